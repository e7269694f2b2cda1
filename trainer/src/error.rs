//! The trainer crate's one error type.

use std::path::PathBuf;

/// Errors from the training forward/backward, losses, optimizer and
/// checkpoints.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Kernel(#[from] arcticd_kernels::Error),
    #[error(transparent)]
    Engine(#[from] arcticd_engine::Error),
    /// Bad batch or data: empty sequences, ids out of range, mismatched masks.
    #[error("bad input: {0}")]
    Input(String),
    /// A policy server (an OpenAI-compatible endpoint) that could not be
    /// reached, failed a request or answered something unreadable.
    #[error("policy endpoint: {0}")]
    Endpoint(String),
    /// Gradients and parameters that do not line up.
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("checkpoint: {0}")]
    Checkpoint(String),
    #[error(transparent)]
    Sandbox(#[from] arcticd_sandbox::Error),
    /// A recipe that does not parse or does not make sense.
    #[error("recipe: {0}")]
    Recipe(String),
    /// A training run that cannot start or go on: its directory cannot be
    /// used or resumed, its batches stopped coming, it stopped early.
    #[error("run: {0}")]
    Run(String),
    /// A collective between data-parallel ranks that could not complete
    /// (a rank failed or left, ranks disagree, weights diverged).
    #[error("data-parallel: {0}")]
    Collective(String),
    /// A run whose memory plan does not fit.
    #[error("memory: {0}")]
    Memory(String),
    /// The io error is said in the message, not chained as a source
    /// (a chain would print it twice).
    #[error("{}: {error}", path.display())]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },
}

impl Error {
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            error: source,
        }
    }
}

pub type Result<T> = std::result::Result<T, Error>;
