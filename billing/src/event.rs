//! `UsageEvent`: the wire format gateways emit, one per request that reached admission.
//!
//! Rejected, failed and client-disconnected requests emit one too, with the tokens actually
//! produced. Fields map 1:1 onto the `request_records` columns of the same name.
//!
//! Encoding: JSON. Times are RFC 3339 strings in UTC (`2026-11-29T09:00:00.123Z`), taken at the
//! gateway; durations are milliseconds as floating-point numbers (`*_ms`), `null` when the
//! interval never happened (no first token, one output token for TPOT, no engine). Money is
//! integer micro-units of the billing currency. Unknown fields are ignored rather than refused so
//! a newer gateway never sends a request's bill to the dead-letter stream.

use chrono::{DateTime, Utc};
use serde::{Deserialize, Serialize};

use crate::BillingError;

/// Longest accepted identifier (request id, idempotency key, tenant, key, model, revisions).
pub const MAX_ID_LEN: usize = 256;

/// Why generation ended, as recorded in `request_records.finish_reason`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token or stop string ended generation.
    Stop,
    /// The output token limit ended generation.
    Length,
    /// The model produced a tool call.
    ToolCalls,
    /// Output was filtered.
    ContentFilter,
    /// The client went away; the tokens produced until then are billed.
    ClientDisconnected,
    /// A server-side deadline expired.
    Timeout,
    /// The engine or gateway failed after admission.
    Error,
    /// Admission refused the request (limits, quota, validation after authentication).
    Rejected,
}

impl FinishReason {
    /// The value stored in the database column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
            Self::ContentFilter => "content_filter",
            Self::ClientDisconnected => "client_disconnected",
            Self::Timeout => "timeout",
            Self::Error => "error",
            Self::Rejected => "rejected",
        }
    }
}

pub use sluice_policies::prices::is_refused;

/// One request's billable usage, timings and execution identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct UsageEvent {
    /// Gateway-assigned request id; the ledger's primary key.
    pub request_id: String,
    /// Client `Idempotency-Key`; unique per tenant, so a retried request is billed once.
    pub idempotency_key: Option<String>,
    /// Authenticated tenant.
    pub tenant_id: String,
    /// API key id (never the secret).
    pub key_id: String,
    /// Model id the request executed under (never a bare alias).
    pub model_id: String,
    /// Content hash of the weights.
    pub model_revision: String,
    /// Tokenizer revision.
    pub tokenizer_revision: String,
    /// Chat template version (hash).
    pub chat_template_version: String,
    /// Adapter as `id@revision`, if any.
    pub adapter: Option<String>,
    /// Engine build, when the request reached an engine.
    pub engine_version: Option<String>,
    /// Engine worker that served it, when the request reached an engine.
    pub engine_worker: Option<String>,
    /// Prompt tokens, cached ones included.
    pub prompt_tokens: u32,
    /// Prompt tokens served from the prefix cache.
    pub cached_prompt_tokens: u32,
    /// Output tokens actually produced (also for disconnects and failures).
    pub completion_tokens: u32,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// HTTP status returned (or that would have been, for a disconnect).
    pub http_status: u16,
    /// Error label when the request failed.
    pub error_type: Option<String>,
    /// Whether the client disconnected before the response completed.
    pub client_disconnected: bool,
    /// Gateway time the request arrived (t_a).
    pub arrival_at: DateTime<Utc>,
    /// Gateway time the first output token was observed (t_1).
    pub first_token_at: Option<DateTime<Utc>>,
    /// Gateway time the last output token was observed (t_O).
    pub last_token_at: Option<DateTime<Utc>>,
    /// Gateway-side time to first token, ms.
    pub ttft_ms: Option<f64>,
    /// Gateway-side time per output token, ms; `None` when fewer than two tokens.
    pub tpot_ms: Option<f64>,
    /// Largest gateway-observed inter-token gap, ms.
    pub itl_max_ms: Option<f64>,
    /// p99 gateway-observed inter-token gap, ms.
    pub itl_p99_ms: Option<f64>,
    /// Gateway-side end-to-end latency, ms.
    pub e2e_ms: Option<f64>,
    /// Engine queue time (first QUEUED -> first SCHEDULED), ms.
    pub engine_queue_ms: Option<f64>,
    /// Engine prefill time (first scheduled -> first token), ms.
    pub engine_prefill_ms: Option<f64>,
    /// Engine decode time (first token -> last token), ms.
    pub engine_decode_ms: Option<f64>,
    /// Distributed trace id.
    pub trace_id: Option<String>,
    /// Lowercase hex SHA-256 of the rendered prompt (the text itself is never stored).
    pub prompt_sha256: String,
    /// Length of the rendered prompt in Unicode scalar values.
    pub prompt_chars: u32,
    /// The request's `user` (the tenant's end user), as lowercase hex SHA-256 of the tenant id,
    /// a newline and the value ([`user_sha256`]): filterable, the value itself never stored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub user_sha256: Option<String>,
    /// Cost in integer micro-units.
    pub cost_micros: u64,
    /// Version of the price list the cost was computed from (`policies/prices.json`).
    pub price_list_version: String,
    /// The rates it was priced at, micro-units per million tokens: uncached prompt tokens,
    /// cached prompt tokens, completion tokens. The cost is recomputed from them and the
    /// token counts alone ([`crate::prices::Rates::charge`]: nothing for a refused request).
    pub price_input_micros: u64,
    /// See [`price_input_micros`](Self::price_input_micros).
    pub price_cached_input_micros: u64,
    /// See [`price_input_micros`](Self::price_input_micros).
    pub price_output_micros: u64,
}

impl UsageEvent {
    /// Checks the rules serde cannot express. Messages never quote field values.
    pub fn validate(&self) -> Result<(), BillingError> {
        let required = [
            (&self.request_id, "request_id is empty or too long"),
            (&self.tenant_id, "tenant_id is empty or too long"),
            (&self.key_id, "key_id is empty or too long"),
            (&self.model_id, "model_id is empty or too long"),
            (&self.model_revision, "model_revision is empty or too long"),
            (&self.tokenizer_revision, "tokenizer_revision is empty or too long"),
            (&self.chat_template_version, "chat_template_version is empty or too long"),
            (&self.price_list_version, "price_list_version is empty or too long"),
        ];
        for (value, message) in required {
            if value.is_empty() || value.len() > MAX_ID_LEN {
                return Err(BillingError::InvalidEvent(message));
            }
        }
        let optional = [
            (&self.idempotency_key, "idempotency_key is empty or too long"),
            (&self.adapter, "adapter is empty or too long"),
            (&self.engine_version, "engine_version is empty or too long"),
            (&self.engine_worker, "engine_worker is empty or too long"),
            (&self.error_type, "error_type is empty or too long"),
            (&self.trace_id, "trace_id is empty or too long"),
        ];
        for (value, message) in optional {
            if value.as_ref().is_some_and(|v| v.is_empty() || v.len() > MAX_ID_LEN) {
                return Err(BillingError::InvalidEvent(message));
            }
        }
        if self.cached_prompt_tokens > self.prompt_tokens {
            return Err(BillingError::InvalidEvent("cached_prompt_tokens exceeds prompt_tokens"));
        }
        if !(100..=599).contains(&self.http_status) {
            return Err(BillingError::InvalidEvent("http_status is not an HTTP status code"));
        }
        if self.prompt_sha256.len() != 64
            || !self.prompt_sha256.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        {
            return Err(BillingError::InvalidEvent("prompt_sha256 is not 64 lowercase hex digits"));
        }
        if self.user_sha256.as_ref().is_some_and(|h| {
            h.len() != 64 || !h.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        }) {
            return Err(BillingError::InvalidEvent("user_sha256 is not 64 lowercase hex digits"));
        }
        if i64::try_from(self.cost_micros).is_err() {
            return Err(BillingError::InvalidEvent("cost_micros is out of range"));
        }
        let rates =
            [self.price_input_micros, self.price_cached_input_micros, self.price_output_micros];
        if rates.iter().any(|r| i64::try_from(*r).is_err()) {
            return Err(BillingError::InvalidEvent("a price rate is out of range"));
        }
        let durations = [
            self.ttft_ms,
            self.tpot_ms,
            self.itl_max_ms,
            self.itl_p99_ms,
            self.e2e_ms,
            self.engine_queue_ms,
            self.engine_prefill_ms,
            self.engine_decode_ms,
        ];
        if durations.iter().flatten().any(|ms| !ms.is_finite() || *ms < 0.0) {
            return Err(BillingError::InvalidEvent("a duration is negative or not finite"));
        }
        if self.first_token_at.is_some_and(|t| t < self.arrival_at) {
            return Err(BillingError::InvalidEvent("first_token_at precedes arrival_at"));
        }
        if let (Some(first), Some(last)) = (self.first_token_at, self.last_token_at)
            && last < first
        {
            return Err(BillingError::InvalidEvent("last_token_at precedes first_token_at"));
        }
        Ok(())
    }
}

/// What the ledger keeps of a request's `user` for `tenant`: lowercase hex SHA-256 of the
/// tenant id, a newline and the value. Scoped by tenant, so one tenant's end-user ids do not
/// link to another's; an auditor filters by the value and the API hashes it the same way.
pub fn user_sha256(tenant: &str, user: &str) -> String {
    use sha2::{Digest, Sha256};
    let digest = Sha256::digest(format!("{tenant}\n{user}").as_bytes());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}
