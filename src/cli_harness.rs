//! `arcticd check-format`, `arcticd traj show` and `arcticd eval`: the
//! rollout harness from the command line.
//!
//! `check-format --input FILE` reads a JSON list of raw assistant
//! completions and prints one JSON verdict per item with exactly the
//! harness's checker. `traj show FILE` prints trajectories as transcripts.
//! `eval` runs pass@1 over K attempts per task through an OpenAI-compatible
//! endpoint (or scripted turns, for demos and tests), resumably. Thin wiring
//! over `arcticd_trainer::harness`.

use crate::cli_sandbox::BackendKind;
use anyhow::{bail, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::image;
use arcticd_sandbox::tasks::{self, Format};
use arcticd_trainer::harness::engine_policy::EnginePolicyRouter;
use arcticd_trainer::harness::eval::{self, EvalConfig};
use arcticd_trainer::harness::openai::{OpenAiConfig, OpenAiPolicy};
use arcticd_trainer::harness::policy::Policy;
use arcticd_trainer::harness::{format, tools, trajectory, Harness, RolloutConfig, ScriptedPolicy};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

#[derive(clap::Args)]
pub struct CheckFormatArgs {
    /// JSON list of raw assistant completions (strings, or objects with a
    /// `text` field).
    #[arg(long)]
    pub input: PathBuf,
    /// Tool schemas (JSON list, OpenAI function format); default the
    /// harness's tools.
    #[arg(long)]
    pub tools: Option<PathBuf>,
}

#[derive(clap::Args)]
pub struct TrajArgs {
    #[command(subcommand)]
    pub command: TrajCommand,
}

#[derive(clap::Subcommand)]
pub enum TrajCommand {
    /// Print trajectories of a JSONL file as readable transcripts.
    Show(TrajShowArgs),
}

#[derive(clap::Args)]
pub struct TrajShowArgs {
    /// A trajectories file (JSONL): a run's `trajectories/step-NNNNNN.jsonl`
    /// or `dropped.jsonl`, or the file `arcticd eval --traj` wrote.
    pub file: PathBuf,
    /// Only this task's trajectories.
    #[arg(long)]
    pub task: Option<String>,
    /// Only the trajectory at this 0-based position in the file.
    #[arg(long)]
    pub index: Option<usize>,
}

#[derive(clap::Args)]
pub struct EvalArgs {
    /// Task file (JSONL).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Record format: auto, native, swebench, r2e.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// A model folder (tokenizer and chat template), or with --endpoint the
    /// model's name there.
    #[arg(long)]
    pub model: String,
    /// OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Folder with the tokenizer and chat template (with --endpoint; default
    /// --model when that is a folder).
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Scripted turns instead of a model: JSON object task id -> list of raw
    /// assistant turns (demos and tests).
    #[arg(long)]
    pub script: Option<PathBuf>,
    /// Attempts per task (K).
    #[arg(long, default_value_t = 4)]
    pub attempts: usize,
    /// Rollouts at once.
    #[arg(long, default_value_t = 2)]
    pub concurrency: usize,
    /// Sandbox backend.
    #[arg(long, value_enum, default_value = "docker")]
    pub backend: BackendKind,
    /// Image for tasks with a local repository and no image of their own.
    #[arg(long, default_value = image::DEFAULT_TAG, value_parser = crate::non_blank)]
    pub image: String,
    /// Per-attempt results (JSONL, appended; resumable).
    #[arg(long, default_value = "eval.jsonl")]
    pub out: PathBuf,
    /// Full trajectories (JSONL, appended).
    #[arg(long)]
    pub traj: Option<PathBuf>,
    /// Engine replicas for an in-process model (--model DIR, no --endpoint).
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    pub replicas: usize,
    /// Rollout settings: a JSON object, e.g. '{"max_turns": 20}', or a JSON
    /// file (the keys of a recipe's [rollout]; `arcticd warm-start` writes
    /// rollout.json).
    #[arg(long)]
    pub config: Option<String>,
}

pub fn check_format(a: CheckFormatArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.input)
        .with_context(|| format!("reading {}", a.input.display()))?;
    let items: Vec<Value> = serde_json::from_str(&text)
        .with_context(|| format!("{}: expected a JSON list", a.input.display()))?;
    let schemas = match &a.tools {
        Some(p) => serde_json::from_str::<Vec<Value>>(
            &std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("{}: expected a JSON list of tool schemas", p.display()))?,
        None => tools::tool_schemas(),
    };
    if let Some(p) = &a.tools {
        arcticd_engine::tool_call::check_tools(&schemas)
            .map_err(|e| anyhow::anyhow!("{}: {e}", p.display()))?;
    }
    for (i, item) in items.iter().enumerate() {
        let raw = match item {
            Value::String(s) => s.as_str(),
            Value::Object(o) => match o.get("text").and_then(Value::as_str) {
                Some(s) => s,
                None => bail!("item {i}: an object without a string `text`"),
            },
            _ => bail!("item {i}: expected a string or an object with `text`"),
        };
        let verdict = match format::check(raw, &schemas) {
            Ok(call) => json!({"index": i, "verdict": "valid", "call": call}),
            Err(v) => {
                json!({"index": i, "verdict": "invalid", "reason": v.code, "detail": v.detail})
            }
        };
        outln!("{verdict}")?;
    }
    Ok(())
}

pub fn traj(a: TrajArgs) -> Result<()> {
    match a.command {
        TrajCommand::Show(s) => {
            let all = trajectory::read_jsonl(&s.file)?;
            let mut shown = 0;
            for (i, t) in all.iter().enumerate() {
                if s.index.is_some_and(|k| k != i)
                    || s.task.as_ref().is_some_and(|id| *id != t.task_id)
                {
                    continue;
                }
                outln!("{}", trajectory::show(t))?;
                shown += 1;
            }
            if all.is_empty() {
                bail!("{} holds no trajectories", s.file.display());
            }
            if shown == 0 {
                bail!(
                    "no trajectory in {} matches (it holds {}, indexed from 0)",
                    s.file.display(),
                    all.len()
                );
            }
            Ok(())
        }
    }
}

pub(crate) fn load_model_files(dir: &Path) -> Result<(Arc<Tokenizer>, ChatTemplate)> {
    let tokenizer = Tokenizer::from_dir(dir)
        .with_context(|| format!("loading the tokenizer of {}", dir.display()))?;
    let template = ChatTemplate::from_dir(dir)?.unwrap_or_else(ChatTemplate::qwen35);
    Ok((Arc::new(tokenizer), template))
}

/// Picks the policy that attempts a task.
type PolicyFactory = Box<dyn Fn(&tasks::Task) -> Arc<dyn Policy> + Sync>;

pub fn eval(a: EvalArgs) -> Result<()> {
    let mut cfg = match &a.config {
        Some(j) => crate::json_setting::<RolloutConfig>("--config", j)?,
        None => RolloutConfig::default(),
    };
    cfg.image = a.image.clone();
    if let Some(traj) = &a.traj {
        crate::not_an_input(
            ("--traj", traj),
            &[("--tasks", &a.tasks), ("--out", &a.out)],
        )?;
    }
    let tasks = tasks::load_tasks(&a.tasks, a.format.parse::<Format>()?)?;
    if tasks.is_empty() {
        bail!("no tasks in {}", a.tasks.display());
    }
    let tok_dir = match (&a.tokenizer, &a.endpoint) {
        (Some(d), _) => d.clone(),
        (None, None) => PathBuf::from(&a.model),
        // As --tokenizer says: the model's folder, when --model is one.
        (None, Some(_)) if Path::new(&a.model).is_dir() => PathBuf::from(&a.model),
        (None, Some(_)) => {
            bail!("--endpoint needs --tokenizer DIR (the model's tokenizer and chat template)")
        }
    };
    let (tokenizer, template) = load_model_files(&tok_dir)?;
    let harness = Harness::new(tokenizer.clone(), template, cfg)?;
    let policy_for: PolicyFactory = if let Some(p) = &a.script {
        let text =
            std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
        let scripts: HashMap<String, Vec<String>> =
            serde_json::from_str(&text).with_context(|| {
                format!(
                    "{}: expected an object of task id -> list of turns",
                    p.display()
                )
            })?;
        // A task without turns would be attempted by an empty script and
        // graded as a failure: a mistyped id, not a result.
        let unscripted: Vec<&str> = tasks
            .iter()
            .map(|t| t.instance_id.as_str())
            .filter(|id| !scripts.contains_key(*id))
            .collect();
        if let Some(first) = unscripted.first() {
            bail!(
                "{}: no turns for {} of the {} tasks (the first: {first:?}); its keys are task \
                 ids of {}",
                p.display(),
                unscripted.len(),
                tasks.len(),
                a.tasks.display()
            );
        }
        // A fresh policy per rollout: each attempt replays its script from
        // the start.
        let tok = tokenizer.clone();
        Box::new(move |t: &tasks::Task| {
            let turns = scripts.get(&t.instance_id).cloned().unwrap_or_default();
            let p: Arc<dyn Policy> = Arc::new(ScriptedPolicy::new(tok.clone(), turns));
            p
        })
    } else if let Some(endpoint) = &a.endpoint {
        let policy: Arc<dyn Policy> = Arc::new(OpenAiPolicy::new(
            OpenAiConfig {
                endpoint: endpoint.clone(),
                model: a.model.clone(),
                ..OpenAiConfig::default()
            },
            tokenizer.clone(),
        )?);
        Box::new(move |_: &tasks::Task| policy.clone())
    } else {
        let engine = EnginePolicyRouter::load(&tok_dir, &harness, a.replicas, 0, &a.model)
            .with_context(|| format!("loading model from {}", tok_dir.display()))?;
        let policy: Arc<dyn Policy> = engine.policy;
        Box::new(move |_: &tasks::Task| policy.clone())
    };
    // What makes the attempts, as the records name it.
    let absolute = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_path_buf());
    let policy = if let Some(p) = &a.script {
        format!("script {}", absolute(p).display())
    } else if let Some(endpoint) = &a.endpoint {
        format!("model {} at {endpoint}", a.model)
    } else {
        format!("model {}", absolute(Path::new(&a.model)).display())
    };
    let ecfg = EvalConfig {
        attempts: a.attempts,
        concurrency: a.concurrency,
        policy: Some(policy),
    };
    let rt = arcticd_sandbox::runtime()?;
    let summary = rt.block_on(async {
        let backend = crate::cli_tasks::backend(a.backend).await?;
        let s = eval::run_eval(
            &harness,
            policy_for.as_ref(),
            backend.as_ref(),
            &tasks,
            &ecfg,
            &a.out,
            a.traj.as_deref(),
        )
        .await?;
        anyhow::Ok(s)
    })?;
    // Nothing graded is an error, not a pass@1 of 0 (the records keep
    // every attempt's reason).
    if let Some(why) = summary.ungraded() {
        bail!("{why} (every attempt is recorded in {})", a.out.display());
    }
    outln!("{}", serde_json::to_string_pretty(&summary)?)?;
    Ok(())
}
