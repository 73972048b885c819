//! Prometheus metrics, named after vLLM's with a `sluice_engine_` prefix, and per-tenant
//! ones (`sluice_engine_tenant_*`) under tenant and adapter labels of bounded cardinality
//! ([`TenantLabels`]).

use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant};

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

use crate::serve::scheduler::{WaitReason, WaitTimes};

/// Label of the finished-requests counter.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct FinishLabel {
    /// `stop`, `length`, `abort` or `error`.
    pub finished_reason: String,
}

/// Label of the per-tenant metrics.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantLabel {
    /// A tenant id, `~other` (beyond the busiest [`TENANT_LABELS`]) or `~none` (no tenant);
    /// `~` is not allowed in tenant ids, so neither can be taken by a tenant.
    pub tenant: String,
    /// The tenant adapter the requests ran under (`tenant/name`), `~base` (none) or `~other`
    /// (beyond the busiest [`ADAPTER_LABELS`]).
    pub adapter: String,
}

/// Label of the per-tenant wait metric: the tenant's label and why its requests waited.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TenantWaitLabel {
    /// As [`TenantLabel::tenant`].
    pub tenant: String,
    /// As [`TenantLabel::adapter`].
    pub adapter: String,
    /// [`WaitReason::as_str`].
    pub reason: &'static str,
}

/// Label of the step-time counter: where a step's time went.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct PhaseLabel {
    /// [`StepPhase::as_str`].
    pub phase: &'static str,
}

/// The parts of an engine step, in the order they run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepPhase {
    /// Planning the batch and gathering its inputs.
    Schedule,
    /// The forward pass's attention over the KV cache (CPU).
    Attention,
    /// The forward pass's layer matrix products (CPU).
    Matmul,
    /// The final norm and LM head over the rows that sample (CPU).
    LmHead,
    /// The rest of a CPU pass (embedding, norms, RoPE, cache writes, the backend's argmax
    /// picks); a GPU's whole pass.
    ForwardOther,
    /// Sampling, detokenizing, stop checks and handing tokens to the streams.
    Emit,
}

impl StepPhase {
    /// Every phase, in order.
    pub const ALL: [StepPhase; 6] = [
        StepPhase::Schedule,
        StepPhase::Attention,
        StepPhase::Matmul,
        StepPhase::LmHead,
        StepPhase::ForwardOther,
        StepPhase::Emit,
    ];

    /// Its label value.
    pub fn as_str(self) -> &'static str {
        match self {
            StepPhase::Schedule => "schedule",
            StepPhase::Attention => "attention",
            StepPhase::Matmul => "matmul",
            StepPhase::LmHead => "lm_head",
            StepPhase::ForwardOther => "forward_other",
            StepPhase::Emit => "emit",
        }
    }
}

/// Tenants named in the per-tenant metrics; the rest are `other`.
pub const TENANT_LABELS: usize = 20;

/// Adapters named in the per-tenant metrics; the rest are `~other`.
pub const ADAPTER_LABELS: usize = 20;

/// How often the named tenants and adapters are chosen anew, by their requests in the last
/// window.
const TENANT_WINDOW: Duration = Duration::from_secs(60);

/// Up to `capacity` names, chosen at the end of each window as the busiest of that window
/// (by finished requests); in between, a name new to the metrics is kept while there is room.
#[derive(Debug)]
struct Busiest {
    capacity: usize,
    named: HashSet<String>,
    counts: HashMap<String, u64>,
}

impl Busiest {
    fn new(capacity: usize) -> Busiest {
        Busiest { capacity, named: HashSet::new(), counts: HashMap::new() }
    }

    /// Names the last window's busiest and starts a new one.
    fn turn(&mut self) {
        let mut ranked: Vec<(&String, &u64)> = self.counts.iter().collect();
        ranked.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
        self.named = ranked.into_iter().take(self.capacity).map(|(t, _)| t.clone()).collect();
        self.counts.clear();
    }

    /// `name`'s label, counting it.
    fn label(&mut self, name: &str) -> String {
        *self.counts.entry(name.to_owned()).or_insert(0) += 1;
        if !self.named.contains(name) && self.named.len() < self.capacity {
            self.named.insert(name.to_owned());
        }
        if self.named.contains(name) { name.to_owned() } else { "~other".to_owned() }
    }

    /// Whether `label` is still one this names (the `~` labels always are).
    fn keeps(&self, label: &str) -> bool {
        label.starts_with('~') || self.named.contains(label)
    }
}

/// Which tenants and adapters the per-tenant metrics name: up to `capacity` tenants and
/// `adapters` adapters, each chosen at the end of each window as the busiest of that window;
/// in between, one new to the metrics gets a name while there is room. Every other tenant
/// and adapter is `~other`, so the number of series stays bounded (at most `(capacity + 2) x
/// (adapters + 2)` label pairs) whatever tenants send.
#[derive(Debug)]
pub struct TenantLabels {
    window: Duration,
    tenants: Busiest,
    adapters: Busiest,
    /// The label pairs with series, so a new window can end those it no longer names.
    live: HashSet<TenantLabel>,
    since: Instant,
}

impl TenantLabels {
    /// Labels for up to `capacity` tenants and `adapters` adapters, chosen anew every
    /// `window`.
    pub fn new(capacity: usize, adapters: usize, window: Duration, now: Instant) -> Self {
        TenantLabels {
            window,
            tenants: Busiest::new(capacity),
            adapters: Busiest::new(adapters),
            live: HashSet::new(),
            since: now,
        }
    }

    /// The label of a request of `tenant` (empty: none) under `adapter` (`tenant/name`;
    /// `None`: the bare base) finishing at `now`, and the labels whose series end because a
    /// new window named others.
    pub fn label(
        &mut self,
        tenant: &str,
        adapter: Option<&str>,
        now: Instant,
    ) -> (TenantLabel, Vec<TenantLabel>) {
        let mut dropped = Vec::new();
        if now.duration_since(self.since) >= self.window {
            self.tenants.turn();
            self.adapters.turn();
            let (tenants, adapters) = (&self.tenants, &self.adapters);
            dropped = self
                .live
                .iter()
                .filter(|l| !(tenants.keeps(&l.tenant) && adapters.keeps(&l.adapter)))
                .cloned()
                .collect();
            dropped.sort_by(|a: &TenantLabel, b| {
                (&a.tenant, &a.adapter).cmp(&(&b.tenant, &b.adapter))
            });
            for l in &dropped {
                self.live.remove(l);
            }
            self.since = now;
        }
        let tenant =
            if tenant.is_empty() { "~none".to_owned() } else { self.tenants.label(tenant) };
        let adapter = match adapter {
            None => "~base".to_owned(),
            Some(a) => self.adapters.label(a),
        };
        let label = TenantLabel { tenant, adapter };
        self.live.insert(label.clone());
        (label, dropped)
    }
}

impl Default for TenantLabels {
    fn default() -> Self {
        TenantLabels::new(TENANT_LABELS, ADAPTER_LABELS, TENANT_WINDOW, Instant::now())
    }
}

/// A per-tenant histogram family.
type TenantHistograms = Family<TenantLabel, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(latency_buckets())
}

/// What a finished request adds to its tenant's metrics.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TenantSample {
    /// Arrival to first scheduled, seconds (`None`: never scheduled).
    pub queue: Option<f64>,
    /// Arrival to first token, seconds.
    pub ttft: Option<f64>,
    /// Mean time per output token after the first, seconds.
    pub tpot: Option<f64>,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub generation_tokens: u64,
    /// Times it was preempted.
    pub preemptions: u64,
    /// Seconds it waited, by reason.
    pub waited: WaitTimes,
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
    /// Tokens still to prefill, over every request held
    /// ([`crate::serve::scheduler::Scheduler::pending_prompt_tokens`]).
    pub pending_prompt_tokens: Gauge,
    /// 1 while requests wait because the running batch is as large as it may grow (its TPOT
    /// limit, `max_num_seqs` or the KV cache): the engine is at capacity, not between steps.
    pub batch_full: Gauge,
    /// Fraction of KV blocks in use.
    pub kv_usage: Gauge<f64, AtomicU64>,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_queries: Counter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_hits: Counter,
    /// Preemptions.
    pub preemptions: Counter,
    /// Of those, the ones that made room for a tenant below its share of a full batch.
    pub fairness_preemptions: Counter,
    /// Passes stopped between layers for a higher-priority arrival.
    pub interrupted_steps: Counter,
    /// Prompt tokens of finished requests.
    pub prompt_tokens: Counter,
    /// Generated tokens.
    pub generation_tokens: Counter,
    /// Finished requests by reason.
    pub finished: Family<FinishLabel, Counter>,
    /// Per tenant: arrival to first scheduled.
    pub tenant_queue: TenantHistograms,
    /// Per tenant: arrival to first token.
    pub tenant_ttft: TenantHistograms,
    /// Per tenant: mean time per output token of each request.
    pub tenant_tpot: TenantHistograms,
    /// Per tenant: prompt tokens of finished requests.
    pub tenant_prompt_tokens: Family<TenantLabel, Counter>,
    /// Per tenant: generated tokens of finished requests.
    pub tenant_generation_tokens: Family<TenantLabel, Counter>,
    /// Per tenant: preemptions of finished requests.
    pub tenant_preemptions: Family<TenantLabel, Counter>,
    /// Per tenant and reason: seconds finished requests waited.
    pub tenant_wait: Family<TenantWaitLabel, Counter<f64, AtomicU64>>,
    /// Seconds of the engine's steps, by phase.
    pub step_seconds: Family<PhaseLabel, Counter<f64, AtomicU64>>,
    /// Steps whose pass ran whole.
    pub steps: Counter,
    /// Seconds the device ran the passes (GPU: by events on its stream; CPU: host clock).
    pub device_busy: Counter<f64, AtomicU64>,
    /// Seconds the device sat idle between one pass and the next while there was work (the
    /// host scheduling, sampling, streaming and launching in between).
    pub device_gap: Counter<f64, AtomicU64>,
    /// Gaps counted in `device_gap`.
    pub device_gaps: Counter,
    /// Passes counted in `device_busy`.
    pub device_passes: Counter,
}

fn latency_buckets() -> impl Iterator<Item = f64> {
    [
        0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
        7.5, 10.0, 20.0, 40.0, 80.0,
    ]
    .into_iter()
}

impl EngineMetrics {
    /// Adds `seconds` to `phase` of the step-time counter.
    pub fn add_step_time(&self, phase: StepPhase, seconds: f64) {
        self.step_seconds.get_or_create(&PhaseLabel { phase: phase.as_str() }).inc_by(seconds);
    }

    /// Seconds of every step phase so far, in [`StepPhase::ALL`]'s order.
    pub fn step_times(&self) -> [f64; 6] {
        StepPhase::ALL
            .map(|p| self.step_seconds.get_or_create(&PhaseLabel { phase: p.as_str() }).get())
    }

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
            pending_prompt_tokens: Gauge::default(),
            batch_full: Gauge::default(),
            kv_usage: Gauge::default(),
            prefix_queries: Counter::default(),
            prefix_hits: Counter::default(),
            preemptions: Counter::default(),
            fairness_preemptions: Counter::default(),
            interrupted_steps: Counter::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            finished: Family::default(),
            tenant_queue: Family::new_with_constructor(latency_histogram),
            tenant_ttft: Family::new_with_constructor(latency_histogram),
            tenant_tpot: Family::new_with_constructor(latency_histogram),
            tenant_prompt_tokens: Family::default(),
            tenant_generation_tokens: Family::default(),
            tenant_preemptions: Family::default(),
            tenant_wait: Family::default(),
            step_seconds: Family::default(),
            steps: Counter::default(),
            device_busy: Counter::default(),
            device_gap: Counter::default(),
            device_gaps: Counter::default(),
            device_passes: Counter::default(),
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
            "num_pending_prompt_tokens",
            "Tokens still to prefill over the requests held (before prefix-cache hits)",
            m.pending_prompt_tokens.clone(),
        );
        r.register(
            "batch_full",
            "1 while requests wait because the running batch is as large as it may grow",
            m.batch_full.clone(),
        );
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
        r.register(
            "num_fairness_preemptions",
            "Of the preemptions, those that made room in a full batch for a tenant below its share",
            m.fairness_preemptions.clone(),
        );
        r.register(
            "num_interrupted_steps",
            "Passes stopped between layers for a higher-priority arrival and planned again",
            m.interrupted_steps.clone(),
        );
        r.register(
            "step_seconds",
            "Seconds of the engine's steps by phase: schedule, the pass's attention, matmul, \
             lm_head and forward_other, then emit (sampling, detokenizing, stop checks, streams)",
            m.step_seconds.clone(),
        );
        r.register("steps", "Engine steps whose forward pass ran whole", m.steps.clone());
        r.register(
            "device_busy_seconds",
            "Seconds the device ran forward passes (a GPU's by events on its stream)",
            m.device_busy.clone(),
        );
        r.register(
            "device_gap_seconds",
            "Seconds the device sat idle between consecutive passes while work was waiting",
            m.device_gap.clone(),
        );
        r.register("device_gaps", "Gaps counted in device_gap_seconds", m.device_gaps.clone());
        r.register(
            "device_passes",
            "Passes counted in device_busy_seconds",
            m.device_passes.clone(),
        );
        r.register("prompt_tokens", "Prompt tokens of finished requests", m.prompt_tokens.clone());
        r.register("generation_tokens", "Generated tokens", m.generation_tokens.clone());
        r.register("request_success", "Finished requests by finish reason", m.finished.clone());
        r.register(
            "tenant_request_queue_time_seconds",
            "Arrival to first scheduled, by tenant",
            m.tenant_queue.clone(),
        );
        r.register(
            "tenant_time_to_first_token_seconds",
            "Arrival to first token, by tenant",
            m.tenant_ttft.clone(),
        );
        r.register(
            "tenant_time_per_output_token_seconds",
            "Mean time per output token after the first, per request, by tenant",
            m.tenant_tpot.clone(),
        );
        r.register(
            "tenant_prompt_tokens",
            "Prompt tokens of finished requests, by tenant",
            m.tenant_prompt_tokens.clone(),
        );
        r.register(
            "tenant_generation_tokens",
            "Generated tokens of finished requests, by tenant",
            m.tenant_generation_tokens.clone(),
        );
        r.register(
            "tenant_preemptions",
            "Preemptions of finished requests, by tenant",
            m.tenant_preemptions.clone(),
        );
        r.register(
            "tenant_queue_wait_seconds",
            "Seconds finished requests waited, by tenant and reason: arrival (until the next \
             step was planned), else the reason admission stopped in the steps they waited \
             through",
            m.tenant_wait.clone(),
        );
        EngineMetrics { registry, ..m }
    }

    /// Adds a finished request to its tenant's series; ends the series of `dropped` tenants.
    pub fn record_tenant(
        &self,
        label: &TenantLabel,
        sample: &TenantSample,
        dropped: &[TenantLabel],
    ) {
        for gone in dropped {
            self.tenant_queue.remove(gone);
            self.tenant_ttft.remove(gone);
            self.tenant_tpot.remove(gone);
            self.tenant_prompt_tokens.remove(gone);
            self.tenant_generation_tokens.remove(gone);
            self.tenant_preemptions.remove(gone);
            for reason in WaitReason::ALL {
                self.tenant_wait.remove(&TenantWaitLabel {
                    tenant: gone.tenant.clone(),
                    adapter: gone.adapter.clone(),
                    reason: reason.as_str(),
                });
            }
        }
        if let Some(q) = sample.queue {
            self.tenant_queue.get_or_create(label).observe(q);
        }
        if let Some(t) = sample.ttft {
            self.tenant_ttft.get_or_create(label).observe(t);
        }
        if let Some(t) = sample.tpot {
            self.tenant_tpot.get_or_create(label).observe(t);
        }
        self.tenant_prompt_tokens.get_or_create(label).inc_by(sample.prompt_tokens);
        self.tenant_generation_tokens.get_or_create(label).inc_by(sample.generation_tokens);
        self.tenant_preemptions.get_or_create(label).inc_by(sample.preemptions);
        for (reason, seconds) in sample.waited.iter() {
            let key = TenantWaitLabel {
                tenant: label.tenant.clone(),
                adapter: label.adapter.clone(),
                reason: reason.as_str(),
            };
            self.tenant_wait.get_or_create(&key).inc_by(seconds);
        }
    }

    /// The load an engine reports to gateways, from the gauges the last step set.
    pub fn load(&self) -> sluice_wire::EngineLoad {
        let count = |g: &Gauge| u64::try_from(g.get()).unwrap_or(0);
        sluice_wire::EngineLoad {
            running: count(&self.running),
            waiting: count(&self.waiting),
            batch_full: self.batch_full.get() > 0,
            pending_prompt_tokens: count(&self.pending_prompt_tokens),
            kv_usage: self.kv_usage.get(),
        }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenant_labels_stay_bounded_and_follow_the_busiest() {
        let t0 = Instant::now();
        let mut l = TenantLabels::new(2, 2, Duration::from_secs(60), t0);
        let name = |l: &mut TenantLabels, t: &str, at: u64| {
            l.label(t, None, t0 + Duration::from_secs(at)).0.tenant
        };
        assert_eq!(name(&mut l, "a", 0), "a");
        assert_eq!(name(&mut l, "b", 1), "b");
        assert_eq!(name(&mut l, "c", 2), "~other", "no room for a third name");
        assert_eq!(name(&mut l, "", 3), "~none");
        for _ in 0..5 {
            name(&mut l, "c", 10);
        }
        // The next window names the busiest of the last one: c (6) and a (1, before b by
        // name at equal counts); b's series end.
        let (label, dropped) = l.label("b", None, t0 + Duration::from_secs(61));
        let b = TenantLabel { tenant: "b".into(), adapter: "~base".into() };
        assert_eq!((label.tenant.as_str(), dropped), ("~other", vec![b]));
        assert_eq!(name(&mut l, "c", 62), "c");
    }

    /// Adapters get names as tenants do, `~base` without one; a flood of distinct adapters
    /// stays within the bound, and a window that names others ends the old pairs' series.
    #[test]
    fn adapter_labels_stay_bounded_too() {
        let t0 = Instant::now();
        let mut l = TenantLabels::new(2, 2, Duration::from_secs(60), t0);
        let at = |s: u64| t0 + Duration::from_secs(s);
        let pair = |l: TenantLabel| (l.tenant, l.adapter);
        assert_eq!(pair(l.label("acme", None, at(0)).0), ("acme".into(), "~base".into()));
        assert_eq!(
            pair(l.label("acme", Some("acme/support"), at(1)).0),
            ("acme".into(), "acme/support".into())
        );
        let mut seen = HashSet::new();
        for i in 0..100 {
            let (label, _) = l.label("acme", Some(&format!("acme/flood-{i}")), at(2));
            seen.insert(label.adapter);
        }
        // acme/support and the first of the flood have names, everything after is ~other.
        assert_eq!(seen.len(), 2, "{seen:?}");
        assert!(seen.contains("~other") && seen.contains("acme/flood-0"), "{seen:?}");
        for _ in 0..3 {
            l.label("acme", Some("acme/busy"), at(3));
        }
        let (label, dropped) = l.label("acme", Some("acme/support"), at(70));
        // The last window's busiest: acme/busy (3), then acme/flood-0... by count: support 1,
        // flood-* 1 each; ties go by name, so acme/flood-0 comes before acme/support.
        assert_eq!(label.adapter, "~other");
        let dropped: Vec<String> = dropped.into_iter().map(|d| d.adapter).collect();
        assert_eq!(dropped, vec!["acme/support".to_string()]);
    }

    #[test]
    fn a_finished_request_lands_in_its_tenants_series_and_dropped_ones_vanish() {
        let m = EngineMetrics::new();
        let mut sample = TenantSample {
            queue: Some(0.2),
            ttft: Some(0.3),
            tpot: Some(0.02),
            prompt_tokens: 12,
            generation_tokens: 5,
            preemptions: 1,
            waited: WaitTimes::default(),
        };
        sample.waited.add(WaitReason::Arrival, 0.05);
        sample.waited.add(WaitReason::TpotLimit, 0.15);
        let acme = TenantLabel { tenant: "acme".into(), adapter: "acme/support".into() };
        m.record_tenant(&acme, &sample, &[]);
        let text = m.encode();
        for (reason, seconds) in [("arrival", "0.05"), ("tpot_limit", "0.15")] {
            let line = format!(
                "sluice_engine_tenant_queue_wait_seconds_total{{tenant=\"acme\",adapter=\"acme/support\",reason=\"{reason}\"}} {seconds}"
            );
            assert!(text.contains(&line), "{line} in {text}");
        }
        assert!(!text.contains("reason=\"kv_cache\""), "reasons never waited for have no series");
        assert!(
            text.contains(
                "sluice_engine_tenant_prompt_tokens_total{tenant=\"acme\",adapter=\"acme/support\"} 12"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "sluice_engine_tenant_time_to_first_token_seconds_count{tenant=\"acme\",adapter=\"acme/support\"} 1"
            )
        );
        let other = TenantLabel { tenant: "~other".into(), adapter: "~base".into() };
        m.record_tenant(&other, &sample, &[acme]);
        assert!(!m.encode().contains("tenant=\"acme\""));
    }
}
