//! Usage ingestion through a real Redis Stream into a real Postgres ledger: ack only after
//! commit, dead-lettering, and a consumer killed mid-batch.

mod common;

use std::time::Duration;

use anyhow::ensure;
use common::{
    Inspect, PgDatabase, REDIS_URL, delete_keys, event, pending, stream_names, wait_until,
};
use redis::AsyncCommands;
use sluice_billing::ingest::{IngestConfig, UsageConsumer, publish_to};
use sluice_billing::{Ledger, UsageEvent};
use tokio::sync::watch;

const DEADLINE: Duration = Duration::from_secs(30);

fn config(consumer: &str, stream: &str, dead: &str, group: &str) -> IngestConfig {
    IngestConfig {
        stream: stream.to_owned(),
        dead_letter_stream: dead.to_owned(),
        group: group.to_owned(),
        batch_size: 100,
        block: Duration::from_millis(200),
        ..IngestConfig::new(consumer)
    }
}

fn events(prefix: &str, n: usize) -> Vec<UsageEvent> {
    (0..n).map(|i| event(&format!("{prefix}-{i:04}"), &format!("tenant-{}", i % 4))).collect()
}

async fn record_count(db: &Inspect) -> anyhow::Result<i64> {
    db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await
}

#[tokio::test]
async fn ingests_through_redis_and_acks_only_after_commit() -> anyhow::Result<()> {
    let pg = PgDatabase::create().await?;
    let (stream, dead, group) = stream_names();
    let client = redis::Client::open(REDIS_URL)?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let db = Inspect::open(&pg.url).await?;
    let mut consumer =
        UsageConsumer::new(client.clone(), ledger.clone(), config("c1", &stream, &dead, &group))
            .await?;

    // Step by step: a read batch is pending, not in the ledger; the commit makes it both
    // stored and acknowledged.
    let first = events("first", 40);
    for e in &first {
        publish_to(&mut redis, &stream, e).await?;
    }
    // The entries are already in the stream, so one read returns them without blocking.
    let Some(batch) = consumer.next_batch().await? else { anyhow::bail!("no batch") };
    ensure!(batch.len() == 40);
    ensure!(pending(&mut redis, &stream, &group).await? == 40);
    ensure!(record_count(&db).await? == 0);
    let (_stop, mut never) = watch::channel(false);
    let summary = consumer.commit(batch, &mut never).await?;
    ensure!(summary.is_some_and(|s| s.inserted == 40 && s.duplicates == 0));
    ensure!(pending(&mut redis, &stream, &group).await? == 0);
    ensure!(record_count(&db).await? == 40);

    // Then the loop: new events, a redelivered duplicate, and two malformed entries.
    let second = events("second", 250);
    for e in &second {
        publish_to(&mut redis, &stream, e).await?;
    }
    publish_to(&mut redis, &stream, &first[0]).await?;
    let _: String = redis.xadd(&stream, "*", &[("event", "{not json")]).await?;
    let _: String = redis.xadd(&stream, "*", &[("other", "field")]).await?;
    let stats = consumer.stats();
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(consumer.run(shutdown));
    wait_until("all entries processed", DEADLINE, || {
        let stats = stats.clone();
        async move { Ok(stats.inserted() == 290 && stats.dead_lettered() == 2) }
    })
    .await?;
    stop.send(true)?;
    task.await??;

    ensure!(stats.duplicates() == 1, "duplicates {}", stats.duplicates());
    ensure!(pending(&mut redis, &stream, &group).await? == 0);
    ensure!(record_count(&db).await? == 290);
    ensure!(
        db.scalar("SELECT CAST(SUM(requests) AS BIGINT) FROM usage_rollups WHERE period = 'day'")
            .await?
            == 290
    );
    let dead_len: usize = redis.xlen(&dead).await?;
    ensure!(dead_len == 2);
    let dead_entries: redis::streams::StreamRangeReply = redis.xrange_all(&dead).await?;
    ensure!(
        dead_entries
            .ids
            .iter()
            .all(|e| e.map.contains_key("source_id") && e.map.contains_key("reason"))
    );

    ledger.close().await;
    db.close().await;
    delete_keys(&mut redis, &[&stream, &dead]).await
}

#[tokio::test]
async fn consumer_killed_mid_batch_loses_and_duplicates_nothing() -> anyhow::Result<()> {
    const N: usize = 300;
    let pg = PgDatabase::create().await?;
    let (stream, dead, group) = stream_names();
    let client = redis::Client::open(REDIS_URL)?;
    let mut redis = client.get_multiplexed_async_connection().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let db = Inspect::open(&pg.url).await?;

    let all = events("crash", N);
    for e in &all {
        publish_to(&mut redis, &stream, e).await?;
    }

    // Consumer A reads a batch and dies before acknowledging it. Half of that batch had
    // already been committed when it died (crash between commit and ack).
    let mut doomed =
        UsageConsumer::new(client.clone(), ledger.clone(), config("a", &stream, &dead, &group))
            .await?;
    let batch = doomed.next_batch().await?;
    let read = batch.as_ref().map_or(0, |b| b.len());
    ensure!(read == 100, "consumer a read {read}");
    ensure!(ledger.insert_batch(&all[..50]).await? == 50);
    drop(batch);
    drop(doomed);
    ensure!(pending(&mut redis, &stream, &group).await? == 100);

    // Consumer B starts, claims A's abandoned entries and ingests everything exactly once.
    let survivor_config =
        IngestConfig { claim_min_idle: Duration::ZERO, ..config("b", &stream, &dead, &group) };
    let survivor = UsageConsumer::new(client.clone(), ledger.clone(), survivor_config).await?;
    let stats = survivor.stats();
    let (stop, shutdown) = watch::channel(false);
    let task = tokio::spawn(survivor.run(shutdown));
    let mut conn = redis.clone();
    let (s, g) = (stream.clone(), group.clone());
    wait_until("every entry stored and acknowledged", DEADLINE, || {
        let mut conn = conn.clone();
        let (s, g, db) = (s.clone(), g.clone(), &db);
        async move {
            Ok(record_count(db).await? == N as i64 && pending(&mut conn, &s, &g).await? == 0)
        }
    })
    .await?;
    stop.send(true)?;
    task.await??;

    ensure!(stats.claimed() >= 100, "claimed {}", stats.claimed());
    ensure!(stats.inserted() == (N - 50) as u64, "inserted {}", stats.inserted());
    ensure!(stats.duplicates() == 50, "duplicates {}", stats.duplicates());
    ensure!(
        db.scalar("SELECT CAST(COUNT(DISTINCT request_id) AS BIGINT) FROM request_records").await?
            == N as i64
    );
    for period in ["hour", "day"] {
        let requests = db
            .scalar(&format!(
                "SELECT CAST(SUM(requests + refused_requests) AS BIGINT) FROM usage_rollups \
                 WHERE period = '{period}'"
            ))
            .await?;
        ensure!(requests == N as i64, "{period} rollups count {requests}");
    }
    ensure!(pending(&mut conn, &stream, &group).await? == 0);
    ledger.close().await;
    db.close().await;
    delete_keys(&mut redis, &[&stream, &dead]).await
}
