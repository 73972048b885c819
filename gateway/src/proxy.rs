//! The gateway's pingora `ProxyHttp`: each phase calls the small modules of this crate.
//!
//! - `request_filter`: the steps of [`crate::admission`] in order: route, authenticate the key
//!   (cached [`KeyGrant`]s), read the body, check and rewrite it with its prompt tokens counted
//!   (a long body off the I/O thread), resolve an `Idempotency-Key`, admit by tokens ([`Limiter`], or the
//!   local fallback). Each [`Refusal`] is answered here, in OpenAI's shapes, and billed as a
//!   refused request.
//! - `upstream_peer`: prefix affinity over the engine workers.
//! - `upstream_request_filter` / `request_body_filter`: the trusted headers and the rewritten
//!   body; client-sent `x-sluice-*` headers never pass.
//! - `response_filter` / `response_body_filter`: rate-limit headers, the gateway's own
//!   overhead, and the stream observer timing what the client receives.
//! - `logging`: settle the reservation to the tokens used and emit exactly one usage event.

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use bytes::Bytes;
use chrono::{DateTime, Datelike, DurationRound, Utc};
use futures_util::FutureExt;
use pingora::http::{RequestHeader, ResponseHeader};
use pingora::prelude::{HttpPeer, Session};
use pingora::proxy::ProxyHttp;
use pingora::{Error, ErrorSource, ErrorType, Result};
use serde::Deserialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sluice_billing::adapters::Adapter;
use sluice_billing::control::KeyGrant;
use sluice_billing::{FinishReason, Ledger, UsageEvent};
use sluice_policies::prices::PriceList;
use sluice_policies::prices::is_refused;
use sluice_wire::header as internal;
use sluice_wire::{EngineTimings, ExecutionIdentity, Outcome as EngineOutcome, Usage};

use crate::admission::{
    self, Asked, Checked, Endpoint, MAX_BODY_BYTES, Refusal, Route, Served, TokenCounter,
    error_json, hex_digest, rate_headers,
};
use crate::catalog::Catalog;
use crate::conclude::{Conclusion, Counts, Facts, Failure, Side, conclude};
use crate::drain::Drain;
use crate::engine_client::EngineClient;
use crate::fair::{FairShare, Slot};
use crate::fair_peers::FairPeers;
use crate::idempotency::{self, Claim, Idempotency, RUNNING_TTL, Stored};
use crate::journal::{Entry, Journal, Recovery};
use crate::limits::{
    Decision, LedgerUsage, Limit, Limiter, RateState, Scope, ScopeLimits, current_periods,
};
use crate::local::{LocalLimiter, RedisDownPolicy};
use crate::metrics::{GatewayMetrics, RefusalLabels, RequestLabels};
use crate::observe::{self, StreamObserver, Timings};
use crate::sink::UsageSink;
use crate::workers::Workers;

/// The client headers forwarded to an engine; every other one is dropped.
const FORWARDED_HEADERS: [&str; 5] =
    ["host", "content-type", "content-length", "accept", "user-agent"];

/// pingora's retry buffer: the part of the body it keeps to forward again.
const RETRY_BUFFER: usize = 64 * 1024;

/// What is read and dropped of a body refused as too large, at most, and for how long:
/// closing a connection with unread data resets it, and a client still sending would see
/// the reset instead of the 413 (the lingering close of nginx and Apache).
const LINGER_BYTES: usize = 16 << 20;
const LINGER: Duration = Duration::from_secs(5);

/// One engine worker.
#[derive(Clone, Debug)]
pub struct Worker {
    /// `host:port` of its HTTP API.
    pub addr: String,
}

/// Gateway settings.
pub struct GatewayConfig {
    /// Engine workers.
    pub workers: Vec<Worker>,
    /// Requests queued on every healthy worker beyond which new ones get 503.
    pub max_waiting: u64,
    /// Bearer token the engines require.
    pub internal_token: Option<String>,
    /// `max_tokens` when a request gives none and the tenant sets no cap.
    pub default_max_tokens: u64,
    /// How long a key lookup is trusted (revocation takes effect within this).
    pub key_cache_ttl: Duration,
    /// What to do when Redis cannot be reached.
    pub redis_down: RedisDownPolicy,
    /// The price list requests are charged by (per model and tier).
    pub prices: &'static PriceList,
    /// This gateway's name in usage events.
    pub name: String,
    /// How long a kept-alive client connection may sit idle between requests.
    pub idle_timeout: Duration,
    /// How long a request head may take to arrive, in all (the first one from the accept).
    pub header_timeout: Duration,
    /// How long a request body may take to arrive, in all (a client trickling it is cut off).
    pub body_timeout: Duration,
    /// Requests one client address may have in flight at once.
    pub max_per_client: u32,
    /// Proxies (load balancers) whose `X-Forwarded-For` names the client: a request from one
    /// of them counts against the address it forwarded for ([`client_address`]).
    pub trusted_proxies: Vec<ipnet::IpNet>,
    /// Fair admission ([`crate::fair`]): off, every tenant queues at the engines as it comes.
    pub fair_admission: bool,
}

/// The ledger's usage by scope: when it was read, for which UTC day, the figures.
type UsageReads = HashMap<String, (Instant, DateTime<Utc>, LedgerUsage)>;

/// Key lookups by SHA-256 of the secret (never the secret itself), with when they were made.
type KeyCache = HashMap<[u8; 32], (Instant, Option<Arc<KeyGrant>>)>;

/// Adapter resolutions by (calling tenant, the `model` it named), with when they were made.
type AdapterCache = HashMap<(String, String), (Instant, Option<Arc<Adapter>>)>;

/// The gateway.
pub struct Gateway {
    cfg: GatewayConfig,
    ledger: Ledger,
    limiter: Option<Limiter>,
    local: LocalLimiter,
    /// The models and defaults [`admission::check`] holds requests to.
    served: Arc<Served>,
    usage: UsageSink,
    idempotency: Arc<Idempotency>,
    keys: Mutex<KeyCache>,
    /// The ledger's answers on which adapter a tenant's `model` names (as long as keys).
    adapters: Mutex<AdapterCache>,
    /// Full execution identities by model revision, from complete responses (a stream cut
    /// short never carries its own).
    identities: Mutex<HashMap<String, ExecutionIdentity>>,
    metrics: Arc<GatewayMetrics>,
    workers: Arc<Workers>,
    /// The ledger's usage by scope: when read, for which UTC day, the figures.
    usage_reads: Mutex<UsageReads>,
    usage_generation: std::sync::atomic::AtomicU64,
    /// Requests in flight, for the shutdown's drain.
    drain: Arc<Drain>,
    /// Requests in flight per client address.
    per_client: InFlight<std::net::IpAddr>,
    /// Requests in flight per tenant from their authentication on (their bodies being read
    /// included), held to the tenant's concurrency limit before a body is read.
    per_tenant: InFlight<String>,
    /// Requests in flight per tenant, for fair admission.
    fair: Arc<FairShare>,
    /// Asks engines what they did for requests whose final count never arrived.
    engines: EngineClient,
    /// Requests sent to engines and not yet billed, in Redis (with the usage stream), for
    /// another gateway to bill if this one dies.
    journal: Option<Arc<Journal>>,
    /// The async runtime that owns the database and Redis connections.
    io: tokio::runtime::Handle,
}

impl Gateway {
    /// Assembles a gateway; `io` is the runtime on which `ledger`, `limiter` and `usage`
    /// were created (their I/O is driven there). `texts` are the text sides of the model
    /// files the gateway was given, each with the id its file gives it; the models are
    /// learned from the engines, whose first poll is done (or has taken [`FIRST_POLL`]) when
    /// this returns.
    pub fn new(
        cfg: GatewayConfig,
        ledger: Ledger,
        limiter: Option<Limiter>,
        texts: Vec<(String, TokenCounter)>,
        usage: UsageSink,
        io: tokio::runtime::Handle,
    ) -> Self {
        let addrs: Vec<String> = cfg.workers.iter().map(|w| w.addr.clone()).collect();
        let workers = Workers::new(&addrs, cfg.internal_token.clone());
        let catalog = Arc::new(Catalog::new(texts));
        workers.spawn_health_checks(&io, &catalog, Duration::from_millis(500), FIRST_POLL);
        let idempotency = Arc::new(Idempotency::new(
            limiter.as_ref().map(Limiter::shared),
            idempotency::WINDOW,
            RUNNING_TTL,
        ));
        let served = Arc::new(Served { catalog, default_max_tokens: cfg.default_max_tokens });
        let engines = EngineClient::new(reqwest::Client::new(), cfg.internal_token.clone());
        let metrics = Arc::new(GatewayMetrics::default());
        let fair = Arc::new(FairShare::default());
        // With Redis, fair admission judges with every replica's figures.
        if let Some(l) = &limiter {
            let (conn, prefix) = l.shared();
            FairPeers::new(conn, &prefix).spawn(Arc::clone(&fair), &io);
        }
        let journal = match (&usage, &limiter) {
            (UsageSink::Redis { stream, .. }, Some(l)) => {
                let (conn, prefix) = l.shared();
                let journal = Arc::new(Journal::new(conn, &prefix, stream));
                let recovery = Recovery {
                    sink: usage.clone(),
                    limiter: limiter.clone(),
                    engines: engines.clone(),
                    idempotency: Arc::clone(&idempotency),
                    recovered: metrics.journal_recovered.clone(),
                };
                journal.spawn(&io, recovery);
                Some(journal)
            }
            _ => None,
        };
        Self {
            idempotency,
            served,
            cfg,
            workers,
            ledger,
            limiter,
            local: LocalLimiter::new(1),
            usage,
            keys: Mutex::new(HashMap::new()),
            adapters: Mutex::new(HashMap::new()),
            identities: Mutex::new(HashMap::new()),
            metrics,
            engines,
            journal,
            drain: Arc::default(),
            per_client: InFlight::default(),
            per_tenant: InFlight::default(),
            fair,
            usage_reads: Mutex::new(HashMap::new()),
            usage_generation: std::sync::atomic::AtomicU64::new(0),
            io,
        }
    }

    /// Its in-flight journal (with Redis), for [`crate::platform::finish`] to close.
    pub fn journal(&self) -> Option<Arc<Journal>> {
        self.journal.clone()
    }

    /// Its Prometheus metrics, for a listener of their own (never the tenants' port).
    pub fn metrics(&self) -> Arc<GatewayMetrics> {
        Arc::clone(&self.metrics)
    }

    /// How long a request head may take to arrive ([`crate::door`] enforces it).
    pub fn header_timeout(&self) -> Duration {
        self.cfg.header_timeout
    }

    /// The drain state its shutdown watch ([`crate::drain::DrainOnSignal`]) works on.
    pub fn drain(&self) -> Arc<Drain> {
        Arc::clone(&self.drain)
    }

    /// The ids of the models learned from the engines so far.
    pub fn models(&self) -> Vec<String> {
        self.served.catalog.entries().iter().map(|e| e.id.clone()).collect()
    }

    /// Records an engine's execution identity (the `sluice` object's `execution_identity`),
    /// so requests cut short are billed with it too.
    pub fn seed_identity(&self, identity: ExecutionIdentity) {
        let mut ids = self.identities.lock().unwrap_or_else(|e| e.into_inner());
        ids.insert(identity.model_revision.clone(), identity);
    }

    /// The identity a request ran under: the one its response named, else the one known for
    /// the revision its engine's header named (`None` when neither is known).
    fn identity_for(
        &self,
        revision: Option<&str>,
        seen: Option<&ExecutionIdentity>,
    ) -> Option<ExecutionIdentity> {
        if let Some(v) = seen {
            self.seed_identity(v.clone());
            return Some(v.clone());
        }
        let r = revision?;
        let ids = self.identities.lock().unwrap_or_else(|e| e.into_inner());
        ids.get(r).cloned().or_else(|| {
            // Else as the engine's card gave it, when the catalog has that revision.
            let entries = self.served.catalog.entries();
            entries
                .iter()
                .find_map(|e| e.identity.as_ref().filter(|i| i.model_revision == r))
                .cloned()
        })
    }

    /// Runs `f` on the I/O runtime and waits for it.
    async fn on_io<F, T>(&self, f: F) -> std::result::Result<T, String>
    where
        F: std::future::Future<Output = T> + Send + 'static,
        T: Send + 'static,
    {
        self.io.spawn(f).await.map_err(|e| e.to_string())
    }

    async fn grant(&self, secret: &str) -> std::result::Result<Option<Arc<KeyGrant>>, String> {
        let digest: [u8; 32] = Sha256::digest(secret.as_bytes()).into();
        {
            let cache = self.keys.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, g)) = cache.get(&digest)
                && at.elapsed() < self.cfg.key_cache_ttl
            {
                return Ok(g.clone());
            }
        }
        let ledger = self.ledger.clone();
        let secret = secret.to_owned();
        let g = self
            .on_io(async move { ledger.key_grant(&secret).await })
            .await?
            .map_err(|e| e.to_string())?
            .map(Arc::new);
        let mut cache = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(digest, (Instant::now(), g.clone()));
        Ok(g)
    }

    /// The adapter revision `model` (`owner/name` or `owner/name@revision`) names for
    /// `tenant`, when it may use one: `None` for a name that is no adapter reference, an
    /// unknown, retired or unshared one alike. Cached as key grants are, so a retirement
    /// takes effect within the cache's time to live.
    async fn adapter(
        &self,
        tenant: &str,
        model: &str,
    ) -> std::result::Result<Option<Arc<Adapter>>, String> {
        let Some((owner, name, revision)) = sluice_billing::adapters::parse_reference(model) else {
            return Ok(None);
        };
        let key = (tenant.to_owned(), model.to_owned());
        {
            let cache = self.adapters.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((at, a)) = cache.get(&key)
                && at.elapsed() < self.cfg.key_cache_ttl
            {
                return Ok(a.clone());
            }
        }
        let ledger = self.ledger.clone();
        let (t, o, n, r) =
            (tenant.to_owned(), owner.to_owned(), name.to_owned(), revision.map(str::to_owned));
        let a = self
            .on_io(async move { ledger.resolve_adapter(&t, &o, &n, r.as_deref()).await })
            .await?
            .map_err(|e| e.to_string())?
            .map(Arc::new);
        let mut cache = self.adapters.lock().unwrap_or_else(|e| e.into_inner());
        if cache.len() > 100_000 {
            cache.clear();
        }
        cache.insert(key, (Instant::now(), a.clone()));
        Ok(a)
    }

    /// `/v1/models` cards of the adapters `grant`'s tenant may use (its own and those shared
    /// with it): the newest active revision of each name whose base model is served and
    /// allowed. A ledger that cannot be read lists none, with a warning.
    async fn adapter_cards(&self, grant: &KeyGrant) -> Vec<Value> {
        let (ledger, t) = (self.ledger.clone(), grant.tenant_id.clone());
        let listed = match self.on_io(async move { ledger.list_adapters(&t).await }).await {
            Ok(Ok(l)) => l,
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "listing adapters");
                return Vec::new();
            }
            Err(e) => {
                tracing::warn!(error = %e, "listing adapters");
                return Vec::new();
            }
        };
        let mut seen = std::collections::HashSet::new();
        listed
            .into_iter()
            .filter(|a| a.status == "active")
            .filter(|a| seen.insert((a.tenant_id.clone(), a.name.clone())))
            .filter_map(|a| self.adapter_card(grant, &a))
            .collect()
    }

    /// The model card of adapter `a` (`tenant/name`, its base model as `parent`), if the
    /// key may use it and a worker may serve its base.
    fn adapter_card(&self, grant: &KeyGrant, a: &Adapter) -> Option<Value> {
        let entry = self.served.catalog.resolve(&a.base_model)?;
        let name = format!("{}/{}", a.tenant_id, a.name);
        let allowed =
            admission::model_allowed(grant, &name) || admission::model_allowed(grant, &entry.id);
        (allowed && self.workers.may_serve(&entry.id)).then(|| {
            json!({
                "id": name,
                "object": "model",
                "created": a.created_at.timestamp(),
                "owned_by": a.tenant_id,
                "parent": entry.id,
                "sluice": {"adapter": a.id(), "rank": a.rank, "targets": a.targets},
            })
        })
    }

    /// The billed tokens the ledger holds for a scope today and this month, read at most
    /// every [`USAGE_REFRESH`] (and again when the day changes). An unreadable ledger keeps
    /// the last figures (or none), with a warning: admission does not stop for it.
    async fn ledger_usage(&self, tenant: &str, key: Option<&str>) -> LedgerUsage {
        let name = match key {
            Some(k) => format!("{tenant}/{k}"),
            None => tenant.to_owned(),
        };
        let now = Utc::now();
        let day_start = now.duration_trunc(chrono::TimeDelta::days(1)).unwrap_or(now);
        let month_start = day_start.with_day(1).unwrap_or(day_start);
        let cached = {
            let reads = self.usage_reads.lock().unwrap_or_else(|e| e.into_inner());
            reads.get(&name).copied()
        };
        if let Some((at, day, u)) = cached
            && day == day_start
            && at.elapsed() < USAGE_REFRESH
        {
            return u;
        }
        let (ledger, t, k) = (self.ledger.clone(), tenant.to_owned(), key.map(str::to_owned));
        let read = self
            .on_io(async move {
                let used = ledger.tokens_used(&t, k.as_deref(), day_start, month_start);
                tokio::time::timeout(USAGE_READ_TIMEOUT, used).await
            })
            .await;
        let (day_number, month_number) = current_periods();
        match read {
            Ok(Ok(Ok((day, month)))) => {
                let generation =
                    self.usage_generation.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
                let u = LedgerUsage { day, month, generation, day_number, month_number };
                let mut reads = self.usage_reads.lock().unwrap_or_else(|e| e.into_inner());
                if reads.len() > 100_000 {
                    reads.clear();
                }
                reads.insert(name, (Instant::now(), day_start, u));
                u
            }
            failed => {
                let why = match failed {
                    Ok(Ok(Err(e))) => e.to_string(),
                    Ok(Err(_)) => format!("no answer within {USAGE_READ_TIMEOUT:?}"),
                    Err(e) => e,
                    Ok(Ok(Ok(_))) => String::new(),
                };
                tracing::warn!(error = %why, "reading the ledger's usage failed; using the last figures");
                // The last figures carry the day and month they count: of another day they
                // count nothing today (the limiters check).
                cached.map(|c| c.2).unwrap_or_default()
            }
        }
    }
}

/// The characters of a model name asked for, and refused, that its row keeps (at most 256
/// bytes, the ledger's bound on an id).
const MODEL_NAME_KEPT: usize = 64;

/// How long a gateway's start waits for its engines to say what they serve.
pub const FIRST_POLL: Duration = Duration::from_secs(10);

/// How long admission waits for the ledger's day and month figures.
const USAGE_READ_TIMEOUT: Duration = Duration::from_secs(2);

/// How long the ledger's day and month figures are trusted before they are read again.
const USAGE_REFRESH: Duration = Duration::from_secs(15);

/// Per-request state.
pub struct Ctx {
    arrival: Instant,
    arrival_at: DateTime<Utc>,
    request_id: String,
    /// Where the request stands: what `logging` bills it as.
    outcome: Outcome,
    grant: Option<Arc<KeyGrant>>,
    /// The key id and its limits, when the key has limits of its own.
    key_scope: Option<(String, ScopeLimits)>,
    body: Option<Bytes>,
    /// What it asks for, as admission read it.
    asked: Asked,
    rate: RateState,
    observer: Option<StreamObserver>,
    response_body: Vec<u8>,
    status: u16,
    overhead: Duration,
    /// The client's `Idempotency-Key`.
    idempotency_key: Option<String>,
    /// The claim this request made with it.
    claim: Option<HeldClaim>,
    /// The response as sent, kept for idempotent replay (`None` once over the limit).
    replay_body: Option<Vec<u8>>,
    content_type: String,
    trace_id: Option<String>,
    worker: Option<String>,
    /// In this gateway's journal (until its usage event is delivered).
    journaled: bool,
    model_revision: Option<String>,
    tried: Vec<String>,
    /// Cancelled by the shutdown's drain.
    cancelled: bool,
    /// The client's address, while it counts against its in-flight cap.
    client_ip: Option<std::net::IpAddr>,
    /// The tenant, while this request counts against its in-flight cap at this gateway.
    tenant_slot: Option<String>,
    /// The part of the stream after its last complete event (while `asked.strip_usage`).
    sse_tail: Vec<u8>,
    /// The request's span: child of the client's trace context, parent of the engine's.
    span: tracing::Span,
    /// Its place in its tenant's count of requests in flight (fair admission).
    fair_slot: Option<Slot>,
}

/// Where a request stands, as far as billing is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    /// Not admitted: still being judged, or answered without a tenant's work (health, model
    /// listings).
    Open,
    /// Refused by the gateway: billed at 0, with this finish reason.
    Refused(FinishReason),
    /// Answered from an idempotency claim's stored response: nothing ran, nothing billed.
    Replayed,
    /// Admitted through `via`; `settled` once its reservation is settled.
    Admitted { via: AdmitVia, settled: bool },
}

/// An `Idempotency-Key` claim this request holds.
struct HeldClaim {
    /// The ledger idempotency key it is billed under.
    ledger_key: String,
    /// Whether the claim lives in Redis (else in this process).
    shared: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum AdmitVia {
    Redis,
    Local,
}

fn header<'a>(req: &'a RequestHeader, name: &str) -> Option<&'a str> {
    req.headers.get(name).and_then(|v| v.to_str().ok())
}

/// Reads and drops the rest of a body refused as too large ([`LINGER_BYTES`] within
/// [`LINGER`] at most), so the client gets the answer rather than a reset connection.
async fn linger(session: &mut Session) {
    let deadline = tokio::time::Instant::now() + LINGER;
    let mut left = LINGER_BYTES;
    while left > 0 {
        match tokio::time::timeout_at(deadline, session.read_request_body()).await {
            Ok(Ok(Some(chunk))) => left = left.saturating_sub(chunk.len()),
            _ => break,
        }
    }
}

async fn respond(
    session: &mut Session,
    status: u16,
    body: Bytes,
    extra: &[(String, String)],
) -> Result<()> {
    let mut h = ResponseHeader::build(status, Some(4))?;
    h.insert_header("content-type", "application/json")?;
    h.insert_header("content-length", body.len().to_string())?;
    for (k, v) in extra {
        h.insert_header(k.clone(), v.as_str())?;
    }
    session.write_response_header(Box::new(h), false).await?;
    session.write_response_body(Some(body), true).await
}

impl Gateway {
    /// Everything before the request may go upstream, as the steps of [`admission`]:
    /// `Ok(true)` when it was answered here (a model listing, an idempotent replay), `Ok(false)`
    /// to send it on, `Err` to refuse it.
    async fn admit(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
    ) -> std::result::Result<bool, Refusal> {
        let req = session.req_header();
        ctx.trace_id = header(req, internal::TRACEPARENT)
            .and_then(|t| t.split('-').nth(1))
            .filter(|id| id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit()))
            .map(str::to_owned);
        ctx.idempotency_key = header(req, "idempotency-key").map(str::to_owned);
        let (method, path) = (req.method.as_str().to_owned(), req.uri.path().to_owned());
        let route = admission::route(&method, &path)?;
        let secret = admission::bearer(header(req, "authorization"))?.to_owned();
        let grant = self.authenticate(&secret).await?;
        if let Err(r) = admission::authorize(&grant, &route, &path) {
            // Billed as a refused request of this tenant.
            ctx.grant = Some(grant);
            return Err(r);
        }
        if self.drain.draining() {
            // Checked once the tenant is known: a refused generation is its request, with a
            // row that costs nothing, so every generation id a client is given is in the
            // ledger (model listings have no rows, refused or not).
            if matches!(route, Route::Generate(_)) {
                ctx.grant = Some(grant);
            }
            return Err(Refusal::ShuttingDown);
        }
        let endpoint = match route {
            Route::Generate(endpoint) => endpoint,
            Route::Model(id) => {
                let card = self.model_card(&grant, id).await?;
                return self.listed(session, ctx, card).await;
            }
            Route::Models => {
                let list = self.model_list(&grant).await;
                return self.listed(session, ctx, list).await;
            }
        };
        ctx.grant = Some(Arc::clone(&grant));
        self.enter_tenant(ctx, &grant)?;
        if ctx.idempotency_key.as_deref().is_some_and(|k| !idempotency::valid_key(k)) {
            ctx.idempotency_key = None;
            return Err(Refusal::InvalidIdempotencyKey);
        }
        let body = self.read_body(session).await?;
        let choices = self.check_kept(endpoint, &grant, &body, ctx).await?;
        // A replay needs no engine: resolved before the overload check (a refusal after a
        // claim releases it in `logging`).
        if let Some(key) = ctx.idempotency_key.clone()
            && self.idempotent(session, ctx, &key, &method, &path, &body).await?
        {
            return Ok(true);
        }
        let model = ctx.asked.model.clone().unwrap_or_default();
        self.enqueue(ctx, &grant, &model, choices).await?;
        Ok(false)
    }

    /// Answers a model listing here (`Ok(true)`, as [`Gateway::admit`] says of a request it
    /// answered).
    async fn listed(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        body: Value,
    ) -> std::result::Result<bool, Refusal> {
        self.answer(session, ctx, 200, Bytes::from(body.to_string())).await?;
        Ok(true)
    }

    /// The card of model (or tenant adapter) `id`, when the key may see it.
    async fn model_card(
        &self,
        grant: &Arc<KeyGrant>,
        id: String,
    ) -> std::result::Result<Value, Refusal> {
        let entry = self.served.catalog.resolve(&id).filter(|e| {
            self.workers.may_serve(&e.id)
                && (admission::model_allowed(grant, &e.id) || admission::model_allowed(grant, &id))
        });
        if let Some(entry) = entry {
            return Ok(entry.card(self.workers.serving(&entry.id)));
        }
        // A tenant adapter (`tenant/name`, or pinned `@sha256:...`) this key's tenant may use;
        // any other name is as unknown as a missing model.
        match self.adapter(&grant.tenant_id, &id).await {
            Ok(Some(a)) => self.adapter_card(grant, &a).ok_or(Refusal::ModelNotFound { model: id }),
            Ok(None) => Err(Refusal::ModelNotFound { model: id }),
            Err(e) => {
                tracing::warn!(error = %e, "resolving an adapter");
                Err(Refusal::ModelNotFound { model: id })
            }
        }
    }

    /// The list of every model and tenant adapter the key may use.
    async fn model_list(&self, grant: &Arc<KeyGrant>) -> Value {
        let mut data: Vec<Value> = self
            .served
            .catalog
            .entries()
            .into_iter()
            .filter(|e| self.workers.may_serve(&e.id) && admission::model_allowed(grant, &e.id))
            .map(|e| e.card(self.workers.serving(&e.id)))
            .collect();
        data.extend(self.adapter_cards(grant).await);
        json!({"object": "list", "data": data})
    }

    /// Takes one of the tenant's concurrency places, judged before its body is read: one key
    /// trickling bodies cannot hold the address's (behind a load balancer, every tenant's)
    /// slots past its own limit. The shared limiter judges it again, across gateways, later.
    fn enter_tenant(&self, ctx: &mut Ctx, grant: &KeyGrant) -> std::result::Result<(), Refusal> {
        let Some(limit) = grant.quota.limits.concurrency.and_then(|c| u64::try_from(c).ok()) else {
            return Ok(());
        };
        if !self.per_tenant.enter(&grant.tenant_id, limit) {
            return Err(Refusal::Limited {
                limit: Limit::Concurrency,
                scope: Scope::Tenant,
                reserved: 0,
                retry_after: Some(Duration::from_secs(1)),
                rate: RateState::default(),
            });
        }
        ctx.tenant_slot = Some(grant.tenant_id.clone());
        Ok(())
    }

    /// Checks the body ([`Gateway::check`]) and keeps the request's facts in `ctx`, refused or
    /// not, so a refused row still records them; then refuses a model without a price (never
    /// billed at a guess) and a prompt past the key's limit. An admitted request's body to
    /// forward goes into `ctx` too; it returns the choices asked for.
    async fn check_kept(
        &self,
        endpoint: Endpoint,
        grant: &Arc<KeyGrant>,
        body: &Bytes,
        ctx: &mut Ctx,
    ) -> std::result::Result<u64, Refusal> {
        let mut checked = match self.check(endpoint, grant, body).await {
            Ok(c) => c,
            Err(r) => {
                // The row of a refused request names the model it asked for (a body refused
                // for another field still named one, when it parses).
                let asked = match &r {
                    Refusal::ModelNotFound { model } | Refusal::ModelNotAllowed { model } => {
                        Some(model.clone())
                    }
                    _ => serde_json::from_slice::<Value>(body)
                        .ok()
                        .and_then(|v| v.get("model")?.as_str().map(str::to_owned)),
                };
                ctx.asked.model = asked.map(|m| m.chars().take(MODEL_NAME_KEPT).collect());
                return Err(r);
            }
        };
        // Judged after the prompt's facts are kept: a refused row still records them.
        let within_limit = admission::within_prompt_limit(grant, &checked);
        let priced = self.cfg.prices.priced(checked.model());
        ctx.asked = std::mem::take(&mut checked.asked);
        if !priced {
            return Err(Refusal::ModelNotPriced {
                model: ctx.asked.model.clone().unwrap_or_default(),
            });
        }
        within_limit?;
        ctx.body = Some(std::mem::take(&mut checked.body));
        Ok(checked.choices)
    }

    /// Queues the admitted request: refused when every engine's queue is full and it would
    /// hold more than its tenant's share, or when fair admission finds its wait past its
    /// TTFT target; then its tokens are reserved and its prompt counts as served.
    async fn enqueue(
        &self,
        ctx: &mut Ctx,
        grant: &Arc<KeyGrant>,
        model: &str,
        choices: u64,
    ) -> std::result::Result<(), Refusal> {
        // Every engine's queue is full: turned away only when this request would hold more
        // than its tenant's share of what is in flight (its `n` counted), so one tenant's
        // burst is refused and the others' requests still queue.
        if self.workers.overloaded(model, self.cfg.max_waiting)
            && self.fair.past_queue_share(&grant.tenant_id, grant.weight(), choices)
        {
            return Err(Refusal::Overloaded);
        }
        // Past its share of backlogged engines, a tenant queues only as far as its TTFT target
        // allows; the place is held until the request's context is dropped.
        let ttft_target = ctx.asked.slo.ttft_ms.map(|ms| Duration::from_millis(ms.into()));
        let backlog = self.workers.backlog(model).filter(|_| self.cfg.fair_admission);
        let slot = self
            .fair
            .admit(
                &grant.tenant_id,
                grant.weight(),
                choices,
                ctx.asked.prompt_tokens,
                ttft_target,
                backlog,
            )
            .map_err(|retry_after| Refusal::OverShare { retry_after })?;
        self.admit_tokens(ctx, grant).await?;
        ctx.fair_slot = Some(slot);
        // The prompt counts as served once admitted (its prefill is the engines' to do), so
        // a flood of long prompts weighs at once in the tokens-served shares, not only as
        // its requests end, seconds later; the completion counts as the request ends.
        self.fair.used(&grant.tenant_id, ctx.asked.prompt_tokens);
        Ok(())
    }

    /// The key's grant, from the cache or the ledger.
    async fn authenticate(&self, secret: &str) -> std::result::Result<Arc<KeyGrant>, Refusal> {
        self.grant(secret)
            .await
            .map_err(|e| {
                tracing::error!(error = %e, "key lookup failed");
                Refusal::AuthUnavailable
            })?
            .ok_or(Refusal::InvalidApiKey)
    }

    /// Answers the health probes, which need no key: `/health` and `/livez` (the process
    /// answers) and `/readyz`. A draining gateway answers 503 to `/health` and `/readyz`, so
    /// load balancers stop sending here, and 200 to `/livez`, so nothing restarts it while it
    /// finishes what it runs. An engine fleet that
    /// is down leaves the gateway ready: clients get an OpenAI error from it rather than a
    /// refused connection. `None` for every other path.
    async fn probe(&self, session: &mut Session, ctx: &mut Ctx) -> Result<Option<bool>> {
        let path = session.req_header().uri.path();
        let (status, body) = match path {
            "/health" | "/readyz" if self.drain.draining() => {
                (503, serde_json::json!({"status": "draining"}))
            }
            "/health" | "/livez" => (200, serde_json::json!({"status": "ok"})),
            "/readyz" => (
                200,
                serde_json::json!({
                    "status": "ready",
                    "workers": self.workers.len(),
                    "workers_healthy": self.workers.healthy_count(),
                }),
            ),
            _ => return Ok(None),
        };
        respond(session, status, Bytes::from(body.to_string()), &[]).await?;
        ctx.status = status;
        Ok(Some(true))
    }

    /// Answers `r` to the client; `logging` bills it as a refused request (once authenticated).
    async fn refuse(&self, session: &mut Session, ctx: &mut Ctx, r: Refusal) -> Result<bool> {
        self.metrics.refusals.get_or_create(&RefusalLabels { reason: r.label() }).inc();
        // A body left unread is not drained for another request on this connection: it closes
        // after the answer.
        if !session.is_body_done() {
            session.set_keepalive(None);
        }
        ctx.status = r.status();
        // A replay whose write failed ran nothing and bills nothing, as before.
        if ctx.outcome != Outcome::Replayed {
            ctx.outcome = Outcome::Refused(r.finish_reason());
        }
        let mut headers = r.headers();
        headers.push((internal::REQUEST_ID.into(), ctx.request_id.clone()));
        respond(session, r.status(), r.body(), &headers).await?;
        Ok(true)
    }

    /// Answers the request here with a JSON body.
    async fn answer(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        status: u16,
        body: Bytes,
    ) -> std::result::Result<(), Refusal> {
        respond(session, status, body, &[]).await.map_err(|_| Refusal::WriteFailed)?;
        ctx.status = status;
        Ok(())
    }

    /// The body, whole, within the body deadline. What goes upstream is the rewritten body,
    /// handed over in `request_body_filter`, which pingora calls only with a retry buffer to
    /// forward: it is enabled for the last 64 KiB (a chunked body of unknown length must fit).
    async fn read_body(&self, session: &mut Session) -> std::result::Result<Bytes, Refusal> {
        let length =
            header(session.req_header(), "content-length").and_then(|v| v.parse::<usize>().ok());
        if length.is_some_and(|n| n > MAX_BODY_BYTES) {
            if length.is_some_and(|n| n <= LINGER_BYTES) {
                linger(session).await;
            }
            session.set_keepalive(None);
            return Err(Refusal::BodyTooLarge);
        }
        let mut body = Vec::with_capacity(length.unwrap_or(0).min(MAX_BODY_BYTES));
        let deadline = tokio::time::Instant::now() + self.cfg.body_timeout;
        loop {
            if length.is_none_or(|n| n.saturating_sub(body.len()) <= RETRY_BUFFER) {
                session.enable_retry_buffering();
            }
            let Ok(read) = tokio::time::timeout_at(deadline, session.read_request_body()).await
            else {
                // A client trickling its body holds a connection and a task: cut it off.
                session.set_keepalive(None);
                return Err(Refusal::BodyTimeout { deadline: self.cfg.body_timeout });
            };
            match read {
                Ok(Some(chunk)) => {
                    body.extend_from_slice(&chunk);
                    if body.len() > MAX_BODY_BYTES {
                        linger(session).await;
                        session.set_keepalive(None);
                        return Err(Refusal::BodyTooLarge);
                    }
                }
                Ok(None) => break,
                Err(_) => return Err(Refusal::BodyUnreadable),
            }
        }
        if session.retry_buffer_truncated() {
            return Err(Refusal::LengthRequired { over: RETRY_BUFFER });
        }
        if !body.is_empty() && session.get_retry_buffer().is_none() {
            // pingora would forward nothing and the upstream would wait for the body.
            return Err(Refusal::BodyNotForwardable);
        }
        Ok(Bytes::from(body))
    }

    /// [`admission::check`]: on the I/O thread for a body of at most [`INLINE_CHECK_BYTES`]
    /// (its tokens cost less than handing it to another thread and back), on the blocking
    /// pool otherwise: tokenizing a long prompt must not stall the I/O thread's other
    /// connections.
    async fn check(
        &self,
        endpoint: Endpoint,
        grant: &Arc<KeyGrant>,
        body: &Bytes,
    ) -> std::result::Result<Checked, Refusal> {
        // A `model` the catalog does not know may name one of the tenant's adapters (or one
        // shared with it): the ledger says which revision, or nothing, and `check` refuses
        // nothing as it refuses any unknown model (a 404 that says nothing of other tenants).
        #[derive(serde::Deserialize)]
        struct Named {
            model: Option<String>,
        }
        let named = serde_json::from_slice::<Named>(body).ok().and_then(|n| n.model);
        let adapter = match named {
            Some(m) if self.served.catalog.resolve(&m).is_none() => {
                self.adapter(&grant.tenant_id, &m).await.unwrap_or_else(|e| {
                    tracing::warn!(error = %e, "adapter lookup failed");
                    None
                })
            }
            _ => None,
        };
        if body.len() <= INLINE_CHECK_BYTES {
            // A fault in the check fails this request alone, as on the blocking pool.
            let check =
                || admission::check_as(endpoint, grant, body, &self.served, adapter.as_deref());
            return std::panic::catch_unwind(std::panic::AssertUnwindSafe(check)).unwrap_or_else(
                |panic| {
                    let why = panic
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| panic.downcast_ref::<String>().cloned())
                        .unwrap_or_default();
                    tracing::error!(error = %why, "admission check failed");
                    Err(Refusal::BodyNotForwardable)
                },
            );
        }
        // Shared, not copied: the idempotency fingerprint reads the same bytes afterwards.
        let (grant, body) = (Arc::clone(grant), body.clone());
        let served = Arc::clone(&self.served);
        tokio::task::spawn_blocking(move || {
            admission::check_as(endpoint, &grant, &body, &served, adapter.as_deref())
        })
        .await
        .unwrap_or_else(|e| {
            tracing::error!(error = %e, "admission check failed");
            Err(Refusal::BodyNotForwardable)
        })
    }

    /// Admission by tokens: the prompt and the largest possible output of every choice,
    /// reserved against the tenant's limits (and the key's own, in the same atomic step).
    async fn admit_tokens(
        &self,
        ctx: &mut Ctx,
        grant: &KeyGrant,
    ) -> std::result::Result<(), Refusal> {
        let q = &grant.quota;
        let mut limits = ScopeLimits::from(q.limits);
        let tenant = grant.tenant_id.clone();
        if limits.limits.has_token_quota() {
            limits.used = self.ledger_usage(&tenant, None).await;
        }
        // A key with limits of its own is held to them too, in the same atomic admission.
        let key_limits =
            (!grant.key_limits.is_empty()).then(|| ScopeLimits::from(grant.key_limits));
        let key_limits = match key_limits {
            Some(mut l) if l.limits.has_token_quota() => {
                l.used = self.ledger_usage(&tenant, Some(&grant.key_id)).await;
                Some(l)
            }
            other => other,
        };
        ctx.key_scope = key_limits.map(|l| (grant.key_id.clone(), l));
        let key = ctx.key_scope.as_ref().map(|(k, l)| (k.as_str(), l));
        let decision = match &self.limiter {
            Some(l) => {
                let (l, id, t, reserve) =
                    (l.clone(), ctx.request_id.clone(), tenant.clone(), ctx.asked.reserved);
                let k = ctx.key_scope.clone();
                let admit = async move {
                    let key = k.as_ref().map(|(k, l)| (k.as_str(), l));
                    l.admit_key(&t, key, &id, reserve, &limits).await
                };
                match self.on_io(admit).await {
                    Ok(Ok(d)) => Some((d, AdmitVia::Redis)),
                    Ok(Err(e)) => {
                        tracing::warn!(error = %e, "shared limiter unreachable");
                        None
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "shared limiter task failed");
                        None
                    }
                }
            }
            None => {
                Some((self.local.admit(&tenant, key, ctx.asked.reserved, &limits), AdmitVia::Local))
            }
        };
        // The tenant's policy (`overrides.on_limiter_down`), else the gateway's default.
        let policy = match grant.overrides["on_limiter_down"].as_str() {
            Some("refuse") => RedisDownPolicy::Refuse,
            Some("local") => RedisDownPolicy::Local,
            _ => self.cfg.redis_down,
        };
        let (decision, via) = match decision {
            Some(d) => d,
            None if policy == RedisDownPolicy::Local => {
                (self.local.admit(&tenant, key, ctx.asked.reserved, &limits), AdmitVia::Local)
            }
            None => {
                self.release_claim(ctx).await;
                return Err(Refusal::LimiterUnavailable);
            }
        };
        match decision {
            Decision::Admitted(state) => {
                ctx.rate = state;
                ctx.outcome = Outcome::Admitted { via, settled: false };
                Ok(())
            }
            Decision::Refused { reason, scope, retry_after, state } => {
                ctx.rate = state;
                self.release_claim(ctx).await;
                Err(Refusal::Limited {
                    limit: reason,
                    scope,
                    reserved: ctx.asked.reserved,
                    retry_after,
                    rate: state,
                })
            }
        }
    }

    /// Resolves the request's `Idempotency-Key`: `Ok(true)` when a retry was answered with
    /// the stored response; `Ok(false)` to run it (the first with this key, billed under its
    /// claim's ledger key).
    async fn idempotent(
        &self,
        session: &mut Session,
        ctx: &mut Ctx,
        key: &str,
        method: &str,
        path: &str,
        body: &[u8],
    ) -> std::result::Result<bool, Refusal> {
        let Some(grant) = &ctx.grant else { return Ok(false) };
        let mut fingerprint = format!("{method} {path}\n").into_bytes();
        fingerprint.extend_from_slice(body);
        let (store, tenant, key_owned, id) = (
            self.idempotency.clone(),
            grant.tenant_id.clone(),
            key.to_owned(),
            ctx.request_id.clone(),
        );
        let claim = self
            .on_io(async move { store.claim(&tenant, &key_owned, &fingerprint, &id).await })
            .await
            .map_err(|_| Refusal::IdempotencyUnavailable)?;
        match claim {
            Claim::First { ledger_key, shared } => {
                ctx.claim = Some(HeldClaim { ledger_key, shared });
                Ok(false)
            }
            Claim::InProgress => Err(Refusal::IdempotencyInProgress),
            Claim::Mismatch => Err(Refusal::IdempotencyMismatch),
            Claim::Replay { first_request_id, response } => {
                self.metrics.idempotent_replays.inc();
                ctx.status = response.status;
                ctx.outcome = Outcome::Replayed;
                let headers = [
                    ("content-type".to_owned(), response.content_type.clone()),
                    ("idempotent-replayed".to_owned(), "true".to_owned()),
                    (internal::REQUEST_ID.to_owned(), first_request_id),
                ];
                respond(session, response.status, response.body, &headers)
                    .await
                    .map_err(|_| Refusal::WriteFailed)?;
                Ok(true)
            }
        }
    }

    /// Ends this request's idempotency claim, if it holds one: `Some(response)` keeps the
    /// completed response for retries; `None` drops the claim so a retry runs anew.
    async fn end_claim(&self, ctx: &Ctx, response: Option<Stored>) {
        let (Some(claim), Some(grant), Some(key)) = (&ctx.claim, &ctx.grant, &ctx.idempotency_key)
        else {
            return;
        };
        let (store, t, k, id) = (
            self.idempotency.clone(),
            grant.tenant_id.clone(),
            key.clone(),
            ctx.request_id.clone(),
        );
        let shared = claim.shared;
        let _ = self
            .on_io(async move {
                match response {
                    Some(r) => store.complete(&t, &k, &id, shared, r).await,
                    None => store.release(&t, &k, &id, shared).await,
                }
            })
            .await;
    }

    /// Drops this request's idempotency claim (it did not complete): a retry runs anew.
    async fn release_claim(&self, ctx: &mut Ctx) {
        self.end_claim(ctx, None).await;
    }

    /// Keeps a completed response for the retries of this request's idempotency claim.
    async fn complete_claim(&self, ctx: &mut Ctx) {
        let Some(body) = ctx.replay_body.take() else {
            // Too large to keep: a retry runs anew.
            self.end_claim(ctx, None).await;
            return;
        };
        let stored = Stored {
            status: ctx.status,
            content_type: ctx.content_type.clone(),
            body: Bytes::from(body),
        };
        self.end_claim(ctx, Some(stored)).await;
    }

    fn event(
        &self,
        ctx: &Ctx,
        timings: Option<&Timings>,
        completion: u64,
        cached: u64,
        finish: FinishReason,
        error: Option<String>,
    ) -> Option<UsageEvent> {
        let grant = ctx.grant.as_ref()?;
        let t = timings.cloned().unwrap_or_default();
        let identity =
            self.identity_for(ctx.model_revision.as_deref(), t.execution_identity.as_ref());
        let id = identity.as_ref();
        let unknown = || "unknown".to_owned();
        let ems = |k: fn(&EngineTimings) -> f64| t.engine_timings.as_ref().map(|e| k(e) * 1000.0);
        let since =
            |ms: f64| ctx.arrival_at + chrono::TimeDelta::microseconds((ms * 1000.0) as i64);
        let prompt = u32::try_from(ctx.asked.prompt_tokens).unwrap_or(u32::MAX);
        // A request that named no model (or `""`) still gets its row.
        let model =
            ctx.asked.model.clone().filter(|m| !m.is_empty()).unwrap_or_else(|| "unknown".into());
        let rates = self.cfg.prices.rates_under(&model, &grant.tier, ctx.asked.adapter.is_some());
        let first = t.ttft_ms.map(since);
        let last = t.ttft_ms.map(|ttft| {
            since(ttft + t.tpot_ms.unwrap_or(0.0) * completion.saturating_sub(1) as f64)
        });
        Some(UsageEvent {
            request_id: ctx.request_id.clone(),
            idempotency_key: ctx.claim.as_ref().map(|c| c.ledger_key.clone()),
            tenant_id: grant.tenant_id.clone(),
            key_id: grant.key_id.clone(),
            model_id: model,
            model_revision: id
                .map(|i| i.model_revision.clone())
                .or_else(|| ctx.model_revision.clone())
                .unwrap_or_else(unknown),
            tokenizer_revision: id.map_or_else(unknown, |i| i.tokenizer_revision.clone()),
            chat_template_version: id
                .and_then(|i| i.chat_template_version.clone())
                .unwrap_or_else(unknown),
            adapter: id.and_then(|i| i.adapter.clone()),
            engine_version: id.map(|i| i.engine_version.clone()),
            engine_worker: ctx.worker.clone(),
            prompt_tokens: prompt,
            cached_prompt_tokens: u32::try_from(cached.min(ctx.asked.prompt_tokens)).unwrap_or(0),
            completion_tokens: u32::try_from(completion).unwrap_or(u32::MAX),
            finish_reason: finish,
            http_status: ctx.status,
            error_type: error,
            client_disconnected: finish == FinishReason::ClientDisconnected,
            arrival_at: ctx.arrival_at,
            first_token_at: first,
            last_token_at: last.filter(|l| first.is_some_and(|f| *l >= f)),
            ttft_ms: t.ttft_ms,
            tpot_ms: t.tpot_ms,
            itl_max_ms: t.itl_max_ms,
            itl_p99_ms: t.itl_p99_ms,
            e2e_ms: Some(t.e2e_ms),
            engine_queue_ms: ems(|e| e.queue),
            engine_prefill_ms: ems(|e| e.prefill),
            engine_decode_ms: ems(|e| e.decode),
            trace_id: ctx.trace_id.clone(),
            prompt_sha256: if ctx.asked.prompt_sha256.is_empty() {
                hex_digest(b"")
            } else {
                ctx.asked.prompt_sha256.clone()
            },
            prompt_chars: u32::try_from(ctx.asked.prompt_chars).unwrap_or(u32::MAX),
            user_sha256: ctx.asked.user_sha256.clone(),
            // A tenant pays for work done: nothing for a request the client was refused.
            cost_micros: rates.charge(ctx.status, ctx.asked.prompt_tokens, cached, completion),
            price_list_version: self.cfg.prices.version.clone(),
            price_input_micros: rates.input,
            price_cached_input_micros: rates.cached_input,
            price_output_micros: rates.output,
        })
    }

    async fn emit(&self, event: UsageEvent) {
        let id = event.request_id.clone();
        // The in-process writer takes events over a channel from any runtime: no hand-off to
        // the I/O runtime and back (two thread wake-ups per request).
        if let UsageSink::Local(local) = &self.usage {
            if let Err(e) = local.emit(event).await {
                tracing::error!(error = %e, request_id = %id, "usage event not delivered");
            }
            return;
        }
        let sink = self.usage.clone();
        match self.on_io(async move { sink.emit(event).await }).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::error!(error = %e, request_id = %id, "usage event not delivered")
            }
            Err(e) => tracing::error!(error = %e, request_id = %id, "usage task failed"),
        }
    }

    /// Writes the request, about to go to `ctx.worker`, into the journal: its usage event
    /// with nothing generated yet. Without Redis it goes unjournaled (served all the same);
    /// so does a request admitted on local limits, Redis having just failed to answer.
    async fn journal_routed(&self, ctx: &mut Ctx) {
        let Some(journal) = &self.journal else { return };
        if !matches!(ctx.outcome, Outcome::Admitted { via: AdmitVia::Redis, .. }) {
            return;
        }
        // The identity the catalog gives the model (the engine's response names its own).
        let seen = ctx.model_revision.clone();
        if seen.is_none() {
            let model = ctx.asked.model.as_deref().unwrap_or_default();
            ctx.model_revision = self
                .served
                .catalog
                .resolve(model)
                .and_then(|e| e.identity.as_ref().map(|i| i.model_revision.clone()));
        }
        let event = self.event(ctx, None, 0, 0, FinishReason::Error, None);
        ctx.model_revision = seen;
        let Some(event) = event else { return };
        let entry = Entry {
            event,
            routed_ms: Utc::now().timestamp_millis(),
            limit_key: ctx.key_scope.as_ref().map(|(k, _)| k.clone()),
            claim_key: ctx.claim.as_ref().filter(|c| c.shared).and(ctx.idempotency_key.clone()),
        };
        let journal = Arc::clone(journal);
        let began = Instant::now();
        let written = self.on_io(async move { journal.write(&entry).await }).await;
        // Part of what the gateway adds before the engine sees the request.
        ctx.overhead += began.elapsed();
        self.metrics.journal_write.observe(began.elapsed().as_secs_f64());
        match written {
            Ok(Ok(())) => ctx.journaled = true,
            Ok(Err(e)) => tracing::warn!(error = %e, request_id = %ctx.request_id,
                "not journaled: this request is lost to billing if this gateway dies"),
            Err(e) => tracing::warn!(error = %e, "journal task failed"),
        }
    }

    /// Emits the request's final event, then takes it out of the journal once delivered.
    async fn emit_final(&self, ctx: &mut Ctx, event: UsageEvent) {
        self.emit(event).await;
        self.forget_delivered(ctx);
    }

    /// Takes a request whose final event went out of the journal, once it is delivered.
    fn forget_delivered(&self, ctx: &mut Ctx) {
        let Some(journal) = self.journal.as_ref().filter(|_| std::mem::take(&mut ctx.journaled))
        else {
            return;
        };
        let id = ctx.request_id.clone();
        if self.usage.retrying(&id) {
            // Redis and the ledger both refused it: the entry stays until the background
            // retry delivers it (were this gateway to die first, its recovery bills it).
            let (journal, sink) = (Arc::clone(journal), self.usage.clone());
            self.io.spawn(async move {
                sink.delivered(&id).await;
                journal.forget_later(id);
            });
        } else {
            journal.forget_later(id);
        }
    }

    /// Settles an admitted request's reservation with the `used` tokens (once: a second call
    /// does nothing) and emits its final `event`. A reservation in Redis is settled in the same
    /// hand-off to the I/O runtime as the event is emitted, the two side by side: one wake-up
    /// each way for both, and both commands in one write when the connection finds them queued
    /// together. A panic in one still lets the other finish, as two tasks would.
    async fn settle_and_emit(&self, ctx: &mut Ctx, used: u64, event: Option<UsageEvent>) {
        let Some(settlement) = self.settle_here(ctx, used) else {
            if let Some(event) = event {
                self.emit_final(ctx, event).await;
            }
            return;
        };
        let emitted = event.is_some();
        let (sink, id) = (self.usage.clone(), ctx.request_id.clone());
        let both = async move {
            let s = &settlement;
            let settle = s.limiter.settle(&s.tenant, s.key.as_deref(), &s.request_id, used);
            let emit = async {
                match event {
                    Some(event) => Some(sink.emit(event).await),
                    None => None,
                }
            };
            let (settle, emit) = (AssertUnwindSafe(settle), AssertUnwindSafe(emit));
            let (settled, emitted) = tokio::join!(settle.catch_unwind(), emit.catch_unwind());
            (settled, emitted, settlement)
        };
        let (settled, emitted_as, settlement) = match self.on_io(both).await {
            Ok(both) => both,
            Err(e) => {
                // The runtime is going down: the journal keeps the entry for the recovery.
                tracing::error!(error = %e, request_id = %id, "usage task failed");
                return;
            }
        };
        match settled {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "settlement failed; retrying");
                self.settle_later(settlement, used);
            }
            Err(_) => tracing::error!(request_id = %id, "settlement task panicked"),
        }
        match emitted_as {
            Ok(Some(Err(e))) => {
                tracing::error!(error = %e, request_id = %id, "usage event not delivered")
            }
            Err(_) => tracing::error!(request_id = %id, "usage task failed"),
            Ok(_) => {}
        }
        if emitted {
            self.forget_delivered(ctx);
        }
    }

    /// Marks an admitted request settled, and settles it at once when its reservation was
    /// made here (local limits); one made in Redis is returned, to settle there.
    fn settle_here(&self, ctx: &mut Ctx, used: u64) -> Option<Settlement> {
        let Outcome::Admitted { via, settled: false } = ctx.outcome else { return None };
        ctx.outcome = Outcome::Admitted { via, settled: true };
        let grant = ctx.grant.as_ref()?;
        let key = ctx.key_scope.as_ref().map(|(k, _)| k.clone());
        match via {
            AdmitVia::Redis => Some(Settlement {
                limiter: self.limiter.clone()?,
                tenant: grant.tenant_id.clone(),
                key,
                request_id: ctx.request_id.clone(),
            }),
            AdmitVia::Local => {
                self.local.release(&grant.tenant_id, key.as_deref(), ctx.asked.reserved, used);
                None
            }
        }
    }

    /// Settling twice settles once (the script drops the reservation), so a failed
    /// settlement (Redis restarting, say) is retried in the background for a while; only past
    /// that does the reservation expire instead.
    fn settle_later(&self, s: Settlement, used: u64) {
        drop(self.io.spawn(async move {
            let mut delay = Duration::from_millis(200);
            let give_up = Instant::now() + SETTLE_RETRY_FOR;
            loop {
                tokio::time::sleep(delay).await;
                match s.limiter.settle(&s.tenant, s.key.as_deref(), &s.request_id, used).await {
                    Ok(_) => return,
                    Err(e) if Instant::now() >= give_up => {
                        tracing::warn!(error = %e, "settlement failed; the reservation expires instead");
                        return;
                    }
                    Err(_) => delay = (delay * 2).min(Duration::from_secs(5)),
                }
            }
        }));
    }
}

/// A reservation in Redis to settle: the limiter, the tenant, the API key whose own limits it
/// was also made under, the request.
struct Settlement {
    limiter: Limiter,
    tenant: String,
    key: Option<String>,
    request_id: String,
}

/// How long a failed settlement of a Redis reservation is retried before it is left to expire.
const SETTLE_RETRY_FOR: Duration = Duration::from_secs(120);

/// The largest request body checked (parsed, rendered, tokenized) on the I/O thread itself:
/// a plain prompt of this size is some 100 µs of tokenizing (about 0.2 µs a byte; a chat's
/// template and tools add their own text, and the first special-token text met builds the
/// tokenizer's literal copy once), where a hand-off to the blocking pool and back costs some
/// 25 µs of CPU and two thread wake-ups on every request.
const INLINE_CHECK_BYTES: usize = 512;

/// How long the gateway waits for an engine to finish aborting a request it asks about.
const OUTCOME_WAIT: Duration = Duration::from_secs(10);

/// How long asking an engine to abort a request may take.
const ABORT_WAIT: Duration = Duration::from_secs(5);

impl Gateway {
    /// The engine's own count for this request, once it has ended there (`None` when the
    /// worker cannot say: unreachable, or it never ran the request).
    async fn engine_outcome(&self, ctx: &Ctx) -> Option<EngineOutcome> {
        let worker = ctx.worker.clone()?;
        let (engines, id) = (self.engines.clone(), ctx.request_id.clone());
        let ask = async move {
            // Whatever still runs for it is stopped first (nothing reads it any more), so the
            // count below is final.
            let _ = engines.abort(&worker, &id, ABORT_WAIT).await;
            engines.outcome(&worker, &id, OUTCOME_WAIT).await.ok().flatten()
        };
        let o = self.on_io(ask).await.ok().flatten();
        match o {
            Some(o) if o.finished() => Some(o),
            Some(o) => {
                tracing::warn!(request_id = %ctx.request_id, state = ?o.state,
                    "the engine did not end the request in time; billing its count so far");
                Some(o)
            }
            None => {
                tracing::warn!(request_id = %ctx.request_id, "the engine's count is unavailable");
                None
            }
        }
    }
}

#[async_trait]
impl ProxyHttp for Gateway {
    type CTX = Ctx;

    fn new_ctx(&self) -> Ctx {
        Ctx {
            arrival: Instant::now(),
            arrival_at: Utc::now(),
            // Time-ordered (UUIDv7: the millisecond, a counter seeded at random each
            // millisecond, 32 random bits): the ledger's index on the id takes each row at its
            // end, not on a random page. The id shows its arrival to the millisecond.
            request_id: format!("req_{}", uuid::Uuid::now_v7().simple()),
            outcome: Outcome::Open,
            grant: None,
            key_scope: None,
            body: None,
            asked: Asked::default(),
            rate: RateState::default(),
            observer: None,
            response_body: Vec::new(),
            status: 0,
            overhead: Duration::ZERO,
            idempotency_key: None,
            claim: None,
            replay_body: Some(Vec::new()),
            content_type: String::new(),
            trace_id: None,
            worker: None,
            journaled: false,
            model_revision: None,
            tried: Vec::new(),
            cancelled: false,
            client_ip: None,
            tenant_slot: None,
            sse_tail: Vec::new(),
            span: tracing::Span::none(),
            fair_slot: None,
        }
    }

    async fn request_filter(&self, session: &mut Session, ctx: &mut Ctx) -> Result<bool> {
        ctx.arrival = Instant::now();
        ctx.arrival_at = Utc::now();
        ctx.span = tracing::info_span!(
            "gateway.request",
            otel.kind = "server",
            request_id = %ctx.request_id,
            path = %session.req_header().uri.path(),
            tenant = tracing::field::Empty,
            status = tracing::field::Empty,
        );
        let parent = opentelemetry::global::get_text_map_propagator(|p| {
            p.extract(&opentelemetry_http::HeaderExtractor(&session.req_header().headers))
        });
        let _ = tracing_opentelemetry::OpenTelemetrySpanExt::set_parent(&ctx.span, parent);
        // Entering once starts the exported span, fixing the id the engine's span will name
        // as its parent.
        ctx.span.in_scope(|| ());
        // In flight from here to `logging`: registered before the drain is checked (in
        // `admit`), so a drain that begins now waits for this request.
        self.drain.begin(&ctx.request_id);
        // One address cannot hold every task (a flood of slow bodies, say).
        let peer = session.client_addr().and_then(|a| a.as_inet()).map(|a| a.ip());
        let forwarded = header(session.req_header(), "x-forwarded-for");
        ctx.client_ip = peer.map(|p| client_address(p, forwarded, &self.cfg.trusted_proxies));
        if let Some(ip) = ctx.client_ip
            && !self.per_client.enter(&ip, u64::from(self.cfg.max_per_client))
        {
            ctx.client_ip = None;
            return self.refuse(session, ctx, Refusal::TooManyConnections).await;
        }
        // Idle kept-alive connections close. The body's deadline is admit's, over its whole
        // arrival: not pingora's downstream read timeout, which would also cut off a client
        // quietly waiting for a long answer.
        session.set_keepalive(Some(self.cfg.idle_timeout.as_secs().max(1)));
        // A client that pipelines gets its responses in order (pingora drops request N+1
        // by default).
        if let pingora::protocols::http::ServerSession::H1(h1) = session.downstream_session.as_mut()
        {
            h1.set_pipelining_enabled(true);
        }
        if let Some(done) = self.probe(session, ctx).await? {
            return Ok(done);
        }
        match self.admit(session, ctx).await {
            Ok(done) => {
                ctx.overhead = ctx.arrival.elapsed();
                Ok(done)
            }
            Err(r) => self.refuse(session, ctx, r).await,
        }
    }

    async fn upstream_peer(&self, _session: &mut Session, ctx: &mut Ctx) -> Result<Box<HttpPeer>> {
        if self.drain.draining() && self.drain.was_cancelled(&ctx.request_id) {
            // Cancelled by the drain before it reached an engine: it never will.
            ctx.cancelled = true;
            return Err(Error::explain(ErrorType::HTTPStatus(503), "cancelled at shutdown"));
        }
        let tenant = ctx.grant.as_ref().map(|g| g.tenant_id.as_str()).unwrap_or("");
        let key = format!("{tenant}\n{}", ctx.asked.affinity);
        let model = ctx.asked.model.as_deref().unwrap_or_default();
        let w = self.workers.choose(model, &key, &ctx.tried).ok_or_else(|| {
            Error::explain(ErrorType::ConnectNoRoute, "no engine worker left to try")
        })?;
        ctx.tried.push(w.addr.clone());
        ctx.worker = Some(w.addr.clone());
        self.drain.routed(&ctx.request_id, &w.addr);
        self.journal_routed(ctx).await;
        Ok(Box::new(HttpPeer::new(w.addr.as_str(), false, String::new())))
    }

    async fn fail_to_proxy(
        &self,
        session: &mut Session,
        e: &Error,
        ctx: &mut Ctx,
    ) -> pingora::proxy::FailToProxy {
        let code = match e.etype() {
            ErrorType::HTTPStatus(code) => *code,
            // No worker left to try.
            ErrorType::ConnectNoRoute => 502,
            _ => match e.esource() {
                ErrorSource::Upstream => 502,
                ErrorSource::Downstream => match e.etype() {
                    // The client is gone: nothing to answer.
                    ErrorType::WriteError | ErrorType::ReadError | ErrorType::ConnectionClosed => 0,
                    _ => 400,
                },
                ErrorSource::Internal | ErrorSource::Unset => 500,
            },
        };
        // Only while nothing of the response was sent: OpenAI's error JSON, and the status
        // the client got is the one recorded.
        if code > 0 && ctx.status == 0 {
            let (kind, message) = match code {
                502 => ("server_error", "the engine could not be reached; retry shortly"),
                504 => ("server_error", "the engine did not answer in time"),
                400..=499 => ("invalid_request_error", "the request could not be read"),
                _ => ("server_error", "the gateway failed to proxy the request"),
            };
            let body = error_json(message, kind, None, Some("upstream_error"));
            let headers = [(internal::REQUEST_ID.to_owned(), ctx.request_id.clone())];
            if respond(session, code, body, &headers).await.is_ok() {
                ctx.status = code;
            }
        } else if code > 0
            && ctx.asked.stream
            && ctx.status == 200
            && !ctx.cancelled
            && matches!(e.esource(), ErrorSource::Upstream)
            && !ctx.observer.as_ref().is_some_and(StreamObserver::done)
        {
            // The engine broke off a stream the client is reading (it died, say): the stream
            // ends with a terminal error event and [DONE], not a cut connection, so the client
            // knows the answer is cut short (it is billed for the tokens it received).
            let err = error_json(
                "the engine failed while streaming this answer; retry it",
                "server_error",
                None,
                Some("upstream_error"),
            );
            // A blank line first: should the engine have died inside an event, that event
            // ends there rather than running into this one.
            let mut out = b"\n\ndata: ".to_vec();
            out.extend_from_slice(&err);
            out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
            let _ = session.downstream_session.write_response_body(Bytes::from(out), true).await;
        }
        pingora::proxy::FailToProxy { error_code: code, can_reuse_downstream: false }
    }

    fn fail_to_connect(
        &self,
        _session: &mut Session,
        _peer: &HttpPeer,
        ctx: &mut Ctx,
        mut e: Box<Error>,
    ) -> Box<Error> {
        // Nothing reached the client yet: another worker may take it. Decided either way:
        // pingora panics on an error whose retry is left undecided.
        e.set_retry(ctx.tried.len() < self.workers.len());
        e
    }

    fn error_while_proxy(
        &self,
        _peer: &HttpPeer,
        _session: &mut Session,
        mut e: Box<Error>,
        ctx: &mut Ctx,
        _client_reused: bool,
    ) -> Box<Error> {
        // Retry elsewhere only if no byte of the response was sent to the client, and while
        // a worker is left to try. Decided either way: an engine's broken connection comes
        // with its retry undecided, and pingora panics on one left so, taking the request's
        // task (its answer, its ledger row, its settlement) with it.
        e.set_retry(ctx.status == 0 && ctx.tried.len() < self.workers.len());
        e
    }

    async fn upstream_request_filter(
        &self,
        _session: &mut Session,
        req: &mut RequestHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The route alone: a query string means nothing to the engine (and a long one got an
        // empty 414 from it).
        if let Ok(uri) = http::Uri::try_from(req.uri.path()) {
            req.set_uri(uri);
        }
        // Only what the engine needs passes: never the client's cookies, forwarding headers,
        // credentials or x-sluice-* (the trusted ones are set below).
        let names: Vec<String> = req
            .headers
            .keys()
            .map(|k| k.as_str().to_owned())
            .filter(|k| !FORWARDED_HEADERS.contains(&k.as_str()))
            .collect();
        for n in names {
            req.remove_header(&n);
        }
        if let Some(g) = &ctx.grant {
            req.insert_header(internal::TENANT, g.tenant_id.as_str())?;
            let priority = g.quota.priority.unwrap_or(0);
            req.insert_header(internal::PRIORITY, priority.to_string())?;
            let weight = g.weight();
            req.insert_header(internal::WEIGHT, weight.to_string())?;
            if let Some(ms) = ctx.asked.slo.tpot_ms {
                req.insert_header(internal::TPOT_MS, ms.to_string())?;
            }
        }
        if let Some(a) = &ctx.asked.adapter {
            req.insert_header(internal::ADAPTER, a.as_str())?;
        }
        req.insert_header(internal::REQUEST_ID, ctx.request_id.as_str())?;
        // The gateway span's context when traces are exported; otherwise the client's trace
        // id (or a new one) under a fresh span id.
        let mut injected = http::HeaderMap::new();
        let cx = tracing_opentelemetry::OpenTelemetrySpanExt::context(&ctx.span);
        opentelemetry::global::get_text_map_propagator(|p| {
            p.inject_context(&cx, &mut opentelemetry_http::HeaderInjector(&mut injected))
        });
        let propagated =
            injected.get(internal::TRACEPARENT).and_then(|v| v.to_str().ok()).map(str::to_owned);
        let traceparent = match propagated {
            Some(tp) => tp,
            None => {
                let trace = ctx
                    .trace_id
                    .clone()
                    .unwrap_or_else(|| uuid::Uuid::new_v4().simple().to_string());
                let span_id = &uuid::Uuid::new_v4().simple().to_string()[..16];
                format!("00-{trace}-{span_id}-01")
            }
        };
        ctx.trace_id = traceparent.split('-').nth(1).map(str::to_owned);
        req.insert_header(internal::TRACEPARENT, traceparent)?;
        if let Some(t) = &self.cfg.internal_token {
            req.insert_header("authorization", format!("Bearer {t}"))?;
        }
        if let Some(b) = &ctx.body {
            req.remove_header("transfer-encoding");
            req.insert_header("content-length", b.len().to_string())?;
            req.insert_header("content-type", "application/json")?;
        }
        Ok(())
    }

    async fn request_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<()> {
        // The client's body was read (and checked) in request_filter; what goes upstream is
        // the rewritten one, whole, in place of the buffered original.
        if end_of_stream {
            *body = ctx.body.clone();
        } else {
            *body = None;
        }
        Ok(())
    }

    async fn response_filter(
        &self,
        _session: &mut Session,
        resp: &mut ResponseHeader,
        ctx: &mut Ctx,
    ) -> Result<()> {
        if !ctx.asked.stream && self.drain.draining() && self.drain.was_cancelled(&ctx.request_id) {
            // Cancelled at shutdown before its answer went out: the client gets a 503 (the
            // engine's partial answer is read for its usage only).
            ctx.cancelled = true;
            resp.set_status(503)?;
            resp.insert_header("content-type", "application/json")?;
            resp.insert_header("content-length", shutdown_body().len().to_string())?;
            resp.remove_header("transfer-encoding");
        }
        ctx.status = resp.status.as_u16();
        ctx.content_type = resp
            .headers
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .unwrap_or("application/json")
            .to_owned();
        ctx.model_revision = resp
            .headers
            .get(internal::MODEL_REVISION)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        for (k, v) in rate_headers(&ctx.rate) {
            resp.insert_header(k, v)?;
        }
        resp.insert_header(internal::REQUEST_ID, ctx.request_id.as_str())?;
        resp.insert_header(
            internal::GATEWAY_OVERHEAD_MS,
            format!("{:.3}", ctx.overhead.as_secs_f64() * 1000.0),
        )?;
        if ctx.asked.stream && ctx.status == 200 {
            ctx.observer = Some(StreamObserver::new(ctx.arrival));
        }
        Ok(())
    }

    fn response_body_filter(
        &self,
        _session: &mut Session,
        body: &mut Option<Bytes>,
        end_of_stream: bool,
        ctx: &mut Ctx,
    ) -> Result<Option<Duration>> {
        self.observe_body(body, ctx);
        if ctx.cancelled && !ctx.asked.stream {
            *body = end_of_stream.then(shutdown_body);
            return Ok(None);
        }
        if ctx.asked.stream && !ctx.cancelled && self.drain.draining() {
            ctx.cancelled = self.drain.was_cancelled(&ctx.request_id);
        }
        if ctx.asked.stream && ctx.status == 200 && (ctx.asked.strip_usage || ctx.cancelled) {
            // Whole events only: the usage-only chunk the client did not ask for, and once
            // cancelled at shutdown the engine's [DONE] (the client's last events are an error,
            // then [DONE]), are held back.
            let (usage, done) = (ctx.asked.strip_usage, ctx.cancelled);
            let chunk = body.take().unwrap_or_default();
            let mut out = whole_events(&mut ctx.sse_tail, &chunk, end_of_stream, |e| {
                !(usage && is_usage_only(e) || done && e.starts_with(b"data: [DONE]"))
            });
            if done && end_of_stream {
                out.extend_from_slice(b"data: ");
                out.extend_from_slice(&shutdown_body());
                out.extend_from_slice(b"\n\ndata: [DONE]\n\n");
            }
            // Never an empty chunk: in chunked encoding that ends the response.
            *body = (!out.is_empty()).then(|| Bytes::from(out));
        }
        Ok(None)
    }

    async fn logging(&self, session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        // The answer is out: the address's slot frees now, not after its usage event is
        // written, or a client's next request could be refused for our ledger's latency.
        if let Some(ip) = ctx.client_ip.take() {
            self.per_client.leave(&ip);
        }
        if let Some(tenant) = ctx.tenant_slot.take() {
            self.per_tenant.leave(&tenant);
        }
        tracing::trace!(
            request_id = %ctx.request_id,
            status = ctx.status,
            prompt_tokens = ctx.asked.prompt_tokens,
            "request ended"
        );
        self.log_request(session, e, ctx).await;
        self.drain.end(&ctx.request_id);
    }
}

/// Requests in flight per client address, or per tenant.
struct InFlight<K>(Mutex<HashMap<K, u64>>);

impl<K> Default for InFlight<K> {
    fn default() -> Self {
        Self(Mutex::new(HashMap::new()))
    }
}

impl<K: std::hash::Hash + Eq + Clone> InFlight<K> {
    /// Counts one more for `k` unless it has `max` already.
    fn enter(&self, k: &K, max: u64) -> bool {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let n = m.entry(k.clone()).or_insert(0);
        if *n >= max {
            return false;
        }
        *n += 1;
        true
    }

    fn leave(&self, k: &K) {
        let mut m = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(n) = m.get_mut(k) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(k);
            }
        }
    }
}

/// The client a request comes from: its peer, or, when the peer is a trusted proxy, the
/// rightmost address of `X-Forwarded-For` that is not itself a trusted proxy (the one the
/// first trusted hop saw; those left of it are the client's to forge). A header that does
/// not parse leaves the peer.
fn client_address(
    peer: std::net::IpAddr,
    forwarded: Option<&str>,
    trusted: &[ipnet::IpNet],
) -> std::net::IpAddr {
    let is_trusted = |ip: &std::net::IpAddr| trusted.iter().any(|net| net.contains(ip));
    if !is_trusted(&peer) {
        return peer;
    }
    let Some(list) = forwarded else { return peer };
    let mut hops = Vec::new();
    for part in list.split(',') {
        match part.trim().parse::<std::net::IpAddr>() {
            Ok(ip) => hops.push(ip),
            Err(_) => return peer,
        }
    }
    hops.into_iter().rev().find(|ip| !is_trusted(ip)).unwrap_or(peer)
}

/// The error a request cancelled at shutdown ends with.
fn shutdown_body() -> Bytes {
    error_json(
        "the server shut down before this request finished; retry it",
        "server_error",
        None,
        Some("shutting_down"),
    )
}

/// The complete SSE events of `tail` + `chunk` that `keep` keeps; what follows the last
/// complete event stays in `tail` (all of it goes out at the end).
fn whole_events(
    tail: &mut Vec<u8>,
    chunk: &[u8],
    end: bool,
    keep: impl Fn(&[u8]) -> bool,
) -> Vec<u8> {
    tail.extend_from_slice(chunk);
    let mut out = Vec::with_capacity(tail.len());
    let mut start = 0;
    while let Some(i) = tail[start..].windows(2).position(|w| w == b"\n\n") {
        let event = &tail[start..start + i + 2];
        if keep(event) {
            out.extend_from_slice(event);
        }
        start += i + 2;
    }
    if end {
        out.extend_from_slice(&tail[start..]);
        start = tail.len();
    }
    tail.drain(..start);
    out
}

fn is_usage_only(event: &[u8]) -> bool {
    let has = |needle: &[u8]| event.windows(needle.len()).any(|w| w == needle);
    event.starts_with(b"data: {") && has(b"\"choices\":[]") && has(b"\"usage\":")
}

impl Gateway {
    /// Keeps what the response body tells (for idempotent replay, the stream observer, the
    /// whole body's usage).
    fn observe_body(&self, body: &Option<Bytes>, ctx: &mut Ctx) {
        if let Some(b) = body {
            // Kept for idempotent retries only while a claim is held and it stays small.
            if ctx.claim.is_some()
                && let Some(keep) = &mut ctx.replay_body
            {
                if keep.len() + b.len() <= idempotency::MAX_STORED {
                    keep.extend_from_slice(b);
                } else {
                    ctx.replay_body = None;
                }
            }
            let now = Instant::now();
            match &mut ctx.observer {
                Some(o) => {
                    o.on_bytes(b, now);
                    // Its first token is out: it no longer waits in its tenant's queue.
                    if o.started()
                        && let Some(slot) = &mut ctx.fair_slot
                    {
                        slot.start();
                    }
                }
                None if ctx.response_body.len() < 16 << 20 => {
                    ctx.response_body.extend_from_slice(b)
                }
                None => {}
            }
        }
    }

    /// Records what the client received in the latency histograms, and how long the request
    /// held its place in the batch (the engine's own prefill and decode) for fair admission.
    fn observe_timings(&self, timings: &Timings) {
        let secs = |ms: f64| ms / 1000.0;
        if let Some(t) = timings.ttft_ms {
            self.metrics.ttft.observe(secs(t));
        }
        if let Some(t) = timings.tpot_ms {
            self.metrics.tpot.observe(secs(t));
        }
        for (gap, _) in &timings.gaps_ms {
            self.metrics.itl.observe(secs(*gap));
        }
        self.metrics.e2e.observe(secs(timings.e2e_ms));
        if let Some(t) = &timings.engine_timings {
            self.fair.served(t.in_batch());
        }
    }

    /// Settles the request and emits its one usage event.
    async fn log_request(&self, _session: &mut Session, e: Option<&Error>, ctx: &mut Ctx) {
        let end = Instant::now();
        ctx.span.record("status", ctx.status);
        if let Some(g) = &ctx.grant {
            ctx.span.record("tenant", g.tenant_id.as_str());
        }
        let tier = ctx.grant.as_ref().map_or("none", |g| g.tier.as_str()).to_owned();
        let status = if ctx.status == 0 { 499 } else { ctx.status };
        self.metrics
            .requests
            .get_or_create(&RequestLabels { status: status.to_string(), tier })
            .inc();
        if matches!(ctx.outcome, Outcome::Admitted { .. }) {
            self.metrics.overhead.observe(ctx.overhead.as_secs_f64());
        }
        if ctx.grant.is_none() {
            return;
        }
        let admitted = match ctx.outcome {
            Outcome::Open | Outcome::Replayed => return,
            Outcome::Refused(reason) => Err(reason),
            Outcome::Admitted { .. } => Ok(()),
        };
        if let Err(reason) = admitted {
            let status = ctx.status;
            self.release_claim(ctx).await;
            let t = Timings {
                e2e_ms: end.saturating_duration_since(ctx.arrival).as_secs_f64() * 1000.0,
                ..Timings::default()
            };
            if let Some(ev) =
                self.event(ctx, Some(&t), 0, 0, reason, Some(format!("http_{status}")))
            {
                self.emit_final(ctx, ev).await;
            }
            return;
        }
        let timings = observed(ctx, end);
        self.observe_timings(&timings);
        ctx.fair_slot = None;
        let facts = facts(ctx, e, &timings);
        // The engine's final count never reached us: the engine says what it did.
        let engine = if facts.needs_engine_count() {
            self.engine_outcome(ctx).await.map(|o| Counts {
                completion: Some(o.completion_tokens),
                cached: Some(o.cached_tokens),
            })
        } else {
            None
        };
        let Conclusion { finish, error, status, completion, cached } = conclude(&facts, engine);
        ctx.status = status;
        // A refused request used nothing of the quota (as the ledger, which seeds the windows,
        // counts it).
        let used = if is_refused(ctx.status) { 0 } else { ctx.asked.prompt_tokens + completion };
        // An idempotency claim ends after the settlement (a retry it lets run finds the
        // quota settled) and before the event (a gateway dying in between leaves the claim to
        // its journal's recovery); without one, settlement and event go out together.
        let claimed = ctx.claim.is_some();
        if claimed {
            self.settle_and_emit(ctx, used, None).await;
        }
        if let Some(grant) = ctx.grant.as_ref().filter(|_| used > 0 && completion > 0) {
            self.fair.used(&grant.tenant_id, completion);
        }
        // Only a whole answer small enough to keep is replayed to retries; anything else lets a
        // retry run anew.
        if ctx.status == 200
            && matches!(finish, FinishReason::Stop | FinishReason::Length | FinishReason::ToolCalls)
            && ctx.replay_body.is_some()
        {
            self.complete_claim(ctx).await;
        } else {
            self.release_claim(ctx).await;
        }
        let event = self.event(ctx, Some(&timings), completion, cached, finish, error);
        if claimed {
            if let Some(event) = event {
                self.emit_final(ctx, event).await;
            }
        } else {
            self.settle_and_emit(ctx, used, event).await;
        }
    }
}

/// What the client received of an admitted request that ended at `end`, timed: the stream
/// observer's figures, or a whole body's (no observable first token: recorded as absent, not
/// as E2E).
fn observed(ctx: &mut Ctx, end: Instant) -> Timings {
    if let Some(o) = ctx.observer.take() {
        return o.finish(end);
    }
    let e2e_ms = end.saturating_duration_since(ctx.arrival).as_secs_f64() * 1000.0;
    observe::whole_response(&ctx.response_body, e2e_ms)
}

/// What the gateway saw of an admitted request by its end, for [`conclude`].
fn facts<'t>(ctx: &Ctx, e: Option<&Error>, timings: &'t Timings) -> Facts<'t> {
    let usage = timings.usage.as_ref().filter(|u| !u.is_null());
    Facts {
        cancelled: ctx.cancelled,
        failure: e.map(|e| Failure {
            side: match e.esource() {
                ErrorSource::Upstream => Side::Upstream,
                ErrorSource::Downstream => Side::Downstream,
                _ => Side::Internal,
            },
            kind: format!("{:?}", e.etype()),
        }),
        stream: ctx.asked.stream,
        done: timings.done,
        status: ctx.status,
        finish_reason: timings.finish_reason.as_deref(),
        // The wire's usage, whole; one the engine did not write whole counts for nothing, and
        // the stream's own count stands in.
        usage: usage.map(|u| match Usage::deserialize(u) {
            Ok(u) => Counts {
                completion: Some(u.completion_tokens),
                cached: Some(u.prompt_tokens_details.cached_tokens),
            },
            Err(_) => Counts::default(),
        }),
        streamed_tokens: timings.streamed_tokens,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_usage_chunk_is_held_back_across_chunk_boundaries() {
        let stream = concat!(
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"completion_tokens\":1}}\n\n",
            "data: [DONE]\n\n"
        )
        .as_bytes();
        // Every split point: the client gets the text and [DONE], never the usage.
        for cut in 0..stream.len() {
            let mut tail = Vec::new();
            let keep = |e: &[u8]| !is_usage_only(e);
            let mut out = whole_events(&mut tail, &stream[..cut], false, keep);
            out.extend(whole_events(&mut tail, &stream[cut..], true, keep));
            assert_eq!(
                String::from_utf8_lossy(&out),
                "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: [DONE]\n\n",
                "cut at {cut}"
            );
        }
    }

    #[test]
    fn the_client_is_the_peer_unless_a_trusted_proxy_forwards_for_it() {
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap_or(std::net::IpAddr::from([0; 4]));
        let trusted: Vec<ipnet::IpNet> =
            ["10.0.0.0/8", "::1/128"].iter().filter_map(|n| n.parse().ok()).collect();
        let lb = ip("10.1.2.3");
        // An untrusted peer's header is its own to forge: ignored.
        assert_eq!(client_address(ip("203.0.113.9"), Some("1.2.3.4"), &trusted), ip("203.0.113.9"));
        // Through the load balancer: the address it saw.
        assert_eq!(client_address(lb, Some("198.51.100.7"), &trusted), ip("198.51.100.7"));
        // A client that sends its own header: the rightmost untrusted hop, not its forgery.
        assert_eq!(
            client_address(lb, Some("6.6.6.6, 198.51.100.7, 10.9.9.9"), &trusted),
            ip("198.51.100.7")
        );
        // No header, a malformed one, or only trusted hops: the peer.
        assert_eq!(client_address(lb, None, &trusted), lb);
        assert_eq!(client_address(lb, Some("not-an-ip"), &trusted), lb);
        assert_eq!(client_address(lb, Some("10.5.5.5"), &trusted), lb);
        // Nothing trusted: always the peer.
        assert_eq!(client_address(lb, Some("198.51.100.7"), &[]), lb);
    }
}
