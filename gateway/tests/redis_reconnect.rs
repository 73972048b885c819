//! A Redis connection comes back after an outage longer than a few reconnection attempts: the
//! gateway's limiter, idempotency claims and usage stream share one, and must not stay
//! wedged once Redis is back.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use sluice_billing::redis_conn::{RedisConn, RedisTarget};

struct RedisServer(Child);

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start(port: u16) -> anyhow::Result<RedisServer> {
    Ok(RedisServer(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no"])
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server is needed for this test")?,
    ))
}

async fn ping(conn: &mut RedisConn) -> bool {
    let cmd = redis::cmd("PING");
    matches!(
        tokio::time::timeout(Duration::from_secs(1), cmd.query_async::<String>(conn)).await,
        Ok(Ok(_))
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shared_connection_recovers_after_a_long_outage() -> anyhow::Result<()> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let server = start(port)?;
    let client = RedisTarget::open(&format!("redis://127.0.0.1:{port}"))?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut conn = loop {
        match client.connect().await {
            Ok(c) => break c,
            Err(e) => {
                ensure!(Instant::now() < deadline, "redis-server did not start: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    ensure!(ping(&mut conn).await, "no answer before the outage");
    drop(server);
    // Ten seconds of outage, used all along (admissions keep trying).
    let outage = Instant::now() + Duration::from_secs(10);
    while Instant::now() < outage {
        ensure!(!ping(&mut conn).await, "an answer from a stopped server");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _server = start(port)?;
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
