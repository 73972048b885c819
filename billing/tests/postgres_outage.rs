//! Postgres goes down while events keep arriving: the consumer retries with backoff, keeps the
//! batch pending, and once Postgres is back every event lands exactly once.
//!
//! This stops the machine's Postgres cluster, so it lives in its own test binary, holds the
//! Postgres test lock exclusively (other billing Postgres tests hold it shared), and a guard
//! restarts the cluster on every exit path, failures included.

mod common;

use std::time::{Duration, Instant};

use anyhow::ensure;
use common::{
    Inspect, PgDatabase, PostgresStopped, REDIS_URL, delete_keys, event, pending, stream_names,
    wait_until,
};
use sluice_billing::ingest::{IngestConfig, UsageConsumer, publish_to};
use sluice_billing::{Ledger, LedgerOptions};
use tokio::sync::watch;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_outage_delays_ingestion_but_loses_and_duplicates_nothing() -> anyhow::Result<()> {
    const BEFORE: usize = 100;
    const DURING: usize = 200;
    let _exclusive = common::postgres_lock(true).await?;
    let pg = PgDatabase::create_unlocked().await?;
    let (stream, dead, group) = stream_names();
    let client = redis::Client::open(REDIS_URL)?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let options =
        LedgerOptions { acquire_timeout: Duration::from_millis(500), ..LedgerOptions::default() };
    let ledger = Ledger::connect_with(&pg.url, &options).await?;
    let config = IngestConfig {
        stream: stream.clone(),
        dead_letter_stream: dead.clone(),
        group: group.clone(),
        block: Duration::from_millis(200),
        retry_initial: Duration::from_millis(50),
        retry_max: Duration::from_millis(800),
        ..IngestConfig::new("outage")
    };
    let consumer = UsageConsumer::new(client.clone(), ledger.clone(), config).await?;
    let stats = consumer.stats();
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(consumer.run(shutdown));

    let events: Vec<_> = (0..BEFORE + DURING)
        .map(|i| event(&format!("outage-{i:04}"), &format!("tenant-{}", i % 3)))
        .collect();
    for e in &events[..BEFORE] {
        publish_to(&mut redis, &stream, e).await?;
    }
    let deadline = Duration::from_secs(60);
    wait_until("events before the outage", deadline, || {
        let stats = stats.clone();
        async move { Ok(stats.inserted() == BEFORE as u64) }
    })
    .await?;

    let outage = Instant::now();
    let mut postgres = PostgresStopped::stop()?;
    for e in &events[BEFORE..] {
        publish_to(&mut redis, &stream, e).await?;
    }
    wait_until("the consumer retrying against the stopped database", deadline, || {
        let stats = stats.clone();
        async move { Ok(stats.database_failures() >= 3) }
    })
    .await?;
    let unacked = pending(&mut redis, &stream, &group).await?;
    ensure!(unacked > 0, "events read during the outage must stay pending");
    ensure!(stats.inserted() == BEFORE as u64);
    let failures_during_outage = stats.database_failures();
    postgres.start()?;
    let down_for = outage.elapsed();

    let restarted = Instant::now();
    let db = Inspect::open(&pg.url).await?;
    let (s, g) = (stream.clone(), group.clone());
    wait_until("every event stored and acknowledged", deadline, || {
        let mut conn = redis.clone();
        let (s, g, db) = (s.clone(), g.clone(), &db);
        async move {
            let stored = db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await?;
            Ok(stored == (BEFORE + DURING) as i64 && pending(&mut conn, &s, &g).await? == 0)
        }
    })
    .await?;
    let drained_in = restarted.elapsed();
    stop.send(true)?;
    task.await??;
    eprintln!(
        "outage: Postgres down {down_for:?}, {failures_during_outage} failed writes retried \
         ({unacked} entries pending meanwhile), all {} events stored {drained_in:?} after restart",
        BEFORE + DURING
    );

    ensure!(stats.inserted() == (BEFORE + DURING) as u64, "inserted {}", stats.inserted());
    ensure!(stats.dead_lettered() == 0);
    ensure!(
        db.scalar("SELECT CAST(SUM(requests) AS BIGINT) FROM usage_rollups WHERE period = 'hour'")
            .await?
            == (BEFORE + DURING) as i64
    );
    ledger.close().await;
    db.close().await;
    delete_keys(&mut redis, &[&stream, &dead]).await
}
