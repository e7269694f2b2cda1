//! The engine crate's one error type. Every message names the file, field or
//! tensor at fault, because users see these directly from the CLI.

use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("config: {0}")]
    Config(String),
    #[error("weights: {0}")]
    Weights(String),
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    #[error("chat template: {0}")]
    Template(String),
    #[error("input: {0}")]
    Input(String),
    /// A failure inside the engine (a forward or a sampling step), never the
    /// caller's fault: a server logs it and answers 500 without the details.
    #[error("internal: {0}")]
    Internal(String),
    /// The engine cannot take work (it stopped, or is shutting down).
    #[error("unavailable: {0}")]
    Unavailable(String),
    #[error("{}: {source}", path.display())]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error(transparent)]
    Kernel(#[from] arcticd_kernels::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }
}
