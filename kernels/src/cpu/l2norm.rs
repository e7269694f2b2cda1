//! L2 normalisation per row: `x * rsqrt(sum(x^2) + eps)` (the Gated DeltaNet
//! normalises q and k per head with eps 1e-6). Saves `rnorm` for the backward.

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
}
