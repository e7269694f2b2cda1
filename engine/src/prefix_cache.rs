//! Prefix cache: prompt prefixes computed once and reused by later requests.
//!
//! The unit of caching is `unit` tokens (a multiple of the block size). Unit
//! `i` of a token sequence is keyed by a hash chain, `key_i = H(key_{i-1},
//! tokens of unit i)`, so one key names the whole prefix up to the end of the
//! unit. An entry holds references to the K/V blocks of its unit and a state
//! slot with a snapshot of every linear layer's conv and recurrent state at
//! the unit's end: recurrent layers cannot resume from an arbitrary position,
//! only from a saved state, so a hit resumes exactly at an entry's end.
//!
//! A hit gives bit-for-bit the same log-probs as a cold run because the
//! scheduler prefills every sequence in segments that never cross a unit
//! boundary: the work done for positions after the hit is the same
//! computation, on the same inputs, as in a cold run (see `scheduler.rs`).
//! Only positions computed by prefill are cached; decoded tokens go through
//! the recurrent step, which rounds differently.
//!
//! Eviction is least-recently-used over entries (deepest first on ties, so
//! a chain is trimmed from its end). Entries hold blocks by reference count,
//! so evicting one that a running sequence still uses frees nothing until
//! that sequence lets go. Follows vLLM's hash-chained block cache, plus the
//! state snapshots a hybrid model needs.

use crate::block_pool::{BlockId, BlockPool};
use crate::kv_cache::{PagedKvCache, SlotId};
use std::collections::HashMap;

/// Key of a cached prefix: the hash chain up to the end of one unit.
pub type PrefixKey = u64;

/// The key of the unit `tokens` following the prefix `parent` (None for
/// the first unit). FNV-1a over the parent key and the token ids, then a
/// final mix; collisions are caught by comparing the stored tokens.
pub fn chain_key(parent: Option<PrefixKey>, tokens: &[u32]) -> PrefixKey {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |x: u64| {
        for b in x.to_le_bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    };
    eat(parent.map_or(u64::MAX, |p| p));
    for &t in tokens {
        eat(t as u64);
    }
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^ (h >> 33)
}

#[derive(Debug)]
struct Entry {
    parent: Option<PrefixKey>,
    tokens: Vec<u32>,
    blocks: Vec<BlockId>,
    slot: SlotId,
    depth: usize,
    last_used: u64,
}

/// A hit: resume at `len` tokens with these blocks and this state.
#[derive(Debug, Clone)]
pub struct PrefixHit {
    /// Tokens covered (a multiple of the unit).
    pub len: usize,
    /// Blocks of positions `0..len`, in order; the caller takes a reference.
    pub blocks: Vec<BlockId>,
    /// The snapshot to copy into the sequence's own slot.
    pub slot: SlotId,
    /// Keys of each unit of the prefix.
    pub keys: Vec<PrefixKey>,
}

/// Hash-chained prefix cache with state snapshots and LRU eviction.
#[derive(Debug)]
pub struct PrefixCache {
    unit: usize,
    entries: HashMap<PrefixKey, Entry>,
    tick: u64,
}

impl PrefixCache {
    pub fn new(unit: usize) -> Self {
        PrefixCache {
            unit,
            entries: HashMap::new(),
            tick: 0,
        }
    }

    pub fn unit(&self) -> usize {
        self.unit
    }

    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest cached prefix of `tokens` no longer than `max_len`,
    /// touching its entries. (The scheduler counts the hit rate, once per
    /// admitted sequence: a lookup may be retried.)
    pub fn lookup(&mut self, tokens: &[u32], max_len: usize) -> Option<PrefixHit> {
        self.tick += 1;
        let mut parent = None;
        let mut keys = Vec::new();
        let mut blocks = Vec::new();
        let mut slot = None;
        let mut len = 0;
        while len + self.unit <= max_len.min(tokens.len()) {
            let unit_tokens = &tokens[len..len + self.unit];
            let key = chain_key(parent, unit_tokens);
            let Some(e) = self.entries.get_mut(&key) else {
                break;
            };
            if e.parent != parent || e.tokens != unit_tokens {
                break;
            }
            e.last_used = self.tick;
            blocks.extend_from_slice(&e.blocks);
            slot = Some(e.slot);
            keys.push(key);
            parent = Some(key);
            len += self.unit;
        }
        let slot = slot?;
        Some(PrefixHit {
            len,
            blocks,
            slot,
            keys,
        })
    }

    /// Whether `key` is cached.
    pub fn contains(&self, key: PrefixKey) -> bool {
        self.entries.contains_key(&key)
    }

    /// Cache the unit `tokens` after prefix `parent`, whose blocks are
    /// `blocks` (a reference is taken on each) and whose state is copied
    /// from `state` into a fresh slot. Evicts LRU entries for the slot if
    /// needed, never one in `protect`. Returns false (and caches nothing)
    /// when no slot can be found.
    #[allow(clippy::too_many_arguments)]
    pub fn insert(
        &mut self,
        cache: &mut PagedKvCache,
        parent: Option<PrefixKey>,
        key: PrefixKey,
        depth: usize,
        tokens: &[u32],
        blocks: &[BlockId],
        state: SlotId,
        protect: &[PrefixKey],
    ) -> bool {
        self.tick += 1;
        if let Some(e) = self.entries.get_mut(&key) {
            e.last_used = self.tick;
            return true;
        }
        let slot = loop {
            if let Some(s) = cache.allocate_slot() {
                break s;
            }
            if !self.evict_one(cache, protect) {
                return false;
            }
        };
        cache.copy_slot(state, slot);
        for &b in blocks {
            cache.pool_mut().share(b);
        }
        self.entries.insert(
            key,
            Entry {
                parent,
                tokens: tokens.to_vec(),
                blocks: blocks.to_vec(),
                slot,
                depth,
                last_used: self.tick,
            },
        );
        true
    }

    /// Evict the least recently used entry not in `protect`, releasing its
    /// blocks and slot. Returns false when nothing can be evicted.
    pub fn evict_one(&mut self, cache: &mut PagedKvCache, protect: &[PrefixKey]) -> bool {
        let victim = self
            .entries
            .iter()
            .filter(|(k, _)| !protect.contains(k))
            .min_by_key(|(_, e)| (e.last_used, std::cmp::Reverse(e.depth)))
            .map(|(&k, _)| k);
        let Some(key) = victim else {
            return false;
        };
        if let Some(e) = self.entries.remove(&key) {
            for b in e.blocks {
                cache.pool_mut().release(b);
            }
            cache.free_slot(e.slot);
        }
        true
    }

    /// Blocks that evicting every entry not in `protect` would free: those
    /// no running sequence shares.
    pub fn releasable_blocks(&self, pool: &BlockPool, protect: &[PrefixKey]) -> usize {
        self.entries
            .iter()
            .filter(|(k, _)| !protect.contains(k))
            .flat_map(|(_, e)| &e.blocks)
            .filter(|&&b| pool.references(b) == 1)
            .count()
    }

    /// Evict entries until `cache` has `blocks` free blocks or nothing is
    /// left to evict. Returns whether the target was met.
    pub fn evict_for_blocks(&mut self, cache: &mut PagedKvCache, blocks: usize) -> bool {
        while cache.pool().num_free() < blocks {
            if !self.evict_one(cache, &[]) {
                return false;
            }
        }
        true
    }

    /// Drop every entry (after a weight update: cached states belong to old
    /// weights).
    pub fn clear(&mut self, cache: &mut PagedKvCache) {
        for (_, e) in self.entries.drain() {
            for b in e.blocks {
                cache.pool_mut().release(b);
            }
            cache.free_slot(e.slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::CacheLayout;

    fn cache() -> PagedKvCache {
        let layout = CacheLayout {
            num_layers: 2,
            attn_layers: vec![1],
            linear_layers: vec![0],
            kv_row: 1,
            conv_len: 1,
            rec_len: 1,
        };
        PagedKvCache::new(layout, 2, 8, 3)
    }

    #[test]
    fn chain_hit_covers_the_longest_cached_prefix() {
        let mut c = cache();
        let mut pc = PrefixCache::new(4);
        let toks: Vec<u32> = (0..12).collect();
        let seq_slot = c.allocate_slot().unwrap();
        let b: Vec<BlockId> = (0..4).map(|_| c.pool_mut().allocate().unwrap()).collect();
        let k0 = chain_key(None, &toks[0..4]);
        let k1 = chain_key(Some(k0), &toks[4..8]);
        assert!(pc.insert(&mut c, None, k0, 1, &toks[0..4], &b[0..2], seq_slot, &[]));
        assert!(pc.insert(
            &mut c,
            Some(k0),
            k1,
            2,
            &toks[4..8],
            &b[2..4],
            seq_slot,
            &[]
        ));
        assert_eq!(c.pool().refcount(b[0]), 2);
        let hit = pc.lookup(&toks, 11).unwrap();
        assert_eq!(hit.len, 8);
        assert_eq!(hit.blocks, b);
        assert_eq!(hit.keys, vec![k0, k1]);
        // Bounded by max_len: only the first unit.
        assert_eq!(pc.lookup(&toks, 7).unwrap().len, 4);
        // A different first unit misses.
        let other: Vec<u32> = (1..13).collect();
        assert!(pc.lookup(&other, 12).is_none());
    }

    #[test]
    fn lru_eviction_frees_slots_and_blocks() {
        let mut c = cache();
        let mut pc = PrefixCache::new(2);
        let seq_slot = c.allocate_slot().unwrap();
        let mut keys = Vec::new();
        for i in 0..3u32 {
            let b = c.pool_mut().allocate().unwrap();
            let toks = [i, i];
            let k = chain_key(None, &toks);
            keys.push(k);
            // Two free slots: the third insert evicts the oldest entry.
            assert!(pc.insert(&mut c, None, k, 1, &toks, &[b], seq_slot, &[]));
            c.pool_mut().release(b);
        }
        assert_eq!(pc.len(), 2);
        assert!(!pc.contains(keys[0]));
        assert_eq!(c.pool().num_free(), 8 - 2);
        pc.clear(&mut c);
        assert_eq!(c.pool().num_free(), 8);
        assert_eq!(c.num_free_slots(), 2);
    }
}
