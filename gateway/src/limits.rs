//! Per-tenant (and per-key, where a key has limits of its own) admission across gateway
//! replicas: requests per minute, tokens per minute, daily and monthly tokens, and concurrent
//! requests, decided by one atomic Redis script per admission that checks and charges both
//! scopes together.
//!
//! At admission a request reserves its prompt tokens plus its largest possible output; when it
//! ends, [`Limiter::settle`] returns what it did not use. Reservations carry an expiry, so
//! the slots and tokens of a gateway that died come back on their own. Windows follow
//! Redis's clock (UTC minutes, days and calendar months), so replicas agree. The tenant's
//! keys share one hash tag, which keeps the scripts valid on Redis Cluster.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sluice_policies::redis_conn::RedisConn;

pub use sluice_billing::control::Limits;

/// What one scope (a tenant, or an API key with limits of its own) is held to: its effective
/// limits (`None` = unlimited) and what the ledger already holds for it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ScopeLimits {
    /// The limits.
    pub limits: Limits,
    /// What the ledger already holds for this scope in the current day and month.
    #[serde(default)]
    pub used: LedgerUsage,
}

impl From<Limits> for ScopeLimits {
    fn from(limits: Limits) -> Self {
        Self { limits, used: LedgerUsage::default() }
    }
}

/// A limit as a count; a negative one (never valid in a quota) counts as unlimited.
pub(crate) fn count(limit: Option<i64>) -> Option<u64> {
    limit.and_then(|n| u64::try_from(n).ok())
}

/// Billed tokens the ledger already holds for a scope in the current UTC day and calendar
/// month. Where a window is new to the counters (a restarted gateway, a flushed Redis) it
/// starts from these, not from zero; `generation` changes with each fresh read of the ledger.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LedgerUsage {
    /// Tokens today (UTC).
    pub day: u64,
    /// Tokens this calendar month (UTC).
    pub month: u64,
    /// Which read of the ledger these figures come from.
    pub generation: u64,
    /// The UTC day (days since the epoch) `day` counts, and the month (year * 12 + month - 1)
    /// `month` counts: a window of another day or month does not start from them.
    pub day_number: i64,
    /// See `day_number`.
    pub month_number: i64,
}

/// Today's UTC day number (days since the epoch) and this month's (year * 12 + month - 1), as
/// the admission script counts them.
pub fn current_periods() -> (i64, i64) {
    use chrono::Datelike;
    let now = chrono::Utc::now();
    (now.timestamp().div_euclid(86_400), i64::from(now.year()) * 12 + i64::from(now.month0()))
}

impl LedgerUsage {
    /// Figures for the current day and month.
    pub fn current(day: u64, month: u64, generation: u64) -> Self {
        let (day_number, month_number) = current_periods();
        Self { day, month, generation, day_number, month_number }
    }
}

/// The limit that refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// Requests per minute used up.
    Rpm,
    /// Tokens per minute used up.
    Tpm,
    /// The request alone needs more than the tokens-per-minute limit.
    TpmExceedsLimit,
    /// Daily tokens used up.
    DailyTokens,
    /// Monthly tokens used up.
    MonthlyTokens,
    /// Too many requests in flight.
    Concurrency,
}

impl Limit {
    /// Label for metrics and error messages.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Rpm => "rpm",
            Self::Tpm => "tpm",
            Self::TpmExceedsLimit => "tpm_exceeds_limit",
            Self::DailyTokens => "daily_tokens",
            Self::MonthlyTokens => "monthly_tokens",
            Self::Concurrency => "concurrency",
        }
    }
}

/// The `x-ratelimit-*` figures of a decision (`None` = unlimited).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RateState {
    /// `x-ratelimit-limit-requests`.
    pub limit_requests: Option<u64>,
    /// `x-ratelimit-remaining-requests`.
    pub remaining_requests: Option<u64>,
    /// `x-ratelimit-limit-tokens`.
    pub limit_tokens: Option<u64>,
    /// `x-ratelimit-remaining-tokens`.
    pub remaining_tokens: Option<u64>,
    /// Until the request window resets.
    pub reset_requests: Duration,
    /// Until the token window resets.
    pub reset_tokens: Duration,
}

/// Which limits refused a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    /// The tenant's quota.
    Tenant,
    /// The API key's own limits.
    Key,
}

/// The outcome of an admission.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Admitted; the reservation holds until settled or expired.
    Admitted(RateState),
    /// Refused: why, and when trying again can succeed (`None`: never, as configured).
    Refused {
        /// The limit that refused.
        reason: Limit,
        /// Whose limit it was.
        scope: Scope,
        /// `Retry-After`.
        retry_after: Option<Duration>,
        /// Header figures.
        state: RateState,
    },
}

/// Admission failed to reach a decision (Redis unreachable or misbehaving).
#[derive(Debug, thiserror::Error)]
pub enum LimitError {
    /// A Redis command failed.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// The script answered something unexpected.
    #[error("unexpected reply from the admission script: {0}")]
    Reply(String),
    /// Redis did not answer in time (down, or reconnecting).
    #[error("redis did not answer within {0:?}")]
    Timeout(Duration),
}

/// How long an admission or settlement waits for Redis before the caller falls back.
pub(crate) const REDIS_TIMEOUT: Duration = Duration::from_millis(300);

/// Atomic admissions and settlements for every tenant, over one Redis connection manager.
#[derive(Clone)]
pub struct Limiter {
    conn: RedisConn,
    /// The scripts (their source and hash), shared by every clone: a clone per request
    /// copies no Lua.
    admit: Arc<redis::Script>,
    settle: Arc<redis::Script>,
    /// How long a reservation lives without being settled.
    pub reservation_ttl: Duration,
    prefix: String,
}

impl std::fmt::Debug for Limiter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Limiter").field("prefix", &self.prefix).finish()
    }
}

/// Idle tenants' counters disappear after this long (longer than any window).
const KEY_TTL: Duration = Duration::from_secs(35 * 24 * 3600);

fn lim(v: Option<i64>) -> i64 {
    v.filter(|n| *n >= 0).unwrap_or(-1)
}

fn unlim(v: i64) -> Option<u64> {
    u64::try_from(v).ok()
}

impl Limiter {
    /// A limiter whose keys start with `prefix` (the deployment's `--redis-namespace`; tests
    /// isolate themselves with their own), reservations living `reservation_ttl`.
    pub fn new(conn: impl Into<RedisConn>, prefix: &str, reservation_ttl: Duration) -> Self {
        Self {
            conn: conn.into(),
            admit: Arc::new(redis::Script::new(include_str!("admit.lua"))),
            settle: Arc::new(redis::Script::new(include_str!("settle.lua"))),
            reservation_ttl,
            prefix: prefix.to_owned(),
        }
    }

    /// The Redis connection and key prefix, for other per-tenant state kept beside the
    /// limits (idempotency keys).
    pub fn shared(&self) -> (RedisConn, String) {
        (self.conn.clone(), self.prefix.clone())
    }

    /// The Redis keys of the tenant's scope, then of the key's when it is limited. One hash
    /// tag per tenant: every key lives in one Cluster slot.
    fn keys(&self, tenant: &str, key: Option<&str>) -> Vec<String> {
        let tag = format!("{{{}:t:{tenant}}}", self.prefix);
        let mut scopes = vec![tag.clone()];
        scopes.extend(key.map(|k| format!("{tag}:k:{k}")));
        scopes
            .iter()
            .flat_map(|s| {
                [format!("{s}:windows"), format!("{s}:inflight"), format!("{s}:reservations")]
            })
            .collect()
    }

    /// Reserves `tokens` (prompt + largest output) for `request_id` if every limit of the
    /// tenant allows.
    pub async fn admit(
        &self,
        tenant: &str,
        request_id: &str,
        tokens: u64,
        limits: &ScopeLimits,
    ) -> Result<Decision, LimitError> {
        self.admit_key(tenant, None, request_id, tokens, limits).await
    }

    /// As [`Limiter::admit`], also holding the request to its API key's own limits
    /// (`key`: the key id and its limits) in the same atomic step: both scopes are charged,
    /// or neither.
    pub async fn admit_key(
        &self,
        tenant: &str,
        key: Option<(&str, &ScopeLimits)>,
        request_id: &str,
        tokens: u64,
        limits: &ScopeLimits,
    ) -> Result<Decision, LimitError> {
        let mut conn = self.conn.clone();
        let mut inv = self.admit.prepare_invoke();
        for k in self.keys(tenant, key.map(|k| k.0)) {
            inv.key(k);
        }
        inv.arg(request_id)
            .arg(tokens)
            .arg(self.reservation_ttl.as_millis() as u64)
            .arg(KEY_TTL.as_millis() as u64);
        for l in std::iter::once(limits).chain(key.map(|k| k.1)) {
            let (used, l) = (l.used, l.limits);
            inv.arg(lim(l.rpm))
                .arg(lim(l.tpm))
                .arg(lim(l.daily_tokens))
                .arg(lim(l.monthly_tokens))
                .arg(lim(l.concurrency))
                .arg(used.day)
                .arg(used.month)
                .arg(used.day_number)
                .arg(used.month_number);
        }
        let invocation = inv.invoke_async::<Vec<redis::Value>>(&mut conn);
        let reply = tokio::time::timeout(REDIS_TIMEOUT, invocation)
            .await
            .map_err(|_| LimitError::Timeout(REDIS_TIMEOUT))??;
        parse_decision(&reply)
    }

    /// Ends a request: `used` tokens are kept, the rest of its reservation is returned, its
    /// concurrency slot is freed, in the tenant's scope and in `key`'s when the request was
    /// admitted with key limits. Returns false when it held no reservation (settled already
    /// or expired).
    pub async fn settle(
        &self,
        tenant: &str,
        key: Option<&str>,
        request_id: &str,
        used: u64,
    ) -> Result<bool, LimitError> {
        let mut conn = self.conn.clone();
        let mut inv = self.settle.prepare_invoke();
        for k in self.keys(tenant, key) {
            inv.key(k);
        }
        let invocation = inv.arg(request_id).arg(used).invoke_async::<i64>(&mut conn);
        let n = tokio::time::timeout(REDIS_TIMEOUT, invocation)
            .await
            .map_err(|_| LimitError::Timeout(REDIS_TIMEOUT))??;
        Ok(n == 1)
    }
}

fn int(v: &redis::Value) -> Result<i64, LimitError> {
    match v {
        redis::Value::Int(n) => Ok(*n),
        other => Err(LimitError::Reply(format!("{other:?}"))),
    }
}

/// Whichever of two (limit, remaining) pairs has less left; unlimited (`None`) has most.
fn tighter(
    a: (Option<u64>, Option<u64>),
    b: (Option<u64>, Option<u64>),
) -> (Option<u64>, Option<u64>) {
    match (a.1, b.1) {
        (_, None) => a,
        (None, Some(_)) => b,
        (Some(x), Some(y)) => {
            if y < x {
                b
            } else {
                a
            }
        }
    }
}

fn parse_decision(reply: &[redis::Value]) -> Result<Decision, LimitError> {
    let [admitted, reason, retry, refusing, reset, per_scope @ ..] = reply else {
        return Err(LimitError::Reply(format!("{} fields", reply.len())));
    };
    if per_scope.is_empty() || per_scope.len() % 4 != 0 {
        return Err(LimitError::Reply(format!("{} fields", reply.len())));
    }
    let reason = match reason {
        redis::Value::BulkString(b) => String::from_utf8_lossy(b).into_owned(),
        redis::Value::SimpleString(s) => s.clone(),
        other => return Err(LimitError::Reply(format!("{other:?}"))),
    };
    let ms =
        |v: &redis::Value| int(v).map(|n| Duration::from_millis(u64::try_from(n).unwrap_or(0)));
    // The headers show whichever scope has less left, for requests and for tokens.
    let (mut requests, mut tokens) = ((None, None), (None, None));
    for (i, s) in per_scope.chunks(4).enumerate() {
        let r = (unlim(int(&s[0])?), unlim(int(&s[1])?));
        let t = (unlim(int(&s[2])?), unlim(int(&s[3])?));
        requests = if i == 0 { r } else { tighter(requests, r) };
        tokens = if i == 0 { t } else { tighter(tokens, t) };
    }
    let state = RateState {
        limit_requests: requests.0,
        remaining_requests: requests.1,
        limit_tokens: tokens.0,
        remaining_tokens: tokens.1,
        reset_requests: ms(reset)?,
        reset_tokens: ms(reset)?,
    };
    if int(admitted)? == 1 {
        return Ok(Decision::Admitted(state));
    }
    let reason = match reason.as_str() {
        "rpm" => Limit::Rpm,
        "tpm" => Limit::Tpm,
        "tpm_exceeds_limit" => Limit::TpmExceedsLimit,
        "daily_tokens" => Limit::DailyTokens,
        "monthly_tokens" => Limit::MonthlyTokens,
        "concurrency" => Limit::Concurrency,
        other => return Err(LimitError::Reply(other.to_owned())),
    };
    let retry = ms(retry)?;
    let retry_after = (reason != Limit::TpmExceedsLimit).then_some(retry);
    let scope = if int(refusing)? >= 2 { Scope::Key } else { Scope::Tenant };
    Ok(Decision::Refused { reason, scope, retry_after, state })
}
