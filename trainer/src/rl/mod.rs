//! The asynchronous RL loop behind `arcticd train` (docs/ARCHITECTURE.md).
//!
//! - [`recipe`]: every setting of a run, TOML, documented in
//!   `recipes/default.toml`.
//! - [`pool`]: the task pool, epochs without replacement, retirement and
//!   recheck.
//! - [`batch`]: finished groups to one update's batch (staleness bound,
//!   masking, group-relative advantages, counts).
//! - [`probe`]: the engine/trainer identity measured on purpose after an
//!   update, however far behind the loop runs.
//! - [`run_dir`]: the run directory, checkpoints with run state, resume.
//! - [`orchestrator`]: the loop itself (dispatcher, rollout workers,
//!   trainer, frozen evaluation).
//!
//! Not for: the losses and the optimizer step (`step`, `loss`), the agent
//! loop (`harness`).

pub mod batch;
pub mod orchestrator;
pub mod pool;
pub mod probe;
pub mod recipe;
pub mod replay;
pub mod run_dir;

pub use orchestrator::{gpu_memory_plan, memory_plan, run, HeldOutChange, RunOptions, RunSummary};
pub use recipe::Recipe;
