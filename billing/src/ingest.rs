//! Durable, at-least-once usage ingestion from a Redis Stream into the [`Ledger`].
//!
//! Gateways `XADD {ns}:usage * event <json>` ([`publish_to`]; `ns` is the deployment's
//! `--redis-namespace`, `sluice` by default: [`USAGE_STREAM`]). Billing replicas share the
//! consumer group `billing`; each runs a [`UsageConsumer`] that reads a batch, inserts it with
//! [`Ledger::insert_batch`] and `XACK`s the entries only after the transaction committed. An
//! entry is therefore never acknowledged before it is in the ledger, and an entry delivered twice
//! (crash after commit, before ack) is absorbed by the idempotent insert.
//!
//! Recovery: on start a consumer first re-reads its own pending entries (same consumer name
//! after a restart), then `XAUTOCLAIM`s entries other consumers left pending for longer than
//! [`IngestConfig::claim_min_idle`]; it repeats the claim pass every
//! [`IngestConfig::claim_interval`] so a replica that dies for good is drained by the others.
//!
//! Failures: while the database is unreachable the same batch is retried with capped exponential
//! backoff and nothing is acknowledged. Entries that can never be inserted (undecodable, failing
//! validation, refused by a constraint) are copied to the dead-letter stream and acknowledged in
//! one MULTI/EXEC; logs carry the entry id and a reason category, never the payload.
//!
//! Keys carry the `{ns}` hash tag so the stream and its dead-letter stream live in one
//! Redis Cluster slot (required by the MULTI/EXEC). The stream is never trimmed here: trimming
//! could delete entries not yet consumed.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use redis::AsyncCommands;
use redis::aio::ConnectionLike;
use redis::streams::{
    StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadOptions, StreamReadReply,
};
use tokio::sync::watch;

use crate::redis_conn::{RedisConn, RedisTarget};
use crate::{BillingError, Ledger, UsageEvent};

/// Stream gateways publish usage events to, in the default namespace
/// ([`Namespace::usage_stream`](crate::redis_conn::Namespace::usage_stream) names another's).
pub const USAGE_STREAM: &str = "{sluice}:usage";
/// Stream that receives entries that can never be inserted: the usage stream's name and
/// `:dead` (the same hash tag, so the same Cluster slot).
pub const DEAD_LETTER_STREAM: &str = "{sluice}:usage:dead";
/// Consumer group shared by billing replicas.
pub const CONSUMER_GROUP: &str = "billing";
/// Stream entry field holding the JSON-encoded [`UsageEvent`].
pub const EVENT_FIELD: &str = "event";

/// Publishes one event to [`USAGE_STREAM`]; returns the stream entry id.
pub async fn publish<C>(conn: &mut C, event: &UsageEvent) -> Result<String, BillingError>
where
    C: ConnectionLike + Send + Sync,
{
    publish_to(conn, USAGE_STREAM, event).await
}

/// Publishes one event to `stream`; returns the stream entry id.
pub async fn publish_to<C>(
    conn: &mut C,
    stream: &str,
    event: &UsageEvent,
) -> Result<String, BillingError>
where
    C: ConnectionLike + Send + Sync,
{
    let id: String = conn.xadd(stream, "*", &[(EVENT_FIELD, entry(event)?)]).await?;
    Ok(id)
}

/// The stream entry's [`EVENT_FIELD`] value of a valid event.
pub fn entry(event: &UsageEvent) -> Result<String, BillingError> {
    event.validate()?;
    serde_json::to_string(event).map_err(BillingError::Encode)
}

/// Settings of one [`UsageConsumer`].
#[derive(Debug, Clone)]
pub struct IngestConfig {
    /// Stream to consume.
    pub stream: String,
    /// Where undecodable or unstorable entries go; must share the stream's hash slot.
    pub dead_letter_stream: String,
    /// Consumer group.
    pub group: String,
    /// This consumer's name, stable across restarts of the same replica.
    pub consumer: String,
    /// Most entries read and inserted per transaction.
    pub batch_size: usize,
    /// How long one `XREADGROUP` waits for new entries.
    pub block: Duration,
    /// Pending entries idle at least this long are taken over from other consumers.
    pub claim_min_idle: Duration,
    /// How often to look for abandoned pending entries while running.
    pub claim_interval: Duration,
    /// First wait before retrying a failed database write.
    pub retry_initial: Duration,
    /// Cap of the exponential backoff.
    pub retry_max: Duration,
}

impl IngestConfig {
    /// Defaults for the default namespace's stream and the group, under the given consumer
    /// name.
    pub fn new(consumer: impl Into<String>) -> Self {
        Self {
            stream: USAGE_STREAM.to_owned(),
            dead_letter_stream: DEAD_LETTER_STREAM.to_owned(),
            group: CONSUMER_GROUP.to_owned(),
            consumer: consumer.into(),
            batch_size: 500,
            block: Duration::from_secs(1),
            claim_min_idle: Duration::from_secs(60),
            claim_interval: Duration::from_secs(30),
            retry_initial: Duration::from_millis(100),
            retry_max: Duration::from_secs(10),
        }
    }
}

/// Counters a consumer updates as it works; shared so tests and metrics can watch it.
#[derive(Debug, Default)]
pub struct ConsumerStats {
    committed_batches: AtomicU64,
    inserted: AtomicU64,
    duplicates: AtomicU64,
    dead_lettered: AtomicU64,
    claimed: AtomicU64,
    database_failures: AtomicU64,
}

impl ConsumerStats {
    /// Batches committed and acknowledged.
    pub fn committed_batches(&self) -> u64 {
        self.committed_batches.load(Ordering::Relaxed)
    }
    /// Events that became new ledger rows.
    pub fn inserted(&self) -> u64 {
        self.inserted.load(Ordering::Relaxed)
    }
    /// Events acknowledged that the ledger already held (redeliveries, client retries).
    pub fn duplicates(&self) -> u64 {
        self.duplicates.load(Ordering::Relaxed)
    }
    /// Entries moved to the dead-letter stream.
    pub fn dead_lettered(&self) -> u64 {
        self.dead_lettered.load(Ordering::Relaxed)
    }
    /// Entries taken over from pending lists (own after restart, or other consumers').
    pub fn claimed(&self) -> u64 {
        self.claimed.load(Ordering::Relaxed)
    }
    /// Failed database writes that were retried.
    pub fn database_failures(&self) -> u64 {
        self.database_failures.load(Ordering::Relaxed)
    }
}

/// An entry that can never become a ledger row.
#[derive(Debug)]
struct Malformed {
    /// Log-safe category (never contains payload data).
    category: &'static str,
    /// Full reason, stored next to the payload in the dead-letter stream.
    detail: String,
    raw: Vec<u8>,
}

#[derive(Debug)]
struct Entry {
    id: String,
    event: Result<UsageEvent, Malformed>,
}

/// Entries read from the stream and not yet acknowledged.
#[derive(Debug)]
pub struct Batch {
    entries: Vec<Entry>,
}

impl Batch {
    /// Number of stream entries in the batch.
    pub fn len(&self) -> usize {
        self.entries.len()
    }
    /// Whether the batch holds no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
    /// Stream entry ids, in stream order.
    pub fn ids(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.id.as_str())
    }
}

/// What committing one batch did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CommitSummary {
    /// New ledger rows.
    pub inserted: usize,
    /// Valid events the ledger already held.
    pub duplicates: usize,
    /// Entries moved to the dead-letter stream.
    pub dead_lettered: usize,
}

/// Where the consumer is in its read cycle.
#[derive(Debug)]
enum Phase {
    /// Re-reading this consumer's own pending entries after `after`.
    OwnPending { after: String },
    /// Claiming abandoned entries, continuing from `cursor`.
    Claim { cursor: String },
    /// Reading new entries.
    New,
}

/// One member of the billing consumer group.
pub struct UsageConsumer {
    redis: RedisConn,
    ledger: Ledger,
    config: IngestConfig,
    stats: Arc<ConsumerStats>,
    phase: Phase,
    last_claim: Instant,
}

impl UsageConsumer {
    /// Connects and creates the consumer group (reading from the stream's start) if missing.
    pub async fn new(
        redis: impl Into<RedisTarget>,
        ledger: Ledger,
        config: IngestConfig,
    ) -> Result<Self, BillingError> {
        let mut redis = redis.into().connect().await?;
        let created: Result<(), redis::RedisError> =
            redis.xgroup_create_mkstream(&config.stream, &config.group, "0").await;
        match created {
            Ok(()) => {}
            Err(err) if err.code() == Some("BUSYGROUP") => {}
            Err(err) => return Err(err.into()),
        }
        Ok(Self {
            redis,
            ledger,
            config,
            stats: Arc::default(),
            phase: Phase::OwnPending { after: "0".to_owned() },
            last_claim: Instant::now(),
        })
    }

    /// Shared counters of this consumer.
    pub fn stats(&self) -> Arc<ConsumerStats> {
        Arc::clone(&self.stats)
    }

    /// Reads the next batch: own pending entries first, then abandoned ones, then new ones.
    /// Returns `None` when nothing arrived within [`IngestConfig::block`]. The entries stay
    /// pending (owned by this consumer) until the batch is committed.
    pub async fn next_batch(&mut self) -> Result<Option<Batch>, BillingError> {
        let count = self.config.batch_size;
        loop {
            match &mut self.phase {
                Phase::OwnPending { after } => {
                    let options = StreamReadOptions::default()
                        .group(&self.config.group, &self.config.consumer)
                        .count(count);
                    let reply: Option<StreamReadReply> = self
                        .redis
                        .xread_options(&[&self.config.stream], &[after.as_str()], &options)
                        .await?;
                    let ids = stream_ids(reply);
                    match ids.last() {
                        Some(last) => {
                            *after = last.id.clone();
                            self.stats.claimed.fetch_add(ids.len() as u64, Ordering::Relaxed);
                            return Ok(Some(Batch::decode(ids)));
                        }
                        None => self.phase = Phase::Claim { cursor: "0-0".to_owned() },
                    }
                }
                Phase::Claim { cursor } => {
                    let min_idle =
                        u64::try_from(self.config.claim_min_idle.as_millis()).unwrap_or(u64::MAX);
                    let reply: StreamAutoClaimReply = self
                        .redis
                        .xautoclaim_options(
                            &self.config.stream,
                            &self.config.group,
                            &self.config.consumer,
                            min_idle,
                            cursor.as_str(),
                            StreamAutoClaimOptions::default().count(count),
                        )
                        .await?;
                    if !reply.deleted_ids.is_empty() {
                        tracing::warn!(
                            count = reply.deleted_ids.len(),
                            "pending usage entries were trimmed from the stream before ingestion"
                        );
                    }
                    if reply.next_stream_id == "0-0" {
                        self.phase = Phase::New;
                        self.last_claim = Instant::now();
                    } else {
                        *cursor = reply.next_stream_id;
                    }
                    if !reply.claimed.is_empty() {
                        let claimed = reply.claimed.len() as u64;
                        self.stats.claimed.fetch_add(claimed, Ordering::Relaxed);
                        tracing::info!(count = claimed, "claimed abandoned usage entries");
                        return Ok(Some(Batch::decode(reply.claimed)));
                    }
                }
                Phase::New => {
                    if self.last_claim.elapsed() >= self.config.claim_interval {
                        self.phase = Phase::Claim { cursor: "0-0".to_owned() };
                        continue;
                    }
                    let block =
                        usize::try_from(self.config.block.as_millis()).unwrap_or(usize::MAX);
                    let options = StreamReadOptions::default()
                        .group(&self.config.group, &self.config.consumer)
                        .count(count)
                        .block(block);
                    let reply: Option<StreamReadReply> =
                        self.redis.xread_options(&[&self.config.stream], &[">"], &options).await?;
                    let ids = stream_ids(reply);
                    return Ok((!ids.is_empty()).then(|| Batch::decode(ids)));
                }
            }
        }
    }

    /// Inserts the batch (retrying the database with backoff until it succeeds) and acknowledges
    /// it after the commit. Returns `None`, acknowledging nothing, if `shutdown` fires first.
    pub async fn commit(
        &mut self,
        batch: Batch,
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<CommitSummary>, BillingError> {
        let mut summary = CommitSummary::default();
        let mut valid: Vec<(String, UsageEvent)> = Vec::with_capacity(batch.len());
        for entry in batch.entries {
            match entry.event {
                Ok(event) => valid.push((entry.id, event)),
                Err(malformed) => {
                    self.dead_letter(&entry.id, &malformed).await?;
                    summary.dead_lettered += 1;
                }
            }
        }
        if valid.is_empty() {
            return Ok(Some(summary));
        }
        let Some((inserted, rejected)) = self.insert_with_retry(&valid, shutdown).await? else {
            return Ok(None);
        };
        for (id, malformed) in &rejected {
            self.dead_letter(id, malformed).await?;
            summary.dead_lettered += 1;
        }
        let ids: Vec<&str> = valid
            .iter()
            .map(|(id, _)| id.as_str())
            .filter(|id| !rejected.iter().any(|(r, _)| r == id))
            .collect();
        if !ids.is_empty() {
            let _acked: usize =
                self.redis.xack(&self.config.stream, &self.config.group, &ids).await?;
        }
        summary.inserted = inserted;
        summary.duplicates = ids.len() - inserted;
        self.stats.committed_batches.fetch_add(1, Ordering::Relaxed);
        self.stats.inserted.fetch_add(inserted as u64, Ordering::Relaxed);
        self.stats.duplicates.fetch_add(summary.duplicates as u64, Ordering::Relaxed);
        Ok(Some(summary))
    }

    /// Consumes until `shutdown` becomes true (or its sender is dropped). Database outages are
    /// waited out; Redis errors are retried with the same backoff. Whatever is in flight at
    /// shutdown stays pending and is picked up by the next start or another replica.
    pub async fn run(mut self, mut shutdown: watch::Receiver<bool>) -> Result<(), BillingError> {
        let mut delay = self.config.retry_initial;
        while !*shutdown.borrow() {
            let step = tokio::select! {
                batch = self.next_batch() => batch,
                _ = shutdown.changed() => break,
            };
            let result = match step {
                Ok(Some(batch)) => match self.commit(batch, &mut shutdown).await {
                    Ok(Some(_)) => Ok(()),
                    Ok(None) => break,
                    Err(err) => Err(err),
                },
                Ok(None) => Ok(()),
                Err(err) => Err(err),
            };
            match result {
                Ok(()) => delay = self.config.retry_initial,
                Err(err) => {
                    tracing::warn!(
                        error = %err,
                        retry_in_ms = delay.as_millis() as u64,
                        "usage ingestion step failed"
                    );
                    // Whatever this consumer read but did not acknowledge is re-read next.
                    self.phase = Phase::OwnPending { after: "0".to_owned() };
                    if wait_or_shutdown(delay, &mut shutdown).await {
                        break;
                    }
                    delay = (delay * 2).min(self.config.retry_max);
                }
            }
        }
        Ok(())
    }

    /// Returns the number of new rows and the events the database refused for good, or `None`
    /// on shutdown. Retryable failures (outage, timeout) retry the whole batch with backoff; a
    /// permanent failure inserts the events one by one so one bad row cannot block the rest.
    async fn insert_with_retry(
        &mut self,
        entries: &[(String, UsageEvent)],
        shutdown: &mut watch::Receiver<bool>,
    ) -> Result<Option<(usize, Vec<(String, Malformed)>)>, BillingError> {
        let events: Vec<UsageEvent> = entries.iter().map(|(_, e)| e.clone()).collect();
        let mut delay = self.config.retry_initial;
        loop {
            let err = match self.ledger.insert_batch(&events).await {
                Ok(inserted) => return Ok(Some((inserted, Vec::new()))),
                Err(err) if err.is_retryable() => err,
                Err(_) => match self.insert_one_by_one(entries).await {
                    Ok(outcome) => return Ok(Some(outcome)),
                    Err(err) => err,
                },
            };
            self.stats.database_failures.fetch_add(1, Ordering::Relaxed);
            tracing::warn!(
                error = %err,
                events = events.len(),
                retry_in_ms = delay.as_millis() as u64,
                "ledger write failed; batch kept pending and retried"
            );
            if wait_or_shutdown(delay, shutdown).await {
                return Ok(None);
            }
            delay = (delay * 2).min(self.config.retry_max);
        }
    }

    async fn insert_one_by_one(
        &self,
        entries: &[(String, UsageEvent)],
    ) -> Result<(usize, Vec<(String, Malformed)>), BillingError> {
        let mut inserted = 0;
        let mut rejected = Vec::new();
        for (id, event) in entries {
            match self.ledger.insert_batch(std::slice::from_ref(event)).await {
                Ok(n) => inserted += n,
                Err(err) if err.is_retryable() => return Err(err),
                Err(err) => rejected.push((
                    id.clone(),
                    Malformed {
                        category: err.error_type(),
                        detail: err.to_string(),
                        raw: serde_json::to_vec(event).unwrap_or_default(),
                    },
                )),
            }
        }
        Ok((inserted, rejected))
    }

    /// Copies the entry to the dead-letter stream and acknowledges it, atomically.
    async fn dead_letter(&mut self, id: &str, malformed: &Malformed) -> Result<(), BillingError> {
        let fields: [(&str, &[u8]); 3] = [
            ("source_id", id.as_bytes()),
            ("reason", malformed.detail.as_bytes()),
            (EVENT_FIELD, malformed.raw.as_slice()),
        ];
        redis::pipe()
            .atomic()
            .xadd(&self.config.dead_letter_stream, "*", &fields)
            .ignore()
            .xack(&self.config.stream, &self.config.group, &[id])
            .ignore()
            .query_async::<()>(&mut self.redis)
            .await?;
        self.stats.dead_lettered.fetch_add(1, Ordering::Relaxed);
        tracing::warn!(entry_id = id, reason = malformed.category, "usage entry dead-lettered");
        Ok(())
    }
}

/// Sleeps for `delay`; returns true if shutdown was requested meanwhile.
async fn wait_or_shutdown(delay: Duration, shutdown: &mut watch::Receiver<bool>) -> bool {
    tokio::select! {
        () = tokio::time::sleep(delay) => *shutdown.borrow(),
        changed = shutdown.changed() => changed.is_err() || *shutdown.borrow(),
    }
}

fn stream_ids(reply: Option<StreamReadReply>) -> Vec<StreamId> {
    reply.map(|r| r.keys.into_iter().flat_map(|k| k.ids).collect()).unwrap_or_default()
}

impl Batch {
    fn decode(ids: Vec<StreamId>) -> Self {
        let entries = ids
            .into_iter()
            .map(|stream_id| {
                let event = decode_entry(&stream_id);
                Entry { id: stream_id.id, event }
            })
            .collect();
        Self { entries }
    }
}

fn decode_entry(stream_id: &StreamId) -> Result<UsageEvent, Malformed> {
    let raw: Vec<u8> = match stream_id.map.get(EVENT_FIELD) {
        Some(value) => redis::from_redis_value(value).map_err(|err| Malformed {
            category: "event field is not a string",
            detail: err.to_string(),
            raw: Vec::new(),
        })?,
        None => {
            return Err(Malformed {
                category: "missing event field",
                detail: "missing event field".to_owned(),
                raw: Vec::new(),
            });
        }
    };
    let event: UsageEvent = match serde_json::from_slice(&raw) {
        Ok(event) => event,
        Err(err) => {
            return Err(Malformed { category: "invalid json", detail: err.to_string(), raw });
        }
    };
    if let Err(err) = event.validate() {
        let category = match err {
            BillingError::InvalidEvent(message) => message,
            _ => "invalid event",
        };
        return Err(Malformed { category, detail: err.to_string(), raw });
    }
    Ok(event)
}

#[cfg(test)]
mod tests {
    use super::{DEAD_LETTER_STREAM, USAGE_STREAM};
    use crate::redis_conn::Namespace;

    #[test]
    fn the_default_streams_are_the_default_namespaces() {
        assert_eq!(Namespace::default().usage_stream(), USAGE_STREAM);
        assert_eq!(format!("{USAGE_STREAM}:dead"), DEAD_LETTER_STREAM);
    }
}
