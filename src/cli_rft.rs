//! `arcticd rft`: rejection fine-tuning (sample K attempts per task, keep
//! the solved ones with well-formed turns, SFT on them, repeat). Prints the
//! report as JSON. Thin wiring over `arcticd_trainer::rft`.

use crate::cli_sandbox::BackendKind;
use crate::progress::Progress;
use anyhow::Result;
use arcticd_sandbox::tasks::{self, Format};
use arcticd_trainer::harness::{Harness, RolloutConfig};
use arcticd_trainer::rft::{self, RftConfig, Sampler};
use arcticd_trainer::sft::SftProgress;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

#[derive(clap::Args)]
pub struct RftArgs {
    /// Checkpoint to start from (Hugging Face layout, with its tokenizer).
    #[arg(long)]
    pub model: PathBuf,
    /// Task file (JSONL or JSON; see `arcticd tasks`).
    #[arg(long)]
    pub tasks: PathBuf,
    /// Task file format.
    #[arg(long, default_value = "auto")]
    pub format: String,
    /// Attempts per task and round (K).
    #[arg(long, default_value_t = 4)]
    pub attempts: usize,
    /// Output folder: round-N/ (attempts, trajectories, model), after/, report.json.
    #[arg(long)]
    pub out: PathBuf,
    /// Rounds of sample, filter, SFT.
    #[arg(long, default_value_t = 1)]
    pub rounds: usize,
    /// Rollouts at once.
    #[arg(long, default_value_t = 4)]
    pub concurrency: usize,
    /// SFT settings of each round as JSON (steps, batch_size, lr, warmup,
    /// grad_clip, weight_decay, shuffle_seed), e.g. '{"steps": 60, "lr": 5e-4}'.
    #[arg(long)]
    pub sft: Option<String>,
    /// Rollout settings: a JSON object or a JSON file (the keys of a recipe's [rollout];
    /// `arcticd warm-start` writes its setting to rollout.json). Default
    /// the harness's defaults.
    #[arg(long)]
    pub rollout: Option<String>,
    /// Sandbox backend.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BackendKind,
}

pub fn rft(a: RftArgs) -> Result<()> {
    crate::folder_out("--out", &a.out)?;
    let mut cfg = RftConfig {
        attempts: a.attempts,
        rounds: a.rounds,
        concurrency: a.concurrency,
        ..RftConfig::default()
    };
    if let Some(j) = &a.sft {
        cfg.sft = crate::json_setting("--sft", j)?;
    }
    let rollout: RolloutConfig = match &a.rollout {
        None => RolloutConfig::default(),
        Some(s) => crate::json_setting("--rollout", s)?,
    };
    let tasks = tasks::load_tasks(&a.tasks, a.format.parse::<Format>()?)?;
    let (tokenizer, template) = crate::cli_harness::load_model_files(&a.model)?;
    let harness = Harness::new(tokenizer, template, rollout)?;
    let bar = Arc::new(Mutex::new(None::<Progress>));
    let shown = bar.clone();
    // One bar per round's SFT, finished at its last step.
    let progress: SftProgress = Arc::new(move |done, total, loss| {
        if let Ok(mut slot) = shown.lock() {
            let p = slot.get_or_insert_with(|| Progress::new(Some(total as u64), "rft SFT"));
            p.set_message(format!("loss {loss:.4}"));
            p.set_position(done as u64);
            if done == total {
                if let Some(p) = slot.take() {
                    p.finish(String::new());
                }
            }
        }
    });
    let rt = arcticd_sandbox::runtime()?;
    let report = rt.block_on(async {
        let backend = crate::cli_tasks::backend(a.backend).await?;
        let r = rft::run_rft(
            &a.model,
            &tasks,
            &harness,
            &Sampler::Engine,
            backend.as_ref(),
            &a.out,
            &cfg,
            Some(progress),
        )
        .await?;
        anyhow::Ok(r)
    })?;
    drop(bar);
    for r in &report.rounds {
        eprintln!(
            "rft round {}: solved {}/{} tasks before (pass@1 {:.3}); kept {} trajectories \
             of {} tasks ({} rejected by the format check)",
            r.round,
            r.before.solved_tasks,
            r.before.tasks,
            r.before.pass_at_1,
            r.kept,
            r.kept_tasks,
            r.rejected_format
        );
    }
    eprintln!(
        "rft: after: solved {}/{} tasks (pass@1 {:.3}); model {}",
        report.after.solved_tasks,
        report.after.tasks,
        report.after.pass_at_1,
        report.final_model.display()
    );
    outln!("{}", serde_json::to_string_pretty(&report)?)?;
    Ok(())
}
