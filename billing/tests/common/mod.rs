//! Helpers shared by the billing integration tests: real Postgres, SQLite and Redis.

#![expect(dead_code, reason = "each test binary uses a different subset of the helpers")]

use std::fs::File;
use std::future::Future;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use chrono::{DateTime, TimeDelta, Utc};
use sluice_billing::{FinishReason, UsageEvent};
use sqlx::{Connection, Executor, PgConnection, PgPool, SqlitePool};

pub const ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/test";
pub const REDIS_URL: &str = "redis://127.0.0.1:6379";
/// Tests that use Postgres hold this lock shared; the outage test holds it exclusively.
const POSTGRES_LOCK: &str = "/tmp/sluice-billing-postgres-tests.lock";

/// Takes the Postgres test lock (blocking, so call it off the async runtime's hot path).
pub async fn postgres_lock(exclusive: bool) -> anyhow::Result<File> {
    tokio::task::spawn_blocking(move || -> anyhow::Result<File> {
        let file = File::options().create(true).truncate(false).write(true).open(POSTGRES_LOCK)?;
        if exclusive {
            file.lock()?;
        } else {
            file.lock_shared()?;
        }
        Ok(file)
    })
    .await?
}

/// A database of its own for one test, dropped (forcibly) when this value is dropped.
pub struct PgDatabase {
    pub url: String,
    name: String,
    _lock: Option<File>,
}

impl PgDatabase {
    /// Creates a fresh database, holding the shared Postgres test lock while it lives.
    pub async fn create() -> anyhow::Result<Self> {
        let lock = postgres_lock(false).await?;
        let mut db = Self::create_unlocked().await?;
        db._lock = Some(lock);
        Ok(db)
    }

    /// Creates a fresh database; the caller already holds the lock.
    pub async fn create_unlocked() -> anyhow::Result<Self> {
        let name = format!("sluice_billing_{}", uuid::Uuid::new_v4().simple());
        let mut admin = PgConnection::connect(ADMIN_URL).await?;
        // The name is generated above, never user input; CREATE DATABASE takes no binds.
        admin.execute(format!("CREATE DATABASE {name}").as_str()).await?;
        admin.close().await?;
        Ok(Self { url: format!("postgres://postgres@127.0.0.1:5432/{name}"), name, _lock: None })
    }
}

impl Drop for PgDatabase {
    fn drop(&mut self) {
        // Synchronous on purpose: it also runs when a test fails half-way.
        let dropped = Command::new("psql")
            .args(["-q", "-h", "127.0.0.1", "-U", "postgres", "-d", "test", "-c"])
            .arg(format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", self.name))
            .status();
        if !matches!(dropped, Ok(status) if status.success()) {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

/// A SQLite ledger file in a temporary directory removed on drop.
pub struct SqliteFile {
    pub url: String,
    _dir: tempfile::TempDir,
}

impl SqliteFile {
    pub fn create() -> anyhow::Result<Self> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("ledger.db");
        let url = format!("sqlite://{}", path.to_str().context("temp path is not UTF-8")?);
        Ok(Self { url, _dir: dir })
    }
}

/// Read-only access to a ledger for assertions, independent of the code under test.
pub enum Inspect {
    Postgres(PgPool),
    Sqlite(SqlitePool),
}

impl Inspect {
    pub async fn open(url: &str) -> anyhow::Result<Self> {
        Ok(if url.starts_with("postgres") {
            Self::Postgres(PgPool::connect(url).await?)
        } else {
            Self::Sqlite(SqlitePool::connect(url).await?)
        })
    }

    /// Runs a query returning one integer; wrap aggregates in `CAST(... AS BIGINT)`.
    pub async fn scalar(&self, sql: &str) -> anyhow::Result<i64> {
        Ok(match self {
            Self::Postgres(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
            Self::Sqlite(pool) => sqlx::query_scalar(sql).fetch_one(pool).await?,
        })
    }

    /// Column names of a table, in declaration order.
    pub async fn columns(&self, table: &str) -> anyhow::Result<Vec<String>> {
        Ok(match self {
            Self::Postgres(pool) => {
                sqlx::query_scalar(
                    "SELECT column_name::TEXT FROM information_schema.columns \
                     WHERE table_schema = 'public' AND table_name = $1 ORDER BY ordinal_position",
                )
                .bind(table)
                .fetch_all(pool)
                .await?
            }
            Self::Sqlite(pool) => {
                sqlx::query_scalar("SELECT name FROM pragma_table_info(?1) ORDER BY cid")
                    .bind(table)
                    .fetch_all(pool)
                    .await?
            }
        })
    }

    pub async fn close(self) {
        match self {
            Self::Postgres(pool) => pool.close().await,
            Self::Sqlite(pool) => pool.close().await,
        }
    }
}

/// 2026-11-30T10:15:30Z, a fixed arrival time.
pub fn base_time() -> DateTime<Utc> {
    DateTime::from_timestamp(1_796_033_730, 0).unwrap_or_default()
}

/// A complete, valid event: 100 prompt tokens (20 cached), 50 completion tokens, 1,234 micros.
pub fn event(request_id: &str, tenant_id: &str) -> UsageEvent {
    let arrival_at = base_time();
    UsageEvent {
        request_id: request_id.to_owned(),
        idempotency_key: None,
        tenant_id: tenant_id.to_owned(),
        key_id: format!("key-{tenant_id}"),
        model_id: "smollm2-135m-instruct".to_owned(),
        model_revision: "sha256:aaaa".to_owned(),
        tokenizer_revision: "sha256:bbbb".to_owned(),
        chat_template_version: "sha256:cccc".to_owned(),
        adapter: None,
        engine_version: Some("0.1.0".to_owned()),
        engine_worker: Some("worker-0".to_owned()),
        prompt_tokens: 100,
        cached_prompt_tokens: 20,
        completion_tokens: 50,
        finish_reason: FinishReason::Stop,
        http_status: 200,
        error_type: None,
        client_disconnected: false,
        arrival_at,
        first_token_at: Some(arrival_at + TimeDelta::milliseconds(120)),
        last_token_at: Some(arrival_at + TimeDelta::milliseconds(1_100)),
        ttft_ms: Some(120.0),
        tpot_ms: Some(20.0),
        itl_max_ms: Some(45.5),
        itl_p99_ms: Some(40.0),
        e2e_ms: Some(1_100.0),
        engine_queue_ms: Some(3.0),
        engine_prefill_ms: Some(60.0),
        engine_decode_ms: Some(980.0),
        trace_id: Some("4bf92f3577b34da6a3ce929d0e0e4736".to_owned()),
        prompt_sha256: "ab".repeat(32),
        prompt_chars: 420,
        user_sha256: None,
        // 50 completion tokens at $24.68 per million.
        cost_micros: 1_234,
        price_list_version: "test-1".to_owned(),
        price_input_micros: 0,
        price_cached_input_micros: 0,
        price_output_micros: 24_680_000,
    }
}

/// Unique stream, dead-letter stream and group names sharing one hash tag.
pub fn stream_names() -> (String, String, String) {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    (
        format!("{{test-{tag}}}:usage"),
        format!("{{test-{tag}}}:usage:dead"),
        format!("billing-{tag}"),
    )
}

/// Polls `check` until it returns true, failing after `deadline`. Never a bare sleep: the
/// pause between polls only bounds the polling rate.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut check: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = anyhow::Result<bool>>,
{
    let start = Instant::now();
    loop {
        if check().await? {
            return Ok(());
        }
        if start.elapsed() > deadline {
            bail!("timed out after {deadline:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Number of entries pending (delivered, not acknowledged) in a consumer group.
pub async fn pending(
    conn: &mut redis::aio::MultiplexedConnection,
    stream: &str,
    group: &str,
) -> anyhow::Result<usize> {
    let reply: redis::streams::StreamPendingReply =
        redis::AsyncCommands::xpending(conn, stream, group).await?;
    Ok(reply.count())
}

/// Deletes the test's Redis keys.
pub async fn delete_keys(
    conn: &mut redis::aio::MultiplexedConnection,
    keys: &[&str],
) -> anyhow::Result<()> {
    let _deleted: usize = redis::AsyncCommands::del(conn, keys).await?;
    Ok(())
}

/// Stops the local Postgres cluster; starts it again when dropped unless already started.
pub struct PostgresStopped {
    version: String,
    running: bool,
}

impl PostgresStopped {
    pub fn stop() -> anyhow::Result<Self> {
        let version = std::fs::read_dir("/etc/postgresql")?
            .filter_map(Result::ok)
            .filter_map(|entry| entry.file_name().into_string().ok())
            .max()
            .context("no cluster under /etc/postgresql")?;
        let mut guard = Self { version, running: true };
        guard.cluster("stop")?;
        guard.running = false;
        Ok(guard)
    }

    pub fn start(&mut self) -> anyhow::Result<()> {
        self.cluster("start")?;
        self.running = true;
        Ok(())
    }

    /// Runs `pg_ctlcluster` with every inherited descriptor above stderr closed: the server it
    /// starts is a daemon that outlives the test, and it must not keep our parent's open files
    /// (a `flock` held around `cargo test`, say) and with them their locks.
    fn cluster(&self, action: &str) -> anyhow::Result<()> {
        const CLOSE_INHERITED_AND_RUN: &str = r#"for fd in /proc/self/fd/*; do n=${fd##*/}; [ "$n" -gt 2 ] && eval "exec $n>&-"; done; exec pg_ctlcluster --skip-systemctl-redirect "$0" main "$1""#;
        // bash, not sh: dash cannot redirect descriptors above 9.
        let status = Command::new("bash")
            .args(["-c", CLOSE_INHERITED_AND_RUN, &self.version, action])
            .status()?;
        if !status.success() {
            bail!("pg_ctlcluster {action} failed: {status}");
        }
        Ok(())
    }
}

impl Drop for PostgresStopped {
    fn drop(&mut self) {
        if !self.running && self.start().is_err() {
            eprintln!("could not restart Postgres: run pg_ctlcluster {} main start", self.version);
        }
    }
}
