//! Strict priority bands inside a step: a request that arrives while a step carrying lower
//! priorities is running interrupts it between two layers of the CPU pass, so it waits for a
//! layer, not for a step of a flood's decodes and prefill chunks. The interrupted step
//! leaves nothing behind: its tokens are not marked computed and nothing is sampled, so the
//! next plan computes them again (the K/V written for them so far is written again, the same).
//!
//! A GPU pass runs whole: it never looks at the flag.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

/// The share of a pass after which it finishes anyway: an interrupt then would waste more
/// than it saves the arrival.
const LAST_SHARE: (usize, usize) = (3, 4);

/// The lowest priority in the step running, and whether a higher one has arrived since it
/// began.
#[derive(Debug)]
pub struct Interrupt {
    /// The lowest priority in the running step (`i32::MAX`: none runs).
    running: AtomicI32,
    raised: AtomicBool,
    /// The last pass was interrupted: the next runs whole.
    last_cut: AtomicBool,
}

impl Default for Interrupt {
    fn default() -> Self {
        Interrupt {
            running: AtomicI32::new(i32::MAX),
            raised: AtomicBool::new(false),
            last_cut: AtomicBool::new(false),
        }
    }
}

impl Interrupt {
    /// A request of `priority` has been queued: it interrupts the running step if that
    /// carries a lower priority. (One queued while a step is being planned, before
    /// [`begin`](Self::begin), waits for that step: it is not in it.)
    pub fn arrive(&self, priority: i32) {
        if priority > self.running.load(Ordering::Acquire) {
            self.raised.store(true, Ordering::Release);
        }
    }

    /// A step whose lowest priority is `priority` begins. Never two passes running are
    /// interrupted: the one after an interrupted pass runs whole, so arrivals faster than
    /// the steps cannot stop the engine (the higher band's own decodes included).
    pub fn begin(&self, priority: i32) {
        let priority = if self.last_cut.load(Ordering::Acquire) { i32::MAX } else { priority };
        self.raised.store(false, Ordering::Release);
        self.running.store(priority, Ordering::Release);
    }

    /// The step has ended, `cut` short or whole.
    pub fn end(&self, cut: bool) {
        self.running.store(i32::MAX, Ordering::Release);
        self.raised.store(false, Ordering::Release);
        self.last_cut.store(cut, Ordering::Release);
    }

    /// Whether the pass, `done` of its `layers` layers behind it, stops here: a higher
    /// priority has arrived, and at least one layer and less than three quarters of the
    /// pass are done.
    pub fn stops(&self, done: usize, layers: usize) -> bool {
        done > 0
            && done * LAST_SHARE.1 < layers * LAST_SHARE.0
            && self.raised.load(Ordering::Acquire)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_higher_priority_interrupts_and_only_early_in_the_pass() {
        let i = Interrupt::default();
        // Nothing runs: an arrival interrupts nothing.
        i.arrive(5);
        assert!(!i.stops(1, 8));
        i.begin(0);
        i.arrive(0);
        assert!(!i.stops(1, 8), "an equal priority waits for the step");
        i.arrive(1);
        assert!(!i.stops(0, 8), "not before the first layer");
        assert!(i.stops(1, 8) && i.stops(5, 8));
        assert!(!i.stops(6, 8), "three quarters done: the pass finishes");
        i.end(false);
        assert!(!i.stops(1, 8), "a new step starts clear");
        i.begin(1);
        assert!(!i.stops(1, 8), "the flag of the last step is gone");
        i.arrive(1);
        assert!(!i.stops(1, 8));
        i.end(false);
    }

    #[test]
    fn the_pass_after_an_interrupted_one_runs_whole() {
        let i = Interrupt::default();
        i.begin(0);
        i.arrive(1);
        assert!(i.stops(1, 8));
        i.end(true);
        i.begin(0);
        i.arrive(1);
        assert!(!i.stops(1, 8), "two passes running would be cut");
        i.end(false);
        i.begin(0);
        i.arrive(1);
        assert!(i.stops(1, 8), "after a whole pass, the next may be cut again");
    }
}
