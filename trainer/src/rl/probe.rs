//! The identity probe: the same-version mismatch measured on purpose.
//!
//! The loop's own mismatch split compares the engine's and the trainer's
//! log-probs only on tokens sampled by the weights the trainer holds when
//! it trains on them. When the trainer is the bottleneck, rollouts queue
//! and every token is one or two versions old by then, so that number is
//! never measured (the demo on 2 cores trains on version-lagged tokens
//! from its second update on). A probe measures it anyway: right after an
//! update, one live replica samples a few tokens from a prompt of the batch
//! (batched with the rollouts in flight, through the paged cache, state
//! slots and prefix cache like any request), and the trainer's forward
//! scores them with a frozen copy of the weights that sampled them (on a
//! GPU, the device trainer itself, before its next step: a host copy would
//! score with the CPU's kernels, not the GPU's). Tokens a later update
//! stamped with a newer version are left out.

use crate::model::{forward_with, token_logprobs_entropy, ForwardOptions, Packed};
use crate::{Error, Result};
use arcticd_engine::engine::{Choice, Request};
use arcticd_engine::router::Router;
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::Qwen3_5;

/// What one probe measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Probe {
    /// The weight version probed.
    pub version: u64,
    /// Tokens sampled at `version` and compared.
    pub tokens: usize,
    pub mean: f64,
    pub max: f64,
}

/// The prompt of a trajectory: its tokens before the first one the model
/// generated (`loss_mask` 1). None when it has no such split.
pub fn prompt_of(tokens: &[u32], loss_mask: &[u8]) -> Option<Vec<u32>> {
    let first = loss_mask.iter().position(|&m| m == 1)?;
    (first > 0).then(|| tokens[..first].to_vec())
}

/// Sample `max_tokens` from `prompt` on the least-loaded replica at
/// `temperature` (seeded), then score them with `model`, the weights of
/// `version`, on the host.
pub async fn run(
    router: Router,
    model: Qwen3_5,
    version: u64,
    prompt: Vec<u32>,
    max_tokens: usize,
    temperature: f32,
    seed: u64,
) -> Result<Probe> {
    let choice = sample(router, prompt.clone(), max_tokens, temperature, seed).await?;
    tokio::task::spawn_blocking(move || score(&model, version, &prompt, &choice, temperature))
        .await
        .map_err(|e| Error::Run(format!("the probe's scoring stopped: {e}")))?
}

/// The probe's sample: `max_tokens` from `prompt` on the least-loaded
/// replica at `temperature`, seeded.
pub async fn sample(
    router: Router,
    prompt: Vec<u32>,
    max_tokens: usize,
    temperature: f32,
    seed: u64,
) -> Result<Choice> {
    let params = SamplingParams {
        temperature,
        max_tokens,
        seed: Some(seed),
        n: 1,
        ..SamplingParams::default()
    };
    let replica = router.least_loaded();
    let request = Request { prompt, params };
    Ok(router.replicas()[replica]
        .generate(request)
        .await?
        .pop()
        .unwrap_or_default())
}

/// |trainer - engine| log-prob over the tokens of `choice` sampled at
/// `version`, the trainer's log-probs from `model` on the host.
pub fn score(
    model: &Qwen3_5,
    version: u64,
    prompt: &[u32],
    choice: &Choice,
    temperature: f32,
) -> Result<Probe> {
    score_by(version, prompt, choice, |seq, rows, targets| {
        let packed = Packed::new(&[seq.to_vec()], model.config.vocab_size)?;
        let acts = forward_with(
            model,
            packed,
            ForwardOptions {
                recompute_layers: true,
            },
        )?;
        let (lps, _) =
            token_logprobs_entropy(model, &acts.hidden, rows, targets, false, temperature)?;
        Ok(lps)
    })
}

/// |trainer - engine| log-prob over the tokens of `choice` sampled at
/// `version`, the trainer's log-prob of `targets[i]` at row `rows[i]` of
/// the sequence `prompt + choice` from `trainer_logprobs(seq, rows,
/// targets)` (the host's forward, or a device trainer's).
pub fn score_by(
    version: u64,
    prompt: &[u32],
    choice: &Choice,
    trainer_logprobs: impl FnOnce(&[u32], &[usize], &[u32]) -> Result<Vec<f32>>,
) -> Result<Probe> {
    let n = choice.tokens.len();
    if prompt.is_empty() {
        return Err(Error::Input(
            "a probe needs a prompt of at least one token".into(),
        ));
    }
    if choice.logprobs.len() != n || choice.weight_versions.len() != n {
        return Err(Error::Input(format!(
            "a probe of {n} tokens came with {} log-probs and {} versions",
            choice.logprobs.len(),
            choice.weight_versions.len()
        )));
    }
    let mut seq = prompt.to_vec();
    seq.extend_from_slice(&choice.tokens);
    // The logits at row p predict the token at p + 1.
    let (mut rows, mut targets, mut engine) = (Vec::new(), Vec::new(), Vec::new());
    for i in (0..n).filter(|&i| choice.weight_versions[i] == version) {
        rows.push(prompt.len() + i - 1);
        targets.push(choice.tokens[i]);
        engine.push(choice.logprobs[i]);
    }
    let mut probe = Probe {
        version,
        tokens: rows.len(),
        mean: 0.0,
        max: 0.0,
    };
    if rows.is_empty() {
        return Ok(probe);
    }
    let lps = trainer_logprobs(&seq, &rows, &targets)?;
    if lps.len() != rows.len() {
        return Err(Error::Run(format!(
            "the trainer scored {} of the probe's {} tokens",
            lps.len(),
            rows.len()
        )));
    }
    for (t, e) in lps.iter().zip(&engine) {
        let d = (*t as f64 - *e as f64).abs();
        probe.mean += d;
        probe.max = probe.max.max(d);
    }
    probe.mean /= rows.len() as f64;
    Ok(probe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_prompt_ends_where_generation_starts() {
        assert_eq!(
            prompt_of(&[5, 6, 7, 8, 9], &[0, 0, 1, 1, 0]),
            Some(vec![5, 6])
        );
        assert_eq!(prompt_of(&[5, 6], &[0, 0]), None);
        assert_eq!(prompt_of(&[5, 6], &[1, 1]), None);
    }
}
