//! Model architectures. One file per architecture (candle style); Qwen3.5 is
//! the one arcticd trains and serves.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ops;
pub mod paged_batch;
pub mod qwen3_5;
pub mod saved;

pub use qwen3_5::{
    check_ids, logit_rows_per_chunk, LinearPacks, PagedPast, Qwen3_5, SeqCache, SeqInput,
};
pub use saved::{planned_floats, planned_layer_floats, Keep, Kept, Trace};

/// How a forward runs the gated-delta recurrence over a segment of new
/// tokens (a prefill; a decode token is the recurrent step either way).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PrefillForm {
    /// Token by token, as decode and the trainer compute it: prefill,
    /// decode, scoring and training give the same bits, so the trainer's
    /// log-probs equal the engine's exactly. The default.
    #[default]
    Recurrent,
    /// In chunks of 64 tokens from the segment's first (the WY form; a
    /// chunk of one token is the recurrent step). On a GPU every chunk's
    /// state-free work runs at once, so long prompts prefill faster. It
    /// rounds differently from the recurrent form (1e-5 relative in the
    /// kernel tests), so a trainer's log-probs no longer equal the engine's
    /// bit for bit: a serving choice, not a training one. On the CPU it is
    /// the slower form at these head sizes (benches/kernels.rs) and exists
    /// so that the engine's guarantees under it are tested without a GPU.
    Chunked,
}

impl std::str::FromStr for PrefillForm {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "recurrent" => Ok(PrefillForm::Recurrent),
            "chunked" => Ok(PrefillForm::Chunked),
            other => Err(crate::Error::Config(format!(
                "prefill {other:?}: expected recurrent or chunked"
            ))),
        }
    }
}

/// How a model's matrices are held on a GPU (the CPU holds what the
/// checkpoint holds, packed in bf16 when every value is a bf16 value).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDType {
    /// bf16 matrices: half the memory and bandwidth; the products round
    /// their input to bf16 as well.
    #[default]
    Bf16,
    /// f32 matrices and fp32 products: the CPU's numbers to rounding.
    F32,
}

impl std::str::FromStr for WeightDType {
    type Err = crate::Error;

    fn from_str(s: &str) -> crate::Result<Self> {
        match s {
            "bf16" => Ok(WeightDType::Bf16),
            "f32" => Ok(WeightDType::F32),
            other => Err(crate::Error::Config(format!(
                "weights {other:?}: expected bf16 or f32"
            ))),
        }
    }
}
