//! The in-flight journal: every request a gateway has sent to an engine and not yet billed,
//! kept in Redis, so a gateway that dies mid-request (SIGKILL, out of memory, a lost machine)
//! loses no usage.
//!
//! Before a request goes to an engine its usage event is written to this gateway's journal
//! (a hash, request id -> [`Entry`]) as it would be billed with nothing generated; when its
//! real event has been delivered the entry is removed. Each gateway keeps an `alive` key with
//! a short expiry fresh and lists itself in the set of gateways. Every gateway sweeps that set:
//! the journal of one whose `alive` key has expired is recovered, each entry billed by what
//! its engine says it did (`GET /v1/internal/requests/{id}`: the engine ended the request
//! itself when the dead gateway's connection closed), its Redis reservation settled with the
//! tokens used, its idempotency claim released, the entry removed. Billing is idempotent on the request id, so an event the
//! dead gateway delivered just before it died is billed once. An entry the engine does not
//! know a minute after it was routed never ran there (or the engine restarted) and is billed
//! as a failure, free; one the engine keeps running, or an engine that cannot be reached, is
//! tried again on later sweeps for up to [`GIVE_UP`].
//!
//! A recovered row says `error_type = gateway_lost`. Its tokens are what the engine counted:
//! a stream forwarded them as they came, so the client received them or all but the last few.
//! Nothing in the journal holds prompt text (the event carries its hash and length).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use chrono::Utc;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use sluice_billing::{FinishReason, UsageEvent};
use sluice_policies::prices::Rates;
use sluice_policies::redis_conn::RedisConn;
use sluice_wire::FinishReason as Ended;

use crate::engine_client::EngineClient;
use crate::idempotency::Idempotency;
use crate::limits::{Limiter, REDIS_TIMEOUT};
use crate::sink::{Delivered, UsageSink};

/// How often a gateway refreshes its `alive` key.
const BEAT_EVERY: Duration = Duration::from_secs(2);

/// How long a gateway is taken for alive after its last beat.
pub const ALIVE_FOR: Duration = Duration::from_secs(10);

/// How often a gateway looks for the journals of dead ones.
const SWEEP_EVERY: Duration = Duration::from_secs(3);

/// How long after its routing an engine that has no record of a request is believed.
const GRACE: Duration = Duration::from_secs(60);

/// How long an entry is retried (an engine unreachable or still running it) before it is
/// billed as unverified, free.
pub const GIVE_UP: Duration = Duration::from_secs(15 * 60);

/// How long the recovery waits on an engine for a request still running.
const OUTCOME_WAIT: Duration = Duration::from_secs(5);

/// Delivered requests removed from the journal in one command at most.
const FORGET_BATCH: usize = 512;

/// About how long removing delivered requests is retried (doubling waits from 0.5 s).
const FORGET_FOR: Duration = Duration::from_secs(300);

/// How long one sweeper may hold a dead gateway's journal.
const LOCK_FOR: Duration = Duration::from_secs(120);

/// How long one sweep recovers a journal before leaving the rest to the next.
const RECOVER_FOR: Duration = Duration::from_secs(60);

/// How long after its engine ended it an entry is left to its gateway (one taken for dead,
/// its heartbeat lost in a Redis restart, may still deliver the real event: up to about 3 s
/// of retries before the ledger fallback).
const LIVE_GRACE: Duration = Duration::from_secs(15);

/// Entries whose engines are asked at once.
const AT_ONCE: usize = 32;

/// The error type of a recovered row.
pub const GATEWAY_LOST: &str = "gateway_lost";

/// One request in flight at an engine.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Entry {
    /// Its usage event as billed with nothing generated (the engine's count goes in).
    pub event: UsageEvent,
    /// When it was routed to `event.engine_worker`, ms since the Unix epoch.
    pub routed_ms: i64,
    /// The API key whose own limits its Redis reservation was made under, if any.
    pub limit_key: Option<String>,
    /// The client's `Idempotency-Key`, when its claim is in Redis (released on recovery, so
    /// a retry runs anew rather than getting 409 for an hour).
    pub claim_key: Option<String>,
}

/// This gateway's journal, and its part in recovering others'.
pub struct Journal {
    conn: RedisConn,
    /// Delivered requests whose entries are removed in the background, in batches.
    delivered: tokio::sync::mpsc::UnboundedSender<Forget>,
    to_forget: std::sync::Mutex<Option<tokio::sync::mpsc::UnboundedReceiver<Forget>>>,
    /// Set at a clean exit: the heartbeat stops.
    closed: std::sync::atomic::AtomicBool,
    /// Deletes a recovery lock only if it is still this gateway's.
    release: redis::Script,
    prefix: String,
    /// The usage stream: gateways recover only the journals of those billing through theirs.
    stream: String,
    id: String,
}

/// What recovering a journal needs: where events go, the limits to settle, the engines' API.
#[derive(Clone)]
pub struct Recovery {
    /// Where recovered events go.
    pub sink: UsageSink,
    /// The shared limits whose reservations are settled.
    pub limiter: Option<Limiter>,
    /// The engines' API.
    pub engines: EngineClient,
    /// The idempotency claims released.
    pub idempotency: Arc<Idempotency>,
    /// Counts the requests billed.
    pub recovered: prometheus_client::metrics::counter::Counter,
}

/// What the removal task is given.
enum Forget {
    /// A delivered request.
    Id(String),
    /// Answered once everything sent before it is removed.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// What came of one entry.
#[derive(Debug, PartialEq, Eq)]
enum Settled {
    /// Its event delivered: removed.
    Billed,
    /// Not billable (unreadable, or refused by the ledger's checks): removed.
    Dropped,
    /// Tried again at a later sweep.
    Later,
}

/// Time since `ms` (since the Unix epoch); zero for a time ahead of this clock.
fn since(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(Utc::now().timestamp_millis() - ms).unwrap_or(0))
}

pub(crate) async fn timed<T>(
    f: impl std::future::Future<Output = redis::RedisResult<T>>,
) -> redis::RedisResult<T> {
    tokio::time::timeout(REDIS_TIMEOUT, f).await.unwrap_or_else(|_| {
        Err(redis::RedisError::from((redis::ErrorKind::IoError, "Redis timed out")))
    })
}

impl Journal {
    /// A journal under `prefix` (the limits' prefix) among the gateways that send usage to
    /// `stream`, with a fresh id for this process.
    pub fn new(conn: RedisConn, prefix: &str, stream: &str) -> Self {
        let (delivered, to_forget) = tokio::sync::mpsc::unbounded_channel();
        Self {
            conn,
            delivered,
            to_forget: std::sync::Mutex::new(Some(to_forget)),
            closed: std::sync::atomic::AtomicBool::new(false),
            release: redis::Script::new(
                "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end",
            ),
            prefix: prefix.to_owned(),
            stream: stream.to_owned(),
            id: uuid::Uuid::new_v4().simple().to_string(),
        }
    }

    /// This process's id among the gateways.
    pub fn id(&self) -> &str {
        &self.id
    }

    // One hash tag per gateway: its journal and `alive` key share a Cluster slot.
    fn journal_key(&self, id: &str) -> String {
        format!("{}:journal:{{gw-{id}}}", self.prefix)
    }

    fn alive_key(&self, id: &str) -> String {
        format!("{}:alive:{{gw-{id}}}", self.prefix)
    }

    fn recovering_key(&self, id: &str) -> String {
        format!("{}:recovering:{{gw-{id}}}", self.prefix)
    }

    fn members_key(&self) -> String {
        format!("{}:gateways:{}", self.prefix, self.stream)
    }

    /// Records a request about to be sent to its engine (again, when it is retried on another).
    pub async fn write(&self, entry: &Entry) -> redis::RedisResult<()> {
        let json = serde_json::to_string(entry).map_err(|e| {
            redis::RedisError::from((redis::ErrorKind::TypeError, "entry", e.to_string()))
        })?;
        let mut conn = self.conn.clone();
        let cmd = redis::cmd("HSET")
            .arg(self.journal_key(&self.id))
            .arg(&entry.event.request_id)
            .arg(json)
            .clone();
        timed(cmd.query_async::<()>(&mut conn)).await
    }

    /// Requests whose events have been delivered.
    pub async fn forget(&self, request_ids: &[String]) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        let cmd = redis::cmd("HDEL").arg(self.journal_key(&self.id)).arg(request_ids).clone();
        timed(cmd.query_async::<()>(&mut conn)).await
    }

    /// A request whose event has been delivered, removed in the background with others (no
    /// wait on the request's path; were this gateway to die first, its recovery would bill
    /// the request again, which billing absorbs).
    pub fn forget_later(&self, request_id: String) {
        let _ = self.delivered.send(Forget::Id(request_id));
    }

    /// Removes what [`Journal::forget_later`] was given, in batches; a batch Redis refuses is
    /// tried again for about [`FORGET_FOR`].
    async fn forget_delivered(&self, mut rx: tokio::sync::mpsc::UnboundedReceiver<Forget>) {
        let mut batch = Vec::new();
        while rx.recv_many(&mut batch, FORGET_BATCH).await > 0 {
            let mut ids = Vec::new();
            let mut flushed = Vec::new();
            for f in batch.drain(..) {
                match f {
                    Forget::Id(id) => ids.push(id),
                    Forget::Flush(done) => flushed.push(done),
                }
            }
            let mut delay = Duration::from_millis(500);
            while !ids.is_empty()
                && let Err(e) = self.forget(&ids).await
            {
                if delay > FORGET_FOR || !flushed.is_empty() {
                    tracing::warn!(error = %e, entries = ids.len(), "delivered requests left in the journal");
                    break;
                }
                tokio::time::sleep(delay).await;
                delay *= 2;
            }
            for done in flushed {
                let _ = done.send(());
            }
        }
    }

    /// At a clean exit, once every event is delivered: the last removals are made and the
    /// heartbeat stops, so whatever is left (events still undelivered) is recovered by
    /// another gateway at its next sweep.
    pub async fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::Relaxed);
        let (done, flushed) = tokio::sync::oneshot::channel();
        if self.delivered.send(Forget::Flush(done)).is_ok() {
            let _ = tokio::time::timeout(Duration::from_secs(5), flushed).await;
        }
        let mut conn = self.conn.clone();
        let alive = redis::cmd("DEL").arg(self.alive_key(&self.id)).clone();
        if let Err(e) = timed(alive.query_async::<()>(&mut conn)).await {
            tracing::warn!(error = %e, "the journal's heartbeat key stays until it expires");
        }
    }

    /// Says this gateway is alive.
    pub async fn beat(&self) -> redis::RedisResult<()> {
        let mut conn = self.conn.clone();
        let alive = redis::cmd("SET")
            .arg(self.alive_key(&self.id))
            .arg(1)
            .arg("PX")
            .arg(ALIVE_FOR.as_millis() as u64)
            .clone();
        timed(alive.query_async::<()>(&mut conn)).await?;
        let member = redis::cmd("SADD").arg(self.members_key()).arg(&self.id).clone();
        timed(member.query_async::<()>(&mut conn)).await
    }

    /// Beats and sweeps on `io` for as long as the process lives.
    pub fn spawn(self: &Arc<Self>, io: &tokio::runtime::Handle, recovery: Recovery) {
        let taken = self.to_forget.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(rx) = taken {
            let me = Arc::clone(self);
            io.spawn(async move { me.forget_delivered(rx).await });
        }
        let me = Arc::clone(self);
        io.spawn(async move {
            while !me.closed.load(std::sync::atomic::Ordering::Relaxed) {
                if let Err(e) = me.beat().await {
                    tracing::warn!(error = %e, "the journal's heartbeat failed");
                }
                tokio::time::sleep(BEAT_EVERY).await;
            }
        });
        let me = Arc::clone(self);
        io.spawn(async move {
            loop {
                tokio::time::sleep(SWEEP_EVERY).await;
                match me.sweep(&recovery).await {
                    Ok(0) => {}
                    Ok(n) => {
                        recovery.recovered.inc_by(n as u64);
                        tracing::info!(billed = n, "recovered a dead gateway's requests")
                    }
                    Err(e) => tracing::warn!(error = %e, "sweeping dead gateways' journals failed"),
                }
            }
        });
    }

    /// Recovers the journal of every gateway that stopped beating; the number of requests
    /// billed.
    pub async fn sweep(&self, recovery: &Recovery) -> redis::RedisResult<usize> {
        let mut conn = self.conn.clone();
        let members: Vec<String> =
            timed(redis::cmd("SMEMBERS").arg(self.members_key()).query_async(&mut conn)).await?;
        let mut billed = 0;
        for gw in members.iter().filter(|g| **g != self.id) {
            let alive: bool =
                timed(redis::cmd("EXISTS").arg(self.alive_key(gw)).query_async(&mut conn)).await?;
            if alive {
                continue;
            }
            // One sweeper at a time per dead gateway (a second would only bill the same ids
            // again, which billing absorbs).
            let claimed: Option<String> = timed(
                redis::cmd("SET")
                    .arg(self.recovering_key(gw))
                    .arg(&self.id)
                    .arg("NX")
                    .arg("PX")
                    .arg(LOCK_FOR.as_millis() as u64)
                    .query_async(&mut conn),
            )
            .await?;
            if claimed.is_none() {
                continue;
            }
            let result = self.recover(gw, recovery).await;
            let mut inv = self.release.key(self.recovering_key(gw));
            let _ = timed(inv.arg(&self.id).invoke_async::<()>(&mut conn)).await;
            billed += result?;
        }
        Ok(billed)
    }

    /// Bills what can be billed of `gw`'s journal; forgets the gateway once it is empty.
    async fn recover(&self, gw: &str, recovery: &Recovery) -> redis::RedisResult<usize> {
        let mut conn = self.conn.clone();
        let key = self.journal_key(gw);
        let entries: HashMap<String, String> =
            timed(redis::cmd("HGETALL").arg(&key).query_async(&mut conn)).await?;
        // Engines asked at once (one still running a request waits up to OUTCOME_WAIT); the
        // rest waits for a later sweep once RECOVER_FOR has passed (well within the lock).
        let began = std::time::Instant::now();
        let mut settled = futures_util::stream::iter(entries)
            .map(|(id, json)| async move {
                let settled = match serde_json::from_str::<Entry>(&json) {
                    Ok(entry) => settle(entry, recovery).await,
                    Err(e) => {
                        tracing::error!(request_id = %id, gateway = %gw, error = %e,
                            "a journal entry is unreadable; it cannot be billed");
                        Settled::Dropped
                    }
                };
                (id, settled)
            })
            .buffer_unordered(AT_ONCE);
        let mut billed = 0;
        while let Some((id, settled)) = settled.next().await {
            if settled != Settled::Later {
                timed(redis::cmd("HDEL").arg(&key).arg(&id).query_async::<()>(&mut conn)).await?;
            }
            billed += usize::from(settled == Settled::Billed);
            if began.elapsed() > RECOVER_FOR {
                return Ok(billed);
            }
        }
        let left: u64 = timed(redis::cmd("HLEN").arg(&key).query_async(&mut conn)).await?;
        // Forgotten only while still silent (a gateway taken for dead that beats again lists
        // itself again within BEAT_EVERY).
        let alive: bool =
            timed(redis::cmd("EXISTS").arg(self.alive_key(gw)).query_async(&mut conn)).await?;
        if left == 0 && !alive {
            timed(redis::cmd("SREM").arg(self.members_key()).arg(gw).query_async::<()>(&mut conn))
                .await?;
        }
        Ok(billed)
    }
}

/// Bills one entry of a dead gateway's journal by its engine's count.
async fn settle(mut entry: Entry, recovery: &Recovery) -> Settled {
    let age = since(entry.routed_ms);
    let ev = &mut entry.event;
    if recovery.sink.retrying(&ev.request_id) {
        // Its recovered event already waits for Redis or the ledger in this process.
        return Settled::Later;
    }
    let outcome = match &ev.engine_worker {
        Some(worker) => recovery.engines.outcome(worker, &ev.request_id, OUTCOME_WAIT).await,
        None => Ok(None),
    };
    let (completion, cached, finish, status) = match outcome {
        Ok(Some(o)) if o.finished() || age >= GIVE_UP => {
            // A gateway taken for dead may still be delivering its own event.
            let ended =
                o.ended_ms.map_or(entry.routed_ms, |ms| i64::try_from(ms).unwrap_or(i64::MAX));
            if age < GIVE_UP && since(ended) < LIVE_GRACE {
                return Settled::Later;
            }
            let billed = |finish| (o.completion_tokens, o.cached_tokens, finish, 200);
            match o.finish_reason {
                Some(Ended::Stop) => billed(FinishReason::Stop),
                Some(Ended::Length) => billed(FinishReason::Length),
                // Never ran (refused at submission), or failed before its first token: free,
                // as the live path bills an engine's error answer.
                None => (0, 0, FinishReason::Error, 502),
                Some(Ended::Error) if o.completion_tokens == 0 => (0, 0, FinishReason::Error, 502),
                // Ended when the dead gateway's connection closed, or failed.
                Some(Ended::Abort | Ended::Error) => billed(FinishReason::Error),
            }
        }
        Ok(Some(_)) => return Settled::Later,
        // The engine never had it (or restarted since): nothing to bill but the failure.
        Ok(None) if age >= GRACE => (0, 0, FinishReason::Error, 502),
        Ok(None) => return Settled::Later,
        Err(e) if age >= GIVE_UP => {
            tracing::warn!(request_id = %ev.request_id, error = %e,
                "the engine cannot say what it did; billed as a failure");
            (0, 0, FinishReason::Error, 502)
        }
        Err(_) => return Settled::Later,
    };
    let prompt = u64::from(ev.prompt_tokens);
    ev.completion_tokens = u32::try_from(completion).unwrap_or(u32::MAX);
    ev.cached_prompt_tokens = u32::try_from(cached.min(prompt)).unwrap_or(0);
    ev.finish_reason = finish;
    ev.http_status = status;
    ev.error_type = Some(GATEWAY_LOST.to_owned());
    ev.client_disconnected = false;
    // Nothing was observed at a gateway: no latency is claimed.
    ev.e2e_ms = None;
    let rates = Rates {
        input: ev.price_input_micros,
        cached_input: ev.price_cached_input_micros,
        output: ev.price_output_micros,
    };
    ev.cost_micros = rates.charge(status, prompt, cached.min(prompt), completion);
    let used = if status == 200 { prompt + completion } else { 0 };
    let (tenant, id) = (ev.tenant_id.clone(), ev.request_id.clone());
    match recovery.sink.emit(entry.event).await {
        Ok(Delivered::Primary | Delivered::Fallback) => {}
        Ok(Delivered::Retrying) => return Settled::Later,
        Err(e) => {
            tracing::error!(request_id = %id, error = %e, "a recovered usage event was refused");
            return Settled::Dropped;
        }
    }
    if let Some(l) = &recovery.limiter
        && let Err(e) = l.settle(&tenant, entry.limit_key.as_deref(), &id, used).await
    {
        tracing::warn!(request_id = %id, error = %e, "settling a recovered reservation failed; it expires instead");
    }
    if let Some(key) = &entry.claim_key {
        recovery.idempotency.release_abandoned(&tenant, key, &id).await;
    }
    Settled::Billed
}
