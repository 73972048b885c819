//! The engine workers behind a gateway: health and load from their `/health` and `/metrics`
//! (polled), and the choice of a worker for a request: prefix affinity (rendezvous hashing
//! on the tenant and the prompt's start, so one tenant's shared prefixes meet the same
//! prefix cache) unless that worker is unhealthy or much busier than the least loaded one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use sha2::{Digest, Sha256};

/// One worker's last known state.
#[derive(Debug)]
pub struct WorkerState {
    /// `host:port` of its HTTP API.
    pub addr: String,
    healthy: AtomicBool,
    running: AtomicU64,
    waiting: AtomicU64,
    batch_full: AtomicBool,
}

impl WorkerState {
    /// Requests running plus waiting at the last poll.
    pub fn load(&self) -> u64 {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    /// Whether the last health check passed.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }
}

/// The gateway's workers.
#[derive(Debug)]
pub struct Workers {
    list: Vec<Arc<WorkerState>>,
}

fn score(addr: &str, key: &str) -> u64 {
    let d = Sha256::digest(format!("{addr}\n{key}").as_bytes());
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// A worker is "much busier" when its load exceeds twice the least loaded one's plus this.
const BUSY_SLACK: u64 = 8;

fn gauge(metrics: &str, name: &str) -> Option<u64> {
    metrics.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let v = rest.trim_start_matches(|c: char| c != ' ').trim();
        v.parse::<f64>().ok().map(|x| x.max(0.0) as u64)
    })
}

impl Workers {
    /// Workers at these addresses, assumed healthy until checked.
    pub fn new(addrs: &[String]) -> Arc<Self> {
        Arc::new(Self {
            list: addrs
                .iter()
                .map(|a| {
                    Arc::new(WorkerState {
                        addr: a.clone(),
                        healthy: AtomicBool::new(true),
                        running: AtomicU64::new(0),
                        waiting: AtomicU64::new(0),
                        batch_full: AtomicBool::new(false),
                    })
                })
                .collect(),
        })
    }

    /// How many workers there are.
    pub fn len(&self) -> usize {
        self.list.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.list.is_empty()
    }

    /// Polls every worker's `/health` and `/metrics` every `interval`, on `io`.
    pub fn spawn_health_checks(self: &Arc<Self>, io: &tokio::runtime::Handle, interval: Duration) {
        let me = Arc::clone(self);
        io.spawn(async move {
            let Ok(http) = reqwest::Client::builder().timeout(Duration::from_secs(1)).build()
            else {
                return;
            };
            loop {
                for w in &me.list {
                    let ok = matches!(
                        http.get(format!("http://{}/health", w.addr)).send().await,
                        Ok(r) if r.status().is_success()
                    );
                    if ok != w.healthy() {
                        tracing::warn!(worker = %w.addr, healthy = ok, "engine worker health changed");
                    }
                    w.healthy.store(ok, Ordering::Relaxed);
                    if !ok {
                        continue;
                    }
                    if let Ok(r) = http.get(format!("http://{}/metrics", w.addr)).send().await
                        && let Ok(text) = r.text().await
                    {
                        if let Some(n) = gauge(&text, "sluice_engine_num_requests_running") {
                            w.running.store(n, Ordering::Relaxed);
                        }
                        if let Some(n) = gauge(&text, "sluice_engine_num_requests_waiting") {
                            w.waiting.store(n, Ordering::Relaxed);
                        }
                        // An engine that does not say is never taken for full.
                        let full = gauge(&text, "sluice_engine_batch_full").is_some_and(|n| n > 0);
                        w.batch_full.store(full, Ordering::Relaxed);
                    }
                }
                tokio::time::sleep(interval).await;
            }
        });
    }

    /// The worker for a request with affinity `key`, never one in `tried`. Healthy workers
    /// first; when none is known healthy, any untried one (the checks may be stale).
    pub fn choose(&self, key: &str, tried: &[String]) -> Option<Arc<WorkerState>> {
        let untried: Vec<&Arc<WorkerState>> =
            self.list.iter().filter(|w| !tried.contains(&w.addr)).collect();
        let healthy: Vec<&Arc<WorkerState>> =
            untried.iter().copied().filter(|w| w.healthy()).collect();
        let pool = if healthy.is_empty() { untried } else { healthy };
        let best = pool.iter().max_by_key(|w| score(&w.addr, key))?;
        let least =
            pool.iter().min_by_key(|w| (w.load(), std::cmp::Reverse(score(&w.addr, key))))?;
        if best.load() > 2 * least.load() + BUSY_SLACK {
            return Some(Arc::clone(least));
        }
        Some(Arc::clone(best))
    }

    /// Whether every healthy worker already has `max_waiting` requests queued (admitting
    /// more would only lengthen queues past any deadline).
    pub fn overloaded(&self, max_waiting: u64) -> bool {
        let healthy: Vec<&Arc<WorkerState>> = self.list.iter().filter(|w| w.healthy()).collect();
        !healthy.is_empty()
            && healthy.iter().all(|w| w.waiting.load(Ordering::Relaxed) >= max_waiting)
    }

    /// The places the engines are running, when every healthy one has requests waiting
    /// because its batch is as large as it may grow (`sluice_engine_batch_full`); `None`
    /// while some engine has room.
    pub fn backlog(&self) -> Option<u64> {
        let healthy: Vec<&Arc<WorkerState>> = self.list.iter().filter(|w| w.healthy()).collect();
        let backlogged = !healthy.is_empty()
            && healthy.iter().all(|w| {
                w.waiting.load(Ordering::Relaxed) > 0 && w.batch_full.load(Ordering::Relaxed)
            });
        backlogged.then(|| healthy.iter().map(|w| w.running.load(Ordering::Relaxed)).sum())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn set(w: &WorkerState, healthy: bool, running: u64, waiting: u64) {
        w.healthy.store(healthy, Ordering::Relaxed);
        w.running.store(running, Ordering::Relaxed);
        w.waiting.store(waiting, Ordering::Relaxed);
        w.batch_full.store(waiting > 0, Ordering::Relaxed);
    }

    #[test]
    fn a_backlog_is_every_healthy_worker_waiting() {
        let w = Workers::new(&["a:1".into(), "b:1".into()]);
        set(&w.list[0], true, 8, 3);
        set(&w.list[1], true, 6, 0);
        assert_eq!(w.backlog(), None, "b has room");
        set(&w.list[1], true, 6, 1);
        assert_eq!(w.backlog(), Some(14));
        set(&w.list[1], false, 6, 0);
        assert_eq!(w.backlog(), Some(8), "an unhealthy worker does not count");
        // Requests waiting between steps, the batch not full: room.
        w.list[0].batch_full.store(false, Ordering::Relaxed);
        assert_eq!(w.backlog(), None);
    }

    #[test]
    fn affinity_holds_until_unhealthy_or_much_busier() {
        let ws = Workers::new(&["a:1".into(), "b:2".into(), "c:3".into()]);
        let first = ws.choose("tenant\nsystem prompt", &[]).map(|w| w.addr.clone());
        // Same key, same worker; different keys spread.
        assert_eq!(ws.choose("tenant\nsystem prompt", &[]).map(|w| w.addr.clone()), first);
        let spread: std::collections::BTreeSet<String> = (0..64)
            .filter_map(|i| ws.choose(&format!("t\n{i}"), &[]).map(|w| w.addr.clone()))
            .collect();
        assert_eq!(spread.len(), 3);
        let Some(first) = first else { return };
        let fw = ws.list.iter().find(|w| w.addr == first).map(Arc::clone);
        let Some(fw) = fw else { return };
        // A little busier: still preferred.
        set(&fw, true, 4, 4);
        assert_eq!(
            ws.choose("tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        // Much busier than the others: the least loaded takes it.
        set(&fw, true, 20, 20);
        assert_ne!(
            ws.choose("tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        // Unhealthy, or already tried: never chosen while another exists.
        set(&fw, false, 0, 0);
        assert_ne!(
            ws.choose("tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        set(&fw, true, 0, 0);
        assert_ne!(
            ws.choose("tenant\nsystem prompt", std::slice::from_ref(&first))
                .map(|w| w.addr.clone()),
            Some(first)
        );
        let all: Vec<String> = ws.list.iter().map(|w| w.addr.clone()).collect();
        assert!(ws.choose("x", &all).is_none());
    }

    #[test]
    fn overload_means_every_healthy_queue_is_full() {
        let ws = Workers::new(&["a:1".into(), "b:2".into()]);
        assert!(!ws.overloaded(4));
        set(&ws.list[0], true, 8, 4);
        assert!(!ws.overloaded(4));
        set(&ws.list[1], false, 0, 0);
        assert!(ws.overloaded(4));
        assert_eq!(
            gauge(
                "# HELP x\nsluice_engine_num_requests_waiting 3\n",
                "sluice_engine_num_requests_waiting"
            ),
            Some(3)
        );
    }
}
