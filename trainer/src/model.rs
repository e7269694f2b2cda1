//! Training forward and backward of Qwen3.5.
//!
//! The forward calls the same `arcticd_kernels::cpu` functions in the same
//! order as the engine's `Qwen3_5::forward` (engine/src/model/qwen3_5.rs),
//! so a token's log-probability here is the engine's, bit for bit; it differs
//! only in keeping the activations the backward needs ([`Activations`]). The
//! backward walks the layers in reverse with the `*_backward` kernels.
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

use crate::grads::{FullAttnGrad, LinearAttnGrad, MixerGrad, ModelGrads};
use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{FullAttention, Layer, Linear, LinearAttention, Mixer};
use arcticd_engine::Qwen3_5;
use arcticd_kernels::cpu::{
    activation::{
        sigmoid, sigmoid_gate_backward, sigmoid_gate_forward, silu_backward, silu_forward,
        silu_mul_backward, silu_mul_forward, softplus, softplus_grad,
    },
    attention::{attention_backward, attention_forward, AttnDims},
    conv1d::{conv1d_backward, conv1d_forward},
    embedding::{embedding_backward, embedding_forward},
    gated_delta::{
        gated_delta_backward_from_checkpoints, gated_delta_recurrent_forward_checkpointed,
        GatedDeltaDims, CHECKPOINT_EVERY,
    },
    l2norm::{l2norm_backward, l2norm_forward},
    logsoftmax::{
        entropy_backward, entropy_forward, logprob_gather_backward, logprob_gather_forward,
    },
    matmul::{matmul_backward, matmul_forward},
    rmsnorm::{gated_rmsnorm_backward, gated_rmsnorm_forward, rmsnorm_backward, rmsnorm_forward},
    rope::{rope_backward, rope_forward},
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
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(sequences.len());
        let mut positions = Vec::new();
        for (s, seq) in sequences.iter().enumerate() {
            if seq.is_empty() {
                return Err(Error::Input(format!("sequence {s} is empty")));
            }
            if let Some((i, &id)) = seq.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
                return Err(Error::Input(format!(
                    "sequence {s}, position {i}: token id {id} is not below the vocabulary size {vocab}"
                )));
            }
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

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Saved activations of a Gated DeltaNet mixer.
#[derive(Debug)]
struct LinearActs {
    qkv: Vec<f32>,
    conv_pre: Vec<f32>,
    q_raw: Vec<f32>,
    k_raw: Vec<f32>,
    rn_q: Vec<f32>,
    rn_k: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    z: Vec<f32>,
    a: Vec<f32>,
    beta: Vec<f32>,
    g: Vec<f32>,
    core: Vec<f32>,
    rstd: Vec<f32>,
    normed: Vec<f32>,
    /// Per sequence, the recurrent state every `CHECKPOINT_EVERY` tokens.
    checkpoints: Vec<Vec<f32>>,
}

/// Saved activations of a gated full-attention mixer.
#[derive(Debug)]
struct FullActs {
    q_raw: Vec<f32>,
    gate: Vec<f32>,
    k_raw: Vec<f32>,
    q_rstd: Vec<f32>,
    k_rstd: Vec<f32>,
    /// Post-norm, post-RoPE.
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    /// Attention output before the sigmoid gate, and after it.
    attn: Vec<f32>,
    gated: Vec<f32>,
}

#[derive(Debug)]
enum MixerActs {
    Linear(Box<LinearActs>),
    Full(Box<FullActs>),
}

/// A layer's activations, or only its input when they are recomputed.
#[derive(Debug)]
enum Saved {
    All(Box<LayerActs>),
    Input(Vec<f32>),
}

#[derive(Debug)]
struct LayerActs {
    x_in: Vec<f32>,
    rstd1: Vec<f32>,
    xn1: Vec<f32>,
    mixer: MixerActs,
    x_mid: Vec<f32>,
    rstd2: Vec<f32>,
    xn2: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
}

/// Everything the backward needs from one forward.
#[derive(Debug)]
pub struct Activations {
    pub packed: Packed,
    layers: Vec<Saved>,
    x_last: Vec<f32>,
    final_rstd: Vec<f32>,
    /// Final hidden states after the final norm, `[tokens, hidden]`.
    pub hidden: Vec<f32>,
}

fn linear_fwd(l: &Linear, inp: &[f32], n: usize) -> Result<Vec<f32>> {
    let mut out = vec![0.0f32; n * l.out_features];
    let bias = match &l.bias {
        Some(b) => Some(b.as_f32()?),
        None => None,
    };
    matmul_forward(
        &mut out,
        inp,
        l.weight.as_f32()?,
        bias,
        n,
        l.in_features,
        l.out_features,
    )?;
    Ok(out)
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

fn rmsnorm_fwd(
    inp: &[f32],
    w: &arcticd_kernels::Tensor,
    c: usize,
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = inp.len() / c;
    let mut out = vec![0.0f32; inp.len()];
    let mut rstd = vec![0.0f32; n];
    rmsnorm_forward(&mut out, &mut rstd, inp, w.as_f32()?, n, c, eps)?;
    Ok((out, rstd))
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

/// The training forward with [`ForwardOptions`].
pub fn forward_with(model: &Qwen3_5, packed: Packed, opts: ForwardOptions) -> Result<Activations> {
    let c = &model.config;
    let h = c.hidden_size;
    let t = packed.len();
    let mut x = vec![0.0f32; t * h];
    embedding_forward(
        &mut x,
        &packed.ids,
        model.embed_tokens.as_f32()?,
        c.vocab_size,
        h,
    )?;
    let mut layers = Vec::with_capacity(model.layers.len());
    for layer in &model.layers {
        let (x_out, acts) = layer_forward(model, layer, &x, &packed)?;
        layers.push(if opts.recompute_layers {
            Saved::Input(x)
        } else {
            Saved::All(Box::new(acts))
        });
        x = x_out;
    }
    let (hidden, final_rstd) = rmsnorm_fwd(&x, &model.norm, h, c.rms_norm_eps)?;
    Ok(Activations {
        packed,
        layers,
        x_last: x,
        final_rstd,
        hidden,
    })
}

/// One decoder layer, as the engine runs it; returns the layer's output and
/// its activations.
fn layer_forward(
    model: &Qwen3_5,
    layer: &Layer,
    x_in: &[f32],
    packed: &Packed,
) -> Result<(Vec<f32>, LayerActs)> {
    let c = &model.config;
    let h = c.hidden_size;
    let t = packed.len();
    let (xn1, rstd1) = rmsnorm_fwd(x_in, &layer.input_layernorm, h, c.rms_norm_eps)?;
    let (mixed, mixer) = match &layer.mixer {
        Mixer::Linear(la) => {
            let (out, acts) = linear_attention_fwd(model, la, &xn1, packed)?;
            (out, MixerActs::Linear(Box::new(acts)))
        }
        Mixer::Full(fa) => {
            let (out, acts) = full_attention_fwd(model, fa, &xn1, packed)?;
            (out, MixerActs::Full(Box::new(acts)))
        }
    };
    let mut x = x_in.to_vec();
    for (a, b) in x.iter_mut().zip(&mixed) {
        *a += b;
    }
    let (xn2, rstd2) = rmsnorm_fwd(&x, &layer.post_attention_layernorm, h, c.rms_norm_eps)?;
    let gate = linear_fwd(&layer.gate_proj, &xn2, t)?;
    let up = linear_fwd(&layer.up_proj, &xn2, t)?;
    let mut act = vec![0.0f32; gate.len()];
    silu_mul_forward(&mut act, &gate, &up, t, c.intermediate_size)?;
    let mlp = linear_fwd(&layer.down_proj, &act, t)?;
    let x_mid = x.clone();
    for (a, b) in x.iter_mut().zip(&mlp) {
        *a += b;
    }
    let acts = LayerActs {
        x_in: x_in.to_vec(),
        rstd1,
        xn1,
        mixer,
        x_mid,
        rstd2,
        xn2,
        gate,
        up,
        act,
    };
    Ok((x, acts))
}

fn linear_attention_fwd(
    model: &Qwen3_5,
    la: &LinearAttention,
    xn: &[f32],
    packed: &Packed,
) -> Result<(Vec<f32>, LinearActs)> {
    let c = &model.config;
    let t = packed.len();
    let (nk, nv, dk, dv) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    );
    let conv_dim = c.linear_conv_dim();
    let kc = c.conv_kernel;
    let qkv = linear_fwd(&la.in_proj_qkv, xn, t)?;
    let z = linear_fwd(&la.in_proj_z, xn, t)?;
    let b = linear_fwd(&la.in_proj_b, xn, t)?;
    let a = linear_fwd(&la.in_proj_a, xn, t)?;

    let mut conv_pre = vec![0.0f32; t * conv_dim];
    for &(start, n) in &packed.spans {
        let mut state = vec![0.0f32; (kc - 1) * conv_dim];
        conv1d_forward(
            &mut conv_pre[start * conv_dim..(start + n) * conv_dim],
            &mut state,
            &qkv[start * conv_dim..(start + n) * conv_dim],
            la.conv1d.as_f32()?,
            n,
            conv_dim,
            kc,
        )?;
    }
    let mut conv = conv_pre.clone();
    silu_forward(&mut conv);

    let (qd, vd) = (nk * dk, nv * dv);
    let mut q_raw = Vec::with_capacity(t * qd);
    let mut k_raw = Vec::with_capacity(t * qd);
    let mut v = Vec::with_capacity(t * vd);
    for row in conv.chunks_exact(conv_dim) {
        q_raw.extend_from_slice(&row[..qd]);
        k_raw.extend_from_slice(&row[qd..2 * qd]);
        v.extend_from_slice(&row[2 * qd..]);
    }
    let mut q = vec![0.0f32; t * qd];
    let mut k = vec![0.0f32; t * qd];
    let mut rn_q = vec![0.0f32; t * nk];
    let mut rn_k = vec![0.0f32; t * nk];
    l2norm_forward(&mut q, &mut rn_q, &q_raw, t * nk, dk, 1e-6)?;
    l2norm_forward(&mut k, &mut rn_k, &k_raw, t * nk, dk, 1e-6)?;
    let scale = 1.0 / (dk as f32).sqrt();
    for x in q.iter_mut() {
        *x *= scale;
    }
    let a_log = la.a_log.as_f32()?;
    let dt_bias = la.dt_bias.as_f32()?;
    let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
    let g: Vec<f32> = a
        .iter()
        .enumerate()
        .map(|(i, &x)| {
            let hh = i % nv;
            -a_log[hh].exp() * softplus(x + dt_bias[hh])
        })
        .collect();

    let mut core = vec![0.0f32; t * vd];
    let mut checkpoints = Vec::with_capacity(packed.spans.len());
    for &(start, n) in &packed.spans {
        let dims = GatedDeltaDims {
            t: n,
            nk,
            nv,
            dk,
            dv,
        };
        let mut state = vec![0.0f32; nv * dk * dv];
        let mut cps = vec![0.0f32; n.div_ceil(CHECKPOINT_EVERY).max(1) * nv * dk * dv];
        let (qs, ks, vs) = (
            &q[start * qd..(start + n) * qd],
            &k[start * qd..(start + n) * qd],
            &v[start * vd..(start + n) * vd],
        );
        let (gs, bs) = (
            &g[start * nv..(start + n) * nv],
            &beta[start * nv..(start + n) * nv],
        );
        let out = &mut core[start * vd..(start + n) * vd];
        // The recurrent form at every length, as the engine runs it, so the
        // numbers are the engine's; the states it passes every
        // CHECKPOINT_EVERY tokens are kept for the backward.
        gated_delta_recurrent_forward_checkpointed(
            out, &mut state, qs, ks, vs, gs, bs, dims, &mut cps,
        )?;
        checkpoints.push(cps);
    }
    let mut normed = vec![0.0f32; t * vd];
    let mut rstd = vec![0.0f32; t * nv];
    gated_rmsnorm_forward(
        &mut normed,
        &mut rstd,
        &core,
        &z,
        la.norm.as_f32()?,
        t * nv,
        dv,
        c.rms_norm_eps,
    )?;
    let out = linear_fwd(&la.out_proj, &normed, t)?;
    Ok((
        out,
        LinearActs {
            qkv,
            conv_pre,
            q_raw,
            k_raw,
            rn_q,
            rn_k,
            q,
            k,
            v,
            z,
            a,
            beta,
            g,
            core,
            rstd,
            normed,
            checkpoints,
        },
    ))
}

fn full_attention_fwd(
    model: &Qwen3_5,
    fa: &FullAttention,
    xn: &[f32],
    packed: &Packed,
) -> Result<(Vec<f32>, FullActs)> {
    let c = &model.config;
    let t = packed.len();
    let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
    let qg = linear_fwd(&fa.q_proj, xn, t)?;
    let mut q_raw = Vec::with_capacity(t * nh * hd);
    let mut gate = Vec::with_capacity(t * nh * hd);
    for head in qg.chunks_exact(2 * hd) {
        q_raw.extend_from_slice(&head[..hd]);
        gate.extend_from_slice(&head[hd..]);
    }
    let k_raw = linear_fwd(&fa.k_proj, xn, t)?;
    let v = linear_fwd(&fa.v_proj, xn, t)?;
    let (mut q, q_rstd) = rmsnorm_fwd(&q_raw, &fa.q_norm, hd, c.rms_norm_eps)?;
    let (mut k, k_rstd) = rmsnorm_fwd(&k_raw, &fa.k_norm, hd, c.rms_norm_eps)?;
    rope_forward(
        &mut q,
        &packed.positions,
        nh,
        hd,
        c.rotary_dim,
        c.rope_theta,
    )?;
    rope_forward(
        &mut k,
        &packed.positions,
        nkv,
        hd,
        c.rotary_dim,
        c.rope_theta,
    )?;

    let (qrow, kvrow) = (nh * hd, nkv * hd);
    let mut attn = vec![0.0f32; t * qrow];
    let scale = 1.0 / (hd as f32).sqrt();
    for &(start, n) in &packed.spans {
        attention_forward(
            &mut attn[start * qrow..(start + n) * qrow],
            &q[start * qrow..(start + n) * qrow],
            &k[start * kvrow..(start + n) * kvrow],
            &v[start * kvrow..(start + n) * kvrow],
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
    let mut gated = attn.clone();
    sigmoid_gate_forward(&mut gated, &gate)?;
    let out = linear_fwd(&fa.o_proj, &gated, t)?;
    Ok((
        out,
        FullActs {
            q_raw,
            gate,
            k_raw,
            q_rstd,
            k_rstd,
            q,
            k,
            v,
            attn,
            gated,
        },
    ))
}

/// Rows of logits made at once, as `Qwen3_5::score` chunks them (so a 248k
/// vocabulary never needs `tokens x vocab` floats, and results match it).
fn rows_per_chunk(vocab: usize) -> usize {
    (1 << 24) / vocab.max(1) + 1
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
    let per = rows_per_chunk(vsz);
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
    let per = rows_per_chunk(vsz);
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
    for ((layer, saved), lg) in model
        .layers
        .iter()
        .zip(&acts.layers)
        .zip(grads.layers.iter_mut())
        .rev()
    {
        let recomputed;
        let la: &LayerActs = match saved {
            Saved::All(a) => a,
            Saved::Input(x_in) => {
                recomputed = layer_forward(model, layer, x_in, &acts.packed)?.1;
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
            (Mixer::Linear(m), MixerActs::Linear(a), MixerGrad::Linear(g)) => {
                linear_attention_bwd(model, m, a, g, &la.xn1, &dx, &acts.packed)?
            }
            (Mixer::Full(m), MixerActs::Full(a), MixerGrad::Full(g)) => {
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
    let (nk, nv, dk, dv) = (
        c.linear_num_key_heads,
        c.linear_num_value_heads,
        c.linear_key_head_dim,
        c.linear_value_head_dim,
    );
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
    for i in 0..t * nv {
        let hh = i % nv;
        let be = s.beta[i];
        db[i] = dbeta[i] * be * (1.0 - be);
        g.a_log[hh] += dg[i] * s.g[i];
        da[i] = dg[i] * -a_log[hh].exp() * softplus_grad(s.a[i] + dt_bias[hh]);
        g.dt_bias[hh] += da[i];
    }
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
