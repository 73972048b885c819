//! Tenant-fair ordering of waiting requests: the Virtual Token Counter of Sheng et al.,
//! "Fairness in Serving Large Language Models" (OSDI 2024).
//!
//! Each tenant has a counter of the service it has received: prefill and decode tokens,
//! weighted separately ([`FairConfig`]), divided by the tenant's weight (its tier's). The next
//! request admitted is the oldest of the tenant with the smallest counter, so a tenant that
//! floods the engine waits behind one that sends little. Rules around that core:
//!
//! - **Priorities are strict bands** above it: a request of a higher priority goes first
//!   whatever the counters; within a band the counters decide.
//! - **No banked credit.** A tenant that had nothing waiting and returns has its counter lifted
//!   to the smallest counter of the tenants waiting (or, when none waits, to the counter of the
//!   last tenant whose queue emptied), so an idle hour is not a right to the next hour alone.
//! - **A starvation bound.** A request that has waited more than `starvation_steps` scheduler
//!   steps goes first (the oldest such first), across tenants and bands.
//!
//! Service is counted for running requests as each step computes their tokens
//! ([`WaitingPolicy::served`]), so a tenant's long generations raise its counter while they
//! run. Plain synchronous state, tested without threads or a model.

use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};

use crate::serve::scheduler::{Waiter, WaitingPolicy};

/// The weights and bounds of the fair policy.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FairConfig {
    /// Service per prefill token.
    pub prefill_weight: f64,
    /// Service per decode token (the paper's default: twice a prefill token).
    pub decode_weight: f64,
    /// A request waiting longer than this many steps goes first.
    pub starvation_steps: u64,
}

impl Default for FairConfig {
    fn default() -> Self {
        FairConfig { prefill_weight: 1.0, decode_weight: 2.0, starvation_steps: 2_000 }
    }
}

/// One waiting request.
#[derive(Clone, Debug)]
struct Entry {
    id: String,
    /// The step at which it (last) started waiting.
    since: u64,
    /// Arrival order among all waiting requests (ties go to the earlier).
    seq: u64,
}

/// How often (in steps) counters of tenants that would be lifted anyway are dropped.
const PRUNE_EVERY: u64 = 1024;

/// The Virtual Token Counter waiting policy (see the module docs).
#[derive(Debug, Default)]
pub struct Vtc {
    config: FairConfig,
    /// Service received per tenant, in weighted tokens over the tenant's weight.
    counters: HashMap<String, f64>,
    /// Waiting requests by priority band, then tenant, oldest first.
    bands: BTreeMap<i32, HashMap<String, VecDeque<Entry>>>,
    /// Each waiting request's (priority, tenant), for removal by id.
    index: HashMap<String, (i32, String)>,
    /// The step at which each live request first started waiting (kept across preemptions,
    /// so the starvation bound counts from the first wait).
    first_wait: HashMap<String, u64>,
    /// Admitted requests and their tenants: a tenant still running keeps its counter.
    running: HashMap<String, String>,
    /// The counter of the tenant whose queue emptied last (the lift when nobody waits).
    last_left: f64,
    /// Steps so far.
    step: u64,
    /// Requests queued so far.
    pushed: u64,
}

impl Vtc {
    /// An empty queue with these weights and bounds.
    pub fn new(config: FairConfig) -> Self {
        Vtc { config, ..Vtc::default() }
    }

    /// A tenant's counter (0 for one never seen).
    pub fn counter(&self, tenant: &str) -> f64 {
        self.counters.get(tenant).copied().unwrap_or(0.0)
    }

    /// Whether `tenant` has a request waiting in any band.
    fn waits(&self, tenant: &str) -> bool {
        self.bands.values().any(|b| b.get(tenant).is_some_and(|q| !q.is_empty()))
    }

    /// The smallest counter among the tenants waiting.
    fn min_waiting(&self) -> Option<f64> {
        self.bands
            .values()
            .flat_map(|b| b.iter().filter(|(_, q)| !q.is_empty()))
            .map(|(t, _)| self.counter(t))
            .min_by(f64::total_cmp)
    }

    /// The band and tenant whose front request goes next.
    fn choose(&self) -> Option<(i32, &str)> {
        let queues = self.bands.iter().flat_map(|(p, b)| {
            b.iter().filter_map(move |(t, q)| Some((*p, t, q.front()?, q.len())))
        });
        // The starvation bound first: the oldest request past it.
        let bound = self.config.starvation_steps;
        let starved = queues
            .clone()
            .filter(|(_, _, e, _)| self.step.saturating_sub(e.since) > bound)
            .min_by_key(|(_, _, e, _)| (e.since, e.seq));
        if let Some((p, t, ..)) = starved {
            return Some((p, t.as_str()));
        }
        // Else the highest band; in it the smallest counter. Ties (a tenant just lifted to
        // another's level) go to the shorter queue, then to the older request.
        let top = *self.bands.iter().rev().find(|(_, b)| b.values().any(|q| !q.is_empty()))?.0;
        queues
            .filter(|(p, ..)| *p == top)
            .min_by(|a, b| {
                let key = |q: &(i32, &String, &Entry, usize)| (self.counter(q.1), q.3, q.2.seq);
                let (x, y) = (key(a), key(b));
                x.0.total_cmp(&y.0).then(x.1.cmp(&y.1)).then(x.2.cmp(&y.2))
            })
            .map(|(p, t, ..)| (p, t.as_str()))
    }

    fn enqueue(&mut self, w: Waiter, front: bool) {
        if !self.waits(&w.tenant) {
            let floor = self.min_waiting().unwrap_or(self.last_left);
            let c = self.counters.entry(w.tenant.clone()).or_insert(0.0);
            *c = c.max(floor);
        }
        self.pushed += 1;
        self.running.remove(&w.id);
        let since = *self.first_wait.entry(w.id.clone()).or_insert(self.step);
        let entry = Entry { id: w.id.clone(), since, seq: self.pushed };
        let queue = self.bands.entry(w.priority).or_default().entry(w.tenant.clone()).or_default();
        if front {
            queue.push_front(entry);
        } else {
            queue.push_back(entry);
        }
        self.index.insert(w.id, (w.priority, w.tenant));
    }

    /// Drops the queue of `tenant` in band `priority` once it is empty, noting its counter.
    fn tidy(&mut self, priority: i32, tenant: &str) {
        let Some(band) = self.bands.get_mut(&priority) else { return };
        if band.get(tenant).is_some_and(VecDeque::is_empty) {
            band.remove(tenant);
            if !self.waits(tenant) {
                self.last_left = self.counter(tenant);
            }
        }
        if self.bands.get(&priority).is_some_and(HashMap::is_empty) {
            self.bands.remove(&priority);
        }
    }

    /// Forgets counters that a return from idle would lift anyway (bounded memory); those of
    /// tenants waiting or running stay.
    fn prune(&mut self) {
        let floor = self.min_waiting().unwrap_or(self.last_left);
        let mut live: HashSet<String> =
            self.bands.values().flat_map(|b| b.keys().cloned()).collect();
        live.extend(self.running.values().cloned());
        self.counters.retain(|t, c| *c > floor || live.contains(t));
    }
}

impl WaitingPolicy for Vtc {
    fn push(&mut self, w: Waiter) {
        self.enqueue(w, false);
    }

    fn shares_places(&self) -> bool {
        true
    }

    fn push_front(&mut self, w: Waiter) {
        self.enqueue(w, true);
    }

    fn peek(&self) -> Option<&str> {
        let (p, t) = self.choose()?;
        self.bands.get(&p)?.get(t)?.front().map(|e| e.id.as_str())
    }

    fn pop(&mut self) -> Option<String> {
        let (p, t) = self.choose()?;
        let t = t.to_owned();
        let entry = self.bands.get_mut(&p)?.get_mut(&t)?.pop_front()?;
        self.index.remove(&entry.id);
        self.running.insert(entry.id.clone(), t.clone());
        self.tidy(p, &t);
        Some(entry.id)
    }

    fn take(&mut self, id: &str) -> bool {
        let Some((p, t)) = self.index.get(id).cloned() else { return false };
        let Some(q) = self.bands.get_mut(&p).and_then(|b| b.get_mut(&t)) else { return false };
        // Wherever it stands in its tenant's queue (it is the front one when made room for).
        let Some(at) = q.iter().position(|e| e.id == id) else { return false };
        q.remove(at);
        self.index.remove(id);
        self.running.insert(id.to_owned(), t.clone());
        self.tidy(p, &t);
        true
    }

    fn remove(&mut self, id: &str) -> bool {
        // The request is gone for good (finished or aborted), whether it waited or ran.
        self.first_wait.remove(id);
        self.running.remove(id);
        let Some((p, t)) = self.index.remove(id) else { return false };
        if let Some(q) = self.bands.get_mut(&p).and_then(|b| b.get_mut(&t)) {
            q.retain(|e| e.id != id);
        }
        self.tidy(p, &t);
        true
    }

    fn len(&self) -> usize {
        self.index.len()
    }

    fn served(&mut self, tenant: &str, weight: u32, prefill: usize, decode: usize) {
        let cost =
            self.config.prefill_weight * prefill as f64 + self.config.decode_weight * decode as f64;
        *self.counters.entry(tenant.to_owned()).or_insert(0.0) += cost / f64::from(weight.max(1));
    }

    fn standing(&self, tenant: &str) -> f64 {
        self.counter(tenant)
    }

    fn tick(&mut self) {
        self.step += 1;
        if self.step.is_multiple_of(PRUNE_EVERY) {
            self.prune();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiter(id: &str, tenant: &str, priority: i32) -> Waiter {
        Waiter { id: id.into(), tenant: tenant.into(), priority, weight: 1 }
    }

    /// Pops everything, serving each popped request `tokens` decode tokens.
    fn drain(v: &mut Vtc, tokens: usize) -> Vec<String> {
        let mut out = Vec::new();
        while let Some(id) = v.pop() {
            let tenant = id.split('-').next().unwrap_or_default().to_owned();
            v.served(&tenant, 1, 0, tokens);
            out.push(id);
        }
        out
    }

    #[test]
    fn the_tenant_served_least_goes_first() {
        let mut v = Vtc::new(FairConfig::default());
        for i in 0..4 {
            v.push(waiter(&format!("noisy-{i}"), "noisy", 0));
        }
        v.push(waiter("quiet-0", "quiet", 0));
        // Both start level: the shorter queue (quiet's) first, then noisy's backlog.
        assert_eq!(drain(&mut v, 10), ["quiet-0", "noisy-0", "noisy-1", "noisy-2", "noisy-3"]);
        // Noisy was served 40 decode tokens, quiet 10. Quiet's return lifts it to noisy's
        // level (no banked credit); level, the shorter queue goes first, and then they
        // alternate as each is served alike.
        for i in 4..7 {
            v.push(waiter(&format!("noisy-{i}"), "noisy", 0));
        }
        v.push(waiter("quiet-1", "quiet", 0));
        v.push(waiter("quiet-2", "quiet", 0));
        assert_eq!(v.counter("quiet"), v.counter("noisy"));
        assert_eq!(drain(&mut v, 10), ["quiet-1", "noisy-4", "quiet-2", "noisy-5", "noisy-6"]);
    }

    #[test]
    fn weights_divide_service() {
        let mut v = Vtc::new(FairConfig::default());
        v.served("gold", 2, 100, 0);
        v.served("plain", 1, 100, 0);
        assert_eq!(v.counter("gold"), 50.0);
        assert_eq!(v.counter("plain"), 100.0);
        assert_eq!(v.counter("never"), 0.0);
        // Decode tokens weigh twice a prefill token.
        v.served("plain", 1, 0, 10);
        assert_eq!(v.counter("plain"), 120.0);
    }

    #[test]
    fn a_tenant_back_from_idle_banks_no_credit() {
        let mut v = Vtc::new(FairConfig::default());
        v.push(waiter("a-0", "a", 0));
        assert_eq!(v.pop().as_deref(), Some("a-0"));
        v.served("a", 1, 1000, 0);
        v.push(waiter("a-1", "a", 0));
        // b never ran; lifted to the smallest waiting counter (a's 1000), not left at 0.
        v.push(waiter("b-0", "b", 0));
        assert_eq!(v.counter("b"), 1000.0);
        // When nobody waits, the lift is to the last tenant whose queue emptied.
        assert_eq!(drain(&mut v, 0), ["a-1", "b-0"]);
        v.push(waiter("c-0", "c", 0));
        assert_eq!(v.counter("c"), 1000.0);
    }

    #[test]
    fn priorities_are_strict_bands() {
        let mut v = Vtc::new(FairConfig::default());
        v.served("big", 1, 0, 10_000);
        v.push(waiter("small-0", "small", 0));
        v.push(waiter("big-0", "big", 1));
        // big has used far more, but its priority band goes first.
        assert_eq!(drain(&mut v, 0), ["big-0", "small-0"]);
    }

    #[test]
    fn the_starvation_bound_overrides_counters_and_bands() {
        let mut v = Vtc::new(FairConfig { starvation_steps: 3, ..FairConfig::default() });
        v.push(waiter("low-0", "low", -1));
        for _ in 0..3 {
            v.tick();
        }
        v.push(waiter("high-0", "high", 5));
        assert_eq!(v.peek(), Some("high-0"), "within the bound the band decides");
        v.tick();
        assert_eq!(v.peek(), Some("low-0"), "past the bound the oldest goes first");
    }

    #[test]
    fn preempted_requests_go_first_in_their_queue_and_removal_is_anywhere() {
        let mut v = Vtc::new(FairConfig::default());
        v.push(waiter("a-1", "a", 0));
        v.push_front(waiter("a-0", "a", 0));
        v.push(waiter("b-0", "b", 0));
        assert!(v.remove("b-0"));
        assert!(!v.remove("b-0"));
        assert_eq!(v.len(), 2);
        assert_eq!(drain(&mut v, 1), ["a-0", "a-1"]);
        assert!(v.is_empty());
    }

    #[test]
    fn a_preempted_request_keeps_its_first_wait_for_the_starvation_bound() {
        let mut v = Vtc::new(FairConfig { starvation_steps: 5, ..FairConfig::default() });
        v.push(waiter("heavy-0", "heavy", 0));
        assert_eq!(v.pop().as_deref(), Some("heavy-0"));
        v.served("heavy", 1, 0, 1000);
        for _ in 0..4 {
            v.tick();
        }
        v.push(waiter("light-0", "light", 0));
        // heavy-0 is preempted back to the front of heavy's queue; it first waited at step 0,
        // so two steps later it is past the bound, though light has the smaller counter.
        v.push_front(waiter("heavy-0", "heavy", 0));
        assert_eq!(v.peek(), Some("light-0"));
        v.tick();
        v.tick();
        assert_eq!(v.peek(), Some("heavy-0"));
    }

    #[test]
    fn a_running_tenants_counter_survives_pruning() {
        let mut v = Vtc::new(FairConfig::default());
        v.push(waiter("run-0", "run", 0));
        assert_eq!(v.pop().as_deref(), Some("run-0"));
        v.served("run", 1, 10, 0);
        v.push(waiter("w-0", "w", 0));
        v.served("w", 1, 50, 0);
        for _ in 0..PRUNE_EVERY {
            v.tick();
        }
        // run's 10 is below the waiting floor (w's 50), but run-0 is still running.
        assert_eq!(v.counter("run"), 10.0);
        v.remove("run-0");
        for _ in 0..PRUNE_EVERY {
            v.tick();
        }
        assert_eq!(v.counter("run"), 0.0, "forgotten once it no longer runs");
    }

    #[test]
    fn counters_that_a_return_would_lift_are_forgotten() {
        let mut v = Vtc::new(FairConfig::default());
        for t in 0..100 {
            v.served(&format!("t{t}"), 1, t, 0);
        }
        v.push(waiter("w-0", "w", 0));
        v.served("w", 1, 50, 0);
        for _ in 0..PRUNE_EVERY {
            v.tick();
        }
        // Only counters above the waiting minimum (w's 50) survive, and w's own.
        assert!(v.counters.len() <= 50, "{} counters", v.counters.len());
        assert_eq!(v.counter("w"), 50.0);
        assert_eq!(v.counter("t99"), 99.0);
    }
}
