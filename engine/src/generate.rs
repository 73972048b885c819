//! Single-sequence generation for the command line and benchmarks, and the incremental
//! detokenizer shared with the serving engine.

use std::time::Instant;

use serde::Serialize;

use crate::backend::{Backend, Device, KvSize};
use crate::error::{EngineError, Result};
use crate::forward::{KvDtype, LogitsWanted, Pick, SeqInput};
use crate::loader::LoadedModel;
use crate::sampler::{Sampler, SamplingParams};
use sluice_text::tokenizer::Tokenizer;

/// Turns a growing token sequence into text deltas without ever emitting a broken UTF-8
/// character: text whose last character is still incomplete is held back.
#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
}

impl IncrementalDecoder {
    /// Appends `id` and returns the text that became final.
    pub fn push(&mut self, tok: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], false)?;
        if full.len() > prefix.len() && !full.ends_with('\u{FFFD}') {
            let delta = full.get(prefix.len()..).unwrap_or_default().to_string();
            self.prefix_offset = self.read_offset;
            self.read_offset = self.ids.len();
            Ok(delta)
        } else {
            Ok(String::new())
        }
    }

    /// Text still held back at the end of generation. The bytes of a character that the
    /// last token left incomplete are dropped: broken UTF-8 is never emitted.
    pub fn flush(&mut self, tok: &Tokenizer) -> Result<String> {
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset], false)?;
        let full = tok.decode(&self.ids[self.prefix_offset..], false)?;
        self.prefix_offset = self.ids.len();
        self.read_offset = self.ids.len();
        let rest = full.get(prefix.len()..).unwrap_or_default();
        Ok(rest.trim_end_matches('\u{FFFD}').to_string())
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An end-of-sequence or stop token.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// Options of one generation.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Keep going past end-of-sequence tokens.
    pub ignore_eos: bool,
}

/// Wall-clock timings of a generation.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Timings {
    /// Seconds to process the prompt and produce the first token.
    pub prefill_seconds: f64,
    /// Seconds for the remaining tokens.
    pub decode_seconds: f64,
    /// Prompt tokens per second.
    pub prefill_tokens_per_second: f64,
    /// Generated tokens per second after the first.
    pub decode_tokens_per_second: f64,
}

/// The result of [`generate`].
#[derive(Clone, Debug, Serialize)]
pub struct Generation {
    /// Prompt length in tokens.
    pub prompt_tokens: usize,
    /// Generated token ids.
    pub completion_tokens: Vec<u32>,
    /// Generated text.
    pub completion_text: String,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// Timings.
    pub timings: Timings,
}

/// Block size of the KV cache used by single-sequence generation.
const BLOCK: usize = 16;

/// Generates from `prompt` token ids on `device` (`threads`: CPU compute threads, 0 = all
/// cores), calling `on_text` with each final piece of text.
pub fn generate(
    model: &LoadedModel,
    device: Device,
    threads: usize,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generation> {
    let ctx = model.weights.config.context_length;
    if prompt.is_empty() {
        return Err(EngineError::InvalidRequest("the prompt is empty".into()));
    }
    if prompt.len() >= ctx {
        return Err(EngineError::InvalidRequest(format!(
            "prompt of {} tokens does not fit the context length {ctx}",
            prompt.len()
        )));
    }
    let total = (prompt.len() + opts.max_tokens).min(ctx);
    let blocks = total.div_ceil(BLOCK);
    let mut backend =
        Backend::new(device, &model.weights, threads, BLOCK, KvSize::Blocks(blocks), KvDtype::F16)?;
    backend.reserve(prompt.len(), 1)?;
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut sampler = Sampler::new(opts.sampling.clone());
    let mut decoder = IncrementalDecoder::default();
    let stops = model.tokenizer.stop_ids();
    let mut out = Vec::new();
    let mut text = String::new();
    let mut finish = FinishReason::Length;
    let start = Instant::now();
    let mut first_token_at = None;
    let mut pos = 0;
    let mut input: Vec<u32> = prompt.to_vec();
    while out.len() < opts.max_tokens && pos + input.len() <= total {
        let seq = SeqInput {
            tokens: &input,
            start_pos: pos,
            block_table: &table,
            logits: LogitsWanted::Last,
            adapter: None,
        };
        let logits = backend.forward_picking(&model.weights, &[seq], &[Pick::Logits])?.logits;
        pos += input.len();
        let tok = sampler.sample(&logits, None).token;
        first_token_at.get_or_insert_with(Instant::now);
        out.push(tok);
        if !opts.ignore_eos && stops.contains(&tok) {
            finish = FinishReason::Stop;
            break;
        }
        let piece = decoder.push(&model.tokenizer, tok)?;
        if !piece.is_empty() {
            on_text(&piece);
            text.push_str(&piece);
        }
        input = vec![tok];
    }
    let rest = decoder.flush(&model.tokenizer)?;
    if !rest.is_empty() {
        on_text(&rest);
        text.push_str(&rest);
    }
    let end = Instant::now();
    let first = first_token_at.unwrap_or(end);
    let prefill = (first - start).as_secs_f64();
    let decode = (end - first).as_secs_f64();
    let timings = Timings {
        prefill_seconds: prefill,
        decode_seconds: decode,
        prefill_tokens_per_second: if prefill > 0.0 { prompt.len() as f64 / prefill } else { 0.0 },
        decode_tokens_per_second: if decode > 0.0 && out.len() > 1 {
            (out.len() - 1) as f64 / decode
        } else {
            0.0
        },
    };
    Ok(Generation {
        prompt_tokens: prompt.len(),
        completion_tokens: out,
        completion_text: text,
        finish_reason: finish,
        timings,
    })
}
