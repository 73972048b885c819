//! Limits kept in this process, for when Redis is unreachable and the tenant's policy says to
//! keep serving: requests and tokens per minute (GCRA through `governor`) and concurrency,
//! each divided by the number of gateway replicas so the fleet stays near the quota; and daily
//! and monthly tokens, counted from what the ledger held at its last read ([`LedgerUsage`],
//! shared by every replica) plus this process's own charges since then (reserved while a
//! request runs, settled to what it used), so a restart never hands out a fresh day or month.
//! A tenant whose policy is `refuse` gets 503 instead of local limits.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use chrono::{Datelike, Utc};

use crate::limits::{
    Decision, Limit, Limits, RateState, Scope, ScopeLimits, count, current_periods,
};

/// What to do for a tenant when the shared limiter cannot be reached.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RedisDownPolicy {
    /// Keep serving under per-replica local limits.
    Local,
    /// Refuse with 503 until Redis is back.
    Refuse,
}

struct Entry {
    limits: Limits,
    requests: Option<DefaultDirectRateLimiter>,
    tokens: Option<DefaultDirectRateLimiter>,
    inflight: u64,
    /// Tokens reserved by requests in flight.
    inflight_tokens: u64,
    /// Tokens settled here since the ledger read `generation`, in `period`.
    settled: u64,
    generation: u64,
    /// (UTC day number, calendar month number) of `settled`.
    period: (i64, i64),
}

/// Per-tenant local limiters.
#[derive(Clone)]
pub struct LocalLimiter {
    replicas: u32,
    tenants: Arc<Mutex<HashMap<String, Entry>>>,
    clock: DefaultClock,
}

impl std::fmt::Debug for LocalLimiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalLimiter").field("replicas", &self.replicas).finish()
    }
}

fn per_minute(limit: Option<u64>, replicas: u32) -> Option<DefaultDirectRateLimiter> {
    let share = limit?.div_ceil(u64::from(replicas.max(1)));
    let n = NonZeroU32::new(u32::try_from(share).unwrap_or(u32::MAX))?;
    Some(RateLimiter::direct(Quota::per_minute(n)))
}

impl LocalLimiter {
    /// Limits for one of `replicas` gateways.
    pub fn new(replicas: u32) -> Self {
        Self { replicas: replicas.max(1), tenants: Arc::default(), clock: DefaultClock::default() }
    }

    /// Admits or refuses `tokens` for `tenant`, and for its API key when the key has limits
    /// of its own (`key`: its id and limits; checked first, so a key refusal leaves the
    /// tenant's counters alone). An admitted request must be [`release`]d.
    ///
    /// [`release`]: LocalLimiter::release
    pub fn admit(
        &self,
        tenant: &str,
        key: Option<(&str, &ScopeLimits)>,
        tokens: u64,
        limits: &ScopeLimits,
    ) -> Decision {
        let mut scopes = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let key_scope = key.map(|(k, l)| (key_entry(tenant, k), l));
        if let Some((name, l)) = &key_scope
            && let Err(refused) = self.check(&mut scopes, name, tokens, l, Scope::Key)
        {
            return refused;
        }
        let state = match self.check(&mut scopes, tenant, tokens, limits, Scope::Tenant) {
            Ok(state) => state,
            Err(refused) => return refused,
        };
        for name in std::iter::once(tenant).chain(key_scope.as_ref().map(|(n, _)| n.as_str())) {
            if let Some(e) = scopes.get_mut(name) {
                e.inflight += 1;
                e.inflight_tokens = e.inflight_tokens.saturating_add(tokens);
            }
        }
        Decision::Admitted(state)
    }

    /// One scope's check: concurrency, then requests and tokens per minute (a passed rate
    /// check is charged).
    fn check(
        &self,
        scopes: &mut HashMap<String, Entry>,
        name: &str,
        tokens: u64,
        limits: &ScopeLimits,
        scope: Scope,
    ) -> Result<RateState, Decision> {
        let entry = scopes.entry(name.to_owned()).or_insert_with(|| Entry {
            limits: Limits::default(),
            requests: None,
            tokens: None,
            inflight: 0,
            inflight_tokens: 0,
            settled: 0,
            generation: 0,
            period: (0, 0),
        });
        // A new ledger read already holds what was settled here before it; a new day or
        // month starts over (a read for the new period follows within its refresh).
        let period = current_periods();
        if entry.generation != limits.used.generation || entry.period != period {
            entry.generation = limits.used.generation;
            entry.period = period;
            entry.settled = 0;
        }
        // The ledger's figures change with every read; the rate limiters only with the limits.
        let (used, limits) = (limits.used, limits.limits);
        let (rpm, tpm) = (count(limits.rpm), count(limits.tpm));
        if entry.limits != limits || (entry.requests.is_none() && rpm.is_some()) {
            entry.limits = limits;
            entry.requests = per_minute(rpm, self.replicas);
            entry.tokens = per_minute(tpm, self.replicas);
        }
        let state = RateState { limit_requests: rpm, limit_tokens: tpm, ..RateState::default() };
        let refuse = |reason, wait: Option<Duration>| {
            Err(Decision::Refused { reason, scope, retry_after: wait, state })
        };
        if let Some(c) = count(limits.concurrency)
            && entry.inflight >= c.div_ceil(u64::from(self.replicas))
        {
            return refuse(Limit::Concurrency, Some(Duration::from_secs(1)));
        }
        // Day and month: the ledger is shared by every replica, so the limits are not divided.
        // Figures of another day or month (read just before midnight) count for nothing.
        let here = entry.settled.saturating_add(entry.inflight_tokens);
        let used_day = if used.day_number == period.0 { used.day } else { 0 };
        let used_month = if used.month_number == period.1 { used.month } else { 0 };
        let now = Utc::now();
        if let Some(d) = count(limits.daily_tokens)
            && used_day.saturating_add(here).saturating_add(tokens) > d
        {
            let next_day = (period.0 + 1) * 86_400 - now.timestamp();
            return refuse(Limit::DailyTokens, Some(Duration::from_secs(next_day.max(1) as u64)));
        }
        if let Some(m) = count(limits.monthly_tokens)
            && used_month.saturating_add(here).saturating_add(tokens) > m
        {
            return refuse(Limit::MonthlyTokens, Some(until_next_month(now)));
        }
        if let Some(r) = &entry.requests
            && let Err(not_until) = r.check()
        {
            return refuse(Limit::Rpm, Some(not_until.wait_time_from(self.clock.now())));
        }
        if let Some(t) = &entry.tokens
            && let Some(n) = NonZeroU32::new(u32::try_from(tokens).unwrap_or(u32::MAX))
        {
            match t.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return refuse(Limit::Tpm, Some(not_until.wait_time_from(self.clock.now())));
                }
                Err(_) => return refuse(Limit::TpmExceedsLimit, None),
            }
        }
        Ok(state)
    }

    /// Ends an admitted request (`key`: the key id when it was admitted with key limits):
    /// of the `reserved` tokens, `used` stay charged to the day and month.
    pub fn release(&self, tenant: &str, key: Option<&str>, reserved: u64, used: u64) {
        let mut scopes = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let key_name = key.map(|k| key_entry(tenant, k));
        for name in std::iter::once(tenant).chain(key_name.as_deref()) {
            if let Some(e) = scopes.get_mut(name) {
                e.inflight = e.inflight.saturating_sub(1);
                e.inflight_tokens = e.inflight_tokens.saturating_sub(reserved);
                e.settled = e.settled.saturating_add(used);
            }
        }
    }
}

fn until_next_month(now: chrono::DateTime<Utc>) -> Duration {
    let (y, m) =
        if now.month() == 12 { (now.year() + 1, 1) } else { (now.year(), now.month() + 1) };
    let next = chrono::NaiveDate::from_ymd_opt(y, m, 1)
        .and_then(|d| d.and_hms_opt(0, 0, 0))
        .map(|t| t.and_utc());
    next.map_or(Duration::from_secs(86_400), |n| {
        (n - now).to_std().unwrap_or(Duration::from_secs(1))
    })
}

/// The local entry of one key's scope (tenant ids cannot contain the separator).
fn key_entry(tenant: &str, key: &str) -> String {
    format!("{tenant}/{key}")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::limits::LedgerUsage;

    #[test]
    fn requests_tokens_and_concurrency_are_limited_per_replica() {
        let l = LocalLimiter::new(2);
        let limits =
            ScopeLimits::from(Limits { rpm: Some(10), concurrency: Some(4), ..Default::default() });
        // 2 replicas: 5 requests per minute, 2 in flight each.
        assert!(matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)));
        assert!(matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)));
        assert!(matches!(
            l.admit("a", None, 1, &limits),
            Decision::Refused { reason: Limit::Concurrency, .. }
        ));
        l.release("a", None, 1, 1);
        l.release("a", None, 1, 1);
        let mut admitted = 2;
        for _ in 0..10 {
            if matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)) {
                admitted += 1;
                l.release("a", None, 1, 1);
            }
        }
        assert_eq!(admitted, 5);
        let tokens = ScopeLimits::from(Limits { tpm: Some(100), ..Default::default() });
        assert!(matches!(l.admit("b", None, 50, &tokens), Decision::Admitted(_)));
        assert!(matches!(
            l.admit("b", None, 10, &tokens),
            Decision::Refused { reason: Limit::Tpm, .. }
        ));
        assert!(matches!(
            l.admit("c", None, 80, &tokens),
            Decision::Refused { reason: Limit::TpmExceedsLimit, retry_after: None, .. }
        ));
    }

    #[test]
    fn a_key_is_held_to_its_own_limits_beside_its_tenants() -> Result<(), String> {
        let l = LocalLimiter::new(1);
        let tenant = ScopeLimits::from(Limits { concurrency: Some(3), ..Default::default() });
        let key = ScopeLimits::from(Limits { concurrency: Some(1), ..Default::default() });
        assert!(matches!(l.admit("t", Some(("k1", &key)), 1, &tenant), Decision::Admitted(_)));
        match l.admit("t", Some(("k1", &key)), 1, &tenant) {
            Decision::Refused { reason: Limit::Concurrency, scope: Scope::Key, .. } => {}
            other => return Err(format!("expected the key's concurrency refusal: {other:?}")),
        }
        // Another key of the tenant has its own slot; the tenant's third slot is the last.
        assert!(matches!(l.admit("t", Some(("k2", &key)), 1, &tenant), Decision::Admitted(_)));
        assert!(matches!(l.admit("t", None, 1, &tenant), Decision::Admitted(_)));
        match l.admit("t", Some(("k3", &key)), 1, &tenant) {
            Decision::Refused { reason: Limit::Concurrency, scope: Scope::Tenant, .. } => {}
            other => return Err(format!("expected the tenant's concurrency refusal: {other:?}")),
        }
        l.release("t", Some("k1"), 1, 1);
        assert!(matches!(l.admit("t", Some(("k1", &key)), 1, &tenant), Decision::Admitted(_)));
        Ok(())
    }

    #[test]
    fn day_and_month_count_from_the_ledger_and_what_ran_here() {
        let l = LocalLimiter::new(2);
        let used = LedgerUsage::current(3_600, 3_600, 1);
        let capped =
            ScopeLimits { limits: Limits { daily_tokens: Some(100), ..Default::default() }, used };
        // 3,600 already in the ledger: a daily cap of 100 refuses at once (a restarted
        // gateway starts from the ledger, not from zero).
        assert!(matches!(
            l.admit("q", None, 10, &capped),
            Decision::Refused { reason: Limit::DailyTokens, retry_after: Some(_), .. }
        ));
        // Reserved while running, settled to what was used, not divided among replicas.
        let fresh = ScopeLimits {
            limits: Limits {
                daily_tokens: Some(100),
                monthly_tokens: Some(150),
                ..Default::default()
            },
            used: LedgerUsage::current(0, 40, 1),
        };
        assert!(matches!(l.admit("r", None, 60, &fresh), Decision::Admitted(_)));
        assert!(matches!(
            l.admit("r", None, 50, &fresh),
            Decision::Refused { reason: Limit::DailyTokens, .. }
        ));
        l.release("r", None, 60, 20);
        assert!(matches!(l.admit("r", None, 80, &fresh), Decision::Admitted(_)));
        l.release("r", None, 80, 80);
        // 40 + 20 + 80 this month: 10 left.
        assert!(matches!(
            l.admit(
                "r",
                None,
                11,
                &ScopeLimits { limits: Limits { daily_tokens: None, ..fresh.limits }, ..fresh }
            ),
            Decision::Refused { reason: Limit::MonthlyTokens, .. }
        ));
        // A new read of the ledger holds what was settled here: it is not counted twice.
        let reread = ScopeLimits {
            limits: Limits { daily_tokens: None, ..fresh.limits },
            used: LedgerUsage::current(100, 140, 2),
        };
        assert!(matches!(l.admit("r", None, 10, &reread), Decision::Admitted(_)));
        // Figures read for yesterday (just before midnight) count nothing today.
        let stale = LedgerUsage { day_number: used.day_number - 1, ..used };
        let capped = ScopeLimits {
            limits: Limits { daily_tokens: Some(100), ..Default::default() },
            used: stale,
        };
        assert!(matches!(l.admit("s", None, 10, &capped), Decision::Admitted(_)));
    }
}
