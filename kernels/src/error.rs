//! The kernels crate's one error type.

/// Errors from tensor construction and op dispatch.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("dtype mismatch: expected {expected}, got {got}")]
    DType { expected: String, got: String },
    #[error("device {0} is not available in this build")]
    NoDevice(String),
    #[error("index out of range: {0}")]
    Index(String),
}

pub type Result<T> = std::result::Result<T, Error>;
