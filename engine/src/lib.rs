//! Sluice engine: model loading (GGUF, safetensors), execution identity, the CPU and CUDA
//! forward passes of Llama-family models and the serving core. The text side (GGUF metadata,
//! tokenizer, chat template) is `sluice_text`'s.

pub mod backend;
pub mod bench;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod defaults;
pub mod error;
pub mod fetch;
pub mod forward;
pub mod generate;
pub mod identity;
pub mod interrupt;
pub mod loader;
pub mod lora;
pub mod model;
pub mod pass_bench;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod serve;
pub mod server;
pub mod structured;
pub mod synth;

pub use error::{EngineError, Result};
