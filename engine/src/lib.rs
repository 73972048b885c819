//! Sluice engine: model loading (GGUF, safetensors), tokenizer, chat template, execution
//! identity and the CPU forward pass of Llama-family models.

pub mod backend;
pub mod bench;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod error;
pub mod fetch;
pub mod forward;
pub mod generate;
pub mod gguf;
pub mod identity;
pub mod loader;
pub mod model;
pub mod quant;
pub mod safetensors;
pub mod sampler;
pub mod serve;
pub mod server;
pub mod synth;
pub mod template;
pub mod tokenizer;

pub use error::{EngineError, Result};
