//! The billing service's HTTP API: admin (tenants, keys, quotas), audit (records, audit log,
//! exports), usage, the dashboard and the console. Every route but `/health` and the pages
//! (the dashboard's and the console's HTML, script and styles) needs a bearer JWT (see [`crate::auth`]); each route names the roles it admits, and a
//! `tenant-admin` only ever reaches its own tenant. Errors are OpenAI-style JSON naming the
//! parameter.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::middleware::Next;
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post, put};
use chrono::{DateTime, Datelike, NaiveDate, TimeDelta, Utc};
use futures_util::FutureExt as _;
use serde::Deserialize;
use serde::de::DeserializeOwned;
use serde_json::{Value, json};

use crate::Ledger;
use crate::auth::{AuthError, Principal, Role, Verifier};
use crate::control::{AdminError, Limits, NewTenant, QuotaSettings, TIERS, TenantChange};
use crate::ingest::ConsumerStats;
use crate::query::{AuditFilter, RECORD_COLUMNS, RecordFilter, UsageFilter, decode_cursor};
use crate::redis_conn::Namespace;

/// Shared state of the API.
pub struct ApiState {
    /// The database.
    pub ledger: Ledger,
    /// Token verification.
    pub verifier: Verifier,
    /// Where control-plane changes are announced, when configured: the connection, and
    /// the deployment's namespace, whose channel ([`Namespace::control_channel`]) and
    /// counter ([`Namespace::control_version_key`], bumped on every change: gateways may poll
    /// it) they go to.
    pub redis: Option<(crate::redis_conn::RedisConn, Namespace)>,
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
        .route("/v1/tenants/{tenant}/adapters", get(list_adapters).post(register_adapter))
        .route("/v1/tenants/{tenant}/adapters/{name}/retire", post(retire_adapter))
        .route("/v1/tenants/{tenant}/adapters/{name}/sharing", put(share_adapter))
        .route("/v1/records", get(records))
        .route("/v1/audit-log", get(audit_log))
        .route("/v1/audit/reconcile", get(reconcile))
        .route("/v1/usage", get(usage))
        .fallback(|| async { ApiError(AdminError::NotFound("no such route".into())) })
        .with_state(state)
        .layer(axum::middleware::from_fn(catch_panic))
}

/// The last line of defence: a handler that panics answers 500 in the API's error shape
/// instead of dropping the connection. Every refusal of bad input is a 400 of its own; this
/// only turns a bug into an answer (the server keeps serving either way).
pub async fn catch_panic(request: Request, next: Next) -> Response {
    let (method, path) = (request.method().clone(), request.uri().path().to_owned());
    match AssertUnwindSafe(next.run(request)).catch_unwind().await {
        Ok(response) => response,
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| (*s).to_owned())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_default();
            tracing::error!(%method, path, panic = what, "a billing API handler panicked");
            error_response(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "the billing service failed on this request",
                None,
            )
        }
    }
}

/// An OpenAI-style error: `{"error": {"message", "type", "param", "code"}}`.
fn error_response(status: StatusCode, kind: &str, message: &str, param: Option<&str>) -> Response {
    let code = status.as_u16().to_string();
    let body = sluice_wire::ErrorBody::new(message, kind, param, Some(&code));
    (status, axum::Json(body)).into_response()
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
        error_response(status, kind, &message, param.as_deref())
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
        let message = if known.is_empty() {
            format!("unknown query parameter {k:?} (this route takes none)")
        } else {
            format!("unknown query parameter {k:?} (known: {})", known.join(", "))
        };
        return Err(AdminError::invalid(k, message).into());
    }
    Ok(params)
}

/// A route that takes no query parameters refuses any, naming it (as the others refuse names
/// they do not know).
fn no_query(params: HashMap<String, String>) -> ApiResult<()> {
    query(params, &[]).map(drop)
}

/// Path parameters (a tenant id, a key id), each held to the rules of a filter value
/// ([`check_text`]); a path axum cannot decode is a 400 in the API's error shape too.
struct ApiPath<T>(T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for ApiPath<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let refused = |e: axum::extract::rejection::PathRejection| {
            ApiError(AdminError::invalid("path", format!("invalid path: {}", e.body_text())))
        };
        let Path(raw) = Path::<Vec<(String, String)>>::from_request_parts(parts, state)
            .await
            .map_err(refused)?;
        for (name, value) in &raw {
            check_text(name, value)?;
        }
        let Path(value) = Path::<T>::from_request_parts(parts, state).await.map_err(refused)?;
        Ok(Self(value))
    }
}

/// RFC 3339, a date (`2026-11-29`, UTC midnight), or an age (`30m`, `24h`, `7d`) before now;
/// years 1 to 9999 (what RFC 3339 writes), so every window computed from it stays inside
/// chrono's range and the databases'.
pub fn parse_time(param: &str, s: &str) -> Result<DateTime<Utc>, AdminError> {
    let at = if let Ok(t) = DateTime::parse_from_rfc3339(s) {
        Some(t.with_timezone(&Utc))
    } else if let Ok(d) = NaiveDate::parse_from_str(s, "%Y-%m-%d") {
        d.and_hms_opt(0, 0, 0).map(|t| t.and_utc())
    } else {
        age(s).map(|d| Utc::now() - d)
    };
    at.filter(|t| (1..=9999).contains(&t.year())).ok_or_else(|| bad_time(param))
}

/// `30s`, `30m`, `24h`, `7d`: a whole number up to 100,000, then the unit.
fn age(s: &str) -> Option<TimeDelta> {
    // The unit is the last character, whatever its width in bytes.
    let mut chars = s.chars();
    let unit = chars.next_back()?;
    let n = chars.as_str().parse::<i64>().ok().filter(|n| (0..=100_000).contains(n))?;
    match unit {
        's' => Some(TimeDelta::seconds(n)),
        'm' => Some(TimeDelta::minutes(n)),
        'h' => Some(TimeDelta::hours(n)),
        'd' => Some(TimeDelta::days(n)),
        _ => None,
    }
}

fn bad_time(param: &str) -> AdminError {
    AdminError::invalid(
        param,
        format!(
            "{param} must be RFC 3339 or YYYY-MM-DD (years 1-9999), or an age like 24h or 7d \
             (s, m, h or d, at most 100000)"
        ),
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

/// A filter value or path segment: 1-256 characters, none of them NUL (which Postgres text
/// cannot hold: the query would fail rather than match nothing).
fn check_text(name: &str, value: &str) -> Result<(), AdminError> {
    if value.is_empty() || value.chars().count() > 256 || value.contains('\0') {
        return Err(AdminError::invalid(
            name,
            format!("{name} must be 1-256 characters, none of them NUL"),
        ));
    }
    Ok(())
}

fn text_param(q: &HashMap<String, String>, name: &str) -> ApiResult<Option<String>> {
    let Some(value) = q.get(name) else { return Ok(None) };
    check_text(name, value)?;
    Ok(Some(value.clone()))
}

/// Announces a change to gateways: bump the version counter, then publish. A Redis failure
/// is logged, not returned: the change is committed, and gateways also poll the counter.
async fn announce(state: &ApiState, kind: &str, tenant: &str) {
    let Some((redis, namespace)) = &state.redis else { return };
    let mut conn = redis.clone();
    let version: Result<i64, _> =
        redis::cmd("INCR").arg(namespace.control_version_key()).query_async(&mut conn).await;
    let result = match version {
        Ok(v) => {
            let msg = json!({"version": v, "kind": kind, "tenant_id": tenant}).to_string();
            redis::cmd("PUBLISH")
                .arg(namespace.control_channel())
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

/// What the console's and the dashboard's pages may load: the script `script_src` admits,
/// their own styles and the API, nothing from elsewhere; no forms posted, no framing.
fn page_policy(script_src: &str) -> String {
    format!(
        "default-src 'none'; script-src {script_src}; style-src 'self' 'unsafe-inline'; \
         connect-src 'self'; img-src 'self' data:; form-action 'none'; frame-ancestors 'none'; \
         base-uri 'none'"
    )
}

/// A page that reads the admin token, with the headers both such pages carry: not cached, its
/// content security policy, no referrer, never framed.
fn token_page(script_src: &str, html: String) -> Response {
    let Ok(policy) = HeaderValue::from_str(&page_policy(script_src)) else {
        return error_response(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            "the page's content security policy is not a header value",
            None,
        );
    };
    (
        [
            (header::CACHE_CONTROL, HeaderValue::from_static("no-store")),
            (header::CONTENT_SECURITY_POLICY, policy),
            (header::REFERRER_POLICY, HeaderValue::from_static("no-referrer")),
            (header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY")),
        ],
        Html(html),
    )
        .into_response()
}

/// The dashboard's one script is inline: the policy admits it by a nonce drawn per response
/// (OS randomness), so the page gets the console's policy without a script file of its own.
async fn dashboard_page() -> Response {
    let nonce = uuid::Uuid::new_v4().simple().to_string();
    let html = include_str!("dashboard.html").replacen(
        "<script>",
        &format!("<script nonce=\"{nonce}\">"),
        1,
    );
    token_page(&format!("'nonce-{nonce}'"), html)
}

async fn console_page() -> Response {
    token_page("'self'", include_str!("console.html").to_owned())
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
async fn whoami(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who =
        authorize(&s, &headers, &[Role::Ops, Role::Billing, Role::Auditor, Role::TenantAdmin])?;
    no_query(q)?;
    Ok(axum::Json(json!({"actor": who.actor, "role": who.role.as_str(), "tenant": who.tenant}))
        .into_response())
}

/// `GET /v1/tiers`: the quota tiers of `policies/tiers.json` and their values.
async fn tiers(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
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
    let (since, until) = (time_param(&q, "since")?, time_param(&q, "until")?);
    // Without `since`, the window is the week before `until`: `until` is then the one to blame.
    let since_param = if since.is_some() { "since" } else { "until" };
    let until = until.unwrap_or_else(Utc::now);
    let since = since.unwrap_or(until - TimeDelta::days(7));
    if since >= until || until - since > TimeDelta::days(400) {
        return Err(AdminError::invalid(
            since_param,
            "the window must be non-empty and at most 400 days",
        )
        .into());
    }
    // The window is cut into hours or days in nanoseconds since 1970, which reach 1677 to 2262.
    for (at, param) in [(since, since_param), (until, "until")] {
        if at.timestamp_nanos_opt().is_none() {
            return Err(AdminError::invalid(
                param,
                "the dashboard's window must lie between 1677-09-22 and 2262-04-11",
            )
            .into());
        }
    }
    Ok(axum::Json(s.ledger.dashboard(since, until).await?).into_response())
}

async fn list_tenants(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Ops])?;
    no_query(q)?;
    Ok(axum::Json(json!({"data": s.ledger.list_tenants().await?})).into_response())
}

async fn get_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(s.ledger.tenant(&tenant).await?).into_response())
}

async fn create_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    no_query(q)?;
    let new: NewTenant = body(&bytes)?;
    let tenant = s.ledger.create_tenant(&who, &new).await?;
    announce(&s, "tenant", &tenant.id).await;
    Ok((StatusCode::CREATED, axum::Json(tenant)).into_response())
}

async fn update_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    no_query(q)?;
    let change: TenantChange = body(&bytes)?;
    let t = s.ledger.update_tenant(&who, &tenant, &change).await?;
    announce(&s, "tenant", &tenant).await;
    Ok(axum::Json(t).into_response())
}

async fn set_status(
    s: &ApiState,
    headers: &HeaderMap,
    q: HashMap<String, String>,
    tenant: &str,
    status: &str,
) -> ApiResult<Response> {
    let who = authorize(s, headers, &[Role::Ops])?;
    no_query(q)?;
    let t = s.ledger.set_tenant_status(&who, tenant, status).await?;
    announce(s, "tenant", tenant).await;
    Ok(axum::Json(t).into_response())
}

async fn suspend_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    set_status(&s, &headers, q, &tenant, "suspended").await
}

async fn activate_tenant(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    set_status(&s, &headers, q, &tenant, "active").await
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
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
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

/// `POST /v1/tenants/{tenant}/adapters`: registers a revision of one of the tenant's
/// adapters, whose files the caller has checked and put in the engines' store.
async fn register_adapter(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    let req: crate::adapters::NewAdapter = body(&bytes)?;
    let a = s.ledger.register_adapter(&who, &tenant, &req).await?;
    announce(&s, "adapter", &tenant).await;
    Ok((StatusCode::CREATED, axum::Json(a)).into_response())
}

/// `GET /v1/tenants/{tenant}/adapters`: the tenant's adapters and those shared with it.
async fn list_adapters(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin, Role::Auditor])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(json!({"data": s.ledger.list_adapters(&tenant).await?})).into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct RetireAdapter {
    #[serde(default)]
    revision: Option<String>,
}

/// `POST /v1/tenants/{tenant}/adapters/{name}/retire`: one revision (`{"revision"}`), or
/// every active one (an empty body).
async fn retire_adapter(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath((tenant, name)): ApiPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    let req: RetireAdapter = if bytes.iter().all(u8::is_ascii_whitespace) {
        RetireAdapter { revision: None }
    } else {
        body(&bytes)?
    };
    let retired = s.ledger.retire_adapter(&who, &tenant, &name, req.revision.as_deref()).await?;
    announce(&s, "adapter", &tenant).await;
    Ok(axum::Json(json!({"data": retired})).into_response())
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct ShareAdapter {
    shared_with: Vec<String>,
}

/// `PUT /v1/tenants/{tenant}/adapters/{name}/sharing`: the other tenants that may use it.
async fn share_adapter(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath((tenant, name)): ApiPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    let req: ShareAdapter = body(&bytes)?;
    let with = s.ledger.share_adapter(&who, &tenant, &name, &req.shared_with).await?;
    announce(&s, "adapter", &tenant).await;
    Ok(axum::Json(json!({"tenant_id": tenant, "name": name, "shared_with": with})).into_response())
}

async fn list_keys(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(json!({"data": s.ledger.list_keys(&tenant).await?})).into_response())
}

async fn revoke_key(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath((tenant, key)): ApiPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    let k = s.ledger.revoke_key(&who, &tenant, &key).await?;
    announce(&s, "key", &tenant).await;
    Ok(axum::Json(k).into_response())
}

async fn set_key_limits(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath((tenant, key)): ApiPath<(String, String)>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    // A tenant admin may hold its own keys to less; a key never gets more than its tenant.
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    let limits: Limits = body(&bytes)?;
    let k = s.ledger.set_key_limits(&who, &tenant, &key, limits).await?;
    announce(&s, "key", &tenant).await;
    Ok(axum::Json(k).into_response())
}

async fn get_quota(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    // A tenant admin reads its own limits; only ops changes them.
    let who = authorize(&s, &headers, &[Role::Ops, Role::TenantAdmin])?;
    no_query(q)?;
    check_tenant(&who, &tenant)?;
    Ok(axum::Json(s.ledger.quota(&tenant).await?).into_response())
}

async fn set_quota(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    ApiPath(tenant): ApiPath<String>,
    Query(q): Query<HashMap<String, String>>,
    bytes: Bytes,
) -> ApiResult<Response> {
    let who = authorize(&s, &headers, &[Role::Ops])?;
    no_query(q)?;
    let settings: QuotaSettings = body(&bytes)?;
    let q = s.ledger.set_quota(&who, &tenant, &settings).await?;
    announce(&s, "quota", &tenant).await;
    Ok(axum::Json(q).into_response())
}

/// One CSV cell. Text a spreadsheet would run as a formula (it begins with `=`, `+`, `-`, `@`,
/// a tab or a carriage return) gets a leading `'`, as OWASP recommends; only text: numbers
/// stay numbers, so a negative one is still `-5`.
fn csv_field(v: &Value) -> String {
    let s = match v {
        Value::Null => return String::new(),
        Value::String(s) if s.starts_with(['=', '+', '-', '@', '\t', '\r']) => format!("'{s}"),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s }
}

/// The query parameters `GET /v1/records` takes; any other is a 400 naming it.
pub const RECORDS_QUERY: &[&str] = &[
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
    "user",
    "adapter",
];

async fn records(
    State(s): State<Arc<ApiState>>,
    headers: HeaderMap,
    Query(q): Query<HashMap<String, String>>,
) -> ApiResult<Response> {
    authorize(&s, &headers, &[Role::Auditor])?;
    let q = query(q, RECORDS_QUERY)?;
    // An end user's rows: the ledger holds the hash of the tenant and the `user` value.
    let tenant = text_param(&q, "tenant")?;
    let user_sha256 = match (text_param(&q, "user")?, &tenant) {
        (None, _) => None,
        (Some(u), Some(t)) => Some(crate::event::user_sha256(t, &u)),
        (Some(_), None) => {
            return Err(AdminError::invalid(
                "user",
                "user needs tenant: the ledger keeps each user hashed with its tenant",
            )
            .into());
        }
    };
    let status =
        match q.get("status") {
            None => None,
            Some(v) => Some(v.parse::<u16>().ok().filter(|s| (100..=599).contains(s)).ok_or_else(
                || AdminError::invalid("status", "status must be an HTTP status code 100-599"),
            )?),
        };
    let filter = RecordFilter {
        tenant,
        key: text_param(&q, "key")?,
        model: text_param(&q, "model")?,
        model_revision: text_param(&q, "model_revision")?,
        user_sha256,
        finish_reason: text_param(&q, "finish_reason")?,
        adapter: text_param(&q, "adapter")?,
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
        if let Some((redis, _)) = &state.redis {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn time_parameters_parse_or_name_the_parameter() {
        for (text, hours_ago) in [("30s", 0), ("90m", 1), ("24h", 24), ("7d", 168), ("0d", 0)] {
            let t = parse_time("since", text).map_err(|e| e.to_string());
            // Read after the parse: at least the age has passed since, and far less than an
            // hour more.
            let ago = t.map(|t| (Utc::now() - t).num_hours());
            assert_eq!(ago, Ok(hours_ago), "{text:?}");
        }
        let midnight = NaiveDate::from_ymd_opt(2026, 11, 29).and_then(|d| d.and_hms_opt(0, 0, 0));
        assert_eq!(parse_time("since", "2026-11-29").ok(), midnight.map(|t| t.and_utc()));
        assert!(parse_time("since", "2026-11-29T10:00:00+02:00").is_ok());
        // A last character of several bytes once cut the string inside it (a panic).
        for bad in [
            "1é",
            "é",
            "24ħ",
            "7日",
            "🦀",
            "1🦀",
            "",
            "d",
            "-1d",
            "100001d",
            "1.5h",
            "1 h",
            "24H",
            "99999999999999999999d",
            "0000-12-31",
            "10000-01-01",
            "+10000-01-01",
            "-262143-01-01",
            "0001-01-01T00:00:00+00:01",
            "yesterday",
            "%",
            "\0",
        ] {
            let got = parse_time("until", bad);
            let named = matches!(&got, Err(AdminError::Invalid { param, .. }) if param == "until");
            assert!(named, "{bad:?} gave {got:?}");
        }
        assert!(
            parse_time("since", "0001-01-01").is_ok() && parse_time("since", "9999-12-31").is_ok()
        );
    }

    #[test]
    fn csv_cells_never_carry_a_formula_and_numbers_stay_numbers() {
        for (value, cell) in [
            (
                json!("=HYPERLINK(\"http://x\",\"y\")"),
                "\"'=HYPERLINK(\"\"http://x\"\",\"\"y\"\")\"",
            ),
            (json!("+1+1"), "'+1+1"),
            (json!("-2+3"), "'-2+3"),
            (json!("-5"), "'-5"),
            (json!("@SUM(A1)"), "'@SUM(A1)"),
            (json!("\tcmd"), "'\tcmd"),
            (json!("\rcmd"), "\"'\rcmd\""),
            (json!("a=b"), "a=b"),
            (json!("smollm2"), "smollm2"),
            (json!("a,b"), "\"a,b\""),
            (json!(-5), "-5"),
            (json!(-1.5), "-1.5"),
            (json!(42), "42"),
            (json!(false), "false"),
            (Value::Null, ""),
        ] {
            assert_eq!(csv_field(&value), cell, "{value}");
        }
    }

    #[test]
    fn text_parameters_refuse_nul_and_lengths_in_characters() {
        assert!(check_text("model", "m").is_ok());
        assert!(check_text("model", &"é".repeat(256)).is_ok());
        for bad in [String::new(), "é".repeat(257), "a\0b".to_owned()] {
            let got = check_text("model", &bad);
            let named = matches!(&got, Err(AdminError::Invalid { param, .. }) if param == "model");
            assert!(named, "{bad:?} gave {got:?}");
        }
    }

    /// A handler that panics answers a 500 in the API's error shape, and the server goes on.
    #[tokio::test]
    async fn a_panicking_handler_answers_500_and_the_server_keeps_serving() -> anyhow::Result<()> {
        #[expect(clippy::panic, reason = "the handler stands for a bug the layer must contain")]
        async fn bug() -> &'static str {
            panic!("a bug in a handler")
        }
        let app = Router::new()
            .route("/bug", get(bug))
            .route("/fine", get(|| async { "fine" }))
            .layer(axum::middleware::from_fn(catch_panic));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        let server = tokio::spawn(async move { axum::serve(listener, app).await });
        let http = reqwest::Client::new();
        for _ in 0..3 {
            let resp = http.get(format!("{base}/bug")).send().await?;
            assert_eq!(resp.status(), StatusCode::INTERNAL_SERVER_ERROR);
            let v: Value = resp.json().await?;
            assert_eq!(v["error"]["type"], "server_error", "{v}");
            assert_eq!(v["error"]["code"], "500", "{v}");
            assert!(v["error"]["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
            let fine = http.get(format!("{base}/fine")).send().await?;
            assert_eq!(fine.status(), StatusCode::OK);
        }
        server.abort();
        Ok(())
    }
}
