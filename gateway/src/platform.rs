//! The wiring every entry point shares (`sluice up`, `sluice gateway`, `sluice bench
//! gateway`): the I/O runtime the gateway's async work runs on, pingora's server settings, the
//! gateway's defaults and price table, where usage goes (Redis with billing's consumer, or the
//! local writer), the metrics endpoint, the proxy's run and drain, and the final flush. The
//! binary only parses flags and calls these.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use pingora::server::ShutdownSignalWatch;
use pingora::server::configuration::ServerConf;
use sluice_billing::local::{LocalIngest, LocalIngestConfig};
use sluice_billing::{BillingError, Ledger};
use sluice_policies::prices::PRICES;
use sluice_policies::redis_conn::{Namespace, RedisTarget};

use crate::drain::DrainOnSignal;
use crate::journal::Journal;
use crate::limits::Limiter;
use crate::local::RedisDownPolicy;
use crate::proxy::{Gateway, GatewayConfig, Worker};
use crate::sink::UsageSink;

/// Why the platform could not start (the cause is the error's `source`, which `{:#}` prints).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// A runtime, thread, socket or file could not be set up.
    #[error("{what}")]
    Io {
        /// What was being done.
        what: String,
        /// The underlying error.
        source: std::io::Error,
    },
    /// Redis could not be reached or configured.
    #[error("{what}")]
    Redis {
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        source: redis::RedisError,
    },
    /// The ledger or the usage writer could not start.
    #[error("{what}")]
    Billing {
        /// What was being done.
        what: &'static str,
        /// The underlying error.
        source: BillingError,
    },
    /// A path pingora needs as text is not UTF-8, or TLS could not be configured.
    #[error("{0}")]
    Config(String),
    /// Usage events neither the stream nor the ledger took before exit (each logged whole).
    #[error("{0} usage events were undelivered at exit (logged whole above)")]
    Undelivered(usize),
}

fn io_error(what: impl Into<String>) -> impl FnOnce(std::io::Error) -> StartError {
    let what = what.into();
    move |source| StartError::Io { what, source }
}

/// Keeps an I/O runtime running on its own thread for as long as it lives.
pub struct IoRuntime {
    /// Where the gateway's async work (ledger, usage writer, health checks) is spawned.
    pub handle: tokio::runtime::Handle,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl IoRuntime {
    /// The default runtime, `sluice-io`.
    pub fn start() -> Result<Self, StartError> {
        Self::named("sluice-io")
    }

    /// An I/O runtime whose threads are called `name` (so a profile or `bench gateway`'s
    /// core layout can tell runtimes apart).
    pub fn named(name: &str) -> Result<Self, StartError> {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name(name)
            .enable_all()
            .build()
            .map_err(io_error("starting the async runtime"))?;
        let handle = rt.handle().clone();
        let (stop, rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name(format!("{name}-main"))
            .spawn(move || {
                let _ = rt.block_on(rx);
            })
            .map_err(io_error("starting the I/O thread"))?;
        Ok(Self { handle, stop: Some(stop), thread: Some(thread) })
    }
}

impl Drop for IoRuntime {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// pingora's settings: two threads, no grace period, two seconds for a graceful shutdown (the
/// drain itself is [`DrainOnSignal`]'s).
pub fn server_conf() -> ServerConf {
    ServerConf {
        threads: 2,
        grace_period_seconds: Some(0),
        graceful_shutdown_timeout_seconds: Some(2),
        ..Default::default()
    }
}

impl GatewayConfig {
    /// The settings every entry point shares: 2 s key cache, 512 default output tokens, 256
    /// queued requests per worker before 503, the price list of `policies/prices.json`
    /// ([`PRICES`]), the front door's timeouts.
    pub fn platform(
        workers: &[String],
        internal_token: Option<String>,
        redis_down: RedisDownPolicy,
    ) -> GatewayConfig {
        GatewayConfig {
            workers: workers.iter().map(|a| Worker { addr: a.clone() }).collect(),
            max_waiting: 256,
            internal_token,
            default_max_tokens: 512,
            key_cache_ttl: Duration::from_secs(2),
            redis_down,
            prices: &PRICES,
            name: "gateway".into(),
            idle_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_per_client: 512,
            trusted_proxies: Vec::new(),
            fair_admission: true,
        }
    }
}

/// Where usage goes and who enforces shared limits.
pub struct Usage {
    /// Shared limits across replicas (with Redis); `None`: limits per process.
    pub limiter: Option<Limiter>,
    /// Where usage events go.
    pub sink: UsageSink,
    /// The local writer, when usage is written to the ledger directly (flushed at the end).
    pub ingest: Option<Arc<LocalIngest>>,
}

impl Usage {
    /// With Redis: shared limits (under `namespace`, as the journal and the peers' keys are)
    /// and the usage stream `stream` to billing (the ledger is the fallback). Without:
    /// per-process limits and the local writer on `database_url`, at background priority on a
    /// thread of its own, so serving goes first.
    pub async fn connect(
        ledger: &Ledger,
        database_url: &str,
        redis_url: Option<&str>,
        namespace: &Namespace,
        stream: &str,
    ) -> Result<Usage, StartError> {
        let redis = |what| move |source| StartError::Redis { what, source };
        match redis_url {
            Some(url) => {
                let client = RedisTarget::open(url).map_err(redis("--redis-url"))?;
                let conn = client.connect().await.map_err(redis("connecting to --redis-url"))?;
                let limiter =
                    Limiter::new(conn.clone(), namespace.as_str(), Duration::from_secs(600));
                let sink = UsageSink::Redis {
                    conn,
                    stream: stream.to_owned(),
                    fallback: ledger.clone(),
                    retrying: Default::default(),
                };
                Ok(Usage { limiter: Some(limiter), sink, ingest: None })
            }
            None => Usage::local(database_url).await,
        }
    }

    /// Per-process limits and the local writer on `database_url` (`sluice up`).
    pub async fn local(database_url: &str) -> Result<Usage, StartError> {
        let ingest = LocalIngest::start_background(database_url, LocalIngestConfig::default())
            .await
            .map_err(|source| StartError::Billing { what: "starting the usage writer", source })?;
        let ingest = Arc::new(ingest);
        Ok(Usage { limiter: None, sink: UsageSink::Local(ingest.clone()), ingest: Some(ingest) })
    }
}

/// Serves the gateway's `/metrics` on `listen` (on the I/O runtime); returns the bound address.
pub fn serve_metrics(
    io: &IoRuntime,
    listen: &str,
    gateway: &Gateway,
) -> Result<SocketAddr, StartError> {
    let metrics = gateway.metrics();
    let app = axum::Router::new().route(
        "/metrics",
        axum::routing::get(move || {
            let m = Arc::clone(&metrics);
            async move { ([("content-type", "text/plain; version=0.0.4")], m.encode()) }
        }),
    );
    io.handle.block_on(async {
        let what = format!("binding --metrics-listen {listen}");
        let listener =
            tokio::net::TcpListener::bind(listen).await.map_err(io_error(what.clone()))?;
        let addr = listener.local_addr().map_err(io_error(what))?;
        tokio::spawn(async move {
            let _ = axum::serve(listener, app).await;
        });
        Ok(addr)
    })
}

/// Runs pingora with the front door on `listen` (TLS with `tls`'s certificate and key) until
/// `shutdown` fires.
pub fn run_proxy_until(
    gateway: Gateway,
    listen: &str,
    tls: Option<(&Path, &Path)>,
    shutdown: Box<dyn ShutdownSignalWatch>,
) -> Result<(), StartError> {
    let mut server = pingora::server::Server::new_with_opt_and_conf(None, server_conf());
    server.bootstrap();
    let mut service = crate::door::service(&server.configuration, gateway);
    match tls {
        Some((cert, key)) => {
            fn text(p: &Path) -> Result<&str, StartError> {
                p.to_str()
                    .ok_or_else(|| StartError::Config(format!("{} is not UTF-8", p.display())))
            }
            service
                .add_tls(listen, text(cert)?, text(key)?)
                .map_err(|e| StartError::Config(format!("configuring TLS: {e}")))?;
        }
        None => service.add_tcp(listen),
    }
    server.add_service(service);
    server.run(pingora::server::RunArgs { shutdown_signal: shutdown });
    Ok(())
}

/// Runs pingora until SIGINT/SIGTERM, then drains: running requests have `drain` to finish,
/// what is left is cancelled with the tokens it has, and each gets its ledger row.
pub fn run_proxy(
    gateway: Gateway,
    listen: &str,
    tls: Option<(&Path, &Path)>,
    drain: Duration,
    internal_token: Option<String>,
) -> Result<(), StartError> {
    let watch = DrainOnSignal::new(gateway.drain(), drain, internal_token);
    run_proxy_until(gateway, listen, tls, Box::new(watch))
}

/// How long, after the proxy stopped, events still retried in the background may take.
const FLUSH_TIMEOUT: Duration = Duration::from_secs(30);

/// After the proxy stopped: everything billed so far reaches the ledger (events the usage
/// stream and the ledger both refused get [`FLUSH_TIMEOUT`] more), the journal makes its last
/// removals and stops beating (another gateway recovers what is left), then it closes. An event
/// still undelivered then is logged whole at error level (ids, counts and hashes: no prompt
/// text), for an operator to replay; the exit status says so.
pub fn finish(
    io: &IoRuntime,
    ingest: Option<&LocalIngest>,
    sink: &UsageSink,
    journal: Option<&Journal>,
    ledger: &Ledger,
) -> Result<(), StartError> {
    io.handle.block_on(async {
        if let Some(ingest) = ingest {
            ingest.flush().await;
        }
        let lost = sink.flush(FLUSH_TIMEOUT).await;
        if let Some(journal) = journal {
            journal.close().await;
        }
        for event in &lost {
            let json = serde_json::to_string(event).unwrap_or_default();
            tracing::error!(request_id = %event.request_id, event = %json, "usage event undelivered at exit");
            eprintln!("usage event undelivered at exit: {json}");
        }
        ledger.close().await;
        if lost.is_empty() {
            Ok(())
        } else {
            Err(StartError::Undelivered(lost.len()))
        }
    })
}
