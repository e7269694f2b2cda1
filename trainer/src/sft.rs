//! SFT on trajectories: the shared second half of the warm start and of
//! rejection fine-tuning. [`sft_examples`] turns solved trajectories into
//! examples (the model's own tokens as targets, prompt and environment
//! tokens as context only); [`train_sft`] runs AdamW with warmup, cosine
//! decay and clipping over them in a seeded, reshuffled order and writes
//! the checkpoint.
//!
//! Not for: `arcticd sft`'s file-order semantics checked against PyTorch
//! (src/cli_train.rs keeps those).

use crate::checkpoint::save_checkpoint;
use crate::harness::Trajectory;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::step::{SftExample, TrainConfig, Trainer};
use crate::{Error, Result};
use arcticd_engine::{ParamStore, Qwen3_5};
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

/// The settings of one [`train_sft`] run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftSettings {
    /// Optimizer steps.
    pub steps: usize,
    /// Trajectories per step.
    pub batch_size: usize,
    /// Peak learning rate (cosine to 0 after the warmup).
    pub lr: f64,
    /// Linear warmup steps.
    pub warmup: u64,
    /// Global gradient-norm clip; 0 = off.
    pub grad_clip: f64,
    /// AdamW decoupled weight decay.
    pub weight_decay: f64,
    /// Seed of the order the trajectories are visited in.
    pub shuffle_seed: u64,
}

impl Default for SftSettings {
    fn default() -> Self {
        SftSettings {
            steps: 100,
            batch_size: 8,
            lr: 1e-3,
            warmup: 10,
            grad_clip: 1.0,
            weight_decay: 0.0,
            shuffle_seed: 0,
        }
    }
}

impl SftSettings {
    /// The trainer's settings: AdamW at `lr`, warmup then cosine to 0 at
    /// `steps`, the clip (0: none).
    fn train_config(&self) -> TrainConfig {
        TrainConfig {
            optimizer: AdamWConfig {
                lr: self.lr,
                weight_decay: self.weight_decay,
                ..AdamWConfig::default()
            },
            schedule: LrSchedule::Cosine {
                warmup: self.warmup,
                total: self.steps as u64,
                floor: 0.0,
            },
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            ..TrainConfig::default()
        }
    }

    /// Rejects settings no SFT run can use: checked where they arrive (the
    /// command line, before any sampling or image build), and again here.
    pub fn check(&self) -> Result<()> {
        if self.steps == 0 || self.batch_size == 0 {
            return Err(Error::Input(format!(
                "SFT needs at least 1 step and 1 trajectory per step, got steps {} and \
                 batch_size {}",
                self.steps, self.batch_size
            )));
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return Err(Error::Input(format!(
                "SFT grad_clip must be a finite number >= 0 (0: off), got {}",
                self.grad_clip
            )));
        }
        self.train_config().optimizer.check()
    }
}

/// SFT examples of the trajectories that earned reward 1: every token as
/// context, the generated ones (loss mask 1) as targets.
pub fn sft_examples(trajectories: &[Trajectory]) -> Vec<SftExample> {
    trajectories
        .iter()
        .filter(|t| t.reward >= 1.0)
        .map(|t| SftExample {
            tokens: t.token_ids.clone(),
            loss_mask: t.loss_mask.clone(),
        })
        .collect()
}

/// Told after every SFT step: (steps done, steps in all, loss).
pub type SftProgress = Arc<dyn Fn(usize, usize, f64) + Send + Sync>;

/// SFT of the model in `base` on `examples` per `cfg` (steps, batch, lr,
/// warmup then cosine, clip, weight decay, visiting order); writes the
/// checkpoint (with optimizer state) to `out`. Returns the per-step losses.
pub fn train_sft(
    cfg: &SftSettings,
    base: &Path,
    examples: &[SftExample],
    out: &Path,
    progress: Option<&SftProgress>,
) -> Result<Vec<f64>> {
    if examples.is_empty() {
        return Err(Error::Input("no SFT examples".into()));
    }
    cfg.check()?;
    crate::checkpoint::check_checkpoint_out(out)?;
    let model = Qwen3_5::load(base)?;
    let mut trainer = Trainer::new(ParamStore::new(model), cfg.train_config())?;
    // A seeded order, reshuffled every pass over the data.
    let mut rng = cfg.shuffle_seed ^ 0x57A2_7E11;
    let mut next = || {
        rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut order: Vec<usize> = Vec::new();
    let mut losses = Vec::with_capacity(cfg.steps);
    let t0 = Instant::now();
    for step in 0..cfg.steps {
        let mut batch = Vec::with_capacity(cfg.batch_size);
        while batch.len() < cfg.batch_size {
            if order.is_empty() {
                order = (0..examples.len()).collect();
                for i in (1..order.len()).rev() {
                    order.swap(i, (next() % (i as u64 + 1)) as usize);
                }
            }
            if let Some(i) = order.pop() {
                batch.push(examples[i].clone());
            }
        }
        let m = trainer.sft_step(&batch)?;
        losses.push(m.loss);
        if let Some(p) = progress {
            p(step + 1, cfg.steps, m.loss);
        }
        tracing::info!(
            step = step + 1,
            steps = cfg.steps,
            loss = m.loss,
            grad_norm = m.grad_norm,
            lr = m.lr,
            secs = t0.elapsed().as_secs_f64(),
            "SFT step"
        );
    }
    trainer.sync_host()?;
    let model = trainer.store().read();
    save_checkpoint(out, &model, base, Some(&*trainer.optimizer()?))?;
    Ok(losses)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::warm_start::WarmStartConfig;

    #[test]
    fn settings_reject_unknown_keys_and_keep_the_owners_defaults() {
        assert!(serde_json::from_str::<SftSettings>(r#"{"stepz": 1}"#).is_err());
        let s: SftSettings = serde_json::from_str(r#"{"steps": 7}"#).unwrap();
        assert_eq!(s.steps, 7);
        // A config that leaves `sft` out keeps its owner's SFT defaults,
        // not SftSettings' own.
        let w: WarmStartConfig = serde_json::from_str(r#"{"demos": 3}"#).unwrap();
        assert_eq!(
            (w.sft.clone(), w.demos),
            (WarmStartConfig::default().sft, 3)
        );
        let w: WarmStartConfig = serde_json::from_str(r#"{"sft": {"steps": 7}}"#).unwrap();
        assert_eq!(w.sft.steps, 7);
        assert!(serde_json::from_str::<WarmStartConfig>(r#"{"sft": {"stepz": 7}}"#).is_err());
    }
}
