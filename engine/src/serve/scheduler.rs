//! Continuous batching in the manner of vLLM v1: one token budget per step, running requests
//! first, chunked prefill, a cap on running sequences, preemption by recompute when blocks
//! run out. Waiting requests are admitted in the order of a [`WaitingPolicy`]: tenant-fair
//! ([`crate::serve::fair::Vtc`], the default) or first come, first served ([`Fcfs`]). The
//! running batch grows only while the predicted step time ([`StepModel`], fitted from the
//! engine's own steps) keeps every running request within its TPOT target: beyond that,
//! requests wait in the policy's order instead of slowing everyone down. Plain synchronous
//! state, tested without threads or a model.

use std::collections::{HashMap, VecDeque};

use crate::serve::CacheScope;
use crate::serve::kv_manager::KvManager;
use crate::serve::step_model::{StepModel, StepShape};

/// The share of a TPOT target the batch is filled to: the rest absorbs the variance of real
/// steps around the model's mean.
const TPOT_HEADROOM: f64 = 0.9;

/// Scheduler limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per step, all requests together.
    pub max_num_batched_tokens: usize,
    /// Requests in the running batch.
    pub max_num_seqs: usize,
}

/// A waiting request, as a [`WaitingPolicy`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Waiter {
    /// Request id.
    pub id: String,
    /// The tenant it is served for (empty: requests that named none, together).
    pub tenant: String,
    /// Priority (higher first).
    pub priority: i32,
    /// The tenant's weight (its tier's share; at least 1).
    pub weight: u32,
}

/// The order in which waiting requests are admitted.
pub trait WaitingPolicy: std::fmt::Debug + Send {
    /// A new request.
    fn push(&mut self, w: Waiter);
    /// A preempted request, to go before the others of its kind.
    fn push_front(&mut self, w: Waiter);
    /// The next request to admit.
    fn peek(&self) -> Option<&str>;
    /// Removes the request [`peek`](Self::peek) returned.
    fn pop(&mut self) -> Option<String>;
    /// Admits `id`, the front request of its tenant's queue, as [`pop`](Self::pop) would
    /// have had it been chosen (the request a full batch made room for).
    fn take(&mut self, id: &str) -> bool;
    /// Removes a request wherever it is (abort).
    fn remove(&mut self, id: &str) -> bool;
    /// Number waiting.
    fn len(&self) -> usize;
    /// Whether none wait.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// A step computed `prefill` prompt (or recomputed) tokens and `decode` new tokens of a
    /// request of `tenant`, whose weight is `weight`.
    fn served(&mut self, _tenant: &str, _weight: u32, _prefill: usize, _decode: usize) {}
    /// A step is being planned.
    fn tick(&mut self) {}
    /// How far above its fair share `tenant` stands (larger: further; preemption takes from
    /// the furthest first). Policies without shares say 0 for everyone.
    fn standing(&self, _tenant: &str) -> f64 {
        0.0
    }
    /// Whether a full batch makes room for a waiting tenant below its weighted share of the
    /// running places, by preempting from the tenant furthest above (policies with shares).
    fn shares_places(&self) -> bool {
        false
    }
}

/// First come, first served, whatever the tenant or priority.
#[derive(Debug, Default)]
pub struct Fcfs {
    queue: VecDeque<String>,
}

impl WaitingPolicy for Fcfs {
    fn push(&mut self, w: Waiter) {
        self.queue.push_back(w.id);
    }
    fn push_front(&mut self, w: Waiter) {
        self.queue.push_front(w.id);
    }
    fn peek(&self) -> Option<&str> {
        self.queue.front().map(String::as_str)
    }
    fn pop(&mut self) -> Option<String> {
        self.queue.pop_front()
    }
    fn take(&mut self, id: &str) -> bool {
        self.remove(id)
    }
    fn remove(&mut self, id: &str) -> bool {
        match self.queue.iter().position(|x| x == id) {
            Some(i) => self.queue.remove(i).is_some(),
            None => false,
        }
    }
    fn len(&self) -> usize {
        self.queue.len()
    }
}

/// How a request is to be scheduled, beside its tokens.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SeqPolicy {
    /// Priority (higher first; lowest preempted first).
    pub priority: i32,
    /// The tenant's weight in the fair order (at least 1).
    pub weight: u32,
    /// The time per output token this request must be kept within, in seconds.
    pub tpot_target: Option<f64>,
}

impl Default for SeqPolicy {
    fn default() -> Self {
        SeqPolicy { priority: 0, weight: 1, tpot_target: None }
    }
}

/// What the scheduler knows of a request.
#[derive(Debug)]
pub struct SeqState {
    /// Prompt followed by the tokens generated so far.
    pub tokens: Vec<u32>,
    /// Prompt length.
    pub prompt_len: usize,
    /// Tokens whose K/V are in the cache.
    pub computed: usize,
    /// Prompt tokens found in the prefix cache at first admission.
    pub cached_prompt: usize,
    /// Prefix-cache scope.
    pub scope: CacheScope,
    /// The tenant's weight in the fair order.
    pub weight: u32,
    /// Priority (higher first; lowest preempted first).
    pub priority: i32,
    /// The time per output token to keep it within, in seconds.
    pub tpot_target: Option<f64>,
    /// Arrival order, for "newest" among equal priorities.
    pub seq_no: u64,
    /// Times preempted.
    pub preemptions: u32,
    /// Whether it has ever been admitted.
    pub admitted: bool,
}

/// One request's share of a step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduled {
    /// Request id.
    pub id: String,
    /// Position of the first token to compute.
    pub start: usize,
    /// Tokens to compute.
    pub len: usize,
}

/// The plan of one step.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct StepPlan {
    /// Work, running requests first.
    pub scheduled: Vec<Scheduled>,
    /// Requests preempted this step (blocks freed, back in the waiting queue).
    pub preempted: Vec<String>,
    /// Requests admitted for the first time this step.
    pub newly_admitted: Vec<String>,
    /// Whether a waiting request was held back because the batch is at its TPOT limit.
    pub held_for_tpot: bool,
    /// Running requests preempted this step to make room for a tenant below its share.
    pub fairness_preemptions: usize,
    /// A waiting request was left waiting because the batch is as large as it may grow (its
    /// TPOT limit, `max_num_seqs` or the KV cache), not for this step's token budget.
    pub batch_full: bool,
}

/// The scheduler.
#[derive(Debug)]
pub struct Scheduler {
    config: SchedulerConfig,
    waiting: Box<dyn WaitingPolicy>,
    running: Vec<String>,
    seqs: HashMap<String, SeqState>,
    kv: KvManager,
    next_seq: u64,
    /// Step times learned from the engine's own steps.
    step_model: StepModel,
}

impl Scheduler {
    /// A scheduler over `kv` with the given waiting policy.
    pub fn new(
        config: SchedulerConfig,
        kv: KvManager,
        waiting: Box<dyn WaitingPolicy>,
    ) -> Scheduler {
        Scheduler {
            config,
            waiting,
            running: Vec::new(),
            seqs: HashMap::new(),
            kv,
            next_seq: 0,
            step_model: StepModel::default(),
        }
    }

    /// The KV manager (block tables).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Queues a request of weight 1 and no TPOT target.
    pub fn add(&mut self, id: String, prompt: Vec<u32>, scope: CacheScope, priority: i32) {
        self.add_with(id, prompt, scope, SeqPolicy { priority, ..SeqPolicy::default() });
    }

    /// Queues a request; its tenant is the one of its cache scope.
    pub fn add_with(&mut self, id: String, prompt: Vec<u32>, scope: CacheScope, policy: SeqPolicy) {
        let SeqPolicy { priority, weight, tpot_target } = policy;
        let weight = weight.max(1);
        self.next_seq += 1;
        let tenant = scope.tenant().to_owned();
        let st = SeqState {
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            cached_prompt: 0,
            scope,
            weight,
            priority,
            tpot_target,
            seq_no: self.next_seq,
            preemptions: 0,
            admitted: false,
        };
        self.seqs.insert(id.clone(), st);
        self.waiting.push(Waiter { id, tenant, priority, weight });
    }

    /// A request's state.
    pub fn seq(&self, id: &str) -> Option<&SeqState> {
        self.seqs.get(id)
    }

    /// Appends a generated token to a request.
    pub fn append_token(&mut self, id: &str, token: u32) {
        if let Some(s) = self.seqs.get_mut(id) {
            s.tokens.push(token);
        }
    }

    /// Records that a step computed `len` more tokens of `id`, and caches full blocks; the
    /// waiting policy counts the service.
    pub fn mark_computed(&mut self, id: &str, len: usize) {
        if let Some(s) = self.seqs.get_mut(id) {
            // One new token of a sequence past its prompt is decode; anything else (prompt,
            // or generated tokens recomputed after a preemption) is prefill.
            let decode = len == 1 && s.computed >= s.prompt_len;
            let (prefill, decode) = if decode { (0, 1) } else { (len, 0) };
            self.waiting.served(s.scope.tenant(), s.weight, prefill, decode);
            s.computed += len;
            self.kv.cache_computed(id, &s.tokens, s.computed, &s.scope);
        }
    }

    /// Removes a request (finished or aborted) and frees its blocks.
    pub fn remove(&mut self, id: &str) -> Option<SeqState> {
        self.waiting.remove(id);
        self.running.retain(|r| r != id);
        self.kv.free(id);
        self.seqs.remove(id)
    }

    /// Requests running.
    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    /// Requests waiting.
    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Whether anything is left to do.
    pub fn has_work(&self) -> bool {
        !self.running.is_empty() || !self.waiting.is_empty()
    }

    /// Plans one step.
    pub fn schedule(&mut self) -> StepPlan {
        self.waiting.tick();
        let mut plan = StepPlan::default();
        let mut budget = self.config.max_num_batched_tokens;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i].clone();
            let Some(s) = self.seqs.get(&id) else {
                self.running.remove(i);
                continue;
            };
            let len = (s.tokens.len() - s.computed).min(budget);
            if len == 0 {
                i += 1;
                continue;
            }
            let total = s.computed + len;
            let mut scheduled = true;
            while !self.kv.allocate(&id, &[], total) {
                // Out of blocks: preempt the lowest-priority, newest running request.
                match self.pick_victim() {
                    Some(v) => {
                        let self_victim = v == id;
                        self.preempt(&v, &mut plan);
                        if self_victim {
                            scheduled = false;
                            break;
                        }
                        // A victim scheduled earlier this step gives its budget back.
                        if let Some(pos) = plan.scheduled.iter().position(|x| x.id == v) {
                            budget += plan.scheduled.remove(pos).len;
                        }
                    }
                    None => {
                        scheduled = false;
                        break;
                    }
                }
            }
            if !scheduled {
                // `id` itself was preempted (it was at or after index i).
                continue;
            }
            let start = self.seqs.get(&id).map_or(0, |s| s.computed);
            plan.scheduled.push(Scheduled { id: id.clone(), start, len });
            budget -= len;
            i = self.running.iter().position(|r| *r == id).map_or(i, |p| p + 1);
        }
        if plan.preempted.is_empty() {
            self.admit_waiting(&mut budget, &mut plan);
        }
        // Requests wait for a full batch, not for the next step: it holds `max_num_seqs`, is at
        // its TPOT limit, or is out of KV blocks (a preemption, or an admission that failed).
        plan.batch_full = self.num_waiting() > 0
            && (plan.batch_full
                || plan.held_for_tpot
                || !plan.preempted.is_empty()
                || self.running.len() >= self.config.max_num_seqs);
        plan
    }

    /// The running request to preempt: the lowest priority, then the tenant furthest above
    /// its fair share, then the newest.
    fn pick_victim(&self) -> Option<String> {
        self.running
            .iter()
            .filter_map(|id| {
                let s = self.seqs.get(id)?;
                Some((id, s.priority, self.waiting.standing(s.scope.tenant()), s.seq_no))
            })
            .min_by(|a, b| a.1.cmp(&b.1).then(b.2.total_cmp(&a.2)).then(b.3.cmp(&a.3)))
            .map(|(id, ..)| id.clone())
    }

    fn preempt(&mut self, id: &str, plan: &mut StepPlan) {
        self.running.retain(|r| r != id);
        self.kv.free_blocks_keep_hashes(id);
        if let Some(s) = self.seqs.get_mut(id) {
            s.computed = 0;
            s.preemptions += 1;
            self.waiting.push_front(Waiter {
                id: id.to_string(),
                tenant: s.scope.tenant().to_owned(),
                priority: s.priority,
                weight: s.weight,
            });
        }
        plan.preempted.push(id.to_string());
    }

    /// Records that a step of this shape took `seconds` (the step-time model learns from it).
    pub fn observe_step(&mut self, shape: StepShape, seconds: f64) {
        self.step_model.observe(shape, seconds);
    }

    /// Whether `candidate` may join the running batch: the time per output token the batch
    /// would give (its decode step, with the recent share of prefill work) is predicted to
    /// stay within the tightest TPOT target of the batch and the candidate.
    /// Until the model is warm, or when nobody has a target, it may.
    fn within_tpot(&self, candidate: &SeqState) -> bool {
        self.within_tpot_without(candidate, None)
    }

    /// [`within_tpot`](Self::within_tpot) with the running request `without` left out.
    fn within_tpot_without(&self, candidate: &SeqState, without: Option<&str>) -> bool {
        let running = || {
            self.running
                .iter()
                .filter(move |id| Some(id.as_str()) != without)
                .filter_map(|id| self.seqs.get(id))
        };
        let target = running()
            .filter_map(|s| s.tpot_target)
            .chain(candidate.tpot_target)
            .min_by(f64::total_cmp);
        let Some(target) = target else { return true };
        let context = running().map(|s| s.tokens.len()).sum::<usize>() + candidate.tokens.len();
        let predicted = self.step_model.predict_tpot(running().count() + 1, context);
        predicted.is_none_or(|t| t <= TPOT_HEADROOM * target)
    }

    /// The running request to make room with for `candidate` when the batch is full (at its
    /// TPOT limit or `max_num_seqs`): the newest of the tenant with the most running requests
    /// per unit of weight, when it keeps at least `candidate`'s tenant's share after the swap,
    /// i.e. `(its count - 1) / its weight >= (candidate's count + 1) / candidate's weight`,
    /// and has no higher priority; never one admitted this step, and only when the candidate
    /// then fits the batch's TPOT limit. Swaps only ever move the batch toward the weighted
    /// shares, so two tenants never take a place back and forth. Requests without a tenant
    /// (private scopes: not through the gateway) count as one tenant.
    fn fair_victim(&self, candidate: &SeqState, plan: &StepPlan) -> Option<String> {
        let mine = candidate.scope.tenant();
        // Per tenant: running count and weight (the largest its requests carry).
        let mut per: HashMap<&str, (u64, u64)> = HashMap::new();
        for s in self.running.iter().filter_map(|id| self.seqs.get(id)) {
            let e = per.entry(s.scope.tenant()).or_insert((0, 1));
            e.0 += 1;
            e.1 = e.1.max(u64::from(s.weight.max(1)));
        }
        let mine_count = per.get(mine).map_or(0, |e| e.0);
        let mine_weight = u64::from(candidate.weight.max(1));
        // The most running per weight: count_a / w_a > count_b / w_b, cross-multiplied.
        let (tenant, &(count, weight)) = per
            .iter()
            .filter(|(t, _)| **t != mine)
            .max_by(|a, b| (a.1.0 * b.1.1).cmp(&(b.1.0 * a.1.1)).then(b.0.cmp(a.0)))?;
        if (count - 1) * mine_weight < (mine_count + 1) * weight {
            return None;
        }
        let victim = self
            .running
            .iter()
            .filter(|id| !plan.newly_admitted.contains(id))
            .filter_map(|id| self.seqs.get(id).map(|s| (id, s)))
            .filter(|(_, s)| s.scope.tenant() == *tenant && s.priority <= candidate.priority)
            .max_by_key(|(_, s)| s.seq_no)
            .map(|(id, _)| id.clone())?;
        self.within_tpot_without(candidate, Some(&victim)).then_some(victim)
    }

    /// Preempts `victim` to make room for a waiting request of a tenant below its share; a
    /// victim scheduled earlier this step gives its budget back.
    fn swap_out(&mut self, victim: &str, budget: &mut usize, plan: &mut StepPlan) {
        self.preempt(victim, plan);
        plan.fairness_preemptions += 1;
        if let Some(pos) = plan.scheduled.iter().position(|x| x.id == victim) {
            *budget += plan.scheduled.remove(pos).len;
        }
    }

    fn admit_waiting(&mut self, budget: &mut usize, plan: &mut StepPlan) {
        // At most one place changes hands per step, and it goes to the request it was made
        // for (not to whoever the policy would name next: perhaps the victim itself).
        let mut swapped = false;
        let mut made_room_for: Option<String> = None;
        while *budget > 0 {
            let next = made_room_for.take().or_else(|| self.waiting.peek().map(str::to_string));
            let Some(id) = next else { break };
            let Some(s) = self.seqs.get(&id) else {
                self.waiting.take(&id);
                continue;
            };
            // A batch at its TPOT limit takes no one else: the rest wait, in the policy's
            // order (a lone request always runs), unless a tenant above its share makes room.
            let full = self.running.len() >= self.config.max_num_seqs;
            let held = !full && !self.running.is_empty() && !self.within_tpot(s);
            if full || held {
                plan.held_for_tpot |= held;
                let victim = (!swapped && self.waiting.shares_places())
                    .then(|| self.fair_victim(s, plan))
                    .flatten();
                match victim {
                    Some(victim) => {
                        self.swap_out(&victim, budget, plan);
                        swapped = true;
                        made_room_for = Some(id);
                        continue;
                    }
                    None => {
                        plan.batch_full = true;
                        break;
                    }
                }
            }
            let n = s.tokens.len();
            // At least one token is always computed, so a fully cached prompt still yields
            // logits: hits cover at most n - 1 tokens.
            let scope = s.scope.clone();
            let tokens = s.tokens.clone();
            let hits = self.kv.find_prefix(&id, &tokens, &scope, n.saturating_sub(1));
            let hit_tokens = hits.len() * self.kv.block_size();
            let len = (n - hit_tokens).min(*budget);
            if !self.kv.allocate(&id, &hits, hit_tokens + len) {
                plan.batch_full = true;
                break;
            }
            self.waiting.take(&id);
            if let Some(s) = self.seqs.get_mut(&id) {
                s.computed = hit_tokens;
                if !s.admitted {
                    s.admitted = true;
                    s.cached_prompt = hit_tokens.min(s.prompt_len);
                    plan.newly_admitted.push(id.clone());
                }
            }
            plan.scheduled.push(Scheduled { id: id.clone(), start: hit_tokens, len });
            self.running.push(id);
            *budget -= len;
        }
    }

    /// Free blocks and total blocks.
    pub fn blocks(&self) -> (usize, usize) {
        (self.kv.pool().free(), self.kv.pool().total())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(blocks: usize, budget: usize, seqs: usize) -> Scheduler {
        Scheduler::new(
            SchedulerConfig { max_num_batched_tokens: budget, max_num_seqs: seqs },
            KvManager::new(blocks, 4, vec![]),
            Box::new(Fcfs::default()),
        )
    }

    fn tenant(t: &str) -> CacheScope {
        CacheScope::Tenant(t.into())
    }

    /// Runs one step as the engine would: mark computed, append a token to requests whose
    /// chunk reached the end.
    fn run_step(s: &mut Scheduler, plan: &StepPlan, next_token: u32) {
        for w in &plan.scheduled {
            s.mark_computed(&w.id, w.len);
            let done = s.seq(&w.id).is_some_and(|q| q.computed == q.tokens.len());
            if done {
                s.append_token(&w.id, next_token);
            }
        }
    }

    #[test]
    fn budget_chunks_long_prompts_and_running_go_first() {
        let mut s = sched(64, 8, 4);
        s.add("a".into(), (0..20).collect(), tenant("t"), 0);
        s.add("b".into(), (100..103).collect(), tenant("t"), 0);
        let p = s.schedule();
        assert_eq!(p.scheduled, vec![Scheduled { id: "a".into(), start: 0, len: 8 }]);
        run_step(&mut s, &p, 1);
        let p = s.schedule();
        assert_eq!(p.scheduled, vec![Scheduled { id: "a".into(), start: 8, len: 8 }]);
        run_step(&mut s, &p, 1);
        // a needs 4 more, then b's 3 prompt tokens fit in the same step.
        let p = s.schedule();
        assert_eq!(
            p.scheduled,
            vec![
                Scheduled { id: "a".into(), start: 16, len: 4 },
                Scheduled { id: "b".into(), start: 0, len: 3 }
            ]
        );
        run_step(&mut s, &p, 1);
        // Both decode one token each.
        let p = s.schedule();
        assert_eq!(p.scheduled.iter().map(|w| w.len).collect::<Vec<_>>(), vec![1, 1]);
    }

    #[test]
    fn max_num_seqs_limits_the_batch() {
        let mut s = sched(64, 100, 2);
        for id in ["a", "b", "c"] {
            s.add(id.into(), vec![1, 2, 3], tenant(id), 0);
        }
        let p = s.schedule();
        assert_eq!(p.scheduled.len(), 2);
        assert_eq!(s.num_waiting(), 1);
    }

    #[test]
    fn prefix_hits_are_scoped_and_one_token_is_always_computed() {
        let mut s = sched(64, 100, 4);
        let prompt: Vec<u32> = (0..12).collect();
        s.add("a".into(), prompt.clone(), tenant("A"), 0);
        let p = s.schedule();
        run_step(&mut s, &p, 99);
        s.remove("a");
        // Same tenant: blocks 0..8 hit (12 tokens, hits capped at 11 -> 2 blocks).
        s.add("a2".into(), prompt.clone(), tenant("A"), 0);
        // Other tenant, same prompt: nothing.
        s.add("b".into(), prompt.clone(), tenant("B"), 0);
        let p = s.schedule();
        assert_eq!(
            p.scheduled,
            vec![
                Scheduled { id: "a2".into(), start: 8, len: 4 },
                Scheduled { id: "b".into(), start: 0, len: 12 }
            ]
        );
        assert_eq!(s.seq("a2").map(|q| q.cached_prompt), Some(8));
        assert_eq!(s.seq("b").map(|q| q.cached_prompt), Some(0));
        // A prompt of exactly one block: hits capped at n - 1 = 3 tokens -> no whole block.
        s.add("c".into(), vec![0, 1, 2, 3], tenant("A"), 0);
        let p = s.schedule();
        assert!(p.scheduled.contains(&Scheduled { id: "c".into(), start: 0, len: 4 }));
    }

    /// Decodes (a few steps at most) until a step preempts someone; who.
    fn decode_until_preempted(s: &mut Scheduler) -> Vec<String> {
        let mut preempted = Vec::new();
        for step in 0..6 {
            let p = s.schedule();
            preempted.extend(p.preempted.clone());
            run_step(s, &p, 7 + step);
            if !preempted.is_empty() {
                break;
            }
        }
        preempted
    }

    #[test]
    fn preemption_recomputes_the_newest_and_blocks_come_back() {
        // 4 blocks of 4 tokens: two requests of 6 prompt tokens take 2 blocks each.
        let mut s = sched(4, 100, 4);
        s.add("old".into(), (0..6).collect(), tenant("t"), 0);
        s.add("new".into(), (10..16).collect(), tenant("t"), 0);
        let p = s.schedule();
        assert_eq!(p.scheduled.len(), 2);
        run_step(&mut s, &p, 7);
        // Decode until someone needs a third block: tokens 7 and 8 fit, the 9th does not.
        let preempted = decode_until_preempted(&mut s);
        assert_eq!(preempted, vec!["new".to_string()]);
        assert_eq!(s.seq("new").map(|q| (q.computed, q.preemptions)), Some((0, 1)));
        assert_eq!(s.num_waiting(), 1);
        s.remove("old");
        s.remove("new");
        assert_eq!(s.blocks(), (4, 4), "every block is free again");
    }

    fn fair(blocks: usize, budget: usize, seqs: usize) -> Scheduler {
        use crate::serve::fair::{FairConfig, Vtc};
        Scheduler::new(
            SchedulerConfig { max_num_batched_tokens: budget, max_num_seqs: seqs },
            KvManager::new(blocks, 4, vec![]),
            Box::new(Vtc::new(FairConfig::default())),
        )
    }

    #[test]
    fn a_quiet_tenant_is_admitted_ahead_of_a_floods_backlog() {
        // Two running slots; the flood queues six requests before the quiet tenant's one.
        let mut s = fair(64, 100, 2);
        for i in 0..6 {
            s.add(format!("flood-{i}"), vec![1, 2, 3], tenant("flood"), 0);
        }
        let p = s.schedule();
        run_step(&mut s, &p, 9);
        s.add("quiet-0".into(), vec![4, 5, 6], tenant("quiet"), 0);
        // A flood request finishes: its slot goes to the quiet tenant, not to flood-2.
        s.remove("flood-0");
        let p = s.schedule();
        assert_eq!(p.newly_admitted, vec!["quiet-0".to_string()]);
        // Under first come, first served it would have gone to flood-2.
        let mut f = sched(64, 100, 2);
        for i in 0..6 {
            f.add(format!("flood-{i}"), vec![1, 2, 3], tenant("flood"), 0);
        }
        let p = f.schedule();
        run_step(&mut f, &p, 9);
        f.add("quiet-0".into(), vec![4, 5, 6], tenant("quiet"), 0);
        f.remove("flood-0");
        assert_eq!(f.schedule().newly_admitted, vec!["flood-2".to_string()]);
    }

    fn weight(weight: u32) -> SeqPolicy {
        SeqPolicy { weight, ..SeqPolicy::default() }
    }

    /// A scheduler whose step-time model has learned `0.01 s + 0.01 s per token`.
    fn trained(seqs: usize) -> Scheduler {
        let mut s = fair(256, 100, seqs);
        for i in 0..40 {
            let tokens = 1 + i % 8;
            let shape = crate::serve::step_model::decode(tokens, 50 * (i % 7));
            s.observe_step(shape, 0.01 + 0.01 * tokens as f64);
        }
        s
    }

    #[test]
    fn the_batch_grows_only_while_the_predicted_step_keeps_the_tpot_target() {
        let tight = SeqPolicy { tpot_target: Some(0.06), ..SeqPolicy::default() };
        let mut s = trained(64);
        for i in 0..10 {
            s.add_with(format!("r-{i}"), vec![1, 2, 3], tenant("t"), tight);
        }
        // 4 running make a 0.05 s step; a fifth would make 0.06 s, over 90% of the 0.06 s
        // target (the headroom).
        let p = s.schedule();
        assert_eq!((p.newly_admitted.len(), p.held_for_tpot), (4, true));
        assert_eq!((s.num_running(), s.num_waiting()), (4, 6));
        assert!(p.batch_full, "requests wait because the batch is at its limit");
        // One finishes: one more joins.
        run_step(&mut s, &p, 5);
        s.remove("r-0");
        let p = s.schedule();
        assert_eq!(p.newly_admitted, vec!["r-4".to_string()]);
        // Without targets the batch is bounded by max_num_seqs only.
        let mut s = trained(64);
        for i in 0..10 {
            s.add(format!("r-{i}"), vec![1, 2, 3], tenant("t"), 0);
        }
        let p = s.schedule();
        assert_eq!((p.newly_admitted.len(), p.held_for_tpot, p.batch_full), (10, false, false));
    }

    #[test]
    fn the_tightest_target_in_the_batch_holds_for_everyone_and_a_lone_request_runs() {
        let loose = SeqPolicy { tpot_target: Some(1.0), ..SeqPolicy::default() };
        let tight = SeqPolicy { tpot_target: Some(0.025), ..SeqPolicy::default() };
        let mut s = trained(64);
        // The tight request is first in the fair order (the shorter queue).
        s.add_with("tight".into(), vec![1, 2, 3], tenant("a"), tight);
        for i in 0..5 {
            s.add_with(format!("loose-{i}"), vec![1, 2, 3], tenant("b"), loose);
        }
        let p = s.schedule();
        // tight + 1 more = 0.03 s > 0.9 x 0.025 s: tight runs alone.
        assert_eq!(p.newly_admitted.len(), 1, "{:?}", p.newly_admitted);
        assert!(p.held_for_tpot);
        run_step(&mut s, &p, 5);
        s.remove(&p.newly_admitted[0]);
        // Once it is gone, the loose requests fill the batch.
        let p = s.schedule();
        assert_eq!(p.newly_admitted.len(), 5);
    }

    #[test]
    fn weights_share_admissions() {
        // One slot, both tenants always waiting: a weight-2 tenant is admitted twice as often.
        let mut s = fair(256, 100, 1);
        for i in 0..12 {
            s.add_with(format!("gold-{i}"), vec![1, 2, 3, 4], tenant("gold"), weight(2));
            s.add_with(format!("plain-{i}"), vec![1, 2, 3, 4], tenant("plain"), weight(1));
        }
        let mut order = Vec::new();
        for _ in 0..9 {
            let p = s.schedule();
            run_step(&mut s, &p, 7);
            let id = p.scheduled[0].id.clone();
            order.push(id.split('-').next().unwrap_or_default().to_owned());
            s.remove(&id);
        }
        let gold = order.iter().filter(|t| *t == "gold").count();
        assert_eq!((gold, order.len() - gold), (6, 3), "{order:?}");
    }

    #[test]
    fn preemption_takes_from_the_tenant_furthest_above_its_share() {
        // 4 blocks of 4 tokens. `heavy` has had far more service, so although `light`'s
        // request is the newest, the victim is heavy's.
        let mut s = fair(4, 100, 4);
        s.waiting.served("heavy", 1, 1000, 0);
        s.add("light".into(), (0..6).collect(), tenant("light"), 0);
        s.add("heavy".into(), (10..16).collect(), tenant("heavy"), 0);
        let p = s.schedule();
        assert_eq!(p.scheduled.len(), 2);
        run_step(&mut s, &p, 7);
        let preempted = decode_until_preempted(&mut s);
        assert_eq!(preempted, vec!["heavy".to_string()]);
    }

    #[test]
    fn a_full_batch_makes_room_for_a_tenant_below_its_share() {
        // Four places, all the flood's, and quiet requests arrive one at a time (the quiet
        // tenant, lifted to the flood's counter, goes first by its shorter queue).
        let mut s = fair(256, 100, 4);
        for i in 0..6 {
            s.add(format!("flood-{i}"), vec![1, 2, 3], tenant("flood"), 0);
        }
        let p = s.schedule();
        run_step(&mut s, &p, 9);
        s.add("quiet-0".into(), vec![4, 5, 6], tenant("quiet"), 0);
        // One place changes hands: the flood's newest running request goes back.
        let p = s.schedule();
        assert_eq!((p.preempted.clone(), p.fairness_preemptions), (vec!["flood-3".into()], 1));
        assert_eq!(p.newly_admitted, vec!["quiet-0".to_string()]);
        run_step(&mut s, &p, 9);
        s.add("quiet-1".into(), vec![4, 5, 6], tenant("quiet"), 0);
        // 3 against 1 still leaves the flood with at least the quiet tenant's share after a swap.
        let p = s.schedule();
        assert_eq!(p.preempted, vec!["flood-2".to_string()]);
        assert_eq!(p.newly_admitted, vec!["quiet-1".to_string()]);
        run_step(&mut s, &p, 9);
        // 2 and 2: nothing moves back, though the flood's requests wait.
        let p = s.schedule();
        assert!(p.preempted.is_empty() && p.newly_admitted.is_empty(), "{p:?}");
        assert_eq!((s.num_running(), s.num_waiting()), (4, 4));
        // A weight-3 tenant keeps three places against a weight-1 one.
        let mut s = fair(256, 100, 4);
        for i in 0..6 {
            s.add_with(format!("gold-{i}"), vec![1, 2, 3], tenant("gold"), weight(3));
        }
        let p = s.schedule();
        run_step(&mut s, &p, 9);
        s.add("plain-0".into(), vec![4, 5, 6], tenant("plain"), 0);
        let p = s.schedule();
        assert_eq!(p.newly_admitted, vec!["plain-0".to_string()], "(4-1)/3 >= (0+1)/1");
        run_step(&mut s, &p, 9);
        s.add("plain-1".into(), vec![4, 5, 6], tenant("plain"), 0);
        let p = s.schedule();
        assert!(p.preempted.is_empty(), "(3-1)/3 < (1+1)/1: {p:?}");
        // First come, first served makes no room for anybody.
        let mut f = sched(256, 100, 4);
        for i in 0..6 {
            f.add(format!("flood-{i}"), vec![1, 2, 3], tenant("flood"), 0);
        }
        let p = f.schedule();
        run_step(&mut f, &p, 9);
        f.add("quiet-0".into(), vec![4, 5, 6], tenant("quiet"), 0);
        let p = f.schedule();
        assert!(p.preempted.is_empty() && p.newly_admitted.is_empty(), "{p:?}");
    }

    #[test]
    fn the_place_made_goes_to_the_request_it_was_made_for() {
        use crate::serve::fair::{FairConfig, Vtc};
        // The flood's requests are long past the starvation bound, so a preempted one would be
        // the policy's next choice: the place still goes to the quiet request, and the victim
        // waits until a place frees.
        let config = FairConfig { starvation_steps: 3, ..FairConfig::default() };
        let mut s = Scheduler::new(
            SchedulerConfig { max_num_batched_tokens: 100, max_num_seqs: 4 },
            KvManager::new(256, 4, vec![]),
            Box::new(Vtc::new(config)),
        );
        for i in 0..4 {
            s.add(format!("flood-{i}"), vec![1, 2, 3], tenant("flood"), 0);
        }
        for _ in 0..5 {
            let p = s.schedule();
            run_step(&mut s, &p, 9);
        }
        s.add("quiet-0".into(), vec![4, 5, 6], tenant("quiet"), 0);
        let p = s.schedule();
        assert_eq!(
            (p.preempted.clone(), p.newly_admitted.clone()),
            (vec!["flood-3".into()], vec!["quiet-0".into()])
        );
        run_step(&mut s, &p, 9);
        for _ in 0..5 {
            let p = s.schedule();
            assert!(p.preempted.is_empty() && p.newly_admitted.is_empty(), "{p:?}");
            assert!(p.batch_full, "flood-3 waits for a full batch");
            run_step(&mut s, &p, 9);
        }
        s.remove("flood-0");
        let p = s.schedule();
        assert_eq!(p.newly_admitted, Vec::<String>::new(), "flood-3 was admitted before");
        assert_eq!(p.scheduled.iter().filter(|x| x.id == "flood-3").count(), 1);
    }

    #[test]
    fn aborting_anywhere_frees_everything() {
        let mut s = sched(16, 5, 4);
        s.add("a".into(), (0..9).collect(), tenant("t"), 0);
        s.add("b".into(), (0..9).collect(), tenant("u"), 0);
        let p = s.schedule();
        run_step(&mut s, &p, 1);
        assert!(s.blocks().0 < 16);
        s.remove("a");
        s.remove("b");
        assert_eq!(s.blocks(), (16, 16));
        assert!(!s.has_work());
    }
}
#[cfg(test)]
mod sim {
    //! A simulated engine: the real scheduler, the step-time law `sluice up` fitted on this
    //! 2-core machine (3.4 ms + 2.3 ms per token + 0.9 us per context token read), open-loop
    //! arrivals at fixed intervals, each tenant capped in flight as the gateway would.
    //! Deterministic: properties of the scheduler, not of a machine's speed.
    use super::*;
    use crate::serve::fair::{FairConfig, Vtc};

    /// Seconds of simulated load before requests count.
    const WARM: f64 = 30.0;

    pub(super) struct Tenant {
        pub name: &'static str,
        pub every: f64,
        pub cap: usize,
        pub weight: u32,
        pub priority: i32,
        pub tpot: Option<f64>,
    }

    /// Per tenant: sorted TTFTs and TPOTs (seconds), and output tokens served.
    pub(super) fn run(
        tenants: &[Tenant],
        seconds: f64,
        fair: bool,
    ) -> Vec<(Vec<f64>, Vec<f64>, usize)> {
        let law = |tokens: usize, context: usize| {
            0.0034 + 0.0023 * tokens as f64 + 0.000_000_9 * context as f64
        };
        let waiting: Box<dyn WaitingPolicy> = if fair {
            Box::new(Vtc::new(FairConfig::default()))
        } else {
            Box::new(Fcfs::default())
        };
        let mut s = Scheduler::new(
            SchedulerConfig { max_num_batched_tokens: 512, max_num_seqs: 64 },
            KvManager::new(8192, 16, vec![]),
            waiting,
        );
        let mut next: Vec<f64> = tenants.iter().enumerate().map(|(i, _)| 0.1 * i as f64).collect();
        let mut live: HashMap<String, (usize, f64, Option<f64>, usize)> = HashMap::new();
        let mut out = vec![(Vec::new(), Vec::new(), 0); tenants.len()];
        let mut t = 0.0;
        let mut n = 0u32;
        while t < seconds {
            for (i, tn) in tenants.iter().enumerate() {
                // The last 30 s let what arrived finish.
                while next[i] <= t && t < seconds - 30.0 {
                    let inflight = live.values().filter(|v| v.0 == i).count();
                    if inflight < tn.cap {
                        n += 1;
                        let id = format!("{}-{n}", tn.name);
                        let prompt: Vec<u32> = (0..128).map(|k| n * 1000 + k).collect();
                        let policy = SeqPolicy {
                            priority: tn.priority,
                            weight: tn.weight,
                            tpot_target: tn.tpot,
                        };
                        s.add_with(id.clone(), prompt, CacheScope::Tenant(tn.name.into()), policy);
                        live.insert(id, (i, next[i], None, 0));
                    }
                    next[i] += tn.every;
                }
            }
            let plan = s.schedule();
            if plan.scheduled.is_empty() {
                t += 0.01;
                continue;
            }
            let tokens: usize = plan.scheduled.iter().map(|w| w.len).sum();
            let context: usize = plan.scheduled.iter().map(|w| w.start + w.len).sum();
            let dt = law(tokens, context);
            let decoding = plan
                .scheduled
                .iter()
                .filter(|w| w.len == 1 && s.seq(&w.id).is_some_and(|q| w.start >= q.prompt_len))
                .count();
            let seqs = plan.scheduled.len();
            let shape = crate::serve::step_model::StepShape { tokens, context, seqs, decoding };
            s.observe_step(shape, dt);
            t += dt;
            let mut done = Vec::new();
            for w in &plan.scheduled {
                s.mark_computed(&w.id, w.len);
                let Some(q) = s.seq(&w.id) else { continue };
                if q.computed == q.tokens.len() {
                    s.append_token(&w.id, 7);
                    if let Some(l) = live.get_mut(&w.id) {
                        l.2.get_or_insert(t);
                        l.3 += 1;
                        if l.3 == 64 {
                            done.push(w.id.clone());
                        }
                    }
                }
            }
            for id in done {
                s.remove(&id);
                // Requests that arrived while the step-time model was still learning the
                // machine are left out.
                if let Some((i, arrived, Some(first), _)) = live.remove(&id)
                    && arrived >= WARM
                {
                    out[i].0.push(first - arrived);
                    out[i].1.push((t - first) / 63.0);
                    out[i].2 += 64;
                }
            }
        }
        for o in &mut out {
            o.0.sort_by(f64::total_cmp);
            o.1.sort_by(f64::total_cmp);
        }
        out
    }

    pub(super) fn pct(v: &[f64], p: f64) -> f64 {
        v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(f64::NAN)
    }

    fn summary(name: &str, r: &(Vec<f64>, Vec<f64>, usize)) -> String {
        format!(
            "{name}: {} requests, TTFT p50 {:.3} p99 {:.3} s, TPOT p50 {:.3} p99 {:.3} s, {} tokens",
            r.0.len(),
            pct(&r.0, 0.5),
            pct(&r.0, 0.99),
            pct(&r.1, 0.5),
            pct(&r.1, 0.99),
            r.2
        )
    }

    fn standard(name: &'static str, every: f64) -> Tenant {
        Tenant { name, every, cap: 32, weight: 2, priority: 0, tpot: Some(0.1) }
    }

    #[test]
    fn a_quiet_tenant_keeps_its_latency_beside_a_flood() {
        // The mix: a quiet tenant at 0.5 requests/s, a noisy one at 5 (its
        // concurrency cap of 32 refusing the rest), 128 prompt and 64 output tokens each.
        let alone = run(&[standard("quiet", 2.0)], 300.0, true);
        let noisy_alone = run(&[standard("noisy", 0.2)], 300.0, true);
        let fair = run(&[standard("quiet", 2.0), standard("noisy", 0.2)], 300.0, true);
        let fcfs = run(&[standard("quiet", 2.0), standard("noisy", 0.2)], 300.0, false);
        let report = [
            summary("quiet alone", &alone[0]),
            summary("noisy alone", &noisy_alone[0]),
            summary("quiet beside noisy", &fair[0]),
            summary("noisy beside quiet", &fair[1]),
            summary("quiet beside noisy, FCFS", &fcfs[0]),
        ]
        .join("\n");
        // Every quiet request is served, ahead of the flood's backlog (under FCFS it queues
        // behind it), and every TPOT stays within the 100 ms target. (Its TTFT beside the
        // flood is still a few times its solo value: the 1.2x is not met.)
        assert_eq!(fair[0].0.len(), alone[0].0.len(), "{report}");
        assert!(pct(&fcfs[0].0, 0.5) > 5.0 * pct(&fair[0].0, 0.99), "{report}");
        for r in [&fair[0], &fair[1]] {
            assert!(pct(&r.1, 0.99) <= 0.1, "{report}");
        }
        // The flood gets at least 80% of what the quiet tenant leaves.
        let left = noisy_alone[0].2 as f64 - fair[0].2 as f64;
        assert!(fair[1].2 as f64 >= 0.8 * left, "{report}");
    }

    #[test]
    fn two_floods_share_by_weight() {
        let gold =
            Tenant { name: "gold", every: 0.15, cap: 32, weight: 2, priority: 0, tpot: Some(0.1) };
        let plain =
            Tenant { name: "plain", every: 0.15, cap: 32, weight: 1, priority: 0, tpot: Some(0.2) };
        let r = run(&[gold, plain], 300.0, true);
        let (g, p) = (r[0].2 as f64, r[1].2 as f64);
        let report = [summary("gold", &r[0]), summary("plain", &r[1])].join("\n");
        assert!((g / p - 2.0).abs() <= 0.3, "weight 2 against 1: {g} to {p}\n{report}");
        let equal = run(&[standard("a", 0.15), standard("b", 0.15)], 300.0, true);
        let (a, b) = (equal[0].2 as f64, equal[1].2 as f64);
        assert!((a / (a + b) - 0.5).abs() <= 0.1, "equal weights: {a} to {b}");
    }

    #[test]
    fn a_higher_priority_goes_ahead_of_a_lower_priority_flood() {
        let ent = || Tenant {
            name: "ent",
            every: 2.0,
            cap: 256,
            weight: 4,
            priority: 1,
            tpot: Some(0.05),
        };
        let alone = run(&[ent()], 300.0, true);
        let mixed = run(&[ent(), standard("flood", 0.2)], 300.0, true);
        let fcfs = run(&[ent(), standard("flood", 0.2)], 300.0, false);
        let report = [
            summary("alone", &alone[0]),
            summary("beside a flood", &mixed[0]),
            summary("beside a flood, FCFS", &fcfs[0]),
        ]
        .join("\n");
        assert_eq!(mixed[0].0.len(), alone[0].0.len(), "{report}");
        assert!(pct(&fcfs[0].0, 0.5) > 5.0 * pct(&mixed[0].0, 0.99), "{report}");
    }
}
