//! Teacher-forced agreement with llama.cpp on the default model (see
//! engine/tests/golden/README.md).

mod common;

use sluice_engine::forward::{KvCache, LogitsWanted, Runner, SeqInput};
use sluice_engine::model::{LlamaWeights, load_gguf_weights};
use sluice_text::gguf::GgufFile;

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let lse = logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    logits.iter().map(|&l| l - lse).collect()
}

/// Feeds each golden prompt and llama.cpp's completion but its last token in one pass and
/// compares our log-probabilities at every generated position with llama.cpp's; returns
/// (positions, top-1 checked, median, max) of |d logprob| of llama.cpp's top-1 token.
fn agreement(
    weights: &LlamaWeights,
    items: &[serde_json::Value],
) -> anyhow::Result<(usize, usize, f32, f32)> {
    agreement_with(weights, None, items).map(|a| (a.positions, a.checked, a.median, a.max))
}

/// What [`agreement_with`] measured.
struct Agreement {
    positions: usize,
    /// Positions whose top-1 was checked against llama.cpp's.
    checked: usize,
    /// Median and max |d logprob| against llama.cpp's top-1.
    median: f32,
    max: f32,
    /// Positions where llama.cpp's clear top-1 is not the exact reference's (not checked).
    llama_wrong: Vec<usize>,
    /// Positions where llama.cpp's top-1 is clear but the exact reference's is a near tie
    /// (it leads by less than [`NEAR_TIE`]): quantized arithmetic, llama.cpp's or ours,
    /// decides those (not checked).
    near_ties: Vec<usize>,
    /// Median and max |d logprob| against the exact reference, and top-1s checked against it.
    exact_median: f32,
    exact_max: f32,
    exact_checked: usize,
}

/// Log-probabilities of every completion position of a golden item.
fn item_logprobs(
    weights: &LlamaWeights,
    item: &serde_json::Value,
) -> anyhow::Result<Vec<Vec<f32>>> {
    let vocab = weights.config.vocab_size;
    let mut runner = Runner::new(0);
    let mut cache = KvCache::new(weights, 16, 64);
    let table: Vec<u32> = (0..64).collect();
    let prompt = common::ids(&item["prompt_tokens"]);
    let completion = common::ids(&item["completion_tokens"]);
    let mut input = prompt.clone();
    input.extend_from_slice(&completion[..completion.len() - 1]);
    let seq = SeqInput {
        tokens: &input,
        start_pos: 0,
        block_table: &table,
        logits: LogitsWanted::All,
        adapter: None,
    };
    let logits = runner.forward(weights, &mut cache, &[seq])?;
    Ok((0..completion.len())
        .map(|pos| {
            let row = prompt.len() - 1 + pos;
            log_softmax(&logits[row * vocab..(row + 1) * vocab])
        })
        .collect())
}

fn argmax(lp: &[f32]) -> usize {
    lp.iter()
        .enumerate()
        .fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a })
        .0
}

/// The same model with every matrix dequantized to f32 and multiplied in f32 (no quantized
/// activations): the arithmetic both llama.cpp and this engine approximate.
fn exact_weights(file: &GgufFile) -> anyhow::Result<LlamaWeights> {
    use sluice_engine::cpu::matmul::PackedWeight;
    use sluice_engine::quant::GgmlType;
    let exact = |p: &PackedWeight| {
        let mut bytes = Vec::with_capacity(p.rows * p.cols * 4);
        let mut row = vec![0f32; p.cols];
        for r in 0..p.rows {
            p.dequantize_row(r, &mut row);
            row.iter().for_each(|v| bytes.extend_from_slice(&v.to_le_bytes()));
        }
        PackedWeight::new(GgmlType::F32, p.rows, p.cols, &bytes)
    };
    let mut w = load_gguf_weights(file)?;
    w.embed = exact(&w.embed);
    w.output = w.output.as_ref().map(exact);
    for l in &mut w.layers {
        for m in
            [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo, &mut l.w_gate, &mut l.w_up, &mut l.w_down]
        {
            *m = exact(m);
        }
    }
    Ok(w)
}

/// An exact top-1 that leads by less than this is a near tie: 8-bit activations move a
/// log-probability by up to the bounds below (0.3 against the exact reference), so such a
/// lead can go either way in any quantized implementation. It is the lead this test calls
/// clear everywhere else.
const NEAR_TIE: f32 = 0.3;

/// [`agreement`], and with an exact reference: llama.cpp's top-1 is checked only where the
/// reference agrees with it (where it does not, llama.cpp's own arithmetic made it), and our
/// log-probabilities are measured against the reference too.
fn agreement_with(
    weights: &LlamaWeights,
    reference: Option<&LlamaWeights>,
    items: &[serde_json::Value],
) -> anyhow::Result<Agreement> {
    let mut diffs = Vec::new();
    let mut exact_diffs = Vec::new();
    let (mut checked_top1, mut exact_checked) = (0, 0);
    let mut llama_wrong = Vec::new();
    let mut near_ties = Vec::new();
    for item in items {
        let ours = item_logprobs(weights, item)?;
        let exact = reference.map(|r| item_logprobs(r, item)).transpose()?;
        for step in item["steps"].as_array().into_iter().flatten() {
            let pos = step["pos"].as_u64().unwrap_or(0) as usize;
            let lp = &ours[pos];
            let top = step["top"].as_array().cloned().unwrap_or_default();
            let (t1, l1) = (
                top[0][0].as_u64().unwrap_or(0) as usize,
                top[0][1].as_f64().unwrap_or(0.0) as f32,
            );
            let l2 = top[1][1].as_f64().unwrap_or(0.0) as f32;
            diffs.push((lp[t1] - l1).abs());
            let exact_lp = exact.as_ref().map(|e| &e[pos]);
            let mut exact_lead = f32::INFINITY;
            if let Some(e) = exact_lp {
                exact_diffs.push((lp[t1] - e[t1]).abs());
                // Where the exact arithmetic has a clear top-1, ours must be it.
                let mut sorted = e.clone();
                sorted.sort_by(|a, b| b.total_cmp(a));
                exact_lead = sorted[0] - sorted[1];
                if exact_lead >= 0.3 {
                    anyhow::ensure!(
                        argmax(lp) == argmax(e),
                        "top-1 differs from the exact reference's at pos {pos} of {:?}",
                        item.get("prompt").or(item.get("messages"))
                    );
                    exact_checked += 1;
                }
            }
            if l1 - l2 >= 0.3 {
                if exact_lp.is_some_and(|e| argmax(e) != t1) {
                    llama_wrong.push(pos);
                    continue;
                }
                if exact_lead < NEAR_TIE {
                    near_ties.push(pos);
                    continue;
                }
                let ours = argmax(lp);
                anyhow::ensure!(
                    ours == t1,
                    "top-1 differs at pos {pos} of {:?}: ours {ours}, llama.cpp {t1} (leading by \
                     {:.3}; ours by {:.3}; the exact reference by {exact_lead:.3}, {:?})",
                    item.get("prompt").or(item.get("messages")),
                    l1 - l2,
                    lp[ours] - lp[t1],
                    exact_lp.map(|e| e[t1] - e[ours])
                );
                checked_top1 += 1;
            }
        }
    }
    anyhow::ensure!(!diffs.is_empty(), "no golden steps");
    diffs.sort_by(f32::total_cmp);
    exact_diffs.sort_by(f32::total_cmp);
    let (median, max) = (diffs[diffs.len() / 2], diffs[diffs.len() - 1]);
    let (exact_median, exact_max) =
        exact_diffs.last().map_or((0.0, 0.0), |&m| (exact_diffs[exact_diffs.len() / 2], m));
    Ok(Agreement {
        positions: diffs.len(),
        checked: checked_top1,
        median,
        max,
        llama_wrong,
        near_ties,
        exact_median,
        exact_max,
        exact_checked,
    })
}

#[test]
fn teacher_forced_logits_agree_with_llama_cpp() -> anyhow::Result<()> {
    let golden = common::golden()?;
    let file = GgufFile::open(&common::default_model()?)?;
    let weights = load_gguf_weights(&file)?;
    let items = ["completion", "chat"]
        .iter()
        .flat_map(|k| golden[*k].as_array().cloned().unwrap_or_default())
        .collect::<Vec<_>>();
    anyhow::ensure!(items.len() == 14, "expected 14 golden items, found {}", items.len());
    let (n, checked, median, max) = agreement(&weights, &items)?;
    println!("positions {n} (top-1 checked {checked}), |dlogprob| median {median:.4} max {max:.4}");
    anyhow::ensure!(median <= 0.05, "median |dlogprob| {median} > 0.05");
    anyhow::ensure!(max <= 0.5, "max |dlogprob| {max} > 0.5");
    Ok(())
}

#[test]
fn gemma3_teacher_forced_logits_agree_with_llama_cpp() -> anyhow::Result<()> {
    let golden = common::gemma_golden()?;
    let file = GgufFile::open(&common::gemma_model()?)?;
    let weights = load_gguf_weights(&file)?;
    let c = &weights.config;
    anyhow::ensure!(c.arch == "gemma3" && c.vocab_size == 262_144 && c.layers == 18, "{c:?}");
    let items = golden["completion"].as_array().cloned().unwrap_or_default();
    anyhow::ensure!(items.len() == 10, "expected 10 golden items, found {}", items.len());
    // Gemma 3's activations are large enough that llama.cpp's own quantized arithmetic (8-bit
    // activations per 256 on its K-quant layers, a GELU read at f16) moves some of its
    // top-1s past the exact model's: at position 10 of the Fibonacci prompt it puts one
    // token 0.49 ahead where f32 arithmetic puts the other 0.05 ahead. So the top-1 is
    // checked against llama.cpp's only where the exact reference agrees with it, and against
    // the exact reference wherever that is clear. It widens near ties too: at position 13 of
    // the SQL prompt llama.cpp leads by 0.36 where the exact model leads by 0.12, and AVX2's
    // arithmetic tips it the other way by 0.05 (position 34 of the whitespace prompt: 0.08
    // exact); so llama.cpp's top-1 is checked only where the exact one is clear too. Few
    // positions may be set aside (9 near ties of 480 on an AVX2 machine).
    let exact = exact_weights(&file)?;
    let a = agreement_with(&weights, Some(&exact), &items)?;
    let n = a.positions;
    println!(
        "gemma3: positions {n} (top-1 checked {}, set aside: llama.cpp's top-1 not exact {:?}, \
         exact near tie {:?}), |dlogprob| median {:.4} max {:.4}; against exact f32: median \
         {:.4} max {:.4} (top-1 checked {})",
        a.checked,
        a.llama_wrong,
        a.near_ties,
        a.median,
        a.max,
        a.exact_median,
        a.exact_max,
        a.exact_checked
    );
    anyhow::ensure!(a.checked >= n / 2, "only {} of {n} positions had a clear top-1", a.checked);
    anyhow::ensure!(a.llama_wrong.len() <= n / 50, "{} positions set aside", a.llama_wrong.len());
    anyhow::ensure!(a.near_ties.len() <= n / 25, "{} near ties set aside", a.near_ties.len());
    anyhow::ensure!(a.median <= 0.05, "median |dlogprob| {} > 0.05", a.median);
    anyhow::ensure!(a.max <= 0.5, "max |dlogprob| {} > 0.5", a.max);
    anyhow::ensure!(a.exact_checked >= n / 2, "only {} exact top-1s checked", a.exact_checked);
    anyhow::ensure!(a.exact_median <= 0.02, "median against exact {} > 0.02", a.exact_median);
    anyhow::ensure!(a.exact_max <= 0.3, "max against exact {} > 0.3", a.exact_max);
    Ok(())
}

/// Sliding-window layers see no further back than their window: with every layer sliding
/// over 8 tokens, 18 layers reach back at most 18 * 7 positions, so two sequences that differ
/// only in their first token give the same last logits 200 positions later, bit for bit; the
/// real configuration (global layers every sixth) does see the difference.
#[test]
fn gemma3_sliding_layers_forget_what_left_the_window() -> anyhow::Result<()> {
    let file = GgufFile::open(&common::gemma_model()?)?;
    let mut weights = load_gguf_weights(&file)?;
    let tokens: Vec<u32> = (0..200u32).map(|i| 2 + (i * 7919) % 5000).collect();
    let mut other = tokens.clone();
    other[1] = 9999;
    let last = |w: &LlamaWeights, t: &[u32]| -> anyhow::Result<Vec<f32>> {
        let mut runner = Runner::new(0);
        let mut cache = KvCache::new(w, 16, 16);
        let table: Vec<u32> = (0..16).collect();
        let seq = SeqInput {
            tokens: t,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
            adapter: None,
        };
        Ok(runner.forward(w, &mut cache, &[seq])?)
    };
    anyhow::ensure!(last(&weights, &tokens)? != last(&weights, &other)?, "global layers see all");
    let g = weights.config.gemma.as_mut().ok_or_else(|| anyhow::anyhow!("not gemma"))?;
    (g.sliding_window, g.global_every) = (8, 0);
    anyhow::ensure!(last(&weights, &tokens)? == last(&weights, &other)?, "a window leaked");
    Ok(())
}

/// The architectures and K-quants past the catalog models, against llama.cpp on files its own
/// quantizer wrote (`scripts/golden-archs`: a random-weight model of each architecture in F16,
/// `llama-quantize` to a type people serve, llama.cpp's greedy steps with top-5
/// log-probabilities): each file loads with its architecture and types, and teacher-forced
/// log-probabilities agree within the golden bounds.
#[test]
fn other_architectures_agree_with_llama_cpp_on_files_it_quantized() -> anyhow::Result<()> {
    use sha2::Digest;
    use sluice_engine::quant::GgmlType;
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/archs");
    let cases = [
        ("phi3-q4_k_m", "phi3", GgmlType::Q4K),
        ("llama-q5_k_m", "llama", GgmlType::Q5K),
        ("qwen3-q6_k", "qwen3", GgmlType::Q6K),
        ("qwen2-q8_0", "qwen2", GgmlType::Q8_0),
        ("gemma2-q4_k_m", "gemma2", GgmlType::Q4K),
        ("gemma3-q5_k_m", "gemma3", GgmlType::Q5K),
        ("phi3-longrope-q8_0", "phi3", GgmlType::Q8_0),
    ];
    for (name, arch, ty) in cases {
        let path = dir.join(format!("{name}.gguf"));
        let golden: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{name}.llamacpp.json")))?)?;
        let digest = format!("{:x}", sha2::Sha256::digest(std::fs::read(&path)?));
        anyhow::ensure!(golden["sha256"] == digest.as_str(), "{name}: not the file llama.cpp ran");
        let file = GgufFile::open(&path)?;
        anyhow::ensure!(
            file.tensors.iter().any(|t| t.ty == ty),
            "{name}: llama-quantize wrote no {} tensor",
            ty.name()
        );
        let weights = load_gguf_weights(&file)?;
        anyhow::ensure!(weights.config.arch == arch, "{name}: {}", weights.config.arch);
        let items = golden["completion"].as_array().cloned().unwrap_or_default();
        anyhow::ensure!(items.len() == 3, "{name}: {} golden items", items.len());
        let (n, checked, median, max) = agreement(&weights, &items)?;
        println!(
            "{name}: positions {n} (top-1 checked {checked}), |dlogprob| median {median:.4} max {max:.4}"
        );
        anyhow::ensure!(median <= 0.05, "{name}: median |dlogprob| {median} > 0.05");
        anyhow::ensure!(max <= 0.5, "{name}: max |dlogprob| {max} > 0.5");
    }
    Ok(())
}
