//! Logs and traces. `tracing` events go to stderr (filter with `RUST_LOG`, default `warn`);
//! when `OTEL_EXPORTER_OTLP_ENDPOINT` is set, spans are also exported over OTLP/HTTP (JSON)
//! to `$OTEL_EXPORTER_OTLP_ENDPOINT/v1/traces`, and W3C trace context is propagated from the
//! gateway to the engine, so one trace covers both.

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

/// Flushes and stops the exporter when dropped.
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(p) = self.provider.take()
            && let Err(e) = p.shutdown()
        {
            eprintln!("trace export shutdown: {e}");
        }
    }
}

/// Crates whose debug and trace events print request or response headers and bodies (API
/// keys, the internal token, prompt and completion text): held at `info` whatever `RUST_LOG`
/// asks, so no log level prints a secret or a prompt.
const REVEALING: [&str; 9] = [
    "pingora",
    "pingora_core",
    "pingora_proxy",
    "pingora_http",
    "hyper",
    "hyper_util",
    "h2",
    "reqwest",
    "rustls",
];

/// Whether an event may be logged: nothing below `info` from a revealing crate (or any of its
/// modules), whatever `RUST_LOG` enables.
fn safe(meta: &tracing::Metadata<'_>) -> bool {
    let target = meta.target();
    let revealing = REVEALING.iter().any(|c| {
        target.strip_prefix(c).is_some_and(|rest| rest.is_empty() || rest.starts_with("::"))
    });
    !revealing || *meta.level() <= tracing::Level::INFO
}

fn log_filter() -> impl tracing_subscriber::layer::Filter<tracing_subscriber::Registry> {
    use tracing_subscriber::filter::FilterExt;
    let env = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    env.and(tracing_subscriber::filter::filter_fn(safe))
}

/// Installs the subscriber for a process named `service` (`sluice-gateway`, `sluice-engine`).
pub fn init(service: &str) -> anyhow::Result<Telemetry> {
    let filter = log_filter;
    let fmt = tracing_subscriber::fmt::layer().with_writer(std::io::stderr).with_filter(filter());
    let endpoint = std::env::var("OTEL_EXPORTER_OTLP_ENDPOINT").ok().filter(|e| !e.is_empty());
    let Some(endpoint) = endpoint else {
        let _ = tracing_subscriber::registry().with(fmt).try_init();
        return Ok(Telemetry { provider: None });
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(Protocol::HttpJson)
        .with_endpoint(format!("{}/v1/traces", endpoint.trim_end_matches('/')))
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service.to_owned()).build())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("sluice"))
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    let _ = tracing_subscriber::registry().with(fmt).with(otel).try_init();
    Ok(Telemetry { provider: Some(provider) })
}
