//! Replaying one update of a finished (or running) run: the weights and
//! AdamW state of the checkpoint before it, the batch it trained on
//! (`trajectories/step-N.jsonl`), and the recipe with any keys changed.
//! This is how a sudden break is traced to its batch and a fix is tried on
//! that batch before a whole run is spent on it (docs/demo.md).
//!
//! The replay is the run's update when nothing is changed: the same
//! trainer code on the same inputs (the weights' version is the
//! checkpoint's, so the version split and stale masking see what the run
//! saw). Needs the checkpoint of update N-1 (`checkpoint_every = 1`), or
//! none for update 1, which starts from the recipe's model.
//!
//! Updates N..=M replay in a chain from that one checkpoint, each on its
//! recorded batch after the one before: unchanged, the chain is the run's
//! own updates (each replay equals its update bit for bit), so a run that
//! kept a checkpoint every 20 updates can still be traced update by update.
//! Where the run rolled back after an update (`rolled_back_to` in its
//! metrics record), the chain restores the same checkpoint there (0: the
//! model the run started from, with a fresh optimizer).
//!
//! Not for: evaluating a change on fresh rollouts (that is a run).

use super::recipe::{Recipe, StalePolicy};
use super::run_dir::{RunDir, RunState};
use crate::device::RestorePoint;
use crate::harness::trajectory::Trajectory;
use crate::step::{PgExample, Trainer};
use crate::{Error, Result};
use arcticd_engine::{ParamStore, Qwen3_5};
use serde::{Deserialize, Serialize};
use std::path::Path;

/// What replaying an update measured.
#[derive(Debug, Clone, Serialize)]
pub struct Replay {
    pub step: u64,
    pub loss: f64,
    pub grad_norm: f64,
    /// Generated tokens of the batch, and those its loss left out.
    pub tokens: usize,
    /// Tokens the trainer's forwards ran (shared prefixes once) and the
    /// step's seconds, forward to the weight write.
    pub tokens_run: usize,
    pub step_secs: f64,
    pub masked_fraction: f64,
    pub tail_masked: usize,
    pub clip_fraction: f64,
    /// Log-prob of the last token of each probe sequence before and after
    /// the update.
    pub probe_before: Vec<f32>,
    pub probe_after: Vec<f32>,
    /// With `attribute`, on the last update: the parameters whose change
    /// moved the probes most, largest first (at most 12).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub attribution: Vec<Attribution>,
}

/// How much of an update's effect on the probes one parameter carries.
#[derive(Debug, Clone, Serialize)]
pub struct Attribution {
    pub parameter: String,
    /// Mean over the probes of the last token's log-prob with this
    /// parameter alone put back to its value before the update, minus its
    /// log-prob after the update.
    pub probe_shift: f32,
}

/// One record of `trajectories/step-N.jsonl`.
#[derive(Deserialize)]
struct Trained {
    advantage: f32,
    #[serde(flatten)]
    t: Trajectory,
}

/// The recipe keys a replay reads, the only ones `--set` may change: the
/// trainer's (`Recipe::train_config`), which recorded tokens are stale
/// (`recorded_batch`), and `model` (the weights of update 1, and the KL
/// reference). Everything else made the recorded batch, which is replayed
/// as it was.
const REPLAY_KEYS: &[&str] = &[
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "lr_decay",
    "warmup",
    "decay_steps",
    "steps",
    "min_lr",
    "grad_clip",
    "micro_batch_tokens",
    "share_prefixes",
    "clip_low",
    "clip_high",
    "tis_cap",
    "kl_coef",
    "ref_kl_coef",
    "entropy_coef",
    "min_token_prob",
    "rollout.temperature",
    "checksum_every",
    "max_staleness",
    "stale",
    "model",
];

/// Replays updates `step..=through` of the run in `run_dir` in a chain
/// from the checkpoint before `step`, with `sets` applied to its recipe,
/// scoring `probes` (token sequences of at least two tokens) before and
/// after each.
pub fn replay(
    run_dir: &Path,
    step: u64,
    through: u64,
    sets: &[String],
    probes: &[Vec<u32>],
    attribute: bool,
) -> Result<Vec<Replay>> {
    if attribute && probes.is_empty() {
        return Err(Error::Input(
            "attributing an update needs probes to measure it by".into(),
        ));
    }
    if step == 0 {
        return Err(Error::Input("updates count from 1".into()));
    }
    if through < step {
        return Err(Error::Input(format!(
            "replaying updates {step} through {through}: the last comes before the first"
        )));
    }
    if let Some(i) = probes.iter().position(|p| p.len() < 2) {
        return Err(Error::Input(format!(
            "probe {i} has fewer than two tokens: nothing to score"
        )));
    }
    if let Some(key) = sets
        .iter()
        .filter_map(|s| s.split_once('=').map(|(k, _)| k.trim()))
        .find(|k| !REPLAY_KEYS.contains(k))
    {
        return Err(Error::Input(format!(
            "--set {key}: a replay does not read it (it trains the recorded batch again); \
             the keys it reads: {}",
            REPLAY_KEYS.join(", ")
        )));
    }
    let dir = RunDir::new(run_dir);
    let recipe = Recipe::from_file(&dir.recipe(), sets)?.checked()?;
    // Every update asked for was recorded: found now, not after the
    // replays before it have run.
    if let Some(missing) = (step..=through).find(|&s| !dir.step_trajectories(s).is_file()) {
        let recorded = (1..)
            .take_while(|&s| dir.step_trajectories(s).is_file())
            .last()
            .unwrap_or(0);
        return Err(Error::Input(format!(
            "{} recorded no batch of update {missing} ({} is missing); its recorded updates \
             run from 1 to {recorded}",
            run_dir.display(),
            dir.step_trajectories(missing).display()
        )));
    }
    let (weights, version) = if step == 1 {
        (start_model(&recipe)?, 0)
    } else {
        let ck = dir.checkpoint(step - 1);
        let state_path = ck.join("run_state.json");
        let text = std::fs::read(&state_path).map_err(|_| {
            let kept: Vec<u64> = dir
                .complete_checkpoints()
                .unwrap_or_default()
                .into_iter()
                .map(|(n, _)| n)
                .collect();
            Error::Input(format!(
                "{} has no complete checkpoint of update {} (it keeps {kept:?}); a run \
                 with checkpoint_every = 1 and keep_checkpoints = \"all\" can replay any update",
                run_dir.display(),
                step - 1
            ))
        })?;
        let state: RunState = serde_json::from_slice(&text)
            .map_err(|e| Error::Input(format!("{}: {e}", state_path.display())))?;
        (ck, state.weight_version)
    };
    let model = Qwen3_5::load(&weights)
        .map_err(|e| Error::Input(format!("model {}: {e}", weights.display())))?;
    let mut trainer = Trainer::new(
        ParamStore::with_version(model, version),
        recipe.train_config(),
    )?;
    if step > 1 {
        trainer.load_optimizer(&weights)?;
    }
    if recipe.ref_kl_coef != 0.0 {
        let start = recipe.model.as_deref().unwrap_or(&weights);
        let reference = Qwen3_5::load(start)
            .map_err(|e| Error::Input(format!("KL reference {}: {e}", start.display())))?;
        trainer = trainer.with_reference(reference)?;
    }

    // Updates after which the run rolled back, and to which checkpoint.
    let rollbacks: std::collections::BTreeMap<u64, u64> = if through > step {
        read_rollbacks(&dir)?
    } else {
        Default::default()
    };
    let last = |t: &Trainer| last_logprobs(&t.store().read(), probes);
    let mut out = Vec::new();
    let mut probe_before = last(&trainer)?;
    for step in step..=through {
        if step > 1 {
            if let Some(&to) = rollbacks.get(&(step - 1)) {
                trainer.restore(&rollback_point(&dir, &recipe, to, step - 1)?)?;
                probe_before = last(&trainer)?;
            }
        }
        let batch = recorded_batch(&dir, step, &recipe, trainer.store().weight_version())?;
        if batch.is_empty() {
            if out.is_empty() {
                return Err(Error::Input(format!(
                    "{}: update {step} trained on nothing",
                    dir.step_trajectories(step).display()
                )));
            }
            // The run did not step either: the weights stay.
            continue;
        }
        let before = (attribute && step == through).then(|| trainer.store().read().clone());
        let t0 = std::time::Instant::now();
        let m = trainer.pg_step(&batch)?;
        let step_secs = t0.elapsed().as_secs_f64();
        let probe_after = last(&trainer)?;
        let attribution = match before {
            Some(b) => attribute_update(&b, &trainer.store().read(), probes, &probe_after)?,
            None => Vec::new(),
        };
        let pg = m.pg.unwrap_or_default();
        out.push(Replay {
            step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            tokens: pg.tokens,
            tokens_run: m.tokens_run,
            step_secs,
            masked_fraction: pg.masked_fraction,
            tail_masked: pg.tail_masked,
            clip_fraction: pg.clipped_fraction,
            probe_before: std::mem::take(&mut probe_before),
            probe_after: probe_after.clone(),
            attribution,
        });
        probe_before = probe_after;
    }
    Ok(out)
}

/// The model the run started from (its recipe's).
fn start_model(recipe: &Recipe) -> Result<std::path::PathBuf> {
    recipe
        .model
        .clone()
        .ok_or_else(|| Error::Recipe("the run's recipe names no model".into()))
}

/// Where the run in `dir` went back to after update `after`: the
/// checkpoint of update `to`, or for 0 the model it started from.
fn rollback_point(dir: &RunDir, recipe: &Recipe, to: u64, after: u64) -> Result<RestorePoint> {
    if to == 0 {
        return Ok(RestorePoint::Start(start_model(recipe)?));
    }
    let ck = dir.checkpoint(to);
    if !ck.join("run_state.json").is_file() {
        return Err(Error::Input(format!(
            "{}: the run rolled back after update {after} to the checkpoint of update {to}, \
             which it no longer keeps; replay from update {} on its own",
            dir.root.display(),
            after + 1
        )));
    }
    Ok(RestorePoint::Checkpoint(ck))
}

/// The updates of the run in `dir` after which it rolled back: update ->
/// the update whose checkpoint it went back to.
fn read_rollbacks(dir: &RunDir) -> Result<std::collections::BTreeMap<u64, u64>> {
    let path = dir.metrics();
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let mut out = std::collections::BTreeMap::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        // A torn last line (a killed run) carries no rollback to follow.
        let Ok(rec) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        if let (Some(step), Some(to)) = (rec["step"].as_u64(), rec["rolled_back_to"].as_u64()) {
            out.insert(step, to);
        }
    }
    Ok(out)
}

/// The log-prob of each probe's last token under `model`.
fn last_logprobs(model: &Qwen3_5, probes: &[Vec<u32>]) -> Result<Vec<f32>> {
    if probes.is_empty() {
        return Ok(Vec::new());
    }
    Ok(model
        .score(probes)?
        .iter()
        .map(|s| s.last().copied().flatten().unwrap_or(f32::NAN))
        .collect())
}

/// Puts each parameter alone back to its value in `before` and scores the
/// probes: the parameters that carry the update's effect on them, largest
/// mean shift first.
fn attribute_update(
    before: &Qwen3_5,
    after: &Qwen3_5,
    probes: &[Vec<u32>],
    probe_after: &[f32],
) -> Result<Vec<Attribution>> {
    let mut m = after.clone();
    let old: Vec<Vec<f32>> = before
        .named_params()
        .iter()
        .map(|(_, t)| t.as_f32().map(<[f32]>::to_vec))
        .collect::<std::result::Result<_, _>>()?;
    let mut out = Vec::with_capacity(old.len());
    for (i, old) in old.iter().enumerate() {
        let (name, new) = {
            let mut params = m.named_params_mut();
            let (name, t) = &mut params[i];
            let dst = t.as_f32_mut()?;
            let new = dst.to_vec();
            dst.copy_from_slice(old);
            (name.clone(), new)
        };
        let lp = last_logprobs(&m, probes)?;
        m.named_params_mut()[i]
            .1
            .as_f32_mut()?
            .copy_from_slice(&new);
        let shift = lp.iter().zip(probe_after).map(|(a, b)| a - b).sum::<f32>() / lp.len() as f32;
        out.push(Attribution {
            parameter: name,
            probe_shift: shift,
        });
    }
    out.sort_by(|a, b| b.probe_shift.abs().total_cmp(&a.probe_shift.abs()));
    out.truncate(12);
    Ok(out)
}

/// The batch update `step` trained on, as the trainer saw it at weight
/// `version` (stale tokens masked when the recipe masks them); empty when
/// it trained on nothing.
fn recorded_batch(
    dir: &RunDir,
    step: u64,
    recipe: &Recipe,
    version: u64,
) -> Result<Vec<PgExample>> {
    let path = dir.step_trajectories(step);
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let oldest_allowed = version.saturating_sub(recipe.max_staleness);
    let mut batch = Vec::new();
    for (i, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let r: Trained = serde_json::from_str(line)
            .map_err(|e| Error::Input(format!("{} line {}: {e}", path.display(), i + 1)))?;
        let mut loss_mask = r.t.loss_mask.clone();
        if recipe.stale == StalePolicy::Mask {
            super::batch::mask_stale(&mut loss_mask, &r.t.weight_versions, oldest_allowed);
        }
        batch.push(PgExample {
            tokens: r.t.token_ids,
            loss_mask,
            behaviour_logprobs: r.t.logprobs,
            proximal_logprobs: None,
            advantage: r.advantage,
            weight_versions: r.t.weight_versions,
        });
    }
    Ok(batch)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every recipe key whose change changes the trainer's settings is
    /// one a replay accepts: each key of the default recipe is changed in
    /// turn (numbers doubled plus one, switches flipped) and the
    /// trainer's settings compared.
    #[test]
    fn every_key_the_training_step_reads_may_be_set_in_a_replay() {
        let base = Recipe::default();
        let table = toml::Value::try_from(&base).unwrap();
        let mut keys: Vec<(String, toml::Value)> = Vec::new();
        for (k, v) in table.as_table().unwrap() {
            match v.as_table() {
                Some(inner) => keys.extend(
                    inner
                        .iter()
                        .map(|(k2, v2)| (format!("{k}.{k2}"), v2.clone())),
                ),
                None => keys.push((k.clone(), v.clone())),
            }
        }
        let mut read = 0;
        for (key, v) in keys {
            let changed = match v {
                toml::Value::Boolean(b) => toml::Value::Boolean(!b),
                toml::Value::Integer(i) => toml::Value::Integer(i * 2 + 1),
                toml::Value::Float(f) => toml::Value::Float(f * 2.0 + 0.5),
                _ => continue,
            };
            let mut t = table.clone();
            let mut at = &mut t;
            let parts: Vec<&str> = key.split('.').collect();
            for p in &parts[..parts.len() - 1] {
                at = at.get_mut(*p).unwrap();
            }
            at.as_table_mut()
                .unwrap()
                .insert(parts[parts.len() - 1].to_string(), changed);
            let Ok(r) = t.try_into::<Recipe>() else {
                continue;
            };
            if r.train_config() != base.train_config() {
                read += 1;
                assert!(
                    REPLAY_KEYS.contains(&key.as_str()),
                    "the trainer reads {key}, which a replay refuses"
                );
            }
        }
        assert!(read >= 15, "only {read} keys change the trainer's settings");
    }
}
