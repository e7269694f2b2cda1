//! Partial rotary position embedding with the rotate-half pairing, as in
//! Qwen3.5: the first `rot_dim` channels of each head are rotated, pairing
//! channel i with i + rot_dim/2, at frequency `theta^(-2i/rot_dim)`; the rest
//! pass through. Text-only positions make Qwen3.5's multimodal RoPE this plain
//! one.
//!
//! Angles are computed in f32 the way the reference computes them (f32
//! inv_freq, f32 position * inv_freq, f32 cos/sin) so long positions agree to
//! the last bits that matter. Applied in place: the input buffer is not needed
//! afterwards, and the backward is the same rotation with -sin.

use crate::{Error, Result};

/// Inverse frequencies `1 / theta^(2i / rot_dim)` for i in 0..rot_dim/2, in f32.
pub fn rope_inv_freq(rot_dim: usize, theta: f32) -> Vec<f32> {
    (0..rot_dim / 2)
        .map(|i| 1.0 / theta.powf((2 * i) as f32 / rot_dim as f32))
        .collect()
}

/// Rotate `x[n, n_heads, head_dim]` in place; token t sits at `positions[t]`.
pub fn rope_forward(
    x: &mut [f32],
    positions: &[u32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    theta: f32,
) -> Result<()> {
    let n = positions.len();
    if x.len() != n * n_heads * head_dim || rot_dim > head_dim || rot_dim & 1 != 0 {
        return Err(Error::Shape(format!(
            "rope: x has {} elements for {n} tokens x {n_heads} heads x {head_dim}, rot_dim {rot_dim}",
            x.len()
        )));
    }
    let half = rot_dim / 2;
    let inv_freq = rope_inv_freq(rot_dim, theta);
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let angle = pos as f32 * inv_freq[i];
            cos[i] = angle.cos();
            sin[i] = angle.sin();
        }
        let row = &mut x[t * n_heads * head_dim..(t + 1) * n_heads * head_dim];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let a = head[i];
                let b = head[i + half];
                head[i] = a * cos[i] - b * sin[i];
                head[i + half] = b * cos[i] + a * sin[i];
            }
        }
    }
    Ok(())
}

/// Backward of [`rope_forward`], in place on the gradient `dx[n, n_heads,
/// head_dim]` (written): the transpose of a rotation is the rotation by the
/// opposite angle, with cos/sin computed exactly as the forward computes them.
pub fn rope_backward(
    dx: &mut [f32],
    positions: &[u32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    theta: f32,
) -> Result<()> {
    let n = positions.len();
    if dx.len() != n * n_heads * head_dim || rot_dim > head_dim || rot_dim & 1 != 0 {
        return Err(Error::Shape(format!(
            "rope_backward: dx has {} elements for {n} tokens x {n_heads} heads x {head_dim}, rot_dim {rot_dim}",
            dx.len()
        )));
    }
    let half = rot_dim / 2;
    let inv_freq = rope_inv_freq(rot_dim, theta);
    let mut cos = vec![0.0f32; half];
    let mut sin = vec![0.0f32; half];
    for (t, &pos) in positions.iter().enumerate() {
        for i in 0..half {
            let angle = pos as f32 * inv_freq[i];
            cos[i] = angle.cos();
            sin[i] = angle.sin();
        }
        let row = &mut dx[t * n_heads * head_dim..(t + 1) * n_heads * head_dim];
        for head in row.chunks_exact_mut(head_dim) {
            for i in 0..half {
                let a = head[i];
                let b = head[i + half];
                head[i] = a * cos[i] + b * sin[i];
                head[i + half] = b * cos[i] - a * sin[i];
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotates_pairs_and_passes_the_rest() {
        // head_dim 6, rot_dim 4: pairs (0,2), (1,3); channels 4,5 untouched.
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        rope_forward(&mut x, &[3], 1, 6, 4, 10_000.0).unwrap();
        let f0 = 3.0f64;
        let f1 = 3.0f64 / 100.0; // 10000^(-2/4)
        let want = [
            1.0 * f0.cos() - 3.0 * f0.sin(),
            2.0 * f1.cos() - 4.0 * f1.sin(),
            3.0 * f0.cos() + 1.0 * f0.sin(),
            4.0 * f1.cos() + 2.0 * f1.sin(),
            5.0,
            6.0,
        ];
        for i in 0..6 {
            assert!(
                (x[i] as f64 - want[i]).abs() < 1e-5,
                "{i}: {} vs {}",
                x[i],
                want[i]
            );
        }
    }

    #[test]
    fn position_zero_is_identity_and_bad_shapes_error() {
        let mut x = vec![0.5, -1.0, 2.0, 3.0];
        rope_forward(&mut x, &[0], 1, 4, 4, 1e6).unwrap();
        assert_eq!(x, vec![0.5, -1.0, 2.0, 3.0]);
        assert!(rope_forward(&mut x, &[0, 1], 1, 4, 4, 1e6).is_err());
        assert!(rope_forward(&mut x, &[0], 1, 4, 3, 1e6).is_err());
    }

    #[test]
    fn backward_matches_finite_differences() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(51);
        let (n_heads, hd, rot) = (2, 8, 4);
        let pos = [0u32, 5, 17];
        let mut x = rand_vec(&mut r, 3 * n_heads * hd, 1.0);
        let probe = rand_vec(&mut r, x.len(), 1.0);
        let mut dx = probe.clone();
        rope_backward(&mut dx, &pos, n_heads, hd, rot, 100.0).unwrap();
        fd(
            "dx",
            &mut x,
            &dx,
            |v| {
                let mut y = v.to_vec();
                rope_forward(&mut y, &pos, n_heads, hd, rot, 100.0).unwrap();
                dot64(&y, &probe)
            },
            1e-2,
            1e-3,
        );
    }
}
