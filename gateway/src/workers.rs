//! The engine workers behind a gateway: health and load from their `/health` and
//! `/v1/internal/load` (polled, the load an [`EngineLoad`]), the models each serves (its
//! `/v1/models`, learned into the [`Catalog`] when it first answers and whenever its `/health`
//! names another), and the choice of a worker for a request: among those serving its model,
//! prefix affinity (rendezvous hashing on the tenant and the prompt's start, so one tenant's
//! shared prefixes meet the same prefix cache) unless that worker is unhealthy or much busier
//! than the least loaded one.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha2::{Digest, Sha256};
use sluice_wire::EngineLoad;

use crate::admission::TokenCounter;
use crate::catalog::Catalog;
use crate::engine_client::{EngineClient, InternalToken};

/// One worker's last known state.
#[derive(Debug)]
pub struct WorkerState {
    /// `host:port` of its HTTP API.
    pub addr: String,
    healthy: AtomicBool,
    running: AtomicU64,
    waiting: AtomicU64,
    batch_full: AtomicBool,
    /// Whether its last load report was read (a failure is logged once, when it starts).
    load_read: AtomicBool,
    /// The model ids it serves, from its last `/v1/models` (empty until it answers).
    models: Mutex<Vec<String>>,
}

impl WorkerState {
    /// Requests running plus waiting at the last poll.
    pub fn load(&self) -> u64 {
        self.running.load(Ordering::Relaxed) + self.waiting.load(Ordering::Relaxed)
    }

    fn set_load(&self, load: &EngineLoad) {
        self.running.store(load.running, Ordering::Relaxed);
        self.waiting.store(load.waiting, Ordering::Relaxed);
        self.batch_full.store(load.batch_full, Ordering::Relaxed);
    }

    /// A poll's load report, or why it could not be read: then the engine is taken for idle,
    /// never busy or full (no figure of an earlier report is kept to steer routing or
    /// admission), and the failure is logged when it starts.
    fn take_load(&self, report: Result<EngineLoad, String>) {
        match report {
            Ok(load) => {
                self.set_load(&load);
                self.load_read.store(true, Ordering::Relaxed);
            }
            Err(e) => {
                if self.load_read.swap(false, Ordering::Relaxed) {
                    tracing::warn!(worker = %self.addr, error = %e,
                        "an engine's load is unknown (older than this gateway?): taken for idle");
                }
                self.set_load(&EngineLoad::default());
            }
        }
    }

    /// Whether the last health check passed.
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Whether it serves `model`.
    pub fn serves(&self, model: &str) -> bool {
        self.models.lock().unwrap_or_else(|e| e.into_inner()).iter().any(|m| m == model)
    }

    /// Whether it serves `model`, or has not said what it serves (never reached yet).
    fn may_serve(&self, model: &str) -> bool {
        let models = self.models.lock().unwrap_or_else(|e| e.into_inner());
        models.is_empty() || models.iter().any(|m| m == model)
    }

    fn set_models(&self, models: Vec<String>) {
        *self.models.lock().unwrap_or_else(|e| e.into_inner()) = models;
    }
}

/// The gateway's workers.
#[derive(Debug)]
pub struct Workers {
    list: Vec<Arc<WorkerState>>,
    /// The internal token the engines require (their `/v1` routes).
    token: Option<InternalToken>,
}

fn score(addr: &str, key: &str) -> u64 {
    let d = Sha256::digest(format!("{addr}\n{key}").as_bytes());
    u64::from_le_bytes([d[0], d[1], d[2], d[3], d[4], d[5], d[6], d[7]])
}

/// A worker is "much busier" when its load exceeds twice the least loaded one's plus this.
const BUSY_SLACK: u64 = 8;

impl Workers {
    /// Workers at these addresses, assumed healthy until checked; `token` is the bearer
    /// token their `/v1` routes require.
    pub fn new(addrs: &[String], token: Option<String>) -> Arc<Self> {
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
                        load_read: AtomicBool::new(true),
                        models: Mutex::new(Vec::new()),
                    })
                })
                .collect(),
            token: InternalToken::new(token),
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

    /// How many workers answered their last health check.
    pub fn healthy_count(&self) -> usize {
        self.list.iter().filter(|w| w.healthy()).count()
    }

    /// The healthy workers serving `model`.
    pub fn serving(&self, model: &str) -> usize {
        self.list.iter().filter(|w| w.healthy() && w.serves(model)).count()
    }

    /// Whether some worker serves `model` or has not said what it serves: a model the
    /// gateway was given a file of is listed until its engines have said otherwise.
    pub fn may_serve(&self, model: &str) -> bool {
        self.list.iter().any(|w| w.may_serve(model))
    }

    /// Polls every worker once: health, load, and (when it has not said, or its health
    /// names a model it was not known to serve) its models, learned into `catalog`.
    pub async fn poll(&self, engines: &EngineClient, catalog: &Catalog) {
        for w in &self.list {
            let health = engines.health(&w.addr).await;
            let ok = health.is_some();
            if ok != w.healthy() {
                tracing::warn!(worker = %w.addr, healthy = ok, "engine worker health changed");
            }
            w.healthy.store(ok, Ordering::Relaxed);
            let Some(named) = health else { continue };
            let named = named.as_deref();
            let known = !w.models.lock().unwrap_or_else(|e| e.into_inner()).is_empty();
            if !known || named.is_some_and(|m| !w.serves(m)) {
                match self.learn(w, engines, catalog).await {
                    Ok(models) => {
                        tracing::info!(worker = %w.addr, models = ?models, "engine worker serves");
                        w.set_models(models);
                    }
                    Err(e) => {
                        tracing::warn!(worker = %w.addr, error = %e, "learning an engine's models failed")
                    }
                }
            }
            w.take_load(engines.load(&w.addr).await);
        }
    }

    /// A worker's models from its `/v1/models`, each with its text side: held already (the
    /// same tokenizer revision and template version), else fetched from the worker.
    async fn learn(
        &self,
        w: &WorkerState,
        engines: &EngineClient,
        catalog: &Catalog,
    ) -> Result<Vec<String>, String> {
        let cards = engines.models(&w.addr).await?;
        let mut models = Vec::new();
        for card in &cards {
            let identity = &card.sluice.execution_identity;
            let tokenizer = identity.tokenizer_revision.as_str();
            let template = identity.chat_template_version.as_deref();
            let text = match catalog.text(tokenizer, template) {
                Some(t) => t,
                None => {
                    let bytes = engines.text(&w.addr).await?;
                    let text =
                        tokio::task::spawn_blocking(move || TokenCounter::from_bundle(&bytes))
                            .await
                            .map_err(|e| e.to_string())?
                            .map_err(|e| format!("the engine's text side: {e}"))?;
                    if text.revision() != tokenizer || text.template_version() != template {
                        return Err(format!(
                            "the engine's text side is tokenizer {} template {:?}, its card says {tokenizer} {template:?}",
                            text.revision(),
                            text.template_version()
                        ));
                    }
                    catalog.add_text(text)
                }
            };
            models.extend(catalog.learn(card, text));
        }
        if models.is_empty() {
            return Err("it lists no model".into());
        }
        Ok(models)
    }

    /// Polls every worker every `interval`, on `io`; the first poll is done (or `first`
    /// has passed) when this returns, so the models are known before requests come.
    pub fn spawn_health_checks(
        self: &Arc<Self>,
        io: &tokio::runtime::Handle,
        catalog: &Arc<Catalog>,
        interval: Duration,
        first: Duration,
    ) {
        let (me, catalog) = (Arc::clone(self), Arc::clone(catalog));
        let (polled, first_poll) = std::sync::mpsc::channel();
        io.spawn(async move {
            // Each call sets its own timeout.
            let Ok(http) = reqwest::Client::builder().build() else { return };
            let engines = EngineClient::with_token(http, me.token.clone());
            loop {
                me.poll(&engines, &catalog).await;
                let _ = polled.send(());
                tokio::time::sleep(interval).await;
            }
        });
        let _ = first_poll.recv_timeout(first);
    }

    /// The worker for a request of `model` with affinity `key`, never one in `tried`, among
    /// those serving it or not yet heard from. Healthy workers first; when none is known
    /// healthy, any untried one (the checks may be stale).
    pub fn choose(&self, model: &str, key: &str, tried: &[String]) -> Option<Arc<WorkerState>> {
        let untried: Vec<&Arc<WorkerState>> =
            self.list.iter().filter(|w| !tried.contains(&w.addr) && w.may_serve(model)).collect();
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

    fn healthy_for<'a>(&'a self, model: &'a str) -> impl Iterator<Item = &'a Arc<WorkerState>> {
        self.list.iter().filter(move |w| w.healthy() && w.serves(model))
    }

    /// Whether every healthy worker serving `model` already has `max_waiting` requests
    /// queued (admitting more would only lengthen queues past any deadline).
    pub fn overloaded(&self, model: &str, max_waiting: u64) -> bool {
        let healthy: Vec<&Arc<WorkerState>> = self.healthy_for(model).collect();
        !healthy.is_empty()
            && healthy.iter().all(|w| w.waiting.load(Ordering::Relaxed) >= max_waiting)
    }

    /// The places the engines serving `model` are running, when every healthy one has
    /// requests waiting because its batch is as large as it may grow (its load's
    /// `batch_full`); `None` while some engine has room.
    pub fn backlog(&self, model: &str) -> Option<u64> {
        let healthy: Vec<&Arc<WorkerState>> = self.healthy_for(model).collect();
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
        w.set_models(vec!["m".into()]);
        w.healthy.store(healthy, Ordering::Relaxed);
        w.set_load(&EngineLoad { running, waiting, batch_full: waiting > 0, ..Default::default() });
    }

    #[test]
    fn an_unread_load_leaves_no_stale_figure() {
        let ws = Workers::new(&["a:1".into()], None);
        set(&ws.list[0], true, 8, 4);
        assert!(ws.overloaded("m", 4) && ws.backlog("m") == Some(8));
        ws.list[0].take_load(Err("404 Not Found".into()));
        assert!(!ws.overloaded("m", 4), "a queue it no longer reports is not full");
        assert_eq!((ws.backlog("m"), ws.list[0].load()), (None, 0));
        let busy = EngineLoad { running: 6, waiting: 2, batch_full: true, ..Default::default() };
        ws.list[0].take_load(Ok(busy));
        assert_eq!((ws.backlog("m"), ws.list[0].load()), (Some(6), 8));
    }

    #[test]
    fn a_backlog_is_every_healthy_worker_waiting() {
        let w = Workers::new(&["a:1".into(), "b:1".into()], None);
        set(&w.list[0], true, 8, 3);
        set(&w.list[1], true, 6, 0);
        assert_eq!(w.backlog("m"), None, "b has room");
        set(&w.list[1], true, 6, 1);
        assert_eq!(w.backlog("m"), Some(14));
        set(&w.list[1], false, 6, 0);
        assert_eq!(w.backlog("m"), Some(8), "an unhealthy worker does not count");
        // Requests waiting between steps, the batch not full: room.
        w.list[0].batch_full.store(false, Ordering::Relaxed);
        assert_eq!(w.backlog("m"), None);
    }

    #[test]
    fn affinity_holds_until_unhealthy_or_much_busier() {
        let ws = Workers::new(&["a:1".into(), "b:2".into(), "c:3".into()], None);
        for w in &ws.list {
            w.set_models(vec!["m".into()]);
        }
        let first = ws.choose("m", "tenant\nsystem prompt", &[]).map(|w| w.addr.clone());
        // Same key, same worker; different keys spread.
        assert_eq!(ws.choose("m", "tenant\nsystem prompt", &[]).map(|w| w.addr.clone()), first);
        let spread: std::collections::BTreeSet<String> = (0..64)
            .filter_map(|i| ws.choose("m", &format!("t\n{i}"), &[]).map(|w| w.addr.clone()))
            .collect();
        assert_eq!(spread.len(), 3);
        let Some(first) = first else { return };
        let fw = ws.list.iter().find(|w| w.addr == first).map(Arc::clone);
        let Some(fw) = fw else { return };
        // A little busier: still preferred.
        set(&fw, true, 4, 4);
        assert_eq!(
            ws.choose("m", "tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        // Much busier than the others: the least loaded takes it.
        set(&fw, true, 20, 20);
        assert_ne!(
            ws.choose("m", "tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        // Unhealthy, or already tried: never chosen while another exists.
        set(&fw, false, 0, 0);
        assert_ne!(
            ws.choose("m", "tenant\nsystem prompt", &[]).map(|w| w.addr.clone()),
            Some(first.clone())
        );
        set(&fw, true, 0, 0);
        assert_ne!(
            ws.choose("m", "tenant\nsystem prompt", std::slice::from_ref(&first))
                .map(|w| w.addr.clone()),
            Some(first)
        );
        let all: Vec<String> = ws.list.iter().map(|w| w.addr.clone()).collect();
        assert!(ws.choose("m", "x", &all).is_none());
    }

    #[test]
    fn overload_means_every_healthy_queue_is_full() {
        let ws = Workers::new(&["a:1".into(), "b:2".into()], None);
        assert!(!ws.overloaded("m", 4));
        set(&ws.list[1], true, 0, 0);
        set(&ws.list[0], true, 8, 4);
        assert!(!ws.overloaded("m", 4));
        set(&ws.list[1], false, 0, 0);
        assert!(ws.overloaded("m", 4));
    }

    #[test]
    fn a_request_goes_only_to_workers_serving_its_model() {
        let ws = Workers::new(&["a:1".into(), "b:2".into(), "c:3".into()], None);
        ws.list[0].set_models(vec!["m".into()]);
        ws.list[1].set_models(vec!["m".into(), "g".into()]);
        ws.list[2].set_models(vec!["g".into()]);
        for i in 0..32 {
            let key = format!("t\n{i}");
            let m = ws.choose("m", &key, &[]).map(|w| w.addr.clone());
            assert!(m.as_deref().is_some_and(|a| a != "c:3"), "{m:?}");
            let g = ws.choose("g", &key, &[]).map(|w| w.addr.clone());
            assert!(g.as_deref().is_some_and(|a| a != "a:1"), "{g:?}");
        }
        assert!(ws.choose("other", "k", &[]).is_none());
        // A worker not heard from yet may serve anything.
        let fresh = Workers::new(&["d:4".into()], None);
        assert!(fresh.choose("other", "k", &[]).is_some() && fresh.may_serve("other"));
        assert!(!ws.may_serve("other") && ws.may_serve("g"));
        assert_eq!((ws.serving("m"), ws.serving("g"), ws.serving("other")), (2, 2, 0));
        // g's engines backlogged, m's with room: only g's requests are held to their share.
        for (w, waiting) in ws.list.iter().zip([0, 2, 3]) {
            w.running.store(4, Ordering::Relaxed);
            w.waiting.store(waiting, Ordering::Relaxed);
            w.batch_full.store(waiting > 0, Ordering::Relaxed);
        }
        assert_eq!((ws.backlog("m"), ws.backlog("g")), (None, Some(8)));
        assert!(ws.overloaded("g", 2) && !ws.overloaded("m", 2));
    }
}
