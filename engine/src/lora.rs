//! Tenant LoRA adapters: low-rank updates of a shared base model's projections, applied per
//! row of a batch (the S-LoRA / Punica design: the base product once for every row, then each
//! adapter's rows take their own `scale * B (A x)`).
//!
//! An adapter comes from a PEFT directory (`adapter_config.json` + `adapter_model.safetensors`)
//! or a GGUF LoRA as llama.cpp's `convert_lora_to_gguf.py` writes it, and is checked against
//! the base model it will run on: every tensor maps to a projection the base has, every shape
//! matches the base's dimensions, rank and alpha are sane, every value is finite. Anything
//! else is an error naming the file and the tensor or key; nothing here panics on a hostile
//! file.
//!
//! Its revision is the SHA-256 of a canonical form (the scale, then each update's `A` and
//! `B` as little-endian f32 in Hugging Face orientation, in layer and projection order), so
//! the same adapter has the same revision whatever file type, dtype or key order carried it.

use std::path::Path;

use serde::Deserialize;
use sha2::{Digest, Sha256};

use crate::cpu::adapter;
use crate::error::{EngineError, Result};
use crate::model::{LlamaConfig, RopeStyle, TensorSource};
use crate::quant::dequantize_row;
use crate::safetensors::SafetensorsModel;
use crate::synth::{permute_for_interleaved_rope, reorder_rope_rows};

/// PEFT's configuration file.
pub const PEFT_CONFIG_FILE: &str = "adapter_config.json";
/// PEFT's weights file.
pub const PEFT_WEIGHTS_FILE: &str = "adapter_model.safetensors";
/// The largest rank accepted.
pub const MAX_RANK: usize = 512;
/// The largest scale (`alpha / r`, or `alpha / sqrt(r)` with rsLoRA) accepted: beyond it an
/// update swamps the base model, which is a broken adapter, not a fine-tune.
pub const MAX_SCALE: f32 = 1024.0;

/// A projection of a transformer block that an adapter may update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Target {
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// Attention output projection.
    O,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up projection.
    Up,
    /// Feed-forward down projection.
    Down,
}

impl Target {
    /// Every target, in the canonical order.
    pub const ALL: [Target; 7] =
        [Target::Q, Target::K, Target::V, Target::O, Target::Gate, Target::Up, Target::Down];

    /// PEFT's module name.
    pub fn peft_name(self) -> &'static str {
        match self {
            Target::Q => "q_proj",
            Target::K => "k_proj",
            Target::V => "v_proj",
            Target::O => "o_proj",
            Target::Gate => "gate_proj",
            Target::Up => "up_proj",
            Target::Down => "down_proj",
        }
    }

    /// llama.cpp's tensor name within a block (`blk.N.NAME.weight`).
    pub fn gguf_name(self) -> &'static str {
        match self {
            Target::Q => "attn_q",
            Target::K => "attn_k",
            Target::V => "attn_v",
            Target::O => "attn_output",
            Target::Gate => "ffn_gate",
            Target::Up => "ffn_up",
            Target::Down => "ffn_down",
        }
    }

    /// (input, output) width of the projection in `c`.
    pub fn dims(self, c: &LlamaConfig) -> (usize, usize) {
        match self {
            Target::Q => (c.hidden, c.q_dim()),
            Target::K | Target::V => (c.hidden, c.kv_dim()),
            Target::O => (c.q_dim(), c.hidden),
            Target::Gate | Target::Up => (c.hidden, c.intermediate),
            Target::Down => (c.intermediate, c.hidden),
        }
    }

    /// Its place in [`Target::ALL`].
    pub(crate) fn index(self) -> usize {
        self as usize
    }

    /// Query and key rows are reordered for interleaved RoPE, as the base's are.
    fn rope_heads(self, c: &LlamaConfig) -> Option<usize> {
        match self {
            Target::Q => Some(c.heads),
            Target::K => Some(c.kv_heads),
            _ => None,
        }
    }
}

/// One projection's update, `out += scale * B (A x)`, as it is served: `A` and `Bᵀ` in f16,
/// each multiplied by a power of two that puts its largest magnitude in `[2^14, 2^15)`, so
/// the f16 range loses nothing a model could notice (half the bytes of f32, and exact for an
/// adapter stored in F16 or BF16). `u_scale` undoes both powers and applies the adapter's
/// scale to `A x`.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraPair {
    /// Rank.
    pub rank: usize,
    /// `A · 2^ea` as f16 bits, in the panels the kernels stream ([`adapter::a_index`]).
    pub(crate) a: Vec<u16>,
    /// `Bᵀ · 2^eb` as f16 bits, in the kernels' panels ([`adapter::b_index`]): a row's
    /// update adds `rank` rows of it weighted by `u`.
    pub(crate) bt: Vec<u16>,
    /// `scale · 2^-(ea + eb)`: what multiplies each element of `A' x`.
    pub(crate) u_scale: f32,
}

impl LoraPair {
    fn new(a: &[f32], bt: &[f32], rank: usize, scale: f32) -> LoraPair {
        let (input, output) = (a.len() / rank, bt.len() / rank);
        let (a, ea) = to_scaled_f16(a);
        let (bt, eb) = to_scaled_f16(bt);
        let u_scale = (f64::from(scale) * 2f64.powi(-(ea + eb))) as f32;
        LoraPair {
            rank,
            a: adapter::a_panels(&a, rank, input),
            bt: adapter::b_panels(&bt, rank, output),
            u_scale,
        }
    }

    fn bytes(&self) -> usize {
        2 * (self.a.len() + self.bt.len())
    }
}

/// `v · 2^e` in f16 bits, and `e`: the largest magnitude lands in `[2^14, 2^15)` (`e` kept
/// within ±60, where an update is either zero or swamps everything anyway). The product is
/// exact in f32 (a power of two, no overflow; what would underflow is zero in f16 too), so
/// the one rounding is f16's.
fn to_scaled_f16(v: &[f32]) -> (Vec<u16>, i32) {
    use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
    let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
    let e = if max > 0.0 { (14 - max.log2().floor() as i32).clamp(-60, 60) } else { 0 };
    let s = 2f32.powi(e);
    let scaled: Vec<f32> = v.iter().map(|&x| x * s).collect();
    let mut out = vec![0u16; v.len()];
    out.reinterpret_cast_mut::<half::f16>().convert_from_f32_slice(&scaled);
    (out, e)
}

/// Adds `v` to `hasher` as little-endian f32, a few KiB at a time (one call per element
/// costs more than the hashing).
fn hash_f32(hasher: &mut Sha256, v: &[f32]) {
    let mut buf = [0u8; 4096];
    for chunk in v.chunks(buf.len() / 4) {
        for (b, x) in buf.chunks_exact_mut(4).zip(chunk) {
            b.copy_from_slice(&x.to_le_bytes());
        }
        hasher.update(&buf[..chunk.len() * 4]);
    }
}

/// A loaded adapter, checked against one base model's shape.
#[derive(Debug)]
pub struct LoraAdapter {
    /// `sha256:` of the canonical form.
    pub revision: String,
    /// The same digest as bytes.
    pub digest: [u8; 32],
    /// Rank (one for every update).
    pub rank: usize,
    /// `alpha / r` (or `alpha / sqrt(r)` with rsLoRA).
    pub scale: f32,
    /// Per layer, per [`Target`], the update where the adapter has one.
    layers: Vec<[Option<LoraPair>; 7]>,
    /// Each target's (input, output) widths in the base it was checked against.
    dims: [(usize, usize); 7],
}

/// The update of one projection as read from a file, before checks: `A` (`rank x input`),
/// `B` (`output x rank`), in Hugging Face orientation, and the tensors' names for messages.
struct RawPair {
    a: Vec<f32>,
    a_shape: Vec<usize>,
    a_name: String,
    b: Vec<f32>,
    b_shape: Vec<usize>,
    b_name: String,
}

impl LoraAdapter {
    /// Loads the adapter at `path` (a PEFT directory, or a GGUF LoRA file) for a base model
    /// of configuration `base`.
    pub fn load(path: &Path, base: &LlamaConfig) -> Result<LoraAdapter> {
        if path.is_dir() { Self::load_peft(path, base) } else { Self::load_gguf(path, base) }
    }

    /// Whether the adapter was checked against a base of `c`'s shape.
    pub fn fits(&self, c: &LlamaConfig) -> bool {
        self.layers.len() == c.layers
            && Target::ALL.iter().all(|t| self.dims[t.index()] == t.dims(c))
    }

    /// Bytes the adapter's updates take.
    pub fn memory_bytes(&self) -> usize {
        self.layers.iter().flatten().flatten().map(LoraPair::bytes).sum()
    }

    /// The update of `target` in `layer`, if the adapter has one.
    pub fn pair(&self, layer: usize, target: Target) -> Option<&LoraPair> {
        self.layers.get(layer)?[target.index()].as_ref()
    }

    /// The projections the adapter updates (in any layer).
    pub fn targets(&self) -> Vec<Target> {
        Target::ALL
            .into_iter()
            .filter(|t| self.layers.iter().any(|l| l[t.index()].is_some()))
            .collect()
    }

    /// The dense update `scale * B A` of `target` in `layer`, `output x input` row-major
    /// (what merging the adapter into the base adds to its weights), in the base's row order,
    /// from the values as served (f16, see [`LoraPair`]), summed in f64.
    pub fn delta(&self, layer: usize, target: Target, base: &LlamaConfig) -> Option<Vec<f32>> {
        let p = self.pair(layer, target)?;
        let (input, output) = target.dims(base);
        let f = |bits: u16| f64::from(half::f16::from_bits(bits).to_f32());
        let mut d = vec![0f64; output * input];
        for k in 0..p.rank {
            let a: Vec<f64> = (0..input).map(|i| f(p.a[adapter::a_index(input, k, i)])).collect();
            for (o, row) in d.chunks_exact_mut(input).enumerate() {
                let b = f(p.bt[adapter::b_index(p.rank, k, o)]);
                for (x, &ai) in row.iter_mut().zip(&a) {
                    *x += b * ai;
                }
            }
        }
        Some(d.iter().map(|&x| (x * f64::from(p.u_scale)) as f32).collect())
    }

    /// A PEFT directory.
    fn load_peft(dir: &Path, base: &LlamaConfig) -> Result<LoraAdapter> {
        let config_path = dir.join(PEFT_CONFIG_FILE);
        let text = std::fs::read(&config_path).map_err(|e| EngineError::io(&config_path, e))?;
        let config: PeftConfig = serde_json::from_slice(&text)
            .map_err(|e| EngineError::format(&config_path, format!("invalid JSON: {e}")))?;
        let targets = config.check(&config_path)?;
        let weights_path = dir.join(PEFT_WEIGHTS_FILE);
        let st = SafetensorsModel::open_file(&weights_path)?;
        let mut raw: Vec<[Option<RawPair>; 7]> =
            (0..base.layers).map(|_| Default::default()).collect();
        let mut halves: std::collections::HashMap<(usize, Target), [Option<String>; 2]> =
            std::collections::HashMap::new();
        for name in st.tensor_names() {
            let fail =
                |m: String| EngineError::format(&weights_path, format!("tensor {name}: {m}"));
            let (layer, target, which) = parse_peft_name(name).ok_or_else(|| {
                fail(
                    "not a LoRA update of a projection this engine adapts (q_proj, k_proj, \
                     v_proj, o_proj, gate_proj, up_proj, down_proj in model.layers.N)"
                        .into(),
                )
            })?;
            if layer >= base.layers {
                return Err(fail(format!("layer {layer}, but the base model has {}", base.layers)));
            }
            if !targets.contains(&target) {
                return Err(fail(format!(
                    "{} is not among adapter_config.json's target_modules",
                    target.peft_name()
                )));
            }
            let slot = &mut halves.entry((layer, target)).or_default()[which];
            if slot.is_some() {
                return Err(fail("appears twice".into()));
            }
            *slot = Some(name.to_string());
        }
        for ((layer, target), [a, b]) in halves {
            let missing = |half: &str| {
                EngineError::format(
                    &weights_path,
                    format!(
                        "layer {layer} {}: {half} is missing (each update needs lora_A and lora_B)",
                        target.peft_name()
                    ),
                )
            };
            let a_name = a.ok_or_else(|| missing("lora_A"))?;
            let b_name = b.ok_or_else(|| missing("lora_B"))?;
            let (a, a_shape) = read_f32(&st, &a_name, &weights_path)?;
            let (b, b_shape) = read_f32(&st, &b_name, &weights_path)?;
            raw[layer][target.index()] = Some(RawPair { a, a_shape, a_name, b, b_shape, b_name });
        }
        if raw.iter().all(|l| l.iter().all(Option::is_none)) {
            return Err(EngineError::format(&weights_path, "holds no LoRA updates"));
        }
        let scale = config.scale(&config_path)?;
        Self::build(raw, config.r, scale, base, &weights_path)
    }

    /// A GGUF LoRA (`general.type` `adapter`, `adapter.type` `lora`).
    fn load_gguf(path: &Path, base: &LlamaConfig) -> Result<LoraAdapter> {
        let f = sluice_text::gguf::GgufFile::open(path)?;
        let fail = |m: String| EngineError::format(path, m);
        let kind = f.get("general.type").and_then(|v| v.as_str());
        if kind != Some("adapter") {
            return Err(fail(format!(
                "general.type is {kind:?}, not \"adapter\": not a GGUF LoRA (a PEFT adapter is \
                 a directory with {PEFT_CONFIG_FILE})"
            )));
        }
        let adapter_type = f.get("adapter.type").and_then(|v| v.as_str());
        if adapter_type != Some("lora") {
            return Err(fail(format!("adapter.type is {adapter_type:?}, not \"lora\"")));
        }
        let arch = f.get_str("general.architecture")?.to_string();
        let alpha = f.get("adapter.lora.alpha").and_then(|v| v.as_f64()).unwrap_or(0.0) as f32;
        // llama.cpp's converter reorders Q/K rows for interleaved RoPE in these architectures;
        // the canonical form is Hugging Face's order.
        let permuted = matches!(arch.as_str(), "llama" | "mistral");
        let mut raw: Vec<[Option<RawPair>; 7]> =
            (0..base.layers).map(|_| Default::default()).collect();
        let mut rank = 0;
        let mut pairs = 0;
        for t in &f.tensors {
            let Some((layer, target, which)) = parse_gguf_name(&t.name) else {
                return Err(fail(format!(
                    "tensor {}: not a LoRA update of a projection this engine adapts \
                     (blk.N.{{attn_q,attn_k,attn_v,attn_output,ffn_gate,ffn_up,ffn_down}}\
                     .weight.lora_a/lora_b)",
                    t.name
                )));
            };
            if which == 1 {
                continue;
            }
            if layer >= base.layers {
                return Err(fail(format!(
                    "tensor {}: layer {layer}, but the base model has {}",
                    t.name, base.layers
                )));
            }
            let b_name = t.name.replace(".lora_a", ".lora_b");
            let (a, a_shape) = read_f32(&f, &t.name, path)?;
            let (mut b, b_shape) = read_f32(&f, &b_name, path)?;
            if let (true, Some(heads), [rows, cols]) =
                (permuted, target.rope_heads(base), &b_shape[..])
                && *rows % (2 * heads) == 0
            {
                b = reorder_rope_rows(&b, heads, *cols, true);
            }
            // One rank for the whole adapter, as PEFT writes them (the scale depends on it).
            match (rank, a_shape[0]) {
                (0, r) => rank = r,
                (r, s) if r != s => {
                    return Err(fail(format!(
                        "tensor {}: rank {s}, but earlier updates have rank {r}",
                        t.name
                    )));
                }
                _ => {}
            }
            pairs += 1;
            raw[layer][target.index()] =
                Some(RawPair { a, a_shape, a_name: t.name.clone(), b, b_shape, b_name });
        }
        // Every lora_b has its lora_a.
        for t in &f.tensors {
            if let Some((_, _, 1)) = parse_gguf_name(&t.name)
                && f.tensor(&t.name.replace(".lora_b", ".lora_a")).is_none()
            {
                return Err(fail(format!("tensor {}: its lora_a is missing", t.name)));
            }
        }
        if pairs == 0 {
            return Err(fail("holds no LoRA updates".into()));
        }
        // llama.cpp: alpha 0 means a scale of 1, else alpha over each update's rank.
        let scale = if alpha == 0.0 { 1.0 } else { alpha / rank as f32 };
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(fail(format!(
                "adapter.lora.alpha {alpha} is not a finite, positive number"
            )));
        }
        Self::build(raw, rank, scale, base, path)
    }

    /// Checks shapes and values against `base` and builds the adapter.
    fn build(
        raw: Vec<[Option<RawPair>; 7]>,
        rank: usize,
        scale: f32,
        base: &LlamaConfig,
        path: &Path,
    ) -> Result<LoraAdapter> {
        let fail = |m: String| EngineError::format(path, m);
        if !(scale.is_finite() && scale > 0.0 && scale <= MAX_SCALE) {
            return Err(fail(format!(
                "scale {scale} (alpha over rank) is outside (0, {MAX_SCALE}]"
            )));
        }
        // Every check first, so nothing is hashed or converted for a file that fails one.
        for layer in &raw {
            for (target, p) in Target::ALL.into_iter().zip(layer) {
                let Some(p) = p else { continue };
                let (input, output) = target.dims(base);
                let r = p.a_shape.first().copied().unwrap_or(0);
                if r != rank || !(1..=MAX_RANK).contains(&r) {
                    return Err(fail(format!(
                        "tensor {}: rank {r}, but the adapter's rank is {rank} (at most \
                         {MAX_RANK})",
                        p.a_name
                    )));
                }
                if p.a_shape != [r, input] {
                    return Err(fail(format!(
                        "tensor {}: shape {:?}, but the base model's {} takes {input} inputs, \
                         so lora_A must be [{r}, {input}]",
                        p.a_name,
                        p.a_shape,
                        target.peft_name()
                    )));
                }
                if p.b_shape != [output, r] {
                    return Err(fail(format!(
                        "tensor {}: shape {:?}, but the base model's {} has {output} outputs, \
                         so lora_B must be [{output}, {r}]",
                        p.b_name,
                        p.b_shape,
                        target.peft_name()
                    )));
                }
                for (name, v) in [(&p.a_name, &p.a), (&p.b_name, &p.b)] {
                    if let Some(i) = v.iter().position(|x| !x.is_finite()) {
                        return Err(fail(format!("tensor {name}: element {i} is {}", v[i])));
                    }
                }
            }
        }
        // The revision is hashed on a thread of its own while the updates are converted
        // (half of a cold load each).
        let hash = |raw: &[[Option<RawPair>; 7]]| -> [u8; 32] {
            let mut hasher = Sha256::new();
            hasher.update(b"sluice-lora-v1\n");
            hasher.update(scale.to_le_bytes());
            for (li, layer) in raw.iter().enumerate() {
                for (target, p) in Target::ALL.into_iter().zip(layer) {
                    let Some(p) = p else { continue };
                    let (input, output) = target.dims(base);
                    hasher.update(format!("{li} {} {rank} {input} {output}\n", target.peft_name()));
                    hash_f32(&mut hasher, &p.a);
                    hash_f32(&mut hasher, &p.b);
                }
            }
            hasher.finalize().into()
        };
        let convert = |raw: &[[Option<RawPair>; 7]]| -> Vec<[Option<LoraPair>; 7]> {
            let mut layers = Vec::with_capacity(raw.len());
            for layer in raw {
                let mut pairs: [Option<LoraPair>; 7] = Default::default();
                for (target, p) in Target::ALL.into_iter().zip(layer) {
                    let Some(p) = p else { continue };
                    let output = target.dims(base).1;
                    // The base's own row order for Q and K.
                    let permuted = match (base.rope_style, target.rope_heads(base)) {
                        (RopeStyle::Interleaved, Some(heads)) => {
                            Some(permute_for_interleaved_rope(&p.b, heads, rank))
                        }
                        _ => None,
                    };
                    let b = permuted.as_deref().unwrap_or(&p.b);
                    let mut bt = vec![0f32; rank * output];
                    for (o, row) in b.chunks_exact(rank).enumerate() {
                        for (k, &x) in row.iter().enumerate() {
                            bt[k * output + o] = x;
                        }
                    }
                    pairs[target.index()] = Some(LoraPair::new(&p.a, &bt, rank, scale));
                }
                layers.push(pairs);
            }
            layers
        };
        let (digest, layers) = std::thread::scope(|s| {
            let hashing = s.spawn(|| hash(&raw));
            let layers = convert(&raw);
            // A panic in the hash (there is none to expect) is the caller's, as it was inline.
            let digest = hashing.join().unwrap_or_else(|e| std::panic::resume_unwind(e));
            (digest, layers)
        });
        let revision =
            format!("sha256:{}", digest.iter().map(|b| format!("{b:02x}")).collect::<String>());
        let dims = Target::ALL.map(|t| t.dims(base));
        Ok(LoraAdapter { revision, digest, rank, scale, layers, dims })
    }
}

/// The fields of PEFT's `adapter_config.json` this engine reads or must refuse.
#[derive(Deserialize)]
struct PeftConfig {
    peft_type: Option<String>,
    r: usize,
    lora_alpha: f32,
    target_modules: serde_json::Value,
    #[serde(default)]
    use_rslora: bool,
    #[serde(default)]
    use_dora: bool,
    #[serde(default)]
    fan_in_fan_out: bool,
    bias: Option<String>,
    modules_to_save: Option<Vec<String>>,
    #[serde(default)]
    rank_pattern: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    alpha_pattern: serde_json::Map<String, serde_json::Value>,
}

impl PeftConfig {
    /// The targets, once every field this engine cannot honour is refused by name.
    fn check(&self, path: &Path) -> Result<Vec<Target>> {
        let fail = |m: String| EngineError::format(path, m);
        if let Some(t) = &self.peft_type
            && t != "LORA"
        {
            return Err(fail(format!("peft_type {t:?}: only LORA adapters are served")));
        }
        if !(1..=MAX_RANK).contains(&self.r) {
            return Err(fail(format!("r {} is outside 1..={MAX_RANK}", self.r)));
        }
        if self.use_dora {
            return Err(fail("use_dora: DoRA adapters are not served".into()));
        }
        if self.fan_in_fan_out {
            return Err(fail("fan_in_fan_out: transposed (Conv1D) weights are not served".into()));
        }
        if let Some(b) = &self.bias
            && b != "none"
        {
            return Err(fail(format!("bias {b:?}: adapters that train biases are not served")));
        }
        if self.modules_to_save.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(fail(
                "modules_to_save: adapters that replace whole modules are not served".into(),
            ));
        }
        if !self.rank_pattern.is_empty() {
            return Err(fail("rank_pattern: per-module ranks are not served".into()));
        }
        if !self.alpha_pattern.is_empty() {
            return Err(fail("alpha_pattern: per-module alphas are not served".into()));
        }
        let names: Vec<String> = match &self.target_modules {
            serde_json::Value::String(s) if s == "all-linear" => {
                Target::ALL.iter().map(|t| t.peft_name().to_string()).collect()
            }
            serde_json::Value::String(s) => vec![s.clone()],
            serde_json::Value::Array(a) => a
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| fail(format!("target_modules: {v} is not a module name")))
                })
                .collect::<Result<_>>()?,
            other => return Err(fail(format!("target_modules: {other} is not a list of names"))),
        };
        let mut targets = Vec::new();
        for n in &names {
            let t = Target::ALL.into_iter().find(|t| t.peft_name() == n).ok_or_else(|| {
                fail(format!(
                    "target_modules: {n:?} is not a projection this engine adapts (q_proj, \
                     k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj, or \"all-linear\")"
                ))
            })?;
            targets.push(t);
        }
        if targets.is_empty() {
            return Err(fail("target_modules is empty".into()));
        }
        Ok(targets)
    }

    fn scale(&self, path: &Path) -> Result<f32> {
        if !(self.lora_alpha.is_finite() && self.lora_alpha > 0.0) {
            return Err(EngineError::format(
                path,
                format!("lora_alpha {} is not a finite, positive number", self.lora_alpha),
            ));
        }
        let r = self.r as f32;
        Ok(if self.use_rslora { self.lora_alpha / r.sqrt() } else { self.lora_alpha / r })
    }
}

/// `(layer, target, 0 for A / 1 for B)` of a PEFT tensor name such as
/// `base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight`.
fn parse_peft_name(name: &str) -> Option<(usize, Target, usize)> {
    let rest = &name[name.find("layers.")? + "layers.".len()..];
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (block, rest) = rest.split_once('.')?;
    let (module, rest) = rest.split_once('.')?;
    let target = Target::ALL.into_iter().find(|t| t.peft_name() == module)?;
    let attention = matches!(target, Target::Q | Target::K | Target::V | Target::O);
    if block != if attention { "self_attn" } else { "mlp" } {
        return None;
    }
    let which = match rest {
        "lora_A.weight" | "lora_A.default.weight" => 0,
        "lora_B.weight" | "lora_B.default.weight" => 1,
        _ => return None,
    };
    Some((layer, target, which))
}

/// `(layer, target, 0 for A / 1 for B)` of a GGUF LoRA tensor name such as
/// `blk.3.attn_q.weight.lora_a`.
fn parse_gguf_name(name: &str) -> Option<(usize, Target, usize)> {
    let rest = name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, which) = rest.split_once(".weight.")?;
    let target = Target::ALL.into_iter().find(|t| t.gguf_name() == module)?;
    let which = match which {
        "lora_a" => 0,
        "lora_b" => 1,
        _ => return None,
    };
    Some((layer, target, which))
}

/// A tensor's values as f32 and its shape (outer first), every float type and GGML
/// quantization accepted.
fn read_f32(src: &dyn TensorSource, name: &str, path: &Path) -> Result<(Vec<f32>, Vec<usize>)> {
    let (ty, shape, bytes) = src
        .tensor(name)
        .ok_or_else(|| EngineError::format(path, format!("tensor {name} is missing")))?;
    let fail = |m: String| EngineError::format(path, format!("tensor {name}: {m}"));
    if shape.len() != 2 {
        return Err(fail(format!("shape {shape:?} is not a matrix")));
    }
    let (rows, cols) = (shape[0], shape[1]);
    let row_bytes = ty
        .row_bytes(cols)
        .filter(|_| cols % ty.block_elems() == 0)
        .ok_or_else(|| fail(format!("{cols} columns do not fill whole {} blocks", ty.name())))?;
    if rows.checked_mul(row_bytes) != Some(bytes.len()) {
        return Err(fail(format!(
            "{} bytes for {rows} rows of {row_bytes} bytes: truncated or inconsistent",
            bytes.len()
        )));
    }
    let mut out = vec![0f32; rows * cols];
    if rows > 0 && cols > 0 {
        for (dst, src) in out.chunks_exact_mut(cols).zip(bytes.chunks_exact(row_bytes)) {
            dequantize_row(ty, src, dst);
        }
    }
    Ok((out, shape))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::synth::{SynthLora, SynthSpec};

    fn tiny() -> LlamaConfig {
        SynthSpec::tiny().config()
    }

    type TestResult<T = ()> = std::result::Result<T, Box<dyn std::error::Error>>;

    /// Writes a rank-2 adapter of tiny's shape on Q and V, lets `edit` change its config and
    /// tensors, and loads it for `base`: the error's text.
    fn refusal(
        base: &LlamaConfig,
        edit: impl FnOnce(&mut serde_json::Value, &mut Vec<(String, GgmlType, Vec<usize>, Vec<u8>)>),
    ) -> TestResult<String> {
        let dir = tempfile::tempdir()?;
        let lora = SynthLora { rank: 2, targets: vec![Target::Q, Target::V], ..SynthLora::new(5) };
        lora.write_peft(&tiny(), GgmlType::F32, dir.path())?;
        let cfg_path = dir.path().join(PEFT_CONFIG_FILE);
        let mut cfg: serde_json::Value = serde_json::from_slice(&std::fs::read(&cfg_path)?)?;
        let st = SafetensorsModel::open_file(&dir.path().join(PEFT_WEIGHTS_FILE))?;
        let mut tensors: Vec<_> = st
            .tensor_names()
            .into_iter()
            .filter_map(|n| {
                st.tensor(n).map(|(ty, shape, b)| (n.to_string(), ty, shape, b.to_vec()))
            })
            .collect();
        drop(st);
        edit(&mut cfg, &mut tensors);
        std::fs::write(&cfg_path, cfg.to_string())?;
        crate::safetensors::write_safetensors(&dir.path().join(PEFT_WEIGHTS_FILE), &tensors)?;
        Ok(match LoraAdapter::load(dir.path(), base) {
            Ok(_) => String::from("loaded"),
            Err(e) => e.to_string(),
        })
    }

    #[test]
    fn a_well_formed_adapter_loads_with_its_rank_scale_and_targets() -> TestResult {
        assert_eq!(refusal(&tiny(), |_, _| {})?, "loaded");
        let dir = tempfile::tempdir()?;
        let lora = SynthLora { rank: 4, alpha: 8.0, ..SynthLora::new(1) };
        lora.write_peft(&tiny(), GgmlType::BF16, dir.path())?;
        let a = LoraAdapter::load(dir.path(), &tiny())?;
        assert_eq!((a.rank, a.scale, a.targets()), (4, 2.0, Target::ALL.to_vec()));
        assert!(a.fits(&tiny()));
        let other = SynthSpec { hidden: 256, intermediate: 512, ..SynthSpec::tiny() }.config();
        assert!(!a.fits(&other));
        assert!(a.revision.starts_with("sha256:") && a.revision.len() == 71);
        // r x (in + out) f16 values per update, two layers of seven.
        let c = tiny();
        let per_layer: usize =
            Target::ALL.iter().map(|t| t.dims(&c)).map(|(i, o)| 4 * (i + o)).sum();
        assert_eq!(a.memory_bytes(), 2 * 2 * per_layer);
        Ok(())
    }

    /// Served in f16 under a power of two: BF16 values (most adapters on the Hub) come back
    /// exactly over 28 binades below the largest, F32 values to f16's precision.
    #[test]
    fn stored_values_keep_bf16_exactly_and_f32_to_f16_precision() {
        let back = |v: &[f32]| {
            let (bits, e) = to_scaled_f16(v);
            bits.iter()
                .map(|&b| (f64::from(half::f16::from_bits(b).to_f32()) * 2f64.powi(-e)) as f32)
                .collect::<Vec<f32>>()
        };
        let bf16: Vec<f32> = (0..400)
            .map(|i| {
                let m = 1.0 + (i % 128) as f32 / 128.0;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                half::bf16::from_f32(sign * m * 2f32.powi(-(i % 28) - 3)).to_f32()
            })
            .collect();
        assert_eq!(back(&bf16), bf16);
        let f32s: Vec<f32> =
            (0..400).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 3.3e-5).collect();
        let max = f32s.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (b, v) in back(&f32s).iter().zip(&f32s) {
            assert!((b - v).abs() <= max * 2f32.powi(-11), "{v} came back as {b}");
        }
        assert_eq!(to_scaled_f16(&[0.0, 0.0]), (vec![0, 0], 0));
        assert_eq!(to_scaled_f16(&[1e30]).1, -60);
    }

    #[test]
    fn every_malformed_adapter_is_refused_by_name() -> TestResult {
        let other = SynthSpec { hidden: 256, intermediate: 512, ..SynthSpec::tiny() }.config();
        let cases: Vec<(TestResult<String>, &str)> = vec![
            (refusal(&other, |_, _| {}), "so lora_A must be [2, 256]"),
            (
                refusal(&tiny(), |_, t| {
                    t[0].3[4..8].copy_from_slice(&f32::NAN.to_le_bytes());
                }),
                "element 1 is NaN",
            ),
            (
                refusal(&tiny(), |c, _| {
                    c["target_modules"] = serde_json::json!(["q_proj", "lm_head"])
                }),
                "target_modules: \"lm_head\" is not a projection",
            ),
            (
                refusal(&tiny(), |c, _| c["target_modules"] = serde_json::json!(["q_proj"])),
                "v_proj is not among adapter_config.json's target_modules",
            ),
            (
                refusal(&tiny(), |_, t| t.retain(|x| !x.0.contains("0.self_attn.q_proj.lora_B"))),
                "lora_B is missing",
            ),
            (refusal(&tiny(), |c, _| c["use_dora"] = true.into()), "use_dora"),
            (refusal(&tiny(), |c, _| c["r"] = 0.into()), "r 0 is outside"),
            (refusal(&tiny(), |c, _| c["r"] = 3.into()), "rank 2, but the adapter's rank is 3"),
            (refusal(&tiny(), |c, _| c["lora_alpha"] = (-1.0).into()), "lora_alpha -1"),
            (refusal(&tiny(), |c, _| c["bias"] = "all".into()), "bias \"all\""),
            (
                refusal(&tiny(), |c, _| c["modules_to_save"] = serde_json::json!(["lm_head"])),
                "modules_to_save",
            ),
            (refusal(&tiny(), |c, _| c["peft_type"] = "IA3".into()), "peft_type \"IA3\""),
            (
                refusal(&tiny(), |_, t| {
                    t[0].0 = t[0].0.replace("layers.0", "layers.9");
                }),
                "layer 9, but the base model has 2",
            ),
            (
                refusal(&tiny(), |_, t| t[0].0 = "base_model.model.lm_head.lora_A.weight".into()),
                "not a LoRA update of a projection",
            ),
        ];
        for (msg, want) in cases {
            let msg = msg?;
            assert!(msg.contains(want), "{msg:?} does not say {want:?}");
            assert!(
                msg.contains(PEFT_CONFIG_FILE) || msg.contains(PEFT_WEIGHTS_FILE),
                "{msg:?} names no file"
            );
        }
        Ok(())
    }

    #[test]
    fn a_model_file_is_not_an_adapter() -> TestResult {
        let dir = tempfile::tempdir()?;
        let p = dir.path().join("m.gguf");
        crate::synth::write_gguf(&SynthSpec::tiny(), GgmlType::F32, &p)?;
        let msg = LoraAdapter::load(&p, &tiny()).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("general.type") && msg.contains("not a GGUF LoRA"), "{msg}");
        let missing = LoraAdapter::load(&dir.path().join("nothing"), &tiny());
        assert!(missing.is_err());
        Ok(())
    }
}
