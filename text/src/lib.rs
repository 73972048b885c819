//! Sluice text: what the gateway, the engine and the load generator share about a model's
//! text. GGUF files (reader and writer), the GGML tensor type tags, tokenizers from GGUF
//! metadata or `tokenizer.json`, chat templates, a model's text side from either format, the
//! synthetic test vocabulary, and the streaming metrics' definitions (TTFT, TPOT, ITL).
//!
//! Nothing here runs a model: the crate has no kernels, no server and no async runtime, so the
//! gateway links it without the engine.

pub mod error;
pub mod ggml;
pub mod gguf;
pub mod model;
pub mod stream;
pub mod synth;
pub mod template;
pub mod tokenizer;
pub mod tools;

pub use error::{Result, TextError};
