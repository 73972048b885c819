//! Watches an OpenAI-style server-sent event stream as it is written to the client and
//! derives the client-side timings the ledger records (MISSION.md's definitions): TTFT from
//! the gateway's arrival to the first event carrying a token, each gap between token-carrying
//! events with its token count, TPOT over the tokens after the first, E2E to the end.
//!
//! The definitions and the event parser are `sluice_text::stream`'s, shared with the load
//! generator; this adds what the ledger keeps beside them (usage, finish reason, identity).

use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::Value;
use sluice_text::stream::{SseParser, TokenEvents, tokens_carried};
use sluice_wire::{EngineTimings, ExecutionIdentity};

/// What the gateway measured for one request.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    /// Arrival to the first token-carrying event (absent when nothing was streamed).
    pub ttft_ms: Option<f64>,
    /// Mean time per output token after the first (absent with fewer than 2 tokens).
    pub tpot_ms: Option<f64>,
    /// Largest gap between token-carrying events.
    pub itl_max_ms: Option<f64>,
    /// 99th percentile (nearest rank) of those gaps.
    pub itl_p99_ms: Option<f64>,
    /// Arrival to the end of the response.
    pub e2e_ms: f64,
    /// Tokens the client received, by the stream's own counts.
    pub streamed_tokens: u64,
    /// The final usage object, when the stream carried one.
    pub usage: Option<Value>,
    /// The engine's own timings from its final chunk.
    pub engine_timings: Option<EngineTimings>,
    /// The last finish reason seen.
    pub finish_reason: Option<String>,
    /// The engine's execution identity.
    pub execution_identity: Option<ExecutionIdentity>,
    /// Whether `[DONE]` arrived (a complete stream).
    pub done: bool,
    /// Every gap between token-carrying events, with the tokens the later event carried.
    pub gaps_ms: Vec<(f64, u64)>,
}

/// What a whole (not streamed) engine response tells the gateway: its usage, the engine's
/// timings and execution identity, the first choice's finish reason. Read without building
/// the answer's text or logprobs into a document (they are skipped as they are parsed, and so
/// not checked for lone surrogates); a body of another shape is read as a document, for the
/// same fields, each on its own.
pub fn whole_response(body: &[u8], e2e_ms: f64) -> Timings {
    /// The first choice's finish reason, nothing else of it.
    #[derive(Deserialize)]
    struct Choice {
        #[serde(default)]
        finish_reason: Value,
    }
    /// The engine's extension, read straight into its types.
    #[derive(Default, Deserialize)]
    struct Ext {
        #[serde(default)]
        timings: Option<EngineTimings>,
        #[serde(default)]
        execution_identity: Option<ExecutionIdentity>,
    }
    #[derive(Deserialize)]
    struct Reply {
        #[serde(default)]
        usage: Value,
        #[serde(default)]
        sluice: Option<Object<Ext>>,
        #[serde(default)]
        choices: Vec<Object<Choice>>,
    }
    let (usage, ext, finish) = match serde_json::from_slice::<Object<Reply>>(body) {
        Ok(Object(r)) => {
            let first = r.choices.into_iter().next().map(|c| c.0.finish_reason);
            (r.usage, r.sluice.map(|e| e.0).unwrap_or_default(), first)
        }
        Err(_) => {
            let v: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
            let ext = Ext {
                timings: EngineTimings::deserialize(&v["sluice"]["timings"]).ok(),
                execution_identity: ExecutionIdentity::deserialize(
                    &v["sluice"]["execution_identity"],
                )
                .ok(),
            };
            let usage = v.get("usage").cloned().unwrap_or_default();
            (usage, ext, Some(v["choices"][0]["finish_reason"].clone()))
        }
    };
    Timings {
        e2e_ms,
        usage: Some(usage).filter(|u| !u.is_null()),
        engine_timings: ext.timings,
        execution_identity: ext.execution_identity,
        finish_reason: finish.and_then(|f| f.as_str().map(str::to_owned)),
        done: true,
        ..Timings::default()
    }
}

/// `T` read from a JSON object only: serde reads a struct from an array too, which a
/// document's `get` and index never do.
struct Object<T>(T);

impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Fields<T>(std::marker::PhantomData<T>);
        impl<'de, T: Deserialize<'de>> serde::de::Visitor<'de> for Fields<T> {
            type Value = T;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an object")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
            }
        }
        d.deserialize_map(Fields(std::marker::PhantomData)).map(Object)
    }
}

/// Observes one response stream.
#[derive(Debug)]
pub struct StreamObserver {
    arrival: Instant,
    parser: SseParser,
    events: TokenEvents,
    out: Timings,
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

impl StreamObserver {
    /// Starts observing a request that arrived at `arrival`.
    pub fn new(arrival: Instant) -> Self {
        Self {
            arrival,
            parser: SseParser::default(),
            events: TokenEvents::default(),
            out: Timings::default(),
        }
    }

    /// Bytes written to the client at `now`.
    pub fn on_bytes(&mut self, bytes: &[u8], now: Instant) {
        for data in self.parser.feed(bytes) {
            if data.trim() == "[DONE]" {
                self.out.done = true;
                continue;
            }
            let Ok(v) = serde_json::from_str::<Value>(&data) else { continue };
            self.on_event(&v, now);
        }
    }

    fn on_event(&mut self, v: &Value, now: Instant) {
        let carried = tokens_carried(v);
        for c in v["choices"].as_array().into_iter().flatten() {
            if let Some(r) = c["finish_reason"].as_str() {
                self.out.finish_reason = Some(r.to_owned());
            }
        }
        if v["usage"].is_object() {
            self.out.usage = Some(v["usage"].clone());
        }
        if let Ok(t) = EngineTimings::deserialize(&v["sluice"]["timings"]) {
            self.out.engine_timings = Some(t);
        }
        if let Ok(id) = ExecutionIdentity::deserialize(&v["sluice"]["execution_identity"]) {
            self.out.execution_identity = Some(id);
        }
        self.events.push(ms(now.saturating_duration_since(self.arrival)), carried);
    }

    /// Whether a token went by already.
    pub fn started(&self) -> bool {
        !self.events.0.is_empty()
    }

    /// Whether `[DONE]` went by already.
    pub fn done(&self) -> bool {
        self.out.done
    }

    /// The timings, with the response ending at `end`.
    pub fn finish(mut self, end: Instant) -> Timings {
        let e = &self.events;
        self.out.e2e_ms = ms(end.saturating_duration_since(self.arrival));
        self.out.ttft_ms = e.ttft();
        self.out.tpot_ms = e.tpot();
        self.out.streamed_tokens = e.tokens();
        self.out.gaps_ms = e.itls();
        if let Some((p99, max)) = e.itl_p99_and_max() {
            self.out.itl_p99_ms = Some(p99);
            self.out.itl_max_ms = Some(max);
        }
        self.out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(text: &str, tokens: Option<u64>) -> String {
        let mut v = serde_json::json!({"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        if let Some(k) = tokens {
            v["sluice"] = serde_json::json!({"tokens": k});
        }
        format!("data: {v}\n\n")
    }

    #[test]
    fn events_split_anywhere_parse_the_same() {
        let stream = format!(
            "{}{}: keep-alive comment\n\ndata: [DONE]\r\n\r\n",
            chunk("Hel", None),
            chunk("lo", None)
        );
        let whole = SseParser::default().feed(stream.as_bytes());
        assert_eq!(whole.len(), 3);
        for cut in 0..stream.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&stream.as_bytes()[..cut]);
            got.extend(p.feed(&stream.as_bytes()[cut..]));
            assert_eq!(got, whole, "cut at {cut}");
        }
        let mut p = SseParser::default();
        let mut got = Vec::new();
        for b in stream.as_bytes() {
            got.extend(p.feed(&[*b]));
        }
        assert_eq!(got, whole);
    }

    #[test]
    fn timings_follow_the_definitions() {
        let t0 = Instant::now();
        let at = |ms: u64| t0 + Duration::from_millis(ms);
        let mut o = StreamObserver::new(t0);
        // Role chunk with no text, then tokens at 100 ms (1), 120 ms (1), 180 ms (a chunk of 3).
        o.on_bytes(b"data: {\"choices\":[{\"delta\":{\"role\":\"assistant\"}}]}\n\n", at(50));
        o.on_bytes(chunk("a", Some(1)).as_bytes(), at(100));
        o.on_bytes(chunk("b", Some(1)).as_bytes(), at(120));
        o.on_bytes(chunk("cde", Some(3)).as_bytes(), at(180));
        let fin = serde_json::json!({"choices": [{"delta": {}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 7, "completion_tokens": 5},
            "sluice": {"tokens": 0, "timings": {"queue": 0.01, "prefill": 0.08, "decode": 0.09,
                "ttft": 0.09, "e2e": 0.18, "preemptions": 0}}});
        o.on_bytes(format!("data: {fin}\n\ndata: [DONE]\n\n").as_bytes(), at(181));
        let t = o.finish(at(200));
        assert_eq!(t.ttft_ms, Some(100.0));
        assert_eq!(t.streamed_tokens, 5);
        // (180 - 100) / (5 - 1)
        assert_eq!(t.tpot_ms, Some(20.0));
        assert_eq!(t.itl_max_ms, Some(60.0));
        assert_eq!(t.itl_p99_ms, Some(60.0));
        assert_eq!(t.e2e_ms, 200.0);
        assert_eq!(t.finish_reason.as_deref(), Some("length"));
        assert_eq!(t.usage.as_ref().map(|u| u["completion_tokens"].clone()), Some(5.into()));
        assert!(t.done && t.engine_timings.is_some());
        assert_eq!(t.engine_timings.map(|e| e.in_batch()), Some(0.08 + 0.09));
    }

    #[test]
    fn a_whole_response_is_read_for_its_usage_timings_identity_and_finish() {
        let body = serde_json::json!({"id": "cmpl-1", "object": "text_completion",
            "choices": [{"index": 0, "text": "a \"quoted\" answer", "logprobs": {"tokens": ["a"]},
                "finish_reason": "length"}, {"index": 1, "text": "b", "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
            "sluice": {"timings": {"queue": 0.01, "prefill": 0.02, "decode": 0.03, "ttft": 0.03,
                "e2e": 0.06, "preemptions": 0}}})
        .to_string();
        let t = whole_response(body.as_bytes(), 12.5);
        assert_eq!(t.finish_reason.as_deref(), Some("length"));
        assert_eq!(t.usage.as_ref().map(|u| u["completion_tokens"].clone()), Some(2.into()));
        assert_eq!(t.engine_timings.map(|e| e.in_batch()), Some(0.02 + 0.03));
        assert!(t.done && t.e2e_ms == 12.5 && t.execution_identity.is_none());
        // Another shape (a choice that is no object) is read as a document, for the same
        // fields; nothing readable gives nothing, and a null usage is none.
        let odd = br#"{"choices": ["x"], "usage": {"completion_tokens": 4},
            "sluice": {"timings": "late"}}"#;
        let t = whole_response(odd, 1.0);
        assert_eq!(t.usage.as_ref().map(|u| u["completion_tokens"].clone()), Some(4.into()));
        assert_eq!(t.finish_reason, None);
        // Read as a document's `get` and index read it: an array is no object, an object's
        // key "0" no first element.
        for junk in [
            &b"not json"[..],
            b"[]",
            b"7",
            br#"[{"completion_tokens": 5}]"#,
            br#"{"usage": null, "choices": {"0": {"finish_reason": "stop"}}}"#,
            br#"{"choices": [["stop"]], "sluice": [{"queue": 0.01}]}"#,
        ] {
            let t = whole_response(junk, 1.0);
            assert!(t.usage.is_none() && t.finish_reason.is_none() && t.engine_timings.is_none());
        }
    }

    #[test]
    fn one_token_has_no_tpot_and_nothing_streamed_has_no_ttft() {
        let t0 = Instant::now();
        let mut o = StreamObserver::new(t0);
        o.on_bytes(chunk("x", None).as_bytes(), t0 + Duration::from_millis(30));
        let t = o.finish(t0 + Duration::from_millis(40));
        assert_eq!((t.ttft_ms, t.tpot_ms, t.itl_max_ms), (Some(30.0), None, None));
        let t = StreamObserver::new(t0).finish(t0 + Duration::from_millis(40));
        assert_eq!((t.ttft_ms, t.e2e_ms, t.done), (None, 40.0, false));
    }
}
