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

/// Whether an event may be logged: below `info`, only our own crates' events (`sluice`,
/// `sluice_engine`, ...), whatever `RUST_LOG` enables. Other crates' debug and trace events
/// print request and response headers and bodies (API keys, the internal token, prompt and
/// completion text: `tokenizers` logs a prompt one character a line), and a new dependency's
/// are unknown, so they are denied by default rather than listed.
fn safe(meta: &tracing::Metadata<'_>) -> bool {
    *meta.level() <= tracing::Level::INFO || own(meta.target())
}

/// Whether a target is one of our crates or a module of one.
fn own(target: &str) -> bool {
    let krate = target.split("::").next().unwrap_or_default();
    krate == "sluice" || krate.strip_prefix("sluice_").is_some_and(|rest| !rest.is_empty())
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

#[cfg(test)]
mod tests {
    use super::own;

    #[test]
    fn only_our_own_crates_log_below_info() {
        for ours in ["sluice", "sluice::up", "sluice_engine::serve::core", "sluice_gateway"] {
            assert!(own(ours), "{ours}");
        }
        for theirs in [
            "tokenizers::tokenizer",
            "pingora_proxy",
            "hyper_util::client",
            "h2",
            "sluicer",
            "sluice_",
            "log",
        ] {
            assert!(!own(theirs), "{theirs}");
        }
    }
}
