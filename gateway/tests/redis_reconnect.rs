//! A Redis connection comes back after an outage longer than a few reconnection attempts: the
//! gateway's limiter, idempotency claims and usage stream share one, and must not stay
//! wedged once Redis is back.

mod common;

use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{RedisServer, connect, free_port};
use sluice_policies::redis_conn::RedisConn;

async fn ping(conn: &mut RedisConn) -> bool {
    let cmd = redis::cmd("PING");
    matches!(
        tokio::time::timeout(Duration::from_secs(1), cmd.query_async::<String>(conn)).await,
        Ok(Ok(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_connection_recovers_after_a_long_outage() -> anyhow::Result<()> {
    let port = free_port()?;
    let server = RedisServer::start(port)?;
    let mut conn = connect(port).await?;
    ensure!(ping(&mut conn).await, "no answer before the outage");
    drop(server);
    // Ten seconds of outage, used all along (admissions keep trying).
    let outage = Instant::now() + Duration::from_secs(10);
    while Instant::now() < outage {
        ensure!(!ping(&mut conn).await, "an answer from a stopped server");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _server = RedisServer::start(port)?;
    let back = Instant::now();
    while !ping(&mut conn).await {
        ensure!(
            back.elapsed() < Duration::from_secs(10),
            "still no answer 10 s after Redis came back"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    eprintln!("answering again {:?} after Redis came back", back.elapsed());
    Ok(())
}
