//! The contract between Sluice's processes: what the gateway sends an engine (the trusted
//! internal headers), where it sends it (the engines' internal routes), and what an engine
//! reports back in typed form (its load, what it did for a request, the identity and timings a
//! response ran under, its model cards, and errors as OpenAI's JSON). Each name is written
//! here once; the engine serves these types and the gateway, billing and the tools read them,
//! so a renamed header, route or field is a compile error on both sides instead of a silent
//! mismatch.
//!
//! This crate depends on serde alone: it is the bottom of the graph, below every process.

pub mod header;
pub mod route;

use serde::{Deserialize, Serialize};

/// The largest fair-order weight a tenant can have (the weight header's range is 1 to this).
pub const MAX_WEIGHT: u32 = 1000;

/// What an engine is doing now, as it answers [`route::LOAD`]: read from its own counters
/// without waiting for a step, so a gateway can poll it often.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineLoad {
    /// Requests in the running batch.
    pub running: u64,
    /// Requests waiting to be scheduled.
    pub waiting: u64,
    /// Whether requests wait because the running batch is as large as it may grow (its TPOT
    /// limit, `max_num_seqs` or the KV cache): the engine is at capacity, not between steps.
    pub batch_full: bool,
    /// Tokens still to prefill, over every request it holds: prompts not yet computed, and
    /// preempted requests' prompt and output to compute again (before prefix-cache hits).
    pub pending_prompt_tokens: u64,
    /// Fraction of KV-cache blocks in use (0 to 1).
    pub kv_usage: f64,
}

impl EngineLoad {
    /// Requests running plus waiting.
    pub fn requests(&self) -> u64 {
        self.running + self.waiting
    }
}

/// Why an engine ended a sequence: OpenAI's `finish_reason`s, plus the client going away and
/// the engine failing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// End-of-sequence, a stop token or a stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
    /// The client went away (or the request was cancelled); tokens so far still count.
    Abort,
    /// The engine failed while running it.
    Error,
}

impl FinishReason {
    /// The wire's string: OpenAI's `finish_reason` for `stop` and `length`.
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Error => "error",
        }
    }
}

/// A choice's `finish_reason` in an engine's answer (OpenAI's, plus `abort` and `error`): what
/// the engine writes and a gateway reads back, by these names only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChoiceFinish {
    /// Ended by the engine's [`FinishReason`].
    Ended(FinishReason),
    /// Ended with tool calls (a [`FinishReason::Stop`] whose answer holds calls).
    ToolCalls,
}

impl ChoiceFinish {
    /// How a choice that ended for `reason` says so: an answer that stopped with calls ends
    /// with `tool_calls`.
    pub fn of(reason: FinishReason, calls: bool) -> Self {
        if calls && reason == FinishReason::Stop {
            ChoiceFinish::ToolCalls
        } else {
            ChoiceFinish::Ended(reason)
        }
    }

    /// The answer's string.
    pub fn as_str(self) -> &'static str {
        match self {
            ChoiceFinish::Ended(r) => r.as_str(),
            ChoiceFinish::ToolCalls => "tool_calls",
        }
    }

    /// The choice finish an answer's string names; `None` for a name no engine writes.
    pub fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "tool_calls" => ChoiceFinish::ToolCalls,
            "stop" => ChoiceFinish::Ended(FinishReason::Stop),
            "length" => ChoiceFinish::Ended(FinishReason::Length),
            "abort" => ChoiceFinish::Ended(FinishReason::Abort),
            "error" => ChoiceFinish::Ended(FinishReason::Error),
            _ => return None,
        })
    }
}

/// Where a request stands at its engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OutcomeState {
    /// Some submitted choice has not ended.
    Running,
    /// Every submitted choice has ended: the counts are final.
    Finished,
}

/// One HTTP request as its engine ran it ([`route::OUTCOME`], and each of
/// [`Outcomes::data`]): what a gateway bills a request by when the client went away, and what
/// an auditor's reconciliation compares the ledger with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// The request id (the gateway's [`header::REQUEST_ID`]).
    pub request_id: String,
    /// The tenant the gateway named, if any.
    pub tenant: Option<String>,
    /// Running until every submitted choice has ended.
    pub state: OutcomeState,
    /// Choices submitted.
    pub choices: u64,
    /// Choices ended.
    pub ended: u64,
    /// Prompt tokens (of one choice: the choices share the prompt).
    pub prompt_tokens: u64,
    /// Prompt tokens served from the prefix cache (the largest over the choices).
    pub cached_tokens: u64,
    /// Tokens generated, over all choices.
    pub completion_tokens: u64,
    /// How the last choice to end ended ([`FinishReason::Abort`] when the client went away).
    pub finish_reason: Option<FinishReason>,
    /// When it was registered, seconds since the Unix epoch.
    pub created: u64,
    /// When it became finished, milliseconds since the Unix epoch.
    pub ended_ms: Option<u64>,
}

impl Outcome {
    /// Whether its counts are final.
    pub fn finished(&self) -> bool {
        self.state == OutcomeState::Finished
    }
}

/// What an engine answers at [`route::OUTCOMES`]: every request it remembers registered since
/// the time asked for. It remembers nothing from before it started.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcomes {
    /// The model it serves.
    pub model: String,
    /// When it started, seconds since the Unix epoch.
    pub started: u64,
    /// When it started, milliseconds since the Unix epoch.
    pub started_ms: u64,
    /// The requests.
    pub data: Vec<Outcome>,
}

/// Immutable description of what computed a response: the `sluice` object's
/// `execution_identity` in an engine's model card and in each response's final chunk or body,
/// and what the ledger records every request under (never a bare model alias).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecutionIdentity {
    /// The model's id, from its file.
    pub model_id: String,
    /// `sha256:` of the weight file(s).
    pub model_revision: String,
    /// `sha256:` of the tokenizer's canonical serialization.
    pub tokenizer_revision: String,
    /// `sha256:` of the chat template text, when the model has one.
    pub chat_template_version: Option<String>,
    /// Adapter `tenant/name@revision`, when one is applied.
    pub adapter: Option<String>,
    /// Engine build.
    pub engine_version: String,
}

impl ExecutionIdentity {
    /// A compact one-line form for headers: `model@rev;tok=..;tmpl=..;adapter=..;engine=..`.
    pub fn header_value(&self) -> String {
        let short = |s: &str| s.trim_start_matches("sha256:").chars().take(16).collect::<String>();
        format!(
            "{}@{};tok={};tmpl={};adapter={};engine={}",
            self.model_id,
            short(&self.model_revision),
            short(&self.tokenizer_revision),
            self.chat_template_version.as_deref().map_or_else(|| "none".into(), short),
            self.adapter.as_deref().unwrap_or("none"),
            self.engine_version
        )
    }
}

/// Engine-side intervals of one request, in seconds from the engine's arrival: the `sluice`
/// object's `timings` in a response's final chunk or body.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct EngineTimings {
    /// Arrival to first scheduled.
    pub queue: f64,
    /// First scheduled to first token.
    pub prefill: f64,
    /// First token to last token.
    pub decode: f64,
    /// Arrival to first token.
    pub ttft: f64,
    /// Arrival to the end.
    pub e2e: f64,
    /// Times the request was preempted and recomputed.
    pub preemptions: u32,
}

impl EngineTimings {
    /// How long the request held its place in the batch: its prefill and its decode.
    pub fn in_batch(&self) -> f64 {
        self.prefill + self.decode
    }
}

/// What a gateway reads of an engine's [`route::MODELS`] answer (the engine's cards carry more
/// for OpenAI clients; what is not named here is ignored).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelList {
    /// One card per model the engine serves.
    pub data: Vec<ModelCard>,
}

/// What a gateway reads of one model card.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCard {
    /// The model's id.
    pub id: String,
    /// Context length in tokens.
    pub max_model_len: u64,
    /// The card's `sluice` object.
    pub sluice: ModelCardExt,
}

/// What a gateway reads of a model card's `sluice` object.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelCardExt {
    /// What requests to this model run under.
    pub execution_identity: ExecutionIdentity,
}

/// OpenAI's `usage` object, as an engine writes it (in a body, and in a stream's last chunk
/// when asked) and a gateway bills by.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// Prompt tokens (of one choice: the choices share the prompt).
    pub prompt_tokens: u64,
    /// Tokens generated, over all choices.
    pub completion_tokens: u64,
    /// Both.
    pub total_tokens: u64,
    /// The prompt's detail.
    pub prompt_tokens_details: PromptTokensDetails,
}

/// `usage.prompt_tokens_details`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PromptTokensDetails {
    /// Prompt tokens served from the prefix cache.
    pub cached_tokens: u64,
}

impl Usage {
    /// The usage of `prompt` tokens (`cached` of them from the prefix cache) and `completion`.
    pub fn new(prompt: u64, completion: u64, cached: u64) -> Self {
        Usage {
            prompt_tokens: prompt,
            completion_tokens: completion,
            total_tokens: prompt.saturating_add(completion),
            prompt_tokens_details: PromptTokensDetails { cached_tokens: cached },
        }
    }
}

/// OpenAI's error JSON, as every Sluice process answers an error:
/// `{"error": {"message", "type", "param", "code"}}`, `param` and `code` null when absent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The `error` object of an [`ErrorBody`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Human-readable message (never prompt text).
    pub message: String,
    /// OpenAI's error `type` (`invalid_request_error`, `server_error`...).
    #[serde(rename = "type")]
    pub kind: String,
    /// The request parameter at fault, as a path (`messages[1].role`).
    pub param: Option<String>,
    /// Machine-readable code.
    pub code: Option<String>,
}

impl ErrorBody {
    /// An error of `kind` saying `message`, naming `param` and `code` when some.
    pub fn new(message: &str, kind: &str, param: Option<&str>, code: Option<&str>) -> Self {
        let owned = |s: Option<&str>| s.map(str::to_owned);
        ErrorBody {
            error: ErrorDetail {
                message: message.to_owned(),
                kind: kind.to_owned(),
                param: owned(param),
                code: owned(code),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_choice_finish_reads_back_by_its_name_and_no_other() {
        let ended = [FinishReason::Stop, FinishReason::Length, FinishReason::Abort];
        let all = ended
            .into_iter()
            .chain([FinishReason::Error])
            .map(ChoiceFinish::Ended)
            .chain([ChoiceFinish::ToolCalls]);
        let mut names = Vec::new();
        for finish in all {
            assert_eq!(ChoiceFinish::parse(finish.as_str()), Some(finish));
            names.push(finish.as_str());
        }
        assert_eq!(names, ["stop", "length", "abort", "error", "tool_calls"]);
        for other in ["", "Stop", "content_filter", "function_call"] {
            assert_eq!(ChoiceFinish::parse(other), None, "{other:?}");
        }
        // Calls turn a stop into `tool_calls`, and nothing else.
        assert_eq!(ChoiceFinish::of(FinishReason::Stop, true), ChoiceFinish::ToolCalls);
        let cut = ChoiceFinish::of(FinishReason::Length, true);
        assert_eq!(cut, ChoiceFinish::Ended(FinishReason::Length));
    }

    #[test]
    fn engine_load_travels_as_json_and_missing_fields_are_refused() -> serde_json::Result<()> {
        let load = EngineLoad {
            running: 3,
            waiting: 2,
            batch_full: true,
            pending_prompt_tokens: 2048,
            kv_usage: 0.5,
        };
        let back: EngineLoad = serde_json::from_str(&serde_json::to_string(&load)?)?;
        assert_eq!(back, load);
        assert_eq!(back.requests(), 5);
        // A report missing a field is an error, not a zero that reads as an idle engine.
        assert!(serde_json::from_str::<EngineLoad>(r#"{"running": 1}"#).is_err());
        Ok(())
    }

    #[test]
    fn outcomes_read_back_as_written_and_states_are_words() -> serde_json::Result<()> {
        let o = Outcome {
            request_id: "req_1".into(),
            tenant: Some("acme".into()),
            state: OutcomeState::Finished,
            choices: 2,
            ended: 2,
            prompt_tokens: 12,
            cached_tokens: 8,
            completion_tokens: 30,
            finish_reason: Some(FinishReason::Abort),
            created: 1_700_000_000,
            ended_ms: Some(1_700_000_000_500),
        };
        let text = serde_json::to_string(&o)?;
        assert!(text.contains(r#""state":"finished""#) && text.contains(r#""abort""#), "{text}");
        let back: Outcome = serde_json::from_str(&text)?;
        assert!(back.finished());
        assert_eq!(back, o);
        // A state or finish reason the wire does not have is an error, never a default.
        let odd = text.replace("finished", "paused");
        assert!(serde_json::from_str::<Outcome>(&odd).is_err());
        for r in
            [FinishReason::Stop, FinishReason::Length, FinishReason::Abort, FinishReason::Error]
        {
            assert_eq!(serde_json::to_value(r)?, serde_json::Value::from(r.as_str()));
        }
        Ok(())
    }

    #[test]
    fn identities_timings_and_cards_read_back_and_refuse_what_is_missing() -> serde_json::Result<()>
    {
        let identity = ExecutionIdentity {
            model_id: "m".into(),
            model_revision: "sha256:0123456789abcdef0123".into(),
            tokenizer_revision: "sha256:fedcba9876543210fedc".into(),
            chat_template_version: None,
            adapter: Some("acme/support@sha256:aa".into()),
            engine_version: "sluice-engine/0".into(),
        };
        assert_eq!(
            identity.header_value(),
            "m@0123456789abcdef;tok=fedcba9876543210;tmpl=none;adapter=acme/support@sha256:aa;\
             engine=sluice-engine/0"
        );
        // An engine's card carries more than the gateway reads: the rest is ignored.
        let card = serde_json::json!({"id": "m", "object": "model", "max_model_len": 2048,
            "sluice": {"execution_identity": identity, "capacity_tokens": 9}});
        let list: ModelList = serde_json::from_value(serde_json::json!({"data": [card]}))?;
        assert_eq!(list.data[0].sluice.execution_identity, identity);
        assert_eq!(list.data[0].max_model_len, 2048);
        // An identity without its revision is an error, never an empty one.
        assert!(serde_json::from_str::<ExecutionIdentity>(r#"{"model_id": "m"}"#).is_err());
        let t = EngineTimings {
            queue: 0.5,
            prefill: 0.25,
            decode: 1.0,
            ttft: 0.75,
            e2e: 1.75,
            preemptions: 1,
        };
        let back: EngineTimings = serde_json::from_str(&serde_json::to_string(&t)?)?;
        assert_eq!((back, back.in_batch()), (t, 1.25));
        assert!(serde_json::from_str::<EngineTimings>(r#"{"queue": 1}"#).is_err());
        Ok(())
    }

    #[test]
    fn usage_is_openais_shape_and_whole() -> serde_json::Result<()> {
        let u = Usage::new(12, 30, 8);
        assert_eq!(
            serde_json::to_value(u)?,
            serde_json::json!({"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42,
                "prompt_tokens_details": {"cached_tokens": 8}})
        );
        assert_eq!(serde_json::from_value::<Usage>(serde_json::to_value(u)?)?, u);
        // A count the engine left out is an error, never a zero that bills nothing.
        assert!(serde_json::from_str::<Usage>(r#"{"prompt_tokens": 1}"#).is_err());
        Ok(())
    }

    #[test]
    fn errors_are_openais_shape_with_nulls_for_what_is_absent() -> serde_json::Result<()> {
        let e = ErrorBody::new("bad", "invalid_request_error", Some("messages[0].role"), None);
        assert_eq!(
            serde_json::to_value(&e)?,
            serde_json::json!({"error": {"message": "bad", "type": "invalid_request_error",
                "param": "messages[0].role", "code": null}})
        );
        let back: ErrorBody = serde_json::from_str(&serde_json::to_string(&e)?)?;
        assert_eq!(back, e);
        Ok(())
    }
}
