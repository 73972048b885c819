//! Fair admission across gateway replicas, through Redis. Every [`SYNC_EVERY`] each replica
//! writes what it has in flight and has served, per tenant ([`FairShare::published`]), under a
//! key of its own that expires unless rewritten, lists itself in the set of replicas, and reads
//! every other replica's key; their sum is the view [`FairShare`] judges by beside its own. A
//! replica that stops (killed, partitioned) drops out when its key expires; while Redis cannot
//! be reached each replica judges by its own requests alone, and again together once it can.
//!
//! The keys share one hash tag (`PREFIX:{fair}:...`), so a Redis Cluster serves them from one
//! slot. Nothing in them names a key or holds prompt text: tenant ids and counts.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use sluice_policies::redis_conn::RedisConn;

use crate::fair::{FairShare, Peers, Published};
use crate::journal::timed;

/// How often a replica publishes its figures and reads the others'.
pub const SYNC_EVERY: Duration = Duration::from_millis(100);

/// How long a replica's figures stand without being rewritten.
const PUBLISHED_FOR: Duration = Duration::from_millis(1500);

/// How long the set of replicas stands once none of them writes (every exchange renews it).
const MEMBERS_FOR: Duration = Duration::from_secs(60);

/// One replica's part in the exchange.
#[derive(Clone, Debug)]
pub struct FairPeers {
    conn: RedisConn,
    prefix: String,
    id: String,
}

impl FairPeers {
    /// A replica with a fresh id among those under `prefix` (the limits' prefix).
    pub fn new(conn: RedisConn, prefix: &str) -> Self {
        Self { conn, prefix: prefix.to_owned(), id: uuid::Uuid::new_v4().simple().to_string() }
    }

    fn key(&self, id: &str) -> String {
        format!("{}:{{fair}}:replica:{id}", self.prefix)
    }

    fn members_key(&self) -> String {
        format!("{}:{{fair}}:replicas", self.prefix)
    }

    /// Publishes `fair`'s figures and reads the other replicas'; the ids whose figures have
    /// expired leave the set.
    pub async fn exchange(&self, fair: &FairShare) -> redis::RedisResult<Peers> {
        let mine = serde_json::to_string(&fair.published()).unwrap_or_else(|_| "{}".into());
        let mut conn = self.conn.clone();
        let mut publish = redis::pipe();
        publish
            .cmd("SET")
            .arg(self.key(&self.id))
            .arg(mine)
            .arg("PX")
            .arg(PUBLISHED_FOR.as_millis() as u64)
            .ignore()
            .cmd("SADD")
            .arg(self.members_key())
            .arg(&self.id)
            .ignore()
            .cmd("PEXPIRE")
            .arg(self.members_key())
            .arg(MEMBERS_FOR.as_millis() as u64)
            .ignore()
            .cmd("SMEMBERS")
            .arg(self.members_key());
        let (members,): (Vec<String>,) = timed(publish.query_async(&mut conn)).await?;
        let others: Vec<&String> = members.iter().filter(|m| **m != self.id).collect();
        let mut peers = Peers::default();
        if others.is_empty() {
            return Ok(peers);
        }
        let keys: Vec<String> = others.iter().map(|id| self.key(id)).collect();
        let read = redis::cmd("MGET").arg(&keys).clone();
        let values: Vec<Option<String>> = timed(read.query_async(&mut conn)).await?;
        let mut gone = Vec::new();
        for (id, value) in others.iter().zip(values) {
            let parsed = value.as_deref().map(serde_json::from_str::<HashMap<String, Published>>);
            match parsed {
                Some(Ok(replica)) => peers.add(&replica),
                // Expired: the replica stopped.
                None => gone.push(id.as_str()),
                // Unreadable: not one of ours (another version's); skipped and forgotten.
                Some(Err(e)) => {
                    tracing::warn!(replica = %id, error = %e, "unreadable fair-share figures");
                    gone.push(id.as_str());
                }
            }
        }
        if !gone.is_empty() {
            let forget = redis::cmd("SREM").arg(self.members_key()).arg(&gone).clone();
            timed(forget.query_async::<()>(&mut conn)).await?;
        }
        Ok(peers)
    }

    /// Exchanges on `io` for as long as the process lives; a failed exchange leaves `fair`
    /// judging alone until the next succeeds.
    pub fn spawn(self, fair: Arc<FairShare>, io: &tokio::runtime::Handle) {
        io.spawn(async move {
            let mut alone = false;
            loop {
                match self.exchange(&fair).await {
                    Ok(peers) => {
                        if alone {
                            tracing::info!("fair admission judges with the other replicas again");
                        }
                        alone = false;
                        fair.set_peers(Some(peers));
                    }
                    Err(e) => {
                        if !alone {
                            tracing::warn!(error = %e, "fair admission judges alone: Redis unreachable");
                        }
                        alone = true;
                        fair.set_peers(None);
                    }
                }
                tokio::time::sleep(SYNC_EVERY).await;
            }
        });
    }
}
