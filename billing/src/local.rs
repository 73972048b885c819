//! In-process usage ingestion for the single-machine `sluice up`: the gateway hands events to
//! a [`LocalIngest`], whose writer task batches them into the (SQLite or Postgres) ledger.
//!
//! The same guarantees as the Redis path, within one process: an event accepted by
//! [`LocalIngest::emit`] is inserted exactly once (idempotent on request id) unless the
//! process dies before the writer commits it; a database that is locked or down is waited
//! out with capped exponential backoff, never by dropping events; a full queue makes `emit`
//! wait (backpressure) instead of growing without bound; [`LocalIngest::shutdown`] drains the
//! queue before returning.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use crate::{BillingError, Ledger, UsageEvent};

/// Settings of a [`LocalIngest`].
#[derive(Clone, Debug)]
pub struct LocalIngestConfig {
    /// Events queued before `emit` waits.
    pub queue: usize,
    /// Most events per transaction.
    pub batch_size: usize,
    /// How long the writer waits to fill a batch after its first event.
    pub linger: Duration,
    /// First wait before retrying a failed write.
    pub retry_initial: Duration,
    /// Cap of the backoff.
    pub retry_max: Duration,
}

impl Default for LocalIngestConfig {
    fn default() -> Self {
        Self {
            queue: 10_000,
            batch_size: 500,
            linger: Duration::from_millis(20),
            retry_initial: Duration::from_millis(50),
            retry_max: Duration::from_secs(5),
        }
    }
}

/// Counters of a [`LocalIngest`].
#[derive(Debug, Default)]
pub struct LocalIngestStats {
    inserted: AtomicU64,
    duplicates: AtomicU64,
    failures: AtomicU64,
}

impl LocalIngestStats {
    /// New rows committed.
    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }
    /// Events whose request id was already in the ledger.
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
    /// Failed write attempts (each retried).
    pub fn failures(&self) -> u64 {
        self.failures.load(Ordering::Relaxed)
    }
}

/// What the writer task receives.
#[derive(Debug)]
enum Msg {
    Event(Box<UsageEvent>),
    /// Commit everything queued before this, then answer.
    Flush(oneshot::Sender<()>),
}

/// How much a background writer's thread is niced (Linux nice values are per thread): under
/// contention it gets about a tenth of a normal thread's share of a CPU, so request handling
/// preempts it, and it still runs (a writer at idle priority could starve behind a busy
/// engine and, through backpressure, stall requests).
pub const BACKGROUND_NICE: i32 = 10;

/// A queue and a writer task moving usage events into a ledger.
#[derive(Debug)]
pub struct LocalIngest {
    tx: mpsc::Sender<Msg>,
    /// Answered when the writer has drained the queue and stopped.
    done: oneshot::Receiver<()>,
    stats: Arc<LocalIngestStats>,
}

impl LocalIngest {
    /// Starts the writer task on the current Tokio runtime.
    pub fn start(ledger: Ledger, config: LocalIngestConfig) -> Self {
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        let stats = Arc::new(LocalIngestStats::default());
        let (done_tx, done) = oneshot::channel();
        let st = stats.clone();
        tokio::spawn(async move {
            write_loop(ledger, config, rx, st).await;
            let _ = done_tx.send(());
        });
        Self { tx, done, stats }
    }

    /// Starts the writer on a thread of its own at background CPU priority
    /// ([`BACKGROUND_NICE`]), with its own connection pool to `url` (so the database's worker
    /// threads, made from that thread, run at that priority too): persisting usage yields the
    /// CPU to proxying and serving under contention and catches up when it eases. The same
    /// guarantees as [`LocalIngest::start`]: nothing accepted is dropped, a full queue makes
    /// `emit` wait.
    pub async fn start_background(
        url: &str,
        config: LocalIngestConfig,
    ) -> Result<Self, BillingError> {
        let (tx, rx) = mpsc::channel(config.queue.max(1));
        let stats = Arc::new(LocalIngestStats::default());
        let (done_tx, done) = oneshot::channel();
        let (ready_tx, ready) = oneshot::channel::<Result<(), BillingError>>();
        let (url, st) = (url.to_owned(), stats.clone());
        std::thread::Builder::new()
            .name("sluice-usage".into())
            .spawn(move || {
                // SAFETY: setpriority with PRIO_PROCESS and 0 changes only the calling thread
                // on Linux (nice is per thread); no pointers are involved.
                unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, BACKGROUND_NICE) };
                let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(BillingError::Writer(e)));
                        return;
                    }
                };
                rt.block_on(async move {
                    let ledger = match Ledger::connect(&url).await {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    write_loop(ledger.clone(), config, rx, st).await;
                    ledger.close().await;
                });
                let _ = done_tx.send(());
            })
            .map_err(BillingError::Writer)?;
        ready.await.map_err(|_| {
            BillingError::Writer(std::io::Error::other("the usage writer thread stopped"))
        })??;
        Ok(Self { tx, done, stats })
    }

    /// Queues one event (validated now, so the writer never meets a bad one); waits while
    /// the queue is full.
    pub async fn emit(&self, event: UsageEvent) -> Result<(), BillingError> {
        event.validate()?;
        self.tx
            .send(Msg::Event(Box::new(event)))
            .await
            .map_err(|_| BillingError::InvalidEvent("usage writer stopped"))
    }

    /// Returns once every event emitted before the call is committed, however many handles
    /// share this writer (the gateway keeps one until its last request is logged).
    pub async fn flush(&self) {
        let (tx, rx) = oneshot::channel();
        if self.tx.send(Msg::Flush(tx)).await.is_ok() {
            let _ = rx.await;
        }
    }

    /// The writer's counters.
    pub fn stats(&self) -> Arc<LocalIngestStats> {
        self.stats.clone()
    }

    /// Stops accepting events and returns once every queued event is committed.
    pub async fn shutdown(self) {
        drop(self.tx);
        if self.done.await.is_err() {
            tracing::error!("usage writer task failed before draining its queue");
        }
    }
}

async fn write_loop(
    ledger: Ledger,
    config: LocalIngestConfig,
    mut rx: mpsc::Receiver<Msg>,
    stats: Arc<LocalIngestStats>,
) {
    let mut batch = Vec::with_capacity(config.batch_size);
    while let Some(first) = rx.recv().await {
        let mut flushes = Vec::new();
        match first {
            Msg::Event(e) => batch.push(*e),
            Msg::Flush(done) => flushes.push(done),
        }
        // Linger once, then take what came: the writer wakes once per batch, not once per
        // event (on a busy gateway a wake-up per request is a context switch per request on
        // the cores that proxy). A full batch already queued, or a flush, is not kept waiting.
        if flushes.is_empty() && rx.len() + batch.len() < config.batch_size {
            tokio::time::sleep(config.linger).await;
        }
        while batch.len() < config.batch_size {
            match rx.try_recv() {
                Ok(Msg::Event(e)) => batch.push(*e),
                Ok(Msg::Flush(done)) => flushes.push(done),
                Err(_) => break,
            }
        }
        write(&ledger, &config, &batch, &stats).await;
        batch.clear();
        for done in flushes {
            let _ = done.send(());
        }
    }
}

/// Commits `batch`, waiting out database failures.
async fn write(
    ledger: &Ledger,
    config: &LocalIngestConfig,
    batch: &[UsageEvent],
    stats: &LocalIngestStats,
) {
    if batch.is_empty() {
        return;
    }
    let mut delay = config.retry_initial;
    loop {
        match ledger.insert_batch(batch).await {
            Ok(n) => {
                stats.inserted.fetch_add(n as u64, Ordering::Relaxed);
                stats.duplicates.fetch_add((batch.len() - n) as u64, Ordering::Relaxed);
                return;
            }
            Err(e) => {
                // Events were validated on entry, so a failure is the database's state
                // (locked, down, full disk): wait it out rather than lose a billed request.
                stats.failures.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    error = %e,
                    retry_in_ms = delay.as_millis() as u64,
                    events = batch.len(),
                    "usage write failed; retrying"
                );
                tokio::time::sleep(delay).await;
                delay = (delay * 2).min(config.retry_max);
            }
        }
    }
}
