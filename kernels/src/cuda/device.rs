//! A CUDA device: its context and stream, every module loaded from the
//! kernel cache for the device's own architecture, and one method per op
//! with the CPU reference's name, argument order (outputs, saved, inputs,
//! sizes) and shape checks (`crate::cpu`).
//!
//! Buffers are `cudarc` device slices; launches go on the device's one
//! stream, so ops run in issue order and a download synchronizes. The GPU
//! tests at the bottom compare every op with its CPU reference at odd
//! shapes; they need a GPU and say they were skipped without one
//! (`ARCTICD_REQUIRE_GPU=1`, as `scripts/gpu-check.sh` sets it, turns the
//! skip into a failure).

use super::index_cache::IndexCache;
use super::{KernelCache, MODULES};
use crate::{Error, Result};
pub use cudarc::driver::CudaEvent;
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Threads per block of the row kernels (one block per row).
const ROW_THREADS: u32 = 256;
/// Threads per block of the elementwise kernels.
const ELEM_THREADS: u32 = 256;

/// Whether the CUDA driver library can be loaded (checked before any call:
/// cudarc panics on a missing library).
pub fn driver_available() -> bool {
    // SAFETY: only tries to open the library by its candidate names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

fn shape(op: &str, checks: &[(&str, usize, usize)]) -> Result<()> {
    for (name, got, want) in checks {
        if got != want {
            return Err(Error::Shape(format!(
                "{op}: {name} has {got} elements, expected {want}"
            )));
        }
    }
    Ok(())
}

fn int(op: &str, what: &str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::Shape(format!("{op}: {what} = {v} does not fit in i32")))
}

fn rows(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn elems(n: usize) -> LaunchConfig {
    let blocks = n.div_ceil(ELEM_THREADS as usize).clamp(1, 65_535) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (ELEM_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Most head_dim the attention kernels hold in registers (8 per lane).
const MAX_HEAD_DIM: usize = 256;
/// Warps per attention block.
const ATTN_WARPS: usize = 4;

fn check_heads(op: &str, n_heads: usize, n_kv_heads: usize, hd: usize) -> Result<()> {
    if n_kv_heads == 0 || !n_heads.is_multiple_of(n_kv_heads) || hd == 0 || hd > MAX_HEAD_DIM {
        return Err(Error::Shape(format!(
            "{op}: {n_heads} heads over {n_kv_heads} KV heads of {hd} \
             (head_dim 1..={MAX_HEAD_DIM}, heads a multiple of KV heads)"
        )));
    }
    Ok(())
}

/// attention_split_merge: a block per (sequence, head), threads over the dims.
fn split_merge_launch(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Prefill attention (attention.cu): warps per slot, (query, head) pairs per
/// warp, keys per shared-memory tile.
const ATTN_PAIR_WARPS: usize = 4;
const ATTN_PAIRS_PER_WARP: usize = 4;
const ATTN_KEY_TILE: usize = 16;
/// Attention backward: rows (pairs for dq, keys for dk/dv) per warp.
const ATTN_BWD_ROWS: usize = 2;
/// (query, head) pairs per prefill block.
const ATTN_PAIRS: usize = ATTN_PAIR_WARPS * ATTN_PAIRS_PER_WARP;
/// Keys per split: every kernel folds a query's keys split by split, and
/// decode runs a block per split.
const ATTN_SPLIT: usize = 512;

/// Decode: query heads of one KV head per block.
const ATTN_DECODE_HEADS: usize = 4;

/// Decode's blocks: for every sequence, KV head and run of up to
/// `ATTN_DECODE_HEADS` of its query heads, one per split; the launch
/// (`hb` heads' warps, their merge buffers).
fn decode_launch(
    seqs: usize,
    n_heads: usize,
    n_kv_heads: usize,
    hd: usize,
    splits: usize,
) -> LaunchConfig {
    let group = n_heads / n_kv_heads;
    let hb = group.min(ATTN_DECODE_HEADS);
    LaunchConfig {
        grid_dim: (
            (seqs * n_kv_heads * group.div_ceil(hb) * splits) as u32,
            1,
            1,
        ),
        block_dim: ((hb * ATTN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: (hb * ATTN_WARPS * (hd + 2) * 4) as u32,
    }
}

/// Decode's splits per (sequence, head): the longest context's, at least 1.
fn decode_splits(context_lens: &[u32]) -> usize {
    let longest = context_lens.iter().copied().max().unwrap_or(0) as usize;
    longest.div_ceil(ATTN_SPLIT).max(1)
}

/// The prefill blocks' tiles: `(sequence, first pair)` for every run of
/// `ATTN_PAIRS` (query, head) pairs of a sequence's new tokens (rows
/// `cu_seqlens[s]..cu_seqlens[s + 1]`) over one KV head, flattened (a
/// sequence with no new token has none), and the blocks: every tile over
/// every KV head.
fn prefill_tiles(cu_seqlens: &[u32], n_heads: usize, n_kv_heads: usize) -> (Vec<u32>, usize) {
    let group = n_heads / n_kv_heads;
    let mut tiles = Vec::new();
    for (s, w) in cu_seqlens.windows(2).enumerate() {
        for pair0 in (0..(w[1] - w[0]) as usize * group).step_by(ATTN_PAIRS) {
            tiles.extend([s as u32, pair0 as u32]);
        }
    }
    let blocks = tiles.len() / 2 * n_kv_heads;
    (tiles, blocks)
}

fn attention_prefill_launch(blocks: usize, hd: usize) -> LaunchConfig {
    let warps = ATTN_WARPS * ATTN_PAIR_WARPS;
    // The key tiles (or the merge buffer, in the same memory), then each
    // pair's running max and sum, twice.
    let floats = (2 * ATTN_KEY_TILE * hd).max(warps * (hd + 2)) + 4 * ATTN_PAIRS;
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((warps * 32) as u32, 1, 1),
        shared_mem_bytes: (floats * 4) as u32,
    }
}

/// Launches `kernel` on the device's stream with `args`, in the kernel's
/// parameter order.
macro_rules! launch {
    ($dev:expr, $kernel:expr, $cfg:expr; $($arg:expr),+ $(,)?) => {{
        let f = $dev.func($kernel)?;
        let mut b = $dev.stream.launch_builder(f);
        $(b.arg($arg);)+
        // SAFETY: every wrapper passes the kernel's parameters in its order
        // and types, after checking the sizes and indices they address.
        unsafe { b.launch($cfg) }?;
    }};
}

/// One GPU with every kernel loaded.
pub struct CudaDevice {
    ordinal: usize,
    arch: u32,
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    /// The cuBLAS handle, created by the first product (`gemm`).
    blas: std::sync::OnceLock<cudarc::cublas::CudaBlas>,
    /// Forward products on `matmul_invariant` instead of cuBLAS.
    batch_invariant: std::sync::atomic::AtomicBool,
    /// The index arrays of the current step, uploaded once for all layers.
    indices: IndexCache<CudaSlice<u32>>,
}

/// Index arrays kept on the device (`CudaDevice::index`): a step's handful
/// (offsets, slots, K/V rows, tables, tiles, the chunk plan) with room to
/// spare for a training step's and an engine step's on one device.
const KEPT_INDEX_ARRAYS: usize = 32;

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice(cuda:{}, sm_{})", self.ordinal, self.arch)
    }
}

impl CudaDevice {
    /// Opens `cuda:ORDINAL` with the default kernel cache.
    pub fn new(ordinal: usize) -> Result<Self> {
        Self::with_cache(ordinal, &KernelCache::new(KernelCache::default_dir()))
    }

    /// Opens `cuda:ORDINAL`, compiling (or reading from `cache`) every
    /// module for its architecture.
    pub fn with_cache(ordinal: usize, cache: &KernelCache) -> Result<Self> {
        if !driver_available() {
            return Err(Error::NoDevice(format!(
                "cuda:{ordinal} (the CUDA driver library libcuda.so is not on the loader path)"
            )));
        }
        let ctx = CudaContext::new(ordinal)?;
        let (major, minor) = ctx.compute_capability()?;
        let arch = (major * 10 + minor) as u32;
        let stream = ctx.default_stream();
        let mut functions = HashMap::new();
        for m in MODULES {
            let cubin = cache.get_or_compile(m, arch)?;
            let module = ctx.load_module(cudarc::nvrtc::Ptx::from_binary(cubin))?;
            for k in m.kernels {
                functions.insert(*k, module.load_function(k)?);
            }
        }
        Ok(CudaDevice {
            ordinal,
            arch,
            ctx,
            stream,
            functions,
            blas: std::sync::OnceLock::new(),
            batch_invariant: false.into(),
            indices: IndexCache::new(KEPT_INDEX_ARRAYS),
        })
    }

    /// Batch-invariant mode: this handle's forward products
    /// (`matmul_forward`, `matmul_forward_add`) run on the in-order kernel
    /// (`matmul.cu`), so a row's result does not depend on the rows beside
    /// it; off (the default), they run on cuBLAS.
    pub fn set_batch_invariant(&self, on: bool) {
        self.batch_invariant
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    pub fn is_batch_invariant(&self) -> bool {
        self.batch_invariant
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The device's ordinal (`cuda:N`).
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The stream every op of this handle runs on (an NCCL communicator
    /// for this device runs its collectives there, in order with them).
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Compute capability as one number (90 for sm_90).
    pub fn arch(&self) -> u32 {
        self.arch
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// An index array on the device for kernels to read (never write):
    /// the one uploaded before with the same values, kept with the last
    /// few, else a new upload. Every layer of a step reads the same
    /// offsets, slots and tables; they cross to the device once.
    pub fn index(&self, host: &[u32]) -> Result<Arc<CudaSlice<u32>>> {
        self.indices.get(host, |h| self.upload(h))
    }

    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    /// Free and total device memory in bytes.
    pub fn memory_info(&self) -> Result<(usize, usize)> {
        Ok(self.ctx.mem_get_info()?)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// An event that completes when the work queued on this device's
    /// stream so far has run.
    pub fn record_event(&self) -> Result<CudaEvent> {
        Ok(self.stream.record_event(None)?)
    }

    /// Orders the work queued on this device's stream from now on after
    /// `event` (another stream's), without the host waiting.
    pub fn wait_event(&self, event: &CudaEvent) -> Result<()> {
        Ok(self.stream.wait(event)?)
    }

    fn func(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::Index(format!("no CUDA kernel named {name}")))
    }

    /// `out[n, c] = inp * rstd * (1 + weight)`, `rstd[n]` saved.
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_forward(
        &self,
        out: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let op = "rmsnorm";
        shape(
            op,
            &[
                ("out", out.len(), n * c),
                ("rstd", rstd.len(), n),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
            ],
        )?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (ni, ci) = (int(op, "n", n)?, int(op, "c", c)?);
        launch!(self, "rmsnorm_forward", rows(n); out, rstd, inp, weight, &ni, &ci, &eps);
        Ok(())
    }

    /// `out[n, c] = inp * rstd * weight * silu(gate)`, `rstd[n]` saved.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_rmsnorm_forward(
        &self,
        out: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let op = "gated_rmsnorm";
        shape(
            op,
            &[
                ("out", out.len(), n * c),
                ("rstd", rstd.len(), n),
                ("inp", inp.len(), n * c),
                ("gate", gate.len(), n * c),
                ("weight", weight.len(), c),
            ],
        )?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (ni, ci) = (int(op, "n", n)?, int(op, "c", c)?);
        launch!(self, "gated_rmsnorm_forward", rows(n); out, rstd, inp, gate, weight, &ni, &ci, &eps);
        Ok(())
    }

    /// `res += inp`, then `out = rmsnorm(res)` with `(1 + weight)`; `rstd`
    /// saved. The residual add of one layer fused with the next norm.
    #[allow(clippy::too_many_arguments)]
    pub fn add_rmsnorm_forward(
        &self,
        out: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        res: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        n: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let op = "add_rmsnorm";
        shape(
            op,
            &[
                ("out", out.len(), n * c),
                ("rstd", rstd.len(), n),
                ("res", res.len(), n * c),
                ("inp", inp.len(), n * c),
                ("weight", weight.len(), c),
            ],
        )?;
        if n == 0 || c == 0 {
            return Ok(());
        }
        let (ni, ci) = (int(op, "n", n)?, int(op, "c", c)?);
        launch!(self, "add_rmsnorm_forward", rows(n); out, rstd, res, inp, weight, &ni, &ci, &eps);
        Ok(())
    }

    /// Per-head RMSNorm (`1 + weight`, `weight[head_dim]`) then partial
    /// rotate-half RoPE on the first `rot_dim` channels, in place on
    /// `x[positions.len(), heads, head_dim]`; `rstd[tokens * heads]` saved.
    #[allow(clippy::too_many_arguments)]
    pub fn qk_norm_rope_forward(
        &self,
        x: &mut CudaSlice<f32>,
        rstd: &mut CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        positions: &CudaSlice<u32>,
        heads: usize,
        head_dim: usize,
        rot_dim: usize,
        theta: f32,
        eps: f32,
    ) -> Result<()> {
        let op = "qk_norm_rope";
        let n = positions.len();
        if rot_dim > head_dim || !rot_dim.is_multiple_of(2) {
            return Err(Error::Shape(format!(
                "{op}: rot_dim {rot_dim} must be even and at most head_dim {head_dim}"
            )));
        }
        shape(
            op,
            &[
                ("x", x.len(), n * heads * head_dim),
                ("rstd", rstd.len(), n * heads),
                ("weight", weight.len(), head_dim),
            ],
        )?;
        if n == 0 || heads == 0 || head_dim == 0 {
            return Ok(());
        }
        let ints = [n, heads, head_dim, rot_dim]
            .iter()
            .map(|&v| int(op, "size", v))
            .collect::<Result<Vec<i32>>>()?;
        launch!(self, "qk_norm_rope_forward", rows(n * heads); x, rstd, weight, positions, &ints[0], &ints[1], &ints[2], &ints[3], &theta, &eps);
        Ok(())
    }

    /// `out[n, c] = table[ids[n]]`, the table f32 `[vocab, c]`. Ids are
    /// checked here (an out-of-range id is an error, as on the CPU).
    pub fn embedding_forward(
        &self,
        out: &mut CudaSlice<f32>,
        ids: &[u32],
        table: &CudaSlice<f32>,
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        self.embedding("embedding_forward_f32", out, ids, table, vocab, c)
    }

    /// [`Self::embedding_forward`] from a bf16 table (raw bits), widened.
    pub fn embedding_forward_bf16(
        &self,
        out: &mut CudaSlice<f32>,
        ids: &[u32],
        table: &CudaSlice<u16>,
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        self.embedding("embedding_forward_bf16", out, ids, table, vocab, c)
    }

    fn embedding<T>(
        &self,
        kernel: &str,
        out: &mut CudaSlice<f32>,
        ids: &[u32],
        table: &CudaSlice<T>,
        vocab: usize,
        c: usize,
    ) -> Result<()> {
        let op = "embedding";
        let n = ids.len();
        shape(
            op,
            &[("out", out.len(), n * c), ("table", table.len(), vocab * c)],
        )?;
        if let Some((t, id)) = ids.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::Index(format!(
                "token id {id} at position {t} is not below the vocabulary size {vocab}"
            )));
        }
        if n == 0 || c == 0 {
            return Ok(());
        }
        let dids = self.upload(ids)?;
        let (ni, ci, vi) = (int(op, "n", n)?, int(op, "c", c)?, int(op, "vocab", vocab)?);
        launch!(self, kernel, rows(n); out, &dids, table, &ni, &ci, &vi);
        Ok(())
    }

    /// `out = bf16(inp)` (round to nearest even), raw bits: the bf16 copy
    /// of the weights the engine reads, written from the fp32 masters.
    pub fn f32_to_bf16(&self, out: &mut CudaSlice<u16>, inp: &CudaSlice<f32>) -> Result<()> {
        let n = inp.len();
        shape("f32_to_bf16", &[("out", out.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "f32_to_bf16_copy", elems(n); out, inp, &nl);
        Ok(())
    }

    /// The Gated DeltaNet gating over `[t, nv]`: `g = -exp(a_log[h]) *
    /// softplus(a + dt_bias[h])`, `beta = sigmoid(b)`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_gating_forward(
        &self,
        g: &mut CudaSlice<f32>,
        beta: &mut CudaSlice<f32>,
        a: &CudaSlice<f32>,
        b_in: &CudaSlice<f32>,
        a_log: &CudaSlice<f32>,
        dt_bias: &CudaSlice<f32>,
        nv: usize,
    ) -> Result<()> {
        let op = "gated_delta_gating";
        let n = a.len();
        if nv == 0 || !n.is_multiple_of(nv) {
            return Err(Error::Shape(format!(
                "{op}: {n} values are not rows of {nv} heads"
            )));
        }
        shape(
            op,
            &[
                ("g", g.len(), n),
                ("beta", beta.len(), n),
                ("b", b_in.len(), n),
                ("a_log", a_log.len(), nv),
                ("dt_bias", dt_bias.len(), nv),
            ],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (ti, hi) = (int(op, "t", n / nv)?, int(op, "nv", nv)?);
        launch!(self, "gated_delta_gating_forward", elems(n); g, beta, a, b_in, a_log, dt_bias, &ti, &hi);
        Ok(())
    }

    /// One decode token of the causal conv for `slots.len()` sequences:
    /// `out, inp [seqs, c]`, conv history `state[slots, k - 1, c]`,
    /// `weight[c, k]`. Pre-activation, as on the CPU.
    pub fn conv1d_update(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        slots: &CudaSlice<u32>,
        k: usize,
    ) -> Result<()> {
        let op = "conv1d_update";
        let seqs = slots.len();
        let c = weight.len() / k.max(1);
        if k == 0 || weight.len() != c * k {
            return Err(Error::Shape(format!(
                "{op}: weight {} for kernel {k}",
                weight.len()
            )));
        }
        shape(
            op,
            &[("out", out.len(), seqs * c), ("inp", inp.len(), seqs * c)],
        )?;
        let per_slot = (k - 1) * c;
        if per_slot > 0 && !state.len().is_multiple_of(per_slot) {
            return Err(Error::Shape(format!(
                "{op}: state has {} elements, not whole slots of {per_slot}",
                state.len()
            )));
        }
        if seqs == 0 || c == 0 {
            return Ok(());
        }
        let ints = [seqs, c, k]
            .iter()
            .map(|&v| int(op, "size", v))
            .collect::<Result<Vec<i32>>>()?;
        launch!(self, op, elems(seqs * c); out, state, inp, weight, slots, &ints[0], &ints[1], &ints[2]);
        Ok(())
    }

    /// The causal conv over packed sequences (`cu_seqlens`, from 0 to the
    /// row count), each continuing the conv history in its state slot
    /// `slots[s]` of `state[slots, k - 1, c]`, which then advances: `out,
    /// inp [rows, c]`, `weight[c, k]`. Prefill and decode alike (a decode
    /// step is sequences of one row). Pre-activation, as on the CPU.
    #[allow(clippy::too_many_arguments)]
    pub fn conv1d_varlen_forward(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        weight: &CudaSlice<f32>,
        slots: &[u32],
        cu_seqlens: &[u32],
        k: usize,
    ) -> Result<()> {
        let op = "conv1d_varlen_forward";
        let seqs = slots.len();
        if k == 0 || k > 8 || !weight.len().is_multiple_of(k) {
            return Err(Error::Shape(format!(
                "{op}: weight {} for kernel width {k} (1 to 8)",
                weight.len()
            )));
        }
        let c = weight.len() / k;
        check_cu_seqlens(op, cu_seqlens, seqs)?;
        let t = cu_seqlens[seqs] as usize;
        shape(op, &[("out", out.len(), t * c), ("inp", inp.len(), t * c)])?;
        let per_slot = (k - 1) * c;
        let held = state.len().checked_div(per_slot).unwrap_or(usize::MAX);
        if let Some(bad) = slots.iter().find(|&&s| s as usize >= held) {
            return Err(Error::Index(format!(
                "{op}: slot {bad} outside a state of {held} slots"
            )));
        }
        if t == 0 || c == 0 {
            return Ok(());
        }
        let ints = [t, c, k, seqs]
            .iter()
            .map(|&v| int(op, "size", v))
            .collect::<Result<Vec<i32>>>()?;
        let (ds, cu, ts) = (
            self.index(slots)?,
            self.index(cu_seqlens)?,
            self.index(&token_seq(cu_seqlens))?,
        );
        launch!(self, op, elems(t * c); out, &*state, inp, weight, &*ds, &*cu, &*ts, &ints[0], &ints[1], &ints[2]);
        launch!(self, "conv1d_varlen_state_advance", elems(seqs * c); state, inp, &*ds, &*cu, &ints[3], &ints[1], &ints[2]);
        Ok(())
    }

    /// `buf[dst..dst + n] = buf[src..src + n]`, ranges inside `buf` that do
    /// not overlap: a state slot or K/V block of a pool into another.
    pub fn copy_within(
        &self,
        buf: &mut CudaSlice<f32>,
        src: usize,
        dst: usize,
        n: usize,
    ) -> Result<()> {
        let op = "copy_within";
        if src
            .max(dst)
            .checked_add(n)
            .is_none_or(|end| end > buf.len())
            || (src < dst + n && dst < src + n && n > 0)
        {
            return Err(Error::Shape(format!(
                "{op}: {n} values from {src} to {dst} in a buffer of {} \
                 (ranges inside it, not overlapping)",
                buf.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let a = [src, dst, n].map(|v| v as i64);
        launch!(self, op, elems(n); buf, &a[0], &a[1], &a[2]);
        Ok(())
    }

    /// `out[i] = inp[rows[i]]` for rows of `width` values.
    pub fn gather_rows(
        &self,
        out: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        rows: &[u32],
        width: usize,
    ) -> Result<()> {
        let op = "gather_rows";
        shape(op, &[("out", out.len(), rows.len() * width)])?;
        let held = inp.len().checked_div(width).unwrap_or(0);
        if let Some(bad) = rows.iter().find(|&&r| r as usize >= held) {
            return Err(Error::Index(format!(
                "{op}: row {bad} of a matrix of {held} rows"
            )));
        }
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let (r, a) = (self.upload(rows)?, [rows.len() as i64, width as i64]);
        launch!(self, op, elems(rows.len() * width); out, inp, &r, &a[0], &a[1]);
        Ok(())
    }

    /// `out[rows[i]] = inp[i]` for rows of `width` values, `rows` distinct:
    /// [`gather_rows`](Self::gather_rows)' inverse.
    pub fn scatter_rows(
        &self,
        out: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        rows: &[u32],
        width: usize,
    ) -> Result<()> {
        let op = "scatter_rows";
        shape(op, &[("inp", inp.len(), rows.len() * width)])?;
        let held = out.len().checked_div(width).unwrap_or(0);
        if let Some(bad) = rows.iter().find(|&&r| r as usize >= held) {
            return Err(Error::Index(format!(
                "{op}: row {bad} of a matrix of {held} rows"
            )));
        }
        let mut seen = rows.to_vec();
        seen.sort_unstable();
        if seen.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::Index(format!("{op}: rows must be distinct")));
        }
        if rows.is_empty() || width == 0 {
            return Ok(());
        }
        let (r, a) = (self.upload(rows)?, [rows.len() as i64, width as i64]);
        launch!(self, op, elems(rows.len() * width); out, inp, &r, &a[0], &a[1]);
        Ok(())
    }

    /// `buf[off..off + n] = 0`.
    pub fn zero_range(&self, buf: &mut CudaSlice<f32>, off: usize, n: usize) -> Result<()> {
        let op = "zero_range";
        if off.checked_add(n).is_none_or(|end| end > buf.len()) {
            return Err(Error::Shape(format!(
                "{op}: {n} values at {off} in a buffer of {}",
                buf.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let a = [off, n].map(|v| v as i64);
        launch!(self, op, elems(n); buf, &a[0], &a[1]);
        Ok(())
    }

    /// Prefill of the gated delta rule over packed sequences (`cu_seqlens`
    /// from 0 to T), each with its fp32 state at `slots[s]` in
    /// `state[slots, nv, dk, dv]`: token by token (the recurrent form), or
    /// with `chunked` in the chunked (WY) form, the same function up to
    /// rounding, in chunks of [`GD_CHUNK`] tokens from each sequence's first
    /// new token (CPU reference: `cpu::gated_delta::gated_delta_chunked_forward`),
    /// a chunk of one token as the recurrent step, with decode's bits. In
    /// the chunked form the work that touches no state (the masked attention
    /// within a chunk and the triangular solve for the pseudo-values) runs
    /// for every chunk at once, then the state advances a chunk at a time;
    /// scratch: `t * nv * (dv + dk + 1)` floats and `GD_CHUNK^2` per chunk
    /// and value head.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_prefill(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        slots: &CudaSlice<u32>,
        cu_seqlens: &[u32],
        dims: (usize, usize, usize, usize),
        chunked: bool,
    ) -> Result<()> {
        let op = "gated_delta_prefill";
        let Some(ints) = check_prefill(op, out, state, q, k, v, g, beta, slots, cu_seqlens, dims)?
        else {
            return Ok(());
        };
        let (seqs, nv, dk, dv) = (slots.len(), dims.1, dims.2, dims.3);
        if !chunked {
            check_register_columns(op, dk)?;
            let cu = self.index(cu_seqlens)?;
            let cfg = recurrent_launch(seqs * nv, dk, dv);
            launch!(self, op, cfg; out, state, q, k, v, g, beta, slots, &*cu, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]);
            return Ok(());
        }
        let plan = ChunkPlan::new(cu_seqlens, GD_CHUNK);
        self.gated_delta_chunks(
            out, state, None, q, k, v, g, beta, slots, &plan, &ints, dims,
        )?;
        Ok(())
    }

    /// The chunked prefill's two passes over `plan` (sizes `ints` = `[seqs,
    /// nk, nv, dk, dv]`), returning what the backward reads again. With
    /// `keep = (kke, starts)` (the backward's) the prep also writes `KKE`
    /// (`[chunks, nv, GD_CHUNK, GD_CHUNK]`) and the scan the state entering
    /// every chunk (`[chunks, nv, dk, dv]`).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gated_delta_chunks(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        keep: Option<(&mut CudaSlice<f32>, &mut CudaSlice<f32>)>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        slots: &CudaSlice<u32>,
        plan: &ChunkPlan,
        ints: &[i32],
        dims: (usize, usize, usize, usize),
    ) -> Result<ChunkPieces> {
        let (seqs, nv, dk, dv) = (slots.len(), dims.1, dims.2, dims.3);
        let t = plan.tokens();
        let chunks = plan.tok0.len();
        let mut p = ChunkPieces {
            a: self.zeros::<f32>(chunks * nv * GD_CHUNK * GD_CHUNK)?,
            u: self.zeros::<f32>(t * nv * dv)?,
            w: self.zeros::<f32>(t * nv * dk)?,
            cum: self.zeros::<f64>(t * nv)?,
            tok0: self.index(&plan.tok0)?,
            len: self.index(&plan.len)?,
            first: self.index(&plan.first)?,
        };
        let n = int("gated_delta_chunks", "chunks", chunks)?;
        let prep = chunk_launch(chunks * nv);
        let scan = chunk_scan_launch(seqs * nv * dv.div_ceil(GD_COLS), dk);
        let ChunkPieces {
            a,
            u,
            w,
            cum,
            tok0,
            len,
            first,
        } = &mut p;
        match keep {
            None => {
                launch!(self, "gated_delta_chunk_prep", prep; &mut *a, &mut *u, &mut *w, &mut *cum, &NULL, q, k, v, g, beta, &**tok0, &**len, &n, &ints[1], &ints[2], &ints[3], &ints[4]);
                launch!(self, "gated_delta_chunk_scan", scan; out, state, &NULL, &*u, &*a, &*w, &*cum, q, k, v, g, beta, slots, &**first, &**tok0, &**len, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]);
            }
            Some((kke, starts)) => {
                launch!(self, "gated_delta_chunk_prep", prep; &mut *a, &mut *u, &mut *w, &mut *cum, kke, q, k, v, g, beta, &**tok0, &**len, &n, &ints[1], &ints[2], &ints[3], &ints[4]);
                launch!(self, "gated_delta_chunk_scan", scan; out, state, starts, &*u, &*a, &*w, &*cum, q, k, v, g, beta, slots, &**first, &**tok0, &**len, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]);
            }
        }
        Ok(p)
    }

    /// `out = silu(gate) * up`.
    pub fn silu_mul_forward(
        &self,
        out: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = out.len();
        shape("silu_mul", &[("gate", gate.len(), n), ("up", up.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "silu_mul_forward", elems(n); out, gate, up, &nl);
        Ok(())
    }

    /// `x *= sigmoid(gate)`, in place.
    pub fn sigmoid_gate_forward(
        &self,
        x: &mut CudaSlice<f32>,
        gate: &CudaSlice<f32>,
    ) -> Result<()> {
        let n = x.len();
        shape("sigmoid_gate", &[("gate", gate.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "sigmoid_gate_forward", elems(n); x, gate, &nl);
        Ok(())
    }

    /// `x = silu(x)`, in place (after the causal conv).
    pub fn silu_forward(&self, x: &mut CudaSlice<f32>) -> Result<()> {
        let n = x.len();
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "silu_forward", elems(n); x, &nl);
        Ok(())
    }

    /// `x += y`.
    pub fn add_assign(&self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        let n = x.len();
        shape("add_assign", &[("y", y.len(), n)])?;
        if n == 0 {
            return Ok(());
        }
        let nl = n as i64;
        launch!(self, "add_assign", elems(n); x, y, &nl);
        Ok(())
    }

    /// `out[r, c] = inp[row0 + r, col0 + c]` for `out [rows, cols]`, `inp`
    /// rows of `in_width`: a column range of every row, or a range of rows.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_block(
        &self,
        out: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        in_width: usize,
        (row0, col0): (usize, usize),
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let op = "copy_block";
        if col0 + cols > in_width || (row0 + rows) * in_width > inp.len() {
            return Err(Error::Shape(format!(
                "{op}: block at ({row0}, {col0}) of {rows} x {cols} is outside {} rows of {in_width}",
                inp.len() / in_width.max(1)
            )));
        }
        shape(op, &[("out", out.len(), rows * cols)])?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let a = [in_width, row0, col0, rows, cols].map(|v| v as i64);
        launch!(self, op, elems(rows * cols); out, inp, &a[0], &a[1], &a[2], &a[3], &a[4]);
        Ok(())
    }

    /// `out[row0 + r, col0 + c] = inp[r, c]` for `inp [rows, cols]`, `out`
    /// rows of `out_width`: [`copy_block`](Self::copy_block)'s inverse.
    #[allow(clippy::too_many_arguments)]
    pub fn copy_into(
        &self,
        out: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        out_width: usize,
        (row0, col0): (usize, usize),
        (rows, cols): (usize, usize),
    ) -> Result<()> {
        let op = "copy_into";
        if col0 + cols > out_width || (row0 + rows) * out_width > out.len() {
            return Err(Error::Shape(format!(
                "{op}: block at ({row0}, {col0}) of {rows} x {cols} is outside {} rows of {out_width}",
                out.len() / out_width.max(1)
            )));
        }
        shape(op, &[("inp", inp.len(), rows * cols)])?;
        if rows == 0 || cols == 0 {
            return Ok(());
        }
        let a = [out_width, row0, col0, rows, cols].map(|v| v as i64);
        launch!(self, op, elems(rows * cols); out, inp, &a[0], &a[1], &a[2], &a[3], &a[4]);
        Ok(())
    }

    /// `out[n, d] = inp * rsqrt(sum inp^2 + eps) * scale`, `rnorm[n]` saved.
    #[allow(clippy::too_many_arguments)]
    pub fn l2norm_forward(
        &self,
        out: &mut CudaSlice<f32>,
        rnorm: &mut CudaSlice<f32>,
        inp: &CudaSlice<f32>,
        n: usize,
        d: usize,
        eps: f32,
        scale: f32,
    ) -> Result<()> {
        let op = "l2norm";
        shape(
            op,
            &[
                ("out", out.len(), n * d),
                ("rnorm", rnorm.len(), n),
                ("inp", inp.len(), n * d),
            ],
        )?;
        if n == 0 || d == 0 {
            return Ok(());
        }
        let (ni, di) = (int(op, "n", n)?, int(op, "d", d)?);
        launch!(self, "l2norm_forward", rows(n); out, rnorm, inp, &ni, &di, &eps, &scale);
        Ok(())
    }

    /// One decode step of the gated delta rule for `seqs` sequences whose
    /// fp32 states sit at `slots` in `state[slots, nv, dk, dv]`.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_delta_decode(
        &self,
        out: &mut CudaSlice<f32>,
        state: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        slots: &CudaSlice<u32>,
        dims: (usize, usize, usize, usize),
    ) -> Result<()> {
        let op = "gated_delta_decode";
        let (nk, nv, dk, dv) = dims;
        let seqs = slots.len();
        if nk == 0 || nv % nk != 0 {
            return Err(Error::Shape(format!(
                "{op}: nv {nv} is not a multiple of nk {nk}"
            )));
        }
        shape(
            op,
            &[
                ("out", out.len(), seqs * nv * dv),
                ("q", q.len(), seqs * nk * dk),
                ("k", k.len(), seqs * nk * dk),
                ("v", v.len(), seqs * nv * dv),
                ("g", g.len(), seqs * nv),
                ("beta", beta.len(), seqs * nv),
            ],
        )?;
        let per_slot = nv * dk * dv;
        if per_slot == 0 || !state.len().is_multiple_of(per_slot) {
            return Err(Error::Shape(format!(
                "{op}: state has {} elements, not a whole number of [{nv}, {dk}, {dv}] slots",
                state.len()
            )));
        }
        check_register_columns(op, dk)?;
        if seqs == 0 {
            return Ok(());
        }
        let ints = [seqs, nk, nv, dk, dv]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let cfg = recurrent_launch(seqs * nv, dk, dv);
        launch!(self, "gated_delta_decode", cfg; out, state, q, k, v, g, beta, slots, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4]);
        Ok(())
    }

    /// Causal GQA prefill over packed sequences (`cu_seqlens`, length
    /// seqs + 1, from 0 to the token count): `out, q [T, n_heads, hd]`,
    /// `k, v [T, n_kv_heads, hd]`.
    #[allow(clippy::too_many_arguments)]
    pub fn varlen_attention_prefill(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        cu_seqlens: &[u32],
        heads: (usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let op = "varlen_attention_prefill";
        let (n_heads, n_kv_heads, hd) = heads;
        check_heads(op, n_heads, n_kv_heads, hd)?;
        check_cu_seqlens(op, cu_seqlens, cu_seqlens.len().saturating_sub(1))?;
        let t = cu_seqlens.last().copied().unwrap_or(0) as usize;
        shape(
            op,
            &[
                ("out", out.len(), t * n_heads * hd),
                ("q", q.len(), t * n_heads * hd),
                ("k", k.len(), t * n_kv_heads * hd),
                ("v", v.len(), t * n_kv_heads * hd),
            ],
        )?;
        if t == 0 {
            return Ok(());
        }
        let (tiles, blocks) = prefill_tiles(cu_seqlens, n_heads, n_kv_heads);
        let (cu, tiles) = (self.index(cu_seqlens)?, self.index(&tiles)?);
        let ints = [n_heads, n_kv_heads, hd]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        launch!(self, op, attention_prefill_launch(blocks, hd); out, q, k, v, &*cu, &*tiles, &ints[0], &ints[1], &ints[2], &scale);
        Ok(())
    }

    /// Causal GQA prefill after a past, over the paged pools (the new
    /// tokens' K/V already written there): sequence s's new tokens are rows
    /// `cu_seqlens[s]..cu_seqlens[s + 1]` of `out, q [T, n_heads, hd]`,
    /// after `pasts[s]` cached keys, all found through `block_tables[s]`.
    /// Each token's output has the bits of `paged_attention_decode` over its
    /// context, and of `varlen_attention_prefill` where the past is empty.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_prefill(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k_pool: &CudaSlice<f32>,
        v_pool: &CudaSlice<f32>,
        block_tables: &[Vec<u32>],
        pasts: &[u32],
        cu_seqlens: &[u32],
        heads: (usize, usize, usize),
        block_size: usize,
        scale: f32,
    ) -> Result<()> {
        let op = "paged_attention_prefill";
        let (n_heads, n_kv_heads, hd) = heads;
        check_heads(op, n_heads, n_kv_heads, hd)?;
        let seqs = pasts.len();
        check_cu_seqlens(op, cu_seqlens, seqs)?;
        let t = cu_seqlens[seqs] as usize;
        shape(
            op,
            &[
                ("out", out.len(), t * n_heads * hd),
                ("q", q.len(), t * n_heads * hd),
                ("block_tables", block_tables.len(), seqs),
            ],
        )?;
        let contexts: Vec<u32> = (0..seqs)
            .map(|s| pasts[s].saturating_add(cu_seqlens[s + 1] - cu_seqlens[s]))
            .collect();
        let flat = flat_block_tables(
            op,
            block_tables,
            &contexts,
            k_pool.len().min(v_pool.len()),
            n_kv_heads * hd,
            block_size,
        )?;
        if t == 0 {
            return Ok(());
        }
        let (tiles, blocks) = prefill_tiles(cu_seqlens, n_heads, n_kv_heads);
        let max_blocks = flat.len() / seqs;
        let (tables, pasts, cu, tiles) = (
            self.index(&flat)?,
            self.index(pasts)?,
            self.index(cu_seqlens)?,
            self.index(&tiles)?,
        );
        let ints = [n_heads, n_kv_heads, hd, block_size, max_blocks]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        launch!(self, op, attention_prefill_launch(blocks, hd); out, q, k_pool, v_pool, &*tables, &*pasts, &*cu, &*tiles, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4], &scale);
        Ok(())
    }

    /// Writes `k, v [tokens, kv_row]` into the pools at rows `slot_mapping`.
    pub fn paged_kv_write(
        &self,
        k_pool: &mut CudaSlice<f32>,
        v_pool: &mut CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        slot_mapping: &[u32],
        kv_row: usize,
    ) -> Result<()> {
        let op = "paged_kv_write";
        let t = slot_mapping.len();
        shape(
            op,
            &[("k", k.len(), t * kv_row), ("v", v.len(), t * kv_row)],
        )?;
        let rows_in_pool = k_pool.len().min(v_pool.len()) / kv_row.max(1);
        if let Some(bad) = slot_mapping.iter().find(|&&s| s as usize >= rows_in_pool) {
            return Err(Error::Index(format!(
                "{op}: slot {bad} outside a pool of {rows_in_pool} rows"
            )));
        }
        if t == 0 || kv_row == 0 {
            return Ok(());
        }
        let slots = self.index(slot_mapping)?;
        let (ti, ri) = (int(op, "tokens", t)?, int(op, "kv_row", kv_row)?);
        launch!(self, op, elems(t * kv_row); k_pool, v_pool, k, v, &*slots, &ti, &ri);
        Ok(())
    }

    /// Decode attention: one query per sequence over its `context_lens[s]`
    /// keys in the paged pools, found through `block_tables[s]` (each row
    /// padded to the longest).
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention_decode(
        &self,
        out: &mut CudaSlice<f32>,
        q: &CudaSlice<f32>,
        k_pool: &CudaSlice<f32>,
        v_pool: &CudaSlice<f32>,
        block_tables: &[Vec<u32>],
        context_lens: &[u32],
        heads: (usize, usize, usize),
        block_size: usize,
        scale: f32,
    ) -> Result<()> {
        let op = "paged_attention_decode";
        let (n_heads, n_kv_heads, hd) = heads;
        check_heads(op, n_heads, n_kv_heads, hd)?;
        let seqs = context_lens.len();
        shape(
            op,
            &[
                ("out", out.len(), seqs * n_heads * hd),
                ("q", q.len(), seqs * n_heads * hd),
                ("block_tables", block_tables.len(), seqs),
            ],
        )?;
        let flat = flat_block_tables(
            op,
            block_tables,
            context_lens,
            k_pool.len().min(v_pool.len()),
            n_kv_heads * hd,
            block_size,
        )?;
        if seqs == 0 {
            return Ok(());
        }
        let max_blocks = flat.len() / seqs;
        let (tables, lens) = (self.index(&flat)?, self.index(context_lens)?);
        // A context longer than a split spreads over blocks, one per split,
        // whose states attention_split_merge folds.
        let splits = decode_splits(context_lens);
        let part = self.zeros::<f32>(if splits > 1 {
            seqs * n_heads * splits * (hd + 2)
        } else {
            1
        })?;
        let ints = [
            seqs, n_heads, n_kv_heads, hd, block_size, max_blocks, splits,
        ]
        .iter()
        .map(|&x| int(op, "size", x))
        .collect::<Result<Vec<i32>>>()?;
        launch!(self, op, decode_launch(seqs, n_heads, n_kv_heads, hd, splits); &mut *out, &part, q, k_pool, v_pool, &*tables, &*lens, &ints[0], &ints[1], &ints[2], &ints[3], &ints[4], &ints[5], &ints[6], &scale);
        if splits > 1 {
            let cfg = split_merge_launch(seqs * n_heads);
            launch!(self, "attention_split_merge", cfg; out, &part, &*lens, &ints[0], &ints[1], &ints[3], &ints[6]);
        }
        Ok(())
    }

    /// `out[r] = log softmax(logits[r] * inv_temp)[targets[r]]`.
    pub fn logprob_gather_forward(
        &self,
        out: &mut CudaSlice<f32>,
        logits: &CudaSlice<f32>,
        targets: &CudaSlice<u32>,
        vocab: usize,
        inv_temp: f32,
    ) -> Result<()> {
        let op = "logprob_gather";
        let n = targets.len();
        shape(
            op,
            &[("out", out.len(), n), ("logits", logits.len(), n * vocab)],
        )?;
        if n == 0 {
            return Ok(());
        }
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, "logprob_gather_forward", rows(n); out, logits, targets, &ni, &vi, &inv_temp);
        Ok(())
    }

    /// `out[r] = argmax logits[r]` (lowest index on ties).
    pub fn argmax_forward(
        &self,
        out: &mut CudaSlice<u32>,
        logits: &CudaSlice<f32>,
        vocab: usize,
    ) -> Result<()> {
        let op = "argmax";
        let n = out.len();
        shape(op, &[("logits", logits.len(), n * vocab)])?;
        if n == 0 {
            return Ok(());
        }
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, "argmax_forward", rows(n); out, logits, &ni, &vi);
        Ok(())
    }

    /// One token per row of `logits [rows, vocab]`, drawn on the device as
    /// the engine's sampler draws from an untruncated distribution, and its
    /// log-prob: `draws[r]` is `Some((1 / T, u))` with `u` in `[0, 1)` the
    /// sampler's uniform (inverse CDF of `softmax(logits * (1 / T))` in
    /// vocabulary order), or `None` for a greedy pick (the first largest
    /// logit, its log-prob at `T = 1`). Only the picks come back to the
    /// host, not the rows.
    pub fn sample_rows(
        &self,
        logits: &CudaSlice<f32>,
        draws: &[Option<(f32, f64)>],
        vocab: usize,
    ) -> Result<Vec<(u32, f32)>> {
        let op = "sample_rows";
        let n = draws.len();
        shape(op, &[("logits", logits.len(), n * vocab)])?;
        if n == 0 {
            return Ok(Vec::new());
        }
        if vocab == 0 {
            return Err(Error::Shape(format!("{op}: an empty vocabulary")));
        }
        let mut inv_t = Vec::with_capacity(n);
        let mut u = Vec::with_capacity(n);
        for (r, d) in draws.iter().enumerate() {
            let (it, ur) = d.unwrap_or((1.0, -1.0));
            if !(it.is_finite() && it > 0.0) || (d.is_some() && !(0.0..1.0).contains(&ur)) {
                return Err(Error::Shape(format!(
                    "{op}: row {r} draws with 1/T = {it}, u = {ur} (need 1/T > 0, 0 <= u < 1)"
                )));
            }
            inv_t.push(it);
            u.push(ur);
        }
        let (dinv, du) = (self.upload(&inv_t)?, self.upload(&u)?);
        let mut tok = self.zeros::<u32>(n)?;
        let mut lp = self.zeros::<f32>(n)?;
        let (ni, vi) = (int(op, "rows", n)?, int(op, "vocab", vocab)?);
        launch!(self, op, rows(n); &mut tok, &mut lp, logits, &dinv, &du, &ni, &vi);
        Ok(self
            .download(&tok)?
            .into_iter()
            .zip(self.download(&lp)?)
            .collect())
    }
}

/// Tokens per chunk of the chunked gated-delta form (`GD_CHUNK` in
/// gated_delta.cu), and that pair of kernels' threads per block
/// (`GD_COLS * GD_ROWS`).
pub(super) const GD_CHUNK: usize = 64;
/// The null device pointer, for an optional output left out.
pub(super) const NULL: u64 = 0;
pub(super) const GD_COLS: usize = 32;
pub(super) const GD_CHUNK_THREADS: u32 = 256;

/// The checks both prefill forms make; the kernels' integer sizes
/// `[seqs, nk, nv, dk, dv]`, or None when there is nothing to do.
#[allow(clippy::too_many_arguments)]
pub(super) fn check_prefill(
    op: &str,
    out: &CudaSlice<f32>,
    state: &CudaSlice<f32>,
    q: &CudaSlice<f32>,
    k: &CudaSlice<f32>,
    v: &CudaSlice<f32>,
    g: &CudaSlice<f32>,
    beta: &CudaSlice<f32>,
    slots: &CudaSlice<u32>,
    cu_seqlens: &[u32],
    dims: (usize, usize, usize, usize),
) -> Result<Option<Vec<i32>>> {
    let (nk, nv, dk, dv) = dims;
    let seqs = slots.len();
    if nk == 0 || !nv.is_multiple_of(nk) {
        return Err(Error::Shape(format!(
            "{op}: nv {nv} is not a multiple of nk {nk}"
        )));
    }
    check_cu_seqlens(op, cu_seqlens, seqs)?;
    let t = cu_seqlens[seqs] as usize;
    shape(
        op,
        &[
            ("out", out.len(), t * nv * dv),
            ("q", q.len(), t * nk * dk),
            ("k", k.len(), t * nk * dk),
            ("v", v.len(), t * nv * dv),
            ("g", g.len(), t * nv),
            ("beta", beta.len(), t * nv),
        ],
    )?;
    let per_slot = nv * dk * dv;
    if per_slot == 0 || !state.len().is_multiple_of(per_slot) {
        return Err(Error::Shape(format!(
            "{op}: state has {} elements, not a whole number of [{nv}, {dk}, {dv}] slots",
            state.len()
        )));
    }
    if seqs == 0 || t == 0 {
        return Ok(None);
    }
    [seqs, nk, nv, dk, dv]
        .iter()
        .map(|&x| int(op, "size", x))
        .collect::<Result<Vec<i32>>>()
        .map(Some)
}

/// The chunks of packed sequences: chunk `n` is tokens `tok0[n] ..
/// tok0[n] + len[n]` (at most `chunk`, cut from each sequence's first
/// token), and sequence `s` owns chunks `first[s] .. first[s + 1]`.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct ChunkPlan {
    tok0: Vec<u32>,
    len: Vec<u32>,
    first: Vec<u32>,
}

/// What the chunked forward leaves for its backward: the masked attention
/// `a`, the pseudo-values `u` and decayed keys `w`, the f64 cumulative
/// decays `cum`, and the plan on the device.
pub(super) struct ChunkPieces {
    a: CudaSlice<f32>,
    u: CudaSlice<f32>,
    w: CudaSlice<f32>,
    cum: CudaSlice<f64>,
    tok0: Arc<CudaSlice<u32>>,
    len: Arc<CudaSlice<u32>>,
    first: Arc<CudaSlice<u32>>,
}

impl ChunkPlan {
    /// Tokens the plan covers.
    fn tokens(&self) -> usize {
        self.tok0
            .last()
            .zip(self.len.last())
            .map_or(0, |(a, b)| (a + b) as usize)
    }

    fn new(cu_seqlens: &[u32], chunk: usize) -> Self {
        let mut plan = ChunkPlan {
            tok0: Vec::new(),
            len: Vec::new(),
            first: vec![0],
        };
        for w in cu_seqlens.windows(2) {
            for t0 in (w[0]..w[1]).step_by(chunk) {
                plan.tok0.push(t0);
                plan.len.push((w[1] - t0).min(chunk as u32));
            }
            plan.first.push(plan.tok0.len() as u32);
        }
        plan
    }
}

/// `cu_seqlens` of `seqs` packed sequences must rise from 0.
pub(super) fn check_cu_seqlens(op: &str, cu_seqlens: &[u32], seqs: usize) -> Result<()> {
    if cu_seqlens.len() != seqs + 1
        || cu_seqlens.first() != Some(&0)
        || cu_seqlens.windows(2).any(|w| w[0] > w[1])
    {
        return Err(Error::Shape(format!(
            "{op}: cu_seqlens {cu_seqlens:?} must rise from 0 over {seqs} sequences"
        )));
    }
    Ok(())
}

/// Checks that every sequence's table covers its `contexts[s]` keys with
/// blocks inside the pools, and flattens the tables (each row padded to
/// the longest, at least one). `pool_len`: the floats of the smaller pool.
fn flat_block_tables(
    op: &str,
    block_tables: &[Vec<u32>],
    contexts: &[u32],
    pool_len: usize,
    row: usize,
    block_size: usize,
) -> Result<Vec<u32>> {
    let pool_blocks = pool_len / (block_size * row).max(1);
    for (s, (table, &n)) in block_tables.iter().zip(contexts).enumerate() {
        let need = (n as usize).div_ceil(block_size.max(1));
        if block_size == 0 || table.len() < need {
            return Err(Error::Shape(format!(
                "{op}: sequence {s} has {n} keys but {} blocks of {block_size}",
                table.len()
            )));
        }
        if let Some(b) = table[..need].iter().find(|&&b| b as usize >= pool_blocks) {
            return Err(Error::Index(format!(
                "{op}: block {b} outside a pool of {pool_blocks} blocks"
            )));
        }
    }
    let max_blocks = block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
    let mut flat = vec![0u32; block_tables.len() * max_blocks];
    for (s, t) in block_tables.iter().enumerate() {
        flat[s * max_blocks..s * max_blocks + t.len()].copy_from_slice(t);
    }
    Ok(flat)
}

/// Decode and the recurrent prefill hold a thread's column of the state in
/// registers (gated_delta.cu): at most `GD_MAX_DK` rows (Qwen3.5's heads
/// are 128 by 128), `GD_REC_COLS` columns per block.
const GD_MAX_DK: usize = 128;
const GD_REC_COLS: usize = 32;

/// Refuses key heads wider than the CUDA recurrence holds in registers:
/// `CudaModel::upload` asks before a weight goes to the device, the
/// kernels again on every call.
pub fn check_register_columns(op: &str, dk: usize) -> Result<()> {
    if dk > GD_MAX_DK {
        return Err(Error::Shape(format!(
            "{op}: key heads of {dk}; the CUDA recurrence holds at most {GD_MAX_DK}"
        )));
    }
    Ok(())
}

/// The chunked gated-delta kernels' blocks (prep, the state's gradient
/// scan, the chunks' gradients): `blocks` of `GD_CHUNK_THREADS`.
pub(super) fn chunk_launch(blocks: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (GD_CHUNK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The chunked forward's state scan: as [`chunk_launch`], with a row of q
/// and of k (`dk` each) staged in shared memory.
fn chunk_scan_launch(blocks: usize, dk: usize) -> LaunchConfig {
    LaunchConfig {
        shared_mem_bytes: (2 * dk * 4) as u32,
        ..chunk_launch(blocks)
    }
}

/// Decode and the recurrent prefill: a block per column tile of each of
/// `heads` (sequence, value head) pairs, q and k staged in shared memory.
fn recurrent_launch(heads: usize, dk: usize, dv: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: ((heads * dv.div_ceil(GD_REC_COLS)) as u32, 1, 1),
        block_dim: (GD_REC_COLS as u32, 1, 1),
        shared_mem_bytes: (2 * dk * 4) as u32,
    }
}

/// The sequence of every packed row: `cu_seqlens` expanded.
fn token_seq(cu_seqlens: &[u32]) -> Vec<u32> {
    cu_seqlens
        .windows(2)
        .enumerate()
        .flat_map(|(s, w)| std::iter::repeat_n(s as u32, w[1].saturating_sub(w[0]) as usize))
        .collect()
}

mod backward;
mod gemm;
pub use gemm::{cublas_available, Mat, MatMut};

/// For tests that need a GPU, here and in other crates: device 0, or
/// None where this machine has none (the test then says it was skipped).
/// With `ARCTICD_REQUIRE_GPU` set (as `scripts/gpu-check.sh` sets it) a
/// missing device is a failure instead.
pub fn test_device() -> Option<CudaDevice> {
    let required = std::env::var_os("ARCTICD_REQUIRE_GPU").is_some();
    if !driver_available() || !super::nvrtc_available() {
        assert!(
            !required,
            "ARCTICD_REQUIRE_GPU is set but CUDA or NVRTC is missing"
        );
        eprintln!("skipped: no CUDA driver or NVRTC on this machine");
        return None;
    }
    match CudaDevice::new(0) {
        Ok(d) => Some(d),
        Err(e) => {
            assert!(!required, "ARCTICD_REQUIRE_GPU is set: {e}");
            eprintln!("skipped: {e}");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu;
    use rand::{Rng, SeedableRng};

    /// The device, or None (skipped) where this machine has no GPU.
    pub(super) fn gpu() -> Option<CudaDevice> {
        test_device()
    }

    pub(super) fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    pub(super) fn close(name: &str, got: &[f32], want: &[f32], tol: f32) {
        assert_eq!(got.len(), want.len(), "{name}");
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= tol * (1.0 + b.abs()),
                "{name}[{i}]: cuda {a} cpu {b}"
            );
        }
    }

    #[test]
    fn rmsnorm_and_gated_rmsnorm_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        for (n, c) in [(1, 7), (5, 129), (3, 1000)] {
            let x = rand_vec(&mut rng, n * c, 2.0);
            let z = rand_vec(&mut rng, n * c, 2.0);
            let w = rand_vec(&mut rng, c, 0.5);
            let (mut y, mut r) = (vec![0.0; n * c], vec![0.0; n]);
            cpu::rmsnorm::rmsnorm_forward(&mut y, &mut r, &x, &w, n, c, 1e-6).unwrap();
            let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
            let (mut dy, mut dr) = (d.zeros(n * c).unwrap(), d.zeros(n).unwrap());
            d.rmsnorm_forward(&mut dy, &mut dr, &dx, &dw, n, c, 1e-6)
                .unwrap();
            close("rmsnorm", &d.download(&dy).unwrap(), &y, 1e-5);
            close("rstd", &d.download(&dr).unwrap(), &r, 1e-5);
            cpu::rmsnorm::gated_rmsnorm_forward(&mut y, &mut r, &x, &z, &w, n, c, 1e-6).unwrap();
            let dz = d.upload(&z).unwrap();
            d.gated_rmsnorm_forward(&mut dy, &mut dr, &dx, &dz, &dw, n, c, 1e-6)
                .unwrap();
            close("gated_rmsnorm", &d.download(&dy).unwrap(), &y, 1e-5);
        }
    }

    #[test]
    fn add_assign_and_copy_block_are_exact() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (rows, width) = (7, 13);
        let x = rand_vec(&mut rng, rows * width, 2.0);
        let y = rand_vec(&mut rng, rows * width, 2.0);
        let mut dx = d.upload(&x).unwrap();
        d.add_assign(&mut dx, &d.upload(&y).unwrap()).unwrap();
        let sum: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        close("add_assign", &d.download(&dx).unwrap(), &sum, 0.0);
        // Columns 4..9 of rows 2..7.
        let mut out = d.zeros(5 * 5).unwrap();
        d.copy_block(&mut out, &d.upload(&x).unwrap(), width, (2, 4), (5, 5))
            .unwrap();
        let want: Vec<f32> = (2..7)
            .flat_map(|r| x[r * width + 4..r * width + 9].to_vec())
            .collect();
        close("copy_block", &d.download(&out).unwrap(), &want, 0.0);
        let outside = d.copy_block(&mut out, &d.upload(&x).unwrap(), width, (3, 4), (5, 5));
        assert!(outside.is_err());
        // And back: the block written into a zeroed matrix at the same place.
        let mut back = d.zeros(rows * width).unwrap();
        d.copy_into(&mut back, &out, width, (2, 4), (5, 5)).unwrap();
        let mut want_back = vec![0.0f32; rows * width];
        for r in 2..7 {
            want_back[r * width + 4..r * width + 9]
                .copy_from_slice(&x[r * width + 4..r * width + 9]);
        }
        close("copy_into", &d.download(&back).unwrap(), &want_back, 0.0);
        assert!(d.copy_into(&mut back, &out, width, (3, 4), (5, 5)).is_err());
    }

    #[test]
    fn add_rmsnorm_and_qk_norm_rope_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let (n, c) = (3, 301);
        let (res, x) = (
            rand_vec(&mut rng, n * c, 1.0),
            rand_vec(&mut rng, n * c, 1.0),
        );
        let w = rand_vec(&mut rng, c, 0.5);
        let sum: Vec<f32> = res.iter().zip(&x).map(|(a, b)| a + b).collect();
        let (mut y, mut r) = (vec![0.0; n * c], vec![0.0; n]);
        cpu::rmsnorm::rmsnorm_forward(&mut y, &mut r, &sum, &w, n, c, 1e-6).unwrap();
        let mut dres = d.upload(&res).unwrap();
        let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
        let (mut dy, mut dr) = (d.zeros(n * c).unwrap(), d.zeros(n).unwrap());
        d.add_rmsnorm_forward(&mut dy, &mut dr, &mut dres, &dx, &dw, n, c, 1e-6)
            .unwrap();
        close(
            "add_rmsnorm residual",
            &d.download(&dres).unwrap(),
            &sum,
            0.0,
        );
        close("add_rmsnorm", &d.download(&dy).unwrap(), &y, 1e-5);

        // q/k norm + partial RoPE at large positions (the angles must agree).
        let (heads, hd, rot, theta) = (3, 80, 20, 1e7f32);
        let positions = [0u32, 7, 40_000];
        let q = rand_vec(&mut rng, 3 * heads * hd, 2.0);
        let qw = rand_vec(&mut rng, hd, 0.5);
        let (mut want, mut rs) = (vec![0.0; q.len()], vec![0.0; 3 * heads]);
        cpu::rmsnorm::rmsnorm_forward(&mut want, &mut rs, &q, &qw, 3 * heads, hd, 1e-6).unwrap();
        cpu::rope::rope_forward(&mut want, &positions, heads, hd, rot, theta).unwrap();
        let mut dq = d.upload(&q).unwrap();
        let mut drs = d.zeros(3 * heads).unwrap();
        let (dqw, dpos) = (d.upload(&qw).unwrap(), d.upload(&positions).unwrap());
        d.qk_norm_rope_forward(&mut dq, &mut drs, &dqw, &dpos, heads, hd, rot, theta, 1e-6)
            .unwrap();
        close("qk_norm_rope", &d.download(&dq).unwrap(), &want, 1e-4);
    }

    #[test]
    fn embedding_bf16_and_gating_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let (vocab, c) = (50, 33);
        let table = rand_vec(&mut rng, vocab * c, 1.0);
        let ids = [3u32, 49, 0, 3];
        let mut want = vec![0.0; ids.len() * c];
        cpu::embedding::embedding_forward(&mut want, &ids, &table, vocab, c).unwrap();
        let dt = d.upload(&table).unwrap();
        let mut out = d.zeros(ids.len() * c).unwrap();
        d.embedding_forward(&mut out, &ids, &dt, vocab, c).unwrap();
        close("embedding", &d.download(&out).unwrap(), &want, 0.0);
        assert!(d.embedding_forward(&mut out, &[50], &dt, vocab, c).is_err());
        // bf16: the device's rounding equals half's, bit for bit.
        let mut bits = d.zeros::<u16>(table.len()).unwrap();
        d.f32_to_bf16(&mut bits, &dt).unwrap();
        let host: Vec<u16> = table
            .iter()
            .map(|&x| half::bf16::from_f32(x).to_bits())
            .collect();
        assert_eq!(d.download(&bits).unwrap(), host);
        let widened: Vec<f32> = ids
            .iter()
            .flat_map(|&i| host[i as usize * c..(i as usize + 1) * c].iter())
            .map(|&b| half::bf16::from_bits(b).to_f32())
            .collect();
        d.embedding_forward_bf16(&mut out, &ids, &bits, vocab, c)
            .unwrap();
        close("embedding bf16", &d.download(&out).unwrap(), &widened, 0.0);

        let (t, nv) = (5, 6);
        let (a, b) = (
            rand_vec(&mut rng, t * nv, 30.0),
            rand_vec(&mut rng, t * nv, 5.0),
        );
        let (a_log, dt_bias) = (rand_vec(&mut rng, nv, 1.0), rand_vec(&mut rng, nv, 1.0));
        let want_g: Vec<f32> = (0..t * nv)
            .map(|i| -a_log[i % nv].exp() * cpu::activation::softplus(a[i] + dt_bias[i % nv]))
            .collect();
        let want_b: Vec<f32> = b.iter().map(|&x| cpu::activation::sigmoid(x)).collect();
        let (mut dg, mut db) = (d.zeros(t * nv).unwrap(), d.zeros(t * nv).unwrap());
        let up = |x: &[f32]| d.upload(x).unwrap();
        d.gated_delta_gating_forward(
            &mut dg,
            &mut db,
            &up(&a),
            &up(&b),
            &up(&a_log),
            &up(&dt_bias),
            nv,
        )
        .unwrap();
        close("g", &d.download(&dg).unwrap(), &want_g, 1e-5);
        close("beta", &d.download(&db).unwrap(), &want_b, 1e-6);
    }

    /// Packed sequences of 5, 1 and 2 rows (the middle one a decode
    /// step) in state slots 2, 0 and 1, twice over: outputs within 1e-5 of
    /// the CPU's conv per sequence, states exactly the CPU's.
    #[test]
    fn conv1d_varlen_matches_cpu_per_sequence() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(12);
        let (c, k) = (29, 4);
        let w = rand_vec(&mut rng, c * k, 1.0);
        let mut states: Vec<Vec<f32>> = (0..3)
            .map(|_| rand_vec(&mut rng, (k - 1) * c, 1.0))
            .collect();
        let (slots, cu) = ([2u32, 0, 1], [0u32, 5, 6, 8]);
        let mut dstate = d.upload(&states.concat()).unwrap();
        let dw = d.upload(&w).unwrap();
        for _ in 0..2 {
            let x = rand_vec(&mut rng, 8 * c, 1.0);
            let mut want = vec![0.0; 8 * c];
            for (s, &slot) in slots.iter().enumerate() {
                let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
                cpu::conv1d::conv1d_forward(
                    &mut want[a * c..b * c],
                    &mut states[slot as usize],
                    &x[a * c..b * c],
                    &w,
                    b - a,
                    c,
                    k,
                )
                .unwrap();
            }
            let mut out = d.zeros(8 * c).unwrap();
            d.conv1d_varlen_forward(
                &mut out,
                &mut dstate,
                &d.upload(&x).unwrap(),
                &dw,
                &slots,
                &cu,
                k,
            )
            .unwrap();
            close("conv1d varlen", &d.download(&out).unwrap(), &want, 1e-5);
            close(
                "conv1d varlen state",
                &d.download(&dstate).unwrap(),
                &states.concat(),
                0.0,
            );
        }
        let mut out = d.zeros(8 * c).unwrap();
        let x = d.upload(&vec![0.0f32; 8 * c]).unwrap();
        let bad_slot = d.conv1d_varlen_forward(&mut out, &mut dstate, &x, &dw, &[0, 3, 1], &cu, k);
        assert!(bad_slot.is_err());
        let bad_cu =
            d.conv1d_varlen_forward(&mut out, &mut dstate, &x, &dw, &slots, &[0, 5, 4, 8], k);
        assert!(bad_cu.is_err());
    }

    /// Past the element launch's cap (65,535 blocks of 256 threads): a
    /// prefill of 2,800 tokens of the 0.8B model's 6,144 conv channels
    /// (17.2M outputs), every row against the CPU, the last ones too.
    #[test]
    fn conv1d_varlen_covers_more_elements_than_one_grid() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let (t, c, k) = (2800, 6144, 4);
        assert!(t * c > 65_535 * ELEM_THREADS as usize);
        let w = rand_vec(&mut rng, c * k, 1.0);
        let x = rand_vec(&mut rng, t * c, 1.0);
        let mut state = rand_vec(&mut rng, (k - 1) * c, 1.0);
        let mut dstate = d.upload(&state).unwrap();
        let mut want = vec![0.0; t * c];
        cpu::conv1d::conv1d_forward(&mut want, &mut state, &x, &w, t, c, k).unwrap();
        let mut out = d.zeros(t * c).unwrap();
        let (dx, dw) = (d.upload(&x).unwrap(), d.upload(&w).unwrap());
        d.conv1d_varlen_forward(&mut out, &mut dstate, &dx, &dw, &[0], &[0, t as u32], k)
            .unwrap();
        close(
            "conv1d varlen, 17.2M",
            &d.download(&out).unwrap(),
            &want,
            1e-5,
        );
        close("its state", &d.download(&dstate).unwrap(), &state, 0.0);
    }

    #[test]
    fn copy_within_zero_range_and_gather_rows_are_exact() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(13);
        let host = rand_vec(&mut rng, 40, 1.0);
        let mut buf = d.upload(&host).unwrap();
        d.copy_within(&mut buf, 3, 20, 10).unwrap();
        d.zero_range(&mut buf, 35, 5).unwrap();
        let mut want = host.clone();
        want.copy_within(3..13, 20);
        want[35..].fill(0.0);
        close(
            "copy_within, zero_range",
            &d.download(&buf).unwrap(),
            &want,
            0.0,
        );
        assert!(d.copy_within(&mut buf, 0, 5, 10).is_err(), "overlap");
        assert!(d.copy_within(&mut buf, 0, 35, 10).is_err(), "past the end");
        assert!(d.zero_range(&mut buf, 38, 3).is_err());
        // Rows 7, 0 and 7 again of a 10 x 4 matrix.
        let mut rows = d.zeros(12).unwrap();
        d.gather_rows(&mut rows, &d.upload(&host).unwrap(), &[7, 0, 7], 4)
            .unwrap();
        let want = [&host[28..32], &host[0..4], &host[28..32]].concat();
        close("gather_rows", &d.download(&rows).unwrap(), &want, 0.0);
        assert!(d.gather_rows(&mut rows, &buf, &[7, 10, 0], 4).is_err());
        // And back, to rows 2 and 5 of a zeroed 6 x 4 matrix.
        let mut spread = d.zeros(24).unwrap();
        let two = d.upload(&host[..8]).unwrap();
        d.scatter_rows(&mut spread, &two, &[5, 2], 4).unwrap();
        let mut want = vec![0.0f32; 24];
        want[20..24].copy_from_slice(&host[0..4]);
        want[8..12].copy_from_slice(&host[4..8]);
        close("scatter_rows", &d.download(&spread).unwrap(), &want, 0.0);
        assert!(d.scatter_rows(&mut spread, &two, &[2, 2], 4).is_err());
    }

    #[test]
    fn conv1d_update_and_gated_delta_prefill_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(8);
        // conv: two sequences in slots 1 and 0, three decode tokens each.
        let (c, k) = (37, 4);
        let w = rand_vec(&mut rng, c * k, 1.0);
        let mut states: Vec<Vec<f32>> = (0..2)
            .map(|_| rand_vec(&mut rng, (k - 1) * c, 1.0))
            .collect();
        let slots = [1u32, 0];
        let mut dstate = d.upload(&states.concat()).unwrap();
        let (dw, dslots) = (d.upload(&w).unwrap(), d.upload(&slots).unwrap());
        for _ in 0..3 {
            let x = rand_vec(&mut rng, 2 * c, 1.0);
            let mut want = vec![0.0; 2 * c];
            for (s, &slot) in slots.iter().enumerate() {
                cpu::conv1d::conv1d_forward(
                    &mut want[s * c..(s + 1) * c],
                    &mut states[slot as usize],
                    &x[s * c..(s + 1) * c],
                    &w,
                    1,
                    c,
                    k,
                )
                .unwrap();
            }
            let mut out = d.zeros(2 * c).unwrap();
            d.conv1d_update(
                &mut out,
                &mut dstate,
                &d.upload(&x).unwrap(),
                &dw,
                &dslots,
                k,
            )
            .unwrap();
            close("conv1d", &d.download(&out).unwrap(), &want, 1e-5);
        }
        close(
            "conv1d state",
            &d.download(&dstate).unwrap(),
            &states.concat(),
            0.0,
        );

        // gated delta prefill: sequences of 19 and 3 tokens.
        let (nk, nv, dk, dv) = (1, 2, 16, 24);
        let cu = [0u32, 19, 22];
        let t = 22;
        let q = rand_vec(&mut rng, t * nk * dk, 0.3);
        let kk = rand_vec(&mut rng, t * nk * dk, 0.3);
        let v = rand_vec(&mut rng, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| -rng.gen_range(0.0..1.0f32)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| rng.gen_range(0.0..1.0f32)).collect();
        let per = nv * dk * dv;
        let mut st: Vec<Vec<f32>> = (0..2).map(|_| rand_vec(&mut rng, per, 0.3)).collect();
        let mut dst = d.upload(&st.concat()).unwrap();
        let mut want = vec![0.0; t * nv * dv];
        for s in 0..2 {
            let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
            let dims = cpu::gated_delta::GatedDeltaDims {
                t: b - a,
                nk,
                nv,
                dk,
                dv,
            };
            cpu::gated_delta::gated_delta_recurrent_forward(
                &mut want[a * nv * dv..b * nv * dv],
                &mut st[s],
                &q[a * nk * dk..b * nk * dk],
                &kk[a * nk * dk..b * nk * dk],
                &v[a * nv * dv..b * nv * dv],
                &g[a * nv..b * nv],
                &beta[a * nv..b * nv],
                dims,
            )
            .unwrap();
        }
        let up = |x: &[f32]| d.upload(x).unwrap();
        let mut out = d.zeros(t * nv * dv).unwrap();
        d.gated_delta_prefill(
            &mut out,
            &mut dst,
            &up(&q),
            &up(&kk),
            &up(&v),
            &up(&g),
            &up(&beta),
            &d.upload(&[0u32, 1]).unwrap(),
            &cu,
            (nk, nv, dk, dv),
            false,
        )
        .unwrap();
        close(
            "gated_delta prefill",
            &d.download(&out).unwrap(),
            &want,
            1e-5,
        );
        close(
            "gated_delta prefill state",
            &d.download(&dst).unwrap(),
            &st.concat(),
            1e-5,
        );
    }

    #[test]
    fn l2norm_matches_cpu_and_scales() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        let (n, dd) = (7, 130);
        let x = rand_vec(&mut rng, n * dd, 1.0);
        let (mut y, mut r) = (vec![0.0; n * dd], vec![0.0; n]);
        cpu::l2norm::l2norm_forward(&mut y, &mut r, &x, n, dd, 1e-6).unwrap();
        let scale = 0.25f32;
        let want: Vec<f32> = y.iter().map(|v| v * scale).collect();
        let dx = d.upload(&x).unwrap();
        let (mut dy, mut dr) = (d.zeros(n * dd).unwrap(), d.zeros(n).unwrap());
        d.l2norm_forward(&mut dy, &mut dr, &dx, n, dd, 1e-6, scale)
            .unwrap();
        close("l2norm", &d.download(&dy).unwrap(), &want, 1e-5);
        close("rnorm", &d.download(&dr).unwrap(), &r, 1e-5);
    }

    #[test]
    fn activations_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let n = 70_001;
        let (g, u) = (rand_vec(&mut rng, n, 8.0), rand_vec(&mut rng, n, 3.0));
        let mut y = vec![0.0; n];
        cpu::activation::silu_mul_forward(&mut y, &g, &u, 1, n).unwrap();
        let (dg, du) = (d.upload(&g).unwrap(), d.upload(&u).unwrap());
        let mut dy = d.zeros(n).unwrap();
        d.silu_mul_forward(&mut dy, &dg, &du).unwrap();
        close("silu_mul", &d.download(&dy).unwrap(), &y, 1e-6);
        let mut x = u.clone();
        cpu::activation::sigmoid_gate_forward(&mut x, &g).unwrap();
        let mut dx = d.upload(&u).unwrap();
        d.sigmoid_gate_forward(&mut dx, &dg).unwrap();
        close("sigmoid_gate", &d.download(&dx).unwrap(), &x, 1e-6);
        let mut x = g.clone();
        cpu::activation::silu_forward(&mut x);
        let mut dx = d.upload(&g).unwrap();
        d.silu_forward(&mut dx).unwrap();
        close("silu", &d.download(&dx).unwrap(), &x, 1e-6);
    }

    #[test]
    fn gated_delta_decode_matches_the_recurrent_reference() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (nk, nv, dk, dv) = (2, 4, 24, 40);
        let dims = cpu::gated_delta::GatedDeltaDims {
            t: 1,
            nk,
            nv,
            dk,
            dv,
        };
        // Two sequences in slots 2 and 0 of a three-slot state, three steps.
        let slots = [2u32, 0];
        let per = nv * dk * dv;
        let mut states: Vec<Vec<f32>> = (0..3).map(|_| rand_vec(&mut rng, per, 0.3)).collect();
        let mut dstate = d.upload(&states.concat()).unwrap();
        let dslots = d.upload(&slots).unwrap();
        for _ in 0..3 {
            let q = rand_vec(&mut rng, 2 * nk * dk, 0.3);
            let k = rand_vec(&mut rng, 2 * nk * dk, 0.3);
            let v = rand_vec(&mut rng, 2 * nv * dv, 1.0);
            let g: Vec<f32> = (0..2 * nv).map(|_| -rng.gen_range(0.0..2.0f32)).collect();
            let beta: Vec<f32> = (0..2 * nv).map(|_| rng.gen_range(0.0..1.0f32)).collect();
            let mut want = vec![0.0; 2 * nv * dv];
            for (s, &slot) in slots.iter().enumerate() {
                cpu::gated_delta::gated_delta_recurrent_forward(
                    &mut want[s * nv * dv..(s + 1) * nv * dv],
                    &mut states[slot as usize],
                    &q[s * nk * dk..(s + 1) * nk * dk],
                    &k[s * nk * dk..(s + 1) * nk * dk],
                    &v[s * nv * dv..(s + 1) * nv * dv],
                    &g[s * nv..(s + 1) * nv],
                    &beta[s * nv..(s + 1) * nv],
                    dims,
                )
                .unwrap();
            }
            let mut dout = d.zeros(2 * nv * dv).unwrap();
            let up = |x: &[f32]| d.upload(x).unwrap();
            d.gated_delta_decode(
                &mut dout,
                &mut dstate,
                &up(&q),
                &up(&k),
                &up(&v),
                &up(&g),
                &up(&beta),
                &dslots,
                (nk, nv, dk, dv),
            )
            .unwrap();
            close("gated_delta out", &d.download(&dout).unwrap(), &want, 1e-5);
        }
        close(
            "gated_delta state",
            &d.download(&dstate).unwrap(),
            &states.concat(),
            1e-5,
        );
    }

    /// Decode token by token and the recurrent prefill in one call give
    /// the same outputs and state bit for bit (the engine's decode ==
    /// prefill), at Qwen3.5's 128 x 128 heads (the registers' limit; four
    /// column tiles), and a wider key head is refused.
    #[test]
    fn gated_delta_decode_steps_equal_the_prefill() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(31);
        let (nk, nv, dk, dv, t) = (2, 4, 128, 128, 5);
        let q = rand_vec(&mut rng, t * nk * dk, 0.1);
        let k = rand_vec(&mut rng, t * nk * dk, 0.1);
        let v = rand_vec(&mut rng, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| -rng.gen_range(0.0..2.0f32)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| rng.gen_range(0.0..1.0f32)).collect();
        let state0 = rand_vec(&mut rng, nv * dk * dv, 0.3);
        let up = |x: &[f32]| d.upload(x).unwrap();
        let slots = d.upload(&[0u32]).unwrap();
        let mut sp = up(&state0);
        let mut op = d.zeros(t * nv * dv).unwrap();
        d.gated_delta_prefill(
            &mut op,
            &mut sp,
            &up(&q),
            &up(&k),
            &up(&v),
            &up(&g),
            &up(&beta),
            &slots,
            &[0, t as u32],
            (nk, nv, dk, dv),
            false,
        )
        .unwrap();
        let mut sd = up(&state0);
        let mut decoded = Vec::new();
        for i in 0..t {
            let mut o = d.zeros(nv * dv).unwrap();
            d.gated_delta_decode(
                &mut o,
                &mut sd,
                &up(&q[i * nk * dk..(i + 1) * nk * dk]),
                &up(&k[i * nk * dk..(i + 1) * nk * dk]),
                &up(&v[i * nv * dv..(i + 1) * nv * dv]),
                &up(&g[i * nv..(i + 1) * nv]),
                &up(&beta[i * nv..(i + 1) * nv]),
                &slots,
                (nk, nv, dk, dv),
            )
            .unwrap();
            decoded.extend(d.download(&o).unwrap());
        }
        assert_eq!(decoded, d.download(&op).unwrap(), "outputs");
        assert_eq!(d.download(&sd).unwrap(), d.download(&sp).unwrap(), "state");
        let mut o = d.zeros(nv * 129).unwrap();
        let err = d
            .gated_delta_decode(
                &mut o,
                &mut up(&vec![0.0; nv * 129 * 129]),
                &up(&q[..nk * 129]),
                &up(&k[..nk * 129]),
                &up(&vec![0.0; nv * 129]),
                &up(&g[..nv]),
                &up(&beta[..nv]),
                &slots,
                (nk, nv, 129, 129),
            )
            .unwrap_err();
        assert!(err.to_string().contains("at most 128"), "{err}");
    }

    #[test]
    fn chunk_plan_cuts_each_sequence_from_its_first_token() {
        let plan = ChunkPlan::new(&[0, 150, 151, 151, 216], 64);
        assert_eq!(plan.tok0, [0, 64, 128, 150, 151, 215]);
        assert_eq!(plan.len, [64, 64, 22, 1, 64, 1]);
        assert_eq!(plan.first, [0, 3, 4, 4, 6]);
        assert_eq!(ChunkPlan::new(&[0], 64).first, [0]);
    }

    /// The chunked prefill against the CPU's recurrent form per sequence
    /// (1e-4 relative: the two forms sum in different orders), with GQA,
    /// widths that are not multiples of the kernels' tiles (dk 48 over
    /// tiles of 16 plus a tail, dv 40 over column tiles of 32), sequences of
    /// 150 (three chunks, the last partial), 1, 0 and 65 (a chunk, then one
    /// token) tokens in shuffled slots. A one-token sequence has the
    /// recurrent kernel's bits exactly, and a prefill cut at a chunk
    /// boundary equals the one-call prefill bit for bit (the prefix cache's
    /// requirement).
    #[test]
    fn gated_delta_chunked_prefill_matches_the_recurrent_form() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        let (nk, nv, dk, dv) = (2, 4, 48, 40);
        let cu = [0u32, 150, 151, 151, 216];
        let slots = [3u32, 0, 4, 1];
        let t = 216;
        let q = rand_vec(&mut rng, t * nk * dk, 0.15);
        let kk = rand_vec(&mut rng, t * nk * dk, 0.15);
        let v = rand_vec(&mut rng, t * nv * dv, 1.0);
        let g: Vec<f32> = (0..t * nv).map(|_| -rng.gen_range(0.0..0.7f32)).collect();
        let beta: Vec<f32> = (0..t * nv).map(|_| rng.gen_range(0.0..1.0f32)).collect();
        let per = nv * dk * dv;
        let init: Vec<f32> = rand_vec(&mut rng, 5 * per, 0.3);
        let mut st: Vec<Vec<f32>> = init.chunks(per).map(|c| c.to_vec()).collect();
        let mut want = vec![0.0; t * nv * dv];
        for (s, &slot) in slots.iter().enumerate() {
            let (a, b) = (cu[s] as usize, cu[s + 1] as usize);
            if a == b {
                continue;
            }
            let dims = cpu::gated_delta::GatedDeltaDims {
                t: b - a,
                nk,
                nv,
                dk,
                dv,
            };
            cpu::gated_delta::gated_delta_recurrent_forward(
                &mut want[a * nv * dv..b * nv * dv],
                &mut st[slot as usize],
                &q[a * nk * dk..b * nk * dk],
                &kk[a * nk * dk..b * nk * dk],
                &v[a * nv * dv..b * nv * dv],
                &g[a * nv..b * nv],
                &beta[a * nv..b * nv],
                dims,
            )
            .unwrap();
        }
        let up = |x: &[f32]| d.upload(x).unwrap();
        let (dq, dk_, dvv, dg, db) = (up(&q), up(&kk), up(&v), up(&g), up(&beta));
        let dslots = d.upload(&slots).unwrap();
        let run = |chunked: bool| {
            let mut dst = up(&init);
            let mut out = d.zeros(t * nv * dv).unwrap();
            d.gated_delta_prefill(
                &mut out,
                &mut dst,
                &dq,
                &dk_,
                &dvv,
                &dg,
                &db,
                &dslots,
                &cu,
                (nk, nv, dk, dv),
                chunked,
            )
            .unwrap();
            (d.download(&out).unwrap(), d.download(&dst).unwrap())
        };
        let (out, state) = run(true);
        close("chunked prefill", &out, &want, 1e-4);
        close("chunked prefill state", &state, &st.concat(), 1e-4);
        let (rec_out, _) = run(false);
        let one = (150 * nv * dv)..(151 * nv * dv);
        assert_eq!(out[one.clone()], rec_out[one], "a one-token sequence");

        // Sequence 0 alone, cut at token 64: the same bits as in one call.
        let sub = |x: &[f32], w: usize, a: usize, b: usize| up(&x[a * w..b * w]);
        let mut dst = up(&init);
        let slot0 = d.upload(&[3u32]).unwrap();
        let mut split = Vec::new();
        for (a, b) in [(0, 64), (64, 150)] {
            let mut o = d.zeros((b - a) * nv * dv).unwrap();
            d.gated_delta_prefill(
                &mut o,
                &mut dst,
                &sub(&q, nk * dk, a, b),
                &sub(&kk, nk * dk, a, b),
                &sub(&v, nv * dv, a, b),
                &sub(&g, nv, a, b),
                &sub(&beta, nv, a, b),
                &slot0,
                &[0, (b - a) as u32],
                (nk, nv, dk, dv),
                true,
            )
            .unwrap();
            split.extend(d.download(&o).unwrap());
        }
        assert_eq!(split[..], out[..150 * nv * dv], "a prefill cut at a chunk");
        assert_eq!(
            d.download(&dst).unwrap()[3 * per..4 * per],
            state[3 * per..4 * per]
        );
    }

    /// Tiles of `ATTN_PAIRS` (query, head) pairs per sequence, none for an
    /// empty one, the last one partial.
    #[test]
    fn prefill_tiles_cover_every_pair_once() {
        assert_eq!(ATTN_PAIRS, 16);
        // group 3: 6 tokens = 18 pairs (two tiles), 0, 1 token = 3 pairs;
        // each tile over 2 KV heads.
        assert_eq!(
            prefill_tiles(&[0, 6, 6, 7], 6, 2),
            (vec![0, 0, 0, 16, 2, 0], 6)
        );
        assert_eq!(prefill_tiles(&[0, 0], 4, 1), (vec![], 0));
        // group 32 (more heads than a tile): two tiles per token.
        assert_eq!(
            prefill_tiles(&[0, 2], 32, 1),
            (vec![0, 0, 0, 16, 0, 32, 0, 48], 4)
        );

        assert_eq!(ATTN_KEY_TILE % ATTN_WARPS, 0);
    }

    /// The value of `#define NAME value` in a kernel source.
    fn define(src: &str, name: &str) -> usize {
        let line = src
            .lines()
            .find(|l| l.split_whitespace().take(2).eq(["#define", name]))
            .unwrap_or_else(|| panic!("no #define {name}"));
        line.split_whitespace().nth(2).unwrap().parse().unwrap()
    }

    /// Decode's split count is the longest context's, and the host's
    /// constants are the kernels' own (`#define`s of attention.cu).
    #[test]
    fn decode_splits_follow_the_longest_context_and_the_kernel_constants() {
        assert_eq!(decode_splits(&[]), 1);
        assert_eq!(decode_splits(&[0, 1, 512]), 1);
        assert_eq!(decode_splits(&[513, 3]), 2);
        assert_eq!(decode_splits(&[7, 32_768]), 64);
        let src = include_str!("attention.cu");
        for (name, host) in [
            ("ATTN_WARPS", ATTN_WARPS),
            ("ATTN_PAIR_WARPS", ATTN_PAIR_WARPS),
            ("ATTN_PAIRS_PER_WARP", ATTN_PAIRS_PER_WARP),
            ("ATTN_KEY_TILE", ATTN_KEY_TILE),
            ("ATTN_BWD_ROWS", ATTN_BWD_ROWS),
            ("ATTN_SPLIT", ATTN_SPLIT),
            ("ATTN_DECODE_HEADS", ATTN_DECODE_HEADS),
        ] {
            assert_eq!(define(src, name), host, "{name}");
        }
        assert_eq!(ATTN_SPLIT % ATTN_KEY_TILE, 0);
    }

    /// The gated-delta, product and sampling launches agree with what their
    /// kernels assume: the same tiles and register rows, and blocks no
    /// larger than the kernels' shared arrays (`red[256]` of the chunk
    /// gradients, which sums over a power-of-two block; sample_rows'
    /// `SAMPLE_THREADS` slots).
    #[test]
    fn the_other_launches_match_their_kernels_constants() {
        let gd = include_str!("gated_delta.cu");
        for (name, host) in [
            ("GD_MAX_DK", GD_MAX_DK),
            ("GD_REC_COLS", GD_REC_COLS),
            ("GD_CHUNK", GD_CHUNK),
            ("GD_COLS", GD_COLS),
        ] {
            assert_eq!(define(gd, name), host, "{name}");
        }
        assert!(gd.contains("__shared__ double red[256];"));
        assert!(GD_CHUNK_THREADS <= 256 && GD_CHUNK_THREADS.is_power_of_two());
        let mm = include_str!("matmul.cu");
        let product = super::gemm::invariant_launch(65, 65);
        assert_eq!(product.block_dim, (define(mm, "MM_THREADS") as u32, 1, 1));
        let tile = define(mm, "MM_TILE") as u32;
        assert_eq!(
            (product.grid_dim.0, product.grid_dim.1),
            (65u32.div_ceil(tile), 65u32.div_ceil(tile))
        );
        let sample = define(include_str!("logsoftmax.cu"), "SAMPLE_THREADS") as u32;
        assert!(rows(1).block_dim.0 <= sample);
    }

    /// The attention launches' dynamic shared memory stays within the 48 KiB
    /// a launch gets without opting in, up to the largest head_dim; decode
    /// runs at most ATTN_DECODE_HEADS heads' warps, one block per
    /// (sequence, KV head, run of heads, split).
    #[test]
    fn attention_launches_fit_default_shared_memory() {
        for hd in [1, 72, MAX_HEAD_DIM] {
            assert!(
                attention_prefill_launch(1, hd).shared_mem_bytes <= 48 << 10,
                "{hd}"
            );
            for (nh, nkv) in [(8, 2), (64, 1), (3, 3)] {
                let cfg = decode_launch(2, nh, nkv, hd, 3);
                assert!(cfg.shared_mem_bytes <= 48 << 10, "{hd}");
                assert!(cfg.block_dim.0 as usize <= ATTN_DECODE_HEADS * ATTN_WARPS * 32);
            }
        }
        // Group 6: runs of 4 and 2 heads, two runs per KV head.
        assert_eq!(decode_launch(2, 12, 2, 24, 3).grid_dim.0, 2 * 2 * 2 * 3);
        assert_eq!(decode_launch(1, 8, 2, 256, 16).block_dim.0, 4 * 4 * 32);
    }

    /// Every kernel's largest launch: the block and the dynamic shared
    /// memory its wrapper asks for at the widest shapes it admits (head_dim
    /// `MAX_HEAD_DIM`, decode's `ATTN_DECODE_HEADS` heads a block, key
    /// heads `GD_MAX_DK`; the gated-delta value heads, which no wrapper
    /// bounds, at the same 128 as Qwen3.5's); the block sizes of the other
    /// launches do not depend on shapes.
    fn largest_launches() -> Vec<(&'static str, LaunchConfig)> {
        use super::backward::{
            attention_dkv_launch, attention_dq_launch, columns, per_item, recurrent_backward_launch,
        };
        let row = [
            "rmsnorm_forward",
            "gated_rmsnorm_forward",
            "add_rmsnorm_forward",
            "qk_norm_rope_forward",
            "embedding_forward_f32",
            "embedding_forward_bf16",
            "l2norm_forward",
            "logprob_gather_forward",
            "argmax_forward",
            "sample_rows",
            "rmsnorm_backward",
            "gated_rmsnorm_backward",
            "l2norm_backward",
            "embedding_backward",
            "qk_norm_rope_backward",
            "logprob_gather_backward",
            "entropy_forward",
            "entropy_backward",
        ];
        let elem = [
            "f32_to_bf16_copy",
            "gated_delta_gating_forward",
            "conv1d_update",
            "conv1d_forward",
            "conv1d_state_advance",
            "conv1d_varlen_forward",
            "conv1d_varlen_state_advance",
            "copy_within",
            "gather_rows",
            "scatter_rows",
            "zero_range",
            "copy_block",
            "copy_into",
            "silu_mul_forward",
            "sigmoid_gate_forward",
            "silu_forward",
            "add_assign",
            "paged_kv_write",
            "silu_backward",
            "silu_mul_backward",
            "sigmoid_gate_backward",
            "gated_delta_gating_backward",
            "conv1d_backward_input",
            "adamw_update",
            "scale_f32",
            "gated_delta_backward_reduce",
        ];
        let item = [
            "gated_delta_gating_param_grad",
            "conv1d_backward_weight",
            "sum_squares_partial",
        ];
        let (hd, dk) = (MAX_HEAD_DIM, GD_MAX_DK);
        let mut out: Vec<(&'static str, LaunchConfig)> = Vec::new();
        let by_element = elems(1);
        out.extend(row.iter().map(|&k| (k, rows(1))));
        out.extend(elem.iter().map(|&k| (k, by_element)));
        out.extend(item.iter().map(|&k| (k, per_item(1))));
        out.extend([
            ("rmsnorm_weight_grad", columns(1)),
            ("gated_rmsnorm_weight_grad", columns(1)),
            ("gated_delta_decode", recurrent_launch(1, dk, dk)),
            ("gated_delta_prefill", recurrent_launch(1, dk, dk)),
            ("gated_delta_chunk_prep", chunk_launch(1)),
            ("gated_delta_chunk_scan", chunk_scan_launch(1, dk)),
            ("gated_delta_chunk_dscan", chunk_launch(1)),
            ("gated_delta_chunk_grads", chunk_launch(1)),
            ("gated_delta_backward", recurrent_backward_launch(1, dk, dk)),
            (
                "paged_attention_decode",
                decode_launch(1, ATTN_DECODE_HEADS, 1, hd, 1),
            ),
            ("attention_split_merge", split_merge_launch(1)),
            ("varlen_attention_prefill", attention_prefill_launch(1, hd)),
            ("paged_attention_prefill", attention_prefill_launch(1, hd)),
            ("attention_backward_dq", attention_dq_launch(1, hd)),
            ("attention_backward_dkv", attention_dkv_launch(1, hd)),
            ("matmul_invariant", super::gemm::invariant_launch(1, 1)),
        ]);
        out
    }

    /// Every kernel's registers (as ptxas reports them for sm_90 and
    /// sm_100), threads and shared memory fit the block its largest launch
    /// asks for, so no launch fails for resources on a GPU
    /// (`CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES`); the table lists each kernel
    /// of every module once. Prints what ptxas reported.
    #[test]
    fn every_kernels_largest_launch_fits_its_registers_and_shared_memory() {
        let launches = largest_launches();
        let mut listed: Vec<&str> = launches.iter().map(|l| l.0).collect();
        listed.sort();
        let mut all: Vec<&str> = super::super::MODULES
            .iter()
            .flat_map(|m| m.kernels.iter().copied())
            .collect();
        all.sort();
        assert_eq!(listed, all, "the table lists every kernel once");
        if !super::super::tests::nvrtc_or_skip() {
            return;
        }
        for arch in [90, 100] {
            let mut refusals = Vec::new();
            for m in super::super::MODULES {
                let report = super::super::kernel_resources(m, arch).unwrap();
                for &kernel in m.kernels {
                    let r = report
                        .iter()
                        .find(|r| r.kernel == kernel)
                        .unwrap_or_else(|| panic!("sm_{arch}: ptxas reported nothing of {kernel}"));
                    let (_, cfg) = launches.iter().find(|l| l.0 == kernel).unwrap();
                    let (x, y, z) = cfg.block_dim;
                    let threads = x * y * z;
                    eprintln!(
                        "sm_{arch} {kernel:30} {:3} registers x {threads:4} threads, \
                         {:5} + {:5} bytes shared, {} bytes spilled",
                        r.registers, r.static_shared, cfg.shared_mem_bytes, r.spill_bytes
                    );
                    refusals.extend(r.launch_refusal(threads, cfg.shared_mem_bytes));
                }
            }
            assert!(refusals.is_empty(), "sm_{arch}:\n{}", refusals.join("\n"));
        }
    }

    /// Qwen3.5's key heads (128) fit the recurrence's registers; a wider
    /// one is a shape error naming the limit, not a launch failure.
    #[test]
    fn register_columns_hold_qwen_key_heads_and_refuse_wider() {
        assert!(check_register_columns("t", 128).is_ok());
        let e = check_register_columns("t", 129).unwrap_err().to_string();
        assert!(e.contains("129") && e.contains("128"), "{e}");
    }

    #[test]
    fn attention_prefill_and_paged_decode_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let (nh, nkv, hd) = (6, 2, 72);
        let scale = (hd as f32).powf(-0.5);
        // Two packed sequences of 37 and 5 tokens.
        let lens = [37usize, 5];
        let cu = [0u32, 37, 42];
        let t: usize = lens.iter().sum();
        let q = rand_vec(&mut rng, t * nh * hd, 1.0);
        let k = rand_vec(&mut rng, t * nkv * hd, 1.0);
        let v = rand_vec(&mut rng, t * nkv * hd, 1.0);
        let mut want = vec![0.0; t * nh * hd];
        let mut at = 0;
        for &n in &lens {
            let dims = cpu::attention::AttnDims {
                nq: n,
                nk: n,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            cpu::attention::attention_forward(
                &mut want[at * nh * hd..(at + n) * nh * hd],
                &q[at * nh * hd..(at + n) * nh * hd],
                &k[at * nkv * hd..(at + n) * nkv * hd],
                &v[at * nkv * hd..(at + n) * nkv * hd],
                dims,
                scale,
            )
            .unwrap();
            at += n;
        }
        let (dq, dk, dv) = (
            d.upload(&q).unwrap(),
            d.upload(&k).unwrap(),
            d.upload(&v).unwrap(),
        );
        let mut dout = d.zeros(t * nh * hd).unwrap();
        d.varlen_attention_prefill(&mut dout, &dq, &dk, &dv, &cu, (nh, nkv, hd), scale)
            .unwrap();
        close(
            "prefill attention",
            &d.download(&dout).unwrap(),
            &want,
            1e-4,
        );

        // Decode: the first sequence's keys scattered over blocks of 8 in a
        // pool of 10 blocks, in reverse order; its last query attends all.
        let (bs, n) = (8, lens[0]);
        let row = nkv * hd;
        let table: Vec<u32> = (0..n.div_ceil(bs) as u32).rev().collect();
        let slots: Vec<u32> = (0..n)
            .map(|j| table[j / bs] * bs as u32 + (j % bs) as u32)
            .collect();
        let (mut kp, mut vp) = (
            d.zeros(10 * bs * row).unwrap(),
            d.zeros(10 * bs * row).unwrap(),
        );
        let (k0, v0) = (
            d.upload(&k[..n * row]).unwrap(),
            d.upload(&v[..n * row]).unwrap(),
        );
        d.paged_kv_write(&mut kp, &mut vp, &k0, &v0, &slots, row)
            .unwrap();
        let qlast = d.upload(&q[(n - 1) * nh * hd..n * nh * hd]).unwrap();
        let mut o = d.zeros(nh * hd).unwrap();
        d.paged_attention_decode(
            &mut o,
            &qlast,
            &kp,
            &vp,
            std::slice::from_ref(&table),
            &[n as u32],
            (nh, nkv, hd),
            bs,
            scale,
        )
        .unwrap();
        close(
            "paged decode",
            &d.download(&o).unwrap(),
            &want[(n - 1) * nh * hd..n * nh * hd],
            1e-4,
        );

        // Every token of the first sequence decoded over its own context
        // has the fresh prefill's bits.
        let fresh = d.download(&dout).unwrap();
        let q0 = d.upload(&q[..n * nh * hd]).unwrap();
        let mut o = d.zeros(n * nh * hd).unwrap();
        let lens: Vec<u32> = (1..=n as u32).collect();
        d.paged_attention_decode(
            &mut o,
            &q0,
            &kp,
            &vp,
            &vec![table.clone(); n],
            &lens,
            (nh, nkv, hd),
            bs,
            scale,
        )
        .unwrap();
        assert_eq!(
            d.download(&o).unwrap(),
            fresh[..n * nh * hd],
            "decode == prefill"
        );

        // The same sequence prefilled after a cached past of 20 (two key
        // tiles and a part), beside a one-token and an empty sequence: the
        // fresh prefill's bits.
        let past = 20;
        let (t2, k2) = ([table.clone(), vec![], table.clone()], [past as u32, 0, 3]);
        let cu2 = [
            0u32,
            (n - past) as u32,
            (n - past) as u32,
            (n - past + 1) as u32,
        ];
        let mut q2 = q[past * nh * hd..n * nh * hd].to_vec();
        q2.extend_from_slice(&q[3 * nh * hd..4 * nh * hd]);
        let mut o = d.zeros(q2.len()).unwrap();
        d.paged_attention_prefill(
            &mut o,
            &d.upload(&q2).unwrap(),
            &kp,
            &vp,
            &t2,
            &k2,
            &cu2,
            (nh, nkv, hd),
            bs,
            scale,
        )
        .unwrap();
        let got = d.download(&o).unwrap();
        assert_eq!(
            got[..(n - past) * nh * hd],
            fresh[past * nh * hd..n * nh * hd]
        );
        assert_eq!(got[(n - past) * nh * hd..], fresh[3 * nh * hd..4 * nh * hd]);
    }

    /// A context of three splits (1,100 keys, the 0.8B model's heads):
    /// the fresh prefill against the CPU, decode (a block per split, then
    /// the split merge) and the paged prefill after a past of 600 with the
    /// fresh prefill's bits, on both sides of a split's end.
    #[test]
    fn long_contexts_split_with_the_same_bits() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (nh, nkv, hd, n, bs) = (8, 2, 256, 1100, 16);
        let (row, scale) = (nkv * hd, (hd as f32).powf(-0.5));
        let q = rand_vec(&mut rng, n * nh * hd, 1.0);
        let k = rand_vec(&mut rng, n * row, 1.0);
        let v = rand_vec(&mut rng, n * row, 1.0);
        let mut want = vec![0.0; n * nh * hd];
        let dims = cpu::attention::AttnDims {
            nq: n,
            nk: n,
            n_heads: nh,
            n_kv_heads: nkv,
            head_dim: hd,
        };
        cpu::attention::attention_forward(&mut want, &q, &k, &v, dims, scale).unwrap();
        let (dq, dk, dv) = (
            d.upload(&q).unwrap(),
            d.upload(&k).unwrap(),
            d.upload(&v).unwrap(),
        );
        let mut fresh = d.zeros(n * nh * hd).unwrap();
        let cu = [0, n as u32];
        d.varlen_attention_prefill(&mut fresh, &dq, &dk, &dv, &cu, (nh, nkv, hd), scale)
            .unwrap();
        let fresh = d.download(&fresh).unwrap();
        close("prefill over three splits", &fresh, &want, 1e-4);

        // The keys in the pools, blocks in reverse order.
        let blocks = n.div_ceil(bs);
        let table: Vec<u32> = (0..blocks as u32).rev().collect();
        let slots: Vec<u32> = (0..n)
            .map(|j| table[j / bs] * bs as u32 + (j % bs) as u32)
            .collect();
        let (mut kp, mut vp) = (
            d.zeros(blocks * bs * row).unwrap(),
            d.zeros(blocks * bs * row).unwrap(),
        );
        d.paged_kv_write(&mut kp, &mut vp, &dk, &dv, &slots, row)
            .unwrap();
        // Decode of tokens around the first split's end and at the last.
        let tokens: Vec<usize> = (505..520).chain(1090..1100).collect();
        let mut qs = Vec::new();
        for &i in &tokens {
            qs.extend_from_slice(&q[i * nh * hd..(i + 1) * nh * hd]);
        }
        let lens: Vec<u32> = tokens.iter().map(|&i| i as u32 + 1).collect();
        let mut o = d.zeros(qs.len()).unwrap();
        d.paged_attention_decode(
            &mut o,
            &d.upload(&qs).unwrap(),
            &kp,
            &vp,
            &vec![table.clone(); tokens.len()],
            &lens,
            (nh, nkv, hd),
            bs,
            scale,
        )
        .unwrap();
        let got = d.download(&o).unwrap();
        for (r, &i) in tokens.iter().enumerate() {
            assert_eq!(
                got[r * nh * hd..(r + 1) * nh * hd],
                fresh[i * nh * hd..(i + 1) * nh * hd],
                "decode of token {i} == prefill"
            );
        }
        // The last 500 tokens prefilled after a cached past of 600.
        let past = 600;
        let mut o = d.zeros((n - past) * nh * hd).unwrap();
        d.paged_attention_prefill(
            &mut o,
            &d.upload(&q[past * nh * hd..]).unwrap(),
            &kp,
            &vp,
            std::slice::from_ref(&table),
            &[past as u32],
            &[0, (n - past) as u32],
            (nh, nkv, hd),
            bs,
            scale,
        )
        .unwrap();
        assert_eq!(d.download(&o).unwrap(), fresh[past * nh * hd..]);
    }

    #[test]
    fn logprob_gather_and_argmax_match_cpu() {
        let Some(d) = gpu() else { return };
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (n, v) = (3, 4097);
        let logits = rand_vec(&mut rng, n * v, 10.0);
        let targets: Vec<u32> = (0..n).map(|_| rng.gen_range(0..v as u32)).collect();
        let inv_t = 1.0 / 0.7f32;
        let scaled: Vec<f32> = logits.iter().map(|x| x * inv_t).collect();
        let mut want = vec![0.0; n];
        cpu::logsoftmax::logprob_gather_forward(&mut want, &scaled, &targets, n, v).unwrap();
        let dl = d.upload(&logits).unwrap();
        let dt = d.upload(&targets).unwrap();
        let mut dout = d.zeros(n).unwrap();
        d.logprob_gather_forward(&mut dout, &dl, &dt, v, inv_t)
            .unwrap();
        close("logprob", &d.download(&dout).unwrap(), &want, 1e-5);
        let mut da = d.zeros::<u32>(n).unwrap();
        d.argmax_forward(&mut da, &dl, v).unwrap();
        let want: Vec<u32> = logits
            .chunks_exact(v)
            .map(|r| cpu::logsoftmax::argmax(r) as u32)
            .collect();
        assert_eq!(d.download(&da).unwrap(), want);
        // The CPU's rule on ties and NaNs: a NaN at 0 stays, one later is
        // passed over, a row of NaNs or of -inf gives 0.
        let (nan, inf) = (f32::NAN, f32::INFINITY);
        let special: [[f32; 5]; 5] = [
            [nan, 1.0, 3.0, 3.0, 2.0],
            [1.0, nan, 3.0, 3.0, nan],
            [nan; 5],
            [-inf; 5],
            [2.0, inf, 2.0, inf, nan],
        ];
        let flat: Vec<f32> = special.concat();
        let mut da = d.zeros::<u32>(special.len()).unwrap();
        d.argmax_forward(&mut da, &d.upload(&flat).unwrap(), 5)
            .unwrap();
        let want: Vec<u32> = special
            .iter()
            .map(|r| cpu::logsoftmax::argmax(r) as u32)
            .collect();
        assert_eq!(want, [0, 2, 0, 0, 1]);
        assert_eq!(d.download(&da).unwrap(), want);
    }
}
