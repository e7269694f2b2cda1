//! Collectives between the trainer ranks of a data-parallel step.
//!
//! Every rank trains on its share of the batch, then the ranks sum their
//! gradients ([`Communicator::all_reduce_sum`]); every rank then holds the
//! same gradient bits and applies the same AdamW step to its own copy of the
//! weights, so the copies stay identical without a broadcast
//! (`Trainer` checks a checksum of them every few steps). Counts, losses and
//! metrics travel by [`Communicator::all_gather`].
//!
//! [`LocalComm::world`] is the in-process implementation: ranks are threads
//! of one process, each holding one [`LocalComm`]. It sums in rank order, so the
//! result does not depend on which rank arrives last. A GPU node's NCCL
//! communicator implements the same trait.

use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};

/// One rank's handle on a group of ranks that run the same collectives in
/// the same order.
pub trait Communicator: Send + Sync {
    /// This rank, `0..world_size()`.
    fn rank(&self) -> usize;
    fn world_size(&self) -> usize;
    /// Sums `buf` element-wise over the ranks, in place. Every rank gets the
    /// same bits.
    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()>;
    /// Every rank's `words`, in rank order (the same length on every rank).
    fn all_gather(&self, words: &[u64]) -> Result<Vec<Vec<u64>>>;
}

/// [`Communicator::all_gather`] of f64 values (sent as their bits).
pub fn all_gather_f64(comm: &dyn Communicator, values: &[f64]) -> Result<Vec<Vec<f64>>> {
    let words: Vec<u64> = values.iter().map(|v| v.to_bits()).collect();
    Ok(comm
        .all_gather(&words)?
        .into_iter()
        .map(|w| w.into_iter().map(f64::from_bits).collect())
        .collect())
}

/// Which collective a rank is in, to catch ranks that disagree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Sum(usize),
    Gather(usize),
}

#[derive(Default)]
struct State {
    /// Counts finished collectives: a waiting rank knows its own has
    /// completed when this moves.
    generation: u64,
    /// The collective being filled, and by how many ranks so far.
    op: Option<Op>,
    arrived: usize,
    /// Ranks still to read the last result before the next can start.
    readers: usize,
    sums: Vec<Vec<f32>>,
    words: Vec<Vec<u64>>,
    result: Vec<f32>,
    /// Set when a rank leaves (its handle dropped, say by a panic) or the
    /// ranks disagree: every waiting and later call fails with it.
    broken: Option<String>,
}

struct Shared {
    size: usize,
    state: Mutex<State>,
    cv: Condvar,
}

/// One rank of an in-process group (threads of one process). Dropping it
/// while other ranks wait in a collective fails their call instead of
/// leaving them waiting.
pub struct LocalComm {
    rank: usize,
    shared: Arc<Shared>,
}

impl LocalComm {
    /// `size` handles, rank 0 first; give each to its own thread.
    pub fn world(size: usize) -> Result<Vec<Self>> {
        if size == 0 {
            return Err(Error::Input("a world needs at least one rank".into()));
        }
        let shared = Arc::new(Shared {
            size,
            state: Mutex::new(State {
                sums: vec![Vec::new(); size],
                words: vec![Vec::new(); size],
                ..Default::default()
            }),
            cv: Condvar::new(),
        });
        Ok((0..size)
            .map(|rank| LocalComm {
                rank,
                shared: shared.clone(),
            })
            .collect())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A rank that panicked while holding the lock has already broken
        // the world (its handle's drop marks it); the state stays readable.
        self.shared.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn wait<'a>(&'a self, g: MutexGuard<'a, State>) -> MutexGuard<'a, State> {
        self.shared.cv.wait(g).unwrap_or_else(|p| p.into_inner())
    }

    fn broken(&self, why: &str) -> Error {
        Error::Collective(format!("rank {}: {why}", self.rank))
    }

    /// Runs one collective: deposit with `put`, the last rank to arrive
    /// combines with `combine`, every rank reads with `take`.
    fn collective<R>(
        &self,
        op: Op,
        put: impl FnOnce(&mut State),
        combine: impl FnOnce(&mut State),
        take: impl FnOnce(&State) -> R,
    ) -> Result<R> {
        let size = self.shared.size;
        let mut g = self.lock();
        // The previous collective's result is still being read.
        while g.readers > 0 && g.broken.is_none() {
            g = self.wait(g);
        }
        if let Some(why) = &g.broken {
            return Err(self.broken(why));
        }
        match g.op {
            Some(current) if current != op => {
                let why = format!(
                    "ranks disagree on the collective: {current:?} against rank {}'s {op:?}",
                    self.rank
                );
                g.broken = Some(why.clone());
                self.shared.cv.notify_all();
                return Err(self.broken(&why));
            }
            _ => g.op = Some(op),
        }
        put(&mut g);
        g.arrived += 1;
        let generation = g.generation;
        if g.arrived == size {
            combine(&mut g);
            g.readers = size;
            g.arrived = 0;
            g.op = None;
            g.generation += 1;
            self.shared.cv.notify_all();
        } else {
            while g.generation == generation {
                if let Some(why) = &g.broken {
                    return Err(self.broken(why));
                }
                g = self.wait(g);
            }
        }
        let out = take(&g);
        g.readers -= 1;
        if g.readers == 0 {
            self.shared.cv.notify_all();
        }
        Ok(out)
    }
}

impl Communicator for LocalComm {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.size
    }

    fn all_reduce_sum(&self, buf: &mut [f32]) -> Result<()> {
        let rank = self.rank;
        let mine = buf.to_vec();
        self.collective(
            Op::Sum(buf.len()),
            |s| s.sums[rank] = mine,
            |s| {
                // Rank order: ((r0 + r1) + r2) + ..., whoever arrived last.
                let mut acc = std::mem::take(&mut s.sums[0]);
                for part in &mut s.sums[1..] {
                    for (a, b) in acc.iter_mut().zip(part.iter()) {
                        *a += b;
                    }
                    *part = Vec::new();
                }
                s.result = acc;
            },
            |s| buf.copy_from_slice(&s.result),
        )
    }

    fn all_gather(&self, words: &[u64]) -> Result<Vec<Vec<u64>>> {
        let rank = self.rank;
        self.collective(
            Op::Gather(words.len()),
            |s| s.words[rank] = words.to_vec(),
            |_| {},
            |s| s.words.clone(),
        )
    }
}

impl Drop for LocalComm {
    fn drop(&mut self) {
        let mut g = self.lock();
        // No collective can complete without this rank any more: fail the
        // ones waiting now and any started later.
        if g.broken.is_none() {
            g.broken = Some(format!("rank {} left the world", self.rank));
        }
        self.shared.cv.notify_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run<R: Send + 'static>(
        size: usize,
        f: impl Fn(LocalComm) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let f = Arc::new(f);
        let handles: Vec<_> = LocalComm::world(size)
            .unwrap()
            .into_iter()
            .map(|c| {
                let f = f.clone();
                std::thread::spawn(move || f(c))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    #[test]
    fn all_reduce_sums_in_rank_order_on_every_rank() {
        for size in [1, 2, 4] {
            let out = run(size, |c| {
                let mut last = Vec::new();
                // Many rounds, so ranks overlap consecutive collectives.
                for round in 0..50 {
                    let mut buf: Vec<f32> = (0..7)
                        .map(|i| (c.rank() * 10 + i + round) as f32 * 0.1)
                        .collect();
                    c.all_reduce_sum(&mut buf).unwrap();
                    last = buf;
                }
                last
            });
            let want: Vec<f32> = (0..7)
                .map(|i| {
                    (0..size).fold(0.0f32, |acc, r| {
                        let x = (r * 10 + i + 49) as f32 * 0.1;
                        if r == 0 {
                            x
                        } else {
                            acc + x
                        }
                    })
                })
                .collect();
            for o in &out {
                assert_eq!(
                    o.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    want.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
                );
            }
        }
    }

    #[test]
    fn all_gather_returns_every_rank_in_order() {
        let out = run(3, |c| {
            let r = c.rank() as u64;
            let a = c.all_gather(&[r, r * r]).unwrap();
            let b = all_gather_f64(&c, &[r as f64 + 0.5]).unwrap();
            (a, b)
        });
        for (a, b) in out {
            assert_eq!(a, vec![vec![0, 0], vec![1, 1], vec![2, 4]]);
            assert_eq!(b, vec![vec![0.5], vec![1.5], vec![2.5]]);
        }
    }

    #[test]
    fn disagreeing_or_departed_ranks_fail_instead_of_hanging() {
        // Different lengths: every rank gets an error.
        let out = run(2, |c| {
            let mut buf = vec![0.0f32; 3 + c.rank()];
            c.all_reduce_sum(&mut buf).map_err(|e| e.to_string())
        });
        assert!(out.iter().all(|r| r.is_err()), "{out:?}");
        assert!(out
            .iter()
            .any(|r| r.as_ref().unwrap_err().contains("disagree")));
        // A rank that leaves (here: panics) fails the others' collective.
        let out = run(2, |c| {
            if c.rank() == 1 {
                drop(c);
                return Err("left".to_string());
            }
            let mut buf = vec![1.0f32; 4];
            c.all_reduce_sum(&mut buf).map_err(|e| e.to_string())
        });
        assert!(
            out[0].as_ref().unwrap_err().contains("left the world"),
            "{out:?}"
        );
        assert!(LocalComm::world(0).is_err());
    }
}
