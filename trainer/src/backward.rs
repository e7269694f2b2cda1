//! The backward through the layers, written once against a device seam
//! ([`BackwardOps`]), as the forward is written once against the engine's
//! `LayerOps`: the order of the steps, which gradient flows where and what
//! accumulates are fixed here; a device supplies the ops over its own
//! buffers. [`CpuBackward`] calls the CPU kernels in the order the backward
//! ran before the seam (the same bits); the CUDA ops come with the
//! trainer's `cuda` feature.
//!
//! Conventions, as in `model.rs`: parameter gradients accumulate (`+=`)
//! into the gradient tree (a `Qwen3_5` with a buffer at every leaf); the
//! residual-stream gradient accumulates within a pass; every other buffer
//! an op returns is new.
//!
//! Not for: the loss (`model.rs`) or the optimizer.

use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{FullAttention, Linear, LinearAttention, Mixer};
use arcticd_engine::model::saved::{FullActs, Kept, LayerActs, LinearActs, MixerActs};
use arcticd_engine::Qwen3_5;

/// What a device does for the backward. `W` is a parameter as the model
/// holds it, `Buf` an activation or gradient buffer, `C` the recurrent
/// state checkpoints the forward kept.
pub trait BackwardOps {
    type W;
    type Buf;
    type C;

    /// Tokens of the packed batch.
    fn tokens(&self) -> usize;

    fn zeros(&mut self, n: usize) -> Result<Self::Buf>;

    /// A linear layer over `n` rows: `dinp += dout @ W`, `dW += dout^T inp`.
    fn linear(
        &mut self,
        l: &Linear<Self::W>,
        g: &mut Linear<Self::Buf>,
        dinp: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        n: usize,
    ) -> Result<()>;

    /// RMSNorm `(1 + w)` over `n` rows of `c`: `dinp +=`, `dw +=`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm(
        &mut self,
        dinp: &mut Self::Buf,
        dw: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
        w: &Self::W,
        rstd: &Self::Buf,
        n: usize,
        c: usize,
    ) -> Result<()>;

    /// `act = silu(gate) * up`: `(dgate, dup)`.
    fn silu_mul(
        &mut self,
        dact: &Self::Buf,
        gate: &Self::Buf,
        up: &Self::Buf,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// The gated RMSNorm over rows of `d`: `(dx, dz)`, `dw +=`.
    #[allow(clippy::too_many_arguments)]
    fn gated_rmsnorm(
        &mut self,
        dw: &mut Self::Buf,
        dout: &Self::Buf,
        x: &Self::Buf,
        z: &Self::Buf,
        w: &Self::W,
        rstd: &Self::Buf,
        d: usize,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// The gated delta rule of every sequence of layer `li` from the state
    /// it started with: `[dq, dk, dv, dg, dbeta]`.
    fn gated_delta(
        &mut self,
        li: usize,
        dout: &Self::Buf,
        acts: &LinearActs<Self::Buf, Self::C>,
    ) -> Result<[Self::Buf; 5]>;

    /// `x *= s`.
    fn scale(&mut self, x: &mut Self::Buf, s: f32) -> Result<()>;

    /// The L2 norm over rows of `d`: `dinp`.
    fn l2norm(
        &mut self,
        dout: &Self::Buf,
        inp: &Self::Buf,
        rnorm: &Self::Buf,
        rows: usize,
        d: usize,
    ) -> Result<Self::Buf>;

    /// Rows of the parts side by side (`parts[i]` rows of `widths[i]`):
    /// the inverse of the forward's column split.
    fn join_columns(&mut self, parts: &[&Self::Buf], widths: &[usize]) -> Result<Self::Buf>;

    /// `y = silu(x)`: `dx`.
    fn silu(&mut self, dout: &Self::Buf, x: &Self::Buf) -> Result<Self::Buf>;

    /// The causal conv of every sequence of layer `li` from the state it
    /// started with: `dinp`, `dw +=`.
    fn conv(
        &mut self,
        li: usize,
        la: &LinearAttention<Self::W>,
        dw: &mut Self::Buf,
        dout: &Self::Buf,
        inp: &Self::Buf,
    ) -> Result<Self::Buf>;

    /// The gating (`g`, `beta` from `a`, `b`): `(da, db)`; the gradients
    /// of `A_log` and `dt_bias` accumulate into `g`.
    fn gating(
        &mut self,
        la: &LinearAttention<Self::W>,
        g: &mut LinearAttention<Self::Buf>,
        dg: &Self::Buf,
        dbeta: &Self::Buf,
        acts: &LinearActs<Self::Buf, Self::C>,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// `gated = attn * sigmoid(gate)`: `(dattn, dgate)`.
    fn sigmoid_gate(
        &mut self,
        dout: &Self::Buf,
        attn: &Self::Buf,
        gate: &Self::Buf,
    ) -> Result<(Self::Buf, Self::Buf)>;

    /// Causal attention of every sequence of layer `li` (over the keys
    /// before it too, where it continues a cache): `(dq, dk, dv)`.
    fn attention(
        &mut self,
        li: usize,
        dout: &Self::Buf,
        acts: &FullActs<Self::Buf>,
    ) -> Result<(Self::Buf, Self::Buf, Self::Buf)>;

    /// The per-head q/k RMSNorm then partial RoPE, over `heads` heads per
    /// token: `draw` from the gradient of the rotated output; `dw +=`.
    fn qk_norm_rope(
        &mut self,
        dout: Self::Buf,
        raw: &Self::Buf,
        w: &Self::W,
        rstd: &Self::Buf,
        heads: usize,
        dw: &mut Self::Buf,
    ) -> Result<Self::Buf>;

    /// The embedding: `dtable +=` at the batch's ids.
    fn embedding(&mut self, dtable: &mut Self::Buf, dx: &Self::Buf) -> Result<()>;

    /// Layer `li`'s activations again from its input (for a forward that
    /// kept only the inputs).
    fn recompute(
        &mut self,
        model: &Qwen3_5<Self::W>,
        li: usize,
        x_in: &Self::Buf,
    ) -> Result<LayerActs<Self::Buf, Self::C>>;
}

/// The forward's record of a packed batch, as the backward reads it.
pub struct Forward<'a, B, C> {
    pub layers: &'a [Kept<B, C>],
    /// The residual stream after the last layer, before the final norm.
    pub x_last: &'a B,
    pub final_rstd: &'a B,
}

/// Backward through the whole model from `dhidden` (the gradient of the
/// final hidden states); parameter gradients accumulate into `grads`.
pub fn model_backward<O: BackwardOps>(
    ops: &mut O,
    model: &Qwen3_5<O::W>,
    fwd: &Forward<'_, O::Buf, O::C>,
    dhidden: &O::Buf,
    grads: &mut Qwen3_5<O::Buf>,
) -> Result<()> {
    let c = &model.config;
    let (h, im, t) = (c.hidden_size, c.intermediate_size, ops.tokens());
    if grads.layers.len() != model.layers.len() || fwd.layers.len() != model.layers.len() {
        return Err(Error::Shape(
            "gradients or activations do not match the model".into(),
        ));
    }
    let mut dx = ops.zeros(t * h)?;
    ops.rmsnorm(
        &mut dx,
        &mut grads.norm,
        dhidden,
        fwd.x_last,
        &model.norm,
        fwd.final_rstd,
        t,
        h,
    )?;
    for (li, ((layer, kept), lg)) in model
        .layers
        .iter()
        .zip(fwd.layers)
        .zip(grads.layers.iter_mut())
        .enumerate()
        .rev()
    {
        let recomputed;
        let la: &LayerActs<O::Buf, O::C> = match kept {
            Kept::All(a) => a,
            Kept::Input(x_in) => {
                recomputed = ops.recompute(model, li, x_in)?;
                &recomputed
            }
        };
        // x_out = x_mid + down(silu(gate(xn2)) * up(xn2)); dx flows through.
        let mut dact = ops.zeros(t * im)?;
        ops.linear(
            &layer.down_proj,
            &mut lg.down_proj,
            &mut dact,
            &dx,
            &la.act,
            t,
        )?;
        let (dgate, dup) = ops.silu_mul(&dact, &la.gate, &la.up)?;
        let mut dxn2 = ops.zeros(t * h)?;
        ops.linear(
            &layer.gate_proj,
            &mut lg.gate_proj,
            &mut dxn2,
            &dgate,
            &la.xn2,
            t,
        )?;
        ops.linear(&layer.up_proj, &mut lg.up_proj, &mut dxn2, &dup, &la.xn2, t)?;
        ops.rmsnorm(
            &mut dx,
            &mut lg.post_attention_layernorm,
            &dxn2,
            &la.x_mid,
            &layer.post_attention_layernorm,
            &la.rstd2,
            t,
            h,
        )?;
        // x_mid = x_in + mixer(xn1).
        let dxn1 = match (&layer.mixer, &la.mixer, &mut lg.mixer) {
            (Mixer::Linear(m), MixerActs::Linear(a), Mixer::Linear(g)) => {
                linear_attention(ops, model, li, m, a, g, &la.xn1, &dx)?
            }
            (Mixer::Full(m), MixerActs::Full(a), Mixer::Full(g)) => {
                full_attention(ops, model, li, m, a, g, &la.xn1, &dx)?
            }
            _ => {
                return Err(Error::Shape(
                    "layer kinds of gradients and model differ".into(),
                ))
            }
        };
        ops.rmsnorm(
            &mut dx,
            &mut lg.input_layernorm,
            &dxn1,
            &la.x_in,
            &layer.input_layernorm,
            &la.rstd1,
            t,
            h,
        )?;
    }
    ops.embedding(&mut grads.embed_tokens, &dx)
}

/// A Gated DeltaNet mixer: the gradient of its input `xn` from that of
/// its output `dy`.
#[allow(clippy::too_many_arguments)]
fn linear_attention<O: BackwardOps>(
    ops: &mut O,
    model: &Qwen3_5<O::W>,
    li: usize,
    la: &LinearAttention<O::W>,
    s: &LinearActs<O::Buf, O::C>,
    g: &mut LinearAttention<O::Buf>,
    xn: &O::Buf,
    dy: &O::Buf,
) -> Result<O::Buf> {
    let c = &model.config;
    let (t, hsz) = (ops.tokens(), c.hidden_size);
    let (nk, nv, dk, dv) = c.delta_heads();
    let (qd, vd) = (nk * dk, nv * dv);
    let mut dnormed = ops.zeros(t * vd)?;
    ops.linear(
        &la.out_proj,
        &mut g.out_proj,
        &mut dnormed,
        dy,
        &s.normed,
        t,
    )?;
    let (dcore, dz) =
        ops.gated_rmsnorm(&mut g.norm, &dnormed, &s.core, &s.z, &la.norm, &s.rstd, dv)?;
    let [mut dq, dk_, dv_, dg, dbeta] = ops.gated_delta(li, &dcore, s)?;
    ops.scale(&mut dq, 1.0 / (dk as f32).sqrt())?;
    let dq_raw = ops.l2norm(&dq, &s.q_raw, &s.rn_q, t * nk, dk)?;
    let dk_raw = ops.l2norm(&dk_, &s.k_raw, &s.rn_k, t * nk, dk)?;
    let dconv = ops.join_columns(&[&dq_raw, &dk_raw, &dv_], &[qd, qd, vd])?;
    let dconv_pre = ops.silu(&dconv, &s.conv_pre)?;
    let dqkv = ops.conv(li, la, &mut g.conv1d, &dconv_pre, &s.qkv)?;
    // beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias).
    let (da, db) = ops.gating(la, g, &dg, &dbeta, s)?;
    let mut dxn = ops.zeros(t * hsz)?;
    ops.linear(&la.in_proj_qkv, &mut g.in_proj_qkv, &mut dxn, &dqkv, xn, t)?;
    ops.linear(&la.in_proj_z, &mut g.in_proj_z, &mut dxn, &dz, xn, t)?;
    ops.linear(&la.in_proj_b, &mut g.in_proj_b, &mut dxn, &db, xn, t)?;
    ops.linear(&la.in_proj_a, &mut g.in_proj_a, &mut dxn, &da, xn, t)?;
    Ok(dxn)
}

/// A gated full-attention mixer: the gradient of its input `xn` from that
/// of its output `dy`.
#[allow(clippy::too_many_arguments)]
fn full_attention<O: BackwardOps>(
    ops: &mut O,
    model: &Qwen3_5<O::W>,
    li: usize,
    fa: &FullAttention<O::W>,
    s: &FullActs<O::Buf>,
    g: &mut FullAttention<O::Buf>,
    xn: &O::Buf,
    dy: &O::Buf,
) -> Result<O::Buf> {
    let c = &model.config;
    let (t, hsz) = (ops.tokens(), c.hidden_size);
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let mut dgated = ops.zeros(t * nh * hd)?;
    ops.linear(&fa.o_proj, &mut g.o_proj, &mut dgated, dy, &s.gated, t)?;
    let (dattn, dgate) = ops.sigmoid_gate(&dgated, &s.attn, &s.gate)?;
    let (dq, dk, dv) = ops.attention(li, &dattn, s)?;
    let dq_raw = ops.qk_norm_rope(dq, &s.q_raw, &fa.q_norm, &s.q_rstd, nh, &mut g.q_norm)?;
    let dk_raw = ops.qk_norm_rope(dk, &s.k_raw, &fa.k_norm, &s.k_rstd, nkv, &mut g.k_norm)?;
    // q_proj rows are interleaved per head: [query head 0 | gate head 0 | ...].
    let dqg = ops.join_columns(&[&dq_raw, &dgate], &[hd, hd])?;
    let mut dxn = ops.zeros(t * hsz)?;
    ops.linear(&fa.q_proj, &mut g.q_proj, &mut dxn, &dqg, xn, t)?;
    ops.linear(&fa.k_proj, &mut g.k_proj, &mut dxn, &dk_raw, xn, t)?;
    ops.linear(&fa.v_proj, &mut g.v_proj, &mut dxn, &dv, xn, t)?;
    Ok(dxn)
}

/// The rows of parts to be joined side by side ([`BackwardOps::join_columns`]),
/// from each part's length and width; an error when they disagree.
pub(crate) fn joined_rows(lens: &[usize], widths: &[usize]) -> Result<usize> {
    let rows = match (lens.first(), widths.first()) {
        (Some(&n), Some(&w)) if w > 0 => n / w,
        _ => 0,
    };
    if lens.len() != widths.len() || lens.iter().zip(widths).any(|(&n, &w)| n != rows * w) {
        return Err(Error::Shape(format!(
            "columns of widths {widths:?} do not have {rows} rows each"
        )));
    }
    Ok(rows)
}
