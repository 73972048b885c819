//! The text crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong reading a model's text side or encoding with it.
#[derive(Debug, thiserror::Error)]
pub enum TextError {
    /// A file could not be opened or read.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// A file is malformed, truncated or hostile.
    #[error("{path}: {message}")]
    Format {
        /// The file involved.
        path: PathBuf,
        /// What is wrong, naming the tensor or key.
        message: String,
    },
    /// Tokenizer construction or encoding failed.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The chat template failed to compile or render, or refused the messages.
    #[error("chat template: {0}")]
    Template(String),
}

impl TextError {
    /// Builds a [`TextError::Format`] error for `path`.
    pub fn format(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        TextError::Format { path: path.into(), message: message.into() }
    }

    /// Builds a [`TextError::Io`] error for `path`.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        TextError::Io { path: path.into(), source }
    }
}

/// Result with [`TextError`].
pub type Result<T, E = TextError> = std::result::Result<T, E>;
