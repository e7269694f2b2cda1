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

use super::{KernelCache, MODULES};
use crate::{Error, Result};
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

fn attention_launch(blocks: usize, hd: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: ((ATTN_WARPS * 32) as u32, 1, 1),
        shared_mem_bytes: (ATTN_WARPS * (hd + 2) * 4) as u32,
    }
}

/// One GPU with every kernel loaded.
pub struct CudaDevice {
    ordinal: usize,
    arch: u32,
    _ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
}

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
            _ctx: ctx,
            stream,
            functions,
        })
    }

    /// Compute capability as one number (90 for sm_90).
    pub fn arch(&self) -> u32 {
        self.arch
    }

    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>> {
        Ok(self.stream.clone_htod(host)?)
    }

    pub fn download<T: DeviceRepr>(&self, dev: &CudaSlice<T>) -> Result<Vec<T>> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        Ok(self.stream.alloc_zeros(n)?)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
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
        let f = self.func("rmsnorm_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(rstd)
            .arg(inp)
            .arg(weight)
            .arg(&ni)
            .arg(&ci)
            .arg(&eps);
        // SAFETY: argument types and count match the kernel; sizes checked.
        unsafe { b.launch(rows(n)) }?;
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
        let f = self.func("gated_rmsnorm_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(rstd)
            .arg(inp)
            .arg(gate)
            .arg(weight)
            .arg(&ni)
            .arg(&ci)
            .arg(&eps);
        // SAFETY: as above.
        unsafe { b.launch(rows(n)) }?;
        Ok(())
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
        let f = self.func("silu_mul_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(gate).arg(up).arg(&nl);
        // SAFETY: as above.
        unsafe { b.launch(elems(n)) }?;
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
        let f = self.func("sigmoid_gate_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(x).arg(gate).arg(&nl);
        // SAFETY: as above.
        unsafe { b.launch(elems(n)) }?;
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
        let f = self.func("l2norm_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(rnorm)
            .arg(inp)
            .arg(&ni)
            .arg(&di)
            .arg(&eps)
            .arg(&scale);
        // SAFETY: as above.
        unsafe { b.launch(rows(n)) }?;
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
        if seqs == 0 {
            return Ok(());
        }
        let ints = [seqs, nk, nv, dk, dv]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let f = self.func("gated_delta_decode")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(state)
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(g)
            .arg(beta)
            .arg(slots)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&ints[4]);
        let cfg = LaunchConfig {
            grid_dim: ((seqs * nv) as u32, 1, 1),
            block_dim: (dv.next_multiple_of(32).min(1024) as u32, 1, 1),
            shared_mem_bytes: (2 * dk * 4) as u32,
        };
        // SAFETY: as above; the slots index the state (checked by the
        // caller's slot allocator; the kernel trusts them).
        unsafe { b.launch(cfg) }?;
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
        let t = cu_seqlens.last().copied().unwrap_or(0) as usize;
        if cu_seqlens.first() != Some(&0) || cu_seqlens.windows(2).any(|w| w[0] > w[1]) {
            return Err(Error::Shape(format!(
                "{op}: cu_seqlens must rise from 0, got {cu_seqlens:?}"
            )));
        }
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
        let token_seq: Vec<u32> = cu_seqlens
            .windows(2)
            .enumerate()
            .flat_map(|(s, w)| std::iter::repeat_n(s as u32, (w[1] - w[0]) as usize))
            .collect();
        let (cu, ts) = (self.upload(cu_seqlens)?, self.upload(&token_seq)?);
        let ints = [t, n_heads, n_kv_heads, hd]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let f = self.func(op)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(q)
            .arg(k)
            .arg(v)
            .arg(&cu)
            .arg(&ts)
            .arg(&ints[0])
            .arg(&ints[1])
            .arg(&ints[2])
            .arg(&ints[3])
            .arg(&scale);
        // SAFETY: as above.
        unsafe { b.launch(attention_launch(t * n_heads, hd)) }?;
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
        let slots = self.upload(slot_mapping)?;
        let (ti, ri) = (int(op, "tokens", t)?, int(op, "kv_row", kv_row)?);
        let f = self.func(op)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(k_pool)
            .arg(v_pool)
            .arg(k)
            .arg(v)
            .arg(&slots)
            .arg(&ti)
            .arg(&ri);
        // SAFETY: as above; slots checked against the pool.
        unsafe { b.launch(elems(t * kv_row)) }?;
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
        let row = n_kv_heads * hd;
        let pool_blocks = k_pool.len().min(v_pool.len()) / (block_size * row).max(1);
        for (s, (table, &n)) in block_tables.iter().zip(context_lens).enumerate() {
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
        if seqs == 0 {
            return Ok(());
        }
        let max_blocks = block_tables.iter().map(Vec::len).max().unwrap_or(0).max(1);
        let mut flat = vec![0u32; seqs * max_blocks];
        for (s, t) in block_tables.iter().enumerate() {
            flat[s * max_blocks..s * max_blocks + t.len()].copy_from_slice(t);
        }
        let (tables, lens) = (self.upload(&flat)?, self.upload(context_lens)?);
        let ints = [seqs, n_heads, n_kv_heads, hd, block_size, max_blocks]
            .iter()
            .map(|&x| int(op, "size", x))
            .collect::<Result<Vec<i32>>>()?;
        let f = self.func(op)?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(q)
            .arg(k_pool)
            .arg(v_pool)
            .arg(&tables)
            .arg(&lens);
        for x in &ints {
            b.arg(x);
        }
        b.arg(&scale);
        // SAFETY: as above; tables checked against the pool.
        unsafe { b.launch(attention_launch(seqs * n_heads, hd)) }?;
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
        let f = self.func("logprob_gather_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out)
            .arg(logits)
            .arg(targets)
            .arg(&ni)
            .arg(&vi)
            .arg(&inv_temp);
        // SAFETY: as above.
        unsafe { b.launch(rows(n)) }?;
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
        let f = self.func("argmax_forward")?;
        let mut b = self.stream.launch_builder(f);
        b.arg(out).arg(logits).arg(&ni).arg(&vi);
        // SAFETY: as above.
        unsafe { b.launch(rows(n)) }?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu;
    use rand::{Rng, SeedableRng};

    /// The device, or None (skipped) where this machine has no GPU.
    fn gpu() -> Option<CudaDevice> {
        let required = std::env::var_os("ARCTICD_REQUIRE_GPU").is_some();
        if !driver_available() || !super::super::nvrtc_available() {
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

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.gen_range(-scale..scale)).collect()
    }

    fn close(name: &str, got: &[f32], want: &[f32], tol: f32) {
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
            &[table],
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
    }
}
