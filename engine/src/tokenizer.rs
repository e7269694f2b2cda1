//! Tokenizer (placeholder until implemented).
