//! Losses over per-token log-probabilities, each returning the loss, the
//! gradient with respect to every token's log-prob (written, `=`) and its
//! metrics. The model's backward takes it from there
//! (`model::token_logprobs_backward`).
//!
//! - SFT: token-mean cross-entropy over the target tokens of a batch.
//! - Policy gradient for asynchronous RL (docs/ARCHITECTURE.md, recipe step 6): PPO-style
//!   clipped importance ratio against the behaviour policy that sampled the
//!   token (the engine's log-prob `b_t`, possibly several weight versions
//!   old), with separate low/high clip epsilons ("clip-higher", DAPO), the
//!   ratio computed in log space and bounded before any `exp`; a truncated
//!   importance weight (TIS) for the gap between a proximal policy and the
//!   behaviour policy; an optional band outside which tokens are masked;
//!   token-mean or sequence-mean aggregation; optional k3 KL to the behaviour
//!   policy, and to a fixed reference policy (the run's starting model).
//!   Advantages are group-relative ([`group_advantages`]).

use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// SFT: `loss = -sum(lp) / n`, `n` the number of target tokens in the whole
/// batch (pass the batch total when accumulating micro-batches). Returns
/// the loss contribution of these tokens and `dlp`.
pub fn sft_loss(lp: &[f32], n_targets_in_batch: usize) -> Result<(f64, Vec<f32>)> {
    if n_targets_in_batch == 0 {
        return Err(Error::Input("the batch has no target tokens".into()));
    }
    let inv = 1.0 / n_targets_in_batch as f64;
    let loss = -lp.iter().map(|&x| x as f64).sum::<f64>() * inv;
    Ok((loss, vec![-inv as f32; lp.len()]))
}

/// How per-token losses are averaged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Aggregation {
    /// Sum over every generated token of the batch / number of those tokens.
    TokenMean,
    /// Mean over sequences of each sequence's token mean.
    SequenceMean,
}

/// Policy-gradient loss settings.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PgConfig {
    /// Lower clip: the ratio is clipped at `1 - clip_low`. Default 0.2.
    pub clip_low: f64,
    /// Upper clip ("clip-higher"): `1 + clip_high`. Default 0.28.
    pub clip_high: f64,
    /// Bound on `|log ratio|` before exponentiation; a token past it gets no
    /// gradient through the ratio. Default 20 (`exp(20)` is finite in f32).
    pub max_log_ratio: f64,
    /// Cap of the truncated importance weight `min(exp(prox - b), cap)` that
    /// corrects the proximal/behaviour (trainer/engine) mismatch. Default 2.
    pub tis_cap: f64,
    /// When set, tokens whose `exp(l - b)` leaves `[lo, hi]` are masked out
    /// (no loss, no gradient) and counted. Default off.
    pub mask_band: Option<(f64, f64)>,
    /// Tokens the behaviour policy sampled with a probability below this
    /// (`exp(b_t) < min_token_prob`) are left out of the loss and counted
    /// ([`PgMetrics::tail_masked`]). Such tail draws of temperature-1
    /// sampling are about 0.1% of the tokens, nearly all in failed attempts,
    /// yet their push-down (`1 - p` ~ 1 on the logit) carried 20-44% of
    /// the logit-gradient mass of the demo's batches, and one batch of them
    /// broke a learned skill in one update (docs/demo.md). 0 = off.
    /// Default 1e-4.
    pub min_token_prob: f64,
    /// Default token-mean.
    pub aggregation: Aggregation,
    /// Coefficient of the k3 estimator of KL(current || behaviour). Default 0 (off).
    pub kl_coef: f64,
    /// Coefficient of the k3 estimator of KL(current || reference), the
    /// reference being a fixed policy (`arcticd train`: the model the run
    /// started from), whose log-probs each [`PgSeq::reference`] carries.
    /// Default 0 (off).
    pub ref_kl_coef: f64,
    /// Entropy bonus: `-entropy_coef * H_t` is added per token (needs the
    /// full-vocabulary entropy, computed from the same logits). Default 0 (off).
    pub entropy_coef: f64,
    /// Sampling temperature of the behaviour policy: the trainer's
    /// log-probs are of `logits / T`, the quantity the engine reported
    /// (0 = greedy, reported at T = 1). Default 1.
    pub temperature: f32,
}

impl Default for PgConfig {
    fn default() -> Self {
        PgConfig {
            clip_low: 0.2,
            clip_high: 0.28,
            max_log_ratio: 20.0,
            tis_cap: 2.0,
            mask_band: None,
            min_token_prob: 1e-4,
            aggregation: Aggregation::TokenMean,
            kl_coef: 0.0,
            ref_kl_coef: 0.0,
            entropy_coef: 0.0,
            temperature: 1.0,
        }
    }
}

/// The generated tokens of one trajectory, in order.
#[derive(Debug, Clone)]
pub struct PgSeq<'a> {
    /// Current (trainer) log-probs `l_t`.
    pub logprobs: &'a [f32],
    /// Behaviour (engine) log-probs `b_t`.
    pub behaviour: &'a [f32],
    /// Proximal log-probs (the trainer's under the weights that generated the
    /// token), when known; the behaviour log-probs otherwise (TIS weight 1).
    pub proximal: Option<&'a [f32]>,
    /// The trajectory's advantage.
    pub advantage: f32,
    /// Policy entropy at each token; required when `entropy_coef != 0`.
    pub entropy: Option<&'a [f32]>,
    /// The reference policy's log-probs of the same tokens; required when
    /// `ref_kl_coef != 0`.
    pub reference: Option<&'a [f32]>,
}

/// Per-step policy-gradient metrics.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct PgMetrics {
    pub loss: f64,
    pub tokens: usize,
    /// Mean and max `|l_t - b_t|` over the tokens.
    pub mismatch_mean: f64,
    pub mismatch_max: f64,
    /// Tokens whose clipped branch was active (no gradient through the ratio).
    pub clipped_fraction: f64,
    /// Tokens masked by `mask_band`, `max_log_ratio` or `min_token_prob`.
    pub masked_fraction: f64,
    /// Tokens left out by `min_token_prob` (a count).
    pub tail_masked: usize,
    pub kl: f64,
    /// The k3 estimate of KL(current || reference) (0 when off).
    pub ref_kl: f64,
    /// Mean policy entropy over the tokens (0 when not computed).
    pub entropy: f64,
}

/// Per-sequence gradients of a policy-gradient loss.
#[derive(Debug, Clone, Default)]
pub struct PgGrads {
    /// d loss / d log-prob per token.
    pub dlp: Vec<Vec<f32>>,
    /// d loss / d entropy per token (empty vectors when the bonus is off).
    pub dent: Vec<Vec<f32>>,
}

/// Policy-gradient loss for a batch; `normalizer` is the token count (token
/// mean) or sequence count (sequence mean) of the whole batch, so micro-batches
/// of one batch add up to the batch loss.
pub fn pg_loss(
    cfg: &PgConfig,
    seqs: &[PgSeq<'_>],
    normalizer: usize,
) -> Result<(PgMetrics, PgGrads)> {
    if normalizer == 0 {
        return Err(Error::Input("policy-gradient batch has no tokens".into()));
    }
    let mut m = PgMetrics::default();
    let (mut clipped, mut masked) = (0usize, 0usize);
    let min_logprob = if cfg.min_token_prob > 0.0 {
        cfg.min_token_prob.ln()
    } else {
        f64::NEG_INFINITY
    };
    let mut grads = PgGrads::default();
    for (s, seq) in seqs.iter().enumerate() {
        let n = seq.logprobs.len();
        if seq.behaviour.len() != n || seq.proximal.is_some_and(|p| p.len() != n) {
            return Err(Error::Input(format!(
                "trajectory {s}: {} log-probs, {} behaviour log-probs",
                n,
                seq.behaviour.len()
            )));
        }
        let weight = match cfg.aggregation {
            Aggregation::TokenMean => 1.0 / normalizer as f64,
            Aggregation::SequenceMean => 1.0 / (normalizer as f64 * n.max(1) as f64),
        };
        let a = seq.advantage as f64;
        let reference = match (cfg.ref_kl_coef != 0.0, seq.reference) {
            (false, _) => None,
            (true, Some(r)) if r.len() == n => Some(r),
            (true, _) => {
                return Err(Error::Input(format!(
                    "trajectory {s}: KL to the reference on but no reference log-probs"
                )))
            }
        };
        let mut dlp = vec![0.0f32; n];
        let mut dent = Vec::new();
        if cfg.entropy_coef != 0.0 {
            let ent = seq.entropy.filter(|e| e.len() == n).ok_or_else(|| {
                Error::Input(format!("trajectory {s}: entropy bonus on but no entropies"))
            })?;
            for &e in ent {
                m.loss -= cfg.entropy_coef * e as f64 * weight;
                m.entropy += e as f64;
            }
            dent = vec![(-cfg.entropy_coef * weight) as f32; n];
        }
        for t in 0..n {
            let l = seq.logprobs[t] as f64;
            let b = seq.behaviour[t] as f64;
            let prox = seq.proximal.map_or(b, |p| p[t] as f64);
            let mismatch = (l - b).abs();
            m.mismatch_mean += mismatch;
            m.mismatch_max = m.mismatch_max.max(mismatch);
            m.tokens += 1;
            let raw = l - prox;
            let out_of_band = cfg.mask_band.is_some_and(|(lo, hi)| {
                let r = (l - b).clamp(-cfg.max_log_ratio, cfg.max_log_ratio).exp();
                r < lo || r > hi
            });
            if b < min_logprob {
                masked += 1;
                m.tail_masked += 1;
                continue;
            }
            if out_of_band || !raw.is_finite() || raw.abs() > cfg.max_log_ratio {
                masked += 1;
                continue;
            }
            let ratio = raw.exp();
            let tis = (prox - b)
                .clamp(-cfg.max_log_ratio, cfg.max_log_ratio)
                .exp()
                .min(cfg.tis_cap);
            // PPO: -min(r A, clip(r) A); the gradient flows only through the
            // unclipped branch when it is the smaller one.
            let clip_r = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high);
            let (s1, s2) = (ratio * a, clip_r * a);
            let obj = s1.min(s2);
            let mut d = 0.0f64;
            if s1 <= s2 {
                d -= tis * a * ratio;
            } else {
                clipped += 1;
            }
            let mut tok = -tis * obj;
            if cfg.kl_coef != 0.0 {
                let (k3, dk3) = k3(l, b, cfg.max_log_ratio);
                m.kl += k3 * weight;
                tok += cfg.kl_coef * k3;
                d += cfg.kl_coef * dk3;
            }
            if let Some(r) = reference {
                let (k3, dk3) = k3(l, r[t] as f64, cfg.max_log_ratio);
                m.ref_kl += k3 * weight;
                tok += cfg.ref_kl_coef * k3;
                d += cfg.ref_kl_coef * dk3;
            }
            m.loss += tok * weight;
            dlp[t] = (d * weight) as f32;
        }
        grads.dlp.push(dlp);
        grads.dent.push(dent);
    }
    if m.tokens > 0 {
        m.mismatch_mean /= m.tokens as f64;
        m.clipped_fraction = clipped as f64 / m.tokens as f64;
        m.masked_fraction = masked as f64 / m.tokens as f64;
        m.entropy /= m.tokens as f64;
    }
    Ok((m, grads))
}

/// The k3 estimator of KL(current || other) at one token sampled from the
/// current policy, `exp(o - l) - (o - l) - 1` (never negative, unbiased for
/// the KL), and its derivative in the current log-prob `l`, `1 - exp(o - l)`.
/// The log-ratio is bounded by `max_log_ratio` before the `exp`.
fn k3(l: f64, other: f64, max_log_ratio: f64) -> (f64, f64) {
    let x = (other - l).clamp(-max_log_ratio, max_log_ratio);
    (x.exp() - x - 1.0, 1.0 - x.exp())
}

/// Group-relative advantages: reward minus the group mean, optionally divided
/// by the group's (population) standard deviation. Returns the advantages
/// and whether the group is degenerate (every reward equal: all advantages
/// are 0 and the group contributes nothing).
pub fn group_advantages(rewards: &[f32], divide_by_std: bool) -> (Vec<f32>, bool) {
    if rewards.is_empty() {
        return (Vec::new(), true);
    }
    let n = rewards.len() as f64;
    let mean = rewards.iter().map(|&r| r as f64).sum::<f64>() / n;
    let degenerate = rewards.iter().all(|&r| r == rewards[0]);
    if degenerate {
        return (vec![0.0; rewards.len()], true);
    }
    let std = (rewards
        .iter()
        .map(|&r| (r as f64 - mean).powi(2))
        .sum::<f64>()
        / n)
        .sqrt();
    let adv = rewards
        .iter()
        .map(|&r| {
            let a = r as f64 - mean;
            (if divide_by_std { a / (std + 1e-6) } else { a }) as f32
        })
        .collect();
    (adv, false)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seq<'a>(l: &'a [f32], b: &'a [f32], a: f32) -> PgSeq<'a> {
        PgSeq {
            logprobs: l,
            behaviour: b,
            proximal: None,
            advantage: a,
            entropy: None,
            reference: None,
        }
    }

    fn pg_loss_d(c: &PgConfig, s: &[PgSeq<'_>], n: usize) -> Result<(PgMetrics, Vec<Vec<f32>>)> {
        pg_loss(c, s, n).map(|(m, g)| (m, g.dlp))
    }

    #[test]
    fn entropy_bonus_lowers_the_loss_by_coef_times_entropy() {
        let cfg = PgConfig {
            entropy_coef: 0.1,
            ..PgConfig::default()
        };
        let l = [-1.0f32, -1.0];
        let ent = [2.0f32, 4.0];
        let s = PgSeq {
            entropy: Some(&ent),
            ..seq(&l, &l, 0.0)
        };
        let (m, g) = pg_loss(&cfg, &[s], 2).unwrap();
        assert!((m.loss + 0.3).abs() < 1e-9 && (m.entropy - 3.0).abs() < 1e-9);
        assert_eq!(g.dent[0], vec![-0.05, -0.05]);
        assert!(pg_loss(&cfg, &[seq(&l, &l, 0.0)], 2).is_err());
    }

    #[test]
    fn sft_is_token_mean() {
        let (loss, d) = sft_loss(&[-1.0, -3.0], 4).unwrap();
        assert_eq!(loss, 1.0);
        assert_eq!(d, vec![-0.25, -0.25]);
        assert!(sft_loss(&[], 0).is_err());
    }

    #[test]
    fn on_policy_gradient_is_minus_advantage() {
        let cfg = PgConfig::default();
        let l = [-1.0f32, -2.0];
        let (m, d) = pg_loss_d(&cfg, &[seq(&l, &l, 0.5)], 2).unwrap();
        assert!((m.loss + 0.5).abs() < 1e-9);
        assert_eq!(d[0], vec![-0.25, -0.25]);
        assert_eq!(m.clipped_fraction, 0.0);
        assert_eq!(m.mismatch_max, 0.0);
    }

    #[test]
    fn clip_higher_and_finite_difference() {
        let cfg = PgConfig::default();
        let b = [-1.0f32; 4];
        // ratios e^0.3 = 1.35 > 1.28 (clipped for A > 0), e^-0.3 = 0.74 < 0.8
        // (clipped for A < 0), e^0.1 inside.
        for (lv, a, clipped) in [
            (-0.7f32, 1.0f32, true),
            (-1.3, -1.0, true),
            (-0.9, 1.0, false),
            (-0.7, -1.0, false),
        ] {
            let l = [lv];
            let (m, d) = pg_loss_d(&cfg, &[seq(&l, &b[..1], a)], 1).unwrap();
            assert_eq!(
                m.clipped_fraction,
                if clipped { 1.0 } else { 0.0 },
                "{lv} {a}"
            );
            let eps = 1e-3f32;
            let lp = pg_loss(&cfg, &[seq(&[lv + eps], &b[..1], a)], 1)
                .unwrap()
                .0
                .loss;
            let lm = pg_loss(&cfg, &[seq(&[lv - eps], &b[..1], a)], 1)
                .unwrap()
                .0
                .loss;
            let num = (lp - lm) / (2.0 * eps as f64);
            assert!(
                (num - d[0][0] as f64).abs() < 1e-3,
                "{lv} {a}: {num} vs {}",
                d[0][0]
            );
        }
    }

    #[test]
    fn huge_log_ratio_is_masked_not_infinite() {
        let cfg = PgConfig::default();
        let (m, d) = pg_loss_d(&cfg, &[seq(&[0.0], &[-500.0], 1.0)], 1).unwrap();
        assert!(m.loss.is_finite() && d[0][0] == 0.0);
        assert_eq!(m.masked_fraction, 1.0);
        assert_eq!(m.mismatch_max, 500.0);
        let band = PgConfig {
            mask_band: Some((0.5, 2.0)),
            ..cfg
        };
        let (m, _) = pg_loss(&band, &[seq(&[-1.0, -1.0], &[-1.0, -2.0], 1.0)], 2).unwrap();
        assert_eq!(m.masked_fraction, 0.5);
    }

    #[test]
    fn kl_gradient_matches_finite_difference() {
        let cfg = PgConfig {
            kl_coef: 0.3,
            ..PgConfig::default()
        };
        let b = [-1.2f32];
        let f = |x: f32| pg_loss_d(&cfg, &[seq(&[x], &b, 0.0)], 1).unwrap();
        let (_, d) = f(-1.0);
        let num = (f(-1.0 + 1e-3).0.loss - f(-1.0 - 1e-3).0.loss) / 2e-3;
        assert!((num - d[0][0] as f64).abs() < 1e-4, "{num} vs {}", d[0][0]);
    }

    #[test]
    fn reference_kl_pulls_toward_the_reference_and_matches_finite_difference() {
        let cfg = PgConfig {
            ref_kl_coef: 0.5,
            ..PgConfig::default()
        };
        let (l, b) = ([-1.0f32, -0.2], [-1.0f32, -0.2]);
        let r = [-0.3f32, -0.2];
        fn with<'a>(x: &'a [f32], b: &'a [f32], r: &'a [f32]) -> PgSeq<'a> {
            PgSeq {
                reference: Some(r),
                ..seq(x, b, 0.0)
            }
        }
        let (m, d) = pg_loss_d(&cfg, &[with(&l, &b, &r)], 2).unwrap();
        // The first token is less likely than under the reference: the
        // gradient of the loss in its log-prob is negative (descent raises
        // it); the second agrees with the reference and gets nothing.
        assert!(d[0][0] < 0.0 && d[0][1] == 0.0, "{:?}", d[0]);
        let x = -0.3f64 + 1.0;
        assert!((m.ref_kl - (x.exp() - x - 1.0) / 2.0).abs() < 1e-6);
        for t in 0..2 {
            let mut up = l;
            let mut down = l;
            up[t] += 1e-3;
            down[t] -= 1e-3;
            let f = |v: &[f32]| pg_loss(&cfg, &[with(v, &b, &r)], 2).unwrap().0.loss;
            let num = (f(&up) - f(&down)) / 2e-3;
            assert!((num - d[0][t] as f64).abs() < 1e-4, "{num} vs {}", d[0][t]);
        }
        // On but without reference log-probs is an error, not a silent 0.
        assert!(pg_loss(&cfg, &[seq(&l, &b, 0.0)], 2).is_err());
    }

    #[test]
    fn tail_draws_are_left_out_and_counted() {
        // Behaviour probabilities 0.5, 2e-5 and 0.9; the second is below
        // the default floor of 1e-4.
        let b = [0.5f32.ln(), 2e-5f32.ln(), 0.9f32.ln()];
        let cfg = PgConfig::default();
        let (m, d) = pg_loss_d(&cfg, &[seq(&b, &b, -1.0)], 3).unwrap();
        assert_eq!(m.tail_masked, 1);
        assert!((m.masked_fraction - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(d[0][1], 0.0);
        assert!(d[0][0] != 0.0 && d[0][2] != 0.0);
        // Off: every token counts, with the same gradient as any other.
        let off = PgConfig {
            min_token_prob: 0.0,
            ..cfg
        };
        let (m, d) = pg_loss_d(&off, &[seq(&b, &b, -1.0)], 3).unwrap();
        assert_eq!((m.tail_masked, m.masked_fraction), (0, 0.0));
        assert_eq!(d[0][1], d[0][0]);
    }

    #[test]
    fn sequence_mean_weights_sequences_equally() {
        let cfg = PgConfig {
            aggregation: Aggregation::SequenceMean,
            ..PgConfig::default()
        };
        let (a, b) = ([-1.0f32; 1], [-1.0f32; 3]);
        let (m, d) = pg_loss_d(&cfg, &[seq(&a, &a, 1.0), seq(&b, &b, 1.0)], 2).unwrap();
        assert!((m.loss + 1.0).abs() < 1e-9);
        assert_eq!(d[0], vec![-0.5]);
        assert!((d[1][0] + 1.0 / 6.0).abs() < 1e-7);
    }

    #[test]
    fn group_advantages_center_and_flag_degenerate_groups() {
        let (a, deg) = group_advantages(&[1.0, 0.0, 0.0, 1.0], false);
        assert_eq!(a, vec![0.5, -0.5, -0.5, 0.5]);
        assert!(!deg);
        let (a, _) = group_advantages(&[1.0, 0.0, 0.0, 1.0], true);
        assert!((a[0] - 1.0).abs() < 1e-5);
        let (a, deg) = group_advantages(&[1.0, 1.0, 1.0], false);
        assert!(deg && a.iter().all(|&x| x == 0.0));
    }
}
