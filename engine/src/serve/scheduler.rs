//! Continuous batching in the manner of vLLM v1: one token budget per step, running requests
//! first, chunked prefill, a cap on running sequences, preemption by recompute when blocks
//! run out. Plain synchronous state, tested without threads or a model.

use std::collections::{HashMap, VecDeque};

use crate::serve::CacheScope;
use crate::serve::kv_manager::KvManager;

/// Scheduler limits.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Tokens computed per step, all requests together.
    pub max_num_batched_tokens: usize,
    /// Requests in the running batch.
    pub max_num_seqs: usize,
}

/// The order in which waiting requests are admitted.
pub trait WaitingPolicy: std::fmt::Debug + Send {
    /// A new request.
    fn push(&mut self, id: String, priority: i32);
    /// A preempted request, to go before the others.
    fn push_front(&mut self, id: String, priority: i32);
    /// The next request to admit.
    fn peek(&self) -> Option<&str>;
    /// Removes the request [`peek`](Self::peek) returned.
    fn pop(&mut self) -> Option<String>;
    /// Removes a request wherever it is (abort).
    fn remove(&mut self, id: &str) -> bool;
    /// Number waiting.
    fn len(&self) -> usize;
    /// Whether none wait.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// First come, first served (tenant-fair policies implement the same trait).
#[derive(Debug, Default)]
pub struct Fcfs {
    queue: VecDeque<String>,
}

impl WaitingPolicy for Fcfs {
    fn push(&mut self, id: String, _priority: i32) {
        self.queue.push_back(id);
    }
    fn push_front(&mut self, id: String, _priority: i32) {
        self.queue.push_front(id);
    }
    fn peek(&self) -> Option<&str> {
        self.queue.front().map(String::as_str)
    }
    fn pop(&mut self) -> Option<String> {
        self.queue.pop_front()
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
    /// Priority (higher first; lowest preempted first).
    pub priority: i32,
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
}

impl Scheduler {
    /// A scheduler over `kv` with the given waiting policy.
    pub fn new(
        config: SchedulerConfig,
        kv: KvManager,
        waiting: Box<dyn WaitingPolicy>,
    ) -> Scheduler {
        Scheduler { config, waiting, running: Vec::new(), seqs: HashMap::new(), kv, next_seq: 0 }
    }

    /// The KV manager (block tables).
    pub fn kv(&self) -> &KvManager {
        &self.kv
    }

    /// Queues a request.
    pub fn add(&mut self, id: String, prompt: Vec<u32>, scope: CacheScope, priority: i32) {
        self.next_seq += 1;
        let st = SeqState {
            prompt_len: prompt.len(),
            tokens: prompt,
            computed: 0,
            cached_prompt: 0,
            scope,
            priority,
            seq_no: self.next_seq,
            preemptions: 0,
            admitted: false,
        };
        self.seqs.insert(id.clone(), st);
        self.waiting.push(id, priority);
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

    /// Records that a step computed `len` more tokens of `id`, and caches full blocks.
    pub fn mark_computed(&mut self, id: &str, len: usize) {
        if let Some(s) = self.seqs.get_mut(id) {
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
        plan
    }

    fn pick_victim(&self) -> Option<String> {
        self.running
            .iter()
            .filter_map(|id| self.seqs.get(id).map(|s| (id, s.priority, s.seq_no)))
            .min_by(|a, b| a.1.cmp(&b.1).then(b.2.cmp(&a.2)))
            .map(|(id, _, _)| id.clone())
    }

    fn preempt(&mut self, id: &str, plan: &mut StepPlan) {
        self.running.retain(|r| r != id);
        self.kv.free_blocks_keep_hashes(id);
        if let Some(s) = self.seqs.get_mut(id) {
            s.computed = 0;
            s.preemptions += 1;
            self.waiting.push_front(id.to_string(), s.priority);
        }
        plan.preempted.push(id.to_string());
    }

    fn admit_waiting(&mut self, budget: &mut usize, plan: &mut StepPlan) {
        while *budget > 0 && self.running.len() < self.config.max_num_seqs {
            let Some(id) = self.waiting.peek().map(str::to_string) else { break };
            let Some(s) = self.seqs.get(&id) else {
                self.waiting.pop();
                continue;
            };
            let n = s.tokens.len();
            // At least one token is always computed, so a fully cached prompt still yields
            // logits: hits cover at most n - 1 tokens.
            let scope = s.scope.clone();
            let tokens = s.tokens.clone();
            let hits = self.kv.find_prefix(&id, &tokens, &scope, n.saturating_sub(1));
            let hit_tokens = hits.len() * self.kv.block_size();
            let len = (n - hit_tokens).min(*budget);
            if !self.kv.allocate(&id, &hits, hit_tokens + len) {
                break;
            }
            self.waiting.pop();
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
        let mut preempted = Vec::new();
        for step in 0..6 {
            let p = s.schedule();
            preempted.extend(p.preempted.clone());
            run_step(&mut s, &p, 7 + step);
            if !preempted.is_empty() {
                break;
            }
        }
        assert_eq!(preempted, vec!["new".to_string()]);
        assert_eq!(s.seq("new").map(|q| (q.computed, q.preemptions)), Some((0, 1)));
        assert_eq!(s.num_waiting(), 1);
        s.remove("old");
        s.remove("new");
        assert_eq!(s.blocks(), (4, 4), "every block is free again");
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
