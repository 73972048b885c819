//! The gateway's Prometheus metrics, `sluice_gateway_` prefixed: requests by status and tenant
//! tier, admission refusals by reason, the client-side TTFT/TPOT/ITL/E2E the gateway observed,
//! and the gateway's own added time.

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Labels of the request counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RequestLabels {
    /// HTTP status class and code, e.g. `200`, `429`.
    pub status: String,
    /// The tenant's tier (`none` before authentication).
    pub tier: String,
}

/// Labels of the refusal counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct RefusalLabels {
    /// Why admission refused.
    pub reason: String,
}

/// All gateway metrics.
#[derive(Debug)]
pub struct GatewayMetrics {
    registry: Registry,
    /// Requests by status and tier.
    pub requests: Family<RequestLabels, Counter>,
    /// Refusals by reason.
    pub refusals: Family<RefusalLabels, Counter>,
    /// Arrival to the first token-carrying event written to the client.
    pub ttft: Histogram,
    /// Time per output token after the first.
    pub tpot: Histogram,
    /// Gaps between token-carrying events.
    pub itl: Histogram,
    /// Arrival to the end of the response.
    pub e2e: Histogram,
    /// The gateway's own time before the request goes upstream.
    pub overhead: Histogram,
    /// Idempotent retries answered with the stored response.
    pub idempotent_replays: Counter,
    /// Writing a request's journal entry before it goes upstream (part of `overhead`).
    pub journal_write: Histogram,
    /// Requests of dead gateways billed from their journals by this one.
    pub journal_recovered: Counter,
}

fn seconds() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ]
    .into_iter()
}

impl Default for GatewayMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("sluice_gateway");
        let requests = Family::<RequestLabels, Counter>::default();
        let refusals = Family::<RefusalLabels, Counter>::default();
        let ttft = Histogram::new(seconds());
        let tpot = Histogram::new(seconds());
        let itl = Histogram::new(seconds());
        let e2e = Histogram::new(seconds());
        // The overhead is microseconds to a few milliseconds.
        let fine = [0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.002, 0.005, 0.01, 0.05];
        let overhead = Histogram::new(fine);
        let journal_write = Histogram::new(fine);
        let journal_recovered = Counter::default();
        registry.register(
            "journal_write_seconds",
            "Writing a request's journal entry to Redis before it goes upstream",
            journal_write.clone(),
        );
        registry.register(
            "journal_recovered",
            "Requests of dead gateways billed from their journals",
            journal_recovered.clone(),
        );
        registry.register("requests", "Requests by HTTP status and tenant tier", requests.clone());
        registry.register("admission_refusals", "Admission refusals by reason", refusals.clone());
        let idempotent_replays = Counter::default();
        registry.register(
            "idempotent_replays",
            "Idempotent retries answered with the stored response",
            idempotent_replays.clone(),
        );
        registry.register(
            "time_to_first_token_seconds",
            "Client-side time to first token",
            ttft.clone(),
        );
        registry.register(
            "time_per_output_token_seconds",
            "Client-side time per output token",
            tpot.clone(),
        );
        registry.register(
            "inter_token_latency_seconds",
            "Gaps between token-carrying events",
            itl.clone(),
        );
        registry.register(
            "e2e_request_latency_seconds",
            "Arrival to the end of the response",
            e2e.clone(),
        );
        registry.register(
            "overhead_seconds",
            "The gateway's own time before going upstream",
            overhead.clone(),
        );
        Self {
            registry,
            requests,
            refusals,
            ttft,
            tpot,
            itl,
            e2e,
            overhead,
            idempotent_replays,
            journal_write,
            journal_recovered,
        }
    }
}

impl GatewayMetrics {
    /// The text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if prometheus_client::encoding::text::encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}
