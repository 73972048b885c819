//! The SSE observer against any bytes, cut anywhere (proptest, stable Rust): it never panics,
//! and what it concludes (tokens streamed, usage, finish reason, [DONE]) does not depend on
//! where the network cut the stream. `PROPTEST_CASES` sets the length of the run
//! (`scripts/fuzz` runs long); failing seeds are kept in `fuzz_sse.proptest-regressions`.

use std::time::Instant;

use proptest::prelude::*;
use serde_json::json;
use sluice_gateway::observe::StreamObserver;

fn config() -> ProptestConfig {
    let cases = std::env::var("PROPTEST_CASES").ok().and_then(|c| c.parse().ok()).unwrap_or(256);
    ProptestConfig { cases, ..ProptestConfig::default() }
}

/// Engine-like events, some malformed, with `\n\n`, `\r\n` and comment lines between them.
fn stream() -> impl Strategy<Value = Vec<u8>> {
    let event = prop_oneof![
        (".{0,8}", 0u64..4).prop_map(|(t, k)| format!(
            "data: {}\n\n",
            json!({"choices": [{"index": 0, "delta": {"content": t}, "finish_reason": null}],
                   "sluice": {"tokens": k}})
        )),
        Just(
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"length\"}]}\n\n"
                .to_owned()
        ),
        Just("data: {\"choices\":[],\"usage\":{\"completion_tokens\":7}}\n\n".to_owned()),
        Just("data: [DONE]\n\n".to_owned()),
        Just(": keep-alive\n\n".to_owned()),
        Just("data: {\"choices\":[{\"delta\":\r\n\r\n".to_owned()),
        Just("event: error\ndata: {\"error\":{\"message\":\"x\"}}\n\n".to_owned()),
        "\\PC{0,12}",
    ];
    prop::collection::vec(event, 0..12).prop_map(|e| e.concat().into_bytes())
}

fn observe(chunks: &[&[u8]]) -> (u64, Option<serde_json::Value>, Option<String>, bool) {
    let start = Instant::now();
    let mut o = StreamObserver::new(start);
    for c in chunks {
        o.on_bytes(c, start);
    }
    let t = o.finish(start);
    (t.streamed_tokens, t.usage, t.finish_reason, t.done)
}

/// `bytes` cut at `cuts` (taken modulo its length), in order.
fn cut<'a>(bytes: &'a [u8], cuts: &[usize]) -> Vec<&'a [u8]> {
    let mut at: Vec<usize> = cuts.iter().map(|c| c % (bytes.len() + 1)).collect();
    at.sort_unstable();
    let mut chunks = Vec::new();
    let mut prev = 0;
    for a in at {
        chunks.push(&bytes[prev..a]);
        prev = a;
    }
    chunks.push(&bytes[prev..]);
    chunks
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn any_bytes_cut_anywhere_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512),
                                           cuts in prop::collection::vec(any::<usize>(), 0..8)) {
        let _ = observe(&cut(&bytes, &cuts));
    }

    #[test]
    fn where_the_stream_is_cut_changes_nothing(bytes in stream(),
                                              cuts in prop::collection::vec(any::<usize>(), 1..10)) {
        prop_assert_eq!(observe(&cut(&bytes, &cuts)), observe(&[&bytes]));
    }
}
