//! Llama-family model description and weights (GGUF and safetensors sources), with Gemma 3's
//! departures from the Llama block as options of the same description.

use crate::cpu::matmul::{ActFormat, PackedWeight};
use crate::error::{EngineError, Result};
use crate::quant::{GgmlType, dequantize_row};
use sluice_text::gguf::GgufFile;

/// How rotary embedding pairs dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// Adjacent pairs `(2i, 2i+1)`: GGUF llama files (the converter permutes Q and K).
    Interleaved,
    /// Halves `(i, i + n/2)`: Hugging Face checkpoints and GGUF qwen2 ("NeoX" style).
    Halves,
}

/// How RoPE frequencies are scaled for contexts past the pre-training one.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum RopeScaling {
    /// Llama 3's (`rope_type = "llama3"`).
    Llama3(Llama3Scaling),
    /// Every frequency divided by the factor (`linear`: Gemma 3 4B and larger, whose sliding
    /// layers keep their own unscaled base).
    Linear(f32),
    /// LongRoPE (Phi-3.5, Phi-4 mini): per-dimension factors from the file (its long ones
    /// when the context exceeds the pre-training one, as llama.cpp chooses them), and cosines
    /// and sines scaled by `attn_factor`, which scales every score by its square.
    LongRope {
        /// Factor on each rotated query and key (`rope.scaling.attn_factor`).
        attn_factor: f32,
        /// Whether the long factors apply (else the short ones).
        long: bool,
    },
}

/// Llama-3 style frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Llama3Scaling {
    /// Overall scale factor.
    pub factor: f32,
    /// Wavelengths longer than `original / low_freq_factor` are scaled fully.
    pub low_freq_factor: f32,
    /// Wavelengths shorter than `original / high_freq_factor` are left alone.
    pub high_freq_factor: f32,
    /// The context length the model was pre-trained with.
    pub original_max_position: f32,
}

/// What a Gemma 2 or 3 block does beyond a Llama one: the embedding scaled by `sqrt(hidden)`,
/// norms after attention and after the FFN (before each residual add), a tanh-approximated
/// GELU gate, and layers that attend over a sliding window between the global ones. Gemma 3
/// adds RMSNorm over each query and key head before RoPE and its own RoPE base for the sliding
/// layers; Gemma 2 instead caps attention scores (`cap * tanh(score / cap)`).
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma {
    /// Tokens a sliding-window layer attends to, its own included.
    pub sliding_window: usize,
    /// Every `global_every`-th layer (the last of each run) attends over the whole context;
    /// the others slide (all of them when 0).
    pub global_every: usize,
    /// RoPE base frequency of the sliding layers (the global ones use `rope_theta`).
    pub local_rope_theta: f32,
    /// Factor on the queries (Gemma's `query_pre_attn_scalar`^-1/2) in place of
    /// `1/sqrt(head_dim)`.
    pub query_scale: f32,
    /// `cap * tanh(logits / cap)` on the output, when set.
    pub final_softcap: Option<f32>,
    /// `cap * tanh(score / cap)` on each scaled attention score, when set (Gemma 2).
    pub attn_softcap: Option<f32>,
    /// RMSNorm over each query and key head before RoPE (Gemma 3).
    pub qk_norm: bool,
    /// Whether the sliding layers' RoPE takes the model's frequency scaling too (Gemma 2; Gemma
    /// 3's sliding layers keep their base unscaled).
    pub local_rope_scaled: bool,
}

impl Gemma {
    /// Whether layer `i` attends over a sliding window.
    pub fn slides(&self, layer: usize) -> bool {
        self.global_every == 0 || layer % self.global_every < self.global_every - 1
    }
}

/// Architecture hyper-parameters.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Architecture name as the file states it (`llama`, `mistral`, `qwen2`, `qwen3`,
    /// `phi3`, `gemma2`, `gemma3`).
    pub arch: String,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Hidden size.
    pub hidden: usize,
    /// Feed-forward inner size.
    pub intermediate: usize,
    /// Number of transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (GQA when fewer than `heads`).
    pub kv_heads: usize,
    /// Per-head dimension.
    pub head_dim: usize,
    /// Dimensions of each head that are rotated.
    pub rope_dims: usize,
    /// RoPE base frequency.
    pub rope_theta: f32,
    /// Optional frequency scaling.
    pub rope_scaling: Option<RopeScaling>,
    /// Pairing of rotated dimensions.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// Maximum context length.
    pub context_length: usize,
    /// Whether the output projection reuses the embedding.
    pub tied_embeddings: bool,
    /// Gemma 2's or 3's block, when the model is one.
    pub gemma: Option<Gemma>,
}

impl LlamaConfig {
    /// The oldest position that token `pos` of layer `layer` attends to.
    pub fn first_visible(&self, layer: usize, pos: usize) -> usize {
        match &self.gemma {
            Some(g) if g.slides(layer) => (pos + 1).saturating_sub(g.sliding_window),
            _ => 0,
        }
    }

    /// The factor on attention scores.
    pub fn attention_scale(&self) -> f32 {
        let base = match &self.gemma {
            Some(g) => g.query_scale,
            None => 1.0 / (self.head_dim as f32).sqrt(),
        };
        // Every dimension is rotated (checked at load), so scaling the rotation's cosines and
        // sines by `m` scales each score by m squared.
        match self.rope_scaling {
            Some(RopeScaling::LongRope { attn_factor, .. }) => base * attn_factor * attn_factor,
            _ => base,
        }
    }

    /// Whether every layer normalizes each query and key head (RMSNorm) before RoPE:
    /// Gemma 3 and Qwen3.
    pub fn has_qk_norm(&self) -> bool {
        self.gemma.as_ref().is_some_and(|g| g.qk_norm) || self.arch == "qwen3"
    }

    /// The cap on attention scores (Gemma 2), when there is one.
    pub fn attention_softcap(&self) -> Option<f32> {
        self.gemma.as_ref().and_then(|g| g.attn_softcap)
    }

    /// Width of the K and V projections.
    pub fn kv_dim(&self) -> usize {
        self.kv_heads * self.head_dim
    }

    /// Width of the Q projection.
    pub fn q_dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Inverse frequencies for each rotated pair, with scaling applied.
    pub fn inv_freq(&self, freq_factors: Option<&[f32]>) -> Vec<f32> {
        let n = self.rope_dims;
        (0..n / 2)
            .map(|i| {
                let base = self.rope_theta.powf(-((2 * i) as f32) / n as f32);
                // A file's own factors (llama.cpp's Llama 3 files) stand for Llama 3's scaling.
                match (freq_factors, self.rope_scaling) {
                    (Some(ff), Some(RopeScaling::Linear(f))) => {
                        base / ff.get(i).copied().unwrap_or(1.0) / f
                    }
                    (Some(ff), _) => base / ff.get(i).copied().unwrap_or(1.0),
                    (None, Some(RopeScaling::Llama3(s))) => llama3_scale(base, s),
                    (None, Some(RopeScaling::Linear(f))) => base / f,
                    // Its factors are required at load; without them, the base.
                    (None, Some(RopeScaling::LongRope { .. })) => base,
                    (None, None) => base,
                }
            })
            .collect()
    }

    fn validate(&self, what: &str) -> Result<()> {
        let bad = |m: String| Err(EngineError::Unsupported(format!("{what}: {m}")));
        if self.hidden == 0 || self.layers == 0 || self.heads == 0 || self.vocab_size == 0 {
            return bad("zero-sized dimension in the configuration".into());
        }
        if self.kv_heads == 0 || !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} heads not a multiple of {} kv heads",
                self.heads, self.kv_heads
            ));
        }
        if self.rope_dims > self.head_dim || !self.rope_dims.is_multiple_of(2) {
            return bad(format!("rope dimension {} vs head dim {}", self.rope_dims, self.head_dim));
        }
        if ![self.hidden, self.intermediate, self.q_dim()].iter().all(|d| d.is_multiple_of(32)) {
            return bad("hidden, intermediate and q sizes must be multiples of 32".into());
        }
        if let Some(g) = &self.gemma
            && g.sliding_window == 0
        {
            return bad("sliding window of 0 tokens".into());
        }
        Ok(())
    }
}

fn llama3_scale(inv_freq: f32, s: Llama3Scaling) -> f32 {
    let wavelen = 2.0 * std::f32::consts::PI / inv_freq;
    let low_wavelen = s.original_max_position / s.low_freq_factor;
    let high_wavelen = s.original_max_position / s.high_freq_factor;
    if wavelen < high_wavelen {
        inv_freq
    } else if wavelen > low_wavelen {
        inv_freq / s.factor
    } else {
        let smooth = (s.original_max_position / wavelen - s.low_freq_factor)
            / (s.high_freq_factor - s.low_freq_factor);
        (1.0 - smooth) * inv_freq / s.factor + smooth * inv_freq
    }
}

/// One transformer block's weights.
#[derive(Debug)]
pub struct LayerWeights {
    /// Pre-attention RMSNorm scale.
    pub attn_norm: Vec<f32>,
    /// Query projection.
    pub wq: PackedWeight,
    /// Key projection.
    pub wk: PackedWeight,
    /// Value projection.
    pub wv: PackedWeight,
    /// Optional Q/K/V biases (Qwen2).
    pub bq: Option<Vec<f32>>,
    /// Key bias.
    pub bk: Option<Vec<f32>>,
    /// Value bias.
    pub bv: Option<Vec<f32>>,
    /// Attention output projection.
    pub wo: PackedWeight,
    /// Pre-FFN RMSNorm scale.
    pub ffn_norm: Vec<f32>,
    /// Gate projection.
    pub w_gate: PackedWeight,
    /// Up projection.
    pub w_up: PackedWeight,
    /// Down projection.
    pub w_down: PackedWeight,
    /// Per-head RMSNorm scales of the queries and keys, `head_dim` each (Gemma 3, Qwen3).
    pub q_norm: Option<Vec<f32>>,
    /// Key head norm.
    pub k_norm: Option<Vec<f32>>,
    /// RMSNorm of the attention output before the residual add (Gemma 3).
    pub post_attn_norm: Option<Vec<f32>>,
    /// RMSNorm of the FFN output before the residual add (Gemma 3).
    pub post_ffn_norm: Option<Vec<f32>>,
}

/// All weights of a Llama-family model, in compute layout.
#[derive(Debug)]
pub struct LlamaWeights {
    /// Hyper-parameters.
    pub config: LlamaConfig,
    /// Token embedding, `vocab x hidden`.
    pub embed: PackedWeight,
    /// Output projection; `None` when tied to the embedding.
    pub output: Option<PackedWeight>,
    /// Final RMSNorm scale.
    pub norm: Vec<f32>,
    /// Transformer blocks.
    pub layers: Vec<LayerWeights>,
    /// Rotary inverse frequencies.
    pub inv_freq: Vec<f32>,
    /// Those of the sliding-window layers, when they have their own (Gemma 2 and 3).
    pub local_inv_freq: Option<Vec<f32>>,
}

impl LlamaWeights {
    /// The output projection (the embedding when tied).
    pub fn lm_head(&self) -> &PackedWeight {
        self.output.as_ref().unwrap_or(&self.embed)
    }

    /// The rotary inverse frequencies of layer `layer`.
    pub fn layer_inv_freq(&self, layer: usize) -> &[f32] {
        match (&self.local_inv_freq, &self.config.gemma) {
            (Some(local), Some(g)) if g.slides(layer) => local,
            _ => &self.inv_freq,
        }
    }

    /// Bytes held by the weights.
    pub fn memory_bytes(&self) -> usize {
        let mut n =
            self.embed.memory_bytes() + self.output.as_ref().map_or(0, |o| o.memory_bytes());
        for l in &self.layers {
            for w in [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down] {
                n += w.memory_bytes();
            }
        }
        n
    }
}

/// A source of named tensors with shapes (rows, cols), whatever the file format.
pub trait TensorSource {
    /// The file, for messages.
    fn describe(&self) -> String;
    /// Type, shape (outer-first: rows then cols; 1-D tensors have rows = 1) and bytes.
    fn tensor(&self, name: &str) -> Option<(GgmlType, Vec<usize>, &[u8])>;
}

fn get_matrix(
    src: &dyn TensorSource,
    name: &str,
    rows: usize,
    cols: usize,
) -> Result<PackedWeight> {
    let [w] = get_matrices(src, name, [rows], cols)?;
    Ok(w)
}

/// A matrix stored as `N` stacked along its rows (Phi-3's fused projections; `N` = 1 for any
/// other), each part repacked on its own.
fn get_matrices<const N: usize>(
    src: &dyn TensorSource,
    name: &str,
    rows: [usize; N],
    cols: usize,
) -> Result<[PackedWeight; N]> {
    let total: usize = rows.iter().sum();
    let (ty, shape, bytes) = src
        .tensor(name)
        .ok_or_else(|| EngineError::format(src.describe(), format!("missing tensor {name}")))?;
    if shape != [total, cols] {
        return Err(EngineError::format(
            src.describe(),
            format!("tensor {name}: shape {shape:?}, expected [{total}, {cols}]"),
        ));
    }
    let row_bytes = ty.row_bytes(cols);
    if row_bytes.map(|b| b * total) != Some(bytes.len()) {
        return Err(EngineError::format(src.describe(), format!("tensor {name}: wrong byte size")));
    }
    let row_bytes = row_bytes.unwrap_or(0);
    let mut at = 0;
    Ok(rows.map(|r| {
        let part = &bytes[at * row_bytes..(at + r) * row_bytes];
        at += r;
        PackedWeight::new(ty, r, cols, part)
    }))
}

fn get_vector(src: &dyn TensorSource, name: &str, n: usize) -> Result<Option<Vec<f32>>> {
    let Some((ty, shape, bytes)) = src.tensor(name) else { return Ok(None) };
    let elems: usize = shape.iter().product();
    if elems != n || ty.row_bytes(n) != Some(bytes.len()) {
        return Err(EngineError::format(
            src.describe(),
            format!("tensor {name}: shape {shape:?}, expected {n} elements"),
        ));
    }
    let mut v = vec![0f32; n];
    dequantize_row(ty, bytes, &mut v);
    Ok(Some(v))
}

fn require_vector(src: &dyn TensorSource, name: &str, n: usize) -> Result<Vec<f32>> {
    get_vector(src, name, n)?
        .ok_or_else(|| EngineError::format(src.describe(), format!("missing tensor {name}")))
}

/// Tensor names of one architecture family's file format.
pub struct TensorNames {
    /// Embedding.
    pub embed: String,
    /// Final norm.
    pub norm: String,
    /// Output projection.
    pub output: String,
    /// Per-layer name for a role such as `q`, `k_bias`, `gate`.
    pub layer: fn(usize, &str) -> String,
}

/// GGUF (llama.cpp) tensor names.
pub fn gguf_names() -> TensorNames {
    TensorNames {
        embed: "token_embd.weight".into(),
        norm: "output_norm.weight".into(),
        output: "output.weight".into(),
        layer: |i, role| {
            let n = match role {
                "attn_norm" => "attn_norm.weight",
                "q" => "attn_q.weight",
                "k" => "attn_k.weight",
                "v" => "attn_v.weight",
                "q_bias" => "attn_q.bias",
                "k_bias" => "attn_k.bias",
                "v_bias" => "attn_v.bias",
                "o" => "attn_output.weight",
                "ffn_norm" => "ffn_norm.weight",
                "q_norm" => "attn_q_norm.weight",
                "k_norm" => "attn_k_norm.weight",
                "post_attn_norm" => "post_attention_norm.weight",
                "post_ffn_norm" => "post_ffw_norm.weight",
                "gate" => "ffn_gate.weight",
                // Phi-3 keeps gate and up in one tensor under the up projection's name.
                "up" | "gate_up" => "ffn_up.weight",
                "qkv" => "attn_qkv.weight",
                _ => "ffn_down.weight",
            };
            format!("blk.{i}.{n}")
        },
    }
}

/// Hugging Face tensor names.
pub fn hf_names() -> TensorNames {
    TensorNames {
        embed: "model.embed_tokens.weight".into(),
        norm: "model.norm.weight".into(),
        output: "lm_head.weight".into(),
        layer: |i, role| {
            let n = match role {
                "attn_norm" => "input_layernorm.weight",
                "q" => "self_attn.q_proj.weight",
                "k" => "self_attn.k_proj.weight",
                "v" => "self_attn.v_proj.weight",
                "q_bias" => "self_attn.q_proj.bias",
                "k_bias" => "self_attn.k_proj.bias",
                "v_bias" => "self_attn.v_proj.bias",
                "o" => "self_attn.o_proj.weight",
                "ffn_norm" => "post_attention_layernorm.weight",
                "q_norm" => "self_attn.q_norm.weight",
                "k_norm" => "self_attn.k_norm.weight",
                "gate" => "mlp.gate_proj.weight",
                "up" => "mlp.up_proj.weight",
                "gate_up" => "mlp.gate_up_proj.weight",
                "qkv" => "self_attn.qkv_proj.weight",
                _ => "mlp.down_proj.weight",
            };
            format!("model.layers.{i}.{n}")
        },
    }
}

/// Hugging Face's names for a Gemma 2 checkpoint: as [`hf_names`], but its
/// `post_attention_layernorm` follows attention, and the FFN has norms before and after.
pub fn hf_gemma_names() -> TensorNames {
    TensorNames {
        layer: |i, role| match role {
            "post_attn_norm" => format!("model.layers.{i}.post_attention_layernorm.weight"),
            "ffn_norm" => format!("model.layers.{i}.pre_feedforward_layernorm.weight"),
            "post_ffn_norm" => format!("model.layers.{i}.post_feedforward_layernorm.weight"),
            other => (hf_names().layer)(i, other),
        },
        ..hf_names()
    }
}

impl LlamaWeights {
    /// Gemma's checkpoints store each RMSNorm weight as `w` for a norm that scales by
    /// `1 + w`; GGUF files (and this engine) hold `1 + w`.
    pub fn add_one_to_norms(&mut self) {
        let add = |v: &mut Vec<f32>| v.iter_mut().for_each(|x| *x += 1.0);
        add(&mut self.norm);
        for l in &mut self.layers {
            add(&mut l.attn_norm);
            add(&mut l.ffn_norm);
            for v in [&mut l.post_attn_norm, &mut l.post_ffn_norm, &mut l.q_norm, &mut l.k_norm] {
                v.iter_mut().for_each(add);
            }
        }
    }
}

/// Loads and repacks all weights.
pub fn load_weights(
    src: &dyn TensorSource,
    names: &TensorNames,
    mut config: LlamaConfig,
    freq_factors: Option<Vec<f32>>,
) -> Result<LlamaWeights> {
    config.validate(&src.describe())?;
    let c = &config;
    let embed = get_matrix(src, &names.embed, c.vocab_size, c.hidden)?;
    let output = match src.tensor(&names.output) {
        Some(_) => Some(get_matrix(src, &names.output, c.vocab_size, c.hidden)?),
        None => None,
    };
    config.tied_embeddings = output.is_none();
    let c = &config;
    let norm = require_vector(src, &names.norm, c.hidden)?;
    // The layer count is the file's word until each layer's tensors are found: a damaged
    // count must fail on a missing tensor, not reserve memory for it.
    let mut layers = Vec::new();
    let gemma = c.gemma.is_some();
    let gemma_norm = |name: String, n: usize| -> Result<Option<Vec<f32>>> {
        if gemma { require_vector(src, &name, n).map(Some) } else { Ok(None) }
    };
    // Per-head RMSNorm of queries and keys before RoPE: Gemma 3 and Qwen3.
    let qk_norm = |name: String| -> Result<Option<Vec<f32>>> {
        if c.has_qk_norm() { require_vector(src, &name, c.head_dim).map(Some) } else { Ok(None) }
    };
    for i in 0..c.layers {
        let n = |role: &str| (names.layer)(i, role);
        // Phi-3 stores Q, K and V as one matrix, and gate and up as another (gate first).
        let [wq, wk, wv] = match src.tensor(&n("qkv")) {
            Some(_) => get_matrices(src, &n("qkv"), [c.q_dim(), c.kv_dim(), c.kv_dim()], c.hidden)?,
            None => [
                get_matrix(src, &n("q"), c.q_dim(), c.hidden)?,
                get_matrix(src, &n("k"), c.kv_dim(), c.hidden)?,
                get_matrix(src, &n("v"), c.kv_dim(), c.hidden)?,
            ],
        };
        let [w_gate, w_up] = match src.tensor(&n("gate")) {
            None if src.tensor(&n("gate_up")).is_some() => {
                get_matrices(src, &n("gate_up"), [c.intermediate, c.intermediate], c.hidden)?
            }
            _ => [
                get_matrix(src, &n("gate"), c.intermediate, c.hidden)?,
                get_matrix(src, &n("up"), c.intermediate, c.hidden)?,
            ],
        };
        let mut w_down = get_matrix(src, &n("down"), c.hidden, c.intermediate)?;
        let mut wo = get_matrix(src, &n("o"), c.hidden, c.q_dim())?;
        // Gemma's two projections into the residual stream take inputs with outliers
        // (attention outputs, FFN products): with K-quant weights, 8-bit activations alone
        // moved Gemma 3 past the golden bound, split ones do not (see `ActFormat::Split`).
        // Other architectures stay within it at 8 bits, as llama.cpp's Q8_K activations are,
        // and the split would cost them a third more integer work in prefill.
        for w in [&mut wo, &mut w_down] {
            if c.gemma.is_some() && matches!(w.ty, GgmlType::Q4K | GgmlType::Q5K | GgmlType::Q6K) {
                w.set_activations(ActFormat::Split);
            }
        }
        layers.push(LayerWeights {
            q_norm: qk_norm(n("q_norm"))?,
            k_norm: qk_norm(n("k_norm"))?,
            post_attn_norm: gemma_norm(n("post_attn_norm"), c.hidden)?,
            post_ffn_norm: gemma_norm(n("post_ffn_norm"), c.hidden)?,
            attn_norm: require_vector(src, &n("attn_norm"), c.hidden)?,
            wq,
            wk,
            wv,
            bq: get_vector(src, &n("q_bias"), c.q_dim())?,
            bk: get_vector(src, &n("k_bias"), c.kv_dim())?,
            bv: get_vector(src, &n("v_bias"), c.kv_dim())?,
            wo,
            ffn_norm: require_vector(src, &n("ffn_norm"), c.hidden)?,
            w_gate,
            w_up,
            w_down,
        });
    }
    let inv_freq = config.inv_freq(freq_factors.as_deref());
    let local_inv_freq = config.gemma.as_ref().map(|g| {
        let rope_scaling = if g.local_rope_scaled { config.rope_scaling } else { None };
        LlamaConfig { rope_theta: g.local_rope_theta, rope_scaling, ..config.clone() }
            .inv_freq(None)
    });
    Ok(LlamaWeights { config, embed, output, norm, layers, inv_freq, local_inv_freq })
}

impl TensorSource for GgufFile {
    fn describe(&self) -> String {
        self.path().display().to_string()
    }

    fn tensor(&self, name: &str) -> Option<(GgmlType, Vec<usize>, &[u8])> {
        let t = GgufFile::tensor(self, name)?;
        // GGUF lists dimensions innermost first; (rows, cols) is the reverse.
        let shape: Vec<usize> = t.dims.iter().rev().copied().collect();
        Some((t.ty, shape, self.tensor_bytes(t)))
    }
}

/// Reads the configuration of a GGUF model.
pub fn gguf_config(f: &GgufFile) -> Result<LlamaConfig> {
    let arch = f.get_str("general.architecture")?.to_string();
    let rope_style = match arch.as_str() {
        "llama" | "mistral" => RopeStyle::Interleaved,
        "qwen2" | "qwen3" | "phi3" | "gemma2" | "gemma3" => RopeStyle::Halves,
        other => {
            return Err(EngineError::Unsupported(format!(
                "general.architecture {other:?} (supported: llama, mistral, qwen2, qwen3, phi3, \
                 gemma2, gemma3)"
            )));
        }
    };
    let longrope = ["rope_factors_long.weight", "rope_factors_short.weight"]
        .iter()
        .any(|t| GgufFile::tensor(f, t).is_some());
    let prefix = arch.clone();
    let key = |k: &str| format!("{prefix}.{k}");
    let u = |k: &str| -> Result<usize> { Ok(f.get_u64(&key(k))? as usize) };
    let opt_f = |k: &str| f.get(&key(k)).and_then(|v| v.as_f64()).map(|v| v as f32);
    let hidden = u("embedding_length")?;
    let heads = u("attention.head_count")?;
    let kv_heads = f
        .get(&key("attention.head_count_kv"))
        .and_then(|v| v.as_u64())
        .map_or(heads, |v| v as usize);
    let head_dim = f
        .get(&key("attention.key_length"))
        .and_then(|v| v.as_u64())
        .map_or(hidden.checked_div(heads).unwrap_or(0), |v| v as usize);
    let rope_dims = f
        .get(&key("rope.dimension_count"))
        .and_then(|v| v.as_u64())
        .map_or(head_dim, |v| v as usize);
    let vocab_size = match f.get(&key("vocab_size")).and_then(|v| v.as_u64()) {
        Some(v) => v as usize,
        None => GgufFile::tensor(f, "token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| EngineError::format(f.path(), "missing tensor token_embd.weight"))?,
    };
    // As llama.cpp reads it: type `none` never scales; otherwise a factor
    // (`rope.scaling.factor`, or the older `rope.scale_linear`) divides the frequencies, the
    // type defaulting to linear; the types that scale otherwise (YaRN, LongRoPE) are refused.
    let factor = opt_f("rope.scaling.factor").or(opt_f("rope.scale_linear")).unwrap_or(0.0);
    let rope_scaling = match f.get(&key("rope.scaling.type")).and_then(|v| v.as_str()) {
        // Phi-3.5 and Phi-4 mini: the factors' tensors say LongRoPE whatever the type.
        _ if longrope => {
            let context = u("context_length")?;
            let original = match f.get(&key("rope.scaling.original_context_length")) {
                None => context,
                Some(_) => u("rope.scaling.original_context_length")?,
            };
            let attn_factor = opt_f("rope.scaling.attn_factor").unwrap_or(1.0);
            if !attn_factor.is_finite() || attn_factor <= 0.0 || rope_dims != head_dim {
                return Err(EngineError::Unsupported(format!(
                    "LongRoPE with attn_factor {attn_factor} over {rope_dims} of {head_dim} \
                     dimensions (a positive factor over every dimension is supported)"
                )));
            }
            Some(RopeScaling::LongRope { attn_factor, long: context > original })
        }
        Some("none") => None,
        None | Some("linear") if factor == 0.0 || factor == 1.0 => None,
        None | Some("linear") if factor.is_finite() && factor > 0.0 => {
            Some(RopeScaling::Linear(factor))
        }
        None | Some("linear") => {
            return Err(EngineError::format(
                f.path(),
                format!(
                    "metadata {}: {factor} is not a positive factor",
                    key("rope.scaling.factor")
                ),
            ));
        }
        Some(other) => {
            return Err(EngineError::Unsupported(format!(
                "{} {other:?} (supported: none, linear)",
                key("rope.scaling.type")
            )));
        }
    };
    // llama.cpp's reading of a gemma3 file: five sliding layers to one global, the sliding
    // ones at RoPE base 10000, queries scaled by 1/sqrt(head_dim) (by 1/sqrt(hidden/heads)
    // for the 62-layer 27B, whose query_pre_attn_scalar differs).
    // Its reading of a gemma2 file: sliding and global layers in turn (the sliding first),
    // every layer at the one RoPE base, scores capped, the 46-layer 27B's queries scaled by
    // 1/sqrt(hidden/heads).
    let cap = |k: &str| opt_f(k).filter(|c| *c > 0.0);
    // Both read a window pattern (one global layer in N) and a sliding layers' RoPE base where
    // the file has them.
    let pattern = |default: usize| -> Result<usize> {
        match f.get(&key("attention.sliding_window_pattern")) {
            None => Ok(default),
            Some(v) => v.as_u64().map(|n| n as usize).ok_or_else(|| {
                EngineError::Unsupported(format!(
                    "{} as a list of layers (a number is supported)",
                    key("attention.sliding_window_pattern")
                ))
            }),
        }
    };
    let window = f.get(&key("attention.sliding_window")).and_then(|v| v.as_u64());
    let gemma = match arch.as_str() {
        "gemma3" => {
            let layers = u("block_count")?;
            let scalar = if layers == 62 { hidden / heads.max(1) } else { head_dim };
            Some(Gemma {
                // No window: every layer global (one in one).
                sliding_window: window.filter(|&w| w > 0).map_or(usize::MAX, |w| w as usize),
                global_every: if window.unwrap_or(0) > 0 { pattern(6)? } else { 1 },
                local_rope_theta: opt_f("rope.freq_base_swa").unwrap_or(10_000.0),
                query_scale: 1.0 / (scalar as f32).sqrt(),
                final_softcap: cap("final_logit_softcapping"),
                attn_softcap: None,
                qk_norm: true,
                local_rope_scaled: false,
            })
        }
        "gemma2" => {
            let layers = u("block_count")?;
            let scalar = if layers == 46 { hidden / heads.max(1) } else { head_dim };
            Some(Gemma {
                sliding_window: window.map_or(4096, |w| w as usize),
                global_every: pattern(2)?,
                local_rope_theta: opt_f("rope.freq_base_swa")
                    .or(opt_f("rope.freq_base"))
                    .unwrap_or(10_000.0),
                query_scale: 1.0 / (scalar as f32).sqrt(),
                // llama.cpp's defaults when the file has no caps.
                final_softcap: cap("final_logit_softcapping").or(Some(30.0)),
                attn_softcap: cap("attn_logit_softcapping").or(Some(50.0)),
                qk_norm: false,
                local_rope_scaled: true,
            })
        }
        _ => None,
    };
    Ok(LlamaConfig {
        gemma,
        arch,
        vocab_size,
        hidden,
        intermediate: u("feed_forward_length")?,
        layers: u("block_count")?,
        heads,
        kv_heads,
        head_dim,
        rope_dims,
        rope_theta: opt_f("rope.freq_base").unwrap_or(10_000.0),
        rope_scaling,
        rope_style,
        rms_eps: opt_f("attention.layer_norm_rms_epsilon").unwrap_or(1e-5),
        context_length: u("context_length")?,
        tied_embeddings: true,
    })
}

/// Loads GGUF weights (llama.cpp's Llama 3 files carry `rope_freqs.weight` factors).
pub fn load_gguf_weights(f: &GgufFile) -> Result<LlamaWeights> {
    let config = gguf_config(f)?;
    let factors = match config.rope_scaling {
        Some(RopeScaling::LongRope { long, .. }) => {
            let name = if long { "rope_factors_long.weight" } else { "rope_factors_short.weight" };
            Some(require_vector(f, name, config.rope_dims / 2)?)
        }
        _ => get_vector(f, "rope_freqs.weight", config.rope_dims / 2)?,
    };
    load_weights(f, &gguf_names(), config, factors)
}
