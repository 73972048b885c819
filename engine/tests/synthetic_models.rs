//! Synthetic random-weight models through both loaders: a GGUF file (Q and K permuted for
//! interleaved RoPE, every tensor type) and a Hugging Face directory (single file or shards)
//! of the same spec must give the same logits, and corrupt inputs must give errors that
//! name what is wrong.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, ensure};
use sluice_engine::EngineError;
use sluice_engine::forward::{KvCache, LogitsWanted, Runner, SeqInput};
use sluice_engine::interrupt::Interrupt;
use sluice_engine::model::{
    LlamaConfig, LlamaWeights, RopeStyle, TensorSource, gguf_config, gguf_names, hf_gemma_names,
    hf_names, load_gguf_weights, load_weights,
};
use sluice_engine::quant::GgmlType;
use sluice_engine::safetensors::{
    INDEX_FILE, SINGLE_FILE, SafetensorsModel, hf_config, load_safetensors_weights,
    write_safetensors,
};
use sluice_engine::synth::{SynthSpec, write_gguf, write_safetensors_dir};
use sluice_text::gguf::GgufFile;
use sluice_text::tokenizer::Tokenizer;

/// Tokens per KV cache block: small, so sequences span several blocks.
const BLOCK: usize = 4;

/// Logits of a batch of two sequences of different lengths (every position), then of one
/// decode step of each.
fn run(w: &LlamaWeights) -> anyhow::Result<Vec<f32>> {
    run_interrupted(w, None)
}

/// [`run`], each pass first interrupted by a higher priority when `interrupt` is given.
fn run_interrupted(
    w: &LlamaWeights,
    interrupt: Option<Arc<Interrupt>>,
) -> anyhow::Result<Vec<f32>> {
    let vocab = w.config.vocab_size as u32;
    let a: Vec<u32> = (0..7).map(|i| (i * 37 + 5) % vocab).collect();
    let b: Vec<u32> = (0..12).map(|i| (i * 53 + 11) % vocab).collect();
    let (table_a, table_b) = ([0, 1, 2], [3, 4, 5, 6]);
    let mut runner = Runner::new(2);
    if let Some(i) = &interrupt {
        runner.set_interrupt(Arc::clone(i));
    }
    let mut cache = KvCache::new(w, BLOCK, 8);
    // A pass of priority 0 that a priority-1 arrival stops after its first layer (its K/V
    // written there), then the pass again.
    let mut forward = |batch: &[SeqInput<'_>]| -> anyhow::Result<Vec<f32>> {
        if let Some(i) = &interrupt {
            i.begin(0, 1.0, std::collections::HashMap::new(), Vec::new());
            i.arrive(1, "ent", 1);
            let cut = runner.forward(w, &mut cache, batch);
            ensure!(matches!(cut, Err(EngineError::Interrupted)), "not interrupted: {cut:?}");
            // As the engine's core would: the pass again, whole; the next may be cut.
            i.end(true);
            i.begin(0, 1.0, std::collections::HashMap::new(), Vec::new());
            i.end(false);
        }
        Ok(runner.forward(w, &mut cache, batch)?)
    };
    let seq = |tokens, start_pos, block_table, logits| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits,
        adapter: None,
    };
    let prefill = [
        seq(&a[..], 0, &table_a[..], LogitsWanted::All),
        seq(&b[..], 0, &table_b[..], LogitsWanted::All),
    ];
    let mut logits = forward(&prefill)?;
    let decode = [
        seq(&[9], a.len(), &table_a[..], LogitsWanted::Last),
        seq(&[10], b.len(), &table_b[..], LogitsWanted::Last),
    ];
    logits.extend(forward(&decode)?);
    ensure!(logits.len() == (a.len() + b.len() + 2) * vocab as usize, "wrong logits count");
    ensure!(logits.iter().all(|x| x.is_finite()), "non-finite logits");
    Ok(logits)
}

/// Largest absolute difference relative to the largest reference logit.
fn rel_diff(reference: &[f32], other: &[f32]) -> f32 {
    let scale = reference.iter().fold(0f32, |m, x| m.max(x.abs()));
    let diff = reference.iter().zip(other).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
    diff / scale
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| f64::from(p * q)).sum::<f64>();
    (dot(a, b) / (dot(a, a) * dot(b, b)).sqrt()) as f32
}

fn err_text<T>(r: sluice_engine::Result<T>) -> anyhow::Result<(EngineError, String)> {
    match r {
        Ok(_) => anyhow::bail!("expected an error"),
        Err(e) => {
            let msg = e.to_string();
            Ok((e, msg))
        }
    }
}

fn gguf_and_safetensors_agree(spec: &SynthSpec) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let gguf_path = dir.path().join("m.gguf");
    let hf_dir = dir.path().join("hf");
    write_gguf(spec, GgmlType::F32, &gguf_path)?;
    write_safetensors_dir(spec, GgmlType::F32, &hf_dir, 1)?;

    let file = GgufFile::open(&gguf_path)?;
    let from_gguf = load_gguf_weights(&file)?;
    let (from_hf, model) = load_safetensors_weights(&hf_dir)?;
    let gguf_style =
        if spec.arch() == "llama" { RopeStyle::Interleaved } else { RopeStyle::Halves };
    ensure!(from_hf.config == spec.config(), "{:?}", from_hf.config);
    ensure!(
        from_gguf.config == LlamaConfig { rope_style: gguf_style, ..spec.config() },
        "{:?}",
        from_gguf.config
    );

    let (by_gguf, by_hf) = (run(&from_gguf)?, run(&from_hf)?);
    let diff = rel_diff(&by_hf, &by_gguf);
    ensure!(diff <= 1e-3, "{}: GGUF and safetensors logits differ by {diff}", spec.arch());

    // The same weights rotated the other way must disagree, or the check above would pass
    // whatever the permutation and RoPE styles did.
    let mut wrong = hf_config(&hf_dir)?;
    wrong.rope_style = RopeStyle::Interleaved;
    let names = if spec.gemma() { hf_gemma_names() } else { hf_names() };
    let mut wrong = load_weights(&model, &names, wrong, None)?;
    if spec.gemma() {
        wrong.add_one_to_norms();
    }
    let control = rel_diff(&by_hf, &run(&wrong)?);
    ensure!(control > 1e-2, "{}: wrong RoPE style changes logits by only {control}", spec.arch());
    Ok(())
}

#[test]
fn gguf_and_safetensors_give_the_same_logits_llama() -> anyhow::Result<()> {
    gguf_and_safetensors_agree(&SynthSpec::tiny())
}

/// Gemma 2 from a Hugging Face directory: its own norm names, norm weights stored less one,
/// capped scores and logits read from config.json.
#[test]
fn gguf_and_safetensors_give_the_same_logits_gemma2() -> anyhow::Result<()> {
    gguf_and_safetensors_agree(&SynthSpec { gemma2: true, tied: true, ..SynthSpec::tiny() })
}

/// Gemma 3 from a Hugging Face directory: per-head Q/K norms (stored less one too), a window
/// pattern from `layer_types`, its sliding layers' own RoPE base.
#[test]
fn gguf_and_safetensors_give_the_same_logits_gemma3() -> anyhow::Result<()> {
    let spec = SynthSpec {
        gemma3: true,
        qk_norm: true,
        tied: true,
        rope_theta: 1_000_000.0,
        ..SynthSpec::tiny()
    };
    gguf_and_safetensors_agree(&spec)
}

/// Phi-3.5's LongRoPE from either format: factors as tensors or as config lists, the same
/// attention factor.
#[test]
fn gguf_and_safetensors_give_the_same_logits_phi3_longrope() -> anyhow::Result<()> {
    gguf_and_safetensors_agree(&SynthSpec { fused: true, longrope: true, ..SynthSpec::tiny() })
}

#[test]
fn gguf_and_safetensors_give_the_same_logits_qwen2_with_bias() -> anyhow::Result<()> {
    gguf_and_safetensors_agree(&SynthSpec { qkv_bias: true, tied: true, ..SynthSpec::tiny() })
}

/// Qwen3: per-head Q/K RMSNorm before RoPE, from either format; the norms are read and
/// applied (scaling one of them changes the logits), and a file without them is refused
/// naming the tensor.
#[test]
fn gguf_and_safetensors_give_the_same_logits_qwen3_with_qk_norm() -> anyhow::Result<()> {
    let spec = SynthSpec { qk_norm: true, tied: true, ..SynthSpec::tiny() };
    gguf_and_safetensors_agree(&spec)?;
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("q3.gguf");
    write_gguf(&spec, GgmlType::F32, &path)?;
    let mut w = load_gguf_weights(&GgufFile::open(&path)?)?;
    ensure!(w.config.arch == "qwen3" && w.layers.iter().all(|l| l.q_norm.is_some()));
    let before = run(&w)?;
    if let Some(k) = w.layers[0].k_norm.as_mut() {
        k.iter_mut().enumerate().for_each(|(i, x)| *x *= 1.0 + (i % 3) as f32);
    }
    let control = rel_diff(&before, &run(&w)?);
    ensure!(control > 1e-2, "a different K norm changes logits by only {control}");

    let hf = dir.path().join("hf");
    write_safetensors_dir(&spec, GgmlType::F32, &hf, 1)?;
    rewrite(&hf, |t| t.retain(|(name, ..)| name != "model.layers.1.self_attn.q_norm.weight"))?;
    let (_, msg) = err_text(load_safetensors_weights(&hf).map(|_| ()))?;
    ensure!(msg.contains("model.layers.1.self_attn.q_norm.weight"), "{msg}");
    Ok(())
}

/// A Phi-3 file seen as separate Q, K, V, gate and up matrices: row ranges of its fused
/// `attn_qkv` and `ffn_up` (gate first), cut here independently of the loader.
struct Unfused<'a> {
    file: &'a GgufFile,
    q: usize,
    kv: usize,
    ffn: usize,
}

impl TensorSource for Unfused<'_> {
    fn describe(&self) -> String {
        TensorSource::describe(self.file)
    }

    fn tensor(&self, name: &str) -> Option<(GgmlType, Vec<usize>, &[u8])> {
        let Some((block, leaf)) = name.strip_suffix(".weight").and_then(|b| b.rsplit_once('.'))
        else {
            return TensorSource::tensor(self.file, name);
        };
        let (fused, rows) = match leaf {
            "attn_q" => ("attn_qkv", 0..self.q),
            "attn_k" => ("attn_qkv", self.q..self.q + self.kv),
            "attn_v" => ("attn_qkv", self.q + self.kv..self.q + 2 * self.kv),
            "ffn_gate" => ("ffn_up", 0..self.ffn),
            "ffn_up" => ("ffn_up", self.ffn..2 * self.ffn),
            "attn_qkv" => return None,
            _ => return TensorSource::tensor(self.file, name),
        };
        let (ty, shape, bytes) =
            TensorSource::tensor(self.file, &format!("{block}.{fused}.weight"))?;
        let row = bytes.len() / shape[0];
        Some((ty, vec![rows.len(), shape[1]], &bytes[rows.start * row..rows.end * row]))
    }
}

/// Phi-3: fused Q/K/V and gate/up matrices, from either format; the loader's split gives
/// exactly the logits of the same rows loaded as separate matrices (in every packed type).
#[test]
fn phi3_fused_matrices_are_their_parts() -> anyhow::Result<()> {
    let spec = SynthSpec { fused: true, hidden: 256, intermediate: 512, ..SynthSpec::tiny() };
    gguf_and_safetensors_agree(&spec)?;
    let dir = tempfile::tempdir()?;
    for ty in [GgmlType::F32, GgmlType::Q8_0, GgmlType::Q4K, GgmlType::Q6K] {
        let path = dir.path().join(format!("phi3.{}.gguf", ty.name()));
        write_gguf(&spec, ty, &path)?;
        let file = GgufFile::open(&path)?;
        let fused = load_gguf_weights(&file)?;
        ensure!(fused.config.arch == "phi3", "{:?}", fused.config.arch);
        let c = &fused.config;
        let parts = Unfused { file: &file, q: c.q_dim(), kv: c.kv_dim(), ffn: c.intermediate };
        ensure!(parts.tensor("blk.0.attn_qkv.weight").is_none());
        let split = load_weights(&parts, &gguf_names(), gguf_config(&file)?, None)?;
        ensure!(run(&fused)? == run(&split)?, "{}: fused and split logits differ", ty.name());
    }
    Ok(())
}

#[test]
fn a_pass_interrupted_between_layers_leaves_nothing_behind() -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    write_gguf(&SynthSpec::tiny(), GgmlType::F32, &path)?;
    let w = load_gguf_weights(&GgufFile::open(&path)?)?;
    let whole = run(&w)?;
    let again = run_interrupted(&w, Some(Arc::default()))?;
    ensure!(
        whole == again,
        "logits differ by {} after interrupted passes",
        rel_diff(&whole, &again)
    );
    Ok(())
}

#[test]
fn sharded_safetensors_load_like_a_single_file() -> anyhow::Result<()> {
    let spec = SynthSpec { seed: 7, ..SynthSpec::tiny() };
    let dir = tempfile::tempdir()?;
    let (single, sharded) = (dir.path().join("single"), dir.path().join("sharded"));
    write_safetensors_dir(&spec, GgmlType::BF16, &single, 1)?;
    write_safetensors_dir(&spec, GgmlType::BF16, &sharded, 3)?;
    ensure!(sharded.join(INDEX_FILE).is_file() && !sharded.join(SINGLE_FILE).exists());

    let (w1, m1) = load_safetensors_weights(&single)?;
    let (w3, m3) = load_safetensors_weights(&sharded)?;
    ensure!(m1.weight_files() == [single.join(SINGLE_FILE)]);
    let shard_names: Vec<PathBuf> =
        (1..=3).map(|k| sharded.join(format!("model-{k:05}-of-00003.safetensors"))).collect();
    ensure!(m3.weight_files() == shard_names, "{:?}", m3.weight_files());
    ensure!(m1.tensor_names() == m3.tensor_names());
    for name in m1.tensor_names() {
        ensure!(m1.tensor(name) == m3.tensor(name), "tensor {name} differs");
    }
    ensure!(run(&w1)? == run(&w3)?, "sharded logits differ");
    Ok(())
}

#[test]
fn every_gguf_tensor_type_runs_close_to_f32() -> anyhow::Result<()> {
    // Row lengths must be whole K-quant super-blocks (256).
    let spec = SynthSpec { hidden: 256, intermediate: 512, seed: 3, ..SynthSpec::tiny() };
    let dir = tempfile::tempdir()?;
    let mut reference = None;
    for ty in GgmlType::ALL {
        let path = dir.path().join(format!("m.{}.gguf", ty.name()));
        write_gguf(&spec, ty, &path)?;
        let file = GgufFile::open(&path)?;
        let q = file.tensor("blk.0.ffn_down.weight").context("ffn_down")?;
        ensure!(q.ty == ty, "{}: stored as {}", ty.name(), q.ty.name());
        let logits = run(&load_gguf_weights(&file)?).with_context(|| ty.name())?;
        let Some(f32_logits) = &reference else {
            reference = Some(logits);
            continue;
        };
        let (diff, cos) = (rel_diff(f32_logits, &logits), cosine(f32_logits, &logits));
        println!("{:5}: relative max diff {diff:.4}, cosine {cos:.5}", ty.name());
        let (max_diff, min_cos) = match ty {
            GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 => (0.05, 0.999),
            GgmlType::Q6K => (0.15, 0.99),
            _ => (0.6, 0.9),
        };
        ensure!(diff <= max_diff && cos >= min_cos, "{}: diff {diff}, cosine {cos}", ty.name());
    }
    Ok(())
}

/// A Hugging Face directory of the tiny spec, in F32.
fn tiny_hf_dir(root: &Path) -> anyhow::Result<PathBuf> {
    let dir = root.join("hf");
    write_safetensors_dir(&SynthSpec::tiny(), GgmlType::F32, &dir, 1)?;
    Ok(dir)
}

type Tensors = Vec<(String, GgmlType, Vec<usize>, Vec<u8>)>;

/// Rewrites `dir`'s model.safetensors after `edit` changes its tensors.
fn rewrite(dir: &Path, edit: impl FnOnce(&mut Tensors)) -> anyhow::Result<()> {
    let path = dir.join(SINGLE_FILE);
    let mut tensors: Tensors = {
        let m = SafetensorsModel::open(dir)?;
        let mut out = Vec::new();
        for name in m.tensor_names() {
            let (ty, shape, bytes) = m.tensor(name).context("listed tensor")?;
            out.push((name.to_string(), ty, shape, bytes.to_vec()));
        }
        out
    };
    edit(&mut tensors);
    write_safetensors(&path, &tensors)?;
    Ok(())
}

#[test]
fn truncated_safetensors_are_errors() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = tiny_hf_dir(root.path())?;
    let path = dir.join(SINGLE_FILE);
    let bytes = std::fs::read(&path)?;
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let n = bytes.len();
    for cut in
        [0, 5, 8, 9, header_end / 2, header_end - 1, header_end, header_end + 3, n / 2, n - 1]
    {
        std::fs::write(&path, &bytes[..cut])?;
        let (e, msg) = err_text(load_safetensors_weights(&dir))?;
        ensure!(matches!(e, EngineError::Format { .. }), "cut {cut}: {msg}");
        ensure!(msg.contains(SINGLE_FILE), "cut {cut}: {msg}");
    }
    Ok(())
}

#[test]
fn absurd_header_lengths_are_errors() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = tiny_hf_dir(root.path())?;
    let path = dir.join(SINGLE_FILE);
    let bytes = std::fs::read(&path)?;
    for len in [u64::MAX, 1 << 40, bytes.len() as u64] {
        let mut b = bytes.clone();
        b[..8].copy_from_slice(&len.to_le_bytes());
        std::fs::write(&path, &b)?;
        let (e, msg) = err_text(SafetensorsModel::open(&dir))?;
        ensure!(matches!(e, EngineError::Format { .. }) && msg.contains("header"), "{len}: {msg}");
    }
    Ok(())
}

#[test]
fn wrong_shapes_name_the_tensor() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = tiny_hf_dir(root.path())?;
    // Consistent in the file, wrong for the config.
    let q = "model.layers.1.self_attn.q_proj.weight";
    rewrite(&dir, |t| {
        if let Some(e) = t.iter_mut().find(|e| e.0 == q) {
            e.2 = vec![e.2[0] / 2, e.2[1] * 2];
        }
    })?;
    let (_, msg) = err_text(load_safetensors_weights(&dir))?;
    ensure!(msg.contains(q) && msg.contains("shape"), "{msg}");

    // Inconsistent in the file itself: the header's shape disagrees with its byte range.
    let dir = root.path().join("hf2");
    write_safetensors_dir(&SynthSpec::tiny(), GgmlType::F32, &dir, 1)?;
    let path = dir.join(SINGLE_FILE);
    let bytes = std::fs::read(&path)?;
    let header_end = 8 + u64::from_le_bytes(bytes[..8].try_into()?) as usize;
    let header = std::str::from_utf8(&bytes[8..header_end])?;
    let entry = "\"model.norm.weight\":{\"dtype\":\"F32\",\"shape\":[64]";
    ensure!(header.contains(entry), "unexpected header layout: {header}");
    let patched = header.replace(entry, &entry.replace("[64]", "[63]"));
    let mut b = bytes[..8].to_vec();
    b.extend_from_slice(patched.as_bytes());
    b.extend_from_slice(&bytes[header_end..]);
    std::fs::write(&path, &b)?;
    let (e, msg) = err_text(SafetensorsModel::open(&dir))?;
    ensure!(matches!(e, EngineError::Format { .. }), "{msg}");
    ensure!(msg.contains("tensor model.norm.weight") && msg.contains("[63]"), "{msg}");
    Ok(())
}

#[test]
fn missing_tensors_are_named() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = tiny_hf_dir(root.path())?;
    for name in ["model.layers.1.mlp.down_proj.weight", "lm_head.weight"] {
        rewrite(&dir, |t| t.retain(|e| e.0 != name))?;
        let (_, msg) = err_text(load_safetensors_weights(&dir))?;
        ensure!(msg.contains(&format!("missing tensor {name}")), "{msg}");
        write_safetensors_dir(&SynthSpec::tiny(), GgmlType::F32, &dir, 1)?;
    }
    Ok(())
}

#[test]
fn unsupported_architectures_are_named() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = tiny_hf_dir(root.path())?;
    let config = dir.join("config.json");
    let text = std::fs::read_to_string(&config)?;
    std::fs::write(&config, text.replace("LlamaForCausalLM", "GPT2LMHeadModel"))?;
    let (e, msg) = err_text(load_safetensors_weights(&dir))?;
    ensure!(matches!(e, EngineError::Unsupported(_)), "{msg}");
    ensure!(msg.contains("unsupported model: architecture GPT2LMHeadModel"), "{msg}");
    Ok(())
}

#[test]
fn broken_shard_indexes_are_errors() -> anyhow::Result<()> {
    let root = tempfile::tempdir()?;
    let dir = root.path().join("hf");
    write_safetensors_dir(&SynthSpec::tiny(), GgmlType::F16, &dir, 2)?;
    let index = dir.join(INDEX_FILE);
    let text = std::fs::read_to_string(&index)?;
    let first = "model-00001-of-00002.safetensors";
    let second = "model-00002-of-00002.safetensors";

    // A tensor placed in the wrong shard.
    let mut v: serde_json::Value = serde_json::from_str(&text)?;
    v["weight_map"]["model.norm.weight"] = serde_json::json!(first);
    std::fs::write(&index, v.to_string())?;
    let (_, msg) = err_text(SafetensorsModel::open(&dir))?;
    ensure!(msg.contains("tensor model.norm.weight") && msg.contains(first), "{msg}");

    // A shard that is gone.
    std::fs::write(&index, &text)?;
    std::fs::remove_file(dir.join(second))?;
    let (e, msg) = err_text(SafetensorsModel::open(&dir))?;
    ensure!(matches!(e, EngineError::Io { .. }) && msg.contains(second), "{msg}");

    // A shard outside the directory.
    std::fs::write(&index, text.replace(second, "../elsewhere.safetensors"))?;
    let (_, msg) = err_text(SafetensorsModel::open(&dir))?;
    ensure!(msg.contains("../elsewhere.safetensors"), "{msg}");
    Ok(())
}

#[test]
fn gguf_and_hf_tokenizers_agree() -> anyhow::Result<()> {
    let spec = SynthSpec::tiny();
    let root = tempfile::tempdir()?;
    let gguf_path = root.path().join("m.gguf");
    write_gguf(&spec, GgmlType::F32, &gguf_path)?;
    let dir = tiny_hf_dir(root.path())?;
    let from_gguf = Tokenizer::from_gguf(&GgufFile::open(&gguf_path)?)?;
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("tokenizer_config.json"))?)?;
    let from_hf = Tokenizer::from_hf_file(&dir.join("tokenizer.json"), Some(&config))?;

    ensure!(from_gguf.bos_id() == from_hf.bos_id() && from_gguf.bos_id().is_some());
    ensure!(from_gguf.eos_id() == from_hf.eos_id() && from_gguf.eos_id().is_some());
    ensure!(!from_gguf.add_bos() && !from_hf.add_bos());
    let hello = from_gguf.token_id("Hello").context("Hello is a merged token")?;
    ensure!(from_gguf.encode("Hello", false)? == [hello]);
    let texts = [
        "Hello world, the cat is in here.\n\nAnd there: 12345 + 6 = 12351!",
        "<|im_start|>user\nHello?<|im_end|>\n<|im_start|>assistant\n",
        "  tabs\tand émojis 🦀, symbols $^~|<=>",
    ];
    for text in texts {
        for special in [false, true] {
            let (a, b) = (from_gguf.encode(text, special)?, from_hf.encode(text, special)?);
            ensure!(a == b, "{text:?} (special {special}): {a:?} vs {b:?}");
            ensure!(from_gguf.decode(&a, false)? == text, "{text:?} does not round-trip");
        }
    }
    Ok(())
}
