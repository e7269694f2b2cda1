//! L2 normalisation per row: `x * rsqrt(sum(x^2) + eps)` (the Gated DeltaNet
//! normalises q and k per head with eps 1e-6). Saves `rnorm` for the backward,
//! which writes (`=`) `dinp`.

use crate::{Error, Result};

pub fn l2norm_forward(
    out: &mut [f32],
    rnorm: &mut [f32],
    inp: &[f32],
    n: usize,
    d: usize,
    eps: f32,
) -> Result<()> {
    if out.len() != n * d || inp.len() != n * d || rnorm.len() != n {
        return Err(Error::Shape(format!(
            "l2norm: out {} rnorm {} inp {} for {n} rows of {d}",
            out.len(),
            rnorm.len(),
            inp.len()
        )));
    }
    if d == 0 {
        return Ok(());
    }
    for ((o, x), r) in out
        .chunks_exact_mut(d)
        .zip(inp.chunks_exact(d))
        .zip(rnorm.iter_mut())
    {
        let ss: f32 = x.iter().map(|v| v * v).sum();
        let s = 1.0 / (ss + eps).sqrt();
        *r = s;
        for (oo, xx) in o.iter_mut().zip(x) {
            *oo = xx * s;
        }
    }
    Ok(())
}

/// Backward of [`l2norm_forward`] from the saved `rnorm`:
/// `dinp = rnorm * dout - inp * rnorm^3 * (inp . dout)` per row (written).
pub fn l2norm_backward(
    dinp: &mut [f32],
    dout: &[f32],
    inp: &[f32],
    rnorm: &[f32],
    n: usize,
    d: usize,
) -> Result<()> {
    if dinp.len() != n * d || dout.len() != n * d || inp.len() != n * d || rnorm.len() != n {
        return Err(Error::Shape(format!(
            "l2norm_backward: dinp {} dout {} inp {} rnorm {} for {n} rows of {d}",
            dinp.len(),
            dout.len(),
            inp.len(),
            rnorm.len()
        )));
    }
    if d == 0 {
        return Ok(());
    }
    for (((dx, dy), x), &r) in dinp
        .chunks_exact_mut(d)
        .zip(dout.chunks_exact(d))
        .zip(inp.chunks_exact(d))
        .zip(rnorm)
    {
        let dot: f32 = x.iter().zip(dy).map(|(a, b)| a * b).sum();
        let k = r * r * r * dot;
        for i in 0..d {
            dx[i] = r * dy[i] - x[i] * k;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_norm_rows() {
        let x = [3.0, 4.0, 0.0, 0.0];
        let mut out = [0.0; 4];
        let mut r = [0.0; 2];
        l2norm_forward(&mut out, &mut r, &x, 2, 2, 1e-6).unwrap();
        assert!((out[0] - 0.6).abs() < 1e-6 && (out[1] - 0.8).abs() < 1e-6);
        assert_eq!(&out[2..], &[0.0, 0.0]);
        assert!(l2norm_forward(&mut out, &mut r, &x, 1, 2, 1e-6).is_err());
    }

    #[test]
    fn backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(41);
        let (n, d) = (3, 6);
        let mut x = rand_vec(&mut r, n * d, 1.0);
        let probe = rand_vec(&mut r, n * d, 1.0);
        let mut out = vec![0.0; n * d];
        let mut rn = vec![0.0; n];
        l2norm_forward(&mut out, &mut rn, &x, n, d, 1e-6).unwrap();
        let mut dx = vec![3.0; n * d];
        l2norm_backward(&mut dx, &probe, &x, &rn, n, d).unwrap();
        fd(
            "dinp",
            &mut x,
            &dx,
            |v| {
                let mut o = vec![0.0; n * d];
                let mut rr = vec![0.0; n];
                l2norm_forward(&mut o, &mut rr, v, n, d, 1e-6).unwrap();
                dot64(&o, &probe)
            },
            1e-2,
            2e-3,
        );
    }
}
