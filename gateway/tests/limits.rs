//! The shared admission limiter against the real Redis: exact quotas under concurrent
//! admissions from two limiter instances (two gateway replicas), settlement, expiry of
//! reservations left by a dead gateway, and each limit's refusal.

use std::time::Duration;

use anyhow::{Context, ensure};
use sluice_gateway::limits::{Decision, LedgerUsage, Limit, Limiter, Limits, Scope, ScopeLimits};

const REDIS_URL: &str = "redis://127.0.0.1:6379";

async fn limiter(prefix: &str, ttl: Duration) -> anyhow::Result<Limiter> {
    let conn = sluice_policies::redis_conn::RedisTarget::open(REDIS_URL)?.connect().await?;
    Ok(Limiter::new(conn, prefix, ttl))
}

fn prefix() -> String {
    format!("test-{}", uuid::Uuid::new_v4().simple())
}

fn refused_by(d: &Decision) -> Option<(Limit, Scope)> {
    match d {
        Decision::Refused { reason, scope, .. } => Some((*reason, *scope)),
        Decision::Admitted(_) => None,
    }
}

fn admitted(d: &Decision) -> bool {
    matches!(d, Decision::Admitted(_))
}

fn refused_for(d: &Decision) -> Option<Limit> {
    match d {
        Decision::Refused { reason, .. } => Some(*reason),
        Decision::Admitted(_) => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_replicas_racing_never_overdraw_a_quota() -> anyhow::Result<()> {
    let p = prefix();
    let (a, b) =
        (limiter(&p, Duration::from_secs(60)).await?, limiter(&p, Duration::from_secs(60)).await?);
    let limits = ScopeLimits::from(Limits { daily_tokens: Some(1_000), ..Default::default() });
    let mut tasks = Vec::new();
    for i in 0..200 {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(
            async move { l.admit("acme", &format!("r{i}"), 100, &limits).await },
        ));
    }
    let mut ok = 0;
    for t in tasks {
        let d = t.await??;
        if admitted(&d) {
            ok += 1;
        } else {
            ensure!(refused_for(&d) == Some(Limit::DailyTokens), "{d:?}");
        }
    }
    ensure!(ok == 10, "{ok} admitted against a quota for exactly 10");
    Ok(())
}

#[tokio::test]
async fn settlement_refunds_what_was_not_used_and_frees_the_slot() -> anyhow::Result<()> {
    let l = limiter(&prefix(), Duration::from_secs(60)).await?;
    let limits =
        ScopeLimits::from(Limits { tpm: Some(1_000), concurrency: Some(2), ..Default::default() });
    ensure!(admitted(&l.admit("t", "a", 600, &limits).await?));
    let d = l.admit("t", "b", 600, &limits).await?;
    ensure!(refused_for(&d) == Some(Limit::Tpm), "{d:?}");
    if let Decision::Refused { retry_after, state, .. } = d {
        ensure!(retry_after.is_some_and(|r| r <= Duration::from_secs(60)), "{retry_after:?}");
        ensure!(
            state.remaining_tokens == Some(400) && state.limit_tokens == Some(1_000),
            "{state:?}"
        );
    }
    // Only 100 of the 600 were used: 900 are free again.
    ensure!(l.settle("t", None, "a", 100).await?);
    ensure!(!l.settle("t", None, "a", 100).await?, "settled twice");
    ensure!(admitted(&l.admit("t", "b", 600, &limits).await?));
    ensure!(admitted(&l.admit("t", "c", 200, &limits).await?));
    let d = l.admit("t", "d", 1, &limits).await?;
    ensure!(refused_for(&d) == Some(Limit::Concurrency), "{d:?}");
    ensure!(l.settle("t", None, "b", 600).await?);
    ensure!(admitted(&l.admit("t", "d", 1, &limits).await?));
    // The same request admitted twice holds one slot.
    ensure!(admitted(&l.admit("t", "d", 1, &limits).await?));
    let d = l.admit("t", "e", 1, &limits).await?;
    ensure!(refused_for(&d) == Some(Limit::Concurrency), "{d:?}");
    Ok(())
}

#[tokio::test]
async fn a_dead_gateways_reservations_expire() -> anyhow::Result<()> {
    let l = limiter(&prefix(), Duration::from_millis(300)).await?;
    let limits =
        ScopeLimits::from(Limits { tpm: Some(500), concurrency: Some(1), ..Default::default() });
    ensure!(admitted(&l.admit("t", "lost", 400, &limits).await?));
    ensure!(!admitted(&l.admit("t", "next", 400, &limits).await?));
    tokio::time::sleep(Duration::from_millis(400)).await;
    // Slot and tokens are back (unless the minute rolled over in between, which resets too).
    ensure!(admitted(&l.admit("t", "next", 400, &limits).await?));
    ensure!(!l.settle("t", None, "lost", 400).await?, "an expired reservation settled");
    Ok(())
}

#[tokio::test]
async fn each_limit_refuses_with_its_reason() -> anyhow::Result<()> {
    let l = limiter(&prefix(), Duration::from_secs(60)).await?;
    let rpm = ScopeLimits::from(Limits { rpm: Some(3), ..Default::default() });
    for i in 0..3 {
        let d = l.admit("r", &format!("q{i}"), 1, &rpm).await?;
        ensure!(admitted(&d), "{d:?}");
        if let Decision::Admitted(s) = d {
            ensure!(s.remaining_requests == Some(2 - i), "{s:?}");
        }
    }
    let d = l.admit("r", "q3", 1, &rpm).await?;
    ensure!(refused_for(&d) == Some(Limit::Rpm), "{d:?}");
    let big = ScopeLimits::from(Limits { tpm: Some(100), ..Default::default() });
    let d = l.admit("b", "huge", 101, &big).await?;
    ensure!(matches!(
        d,
        Decision::Refused { reason: Limit::TpmExceedsLimit, retry_after: None, .. }
    ));
    let monthly = ScopeLimits::from(Limits { monthly_tokens: Some(50), ..Default::default() });
    ensure!(admitted(&l.admit("m", "x", 50, &monthly).await?));
    let d = l.admit("m", "y", 1, &monthly).await?;
    ensure!(refused_for(&d) == Some(Limit::MonthlyTokens), "{d:?}");
    if let Decision::Refused { retry_after: Some(r), .. } = d {
        ensure!(r <= Duration::from_secs(31 * 86_400) && r > Duration::ZERO, "{r:?}");
    }
    // Unlimited tenants are always admitted and see no limits.
    let d = l.admit("u", "z", 1_000_000, &ScopeLimits::default()).await?;
    ensure!(
        matches!(d, Decision::Admitted(s) if s.limit_requests.is_none() && s.remaining_tokens.is_none())
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_keys_own_limits_hold_beside_its_tenants_across_replicas() -> anyhow::Result<()> {
    let p = prefix();
    let (a, b) =
        (limiter(&p, Duration::from_secs(60)).await?, limiter(&p, Duration::from_secs(60)).await?);
    let tenant = ScopeLimits::from(Limits { daily_tokens: Some(1_000), ..Default::default() });
    let key = ScopeLimits::from(Limits { daily_tokens: Some(300), ..Default::default() });
    // 60 concurrent admissions of 100 tokens on one key: exactly 3 fit the key's 300.
    let mut tasks = Vec::new();
    for i in 0..60 {
        let l = if i % 2 == 0 { a.clone() } else { b.clone() };
        tasks.push(tokio::spawn(async move {
            l.admit_key("acme", Some(("k1", &key)), &format!("r{i}"), 100, &tenant).await
        }));
    }
    let mut ok = 0;
    let mut first_admitted = None;
    for (i, t) in tasks.into_iter().enumerate() {
        let d = t.await??;
        if admitted(&d) {
            ok += 1;
            first_admitted.get_or_insert(format!("r{i}"));
        } else {
            ensure!(refused_by(&d) == Some((Limit::DailyTokens, Scope::Key)), "{d:?}");
        }
    }
    ensure!(ok == 3, "{ok} admitted against a key quota for exactly 3");
    // The tenant was charged for the key's requests too: 700 left, another key gets 7.
    let mut other = 0;
    for i in 0..10 {
        let d = a.admit_key("acme", Some(("k2", &key)), &format!("s{i}"), 100, &tenant).await?;
        if admitted(&d) {
            other += 1;
        }
    }
    ensure!(other == 3, "key k2 admitted {other}, its own limit is 3");
    for i in 0..10 {
        let d = a.admit("acme", &format!("u{i}"), 100, &tenant).await?;
        if !admitted(&d) {
            ensure!(refused_by(&d) == Some((Limit::DailyTokens, Scope::Tenant)), "{d:?}");
            ensure!(i == 4, "the tenant refused after {i} more, expected 4");
            break;
        }
    }
    // Settling a key-scoped request (one of the three admitted: which ones won the race
    // varies) refunds both scopes.
    let settled = first_admitted.context("none admitted")?;
    ensure!(a.settle("acme", Some("k1"), &settled, 0).await?, "settling {settled} found nothing");
    let d = b.admit_key("acme", Some(("k1", &key)), "again", 100, &tenant).await?;
    ensure!(admitted(&d), "the key's refund did not come back: {d:?}");
    Ok(())
}

#[tokio::test]
async fn headers_show_the_tighter_of_tenant_and_key() -> anyhow::Result<()> {
    let l = limiter(&prefix(), Duration::from_secs(60)).await?;
    let tenant =
        ScopeLimits::from(Limits { rpm: Some(100), tpm: Some(10_000), ..Default::default() });
    let key = ScopeLimits::from(Limits { rpm: Some(2), ..Default::default() });
    let d = l.admit_key("h", Some(("k", &key)), "a", 10, &tenant).await?;
    let Decision::Admitted(s) = d else { anyhow::bail!("refused: {d:?}") };
    ensure!(s.limit_requests == Some(2) && s.remaining_requests == Some(1), "{s:?}");
    ensure!(s.limit_tokens == Some(10_000) && s.remaining_tokens == Some(9_990), "{s:?}");
    ensure!(admitted(&l.admit_key("h", Some(("k", &key)), "b", 10, &tenant).await?));
    let d = l.admit_key("h", Some(("k", &key)), "c", 10, &tenant).await?;
    ensure!(refused_by(&d) == Some((Limit::Rpm, Scope::Key)), "{d:?}");
    // The tenant's own requests are not held to the key's limit.
    ensure!(admitted(&l.admit("h", "d", 10, &tenant).await?));
    Ok(())
}

#[tokio::test]
async fn new_day_and_month_windows_start_from_the_ledger() -> anyhow::Result<()> {
    // A flushed Redis (a fresh prefix: no counters) with 3,600 tokens already billed today.
    let l = limiter(&prefix(), Duration::from_secs(60)).await?;
    let used = LedgerUsage::current(3_600, 3_600, 1);
    let daily =
        ScopeLimits { limits: Limits { daily_tokens: Some(100), ..Default::default() }, used };
    let d = l.admit("d", "a", 10, &daily).await?;
    ensure!(refused_for(&d) == Some(Limit::DailyTokens), "{d:?}");
    // The month starts from the ledger's figure too, and keeps counting on from it.
    let monthly = ScopeLimits {
        limits: Limits { monthly_tokens: Some(4_000), ..Default::default() },
        used: LedgerUsage::current(0, 3_900, 1),
    };
    ensure!(admitted(&l.admit("m", "x", 100, &monthly).await?));
    ensure!(l.settle("m", None, "x", 60).await?);
    let d = l.admit("m", "y", 41, &monthly).await?;
    ensure!(refused_for(&d) == Some(Limit::MonthlyTokens), "{d:?}");
    ensure!(admitted(&l.admit("m", "z", 40, &monthly).await?));
    // Figures read for another day (just before midnight) seed nothing.
    let stale = LedgerUsage { day_number: used.day_number - 1, ..used };
    let daily = ScopeLimits {
        limits: Limits { daily_tokens: Some(100), ..Default::default() },
        used: stale,
    };
    ensure!(admitted(&l.admit("y", "a", 10, &daily).await?));
    Ok(())
}
