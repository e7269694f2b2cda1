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
