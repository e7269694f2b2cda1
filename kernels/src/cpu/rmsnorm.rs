//! RMSNorm in the Qwen3.5 forms, computed in f32:
//! - `rmsnorm_forward`: `x * rsqrt(mean(x^2) + eps) * (1 + w)` — layer norms,
//!   the final norm, q_norm and k_norm (weights start at 0).
//! - `gated_rmsnorm_forward`: `x * rsqrt(mean(x^2) + eps) * w * silu(z)` — the
//!   Gated DeltaNet output norm (plain w, starts at 1).
//!
//! The forward saves `rstd` per row, which is what the backward needs.

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

fn row_rstd(x: &[f32], eps: f32) -> f32 {
    let ss: f32 = x.iter().map(|v| v * v).sum();
    1.0 / (ss / x.len() as f32 + eps).sqrt()
}

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
    for (((o, x), z), r) in out
        .chunks_exact_mut(c)
        .zip(inp.chunks_exact(c))
        .zip(gate.chunks_exact(c))
        .zip(rstd.iter_mut())
    {
        let s = row_rstd(x, eps);
        *r = s;
        for i in 0..c {
            let zi = z[i];
            let silu = zi / (1.0 + (-zi).exp());
            o[i] = x[i] * s * weight[i] * silu;
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
}
