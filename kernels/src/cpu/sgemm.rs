//! Single-precision matrix product on AVX-512, or on AVX2 with FMA:
//! `C[m, n] (+)= A[m, k] B[k, n]` with A and B read through any strides and
//! C row-major.
//!
//! Every element of C is one chain of fused multiply-adds over `k` in
//! order, starting from zero (or from C's value when accumulating). Blocking,
//! packing, tile edges and threads never change that chain, so a row's
//! result is bit-identical however many other rows are computed with it
//! (the batch invariance the engine and the trainer rely on, by
//! construction rather than by steering another library's choices).
//!
//! Layout follows the usual packed-panel scheme: B is packed per
//! `KC x NC` block into `NR`-column panels (`[panel][p][NR]`), A per `MC x
//! KC` block into `MR`-row panels (`[panel][p][MR]`), zero-padded at the
//! edges; a `MR x NR` microkernel keeps its tile in 24 zmm registers (on
//! AVX2, a quarter of the tile's columns at a time in 12 ymm registers).
//! The threads split a block's row blocks and column panels; each owns the
//! C tiles it writes.
//!
//! Both instruction sets run the same chain per element (a fused
//! multiply-add is exactly rounded whatever the vector width), so a
//! product's bits do not depend on which one the CPU has.
//!
//! Not for: machines with neither ([`available`] says so and callers fall
//! back to the `gemm` crate, see `matmul.rs`), or anything but f32.

use crate::{Error, Result};
use rayon::prelude::*;

/// Rows of the microkernel's tile.
const MR: usize = 12;
/// Columns of the microkernel's tile (two 16-lane registers).
const NR: usize = 32;
/// Depth of a packed block: a B panel (`KC x NR`) is 32 KiB and stays in L1.
const KC: usize = 256;
/// Rows of a packed A block (a multiple of MR; 120 KiB at KC).
const MC: usize = 120;
/// Columns of a packed B block (a multiple of NR; 1 MiB at KC).
const NC: usize = 1024;
/// Products below this many multiply-adds run on one thread.
const PARALLEL_MIN: usize = 1 << 18;

/// A read-only matrix: element `(i, j)` is `data[i * rs + j * cs]`.
#[derive(Clone, Copy, Debug)]
pub struct Strided<'a> {
    pub data: &'a [f32],
    pub rs: usize,
    pub cs: usize,
}

/// The vector instructions the microkernel runs on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Isa {
    Avx512,
    Avx2,
}

/// The best [`Isa`] this CPU has, if any.
fn isa() -> Option<Isa> {
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma");
        #[cfg(test)]
        if avx2 && tests::FORCE_AVX2.load(std::sync::atomic::Ordering::Relaxed) {
            return Some(Isa::Avx2);
        }
        if std::arch::is_x86_feature_detected!("avx512f") {
            Some(Isa::Avx512)
        } else if avx2 {
            Some(Isa::Avx2)
        } else {
            None
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        None
    }
}

/// Whether this CPU runs [`sgemm`] (AVX-512, or AVX2 with FMA).
pub fn available() -> bool {
    isa().is_some()
}

fn unavailable() -> Error {
    Error::NoDevice("a CPU with AVX-512, or AVX2 and FMA (sgemm)".into())
}

fn covers(name: &str, len: usize, rows: usize, cols: usize, rs: usize, cs: usize) -> Result<()> {
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let last = (rows - 1)
        .checked_mul(rs)
        .and_then(|x| (cols - 1).checked_mul(cs).and_then(|y| x.checked_add(y)));
    match last {
        Some(l) if l < len => Ok(()),
        _ => Err(Error::Shape(format!(
            "sgemm: {name} [{rows}, {cols}] with strides ({rs}, {cs}) needs more than {len} elements"
        ))),
    }
}

/// A raw pointer the row-block tasks share; each writes only its own tiles.
#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: tasks write disjoint tiles of C (see `sgemm`), and C outlives them.
unsafe impl Send for SendPtr {}
unsafe impl Sync for SendPtr {}

/// `C[m, n] = A[m, k] B[k, n]`, or `C += A B` with `accumulate`. C is
/// row-major with leading dimension `ldc >= n`. `parallel` allows rayon
/// threads (large products only). Errors when the CPU has neither
/// instruction set ([`available`]) or a view is too short for its shape.
#[allow(clippy::too_many_arguments)]
pub fn sgemm(
    m: usize,
    n: usize,
    k: usize,
    a: Strided<'_>,
    b: Strided<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    covers("B", b.data.len(), k, n, b.rs, b.cs)?;
    run(
        m,
        n,
        k,
        a,
        BSource::Strided(b),
        c,
        ldc,
        accumulate,
        parallel,
    )
}

/// [`sgemm`] with B packed beforehand ([`PackedB`]): the same panels, so
/// the same bits, without packing B on every call (a weight used by a few
/// rows at a time, as in decoding).
#[allow(clippy::too_many_arguments)]
pub fn sgemm_packed(
    m: usize,
    a: Strided<'_>,
    b: &PackedB,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    run(
        m,
        b.n,
        b.k,
        a,
        BSource::Packed(b),
        c,
        ldc,
        accumulate,
        parallel,
    )
}

/// B `[k, n]` in the panels [`sgemm`] packs it into, every block at once.
///
/// Stored as bf16 when every value of B is a bf16 value (a checkpoint read
/// from bf16, as served models are): half the memory, and half the bytes a
/// decode step streams. The kernel widens each value back to the same f32
/// (widening is exact), so the products' bits do not change; weights that
/// are not all bf16 values (the trainer's fp32 masters after an update)
/// stay f32.
#[derive(Debug, Clone)]
pub struct PackedB {
    k: usize,
    n: usize,
    /// Start of block (column block jb, depth block pb) at `jb * n_pc + pb`.
    offsets: Vec<usize>,
    data: Panels,
}

/// A packed B's values.
#[derive(Debug, Clone)]
enum Panels {
    F32(Vec<f32>),
    /// The high halves of the f32 values (their low halves are zero).
    Bf16(Vec<u16>),
}

impl PackedB {
    /// Packs `b` (`[k, n]`), in bf16 where that loses nothing (see
    /// [`PackedB`]). Errors when [`sgemm`] does not run here or `b` is
    /// short.
    pub fn new(b: Strided<'_>, k: usize, n: usize) -> Result<PackedB> {
        if !available() {
            return Err(unavailable());
        }
        covers("B", b.data.len(), k, n, b.rs, b.cs)?;
        let mut offsets = Vec::new();
        let mut len = 0;
        for jc in (0..n).step_by(NC) {
            let npan = NC.min(n - jc).div_ceil(NR);
            for pc in (0..k).step_by(KC) {
                offsets.push(len);
                len += npan * NR * KC.min(k - pc);
            }
        }
        let narrow = all_bf16(b, k, n);
        let mut wide = vec![0.0f32; if narrow { 0 } else { len }];
        let mut half = vec![0u16; if narrow { len } else { 0 }];
        // A bf16 pack goes through one block of f32 at a time.
        let mut block = vec![0.0f32; if narrow { KC * NC } else { 0 }];
        let mut i = 0;
        for jc in (0..n).step_by(NC) {
            let nc = NC.min(n - jc);
            for pc in (0..k).step_by(KC) {
                let kc = KC.min(k - pc);
                let start = offsets[i];
                let size = nc.div_ceil(NR) * NR * kc;
                if narrow {
                    pack_b(&mut block[..size], b, pc, kc, jc, nc, true);
                    for (h, x) in half[start..start + size].iter_mut().zip(&block[..size]) {
                        *h = (x.to_bits() >> 16) as u16;
                    }
                } else {
                    pack_b(&mut wide[start..start + size], b, pc, kc, jc, nc, true);
                }
                i += 1;
            }
        }
        Ok(PackedB {
            k,
            n,
            offsets,
            data: if narrow {
                Panels::Bf16(half)
            } else {
                Panels::F32(wide)
            },
        })
    }

    /// Depth (rows) and width (columns) of the packed matrix.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }

    /// Bytes the packed values take.
    pub fn bytes(&self) -> usize {
        match &self.data {
            Panels::F32(v) => v.len() * 4,
            Panels::Bf16(v) => v.len() * 2,
        }
    }

    /// Whether the values are held as bf16 (see [`PackedB`]).
    pub fn is_bf16(&self) -> bool {
        matches!(self.data, Panels::Bf16(_))
    }
}

/// Whether every value of `b` (`[k, n]`) is a bf16 value: its low 16 bits
/// are zero.
fn all_bf16(b: Strided<'_>, k: usize, n: usize) -> bool {
    let exact = |x: f32| x.to_bits() & 0xffff == 0;
    // Along the smaller stride inside (an nn.Linear weight read as B is
    // contiguous along k).
    if b.rs <= b.cs {
        (0..n).all(|j| (0..k).all(|p| exact(b.data[p * b.rs + j * b.cs])))
    } else {
        (0..k).all(|p| (0..n).all(|j| exact(b.data[p * b.rs + j * b.cs])))
    }
}

/// One block of packed B panels, in either precision.
#[derive(Clone, Copy)]
enum PanelRef<'a> {
    F32(&'a [f32]),
    Bf16(&'a [u16]),
}

impl PanelRef<'_> {
    fn is_bf16(&self) -> bool {
        matches!(self, PanelRef::Bf16(_))
    }

    /// The address of value `at` (the panel starting there).
    fn panel(&self, at: usize) -> *const u8 {
        match self {
            PanelRef::F32(v) => v[at..].as_ptr() as *const u8,
            PanelRef::Bf16(v) => v[at..].as_ptr() as *const u8,
        }
    }
}

/// Where a product's B comes from.
#[derive(Clone, Copy)]
enum BSource<'a> {
    Strided(Strided<'a>),
    Packed(&'a PackedB),
}

#[allow(clippy::too_many_arguments)]
fn run(
    m: usize,
    n: usize,
    k: usize,
    a: Strided<'_>,
    b: BSource<'_>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
    parallel: bool,
) -> Result<()> {
    let isa = isa().ok_or_else(unavailable)?;
    covers("A", a.data.len(), m, k, a.rs, a.cs)?;
    if m > 0 && n > 0 && (ldc < n || (m - 1) * ldc + n > c.len()) {
        return Err(Error::Shape(format!(
            "sgemm: C [{m}, {n}] with leading dimension {ldc} does not fit {} elements",
            c.len()
        )));
    }
    if m == 0 || n == 0 {
        return Ok(());
    }
    if k == 0 {
        if !accumulate {
            for row in c.chunks_mut(ldc).take(m) {
                row[..n].fill(0.0);
            }
        }
        return Ok(());
    }
    let threads = if parallel && m * n * k >= PARALLEL_MIN {
        rayon::current_num_threads()
    } else {
        1
    };
    let cp = SendPtr(c.as_mut_ptr());
    let mut bpack = match b {
        BSource::Strided(_) => take_scratch(&B_SCRATCH, KC * n.min(NC).next_multiple_of(NR)),
        BSource::Packed(_) => Vec::new(),
    };
    let mut block = 0;
    for jc in (0..n).step_by(NC) {
        let nc = NC.min(n - jc);
        let npan = nc.div_ceil(NR);
        for pc in (0..k).step_by(KC) {
            let kc = KC.min(k - pc);
            let bp = match b {
                BSource::Strided(b) => {
                    pack_b(&mut bpack[..npan * NR * kc], b, pc, kc, jc, nc, threads > 1);
                    PanelRef::F32(&bpack[..npan * NR * kc])
                }
                BSource::Packed(p) => {
                    let start = p.offsets[block];
                    let end = start + npan * NR * kc;
                    match &p.data {
                        Panels::F32(v) => PanelRef::F32(&v[start..end]),
                        Panels::Bf16(v) => PanelRef::Bf16(&v[start..end]),
                    }
                }
            };
            block += 1;
            let load = pc > 0 || accumulate;
            let n_ic = m.div_ceil(MC);
            let groups = npan.min((2 * threads).div_ceil(n_ic)).max(1);
            let per = npan.div_ceil(groups);
            let tasks: Vec<(usize, usize)> = (0..n_ic)
                .flat_map(|i| (0..groups).map(move |g| (i, g)))
                .filter(|&(_, g)| g * per < npan)
                .collect();
            // A's row blocks are packed once, before the tasks that share
            // them (a decode product's few rows were packed once per task).
            let a_len = (n_ic - 1) * MC * kc + (m - (n_ic - 1) * MC).div_ceil(MR) * MR * kc;
            let mut apack = take_scratch(&A_SCRATCH, a_len);
            let pack_block = |(ib, dst): (usize, &mut [f32])| {
                let ic = ib * MC;
                pack_a(dst, a, ic, MC.min(m - ic), pc, kc);
            };
            if threads > 1 && n_ic > 1 {
                apack[..a_len]
                    .par_chunks_mut(MC * kc)
                    .enumerate()
                    .for_each(pack_block);
            } else {
                apack[..a_len]
                    .chunks_mut(MC * kc)
                    .enumerate()
                    .for_each(pack_block);
            }
            let apack_all: &[f32] = &apack[..a_len];
            let task = |&(ib, g): &(usize, usize)| {
                let ic = ib * MC;
                let mc = MC.min(m - ic);
                let mpan = mc.div_ceil(MR);
                let apack = &apack_all[ib * MC * kc..];
                let last = ((g + 1) * per).min(npan);
                for jp in g * per..last {
                    let j0 = jc + jp * NR;
                    let nr = NR.min(n - j0);
                    for ip in 0..mpan {
                        // The first row panel's pass over this B panel
                        // fetches the next one (a packed weight's blocks
                        // lie end to end, so past a block's last panel is
                        // the next block's first): B streams from L3 or
                        // memory (a weight read by a few decode rows), and
                        // without this the kernel waited on it half its
                        // time.
                        let run_tile: TileFn = match (isa, ip == 0, bp.is_bf16()) {
                            (Isa::Avx512, true, false) => tile::<true, false, true>,
                            (Isa::Avx512, false, false) => tile::<false, false, true>,
                            (Isa::Avx512, true, true) => tile::<true, true, true>,
                            (Isa::Avx512, false, true) => tile::<false, true, true>,
                            (Isa::Avx2, true, false) => tile::<true, false, false>,
                            (Isa::Avx2, false, false) => tile::<false, false, false>,
                            (Isa::Avx2, true, true) => tile::<true, true, false>,
                            (Isa::Avx2, false, true) => tile::<false, true, false>,
                        };
                        let i0 = ic + ip * MR;
                        let mr = MR.min(m - i0);
                        // SAFETY: the panels hold MR (NR) x kc values; the
                        // tile (i0.., j0..) of mr x nr lies inside C (checked
                        // above) and belongs to this task alone.
                        unsafe {
                            run_tile(
                                kc,
                                apack.as_ptr().add(ip * MR * kc),
                                bp.panel(jp * NR * kc),
                                cp,
                                i0 * ldc + j0,
                                ldc,
                                mr,
                                nr,
                                load,
                            );
                        }
                    }
                }
            };
            if threads > 1 && tasks.len() > 1 {
                tasks.par_iter().for_each(task);
            } else {
                tasks.iter().for_each(task);
            }
            A_SCRATCH.with(|s| s.replace(apack));
        }
    }
    if let BSource::Strided(_) = b {
        B_SCRATCH.with(|s| s.replace(bpack));
    }
    Ok(())
}

thread_local! {
    /// Packing buffers kept per thread between calls (packing overwrites
    /// every value it hands the kernel, padding included, so they are never
    /// cleared).
    static A_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    static B_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// This thread's buffer from `slot`, at least `len` long (only growth is
/// zero-filled). Put it back when done; a nested call meanwhile simply
/// allocates its own.
fn take_scratch(
    slot: &'static std::thread::LocalKey<std::cell::RefCell<Vec<f32>>>,
    len: usize,
) -> Vec<f32> {
    let mut v = slot.with(|s| s.take());
    if v.len() < len {
        v.resize(len, 0.0);
    }
    v
}

/// Rows `i0..i0 + mc`, depth `p0..p0 + kc` of A into MR-row panels.
fn pack_a(dst: &mut [f32], a: Strided<'_>, i0: usize, mc: usize, p0: usize, kc: usize) {
    for (ip, panel) in dst.chunks_exact_mut(MR * kc).enumerate() {
        let rows = MR.min(mc - ip * MR);
        if rows < MR {
            panel.fill(0.0);
        }
        let base = (i0 + ip * MR) * a.rs + p0 * a.cs;
        // SAFETY: `sgemm` checked that A covers rows i0..i0+mc, columns
        // p0..p0+kc; the panel holds kc x MR values.
        unsafe {
            pack::<MR>(
                panel.as_mut_ptr(),
                a.data.as_ptr().add(base),
                a.rs,
                a.cs,
                rows,
                kc,
            )
        }
    }
}

/// Depth `p0..p0 + kc`, columns `j0..j0 + nc` of B into NR-column panels,
/// the panels shared out among threads when `parallel`.
fn pack_b(
    dst: &mut [f32],
    b: Strided<'_>,
    p0: usize,
    kc: usize,
    j0: usize,
    nc: usize,
    parallel: bool,
) {
    let one = |(jp, panel): (usize, &mut [f32])| {
        let cols = NR.min(nc - jp * NR);
        if cols < NR {
            panel.fill(0.0);
        }
        let base = p0 * b.rs + (j0 + jp * NR) * b.cs;
        // SAFETY: as in `pack_a`, for B's depth and columns.
        unsafe {
            pack::<NR>(
                panel.as_mut_ptr(),
                b.data.as_ptr().add(base),
                b.cs,
                b.rs,
                cols,
                kc,
            )
        }
    };
    if parallel && dst.len() > NR * kc {
        dst.par_chunks_exact_mut(NR * kc).enumerate().for_each(one);
    } else {
        dst.chunks_exact_mut(NR * kc).enumerate().for_each(one);
    }
}

/// `dst[p * W + x] = src[x * xs + p * ps]` for `x < lanes`, `p < depth`:
/// one panel. Reads run along whichever source stride is 1.
///
/// # Safety
/// Every index read and written is in bounds of its buffer.
unsafe fn pack<const W: usize>(
    dst: *mut f32,
    src: *const f32,
    xs: usize,
    ps: usize,
    lanes: usize,
    depth: usize,
) {
    if xs == 1 {
        for p in 0..depth {
            if lanes == W {
                // A fixed-size copy: inlined moves, not a memcpy call per row.
                std::ptr::copy_nonoverlapping(src.add(p * ps), dst.add(p * W), W);
            } else {
                std::ptr::copy_nonoverlapping(src.add(p * ps), dst.add(p * W), lanes);
            }
        }
    } else if ps == 1 && available() {
        // A transpose (an `nn.Linear` weight read as B, row-major
        // activations read as A), up to 16 x 16 (AVX2: 8 x 8) at a time in
        // registers.
        let wide = isa() == Some(Isa::Avx512);
        let t = if wide { 16 } else { 8 };
        let full = depth - depth % t;
        for p0 in (0..full).step_by(t) {
            for x0 in (0..lanes).step_by(t) {
                let n = t.min(lanes - x0);
                let (s, d) = (src.add(x0 * xs + p0), dst.add(p0 * W + x0));
                if wide {
                    transpose16(s, xs, d, W, n);
                } else {
                    transpose8(s, xs, d, W, n);
                }
            }
        }
        for x in 0..lanes {
            for p in full..depth {
                *dst.add(p * W + x) = *src.add(x * xs + p);
            }
        }
    } else {
        // Sixteen steps of depth per source line at a time (reads along
        // `ps` stay in few cache lines, writes in the panel).
        for p0 in (0..depth).step_by(16) {
            let pn = 16.min(depth - p0);
            for x in 0..lanes {
                let s = src.add(x * xs + p0 * ps);
                let d = dst.add(p0 * W + x);
                for p in 0..pn {
                    *d.add(p * W) = *s.add(p * ps);
                }
            }
        }
    }
}

/// `dst[r * ds + c] = src[c * ss + r]` for r < 16, c < n <= 16: a 16 x n
/// transpose through registers (pairs of rows interleaved by 32 bits, then
/// 64 bits, then 128-bit lanes twice); missing source rows read as zeros and
/// only the first n values of each destination row are written.
///
/// # Safety
/// AVX-512F is present; the n source rows of 16 floats and the 16
/// destination rows of n floats are in bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(src: *const f32, ss: usize, dst: *mut f32, ds: usize, n: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm512_setzero_ps(); 16];
    for (i, row) in r.iter_mut().enumerate().take(n) {
        *row = _mm512_loadu_ps(src.add(i * ss));
    }
    let mask: __mmask16 = if n >= 16 { 0xffff } else { (1u16 << n) - 1 };
    // t[2i], t[2i+1]: rows 2i, 2i+1 interleaved (columns 4L, 4L+1 / 4L+2, 4L+3
    // of each 128-bit lane L).
    let mut t = [_mm512_setzero_ps(); 16];
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + o]: rows 4g..4g+4 at column 4L + o of each lane L.
    let mut u = [_mm512_setzero_ps(); 16];
    for g in 0..4 {
        let (a, b, c, d) = (t[4 * g], t[4 * g + 2], t[4 * g + 1], t[4 * g + 3]);
        let (a, b) = (_mm512_castps_pd(a), _mm512_castps_pd(b));
        let (c, d) = (_mm512_castps_pd(c), _mm512_castps_pd(d));
        u[4 * g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, b));
        u[4 * g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, b));
        u[4 * g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(c, d));
        u[4 * g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(c, d));
    }
    for o in 0..4 {
        // Lanes (col o, col 8+o) of row groups 0,1 and 2,3; then (4+o, 12+o).
        let x01 = _mm512_shuffle_f32x4::<0x88>(u[o], u[4 + o]);
        let y01 = _mm512_shuffle_f32x4::<0xdd>(u[o], u[4 + o]);
        let x23 = _mm512_shuffle_f32x4::<0x88>(u[8 + o], u[12 + o]);
        let y23 = _mm512_shuffle_f32x4::<0xdd>(u[8 + o], u[12 + o]);
        _mm512_mask_storeu_ps(
            dst.add(o * ds),
            mask,
            _mm512_shuffle_f32x4::<0x88>(x01, x23),
        );
        _mm512_mask_storeu_ps(
            dst.add((8 + o) * ds),
            mask,
            _mm512_shuffle_f32x4::<0xdd>(x01, x23),
        );
        _mm512_mask_storeu_ps(
            dst.add((4 + o) * ds),
            mask,
            _mm512_shuffle_f32x4::<0x88>(y01, y23),
        );
        _mm512_mask_storeu_ps(
            dst.add((12 + o) * ds),
            mask,
            _mm512_shuffle_f32x4::<0xdd>(y01, y23),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn transpose16(_: *const f32, _: usize, _: *mut f32, _: usize, _: usize) {
    unreachable!("sgemm runs only where `available()` is true")
}

/// `dst[r * ds + c] = src[c * ss + r]` for r < 8, c < n <= 8: an 8 x n
/// transpose through registers (rows interleaved by 32 bits, then 64 bits,
/// then 128-bit lanes); missing source rows read as zeros and only the
/// first n values of each destination row are written.
///
/// # Safety
/// AVX2 is present; the n source rows of 8 floats and the 8 destination
/// rows of n floats are in bounds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn transpose8(src: *const f32, ss: usize, dst: *mut f32, ds: usize, n: usize) {
    use std::arch::x86_64::*;
    let mut r = [_mm256_setzero_ps(); 8];
    for (i, row) in r.iter_mut().enumerate().take(n) {
        *row = _mm256_loadu_ps(src.add(i * ss));
    }
    let mut t = [_mm256_setzero_ps(); 8];
    for i in 0..4 {
        t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    // u[4g + j] holds column j (and j + 4 in the high lane) of rows 4g..4g+4.
    let mut u = [_mm256_setzero_ps(); 8];
    for g in 0..2 {
        let (lo, hi) = (t[4 * g], t[4 * g + 2]);
        let (lo2, hi2) = (t[4 * g + 1], t[4 * g + 3]);
        u[4 * g] = _mm256_shuffle_ps::<0x44>(lo, hi);
        u[4 * g + 1] = _mm256_shuffle_ps::<0xee>(lo, hi);
        u[4 * g + 2] = _mm256_shuffle_ps::<0x44>(lo2, hi2);
        u[4 * g + 3] = _mm256_shuffle_ps::<0xee>(lo2, hi2);
    }
    let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(n as i32), lane);
    for j in 0..4 {
        _mm256_maskstore_ps(
            dst.add(j * ds),
            mask,
            _mm256_permute2f128_ps::<0x20>(u[j], u[4 + j]),
        );
        _mm256_maskstore_ps(
            dst.add((j + 4) * ds),
            mask,
            _mm256_permute2f128_ps::<0x31>(u[j], u[4 + j]),
        );
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn transpose8(_: *const f32, _: usize, _: *mut f32, _: usize, _: usize) {
    unreachable!("sgemm runs only where `available()` is true")
}

/// [`tile`] with its prefetch, precision and instruction set chosen.
type TileFn = unsafe fn(usize, *const f32, *const u8, SendPtr, usize, usize, usize, usize, bool);

/// One `mr x nr` tile of C at `c.0 + off`: straight into C when whole,
/// through a zero-padded copy at the edges. With `FETCH`, the B panel after
/// this one is prefetched while the tile runs; with `BF16`, B's values are
/// bf16 (see [`PackedB`]), else f32; `Z` runs the AVX-512 kernel, else the
/// AVX2 one.
///
/// # Safety
/// `a` and `b` point at packed panels of `kc` steps; the tile lies inside C;
/// the CPU has the instruction set `Z` names.
#[allow(clippy::too_many_arguments)]
unsafe fn tile<const FETCH: bool, const BF16: bool, const Z: bool>(
    kc: usize,
    a: *const f32,
    b: *const u8,
    c: SendPtr,
    off: usize,
    ldc: usize,
    mr: usize,
    nr: usize,
    load: bool,
) {
    let dst = c.0.add(off);
    if nr == NR {
        rows_kernel::<FETCH, BF16, Z>(mr, kc, a, b, dst, ldc, load);
        return;
    }
    let mut buf = [0.0f32; MR * NR];
    if load {
        for i in 0..mr {
            std::ptr::copy_nonoverlapping(dst.add(i * ldc), buf.as_mut_ptr().add(i * NR), nr);
        }
    }
    rows_kernel::<FETCH, BF16, Z>(mr, kc, a, b, buf.as_mut_ptr(), NR, load);
    for i in 0..mr {
        std::ptr::copy_nonoverlapping(buf.as_ptr().add(i * NR), dst.add(i * ldc), nr);
    }
}

/// The kernel for the first `mr` rows of a panel (a decode step multiplies
/// a weight by one or a few rows; the padding rows are not computed).
///
/// # Safety
/// As [`kernel`] (or [`kernel_avx2`] without `Z`), with `1 <= mr <= MR`
/// rows of C.
unsafe fn rows_kernel<const FETCH: bool, const BF16: bool, const Z: bool>(
    mr: usize,
    kc: usize,
    a: *const f32,
    b: *const u8,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    macro_rules! rows {
        ($($r:literal)*) => {
            match (mr, Z) {
                $(($r, true) => kernel::<$r, FETCH, BF16>(kc, a, b, c, ldc, load),
                ($r, false) => kernel_avx2::<$r, FETCH, BF16>(kc, a, b, c, ldc, load),)*
                (_, true) => kernel::<MR, FETCH, BF16>(kc, a, b, c, ldc, load),
                (_, false) => kernel_avx2::<MR, FETCH, BF16>(kc, a, b, c, ldc, load),
            }
        };
    }
    rows!(1 2 3 4 5 6 7 8 9 10 11)
}

/// An `R x NR` tile (`R <= MR` rows of an MR-row panel): `acc = C or 0;
/// for p: acc += a[p] (x) b[p]`. Every row's arithmetic is the same for
/// every `R`. With `FETCH`, each step also prefetches the same step of the
/// next B panel (`kc * NR` values on), so it arrives before it is needed;
/// a prefetch never faults and changes no value. With `BF16`, each step's
/// `NR` values of B are bf16 and widened to f32 (exactly: the bits move to
/// the high half) before the same multiply-adds.
///
/// # Safety
/// AVX-512F is present; `a` holds `kc * MR` floats, `b` `kc * NR` values
/// (f32, or bf16 with `BF16`); `c` is a writable `R x NR` tile with row
/// stride `ldc`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn kernel<const R: usize, const FETCH: bool, const BF16: bool>(
    kc: usize,
    a: *const f32,
    b: *const u8,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    use std::arch::x86_64::*;
    let mut acc = [_mm512_setzero_ps(); 2 * MR];
    if load {
        for i in 0..R {
            acc[2 * i] = _mm512_loadu_ps(c.add(i * ldc));
            acc[2 * i + 1] = _mm512_loadu_ps(c.add(i * ldc + 16));
        }
    }
    // Bytes of one step of B, and from a step to the same step of the next
    // panel.
    let step = if BF16 { 2 * NR } else { 4 * NR };
    let ahead = kc * step;
    let (mut a, mut b) = (a, b);
    for _ in 0..kc {
        if FETCH {
            _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(ahead) as *const i8);
            if !BF16 {
                _mm_prefetch::<_MM_HINT_T0>(b.wrapping_add(ahead + 64) as *const i8);
            }
        }
        let (b0, b1) = if BF16 {
            let lo = _mm256_loadu_si256(b as *const __m256i);
            let hi = _mm256_loadu_si256(b.add(32) as *const __m256i);
            (
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(lo))),
                _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(hi))),
            )
        } else {
            (
                _mm512_loadu_ps(b as *const f32),
                _mm512_loadu_ps(b.add(64) as *const f32),
            )
        };
        for i in 0..R {
            let ai = _mm512_set1_ps(*a.add(i));
            acc[2 * i] = _mm512_fmadd_ps(ai, b0, acc[2 * i]);
            acc[2 * i + 1] = _mm512_fmadd_ps(ai, b1, acc[2 * i + 1]);
        }
        a = a.add(MR);
        b = b.add(step);
    }
    for i in 0..R {
        _mm512_storeu_ps(c.add(i * ldc), acc[2 * i]);
        _mm512_storeu_ps(c.add(i * ldc + 16), acc[2 * i + 1]);
    }
}

/// [`kernel`] on AVX2: the same tile and the same chain per element, in
/// blocks whose accumulators fit the sixteen ymm registers beside a step of
/// B and the broadcast value: one or two rows across all 32 columns (B
/// streams once, as decoding needs), else up to six rows across 16
/// columns at a time.
///
/// # Safety
/// AVX2 and FMA are present; otherwise as [`kernel`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn kernel_avx2<const R: usize, const FETCH: bool, const BF16: bool>(
    kc: usize,
    a: *const f32,
    b: *const u8,
    c: *mut f32,
    ldc: usize,
    load: bool,
) {
    // Rows `i..` of the tile as one block of H rows and W registers.
    macro_rules! block {
        ($h:literal, $w:literal, $i:literal) => {
            block_avx2::<$h, $w, FETCH, BF16>(kc, a.add($i), b, c.add($i * ldc), ldc, load, $i == 0)
        };
    }
    match R {
        1 => block!(1, 4, 0),
        2 => block!(2, 4, 0),
        3 => block!(3, 2, 0),
        4 => block!(4, 2, 0),
        5 => block!(5, 2, 0),
        6 => block!(6, 2, 0),
        7 => {
            block!(6, 2, 0);
            block!(1, 4, 6)
        }
        8 => {
            block!(6, 2, 0);
            block!(2, 4, 6)
        }
        9 => {
            block!(6, 2, 0);
            block!(3, 2, 6)
        }
        10 => {
            block!(6, 2, 0);
            block!(4, 2, 6)
        }
        11 => {
            block!(6, 2, 0);
            block!(5, 2, 6)
        }
        _ => {
            block!(6, 2, 0);
            block!(6, 2, 6)
        }
    }
}

/// `H` rows of a tile (A's values at `a[p * MR + i]`, C's rows from `c`),
/// `8 * W` columns at a time: `acc = C or 0; for p: acc += a[p] (x) b[p]`.
/// With `FETCH` and `first`, the first column group's pass prefetches the
/// next B panel as [`kernel`] does.
///
/// # Safety
/// As [`kernel_avx2`], for rows `0..H` from `a` and `c`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn block_avx2<const H: usize, const W: usize, const FETCH: bool, const BF16: bool>(
    kc: usize,
    a: *const f32,
    b: *const u8,
    c: *mut f32,
    ldc: usize,
    load: bool,
    first: bool,
) {
    use std::arch::x86_64::*;
    let size = if BF16 { 2 } else { 4 };
    let step = size * NR;
    let ahead = kc * step;
    for g in 0..NR / (8 * W) {
        let col = g * 8 * W;
        let mut acc = [[_mm256_setzero_ps(); W]; H];
        if load {
            for (i, row) in acc.iter_mut().enumerate() {
                for (w, x) in row.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(c.add(i * ldc + col + 8 * w));
                }
            }
        }
        let (mut ap, mut bp) = (a, b.add(size * col));
        for _ in 0..kc {
            if FETCH && first && g == 0 {
                _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(ahead) as *const i8);
                if !BF16 {
                    _mm_prefetch::<_MM_HINT_T0>(bp.wrapping_add(ahead + 64) as *const i8);
                }
            }
            let mut bv = [_mm256_setzero_ps(); W];
            for (w, v) in bv.iter_mut().enumerate() {
                let at = bp.add(size * 8 * w);
                *v = if BF16 {
                    let h = _mm_loadu_si128(at as *const __m128i);
                    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
                } else {
                    _mm256_loadu_ps(at as *const f32)
                };
            }
            for (i, row) in acc.iter_mut().enumerate() {
                let ai = _mm256_set1_ps(*ap.add(i));
                for (x, v) in row.iter_mut().zip(&bv) {
                    *x = _mm256_fmadd_ps(ai, *v, *x);
                }
            }
            ap = ap.add(MR);
            bp = bp.add(step);
        }
        for (i, row) in acc.iter().enumerate() {
            for (w, x) in row.iter().enumerate() {
                _mm256_storeu_ps(c.add(i * ldc + col + 8 * w), *x);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel_avx2<const R: usize, const FETCH: bool, const BF16: bool>(
    _: usize,
    _: *const f32,
    _: *const u8,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("sgemm runs only where `available()` is true")
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn kernel<const R: usize, const FETCH: bool, const BF16: bool>(
    _: usize,
    _: *const f32,
    _: *const u8,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("sgemm runs only where `available()` is true")
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    use std::sync::atomic::{AtomicBool, Ordering};

    /// Makes [`isa`] answer AVX2 on a CPU that has AVX-512 too, so both
    /// kernels are tested there. Tests that run meanwhile get AVX2's bits,
    /// which are the same.
    pub(super) static FORCE_AVX2: AtomicBool = AtomicBool::new(false);

    /// `f` on every instruction set this CPU has.
    fn on_each_isa(mut f: impl FnMut(Isa)) {
        let Some(best) = isa() else {
            eprintln!("skipped: no AVX-512 or AVX2 + FMA on this CPU");
            return;
        };
        f(best);
        if best == Isa::Avx512 && std::arch::is_x86_feature_detected!("avx2") {
            FORCE_AVX2.store(true, Ordering::Relaxed);
            f(Isa::Avx2);
            FORCE_AVX2.store(false, Ordering::Relaxed);
        }
    }

    /// The chain the kernel promises, element by element.
    fn chain(m: usize, n: usize, k: usize, a: Strided, b: Strided, c0: Option<&[f32]>) -> Vec<f32> {
        let mut out = vec![0.0f32; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = c0.map_or(0.0, |c| c[i * n + j]);
                for p in 0..k {
                    s = a.data[i * a.rs + p * a.cs].mul_add(b.data[p * b.rs + j * b.cs], s);
                }
                out[i * n + j] = s;
            }
        }
        out
    }

    #[test]
    fn equals_the_fma_chain_bit_for_bit_at_every_shape_and_layout() {
        on_each_isa(chain_at_every_shape);
    }

    fn chain_at_every_shape(isa: Isa) {
        let mut rng = StdRng::seed_from_u64(7);
        let shapes = [
            (1, 1, 1),
            (1, 33, 5),
            (12, 32, 256),
            (13, 31, 257),
            (130, 70, 600),
            (121, 1030, 40),
            (3, 2100, 20),
            (2, 64, 300),
            (40, 96, 37),
        ];
        for &(m, n, k) in &shapes {
            let av: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let bv: Vec<f32> = (0..k * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let c0: Vec<f32> = (0..m * n).map(|_| rng.gen_range(-1.0..1.0)).collect();
            // A row-major or column-major, B row-major or column-major.
            for (a, b) in [
                (
                    Strided {
                        data: &av,
                        rs: k,
                        cs: 1,
                    },
                    Strided {
                        data: &bv,
                        rs: n,
                        cs: 1,
                    },
                ),
                (
                    Strided {
                        data: &av,
                        rs: 1,
                        cs: m,
                    },
                    Strided {
                        data: &bv,
                        rs: 1,
                        cs: k,
                    },
                ),
            ] {
                for accumulate in [false, true] {
                    for parallel in [false, true] {
                        let mut c = c0.clone();
                        sgemm(m, n, k, a, b, &mut c, n, accumulate, parallel).unwrap();
                        let want = chain(m, n, k, a, b, accumulate.then_some(&c0[..]));
                        assert!(
                            c.iter().zip(&want).all(|(x, y)| x.to_bits() == y.to_bits()),
                            "{isa:?} m {m} n {n} k {k} acc {accumulate} par {parallel} rs {}",
                            a.rs
                        );
                    }
                }
            }
        }
    }

    /// Whether the product with `packed` (B packed beforehand) gives the
    /// bits of the product with `b`, overwriting and accumulating.
    fn packed_matches(m: usize, a: Strided, b: Strided, packed: &PackedB) -> bool {
        let (k, n) = packed.dims();
        [false, true].into_iter().all(|accumulate| {
            let mut want = vec![0.5f32; m * n];
            let mut got = want.clone();
            sgemm(m, n, k, a, b, &mut want, n, accumulate, true).unwrap();
            sgemm_packed(m, a, packed, &mut got, n, accumulate, true).unwrap();
            got.iter()
                .zip(&want)
                .all(|(x, y)| x.to_bits() == y.to_bits())
        })
    }

    #[test]
    fn packed_b_gives_the_same_bits() {
        on_each_isa(packed_b_same_bits);
    }

    fn packed_b_same_bits(isa: Isa) {
        let mut rng = StdRng::seed_from_u64(8);
        for &(m, n, k) in &[(1, 40, 300), (33, 1100, 70), (5, 32, 256), (130, 4, 600)] {
            let av: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let wv: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let a = Strided {
                data: &av,
                rs: k,
                cs: 1,
            };
            // An nn.Linear weight [n, k] read as B = W^T.
            let b = Strided {
                data: &wv,
                rs: 1,
                cs: k,
            };
            let packed = PackedB::new(b, k, n).unwrap();
            assert_eq!(packed.dims(), (k, n));
            assert!(
                packed_matches(m, a, b, &packed),
                "{isa:?} m {m} n {n} k {k}"
            );
        }
    }

    /// A B whose values are all bf16 values is packed in bf16 (half the
    /// bytes) and gives the bits of the f32 product; one value off bf16
    /// keeps the whole pack f32.
    #[test]
    fn bf16_valued_b_packs_in_half_the_bytes_with_the_same_bits() {
        on_each_isa(bf16_packs);
    }

    fn bf16_packs(isa: Isa) {
        let mut rng = StdRng::seed_from_u64(9);
        let bf = |x: f32| half::bf16::from_f32(x).to_f32();
        for &(m, n, k) in &[(1, 40, 300), (13, 1100, 70), (3, 32, 513), (130, 4, 600)] {
            let av: Vec<f32> = (0..m * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
            let mut wv: Vec<f32> = (0..n * k).map(|_| bf(rng.gen_range(-1.0..1.0))).collect();
            let mut narrow_bytes = 0;
            let a = Strided {
                data: &av,
                rs: k,
                cs: 1,
            };
            for layout in ["linear", "row-major"] {
                let b = match layout {
                    "linear" => Strided {
                        data: &wv,
                        rs: 1,
                        cs: k,
                    },
                    _ => Strided {
                        data: &wv,
                        rs: n,
                        cs: 1,
                    },
                };
                let packed = PackedB::new(b, k, n).unwrap();
                assert!(packed.is_bf16(), "{layout} m {m} n {n} k {k}");
                narrow_bytes = packed.bytes();
                assert!(
                    packed_matches(m, a, b, &packed),
                    "{isa:?} {layout} m {m} n {n} k {k}"
                );
            }
            let last = wv.len() - 1;
            wv[last] = f32::from_bits(wv[last].to_bits() | 1);
            let b = Strided {
                data: &wv,
                rs: 1,
                cs: k,
            };
            let packed = PackedB::new(b, k, n).unwrap();
            assert!(!packed.is_bf16(), "m {m} n {n} k {k}");
            assert_eq!(packed.bytes(), 2 * narrow_bytes);
            assert!(packed_matches(m, a, b, &packed), "m {m} n {n} k {k}");
        }
    }

    #[test]
    fn leading_dimension_leaves_other_columns_alone() {
        if !available() {
            return;
        }
        let (m, n, k, ldc) = (5, 7, 9, 11);
        let av = vec![1.0f32; m * k];
        let bv = vec![2.0f32; k * n];
        let mut c = vec![-1.0f32; (m - 1) * ldc + n];
        let a = Strided {
            data: &av,
            rs: k,
            cs: 1,
        };
        let b = Strided {
            data: &bv,
            rs: n,
            cs: 1,
        };
        sgemm(m, n, k, a, b, &mut c, ldc, false, false).unwrap();
        for (idx, x) in c.iter().enumerate() {
            let want = if idx % ldc < n { 18.0 } else { -1.0 };
            assert_eq!(*x, want, "element {idx}");
        }
    }

    #[test]
    fn short_views_are_errors() {
        if !available() {
            return;
        }
        let v = vec![0.0f32; 10];
        let mut c = vec![0.0f32; 4];
        let a = Strided {
            data: &v,
            rs: 5,
            cs: 1,
        };
        let b = Strided {
            data: &v,
            rs: 2,
            cs: 1,
        };
        assert!(sgemm(3, 2, 5, a, b, &mut c, 2, false, false).is_err());
        assert!(sgemm(2, 2, 5, a, b, &mut c[..3], 2, false, false).is_err());
    }
}
