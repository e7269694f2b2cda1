//! arcticd engine: the Qwen3.5 hybrid model, checkpoint loading, tokenizer and
//! chat format. The paged cache, scheduler and server build on this.

pub mod block_pool;
pub mod chat;
pub mod config;
pub mod engine;
pub mod error;
pub mod guide;
pub mod init;
pub mod kv_cache;
pub mod model;
pub mod params;
pub mod prefix_cache;
pub mod router;
pub mod sampler;
pub mod scheduler;
pub mod tokenizer;
pub mod tool_call;
pub mod weights;

pub use config::{LayerType, ModelConfig};
pub use error::{Error, Failure, Result};
pub use model::{Qwen3_5, SeqCache, SeqInput};
pub use params::ParamStore;
