//! Pointwise activations: SiLU, SiLU-and-multiply (the MLP's
//! `silu(gate) * up`), and the sigmoid output gate of full attention.

use crate::{Error, Result};

#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

#[inline]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `softplus(x) = log(1 + exp(x))`, with PyTorch's threshold of 20 (linear above).
#[inline]
pub fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// In place `x = silu(x)`.
pub fn silu_forward(x: &mut [f32]) {
    for v in x.iter_mut() {
        *v = silu(*v);
    }
}

/// `out[n, h] = silu(gate[n, h]) * up[n, h]`: the MLP's activation.
pub fn silu_mul_forward(
    out: &mut [f32],
    gate: &[f32],
    up: &[f32],
    n: usize,
    h: usize,
) -> Result<()> {
    if out.len() != n * h || gate.len() != n * h || up.len() != n * h {
        return Err(Error::Shape(format!(
            "silu_mul: out {} / gate {} / up {} for {n} rows of {h}",
            out.len(),
            gate.len(),
            up.len()
        )));
    }
    for ((o, g), u) in out.iter_mut().zip(gate).zip(up) {
        *o = silu(*g) * u;
    }
    Ok(())
}

/// In place `x *= sigmoid(gate)`.
pub fn sigmoid_gate_forward(x: &mut [f32], gate: &[f32]) -> Result<()> {
    if x.len() != gate.len() {
        return Err(Error::Shape(format!(
            "sigmoid_gate: x {} vs gate {}",
            x.len(),
            gate.len()
        )));
    }
    for (v, g) in x.iter_mut().zip(gate) {
        *v *= sigmoid(*g);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silu_mul_and_gate() {
        let mut out = [0.0; 2];
        silu_mul_forward(&mut out, &[1.0, -2.0], &[3.0, 4.0], 1, 2).unwrap();
        assert!((out[0] - 3.0 / (1.0 + (-1.0f32).exp())).abs() < 1e-6);
        assert!((out[1] - 4.0 * -2.0 / (1.0 + 2.0f32.exp())).abs() < 1e-6);
        let mut x = [2.0, 2.0];
        sigmoid_gate_forward(&mut x, &[0.0, 100.0]).unwrap();
        assert_eq!(x, [1.0, 2.0]);
        assert!((softplus(0.0) - 2.0f32.ln()).abs() < 1e-7);
        assert_eq!(softplus(30.0), 30.0);
    }
}
