//! The AdamW update of one parameter tensor (torch.optim.AdamW's
//! single-tensor path, decoupled weight decay), the element-wise core that
//! the trainer's optimizer and the CUDA kernel both follow.
//!
//! The step's scalars are computed once, in f64, by [`AdamWStep::new`]; the
//! update itself is f32 and in this order: decay the weight, update the
//! moments, then `p -= step_size * m / (sqrt(v) / sqrt(bc2) + eps)`.

use crate::{Error, Result};

/// The scalars of one AdamW step, from the hyper-parameters, the learning
/// rate of this step and the 1-based step number.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWStep {
    /// `1 - lr * weight_decay`.
    pub decay: f32,
    /// `lr / (1 - beta1^step)`.
    pub step_size: f32,
    /// `1 - beta1`.
    pub b1w: f32,
    pub beta2: f32,
    /// `1 - beta2`.
    pub b2w: f32,
    /// `sqrt(1 - beta2^step)`.
    pub bc2_sqrt: f32,
    pub eps: f32,
}

impl AdamWStep {
    pub fn new(lr: f64, beta1: f64, beta2: f64, eps: f64, weight_decay: f64, step: u64) -> Self {
        let bc1 = 1.0 - beta1.powi(step as i32);
        let bc2_sqrt = (1.0 - beta2.powi(step as i32)).sqrt();
        AdamWStep {
            decay: (1.0 - lr * weight_decay) as f32,
            step_size: (lr / bc1) as f32,
            b1w: (1.0 - beta1) as f32,
            beta2: beta2 as f32,
            b2w: (1.0 - beta2) as f32,
            bc2_sqrt: bc2_sqrt as f32,
            eps: eps as f32,
        }
    }
}

/// One step on `param` with its moments `exp_avg`, `exp_avg_sq` and
/// gradient `grad`, all in place.
pub fn adamw_update(
    param: &mut [f32],
    exp_avg: &mut [f32],
    exp_avg_sq: &mut [f32],
    grad: &[f32],
    s: &AdamWStep,
) -> Result<()> {
    let n = param.len();
    if exp_avg.len() != n || exp_avg_sq.len() != n || grad.len() != n {
        return Err(Error::Shape(format!(
            "adamw_update: param {n} exp_avg {} exp_avg_sq {} grad {}",
            exp_avg.len(),
            exp_avg_sq.len(),
            grad.len()
        )));
    }
    for j in 0..n {
        param[j] *= s.decay;
        exp_avg[j] += s.b1w * (grad[j] - exp_avg[j]);
        exp_avg_sq[j] = exp_avg_sq[j] * s.beta2 + s.b2w * grad[j] * grad[j];
        let denom = exp_avg_sq[j].sqrt() / s.bc2_sqrt + s.eps;
        param[j] -= s.step_size * (exp_avg[j] / denom);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two steps against the update written out in f64 (torch's formula).
    #[test]
    fn two_steps_follow_the_torch_formula() {
        let (lr, b1, b2, eps, wd) = (1e-2, 0.9, 0.999, 1e-8, 0.1);
        let mut p = vec![0.5f32, -1.0, 2.0];
        let (mut m, mut v) = (vec![0.0f32; 3], vec![0.0f32; 3]);
        let grads = [[0.1f32, -0.2, 0.0], [0.3, 0.1, -0.5]];
        let mut want: Vec<f64> = p.iter().map(|&x| x as f64).collect();
        let (mut mw, mut vw) = (vec![0.0f64; 3], vec![0.0f64; 3]);
        for (k, g) in grads.iter().enumerate() {
            let step = k as u64 + 1;
            adamw_update(
                &mut p,
                &mut m,
                &mut v,
                g,
                &AdamWStep::new(lr, b1, b2, eps, wd, step),
            )
            .unwrap();
            for j in 0..3 {
                let gj = g[j] as f64;
                want[j] *= 1.0 - lr * wd;
                mw[j] = b1 * mw[j] + (1.0 - b1) * gj;
                vw[j] = b2 * vw[j] + (1.0 - b2) * gj * gj;
                let mhat = mw[j] / (1.0 - b1.powi(step as i32));
                let vhat = vw[j] / (1.0 - b2.powi(step as i32));
                want[j] -= lr * mhat / (vhat.sqrt() + eps);
            }
        }
        for j in 0..3 {
            assert!(
                (p[j] as f64 - want[j]).abs() < 1e-6,
                "{j}: {} vs {}",
                p[j],
                want[j]
            );
        }
        assert!(adamw_update(
            &mut p,
            &mut m,
            &mut v,
            &[0.0; 2],
            &AdamWStep::new(lr, b1, b2, eps, wd, 3)
        )
        .is_err());
    }
}
