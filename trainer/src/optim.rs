//! AdamW with the semantics of `torch.optim.AdamW` (single-tensor path:
//! decoupled weight decay `p *= 1 - lr * wd`, bias-corrected moments,
//! `p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps)`), global-norm clipping
//! with the semantics of `torch.nn.utils.clip_grad_norm_`, and learning-rate
//! schedules with the semantics of transformers' `get_*_schedule_with_warmup`.
//!
//! The optimizer owns fp32 master weights and both moments, in
//! `Qwen3_5::named_params` order; [`AdamW::write_to`] copies the master
//! weights into a model in place (the engine's parameter store, under its
//! write guard). Gradients are read, never written, by `step`.

use crate::grads::ModelGrads;
use crate::{Error, Result};
use arcticd_engine::Qwen3_5;
use arcticd_kernels::cpu::adamw::{adamw_update, AdamWStep};
use serde::{Deserialize, Serialize};

/// AdamW hyper-parameters (torch defaults).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct AdamWConfig {
    /// Peak learning rate. Default 1e-3 (torch's default).
    pub lr: f64,
    /// First-moment decay. Default 0.9.
    pub beta1: f64,
    /// Second-moment decay. Default 0.999.
    pub beta2: f64,
    /// Denominator epsilon. Default 1e-8.
    pub eps: f64,
    /// Decoupled weight decay, applied to every parameter as torch does with
    /// one parameter group. Default 0.01 (torch's default).
    pub weight_decay: f64,
}

impl Default for AdamWConfig {
    fn default() -> Self {
        AdamWConfig {
            lr: 1e-3,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        }
    }
}

impl AdamWConfig {
    /// Rejects hyper-parameters AdamW cannot step with (it would skip every
    /// step on non-finite updates, or blow the weights up): a finite `lr`
    /// and `weight_decay` >= 0, betas in [0, 1), a finite `eps` > 0.
    pub fn check(&self) -> Result<()> {
        let bad = |what: &str, v: f64| Err(Error::Input(format!("AdamW: {what}, got {v:?}")));
        if !(self.lr.is_finite() && self.lr >= 0.0) {
            return bad("lr must be a finite number >= 0", self.lr);
        }
        for (name, b) in [("beta1", self.beta1), ("beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return bad(&format!("{name} must be in [0, 1)"), b);
            }
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad("eps must be a finite number > 0", self.eps);
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad(
                "weight_decay must be a finite number >= 0",
                self.weight_decay,
            );
        }
        Ok(())
    }
}

/// Learning-rate schedule, as a multiplier of the peak rate per step
/// (0-based step index = number of optimizer steps taken before this one).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum LrSchedule {
    /// Always the peak rate.
    Constant,
    /// `step / warmup` for `step < warmup`, then 1
    /// (transformers' `get_constant_schedule_with_warmup`).
    LinearWarmup { warmup: u64 },
    /// Linear warmup, then half a cosine from 1 down to `floor` at `total`
    /// steps, then `floor` (transformers' `get_cosine_schedule_with_warmup`
    /// at floor 0, `get_cosine_with_min_lr_schedule_with_warmup` above it).
    Cosine {
        warmup: u64,
        total: u64,
        #[serde(default)]
        floor: f64,
    },
}

impl LrSchedule {
    pub fn factor(&self, step: u64) -> f64 {
        let warm = |w: u64| {
            if step < w {
                Some(step as f64 / w.max(1) as f64)
            } else {
                None
            }
        };
        match *self {
            LrSchedule::Constant => 1.0,
            LrSchedule::LinearWarmup { warmup } => warm(warmup).unwrap_or(1.0),
            LrSchedule::Cosine {
                warmup,
                total,
                floor,
            } => warm(warmup).unwrap_or_else(|| {
                let progress = (step - warmup) as f64 / total.saturating_sub(warmup).max(1) as f64;
                let cosine = 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos());
                floor + (1.0 - floor) * cosine.max(0.0)
            }),
        }
    }

    /// A warning when a run of `steps` steps at peak rate `lr` ends inside
    /// the warmup, so that its rate never reaches `lr`; None otherwise.
    pub fn unfinished_warmup(&self, steps: u64, lr: f64) -> Option<String> {
        let warmup = match *self {
            LrSchedule::Constant => return None,
            LrSchedule::LinearWarmup { warmup } | LrSchedule::Cosine { warmup, .. } => warmup,
        };
        (steps > 0 && warmup >= steps).then(|| {
            format!(
                "warmup {warmup} is not shorter than steps {steps}, so the learning rate never \
                 reaches lr {lr} (the last step uses {:e})",
                lr * self.factor(steps - 1)
            )
        })
    }
}

/// The factor `torch.nn.utils.clip_grad_norm_(params, max_norm)` scales
/// every gradient by at global norm `norm`: `max_norm / (norm + 1e-6)`,
/// None when that is not below 1 (no scaling).
pub fn clip_coef(norm: f64, max_norm: f64) -> Option<f32> {
    let coef = (max_norm / (norm + 1e-6)).min(1.0);
    (coef < 1.0).then_some(coef as f32)
}

/// `torch.nn.utils.clip_grad_norm_(params, max_norm)`: returns the total norm
/// before clipping and scales every gradient by [`clip_coef`].
pub fn clip_grad_norm(grads: &mut ModelGrads, max_norm: f64) -> f64 {
    let (total, _) = grads.global_norm();
    if let Some(s) = clip_coef(total, max_norm) {
        grads.scale(s);
    }
    total
}

/// AdamW state: master weights and moments per parameter.
#[derive(Debug, Clone)]
pub struct AdamW {
    pub config: AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    pub names: Vec<String>,
    pub shapes: Vec<Vec<usize>>,
    pub master: Vec<Vec<f32>>,
    pub exp_avg: Vec<Vec<f32>>,
    pub exp_avg_sq: Vec<Vec<f32>>,
}

impl AdamW {
    /// Fresh state with master weights copied from `model`.
    pub fn new(model: &Qwen3_5, config: AdamWConfig) -> Result<Self> {
        config.check()?;
        let params = model.named_params();
        let mut master = Vec::with_capacity(params.len());
        for (_, p) in &params {
            master.push(p.as_f32()?.to_vec());
        }
        let zeros: Vec<Vec<f32>> = master.iter().map(|m| vec![0.0; m.len()]).collect();
        Ok(AdamW {
            config,
            step: 0,
            names: params.iter().map(|(n, _)| n.clone()).collect(),
            shapes: params.iter().map(|(_, p)| p.shape().to_vec()).collect(),
            master,
            exp_avg: zeros.clone(),
            exp_avg_sq: zeros,
        })
    }

    /// One AdamW step at learning rate `lr` on the master weights.
    pub fn step(&mut self, grads: &ModelGrads, lr: f64) -> Result<()> {
        let named = grads.named();
        if named.len() != self.names.len() {
            return Err(Error::Shape(format!(
                "{} gradients for {} optimizer parameters",
                named.len(),
                self.names.len()
            )));
        }
        for ((gname, g), (name, p)) in named.iter().zip(self.names.iter().zip(&self.master)) {
            if gname != name || g.len() != p.len() {
                return Err(Error::Shape(format!(
                    "gradient {gname} ({}) does not match parameter {name} ({})",
                    g.len(),
                    p.len()
                )));
            }
        }
        self.step += 1;
        let c = self.config;
        let s = AdamWStep::new(lr, c.beta1, c.beta2, c.eps, c.weight_decay, self.step);
        for (i, (_, g)) in named.iter().enumerate() {
            adamw_update(
                &mut self.master[i],
                &mut self.exp_avg[i],
                &mut self.exp_avg_sq[i],
                g,
                &s,
            )?;
        }
        Ok(())
    }

    /// Copy the master weights into `model` in place.
    pub fn write_to(&self, model: &mut Qwen3_5) -> Result<()> {
        let params = model.named_params_mut();
        if params.len() != self.names.len() {
            return Err(Error::Shape(format!(
                "model has {} parameters, optimizer {}",
                params.len(),
                self.names.len()
            )));
        }
        for ((name, p), (mname, m)) in params.into_iter().zip(self.names.iter().zip(&self.master)) {
            let dst = p.as_f32_mut()?;
            if &name != mname || dst.len() != m.len() {
                return Err(Error::Shape(format!(
                    "parameter {name} does not match optimizer entry {mname}"
                )));
            }
            dst.copy_from_slice(m);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run that ends inside its warmup is warned of, with the last step's
    /// rate; one that gets past it, or has none, is not.
    #[test]
    fn a_run_shorter_than_its_warmup_is_warned_of() {
        let w = LrSchedule::LinearWarmup { warmup: 4 };
        let msg = w.unfinished_warmup(2, 0.1).unwrap();
        assert!(
            msg.contains("warmup 4 is not shorter than steps 2") && msg.contains("2.5e-2"),
            "{msg}"
        );
        assert!(w.unfinished_warmup(4, 0.1).is_some());
        assert!(w.unfinished_warmup(5, 0.1).is_none());
        let c = LrSchedule::Cosine {
            warmup: 10,
            total: 20,
            floor: 0.0,
        };
        assert!(c.unfinished_warmup(3, 1e-3).is_some());
        assert!(c.unfinished_warmup(11, 1e-3).is_none());
        assert!(LrSchedule::Constant.unfinished_warmup(1, 1e-3).is_none());
    }

    #[test]
    fn schedules() {
        assert_eq!(LrSchedule::Constant.factor(7), 1.0);
        let w = LrSchedule::LinearWarmup { warmup: 4 };
        let f: Vec<f64> = (0..6).map(|s| w.factor(s)).collect();
        assert_eq!(f, vec![0.0, 0.25, 0.5, 0.75, 1.0, 1.0]);
        let c = LrSchedule::Cosine {
            warmup: 2,
            total: 6,
            floor: 0.0,
        };
        assert_eq!(c.factor(1), 0.5);
        assert!((c.factor(2) - 1.0).abs() < 1e-12);
        assert!((c.factor(4) - 0.5).abs() < 1e-12);
        assert!(c.factor(6).abs() < 1e-12);
        assert!(c.factor(9).abs() < 1e-12);
        let f = LrSchedule::Cosine {
            warmup: 0,
            total: 4,
            floor: 0.1,
        };
        assert!((f.factor(0) - 1.0).abs() < 1e-12);
        assert!((f.factor(2) - 0.55).abs() < 1e-12);
        assert!((f.factor(4) - 0.1).abs() < 1e-12);
        assert!((f.factor(40) - 0.1).abs() < 1e-12);
    }
}
