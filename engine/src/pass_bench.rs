//! `sluice bench forward`: the forward pass alone, called as the serving engine calls it
//! ([`Backend::forward_picking`], greedy tokens picked by the backend, decode batches through
//! the GPU's graphs), at given batch sizes and context. It is the baseline the serving figures
//! (`sluice bench serve` against `sluice engine`) are held against: what the scheduler,
//! sampling, streaming and HTTP cost is the difference.

use std::time::Instant;

use serde::Serialize;

use crate::backend::{Backend, Device, KvSize, PassTimes, Pick};
use crate::error::{EngineError, Result};
use crate::forward::{KvDtype, LogitsWanted, SeqInput};
use crate::loader::LoadedModel;

/// What to measure.
#[derive(Clone, Debug)]
pub struct ForwardBenchConfig {
    /// Where the passes run.
    pub device: Device,
    /// Decode batch sizes, one point each.
    pub batches: Vec<usize>,
    /// Tokens of context every sequence holds when the timed decode steps begin.
    pub context: usize,
    /// Timed decode steps per point (after two untimed ones: a GPU captures its graph then).
    pub steps: usize,
    /// Most token rows of a prefill pass (the engine's `max_num_batched_tokens`).
    pub max_num_batched_tokens: usize,
    /// CPU compute threads (0: all cores).
    pub threads: usize,
}

/// One batch size's figures.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct ForwardPoint {
    /// Sequences in each decode step.
    pub batch: usize,
    /// Context at the first timed step.
    pub context: usize,
    /// Prompt tokens per second of the prefill that built the context.
    pub prefill_tokens_per_second: f64,
    /// Median wall time of a decode step, as the engine waits for it (ms).
    pub step_ms: f64,
    /// 90th percentile of the same.
    pub step_ms_p90: f64,
    /// Mean of the same.
    pub step_ms_mean: f64,
    /// The device's own time per decode step (GPU: events on its stream), mean (ms).
    pub device_step_ms: f64,
    /// `batch / step_ms`: output tokens per second from the forward pass alone.
    pub tokens_per_second: f64,
}

/// Runs every point on one backend sized for the largest batch.
pub fn bench_forward(model: &LoadedModel, cfg: &ForwardBenchConfig) -> Result<Vec<ForwardPoint>> {
    let w = &model.weights;
    let largest = cfg.batches.iter().copied().max().unwrap_or(0);
    if largest == 0 || cfg.steps == 0 || cfg.context == 0 || cfg.max_num_batched_tokens == 0 {
        return Err(EngineError::InvalidRequest(
            "bench forward needs a batch size, --steps, --context and --max-num-batched-tokens \
             above 0"
                .into(),
        ));
    }
    let positions = cfg.context + cfg.steps + 2;
    if positions > w.config.context_length {
        return Err(EngineError::InvalidRequest(format!(
            "--context {} and --steps {} need {positions} positions; the model holds {}",
            cfg.context, cfg.steps, w.config.context_length
        )));
    }
    let block_size = 16;
    let per_seq = positions.div_ceil(block_size);
    let blocks = KvSize::Blocks(per_seq * largest);
    let mut backend =
        Backend::new(cfg.device, w, cfg.threads, block_size, blocks, KvDtype::default())?;
    backend.reserve(cfg.max_num_batched_tokens.max(largest), largest)?;
    let tables: Vec<Vec<u32>> = (0..largest)
        .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
        .collect();
    let vocab = w.config.vocab_size as u32;
    let mut points = Vec::new();
    for &batch in &cfg.batches {
        // Distinct prompts (ids spread over the vocabulary), prefilled in passes of at most
        // max_num_batched_tokens rows, several sequences a pass as the scheduler packs them.
        let prompts: Vec<Vec<u32>> = (0..batch)
            .map(|s| {
                (0..cfg.context as u32)
                    .map(|i| {
                        1 + (i.wrapping_mul(7919) ^ (s as u32).wrapping_mul(104_729)) % (vocab - 1)
                    })
                    .collect()
            })
            .collect();
        let mut last = vec![0u32; batch];
        let began = Instant::now();
        let mut next = (0, 0);
        while next.0 < batch {
            let mut room = cfg.max_num_batched_tokens;
            let mut chunks = Vec::new();
            while room > 0 && next.0 < batch {
                let (s, at) = next;
                let len = (cfg.context - at).min(room);
                let ends = at + len == cfg.context;
                chunks.push((s, at, len, ends));
                room -= len;
                next = if ends { (s + 1, 0) } else { (s, at + len) };
            }
            let inputs: Vec<SeqInput<'_>> = chunks
                .iter()
                .map(|&(s, at, len, ends)| SeqInput {
                    tokens: &prompts[s][at..at + len],
                    start_pos: at,
                    block_table: &tables[s],
                    logits: if ends { LogitsWanted::Last } else { LogitsWanted::None },
                    adapter: None,
                })
                .collect();
            let out = backend.forward_picking(w, &inputs, &vec![Pick::Argmax; inputs.len()])?;
            for (&(s, _, _, _), picked) in chunks.iter().zip(&out.picked) {
                if let Some(t) = picked {
                    last[s] = *t;
                }
            }
        }
        let prefill = began.elapsed().as_secs_f64();
        let mut steps = Vec::with_capacity(cfg.steps);
        let mut device = PassTimes::default();
        for step in 0..cfg.steps + 2 {
            let tokens: Vec<[u32; 1]> = last.iter().map(|&t| [t]).collect();
            let inputs: Vec<SeqInput<'_>> = (0..batch)
                .map(|s| SeqInput {
                    tokens: &tokens[s],
                    start_pos: cfg.context + step,
                    block_table: &tables[s],
                    logits: LogitsWanted::Last,
                    adapter: None,
                })
                .collect();
            let _ = backend.take_pass_times();
            let t = Instant::now();
            let out = backend.forward_picking(w, &inputs, &vec![Pick::Argmax; batch])?;
            let seconds = t.elapsed().as_secs_f64();
            for (s, picked) in out.picked.iter().enumerate() {
                last[s] = picked.ok_or_else(|| {
                    EngineError::Device("the backend picked no token for a decode row".into())
                })?;
            }
            // The first two steps (a GPU captures its graph for the bucket) are not timed.
            if step >= 2 {
                steps.push(seconds);
                device.add(backend.take_pass_times());
            }
        }
        backend.pass_break();
        let mean = steps.iter().sum::<f64>() * 1e3 / steps.len() as f64;
        steps.sort_by(f64::total_cmp);
        let at = |q: f64| steps[((steps.len() - 1) as f64 * q).round() as usize] * 1e3;
        let step_ms = at(0.5);
        points.push(ForwardPoint {
            batch,
            context: cfg.context,
            prefill_tokens_per_second: (batch * cfg.context) as f64 / prefill.max(1e-9),
            step_ms,
            step_ms_p90: at(0.9),
            step_ms_mean: mean,
            device_step_ms: device.busy * 1e3 / device.passes.max(1) as f64,
            tokens_per_second: batch as f64 / (step_ms / 1e3).max(1e-12),
        });
    }
    Ok(points)
}

/// The table `sluice bench forward` prints.
pub fn table(points: &[ForwardPoint]) -> String {
    let mut out = String::from(
        "batch  context  prefill tok/s  step ms p50  step ms p90  device ms/step  decode tok/s\n",
    );
    for p in points {
        out.push_str(&format!(
            "{:>5}  {:>7}  {:>13.0}  {:>11.3}  {:>11.3}  {:>14.3}  {:>12.1}\n",
            p.batch,
            p.context,
            p.prefill_tokens_per_second,
            p.step_ms,
            p.step_ms_p90,
            p.device_step_ms,
            p.tokens_per_second
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::GgmlType;
    use crate::synth::{SynthSpec, write_gguf};

    /// Every point runs its batch at the asked context: the decode steps are timed, the device
    /// time per step is no more than the wall time, and tokens per second follow from them.
    #[test]
    fn points_cover_each_batch() -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.gguf");
        write_gguf(&SynthSpec::tiny(), GgmlType::F32, &path)?;
        let model = LoadedModel::load(&path)?;
        let cfg = ForwardBenchConfig {
            device: Device::Cpu,
            batches: vec![1, 3],
            context: 40,
            steps: 4,
            max_num_batched_tokens: 32,
            threads: 1,
        };
        let points = bench_forward(&model, &cfg)?;
        assert_eq!(points.iter().map(|p| p.batch).collect::<Vec<_>>(), vec![1, 3]);
        for p in &points {
            assert_eq!(p.context, 40);
            assert!(p.step_ms > 0.0 && p.step_ms <= p.step_ms_p90);
            // The device's time is part of the wall time the engine waits.
            assert!(p.device_step_ms > 0.0 && p.device_step_ms <= p.step_ms_mean * 1.0001);
            let want = p.batch as f64 / (p.step_ms / 1e3);
            assert!((p.tokens_per_second - want).abs() < 1e-6 * want);
            assert!(p.prefill_tokens_per_second > 0.0);
        }
        assert!(table(&points).lines().count() == 3);
        // A context the model cannot hold is refused, naming the flags.
        let long = ForwardBenchConfig { context: 400, ..cfg };
        let err = bench_forward(&model, &long).err().map(|e| e.to_string()).unwrap_or_default();
        assert!(err.contains("--context"), "{err}");
        Ok(())
    }
}
