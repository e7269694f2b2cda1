//! arcticd engine: the Qwen3.5 hybrid model, checkpoint loading, tokenizer and
//! chat format. The paged cache, scheduler and server build on this.

pub mod chat;
pub mod config;
pub mod error;
pub mod init;
pub mod model;
pub mod params;
pub mod tokenizer;
pub mod weights;

pub use config::{LayerType, ModelConfig};
pub use error::{Error, Result};
pub use model::{Qwen3_5, SeqCache, SeqInput};
pub use params::ParamStore;
