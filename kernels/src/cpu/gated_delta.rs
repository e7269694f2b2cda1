//! Gated delta rule (placeholder until implemented).
