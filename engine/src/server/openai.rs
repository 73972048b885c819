//! OpenAI wire types: request fields in, response bodies and stream chunks out.
//!
//! A request body is read into fields structs (unknown fields are ignored, as SDKs send
//! extras); the polymorphic fields (`prompt`, `stop`, completions' `logprobs`) stay JSON
//! values and are checked in `validate`.

use serde::{Deserialize, Serialize, Serializer};

use crate::defaults::SamplingDefaults;
use crate::identity::ExecutionIdentity;
use crate::serve::{EngineTimings, Usage};
use sluice_text::template::ChatMessage;

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a last chunk with the usage of the whole request.
    #[serde(default)]
    pub include_usage: Option<bool>,
}

/// Fields both endpoints share.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct SamplingFields {
    /// The model the client asks for.
    pub model: Option<String>,
    /// Most tokens to generate.
    pub max_tokens: Option<i64>,
    /// Sampling temperature (default 1).
    pub temperature: Option<f64>,
    /// Nucleus threshold in (0, 1].
    pub top_p: Option<f64>,
    /// Top-k cut; 0 or -1: none.
    pub top_k: Option<i64>,
    /// Min-p cut in [0, 1].
    pub min_p: Option<f64>,
    /// Seed (random when absent).
    pub seed: Option<i64>,
    /// A string or up to 4 strings.
    pub stop: Option<serde_json::Value>,
    /// Extra token ids that end generation.
    pub stop_token_ids: Option<Vec<i64>>,
    /// Number of choices.
    pub n: Option<i64>,
    /// Server-sent events instead of one body.
    pub stream: Option<bool>,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Keep generating past end-of-sequence.
    pub ignore_eos: Option<bool>,
    /// In [-2, 2].
    pub presence_penalty: Option<f64>,
    /// In [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// Token ids (as strings) to biases from -100 to 100.
    pub logit_bias: Option<serde_json::Value>,
}

/// `/v1/completions` fields beyond [`SamplingFields`].
#[derive(Clone, Debug, Default, Deserialize)]
pub struct CompletionFields {
    /// A string, an array of token ids, or a one-element array of either.
    pub prompt: Option<serde_json::Value>,
    /// Return the prompt before the completion.
    pub echo: Option<bool>,
    /// Number of alternatives per token (an integer here, unlike chat).
    pub logprobs: Option<i64>,
}

/// `/v1/chat/completions` fields beyond [`SamplingFields`].
#[derive(Clone, Debug, Default, Deserialize)]
pub struct ChatFields {
    /// The conversation.
    pub messages: Option<Vec<ChatMessage>>,
    /// Return log-probabilities of the chosen tokens.
    pub logprobs: Option<bool>,
    /// Alternatives per token (needs `logprobs: true`).
    pub top_logprobs: Option<i64>,
    /// Newer name of `max_tokens`; wins when both are present.
    pub max_completion_tokens: Option<i64>,
}

/// OpenAI `usage`: the wire's, which gateways bill by.
pub use sluice_wire::Usage as UsageBody;

/// The `usage` object of the engine's counts.
pub fn usage_body(u: Usage) -> UsageBody {
    let n = |x: usize| u64::try_from(x).unwrap_or(u64::MAX);
    UsageBody::new(n(u.prompt_tokens), n(u.completion_tokens), n(u.cached_tokens))
}

/// The generation parameters a request ran with (part of its execution contract), after
/// defaults were applied; the seed is the one actually used.
#[derive(Clone, Debug, Serialize)]
pub struct GenerationParams {
    /// Most tokens per choice.
    pub max_tokens: usize,
    /// Temperature.
    pub temperature: f32,
    /// Top-p.
    pub top_p: f32,
    /// Top-k (0: none).
    pub top_k: usize,
    /// Min-p.
    pub min_p: f32,
    /// Presence penalty.
    pub presence_penalty: f32,
    /// Frequency penalty.
    pub frequency_penalty: f32,
    /// Seed of choice 0 (choice i uses seed + i).
    pub seed: u64,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Streamed or not.
    pub stream: bool,
    /// Number of choices.
    pub n: usize,
    /// Whether EOS was ignored.
    pub ignore_eos: bool,
    /// Biases added to these tokens' logits.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub logit_bias: std::collections::BTreeMap<u32, f32>,
}

/// Per-choice detail of a request with `n` > 1.
#[derive(Clone, Debug, Serialize)]
pub struct ChoiceDetail {
    /// Choice index.
    pub index: usize,
    /// The engine's id of this choice.
    pub request_id: String,
    /// Its counts.
    pub usage: UsageBody,
    /// Its engine-side timings.
    pub timings: EngineTimings,
}

/// The `sluice` extension object. Every stream chunk has `tokens`; the final chunk of a
/// choice and every non-streamed body have the rest.
#[derive(Clone, Debug, Default, Serialize)]
pub struct SluiceExt {
    /// Tokens this chunk carries (streaming only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens: Option<usize>,
    /// The request id (the choice's engine id in a final chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub request_id: Option<String>,
    /// W3C trace id, when the request carried one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace_id: Option<String>,
    /// What computed the response.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub execution_identity: Option<ExecutionIdentity>,
    /// Generation parameters after defaults.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parameters: Option<GenerationParams>,
    /// Engine-side timings in seconds from the engine's arrival (choice 0 for a body).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timings: Option<EngineTimings>,
    /// Per-choice detail when `n` > 1.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub choices: Option<Vec<ChoiceDetail>>,
    /// Why a choice failed, when it did.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// Top alternatives as a JSON object in rank order (legacy completions logprobs).
#[derive(Clone, Debug, Default)]
pub struct RankedMap(pub Vec<(String, f32)>);

impl Serialize for RankedMap {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(self.0.len()))?;
        for (k, v) in &self.0 {
            m.serialize_entry(k, v)?;
        }
        m.end()
    }
}

/// Legacy completions `logprobs`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct CompletionLogprobs {
    /// Token strings.
    pub tokens: Vec<String>,
    /// Their log-probabilities (`null` for the first prompt token).
    pub token_logprobs: Vec<Option<f32>>,
    /// Alternatives per position.
    pub top_logprobs: Vec<Option<RankedMap>>,
    /// Character offset of each token in the returned text.
    pub text_offset: Vec<usize>,
}

/// One completions choice (body or chunk).
#[derive(Clone, Debug, Serialize)]
pub struct CompletionChoice {
    /// Choice index.
    pub index: usize,
    /// Text (a delta in a chunk).
    pub text: String,
    /// Log-probabilities, when asked.
    pub logprobs: Option<CompletionLogprobs>,
    /// `stop`, `length`, `abort`, `error`; `null` until the end.
    pub finish_reason: Option<&'static str>,
}

/// `/v1/completions` body or stream chunk.
#[derive(Clone, Debug, Serialize)]
pub struct CompletionBody {
    /// `cmpl-...`.
    pub id: String,
    /// `text_completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Choices.
    pub choices: Vec<CompletionChoice>,
    /// Counts (absent from chunks unless it is the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    /// Extension.
    pub sluice: SluiceExt,
}

/// One alternative in chat logprobs.
#[derive(Clone, Debug, Serialize)]
pub struct ChatTopLogprob {
    /// Token text.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
}

/// One chosen token in chat logprobs.
#[derive(Clone, Debug, Serialize)]
pub struct ChatTokenLogprob {
    /// Token text.
    pub token: String,
    /// Log-probability.
    pub logprob: f32,
    /// The token's bytes.
    pub bytes: Vec<u8>,
    /// Alternatives, best first.
    pub top_logprobs: Vec<ChatTopLogprob>,
}

/// Chat `logprobs`.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatLogprobs {
    /// Per generated token.
    pub content: Vec<ChatTokenLogprob>,
}

/// The assistant message of a chat body.
#[derive(Clone, Debug, Serialize)]
pub struct AssistantMessage {
    /// `assistant`.
    pub role: &'static str,
    /// The text (`null` when the answer is only tool calls).
    pub content: Option<String>,
    /// The tool calls the answer makes.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallBody>>,
}

/// The function and arguments of a tool call.
#[derive(Clone, Debug, Serialize)]
pub struct FunctionCallBody {
    /// The function's name.
    pub name: String,
    /// Its arguments, JSON text.
    pub arguments: String,
}

/// A tool call in an answer (`message.tool_calls`), or the whole of one in a stream delta
/// (`delta.tool_calls`, where `index` says which).
#[derive(Clone, Debug, Serialize)]
pub struct ToolCallBody {
    /// Its place among the answer's calls (stream deltas only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub index: Option<usize>,
    /// `call_...`.
    pub id: String,
    /// `function`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// What is called.
    pub function: FunctionCallBody,
}

impl ToolCallBody {
    /// The wire form of `call`; `index` in a stream delta.
    pub fn new(call: sluice_text::tools::ToolCall, index: Option<usize>) -> ToolCallBody {
        ToolCallBody {
            index,
            id: call.id,
            kind: "function",
            function: FunctionCallBody { name: call.name, arguments: call.arguments },
        }
    }
}

/// One chat choice in a body.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChoice {
    /// Choice index.
    pub index: usize,
    /// The reply.
    pub message: AssistantMessage,
    /// Log-probabilities, when asked.
    pub logprobs: Option<ChatLogprobs>,
    /// Why it ended.
    pub finish_reason: Option<&'static str>,
}

/// A chat stream delta.
#[derive(Clone, Debug, Default, Serialize)]
pub struct ChatDelta {
    /// `assistant` in a choice's first chunk.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub role: Option<&'static str>,
    /// New text.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<String>,
    /// Tool calls, each whole.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<ToolCallBody>>,
}

/// One chat choice in a chunk.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChunkChoice {
    /// Choice index.
    pub index: usize,
    /// What is new.
    pub delta: ChatDelta,
    /// Log-probabilities of this chunk's tokens, when asked.
    pub logprobs: Option<ChatLogprobs>,
    /// Set in the choice's last chunk.
    pub finish_reason: Option<&'static str>,
}

/// `/v1/chat/completions` body.
#[derive(Clone, Debug, Serialize)]
pub struct ChatBody {
    /// `chatcmpl-...`.
    pub id: String,
    /// `chat.completion`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Choices.
    pub choices: Vec<ChatChoice>,
    /// Counts.
    pub usage: UsageBody,
    /// Extension.
    pub sluice: SluiceExt,
}

/// `/v1/chat/completions` stream chunk.
#[derive(Clone, Debug, Serialize)]
pub struct ChatChunk {
    /// `chatcmpl-...`, the same in every chunk.
    pub id: String,
    /// `chat.completion.chunk`.
    pub object: &'static str,
    /// Unix seconds.
    pub created: u64,
    /// Served model name.
    pub model: String,
    /// Choices (empty in the usage chunk).
    pub choices: Vec<ChatChunkChoice>,
    /// Counts (only in the usage chunk).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub usage: Option<UsageBody>,
    /// Extension.
    pub sluice: SluiceExt,
}

/// An entry of `/v1/models`.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCard {
    /// Served name.
    pub id: String,
    /// `model`.
    pub object: &'static str,
    /// Unix seconds when the engine started.
    pub created: u64,
    /// `sluice`.
    pub owned_by: &'static str,
    /// Context length in tokens.
    pub max_model_len: usize,
    /// Extension carrying the execution identity.
    pub sluice: ModelCardExt,
}

/// The `sluice` object of a model card.
#[derive(Clone, Debug, Serialize)]
pub struct ModelCardExt {
    /// What requests to this model run under.
    pub execution_identity: ExecutionIdentity,
    /// Most tokens (prompt + output) one request can hold in this engine's KV cache.
    pub capacity_tokens: usize,
    /// What the sampling parameters a request leaves out are, and where each came from.
    pub sampling_defaults: SamplingDefaults,
}
