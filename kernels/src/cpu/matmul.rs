//! Matrix multiply for linear layers: `out[n, oc] = inp[n, c] @ weight[oc, c]^T`,
//! the PyTorch `nn.Linear` layout, on the `gemm` crate (multithreaded through
//! rayon). Also a plain `a @ b` for the few places that need it.
//!
//! The backward (dinp += dout @ weight, dweight += dout^T @ inp) will sit
//! beside the forward; both accumulate.

use crate::{Error, Result};
use gemm::Parallelism;

fn parallelism(flops: usize) -> Parallelism {
    // Tiny products are faster on one thread than paying rayon's fan-out.
    if flops < 64 * 64 * 64 {
        Parallelism::None
    } else {
        Parallelism::Rayon(0)
    }
}

fn check(name: &str, got: usize, want: usize) -> Result<()> {
    if got != want {
        return Err(Error::Shape(format!(
            "matmul: {name} has {got} elements, expected {want}"
        )));
    }
    Ok(())
}

/// `out[n, oc] = inp[n, c] @ weight[oc, c]^T (+ bias[oc])`. Overwrites `out`.
pub fn matmul_forward(
    out: &mut [f32],
    inp: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    check("out", out.len(), n * oc)?;
    check("inp", inp.len(), n * c)?;
    check("weight", weight.len(), oc * c)?;
    if let Some(b) = bias {
        check("bias", b.len(), oc)?;
    }
    if n == 0 || oc == 0 {
        return Ok(());
    }
    if c == 0 {
        out.fill(0.0);
    } else {
        // SAFETY: the lengths are checked above; dst is [n, oc] row-major
        // (col stride 1, row stride oc); lhs is [n, c] row-major; rhs is
        // weight^T, i.e. element (k, j) = weight[j * c + k]: col stride c,
        // row stride 1.
        unsafe {
            gemm::gemm(
                n,
                oc,
                c,
                out.as_mut_ptr(),
                1,
                oc as isize,
                false,
                inp.as_ptr(),
                1,
                c as isize,
                weight.as_ptr(),
                c as isize,
                1,
                0.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism(n * c * oc),
            );
        }
    }
    if let Some(b) = bias {
        for row in out.chunks_exact_mut(oc) {
            for (o, bb) in row.iter_mut().zip(b) {
                *o += bb;
            }
        }
    }
    Ok(())
}

/// `out[m, n] = a[m, k] @ b[k, n]`, all row-major. Overwrites `out`.
pub fn matmul_nn(
    out: &mut [f32],
    a: &[f32],
    b: &[f32],
    m: usize,
    k: usize,
    n: usize,
) -> Result<()> {
    check("out", out.len(), m * n)?;
    check("a", a.len(), m * k)?;
    check("b", b.len(), k * n)?;
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        out.fill(0.0);
        return Ok(());
    }
    // SAFETY: lengths checked above; all three are row-major.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            out.as_mut_ptr(),
            1,
            n as isize,
            false,
            a.as_ptr(),
            1,
            k as isize,
            b.as_ptr(),
            1,
            n as isize,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(m * k * n),
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn naive(inp: &[f32], w: &[f32], n: usize, c: usize, oc: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n * oc];
        for i in 0..n {
            for j in 0..oc {
                let mut s = 0.0f64;
                for k in 0..c {
                    s += inp[i * c + k] as f64 * w[j * c + k] as f64;
                }
                out[i * oc + j] = s as f32;
            }
        }
        out
    }

    #[test]
    fn linear_matches_naive_at_odd_shapes() {
        let mut rng = StdRng::seed_from_u64(1);
        for &(n, c, oc) in &[(1, 1, 1), (3, 5, 7), (17, 33, 9), (130, 70, 129)] {
            let inp: Vec<f32> = (0..n * c).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let w: Vec<f32> = (0..oc * c).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let bias: Vec<f32> = (0..oc).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut out = vec![f32::NAN; n * oc];
            matmul_forward(&mut out, &inp, &w, Some(&bias), n, c, oc).unwrap();
            let want = naive(&inp, &w, n, c, oc);
            for i in 0..n * oc {
                let expect = want[i] + bias[i % oc];
                assert!(
                    (out[i] - expect).abs() < 1e-4,
                    "{n}x{c}x{oc} at {i}: {} vs {expect}",
                    out[i]
                );
            }
        }
    }

    #[test]
    fn nn_matches_naive() {
        let mut rng = StdRng::seed_from_u64(2);
        let (m, k, n) = (9, 13, 6);
        let a: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
        // b^T in [n, k] layout gives the linear form.
        let mut bt = vec![0.0; n * k];
        for i in 0..k {
            for j in 0..n {
                bt[j * k + i] = b[i * n + j];
            }
        }
        let mut out = vec![0.0; m * n];
        matmul_nn(&mut out, &a, &b, m, k, n).unwrap();
        let want = naive(&a, &bt, m, k, n);
        for i in 0..m * n {
            assert!((out[i] - want[i]).abs() < 1e-5);
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let mut out = vec![0.0; 4];
        assert!(matmul_forward(&mut out, &[0.0; 3], &[0.0; 4], None, 2, 2, 2).is_err());
    }
}
