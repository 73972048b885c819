//! Admission as data: what the gateway decides about a request before it goes upstream, with
//! no pingora in it. [`route`] names the endpoint, [`bearer`] and [`authorize`] judge the key,
//! [`check`] validates and rewrites a generation request and counts its prompt tokens, and
//! every way of saying no is one [`Refusal`], which maps exhaustively to the HTTP status, the
//! OpenAI error type and code, the metric label and the ledger's finish reason. The proxy's
//! phases ([`crate::proxy`]) only run these steps in order and do the I/O between them.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use sluice_billing::FinishReason;
use sluice_billing::adapters::Adapter;
use sluice_billing::control::{KeyGrant, tier_tpot_ms, tier_ttft_ms};
use sluice_text::model::ModelText;
use sluice_text::template::{ChatMessage, ChatTemplate, encode_chat_tools};
use sluice_text::tokenizer::{MAX_PROMPT_IDS, PROMPT_FIELD, Tokenizer};
use sluice_text::tools::Tools;

use crate::catalog::{Catalog, ModelEntry};
use crate::limits::{Limit, RateState, Scope};

/// Largest request body accepted (long-context prompts; the engine takes up to 4 MiB, room for
/// this and the prompt's token ids the gateway adds).
pub const MAX_BODY_BYTES: usize = 2 << 20;

/// Counts prompt tokens exactly as the engine will: the model's chat template and tokenizer,
/// read from the same files the engine loads (a GGUF file or a Hugging Face directory), or
/// sent by the engine itself ([`TokenCounter::from_bundle`]).
#[derive(Debug)]
pub struct TokenCounter {
    tokenizer: Tokenizer,
    template: Option<ChatTemplate>,
    revision: String,
    template_version: Option<String>,
}

impl TokenCounter {
    /// From a model's text side (a GGUF file's weights are mapped, never read).
    pub fn open(path: &std::path::Path) -> sluice_text::Result<Self> {
        Ok(Self::of(ModelText::open(path)?))
    }

    /// From a text side an engine sent ([`ModelText::bundle`]).
    pub fn from_bundle(bytes: &[u8]) -> sluice_text::Result<Self> {
        Ok(Self::of(ModelText::from_bundle(bytes)?))
    }

    fn of(ModelText { tokenizer, template }: ModelText) -> Self {
        let revision = format!("sha256:{}", tokenizer.revision());
        let template_version = template.as_ref().map(|t| format!("sha256:{}", t.version()));
        Self { tokenizer, template, revision, template_version }
    }

    /// The tokenizer's revision, as the engine's execution identity names it.
    pub fn revision(&self) -> &str {
        &self.revision
    }

    /// The chat template's version, as the engine's execution identity names it (`None`: the
    /// model has no template).
    pub fn template_version(&self) -> Option<&str> {
        self.template_version.as_deref()
    }

    /// What the engine is told about a prompt's token ids: the ids, the tokenizer's revision
    /// and, for a chat, the template's version; `None` past [`MAX_PROMPT_IDS`].
    fn handed_over(&self, ids: Vec<u32>, chat: bool) -> Option<Value> {
        (ids.len() <= MAX_PROMPT_IDS).then(|| {
            let mut v = json!({"ids": ids, "tokenizer_revision": self.revision});
            if chat && let Some(t) = &self.template_version {
                v["chat_template_version"] = json!(t);
            }
            v
        })
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tokenizer.encode_prompt(text).map_err(|e| e.to_string())
    }

    /// Prompt token ids of a chat request, and the rendered prompt.
    fn chat(
        &self,
        messages: &[ChatMessage],
        tools: Option<&Tools>,
    ) -> Result<(Vec<u32>, String), String> {
        let t =
            self.template.as_ref().ok_or("the model has no chat template; use /v1/completions")?;
        encode_chat_tools(t, &self.tokenizer, messages, tools, true).map_err(|e| e.to_string())
    }
}

/// A generation endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`.
    Chat,
    /// `POST /v1/completions`.
    Completions,
}

/// What a request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// A generation, sent to an engine.
    Generate(Endpoint),
    /// `GET /v1/models`.
    Models,
    /// `GET /v1/models/{id}`.
    Model(String),
}

impl Route {
    /// The key scope that may call it (reading one model needs the scope that lists them).
    fn scope(&self) -> &'static str {
        match self {
            Self::Generate(Endpoint::Chat) => "chat",
            Self::Generate(Endpoint::Completions) => "completions",
            Self::Models | Self::Model(_) => "models",
        }
    }
}

/// Every answer the gateway gives instead of sending a request upstream.
#[derive(Clone, Debug, PartialEq)]
pub enum Refusal {
    /// A known path with another method.
    MethodNotAllowed { method: String, path: String, allow: &'static str },
    /// No such route.
    UnknownRoute { method: String, path: String },
    /// No bearer key, or one that is unknown, wrong, revoked or expired (never which).
    InvalidApiKey,
    /// The key store cannot be reached.
    AuthUnavailable,
    /// The tenant is suspended.
    TenantSuspended,
    /// The key's scopes do not include this route.
    InsufficientScope { path: String },
    /// The model is not served (or not visible to this tenant, for `GET /v1/models/{id}`).
    ModelNotFound { model: String },
    /// The tenant may not use this model.
    ModelNotAllowed { model: String },
    /// A malformed `Idempotency-Key`.
    InvalidIdempotencyKey,
    /// The body is over [`MAX_BODY_BYTES`].
    BodyTooLarge,
    /// The body did not arrive within the body deadline.
    BodyTimeout { deadline: Duration },
    /// The body could not be read.
    BodyUnreadable,
    /// A body too long to forward without a `Content-Length`.
    LengthRequired { over: usize },
    /// pingora kept nothing of the body to forward.
    BodyNotForwardable,
    /// The body is not JSON.
    InvalidJson(String),
    /// The body is JSON but not an object.
    NotAnObject,
    /// No `model`.
    MissingModel,
    /// `n` is not a positive integer.
    InvalidN,
    /// `n` over the tenant's cap.
    NOverCap { cap: u64 },
    /// `max_tokens` (or `max_completion_tokens`) is not a non-negative integer.
    InvalidMaxTokens { field: &'static str },
    /// `max_tokens` over the tenant's cap.
    MaxTokensOverCap { field: &'static str, cap: u64 },
    /// `messages` does not parse.
    InvalidMessages(String),
    /// `messages` is empty.
    EmptyMessages,
    /// `tools`, `tool_choice` or `parallel_tool_calls` is malformed.
    InvalidTools { param: &'static str, message: String },
    /// The prompt cannot be rendered or tokenized.
    Untokenizable { param: &'static str, reason: String },
    /// `prompt` is neither a string nor an array of token ids.
    InvalidPrompt,
    /// The prompt is over the tenant's limit.
    PromptTooLong { tokens: u64, limit: u64, param: &'static str },
    /// `slo` is malformed, or asks for a target tighter than the tier's.
    InvalidSlo { param: &'static str, message: String },
    /// A request with this `Idempotency-Key` is still running.
    IdempotencyInProgress,
    /// This `Idempotency-Key` came with another body.
    IdempotencyMismatch,
    /// The idempotency store failed.
    IdempotencyUnavailable,
    /// Every engine's queue is full.
    Overloaded,
    /// The model is served but the price list in force does not name it: served, it would be
    /// billed at a guess.
    ModelNotPriced { model: String },
    /// The shared limiter cannot be reached and the policy is to refuse.
    LimiterUnavailable,
    /// A rate limit or quota: which, whose, what the request needed, the header figures.
    Limited {
        /// The limit.
        limit: Limit,
        /// The tenant's or the key's.
        scope: Scope,
        /// The tokens the request would have reserved.
        reserved: u64,
        /// When trying again can succeed (`None`: never, as configured).
        retry_after: Option<Duration>,
        /// The `x-ratelimit-*` figures.
        rate: RateState,
    },
    /// The engines are backlogged and the tenant is past its share of them, further than its
    /// TTFT target allows it to queue.
    OverShare {
        /// When trying again can succeed.
        retry_after: Duration,
    },
    /// The gateway is draining for shutdown.
    ShuttingDown,
    /// The client's address has too many requests in flight.
    TooManyConnections,
    /// Writing a direct answer failed.
    WriteFailed,
}

impl Refusal {
    /// The HTTP status.
    pub fn status(&self) -> u16 {
        match self {
            Self::InvalidIdempotencyKey
            | Self::BodyUnreadable
            | Self::InvalidJson(_)
            | Self::NotAnObject
            | Self::MissingModel
            | Self::InvalidN
            | Self::NOverCap { .. }
            | Self::InvalidMaxTokens { .. }
            | Self::MaxTokensOverCap { .. }
            | Self::InvalidMessages(_)
            | Self::EmptyMessages
            | Self::Untokenizable { .. }
            | Self::InvalidPrompt
            | Self::InvalidTools { .. }
            | Self::InvalidSlo { .. } => 400,
            Self::InvalidApiKey => 401,
            Self::TenantSuspended
            | Self::InsufficientScope { .. }
            | Self::ModelNotAllowed { .. } => 403,
            Self::UnknownRoute { .. } | Self::ModelNotFound { .. } => 404,
            Self::MethodNotAllowed { .. } => 405,
            Self::BodyTimeout { .. } => 408,
            Self::IdempotencyInProgress => 409,
            Self::LengthRequired { .. } => 411,
            Self::BodyTooLarge | Self::PromptTooLong { .. } => 413,
            Self::IdempotencyMismatch => 422,
            Self::Limited { .. } | Self::OverShare { .. } | Self::TooManyConnections => 429,
            Self::BodyNotForwardable | Self::IdempotencyUnavailable | Self::WriteFailed => 500,
            Self::AuthUnavailable
            | Self::Overloaded
            | Self::ModelNotPriced { .. }
            | Self::LimiterUnavailable
            | Self::ShuttingDown => 503,
        }
    }

    /// OpenAI's error `type`.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::TenantSuspended
            | Self::InsufficientScope { .. }
            | Self::ModelNotAllowed { .. } => "permission_error",
            Self::Limited { limit: Limit::DailyTokens | Limit::MonthlyTokens, .. } => {
                "insufficient_quota"
            }
            Self::Limited { .. } | Self::OverShare { .. } | Self::TooManyConnections => {
                "rate_limit_error"
            }
            Self::AuthUnavailable
            | Self::BodyNotForwardable
            | Self::IdempotencyUnavailable
            | Self::Overloaded
            | Self::ModelNotPriced { .. }
            | Self::LimiterUnavailable
            | Self::ShuttingDown
            | Self::WriteFailed => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's error `code` (where there is one) and the metric label, in one exhaustive
    /// table: most refusals are labelled by their code.
    fn names(&self) -> (Option<&'static str>, &'static str) {
        let code = |c| (Some(c), c);
        match self {
            Self::MethodNotAllowed { .. } => code("method_not_allowed"),
            Self::UnknownRoute { .. } => code("unknown_route"),
            Self::InvalidApiKey => code("invalid_api_key"),
            Self::TenantSuspended => code("tenant_suspended"),
            Self::InsufficientScope { .. } => code("insufficient_scope"),
            Self::ModelNotFound { .. } => code("model_not_found"),
            Self::ModelNotAllowed { .. } => code("model_not_allowed"),
            Self::InvalidIdempotencyKey => code("invalid_idempotency_key"),
            Self::BodyTimeout { .. } => (Some("request_timeout"), "body_timeout"),
            Self::PromptTooLong { .. } => code("context_length_exceeded"),
            Self::IdempotencyInProgress => code("idempotency_key_in_use"),
            Self::IdempotencyMismatch => code("idempotency_key_reused"),
            Self::Overloaded => code("overloaded"),
            Self::ModelNotPriced { .. } => code("model_not_priced"),
            // Labelled by the limit and its scope ([`Self::label`]).
            Self::Limited { limit: Limit::DailyTokens | Limit::MonthlyTokens, .. } => {
                code("insufficient_quota")
            }
            Self::Limited { .. } => code("rate_limit_exceeded"),
            Self::OverShare { .. } => code("fair_share_exceeded"),
            Self::ShuttingDown => code("shutting_down"),
            Self::TooManyConnections => code("too_many_connections"),
            Self::AuthUnavailable => code("auth_unavailable"),
            Self::BodyTooLarge => (None, "body_too_large"),
            Self::BodyUnreadable
            | Self::LengthRequired { .. }
            | Self::BodyNotForwardable
            | Self::InvalidJson(_)
            | Self::NotAnObject => (None, "invalid_body"),
            Self::MissingModel
            | Self::InvalidN
            | Self::NOverCap { .. }
            | Self::InvalidMaxTokens { .. }
            | Self::MaxTokensOverCap { .. }
            | Self::InvalidMessages(_)
            | Self::EmptyMessages
            | Self::Untokenizable { .. }
            | Self::InvalidPrompt
            | Self::InvalidTools { .. }
            | Self::InvalidSlo { .. } => (None, "invalid_parameter"),
            Self::IdempotencyUnavailable => code("idempotency_unavailable"),
            Self::LimiterUnavailable => code("limiter_unavailable"),
            Self::WriteFailed => (None, "write_failed"),
        }
    }

    /// OpenAI's error `code`, where there is one.
    pub fn code(&self) -> Option<&'static str> {
        self.names().0
    }

    /// The request parameter at fault, where there is one.
    pub fn param(&self) -> Option<&'static str> {
        match self {
            Self::ModelNotFound { .. } | Self::ModelNotAllowed { .. } | Self::MissingModel => {
                Some("model")
            }
            Self::InvalidN | Self::NOverCap { .. } => Some("n"),
            Self::InvalidMaxTokens { .. } | Self::MaxTokensOverCap { .. } => Some("max_tokens"),
            Self::InvalidMessages(_) | Self::EmptyMessages => Some("messages"),
            Self::InvalidPrompt => Some("prompt"),
            Self::Untokenizable { param, .. }
            | Self::PromptTooLong { param, .. }
            | Self::InvalidTools { param, .. }
            | Self::InvalidSlo { param, .. } => Some(param),
            _ => None,
        }
    }

    /// What the client is told.
    pub fn message(&self) -> String {
        match self {
            Self::MethodNotAllowed { method, path, allow } => {
                format!("{path} does not accept {method}; use {allow}")
            }
            Self::UnknownRoute { method, path } => format!("unknown route {method} {path}"),
            Self::InvalidApiKey => "Incorrect API key provided.".into(),
            Self::AuthUnavailable => "authentication is unavailable; retry shortly".into(),
            Self::TenantSuspended => "this tenant is suspended".into(),
            Self::InsufficientScope { path } => format!("this key may not call {path}"),
            Self::ModelNotFound { model } => format!("The model `{model}` does not exist"),
            Self::ModelNotAllowed { model } => format!("this tenant may not use `{model}`"),
            Self::InvalidIdempotencyKey => {
                "Idempotency-Key must be 1-200 visible ASCII characters".into()
            }
            Self::BodyTooLarge => format!("request body over {MAX_BODY_BYTES} bytes"),
            Self::BodyTimeout { deadline } => {
                format!("the request body did not arrive within {} s", deadline.as_secs())
            }
            Self::BodyUnreadable => "could not read the request body".into(),
            Self::LengthRequired { over } => {
                format!("a body over {over} bytes needs a Content-Length header")
            }
            Self::BodyNotForwardable => "the request body could not be forwarded".into(),
            Self::InvalidJson(e) => {
                format!("We could not parse the JSON body of your request: {e}")
            }
            Self::NotAnObject => "the body must be a JSON object".into(),
            Self::MissingModel => "you must provide a model parameter".into(),
            Self::InvalidN => "n must be a positive integer".into(),
            Self::NOverCap { cap } => format!("n is over this tenant's cap of {cap}"),
            Self::InvalidMaxTokens { field } => format!("{field} must be a non-negative integer"),
            Self::MaxTokensOverCap { field, cap } => {
                format!("{field} is over this tenant's cap of {cap}")
            }
            Self::InvalidMessages(e) => format!("invalid messages: {e}"),
            Self::EmptyMessages => "messages must not be empty".into(),
            Self::Untokenizable { reason, .. } => reason.clone(),
            Self::InvalidPrompt => "prompt must be a string or an array of token ids".into(),
            Self::PromptTooLong { tokens, limit, .. } => {
                format!("the prompt has {tokens} tokens, over this tenant's limit of {limit}")
            }
            Self::InvalidSlo { message, .. } | Self::InvalidTools { message, .. } => {
                message.clone()
            }
            Self::IdempotencyInProgress => {
                "a request with this Idempotency-Key is still in progress; retry later".into()
            }
            Self::IdempotencyMismatch => {
                "this Idempotency-Key was used with a different request body".into()
            }
            Self::IdempotencyUnavailable => "idempotency check failed".into(),
            Self::Overloaded => "the engines are at capacity; retry shortly".into(),
            Self::ModelNotPriced { model } => format!(
                "the model `{model}` has no price in this platform's price list, so it is not \
                 served; the operator must price it (prices.json)"
            ),
            Self::LimiterUnavailable => "rate limiting is unavailable; retry shortly".into(),
            Self::Limited { limit, scope, reserved, .. } => {
                let whose = match scope {
                    Scope::Tenant => "",
                    Scope::Key => "this API key's ",
                };
                let what = match limit {
                    Limit::Rpm | Limit::Concurrency => "requests",
                    _ => "tokens",
                };
                format!(
                    "Rate limit reached for {whose}{what} ({}); this request needs {reserved} \
                     tokens.",
                    limit.as_str()
                )
            }
            Self::OverShare { retry_after } => format!(
                "the engines are busy and this tenant's requests past its share of them would not \
                 start in time; retry after {} s",
                seconds_up(*retry_after)
            ),
            Self::ShuttingDown => "the gateway is shutting down; retry on another replica".into(),
            Self::TooManyConnections => "too many requests in flight from this address".into(),
            Self::WriteFailed => "write failed".into(),
        }
    }

    /// Headers the answer carries beside the error body.
    pub fn headers(&self) -> Vec<(String, String)> {
        let retry_soon = || vec![("retry-after".to_owned(), "1".to_owned())];
        match self {
            Self::MethodNotAllowed { allow, .. } => vec![("allow".into(), (*allow).into())],
            Self::Overloaded
            | Self::LimiterUnavailable
            | Self::IdempotencyInProgress
            | Self::TooManyConnections => retry_soon(),
            Self::ShuttingDown => {
                let mut h = retry_soon();
                h.push(("connection".into(), "close".into()));
                h
            }
            Self::OverShare { retry_after } => {
                vec![("retry-after".into(), seconds_up(*retry_after).to_string())]
            }
            Self::Limited { retry_after, rate, .. } => {
                let mut h = rate_headers(rate);
                if let Some(after) = retry_after {
                    h.push(("retry-after".into(), after.as_secs().max(1).to_string()));
                }
                h
            }
            _ => Vec::new(),
        }
    }

    /// The OpenAI error body.
    pub fn body(&self) -> Bytes {
        error_json(&self.message(), self.kind(), self.param(), self.code())
    }

    /// The label of `sluice_gateway_admission_refusals_total`.
    pub fn label(&self) -> String {
        match self {
            Self::Limited { limit, scope: Scope::Tenant, .. } => limit.as_str().to_owned(),
            Self::Limited { limit, scope: Scope::Key, .. } => format!("key_{}", limit.as_str()),
            _ => self.names().1.to_owned(),
        }
    }

    /// How the ledger records it: `rejected` for a request judged and declined, `error` for
    /// one the gateway failed to take (its body never came whole, a write failed).
    pub fn finish_reason(&self) -> FinishReason {
        match self {
            Self::BodyTimeout { .. }
            | Self::LengthRequired { .. }
            | Self::BodyNotForwardable
            | Self::IdempotencyUnavailable
            | Self::WriteFailed
            | Self::InvalidApiKey
            | Self::MethodNotAllowed { .. } => FinishReason::Error,
            _ => FinishReason::Rejected,
        }
    }
}

/// Whole seconds, rounded up, at least 1 (`Retry-After` never invites an early retry).
fn seconds_up(d: Duration) -> u64 {
    (d.as_secs_f64().ceil() as u64).max(1)
}

/// An OpenAI error body.
pub fn error_json(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Bytes {
    let body = sluice_wire::ErrorBody::new(message, kind, param, code);
    Bytes::from(serde_json::to_vec(&body).unwrap_or_default())
}

/// The `x-ratelimit-*` headers for `r`.
pub fn rate_headers(r: &RateState) -> Vec<(String, String)> {
    let mut v = Vec::new();
    let secs = |d: Duration| format!("{:.3}s", d.as_secs_f64());
    // The local fallback knows the limits but not the fleet's remaining counts.
    if let Some(l) = r.limit_requests {
        v.push(("x-ratelimit-limit-requests".into(), l.to_string()));
        if let Some(rem) = r.remaining_requests {
            v.push(("x-ratelimit-remaining-requests".into(), rem.to_string()));
            v.push(("x-ratelimit-reset-requests".into(), secs(r.reset_requests)));
        }
    }
    if let Some(l) = r.limit_tokens {
        v.push(("x-ratelimit-limit-tokens".into(), l.to_string()));
        if let Some(rem) = r.remaining_tokens {
            v.push(("x-ratelimit-remaining-tokens".into(), rem.to_string()));
            v.push(("x-ratelimit-reset-tokens".into(), secs(r.reset_tokens)));
        }
    }
    v
}

/// The route of `method` `path`.
pub fn route(method: &str, path: &str) -> Result<Route, Refusal> {
    match (method, path) {
        ("POST", "/v1/chat/completions") => Ok(Route::Generate(Endpoint::Chat)),
        ("POST", "/v1/completions") => Ok(Route::Generate(Endpoint::Completions)),
        ("GET", "/v1/models") => Ok(Route::Models),
        ("GET", p) if p.strip_prefix("/v1/models/").is_some_and(|id| !id.is_empty()) => {
            Ok(Route::Model(p.trim_start_matches("/v1/models/").to_owned()))
        }
        (_, "/v1/chat/completions" | "/v1/completions" | "/v1/models") => {
            Err(Refusal::MethodNotAllowed {
                method: method.to_owned(),
                path: path.to_owned(),
                allow: if path == "/v1/models" { "GET" } else { "POST" },
            })
        }
        _ => Err(Refusal::UnknownRoute { method: method.to_owned(), path: path.to_owned() }),
    }
}

/// The key in an `Authorization` header (the scheme is case-insensitive, RFC 9110).
pub fn bearer(authorization: Option<&str>) -> Result<&str, Refusal> {
    authorization
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, t)| t.trim())
        .ok_or(Refusal::InvalidApiKey)
}

/// Whether `grant` may call `route` at all.
pub fn authorize(grant: &KeyGrant, route: &Route, path: &str) -> Result<(), Refusal> {
    if grant.tenant_status != "active" {
        return Err(Refusal::TenantSuspended);
    }
    if !grant.scopes.iter().any(|s| s == route.scope()) {
        return Err(Refusal::InsufficientScope { path: path.to_owned() });
    }
    Ok(())
}

/// Whether the tenant may see and use `model`.
pub fn model_allowed(grant: &KeyGrant, model: &str) -> bool {
    let allowed = &grant.quota.allowed_models;
    allowed.is_empty() || allowed.iter().any(|a| a == model)
}

/// What this gateway serves, for [`check`].
#[derive(Debug)]
pub struct Served {
    /// The models, learned from the engines.
    pub catalog: Arc<Catalog>,
    /// `max_tokens` when a request gives none and the tenant sets no cap.
    pub default_max_tokens: u64,
}

/// What a request asks for, as admission read it: kept once, for the engine's headers, the
/// stream's handling, the reservation and the usage event. A refused request keeps what was
/// read before the refusal (the model it named, at least, when it named one).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Asked {
    /// The model's id (an alias resolved), once named; the name asked for, when the request
    /// was refused for it.
    pub model: Option<String>,
    /// The tenant adapter it runs under (`tenant/name@revision`), for the engine's
    /// `x-sluice-adapter` header.
    pub adapter: Option<String>,
    /// Prompt tokens, as the engine will count them.
    pub prompt_tokens: u64,
    /// The most the request can use: its prompt and the largest output of every choice (what
    /// its admission reserves).
    pub reserved: u64,
    /// SHA-256 of the prompt (the rendered chat, the raw prompt or its token ids), hex.
    pub prompt_sha256: String,
    /// The prompt's length in characters.
    pub prompt_chars: u64,
    /// The request's `user` as the ledger keeps it ([`sluice_billing::event::user_sha256`]):
    /// the end user's id hashed with the tenant's, never the id itself.
    pub user_sha256: Option<String>,
    /// The prompt's first 512 characters, for prefix affinity over the engines.
    pub affinity: String,
    /// Streamed.
    pub stream: bool,
    /// The stream's usage-only chunk is the gateway's, not the client's: held back.
    pub strip_usage: bool,
    /// The latency targets the request is held to.
    pub slo: Slo,
}

/// A generation request that passed [`check`]: the body to forward and what it asks for.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The body to forward: defaults filled in, usage asked for in streams, the gateway's
    /// own prompt token ids, the model named by its id (not an alias).
    pub body: Bytes,
    /// Choices asked for (`n`): the sequences the engine will run.
    pub choices: u64,
    /// The parameter that holds the prompt (`messages` or `prompt`).
    pub prompt_param: &'static str,
    /// What it asks for (its model always named).
    pub asked: Asked,
}

impl Checked {
    /// The model's id.
    pub fn model(&self) -> &str {
        self.asked.model.as_deref().unwrap_or_default()
    }
}

/// The latency targets a request is held to, in milliseconds: its tier's
/// (`policies/scheduling.json`), or looser ones it asked for in the body's `slo` object
/// (`{"ttft_ms": 3000, "tpot_ms": 250}`, a Sluice extension). A request may loosen its
/// tier's targets, never tighten them: a tighter target would take service from others.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Slo {
    /// Time to first token: how long the request may wait to start.
    pub ttft_ms: Option<u32>,
    /// Time per output token: how slow the batch it runs in may become.
    pub tpot_ms: Option<u32>,
}

impl Slo {
    /// `tier`'s targets.
    pub fn of_tier(tier: &str) -> Self {
        Self { ttft_ms: tier_ttft_ms(tier), tpot_ms: tier_tpot_ms(tier) }
    }

    /// The targets for a request of `tier` that sent `asked` as its `slo` (absent or null:
    /// the tier's).
    pub fn asked(asked: Option<&Value>, tier: &str) -> Result<Self, Refusal> {
        let mut slo = Self::of_tier(tier);
        let fields = match asked {
            None | Some(Value::Null) => return Ok(slo),
            Some(Value::Object(fields)) => fields,
            Some(_) => {
                return Err(Refusal::InvalidSlo {
                    param: "slo",
                    message: "slo must be an object with ttft_ms and/or tpot_ms".into(),
                });
            }
        };
        for (name, value) in fields {
            let (param, target, most) = match name.as_str() {
                "ttft_ms" => ("slo.ttft_ms", &mut slo.ttft_ms, 600_000),
                "tpot_ms" => ("slo.tpot_ms", &mut slo.tpot_ms, 60_000),
                other => {
                    return Err(Refusal::InvalidSlo {
                        param: "slo",
                        message: format!("unknown slo field {other:?} (known: ttft_ms, tpot_ms)"),
                    });
                }
            };
            let ms = value
                .as_u64()
                .filter(|ms| (1..=most).contains(ms))
                .and_then(|ms| u32::try_from(ms).ok())
                .ok_or_else(|| Refusal::InvalidSlo {
                    param,
                    message: format!("{param} must be an integer from 1 to {most}"),
                })?;
            match *target {
                Some(tier_ms) if ms < tier_ms => {
                    return Err(Refusal::InvalidSlo {
                        param,
                        message: format!(
                            "{param} {ms} is tighter than the {tier} tier's target of {tier_ms} \
                             ms; a request may only loosen its tier's targets"
                        ),
                    });
                }
                Some(_) => *target = Some(ms),
                None => {
                    return Err(Refusal::InvalidSlo {
                        param,
                        message: format!(
                            "the {tier} tier has no {} target: there is nothing to loosen",
                            &param[4..]
                        ),
                    });
                }
            }
        }
        Ok(slo)
    }
}

/// Validates and rewrites a generation request against the tenant's caps, and counts its
/// prompt tokens: the pure part of admission (it tokenizes: run a long body off the I/O thread).
/// The prompt limit is [`within_prompt_limit`]'s.
pub fn check(
    endpoint: Endpoint,
    grant: &KeyGrant,
    body: &[u8],
    served: &Served,
) -> Result<Checked, Refusal> {
    check_as(endpoint, grant, body, served, None)
}

/// [`check`] of a request whose `model` names a tenant adapter, `adapter` being the revision
/// the ledger resolved it to for this tenant: the request runs on the adapter's base model,
/// and `allowed_models` admits it by the adapter's `tenant/name` or by its base model.
pub fn check_as(
    endpoint: Endpoint,
    grant: &KeyGrant,
    body: &[u8],
    served: &Served,
    adapter: Option<&Adapter>,
) -> Result<Checked, Refusal> {
    let mut v: Value =
        serde_json::from_slice(body).map_err(|e| Refusal::InvalidJson(e.to_string()))?;
    let obj = v.as_object_mut().ok_or(Refusal::NotAnObject)?;
    // The cache scope comes from the tenant (a body's `cache_salt` is refused by name at the
    // engine, as is every parameter it does not implement) and the prompt's token ids from
    // the gateway, never from the client.
    obj.remove(PROMPT_FIELD);
    let model = obj.get("model").and_then(Value::as_str).unwrap_or_default().to_owned();
    if model.is_empty() {
        return Err(Refusal::MissingModel);
    }
    let (entry, adapter_id) = resolve_model(grant, served, model, adapter)?;
    let counter = &entry.tokens;
    obj.insert("model".into(), Value::from(entry.id.as_str()));
    // The engine learns the targets from the gateway's headers, not from the body.
    let slo = Slo::asked(obj.remove("slo").as_ref(), &grant.tier)?;
    let (n, max_tokens) = output_asked(endpoint, obj, grant, served)?;
    let (ids, prompt_text, param) = prompt_of(endpoint, obj, counter)?;
    let prompt_tokens = match &ids {
        Some(ids) => ids.len(),
        None => obj.get("prompt").and_then(Value::as_array).map_or(0, Vec::len),
    };
    // The engine uses these instead of tokenizing again when its tokenizer is this one.
    if let Some(sent) = ids.and_then(|ids| counter.handed_over(ids, endpoint == Endpoint::Chat)) {
        obj.insert(PROMPT_FIELD.into(), sent);
    }
    let prompt_tokens = prompt_tokens as u64;
    let stream = obj.get("stream").and_then(Value::as_bool).unwrap_or(false);
    let mut strip_usage = false;
    if stream {
        // Usage in the final chunk, so the tokens produced are known even for streams; a
        // client that did not ask for it does not get it.
        let asked = obj.get("stream_options").and_then(|o| o.get("include_usage"));
        strip_usage = asked != Some(&Value::Bool(true));
        obj.insert("stream_options".into(), json!({"include_usage": true}));
    }
    let user_sha256 = obj
        .get("user")
        .and_then(Value::as_str)
        .map(|u| sluice_billing::event::user_sha256(&grant.tenant_id, u));
    Ok(Checked {
        body: Bytes::from(v.to_string()),
        choices: n,
        prompt_param: param,
        asked: Asked {
            model: Some(entry.id.clone()),
            adapter: adapter_id,
            prompt_tokens,
            reserved: prompt_tokens.saturating_add(max_tokens.saturating_mul(n)),
            prompt_sha256: hex_digest(prompt_text.as_bytes()),
            prompt_chars: prompt_text.chars().count() as u64,
            user_sha256,
            affinity: prompt_text.chars().take(512).collect(),
            stream,
            strip_usage,
            slo,
        },
    })
}

/// The catalog entry a request runs on, with the adapter revision it runs under: the model it
/// names, or the base model of the tenant adapter it names. Refused when no engine serves it or
/// the key may not use it.
fn resolve_model(
    grant: &KeyGrant,
    served: &Served,
    model: String,
    adapter: Option<&Adapter>,
) -> Result<(Arc<ModelEntry>, Option<String>), Refusal> {
    let Some(a) = adapter else {
        let Some(entry) = served.catalog.resolve(&model) else {
            return Err(Refusal::ModelNotFound { model });
        };
        if !model_allowed(grant, &entry.id) && !model_allowed(grant, &model) {
            return Err(Refusal::ModelNotAllowed { model });
        }
        return Ok((entry, None));
    };
    // An adapter of a model no engine serves is as unknown as any other model.
    let Some(entry) = served.catalog.resolve(&a.base_model) else {
        return Err(Refusal::ModelNotFound { model });
    };
    let name = format!("{}/{}", a.tenant_id, a.name);
    if !model_allowed(grant, &name) && !model_allowed(grant, &entry.id) {
        return Err(Refusal::ModelNotAllowed { model });
    }
    Ok((entry, Some(a.id())))
}

/// The output a request asks for, `(n, max_tokens)`, within the tenant's caps: `max_tokens`
/// (or a chat's `max_completion_tokens`) is written back into the body, filled in from the
/// cap and the served default when absent.
fn output_asked(
    endpoint: Endpoint,
    obj: &mut serde_json::Map<String, Value>,
    grant: &KeyGrant,
    served: &Served,
) -> Result<(u64, u64), Refusal> {
    let q = &grant.quota;
    let n = match obj.get("n") {
        None | Some(Value::Null) => 1,
        Some(x) => x.as_u64().filter(|n| *n >= 1).ok_or(Refusal::InvalidN)?,
    };
    if let Some(cap) = q.max_n.and_then(|m| u64::try_from(m).ok())
        && n > cap
    {
        return Err(Refusal::NOverCap { cap });
    }
    let field = if endpoint == Endpoint::Chat && obj.contains_key("max_completion_tokens") {
        "max_completion_tokens"
    } else {
        "max_tokens"
    };
    let cap = q.max_output_tokens.and_then(|m| u64::try_from(m).ok());
    let max_tokens = match obj.get(field) {
        None | Some(Value::Null) => {
            cap.unwrap_or(served.default_max_tokens).min(served.default_max_tokens)
        }
        Some(x) => x.as_u64().ok_or(Refusal::InvalidMaxTokens { field })?,
    };
    if let Some(cap) = cap
        && max_tokens > cap
    {
        return Err(Refusal::MaxTokensOverCap { field, cap });
    }
    obj.insert(field.into(), Value::from(max_tokens));
    Ok((n, max_tokens))
}

/// The request's prompt: its token ids when the gateway tokenized it (`None` for a prompt of
/// the client's own token ids), its text as hashed and measured, and the parameter that holds
/// it.
fn prompt_of(
    endpoint: Endpoint,
    obj: &serde_json::Map<String, Value>,
    counter: &TokenCounter,
) -> Result<(Option<Vec<u32>>, String, &'static str), Refusal> {
    match endpoint {
        Endpoint::Chat => {
            let messages: Vec<ChatMessage> =
                serde_json::from_value(obj.get("messages").cloned().unwrap_or(Value::Null))
                    .map_err(|e| Refusal::InvalidMessages(e.to_string()))?;
            if messages.is_empty() {
                return Err(Refusal::EmptyMessages);
            }
            let tools = Tools::from_object(obj)
                .map_err(|e| Refusal::InvalidTools { param: e.param, message: e.message })?;
            let param = "messages";
            let (ids, text) = counter
                .chat(&messages, tools.as_ref())
                .map_err(|reason| Refusal::Untokenizable { param, reason })?;
            Ok((Some(ids), text, param))
        }
        Endpoint::Completions => {
            let param = "prompt";
            match obj.get("prompt") {
                Some(Value::String(s)) => {
                    let ids = counter
                        .encode(s)
                        .map_err(|reason| Refusal::Untokenizable { param, reason })?;
                    Ok((Some(ids), s.clone(), param))
                }
                // Token ids are the client's own: the engine checks them against its vocabulary.
                Some(Value::Array(a)) if a.iter().all(Value::is_u64) && !a.is_empty() => {
                    Ok((None, Value::Array(a.clone()).to_string(), param))
                }
                _ => Err(Refusal::InvalidPrompt),
            }
        }
    }
}

/// Whether the checked prompt is within the tenant's prompt limit (a separate step, so that
/// the refused request's row still records the prompt it brought).
pub fn within_prompt_limit(grant: &KeyGrant, checked: &Checked) -> Result<(), Refusal> {
    match grant.quota.max_prompt_tokens.and_then(|m| u64::try_from(m).ok()) {
        Some(limit) if checked.asked.prompt_tokens > limit => Err(Refusal::PromptTooLong {
            tokens: checked.asked.prompt_tokens,
            limit,
            param: checked.prompt_param,
        }),
        _ => Ok(()),
    }
}

/// Hex SHA-256 of `b`.
pub fn hex_digest(b: &[u8]) -> String {
    Sha256::digest(b).iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use sluice_billing::control::QuotaSettings;
    use sluice_text::synth::write_vocab_gguf;

    type TestResult = Result<(), Box<dyn std::error::Error>>;

    fn counter() -> Result<TokenCounter, Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("tiny.gguf");
        write_vocab_gguf(320, &path)?;
        Ok(TokenCounter::open(&path)?)
    }

    fn grant(quota: QuotaSettings) -> KeyGrant {
        KeyGrant {
            key_id: "key_1".into(),
            tenant_id: "acme".into(),
            tenant_status: "active".into(),
            tier: "standard".into(),
            scopes: vec!["chat".into(), "completions".into(), "models".into()],
            quota,
            key_limits: Default::default(),
            overrides: Value::Null,
        }
    }

    /// A gateway serving model `m` (alias `default`), counted by [`counter`].
    fn served() -> Result<Served, Box<dyn std::error::Error>> {
        let aliases = [("default".to_owned(), "m".to_owned())].into_iter().collect();
        let catalog = Catalog::with_aliases(Vec::new(), aliases);
        let text = catalog.add_text(counter()?);
        let identity = sluice_wire::ExecutionIdentity {
            model_id: "m".into(),
            model_revision: "sha256:m".into(),
            tokenizer_revision: text.revision().to_owned(),
            chat_template_version: text.template_version().map(str::to_owned),
            adapter: None,
            engine_version: "test".into(),
        };
        let ext = sluice_wire::ModelCardExt { execution_identity: identity };
        let card = sluice_wire::ModelCard { id: "m".into(), max_model_len: 2048, sluice: ext };
        catalog.learn(&card, text);
        Ok(Served { catalog: Arc::new(catalog), default_max_tokens: 512 })
    }

    /// `check` of `body` as a completions request under `quota`.
    fn completions(quota: QuotaSettings, body: Value) -> Result<Checked, Refusal> {
        let s = served()
            .map_err(|e| Refusal::Untokenizable { param: "test", reason: e.to_string() })?;
        check(Endpoint::Completions, &grant(quota), body.to_string().as_bytes(), &s)
    }

    #[test]
    fn routes_and_their_refusals() {
        assert_eq!(route("POST", "/v1/chat/completions"), Ok(Route::Generate(Endpoint::Chat)));
        assert_eq!(route("GET", "/v1/models/m"), Ok(Route::Model("m".into())));
        let r = route("GET", "/v1/completions").err();
        assert!(
            r.as_ref().is_some_and(|r| r.status() == 405
                && r.headers() == vec![("allow".to_owned(), "POST".to_owned())])
        );
        let r = route("GET", "/v1/models/").err();
        assert!(r.is_some_and(|r| r.status() == 404 && r.code() == Some("unknown_route")));
    }

    #[test]
    fn keys_scopes_and_suspension() {
        assert_eq!(bearer(Some("bearer sk-1")), Ok("sk-1"));
        assert_eq!(bearer(Some("Basic sk-1")), Err(Refusal::InvalidApiKey));
        assert_eq!(bearer(None), Err(Refusal::InvalidApiKey));
        let mut g = grant(QuotaSettings::default());
        g.scopes = vec!["chat".into()];
        let r = authorize(&g, &Route::Models, "/v1/models");
        assert!(r.is_err_and(|r| r.status() == 403 && r.code() == Some("insufficient_scope")));
        g.tenant_status = "suspended".into();
        let r = authorize(&g, &Route::Generate(Endpoint::Chat), "/v1/chat/completions");
        assert_eq!(r, Err(Refusal::TenantSuspended));
    }

    #[test]
    fn every_body_refusal_names_its_parameter() -> TestResult {
        let q = QuotaSettings::default;
        let capped = QuotaSettings {
            max_n: Some(2),
            max_output_tokens: Some(10),
            ..QuotaSettings::default()
        };
        let cases = [
            (q(), json!([1]), 400, None),
            (q(), json!({"prompt": "hi"}), 400, Some("model")),
            (q(), json!({"model": "other", "prompt": "hi"}), 404, Some("model")),
            (
                QuotaSettings { allowed_models: vec!["x".into()], ..QuotaSettings::default() },
                json!({"model": "m", "prompt": "hi"}),
                403,
                Some("model"),
            ),
            (q(), json!({"model": "m", "prompt": "hi", "n": 0}), 400, Some("n")),
            (capped.clone(), json!({"model": "m", "prompt": "hi", "n": 3}), 400, Some("n")),
            (q(), json!({"model": "m", "prompt": "hi", "max_tokens": -1}), 400, Some("max_tokens")),
            (
                capped,
                json!({"model": "m", "prompt": "hi", "max_tokens": 11}),
                400,
                Some("max_tokens"),
            ),
            (q(), json!({"model": "m", "prompt": 7}), 400, Some("prompt")),
            (q(), json!({"model": "m", "prompt": []}), 400, Some("prompt")),
        ];
        for (quota, body, status, param) in cases {
            let r = completions(quota, body.clone()).err().ok_or(format!("{body} passed"))?;
            assert_eq!((r.status(), r.param()), (status, param), "{body}: {r:?}");
            let e: Value = serde_json::from_slice(&r.body())?;
            assert_eq!(e["error"]["message"], r.message().as_str());
            assert_eq!(r.finish_reason(), FinishReason::Rejected, "{body}");
        }
        let r = completions(q(), Value::Null).err();
        assert!(matches!(r, Some(Refusal::NotAnObject)));
        let s = served()?;
        let g = grant(QuotaSettings::default());
        let r = check(Endpoint::Completions, &g, b"{", &s).err();
        assert!(r.is_some_and(|r| r.status() == 400 && r.message().contains("JSON")));
        for messages in [json!([]), json!("hi")] {
            let body = json!({"model": "m", "messages": messages}).to_string();
            let r = check(Endpoint::Chat, &g, body.as_bytes(), &s).err();
            assert!(r.is_some_and(|r| r.param() == Some("messages")), "{messages}");
        }
        let chat = |extra: Value| {
            let mut body = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            if let (Some(b), Value::Object(e)) = (body.as_object_mut(), extra) {
                b.extend(e);
            }
            check(Endpoint::Chat, &g, body.to_string().as_bytes(), &s)
        };
        let f = json!([{"type": "function", "function": {"name": "f", "description": "does f"}}]);
        for (extra, param) in [
            (json!({"tools": "x"}), "tools"),
            (json!({"tools": [{"type": "function"}]}), "tools"),
            (json!({"tools": f, "tool_choice": "always"}), "tool_choice"),
            (json!({"tools": f, "parallel_tool_calls": 2}), "parallel_tool_calls"),
        ] {
            let r = chat(extra.clone()).err();
            assert!(r.is_some_and(|r| r.status() == 400 && r.param() == Some(param)), "{extra}");
        }
        // Offered tools are part of the prompt the engine runs, and counted with it.
        let plain = chat(json!({})).map(|c| c.asked.prompt_tokens).map_err(|r| r.message())?;
        let offered =
            chat(json!({"tools": f})).map(|c| c.asked.prompt_tokens).map_err(|r| r.message())?;
        let declined =
            chat(json!({"tools": f, "tool_choice": "none"})).map(|c| c.asked.prompt_tokens);
        assert!(offered > plain + 20, "{offered} vs {plain}");
        assert_eq!(declined.map_err(|r| r.message())?, plain);
        Ok(())
    }

    #[test]
    fn a_request_may_loosen_its_tiers_targets_never_tighten_them() -> TestResult {
        let q = QuotaSettings::default;
        let body = |slo: Value| json!({"model": "m", "prompt": "hi", "slo": slo});
        // The grant's tier is standard: TTFT 1000 ms, TPOT 100 ms.
        let tier = Slo { ttft_ms: Some(1000), tpot_ms: Some(100) };
        assert_eq!(
            completions(q(), json!({"model": "m", "prompt": "hi"})).map(|c| c.asked.slo),
            Ok(tier)
        );
        assert_eq!(completions(q(), body(Value::Null)).map(|c| c.asked.slo), Ok(tier));
        let looser = completions(q(), body(json!({"tpot_ms": 250}))).map_err(|r| r.message())?;
        assert_eq!(looser.asked.slo, Slo { ttft_ms: Some(1000), tpot_ms: Some(250) });
        let sent: Value = serde_json::from_slice(&looser.body)?;
        assert!(sent.get("slo").is_none(), "the engine takes targets from the gateway only");
        let both = completions(q(), body(json!({"ttft_ms": 1000, "tpot_ms": 100})));
        assert_eq!(both.map(|c| c.asked.slo), Ok(tier));
        for (slo, param) in [
            (json!({"tpot_ms": 99}), "slo.tpot_ms"),
            (json!({"ttft_ms": 500}), "slo.ttft_ms"),
            (json!({"tpot_ms": 0}), "slo.tpot_ms"),
            (json!({"tpot_ms": "fast"}), "slo.tpot_ms"),
            (json!({"ttft_ms": 600_001}), "slo.ttft_ms"),
            (json!({"tbt_ms": 200}), "slo"),
            (json!(200), "slo"),
        ] {
            let r = completions(q(), body(slo.clone())).err().ok_or(format!("{slo} passed"))?;
            assert_eq!((r.status(), r.param()), (400, Some(param)), "{slo}: {r:?}");
            assert_eq!(r.finish_reason(), FinishReason::Rejected);
        }
        let tighter = completions(q(), body(json!({"tpot_ms": 20}))).err().map(|r| r.message());
        assert!(tighter.is_some_and(|m| m.contains("tighter than the standard tier's")));
        // A tier without a target has nothing to loosen.
        let mut g = grant(q());
        g.tier = "unnamed".into();
        let b = body(json!({"tpot_ms": 300})).to_string();
        let r = check(Endpoint::Completions, &g, b.as_bytes(), &served()?).err();
        assert!(r.is_some_and(|r| r.message().contains("no tpot_ms target")), "{g:?}");
        Ok(())
    }

    #[test]
    fn a_checked_request_is_rewritten_and_counted() -> TestResult {
        let quota = QuotaSettings { max_prompt_tokens: Some(3), ..QuotaSettings::default() };
        let body = json!({"model": "m", "prompt": "hello world", "n": 2, "stream": true,
            "cache_salt": "client-chosen",
            PROMPT_FIELD: {"ids": [7], "tokenizer_revision": "sha256:client"}});
        let checked = completions(quota.clone(), body).map_err(|r| r.message())?;
        let sent: Value = serde_json::from_slice(&checked.body)?;
        // Forwarded as sent: the engine refuses it by name rather than the gateway dropping it.
        assert_eq!(sent.get("cache_salt"), Some(&json!("client-chosen")));
        // The gateway's own token ids replace whatever the client put there.
        let c = counter()?;
        let carried: sluice_text::tokenizer::PromptTokens =
            serde_json::from_value(sent[PROMPT_FIELD].clone())?;
        assert_eq!(carried.ids, c.encode("hello world")?);
        assert_eq!(carried.ids.len() as u64, checked.asked.prompt_tokens);
        assert_eq!(carried.tokenizer_revision, c.revision());
        assert_eq!(carried.chat_template_version, None, "a completion has no template");
        assert_eq!(sent["max_tokens"], 512);
        assert_eq!(sent["stream_options"]["include_usage"], true);
        assert!(checked.asked.stream && checked.asked.strip_usage);
        assert!(checked.asked.prompt_tokens > 0);
        assert_eq!(checked.asked.reserved, checked.asked.prompt_tokens + 2 * 512);
        assert_eq!(checked.asked.prompt_sha256, hex_digest(b"hello world"));
        assert_eq!(checked.asked.user_sha256, None, "no user, no hash");
        // The prompt limit is its own step, after the prompt was counted.
        let r = within_prompt_limit(&grant(quota), &checked);
        if checked.asked.prompt_tokens > 3 {
            let r = r.err().ok_or("over the prompt limit, yet passed")?;
            assert_eq!(
                (r.status(), r.code(), r.param()),
                (413, Some("context_length_exceeded"), Some("prompt"))
            );
        } else {
            assert!(r.is_ok());
        }
        let ids = completions(QuotaSettings::default(), json!({"model": "m", "prompt": [1, 2, 3]}))
            .map_err(|r| r.message())?;
        assert_eq!(ids.asked.prompt_tokens, 3);
        assert!(!ids.asked.strip_usage);
        let sent: Value = serde_json::from_slice(&ids.body)?;
        assert!(sent.get(PROMPT_FIELD).is_none(), "client token ids are the engine's to check");
        // A chat's ids name the template that rendered it, too.
        let chat = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
        let g = grant(QuotaSettings::default());
        let checked = check(Endpoint::Chat, &g, chat.to_string().as_bytes(), &served()?)
            .map_err(|r| r.message())?;
        let sent: Value = serde_json::from_slice(&checked.body)?;
        assert_eq!(
            sent[PROMPT_FIELD]["ids"].as_array().map(Vec::len),
            Some(checked.asked.prompt_tokens as usize)
        );
        assert!(
            sent[PROMPT_FIELD]["chat_template_version"]
                .as_str()
                .is_some_and(|v| v.starts_with("sha256:"))
        );
        // An alias is resolved here: the engine, the ledger and the prices see the id.
        let aliased =
            completions(QuotaSettings::default(), json!({"model": "default", "prompt": "hi"}))
                .map_err(|r| r.message())?;
        let sent: Value = serde_json::from_slice(&aliased.body)?;
        assert_eq!((aliased.model(), &sent["model"]), ("m", &json!("m")));
        let only_m = QuotaSettings { allowed_models: vec!["m".into()], ..QuotaSettings::default() };
        assert!(completions(only_m, json!({"model": "default", "prompt": "hi"})).is_ok());
        Ok(())
    }

    #[test]
    fn limits_map_to_429s_with_their_headers() {
        let rate = RateState {
            limit_requests: Some(5),
            remaining_requests: Some(0),
            ..RateState::default()
        };
        let r = Refusal::Limited {
            limit: Limit::Rpm,
            scope: Scope::Key,
            reserved: 40,
            retry_after: Some(Duration::from_millis(200)),
            rate,
        };
        assert_eq!(
            (r.status(), r.kind(), r.code()),
            (429, "rate_limit_error", Some("rate_limit_exceeded"))
        );
        assert_eq!(r.label(), "key_rpm");
        assert!(
            r.message().contains("this API key's requests (rpm)") && r.message().contains("40")
        );
        let h = r.headers();
        assert!(h.contains(&("retry-after".to_owned(), "1".to_owned())), "{h:?}");
        assert!(h.contains(&("x-ratelimit-limit-requests".to_owned(), "5".to_owned())), "{h:?}");
        let q = Refusal::Limited {
            limit: Limit::MonthlyTokens,
            scope: Scope::Tenant,
            reserved: 1,
            retry_after: None,
            rate: RateState::default(),
        };
        assert_eq!(
            (q.kind(), q.code(), q.label().as_str()),
            ("insufficient_quota", Some("insufficient_quota"), "monthly_tokens")
        );
        // A request the gateway failed to take is an error, not a judgement.
        assert_eq!(
            Refusal::BodyTimeout { deadline: Duration::from_secs(3) }.finish_reason(),
            FinishReason::Error
        );
        assert_eq!(Refusal::Overloaded.headers(), vec![("retry-after".to_owned(), "1".to_owned())]);
        // Past its fair share: a 429 that says when, judged (rejected), never billed.
        let f = Refusal::OverShare { retry_after: Duration::from_millis(2500) };
        assert_eq!(
            (f.status(), f.kind(), f.code()),
            (429, "rate_limit_error", Some("fair_share_exceeded"))
        );
        assert_eq!(f.headers(), vec![("retry-after".to_owned(), "3".to_owned())]);
        assert_eq!(
            (f.label().as_str(), f.finish_reason()),
            ("fair_share_exceeded", FinishReason::Rejected)
        );
        assert!(f.message().contains("retry after 3 s"), "{}", f.message());
    }
}
