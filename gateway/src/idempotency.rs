//! `Idempotency-Key`: a retry with the same key and the same body within 24 hours gets the
//! first response again, without running or billing anything; the same key with another body
//! is refused (422), and so is a retry while the first is still running (409).
//!
//! The first request with a key claims it (body hash, request id, state `running`). When it
//! completes (HTTP 200, generation ended by stop or length) its response is stored with the
//! claim for the window; when it fails, is refused or the client leaves, the claim is dropped,
//! so a retry runs (and is billed) as a new first. The first request is billed under the ledger
//! idempotency key `<client key>#<first request id>`: unique per claim, so a key reused after
//! the window is billed again. Claims live in Redis beside the limits (shared by every replica,
//! expiring on their own: a `running` claim of a crashed gateway after [`RUNNING_TTL`]); when
//! Redis is not configured or not answering, in this process.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use sha2::{Digest, Sha256};
use sluice_policies::redis_conn::RedisConn;

use crate::limits::REDIS_TIMEOUT;

/// How long a completed claim answers retries.
pub const WINDOW: Duration = Duration::from_secs(24 * 3600);

/// How long a claim may stay `running`: longer than any request the gateway proxies (a slow
/// long generation must not lose its claim), and how long a gateway that died mid-request
/// leaves its key answering 409.
pub const RUNNING_TTL: Duration = Duration::from_secs(3600);

/// Longest accepted key (the ledger key adds `#` and a request id to it).
pub const MAX_KEY_LEN: usize = 200;

/// Largest response kept for replay; a larger one drops the claim instead.
pub const MAX_STORED: usize = 1 << 20;

/// Claims kept in this process at most (earliest expiring dropped first when full).
const LOCAL_CAP: usize = 10_000;

/// A completed response, as the client received it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// HTTP status.
    pub status: u16,
    /// `content-type`.
    pub content_type: String,
    /// The body bytes (the whole event stream for a streamed request).
    pub body: Bytes,
}

/// What a request's `Idempotency-Key` makes of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The first request with this key: run and bill it under `ledger_key`.
    First {
        /// The ledger idempotency key of the claim.
        ledger_key: String,
        /// Whether the claim is in Redis (else in this process, Redis having failed): its
        /// completion or release goes to the same place.
        shared: bool,
    },
    /// A retry of a completed request: answer with its response.
    Replay {
        /// The request that claimed the key.
        first_request_id: String,
        /// Its response.
        response: Stored,
    },
    /// The first request is still running.
    InProgress,
    /// The key was claimed by a request with another body.
    Mismatch,
}

/// KEYS[1] claim hash; ARGV body hash, request id, running ttl ms.
const CLAIM: &str = r"
local c = redis.call('HMGET', KEYS[1], 'body', 'id', 'state')
if not c[1] then
  redis.call('HSET', KEYS[1], 'body', ARGV[1], 'id', ARGV[2], 'state', 'running')
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'first', ARGV[2], '', ''}
end
if c[1] ~= ARGV[1] then return {'mismatch', c[2], '', ''} end
if c[3] ~= 'done' then return {'running', c[2], '', ''} end
local r = redis.call('HMGET', KEYS[1], 'status', 'ctype', 'response')
return {'done', c[2], r[1] .. ' ' .. r[2], r[3]}
";

/// KEYS[1] claim hash; ARGV request id, status, content type, body, window ms.
const COMPLETE: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', 'done', 'status', ARGV[2], 'ctype', ARGV[3], 'response', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
return 1
";

/// KEYS[1] claim hash; ARGV request id, then `running` to release only a claim still running.
const RELEASE: &str = r"
if redis.call('HGET', KEYS[1], 'id') ~= ARGV[1] then return 0 end
if ARGV[2] == 'running' and redis.call('HGET', KEYS[1], 'state') ~= 'running' then return 0 end
redis.call('DEL', KEYS[1])
return 1
";

struct LocalClaim {
    body: String,
    first: String,
    response: Option<Stored>,
    until: Instant,
}

struct Shared {
    conn: RedisConn,
    prefix: String,
    claim: redis::Script,
    complete: redis::Script,
    release: redis::Script,
}

/// The claims of every tenant's idempotency keys.
pub struct Idempotency {
    redis: Option<Shared>,
    local: Mutex<HashMap<String, LocalClaim>>,
    window: Duration,
    running_ttl: Duration,
}

impl std::fmt::Debug for Idempotency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Idempotency").field("window", &self.window).finish()
    }
}

fn hex(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

/// Checks a client's `Idempotency-Key` value: 1-200 visible ASCII characters.
pub fn valid_key(key: &str) -> bool {
    !key.is_empty() && key.len() <= MAX_KEY_LEN && key.bytes().all(|b| b.is_ascii_graphic())
}

fn text(v: &redis::Value) -> Option<Vec<u8>> {
    match v {
        redis::Value::BulkString(b) => Some(b.clone()),
        redis::Value::SimpleString(s) => Some(s.clone().into_bytes()),
        _ => None,
    }
}

impl Idempotency {
    /// Claims in Redis when `redis` (connection, key prefix) is given, else in this process;
    /// completed claims hold `window`, running ones `running_ttl`.
    pub fn new(
        redis: Option<(RedisConn, String)>,
        window: Duration,
        running_ttl: Duration,
    ) -> Self {
        Self {
            redis: redis.map(|(conn, prefix)| Shared {
                conn,
                prefix,
                claim: redis::Script::new(CLAIM),
                complete: redis::Script::new(COMPLETE),
                release: redis::Script::new(RELEASE),
            }),
            local: Mutex::new(HashMap::new()),
            window,
            running_ttl,
        }
    }

    fn slot(prefix: &str, tenant: &str, key: &str) -> String {
        format!("{{{prefix}:t:{tenant}}}:idem:{}", hex(key.as_bytes()))
    }

    /// Claims `key` for `tenant`'s request `request_id` with this `body` (callers include the
    /// method and path), or finds the claim it retries.
    pub async fn claim(&self, tenant: &str, key: &str, body: &[u8], request_id: &str) -> Claim {
        let body_hash = hex(body);
        if let Some(r) = &self.redis {
            let mut conn = r.conn.clone();
            let mut inv = r.claim.key(Self::slot(&r.prefix, tenant, key));
            let call = inv
                .arg(&body_hash)
                .arg(request_id)
                .arg(self.running_ttl.as_millis() as u64)
                .invoke_async::<Vec<redis::Value>>(&mut conn);
            match tokio::time::timeout(REDIS_TIMEOUT, call).await {
                Ok(Ok(reply)) => {
                    if let Some(c) = Self::parse(key, &reply) {
                        return c;
                    }
                    tracing::warn!("unexpected idempotency claim reply; local claims");
                }
                Ok(Err(e)) => tracing::warn!(error = %e, "idempotency claims unreachable; local"),
                Err(_) => tracing::warn!("idempotency claims timed out; local claims"),
            }
        }
        self.claim_locally(tenant, key, &body_hash, request_id)
    }

    fn parse(key: &str, reply: &[redis::Value]) -> Option<Claim> {
        let [kind, first, meta, body] = reply else { return None };
        let first = String::from_utf8(text(first)?).ok()?;
        Some(match text(kind)?.as_slice() {
            b"first" => Claim::First { ledger_key: format!("{key}#{first}"), shared: true },
            b"mismatch" => Claim::Mismatch,
            b"running" => Claim::InProgress,
            b"done" => {
                let meta = String::from_utf8(text(meta)?).ok()?;
                let (status, content_type) = meta.split_once(' ')?;
                Claim::Replay {
                    first_request_id: first,
                    response: Stored {
                        status: status.parse().ok()?,
                        content_type: content_type.to_owned(),
                        body: Bytes::from(text(body)?),
                    },
                }
            }
            _ => return None,
        })
    }

    fn claim_locally(&self, tenant: &str, key: &str, body_hash: &str, request_id: &str) -> Claim {
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let slot = Self::slot("", tenant, key);
        if let Some(c) = local.get(&slot)
            && c.until > now
        {
            return match &c.response {
                _ if c.body != body_hash => Claim::Mismatch,
                None => Claim::InProgress,
                Some(r) => Claim::Replay { first_request_id: c.first.clone(), response: r.clone() },
            };
        }
        if local.len() >= LOCAL_CAP {
            local.retain(|_, c| c.until > now);
            if local.len() >= LOCAL_CAP
                && let Some(first_out) =
                    local.iter().min_by_key(|(_, c)| c.until).map(|(k, _)| k.clone())
            {
                local.remove(&first_out);
            }
        }
        local.insert(
            slot,
            LocalClaim {
                body: body_hash.to_owned(),
                first: request_id.to_owned(),
                response: None,
                until: now + self.running_ttl,
            },
        );
        Claim::First { ledger_key: format!("{key}#{request_id}"), shared: false }
    }

    /// The first request completed: its response answers retries for the window (`shared`:
    /// where the claim was made).
    pub async fn complete(
        &self,
        tenant: &str,
        key: &str,
        request_id: &str,
        shared: bool,
        response: Stored,
    ) {
        if let Some(r) = self.redis.as_ref().filter(|_| shared) {
            let mut conn = r.conn.clone();
            let mut inv = r.complete.key(Self::slot(&r.prefix, tenant, key));
            let call = inv
                .arg(request_id)
                .arg(response.status)
                .arg(&response.content_type)
                .arg(response.body.as_ref())
                .arg(self.window.as_millis() as u64)
                .invoke_async::<i64>(&mut conn);
            match tokio::time::timeout(REDIS_TIMEOUT, call).await {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "idempotency completion not stored"),
                Err(_) => tracing::warn!("idempotency completion timed out"),
            }
        }
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = local.get_mut(&Self::slot("", tenant, key))
            && c.first == request_id
        {
            c.response = Some(response);
            c.until = Instant::now() + self.window;
        }
    }

    /// The first request did not complete: its claim is dropped, so a retry runs anew.
    pub async fn release(&self, tenant: &str, key: &str, request_id: &str, shared: bool) {
        self.release_if(tenant, key, request_id, shared, "any").await;
    }

    /// The Redis claim of a request whose gateway died: dropped if still running (a
    /// completed one keeps answering retries).
    pub async fn release_abandoned(&self, tenant: &str, key: &str, request_id: &str) {
        self.release_if(tenant, key, request_id, true, "running").await;
    }

    async fn release_if(
        &self,
        tenant: &str,
        key: &str,
        request_id: &str,
        shared: bool,
        when: &str,
    ) {
        if let Some(r) = self.redis.as_ref().filter(|_| shared) {
            let mut conn = r.conn.clone();
            let mut inv = r.release.key(Self::slot(&r.prefix, tenant, key));
            let call = inv.arg(request_id).arg(when).invoke_async::<i64>(&mut conn);
            match tokio::time::timeout(REDIS_TIMEOUT, call).await {
                Ok(Ok(_)) => return,
                Ok(Err(e)) => tracing::warn!(error = %e, "idempotency claim not released"),
                Err(_) => tracing::warn!("idempotency release timed out"),
            }
        }
        let mut local = self.local.lock().unwrap_or_else(|e| e.into_inner());
        let slot = Self::slot("", tenant, key);
        if local.get(&slot).is_some_and(|c| c.first == request_id) {
            local.remove(&slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_checked() {
        assert!(valid_key("retry-me-1"));
        assert!(!valid_key(""));
        assert!(!valid_key("has space"));
        assert!(!valid_key(&"x".repeat(MAX_KEY_LEN + 1)));
    }
}
