//! arcticd kernels: the `Tensor` type, device dispatch, and every numeric op
//! of the model as a forward (and, as the trainer lands, backward) pair.
//!
//! Not for: anything that knows about models, layers or checkpoints; that is
//! the engine's job. The CPU implementation of each op is the reference and
//! always exists (`cpu::*`, plain slice functions in the llm.c style); the
//! CUDA path (`cuda::*`, behind the `cuda` feature) has the same names and
//! is tested against it.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod error;
pub mod host;
pub mod tensor;

pub use device::Device;
pub use error::{Error, Result};
pub use tensor::{DType, Storage, Tensor, TensorId};
