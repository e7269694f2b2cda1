//! Matrix products on the device through cuBLAS (`cublasGemmEx`), with the
//! CPU product's names, argument order and contracts (`cpu::matmul`):
//! `out[n, oc] = inp[n, c] @ weight[oc, c]^T`, and its backward
//! accumulating into `dinp` and `dweight`.
//!
//! Operands are f32 or bf16 (raw bits, as every bf16 buffer here), the
//! two inputs of one product in the same type, as cuBLAS requires;
//! accumulation is always fp32 (`CUBLAS_COMPUTE_32F`). f32 products never
//! use TF32: cuBLAS takes TF32 only when asked for it (a `_FAST_TF32`
//! compute type, which cudarc's f32 matmul picks by default, or a TF32
//! math mode), and neither is asked for here, so an f32 product keeps
//! f32's 24-bit mantissa.
//!
//! Unlike the CPU product, cuBLAS picks its kernel by shape, so a row's
//! bits may depend on how many rows run with it. A device in batch-
//! invariant mode ([`CudaDevice::set_batch_invariant`]) runs the forward
//! products (`matmul_forward`, `matmul_forward_add`) on its own kernel
//! instead (`matmul.cu`: every output summed over k in order), which gives
//! a row the same bits at any batch size, as the CPU's product does, on
//! the CUDA cores: the engine's deterministic mode.

use super::{int, shape, CudaDevice};
use crate::{Error, Result};
use cudarc::cublas::{result as blas, sys, CudaBlas};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};
use cudarc::driver::{LaunchConfig, PushKernelArg};
use std::ffi::c_void;

/// A product's input, by element type.
#[derive(Clone, Copy)]
pub enum Mat<'a> {
    F32(&'a CudaSlice<f32>),
    /// bf16 as raw bits.
    Bf16(&'a CudaSlice<u16>),
}

/// A product's output, by element type.
pub enum MatMut<'a> {
    F32(&'a mut CudaSlice<f32>),
    /// bf16 as raw bits (rounded to nearest even from the fp32 sum).
    Bf16(&'a mut CudaSlice<u16>),
}

/// `matmul_invariant`'s output tile (matmul.cu): `INVARIANT_TILE` rows by
/// as many output columns per block of 256 threads.
const INVARIANT_TILE: usize = 64;

/// `matmul_invariant`'s blocks for `n` rows and `oc` output columns.
pub(super) fn invariant_launch(n: usize, oc: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            oc.div_ceil(INVARIANT_TILE) as u32,
            n.div_ceil(INVARIANT_TILE) as u32,
            1,
        ),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    }
}

impl Mat<'_> {
    fn len(&self) -> usize {
        match self {
            Mat::F32(s) => s.len(),
            Mat::Bf16(s) => s.len(),
        }
    }

    fn dtype(&self) -> sys::cudaDataType {
        match self {
            Mat::F32(_) => sys::cudaDataType_t::CUDA_R_32F,
            Mat::Bf16(_) => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }

    /// The raw pointer, and the guard that orders the stream's use of it.
    fn device_ptr<'s>(self, stream: &'s CudaStream) -> (u64, SyncOnDrop<'s>)
    where
        Self: 's,
    {
        match self {
            Mat::F32(s) => s.device_ptr(stream),
            Mat::Bf16(s) => s.device_ptr(stream),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Mat::F32(_) => "f32",
            Mat::Bf16(_) => "bf16",
        }
    }
}

impl MatMut<'_> {
    fn len(&self) -> usize {
        match self {
            MatMut::F32(s) => s.len(),
            MatMut::Bf16(s) => s.len(),
        }
    }

    fn dtype(&self) -> sys::cudaDataType {
        match self {
            MatMut::F32(_) => sys::cudaDataType_t::CUDA_R_32F,
            MatMut::Bf16(_) => sys::cudaDataType_t::CUDA_R_16BF,
        }
    }
}

/// Whether the cuBLAS library can be loaded (checked before the first
/// call: cudarc panics on a missing library).
pub fn cublas_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { sys::is_culib_present() }
}

/// The cuBLAS handle of a device, on the device's stream.
pub(super) fn new_blas(dev: &CudaDevice) -> Result<CudaBlas> {
    if !cublas_available() {
        return Err(Error::NoDevice(format!(
            "cuda:{} (the cuBLAS library libcublas.so is not on the loader path)",
            dev.ordinal
        )));
    }
    CudaBlas::new(dev.stream.clone()).map_err(|source| Error::Blas {
        op: "creating the cuBLAS handle".into(),
        source,
    })
}

/// One row-major product `c[m, n] = alpha * a @ b + beta * c`, `a` stored
/// `[m, k]` (or `[k, m]` with `a_t`), `b` stored `[k, n]` (or `[n, k]`
/// with `b_t`).
struct Gemm {
    m: usize,
    n: usize,
    k: usize,
    a_t: bool,
    b_t: bool,
    beta: f32,
}

impl CudaDevice {
    fn blas(&self) -> Result<&CudaBlas> {
        if let Some(b) = self.blas.get() {
            return Ok(b);
        }
        let b = new_blas(self)?;
        Ok(self.blas.get_or_init(|| b))
    }

    fn gemm(&self, op: &str, g: Gemm, c: MatMut<'_>, a: Mat<'_>, b: Mat<'_>) -> Result<()> {
        let Gemm {
            m,
            n,
            k,
            a_t,
            b_t,
            beta,
        } = g;
        shape(
            op,
            &[
                ("a", a.len(), m * k),
                ("b", b.len(), k * n),
                ("out", c.len(), m * n),
            ],
        )?;
        if a.dtype() != b.dtype() {
            return Err(Error::Shape(format!(
                "{op}: inputs of one product must share a type, got {} and {}",
                a.name(),
                b.name()
            )));
        }
        if m == 0 || n == 0 {
            return Ok(());
        }
        let (mi, ni, ki) = (int(op, "m", m)?, int(op, "n", n)?, int(op, "k", k)?);
        // Column-major cuBLAS sees every row-major matrix transposed:
        // c^T[n, m] = op(b)^T[n, k] @ op(a)^T[k, m], so b goes first.
        let trans = |t: bool| {
            if t {
                sys::cublasOperation_t::CUBLAS_OP_T
            } else {
                sys::cublasOperation_t::CUBLAS_OP_N
            }
        };
        let ldb = if b_t { ki } else { ni };
        let lda = if a_t { mi } else { ki };
        let blas = self.blas()?;
        let (alpha, beta) = (1.0f32, beta);
        let stream = &self.stream;
        let (bp, _rb) = b.device_ptr(stream);
        let (ap, _ra) = a.device_ptr(stream);
        let c_type = c.dtype();
        let (cp, _rc) = match c {
            MatMut::F32(s) => s.device_ptr_mut(stream),
            MatMut::Bf16(s) => s.device_ptr_mut(stream),
        };
        // SAFETY: the three buffers hold m*k, k*n and m*n elements of the
        // types named (checked above), the leading dimensions are those of
        // the row-major layouts, and alpha/beta are f32 host values as the
        // fp32 compute type reads them.
        unsafe {
            blas::gemm_ex(
                *blas.handle(),
                trans(b_t),
                trans(a_t),
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const c_void,
                bp as *const c_void,
                b.dtype(),
                ldb,
                ap as *const c_void,
                a.dtype(),
                lda,
                (&beta) as *const f32 as *const c_void,
                cp as *mut c_void,
                c_type,
                ni,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|source| Error::Blas {
            op: op.into(),
            source,
        })
    }

    /// `out[n, oc] = inp[n, c] @ weight[oc, c]^T`, overwriting `out`: the
    /// linear layer (no bias: Qwen3.5 has none). `inp` and `weight` both
    /// f32 or both bf16; `out` f32 or bf16; fp32 accumulation.
    pub fn matmul_forward(
        &self,
        out: MatMut<'_>,
        inp: Mat<'_>,
        weight: Mat<'_>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        self.matmul_into(out, inp, weight, n, c, oc, false)
    }

    /// [`matmul_forward`](Self::matmul_forward) added to `out` (`out +=`):
    /// a projection back into the residual stream in one pass.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_forward_add(
        &self,
        out: &mut CudaSlice<f32>,
        inp: Mat<'_>,
        weight: Mat<'_>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        self.matmul_into(MatMut::F32(out), inp, weight, n, c, oc, true)
    }

    #[allow(clippy::too_many_arguments)]
    fn matmul_into(
        &self,
        out: MatMut<'_>,
        inp: Mat<'_>,
        weight: Mat<'_>,
        n: usize,
        c: usize,
        oc: usize,
        add: bool,
    ) -> Result<()> {
        if self.is_batch_invariant() {
            return self.matmul_invariant(out, inp, weight, (n, c, oc), add);
        }
        let g = Gemm {
            m: n,
            n: oc,
            k: c,
            a_t: false,
            b_t: true,
            beta: if add { 1.0 } else { 0.0 },
        };
        self.gemm("matmul_forward", g, out, inp, weight)
    }

    /// Backward of [`matmul_forward`](Self::matmul_forward) in f32, as
    /// `cpu::matmul::matmul_backward`: `dinp[n, c] += dout @ weight` and
    /// `dweight[oc, c] += dout^T @ inp`, both accumulating.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_backward(
        &self,
        dinp: &mut CudaSlice<f32>,
        dweight: &mut CudaSlice<f32>,
        dout: &CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        let dinp_g = Gemm {
            m: n,
            n: c,
            k: oc,
            a_t: false,
            b_t: false,
            beta: 1.0,
        };
        self.gemm(
            "matmul_backward dinp",
            dinp_g,
            MatMut::F32(dinp),
            Mat::F32(dout),
            Mat::F32(weight),
        )?;
        let dw_g = Gemm {
            m: oc,
            n: c,
            k: n,
            a_t: true,
            b_t: false,
            beta: 1.0,
        };
        self.gemm(
            "matmul_backward dweight",
            dw_g,
            MatMut::F32(dweight),
            Mat::F32(dout),
            Mat::F32(inp),
        )
    }

    /// `out[n, oc] (+)= inp[n, c] @ weight[oc, c]^T` on `matmul_invariant`:
    /// each output summed over k in order, the same bits for a row at any
    /// `n`. Inputs f32 or bf16 (they may differ), output f32 or bf16; `add`
    /// only into f32.
    pub fn matmul_invariant(
        &self,
        out: MatMut<'_>,
        inp: Mat<'_>,
        weight: Mat<'_>,
        (n, c, oc): (usize, usize, usize),
        add: bool,
    ) -> Result<()> {
        let op = "matmul_invariant";
        shape(
            op,
            &[
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), oc * c),
                ("out", out.len(), n * oc),
            ],
        )?;
        let out_bf16 = matches!(out, MatMut::Bf16(_));
        if add && out_bf16 {
            return Err(Error::Shape(format!("{op}: an added output must be f32")));
        }
        if n == 0 || oc == 0 {
            return Ok(());
        }
        if n.div_ceil(INVARIANT_TILE) > 65_535 {
            return Err(Error::Shape(format!("{op}: {n} rows exceed one launch")));
        }
        let cfg = invariant_launch(n, oc);
        let ints = [n, c, oc]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let flags = [
            matches!(inp, Mat::Bf16(_)) as i32,
            matches!(weight, Mat::Bf16(_)) as i32,
            out_bf16 as i32,
            add as i32,
        ];
        let stream = &self.stream;
        let (ip, _ri) = inp.device_ptr(stream);
        let (wp, _rw) = weight.device_ptr(stream);
        let (opt, _ro) = match out {
            MatMut::F32(s) => s.device_ptr_mut(stream),
            MatMut::Bf16(s) => s.device_ptr_mut(stream),
        };
        let mut b = stream.launch_builder(self.func(op)?);
        b.arg(&opt).arg(&ip).arg(&wp);
        for x in &ints {
            b.arg(x);
        }
        for f in &flags {
            b.arg(f);
        }
        // SAFETY: the three buffers hold n*c, oc*c and n*oc elements of
        // the types the flags name (checked above), in the kernel's order.
        unsafe { b.launch(cfg) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{gpu, rand_vec};
    use super::*;
    use crate::cpu;
    use rand::SeedableRng;

    fn bf16_bits(x: &[f32]) -> Vec<u16> {
        x.iter()
            .map(|&v| half::bf16::from_f32(v).to_bits())
            .collect()
    }

    fn widen(b: &[u16]) -> Vec<f32> {
        b.iter()
            .map(|&v| half::bf16::from_bits(v).to_f32())
            .collect()
    }

    /// `got` against `want` within `tol` of the sum of |terms| of each
    /// output (`scale[i]`): the bound of a reordered fp32 sum.
    fn close_sum(name: &str, got: &[f32], want: &[f32], scale: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, ((a, b), s)) in got.iter().zip(want).zip(scale).enumerate() {
            assert!(
                (a - b).abs() <= tol * (s + 1e-30),
                "{name}[{i}]: cuda {a} cpu {b} (sum of |terms| {s})"
            );
        }
    }

    /// Sum of |inp| |weight| terms of each output of the forward.
    fn abs_forward(inp: &[f32], w: &[f32], n: usize, c: usize, oc: usize) -> Vec<f32> {
        let (a, b): (Vec<f32>, Vec<f32>) = (
            inp.iter().map(|x| x.abs()).collect(),
            w.iter().map(|x| x.abs()).collect(),
        );
        let mut out = vec![0.0; n * oc];
        cpu::matmul::matmul_forward(&mut out, &a, &b, None, n, c, oc).unwrap();
        out
    }

    /// f32 and bf16 products at odd shapes against the CPU product (of the
    /// same bf16-rounded values): an fp32 sum in another order, so within
    /// 1e-5 of each output's sum of |terms| (TF32 would miss it by ~100x).
    /// Both ways: cuBLAS, and the batch-invariant kernel.
    #[test]
    fn matmul_forward_matches_cpu_f32_and_bf16() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        for (invariant, (n, c, oc)) in [false, true].into_iter().flat_map(|inv| {
            [(1, 7, 5), (3, 129, 33), (67, 1000, 250), (2, 4096, 17)].map(|s| (inv, s))
        }) {
            d.set_batch_invariant(invariant);
            let inp = rand_vec(&mut rng, n * c, 1.0);
            let w = rand_vec(&mut rng, oc * c, 0.1);
            let mut want = vec![0.0; n * oc];
            cpu::matmul::matmul_forward(&mut want, &inp, &w, None, n, c, oc).unwrap();
            let scale = abs_forward(&inp, &w, n, c, oc);
            let (di, dw) = (d.upload(&inp).unwrap(), d.upload(&w).unwrap());
            let mut out = d.zeros::<f32>(n * oc).unwrap();
            d.matmul_forward(
                MatMut::F32(&mut out),
                Mat::F32(&di),
                Mat::F32(&dw),
                n,
                c,
                oc,
            )
            .unwrap();
            close_sum("f32", &d.download(&out).unwrap(), &want, &scale, 1e-5);
            // out += the same product.
            d.matmul_forward_add(&mut out, Mat::F32(&di), Mat::F32(&dw), n, c, oc)
                .unwrap();
            let twice: Vec<f32> = want.iter().map(|x| 2.0 * x).collect();
            let scale2: Vec<f32> = scale.iter().map(|x| 2.0 * x).collect();
            close_sum("f32 add", &d.download(&out).unwrap(), &twice, &scale2, 1e-5);

            let (ib, wb) = (bf16_bits(&inp), bf16_bits(&w));
            let (iw, ww) = (widen(&ib), widen(&wb));
            cpu::matmul::matmul_forward(&mut want, &iw, &ww, None, n, c, oc).unwrap();
            let scale = abs_forward(&iw, &ww, n, c, oc);
            let (dib, dwb) = (d.upload(&ib).unwrap(), d.upload(&wb).unwrap());
            d.matmul_forward(
                MatMut::F32(&mut out),
                Mat::Bf16(&dib),
                Mat::Bf16(&dwb),
                n,
                c,
                oc,
            )
            .unwrap();
            close_sum("bf16", &d.download(&out).unwrap(), &want, &scale, 1e-5);
            // bf16 out: the fp32 sum rounded once more.
            let mut outb = d.zeros::<u16>(n * oc).unwrap();
            d.matmul_forward(
                MatMut::Bf16(&mut outb),
                Mat::Bf16(&dib),
                Mat::Bf16(&dwb),
                n,
                c,
                oc,
            )
            .unwrap();
            let got = widen(&d.download(&outb).unwrap());
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!(
                    (g - w).abs() <= 2f32.powi(-8) * w.abs() + 1e-5 * scale[i],
                    "bf16 out[{i}]: {g} vs {w}"
                );
            }
        }
    }

    /// In batch-invariant mode a row's product has the same bits alone,
    /// in a batch, at any place in its tile, with bf16 or f32 operands.
    #[test]
    fn batch_invariant_rows_keep_their_bits() {
        let Some(d) = gpu() else { return };
        d.set_batch_invariant(true);
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let (big, c, oc) = (150, 1000, 333);
        let inp = rand_vec(&mut rng, big * c, 1.0);
        let w = rand_vec(&mut rng, oc * c, 0.1);
        let (ib, wb) = (
            d.upload(&bf16_bits(&inp)).unwrap(),
            d.upload(&bf16_bits(&w)).unwrap(),
        );
        let (inf, wf) = (d.upload(&inp).unwrap(), d.upload(&w).unwrap());
        for (name, i_all, wt) in [
            ("bf16", Mat::Bf16(&ib), Mat::Bf16(&wb)),
            ("f32", Mat::F32(&inf), Mat::F32(&wf)),
        ] {
            let mut all = d.zeros::<f32>(big * oc).unwrap();
            d.matmul_forward(MatMut::F32(&mut all), i_all, wt, big, c, oc)
                .unwrap();
            let all = d.download(&all).unwrap();
            // Rows first..first + n run on their own.
            for (first, n) in [(0, 1), (0, 5), (13, 1), (63, 2), (70, 64), (149, 1)] {
                let part = match i_all {
                    Mat::Bf16(_) => {
                        let b = bf16_bits(&inp[first * c..(first + n) * c]);
                        let x = d.upload(&b).unwrap();
                        let mut o = d.zeros::<f32>(n * oc).unwrap();
                        d.matmul_forward(MatMut::F32(&mut o), Mat::Bf16(&x), wt, n, c, oc)
                            .unwrap();
                        d.download(&o).unwrap()
                    }
                    Mat::F32(_) => {
                        let x = d.upload(&inp[first * c..(first + n) * c]).unwrap();
                        let mut o = d.zeros::<f32>(n * oc).unwrap();
                        d.matmul_forward(MatMut::F32(&mut o), Mat::F32(&x), wt, n, c, oc)
                            .unwrap();
                        d.download(&o).unwrap()
                    }
                };
                assert_eq!(
                    part[..],
                    all[first * oc..(first + n) * oc],
                    "{name}: rows {first}..{}",
                    first + n
                );
            }
        }
    }

    #[test]
    fn matmul_backward_matches_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        for (n, c, oc) in [(1, 9, 4), (37, 130, 65), (300, 64, 513)] {
            let inp = rand_vec(&mut rng, n * c, 1.0);
            let w = rand_vec(&mut rng, oc * c, 0.2);
            let dout = rand_vec(&mut rng, n * oc, 1.0);
            let dinp0 = rand_vec(&mut rng, n * c, 1.0);
            let dw0 = rand_vec(&mut rng, oc * c, 1.0);
            let (mut dinp, mut dw) = (dinp0.clone(), dw0.clone());
            cpu::matmul::matmul_backward(&mut dinp, &mut dw, None, &dout, &inp, &w, n, c, oc)
                .unwrap();
            // Bounds: each output's sum of |terms| plus the value it started from.
            let abs = |x: &[f32]| x.iter().map(|v| v.abs()).collect::<Vec<f32>>();
            let (mut si, mut sw) = (abs(&dinp0), abs(&dw0));
            cpu::matmul::matmul_backward(
                &mut si,
                &mut sw,
                None,
                &abs(&dout),
                &abs(&inp),
                &abs(&w),
                n,
                c,
                oc,
            )
            .unwrap();
            let (mut ddi, mut ddw) = (d.upload(&dinp0).unwrap(), d.upload(&dw0).unwrap());
            let (ddo, di, dwt) = (
                d.upload(&dout).unwrap(),
                d.upload(&inp).unwrap(),
                d.upload(&w).unwrap(),
            );
            d.matmul_backward(&mut ddi, &mut ddw, &ddo, &di, &dwt, n, c, oc)
                .unwrap();
            close_sum("dinp", &d.download(&ddi).unwrap(), &dinp, &si, 1e-5);
            close_sum("dweight", &d.download(&ddw).unwrap(), &dw, &sw, 1e-5);
        }
    }

    #[test]
    fn matmul_shapes_and_types_are_checked() {
        let Some(d) = gpu() else { return };
        let (a, wb) = (d.zeros::<f32>(6).unwrap(), d.zeros::<u16>(6).unwrap());
        let mut out = d.zeros::<f32>(4).unwrap();
        let e = d
            .matmul_forward(MatMut::F32(&mut out), Mat::F32(&a), Mat::Bf16(&wb), 2, 3, 2)
            .unwrap_err();
        assert!(e.to_string().contains("share a type"), "{e}");
        let e = d
            .matmul_forward(MatMut::F32(&mut out), Mat::F32(&a), Mat::F32(&a), 2, 3, 3)
            .unwrap_err();
        assert!(e.to_string().contains("expected"), "{e}");
    }
}
