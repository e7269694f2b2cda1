//! The engine's cache memory, sized once from a byte budget: paged K/V for
//! the full-attention layers (blocks of `block_size` positions, handed out by
//! a [`BlockPool`], found through per-sequence block tables) and fixed state
//! slots for the Gated DeltaNet layers (conv history and fp32 recurrent state
//! per linear layer). A running sequence holds one state slot; the prefix
//! cache holds slots as snapshots of the state at a cached prefix's end.
//!
//! The engine's forward reads a sequence's past K/V in place from the blocks
//! ([`PagedKvCache::pages`] and the model's `forward_paged`; decode attention
//! walks the block table, a long prefill run gathers its past once).
//! [`PagedKvCache::load_states`] moves the sequence's state vectors into its
//! per-step [`SeqCache`] (moved, not copied) and [`PagedKvCache::store`]
//! writes the new positions back. [`PagedKvCache::load`] also gathers the
//! K/V into the `SeqCache`, for callers that want the sequence in one piece.
//!
//! Where the tensors live is the cache's [`Store`]: host memory for the
//! CPU model, or (feature `cuda`) the GPU's memory, where the CUDA model
//! reads and writes the pools and slots in place
//! ([`DeviceCache`](crate::model::cuda::DeviceCache)). The bookkeeping
//! (blocks, slots, budget) is the same for both.
//!
//! Not for: policy (the scheduler decides who gets blocks) or hashing
//! (`prefix_cache.rs`).

use crate::block_pool::{BlockId, BlockPool};
use crate::config::{LayerType, ModelConfig};
use crate::model::SeqCache;
use crate::{Error, Result};

/// Index of a state slot.
pub type SlotId = u32;

/// Sizes of the cached tensors, from the model config.
#[derive(Debug, Clone)]
pub struct CacheLayout {
    pub num_layers: usize,
    /// Model layer index of each full-attention layer.
    pub attn_layers: Vec<usize>,
    /// Model layer index of each linear-attention layer.
    pub linear_layers: Vec<usize>,
    /// Floats per position per attention layer for K (and again for V).
    pub kv_row: usize,
    /// Floats of conv history per linear layer.
    pub conv_len: usize,
    /// Floats of recurrent state per linear layer.
    pub rec_len: usize,
}

impl CacheLayout {
    pub fn new(c: &ModelConfig) -> Self {
        let mut attn_layers = Vec::new();
        let mut linear_layers = Vec::new();
        for (i, lt) in c.layer_types.iter().enumerate() {
            match lt {
                LayerType::FullAttention => attn_layers.push(i),
                LayerType::LinearAttention => linear_layers.push(i),
            }
        }
        CacheLayout {
            num_layers: c.num_layers(),
            attn_layers,
            linear_layers,
            kv_row: c.num_kv_heads * c.head_dim,
            conv_len: c.conv_kernel.saturating_sub(1) * c.linear_conv_dim(),
            rec_len: c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim,
        }
    }

    /// Bytes of one K/V block (all attention layers, K and V).
    pub fn block_bytes(&self, block_size: usize) -> usize {
        self.attn_layers.len() * 2 * block_size * self.kv_row * 4
    }

    /// Bytes of one state slot (all linear layers, conv and recurrent).
    pub fn slot_bytes(&self) -> usize {
        self.linear_layers.len() * (self.conv_len + self.rec_len) * 4
    }
}

/// Conv and recurrent state of every linear layer, indexed by model layer
/// (empty vectors at attention layers, as in [`SeqCache`]).
#[derive(Debug, Clone)]
struct StateSlot {
    conv: Vec<Vec<f32>>,
    rec: Vec<Vec<f32>>,
}

/// Paged K/V storage, its block pool, and the state slots.
#[derive(Debug)]
pub struct PagedKvCache {
    layout: CacheLayout,
    block_size: usize,
    pool: BlockPool,
    num_slots: usize,
    free_slots: Vec<SlotId>,
    store: Store,
}

/// Where a cache's tensors are allocated.
#[derive(Debug, Clone, Default)]
pub enum Placement {
    #[default]
    Host,
    /// On a GPU, for the CUDA model.
    #[cfg(feature = "cuda")]
    Device(std::sync::Arc<arcticd_kernels::cuda::device::CudaDevice>),
}

/// The cached tensors.
#[derive(Debug)]
enum Store {
    Host(HostStore),
    #[cfg(feature = "cuda")]
    Device(crate::model::cuda::DeviceCache),
}

impl Store {
    fn host_mut(&mut self) -> Result<&mut HostStore> {
        match self {
            Store::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Store::Device(_) => Err(on_device()),
        }
    }

    fn host_ref(&self) -> Result<&HostStore> {
        match self {
            Store::Host(h) => Ok(h),
            #[cfg(feature = "cuda")]
            Store::Device(_) => Err(on_device()),
        }
    }
}

/// The cached tensors in host memory, for the CPU model.
#[derive(Debug)]
struct HostStore {
    /// Per attention layer `[num_blocks, block_size, kv_row]`.
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
    slots: Vec<StateSlot>,
}

/// Sequences that run at once and prefix-cache snapshots kept, as fitted
/// to a cache budget by [`fit_slots`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SlotFit {
    pub running: usize,
    pub snapshots: usize,
    /// Whether fewer than asked fit.
    pub reduced: bool,
}

/// How many of `running` sequences and `snapshots` prefix snapshots a
/// budget of `budget_bytes` holds: every state slot (one per running
/// sequence and per snapshot, `layout.slot_bytes()` each) plus at least
/// `min_blocks` K/V blocks. When all asked do not fit, the slots get at
/// most half the budget (the rest is K/V), running sequences first, at
/// least one. A real model's state is large (Qwen3.5-0.8B: about 20 MB a
/// sequence), so a fixed number of running sequences would not fit a
/// modest budget; the engine runs fewer instead of refusing to start.
pub fn fit_slots(
    layout: &CacheLayout,
    block_size: usize,
    budget_bytes: usize,
    running: usize,
    snapshots: usize,
    min_blocks: usize,
) -> Result<SlotFit> {
    let slot = layout.slot_bytes();
    let kv_floor = layout.block_bytes(block_size) * min_blocks;
    let asked = (running + snapshots)
        .checked_mul(slot)
        .and_then(|b| b.checked_add(kv_floor));
    if asked.is_some_and(|b| b <= budget_bytes) {
        return Ok(SlotFit {
            running,
            snapshots,
            reduced: false,
        });
    }
    let fit = (budget_bytes / 2).checked_div(slot).unwrap_or(usize::MAX);
    if fit == 0 || budget_bytes - slot.min(budget_bytes) < kv_floor {
        return Err(Error::Config(format!(
            "cache memory {budget_bytes} bytes cannot hold one sequence: its state slot takes \
             {slot} bytes and at least {kv_floor} bytes of K/V blocks are needed beside it; \
             give the cache at least {} bytes",
            2 * slot.max(kv_floor)
        )));
    }
    let r = running.min(fit).max(1);
    Ok(SlotFit {
        running: r,
        snapshots: snapshots.min(fit.saturating_sub(r)),
        reduced: true,
    })
}

impl PagedKvCache {
    /// Split `budget_bytes` into `num_slots` state slots and as many K/V
    /// blocks as fit in the rest, allocated where `placement` says. Errors
    /// when not even `min_blocks` fit.
    pub fn with_budget(
        config: &ModelConfig,
        block_size: usize,
        budget_bytes: usize,
        (num_slots, min_blocks, max_blocks): (usize, usize, usize),
        placement: Placement,
    ) -> Result<Self> {
        let layout = CacheLayout::new(config);
        if block_size == 0 {
            return Err(Error::Config("block_size must be positive".into()));
        }
        let slot_total = layout.slot_bytes() * num_slots;
        let left = budget_bytes.checked_sub(slot_total).ok_or_else(|| {
            Error::Config(format!(
                "cache memory {budget_bytes} bytes cannot hold {num_slots} state slots of {} bytes",
                layout.slot_bytes()
            ))
        })?;
        let block_bytes = layout.block_bytes(block_size);
        let num_blocks = left
            .checked_div(block_bytes)
            .map_or(max_blocks, |n| n.min(max_blocks));
        if num_blocks < min_blocks {
            return Err(Error::Config(format!(
                "cache memory {budget_bytes} bytes leaves room for {num_blocks} KV blocks of \
                 {block_bytes} bytes after {num_slots} state slots; at least {min_blocks} are needed"
            )));
        }
        match placement {
            Placement::Host => Ok(Self::new(layout, block_size, num_blocks, num_slots)),
            #[cfg(feature = "cuda")]
            Placement::Device(dev) => {
                let store = crate::model::cuda::DeviceCache::new(
                    dev, &layout, block_size, num_blocks, num_slots,
                )?;
                Ok(Self::with_store(
                    layout,
                    block_size,
                    num_blocks,
                    num_slots,
                    Store::Device(store),
                ))
            }
        }
    }

    /// A cache of exactly `num_blocks` blocks and `num_slots` slots.
    pub fn new(
        layout: CacheLayout,
        block_size: usize,
        num_blocks: usize,
        num_slots: usize,
    ) -> Self {
        let per_layer = num_blocks * block_size * layout.kv_row;
        let n_attn = layout.attn_layers.len();
        let empty_slot = || {
            let mut s = StateSlot {
                conv: vec![Vec::new(); layout.num_layers],
                rec: vec![Vec::new(); layout.num_layers],
            };
            for &li in &layout.linear_layers {
                s.conv[li] = vec![0.0; layout.conv_len];
                s.rec[li] = vec![0.0; layout.rec_len];
            }
            s
        };
        // One zeroed allocation per pool (not `vec![pool; n]`, whose clones
        // write every byte): the OS hands out zero pages as they are first
        // used, so a large cache costs memory only as it fills.
        let pools = || -> Vec<Vec<f32>> { (0..n_attn).map(|_| vec![0.0; per_layer]).collect() };
        let store = Store::Host(HostStore {
            k: pools(),
            v: pools(),
            slots: (0..num_slots).map(|_| empty_slot()).collect(),
        });
        Self::with_store(layout, block_size, num_blocks, num_slots, store)
    }

    fn with_store(
        layout: CacheLayout,
        block_size: usize,
        num_blocks: usize,
        num_slots: usize,
        store: Store,
    ) -> Self {
        PagedKvCache {
            num_slots,
            free_slots: (0..num_slots as SlotId).rev().collect(),
            pool: BlockPool::new(num_blocks),
            layout,
            block_size,
            store,
        }
    }

    /// The device tensors, for the CUDA model's forward; `None` when the
    /// cache is in host memory.
    #[cfg(feature = "cuda")]
    pub fn device_mut(&mut self) -> Option<&mut crate::model::cuda::DeviceCache> {
        match &mut self.store {
            Store::Device(d) => Some(d),
            Store::Host(_) => None,
        }
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    pub fn layout(&self) -> &CacheLayout {
        &self.layout
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    pub fn pool_mut(&mut self) -> &mut BlockPool {
        &mut self.pool
    }

    /// Positions the whole pool can hold.
    pub fn capacity_tokens(&self) -> usize {
        self.pool.num_blocks() * self.block_size
    }

    pub fn num_free_slots(&self) -> usize {
        self.free_slots.len()
    }

    pub fn num_slots(&self) -> usize {
        self.num_slots
    }

    /// Take a state slot, zeroed (a fresh sequence's state).
    pub fn allocate_slot(&mut self) -> Option<SlotId> {
        let id = self.free_slots.pop()?;
        match &mut self.store {
            Store::Host(h) => {
                let s = &mut h.slots[id as usize];
                for &li in &self.layout.linear_layers {
                    s.conv[li].fill(0.0);
                    s.rec[li].fill(0.0);
                }
            }
            #[cfg(feature = "cuda")]
            Store::Device(d) => d.zero_slot(id),
        }
        Some(id)
    }

    /// Return a slot. Panics on a slot id that was not handed out twice in a
    /// row only in debug builds; the engine's bookkeeping owns this.
    pub fn free_slot(&mut self, id: SlotId) {
        debug_assert!(!self.free_slots.contains(&id), "slot {id} freed twice");
        self.free_slots.push(id);
    }

    /// Copy the state of slot `src` into slot `dst` (a snapshot, or a resume
    /// from one).
    // In builds with `cuda` the match below has a device arm.
    #[allow(clippy::infallible_destructuring_match)]
    pub fn copy_slot(&mut self, src: SlotId, dst: SlotId) {
        if src == dst {
            return;
        }
        let h = match &mut self.store {
            Store::Host(h) => h,
            #[cfg(feature = "cuda")]
            Store::Device(d) => return d.copy_slot(src, dst),
        };
        let (s, d) = (src as usize, dst as usize);
        for &li in &self.layout.linear_layers {
            let (a, b) = if s < d {
                let (lo, hi) = h.slots.split_at_mut(d);
                (&lo[s], &mut hi[0])
            } else {
                let (lo, hi) = h.slots.split_at_mut(s);
                (&hi[0], &mut lo[d])
            };
            b.conv[li].copy_from_slice(&a.conv[li]);
            b.rec[li].copy_from_slice(&a.rec[li]);
        }
    }

    /// Copy the first `rows` positions of block `src` into block `dst`, in
    /// every attention layer (copy-on-write of a shared partial block).
    #[allow(clippy::infallible_destructuring_match)]
    pub fn copy_block(&mut self, src: BlockId, dst: BlockId, rows: usize) {
        let h = match &mut self.store {
            Store::Host(h) => h,
            #[cfg(feature = "cuda")]
            Store::Device(d) => return d.copy_block(src, dst, rows),
        };
        let n = rows.min(self.block_size) * self.layout.kv_row;
        let (s, d) = (
            src as usize * self.block_size * self.layout.kv_row,
            dst as usize * self.block_size * self.layout.kv_row,
        );
        for buf in h.k.iter_mut().chain(h.v.iter_mut()) {
            buf.copy_within(s..s + n, d);
        }
    }

    /// Blocks a sequence of `len` positions needs.
    pub fn blocks_for(&self, len: usize) -> usize {
        len.div_ceil(self.block_size)
    }

    /// Fill `cache` for a sequence whose first `past` positions are in the
    /// blocks of `table` and whose state is in `slot`: K/V are gathered into
    /// `cache.k/v` (reusing their capacity) and the slot's state vectors are
    /// moved in. Must be paired with [`store`](Self::store). Host caches
    /// only.
    pub fn load(
        &mut self,
        cache: &mut SeqCache,
        table: &[BlockId],
        past: usize,
        slot: SlotId,
    ) -> Result<()> {
        let (bs, row) = (self.block_size, self.layout.kv_row);
        let layout = &self.layout;
        let h = self.store.host_mut()?;
        for (ai, &li) in layout.attn_layers.iter().enumerate() {
            for (dst, src) in [(&mut cache.k[li], &h.k[ai]), (&mut cache.v[li], &h.v[ai])] {
                dst.clear();
                let mut pos = 0;
                for &b in table {
                    if pos >= past {
                        break;
                    }
                    let n = bs.min(past - pos);
                    let off = b as usize * bs * row;
                    dst.extend_from_slice(&src[off..off + n * row]);
                    pos += n;
                }
            }
        }
        swap_states(layout, cache, &mut h.slots[slot as usize]);
        cache.len = past;
        Ok(())
    }

    /// [`load`](Self::load) without the K/V gather: for a forward that reads
    /// the past in place ([`Qwen3_5::forward_paged`](crate::Qwen3_5::forward_paged)
    /// with [`pages`](Self::pages)). The cache's K/V are left empty.
    pub fn load_states(&mut self, cache: &mut SeqCache, past: usize, slot: SlotId) -> Result<()> {
        for &li in &self.layout.attn_layers {
            cache.k[li].clear();
            cache.v[li].clear();
        }
        let layout = &self.layout;
        let h = self.store.host_mut()?;
        swap_states(layout, cache, &mut h.slots[slot as usize]);
        cache.len = past;
        Ok(())
    }

    /// The K and V block pools by model layer index (empty slices for the
    /// linear layers), for [`PagedPast`](crate::model::PagedPast). Host
    /// caches only.
    pub fn pages(&self) -> Result<Vec<(&[f32], &[f32])>> {
        let h = self.store.host_ref()?;
        let mut pools: Vec<(&[f32], &[f32])> = vec![(&[], &[]); self.layout.num_layers];
        for (ai, &li) in self.layout.attn_layers.iter().enumerate() {
            pools[li] = (&h.k[ai], &h.v[ai]);
        }
        Ok(pools)
    }

    /// Write positions `past..past + n` of `cache` into the blocks of
    /// `table` (which must cover them) and move the state back into `slot`.
    pub fn store(
        &mut self,
        cache: &mut SeqCache,
        table: &[BlockId],
        past: usize,
        n: usize,
        slot: SlotId,
    ) -> Result<()> {
        let (bs, row) = (self.block_size, self.layout.kv_row);
        let layout = &self.layout;
        let h = self.store.host_mut()?;
        for (ai, &li) in layout.attn_layers.iter().enumerate() {
            for (src, dst) in [(&cache.k[li], &mut h.k[ai]), (&cache.v[li], &mut h.v[ai])] {
                // The cache holds every position, or (after a paged
                // forward) only the `n` new ones.
                let first = if src.len() == n * row { past } else { 0 };
                let mut pos = past;
                while pos < past + n {
                    let b = table[pos / bs] as usize;
                    let within = pos % bs;
                    let m = (bs - within).min(past + n - pos);
                    let off = (b * bs + within) * row;
                    let from = (pos - first) * row;
                    dst[off..off + m * row].copy_from_slice(&src[from..from + m * row]);
                    pos += m;
                }
            }
        }
        swap_states(layout, cache, &mut h.slots[slot as usize]);
        Ok(())
    }
}

/// What the CPU model's access to a cache on a GPU is.
#[cfg(feature = "cuda")]
fn on_device() -> Error {
    Error::Invariant("the CPU model was given a cache that lives on a GPU".into())
}

/// Moves a slot's state vectors into a sequence's cache and the cache's
/// into the slot (no copy).
fn swap_states(layout: &CacheLayout, cache: &mut SeqCache, slot: &mut StateSlot) {
    for &li in &layout.linear_layers {
        std::mem::swap(&mut cache.conv_state[li], &mut slot.conv[li]);
        std::mem::swap(&mut cache.recurrent_state[li], &mut slot.rec[li]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Asked numbers when they fit; otherwise slots within half the
    /// budget, running sequences first; an error below one sequence.
    #[test]
    fn state_slots_are_fitted_to_the_budget() {
        // A large state beside small K/V, as in the real models.
        let layout = CacheLayout {
            kv_row: 1,
            conv_len: 100,
            rec_len: 1000,
            ..layout()
        };
        let slot = layout.slot_bytes();
        let roomy = fit_slots(&layout, 16, 13 * slot, 8, 4, 4).unwrap();
        assert_eq!(
            (roomy.running, roomy.snapshots, roomy.reduced),
            (8, 4, false)
        );
        let tight = fit_slots(&layout, 16, 10 * slot, 8, 4, 4).unwrap();
        assert_eq!(
            (tight.running, tight.snapshots, tight.reduced),
            (5, 0, true)
        );
        let three = fit_slots(&layout, 16, 6 * slot, 2, 4, 4).unwrap();
        assert_eq!(
            (three.running, three.snapshots, three.reduced),
            (2, 1, true)
        );
        assert!(fit_slots(&layout, 16, slot, 8, 4, 4).is_err());
        assert!(fit_slots(&layout, 16, 0, 8, 4, 4).is_err());
    }

    fn layout() -> CacheLayout {
        CacheLayout {
            num_layers: 2,
            attn_layers: vec![1],
            linear_layers: vec![0],
            kv_row: 3,
            conv_len: 2,
            rec_len: 4,
        }
    }

    fn scratch(l: &CacheLayout) -> SeqCache {
        SeqCache {
            conv_state: vec![Vec::new(); l.num_layers],
            recurrent_state: vec![Vec::new(); l.num_layers],
            k: vec![Vec::new(); l.num_layers],
            v: vec![Vec::new(); l.num_layers],
            len: 0,
        }
    }

    #[test]
    fn store_then_load_round_trips_across_blocks() {
        let mut c = PagedKvCache::new(layout(), 2, 4, 2);
        // Non-contiguous table: positions 0-1 in block 3, 2-3 in block 0, 4 in block 2.
        let table = [3, 0, 2];
        let slot = c.allocate_slot().unwrap();
        let mut s = scratch(c.layout());
        c.load(&mut s, &table, 0, slot).unwrap();
        let rows: Vec<f32> = (0..15).map(|x| x as f32).collect();
        s.k[1] = rows.clone();
        s.v[1] = rows.iter().map(|x| -x).collect();
        s.recurrent_state[0] = vec![1.0, 2.0, 3.0, 4.0];
        c.store(&mut s, &table, 0, 5, slot).unwrap();
        let mut t = scratch(c.layout());
        c.load(&mut t, &table, 5, slot).unwrap();
        assert_eq!(t.k[1], rows);
        assert_eq!(t.v[1][14], -14.0);
        assert_eq!(t.recurrent_state[0], vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(t.len, 5);
        // Appending one position continues in the third block.
        t.k[1].extend_from_slice(&[7.0, 7.0, 7.0]);
        t.v[1].extend_from_slice(&[8.0, 8.0, 8.0]);
        c.store(&mut t, &table, 5, 1, slot).unwrap();
        let mut u = scratch(c.layout());
        c.load(&mut u, &table, 6, slot).unwrap();
        assert_eq!(&u.k[1][15..], &[7.0, 7.0, 7.0]);
        assert_eq!(&u.k[1][..15], &rows[..]);
    }

    /// A paged forward loads only the states and stores only the new
    /// positions; the pools then hold what a gather-based step would.
    #[test]
    fn paged_steps_store_only_new_positions() {
        let mut c = PagedKvCache::new(layout(), 2, 4, 2);
        let table = [3, 0, 2];
        let slot = c.allocate_slot().unwrap();
        let mut s = scratch(c.layout());
        c.load_states(&mut s, 0, slot).unwrap();
        let rows: Vec<f32> = (0..15).map(|x| x as f32).collect();
        s.k[1] = rows.clone();
        s.v[1] = rows.iter().map(|x| -x).collect();
        s.recurrent_state[0] = vec![1.0, 2.0, 3.0, 4.0];
        c.store(&mut s, &table, 0, 5, slot).unwrap();
        // Next step: the cache gets no K/V, the new position only.
        let mut t = scratch(c.layout());
        c.load_states(&mut t, 5, slot).unwrap();
        assert!(t.k[1].is_empty() && t.v[1].is_empty());
        assert_eq!(t.recurrent_state[0], vec![1.0, 2.0, 3.0, 4.0]);
        assert_eq!(t.len, 5);
        t.k[1] = vec![7.0, 7.0, 7.0];
        t.v[1] = vec![8.0, 8.0, 8.0];
        c.store(&mut t, &table, 5, 1, slot).unwrap();
        let pages = c.pages().unwrap();
        let (k_pool, v_pool) = pages[1];
        assert!(pages[0].0.is_empty());
        // Position 5 is row 1 of block 2; position 2 row 0 of block 0.
        assert_eq!(&k_pool[(2 * 2 + 1) * 3..(2 * 2 + 2) * 3], &[7.0, 7.0, 7.0]);
        assert_eq!(&v_pool[(2 * 2 + 1) * 3..(2 * 2 + 2) * 3], &[8.0, 8.0, 8.0]);
        assert_eq!(&k_pool[0..3], &rows[6..9]);
        let mut u = scratch(c.layout());
        c.load(&mut u, &table, 6, slot).unwrap();
        assert_eq!(&u.k[1][..15], &rows[..]);
        assert_eq!(&u.k[1][15..], &[7.0, 7.0, 7.0]);
    }

    #[test]
    fn slots_are_zeroed_and_copied() {
        let mut c = PagedKvCache::new(layout(), 2, 1, 2);
        let a = c.allocate_slot().unwrap();
        let b = c.allocate_slot().unwrap();
        assert!(c.allocate_slot().is_none());
        c.store.host_mut().unwrap().slots[a as usize].rec[0] = vec![5.0; 4];
        c.copy_slot(a, b);
        assert_eq!(
            c.store.host_mut().unwrap().slots[b as usize].rec[0],
            vec![5.0; 4]
        );
        c.free_slot(a);
        let a2 = c.allocate_slot().unwrap();
        assert_eq!(a2, a);
        assert_eq!(
            c.store.host_mut().unwrap().slots[a as usize].rec[0],
            vec![0.0; 4]
        );
    }

    #[test]
    fn budget_sizes_blocks_after_slots() {
        let cfg_layout = layout();
        // slot: (2 + 4) * 4 = 24 bytes; block of 2: 1 * 2 * 2 * 3 * 4 = 48 bytes.
        assert_eq!(cfg_layout.slot_bytes(), 24);
        assert_eq!(cfg_layout.block_bytes(2), 48);
    }
}
