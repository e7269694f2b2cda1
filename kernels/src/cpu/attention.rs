//! Causal grouped-query attention for one sequence, softmax in f32.
//!
//! Queries are the last `nq` positions of a sequence whose keys/values cover
//! positions `0..nk` (nq == nk for a prefill from scratch, nq == 1 for
//! decode), so query i sits at position `nk - nq + i` and attends keys
//! `0..=nk - nq + i`. Query head h reads key/value head `h / (n_heads /
//! n_kv_heads)`. The sigmoid output gate of Qwen3.5 is applied by the caller
//! with `activation::sigmoid_gate_forward`, which keeps this kernel usable for
//! the paged decode path too.
//!
//! Two paths compute the same function. Short query runs (decode, nq <
//! [`MIN_BLOCKED_NQ`]) go row by row, parallel over query tokens. Prefill
//! goes through [`attention_blocked`], which turns the work into matrix
//! products on the `gemm` crate (see the paragraph above it).
//!
//! [`attention_backward`] recomputes the probabilities and writes (`=`) dq,
//! dk and dv.

use super::activation::exp_poly;
use super::prefetch_rows;
use crate::{Error, Result};
use gemm::Parallelism;
use rayon::prelude::*;

/// Query runs at least this long take the gemm-blocked path; shorter ones
/// (decode, short appends) the row-wise one, whose per-row cost is already
/// minimal and which allocates nothing per head.
pub const MIN_BLOCKED_NQ: usize = 16;

/// Query rows per block of the blocked path: a block's score matrix is
/// `BLOCK_Q x nk` f32s per rayon task, so memory stays bounded on long
/// sequences, and nq / BLOCK_Q tasks keep every core busy.
const BLOCK_Q: usize = 64;

/// Sizes of one attention call.
#[derive(Debug, Clone, Copy)]
pub struct AttnDims {
    pub nq: usize,
    pub nk: usize,
    pub n_heads: usize,
    pub n_kv_heads: usize,
    pub head_dim: usize,
}

/// `out[nq, n_heads, head_dim]` from `q[nq, n_heads, hd]`, `k, v[nk, n_kv_heads, hd]`.
pub fn attention_forward(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) -> Result<()> {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    if n_kv_heads == 0
        || n_heads % n_kv_heads != 0
        || nq > nk
        || out.len() != nq * n_heads * hd
        || q.len() != nq * n_heads * hd
        || k.len() != nk * n_kv_heads * hd
        || v.len() != nk * n_kv_heads * hd
    {
        return Err(Error::Shape(format!(
            "attention: {dims:?} with out {} q {} k {} v {}",
            out.len(),
            q.len(),
            k.len(),
            v.len()
        )));
    }
    if nq == 0 || hd == 0 || n_heads == 0 {
        return Ok(());
    }
    if nq >= MIN_BLOCKED_NQ {
        attention_blocked(out, q, k, v, dims, scale);
        return Ok(());
    }
    let kv = Contiguous {
        k,
        v,
        kv_row: n_kv_heads * hd,
    };
    attend_rows(out, q, &kv, dims, scale);
    Ok(())
}

/// Where the rows of the row path find position `j`'s keys and values (all
/// key/value heads, `n_kv_heads * head_dim` floats each).
trait KvRows: Sync {
    fn k(&self, j: usize) -> &[f32];
    fn v(&self, j: usize) -> &[f32];
}

/// Keys and values `[nk, n_kv_heads, hd]`, one after another.
struct Contiguous<'a> {
    k: &'a [f32],
    v: &'a [f32],
    kv_row: usize,
}

impl KvRows for Contiguous<'_> {
    #[inline(always)]
    fn k(&self, j: usize) -> &[f32] {
        &self.k[j * self.kv_row..(j + 1) * self.kv_row]
    }
    #[inline(always)]
    fn v(&self, j: usize) -> &[f32] {
        &self.v[j * self.kv_row..(j + 1) * self.kv_row]
    }
}

/// A sequence's keys and values read in place from a paged cache: positions
/// `0..past` from the blocks of `blocks` (position `p` is row `p %
/// block_size` of block `blocks[p / block_size]`, in pools laid out
/// `[num_blocks, block_size, kv_row]`), positions `past..` from `new_k`,
/// `new_v` (the rows this call adds, `[nk - past, kv_row]`).
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a> {
    pub k_pool: &'a [f32],
    pub v_pool: &'a [f32],
    pub blocks: &'a [u32],
    pub block_size: usize,
    pub past: usize,
    pub new_k: &'a [f32],
    pub new_v: &'a [f32],
    pub kv_row: usize,
}

impl PagedKv<'_> {
    /// Prefetches the key rows a decode call reads first (the call fetches
    /// the rest ahead of itself), so a caller can start it for the next
    /// sequence while this one runs. A hint: nothing is read through.
    pub fn warm(&self) {
        for j in 0..ROWS_AHEAD.min(self.past) {
            let Some(at) = self.pool_at(j) else {
                return;
            };
            prefetch_rows(self.k_pool.as_ptr().wrapping_add(at), 1, 0, self.kv_row);
        }
    }

    /// Where past position `j` starts in the pools; `None` when the block
    /// table does not reach it.
    #[inline(always)]
    fn pool_at(&self, j: usize) -> Option<usize> {
        let b = *self.blocks.get(j / self.block_size.max(1))? as usize;
        Some((b * self.block_size + j % self.block_size) * self.kv_row)
    }

    #[inline(always)]
    fn row<'b>(&self, pool: &'b [f32], new: &'b [f32], j: usize) -> &'b [f32] {
        let r = self.kv_row;
        if j < self.past {
            let at = self
                .pool_at(j)
                .expect("attention_forward_paged checked that the table covers the past");
            &pool[at..at + r]
        } else {
            &new[(j - self.past) * r..(j - self.past + 1) * r]
        }
    }
}

impl KvRows for PagedKv<'_> {
    #[inline(always)]
    fn k(&self, j: usize) -> &[f32] {
        self.row(self.k_pool, self.new_k, j)
    }
    #[inline(always)]
    fn v(&self, j: usize) -> &[f32] {
        self.row(self.v_pool, self.new_v, j)
    }
}

/// [`attention_forward`] with the keys and values in a paged cache (see
/// [`PagedKv`]), for short query runs (decode): the row path, so the bits are
/// those of [`attention_forward`] on the same keys and values gathered
/// into one piece, whenever that takes its row path (`nq <` 16).
pub fn attention_forward_paged(
    out: &mut [f32],
    q: &[f32],
    kv: &PagedKv<'_>,
    dims: AttnDims,
    scale: f32,
) -> Result<()> {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let r = kv.kv_row;
    let bad = n_kv_heads == 0
        || n_heads % n_kv_heads != 0
        || nq > nk
        || kv.past > nk
        || r != n_kv_heads * hd
        || out.len() != nq * n_heads * hd
        || q.len() != nq * n_heads * hd
        || kv.new_k.len() != (nk - kv.past.min(nk)) * r
        || kv.new_v.len() != kv.new_k.len()
        || (kv.past > 0
            && (kv.block_size == 0
                || kv.blocks.len() * kv.block_size < kv.past
                || kv.blocks[..kv.past.div_ceil(kv.block_size)]
                    .iter()
                    .any(|&b| {
                        (b as usize + 1) * kv.block_size * r > kv.k_pool.len().min(kv.v_pool.len())
                    })));
    if bad {
        return Err(Error::Shape(format!(
            "paged attention: {dims:?} with past {}, {} blocks of {}, kv_row {r}, out {} q {} new k {} new v {}",
            kv.past,
            kv.blocks.len(),
            kv.block_size,
            out.len(),
            q.len(),
            kv.new_k.len(),
            kv.new_v.len()
        )));
    }
    if nq == 0 || hd == 0 || n_heads == 0 {
        return Ok(());
    }
    attend_rows(out, q, kv, dims, scale);
    Ok(())
}

/// The row path: every query row, all heads, parallel over rows.
fn attend_rows<K: KvRows>(out: &mut [f32], q: &[f32], kv: &K, dims: AttnDims, scale: f32) {
    let AttnDims { nq, nk, .. } = dims;
    let row_len = dims.n_heads * dims.head_dim;
    out.par_chunks_mut(row_len).enumerate().for_each_init(
        || vec![0.0f32; 2 * nk],
        |scratch, (i, o)| {
            let q_row = &q[i * row_len..(i + 1) * row_len];
            // Keys 0..=last, the row's own position included.
            let live = nk - nq + i + 1;
            attend_row(o, q_row, kv, &mut scratch[..2 * live], dims, scale);
        },
    );
}

/// One query row, all heads, over the keys `0..scratch.len() / 2`
/// (`scratch` holds two heads' scores): scores in [`DOT_LANES`] split sums,
/// [`softmax_body`], then the weighted sum of values. The loops
/// vectorise; where the CPU has AVX-512 (or AVX2) they run from a copy
/// compiled for it.
fn attend_row<K: KvRows>(
    o: &mut [f32],
    q_row: &[f32],
    kv: &K,
    scratch: &mut [f32],
    dims: AttnDims,
    scale: f32,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { attend_row_avx512(o, q_row, kv, scratch, dims, scale) };
    }
    let live = scratch.len() / 2;
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { attend_row_avx2(o, q_row, kv, &mut scratch[..live], dims, scale) };
    }
    attend_row_body(o, q_row, kv, &mut scratch[..live], dims, scale, dot_split)
}

/// [`attend_row`] on AVX-512: head widths of 16 to 128 with an even number
/// of query heads per key/value head take [`attend_pairs`], the rest the
/// portable body with [`dot_split_avx512`]. The same bits either way.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_row_avx512<K: KvRows>(
    o: &mut [f32],
    q_row: &[f32],
    kv: &K,
    scratch: &mut [f32],
    dims: AttnDims,
    scale: f32,
) {
    let (hd, group) = (dims.head_dim, dims.n_heads / dims.n_kv_heads);
    if hd % 16 == 0 && group % 2 == 0 {
        // SAFETY (each arm): AVX-512F is present (this function's contract);
        // hd is 16 times the const.
        match hd / 16 {
            1 => return unsafe { attend_pairs::<K, 1>(o, q_row, kv, scratch, dims, scale) },
            2 => return unsafe { attend_pairs::<K, 2>(o, q_row, kv, scratch, dims, scale) },
            4 => return unsafe { attend_pairs::<K, 4>(o, q_row, kv, scratch, dims, scale) },
            8 => return unsafe { attend_pairs::<K, 8>(o, q_row, kv, scratch, dims, scale) },
            _ => {}
        }
    }
    let live = scratch.len() / 2;
    attend_row_body(o, q_row, kv, &mut scratch[..live], dims, scale, |a, b| {
        // SAFETY: this copy runs only where AVX-512F is present.
        unsafe { dot_split_avx512(a, b) }
    })
}

/// [`attend_row_body`] two query heads of one key/value head at a time,
/// for `head_dim = 16 NC`: each key and value row is loaded once for both,
/// and both heads' outputs stay in registers across the positions (in
/// memory, each position's add waited on the last one's store). Every
/// output is the same chain `0 + p_0 v_0 + p_1 v_1 + ...` as in the body,
/// so the same bits.
///
/// # Safety
/// AVX-512F is present; `head_dim == 16 * NC`; the query heads per
/// key/value head are even; `scratch` is two heads' scores long.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attend_pairs<K: KvRows, const NC: usize>(
    o: &mut [f32],
    q_row: &[f32],
    kv: &K,
    scratch: &mut [f32],
    dims: AttnDims,
    scale: f32,
) {
    use std::arch::x86_64::*;
    let hd = 16 * NC;
    let group = dims.n_heads / dims.n_kv_heads;
    let live = scratch.len() / 2;
    let (s0, s1) = scratch.split_at_mut(live);
    for h in (0..dims.n_heads).step_by(2) {
        let kvh = h / group;
        let (q0, q1) = (
            &q_row[h * hd..(h + 1) * hd],
            &q_row[(h + 1) * hd..(h + 2) * hd],
        );
        let fetch = h % group == 0;
        for j in 0..live {
            if fetch && j + ROWS_AHEAD < live {
                fetch_head_row(kv, j + ROWS_AHEAD, false, kvh, hd);
            }
            let kj = &kv.k(j)[kvh * hd..(kvh + 1) * hd];
            // SAFETY: AVX-512F is present.
            unsafe {
                s0[j] = dot_split_avx512(q0, kj) * scale;
                s1[j] = dot_split_avx512(q1, kj) * scale;
            }
        }
        if fetch {
            for j in 0..ROWS_AHEAD.min(live) {
                fetch_head_row(kv, j, true, kvh, hd);
            }
        }
        softmax_body(s0);
        softmax_body(s1);
        let mut a0 = [_mm512_setzero_ps(); NC];
        let mut a1 = [_mm512_setzero_ps(); NC];
        for j in 0..live {
            if fetch && j + ROWS_AHEAD < live {
                fetch_head_row(kv, j + ROWS_AHEAD, true, kvh, hd);
            }
            let vj = &kv.v(j)[kvh * hd..(kvh + 1) * hd];
            let (p0, p1) = (_mm512_set1_ps(s0[j]), _mm512_set1_ps(s1[j]));
            for c in 0..NC {
                // SAFETY: vj holds hd = 16 NC values.
                let x = unsafe { _mm512_loadu_ps(vj.as_ptr().add(16 * c)) };
                a0[c] = _mm512_add_ps(a0[c], _mm512_mul_ps(p0, x));
                a1[c] = _mm512_add_ps(a1[c], _mm512_mul_ps(p1, x));
            }
        }
        let (o0, o1) = o[h * hd..(h + 2) * hd].split_at_mut(hd);
        for c in 0..NC {
            // SAFETY: o0 and o1 hold hd = 16 NC values each.
            unsafe {
                _mm512_storeu_ps(o0.as_mut_ptr().add(16 * c), a0[c]);
                _mm512_storeu_ps(o1.as_mut_ptr().add(16 * c), a1[c]);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attend_row_avx2<K: KvRows>(
    o: &mut [f32],
    q_row: &[f32],
    kv: &K,
    scores: &mut [f32],
    dims: AttnDims,
    scale: f32,
) {
    attend_row_body(o, q_row, kv, scores, dims, scale, dot_split)
}

/// Positions ahead of the one being read whose key (value) row is
/// prefetched: past keys and values stream from memory in a decode step.
const ROWS_AHEAD: usize = 16;

/// Prefetches key/value head `kvh`'s key (`value`: false) or value row at
/// position `j` (`hd` floats).
#[inline(always)]
fn fetch_head_row<K: KvRows>(kv: &K, j: usize, value: bool, kvh: usize, hd: usize) {
    let row = if value { kv.v(j) } else { kv.k(j) };
    prefetch_rows(row.as_ptr().wrapping_add(kvh * hd), 1, 0, hd);
}

/// The row path's body; `dot` is [`dot_split`] or a copy with the same bits.
#[inline(always)]
fn attend_row_body<K: KvRows>(
    o: &mut [f32],
    q_row: &[f32],
    kv: &K,
    scores: &mut [f32],
    dims: AttnDims,
    scale: f32,
    dot: impl Fn(&[f32], &[f32]) -> f32,
) {
    let (hd, n_heads) = (dims.head_dim, dims.n_heads);
    let group = n_heads / dims.n_kv_heads;
    let live = scores.len();
    for h in 0..n_heads {
        let kvh = h / group;
        let qh = &q_row[h * hd..(h + 1) * hd];
        // A key/value head's rows are fetched by its group's first head.
        let fetch = h % group == 0;
        for (j, s) in scores.iter_mut().enumerate() {
            if fetch && j + ROWS_AHEAD < live {
                fetch_head_row(kv, j + ROWS_AHEAD, false, kvh, hd);
            }
            let kj = &kv.k(j)[kvh * hd..(kvh + 1) * hd];
            *s = dot(qh, kj) * scale;
        }
        if fetch {
            for j in 0..ROWS_AHEAD.min(live) {
                fetch_head_row(kv, j, true, kvh, hd);
            }
        }
        softmax_body(scores);
        let oh = &mut o[h * hd..(h + 1) * hd];
        oh.fill(0.0);
        for (j, &p) in scores.iter().enumerate() {
            if fetch && j + ROWS_AHEAD < live {
                fetch_head_row(kv, j + ROWS_AHEAD, true, kvh, hd);
            }
            let vj = &kv.v(j)[kvh * hd..(kvh + 1) * hd];
            for (a, b) in oh.iter_mut().zip(vj) {
                *a += p * b;
            }
        }
    }
}

/// Partial sums of [`dot_split`]: one AVX-512 register.
const DOT_LANES: usize = 16;

/// `sum_i a_i b_i` in [`DOT_LANES`] interleaved partials, so it vectorises.
#[inline(always)]
fn dot_split(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let full = n - n % DOT_LANES;
    let mut acc = [0.0f32; DOT_LANES];
    for (x, y) in a[..full]
        .chunks_exact(DOT_LANES)
        .zip(b[..full].chunks_exact(DOT_LANES))
    {
        for l in 0..DOT_LANES {
            acc[l] += x[l] * y[l];
        }
    }
    let mut half = DOT_LANES / 2;
    while half > 0 {
        for l in 0..half {
            acc[l] += acc[l + half];
        }
        half /= 2;
    }
    let mut sum = acc[0];
    for i in full..n {
        sum += a[i] * b[i];
    }
    sum
}

/// [`dot_split`] in AVX-512 registers, the same bits: the partials are one
/// register (LLVM vectorised the portable loop as eight two-lane pieces),
/// and the halving tree adds the same pairs in the same order.
///
/// # Safety
/// AVX-512F is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot_split_avx512(a: &[f32], b: &[f32]) -> f32 {
    use std::arch::x86_64::*;
    let n = a.len().min(b.len());
    let full = n - n % DOT_LANES;
    let mut acc = _mm512_setzero_ps();
    for i in (0..full).step_by(DOT_LANES) {
        // SAFETY: i + DOT_LANES <= full <= both lengths.
        let (x, y) = unsafe {
            (
                _mm512_loadu_ps(a.as_ptr().add(i)),
                _mm512_loadu_ps(b.as_ptr().add(i)),
            )
        };
        acc = _mm512_add_ps(acc, _mm512_mul_ps(x, y));
    }
    // Halves of 8, 4, 2 and 1 lanes, as in `dot_split`.
    let hi8 = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
    let s8 = _mm256_add_ps(_mm512_castps512_ps256(acc), hi8);
    let s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps::<1>(s8));
    let s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    let s1 = _mm_add_ss(s2, _mm_shuffle_ps::<1>(s2, s2));
    let mut sum = _mm_cvtss_f32(s1);
    for i in full..n {
        sum += a[i] * b[i];
    }
    sum
}

/// Prefill attention in blocks, with the row path's arithmetic. Query rows
/// are cut into blocks of [`BLOCK_Q`]; a block, all heads, is one rayon task
/// that owns its rows of `out`. Block rows `i0..i0 + b` see keys `0..kn` with
/// `kn = nk - nq + i0 + b` (the causal frontier of the block's last row), so
/// keys past the block are never touched and the triangle costs half a
/// square. Per query head, each key row is read once for all the block's
/// rows that see it: scores with the same [`dot_split`] as a decode row,
/// each row softmaxed by the same [`softmax_body`], then every output the
/// same chain `0 + p_0 v_0 + p_1 v_1 + ...` in position order.
///
/// So a position's output has the same bits whichever way the sequence was
/// cut into calls: prefilled in one call or several, after a prefix hit, or
/// decoded a token at a time. The engine's log-probs and the trainer's
/// forward over the whole sequence then agree bit for bit. Matrix products
/// (the gemm crate) summed the values in blocks of at least 512 positions
/// and the scores with fused multiply-adds, so they agreed with a decode row
/// only to a few units in the last place, and a log-prob sometimes to 1e-5.
fn attention_blocked(out: &mut [f32], q: &[f32], k: &[f32], v: &[f32], dims: AttnDims, scale: f32) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { attention_blocked_avx512(out, q, k, v, dims, scale) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { attention_blocked_avx2(out, q, k, v, dims, scale) };
    }
    attention_blocked_body(out, q, k, v, dims, scale, dot_split)
}

/// [`attention_blocked_body`] compiled for AVX-512, with the register copy
/// of [`dot_split`] (the same bits).
///
/// # Safety
/// AVX-512F is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn attention_blocked_avx512(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) {
    attention_blocked_body(out, q, k, v, dims, scale, |a, b| {
        // SAFETY: this copy runs only where AVX-512F is present.
        unsafe { dot_split_avx512(a, b) }
    })
}

/// [`attention_blocked_body`] compiled for AVX2 (the same bits).
///
/// # Safety
/// AVX2 is present.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn attention_blocked_avx2(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) {
    attention_blocked_body(out, q, k, v, dims, scale, dot_split)
}

#[inline(always)]
fn attention_blocked_body(
    out: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
    dot: impl Fn(&[f32], &[f32]) -> f32 + Sync,
) {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let group = n_heads / n_kv_heads;
    let row_len = n_heads * hd;
    let kv_row = n_kv_heads * hd;
    out.par_chunks_mut(BLOCK_Q * row_len)
        .enumerate()
        .for_each_init(Vec::new, |scores: &mut Vec<f32>, (blk, o)| {
            let i0 = blk * BLOCK_Q;
            let b = o.len() / row_len;
            // Position of the block's first row; row r sees keys 0..=first + r.
            let first = nk - nq + i0;
            let kn = first + b;
            scores.resize(b * kn, 0.0);
            for h in 0..n_heads {
                let kvh = h / group;
                for j in 0..kn {
                    let kj = &k[j * kv_row + kvh * hd..][..hd];
                    for r in j.saturating_sub(first)..b {
                        let qr = &q[(i0 + r) * row_len + h * hd..][..hd];
                        scores[r * kn + j] = dot(qr, kj) * scale;
                    }
                }
                for (r, row) in scores.chunks_exact_mut(kn).enumerate() {
                    softmax_body(&mut row[..first + r + 1]);
                }
                for r in 0..b {
                    o[r * row_len + h * hd..][..hd].fill(0.0);
                }
                for j in 0..kn {
                    let vj = &v[j * kv_row + kvh * hd..][..hd];
                    for r in j.saturating_sub(first)..b {
                        let p = scores[r * kn + j];
                        let or = &mut o[r * row_len + h * hd..][..hd];
                        for (a, x) in or.iter_mut().zip(vj) {
                            *a += p * x;
                        }
                    }
                }
            }
        });
}

/// Lanes of the split reductions below: wide enough for LLVM to keep two SSE
/// (or one AVX) register of partial results, so the loops vectorise.
const LANES: usize = 8;

/// `x = softmax(x)` in f32, max-subtracted. The max and the sum run in
/// [`LANES`] interleaved partials (a different summation order from a plain
/// loop, same math), and the exponentials go through [`exp_poly`], so the
/// whole row vectorises; with libm's scalar `expf` the softmax cost as much
/// as the rest of the row. The crate is built for baseline x86-64 (SSE2):
/// its callers' copies compiled for AVX2 or AVX-512 run the same loops
/// wider, with the same bits (the lanes are explicit).
#[inline(always)]
fn softmax_body(x: &mut [f32]) {
    let mut m = [f32::NEG_INFINITY; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, b) in m.iter_mut().zip(c) {
            *a = a.max(*b);
        }
    }
    let max = chunks
        .remainder()
        .iter()
        .chain(&m)
        .fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    x.iter_mut().for_each(|s| *s = exp_poly(*s - max));
    let mut acc = [0.0f32; LANES];
    let mut chunks = x.chunks_exact(LANES);
    for c in &mut chunks {
        for (a, b) in acc.iter_mut().zip(c) {
            *a += b;
        }
    }
    let sum: f32 = acc.iter().sum::<f32>() + chunks.remainder().iter().sum::<f32>();
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|s| *s *= inv);
}

/// A strided, read-only view of an f32 matrix: element `(r, c)` is
/// `data[r * rs + c * cs]`.
#[derive(Clone, Copy)]
pub(crate) struct MatRef<'a> {
    pub data: &'a [f32],
    pub rows: usize,
    pub cols: usize,
    pub rs: usize,
    pub cs: usize,
}

impl MatRef<'_> {
    /// Whether every element the view names lies inside `len` elements.
    fn fits(rows: usize, cols: usize, rs: usize, cs: usize, len: usize) -> bool {
        rows == 0 || cols == 0 || (rows - 1) * rs + (cols - 1) * cs < len
    }
}

/// `dst = alpha * dst + beta * lhs @ rhs` on one thread, with `dst` row-major
/// (`lhs.rows x rhs.cols`, row stride `dst_rs`); `alpha = None` overwrites
/// `dst` without reading it. For the small products inside kernels that are
/// already parallel across heads or blocks (here and in `gated_delta`); it
/// would sit better beside `matmul`'s wrappers.
pub(crate) fn gemm_serial(
    dst: &mut [f32],
    dst_rs: usize,
    alpha: Option<f32>,
    lhs: MatRef<'_>,
    rhs: MatRef<'_>,
    beta: f32,
) {
    let (m, kk, n) = (lhs.rows, lhs.cols, rhs.cols);
    assert_eq!(kk, rhs.rows, "gemm_serial: inner sizes differ");
    assert!(MatRef::fits(m, n, dst_rs, 1, dst.len()), "gemm_serial: dst");
    assert!(
        MatRef::fits(m, kk, lhs.rs, lhs.cs, lhs.data.len()),
        "gemm_serial: lhs"
    );
    assert!(
        MatRef::fits(kk, n, rhs.rs, rhs.cs, rhs.data.len()),
        "gemm_serial: rhs"
    );
    if m == 0 || n == 0 {
        return;
    }
    if kk == 0 {
        for row in dst.chunks_mut(dst_rs).take(m) {
            match alpha {
                None => row[..n].fill(0.0),
                Some(a) => row[..n].iter_mut().for_each(|x| *x *= a),
            }
        }
        return;
    }
    // SAFETY: the asserts above keep every element gemm reads or writes
    // inside the three slices, and `dst` is borrowed mutably, so it aliases
    // neither operand.
    unsafe {
        gemm::gemm(
            m,
            n,
            kk,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            alpha.is_some(),
            lhs.data.as_ptr(),
            lhs.cs as isize,
            lhs.rs as isize,
            rhs.data.as_ptr(),
            rhs.cs as isize,
            rhs.rs as isize,
            alpha.unwrap_or(0.0),
            beta,
            false,
            false,
            false,
            Parallelism::None,
        );
    }
}

/// Backward of [`attention_forward`]: causal grouped-query attention for one
/// sequence, probabilities recomputed from q and k (nothing `[nq, nk]` is kept
/// from the forward), as FlashAttention's backward does. With `p = softmax(s)`,
/// `s_j = scale q . k_j`, `o = sum_j p_j v_j`: `dv_j += p_j do`,
/// `ds_j = p_j (do . v_j - do . o)`, `dq = scale sum_j ds_j k_j`,
/// `dk_j += scale ds_j q`. `dq`, `dk`, `dv` are all written (`=`). Parallel
/// over key/value heads: each task owns its kv head's rows of `dk`/`dv` and
/// the query heads of its group.
#[allow(clippy::too_many_arguments)]
pub fn attention_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) -> Result<()> {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let qn = nq * n_heads * hd;
    let kn = nk * n_kv_heads * hd;
    if n_kv_heads == 0
        || n_heads % n_kv_heads != 0
        || nq > nk
        || dq.len() != qn
        || dout.len() != qn
        || q.len() != qn
        || dk.len() != kn
        || dv.len() != kn
        || k.len() != kn
        || v.len() != kn
    {
        return Err(Error::Shape(format!(
            "attention_backward: {dims:?} with dq {} dk {} dv {} dout {} q {} k {} v {}",
            dq.len(),
            dk.len(),
            dv.len(),
            dout.len(),
            q.len(),
            k.len(),
            v.len()
        )));
    }
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    if nq == 0 || hd == 0 || n_heads == 0 {
        return Ok(());
    }
    if nq >= MIN_BLOCKED_NQ {
        attention_backward_blocked(dq, dk, dv, dout, q, k, v, dims, scale);
    } else {
        attention_backward_rows(dq, dk, dv, dout, q, k, v, dims, scale);
    }
    Ok(())
}

/// Row-wise backward (short query runs); outputs zeroed by the caller.
#[allow(clippy::too_many_arguments)]
fn attention_backward_rows(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let group = n_heads / n_kv_heads;
    let row = n_heads * hd;
    let kv_row = n_kv_heads * hd;
    // Per kv head: (dq of its query heads [nq, group, hd], dk [nk, hd], dv [nk, hd]).
    let parts: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..n_kv_heads)
        .into_par_iter()
        .map(|kvh| {
            let mut dq_g = vec![0.0f32; nq * group * hd];
            let mut dk_h = vec![0.0f32; nk * hd];
            let mut dv_h = vec![0.0f32; nk * hd];
            let mut p = vec![0.0f32; nk];
            let mut dp = vec![0.0f32; nk];
            let kj = |j: usize| &k[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            let vj = |j: usize| &v[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            for i in 0..nq {
                let last = nk - nq + i;
                for gi in 0..group {
                    let h = kvh * group + gi;
                    let qh = &q[i * row + h * hd..i * row + (h + 1) * hd];
                    let doh = &dout[i * row + h * hd..i * row + (h + 1) * hd];
                    let mut max = f32::NEG_INFINITY;
                    for (j, s) in p.iter_mut().enumerate().take(last + 1) {
                        *s = row_dot(qh, kj(j)) * scale;
                        max = max.max(*s);
                    }
                    let mut sum = 0.0f32;
                    for s in p.iter_mut().take(last + 1) {
                        *s = (*s - max).exp();
                        sum += *s;
                    }
                    let inv = 1.0 / sum;
                    let mut d_o = 0.0f32; // do . o = sum_j p_j (do . v_j)
                    for j in 0..=last {
                        p[j] *= inv;
                        dp[j] = row_dot(doh, vj(j));
                        d_o += p[j] * dp[j];
                    }
                    let dqh = &mut dq_g[(i * group + gi) * hd..(i * group + gi + 1) * hd];
                    for j in 0..=last {
                        let ds = p[j] * (dp[j] - d_o) * scale;
                        let kk = kj(j);
                        let dkj = &mut dk_h[j * hd..(j + 1) * hd];
                        let dvj = &mut dv_h[j * hd..(j + 1) * hd];
                        for x in 0..hd {
                            dqh[x] += ds * kk[x];
                            dkj[x] += ds * qh[x];
                            dvj[x] += p[j] * doh[x];
                        }
                    }
                }
            }
            (dq_g, dk_h, dv_h)
        })
        .collect();
    for (kvh, (dq_g, dk_h, dv_h)) in parts.iter().enumerate() {
        for i in 0..nq {
            for gi in 0..group {
                let h = kvh * group + gi;
                dq[i * row + h * hd..i * row + (h + 1) * hd]
                    .copy_from_slice(&dq_g[(i * group + gi) * hd..(i * group + gi + 1) * hd]);
            }
        }
        for j in 0..nk {
            let dst = j * kv_row + kvh * hd;
            dk[dst..dst + hd].copy_from_slice(&dk_h[j * hd..(j + 1) * hd]);
            dv[dst..dst + hd].copy_from_slice(&dv_h[j * hd..(j + 1) * hd]);
        }
    }
}

/// Prefill backward as matrix products, one rayon task per query head (so
/// MQA still has `n_heads` tasks), query rows in blocks of [`BLOCK_Q`]
/// reading only keys up to the block's causal frontier, as the forward's
/// blocked path does. Per block: `S = scale Q K^T`, masked softmax `P`,
/// `dP = dO V^T`, `dS = scale P (dP - rowsum(P dP))`, then `dQ = dS K`,
/// `dK += dS^T Q`, `dV += P^T dO`. Each head's `dK`/`dV` is private and
/// summed into its kv head afterwards. Outputs zeroed by the caller.
#[allow(clippy::too_many_arguments)]
fn attention_backward_blocked(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dout: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    dims: AttnDims,
    scale: f32,
) {
    let AttnDims {
        nq,
        nk,
        n_heads,
        n_kv_heads,
        head_dim: hd,
    } = dims;
    let group = n_heads / n_kv_heads;
    let row = n_heads * hd;
    let kv_row = n_kv_heads * hd;
    let heads: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..n_heads)
        .into_par_iter()
        .map(|h| {
            let kvh = h / group;
            let (qo, ko) = (h * hd, kvh * hd);
            let mut dq_h = vec![0.0f32; nq * hd];
            let mut dk_h = vec![0.0f32; nk * hd];
            let mut dv_h = vec![0.0f32; nk * hd];
            let mut p = vec![0.0f32; BLOCK_Q * nk];
            let mut ds = vec![0.0f32; BLOCK_Q * nk];
            let mut i0 = 0;
            while i0 < nq {
                let b = BLOCK_Q.min(nq - i0);
                let kn = nk - nq + i0 + b;
                let q_blk = MatRef {
                    data: &q[i0 * row + qo..],
                    rows: b,
                    cols: hd,
                    rs: row,
                    cs: 1,
                };
                let do_blk = MatRef {
                    data: &dout[i0 * row + qo..],
                    rows: b,
                    cols: hd,
                    rs: row,
                    cs: 1,
                };
                let k_t = MatRef {
                    data: &k[ko..],
                    rows: hd,
                    cols: kn,
                    rs: 1,
                    cs: kv_row,
                };
                let v_t = MatRef {
                    data: &v[ko..],
                    rows: hd,
                    cols: kn,
                    rs: 1,
                    cs: kv_row,
                };
                gemm_serial(&mut p[..b * kn], kn, None, q_blk, k_t, scale);
                gemm_serial(&mut ds[..b * kn], kn, None, do_blk, v_t, 1.0);
                for i in 0..b {
                    let last = nk - nq + i0 + i; // inclusive
                    let pr = &mut p[i * kn..(i + 1) * kn];
                    let dr = &mut ds[i * kn..(i + 1) * kn];
                    let max = pr[..=last]
                        .iter()
                        .cloned()
                        .fold(f32::NEG_INFINITY, f32::max);
                    let mut sum = 0.0f32;
                    for x in pr[..=last].iter_mut() {
                        *x = (*x - max).exp();
                        sum += *x;
                    }
                    let inv = 1.0 / sum;
                    let mut d_o = 0.0f32;
                    for (x, d) in pr[..=last].iter_mut().zip(&dr[..=last]) {
                        *x *= inv;
                        d_o += *x * d;
                    }
                    pr[last + 1..].fill(0.0);
                    for (d, x) in dr.iter_mut().zip(pr.iter()) {
                        *d = x * (*d - d_o) * scale;
                    }
                }
                let ds_m = MatRef {
                    data: &ds[..b * kn],
                    rows: b,
                    cols: kn,
                    rs: kn,
                    cs: 1,
                };
                let k_m = MatRef {
                    data: &k[ko..],
                    rows: kn,
                    cols: hd,
                    rs: kv_row,
                    cs: 1,
                };
                gemm_serial(&mut dq_h[i0 * hd..(i0 + b) * hd], hd, None, ds_m, k_m, 1.0);
                let ds_t = MatRef {
                    data: &ds[..b * kn],
                    rows: kn,
                    cols: b,
                    rs: 1,
                    cs: kn,
                };
                gemm_serial(&mut dk_h[..kn * hd], hd, Some(1.0), ds_t, q_blk, 1.0);
                let p_t = MatRef {
                    data: &p[..b * kn],
                    rows: kn,
                    cols: b,
                    rs: 1,
                    cs: kn,
                };
                gemm_serial(&mut dv_h[..kn * hd], hd, Some(1.0), p_t, do_blk, 1.0);
                i0 += b;
            }
            (dq_h, dk_h, dv_h)
        })
        .collect();
    for (h, (dq_h, dk_h, dv_h)) in heads.iter().enumerate() {
        let (qo, ko) = (h * hd, (h / group) * hd);
        for i in 0..nq {
            dq[i * row + qo..i * row + qo + hd].copy_from_slice(&dq_h[i * hd..(i + 1) * hd]);
        }
        for j in 0..nk {
            let o = j * kv_row + ko;
            for (d, s) in dk[o..o + hd].iter_mut().zip(&dk_h[j * hd..(j + 1) * hd]) {
                *d += s;
            }
            for (d, s) in dv[o..o + hd].iter_mut().zip(&dv_h[j * hd..(j + 1) * hd]) {
                *d += s;
            }
        }
    }
}

#[inline]
fn row_dot(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::StdRng, Rng, SeedableRng};

    fn naive(q: &[f32], k: &[f32], v: &[f32], d: AttnDims, scale: f32) -> Vec<f64> {
        let mut out = vec![0.0f64; d.nq * d.n_heads * d.head_dim];
        let g = d.n_heads / d.n_kv_heads;
        for i in 0..d.nq {
            let pos = d.nk - d.nq + i;
            for h in 0..d.n_heads {
                let kvh = h / g;
                let mut s: Vec<f64> = (0..=pos)
                    .map(|j| {
                        (0..d.head_dim)
                            .map(|x| {
                                q[(i * d.n_heads + h) * d.head_dim + x] as f64
                                    * k[(j * d.n_kv_heads + kvh) * d.head_dim + x] as f64
                            })
                            .sum::<f64>()
                            * scale as f64
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s
                    .iter_mut()
                    .map(|x| {
                        *x = (*x - m).exp();
                        *x
                    })
                    .sum();
                for (j, p) in s.iter().enumerate() {
                    for x in 0..d.head_dim {
                        out[(i * d.n_heads + h) * d.head_dim + x] +=
                            p / z * v[(j * d.n_kv_heads + kvh) * d.head_dim + x] as f64;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn gqa_causal_matches_naive_prefill_and_decode() {
        let mut rng = StdRng::seed_from_u64(7);
        // 16 and up take the blocked path: one partial block, a block
        // boundary, queries appended after a cached prefix.
        for &(nq, nk) in &[
            (1, 1),
            (5, 5),
            (1, 9),
            (3, 11),
            (16, 16),
            (70, 70),
            (20, 53),
            (130, 200),
        ] {
            let d = AttnDims {
                nq,
                nk,
                n_heads: 6,
                n_kv_heads: 2,
                head_dim: 5,
            };
            let q: Vec<f32> = (0..nq * 30).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let k: Vec<f32> = (0..nk * 10).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..nk * 10).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mut out = vec![0.0; nq * 30];
            attention_forward(&mut out, &q, &k, &v, d, 0.4).unwrap();
            let want = naive(&q, &k, &v, d, 0.4);
            for (a, b) in out.iter().zip(&want) {
                assert!((*a as f64 - b).abs() < 1e-5, "{nq}/{nk}: {a} vs {b}");
            }
        }
    }

    /// A position's output has the same bits whichever way its sequence is
    /// cut into calls: one prefill, a prefill after a cached prefix (other
    /// block alignments), or a decode row, past the 512 positions where a
    /// matrix product would split its sum. The engine/trainer identity rests
    /// on it.
    #[test]
    fn every_cut_of_a_sequence_gives_the_same_bits() {
        let mut rng = StdRng::seed_from_u64(21);
        // Head widths for the portable body and both register paths.
        for (n_heads, n_kv_heads, hd, l) in [(4, 2, 32, 700), (6, 2, 5, 150), (2, 1, 64, 530)] {
            let (row, kv_row) = (n_heads * hd, n_kv_heads * hd);
            let q: Vec<f32> = (0..l * row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let k: Vec<f32> = (0..l * kv_row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..l * kv_row).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let dims = |nq, nk| AttnDims {
                nq,
                nk,
                n_heads,
                n_kv_heads,
                head_dim: hd,
            };
            let mut full = vec![0.0; l * row];
            attention_forward(&mut full, &q, &k, &v, dims(l, l), 0.3).unwrap();
            for past in [1, 17, 64, 100, l - 40] {
                let n = l - past;
                let mut part = vec![0.0; n * row];
                let kv = ..l * kv_row;
                attention_forward(&mut part, &q[past * row..], &k[kv], &v[kv], dims(n, l), 0.3)
                    .unwrap();
                assert!(part == full[past * row..], "{hd}/{l}: prefill after {past}");
            }
            for p in [0, 15, 16, 63, 64, 511, 512, l - 1]
                .into_iter()
                .filter(|&p| p < l)
            {
                let mut one = vec![0.0; row];
                let kv = ..(p + 1) * kv_row;
                attention_forward(
                    &mut one,
                    &q[p * row..(p + 1) * row],
                    &k[kv],
                    &v[kv],
                    dims(1, p + 1),
                    0.3,
                )
                .unwrap();
                assert!(
                    one == full[p * row..(p + 1) * row],
                    "{hd}/{l}: decode row {p}"
                );
            }
        }
    }

    /// Keys read in place from shuffled blocks give the bits of the same
    /// keys in one piece; a table that does not cover the past is an error.
    #[test]
    fn avx512_dot_has_the_portable_bits() {
        #[cfg(target_arch = "x86_64")]
        if std::arch::is_x86_feature_detected!("avx512f") {
            let mut rng = StdRng::seed_from_u64(11);
            for n in [0, 1, 15, 16, 17, 64, 100, 128, 257] {
                let a: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
                let b: Vec<f32> = (0..n).map(|_| rng.gen_range(-3.0..3.0)).collect();
                // SAFETY: AVX-512F checked above.
                let fast = unsafe { dot_split_avx512(&a, &b) };
                assert_eq!(fast.to_bits(), dot_split(&a, &b).to_bits(), "n = {n}");
            }
        }
    }

    #[test]
    fn vector_row_paths_have_the_portable_bits() {
        let mut rng = StdRng::seed_from_u64(12);
        for (n_heads, n_kv_heads, hd) in [
            (4, 2, 16),
            (4, 2, 64),
            (8, 2, 32),
            (4, 2, 128),
            (6, 2, 48),
            (4, 4, 64),
            (4, 2, 40),
        ] {
            for live in [1, 7, 33] {
                let dims = AttnDims {
                    nq: 1,
                    nk: live,
                    n_heads,
                    n_kv_heads,
                    head_dim: hd,
                };
                let kv_row = n_kv_heads * hd;
                let mut r =
                    |n: usize| -> Vec<f32> { (0..n).map(|_| rng.gen_range(-2.0..2.0)).collect() };
                let (q, k, v) = (r(n_heads * hd), r(live * kv_row), r(live * kv_row));
                let kv = Contiguous {
                    k: &k,
                    v: &v,
                    kv_row,
                };
                let mut fast = vec![0.0f32; n_heads * hd];
                attend_row(&mut fast, &q, &kv, &mut vec![0.0; 2 * live], dims, 0.125);
                let mut slow = vec![0.0f32; n_heads * hd];
                attend_row_body(
                    &mut slow,
                    &q,
                    &kv,
                    &mut vec![0.0; live],
                    dims,
                    0.125,
                    dot_split,
                );
                let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&fast),
                    bits(&slow),
                    "heads {n_heads}/{n_kv_heads}, hd {hd}, live {live}"
                );
            }
        }
    }

    #[test]
    fn paged_rows_match_contiguous_bit_for_bit() {
        let mut rng = StdRng::seed_from_u64(9);
        let (n_heads, n_kv_heads, hd, bs) = (4, 2, 8, 4);
        let r = n_kv_heads * hd;
        for &(nq, nk) in &[(1, 1), (1, 10), (3, 11), (2, 8), (1, 4)] {
            let past = nk - nq;
            let d = AttnDims {
                nq,
                nk,
                n_heads,
                n_kv_heads,
                head_dim: hd,
            };
            let q: Vec<f32> = (0..nq * n_heads * hd)
                .map(|_| rng.gen_range(-2.0..2.0))
                .collect();
            let k: Vec<f32> = (0..nk * r).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let v: Vec<f32> = (0..nk * r).map(|_| rng.gen_range(-2.0..2.0)).collect();
            let mut want = vec![0.0; nq * n_heads * hd];
            attention_forward(&mut want, &q, &k, &v, d, 0.3).unwrap();
            // Past positions scattered over blocks 5, 2, 7 of a pool of 8.
            let blocks: Vec<u32> = [5u32, 2, 7][..past.div_ceil(bs)].to_vec();
            let mut k_pool = vec![f32::NAN; 8 * bs * r];
            let mut v_pool = vec![f32::NAN; 8 * bs * r];
            for p in 0..past {
                let at = (blocks[p / bs] as usize * bs + p % bs) * r;
                k_pool[at..at + r].copy_from_slice(&k[p * r..(p + 1) * r]);
                v_pool[at..at + r].copy_from_slice(&v[p * r..(p + 1) * r]);
            }
            let kv = PagedKv {
                k_pool: &k_pool,
                v_pool: &v_pool,
                blocks: &blocks,
                block_size: bs,
                past,
                new_k: &k[past * r..],
                new_v: &v[past * r..],
                kv_row: r,
            };
            let mut out = vec![0.0; nq * n_heads * hd];
            attention_forward_paged(&mut out, &q, &kv, d, 0.3).unwrap();
            let bits = |x: &[f32]| x.iter().map(|a| a.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&out), bits(&want), "{nq}/{nk}");
            if past > 0 {
                let short = PagedKv {
                    blocks: &blocks[..blocks.len() - 1],
                    ..kv
                };
                if short.blocks.len() * bs < past {
                    assert!(attention_forward_paged(&mut out, &q, &short, d, 0.3).is_err());
                }
                let outside = [8u32, 0, 0];
                let bad = PagedKv {
                    blocks: &outside[..blocks.len()],
                    ..kv
                };
                assert!(attention_forward_paged(&mut out, &q, &bad, d, 0.3).is_err());
            }
        }
    }

    #[test]
    fn rejects_bad_head_counts() {
        let d = AttnDims {
            nq: 1,
            nk: 1,
            n_heads: 3,
            n_kv_heads: 2,
            head_dim: 1,
        };
        let mut out = vec![0.0; 3];
        assert!(attention_forward(&mut out, &[0.0; 3], &[0.0; 2], &[0.0; 2], d, 1.0).is_err());
    }

    mod backward {
        use super::super::*;
        use crate::cpu::gradcheck::{check as fd_check, rand_vec, rng};

        #[test]
        fn blocked_backward_matches_row_backward() {
            let mut r = rng(6);
            // Odd sizes: a partial last block, queries that are a suffix, MQA.
            for &(nq, nk, nh, nkv, hd) in
                &[(70, 70, 4, 2, 5), (17, 30, 3, 1, 8), (130, 131, 2, 2, 3)]
            {
                let dims = AttnDims {
                    nq,
                    nk,
                    n_heads: nh,
                    n_kv_heads: nkv,
                    head_dim: hd,
                };
                let q = rand_vec(&mut r, nq * nh * hd, 1.0);
                let k = rand_vec(&mut r, nk * nkv * hd, 1.0);
                let v = rand_vec(&mut r, nk * nkv * hd, 1.0);
                let dout = rand_vec(&mut r, nq * nh * hd, 1.0);
                let mut a = [vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]];
                let mut b = a.clone();
                {
                    let [x, y, z] = &mut a;
                    attention_backward_rows(x, y, z, &dout, &q, &k, &v, dims, 0.3);
                }
                {
                    let [x, y, z] = &mut b;
                    attention_backward_blocked(x, y, z, &dout, &q, &k, &v, dims, 0.3);
                }
                for (ga, gb) in a.iter().zip(&b) {
                    for (x, y) in ga.iter().zip(gb) {
                        assert!(
                            (x - y).abs() < 1e-5 * (1.0 + x.abs()),
                            "{nq}/{nk}: {x} vs {y}"
                        );
                    }
                }
            }
        }

        #[test]
        fn backward_matches_finite_differences_prefill_and_suffix() {
            let mut r = rng(5);
            // (nq, nk): full prefill, and queries that are the tail of a longer run;
            // 20 rows also exercises the forward's blocked path.
            for &(nq, nk) in &[(4, 4), (2, 5), (20, 20)] {
                let dims = AttnDims {
                    nq,
                    nk,
                    n_heads: 4,
                    n_kv_heads: 2,
                    head_dim: 3,
                };
                let scale = 0.7;
                let mut q = rand_vec(&mut r, nq * 12, 1.0);
                let mut k = rand_vec(&mut r, nk * 6, 1.0);
                let mut v = rand_vec(&mut r, nk * 6, 1.0);
                let probe = rand_vec(&mut r, nq * 12, 1.0);
                let (mut dq, mut dk, mut dv) =
                    (vec![1.0; nq * 12], vec![1.0; nk * 6], vec![1.0; nk * 6]);
                attention_backward(&mut dq, &mut dk, &mut dv, &probe, &q, &k, &v, dims, scale)
                    .unwrap();
                let loss = |q: &[f32], k: &[f32], v: &[f32]| {
                    let mut out = vec![0.0; nq * 12];
                    attention_forward(&mut out, q, k, v, dims, scale).unwrap();
                    out.iter()
                        .zip(&probe)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                };
                let (q0, k0, v0) = (q.clone(), k.clone(), v.clone());
                fd_check("dq", &mut q, &dq, |x| loss(x, &k0, &v0), 1e-2, 2e-3);
                fd_check("dk", &mut k, &dk, |x| loss(&q0, x, &v0), 1e-2, 2e-3);
                fd_check("dv", &mut v, &dv, |x| loss(&q0, &k0, x), 1e-2, 2e-3);
            }
        }
    }
}
