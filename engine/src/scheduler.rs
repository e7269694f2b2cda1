//! The scheduler: which sequences run in the next step, and how many of their
//! tokens. It owns the paged cache and the prefix cache; the engine loop owns
//! it (one task, no locks).
//!
//! Each step has a token budget (`max_batched_tokens`). Running sequences go
//! first, in arrival order: a decoding one takes one token, a prefilling one
//! its next prefill segment. Then waiting sequences are admitted while the
//! budget, the sequence limit and the cache allow (continuous batching: new
//! requests join between any two steps).
//!
//! Prefill segments never cross a multiple of `unit` tokens (the prefix
//! cache's granularity). This makes the computation of every prefilled
//! position a function of the token ids alone, not of the budget, of other
//! requests, or of where a prefix-cache hit resumed: the gated delta rule's
//! chunks, the attention kernel's query blocks and the one-token recurrent
//! path all fall at the same places in a cold run and in a resumed one, so a
//! hit is bit-for-bit a cold run. It costs one step per `unit` prompt tokens
//! per sequence, which batching across sequences hides.
//!
//! When blocks run out, the prefix cache is evicted first, then the most
//! recently arrived running sequence is preempted by recompute: its blocks
//! and state are dropped and it waits at the head of the queue to prefill
//! its prompt and generated tokens again (vLLM's recompute preemption).
//!
//! Admission keeps preemption rare. A waiting sequence is admitted only
//! when the pool holds blocks for all of its prefill, and, while others
//! run, one block more for each running sequence to grow into; its blocks
//! are taken at admission, so later admissions see what is really left.
//! A step that preempts admits nothing: the room it made is for the
//! sequences still running. Without these rules a preempted sequence came
//! straight back on its first segment's blocks and was preempted again,
//! recomputing its whole length each time.

use crate::block_pool::BlockId;
use crate::kv_cache::{PagedKvCache, SlotId};
use crate::prefix_cache::{chain_key, PrefixCache, PrefixKey};
use crate::sampler::Sampler;
use std::collections::VecDeque;

/// One sequence (one choice of a request) as the scheduler tracks it.
#[derive(Debug)]
pub struct Sequence {
    /// Request id, and which of its `n` choices this is.
    pub request: u64,
    pub index: usize,
    /// Prompt then generated tokens.
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Positions whose K/V and state are in the cache.
    pub computed: usize,
    /// Positions below this are computed by prefill segments (the prompt,
    /// or everything after a preemption or weight update).
    pub prefill_target: usize,
    pub block_table: Vec<BlockId>,
    pub slot: Option<SlotId>,
    /// Prefix keys of the units computed so far.
    pub prefix_keys: Vec<PrefixKey>,
    pub sampler: Sampler,
    /// Tokens generated so far.
    pub generated: usize,
    /// Times this sequence was preempted (its prompt was admitted once).
    pub preempted: u32,
    /// The request's other choices (index, sampler), forked from this
    /// sequence once its prompt is in the cache, so `n` choices prefill
    /// their shared prompt once.
    pub forks: Vec<(usize, Sampler)>,
}

impl Sequence {
    pub fn new(request: u64, index: usize, prompt: Vec<u32>, sampler: Sampler) -> Self {
        let prompt_len = prompt.len();
        Sequence {
            request,
            index,
            tokens: prompt,
            prompt_len,
            computed: 0,
            prefill_target: prompt_len,
            block_table: Vec::new(),
            slot: None,
            prefix_keys: Vec::new(),
            sampler,
            generated: 0,
            preempted: 0,
            forks: Vec::new(),
        }
    }

    fn prefilling(&self) -> bool {
        self.computed < self.prefill_target
    }

    /// Tokens of the next forward for this sequence (starting at
    /// `computed`): its next prefill segment, or the one new token.
    fn next_len(&self, unit: usize) -> usize {
        if self.prefilling() {
            let boundary = (self.computed / unit + 1) * unit;
            boundary.min(self.prefill_target) - self.computed
        } else {
            self.tokens.len() - self.computed
        }
    }
}

/// A planned forward for `running[seq]`: `n` tokens from `computed`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scheduled {
    pub seq: usize,
    pub n: usize,
}

/// Limits the scheduler enforces.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub max_num_seqs: usize,
    pub max_batched_tokens: usize,
    /// Prefill segment alignment and prefix-cache unit.
    pub unit: usize,
}

/// Waiting and running sequences over one paged cache.
#[derive(Debug)]
pub struct Scheduler {
    pub cache: PagedKvCache,
    pub prefix: Option<PrefixCache>,
    pub waiting: VecDeque<Sequence>,
    pub running: Vec<Sequence>,
    pub limits: Limits,
    /// Sequences preempted so far.
    pub preemptions: u64,
    /// Prompt tokens admitted (once per sequence) and the part of them
    /// served by the prefix cache.
    pub prompt_tokens: u64,
    pub prefix_hit_tokens: u64,
    /// Tokens prefilled again when preempted sequences came back (less what
    /// the prefix cache served): what preemption cost.
    pub recomputed_tokens: u64,
}

impl Scheduler {
    pub fn new(cache: PagedKvCache, limits: Limits, prefix_cache: bool) -> Self {
        Scheduler {
            prefix: prefix_cache.then(|| PrefixCache::new(limits.unit)),
            cache,
            waiting: VecDeque::new(),
            running: Vec::new(),
            limits,
            preemptions: 0,
            prompt_tokens: 0,
            prefix_hit_tokens: 0,
            recomputed_tokens: 0,
        }
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    pub fn add(&mut self, seq: Sequence) {
        self.waiting.push_back(seq);
    }

    /// Plan the next step. Indices refer to `running` after the call.
    pub fn schedule(&mut self) -> Vec<Scheduled> {
        let unit = self.limits.unit;
        let mut budget = self.limits.max_batched_tokens;
        let preempted_before = self.preemptions;
        let mut plan = Vec::new();
        let mut i = 0;
        while i < self.running.len() {
            let n = self.running[i].next_len(unit);
            if n > budget {
                i += 1;
                continue;
            }
            let upto = self.running[i].computed + n;
            let mut preempted_self = false;
            while !self.grow(i, upto) {
                let last = self.running.len() - 1;
                if last > i {
                    self.preempt(last);
                } else {
                    self.preempt(i);
                    preempted_self = true;
                    break;
                }
            }
            if preempted_self {
                return plan;
            }
            plan.push(Scheduled { seq: i, n });
            budget -= n;
            i += 1;
        }
        if self.preemptions > preempted_before {
            return plan;
        }
        while budget > 0 && self.running.len() < self.limits.max_num_seqs {
            let Some(n) = self.admit_front(budget) else {
                break;
            };
            plan.push(Scheduled {
                seq: self.running.len() - 1,
                n,
            });
            budget -= n;
        }
        plan
    }

    /// Give `running[i]` blocks for `upto` positions, evicting the prefix
    /// cache if needed. False when the pool cannot provide them.
    fn grow(&mut self, i: usize, upto: usize) -> bool {
        let need = self
            .cache
            .blocks_for(upto)
            .saturating_sub(self.running[i].block_table.len());
        if need == 0 {
            return true;
        }
        if self.cache.pool().num_free() < need {
            let ok = match &mut self.prefix {
                Some(p) => p.evict_for_blocks(&mut self.cache, need),
                None => false,
            };
            if !ok {
                return false;
            }
        }
        for _ in 0..need {
            match self.cache.pool_mut().allocate() {
                Some(b) => self.running[i].block_table.push(b),
                None => return false,
            }
        }
        true
    }

    /// Move the head of `waiting` to `running` if it fits; returns the
    /// length of its first segment.
    fn admit_front(&mut self, budget: usize) -> Option<usize> {
        let unit = self.limits.unit;
        let seq = self.waiting.front_mut()?;
        let target = seq.prefill_target;
        let hit = match &mut self.prefix {
            Some(p) if target > 1 => p.lookup(&seq.tokens[..target], target - 1),
            _ => None,
        };
        let start = hit.as_ref().map_or(0, |h| h.len);
        let first = ((start / unit + 1) * unit).min(target) - start;
        let hit_blocks = hit.as_ref().map_or(0, |h| h.blocks.len());
        let keys: Vec<PrefixKey> = hit.as_ref().map_or(Vec::new(), |h| h.keys.clone());
        // All of the prefill's blocks, and room for the running sequences
        // (this one included) to grow by a block each. Alone, a sequence
        // always fits: no request is longer than the pool.
        let need = self.cache.blocks_for(target);
        let reserve = if self.running.is_empty() {
            0
        } else {
            self.running.len() + 1
        };
        let want = need - hit_blocks + reserve;
        let free = self.cache.pool().num_free();
        let releasable = match &self.prefix {
            Some(p) if free < want => p.releasable_blocks(self.cache.pool(), &keys),
            _ => 0,
        };
        // Nothing is evicted unless the sequence then fits: its blocks, and
        // a state slot, which an unprotected snapshot may have to give up
        // (the hit's own are kept, so the hit stays valid).
        if first > budget || free + releasable < want {
            return None;
        }
        let slot = loop {
            if let Some(s) = self.cache.allocate_slot() {
                break s;
            }
            let Some(p) = &mut self.prefix else {
                return None;
            };
            if p.evict_one(&mut self.cache, &keys) {
                continue;
            }
            // Every snapshot that could give up its slot is the hit's own:
            // give one up and look again (a shorter hit, or none).
            if !keys.is_empty() && p.evict_one(&mut self.cache, &[]) {
                return self.admit_front(budget);
            }
            return None;
        };
        if let Some(p) = &mut self.prefix {
            while self.cache.pool().num_free() < want && p.evict_one(&mut self.cache, &keys) {}
        }
        if self.cache.pool().num_free() < want {
            self.cache.free_slot(slot);
            return None;
        }
        let Some(mut seq) = self.waiting.pop_front() else {
            self.cache.free_slot(slot);
            return None;
        };
        if let Some(h) = &hit {
            for &b in &h.blocks {
                self.cache.pool_mut().share(b);
            }
            seq.block_table.extend_from_slice(&h.blocks);
            self.cache.copy_slot(h.slot, slot);
        }
        for _ in hit_blocks..need {
            // Checked above: the pool has these blocks free.
            if let Some(b) = self.cache.pool_mut().allocate() {
                seq.block_table.push(b);
            }
        }
        seq.slot = Some(slot);
        seq.computed = start;
        seq.prefix_keys = keys;
        if seq.preempted == 0 {
            self.prompt_tokens += target as u64;
            self.prefix_hit_tokens += start as u64;
        } else {
            self.recomputed_tokens += (target - start) as u64;
        }
        self.running.push(seq);
        Some(first)
    }

    /// Fork the pending choices of `running[i]`, whose prompt is all in the
    /// cache: each child shares the parent's full blocks, gets a copy of its
    /// last partial block (copy-on-write, done eagerly) and of its state, and
    /// is appended to `running`. Returns the children's indices. A child
    /// that does not fit (sequence limit, slots, blocks) waits instead and
    /// prefills on its own (the prefix cache still helps).
    pub fn fork(&mut self, i: usize) -> Vec<usize> {
        let forks = std::mem::take(&mut self.running[i].forks);
        let bs = self.cache.block_size();
        let mut out = Vec::new();
        for (index, sampler) in forks {
            let parent = &self.running[i];
            let mut child = Sequence::new(parent.request, index, parent.tokens.clone(), sampler);
            child.prompt_len = parent.prompt_len;
            child.prefill_target = parent.prefill_target;
            let (computed, partial) = (parent.computed, !parent.computed.is_multiple_of(bs));
            let fits = self.running.len() < self.limits.max_num_seqs
                && self.make_room(1, usize::from(partial));
            let slot = if fits {
                self.cache.allocate_slot()
            } else {
                None
            };
            let (Some(slot), Some(parent_slot)) = (slot, self.running[i].slot) else {
                if let Some(s) = slot {
                    self.cache.free_slot(s);
                }
                self.waiting.push_front(child);
                continue;
            };
            let parent = &self.running[i];
            let full = computed / bs;
            let mut table = parent.block_table[..full].to_vec();
            let src = parent.block_table.get(full).copied();
            child.prefix_keys = parent.prefix_keys.clone();
            for &b in &table {
                self.cache.pool_mut().share(b);
            }
            if let (true, Some(src)) = (partial, src) {
                // make_room left a block free.
                if let Some(dst) = self.cache.pool_mut().allocate() {
                    self.cache.copy_block(src, dst, computed % bs);
                    table.push(dst);
                }
            }
            self.cache.copy_slot(parent_slot, slot);
            child.block_table = table;
            child.slot = Some(slot);
            child.computed = computed;
            self.running.push(child);
            out.push(self.running.len() - 1);
        }
        out
    }

    /// Evict prefix-cache entries until `slots` state slots and `blocks`
    /// blocks are free. False when that is not possible.
    fn make_room(&mut self, slots: usize, blocks: usize) -> bool {
        loop {
            if self.cache.num_free_slots() >= slots && self.cache.pool().num_free() >= blocks {
                return true;
            }
            let evicted = match &mut self.prefix {
                Some(p) => p.evict_one(&mut self.cache, &[]),
                None => false,
            };
            if !evicted {
                return false;
            }
        }
    }

    /// Drop a sequence's cache and return it to the head of the queue.
    fn preempt(&mut self, i: usize) {
        let mut seq = self.running.remove(i);
        self.release(&mut seq);
        seq.prefill_target = seq.tokens.len();
        seq.preempted += 1;
        self.preemptions += 1;
        self.waiting.push_front(seq);
    }

    /// Give back a sequence's blocks and slot.
    pub fn release(&mut self, seq: &mut Sequence) {
        for b in seq.block_table.drain(..) {
            self.cache.pool_mut().release(b);
        }
        if let Some(s) = seq.slot.take() {
            self.cache.free_slot(s);
        }
        seq.computed = 0;
        seq.prefix_keys.clear();
    }

    /// Remove `running[i]`, releasing its cache.
    pub fn finish(&mut self, i: usize) -> Sequence {
        let mut seq = self.running.remove(i);
        self.release(&mut seq);
        seq
    }

    /// Remove every sequence of `request` from both queues.
    pub fn abort_request(&mut self, request: u64) -> usize {
        let mut n = 0;
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].request == request {
                self.finish(i);
                n += 1;
            } else {
                i += 1;
            }
        }
        let before = self.waiting.len();
        self.waiting.retain(|s| s.request != request);
        n + before - self.waiting.len()
    }

    /// Account for a finished forward: advance `computed`, and cache every
    /// prefill unit that just completed.
    pub fn after_step(&mut self, plan: &[Scheduled]) {
        let unit = self.limits.unit;
        for item in plan {
            let seq = &mut self.running[item.seq];
            let was_prefill = seq.prefilling();
            seq.computed += item.n;
            let Some(prefix) = &mut self.prefix else {
                continue;
            };
            if !was_prefill
                || !seq.computed.is_multiple_of(unit)
                || seq.computed > seq.prefill_target
            {
                continue;
            }
            let k = seq.computed / unit - 1;
            if seq.prefix_keys.len() != k {
                continue;
            }
            let Some(slot) = seq.slot else {
                continue;
            };
            let parent = seq.prefix_keys.last().copied();
            let unit_tokens = &seq.tokens[k * unit..(k + 1) * unit];
            let key = chain_key(parent, unit_tokens);
            let bs = self.cache.block_size();
            let blocks = &seq.block_table[k * unit / bs..(k + 1) * unit / bs];
            prefix.insert(
                &mut self.cache,
                parent,
                key,
                k + 1,
                unit_tokens,
                blocks,
                slot,
                &seq.prefix_keys,
            );
            seq.prefix_keys.push(key);
        }
    }

    /// New weights: every cached state is stale. Drop the prefix cache and
    /// make every running sequence recompute all of its tokens before it
    /// samples again.
    /// Forget cached prefixes (computed by weights that are gone) and keep
    /// every running sequence's caches: the `rebuild_caches = false`
    /// ablation.
    pub fn drop_prefix_cache(&mut self) {
        if let Some(p) = &mut self.prefix {
            p.clear(&mut self.cache);
        }
    }

    pub fn reset_for_new_weights(&mut self) {
        if let Some(p) = &mut self.prefix {
            p.clear(&mut self.cache);
        }
        let mut running = std::mem::take(&mut self.running);
        for seq in running.iter_mut() {
            for b in seq.block_table.drain(..) {
                self.cache.pool_mut().release(b);
            }
            if let Some(s) = seq.slot.take() {
                self.cache.free_slot(s);
                seq.slot = self.cache.allocate_slot();
            }
            seq.computed = 0;
            seq.prefix_keys.clear();
            seq.prefill_target = seq.tokens.len();
        }
        self.running = running;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_cache::CacheLayout;
    use crate::sampler::SamplingParams;

    fn scheduler(num_blocks: usize, prefix: bool) -> Scheduler {
        scheduler_with(num_blocks, 4, prefix)
    }

    fn scheduler_with(num_blocks: usize, max_num_seqs: usize, prefix: bool) -> Scheduler {
        let layout = CacheLayout {
            num_layers: 2,
            attn_layers: vec![1],
            linear_layers: vec![0],
            kv_row: 1,
            conv_len: 1,
            rec_len: 1,
        };
        let limits = Limits {
            max_num_seqs,
            max_batched_tokens: 40,
            unit: 8,
        };
        // Slots: one per running sequence plus three snapshots.
        let cache = PagedKvCache::new(layout, 4, num_blocks, max_num_seqs + 3);
        Scheduler::new(cache, limits, prefix)
    }

    /// Run every sequence to `gen` tokens without a model: the scheduler's
    /// bookkeeping only. Returns the number of steps.
    fn drive(s: &mut Scheduler, gen: usize) -> usize {
        let mut steps = 0;
        while !s.is_idle() {
            steps += 1;
            assert!(steps < 10_000, "no progress");
            step(s, gen);
        }
        steps
    }

    /// One step of [`drive`].
    fn step(s: &mut Scheduler, gen: usize) {
        let admitted = |s: &Scheduler| s.prompt_tokens + s.recomputed_tokens;
        let (preempted, before) = (s.preemptions, admitted(s));
        let plan = s.schedule();
        // A step that preempts admits nothing: the room it made is for
        // the sequences still running (else the preempted one comes
        // straight back and is preempted again).
        if s.preemptions > preempted {
            assert_eq!(admitted(s), before, "admitted in a step that preempted");
        }
        for item in &plan {
            let seq = &s.running[item.seq];
            // Blocks cover what the step writes; segments respect units.
            assert!(seq.block_table.len() * 4 >= seq.computed + item.n);
            if seq.computed < seq.prefill_target {
                assert!(seq.computed / 8 == (seq.computed + item.n - 1) / 8);
            }
        }
        s.after_step(&plan);
        let mut sampled: Vec<usize> = Vec::new();
        for item in &plan {
            if s.running[item.seq].computed == s.running[item.seq].tokens.len() {
                sampled.push(item.seq);
                if !s.running[item.seq].forks.is_empty() {
                    sampled.extend(s.fork(item.seq));
                }
            }
        }
        let mut done = Vec::new();
        for i in sampled {
            let seq = &mut s.running[i];
            if seq.computed == seq.tokens.len() {
                seq.tokens.push(1);
                seq.generated += 1;
                if seq.generated >= gen {
                    done.push(i);
                }
            }
        }
        done.sort_unstable_by(|a, b| b.cmp(a));
        for i in done {
            s.finish(i);
        }
    }

    fn add(s: &mut Scheduler, id: u64, prompt: Vec<u32>) {
        let sampler = Sampler::new(&SamplingParams::greedy(1), 0);
        s.add(Sequence::new(id, 0, prompt, sampler));
    }

    #[test]
    fn forked_choices_share_blocks_and_release_them() {
        // Roomy, then tight enough that some children must wait and prefill.
        for blocks in [64, 14] {
            let mut s = scheduler(blocks, true);
            for id in 0..2 {
                let sampler = Sampler::new(&SamplingParams::greedy(1), 0);
                let mut seq = Sequence::new(id, 0, (0..18).collect(), sampler);
                seq.forks = (1..4)
                    .map(|i| (i, Sampler::new(&SamplingParams::greedy(1), i)))
                    .collect();
                s.add(seq);
            }
            drive(&mut s, 6);
            check_nothing_leaked(&s);
        }
    }

    fn check_nothing_leaked(s: &Scheduler) {
        let entries = s.prefix.as_ref().map_or(0, |p| p.len());
        assert_eq!(s.cache.num_free_slots() + entries, s.cache.num_slots());
        // Each prefix entry holds the two blocks of its unit.
        assert_eq!(s.cache.pool().num_used(), 2 * entries);
    }

    #[test]
    fn bookkeeping_balances_with_prefix_hits() {
        let mut s = scheduler(64, true);
        let shared: Vec<u32> = (0..20).collect();
        for id in 0..6 {
            let mut p = shared.clone();
            p.extend([100 + id as u32, 7]);
            add(&mut s, id, p);
        }
        drive(&mut s, 5);
        check_nothing_leaked(&s);
        // The same prompt again resumes from the cache.
        add(&mut s, 9, shared.clone());
        drive(&mut s, 3);
        assert!(s.prefix_hit_tokens >= 16, "{}", s.prefix_hit_tokens);
        check_nothing_leaked(&s);
    }

    #[test]
    fn preemption_under_block_pressure_finishes_everything() {
        // 12 blocks of 4 positions: four sequences of up to 30 cannot all fit.
        let mut s = scheduler(12, false);
        for id in 0..6 {
            add(&mut s, id, (0..10 + id as u32).collect());
        }
        drive(&mut s, 20);
        assert!(s.preemptions > 0);
        check_nothing_leaked(&s);
    }

    #[test]
    fn a_tight_pool_preempts_rarely_and_recomputes_little() {
        // 16 sequences of 20 prompt and 40 generated positions (15 blocks
        // each at full length) over 40 blocks of 4: under three fit whole,
        // though eight may run.
        let mut s = scheduler_with(40, 8, false);
        let prompts: usize = 16 * 20;
        for id in 0..16u32 {
            add(&mut s, id.into(), (0..20).map(|t| t + 100 * id).collect());
        }
        drive(&mut s, 40);
        assert_eq!(
            s.prompt_tokens as usize, prompts,
            "each prompt counted once"
        );
        let recomputed = s.recomputed_tokens as usize;
        eprintln!(
            "preemptions {}, tokens recomputed {recomputed} (prompts {prompts})",
            s.preemptions
        );
        // Each preemption recomputes what the sequence held; admitting only
        // what fits whole keeps that to about one preemption per sequence.
        assert!(s.preemptions <= 16, "{} preemptions", s.preemptions);
        assert!(recomputed <= 16 * 60, "{recomputed} tokens recomputed");
        check_nothing_leaked(&s);
    }

    /// Fill every state slot: one long sequence running, the rest cached
    /// prefixes of other prompts.
    fn slots_full_of_snapshots() -> Scheduler {
        let mut s = scheduler_with(40, 2, true);
        for id in 0..6u32 {
            add(&mut s, id.into(), (0..17).map(|t| t + 1000 * id).collect());
        }
        drive(&mut s, 2);
        add(&mut s, 99, (0..60).map(|t| t + 50_000).collect());
        while s.running.first().is_none_or(|q| q.computed < 60) {
            step(&mut s, 1000);
        }
        assert_eq!(s.cache.num_free_slots(), 0, "the slots are full");
        s
    }

    #[test]
    fn an_admission_that_cannot_fit_evicts_no_cached_prefix() {
        let mut s = slots_full_of_snapshots();
        let cached = s.prefix.as_ref().map_or(0, |p| p.len());
        assert!(cached > 0);
        // 26 blocks of prompt: more than the pool has free with every
        // unprotected snapshot given up.
        add(&mut s, 100, (0..104).map(|t| t + 70_000).collect());
        for _ in 0..3 {
            step(&mut s, 1000);
            assert_eq!(s.running.len(), 1, "it does not fit");
            assert_eq!(s.prefix.as_ref().map_or(0, |p| p.len()), cached);
        }
    }

    #[test]
    fn a_hit_whose_snapshots_hold_every_free_slot_is_still_admitted() {
        let mut s = scheduler_with(40, 2, true);
        // One prompt's units fill the snapshot slots...
        let prompt: Vec<u32> = (0..41).collect();
        add(&mut s, 1, prompt.clone());
        drive(&mut s, 2);
        // ...another sequence takes the last slot...
        add(&mut s, 2, vec![7, 7, 7, 7, 7]);
        step(&mut s, 30);
        assert_eq!(s.cache.num_free_slots(), 0, "the slots are full");
        let protected = s.prefix.as_ref().map_or(0, |p| p.len());
        // ...and the first prompt comes back: it must get a slot, from a
        // snapshot of its own hit.
        add(&mut s, 3, prompt);
        for _ in 0..3 {
            step(&mut s, 30);
        }
        assert!(s.running.iter().any(|q| q.request == 3), "admitted");
        assert!(s.prefix_hit_tokens > 0);
        assert!(s.prefix.as_ref().map_or(0, |p| p.len()) < protected);
        drive(&mut s, 30);
        check_nothing_leaked(&s);
    }
}
