//! The benchmark functions against the real Postgres and Redis: their reports must account for
//! every event exactly once. Consistency only; speed is never asserted here.

mod common;

use anyhow::ensure;
use common::{Inspect, PgDatabase, REDIS_URL};
use sluice_billing::Ledger;
use sluice_billing::bench::{LatencySummary, bench_ingest, bench_insert};

fn ordered(s: &LatencySummary) -> bool {
    0.0 <= s.p50_ms && s.p50_ms <= s.p99_ms && s.p99_ms <= s.max_ms
}

async fn record_count(db: &Inspect) -> anyhow::Result<i64> {
    db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await
}

#[tokio::test]
async fn insert_and_ingest_reports_account_for_every_record() -> anyhow::Result<()> {
    let pg = PgDatabase::create().await?;
    let ledger = Ledger::connect(&pg.url).await?;
    let db = Inspect::open(&pg.url).await?;

    let insert = bench_insert(&ledger, 2_000, 300).await?;
    ensure!(insert.records == 2_000 && insert.inserted == 2_000, "{insert:?}");
    ensure!(insert.batches == 7 && insert.commit_latency.samples == 7, "{insert:?}");
    ensure!(ordered(&insert.commit_latency), "{insert:?}");
    ensure!(insert.records_per_second > 0.0, "{insert:?}");
    ensure!(record_count(&db).await? == 2_000, "rows after the insert run");
    let requests: i64 = db
        .scalar(
            "SELECT CAST(SUM(requests + refused_requests) AS BIGINT) FROM usage_rollups \
             WHERE period = 'day'",
        )
        .await?;
    ensure!(requests == 2_000, "day rollups count {requests} requests");

    let stream = format!("{{bench-test-{}}}:usage", uuid::Uuid::new_v4().simple());
    let client = redis::Client::open(REDIS_URL)?;
    let ingest = bench_ingest(client.clone(), ledger.clone(), &stream, 2_000.0, 2_000).await?;
    ensure!(ingest.records == 2_000 && ingest.committed == 2_000, "{ingest:?}");
    ensure!(ingest.inserted == 2_000 && ingest.duplicates == 0, "{ingest:?}");
    ensure!(ingest.dead_lettered == 0 && ingest.batches >= 1, "{ingest:?}");
    ensure!(ingest.lag.samples == 2_000 && ordered(&ingest.lag), "{ingest:?}");
    ensure!(ingest.achieved_publish_rate_per_s > 0.0, "{ingest:?}");
    ensure!(record_count(&db).await? == 4_000, "rows after the ingest run");
    let distinct: i64 =
        db.scalar("SELECT CAST(COUNT(DISTINCT request_id) AS BIGINT) FROM request_records").await?;
    ensure!(distinct == 4_000, "{distinct} distinct request ids");

    // The scratch stream and its dead-letter stream are gone.
    let mut conn = client.get_multiplexed_async_connection().await?;
    let exists: usize =
        redis::AsyncCommands::exists(&mut conn, &[stream.clone(), format!("{stream}:dead")])
            .await?;
    ensure!(exists == 0, "bench streams left behind");

    db.close().await;
    ledger.close().await;
    Ok(())
}
