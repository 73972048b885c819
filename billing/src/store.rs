//! `Ledger`: the request-records store, over Postgres (production) or SQLite (embedded default).
//!
//! The schema lives in `migrations/{postgres,sqlite}/` at the workspace root. The files are
//! embedded with `include_str!` and applied through sqlx's migrator, so the binary needs no
//! migrations folder at run time and the `_sqlx_migrations` bookkeeping stays compatible with the
//! sqlx CLI run against the same folders.

use std::borrow::Cow;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::str::FromStr;
use std::time::Duration;

use chrono::{DateTime, DurationRound, TimeDelta, Utc};
use sqlx::error::BoxDynError;
use sqlx::migrate::{Migration, MigrationSource, MigrationType, Migrator};
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};
use sqlx::{PgPool, Postgres, QueryBuilder, Row, Sqlite, SqlitePool};

use crate::{BillingError, UsageEvent};

/// One migration compiled into the binary.
#[derive(Debug)]
struct EmbeddedMigration {
    version: i64,
    description: &'static str,
    sql: &'static str,
}

const POSTGRES_MIGRATIONS: &[EmbeddedMigration] = &[
    EmbeddedMigration {
        version: 1,
        description: "ledger",
        sql: include_str!("../../migrations/postgres/0001_ledger.sql"),
    },
    EmbeddedMigration {
        version: 2,
        description: "key limits",
        sql: include_str!("../../migrations/postgres/0002_key_limits.sql"),
    },
    EmbeddedMigration {
        version: 3,
        description: "refused usage",
        sql: include_str!("../../migrations/postgres/0003_refused_usage.sql"),
    },
    EmbeddedMigration {
        version: 4,
        description: "price list",
        sql: include_str!("../../migrations/postgres/0004_price_list.sql"),
    },
    EmbeddedMigration {
        version: 5,
        description: "partitioned records",
        sql: include_str!("../../migrations/postgres/0005_partitioned_records.sql"),
    },
    EmbeddedMigration {
        version: 6,
        description: "user sha256",
        sql: include_str!("../../migrations/postgres/0006_user_sha256.sql"),
    },
    EmbeddedMigration {
        version: 7,
        description: "adapters",
        sql: include_str!("../../migrations/postgres/0007_adapters.sql"),
    },
];

const SQLITE_MIGRATIONS: &[EmbeddedMigration] = &[
    EmbeddedMigration {
        version: 1,
        description: "ledger",
        sql: include_str!("../../migrations/sqlite/0001_ledger.sql"),
    },
    EmbeddedMigration {
        version: 2,
        description: "key limits",
        sql: include_str!("../../migrations/sqlite/0002_key_limits.sql"),
    },
    EmbeddedMigration {
        version: 3,
        description: "refused usage",
        sql: include_str!("../../migrations/sqlite/0003_refused_usage.sql"),
    },
    EmbeddedMigration {
        version: 4,
        description: "price list",
        sql: include_str!("../../migrations/sqlite/0004_price_list.sql"),
    },
    EmbeddedMigration {
        version: 5,
        description: "partitioned records",
        sql: include_str!("../../migrations/sqlite/0005_partitioned_records.sql"),
    },
    EmbeddedMigration {
        version: 6,
        description: "user sha256",
        sql: include_str!("../../migrations/sqlite/0006_user_sha256.sql"),
    },
    EmbeddedMigration {
        version: 7,
        description: "adapters",
        sql: include_str!("../../migrations/sqlite/0007_adapters.sql"),
    },
];

#[derive(Debug, Clone, Copy)]
struct EmbeddedMigrations(&'static [EmbeddedMigration]);

impl MigrationSource<'static> for EmbeddedMigrations {
    fn resolve(
        self,
    ) -> Pin<Box<dyn Future<Output = Result<Vec<Migration>, BoxDynError>> + Send + 'static>> {
        let migrations = self
            .0
            .iter()
            .map(|m| {
                Migration::new(
                    m.version,
                    Cow::Borrowed(m.description),
                    MigrationType::Simple,
                    Cow::Borrowed(m.sql),
                    false,
                )
            })
            .collect();
        Box::pin(std::future::ready(Ok(migrations)))
    }
}

/// Rows per multi-row INSERT, largest first: a batch is cut greedily into statements of these
/// sizes, so only five statement texts ever exist and each stays prepared in the connection's
/// statement cache (a statement per batch size meant re-preparing an INSERT of hundreds of
/// binds for nearly every batch). 38 binds a row keeps the largest well under the bind limits
/// of both backends (Postgres 65,535; SQLite 32,766).
const RECORDS_PER_STATEMENT: [usize; 5] = [256, 64, 16, 4, 1];
/// Rollup rows per upsert statement (10 binds each).
const ROLLUPS_PER_STATEMENT: usize = 1000;

const INSERT_RECORDS_HEAD: &str = "INSERT INTO request_records (request_id, idempotency_key, \
    tenant_id, key_id, model_id, model_revision, tokenizer_revision, chat_template_version, \
    adapter, engine_version, engine_worker, prompt_tokens, cached_prompt_tokens, \
    completion_tokens, finish_reason, http_status, error_type, client_disconnected, arrival_at, \
    first_token_at, last_token_at, ttft_ms, tpot_ms, itl_max_ms, itl_p99_ms, e2e_ms, \
    engine_queue_ms, engine_prefill_ms, engine_decode_ms, trace_id, prompt_sha256, prompt_chars, \
    cost_micros, price_list_version, price_input_micros, price_cached_input_micros, \
    price_output_micros, user_sha256) ";

// No conflict target: a clash on the request id *or* on (tenant_id, idempotency_key) skips the
// row, and RETURNING lists only the rows this statement really inserted.
const INSERT_RECORDS_TAIL: &str = " ON CONFLICT DO NOTHING RETURNING tenant_id, model_id, \
    arrival_at, prompt_tokens, cached_prompt_tokens, completion_tokens, cost_micros, http_status";

const UPSERT_ROLLUPS_HEAD: &str = "INSERT INTO usage_rollups (period, bucket_start, tenant_id, \
    model_id, requests, prompt_tokens, cached_prompt_tokens, completion_tokens, cost_micros, \
    refused_requests) ";

const UPSERT_ROLLUPS_TAIL: &str = " ON CONFLICT (period, bucket_start, tenant_id, model_id) \
    DO UPDATE SET requests = usage_rollups.requests + excluded.requests, \
    prompt_tokens = usage_rollups.prompt_tokens + excluded.prompt_tokens, \
    cached_prompt_tokens = usage_rollups.cached_prompt_tokens + excluded.cached_prompt_tokens, \
    completion_tokens = usage_rollups.completion_tokens + excluded.completion_tokens, \
    cost_micros = usage_rollups.cost_micros + excluded.cost_micros, \
    refused_requests = usage_rollups.refused_requests + excluded.refused_requests";

/// Which database a `Ledger` talks to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// Production store.
    Postgres,
    /// Embedded store for the single-machine default.
    Sqlite,
}

/// Connection settings for [`Ledger::connect_with`].
#[derive(Debug, Clone)]
pub struct LedgerOptions {
    /// Pool size.
    pub max_connections: u32,
    /// How long one operation waits for a connection before failing (retryably); bounds how
    /// long an outage blocks a caller before it sees the error.
    pub acquire_timeout: Duration,
}

impl Default for LedgerOptions {
    fn default() -> Self {
        Self { max_connections: 8, acquire_timeout: Duration::from_secs(5) }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Pool {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

/// The billing ledger. Cheap to clone (shares one pool).
#[derive(Debug, Clone)]
pub struct Ledger {
    pool: Pool,
}

/// Dashboard rollup granularity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Period {
    Hour,
    Day,
}

impl Period {
    fn as_str(self) -> &'static str {
        match self {
            Self::Hour => "hour",
            Self::Day => "day",
        }
    }

    fn bucket_start(self, at: DateTime<Utc>) -> Result<DateTime<Utc>, BillingError> {
        let width = match self {
            Self::Hour => TimeDelta::hours(1),
            Self::Day => TimeDelta::days(1),
        };
        // Truncation counts from the Unix epoch, so day buckets start at UTC midnight.
        at.duration_trunc(width)
            .map_err(|_| BillingError::InvalidEvent("arrival_at is out of range"))
    }
}

/// `events` cut into consecutive runs of [`RECORDS_PER_STATEMENT`] sizes, largest first.
fn statement_chunks<T>(mut events: &[T]) -> Vec<&[T]> {
    let mut out = Vec::new();
    for size in RECORDS_PER_STATEMENT {
        while events.len() >= size {
            let (head, rest) = events.split_at(size);
            out.push(head);
            events = rest;
        }
    }
    out
}

/// Sorted so concurrent writers upsert rollup rows in the same order and cannot deadlock.
type RollupKey = (Period, DateTime<Utc>, String, String);

#[derive(Debug, Default, Clone, Copy)]
struct RollupSums {
    requests: i64,
    prompt_tokens: i64,
    cached_prompt_tokens: i64,
    completion_tokens: i64,
    cost_micros: i64,
    refused_requests: i64,
}

/// Adds one inserted `request_records` row (as RETURNING gave it back) to the rollups.
fn add_to_rollups<R>(
    rollups: &mut BTreeMap<RollupKey, RollupSums>,
    row: &R,
) -> Result<(), BillingError>
where
    R: Row,
    for<'r> String: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i64: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> i32: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    for<'r> DateTime<Utc>: sqlx::Decode<'r, R::Database> + sqlx::Type<R::Database>,
    usize: sqlx::ColumnIndex<R>,
{
    let tenant_id: String = row.try_get(0)?;
    let model_id: String = row.try_get(1)?;
    let arrival_at: DateTime<Utc> = row.try_get(2)?;
    let prompt_tokens: i64 = row.try_get(3)?;
    let cached_prompt_tokens: i64 = row.try_get(4)?;
    let completion_tokens: i64 = row.try_get(5)?;
    let cost_micros: i64 = row.try_get(6)?;
    let http_status: i32 = row.try_get(7)?;
    let refused = u16::try_from(http_status).is_ok_and(crate::event::is_refused);
    for period in [Period::Hour, Period::Day] {
        let key = (period, period.bucket_start(arrival_at)?, tenant_id.clone(), model_id.clone());
        let sums = rollups.entry(key).or_default();
        if refused {
            // Counted apart; its tokens were never served (and its cost is 0).
            sums.refused_requests += 1;
            continue;
        }
        sums.requests += 1;
        sums.prompt_tokens += prompt_tokens;
        sums.cached_prompt_tokens += cached_prompt_tokens;
        sums.completion_tokens += completion_tokens;
        sums.cost_micros = sums.cost_micros.saturating_add(cost_micros);
    }
    Ok(())
}

/// The same statements for both backends; only the pool and `QueryBuilder` types differ, which
/// sqlx's generic bounds make far noisier to express as a generic function than as a macro.
macro_rules! insert_batch_on {
    ($name:ident, $db:ty, $pool:ty) => {
        async fn $name(pool: &$pool, events: &[UsageEvent]) -> Result<usize, BillingError> {
            let mut tx = pool.begin().await?;
            let mut rollups: BTreeMap<RollupKey, RollupSums> = BTreeMap::new();
            let mut inserted = 0;
            for chunk in statement_chunks(events) {
                let mut query = QueryBuilder::<$db>::new(INSERT_RECORDS_HEAD);
                query.push_values(chunk, |mut row, e| {
                    row.push_bind(e.request_id.as_str())
                        .push_bind(e.idempotency_key.as_deref())
                        .push_bind(e.tenant_id.as_str())
                        .push_bind(e.key_id.as_str())
                        .push_bind(e.model_id.as_str())
                        .push_bind(e.model_revision.as_str())
                        .push_bind(e.tokenizer_revision.as_str())
                        .push_bind(e.chat_template_version.as_str())
                        .push_bind(e.adapter.as_deref())
                        .push_bind(e.engine_version.as_deref())
                        .push_bind(e.engine_worker.as_deref())
                        .push_bind(i64::from(e.prompt_tokens))
                        .push_bind(i64::from(e.cached_prompt_tokens))
                        .push_bind(i64::from(e.completion_tokens))
                        .push_bind(e.finish_reason.as_str())
                        .push_bind(i32::from(e.http_status))
                        .push_bind(e.error_type.as_deref())
                        .push_bind(e.client_disconnected)
                        .push_bind(e.arrival_at)
                        .push_bind(e.first_token_at)
                        .push_bind(e.last_token_at)
                        .push_bind(e.ttft_ms)
                        .push_bind(e.tpot_ms)
                        .push_bind(e.itl_max_ms)
                        .push_bind(e.itl_p99_ms)
                        .push_bind(e.e2e_ms)
                        .push_bind(e.engine_queue_ms)
                        .push_bind(e.engine_prefill_ms)
                        .push_bind(e.engine_decode_ms)
                        .push_bind(e.trace_id.as_deref())
                        .push_bind(e.prompt_sha256.as_str())
                        .push_bind(i64::from(e.prompt_chars))
                        // validate() has checked the range.
                        .push_bind(i64::try_from(e.cost_micros).unwrap_or(i64::MAX))
                        .push_bind(e.price_list_version.as_str())
                        .push_bind(i64::try_from(e.price_input_micros).unwrap_or(i64::MAX))
                        .push_bind(i64::try_from(e.price_cached_input_micros).unwrap_or(i64::MAX))
                        .push_bind(i64::try_from(e.price_output_micros).unwrap_or(i64::MAX))
                        .push_bind(e.user_sha256.as_deref());
                });
                query.push(INSERT_RECORDS_TAIL);
                let rows = query.build().fetch_all(&mut *tx).await?;
                for row in &rows {
                    add_to_rollups(&mut rollups, row)?;
                }
                inserted += rows.len();
            }
            let rollups: Vec<(RollupKey, RollupSums)> = rollups.into_iter().collect();
            for chunk in rollups.chunks(ROLLUPS_PER_STATEMENT) {
                let mut query = QueryBuilder::<$db>::new(UPSERT_ROLLUPS_HEAD);
                query.push_values(chunk, |mut row, ((period, bucket, tenant, model), sums)| {
                    row.push_bind(period.as_str())
                        .push_bind(*bucket)
                        .push_bind(tenant.as_str())
                        .push_bind(model.as_str())
                        .push_bind(sums.requests)
                        .push_bind(sums.prompt_tokens)
                        .push_bind(sums.cached_prompt_tokens)
                        .push_bind(sums.completion_tokens)
                        .push_bind(sums.cost_micros)
                        .push_bind(sums.refused_requests);
                });
                query.push(UPSERT_ROLLUPS_TAIL);
                query.build().execute(&mut *tx).await?;
            }
            tx.commit().await?;
            Ok(inserted)
        }
    };
}

insert_batch_on!(insert_batch_postgres, Postgres, PgPool);
insert_batch_on!(insert_batch_sqlite, Sqlite, SqlitePool);

/// How far ahead of the current month partitions exist: three months, so a billing service
/// that stops creating them (down, or its hourly task failing) has a quarter to be noticed.
pub const PARTITIONS_AHEAD: TimeDelta = TimeDelta::days(92);

async fn create_record_partitions(
    pool: &PgPool,
    first: DateTime<Utc>,
    last: DateTime<Utc>,
) -> Result<u32, BillingError> {
    let created: i32 = sqlx::query_scalar("SELECT sluice_create_record_partitions($1, $2)")
        .bind(first)
        .bind(last)
        .fetch_one(pool)
        .await?;
    Ok(u32::try_from(created).unwrap_or(0))
}

impl Ledger {
    /// Connects with default options and applies pending migrations.
    pub async fn connect(url: &str) -> Result<Self, BillingError> {
        Self::connect_with(url, &LedgerOptions::default()).await
    }

    /// Connects to `postgres://…` or `sqlite://…` and applies that backend's pending migrations.
    pub async fn connect_with(url: &str, options: &LedgerOptions) -> Result<Self, BillingError> {
        let pool = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let connect = PgConnectOptions::from_str(url)?;
            let pool = PgPoolOptions::new()
                .max_connections(options.max_connections)
                .acquire_timeout(options.acquire_timeout)
                .connect_with(connect)
                .await?;
            Migrator::new(EmbeddedMigrations(POSTGRES_MIGRATIONS)).await?.run(&pool).await?;
            let now = Utc::now();
            create_record_partitions(&pool, now, now + PARTITIONS_AHEAD).await?;
            Pool::Postgres(pool)
        } else if url.starts_with("sqlite:") {
            let connect = SqliteConnectOptions::from_str(url)?
                .create_if_missing(true)
                .journal_mode(SqliteJournalMode::Wal)
                .busy_timeout(options.acquire_timeout)
                .foreign_keys(true);
            let pool = SqlitePoolOptions::new()
                .max_connections(options.max_connections)
                .acquire_timeout(options.acquire_timeout)
                .connect_with(connect)
                .await?;
            Migrator::new(EmbeddedMigrations(SQLITE_MIGRATIONS)).await?.run(&pool).await?;
            Pool::Sqlite(pool)
        } else {
            return Err(BillingError::UnsupportedUrl);
        };
        Ok(Self { pool })
    }

    /// A SQLite ledger file in rollback-journal mode over one connection, schema applied: a
    /// retention archive, whose committed rows are in the file itself (no write-ahead log
    /// beside it, whenever the connection happens to close).
    #[cfg(feature = "server")]
    pub(crate) async fn open_archive(path: &std::path::Path) -> Result<Self, BillingError> {
        let connect = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Delete)
            .synchronous(sqlx::sqlite::SqliteSynchronous::Full)
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new().max_connections(1).connect_with(connect).await?;
        Migrator::new(EmbeddedMigrations(SQLITE_MIGRATIONS)).await?.run(&pool).await?;
        Ok(Self { pool: Pool::Sqlite(pool) })
    }

    /// The connection pool, for the control-plane queries.
    pub(crate) fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Whether the database answers a trivial query (readiness).
    pub async fn ping(&self) -> Result<(), BillingError> {
        match &self.pool {
            Pool::Postgres(p) => sqlx::query("SELECT 1").execute(p).await.map(drop)?,
            Pool::Sqlite(p) => sqlx::query("SELECT 1").execute(p).await.map(drop)?,
        }
        Ok(())
    }

    /// Which database this ledger writes to.
    pub fn backend(&self) -> Backend {
        match self.pool {
            Pool::Postgres(_) => Backend::Postgres,
            Pool::Sqlite(_) => Backend::Sqlite,
        }
    }

    /// Inserts a batch in one transaction and returns how many rows were new.
    ///
    /// Idempotent: an event whose request id, or whose (tenant, idempotency key), is already in
    /// the ledger (or earlier in the same batch) is skipped, and the hour and day rollups are
    /// updated in the same transaction from the rows actually inserted, so a replayed batch
    /// changes nothing. Every event is validated first; one invalid event fails the whole batch.
    pub async fn insert_batch(&self, events: &[UsageEvent]) -> Result<usize, BillingError> {
        for event in events {
            event.validate()?;
        }
        if events.is_empty() {
            return Ok(0);
        }
        match &self.pool {
            Pool::Postgres(pool) => insert_batch_postgres(pool, events).await,
            Pool::Sqlite(pool) => insert_batch_sqlite(pool, events).await,
        }
    }

    /// Creates the monthly `request_records` partitions (Postgres) covering `first` to `last`
    /// that do not exist yet, and returns how many it created. The ledger creates the current
    /// month's and the next [`PARTITIONS_AHEAD`] at connect and `sluice billing` every hour, so
    /// a row normally lands in its month's partition; one that does not (a month not created
    /// yet, or archived already) lands in the default partition, never refused, and moves into
    /// its month when that is created. SQLite's one table has nothing to create: `Ok(0)`.
    pub async fn create_record_partitions(
        &self,
        first: DateTime<Utc>,
        last: DateTime<Utc>,
    ) -> Result<u32, BillingError> {
        match &self.pool {
            Pool::Postgres(pool) => create_record_partitions(pool, first, last).await,
            Pool::Sqlite(_) => Ok(0),
        }
    }

    /// Closes the pool, waiting for connections in use to be returned.
    pub async fn close(&self) {
        match &self.pool {
            Pool::Postgres(pool) => pool.close().await,
            Pool::Sqlite(pool) => pool.close().await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batches_are_cut_into_the_fixed_statement_sizes_in_order() {
        for n in [0usize, 1, 3, 4, 40, 255, 256, 257, 700] {
            let v: Vec<usize> = (0..n).collect();
            let chunks = statement_chunks(&v);
            assert!(chunks.iter().all(|c| RECORDS_PER_STATEMENT.contains(&c.len())), "{n}");
            let joined: Vec<usize> = chunks.concat();
            assert_eq!(joined, v, "{n}: every event once, in order");
        }
        let sizes: Vec<usize> = statement_chunks(&[0u8; 40]).iter().map(|c| c.len()).collect();
        assert_eq!(sizes, [16, 16, 4, 4]);
    }
}
