//! Log-softmax over the vocabulary and the log-prob gather that scoring and
//! the policy-gradient loss need: `lp[t] = logits[t, y_t] - logsumexp(logits[t])`.
//! The sum is accumulated in f64: the vocabulary is 248k wide in real models
//! and an f32 sum loses digits that log-prob comparisons care about.
//! Backwards write (`=`) `dlogits`, except `entropy_backward`, which adds to
//! it. `entropy_forward` gives the per-row entropy for entropy bonuses.

use super::activation::exp_poly;
use crate::{Error, Result};
use rayon::prelude::*;

/// Partial sums (and maxima) of [`logsumexp`]: an AVX-512 register of f32.
const LANES: usize = 16;

/// `log sum_i e^{x_i}`, max-subtracted. The exponentials are
/// [`exp_poly`]'s (about 2 ulp in f32, vectorised); their sum is taken in
/// f64, in [`LANES`] interleaved partials. Engine and trainer both call this
/// one function, so their log-probs agree bit for bit. Where the CPU has
/// AVX-512 (or AVX2) the loops run from a copy compiled for it.
fn logsumexp(row: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { logsumexp_avx512(row) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { logsumexp_avx2(row) };
    }
    logsumexp_body(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn logsumexp_avx512(row: &[f32]) -> f32 {
    logsumexp_body(row)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn logsumexp_avx2(row: &[f32]) -> f32 {
    logsumexp_body(row)
}

#[inline(always)]
fn logsumexp_body(row: &[f32]) -> f32 {
    logsumexp_from(row, row_max(row))
}

/// The largest value of `row`, NaNs passed over (`-inf` when there is no
/// other), in [`LANES`] partial maxima.
#[inline(always)]
fn row_max(row: &[f32]) -> f32 {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, b) in m.iter_mut().zip(c) {
            *a = a.max(*b);
        }
    }
    chunks
        .remainder()
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b))
}

/// [`logsumexp`] given the row's [`row_max`].
#[inline(always)]
fn logsumexp_from(row: &[f32], max: f32) -> f32 {
    if !max.is_finite() {
        return max;
    }
    let mut acc = [0.0f64; LANES];
    let mut chunks = row.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, &b) in acc.iter_mut().zip(c) {
            *a += exp_poly(b - max) as f64;
        }
    }
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&x| exp_poly(x - max) as f64)
        .sum();
    let s = acc.iter().sum::<f64>() + tail;
    max + s.ln() as f32
}

/// Index of the largest value (the first on ties), as greedy decoding and
/// reference argmaxes use: what a scan from 0 keeping the first strictly
/// larger value finds, so NaNs are passed over (and a NaN at 0 is kept).
pub fn argmax(row: &[f32]) -> usize {
    super::widest(|| first_max(row, row_max(row)))
}

/// Where `max` (the row's [`row_max`]) first occurs, with [`argmax`]'s rule.
#[inline(always)]
fn first_max(row: &[f32], max: f32) -> usize {
    match row.first() {
        Some(x) if !x.is_nan() => row.iter().position(|&x| x == max).unwrap_or(0),
        _ => 0,
    }
}

/// Greedy decoding's pick from one row of logits: its [`argmax`] and that
/// entry's log-prob `x[i] - logsumexp(x)`, with the bits of
/// [`logprob_gather_forward`] on that index; one pass finds the maximum for
/// both. Errors on an empty row.
pub fn greedy_pick(row: &[f32]) -> Result<(usize, f32)> {
    if row.is_empty() {
        return Err(Error::Shape("greedy pick from an empty row".into()));
    }
    Ok(super::widest(|| {
        let max = row_max(row);
        let i = first_max(row, max);
        (i, row[i] - logsumexp_from(row, max))
    }))
}

/// `out[n, v] = logits - logsumexp(logits)` per row.
pub fn log_softmax_forward(out: &mut [f32], logits: &[f32], n: usize, v: usize) -> Result<()> {
    if out.len() != n * v || logits.len() != n * v {
        return Err(Error::Shape(format!(
            "log_softmax: out {} logits {} for {n} x {v}",
            out.len(),
            logits.len()
        )));
    }
    if v == 0 {
        return Ok(());
    }
    let row = |(o, x): (&mut [f32], &[f32])| {
        let lse = logsumexp(x);
        for (a, b) in o.iter_mut().zip(x) {
            *a = b - lse;
        }
    };
    if n == 1 {
        // One row (a sampler's): not worth handing to the thread pool.
        row((out, logits));
    } else {
        out.par_chunks_mut(v)
            .zip(logits.par_chunks(v))
            .for_each(row);
    }
    Ok(())
}

/// `out[n] = log_softmax(logits[n, v])[targets[n]]`. Also returns nothing else:
/// the backward recomputes softmax from the logits.
pub fn logprob_gather_forward(
    out: &mut [f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) -> Result<()> {
    if out.len() != n || targets.len() != n || logits.len() != n * v {
        return Err(Error::Shape(format!(
            "logprob_gather: out {} targets {} logits {} for {n} x {v}",
            out.len(),
            targets.len(),
            logits.len()
        )));
    }
    if let Some((t, &y)) = targets.iter().enumerate().find(|(_, &y)| y as usize >= v) {
        return Err(Error::Index(format!(
            "target id {y} at row {t} is not below the vocabulary size {v}"
        )));
    }
    if v == 0 {
        return Ok(());
    }
    out.par_iter_mut()
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter())
        .for_each(|((o, x), &y)| {
            *o = x[y as usize] - logsumexp(x);
        });
    Ok(())
}

/// Backward of [`logprob_gather_forward`]: `dlogits[n, v] = dlp[n] *
/// (onehot(targets[n]) - softmax(logits[n]))` (written). The softmax is
/// recomputed from the logits with the same f64 log-sum-exp as the forward,
/// so no `[n, v]` probabilities are kept between the passes.
pub fn logprob_gather_backward(
    dlogits: &mut [f32],
    dlp: &[f32],
    logits: &[f32],
    targets: &[u32],
    n: usize,
    v: usize,
) -> Result<()> {
    if dlogits.len() != n * v || dlp.len() != n || targets.len() != n || logits.len() != n * v {
        return Err(Error::Shape(format!(
            "logprob_gather_backward: dlogits {} dlp {} targets {} logits {} for {n} x {v}",
            dlogits.len(),
            dlp.len(),
            targets.len(),
            logits.len()
        )));
    }
    if let Some((t, &y)) = targets.iter().enumerate().find(|(_, &y)| y as usize >= v) {
        return Err(Error::Index(format!(
            "target id {y} at row {t} is not below the vocabulary size {v}"
        )));
    }
    if v == 0 {
        return Ok(());
    }
    dlogits
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v))
        .zip(targets.par_iter().zip(dlp.par_iter()))
        .for_each(|((d, x), (&y, &g))| {
            let lse = logsumexp(x);
            for (dd, &xx) in d.iter_mut().zip(x) {
                *dd = -g * (xx - lse).exp();
            }
            d[y as usize] += g;
        });
    Ok(())
}

/// Backward of [`log_softmax_forward`] from its output: `dlogits = dout -
/// softmax * sum(dout)` per row (written).
pub fn log_softmax_backward(
    dlogits: &mut [f32],
    dout: &[f32],
    out: &[f32],
    n: usize,
    v: usize,
) -> Result<()> {
    if dlogits.len() != n * v || dout.len() != n * v || out.len() != n * v {
        return Err(Error::Shape(format!(
            "log_softmax_backward: dlogits {} dout {} out {} for {n} x {v}",
            dlogits.len(),
            dout.len(),
            out.len()
        )));
    }
    if v == 0 {
        return Ok(());
    }
    dlogits
        .par_chunks_mut(v)
        .zip(dout.par_chunks(v).zip(out.par_chunks(v)))
        .for_each(|(d, (g, o))| {
            let s: f64 = g.iter().map(|&x| x as f64).sum();
            for i in 0..v {
                d[i] = g[i] - (o[i].exp() as f64 * s) as f32;
            }
        });
    Ok(())
}

/// `out[n] = -sum_j p_j log p_j` with `p = softmax(logits[n])` (the policy's
/// entropy per row, for entropy bonuses), sums in f64.
pub fn entropy_forward(out: &mut [f32], logits: &[f32], n: usize, v: usize) -> Result<()> {
    if out.len() != n || logits.len() != n * v {
        return Err(Error::Shape(format!(
            "entropy: out {} logits {} for {n} x {v}",
            out.len(),
            logits.len()
        )));
    }
    if v == 0 {
        return Ok(());
    }
    out.par_iter_mut()
        .zip(logits.par_chunks(v))
        .for_each(|(o, x)| {
            let lse = logsumexp(x) as f64;
            let h: f64 = x
                .iter()
                .map(|&z| {
                    let lp = z as f64 - lse;
                    -lp.exp() * lp
                })
                .sum();
            *o = h as f32;
        });
    Ok(())
}

/// Backward of [`entropy_forward`]: `dlogits[n, j] += dent[n] * -p_j (log p_j + H_n)`.
/// Accumulates (`+=`), so it adds onto [`logprob_gather_backward`]'s output.
pub fn entropy_backward(
    dlogits: &mut [f32],
    dent: &[f32],
    logits: &[f32],
    n: usize,
    v: usize,
) -> Result<()> {
    if dlogits.len() != n * v || dent.len() != n || logits.len() != n * v {
        return Err(Error::Shape(format!(
            "entropy_backward: dlogits {} dent {} logits {} for {n} x {v}",
            dlogits.len(),
            dent.len(),
            logits.len()
        )));
    }
    if v == 0 {
        return Ok(());
    }
    dlogits
        .par_chunks_mut(v)
        .zip(logits.par_chunks(v).zip(dent.par_iter()))
        .for_each(|(d, (x, &g))| {
            let lse = logsumexp(x) as f64;
            let h: f64 = x
                .iter()
                .map(|&z| {
                    let lp = z as f64 - lse;
                    -lp.exp() * lp
                })
                .sum();
            for (dd, &z) in d.iter_mut().zip(x) {
                let lp = z as f64 - lse;
                *dd += (g as f64 * -lp.exp() * (lp + h)) as f32;
            }
        });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    #[test]
    fn argmax_is_the_first_strictly_larger_scan_and_pick_has_gather_bits() {
        fn scan(x: &[f32]) -> usize {
            let mut best = 0;
            for (i, v) in x.iter().enumerate() {
                if *v > x[best] {
                    best = i;
                }
            }
            best
        }
        let mut rng = StdRng::seed_from_u64(5);
        let special = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0];
        for len in [0, 1, 2, 15, 16, 17, 100, 4096] {
            for _ in 0..50 {
                // Few distinct values, so ties are common; some specials.
                let x: Vec<f32> = (0..len)
                    .map(|_| {
                        if rng.gen_bool(0.05) {
                            special[rng.gen_range(0..special.len())]
                        } else {
                            rng.gen_range(0..8) as f32 + rng.gen_range(0..2) as f32 * 0.5
                        }
                    })
                    .collect();
                assert_eq!(argmax(&x), scan(&x), "{x:?}");
                if len == 0 {
                    assert!(greedy_pick(&x).is_err());
                    continue;
                }
                let (i, lp) = greedy_pick(&x).unwrap();
                assert_eq!(i, scan(&x));
                let mut want = [0.0f32];
                logprob_gather_forward(&mut want, &x, &[i as u32], 1, len).unwrap();
                assert_eq!(lp.to_bits(), want[0].to_bits(), "{x:?}");
            }
        }
    }

    #[test]
    fn gather_matches_log_softmax() {
        let logits = [1.0, 2.0, 3.0, -1.0, 0.0, 1000.0];
        let mut ls = [0.0; 6];
        log_softmax_forward(&mut ls, &logits, 2, 3).unwrap();
        let z: f64 = (1.0f64.exp() + 2.0f64.exp() + 3.0f64.exp()).ln();
        assert!((ls[0] as f64 - (1.0 - z)).abs() < 1e-6);
        let s: f32 = ls[..3].iter().map(|x| x.exp()).sum();
        assert!((s - 1.0).abs() < 1e-6);
        let mut lp = [0.0; 2];
        logprob_gather_forward(&mut lp, &logits, &[2, 1], 2, 3).unwrap();
        assert_eq!(lp[0], ls[2]);
        assert_eq!(lp[1], ls[4]);
        assert!(lp[1] < -900.0);
        assert!(logprob_gather_forward(&mut lp, &logits, &[3, 1], 2, 3).is_err());
    }

    #[test]
    fn backwards_match_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(61);
        let (n, v) = (3, 7);
        let mut x = rand_vec(&mut r, n * v, 3.0);
        let targets = [6u32, 0, 3];
        let probe = rand_vec(&mut r, n, 1.0);
        let mut d = vec![0.0; n * v];
        logprob_gather_backward(&mut d, &probe, &x, &targets, n, v).unwrap();
        let x0 = x.clone();
        fd(
            "gather",
            &mut x,
            &d,
            |l| {
                let mut lp = vec![0.0; n];
                logprob_gather_forward(&mut lp, l, &targets, n, v).unwrap();
                dot64(&lp, &probe)
            },
            1e-2,
            1e-3,
        );
        let probe = rand_vec(&mut r, n * v, 1.0);
        let mut out = vec![0.0; n * v];
        log_softmax_forward(&mut out, &x0, n, v).unwrap();
        log_softmax_backward(&mut d, &probe, &out, n, v).unwrap();
        fd(
            "log_softmax",
            &mut x,
            &d,
            |l| {
                let mut o = vec![0.0; n * v];
                log_softmax_forward(&mut o, l, n, v).unwrap();
                dot64(&o, &probe)
            },
            1e-2,
            1e-3,
        );
    }

    #[test]
    fn entropy_backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(62);
        let (n, v) = (3, 6);
        let mut x = rand_vec(&mut r, n * v, 2.0);
        let probe = rand_vec(&mut r, n, 1.0);
        let mut h = vec![0.0; n];
        let mut d = vec![0.5; n * v];
        entropy_backward(&mut d, &probe, &x, n, v).unwrap();
        d.iter_mut().for_each(|g| *g -= 0.5);
        let mut two = [0.0f32];
        entropy_forward(&mut two, &[0.0, 0.0], 1, 2).unwrap();
        assert!((two[0] - 2.0f32.ln()).abs() < 1e-6);
        fd(
            "entropy",
            &mut x,
            &d,
            |l| {
                entropy_forward(&mut h, l, n, v).unwrap();
                dot64(&h, &probe)
            },
            1e-2,
            1e-3,
        );
    }
}
