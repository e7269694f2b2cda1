//! Rejection fine-tuning (`arcticd rft`): the first stage of the
//! long-context SWE RL recipe (docs/ARCHITECTURE.md, "The recipe").
//!
//! A round samples K attempts per task with the current model through the
//! ordinary harness and sandbox, keeps the trajectories that earned reward
//! 1 *and* whose every turn passes the strict raw-format check
//! ([`keeps`]), and runs SFT on their model tokens (prompt and environment
//! tokens are context only, [`crate::sft`]). The next round starts from the
//! model the last one wrote. After the last round the final model is
//! sampled once more, so every round has a "tasks solved before" and an
//! "after" (the next round's before).
//!
//! The output folder: `round-N/attempts.jsonl` (one record per attempt of
//! the model round N started from), `round-N/trajectories.jsonl`,
//! `round-N/model/` (the checkpoint round N wrote), `after/` (the final
//! model's attempts), `report.json`, and `rft.json`, what the folder was
//! started with. It resumes: attempts already recorded are not sampled
//! again and a round whose checkpoint is complete is not trained again;
//! so a resume must ask for what `rft.json` says (more rounds, other
//! concurrency are fine), and a folder that is not empty and has no
//! `rft.json` is refused, untouched.
//!
//! Not for: RL (`crate::rl`), or picking tasks (every task given is
//! attempted every round).

use crate::harness::eval::{run_eval, EvalConfig, EvalSummary, PolicyFor};
use crate::harness::{check_format, EnginePolicyRouter, Harness, Policy, Trajectory};
use crate::sft::{sft_examples, train_sft, SftProgress, SftSettings};
use crate::{Error, Result};
use arcticd_sandbox::tasks::Task;
use arcticd_sandbox::Backend;
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

/// Settings of [`run_rft`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RftConfig {
    /// Attempts per task and round (K). Default 4.
    pub attempts: usize,
    /// Rounds of sample-filter-SFT. Default 1.
    pub rounds: usize,
    /// Rollouts at once. Default 4.
    pub concurrency: usize,
    /// Engine replicas while sampling. Default 1.
    pub replicas: usize,
    /// Paged KV cache per replica, MiB. Default 256.
    pub engine_cache_mib: usize,
    /// The SFT of each round (defaults: 100 steps of 8, lr 1e-3, 10 warmup
    /// steps then cosine, clip 1).
    pub sft: SftSettings,
}

impl Default for RftConfig {
    fn default() -> Self {
        RftConfig {
            attempts: 4,
            rounds: 1,
            concurrency: 4,
            replicas: 1,
            engine_cache_mib: 256,
            sft: SftSettings::default(),
        }
    }
}

/// What an output folder was started with (`rft.json`): what its recorded
/// attempts and checkpoints depend on.
#[derive(Debug, Serialize, Deserialize)]
struct Started {
    model: PathBuf,
    tasks: Vec<String>,
    attempts: usize,
    sft: Value,
    rollout: Value,
}

/// Makes `out` this run's folder: a new or empty folder gets `rft.json`;
/// one that has it must have been started with the same settings (named
/// when one differs); any other is refused, untouched.
fn claim_out(out: &Path, started: &Started) -> Result<()> {
    let path = out.join("rft.json");
    let json = |v: &Started| serde_json::to_value(v).map_err(|e| Error::Input(e.to_string()));
    match std::fs::read(&path) {
        Ok(bytes) => {
            let there: Value = serde_json::from_slice(&bytes).map_err(|e| {
                Error::Input(format!("{}: not an rft settings file: {e}", path.display()))
            })?;
            let now = json(started)?;
            let keys = ["model", "tasks", "attempts", "sft", "rollout"];
            if let Some(key) = keys.iter().find(|k| there.get(**k) != now.get(**k)) {
                return Err(Error::Input(format!(
                    "{} was started with another {key} ({} there, {} now); its attempts and \
                     checkpoints belong to that run: resume it with the same settings, or give \
                     a new --out",
                    out.display(),
                    brief(&there[*key]),
                    brief(&now[*key])
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let empty = match std::fs::read_dir(out) {
                Ok(mut rd) => rd.next().is_none(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => true,
                Err(e) => return Err(Error::io(out, e)),
            };
            if !empty {
                return Err(Error::Input(format!(
                    "{} is not empty and has no rft.json, so it is no rft output folder (an rft \
                     run writes rft.json first): give a new or empty --out",
                    out.display()
                )));
            }
            std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
            let text =
                serde_json::to_vec_pretty(started).map_err(|e| Error::Input(e.to_string()))?;
            arcticd_engine::weights::write_atomic(&path, &text)?;
            Ok(())
        }
        Err(e) => Err(Error::io(&path, e)),
    }
}

/// A JSON value, cut to a line's length for a message.
fn brief(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(80) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

/// Where the attempts come from.
pub enum Sampler<'a> {
    /// The in-process engine over the round's checkpoint (what `arcticd
    /// rft` uses).
    Engine,
    /// A given policy whatever the checkpoint (tests, scripted baselines).
    Fixed(PolicyFor<'a>),
}

/// What one sampling pass measured.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleStats {
    /// Tasks with at least one graded attempt.
    pub tasks: usize,
    /// Graded (unmasked) attempts.
    pub attempts: usize,
    /// Tasks with at least one attempt of reward 1.
    pub solved_tasks: usize,
    /// Mean over tasks of the per-task mean reward.
    pub pass_at_1: f64,
    /// Termination reason -> attempts.
    pub terminations: BTreeMap<String, usize>,
}

impl From<&EvalSummary> for SampleStats {
    fn from(s: &EvalSummary) -> Self {
        SampleStats {
            tasks: s.tasks,
            attempts: s.attempts,
            solved_tasks: s.per_task.iter().filter(|t| t.solved > 0).count(),
            pass_at_1: s.pass_at_1,
            terminations: s.terminations.clone(),
        }
    }
}

/// One round.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RoundReport {
    pub round: usize,
    /// The checkpoint the round sampled with.
    pub model_in: PathBuf,
    /// The checkpoint the round wrote.
    pub model_out: PathBuf,
    /// The attempts of `model_in`.
    pub before: SampleStats,
    /// Trajectories kept for SFT, and the tasks they cover.
    pub kept: usize,
    pub kept_tasks: usize,
    /// Reward-1 trajectories left out because a turn failed the strict
    /// raw-format check.
    pub rejected_format: usize,
    /// SFT loss per target token, mean of the first and of the last 5 steps
    /// (0 when the checkpoint was already complete and not retrained).
    pub first_loss: f64,
    pub last_loss: f64,
    pub sample_secs: f64,
    pub sft_secs: f64,
}

/// The whole run (also `report.json`).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RftReport {
    pub rounds: Vec<RoundReport>,
    /// The attempts of the final model.
    pub after: SampleStats,
    pub final_model: PathBuf,
}

/// Whether RFT keeps `t`: graded, reward 1, and every turn's raw text is
/// exactly one well-formed call under `schemas` (the strict check, whatever
/// the harness's gates let through).
pub fn keeps(t: &Trajectory, schemas: &[Value]) -> bool {
    !t.masked
        && t.reward >= 1.0
        && !t.turns.is_empty()
        && t.turns.iter().all(|turn| {
            turn.format_error.is_none() && check_format(&turn.raw_text, schemas).is_ok()
        })
}

/// The last graded trajectory of every (task, attempt) in `path`: a resumed
/// pass appends, and masked attempts are sampled again.
fn latest_trajectories(path: &Path) -> Result<Vec<Trajectory>> {
    if !path.is_file() {
        return Ok(Vec::new());
    }
    let mut by_key: HashMap<(String, usize), Trajectory> = HashMap::new();
    for t in crate::harness::trajectory::read_jsonl(path)? {
        if !t.masked {
            by_key.insert((t.task_id.clone(), t.attempt), t);
        }
    }
    let mut out: Vec<Trajectory> = by_key.into_values().collect();
    out.sort_by(|a, b| (&a.task_id, a.attempt).cmp(&(&b.task_id, b.attempt)));
    Ok(out)
}

/// Samples `cfg.attempts` attempts of every task with the model in `model`
/// into `dir` (`attempts.jsonl`, `trajectories.jsonl`).
async fn sample(
    model: &Path,
    harness: &Harness,
    sampler: &Sampler<'_>,
    backend: &dyn Backend,
    tasks: &[Task],
    cfg: &RftConfig,
    dir: &Path,
) -> Result<(SampleStats, Vec<Trajectory>)> {
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let (records, trajs) = (dir.join("attempts.jsonl"), dir.join("trajectories.jsonl"));
    let ecfg = EvalConfig {
        attempts: cfg.attempts,
        concurrency: cfg.concurrency,
        policy: None,
    };
    let summary = match sampler {
        Sampler::Fixed(policy_for) => {
            run_eval(
                harness,
                *policy_for,
                backend,
                tasks,
                &ecfg,
                &records,
                Some(&trajs),
            )
            .await?
        }
        Sampler::Engine => {
            let engine = EnginePolicyRouter::load(
                model,
                harness,
                cfg.replicas,
                cfg.engine_cache_mib,
                "rft",
            )?;
            let policy: Arc<dyn Policy> = engine.policy.clone();
            let policy_for = move |_: &Task| policy.clone();
            let r = run_eval(
                harness,
                &policy_for,
                backend,
                tasks,
                &ecfg,
                &records,
                Some(&trajs),
            )
            .await;
            engine.router.shutdown();
            r?
        }
    };
    if let Some(why) = summary.ungraded() {
        return Err(Error::Run(format!(
            "{why} (attempts in {})",
            records.display()
        )));
    }
    Ok((SampleStats::from(&summary), latest_trajectories(&trajs)?))
}

fn mean(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        0.0
    } else {
        xs.iter().sum::<f64>() / xs.len() as f64
    }
}

/// Runs `cfg.rounds` rounds of rejection fine-tuning from the checkpoint
/// `model` on `tasks` into `out` (see the module doc), then samples the
/// final model. A round that keeps no trajectory is an error (nothing to
/// fine-tune on), after its attempts are written.
#[allow(clippy::too_many_arguments)]
pub async fn run_rft(
    model: &Path,
    tasks: &[Task],
    harness: &Harness,
    sampler: &Sampler<'_>,
    backend: &dyn Backend,
    out: &Path,
    cfg: &RftConfig,
    progress: Option<SftProgress>,
) -> Result<RftReport> {
    if cfg.attempts == 0 || cfg.rounds == 0 {
        return Err(Error::Input(
            "rft needs attempts >= 1 and rounds >= 1".into(),
        ));
    }
    // Before the first round's sampling, not after it.
    cfg.sft.check()?;
    if tasks.is_empty() {
        return Err(Error::Input("rft: the task file holds no task".into()));
    }
    let value = |v: std::result::Result<Value, serde_json::Error>| {
        v.map_err(|e| Error::Input(e.to_string()))
    };
    claim_out(
        out,
        &Started {
            model: std::path::absolute(model).map_err(|e| Error::io(model, e))?,
            tasks: tasks.iter().map(|t| t.instance_id.clone()).collect(),
            attempts: cfg.attempts,
            sft: value(serde_json::to_value(&cfg.sft))?,
            rollout: value(serde_json::to_value(&harness.cfg))?,
        },
    )?;
    let schemas = harness.tools().to_vec();
    let mut rounds = Vec::with_capacity(cfg.rounds);
    let mut current = model.to_path_buf();
    for round in 1..=cfg.rounds {
        let dir = out.join(format!("round-{round}"));
        let t0 = Instant::now();
        let (before, trajs) = sample(&current, harness, sampler, backend, tasks, cfg, &dir).await?;
        let sample_secs = t0.elapsed().as_secs_f64();
        let solved: Vec<Trajectory> = trajs.into_iter().filter(|t| t.reward >= 1.0).collect();
        let (kept, rejected): (Vec<Trajectory>, Vec<Trajectory>) =
            solved.into_iter().partition(|t| keeps(t, &schemas));
        let kept_tasks = kept
            .iter()
            .map(|t| t.task_id.as_str())
            .collect::<std::collections::HashSet<_>>()
            .len();
        tracing::info!(
            round,
            solved_tasks = before.solved_tasks,
            tasks = before.tasks,
            pass_at_1 = before.pass_at_1,
            kept = kept.len(),
            rejected_format = rejected.len(),
            "rft: sampled"
        );
        if kept.is_empty() {
            return Err(Error::Input(format!(
                "rft round {round}: no attempt of {} x {} solved its task with well-formed \
                 turns, so there is nothing to fine-tune on (attempts in {})",
                before.tasks,
                cfg.attempts,
                dir.join("attempts.jsonl").display()
            )));
        }
        let model_out = dir.join("model");
        let s0 = Instant::now();
        let (first_loss, last_loss) = if model_out.join("config.json").is_file() {
            tracing::info!(round, model = %model_out.display(), "rft: checkpoint complete; not retrained");
            (0.0, 0.0)
        } else {
            let examples = sft_examples(&kept);
            let (sft, base, dst, p) = (
                cfg.sft.clone(),
                current.clone(),
                model_out.clone(),
                progress.clone(),
            );
            let losses = arcticd_sandbox::tokio::task::spawn_blocking(move || {
                train_sft(&sft, &base, &examples, &dst, p.as_ref())
            })
            .await
            .map_err(|e| Error::Input(format!("the SFT task failed: {e}")))??;
            let k = (losses.len() / 2).clamp(1, 5).min(losses.len());
            (mean(&losses[..k]), mean(&losses[losses.len() - k..]))
        };
        rounds.push(RoundReport {
            round,
            model_in: current.clone(),
            model_out: model_out.clone(),
            before,
            kept: kept.len(),
            kept_tasks,
            rejected_format: rejected.len(),
            first_loss,
            last_loss,
            sample_secs,
            sft_secs: s0.elapsed().as_secs_f64(),
        });
        current = model_out;
    }
    let (after, _) = sample(
        &current,
        harness,
        sampler,
        backend,
        tasks,
        cfg,
        &out.join("after"),
    )
    .await?;
    let report = RftReport {
        rounds,
        after,
        final_model: current,
    };
    let path = out.join("report.json");
    let text = serde_json::to_string_pretty(&report).map_err(|e| Error::Input(e.to_string()))?;
    std::fs::write(&path, text).map_err(|e| Error::io(&path, e))?;
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::harness::format::render_call;
    use crate::harness::tools::tool_schemas;
    use crate::harness::trajectory::TurnRecord;
    use crate::harness::Termination;

    fn traj(reward: f64, raws: &[&str], term: Termination) -> Trajectory {
        let mut t = Trajectory::unstarted("t", 0, "p", "");
        t.reward = reward;
        t.termination = term;
        t.masked = term.masked();
        t.turns = raws
            .iter()
            .map(|r| TurnRecord {
                raw_text: r.to_string(),
                ..TurnRecord::default()
            })
            .collect();
        t
    }

    #[test]
    fn keeps_only_solved_well_formed_graded_trajectories() {
        let s = tool_schemas();
        let good = render_call("submit", &[]);
        let view = render_call(
            "str_replace_based_edit_tool",
            &[("command", "view"), ("path", "calc/core.py")],
        );
        assert!(keeps(
            &traj(1.0, &[&view, &good], Termination::Submitted),
            &s
        ));
        assert!(!keeps(
            &traj(0.0, &[&view, &good], Termination::Submitted),
            &s
        ));
        // A turn the harness let through (gates off) but the strict check
        // refuses: text after the call.
        let chatty = format!("{good}\nDone.");
        assert!(!keeps(
            &traj(1.0, &[&chatty, &good], Termination::Submitted),
            &s
        ));
        let mut hinted = traj(1.0, &[&view, &good], Termination::Submitted);
        hinted.turns[0].format_error = Some("invalid_json".into());
        assert!(!keeps(&hinted, &s));
        assert!(!keeps(&traj(1.0, &[&good], Termination::Infra), &s));
        assert!(!keeps(&traj(1.0, &[], Termination::Submitted), &s));
    }
}
