//! Fair admission across two gateway replicas through a real Redis: each sees the other's
//! requests in flight, a tenant whose load is split over both is judged by all of it, a
//! stopped replica drops out when its figures expire, and with Redis down each judges alone
//! until it is back.

mod common;

use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, ensure};
use common::{RedisServer, connect, free_port};
use sluice_gateway::fair::{FairShare, Slot};
use sluice_gateway::fair_peers::FairPeers;

/// A replica: its admission and its part in the exchange.
struct Replica {
    fair: Arc<FairShare>,
    peers: FairPeers,
}

impl Replica {
    fn new(conn: sluice_policies::redis_conn::RedisConn, prefix: &str) -> Self {
        let fair = Arc::new(FairShare::default());
        // The service time known (6 s a request), so a backlog is judged.
        for _ in 0..8 {
            fair.served(6.0);
        }
        Replica { fair, peers: FairPeers::new(conn, prefix) }
    }

    /// One exchange, its result handed to the admission as the sync task does.
    async fn exchange(&self) -> bool {
        let peers = self.peers.exchange(&self.fair).await.ok();
        let ok = peers.is_some();
        self.fair.set_peers(peers);
        ok
    }

    fn admit(&self, tenant: &str) -> Option<Slot> {
        // A prompt of 128 tokens; no prefill rate is known, so places alone judge.
        self.fair.admit(tenant, 1, 1, 128, Some(Duration::from_secs(1)), Some(12)).ok()
    }
}

/// Admits the flood alternately at `a` and `b`, both exchanging after every admission,
/// until both refuse.
async fn flood(a: &Replica, b: &Replica) -> Vec<Slot> {
    let mut held = Vec::new();
    let mut refused = [false, false];
    while !refused.iter().all(|r| *r) {
        for (i, r) in [a, b].into_iter().enumerate() {
            match r.admit("flood") {
                Some(slot) => held.push(slot),
                None => refused[i] = true,
            }
            a.exchange().await;
            b.exchange().await;
        }
    }
    held
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_judge_a_split_flood_as_one_and_alone_without_redis() -> anyhow::Result<()> {
    let port = free_port()?;
    let server = RedisServer::start(port)?;
    let conn = connect(port).await?;
    let prefix = format!("test-{}", uuid::Uuid::new_v4().simple());
    let (a, b) = (Replica::new(conn.clone(), &prefix), Replica::new(conn.clone(), &prefix));
    // A quiet tenant (weight 1, as the flood) has a request in flight at a; b learns of it.
    let quiet = a.admit("quiet").context("the quiet tenant is admitted")?;
    ensure!(a.exchange().await && b.exchange().await, "the exchange failed");
    ensure!(b.fair.in_flight_everywhere("quiet") == 1, "b does not see a's request");
    ensure!(b.fair.in_flight("quiet") == 0 && b.fair.peer_replicas() == 1);
    // Of 12 places the flood has 6 and the queue that starts within 1 s: 7, split over both
    // replicas as one replica would admit them.
    let held = flood(&a, &b).await;
    ensure!(held.len() == 7, "{} admitted over two replicas, not 7", held.len());
    ensure!(a.fair.in_flight("flood") + b.fair.in_flight("flood") == 7);
    // Places given back at one replica are seen at the other.
    drop(held);
    drop(quiet);
    ensure!(a.exchange().await && b.exchange().await);
    ensure!(b.fair.in_flight_everywhere("flood") == 0 && b.fair.in_flight_everywhere("quiet") == 0);
    // A replica that stops exchanging drops out when its figures expire (1.5 s).
    let c = Replica::new(conn.clone(), &prefix);
    let _held_at_c = c.admit("flood").context("c admits")?;
    ensure!(c.exchange().await && a.exchange().await);
    ensure!(a.fair.in_flight_everywhere("flood") == 1 && a.fair.peer_replicas() == 2);
    tokio::time::sleep(Duration::from_millis(1700)).await;
    ensure!(b.exchange().await && a.exchange().await);
    ensure!(a.fair.in_flight_everywhere("flood") == 0, "a stopped replica's figures stand");
    ensure!(a.fair.peer_replicas() == 1, "{} peers", a.fair.peer_replicas());
    // Redis down: the exchange fails and each replica judges by its own requests: a gives
    // the flood 7 beside the quiet tenant's request, b, which holds none of the quiet
    // tenant's, its whole 12 places and the queue, 14.
    let quiet = a.admit("quiet").context("the quiet tenant is admitted")?;
    drop(server);
    ensure!(!a.exchange().await && !b.exchange().await, "an exchange without Redis");
    let mut alone = Vec::new();
    while let Some(s) = a.admit("flood") {
        alone.push(s);
    }
    let at_a = alone.len();
    while let Some(s) = b.admit("flood") {
        alone.push(s);
    }
    ensure!(
        (at_a, alone.len() - at_a) == (7, 14),
        "judged alone: {at_a} and {}",
        alone.len() - at_a
    );
    // Redis back: together again.
    let _server = RedisServer::start(port)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !(a.exchange().await && b.exchange().await) {
        ensure!(std::time::Instant::now() < deadline, "no exchange 10 s after Redis came back");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        b.fair.in_flight_everywhere("flood") == 21 && b.fair.in_flight_everywhere("quiet") == 1
    );
    // b's own flood requests end: alone it would admit the flood again, but a still holds
    // the flood's 7 beside the quiet tenant's request, and b sees them.
    alone.truncate(at_a);
    ensure!(a.exchange().await && b.exchange().await);
    ensure!(b.fair.in_flight("flood") == 0 && b.fair.in_flight_everywhere("flood") == 7);
    ensure!(b.admit("flood").is_none(), "b admits past the flood's share of both");
    drop(quiet);
    Ok(())
}
