//! The in-flight journal on a real Redis: a sweeper bills the entries of a gateway whose
//! heartbeat expired, never those of a live one, waits on an entry whose engine may still
//! answer, and forgets the dead gateway once its journal is empty. (A gateway killed with
//! requests at a real engine: `tests/gateway_crash.rs`.)

mod common;

use std::sync::Arc;

use anyhow::ensure;
use chrono::Utc;
use sluice_billing::{FinishReason, Ledger, UsageEvent};
use sluice_gateway::engine_client::EngineClient;
use sluice_gateway::idempotency::{Idempotency, RUNNING_TTL, WINDOW};
use sluice_gateway::journal::{Entry, GATEWAY_LOST, GIVE_UP, Journal, Recovery};
use sluice_gateway::sink::UsageSink;
use sluice_policies::redis_conn::RedisTarget;

const REDIS_URL: &str = "redis://127.0.0.1:6379";

fn entry(id: &str, worker: Option<&str>, routed_ago: chrono::TimeDelta) -> Entry {
    let mut event = common::event(id);
    event.engine_worker = worker.map(str::to_owned);
    event.completion_tokens = 0;
    event.cost_micros = 0;
    // Priced, so a free row is the recovery's doing.
    (event.price_input_micros, event.price_output_micros) = (150_000, 600_000);
    Entry {
        event,
        routed_ms: (Utc::now() - routed_ago).timestamp_millis(),
        limit_key: None,
        claim_key: None,
    }
}

async fn cmd<T: redis::FromRedisValue>(args: &[&str]) -> anyhow::Result<T> {
    let mut conn = redis::Client::open(REDIS_URL)?.get_multiplexed_async_connection().await?;
    let mut c = redis::cmd(args[0]);
    for a in &args[1..] {
        c.arg(*a);
    }
    Ok(c.query_async(&mut conn).await?)
}

#[tokio::test]
async fn a_dead_gateways_journal_is_billed_and_a_live_ones_is_not() -> anyhow::Result<()> {
    let tag = uuid::Uuid::new_v4().simple().to_string();
    let (prefix, stream) = (format!("jt-{tag}"), format!("{{jt-{tag}}}:usage"));
    let conn = RedisTarget::open(REDIS_URL)?.connect().await?;
    let dir = tempfile::tempdir()?;
    let ledger =
        Ledger::connect(&format!("sqlite://{}", dir.path().join("l.db").display())).await?;
    let recovery = Recovery {
        sink: UsageSink::Redis {
            conn: conn.clone(),
            stream: stream.clone(),
            fallback: ledger.clone(),
            retrying: Default::default(),
        },
        limiter: None,
        engines: EngineClient::new(reqwest::Client::new(), None),
        idempotency: Arc::new(Idempotency::new(None, WINDOW, RUNNING_TTL)),
        recovered: Default::default(),
    };
    let [dead, live, sweeper] =
        std::array::from_fn(|_| Journal::new(conn.clone(), &prefix, &stream));
    for j in [&dead, &live, &sweeper] {
        j.beat().await?;
    }
    // An engine address nothing listens on.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.to_string();
    let long_ago = chrono::TimeDelta::from_std(GIVE_UP)? + chrono::TimeDelta::minutes(1);
    dead.write(&entry("fresh", Some(&closed), chrono::TimeDelta::zero())).await?;
    dead.write(&entry("stale", Some(&closed), long_ago)).await?;
    dead.write(&entry("unrouted", None, chrono::TimeDelta::minutes(2))).await?;
    live.write(&entry("running", Some(&closed), long_ago)).await?;

    // Nobody is dead yet.
    ensure!(sweeper.sweep(&recovery).await? == 0, "a live gateway's journal was recovered");
    // The dead one's heartbeat expires (its key is deleted here rather than waited for); the
    // live one keeps beating.
    cmd::<()>(&["DEL", &format!("{prefix}:alive:{{gw-{}}}", dead.id())]).await?;
    live.beat().await?;
    let billed = sweeper.sweep(&recovery).await?;
    ensure!(billed == 2, "{billed} billed");
    let events = stream_events(&stream).await?;
    let ids: Vec<&str> = events.iter().map(|e| e.request_id.as_str()).collect();
    ensure!(ids.len() == 2 && ids.contains(&"stale") && ids.contains(&"unrouted"), "{ids:?}");
    for e in &events {
        // Nothing the engine can vouch for: a failure, free.
        ensure!(
            e.http_status == 502
                && e.completion_tokens == 0
                && e.cost_micros == 0
                && e.finish_reason == FinishReason::Error
                && e.error_type.as_deref() == Some(GATEWAY_LOST)
                && e.e2e_ms.is_none(),
            "{e:?}"
        );
    }
    let left: Vec<String> =
        cmd(&["HKEYS", &format!("{prefix}:journal:{{gw-{}}}", dead.id())]).await?;
    ensure!(left == ["fresh"], "left in the dead journal: {left:?}");
    let untouched: Vec<String> =
        cmd(&["HKEYS", &format!("{prefix}:journal:{{gw-{}}}", live.id())]).await?;
    ensure!(untouched == ["running"], "the live journal: {untouched:?}");
    let members_key = format!("{prefix}:gateways:{stream}");
    let members: Vec<String> = cmd(&["SMEMBERS", &members_key]).await?;
    ensure!(members.contains(&dead.id().to_owned()), "{members:?}");

    // The last entry, once its engine can no longer be waited for: billed, and the dead
    // gateway forgotten.
    dead.write(&entry("fresh", Some(&closed), long_ago)).await?;
    live.beat().await?;
    ensure!(sweeper.sweep(&recovery).await? == 1);
    let members: Vec<String> = cmd(&["SMEMBERS", &members_key]).await?;
    ensure!(!members.contains(&dead.id().to_owned()) && members.len() == 2, "{members:?}");
    ensure!(stream_events(&stream).await?.len() == 3);

    for key in [members_key, stream, format!("{prefix}:journal:{{gw-{}}}", live.id())] {
        cmd::<()>(&["DEL", &key]).await?;
    }
    ledger.close().await;
    Ok(())
}

/// The usage events on `stream`, in order.
async fn stream_events(stream: &str) -> anyhow::Result<Vec<UsageEvent>> {
    let reply: redis::streams::StreamRangeReply = cmd(&["XRANGE", stream, "-", "+"]).await?;
    reply
        .ids
        .iter()
        .map(|e| {
            let json: String = e.get(sluice_billing::ingest::EVENT_FIELD).unwrap_or_default();
            Ok(serde_json::from_str(&json)?)
        })
        .collect()
}
