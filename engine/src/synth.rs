//! Synthetic random-weight Llama-family models, written through the real file formats.
//!
//! One [`SynthSpec`] gives the same model as a GGUF file (any tensor type; Q and K rows
//! permuted for interleaved RoPE exactly as llama.cpp's converter does) and as a Hugging Face
//! directory (`config.json`, safetensors, `tokenizer.json`). Tests load both and compare; GPU
//! parity and benchmark scripts use large specs, so generation and quantization use all cores
//! and every weight is a pure function of (seed, tensor name, index).

use std::path::Path;

use serde_json::json;

use sluice_text::gguf::{GgufWriter, MetaValue};
use sluice_text::synth::{SynthVocabulary, tokenizer_token_count};

use crate::error::{EngineError, Result};
use crate::model::{
    Gemma, LlamaConfig, RopeScaling, RopeStyle, gguf_names, hf_gemma_names, hf_names,
};
use crate::quant::{GgmlType, quantize_row};
use crate::safetensors::{CONFIG_FILE, INDEX_FILE, SINGLE_FILE, write_safetensors};

/// RMSNorm epsilon of every synthetic model.
pub const RMS_EPS: f32 = 1e-5;
/// A synthetic Gemma 2's sliding window: short, so the golden prompts cross it.
const GEMMA2_SLIDING_WINDOW: usize = 16;
/// Its caps, low enough to change random weights' scores and logits (the real models' are 50
/// and 30).
const GEMMA2_ATTN_SOFTCAP: f32 = 0.5;
const GEMMA2_FINAL_SOFTCAP: f32 = 8.0;
/// The pre-training context a synthetic LongRoPE model states (its context is longer).
pub const LONGROPE_ORIGINAL_CONTEXT: usize = 64;
/// A synthetic Gemma 3's sliding layers' RoPE base (its global layers take the spec's).
const GEMMA3_LOCAL_ROPE_THETA: f32 = 10_000.0;
/// Shape and seed of a synthetic model.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthSpec {
    /// Vocabulary size (at least [`tokenizer_token_count`]; the rest are `<unused_N>`).
    pub vocab: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Feed-forward inner size.
    pub intermediate: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads (head dim is `hidden / heads`).
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Context length.
    pub context: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Whether the output projection reuses the embedding.
    pub tied: bool,
    /// Q/K/V biases; makes the model a Qwen2 one.
    pub qkv_bias: bool,
    /// Per-head Q/K RMSNorm (and no biases); makes the model a Qwen3 one.
    pub qk_norm: bool,
    /// Q, K and V in one matrix, gate and up in another; makes the model a Phi-3 one.
    pub fused: bool,
    /// Gemma 2's block (norms after attention and after the FFN, GELU, the embedding scaled,
    /// sliding-window layers, capped scores and logits; tied embeddings); GGUF only.
    pub gemma2: bool,
    /// Gemma 3's block (Gemma 2's without the caps, with per-head Q/K norms, which
    /// `qk_norm` must ask for, and an unscaled RoPE base of 10,000 on the sliding layers).
    pub gemma3: bool,
    /// Phi-3.5's LongRoPE: per-dimension factors (the long ones apply, the context being
    /// past a pre-training context of [`LONGROPE_ORIGINAL_CONTEXT`]) and an attention factor;
    /// with `fused`.
    pub longrope: bool,
    /// Seed of every weight.
    pub seed: u64,
}

impl SynthSpec {
    /// A model small enough for unit tests.
    pub fn tiny() -> SynthSpec {
        SynthSpec {
            vocab: 320,
            hidden: 64,
            intermediate: 128,
            layers: 2,
            heads: 4,
            kv_heads: 2,
            context: 256,
            rope_theta: 10_000.0,
            tied: false,
            qkv_bias: false,
            qk_norm: false,
            fused: false,
            gemma2: false,
            gemma3: false,
            longrope: false,
            seed: 1,
        }
    }

    /// The shapes `sluice model synth` writes by name: `tiny`, `tiny-256` (rows of whole
    /// K-quant super-blocks, for llama.cpp's quantizer), `small` (tiny layers under a
    /// 32,000-token vocabulary, so clients' usual token ids are in range), `llama-1b` (Llama
    /// 3.2 1B's shape), `qwen2.5-3b` (Qwen2.5 3B's: Q/K/V biases, 2 KV heads) and `llama-8b`
    /// (Llama 3.1 8B's), the last four with an 8,192-token context.
    pub const NAMES: [&str; 6] =
        ["tiny", "tiny-256", "small", "llama-1b", "qwen2.5-3b", "llama-8b"];

    /// The shape called `name` ([`SynthSpec::NAMES`]), seed 1.
    pub fn named(name: &str) -> Option<SynthSpec> {
        let llama3 = |hidden, intermediate, layers, tied| SynthSpec {
            vocab: 128_256,
            hidden,
            intermediate,
            layers,
            heads: 32,
            kv_heads: 8,
            context: 8192,
            rope_theta: 500_000.0,
            tied,
            qkv_bias: false,
            qk_norm: false,
            fused: false,
            gemma2: false,
            gemma3: false,
            longrope: false,
            seed: 1,
        };
        match name {
            "tiny" => Some(SynthSpec::tiny()),
            "tiny-256" => Some(SynthSpec { hidden: 256, intermediate: 512, ..SynthSpec::tiny() }),
            "small" => Some(SynthSpec { vocab: 32_000, context: 8192, ..SynthSpec::tiny() }),
            "llama-1b" => Some(llama3(2048, 8192, 16, true)),
            "llama-8b" => Some(llama3(4096, 14_336, 32, false)),
            "qwen2.5-3b" => Some(SynthSpec {
                vocab: 151_936,
                hidden: 2048,
                intermediate: 11_008,
                layers: 36,
                heads: 16,
                kv_heads: 2,
                context: 8192,
                rope_theta: 1_000_000.0,
                tied: true,
                qkv_bias: true,
                qk_norm: false,
                fused: false,
                gemma2: false,
                gemma3: false,
                longrope: false,
                seed: 1,
            }),
            _ => None,
        }
    }

    /// Parameters (weights, norms and biases).
    pub fn parameters(&self) -> usize {
        self.tensors().iter().map(|t| t.shape.iter().product::<usize>()).sum()
    }

    /// Per-head dimension.
    pub fn head_dim(&self) -> usize {
        self.hidden.checked_div(self.heads).unwrap_or(0)
    }

    /// Architecture name: `gemma2` with its block, `phi3` with fused matrices, `qwen3` with
    /// Q/K norms, `qwen2` with biases, else `llama`.
    pub fn arch(&self) -> &'static str {
        if self.gemma2 {
            return "gemma2";
        }
        if self.gemma3 {
            return "gemma3";
        }
        match (self.fused, self.qk_norm, self.qkv_bias) {
            (true, ..) => "phi3",
            (false, true, _) => "qwen3",
            (false, false, true) => "qwen2",
            (false, false, false) => "llama",
        }
    }

    /// The configuration as the Hugging Face loader reads it (RoPE in halves).
    pub fn config(&self) -> LlamaConfig {
        LlamaConfig {
            arch: self.arch().into(),
            vocab_size: self.vocab,
            hidden: self.hidden,
            intermediate: self.intermediate,
            layers: self.layers,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim(),
            rope_dims: self.head_dim(),
            rope_theta: self.rope_theta,
            rope_scaling: self.longrope.then(|| {
                let (context, original) = (self.context as f64, LONGROPE_ORIGINAL_CONTEXT as f64);
                let attn_factor = (1.0 + (context / original).ln() / original.ln()).sqrt() as f32;
                RopeScaling::LongRope { attn_factor, long: true }
            }),
            rope_style: RopeStyle::Halves,
            rms_eps: RMS_EPS,
            context_length: self.context,
            tied_embeddings: self.tied,
            gemma: self.gemma().then(|| Gemma {
                sliding_window: GEMMA2_SLIDING_WINDOW,
                global_every: 2,
                local_rope_theta: if self.gemma3 {
                    GEMMA3_LOCAL_ROPE_THETA
                } else {
                    self.rope_theta
                },
                query_scale: 1.0 / (self.head_dim() as f32).sqrt(),
                final_softcap: self.gemma2.then_some(GEMMA2_FINAL_SOFTCAP),
                attn_softcap: self.gemma2.then_some(GEMMA2_ATTN_SOFTCAP),
                qk_norm: self.gemma3,
                local_rope_scaled: self.gemma2,
            }),
        }
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(EngineError::Unsupported(format!("synthetic spec: {m}")));
        let dims = [self.vocab, self.hidden, self.intermediate, self.layers, self.context];
        if dims.contains(&0) || self.heads == 0 || self.kv_heads == 0 {
            return bad(format!("zero-sized dimension in {self:?}"));
        }
        if !self.hidden.is_multiple_of(self.heads) || !self.head_dim().is_multiple_of(2) {
            return bad(format!(
                "hidden {} is not an even head dim times {} heads",
                self.hidden, self.heads
            ));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads not a multiple of {} kv heads",
                self.heads, self.kv_heads
            ));
        }
        if self.vocab < tokenizer_token_count() {
            return bad(format!(
                "vocab {} is smaller than the tokenizer's {} tokens",
                self.vocab,
                tokenizer_token_count()
            ));
        }
        if !self.rope_theta.is_finite() || self.rope_theta <= 0.0 {
            return bad(format!("rope_theta {}", self.rope_theta));
        }
        if self.gemma2 && (!self.tied || self.fused || self.qkv_bias || self.qk_norm || self.gemma3)
        {
            return bad("gemma2 ties its embeddings and has no fused matrices, biases or Q/K \
                        norms"
                .into());
        }
        if self.longrope && (!self.fused || self.context <= LONGROPE_ORIGINAL_CONTEXT) {
            return bad(format!(
                "LongRoPE is Phi-3's (fused matrices) with a context past {LONGROPE_ORIGINAL_CONTEXT}"
            ));
        }
        if self.gemma3 && (!self.tied || self.fused || self.qkv_bias || !self.qk_norm) {
            return bad("gemma3 ties its embeddings, has Q/K norms and no fused matrices or \
                        biases"
                .into());
        }
        Ok(())
    }

    /// Whether the block is Gemma 2's or 3's.
    pub fn gemma(&self) -> bool {
        self.gemma2 || self.gemma3
    }

    /// Every tensor, in file order, named both ways.
    fn tensors(&self) -> Vec<SynthTensor> {
        let (hf, gguf) = (if self.gemma() { hf_gemma_names() } else { hf_names() }, gguf_names());
        let (q_dim, kv_dim) = (self.heads * self.head_dim(), self.kv_heads * self.head_dim());
        let mut out = vec![SynthTensor::new(&hf.embed, &gguf.embed, &[self.vocab, self.hidden])];
        for i in 0..self.layers {
            let t = |role: &str, shape: &[usize]| {
                SynthTensor::new(&(hf.layer)(i, role), &(gguf.layer)(i, role), shape)
            };
            let rope = |mut t: SynthTensor, heads: usize| {
                t.rope_heads = Some(heads);
                t
            };
            out.push(t("attn_norm", &[self.hidden]));
            if self.fused {
                out.push(t("qkv", &[q_dim + 2 * kv_dim, self.hidden]));
            } else {
                out.push(rope(t("q", &[q_dim, self.hidden]), self.heads));
                out.push(rope(t("k", &[kv_dim, self.hidden]), self.kv_heads));
                out.push(t("v", &[kv_dim, self.hidden]));
            }
            if self.qkv_bias {
                out.push(rope(t("q_bias", &[q_dim]), self.heads));
                out.push(rope(t("k_bias", &[kv_dim]), self.kv_heads));
                out.push(t("v_bias", &[kv_dim]));
            }
            if self.qk_norm {
                out.push(t("q_norm", &[self.head_dim()]));
                out.push(t("k_norm", &[self.head_dim()]));
            }
            out.push(t("o", &[self.hidden, q_dim]));
            if self.gemma() {
                out.push(t("post_attn_norm", &[self.hidden]));
            }
            out.push(t("ffn_norm", &[self.hidden]));
            if self.fused {
                out.push(t("gate_up", &[2 * self.intermediate, self.hidden]));
            } else {
                out.push(t("gate", &[self.intermediate, self.hidden]));
                out.push(t("up", &[self.intermediate, self.hidden]));
            }
            out.push(t("down", &[self.hidden, self.intermediate]));
            if self.gemma() {
                out.push(t("post_ffn_norm", &[self.hidden]));
            }
        }
        out.push(SynthTensor::new(&hf.norm, &gguf.norm, &[self.hidden]));
        if !self.tied {
            out.push(SynthTensor::new(&hf.output, &gguf.output, &[self.vocab, self.hidden]));
        }
        out
    }

    /// The values of one tensor in Hugging Face layout.
    fn values(&self, t: &SynthTensor) -> Vec<f32> {
        let key = splitmix64(self.seed ^ fnv1a(&t.hf));
        let n: usize = t.shape.iter().product();
        let (center, std) = match t.kind() {
            Kind::Norm => (1.0, 0.1),
            Kind::Bias => (0.0, 0.2),
            // Keeps activations of order one at any width (about 0.02 for 2048 columns).
            Kind::Matrix => (0.0, 1.0 / (t.shape[1] as f32).sqrt()),
        };
        let mut out = vec![0f32; n];
        par_chunks_mut(&mut out, 1 << 16, |chunk, part| {
            let base = chunk << 16;
            for (j, v) in part.iter_mut().enumerate() {
                let h = splitmix64(key.wrapping_add(((base + j) as u64).wrapping_mul(GOLDEN)));
                *v = center + std * approx_normal(h);
            }
        });
        out
    }
}

/// One tensor of a synthetic model.
struct SynthTensor {
    hf: String,
    gguf: String,
    /// Outer-first.
    shape: Vec<usize>,
    /// Heads whose rows are permuted for interleaved RoPE (Q and K and their biases).
    rope_heads: Option<usize>,
}

enum Kind {
    Matrix,
    Norm,
    Bias,
}

impl SynthTensor {
    fn new(hf: &str, gguf: &str, shape: &[usize]) -> SynthTensor {
        SynthTensor { hf: hf.into(), gguf: gguf.into(), shape: shape.to_vec(), rope_heads: None }
    }

    fn kind(&self) -> Kind {
        match (self.shape.len(), self.hf.ends_with(".bias")) {
            (2, _) => Kind::Matrix,
            (_, true) => Kind::Bias,
            _ => Kind::Norm,
        }
    }

    /// Encodes `values` as `ty`, row by row, on all cores.
    fn encode(&self, ty: GgmlType, values: &[f32]) -> Result<Vec<u8>> {
        let cols = self.shape.last().copied().unwrap_or(1);
        let row_bytes = ty.row_bytes(cols).ok_or_else(|| {
            EngineError::Unsupported(format!(
                "tensor {}: rows of {cols} are not whole {} blocks of {}",
                self.hf,
                ty.name(),
                ty.block_elems()
            ))
        })?;
        let rows_per_chunk = ((1 << 16) / cols).max(1);
        let mut out = vec![0u8; values.len() / cols * row_bytes];
        par_chunks_mut(&mut out, rows_per_chunk * row_bytes, |chunk, part| {
            let first = chunk * rows_per_chunk;
            for (r, dst) in part.chunks_exact_mut(row_bytes).enumerate() {
                let src = &values[(first + r) * cols..(first + r + 1) * cols];
                dst.copy_from_slice(&quantize_row(ty, src));
            }
        });
        Ok(out)
    }
}

/// llama.cpp's HF-to-GGUF reordering of Q/K rows: within each head, Hugging Face row
/// `half * hd/2 + i` (rotated with its partner in the other half) becomes row `2 i + half`
/// (rotated with its neighbour), so interleaved RoPE computes the same model.
pub(crate) fn permute_for_interleaved_rope(values: &[f32], heads: usize, cols: usize) -> Vec<f32> {
    reorder_rope_rows(values, heads, cols, false)
}

/// [`permute_for_interleaved_rope`], or with `back` its inverse (llama.cpp's row order to
/// Hugging Face's).
pub(crate) fn reorder_rope_rows(values: &[f32], heads: usize, cols: usize, back: bool) -> Vec<f32> {
    let hd = values.len() / cols / heads;
    let mut out = vec![0f32; values.len()];
    for h in 0..heads {
        for i in 0..hd / 2 {
            for half in 0..2 {
                let hf = (h * hd + half * hd / 2 + i) * cols;
                let gguf = (h * hd + 2 * i + half) * cols;
                let (src, dst) = if back { (gguf, hf) } else { (hf, gguf) };
                out[dst..dst + cols].copy_from_slice(&values[src..src + cols]);
            }
        }
    }
    out
}

const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

/// SplitMix64's output function: a well-mixed 64-bit hash of a counter.
fn splitmix64(x: u64) -> u64 {
    let mut z = x.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// FNV-1a, a hash that is stable across runs and platforms (unlike `std`'s).
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3))
}

/// A roughly standard normal value: the Irwin-Hall sum of the hash's four 16-bit uniforms,
/// centred and scaled to unit variance (bounded tails, which suits quantizers).
fn approx_normal(h: u64) -> f32 {
    let sum: u32 = (0..4).map(|k| ((h >> (16 * k)) & 0xFFFF) as u32).sum();
    ((sum as f32 + 2.0) / 65_536.0 - 2.0) * 3f32.sqrt()
}

/// Runs `f(chunk index, chunk)` over `out` split into `chunk`-sized pieces, on all cores
/// when there is more than one piece.
fn par_chunks_mut<T: Send>(out: &mut [T], chunk: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let chunk = chunk.max(1);
    let pieces = out.len().div_ceil(chunk);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(pieces);
    if threads <= 1 {
        out.chunks_mut(chunk).enumerate().for_each(|(i, c)| f(i, c));
        return;
    }
    let per_thread = pieces.div_ceil(threads);
    std::thread::scope(|s| {
        for (t, run) in out.chunks_mut(per_thread * chunk).enumerate() {
            let f = &f;
            s.spawn(move || {
                for (j, c) in run.chunks_mut(chunk).enumerate() {
                    f(t * per_thread + j, c);
                }
            });
        }
    });
}

/// Writes `spec` as a GGUF file with matrices in `ty` (norms and biases stay F32), the
/// `{arch}.*` hyper-parameters `gguf_config` reads and a byte-level BPE tokenizer.
pub fn write_gguf(spec: &SynthSpec, ty: GgmlType, path: &Path) -> Result<()> {
    write_gguf_with_vocabulary(spec, ty, &SynthVocabulary::new(spec.vocab), path)
}

/// [`write_gguf`] with another tokenizer (e.g. [`SynthVocabulary::probe`]), which must have
/// `spec.vocab` tokens.
pub fn write_gguf_with_vocabulary(
    spec: &SynthSpec,
    ty: GgmlType,
    vocabulary: &SynthVocabulary,
    path: &Path,
) -> Result<()> {
    spec.validate()?;
    if vocabulary.len() != spec.vocab {
        return Err(EngineError::Unsupported(format!(
            "a tokenizer of {} tokens for a model of {}",
            vocabulary.len(),
            spec.vocab
        )));
    }
    let arch = spec.arch();
    let mut w = GgufWriter::new();
    let u = |v: usize| MetaValue::U64(v as u64);
    let key = |k: &str| format!("{arch}.{k}");
    w.meta("general.architecture", MetaValue::String(arch.into()))
        .meta("general.name", MetaValue::String("sluice synthetic".into()))
        .meta(&key("vocab_size"), u(spec.vocab))
        .meta(&key("context_length"), u(spec.context))
        .meta(&key("embedding_length"), u(spec.hidden))
        .meta(&key("feed_forward_length"), u(spec.intermediate))
        .meta(&key("block_count"), u(spec.layers))
        .meta(&key("attention.head_count"), u(spec.heads))
        .meta(&key("attention.head_count_kv"), u(spec.kv_heads))
        .meta(&key("attention.key_length"), u(spec.head_dim()))
        .meta(&key("attention.value_length"), u(spec.head_dim()))
        .meta(&key("attention.layer_norm_rms_epsilon"), MetaValue::F64(f64::from(RMS_EPS)))
        .meta(&key("rope.dimension_count"), u(spec.head_dim()))
        .meta(&key("rope.freq_base"), MetaValue::F64(f64::from(spec.rope_theta)));

    if spec.gemma2 {
        w.meta(&key("attention.sliding_window"), u(GEMMA2_SLIDING_WINDOW))
            .meta(&key("attn_logit_softcapping"), MetaValue::F64(f64::from(GEMMA2_ATTN_SOFTCAP)))
            .meta(&key("final_logit_softcapping"), MetaValue::F64(f64::from(GEMMA2_FINAL_SOFTCAP)));
    }
    if spec.longrope {
        let (context, original) = (spec.context as f64, LONGROPE_ORIGINAL_CONTEXT as f64);
        let attn_factor = (1.0 + (context / original).ln() / original.ln()).sqrt();
        w.meta(&key("rope.scaling.original_context_length"), u(LONGROPE_ORIGINAL_CONTEXT))
            .meta(&key("rope.scaling.attn_factor"), MetaValue::F64(attn_factor));
        let half = spec.head_dim() / 2;
        let (long, short) = longrope_factors(half);
        for (name, factors) in
            [("rope_factors_long.weight", long), ("rope_factors_short.weight", short)]
        {
            w.tensor(name, &[half], GgmlType::F32, quantize_row(GgmlType::F32, &factors));
        }
    }
    if spec.gemma3 {
        w.meta(&key("attention.sliding_window"), u(GEMMA2_SLIDING_WINDOW))
            .meta(&key("attention.sliding_window_pattern"), u(2))
            .meta(&key("rope.freq_base_swa"), MetaValue::F64(f64::from(GEMMA3_LOCAL_ROPE_THETA)));
    }
    vocabulary.write_gguf_meta(&mut w);

    // llama.cpp's qwen2 uses NeoX (halves) RoPE and its converter leaves Q and K alone.
    let permute = arch == "llama";
    for t in spec.tensors() {
        let mut values = spec.values(&t);
        let cols = if t.shape.len() == 2 { t.shape[1] } else { 1 };
        if let (true, Some(heads)) = (permute, t.rope_heads) {
            values = permute_for_interleaved_rope(&values, heads, cols);
        }
        let (ty, bytes) = match t.kind() {
            Kind::Matrix => (ty, t.encode(ty, &values)?),
            Kind::Norm | Kind::Bias => (GgmlType::F32, quantize_row(GgmlType::F32, &values)),
        };
        let dims: Vec<usize> = t.shape.iter().rev().copied().collect();
        w.tensor(&t.gguf, &dims, ty, bytes);
    }
    Ok(w.write(path)?)
}

/// Writes `spec` as a Hugging Face directory: `config.json`, weights in `ty` (F32, F16 or
/// BF16) as `model.safetensors` or, when `shards > 1`, that many shards and an index,
/// `tokenizer.json` (the GGUF tokenizer's equivalent) and `tokenizer_config.json`.
pub fn write_safetensors_dir(
    spec: &SynthSpec,
    ty: GgmlType,
    dir: &Path,
    shards: usize,
) -> Result<()> {
    spec.validate()?;
    let dtype = match ty {
        GgmlType::F32 => "float32",
        GgmlType::F16 => "float16",
        GgmlType::BF16 => "bfloat16",
        other => {
            return Err(EngineError::Unsupported(format!(
                "safetensors checkpoints hold F32, F16 or BF16, not {}",
                other.name()
            )));
        }
    };
    std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    let v = SynthVocabulary::new(spec.vocab);
    let model_type = spec.arch();
    let hf_arch = match model_type {
        "phi3" => "Phi3ForCausalLM",
        "qwen3" => "Qwen3ForCausalLM",
        "qwen2" => "Qwen2ForCausalLM",
        "gemma2" => "Gemma2ForCausalLM",
        "gemma3" => "Gemma3ForCausalLM",
        _ => "LlamaForCausalLM",
    };
    let mut config = json!({
        "architectures": [hf_arch],
        "model_type": model_type,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim(),
        "hidden_act": "silu",
        "attention_bias": spec.qkv_bias,
        "max_position_embeddings": spec.context,
        "rms_norm_eps": RMS_EPS,
        "rope_theta": spec.rope_theta,
        "rope_scaling": null,
        "use_sliding_window": false,
        "tie_word_embeddings": spec.tied,
        "vocab_size": spec.vocab,
        "bos_token_id": v.bos(),
        "eos_token_id": v.eos(),
        "torch_dtype": dtype,
    });
    if spec.gemma2 {
        let gemma = json!({
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": spec.head_dim(),
            "sliding_window": GEMMA2_SLIDING_WINDOW,
            "attn_logit_softcapping": GEMMA2_ATTN_SOFTCAP,
            "final_logit_softcapping": GEMMA2_FINAL_SOFTCAP,
        });
        extend(&mut config, gemma);
    }
    if spec.longrope {
        let (long, short) = longrope_factors(spec.head_dim() / 2);
        let scaling = json!({
            "rope_scaling": {"rope_type": "longrope", "long_factor": long, "short_factor": short},
            "original_max_position_embeddings": LONGROPE_ORIGINAL_CONTEXT,
        });
        extend(&mut config, scaling);
    }
    if spec.gemma3 {
        let gemma = json!({
            "model_type": "gemma3_text",
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_activation": "gelu_pytorch_tanh",
            "query_pre_attn_scalar": spec.head_dim(),
            "sliding_window": GEMMA2_SLIDING_WINDOW,
            "layer_types": (0..spec.layers)
                .map(|l| if l % 2 == 0 { "sliding_attention" } else { "full_attention" })
                .collect::<Vec<_>>(),
            "rope_local_base_freq": GEMMA3_LOCAL_ROPE_THETA,
            "attn_logit_softcapping": null,
            "final_logit_softcapping": null,
        });
        extend(&mut config, gemma);
    }
    write_json(&dir.join(CONFIG_FILE), &config)?;
    write_json(&dir.join("tokenizer.json"), &v.tokenizer_json())?;
    write_json(&dir.join("tokenizer_config.json"), &v.tokenizer_config_json(spec.context))?;

    let tensors = spec.tensors();
    let bytes = |t: &SynthTensor| t.shape.iter().product::<usize>() * ty.block_bytes();
    let groups = split_into_shards(&tensors.iter().map(bytes).collect::<Vec<_>>(), shards)?;
    let mut weight_map = serde_json::Map::new();
    for (k, range) in groups.iter().enumerate() {
        let file = if groups.len() == 1 {
            SINGLE_FILE.to_string()
        } else {
            format!("model-{:05}-of-{:05}.safetensors", k + 1, groups.len())
        };
        // One shard in memory at a time.
        let mut encoded = Vec::with_capacity(range.len());
        for t in &tensors[range.clone()] {
            let mut values = spec.values(t);
            // Gemma's checkpoints hold each norm weight less one (see `add_one_to_norms`).
            if spec.gemma() && matches!(t.kind(), Kind::Norm) {
                values.iter_mut().for_each(|v| *v -= 1.0);
            }
            encoded.push((t.hf.clone(), ty, t.shape.clone(), t.encode(ty, &values)?));
            weight_map.insert(t.hf.clone(), json!(file));
        }
        write_safetensors(&dir.join(&file), &encoded)?;
    }
    if groups.len() > 1 {
        let total: usize = tensors.iter().map(bytes).sum();
        let index = json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
        write_json(&dir.join(INDEX_FILE), &index)?;
    }
    Ok(())
}

/// A synthetic LongRoPE model's long and short factors for `half` rotated pairs.
fn longrope_factors(half: usize) -> (Vec<f32>, Vec<f32>) {
    let f = |step: f32| (0..half).map(|i| 1.0 + step * i as f32).collect();
    (f(0.25), f(0.05))
}

/// Splits tensors of the given sizes, in order, into `shards` non-empty runs of roughly
/// equal bytes.
fn split_into_shards(sizes: &[usize], shards: usize) -> Result<Vec<std::ops::Range<usize>>> {
    let shards = shards.max(1);
    if shards > sizes.len() {
        return Err(EngineError::Unsupported(format!(
            "cannot split {} tensors into {shards} shards",
            sizes.len()
        )));
    }
    let total: usize = sizes.iter().sum();
    let mut runs = Vec::with_capacity(shards);
    let (mut start, mut acc) = (0, 0);
    for k in 0..shards {
        let target = total / shards * (k + 1);
        let mut end = start + 1;
        acc += sizes[start];
        // Leave at least one tensor for each later shard.
        while end < sizes.len() - (shards - 1 - k) && (acc < target || k + 1 == shards) {
            acc += sizes[end];
            end += 1;
        }
        runs.push(start..end);
        start = end;
    }
    Ok(runs)
}

/// Adds (or replaces) the fields of the object `more` in the object `config`.
fn extend(config: &mut serde_json::Value, more: serde_json::Value) {
    if let (Some(c), serde_json::Value::Object(m)) = (config.as_object_mut(), more) {
        c.extend(m);
    }
}

fn write_json(path: &Path, value: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_vec_pretty(value)
        .map_err(|e| EngineError::format(path, format!("serialize: {e}")))?;
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

/// A synthetic LoRA adapter for a base model: random `A` and `B` (not PEFT's zero `B`, so the
/// adapter changes the model from the first token), every value a pure function of (seed,
/// tensor name, index).
#[derive(Clone, Debug, PartialEq)]
pub struct SynthLora {
    /// Rank.
    pub rank: usize,
    /// `lora_alpha` (the scale is `alpha / rank`).
    pub alpha: f32,
    /// The projections it updates.
    pub targets: Vec<crate::lora::Target>,
    /// Seed of every value.
    pub seed: u64,
    /// Standard deviation of `B`'s values: how far the adapter moves the model.
    pub b_std: f32,
}

impl SynthLora {
    /// Rank 8, alpha 16, every projection, `B` at 0.02.
    pub fn new(seed: u64) -> SynthLora {
        SynthLora {
            rank: 8,
            alpha: 16.0,
            targets: crate::lora::Target::ALL.to_vec(),
            seed,
            b_std: 0.02,
        }
    }

    /// `(layer, target, A [rank x input], B [output x rank])` in Hugging Face orientation.
    fn updates(&self, base: &LlamaConfig) -> Vec<(usize, crate::lora::Target, Vec<f32>, Vec<f32>)> {
        let mut out = Vec::new();
        for layer in 0..base.layers {
            for &t in &self.targets {
                let (input, output) = t.dims(base);
                let values = |half: &str, n: usize, std: f32| -> Vec<f32> {
                    let key =
                        splitmix64(self.seed ^ fnv1a(&format!("{layer}.{}.{half}", t.peft_name())));
                    (0..n)
                        .map(|j| {
                            let h = splitmix64(key.wrapping_add((j as u64).wrapping_mul(GOLDEN)));
                            std * approx_normal(h)
                        })
                        .collect()
                };
                let a = values("A", self.rank * input, 1.0 / (input as f32).sqrt());
                let b = values("B", output * self.rank, self.b_std);
                out.push((layer, t, a, b));
            }
        }
        out
    }

    /// Writes the adapter as PEFT does: `adapter_config.json` and
    /// `adapter_model.safetensors` (values in `ty`: F32, F16 or BF16) in `dir`.
    pub fn write_peft(&self, base: &LlamaConfig, ty: GgmlType, dir: &Path) -> Result<()> {
        std::fs::create_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
        let config = json!({
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": self.rank,
            "lora_alpha": self.alpha,
            "lora_dropout": 0.0,
            "target_modules": self.targets.iter().map(|t| t.peft_name()).collect::<Vec<_>>(),
            "bias": "none",
            "fan_in_fan_out": false,
            "use_rslora": false,
            "modules_to_save": null,
            "base_model_name_or_path": base.arch,
        });
        let path = dir.join(crate::lora::PEFT_CONFIG_FILE);
        let text = serde_json::to_vec_pretty(&config)
            .map_err(|e| EngineError::format(&path, e.to_string()))?;
        std::fs::write(&path, text).map_err(|e| EngineError::io(&path, e))?;
        let mut tensors = Vec::new();
        for (layer, t, a, b) in self.updates(base) {
            let (input, output) = t.dims(base);
            let block = match t {
                crate::lora::Target::Q
                | crate::lora::Target::K
                | crate::lora::Target::V
                | crate::lora::Target::O => "self_attn",
                _ => "mlp",
            };
            let name = |half: &str| {
                format!(
                    "base_model.model.model.layers.{layer}.{block}.{}.lora_{half}.weight",
                    t.peft_name()
                )
            };
            tensors.push((name("A"), ty, vec![self.rank, input], quantize_row(ty, &a)));
            tensors.push((name("B"), ty, vec![output, self.rank], quantize_row(ty, &b)));
        }
        write_safetensors(&dir.join(crate::lora::PEFT_WEIGHTS_FILE), &tensors)
    }

    /// Writes the adapter as llama.cpp's `convert_lora_to_gguf.py` does for a base of
    /// architecture `arch` (Q and K rows of `B` permuted for interleaved RoPE where that
    /// architecture's converter permutes the base's), values in `ty`.
    pub fn write_gguf(
        &self,
        base: &LlamaConfig,
        arch: &str,
        ty: GgmlType,
        path: &Path,
    ) -> Result<()> {
        let mut w = GgufWriter::new();
        w.meta("general.architecture", MetaValue::String(arch.into()))
            .meta("general.type", MetaValue::String("adapter".into()))
            .meta("general.name", MetaValue::String("sluice synthetic adapter".into()))
            .meta("adapter.type", MetaValue::String("lora".into()))
            .meta("adapter.lora.alpha", MetaValue::F64(f64::from(self.alpha)));
        let permute = matches!(arch, "llama" | "mistral");
        for (layer, t, a, mut b) in self.updates(base) {
            let (input, output) = t.dims(base);
            let heads = match t {
                crate::lora::Target::Q => Some(base.heads),
                crate::lora::Target::K => Some(base.kv_heads),
                _ => None,
            };
            if let (true, Some(heads)) = (permute, heads) {
                b = permute_for_interleaved_rope(&b, heads, self.rank);
            }
            let name = |half: &str| format!("blk.{layer}.{}.weight.lora_{half}", t.gguf_name());
            w.tensor(&name("a"), &[input, self.rank], ty, quantize_row(ty, &a));
            w.tensor(&name("b"), &[self.rank, output], ty, quantize_row(ty, &b));
        }
        Ok(w.write(path)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permutation_matches_llama_cpp_converter() {
        // Two heads of dim 4, one column: HF rows (h, half, i) -> GGUF rows (h, i, half).
        let hf: Vec<f32> = (0..8).map(|r| r as f32).collect();
        assert_eq!(permute_for_interleaved_rope(&hf, 2, 1), [0., 2., 1., 3., 4., 6., 5., 7.]);
    }

    #[test]
    fn values_are_deterministic_and_scaled() {
        let spec = SynthSpec { hidden: 256, intermediate: 512, ..SynthSpec::tiny() };
        let tensors = spec.tensors();
        let t = &tensors[1];
        assert_eq!(t.hf, "model.layers.0.input_layernorm.weight");
        let norm = spec.values(t);
        assert!(norm.iter().all(|x| (0.5..1.5).contains(x)));
        let gate = tensors.iter().find(|t| t.hf.ends_with("0.mlp.gate_proj.weight"));
        let gate = gate.map(|t| spec.values(t)).unwrap_or_default();
        assert_eq!(gate.len(), 512 * 256);
        let var = gate.iter().map(|x| x * x).sum::<f32>() / gate.len() as f32;
        assert!((var * 256.0 - 1.0).abs() < 0.05, "variance x cols {}", var * 256.0);
        let again = SynthSpec { ..spec.clone() };
        assert_eq!(again.values(t), norm);
        let other = SynthSpec { seed: 2, ..spec };
        assert_ne!(other.values(t), norm);
    }

    /// The named shapes are the models they are named after: Llama 3.1 8B has 8.03 billion
    /// parameters, Llama 3.2 1B 1.24 billion and Qwen2.5 3B 3.09 billion (tied embeddings).
    #[test]
    fn named_shapes_have_their_models_sizes() {
        let billions = |name: &str| {
            let spec = SynthSpec::named(name);
            assert!(spec.as_ref().is_some_and(|s| s.validate().is_ok()), "{name}");
            spec.map_or(0.0, |s| s.parameters() as f64 / 1e9)
        };
        assert!((billions("llama-8b") - 8.03).abs() < 0.01, "{}", billions("llama-8b"));
        assert!((billions("llama-1b") - 1.24).abs() < 0.01, "{}", billions("llama-1b"));
        assert!((billions("qwen2.5-3b") - 3.09).abs() < 0.01, "{}", billions("qwen2.5-3b"));
        assert_eq!(SynthSpec::named("tiny"), Some(SynthSpec::tiny()));
        assert!(SynthSpec::NAMES.iter().all(|n| SynthSpec::named(n).is_some()));
        assert_eq!(SynthSpec::named("llama-70b"), None);
    }

    #[test]
    fn shards_are_balanced_and_non_empty() -> Result<()> {
        assert_eq!(split_into_shards(&[10, 10, 10, 10], 2)?, [0..2, 2..4]);
        assert_eq!(split_into_shards(&[100, 1, 1], 3)?, [0..1, 1..2, 2..3]);
        assert_eq!(split_into_shards(&[1, 1, 100], 2)?, [0..2, 2..3]);
        assert_eq!(split_into_shards(&[5, 6], 1)?.first(), Some(&(0..2)));
        assert!(split_into_shards(&[5], 2).is_err());
        Ok(())
    }

    #[test]
    fn specs_are_validated() {
        let bad = [
            SynthSpec { vocab: 100, ..SynthSpec::tiny() },
            SynthSpec { kv_heads: 3, ..SynthSpec::tiny() },
            SynthSpec { heads: 0, ..SynthSpec::tiny() },
        ];
        for spec in bad {
            assert!(spec.validate().is_err(), "{spec:?}");
        }
        let dir = std::env::temp_dir().join("sluice-never-written.gguf");
        let q4k = write_gguf(&SynthSpec::tiny(), GgmlType::Q4K, &dir);
        let msg = q4k.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("Q4_K") && msg.contains("tensor model.embed_tokens.weight"), "{msg}");
    }
}
