//! `arcticd warm-start`: the warm-started model of the built-in RL demo
//! (a fresh model, SFT on scripted expert trajectories of toy tasks run
//! through the real harness). Prints the report as JSON. Thin wiring over
//! `arcticd_trainer::warm_start`.

use crate::cli_sandbox::BackendKind;
use anyhow::{Context, Result};
use arcticd_sandbox::Backend;
use arcticd_trainer::harness::RolloutConfig;
use arcticd_trainer::warm_start::{self, WarmStartConfig, WarmStartReport};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

#[derive(clap::Args)]
pub struct WarmStartArgs {
    /// Output folder: base/, demos/, demos.jsonl and model/ (the checkpoint).
    #[arg(long)]
    pub out: PathBuf,
    /// Warm-start settings as JSON, inline or a file: demos, demo_seed,
    /// give_up_share, preset, init_seed, base_model, concurrency and sft
    /// (the SFT run's settings), e.g. '{"demos": 64, "sft": {"steps": 80}}'.
    #[arg(long)]
    pub config: Option<String>,
    /// Rollout settings as JSON, inline or a file (the keys of a recipe's
    /// [rollout]); default the demo's short-prompt setting. Eval and RL
    /// must use the same.
    #[arg(long)]
    pub rollout: Option<String>,
    /// Sandbox backend.
    #[arg(long, value_enum, default_value = "local")]
    pub backend: BackendKind,
}

pub fn warm_start(a: WarmStartArgs) -> Result<()> {
    crate::folder_out("--out", &a.out)?;
    let cfg: WarmStartConfig = match &a.config {
        Some(j) => crate::json_setting("--config", j)?,
        None => WarmStartConfig::default(),
    };
    let rollout: RolloutConfig = match &a.rollout {
        Some(j) => crate::json_setting("--rollout", j)?,
        None => warm_start::demo_rollout_config(),
    };
    // Before the base image is built or a demonstration runs.
    cfg.check().context("--config")?;
    let rt = arcticd_sandbox::runtime()?;
    let report = rt.block_on(async {
        // The toy tasks run in the base image: built once, cached by tag.
        let docker = matches!(a.backend, BackendKind::Docker);
        crate::cli_sandbox::ensure_base_image(docker, "warm-start").await?;
        let backend = crate::cli_tasks::backend(a.backend).await?;
        let r = build_shown(&cfg, &rollout, backend.as_ref(), &a.out, "warm-start", "").await?;
        anyhow::Ok(r)
    })?;
    outln!("{}", serde_json::to_string_pretty(&report)?)?;
    Ok(())
}

/// [`warm_start::build_warm_start`] as a user watches it: a line saying
/// what it will do (`who` starts it, `note` ends it), then the SFT's
/// progress bar with its loss.
pub(crate) async fn build_shown(
    cfg: &WarmStartConfig,
    rollout: &RolloutConfig,
    backend: &dyn Backend,
    out: &Path,
    who: &str,
    note: &str,
) -> Result<WarmStartReport> {
    eprintln!(
        "{who}: {} teacher demonstrations through the sandbox (on {:.0}% of them the teacher \
         gives up), then {} SFT steps{note}",
        cfg.demos,
        cfg.give_up_share * 100.0,
        cfg.sft.steps
    );
    let bar = Arc::new(Mutex::new(crate::progress::Progress::new(
        Some(cfg.sft.steps as u64),
        "warm-start SFT",
    )));
    let shown = bar.clone();
    let progress: warm_start::SftProgress = Arc::new(move |done, _, loss| {
        if let Ok(mut p) = shown.lock() {
            p.set_message(format!("loss {loss:.4}"));
            p.set_position(done as u64);
        }
    });
    let report = warm_start::build_warm_start(cfg, rollout, backend, out, Some(progress)).await?;
    if let Ok(m) = Arc::try_unwrap(bar) {
        m.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .finish(String::new());
    }
    Ok(report)
}
