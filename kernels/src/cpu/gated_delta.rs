//! Gated delta rule: the sequence mixer of Qwen3.5's Gated DeltaNet layers,
//! forward and backward, for one sequence. The semantics are those of
//! flash-linear-attention's `chunk_gated_delta_rule` and
//! `fused_recurrent_gated_delta_rule` (Yang, Kautz, Hatamizadeh, "Gated Delta
//! Networks", 2024).
//!
//! Not for: the projections, the causal conv, the L2 normalisation of q and k
//! or the q scaling by `dk^-0.5` (the caller does those), nor batching several
//! sequences (call once per sequence, each with its own state).
//!
//! Layouts: `q`, `k` are `[T, nk, dk]`; `v` is `[T, nv, dv]`; `g` (log decay,
//! `<= 0`) and `beta` are `[T, nv]`; `out` is `[T, nv, dv]`; `state` is
//! `[nv, dk, dv]` f32, read as the initial state and overwritten with the
//! final one, so decode carries it from call to call. Value head `h` reads key
//! head `h / (nv / nk)`. `out` and `state` are written (`=`), never
//! accumulated.
//!
//! Recurrence, per value head, per token `t`, with state `S` (`dk x dv`):
//!
//! ```text
//! S     = exp(g_t) S
//! delta = beta_t (v_t - S^T k_t)
//! S     = S + k_t delta^T
//! o_t   = S^T q_t
//! ```
//!
//! `gated_delta_recurrent_forward` runs that literally (the reference, and the
//! decode path). `gated_delta_chunked_forward` computes the same function a
//! chunk of `C` tokens at a time. Within a chunk, with `G_i` the cumulative
//! log decay up to token `i` and `S0` the state entering the chunk, unrolling
//! the recurrence gives `(I + L) Delta = diag(beta) V - diag(beta exp(G)) K S0`
//! where `L[i][j] = beta_i (k_i . k_j) exp(G_i - G_j)` for `j < i` (the WY / UT
//! representation). One forward substitution against the unit lower
//! triangular `I + L` yields the pseudo-values `U` and the decayed keys `W`,
//! so `Delta = U - W S0`. Then `o_i = exp(G_i) S0^T q_i + sum_{j<=i} exp(G_i -
//! G_j) (q_i . k_j) delta_j` (intra-chunk causal attention with a decay mask)
//! and the state passes to the next chunk as `exp(G_last) S0 + sum_j
//! exp(G_last - G_j) k_j delta_j^T`. Every exponent is a difference `G_i - G_j`
//! with `i >= j` (or a `G_i` alone), hence `<= 0`: no `exp(-G)` ever overflows.
//! The state-touching work is matrix products over the whole chunk; only the
//! `C x C` substitution stays sequential.
//!
//! Heads are independent and run in parallel with rayon. The backward comes
//! in the same two forms, each the exact gradient of the one function:
//! [`gated_delta_backward`] (recurrent, see the comment above it) and
//! [`gated_delta_chunked_backward_from_checkpoints`] (WY, see the comment
//! above `head_backward_chunked`); both write (`=`) every gradient.

use rayon::prelude::*;

use crate::cpu::attention::{gemm_serial, MatRef};
use crate::cpu::{prefetch_line, prefetch_rows};
use crate::{Error, Result};

/// Sizes of one gated-delta call: `t` tokens, `nk` key heads of width `dk`,
/// `nv` value heads of width `dv` (`nv` a multiple of `nk`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GatedDeltaDims {
    pub t: usize,
    pub nk: usize,
    pub nv: usize,
    pub dk: usize,
    pub dv: usize,
}

/// Default chunk length of the chunked form (as in the reference kernels).
pub const CHUNK: usize = 64;

/// The f32 scratch (in floats) the GPU's chunked backward allocates for
/// `tokens` packed over at most `sequences` sequences
/// (`CudaDevice::gated_delta_chunked_backward`: per token the recomputed
/// output, `U`, `Delta`, its gradient and `dRv` at value width, `W`,
/// `dQg`, `dKd`, `dRk` and the per-value-head `dq`, `dk` at key width, and
/// the f64 cumulative decay; per chunk the masked attention, `KKE`, the
/// entering state and its gradient; per sequence a state and its
/// gradient), for memory plans. `(nk, nv, dk, dv)` as the forward's.
pub fn chunked_backward_scratch_floats(
    tokens: usize,
    sequences: usize,
    (_nk, nv, dk, dv): (usize, usize, usize, usize),
) -> usize {
    let chunks = tokens.div_ceil(CHUNK) + sequences;
    let state = nv * dk * dv;
    tokens * nv * (5 * dv + 6 * dk + 2)
        + chunks * (2 * nv * CHUNK * CHUNK + 2 * state)
        + sequences * 2 * state
}

/// Token-by-token gated delta rule; see the module header.
#[allow(clippy::too_many_arguments)] // the llm.c convention: outputs, state, inputs, sizes
pub fn gated_delta_recurrent_forward(
    out: &mut [f32],
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    let layout = Layout::check(out, state, q, k, v, g, beta, dims)?;
    for_each_head(out, state, dims, |h, s, out_h| {
        recurrent_head(out_h, s, q, k, v, g, beta, &layout, h)
    });
    Ok(())
}

/// Prefetches what a one-token [`gated_delta_recurrent_forward`] on `state`
/// reads first (head 0; the call fetches each next head ahead of itself),
/// so a caller can start it for the next sequence's state while this one
/// runs. A hint: `state` is never read through.
pub fn warm_state(state: *const f32, dims: GatedDeltaDims) {
    prefetch_rows(state, 1, 0, dims.dk * dims.dv);
}

/// [`gated_delta_recurrent_forward`] that also saves the state before every
/// [`CHECKPOINT_EVERY`]-th token into `checkpoints` (`[ceil(t /
/// CHECKPOINT_EVERY)` (at least 1)`, nv, dk, dv]`; the first is the incoming state), for
/// [`gated_delta_backward_from_checkpoints`]. The same bits as one call.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_recurrent_forward_checkpointed(
    out: &mut [f32],
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
    checkpoints: &mut [f32],
) -> Result<()> {
    Layout::check(out, state, q, k, v, g, beta, dims)?;
    let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
    let sn = nv * dk * dv;
    if checkpoints.len() != t.div_ceil(CHECKPOINT_EVERY).max(1) * sn {
        return Err(Error::Shape(format!(
            "gated delta checkpoints: {} floats for {dims:?}",
            checkpoints.len()
        )));
    }
    if t == 0 {
        checkpoints.copy_from_slice(state);
        return Ok(());
    }
    for (c, cp) in checkpoints.chunks_exact_mut(sn.max(1)).enumerate() {
        let (t0, t1) = (c * CHECKPOINT_EVERY, ((c + 1) * CHECKPOINT_EVERY).min(t));
        cp.copy_from_slice(state);
        gated_delta_recurrent_forward(
            &mut out[t0 * nv * dv..t1 * nv * dv],
            state,
            &q[t0 * nk * dk..t1 * nk * dk],
            &k[t0 * nk * dk..t1 * nk * dk],
            &v[t0 * nv * dv..t1 * nv * dv],
            &g[t0 * nv..t1 * nv],
            &beta[t0 * nv..t1 * nv],
            GatedDeltaDims { t: t1 - t0, ..dims },
        )?;
    }
    Ok(())
}

/// Chunked gated delta rule (WY representation, `chunk` tokens per step);
/// computes the same function as [`gated_delta_recurrent_forward`] up to
/// rounding. A final partial chunk is handled; `chunk` must be positive.
#[allow(clippy::too_many_arguments)] // the llm.c convention: outputs, state, inputs, sizes
pub fn gated_delta_chunked_forward(
    out: &mut [f32],
    state: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
    chunk: usize,
) -> Result<()> {
    if chunk == 0 {
        return Err(Error::Shape("gated delta: chunk length must be > 0".into()));
    }
    let layout = Layout::check(out, state, q, k, v, g, beta, dims)?;
    for_each_head(out, state, dims, |h, s, out_h| {
        chunked_head(out_h, s, q, k, v, g, beta, &layout, h, chunk)
    });
    Ok(())
}

/// Validated sizes plus the key-head ratio, shared by both forms.
struct Layout {
    dims: GatedDeltaDims,
    /// Value heads per key head.
    r: usize,
}

impl Layout {
    #[allow(clippy::too_many_arguments)]
    fn check(
        out: &[f32],
        state: &[f32],
        q: &[f32],
        k: &[f32],
        v: &[f32],
        g: &[f32],
        beta: &[f32],
        dims: GatedDeltaDims,
    ) -> Result<Self> {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        if nk == 0 {
            if nv != 0 {
                return Err(Error::Shape(format!(
                    "gated delta: nk = 0 key heads but nv = {nv} value heads"
                )));
            }
        } else if nv % nk != 0 {
            return Err(Error::Shape(format!(
                "gated delta: nv = {nv} value heads is not a multiple of nk = {nk} key heads"
            )));
        }
        let want = |name: &str, got: usize, sizes: &[usize], shape: &str| -> Result<()> {
            let n = sizes
                .iter()
                .try_fold(1usize, |acc, &d| acc.checked_mul(d))
                .ok_or_else(|| Error::Shape(format!("gated delta: {name} {shape} overflows")))?;
            if got != n {
                return Err(Error::Shape(format!(
                    "gated delta: {name} has {got} elements, expected {shape} = {n} ({dims:?})"
                )));
            }
            Ok(())
        };
        want("q", q.len(), &[t, nk, dk], "[t, nk, dk]")?;
        want("k", k.len(), &[t, nk, dk], "[t, nk, dk]")?;
        want("v", v.len(), &[t, nv, dv], "[t, nv, dv]")?;
        want("g", g.len(), &[t, nv], "[t, nv]")?;
        want("beta", beta.len(), &[t, nv], "[t, nv]")?;
        want("out", out.len(), &[t, nv, dv], "[t, nv, dv]")?;
        want("state", state.len(), &[nv, dk, dv], "[nv, dk, dv]")?;
        // nk == 0 (then nv == 0 too) has no heads; 1 just keeps `key_row` total.
        let r = nv.checked_div(nk).unwrap_or(1);
        Ok(Self { dims, r })
    }

    /// Row of `q`/`k` for token `t`, value head `h`.
    #[inline]
    fn key_row<'a>(&self, x: &'a [f32], t: usize, h: usize) -> &'a [f32] {
        let d = &self.dims;
        let off = (t * d.nk + h / self.r) * d.dk;
        &x[off..off + d.dk]
    }

    /// Row of `v` for token `t`, value head `h`.
    #[inline]
    fn value_row<'a>(&self, v: &'a [f32], t: usize, h: usize) -> &'a [f32] {
        let d = &self.dims;
        let off = (t * d.nv + h) * d.dv;
        &v[off..off + d.dv]
    }

    /// Scalar of a `[t, nv]` tensor (`g`, `beta`).
    #[inline]
    fn head_scalar(&self, x: &[f32], t: usize, h: usize) -> f32 {
        x[t * self.dims.nv + h]
    }
}

/// Runs `f(h, state_h, out_h)` for every value head in parallel, where
/// `out_h` is that head's output as a contiguous `[t, dv]` slice. For a single
/// token (decode) the heads' rows of `out` are already contiguous and disjoint,
/// so they are handed out directly and nothing is allocated; for longer inputs
/// each head writes a private buffer that is scattered into `out` afterwards.
fn for_each_head<F>(out: &mut [f32], state: &mut [f32], dims: GatedDeltaDims, f: F)
where
    F: Fn(usize, &mut [f32], &mut [f32]) + Sync,
{
    let GatedDeltaDims { t, nv, dk, dv, .. } = dims;
    if nv == 0 || t == 0 {
        return;
    }
    let state_len = dk * dv;
    if state_len == 0 {
        // Degenerate widths: an empty state gives zero outputs, and
        // chunks_mut(0) would panic.
        out.fill(0.0);
        return;
    }
    if t == 1 && nv * state_len <= SERIAL_STATE {
        // Decode of a small state: too little work to share out.
        for (h, (s, o)) in state
            .chunks_mut(state_len)
            .zip(out.chunks_mut(dv))
            .enumerate()
        {
            f(h, s, o);
        }
        return;
    }
    if t == 1 {
        state
            .par_chunks_mut(state_len)
            .zip(out.par_chunks_mut(dv))
            .enumerate()
            .for_each(|(h, (s, o))| f(h, s, o));
        return;
    }
    let mut per_head = vec![0.0f32; nv * t * dv];
    state
        .par_chunks_mut(state_len)
        .zip(per_head.par_chunks_mut(t * dv))
        .enumerate()
        .for_each(|(h, (s, o))| f(h, s, o));
    out.par_chunks_mut(nv * dv)
        .enumerate()
        .for_each(|(ti, row)| {
            for (h, dst) in row.chunks_mut(dv).enumerate() {
                let src = &per_head[(h * t + ti) * dv..(h * t + ti + 1) * dv];
                dst.copy_from_slice(src);
            }
        });
}

/// A one-token step over at most this many state floats (all heads) runs
/// on the calling thread: splitting it costs more than it saves.
const SERIAL_STATE: usize = 1 << 15;

/// Value widths up to this keep the recurrent form's two scratch vectors on
/// the stack, so the decode path allocates nothing.
const STACK_DV: usize = 256;

/// One value head, token by token; see [`recurrent_head_body`]. The crate is
/// built for baseline x86-64 (SSE2); where the CPU has AVX2 the same loops
/// run from a copy compiled for it, twice as wide.
#[allow(clippy::too_many_arguments)]
fn recurrent_head(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
) {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        // SAFETY: the CPU supports AVX-512F, checked just above.
        return unsafe { recurrent_head_avx512(out_h, s, q, k, v, g, beta, layout, h) };
    }
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU supports AVX2, checked just above.
        return unsafe { recurrent_head_avx2(out_h, s, q, k, v, g, beta, layout, h) };
    }
    recurrent_head_body(out_h, s, q, k, v, g, beta, layout, h)
}

/// [`recurrent_head_body`] for AVX-512: a [`TILE`] of columns is one
/// register. No multiply-add is contracted (Rust never fuses them), so the
/// bits are those of the other copies.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[allow(clippy::too_many_arguments)]
unsafe fn recurrent_head_avx512(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
) {
    let GatedDeltaDims { t, dv, .. } = layout.dims;
    if t == 1 && dv % 16 == 0 {
        let args = (
            layout.key_row(q, 0, h),
            layout.key_row(k, 0, h),
            layout.value_row(v, 0, h),
            layout.head_scalar(g, 0, h).exp(),
            layout.head_scalar(beta, 0, h),
        );
        // SAFETY (each arm): AVX-512F is present (this function's
        // contract); dv is 16 times the const.
        match dv / 16 {
            1 => return unsafe { decode_head_avx512::<1>(out_h, s, args) },
            2 => return unsafe { decode_head_avx512::<2>(out_h, s, args) },
            4 => return unsafe { decode_head_avx512::<4>(out_h, s, args) },
            8 => return unsafe { decode_head_avx512::<8>(out_h, s, args) },
            _ => {}
        }
    }
    recurrent_head_body(out_h, s, q, k, v, g, beta, layout, h)
}

/// One value head, one token (a decode step), `dv = 16 NC`, in AVX-512
/// registers: the same arithmetic as [`first_pass`] with the same bits (no
/// product fused into an add), but over whole rows of `S` (`S` read along
/// memory, and the NC column sums are independent chains where a tile had
/// one): `S^T k` down the rows, then `delta`, then a second pass down the
/// rows (now in L1) applying the update and summing the readout, while the
/// next head's rows are fetched.
///
/// # Safety
/// AVX-512F is present; `o` holds `dv`, `s` `dk x dv` values (`dk` the
/// length of `q` and `k`), `v` `dv`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn decode_head_avx512<const NC: usize>(
    o: &mut [f32],
    s: &mut [f32],
    (q, k, v, decay, b): (&[f32], &[f32], &[f32], f32, f32),
) {
    use std::arch::x86_64::*;
    let dv = 16 * NC;
    let dk = k.len();
    assert!(o.len() == dv && v.len() == dv && q.len() == dk && s.len() == dk * dv);
    let head = s.len();
    let sp = s.as_mut_ptr();
    // SAFETY (loads and stores below): rows i < dk of dv floats lie in `s`,
    // and `o`, `v` hold dv floats (asserted above).
    let mut d = [_mm512_setzero_ps(); NC];
    for (i, &ki) in k.iter().enumerate() {
        let row = unsafe { sp.add(i * dv) };
        let ki = _mm512_set1_ps(ki);
        for (c, dc) in d.iter_mut().enumerate() {
            let x = unsafe { _mm512_loadu_ps(row.add(16 * c)) };
            *dc = _mm512_add_ps(*dc, _mm512_mul_ps(ki, x));
        }
    }
    let (vb, vdecay) = (_mm512_set1_ps(b), _mm512_set1_ps(decay));
    for (c, dc) in d.iter_mut().enumerate() {
        let vc = unsafe { _mm512_loadu_ps(v.as_ptr().add(16 * c)) };
        *dc = _mm512_mul_ps(vb, _mm512_sub_ps(vc, _mm512_mul_ps(vdecay, *dc)));
    }
    let mut oa = [_mm512_setzero_ps(); NC];
    for (i, (&ki, &qi)) in k.iter().zip(q).enumerate() {
        let row = unsafe { sp.add(i * dv) };
        for c in 0..NC {
            prefetch_line(row.wrapping_add(head + 16 * c));
        }
        let (ki, qi) = (_mm512_set1_ps(ki), _mm512_set1_ps(qi));
        for c in 0..NC {
            let x = unsafe { _mm512_loadu_ps(row.add(16 * c)) };
            let y = _mm512_add_ps(_mm512_mul_ps(vdecay, x), _mm512_mul_ps(ki, d[c]));
            unsafe { _mm512_storeu_ps(row.add(16 * c), y) };
            oa[c] = _mm512_add_ps(oa[c], _mm512_mul_ps(qi, y));
        }
    }
    for (c, oc) in oa.iter().enumerate() {
        unsafe { _mm512_storeu_ps(o.as_mut_ptr().add(16 * c), *oc) };
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[allow(clippy::too_many_arguments)]
unsafe fn recurrent_head_avx2(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
) {
    recurrent_head_body(out_h, s, q, k, v, g, beta, layout, h)
}

/// One value head, token by token, in a single pass over `S` per token. The
/// pass over row `i` of `S` applies the update `s_i = exp(g) s_i + k_i
/// delta` and, while the row is in registers, accumulates both this token's
/// readout `o += q_i s_i` and the next token's `S^T k_{t+1}` (taken before
/// its decay, which is folded into its `delta` instead). Each accumulation
/// runs over `i` in order, so the result is bit-for-bit the three-pass
/// recurrence; `S` is read and written once per token instead of three
/// times. Inner loops run over `dv`, contiguous in `S`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn recurrent_head_body(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
) {
    let GatedDeltaDims { t, dv, .. } = layout.dims;
    let mut stack = [0.0f32; 2 * STACK_DV];
    let mut heap = Vec::new();
    let scratch: &mut [f32] = if dv <= STACK_DV {
        &mut stack[..2 * dv]
    } else {
        heap.resize(2 * dv, 0.0);
        &mut heap
    };
    // cur: S^T k_t, then delta_t in place; next: S^T k_{t+1}.
    let (mut cur, mut next) = scratch.split_at_mut(dv);

    for ti in 0..t {
        let kt = layout.key_row(k, ti, h);
        let qt = layout.key_row(q, ti, h);
        let vt = layout.value_row(v, ti, h);
        let decay = layout.head_scalar(g, ti, h).exp();
        let b = layout.head_scalar(beta, ti, h);
        let o = &mut out_h[ti * dv..(ti + 1) * dv];
        let kn = layout.key_row(k, (ti + 1).min(t - 1), h);
        if ti == 0 {
            // The first token's S^T k is taken tile by tile inside the pass,
            // so each tile of S is read from memory once (a decode step is
            // this pass alone).
            if t > 1 {
                first_pass::<true>(s, kt, qt, kn, vt, decay, b, o, next);
            } else {
                first_pass::<false>(s, kt, qt, kn, vt, decay, b, o, next);
            }
        } else {
            // delta = beta (v - (exp(g) S_old)^T k)
            for (d, vj) in cur.iter_mut().zip(vt) {
                *d = b * (vj - decay * *d);
            }
            if ti + 1 < t {
                fused_pass::<true>(s, kt, qt, kn, decay, cur, o, next);
            } else {
                fused_pass::<false>(s, kt, qt, kn, decay, cur, o, next);
            }
        }
        std::mem::swap(&mut cur, &mut next);
    }
}

/// [`fused_pass`] for a call's first token, whose `S^T k` is not known yet:
/// per tile of columns, first `S^T k` over the tile's rows (in order, so the
/// same sums as a separate pass), then `delta` and the tile's update. The
/// tile stays in L1 between the two, so `S` is read once instead of twice.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn first_pass<const NEXT: bool>(
    s: &mut [f32],
    kt: &[f32],
    qt: &[f32],
    kn: &[f32],
    vt: &[f32],
    decay: f32,
    b: f32,
    o: &mut [f32],
    next: &mut [f32],
) {
    let dv = vt.len();
    let full = dv - dv % TILE;
    let delta_of = |cur: f32, vj: f32| b * (vj - decay * cur);
    let head = s.len();
    for j0 in (0..full).step_by(TILE) {
        // While this tile is read, each row fetches its line two tiles on,
        // past the last tile in the next head (heads lie end to end): a
        // decode step streams S from memory, and one tile ahead is too
        // late (measured on a cold decode of 96 states: 460 us without,
        // 395 one tile ahead, 260 two ahead).
        let on = j0 + 2 * TILE;
        let ahead = if on < full { on } else { head + on - full };
        let mut d = [0.0f32; TILE];
        for (ki, s_i) in kt.iter().zip(s.chunks_exact(dv)) {
            prefetch_line(s_i.as_ptr().wrapping_add(ahead));
            for j in 0..TILE {
                d[j] += ki * s_i[j0 + j];
            }
        }
        for j in 0..TILE {
            d[j] = delta_of(d[j], vt[j0 + j]);
        }
        update_tile::<NEXT>(s, kt, qt, kn, decay, &d, j0, o, next);
    }
    if full < dv {
        let mut d = vec![0.0f32; dv - full];
        for (ki, s_i) in kt.iter().zip(s.chunks_exact(dv)) {
            for (dj, x) in d.iter_mut().zip(&s_i[full..]) {
                *dj += ki * x;
            }
        }
        for (dj, vj) in d.iter_mut().zip(&vt[full..]) {
            *dj = delta_of(*dj, *vj);
        }
        fused_columns::<NEXT>(s, kt, qt, kn, decay, &d, full, o, next);
    }
}

/// The update of [`fused_pass`] on the tile of columns `j0..j0 + TILE`,
/// whose `delta` is `d`: down the rows of `S`, accumulating the tile's `o`
/// (and `next`) in registers.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn update_tile<const NEXT: bool>(
    s: &mut [f32],
    kt: &[f32],
    qt: &[f32],
    kn: &[f32],
    decay: f32,
    d: &[f32; TILE],
    j0: usize,
    o: &mut [f32],
    next: &mut [f32],
) {
    let dv = o.len();
    let mut oa = [0.0f32; TILE];
    let mut na = [0.0f32; TILE];
    for (((ki, qi), kni), s_i) in kt.iter().zip(qt).zip(kn).zip(s.chunks_exact_mut(dv)) {
        let x = &mut s_i[j0..j0 + TILE];
        for j in 0..TILE {
            let y = decay * x[j] + ki * d[j];
            x[j] = y;
            oa[j] += qi * y;
            if NEXT {
                na[j] += kni * y;
            }
        }
    }
    o[j0..j0 + TILE].copy_from_slice(&oa);
    if NEXT {
        next[j0..j0 + TILE].copy_from_slice(&na);
    }
}

/// Columns of `S` per tile of [`fused_pass`]: the tile's `delta`, `o` and
/// `next` stay in vector registers while the pass walks down the rows.
const TILE: usize = 16;

/// For every row `i` of `S` (`dk x dv`): `s_i = decay s_i + k_i delta`, then
/// `o += q_i s_i` and, with `NEXT`, `next += kn_i s_i`; `o` and `next` are
/// overwritten. Tiled over columns so the accumulators are not reloaded per
/// row; every sum still runs over `i` in order.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fused_pass<const NEXT: bool>(
    s: &mut [f32],
    kt: &[f32],
    qt: &[f32],
    kn: &[f32],
    decay: f32,
    delta: &[f32],
    o: &mut [f32],
    next: &mut [f32],
) {
    let dv = delta.len();
    let full = dv - dv % TILE;
    for j0 in (0..full).step_by(TILE) {
        let mut d = [0.0f32; TILE];
        d.copy_from_slice(&delta[j0..j0 + TILE]);
        update_tile::<NEXT>(s, kt, qt, kn, decay, &d, j0, o, next);
    }
    if full < dv {
        fused_columns::<NEXT>(s, kt, qt, kn, decay, &delta[full..], full, o, next);
    }
}

/// [`fused_pass`] over the columns `from..` of `S` (`delta` holds theirs),
/// one row at a time: the ragged edge past the last full tile.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn fused_columns<const NEXT: bool>(
    s: &mut [f32],
    kt: &[f32],
    qt: &[f32],
    kn: &[f32],
    decay: f32,
    delta: &[f32],
    from: usize,
    o: &mut [f32],
    next: &mut [f32],
) {
    let dv = from + delta.len();
    let (o, next) = (&mut o[from..], &mut next[from..]);
    o.fill(0.0);
    next.fill(0.0);
    for (((ki, qi), kni), s_i) in kt.iter().zip(qt).zip(kn).zip(s.chunks_exact_mut(dv)) {
        for (((x, dj), oj), nj) in s_i[from..]
            .iter_mut()
            .zip(delta)
            .zip(o.iter_mut())
            .zip(next.iter_mut())
        {
            let y = decay * *x + ki * dj;
            *x = y;
            *oj += qi * y;
            if NEXT {
                *nj += kni * y;
            }
        }
    }
}

/// Rows of the diagonal blocks of the chunked form's forward substitution:
/// the solve is sequential within a block of this many rows and a gemm
/// between blocks.
const SOLVE_BLOCK: usize = 16;

/// Per-head scratch of the chunked form, sized for one chunk of `cap` tokens.
struct ChunkScratch {
    /// `G_i`, cumulative log decay within the chunk.
    cum: Vec<f32>,
    /// `[Q; K]` of the chunk, `[2c, dk]`: Q rows are scaled by `exp(G_i)`
    /// once `Q K^T` is taken, K rows by `exp(G_last - G_j)` once `W` is built.
    qk: Vec<f32>,
    /// `[Q; K] K^T`, `[2c, c]`, turned in place into the decay-masked
    /// intra-chunk attention (top half) and `L` (bottom half).
    prod: Vec<f32>,
    /// `[U | W]`, `[c, dv + dk]`: right-hand sides of the substitution, then
    /// its solution.
    uw: Vec<f32>,
    /// `Delta = U - W S0`, `[c, dv]`.
    delta: Vec<f32>,
}

/// One value head, a chunk at a time (see the module header for the algebra).
///
/// Blocking: a chunk of `c` tokens is one set of small matrix products on
/// the `gemm` crate, single-threaded (the heads are the parallel axis):
/// `[Q; K] K^T` gives the intra-chunk attention scores and `L` in one product
/// (`2c x c`); the decay mask `exp(G_i - G_j)` and `beta` are applied
/// elementwise. The unit lower triangular solve `(I + L) [U | W] = [diag(beta)
/// V | diag(beta exp(G)) K]` runs on both right-hand sides at once (`dv + dk`
/// wide rows), row by row inside diagonal blocks of [`SOLVE_BLOCK`] and as a
/// gemm update from all earlier rows at the start of each block. Then
/// `Delta = U - W S0`, `O = diag(exp(G)) Q S0 + A Delta` and `S = exp(G_last)
/// S0 + (diag(exp(G_last - G)) K)^T Delta` are four more gemms (`A` the masked
/// attention). Scratch is allocated once per head and reused across chunks.
#[allow(clippy::too_many_arguments)]
fn chunked_head(
    out_h: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
    chunk: usize,
) {
    let GatedDeltaDims { t, dk, dv, .. } = layout.dims;
    let cap = chunk.min(t);
    let w_rs = dv + dk;
    let mut sc = ChunkScratch {
        cum: vec![0.0; cap],
        qk: vec![0.0; 2 * cap * dk],
        prod: vec![0.0; 2 * cap * cap],
        uw: vec![0.0; cap * w_rs],
        delta: vec![0.0; cap * dv],
    };

    let mut t0 = 0;
    while t0 < t {
        let c = chunk.min(t - t0);
        chunk_step(
            &mut out_h[t0 * dv..(t0 + c) * dv],
            s,
            q,
            k,
            v,
            g,
            beta,
            layout,
            h,
            t0,
            c,
            &mut sc,
        );
        t0 += c;
    }
}

/// One chunk `t0..t0 + c` of [`chunked_head`]: writes `out_c` (`[c, dv]`) and
/// advances `s`.
#[allow(clippy::too_many_arguments)]
fn chunk_step(
    out_c: &mut [f32],
    s: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    layout: &Layout,
    h: usize,
    t0: usize,
    c: usize,
    sc: &mut ChunkScratch,
) {
    let GatedDeltaDims { dk, dv, .. } = layout.dims;
    let w_rs = dv + dk;
    let cum = &mut sc.cum[..c];
    let qk = &mut sc.qk[..2 * c * dk];
    let prod = &mut sc.prod[..2 * c * c];
    let uw = &mut sc.uw[..c * w_rs];
    let delta = &mut sc.delta[..c * dv];

    let mut acc = 0.0f32;
    for (i, gi) in cum.iter_mut().enumerate() {
        acc += layout.head_scalar(g, t0 + i, h);
        *gi = acc;
    }
    for i in 0..c {
        qk[i * dk..(i + 1) * dk].copy_from_slice(layout.key_row(q, t0 + i, h));
        qk[(c + i) * dk..(c + i + 1) * dk].copy_from_slice(layout.key_row(k, t0 + i, h));
    }

    // prod = [Q; K] K^T
    gemm_serial(
        prod,
        c,
        None,
        MatRef {
            data: qk,
            rows: 2 * c,
            cols: dk,
            rs: dk,
            cs: 1,
        },
        MatRef {
            data: &qk[c * dk..],
            rows: dk,
            cols: c,
            rs: 1,
            cs: dk,
        },
        1.0,
    );
    let (qs, ks) = qk.split_at_mut(c * dk);
    // Top: attn_ij = (q_i . k_j) exp(G_i - G_j), j <= i. Bottom: L_ij =
    // beta_i (k_i . k_j) exp(G_i - G_j), j < i. Zero elsewhere: the upper
    // triangle's exponents are positive and are never evaluated.
    let (attn, lower) = prod.split_at_mut(c * c);
    for i in 0..c {
        let bi = layout.head_scalar(beta, t0 + i, h);
        let a_row = &mut attn[i * c..(i + 1) * c];
        let l_row = &mut lower[i * c..(i + 1) * c];
        for j in 0..i {
            let decay = (cum[i] - cum[j]).exp();
            a_row[j] *= decay;
            l_row[j] *= bi * decay;
        }
        a_row[i + 1..].fill(0.0);
        l_row[i..].fill(0.0);
    }

    // Right-hand sides [beta_i v_i | beta_i exp(G_i) k_i], then solve
    // (I + L) X = rhs: x_i -= sum_{j<i} L_ij x_j.
    for i in 0..c {
        let bi = layout.head_scalar(beta, t0 + i, h);
        let (u_i, w_i) = uw[i * w_rs..(i + 1) * w_rs].split_at_mut(dv);
        for (x, vj) in u_i.iter_mut().zip(layout.value_row(v, t0 + i, h)) {
            *x = bi * vj;
        }
        let scale = bi * cum[i].exp();
        for (x, kj) in w_i.iter_mut().zip(&ks[i * dk..(i + 1) * dk]) {
            *x = scale * kj;
        }
    }
    let mut b0 = 0;
    while b0 < c {
        let b1 = (b0 + SOLVE_BLOCK).min(c);
        let (done, rest) = uw.split_at_mut(b0 * w_rs);
        if b0 > 0 {
            gemm_serial(
                rest,
                w_rs,
                Some(1.0),
                MatRef {
                    data: &lower[b0 * c..],
                    rows: b1 - b0,
                    cols: b0,
                    rs: c,
                    cs: 1,
                },
                MatRef {
                    data: done,
                    rows: b0,
                    cols: w_rs,
                    rs: w_rs,
                    cs: 1,
                },
                -1.0,
            );
        }
        for i in b0..b1 {
            let (block_done, row) = rest.split_at_mut((i - b0) * w_rs);
            let x_i = &mut row[..w_rs];
            for (j, x_j) in block_done.chunks_exact(w_rs).enumerate() {
                let l = lower[i * c + b0 + j];
                for (a, b) in x_i.iter_mut().zip(x_j) {
                    *a -= l * b;
                }
            }
        }
        b0 = b1;
    }

    // Q rows scaled by exp(G_i) for the inter-chunk readout.
    for (i, q_i) in qs.chunks_exact_mut(dk).enumerate() {
        let e = cum[i].exp();
        q_i.iter_mut().for_each(|x| *x *= e);
    }
    let s0 = MatRef {
        data: s,
        rows: dk,
        cols: dv,
        rs: dv,
        cs: 1,
    };
    // O = diag(exp(G)) Q S0, before S0 is overwritten.
    gemm_serial(
        out_c,
        dv,
        None,
        MatRef {
            data: qs,
            rows: c,
            cols: dk,
            rs: dk,
            cs: 1,
        },
        s0,
        1.0,
    );
    // Delta = U - W S0.
    for (d_i, x_i) in delta.chunks_exact_mut(dv).zip(uw.chunks_exact(w_rs)) {
        d_i.copy_from_slice(&x_i[..dv]);
    }
    gemm_serial(
        delta,
        dv,
        Some(1.0),
        MatRef {
            data: &uw[dv..],
            rows: c,
            cols: dk,
            rs: w_rs,
            cs: 1,
        },
        s0,
        -1.0,
    );
    let delta_m = MatRef {
        data: delta,
        rows: c,
        cols: dv,
        rs: dv,
        cs: 1,
    };
    // O += A Delta
    gemm_serial(
        out_c,
        dv,
        Some(1.0),
        MatRef {
            data: attn,
            rows: c,
            cols: c,
            rs: c,
            cs: 1,
        },
        delta_m,
        1.0,
    );
    // S = exp(G_last) S0 + (diag(exp(G_last - G)) K)^T Delta
    let g_last = cum[c - 1];
    for (j, k_j) in ks.chunks_exact_mut(dk).enumerate() {
        let e = (g_last - cum[j]).exp();
        k_j.iter_mut().for_each(|x| *x *= e);
    }
    gemm_serial(
        s,
        dv,
        Some(g_last.exp()),
        MatRef {
            data: ks,
            rows: dk,
            cols: c,
            rs: 1,
            cs: dk,
        },
        delta_m,
        1.0,
    );
}

// ---------------------------------------------------------------------------
// Backward of the gated delta rule (`arcticd_kernels::cpu::gated_delta`),
// exact, in the recurrent form (the chunked form's is further down): the
// two forwards compute the same function, so either backward serves both.
//
// Per value head, token `t`, with `S' = exp(g_t) S_{t-1}`,
// `delta = beta_t (v_t - S'^T k_t)`, `S_t = S' + k_t delta^T`, `o_t = S_t^T q_t`,
// walking t backwards with `dS` the gradient of `S_t`:
//
// ```text
// dS     += q_t do_t^T              dq_t = S_t do_t
// ddelta  = dS^T k_t                dk_t = dS delta
// dv_t    = beta_t ddelta           dbeta_t = ddelta . (v_t - S'^T k_t)
// du      = -beta_t ddelta          dS' = dS + k_t du^T,  dk_t += S' du
// dg_t    = sum(dS' * S')           dS_{t-1} = exp(g_t) dS'
// ```
//
// States are not kept for every token: the backward re-runs the recurrence
// from states checkpointed every `CHUNK` tokens, so memory is
// `(T / CHUNK + CHUNK) * dk * dv` per head instead of `T * dk * dv`.
// Every gradient is written (`=`); q/k gradients of the value heads that
// share a key head are summed.

/// Tokens between re-computation checkpoints of the state.
const RECOMPUTE_CHUNK: usize = 64;

/// Tokens between the states [`gated_delta_recurrent_forward_checkpointed`]
/// saves: the backward's re-computation chunk.
pub const CHECKPOINT_EVERY: usize = RECOMPUTE_CHUNK;

/// Gradients of one value head: dq, dk `[t, dk]`, dv `[t, dv]`, dg, dbeta `[t]`,
/// dstate0 `[dk, dv]`.
type HeadGrads = (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>);

/// Layouts as in the forward: `q`, `k` `[t, nk, dk]`; `v`, `dout` `[t, nv, dv]`;
/// `g`, `beta` `[t, nv]`; `state0` `[nv, dk, dv]` is the state the forward
/// started from. `dstate0`, when given, receives the initial state's gradient.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dout: &[f32],
    state0: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    backward(
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dstate0,
        None,
        dout,
        state0,
        None,
        q,
        k,
        v,
        g,
        beta,
        dims,
        Form::Recurrent,
    )
}

/// [`gated_delta_backward`] starting from the states the forward saved
/// ([`gated_delta_recurrent_forward_checkpointed`]), which saves the
/// backward's own forward pass over the sequence. The first checkpoint is
/// the initial state. `dstate_last`, when given, is the gradient of the
/// state after the last token (`[nv, dk, dv]`, where a continuation of the
/// sequence read it); it flows back with `dout`'s.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_backward_from_checkpoints(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dstate_last: Option<&[f32]>,
    dout: &[f32],
    checkpoints: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    from_checkpoints(
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dstate0,
        dstate_last,
        dout,
        checkpoints,
        q,
        k,
        v,
        g,
        beta,
        dims,
        Form::Recurrent,
    )
}

/// [`gated_delta_backward_from_checkpoints`] in the chunked (WY) form: the
/// gradient of the same function, computed a chunk of [`CHECKPOINT_EVERY`]
/// tokens at a time with matrix products (see the comment above
/// [`head_backward_chunked`]). The reference for the GPU's chunked
/// backward; on a CPU it pays at wide heads.
#[allow(clippy::too_many_arguments)]
pub fn gated_delta_chunked_backward_from_checkpoints(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dstate_last: Option<&[f32]>,
    dout: &[f32],
    checkpoints: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Result<()> {
    from_checkpoints(
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dstate0,
        dstate_last,
        dout,
        checkpoints,
        q,
        k,
        v,
        g,
        beta,
        dims,
        Form::Chunked,
    )
}

/// Which algorithm a backward runs; both give the exact gradient.
#[derive(Clone, Copy)]
enum Form {
    /// Token by token, carrying the state's gradient ([`head_backward`]).
    Recurrent,
    /// A chunk at a time in the WY form ([`head_backward_chunked`]).
    Chunked,
}

#[allow(clippy::too_many_arguments)]
fn from_checkpoints(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dstate_last: Option<&[f32]>,
    dout: &[f32],
    checkpoints: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
    form: Form,
) -> Result<()> {
    let sn = dims.nv * dims.dk * dims.dv;
    if checkpoints.len() != dims.t.div_ceil(CHECKPOINT_EVERY).max(1) * sn {
        return Err(Error::Shape(format!(
            "gated delta checkpoints: {} floats for {dims:?}",
            checkpoints.len()
        )));
    }
    let state0 = &checkpoints[..sn];
    backward(
        dq,
        dk,
        dv,
        dg,
        dbeta,
        dstate0,
        dstate_last,
        dout,
        state0,
        Some(checkpoints),
        q,
        k,
        v,
        g,
        beta,
        dims,
        form,
    )
}

#[allow(clippy::too_many_arguments)]
fn backward(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    dg: &mut [f32],
    dbeta: &mut [f32],
    dstate0: Option<&mut [f32]>,
    dstate_last: Option<&[f32]>,
    dout: &[f32],
    state0: &[f32],
    checkpoints: Option<&[f32]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
    form: Form,
) -> Result<()> {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let (qn, vn, sn) = (t * nk * dkd, t * nv * dvd, nv * dkd * dvd);
    if nk == 0
        || nv % nk != 0
        || dq.len() != qn
        || dk.len() != qn
        || q.len() != qn
        || k.len() != qn
        || dv.len() != vn
        || v.len() != vn
        || dout.len() != vn
        || dg.len() != t * nv
        || dbeta.len() != t * nv
        || g.len() != t * nv
        || beta.len() != t * nv
        || state0.len() != sn
        || dstate0.as_ref().is_some_and(|d| d.len() != sn)
        || dstate_last.is_some_and(|d| d.len() != sn)
    {
        return Err(Error::Shape(format!(
            "gated_delta_backward: {dims:?} with dq {} dk {} dv {} dg {} dbeta {} dout {} state0 {}",
            dq.len(),
            dk.len(),
            dv.len(),
            dg.len(),
            dbeta.len(),
            dout.len(),
            state0.len()
        )));
    }
    let r = nv / nk;
    let heads: Vec<HeadGrads> = (0..nv)
        .into_par_iter()
        .map(|h| {
            let ss = dkd * dvd;
            // The gradient of the last state, where the caller has one.
            let ds_last = dstate_last.map(|d| &d[h * ss..(h + 1) * ss]);
            if let Form::Chunked = form {
                let starts = chunk_starts(h, state0, checkpoints, k, v, g, beta, dims);
                return head_backward_chunked(h, r, dout, ds_last, &starts, q, k, v, g, beta, dims);
            }
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
            {
                // SAFETY: the CPU supports AVX2 and FMA, checked just above.
                return unsafe {
                    head_backward_avx2(
                        h,
                        r,
                        dout,
                        ds_last,
                        state0,
                        checkpoints,
                        q,
                        k,
                        v,
                        g,
                        beta,
                        dims,
                    )
                };
            }
            head_backward(
                h,
                r,
                dout,
                ds_last,
                state0,
                checkpoints,
                q,
                k,
                v,
                g,
                beta,
                dims,
            )
        })
        .collect();
    dq.fill(0.0);
    dk.fill(0.0);
    for (h, (hq, hk, hv, hg, hb, _)) in heads.iter().enumerate() {
        let kh = h / r;
        for ti in 0..t {
            let o = (ti * nk + kh) * dkd;
            for x in 0..dkd {
                dq[o + x] += hq[ti * dkd + x];
                dk[o + x] += hk[ti * dkd + x];
            }
            let ov = (ti * nv + h) * dvd;
            dv[ov..ov + dvd].copy_from_slice(&hv[ti * dvd..(ti + 1) * dvd]);
            dg[ti * nv + h] = hg[ti];
            dbeta[ti * nv + h] = hb[ti];
        }
    }
    if let Some(ds) = dstate0 {
        for (h, head) in heads.iter().enumerate() {
            ds[h * dkd * dvd..(h + 1) * dkd * dvd].copy_from_slice(&head.5);
        }
    }
    Ok(())
}

/// [`head_backward`] compiled for AVX2 and FMA.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn head_backward_avx2(
    h: usize,
    r: usize,
    dout: &[f32],
    ds_last: Option<&[f32]>,
    state0: &[f32],
    checkpoints: Option<&[f32]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> HeadGrads {
    head_backward(
        h,
        r,
        dout,
        ds_last,
        state0,
        checkpoints,
        q,
        k,
        v,
        g,
        beta,
        dims,
    )
}

/// `sum_i a_i b_i` in eight interleaved partial sums, so the loop
/// vectorises (a different summation order from a plain loop; the backward
/// only needs the gradient, not the forward's bits).
#[inline(always)]
fn dot_lanes(a: &[f32], b: &[f32]) -> f32 {
    const L: usize = 8;
    let n = a.len().min(b.len());
    let full = n - n % L;
    let mut acc = [0.0f32; L];
    for (x, y) in a[..full].chunks_exact(L).zip(b[..full].chunks_exact(L)) {
        for l in 0..L {
            acc[l] += x[l] * y[l];
        }
    }
    let mut sum = ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
    for i in full..n {
        sum += a[i] * b[i];
    }
    sum
}

/// One step of the recurrence for the backward's recomputation:
/// `delta = b (v - decay S^T k)`, `S_next = decay S + k delta^T`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn recurrence_step(
    s_prev: &[f32],
    s_next: &mut [f32],
    delta: &mut [f32],
    kt: &[f32],
    vt: &[f32],
    decay: f32,
    b: f32,
    dvd: usize,
) {
    delta.fill(0.0);
    for (ka, srow) in kt.iter().zip(s_prev.chunks_exact(dvd)) {
        let w = ka * decay;
        for (d, sv) in delta.iter_mut().zip(srow) {
            *d += w * sv;
        }
    }
    for (d, vv) in delta.iter_mut().zip(vt) {
        *d = b * (vv - *d);
    }
    for ((ka, srow), nrow) in kt
        .iter()
        .zip(s_prev.chunks_exact(dvd))
        .zip(s_next.chunks_exact_mut(dvd))
    {
        for ((nv_, sv), d) in nrow.iter_mut().zip(srow).zip(delta.iter()) {
            *nv_ = decay * sv + ka * d;
        }
    }
}

#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_backward(
    h: usize,
    r: usize,
    dout: &[f32],
    ds_last: Option<&[f32]>,
    state0: &[f32],
    checkpoints: Option<&[f32]>,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> HeadGrads {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let ss = dkd * dvd;
    let kh = h / r;
    let key = |ti: usize| (ti * nk + kh) * dkd..(ti * nk + kh + 1) * dkd;
    let val = |ti: usize| (ti * nv + h) * dvd..(ti * nv + h + 1) * dvd;

    // One recurrence step: s (S_{t-1}) -> S_t, with delta out.
    let step = |s_prev: &[f32], s_next: &mut [f32], delta: &mut [f32], ti: usize| {
        let (decay, b) = (g[ti * nv + h].exp(), beta[ti * nv + h]);
        recurrence_step(
            s_prev,
            s_next,
            delta,
            &k[key(ti)],
            &v[val(ti)],
            decay,
            b,
            dvd,
        )
    };
    let n_chunks = t.div_ceil(RECOMPUTE_CHUNK);
    let starts = chunk_starts(h, state0, checkpoints, k, v, g, beta, dims);

    let mut hq = vec![0.0f32; t * dkd];
    let mut hk = vec![0.0f32; t * dkd];
    let mut hv = vec![0.0f32; t * dvd];
    let mut hg = vec![0.0f32; t];
    let mut hb = vec![0.0f32; t];
    // dS of the state after the last token: the caller's, or zero.
    let mut ds = ds_last.map_or_else(|| vec![0.0f32; ss], <[f32]>::to_vec);
    // states[i] = S before token c0 + i; deltas[i] = delta of that token.
    let mut states = vec![0.0f32; (RECOMPUTE_CHUNK + 1) * ss];
    let mut deltas = vec![0.0f32; RECOMPUTE_CHUNK * dvd];
    let mut sd = vec![0.0f32; ss];
    let mut ddelta = vec![0.0f32; dvd];
    let mut ksd = vec![0.0f32; dvd];
    let mut du = vec![0.0f32; dvd];
    for ci in (0..n_chunks).rev() {
        let c0 = ci * RECOMPUTE_CHUNK;
        let c1 = (c0 + RECOMPUTE_CHUNK).min(t);
        states[..ss].copy_from_slice(&starts[ci * ss..(ci + 1) * ss]);
        for ti in c0..c1 {
            let i = ti - c0;
            let (before, after) = states.split_at_mut((i + 1) * ss);
            step(
                &before[i * ss..],
                &mut after[..ss],
                &mut deltas[i * dvd..(i + 1) * dvd],
                ti,
            );
        }
        for ti in (c0..c1).rev() {
            let i = ti - c0;
            let s_prev = &states[i * ss..(i + 1) * ss];
            let s_t = &states[(i + 1) * ss..(i + 2) * ss];
            let delta = &deltas[i * dvd..(i + 1) * dvd];
            let qt = &q[key(ti)];
            let kt = &k[key(ti)];
            let vt = &v[val(ti)];
            let dot_ = &dout[val(ti)];
            let decay = g[ti * nv + h].exp();
            let b = beta[ti * nv + h];
            let dqt = &mut hq[ti * dkd..(ti + 1) * dkd];
            let dkt = &mut hk[ti * dkd..(ti + 1) * dkd];
            // o_t = S_t^T q_t.
            for (((dq_a, q_a), row), drow) in dqt
                .iter_mut()
                .zip(qt)
                .zip(s_t.chunks_exact(dvd))
                .zip(ds.chunks_exact_mut(dvd))
            {
                *dq_a = dot_lanes(row, dot_);
                for (d, o) in drow.iter_mut().zip(dot_) {
                    *d += q_a * o;
                }
            }
            // S_t = S' + k delta^T.
            ddelta.fill(0.0);
            for ((dk_a, k_a), drow) in dkt.iter_mut().zip(kt).zip(ds.chunks_exact(dvd)) {
                for (dd, dsv) in ddelta.iter_mut().zip(drow) {
                    *dd += k_a * dsv;
                }
                *dk_a = dot_lanes(drow, delta);
            }
            // delta = beta (v - S'^T k).
            for (x, p) in sd.iter_mut().zip(s_prev) {
                *x = decay * p;
            }
            ksd.fill(0.0);
            for (k_a, srow) in kt.iter().zip(sd.chunks_exact(dvd)) {
                for (x, sv) in ksd.iter_mut().zip(srow) {
                    *x += k_a * sv;
                }
            }
            let mut db = 0.0f32;
            for (((dv_c, dd), vv), ks) in hv[ti * dvd..(ti + 1) * dvd]
                .iter_mut()
                .zip(ddelta.iter())
                .zip(vt)
                .zip(ksd.iter())
            {
                *dv_c = b * dd;
                db += dd * (vv - ks);
            }
            hb[ti] = db;
            // du = -beta ddelta: dS' = dS + k du^T, dk += S' du.
            for (u, dd) in du.iter_mut().zip(ddelta.iter()) {
                *u = -b * dd;
            }
            let mut dgt = 0.0f32;
            for ((dk_a, k_a), (srow, drow)) in dkt
                .iter_mut()
                .zip(kt)
                .zip(sd.chunks_exact(dvd).zip(ds.chunks_exact_mut(dvd)))
            {
                *dk_a += dot_lanes(srow, &du);
                for (dsv, u) in drow.iter_mut().zip(du.iter()) {
                    *dsv += k_a * u;
                }
                dgt += dot_lanes(drow, srow);
                for dsv in drow.iter_mut() {
                    *dsv *= decay;
                }
            }
            hg[ti] = dgt;
        }
    }
    (hq, hk, hv, hg, hb, ds)
}

/// The state of head `h` at every [`RECOMPUTE_CHUNK`] start (`[chunks (at
/// least 1), dk, dv]`): the forward's checkpoints, or a forward pass over
/// the head from `state0`.
#[allow(clippy::too_many_arguments)]
fn chunk_starts(
    h: usize,
    state0: &[f32],
    checkpoints: Option<&[f32]>,
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> Vec<f32> {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let ss = dkd * dvd;
    let kh = h / (nv / nk);
    let n_chunks = t.div_ceil(RECOMPUTE_CHUNK);
    let mut starts = vec![0.0f32; n_chunks.max(1) * ss];
    if let Some(cp) = checkpoints {
        for (c, dst) in starts.chunks_exact_mut(ss).enumerate() {
            dst.copy_from_slice(&cp[(c * nv + h) * ss..(c * nv + h + 1) * ss]);
        }
        return starts;
    }
    starts[..ss].copy_from_slice(&state0[h * ss..(h + 1) * ss]);
    let mut cur = state0[h * ss..(h + 1) * ss].to_vec();
    let mut next = vec![0.0f32; ss];
    let mut delta = vec![0.0f32; dvd];
    for ti in 0..t {
        if ti % RECOMPUTE_CHUNK == 0 && ti > 0 {
            starts[(ti / RECOMPUTE_CHUNK) * ss..(ti / RECOMPUTE_CHUNK + 1) * ss]
                .copy_from_slice(&cur);
        }
        recurrence_step(
            &cur,
            &mut next,
            &mut delta,
            &k[(ti * nk + kh) * dkd..(ti * nk + kh + 1) * dkd],
            &v[(ti * nv + h) * dvd..(ti * nv + h + 1) * dvd],
            g[ti * nv + h].exp(),
            beta[ti * nv + h],
            dvd,
        );
        std::mem::swap(&mut cur, &mut next);
    }
    starts
}

/// `dst (m x n) = [dst +] scale * op(a) op(b)` over row-major operands,
/// `op(a)` being `m x kk` (`a` stored `kk x m` when `at`) and `op(b)`
/// `kk x n` (`b` stored `n x kk` when `bt`).
#[allow(clippy::too_many_arguments)]
fn mm(
    dst: &mut [f32],
    (m, n, kk): (usize, usize, usize),
    a: &[f32],
    at: bool,
    b: &[f32],
    bt: bool,
    scale: f32,
    accumulate: bool,
) {
    let (ars, acs) = if at { (1, m) } else { (kk, 1) };
    let (brs, bcs) = if bt { (1, kk) } else { (n, 1) };
    gemm_serial(
        &mut dst[..m * n],
        n,
        accumulate.then_some(1.0),
        MatRef {
            data: a,
            rows: m,
            cols: kk,
            rs: ars,
            cs: acs,
        },
        MatRef {
            data: b,
            rows: kk,
            cols: n,
            rs: brs,
            cs: bcs,
        },
        scale,
    );
}

fn dot64(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(x, y)| *x as f64 * *y as f64).sum()
}

// The chunked (WY) backward, per value head, chunks in reverse. For a
// chunk of `c` tokens entering with state `S0` and leaving with `S1`, whose
// gradient `dS` the later chunks passed back, recompute the forward's
// pieces (the header's notation: `G`, `E_ij = e^(G_i - G_j)` for `j <= i`,
// `A = (Q K^T) . E`, `L = diag(b) (K K^T) . E` strictly lower, `T = (I +
// L)^-1`, `U = T diag(b) V`, `W = T diag(b e^G) K`, `Delta = U - W S0`) and
// run the four products' adjoints, with `Qg = diag(e^G) Q` and `Kd =
// diag(e^(G_last - G)) K`:
//
// ```text
// dDelta = A^T dO + Kd dS            dA  = (dO Delta^T) masked to j <= i
// dQg    = dO S0^T                   dKd = Delta dS^T
// dS0    = e^G_last dS + Qg^T dO - W^T dDelta
// [dRv | dRk] = T^T [dDelta | -dDelta S0^T]      (a back substitution)
// dL     = -(dRv U^T + dRk W^T) strictly lower
// ```
//
// then, with `P = dA . E` and `D = dL . E`: `dQ = diag(e^G) dQg + P K`,
// `dK = P^T Q + Kd-part + diag(b e^G) dRk + (diag(b) D + (diag(b) D)^T) K`,
// `dV = diag(b) dRv`, `db_i = v_i . dRv_i + e^G_i k_i . dRk_i + sum_j D_ij
// (k_i . k_j)`, and the cumulative decay's gradient `dG_i` (the rows minus
// the columns of `dA . A` and `dL . L`, plus `Qg_i . dQg_i - Kd_i . dKd_i +
// b_i e^G_i k_i . dRk_i`, and at the last token `e^G_last <S0, dS> + sum_j
// Kd_j . dKd_j`) summed from the end of the chunk gives `dg`. The `dG`
// terms nearly cancel where the decay's gradient is small, so they are
// summed in f64.

/// The chunked backward of value head `h` from its chunk-start states
/// (`[chunks, dk, dv]`).
#[allow(clippy::too_many_arguments)]
fn head_backward_chunked(
    h: usize,
    r: usize,
    dout: &[f32],
    ds_last: Option<&[f32]>,
    starts: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    g: &[f32],
    beta: &[f32],
    dims: GatedDeltaDims,
) -> HeadGrads {
    let GatedDeltaDims {
        t,
        nk,
        nv,
        dk: dkd,
        dv: dvd,
    } = dims;
    let ss = dkd * dvd;
    let kh = h / r;
    let cap = RECOMPUTE_CHUNK.min(t);
    let mut hq = vec![0.0f32; t * dkd];
    let mut hk = vec![0.0f32; t * dkd];
    let mut hv = vec![0.0f32; t * dvd];
    let mut hg = vec![0.0f32; t];
    let mut hb = vec![0.0f32; t];
    // dS of the state after the last token: the caller's, or zero.
    let mut ds = ds_last.map_or_else(|| vec![0.0f32; ss], <[f32]>::to_vec);
    let mut ds_prev = vec![0.0f32; ss];
    let kmat = || vec![0.0f32; cap * dkd];
    let vmat = || vec![0.0f32; cap * dvd];
    let sq = || vec![0.0f32; cap * cap];
    let (mut qc, mut kc, mut qg, mut kd) = (kmat(), kmat(), kmat(), kmat());
    let (mut w, mut dqg, mut dkd_, mut drk, mut dqc, mut dkc) =
        (kmat(), kmat(), kmat(), kmat(), kmat(), kmat());
    let (mut vc, mut doc, mut u, mut delta, mut drv) = (vmat(), vmat(), vmat(), vmat(), vmat());
    let (mut kk, mut qk, mut emask, mut lower, mut att) = (sq(), sq(), sq(), sq(), sq());
    let (mut da, mut dl, mut sym) = (sq(), sq(), sq());
    let (mut cum, mut eg, mut b) = (vec![0.0f64; cap], vec![0.0f32; cap], vec![0.0f32; cap]);
    let mut dgc = vec![0.0f64; cap];

    for ci in (0..t.div_ceil(RECOMPUTE_CHUNK)).rev() {
        let t0 = ci * RECOMPUTE_CHUNK;
        let c = RECOMPUTE_CHUNK.min(t - t0);
        let s0 = &starts[ci * ss..(ci + 1) * ss];
        // G in f64: a difference G_i - G_j of two f32 running sums would
        // carry the sums' rounding (about |G_i| * 2^-24) into every decay.
        let mut acc = 0.0f64;
        for i in 0..c {
            let ti = t0 + i;
            acc += g[ti * nv + h] as f64;
            cum[i] = acc;
            eg[i] = (acc as f32).exp();
            b[i] = beta[ti * nv + h];
            let key = (ti * nk + kh) * dkd..(ti * nk + kh + 1) * dkd;
            let val = (ti * nv + h) * dvd..(ti * nv + h + 1) * dvd;
            qc[i * dkd..(i + 1) * dkd].copy_from_slice(&q[key.clone()]);
            kc[i * dkd..(i + 1) * dkd].copy_from_slice(&k[key]);
            vc[i * dvd..(i + 1) * dvd].copy_from_slice(&v[val.clone()]);
            doc[i * dvd..(i + 1) * dvd].copy_from_slice(&dout[val]);
        }
        let (qc, kc, vc, doc) = (
            &qc[..c * dkd],
            &kc[..c * dkd],
            &vc[..c * dvd],
            &doc[..c * dvd],
        );
        let g_last = cum[c - 1];
        let e_last = (g_last as f32).exp();
        let decay = |i: usize, j: usize| ((cum[i] - cum[j]) as f32).exp();

        // The forward's pieces.
        mm(&mut kk, (c, c, dkd), kc, false, kc, true, 1.0, false);
        mm(&mut qk, (c, c, dkd), qc, false, kc, true, 1.0, false);
        for i in 0..c {
            for j in 0..c {
                let e = if j <= i { decay(i, j) } else { 0.0 };
                emask[i * c + j] = e;
                att[i * c + j] = qk[i * c + j] * e;
                lower[i * c + j] = if j < i { b[i] * kk[i * c + j] * e } else { 0.0 };
            }
        }
        for i in 0..c {
            let (qi, ki) = (&qc[i * dkd..(i + 1) * dkd], &kc[i * dkd..(i + 1) * dkd]);
            let decay_to_end = decay(c - 1, i);
            for x in 0..dkd {
                qg[i * dkd + x] = eg[i] * qi[x];
                kd[i * dkd + x] = decay_to_end * ki[x];
                w[i * dkd + x] = b[i] * eg[i] * ki[x];
            }
            for x in 0..dvd {
                u[i * dvd + x] = b[i] * vc[i * dvd + x];
            }
        }
        // (I + L) [U | W] = [diag(b) V | diag(b e^G) K], row by row.
        for i in 1..c {
            let (done_u, row_u) = u.split_at_mut(i * dvd);
            let (done_w, row_w) = w.split_at_mut(i * dkd);
            for j in 0..i {
                let l = lower[i * c + j];
                for (a, x) in row_u[..dvd].iter_mut().zip(&done_u[j * dvd..]) {
                    *a -= l * x;
                }
                for (a, x) in row_w[..dkd].iter_mut().zip(&done_w[j * dkd..]) {
                    *a -= l * x;
                }
            }
        }
        let (u, w) = (&u[..c * dvd], &w[..c * dkd]);
        delta[..c * dvd].copy_from_slice(u);
        mm(&mut delta, (c, dvd, dkd), w, false, s0, false, -1.0, true);
        let delta = &delta[..c * dvd];

        // The adjoints of the four products.
        let ddelta = &mut drv;
        mm(ddelta, (c, dvd, c), &att, true, doc, false, 1.0, false);
        mm(ddelta, (c, dvd, dkd), &kd, false, &ds, false, 1.0, true);
        mm(&mut da, (c, c, dvd), doc, false, delta, true, 1.0, false);
        mm(&mut dqg, (c, dkd, dvd), doc, false, s0, true, 1.0, false);
        mm(
            &mut dkd_,
            (c, dkd, dvd),
            delta,
            false,
            &ds,
            true,
            1.0,
            false,
        );
        // dG_last's share from S1 = e^G_last S0 + ..., with this chunk's dS.
        let mut dg_last = e_last as f64 * dot64(s0, &ds);
        for (p, x) in ds_prev.iter_mut().zip(&ds) {
            *p = e_last * x;
        }
        mm(
            &mut ds_prev,
            (dkd, dvd, c),
            &qg,
            true,
            doc,
            false,
            1.0,
            true,
        );
        mm(
            &mut ds_prev,
            (dkd, dvd, c),
            w,
            true,
            ddelta,
            false,
            -1.0,
            true,
        );
        // [dRv | dRk] = T^T [dDelta | -dDelta S0^T]: back substitution.
        mm(
            &mut drk,
            (c, dkd, dvd),
            ddelta,
            false,
            s0,
            true,
            -1.0,
            false,
        );
        for i in (0..c.saturating_sub(1)).rev() {
            let (row_v, later_v) = ddelta.split_at_mut((i + 1) * dvd);
            let (row_k, later_k) = drk.split_at_mut((i + 1) * dkd);
            for j in i + 1..c {
                let l = lower[j * c + i];
                let jj = j - i - 1;
                for (a, x) in row_v[i * dvd..]
                    .iter_mut()
                    .zip(&later_v[jj * dvd..(jj + 1) * dvd])
                {
                    *a -= l * x;
                }
                for (a, x) in row_k[i * dkd..]
                    .iter_mut()
                    .zip(&later_k[jj * dkd..(jj + 1) * dkd])
                {
                    *a -= l * x;
                }
            }
        }
        let (drv, drk) = (&ddelta[..c * dvd], &drk[..c * dkd]);
        mm(&mut dl, (c, c, dvd), drv, false, u, true, -1.0, false);
        mm(&mut dl, (c, c, dkd), drk, false, w, true, -1.0, true);

        // P = dA . E (kept in da), D = dL . E; sym = diag(b) D + its transpose.
        // dG gets the rows minus the columns of dA . A and dL . L.
        dgc[..c].fill(0.0);
        for i in 0..c {
            for j in 0..c {
                let e = emask[i * c + j];
                let p = if j <= i { da[i * c + j] * e } else { 0.0 };
                let dd = if j < i { dl[i * c + j] * e } else { 0.0 };
                da[i * c + j] = p;
                dl[i * c + j] = dd;
                let x = p as f64 * qk[i * c + j] as f64
                    + dd as f64 * b[i] as f64 * kk[i * c + j] as f64;
                dgc[i] += x;
                dgc[j] -= x;
            }
        }
        for i in 0..c {
            for j in 0..c {
                sym[i * c + j] = b[i] * dl[i * c + j] + b[j] * dl[j * c + i];
            }
        }
        mm(&mut dqc, (c, dkd, c), &da, false, kc, false, 1.0, false);
        mm(&mut dkc, (c, dkd, c), &da, true, qc, false, 1.0, false);
        mm(&mut dkc, (c, dkd, c), &sym, false, kc, false, 1.0, true);

        for i in 0..c {
            let ti = t0 + i;
            let (ki, vi) = (&kc[i * dkd..(i + 1) * dkd], &vc[i * dvd..(i + 1) * dvd]);
            let (drv_i, drk_i) = (&drv[i * dvd..(i + 1) * dvd], &drk[i * dkd..(i + 1) * dkd]);
            let decay_to_end = decay(c - 1, i);
            let hq_t = &mut hq[ti * dkd..(ti + 1) * dkd];
            let hk_t = &mut hk[ti * dkd..(ti + 1) * dkd];
            for x in 0..dkd {
                hq_t[x] = dqc[i * dkd + x] + eg[i] * dqg[i * dkd + x];
                hk_t[x] =
                    dkc[i * dkd + x] + decay_to_end * dkd_[i * dkd + x] + b[i] * eg[i] * drk_i[x];
            }
            for x in 0..dvd {
                hv[ti * dvd + x] = b[i] * drv_i[x];
            }
            let k_drk = dot64(ki, drk_i);
            let mut db = dot64(vi, drv_i) + eg[i] as f64 * k_drk;
            for j in 0..i {
                db += dl[i * c + j] as f64 * kk[i * c + j] as f64;
            }
            hb[ti] = db as f32;
            let kd_dkd = dot64(&kd[i * dkd..(i + 1) * dkd], &dkd_[i * dkd..(i + 1) * dkd]);
            dgc[i] += dot64(&qg[i * dkd..(i + 1) * dkd], &dqg[i * dkd..(i + 1) * dkd]) - kd_dkd
                + (b[i] * eg[i]) as f64 * k_drk;
            dg_last += kd_dkd;
        }
        dgc[c - 1] += dg_last;
        let mut acc = 0.0f64;
        for i in (0..c).rev() {
            acc += dgc[i];
            hg[t0 + i] = acc as f32;
        }
        std::mem::swap(&mut ds, &mut ds_prev);
    }
    (hq, hk, hv, hg, hb, ds)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    struct Inputs {
        q: Vec<f32>,
        k: Vec<f32>,
        v: Vec<f32>,
        g: Vec<f32>,
        beta: Vec<f32>,
        state: Vec<f32>,
    }

    fn l2_normalised_rows(rng: &mut StdRng, rows: usize, d: usize, scale: f32) -> Vec<f32> {
        let mut x: Vec<f32> = (0..rows * d).map(|_| rng.gen_range(-1.0..1.0)).collect();
        for row in x.chunks_mut(d) {
            let n = (row.iter().map(|a| a * a).sum::<f32>() + 1e-6).sqrt();
            row.iter_mut().for_each(|a| *a *= scale / n);
        }
        x
    }

    fn random_inputs(dims: GatedDeltaDims, seed: u64) -> Inputs {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let mut rng = StdRng::seed_from_u64(seed);
        let q = l2_normalised_rows(&mut rng, t * nk, dk, (dk as f32).powf(-0.5));
        let k = l2_normalised_rows(&mut rng, t * nk, dk, 1.0);
        let v = (0..t * nv * dv).map(|_| rng.gen_range(-1.0..1.0)).collect();
        // g = -exp(A_log) * softplus(a + dt_bias), as the model computes it.
        let g = (0..t * nv)
            .map(|_| {
                let a_log: f32 = rng.gen_range(-1.0..0.5);
                let x: f32 = rng.gen_range(-3.0..1.5);
                -a_log.exp() * x.exp().ln_1p()
            })
            .collect();
        let beta = (0..t * nv)
            .map(|_| 1.0 / (1.0 + (-rng.gen_range(-4.0f32..4.0)).exp()))
            .collect();
        let state = (0..nv * dk * dv)
            .map(|_| rng.gen_range(-0.5..0.5))
            .collect();
        Inputs {
            q,
            k,
            v,
            g,
            beta,
            state,
        }
    }

    /// Returns (out, final state).
    fn run(inp: &Inputs, dims: GatedDeltaDims, chunk: Option<usize>) -> (Vec<f32>, Vec<f32>) {
        let mut out = vec![f32::NAN; dims.t * dims.nv * dims.dv];
        let mut state = inp.state.clone();
        match chunk {
            None => gated_delta_recurrent_forward(
                &mut out, &mut state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, dims,
            ),
            Some(c) => gated_delta_chunked_forward(
                &mut out, &mut state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, dims, c,
            ),
        }
        .unwrap();
        (out, state)
    }

    fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(
                0.0,
                |m, d| if d.is_nan() { f32::INFINITY } else { m.max(d) },
            )
    }

    /// The recurrence written out with explicit indices, one scalar at a time.
    fn naive(inp: &Inputs, dims: GatedDeltaDims) -> (Vec<f32>, Vec<f32>) {
        let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
        let r = nv / nk;
        let mut out = vec![0.0f32; t * nv * dv];
        let mut state = inp.state.clone();
        for h in 0..nv {
            let kh = h / r;
            let mut s = vec![vec![0.0f32; dv]; dk];
            for (i, row) in s.iter_mut().enumerate() {
                for (j, x) in row.iter_mut().enumerate() {
                    *x = state[(h * dk + i) * dv + j];
                }
            }
            for ti in 0..t {
                let qv = |i: usize| inp.q[(ti * nk + kh) * dk + i];
                let kv = |i: usize| inp.k[(ti * nk + kh) * dk + i];
                let gt = inp.g[ti * nv + h];
                let bt = inp.beta[ti * nv + h];
                for row in s.iter_mut() {
                    for x in row.iter_mut() {
                        *x *= gt.exp();
                    }
                }
                let mut delta = vec![0.0f32; dv];
                for (j, d) in delta.iter_mut().enumerate() {
                    let mut sk = 0.0;
                    for (i, row) in s.iter().enumerate() {
                        sk += row[j] * kv(i);
                    }
                    *d = bt * (inp.v[(ti * nv + h) * dv + j] - sk);
                }
                for (i, row) in s.iter_mut().enumerate() {
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += kv(i) * delta[j];
                    }
                }
                for j in 0..dv {
                    let mut o = 0.0;
                    for (i, row) in s.iter().enumerate() {
                        o += row[j] * qv(i);
                    }
                    out[(ti * nv + h) * dv + j] = o;
                }
            }
            for (i, row) in s.iter().enumerate() {
                for (j, x) in row.iter().enumerate() {
                    state[(h * dk + i) * dv + j] = *x;
                }
            }
        }
        (out, state)
    }

    fn dims(t: usize) -> GatedDeltaDims {
        GatedDeltaDims {
            t,
            nk: 2,
            nv: 4,
            dk: 16,
            dv: 8,
        }
    }

    #[test]
    fn recurrent_matches_naive() {
        for (seed, d) in [
            GatedDeltaDims {
                t: 5,
                nk: 1,
                nv: 2,
                dk: 3,
                dv: 4,
            },
            GatedDeltaDims {
                t: 7,
                nk: 2,
                nv: 4,
                dk: 5,
                dv: 3,
            },
            GatedDeltaDims {
                t: 1,
                nk: 3,
                nv: 3,
                dk: 4,
                dv: 2,
            },
            // Two full column tiles of the fused pass plus a remainder.
            GatedDeltaDims {
                t: 6,
                nk: 1,
                nv: 2,
                dk: 5,
                dv: 2 * TILE + 3,
            },
        ]
        .into_iter()
        .enumerate()
        {
            let inp = random_inputs(d, 10 + seed as u64);
            let (out, state) = run(&inp, d, None);
            let (want_out, want_state) = naive(&inp, d);
            // The outputs must be non-trivial, or agreement proves nothing.
            assert!(want_out.iter().any(|x| x.abs() > 1e-2), "{d:?}");
            assert!(max_abs_diff(&out, &want_out) <= 1e-6, "out {d:?}");
            assert!(max_abs_diff(&state, &want_state) <= 1e-6, "state {d:?}");
        }
    }

    #[test]
    fn chunked_matches_recurrent() {
        let mut worst = 0.0f32;
        for t in [1, 2, 63, 64, 65, 130, 200] {
            let d = dims(t);
            let inp = random_inputs(d, 1000 + t as u64);
            let (want_out, want_state) = run(&inp, d, None);
            assert!(want_out.iter().any(|x| x.abs() > 1e-2));
            for chunk in [16, CHUNK, 1, 7, 1000] {
                let (out, state) = run(&inp, d, Some(chunk));
                let diff_out = max_abs_diff(&out, &want_out);
                let diff_state = max_abs_diff(&state, &want_state);
                assert!(diff_out <= 1e-5, "t={t} chunk={chunk}: out diff {diff_out}");
                assert!(
                    diff_state <= 1e-5,
                    "t={t} chunk={chunk}: state diff {diff_state}"
                );
                worst = worst.max(diff_out).max(diff_state);
            }
        }
        println!("chunked vs recurrent, max abs diff: {worst:e}");
    }

    /// Widths where the fused recurrent pass runs whole column tiles and the
    /// chunked solve spans several diagonal blocks.
    #[test]
    fn chunked_matches_recurrent_at_wide_heads() {
        let d = GatedDeltaDims {
            t: 150,
            nk: 1,
            nv: 2,
            dk: 40,
            dv: 2 * TILE,
        };
        let inp = random_inputs(d, 77);
        let (want_out, want_state) = run(&inp, d, None);
        let (naive_out, naive_state) = naive(&inp, d);
        assert!(max_abs_diff(&want_out, &naive_out) <= 1e-6);
        assert!(max_abs_diff(&want_state, &naive_state) <= 1e-6);
        for chunk in [CHUNK, 2 * SOLVE_BLOCK + 5] {
            let (out, state) = run(&inp, d, Some(chunk));
            assert!(max_abs_diff(&out, &want_out) <= 1e-5, "chunk={chunk}");
            assert!(max_abs_diff(&state, &want_state) <= 1e-5, "chunk={chunk}");
        }
    }

    #[test]
    fn empty_sequence_keeps_state() {
        let d = dims(0);
        let inp = random_inputs(d, 3);
        for chunk in [None, Some(CHUNK)] {
            let (out, state) = run(&inp, d, chunk);
            assert!(out.is_empty());
            assert_eq!(state, inp.state);
        }
    }

    /// Two halves with the state carried between them equal one run over the
    /// whole sequence, for both forms (and mixing them: chunked prefill, then
    /// recurrent decode).
    /// Decoding token by token gives the bits of one call over all the
    /// tokens (the engine's prefix cache and prefill/decode agreement rely
    /// on it), with full tiles and a ragged edge, one head and many.
    #[test]
    fn decode_steps_are_bit_identical_to_one_call() {
        for (nv, dv) in [
            (4, 2 * TILE + 3),
            (1, TILE),
            (2, 5),
            (2, 64),
            (3, 32),
            (1, 128),
        ] {
            let d = |t| GatedDeltaDims {
                t,
                nk: 1,
                nv,
                dk: 24,
                dv,
            };
            let t = 9;
            let inp = random_inputs(d(t), 7);
            let (want_out, want_state) = run(&inp, d(t), None);
            let mut state = inp.state.clone();
            let mut out = Vec::new();
            for ti in 0..t {
                let step = Inputs {
                    q: inp.q[ti * 24..(ti + 1) * 24].to_vec(),
                    k: inp.k[ti * 24..(ti + 1) * 24].to_vec(),
                    v: inp.v[ti * nv * dv..(ti + 1) * nv * dv].to_vec(),
                    g: inp.g[ti * nv..(ti + 1) * nv].to_vec(),
                    beta: inp.beta[ti * nv..(ti + 1) * nv].to_vec(),
                    state,
                };
                let (o, s) = run(&step, d(1), None);
                out.extend(o);
                state = s;
            }
            let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
            assert_eq!(bits(&out), bits(&want_out), "dv {dv}");
            assert_eq!(bits(&state), bits(&want_state), "dv {dv}");
            let (naive_out, _) = naive(&inp, d(t));
            assert!(max_abs_diff(&out, &naive_out) <= 1e-5);
        }
    }

    /// The checkpointed forward is the plain forward bit for bit, its
    /// checkpoints are the states at chunk starts, and the backward from
    /// them matches the backward that recomputes them.
    #[test]
    fn checkpointed_forward_and_backward_agree_with_plain() {
        let t = 2 * CHECKPOINT_EVERY + 9;
        let d = dims(t);
        let GatedDeltaDims { nk, nv, dk, dv, .. } = d;
        let inp = random_inputs(d, 5);
        let (want_out, want_state) = run(&inp, d, None);
        let sn = nv * dk * dv;
        let mut cps = vec![0.0f32; 3 * sn];
        let mut out = vec![0.0f32; t * nv * dv];
        let mut state = inp.state.clone();
        gated_delta_recurrent_forward_checkpointed(
            &mut out, &mut state, &inp.q, &inp.k, &inp.v, &inp.g, &inp.beta, d, &mut cps,
        )
        .unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<u32>>();
        assert_eq!(bits(&out), bits(&want_out));
        assert_eq!(bits(&state), bits(&want_state));
        assert_eq!(&cps[..sn], &inp.state[..]);
        let (_, mid) = run(
            &Inputs {
                q: inp.q[..CHECKPOINT_EVERY * nk * dk].to_vec(),
                k: inp.k[..CHECKPOINT_EVERY * nk * dk].to_vec(),
                v: inp.v[..CHECKPOINT_EVERY * nv * dv].to_vec(),
                g: inp.g[..CHECKPOINT_EVERY * nv].to_vec(),
                beta: inp.beta[..CHECKPOINT_EVERY * nv].to_vec(),
                state: inp.state.clone(),
            },
            dims(CHECKPOINT_EVERY),
            None,
        );
        assert_eq!(bits(&cps[sn..2 * sn]), bits(&mid));
        let dout: Vec<f32> = (0..t * nv * dv)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) / 7.0)
            .collect();
        let grads = |from_cps: bool| {
            let (mut dq, mut dk_, mut dv_) = (
                vec![0.0; t * nk * dk],
                vec![0.0; t * nk * dk],
                vec![0.0; t * nv * dv],
            );
            let (mut dg, mut db, mut ds) = (vec![0.0; t * nv], vec![0.0; t * nv], vec![0.0; sn]);
            if from_cps {
                gated_delta_backward_from_checkpoints(
                    &mut dq,
                    &mut dk_,
                    &mut dv_,
                    &mut dg,
                    &mut db,
                    Some(&mut ds),
                    None,
                    &dout,
                    &cps,
                    &inp.q,
                    &inp.k,
                    &inp.v,
                    &inp.g,
                    &inp.beta,
                    d,
                )
                .unwrap();
            } else {
                gated_delta_backward(
                    &mut dq,
                    &mut dk_,
                    &mut dv_,
                    &mut dg,
                    &mut db,
                    Some(&mut ds),
                    &dout,
                    &inp.state,
                    &inp.q,
                    &inp.k,
                    &inp.v,
                    &inp.g,
                    &inp.beta,
                    d,
                )
                .unwrap();
            }
            [dq, dk_, dv_, dg, db, ds]
        };
        for (a, b) in grads(true).iter().zip(grads(false).iter()) {
            let scale = b.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
            assert!(
                max_abs_diff(a, b) <= 1e-5 * scale,
                "{} vs scale {scale}",
                max_abs_diff(a, b)
            );
        }
        let short = vec![0.0f32; 2 * sn];
        let mut z = vec![0.0f32; t * nk * dk];
        assert!(gated_delta_backward_from_checkpoints(
            &mut z.clone(),
            &mut z,
            &mut vec![0.0; t * nv * dv],
            &mut vec![0.0; t * nv],
            &mut vec![0.0; t * nv],
            None,
            None,
            &dout,
            &short,
            &inp.q,
            &inp.k,
            &inp.v,
            &inp.g,
            &inp.beta,
            d,
        )
        .is_err());
    }

    #[test]
    fn state_carries_across_calls() {
        let t = 130;
        let split = 77;
        let d = dims(t);
        let inp = random_inputs(d, 42);
        let (want_out, want_state) = run(&inp, d, None);
        let GatedDeltaDims { nk, nv, dk, dv, .. } = d;
        let part = |lo: usize, hi: usize| {
            let mut p = random_inputs(dims(0), 0);
            p.q = inp.q[lo * nk * dk..hi * nk * dk].to_vec();
            p.k = inp.k[lo * nk * dk..hi * nk * dk].to_vec();
            p.v = inp.v[lo * nv * dv..hi * nv * dv].to_vec();
            p.g = inp.g[lo * nv..hi * nv].to_vec();
            p.beta = inp.beta[lo * nv..hi * nv].to_vec();
            p
        };
        for (first, second) in [(None, None), (Some(CHUNK), Some(CHUNK)), (Some(16), None)] {
            let mut a = part(0, split);
            a.state = inp.state.clone();
            let (out_a, state_a) = run(&a, dims(split), first);
            let mut b = part(split, t);
            b.state = state_a;
            let (out_b, state_b) = run(&b, dims(t - split), second);
            let out: Vec<f32> = out_a.into_iter().chain(out_b).collect();
            assert!(
                max_abs_diff(&out, &want_out) <= 1e-5,
                "{first:?} {second:?}"
            );
            assert!(
                max_abs_diff(&state_b, &want_state) <= 1e-5,
                "{first:?} {second:?}"
            );
        }
        // Token-by-token decode with the recurrent form.
        let mut state = inp.state.clone();
        let mut out = Vec::new();
        for ti in 0..t {
            let mut step = part(ti, ti + 1);
            step.state = state;
            let (o, s) = run(&step, dims(1), None);
            out.extend(o);
            state = s;
        }
        assert!(max_abs_diff(&out, &want_out) <= 1e-6);
        assert!(max_abs_diff(&state, &want_state) <= 1e-6);
    }

    #[test]
    fn bad_lengths_are_errors() {
        let d = dims(5);
        let inp = random_inputs(d, 7);
        let n_out = d.t * d.nv * d.dv;
        let call = |out_len: usize,
                    state_drop: usize,
                    which: &str,
                    d: GatedDeltaDims,
                    chunk: Option<usize>| {
            let mut out = vec![0.0; out_len];
            let mut state = inp.state[state_drop..].to_vec();
            let cut = |name: &str, x: &[f32]| -> Vec<f32> {
                if name == which {
                    x[1..].to_vec()
                } else {
                    x.to_vec()
                }
            };
            let (q, k, v) = (cut("q", &inp.q), cut("k", &inp.k), cut("v", &inp.v));
            let (g, beta) = (cut("g", &inp.g), cut("beta", &inp.beta));
            match chunk {
                None => {
                    gated_delta_recurrent_forward(&mut out, &mut state, &q, &k, &v, &g, &beta, d)
                }
                Some(c) => {
                    gated_delta_chunked_forward(&mut out, &mut state, &q, &k, &v, &g, &beta, d, c)
                }
            }
        };
        for chunk in [None, Some(CHUNK)] {
            assert!(call(n_out, 0, "", d, chunk).is_ok());
            assert!(matches!(
                call(n_out - 1, 0, "", d, chunk),
                Err(Error::Shape(_))
            ));
            assert!(matches!(
                call(n_out + 1, 0, "", d, chunk),
                Err(Error::Shape(_))
            ));
            assert!(matches!(call(n_out, 1, "", d, chunk), Err(Error::Shape(_))));
            for which in ["q", "k", "v", "g", "beta"] {
                assert!(
                    matches!(call(n_out, 0, which, d, chunk), Err(Error::Shape(_))),
                    "{which}"
                );
            }
            // Dims that disagree with the buffers, and nv not a multiple of nk.
            let wrong_t = GatedDeltaDims { t: 6, ..d };
            assert!(matches!(
                call(n_out, 0, "", wrong_t, chunk),
                Err(Error::Shape(_))
            ));
            let odd_heads = GatedDeltaDims { nk: 3, ..d };
            assert!(matches!(
                call(n_out, 0, "", odd_heads, chunk),
                Err(Error::Shape(_))
            ));
            let no_key_heads = GatedDeltaDims { nk: 0, ..d };
            assert!(matches!(
                call(n_out, 0, "", no_key_heads, chunk),
                Err(Error::Shape(_))
            ));
            let huge = GatedDeltaDims { t: usize::MAX, ..d };
            assert!(matches!(
                call(n_out, 0, "", huge, chunk),
                Err(Error::Shape(_))
            ));
        }
        assert!(matches!(
            call(n_out, 0, "", d, Some(0)),
            Err(Error::Shape(_))
        ));
    }

    mod backward {
        use super::super::*;
        use crate::cpu::gradcheck::{check as fd_check, rand_vec, rng};
        use rand::Rng;

        fn l2rows(x: &mut [f32], d: usize) {
            for row in x.chunks_exact_mut(d) {
                let n = row.iter().map(|v| v * v).sum::<f32>().sqrt();
                row.iter_mut().for_each(|v| *v /= n);
            }
        }

        #[test]
        fn matches_finite_differences_with_shared_key_heads_and_state() {
            let mut r = rng(9);
            let dims = GatedDeltaDims {
                t: 7,
                nk: 1,
                nv: 2,
                dk: 3,
                dv: 2,
            };
            let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
            let mut q = rand_vec(&mut r, t * nk * dk, 1.0);
            let mut k = rand_vec(&mut r, t * nk * dk, 1.0);
            l2rows(&mut k, dk);
            let mut v = rand_vec(&mut r, t * nv * dv, 1.0);
            let mut g: Vec<f32> = (0..t * nv).map(|_| -r.gen_range(0.05..1.5)).collect();
            let mut beta: Vec<f32> = (0..t * nv).map(|_| r.gen_range(0.1..0.9)).collect();
            let mut s0 = rand_vec(&mut r, nv * dk * dv, 0.5);
            let probe = rand_vec(&mut r, t * nv * dv, 1.0);
            let mut grads = [
                vec![0.0; q.len()],
                vec![0.0; k.len()],
                vec![0.0; v.len()],
                vec![0.0; g.len()],
                vec![0.0; beta.len()],
            ];
            let mut ds0 = vec![0.0; s0.len()];
            let [dq, dkk, dvv, dg, db] = &mut grads;
            gated_delta_backward(
                dq,
                dkk,
                dvv,
                dg,
                db,
                Some(&mut ds0),
                &probe,
                &s0,
                &q,
                &k,
                &v,
                &g,
                &beta,
                dims,
            )
            .unwrap();
            let loss = |q: &[f32], k: &[f32], v: &[f32], g: &[f32], b: &[f32], s: &[f32]| {
                let mut out = vec![0.0; t * nv * dv];
                let mut st = s.to_vec();
                gated_delta_recurrent_forward(&mut out, &mut st, q, k, v, g, b, dims).unwrap();
                out.iter()
                    .zip(&probe)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            };
            let (q0, k0, v0, g0, b0, s00) = (
                q.clone(),
                k.clone(),
                v.clone(),
                g.clone(),
                beta.clone(),
                s0.clone(),
            );
            let tol = 2e-3;
            fd_check(
                "dq",
                &mut q,
                &grads[0],
                |x| loss(x, &k0, &v0, &g0, &b0, &s00),
                1e-2,
                tol,
            );
            fd_check(
                "dk",
                &mut k,
                &grads[1],
                |x| loss(&q0, x, &v0, &g0, &b0, &s00),
                1e-2,
                tol,
            );
            fd_check(
                "dv",
                &mut v,
                &grads[2],
                |x| loss(&q0, &k0, x, &g0, &b0, &s00),
                1e-2,
                tol,
            );
            fd_check(
                "dg",
                &mut g,
                &grads[3],
                |x| loss(&q0, &k0, &v0, x, &b0, &s00),
                1e-2,
                tol,
            );
            fd_check(
                "dbeta",
                &mut beta,
                &grads[4],
                |x| loss(&q0, &k0, &v0, &g0, x, &s00),
                1e-2,
                tol,
            );
            fd_check(
                "dstate0",
                &mut s0,
                &ds0,
                |x| loss(&q0, &k0, &v0, &g0, &b0, x),
                1e-2,
                tol,
            );
        }

        /// A sequence cut in two and run as a prefix then a continuation
        /// from its state has the whole sequence's gradient: the
        /// continuation's `dstate0` handed to the prefix as `dstate_last`
        /// (how the trainer shares a prompt between attempts). Both
        /// forms, cuts inside and at a chunk edge, GQA.
        #[test]
        fn the_last_state_gradient_joins_a_prefix_to_its_continuation() {
            use super::{max_abs_diff, random_inputs as inputs};
            for chunked in [false, true] {
                for (a, b) in [(70, 50), (64, 3), (1, 90), (100, 1)] {
                    let t = a + b;
                    let d = GatedDeltaDims {
                        t,
                        nk: 2,
                        nv: 4,
                        dk: 8,
                        dv: 6,
                    };
                    let (nk, nv, dk, dv) = (d.nk, d.nv, d.dk, d.dv);
                    let inp = inputs(d, 40 + t as u64);
                    let probe: Vec<f32> = (0..t * nv * dv)
                        .map(|i| ((i * 29 % 13) as f32 - 6.0) / 9.0)
                        .collect();
                    let whole = backward_of(&inp, 0..t, d, &probe, &inp.state, None, chunked);
                    // The prefix's last state, where the continuation starts.
                    let mut mid = inp.state.clone();
                    let mut out = vec![0.0f32; a * nv * dv];
                    let part = |x: &[f32], w: usize, r: std::ops::Range<usize>| {
                        x[r.start * w..r.end * w].to_vec()
                    };
                    gated_delta_recurrent_forward(
                        &mut out,
                        &mut mid,
                        &part(&inp.q, nk * dk, 0..a),
                        &part(&inp.k, nk * dk, 0..a),
                        &part(&inp.v, nv * dv, 0..a),
                        &part(&inp.g, nv, 0..a),
                        &part(&inp.beta, nv, 0..a),
                        GatedDeltaDims { t: a, ..d },
                    )
                    .unwrap();
                    let pb = part(&probe, nv * dv, a..t);
                    let tail = backward_of(&inp, a..t, d, &pb, &mid, None, chunked);
                    let pa = part(&probe, nv * dv, 0..a);
                    let head = backward_of(&inp, 0..a, d, &pa, &inp.state, Some(&tail[5]), chunked);
                    let widths = [nk * dk, nk * dk, nv * dv, nv, nv];
                    for (i, w) in widths.into_iter().enumerate() {
                        let mut joined = head[i].clone();
                        joined.extend_from_slice(&tail[i]);
                        let scale = whole[i].iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                        let diff = max_abs_diff(&joined, &whole[i]);
                        assert_eq!(joined.len(), t * w);
                        assert!(
                            diff <= 1e-5 * scale,
                            "chunked={chunked} cut {a}+{b}, gradient {i}: {diff} at scale {scale}"
                        );
                    }
                    let scale = whole[5].iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                    assert!(max_abs_diff(&head[5], &whole[5]) <= 1e-5 * scale);
                }
            }
        }

        /// Gradients of `sum(out * probe)` from the checkpointed forward,
        /// by either backward: `[dq, dk, dv, dg, dbeta, dstate0]`.
        fn grads_by(
            inp: &super::Inputs,
            dims: GatedDeltaDims,
            probe: &[f32],
            chunked: bool,
        ) -> [Vec<f32>; 6] {
            backward_of(inp, 0..dims.t, dims, probe, &inp.state, None, chunked)
        }

        /// [`grads_by`] of tokens `r` of `inp` run from the state `s0`,
        /// with `ds_last` the gradient of the state after them.
        #[allow(clippy::too_many_arguments)]
        fn backward_of(
            inp: &super::Inputs,
            r: std::ops::Range<usize>,
            d: GatedDeltaDims,
            probe: &[f32],
            s0: &[f32],
            ds_last: Option<&[f32]>,
            chunked: bool,
        ) -> [Vec<f32>; 6] {
            let (nk, nv, dk, dv) = (d.nk, d.nv, d.dk, d.dv);
            let d = GatedDeltaDims { t: r.len(), ..d };
            let t = d.t;
            let cut = |x: &[f32], w: usize| x[r.start * w..r.end * w].to_vec();
            let (q, k, v) = (
                cut(&inp.q, nk * dk),
                cut(&inp.k, nk * dk),
                cut(&inp.v, nv * dv),
            );
            let (g, beta) = (cut(&inp.g, nv), cut(&inp.beta, nv));
            let sn = nv * dk * dv;
            let mut cps = vec![0.0f32; t.div_ceil(CHECKPOINT_EVERY).max(1) * sn];
            let mut out = vec![0.0f32; t * nv * dv];
            let mut state = s0.to_vec();
            gated_delta_recurrent_forward_checkpointed(
                &mut out, &mut state, &q, &k, &v, &g, &beta, d, &mut cps,
            )
            .unwrap();
            let mut gr = [
                vec![0.0; t * nk * dk],
                vec![0.0; t * nk * dk],
                vec![0.0; t * nv * dv],
                vec![0.0; t * nv],
                vec![0.0; t * nv],
                vec![0.0; sn],
            ];
            let [dq, dkk, dvv, dg, db, ds] = &mut gr;
            let f = if chunked {
                gated_delta_chunked_backward_from_checkpoints
            } else {
                gated_delta_backward_from_checkpoints
            };
            f(
                dq,
                dkk,
                dvv,
                dg,
                db,
                Some(ds),
                ds_last,
                probe,
                &cps,
                &q,
                &k,
                &v,
                &g,
                &beta,
                d,
            )
            .unwrap();
            gr
        }

        /// The chunked backward is the recurrent one's gradient: GQA, dk != dv,
        /// a partial last chunk, one token, an exact chunk.
        #[test]
        fn chunked_matches_recurrent() {
            for (t, seed) in [(150, 1), (1, 2), (64, 3), (65, 4)] {
                let d = GatedDeltaDims {
                    t,
                    nk: 2,
                    nv: 4,
                    dk: 12,
                    dv: 10,
                };
                let inp = super::random_inputs(d, seed);
                let mut r = rng(seed);
                let probe = rand_vec(&mut r, t * d.nv * d.dv, 1.0);
                let want = grads_by(&inp, d, &probe, false);
                let got = grads_by(&inp, d, &probe, true);
                for (name, (a, b)) in ["dq", "dk", "dv", "dg", "dbeta", "dstate0"]
                    .iter()
                    .zip(got.iter().zip(&want))
                {
                    let scale = b.iter().fold(1e-3f32, |m, x| m.max(x.abs()));
                    let diff = super::max_abs_diff(a, b);
                    assert!(
                        diff <= 2e-5 * scale,
                        "t {t} {name}: {diff:e} against a scale of {scale}"
                    );
                }
            }
        }

        /// The recurrence and its backward in f64, token by token:
        /// `[dq, dk, dv, dg, dbeta, dstate0]` of `sum(out * probe)`.
        fn grads_f64(inp: &super::Inputs, dims: GatedDeltaDims, probe: &[f32]) -> [Vec<f64>; 6] {
            let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
            let r = nv / nk;
            let mut gr = [
                vec![0.0; t * nk * dk],
                vec![0.0; t * nk * dk],
                vec![0.0; t * nv * dv],
                vec![0.0; t * nv],
                vec![0.0; t * nv],
                vec![0.0; nv * dk * dv],
            ];
            for h in 0..nv {
                let kh = h / r;
                let qv = |ti: usize, i: usize| inp.q[(ti * nk + kh) * dk + i] as f64;
                let kv = |ti: usize, i: usize| inp.k[(ti * nk + kh) * dk + i] as f64;
                let vv = |ti: usize, j: usize| inp.v[(ti * nv + h) * dv + j] as f64;
                // states[ti] is the state before token ti.
                let mut states = vec![vec![0.0f64; dk * dv]; t + 1];
                for (x, s) in states[0].iter_mut().zip(&inp.state[h * dk * dv..]) {
                    *x = *s as f64;
                }
                for ti in 0..t {
                    let decay = (inp.g[ti * nv + h] as f64).exp();
                    let b = inp.beta[ti * nv + h] as f64;
                    let mut s: Vec<f64> = states[ti].iter().map(|x| x * decay).collect();
                    for j in 0..dv {
                        let sk: f64 = (0..dk).map(|i| s[i * dv + j] * kv(ti, i)).sum();
                        let delta = b * (vv(ti, j) - sk);
                        for i in 0..dk {
                            s[i * dv + j] += kv(ti, i) * delta;
                        }
                    }
                    states[ti + 1] = s;
                }
                let mut ds = vec![0.0f64; dk * dv];
                for ti in (0..t).rev() {
                    let decay = (inp.g[ti * nv + h] as f64).exp();
                    let b = inp.beta[ti * nv + h] as f64;
                    let sa: Vec<f64> = states[ti].iter().map(|x| x * decay).collect();
                    let s1 = &states[ti + 1];
                    let dov = |j: usize| probe[(ti * nv + h) * dv + j] as f64;
                    for i in 0..dk {
                        let mut dq = 0.0;
                        for j in 0..dv {
                            dq += s1[i * dv + j] * dov(j);
                            ds[i * dv + j] += qv(ti, i) * dov(j);
                        }
                        gr[0][(ti * nk + kh) * dk + i] += dq;
                    }
                    let (mut dbeta, mut dg) = (0.0, 0.0);
                    let mut dkt = vec![0.0f64; dk];
                    let mut dkv = vec![0.0f64; dv];
                    for j in 0..dv {
                        let sk: f64 = (0..dk).map(|i| sa[i * dv + j] * kv(ti, i)).sum();
                        let res = vv(ti, j) - sk;
                        let dd: f64 = (0..dk).map(|i| ds[i * dv + j] * kv(ti, i)).sum();
                        gr[2][(ti * nv + h) * dv + j] = b * dd;
                        dbeta += dd * res;
                        for (i, x) in dkt.iter_mut().enumerate() {
                            *x += ds[i * dv + j] * b * res;
                        }
                        dkv[j] = -b * dd;
                    }
                    for i in 0..dk {
                        for j in 0..dv {
                            dkt[i] += sa[i * dv + j] * dkv[j];
                            let x = ds[i * dv + j] + kv(ti, i) * dkv[j];
                            dg += sa[i * dv + j] * x;
                            ds[i * dv + j] = x * decay;
                        }
                        gr[1][(ti * nk + kh) * dk + i] += dkt[i];
                    }
                    gr[3][ti * nv + h] = dg;
                    gr[4][ti * nv + h] = dbeta;
                }
                gr[5][h * dk * dv..(h + 1) * dk * dv].copy_from_slice(&ds);
            }
            gr
        }

        /// Each f32 backward's error against the f64 recurrence, per tensor
        /// (relative L2 norm): the chunked form must be within 3x of the
        /// recurrent one's on every tensor, the decay's included. Measured
        /// over 700 tokens at 32-wide heads: 1.7e-7 to 2.2e-7 against
        /// 0.75e-7 to 1.7e-7 (with f32 cumulative decays it was 5 to 10x).
        #[test]
        fn chunked_is_as_accurate_as_recurrent_against_f64() {
            let d = GatedDeltaDims {
                t: 700,
                nk: 2,
                nv: 4,
                dk: 32,
                dv: 32,
            };
            let inp = super::random_inputs(d, 7);
            let mut r = rng(7);
            let probe = rand_vec(&mut r, d.t * d.nv * d.dv, 1.0);
            let exact = grads_f64(&inp, d, &probe);
            let err = |got: &[f32], want: &[f64]| {
                let num: f64 = got
                    .iter()
                    .zip(want)
                    .map(|(a, b)| (*a as f64 - b).powi(2))
                    .sum();
                let den: f64 = want.iter().map(|b| b * b).sum();
                (num / den.max(1e-300)).sqrt()
            };
            let rec = grads_by(&inp, d, &probe, false);
            let chk = grads_by(&inp, d, &probe, true);
            for (i, name) in ["dq", "dk", "dv", "dg", "dbeta", "dstate0"]
                .iter()
                .enumerate()
            {
                let (er, ec) = (err(&rec[i], &exact[i]), err(&chk[i], &exact[i]));
                eprintln!("{name}: recurrent {er:.2e}, chunked {ec:.2e}");
                assert!(
                    ec <= 3.0 * er.max(1e-7),
                    "{name}: chunked {ec:e}, recurrent {er:e}"
                );
            }
        }

        /// Longer than one recompute chunk: the gradient of a linear probe
        /// against the chunked forward, checked on a random direction.
        #[test]
        fn directional_derivative_across_chunks() {
            let mut r = rng(10);
            let dims = GatedDeltaDims {
                t: 150,
                nk: 2,
                nv: 4,
                dk: 4,
                dv: 3,
            };
            let GatedDeltaDims { t, nk, nv, dk, dv } = dims;
            let q = rand_vec(&mut r, t * nk * dk, 1.0);
            let mut k = rand_vec(&mut r, t * nk * dk, 1.0);
            l2rows(&mut k, dk);
            let v = rand_vec(&mut r, t * nv * dv, 1.0);
            let g: Vec<f32> = (0..t * nv).map(|_| -r.gen_range(0.01..0.3)).collect();
            let beta: Vec<f32> = (0..t * nv).map(|_| r.gen_range(0.1..0.9)).collect();
            let s0 = vec![0.0; nv * dk * dv];
            let probe = rand_vec(&mut r, t * nv * dv, 1.0);
            let (mut dq, mut dkk, mut dvv) =
                (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
            let (mut dg, mut db) = (vec![0.0; g.len()], vec![0.0; beta.len()]);
            gated_delta_backward(
                &mut dq, &mut dkk, &mut dvv, &mut dg, &mut db, None, &probe, &s0, &q, &k, &v, &g,
                &beta, dims,
            )
            .unwrap();
            let dirs: Vec<Vec<f32>> = [q.len(), k.len(), v.len(), g.len(), beta.len()]
                .iter()
                .map(|&n| rand_vec(&mut r, n, 1.0))
                .collect();
            let loss = |eps: f32| {
                let sh = |x: &[f32], d: &[f32]| -> Vec<f32> {
                    x.iter().zip(d).map(|(a, b)| a + eps * b).collect()
                };
                let mut out = vec![0.0; t * nv * dv];
                let mut st = s0.clone();
                gated_delta_chunked_forward(
                    &mut out,
                    &mut st,
                    &sh(&q, &dirs[0]),
                    &sh(&k, &dirs[1]),
                    &sh(&v, &dirs[2]),
                    &sh(&g, &dirs[3]),
                    &sh(&beta, &dirs[4]),
                    dims,
                    64,
                )
                .unwrap();
                out.iter()
                    .zip(&probe)
                    .map(|(a, b)| *a as f64 * *b as f64)
                    .sum::<f64>()
            };
            let eps = 1e-3;
            let numeric = (loss(eps) - loss(-eps)) / (2.0 * eps as f64);
            let analytic: f64 = [&dq, &dkk, &dvv, &dg, &db]
                .iter()
                .zip(&dirs)
                .map(|(gr, d)| {
                    gr.iter()
                        .zip(d)
                        .map(|(a, b)| *a as f64 * *b as f64)
                        .sum::<f64>()
                })
                .sum();
            let rel = (numeric - analytic).abs() / analytic.abs().max(1.0);
            assert!(
                rel < 1e-3,
                "analytic {analytic} vs numeric {numeric} (rel {rel:.2e})"
            );
        }
    }
}
