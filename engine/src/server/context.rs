//! What the trusted internal headers say about a request, and the internal-token check.
//!
//! The engine sits behind the gateway, which authenticates tenants and sets these headers;
//! with `--internal-token` only the gateway (holding the token) can reach it.

use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::http::HeaderMap;
use sha2::{Digest, Sha256};

use sluice_wire::MAX_WEIGHT;
use sluice_wire::header::{
    ADAPTER as ADAPTER_HEADER, PRIORITY as PRIORITY_HEADER, REQUEST_ID as REQUEST_ID_HEADER,
    TENANT as TENANT_HEADER, TPOT_MS as TPOT_HEADER, TRACEPARENT as TRACEPARENT_HEADER,
    WEIGHT as WEIGHT_HEADER,
};

use crate::server::adapters::AdapterRef;
use crate::server::error::ApiError;

const MAX_ID_LEN: usize = 128;

/// A W3C `traceparent` (version 00).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceContext {
    /// 32 lowercase hex digits.
    pub trace_id: String,
    /// 16 lowercase hex digits: the caller's span.
    pub parent_id: String,
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// Parses a `traceparent` header; `None` when it is malformed (the W3C rule is to ignore a
/// bad one rather than fail the request).
pub fn parse_traceparent(value: &str) -> Option<TraceContext> {
    let parts: Vec<&str> = value.trim().split('-').collect();
    let [version, trace_id, parent_id, flags, rest @ ..] = parts.as_slice() else {
        return None;
    };
    let hex = |s: &str, len: usize| {
        s.len() == len && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    // Version ff is forbidden; later versions may append fields, version 00 may not.
    if !hex(version, 2) || *version == "ff" || (*version == "00" && !rest.is_empty()) {
        return None;
    }
    if !hex(trace_id, 32) || !hex(parent_id, 16) || !hex(flags, 2) {
        return None;
    }
    if trace_id.bytes().all(|b| b == b'0') || parent_id.bytes().all(|b| b == b'0') {
        return None;
    }
    Some(TraceContext {
        trace_id: trace_id.to_string(),
        parent_id: parent_id.to_string(),
        flags: u8::from_str_radix(flags, 16).ok()?,
    })
}

/// Per-request facts taken from the headers when the request arrives.
#[derive(Clone, Debug)]
pub struct RequestContext {
    /// The request id (header or generated).
    pub request_id: String,
    /// The tenant cache scope, when the gateway named one.
    pub tenant: Option<String>,
    /// Scheduling priority.
    pub priority: i32,
    /// The tenant's weight in the fair order.
    pub weight: u32,
    /// The TPOT target to keep the request within.
    pub tpot_target: Option<std::time::Duration>,
    /// Trace context, when a valid one came in.
    pub trace: Option<TraceContext>,
    /// When the request reached the engine: the origin of every engine-side timing.
    pub arrival: Instant,
    /// Unix seconds at arrival (OpenAI's `created`).
    pub created: u64,
    /// The tenant adapter the gateway resolved the request's model to, if any.
    pub adapter: Option<AdapterRef>,
}

impl RequestContext {
    /// Reads the internal headers; a malformed one is a 400 naming it.
    pub fn from_headers(headers: &HeaderMap, arrival: Instant) -> Result<RequestContext, ApiError> {
        let text = |name: &str| -> Result<Option<String>, ApiError> {
            match headers.get(name) {
                None => Ok(None),
                Some(v) => v
                    .to_str()
                    .map(|s| Some(s.trim().to_string()))
                    .map_err(|_| ApiError::invalid(name, format!("{name} must be visible ASCII"))),
            }
        };
        let request_id = match text(REQUEST_ID_HEADER)? {
            Some(id) => {
                let ok = !id.is_empty()
                    && id.len() <= MAX_ID_LEN
                    && id.bytes().all(|b| b.is_ascii_alphanumeric() || b"-_.:".contains(&b));
                if !ok {
                    return Err(ApiError::invalid(
                        REQUEST_ID_HEADER,
                        format!(
                            "{REQUEST_ID_HEADER} must be 1 to {MAX_ID_LEN} characters of [A-Za-z0-9-_.:]"
                        ),
                    ));
                }
                id
            }
            None => uuid::Uuid::new_v4().simple().to_string(),
        };
        let tenant = match text(TENANT_HEADER)? {
            Some(t) if t.is_empty() || t.len() > 256 => {
                return Err(ApiError::invalid(
                    TENANT_HEADER,
                    format!("{TENANT_HEADER} must be 1 to 256 characters"),
                ));
            }
            t => t,
        };
        let priority = match text(PRIORITY_HEADER)? {
            Some(p) => p.parse::<i32>().map_err(|_| {
                ApiError::invalid(PRIORITY_HEADER, format!("{PRIORITY_HEADER} must be an i32"))
            })?,
            None => 0,
        };
        let weight = match text(WEIGHT_HEADER)? {
            Some(w) => {
                w.parse::<u32>().ok().filter(|w| (1..=MAX_WEIGHT).contains(w)).ok_or_else(|| {
                    ApiError::invalid(
                        WEIGHT_HEADER,
                        format!("{WEIGHT_HEADER} must be 1 to {MAX_WEIGHT}"),
                    )
                })?
            }
            None => 1,
        };
        let tpot_target = match text(TPOT_HEADER)? {
            Some(ms) => Some(
                ms.parse::<u64>()
                    .ok()
                    .filter(|ms| (1..=60_000).contains(ms))
                    .map(std::time::Duration::from_millis)
                    .ok_or_else(|| {
                        ApiError::invalid(TPOT_HEADER, format!("{TPOT_HEADER} must be 1 to 60000"))
                    })?,
            ),
            None => None,
        };
        let trace = text(TRACEPARENT_HEADER).ok().flatten().and_then(|t| parse_traceparent(&t));
        let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let adapter = match text(ADAPTER_HEADER)? {
            Some(a) => {
                Some(AdapterRef::parse(&a).map_err(|m| ApiError::invalid(ADAPTER_HEADER, m))?)
            }
            None => None,
        };
        Ok(RequestContext {
            request_id,
            tenant,
            priority,
            weight,
            tpot_target,
            trace,
            arrival,
            created,
            adapter,
        })
    }

    /// The trace id, when a trace context came in.
    pub fn trace_id(&self) -> Option<&str> {
        self.trace.as_ref().map(|t| t.trace_id.as_str())
    }
}

/// The expected internal bearer token, kept only as a digest.
#[derive(Clone)]
pub struct InternalToken {
    digest: [u8; 32],
}

impl std::fmt::Debug for InternalToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("InternalToken(<redacted>)")
    }
}

impl InternalToken {
    /// Remembers `token`.
    pub fn new(token: &str) -> InternalToken {
        InternalToken { digest: Sha256::digest(token.as_bytes()).into() }
    }

    /// Whether the `Authorization` header carries `Bearer <token>`. Comparing fixed-size
    /// digests without an early exit takes the same time whatever the caller sent.
    pub fn accepts(&self, headers: &HeaderMap) -> bool {
        let Some(value) = headers.get("authorization").and_then(|v| v.to_str().ok()) else {
            return false;
        };
        let Some((scheme, token)) = value.trim().split_once(' ') else {
            return false;
        };
        if !scheme.eq_ignore_ascii_case("bearer") {
            return false;
        }
        let given: [u8; 32] = Sha256::digest(token.trim().as_bytes()).into();
        given.iter().zip(self.digest.iter()).fold(0u8, |acc, (a, b)| acc | (a ^ b)) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn traceparent_parsing() {
        let good = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let t = parse_traceparent(good);
        assert_eq!(
            t,
            Some(TraceContext {
                trace_id: "4bf92f3577b34da6a3ce929d0e0e4736".into(),
                parent_id: "00f067aa0ba902b7".into(),
                flags: 1,
            })
        );
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(parse_traceparent(bad), None, "{bad:?}");
        }
        // A future version may carry more fields.
        assert!(
            parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-x")
                .is_some()
        );
    }

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            if let Ok(v) = HeaderValue::from_str(v) {
                h.insert(*k, v);
            }
        }
        h
    }

    #[test]
    fn internal_token_needs_the_exact_bearer() {
        let t = InternalToken::new("s3cret");
        assert!(t.accepts(&headers(&[("authorization", "Bearer s3cret")])));
        assert!(t.accepts(&headers(&[("authorization", "bearer s3cret")])));
        for bad in ["Bearer s3cre", "Bearer s3cret2", "Basic s3cret", "s3cret", "Bearer "] {
            assert!(!t.accepts(&headers(&[("authorization", bad)])), "{bad:?}");
        }
        assert!(!t.accepts(&HeaderMap::new()));
        assert!(!format!("{t:?}").contains("s3cret"));
    }

    #[test]
    fn header_context() -> Result<(), ApiError> {
        let now = Instant::now();
        let c = RequestContext::from_headers(
            &headers(&[
                ("x-sluice-tenant", "acme"),
                ("x-sluice-request-id", "req-1"),
                ("x-sluice-priority", "-3"),
                ("x-sluice-weight", "4"),
                ("x-sluice-tpot-ms", "80"),
                ("traceparent", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            ]),
            now,
        )?;
        assert_eq!(c.tenant.as_deref(), Some("acme"));
        assert_eq!(c.request_id, "req-1");
        assert_eq!(c.priority, -3);
        assert_eq!(c.weight, 4);
        assert_eq!(c.tpot_target, Some(std::time::Duration::from_millis(80)));
        assert_eq!(c.trace_id(), Some("4bf92f3577b34da6a3ce929d0e0e4736"));

        let c = RequestContext::from_headers(&HeaderMap::new(), now)?;
        assert_eq!((c.tenant, c.priority, c.weight, c.trace), (None, 0, 1, None));
        assert_eq!(c.request_id.len(), 32);

        for (name, value) in [
            ("x-sluice-priority", "high"),
            ("x-sluice-weight", "0"),
            ("x-sluice-weight", "1001"),
            ("x-sluice-tpot-ms", "0"),
            ("x-sluice-tpot-ms", "fast"),
            ("x-sluice-request-id", "has space"),
            ("x-sluice-request-id", ""),
        ] {
            let e = RequestContext::from_headers(&headers(&[(name, value)]), now).err();
            assert_eq!(e.and_then(|e| e.param), Some(name.to_string()), "{name}: {value:?}");
        }
        Ok(())
    }
}
