//! Model architectures. One file per architecture (candle style); Qwen3.5 is
//! the one arcticd trains and serves.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod ops;
pub mod qwen3_5;
pub mod saved;

pub use qwen3_5::{
    check_ids, logit_rows_per_chunk, LinearPacks, PagedPast, Qwen3_5, SeqCache, SeqInput,
};
pub use saved::{planned_floats, planned_layer_floats, Keep, Kept, Trace};
