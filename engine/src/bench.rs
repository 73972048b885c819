//! Model-level benchmark: prefill and decode speed at batch 1, against the memory-bandwidth
//! floor measured in the same run.

use std::time::Instant;

use serde::Serialize;

use std::path::Path;

use crate::error::{EngineError, Result};
use crate::forward::{KvCache, KvDtype, LogitsWanted, Runner, SeqInput};
use crate::loader::LoadedModel;
use crate::model::LlamaWeights;
use crate::sampler::argmax;
#[cfg(doc)]
use crate::serve::metrics::StepPhase;

/// What to measure.
#[derive(Clone, Copy, Debug)]
pub struct ModelBenchConfig {
    /// Prompt length for the prefill measurement.
    pub prompt_tokens: usize,
    /// Tokens generated for the decode measurement.
    pub decode_tokens: usize,
    /// Repetitions; the median is reported.
    pub repetitions: usize,
}

/// Measured figures.
#[derive(Clone, Debug, Serialize)]
pub struct ModelBenchReport {
    /// Compute threads.
    pub threads: usize,
    /// Instruction set of the kernels.
    pub isa: String,
    /// Prompt length.
    pub prompt_tokens: usize,
    /// Decoded tokens.
    pub decode_tokens: usize,
    /// Median prefill speed.
    pub prefill_tokens_per_second: f64,
    /// Median decode speed from an empty context (what `llama-bench -n` measures).
    pub decode_tokens_per_second: f64,
    /// Median decode step time from an empty context.
    pub decode_ms_per_token: f64,
    /// Median decode speed after the prompt (attention over `prompt_tokens` more positions).
    pub decode_after_prompt_tokens_per_second: f64,
    /// Bytes of weights read per decode step.
    pub weight_bytes: usize,
    /// Measured read bandwidth of this machine, all threads.
    pub memory_bandwidth_gb_per_s: f64,
    /// `weight_bytes / bandwidth`: no decode step can be faster.
    pub decode_floor_ms: f64,
    /// Resident memory of the process after the runs (weights, KV cache, buffers), if known.
    pub resident_bytes: Option<u64>,
    /// Bytes of the KV cache used by the benchmark.
    pub kv_cache_bytes: usize,
    /// Which kernel each of the file's weight types took.
    pub kernels: Vec<KernelUse>,
}

/// The matrices of one file type and what computed their products.
#[derive(Clone, Debug, Serialize)]
pub struct KernelUse {
    /// The GGML type the file stores them in.
    pub file_type: String,
    /// How many matrices.
    pub tensors: usize,
    /// Their layout and activations ([`crate::cpu::matmul::PackedWeight::kernel`]).
    pub kernel: String,
}

/// The kernels of `w`'s matrices, one entry per file type and kernel.
fn kernels_used(w: &LlamaWeights) -> Vec<KernelUse> {
    let mut out: Vec<KernelUse> = Vec::new();
    let layers =
        w.layers.iter().flat_map(|l| [&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down]);
    for m in std::iter::once(w.lm_head()).chain(layers) {
        let (file_type, kernel) = (m.ty.name().to_string(), m.kernel());
        match out.iter_mut().find(|k| k.file_type == file_type && k.kernel == kernel) {
            Some(k) => k.tensors += 1,
            None => out.push(KernelUse { file_type, tensors: 1, kernel }),
        }
    }
    out
}

/// Runs the benchmark.
pub fn bench_model(
    model: &LoadedModel,
    runner: &mut Runner,
    cfg: ModelBenchConfig,
) -> Result<ModelBenchReport> {
    let w = &model.weights;
    let vocab = w.config.vocab_size as u32;
    // A deterministic prompt of ordinary tokens (ids spread over the vocabulary).
    let prompt: Vec<u32> =
        (0..cfg.prompt_tokens as u32).map(|i| 100 + (i * 7919) % (vocab - 200)).collect();
    let total = cfg.prompt_tokens + cfg.decode_tokens + 1;
    let blocks = total.div_ceil(16);
    let mut cache = KvCache::new(w, 16, blocks);
    let table: Vec<u32> = (0..blocks as u32).collect();
    let mut prefill = Vec::new();
    let mut decode = Vec::new();
    let mut decode_deep = Vec::new();
    for _ in 0..cfg.repetitions.max(1) {
        decode.push(decode_run(runner, w, &mut cache, &table, 0, prompt[0], cfg.decode_tokens)?);
    }
    for _ in 0..cfg.repetitions.max(1) {
        let t0 = Instant::now();
        let seq = SeqInput {
            tokens: &prompt,
            start_pos: 0,
            block_table: &table,
            logits: LogitsWanted::Last,
            adapter: None,
        };
        let logits = runner.forward_logits(w, &mut cache, &[seq])?;
        prefill.push(t0.elapsed().as_secs_f64());
        let first = argmax(logits);
        decode_deep.push(decode_run(
            runner,
            w,
            &mut cache,
            &table,
            cfg.prompt_tokens,
            first,
            cfg.decode_tokens,
        )?);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let prefill_s = median(&mut prefill);
    let decode_s = median(&mut decode);
    let decode_deep_s = median(&mut decode_deep);
    let resident_bytes = resident_bytes();
    let bandwidth = measure_read_bandwidth(runner);
    let weight_bytes = w.memory_bytes();
    Ok(ModelBenchReport {
        threads: runner.threads(),
        isa: format!("{:?}", runner.isa()),
        prompt_tokens: cfg.prompt_tokens,
        decode_tokens: cfg.decode_tokens,
        prefill_tokens_per_second: cfg.prompt_tokens as f64 / prefill_s,
        decode_tokens_per_second: cfg.decode_tokens as f64 / decode_s,
        decode_ms_per_token: decode_s * 1e3 / cfg.decode_tokens.max(1) as f64,
        decode_after_prompt_tokens_per_second: cfg.decode_tokens as f64 / decode_deep_s,
        weight_bytes,
        memory_bandwidth_gb_per_s: bandwidth / 1e9,
        decode_floor_ms: weight_bytes as f64 / bandwidth * 1e3,
        resident_bytes,
        kv_cache_bytes: KvCache::bytes_per_block(w, 16, cache.dtype()) * blocks,
        kernels: kernels_used(w),
    })
}

/// What a model benchmark is set against: llama.cpp on the same model.
#[derive(Clone, Debug, Serialize)]
pub struct ModelBaseline {
    /// Where the figures come from.
    pub source: String,
    /// Prefill speed.
    pub prefill_tokens_per_second: f64,
    /// Decode speed from an empty context.
    pub decode_tokens_per_second: f64,
}

impl ModelBaseline {
    /// Runs llama.cpp's `llama-bench` (`bin`) now on `model`: a `prompt`-token prefill and a
    /// `decode`-token decode on `threads` threads.
    pub fn llama_bench(
        bin: &Path,
        model: &Path,
        threads: usize,
        prompt: usize,
        decode: usize,
    ) -> Result<Self> {
        let failed =
            |message: String| EngineError::Baseline(format!("{}: {message}", bin.display()));
        let out = std::process::Command::new(bin)
            .arg("-m")
            .arg(model)
            .args(["-t", &threads.to_string(), "-p", &prompt.to_string()])
            .args(["-n", &decode.to_string(), "-o", "json"])
            .output()
            .map_err(|e| EngineError::io(bin, e))?;
        if !out.status.success() {
            return Err(failed(format!("failed: {}", String::from_utf8_lossy(&out.stderr))));
        }
        let rows: Vec<serde_json::Value> = serde_json::from_slice(&out.stdout)
            .map_err(|e| failed(format!("its JSON output: {e}")))?;
        let speed = |n_prompt: usize, n_gen: usize| {
            rows.iter()
                .rev()
                .find(|r| {
                    r["n_prompt"].as_u64() == Some(n_prompt as u64)
                        && r["n_gen"].as_u64() == Some(n_gen as u64)
                })
                .and_then(|r| r["avg_ts"].as_f64())
        };
        match (speed(prompt, 0), speed(0, decode)) {
            (Some(prefill), Some(decode)) => Ok(Self {
                source: format!("llama.cpp {} measured now", bin.display()),
                prefill_tokens_per_second: prefill,
                decode_tokens_per_second: decode,
            }),
            _ => Err(failed(format!("printed no pp{prompt}/tg{decode} rows"))),
        }
    }
}

/// A model benchmark set against its baseline: what `sluice bench model` prints.
#[derive(Clone, Debug, Serialize)]
pub struct ModelComparison {
    /// The model measured.
    pub model_id: String,
    /// Its revision.
    pub model_revision: String,
    /// Size of its file (or directory's weights file), bytes.
    pub model_file_bytes: u64,
    /// What was measured.
    pub report: ModelBenchReport,
    /// What it is set against: llama.cpp measured in the same run, or none (no stored
    /// figures stand in: they would be another model's, lengths' or machine's).
    pub baseline: Option<ModelBaseline>,
    /// Prefill speed over the baseline's.
    pub prefill_ratio: Option<f64>,
    /// Decode speed over the baseline's.
    pub decode_ratio: Option<f64>,
}

impl ModelComparison {
    /// `report` of `model` against `baseline`.
    pub fn new(
        model: &LoadedModel,
        report: ModelBenchReport,
        baseline: Option<ModelBaseline>,
    ) -> Self {
        Self {
            model_id: model.identity.model_id.clone(),
            model_revision: model.identity.model_revision.clone(),
            model_file_bytes: std::fs::metadata(&model.path).map_or(0, |m| m.len()),
            prefill_ratio: baseline
                .as_ref()
                .map(|b| report.prefill_tokens_per_second / b.prefill_tokens_per_second),
            decode_ratio: baseline
                .as_ref()
                .map(|b| report.decode_tokens_per_second / b.decode_tokens_per_second),
            report,
            baseline,
        }
    }
}

const MIB: f64 = (1 << 20) as f64;

impl std::fmt::Display for ModelComparison {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let r = &self.report;
        writeln!(f, "model      {} ({})", self.model_id, self.model_revision)?;
        writeln!(f, "threads    {} ({})", r.threads, r.isa)?;
        let against = |base: Option<f64>, ratio: Option<f64>| match (base, ratio) {
            (Some(b), Some(x)) => format!("baseline {b:>7.1}   ratio {x:.2}x"),
            _ => "no baseline".to_string(),
        };
        let b = self.baseline.as_ref();
        match b {
            Some(b) => writeln!(f, "baseline   {}", b.source)?,
            None => writeln!(
                f,
                "baseline   none: --llama-bench PATH runs llama.cpp on this model in the same run"
            )?,
        }
        writeln!(
            f,
            "prefill    {:>8.1} tok/s on {} tokens   {}",
            r.prefill_tokens_per_second,
            r.prompt_tokens,
            against(b.map(|b| b.prefill_tokens_per_second), self.prefill_ratio)
        )?;
        writeln!(
            f,
            "decode     {:>8.1} tok/s over {} tokens  {}",
            r.decode_tokens_per_second,
            r.decode_tokens,
            against(b.map(|b| b.decode_tokens_per_second), self.decode_ratio)
        )?;
        writeln!(
            f,
            "decode     {:>8.1} tok/s over {} tokens after the {}-token prompt (no baseline)",
            r.decode_after_prompt_tokens_per_second, r.decode_tokens, r.prompt_tokens
        )?;
        writeln!(
            f,
            "bandwidth  {:.2} ms/token vs floor {:.2} ms ({:.1} MiB of weights at {:.1} GB/s measured): {:.0}% of the bound",
            r.decode_ms_per_token,
            r.decode_floor_ms,
            r.weight_bytes as f64 / MIB,
            r.memory_bandwidth_gb_per_s,
            100.0 * r.decode_floor_ms / r.decode_ms_per_token
        )?;
        for k in &r.kernels {
            writeln!(f, "kernel     {} x {:<3} {}", k.file_type, k.tensors, k.kernel)?;
        }
        if let Some(rss) = r.resident_bytes {
            writeln!(
                f,
                "memory     {:.1} MiB resident: {:.1} MiB model file, {:.1} MiB weights in memory, {:.1} MiB KV cache",
                rss as f64 / MIB,
                self.model_file_bytes as f64 / MIB,
                r.weight_bytes as f64 / MIB,
                r.kv_cache_bytes as f64 / MIB
            )?;
        }
        Ok(())
    }
}

/// The process's resident set size (Linux `/proc/self/status`).
fn resident_bytes() -> Option<u64> {
    proc_status_bytes("VmRSS:")
}

/// A size line of `/proc/self/status` (Linux), in bytes.
fn proc_status_bytes(key: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(key))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Seconds to greedily decode `n` tokens one at a time from `start_pos`.
fn decode_run(
    runner: &mut Runner,
    w: &crate::model::LlamaWeights,
    cache: &mut KvCache,
    table: &[u32],
    start_pos: usize,
    first: u32,
    n: usize,
) -> Result<f64> {
    let mut tok = first;
    let t = Instant::now();
    for i in 0..n {
        let input = [tok];
        let seq = SeqInput {
            tokens: &input,
            start_pos: start_pos + i,
            block_table: table,
            logits: LogitsWanted::Last,
            adapter: None,
        };
        tok = argmax(runner.forward_logits(w, cache, &[seq])?);
    }
    Ok(t.elapsed().as_secs_f64())
}

/// Bytes per second all compute threads together read from a buffer far larger than the
/// caches (best of a few passes).
fn measure_read_bandwidth(runner: &Runner) -> f64 {
    let n: usize = 64 << 20; // 64 Mi u64 = 512 MiB
    let buf: Vec<u64> = (0..n as u64).collect();
    let threads = runner.threads();
    let mut best = 0f64;
    for _ in 0..3 {
        let t0 = Instant::now();
        let sums: Vec<u64> = std::thread::scope(|s| {
            let handles: Vec<_> = buf
                .chunks(n.div_ceil(threads))
                .map(|c| s.spawn(move || c.iter().fold(0u64, |a, &b| a.wrapping_add(b))))
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or(0)).collect()
        });
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(sums);
        best = best.max((n * 8) as f64 / secs);
    }
    best
}

/// One concurrency level of [`bench_engine`].
#[derive(Clone, Debug, Serialize)]
pub struct EngineBenchPoint {
    /// Concurrent streams (closed loop: a new request starts when one ends).
    pub concurrency: usize,
    /// Prompt tokens per request.
    pub prompt_tokens: usize,
    /// Requests completed.
    pub requests: usize,
    /// Generated tokens over the wall time of the level.
    pub output_tokens_per_second: f64,
    /// Engine-side time to first token, median, seconds.
    pub ttft_p50: f64,
    /// Engine-side time to first token, 99th percentile, seconds.
    pub ttft_p99: f64,
    /// Per-request decode time per token (TPOT), median, seconds.
    pub tpot_p50: f64,
    /// Wall time of the level, seconds.
    pub seconds: f64,
    /// Engine steps during the level.
    pub steps: u64,
    /// Seconds of those steps by phase, in [`StepPhase::ALL`]'s order.
    pub step_seconds: [f64; 6],
}

/// A level's step time by phase, as one row under [`StepSplit::HEADER`].
pub struct StepSplit<'a>(pub &'a EngineBenchPoint);

impl StepSplit<'_> {
    /// The header: the phases of [`StepPhase::ALL`].
    pub const HEADER: &'static str = "streams  prompt  steps  ms/step  schedule  attention  matmul  \
                              lm_head  forward_other  emit";
}

impl std::fmt::Display for StepSplit<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = self.0;
        let total: f64 = p.step_seconds.iter().sum();
        let share = |i: usize| 100.0 * p.step_seconds[i] / total.max(f64::MIN_POSITIVE);
        write!(
            f,
            "{:>7}  {:>6}  {:>5}  {:>7.2}  {:>7.1}%  {:>8.1}%  {:>5.1}%  {:>6.1}%  {:>12.1}%  {:>3.1}%",
            p.concurrency,
            p.prompt_tokens,
            p.steps,
            total * 1e3 / p.steps.max(1) as f64,
            share(0),
            share(1),
            share(2),
            share(3),
            share(4),
            share(5),
        )
    }
}

/// The KV cache one long sequence takes, in the dtype measured and in the other, and the
/// process's peak resident memory.
#[derive(Clone, Debug, Serialize)]
pub struct LongContext {
    /// Positions of the sequence (prompt and output).
    pub positions: usize,
    /// What the cache stores.
    pub dtype: KvDtype,
    /// Its KV bytes (whole blocks of 16).
    pub kv_bytes: usize,
    /// The same sequence's KV bytes in f32.
    pub kv_bytes_f32: usize,
    /// Peak resident memory of this process so far (the cache is allocated whole at start).
    pub peak_resident_bytes: Option<u64>,
}

impl LongContext {
    /// A sequence of `prompt + output` positions of `w`'s shape in `dtype`.
    pub fn new(w: &LlamaWeights, prompt: usize, output: usize, dtype: KvDtype) -> Self {
        let blocks = (prompt + output).div_ceil(16);
        LongContext {
            positions: prompt + output,
            dtype,
            kv_bytes: KvCache::bytes_per_block(w, 16, dtype) * blocks,
            kv_bytes_f32: KvCache::bytes_per_block(w, 16, KvDtype::F32) * blocks,
            peak_resident_bytes: proc_status_bytes("VmHWM:"),
        }
    }
}

impl std::fmt::Display for LongContext {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "memory per sequence of {} positions: {:.1} MiB of KV cache in {} ({:.1} MiB in f32, \
             {:.2}x)",
            self.positions,
            self.kv_bytes as f64 / MIB,
            self.dtype,
            self.kv_bytes_f32 as f64 / MIB,
            self.kv_bytes as f64 / self.kv_bytes_f32 as f64
        )?;
        if let Some(peak) = self.peak_resident_bytes {
            write!(f, "; process peak resident {:.1} MiB", peak as f64 / MIB)?;
        }
        Ok(())
    }
}

/// One level of `sluice bench engine --adapters N`: its streams spread over N tenant adapters
/// and the bare base, against the same level on the base alone, measured in the same run.
#[derive(Clone, Debug)]
pub struct AdapterComparison {
    /// The level on the base model alone (the baseline, measured in the same run).
    pub base: EngineBenchPoint,
    /// The same level with its streams spread over the adapters and the base.
    pub adapters: EngineBenchPoint,
    /// Adapters the streams were spread over (and the base).
    pub adapter_count: usize,
}

impl AdapterComparison {
    /// The header of the table of [`AdapterComparison`] rows.
    pub const HEADER: &str =
        "streams  base tok/s  adapters tok/s  ratio  TPOT p50 base  TPOT p50 adapters  overhead";

    /// Throughput with adapters over throughput on the base alone.
    pub fn ratio(&self) -> f64 {
        self.adapters.output_tokens_per_second / self.base.output_tokens_per_second.max(1e-9)
    }

    /// TPOT with adapters over TPOT on the base alone, less one.
    pub fn tpot_overhead(&self) -> f64 {
        self.adapters.tpot_p50 / self.base.tpot_p50.max(1e-12) - 1.0
    }
}

impl serde::Serialize for AdapterComparison {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut m = s.serialize_map(Some(6))?;
        m.serialize_entry("point", "adapters")?;
        m.serialize_entry("adapter_count", &self.adapter_count)?;
        m.serialize_entry("baseline", "the same level on the base model alone, measured now")?;
        m.serialize_entry("base", &self.base)?;
        m.serialize_entry("adapters", &self.adapters)?;
        m.serialize_entry("ratio", &self.ratio())?;
        m.serialize_entry("tpot_overhead", &self.tpot_overhead())?;
        m.end()
    }
}

impl std::fmt::Display for AdapterComparison {
    /// One row of the table under [`AdapterComparison::HEADER`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:>7}  {:>10.1}  {:>14.1}  {:>4.2}x  {:>10.2} ms  {:>14.2} ms  {:>+7.1}%",
            self.base.concurrency,
            self.base.output_tokens_per_second,
            self.adapters.output_tokens_per_second,
            self.ratio(),
            self.base.tpot_p50 * 1e3,
            self.adapters.tpot_p50 * 1e3,
            100.0 * self.tpot_overhead()
        )
    }
}

/// One level of `sluice bench engine` in process. It has no baseline: llama.cpp is measured
/// beside the engine only over HTTP (`--llama-server`), and stored figures would be another
/// model's, workload's or machine's.
#[derive(Clone, Debug, Serialize)]
pub struct EngineComparison {
    /// What was measured.
    pub point: EngineBenchPoint,
}

impl EngineComparison {
    /// The header of the table of [`EngineComparison`] rows.
    pub const HEADER: &str = "streams  output tok/s   TTFT p50   TTFT p99   TPOT p50";

    /// `point`'s row.
    pub fn new(point: EngineBenchPoint) -> Self {
        Self { point }
    }
}

impl std::fmt::Display for EngineComparison {
    /// One row of the table under [`EngineComparison::HEADER`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.point;
        write!(
            f,
            "{:>7}  {:>12.1}  {:>7.2} s  {:>7.2} s   {:>5.1} ms",
            p.concurrency,
            p.output_tokens_per_second,
            p.ttft_p50,
            p.ttft_p99,
            p.tpot_p50 * 1e3
        )
    }
}

/// One level of `sluice bench engine --response-format`: the same load unconstrained (the
/// baseline) and constrained to the grammar, in one run.
#[derive(Clone, Debug, Serialize)]
pub struct StructuredComparison {
    /// Without a grammar.
    pub free: EngineBenchPoint,
    /// Every request constrained to the grammar.
    pub constrained: EngineBenchPoint,
}

impl StructuredComparison {
    /// The header of the table of [`StructuredComparison`] rows.
    pub const HEADER: &str = "streams  tok/s free  tok/s constrained  ratio  TPOT free  \
                              TPOT constrained  overhead/token  tokens/request";

    /// Decode time a token costs more under the grammar, median TPOT against median TPOT.
    pub fn overhead_ms_per_token(&self) -> f64 {
        (self.constrained.tpot_p50 - self.free.tpot_p50) * 1e3
    }
}

impl std::fmt::Display for StructuredComparison {
    /// One row of the table under [`StructuredComparison::HEADER`].
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (a, b) = (&self.free, &self.constrained);
        let per_request = |p: &EngineBenchPoint| {
            p.output_tokens_per_second * p.seconds / p.requests.max(1) as f64
        };
        write!(
            f,
            "{:>7}  {:>10.1}  {:>17.1}  {:>4.2}x  {:>6.2} ms  {:>13.2} ms  {:>+11.3} ms  {:>6.0} / {:.0}",
            a.concurrency,
            a.output_tokens_per_second,
            b.output_tokens_per_second,
            b.output_tokens_per_second / a.output_tokens_per_second,
            a.tpot_p50 * 1e3,
            b.tpot_p50 * 1e3,
            self.overhead_ms_per_token(),
            per_request(a),
            per_request(b),
        )
    }
}

/// Aggregate throughput and TTFT of the serving engine in process, with `concurrency`
/// streams of unique `prompt_tokens`-token prompts generating `output_tokens` each
/// (`ignore_eos`), `rounds` requests per stream; with `grammar`, every output is constrained
/// to it (and ends when its value closes).
pub fn bench_engine(
    handle: &crate::serve::handle::EngineHandle,
    concurrency: usize,
    prompt_tokens: usize,
    output_tokens: usize,
    rounds: usize,
    grammar: Option<std::sync::Arc<crate::structured::Grammar>>,
    adapters: &[std::sync::Arc<crate::lora::LoraAdapter>],
) -> Result<EngineBenchPoint> {
    use crate::serve::{CacheScope, EngineEvent, ValidRequest};
    let vocab = handle.model().weights.config.vocab_size as u32;
    let steps_before = handle.metrics().step_times();
    let steps_count = handle.metrics().steps.get();
    let start = Instant::now();
    let results: Vec<Result<Vec<(f64, f64, usize)>>> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..concurrency)
            .map(|c| {
                let grammar = grammar.clone();
                // Streams spread over the adapters and the bare base in turn: stream 0 on the
                // first adapter, stream `adapters.len()` on the base.
                let slot = c % (adapters.len() + 1);
                let adapter = adapters.get(slot).map(|a| crate::serve::RequestAdapter {
                    name: format!("bench/adapter-{slot}"),
                    adapter: std::sync::Arc::clone(a),
                });
                s.spawn(move || -> Result<Vec<(f64, f64, usize)>> {
                    let mut out = Vec::new();
                    for r in 0..rounds {
                        let salt = (c * 1000 + r) as u32;
                        let prompt: Vec<u32> = (0..prompt_tokens as u32)
                            .map(|i| {
                                100 + (i.wrapping_mul(7919) ^ salt.wrapping_mul(104_729))
                                    % (vocab - 200)
                            })
                            .collect();
                        let id = format!("bench-{c}-{r}");
                        let req = ValidRequest {
                            request_id: id.clone(),
                            prompt,
                            max_tokens: output_tokens,
                            sampling: Default::default(),
                            stop: Vec::new(),
                            stop_token_ids: Vec::new(),
                            ignore_eos: true,
                            logprobs: None,
                            prompt_logprobs: None,
                            cache_scope: CacheScope::Private(id),
                            priority: 0,
                            weight: 1,
                            tpot_target: None,
                            arrival: Instant::now(),
                            grammar: grammar.clone(),
                            adapter: adapter.clone(),
                        };
                        let mut stream = handle.submit(req)?;
                        while let Some(ev) = stream.blocking_next() {
                            if let EngineEvent::Finished { timings, usage, .. } = ev {
                                let tpot = if usage.completion_tokens > 1 {
                                    timings.decode / (usage.completion_tokens - 1) as f64
                                } else {
                                    0.0
                                };
                                out.push((timings.ttft, tpot, usage.completion_tokens));
                            }
                        }
                    }
                    Ok(out)
                })
            })
            .collect();
        workers
            .into_iter()
            .map(|w| {
                w.join().unwrap_or_else(|_| {
                    Err(crate::EngineError::InvalidRequest("bench worker panicked".into()))
                })
            })
            .collect()
    });
    let seconds = start.elapsed().as_secs_f64();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    let pct = |mut v: Vec<f64>, p: f64| {
        v.sort_by(f64::total_cmp);
        v.get(((v.len() as f64 - 1.0) * p).round() as usize).copied().unwrap_or(0.0)
    };
    let tokens: usize = all.iter().map(|x| x.2).sum();
    let mut step_seconds = handle.metrics().step_times();
    for (a, b) in step_seconds.iter_mut().zip(steps_before) {
        *a -= b;
    }
    Ok(EngineBenchPoint {
        concurrency,
        prompt_tokens,
        requests: all.len(),
        output_tokens_per_second: tokens as f64 / seconds,
        ttft_p50: pct(all.iter().map(|x| x.0).collect(), 0.5),
        ttft_p99: pct(all.iter().map(|x| x.0).collect(), 0.99),
        tpot_p50: pct(all.iter().map(|x| x.1).collect(), 0.5),
        seconds,
        steps: handle.metrics().steps.get() - steps_count,
        step_seconds,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a baseline measured in the same run there is no ratio, in text or JSON (stored
    /// figures once stood in, whatever the model, lengths or threads).
    #[test]
    fn no_baseline_means_no_ratio_in_any_format() -> std::result::Result<(), serde_json::Error> {
        let report = ModelBenchReport {
            threads: 2,
            isa: "Avx2".into(),
            prompt_tokens: 512,
            decode_tokens: 128,
            prefill_tokens_per_second: 900.0,
            decode_tokens_per_second: 250.0,
            decode_ms_per_token: 4.0,
            decode_after_prompt_tokens_per_second: 200.0,
            weight_bytes: 1 << 20,
            memory_bandwidth_gb_per_s: 20.0,
            decode_floor_ms: 0.05,
            resident_bytes: None,
            kv_cache_bytes: 1 << 20,
            kernels: vec![KernelUse {
                file_type: "Q4_K".into(),
                tensors: 3,
                kernel: "packed 4-bit".into(),
            }],
        };
        let alone = ModelComparison {
            model_id: "m".into(),
            model_revision: "sha256:x".into(),
            model_file_bytes: 1,
            report: report.clone(),
            baseline: None,
            prefill_ratio: None,
            decode_ratio: None,
        };
        let text = alone.to_string();
        assert!(!text.contains("ratio") && text.contains("no baseline"), "{text}");
        assert!(text.contains("kernel     Q4_K x 3   packed 4-bit"), "{text}");
        let json = serde_json::to_value(&alone)?;
        assert!(json["baseline"].is_null() && json["prefill_ratio"].is_null(), "{json}");
        let measured = ModelBaseline {
            source: "llama-bench now".into(),
            prefill_tokens_per_second: 300.0,
            decode_tokens_per_second: 125.0,
        };
        let with = ModelComparison {
            baseline: Some(measured),
            prefill_ratio: Some(3.0),
            decode_ratio: Some(2.0),
            ..alone
        };
        assert!(with.to_string().contains("ratio 3.00x"), "{with}");
        Ok(())
    }
}
