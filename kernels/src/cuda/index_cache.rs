//! The index arrays a step's kernels read (sequence offsets, state slots,
//! K/V rows, block tables, prefill tiles) are the same in every layer: a
//! decode step of a 24-layer model used to copy each to the device once
//! per layer. [`IndexCache`] keeps the last few uploaded, found again by
//! their values, so a step copies each once. Only kernels read them, never
//! write, so an array with the same values is the same data; the buffer is
//! shared (`Arc`) and freed when the last user and the cache let go.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Arrays longer than this are uploaded by every call, not kept.
pub(super) const MAX_CACHED_LEN: usize = 1 << 16;

/// The last `cap` index arrays uploaded, most recently used first; `B` is
/// the device buffer (a plain vector in the tests).
pub(super) struct IndexCache<B> {
    cap: usize,
    entries: Mutex<VecDeque<(Vec<u32>, Arc<B>)>>,
}

impl<B> IndexCache<B> {
    pub(super) fn new(cap: usize) -> Self {
        IndexCache {
            cap,
            entries: Mutex::new(VecDeque::with_capacity(cap)),
        }
    }

    /// The buffer holding `host`: a kept one with the same values, else
    /// `upload(host)`, kept in place of the least recently used.
    pub(super) fn get<E>(
        &self,
        host: &[u32],
        upload: impl FnOnce(&[u32]) -> Result<B, E>,
    ) -> Result<Arc<B>, E> {
        if host.len() > MAX_CACHED_LEN || self.cap == 0 {
            return upload(host).map(Arc::new);
        }
        // A poisoned lock only means another thread panicked mid-lookup;
        // the entries are whole either way.
        let mut entries = self.entries.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = entries.iter().position(|(h, _)| h.as_slice() == host) {
            let hit = entries.remove(i).expect("position is in range");
            let buf = hit.1.clone();
            entries.push_front(hit);
            return Ok(buf);
        }
        let buf = Arc::new(upload(host)?);
        entries.push_front((host.to_vec(), buf.clone()));
        entries.truncate(self.cap);
        Ok(buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    fn counting(n: &Cell<usize>) -> impl Fn(&[u32]) -> Result<Vec<u32>, ()> + '_ {
        move |h| {
            n.set(n.get() + 1);
            Ok(h.to_vec())
        }
    }

    /// Every layer of a step asks for the same arrays: each is uploaded
    /// once, and the same buffer comes back.
    #[test]
    fn a_step_uploads_each_array_once() {
        let cache = IndexCache::new(4);
        let uploads = Cell::new(0);
        let (cu, slots) = ([0u32, 1, 2, 3], [7u32, 2, 5]);
        let first = cache.get(&cu, counting(&uploads)).unwrap();
        for _layer in 0..24 {
            let a = cache.get(&cu, counting(&uploads)).unwrap();
            let b = cache.get(&slots, counting(&uploads)).unwrap();
            assert!(Arc::ptr_eq(&a, &first));
            assert_eq!(*b, slots);
        }
        assert_eq!(uploads.get(), 2);
        // Other values are another buffer; an empty array is kept too.
        assert_eq!(
            *cache.get(&[0, 1, 2, 4], counting(&uploads)).unwrap(),
            [0, 1, 2, 4]
        );
        assert!(cache.get(&[], counting(&uploads)).unwrap().is_empty());
        assert_eq!(uploads.get(), 4);
    }

    /// The least recently used array goes first; a hit counts as a use.
    #[test]
    fn the_least_recently_used_array_is_dropped() {
        let cache = IndexCache::new(2);
        let uploads = Cell::new(0);
        cache.get(&[1], counting(&uploads)).unwrap();
        cache.get(&[2], counting(&uploads)).unwrap();
        cache.get(&[1], counting(&uploads)).unwrap(); // [1] used again
        cache.get(&[3], counting(&uploads)).unwrap(); // drops [2]
        assert_eq!(uploads.get(), 3);
        cache.get(&[1], counting(&uploads)).unwrap();
        assert_eq!(uploads.get(), 3);
        cache.get(&[2], counting(&uploads)).unwrap();
        assert_eq!(uploads.get(), 4);
    }

    /// Long arrays and a failed upload are not kept.
    #[test]
    fn long_arrays_and_failures_are_not_kept() {
        let cache = IndexCache::new(4);
        let uploads = Cell::new(0);
        let long = vec![0u32; MAX_CACHED_LEN + 1];
        cache.get(&long, counting(&uploads)).unwrap();
        cache.get(&long, counting(&uploads)).unwrap();
        assert_eq!(uploads.get(), 2);
        assert_eq!(
            cache.get(&[9], |_| Err::<Vec<u32>, _>("no device")),
            Err("no device")
        );
        cache.get(&[9], counting(&uploads)).unwrap();
        assert_eq!(uploads.get(), 3);
    }
}
