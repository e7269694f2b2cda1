//! Training forward and backward of Qwen3.5.
//!
//! The forward is the engine's (`Qwen3_5::forward_keeping`,
//! engine/src/model/qwen3_5.rs): the same layer code that prefills, decodes
//! and scores, with the activations the backward needs kept
//! (`arcticd_engine::model::saved`), so a token's log-probability here is
//! the engine's, bit for bit. The backward walks the layers in reverse with
//! the `*_backward` kernels.
//!
//! Batches are packed without padding: every sequence starts at position 0
//! with fresh conv/recurrent state, attention runs per sequence, and the conv
//! and gated-delta backwards run per sequence too, so nothing leaks across a
//! sequence boundary in either direction.
//!
//! Gradients: parameter gradients accumulate (`+=`) into [`ModelGrads`] (so
//! micro-batches add up); the residual-stream gradient accumulates within a
//! pass; every other buffer is written. Activations are held for the whole
//! pass, or only each layer's input with `ForwardOptions::recompute_layers`;
//! the gated-delta backward recomputes its states from per-chunk checkpoints.

use crate::grads::{FullAttnGrad, LinearAttnGrad, ModelGrads};
use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{FullAttention, Linear, LinearAttention, Mixer};
use arcticd_engine::model::saved::{FullActs, Keep, Kept, LayerActs, LinearActs, MixerActs};
use arcticd_engine::model::{check_ids, logit_rows_per_chunk};
use arcticd_engine::Qwen3_5;
use arcticd_kernels::cpu::{
    activation::{
        gated_delta_gating_backward, sigmoid_gate_backward, silu_backward, silu_mul_backward,
    },
    attention::{attention_backward, AttnDims},
    conv1d::conv1d_backward,
    embedding::embedding_backward,
    gated_delta::{gated_delta_backward_from_checkpoints, GatedDeltaDims},
    l2norm::l2norm_backward,
    logsoftmax::{
        entropy_backward, entropy_forward, logprob_gather_backward, logprob_gather_forward,
    },
    matmul::{matmul_backward, matmul_forward},
    rmsnorm::{gated_rmsnorm_backward, rmsnorm_backward},
    rope::rope_backward,
};

/// A packed batch: token ids of every sequence back to back.
#[derive(Debug, Clone)]
pub struct Packed {
    pub ids: Vec<u32>,
    /// `(start, len)` of each sequence in `ids`.
    pub spans: Vec<(usize, usize)>,
    /// Position of every token within its sequence.
    pub positions: Vec<u32>,
}

impl Packed {
    /// Pack `sequences` (each non-empty, ids below `vocab`).
    pub fn new(sequences: &[Vec<u32>], vocab: usize) -> Result<Self> {
        check_ids(sequences, vocab).map_err(|e| match e {
            arcticd_engine::Error::Input(m) => Error::Input(m),
            e => Error::Engine(e),
        })?;
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(sequences.len());
        let mut positions = Vec::new();
        for seq in sequences {
            spans.push((ids.len(), seq.len()));
            ids.extend_from_slice(seq);
            positions.extend((0..seq.len()).map(|p| p as u32));
        }
        Ok(Packed {
            ids,
            spans,
            positions,
        })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Each sequence's ids.
    pub fn sequences(&self) -> Vec<&[u32]> {
        self.spans
            .iter()
            .map(|&(start, n)| &self.ids[start..start + n])
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Everything the backward needs from one forward.
#[derive(Debug)]
pub struct Activations {
    pub packed: Packed,
    layers: Vec<Kept>,
    x_last: Vec<f32>,
    final_rstd: Vec<f32>,
    /// Final hidden states after the final norm, `[tokens, hidden]`.
    pub hidden: Vec<f32>,
}

/// `dinp += dout @ W`, `dW += dout^T inp` (and the bias).
fn linear_bwd(
    l: &Linear,
    g: &mut crate::grads::LinearGrad,
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    n: usize,
) -> Result<()> {
    matmul_backward(
        dinp,
        &mut g.weight,
        g.bias.as_deref_mut(),
        dout,
        inp,
        l.weight.as_f32()?,
        n,
        l.in_features,
        l.out_features,
    )?;
    Ok(())
}

/// How much of the forward the backward keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardOptions {
    /// Keep only each layer's input and recompute the layer's activations
    /// in the backward (per-layer activation checkpointing): one extra layer
    /// forward per layer, activation memory of one layer instead of all.
    /// The gradients are identical (the forward is deterministic).
    pub recompute_layers: bool,
}

/// The training forward over a packed batch, keeping every activation.
pub fn forward(model: &Qwen3_5, packed: Packed) -> Result<Activations> {
    forward_with(model, packed, ForwardOptions::default())
}

/// The training forward with [`ForwardOptions`]: the engine's forward
/// (`Qwen3_5::forward_keeping`), the same layer code the engine serves with.
pub fn forward_with(model: &Qwen3_5, packed: Packed, opts: ForwardOptions) -> Result<Activations> {
    let keep = if opts.recompute_layers {
        Keep::Inputs
    } else {
        Keep::All
    };
    let trace = model.forward_keeping(&packed.sequences(), keep)?;
    Ok(Activations {
        packed,
        layers: trace.layers,
        x_last: trace.x_last,
        final_rstd: trace.final_rstd,
        hidden: trace.hidden,
    })
}

/// `lp[i] = log p(targets[i] | hidden row rows[i])`.
pub fn token_logprobs(
    model: &Qwen3_5,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
) -> Result<Vec<f32>> {
    Ok(token_logprobs_entropy(model, hidden, rows, targets, false, 1.0)?.0)
}

/// [`token_logprobs`] of the distribution at `temperature` (`logits / T`,
/// the engine sampler's exact arithmetic: `x * (1 / T)` in f32, skipped at
/// `T = 1` and for greedy `T = 0`, which the sampler reports at `T = 1`),
/// and with `entropy` also that distribution's entropy at each row (same
/// logits, computed once).
pub fn token_logprobs_entropy(
    model: &Qwen3_5,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    entropy: bool,
    temperature: f32,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let inv_t = inverse_temperature(temperature)?;
    let (h, vsz) = (model.config.hidden_size, model.config.vocab_size);
    check_rows(hidden.len() / h.max(1), rows, targets)?;
    let w = model.lm_head_weight().as_f32()?;
    let per = logit_rows_per_chunk(vsz);
    let mut lps = Vec::with_capacity(rows.len());
    let mut ents = Vec::with_capacity(if entropy { rows.len() } else { 0 });
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let hsel = gather_rows(hidden, rc, h);
        let mut logits = vec![0.0f32; rc.len() * vsz];
        matmul_forward(&mut logits, &hsel, w, None, rc.len(), h, vsz)?;
        scale_logits(&mut logits, inv_t);
        let mut lp = vec![0.0f32; rc.len()];
        logprob_gather_forward(&mut lp, &logits, tc, rc.len(), vsz)?;
        lps.extend(lp);
        if entropy {
            let mut e = vec![0.0f32; rc.len()];
            entropy_forward(&mut e, &logits, rc.len(), vsz)?;
            ents.extend(e);
        }
    }
    Ok((lps, entropy.then_some(ents)))
}

/// `1 / T` as the sampler computes it; `None` where the sampler does not
/// scale (`T = 1`, or greedy).
fn inverse_temperature(temperature: f32) -> Result<Option<f32>> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(Error::Input(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        )));
    }
    Ok((temperature > 1e-6 && temperature != 1.0).then(|| 1.0 / temperature))
}

fn scale_logits(logits: &mut [f32], inv_t: Option<f32>) {
    if let Some(s) = inv_t {
        logits.iter_mut().for_each(|x| *x *= s);
    }
}

fn check_rows(n: usize, rows: &[usize], targets: &[u32]) -> Result<()> {
    if rows.len() != targets.len() {
        return Err(Error::Input(format!(
            "{} rows but {} targets",
            rows.len(),
            targets.len()
        )));
    }
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(Error::Input(format!("row {r} is past the {n} tokens")));
    }
    Ok(())
}

fn gather_rows(x: &[f32], rows: &[usize], h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * h);
    for &r in rows {
        out.extend_from_slice(&x[r * h..(r + 1) * h]);
    }
    out
}

/// Backward of [`token_logprobs`] for upstream gradients `dlp`: accumulates
/// the output projection's gradient (into `embed_tokens` when tied) and
/// returns `dhidden [tokens, hidden]`. Logits are recomputed chunk by chunk.
pub fn token_logprobs_backward(
    model: &Qwen3_5,
    grads: &mut ModelGrads,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    dlp: &[f32],
) -> Result<Vec<f32>> {
    token_logprobs_entropy_backward(model, grads, hidden, rows, targets, dlp, None, 1.0)
}

/// Backward of [`token_logprobs_entropy`]: `dlp` per row and, when given,
/// `dent` (gradient of each row's entropy), at the same `temperature`.
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs_entropy_backward(
    model: &Qwen3_5,
    grads: &mut ModelGrads,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    dlp: &[f32],
    dent: Option<&[f32]>,
    temperature: f32,
) -> Result<Vec<f32>> {
    let inv_t = inverse_temperature(temperature)?;
    let (h, vsz) = (model.config.hidden_size, model.config.vocab_size);
    let n = hidden.len() / h.max(1);
    check_rows(n, rows, targets)?;
    if dlp.len() != rows.len() || dent.is_some_and(|d| d.len() != rows.len()) {
        return Err(Error::Input(format!(
            "{} log-prob gradients for {} rows",
            dlp.len(),
            rows.len()
        )));
    }
    let w = model.lm_head_weight().as_f32()?;
    let dw = match grads.lm_head.as_mut() {
        Some(g) => g,
        None => &mut grads.embed_tokens,
    };
    let per = logit_rows_per_chunk(vsz);
    let mut dhidden = vec![0.0f32; n * h];
    let mut start = 0;
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let m = rc.len();
        let hsel = gather_rows(hidden, rc, h);
        let mut logits = vec![0.0f32; m * vsz];
        matmul_forward(&mut logits, &hsel, w, None, m, h, vsz)?;
        scale_logits(&mut logits, inv_t);
        let mut dlogits = vec![0.0f32; m * vsz];
        logprob_gather_backward(&mut dlogits, &dlp[start..start + m], &logits, tc, m, vsz)?;
        if let Some(de) = dent {
            entropy_backward(&mut dlogits, &de[start..start + m], &logits, m, vsz)?;
        }
        // d(x / T) / dx = 1 / T.
        scale_logits(&mut dlogits, inv_t);
        let mut dsel = vec![0.0f32; m * h];
        matmul_backward(&mut dsel, dw, None, &dlogits, &hsel, w, m, h, vsz)?;
        for (i, &r) in rc.iter().enumerate() {
            for (d, s) in dhidden[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&dsel[i * h..(i + 1) * h])
            {
                *d += s;
            }
        }
        start += m;
    }
    Ok(dhidden)
}

/// Backward through the whole model from `dhidden` (the gradient of the
/// final hidden states); parameter gradients accumulate into `grads`.
pub fn backward(
    model: &Qwen3_5,
    acts: &Activations,
    dhidden: &[f32],
    grads: &mut ModelGrads,
) -> Result<()> {
    let c = &model.config;
    let h = c.hidden_size;
    let t = acts.packed.len();
    if dhidden.len() != t * h {
        return Err(Error::Shape(format!(
            "dhidden has {} values for {t} tokens x {h}",
            dhidden.len()
        )));
    }
    if grads.layers.len() != model.layers.len() {
        return Err(Error::Shape("gradients do not match the model".into()));
    }
    let mut dx = vec![0.0f32; t * h];
    rmsnorm_backward(
        &mut dx,
        &mut grads.norm,
        dhidden,
        &acts.x_last,
        model.norm.as_f32()?,
        &acts.final_rstd,
        t,
        h,
    )?;
    let im = c.intermediate_size;
    let sequences = acts.packed.sequences();
    for (li, ((layer, kept), lg)) in model
        .layers
        .iter()
        .zip(&acts.layers)
        .zip(grads.layers.iter_mut())
        .enumerate()
        .rev()
    {
        let recomputed;
        let la: &LayerActs = match kept {
            Kept::All(a) => a,
            Kept::Input(x_in) => {
                recomputed = model.recompute_layer(li, x_in, &sequences)?;
                &recomputed
            }
        };
        // x_out = x_mid + down(silu(gate(xn2)) * up(xn2)); dx flows through.
        let mut dact = vec![0.0f32; t * im];
        linear_bwd(
            &layer.down_proj,
            &mut lg.down_proj,
            &mut dact,
            &dx,
            &la.act,
            t,
        )?;
        let (mut dgate, mut dup) = (vec![0.0f32; t * im], vec![0.0f32; t * im]);
        silu_mul_backward(&mut dgate, &mut dup, &dact, &la.gate, &la.up)?;
        let mut dxn2 = vec![0.0f32; t * h];
        linear_bwd(
            &layer.gate_proj,
            &mut lg.gate_proj,
            &mut dxn2,
            &dgate,
            &la.xn2,
            t,
        )?;
        linear_bwd(&layer.up_proj, &mut lg.up_proj, &mut dxn2, &dup, &la.xn2, t)?;
        rmsnorm_backward(
            &mut dx,
            &mut lg.post_attention_layernorm,
            &dxn2,
            &la.x_mid,
            layer.post_attention_layernorm.as_f32()?,
            &la.rstd2,
            t,
            h,
        )?;
        // x_mid = x_in + mixer(xn1).
        let dxn1 = match (&layer.mixer, &la.mixer, &mut lg.mixer) {
            (Mixer::Linear(m), MixerActs::Linear(a), Mixer::Linear(g)) => {
                linear_attention_bwd(model, m, a, g, &la.xn1, &dx, &acts.packed)?
            }
            (Mixer::Full(m), MixerActs::Full(a), Mixer::Full(g)) => {
                full_attention_bwd(model, m, a, g, &la.xn1, &dx, &acts.packed)?
            }
            _ => {
                return Err(Error::Shape(
                    "layer kinds of gradients and model differ".into(),
                ))
            }
        };
        rmsnorm_backward(
            &mut dx,
            &mut lg.input_layernorm,
            &dxn1,
            &la.x_in,
            layer.input_layernorm.as_f32()?,
            &la.rstd1,
            t,
            h,
        )?;
    }
    embedding_backward(
        &mut grads.embed_tokens,
        &dx,
        &acts.packed.ids,
        c.vocab_size,
        h,
    )?;
    Ok(())
}

/// Returns the gradient of the mixer's input `xn`.
fn linear_attention_bwd(
    model: &Qwen3_5,
    la: &LinearAttention,
    s: &LinearActs,
    g: &mut LinearAttnGrad,
    xn: &[f32],
    dy: &[f32],
    packed: &Packed,
) -> Result<Vec<f32>> {
    let c = &model.config;
    let t = packed.len();
    let hsz = c.hidden_size;
    let (nk, nv, dk, dv) = c.delta_heads();
    let conv_dim = c.linear_conv_dim();
    let kc = c.conv_kernel;
    let (qd, vd) = (nk * dk, nv * dv);

    let mut dnormed = vec![0.0f32; t * vd];
    linear_bwd(
        &la.out_proj,
        &mut g.out_proj,
        &mut dnormed,
        dy,
        &s.normed,
        t,
    )?;
    let (mut dcore, mut dz) = (vec![0.0f32; t * vd], vec![0.0f32; t * vd]);
    gated_rmsnorm_backward(
        &mut dcore,
        &mut dz,
        &mut g.norm,
        &dnormed,
        &s.core,
        &s.z,
        la.norm.as_f32()?,
        &s.rstd,
        t * nv,
        dv,
    )?;

    let mut dq = vec![0.0f32; t * qd];
    let mut dk_ = vec![0.0f32; t * qd];
    let mut dv_ = vec![0.0f32; t * vd];
    let mut dg = vec![0.0f32; t * nv];
    let mut dbeta = vec![0.0f32; t * nv];
    for (&(st, n), cps) in packed.spans.iter().zip(&s.checkpoints) {
        let dims = GatedDeltaDims {
            t: n,
            nk,
            nv,
            dk,
            dv,
        };
        let (kq, kv, kh) = (
            st * qd..(st + n) * qd,
            st * vd..(st + n) * vd,
            st * nv..(st + n) * nv,
        );
        gated_delta_backward_from_checkpoints(
            &mut dq[kq.clone()],
            &mut dk_[kq.clone()],
            &mut dv_[kv.clone()],
            &mut dg[kh.clone()],
            &mut dbeta[kh.clone()],
            None,
            &dcore[kv.clone()],
            cps,
            &s.q[kq.clone()],
            &s.k[kq],
            &s.v[kv],
            &s.g[kh.clone()],
            &s.beta[kh],
            dims,
        )?;
    }
    let scale = 1.0 / (dk as f32).sqrt();
    for x in dq.iter_mut() {
        *x *= scale;
    }
    let (mut dq_raw, mut dk_raw) = (vec![0.0f32; t * qd], vec![0.0f32; t * qd]);
    l2norm_backward(&mut dq_raw, &dq, &s.q_raw, &s.rn_q, t * nk, dk)?;
    l2norm_backward(&mut dk_raw, &dk_, &s.k_raw, &s.rn_k, t * nk, dk)?;
    let mut dconv = Vec::with_capacity(t * conv_dim);
    for ti in 0..t {
        dconv.extend_from_slice(&dq_raw[ti * qd..(ti + 1) * qd]);
        dconv.extend_from_slice(&dk_raw[ti * qd..(ti + 1) * qd]);
        dconv.extend_from_slice(&dv_[ti * vd..(ti + 1) * vd]);
    }
    let mut dconv_pre = vec![0.0f32; t * conv_dim];
    silu_backward(&mut dconv_pre, &dconv, &s.conv_pre)?;
    let mut dqkv = vec![0.0f32; t * conv_dim];
    let zero_state = vec![0.0f32; (kc - 1) * conv_dim];
    for &(st, n) in &packed.spans {
        let r = st * conv_dim..(st + n) * conv_dim;
        conv1d_backward(
            &mut dqkv[r.clone()],
            &mut g.conv1d,
            None,
            &dconv_pre[r.clone()],
            &zero_state,
            &s.qkv[r],
            la.conv1d.as_f32()?,
            n,
            conv_dim,
            kc,
        )?;
    }
    // beta = sigmoid(b); g = -exp(A_log) softplus(a + dt_bias).
    let a_log = la.a_log.as_f32()?;
    let dt_bias = la.dt_bias.as_f32()?;
    let mut db = vec![0.0f32; t * nv];
    let mut da = vec![0.0f32; t * nv];
    gated_delta_gating_backward(
        &mut da,
        &mut db,
        &mut g.a_log,
        &mut g.dt_bias,
        &dg,
        &dbeta,
        &s.g,
        &s.beta,
        &s.a,
        a_log,
        dt_bias,
    )?;
    let mut dxn = vec![0.0f32; t * hsz];
    linear_bwd(&la.in_proj_qkv, &mut g.in_proj_qkv, &mut dxn, &dqkv, xn, t)?;
    linear_bwd(&la.in_proj_z, &mut g.in_proj_z, &mut dxn, &dz, xn, t)?;
    linear_bwd(&la.in_proj_b, &mut g.in_proj_b, &mut dxn, &db, xn, t)?;
    linear_bwd(&la.in_proj_a, &mut g.in_proj_a, &mut dxn, &da, xn, t)?;
    Ok(dxn)
}

fn full_attention_bwd(
    model: &Qwen3_5,
    fa: &FullAttention,
    s: &FullActs,
    g: &mut FullAttnGrad,
    xn: &[f32],
    dy: &[f32],
    packed: &Packed,
) -> Result<Vec<f32>> {
    let c = &model.config;
    let t = packed.len();
    let hsz = c.hidden_size;
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let (qrow, kvrow) = (nh * hd, nkv * hd);
    let mut dgated = vec![0.0f32; t * qrow];
    linear_bwd(&fa.o_proj, &mut g.o_proj, &mut dgated, dy, &s.gated, t)?;
    let (mut dattn, mut dgate) = (vec![0.0f32; t * qrow], vec![0.0f32; t * qrow]);
    sigmoid_gate_backward(&mut dattn, &mut dgate, &dgated, &s.attn, &s.gate)?;
    let mut dq = vec![0.0f32; t * qrow];
    let mut dk = vec![0.0f32; t * kvrow];
    let mut dv = vec![0.0f32; t * kvrow];
    let scale = 1.0 / (hd as f32).sqrt();
    for &(st, n) in &packed.spans {
        let (rq, rk) = (st * qrow..(st + n) * qrow, st * kvrow..(st + n) * kvrow);
        attention_backward(
            &mut dq[rq.clone()],
            &mut dk[rk.clone()],
            &mut dv[rk.clone()],
            &dattn[rq.clone()],
            &s.q[rq],
            &s.k[rk.clone()],
            &s.v[rk],
            AttnDims {
                nq: n,
                nk: n,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            },
            scale,
        )?;
    }
    rope_backward(
        &mut dq,
        &packed.positions,
        nh,
        hd,
        c.rotary_dim,
        c.rope_theta,
    )?;
    rope_backward(
        &mut dk,
        &packed.positions,
        nkv,
        hd,
        c.rotary_dim,
        c.rope_theta,
    )?;
    let mut dq_raw = vec![0.0f32; t * qrow];
    let mut dk_raw = vec![0.0f32; t * kvrow];
    rmsnorm_backward(
        &mut dq_raw,
        &mut g.q_norm,
        &dq,
        &s.q_raw,
        fa.q_norm.as_f32()?,
        &s.q_rstd,
        t * nh,
        hd,
    )?;
    rmsnorm_backward(
        &mut dk_raw,
        &mut g.k_norm,
        &dk,
        &s.k_raw,
        fa.k_norm.as_f32()?,
        &s.k_rstd,
        t * nkv,
        hd,
    )?;
    // q_proj rows are interleaved per head: [query head 0 | gate head 0 | ...].
    let mut dqg = Vec::with_capacity(t * qrow * 2);
    for (qh, gh) in dq_raw.chunks_exact(hd).zip(dgate.chunks_exact(hd)) {
        dqg.extend_from_slice(qh);
        dqg.extend_from_slice(gh);
    }
    let mut dxn = vec![0.0f32; t * hsz];
    linear_bwd(&fa.q_proj, &mut g.q_proj, &mut dxn, &dqg, xn, t)?;
    linear_bwd(&fa.k_proj, &mut g.k_proj, &mut dxn, &dk_raw, xn, t)?;
    linear_bwd(&fa.v_proj, &mut g.v_proj, &mut dxn, &dv, xn, t)?;
    Ok(dxn)
}
