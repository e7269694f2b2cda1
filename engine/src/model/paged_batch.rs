//! The host side of a forward over a paged cache that lives elsewhere (a
//! GPU's): where each new token of a packed batch sits (its sequence, its
//! position, the pool row its keys and values go to) and, for attention
//! after a past, what each row attends to. Plain host arithmetic, so the
//! CPU tests check the addressing the CUDA forward uses against the CPU
//! cache's own layout.
//!
//! Not for: running anything (`cuda.rs`), or deciding who gets which
//! blocks and slots (the scheduler, `kv_cache.rs`).

use crate::kv_cache::SlotId;
use crate::{Error, Result};

/// One sequence of a batch over a paged cache: new tokens after `past`
/// positions, its state in slot `slot` and its keys and values in the
/// blocks `blocks` (which must cover `past + tokens.len()` positions).
#[derive(Debug, Clone, Copy)]
pub struct PagedSeq<'a> {
    pub tokens: &'a [u32],
    pub past: usize,
    pub slot: SlotId,
    pub blocks: &'a [u32],
}

/// A packed batch's new tokens, placed in a cache of `num_blocks` blocks
/// of `block_size` positions and `num_slots` state slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PagedBatch {
    /// Every new token, sequences back to back.
    pub ids: Vec<u32>,
    /// Each new token's position in its sequence.
    pub positions: Vec<u32>,
    /// Row offsets of the sequences (`seqs + 1`, from 0).
    pub cu_seqlens: Vec<u32>,
    /// Each sequence's state slot.
    pub slots: Vec<u32>,
    /// The pool row (`block * block_size + offset`) of every new token.
    pub kv_rows: Vec<u32>,
    /// Whether every sequence starts at position 0.
    pub fresh: bool,
}

impl PagedBatch {
    pub fn new(
        seqs: &[PagedSeq<'_>],
        block_size: usize,
        num_blocks: usize,
        num_slots: usize,
    ) -> Result<Self> {
        let bs = block_size;
        let mut b = PagedBatch {
            ids: Vec::new(),
            positions: Vec::new(),
            cu_seqlens: vec![0],
            slots: Vec::with_capacity(seqs.len()),
            kv_rows: Vec::new(),
            fresh: seqs.iter().all(|s| s.past == 0),
        };
        for (s, seq) in seqs.iter().enumerate() {
            let end = seq.past + seq.tokens.len();
            if seq.tokens.is_empty() {
                return Err(Error::Input(format!("sequence {s} has no tokens to run")));
            }
            if seq.slot as usize >= num_slots {
                return Err(Error::Invariant(format!(
                    "sequence {s}: state slot {} of a cache of {num_slots}",
                    seq.slot
                )));
            }
            if bs == 0
                || seq.blocks.len() * bs < end
                || seq.blocks.iter().any(|&blk| blk as usize >= num_blocks)
            {
                return Err(Error::Invariant(format!(
                    "sequence {s}: blocks {:?} of {bs} positions (of a cache of {num_blocks}) \
                     do not hold {end} positions",
                    seq.blocks
                )));
            }
            b.ids.extend_from_slice(seq.tokens);
            for p in seq.past..end {
                b.positions.push(p as u32);
                b.kv_rows
                    .push((seq.blocks[p / bs] as usize * bs + p % bs) as u32);
            }
            b.cu_seqlens.push(b.ids.len() as u32);
            b.slots.push(seq.slot);
        }
        if b.ids.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        Ok(b)
    }

    /// For attention after a past, one decode query per new row: the
    /// block table of the row's sequence and how many positions the row
    /// sees (its own position and every one before).
    pub fn row_contexts(&self, seqs: &[PagedSeq<'_>]) -> (Vec<Vec<u32>>, Vec<u32>) {
        let t = self.ids.len();
        let (mut tables, mut lens) = (Vec::with_capacity(t), Vec::with_capacity(t));
        for seq in seqs {
            for i in 0..seq.tokens.len() {
                tables.push(seq.blocks.to_vec());
                lens.push((seq.past + i + 1) as u32);
            }
        }
        (tables, lens)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::{CacheLayout, PagedKvCache};
    use crate::model::SeqCache;

    fn layout() -> CacheLayout {
        CacheLayout {
            num_layers: 1,
            attn_layers: vec![0],
            linear_layers: vec![],
            kv_row: 1,
            conv_len: 0,
            rec_len: 0,
        }
    }

    /// Each new token's pool row is where the CPU cache stores that
    /// position: stored through `PagedKvCache::store` with the position as
    /// its key, the pools hold, at `kv_rows[i]`, `positions[i]`.
    #[test]
    fn pool_rows_are_where_the_cpu_cache_stores_positions() {
        let (bs, blocks) = (4, 12);
        let mut cache = PagedKvCache::new(layout(), bs, blocks, 3);
        // Non-contiguous tables; sequence 1 continues after a past of 6,
        // sequence 2 is a decode step after 9.
        let tables: [&[u32]; 3] = [&[7, 2], &[0, 11, 5], &[3, 9, 1]];
        let (pasts, lens) = ([0usize, 6, 9], [5usize, 4, 1]);
        let tokens: Vec<Vec<u32>> = lens.iter().map(|&n| (0..n as u32).collect()).collect();
        let seqs: Vec<PagedSeq<'_>> = (0..3)
            .map(|s| PagedSeq {
                tokens: &tokens[s],
                past: pasts[s],
                slot: s as SlotId,
                blocks: tables[s],
            })
            .collect();
        let b = PagedBatch::new(&seqs, bs, blocks, 3).unwrap();
        assert_eq!(b.cu_seqlens, vec![0, 5, 9, 10]);
        assert_eq!(b.positions, vec![0, 1, 2, 3, 4, 6, 7, 8, 9, 9]);
        assert_eq!(b.slots, vec![0, 1, 2]);
        assert!(!b.fresh);
        for s in 0..3 {
            let slot = cache.allocate_slot().unwrap();
            let mut seq = SeqCache {
                conv_state: vec![Vec::new()],
                recurrent_state: vec![Vec::new()],
                k: vec![Vec::new()],
                v: vec![Vec::new()],
                len: 0,
            };
            cache.load_states(&mut seq, pasts[s], slot).unwrap();
            // Key = the sequence's tag * 100 + position.
            let new: Vec<f32> = (pasts[s]..pasts[s] + lens[s])
                .map(|p| (s * 100 + p) as f32)
                .collect();
            seq.k[0] = new.clone();
            seq.v[0] = new;
            cache
                .store(&mut seq, tables[s], pasts[s], lens[s], slot)
                .unwrap();
        }
        let pages = cache.pages().unwrap();
        let (k_pool, _) = pages[0];
        let mut row = 0;
        for (s, &n) in lens.iter().enumerate() {
            for _ in 0..n {
                let want = (s * 100) as f32 + b.positions[row] as f32;
                assert_eq!(k_pool[b.kv_rows[row] as usize], want, "row {row}");
                row += 1;
            }
        }
        let (rt, rl) = b.row_contexts(&seqs);
        assert_eq!(rl, vec![1, 2, 3, 4, 5, 7, 8, 9, 10, 10]);
        assert_eq!(rt[6], tables[1].to_vec());
        assert_eq!(rt[9], tables[2].to_vec());
    }

    #[test]
    fn misplaced_sequences_are_errors() {
        let toks = [1u32, 2, 3];
        let seq = |past, slot, blocks: &'static [u32]| PagedSeq {
            tokens: &toks,
            past,
            slot,
            blocks,
        };
        let fresh = PagedBatch::new(&[seq(0, 0, &[0])], 4, 2, 1).unwrap();
        assert!(fresh.fresh);
        for (bad, what) in [
            (seq(0, 1, &[0]), "slot"),
            (seq(2, 0, &[0]), "do not hold"),
            (seq(0, 0, &[2]), "do not hold"),
        ] {
            let e = PagedBatch::new(&[bad], 4, 2, 1).unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        }
        let empty = PagedSeq {
            tokens: &[],
            past: 0,
            slot: 0,
            blocks: &[0],
        };
        assert!(PagedBatch::new(&[empty], 4, 2, 1).is_err());
        assert!(PagedBatch::new(&[], 4, 2, 1).is_err());
    }
}
