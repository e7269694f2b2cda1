//! Matrix multiply for linear layers: `out[n, oc] = inp[n, c] @ weight[oc, c]^T`,
//! the PyTorch `nn.Linear` layout, on the `gemm` crate (multithreaded through
//! rayon). Also a plain `a @ b` for the few places that need it.
//!
//! The backward (`dinp += dout @ weight`, `dweight += dout^T @ inp`,
//! `dbias += sum dout`) sits beside the forward; all three accumulate.

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

/// Backward of [`matmul_forward`]: `dinp[n, c] += dout[n, oc] @ weight[oc, c]`,
/// `dweight[oc, c] += dout^T @ inp`, `dbias[oc] += sum_n dout`. All three
/// accumulate (the residual stream and parameter gradients).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward(
    dinp: &mut [f32],
    dweight: &mut [f32],
    dbias: Option<&mut [f32]>,
    dout: &[f32],
    inp: &[f32],
    weight: &[f32],
    n: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    check("dinp", dinp.len(), n * c)?;
    check("dweight", dweight.len(), oc * c)?;
    check("dout", dout.len(), n * oc)?;
    check("inp", inp.len(), n * c)?;
    check("weight", weight.len(), oc * c)?;
    if let Some(db) = dbias {
        check("dbias", db.len(), oc)?;
        for row in dout.chunks_exact(oc.max(1)) {
            for (d, g) in db.iter_mut().zip(row) {
                *d += g;
            }
        }
    }
    if n == 0 || c == 0 || oc == 0 {
        return Ok(());
    }
    // SAFETY: lengths checked above. dinp [n, c] row-major; dout [n, oc]
    // row-major; weight [oc, c] row-major. read_dst with alpha 1 accumulates.
    unsafe {
        gemm::gemm(
            n,
            c,
            oc,
            dinp.as_mut_ptr(),
            1,
            c as isize,
            true,
            dout.as_ptr(),
            1,
            oc as isize,
            weight.as_ptr(),
            1,
            c as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(n * c * oc),
        );
    }
    // SAFETY: lengths checked above. dweight [oc, c] row-major; lhs is
    // dout^T: element (i, t) = dout[t * oc + i], col stride oc, row stride 1;
    // rhs is inp [n, c] row-major.
    unsafe {
        gemm::gemm(
            oc,
            c,
            n,
            dweight.as_mut_ptr(),
            1,
            c as isize,
            true,
            dout.as_ptr(),
            oc as isize,
            1,
            inp.as_ptr(),
            1,
            c as isize,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism(n * c * oc),
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

    #[test]
    fn backward_matches_finite_differences_and_accumulates() {
        use crate::cpu::gradcheck::{check as fd, dot64, rand_vec, rng};
        let mut r = rng(3);
        for &(n, c, oc) in &[(1, 1, 1), (3, 5, 7), (9, 70, 66)] {
            let mut inp = rand_vec(&mut r, n * c, 1.0);
            let mut w = rand_vec(&mut r, oc * c, 1.0);
            let mut b = rand_vec(&mut r, oc, 1.0);
            let probe = rand_vec(&mut r, n * oc, 1.0);
            // Pre-filled gradients: the backward must add to them.
            let base = 0.25f32;
            let mut dinp = vec![base; n * c];
            let mut dw = vec![base; oc * c];
            let mut db = vec![base; oc];
            matmul_backward(
                &mut dinp,
                &mut dw,
                Some(&mut db),
                &probe,
                &inp,
                &w,
                n,
                c,
                oc,
            )
            .unwrap();
            for g in dinp.iter_mut().chain(dw.iter_mut()).chain(db.iter_mut()) {
                *g -= base;
            }
            let loss = |i: &[f32], w: &[f32], b: &[f32]| {
                let mut out = vec![0.0; n * oc];
                matmul_forward(&mut out, i, w, Some(b), n, c, oc).unwrap();
                dot64(&out, &probe)
            };
            let (w0, b0, i0) = (w.clone(), b.clone(), inp.clone());
            fd("dinp", &mut inp, &dinp, |x| loss(x, &w0, &b0), 1e-2, 1e-3);
            fd("dweight", &mut w, &dw, |x| loss(&i0, x, &b0), 1e-2, 1e-3);
            fd("dbias", &mut b, &db, |x| loss(&i0, &w0, x), 1e-2, 1e-3);
        }
    }
}
