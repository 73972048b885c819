//! Shutdown without losing a request: on SIGINT or SIGTERM the gateway stops admitting (new
//! requests get 503 `shutting_down`), lets the running ones finish for up to the drain
//! timeout, then cancels what is left: each engine is told to abort them, so every one ends
//! with the tokens it has (a stream with a terminal SSE error event, a whole answer as a 503),
//! and each goes through `logging` and gets its ledger row before the process exits.
//!
//! [`DrainOnSignal`] is pingora's shutdown watch: its `recv` returns (and pingora closes the
//! listeners and stops) only once the drain is over.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use pingora::server::{ShutdownSignal, ShutdownSignalWatch};

use crate::engine_client::EngineClient;

/// How long cancelling one request at its engine may take.
const ABORT_TIMEOUT: Duration = Duration::from_secs(2);

/// After the cancellation, how long the cancelled requests have to end and be billed.
const AFTER_CANCEL: Duration = Duration::from_secs(10);

/// The requests in flight and the drain's progress.
#[derive(Debug, Default)]
pub struct Drain {
    /// Request id -> the engine worker it went to (once routed).
    inflight: Mutex<HashMap<String, Option<String>>>,
    cancelled: Mutex<HashSet<String>>,
    draining: AtomicBool,
    changed: tokio::sync::Notify,
}

impl Drain {
    fn lock_inflight(&self) -> std::sync::MutexGuard<'_, HashMap<String, Option<String>>> {
        self.inflight.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether shutdown has begun (new requests are refused).
    pub fn draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    /// A request was accepted.
    pub fn begin(&self, request_id: &str) {
        self.lock_inflight().insert(request_id.to_owned(), None);
    }

    /// It goes to `worker`.
    pub fn routed(&self, request_id: &str, worker: &str) {
        if let Some(w) = self.lock_inflight().get_mut(request_id) {
            *w = Some(worker.to_owned());
        }
    }

    /// It ended (its usage was emitted).
    pub fn end(&self, request_id: &str) {
        self.lock_inflight().remove(request_id);
        self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).remove(request_id);
        self.changed.notify_waiters();
    }

    /// Whether the drain cancelled this request.
    pub fn was_cancelled(&self, request_id: &str) -> bool {
        self.cancelled.lock().unwrap_or_else(|e| e.into_inner()).contains(request_id)
    }

    /// Requests in flight.
    pub fn inflight(&self) -> usize {
        self.lock_inflight().len()
    }

    /// Waits until nothing is in flight or `deadline` passes; true when nothing is.
    async fn settled_by(&self, deadline: Instant) -> bool {
        loop {
            let changed = self.changed.notified();
            if self.inflight() == 0 {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Polled too: a request that ends between the check and the wait is seen.
            let _ = tokio::time::timeout(left.min(Duration::from_millis(200)), changed).await;
        }
    }

    /// Marks what is still in flight as cancelled; returns it with its workers.
    fn cancel_all(&self) -> Vec<(String, Option<String>)> {
        let left: Vec<(String, Option<String>)> =
            self.lock_inflight().iter().map(|(k, v)| (k.clone(), v.clone())).collect();
        let mut cancelled = self.cancelled.lock().unwrap_or_else(|e| e.into_inner());
        cancelled.extend(left.iter().map(|(id, _)| id.clone()));
        left
    }
}

/// pingora's shutdown watch: SIGINT and SIGTERM both drain (pingora's own watch treats SIGINT
/// as an immediate stop, which loses the running requests).
pub struct DrainOnSignal {
    drain: Arc<Drain>,
    timeout: Duration,
    internal_token: Option<String>,
}

impl DrainOnSignal {
    /// Drains `drain` for up to `timeout`, then cancels through each engine's abort route.
    pub fn new(drain: Arc<Drain>, timeout: Duration, internal_token: Option<String>) -> Self {
        Self { drain, timeout, internal_token }
    }

    async fn cancel_left(&self) {
        let left = self.drain.cancel_all();
        tracing::warn!(requests = left.len(), "drain timeout reached; cancelling what is left");
        let Ok(http) = reqwest::Client::builder().build() else { return };
        let engines = EngineClient::new(http, self.internal_token.clone());
        // All at once, under one deadline: an unreachable engine costs 2 s, not 2 s each.
        let aborts = left.into_iter().filter_map(|(id, worker)| {
            // Not routed yet: upstream_peer refuses it.
            let worker = worker?;
            let engines = &engines;
            Some(async move {
                if let Err(e) = engines.abort(&worker, &id, ABORT_TIMEOUT).await {
                    tracing::warn!(error = %e, request_id = %id, "could not cancel at the engine");
                }
            })
        });
        futures_util::future::join_all(aborts).await;
    }
}

#[async_trait]
impl ShutdownSignalWatch for DrainOnSignal {
    async fn recv(&self) -> ShutdownSignal {
        use tokio::signal::unix::{SignalKind, signal};
        match (signal(SignalKind::interrupt()), signal(SignalKind::terminate())) {
            (Ok(mut int), Ok(mut term)) => {
                tokio::select! {
                    _ = int.recv() => {}
                    _ = term.recv() => {}
                }
            }
            _ => {
                tracing::error!("cannot watch for signals; the gateway stops only when killed");
                std::future::pending::<()>().await;
            }
        }
        self.drain.draining.store(true, Ordering::Relaxed);
        let running = self.drain.inflight();
        tracing::info!(running, timeout = ?self.timeout, "shutting down: draining");
        eprintln!("shutting down: draining {running} requests (up to {:?})", self.timeout);
        if !self.drain.settled_by(Instant::now() + self.timeout).await {
            self.cancel_left().await;
            if !self.drain.settled_by(Instant::now() + AFTER_CANCEL).await {
                tracing::error!(
                    requests = self.drain.inflight(),
                    "requests still open after the cancellation; stopping anyway"
                );
            }
        }
        ShutdownSignal::GracefulTerminate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_drain_settles_when_the_last_request_ends() {
        let d = Arc::new(Drain::default());
        d.begin("a");
        d.begin("b");
        d.routed("b", "127.0.0.1:1");
        assert!(!d.settled_by(Instant::now() + Duration::from_millis(50)).await);
        let left = d.cancel_all();
        assert_eq!(left.len(), 2);
        assert!(d.was_cancelled("a") && d.was_cancelled("b"));
        let ender = Arc::clone(&d);
        let t = tokio::spawn(async move {
            ender.end("a");
            ender.end("b");
        });
        assert!(d.settled_by(Instant::now() + Duration::from_secs(10)).await);
        assert!(!d.was_cancelled("a"));
        let _ = t.await;
    }
}
