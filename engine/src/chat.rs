//! Chat template (placeholder until implemented).
