//! The serving engine: validated requests in, token events out.
//!
//! The synchronous core (`block_pool`, `kv_manager`, `scheduler` with its tenant-fair order in
//! `fair`, `core`) is plain code
//! tested without threads or HTTP; `handle` runs it on one thread that owns all state and
//! gives out cloneable handles; the HTTP layer (`server`) only ever talks to a handle.

pub mod block_pool;
pub mod core;
pub mod fair;
pub mod handle;
pub mod kv_manager;
pub mod metrics;
pub mod outcomes;
pub mod scheduler;
pub mod step_model;
pub mod stop;

use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::lora::LoraAdapter;
use crate::sampler::SamplingParams;
use crate::structured::Grammar;

/// Where a request's cached prefix blocks may be shared. It comes from the gateway's
/// authenticated tenant (`x-sluice-tenant`), never from the client.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum CacheScope {
    /// Shared by every request of this tenant.
    Tenant(String),
    /// A scope of its own: this request shares with nobody.
    Private(String),
}

impl CacheScope {
    /// The tenant a request is served for: its scope's tenant, or empty for a private scope
    /// (requests that named no tenant count together in the fair order).
    pub fn tenant(&self) -> &str {
        match self {
            CacheScope::Tenant(t) => t,
            CacheScope::Private(_) => "",
        }
    }
}

/// A request the engine can run: every field checked by the request layer.
#[derive(Clone, Debug)]
pub struct ValidRequest {
    /// Unique id (also the key for aborts and billing).
    pub request_id: String,
    /// Prompt token ids (non-empty, all inside the vocabulary).
    pub prompt: Vec<u32>,
    /// Most tokens to generate (at least 1; prompt + max_tokens fits the context).
    pub max_tokens: usize,
    /// Sampling parameters.
    pub sampling: SamplingParams,
    /// Stop strings (at most 4, non-empty).
    pub stop: Vec<String>,
    /// Extra stop token ids.
    pub stop_token_ids: Vec<u32>,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Return the chosen token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Return log-probabilities of the prompt tokens with this many alternatives (echo).
    pub prompt_logprobs: Option<usize>,
    /// Prefix-cache scope.
    pub cache_scope: CacheScope,
    /// Larger runs first among waiting requests; the lowest is preempted first.
    pub priority: i32,
    /// The tenant's weight in the fair order (its tier's share; at least 1).
    pub weight: u32,
    /// The time per output token to keep it within (its tier's target): the running batch
    /// grows only while the predicted step time allows it.
    pub tpot_target: Option<Duration>,
    /// When the request arrived at the engine.
    pub arrival: Instant,
    /// The grammar its output must follow (`response_format`), if any.
    pub grammar: Option<Arc<Grammar>>,
    /// The tenant adapter it runs under, if any; its revision joins its prefix-cache keys.
    pub adapter: Option<RequestAdapter>,
}

/// A request's tenant adapter: its name, for the per-tenant metrics, and its weights.
#[derive(Clone, Debug)]
pub struct RequestAdapter {
    /// `tenant/name`, as the request named it (the revision is the adapter's own).
    pub name: String,
    /// The loaded adapter.
    pub adapter: Arc<LoraAdapter>,
}

/// Why a request ended (the wire's: the gateway and billing read it as the engine writes it).
pub use sluice_wire::FinishReason;

/// One generated token.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TokenOutput {
    /// Token id.
    pub token: u32,
    /// Its log-probability.
    pub logprob: f32,
    /// Alternatives, best first (empty unless asked).
    pub top: Vec<(u32, f32)>,
}

/// Log-probability of one prompt token (the first has none).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PromptLogprob {
    /// Token id.
    pub token: u32,
    /// Its log-probability given the previous tokens; `None` for the first token.
    pub logprob: Option<f32>,
    /// Alternatives at that position.
    pub top: Vec<(u32, f32)>,
}

/// Token counts of a request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt_tokens: usize,
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: usize,
    /// Generated tokens.
    pub completion_tokens: usize,
}

pub use sluice_wire::EngineTimings;

/// What the engine sends back for a request, in order.
#[derive(Clone, Debug, PartialEq)]
pub enum EngineEvent {
    /// Prompt log-probabilities (only when asked), before any token.
    PromptLogprobs(Vec<PromptLogprob>),
    /// New tokens and the text that became final with them (may be empty while a possible
    /// stop string or an incomplete character is held back).
    Tokens {
        /// The tokens of this step.
        tokens: Vec<TokenOutput>,
        /// Final text.
        text: String,
    },
    /// The request ended; always the last event.
    Finished {
        /// Why.
        reason: FinishReason,
        /// Held-back text released at the end.
        text: String,
        /// Counts.
        usage: Usage,
        /// Engine-side timings.
        timings: EngineTimings,
        /// Error message when `reason` is `Error`.
        error: Option<String>,
    },
}
