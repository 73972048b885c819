//! Prometheus metrics, named after vLLM's with a `sluice_engine_` prefix.

use std::sync::atomic::AtomicU64;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

/// Label of the finished-requests counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    /// `stop`, `length`, `abort` or `error`.
    pub finished_reason: String,
}

/// All engine metrics.
#[derive(Debug)]
pub struct EngineMetrics {
    registry: Registry,
    /// Arrival to first token.
    pub ttft: Histogram,
    /// Gap between consecutive tokens of a request.
    pub itl: Histogram,
    /// Arrival to finish.
    pub e2e: Histogram,
    /// Arrival to first scheduled.
    pub queue: Histogram,
    /// First scheduled to first token.
    pub prefill: Histogram,
    /// First token to last token.
    pub decode: Histogram,
    /// Requests being computed.
    pub running: Gauge,
    /// Requests waiting to be scheduled.
    pub waiting: Gauge,
    /// Fraction of KV blocks in use.
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: Counter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: Counter,
    /// Preemptions.
    pub preemptions: Counter,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: Counter,
    /// Generated tokens.
    pub generation_tokens: Counter,
    /// Finished requests by reason.
    pub finished: Family<FinishLabel, Counter>,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ]
    .into_iter()
}

impl EngineMetrics {
    /// Creates and registers every metric.
    pub fn new() -> EngineMetrics {
        let mut registry = Registry::with_prefix("sluice_engine");
        let h = || Histogram::new(latency_buckets());
        let m = EngineMetrics {
            ttft: h(),
            itl: h(),
            e2e: h(),
            queue: h(),
            prefill: h(),
            decode: h(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Family::default(),
            registry: Registry::default(),
        };
        let r = &mut registry;
        r.register(
            "time_to_first_token_seconds",
            "Arrival at the engine to first token",
            m.ttft.clone(),
        );
        r.register(
            "inter_token_latency_seconds",
            "Gap between consecutive output tokens",
            m.itl.clone(),
        );
        r.register(
            "e2e_request_latency_seconds",
            "Arrival at the engine to the last token",
            m.e2e.clone(),
        );
        r.register("request_queue_time_seconds", "Arrival to first scheduled", m.queue.clone());
        r.register(
            "request_prefill_time_seconds",
            "First scheduled to first token",
            m.prefill.clone(),
        );
        r.register("request_decode_time_seconds", "First token to last token", m.decode.clone());
        r.register("num_requests_running", "Requests in the running batch", m.running.clone());
        r.register("num_requests_waiting", "Requests waiting to be scheduled", m.waiting.clone());
        r.register(
            "kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0-1)",
            m.kv_usage.clone(),
        );
        r.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_queries.clone(),
        );
        r.register(
            "prefix_cache_hits",
            "Prompt tokens served from the prefix cache",
            m.prefix_hits.clone(),
        );
        r.register(
            "num_preemptions",
            "Requests preempted (recomputed later)",
            m.preemptions.clone(),
        );
        r.register("prompt_tokens", "Prompt tokens of finished requests", m.prompt_tokens.clone());
        r.register("generation_tokens", "Generated tokens", m.generation_tokens.clone());
        r.register("request_success", "Finished requests by finish reason", m.finished.clone());
        EngineMetrics { registry, ..m }
    }

    /// The text exposition format.
    pub fn encode(&self) -> String {
        let mut s = String::new();
        if prometheus_client::encoding::text::encode(&mut s, &self.registry).is_err() {
            s.clear();
        }
        s
    }
}

impl Default for EngineMetrics {
    fn default() -> Self {
        Self::new()
    }
}
