//! In-process ingestion into SQLite (the `sluice up` path): every event exactly once, through
//! a locked database and concurrent emitters, and nothing left behind at shutdown.

mod common;

use std::time::Duration;

use common::{Inspect, SqliteFile, event};
use sluice_billing::local::{LocalIngest, LocalIngestConfig};
use sluice_billing::{Ledger, LedgerOptions};
use sqlx::{Connection, Executor, SqliteConnection};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_event_lands_once_even_while_the_database_is_locked() -> anyhow::Result<()> {
    let file = SqliteFile::create()?;
    // A short busy timeout makes writes fail (and be retried) while the lock is held.
    let options =
        LedgerOptions { acquire_timeout: Duration::from_millis(100), ..Default::default() };
    let ledger = Ledger::connect_with(&file.url, &options).await?;
    let ingest = std::sync::Arc::new(LocalIngest::start(
        ledger.clone(),
        LocalIngestConfig { queue: 64, ..Default::default() },
    ));
    // Another connection holds an exclusive lock for 1.5 s while events pour in.
    let mut locker = SqliteConnection::connect(&file.url).await?;
    locker.execute("BEGIN EXCLUSIVE").await?;
    let mut emitters = Vec::new();
    for w in 0..4 {
        let ingest = ingest.clone();
        emitters.push(tokio::spawn(async move {
            for i in 0..250 {
                ingest.emit(event(&format!("local-{w}-{i}"), "acme")).await?;
                // A retry of the same request (same id) is billed once.
                if i % 50 == 0 {
                    ingest.emit(event(&format!("local-{w}-{i}"), "acme")).await?;
                }
            }
            anyhow::Ok(())
        }));
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    locker.execute("COMMIT").await?;
    locker.close().await?;
    for e in emitters {
        e.await??;
    }
    let stats = ingest.stats();
    let ingest = std::sync::Arc::try_unwrap(ingest)
        .map_err(|_| anyhow::anyhow!("emitters still hold the ingest"))?;
    ingest.shutdown().await;
    anyhow::ensure!(
        stats.failures() > 0,
        "the lock never made a write fail; the test proves nothing"
    );
    anyhow::ensure!(stats.inserted() == 1000 && stats.duplicates() == 20, "{stats:?}");
    let db = Inspect::open(&file.url).await?;
    anyhow::ensure!(
        db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == 1000
    );
    let rolled = db
        .scalar("SELECT CAST(SUM(requests) AS BIGINT) FROM usage_rollups WHERE period = 'day'")
        .await?;
    anyhow::ensure!(rolled == 1000, "rollups count {rolled}");
    db.close().await;
    ledger.close().await;
    Ok(())
}

#[tokio::test]
async fn invalid_events_are_refused_at_the_door() -> anyhow::Result<()> {
    let file = SqliteFile::create()?;
    let ledger = Ledger::connect(&file.url).await?;
    let ingest = LocalIngest::start(ledger, LocalIngestConfig::default());
    let mut bad = event("x", "acme");
    bad.request_id.clear();
    anyhow::ensure!(ingest.emit(bad).await.is_err());
    ingest.shutdown().await;
    Ok(())
}

/// `(name, nice)` of every thread of this process, from /proc.
fn threads() -> anyhow::Result<Vec<(String, i64)>> {
    let mut out = Vec::new();
    for task in std::fs::read_dir("/proc/self/task")? {
        let path = task?.path();
        let (Ok(comm), Ok(stat)) = (
            std::fs::read_to_string(path.join("comm")),
            std::fs::read_to_string(path.join("stat")),
        ) else {
            continue; // the thread ended meanwhile
        };
        // Field 19 (nice), counted after the parenthesized command name.
        let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
        let nice = rest.split_whitespace().nth(16).and_then(|v| v.parse().ok()).unwrap_or(0);
        out.push((comm.trim().to_owned(), nice));
    }
    Ok(out)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_background_writer_runs_niced_with_its_own_connections_and_loses_nothing()
-> anyhow::Result<()> {
    let file = SqliteFile::create()?;
    let ingest = std::sync::Arc::new(
        LocalIngest::start_background(&file.url, LocalIngestConfig::default()).await?,
    );
    let mut emitters = Vec::new();
    for w in 0..4 {
        let ingest = ingest.clone();
        emitters.push(tokio::spawn(async move {
            for i in 0..100 {
                ingest.emit(event(&format!("bg-{w}-{i}"), "acme")).await?;
            }
            anyhow::Ok(())
        }));
    }
    for e in emitters {
        e.await??;
    }
    ingest.flush().await;
    let threads = threads()?;
    let nice = sluice_billing::local::BACKGROUND_NICE as i64;
    anyhow::ensure!(
        threads.iter().any(|(n, v)| n == "sluice-usage" && *v == nice),
        "no writer thread at nice {nice}: {threads:?}"
    );
    // The writer's SQLite connections were opened from its thread: their workers inherit it.
    anyhow::ensure!(
        threads.iter().any(|(n, v)| n.starts_with("sqlx-sqlite") && *v == nice),
        "no SQLite worker at nice {nice}: {threads:?}"
    );
    let stats = ingest.stats();
    let ingest = std::sync::Arc::try_unwrap(ingest)
        .map_err(|_| anyhow::anyhow!("emitters still hold the ingest"))?;
    ingest.shutdown().await;
    anyhow::ensure!(stats.inserted() == 400 && stats.duplicates() == 0, "{stats:?}");
    let db = Inspect::open(&file.url).await?;
    anyhow::ensure!(
        db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == 400
    );
    db.close().await;

    // A database it cannot open is an error at start, not a writer that silently never writes.
    let bad = LocalIngest::start_background("mysql://nowhere", LocalIngestConfig::default()).await;
    anyhow::ensure!(bad.is_err(), "a bad URL started a writer");
    Ok(())
}
