//! The CUDA runner end to end on a machine without a GPU: cudarc finds, under the names
//! libcuda.so and libcublas.so, an emulated driver and cuBLAS (tests/emu/fake_cuda.cpp,
//! tests/emu/fake_cublas.cpp) built here with our kernels over the CPU emulation of CUDA, and
//! loaded into this process before cudarc looks. NVRTC is the real one (PyPI; CI installs it),
//! so the kernels are still compiled to PTX for sm_90 as on the device. Then the same parity
//! checks the GPU machine runs (tests/cuda_device.rs): the runner's forward pass, mixed
//! batches, CUDA graphs against eager passes, quantized weights dequantized by our kernels,
//! greedy tokens picked on the device, all against the CPU backend.
//!
//! What this shows is our use of the driver, cuBLAS and the kernels (argument order, shapes,
//! layouts, graph capture, the plan); not speed, and not the hardware's own behaviour.
#![cfg(feature = "cuda")]

mod emu;
mod kernel_checks;

use std::sync::{Mutex, MutexGuard, OnceLock};

use anyhow::{Context, bail, ensure};
use sluice_engine::backend::{Pick, wanted_rows};
use sluice_engine::cuda::{CudaRunner, driver_available, nvrtc_available};
use sluice_engine::forward::{KvCache, LogitsWanted, Runner, SeqInput};
use sluice_engine::quant::GgmlType;

/// Builds the emulated libcuda.so and libcublas.so and loads them (once per process, kept for
/// its life), or says why it cannot; then waits for the emulated device (the tests take it one
/// at a time, so one test's memory figures are its own). `Ok(None)`: no NVRTC here and none
/// required (SLUICE_REQUIRE_NVRTC unset; CI sets it), so the test has nothing to run.
fn emulated_cuda() -> anyhow::Result<Option<MutexGuard<'static, ()>>> {
    static DEVICE: Mutex<()> = Mutex::new(());
    if !nvrtc_available() && !std::env::var("SLUICE_REQUIRE_NVRTC").is_ok_and(|v| v == "1") {
        eprintln!("NVRTC not found: the CUDA runner is not run under emulation here");
        return Ok(None);
    }
    static LOADED: OnceLock<Result<(), String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let load = || -> anyhow::Result<()> {
            if !nvrtc_available() {
                bail!(
                    "NVRTC is needed (the kernels are compiled by it): pip install \
                     nvidia-cuda-nvrtc-cu12 and put its lib directory on LD_LIBRARY_PATH"
                );
            }
            // Under the target directory (a /tmp mounted noexec cannot hold libraries to load);
            // one folder per process, removed once the libraries are loaded.
            let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR"))
                .join(format!("cuda-emulated-{}", std::process::id()));
            std::fs::create_dir_all(&dir)?;
            let cuda = dir.join("libcuda.so");
            let driver = format!(
                "{}\n#include \"{}\"\n",
                emu::kernels_source()?,
                emu::dir().join("fake_cuda.cpp").display()
            );
            emu::shared_library(&driver, &cuda, Some("libcuda.so"), &[])?;
            let blas = dir.join("libcublas.so");
            let blas_src = std::fs::read_to_string(emu::dir().join("fake_cublas.cpp"))?;
            emu::shared_library(&blas_src, &blas, Some("libcublas.so"), &[&cuda])?;
            for lib in [&cuda, &blas] {
                use libloading::os::unix::{Library, RTLD_GLOBAL, RTLD_NOW};
                // SAFETY: our own libraries; loaded globally under their sonames so cudarc's
                // dlopen("libcuda.so") / ("libcublas.so") finds them, and never unloaded.
                let l = unsafe { Library::open(Some(lib), RTLD_NOW | RTLD_GLOBAL) }?;
                std::mem::forget(l);
            }
            let _ = std::fs::remove_dir_all(&dir);
            ensure!(driver_available(), "the emulated driver did not load as libcuda.so");
            Ok(())
        };
        load().map_err(|e| format!("{e:#}"))
    });
    match loaded {
        // A test that failed holding the device left it as it was: the next may go on.
        Ok(()) => Ok(Some(DEVICE.lock().unwrap_or_else(std::sync::PoisonError::into_inner))),
        Err(e) => bail!("{e}"),
    }
}

#[test]
fn forward_matches_the_cpu_backend_through_the_emulated_driver() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    kernel_checks::forward_parity()
}

#[test]
fn tenant_adapters_match_the_cpu_backend_through_the_emulated_driver() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    kernel_checks::adapter_parity()
}

#[test]
fn quantized_weights_match_the_cpu_backend_through_the_emulated_driver() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    kernel_checks::quantized_parity()
}

/// `reserve` sets aside exactly the device memory it reports, and a second call replaces the
/// first's buffers rather than adding to them.
#[test]
fn reserve_reports_the_memory_it_sets_aside() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let w = kernel_checks::synthetic(GgmlType::F32)?;
    let r = CudaRunner::new(0)?;
    let model = r.upload(&w)?;
    let mut cache = r.kv_cache(&model, 16, 8)?;
    let free = || -> anyhow::Result<usize> { Ok(r.memory_info()?.0) };
    let before = free()?;
    let reported = r.reserve(&model, &mut cache, 256, 8)?;
    let after = free()?;
    ensure!(reported > 0, "nothing reserved");
    ensure!(
        before - after == reported,
        "reserve reported {reported} bytes, allocated {}",
        before - after
    );
    let again = r.reserve(&model, &mut cache, 256, 8)?;
    ensure!(again == reported && free()? == after, "a second reserve took more memory");
    Ok(())
}

/// The profile of a pass names each phase that ran (prefill and decode attention for a mixed
/// batch; bias only for models with one) with its time, and the pass it profiles is a real
/// one: its K/V are in the cache for the next step, which gives the CPU backend's logits.
#[test]
fn a_profiled_pass_names_its_phases_and_does_the_pass() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let w = kernel_checks::tiled_model()?;
    let vocab = w.config.vocab_size;
    let r = CudaRunner::new(0)?;
    let model = r.upload(&w)?;
    let mut cache = r.kv_cache(&model, 16, 8)?;
    let (a, b): (Vec<u32>, Vec<u32>) = ((0..40).collect(), (0..3).map(|i| i * 5).collect());
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((0..3).collect(), (3..4).collect());
    let seq = |tokens, start_pos, block_table| SeqInput {
        tokens,
        start_pos,
        block_table,
        logits: LogitsWanted::Last,
        adapter: None,
    };
    // b's first two tokens cached, then a's prompt beside b's third token (a decode row).
    r.forward(&model, &mut cache, &[seq(&b[..2], 0, &tb)])?;
    let started = std::time::Instant::now();
    let phases = r.profile(&model, &mut cache, &[seq(&a, 0, &ta), seq(&b[2..], 2, &tb)])?;
    let wall = started.elapsed().as_secs_f64() * 1e3;
    let names: Vec<&str> = phases.iter().map(|(n, _)| *n).collect();
    ensure!(
        names
            == [
                "embedding",
                "RMSNorm",
                "QKV GEMM",
                "RoPE + K/V write",
                "decode attention",
                "prefill attention",
                "O GEMM",
                "add + RMSNorm",
                "gate/up GEMM",
                "SiLU x up",
                "down GEMM",
                "LM head"
            ],
        "phases {names:?}"
    );
    let total: f64 = phases.iter().map(|(_, ms)| ms).sum();
    ensure!(phases.iter().all(|(_, ms)| *ms >= 0.0) && total > 0.0 && total <= wall, "{phases:?}");
    // The next token of each after the profiled pass, against the CPU backend.
    let mut cpu = Runner::new(2);
    let mut cpu_cache = KvCache::new(&w, 16, 8);
    let (a2, b2) = ([7u32], [9u32]);
    let mut want = Vec::new();
    for batch in [
        vec![seq(&b[..2], 0, &tb)],
        vec![seq(&a, 0, &ta), seq(&b[2..], 2, &tb)],
        vec![seq(&a2, 40, &ta), seq(&b2, 3, &tb)],
    ] {
        want = cpu.forward(&w, &mut cpu_cache, &batch)?;
    }
    let got = r.forward(&model, &mut cache, &[seq(&a2, 40, &ta), seq(&b2, 3, &tb)])?;
    let worst = kernel_checks::compare_logits(&got, &want, vocab)?;
    eprintln!("after a profiled pass: max difference {worst:.4} of the range; {phases:?}");
    Ok(())
}

/// The device bench's code, end to end on a small model under the emulated driver (so a
/// mistake in it shows here, not in the GPU machine's few minutes); its figures mean nothing
/// here.
#[test]
fn the_device_bench_runs_on_a_small_shape() -> anyhow::Result<()> {
    use sluice_engine::model::{LlamaConfig, RopeStyle};
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let config = LlamaConfig {
        arch: "llama".into(),
        vocab_size: 256,
        hidden: 128,
        intermediate: 256,
        layers: 2,
        heads: 4,
        kv_heads: 2,
        head_dim: 64,
        rope_dims: 64,
        rope_theta: 10_000.0,
        rope_scaling: None,
        rope_style: RopeStyle::Halves,
        rms_eps: 1e-5,
        context_length: 512,
        tied_embeddings: false,
        gemma: None,
    };
    let shape = kernel_checks::BenchShape {
        prompt: 128,
        decode_ctx: 40,
        batches: &[3],
        long_ctx: 300,
        long_batches: &[1],
        gemv_batches: &[1, 2],
        gemv_shapes: &[],
        // The emulation's kernels are built once, with the defaults: the default's own shape
        // runs the comparison's path (a cache of random keys and values, a recompile).
        attention_shapes: &[(2, false)],
        profile_batches: &[2, 8],
        reps: 1,
    };
    let r = CudaRunner::new(0)?;
    // The matrix-vector shapes the GPU bench compares: ones the kernels cannot take are
    // refused with the reason, and the default compiles and loads again.
    for bad in [(3, 4), (32, 2), (16, 16), (4, 0), (4, 17)] {
        let e = r.set_gemv_shape(Some(bad)).err().map(|e| e.to_string()).unwrap_or_default();
        anyhow::ensure!(e.contains("want 1, 2, 4, 8 or 16 warps"), "shape {bad:?}: {e:?}");
    }
    r.set_gemv_shape(None)?;
    // ... and the decode attention shapes.
    for bad in [(0, false), (9, true)] {
        let e = r.set_attention_shape(Some(bad)).err().map(|e| e.to_string()).unwrap_or_default();
        anyhow::ensure!(e.contains("want 1..=8"), "attention shape {bad:?}: {e:?}");
    }
    r.set_attention_shape(None)?;
    anyhow::ensure!(r.attention_shape() == (2, false), "{:?}", r.attention_shape());
    kernel_checks::bench_llama(&r, &config, &shape)
}

/// With a share of the device's memory, the KV cache takes what the weights and pass buffers
/// leave of it: the device then holds the share less the headroom, to within one block. A
/// share that leaves no room, one out of range, and one on the CPU are refused.
#[test]
fn a_share_of_device_memory_sizes_the_kv_cache() -> anyhow::Result<()> {
    use sluice_engine::backend::{Backend, DEVICE_HEADROOM, Device, KvSize};
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let w = kernel_checks::synthetic(GgmlType::F32)?;
    let (share, max_tokens, max_seqs) = (0.5, 256, 8);
    let kv = KvSize::DeviceShare { share, max_tokens, max_seqs };
    let mut b = Backend::new(Device::Cuda(0), &w, 1, 16, kv, Default::default())?;
    b.reserve(max_tokens, max_seqs)?;
    let Backend::Cuda(cuda) = &b else { bail!("not a CUDA backend") };
    cuda.runner.synchronize()?;
    let (free, total) = cuda.runner.memory_info()?;
    let (used, limit) = (total - free, (total as f64 * share) as usize - DEVICE_HEADROOM);
    let per_block = Device::Cuda(0).bytes_per_block(&w, 16, Default::default());
    ensure!(
        used <= limit && used + per_block > limit,
        "{} blocks of {per_block} bytes: {used} bytes in use, the limit {limit}",
        b.num_blocks()
    );
    drop(b);
    for (device, share, says) in [
        (Device::Cuda(0), 0.2, "leaves no room"),
        (Device::Cuda(0), 1.5, "must be in (0, 1]"),
        (Device::Cpu, 0.5, "on the CPU"),
    ] {
        let kv = KvSize::DeviceShare { share, max_tokens, max_seqs };
        let e =
            Backend::new(device, &w, 1, 16, kv, Default::default()).err().context("accepted")?;
        ensure!(e.to_string().contains(says), "{device} {share}: {e}");
    }
    Ok(())
}

/// A prefill long enough for two row tiles of the tensor-core kernel (head size 64), after a
/// cached prefix, then greedy tokens picked on the device: the same tokens as the argmax of the
/// CPU backend's logits wherever those are not near-ties.
#[test]
fn tiled_prefill_and_device_argmax_match_the_cpu_backend() -> anyhow::Result<()> {
    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let w = kernel_checks::tiled_model()?;
    let vocab = w.config.vocab_size;
    let prompt: Vec<u32> = (0..150u32).map(|i| (i * 37 + 3) % vocab as u32).collect();
    let table: Vec<u32> = (0..10).collect();
    let seq = |tokens, start_pos, logits| SeqInput {
        tokens,
        start_pos,
        block_table: &table,
        logits,
        adapter: None,
    };
    // 20 tokens first (the cached prefix), then 130 more in one chunk: tiles of 64, 64, 2.
    let passes = [(0usize, 20usize, LogitsWanted::None), (20, 150, LogitsWanted::All)];

    let mut cpu = Runner::new(2);
    let mut cpu_cache = KvCache::new(&w, 16, 12);
    let mut want = Vec::new();
    for (a, b, logits) in passes {
        want = cpu.forward(&w, &mut cpu_cache, &[seq(&prompt[a..b], a, logits)])?;
    }
    let r = CudaRunner::new(0)?;
    let model = r.upload(&w)?;
    let mut cache = r.kv_cache(&model, 16, 12)?;
    let mut got = Vec::new();
    for (a, b, logits) in passes {
        got = r.forward(&model, &mut cache, &[seq(&prompt[a..b], a, logits)])?;
    }
    let worst = kernel_checks::compare_logits(&got, &want, vocab)?;
    eprintln!("tiled prefill, 130 rows after 20 cached: max difference {worst:.4} of the range");

    // One decode step twice at the same position (the second rewrites the same K/V): the token
    // picked on the device is the argmax of the logits the first pass returned.
    let next = [prompt[149]];
    let step = [seq(&next[..], 150, LogitsWanted::Last)];
    let logits = r.forward(&model, &mut cache, &step)?;
    let picks = [Pick::Argmax];
    let out = r.forward_picking(&model, &mut cache, &step, &wanted_rows(&step, &picks), &picks)?;
    ensure!(out.logits.is_empty(), "a picked row's logits came back");
    let want = sluice_engine::sampler::argmax(&logits);
    ensure!(out.picked == vec![Some(want)], "picked {:?}, argmax {want}", out.picked);
    Ok(())
}

/// The serving engine on the emulated device (`--device cuda`): the scheduler, continuous
/// batching, decode graphs and greedy tokens picked on the device. Each prompt alone and all
/// together give the same tokens (the emulated device's arithmetic does not depend on the
/// batch); a request asking for log-probabilities (its logits go back to the host sampler)
/// gets the same tokens as without (picked on the device); usage counts what ran.
#[test]
fn the_serving_engine_runs_on_the_emulated_device() -> anyhow::Result<()> {
    use std::sync::Arc;
    use std::time::Instant;

    use sluice_engine::backend::Device;
    use sluice_engine::loader::LoadedModel;
    use sluice_engine::sampler::SamplingParams;
    use sluice_engine::serve::core::EngineConfig;
    use sluice_engine::serve::handle::{EngineHandle, RequestStream};
    use sluice_engine::serve::{CacheScope, EngineEvent, FinishReason, ValidRequest};
    use sluice_engine::synth::{SynthSpec, write_gguf};

    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let spec = SynthSpec { hidden: 128, heads: 2, kv_heads: 1, ..SynthSpec::tiny() };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    write_gguf(&spec, GgmlType::Q8_0, &path)?;
    let model = Arc::new(LoadedModel::load(&path)?);
    let config = EngineConfig {
        kv_cache_bytes: 4 << 20,
        max_num_seqs: 4,
        device: Device::Cuda(0),
        ..EngineConfig::default()
    };
    let h = EngineHandle::start(Arc::clone(&model), config)?;
    let sampled = |id: &str, prompt: &[u32], logprobs: Option<usize>, sampling| ValidRequest {
        request_id: id.into(),
        prompt: prompt.to_vec(),
        max_tokens: 12,
        sampling,
        stop: Vec::new(),
        stop_token_ids: Vec::new(),
        ignore_eos: true,
        logprobs,
        prompt_logprobs: None,
        cache_scope: CacheScope::Private(id.into()),
        priority: 0,
        weight: 1,
        tpot_target: None,
        arrival: Instant::now(),
        grammar: None,
        adapter: None,
    };
    let request = |id: &str, prompt: &[u32], logprobs: Option<usize>| {
        sampled(id, prompt, logprobs, SamplingParams::default())
    };
    let collect = |mut s: RequestStream| -> anyhow::Result<(Vec<u32>, usize, usize)> {
        let mut tokens = Vec::new();
        while let Some(ev) = s.blocking_next() {
            match ev {
                EngineEvent::Tokens { tokens: t, .. } => tokens.extend(t.iter().map(|t| t.token)),
                EngineEvent::Finished { reason, usage, error, .. } => {
                    ensure!(
                        error.is_none() && reason == FinishReason::Length,
                        "{reason:?} {error:?}"
                    );
                    return Ok((tokens, usage.prompt_tokens, usage.completion_tokens));
                }
                EngineEvent::PromptLogprobs(_) => {}
            }
        }
        bail!("the stream ended without Finished")
    };
    let prompts: Vec<Vec<u32>> =
        (0..3u32).map(|p| (0..5 + 9 * p).map(|i| (i * 31 + p * 7 + 1) % 300).collect()).collect();
    let mut alone = Vec::new();
    for (i, p) in prompts.iter().enumerate() {
        let (tokens, prompt_tokens, completion) =
            collect(h.submit(request(&format!("a{i}"), p, None))?)?;
        ensure!(prompt_tokens == p.len() && completion == 12 && tokens.len() == 12);
        alone.push(tokens);
    }
    let streams: Vec<RequestStream> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| h.submit(request(&format!("b{i}"), p, None)))
        .collect::<Result<_, _>>()?;
    for (i, s) in streams.into_iter().enumerate() {
        let (tokens, ..) = collect(s)?;
        ensure!(tokens == alone[i], "prompt {i}: alone {:?}, batched {tokens:?}", alone[i]);
    }
    let (with_logprobs, ..) = collect(h.submit(request("lp", &prompts[1], Some(2)))?)?;
    ensure!(
        with_logprobs == alone[1],
        "host-sampled {with_logprobs:?} vs device-picked {:?}",
        alone[1]
    );

    // Draws on the device: top-k 1 keeps only the argmax, so it is greedy; a seeded draw
    // repeats; different seeds do not all give the same tokens.
    let draw = |seed: u64, top_k: usize| SamplingParams {
        temperature: 0.9,
        top_k,
        top_p: 0.9,
        seed,
        ..SamplingParams::default()
    };
    let (top1, ..) = collect(h.submit(sampled("k1", &prompts[2], None, draw(3, 1)))?)?;
    ensure!(top1 == alone[2], "top-k 1 drew {top1:?}, greedy {:?}", alone[2]);
    let mut by_seed = Vec::new();
    for (i, seed) in [5u64, 5, 6, 7].into_iter().enumerate() {
        let req = sampled(&format!("d{i}"), &prompts[0], None, draw(seed, 0));
        let (tokens, ..) = collect(h.submit(req)?)?;
        ensure!(tokens.iter().all(|t| (*t as usize) < model.weights.config.vocab_size));
        by_seed.push(tokens);
    }
    ensure!(by_seed[0] == by_seed[1], "seed 5 twice: {:?} vs {:?}", by_seed[0], by_seed[1]);
    ensure!(
        by_seed[2..].iter().any(|t| *t != by_seed[0]),
        "seeds 5, 6 and 7 drew the same tokens: {by_seed:?}"
    );

    // The passes' device time, by events on the stream: every pass counted, and gaps only
    // between passes that followed one another (the batched streams' steps).
    let m = h.metrics();
    let (busy, gap, gaps, steps) =
        (m.device_busy.get(), m.device_gap.get(), m.device_gaps.get(), m.steps.get());
    ensure!(busy > 0.0 && gap > 0.0, "device busy {busy} s, idle between passes {gap} s");
    ensure!(gaps > 0 && gaps < steps, "{gaps} gaps counted over {steps} steps");
    Ok(())
}

/// `sluice bench forward` on the CUDA backend: decode steps through the graphs, timed by the
/// host and by events on the stream.
#[test]
fn the_forward_bench_runs_on_the_emulated_device() -> anyhow::Result<()> {
    use sluice_engine::backend::Device;
    use sluice_engine::loader::LoadedModel;
    use sluice_engine::pass_bench::{ForwardBenchConfig, bench_forward};
    use sluice_engine::synth::{SynthSpec, write_gguf};

    let Some(_device) = emulated_cuda()? else {
        return Ok(());
    };
    let spec = SynthSpec { hidden: 128, heads: 2, kv_heads: 1, ..SynthSpec::tiny() };
    let dir = tempfile::tempdir()?;
    let path = dir.path().join("m.gguf");
    write_gguf(&spec, GgmlType::BF16, &path)?;
    let model = LoadedModel::load(&path)?;
    let cfg = ForwardBenchConfig {
        device: Device::Cuda(0),
        batches: vec![1, 3],
        context: 20,
        steps: 2,
        max_num_batched_tokens: 32,
        threads: 1,
    };
    let points = bench_forward(&model, &cfg)?;
    ensure!(points.len() == 2, "{points:?}");
    for p in &points {
        ensure!(p.step_ms > 0.0 && p.device_step_ms > 0.0, "{p:?}");
        ensure!(p.device_step_ms <= p.step_ms_mean * 1.0001, "{p:?}");
    }
    Ok(())
}
