//! Gated delta rule: the sequence mixer of Qwen3.5's Gated DeltaNet layers,
//! forward only, for one sequence. The semantics are those of
//! flash-linear-attention's `chunk_gated_delta_rule` and
//! `fused_recurrent_gated_delta_rule` (Yang, Kautz, Hatamizadeh, "Gated Delta
//! Networks", 2024).
//!
//! Not for: the projections, the causal conv, the L2 normalisation of q and k
//! or the q scaling by `dk^-0.5` (the caller does those), nor batching several
//! sequences (call once per sequence, each with its own state).
//!
//! Layouts: `q`, `k` are `[T, nk, dk]`; `v` is `[T, nv, dv]`; `g` (log decay,
//! `<= 0`) and `beta` are `[T, nv]`; `out` is `[T, nv, dv]`; `state` is
//! `[nv, dk, dv]` f32, read as the initial state and overwritten with the
//! final one, so decode carries it from call to call. Value head `h` reads key
//! head `h / (nv / nk)`. `out` and `state` are written (`=`), never
//! accumulated.
//!
//! Recurrence, per value head, per token `t`, with state `S` (`dk x dv`):
//!
//! ```text
//! S     = exp(g_t) S
//! delta = beta_t (v_t - S^T k_t)
//! S     = S + k_t delta^T
//! o_t   = S^T q_t
//! ```
//!
//! `gated_delta_recurrent_forward` runs that literally (the reference, and the
//! decode path). `gated_delta_chunked_forward` computes the same function a
//! chunk of `C` tokens at a time. Within a chunk, with `G_i` the cumulative
//! log decay up to token `i` and `S0` the state entering the chunk, unrolling
//! the recurrence gives `(I + L) Delta = diag(beta) V - diag(beta exp(G)) K S0`
//! where `L[i][j] = beta_i (k_i . k_j) exp(G_i - G_j)` for `j < i` (the WY / UT
//! representation). One forward substitution against the unit lower
//! triangular `I + L` yields the pseudo-values `U` and the decayed keys `W`,
//! so `Delta = U - W S0`. Then `o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i -
//! G_j) (q_i . k_j) delta_j` (intra-chunk causal attention with a decay mask)
//! and the state passes to the next chunk as `exp(G_last) S0 + sum_j
//! exp(G_last - G_j) k_j delta_j^T`. Every exponent is a difference `G_i - G_j`
//! with `i >= j` (or a `G_i` alone), hence `<= 0`: no `exp(-G)` ever overflows.
//! The state-touching work is matrix products over the whole chunk; only the
//! `C x C` substitution stays sequential.
//!
//! Heads are independent and run in parallel with rayon. The backward
//! (for the trainer) will live beside these forwards in this file.

use rayon::prelude::*;

use crate::{Error, Result};

/// Sizes of one gated-delta call: `t` tokens, `nk` key heads of width `dk`,
/// `nv` value heads of width `dv` (`nv` a multiple of `nk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedDeltaDims {
    pub t: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Default chunk length of the chunked form (as in the reference kernels).
pub const CHUNK: usize = 64;

/// Token-by-token gated delta rule; see the module header.
#[allow(clippy::too_many_arguments)] // the llm.c convention: outputs, state, inputs, sizes
pub fn gated_delta_recurrent_forward(
    out: &mut [f32],
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    let layout = Layout::check(out, state, q, k, v, g, beta, dims)?;
    for_each_head(out, state, dims, |h, s, out_h| {
        recurrent_head(out_h, s, q, k, v, g, beta, &layout, h)
    });
    Ok(())
}

/// Chunked gated delta rule (WY representation, `chunk` tokens per step);
/// computes the same function as [`gated_delta_recurrent_forward`] up to
/// rounding. A final partial chunk is handled; `chunk` must be positive.
#[allow(clippy::too_many_arguments)] // the llm.c convention: outputs, state, inputs, sizes
pub fn gated_delta_chunked_forward(
    out: &mut [f32],
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
    chunk: usize,
) -> Result<()> {
    if chunk == 0 {
        return Err(Error::Shape("gated delta: chunk length must be > 0".into()));
    }
    let layout = Layout::check(out, state, q, k, v, g, beta, dims)?;
    for_each_head(out, state, dims, |h, s, out_h| {
        chunked_head(out_h, s, q, k, v, g, beta, &layout, h, chunk)
    });
    Ok(())
}

/// Validated sizes plus the key-head ratio, shared by both forms.
struct Layout {
    dims: GatedDeltaDims,
    /// Value heads per key head.
    r: usize,
}

impl Layout {
    #[allow(clippy::too_many_arguments)]
    fn check(
        out: &[f32],
        state: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        dims: GatedDeltaDims,
    ) -> Result<Self> {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        if nk == 0 {
            if nv != 0 {
                return Err(Error::Shape(format!(
                    "gated delta: nk = 0 key heads but nv = {nv} value heads"
                )));
            }
        } else if nv % nk != 0 {
            return Err(Error::Shape(format!(
                "gated delta: nv = {nv} value heads is not a multiple of nk = {nk} key heads"
            )));
        }
        let want = |name: &str, got: usize, sizes: &[usize], shape: &str| -> Result<()> {
            let n = sizes
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| Error::Shape(format!("gated delta: {name} {shape} overflows")))?;
            if got != n {
                return Err(Error::Shape(format!(
                    "gated delta: {name} has {got} elements, expected {shape} = {n} ({dims:?})"
                )));
            }
            Ok(())
        };
        want("q", q.len(), &[t, nk, dk], "[t, nk, dk]")?;
        want("k", k.len(), &[t, nk, dk], "[t, nk, dk]")?;
        want("v", v.len(), &[t, nv, dv], "[t, nv, dv]")?;
        want("g", g.len(), &[t, nv], "[t, nv]")?;
        want("beta", beta.len(), &[t, nv], "[t, nv]")?;
        want("out", out.len(), &[t, nv, dv], "[t, nv, dv]")?;
        want("state", state.len(), &[nv, dk, dv], "[nv, dk, dv]")?;
        // nk == 0 (then nv == 0 too) has no heads; 1 just keeps `key_row` total.
        let r = nv.checked_div(nk).unwrap_or(1);
        Ok(Self { dims, r })
    }

    /// Row of `q`/`k` for token `t`, value head `h`.
    #[inline]
    fn key_row<'a>(&self, x: &'a [f32], t: usize, h: usize) -> &'a [f32] {
        let d = &self.dims;
        let off = (t * d.nk + h / self.r) * d.dk;
        &x[off..off + d.dk]
    }

    /// Row of `v` for token `t`, value head `h`.
    #[inline]
    fn value_row<'a>(&self, v: &'a [f32], t: usize, h: usize) -> &'a [f32] {
        let d = &self.dims;
        let off = (t * d.nv + h) * d.dv;
        &v[off..off + d.dv]
    }

    /// Scalar of a `[t, nv]` tensor (`g`, `beta`).
    #[inline]
    fn head_scalar(&self, x: &[f32], t: usize, h: usize) -> f32 {
        x[t * self.dims.nv + h]
    }
}

/// Runs `f(h, state_h, out_h)` for every value head in parallel, where
/// `out_h` is that head's output as a contiguous `[t, dv]` slice. For a single
/// token (decode) the heads' rows of `out` are already contiguous and disjoint,
/// so they are handed out directly and nothing is allocated; for longer inputs
/// each head writes a private buffer that is scattered into `out` afterwards.
fn for_each_head<F>(out: &mut [f32], state: &mut [f32], dims: GatedDeltaDims, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let GatedDeltaDims { t, nv, dk, dv, .. } = dims;
    if nv == 0 || t == 0 {
        return;
    }
    let state_len = dk * dv;
    if state_len == 0 {
        // Degenerate widths: an empty state gives zero outputs, and
        // chunks_mut(0) would panic.
        out.fill(0.0);
        return;
    }
    if t == 1 {
        state
            .par_chunks_mut(state_len)
            .zip(out.par_chunks_mut(dv))
            .enumerate()
            .for_each(|(h, (s, o))| f(h, s, o));
        return;
    }
    let mut per_head = vec![0.0f32; nv * t * dv];
    state
        .par_chunks_mut(state_len)
        .zip(per_head.par_chunks_mut(t * dv))
        .enumerate()
        .for_each(|(h, (s, o))| f(h, s, o));
    out.par_chunks_mut(nv * dv)
        .enumerate()
        .for_each(|(ti, row)| {
            for (h, dst) in row.chunks_mut(dv).enumerate() {
                let src = &per_head[(h * t + ti) * dv..(h * t + ti + 1) * dv];
                dst.copy_from_slice(src);
            }
        });
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y += alpha * x`.
#[inline]
fn axpy(alpha: f32, x: &[f32], y: &mut [f32]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += alpha * xi;
    }
}

/// One value head, token by token. The head's output row doubles as scratch
/// for `S^T k` and then `delta`, so the decode path allocates nothing. Each
/// pass walks `S` row by row (contiguous `dv` inner loops).
#[allow(clippy::too_many_arguments)]
fn recurrent_head(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
) {
    let GatedDeltaDims { t, dv, .. } = layout.dims;
    for ti in 0..t {
        let kt = layout.key_row(k, ti, h);
        let qt = layout.key_row(q, ti, h);
        let vt = layout.value_row(v, ti, h);
        let decay = layout.head_scalar(g, ti, h).exp();
        let b = layout.head_scalar(beta, ti, h);
        let row = &mut out_h[ti * dv..(ti + 1) * dv];

        // row = S_old^T k; the decay is folded in below: (exp(g) S)^T k.
        row.fill(0.0);
        for (ki, s_i) in kt.iter().zip(s.chunks_exact(dv)) {
            axpy(*ki, s_i, row);
        }
        // row = delta = beta (v - exp(g) S_old^T k)
        for (d, vj) in row.iter_mut().zip(vt) {
            *d = b * (vj - decay * *d);
        }
        // S = exp(g) S_old + k delta^T
        for (ki, s_i) in kt.iter().zip(s.chunks_exact_mut(dv)) {
            for (sij, dj) in s_i.iter_mut().zip(row.iter()) {
                *sij = decay * *sij + ki * dj;
            }
        }
        // row = o = S^T q
        row.fill(0.0);
        for (qi, s_i) in qt.iter().zip(s.chunks_exact(dv)) {
            axpy(*qi, s_i, row);
        }
    }
}

/// One value head, a chunk at a time (see the module header for the algebra).
/// Scratch is allocated once per head and reused across chunks.
#[allow(clippy::too_many_arguments)]
fn chunked_head(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
    chunk: usize,
) {
    let GatedDeltaDims { t, dk, dv, .. } = layout.dims;
    let cap = chunk.min(t);
    // cum[i]: cumulative log decay G_i within the chunk.
    let mut cum = vec![0.0f32; cap];
    // lower[i*cap + j], j < i: beta_i (k_i . k_j) exp(G_i - G_j).
    let mut lower = vec![0.0f32; cap * cap];
    // attn[i*cap + j], j <= i: (q_i . k_j) exp(G_i - G_j).
    let mut attn = vec![0.0f32; cap * cap];
    // u: pseudo-values, then delta = u - w S0 in place. [c, dv]
    let mut u = vec![0.0f32; cap * dv];
    // w: A^{-1} diag(beta exp(G)) K. [c, dk]
    let mut w = vec![0.0f32; cap * dk];

    let mut t0 = 0;
    while t0 < t {
        let c = chunk.min(t - t0);
        let mut acc = 0.0f32;
        for (i, gi) in cum[..c].iter_mut().enumerate() {
            acc += layout.head_scalar(g, t0 + i, h);
            *gi = acc;
        }

        for i in 0..c {
            let ki = layout.key_row(k, t0 + i, h);
            let qi = layout.key_row(q, t0 + i, h);
            let bi = layout.head_scalar(beta, t0 + i, h);
            for j in 0..=i {
                let kj = layout.key_row(k, t0 + j, h);
                let decay = (cum[i] - cum[j]).exp();
                attn[i * cap + j] = dot(qi, kj) * decay;
                if j < i {
                    lower[i * cap + j] = bi * dot(ki, kj) * decay;
                }
            }
        }

        // Forward substitution against the unit lower triangular I + L:
        // u_i = beta_i v_i - sum_{j<i} L_ij u_j, w_i likewise from beta_i exp(G_i) k_i.
        for i in 0..c {
            let bi = layout.head_scalar(beta, t0 + i, h);
            let (u_done, u_rest) = u.split_at_mut(i * dv);
            let u_i = &mut u_rest[..dv];
            for (x, vj) in u_i.iter_mut().zip(layout.value_row(v, t0 + i, h)) {
                *x = bi * vj;
            }
            let (w_done, w_rest) = w.split_at_mut(i * dk);
            let w_i = &mut w_rest[..dk];
            let scale = bi * cum[i].exp();
            for (x, kj) in w_i.iter_mut().zip(layout.key_row(k, t0 + i, h)) {
                *x = scale * kj;
            }
            for j in 0..i {
                let l = lower[i * cap + j];
                axpy(-l, &u_done[j * dv..(j + 1) * dv], u_i);
                axpy(-l, &w_done[j * dk..(j + 1) * dk], w_i);
            }
        }

        // delta_i = u_i - S0^T w_i, in place in u.
        for i in 0..c {
            let d_i = &mut u[i * dv..(i + 1) * dv];
            for (wa, s_a) in w[i * dk..(i + 1) * dk].iter().zip(s.chunks_exact(dv)) {
                axpy(-wa, s_a, d_i);
            }
        }

        // o_i = exp(G_i) S0^T q_i + sum_{j<=i} attn_ij delta_j
        for i in 0..c {
            let o = &mut out_h[(t0 + i) * dv..(t0 + i + 1) * dv];
            o.fill(0.0);
            for (qa, s_a) in layout.key_row(q, t0 + i, h).iter().zip(s.chunks_exact(dv)) {
                axpy(*qa, s_a, o);
            }
            let gi = cum[i].exp();
            o.iter_mut().for_each(|x| *x *= gi);
            for j in 0..=i {
                axpy(attn[i * cap + j], &u[j * dv..(j + 1) * dv], o);
            }
        }

        // S = exp(G_last) S0 + sum_j exp(G_last - G_j) k_j delta_j^T
        let g_last = cum[c - 1];
        let total = g_last.exp();
        s.iter_mut().for_each(|x| *x *= total);
        for j in 0..c {
            let kj = layout.key_row(k, t0 + j, h);
            let decay = (g_last - cum[j]).exp();
            let d_j = &u[j * dv..(j + 1) * dv];
            for (ka, s_a) in kj.iter().zip(s.chunks_exact_mut(dv)) {
                axpy(decay * ka, d_j, s_a);
            }
        }

        t0 += c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        state: Vec<f32>,
    }

    fn l2_normalised_rows(rng: &mut StdRng, rows: usize, d: usize, scale: f32) -> Vec<f32> {
        let mut x: Vec<f32> = (0..rows * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        for row in x.chunks_mut(d) {
            let n = (row.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
            row.iter_mut().for_each(|a| *a *= scale / n);
        }
        x
    }

    fn random_inputs(dims: GatedDeltaDims, seed: u64) -> Inputs {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let mut rng = StdRng::seed_from_u64(seed);
        let q = l2_normalised_rows(&mut rng, t * nk, dk, (dk as f32).powf(-0.5));
        let k = l2_normalised_rows(&mut rng, t * nk, dk, 1.0);
        let v = (0..t * nv * dv).map(|_| rng.gen_range(-1.0..1.0)).collect();
        // g = -exp(A_log) * softplus(a + dt_bias), as the model computes it.
        let g = (0..t * nv)
            .map(|_| {
                let a_log: f32 = rng.gen_range(-1.0..0.5);
                let x: f32 = rng.gen_range(-3.0..1.5);
                -a_log.exp() * x.exp().ln_1p()
            })
            .collect();
        let beta = (0..t * nv)
            .map(|_| 1.0 / (1.0 + (-rng.gen_range(-4.0f32..4.0)).exp()))
            .collect();
        let state = (0..nv * dk * dv)
            .map(|_| rng.gen_range(-0.5..0.5))
            .collect();
        Inputs {
            q,
            k,
            v,
            g,
            beta,
            state,
        }
    }

    /// Returns (out, final state).
    fn run(inp: &Inputs, dims: GatedDeltaDims, chunk: Option<usize>) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; dims.t * dims.nv * dims.dv];
        let mut state = inp.state.clone();
        match chunk {
            None => gated_delta_recurrent_forward(
                &mut out, &mut state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, dims,
            ),
            Some(c) => gated_delta_chunked_forward(
                &mut out, &mut state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, dims, c,
            ),
        }
        .unwrap();
        (out, state)
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(
                0.0,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    }

    /// The recurrence written out with explicit indices, one scalar at a time.
    fn naive(inp: &Inputs, dims: GatedDeltaDims) -> (Vec<f32>, Vec<f32>) {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let r = nv / nk;
        let mut out = vec![0.0f32; t * nv * dv];
        let mut state = inp.state.clone();
        for h in 0..nv {
            let kh = h / r;
            let mut s = vec![vec![0.0f32; dv]; dk];
            for (i, row) in s.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = state[(h * dk + i) * dv + j];
                }
            }
            for ti in 0..t {
                let qv = |i: usize| inp.q[(ti * nk + kh) * dk + i];
                let kv = |i: usize| inp.k[(ti * nk + kh) * dk + i];
                let gt = inp.g[ti * nv + h];
                let bt = inp.beta[ti * nv + h];
                for row in s.iter_mut() {
                    for x in row.iter_mut() {
                        *x *= gt.exp();
                    }
                }
                let mut delta = vec![0.0f32; dv];
                for (j, d) in delta.iter_mut().enumerate() {
                    let mut sk = 0.0;
                    for (i, row) in s.iter().enumerate() {
                        sk += row[j] * kv(i);
                    }
                    *d = bt * (inp.v[(ti * nv + h) * dv + j] - sk);
                }
                for (i, row) in s.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += kv(i) * delta[j];
                    }
                }
                for j in 0..dv {
                    let mut o = 0.0;
                    for (i, row) in s.iter().enumerate() {
                        o += row[j] * qv(i);
                    }
                    out[(ti * nv + h) * dv + j] = o;
                }
            }
            for (i, row) in s.iter().enumerate() {
                for (j, x) in row.iter().enumerate() {
                    state[(h * dk + i) * dv + j] = *x;
                }
            }
        }
        (out, state)
    }

    fn dims(t: usize) -> GatedDeltaDims {
        GatedDeltaDims {
            t,
            nk: 2,
            nv: 4,
            dk: 16,
            dv: 8,
        }
    }

    #[test]
    fn recurrent_matches_naive() {
        for (seed, d) in [
            GatedDeltaDims {
                t: 5,
                nk: 1,
                nv: 2,
                dk: 3,
                dv: 4,
            },
            GatedDeltaDims {
                t: 7,
                nk: 2,
                nv: 4,
                dk: 5,
                dv: 3,
            },
            GatedDeltaDims {
                t: 1,
                nk: 3,
                nv: 3,
                dk: 4,
                dv: 2,
            },
        ]
        .into_iter()
        .enumerate()
        {
            let inp = random_inputs(d, 10 + seed as u64);
            let (out, state) = run(&inp, d, None);
            let (want_out, want_state) = naive(&inp, d);
            // The outputs must be non-trivial, or agreement proves nothing.
            assert!(want_out.iter().any(|x| x.abs() > 1e-2), "{d:?}");
            assert!(max_abs_diff(&out, &want_out) <= 1e-6, "out {d:?}");
            assert!(max_abs_diff(&state, &want_state) <= 1e-6, "state {d:?}");
        }
    }

    #[test]
    fn chunked_matches_recurrent() {
        let mut worst = 0.0f32;
        for t in [1, 2, 63, 64, 65, 130, 200] {
            let d = dims(t);
            let inp = random_inputs(d, 1000 + t as u64);
            let (want_out, want_state) = run(&inp, d, None);
            assert!(want_out.iter().any(|x| x.abs() > 1e-2));
            for chunk in [16, CHUNK, 1, 7, 1000] {
                let (out, state) = run(&inp, d, Some(chunk));
                let diff_out = max_abs_diff(&out, &want_out);
                let diff_state = max_abs_diff(&state, &want_state);
                assert!(diff_out <= 1e-5, "t={t} chunk={chunk}: out diff {diff_out}");
                assert!(
                    diff_state <= 1e-5,
                    "t={t} chunk={chunk}: state diff {diff_state}"
                );
                worst = worst.max(diff_out).max(diff_state);
            }
        }
        println!("chunked vs recurrent, max abs diff: {worst:e}");
    }

    #[test]
    fn empty_sequence_keeps_state() {
        let d = dims(0);
        let inp = random_inputs(d, 3);
        for chunk in [None, Some(CHUNK)] {
            let (out, state) = run(&inp, d, chunk);
            assert!(out.is_empty());
            assert_eq!(state, inp.state);
        }
    }

    /// Two halves with the state carried between them equal one run over the
    /// whole sequence, for both forms (and mixing them: chunked prefill, then
    /// recurrent decode).
    #[test]
    fn state_carries_across_calls() {
        let t = 130;
        let split = 77;
        let d = dims(t);
        let inp = random_inputs(d, 42);
        let (want_out, want_state) = run(&inp, d, None);
        let GatedDeltaDims { nk, nv, dk, dv, .. } = d;
        let part = |lo: usize, hi: usize| {
            let mut p = random_inputs(dims(0), 0);
            p.q = inp.q[lo * nk * dk..hi * nk * dk].to_vec();
            p.k = inp.k[lo * nk * dk..hi * nk * dk].to_vec();
            p.v = inp.v[lo * nv * dv..hi * nv * dv].to_vec();
            p.g = inp.g[lo * nv..hi * nv].to_vec();
            p.beta = inp.beta[lo * nv..hi * nv].to_vec();
            p
        };
        for (first, second) in [(None, None), (Some(CHUNK), Some(CHUNK)), (Some(16), None)] {
            let mut a = part(0, split);
            a.state = inp.state.clone();
            let (out_a, state_a) = run(&a, dims(split), first);
            let mut b = part(split, t);
            b.state = state_a;
            let (out_b, state_b) = run(&b, dims(t - split), second);
            let out: Vec<f32> = out_a.into_iter().chain(out_b).collect();
            assert!(
                max_abs_diff(&out, &want_out) <= 1e-5,
                "{first:?} {second:?}"
            );
            assert!(
                max_abs_diff(&state_b, &want_state) <= 1e-5,
                "{first:?} {second:?}"
            );
        }
        // Token-by-token decode with the recurrent form.
        let mut state = inp.state.clone();
        let mut out = Vec::new();
        for ti in 0..t {
            let mut step = part(ti, ti + 1);
            step.state = state;
            let (o, s) = run(&step, dims(1), None);
            out.extend(o);
            state = s;
        }
        assert!(max_abs_diff(&out, &want_out) <= 1e-6);
        assert!(max_abs_diff(&state, &want_state) <= 1e-6);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let d = dims(5);
        let inp = random_inputs(d, 7);
        let n_out = d.t * d.nv * d.dv;
        let call = |out_len: usize,
                    state_drop: usize,
                    which: &str,
                    d: GatedDeltaDims,
                    chunk: Option<usize>| {
            let mut out = vec![0.0; out_len];
            let mut state = inp.state[state_drop..].to_vec();
            let cut = |name: &str, x: &[f32]| -> Vec<f32> {
                if name == which {
                    x[1..].to_vec()
                } else {
                    x.to_vec()
                }
            };
            let (q, k, v) = (cut("q", &inp.q), cut("k", &inp.k), cut("v", &inp.v));
            let (g, beta) = (cut("g", &inp.g), cut("beta", &inp.beta));
            match chunk {
                None => {
                    gated_delta_recurrent_forward(&mut out, &mut state, &q, &k, &v, &g, &beta, d)
                }
                Some(c) => {
                    gated_delta_chunked_forward(&mut out, &mut state, &q, &k, &v, &g, &beta, d, c)
                }
            }
        };
        for chunk in [None, Some(CHUNK)] {
            assert!(call(n_out, 0, "", d, chunk).is_ok());
            assert!(matches!(
                call(n_out - 1, 0, "", d, chunk),
                Err(Error::Shape(_))
            ));
            assert!(matches!(
                call(n_out + 1, 0, "", d, chunk),
                Err(Error::Shape(_))
            ));
            assert!(matches!(call(n_out, 1, "", d, chunk), Err(Error::Shape(_))));
            for which in ["q", "k", "v", "g", "beta"] {
                assert!(
                    matches!(call(n_out, 0, which, d, chunk), Err(Error::Shape(_))),
                    "{which}"
                );
            }
            // Dims that disagree with the buffers, and nv not a multiple of nk.
            let wrong_t = GatedDeltaDims { t: 6, ..d };
            assert!(matches!(
                call(n_out, 0, "", wrong_t, chunk),
                Err(Error::Shape(_))
            ));
            let odd_heads = GatedDeltaDims { nk: 3, ..d };
            assert!(matches!(
                call(n_out, 0, "", odd_heads, chunk),
                Err(Error::Shape(_))
            ));
            let no_key_heads = GatedDeltaDims { nk: 0, ..d };
            assert!(matches!(
                call(n_out, 0, "", no_key_heads, chunk),
                Err(Error::Shape(_))
            ));
            let huge = GatedDeltaDims { t: usize::MAX, ..d };
            assert!(matches!(
                call(n_out, 0, "", huge, chunk),
                Err(Error::Shape(_))
            ));
        }
        assert!(matches!(
            call(n_out, 0, "", d, Some(0)),
            Err(Error::Shape(_))
        ));
    }
}
