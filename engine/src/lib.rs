//! arcticd engine: the Qwen3.5 hybrid model, checkpoint loading, tokenizer and
//! chat format. The paged cache, scheduler and server build on this.

pub mod chat;
pub mod error;
pub mod tokenizer;

pub use error::{Error, Result};
