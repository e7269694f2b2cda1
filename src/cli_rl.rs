//! `arcticd train`: the asynchronous RL loop (trainer crate, `rl`) from a
//! recipe, a resumed run directory, or with no arguments the built-in demo
//! (`crate::demo`). Shows one progress line per update, optionally serves
//! the latest metrics as Prometheus text, and says where the run and its
//! plots are.

use anyhow::{bail, Context, Result};
use arcticd_engine::config::ModelConfig;
use arcticd_trainer::rl::run_dir::RunDir;
use arcticd_trainer::rl::{self, Recipe, RunOptions};
use clap::Args;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(Args)]
pub struct TrainArgs {
    /// Recipe (TOML; every key is documented in recipes/default.toml).
    /// Without a recipe and without --resume: the built-in demo.
    #[arg(long)]
    pub recipe: Option<PathBuf>,
    /// Run directory (default: runs/<recipe name>-<unix time>).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Override a recipe key: --set steps=20 --set rollout.max_turns=8.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// Continue the run in this directory from its last complete checkpoint.
    #[arg(long, value_name = "RUN_DIR", conflicts_with_all = ["recipe", "out"])]
    pub resume: Option<PathBuf>,
    /// Serve the latest update's metrics as Prometheus text on this port
    /// (127.0.0.1).
    #[arg(long)]
    pub metrics_port: Option<u16>,
    /// Where the engines run and the trainer steps: cpu or cuda:N (the
    /// recipe key `device`; a resumed run may move to another device).
    #[arg(long)]
    pub device: Option<arcticd_kernels::Device>,
}

#[derive(Args)]
pub struct ReplayArgs {
    /// The run directory.
    #[arg(long)]
    pub run: PathBuf,
    /// The update to replay (its batch is trajectories/step-N.jsonl; the
    /// checkpoint of update N-1 must exist).
    #[arg(long)]
    pub step: u64,
    /// Go on replaying the recorded updates after it, up to this one, each
    /// after the one before (the checkpoint of update STEP-1 is the only one
    /// needed).
    #[arg(long)]
    pub through: Option<u64>,
    /// Change a key of the run's recipe for the replay: --set min_token_prob=0.
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// JSON file `{"sequences": [[token ids], ...]}`: the log-prob of each
    /// sequence's last token is reported before and after the update.
    #[arg(long)]
    pub probes: Option<PathBuf>,
    /// On the last replayed update, put each parameter alone back to its
    /// value before it and report those that move the probes most.
    #[arg(long, requires = "probes")]
    pub attribute: bool,
}

/// `arcticd replay`: one JSON object per replayed update on stdout.
pub fn replay(args: ReplayArgs) -> Result<()> {
    #[derive(serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Probes {
        sequences: Vec<Vec<u32>>,
    }
    let probes = match &args.probes {
        Some(p) => {
            let text =
                std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
            serde_json::from_str::<Probes>(&text)
                .with_context(|| {
                    format!(
                        "{} must be {{\"sequences\": [[token ids], ...]}}",
                        p.display()
                    )
                })?
                .sequences
        }
        None => Vec::new(),
    };
    let through = args.through.unwrap_or(args.step);
    for r in rl::replay::replay(
        &args.run,
        args.step,
        through,
        &args.sets,
        &probes,
        args.attribute,
    )? {
        outln!("{}", serde_json::to_string(&r)?)?;
    }
    Ok(())
}

fn unix_time() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// A run's held-out change as a person reads it.
fn held_out_text(h: &arcticd_trainer::rl::HeldOutChange) -> String {
    let attempts = match h.attempts {
        (a, b) if a == b => format!("{a} attempts"),
        (a, b) => format!("{a} then {b} attempts"),
    };
    format!(
        "held-out pass@1 {:.1}% before the first update, {:.1}% at update {} ({:+.1} points, \
         standard error {:.1}, {} tasks x {attempts})",
        100.0 * h.from,
        100.0 * h.to,
        h.to_step,
        100.0 * (h.to - h.from),
        100.0 * h.std_error,
        h.tasks,
    )
}

/// One line per update, as a person reads it.
fn progress_line(rec: &Value, steps: u64) -> String {
    let f = |k: &str| rec.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN);
    let step = rec.get("step").and_then(Value::as_u64).unwrap_or(0);
    let elapsed = f("elapsed_s");
    let eta = if step > 0 {
        elapsed / step as f64 * steps.saturating_sub(step) as f64
    } else {
        f64::NAN
    };
    // Same-version tokens are absent when the update trained nothing (every
    // group zero-variance) or when every trained token was sampled by older
    // weights (the trainer is the bottleneck and rollouts wait their turn).
    let count = |k: &str| rec.get(k).and_then(Value::as_u64).unwrap_or(0);
    // A probe (`probe_every`) measures it on purpose when the batch cannot.
    let probe = count("probe_tokens");
    let mismatch = match (count("mismatch_same_version_tokens"), count("tokens")) {
        (n, _) if n > 0 => format!("{:.1e}", f("mismatch_same_version_max")),
        _ if probe > 0 => format!("{:.1e} (probe, {probe} tokens)", f("probe_mismatch_max")),
        (_, 0) => "n/a (nothing trained)".to_string(),
        _ => "n/a (every token from older weights)".to_string(),
    };
    let mut s = format!(
        "reward {:.3} | pass {:.1}% | rollouts/s {:.2} | stale dropped {} | mismatch(same version) {mismatch} | {:.0}s, ETA {:.0}s",
        f("reward_mean"),
        100.0 * f("pass_rate"),
        f("rollouts_per_s"),
        rec.get("stale_dropped").and_then(Value::as_u64).unwrap_or(0),
        elapsed,
        eta
    );
    if let Some(p) = rec.get("eval_pass_at_1").and_then(Value::as_f64) {
        s.push_str(&format!(" | held-out pass@1 {:.1}%", 100.0 * p));
        if let Some(e) = rec.get("eval_std_error").and_then(Value::as_f64) {
            s.push_str(&format!(" ± {:.1}", 100.0 * e));
        }
    }
    match rec.get("rolled_back_to").and_then(Value::as_u64) {
        Some(0) => s.push_str(" | collapsed: rolled back to the starting model"),
        Some(at) => s.push_str(&format!(" | collapsed: rolled back to update {at}")),
        None => {}
    }
    s
}

/// The numeric fields of a metrics record as Prometheus text.
pub fn prometheus_text(rec: &Value) -> String {
    let mut out = String::new();
    if let Some(m) = rec.as_object() {
        for (k, v) in m {
            match v {
                Value::Number(n) => {
                    if let Some(x) = n.as_f64() {
                        out.push_str(&format!("arcticd_{k} {x}\n"));
                    }
                }
                Value::Bool(b) => out.push_str(&format!("arcticd_{k} {}\n", u8::from(*b))),
                Value::Array(a) => {
                    for (i, x) in a.iter().enumerate() {
                        if let Some(x) = x.as_f64() {
                            out.push_str(&format!("arcticd_{k}{{replica=\"{i}\"}} {x}\n"));
                        }
                    }
                }
                Value::Object(o) => {
                    for (label, x) in o {
                        if let Some(x) = x.as_f64() {
                            out.push_str(&format!("arcticd_{k}{{key=\"{label}\"}} {x}\n"));
                        }
                    }
                }
                _ => {}
            }
        }
    }
    out
}

/// Serves the latest metrics record on 127.0.0.1:`port` (0: any free
/// port); returns the port it listens on.
fn serve_metrics(port: u16, latest: Arc<Mutex<String>>) -> Result<u16> {
    let listener = std::net::TcpListener::bind(("127.0.0.1", port))
        .with_context(|| format!("--metrics-port {port}: cannot listen"))?;
    listener.set_nonblocking(true)?;
    let port = listener.local_addr()?.port();
    std::thread::Builder::new()
        .name("metrics".into())
        .spawn(move || {
            let rt = match tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
            {
                Ok(rt) => rt,
                Err(e) => {
                    tracing::warn!("metrics server: {e}");
                    return;
                }
            };
            rt.block_on(async move {
                let app = axum::Router::new().route(
                    "/metrics",
                    axum::routing::get(move || {
                        let latest = latest.clone();
                        async move { latest.lock().map(|s| s.clone()).unwrap_or_default() }
                    }),
                );
                match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => {
                        if let Err(e) = axum::serve(l, app).await {
                            tracing::warn!("metrics server: {e}");
                        }
                    }
                    Err(e) => tracing::warn!("metrics server: {e}"),
                }
            });
        })?;
    Ok(port)
}

pub fn train(mut a: TrainArgs) -> Result<()> {
    if let (Some(d), None) = (a.device, &a.resume) {
        a.sets.push(format!("device={d}"));
    }
    let (mut recipe, out, resume) = if let Some(dir) = &a.resume {
        let path = dir.join("recipe.toml");
        if dir.is_file() {
            bail!("{} is a file, not a run directory", dir.display());
        }
        if !dir.is_dir() {
            bail!("{}: no such run directory", dir.display());
        }
        if !path.is_file() {
            bail!("{} is not a run directory (no recipe.toml)", dir.display());
        }
        if !a.sets.is_empty() {
            bail!(
                "--set cannot change a run being resumed; its recipe is {}",
                path.display()
            );
        }
        (Recipe::from_file(&path, &[])?, dir.clone(), true)
    } else if let Some(path) = &a.recipe {
        let r = Recipe::from_file(path, &a.sets)
            .with_context(|| format!("reading the recipe {}", path.display()))?;
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().to_string())
            .unwrap_or_else(|| "run".into());
        let out = a
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("runs/{stem}-{}", unix_time())));
        RunDir::new(&out).check_new()?;
        (r, out, false)
    } else {
        let out = a
            .out
            .clone()
            .unwrap_or_else(|| PathBuf::from(format!("runs/demo-{}", unix_time())));
        // Before the demo builds its inputs (minutes), not after.
        RunDir::new(&out).check_new()?;
        (crate::demo::prepare(&a.sets)?, out, false)
    };
    if let (Some(d), true) = (a.device, resume) {
        recipe.device = d;
        recipe = recipe.checked()?;
    }
    if recipe.model.is_none() {
        bail!("the recipe names no model: set model = \"DIR\" in it, or --set model=DIR");
    }
    let steps = recipe.steps;
    for a in recipe.ablations() {
        eprintln!("ABLATION ON (not the full recipe): {a}");
        tracing::warn!("ablation on: {a}");
    }
    if let Some(w) = recipe
        .train_config()
        .schedule
        .unfinished_warmup(steps, recipe.lr)
    {
        tracing::warn!("{w}");
    }
    let latest = Arc::new(Mutex::new(String::new()));
    if let Some(port) = a.metrics_port {
        let port = serve_metrics(port, latest.clone())?;
        eprintln!("metrics: http://127.0.0.1:{port}/metrics");
    }
    eprintln!(
        "training: {} updates of {} groups x {} attempts; run directory {}",
        steps,
        recipe.groups_per_step,
        recipe.group_size,
        out.display()
    );
    // `rl::run` checks the same plan before it loads the weights.
    if let Some(config) = recipe
        .model
        .as_deref()
        .and_then(|m| ModelConfig::from_dir(m).ok())
    {
        if recipe.device == arcticd_kernels::Device::Cpu {
            eprintln!("memory plan:\n{}", rl::memory_plan(&recipe, &config));
        } else {
            eprintln!(
                "memory plan of each rank's GPU:\n{}",
                rl::gpu_memory_plan(&recipe, &config)
            );
        }
    }
    // Resumed runs start past 0; the bar shows updates of the whole run.
    let progress = Arc::new(Mutex::new(
        crate::progress::Progress::new(Some(steps), "train").with_interval(Duration::ZERO),
    ));
    let shown = progress.clone();
    let on_step = Box::new(move |rec: &Value| {
        if let Ok(mut p) = shown.lock() {
            p.set_message(progress_line(rec, steps));
            p.set_position(rec.get("step").and_then(Value::as_u64).unwrap_or(0));
        }
        if let Ok(mut l) = latest.lock() {
            *l = prometheus_text(rec);
        }
    });
    let summary = rl::run(
        recipe,
        RunOptions {
            out: out.clone(),
            resume,
            cancel: Arc::new(AtomicBool::new(false)),
            on_step: Some(on_step),
        },
    )?;
    if let Ok(m) = Arc::try_unwrap(progress) {
        m.into_inner()
            .unwrap_or_else(|e| e.into_inner())
            .finish(String::new());
    }
    let plots = crate::cli_plot::plot_runs(std::slice::from_ref(&out), &out.join("plots"), 10)
        .map_err(|e| tracing::warn!("plotting: {e:#}"))
        .unwrap_or_default();
    outln!("{}", serde_json::to_string_pretty(&summary)?)?;
    eprintln!(
        "{} after {} updates{}; {}run directory {}{}",
        match (summary.cancelled, &summary.stopped) {
            (true, _) => "stopped",
            (false, Some(_)) => "failed",
            (false, None) => "done",
        },
        summary.steps,
        match summary.totals.rollbacks {
            0 => String::new(),
            1 => " (1 rollback after a collapse)".to_string(),
            n => format!(" ({n} rollbacks after collapses)"),
        },
        summary
            .held_out
            .as_ref()
            .map(|h| format!("{}; ", held_out_text(h)))
            .unwrap_or_default(),
        out.display(),
        if plots.is_empty() {
            String::new()
        } else {
            format!(
                "; plots: {}",
                plots
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        }
    );
    if let Some(why) = &summary.stopped {
        anyhow::bail!("the run failed: {why}");
    }
    if summary.cancelled {
        // Stopped by a signal, with its checkpoint: not a finished run.
        std::process::exit(arcticd_trainer::interrupt::status().unwrap_or(130));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn progress_line_says_when_the_run_rolled_back() {
        let rec = json!({"step": 67, "elapsed_s": 10.0, "rolled_back_to": 60});
        assert!(progress_line(&rec, 80).ends_with(" | collapsed: rolled back to update 60"));
        let rec = json!({"step": 7, "elapsed_s": 10.0, "rolled_back_to": 0});
        assert!(
            progress_line(&rec, 80).ends_with(" | collapsed: rolled back to the starting model")
        );
        let rec = json!({"step": 68, "elapsed_s": 10.0});
        assert!(!progress_line(&rec, 80).contains("rolled back"));
    }

    #[test]
    fn progress_line_says_when_nothing_was_trained() {
        for tokens in [json!(0), json!(null)] {
            let rec = json!({"step": 2, "elapsed_s": 10.0, "reward_mean": 0.0, "pass_rate": 0.0,
                "mismatch_same_version_tokens": tokens, "mismatch_same_version_max": null});
            assert!(progress_line(&rec, 4).contains("mismatch(same version) n/a (nothing trained)"));
        }
        let rec = json!({"step": 2, "elapsed_s": 10.0, "tokens": 5390,
            "mismatch_same_version_tokens": 0, "mismatch_same_version_max": 0.0});
        let line = progress_line(&rec, 4);
        assert!(
            line.contains("n/a (every token from older weights)"),
            "{line}"
        );
        let rec = json!({"step": 2, "elapsed_s": 10.0, "tokens": 5390,
            "mismatch_same_version_tokens": 0, "probe_tokens": 32, "probe_mismatch_max": 0.0});
        let line = progress_line(&rec, 4);
        assert!(
            line.contains("mismatch(same version) 0.0e0 (probe, 32 tokens)"),
            "{line}"
        );
        let rec = json!({"step": 2, "elapsed_s": 10.0, "mismatch_same_version_tokens": 9,
            "mismatch_same_version_max": 2e-6, "eval_pass_at_1": 0.25});
        let line = progress_line(&rec, 4);
        assert!(
            line.contains("mismatch(same version) 2.0e-6")
                && line.contains("held-out pass@1 25.0%"),
            "{line}"
        );
        // With its standard error when the evaluation had one.
        let rec = json!({"step": 2, "elapsed_s": 10.0, "eval_pass_at_1": 0.25,
            "eval_std_error": 0.0234});
        let line = progress_line(&rec, 4);
        assert!(line.ends_with("held-out pass@1 25.0% ± 2.3"), "{line}");
    }

    #[test]
    fn prometheus_text_has_numbers_arrays_and_maps() {
        let t = prometheus_text(&json!({
            "step": 3, "reward_mean": 0.5, "update_skipped": false,
            "replica_load": [1, 2], "termination": {"submitted": 4}, "note": "x"
        }));
        assert!(t.contains("arcticd_step 3\n"));
        assert!(t.contains("arcticd_reward_mean 0.5\n"));
        assert!(t.contains("arcticd_update_skipped 0\n"));
        assert!(t.contains("arcticd_replica_load{replica=\"1\"} 2\n"));
        assert!(t.contains("arcticd_termination{key=\"submitted\"} 4\n"));
        assert!(!t.contains("note"));
    }
}
