//! Backward of `arcticd_kernels::cpu::attention::attention_forward`: causal
//! grouped-query attention for one sequence, softmax in f32.
//!
//! The probabilities are recomputed from q and k (nothing `[nq, nk]` is kept
//! from the forward), as FlashAttention's backward does. With `p = softmax(s)`,
//! `s_j = scale q . k_j`, `o = sum_j p_j v_j`: `dv_j += p_j do`,
//! `ds_j = p_j (do . v_j - do . o)`, `dq = scale sum_j ds_j k_j`,
//! `dk_j += scale ds_j q`. All of `dq`, `dk`, `dv` are written (`=`).
//!
//! Parallel over key/value heads: each task owns its kv head's columns of
//! `dk`/`dv` and the query heads of its group.

use crate::{Error, Result};
use arcticd_kernels::cpu::attention::AttnDims;
use rayon::prelude::*;

/// `dq[nq, n_heads, hd]`, `dk, dv[nk, n_kv_heads, hd]` from `dout[nq, n_heads, hd]`.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) -> Result<()> {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let qn = nq * n_heads * hd;
    let kn = nk * n_kv_heads * hd;
    if n_kv_heads == 0
        || n_heads % n_kv_heads != 0
        || nq > nk
        || dq.len() != qn
        || dout.len() != qn
        || q.len() != qn
        || dk.len() != kn
        || dv.len() != kn
        || k.len() != kn
        || v.len() != kn
    {
        return Err(Error::Shape(format!(
            "attention_backward: {dims:?} with dq {} dk {} dv {} dout {} q {} k {} v {}",
            dq.len(),
            dk.len(),
            dv.len(),
            dout.len(),
            q.len(),
            k.len(),
            v.len()
        )));
    }
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    if nq == 0 || hd == 0 || n_heads == 0 {
        return Ok(());
    }
    let group = n_heads / n_kv_heads;
    let row = n_heads * hd;
    let kv_row = n_kv_heads * hd;
    // Per kv head: (dq of its query heads [nq, group, hd], dk [nk, hd], dv [nk, hd]).
    let parts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..n_kv_heads)
        .into_par_iter()
        .map(|kvh| {
            let mut dq_g = vec![0.0f32; nq * group * hd];
            let mut dk_h = vec![0.0f32; nk * hd];
            let mut dv_h = vec![0.0f32; nk * hd];
            let mut p = vec![0.0f32; nk];
            let mut dp = vec![0.0f32; nk];
            let kj = |j: usize| &k[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            let vj = |j: usize| &v[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            for i in 0..nq {
                let last = nk - nq + i;
                for gi in 0..group {
                    let h = kvh * group + gi;
                    let qh = &q[i * row + h * hd..i * row + (h + 1) * hd];
                    let doh = &dout[i * row + h * hd..i * row + (h + 1) * hd];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in p.iter_mut().enumerate().take(last + 1) {
                        *s = dot(qh, kj(j)) * scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0.0f32;
                    for s in p.iter_mut().take(last + 1) {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let inv = 1.0 / sum;
                    let mut d_o = 0.0f32; // do . o = sum_j p_j (do . v_j)
                    for j in 0..=last {
                        p[j] *= inv;
                        dp[j] = dot(doh, vj(j));
                        d_o += p[j] * dp[j];
                    }
                    let dqh = &mut dq_g[(i * group + gi) * hd..(i * group + gi + 1) * hd];
                    for j in 0..=last {
                        let ds = p[j] * (dp[j] - d_o) * scale;
                        let kk = kj(j);
                        let dkj = &mut dk_h[j * hd..(j + 1) * hd];
                        let dvj = &mut dv_h[j * hd..(j + 1) * hd];
                        for x in 0..hd {
                            dqh[x] += ds * kk[x];
                            dkj[x] += ds * qh[x];
                            dvj[x] += p[j] * doh[x];
                        }
                    }
                }
            }
            (dq_g, dk_h, dv_h)
        })
        .collect();
    for (kvh, (dq_g, dk_h, dv_h)) in parts.iter().enumerate() {
        for i in 0..nq {
            for gi in 0..group {
                let h = kvh * group + gi;
                dq[i * row + h * hd..i * row + (h + 1) * hd]
                    .copy_from_slice(&dq_g[(i * group + gi) * hd..(i * group + gi + 1) * hd]);
            }
        }
        for j in 0..nk {
            let dst = j * kv_row + kvh * hd;
            dk[dst..dst + hd].copy_from_slice(&dk_h[j * hd..(j + 1) * hd]);
            dv[dst..dst + hd].copy_from_slice(&dv_h[j * hd..(j + 1) * hd]);
        }
    }
    Ok(())
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::testutil::{fd_check, rand_vec};
    use arcticd_kernels::cpu::attention::attention_forward;
    use rand::{rngs::StdRng, SeedableRng};

    #[test]
    fn matches_finite_differences_prefill_and_suffix() {
        let mut r = StdRng::seed_from_u64(5);
        // (nq, nk): full prefill, and queries that are the tail of a longer run;
        // 20 rows also exercises the forward's blocked path.
        for &(nq, nk) in &[(4, 4), (2, 5), (20, 20)] {
            let dims = AttnDims {
                nq,
                nk,
                n_heads: 4,
                n_kv_heads: 2,
                head_dim: 3,
            };
            let scale = 0.7;
            let mut q = rand_vec(&mut r, nq * 12, 1.0);
            let mut k = rand_vec(&mut r, nk * 6, 1.0);
            let mut v = rand_vec(&mut r, nk * 6, 1.0);
            let probe = rand_vec(&mut r, nq * 12, 1.0);
            let (mut dq, mut dk, mut dv) =
                (vec![1.0; nq * 12], vec![1.0; nk * 6], vec![1.0; nk * 6]);
            attention_backward(&mut dq, &mut dk, &mut dv, &probe, &q, &k, &v, dims, scale).unwrap();
            let loss = |q: &[f32], k: &[f32], v: &[f32]| {
                let mut out = vec![0.0; nq * 12];
                attention_forward(&mut out, q, k, v, dims, scale).unwrap();
                out.iter()
                    .zip(&probe)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            };
            let (q0, k0, v0) = (q.clone(), k.clone(), v.clone());
            fd_check("dq", &mut q, &dq, |x| loss(x, &k0, &v0), 1e-2, 2e-3);
            fd_check("dk", &mut k, &dk, |x| loss(&q0, x, &v0), 1e-2, 2e-3);
            fd_check("dv", &mut v, &dv, |x| loss(&q0, &k0, x), 1e-2, 2e-3);
        }
    }
}
