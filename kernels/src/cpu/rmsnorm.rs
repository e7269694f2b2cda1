//! RMSNorm in the Qwen3.5 forms, computed in f32:
//! - `rmsnorm_forward`: `x * rsqrt(mean(x^2) + eps) * (1 + w)` — layer norms,
//!   the final norm, q_norm and k_norm (weights start at 0).
//! - `gated_rmsnorm_forward`: `x * rsqrt(mean(x^2) + eps) * w * silu(z)` — the
//!   Gated DeltaNet output norm (plain w, starts at 1).
//!
//! The forward saves `rstd` per row, which is what the backward needs.
//! Backward: `rmsnorm_backward` accumulates `dinp` (the residual stream) and
//! `dweight`; `gated_rmsnorm_backward` writes `dinp` and `dgate` and
//! accumulates `dweight`.

use super::activation::silu;
use crate::{Error, Result};

fn check(op: &str, lens: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, got, want) in lens {
        if got != want {
            return Err(Error::Shape(format!(
                "{op}: {name} has {got} elements, expected {want}"
            )));
        }
    }
    Ok(())
}

/// `1 / sqrt(mean(x^2) + eps)`. The sum of squares runs in [`LANES`]
/// interleaved partials, so it vectorises instead of being one long chain
/// of dependent adds (every caller, engine and trainer, uses this one sum).
fn row_rstd(x: &[f32], eps: f32) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a += v * v;
        }
    }
    let mut half = LANES / 2;
    while half > 0 {
        for l in 0..half {
            acc[l] += acc[l + half];
        }
        half /= 2;
    }
    let ss = chunks.remainder().iter().fold(acc[0], |a, v| a + v * v);
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

/// Partial sums of [`row_rstd`]: one AVX-512 register.
const LANES: usize = 16;

/// `out[n, c] = inp * rstd * (1 + weight)`, `rstd[n]` saved.
pub fn rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    check(
        "rmsnorm",
        &[
            ("out", out.len(), n * c),
            ("rstd", rstd.len(), n),
            ("inp", inp.len(), n * c),
            ("weight", weight.len(), c),
        ],
    )?;
    if c == 0 {
        return Ok(());
    }
    super::widest(|| {
        for ((o, x), r) in out
            .chunks_exact_mut(c)
            .zip(inp.chunks_exact(c))
            .zip(rstd.iter_mut())
        {
            let s = row_rstd(x, eps);
            *r = s;
            for ((oo, xx), w) in o.iter_mut().zip(x).zip(weight) {
                *oo = xx * s * (1.0 + w);
            }
        }
    });
    Ok(())
}

/// `out[n, c] = inp * rstd * weight * silu(gate)`, `rstd[n]` saved.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm_forward(
    out: &mut [f32],
    rstd: &mut [f32],
    inp: &[f32],
    gate: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    eps: f32,
) -> Result<()> {
    check(
        "gated_rmsnorm",
        &[
            ("out", out.len(), n * c),
            ("rstd", rstd.len(), n),
            ("inp", inp.len(), n * c),
            ("gate", gate.len(), n * c),
            ("weight", weight.len(), c),
        ],
    )?;
    if c == 0 {
        return Ok(());
    }
    super::widest(|| {
        for (((o, x), z), r) in out
            .chunks_exact_mut(c)
            .zip(inp.chunks_exact(c))
            .zip(gate.chunks_exact(c))
            .zip(rstd.iter_mut())
        {
            let s = row_rstd(x, eps);
            *r = s;
            for i in 0..c {
                o[i] = x[i] * s * weight[i] * silu(z[i]);
            }
        }
    });
    Ok(())
}

/// Backward of [`rmsnorm_forward`] from the saved `rstd`:
/// `dinp += rstd * dy' - inp * rstd^3 / c * sum(dy' * inp)` with
/// `dy' = dout * (1 + weight)`, and `dweight += sum_rows dout * inp * rstd`.
/// Both accumulate (`dinp` is the residual stream for the layer norms).
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) -> Result<()> {
    check(
        "rmsnorm_backward",
        &[
            ("dinp", dinp.len(), n * c),
            ("dweight", dweight.len(), c),
            ("dout", dout.len(), n * c),
            ("inp", inp.len(), n * c),
            ("weight", weight.len(), c),
            ("rstd", rstd.len(), n),
        ],
    )?;
    if c == 0 {
        return Ok(());
    }
    for (((dx, dy), x), &r) in dinp
        .chunks_exact_mut(c)
        .zip(dout.chunks_exact(c))
        .zip(inp.chunks_exact(c))
        .zip(rstd)
    {
        let mut dot = 0.0f32;
        for i in 0..c {
            dot += dy[i] * (1.0 + weight[i]) * x[i];
            dweight[i] += dy[i] * x[i] * r;
        }
        let k = r * r * r * dot / c as f32;
        for i in 0..c {
            dx[i] += r * dy[i] * (1.0 + weight[i]) - x[i] * k;
        }
    }
    Ok(())
}

/// Backward of [`gated_rmsnorm_forward`]: `dinp` and `dgate` are written
/// (`=`), `dweight` accumulates.
#[allow(clippy::too_many_arguments)]
pub fn gated_rmsnorm_backward(
    dinp: &mut [f32],
    dgate: &mut [f32],
    dweight: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    gate: &[f32],
    weight: &[f32],
    rstd: &[f32],
    n: usize,
    c: usize,
) -> Result<()> {
    check(
        "gated_rmsnorm_backward",
        &[
            ("dinp", dinp.len(), n * c),
            ("dgate", dgate.len(), n * c),
            ("dweight", dweight.len(), c),
            ("dout", dout.len(), n * c),
            ("inp", inp.len(), n * c),
            ("gate", gate.len(), n * c),
            ("weight", weight.len(), c),
            ("rstd", rstd.len(), n),
        ],
    )?;
    if c == 0 {
        return Ok(());
    }
    for (row, &r) in rstd.iter().enumerate() {
        let o = row * c;
        let (x, z, dy) = (&inp[o..o + c], &gate[o..o + c], &dout[o..o + c]);
        let mut dot = 0.0f32;
        for i in 0..c {
            let s = 1.0 / (1.0 + (-z[i]).exp());
            let silu = z[i] * s;
            let dsilu = s * (1.0 + z[i] * (1.0 - s));
            let xn = x[i] * r;
            dweight[i] += dy[i] * xn * silu;
            dgate[o + i] = dy[i] * xn * weight[i] * dsilu;
            dot += dy[i] * weight[i] * silu * x[i];
        }
        let k = r * r * r * dot / c as f32;
        for i in 0..c {
            let silu = z[i] / (1.0 + (-z[i]).exp());
            dinp[o + i] = r * dy[i] * weight[i] * silu - x[i] * k;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rmsnorm_uses_one_plus_w() {
        let x = [1.0, -2.0, 3.0, 0.5];
        let w = [0.0, 0.5, -0.5, 1.0];
        let mut out = [0.0; 4];
        let mut rstd = [0.0; 1];
        rmsnorm_forward(&mut out, &mut rstd, &x, &w, 1, 4, 1e-6).unwrap();
        let ms: f64 = x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / 4.0;
        let r = 1.0 / (ms + 1e-6).sqrt();
        for i in 0..4 {
            let want = x[i] as f64 * r * (1.0 + w[i] as f64);
            assert!((out[i] as f64 - want).abs() < 1e-6);
        }
        assert!((rstd[0] as f64 - r).abs() < 1e-6);
    }

    #[test]
    fn gated_rmsnorm_uses_plain_w_and_silu() {
        let x = [1.0, -2.0];
        let z = [0.3, -1.2];
        let w = [1.5, 0.25];
        let mut out = [0.0; 2];
        let mut rstd = [0.0; 1];
        gated_rmsnorm_forward(&mut out, &mut rstd, &x, &z, &w, 1, 2, 1e-6).unwrap();
        let r = 1.0 / ((1.0f64 + 4.0) / 2.0 + 1e-6).sqrt();
        for i in 0..2 {
            let zi = z[i] as f64;
            let want = x[i] as f64 * r * w[i] as f64 * zi / (1.0 + (-zi).exp());
            assert!((out[i] as f64 - want).abs() < 1e-6);
        }
        assert!(gated_rmsnorm_forward(&mut out, &mut rstd, &x, &z[..1], &w, 1, 2, 1e-6).is_err());
    }

    #[test]
    fn rmsnorm_backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(11);
        let (n, c, eps) = (3, 7, 1e-5);
        let mut x = rand_vec(&mut r, n * c, 2.0);
        let mut w = rand_vec(&mut r, c, 0.5);
        let probe = rand_vec(&mut r, n * c, 1.0);
        let mut out = vec![0.0; n * c];
        let mut rstd = vec![0.0; n];
        rmsnorm_forward(&mut out, &mut rstd, &x, &w, n, c, eps).unwrap();
        let mut dx = vec![0.5; n * c];
        let mut dw = vec![0.5; c];
        rmsnorm_backward(&mut dx, &mut dw, &probe, &x, &w, &rstd, n, c).unwrap();
        dx.iter_mut().chain(dw.iter_mut()).for_each(|g| *g -= 0.5);
        let loss = |x: &[f32], w: &[f32]| {
            let mut out = vec![0.0; n * c];
            let mut rs = vec![0.0; n];
            rmsnorm_forward(&mut out, &mut rs, x, w, n, c, eps).unwrap();
            dot64(&out, &probe)
        };
        let (x0, w0) = (x.clone(), w.clone());
        fd("dinp", &mut x, &dx, |v| loss(v, &w0), 1e-2, 2e-3);
        fd("dweight", &mut w, &dw, |v| loss(&x0, v), 1e-2, 2e-3);
    }

    #[test]
    fn gated_rmsnorm_backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(12);
        let (n, c, eps) = (4, 5, 1e-6);
        let mut x = rand_vec(&mut r, n * c, 2.0);
        let mut z = rand_vec(&mut r, n * c, 3.0);
        let mut w = rand_vec(&mut r, c, 1.5);
        let probe = rand_vec(&mut r, n * c, 1.0);
        let mut out = vec![0.0; n * c];
        let mut rstd = vec![0.0; n];
        gated_rmsnorm_forward(&mut out, &mut rstd, &x, &z, &w, n, c, eps).unwrap();
        let (mut dx, mut dz) = (vec![9.0; n * c], vec![9.0; n * c]);
        let mut dw = vec![0.5; c];
        gated_rmsnorm_backward(&mut dx, &mut dz, &mut dw, &probe, &x, &z, &w, &rstd, n, c).unwrap();
        dw.iter_mut().for_each(|g| *g -= 0.5);
        let loss = |x: &[f32], z: &[f32], w: &[f32]| {
            let mut out = vec![0.0; n * c];
            let mut rs = vec![0.0; n];
            gated_rmsnorm_forward(&mut out, &mut rs, x, z, w, n, c, eps).unwrap();
            dot64(&out, &probe)
        };
        let (x0, z0, w0) = (x.clone(), z.clone(), w.clone());
        fd("dinp", &mut x, &dx, |v| loss(v, &z0, &w0), 1e-2, 2e-3);
        fd("dgate", &mut z, &dz, |v| loss(&x0, v, &w0), 1e-2, 2e-3);
        fd("dweight", &mut w, &dw, |v| loss(&x0, &z0, v), 1e-2, 2e-3);
    }
}
