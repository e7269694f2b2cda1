//! The device seam of the layer code: what a decoder layer asks of the
//! device it runs on. The layer itself ([`Qwen3_5`](super::Qwen3_5)'s
//! `layer_forward`, `delta_net` and `attention`) is written once against
//! this trait; a device implements it over its own buffers and weights:
//! the CPU ([`super::cpu::CpuOps`]) with the `arcticd_kernels::cpu`
//! kernels on host vectors, in the order that makes prefill, decode,
//! scoring and training the same bits; CUDA (`super::cuda`, behind the
//! `cuda` feature) with the NVRTC kernels and cuBLAS on device buffers.
//!
//! Everything that is per sequence (conv and recurrent state, the keys
//! and values of the past, where they lie) is the implementation's: the
//! layer code sees a packed batch of `t` new tokens and a layer index.
//!
//! Not for: the model's parameter tree or its loading (`qwen3_5`), nor
//! the backward (the trainer's).

use super::qwen3_5::{Linear, LinearAttention};
use crate::Result;

/// One device's side of a decoder layer. Buffers are row-major f32 values
/// `[rows, width]`; every op writes new buffers unless it says in place.
pub trait LayerOps {
    /// A parameter as this device holds it.
    type W;
    /// A buffer of f32 activations.
    type Buf;
    /// The recurrent states a training forward keeps for the backward.
    type Checkpoints;

    /// A copy of `x` (what a training forward keeps of a buffer that the
    /// layer then changes in place).
    fn duplicate(&mut self, x: &Self::Buf) -> Result<Self::Buf>;

    /// The token embeddings `[t, hidden]` of the batch.
    fn embed(&mut self, table: &Self::W) -> Result<Self::Buf>;

    /// RMSNorm `(1 + weight)` over rows of `c`: the output and each row's
    /// reciprocal RMS.
    fn rmsnorm(
        &mut self,
        x: &Self::Buf,
        weight: &Self::W,
        c: usize,
        eps: f32,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// `x += y`, in place.
    fn add_assign(&mut self, x: &mut Self::Buf, y: &Self::Buf) -> Result<()>;

    /// `[l(x) for l in group]` over `t` rows.
    fn project(
        &mut self,
        group: &[&Linear<Self::W>],
        x: &Self::Buf,
        t: usize,
    ) -> Result<Vec<Self::Buf>>;

    /// `silu(gate) * up` over `t` rows of `width`.
    fn silu_mul(
        &mut self,
        gate: &Self::Buf,
        up: &Self::Buf,
        t: usize,
        width: usize,
    ) -> Result<Self::Buf>;

    /// `silu(x)`, in place.
    fn silu(&mut self, x: &mut Self::Buf) -> Result<()>;

    /// `x * sigmoid(gate)`, in place.
    fn sigmoid_gate(&mut self, x: &mut Self::Buf, gate: &Self::Buf) -> Result<()>;

    /// Rows of `x` cut into column ranges of the given widths, which add up
    /// to the row's width: one buffer `[rows, width]` per range.
    fn split_columns(&mut self, x: &Self::Buf, widths: &[usize]) -> Result<Vec<Self::Buf>>;

    /// Rows of `d` scaled to unit L2 norm, then by `scale`: the output and
    /// each row's reciprocal norm.
    fn l2norm(
        &mut self,
        x: &Self::Buf,
        rows: usize,
        d: usize,
        scale: f32,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// The gated RMSNorm `rmsnorm(x) * weight * silu(z)` over rows of `d`:
    /// the output and each row's reciprocal RMS.
    fn gated_rmsnorm(
        &mut self,
        x: &Self::Buf,
        z: &Self::Buf,
        weight: &Self::W,
        d: usize,
        eps: f32,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// The causal depthwise conv of linear layer `li` over `qkv [t,
    /// conv_dim]`, before its SiLU, each sequence continuing from its own
    /// conv state (which advances).
    fn causal_conv(
        &mut self,
        la: &LinearAttention<Self::W>,
        li: usize,
        qkv: &Self::Buf,
    ) -> Result<Self::Buf>;

    /// The decay `g = -exp(A_log) * softplus(a + dt_bias)` and the write
    /// strength `beta = sigmoid(b)`, per token and value head.
    fn gating(
        &mut self,
        la: &LinearAttention<Self::W>,
        a: &Self::Buf,
        b: &Self::Buf,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// The gated-delta recurrence of linear layer `li` (fp32 state), each
    /// sequence from its own state (which advances): the output `[t, nv *
    /// dv]` and, with `keep`, the states a backward restarts from.
    #[allow(clippy::too_many_arguments)]
    fn recurrence(
        &mut self,
        li: usize,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
        g: &Self::Buf,
        beta: &Self::Buf,
        keep: bool,
    ) -> Result<(Self::Buf, Option<Self::Checkpoints>)>;

    /// Per-head RMSNorm `(1 + weight)` of `x [t, heads, head_dim]`, then
    /// partial rotate-half RoPE at each token's position: the output and
    /// each head's reciprocal RMS.
    fn qk_norm_rope(
        &mut self,
        x: &Self::Buf,
        weight: &Self::W,
        heads: usize,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// Causal attention of full-attention layer `li`: each sequence's new
    /// queries over its past keys and values and its new ones (which join
    /// its past). `[t, heads * head_dim]`.
    fn attention(
        &mut self,
        li: usize,
        q: &Self::Buf,
        k: &Self::Buf,
        v: &Self::Buf,
    ) -> Result<Self::Buf>;
}

/// `N` buffers from a `Vec` the op promised to fill with `N`.
pub(crate) fn take<B, const N: usize>(op: &str, bufs: Vec<B>) -> Result<[B; N]> {
    let got = bufs.len();
    bufs.try_into()
        .map_err(|_| crate::Error::Invariant(format!("{op} returned {got} buffers, expected {N}")))
}
