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

/// A usage event destination. Cheap to clone.
#[derive(Clone)]
pub enum UsageSink {
    /// `XADD` to the usage stream, falling back to the ledger.
    Redis {
        /// For the background retries: a fresh connection each time (a connection manager
        /// can stay wedged after a long outage; see `retry_publish`).
        client: redis::Client,
        /// Connection.
        conn: redis::aio::ConnectionManager,
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

async fn publish(
    conn: &redis::aio::ConnectionManager,
    stream: &str,
    event: &UsageEvent,
) -> Result<(), BillingError> {
    let mut conn = conn.clone();
    sluice_billing::ingest::publish_to(&mut conn, stream, event).await.map(|_| ())
}

/// One background retry over a connection of its own: the shared connection manager was seen
/// to leave every command pending, even after Redis came back, once an outage outlasted its
/// reconnection attempts (redis 0.32), and an event must not wait on that.
async fn retry_publish(client: &redis::Client, stream: &str, event: &UsageEvent) -> bool {
    let attempt = async {
        let mut conn = client.get_multiplexed_async_connection().await?;
        sluice_billing::ingest::publish_to(&mut conn, stream, event).await.map_err(|e| {
            redis::RedisError::from((redis::ErrorKind::IoError, "publish", e.to_string()))
        })
    };
    matches!(tokio::time::timeout(Duration::from_secs(2), attempt).await, Ok(Ok(_)))
}

impl UsageSink {
    /// Delivers one event; see the module docs for what happens on failures.
    pub async fn emit(&self, event: UsageEvent) -> Result<Delivered, BillingError> {
        match self {
            Self::Local(l) => l.emit(event).await.map(|()| Delivered::Primary),
            Self::Redis { client, conn, stream, fallback, retrying } => {
                event.validate()?;
                let mut delay = Duration::from_millis(20);
                for attempt in 0..3 {
                    match tokio::time::timeout(
                        Duration::from_secs(1),
                        publish(conn, stream, &event),
                    )
                    .await
                    {
                        Ok(Ok(())) => return Ok(Delivered::Primary),
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
                let (client, stream, fallback) = (client.clone(), stream.clone(), fallback.clone());
                let retrying = Arc::clone(retrying);
                tokio::spawn(async move {
                    let mut delay = Duration::from_millis(200);
                    loop {
                        tokio::time::sleep(delay).await;
                        let sent = retry_publish(&client, &stream, &event).await;
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
