//! arcticd trainer: the backward of the Qwen3.5 model on the same CPU kernels
//! the engine runs forward, losses (SFT and asynchronous-RL policy gradient),
//! AdamW with torch semantics, and Hugging Face checkpoints.
//!
//! Not for: sampling or serving (engine), sandboxes (sandbox crate). The
//! rollout harness and the async orchestrator build on this.

pub mod backward;
pub mod checkpoint;
pub mod comm;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod data;
pub mod device;
pub mod error;
pub mod grads;
pub mod harness;
pub mod interrupt;
pub mod loss;
pub mod memory;
pub mod model;
pub mod optim;
pub mod rft;
pub mod rl;
pub mod sft;
pub mod step;
pub mod warm_start;

pub use error::{Error, Result};
pub use grads::ModelGrads;
