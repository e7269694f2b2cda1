//! Recipes: every setting of an `arcticd train` run, as TOML.
//!
//! One flat struct ([`Recipe`]) for the loop, the optimizer and the loss,
//! with the rollout harness's settings in a `[rollout]` table. Unknown keys
//! are errors that name the key and its line; `--set key=value` overrides go
//! through the same deserializer (dotted keys reach into `[rollout]`).
//! `recipes/default.toml` documents every key and is tested to equal
//! [`Recipe::default`]. Defaults are the source recipe (docs/ARCHITECTURE.md,
//! "The recipe"): format, duplicate and budget gates on, fp32 state, caches
//! rebuilt after every update, least-loaded routing, explicit submit.
//!
//! Not for: the demo's own values (`recipes/demo.toml`) or command-line
//! parsing (the binary).

use crate::harness::rollout::check_secs;
use crate::harness::{FormatCheck, RolloutConfig, Routing};
use crate::loss::PgConfig;
use crate::optim::{AdamWConfig, LrSchedule};
use crate::step::TrainConfig;
use crate::{Error, Result};
use arcticd_engine::engine::EngineConfig;
pub use arcticd_engine::engine::StateDtype;
use arcticd_engine::error::plain_types;
use arcticd_kernels::Device;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// What happens to tokens older than `max_staleness` at consumption.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StalePolicy {
    /// The whole trajectory is dropped, counted and written to
    /// `trajectories/dropped.jsonl`.
    Drop,
    /// Only the too-old tokens are masked out of the loss.
    Mask,
}

/// The learning rate after the warmup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LrDecay {
    /// The peak rate to the end.
    Constant,
    /// Half a cosine from the peak down to `min_lr` at the last update.
    Cosine,
}

/// What happens to a rollout cut by a token or turn budget (DAPO's
/// overlong handling).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Overlong {
    /// It keeps reward 0 and is trained on like any failure.
    Zero,
    /// It is masked out of the loss and its group's advantage, and counted.
    Mask,
}

/// The sandbox backend rollouts run in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SandboxBackend {
    /// bubblewrap namespaces (no daemon needed).
    Local,
    /// One Docker container per sandbox.
    Docker,
}

/// How many checkpoints to keep.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(
    untagged,
    expecting = "a number of checkpoints (at least 1) or the word \"all\""
)]
pub enum Keep {
    /// The newest N (at least 1).
    Count(usize),
    /// `"all"`.
    All(KeepAll),
}

/// The word `all`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KeepAll {
    All,
}

/// Every setting of a training run. Paths are relative to the recipe
/// file's folder when read from one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Recipe {
    /// Checkpoint to start from (Hugging Face layout). Required.
    pub model: Option<PathBuf>,
    /// Training tasks (JSONL, any format `tasks` reads). Required.
    pub tasks: Option<PathBuf>,
    /// Held-out tasks for `eval_every`. Default none.
    pub eval_tasks: Option<PathBuf>,
    /// Sandbox backend. Default "local".
    pub backend: SandboxBackend,
    /// Optimizer updates to run. Default 100.
    pub steps: u64,
    /// Attempts per task (G); advantages are relative to the group. Default 8.
    pub group_size: usize,
    /// Complete groups per update (B). Default 4.
    pub groups_per_step: usize,
    /// Most weight versions a trained token may lag the trainer. Default 4.
    pub max_staleness: u64,
    /// Over-stale trajectories: "drop" or "mask". Default "drop".
    pub stale: StalePolicy,
    /// Rollouts in flight at once (each holds one sandbox). Default 8.
    pub concurrency: usize,
    /// Engine replicas. Default 1.
    pub replicas: usize,
    /// Data-parallel trainer ranks, each with its own copy of the weights,
    /// read by its own replicas (replica r is rank r mod ranks's); every
    /// rank trains on its share of each batch, gradients are summed across
    /// them and every rank takes the same step, so no weights are ever
    /// copied between them. `replicas` must be a multiple. Default 1.
    pub ranks: usize,
    /// Where the engines run and the trainer steps: "cpu", or "cuda:N" in
    /// a build with the `cuda` feature (rank r and its replicas on
    /// cuda:N+r). Default "cpu".
    #[serde(with = "device_key")]
    pub device: Device,
    /// With several ranks, compare a checksum of every rank's weights
    /// every this many updates, recorded in the metrics (0: never).
    /// Default 10.
    pub checksum_every: u64,
    /// Seed of the task order. Default 0.
    pub seed: u64,
    /// Peak learning rate. Default 1e-6.
    pub lr: f64,
    /// Linear warmup updates. Default 0.
    pub warmup: u64,
    /// The learning rate after the warmup: "constant" (the default) or
    /// "cosine", half a cosine from `lr` down to `min_lr` at update
    /// `decay_steps`, then `min_lr`.
    pub lr_decay: LrDecay,
    /// Where the cosine decay ends. Default 0.0.
    pub min_lr: f64,
    /// The update at which the cosine decay reaches `min_lr`; the updates
    /// after it hold `min_lr` (a run that fits, then holds the fit).
    /// 0 (the default): `steps`.
    pub decay_steps: u64,
    /// AdamW decoupled weight decay. Default 0.0.
    pub weight_decay: f64,
    /// AdamW beta1. Default 0.9.
    pub beta1: f64,
    /// AdamW beta2. Default 0.999.
    pub beta2: f64,
    /// AdamW epsilon. Default 1e-8.
    pub eps: f64,
    /// Global gradient-norm clip; 0 = off. Default 1.0.
    pub grad_clip: f64,
    /// Tokens per trainer micro-batch. Default 16384.
    pub micro_batch_tokens: usize,
    /// Train on each group's shared prompt once instead of once per
    /// attempt (same log-probs, same gradient to fp32 rounding, fewer
    /// tokens; CPU trainer only). Default true.
    pub share_prefixes: bool,
    /// PPO lower clip (`1 - clip_low`). Default 0.2.
    pub clip_low: f64,
    /// PPO upper clip, clip-higher (`1 + clip_high`). Default 0.28.
    pub clip_high: f64,
    /// Cap of the truncated importance weight. Default 2.0.
    pub tis_cap: f64,
    /// k3 KL coefficient to the behaviour policy. Default 0.0.
    pub kl_coef: f64,
    /// k3 KL coefficient to the run's starting model (`model`), held frozen
    /// by the trainer: one more forward per micro-batch and one more copy
    /// of the weights. Default 0.0.
    pub ref_kl_coef: f64,
    /// Entropy bonus coefficient. Default 0.0.
    pub entropy_coef: f64,
    /// Leave out of the loss every token the engine sampled with a
    /// probability below this (see `PgConfig::min_token_prob`); 0 = off.
    /// Default 1e-4.
    pub min_token_prob: f64,
    /// Divide group advantages by the group's standard deviation. Default false.
    pub advantage_std: bool,
    /// Leave out groups whose rewards are all equal (they carry no signal
    /// and would dilute the token mean); counted either way. Default true.
    pub filter_zero_variance: bool,
    /// A rollout cut by a token or turn budget: "zero" (reward 0) or
    /// "mask" (left out of the loss, counted). Default "zero".
    pub overlong: Overlong,
    /// DAPO's dynamic sampling: an update waits for B groups whose rewards
    /// differ, consuming (and counting, `extra_groups`) the zero-variance
    /// ones that came between; at most `dynamic_max_groups` groups per
    /// update. Default false.
    pub dynamic_sampling: bool,
    /// Cap of the groups one update may consume with dynamic sampling.
    /// Default 32.
    pub dynamic_max_groups: usize,
    /// Ablation: reward subtracted per 1,000 generated tokens before the
    /// advantages (the source saw it lift the early peak, then collapse a
    /// run). Default 0.0 (off).
    pub length_penalty: f64,
    /// Retire a task as mastered when every attempt of its last N visits
    /// was solved; 0 = never. Default 2.
    pub retire_after: usize,
    /// Retire a task as hopeless when every attempt of its last N visits
    /// failed; 0 = never. Default 0.
    pub drop_after: usize,
    /// End the run when this many updates in a row solved nothing and
    /// trained nothing (every graded attempt failed, so every group was
    /// zero-variance and left out): the weights can no longer change, so
    /// neither can what the run samples. 0 = never. Default 10.
    pub stop_after_dead_updates: u64,
    /// After this many dead updates in a row (as above), put back the
    /// weights and optimizer state of the newest checkpoint written before
    /// the collapse, as a new weight version, and go on; rollouts sampled
    /// before it are discarded. Only a run that was alive since that
    /// checkpoint rolls back, at most `max_rollbacks` times; then the stop
    /// above still applies. 0 = never. Default 3.
    pub rollback_after_dead_updates: u64,
    /// Rollbacks a run may take. Default 2.
    pub max_rollbacks: u64,
    /// Re-run retired tasks with frozen weights every N updates; 0 = never.
    /// Default 20.
    pub recheck_every: u64,
    /// Attempts per retired task in a recheck. Default 4.
    pub recheck_attempts: usize,
    /// A mastered task whose recheck reward falls below this comes back.
    /// Default 0.75.
    pub unretire_below: f64,
    /// pass@1 on `eval_tasks` every N updates (and before the first); 0 =
    /// never. Default 10.
    pub eval_every: u64,
    /// Attempts per held-out task. Default 4.
    pub eval_attempts: usize,
    /// Attempts per held-out task in the evaluations before the first
    /// update and after the last, whose difference the run reports with
    /// its standard error; 0 = `eval_attempts`. Default 0.
    pub eval_end_attempts: usize,
    /// Every N updates, probe the engine/trainer identity (`rl::probe`):
    /// a live replica samples `probe_tokens` tokens from a prompt of the
    /// batch just trained, at the new weights, and the trainer scores them
    /// with a frozen copy of those weights (`probe_mismatch_*` in the
    /// metrics). It measures the same-version mismatch however far behind
    /// the loop runs. Each probe clones the weights once. 0 = never.
    /// Default 0.
    pub probe_every: u64,
    /// Tokens a probe samples. Default 32.
    pub probe_tokens: usize,
    /// Checkpoint every N updates (and at the end); 0 = only at the end.
    /// Default 10.
    pub checkpoint_every: u64,
    /// Checkpoints kept: a count or "all". Default 3.
    pub keep_checkpoints: Keep,
    /// Longest a rollout may take, grading included, before it is abandoned
    /// as infra. Default 3600.
    pub rollout_timeout_secs: f64,
    /// Longest the trainer waits for the rollouts of an update before the
    /// run fails (a stuck sandbox or engine never hangs a run). Default 7200.
    pub batch_timeout_secs: f64,
    /// Engine KV and state cache per replica, MiB. Default 256.
    pub engine_cache_mib: usize,
    /// Ablation: the engine's recurrent and conv state between steps,
    /// "f32" or "bf16" (rounded after every step; the trainer stays fp32).
    /// Default "f32".
    pub state_dtype: StateDtype,
    /// Ablation when false: in-flight sequences keep the caches the old
    /// weights computed across an update. Default true.
    pub rebuild_caches: bool,
    /// On GPUs, the deterministic mode for engines and trainer ranks alike:
    /// forward products on an in-order kernel instead of cuBLAS, so a
    /// token's log-prob does not depend on what it was batched with (the
    /// CPU's same-version identity; slower forwards). Default false.
    pub batch_invariant: bool,
    /// How rollouts reach replicas: "least_loaded" (each request to the
    /// replica with the least outstanding work) or "pinned" (every turn of
    /// a rollout on the replica its id picks, for cache reuse; an
    /// ablation). Default "least_loaded".
    pub routing: Routing,
    /// The rollout harness: budgets, gates, temperature, prompts.
    pub rollout: RolloutConfig,
}

impl Default for Recipe {
    fn default() -> Self {
        Recipe {
            model: None,
            tasks: None,
            eval_tasks: None,
            backend: SandboxBackend::Local,
            steps: 100,
            group_size: 8,
            groups_per_step: 4,
            max_staleness: 4,
            stale: StalePolicy::Drop,
            concurrency: 8,
            replicas: 1,
            ranks: 1,
            device: Device::Cpu,
            checksum_every: 10,
            seed: 0,
            lr: 1e-6,
            warmup: 0,
            lr_decay: LrDecay::Constant,
            min_lr: 0.0,
            decay_steps: 0,
            weight_decay: 0.0,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            grad_clip: 1.0,
            micro_batch_tokens: 16384,
            share_prefixes: true,
            clip_low: 0.2,
            clip_high: 0.28,
            tis_cap: 2.0,
            kl_coef: 0.0,
            ref_kl_coef: 0.0,
            entropy_coef: 0.0,
            min_token_prob: 1e-4,
            advantage_std: false,
            filter_zero_variance: true,
            overlong: Overlong::Zero,
            dynamic_sampling: false,
            dynamic_max_groups: 32,
            length_penalty: 0.0,
            retire_after: 2,
            drop_after: 0,
            stop_after_dead_updates: 10,
            rollback_after_dead_updates: 3,
            max_rollbacks: 2,
            recheck_every: 20,
            recheck_attempts: 4,
            unretire_below: 0.75,
            eval_every: 10,
            eval_attempts: 4,
            eval_end_attempts: 0,
            probe_every: 0,
            probe_tokens: 32,
            checkpoint_every: 10,
            keep_checkpoints: Keep::Count(3),
            rollout_timeout_secs: 3600.0,
            batch_timeout_secs: 7200.0,
            engine_cache_mib: 256,
            state_dtype: StateDtype::F32,
            rebuild_caches: true,
            batch_invariant: false,
            routing: Routing::LeastLoaded,
            rollout: RolloutConfig::default(),
        }
    }
}

/// Parses `key=value`: the value as a TOML value when it is one
/// (`3`, `1e-4`, `true`, `"x"`, `[1, 2]`), else as a bare string.
/// A [`Device`] in a recipe: its name ("cpu", "cuda:N").
mod device_key {
    use arcticd_kernels::Device;
    use serde::{de::Error as _, Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(d)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(D::Error::custom)
    }
}

fn parse_set(kv: &str) -> Result<(Vec<String>, toml::Value)> {
    let (k, v) = kv
        .split_once('=')
        .ok_or_else(|| Error::Recipe(format!("--set {kv:?}: expected key=value")))?;
    let key: Vec<String> = k.trim().split('.').map(|p| p.trim().to_string()).collect();
    if key.iter().any(|p| p.is_empty()) {
        return Err(Error::Recipe(format!("--set {kv:?}: empty key")));
    }
    let v = v.trim();
    let value = toml::from_str::<toml::Table>(&format!("x = {v}"))
        .ok()
        .and_then(|mut t| t.remove("x"))
        .unwrap_or_else(|| toml::Value::String(v.to_string()));
    Ok((key, value))
}

impl Recipe {
    /// Parses recipe text; `origin` names it in errors.
    pub fn from_toml(text: &str, origin: &str) -> Result<Self> {
        Self::from_toml_with(text, origin, &[])
    }

    /// Parses recipe text with `key=value` overrides applied on top.
    pub fn from_toml_with(text: &str, origin: &str, sets: &[String]) -> Result<Self> {
        // Parse once as it is, so a bad key's error points at its line.
        let base: Recipe = toml::from_str(text)
            .map_err(|e| Error::Recipe(format!("{origin}: {}", plain_types(&e.to_string()))))?;
        if sets.is_empty() {
            return base.checked();
        }
        let mut table: toml::Table = toml::from_str(text)
            .map_err(|e| Error::Recipe(format!("{origin}: {}", plain_types(&e.to_string()))))?;
        for kv in sets {
            let (key, value) = parse_set(kv)?;
            let mut t = &mut table;
            for part in &key[..key.len() - 1] {
                let entry = t
                    .entry(part.clone())
                    .or_insert_with(|| toml::Value::Table(Default::default()));
                t = entry
                    .as_table_mut()
                    .ok_or_else(|| Error::Recipe(format!("--set {kv:?}: {part} is not a table")))?;
            }
            t.insert(key[key.len() - 1].clone(), value);
        }
        let r: Recipe = toml::Value::Table(table).try_into().map_err(|e| {
            Error::Recipe(format!(
                "{origin} with --set {sets:?}: {}",
                plain_types(&e.to_string())
            ))
        })?;
        r.checked()
    }

    /// Reads a recipe file. A relative path in the file is taken from the
    /// file's folder, one given by `--set` from the working folder; both
    /// are made absolute, so the run's own `recipe.toml` (which `--resume`
    /// reads from the run folder) names the same files.
    pub fn from_file(path: &Path, sets: &[String]) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let mut r = Self::from_toml_with(&text, &path.display().to_string(), sets)?;
        let folder = path.parent().unwrap_or(Path::new(""));
        let set_here = |key: &str| {
            sets.iter()
                .any(|kv| kv.split_once('=').is_some_and(|(k, _)| k.trim() == key))
        };
        for (key, p) in [
            ("model", &mut r.model),
            ("tasks", &mut r.tasks),
            ("eval_tasks", &mut r.eval_tasks),
        ] {
            if let Some(p) = p {
                let from = if set_here(key) { Path::new("") } else { folder };
                *p = std::path::absolute(from.join(&*p))
                    .map_err(|e| Error::Recipe(format!("{key} {}: {e}", p.display())))?;
            }
        }
        Ok(r)
    }

    /// The recipe as TOML (what `RUN_DIR/recipe.toml` holds).
    pub fn to_toml(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| Error::Recipe(format!("writing the recipe: {e}")))
    }

    /// What differs from `earlier` (a recipe as TOML, written by
    /// [`to_toml`](Self::to_toml)), one `key: old -> new` per setting, in
    /// key order; a key the earlier recipe lacks shows as `(none)`.
    pub fn changes_from(&self, earlier: &str) -> Result<Vec<String>> {
        fn flat(
            prefix: &str,
            v: &toml::Value,
            out: &mut std::collections::BTreeMap<String, String>,
        ) {
            match v {
                toml::Value::Table(t) => {
                    for (k, v) in t {
                        let key = if prefix.is_empty() {
                            k.clone()
                        } else {
                            format!("{prefix}.{k}")
                        };
                        flat(&key, v, out);
                    }
                }
                other => {
                    out.insert(prefix.to_string(), other.to_string());
                }
            }
        }
        let parse = |text: &str| -> Result<std::collections::BTreeMap<String, String>> {
            let v: toml::Value = toml::from_str(text)
                .map_err(|e| Error::Recipe(format!("an earlier recipe: {e}")))?;
            let mut out = std::collections::BTreeMap::new();
            flat("", &v, &mut out);
            Ok(out)
        };
        let (old, new) = (parse(earlier)?, parse(&self.to_toml()?)?);
        let none = "(none)".to_string();
        let keys: std::collections::BTreeSet<&String> = old.keys().chain(new.keys()).collect();
        Ok(keys
            .into_iter()
            .filter_map(|k| {
                let (a, b) = (old.get(k).unwrap_or(&none), new.get(k).unwrap_or(&none));
                (a != b).then(|| format!("{k}: {a} -> {b}"))
            })
            .collect())
    }

    /// Rejects values the loop cannot run with.
    pub fn checked(self) -> Result<Self> {
        let bad = |m: &str| Err(Error::Recipe(m.to_string()));
        if self.steps == 0 {
            return bad("steps must be at least 1 (a run of 0 updates trains nothing)");
        }
        if self.group_size < 2 {
            return bad("group_size must be at least 2 (advantages are relative to the group)");
        }
        if self.groups_per_step == 0 {
            return bad("groups_per_step must be at least 1");
        }
        if self.concurrency == 0 || self.replicas == 0 || self.ranks == 0 {
            return bad("concurrency, replicas and ranks must be at least 1");
        }
        if !self.replicas.is_multiple_of(self.ranks) {
            return bad("replicas must be a multiple of ranks (each rank's weights are read by its own replicas)");
        }
        // The checks the rollouts and the optimizer make themselves, now.
        let recipe = |prefix: &'static str| {
            move |e: Error| match e {
                Error::Input(m) => Error::Recipe(format!("{prefix}{m}")),
                e => e,
            }
        };
        self.rollout.check().map_err(recipe("rollout."))?;
        self.train_config().optimizer.check().map_err(recipe(""))?;
        if !(self.min_lr.is_finite() && self.min_lr >= 0.0 && self.min_lr <= self.lr) {
            return bad("min_lr must be a finite number between 0 and lr");
        }
        if self.decay_steps > 0 && self.decay_steps <= self.warmup {
            return bad("decay_steps must be past warmup (0 = steps)");
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad("grad_clip must be a finite number >= 0 (0 = off)");
        }
        if !(self.clip_low.is_finite() && (0.0..1.0).contains(&self.clip_low)) {
            return bad("clip_low must be in [0, 1) (the ratio's floor is 1 - clip_low)");
        }
        if !(self.clip_high.is_finite() && self.clip_high >= 0.0) {
            return bad(
                "clip_high must be a finite number >= 0 (the ratio's ceiling is 1 + clip_high)",
            );
        }
        if !(self.tis_cap.is_finite() && self.tis_cap > 0.0) {
            return bad("tis_cap must be a finite number > 0");
        }
        if self.probe_every > 0 && self.probe_tokens == 0 {
            return bad("probe_tokens must be at least 1 when probe_every is on");
        }
        check_secs("rollout_timeout_secs", self.rollout_timeout_secs, None).map_err(recipe(""))?;
        check_secs("batch_timeout_secs", self.batch_timeout_secs, None).map_err(recipe(""))?;
        if matches!(self.keep_checkpoints, Keep::Count(0)) {
            return bad("keep_checkpoints must be at least 1 or \"all\"");
        }
        if self.micro_batch_tokens == 0 || self.engine_cache_mib == 0 {
            return bad("micro_batch_tokens and engine_cache_mib must be positive");
        }
        if !(self.min_token_prob.is_finite() && (0.0..1.0).contains(&self.min_token_prob)) {
            return bad("min_token_prob must be a number in [0, 1) (0 = off)");
        }
        for (name, v) in [
            ("kl_coef", self.kl_coef),
            ("ref_kl_coef", self.ref_kl_coef),
            ("entropy_coef", self.entropy_coef),
        ] {
            // A negative coefficient would reward drifting from the
            // reference, or collapsing the entropy.
            if !(v.is_finite() && v >= 0.0) {
                return Err(Error::Recipe(format!(
                    "{name} must be a finite number >= 0 (0 = off)"
                )));
            }
        }
        if !(self.unretire_below.is_finite() && (0.0..=1.0).contains(&self.unretire_below)) {
            return bad("unretire_below must be a number in [0, 1] (a recheck's mean reward)");
        }
        if self.recheck_every > 0 && self.recheck_attempts == 0 {
            return bad("recheck_attempts must be at least 1 when recheck_every is on");
        }
        if self.eval_every > 0 && self.eval_attempts == 0 {
            return bad(
                "eval_attempts must be at least 1 when eval_every is on (eval_every = 0 turns \
                 the evaluation off)",
            );
        }
        if !(self.length_penalty.is_finite() && self.length_penalty >= 0.0) {
            return bad("length_penalty must be a finite number >= 0 (0 = off)");
        }
        Ok(self)
    }

    /// The ablation switches that are on, in words: measurements that
    /// leave the full recipe, said loudly at the start of a run.
    pub fn ablations(&self) -> Vec<String> {
        let mut on = Vec::new();
        let gates = [
            (self.rollout.gate_format, "rollout.gate_format = false: malformed turns get a hint and the rollout goes on"),
            (self.rollout.gate_duplicate, "rollout.gate_duplicate = false: repeated calls get a hint and the rollout goes on"),
            (self.rollout.gate_length, "rollout.gate_length = false: a turn cut at the token limit gets a hint and the rollout goes on"),
        ];
        on.extend(gates.iter().filter(|(g, _)| !g).map(|(_, w)| w.to_string()));
        if self.rollout.format_check == FormatCheck::Lenient {
            on.push("rollout.format_check = \"lenient\": turns are judged after a forgiving parse, not on their raw text".into());
        }
        if self.routing == Routing::Pinned {
            on.push("routing = \"pinned\": every turn of a rollout goes to one replica, whatever its load".into());
        }
        if !self.rebuild_caches {
            on.push("rebuild_caches = false: in-flight sequences keep the old weights' caches across an update".into());
        }
        if self.state_dtype == StateDtype::Bf16 {
            on.push("state_dtype = \"bf16\": the engine rounds its recurrent and conv state to bf16 after every step; the trainer stays fp32".into());
        }
        if self.length_penalty > 0.0 {
            on.push(format!(
                "length_penalty = {}: reward minus that per 1,000 generated tokens",
                self.length_penalty
            ));
        }
        on
    }

    /// The settings of every engine of the run (the training replicas and
    /// the frozen ones that score held-out and retired tasks), on `device`
    /// (rank 0's; the replicas of rank r are on its own).
    pub fn engine_config(&self) -> EngineConfig {
        EngineConfig {
            device: self.device,
            cache_memory: self.engine_cache_mib << 20,
            max_model_len: self
                .rollout
                .max_context_tokens
                .max(self.rollout.max_new_tokens.saturating_add(1))
                .max(1024),
            state_dtype: self.state_dtype,
            rebuild_caches: self.rebuild_caches,
            batch_invariant: self.batch_invariant,
            ..EngineConfig::default()
        }
    }

    /// The trainer's settings. A key read here is one `arcticd replay`
    /// may change: list it in `replay::REPLAY_KEYS`.
    pub fn train_config(&self) -> TrainConfig {
        TrainConfig {
            optimizer: AdamWConfig {
                lr: self.lr,
                beta1: self.beta1,
                beta2: self.beta2,
                eps: self.eps,
                weight_decay: self.weight_decay,
            },
            schedule: if self.lr_decay == LrDecay::Cosine {
                LrSchedule::Cosine {
                    warmup: self.warmup,
                    total: if self.decay_steps > 0 {
                        self.decay_steps
                    } else {
                        self.steps
                    },
                    floor: if self.lr > 0.0 {
                        self.min_lr / self.lr
                    } else {
                        0.0
                    },
                }
            } else if self.warmup > 0 {
                LrSchedule::LinearWarmup {
                    warmup: self.warmup,
                }
            } else {
                LrSchedule::Constant
            },
            grad_clip: (self.grad_clip > 0.0).then_some(self.grad_clip),
            micro_batch_tokens: self.micro_batch_tokens,
            recompute_layers: false,
            share_prefixes: self.share_prefixes,
            pg: PgConfig {
                clip_low: self.clip_low,
                clip_high: self.clip_high,
                tis_cap: self.tis_cap,
                kl_coef: self.kl_coef,
                ref_kl_coef: self.ref_kl_coef,
                entropy_coef: self.entropy_coef,
                min_token_prob: self.min_token_prob,
                temperature: self.rollout.temperature,
                ..PgConfig::default()
            },
            checksum_every: self.checksum_every,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_from_names_edited_and_removed_settings() {
        let sets = ["steps=7".to_string(), "rollout.max_turns=3".to_string()];
        let first = Recipe::from_toml_with("", "test", &sets).unwrap();
        let text = first.to_toml().unwrap();
        assert!(first.changes_from(&text).unwrap().is_empty());
        // A user's edit of RUN_DIR/recipe.toml: one key removed, one changed.
        let edited: String = text
            .lines()
            .filter(|l| !l.starts_with("steps ="))
            .map(|l| {
                if l.starts_with("max_turns =") {
                    "max_turns = 5\n".to_string()
                } else {
                    format!("{l}\n")
                }
            })
            .collect();
        let now = Recipe::from_toml_with(&edited, "test", &[]).unwrap();
        let default_steps = Recipe::default().steps;
        assert_eq!(
            now.changes_from(&text).unwrap(),
            vec![
                "rollout.max_turns: 3 -> 5".to_string(),
                format!("steps: 7 -> {default_steps}"),
            ]
        );
    }

    #[test]
    fn ablations_are_off_by_default_and_named_when_on() {
        assert!(Recipe::default().ablations().is_empty());
        let r = Recipe::from_toml_with(
            "",
            "test",
            &[
                "rollout.gate_format=false".into(),
                "length_penalty=0.5".into(),
                "rollout.format_check=lenient".into(),
                "routing=pinned".into(),
                "rebuild_caches=false".into(),
                "state_dtype=bf16".into(),
            ],
        )
        .unwrap();
        let a = r.ablations();
        assert_eq!(a.len(), 6, "{a:?}");
        for (said, key) in a.iter().zip([
            "rollout.gate_format",
            "rollout.format_check",
            "routing",
            "rebuild_caches",
            "state_dtype",
            "length_penalty",
        ]) {
            assert!(said.starts_with(key), "{said} should name {key}");
        }
        let e = r.engine_config();
        assert!(e.state_dtype == StateDtype::Bf16 && !e.rebuild_caches);
        let e = Recipe::default().engine_config();
        assert!(e.state_dtype == StateDtype::F32 && e.rebuild_caches);
        assert!(Recipe::from_toml_with("", "test", &["state_dtype=fp8".into()]).is_err());
        assert!(Recipe::from_toml_with("", "test", &["routing=random".into()]).is_err());
        assert!(Recipe::from_toml_with("", "test", &["length_penalty=-1".into()]).is_err());
        assert!(Recipe::from_toml_with("", "test", &["overlong=\"cut\"".into()]).is_err());
    }

    #[test]
    fn default_toml_documents_the_defaults() {
        let text = include_str!("../../../recipes/default.toml");
        let r = Recipe::from_toml(text, "recipes/default.toml").unwrap();
        assert_eq!(r, Recipe::default());
    }

    /// The stress test's recipe parses, keeps every task in the pool, and
    /// rolls out in the setting the warm start was trained for, sampled at
    /// temperature 0.7; it fits for 200 updates and holds for 100.
    #[test]
    fn overfit_recipe_parses_and_keeps_the_warm_starts_setting() {
        let text = include_str!("../../../recipes/overfit.toml");
        let r = Recipe::from_toml(text, "recipes/overfit.toml").unwrap();
        assert_eq!(r.retire_after, 0);
        let mut warm = crate::warm_start::demo_rollout_config();
        warm.temperature = 0.7;
        assert_eq!(r.rollout, warm);
        let s = r.train_config().schedule;
        assert!(r.min_lr > 0.0 && r.min_lr < r.lr);
        assert!(r.lr * s.factor(199) > r.min_lr);
        for step in [200, r.steps - 1] {
            assert!((r.lr * s.factor(step) - r.min_lr).abs() < 1e-12, "{step}");
        }
        assert!(r.ablations().is_empty());
    }

    #[test]
    fn unknown_keys_are_named_with_their_line() {
        let e = Recipe::from_toml("steps = 3\nstepz = 4\n", "r.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("stepz") && e.contains("line 2"), "{e}");
        let e = Recipe::from_toml("[rollout]\nmax_turnz = 4\n", "r.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_turnz"), "{e}");
    }

    #[test]
    fn sets_override_and_are_checked() {
        let sets = vec![
            "steps=7".to_string(),
            "rollout.max_turns=3".into(),
            "stale=mask".into(),
            "keep_checkpoints=all".into(),
            "lr=1e-4".into(),
        ];
        let r = Recipe::from_toml_with("steps = 3\n", "r.toml", &sets).unwrap();
        assert_eq!(r.steps, 7);
        assert_eq!(r.rollout.max_turns, 3);
        assert_eq!(r.stale, StalePolicy::Mask);
        assert_eq!(r.keep_checkpoints, Keep::All(KeepAll::All));
        assert_eq!(r.lr, 1e-4);
        assert!(Recipe::from_toml_with("", "r", &["nokey=1".into()]).is_err());
        assert!(Recipe::from_toml_with("", "r", &["steps".into()]).is_err());
        assert!(Recipe::from_toml("group_size = 1\n", "r").is_err());
        let err = Recipe::from_toml("ranks = 2\n", "r")
            .unwrap_err()
            .to_string();
        assert!(err.contains("multiple of ranks"), "{err}");
        assert!(Recipe::from_toml("ranks = 2\nreplicas = 4\n", "r").is_ok());
        assert!(Recipe::from_toml("ranks = 0\n", "r").is_err());
        let r = Recipe::from_toml_with("", "r", &["device=cuda:1".into()]).unwrap();
        assert_eq!(r.device, Device::Cuda(1));
        assert!(r.to_toml().unwrap().contains("device = \"cuda:1\""));
        let err = Recipe::from_toml("device = \"gpu\"\n", "r").unwrap_err();
        assert!(
            err.to_string().contains("expected cpu, cuda or cuda:N"),
            "{err}"
        );
        let on_gpu = "device = \"cuda\"\nentropy_coef = 0.01\nref_kl_coef = 0.01\n";
        assert!(Recipe::from_toml(on_gpu, "r").is_ok());
        assert!(Recipe::from_toml("stale = \"sometimes\"\n", "r").is_err());
        // A wrong type is said as a user reads it, not as Rust names it.
        let err = Recipe::from_toml("steps = \"many\"\n", "r")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("expected a whole number from 0") && !err.contains("u64"),
            "{err}"
        );
        let err = Recipe::from_toml_with("", "r", &["lr=abc".into()])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("expected a number") && !err.contains("f64"),
            "{err}"
        );
    }

    #[test]
    fn cosine_decay_reaches_min_lr_at_the_last_update() {
        let r = Recipe::from_toml(
            "steps = 100\nlr = 3e-4\nwarmup = 10\nlr_decay = \"cosine\"\nmin_lr = 3e-5\n",
            "r",
        )
        .unwrap();
        let s = r.train_config().schedule;
        let lr = |step: u64| r.lr * s.factor(step);
        assert!((lr(5) - 1.5e-4).abs() < 1e-12);
        assert!((lr(10) - 3e-4).abs() < 1e-12);
        assert!((lr(55) - 1.65e-4).abs() < 1e-12);
        assert!((lr(100) - 3e-5).abs() < 1e-12);
        assert!((lr(300) - 3e-5).abs() < 1e-12);
        assert_eq!(
            Recipe::default().train_config().schedule,
            LrSchedule::Constant
        );
        assert!(Recipe::from_toml("lr = 1e-4\nmin_lr = 1e-3\n", "r").is_err());
        assert!(Recipe::from_toml("warmup = 10\ndecay_steps = 10\n", "r").is_err());
        assert!(Recipe::from_toml("lr_decay = \"linear\"\n", "r").is_err());
        // With decay_steps the floor comes before the last update and holds.
        let r = Recipe::from_toml(
            "steps = 300\nlr = 3e-4\nwarmup = 10\nlr_decay = \"cosine\"\nmin_lr = 3e-5\n\
             decay_steps = 200\n",
            "r",
        )
        .unwrap();
        let s = r.train_config().schedule;
        let lr = |step: u64| r.lr * s.factor(step);
        assert!((lr(10) - 3e-4).abs() < 1e-12);
        assert!((lr(105) - 1.65e-4).abs() < 1e-12);
        for step in [200, 250, 299] {
            assert!((lr(step) - 3e-5).abs() < 1e-12, "{step}");
        }
        assert!(lr(199) > 3e-5);
    }

    #[test]
    fn values_no_run_can_use_are_refused_before_it_starts() {
        for (set, says) in [
            ("rollout_timeout_secs=nan", "rollout_timeout_secs"),
            ("batch_timeout_secs=1e300", "batch_timeout_secs"),
            ("rollout.max_wall_secs=inf", "rollout.max_wall_secs"),
            ("rollout.test_timeout_secs=0.0", "rollout.test_timeout_secs"),
            ("rollout.max_new_tokens=0", "rollout.max_new_tokens"),
            ("rollout.temperature=-1.0", "rollout.temperature"),
            ("lr=nan", "AdamW: lr must be a finite number"),
            ("beta1=1.0", "beta1"),
            ("beta2=1.5", "beta2"),
            ("eps=0.0", "eps"),
            ("weight_decay=-0.1", "weight_decay"),
            ("clip_low=2.0", "clip_low"),
            ("clip_high=-1.0", "clip_high"),
            ("tis_cap=0.0", "tis_cap"),
            ("steps=0", "steps must be at least 1"),
            (
                "unretire_below=5.0",
                "unretire_below must be a number in [0, 1]",
            ),
            ("recheck_attempts=0", "recheck_attempts must be at least 1"),
            ("eval_attempts=0", "eval_attempts must be at least 1"),
            (
                "keep_checkpoints=\"some\"",
                "a number of checkpoints (at least 1) or the word \"all\"",
            ),
        ] {
            let e = Recipe::from_toml_with("", "r", &[set.to_string()])
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{set}: {e}");
        }
        // Zero is "no limit" for the rollout's wall time.
        Recipe::from_toml_with("", "r", &["rollout.max_wall_secs=0.0".into()]).unwrap();
    }

    #[test]
    fn recipe_paths_are_absolute_from_the_file_or_the_working_folder() {
        // Unit tests run in the crate's folder.
        let file = Path::new("../recipes/default.toml");
        let sets = [
            "model = \"m\"".to_string(),
            "tasks=\"t/tasks.jsonl\"".to_string(),
        ];
        let r = Recipe::from_file(file, &sets).unwrap();
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(r.model.unwrap(), cwd.join("m"));
        assert_eq!(r.tasks.unwrap(), cwd.join("t/tasks.jsonl"));
        // In the file: from the file's folder (here through the run's
        // written recipe, read back as `--resume` reads it).
        let dir = tempfile::tempdir().unwrap();
        let rel = Recipe {
            model: Some("m".into()),
            eval_tasks: Some("../e.jsonl".into()),
            ..Recipe::default()
        };
        std::fs::write(dir.path().join("r.toml"), rel.to_toml().unwrap()).unwrap();
        let r = Recipe::from_file(&dir.path().join("r.toml"), &[]).unwrap();
        assert_eq!(r.model.as_deref(), Some(dir.path().join("m").as_path()));
        assert!(r.eval_tasks.as_ref().unwrap().is_absolute());
        std::fs::write(dir.path().join("again.toml"), r.to_toml().unwrap()).unwrap();
        let again = Recipe::from_file(&dir.path().join("again.toml"), &[]).unwrap();
        assert_eq!(again, r);
    }

    #[test]
    fn resolved_recipe_round_trips() {
        let r = Recipe {
            model: Some("m".into()),
            ..Recipe::default()
        };
        let back = Recipe::from_toml(&r.to_toml().unwrap(), "x").unwrap();
        assert_eq!(back, r);
    }
}
