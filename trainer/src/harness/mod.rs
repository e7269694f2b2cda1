//! The rollout harness: how an agent works on a task and when it earns
//! reward (docs/ARCHITECTURE.md, recipe steps 2 to 4, 11; the trajectory contract).
//!
//! - [`format`]: the tool-call format (render, strict check, lenient parse),
//!   which lives in the engine crate beside the chat template.
//! - [`tools`]: bash, the file editor and submit, run in the sandbox.
//! - [`policy`]: the model trait (prompt ids in; ids, log-probs, weight
//!   versions, finish reason out) and a scripted policy;
//!   [`openai`]: an OpenAI-compatible HTTP policy; [`engine_policy`]: the
//!   in-process engine behind its router.
//! - [`rollout`]: the agent loop with gated reward.
//! - [`trajectory`]: the record and its transcript view.
//! - [`eval`]: pass@1 over K attempts, resumable.
//! - [`wrong_patch`]: agent-written wrong patches for the task audit;
//!   [`strengthen`]: agent-written tests for the tasks it finds loose.
//!
//! Not for: losses, batching, the async orchestrator.

pub mod engine_policy;
pub mod eval;
pub mod openai;
pub mod policy;
pub mod rollout;
pub mod strengthen;
pub mod tools;
pub mod trajectory;
pub mod wrong_patch;

pub use arcticd_engine::tool_call as format;
pub use engine_policy::{EnginePolicy, EnginePolicyRouter, Routing};
pub use format::{check as check_format, FormatCheck, ToolCall};
pub use policy::{Completion, FinishReason, GenerateRequest, Policy, ScriptedPolicy};
pub use rollout::{Harness, RolloutConfig};
pub use trajectory::{Termination, Trajectory};
