//! The engine's one error type.

use std::path::PathBuf;

/// Everything that can go wrong inside the engine crate.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A model file is malformed, truncated or hostile.
    #[error("{path}: {message}")]
    Format {
        /// The file involved.
        path: PathBuf,
        /// What is wrong, naming the tensor or key.
        message: String,
    },
    /// The model is well formed but uses something this engine does not support.
    #[error("unsupported model: {0}")]
    Unsupported(String),
    /// Tokenizer construction or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render, or refused the messages.
    #[error("chat template: {0}")]
    Template(String),
    /// A request is invalid for this model (bad token id, context overflow, ...).
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// The engine cannot take work (its thread has stopped).
    #[error("engine unavailable: {0}")]
    Unavailable(String),
    /// Obtaining the default model failed.
    #[error("model fetch: {0}")]
    Fetch(String),
    /// The compute device cannot be used (no driver, no device, no CUDA in this build).
    #[error("device {0}")]
    Device(String),
    /// A pass stopped between layers for a higher-priority arrival
    /// ([`crate::interrupt::Interrupt`]); the step is planned again.
    #[error("the pass was interrupted for a higher priority")]
    Interrupted,
    /// A benchmark's baseline could not be measured (the other program failed).
    #[error("baseline {0}")]
    Baseline(String),
}

impl EngineError {
    /// Builds a [`EngineError::Format`] error for `path`.
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        EngineError::Format { path: path.into(), message: message.into() }
    }

    /// Builds a [`EngineError::Io`] error for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        EngineError::Io { path: path.into(), source }
    }

    /// A short label for metrics and logs.
    pub fn error_type(&self) -> &'static str {
        match self {
            EngineError::Io { .. } => "io",
            EngineError::Format { .. } => "format",
            EngineError::Unsupported(_) => "unsupported",
            EngineError::Tokenizer(_) => "tokenizer",
            EngineError::Template(_) => "template",
            EngineError::InvalidRequest(_) => "validation",
            EngineError::Fetch(_) => "fetch",
            EngineError::Unavailable(_) => "unavailable",
            EngineError::Device(_) => "device",
            EngineError::Interrupted => "interrupted",
            EngineError::Baseline(_) => "baseline",
        }
    }
}

impl From<sluice_text::TextError> for EngineError {
    /// The text crate's errors keep their kind (a bad tokenizer is still a format error of its
    /// file, a refusing template still a template error).
    fn from(e: sluice_text::TextError) -> Self {
        use sluice_text::TextError;
        match e {
            TextError::Io { path, source } => EngineError::Io { path, source },
            TextError::Format { path, message } => EngineError::Format { path, message },
            TextError::Tokenizer(m) => EngineError::Tokenizer(m),
            TextError::Template(m) => EngineError::Template(m),
        }
    }
}

/// Result with [`EngineError`].
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
