//! The OpenAI-compatible HTTP server of an engine worker (`sluice engine`).
//!
//! Routes: `POST /v1/completions`, `POST /v1/chat/completions`, `GET /v1/models[/{id}]`,
//! `GET /health`, `GET /metrics`, and for gateways `GET /v1/internal/text` (the model's
//! tokenizer and chat template, [`ModelText::bundle`]), `GET /v1/internal/load` (an
//! [`EngineLoad`]) and the requests' outcomes; every path is a [`sluice_wire::route`].
//! Every `/v1` request passes one middleware that checks the internal token, reads the
//! trusted internal headers into a [`RequestContext`] and stamps the execution identity and
//! request id on the response. Handlers turn the body into a checked [`validate::Plan`],
//! submit one engine request per choice and answer with one body or an SSE stream that owns
//! the engine streams (dropping it aborts the work).
//!
//! The server knows nothing about tenants' keys or billing: the gateway authenticates and
//! sends the tenant as a header; without `x-sluice-tenant` a request shares cache with nobody.

pub mod adapters;
pub mod context;
pub mod error;
pub mod openai;
pub mod respond;
pub mod validate;

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Extension, Path, Request, State};
use axum::http::{HeaderName, HeaderValue, Method, Uri, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Serialize;
use serde_json::Value;
use sluice_text::model::ModelText;
use sluice_text::tokenizer::PROMPT_FIELD;
use sluice_wire::header::{
    EXECUTION_IDENTITY as IDENTITY_HEADER, MODEL_REVISION as MODEL_REVISION_HEADER,
    REQUEST_ID as REQUEST_ID_HEADER,
};
use sluice_wire::{EngineLoad, Outcomes, route};

use crate::defaults::SamplingDefaults;
use crate::serve::RequestAdapter;
use crate::serve::core::EngineStats;
use crate::serve::handle::EngineHandle;
use crate::server::adapters::AdapterSet;
use crate::server::context::{InternalToken, RequestContext};
use crate::server::error::ApiError;
use crate::server::openai::{ModelCard, ModelCardExt};
use crate::server::respond::{Endpoint, Shaper};
use crate::server::validate::Limits;

/// Largest request body accepted.
pub const MAX_BODY_BYTES: usize = 4 << 20;

/// How long shutdown waits for open requests before aborting them, unless configured.
pub const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(30);

/// After the drain, how long aborted requests have to send their last events.
const AFTER_ABORT: Duration = Duration::from_secs(5);

/// Server settings (engine sizes are the engine's own config).
#[derive(Clone)]
pub struct ServerConfig {
    /// Name the model is served under (default: the execution identity's model id).
    pub served_model_name: Option<String>,
    /// When set, `/v1` requests must carry `Authorization: Bearer <token>`.
    pub internal_token: Option<String>,
    /// Most choices (`n`) per request: by default the platform's one cap,
    /// `sluice_billing::control::MAX_N`, which every tier and override stays within.
    pub max_n: usize,
    /// Most log-probability alternatives per token.
    pub max_logprobs: usize,
    /// The content-addressed adapter store tenants' adapters are read from
    /// ([`adapters::AdapterSet`]); without one, a request naming an adapter is a 404.
    pub adapter_store: Option<std::path::PathBuf>,
    /// Bytes the resident adapters may take together.
    pub adapter_memory_bytes: usize,
}

/// Adapter memory unless configured: 512 MiB, some hundred rank-16 adapters of an 8B model's
/// attention projections, thousands of the default model's.
pub const DEFAULT_ADAPTER_MEMORY_BYTES: usize = 512 << 20;

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            served_model_name: None,
            internal_token: None,
            max_n: 16,
            max_logprobs: 20,
            adapter_store: None,
            adapter_memory_bytes: DEFAULT_ADAPTER_MEMORY_BYTES,
        }
    }
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("served_model_name", &self.served_model_name)
            .field("internal_token", &self.internal_token.as_ref().map(|_| "<redacted>"))
            .field("max_n", &self.max_n)
            .field("max_logprobs", &self.max_logprobs)
            .field("adapter_store", &self.adapter_store)
            .field("adapter_memory_bytes", &self.adapter_memory_bytes)
            .finish()
    }
}

/// Whether each finished request is logged on stderr (one line of ids, counts and outcome;
/// never prompt text). Benchmarks turn it off.
pub static REQUEST_LOG: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

struct App {
    handle: EngineHandle,
    served_name: String,
    token: Option<InternalToken>,
    limits: Limits,
    identity_header: Option<HeaderValue>,
    revision_header: Option<HeaderValue>,
    adapters: Option<Arc<AdapterSet>>,
    started: u64,
    /// The same instant in milliseconds: a request billed within the second this engine
    /// started may have run on the process before it, on the same address.
    started_ms: u64,
}

/// The server's routes over a running engine.
pub fn router(handle: EngineHandle, cfg: ServerConfig) -> Router {
    let model = Arc::clone(handle.model());
    let identity = &model.identity;
    let served_name = cfg.served_model_name.clone().unwrap_or_else(|| identity.model_id.clone());
    let sampling = SamplingDefaults::for_model(&model.recommended, &served_name);
    tracing::info!(
        model = %served_name,
        temperature = sampling.temperature,
        top_p = sampling.top_p,
        top_k = sampling.top_k,
        min_p = sampling.min_p,
        "sampling defaults (for parameters a request leaves out)"
    );
    let app = Arc::new(App {
        served_name,
        token: cfg.internal_token.as_deref().map(InternalToken::new),
        limits: Limits {
            context_length: model.weights.config.context_length,
            capacity_tokens: handle.capacity_tokens(),
            vocab_size: model.tokenizer.vocab_size().min(model.weights.config.vocab_size),
            max_n: cfg.max_n,
            max_logprobs: cfg.max_logprobs,
            sampling,
        },
        identity_header: HeaderValue::from_str(&identity.header_value()).ok(),
        adapters: cfg.adapter_store.clone().map(|store| {
            Arc::new(AdapterSet::new(store, model.weights.config.clone(), cfg.adapter_memory_bytes))
        }),
        revision_header: HeaderValue::from_str(&identity.model_revision).ok(),
        started: unix_now(),
        started_ms: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        handle,
    });
    let v1 = Router::new()
        .route(route::COMPLETIONS, post(completions))
        .route(route::CHAT_COMPLETIONS, post(chat_completions))
        .route(route::MODELS, get(models))
        .route(route::MODEL, get(model_card))
        .route(route::OUTCOME, get(outcome))
        .route(route::ABORT, post(abort))
        .route(route::OUTCOMES, get(outcomes))
        .route(route::TEXT, get(text_bundle))
        .route(route::LOAD, get(load))
        // Long-context prompts: above the gateway's 2 MiB cap, so the gateway's is the one hit.
        .layer(axum::extract::DefaultBodyLimit::max(MAX_BODY_BYTES))
        .layer(middleware::from_fn_with_state(Arc::clone(&app), api_layer));
    Router::new()
        .route(route::HEALTH, get(health))
        .route(route::LIVEZ, get(livez))
        .route(route::READYZ, get(readyz))
        .route(route::METRICS, get(metrics))
        .merge(v1)
        .fallback(no_route)
        .method_not_allowed_fallback(wrong_method)
        .with_state(app)
}

/// The engine's listener, TCP_NODELAY on every connection it accepts: each token's event
/// goes out as written. Without it, Nagle's algorithm holds a small write until the last one
/// is acknowledged, and a client delaying its ACKs turns that into tens of milliseconds of
/// TTFT and tokens arriving in bursts.
pub fn no_delay(
    listener: tokio::net::TcpListener,
) -> axum::serve::TapIo<tokio::net::TcpListener, fn(&mut tokio::net::TcpStream)> {
    use axum::serve::ListenerExt;
    listener.tap_io(set_no_delay as fn(&mut tokio::net::TcpStream))
}

fn set_no_delay(tcp: &mut tokio::net::TcpStream) {
    if let Err(e) = tcp.set_nodelay(true) {
        tracing::debug!(error = %e, "TCP_NODELAY on an accepted connection");
    }
}

/// Serves `router` on `listener` until `shutdown` resolves; then drains: stops accepting
/// connections, `/health` says `draining` on connections still open (gateways route
/// elsewhere), open requests run on for up to `drain_timeout`; then what is left is aborted, so
/// each ends with the tokens it has (a stream with its last chunk and usage), and the server
/// waits a moment for those answers to go out.
pub async fn serve(
    listener: tokio::net::TcpListener,
    router: Router,
    handle: EngineHandle,
    shutdown: impl Future<Output = ()> + Send + 'static,
    drain_timeout: Duration,
) -> std::io::Result<()> {
    let stopping = Arc::new(tokio::sync::Notify::new());
    let notify = Arc::clone(&stopping);
    let draining = handle.clone();
    let server = axum::serve(no_delay(listener), router)
        .with_graceful_shutdown(async move {
            shutdown.await;
            draining.set_draining();
            notify.notify_one();
        })
        .into_future();
    tokio::pin!(server);
    tokio::select! {
        r = &mut server => return r,
        () = async {
            stopping.notified().await;
            tokio::time::sleep(drain_timeout).await;
        } => {}
    }
    eprintln!("requests still open {drain_timeout:?} after shutdown began; aborting them");
    handle.abort_all();
    match tokio::time::timeout(AFTER_ABORT, &mut server).await {
        Ok(r) => r,
        Err(_) => {
            eprintln!("answers still open {AFTER_ABORT:?} after the abort; dropping them");
            Ok(())
        }
    }
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

/// Token check, internal headers, and the identity headers on every `/v1` response.
async fn api_layer(State(app): State<Arc<App>>, mut req: Request, next: Next) -> Response {
    let arrival = Instant::now();
    let mut resp = if app.token.as_ref().is_some_and(|t| !t.accepts(req.headers())) {
        ApiError::unauthorized().into_response()
    } else {
        match RequestContext::from_headers(req.headers(), arrival) {
            Err(e) => e.into_response(),
            Ok(ctx) => {
                let id = HeaderValue::from_str(&ctx.request_id).ok();
                // A span under the caller's trace (W3C trace context), exported when the
                // process has an OpenTelemetry exporter; a no-op otherwise.
                let span = tracing::info_span!(
                    "engine.request",
                    otel.kind = "server",
                    request_id = %ctx.request_id,
                    tenant = ctx.tenant.as_deref().unwrap_or("-"),
                    path = %req.uri().path(),
                );
                let parent = opentelemetry::global::get_text_map_propagator(|p| {
                    p.extract(&opentelemetry_http::HeaderExtractor(req.headers()))
                });
                let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&span, parent);
                req.extensions_mut().insert(ctx);
                let mut resp = tracing::Instrument::instrument(next.run(req), span.clone()).await;
                tracing::trace!(parent: &span, status = resp.status().as_u16(), "answered");
                if let Some(id) = id {
                    resp.headers_mut().insert(HeaderName::from_static(REQUEST_ID_HEADER), id);
                }
                resp
            }
        }
    };
    let headers = resp.headers_mut();
    // A request under an adapter has stamped its own identity.
    if let Some(v) = &app.identity_header
        && !headers.contains_key(IDENTITY_HEADER)
    {
        headers.insert(HeaderName::from_static(IDENTITY_HEADER), v.clone());
    }
    if let Some(v) = &app.revision_header {
        headers.insert(HeaderName::from_static(MODEL_REVISION_HEADER), v.clone());
    }
    resp
}

async fn completions(
    State(app): State<Arc<App>>,
    Extension(ctx): Extension<RequestContext>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(app, ctx, Endpoint::Completions, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn chat_completions(
    State(app): State<Arc<App>>,
    Extension(ctx): Extension<RequestContext>,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    generate(app, ctx, Endpoint::Chat, body).await.unwrap_or_else(IntoResponse::into_response)
}

async fn generate(
    app: Arc<App>,
    ctx: RequestContext,
    endpoint: Endpoint,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let body = body.map_err(|e| ApiError::from_body_rejection(&e))?;
    let model = Arc::clone(app.handle.model());
    // Parsing, rendering and tokenizing are CPU work: keep them off the I/O threads.
    let plan = {
        let app = Arc::clone(&app);
        let model = Arc::clone(&model);
        tokio::task::spawn_blocking(move || {
            let mut value = validate::parse_body(&body)?;
            // Token ids come from the gateway, which holds the internal token: without one
            // configured, anybody could send ids that are not the prompt's.
            if app.token.is_none()
                && let Some(obj) = value.as_object_mut()
            {
                obj.remove(PROMPT_FIELD);
            }
            match value.get("model") {
                None | Some(Value::Null) => {}
                Some(Value::String(m)) => validate::check_model(
                    Some(m),
                    &[app.served_name.as_str(), model.identity.model_id.as_str()],
                )?,
                Some(_) => return Err(ApiError::invalid("model", "model must be a string")),
            }
            match endpoint {
                Endpoint::Completions => validate::completion_plan(&value, &model, &app.limits),
                Endpoint::Chat => validate::chat_plan(&value, &model, &app.limits),
            }
        })
        .await
        .map_err(|e| ApiError::internal(format!("request validation failed: {e}")))??
    };
    // The adapter is loaded (or waited for) here, on this request's task: the step thread and
    // every other request go on meanwhile.
    let adapter = match (&ctx.adapter, &app.adapters) {
        (None, _) => None,
        (Some(r), Some(set)) => Some(RequestAdapter {
            name: format!("{}/{}", r.tenant, r.name),
            adapter: set.get(r).await?,
        }),
        (Some(r), None) => {
            return Err(ApiError::model_not_found(&format!("{}/{}", r.tenant, r.name)));
        }
    };
    let mut identity = model.identity.clone();
    identity.adapter = ctx.adapter.as_ref().map(ToString::to_string);
    let mut streams = Vec::with_capacity(plan.params.n);
    let outcomes = app.handle.outcomes();
    for r in plan.requests(&ctx, adapter.as_ref()) {
        // Registered first, so its end is recorded however it ends.
        let choice = r.request_id.clone();
        let registered = outcomes.register(&ctx.request_id, &choice, ctx.tenant.as_deref());
        // Sizes were checked above, so a refusal here means the engine is gone or full.
        let s = app.handle.submit(r).map_err(|e| {
            if registered {
                outcomes.unregister(&choice);
            }
            ApiError::from_engine(&e, Some("max_tokens"))
        })?;
        streams.push(s);
    }
    let stream = plan.params.stream;
    let shaper = Shaper {
        endpoint,
        model_name: app.served_name.clone(),
        request_id: ctx.request_id.clone(),
        tenant: ctx.tenant.clone(),
        trace_id: ctx.trace_id().map(str::to_string),
        created: ctx.created,
        identity,
        model,
        plan,
    };
    let identity_header = HeaderValue::from_str(&shaper.identity.header_value()).ok();
    let events = respond::merge(streams);
    let mut resp = if stream {
        respond::stream(shaper, events)
    } else {
        respond::collect(shaper, events).await?
    };
    if let (Some(_), Some(v)) = (&ctx.adapter, identity_header) {
        resp.headers_mut().insert(HeaderName::from_static(IDENTITY_HEADER), v);
    }
    Ok(resp)
}

/// `?wait_ms=`: how long to wait for a running request to end (at most 30 s).
#[derive(serde::Deserialize)]
struct OutcomeQuery {
    wait_ms: Option<u64>,
}

/// `GET /v1/internal/requests/{id}`: the tokens the engine prefilled and generated for a
/// request and how it ended (behind the internal token like every `/v1` route): the gateway
/// bills a request whose client went away by it.
async fn outcome(
    State(app): State<Arc<App>>,
    Path(id): Path<String>,
    axum::extract::Query(q): axum::extract::Query<OutcomeQuery>,
) -> Response {
    let deadline = Instant::now() + Duration::from_millis(q.wait_ms.unwrap_or(0).min(30_000));
    // Polled, not waited on a thread: a burst of lookups holds no blocking threads.
    loop {
        match app.handle.outcomes().get(&id, Duration::ZERO) {
            None => return ApiError::unknown_request(&id).into_response(),
            Some(o) if o.finished() || Instant::now() >= deadline => {
                return Json(o).into_response();
            }
            Some(_) => tokio::time::sleep(Duration::from_millis(10)).await,
        }
    }
}

/// `?since=`: seconds since the Unix epoch.
#[derive(serde::Deserialize)]
struct OutcomesQuery {
    since: Option<u64>,
}

/// `GET /v1/internal/outcomes?since=`: every remembered request registered since then, with
/// the served model and when this engine started (it remembers nothing from before), for an
/// auditor's reconciliation against the ledger.
async fn outcomes(
    State(app): State<Arc<App>>,
    axum::extract::Query(q): axum::extract::Query<OutcomesQuery>,
) -> Response {
    Json(Outcomes {
        model: app.served_name.clone(),
        started: app.started,
        started_ms: app.started_ms,
        data: app.handle.outcomes().since(q.since.unwrap_or(0)),
    })
    .into_response()
}

/// `POST /v1/internal/requests/{id}/abort`: ends a request's running choices now, with the
/// tokens they have (a gateway's drain cancelling what is left at shutdown).
async fn abort(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    let choices = app.handle.outcomes().running_choices(&id);
    for c in &choices {
        app.handle.abort(c);
    }
    Json(serde_json::json!({"request_id": id, "aborted": choices.len()})).into_response()
}

#[derive(Serialize)]
struct ModelList {
    object: &'static str,
    data: Vec<ModelCard>,
}

fn card(app: &App) -> ModelCard {
    let model = app.handle.model();
    ModelCard {
        id: app.served_name.clone(),
        object: "model",
        created: app.started,
        owned_by: "sluice",
        max_model_len: model.weights.config.context_length,
        sluice: ModelCardExt {
            execution_identity: model.identity.clone(),
            capacity_tokens: app.handle.capacity_tokens(),
            sampling_defaults: app.limits.sampling.clone(),
        },
    }
}

async fn models(State(app): State<Arc<App>>) -> Response {
    Json(ModelList { object: "list", data: vec![card(&app)] }).into_response()
}

async fn model_card(State(app): State<Arc<App>>, Path(id): Path<String>) -> Response {
    if id == app.served_name {
        Json(card(&app)).into_response()
    } else {
        ApiError::model_not_found(&id).into_response()
    }
}

/// The model's text side for gateways ([`ModelText::bundle`]): its tokenizer and chat
/// template, so a gateway counts tokens as this engine does without the weights.
async fn text_bundle(State(app): State<Arc<App>>) -> Response {
    let path = app.handle.model().path.clone();
    match tokio::task::spawn_blocking(move || ModelText::bundle(&path)).await {
        Ok(Ok(bytes)) => {
            ([(header::CONTENT_TYPE, "application/octet-stream")], bytes).into_response()
        }
        Ok(Err(e)) => {
            ApiError::internal(format!("reading the model's text side: {e}")).into_response()
        }
        Err(e) => ApiError::internal(format!("reading the model's text side: {e}")).into_response(),
    }
}

#[derive(Serialize)]
struct Health {
    status: &'static str,
    model: String,
    #[serde(flatten)]
    stats: EngineStats,
}

async fn health(State(app): State<Arc<App>>) -> Response {
    let handle = app.handle.clone();
    // `stats` waits for the engine thread to finish its current step.
    match tokio::task::spawn_blocking(move || handle.stats()).await {
        Ok(Some(stats)) if app.handle.is_draining() => (
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Json(Health { status: "draining", model: app.served_name.clone(), stats }),
        )
            .into_response(),
        Ok(Some(stats)) => {
            Json(Health { status: "ok", model: app.served_name.clone(), stats }).into_response()
        }
        _ => ApiError::unavailable().into_response(),
    }
}

/// The engine's load, read from its gauges (set at the end of every step) without waiting for
/// the step in progress.
async fn load(State(app): State<Arc<App>>) -> Json<EngineLoad> {
    Json(app.handle.metrics().load())
}

/// Liveness: the process answers and its engine thread runs. A restart is the cure for neither
/// failing, so nothing slower (a step in progress) is waited for.
async fn livez(State(app): State<Arc<App>>) -> Response {
    if app.handle.is_alive() {
        Json(serde_json::json!({"status": "ok"})).into_response()
    } else {
        ApiError::unavailable().into_response()
    }
}

/// Readiness: the model is loaded (it is before the port opens), the engine thread runs and
/// no drain has begun; a draining engine answers 503 so that it leaves the load balancer
/// while its running requests finish.
async fn readyz(State(app): State<Arc<App>>) -> Response {
    let status = if !app.handle.is_alive() {
        "stopped"
    } else if app.handle.is_draining() {
        "draining"
    } else {
        return Json(serde_json::json!({"status": "ready", "model": app.served_name}))
            .into_response();
    };
    (axum::http::StatusCode::SERVICE_UNAVAILABLE, Json(serde_json::json!({"status": status})))
        .into_response()
}

/// The engine's metrics: the aggregate series to anyone who reaches the port (probes, the
/// gateways' load polling), the per-tenant ones (`sluice_engine_tenant_*`: who uses the
/// engine, how much, how fast) only behind the internal token when one is configured.
async fn metrics(State(app): State<Arc<App>>, headers: axum::http::HeaderMap) -> Response {
    let mut text = app.handle.metrics().encode();
    if let Some(set) = &app.adapters {
        let lines = set.stats().exposition();
        // Before OpenMetrics' closing line, which must be the last.
        match text.rfind("# EOF") {
            Some(at) => text.insert_str(at, &lines),
            None => text.push_str(&lines),
        }
    }
    let text = match &app.token {
        Some(t) if !t.accepts(&headers) => without_tenant_series(&text),
        _ => text,
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")], text).into_response()
}

/// `text` (Prometheus exposition) without the per-tenant series and their comments.
fn without_tenant_series(text: &str) -> String {
    const TENANT: &str = "sluice_engine_tenant_";
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let name = match line.strip_prefix("# ") {
            Some(comment) => comment.split_whitespace().nth(1).unwrap_or_default(),
            None => line,
        };
        if !name.starts_with(TENANT) {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

async fn no_route(method: Method, uri: Uri) -> Response {
    ApiError::no_route(method.as_str(), uri.path()).into_response()
}

async fn wrong_method(method: Method, uri: Uri) -> Response {
    ApiError::method_not_allowed(method.as_str(), uri.path()).into_response()
}
