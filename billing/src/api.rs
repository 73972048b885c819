//! The billing service's HTTP API: admin (tenants, keys, quotas), audit (records, audit log,
//! exports), usage, the dashboard and the console. Every route but `/health` and the pages
//! (the dashboard's and the console's HTML, script and styles) needs a bearer JWT (see [`crate::auth`]); each route names the roles it admits, and a
//! `tenant-admin` only ever reaches its own tenant. Errors are OpenAI-style JSON naming the
//! parameter.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post, put};
use chrono::{DateTime, NaiveDate, TimeDelta, Utc};
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::Ledger;
use crate::auth::{AuthError, Principal, Role, Verifier};
use crate::control::{AdminError, Limits, NewTenant, QuotaSettings, TIERS, TenantChange};
use crate::ingest::ConsumerStats;
use crate::query::{AuditFilter, RECORD_COLUMNS, RecordFilter, UsageFilter, decode_cursor};

/// Redis pub/sub channel announcing control-plane changes to gateways.
pub const CONTROL_CHANNEL: &str = "{sluice}:control";
/// Redis counter bumped on every control-plane change (gateways may poll it).
pub const CONTROL_VERSION_KEY: &str = "{sluice}:control:version";

/// Shared state of the API.
pub struct ApiState {
    /// The database.
    pub ledger: Ledger,
    /// Token verification.
    pub verifier: Verifier,
    /// Where control-plane changes are announced, when configured.
    pub redis: Option<crate::redis_conn::RedisConn>,
    /// Draining and ingestion, for `/readyz` and `/metrics`.
    pub service: Arc<ServiceStatus>,
}

/// What the probes and `/metrics` report besides the database: whether shutdown began, and
/// this replica's usage consumer, when it runs one.
#[derive(Debug, Default)]
pub struct ServiceStatus {
    draining: AtomicBool,
    consumer: OnceLock<ConsumerInfo>,
}

#[derive(Debug)]
struct ConsumerInfo {
    stats: Arc<ConsumerStats>,
    stream: String,
    group: String,
}

impl ServiceStatus {
    /// Shutdown began: readiness answers 503 from now on.
    pub fn begin_drain(&self) {
        self.draining.store(true, Ordering::Relaxed);
    }

    /// Whether shutdown began.
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// This replica consumes `stream` in `group`; its counters are `stats`.
    pub fn set_consumer(&self, stats: Arc<ConsumerStats>, stream: &str, group: &str) {
        let info = ConsumerInfo { stats, stream: stream.to_owned(), group: group.to_owned() };
        let _ = self.consumer.set(info);
    }
}

impl std::fmt::Debug for ApiState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ApiState").field("backend", &self.ledger.backend()).finish()
    }
}

/// The router over `state`.
pub fn router(state: Arc<ApiState>) -> Router {
    Router::new()
        .route("/health", get(|| async { "ok" }))
        .route("/livez", get(|| async { axum::Json(json!({"status": "ok"})) }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        .route("/", get(|| async { axum::response::Redirect::to("/console") }))
        .route("/console", get(console_page))
        .route("/console.js", get(console_script))
        .route("/ui.css", get(shared_styles))
        .route("/dashboard", get(dashboard_page))
        .route("/v1/whoami", get(whoami))
        .route("/v1/tiers", get(tiers))
        .route("/v1/dashboard/data", get(dashboard_data))
        .route("/v1/tenants", get(list_tenants).post(create_tenant))
        .route("/v1/tenants/{tenant}", get(get_tenant).patch(update_tenant))
        .route("/v1/tenants/{tenant}/suspend", post(suspend_tenant))
        .route("/v1/tenants/{tenant}/activate", post(activate_tenant))
        .route("/v1/tenants/{tenant}/keys", get(list_keys).post(issue_key))
        .route("/v1/tenants/{tenant}/keys/{key}/revoke", post(revoke_key))
        .route("/v1/tenants/{tenant}/keys/{key}/limits", put(set_key_limits))
        .route("/v1/tenants/{tenant}/quota", get(get_quota).put(set_quota))
        .route("/v1/records", get(records))
        .route("/v1/audit-log", get(audit_log))
        .route("/v1/audit/reconcile", get(reconcile))
        .route("/v1/usage", get(usage))
        .fallback(|| async { ApiError(AdminError::NotFound("no such route".into())) })
        .with_state(state)
}

/// An [`AdminError`] as an HTTP response.
#[derive(Debug)]
pub struct ApiError(pub AdminError);

impl From<AdminError> for ApiError {
    fn from(e: AdminError) -> Self {
        Self(e)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let (status, kind, param) = match &self.0 {
            AdminError::Invalid { param, .. } => {
                (StatusCode::BAD_REQUEST, "invalid_request_error", Some(param.clone()))
            }
            AdminError::Unauthorized(_) => (StatusCode::UNAUTHORIZED, "authentication_error", None),
            AdminError::Forbidden(_) => (StatusCode::FORBIDDEN, "permission_error", None),
            AdminError::NotFound(_) => (StatusCode::NOT_FOUND, "not_found_error", None),
            AdminError::Conflict(_) => (StatusCode::CONFLICT, "conflict_error", None),
            AdminError::Billing(e) => (
                StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                "server_error",
                None,
            ),
        };
        let message = match &self.0 {
            AdminError::Billing(e) => {
                tracing::error!(error = %e, "billing API database error");
                format!("the billing database failed ({})", e.error_type())
            }
            other => other.to_string(),
        };
        let code = status.as_u16().to_string();
        let body =
            json!({"error": {"message": message, "type": kind, "param": param, "code": code}});
        (status, axum::Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

/// Verifies the bearer token and checks the role against `allowed`.
fn authorize(state: &ApiState, headers: &HeaderMap, allowed: &[Role]) -> ApiResult<Principal> {
    let token = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split_once(' '))
        // The scheme is case-insensitive (RFC 9110).
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim())
        .filter(|t| !t.is_empty())
        .ok_or_else(|| AdminError::Unauthorized(AuthError::Missing.to_string()))?;
    let who = state.verifier.verify(token).map_err(|e| {
        // Why is for the operator's log; the client hears only that the token was refused.
        tracing::warn!(reason = %e, "admin token refused");
        AdminError::Unauthorized("invalid or expired token".into())
    })?;
    if !allowed.contains(&who.role) {
        return Err(AdminError::Forbidden(format!(
            "role {} may not do this (allowed: {})",
            who.role.as_str(),
            allowed.iter().map(|r| r.as_str()).collect::<Vec<_>>().join(", ")
        ))
        .into());
    }
    Ok(who)
}

/// A `tenant-admin` may only touch its own tenant.
fn check_tenant(who: &Principal, tenant: &str) -> ApiResult<()> {
    if who.role == Role::TenantAdmin && who.tenant.as_deref() != Some(tenant) {
        return Err(AdminError::Forbidden(
            "a tenant-admin token reaches only its own tenant".into(),
        )
        .into());
    }
    Ok(())
}

/// Parses a JSON body, naming the field at fault.
fn body<T: DeserializeOwned>(bytes: &Bytes) -> ApiResult<T> {
    let bytes: &[u8] = if bytes.iter().all(u8::is_ascii_whitespace) { b"{}" } else { bytes };
    let de = &mut serde_json::Deserializer::from_slice(bytes);
    serde_path_to_error::deserialize(de).map_err(|e| {
        let path = e.path().to_string();
        let param = if path == "." { "body".to_owned() } else { path };
        ApiError(AdminError::invalid(&param, format!("invalid request body: {}", e.inner())))
    })
}

/// Query parameters, refusing names the route does not know.
fn query(params: HashMap<String, String>, known: &[&str]) -> ApiResult<HashMap<String, String>> {
    if let Some(k) = params.keys().find(|k| !known.contains(&k.as_str())) {
        return Err(AdminError::invalid(
            k,
            format!("unknown query parameter {k:?} (known: {})", known.join(", ")),
        )
        .into());
    }
    Ok(params)
}

/// RFC 3339, a date (`2026-11-29`, UTC midnight), or an age (`30m`, `24h`, `7d`) before now.
pub fn parse_time(param: &str, s: &str) -> Result<DateTime<Utc>, AdminError> {
    if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        return Ok(t.with_timezone(&Utc));
    }
    if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d")
        && let Some(t) = d.and_hms_opt(0, 0, 0)
    {
        return Ok(t.and_utc());
    }
    let (num, unit) = s.split_at(s.len().saturating_sub(1));
    if let Ok(n) = num.parse::<i64>()
        && (0..=100_000).contains(&n)
    {
        let d = match unit {
            "s" => TimeDelta::seconds(n),
            "m" => TimeDelta::minutes(n),
            "h" => TimeDelta::hours(n),
            "d" => TimeDelta::days(n),
            _ => return Err(bad_time(param)),
        };
        return Ok(Utc::now() - d);
    }
    Err(bad_time(param))
}

fn bad_time(param: &str) -> AdminError {
    AdminError::invalid(
        param,
        format!("{param} must be RFC 3339, YYYY-MM-DD, or an age like 24h or 7d"),
    )
}

fn time_param(q: &HashMap<String, String>, name: &str) -> ApiResult<Option<DateTime<Utc>>> {
    Ok(q.get(name).map(|s| parse_time(name, s)).transpose()?)
}

fn limit_param(q: &HashMap<String, String>, default: u32, max: u32) -> ApiResult<u32> {
    match q.get("limit") {
        None => Ok(default),
        Some(s) => match s.parse::<u32>() {
            Ok(n) if (1..=max).contains(&n) => Ok(n),
            _ => {
                Err(AdminError::invalid("limit", format!("limit must be an integer 1..={max}"))
                    .into())
            }
        },
    }
}

fn text_param(q: &HashMap<String, String>, name: &str) -> ApiResult<Option<String>> {
    match q.get(name) {
        Some(v) if v.is_empty() || v.len() > 256 => {
            Err(AdminError::invalid(name, format!("{name} must be 1-256 characters")).into())
        }
        v => Ok(v.cloned()),
    }
}

/// Announces a change to gateways: bump the version counter, then publish. A Redis failure
/// is logged, not returned: the change is committed, and gateways also poll the counter.
async fn announce(state: &ApiState, kind: &str, tenant: &str) {
    let Some(redis) = &state.redis else { return };
    let mut conn = redis.clone();
    let version: Result<i64, _> =
        redis::cmd("INCR").arg(CONTROL_VERSION_KEY).query_async(&mut conn).await;
    let result = match version {
        Ok(v) => {
            let msg = json!({"version": v, "kind": kind, "tenant_id": tenant}).to_string();
            redis::cmd("PUBLISH")
                .arg(CONTROL_CHANNEL)
                .arg(msg)
                .query_async::<i64>(&mut conn)
                .await
                .map(|_| ())
        }
        Err(e) => Err(e),
    };
    if let Err(e) = result {
        tracing::warn!(error = %e, kind, "could not announce a control-plane change");
    }
}

async fn dashboard_page() -> impl IntoResponse {
    (
        [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
        Html(include_str!("dashboard.html")),
    )
}

/// What the console's pages may load: their own script and the API, nothing from elsewhere.
const CONSOLE_POLICY: &str = concat!(
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; ",
    "connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; ",
    "base-uri 'none'"
);

async fn console_page() -> impl IntoResponse {
    (
        [
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            (header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONSOLE_POLICY)),
            (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
            (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        ],
        Html(include_str!("console.html")),
    )
}

async fn console_script() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/javascript; charset=utf-8")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
        include_str!("console.js"),
    )
}

async fn shared_styles() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, HeaderValue::from_static("text/css; charset=utf-8")),
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
        ],
        include_str!("ui.css"),
    )
}

/// `GET /v1/whoami`: the token's principal, so the console shows the pages its role reaches
/// (the API still checks every call).
async fn whoami(State(s): State<Arc<ApiState>>, headers: HeaderMap) -> ApiResult<Response> {
    let who =
        authorize(&s, &headers, &[Role::Ops, Role::Billing, Role::Auditor, Role::TenantAdmin])?;
    Ok(axum::Json(json!({"actor": who.actor, "role": who.role.as_str(), "tenant": who.tenant}))
        .into_response())
}

/// `GET /v1/tiers`: the quota tiers of `policies/tiers.json` and their values.
async fn tiers(State(s): State<Arc<ApiState>>, headers: HeaderMap) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    let data: Vec<Value> =
        TIERS.iter().map(|(name, q)| json!({"name": name, "settings": q})).collect();
    Ok(axum::Json(json!({"data": data})).into_response())
}

async fn dashboard_data(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Billing])?;
    let q = query(q, &["since", "until"])?;
    let until = time_param(&q, "until")?.unwrap_or_else(Utc::now);
    let since = time_param(&q, "since")?.unwrap_or(until - TimeDelta::days(7));
    if since >= until || until - since > TimeDelta::days(400) {
        return Err(AdminError::invalid(
            "since",
            "the window must be non-empty and at most 400 days",
        )
        .into());
    }
    Ok(axum::Json(s.ledger.dashboard(since, until).await?).into_response())
}

async fn list_tenants(State(s): State<Arc<ApiState>>, headers: HeaderMap) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Ops])?;
    Ok(axum::Json(json!({"data": s.ledger.list_tenants().await?})).into_response())
}

async fn get_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(s.ledger.tenant(&tenant).await?).into_response())
}

async fn create_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    let new: NewTenant = body(&bytes)?;
    let tenant = s.ledger.create_tenant(&who, &new).await?;
    announce(&s, "tenant", &tenant.id).await;
    Ok((StatusCode::CREATED, axum::Json(tenant)).into_response())
}

async fn update_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    let change: TenantChange = body(&bytes)?;
    let t = s.ledger.update_tenant(&who, &tenant, &change).await?;
    announce(&s, "tenant", &tenant).await;
    Ok(axum::Json(t).into_response())
}

async fn set_status(
    s: &ApiState,
    headers: &HeaderMap,
    tenant: &str,
    status: &str,
) -> ApiResult<Response> {
    let who = authorize(s, headers, &[Role::Ops])?;
    let t = s.ledger.set_tenant_status(&who, tenant, status).await?;
    announce(s, "tenant", tenant).await;
    Ok(axum::Json(t).into_response())
}

async fn suspend_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> ApiResult<Response> {
    set_status(&s, &headers, &tenant, "suspended").await
}

async fn activate_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> ApiResult<Response> {
    set_status(&s, &headers, &tenant, "active").await
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct IssueKey {
    #[serde(default)]
    scopes: Option<Vec<String>>,
    #[serde(default)]
    expires_at: Option<DateTime<Utc>>,
    #[serde(default)]
    limits: Limits,
}

async fn issue_key(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    let req: IssueKey = body(&bytes)?;
    let (key, secret) =
        s.ledger.issue_key(&who, &tenant, req.scopes, req.expires_at, req.limits).await?;
    announce(&s, "key", &tenant).await;
    let mut v = serde_json::to_value(&key).unwrap_or_else(|_| json!({}));
    if let Value::Object(m) = &mut v {
        m.insert("secret".into(), Value::from(secret));
    }
    Ok((
        StatusCode::CREATED,
        [(header::CACHE_CONTROL, HeaderValue::from_static("no-store"))],
        axum::Json(v),
    )
        .into_response())
}

async fn list_keys(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(json!({"data": s.ledger.list_keys(&tenant).await?})).into_response())
}

async fn revoke_key(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((tenant, key)): Path<(String, String)>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    let k = s.ledger.revoke_key(&who, &tenant, &key).await?;
    announce(&s, "key", &tenant).await;
    Ok(axum::Json(k).into_response())
}

async fn set_key_limits(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path((tenant, key)): Path<(String, String)>,
    bytes: Bytes,
) -> ApiResult<Response> {
    // A tenant admin may hold its own keys to less; a key never gets more than its tenant.
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    let limits: Limits = body(&bytes)?;
    let k = s.ledger.set_key_limits(&who, &tenant, &key, limits).await?;
    announce(&s, "key", &tenant).await;
    Ok(axum::Json(k).into_response())
}

async fn get_quota(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
) -> ApiResult<Response> {
    // A tenant admin reads its own limits; only ops changes them.
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(s.ledger.quota(&tenant).await?).into_response())
}

async fn set_quota(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Path(tenant): Path<String>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    let settings: QuotaSettings = body(&bytes)?;
    let q = s.ledger.set_quota(&who, &tenant, &settings).await?;
    announce(&s, "quota", &tenant).await;
    Ok(axum::Json(q).into_response())
}

fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => return String::new(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
}

async fn records(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Auditor])?;
    let q = query(
        q,
        &[
            "tenant",
            "key",
            "model",
            "model_revision",
            "finish_reason",
            "status",
            "since",
            "until",
            "limit",
            "cursor",
            "format",
        ],
    )?;
    let status =
        match q.get("status") {
            None => None,
            Some(v) => Some(v.parse::<u16>().ok().filter(|s| (100..=599).contains(s)).ok_or_else(
                || AdminError::invalid("status", "status must be an HTTP status code 100-599"),
            )?),
        };
    let filter = RecordFilter {
        tenant: text_param(&q, "tenant")?,
        key: text_param(&q, "key")?,
        model: text_param(&q, "model")?,
        model_revision: text_param(&q, "model_revision")?,
        finish_reason: text_param(&q, "finish_reason")?,
        status,
        since: time_param(&q, "since")?,
        until: time_param(&q, "until")?,
        after: q.get("cursor").map(|c| decode_cursor(c)).transpose()?,
        limit: limit_param(&q, 100, 10_000)?,
    };
    let page = s.ledger.records(&filter).await?;
    let cursor_header = page.next_cursor.as_deref().and_then(|c| HeaderValue::from_str(c).ok());
    let format = q.get("format").map(String::as_str).unwrap_or("json");
    let mut resp = match format {
        "json" => axum::Json(&page).into_response(),
        "jsonl" => {
            let mut out = String::new();
            for r in &page.records {
                out.push_str(&Value::Object(r.clone()).to_string());
                out.push('\n');
            }
            ([(header::CONTENT_TYPE, "application/x-ndjson")], out).into_response()
        }
        "csv" => {
            let names: Vec<&str> = RECORD_COLUMNS.iter().map(|(n, _)| *n).collect();
            let mut out = names.join(",");
            out.push('\n');
            for r in &page.records {
                let row: Vec<String> =
                    names.iter().map(|n| csv_field(r.get(*n).unwrap_or(&Value::Null))).collect();
                out.push_str(&row.join(","));
                out.push('\n');
            }
            ([(header::CONTENT_TYPE, "text/csv; charset=utf-8")], out).into_response()
        }
        _ => return Err(AdminError::invalid("format", "format must be json, jsonl or csv").into()),
    };
    if let Some(c) = cursor_header {
        resp.headers_mut().insert("x-next-cursor", c);
    }
    Ok(resp)
}

/// `GET /v1/audit/reconcile?since=`: the hour rollups against the rows they count.
async fn reconcile(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Auditor, Role::Billing])?;
    let q = query(q, &["since"])?;
    let since = time_param(&q, "since")?.unwrap_or_else(|| Utc::now() - TimeDelta::days(1));
    Ok(axum::Json(s.ledger.reconcile_rollups(since).await?).into_response())
}

async fn audit_log(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    // Ops sees the changes it made, beside the auditors who review them.
    authorize(&s, &headers, &[Role::Auditor, Role::Ops])?;
    let q = query(q, &["since", "until", "actor", "target", "limit", "cursor"])?;
    let after =
        match q.get("cursor") {
            None => None,
            Some(c) => Some(c.parse::<i64>().ok().filter(|n| *n >= 0).ok_or_else(|| {
                AdminError::invalid("cursor", "cursor is not one this API returned")
            })?),
        };
    let limit = limit_param(&q, 100, 10_000)?;
    let entries = s
        .ledger
        .audit_log(&AuditFilter {
            after,
            since: time_param(&q, "since")?,
            until: time_param(&q, "until")?,
            actor: text_param(&q, "actor")?,
            target: text_param(&q, "target")?,
            limit: i64::from(limit),
        })
        .await?;
    let next = (entries.len() == limit as usize)
        .then(|| entries.last().map(|e| e.id.to_string()))
        .flatten();
    Ok(axum::Json(json!({"data": entries, "next_cursor": next})).into_response())
}

async fn usage(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Billing, Role::TenantAdmin])?;
    let q = query(q, &["tenant", "model", "period", "since", "until"])?;
    let mut tenant = text_param(&q, "tenant")?;
    if who.role == Role::TenantAdmin {
        match &tenant {
            Some(t) => check_tenant(&who, t)?,
            None => tenant = who.tenant.clone(),
        }
    }
    let period = q.get("period").cloned().unwrap_or_else(|| "day".into());
    if period != "hour" && period != "day" {
        return Err(AdminError::invalid("period", "period must be hour or day").into());
    }
    let rows = s
        .ledger
        .usage(&UsageFilter {
            period: period.clone(),
            tenant,
            model: text_param(&q, "model")?,
            since: time_param(&q, "since")?,
            until: time_param(&q, "until")?,
        })
        .await?;
    // `requests` and the sums are billed usage; refused requests are counted apart.
    let mut totals = json!({"requests": 0i64, "prompt_tokens": 0i64, "cached_prompt_tokens": 0i64, "completion_tokens": 0i64, "cost_micros": 0i64, "refused_requests": 0i64});
    for r in &rows {
        for (k, v) in [
            ("requests", r.requests),
            ("prompt_tokens", r.prompt_tokens),
            ("cached_prompt_tokens", r.cached_prompt_tokens),
            ("completion_tokens", r.completion_tokens),
            ("cost_micros", r.cost_micros),
            ("refused_requests", r.refused_requests),
        ] {
            totals[k] = Value::from(totals[k].as_i64().unwrap_or(0).saturating_add(v));
        }
    }
    Ok(axum::Json(json!({"period": period, "data": rows, "totals": totals})).into_response())
}

/// Readiness: not draining, and the ledger's database answers within two seconds. A billing
/// service that cannot write leaves the load balancer; its stream consumers pick the backlog
/// up again when the database returns.
async fn readyz(State(state): State<Arc<ApiState>>) -> Response {
    if state.service.draining() {
        return not_ready("draining");
    }
    match tokio::time::timeout(std::time::Duration::from_secs(2), state.ledger.ping()).await {
        Ok(Ok(())) => axum::Json(json!({"status": "ready"})).into_response(),
        Ok(Err(e)) => {
            tracing::warn!(error = %e, "readiness: the database did not answer");
            not_ready("database_unavailable")
        }
        Err(_) => not_ready("database_timeout"),
    }
}

fn not_ready(reason: &str) -> Response {
    (StatusCode::SERVICE_UNAVAILABLE, axum::Json(json!({"status": reason}))).into_response()
}

/// Prometheus metrics (text exposition, unauthenticated like the probes: counts only, no
/// tenant data): the usage consumer's counters, the group's pending entries (read but not yet
/// acknowledged: the backlog a dead consumer leaves until it is claimed), whether the database
/// answers and whether shutdown began.
async fn metrics(State(state): State<Arc<ApiState>>) -> Response {
    let mut out = String::new();
    let mut family = |name: &str, kind: &str, help: &str, value: f64| {
        let _ = write!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n");
    };
    let up = matches!(
        tokio::time::timeout(std::time::Duration::from_secs(2), state.ledger.ping()).await,
        Ok(Ok(()))
    );
    family(
        "sluice_billing_database_up",
        "gauge",
        "Whether the ledger database answered a ping within 2 s.",
        f64::from(u8::from(up)),
    );
    family(
        "sluice_billing_draining",
        "gauge",
        "Whether shutdown began (readiness fails while it drains).",
        f64::from(u8::from(state.service.draining())),
    );
    if let Some(c) = state.service.consumer.get() {
        let s = &c.stats;
        // Whole names, so a search of the source finds each exported metric.
        for (name, help, v) in [
            (
                "sluice_billing_ingest_batches_total",
                "Usage batches committed and acknowledged.",
                s.committed_batches(),
            ),
            (
                "sluice_billing_ingest_inserted_total",
                "Usage events that became new ledger rows.",
                s.inserted(),
            ),
            (
                "sluice_billing_ingest_duplicates_total",
                "Usage events the ledger already held (redeliveries).",
                s.duplicates(),
            ),
            (
                "sluice_billing_ingest_dead_lettered_total",
                "Entries moved to the dead-letter stream.",
                s.dead_lettered(),
            ),
            (
                "sluice_billing_ingest_claimed_total",
                "Pending entries taken over (own after a restart, or others').",
                s.claimed(),
            ),
            (
                "sluice_billing_ingest_database_failures_total",
                "Failed ledger writes that were retried.",
                s.database_failures(),
            ),
        ] {
            family(name, "counter", help, v as f64);
        }
        if let Some(redis) = &state.redis {
            let mut conn = redis.clone();
            let pending = tokio::time::timeout(
                std::time::Duration::from_secs(1),
                redis::cmd("XPENDING")
                    .arg(&c.stream)
                    .arg(&c.group)
                    .query_async::<redis::Value>(&mut conn),
            )
            .await;
            // The summary form's first element is the count.
            if let Ok(Ok(redis::Value::Array(v))) = pending
                && let Some(redis::Value::Int(n)) = v.first()
            {
                family(
                    "sluice_billing_stream_pending",
                    "gauge",
                    "Usage entries read by the group's consumers and not yet acknowledged.",
                    *n as f64,
                );
            }
        }
    }
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], out).into_response()
}
