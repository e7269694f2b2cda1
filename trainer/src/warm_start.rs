//! The warm start of the built-in RL demo: a model that already solves a
//! share of toy tasks when sampling, so that RL has reward to learn from,
//! and has something left to learn from reward.
//!
//! A scripted teacher views the buggy file, replaces the buggy line with
//! the fixed one (both read off the task's gold patch) and submits. On a
//! seeded share of the demonstrations (`give_up_share`, default one half)
//! it gives up instead: it views the file and submits it unchanged. Its
//! turns run through the real harness and sandbox ([`Harness::rollout`]
//! with a [`ScriptedPolicy`]), so the SFT data holds exactly the tokens the
//! model will see in RL: the prompt and observations as context, the
//! generated turns as targets. Every demonstration that ran as scripted is
//! kept, the giving-up ones too: this is a teacher's unfiltered data, as
//! when a weaker model's trajectories are distilled without a reward
//! filter. The student learns the format and the fix from all of them and
//! gives up on about half of its attempts; RL has to learn from reward that
//! giving up does not pay. SFT (AdamW, clipped, cosine) gives the
//! warm-started checkpoint.
//!
//! [`build_warm_start`] does it all: a fresh model of a preset, a toy pool
//! of demonstration tasks (one fixed package path, no loose tasks; use a
//! seed the RL pool and the held-out set do not use), the teacher's
//! trajectories, SFT and the checkpoint. [`demo_rollout_config`] is the
//! short-prompt rollout setting the model is trained for; RL and eval must
//! use the same one.
//!
//! Measured on 2 CPU cores, with a teacher that never gives up (96 demos,
//! 300 steps of 8, lr 3e-3, clip 1): about 4 minutes to build, loss per
//! target token 7.9 to 0.01; pass@1 on held-out toy tasks 0.44-0.62
//! sampling at temperature 1 and 0.75-0.88 greedy. RL barely moves such a
//! model in 15 minutes (docs/demo.md). 150 steps leave it at 0.02 (T=1). A
//! trajectory is about 600 tokens: a 240-token prompt, two short
//! observations, and 87-127 generated tokens in two or three turns. The
//! demo's defaults (192 demos, half of them giving up) are measured in
//! docs/demo.md.
//!
//! Not for: RL itself, or tasks whose gold patch changes more than one line.

use crate::harness::format::render_call;
use crate::harness::{Harness, RolloutConfig, ScriptedPolicy, Termination, Trajectory};
pub use crate::sft::{sft_examples, train_sft, SftProgress, SftSettings};
use crate::step::SftExample;
use crate::{Error, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::tasks::{toy, Task};
use arcticd_sandbox::Backend;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// The system prompt of [`demo_rollout_config`].
pub const DEMO_SYSTEM_PROMPT: &str = "You fix bugs in Python repositories. Reply with one tool call per turn: view the file, replace the buggy line with str_replace, then submit.";

/// The instruction of [`demo_rollout_config`].
pub const DEMO_INSTRUCTION: &str = "Fix the bug, then call submit.";

/// The package every demonstration and demo task uses (`calc/core.py`).
pub const DEMO_PACKAGE: &str = "calc";

/// The rollout setting the warm start is trained for: the short prompt
/// without tool schemas, three turns of the expert plus slack, short turns.
pub fn demo_rollout_config() -> RolloutConfig {
    RolloutConfig {
        max_turns: 6,
        max_context_tokens: 4096,
        max_wall_secs: 300.0,
        max_new_tokens: 160,
        test_timeout_secs: 120.0,
        system_prompt: DEMO_SYSTEM_PROMPT.to_string(),
        instruction: DEMO_INSTRUCTION.to_string(),
        prompt_tools: false,
        ..RolloutConfig::default()
    }
}

/// The toy pool options of the demo (demonstrations, RL pool, held-out set
/// alike; they differ by seed): one fixed package, no loose tasks.
pub fn demo_toy_config(count: usize, seed: u64) -> toy::ToyConfig {
    toy::ToyConfig {
        count,
        seed,
        loose_share: 0.0,
        package: Some(DEMO_PACKAGE.to_string()),
    }
}

/// Settings of [`build_warm_start`]. An unknown key is an error (a typo
/// would otherwise run the defaults for half an hour).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct WarmStartConfig {
    /// Model preset of the fresh model (`init-model`'s). Default "demo".
    pub preset: String,
    /// Seed of the fresh model's weights. Default 0.
    pub init_seed: u64,
    /// Start from this checkpoint instead of a fresh model. Default None.
    pub base_model: Option<PathBuf>,
    /// Demonstration tasks (one teacher trajectory each). Default 192.
    pub demos: usize,
    /// Seed of the demonstration pool; keep it apart from the RL pool's and
    /// the held-out set's. Default 1000.
    pub demo_seed: u64,
    /// Expert rollouts at once. Default 2.
    pub concurrency: usize,
    /// Share of the demonstrations in which the teacher views the file and
    /// submits without a fix (reward 0). They are kept for SFT like the
    /// others: unfiltered data of a teacher that is right only some of the
    /// time, so the student learns the format from every demonstration and
    /// has to learn from reward, in RL, that submitting unfixed code does
    /// not pay. Default 0.5.
    pub give_up_share: f64,
    /// The SFT run (defaults: 600 steps of 8, lr 3e-3 with 10 warmup steps
    /// then cosine, clip 1, no weight decay).
    pub sft: SftSettings,
}

impl WarmStartConfig {
    /// Rejects settings no warm start can use (a preset that is not one,
    /// no demonstration, none at once, a give-up share outside [0, 1], bad
    /// SFT settings) before any image build or rollout.
    pub fn check(&self) -> Result<()> {
        if self.base_model.is_none() {
            arcticd_engine::init::preset(&self.preset)?;
        }
        if self.demos == 0 || self.concurrency == 0 {
            return Err(Error::Input(format!(
                "a warm start needs at least 1 demonstration and 1 at once, got demos {} and \
                 concurrency {}",
                self.demos, self.concurrency
            )));
        }
        if !(0.0..=1.0).contains(&self.give_up_share) {
            return Err(Error::Input(format!(
                "give_up_share is a share of the demonstrations, in [0, 1], got {}",
                self.give_up_share
            )));
        }
        self.sft.check()
    }
}

impl Default for WarmStartConfig {
    fn default() -> Self {
        WarmStartConfig {
            preset: "demo".into(),
            init_seed: 0,
            base_model: None,
            demos: 192,
            demo_seed: 1000,
            concurrency: 2,
            give_up_share: 0.5,
            sft: SftSettings {
                steps: 600,
                batch_size: 8,
                lr: 3e-3,
                warmup: 10,
                grad_clip: 1.0,
                weight_decay: 0.0,
                shuffle_seed: 0,
            },
        }
    }
}

/// What [`build_warm_start`] did.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct WarmStartReport {
    /// The warm-started checkpoint.
    pub model_dir: PathBuf,
    /// Expert rollouts run, how many went into SFT (the fixing ones that
    /// earned reward 1 and the giving-up ones that submitted), and how many
    /// of those gave up.
    pub demos: usize,
    pub kept: usize,
    pub gave_up: usize,
    /// Mean tokens of the initial prompt and of a whole kept trajectory,
    /// and mean generated (target) tokens per trajectory.
    pub prompt_tokens: f64,
    pub trajectory_tokens: f64,
    pub target_tokens: f64,
    /// SFT loss per target token: mean of the first and of the last 5 steps
    /// (fewer when there are under 10).
    pub first_loss: f64,
    pub last_loss: f64,
    /// Seconds spent on the expert rollouts, on SFT, and in all.
    pub rollout_secs: f64,
    pub sft_secs: f64,
    pub total_secs: f64,
}

/// The old and new line of a one-line gold patch, and its file.
fn one_line_fix(task: &Task) -> Result<(String, String, String)> {
    let (mut path, mut old, mut new) = (None, Vec::new(), Vec::new());
    for l in task.patch.lines() {
        if let Some(p) = l.strip_prefix("+++ b/") {
            if path.replace(p.to_string()).is_some() {
                return Err(Error::Input(format!(
                    "{}: the gold patch changes more than one file",
                    task.instance_id
                )));
            }
        } else if l.starts_with("--- ") || l.starts_with("+++ ") {
        } else if let Some(x) = l.strip_prefix('-') {
            old.push(x);
        } else if let Some(x) = l.strip_prefix('+') {
            new.push(x);
        }
    }
    match (path, old.as_slice(), new.as_slice()) {
        (Some(p), [o], [n]) => Ok((p, o.to_string(), n.to_string())),
        _ => Err(Error::Input(format!(
            "{}: the gold patch is not a one-line change of one file",
            task.instance_id
        ))),
    }
}

/// The raw assistant turns of the expert on `task`: view the file of the
/// gold patch, `str_replace` its old line by the new one, submit. Fails on
/// a gold patch that is not a one-line change of one file.
pub fn expert_turns(task: &Task) -> Result<Vec<String>> {
    let (path, old, new) = one_line_fix(task)?;
    let edit = "str_replace_based_edit_tool";
    Ok(vec![
        render_call(edit, &[("command", "view"), ("path", &path)]),
        render_call(
            edit,
            &[
                ("command", "str_replace"),
                ("path", &path),
                ("old_str", &old),
                ("new_str", &new),
            ],
        ),
        render_call("submit", &[]),
    ])
}

/// The teacher's turns when it gives up on `task`: view the file of the
/// gold patch, submit it unchanged.
pub fn give_up_turns(task: &Task) -> Result<Vec<String>> {
    let (path, _, _) = one_line_fix(task)?;
    Ok(vec![
        render_call(
            "str_replace_based_edit_tool",
            &[("command", "view"), ("path", &path)],
        ),
        render_call("submit", &[]),
    ])
}

/// Whether the teacher gives up on demonstration `i`: a seeded coin with
/// probability `share`, independent of the task. (Every other index would
/// not do: the toy pool assigns families by index, so the student would
/// learn "give up on these families", a per-task certainty whose groups
/// all fail alike and carry no RL signal.)
pub fn gives_up(i: usize, share: f64, seed: u64) -> bool {
    let mut z = (i as u64 ^ seed.rotate_left(32)).wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    ((z >> 11) as f64 / (1u64 << 53) as f64) < share
}

/// Runs the expert on every task through `harness`, `concurrency` at once,
/// giving up (see [`give_up_turns`]) on the tasks [`gives_up`] picks at
/// `give_up_share`; returns the trajectories in task order (all of them,
/// any reward).
pub async fn expert_trajectories(
    harness: &Harness,
    backend: &dyn Backend,
    tasks: &[Task],
    concurrency: usize,
    give_up_share: f64,
    give_up_seed: u64,
) -> Result<Vec<Trajectory>> {
    let mut scripts = Vec::with_capacity(tasks.len());
    for (i, t) in tasks.iter().enumerate() {
        scripts.push(if gives_up(i, give_up_share, give_up_seed) {
            give_up_turns(t)?
        } else {
            expert_turns(t)?
        });
    }
    let tok = harness.tokenizer().clone();
    let mut out: Vec<(usize, Trajectory)> = futures_util::stream::iter(
        tasks
            .iter()
            .zip(scripts)
            .enumerate()
            .map(|(i, (t, turns))| {
                let policy = ScriptedPolicy::new(tok.clone(), turns);
                async move { (i, harness.rollout(&policy, backend, t, 0).await) }
            }),
    )
    .buffer_unordered(concurrency.max(1))
    .collect()
    .await;
    out.sort_by_key(|(i, _)| *i);
    Ok(out.into_iter().map(|(_, t)| t).collect())
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Builds the warm-started model under `out_dir`: `rollout.json` (the
/// rollout setting, for eval and RL), `base/` (a fresh model of
/// `cfg.preset`, unless `cfg.base_model`), `demos/` (the demonstration
/// pool, [`demo_toy_config`]), `demos.jsonl` (the expert trajectories),
/// `model/` (the checkpoint). `rollout` must be the setting the model will
/// run under (normally [`demo_rollout_config`]); `backend` runs the
/// sandboxes.
pub async fn build_warm_start(
    cfg: &WarmStartConfig,
    rollout: &RolloutConfig,
    backend: &dyn Backend,
    out_dir: &Path,
    progress: Option<SftProgress>,
) -> Result<WarmStartReport> {
    cfg.check()?;
    let t0 = Instant::now();
    std::fs::create_dir_all(out_dir).map_err(|e| Error::io(out_dir, e))?;
    let rollout_path = out_dir.join("rollout.json");
    let text = serde_json::to_string_pretty(rollout).map_err(|e| Error::Input(e.to_string()))?;
    std::fs::write(&rollout_path, text).map_err(|e| Error::io(&rollout_path, e))?;
    let base = match &cfg.base_model {
        Some(p) => p.clone(),
        None => {
            let dir = out_dir.join("base");
            let preset = arcticd_engine::init::preset(&cfg.preset)?;
            let r = arcticd_engine::init::init_model(preset, &dir, cfg.init_seed)?;
            tracing::info!(preset = %cfg.preset, parameters = r.parameters, "warm start: fresh model");
            dir
        }
    };
    let tasks = toy::generate(
        &demo_toy_config(cfg.demos, cfg.demo_seed),
        &out_dir.join("demos"),
    )
    .map_err(|e| Error::Input(format!("demonstration pool: {e}")))?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&base)?);
    let template = ChatTemplate::from_dir(&base)?.unwrap_or_else(ChatTemplate::qwen35);
    let harness = Harness::new(tokenizer, template, rollout.clone())?;

    let r0 = Instant::now();
    let trajs = expert_trajectories(
        &harness,
        backend,
        &tasks,
        cfg.concurrency,
        cfg.give_up_share,
        cfg.demo_seed,
    )
    .await?;
    let rollout_secs = r0.elapsed().as_secs_f64();
    let path = out_dir.join("demos.jsonl");
    let mut lines = String::new();
    for t in &trajs {
        lines.push_str(&serde_json::to_string(t).map_err(|e| Error::Input(e.to_string()))?);
        lines.push('\n');
    }
    std::fs::write(&path, lines).map_err(|e| Error::io(&path, e))?;
    // The fixing demonstrations that solved their task, and the giving-up
    // ones that got as far as submitting (reward 0 by design).
    let mut kept: Vec<&Trajectory> = Vec::new();
    let mut gave_up = 0;
    for (i, t) in trajs.iter().enumerate() {
        let giving_up = gives_up(i, cfg.give_up_share, cfg.demo_seed);
        if giving_up && !t.masked && t.termination == Termination::Submitted {
            kept.push(t);
            gave_up += 1;
        } else if !giving_up && t.reward >= 1.0 {
            kept.push(t);
        } else {
            tracing::warn!(task = %t.task_id, detail = %t.detail, "warm start: demonstration did not run as scripted; dropped");
        }
    }
    if kept.is_empty() {
        let why = trajs
            .first()
            .map(|t| format!(": the first ended {:?} ({})", t.termination, t.detail))
            .unwrap_or_default();
        return Err(Error::Input(format!(
            "none of the {} demonstrations ran as scripted{why}",
            trajs.len()
        )));
    }
    let examples: Vec<SftExample> = kept
        .iter()
        .map(|t| SftExample {
            tokens: t.token_ids.clone(),
            loss_mask: t.loss_mask.clone(),
        })
        .collect();
    let prompt_tokens = mean(&kept.iter().map(|t| t.prompt_len as f64).collect::<Vec<_>>());
    let trajectory_tokens = mean(
        &kept
            .iter()
            .map(|t| t.token_ids.len() as f64)
            .collect::<Vec<_>>(),
    );
    let target_tokens = mean(
        &kept
            .iter()
            .map(|t| t.loss_mask.iter().map(|&m| m as f64).sum::<f64>())
            .collect::<Vec<_>>(),
    );
    tracing::info!(
        demos = trajs.len(),
        kept = examples.len(),
        prompt_tokens,
        trajectory_tokens,
        secs = rollout_secs,
        "warm start: expert trajectories"
    );

    let s0 = Instant::now();
    let model_dir = out_dir.join("model");
    let (cfg2, base2, dir2) = (cfg.clone(), base.clone(), model_dir.clone());
    let losses = arcticd_sandbox::tokio::task::spawn_blocking(move || {
        train_sft(&cfg2.sft, &base2, &examples, &dir2, progress.as_ref())
    })
    .await
    .map_err(|e| Error::Input(format!("the SFT task failed: {e}")))??;
    let sft_secs = s0.elapsed().as_secs_f64();
    let k = (losses.len() / 2).clamp(1, 5).min(losses.len());
    let report = WarmStartReport {
        model_dir,
        demos: trajs.len(),
        kept: kept.len(),
        gave_up,
        prompt_tokens,
        trajectory_tokens,
        target_tokens,
        first_loss: mean(&losses[..k]),
        last_loss: mean(&losses[losses.len() - k..]),
        rollout_secs,
        sft_secs,
        total_secs: t0.elapsed().as_secs_f64(),
    };
    tracing::info!(?report, "warm start: done");
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::{check_format, tools::tool_schemas};

    /// Settings no warm start can use are refused by `check`, which the
    /// command runs before building an image or a demonstration.
    #[test]
    fn unusable_settings_are_refused_up_front() {
        WarmStartConfig::default().check().unwrap();
        type Edit = fn(&mut WarmStartConfig);
        let cases: [(&str, Edit); 6] = [
            ("bogus", |c| c.preset = "bogus".into()),
            ("demos 0", |c| c.demos = 0),
            ("concurrency 0", |c| c.concurrency = 0),
            ("give_up_share", |c| c.give_up_share = 5.0),
            ("lr must be", |c| c.sft.lr = -1.0),
            ("steps 0", |c| c.sft.steps = 0),
        ];
        for (says, edit) in cases {
            let mut c = WarmStartConfig::default();
            edit(&mut c);
            let e = c.check().unwrap_err().to_string();
            assert!(e.contains(says), "{says}: {e}");
        }
    }

    #[test]
    fn the_teacher_gives_up_on_an_even_share() {
        let picked = |n: usize, share: f64| (0..n).filter(|&i| gives_up(i, share, 1000)).count();
        assert_eq!(picked(96, 0.0), 0);
        assert_eq!(picked(96, 1.0), 96);
        let half = picked(600, 0.5);
        assert!((250..350).contains(&half), "{half}");
        // Independent of the family (assigned by index mod 6): every
        // family both gives up and fixes.
        for f in 0..6 {
            let ups = (0..96)
                .filter(|i| i % 6 == f && gives_up(*i, 0.5, 1000))
                .count();
            assert!((1..16).contains(&ups), "family {f}: {ups} of 16");
        }
        let d = tempfile::tempdir().unwrap();
        let t = &toy::generate(&demo_toy_config(1, 3), d.path()).unwrap()[0];
        let turns = give_up_turns(t).unwrap();
        let calls: Vec<_> = turns
            .iter()
            .map(|r| check_format(r, &tool_schemas()).unwrap())
            .collect();
        assert_eq!(calls[0].arguments["command"], "view");
        assert_eq!(calls[1].name, "submit");
    }

    #[test]
    fn expert_turns_pass_the_format_check_and_fix_the_gold_line() {
        let d = tempfile::tempdir().unwrap();
        let tasks = toy::generate(&demo_toy_config(6, 3), d.path()).unwrap();
        for t in &tasks {
            let turns = expert_turns(t).unwrap();
            assert_eq!(turns.len(), 3);
            let calls: Vec<_> = turns
                .iter()
                .map(|r| check_format(r, &tool_schemas()).unwrap())
                .collect();
            assert_eq!(calls[0].arguments["command"], "view");
            assert_eq!(calls[0].arguments["path"], "calc/core.py");
            let sol = &t.meta["toy"]["solution"];
            assert_eq!(calls[1].arguments["old_str"], sol["old_str"]);
            assert_eq!(calls[1].arguments["new_str"], sol["new_str"]);
            assert_eq!(calls[2].name, "submit");
        }
        let mut bad = tasks[0].clone();
        bad.patch.push_str("+another line\n");
        assert!(expert_turns(&bad).is_err());
    }
}
