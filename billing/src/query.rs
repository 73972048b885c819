//! The ledger's read side: request records (filters, keyset pagination, exports), the admin
//! audit log, usage rollups, the dashboard's aggregates, the billed tokens admission starts its
//! day and month windows from, and the rollups reconciled against their rows. The write side
//! (tenants, keys, quotas and their audit rows) is [`crate::control`].

use std::collections::BTreeMap;

use chrono::{DateTime, DurationRound, SecondsFormat, TimeDelta, Utc};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use sqlx::types::Json;
use sqlx::{QueryBuilder, Row};

use crate::Ledger;
use crate::control::{AdminError, AuditEntry, on_pool, rfc3339, tier_tpot_ms, tier_ttft_ms};
use crate::store::Pool;

impl Ledger {
    /// Audit-log rows with `id > after`, oldest first, optionally filtered.
    pub async fn audit_log(&self, filter: &AuditFilter) -> Result<Vec<AuditEntry>, AdminError> {
        on_pool!(self, pool => {
            let mut q = QueryBuilder::new(
                "SELECT id, at, actor, role, action, target, before, after FROM admin_audit_log WHERE id > ",
            );
            q.push_bind(filter.after.unwrap_or(0));
            if let Some(since) = filter.since {
                q.push(" AND at >= ").push_bind(since);
            }
            if let Some(until) = filter.until {
                q.push(" AND at < ").push_bind(until);
            }
            if let Some(actor) = &filter.actor {
                q.push(" AND actor = ").push_bind(actor.clone());
            }
            if let Some(target) = &filter.target {
                q.push(" AND target = ").push_bind(target.clone());
            }
            q.push(" ORDER BY id LIMIT ").push_bind(filter.limit);
            let rows = q.build().fetch_all(pool).await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(AuditEntry {
                    id: row.try_get("id")?,
                    at: row.try_get("at")?,
                    actor: row.try_get("actor")?,
                    role: row.try_get("role")?,
                    action: row.try_get("action")?,
                    target: row.try_get("target")?,
                    before: row.try_get::<Option<Json<Value>>, _>("before")?.map(|j| j.0),
                    after: row.try_get::<Option<Json<Value>>, _>("after")?.map(|j| j.0),
                });
            }
            Ok(out)
        })
    }

    /// Request records matching `filter`, in (arrival, request id) order after the cursor.
    pub async fn records(&self, filter: &RecordFilter) -> Result<RecordPage, AdminError> {
        on_pool!(self, pool => {
            let mut q = QueryBuilder::new("");
            records_query(&mut q, filter);
            let rows = q.build().fetch_all(pool).await?;
            let mut records = Vec::with_capacity(rows.len());
            for row in &rows {
                let mut m = Map::new();
                for (name, col) in RECORD_COLUMNS {
                    let v = match col {
                        Col::Text => Value::from(row.try_get::<String, _>(*name)?),
                        Col::OptText => row.try_get::<Option<String>, _>(*name)?.map_or(Value::Null, Value::from),
                        Col::Int => Value::from(row.try_get::<i64, _>(*name)?),
                        Col::Int32 => Value::from(row.try_get::<i32, _>(*name)?),
                        Col::Bool => Value::from(row.try_get::<bool, _>(*name)?),
                        Col::Time => Value::from(rfc3339(&row.try_get::<DateTime<Utc>, _>(*name)?)),
                        Col::OptTime => row
                            .try_get::<Option<DateTime<Utc>>, _>(*name)?
                            .map_or(Value::Null, |t| Value::from(rfc3339(&t))),
                        Col::OptFloat => row.try_get::<Option<f64>, _>(*name)?.map_or(Value::Null, Value::from),
                    };
                    m.insert((*name).to_owned(), v);
                }
                records.push(m);
            }
            let next_cursor = if records.len() == filter.limit as usize {
                let last = rows.last();
                match last {
                    Some(row) => Some(encode_cursor(&row.try_get("arrival_at")?, &row.try_get::<String, _>("request_id")?)),
                    None => None,
                }
            } else {
                None
            };
            Ok(RecordPage { records, next_cursor })
        })
    }

    /// Postgres's plan for [`Ledger::records`] with `filter` (`EXPLAIN`, text format), or for
    /// the tenant-month usage query [`Ledger::usage`] runs when `usage` is given: what the test
    /// of the year-of-records indexes reads. `None` on SQLite.
    pub async fn explain(
        &self,
        filter: &RecordFilter,
        usage: Option<&UsageFilter>,
    ) -> Result<Option<String>, AdminError> {
        let Pool::Postgres(pool) = self.pool() else {
            return Ok(None);
        };
        let mut q = QueryBuilder::new("EXPLAIN ");
        match usage {
            Some(u) => usage_query(&mut q, u),
            None => records_query(&mut q, filter),
        }
        let lines: Vec<String> = q.build_query_scalar().fetch_all(pool).await?;
        Ok(Some(lines.join("\n")))
    }

    /// Billed tokens (prompt + completion, refused requests excluded) of a tenant (from its day
    /// rollups), or of one of its keys (from its rows), since `day_start` and since
    /// `month_start` (`month_start <= day_start`, both UTC midnights):
    /// where the admission windows start when their counters are new (a restart, a flushed
    /// Redis), so a tenant never gets a fresh day or month for free.
    pub async fn tokens_used(
        &self,
        tenant: &str,
        key: Option<&str>,
        day_start: DateTime<Utc>,
        month_start: DateTime<Utc>,
    ) -> Result<(u64, u64), AdminError> {
        let (day, month): (i64, i64) = on_pool!(self, pool => {
            if key.is_none() {
                // A tenant's: its day rollups (a month is at most 31 rows).
                let row = sqlx::query(
                    "SELECT CAST(COALESCE(SUM(CASE WHEN bucket_start >= $1 \
                     THEN prompt_tokens + completion_tokens ELSE 0 END), 0) AS BIGINT) AS day, \
                     CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS BIGINT) AS month \
                     FROM usage_rollups WHERE period = 'day' AND tenant_id = $2 \
                     AND bucket_start >= $3",
                )
                .bind(day_start)
                .bind(tenant)
                .bind(month_start)
                .fetch_one(pool)
                .await?;
                return Ok((
                    u64::try_from(row.try_get::<i64, _>("day")?).unwrap_or(0),
                    u64::try_from(row.try_get::<i64, _>("month")?).unwrap_or(0),
                ));
            }
            // A key's: its rows (rollups are per tenant).
            let mut q = QueryBuilder::new(
                "SELECT CAST(COALESCE(SUM(CASE WHEN arrival_at >= ",
            );
            q.push_bind(day_start)
                .push(
                    " THEN prompt_tokens + completion_tokens ELSE 0 END), 0) AS BIGINT) AS day, \
                     CAST(COALESCE(SUM(prompt_tokens + completion_tokens), 0) AS BIGINT) AS month \
                     FROM request_records WHERE tenant_id = ",
                )
                .push_bind(tenant.to_owned())
                .push(" AND arrival_at >= ")
                .push_bind(month_start)
                .push(" AND (http_status < 400 OR http_status = 499)");
            if let Some(k) = key {
                q.push(" AND key_id = ").push_bind(k.to_owned());
            }
            let row = q.build().fetch_one(pool).await?;
            (row.try_get("day")?, row.try_get("month")?)
        });
        Ok((u64::try_from(day).unwrap_or(0), u64::try_from(month).unwrap_or(0)))
    }

    /// The hour rollups since `since` (from the start of its hour) recomputed from the rows
    /// they count, by the same rule the writer uses (billed requests and their sums, refused
    /// ones apart): every bucket where the two differ.
    pub async fn reconcile_rollups(
        &self,
        since: DateTime<Utc>,
    ) -> Result<RollupReconciliation, AdminError> {
        let hour = TimeDelta::hours(1);
        let start =
            since.duration_trunc(hour).map_err(|_| AdminError::invalid("since", "out of range"))?;
        let mut from_rows: BTreeMap<(DateTime<Utc>, String, String), RollupSums> = BTreeMap::new();
        let mut records = 0u64;
        let postgres = self.backend() == crate::Backend::Postgres;
        let rollup_rows = on_pool!(self, pool => {
            // Rows and rollups from one snapshot: a batch committed between two reads would
            // look like a difference.
            let mut tx = pool.begin().await?;
            if postgres {
                sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
                    .execute(&mut *tx)
                    .await?;
            }
            let rows = sqlx::query(
                "SELECT tenant_id, model_id, arrival_at, prompt_tokens, cached_prompt_tokens, \
                 completion_tokens, cost_micros, http_status FROM request_records \
                 WHERE arrival_at >= $1",
            )
            .bind(start)
            .fetch_all(&mut *tx)
            .await?;
            let rollups = sqlx::query(
                "SELECT bucket_start, tenant_id, model_id, requests, prompt_tokens, \
                 cached_prompt_tokens, completion_tokens, cost_micros, refused_requests \
                 FROM usage_rollups WHERE period = 'hour' AND bucket_start >= $1",
            )
            .bind(start)
            .fetch_all(&mut *tx)
            .await?;
            tx.rollback().await?;
            for row in &rows {
                records += 1;
                let at: DateTime<Utc> = row.try_get("arrival_at")?;
                let bucket = at
                    .duration_trunc(hour)
                    .map_err(|_| AdminError::invalid("since", "a record is out of range"))?;
                let key = (bucket, row.try_get("tenant_id")?, row.try_get("model_id")?);
                let sums = from_rows.entry(key).or_default();
                let status: i32 = row.try_get("http_status")?;
                if u16::try_from(status).is_ok_and(crate::event::is_refused) {
                    sums.refused_requests += 1;
                } else {
                    sums.requests += 1;
                    sums.prompt_tokens += row.try_get::<i64, _>("prompt_tokens")?;
                    sums.cached_prompt_tokens += row.try_get::<i64, _>("cached_prompt_tokens")?;
                    sums.completion_tokens += row.try_get::<i64, _>("completion_tokens")?;
                    sums.cost_micros += row.try_get::<i64, _>("cost_micros")?;
                }
            }
            let mut out = Vec::with_capacity(rollups.len());
            for r in &rollups {
                out.push((
                    (r.try_get("bucket_start")?, r.try_get("tenant_id")?, r.try_get("model_id")?),
                    RollupSums {
                        requests: r.try_get("requests")?,
                        refused_requests: r.try_get("refused_requests")?,
                        prompt_tokens: r.try_get("prompt_tokens")?,
                        cached_prompt_tokens: r.try_get("cached_prompt_tokens")?,
                        completion_tokens: r.try_get("completion_tokens")?,
                        cost_micros: r.try_get("cost_micros")?,
                    },
                ));
            }
            out
        });
        let from_rollups: BTreeMap<(DateTime<Utc>, String, String), RollupSums> =
            rollup_rows.into_iter().collect();
        let mut differences = Vec::new();
        let keys: std::collections::BTreeSet<_> =
            from_rows.keys().chain(from_rollups.keys()).cloned().collect();
        let buckets = keys.len();
        for k in keys {
            let rows = from_rows.get(&k).copied().unwrap_or_default();
            let rollup = from_rollups.get(&k).copied().unwrap_or_default();
            if rows != rollup {
                differences.push(RollupDifference {
                    bucket_start: k.0,
                    tenant_id: k.1,
                    model_id: k.2,
                    rows,
                    rollup,
                });
            }
        }
        Ok(RollupReconciliation { since: start, records, buckets, differences })
    }

    /// Usage rollup rows for a period, filtered.
    pub async fn usage(&self, filter: &UsageFilter) -> Result<Vec<UsageRow>, AdminError> {
        on_pool!(self, pool => {
            let mut q = QueryBuilder::new("");
            usage_query(&mut q, filter);
            let rows = q.build().fetch_all(pool).await?;
            let mut out = Vec::with_capacity(rows.len());
            for row in &rows {
                out.push(UsageRow {
                    bucket_start: row.try_get("bucket_start")?,
                    tenant_id: row.try_get("tenant_id")?,
                    model_id: row.try_get("model_id")?,
                    requests: row.try_get("requests")?,
                    prompt_tokens: row.try_get("prompt_tokens")?,
                    cached_prompt_tokens: row.try_get("cached_prompt_tokens")?,
                    completion_tokens: row.try_get("completion_tokens")?,
                    cost_micros: row.try_get("cost_micros")?,
                    refused_requests: row.try_get("refused_requests")?,
                });
            }
            Ok(out)
        })
    }

    /// Everything the dashboard draws for `[since, until)`.
    pub async fn dashboard(
        &self,
        since: DateTime<Utc>,
        until: DateTime<Utc>,
    ) -> Result<Dashboard, AdminError> {
        let period = if until - since <= TimeDelta::hours(48) { "hour" } else { "day" };
        // The window starts and ends at bucket boundaries, so the rollup series and the
        // counts read from the records cover the same requests.
        let width = if period == "hour" { TimeDelta::hours(1) } else { TimeDelta::days(1) };
        let since = since
            .duration_trunc(width)
            .map_err(|_| AdminError::invalid("since", "since is out of range"))?;
        let until_start = until
            .duration_trunc(width)
            .map_err(|_| AdminError::invalid("until", "until is out of range"))?;
        let until = if until_start == until { until } else { until_start + width };
        let series = self
            .usage(&UsageFilter {
                period: period.into(),
                tenant: None,
                model: None,
                since: Some(since),
                until: Some(until),
            })
            .await?;
        let (finish_reasons, samples) = on_pool!(self, pool => {
            let rows = sqlx::query(
                "SELECT tenant_id, finish_reason, COUNT(*) AS n FROM request_records \
                 WHERE arrival_at >= $1 AND arrival_at < $2 GROUP BY tenant_id, finish_reason \
                 ORDER BY tenant_id, finish_reason",
            )
            .bind(since)
            .bind(until)
            .fetch_all(pool)
            .await?;
            let mut finish = Vec::with_capacity(rows.len());
            for row in &rows {
                finish.push(FinishCount {
                    tenant_id: row.try_get("tenant_id")?,
                    finish_reason: row.try_get("finish_reason")?,
                    requests: row.try_get("n")?,
                });
            }
            let rows = sqlx::query(
                "SELECT r.tenant_id, r.ttft_ms, r.tpot_ms, r.finish_reason, t.tier, \
                 r.engine_queue_ms, r.engine_prefill_ms, r.engine_decode_ms, r.completion_tokens \
                 FROM request_records r LEFT JOIN tenants t ON t.id = r.tenant_id \
                 WHERE r.arrival_at >= $1 AND r.arrival_at < $2 \
                 ORDER BY r.arrival_at DESC LIMIT 200000",
            )
            .bind(since)
            .bind(until)
            .fetch_all(pool)
            .await?;
            let mut samples: BTreeMap<String, Samples> = BTreeMap::new();
            for row in &rows {
                let e = samples.entry(row.try_get("tenant_id")?).or_default();
                let ttft = row.try_get::<Option<f64>, _>("ttft_ms")?;
                let tpot = row.try_get::<Option<f64>, _>("tpot_ms")?;
                let finish: String = row.try_get("finish_reason")?;
                if e.requests == 0 {
                    // The tenant's tier today: its targets judge the window.
                    let tier: Option<String> = row.try_get("tier")?;
                    let tier = tier.unwrap_or_default();
                    e.targets = (tier_ttft_ms(&tier), tier_tpot_ms(&tier));
                }
                let engine = EngineTimes {
                    queue_ms: row.try_get("engine_queue_ms")?,
                    prefill_ms: row.try_get("engine_prefill_ms")?,
                    decode_ms: row.try_get("engine_decode_ms")?,
                    completion_tokens: row.try_get("completion_tokens")?,
                };
                e.add(&finish, ttft, tpot, engine);
            }
            (finish, samples)
        });
        let latency = samples
            .into_iter()
            .map(|(tenant_id, s)| {
                let judged = s.targets != (None, None);
                LatencyRow {
                    tenant_id,
                    requests: s.requests,
                    ttft_ms: Percentiles::of(s.ttft),
                    tpot_ms: Percentiles::of(s.tpot),
                    ttft_target_ms: s.targets.0,
                    tpot_target_ms: s.targets.1,
                    attainment: judged.then(|| s.good as f64 / s.requests.max(1) as f64),
                    engine_requests: s.engine_requests,
                    engine_ttft_ms: Percentiles::of(s.engine_ttft),
                    engine_tpot_ms: Percentiles::of(s.engine_tpot),
                    engine_queue_ms: Percentiles::of(s.engine_queue),
                    engine_attainment: (judged && s.engine_requests > 0)
                        .then(|| s.engine_good as f64 / s.engine_requests as f64),
                    misses: judged.then_some(s.misses),
                }
            })
            .collect();
        let mut top: BTreeMap<String, TenantTotal> = BTreeMap::new();
        for row in &series {
            let t = top.entry(row.tenant_id.clone()).or_insert_with(|| TenantTotal {
                tenant_id: row.tenant_id.clone(),
                ..TenantTotal::default()
            });
            t.requests += row.requests;
            t.prompt_tokens += row.prompt_tokens;
            t.cached_prompt_tokens += row.cached_prompt_tokens;
            t.completion_tokens += row.completion_tokens;
            t.cost_micros = t.cost_micros.saturating_add(row.cost_micros);
            t.refused_requests += row.refused_requests;
        }
        let mut top_tenants: Vec<TenantTotal> = top.into_values().collect();
        top_tenants.sort_by(|a, b| {
            (b.cost_micros, b.prompt_tokens + b.completion_tokens, &a.tenant_id).cmp(&(
                a.cost_micros,
                a.prompt_tokens + a.completion_tokens,
                &b.tenant_id,
            ))
        });
        Ok(Dashboard {
            since,
            until,
            period: period.into(),
            series,
            finish_reasons,
            latency,
            top_tenants,
        })
    }
}

/// Filters for [`Ledger::audit_log`].
#[derive(Clone, Debug, Default)]
pub struct AuditFilter {
    /// Rows after this id (keyset cursor).
    pub after: Option<i64>,
    /// From this time.
    pub since: Option<DateTime<Utc>>,
    /// Before this time.
    pub until: Option<DateTime<Utc>>,
    /// By this actor.
    pub actor: Option<String>,
    /// On this target.
    pub target: Option<String>,
    /// At most this many rows.
    pub limit: i64,
}

/// Appends [`Ledger::records`]' query for `filter` to `q` (one builder for both databases, and
/// for `EXPLAIN`).
fn records_query<'a, DB: sqlx::Database>(q: &mut QueryBuilder<'a, DB>, filter: &RecordFilter)
where
    String: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    DateTime<Utc>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    i32: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    i64: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    let cols: Vec<&str> = RECORD_COLUMNS.iter().map(|(n, _)| *n).collect();
    q.push(format!("SELECT {} FROM request_records WHERE 1 = 1", cols.join(", ")));
    for (col, val) in [
        ("tenant_id", &filter.tenant),
        ("key_id", &filter.key),
        ("model_id", &filter.model),
        ("model_revision", &filter.model_revision),
        ("finish_reason", &filter.finish_reason),
        ("user_sha256", &filter.user_sha256),
    ] {
        if let Some(v) = val {
            q.push(format!(" AND {col} = ")).push_bind(v.clone());
        }
    }
    match filter.adapter.as_deref() {
        Some(a) if a.contains('@') => {
            q.push(" AND adapter = ").push_bind(a.to_owned());
        }
        // Every revision of a name: the text up to its `@` (no LIKE, whose `_` is a wildcard).
        Some(a) => {
            let prefix = format!("{a}@");
            let n = i32::try_from(prefix.chars().count()).unwrap_or(i32::MAX);
            q.push(" AND substr(adapter, 1, ").push_bind(n).push(") = ").push_bind(prefix);
        }
        None => {}
    }
    if let Some(status) = filter.status {
        q.push(" AND http_status = ").push_bind(i32::from(status));
    }
    if let Some(since) = filter.since {
        q.push(" AND arrival_at >= ").push_bind(since);
    }
    if let Some(until) = filter.until {
        q.push(" AND arrival_at < ").push_bind(until);
    }
    if let Some((at, id)) = &filter.after {
        q.push(" AND (arrival_at > ").push_bind(*at);
        q.push(" OR (arrival_at = ").push_bind(*at);
        q.push(" AND request_id > ").push_bind(id.clone());
        q.push("))");
    }
    q.push(" ORDER BY arrival_at, request_id LIMIT ").push_bind(i64::from(filter.limit));
}

/// Appends [`Ledger::usage`]'s query for `filter` to `q`.
fn usage_query<'a, DB: sqlx::Database>(q: &mut QueryBuilder<'a, DB>, filter: &UsageFilter)
where
    String: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
    DateTime<Utc>: sqlx::Encode<'a, DB> + sqlx::Type<DB>,
{
    q.push(
        "SELECT bucket_start, tenant_id, model_id, requests, prompt_tokens, \
         cached_prompt_tokens, completion_tokens, cost_micros, refused_requests \
         FROM usage_rollups WHERE period = ",
    );
    q.push_bind(filter.period.clone());
    if let Some(t) = &filter.tenant {
        q.push(" AND tenant_id = ").push_bind(t.clone());
    }
    if let Some(m) = &filter.model {
        q.push(" AND model_id = ").push_bind(m.clone());
    }
    if let Some(since) = filter.since {
        q.push(" AND bucket_start >= ").push_bind(since);
    }
    if let Some(until) = filter.until {
        q.push(" AND bucket_start < ").push_bind(until);
    }
    q.push(" ORDER BY bucket_start, tenant_id, model_id LIMIT 100000");
}

/// How a `request_records` column is read.
#[derive(Clone, Copy, Debug)]
pub enum Col {
    /// NOT NULL text.
    Text,
    /// Nullable text.
    OptText,
    /// BIGINT.
    Int,
    /// INTEGER.
    Int32,
    /// BOOLEAN.
    Bool,
    /// NOT NULL timestamp.
    Time,
    /// Nullable timestamp.
    OptTime,
    /// Nullable double.
    OptFloat,
}

/// The columns of `request_records`, in schema order, as exported.
pub const RECORD_COLUMNS: &[(&str, Col)] = &[
    ("request_id", Col::Text),
    ("idempotency_key", Col::OptText),
    ("tenant_id", Col::Text),
    ("key_id", Col::Text),
    ("model_id", Col::Text),
    ("model_revision", Col::Text),
    ("tokenizer_revision", Col::Text),
    ("chat_template_version", Col::Text),
    ("adapter", Col::OptText),
    ("engine_version", Col::OptText),
    ("engine_worker", Col::OptText),
    ("prompt_tokens", Col::Int),
    ("cached_prompt_tokens", Col::Int),
    ("completion_tokens", Col::Int),
    ("finish_reason", Col::Text),
    ("http_status", Col::Int32),
    ("error_type", Col::OptText),
    ("client_disconnected", Col::Bool),
    ("arrival_at", Col::Time),
    ("first_token_at", Col::OptTime),
    ("last_token_at", Col::OptTime),
    ("ttft_ms", Col::OptFloat),
    ("tpot_ms", Col::OptFloat),
    ("itl_max_ms", Col::OptFloat),
    ("itl_p99_ms", Col::OptFloat),
    ("e2e_ms", Col::OptFloat),
    ("engine_queue_ms", Col::OptFloat),
    ("engine_prefill_ms", Col::OptFloat),
    ("engine_decode_ms", Col::OptFloat),
    ("trace_id", Col::OptText),
    ("prompt_sha256", Col::Text),
    ("prompt_chars", Col::Int),
    ("cost_micros", Col::Int),
    ("ingested_at", Col::Time),
    ("price_list_version", Col::Text),
    ("price_input_micros", Col::Int),
    ("price_cached_input_micros", Col::Int),
    ("price_output_micros", Col::Int),
    ("user_sha256", Col::OptText),
];

/// Filters for [`Ledger::records`].
#[derive(Clone, Debug, Default)]
pub struct RecordFilter {
    /// Tenant id.
    pub tenant: Option<String>,
    /// API key id.
    pub key: Option<String>,
    /// Model id.
    pub model: Option<String>,
    /// Model revision.
    pub model_revision: Option<String>,
    /// The request's `user`, as [`crate::event::user_sha256`] of its tenant and the value.
    pub user_sha256: Option<String>,
    /// Finish reason.
    pub finish_reason: Option<String>,
    /// The tenant adapter: `tenant/name@revision` exactly, or `tenant/name` for every revision.
    pub adapter: Option<String>,
    /// HTTP status.
    pub status: Option<u16>,
    /// Arrival at or after.
    pub since: Option<DateTime<Utc>>,
    /// Arrival before.
    pub until: Option<DateTime<Utc>>,
    /// Keyset position: records strictly after this (arrival, request id).
    pub after: Option<(DateTime<Utc>, String)>,
    /// Page size.
    pub limit: u32,
}

/// One page of records.
#[derive(Clone, Debug, Serialize)]
pub struct RecordPage {
    /// Rows as column name -> value.
    pub records: Vec<Map<String, Value>>,
    /// Cursor for the next page, when this one was full.
    pub next_cursor: Option<String>,
}

/// Opaque keyset cursor: hex of `arrival\nrequest_id`.
pub fn encode_cursor(at: &DateTime<Utc>, request_id: &str) -> String {
    hex::encode(format!("{}\n{request_id}", at.to_rfc3339_opts(SecondsFormat::AutoSi, true)))
}

/// Decodes [`encode_cursor`]'s output.
pub fn decode_cursor(cursor: &str) -> Result<(DateTime<Utc>, String), AdminError> {
    let bad = || AdminError::invalid("cursor", "cursor is not one this API returned");
    let raw = hex::decode(cursor).map_err(|_| bad())?;
    let text = String::from_utf8(raw).map_err(|_| bad())?;
    let (at, id) = text.split_once('\n').ok_or_else(bad)?;
    // A NUL would fail the query on Postgres (text cannot hold one) rather than match nothing.
    if id.contains('\0') {
        return Err(bad());
    }
    let at = DateTime::parse_from_rfc3339(at).map_err(|_| bad())?.with_timezone(&Utc);
    Ok((at, id.to_owned()))
}

/// Filters for [`Ledger::usage`].
#[derive(Clone, Debug)]
pub struct UsageFilter {
    /// `hour` or `day`.
    pub period: String,
    /// Tenant id.
    pub tenant: Option<String>,
    /// Model id.
    pub model: Option<String>,
    /// Buckets starting at or after.
    pub since: Option<DateTime<Utc>>,
    /// Buckets starting before.
    pub until: Option<DateTime<Utc>>,
}

/// One rollup row.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct UsageRow {
    /// Bucket start (UTC hour or day).
    pub bucket_start: DateTime<Utc>,
    /// Tenant.
    pub tenant_id: String,
    /// Model.
    pub model_id: String,
    /// Billed requests (the tokens and cost below are theirs).
    pub requests: i64,
    /// Prompt tokens.
    pub prompt_tokens: i64,
    /// Of which served from the prefix cache.
    pub cached_prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
    /// Cost, micro-units.
    pub cost_micros: i64,
    /// Refused requests (an error status; no tokens billed, no cost).
    #[serde(default)]
    pub refused_requests: i64,
}

/// The sums a usage rollup holds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollupSums {
    /// Billed requests.
    pub requests: i64,
    /// Refused requests.
    pub refused_requests: i64,
    /// Prompt tokens of billed requests.
    pub prompt_tokens: i64,
    /// Of which cached.
    pub cached_prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
    /// Cost, micro-units.
    pub cost_micros: i64,
}

/// One hour bucket whose rollup does not match its rows.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RollupDifference {
    /// Bucket start (UTC hour).
    pub bucket_start: DateTime<Utc>,
    /// Tenant.
    pub tenant_id: String,
    /// Model.
    pub model_id: String,
    /// What the rows add up to.
    pub rows: RollupSums,
    /// What the rollup holds.
    pub rollup: RollupSums,
}

/// The rollups checked against the rows since an hour (`sluice audit reconcile` reads it back
/// with this type, so a field it lacks is an error there, never an empty list).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RollupReconciliation {
    /// Start of the first hour checked.
    pub since: DateTime<Utc>,
    /// Rows read.
    pub records: u64,
    /// (hour, tenant, model) buckets compared.
    pub buckets: usize,
    /// Where they differ (empty when they agree).
    pub differences: Vec<RollupDifference>,
}

/// Requests per tenant and finish reason.
#[derive(Clone, Debug, Serialize)]
pub struct FinishCount {
    /// Tenant.
    pub tenant_id: String,
    /// Finish reason.
    pub finish_reason: String,
    /// Requests.
    pub requests: i64,
}

/// One tenant's latency samples in a dashboard window.
#[derive(Default)]
struct Samples {
    requests: u64,
    good: u64,
    ttft: Vec<f64>,
    tpot: Vec<f64>,
    /// The tier's TTFT and TPOT targets, ms.
    targets: (Option<u32>, Option<u32>),
    /// Requests the engine timed, and those good by its own figures.
    engine_requests: u64,
    engine_good: u64,
    engine_ttft: Vec<f64>,
    engine_tpot: Vec<f64>,
    engine_queue: Vec<f64>,
    misses: Misses,
}

/// What the engine recorded of one request.
#[derive(Clone, Copy, Debug, Default)]
struct EngineTimes {
    queue_ms: Option<f64>,
    prefill_ms: Option<f64>,
    decode_ms: Option<f64>,
    completion_tokens: i64,
}

impl EngineTimes {
    /// Arrival at the engine to its first token: queue and prefill.
    fn ttft(&self) -> Option<f64> {
        Some(self.queue_ms? + self.prefill_ms?)
    }

    /// The engine's decode time per token after the first.
    fn tpot(&self) -> Option<f64> {
        let after_first = self.completion_tokens.checked_sub(1).filter(|n| *n > 0)?;
        Some(self.decode_ms? / after_first as f64)
    }
}

/// A tenant's requests that missed its SLO, by why: refused at the gateway (quota, rate
/// limit, fair share), failed (an error, a timeout, the client gone), or too slow, put down
/// to what took the most of its time to first token (the engine's queue, its prefill, or
/// everything outside the engine: the gateway, the network, the client) or to a TPOT over
/// its target.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Misses {
    pub refused: u64,
    pub failed: u64,
    pub engine_queue: u64,
    pub prefill: u64,
    pub outside_engine: u64,
    pub tpot: u64,
}

impl Samples {
    /// Adds one request: judged by the gateway's figures (what the client saw) and, where the
    /// engine timed it, by the engine's own.
    fn add(&mut self, finish: &str, ttft: Option<f64>, tpot: Option<f64>, engine: EngineTimes) {
        self.requests += 1;
        let is_good = good(finish, ttft, tpot, self.targets);
        self.good += u64::from(is_good);
        self.ttft.extend(ttft);
        self.tpot.extend(tpot);
        let (e_ttft, e_tpot) = (engine.ttft(), engine.tpot());
        if e_ttft.is_some() {
            self.engine_requests += 1;
            self.engine_good += u64::from(good(finish, e_ttft, e_tpot, self.targets));
            self.engine_ttft.extend(e_ttft);
            self.engine_tpot.extend(e_tpot);
            self.engine_queue.extend(engine.queue_ms);
        }
        if is_good {
            return;
        }
        let over = |v: Option<f64>, t: Option<u32>| v.zip(t).is_some_and(|(v, t)| v > f64::from(t));
        let m = &mut self.misses;
        if finish == "rejected" {
            m.refused += 1;
        } else if !matches!(finish, "stop" | "length" | "tool_calls" | "content_filter") {
            m.failed += 1;
        } else if over(ttft, self.targets.0) {
            let queue = engine.queue_ms.unwrap_or(0.0);
            let prefill = engine.prefill_ms.unwrap_or(0.0);
            let outside = ttft.unwrap_or(0.0) - queue - prefill;
            if queue >= prefill && queue >= outside {
                m.engine_queue += 1;
            } else if prefill >= outside {
                m.prefill += 1;
            } else {
                m.outside_engine += 1;
            }
        } else {
            m.tpot += 1;
        }
    }
}

/// Whether a request was good (MISSION.md's SLO attainment): it ended normally and within its
/// tier's targets. A request without a TTFT (a whole answer) or TPOT (one token) is judged by
/// what it has; every other ending, refusals included, is not good.
fn good(
    finish: &str,
    ttft: Option<f64>,
    tpot: Option<f64>,
    targets: (Option<u32>, Option<u32>),
) -> bool {
    let within = |v: Option<f64>, t: Option<u32>| match (v, t) {
        (Some(v), Some(t)) => v <= f64::from(t),
        _ => true,
    };
    matches!(finish, "stop" | "length" | "tool_calls" | "content_filter")
        && within(ttft, targets.0)
        && within(tpot, targets.1)
}

/// Nearest-rank percentiles of a sample.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th.
    pub p90: f64,
    /// 99th.
    pub p99: f64,
}

impl Percentiles {
    /// `None` for an empty sample; else value at index `ceil(p/100 * n) - 1` of the sorted sample.
    pub fn of(mut v: Vec<f64>) -> Option<Self> {
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let at = |p: f64| {
            let rank = ((p / 100.0) * v.len() as f64).ceil() as usize;
            v[rank.clamp(1, v.len()) - 1]
        };
        Some(Self { p50: at(50.0), p90: at(90.0), p99: at(99.0) })
    }
}

/// TTFT and TPOT percentiles of one tenant.
#[derive(Clone, Debug, Serialize)]
pub struct LatencyRow {
    /// Tenant.
    pub tenant_id: String,
    /// Requests in the window.
    pub requests: u64,
    /// Time to first token.
    pub ttft_ms: Option<Percentiles>,
    /// Time per output token.
    pub tpot_ms: Option<Percentiles>,
    /// The tenant's tier's TTFT target, ms.
    pub ttft_target_ms: Option<u32>,
    /// The tenant's tier's TPOT target, ms.
    pub tpot_target_ms: Option<u32>,
    /// Good requests over all of the window's requests (refused and failed ones included), by
    /// the tier's targets; `None` when the tier has none.
    pub attainment: Option<f64>,
    /// Requests the engine timed (those that reached one).
    pub engine_requests: u64,
    /// The engine's own time to first token (its queue and prefill) and time per output token.
    pub engine_ttft_ms: Option<Percentiles>,
    pub engine_tpot_ms: Option<Percentiles>,
    /// The wait in the engine's queue.
    pub engine_queue_ms: Option<Percentiles>,
    /// Of the requests the engine timed, those good by its own figures and the tier's targets:
    /// beside `attainment`, what the engine did against what the client saw.
    pub engine_attainment: Option<f64>,
    /// The requests that missed the targets, by why (`None` when the tier has none).
    pub misses: Option<Misses>,
}

/// Totals of one tenant over the window.
#[derive(Clone, Debug, Default, Serialize)]
pub struct TenantTotal {
    /// Tenant.
    pub tenant_id: String,
    /// Billed requests.
    pub requests: i64,
    /// Prompt tokens.
    pub prompt_tokens: i64,
    /// Cached prompt tokens.
    pub cached_prompt_tokens: i64,
    /// Completion tokens.
    pub completion_tokens: i64,
    /// Cost, micro-units.
    pub cost_micros: i64,
    /// Refused requests.
    pub refused_requests: i64,
}

/// What the dashboard page draws.
#[derive(Clone, Debug, Serialize)]
pub struct Dashboard {
    /// Window start (the caller's, moved back to the start of its bucket).
    pub since: DateTime<Utc>,
    /// Window end (moved forward to the end of its bucket).
    pub until: DateTime<Utc>,
    /// Bucket width of `series`.
    pub period: String,
    /// Usage per bucket x tenant x model.
    pub series: Vec<UsageRow>,
    /// Requests per tenant x finish reason.
    pub finish_reasons: Vec<FinishCount>,
    /// Latency percentiles per tenant.
    pub latency: Vec<LatencyRow>,
    /// Tenants by cost, then tokens.
    pub top_tenants: Vec<TenantTotal>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn engine(queue: f64, prefill: f64, decode: f64, tokens: i64) -> EngineTimes {
        EngineTimes {
            queue_ms: Some(queue),
            prefill_ms: Some(prefill),
            decode_ms: Some(decode),
            completion_tokens: tokens,
        }
    }

    #[test]
    fn misses_are_put_down_to_the_largest_part_of_a_late_first_token() {
        let mut s = Samples { targets: (Some(1000), Some(100)), ..Samples::default() };
        // Good: within both targets, by the gateway's figures and the engine's.
        s.add("stop", Some(300.0), Some(50.0), engine(100.0, 150.0, 500.0, 11));
        // Late, most of it in the engine's queue; in its prefill; outside the engine.
        s.add("stop", Some(1500.0), Some(50.0), engine(1200.0, 200.0, 500.0, 11));
        s.add("length", Some(1500.0), Some(50.0), engine(100.0, 1300.0, 500.0, 11));
        s.add("stop", Some(1500.0), Some(50.0), engine(10.0, 90.0, 500.0, 11));
        // In time, but a TPOT over its target; refused; failed.
        s.add("stop", Some(300.0), Some(150.0), engine(10.0, 90.0, 1500.0, 11));
        s.add("rejected", None, None, EngineTimes::default());
        s.add("error", Some(300.0), None, engine(10.0, 90.0, 0.0, 1));
        let want = Misses {
            refused: 1,
            failed: 1,
            engine_queue: 1,
            prefill: 1,
            outside_engine: 1,
            tpot: 1,
        };
        assert_eq!((s.requests, s.good, s.misses), (7, 1, want));
        // The engine timed six; by its own figures the one late outside it was good (100 ms
        // to its first token, 50 ms a token).
        assert_eq!((s.engine_requests, s.engine_good), (6, 2));
        assert_eq!(s.engine_queue, [100.0, 1200.0, 100.0, 10.0, 10.0, 10.0]);
        // The engine's TPOT is over the tokens after the first; one token has none.
        assert_eq!(s.engine_tpot, [50.0, 50.0, 50.0, 50.0, 150.0]);
        assert_eq!(engine(1.0, 2.0, 3.0, 1).tpot(), None);
        assert_eq!(EngineTimes { prefill_ms: None, ..engine(1.0, 2.0, 3.0, 4) }.ttft(), None);
    }
}
