//! Usage events survive a Redis outage: with the stream's Redis gone, events go straight into
//! the ledger (exactly once, even when the stream delivered a copy before), and nothing is lost.

mod common;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use common::event;
use sluice_billing::Ledger;
use sluice_gateway::sink::{Delivered, UsageSink};
use sluice_policies::redis_conn::RedisTarget;

struct RedisServer(Child);

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn events_reach_the_ledger_when_redis_is_gone() -> anyhow::Result<()> {
    // A Redis of this test's own, so stopping it disturbs nothing else.
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let dir = tempfile_dir()?;
    let server = start_redis(port, &dir)?;
    let url = format!("redis://127.0.0.1:{port}");
    let client = RedisTarget::open(&url)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let conn = loop {
        match client.connect().await {
            Ok(c) => break c,
            Err(e) => {
                ensure!(Instant::now() < deadline, "redis-server did not start: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    };
    let ledger = Ledger::connect(&format!("sqlite://{}", dir.join("ledger.db").display())).await?;
    let sink = UsageSink::Redis {
        conn,
        stream: "{t}:usage".into(),
        fallback: ledger.clone(),
        retrying: Default::default(),
    };
    ensure!(sink.emit(event("a")).await? == Delivered::Primary);
    drop(server);
    for id in ["b", "c"] {
        ensure!(
            sink.emit(event(id)).await? == Delivered::Fallback,
            "{id} not written to the ledger"
        );
    }
    // A request already delivered through the stream and written again is billed once.
    ensure!(ledger.insert_batch(&[event("a")]).await? == 1);
    ensure!(ledger.insert_batch(&[event("a")]).await? == 0);
    let page = ledger
        .records(&sluice_billing::query::RecordFilter { limit: 10, ..Default::default() })
        .await?;
    let ids: Vec<&str> = page.records.iter().filter_map(|r| r["request_id"].as_str()).collect();
    ensure!(ids.len() == 3 && ["a", "b", "c"].iter().all(|i| ids.contains(i)), "{ids:?}");
    ledger.close().await;

    // Both paths down: the event is retried in the background, and `flush` (what the gateway
    // runs before it exits) names it while it is undelivered...
    ensure!(sink.emit(event("d")).await? == Delivered::Retrying);
    let left = sink.flush(Duration::from_millis(300)).await;
    ensure!(left.len() == 1 && left[0].request_id == "d", "{left:?}");
    // ...and waits for it once Redis is back.
    let _server = start_redis(port, &dir)?;
    let left = sink.flush(Duration::from_secs(30)).await;
    ensure!(left.is_empty(), "still undelivered: {left:?}");
    let mut conn = redis::Client::open(url.as_str())?.get_multiplexed_async_connection().await?;
    let entries: redis::streams::StreamRangeReply =
        redis::AsyncCommands::xrange_all(&mut conn, "{t}:usage").await?;
    ensure!(entries.ids.len() == 1, "{} entries in the restarted stream", entries.ids.len());
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn start_redis(port: u16, dir: &std::path::Path) -> anyhow::Result<RedisServer> {
    Ok(RedisServer(
        Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", ""])
            .args(["--appendonly", "no", "--dir"])
            .arg(dir)
            .stdout(Stdio::null())
            .spawn()
            .context("redis-server is needed for this test")?,
    ))
}

fn tempfile_dir() -> anyhow::Result<std::path::PathBuf> {
    let d = std::env::temp_dir().join(format!("sluice-sink-{}", std::process::id()));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}
