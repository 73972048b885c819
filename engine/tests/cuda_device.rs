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
fn matrix_vector_products_match_their_definitions() -> anyhow::Result<()> {
    kernel_checks::gemv(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn the_fused_projection_matches_the_kernels_it_fuses() -> anyhow::Result<()> {
    kernel_checks::gemv_rope(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn argmax_takes_the_lowest_index_among_equals() -> anyhow::Result<()> {
    kernel_checks::argmax(&gpu()?)
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn lora_updates_rows_of_mixed_adapters_and_leaves_the_rest() -> anyhow::Result<()> {
    kernel_checks::lora(&gpu()?)
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
fn tenant_adapters_match_the_cpu_backend() -> anyhow::Result<()> {
    gpu()?;
    kernel_checks::adapter_parity()
}

#[test]
#[ignore = "needs an NVIDIA GPU: run with --ignored on one"]
fn quantized_weights_dequantized_on_the_device_match_the_cpu_backend() -> anyhow::Result<()> {
    gpu()?;
    kernel_checks::quantized_parity()
}

/// Issue 7's speed figures on an 8B-shaped Llama with random bf16 weights made on the device:
/// decode step time at batch 1 against the memory bound (weight bytes / the device's own
/// bandwidth), decode throughput at batch 64 and 256, and prefill TFLOP/s on a 2,048-token
/// prompt against the device's data-sheet bf16 peak; it prints which device and figures it
/// used. Prints the figures (logits stay on the device).
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
        gemma: None,
    };
    let r = CudaRunner::new(0)?;
    kernel_checks::bench_llama(&r, &config, &kernel_checks::BenchShape::ISSUE)
}
