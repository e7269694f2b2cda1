//! The task pool and its curriculum (docs/ARCHITECTURE.md, recipe step 9).
//!
//! Tasks are visited per epoch without replacement, in a seeded order. After
//! each visit (one group of attempts) a task whose every attempt over its
//! last `retire_after` visits was solved is retired as mastered; one whose
//! every attempt over its last `drop_after` visits failed is retired as
//! hopeless. Retired tasks are re-scored with frozen weights on a schedule
//! (by the loop); a mastered task whose recheck falls below a bar comes
//! back. The pool is plain data: its [`PoolState`] goes into every
//! checkpoint and a resumed run continues the same order.
//!
//! Not for: running rollouts or deciding when to recheck (the loop does).

use serde::{Deserialize, Serialize};

/// Where a task stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TaskStatus {
    Active,
    /// Solved by every attempt of its last `retire_after` visits.
    Mastered,
    /// Failed by every attempt of its last `drop_after` visits.
    Hopeless,
}

/// One task's record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TaskRecord {
    pub id: String,
    pub status: TaskStatus,
    /// Per visit: (attempts solved, attempts graded), newest last.
    pub visits: Vec<(usize, usize)>,
    /// Update at which the status last changed.
    pub changed_at: u64,
    /// Reward of the last recheck, if any.
    pub recheck_reward: Option<f64>,
}

/// The pool's whole state (saved in checkpoints).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PoolState {
    pub tasks: Vec<TaskRecord>,
    /// This epoch's order (task indices) and how far it has gone.
    pub order: Vec<usize>,
    pub cursor: usize,
    pub epoch: u64,
    /// SplitMix64 state of the shuffles.
    pub rng: u64,
}

/// The pool with its retirement settings.
#[derive(Debug, Clone)]
pub struct TaskPool {
    pub state: PoolState,
    /// 0 = never retire as mastered.
    pub retire_after: usize,
    /// 0 = never retire as hopeless.
    pub drop_after: usize,
}

fn splitmix(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl TaskPool {
    /// A fresh pool over task ids.
    pub fn new(ids: Vec<String>, seed: u64, retire_after: usize, drop_after: usize) -> Self {
        let tasks = ids
            .into_iter()
            .map(|id| TaskRecord {
                id,
                status: TaskStatus::Active,
                visits: Vec::new(),
                changed_at: 0,
                recheck_reward: None,
            })
            .collect();
        TaskPool {
            state: PoolState {
                tasks,
                order: Vec::new(),
                cursor: 0,
                epoch: 0,
                rng: seed ^ 0x005E_ED0F_7A5C,
            },
            retire_after,
            drop_after,
        }
    }

    /// Tasks not retired.
    pub fn active(&self) -> usize {
        self.state
            .tasks
            .iter()
            .filter(|t| t.status == TaskStatus::Active)
            .count()
    }

    /// Indices of retired tasks, mastered first.
    pub fn retired(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (0..self.state.tasks.len())
            .filter(|&i| self.state.tasks[i].status != TaskStatus::Active)
            .collect();
        v.sort_by_key(|&i| (self.state.tasks[i].status != TaskStatus::Mastered, i));
        v
    }

    /// Counts of (mastered, hopeless).
    pub fn retired_counts(&self) -> (usize, usize) {
        let s = &self.state.tasks;
        (
            s.iter()
                .filter(|t| t.status == TaskStatus::Mastered)
                .count(),
            s.iter()
                .filter(|t| t.status == TaskStatus::Hopeless)
                .count(),
        )
    }

    /// The next active task of this epoch (a new shuffled epoch begins when
    /// it runs out); `None` when every task is retired.
    pub fn next_task(&mut self) -> Option<usize> {
        if self.active() == 0 {
            return None;
        }
        loop {
            if self.state.cursor >= self.state.order.len() {
                self.new_epoch();
            }
            let i = self.state.order[self.state.cursor];
            self.state.cursor += 1;
            if self.state.tasks[i].status == TaskStatus::Active {
                return Some(i);
            }
        }
    }

    fn new_epoch(&mut self) {
        let n = self.state.tasks.len();
        let mut order: Vec<usize> = (0..n).collect();
        // Fisher-Yates.
        for i in (1..n).rev() {
            let j = (splitmix(&mut self.state.rng) % (i as u64 + 1)) as usize;
            order.swap(i, j);
        }
        self.state.order = order;
        self.state.cursor = 0;
        self.state.epoch += 1;
    }

    /// Records one visit's graded attempts (masked ones left out) and
    /// retires the task when its last visits say so. Returns the new status
    /// when it changed.
    pub fn record(
        &mut self,
        i: usize,
        solved: usize,
        graded: usize,
        step: u64,
    ) -> Option<TaskStatus> {
        let (retire_after, drop_after) = (self.retire_after, self.drop_after);
        let t = self.state.tasks.get_mut(i)?;
        if graded == 0 {
            return None;
        }
        t.visits.push((solved, graded));
        let keep = retire_after.max(drop_after).max(1);
        if t.visits.len() > keep {
            t.visits.drain(..t.visits.len() - keep);
        }
        if t.status != TaskStatus::Active {
            return None;
        }
        let last =
            |n: usize| (n > 0 && t.visits.len() >= n).then(|| &t.visits[t.visits.len() - n..]);
        let new = if last(retire_after).is_some_and(|v| v.iter().all(|&(s, g)| s == g)) {
            Some(TaskStatus::Mastered)
        } else if last(drop_after).is_some_and(|v| v.iter().all(|&(s, _)| s == 0)) {
            Some(TaskStatus::Hopeless)
        } else {
            None
        };
        if let Some(s) = new {
            t.status = s;
            t.changed_at = step;
        }
        new
    }

    /// Records a recheck's reward; a mastered task below `unretire_below`
    /// (or a hopeless one that now scores) comes back. Returns whether it
    /// came back.
    pub fn recheck(&mut self, i: usize, reward: f64, unretire_below: f64, step: u64) -> bool {
        let Some(t) = self.state.tasks.get_mut(i) else {
            return false;
        };
        t.recheck_reward = Some(reward);
        let back = match t.status {
            TaskStatus::Mastered => reward < unretire_below,
            TaskStatus::Hopeless => reward > 0.0,
            TaskStatus::Active => false,
        };
        if back {
            t.status = TaskStatus::Active;
            t.changed_at = step;
            t.visits.clear();
        }
        back
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pool(n: usize) -> TaskPool {
        TaskPool::new((0..n).map(|i| format!("t{i}")).collect(), 7, 2, 3)
    }

    #[test]
    fn epochs_visit_every_task_once() {
        let mut p = pool(5);
        let mut seen: Vec<usize> = (0..5).map(|_| p.next_task().unwrap()).collect();
        seen.sort();
        assert_eq!(seen, vec![0, 1, 2, 3, 4]);
        assert_eq!(p.state.epoch, 1);
        p.next_task();
        assert_eq!(p.state.epoch, 2);
        // Same seed, same order.
        let (mut a, mut b) = (pool(5), pool(5));
        let oa: Vec<_> = (0..12).map(|_| a.next_task()).collect();
        let ob: Vec<_> = (0..12).map(|_| b.next_task()).collect();
        assert_eq!(oa, ob);
    }

    #[test]
    fn retires_mastered_and_hopeless_and_rechecks() {
        let mut p = pool(3);
        assert_eq!(p.record(0, 4, 4, 1), None);
        assert_eq!(p.record(0, 4, 4, 2), Some(TaskStatus::Mastered));
        assert_eq!(p.record(1, 0, 4, 1), None);
        assert_eq!(p.record(1, 0, 4, 2), None);
        assert_eq!(p.record(1, 0, 4, 3), Some(TaskStatus::Hopeless));
        // A half-solved task stays; masked-only visits are not visits.
        assert_eq!(p.record(2, 2, 4, 1), None);
        assert_eq!(p.record(2, 0, 0, 1), None);
        assert_eq!(p.active(), 1);
        assert_eq!(p.retired(), vec![0, 1]);
        for _ in 0..5 {
            assert_eq!(p.next_task(), Some(2));
        }
        assert!(!p.recheck(0, 0.9, 0.75, 5));
        assert!(p.recheck(0, 0.5, 0.75, 6));
        assert_eq!(p.state.tasks[0].status, TaskStatus::Active);
        assert!(p.recheck(1, 0.25, 0.75, 6));
        assert_eq!(p.active(), 3);
    }

    #[test]
    fn all_retired_gives_none() {
        let mut p = TaskPool::new(vec!["a".into()], 0, 1, 0);
        p.record(0, 2, 2, 1);
        assert_eq!(p.next_task(), None);
    }
}
