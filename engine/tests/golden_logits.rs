//! Teacher-forced agreement with llama.cpp on the default model (see shared/golden/README.md).

mod common;

use sluice_engine::forward::{KvCache, LogitsWanted, Runner, SeqInput};
use sluice_engine::model::load_gguf_weights;
use sluice_text::gguf::GgufFile;

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let lse = logits.iter().map(|&l| ((l - max) as f64).exp()).sum::<f64>().ln() as f32 + max;
    logits.iter().map(|&l| l - lse).collect()
}

#[test]
fn teacher_forced_logits_agree_with_llama_cpp() -> anyhow::Result<()> {
    let golden = common::golden()?;
    let file = GgufFile::open(&common::default_model()?)?;
    let weights = load_gguf_weights(&file)?;
    let vocab = weights.config.vocab_size;
    let mut runner = Runner::new(0);
    let mut cache = KvCache::new(&weights, 16, 64);
    let table: Vec<u32> = (0..64).collect();
    let mut diffs = Vec::new();
    let mut checked_top1 = 0;
    let items = ["completion", "chat"]
        .iter()
        .flat_map(|k| golden[*k].as_array().cloned().unwrap_or_default())
        .collect::<Vec<_>>();
    anyhow::ensure!(items.len() == 14, "expected 14 golden items, found {}", items.len());
    for item in &items {
        let prompt = common::ids(&item["prompt_tokens"]);
        let completion = common::ids(&item["completion_tokens"]);
        let mut input = prompt.clone();
        input.extend_from_slice(&completion[..completion.len() - 1]);
        let seq = SeqInput {
            tokens: &input,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::All,
        };
        let logits = runner.forward(&weights, &mut cache, &[seq])?;
        for step in item["steps"].as_array().into_iter().flatten() {
            let pos = step["pos"].as_u64().unwrap_or(0) as usize;
            let row = prompt.len() - 1 + pos;
            let lp = log_softmax(&logits[row * vocab..(row + 1) * vocab]);
            let top = step["top"].as_array().cloned().unwrap_or_default();
            let (t1, l1) = (
                top[0][0].as_u64().unwrap_or(0) as usize,
                top[0][1].as_f64().unwrap_or(0.0) as f32,
            );
            let l2 = top[1][1].as_f64().unwrap_or(0.0) as f32;
            diffs.push((lp[t1] - l1).abs());
            if l1 - l2 >= 0.3 {
                let ours = lp
                    .iter()
                    .enumerate()
                    .fold((0, f32::NEG_INFINITY), |a, (i, &v)| if v > a.1 { (i, v) } else { a })
                    .0;
                anyhow::ensure!(
                    ours == t1,
                    "top-1 differs at pos {pos} of {:?}: ours {ours}, llama.cpp {t1}",
                    item.get("prompt").or(item.get("messages"))
                );
                checked_top1 += 1;
            }
        }
    }
    diffs.sort_by(f32::total_cmp);
    let median = diffs[diffs.len() / 2];
    let max = diffs[diffs.len() - 1];
    println!(
        "positions {} (top-1 checked {checked_top1}), |dlogprob| median {median:.4} max {max:.4}",
        diffs.len()
    );
    anyhow::ensure!(median <= 0.05, "median |dlogprob| {median} > 0.05");
    anyhow::ensure!(max <= 0.5, "max |dlogprob| {max} > 0.5");
    Ok(())
}
