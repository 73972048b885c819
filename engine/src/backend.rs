//! Where the forward pass runs: the CPU runner, or (feature `cuda`) a GPU through
//! [`CudaRunner`](crate::cuda::CudaRunner). The serving core calls [`Backend::forward`] with
//! the same batch either way, so the scheduler, block pool and server do not change.

use std::str::FromStr;

use crate::error::{EngineError, Result};
use crate::forward::{KvCache, Runner, SeqInput};
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

impl Device {
    /// KV bytes one block of `block_size` positions takes on this device (f32 on the CPU, bf16
    /// on a GPU).
    pub fn bytes_per_block(self, weights: &LlamaWeights, block_size: usize) -> usize {
        match self {
            Device::Cpu => KvCache::bytes_per_block(weights, block_size),
            Device::Cuda(_) => {
                let c = &weights.config;
                2 * c.layers * c.kv_dim() * block_size * 2
            }
        }
    }
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
    },
    /// A GPU.
    #[cfg(feature = "cuda")]
    Cuda(Box<CudaBackend>),
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
    /// Opens `device` for `weights` with a cache of `num_blocks` blocks of `block_size`
    /// positions (`threads`: CPU compute threads, 0 = all cores). A GPU that cannot be used
    /// (no driver, no device, a build without CUDA) is a clear error.
    pub fn new(
        device: Device,
        weights: &LlamaWeights,
        threads: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<Backend> {
        match device {
            Device::Cpu => Ok(Backend::Cpu {
                runner: Runner::new(threads),
                cache: KvCache::new(weights, block_size, num_blocks),
            }),
            #[cfg(feature = "cuda")]
            Device::Cuda(n) => {
                let fail =
                    |e: crate::cuda::CudaError| EngineError::Device(format!("cuda:{n}: {e}"));
                let runner = crate::cuda::CudaRunner::new(n).map_err(fail)?;
                let model = runner.upload(weights).map_err(fail)?;
                let cache = runner.kv_cache(&model, block_size, num_blocks).map_err(fail)?;
                Ok(Backend::Cuda(Box::new(CudaBackend { runner, model, cache })))
            }
            #[cfg(not(feature = "cuda"))]
            Device::Cuda(n) => Err(EngineError::Device(format!(
                "cuda:{n}: this build has no CUDA backend (build with the `cuda` feature)"
            ))),
        }
    }

    /// Runs one batch; the wanted logits, `vocab` floats per wanted token, in batch order.
    pub fn forward(&mut self, weights: &LlamaWeights, batch: &[SeqInput<'_>]) -> Result<Vec<f32>> {
        match self {
            Backend::Cpu { runner, cache } => runner.forward(weights, cache, batch),
            #[cfg(feature = "cuda")]
            Backend::Cuda(b) => {
                let CudaBackend { runner, model, cache } = &mut **b;
                runner.forward(model, cache, batch).map_err(|e| match e {
                    crate::cuda::CudaError::Invalid(m) => EngineError::InvalidRequest(m),
                    other => EngineError::Device(other.to_string()),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn devices_parse_and_print() {
        assert_eq!("cpu".parse(), Ok(Device::Cpu));
        assert_eq!("cuda".parse(), Ok(Device::Cuda(0)));
        assert_eq!("cuda:3".parse(), Ok(Device::Cuda(3)));
        assert!("gpu".parse::<Device>().is_err() && "cuda:x".parse::<Device>().is_err());
        assert_eq!(Device::Cuda(1).to_string(), "cuda:1");
    }
}
