//! How an admitted request ended, as data: what the gateway saw of it ([`Facts`]: the
//! response's status, the stream's end, the engine's final counts, the error pingora reported
//! and from which side) goes in, and what is billed and recorded comes out ([`Conclusion`]:
//! the finish reason, the error, the status, the tokens). [`crate::proxy`]'s `logging` phase
//! gathers the facts, asks the engine for its count when [`Facts::needs_engine_count`] says
//! so, and settles and records what [`conclude`] returns; nothing here touches I/O, so every
//! ending is tested as a table.

use sluice_billing::FinishReason;
use sluice_wire::{ChoiceFinish, FinishReason as Ended};

/// Which side of the gateway a failure came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// The engine's: the connection to it broke, or it answered badly.
    Upstream,
    /// The client's: it went away.
    Downstream,
    /// The gateway's own.
    Internal,
}

/// A failure pingora reported.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Failure {
    /// Where it came from.
    pub side: Side,
    /// What it was: pingora's error type, recorded as the error.
    pub kind: String,
}

/// The engine's final counts for a request: from its usage object, or from its outcome.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Tokens generated (over every choice), when the engine said.
    pub completion: Option<u64>,
    /// Prompt tokens served from the prefix cache, when the engine said.
    pub cached: Option<u64>,
}

/// What the gateway saw of an admitted request by its end.
#[derive(Clone, Debug, PartialEq)]
pub struct Facts<'a> {
    /// Cancelled by the gateway's own shutdown after its drain timed out.
    pub cancelled: bool,
    /// The failure pingora reported, if any.
    pub failure: Option<Failure>,
    /// Whether the client asked for a stream.
    pub stream: bool,
    /// Whether the answer was whole: `[DONE]` streamed, or a body read.
    pub done: bool,
    /// The response status sent to the client, 0 when none was.
    pub status: u16,
    /// The last finish reason the engine's answer carried.
    pub finish_reason: Option<&'a str>,
    /// The engine's usage object, when its answer carried one.
    pub usage: Option<Counts>,
    /// Tokens the client received, by the stream's own counts.
    pub streamed_tokens: u64,
}

/// What an admitted request is billed and recorded as.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Conclusion {
    /// Its finish reason.
    pub finish: FinishReason,
    /// What failed, when something did.
    pub error: Option<String>,
    /// Its status: 499 when no response went out.
    pub status: u16,
    /// Tokens generated, billed.
    pub completion: u64,
    /// Prompt tokens served from the prefix cache.
    pub cached: u64,
}

impl Facts<'_> {
    /// Whether the engine's own count is needed: its final count never reached the gateway
    /// (the client went away, or the connection broke) on an answer that was not refused.
    pub fn needs_engine_count(&self) -> bool {
        self.usage.is_none() && (self.status == 200 || self.status == 0)
    }

    /// A stream cut short without `[DONE]` is the client's leaving, unless the engine broke it
    /// off (then it is an error, billed for what the client received).
    fn client_left(&self) -> bool {
        self.side() == Some(Side::Downstream)
            || (self.stream && !self.done && self.status == 200 && !self.engine_failed())
    }

    /// Where its failure came from, when it failed.
    fn side(&self) -> Option<Side> {
        self.failure.as_ref().map(|f| f.side)
    }

    /// Whether the engine's side failed.
    fn engine_failed(&self) -> bool {
        self.side() == Some(Side::Upstream)
    }
}

/// The ending of an admitted request from `facts`, with the engine's count `engine` when the
/// facts needed it ([`Facts::needs_engine_count`]) and the engine could say.
pub fn conclude(facts: &Facts, engine: Option<Counts>) -> Conclusion {
    let usage = facts.usage.unwrap_or_default();
    let mut completion = usage.completion.unwrap_or(facts.streamed_tokens);
    let mut cached = usage.cached.unwrap_or(0);
    if facts.needs_engine_count() {
        if let Some(o) = engine {
            completion = o.completion.unwrap_or(completion);
            cached = o.cached.unwrap_or(cached);
        }
        // A stream the engine broke off is billed for what the client received, never more
        // (a live engine may have generated tokens that never left it).
        if facts.engine_failed() && facts.stream {
            completion = completion.min(facts.streamed_tokens);
        }
    }
    let status = facts.status;
    let (finish, error) = if facts.cancelled {
        (FinishReason::Error, Some("cancelled_at_shutdown".to_owned()))
    } else if facts.client_left() {
        (FinishReason::ClientDisconnected, None)
    } else if let Some(f) = &facts.failure {
        (FinishReason::Error, Some(f.kind.clone()))
    } else if (400..500).contains(&status) {
        // The engine refused it (validation) before any work.
        (FinishReason::Rejected, Some(format!("http_{status}")))
    } else if status >= 400 {
        (FinishReason::Error, Some(format!("http_{status}")))
    } else {
        let finish = match facts.finish_reason.map(ChoiceFinish::parse) {
            None => FinishReason::Stop,
            Some(Some(ChoiceFinish::ToolCalls)) => FinishReason::ToolCalls,
            Some(Some(ChoiceFinish::Ended(ended))) => match ended {
                Ended::Stop => FinishReason::Stop,
                Ended::Length => FinishReason::Length,
                Ended::Abort => FinishReason::ClientDisconnected,
                Ended::Error => FinishReason::Error,
            },
            // A name no engine writes.
            Some(None) => FinishReason::Error,
        };
        (finish, None)
    };
    Conclusion { finish, error, status: if status == 0 { 499 } else { status }, completion, cached }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A whole streamed answer that carried `finish`, 5 tokens and the engine's usage.
    fn whole(finish: Option<&str>) -> Facts<'_> {
        Facts {
            cancelled: false,
            failure: None,
            stream: true,
            done: true,
            status: 200,
            finish_reason: finish,
            usage: Some(Counts { completion: Some(5), cached: Some(2) }),
            streamed_tokens: 5,
        }
    }

    fn failed(side: Side) -> Option<Failure> {
        Some(Failure { side, kind: "ConnectionClosed".into() })
    }

    fn ended(
        finish: FinishReason,
        error: Option<&str>,
        status: u16,
        counts: (u64, u64),
    ) -> Conclusion {
        let error = error.map(str::to_owned);
        Conclusion { finish, error, status, completion: counts.0, cached: counts.1 }
    }

    #[test]
    fn every_ending_is_billed_and_recorded_as_the_table_says() {
        use FinishReason::*;
        let engine = Some(Counts { completion: Some(30), cached: Some(8) });
        // A stream the client left: no usage, no [DONE], nothing failed upstream.
        let left = Facts { done: false, usage: None, ..whole(None) };
        let cases: Vec<(&str, Facts, Option<Counts>, Conclusion)> = vec![
            ("length", whole(Some("length")), None, ended(Length, None, 200, (5, 2))),
            ("stop", whole(Some("stop")), None, ended(Stop, None, 200, (5, 2))),
            ("no reason is a stop", whole(None), None, ended(Stop, None, 200, (5, 2))),
            ("tool calls", whole(Some("tool_calls")), None, ended(ToolCalls, None, 200, (5, 2))),
            (
                "engine abort",
                whole(Some("abort")),
                None,
                ended(ClientDisconnected, None, 200, (5, 2)),
            ),
            ("unknown reason", whole(Some("paused")), None, ended(Error, None, 200, (5, 2))),
            // The engine's usage wins over the stream's count; without it, the stream's.
            (
                "usage without counts",
                Facts { usage: Some(Counts::default()), ..whole(Some("stop")) },
                None,
                ended(Stop, None, 200, (5, 0)),
            ),
            // The client left: the engine's own count, else what was streamed.
            ("client left", left.clone(), engine, ended(ClientDisconnected, None, 200, (30, 8))),
            (
                "client left, engine silent",
                left.clone(),
                None,
                ended(ClientDisconnected, None, 200, (5, 0)),
            ),
            (
                "client gone before the head",
                Facts {
                    failure: failed(Side::Downstream),
                    status: 0,
                    stream: false,
                    ..left.clone()
                },
                engine,
                ended(ClientDisconnected, None, 499, (30, 8)),
            ),
            // The engine broke the stream off: an error, billed for what the client received.
            (
                "engine broke off",
                Facts { failure: failed(Side::Upstream), ..left.clone() },
                engine,
                ended(Error, Some("ConnectionClosed"), 200, (5, 8)),
            ),
            (
                "engine broke a body off",
                Facts { failure: failed(Side::Upstream), stream: false, ..left.clone() },
                engine,
                ended(Error, Some("ConnectionClosed"), 200, (30, 8)),
            ),
            (
                "gateway failed",
                Facts { failure: failed(Side::Internal), ..whole(Some("stop")) },
                None,
                ended(Error, Some("ConnectionClosed"), 200, (5, 2)),
            ),
            // The shutdown's cancellation is named whatever else happened.
            (
                "cancelled at shutdown",
                Facts { cancelled: true, failure: failed(Side::Downstream), ..left.clone() },
                engine,
                ended(Error, Some("cancelled_at_shutdown"), 200, (30, 8)),
            ),
            // Refused by the engine before any work: nothing to ask it.
            (
                "engine refused",
                Facts { status: 400, usage: None, streamed_tokens: 0, ..whole(None) },
                engine,
                ended(Rejected, Some("http_400"), 400, (0, 0)),
            ),
            (
                "engine failed",
                Facts { status: 503, usage: None, streamed_tokens: 0, ..whole(None) },
                engine,
                ended(Error, Some("http_503"), 503, (0, 0)),
            ),
        ];
        for (name, facts, engine, want) in cases {
            assert_eq!(conclude(&facts, engine), want, "{name}");
        }
    }

    #[test]
    fn the_engine_is_asked_only_when_its_final_count_never_came() {
        assert!(!whole(Some("stop")).needs_engine_count());
        let cut = Facts { done: false, usage: None, ..whole(None) };
        assert!(cut.needs_engine_count());
        assert!(Facts { status: 0, ..cut.clone() }.needs_engine_count());
        assert!(!Facts { status: 429, ..cut.clone() }.needs_engine_count());
        assert!(!Facts { status: 500, ..cut }.needs_engine_count());
    }
}
