//! Causal grouped-query attention for one sequence, softmax in f32.
//!
//! Queries are the last `nq` positions of a sequence whose keys/values cover
//! positions `0..nk` (nq == nk for a prefill from scratch, nq == 1 for
//! decode), so query i sits at position `nk - nq + i` and attends keys
//! `0..=nk - nq + i`. Query head h reads key/value head `h / (n_heads /
//! n_kv_heads)`. The sigmoid output gate of Qwen3.5 is applied by the caller
//! with `activation::sigmoid_gate_forward`, which keeps this kernel usable for
//! the paged decode path too.
//!
//! Parallel over query tokens (rayon); each row is independent.

use crate::{Error, Result};
use rayon::prelude::*;

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub nq: usize,
    pub nk: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// `out[nq, n_heads, head_dim]` from `q[nq, n_heads, hd]`, `k, v[nk, n_kv_heads, hd]`.
pub fn attention_forward(
    out: &mut [f32],
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
    if n_kv_heads == 0
        || n_heads % n_kv_heads != 0
        || nq > nk
        || out.len() != nq * n_heads * hd
        || q.len() != nq * n_heads * hd
        || k.len() != nk * n_kv_heads * hd
        || v.len() != nk * n_kv_heads * hd
    {
        return Err(Error::Shape(format!(
            "attention: {dims:?} with out {} q {} k {} v {}",
            out.len(),
            q.len(),
            k.len(),
            v.len()
        )));
    }
    if nq == 0 || hd == 0 || n_heads == 0 {
        return Ok(());
    }
    let group = n_heads / n_kv_heads;
    let row_len = n_heads * hd;
    let kv_row = n_kv_heads * hd;
    out.par_chunks_mut(row_len).enumerate().for_each_init(
        || vec![0.0f32; nk],
        |scores, (i, o)| {
            let last = nk - nq + i; // inclusive
            for h in 0..n_heads {
                let kvh = h / group;
                let qh = &q[i * row_len + h * hd..i * row_len + (h + 1) * hd];
                let mut max = f32::NEG_INFINITY;
                for (j, s) in scores.iter_mut().enumerate().take(last + 1) {
                    let kj = &k[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
                    let dot: f32 = qh.iter().zip(kj).map(|(a, b)| a * b).sum();
                    *s = dot * scale;
                    max = max.max(*s);
                }
                let mut sum = 0.0f32;
                for s in scores.iter_mut().take(last + 1) {
                    *s = (*s - max).exp();
                    sum += *s;
                }
                let inv = 1.0 / sum;
                let oh = &mut o[h * hd..(h + 1) * hd];
                oh.fill(0.0);
                for (j, s) in scores.iter().enumerate().take(last + 1) {
                    let p = s * inv;
                    let vj = &v[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
                    for (a, b) in oh.iter_mut().zip(vj) {
                        *a += p * b;
                    }
                }
            }
        },
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn naive(q: &[f32], k: &[f32], v: &[f32], d: AttnDims, scale: f32) -> Vec<f64> {
        let mut out = vec![0.0f64; d.nq * d.n_heads * d.head_dim];
        let g = d.n_heads / d.n_kv_heads;
        for i in 0..d.nq {
            let pos = d.nk - d.nq + i;
            for h in 0..d.n_heads {
                let kvh = h / g;
                let mut s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        (0..d.head_dim)
                            .map(|x| {
                                q[(i * d.n_heads + h) * d.head_dim + x] as f64
                                    * k[(j * d.n_kv_heads + kvh) * d.head_dim + x] as f64
                            })
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s
                    .iter_mut()
                    .map(|x| {
                        *x = (*x - m).exp();
                        *x
                    })
                    .sum();
                for (j, p) in s.iter().enumerate() {
                    for x in 0..d.head_dim {
                        out[(i * d.n_heads + h) * d.head_dim + x] +=
                            p / z * v[(j * d.n_kv_heads + kvh) * d.head_dim + x] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn gqa_causal_matches_naive_prefill_and_decode() {
        let mut rng = StdRng::seed_from_u64(7);
        for &(nq, nk) in &[(1, 1), (5, 5), (1, 9), (3, 11), (70, 70)] {
            let d = AttnDims {
                nq,
                nk,
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: 5,
            };
            let q: Vec<f32> = (0..nq * 30).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let k: Vec<f32> = (0..nk * 10).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..nk * 10).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mut out = vec![0.0; nq * 30];
            attention_forward(&mut out, &q, &k, &v, d, 0.4).unwrap();
            let want = naive(&q, &k, &v, d, 0.4);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{nq}/{nk}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn rejects_bad_head_counts() {
        let d = AttnDims {
            nq: 1,
            nk: 1,
            n_heads: 3,
            n_kv_heads: 2,
            head_dim: 1,
        };
        let mut out = vec![0.0; 3];
        assert!(attention_forward(&mut out, &[0.0; 3], &[0.0; 2], &[0.0; 2], d, 1.0).is_err());
    }
}
