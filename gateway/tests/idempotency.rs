//! Idempotency claims, in this process and shared through the real Redis by two gateway
//! replicas: first, in progress, mismatch, replay of the stored response, release after a
//! failure, and expiry of the window and of a crashed gateway's running claim.

use std::time::Duration;

use anyhow::ensure;
use bytes::Bytes;
use sluice_gateway::idempotency::{Claim, Idempotency, Stored};

const REDIS_URL: &str = "redis://127.0.0.1:6379";
const WINDOW: Duration = Duration::from_millis(600);
const RUNNING: Duration = Duration::from_millis(300);

async fn shared(prefix: &str) -> anyhow::Result<Idempotency> {
    let conn = sluice_policies::redis_conn::RedisTarget::open(REDIS_URL)?.connect().await?;
    Ok(Idempotency::new(Some((conn, prefix.to_owned())), WINDOW, RUNNING))
}

/// `a` and `b` are two replicas (the same store when claims are local); `shared`: whether
/// claims live in Redis.
async fn scenario(a: &Idempotency, b: &Idempotency, shared: bool) -> anyhow::Result<()> {
    let (body, other) = (b"POST /v1/completions {\"prompt\":\"hi\"}", b"POST /v1/completions {}");
    let first = a.claim("t", "k", body, "r1").await;
    ensure!(first == Claim::First { ledger_key: "k#r1".into(), shared }, "{first:?}");
    ensure!(b.claim("t", "k", body, "r2").await == Claim::InProgress);
    ensure!(b.claim("t", "k", other, "r3").await == Claim::Mismatch);
    // Another tenant's key of the same name is its own.
    ensure!(matches!(b.claim("u", "k", other, "r3u").await, Claim::First { .. }));
    let stored = Stored {
        status: 200,
        content_type: "text/event-stream".into(),
        body: Bytes::from_static(b"data: {\"x\":1}\n\ndata: [DONE]\n\n"),
    };
    a.complete("t", "k", "r1", shared, stored.clone()).await;
    let replay = b.claim("t", "k", body, "r4").await;
    ensure!(
        replay == Claim::Replay { first_request_id: "r1".into(), response: stored.clone() },
        "{replay:?}"
    );
    // Only the claiming request can release; a failed first frees the key for a new first.
    b.release("t", "k", "r4", shared).await;
    ensure!(matches!(a.claim("t", "k", body, "r5").await, Claim::Replay { .. }));
    ensure!(
        a.claim("t", "k2", body, "r6").await == Claim::First { ledger_key: "k2#r6".into(), shared }
    );
    a.release("t", "k2", "r6", shared).await;
    ensure!(
        b.claim("t", "k2", body, "r7").await == Claim::First { ledger_key: "k2#r7".into(), shared }
    );
    // A running claim whose gateway died lapses after RUNNING; a completed one after WINDOW.
    tokio::time::sleep(RUNNING + Duration::from_millis(100)).await;
    ensure!(
        a.claim("t", "k2", other, "r8").await
            == Claim::First { ledger_key: "k2#r8".into(), shared }
    );
    ensure!(matches!(b.claim("t", "k", body, "r9").await, Claim::Replay { .. }));
    tokio::time::sleep(WINDOW).await;
    let later = b.claim("t", "k", other, "r10").await;
    ensure!(later == Claim::First { ledger_key: "k#r10".into(), shared }, "{later:?}");
    Ok(())
}

#[tokio::test]
async fn claims_in_this_process() -> anyhow::Result<()> {
    let local = Idempotency::new(None, WINDOW, RUNNING);
    scenario(&local, &local, false).await
}

#[tokio::test]
async fn claims_shared_by_two_replicas_through_redis() -> anyhow::Result<()> {
    let prefix = format!("test-{}", uuid::Uuid::new_v4().simple());
    scenario(&shared(&prefix).await?, &shared(&prefix).await?, true).await
}
