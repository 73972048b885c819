//! Limits kept in this process, for when Redis is unreachable and the tenant's policy says to
//! keep serving: requests and tokens per minute (GCRA through `governor`) and concurrency,
//! each divided by the number of gateway replicas so the fleet stays near the quota.
//! Daily and monthly quotas cannot be enforced without the shared counters; a tenant whose
//! policy is `refuse` gets 503 instead.

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};

use crate::limits::{Decision, RateState, Refusal, Scope, TenantLimits};

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
    limits: TenantLimits,
    requests: Option<DefaultDirectRateLimiter>,
    tokens: Option<DefaultDirectRateLimiter>,
    inflight: u64,
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
        key: Option<(&str, &TenantLimits)>,
        tokens: u64,
        limits: &TenantLimits,
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
        limits: &TenantLimits,
        scope: Scope,
    ) -> Result<RateState, Decision> {
        let entry = scopes.entry(name.to_owned()).or_insert_with(|| Entry {
            limits: TenantLimits::default(),
            requests: None,
            tokens: None,
            inflight: 0,
        });
        if entry.limits != *limits || (entry.requests.is_none() && limits.rpm.is_some()) {
            entry.limits = *limits;
            entry.requests = per_minute(limits.rpm, self.replicas);
            entry.tokens = per_minute(limits.tpm, self.replicas);
        }
        let state = RateState {
            limit_requests: limits.rpm,
            limit_tokens: limits.tpm,
            ..RateState::default()
        };
        let refuse = |reason, wait: Option<Duration>| {
            Err(Decision::Refused { reason, scope, retry_after: wait, state })
        };
        if let Some(c) = limits.concurrency
            && entry.inflight >= c.div_ceil(u64::from(self.replicas))
        {
            return refuse(Refusal::Concurrency, Some(Duration::from_secs(1)));
        }
        if let Some(r) = &entry.requests
            && let Err(not_until) = r.check()
        {
            return refuse(Refusal::Rpm, Some(not_until.wait_time_from(self.clock.now())));
        }
        if let Some(t) = &entry.tokens
            && let Some(n) = NonZeroU32::new(u32::try_from(tokens).unwrap_or(u32::MAX))
        {
            match t.check_n(n) {
                Ok(Ok(())) => {}
                Ok(Err(not_until)) => {
                    return refuse(Refusal::Tpm, Some(not_until.wait_time_from(self.clock.now())));
                }
                Err(_) => return refuse(Refusal::TpmExceedsLimit, None),
            }
        }
        Ok(state)
    }

    /// Ends an admitted request (`key`: the key id when it was admitted with key limits).
    pub fn release(&self, tenant: &str, key: Option<&str>) {
        let mut scopes = self.tenants.lock().unwrap_or_else(|e| e.into_inner());
        let key_name = key.map(|k| key_entry(tenant, k));
        for name in std::iter::once(tenant).chain(key_name.as_deref()) {
            if let Some(e) = scopes.get_mut(name) {
                e.inflight = e.inflight.saturating_sub(1);
            }
        }
    }
}

/// The local entry of one key's scope (tenant ids cannot contain the separator).
fn key_entry(tenant: &str, key: &str) -> String {
    format!("{tenant}/{key}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_tokens_and_concurrency_are_limited_per_replica() {
        let l = LocalLimiter::new(2);
        let limits = TenantLimits { rpm: Some(10), concurrency: Some(4), ..Default::default() };
        // 2 replicas: 5 requests per minute, 2 in flight each.
        assert!(matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)));
        assert!(matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)));
        assert!(matches!(
            l.admit("a", None, 1, &limits),
            Decision::Refused { reason: Refusal::Concurrency, .. }
        ));
        l.release("a", None);
        l.release("a", None);
        let mut admitted = 2;
        for _ in 0..10 {
            if matches!(l.admit("a", None, 1, &limits), Decision::Admitted(_)) {
                admitted += 1;
                l.release("a", None);
            }
        }
        assert_eq!(admitted, 5);
        let tokens = TenantLimits { tpm: Some(100), ..Default::default() };
        assert!(matches!(l.admit("b", None, 50, &tokens), Decision::Admitted(_)));
        assert!(matches!(
            l.admit("b", None, 10, &tokens),
            Decision::Refused { reason: Refusal::Tpm, .. }
        ));
        assert!(matches!(
            l.admit("c", None, 80, &tokens),
            Decision::Refused { reason: Refusal::TpmExceedsLimit, retry_after: None, .. }
        ));
    }

    #[test]
    fn a_key_is_held_to_its_own_limits_beside_its_tenants() -> Result<(), String> {
        let l = LocalLimiter::new(1);
        let tenant = TenantLimits { concurrency: Some(3), ..Default::default() };
        let key = TenantLimits { concurrency: Some(1), ..Default::default() };
        assert!(matches!(l.admit("t", Some(("k1", &key)), 1, &tenant), Decision::Admitted(_)));
        match l.admit("t", Some(("k1", &key)), 1, &tenant) {
            Decision::Refused { reason: Refusal::Concurrency, scope: Scope::Key, .. } => {}
            other => return Err(format!("expected the key's concurrency refusal: {other:?}")),
        }
        // Another key of the tenant has its own slot; the tenant's third slot is the last.
        assert!(matches!(l.admit("t", Some(("k2", &key)), 1, &tenant), Decision::Admitted(_)));
        assert!(matches!(l.admit("t", None, 1, &tenant), Decision::Admitted(_)));
        match l.admit("t", Some(("k3", &key)), 1, &tenant) {
            Decision::Refused { reason: Refusal::Concurrency, scope: Scope::Tenant, .. } => {}
            other => return Err(format!("expected the tenant's concurrency refusal: {other:?}")),
        }
        l.release("t", Some("k1"));
        assert!(matches!(l.admit("t", Some(("k1", &key)), 1, &tenant), Decision::Admitted(_)));
        Ok(())
    }
}
