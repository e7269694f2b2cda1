//! The CPU side of the layer code ([`LayerOps`]): the `arcticd_kernels::cpu`
//! kernels on host vectors, each sequence of a packed batch reading and
//! advancing its own [`SeqCache`] (or reading its past keys and values in
//! place from a paged cache). The order of every sum is fixed by the
//! kernels, never by how a batch is cut, so prefill, decode, scoring and
//! training give the same bits.
//!
//! Not for: the layer's structure (`qwen3_5`), scheduling or paging (the
//! engine's).

use super::ops::LayerOps;
use super::qwen3_5::{Layout, Linear, LinearAttention, LinearPacks, PagedPast, SeqInput};
use super::PrefillForm;
use crate::config::ModelConfig;
use crate::{Error, Result};
use arcticd_kernels::cpu::{
    activation::{sigmoid, sigmoid_gate_forward, silu_forward, silu_mul_forward, softplus},
    attention::{attention_forward, attention_forward_paged, AttnDims, PagedKv, MIN_BLOCKED_NQ},
    conv1d::conv1d_forward,
    embedding::embedding_forward,
    gated_delta::{
        gated_delta_chunked_forward, gated_delta_recurrent_forward,
        gated_delta_recurrent_forward_checkpointed, warm_state, GatedDeltaDims, CHECKPOINT_EVERY,
        CHUNK,
    },
    l2norm::l2norm_forward,
    matmul::matmul_forward_packed,
    prefetch_rows,
    rmsnorm::{gated_rmsnorm_forward, rmsnorm_forward},
    rope::rope_forward,
};
use arcticd_kernels::Tensor;
use rayon::prelude::*;

/// Query runs shorter than this read a paged past in place (the attention
/// kernel's row path, whose bits they then share); longer ones gather it
/// once for the blocked path.
const PAGED_MAX_NQ: usize = MIN_BLOCKED_NQ;

/// A packed batch on the CPU: its layout, its sequences' caches, where
/// their pasts lie when paged, and the packed weights when there are some.
pub(crate) struct CpuOps<'a, 'b, 'c> {
    pub config: &'a ModelConfig,
    pub layout: &'a Layout,
    pub batch: &'a mut [SeqInput<'b>],
    pub pasts: Option<&'a [Option<PagedPast<'c>>]>,
    pub packs: Option<&'a LinearPacks>,
    /// How the recurrence runs over a sequence's new tokens (a training
    /// forward, which keeps checkpoints, always runs it token by token).
    pub form: PrefillForm,
}

/// `[l.forward(inp) for l in group]`, in one product when `packs` holds the
/// group side by side.
pub(crate) fn project(
    group: &[&Linear],
    inp: &[f32],
    n: usize,
    packs: Option<&LinearPacks>,
) -> Result<Vec<Vec<f32>>> {
    let Some(p) = packs.and_then(|p| p.get_fused(group)) else {
        return group
            .iter()
            .map(|l| l.forward_with(inp, n, packs))
            .collect();
    };
    let total = p.dims().1;
    let mut joined = vec![0.0f32; n * total];
    matmul_forward_packed(&mut joined, inp, p, None, n)?;
    let mut outs: Vec<Vec<f32>> = group
        .iter()
        .map(|l| Vec::with_capacity(n * l.out_features))
        .collect();
    for row in joined.chunks_exact(total) {
        let mut at = 0;
        for (o, l) in outs.iter_mut().zip(group) {
            o.extend_from_slice(&row[at..at + l.out_features]);
            at += l.out_features;
        }
    }
    Ok(outs)
}

/// `buf` cut into one piece of `n * row` floats per span `(start, n, _)`;
/// the spans tile it in order.
fn split_rows<'a>(
    mut buf: &'a mut [f32],
    spans: &[(usize, usize, usize)],
    row: usize,
) -> Vec<&'a mut [f32]> {
    let mut pieces = Vec::with_capacity(spans.len());
    for &(_, n, _) in spans {
        let (head, tail) = std::mem::take(&mut buf).split_at_mut(n * row);
        pieces.push(head);
        buf = tail;
    }
    pieces
}

/// One sequence's `q, k, v, g, beta` for the gated-delta kernels.
type DeltaInputs<'a> = (&'a [f32], &'a [f32], &'a [f32], &'a [f32], &'a [f32]);

/// [`PrefillForm::Chunked`] over one sequence's new tokens: chunks of
/// [`CHUNK`] from the first, and a last chunk of one token (or a segment of
/// one) as the recurrent step, as the GPU kernel runs it, so a token
/// computed alone has decode's bits.
fn chunked_segment(
    out: &mut [f32],
    state: &mut [f32],
    (q, k, v, g, beta): DeltaInputs<'_>,
    dims: GatedDeltaDims,
) -> Result<()> {
    let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
    let m = if t % CHUNK == 1 { t - 1 } else { t };
    if m > 0 {
        let head = GatedDeltaDims { t: m, ..dims };
        let (qd, vd) = (m * nk * dk, m * nv * dv);
        gated_delta_chunked_forward(
            &mut out[..vd],
            state,
            &q[..qd],
            &k[..qd],
            &v[..vd],
            &g[..m * nv],
            &beta[..m * nv],
            head,
            CHUNK,
        )?;
    }
    if m < t {
        let (qd, vd) = (m * nk * dk, m * nv * dv);
        gated_delta_recurrent_forward(
            &mut out[vd..],
            state,
            &q[qd..],
            &k[qd..],
            &v[vd..],
            &g[m * nv..],
            &beta[m * nv..],
            GatedDeltaDims { t: 1, ..dims },
        )?;
    }
    Ok(())
}

/// RMSNorm over rows of `c`: the output and each row's reciprocal RMS.
pub(crate) fn rmsnorm(
    inp: &[f32],
    weight: &Tensor,
    c: usize,
    eps: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = inp.len() / c;
    let mut out = vec![0.0f32; inp.len()];
    let mut rstd = vec![0.0f32; n];
    rmsnorm_forward(&mut out, &mut rstd, inp, weight.as_f32()?, n, c, eps)?;
    Ok((out, rstd))
}

impl CpuOps<'_, '_, '_> {
    /// Tokens in the batch.
    fn tokens(&self) -> usize {
        self.layout.ids.len()
    }

    /// Where each sequence's states of linear layer `li` lie: the conv
    /// state's address and length, the recurrent state's address. A decode
    /// step reads every sequence's states from memory, so each sequence's
    /// are fetched while the one before it runs (addresses, only ever
    /// prefetched, never read through).
    fn state_addresses(&self, li: usize) -> Vec<(usize, usize, usize)> {
        self.batch
            .iter()
            .map(|seq| {
                let conv = &seq.cache.conv_state[li];
                (
                    conv.as_ptr() as usize,
                    conv.len(),
                    seq.cache.recurrent_state[li].as_ptr() as usize,
                )
            })
            .collect()
    }
}

impl LayerOps for CpuOps<'_, '_, '_> {
    type W = Tensor;
    type Buf = Vec<f32>;
    type Checkpoints = Vec<Vec<f32>>;

    fn duplicate(&mut self, x: &Vec<f32>) -> Result<Vec<f32>> {
        Ok(x.clone())
    }

    fn embed(&mut self, table: &Tensor) -> Result<Vec<f32>> {
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let ids = &self.layout.ids;
        let mut x = vec![0.0f32; ids.len() * h];
        embedding_forward(&mut x, ids, table.as_f32()?, v, h)
            .map_err(|e| Error::Input(e.to_string()))?;
        Ok(x)
    }

    fn rmsnorm(
        &mut self,
        x: &Vec<f32>,
        weight: &Tensor,
        c: usize,
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        rmsnorm(x, weight, c, eps)
    }

    fn add_assign(&mut self, x: &mut Vec<f32>, y: &Vec<f32>) -> Result<()> {
        if x.len() != y.len() {
            return Err(Error::Invariant(format!(
                "adding {} values to {}",
                y.len(),
                x.len()
            )));
        }
        for (a, b) in x.iter_mut().zip(y) {
            *a += b;
        }
        Ok(())
    }

    fn project(&mut self, group: &[&Linear], x: &Vec<f32>, t: usize) -> Result<Vec<Vec<f32>>> {
        project(group, x, t, self.packs)
    }

    fn silu_mul(
        &mut self,
        gate: &Vec<f32>,
        up: &Vec<f32>,
        t: usize,
        width: usize,
    ) -> Result<Vec<f32>> {
        let mut act = vec![0.0f32; gate.len()];
        silu_mul_forward(&mut act, gate, up, t, width)?;
        Ok(act)
    }

    fn silu(&mut self, x: &mut Vec<f32>) -> Result<()> {
        silu_forward(x);
        Ok(())
    }

    fn sigmoid_gate(&mut self, x: &mut Vec<f32>, gate: &Vec<f32>) -> Result<()> {
        sigmoid_gate_forward(x, gate)?;
        Ok(())
    }

    fn split_columns(&mut self, x: &Vec<f32>, widths: &[usize]) -> Result<Vec<Vec<f32>>> {
        let width: usize = widths.iter().sum();
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(Error::Invariant(format!(
                "{} values are not rows of {width}",
                x.len()
            )));
        }
        let rows = x.len() / width;
        let mut outs: Vec<Vec<f32>> = widths
            .iter()
            .map(|w| Vec::with_capacity(rows * w))
            .collect();
        for row in x.chunks_exact(width) {
            let mut at = 0;
            for (o, &w) in outs.iter_mut().zip(widths) {
                o.extend_from_slice(&row[at..at + w]);
                at += w;
            }
        }
        Ok(outs)
    }

    fn l2norm(
        &mut self,
        x: &Vec<f32>,
        rows: usize,
        d: usize,
        scale: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let mut out = vec![0.0f32; rows * d];
        let mut rnorm = vec![0.0f32; rows];
        l2norm_forward(&mut out, &mut rnorm, x, rows, d, 1e-6)?;
        if scale != 1.0 {
            for v in out.iter_mut() {
                *v *= scale;
            }
        }
        Ok((out, rnorm))
    }

    fn gated_rmsnorm(
        &mut self,
        x: &Vec<f32>,
        z: &Vec<f32>,
        weight: &Tensor,
        d: usize,
        eps: f32,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let rows = x.len() / d.max(1);
        let mut out = vec![0.0f32; x.len()];
        let mut rstd = vec![0.0f32; rows];
        gated_rmsnorm_forward(&mut out, &mut rstd, x, z, weight.as_f32()?, rows, d, eps)?;
        Ok((out, rstd))
    }

    fn causal_conv(&mut self, la: &LinearAttention, li: usize, qkv: &Vec<f32>) -> Result<Vec<f32>> {
        let (conv_dim, kc) = (self.config.linear_conv_dim(), self.config.conv_kernel);
        let mut conv = vec![0.0f32; self.tokens() * conv_dim];
        let states = self.state_addresses(li);
        let weight = la.conv1d.as_f32()?;
        for (i, (&(start, n, _), seq)) in self
            .layout
            .spans
            .iter()
            .zip(self.batch.iter_mut())
            .enumerate()
        {
            if let Some(&(next, len, _)) = states.get(i + 1) {
                prefetch_rows(next as *const f32, 1, 0, len);
            }
            conv1d_forward(
                &mut conv[start * conv_dim..(start + n) * conv_dim],
                &mut seq.cache.conv_state[li],
                &qkv[start * conv_dim..(start + n) * conv_dim],
                weight,
                n,
                conv_dim,
                kc,
            )?;
        }
        Ok(conv)
    }

    fn gating(
        &mut self,
        la: &LinearAttention,
        a: &Vec<f32>,
        b: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let nv = self.config.linear_num_value_heads;
        let a_log = la.a_log.as_f32()?;
        let dt_bias = la.dt_bias.as_f32()?;
        let g: Vec<f32> = a
            .iter()
            .enumerate()
            .map(|(i, &x)| {
                let hh = i % nv;
                -a_log[hh].exp() * softplus(x + dt_bias[hh])
            })
            .collect();
        let beta: Vec<f32> = b.iter().map(|&x| sigmoid(x)).collect();
        Ok((g, beta))
    }

    fn recurrence(
        &mut self,
        li: usize,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
        g: &Vec<f32>,
        beta: &Vec<f32>,
        keep: bool,
    ) -> Result<(Vec<f32>, Option<Vec<Vec<f32>>>)> {
        let c = self.config;
        let (nk, nv, dk, dv) = c.delta_heads();
        let (qd, vd) = (nk * dk, nv * dv);
        let states = self.state_addresses(li);
        let spans = &self.layout.spans;
        let mut core = vec![0.0f32; self.tokens() * vd];
        let outs = split_rows(&mut core, spans, vd);
        let jobs: Vec<_> = spans
            .iter()
            .zip(self.batch.iter_mut())
            .zip(outs)
            .enumerate()
            .collect();
        // Sequences in parallel (their states are independent); each one's
        // arithmetic is the same whatever runs beside it. With `keep`, the
        // states every CHECKPOINT_EVERY tokens are kept for the backward.
        let states = &states;
        let chunked = self.form == PrefillForm::Chunked;
        let checkpoints = jobs
            .into_par_iter()
            .map(|(i, ((&(start, n, _), seq), out))| -> Result<Vec<f32>> {
                let dims = GatedDeltaDims {
                    t: n,
                    nk,
                    nv,
                    dk,
                    dv,
                };
                if let Some(&(_, _, next)) = states.get(i + 1) {
                    warm_state(next as *const f32, dims);
                }
                let args = (
                    &q[start * qd..(start + n) * qd],
                    &k[start * qd..(start + n) * qd],
                    &v[start * vd..(start + n) * vd],
                    &g[start * nv..(start + n) * nv],
                    &beta[start * nv..(start + n) * nv],
                );
                let state = &mut seq.cache.recurrent_state[li];
                // The recurrent form for every length: on the CPU it is the faster
                // one at these head sizes (benches/kernels.rs: ~0.45 ms vs ~1.0 ms
                // for the chunked form at t=512, d=64), and one form everywhere
                // makes prefill, decode and scoring of the same tokens bit-identical,
                // which the engine's prefix cache and the trainer's log-prob
                // agreement rely on. The chunked form (held to 1e-5 of this one in
                // the kernel tests) is the GPU prefill path, and here on request
                // (PrefillForm::Chunked).
                if chunked && !keep {
                    chunked_segment(out, state, args, dims)?;
                    return Ok(Vec::new());
                }
                if !keep {
                    gated_delta_recurrent_forward(
                        out, state, args.0, args.1, args.2, args.3, args.4, dims,
                    )?;
                    return Ok(Vec::new());
                }
                let mut cps = vec![0.0f32; n.div_ceil(CHECKPOINT_EVERY).max(1) * nv * dk * dv];
                gated_delta_recurrent_forward_checkpointed(
                    out, state, args.0, args.1, args.2, args.3, args.4, dims, &mut cps,
                )?;
                Ok(cps)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok((core, keep.then_some(checkpoints)))
    }

    fn qk_norm_rope(
        &mut self,
        x: &Vec<f32>,
        weight: &Tensor,
        heads: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = self.config;
        let (mut out, rstd) = rmsnorm(x, weight, c.head_dim, c.rms_norm_eps)?;
        rope_forward(
            &mut out,
            &self.layout.positions,
            heads,
            c.head_dim,
            c.rotary_dim,
            c.rope_theta,
        )?;
        Ok((out, rstd))
    }

    fn attention(
        &mut self,
        li: usize,
        q: &Vec<f32>,
        k: &Vec<f32>,
        v: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let c = self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let (qrow, kvrow) = (nh * hd, nkv * hd);
        let (spans, pasts) = (&self.layout.spans, self.pasts);
        let mut out = vec![0.0f32; self.tokens() * qrow];
        let scale = 1.0 / (hd as f32).sqrt();
        let outs = split_rows(&mut out, spans, qrow);
        let jobs: Vec<_> = spans
            .iter()
            .zip(self.batch.iter_mut())
            .zip(outs)
            .enumerate()
            .collect();
        let dims = |n: usize, past: usize| AttnDims {
            nq: n,
            nk: past + n,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        // Sequences in parallel, as in the linear layers.
        jobs.into_par_iter()
            .try_for_each(|(s, ((&(start, n, past), seq), o))| -> Result<()> {
                let kc = &mut seq.cache.k[li];
                let vc = &mut seq.cache.v[li];
                if let Some(p) = pasts.and_then(|p| p[s].as_ref()) {
                    let (k_pool, v_pool) = p.pools.get(li).copied().unwrap_or_default();
                    let paged = PagedKv {
                        k_pool,
                        v_pool,
                        blocks: p.blocks,
                        block_size: p.block_size,
                        past,
                        new_k: &k[start * kvrow..(start + n) * kvrow],
                        new_v: &v[start * kvrow..(start + n) * kvrow],
                        kv_row: kvrow,
                    };
                    kc.clear();
                    vc.clear();
                    if n < PAGED_MAX_NQ {
                        // Decode: the past is read where it lies, the next
                        // sequence's first keys fetched meanwhile.
                        if let (Some(Some(next)), Some(&(_, _, next_past))) =
                            (pasts.and_then(|p| p.get(s + 1)), spans.get(s + 1))
                        {
                            let (k_pool, v_pool) = next.pools.get(li).copied().unwrap_or_default();
                            PagedKv {
                                k_pool,
                                v_pool,
                                blocks: next.blocks,
                                block_size: next.block_size,
                                past: next_past,
                                new_k: &[],
                                new_v: &[],
                                kv_row: kvrow,
                            }
                            .warm();
                        }
                        kc.extend_from_slice(paged.new_k);
                        vc.extend_from_slice(paged.new_v);
                        let q = &q[start * qrow..(start + n) * qrow];
                        return attention_forward_paged(o, q, &paged, dims(n, past), scale)
                            .map_err(|e| Error::Input(e.to_string()));
                    }
                    // A long run of queries is matrix products over one
                    // piece: gather the past once.
                    for pos in 0..past {
                        let Some(&b) = p.blocks.get(pos / p.block_size.max(1)) else {
                            return Err(Error::Input(format!(
                                "block table of {} blocks does not cover {past} positions",
                                p.blocks.len()
                            )));
                        };
                        let at = (b as usize * p.block_size + pos % p.block_size) * kvrow;
                        let (Some(kr), Some(vr)) =
                            (k_pool.get(at..at + kvrow), v_pool.get(at..at + kvrow))
                        else {
                            return Err(Error::Input(format!("block {b} is outside the cache")));
                        };
                        kc.extend_from_slice(kr);
                        vc.extend_from_slice(vr);
                    }
                }
                if kc.len() != past * kvrow {
                    return Err(Error::Input(format!(
                        "cache of layer {li} holds {} positions, the sequence says {past}",
                        kc.len() / kvrow.max(1)
                    )));
                }
                kc.extend_from_slice(&k[start * kvrow..(start + n) * kvrow]);
                vc.extend_from_slice(&v[start * kvrow..(start + n) * kvrow]);
                attention_forward(
                    o,
                    &q[start * qrow..(start + n) * qrow],
                    kc,
                    vc,
                    dims(n, past),
                    scale,
                )?;
                Ok(())
            })?;
        Ok(out)
    }
}
