//! Backward of the gated delta rule (`arcticd_kernels::cpu::gated_delta`),
//! exact, in the recurrent form: the chunked forward computes the same
//! function, so one backward serves both.
//!
//! Per value head, token `t`, with `S' = exp(g_t) S_{t-1}`,
//! `delta = beta_t (v_t - S'^T k_t)`, `S_t = S' + k_t delta^T`, `o_t = S_t^T q_t`,
//! walking t backwards with `dS` the gradient of `S_t`:
//!
//! ```text
//! dS     += q_t do_t^T              dq_t = S_t do_t
//! ddelta  = dS^T k_t                dk_t = dS delta
//! dv_t    = beta_t ddelta           dbeta_t = ddelta . (v_t - S'^T k_t)
//! du      = -beta_t ddelta          dS' = dS + k_t du^T,  dk_t += S' du
//! dg_t    = sum(dS' * S')           dS_{t-1} = exp(g_t) dS'
//! ```
//!
//! States are not kept for every token: the backward re-runs the recurrence
//! from states checkpointed every `CHUNK` tokens, so memory is
//! `(T / CHUNK + CHUNK) * dk * dv` per head instead of `T * dk * dv`.
//! Every gradient is written (`=`); q/k gradients of the value heads that
//! share a key head are summed.

use crate::{Error, Result};
use arcticd_kernels::cpu::gated_delta::GatedDeltaDims;
use rayon::prelude::*;

/// Tokens between re-computation checkpoints of the state.
const CHUNK: usize = 64;

/// Gradients of one value head: dq, dk `[t, dk]`, dv `[t, dv]`, dg, dbeta `[t]`,
/// dstate0 `[dk, dv]`.
type HeadGrads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Layouts as in the forward: `q`, `k` `[t, nk, dk]`; `v`, `dout` `[t, nv, dv]`;
/// `g`, `beta` `[t, nv]`; `state0` `[nv, dk, dv]` is the state the forward
/// started from. `dstate0`, when given, receives the initial state's gradient.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dout: &[f32],
    state0: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let (qn, vn, sn) = (t * nk * dkd, t * nv * dvd, nv * dkd * dvd);
    if nk == 0
        || nv % nk != 0
        || dq.len() != qn
        || dk.len() != qn
        || q.len() != qn
        || k.len() != qn
        || dv.len() != vn
        || v.len() != vn
        || dout.len() != vn
        || dg.len() != t * nv
        || dbeta.len() != t * nv
        || g.len() != t * nv
        || beta.len() != t * nv
        || state0.len() != sn
        || dstate0.as_ref().is_some_and(|d| d.len() != sn)
    {
        return Err(Error::Shape(format!(
            "gated_delta_backward: {dims:?} with dq {} dk {} dv {} dg {} dbeta {} dout {} state0 {}",
            dq.len(),
            dk.len(),
            dv.len(),
            dg.len(),
            dbeta.len(),
            dout.len(),
            state0.len()
        )));
    }
    let r = nv / nk;
    let heads: Vec<HeadGrads> = (0..nv)
        .into_par_iter()
        .map(|h| head_backward(h, r, dout, state0, q, k, v, g, beta, dims))
        .collect();
    dq.fill(0.0);
    dk.fill(0.0);
    for (h, (hq, hk, hv, hg, hb, _)) in heads.iter().enumerate() {
        let kh = h / r;
        for ti in 0..t {
            let o = (ti * nk + kh) * dkd;
            for x in 0..dkd {
                dq[o + x] += hq[ti * dkd + x];
                dk[o + x] += hk[ti * dkd + x];
            }
            let ov = (ti * nv + h) * dvd;
            dv[ov..ov + dvd].copy_from_slice(&hv[ti * dvd..(ti + 1) * dvd]);
            dg[ti * nv + h] = hg[ti];
            dbeta[ti * nv + h] = hb[ti];
        }
    }
    if let Some(ds) = dstate0 {
        for (h, head) in heads.iter().enumerate() {
            ds[h * dkd * dvd..(h + 1) * dkd * dvd].copy_from_slice(&head.5);
        }
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn head_backward(
    h: usize,
    r: usize,
    dout: &[f32],
    state0: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> HeadGrads {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let ss = dkd * dvd;
    let kh = h / r;
    let key = |ti: usize| (ti * nk + kh) * dkd..(ti * nk + kh + 1) * dkd;
    let val = |ti: usize| (ti * nv + h) * dvd..(ti * nv + h + 1) * dvd;

    // One recurrence step: s (S_{t-1}) -> S_t, with S' in `sd` and delta out.
    let step = |s_prev: &[f32], s_next: &mut [f32], delta: &mut [f32], ti: usize| {
        let decay = g[ti * nv + h].exp();
        let b = beta[ti * nv + h];
        let kt = &k[key(ti)];
        let vt = &v[val(ti)];
        delta.fill(0.0);
        for a in 0..dkd {
            for c in 0..dvd {
                delta[c] += kt[a] * decay * s_prev[a * dvd + c];
            }
        }
        for c in 0..dvd {
            delta[c] = b * (vt[c] - delta[c]);
        }
        for a in 0..dkd {
            for c in 0..dvd {
                s_next[a * dvd + c] = decay * s_prev[a * dvd + c] + kt[a] * delta[c];
            }
        }
    };

    // Forward pass over the head, keeping the state at every chunk start.
    let n_chunks = t.div_ceil(CHUNK);
    let mut starts = vec![0.0f32; n_chunks.max(1) * ss];
    starts[..ss].copy_from_slice(&state0[h * ss..(h + 1) * ss]);
    let mut cur = state0[h * ss..(h + 1) * ss].to_vec();
    let mut next = vec![0.0f32; ss];
    let mut delta = vec![0.0f32; dvd];
    for ti in 0..t {
        if ti % CHUNK == 0 && ti > 0 {
            starts[(ti / CHUNK) * ss..(ti / CHUNK + 1) * ss].copy_from_slice(&cur);
        }
        step(&cur, &mut next, &mut delta, ti);
        std::mem::swap(&mut cur, &mut next);
    }

    let mut hq = vec![0.0f32; t * dkd];
    let mut hk = vec![0.0f32; t * dkd];
    let mut hv = vec![0.0f32; t * dvd];
    let mut hg = vec![0.0f32; t];
    let mut hb = vec![0.0f32; t];
    let mut ds = vec![0.0f32; ss];
    // states[i] = S before token c0 + i; deltas[i] = delta of that token.
    let mut states = vec![0.0f32; (CHUNK + 1) * ss];
    let mut deltas = vec![0.0f32; CHUNK * dvd];
    let mut sd = vec![0.0f32; ss];
    let mut ddelta = vec![0.0f32; dvd];
    for ci in (0..n_chunks).rev() {
        let c0 = ci * CHUNK;
        let c1 = (c0 + CHUNK).min(t);
        states[..ss].copy_from_slice(&starts[ci * ss..(ci + 1) * ss]);
        for ti in c0..c1 {
            let i = ti - c0;
            let (before, after) = states.split_at_mut((i + 1) * ss);
            step(
                &before[i * ss..],
                &mut after[..ss],
                &mut deltas[i * dvd..(i + 1) * dvd],
                ti,
            );
        }
        for ti in (c0..c1).rev() {
            let i = ti - c0;
            let s_prev = &states[i * ss..(i + 1) * ss];
            let s_t = &states[(i + 1) * ss..(i + 2) * ss];
            let delta = &deltas[i * dvd..(i + 1) * dvd];
            let qt = &q[key(ti)];
            let kt = &k[key(ti)];
            let vt = &v[val(ti)];
            let dot_ = &dout[val(ti)];
            let decay = g[ti * nv + h].exp();
            let b = beta[ti * nv + h];
            let dqt = &mut hq[ti * dkd..(ti + 1) * dkd];
            let dkt = &mut hk[ti * dkd..(ti + 1) * dkd];
            // o_t = S_t^T q_t.
            for a in 0..dkd {
                let row = &s_t[a * dvd..(a + 1) * dvd];
                dqt[a] = row.iter().zip(dot_).map(|(x, y)| x * y).sum();
                let drow = &mut ds[a * dvd..(a + 1) * dvd];
                for c in 0..dvd {
                    drow[c] += qt[a] * dot_[c];
                }
            }
            // S_t = S' + k delta^T.
            ddelta.fill(0.0);
            for a in 0..dkd {
                let drow = &ds[a * dvd..(a + 1) * dvd];
                let mut acc = 0.0f32;
                for c in 0..dvd {
                    ddelta[c] += kt[a] * drow[c];
                    acc += drow[c] * delta[c];
                }
                dkt[a] = acc;
            }
            // delta = beta (v - S'^T k).
            for (x, p) in sd.iter_mut().zip(s_prev) {
                *x = decay * p;
            }
            let mut db = 0.0f32;
            for c in 0..dvd {
                let ksd: f32 = (0..dkd).map(|a| kt[a] * sd[a * dvd + c]).sum();
                hv[ti * dvd + c] = b * ddelta[c];
                db += ddelta[c] * (vt[c] - ksd);
            }
            hb[ti] = db;
            // du = -beta ddelta: dS' = dS + k du^T, dk += S' du.
            let mut dgt = 0.0f32;
            for a in 0..dkd {
                let srow = &sd[a * dvd..(a + 1) * dvd];
                let drow = &mut ds[a * dvd..(a + 1) * dvd];
                let mut acc = 0.0f32;
                for c in 0..dvd {
                    let du = -b * ddelta[c];
                    acc += srow[c] * du;
                    drow[c] += kt[a] * du;
                    dgt += drow[c] * srow[c];
                    drow[c] *= decay;
                }
                dkt[a] += acc;
            }
            hg[ti] = dgt;
        }
    }
    (hq, hk, hv, hg, hb, ds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{fd_check, rand_vec};
    use arcticd_kernels::cpu::gated_delta::{
        gated_delta_chunked_forward, gated_delta_recurrent_forward,
    };
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn l2rows(x: &mut [f32], d: usize) {
        for row in x.chunks_exact_mut(d) {
            let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
            row.iter_mut().for_each(|v| *v /= n);
        }
    }

    #[test]
    fn matches_finite_differences_with_shared_key_heads_and_state() {
        let mut r = StdRng::seed_from_u64(9);
        let dims = GatedDeltaDims {
            t: 7,
            nk: 1,
            nv: 2,
            dk: 3,
            dv: 2,
        };
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let mut q = rand_vec(&mut r, t * nk * dk, 1.0);
        let mut k = rand_vec(&mut r, t * nk * dk, 1.0);
        l2rows(&mut k, dk);
        let mut v = rand_vec(&mut r, t * nv * dv, 1.0);
        let mut g: Vec<f32> = (0..t * nv).map(|_| -r.gen_range(0.05..1.5)).collect();
        let mut beta: Vec<f32> = (0..t * nv).map(|_| r.gen_range(0.1..0.9)).collect();
        let mut s0 = rand_vec(&mut r, nv * dk * dv, 0.5);
        let probe = rand_vec(&mut r, t * nv * dv, 1.0);
        let mut grads = [
            vec![0.0; q.len()],
            vec![0.0; k.len()],
            vec![0.0; v.len()],
            vec![0.0; g.len()],
            vec![0.0; beta.len()],
        ];
        let mut ds0 = vec![0.0; s0.len()];
        let [dq, dkk, dvv, dg, db] = &mut grads;
        gated_delta_backward(
            dq,
            dkk,
            dvv,
            dg,
            db,
            Some(&mut ds0),
            &probe,
            &s0,
            &q,
            &k,
            &v,
            &g,
            &beta,
            dims,
        )
        .unwrap();
        let loss = |q: &[f32], k: &[f32], v: &[f32], g: &[f32], b: &[f32], s: &[f32]| {
            let mut out = vec![0.0; t * nv * dv];
            let mut st = s.to_vec();
            gated_delta_recurrent_forward(&mut out, &mut st, q, k, v, g, b, dims).unwrap();
            out.iter()
                .zip(&probe)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
        };
        let (q0, k0, v0, g0, b0, s00) = (
            q.clone(),
            k.clone(),
            v.clone(),
            g.clone(),
            beta.clone(),
            s0.clone(),
        );
        let tol = 2e-3;
        fd_check(
            "dq",
            &mut q,
            &grads[0],
            |x| loss(x, &k0, &v0, &g0, &b0, &s00),
            1e-2,
            tol,
        );
        fd_check(
            "dk",
            &mut k,
            &grads[1],
            |x| loss(&q0, x, &v0, &g0, &b0, &s00),
            1e-2,
            tol,
        );
        fd_check(
            "dv",
            &mut v,
            &grads[2],
            |x| loss(&q0, &k0, x, &g0, &b0, &s00),
            1e-2,
            tol,
        );
        fd_check(
            "dg",
            &mut g,
            &grads[3],
            |x| loss(&q0, &k0, &v0, x, &b0, &s00),
            1e-2,
            tol,
        );
        fd_check(
            "dbeta",
            &mut beta,
            &grads[4],
            |x| loss(&q0, &k0, &v0, &g0, x, &s00),
            1e-2,
            tol,
        );
        fd_check(
            "dstate0",
            &mut s0,
            &ds0,
            |x| loss(&q0, &k0, &v0, &g0, &b0, x),
            1e-2,
            tol,
        );
    }

    /// Longer than one recompute chunk: the gradient of a linear probe
    /// against the chunked forward, checked on a random direction.
    #[test]
    fn directional_derivative_across_chunks() {
        let mut r = StdRng::seed_from_u64(10);
        let dims = GatedDeltaDims {
            t: 150,
            nk: 2,
            nv: 4,
            dk: 4,
            dv: 3,
        };
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let q = rand_vec(&mut r, t * nk * dk, 1.0);
        let mut k = rand_vec(&mut r, t * nk * dk, 1.0);
        l2rows(&mut k, dk);
        let v = rand_vec(&mut r, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| -r.gen_range(0.01..0.3)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| r.gen_range(0.1..0.9)).collect();
        let s0 = vec![0.0; nv * dk * dv];
        let probe = rand_vec(&mut r, t * nv * dv, 1.0);
        let (mut dq, mut dkk, mut dvv) =
            (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let (mut dg, mut db) = (vec![0.0; g.len()], vec![0.0; beta.len()]);
        gated_delta_backward(
            &mut dq, &mut dkk, &mut dvv, &mut dg, &mut db, None, &probe, &s0, &q, &k, &v, &g,
            &beta, dims,
        )
        .unwrap();
        let dirs: Vec<Vec<f32>> = [q.len(), k.len(), v.len(), g.len(), beta.len()]
            .iter()
            .map(|&n| rand_vec(&mut r, n, 1.0))
            .collect();
        let loss = |eps: f32| {
            let sh = |x: &[f32], d: &[f32]| -> Vec<f32> {
                x.iter().zip(d).map(|(a, b)| a + eps * b).collect()
            };
            let mut out = vec![0.0; t * nv * dv];
            let mut st = s0.clone();
            gated_delta_chunked_forward(
                &mut out,
                &mut st,
                &sh(&q, &dirs[0]),
                &sh(&k, &dirs[1]),
                &sh(&v, &dirs[2]),
                &sh(&g, &dirs[3]),
                &sh(&beta, &dirs[4]),
                dims,
                64,
            )
            .unwrap();
            out.iter()
                .zip(&probe)
                .map(|(a, b)| *a as f64 * *b as f64)
                .sum::<f64>()
        };
        let eps = 1e-3;
        let numeric = (loss(eps) - loss(-eps)) / (2.0 * eps as f64);
        let analytic: f64 = [&dq, &dkk, &dvv, &dg, &db]
            .iter()
            .zip(&dirs)
            .map(|(gr, d)| {
                gr.iter()
                    .zip(d)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            })
            .sum();
        let rel = (numeric - analytic).abs() / analytic.abs().max(1.0);
        assert!(
            rel < 1e-3,
            "analytic {analytic} vs numeric {numeric} (rel {rel:.2e})"
        );
    }
}
