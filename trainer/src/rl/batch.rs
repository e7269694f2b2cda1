//! From finished groups to one update's training batch: masking, the
//! staleness bound at consumption, group-relative advantages and the
//! counts the metrics report (docs/ARCHITECTURE.md, recipe steps 5 and 6).
//!
//! A trajectory's lag at the update that consumes it is the trainer's
//! weight version minus the oldest version among its generated tokens.
//! Over `max_staleness`: dropped whole (`stale = "drop"`) or only its
//! too-old tokens masked out of the loss (`stale = "mask"`); nothing over
//! the bound is ever trained on. Trajectories that ended in `infra` or
//! `policy_error` carry no reward signal: they are left out of their
//! group's advantage and of the loss, and counted. A group whose remaining
//! rewards are all equal contributes nothing and is counted (and, with
//! `filter_zero_variance`, left out so it does not dilute the token mean).
//! Two reward options (DAPO's overlong handling, and an ablation): a
//! trajectory cut by a token or turn budget keeps reward 0 (`overlong =
//! "zero"`) or is masked out of the loss and counted (`"mask"`);
//! `length_penalty` subtracts that much per 1,000 generated tokens from the
//! reward the advantages see (reward_mean and pass_rate stay the task's).
//!
//! Not for: running rollouts or the optimizer step.

use super::recipe::{Overlong, StalePolicy};
use crate::harness::trajectory::{Termination, Trajectory};
use crate::loss::group_advantages;
use crate::step::PgExample;
use serde::Serialize;
use std::collections::BTreeMap;

/// The G attempts of one task, as they finished.
#[derive(Debug, Clone)]
pub struct Group {
    /// Index of the task in the pool.
    pub task: usize,
    /// Sequence number of the group in dispatch order.
    pub seq: u64,
    pub trajectories: Vec<Trajectory>,
}

/// The oldest weight version among a trajectory's generated tokens (`None`
/// when it generated nothing).
pub fn oldest_version(t: &Trajectory) -> Option<u64> {
    t.loss_mask
        .iter()
        .zip(&t.weight_versions)
        .filter(|(m, _)| **m == 1)
        .map(|(_, v)| *v)
        .min()
}

/// Counts of one update's consumption.
#[derive(Debug, Clone, Default, Serialize)]
pub struct BatchStats {
    pub groups: usize,
    pub trajectories: usize,
    pub zero_variance_groups: usize,
    pub stale_dropped: usize,
    pub stale_masked_tokens: usize,
    pub masked_infra: usize,
    /// Cut by a token or turn budget and masked (`overlong = "mask"`).
    pub overlong_masked: usize,
    pub termination: BTreeMap<String, usize>,
    /// Lag of every unmasked trajectory consumed (dropped ones included).
    pub lag_histogram: BTreeMap<u64, usize>,
    /// Lag over the trajectories trained on.
    pub staleness_mean: f64,
    pub staleness_max: u64,
    /// Over unmasked trajectories (zero-variance and stale ones included).
    pub reward_mean: f64,
    pub pass_rate: f64,
    pub graded: usize,
    /// Trajectories and generated tokens trained on.
    pub trained: usize,
    pub trained_tokens: usize,
}

/// One update's batch.
#[derive(Debug, Default)]
pub struct Batch {
    pub examples: Vec<PgExample>,
    /// The trained trajectories with their advantages (for
    /// `trajectories/step-N.jsonl`).
    pub trained: Vec<(Trajectory, f32)>,
    /// Left out, with why (for `trajectories/dropped.jsonl`).
    pub dropped: Vec<(Trajectory, String)>,
    pub stats: BatchStats,
}

/// Settings of [`plan`].
#[derive(Debug, Clone, Copy)]
pub struct PlanConfig {
    pub trainer_version: u64,
    pub max_staleness: u64,
    pub stale: StalePolicy,
    pub filter_zero_variance: bool,
    pub advantage_std: bool,
    pub overlong: Overlong,
    /// Reward subtracted per 1,000 generated tokens before the advantages.
    pub length_penalty: f64,
}

/// Whether a rollout was cut by a token or turn budget.
pub fn cut_by_budget(t: &Trajectory) -> bool {
    matches!(
        t.termination,
        Termination::Truncated | Termination::TurnBudget | Termination::ContextBudget
    )
}

/// The reward the advantages see: the grade (0 for a rollout cut by a
/// budget), less `length_penalty` per 1,000 generated tokens.
fn shaped_reward(t: &Trajectory, length_penalty: f64) -> f32 {
    let base = if cut_by_budget(t) { 0.0 } else { t.reward };
    let generated = t.loss_mask.iter().filter(|&&m| m == 1).count() as f64;
    (base - length_penalty * generated / 1000.0) as f32
}

/// Builds the batch of one update from complete groups.
pub fn plan(groups: Vec<Group>, cfg: PlanConfig) -> Batch {
    let mut b = Batch::default();
    let (mut reward_sum, mut solved) = (0.0f64, 0usize);
    let mut lag_sum = 0u64;
    let oldest_allowed = cfg.trainer_version.saturating_sub(cfg.max_staleness);
    for g in groups {
        b.stats.groups += 1;
        let mut kept: Vec<(Trajectory, u64)> = Vec::new();
        for t in g.trajectories {
            b.stats.trajectories += 1;
            *b.stats
                .termination
                .entry(
                    serde_json::to_value(t.termination)
                        .ok()
                        .and_then(|v| v.as_str().map(str::to_string))
                        .unwrap_or_default(),
                )
                .or_default() += 1;
            if t.masked || t.termination.masked() {
                b.stats.masked_infra += 1;
                let why = format!("masked: {:?}: {}", t.termination, t.detail);
                b.dropped.push((t, why));
                continue;
            }
            b.stats.graded += 1;
            reward_sum += t.reward;
            solved += usize::from(t.reward >= 1.0);
            if cfg.overlong == Overlong::Mask && cut_by_budget(&t) {
                b.stats.overlong_masked += 1;
                let why = format!("overlong (masked): {:?}: {}", t.termination, t.detail);
                b.dropped.push((t, why));
                continue;
            }
            let lag = oldest_version(&t).map_or(0, |v| cfg.trainer_version.saturating_sub(v));
            *b.stats.lag_histogram.entry(lag).or_default() += 1;
            if lag > cfg.max_staleness && cfg.stale == StalePolicy::Drop {
                b.stats.stale_dropped += 1;
                let why = format!(
                    "stale: lag {lag} > max_staleness {} at version {}",
                    cfg.max_staleness, cfg.trainer_version
                );
                b.dropped.push((t, why));
                continue;
            }
            kept.push((t, lag));
        }
        let rewards: Vec<f32> = kept
            .iter()
            .map(|(t, _)| shaped_reward(t, cfg.length_penalty))
            .collect();
        let (adv, degenerate) = group_advantages(&rewards, cfg.advantage_std);
        if degenerate {
            b.stats.zero_variance_groups += 1;
            if cfg.filter_zero_variance {
                for (t, _) in kept {
                    let why = format!(
                        "zero variance: every graded attempt got reward {}",
                        t.reward
                    );
                    b.dropped.push((t, why));
                }
                continue;
            }
        }
        for ((t, _), a) in kept.into_iter().zip(adv) {
            let mut mask = t.loss_mask.clone();
            b.stats.stale_masked_tokens +=
                mask_stale(&mut mask, &t.weight_versions, oldest_allowed);
            let n_gen = mask.iter().skip(1).filter(|m| **m == 1).count();
            if n_gen == 0 {
                continue;
            }
            let lag = mask
                .iter()
                .zip(&t.weight_versions)
                .filter(|(m, _)| **m == 1)
                .map(|(_, v)| cfg.trainer_version.saturating_sub(*v))
                .max()
                .unwrap_or(0);
            lag_sum += lag;
            b.stats.staleness_max = b.stats.staleness_max.max(lag);
            b.stats.trained += 1;
            b.stats.trained_tokens += n_gen;
            b.examples.push(PgExample {
                tokens: t.token_ids.clone(),
                loss_mask: mask,
                behaviour_logprobs: t.logprobs.clone(),
                proximal_logprobs: None,
                advantage: a,
                weight_versions: t.weight_versions.clone(),
            });
            b.trained.push((t, a));
        }
    }
    if b.stats.graded > 0 {
        b.stats.reward_mean = reward_sum / b.stats.graded as f64;
        b.stats.pass_rate = solved as f64 / b.stats.graded as f64;
    }
    if b.stats.trained > 0 {
        b.stats.staleness_mean = lag_sum as f64 / b.stats.trained as f64;
    }
    b
}

/// Masks the generated tokens of versions older than `oldest_allowed`
/// (`stale = "mask"`); returns how many.
pub fn mask_stale(mask: &mut [u8], versions: &[u64], oldest_allowed: u64) -> usize {
    let mut n = 0;
    for (m, v) in mask.iter_mut().zip(versions) {
        if *m == 1 && *v < oldest_allowed {
            *m = 0;
            n += 1;
        }
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::trajectory::Termination;

    /// A trajectory: 2 prompt tokens, then generated tokens of `versions`.
    fn traj(reward: f64, versions: &[u64], term: Termination) -> Trajectory {
        let n = 2 + versions.len();
        let mut wv = vec![0, 0];
        wv.extend_from_slice(versions);
        let mut mask = vec![0u8, 0];
        mask.extend(std::iter::repeat_n(1u8, versions.len()));
        Trajectory {
            task_id: "t".into(),
            attempt: 0,
            policy: "p".into(),
            token_ids: (0..n as u32).collect(),
            loss_mask: mask,
            logprobs: vec![-0.5; n],
            weight_versions: wv,
            prompt_len: 2,
            prompt_text: String::new(),
            reward,
            termination: term,
            masked: term.masked(),
            detail: String::new(),
            turns: vec![],
            grade: None,
            diff: None,
            wall_secs: 0.0,
        }
    }

    fn cfg(v: u64, k: u64, stale: StalePolicy) -> PlanConfig {
        PlanConfig {
            trainer_version: v,
            max_staleness: k,
            stale,
            filter_zero_variance: true,
            advantage_std: false,
            overlong: Overlong::Zero,
            length_penalty: 0.0,
        }
    }

    #[test]
    fn overlong_mask_and_length_penalty() {
        let cut = traj(0.0, &[5, 5], Termination::TurnBudget);
        let groups = || {
            vec![Group {
                task: 0,
                seq: 0,
                trajectories: vec![
                    traj(1.0, &[5, 5], Termination::Submitted),
                    traj(0.0, &[5, 5, 5, 5], Termination::Submitted),
                    cut.clone(),
                ],
            }]
        };
        let b = plan(groups(), cfg(5, 2, StalePolicy::Drop));
        assert_eq!(b.stats.overlong_masked, 0);
        let adv: Vec<f32> = b.examples.iter().map(|e| e.advantage).collect();
        assert!((adv[0] - 2.0 / 3.0).abs() < 1e-6 && (adv[2] + 1.0 / 3.0).abs() < 1e-6);
        let b = plan(
            groups(),
            PlanConfig {
                overlong: Overlong::Mask,
                ..cfg(5, 2, StalePolicy::Drop)
            },
        );
        assert_eq!((b.stats.overlong_masked, b.examples.len()), (1, 2));
        assert!(b.dropped[0].1.starts_with("overlong"));
        // 1000 per 1k tokens: the 4-token failure loses 2 more than the
        // 2-token success.
        let b = plan(
            groups(),
            PlanConfig {
                overlong: Overlong::Mask,
                length_penalty: 1000.0,
                ..cfg(5, 2, StalePolicy::Drop)
            },
        );
        let adv: Vec<f32> = b.examples.iter().map(|e| e.advantage).collect();
        assert!((adv[0] - adv[1] - 3.0).abs() < 1e-5, "{adv:?}");
        assert!((b.stats.pass_rate - 1.0 / 3.0).abs() < 1e-12);
    }

    const S: Termination = Termination::Submitted;

    #[test]
    fn infra_is_masked_and_left_out_of_the_advantage() {
        let g = Group {
            task: 0,
            seq: 0,
            trajectories: vec![
                traj(1.0, &[3, 3], S),
                traj(0.0, &[3], S),
                traj(0.0, &[3], Termination::Infra),
                traj(0.0, &[], Termination::PolicyError),
            ],
        };
        let b = plan(vec![g], cfg(3, 1, StalePolicy::Drop));
        assert_eq!(b.stats.masked_infra, 2);
        assert_eq!(b.stats.graded, 2);
        assert_eq!(b.examples.len(), 2);
        // Mean of the two graded rewards only: +0.5 / -0.5.
        assert_eq!(b.examples[0].advantage, 0.5);
        assert_eq!(b.examples[1].advantage, -0.5);
        assert_eq!(b.dropped.len(), 2);
        assert_eq!(b.stats.pass_rate, 0.5);
    }

    #[test]
    fn zero_variance_groups_are_counted_and_filtered() {
        let g = |r: f64| Group {
            task: 0,
            seq: 0,
            trajectories: vec![traj(r, &[1], S), traj(r, &[1], S)],
        };
        let b = plan(vec![g(1.0), g(0.0)], cfg(1, 1, StalePolicy::Drop));
        assert_eq!(b.stats.zero_variance_groups, 2);
        assert!(b.examples.is_empty());
        assert_eq!(b.dropped.len(), 4);
        assert!(b
            .dropped
            .iter()
            .all(|(_, why)| why.starts_with("zero variance")));
        assert_eq!(b.stats.reward_mean, 0.5);
        let mut c = cfg(1, 1, StalePolicy::Drop);
        c.filter_zero_variance = false;
        let b = plan(vec![g(1.0)], c);
        assert_eq!(b.examples.len(), 2);
        assert!(b.examples.iter().all(|e| e.advantage == 0.0));
    }

    #[test]
    fn nothing_over_the_bound_is_trained_on() {
        let group = || Group {
            task: 0,
            seq: 0,
            trajectories: vec![
                traj(1.0, &[7, 8], S),
                traj(0.0, &[9, 10], S),
                traj(0.0, &[2, 10], S),
            ],
        };
        // Drop: the trajectory whose oldest token is version 2 goes.
        let b = plan(vec![group()], cfg(10, 4, StalePolicy::Drop));
        assert_eq!(b.stats.stale_dropped, 1);
        assert_eq!(b.stats.lag_histogram.get(&8), Some(&1));
        assert_eq!(b.examples.len(), 2);
        assert_eq!(b.stats.staleness_max, 3);
        assert!(b.dropped[0].1.starts_with("stale"));
        // Mask: only the old token leaves the loss.
        let b = plan(vec![group()], cfg(10, 4, StalePolicy::Mask));
        assert_eq!(b.stats.stale_dropped, 0);
        assert_eq!(b.stats.stale_masked_tokens, 1);
        assert_eq!(b.examples.len(), 3);
        for e in &b.examples {
            for (m, v) in e.loss_mask.iter().zip(&e.weight_versions) {
                assert!(*m == 0 || 10 - v <= 4);
            }
        }
        assert!(b.stats.staleness_max <= 4);
    }
}
