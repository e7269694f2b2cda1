//! What a forward keeps for a backward. The trainer's forward is the
//! engine's forward ([`Qwen3_5::forward_keeping`](super::Qwen3_5::forward_keeping))
//! with these switched on: every buffer here is one the forward computes
//! anyway, moved out instead of dropped, plus the few it would otherwise
//! overwrite in place (the conv output before SiLU, the attention output
//! before its gate) and the recurrent state every `CHECKPOINT_EVERY` tokens.
//!
//! Not for: gradients or the backward itself (the trainer's).

use crate::config::{LayerType, ModelConfig};
use arcticd_kernels::cpu::gated_delta::CHECKPOINT_EVERY;

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

/// A layer's activations, or only its input when they are recomputed (in
/// a device's buffers `B`, with its recurrent-state checkpoints `C`).
#[derive(Debug)]
pub enum Kept<B = Vec<f32>, C = Vec<Vec<f32>>> {
    All(Box<LayerActs<B, C>>),
    Input(B),
}

/// One decoder layer's activations, in a device's buffers `B` (host
/// vectors on the CPU) with its recurrent-state checkpoints `C`.
#[derive(Debug)]
pub struct LayerActs<B = Vec<f32>, C = Vec<Vec<f32>>> {
    pub x_in: B,
    pub rstd1: B,
    pub xn1: B,
    pub mixer: MixerActs<B, C>,
    /// The residual stream after the mixer, before the MLP.
    pub x_mid: B,
    pub rstd2: B,
    pub xn2: B,
    pub gate: B,
    pub up: B,
    pub act: B,
}

#[derive(Debug)]
pub enum MixerActs<B = Vec<f32>, C = Vec<Vec<f32>>> {
    Linear(Box<LinearActs<B, C>>),
    Full(Box<FullActs<B>>),
}

/// A Gated DeltaNet mixer's activations.
#[derive(Debug)]
pub struct LinearActs<B = Vec<f32>, C = Vec<Vec<f32>>> {
    pub qkv: B,
    /// The causal conv's output before SiLU.
    pub conv_pre: B,
    pub q_raw: B,
    pub k_raw: B,
    /// The L2 norms' reciprocal norms.
    pub rn_q: B,
    pub rn_k: B,
    /// Normalised (and, for q, scaled).
    pub q: B,
    pub k: B,
    pub v: B,
    pub z: B,
    pub a: B,
    pub beta: B,
    pub g: B,
    pub core: B,
    pub rstd: B,
    pub normed: B,
    /// Per sequence, the recurrent state every `CHECKPOINT_EVERY` tokens.
    pub checkpoints: C,
}

/// A gated full-attention mixer's activations.
#[derive(Debug)]
pub struct FullActs<B = Vec<f32>> {
    pub q_raw: B,
    pub gate: B,
    pub k_raw: B,
    pub q_rstd: B,
    pub k_rstd: B,
    /// Post-norm, post-RoPE.
    pub q: B,
    pub k: B,
    pub v: B,
    /// The attention output before the sigmoid gate, and after it.
    pub attn: B,
    pub gated: B,
}

impl Trace {
    /// The f32 values kept, every buffer counted: what
    /// [`planned_floats`] predicts.
    pub fn floats(&self) -> usize {
        let layers: usize = self.layers.iter().map(Kept::floats).sum();
        layers + self.x_last.len() + self.final_rstd.len() + self.hidden.len()
    }
}

impl Kept {
    pub fn floats(&self) -> usize {
        match self {
            Kept::All(a) => a.floats(),
            Kept::Input(x) => x.len(),
        }
    }
}

impl LayerActs {
    pub fn floats(&self) -> usize {
        let mixer = match &self.mixer {
            MixerActs::Linear(a) => {
                [
                    &a.qkv,
                    &a.conv_pre,
                    &a.q_raw,
                    &a.k_raw,
                    &a.rn_q,
                    &a.rn_k,
                    &a.q,
                    &a.k,
                    &a.v,
                    &a.z,
                    &a.a,
                    &a.beta,
                    &a.g,
                    &a.core,
                    &a.rstd,
                    &a.normed,
                ]
                .iter()
                .map(|b| b.len())
                .sum::<usize>()
                    + a.checkpoints.iter().map(Vec::len).sum::<usize>()
            }
            MixerActs::Full(a) => [
                &a.q_raw, &a.gate, &a.k_raw, &a.q_rstd, &a.k_rstd, &a.q, &a.k, &a.v, &a.attn,
                &a.gated,
            ]
            .iter()
            .map(|b| b.len())
            .sum(),
        };
        [
            &self.x_in,
            &self.rstd1,
            &self.xn1,
            &self.x_mid,
            &self.rstd2,
            &self.xn2,
            &self.gate,
            &self.up,
            &self.act,
        ]
        .iter()
        .map(|b| b.len())
        .sum::<usize>()
            + mixer
    }
}

/// The f32 values a training forward over sequences of `lens` tokens keeps
/// ([`Trace::floats`]), from the config alone: what a memory plan counts
/// before anything is allocated. `layer` limits it to one layer's
/// activations (what a backward over [`Keep::Inputs`] recomputes at a
/// time).
pub fn planned_floats(config: &ModelConfig, lens: &[usize], keep: Keep) -> usize {
    let t: usize = lens.iter().sum();
    let h = config.hidden_size;
    let layers: usize = (0..config.layer_types.len())
        .map(|li| match keep {
            Keep::All => planned_layer_floats(config, li, lens),
            Keep::Inputs => t * h,
        })
        .sum();
    layers + t * (2 * h + 1)
}

/// The f32 values one layer's [`LayerActs`] hold for sequences of `lens`.
pub fn planned_layer_floats(config: &ModelConfig, li: usize, lens: &[usize]) -> usize {
    let c = config;
    let t: usize = lens.iter().sum();
    let (h, i) = (c.hidden_size, c.intermediate_size);
    // x_in, xn1, x_mid, xn2; rstd1, rstd2; gate, up, act.
    let common = 4 * h + 2 + 3 * i;
    let per_token = match c.layer_types.get(li) {
        Some(LayerType::LinearAttention) => {
            let (nk, nv) = (c.linear_num_key_heads, c.linear_num_value_heads);
            let (qd, vd) = (nk * c.linear_key_head_dim, nv * c.linear_value_head_dim);
            // qkv, conv_pre; q_raw, k_raw, q, k; rn_q, rn_k; v, z, core,
            // normed; a, beta, g, rstd.
            2 * c.linear_conv_dim() + 4 * qd + 2 * nk + 4 * vd + 4 * nv
        }
        Some(LayerType::FullAttention) => {
            let (q, kv) = (c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim);
            // q_raw, gate, q, attn, gated; k_raw, k, v; q_rstd, k_rstd.
            5 * q + 3 * kv + c.num_heads + c.num_kv_heads
        }
        None => return 0,
    };
    let states = match c.layer_types.get(li) {
        Some(LayerType::LinearAttention) => {
            let state = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim;
            lens.iter()
                .map(|&n| n.div_ceil(CHECKPOINT_EVERY).max(1))
                .sum::<usize>()
                * state
        }
        _ => 0,
    };
    t * (common + per_token) + states
}
