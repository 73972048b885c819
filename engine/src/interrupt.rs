//! Strict bands inside a step: a request that arrives while a step carrying lower priorities
//! is running interrupts it between two layers of the CPU pass, so it waits for a layer, not
//! for a step of a flood's decodes and prefill chunks. Within a band the same holds against a
//! tenant that [dominates] the arrival's: one holding more than twice the running places per
//! unit of weight that the arrival's tenant holds with it (a flood against a quiet tenant,
//! never two tenants near their shares). A pass that carries a prefill the arrival does not
//! outrank that way (its own tenant's, or a higher band's) runs whole: cutting it would throw
//! away the very work the arrival waits beside, and two arrivals close together would
//! prefill twice. The interrupted step leaves nothing behind: its
//! tokens are not marked computed and nothing is sampled, so the next plan computes them
//! again (the K/V written for them so far is written again, the same).
//!
//! A GPU pass runs whole: it never looks at the flag.

use std::collections::HashMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The share of a pass after which it finishes anyway: an interrupt then would waste more
/// than it saves the arrival.
const LAST_SHARE: (usize, usize) = (3, 4);

/// How many times a tenant's running places per unit of weight must exceed another's (that
/// one's counted with its new request) for it to give way in their band.
pub const DOMINANCE: f64 = 2.0;

/// Whether a tenant of `load` (running places per unit of weight) gives way in its band to
/// a request of a tenant whose load, its request counted, is `other`.
pub fn dominates(load: f64, other: f64) -> bool {
    load > DOMINANCE * other
}

/// The step running, as arrivals judge it.
#[derive(Debug, Default)]
struct Running {
    /// The heaviest load among the step's requests of its lowest priority.
    band_load: f64,
    /// Every tenant's running places per unit of weight.
    loads: HashMap<String, f64>,
    /// The priority and tenant of each prefill in the step.
    prefills: Vec<(i32, String)>,
}

/// The lowest priority in the step running, who runs, and whether an arrival that outranks
/// it has come since it began.
#[derive(Debug)]
pub struct Interrupt {
    /// The lowest priority in the running step (`i32::MAX`: none runs).
    running: AtomicI32,
    raised: AtomicBool,
    /// The last pass was interrupted: the next runs whole.
    last_cut: AtomicBool,
    step: Mutex<Running>,
}

impl Default for Interrupt {
    fn default() -> Self {
        Interrupt {
            running: AtomicI32::new(i32::MAX),
            raised: AtomicBool::new(false),
            last_cut: AtomicBool::new(false),
            step: Mutex::default(),
        }
    }
}

impl Interrupt {
    /// A request of `priority` for `tenant` (of `weight`) has been queued: it interrupts the
    /// running step if that carries a lower priority, or in its band a tenant that
    /// [dominates] the arrival's. (One queued while a step is being planned, before
    /// [`begin`](Self::begin), waits for that step: it is not in it.)
    pub fn arrive(&self, priority: i32, tenant: &str, weight: u32) {
        let lowest = self.running.load(Ordering::Acquire);
        if priority < lowest {
            return;
        }
        let step = self.step.lock().unwrap_or_else(|e| e.into_inner());
        let load = |t: &str| step.loads.get(t).copied().unwrap_or(0.0);
        let own = load(tenant) + 1.0 / f64::from(weight.max(1));
        let outranks = priority > lowest || dominates(step.band_load, own);
        // Every prefill in the pass gives way to it: a lower band's, or in its band another
        // tenant's that dominates its own.
        let prefills_give_way = step.prefills.iter().all(|(p, t)| {
            priority > *p || priority == *p && t != tenant && dominates(load(t), own)
        });
        if outranks && prefills_give_way {
            self.raised.store(true, Ordering::Release);
        }
    }

    /// A step begins whose lowest priority is `lowest`, the heaviest load among its requests
    /// of that priority `band_load`, with the tenants' running places per unit of weight
    /// `loads` and its `prefills` (priority and tenant of each). Never two passes running are
    /// interrupted: the one after an interrupted pass runs whole, so arrivals faster than the
    /// steps cannot stop the engine (the higher band's own decodes included).
    pub fn begin(
        &self,
        lowest: i32,
        band_load: f64,
        loads: HashMap<String, f64>,
        prefills: Vec<(i32, String)>,
    ) {
        *self.step.lock().unwrap_or_else(|e| e.into_inner()) =
            Running { band_load, loads, prefills };
        let lowest = if self.last_cut.load(Ordering::Acquire) { i32::MAX } else { lowest };
        self.raised.store(false, Ordering::Release);
        self.running.store(lowest, Ordering::Release);
    }

    /// The step has ended, `cut` short or whole.
    pub fn end(&self, cut: bool) {
        self.running.store(i32::MAX, Ordering::Release);
        self.raised.store(false, Ordering::Release);
        self.last_cut.store(cut, Ordering::Release);
    }

    /// Whether the pass, `done` of its `layers` layers behind it, stops here: an arrival has
    /// outranked it, and at least one layer and less than three quarters of the pass are done.
    pub fn stops(&self, done: usize, layers: usize) -> bool {
        done > 0
            && done * LAST_SHARE.1 < layers * LAST_SHARE.0
            && self.raised.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loads(of: &[(&str, f64)]) -> HashMap<String, f64> {
        of.iter().map(|(t, l)| (t.to_string(), *l)).collect()
    }

    #[test]
    fn only_a_higher_priority_or_a_dominated_tenant_interrupts_early_in_the_pass() {
        let i = Interrupt::default();
        // Nothing runs: an arrival interrupts nothing.
        i.arrive(5, "a", 1);
        assert!(!i.stops(1, 8));
        // A flood's step: 20 places at weight 1, beside a quiet tenant's 2.
        i.begin(0, 20.0, loads(&[("flood", 20.0), ("quiet", 2.0)]), Vec::new());
        i.arrive(0, "flood", 1);
        assert!(!i.stops(1, 8), "the flood's own arrival waits for the step");
        i.arrive(1, "ent", 1);
        assert!(!i.stops(0, 8), "not before the first layer");
        assert!(i.stops(1, 8) && i.stops(5, 8));
        assert!(!i.stops(6, 8), "three quarters done: the pass finishes");
        i.end(false);
        assert!(!i.stops(1, 8), "a new step starts clear");
        // The quiet tenant's arrival (3 places with it, under a tenth of the flood's) does.
        i.begin(0, 20.0, loads(&[("flood", 20.0), ("quiet", 2.0)]), Vec::new());
        i.arrive(0, "quiet", 1);
        assert!(i.stops(1, 8));
        i.end(false);
        // Two tenants near their shares: neither interrupts the other in their band.
        i.begin(0, 13.0, loads(&[("a", 13.0), ("b", 11.0)]), Vec::new());
        i.arrive(0, "b", 1);
        i.arrive(0, "c", 1);
        assert!(i.stops(1, 8), "a tenant with nothing running is dominated by any of 13");
        i.end(false);
        i.begin(0, 13.0, loads(&[("a", 13.0), ("b", 11.0)]), Vec::new());
        i.arrive(0, "b", 1);
        assert!(!i.stops(1, 8));
        i.end(false);
        // A weight counts: 12 places at weight 8 are 1.5 per unit, 1.625 with the arrival.
        i.begin(0, 3.0, loads(&[("flood", 3.0), ("ent", 1.5)]), Vec::new());
        i.arrive(0, "ent", 8);
        assert!(!i.stops(1, 8), "the flood's 3 are not past twice 1.625");
        i.end(false);
        i.begin(0, 3.5, loads(&[("flood", 3.5), ("ent", 1.5)]), Vec::new());
        i.arrive(0, "ent", 8);
        assert!(i.stops(1, 8), "3.5 are");
        i.end(false);
    }

    #[test]
    fn a_pass_carrying_a_prefill_the_arrival_does_not_outrank_runs_whole() {
        let i = Interrupt::default();
        let flood = || loads(&[("flood", 20.0), ("quiet", 2.0)]);
        let prefill = |p: i32, t: &str| vec![(p, t.to_owned())];
        // The quiet tenant's own prefill beside the flood's decodes: its next arrival waits.
        i.begin(0, 20.0, flood(), prefill(0, "quiet"));
        i.arrive(0, "quiet", 1);
        assert!(!i.stops(1, 8), "its own prefill would be thrown away");
        // Another quiet tenant's, level with it: not cut either.
        i.arrive(0, "other", 1);
        assert!(!i.stops(1, 8), "a tenant it does not dominate is not cut for it");
        i.end(false);
        // The flood's chunk gives way to the quiet tenant, as its decodes do.
        i.begin(0, 20.0, flood(), prefill(0, "flood"));
        i.arrive(0, "quiet", 1);
        assert!(i.stops(1, 8));
        i.end(false);
        // A higher band's prefill beside lower decodes: its band's next arrival waits, a
        // still higher one cuts.
        i.begin(0, 20.0, flood(), prefill(1, "ent"));
        i.arrive(1, "ent", 1);
        i.arrive(1, "vip", 1);
        assert!(!i.stops(1, 8), "the band's own prefill runs whole");
        i.arrive(2, "ops", 1);
        assert!(i.stops(1, 8));
    }

    #[test]
    fn the_pass_after_an_interrupted_one_runs_whole() {
        let i = Interrupt::default();
        i.begin(0, 20.0, HashMap::new(), Vec::new());
        i.arrive(1, "ent", 1);
        assert!(i.stops(1, 8));
        i.end(true);
        i.begin(0, 20.0, HashMap::new(), Vec::new());
        i.arrive(1, "ent", 1);
        assert!(!i.stops(1, 8), "two passes running would be cut");
        i.end(false);
        i.begin(0, 20.0, HashMap::new(), Vec::new());
        i.arrive(1, "ent", 1);
        assert!(i.stops(1, 8), "after a whole pass, the next may be cut again");
    }
}
