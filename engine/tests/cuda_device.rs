//! On the GPU: every kernel of `kernels/` against the checks of `tests/kernel_checks` (the same
//! checks the CPU emulation runs in tests/kernel_emu.rs), the CUDA runner's forward pass
//! against the CPU backend on synthetic models (as tests/cuda_emulated.rs runs it through the
//! emulated driver), and the 8B-shaped benchmark. They need an NVIDIA device, so they are
//! `#[ignore]`d in the ordinary run (CI has no GPU) and run on a GPU machine with `cargo test
//! -p sluice-engine --features cuda --test cuda_device -- --ignored` (scripts/device-build and
//! scripts/device-check), where a missing driver or device fails them.
#![cfg(feature = "cuda")]

use std::sync::Arc;

use anyhow::{Context, bail};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use kernel_checks::{Arg, Dev};
use sluice_engine::cuda::{CudaRunner, KERNELS, compile, driver_available, probe};
use sluice_engine::forward::{LogitsWanted, SeqInput};

mod kernel_checks;

struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    arch: String,
}

fn gpu() -> anyhow::Result<Gpu> {
    if !driver_available() {
        bail!("no NVIDIA driver found: these tests run on a GPU machine");
    }
    let info = probe(0)?;
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    Ok(Gpu { ctx, stream, arch: info.arch() })
}

impl Gpu {
    fn function(&self, module: &'static str, name: &str) -> anyhow::Result<CudaFunction> {
        let src = KERNELS.iter().find(|(m, _)| *m == module).context("no such module")?.1;
        let compiled = compile(module, src, &self.arch)?;
        let m = self.ctx.load_module(Ptx::from_src(compiled.ptx))?;
        Ok(m.load_function(name)?)
    }
}

impl Dev for Gpu {
    /// Uploads every buffer, launches, waits and copies the `Out` buffers back.
    fn launch3(
        &self,
        module: &'static str,
        kernel: &str,
        grid: (u32, u32, u32),
        block: u32,
        args: &mut [Arg<'_>],
    ) -> anyhow::Result<()> {
        let f = self.function(module, kernel)?;
        let s = &self.stream;
        let mut bufs = Vec::new();
        for a in args.iter() {
            match a {
                Arg::In(b) => bufs.push(s.clone_htod(*b)?),
                Arg::Out(b) => bufs.push(s.clone_htod(&**b)?),
                _ => {}
            }
        }
        {
            let mut lb = s.launch_builder(&f);
            let mut it = bufs.iter();
            for a in args.iter() {
                match a {
                    Arg::In(_) | Arg::Out(_) => {
                        lb.arg(it.next().context("buffer")?);
                    }
                    Arg::I32(v) => {
                        lb.arg(v);
                    }
                    Arg::I64(v) => {
                        lb.arg(v);
                    }
                    Arg::U64(v) => {
                        lb.arg(v);
                    }
                    Arg::F32(v) => {
                        lb.arg(v);
                    }
                }
            }
            let cfg =
                LaunchConfig { grid_dim: grid, block_dim: (block, 1, 1), shared_mem_bytes: 0 };
            // SAFETY: the checks pass one argument per kernel parameter, of its type (buffers
            // as device pointers to the uploaded copies).
            unsafe { lb.launch(cfg) }?;
        }
        let mut it = bufs.iter();
        for a in args.iter_mut() {
            match a {
                Arg::In(_) => {
                    it.next();
                }
                Arg::Out(b) => s.memcpy_dtoh(it.next().context("buffer")?, &mut **b)?,
                _ => {}
            }
        }
        s.synchronize()?;
        Ok(())
    }

    fn emulated(&self) -> bool {
        false
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn elementwise_kernels_match_their_definitions() -> anyhow::Result<()> {
    kernel_checks::elementwise(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn dequantization_matches_the_cpu_backend() -> anyhow::Result<()> {
    kernel_checks::dequantization(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn paged_and_prefill_attention_match_softmax_attention() -> anyhow::Result<()> {
    kernel_checks::attention(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn argmax_takes_the_lowest_index_among_equals() -> anyhow::Result<()> {
    kernel_checks::argmax(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn sampling_follows_temperature_top_k_and_top_p() -> anyhow::Result<()> {
    kernel_checks::sampling(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn forward_matches_the_cpu_backend_on_a_synthetic_model() -> anyhow::Result<()> {
    gpu()?;
    kernel_checks::forward_parity()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn quantized_weights_dequantized_on_the_device_match_the_cpu_backend() -> anyhow::Result<()> {
    gpu()?;
    kernel_checks::quantized_parity()
}

/// Issue 7's speed figures on an 8B-shaped Llama with random bf16 weights made on the device:
/// decode step time at batch 1 against the HBM bound (weight bytes / 4.8 TB/s), decode
/// throughput at batch 64 and 256, and prefill TFLOP/s on a 2,048-token prompt against the
/// ~790 TFLOP/s bf16 peak measured on the H200. Prints the figures (logits stay on the device).
#[test]
#[ignore = "needs an NVIDIA GPU with ~40 GB free: run with --ignored on one"]
fn bench_8b_shaped_decode_and_prefill() -> anyhow::Result<()> {
    use sluice_engine::model::{LlamaConfig, RopeStyle};
    gpu()?;
    let config = LlamaConfig {
        arch: "llama".into(),
        vocab_size: 128_256,
        hidden: 4096,
        intermediate: 14_336,
        layers: 32,
        heads: 32,
        kv_heads: 8,
        head_dim: 128,
        rope_dims: 128,
        rope_theta: 500_000.0,
        rope_scaling: None,
        rope_style: RopeStyle::Halves,
        rms_eps: 1e-5,
        context_length: 8192,
        tied_embeddings: false,
    };
    let c = &config;
    let params = c.vocab_size * c.hidden * 2
        + c.layers
            * (c.hidden * (c.q_dim() + 2 * c.kv_dim())
                + c.q_dim() * c.hidden
                + 3 * c.hidden * c.intermediate);
    let weight_bytes = params as f64 * 2.0;
    let bound_ms = weight_bytes / 4.8e12 * 1e3;
    let r = CudaRunner::new(0)?;
    let model = r.random_model(c, 7)?;
    let block = 16usize;
    let time = |f: &mut dyn FnMut() -> anyhow::Result<()>, reps: usize| -> anyhow::Result<f64> {
        f()?;
        r.synchronize()?;
        let t = std::time::Instant::now();
        for _ in 0..reps {
            f()?;
        }
        r.synchronize()?;
        Ok(t.elapsed().as_secs_f64() / reps as f64)
    };

    // Prefill: one 2,048-token prompt.
    let prompt: Vec<u32> = (0..2048u32).map(|i| (i * 7919) % 128_000).collect();
    let table: Vec<u32> = (0..(2048 / block) as u32).collect();
    let mut cache = r.kv_cache(&model, block, table.len())?;
    let secs = time(
        &mut || {
            let b = [SeqInput {
                tokens: &prompt,
                start_pos: 0,
                block_table: &table,
                logits: LogitsWanted::Last,
            }];
            r.forward_device(&model, &mut cache, &b)?;
            Ok(())
        },
        3,
    )?;
    let t = prompt.len() as f64;
    // The products the pass does: every layer's weights for each token, the LM head for the
    // last token only (the embedding is a gather), and attention's QK^T and PV (the causal
    // half of 4 T^2 d per layer).
    let layer_params = params - 2 * c.vocab_size * c.hidden;
    let flops = 2.0 * layer_params as f64 * t
        + 2.0 * (c.vocab_size * c.hidden) as f64
        + 2.0 * c.layers as f64 * t * t * c.q_dim() as f64;
    eprintln!(
        "prefill 2048 tokens: {:.1} ms, {:.0} TFLOP/s ({:.2} of 790)",
        secs * 1e3,
        flops / secs / 1e12,
        flops / secs / 1e12 / 790.0
    );
    // Where the time goes: the same 2,048 rows as 32 prompts of 64 tokens do the same GEMMs
    // and elementwise work but 1/32 of the attention, so the difference is about attention's
    // share.
    let short = time(
        &mut || {
            let b: Vec<SeqInput<'_>> = (0..32)
                .map(|s| SeqInput {
                    tokens: &prompt[s * 64..(s + 1) * 64],
                    start_pos: 0,
                    block_table: &table[s * 64 / block..(s + 1) * 64 / block],
                    logits: LogitsWanted::Last,
                })
                .collect();
            r.forward_device(&model, &mut cache, &b)?;
            Ok(())
        },
        3,
    )?;
    let attn_flops = 2.0 * c.layers as f64 * t * t * c.q_dim() as f64 * (1.0 - 1.0 / 32.0);
    eprintln!(
        "prefill as 32 prompts of 64 tokens: {:.1} ms; attention of the 2048-token prompt about \
         {:.1} ms ({:.0} TFLOP/s), the rest {:.1} ms ({:.0} TFLOP/s)",
        short * 1e3,
        (secs - short) * 1e3,
        attn_flops / (secs - short) / 1e12,
        short * 1e3,
        (flops - 2.0 * c.layers as f64 * t * t * c.q_dim() as f64) / short / 1e12
    );

    // Decode: each sequence holds 128 tokens of context; batch 1 eagerly too, to show what
    // the graph saves.
    for (batch, graphs) in [(1usize, false), (1, true), (64, true), (256, true)] {
        let ctx = 128usize;
        let per_seq = ctx / block + 1;
        let mut cache = r.kv_cache(&model, block, batch * per_seq)?;
        cache.set_graphs(graphs);
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let toks: Vec<[u32; 1]> = (0..batch).map(|s| [(s as u32 * 31) % 128_000]).collect();
        let step_batch = || -> Vec<SeqInput<'_>> {
            (0..batch)
                .map(|s| SeqInput {
                    tokens: &toks[s],
                    start_pos: ctx,
                    block_table: &tables[s],
                    logits: LogitsWanted::Last,
                })
                .collect()
        };
        let secs = time(
            &mut || {
                r.forward_device(&model, &mut cache, &step_batch())?;
                Ok(())
            },
            10,
        )?;
        eprintln!(
            "decode batch {batch} ({}): {:.2} ms/step, {:.0} tok/s{}",
            if graphs { "CUDA graph" } else { "eager" },
            secs * 1e3,
            batch as f64 / secs,
            if batch == 1 {
                format!(" (HBM bound {bound_ms:.2} ms: {:.2} of it)", bound_ms / (secs * 1e3))
            } else {
                String::new()
            }
        );
        if !graphs {
            continue;
        }
        // The serving path: the step with its tokens chosen, greedy on the device (ids back)
        // against the logits copied back for the host to choose.
        let rows: Vec<Option<usize>> = (0..batch).map(Some).collect();
        let picks = vec![sluice_engine::backend::Pick::Argmax; batch];
        let mut step = |pick: bool| -> anyhow::Result<f64> {
            time(
                &mut || {
                    let b = step_batch();
                    if pick {
                        r.forward_picking(&model, &mut cache, &b, &rows, &picks)?;
                    } else {
                        let logits = r.forward(&model, &mut cache, &b)?;
                        let ids: Vec<u32> = logits
                            .chunks(c.vocab_size)
                            .map(sluice_engine::sampler::argmax)
                            .collect();
                        std::hint::black_box(ids);
                    }
                    Ok(())
                },
                10,
            )
        };
        let (device_pick, host_pick) = (step(true)?, step(false)?);
        eprintln!(
            "decode batch {batch}, tokens chosen: on the device {:.2} ms/step, logits to the \
             host {:.2} ms/step ({:.2}x)",
            device_pick * 1e3,
            host_pick * 1e3,
            host_pick / device_pick
        );
    }

    // Long contexts: decode steps over 8,000 tokens each, attention split into parts across
    // the device (the default) against one block per row and head group (max splits 1).
    for batch in [1usize, 8] {
        let ctx = 8000usize;
        let per_seq = ctx / block + 1;
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let toks: Vec<[u32; 1]> = (0..batch).map(|s| [(s as u32 * 31) % 128_000]).collect();
        let mut ms = Vec::new();
        for max_splits in [1usize, 64] {
            r.set_max_splits(max_splits);
            let mut cache = r.kv_cache(&model, block, batch * per_seq)?;
            let secs = time(
                &mut || {
                    let b: Vec<SeqInput<'_>> = (0..batch)
                        .map(|s| SeqInput {
                            tokens: &toks[s],
                            start_pos: ctx,
                            block_table: &tables[s],
                            logits: LogitsWanted::Last,
                        })
                        .collect();
                    r.forward_device(&model, &mut cache, &b)?;
                    Ok(())
                },
                10,
            )?;
            ms.push(secs * 1e3);
        }
        eprintln!(
            "decode batch {batch} at 8000 tokens of context (CUDA graph): {:.2} ms/step split, \
             {:.2} ms/step unsplit ({:.2}x)",
            ms[1],
            ms[0],
            ms[0] / ms[1]
        );
    }

    // Where the time goes, phase by phase (events between launches, one eager pass each; last,
    // so the figures above are out even if this fails).
    let gemm_flops = |phase: &str, rows: f64| -> Option<f64> {
        let (h, q, kv, ff) =
            (c.hidden as f64, c.q_dim() as f64, c.kv_dim() as f64, c.intermediate as f64);
        let per_row = match phase {
            "QKV GEMM" => h * (q + 2.0 * kv),
            "O GEMM" => q * h,
            "gate/up GEMM" => 2.0 * h * ff,
            "down GEMM" => ff * h,
            _ => return None,
        };
        Some(2.0 * per_row * rows * c.layers as f64)
    };
    let show = |title: &str, phases: &[(&str, f64)], rows: f64| {
        let total: f64 = phases.iter().map(|(_, ms)| ms).sum();
        eprintln!("profile, {title}: {total:.2} ms in all");
        for (phase, ms) in phases {
            let rate = match (gemm_flops(phase, rows), *phase) {
                (Some(f), _) if rows > 1.0 => format!(", {:.0} TFLOP/s", f / ms / 1e9),
                // One row: a GEMM reads its weights once (bf16).
                (Some(f), _) => format!(", {:.2} TB/s of weights", f / rows / ms / 1e9),
                (None, "prefill attention") => format!(
                    ", {:.0} TFLOP/s",
                    2.0 * c.layers as f64 * rows * rows * c.q_dim() as f64 / ms / 1e9
                ),
                _ => String::new(),
            };
            eprintln!("  {phase:<18} {ms:>8.3} ms {:>5.1}%{rate}", 100.0 * ms / total);
        }
    };
    let prefill = [SeqInput {
        tokens: &prompt,
        start_pos: 0,
        block_table: &table,
        logits: LogitsWanted::Last,
    }];
    show("prefill 2048 tokens", &r.profile(&model, &mut cache, &prefill)?, t);
    for batch in [1usize, 256] {
        let ctx = 128usize;
        let per_seq = ctx / block + 1;
        let mut cache = r.kv_cache(&model, block, batch * per_seq)?;
        let tables: Vec<Vec<u32>> = (0..batch)
            .map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect())
            .collect();
        let toks: Vec<[u32; 1]> = (0..batch).map(|s| [(s as u32 * 31) % 128_000]).collect();
        let b: Vec<SeqInput<'_>> = (0..batch)
            .map(|s| SeqInput {
                tokens: &toks[s],
                start_pos: ctx,
                block_table: &tables[s],
                logits: LogitsWanted::Last,
            })
            .collect();
        r.profile(&model, &mut cache, &b)?; // the first pass sets cuBLAS up
        show(
            &format!("decode batch {batch}, eager"),
            &r.profile(&model, &mut cache, &b)?,
            batch as f64,
        );
    }
    Ok(())
}
