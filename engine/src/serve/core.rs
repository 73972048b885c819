//! The engine core: scheduler + forward pass + sampling + stop handling, one step at a time.
//! Synchronous; owned by one thread (see `handle`).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use tokio::sync::mpsc::UnboundedSender;

use crate::backend::{Backend, Device, KvSize, PendingPass, Pick, StepOutput};
use crate::error::{EngineError, Result};
use crate::forward::{ForwardProfile, KvDtype, LogitsWanted, SeqInput};
use crate::generate::IncrementalDecoder;
use crate::interrupt::Interrupt;
use crate::loader::LoadedModel;
use crate::lora::LoraAdapter;
use crate::sampler::{Sampler, log_softmax, top_n};
use crate::serve::block_pool::CacheKey;
use crate::serve::fair::{FairConfig, Vtc};
use crate::serve::kv_manager::KvManager;
use crate::serve::metrics::{EngineMetrics, FinishLabel, StepPhase, TenantLabels, TenantSample};
use crate::serve::outcomes::OutcomeLog;
use crate::serve::scheduler::{
    Fcfs, Scheduler, SchedulerConfig, SeqPolicy, StepContext, StepPlan, WaitReason, WaitTimes,
    WaitingPolicy,
};
use crate::serve::step_model::StepShape;
use crate::serve::stop::{StopOutcome, StopText};
use crate::serve::{
    EngineEvent, EngineTimings, FinishReason, PromptLogprob, TokenOutput, Usage, ValidRequest,
};
use crate::structured::{Matcher, sample_constrained};

/// Engine limits and sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// Tokens per KV block.
    pub block_size: usize,
    /// Memory for the KV cache, in bytes (blocks are preallocated from it).
    pub kv_cache_bytes: usize,
    /// What a CPU KV cache stores (a GPU's is bf16).
    pub kv_cache_dtype: KvDtype,
    /// On a GPU: the share of the device's memory the engine may take in all (weights, pass
    /// buffers and the KV cache, which gets what the others leave; vLLM's
    /// `gpu_memory_utilization`). When set, `kv_cache_bytes` is not used.
    pub gpu_memory_utilization: Option<f64>,
    /// Tokens computed per step, all requests together.
    pub max_num_batched_tokens: usize,
    /// Requests in the running batch.
    pub max_num_seqs: usize,
    /// Compute threads (0: all cores).
    pub threads: usize,
    /// Where the forward pass runs.
    pub device: Device,
    /// The order in which waiting requests are admitted.
    pub scheduling: Scheduling,
    /// Whether planning and streaming overlap the device's passes.
    pub overlap: Overlap,
}

/// Whether the engine's host work overlaps the device's passes: the next pass planned, and
/// the landed pass's tokens streamed (detokenizing, stop strings, the requests' channels),
/// while the device runs a pass, so the device waits only for a pass to land and the next
/// to launch (vLLM's asynchronous scheduling and output processing). A planned row that a
/// landed token ends is left out; a request that a stop string ends has one row of the pass
/// after wasted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Overlap {
    /// On a GPU, whose passes run while the host goes on; off on the CPU, whose pass is the
    /// host's own work (overlapping would only hold each token back one step).
    #[default]
    Auto,
    /// Always (on the CPU: for tests of the overlapped order).
    On,
    /// Never.
    Off,
}

impl std::str::FromStr for Overlap {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "auto" => Ok(Overlap::Auto),
            "on" => Ok(Overlap::On),
            "off" => Ok(Overlap::Off),
            other => Err(format!("{other:?} is not auto, on or off")),
        }
    }
}

/// The order in which waiting requests are admitted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Scheduling {
    /// Tenant-fair: the Virtual Token Counter ([`crate::serve::fair`]), priorities as bands.
    #[default]
    Fair,
    /// First come, first served.
    Fcfs,
}

impl std::str::FromStr for Scheduling {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fair" => Ok(Scheduling::Fair),
            "fcfs" => Ok(Scheduling::Fcfs),
            other => Err(format!("unknown scheduling policy {other:?} (expected fair or fcfs)")),
        }
    }
}

impl Scheduling {
    /// The waiting queue of this policy.
    pub fn waiting(self) -> Box<dyn WaitingPolicy> {
        match self {
            Scheduling::Fair => Box::new(Vtc::new(FairConfig::default())),
            Scheduling::Fcfs => Box::new(Fcfs::default()),
        }
    }
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            kv_cache_bytes: 512 << 20,
            kv_cache_dtype: KvDtype::default(),
            gpu_memory_utilization: None,
            max_num_batched_tokens: 512,
            max_num_seqs: 64,
            threads: 0,
            device: Device::Cpu,
            scheduling: Scheduling::default(),
            overlap: Overlap::default(),
        }
    }
}

/// A snapshot of the engine's load.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct EngineStats {
    /// Requests running.
    pub running: usize,
    /// Requests waiting.
    pub waiting: usize,
    /// Free KV blocks (cached ones included).
    pub free_blocks: usize,
    /// All KV blocks.
    pub total_blocks: usize,
}

struct ReqState {
    req: ValidRequest,
    /// Tells this request from an earlier one under the same id.
    serial: u64,
    /// Its scheduler state, once a token ended it and it left the scheduler (the token is
    /// still to be streamed).
    removed: Option<crate::serve::scheduler::SeqState>,
    /// Where its sequence holds [`PLACEHOLDER`] for the token of the pass in flight.
    placeholder: Option<usize>,
    tx: UnboundedSender<EngineEvent>,
    sampler: Sampler,
    decoder: IncrementalDecoder,
    stop: StopText,
    output: usize,
    first_scheduled: Option<Instant>,
    /// When the first step after its arrival was planned.
    first_planned: Option<Instant>,
    first_token: Option<Instant>,
    last_token: Option<Instant>,
    prompt_logprobs: Vec<PromptLogprob>,
    prompt_logprobs_sent: bool,
    /// A stop string matched: held-back text is dropped, not released.
    stop_matched: bool,
    /// Where its output stands in its grammar (`response_format`).
    matcher: Option<Matcher>,
    /// The tokens that end its constrained output once the value is complete.
    matcher_stops: Vec<u32>,
    /// The token budget made the grammar close the value.
    closed_by_budget: bool,
}

/// A step's row, owned (the scheduler changes while results are applied).
struct Work {
    id: String,
    serial: u64,
    tokens: Vec<u32>,
    start: usize,
    table: Vec<u32>,
    logits: LogitsWanted,
    reaches_end: bool,
    prompt_len: usize,
    adapter: Option<Arc<LoraAdapter>>,
}

/// A pass launched and not yet landed.
struct Flight {
    work: Vec<Work>,
    pass: PendingPass,
    /// When it was launched.
    began: Instant,
    /// The CPU passes' profile before it.
    profile: Option<ForwardProfile>,
    /// What the scheduler judges its time by.
    context: StepContext,
}

/// Holds the place of a token chosen when its pass lands ([`EngineCore::step`] overlapped).
const PLACEHOLDER: u32 = u32::MAX;

/// A token chosen for a request, not yet streamed.
struct Chosen {
    id: String,
    serial: u64,
    token: TokenOutput,
    /// One of the model's or the request's stop tokens (no text).
    stop_token: bool,
    /// How the request ends with it, as far as the token alone says.
    finish: Option<FinishReason>,
}

/// Where a sequence's next token comes from.
enum Choice<'a> {
    /// Its logits, for its sampler.
    Logits(&'a [f32]),
    /// Chosen by the backend (greedy, or a draw on a GPU).
    Picked(u32),
}

/// The engine core.
pub struct EngineCore {
    model: Arc<LoadedModel>,
    backend: Backend,
    block_size: usize,
    num_blocks: usize,
    sched: Scheduler,
    reqs: HashMap<String, ReqState>,
    metrics: Arc<EngineMetrics>,
    outcomes: Arc<OutcomeLog>,
    /// Which tenants the per-tenant metrics name.
    tenant_labels: TenantLabels,
    /// Requests added since the last step was planned.
    unplanned: Vec<String>,
    /// The running step's priority, for arrivals to interrupt (armed with the fair policy).
    interrupt: Arc<Interrupt>,
    /// Whether passes stop for arrivals (the fair policy armed the backend, and the output
    /// is not overlapped).
    interrupts: bool,
    /// Whether planning and streaming overlap the device's passes.
    overlap: bool,
    /// The pass launched and not yet landed (only between steps when overlapping).
    in_flight: Option<Flight>,
    /// The next request's serial.
    next_serial: u64,
}

impl EngineCore {
    /// Allocates the KV cache and the scheduler.
    pub fn new(
        model: Arc<LoadedModel>,
        config: EngineConfig,
        metrics: Arc<EngineMetrics>,
    ) -> Result<EngineCore> {
        if config.max_num_batched_tokens == 0 || config.max_num_seqs == 0 {
            return Err(EngineError::InvalidRequest(
                "max_num_batched_tokens and max_num_seqs must be positive".into(),
            ));
        }
        let kv = match config.gpu_memory_utilization {
            Some(share) if config.block_size > 0 => KvSize::DeviceShare {
                share,
                max_tokens: config.max_num_batched_tokens,
                max_seqs: config.max_num_seqs,
            },
            _ => {
                let bs = config.block_size.max(1);
                let per_block =
                    config.device.bytes_per_block(&model.weights, bs, config.kv_cache_dtype);
                let num_blocks = config.kv_cache_bytes / per_block;
                if config.block_size == 0 || num_blocks == 0 {
                    return Err(EngineError::InvalidRequest(format!(
                        "a KV cache of {} bytes holds no block of {} tokens ({per_block} bytes \
                         each)",
                        config.kv_cache_bytes, config.block_size
                    )));
                }
                KvSize::Blocks(num_blocks)
            }
        };
        let mut backend = Backend::new(
            config.device,
            &model.weights,
            config.threads,
            config.block_size,
            kv,
            config.kv_cache_dtype,
        )?;
        let num_blocks = backend.num_blocks();
        let reserved = backend.reserve(config.max_num_batched_tokens, config.max_num_seqs)?;
        if reserved > 0 {
            tracing::info!(
                device = %config.device,
                mib = reserved >> 20,
                "pass buffers set aside beside the KV cache"
            );
        }
        // Priorities are strict bands under the fair policy: a higher one interrupts a pass
        // of lower ones between layers. First come, first served knows no priorities.
        let interrupt = Arc::new(Interrupt::default());
        let overlap = match config.overlap {
            Overlap::Auto => config.device != Device::Cpu,
            Overlap::On => true,
            Overlap::Off => false,
        };
        // A pass the host no longer waits on cannot be stopped between layers.
        let interrupts = config.scheduling == Scheduling::Fair && !overlap;
        if interrupts {
            backend.set_interrupt(Arc::clone(&interrupt));
        }
        let keys = vec![CacheKey::ModelRevision(model.identity.model_revision.clone())];
        let sched = Scheduler::new(
            SchedulerConfig {
                max_num_batched_tokens: config.max_num_batched_tokens,
                max_num_seqs: config.max_num_seqs,
            },
            KvManager::new(num_blocks, config.block_size, keys),
            config.scheduling.waiting(),
        );
        Ok(EngineCore {
            backend,
            block_size: config.block_size,
            num_blocks,
            model,
            sched,
            reqs: HashMap::new(),
            metrics,
            outcomes: Arc::default(),
            tenant_labels: TenantLabels::default(),
            unplanned: Vec::new(),
            interrupt,
            interrupts,
            overlap,
            in_flight: None,
            next_serial: 0,
        })
    }

    /// What arrivals tell the running step ([`Interrupt::arrive`]).
    pub fn interrupt(&self) -> Arc<Interrupt> {
        Arc::clone(&self.interrupt)
    }

    /// Most tokens one request can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.num_blocks * self.block_size
    }

    /// Whether any request is waiting or running, or a pass is still to land.
    pub fn has_work(&self) -> bool {
        self.sched.has_work() || self.in_flight.is_some()
    }

    /// Load snapshot.
    pub fn stats(&self) -> EngineStats {
        let (free, total) = self.sched.blocks();
        EngineStats {
            running: self.sched.num_running(),
            waiting: self.sched.num_waiting(),
            free_blocks: free,
            total_blocks: total,
        }
    }

    /// Queues a request; events go to `tx`.
    pub fn add_request(&mut self, req: ValidRequest, tx: UnboundedSender<EngineEvent>) {
        if !self.has_work() {
            // The device sat idle for want of work since the last pass, not for the host.
            self.backend.pass_break();
        }
        if self.reqs.contains_key(&req.request_id) {
            let _ = tx.send(finished_error(&req, "duplicate request id"));
            return;
        }
        self.next_serial += 1;
        let state = ReqState {
            serial: self.next_serial,
            removed: None,
            placeholder: None,
            sampler: Sampler::new(req.sampling.clone()),
            decoder: IncrementalDecoder::default(),
            stop: StopText::new(&req.stop),
            output: 0,
            first_scheduled: None,
            first_planned: None,
            first_token: None,
            last_token: None,
            prompt_logprobs: Vec::new(),
            prompt_logprobs_sent: false,
            stop_matched: false,
            matcher: req.grammar.clone().map(Matcher::new),
            matcher_stops: match &req.grammar {
                Some(_) => {
                    stops_for(self.model.tokenizer.stop_ids(), req.ignore_eos, &req.stop_token_ids)
                }
                None => Vec::new(),
            },
            closed_by_budget: false,
            tx,
            req,
        };
        let r = &state.req;
        let policy = SeqPolicy {
            priority: r.priority,
            weight: r.weight,
            tpot_target: r.tpot_target.map(|t| t.as_secs_f64()),
            adapter: r.adapter.as_ref().map(|a| a.adapter.digest),
        };
        self.sched.add_with(r.request_id.clone(), r.prompt.clone(), r.cache_scope.clone(), policy);
        self.unplanned.push(r.request_id.clone());
        self.reqs.insert(r.request_id.clone(), state);
        self.update_gauges();
    }

    /// What the engine did for each recent request, shared with readers.
    pub fn outcomes(&self) -> Arc<OutcomeLog> {
        Arc::clone(&self.outcomes)
    }

    /// Aborts a request: its blocks are freed now; tokens so far count.
    pub fn abort(&mut self, id: &str) {
        if self.reqs.contains_key(id) {
            self.finish(id, FinishReason::Abort, None);
        }
    }

    /// Aborts every request (the end of a shutdown's drain).
    pub fn abort_all(&mut self) {
        let ids: Vec<String> = self.reqs.keys().cloned().collect();
        for id in ids {
            self.finish(&id, FinishReason::Abort, None);
        }
    }

    fn update_gauges(&self) {
        self.metrics.running.set(self.sched.num_running() as i64);
        self.metrics.waiting.set(self.sched.num_waiting() as i64);
        self.metrics.pending_prompt_tokens.set(self.sched.pending_prompt_tokens() as i64);
        if self.sched.num_waiting() == 0 {
            self.metrics.batch_full.set(0);
        }
        let (free, total) = self.sched.blocks();
        self.metrics.kv_usage.set(if total == 0 { 0.0 } else { 1.0 - free as f64 / total as f64 });
    }

    /// Runs one scheduler step: plan, forward, sample, emit. Overlapped (a GPU's order), a
    /// step plans the next pass while the device runs the one the step before launched, then
    /// lands that one (its tokens chosen, the requests they end taken out), launches the next
    /// and streams the landed tokens while the device runs it: the device waits only for the
    /// landing and the launch.
    pub fn step(&mut self) {
        if self.overlap {
            let plan = self.plan_next();
            let landed = match self.in_flight.take() {
                Some(f) => self.land(f),
                None => Vec::new(),
            };
            if let Some(plan) = plan {
                self.launch(plan);
            }
            self.deliver(landed);
        } else {
            if let Some(plan) = self.plan_next() {
                self.launch(plan);
            }
            if let Some(f) = self.in_flight.take() {
                let landed = self.land(f);
                self.deliver(landed);
            }
        }
        self.update_gauges();
    }

    /// Plans the next pass (`None`: nothing to run), with what its landing is judged by.
    fn plan_next(&mut self) -> Option<(StepPlan, StepContext)> {
        let planned = Instant::now();
        for id in self.unplanned.drain(..) {
            if let Some(st) = self.reqs.get_mut(&id) {
                st.first_planned.get_or_insert(planned);
            }
        }
        let plan = self.sched.schedule();
        let context = self.sched.take_step_context();
        let now = Instant::now();
        self.metrics.preemptions.inc_by(plan.preempted.len() as u64);
        self.metrics.fairness_preemptions.inc_by(plan.fairness_preemptions as u64);
        self.metrics.batch_full.set(i64::from(plan.batch_full));
        for id in &plan.newly_admitted {
            if let (Some(st), Some(seq)) = (self.reqs.get_mut(id), self.sched.seq(id)) {
                st.first_scheduled.get_or_insert(now);
                self.metrics.prefix_queries.inc_by(seq.prompt_len as u64);
                self.metrics.prefix_hits.inc_by(seq.cached_prompt as u64);
                self.metrics.queue.observe((now - st.req.arrival).as_secs_f64());
            }
        }
        self.metrics.add_step_time(StepPhase::Schedule, planned.elapsed().as_secs_f64());
        if plan.scheduled.is_empty() {
            if self.in_flight.is_none() {
                self.backend.pass_break();
            }
            return None;
        }
        Some((plan, context))
    }

    /// Launches a planned pass (it lands at `in_flight`). A planned row whose request has
    /// ended since (a landed token ended it) is left out. Overlapped, its rows count as
    /// computed now, and a row that gives a token holds its place with [`PLACEHOLDER`] until
    /// it lands, so the next pass can be planned while this one runs.
    fn launch(&mut self, (plan, context): (StepPlan, StepContext)) {
        let building = Instant::now();
        let mut work = Vec::with_capacity(plan.scheduled.len());
        for w in &plan.scheduled {
            let (Some(seq), Some(st)) = (self.sched.seq(&w.id), self.reqs.get(&w.id)) else {
                continue;
            };
            let tokens = &seq.tokens[w.start..w.start + w.len];
            if tokens.contains(&PLACEHOLDER) {
                // Every landed token replaced its placeholder: one left is a bug, and never
                // a token to compute.
                let msg = "internal error: a token still to be chosen was planned".to_string();
                self.finish(&w.id, FinishReason::Error, Some(msg));
                continue;
            }
            let reaches_end = w.start + w.len == seq.tokens.len();
            let want_prompt_lp = st.req.prompt_logprobs.is_some()
                && !st.prompt_logprobs_sent
                && w.start < seq.prompt_len;
            let logits = if want_prompt_lp {
                LogitsWanted::All
            } else if reaches_end {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            };
            work.push(Work {
                id: w.id.clone(),
                serial: st.serial,
                tokens: tokens.to_vec(),
                start: w.start,
                table: self.sched.kv().blocks(&w.id).to_vec(),
                logits,
                reaches_end,
                prompt_len: seq.prompt_len,
                adapter: st.req.adapter.as_ref().map(|a| Arc::clone(&a.adapter)),
            });
        }
        if work.is_empty() {
            return;
        }
        let inputs: Vec<SeqInput<'_>> = work
            .iter()
            .map(|w| SeqInput {
                tokens: &w.tokens,
                start_pos: w.start,
                block_table: &w.table,
                logits: w.logits,
                adapter: w.adapter.as_deref(),
            })
            .collect();
        // Greedy sequences with nothing else asked of their logits get their token picked
        // by the backend, and on a GPU so do plain draws (only the id comes back).
        let draws = self.backend.draws_on_device();
        let picks: Vec<Pick> = work
            .iter()
            .map(|w| match self.reqs.get_mut(&w.id) {
                Some(st) if w.logits == LogitsWanted::Last && st.matcher.is_none() => {
                    if st.sampler.argmax_only(st.req.logprobs) {
                        Pick::Argmax
                    } else if draws {
                        st.sampler.device_draw(st.req.logprobs).unwrap_or_default()
                    } else {
                        Pick::Logits
                    }
                }
                _ => Pick::Logits,
            })
            .collect();
        // What arrivals are judged against, only where they can interrupt (the fair policy).
        if self.interrupts {
            let (lowest, band_load, loads) =
                self.sched.step_loads(work.iter().map(|w| w.id.as_str()));
            let prefills = work
                .iter()
                .filter(|w| w.tokens.len() > 1)
                .filter_map(|w| self.sched.seq(&w.id))
                .map(|s| (s.priority, s.scope.tenant().to_owned()))
                .collect();
            self.interrupt.begin(lowest.unwrap_or(i32::MAX), band_load, loads, prefills);
        }
        let profile = self.backend.profile();
        let began = Instant::now();
        // Building the inputs counts as planning.
        self.metrics.add_step_time(StepPhase::Schedule, (began - building).as_secs_f64());
        let pass = self.backend.launch(&self.model.weights, &inputs, &picks);
        drop(inputs);
        if self.overlap {
            for w in &work {
                // Offered to the prefix cache when it lands whole: a failed pass's blocks
                // must never be found.
                self.sched.advance_computed(&w.id, w.tokens.len());
                if w.reaches_end
                    && let Some(st) = self.reqs.get_mut(&w.id)
                {
                    st.placeholder = self.sched.seq(&w.id).map(|s| s.tokens.len());
                    self.sched.append_token(&w.id, PLACEHOLDER);
                }
            }
        }
        self.in_flight = Some(Flight { work, pass, began, profile, context });
    }

    /// Whether `id` is still the request a pass was launched for.
    fn current(&self, id: &str, serial: u64) -> bool {
        self.reqs.get(id).is_some_and(|st| st.serial == serial)
    }

    /// Waits for a launched pass and applies it: computed tokens to the scheduler, prompt
    /// logprobs, and each finished row's next token chosen (not yet streamed). Rows of
    /// requests that ended since the launch are dropped.
    fn land(&mut self, f: Flight) -> Vec<Chosen> {
        let Flight { work, pass, began, profile, context } = f;
        let result = self.backend.collect(pass);
        let seconds = began.elapsed().as_secs_f64();
        let passed = Instant::now();
        match (profile, self.backend.profile()) {
            (Some(b), Some(a)) => {
                let p = a.since(&b);
                self.metrics.add_step_time(StepPhase::Attention, p.attention);
                self.metrics.add_step_time(StepPhase::Matmul, p.matmul);
                self.metrics.add_step_time(StepPhase::LmHead, p.lm_head);
                let other = (seconds - p.attention - p.matmul - p.lm_head).max(0.0);
                self.metrics.add_step_time(StepPhase::ForwardOther, other);
            }
            _ => self.metrics.add_step_time(StepPhase::ForwardOther, seconds),
        }
        let times = self.backend.take_pass_times();
        self.metrics.device_busy.inc_by(times.busy);
        self.metrics.device_gap.inc_by(times.gap);
        self.metrics.device_gaps.inc_by(times.gaps);
        self.metrics.device_passes.inc_by(times.passes);
        let cut = matches!(result, Err(EngineError::Interrupted));
        if self.interrupts {
            self.interrupt.end(cut);
        }
        self.sched.restore_step_context(context);
        if cut {
            // Nothing of the step stands: the next plan, with the arrival in it, computes
            // its tokens again.
            self.metrics.interrupted_steps.inc();
            self.sched.observe_interrupted(seconds);
            return Vec::new();
        }
        // The step-time model behind the TPOT limit learns from every whole pass, by the time
        // a step takes: the host's wait for the pass; overlapped, the device's time from the
        // end of the pass before to the end of this one, where this pass alone was read (the
        // host's wait then holds only what it did not overlap).
        let shape = StepShape {
            tokens: work.iter().map(|w| w.tokens.len()).sum(),
            context: work.iter().map(|w| w.start + w.tokens.len()).sum(),
        };
        let step = if self.overlap && times.passes == 1 { times.busy + times.gap } else { seconds };
        self.sched.observe_step(shape, step);
        let StepOutput { logits, picked } = match result {
            Ok(out) => out,
            Err(e) => {
                for w in &work {
                    if self.current(&w.id, w.serial) {
                        self.finish(&w.id, FinishReason::Error, Some(e.to_string()));
                    }
                }
                return Vec::new();
            }
        };
        let vocab = self.model.weights.config.vocab_size;
        let mut row = 0;
        let mut chosen = Vec::new();
        for (i, w) in work.iter().enumerate() {
            let pick = picked.get(i).copied().flatten();
            let rows = match (w.logits, pick) {
                (LogitsWanted::None, _) | (LogitsWanted::Last, Some(_)) => 0,
                (LogitsWanted::Last, None) => 1,
                (LogitsWanted::All, _) => w.tokens.len(),
            };
            let chunk = logits.get(row * vocab..(row + rows) * vocab);
            row += rows;
            if !self.current(&w.id, w.serial) {
                // Ended since the launch (a stop string, its client gone): a wasted row.
                continue;
            }
            let Some(chunk) = chunk else {
                self.finish(&w.id, FinishReason::Error, Some("missing logits".into()));
                continue;
            };
            // Overlapped, its rows counted as computed at the launch.
            if self.overlap {
                self.sched.offer_computed(&w.id);
            } else {
                self.sched.mark_computed(&w.id, w.tokens.len());
            }
            if w.logits == LogitsWanted::All {
                self.collect_prompt_logprobs(w.id.as_str(), w.start, w.prompt_len, chunk, vocab);
            }
            if w.reaches_end {
                let choice = match pick {
                    Some(token) => Some(Choice::Picked(token)),
                    None if rows > 0 => Some(Choice::Logits(&chunk[(rows - 1) * vocab..])),
                    None => None,
                };
                if let Some(c) = choice.and_then(|c| self.accept_token(&w.id, c)) {
                    chosen.push(c);
                }
            }
        }
        self.metrics.add_step_time(StepPhase::Emit, passed.elapsed().as_secs_f64());
        self.metrics.steps.inc();
        chosen
    }

    /// Streams the chosen tokens.
    fn deliver(&mut self, chosen: Vec<Chosen>) {
        if chosen.is_empty() {
            return;
        }
        let began = Instant::now();
        for c in chosen {
            self.deliver_token(c);
        }
        self.metrics.add_step_time(StepPhase::Emit, began.elapsed().as_secs_f64());
    }

    fn collect_prompt_logprobs(
        &mut self,
        id: &str,
        start: usize,
        prompt_len: usize,
        chunk: &[f32],
        vocab: usize,
    ) {
        let Some(seq) = self.sched.seq(id) else { return };
        let prompt: Vec<u32> = seq.tokens[..prompt_len].to_vec();
        let Some(st) = self.reqs.get_mut(id) else { return };
        let k = st.req.prompt_logprobs.unwrap_or(0);
        if start == 0 && st.prompt_logprobs.is_empty() {
            st.prompt_logprobs.push(PromptLogprob {
                token: prompt[0],
                logprob: None,
                top: Vec::new(),
            });
        }
        for (r, logits) in chunk.chunks_exact(vocab).enumerate() {
            let next = start + r + 1;
            if next >= prompt_len || st.prompt_logprobs.len() != next {
                continue;
            }
            let lp = log_softmax(logits);
            let token = prompt[next];
            st.prompt_logprobs.push(PromptLogprob {
                token,
                logprob: Some(lp[token as usize]),
                top: top_n(&lp, k),
            });
        }
        if st.prompt_logprobs.len() == prompt_len && !st.prompt_logprobs_sent {
            st.prompt_logprobs_sent = true;
            let ev = EngineEvent::PromptLogprobs(std::mem::take(&mut st.prompt_logprobs));
            if st.tx.send(ev).is_err() {
                self.finish(id, FinishReason::Abort, None);
            }
        }
    }

    /// Chooses `id`'s next token from `choice` and adds it to the sequence; a request the
    /// token ends (a stop token, its length, a closed response format) leaves the scheduler
    /// now, so the next plan has no row for it. The text and the stream come in
    /// [`EngineCore::deliver_token`].
    fn accept_token(&mut self, id: &str, choice: Choice<'_>) -> Option<Chosen> {
        let ctx = self.model.weights.config.context_length;
        let stops = self.model.tokenizer.stop_ids();
        let st = self.reqs.get_mut(id)?;
        // Tokens that may still come, this one included.
        let left = (st.req.max_tokens.saturating_sub(st.output))
            .min(ctx.saturating_sub(st.req.prompt.len() + st.output));
        let s = match (choice, &mut st.matcher) {
            (Choice::Logits(logits), None) => st.sampler.sample(logits, st.req.logprobs),
            (Choice::Logits(logits), Some(m)) => {
                let tok = &self.model.tokenizer;
                let bytes = |t: u32| tok.token_bytes(t).filter(|_| !tok.is_special(t));
                let picked = sample_constrained(
                    &mut st.sampler,
                    m,
                    logits,
                    st.req.logprobs,
                    bytes,
                    &st.matcher_stops,
                    self.model.spelling(),
                    left,
                );
                match picked {
                    Ok((s, forced)) => {
                        st.closed_by_budget |= forced;
                        s
                    }
                    Err(_) => {
                        let msg = "no token continues the response format".to_string();
                        self.finish(id, FinishReason::Error, Some(msg));
                        return None;
                    }
                }
            }
            (Choice::Picked(token), _) => st.sampler.accept(token),
        };
        st.output += 1;
        self.metrics.generation_tokens.inc();
        match st.placeholder.take() {
            Some(at) => self.sched.set_token(id, at, s.token),
            None => self.sched.append_token(id, s.token),
        }
        let token = TokenOutput {
            token: s.token,
            logprob: s.logprob,
            top: if st.req.logprobs.is_some() { s.top } else { Vec::new() },
        };
        let stop_token = (!st.req.ignore_eos && stops.contains(&s.token))
            || st.req.stop_token_ids.contains(&s.token);
        let mut finish = stop_token.then_some(FinishReason::Stop);
        // A constrained output ends as soon as its value is closed: a stop, unless the
        // token budget made the grammar close it (then it is cut short, valid).
        if finish.is_none() && st.matcher.as_ref().is_some_and(Matcher::is_closed) {
            finish =
                Some(if st.closed_by_budget { FinishReason::Length } else { FinishReason::Stop });
        }
        let total = st.req.prompt.len() + st.output;
        if finish.is_none() && (st.output >= st.req.max_tokens || total >= ctx) {
            finish = Some(FinishReason::Length);
        }
        if finish.is_some() {
            st.removed = self.sched.remove(id);
        }
        Some(Chosen { id: id.to_string(), serial: st.serial, token, stop_token, finish })
    }

    /// Streams a chosen token: its text (held back while it may begin a stop string), and
    /// the request's end when the token, a stop string or a closed stream ends it.
    fn deliver_token(&mut self, c: Chosen) {
        let Some(st) = self.reqs.get_mut(&c.id).filter(|st| st.serial == c.serial) else {
            return;
        };
        let now = Instant::now();
        match st.last_token {
            Some(prev) => self.metrics.itl.observe((now - prev).as_secs_f64()),
            None => {
                st.first_token = Some(now);
                self.metrics.ttft.observe((now - st.req.arrival).as_secs_f64());
                if let Some(fs) = st.first_scheduled {
                    self.metrics.prefill.observe((now - fs).as_secs_f64());
                }
            }
        }
        st.last_token = Some(now);
        let mut finish = c.finish;
        let text = if c.stop_token {
            String::new()
        } else {
            let delta = match st.decoder.push(&self.model.tokenizer, c.token.token) {
                Ok(d) => d,
                Err(e) => {
                    let msg = e.to_string();
                    self.finish(&c.id, FinishReason::Error, Some(msg));
                    return;
                }
            };
            match st.stop.push(&delta) {
                StopOutcome::Continue(t) => t,
                StopOutcome::Stopped(t) => {
                    // A stop string ends it whatever else the token said.
                    st.stop_matched = true;
                    finish = Some(FinishReason::Stop);
                    t
                }
            }
        };
        if st.tx.send(EngineEvent::Tokens { tokens: vec![c.token], text }).is_err() {
            // The client went away.
            finish = Some(FinishReason::Abort);
        }
        if let Some(reason) = finish {
            self.finish(&c.id, reason, None);
        }
    }

    fn finish(&mut self, id: &str, reason: FinishReason, error: Option<String>) {
        let seq = self.sched.remove(id);
        let Some(mut st) = self.reqs.remove(id) else { return };
        let seq = seq.or_else(|| st.removed.take());
        let now = Instant::now();
        // Text held back for a possible stop string (or a split character) is released,
        // unless a stop string matched.
        let mut text = String::new();
        if !st.stop_matched && reason != FinishReason::Error {
            if let Ok(rest) = st.decoder.flush(&self.model.tokenizer) {
                let _ = st.stop.push(&rest);
            }
            text = st.stop.finish();
        }
        let since = |t: Option<Instant>, from: Instant| t.map_or(0.0, |t| (t - from).as_secs_f64());
        let arrival = st.req.arrival;
        let timings = EngineTimings {
            queue: since(st.first_scheduled, arrival),
            prefill: match (st.first_scheduled, st.first_token) {
                (Some(a), Some(b)) => (b - a).as_secs_f64(),
                _ => 0.0,
            },
            decode: match (st.first_token, st.last_token) {
                (Some(a), Some(b)) => (b - a).as_secs_f64(),
                _ => 0.0,
            },
            ttft: since(st.first_token, arrival),
            e2e: (now - arrival).as_secs_f64(),
            preemptions: seq.as_ref().map_or(0, |s| s.preemptions),
        };
        let usage = Usage {
            prompt_tokens: st.req.prompt.len(),
            cached_tokens: seq.as_ref().map_or(0, |s| s.cached_prompt),
            completion_tokens: st.output,
        };
        if st.first_token.is_some() {
            self.metrics.decode.observe(timings.decode);
        }
        self.metrics.e2e.observe(timings.e2e);
        self.metrics.prompt_tokens.inc_by(usage.prompt_tokens as u64);
        let adapter = st.req.adapter.as_ref().map(|a| a.name.as_str());
        let (label, dropped) = self.tenant_labels.label(st.req.cache_scope.tenant(), adapter, now);
        let mut waited = seq.as_ref().map_or_else(WaitTimes::default, |s| s.waited);
        waited.add(WaitReason::Arrival, since(st.first_planned, arrival));
        let sample = TenantSample {
            waited,
            queue: st.first_scheduled.map(|_| timings.queue),
            ttft: st.first_token.map(|_| timings.ttft),
            tpot: (st.output > 1).then(|| timings.decode / (st.output - 1) as f64),
            prompt_tokens: usage.prompt_tokens as u64,
            generation_tokens: st.output as u64,
            preemptions: u64::from(timings.preemptions),
        };
        self.metrics.record_tenant(&label, &sample, &dropped);
        self.metrics
            .finished
            .get_or_create(&FinishLabel { finished_reason: reason.as_str().into() })
            .inc();
        self.outcomes.ended(id, &usage, reason);
        let _ = st.tx.send(EngineEvent::Finished { reason, text, usage, timings, error });
        self.update_gauges();
    }
}

/// The tokens that end a constrained output once its value is complete: the model's stop
/// tokens (unless `ignore_eos`) and the request's own.
fn stops_for(model: &[u32], ignore_eos: bool, extra: &[u32]) -> Vec<u32> {
    let model = if ignore_eos { &[][..] } else { model };
    model.iter().chain(extra).copied().collect()
}

fn finished_error(req: &ValidRequest, msg: &str) -> EngineEvent {
    EngineEvent::Finished {
        reason: FinishReason::Error,
        text: String::new(),
        usage: Usage { prompt_tokens: req.prompt.len(), ..Default::default() },
        timings: EngineTimings::default(),
        error: Some(msg.to_string()),
    }
}
