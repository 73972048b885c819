//! Where the gateway sends usage events: the Redis Stream billing consumes (multi-machine),
//! or the in-process writer into the embedded ledger (`sluice up`).
//!
//! An event is never dropped while either path works: when Redis refuses it, it is written
//! straight into the ledger (idempotent on the request id, so a late duplicate through the
//! stream is harmless); when both fail, a background task keeps trying both, with backoff,
//! for as long as the process lives.

use std::sync::Arc;
use std::time::Duration;

use sluice_billing::local::LocalIngest;
use sluice_billing::{BillingError, Ledger, UsageEvent};

/// A usage event destination. Cheap to clone.
#[derive(Clone)]
pub enum UsageSink {
    /// `XADD` to the usage stream, falling back to the ledger.
    Redis {
        /// Connection.
        conn: redis::aio::ConnectionManager,
        /// Stream name.
        stream: String,
        /// Written directly when Redis fails.
        fallback: Ledger,
    },
    /// In-process batched writer.
    Local(Arc<LocalIngest>),
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

impl UsageSink {
    /// Delivers one event; see the module docs for what happens on failures.
    pub async fn emit(&self, event: UsageEvent) -> Result<Delivered, BillingError> {
        match self {
            Self::Local(l) => l.emit(event).await.map(|()| Delivered::Primary),
            Self::Redis { conn, stream, fallback } => {
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
                let (conn, stream, fallback) = (conn.clone(), stream.clone(), fallback.clone());
                tokio::spawn(async move {
                    let mut delay = Duration::from_millis(200);
                    loop {
                        tokio::time::sleep(delay).await;
                        let sent = matches!(
                            tokio::time::timeout(
                                Duration::from_secs(1),
                                publish(&conn, &stream, &event)
                            )
                            .await,
                            Ok(Ok(()))
                        );
                        if sent || fallback.insert_batch(std::slice::from_ref(&event)).await.is_ok()
                        {
                            tracing::info!(request_id = %event.request_id, "usage event delivered after an outage");
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
