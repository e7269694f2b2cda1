//! Training forward and backward of Qwen3.5.
//!
//! The forward is the engine's (`Qwen3_5::forward_keeping`,
//! engine/src/model/qwen3_5.rs): the same layer code that prefills, decodes
//! and scores, with the activations the backward needs kept
//! (`arcticd_engine::model::saved`), so a token's log-probability here is
//! the engine's, bit for bit. The backward walks the layers in reverse
//! (`backward.rs`, written once over a device seam); here are its CPU ops,
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

use crate::backward::{model_backward, BackwardOps, Forward};
use crate::grads::{LinearAttnGrad, LinearGrad, ModelGrads};
use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{Linear, LinearAttention};
use arcticd_engine::model::saved::{FullActs, Keep, Kept, LayerActs, LinearActs};
use arcticd_engine::model::{check_ids, logit_rows_per_chunk};
use arcticd_engine::Qwen3_5;
use arcticd_kernels::cpu::{
    activation::{
        gated_delta_gating_backward, sigmoid_gate_backward, silu_backward, silu_mul_backward,
    },
    attention::{attention_backward, AttnDims},
    conv1d::conv1d_backward,
    embedding::embedding_backward,
    gated_delta::{
        gated_delta_backward_from_checkpoints, gated_delta_chunked_backward_from_checkpoints,
        GatedDeltaDims,
    },
    l2norm::l2norm_backward,
    logsoftmax::{
        entropy_backward, entropy_forward, logprob_gather_backward, logprob_gather_forward,
    },
    matmul::{matmul_backward, matmul_forward},
    rmsnorm::{gated_rmsnorm_backward, rmsnorm_backward},
    rope::rope_backward,
};
use arcticd_kernels::Tensor;

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
pub(crate) fn inverse_temperature(temperature: f32) -> Result<Option<f32>> {
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

pub(crate) fn check_rows(n: usize, rows: &[usize], targets: &[u32]) -> Result<()> {
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
    let (t, h) = (acts.packed.len(), model.config.hidden_size);
    if dhidden.len() != t * h {
        return Err(Error::Shape(format!(
            "dhidden has {} values for {t} tokens x {h}",
            dhidden.len()
        )));
    }
    let fwd = Forward {
        layers: &acts.layers,
        x_last: &acts.x_last,
        final_rstd: &acts.final_rstd,
    };
    let dhidden = dhidden.to_vec();
    let mut ops = CpuBackward {
        model,
        packed: &acts.packed,
    };
    model_backward(&mut ops, model, &fwd, &dhidden, &mut grads.0)
}

/// Head width from which the CPU's gated-delta backward runs in the chunked
/// form (`benches/kernels.rs`, `gated_delta_backward`, 512 tokens, 4
/// heads: the chunked form takes 1.37x the recurrent one's time at width
/// 32, 0.72x at 64 and 0.42x at 128). Either is the exact gradient.
const CHUNKED_BACKWARD_MIN_WIDTH: usize = 64;

/// The CPU's side of the backward: the CPU kernels on host vectors, each
/// sequence of the packed batch on its own where the op runs per sequence.
struct CpuBackward<'a> {
    model: &'a Qwen3_5,
    packed: &'a Packed,
}

impl BackwardOps for CpuBackward<'_> {
    type W = Tensor;
    type Buf = Vec<f32>;
    type C = Vec<Vec<f32>>;

    fn tokens(&self) -> usize {
        self.packed.len()
    }

    fn zeros(&mut self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn linear(
        &mut self,
        l: &Linear,
        g: &mut LinearGrad,
        dinp: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
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

    fn rmsnorm(
        &mut self,
        dinp: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        rmsnorm_backward(dinp, dw, dout, inp, w.as_f32()?, rstd, n, c)?;
        Ok(())
    }

    fn silu_mul(
        &mut self,
        dact: &Vec<f32>,
        gate: &Vec<f32>,
        up: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dgate, mut dup) = (vec![0.0f32; dact.len()], vec![0.0f32; dact.len()]);
        silu_mul_backward(&mut dgate, &mut dup, dact, gate, up)?;
        Ok((dgate, dup))
    }

    fn gated_rmsnorm(
        &mut self,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        x: &Vec<f32>,
        z: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        d: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dx, mut dz) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        let rows = x.len() / d.max(1);
        gated_rmsnorm_backward(&mut dx, &mut dz, dw, dout, x, z, w.as_f32()?, rstd, rows, d)?;
        Ok((dx, dz))
    }

    fn gated_delta(&mut self, dcore: &Vec<f32>, s: &LinearActs) -> Result<[Vec<f32>; 5]> {
        let (nk, nv, dk, dv) = self.model.config.delta_heads();
        let (qd, vd, t) = (nk * dk, nv * dv, self.packed.len());
        let mut dq = vec![0.0f32; t * qd];
        let mut dk_ = vec![0.0f32; t * qd];
        let mut dv_ = vec![0.0f32; t * vd];
        let mut dg = vec![0.0f32; t * nv];
        let mut dbeta = vec![0.0f32; t * nv];
        for (&(st, n), cps) in self.packed.spans.iter().zip(&s.checkpoints) {
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
            let backward = if dk.min(dv) >= CHUNKED_BACKWARD_MIN_WIDTH {
                gated_delta_chunked_backward_from_checkpoints
            } else {
                gated_delta_backward_from_checkpoints
            };
            backward(
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
        Ok([dq, dk_, dv_, dg, dbeta])
    }

    fn scale(&mut self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        for v in x.iter_mut() {
            *v *= s;
        }
        Ok(())
    }

    fn l2norm(
        &mut self,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        rnorm: &Vec<f32>,
        rows: usize,
        d: usize,
    ) -> Result<Vec<f32>> {
        let mut dinp = vec![0.0f32; inp.len()];
        l2norm_backward(&mut dinp, dout, inp, rnorm, rows, d)?;
        Ok(dinp)
    }

    fn join_columns(&mut self, parts: &[&Vec<f32>], widths: &[usize]) -> Result<Vec<f32>> {
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let rows = crate::backward::joined_rows(&lens, widths)?;
        let mut out = Vec::with_capacity(rows * widths.iter().sum::<usize>());
        for r in 0..rows {
            for (p, &w) in parts.iter().zip(widths) {
                out.extend_from_slice(&p[r * w..(r + 1) * w]);
            }
        }
        Ok(out)
    }

    fn silu(&mut self, dout: &Vec<f32>, x: &Vec<f32>) -> Result<Vec<f32>> {
        let mut dx = vec![0.0f32; x.len()];
        silu_backward(&mut dx, dout, x)?;
        Ok(dx)
    }

    fn conv(
        &mut self,
        la: &LinearAttention,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let c = &self.model.config;
        let (conv_dim, kc) = (c.linear_conv_dim(), c.conv_kernel);
        let mut dinp = vec![0.0f32; inp.len()];
        let zero_state = vec![0.0f32; (kc - 1) * conv_dim];
        for &(st, n) in &self.packed.spans {
            let r = st * conv_dim..(st + n) * conv_dim;
            conv1d_backward(
                &mut dinp[r.clone()],
                dw,
                None,
                &dout[r.clone()],
                &zero_state,
                &inp[r],
                la.conv1d.as_f32()?,
                n,
                conv_dim,
                kc,
            )?;
        }
        Ok(dinp)
    }

    fn gating(
        &mut self,
        la: &LinearAttention,
        g: &mut LinearAttnGrad,
        dg: &Vec<f32>,
        dbeta: &Vec<f32>,
        s: &LinearActs,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut da, mut db) = (vec![0.0f32; dg.len()], vec![0.0f32; dg.len()]);
        gated_delta_gating_backward(
            &mut da,
            &mut db,
            &mut g.a_log,
            &mut g.dt_bias,
            dg,
            dbeta,
            &s.g,
            &s.beta,
            &s.a,
            la.a_log.as_f32()?,
            la.dt_bias.as_f32()?,
        )?;
        Ok((da, db))
    }

    fn sigmoid_gate(
        &mut self,
        dout: &Vec<f32>,
        attn: &Vec<f32>,
        gate: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dattn, mut dgate) = (vec![0.0f32; dout.len()], vec![0.0f32; dout.len()]);
        sigmoid_gate_backward(&mut dattn, &mut dgate, dout, attn, gate)?;
        Ok((dattn, dgate))
    }

    fn attention(
        &mut self,
        dattn: &Vec<f32>,
        s: &FullActs,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let c = &self.model.config;
        let t = self.packed.len();
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let (qrow, kvrow) = (nh * hd, nkv * hd);
        let mut dq = vec![0.0f32; t * qrow];
        let mut dk = vec![0.0f32; t * kvrow];
        let mut dv = vec![0.0f32; t * kvrow];
        let scale = 1.0 / (hd as f32).sqrt();
        for &(st, n) in &self.packed.spans {
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
        Ok((dq, dk, dv))
    }

    fn qk_norm_rope(
        &mut self,
        mut dout: Vec<f32>,
        raw: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        heads: usize,
        dw: &mut Vec<f32>,
    ) -> Result<Vec<f32>> {
        let c = &self.model.config;
        let hd = c.head_dim;
        rope_backward(
            &mut dout,
            &self.packed.positions,
            heads,
            hd,
            c.rotary_dim,
            c.rope_theta,
        )?;
        let mut draw = vec![0.0f32; raw.len()];
        let rows = self.packed.len() * heads;
        rmsnorm_backward(&mut draw, dw, &dout, raw, w.as_f32()?, rstd, rows, hd)?;
        Ok(draw)
    }

    fn embedding(&mut self, dtable: &mut Vec<f32>, dx: &Vec<f32>) -> Result<()> {
        let c = &self.model.config;
        embedding_backward(dtable, dx, &self.packed.ids, c.vocab_size, c.hidden_size)?;
        Ok(())
    }

    fn recompute(&mut self, model: &Qwen3_5, li: usize, x_in: &Vec<f32>) -> Result<LayerActs> {
        Ok(model.recompute_layer(li, x_in, &self.packed.sequences())?)
    }
}
