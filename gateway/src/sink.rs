//! Where the gateway sends usage events: the Redis Stream billing consumes (multi-machine),
//! or the in-process writer into the embedded ledger (`sluice up`).
//!
//! An event is never dropped while either path works: when Redis refuses it, it is written
//! straight into the ledger (idempotent on the request id, so a late duplicate through the
//! stream is harmless); when both fail, a background task keeps trying both, with backoff,
//! for as long as the process lives. At exit [`UsageSink::flush`] waits for those, and
//! `finish` logs any still undelivered (counts, hashes and ids only: an event never holds
//! prompt text) so an operator can replay them.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sluice_billing::local::LocalIngest;
use sluice_billing::{BillingError, Ledger, UsageEvent};
use sluice_policies::redis_conn::RedisConn;

/// A usage event destination. Cheap to clone.
#[derive(Clone)]
pub enum UsageSink {
    /// `XADD` to the usage stream, falling back to the ledger.
    Redis {
        /// Connection.
        conn: RedisConn,
        /// Stream name.
        stream: String,
        /// Written directly when Redis fails.
        fallback: Ledger,
        /// Events neither path took yet, retried in the background.
        retrying: Arc<Retrying>,
    },
    /// In-process batched writer.
    Local(Arc<LocalIngest>),
}

/// Events being retried in the background, by request id.
#[derive(Debug, Default)]
pub struct Retrying {
    events: Mutex<HashMap<String, UsageEvent>>,
    changed: tokio::sync::Notify,
}

impl Retrying {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, UsageEvent>> {
        self.events.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn add(&self, event: &UsageEvent) {
        self.lock().insert(event.request_id.clone(), event.clone());
    }

    fn done(&self, request_id: &str) {
        self.lock().remove(request_id);
        self.changed.notify_waiters();
    }
}

/// How an event reached billing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Delivered {
    /// Through the usage stream (or the in-process writer).
    Primary,
    /// Straight into the ledger because Redis failed.
    Fallback,
    /// Neither worked yet; a background task keeps trying.
    Retrying,
}

/// How long an event's `XADD` on a Redis Cluster waits for a replica to have it.
const REPLICA_WAIT_MS: u64 = 100;

/// `XADD`s the event. On a Redis Cluster the same round trip asks `WAIT 1`: an entry no
/// replica acknowledged would be lost if its primary failed over now, so it is returned as
/// `Ok(false)` and the caller writes the event to the ledger as well (the consumer's later
/// insert of the same request id is absorbed as a duplicate).
async fn publish(conn: &RedisConn, stream: &str, event: &UsageEvent) -> Result<bool, BillingError> {
    let mut conn = conn.clone();
    if !matches!(conn, RedisConn::Cluster(_)) {
        return sluice_billing::ingest::publish_to(&mut conn, stream, event).await.map(|_| true);
    }
    let json = sluice_billing::ingest::entry(event)?;
    let (_id, replicas): (String, i64) = redis::pipe()
        .xadd(stream, "*", &[(sluice_billing::ingest::EVENT_FIELD, json)])
        .cmd("WAIT")
        .arg(1)
        .arg(REPLICA_WAIT_MS)
        .query_async(&mut conn)
        .await?;
    Ok(replicas > 0)
}

/// One background retry: true only once the stream has the event durably (on a Cluster, on
/// a replica too).
async fn durably_published(conn: &RedisConn, stream: &str, event: &UsageEvent) -> bool {
    matches!(
        tokio::time::timeout(Duration::from_secs(2), publish(conn, stream, event)).await,
        Ok(Ok(true))
    )
}

impl UsageSink {
    /// Delivers one event; see the module docs for what happens on failures.
    pub async fn emit(&self, event: UsageEvent) -> Result<Delivered, BillingError> {
        match self {
            Self::Local(l) => l.emit(event).await.map(|()| Delivered::Primary),
            Self::Redis { conn, stream, fallback, retrying } => {
                event.validate()?;
                let mut delay = Duration::from_millis(20);
                for attempt in 0..3 {
                    match tokio::time::timeout(
                        Duration::from_secs(1),
                        publish(conn, stream, &event),
                    )
                    .await
                    {
                        Ok(Ok(true)) => return Ok(Delivered::Primary),
                        Ok(Ok(false)) => {
                            // In the stream, on its primary alone: the ledger gets it too,
                            // else it is retried below like an event nothing took.
                            if fallback.insert_batch(std::slice::from_ref(&event)).await.is_ok() {
                                return Ok(Delivered::Primary);
                            }
                            tracing::warn!(request_id = %event.request_id, "usage event on an unreplicated primary only; retrying");
                            break;
                        }
                        Ok(Err(e)) if !e.is_retryable() => return Err(e),
                        Ok(Err(e)) => {
                            tracing::warn!(error = %e, attempt, "usage stream refused an event")
                        }
                        Err(_) => tracing::warn!(attempt, "usage stream timed out"),
                    }
                    tokio::time::sleep(delay).await;
                    delay *= 2;
                }
                if fallback.insert_batch(std::slice::from_ref(&event)).await.is_ok() {
                    return Ok(Delivered::Fallback);
                }
                tracing::error!(request_id = %event.request_id, "usage stream and ledger both down; retrying in the background");
                retrying.add(&event);
                let (conn, stream, fallback) = (conn.clone(), stream.clone(), fallback.clone());
                let retrying = Arc::clone(retrying);
                tokio::spawn(async move {
                    let mut delay = Duration::from_millis(200);
                    loop {
                        tokio::time::sleep(delay).await;
                        let sent = durably_published(&conn, &stream, &event).await;
                        if sent || fallback.insert_batch(std::slice::from_ref(&event)).await.is_ok()
                        {
                            tracing::info!(request_id = %event.request_id, "usage event delivered after an outage");
                            retrying.done(&event.request_id);
                            return;
                        }
                        delay = (delay * 2).min(Duration::from_secs(10));
                    }
                });
                Ok(Delivered::Retrying)
            }
        }
    }
}

impl UsageSink {
    /// Whether the event of `request_id` is being retried in the background.
    pub fn retrying(&self, request_id: &str) -> bool {
        matches!(self, Self::Redis { retrying, .. } if retrying.lock().contains_key(request_id))
    }

    /// Returns once the event of `request_id` is no longer being retried (delivered).
    pub async fn delivered(&self, request_id: &str) {
        let Self::Redis { retrying, .. } = self else { return };
        loop {
            let changed = retrying.changed.notified();
            if !retrying.lock().contains_key(request_id) {
                return;
            }
            changed.await;
        }
    }

    /// Waits up to `within` for the events being retried in the background; returns those
    /// still undelivered then (the process is about to exit and take their tasks with it).
    pub async fn flush(&self, within: Duration) -> Vec<UsageEvent> {
        let Self::Redis { retrying, .. } = self else { return Vec::new() };
        let deadline = Instant::now() + within;
        loop {
            let changed = retrying.changed.notified();
            let left = retrying.lock().len();
            if left == 0 {
                return Vec::new();
            }
            let wait = deadline.saturating_duration_since(Instant::now());
            if wait.is_zero() {
                return retrying.lock().values().cloned().collect();
            }
            tracing::info!(events = left, "waiting for usage events retried in the background");
            let _ = tokio::time::timeout(wait.min(Duration::from_millis(500)), changed).await;
        }
    }
}
