//! Matrix multiply for linear layers: `out[n, oc] = inp[n, c] @ weight[oc, c]^T`,
//! the PyTorch `nn.Linear` layout, on the `gemm` crate (multithreaded through
//! rayon). Also a plain `a @ b` for the few places that need it.
//!
//! The backward (`dinp += dout @ weight`, `dweight += dout^T @ inp`,
//! `dbias += sum dout`) sits beside the forward; all three accumulate.

use super::sgemm::{self, Strided};
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

/// Depth of one `gemm` call in [`matmul_forward`]: the crate blocks the
/// reduction dimension itself above 512, with a block size that depends on
/// the row count, so the forward cuts it into 512-deep slices of its own.
const K_SLICE: usize = 512;

/// Fewest rows [`matmul_forward`] hands `gemm` for `oc` output columns.
/// Below it the crate takes other algorithms (one row: a matrix-vector
/// kernel; `rows * oc <= 256`: dot-product kernels) that sum in another
/// order than its blocked microkernel.
fn min_rows(oc: usize) -> usize {
    (256 / oc.max(1) + 1).max(2)
}

/// `out[n, oc] = inp[n, c] @ weight[oc, c]^T (+ bias[oc])`. Overwrites `out`.
///
/// Batch-invariant: a row's result is bit-identical however many rows are
/// computed with it. The engine relies on this (a prefix-cache hit, a
/// preempted sequence, a lone request and a batched one give the same bits)
/// and so does the trainer (its log-probs are the engine's). With AVX-512,
/// or AVX2 and FMA, the product runs on [`sgemm`] (invariant by
/// construction, and the same bits on either); elsewhere on
/// the `gemm` crate, with small products padded with zero rows up to
/// [`min_rows`] and the reduction cut into [`K_SLICE`]-deep slices, so every
/// row goes through the same microkernel with the same summation order.
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
    } else if sgemm::available() {
        let a = Strided {
            data: inp,
            rs: c,
            cs: 1,
        };
        let w = Strided {
            data: weight,
            rs: 1,
            cs: c,
        };
        sgemm::sgemm(n, oc, c, a, w, out, oc, false, true)?;
    } else {
        linear_portable(out, inp, weight, n, c, oc);
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

/// An `nn.Linear` weight `[oc, c]` packed for [`matmul_forward_packed`], or
/// `None` where [`sgemm`] does not run (neither AVX-512 nor AVX2 + FMA):
/// callers then use
/// [`matmul_forward`].
pub fn pack_linear(weight: &[f32], c: usize, oc: usize) -> Result<Option<sgemm::PackedB>> {
    check("weight", weight.len(), oc * c)?;
    if !sgemm::available() {
        return Ok(None);
    }
    let w = Strided {
        data: weight,
        rs: 1,
        cs: c,
    };
    sgemm::PackedB::new(w, c, oc).map(Some)
}

/// [`matmul_forward`] with the weight packed by [`pack_linear`]: the same
/// bits without re-packing the weight on every call.
pub fn matmul_forward_packed(
    out: &mut [f32],
    inp: &[f32],
    weight: &sgemm::PackedB,
    bias: Option<&[f32]>,
    n: usize,
) -> Result<()> {
    let (c, oc) = weight.dims();
    check("out", out.len(), n * oc)?;
    check("inp", inp.len(), n * c)?;
    if let Some(b) = bias {
        check("bias", b.len(), oc)?;
    }
    if n == 0 || oc == 0 {
        return Ok(());
    }
    if c == 0 {
        out.fill(0.0);
    } else {
        let a = Strided {
            data: inp,
            rs: c,
            cs: 1,
        };
        sgemm::sgemm_packed(n, a, weight, out, oc, false, true)?;
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

/// The forward's product where [`sgemm`] does not run, on the `gemm` crate: padded to
/// [`min_rows`] and sliced along the reduction (see [`matmul_forward`]).
fn linear_portable(out: &mut [f32], inp: &[f32], weight: &[f32], n: usize, c: usize, oc: usize) {
    if n < min_rows(oc) {
        let rows = min_rows(oc);
        let mut padded = vec![0.0f32; rows * c];
        padded[..n * c].copy_from_slice(inp);
        let mut wide = vec![0.0f32; rows * oc];
        linear_sliced(&mut wide, &padded, weight, rows, c, oc);
        out.copy_from_slice(&wide[..n * oc]);
    } else {
        linear_sliced(out, inp, weight, n, c, oc);
    }
}

/// `out = inp @ weight^T` as one `gemm` call per [`K_SLICE`] of the
/// reduction, each after the first accumulating. Lengths are the caller's.
fn linear_sliced(out: &mut [f32], inp: &[f32], weight: &[f32], n: usize, c: usize, oc: usize) {
    debug_assert!(out.len() == n * oc && inp.len() == n * c && weight.len() == oc * c);
    let mut k0 = 0;
    while k0 < c {
        let kb = K_SLICE.min(c - k0);
        // SAFETY: the caller checked the lengths; dst is [n, oc] row-major
        // (col stride 1, row stride oc); lhs is columns k0..k0+kb of [n, c]
        // row-major; rhs is rows k0..k0+kb of weight^T, i.e. element
        // (k, j) = weight[j * c + k0 + k]: col stride c, row stride 1.
        unsafe {
            gemm::gemm(
                n,
                oc,
                kb,
                out.as_mut_ptr(),
                1,
                oc as isize,
                k0 > 0,
                inp.as_ptr().add(k0),
                1,
                c as isize,
                weight.as_ptr().add(k0),
                c as isize,
                1,
                1.0f32,
                1.0f32,
                false,
                false,
                false,
                parallelism(n * kb * oc),
            );
        }
        k0 += kb;
    }
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
    if sgemm::available() {
        let (a, b) = (
            Strided {
                data: a,
                rs: k,
                cs: 1,
            },
            Strided {
                data: b,
                rs: n,
                cs: 1,
            },
        );
        return sgemm::sgemm(m, n, k, a, b, out, n, false, true);
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
    if sgemm::available() {
        let dout_v = Strided {
            data: dout,
            rs: oc,
            cs: 1,
        };
        // dinp[n, c] += dout[n, oc] @ weight[oc, c].
        let w = Strided {
            data: weight,
            rs: c,
            cs: 1,
        };
        sgemm::sgemm(n, c, oc, dout_v, w, dinp, c, true, true)?;
        // dweight[oc, c] += dout^T[oc, n] @ inp[n, c].
        let dout_t = Strided {
            data: dout,
            rs: 1,
            cs: oc,
        };
        let x = Strided {
            data: inp,
            rs: c,
            cs: 1,
        };
        return sgemm::sgemm(oc, c, n, dout_t, x, dweight, c, true, true);
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
    fn rows_do_not_depend_on_their_batch() {
        let mut rng = StdRng::seed_from_u64(4);
        // Narrow and wide outputs, reductions below, at and above a slice.
        for &(c, oc) in &[
            (64, 4),
            (256, 32),
            (600, 48),
            (700, 96),
            (1100, 300),
            (96, 1),
        ] {
            let w: Vec<f32> = (0..oc * c).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let big = 150;
            let inp: Vec<f32> = (0..big * c).map(|_| rng.gen_range(-1.0..1.0)).collect();
            // The dispatching forward and the portable path on its own.
            let forward = |o: &mut [f32], x: &[f32], n: usize| {
                matmul_forward(o, x, &w, None, n, c, oc).unwrap()
            };
            let portable = |o: &mut [f32], x: &[f32], n: usize| linear_portable(o, x, &w, n, c, oc);
            type LinearFn<'a> = dyn Fn(&mut [f32], &[f32], usize) + 'a;
            let paths: [(&str, &LinearFn<'_>); 2] =
                [("forward", &forward), ("portable", &portable)];
            for (name, f) in paths {
                let mut all = vec![0.0f32; big * oc];
                f(&mut all, &inp, big);
                for n in [1, 2, 3, 17, 64, 65, 100] {
                    let mut part = vec![0.0f32; n * oc];
                    f(&mut part, &inp[..n * c], n);
                    assert!(
                        part.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{name} c {c} oc {oc}: {n} rows differ from the same rows in a batch of {big}"
                    );
                }
                let want = naive(&inp, &w, big, c, oc);
                for (a, b) in all.iter().zip(&want) {
                    assert!((a - b).abs() < 1e-3, "{name}: {a} vs {b}");
                }
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
