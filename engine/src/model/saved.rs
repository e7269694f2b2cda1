//! What a forward keeps for a backward. The trainer's forward is the
//! engine's forward ([`Qwen3_5::forward_keeping`](super::Qwen3_5::forward_keeping))
//! with these switched on: every buffer here is one the forward computes
//! anyway, moved out instead of dropped, plus the few it would otherwise
//! overwrite in place (the conv output before SiLU, the attention output
//! before its gate) and the recurrent state every `CHECKPOINT_EVERY` tokens.
//!
//! Not for: gradients or the backward itself (the trainer's).

/// What the training forward keeps of each layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// Every activation of every layer.
    All,
    /// Only each layer's input; the backward recomputes the rest one layer
    /// at a time ([`Qwen3_5::recompute_layer`](super::Qwen3_5::recompute_layer)).
    Inputs,
}

/// A training forward over fresh sequences packed back to back.
#[derive(Debug)]
pub struct Trace {
    pub layers: Vec<Kept>,
    /// The residual stream after the last layer, before the final norm.
    pub x_last: Vec<f32>,
    pub final_rstd: Vec<f32>,
    /// Final hidden states after the final norm, `[tokens, hidden]`.
    pub hidden: Vec<f32>,
}

/// A layer's activations, or only its input when they are recomputed.
#[derive(Debug)]
pub enum Kept {
    All(Box<LayerActs>),
    Input(Vec<f32>),
}

/// One decoder layer's activations.
#[derive(Debug)]
pub struct LayerActs {
    pub x_in: Vec<f32>,
    pub rstd1: Vec<f32>,
    pub xn1: Vec<f32>,
    pub mixer: MixerActs,
    /// The residual stream after the mixer, before the MLP.
    pub x_mid: Vec<f32>,
    pub rstd2: Vec<f32>,
    pub xn2: Vec<f32>,
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub act: Vec<f32>,
}

#[derive(Debug)]
pub enum MixerActs {
    Linear(Box<LinearActs>),
    Full(Box<FullActs>),
}

/// A Gated DeltaNet mixer's activations.
#[derive(Debug)]
pub struct LinearActs {
    pub qkv: Vec<f32>,
    /// The causal conv's output before SiLU.
    pub conv_pre: Vec<f32>,
    pub q_raw: Vec<f32>,
    pub k_raw: Vec<f32>,
    /// The L2 norms' reciprocal norms.
    pub rn_q: Vec<f32>,
    pub rn_k: Vec<f32>,
    /// Normalised (and, for q, scaled).
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    pub z: Vec<f32>,
    pub a: Vec<f32>,
    pub beta: Vec<f32>,
    pub g: Vec<f32>,
    pub core: Vec<f32>,
    pub rstd: Vec<f32>,
    pub normed: Vec<f32>,
    /// Per sequence, the recurrent state every `CHECKPOINT_EVERY` tokens.
    pub checkpoints: Vec<Vec<f32>>,
}

/// A gated full-attention mixer's activations.
#[derive(Debug)]
pub struct FullActs {
    pub q_raw: Vec<f32>,
    pub gate: Vec<f32>,
    pub k_raw: Vec<f32>,
    pub q_rstd: Vec<f32>,
    pub k_rstd: Vec<f32>,
    /// Post-norm, post-RoPE.
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The attention output before the sigmoid gate, and after it.
    pub attn: Vec<f32>,
    pub gated: Vec<f32>,
}
