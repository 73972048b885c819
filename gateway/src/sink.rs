//! Where the gateway sends usage events: the Redis Stream billing consumes (multi-machine),
//! or the in-process writer into the embedded ledger (`sluice up`).

use std::sync::Arc;

use sluice_billing::local::LocalIngest;
use sluice_billing::{BillingError, UsageEvent};

/// A usage event destination. Cheap to clone.
#[derive(Clone)]
pub enum UsageSink {
    /// `XADD` to the usage stream.
    Redis {
        /// Connection.
        conn: redis::aio::ConnectionManager,
        /// Stream name.
        stream: String,
    },
    /// In-process batched writer.
    Local(Arc<LocalIngest>),
}

impl UsageSink {
    /// Delivers one event (retrying Redis a few times before giving up loudly).
    pub async fn emit(&self, event: UsageEvent) -> Result<(), BillingError> {
        match self {
            Self::Local(l) => l.emit(event).await,
            Self::Redis { conn, stream } => {
                let mut delay = std::time::Duration::from_millis(20);
                let mut conn = conn.clone();
                for attempt in 0..6 {
                    match sluice_billing::ingest::publish_to(&mut conn, stream, &event).await {
                        Ok(_) => return Ok(()),
                        Err(e) if attempt == 5 || !e.is_retryable() => return Err(e),
                        Err(_) => {
                            tokio::time::sleep(delay).await;
                            delay *= 2;
                        }
                    }
                }
                Ok(())
            }
        }
    }
}
