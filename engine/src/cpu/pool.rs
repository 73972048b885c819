//! A fixed set of compute threads for the forward pass.
//!
//! A decode step runs a few hundred small parallel regions (one per matrix product); waking
//! threads through the OS for each would cost more than the work. Workers spin for a short
//! while on an epoch counter before parking, and the calling thread takes part as worker 0.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle, Thread};
use std::time::{Duration, Instant};

/// How long an idle worker spins before parking.
const SPIN: Duration = Duration::from_micros(200);

type Job = dyn Fn(usize) + Sync;

struct Shared {
    /// The current job, as a pointer whose lifetime `run` guarantees (see there).
    job: Mutex<Option<JobPtr>>,
    epoch: AtomicUsize,
    remaining: AtomicUsize,
    shutdown: AtomicBool,
}

#[derive(Clone, Copy)]
struct JobPtr(*const Job);

// SAFETY: the pointee is `Sync`, and `run` keeps it alive until every worker is done with it.
unsafe impl Send for JobPtr {}

/// A pool of `n` compute threads (the caller plus `n - 1` workers).
pub struct ThreadPool {
    shared: Arc<Shared>,
    workers: Vec<(JoinHandle<()>, Thread)>,
    run_lock: Mutex<()>,
}

impl std::fmt::Debug for ThreadPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ThreadPool").field("threads", &self.threads()).finish()
    }
}

impl ThreadPool {
    /// A pool with `threads` compute threads in all (at least one).
    pub fn new(threads: usize) -> ThreadPool {
        let shared = Arc::new(Shared {
            job: Mutex::new(None),
            epoch: AtomicUsize::new(0),
            remaining: AtomicUsize::new(0),
            shutdown: AtomicBool::new(false),
        });
        let workers = (1..threads.max(1))
            .filter_map(|i| {
                let s = Arc::clone(&shared);
                let h = thread::Builder::new()
                    .name(format!("sluice-cpu-{i}"))
                    .spawn(move || worker(&s, i))
                    .ok()?;
                let t = h.thread().clone();
                Some((h, t))
            })
            .collect();
        ThreadPool { shared, workers, run_lock: Mutex::new(()) }
    }

    /// A pool sized to the machine's available parallelism.
    pub fn with_available_parallelism() -> ThreadPool {
        ThreadPool::new(thread::available_parallelism().map_or(1, |n| n.get()))
    }

    /// Number of compute threads, the caller included.
    pub fn threads(&self) -> usize {
        self.workers.len() + 1
    }

    /// Runs `f(i)` for every thread index `i` in `0..threads()` and returns when all are done.
    pub fn run(&self, f: &(dyn Fn(usize) + Sync)) {
        if self.workers.is_empty() {
            f(0);
            return;
        }
        let _guard = self.run_lock.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the lifetime is erased only for the duration of this call: we wait below
        // until `remaining` reaches zero, i.e. until no worker will touch the job again, and
        // clear the slot before returning.
        let ptr =
            unsafe { std::mem::transmute::<*const (dyn Fn(usize) + Sync + '_), *const Job>(f) };
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = Some(JobPtr(ptr));
        self.shared.remaining.store(self.workers.len(), Ordering::Release);
        self.shared.epoch.fetch_add(1, Ordering::AcqRel);
        for (_, t) in &self.workers {
            t.unpark();
        }
        f(0);
        let mut spins = 0u32;
        while self.shared.remaining.load(Ordering::Acquire) != 0 {
            // On an oversubscribed machine a waiting thread must let the one it waits for run.
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(256) {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        *self.shared.job.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

fn worker(s: &Shared, index: usize) {
    let mut seen = 0usize;
    loop {
        let start = Instant::now();
        let mut spins = 0u32;
        loop {
            if s.shutdown.load(Ordering::Acquire) {
                return;
            }
            let e = s.epoch.load(Ordering::Acquire);
            if e != seen {
                seen = e;
                break;
            }
            spins = spins.wrapping_add(1);
            if spins.is_multiple_of(64) && start.elapsed() > SPIN {
                thread::park_timeout(Duration::from_millis(50));
            } else if spins.is_multiple_of(256) {
                thread::yield_now();
            } else {
                std::hint::spin_loop();
            }
        }
        let job = *s.job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(JobPtr(p)) = job {
            // SAFETY: `run` published this pointer before bumping the epoch and keeps the
            // closure alive until `remaining` drops to zero, which happens only after this call.
            unsafe { (*p)(index) };
        }
        s.remaining.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        for (h, t) in self.workers.drain(..) {
            t.unpark();
            let _ = h.join();
        }
    }
}

/// A raw output pointer shared with pool threads, each of which writes a disjoint part.
#[derive(Clone, Copy, Debug)]
pub struct SharedOut(pub *mut f32);
// SAFETY: only used for disjoint writes from pool threads while the owning `&mut` borrow is
// held by the caller of `ThreadPool::run`.
unsafe impl Send for SharedOut {}
// SAFETY: as above.
unsafe impl Sync for SharedOut {}

impl SharedOut {
    /// The pointer.
    pub fn get(self) -> *mut f32 {
        self.0
    }
}

/// Splits `0..n` into `parts` contiguous ranges whose starts are multiples of `align`;
/// returns part `i`.
pub fn split_range(n: usize, parts: usize, i: usize, align: usize) -> std::ops::Range<usize> {
    let units = n.div_ceil(align);
    let per = units / parts;
    let extra = units % parts;
    let start_u = i * per + i.min(extra);
    let len_u = per + usize::from(i < extra);
    let start = (start_u * align).min(n);
    let end = ((start_u + len_u) * align).min(n);
    start..end
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_index_runs_once_per_call() {
        let pool = ThreadPool::new(3);
        let hits = AtomicUsize::new(0);
        for _ in 0..1000 {
            pool.run(&|i| {
                hits.fetch_add(1 << (i * 10), Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 1000 * (1 + (1 << 10) + (1 << 20)));
    }

    #[test]
    fn split_range_covers_everything_aligned() {
        for n in [0, 1, 7, 64, 577, 1000] {
            for parts in 1..5 {
                let mut next = 0;
                for i in 0..parts {
                    let r = split_range(n, parts, i, 4);
                    assert_eq!(r.start, next);
                    assert!(r.start.is_multiple_of(4) || r.start == n);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }
}
