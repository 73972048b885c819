//! Ledger store against real Postgres and a real SQLite file: migrations, idempotent inserts,
//! rollups counted once, large batches.

mod common;

use std::time::Instant;

use anyhow::ensure;
use chrono::TimeDelta;
use common::{Inspect, PgDatabase, SqliteFile, event};
use sluice_billing::{Backend, BillingError, FinishReason, Ledger};

const TABLES: [&str; 7] = [
    "tenants",
    "api_keys",
    "quotas",
    "request_records",
    "usage_rollups",
    "admin_audit_log",
    "adapters",
];

const REQUEST_RECORD_COLUMNS: [&str; 39] = [
    "request_id",
    "idempotency_key",
    "tenant_id",
    "key_id",
    "model_id",
    "model_revision",
    "tokenizer_revision",
    "chat_template_version",
    "adapter",
    "engine_version",
    "engine_worker",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "finish_reason",
    "http_status",
    "error_type",
    "client_disconnected",
    "arrival_at",
    "first_token_at",
    "last_token_at",
    "ttft_ms",
    "tpot_ms",
    "itl_max_ms",
    "itl_p99_ms",
    "e2e_ms",
    "engine_queue_ms",
    "engine_prefill_ms",
    "engine_decode_ms",
    "trace_id",
    "prompt_sha256",
    "prompt_chars",
    "cost_micros",
    "ingested_at",
    "price_list_version",
    "price_input_micros",
    "price_cached_input_micros",
    "price_output_micros",
    "user_sha256",
];

/// Applies migrations twice (the second run is a no-op) and checks both backends end up with
/// the same tables and columns.
async fn check_migrations(url: &str, backend: Backend) -> anyhow::Result<Vec<Vec<String>>> {
    let ledger = Ledger::connect(url).await?;
    ensure!(ledger.backend() == backend);
    ledger.close().await;
    let ledger = Ledger::connect(url).await?;
    ledger.close().await;

    let db = Inspect::open(url).await?;
    // Every embedded migration applied once (0001 ledger, 0002 key limits, 0003 refused usage,
    // 0004 price list, 0005 partitioned records, 0006 user sha256, 0007 adapters), also on
    // reconnect.
    ensure!(db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM _sqlx_migrations").await? == 7);
    let mut columns = Vec::new();
    for table in TABLES {
        ensure!(db.scalar(&format!("SELECT CAST(COUNT(*) AS BIGINT) FROM {table}")).await? == 0);
        columns.push(db.columns(table).await?);
    }
    ensure!(columns[3] == REQUEST_RECORD_COLUMNS, "request_records columns: {:?}", columns[3]);
    db.close().await;
    Ok(columns)
}

#[tokio::test]
async fn migrations_apply_on_both_backends_and_stay_in_step() -> anyhow::Result<()> {
    let pg = PgDatabase::create().await?;
    let sqlite = SqliteFile::create()?;
    let pg_columns = check_migrations(&pg.url, Backend::Postgres).await?;
    let sqlite_columns = check_migrations(&sqlite.url, Backend::Sqlite).await?;
    ensure!(pg_columns == sqlite_columns, "{pg_columns:?}\n!=\n{sqlite_columns:?}");
    Ok(())
}

#[tokio::test]
async fn unsupported_url_is_refused() -> anyhow::Result<()> {
    let result = Ledger::connect("mysql://localhost/db").await;
    ensure!(matches!(result, Err(BillingError::UnsupportedUrl)));
    Ok(())
}

async fn check_idempotency(url: &str) -> anyhow::Result<()> {
    let ledger = Ledger::connect(url).await?;
    let a = event("req-a", "t1");
    ensure!(ledger.insert_batch(std::slice::from_ref(&a)).await? == 1);
    // Same request id again, alone and twice within one batch: nothing new.
    ensure!(ledger.insert_batch(std::slice::from_ref(&a)).await? == 0);
    ensure!(ledger.insert_batch(&[a.clone(), a.clone()]).await? == 0);

    let mut b = event("req-b", "t1");
    b.idempotency_key = Some("idem-1".to_owned());
    // A client retry: new request id, same Idempotency-Key, same tenant -> ignored.
    let mut b_retry = event("req-b-retry", "t1");
    b_retry.idempotency_key = Some("idem-1".to_owned());
    b_retry.completion_tokens = 999;
    // The same key under another tenant is a different request.
    let mut c = event("req-c", "t2");
    c.idempotency_key = Some("idem-1".to_owned());
    ensure!(ledger.insert_batch(&[b, b_retry.clone(), c]).await? == 2);
    ensure!(ledger.insert_batch(std::slice::from_ref(&b_retry)).await? == 0);

    // A disconnected request, billed for what it produced, in the next hour bucket.
    let mut d = event("req-d", "t1");
    d.arrival_at += TimeDelta::hours(1);
    d.first_token_at = None;
    d.last_token_at = None;
    d.finish_reason = FinishReason::ClientDisconnected;
    d.client_disconnected = true;
    d.http_status = 499;
    d.completion_tokens = 0;
    // A refused request (429 at admission): its row records the prompt; the rollups count it
    // apart from billed usage.
    let mut r = event("req-r", "t2");
    r.finish_reason = FinishReason::Rejected;
    r.http_status = 429;
    r.completion_tokens = 0;
    r.cost_micros = 0;
    ensure!(ledger.insert_batch(&[d, r]).await? == 2);
    ledger.close().await;

    let db = Inspect::open(url).await?;
    ensure!(db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == 5);
    ensure!(
        db.scalar(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM request_records WHERE request_id = 'req-b-retry'"
        )
        .await?
            == 0
    );
    let sum = |period: &str, column: &str, tenant: &str| {
        format!(
            "SELECT CAST(COALESCE(SUM({column}), 0) AS BIGINT) FROM usage_rollups \
             WHERE period = '{period}' AND tenant_id = '{tenant}'"
        )
    };
    for period in ["hour", "day"] {
        ensure!(db.scalar(&sum(period, "requests", "t1")).await? == 3, "{period} requests t1");
        ensure!(db.scalar(&sum(period, "requests", "t2")).await? == 1, "{period} requests t2");
        ensure!(db.scalar(&sum(period, "refused_requests", "t2")).await? == 1, "{period} t2");
        ensure!(db.scalar(&sum(period, "prompt_tokens", "t2")).await? == 100, "{period} t2");
        ensure!(db.scalar(&sum(period, "refused_requests", "t1")).await? == 0, "{period} t1");
        ensure!(db.scalar(&sum(period, "prompt_tokens", "t1")).await? == 300);
        ensure!(db.scalar(&sum(period, "cached_prompt_tokens", "t1")).await? == 60);
        ensure!(db.scalar(&sum(period, "completion_tokens", "t1")).await? == 100);
        ensure!(db.scalar(&sum(period, "cost_micros", "t1")).await? == 3 * 1_234);
    }
    ensure!(
        db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM usage_rollups WHERE period = 'hour'")
            .await?
            == 3,
        "t1 has two hour buckets, t2 one"
    );
    ensure!(
        db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM usage_rollups WHERE period = 'day'")
            .await?
            == 2
    );
    ensure!(
        db.scalar(
            "SELECT CAST(COUNT(*) AS BIGINT) FROM request_records \
             WHERE request_id = 'req-d' AND client_disconnected AND first_token_at IS NULL \
             AND finish_reason = 'client_disconnected' AND http_status = 499"
        )
        .await?
            == 1
    );
    db.close().await;
    Ok(())
}

#[tokio::test]
async fn inserts_are_idempotent_on_postgres() -> anyhow::Result<()> {
    let pg = PgDatabase::create().await?;
    check_idempotency(&pg.url).await
}

#[tokio::test]
async fn inserts_are_idempotent_on_sqlite() -> anyhow::Result<()> {
    let sqlite = SqliteFile::create()?;
    check_idempotency(&sqlite.url).await
}

async fn check_large_batch(url: &str, label: &str) -> anyhow::Result<()> {
    const N: usize = 1_000;
    let ledger = Ledger::connect(url).await?;
    let events: Vec<_> = (0..N)
        .map(|i| {
            let mut e = event(&format!("req-{i:05}"), &format!("tenant-{}", i % 3));
            e.model_id = format!("model-{}", i % 2);
            e.arrival_at += TimeDelta::minutes((i % 300) as i64);
            e.first_token_at = None;
            e.last_token_at = None;
            e.cost_micros = i as u64;
            e
        })
        .collect();
    let start = Instant::now();
    let inserted = ledger.insert_batch(&events).await?;
    let elapsed = start.elapsed();
    eprintln!("{label}: inserted {inserted} records in one batch in {elapsed:?}");
    ensure!(inserted == N);
    ensure!(ledger.insert_batch(&events).await? == 0, "replaying the batch inserts nothing");
    ledger.close().await;

    let db = Inspect::open(url).await?;
    let expected_cost = (0..N as i64).sum::<i64>();
    ensure!(db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == N as i64);
    ensure!(
        db.scalar("SELECT CAST(SUM(cost_micros) AS BIGINT) FROM request_records").await?
            == expected_cost
    );
    for period in ["hour", "day"] {
        let requests = db
            .scalar(&format!(
                "SELECT CAST(SUM(requests) AS BIGINT) FROM usage_rollups WHERE period = '{period}'"
            ))
            .await?;
        ensure!(requests == N as i64, "{period} rollups count {requests} requests");
        let cost = db
            .scalar(&format!(
                "SELECT CAST(SUM(cost_micros) AS BIGINT) FROM usage_rollups \
                 WHERE period = '{period}'"
            ))
            .await?;
        ensure!(cost == expected_cost, "{period} rollups cost {cost}");
    }
    // 3 tenants x 2 models (i % 6 fixes both) over 5 hours starting at 10:15 -> 6 hour buckets.
    ensure!(
        db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM usage_rollups WHERE period = 'hour'")
            .await?
            == 6 * 6
    );
    db.close().await;
    Ok(())
}

#[tokio::test]
async fn batch_of_1000_on_postgres() -> anyhow::Result<()> {
    let pg = PgDatabase::create().await?;
    check_large_batch(&pg.url, "postgres").await
}

#[tokio::test]
async fn batch_of_1000_on_sqlite() -> anyhow::Result<()> {
    let sqlite = SqliteFile::create()?;
    check_large_batch(&sqlite.url, "sqlite").await
}

#[tokio::test]
async fn invalid_events_are_refused_before_any_write() -> anyhow::Result<()> {
    let sqlite = SqliteFile::create()?;
    let ledger = Ledger::connect(&sqlite.url).await?;
    let mut bad = event("req-bad", "t1");
    bad.cached_prompt_tokens = bad.prompt_tokens + 1;
    let result = ledger.insert_batch(&[event("req-good", "t1"), bad]).await;
    ensure!(matches!(result, Err(BillingError::InvalidEvent(_))));
    ensure!(!result.as_ref().is_err_and(BillingError::is_retryable));
    let mut bad_hash = event("req-bad-hash", "t1");
    bad_hash.prompt_sha256 = "not a hash".to_owned();
    ensure!(matches!(ledger.insert_batch(&[bad_hash]).await, Err(BillingError::InvalidEvent(_))));
    // A cost with no price list to recompute it from, or a rate past the column's range.
    let mut unpriced = event("req-unpriced", "t1");
    unpriced.price_list_version = String::new();
    let mut huge = event("req-huge-rate", "t1");
    huge.price_output_micros = u64::MAX;
    for bad in [unpriced, huge] {
        let result = ledger.insert_batch(&[bad]).await;
        ensure!(matches!(result, Err(BillingError::InvalidEvent(_))), "{result:?}");
    }
    ledger.close().await;
    let db = Inspect::open(&sqlite.url).await?;
    ensure!(db.scalar("SELECT CAST(COUNT(*) AS BIGINT) FROM request_records").await? == 0);
    db.close().await;
    Ok(())
}
