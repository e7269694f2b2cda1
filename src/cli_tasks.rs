//! `arcticd tasks`: generate the toy pool, validate tasks, audit them for
//! wrong patches their tests accept.
//!
//! `tasks toy --count N --seed S --out DIR` writes DIR/tasks.jsonl and the
//! repositories; `tasks validate --tasks FILE --backend docker|local` prints
//! one JSON verdict per task; `tasks audit --tasks FILE --backend ...
//! [--out FILE] [--report FILE] [--strengthen]` prints per-task audit lines
//! and a summary (precision / recall against the toy pool's ground truth)
//! and writes the curated set (valid and not loose, strengthened tasks in
//! their new form); `tasks select --tasks FILE --eval EVAL --min-solved N
//! --out FILE` keeps the tasks an `arcticd eval` run solved. Thin wiring
//! over `arcticd_sandbox::tasks` and the harness's audit agents.

use crate::cli_sandbox::BackendKind;
use anyhow::{bail, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::{self, audit, toy, validate, Format, Task};
use arcticd_sandbox::{Backend, Policy};
use arcticd_trainer::harness::openai::{OpenAiConfig, OpenAiPolicy};
use arcticd_trainer::harness::policy::Policy as ModelPolicy;
use arcticd_trainer::harness::{
    eval, strengthen, wrong_patch, Harness, RolloutConfig, ScriptedPolicy,
};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct TasksArgs {
    #[command(subcommand)]
    pub command: TasksCommand,
}

#[derive(clap::Subcommand)]
pub enum TasksCommand {
    /// Generate the toy task pool: small Python repositories with seeded bugs.
    Toy(ToyArgs),
    /// Check that fail-to-pass tests fail before and pass after the gold patch.
    Validate(ValidateArgs),
    /// Try wrong patches against each task; flag tasks whose tests accept one.
    Audit(AuditArgs),
    /// Keep the tasks an `arcticd eval` run solved at least N times (the
    /// overfit stress test's pool: tasks the warm start can solve).
    Select(SelectArgs),
}

#[derive(clap::Args)]
pub struct SelectArgs {
    /// Task file (JSONL).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Record format: auto, native, swebench, r2e.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Per-attempt results of `arcticd eval` over these tasks (its --out).
    #[arg(long)]
    pub eval: PathBuf,
    /// Solved attempts a task needs to be kept (masked attempts never count).
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    pub min_solved: usize,
    /// Most tasks kept, in file order; 0 = all.
    #[arg(long, default_value_t = 0)]
    pub limit: usize,
    /// Where to write the kept tasks (JSONL; repository folders absolute).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args)]
pub struct ToyArgs {
    /// Number of tasks.
    #[arg(long, default_value_t = 12)]
    pub count: usize,
    /// Seed of every random choice.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Share of deliberately loose tasks.
    #[arg(long, default_value_t = 0.25)]
    pub loose_share: f64,
    /// One package name for every task (`PKG/core.py`) instead of a seeded
    /// name per task.
    #[arg(long)]
    pub package: Option<String>,
    /// Output folder (tasks.jsonl and repos/).
    #[arg(long)]
    pub out: PathBuf,
}

#[derive(clap::Args)]
pub struct CommonArgs {
    /// Task file (JSONL).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Record format: auto, native, swebench, r2e.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Sandbox backend.
    #[arg(long, value_enum, default_value = "docker")]
    pub backend: BackendKind,
    /// Image for tasks with a local repository and no image of their own.
    #[arg(long, default_value = image::DEFAULT_TAG, value_parser = crate::non_blank)]
    pub image: String,
    /// Tasks run at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Limit of one test run, seconds.
    #[arg(long, default_value_t = 300.0)]
    pub test_timeout: f64,
    /// Runs of each condition (flakiness check).
    #[arg(long, default_value_t = 2)]
    pub repeats: usize,
}

#[derive(clap::Args)]
pub struct ValidateArgs {
    #[command(flatten)]
    pub common: CommonArgs,
}

#[derive(clap::Args)]
pub struct AuditArgs {
    #[command(flatten)]
    pub common: CommonArgs,
    /// Most mechanical wrong patches graded per task.
    #[arg(long, default_value_t = 24)]
    pub max_variants: usize,
    /// Skip validation (audit every task as if valid).
    #[arg(long)]
    pub no_validate: bool,
    /// Where to write the curated task set (valid and not loose).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Where to write the full report (JSON); printed to stdout otherwise.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// An OpenAI-compatible endpoint: an agent shown the gold patch and the
    /// tests also tries to write a wrong patch that passes them.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Model name at the endpoint.
    #[arg(long, default_value = "default")]
    pub model: String,
    /// Folder with the tokenizer and chat template for the agent.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Scripted agent turns instead of an endpoint: JSON object task id ->
    /// list of raw assistant turns (demos and tests); the strengthening
    /// agent's turns for task X are keyed `strengthen/X`.
    #[arg(long)]
    pub agent_script: Option<PathBuf>,
    /// Agent attempts per task.
    #[arg(long, default_value_t = 1)]
    pub agent_attempts: usize,
    /// Agent rollout settings: a JSON object or a JSON file (the keys of a
    /// recipe's [rollout]).
    #[arg(long)]
    pub agent_config: Option<String>,
    /// Ask the agent for extra tests for each loose task: accepted only when
    /// they pass on the gold patch and fail on the accepted wrong patch, and
    /// the strengthened task validates and is no longer loose. Needs an
    /// agent (--endpoint or --agent-script). Attempts per task:
    /// --agent-attempts.
    #[arg(long)]
    pub strengthen: bool,
}

/// The audit's agent: a harness and the policy per task.
/// Picks the policy that attempts a task.
type PolicyFactory = Box<dyn Fn(&Task) -> Arc<dyn ModelPolicy> + Sync>;

struct Agent {
    harness: Harness,
    /// The same model and settings, asked for tests instead of a fix.
    strengthen_harness: Harness,
    policy_for: PolicyFactory,
    attempts: usize,
}

fn agent(a: &AuditArgs) -> Result<Option<Agent>> {
    if a.endpoint.is_none() && a.agent_script.is_none() {
        return Ok(None);
    }
    let Some(dir) = &a.tokenizer else {
        bail!("an audit agent needs --tokenizer DIR (the model's tokenizer and chat template)");
    };
    let tokenizer = Arc::new(Tokenizer::from_dir(dir)?);
    // Two harnesses (fixing and strengthening), each with its template.
    let template = || -> Result<ChatTemplate> {
        Ok(ChatTemplate::from_dir(dir)?.unwrap_or_else(ChatTemplate::qwen35))
    };
    let mut cfg = match &a.agent_config {
        Some(j) => crate::json_setting::<RolloutConfig>("--agent-config", j)?,
        None => RolloutConfig::default(),
    };
    cfg.image = a.common.image.clone();
    let strengthen_cfg = RolloutConfig {
        instruction: strengthen::STRENGTHEN_INSTRUCTION.to_string(),
        ..cfg.clone()
    };
    let strengthen_harness = Harness::new(tokenizer.clone(), template()?, strengthen_cfg)?;
    let harness = Harness::new(tokenizer.clone(), template()?, cfg)?;
    let policy_for: PolicyFactory = match (&a.agent_script, &a.endpoint) {
        (Some(p), _) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            let scripts: HashMap<String, Vec<String>> =
                serde_json::from_str(&text).with_context(|| {
                    format!(
                        "{}: expected an object of task id -> list of turns",
                        p.display()
                    )
                })?;
            // A fresh policy per rollout: each attempt replays its script.
            Box::new(move |t: &Task| {
                let turns = scripts.get(&t.instance_id).cloned().unwrap_or_default();
                let p: Arc<dyn ModelPolicy> =
                    Arc::new(ScriptedPolicy::new(tokenizer.clone(), turns));
                p
            })
        }
        (None, Some(endpoint)) => {
            let policy: Arc<dyn ModelPolicy> = Arc::new(OpenAiPolicy::new(
                OpenAiConfig {
                    endpoint: endpoint.clone(),
                    model: a.model.clone(),
                    ..OpenAiConfig::default()
                },
                tokenizer,
            )?);
            Box::new(move |_: &Task| policy.clone())
        }
        (None, None) => return Ok(None),
    };
    Ok(Some(Agent {
        harness,
        strengthen_harness,
        policy_for,
        attempts: a.agent_attempts.max(1),
    }))
}

/// Whether `bytes` read as tasks in this crate's format (an earlier
/// `--out` of select or audit; empty counts).
fn is_task_file(bytes: &[u8]) -> bool {
    let Ok(text) = std::str::from_utf8(bytes) else {
        return false;
    };
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .all(|l| serde_json::from_str::<Task>(l).is_ok())
}

/// Whether `bytes` are an audit's `--report` (a JSON object with its
/// counts and results).
fn is_audit_report(bytes: &[u8]) -> bool {
    serde_json::from_slice::<serde_json::Value>(bytes).is_ok_and(|v| {
        ["tasks", "loose", "tight", "results"]
            .iter()
            .all(|k| v.get(k).is_some())
    })
}

fn select(a: SelectArgs) -> Result<()> {
    let format: Format = a.format.parse()?;
    crate::not_an_input(
        ("--out", &a.out),
        &[("--tasks", &a.tasks), ("--eval", &a.eval)],
    )?;
    crate::replaces_only("--out", &a.out, "a task file", is_task_file)?;
    // A missing file would read as an evaluation that attempted nothing.
    if !a.eval.is_file() {
        bail!(
            "--eval {}: no such file (the per-attempt records an `arcticd eval --out` wrote)",
            a.eval.display()
        );
    }
    let path = std::fs::canonicalize(&a.tasks)
        .with_context(|| format!("reading {}", a.tasks.display()))?;
    let all = tasks::load_tasks(&path, format)?;
    let records = eval::read_records(&a.eval)?;
    let ids: HashSet<&str> = records.iter().map(|r| r.task_id.as_str()).collect();
    let attempted = all
        .iter()
        .filter(|t| ids.contains(t.instance_id.as_str()))
        .count();
    let summary = eval::summarize(&all, &records);
    let kept = eval::select_solved(&all, &summary, a.min_solved, a.limit);
    if kept.is_empty() {
        bail!(
            "no task of {} was solved {} time(s) in {} ({attempted} of {} attempted); nothing written",
            a.tasks.display(),
            a.min_solved.max(1),
            a.eval.display(),
            all.len()
        );
    }
    if let Some(dir) = a.out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let kept: Vec<Task> = kept.into_iter().cloned().collect();
    tasks::write_tasks(&a.out, &kept)?;
    outln!(
        "{}",
        serde_json::json!({
            "tasks": all.len(),
            "attempted": attempted,
            "kept": kept.len(),
            "file": a.out,
        })
    )?;
    Ok(())
}

pub fn main(args: TasksArgs) -> Result<()> {
    match args.command {
        TasksCommand::Select(a) => select(a),
        TasksCommand::Toy(a) => {
            let cfg = toy::ToyConfig {
                count: a.count,
                seed: a.seed,
                loose_share: a.loose_share,
                package: a.package,
            };
            let tasks = toy::generate(&cfg, &a.out)?;
            let loose = tasks.iter().filter(|t| t.toy_loose() == Some(true)).count();
            outln!(
                "{}",
                serde_json::json!({
                    "tasks": tasks.len(),
                    "loose": loose,
                    "file": a.out.join("tasks.jsonl"),
                })
            )?;
            Ok(())
        }
        TasksCommand::Validate(a) => {
            let rt = arcticd_sandbox::runtime()?;
            rt.block_on(async {
                let (backend, tasks, policy, cfg) = setup(&a.common).await?;
                let verdicts =
                    validate::validate_tasks(backend.as_ref(), &tasks, &policy, &cfg).await;
                for v in &verdicts {
                    outln!("{}", serde_json::to_string(v)?)?;
                }
                let invalid = verdicts.iter().filter(|v| !v.is_valid()).count();
                if invalid > 0 {
                    bail!(
                        "{invalid} of {} tasks are invalid (their verdicts are above)",
                        verdicts.len()
                    );
                }
                Ok(())
            })
        }
        TasksCommand::Audit(a) => {
            let inputs = [("--tasks", a.common.tasks.as_path())];
            // Checked before the audit (hours on real tasks), not after it.
            if let Some(out) = &a.out {
                crate::not_an_input(("--out", out), &inputs)?;
                crate::can_write("--out", out)?;
                crate::replaces_only("--out", out, "a task file", is_task_file)?;
            }
            if let Some(report) = &a.report {
                crate::not_an_input(("--report", report), &inputs)?;
                crate::can_write("--report", report)?;
                crate::replaces_only("--report", report, "an audit report", is_audit_report)?;
                if let Some(out) = &a.out {
                    if report == out {
                        bail!("--report and --out name the same file, {}", out.display());
                    }
                }
            }
            let agent = agent(&a)?;
            if a.strengthen && agent.is_none() {
                bail!(
                    "--strengthen needs an agent to write the tests: --endpoint URL or \
                     --agent-script FILE, with --tokenizer DIR"
                );
            }
            let rt = arcticd_sandbox::runtime()?;
            rt.block_on(async {
                let (backend, tasks, policy, vcfg) = setup(&a.common).await?;
                let cfg = audit::AuditConfig {
                    validate: vcfg,
                    validate_first: !a.no_validate,
                    max_variants: a.max_variants,
                };
                let ag = agent.as_ref().map(|ag| wrong_patch::AuditAgent {
                    harness: &ag.harness,
                    policy_for: ag.policy_for.as_ref(),
                    attempts: ag.attempts,
                });
                let sa =
                    agent
                        .as_ref()
                        .filter(|_| a.strengthen)
                        .map(|ag| wrong_patch::AuditAgent {
                            harness: &ag.strengthen_harness,
                            policy_for: ag.policy_for.as_ref(),
                            attempts: ag.attempts,
                        });
                let report = wrong_patch::audit_tasks_with_agent(
                    backend.as_ref(),
                    &tasks,
                    &policy,
                    &cfg,
                    ag.as_ref(),
                    sa.as_ref(),
                )
                .await;
                if report.undecided > 0 {
                    tracing::warn!(
                        "{} of {} tasks undecided: no wrong patch passed, but some could not \
                         be graded (their infra_errors) or none was tried (a --max-variants of \
                         0 and no agent); left out of any curated set",
                        report.undecided,
                        report.tasks
                    );
                }
                if let Some(out) = &a.out {
                    let keep: Vec<Task> = tasks
                        .iter()
                        .zip(&report.results)
                        .filter_map(|(t, r)| r.curated(t))
                        .collect();
                    tasks::write_tasks(out, &keep)?;
                }
                let text = serde_json::to_string_pretty(&report)?;
                match &a.report {
                    Some(p) => {
                        std::fs::write(p, &text)
                            .with_context(|| format!("writing {}", p.display()))?;
                        let summary = serde_json::json!({
                            "tasks": report.tasks, "invalid": report.invalid,
                            "loose": report.loose, "tight": report.tight,
                            "undecided": report.undecided,
                            "strengthened": report.strengthened,
                            "precision": report.precision, "recall": report.recall,
                        });
                        outln!("{summary}")?;
                    }
                    None => outln!("{text}")?,
                }
                Ok(())
            })
        }
    }
}

/// A backend by kind.
pub async fn backend(kind: BackendKind) -> Result<Box<dyn Backend>> {
    Ok(match kind {
        BackendKind::Docker => Box::new(DockerBackend::new().await?),
        BackendKind::Local => Box::new(LocalBackend::new().await?),
    })
}

async fn setup(
    a: &CommonArgs,
) -> Result<(
    Box<dyn Backend>,
    Vec<Task>,
    Policy,
    validate::ValidateConfig,
)> {
    let format: Format = a.format.parse()?;
    let tasks = tasks::load_tasks(&a.tasks, format)?;
    if tasks.is_empty() {
        bail!("{} holds no tasks", a.tasks.display());
    }
    let cfg = validate::ValidateConfig {
        image: a.image.clone(),
        test_timeout_secs: a.test_timeout,
        repeats: a.repeats,
        concurrency: a.concurrency,
    };
    cfg.check()
        .context("--test-timeout, --repeats, --concurrency")?;
    let backend = backend(a.backend).await?;
    Ok((backend, tasks, Policy::default(), cfg))
}

#[cfg(test)]
mod tests {
    use super::{is_audit_report, is_task_file};

    /// An output replaces only an earlier output of its kind: an audit's
    /// report, tasks (or an empty file), never notes or an evaluation's
    /// records.
    #[test]
    fn outputs_replace_only_their_own_kind() {
        let report = serde_json::to_vec(&super::audit::report(vec![])).unwrap();
        assert!(is_audit_report(&report));
        assert!(!is_audit_report(b"{\"tasks\": 3}"));
        assert!(!is_audit_report(b"my notes"));
        assert!(is_task_file(b""));
        assert!(!is_task_file(b"my notes\n"));
        let record = b"{\"task_id\":\"a\",\"attempt\":0,\"reward\":1.0,\"termination\":\"submitted\",\"masked\":false}\n";
        assert!(!is_task_file(record));
        assert!(!is_task_file(&report));
    }
}
