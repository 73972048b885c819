//! Hugging Face checkpoints: `config.json` and memory-mapped safetensors weights, in one
//! `model.safetensors` or sharded under `model.safetensors.index.json`.
//!
//! Every header is checked before any tensor is handed out: header length, dtype, byte size
//! against shape, data offsets inside the file and no two tensors sharing bytes. Errors name
//! the file and the tensor or key; nothing here panics on a hostile file.

use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use ::safetensors::Dtype;
use ::safetensors::tensor::TensorInfo;
use memmap2::Mmap;
use serde::Deserialize;

use crate::error::{EngineError, Result};
use crate::model::{
    Gemma, Llama3Scaling, LlamaConfig, LlamaWeights, RopeScaling, RopeStyle, TensorSource,
    hf_gemma_names, hf_names, load_weights,
};
use crate::quant::GgmlType;

/// File name of an unsharded checkpoint.
pub const SINGLE_FILE: &str = "model.safetensors";
/// File name of the index of a sharded checkpoint.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// File name of the model configuration.
pub const CONFIG_FILE: &str = "config.json";

/// Largest header accepted (the safetensors crate's own limit).
const MAX_HEADER_BYTES: usize = 100_000_000;
/// Bytes of the little-endian header length that starts every file.
const LEN_BYTES: usize = 8;

/// Architectures this engine runs, as `config.json` names them, with our short names.
const ARCHITECTURES: [(&str, &str); 7] = [
    ("LlamaForCausalLM", "llama"),
    ("MistralForCausalLM", "mistral"),
    ("Qwen2ForCausalLM", "qwen2"),
    ("Qwen3ForCausalLM", "qwen3"),
    ("Phi3ForCausalLM", "phi3"),
    ("Gemma2ForCausalLM", "gemma2"),
    ("Gemma3ForCausalLM", "gemma3"),
];

/// Where one tensor lives.
struct Entry {
    shard: usize,
    ty: GgmlType,
    shape: Vec<usize>,
    /// Absolute byte range in the shard's file.
    start: usize,
    end: usize,
}

/// A memory-mapped safetensors checkpoint (one file or all shards of an index).
pub struct SafetensorsModel {
    /// What messages name: the single file or the index.
    path: PathBuf,
    files: Vec<PathBuf>,
    maps: Vec<Mmap>,
    tensors: HashMap<String, Entry>,
}

impl SafetensorsModel {
    /// Opens the checkpoint in `dir`: `model.safetensors` when present (as `transformers`
    /// prefers), otherwise every shard listed in `model.safetensors.index.json`.
    pub fn open(dir: &Path) -> Result<SafetensorsModel> {
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            return Self::open_file(&single);
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_index(&index);
        }
        Err(EngineError::format(dir, format!("neither {SINGLE_FILE} nor {INDEX_FILE} found")))
    }

    /// Opens one safetensors file.
    pub fn open_file(path: &Path) -> Result<SafetensorsModel> {
        let map = map_file(path)?;
        let tensors = parse_header(path, &map)?;
        Ok(SafetensorsModel {
            path: path.to_path_buf(),
            files: vec![path.to_path_buf()],
            maps: vec![map],
            tensors,
        })
    }

    /// Opens the shards listed in a `model.safetensors.index.json`; its `weight_map` decides
    /// which tensors exist and where.
    pub fn open_index(index: &Path) -> Result<SafetensorsModel> {
        #[derive(Deserialize)]
        struct ShardIndex {
            weight_map: BTreeMap<String, String>,
        }
        let text = std::fs::read(index).map_err(|e| EngineError::io(index, e))?;
        let parsed: ShardIndex = serde_json::from_slice(&text)
            .map_err(|e| EngineError::format(index, format!("invalid index: {e}")))?;
        let dir = index.parent().unwrap_or(Path::new("."));
        let names: BTreeSet<&str> = parsed.weight_map.values().map(String::as_str).collect();
        let mut files = Vec::with_capacity(names.len());
        let mut maps = Vec::with_capacity(names.len());
        let mut per_shard = Vec::with_capacity(names.len());
        for name in &names {
            // A shard is a plain file next to the index, never a path elsewhere.
            if Path::new(name).file_name().and_then(|f| f.to_str()) != Some(*name) {
                return Err(EngineError::format(
                    index,
                    format!("weight_map names shard {name:?}, which is not a plain file name"),
                ));
            }
            let path = dir.join(name);
            let map = map_file(&path)?;
            per_shard.push(parse_header(&path, &map)?);
            files.push(path);
            maps.push(map);
        }
        let shard_of: HashMap<&str, usize> =
            names.iter().enumerate().map(|(i, n)| (*n, i)).collect();
        let mut tensors = HashMap::with_capacity(parsed.weight_map.len());
        for (tensor, file) in &parsed.weight_map {
            let found = shard_of
                .get(file.as_str())
                .and_then(|&shard| Some((shard, per_shard.get_mut(shard)?.remove(tensor)?)));
            let (shard, entry) = found.ok_or_else(|| {
                EngineError::format(
                    index,
                    format!("tensor {tensor}: weight_map places it in {file}, which lacks it"),
                )
            })?;
            tensors.insert(tensor.clone(), Entry { shard, ..entry });
        }
        Ok(SafetensorsModel { path: index.to_path_buf(), files, maps, tensors })
    }

    /// The weight files in shard order (for revision hashing).
    pub fn weight_files(&self) -> &[PathBuf] {
        &self.files
    }

    /// Tensor names, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }
}

impl TensorSource for SafetensorsModel {
    fn describe(&self) -> String {
        self.path.display().to_string()
    }

    fn tensor(&self, name: &str) -> Option<(GgmlType, Vec<usize>, &[u8])> {
        let e = self.tensors.get(name)?;
        let bytes = self.maps.get(e.shard)?.get(e.start..e.end)?;
        Some((e.ty, e.shape.clone(), bytes))
    }
}

fn map_file(path: &Path) -> Result<Mmap> {
    let file = std::fs::File::open(path).map_err(|e| EngineError::io(path, e))?;
    // SAFETY: the map is read-only; a file truncated underneath us by another process is
    // outside what any mmap-based loader can defend against (as in gguf.rs).
    unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))
}

/// Validates a safetensors file's header against its length; offsets come back absolute.
fn parse_header(path: &Path, file: &[u8]) -> Result<HashMap<String, Entry>> {
    let fail = |m: String| EngineError::format(path, m);
    let len_bytes: [u8; LEN_BYTES] = file
        .get(..LEN_BYTES)
        .and_then(|b| b.try_into().ok())
        .ok_or_else(|| fail(format!("truncated: {} bytes, no header length", file.len())))?;
    let header_len = u64::from_le_bytes(len_bytes);
    let header_end = usize::try_from(header_len)
        .ok()
        .filter(|&n| n <= MAX_HEADER_BYTES)
        .map(|n| n + LEN_BYTES)
        .ok_or_else(|| fail(format!("header length {header_len} exceeds {MAX_HEADER_BYTES}")))?;
    let header = file.get(LEN_BYTES..header_end).ok_or_else(|| {
        fail(format!(
            "truncated: header of {header_len} bytes but the file has {} bytes",
            file.len()
        ))
    })?;
    let raw: BTreeMap<String, serde_json::Value> =
        serde_json::from_slice(header).map_err(|e| fail(format!("invalid header: {e}")))?;
    let data_len = file.len() - header_end;
    let mut tensors = HashMap::with_capacity(raw.len());
    let mut ranges = Vec::with_capacity(raw.len());
    for (name, value) in raw {
        if name == "__metadata__" {
            continue;
        }
        let info: TensorInfo =
            serde_json::from_value(value).map_err(|e| fail(format!("tensor {name}: {e}")))?;
        let (ty, elem_bytes) = match info.dtype {
            Dtype::F32 => (GgmlType::F32, 4),
            Dtype::F16 => (GgmlType::F16, 2),
            Dtype::BF16 => (GgmlType::BF16, 2),
            other => {
                return Err(fail(format!(
                    "tensor {name}: dtype {other} is not supported (F32, F16, BF16 are)"
                )));
            }
        };
        let (start, end) = info.data_offsets;
        let size = info
            .shape
            .iter()
            .try_fold(elem_bytes, |a: usize, &d| a.checked_mul(d))
            .ok_or_else(|| fail(format!("tensor {name}: shape {:?} overflows", info.shape)))?;
        match end.checked_sub(start) {
            Some(n) if n == size => {}
            Some(n) => {
                return Err(fail(format!(
                    "tensor {name}: data_offsets hold {n} bytes but shape {:?} of {} needs {size}",
                    info.shape, info.dtype
                )));
            }
            None => {
                return Err(fail(format!("tensor {name}: data_offsets [{start}, {end}) reversed")));
            }
        }
        if end > data_len {
            return Err(fail(format!(
                "tensor {name}: data [{start}, {end}) extends past the {data_len} data bytes: \
                 truncated?"
            )));
        }
        ranges.push((start, end, name.clone()));
        let entry = Entry {
            shard: 0,
            ty,
            shape: info.shape,
            start: header_end + start,
            end: header_end + end,
        };
        tensors.insert(name, entry);
    }
    ranges.sort_unstable();
    for pair in ranges.windows(2) {
        if let [(_, end_a, a), (start_b, _, b)] = pair
            && start_b < end_a
        {
            return Err(fail(format!("tensors {a} and {b} overlap")));
        }
    }
    Ok(tensors)
}

/// The fields of a Hugging Face `config.json` this engine reads; the many others are ignored.
#[derive(Deserialize)]
struct HfConfig {
    #[serde(default)]
    architectures: Vec<String>,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f32>,
    rms_norm_eps: Option<f32>,
    max_position_embeddings: usize,
    vocab_size: usize,
    tie_word_embeddings: Option<bool>,
    rope_scaling: Option<HfRopeScaling>,
    partial_rotary_factor: Option<f32>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    query_pre_attn_scalar: Option<f32>,
    /// Absent: Gemma 2's default cap; `null`: none.
    attn_logit_softcapping: Option<serde_json::Value>,
    final_logit_softcapping: Option<serde_json::Value>,
    rope_local_base_freq: Option<f32>,
    original_max_position_embeddings: Option<usize>,
    sliding_window_pattern: Option<usize>,
    layer_types: Option<Vec<String>>,
}

#[derive(Deserialize)]
struct HfRopeScaling {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    legacy_type: Option<String>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<f32>,
    long_factor: Option<Vec<f32>>,
    short_factor: Option<Vec<f32>>,
    attention_factor: Option<f32>,
}

/// Reads `dir/config.json` into a [`LlamaConfig`] (RoPE in halves, as every Hugging Face
/// checkpoint stores Q and K).
pub fn hf_config(dir: &Path) -> Result<LlamaConfig> {
    Ok(read_hf_config(dir)?.0)
}

/// [`hf_config`], and the per-dimension RoPE factors the config lists (LongRoPE's).
fn read_hf_config(dir: &Path) -> Result<(LlamaConfig, Option<Vec<f32>>)> {
    let path = dir.join(CONFIG_FILE);
    let text = std::fs::read(&path).map_err(|e| EngineError::io(&path, e))?;
    let c: HfConfig = serde_json::from_slice(&text)
        .map_err(|e| EngineError::format(&path, format!("invalid {CONFIG_FILE}: {e}")))?;
    let fail = |m: String| EngineError::format(&path, m);
    let arch = c
        .architectures
        .iter()
        .find_map(|a| ARCHITECTURES.iter().find(|(hf, _)| hf == a).map(|(_, ours)| *ours))
        .ok_or_else(|| {
            let supported: Vec<&str> = ARCHITECTURES.iter().map(|(hf, _)| *hf).collect();
            let found =
                if c.architectures.is_empty() { "none".into() } else { c.architectures.join(", ") };
            EngineError::Unsupported(format!(
                "architecture {found} (supported: {})",
                supported.join(", ")
            ))
        })?;
    let head_dim = match c.head_dim {
        Some(d) => d,
        None => c
            .hidden_size
            .checked_div(c.num_attention_heads)
            .ok_or_else(|| fail("num_attention_heads is 0".into()))?,
    };
    let rope_dims = match c.partial_rotary_factor {
        None => head_dim,
        Some(f) if f > 0.0 && f <= 1.0 => (head_dim as f32 * f) as usize,
        Some(f) => return Err(fail(format!("partial_rotary_factor {f} is not in (0, 1]"))),
    };
    let (rope_scaling, factors) = match &c.rope_scaling {
        None => (None, None),
        Some(s) => rope_scaling(s, &c, rope_dims, head_dim).map_err(fail)?,
    };
    // The forward pass attends over the whole context; capping the context at the sliding
    // window keeps it exact for models trained with one.
    let window = match arch {
        "mistral" | "phi3" => c.sliding_window,
        "qwen2" | "qwen3" if c.use_sliding_window == Some(true) => c.sliding_window,
        _ => None,
    };
    let context_length =
        window.map_or(c.max_position_embeddings, |w| w.min(c.max_position_embeddings));
    let config = LlamaConfig {
        arch: arch.to_string(),
        vocab_size: c.vocab_size,
        hidden: c.hidden_size,
        intermediate: c.intermediate_size,
        layers: c.num_hidden_layers,
        heads: c.num_attention_heads,
        kv_heads: c.num_key_value_heads.unwrap_or(c.num_attention_heads),
        head_dim,
        rope_dims,
        rope_theta: c.rope_theta.unwrap_or(10_000.0),
        rope_scaling,
        rope_style: RopeStyle::Halves,
        // transformers' default for all three architectures.
        rms_eps: c.rms_norm_eps.unwrap_or(1e-6),
        context_length,
        // Gemma ties its embeddings unless told otherwise; the others do not.
        tied_embeddings: c.tie_word_embeddings.unwrap_or(arch.starts_with("gemma")),
        gemma: gemma_block(&c, arch, head_dim).map_err(fail)?,
    };
    Ok((config, factors))
}

/// Gemma 2's or 3's block from their configs (transformers' defaults where a key is absent).
fn gemma_block(
    c: &HfConfig,
    arch: &str,
    head_dim: usize,
) -> std::result::Result<Option<Gemma>, String> {
    // A cap that is absent takes `default`; `null` means none.
    let cap = |c: &Option<serde_json::Value>, default: Option<f32>| match c {
        None => default,
        Some(v) => v.as_f64().map(|v| v as f32).filter(|c| *c > 0.0),
    };
    let query_scale = 1.0 / c.query_pre_attn_scalar.unwrap_or(head_dim as f32).sqrt();
    Ok(match arch {
        "gemma2" => Some(Gemma {
            sliding_window: c.sliding_window.unwrap_or(4096),
            global_every: 2,
            local_rope_theta: c.rope_theta.unwrap_or(10_000.0),
            query_scale,
            final_softcap: cap(&c.final_logit_softcapping, Some(30.0)),
            attn_softcap: cap(&c.attn_logit_softcapping, Some(50.0)),
            qk_norm: false,
            local_rope_scaled: true,
        }),
        "gemma3" => {
            // Newer configs list each layer's kind; this engine runs one global layer in N.
            let global_every = match &c.layer_types {
                None => c.sliding_window_pattern.unwrap_or(6),
                Some(kinds) => {
                    let n = kinds.iter().position(|k| k == "full_attention").map_or(0, |i| i + 1);
                    let periodic = kinds.iter().enumerate().all(|(l, k)| {
                        let global = n > 0 && l % n == n - 1;
                        k == if global { "full_attention" } else { "sliding_attention" }
                    });
                    if !periodic {
                        return Err(format!(
                            "layer_types {kinds:?} is not one full_attention layer in N"
                        ));
                    }
                    n
                }
            };
            Some(Gemma {
                sliding_window: c.sliding_window.unwrap_or(4096),
                global_every,
                local_rope_theta: c.rope_local_base_freq.unwrap_or(10_000.0),
                query_scale,
                final_softcap: cap(&c.final_logit_softcapping, None),
                attn_softcap: cap(&c.attn_logit_softcapping, None),
                qk_norm: true,
                local_rope_scaled: false,
            })
        }
        _ => None,
    })
}

/// `rope_scaling`'s kind, with the per-dimension factors LongRoPE lists.
type Scaling = (Option<RopeScaling>, Option<Vec<f32>>);

fn rope_scaling(
    s: &HfRopeScaling,
    c: &HfConfig,
    rope_dims: usize,
    head_dim: usize,
) -> std::result::Result<Scaling, String> {
    let kind = s.rope_type.as_deref().or(s.legacy_type.as_deref()).unwrap_or("default");
    if kind != "longrope" {
        return llama3_scaling(s).map(|k| (k, None));
    }
    // As llama.cpp's converter and loader read Phi-3.5's: the long factors when the context
    // exceeds the pre-training one, and transformers' attention factor.
    let original = c
        .original_max_position_embeddings
        .or(s.original_max_position_embeddings.map(|v| v as usize))
        .ok_or("original_max_position_embeddings is missing (required by longrope)")?;
    let long = c.max_position_embeddings > original;
    let (key, factors) =
        if long { ("long_factor", &s.long_factor) } else { ("short_factor", &s.short_factor) };
    let factors = factors.clone().ok_or(format!("rope_scaling.{key} is missing"))?;
    if factors.len() != rope_dims / 2 || factors.iter().any(|f| !f.is_finite() || *f <= 0.0) {
        return Err(format!(
            "rope_scaling.{key} must hold {} positive numbers, not {}",
            rope_dims / 2,
            factors.len()
        ));
    }
    if rope_dims != head_dim {
        return Err("longrope over part of each head is not supported".into());
    }
    let attn_factor = match s.attention_factor {
        Some(f) => f,
        None => {
            let (context, original) = (c.max_position_embeddings as f64, original as f64);
            if context <= original {
                1.0
            } else {
                (1.0 + (context / original).ln() / original.ln()).sqrt() as f32
            }
        }
    };
    Ok((Some(RopeScaling::LongRope { attn_factor, long }), Some(factors)))
}

fn llama3_scaling(s: &HfRopeScaling) -> std::result::Result<Option<RopeScaling>, String> {
    let kind = s.rope_type.as_deref().or(s.legacy_type.as_deref()).unwrap_or("default");
    match kind {
        "default" => Ok(None),
        "linear" => match s.factor {
            Some(f) if f.is_finite() && f > 0.0 => Ok(Some(RopeScaling::Linear(f))),
            other => Err(format!("rope_scaling.factor {other:?} is not a positive number")),
        },
        "llama3" => {
            let need = |v: Option<f32>, key: &str| {
                v.ok_or_else(|| format!("rope_scaling.{key} is missing (required by llama3)"))
            };
            Ok(Some(RopeScaling::Llama3(Llama3Scaling {
                factor: need(s.factor, "factor")?,
                low_freq_factor: need(s.low_freq_factor, "low_freq_factor")?,
                high_freq_factor: need(s.high_freq_factor, "high_freq_factor")?,
                original_max_position: need(
                    s.original_max_position_embeddings,
                    "original_max_position_embeddings",
                )?,
            })))
        }
        other => {
            Err(format!("rope_scaling type {other:?} is not supported (llama3 and linear are)"))
        }
    }
}

/// Loads the configuration and weights of the Hugging Face checkpoint in `dir`. The model
/// is returned too, for its file list.
pub fn load_safetensors_weights(dir: &Path) -> Result<(LlamaWeights, SafetensorsModel)> {
    let (config, factors) = read_hf_config(dir)?;
    let model = SafetensorsModel::open(dir)?;
    let gemma = config.gemma.is_some();
    let names = if gemma { hf_gemma_names() } else { hf_names() };
    // `load_weights` ties the head when `lm_head` is absent; only do so when the config says so.
    if !config.tied_embeddings && model.tensor(&names.output).is_none() {
        return Err(EngineError::format(
            model.describe(),
            format!("missing tensor {} (tie_word_embeddings is false)", names.output),
        ));
    }
    let mut weights = load_weights(&model, &names, config, factors)?;
    if gemma {
        weights.add_one_to_norms();
    }
    Ok((weights, model))
}

/// One tensor to write: its bytes, already encoded in a safetensors dtype.
struct RawTensor<'a> {
    dtype: Dtype,
    shape: &'a [usize],
    data: &'a [u8],
}

impl ::safetensors::View for RawTensor<'_> {
    fn dtype(&self) -> Dtype {
        self.dtype
    }

    fn shape(&self) -> &[usize] {
        self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(self.data)
    }

    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Writes a safetensors file of `(name, type, shape outer-first, little-endian bytes)`
/// tensors; types are limited to F32, F16 and BF16.
pub fn write_safetensors(
    path: &Path,
    tensors: &[(String, GgmlType, Vec<usize>, Vec<u8>)],
) -> Result<()> {
    let mut views = Vec::with_capacity(tensors.len());
    for (name, ty, shape, data) in tensors {
        let (dtype, elem_bytes) = match ty {
            GgmlType::F32 => (Dtype::F32, 4),
            GgmlType::F16 => (Dtype::F16, 2),
            GgmlType::BF16 => (Dtype::BF16, 2),
            other => {
                return Err(EngineError::Unsupported(format!(
                    "tensor {name}: safetensors cannot hold {}",
                    other.name()
                )));
            }
        };
        let need = shape.iter().try_fold(elem_bytes, |a: usize, &d| a.checked_mul(d));
        if need != Some(data.len()) {
            return Err(EngineError::format(
                path,
                format!("tensor {name}: {} bytes for shape {shape:?} of {dtype}", data.len()),
            ));
        }
        views.push((name.as_str(), RawTensor { dtype, shape, data }));
    }
    // transformers refuses files whose metadata does not name the framework.
    let metadata = HashMap::from([("format".to_string(), "pt".to_string())]);
    ::safetensors::serialize_to_file(views, Some(metadata), path).map_err(|e| match e {
        ::safetensors::SafeTensorError::IoError(io) => EngineError::io(path, io),
        other => EngineError::format(path, other.to_string()),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f32_bytes(v: &[f32]) -> Vec<u8> {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    fn raw_file(header: &str, data_len: usize) -> Vec<u8> {
        let mut b = (header.len() as u64).to_le_bytes().to_vec();
        b.extend_from_slice(header.as_bytes());
        b.resize(b.len() + data_len, 0);
        b
    }

    fn open_bytes(bytes: &[u8]) -> Result<SafetensorsModel> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::io("tempdir", e))?;
        let p = dir.path().join(SINGLE_FILE);
        std::fs::write(&p, bytes).map_err(|e| EngineError::io(&p, e))?;
        SafetensorsModel::open(dir.path())
    }

    fn message(r: Result<SafetensorsModel>) -> String {
        r.err().map(|e| e.to_string()).unwrap_or_default()
    }

    #[test]
    fn round_trips_every_float_type() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::io("tempdir", e))?;
        let p = dir.path().join(SINGLE_FILE);
        let x = [1.0f32, -2.0, 0.5, 3.25, 0.0, 7.0];
        let tensors: Vec<_> = [GgmlType::F32, GgmlType::F16, GgmlType::BF16]
            .into_iter()
            .map(|ty| {
                let bytes = crate::quant::quantize_row(ty, &x);
                (format!("t.{}", ty.name()), ty, vec![2, 3], bytes)
            })
            .collect();
        write_safetensors(&p, &tensors)?;
        let m = SafetensorsModel::open(dir.path())?;
        assert_eq!(m.weight_files(), [p]);
        assert_eq!(m.tensor_names(), ["t.BF16", "t.F16", "t.F32"]);
        for (name, ty, shape, bytes) in &tensors {
            let got = m.tensor(name);
            assert_eq!(got, Some((*ty, shape.clone(), &bytes[..])), "{name}");
        }
        Ok(())
    }

    #[test]
    fn every_truncation_is_an_error() -> Result<()> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::io("tempdir", e))?;
        let p = dir.path().join(SINGLE_FILE);
        let t = |n: &str| (n.to_string(), GgmlType::F32, vec![4], f32_bytes(&[1.0; 4]));
        write_safetensors(&p, &[t("a"), t("b")])?;
        let bytes = std::fs::read(&p).map_err(|e| EngineError::io(&p, e))?;
        for cut in 0..bytes.len() {
            let r = open_bytes(&bytes[..cut]);
            assert!(
                matches!(r, Err(EngineError::Format { .. })),
                "cut at {cut} of {}",
                bytes.len()
            );
        }
        Ok(())
    }

    #[test]
    fn hostile_headers_are_refused_by_name() {
        let absurd = [u64::MAX.to_le_bytes().as_slice(), b"{}"].concat();
        assert!(message(open_bytes(&absurd)).contains("header length"));

        let h = r#"{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,12]}}"#;
        let msg = message(open_bytes(&raw_file(h, 16)));
        assert!(msg.contains("tensor w") && msg.contains("needs 16"), "{msg}");

        let h = r#"{"ids":{"dtype":"I32","shape":[2],"data_offsets":[0,8]}}"#;
        let msg = message(open_bytes(&raw_file(h, 8)));
        assert!(msg.contains("tensor ids") && msg.contains("I32"), "{msg}");

        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F16","shape":[2],"data_offsets":[4,8]}}"#;
        let msg = message(open_bytes(&raw_file(h, 8)));
        assert!(msg.contains("a and b overlap"), "{msg}");

        let h = r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[18446744073709551615,7]}}"#;
        assert!(message(open_bytes(&raw_file(h, 8))).contains("tensor a"));

        let h = r#"{"a":{"dtype":"F32","shape":[4611686018427387904,4],"data_offsets":[0,8]}}"#;
        assert!(message(open_bytes(&raw_file(h, 8))).contains("overflows"));
    }

    #[test]
    fn write_refuses_mismatched_sizes_and_quantized_types() {
        let p = Path::new("/nonexistent/never-written.safetensors");
        let bad = [("w".to_string(), GgmlType::F32, vec![3], vec![0u8; 8])];
        let msg = write_safetensors(p, &bad).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("tensor w"), "{msg}");
        let q = [("q".to_string(), GgmlType::Q8_0, vec![32], vec![0u8; 34])];
        let msg = write_safetensors(p, &q).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(msg.contains("tensor q") && msg.contains("Q8_0"), "{msg}");
    }

    fn config_dir(json: &str) -> Result<(tempfile::TempDir, Result<LlamaConfig>)> {
        let dir = tempfile::tempdir().map_err(|e| EngineError::io("tempdir", e))?;
        let p = dir.path().join(CONFIG_FILE);
        std::fs::write(&p, json).map_err(|e| EngineError::io(&p, e))?;
        let c = hf_config(dir.path());
        Ok((dir, c))
    }

    const LLAMA3: &str = r#"{
        "architectures": ["LlamaForCausalLM"], "hidden_size": 2048, "intermediate_size": 8192,
        "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
        "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "max_position_embeddings": 131072,
        "vocab_size": 128256, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
        "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}
    }"#;

    #[test]
    fn reads_a_llama3_config() -> Result<()> {
        let (_dir, c) = config_dir(LLAMA3)?;
        let c = c?;
        assert_eq!((c.arch.as_str(), c.hidden, c.heads, c.kv_heads), ("llama", 2048, 32, 8));
        assert_eq!((c.head_dim, c.rope_dims, c.rope_style), (64, 64, RopeStyle::Halves));
        assert_eq!((c.context_length, c.vocab_size, c.tied_embeddings), (131072, 128256, true));
        assert_eq!(c.rope_theta, 500_000.0);
        let Some(RopeScaling::Llama3(s)) = c.rope_scaling else {
            return Err(EngineError::Unsupported(format!("scaling {:?}", c.rope_scaling)));
        };
        assert_eq!((s.factor, s.original_max_position), (32.0, 8192.0));
        // Linear scaling divides every frequency by its factor.
        let linear = LLAMA3.replace(
            r#""rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
            r#""rope_scaling": {"factor": 8.0, "rope_type": "linear"}"#,
        );
        let (_dir, linear) = config_dir(&linear)?;
        let linear = linear?;
        assert_eq!(linear.rope_scaling, Some(RopeScaling::Linear(8.0)));
        let plain = LlamaConfig { rope_scaling: None, ..linear.clone() }.inv_freq(None);
        for (a, b) in linear.inv_freq(None).iter().zip(&plain) {
            assert!((a * 8.0 - b).abs() <= b * 1e-6, "{a} {b}");
        }
        Ok(())
    }

    #[test]
    fn config_defaults_and_sliding_window() -> Result<()> {
        let mistral = r#"{"architectures": ["MistralForCausalLM"], "hidden_size": 256,
            "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
            "max_position_embeddings": 32768, "vocab_size": 1000, "sliding_window": 4096,
            "head_dim": null, "rope_scaling": null}"#;
        let (_dir, c) = config_dir(mistral)?;
        let c = c?;
        assert_eq!((c.arch.as_str(), c.kv_heads, c.head_dim), ("mistral", 4, 64));
        assert_eq!((c.rope_theta, c.rms_eps, c.tied_embeddings), (10_000.0, 1e-6, false));
        assert_eq!(c.context_length, 4096);
        let qwen = mistral.replace("MistralForCausalLM", "Qwen2ForCausalLM");
        let (_dir, c) = config_dir(&qwen)?;
        assert_eq!(c?.context_length, 32768, "qwen2 ignores the window unless enabled");
        let partial = mistral.replace("\"head_dim\": null", "\"partial_rotary_factor\": 0.5");
        let (_dir, c) = config_dir(&partial)?;
        assert_eq!(c?.rope_dims, 32);
        Ok(())
    }

    #[test]
    fn config_errors_name_the_problem() -> Result<()> {
        let cases = [
            (LLAMA3.replace("LlamaForCausalLM", "GPT2LMHeadModel"), "architecture GPT2LMHeadModel"),
            (LLAMA3.replace("\"llama3\"", "\"yarn\""), "rope_scaling type \"yarn\""),
            (LLAMA3.replace("\"factor\": 32.0,", ""), "rope_scaling.factor"),
            (LLAMA3.replace("\"hidden_size\": 2048,", ""), "hidden_size"),
            (
                LLAMA3.replace("\"rope_theta\": 500000.0,", "\"rope_theta\": \"x\","),
                "line 4 column",
            ),
        ];
        for (json, want) in cases {
            let (_dir, c) = config_dir(&json)?;
            let msg = c.err().map(|e| e.to_string()).unwrap_or_default();
            assert!(msg.contains(want), "{want}: {msg}");
        }
        Ok(())
    }
}
