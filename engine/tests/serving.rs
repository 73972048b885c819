//! The serving engine on the real default model, through its handle (no HTTP): batch
//! invariance, prefix-cache isolation, stop strings, UTF-8, cancellation, preemption. The
//! tests of the step's order run with the output overlapped too (`Overlap::On`: tokens
//! streamed after the next pass is launched, as on a GPU), which must not change an answer.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, ensure};
use sluice_engine::loader::LoadedModel;
use sluice_engine::sampler::SamplingParams;
use sluice_engine::serve::core::{EngineConfig, Overlap};
use sluice_engine::serve::handle::{EngineHandle, RequestStream};
use sluice_engine::serve::{CacheScope, EngineEvent, FinishReason, Usage, ValidRequest};

fn model() -> anyhow::Result<Arc<LoadedModel>> {
    Ok(Arc::new(LoadedModel::load(&common::default_model()?)?))
}

fn request(id: &str, prompt: Vec<u32>, max_tokens: usize, scope: CacheScope) -> ValidRequest {
    ValidRequest {
        request_id: id.into(),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: false,
        logprobs: None,
        prompt_logprobs: None,
        cache_scope: scope,
        priority: 0,
        weight: 1,
        tpot_target: None,
        arrival: Instant::now(),
        grammar: None,
        adapter: None,
    }
}

struct Outcome {
    tokens: Vec<u32>,
    texts: Vec<String>,
    reason: FinishReason,
    usage: Usage,
}

fn collect(mut s: RequestStream) -> anyhow::Result<Outcome> {
    let mut out = Outcome {
        tokens: Vec::new(),
        texts: Vec::new(),
        reason: FinishReason::Error,
        usage: Usage::default(),
    };
    while let Some(ev) = s.blocking_next() {
        match ev {
            EngineEvent::Tokens { tokens, text } => {
                out.tokens.extend(tokens.iter().map(|t| t.token));
                out.texts.push(text);
            }
            EngineEvent::Finished { reason, text, usage, error, .. } => {
                ensure!(error.is_none(), "engine error: {error:?}");
                out.texts.push(text);
                out.reason = reason;
                out.usage = usage;
                return Ok(out);
            }
            EngineEvent::PromptLogprobs(_) => {}
        }
    }
    anyhow::bail!("stream ended without Finished")
}

fn wait_idle(h: &EngineHandle) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let s = h.stats().context("engine stopped")?;
        if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
            return Ok(());
        }
        ensure!(Instant::now() < deadline, "engine not idle: {s:?}");
        std::thread::yield_now();
    }
}

fn golden_prompts(m: &LoadedModel) -> anyhow::Result<Vec<Vec<u32>>> {
    let g = common::golden()?;
    let mut v = Vec::new();
    for item in g["completion"].as_array().into_iter().flatten() {
        v.push(m.encode_prompt(item["prompt"].as_str().context("prompt")?)?);
    }
    Ok(v)
}

#[test]
fn greedy_is_batch_invariant_on_the_golden_prompts() -> anyhow::Result<()> {
    let m = model()?;
    let mut answers = Vec::new();
    for overlap in [Overlap::Off, Overlap::On] {
        answers.push(batch_invariance(&m, overlap).with_context(|| format!("{overlap:?}"))?);
    }
    ensure!(answers[0] == answers[1], "the overlapped output changed the answers");
    Ok(())
}

/// What one engine answered in [`batch_invariance`].
#[derive(Debug, PartialEq)]
struct Answers {
    /// Each golden prompt's greedy tokens.
    greedy: Vec<Vec<u32>>,
    /// A seeded sampled answer (sampled on the host): tokens, text, usage.
    sampled: (Vec<u32>, String, Usage),
}

/// The golden prompts alone, then all at once: the same tokens. Returns them, and a seeded
/// sampled answer.
fn batch_invariance(m: &Arc<LoadedModel>, overlap: Overlap) -> anyhow::Result<Answers> {
    let prompts = golden_prompts(m)?;
    let h = EngineHandle::start(
        Arc::clone(m),
        EngineConfig { kv_cache_bytes: 64 << 20, overlap, ..Default::default() },
    )?;
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let s = h.submit(request(
            &format!("alone-{i}"),
            p.clone(),
            24,
            CacheScope::Private(format!("a{i}")),
        ))?;
        alone.push(collect(s)?.tokens);
    }
    // All at once: they share steps (prefill chunks and decodes mixed in one batch).
    let streams: Vec<RequestStream> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            h.submit(request(
                &format!("batch-{i}"),
                p.clone(),
                24,
                CacheScope::Private(format!("b{i}")),
            ))
        })
        .collect::<Result<_, _>>()?;
    for (i, s) in streams.into_iter().enumerate() {
        let got = collect(s)?.tokens;
        ensure!(got == alone[i], "prompt {i}: alone {:?} vs batched {:?}", alone[i], got);
    }
    let mut r = request("sampled", prompts[0].clone(), 16, CacheScope::Private("d".into()));
    r.sampling = SamplingParams { temperature: 0.8, seed: 7, ..SamplingParams::default() };
    let sampled = collect(h.submit(r)?)?;
    wait_idle(&h)?;
    Ok(Answers { greedy: alone, sampled: (sampled.tokens, sampled.texts.concat(), sampled.usage) })
}

#[test]
fn prefix_cache_hits_only_within_a_tenant() -> anyhow::Result<()> {
    let m = model()?;
    // Overlapped, a pass's blocks are offered to the cache at its launch: the same hits.
    for overlap in [Overlap::Off, Overlap::On] {
        prefix_cache(&m, overlap).with_context(|| format!("{overlap:?}"))?;
    }
    Ok(())
}

fn prefix_cache(m: &Arc<LoadedModel>, overlap: Overlap) -> anyhow::Result<()> {
    let h = EngineHandle::start(
        Arc::clone(m),
        EngineConfig { kv_cache_bytes: 64 << 20, threads: 1, overlap, ..Default::default() },
    )?;
    let text = "You are a careful assistant. ".repeat(12);
    let prompt = m.encode_prompt(&text)?;
    ensure!(prompt.len() > 48, "prompt too short for the test: {}", prompt.len());
    let first =
        collect(h.submit(request("a1", prompt.clone(), 4, CacheScope::Tenant("A".into())))?)?;
    ensure!(first.usage.cached_tokens == 0);
    let again =
        collect(h.submit(request("a2", prompt.clone(), 4, CacheScope::Tenant("A".into())))?)?;
    ensure!(
        again.usage.cached_tokens >= prompt.len() - 16 && again.usage.cached_tokens < prompt.len(),
        "tenant A repeat cached {}",
        again.usage.cached_tokens
    );
    ensure!(again.tokens == first.tokens, "cached prefix changed the output");
    let other =
        collect(h.submit(request("b1", prompt.clone(), 4, CacheScope::Tenant("B".into())))?)?;
    ensure!(other.usage.cached_tokens == 0, "tenant B hit tenant A's cache");
    let private =
        collect(h.submit(request("p1", prompt.clone(), 4, CacheScope::Private("p1".into())))?)?;
    ensure!(private.usage.cached_tokens == 0);
    wait_idle(&h)
}

#[test]
fn stop_strings_across_tokens_and_split_characters() -> anyhow::Result<()> {
    let m = model()?;
    for overlap in [Overlap::Off, Overlap::On] {
        stop_strings(&m, overlap).with_context(|| format!("{overlap:?}"))?;
    }
    Ok(())
}

fn stop_strings(m: &Arc<LoadedModel>, overlap: Overlap) -> anyhow::Result<()> {
    let h = EngineHandle::start(
        Arc::clone(m),
        EngineConfig { kv_cache_bytes: 64 << 20, threads: 1, overlap, ..Default::default() },
    )?;
    // Greedy continuation: " Paris.\n\nThe United States has ..." -- "s.\n" spans three tokens.
    let mut r = request(
        "stop",
        m.encode_prompt("The capital of France is")?,
        40,
        CacheScope::Private("s".into()),
    );
    r.stop = vec!["s.\n".into(), "never-happens".into()];
    let out = collect(h.submit(r)?)?;
    ensure!(out.reason == FinishReason::Stop);
    ensure!(out.texts.concat() == " Pari", "text {:?}", out.texts.concat());

    // A prompt whose continuation splits characters across tokens: every event's text is
    // whole characters and the total equals decoding all tokens at once.
    let r = request(
        "utf8",
        m.encode_prompt("東京は日本の首都です。大阪は")?,
        32,
        CacheScope::Private("u".into()),
    );
    let out = collect(h.submit(r)?)?;
    let all = out.texts.concat();
    ensure!(!all.contains('\u{FFFD}'), "replacement character in {all:?}");
    let ids: Vec<u32> =
        out.tokens.iter().copied().filter(|t| !m.tokenizer.stop_ids().contains(t)).collect();
    // A character the last token leaves incomplete is dropped, never emitted broken.
    let decoded = m.tokenizer.decode(&ids, false)?;
    let whole = decoded.trim_end_matches('\u{FFFD}');
    ensure!(all == whole, "incremental {all:?} vs whole {whole:?} ({:?})", out.texts);
    ensure!(
        out.texts.iter().any(String::is_empty),
        "expected held-back text somewhere in {:?}",
        out.texts
    );
    wait_idle(&h)
}

#[test]
fn cancelled_and_preempted_requests_free_every_block() -> anyhow::Result<()> {
    let m = model()?;
    for overlap in [Overlap::Off, Overlap::On] {
        cancelled_and_preempted(&m, overlap).with_context(|| format!("{overlap:?}"))?;
    }
    Ok(())
}

fn cancelled_and_preempted(m: &Arc<LoadedModel>, overlap: Overlap) -> anyhow::Result<()> {
    // Room for about 7 blocks of 16 tokens: four 40-token generations cannot all fit, so
    // the scheduler must preempt and recompute.
    let per_block =
        sluice_engine::forward::KvCache::bytes_per_block(&m.weights, 16, Default::default());
    let h = EngineHandle::start(
        Arc::clone(m),
        EngineConfig { kv_cache_bytes: per_block * 7, threads: 1, overlap, ..Default::default() },
    )?;
    let prompts = golden_prompts(m)?;
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().take(4).enumerate() {
        let mut r =
            request(&format!("solo-{i}"), p.clone(), 40, CacheScope::Private(format!("s{i}")));
        r.ignore_eos = true;
        alone.push(collect(h.submit(r)?)?.tokens);
    }
    let streams: Vec<RequestStream> = prompts
        .iter()
        .take(4)
        .enumerate()
        .map(|(i, p)| {
            let mut r =
                request(&format!("crowd-{i}"), p.clone(), 40, CacheScope::Private(format!("c{i}")));
            r.ignore_eos = true;
            h.submit(r)
        })
        .collect::<Result<_, _>>()?;
    for (i, s) in streams.into_iter().enumerate() {
        let out = collect(s)?;
        ensure!(out.tokens == alone[i], "preemption changed request {i}'s output");
        ensure!(out.reason == FinishReason::Length);
    }
    let metrics = h.metrics().encode();
    let preempted: f64 = metrics
        .lines()
        .find(|l| l.starts_with("sluice_engine_num_preemptions_total"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0.0);
    ensure!(preempted > 0.0, "the test did not force a preemption");
    wait_idle(&h)?;

    // Cancellation: drop the stream after two events.
    let mut r = request("cancel", prompts[0].clone(), 90, CacheScope::Private("x".into()));
    r.ignore_eos = true;
    let mut s = h.submit(r)?;
    for _ in 0..2 {
        s.blocking_next().context("event")?;
    }
    drop(s);
    wait_idle(&h)?;
    ensure!(metrics.contains("sluice_engine_time_to_first_token_seconds"));
    Ok(())
}

#[test]
fn requests_the_cache_can_never_hold_are_refused() -> anyhow::Result<()> {
    let m = model()?;
    let per_block =
        sluice_engine::forward::KvCache::bytes_per_block(&m.weights, 16, Default::default());
    let h = EngineHandle::start(
        Arc::clone(&m),
        EngineConfig { kv_cache_bytes: per_block * 2, threads: 1, ..Default::default() },
    )?;
    let err = h
        .submit(request("big", vec![1; 20], 20, CacheScope::Private("b".into())))
        .err()
        .context("accepted")?;
    ensure!(err.to_string().contains("KV"), "{err}");
    Ok(())
}

/// Constrained requests (`response_format`) on the real model: greedy and sampled at several
/// seeds, every output is a closed JSON value of its schema, ended by the grammar (`stop`).
#[test]
fn constrained_outputs_parse_and_follow_their_schema() -> anyhow::Result<()> {
    let m = model()?;
    let mut answers = Vec::new();
    for overlap in [Overlap::Off, Overlap::On] {
        answers.push(constrained(&m, overlap).with_context(|| format!("{overlap:?}"))?);
    }
    ensure!(answers[0] == answers[1], "the overlapped order changed a constrained answer");
    Ok(())
}

/// Every constrained answer's text, after checking it.
fn constrained(m: &Arc<LoadedModel>, overlap: Overlap) -> anyhow::Result<Vec<String>> {
    use sluice_engine::structured::Grammar;
    let h = EngineHandle::start(
        Arc::clone(m),
        EngineConfig { kv_cache_bytes: 64 << 20, overlap, ..Default::default() },
    )?;
    let mut texts = Vec::new();
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "pet": {"enum": ["cat", "dog"]},
            "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}
        },
        "required": ["name", "age", "pet", "tags"],
        "additionalProperties": false
    });
    let grammars = [
        ("schema", Arc::new(Grammar::from_schema(&schema).map_err(|e| anyhow::anyhow!("{e}"))?)),
        ("object", Arc::new(Grammar::any_object())),
    ];
    let prompt = m.encode_prompt("Here is a person, as JSON:")?;
    for (kind, grammar) in &grammars {
        for (i, temperature) in [0.0, 0.8, 0.8, 0.8].into_iter().enumerate() {
            let mut req = request(
                &format!("{kind}-{i}"),
                prompt.clone(),
                256,
                CacheScope::Private(format!("s{i}")),
            );
            req.sampling = SamplingParams { temperature, seed: i as u64, ..Default::default() };
            req.grammar = Some(Arc::clone(grammar));
            let out = collect(h.submit(req)?)?;
            let text = out.texts.concat();
            texts.push(text.clone());
            // The model ends the JSON itself, or a sampled ramble is closed by the grammar in
            // the last tokens of the budget: JSON either way (greedy ones end on their own).
            let closed = out.reason == FinishReason::Length && out.tokens.len() == 256;
            ensure!(
                out.reason == FinishReason::Stop || (closed && temperature > 0.0),
                "{kind}-{i} ended {:?} after {} tokens: {text}",
                out.reason,
                out.tokens.len()
            );
            let v: serde_json::Value = serde_json::from_str(&text)
                .with_context(|| format!("{kind}-{i} is not JSON: {text}"))?;
            let o =
                v.as_object().with_context(|| format!("{kind}-{i} is not an object: {text}"))?;
            if *kind == "schema" {
                let keys: Vec<&str> = o.keys().map(String::as_str).collect();
                ensure!(keys == ["name", "age", "pet", "tags"], "{kind}-{i}: {text}");
                ensure!(o["name"].is_string() && o["age"].is_i64(), "{kind}-{i}: {text}");
                ensure!(["cat", "dog"].contains(&o["pet"].as_str().unwrap_or("")), "{text}");
                let tags = o["tags"].as_array().context("tags")?;
                ensure!(tags.len() <= 3 && tags.iter().all(|t| t.is_string()), "{text}");
            }
        }
    }
    wait_idle(&h)?;
    Ok(texts)
}
