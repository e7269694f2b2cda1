//! The kernels crate's one error type.

/// Errors from tensor construction and op dispatch.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("shape mismatch: {0}")]
    Shape(String),
    #[error("dtype mismatch: expected {expected}, got {got}")]
    DType { expected: String, got: String },
    #[error("device not available: {0}")]
    NoDevice(String),
    /// A read of a tensor whose elements were released (kept only in a
    /// packed form for the matrix product).
    #[error("tensor {0} was released after packing (read-only, served from its packed form)")]
    Released(String),
    #[error("index out of range: {0}")]
    Index(String),
    /// A device name that names none (`gpu`, `cuda:x`).
    #[error("{0}")]
    DeviceName(String),
    /// NVRTC rejected a kernel module; `log` is its compiler output.
    #[error("CUDA kernel module {module} did not compile:\n{log}")]
    Compile { module: String, log: String },
    #[cfg(feature = "cuda")]
    #[error("CUDA driver: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    /// cuBLAS refused or failed a product; `op` names it.
    #[cfg(feature = "cuda")]
    #[error("cuBLAS in {op}: {source:?}")]
    Blas {
        op: String,
        source: cudarc::cublas::result::CublasError,
    },
}

pub type Result<T> = std::result::Result<T, Error>;
