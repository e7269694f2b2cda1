//! `arcticd tasks`: generate the toy pool, validate tasks, audit them for
//! wrong patches their tests accept.
//!
//! `tasks toy --count N --seed S --out DIR` writes DIR/tasks.jsonl and the
//! repositories; `tasks validate --tasks FILE --backend docker|local` prints
//! one JSON verdict per task; `tasks audit --tasks FILE --backend ...
//! [--out FILE] [--report FILE]` prints per-task audit lines and a summary
//! (precision / recall against the toy pool's ground truth) and writes the
//! curated set (valid and not loose). Thin wiring over
//! `arcticd_sandbox::tasks`.

use crate::cli_sandbox::BackendKind;
use anyhow::{bail, Context, Result};
use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::image;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::{self, audit, toy, validate, Format, Task};
use arcticd_sandbox::{Backend, Policy};
use std::path::PathBuf;

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
    #[arg(long, default_value = image::DEFAULT_TAG)]
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
    /// An OpenAI-compatible endpoint for agent-written wrong patches (not
    /// implemented yet: only mechanical variants are tried).
    #[arg(long)]
    pub endpoint: Option<String>,
    /// Model name at the endpoint.
    #[arg(long)]
    pub model: Option<String>,
    /// Ask the agent for extra tests (needs --endpoint; not implemented yet).
    #[arg(long)]
    pub strengthen: bool,
}

pub fn main(args: TasksArgs) -> Result<()> {
    match args.command {
        TasksCommand::Toy(a) => {
            let cfg = toy::ToyConfig {
                count: a.count,
                seed: a.seed,
                loose_share: a.loose_share,
            };
            let tasks = toy::generate(&cfg, &a.out)?;
            let loose = tasks.iter().filter(|t| t.toy_loose() == Some(true)).count();
            println!(
                "{}",
                serde_json::json!({
                    "tasks": tasks.len(),
                    "loose": loose,
                    "file": a.out.join("tasks.jsonl"),
                })
            );
            Ok(())
        }
        TasksCommand::Validate(a) => {
            let rt = arcticd_sandbox::runtime()?;
            rt.block_on(async {
                let (backend, tasks, policy, cfg) = setup(&a.common).await?;
                let verdicts =
                    validate::validate_tasks(backend.as_ref(), &tasks, &policy, &cfg).await;
                for v in &verdicts {
                    println!("{}", serde_json::to_string(v)?);
                }
                Ok(())
            })
        }
        TasksCommand::Audit(a) => {
            if a.endpoint.is_some() || a.strengthen {
                bail!("agent-written wrong patches and --strengthen are not implemented yet; run without --endpoint/--strengthen for the mechanical audit");
            }
            let _ = &a.model;
            let rt = arcticd_sandbox::runtime()?;
            rt.block_on(async {
                let (backend, tasks, policy, vcfg) = setup(&a.common).await?;
                let cfg = audit::AuditConfig {
                    validate: vcfg,
                    validate_first: !a.no_validate,
                    max_variants: a.max_variants,
                };
                let report = audit::audit_tasks(backend.as_ref(), &tasks, &policy, &cfg).await;
                if let Some(out) = &a.out {
                    let keep: Vec<Task> = tasks
                        .iter()
                        .zip(&report.results)
                        .filter(|(_, r)| r.verdict == "tight")
                        .map(|(t, _)| t.clone())
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
                            "precision": report.precision, "recall": report.recall,
                        });
                        println!("{summary}");
                    }
                    None => println!("{text}"),
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
    let backend = backend(a.backend).await?;
    let cfg = validate::ValidateConfig {
        image: a.image.clone(),
        test_timeout_secs: a.test_timeout,
        repeats: a.repeats,
        concurrency: a.concurrency,
    };
    Ok((backend, tasks, Policy::default(), cfg))
}
