//! One thread owns the engine core; everyone else holds a cloneable [`EngineHandle`].

use std::sync::Arc;
use std::sync::mpsc as std_mpsc;
use std::thread::JoinHandle;

use tokio::sync::mpsc;

use crate::error::{EngineError, Result};
use crate::loader::LoadedModel;
use crate::serve::core::{EngineConfig, EngineCore, EngineStats};
use crate::serve::metrics::EngineMetrics;
use crate::serve::outcomes::OutcomeLog;
use crate::serve::{EngineEvent, ValidRequest};

enum Command {
    Add(Box<ValidRequest>, mpsc::UnboundedSender<EngineEvent>),
    Abort(String),
    AbortAll,
    Stats(std_mpsc::Sender<EngineStats>),
    Shutdown,
}

struct Inner {
    tx: std_mpsc::Sender<Command>,
    model: Arc<LoadedModel>,
    config: EngineConfig,
    metrics: Arc<EngineMetrics>,
    capacity_tokens: usize,
    outcomes: Arc<OutcomeLog>,
    /// Arrivals of a higher priority interrupt the running pass.
    interrupt: Arc<crate::interrupt::Interrupt>,
    draining: std::sync::atomic::AtomicBool,
    thread: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.lock().unwrap_or_else(|e| e.into_inner()).take() {
            let _ = t.join();
        }
    }
}

/// A cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle").field("model", &self.inner.model.identity.model_id).finish()
    }
}

/// The events of one request. Dropping it aborts the request (its KV blocks are freed by
/// the next scheduler step).
#[derive(Debug)]
pub struct RequestStream {
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    request_id: String,
    tx: std_mpsc::Sender<Command>,
    finished: bool,
}

impl RequestStream {
    /// The next event; `None` after `Finished`.
    pub async fn next(&mut self) -> Option<EngineEvent> {
        if self.finished {
            return None;
        }
        let ev = self.rx.recv().await;
        self.note(&ev);
        ev
    }

    /// The next event, blocking the calling (non-async) thread.
    pub fn blocking_next(&mut self) -> Option<EngineEvent> {
        if self.finished {
            return None;
        }
        let ev = self.rx.blocking_recv();
        self.note(&ev);
        ev
    }

    fn note(&mut self, ev: &Option<EngineEvent>) {
        if matches!(ev, None | Some(EngineEvent::Finished { .. })) {
            self.finished = true;
        }
    }

    /// The request's id.
    pub fn request_id(&self) -> &str {
        &self.request_id
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Abort(self.request_id.clone()));
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread for `model`.
    pub fn start(model: Arc<LoadedModel>, config: EngineConfig) -> Result<EngineHandle> {
        let metrics = Arc::new(EngineMetrics::new());
        let core = EngineCore::new(Arc::clone(&model), config.clone(), Arc::clone(&metrics))?;
        let capacity_tokens = core.capacity_tokens();
        let outcomes = core.outcomes();
        let interrupt = core.interrupt();
        let (tx, rx) = std_mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || run(core, rx))
            .map_err(|e| EngineError::Unavailable(format!("starting the engine thread: {e}")))?;
        Ok(EngineHandle {
            inner: Arc::new(Inner {
                tx,
                model,
                config,
                metrics,
                capacity_tokens,
                outcomes,
                interrupt,
                draining: std::sync::atomic::AtomicBool::new(false),
                thread: std::sync::Mutex::new(Some(thread)),
            }),
        })
    }

    /// What the engine did for each recent request (register choices before submitting).
    pub fn outcomes(&self) -> &Arc<OutcomeLog> {
        &self.inner.outcomes
    }

    /// The served model.
    pub fn model(&self) -> &Arc<LoadedModel> {
        &self.inner.model
    }

    /// The engine's configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.inner.config
    }

    /// Prometheus metrics.
    pub fn metrics(&self) -> &EngineMetrics {
        &self.inner.metrics
    }

    /// Most tokens (prompt + output) one request can ever hold in the KV cache.
    pub fn capacity_tokens(&self) -> usize {
        self.inner.capacity_tokens
    }

    /// Queues a request. Refuses one whose prompt plus `max_tokens` the KV cache could never
    /// hold, or that exceeds the context length.
    pub fn submit(&self, req: ValidRequest) -> Result<RequestStream> {
        let need = req.prompt.len() + req.max_tokens;
        if need > self.inner.capacity_tokens {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) plus max_tokens ({}) needs {need} KV slots; this engine holds at most {}",
                req.prompt.len(),
                req.max_tokens,
                self.inner.capacity_tokens
            )));
        }
        let ctx = self.inner.model.weights.config.context_length;
        if need > ctx {
            return Err(EngineError::InvalidRequest(format!(
                "prompt ({} tokens) plus max_tokens ({}) exceeds the context length {ctx}",
                req.prompt.len(),
                req.max_tokens
            )));
        }
        let (etx, erx) = mpsc::unbounded_channel();
        let request_id = req.request_id.clone();
        let (priority, weight) = (req.priority, req.weight);
        let tenant = req.cache_scope.tenant().to_owned();
        self.inner
            .tx
            .send(Command::Add(Box::new(req), etx))
            .map_err(|_| EngineError::Unavailable("the engine has stopped".into()))?;
        // Queued first, then told: the pass it stops is replanned with it there.
        self.inner.interrupt.arrive(priority, &tenant, weight);
        Ok(RequestStream { rx: erx, request_id, tx: self.inner.tx.clone(), finished: false })
    }

    /// Aborts one engine request (a choice id): it ends at once with the tokens it has.
    pub fn abort(&self, choice_id: &str) {
        let _ = self.inner.tx.send(Command::Abort(choice_id.to_owned()));
    }

    /// Aborts every request the engine holds (the end of a drain).
    pub fn abort_all(&self) {
        let _ = self.inner.tx.send(Command::AbortAll);
    }

    /// Marks the engine as draining (its `/health` says so; gateways route elsewhere).
    pub fn set_draining(&self) {
        self.inner.draining.store(true, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether shutdown has begun.
    pub fn is_draining(&self) -> bool {
        self.inner.draining.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether the engine thread still runs (it ends only at shutdown or on a panic): liveness,
    /// answered without waiting for the step in progress.
    pub fn is_alive(&self) -> bool {
        let thread = self.inner.thread.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        thread.as_ref().is_some_and(|t| !t.is_finished())
    }

    /// A snapshot of queue and cache state.
    pub fn stats(&self) -> Option<EngineStats> {
        let (tx, rx) = std_mpsc::channel();
        self.inner.tx.send(Command::Stats(tx)).ok()?;
        rx.recv().ok()
    }
}

fn run(mut core: EngineCore, rx: std_mpsc::Receiver<Command>) {
    loop {
        // Block only when there is nothing to compute.
        let first = if core.has_work() {
            match rx.try_recv() {
                Ok(c) => Some(c),
                Err(std_mpsc::TryRecvError::Empty) => None,
                Err(std_mpsc::TryRecvError::Disconnected) => return,
            }
        } else {
            match rx.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        let mut next = first;
        while let Some(cmd) = next {
            match cmd {
                Command::Add(req, tx) => core.add_request(*req, tx),
                Command::Abort(id) => core.abort(&id),
                Command::AbortAll => core.abort_all(),
                Command::Stats(tx) => {
                    let _ = tx.send(core.stats());
                }
                Command::Shutdown => return,
            }
            next = rx.try_recv().ok();
        }
        if core.has_work() {
            core.step();
        }
    }
}
