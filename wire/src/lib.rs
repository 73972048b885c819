//! The contract between Sluice's processes: what the gateway sends an engine (the trusted
//! internal headers), where it sends it (the engines' internal routes), and what an engine
//! reports back in typed form (its load). Each name is written here once; the engine serves
//! these types and the gateway, billing and the tools read them, so a renamed header or route
//! is a compile error on both sides instead of a silent mismatch.
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
