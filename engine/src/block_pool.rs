//! The block pool of the paged KV cache: a fixed set of block ids handed out
//! and taken back in O(1) (a free stack), each with a reference count so one
//! block can sit in several block tables at once (a shared prompt prefix, the
//! prefix cache). A block returns to the free stack when its last reference
//! is released.
//!
//! Not for: the K/V memory itself (`kv_cache.rs` owns the storage and maps a
//! block id to rows), nor policy (who gets evicted or preempted is the
//! scheduler's call). Plain and synchronous: only the engine task touches it
//! (vLLM's `BlockPool`, mistral.rs's block engine, minus their locking).

/// Index of a block in the pool, also its index into the KV storage.
pub type BlockId = u32;

/// Fixed-size pool of reference-counted block ids.
#[derive(Debug, Clone)]
pub struct BlockPool {
    /// Ids with no reference, popped from the back.
    free: Vec<BlockId>,
    /// References held on each block; 0 means it is on the free stack.
    refcount: Vec<u32>,
}

impl BlockPool {
    /// A pool of `num_blocks` free blocks. Block 0 is handed out first.
    pub fn new(num_blocks: usize) -> Self {
        BlockPool {
            free: (0..num_blocks as BlockId).rev().collect(),
            refcount: vec![0; num_blocks],
        }
    }

    /// Blocks in the pool, free or not.
    pub fn num_blocks(&self) -> usize {
        self.refcount.len()
    }

    /// Blocks not referenced by anyone.
    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    /// Blocks referenced at least once.
    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    /// References held on a block (0 when it is free).
    pub fn references(&self, id: BlockId) -> u32 {
        self.refcount[id as usize]
    }

    /// Take a free block with one reference, or `None` when the pool is
    /// exhausted. O(1).
    pub fn allocate(&mut self) -> Option<BlockId> {
        let id = self.free.pop()?;
        self.refcount[id as usize] = 1;
        Some(id)
    }

    /// Add a reference to a block that is in use. O(1).
    ///
    /// Panics if the block is free: sharing a block nobody owns is a bug in
    /// the caller's bookkeeping, never something a client can cause.
    pub fn share(&mut self, id: BlockId) {
        let rc = &mut self.refcount[id as usize];
        assert!(*rc > 0, "block {id} shared while free");
        *rc += 1;
    }

    /// Drop one reference; the block goes back to the free stack when none
    /// remain. Returns whether it was freed. O(1).
    ///
    /// Panics on a double free (an engine bookkeeping bug).
    pub fn release(&mut self, id: BlockId) -> bool {
        let rc = &mut self.refcount[id as usize];
        assert!(*rc > 0, "block {id} released while free");
        *rc -= 1;
        if *rc == 0 {
            self.free.push(id);
            true
        } else {
            false
        }
    }

    /// References held on `id`.
    pub fn refcount(&self, id: BlockId) -> u32 {
        self.refcount[id as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allocate_until_empty_then_free_returns_blocks() {
        let mut pool = BlockPool::new(3);
        let a = pool.allocate().unwrap();
        let b = pool.allocate().unwrap();
        let c = pool.allocate().unwrap();
        assert_eq!((a, b, c), (0, 1, 2));
        assert_eq!(pool.allocate(), None);
        assert_eq!(pool.num_free(), 0);
        assert!(pool.release(b));
        assert_eq!(pool.num_free(), 1);
        assert_eq!(pool.allocate(), Some(b));
        assert_eq!(pool.num_used(), 3);
    }

    #[test]
    fn shared_block_is_freed_by_the_last_reference() {
        let mut pool = BlockPool::new(2);
        let a = pool.allocate().unwrap();
        pool.share(a);
        pool.share(a);
        assert_eq!(pool.refcount(a), 3);
        assert!(!pool.release(a));
        assert!(!pool.release(a));
        assert_eq!(pool.num_free(), 1);
        assert!(pool.release(a));
        assert_eq!(pool.num_free(), 2);
        assert_eq!(pool.refcount(a), 0);
    }

    #[test]
    #[should_panic(expected = "released while free")]
    fn double_free_is_caught() {
        let mut pool = BlockPool::new(1);
        let a = pool.allocate().unwrap();
        pool.release(a);
        pool.release(a);
    }

    #[test]
    fn many_cycles_keep_counts_consistent() {
        let mut pool = BlockPool::new(64);
        let mut held = Vec::new();
        for round in 0..1000usize {
            if round % 3 == 2 {
                if let Some(id) = held.pop() {
                    pool.release(id);
                }
            } else if let Some(id) = pool.allocate() {
                held.push(id);
            }
            assert_eq!(pool.num_used(), held.len());
        }
    }
}
