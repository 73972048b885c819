//! The streaming metrics, defined once for the gateway's ledger and the load generator
//! (MISSION.md): TTFT = t_1 - t_a; TPOT = (t_O - t_1) / (O - 1) for O > 1 (undefined for one
//! token); ITL = every gap between token-carrying events, a chunk of k tokens being one gap;
//! E2E = t_O - t_a. Both sides parse the same server-sent events with [`SseParser`] and count
//! tokens per event with [`tokens_carried`].
//!
//! Events may be split across reads in any way; the parser keeps the incomplete tail. A chunk
//! carrying k tokens (Sluice engines say so in `sluice.tokens`; otherwise one per choice that
//! carries text) counts k tokens, and its gap is a chunk gap, not k token gaps.

use serde_json::Value;

/// Incremental SSE parser: feed bytes, get complete events' `data` fields.
#[derive(Debug, Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    /// Appends `bytes` and returns the data of every event completed by them.
    pub fn feed(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some((end, sep)) = find_event_end(&self.buf) {
            let event: Vec<u8> = self.buf.drain(..end + sep).take(end).collect();
            let text = String::from_utf8_lossy(&event);
            let mut data: Vec<&str> = Vec::new();
            for line in text.split('\n') {
                let line = line.strip_suffix('\r').unwrap_or(line);
                if let Some(v) = line.strip_prefix("data:") {
                    data.push(v.strip_prefix(' ').unwrap_or(v));
                }
            }
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

/// Position and length of the first blank-line separator (`\n\n`, `\r\n\r\n`, `\r\r`).
fn find_event_end(buf: &[u8]) -> Option<(usize, usize)> {
    let mut i = 0;
    while i < buf.len() {
        if buf[i..].starts_with(b"\r\n\r\n") {
            return Some((i, 4));
        }
        if buf[i..].starts_with(b"\n\n") || buf[i..].starts_with(b"\r\r") {
            return Some((i, 2));
        }
        i += 1;
    }
    None
}

/// Tokens one stream event carries: the server's own count when it gives one (Sluice's
/// `sluice.tokens`), otherwise one per choice that carries text.
pub fn tokens_carried(event: &Value) -> u64 {
    event["sluice"]["tokens"].as_u64().unwrap_or_else(|| {
        event["choices"].as_array().map_or(0, |cs| {
            cs.iter()
                .filter(|c| {
                    let text = c["text"].as_str().or_else(|| c["delta"]["content"].as_str());
                    text.is_some_and(|t| !t.is_empty())
                })
                .count() as u64
        })
    })
}

/// The token-carrying events of one response: the time since the request's arrival (or its
/// scheduled send) and the tokens each event carried, in order. Times are in the caller's unit
/// (the gateway's ledger uses milliseconds, the load generator seconds), and so are the
/// metrics derived from them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TokenEvents(pub Vec<(f64, u64)>);

impl TokenEvents {
    /// Records an event at `at_s` carrying `tokens` (events carrying none are not recorded).
    pub fn push(&mut self, at_s: f64, tokens: u64) {
        if tokens > 0 {
            self.0.push((at_s, tokens));
        }
    }

    /// Time to first token; `None` when nothing was streamed.
    pub fn ttft(&self) -> Option<f64> {
        self.0.first().map(|e| e.0)
    }

    /// Tokens the events carried.
    pub fn tokens(&self) -> u64 {
        self.0.iter().map(|e| e.1).sum()
    }

    /// Time per output token after the first; `None` for fewer than two tokens.
    /// Tokens after the first one carried by the first event count too: a first chunk of k
    /// tokens contributes k - 1 to the denominator at zero time.
    pub fn tpot(&self) -> Option<f64> {
        let o = self.tokens();
        let (first, last) = (self.0.first()?, self.0.last()?);
        (o > 1).then(|| (last.0 - first.0) / (o - 1) as f64)
    }

    /// Gaps between token-carrying events, each with the tokens of the later event.
    pub fn itls(&self) -> Vec<(f64, u64)> {
        self.0.windows(2).map(|w| (w[1].0 - w[0].0, w[1].1)).collect()
    }

    /// The 99th percentile (nearest rank) and the largest gap; `None` without gaps.
    pub fn itl_p99_and_max(&self) -> Option<(f64, f64)> {
        let mut g: Vec<f64> = self.itls().into_iter().map(|(d, _)| d).collect();
        g.sort_by(f64::total_cmp);
        let rank = ((0.99 * g.len() as f64).ceil() as usize).clamp(1, g.len().max(1));
        Some((*g.get(rank - 1)?, *g.last()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_follow_the_definitions() {
        // Arrival at 0; chunks at 0.1 s (2 tokens), 0.14 s (1), 0.2 s (2).
        let e = TokenEvents(vec![(0.1, 2), (0.14, 1), (0.2, 2)]);
        assert_eq!(e.ttft(), Some(0.1));
        assert_eq!(e.tokens(), 5);
        let tpot = e.tpot().unwrap_or_default();
        assert!((tpot - 0.025).abs() < 1e-12, "{tpot}");
        let itls = e.itls();
        assert_eq!(itls.len(), 2);
        assert!((itls[0].0 - 0.04).abs() < 1e-12 && itls[1].1 == 2, "{itls:?}");
        let (p99, max) = e.itl_p99_and_max().unwrap_or_default();
        assert!((p99 - 0.06).abs() < 1e-12 && (max - 0.06).abs() < 1e-12, "{p99} {max}");
    }

    #[test]
    fn one_token_has_no_tpot_and_nothing_streamed_has_no_ttft() {
        let mut e = TokenEvents::default();
        assert_eq!((e.ttft(), e.tpot(), e.itl_p99_and_max()), (None, None, None));
        e.push(0.5, 0);
        assert_eq!(e.ttft(), None);
        e.push(0.03, 1);
        assert_eq!((e.ttft(), e.tpot(), e.itl_p99_and_max()), (Some(0.03), None, None));
    }

    #[test]
    fn events_split_anywhere_parse_the_same() {
        let stream = "data: {\"a\":1}\r\n\r\ndata: x\ndata: y\n\n: comment\n\ndata: [DONE]\n\n";
        let whole = SseParser::default().feed(stream.as_bytes());
        assert_eq!(whole, ["{\"a\":1}", "x\ny", "[DONE]"]);
        for cut in 0..stream.len() {
            let mut p = SseParser::default();
            let mut got = p.feed(&stream.as_bytes()[..cut]);
            got.extend(p.feed(&stream.as_bytes()[cut..]));
            assert_eq!(got, whole, "cut at {cut}");
        }
    }

    #[test]
    fn tokens_carried_prefers_the_servers_count() {
        let own = serde_json::json!({"choices": [{"text": "ab"}], "sluice": {"tokens": 3}});
        let text = serde_json::json!({"choices": [{"text": "ab"}, {"delta": {"content": ""}}]});
        let chat = serde_json::json!({"choices": [{"delta": {"content": "x"}}]});
        assert_eq!([tokens_carried(&own), tokens_carried(&text), tokens_carried(&chat)], [3, 1, 1]);
    }
}
