//! Where the forward pass runs: the CPU runner, or (feature `cuda`) a GPU through
//! [`CudaRunner`](crate::cuda::CudaRunner). The serving core calls [`Backend::forward_picking`] with
//! the same batch either way, so the scheduler, block pool and server do not change.

use std::str::FromStr;

use crate::error::{EngineError, Result};
use crate::forward::{ForwardProfile, KvCache, KvDtype, Runner, SeqInput};
// The types a step speaks live below every backend (the CPU runner, the CUDA runner, the
// sampler), so none of them imports upward from here.
pub use crate::forward::{PassTimes, Pick, StepOutput, wanted_rows};
use crate::model::LlamaWeights;

/// A compute device.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Device {
    /// The CPU runner.
    #[default]
    Cpu,
    /// CUDA device N.
    Cuda(usize),
}

impl FromStr for Device {
    type Err = String;

    /// `cpu`, `cuda` (device 0) or `cuda:N`.
    fn from_str(s: &str) -> std::result::Result<Device, String> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|n| n.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| format!("{s:?} is not a device: cpu, cuda or cuda:N")),
        }
    }
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(n) => write!(f, "cuda:{n}"),
        }
    }
}

/// The KV cache's size as `--kv-cache-mb` and `--gpu-memory-utilization` ask on `device`:
/// bytes (512 MiB unless given), and on a GPU without `--kv-cache-mb` the share of its memory
/// the engine may take (0.9 unless given), which then sizes the cache instead.
pub fn kv_cache_size(
    device: Device,
    kv_cache_mb: Option<usize>,
    gpu_memory_utilization: Option<f64>,
) -> Result<(usize, Option<f64>)> {
    let on_gpu = matches!(device, Device::Cuda(_));
    if !on_gpu && gpu_memory_utilization.is_some() {
        return Err(EngineError::InvalidRequest(
            "--gpu-memory-utilization sizes a GPU's KV cache; on the CPU give --kv-cache-mb".into(),
        ));
    }
    let share = match (on_gpu, kv_cache_mb) {
        (true, None) => Some(gpu_memory_utilization.unwrap_or(0.9)),
        _ => None,
    };
    if let Some(share) = share
        && !(share > 0.0 && share <= 1.0)
    {
        return Err(EngineError::InvalidRequest(format!(
            "--gpu-memory-utilization must be in (0, 1], not {share}"
        )));
    }
    let bytes = kv_cache_mb
        .unwrap_or(512)
        .checked_mul(1 << 20)
        .ok_or_else(|| EngineError::InvalidRequest("--kv-cache-mb is too large".into()))?;
    Ok((bytes, share))
}

impl Device {
    /// KV bytes one block of `block_size` positions takes on this device (`dtype` on the CPU,
    /// bf16 on a GPU).
    pub fn bytes_per_block(
        self,
        weights: &LlamaWeights,
        block_size: usize,
        dtype: KvDtype,
    ) -> usize {
        match self {
            Device::Cpu => KvCache::bytes_per_block(weights, block_size, dtype),
            Device::Cuda(_) => cuda_block_bytes(&weights.config, block_size),
        }
    }
}

/// How big the KV cache is.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum KvSize {
    /// This many blocks.
    Blocks(usize),
    /// On a GPU: what `share` of the device's memory leaves once the weights and the pass
    /// buffers for batches of up to `max_tokens` rows over `max_seqs` sequences are in, less
    /// [`DEVICE_HEADROOM`] (vLLM's `gpu_memory_utilization`).
    DeviceShare {
        /// Of the device's total memory, in (0, 1].
        share: f64,
        /// Token rows per pass.
        max_tokens: usize,
        /// Sequences per pass.
        max_seqs: usize,
    },
}

/// Device memory a [`KvSize::DeviceShare`] cache leaves free beyond the share: for what the
/// driver, cuBLAS and the CUDA graphs allocate on their own.
pub const DEVICE_HEADROOM: usize = 256 << 20;

/// KV bytes of one block of `block_size` positions on a GPU, from the model's shape: K and V,
/// bf16.
fn cuda_block_bytes(c: &crate::model::LlamaConfig, block_size: usize) -> usize {
    2 * c.layers * c.kv_dim() * block_size * 2
}

/// A runner and its KV cache on one device.
#[cfg_attr(
    feature = "cuda",
    expect(
        clippy::large_enum_variant,
        reason = "one per engine, made once, never moved in a loop"
    )
)]
pub enum Backend {
    /// The CPU runner and cache.
    Cpu {
        /// Compute threads and scratch.
        runner: Runner,
        /// The paged cache.
        cache: KvCache,
        /// The passes' times, by the host's clock (the CPU's passes are synchronous).
        clock: HostClock,
    },
    /// A GPU.
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
}

/// The CPU passes' [`PassTimes`]: when the last one ended, while the next one's gap counts.
#[derive(Debug, Default)]
pub struct HostClock {
    last_end: Option<std::time::Instant>,
    times: PassTimes,
}

/// A pass [launched](Backend::launch) and not yet [collected](Backend::collect).
#[must_use = "a launched pass is collected"]
pub struct PendingPass(Pending);

enum Pending {
    /// Run already (the CPU), or refused.
    Done(Result<StepOutput>),
    /// Queued on a GPU.
    #[cfg(feature = "cuda")]
    Cuda(crate::cuda::PendingPicks),
}

impl std::fmt::Debug for PendingPass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self.0 {
            Pending::Done(_) => "PendingPass(done)",
            #[cfg(feature = "cuda")]
            Pending::Cuda(_) => "PendingPass(queued)",
        })
    }
}

/// A CUDA error as the engine reports it: the request's fault or the device's.
#[cfg(feature = "cuda")]
fn cuda_error(e: crate::cuda::CudaError) -> EngineError {
    match e {
        crate::cuda::CudaError::Invalid(m) => EngineError::InvalidRequest(m),
        other => EngineError::Device(other.to_string()),
    }
}

/// The runner, the weights on the device and the device cache.
#[cfg(feature = "cuda")]
pub struct CudaBackend {
    /// Kernels, cuBLAS and the stream.
    pub runner: crate::cuda::CudaRunner,
    /// The weights in bf16 on the device.
    pub model: crate::cuda::CudaModel,
    /// The paged cache on the device.
    pub cache: crate::cuda::CudaKvCache,
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Backend::Cpu { runner, .. } => f.debug_tuple("Cpu").field(runner).finish(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => f.debug_tuple("Cuda").field(&b.runner).finish(),
        }
    }
}

impl Backend {
    /// Opens `device` for `weights` with a cache of `kv` in blocks of `block_size` positions
    /// (`threads`: CPU compute threads, 0 = all cores; `dtype`: what a CPU cache stores, a
    /// GPU's is bf16). A GPU that cannot be used (no driver, no device, a build without CUDA)
    /// is a clear error.
    pub fn new(
        device: Device,
        weights: &LlamaWeights,
        threads: usize,
        block_size: usize,
        kv: KvSize,
        dtype: KvDtype,
    ) -> Result<Backend> {
        if let KvSize::DeviceShare { share, .. } = kv
            && !(share > 0.0 && share <= 1.0)
        {
            return Err(EngineError::InvalidRequest(format!(
                "the share of device memory must be in (0, 1], not {share}"
            )));
        }
        match (device, kv) {
            (Device::Cpu, KvSize::DeviceShare { .. }) => Err(EngineError::InvalidRequest(
                "a share of device memory sizes a GPU's KV cache; on the CPU give it in bytes"
                    .into(),
            )),
            (Device::Cpu, KvSize::Blocks(num_blocks)) => Ok(Backend::Cpu {
                runner: Runner::new(threads),
                cache: KvCache::with_dtype(weights, block_size, num_blocks, dtype),
                clock: HostClock::default(),
            }),
            #[cfg(feature = "cuda")]
            (Device::Cuda(n), kv) => {
                let fail =
                    |e: crate::cuda::CudaError| EngineError::Device(format!("cuda:{n}: {e}"));
                let runner = crate::cuda::CudaRunner::new(n).map_err(fail)?;
                let model = runner.upload(weights).map_err(fail)?;
                let num_blocks = match kv {
                    KvSize::Blocks(b) => b,
                    KvSize::DeviceShare { share, max_tokens, max_seqs } => {
                        let probe = (block_size, max_tokens, max_seqs);
                        blocks_for_share(&runner, &model, probe, share).map_err(fail)?
                    }
                };
                let cache = runner.kv_cache(&model, block_size, num_blocks).map_err(fail)?;
                Ok(Backend::Cuda(Box::new(CudaBackend { runner, model, cache })))
            }
            #[cfg(not(feature = "cuda"))]
            (Device::Cuda(n), _) => Err(EngineError::Device(format!(
                "cuda:{n}: this build has no CUDA backend (build with the `cuda` feature)"
            ))),
        }
    }

    /// The KV cache's blocks.
    pub fn num_blocks(&self) -> usize {
        match self {
            Backend::Cpu { cache, .. } => cache.num_blocks(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.cache.num_blocks(),
        }
    }

    /// Sets aside the forward pass's buffers for batches of up to `max_tokens` token rows over
    /// `max_seqs` sequences: on a GPU, device memory now (and the decode graphs' shared
    /// buffers), so a device too small for the configured cache and batch fails at start
    /// rather than on the first large batch. Returns the bytes set aside (0 on the CPU, whose
    /// runner sizes its scratch per pass).
    pub fn reserve(&mut self, max_tokens: usize, max_seqs: usize) -> Result<usize> {
        match self {
            Backend::Cpu { .. } => {
                // The CPU runner sizes its scratch per pass.
                let _ = (max_tokens, max_seqs);
                Ok(0)
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => {
                let CudaBackend { runner, model, cache } = &mut **b;
                runner
                    .reserve(model, cache, max_tokens, max_seqs)
                    .map_err(|e| EngineError::Device(e.to_string()))
            }
        }
    }

    /// Where the CPU passes' time went so far (none on a GPU, whose passes are timed by the
    /// device bench's profile).
    pub fn profile(&self) -> Option<ForwardProfile> {
        match self {
            Backend::Cpu { runner, .. } => Some(runner.profile()),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => None,
        }
    }

    /// Lets a higher-priority arrival stop a pass between layers (on the CPU; a GPU pass,
    /// queued on the device as a whole, runs to its end).
    pub fn set_interrupt(&mut self, interrupt: std::sync::Arc<crate::interrupt::Interrupt>) {
        match self {
            Backend::Cpu { runner, .. } => runner.set_interrupt(interrupt),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => drop(interrupt),
        }
    }

    /// Whether [`Pick::Draw`] is done here (a GPU); elsewhere draws stay with the host
    /// sampler.
    pub fn draws_on_device(&self) -> bool {
        match self {
            Backend::Cpu { .. } => false,
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => true,
        }
    }

    /// How long the passes since the last call kept the device busy, and how long it sat
    /// idle between them ([`PassTimes`]): on a GPU by events on its stream, on the CPU by the
    /// host's clock.
    pub fn take_pass_times(&mut self) -> PassTimes {
        match self {
            Backend::Cpu { clock, .. } => std::mem::take(&mut clock.times),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => b.runner.take_pass_times(),
        }
    }

    /// The device is about to go idle for want of work (nothing runs or waits): the time
    /// until the next pass is not a gap between passes.
    pub fn pass_break(&mut self) {
        match self {
            Backend::Cpu { clock, .. } => clock.last_end = None,
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => {
                if let Err(e) = b.runner.pass_break() {
                    tracing::warn!(error = %e, "reading the passes' device times");
                }
            }
        }
    }

    /// As [`Backend::forward_picking`], without waiting for the pass: a GPU's pass is queued
    /// and its picks copied back as it ends, while the host goes on; [`Backend::collect`]
    /// waits for it and gives its output. (The CPU's pass runs here, whole.) At most one pass
    /// may be pending at a time.
    pub fn launch(
        &mut self,
        weights: &LlamaWeights,
        batch: &[SeqInput<'_>],
        picks: &[Pick],
    ) -> PendingPass {
        match self {
            Backend::Cpu { .. } => {
                PendingPass(Pending::Done(self.forward_cpu(weights, batch, picks)))
            }
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => {
                let rows = wanted_rows(batch, picks);
                let CudaBackend { runner, model, cache } = &mut **b;
                match runner.launch_picking(model, cache, batch, rows, picks) {
                    Ok(p) => PendingPass(Pending::Cuda(p)),
                    Err(e) => PendingPass(Pending::Done(Err(cuda_error(e)))),
                }
            }
        }
    }

    /// Waits for a pass [launched](Backend::launch) here and gives its output.
    pub fn collect(&mut self, pass: PendingPass) -> Result<StepOutput> {
        match (self, pass.0) {
            (_, Pending::Done(out)) => out,
            #[cfg(feature = "cuda")]
            (Backend::Cuda(b), Pending::Cuda(p)) => b.runner.collect_picks(p).map_err(cuda_error),
            #[cfg(feature = "cuda")]
            (Backend::Cpu { .. }, Pending::Cuda(_)) => {
                Err(EngineError::Device("a GPU's pass collected on the CPU backend".into()))
            }
        }
    }

    /// Runs one batch (the wanted logits, `vocab` floats per wanted row, in batch order),
    /// choosing the next token where it can: for each sequence `i` whose last logits are
    /// wanted and `picks[i]` is [`Pick::Argmax`] (or [`Pick::Draw`], on a device that
    /// [draws](Backend::draws_on_device)), the token comes back instead of its logits. On a
    /// GPU that is done there, so a step copies back a few ids rather than `vocab` floats per
    /// sequence. `picks` may be shorter than `batch` (missing: logits).
    pub fn forward_picking(
        &mut self,
        weights: &LlamaWeights,
        batch: &[SeqInput<'_>],
        picks: &[Pick],
    ) -> Result<StepOutput> {
        let pass = self.launch(weights, batch, picks);
        self.collect(pass)
    }

    /// The CPU backend's pass, timed by the host's clock.
    fn forward_cpu(
        &mut self,
        weights: &LlamaWeights,
        batch: &[SeqInput<'_>],
        picks: &[Pick],
    ) -> Result<StepOutput> {
        let vocab = weights.config.vocab_size;
        let rows = wanted_rows(batch, picks);
        let Backend::Cpu { runner, cache, clock } = self else {
            return Err(EngineError::Device("not the CPU backend".into()));
        };
        let began = std::time::Instant::now();
        let out = runner
            .forward_logits(weights, cache, batch)
            .map(|_| ())
            .and_then(|()| Self::pick_cpu(runner, batch.len(), &rows, picks, vocab));
        // The picking is the device's work here (a GPU's argmax is in its pass).
        let ended = std::time::Instant::now();
        let gap = clock.last_end.map(|last| (began - last).as_secs_f64());
        clock.times.record(gap, (ended - began).as_secs_f64());
        clock.last_end = Some(ended);
        out
    }

    /// The runner's last pass's wanted logits over `seqs` sequences, with the argmax rows'
    /// tokens picked.
    fn pick_cpu(
        runner: &Runner,
        seqs: usize,
        rows: &[Option<usize>],
        picks: &[Pick],
        vocab: usize,
    ) -> Result<StepOutput> {
        let all = runner.last_logits();
        if all.len() < rows.len() * vocab {
            return Err(EngineError::Device("the pass returned fewer logits than wanted".into()));
        }
        let mut out = StepOutput { logits: Vec::new(), picked: vec![None; seqs] };
        let mut argmax_rows = Vec::new();
        let mut argmax_seqs = Vec::new();
        for (r, pick) in rows.iter().enumerate() {
            match pick.map(|i| (i, picks[i])) {
                Some((i, Pick::Argmax)) => {
                    argmax_rows.push(r);
                    argmax_seqs.push(i);
                }
                Some((_, Pick::Draw { .. })) => {
                    return Err(EngineError::Device(
                        "the CPU backend leaves draws to the host sampler".into(),
                    ));
                }
                _ => out.logits.extend_from_slice(&all[r * vocab..(r + 1) * vocab]),
            }
        }
        for (i, token) in argmax_seqs.into_iter().zip(runner.argmax_rows(vocab, &argmax_rows)) {
            out.picked[i] = Some(token);
        }
        Ok(out)
    }
}

/// The KV blocks of `block_size` positions that fit in `share` of the device's memory beside
/// `model` (on the device already) and the pass buffers for batches of `max_tokens` rows over
/// `max_seqs` sequences, less [`DEVICE_HEADROOM`]. The pass buffers are measured by reserving
/// them over a one-block cache, freed before the device's free memory is read.
#[cfg(feature = "cuda")]
fn blocks_for_share(
    runner: &crate::cuda::CudaRunner,
    model: &crate::cuda::CudaModel,
    (block_size, max_tokens, max_seqs): (usize, usize, usize),
    share: f64,
) -> std::result::Result<usize, crate::cuda::CudaError> {
    let passes = {
        let mut probe = runner.kv_cache(model, block_size, 1)?;
        runner.reserve(model, &mut probe, max_tokens, max_seqs)?
    };
    // Freed memory goes back to the driver at a synchronization.
    runner.synchronize()?;
    let (free, total) = runner.memory_info()?;
    let others = total - (total as f64 * share) as usize;
    let room = free.saturating_sub(others + passes + DEVICE_HEADROOM);
    let per_block = cuda_block_bytes(model.config(), block_size);
    let blocks = room / per_block.max(1);
    if blocks == 0 {
        return Err(crate::cuda::CudaError::Invalid(format!(
            "{share} of the device's {} MiB leaves no room for a KV block of {per_block} bytes \
             ({} MiB free with the weights in, {} MiB for the pass buffers, {} MiB kept free)",
            total >> 20,
            free >> 20,
            passes >> 20,
            (others + DEVICE_HEADROOM) >> 20
        )));
    }
    tracing::info!(
        blocks,
        kv_mib = (blocks * per_block) >> 20,
        free_mib = free >> 20,
        total_mib = total >> 20,
        share,
        "KV cache sized to the device's memory"
    );
    Ok(blocks)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::forward::LogitsWanted;
    use sluice_text::gguf::GgufFile;

    #[test]
    fn kv_cache_sizes_follow_the_flags() {
        assert_eq!(kv_cache_size(Device::Cpu, None, None).ok(), Some((512 << 20, None)));
        assert_eq!(kv_cache_size(Device::Cpu, Some(64), None).ok(), Some((64 << 20, None)));
        assert!(kv_cache_size(Device::Cpu, None, Some(0.5)).is_err());
        assert_eq!(kv_cache_size(Device::Cuda(0), None, None).ok(), Some((512 << 20, Some(0.9))));
        assert_eq!(kv_cache_size(Device::Cuda(0), Some(64), None).ok(), Some((64 << 20, None)));
        assert!(kv_cache_size(Device::Cuda(0), None, Some(1.5)).is_err());
        assert!(kv_cache_size(Device::Cpu, Some(usize::MAX), None).is_err());
    }
    use crate::model::load_gguf_weights;
    use crate::quant::GgmlType;
    use crate::synth::{SynthSpec, write_gguf};

    /// Picked tokens are the argmax of the logits the same pass gives without picking, and the
    /// rows not picked come back unchanged, in order.
    #[test]
    fn picking_returns_the_argmax_and_the_other_rows()
    -> std::result::Result<(), Box<dyn std::error::Error>> {
        let dir = tempfile::tempdir()?;
        let path = dir.path().join("m.gguf");
        write_gguf(&SynthSpec::tiny(), GgmlType::F32, &path)?;
        let w = load_gguf_weights(&GgufFile::open(&path)?)?;
        let vocab = w.config.vocab_size;
        let (a, b, c) = ([5u32, 6, 7], [9u32, 10], [11u32, 12, 13, 14]);
        let (ta, tb, tc) = ([0u32], [1u32], [2u32]);
        let seq = |tokens, table, logits| SeqInput {
            tokens,
            start_pos: 0,
            block_table: table,
            logits,
            adapter: None,
        };
        let batch = [
            seq(&a[..], &ta[..], LogitsWanted::Last),
            seq(&b[..], &tb[..], LogitsWanted::All),
            seq(&c[..], &tc[..], LogitsWanted::Last),
        ];
        let mut plain = Backend::new(Device::Cpu, &w, 1, 16, KvSize::Blocks(4), KvDtype::F16)?;
        let all = plain.forward_picking(&w, &batch, &[])?;
        assert_eq!(all.logits.len(), (1 + 2 + 1) * vocab);
        assert_eq!(all.picked, vec![None, None, None]);
        let mut picking = Backend::new(Device::Cpu, &w, 1, 16, KvSize::Blocks(4), KvDtype::F16)?;
        // Sequence 1 asks for all rows: a pick there is ignored.
        let out = picking.forward_picking(&w, &batch, &[Pick::Argmax; 3])?;
        let row = |r: usize| &all.logits[r * vocab..(r + 1) * vocab];
        assert_eq!(
            out.picked,
            vec![Some(crate::sampler::argmax(row(0))), None, Some(crate::sampler::argmax(row(3)))]
        );
        assert_eq!(out.logits, all.logits[vocab..3 * vocab].to_vec());
        let picks = [Pick::Logits, Pick::Argmax, Pick::Argmax];
        assert_eq!(wanted_rows(&batch, &picks), vec![None, None, None, Some(2)]);
        // Draws are the device's: the CPU backend refuses them rather than answer otherwise.
        let draw = Pick::Draw { temperature: 1.0, top_k: 0, top_p: 1.0, uniform: 0.5 };
        assert!(picking.forward_picking(&w, &batch[..1], &[draw]).is_err());
        Ok(())
    }

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        assert!("gpu".parse::<Device>().is_err() && "cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
