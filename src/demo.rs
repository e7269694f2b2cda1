//! The built-in demo of `arcticd train` (no arguments): everything a fresh
//! machine needs to watch an agent learn by RL on 2 cores.
//!
//! It picks the sandbox (local bubblewrap, Docker when bubblewrap is
//! missing), builds the sandbox root file system if needed, writes a toy
//! training pool and a held-out toy set (one fixed package, no loose
//! tasks), builds the warm-started model (SFT on scripted expert
//! trajectories of *other* toy tasks, `arcticd_trainer::warm_start`) and
//! returns the recipe `recipes/demo.toml` pointing at them. Everything is
//! cached under `$ARCTICD_DEMO_DIR`, else `$XDG_CACHE_HOME/arcticd/demo`,
//! else `~/.cache/arcticd/demo`, keyed by the settings that made it, so
//! the second run starts training at once.

use anyhow::{bail, Context, Result};
use arcticd_sandbox::tasks::{self, toy, Format};
use arcticd_trainer::harness::eval::{run_eval, select_solved, EvalConfig};
use arcticd_trainer::harness::{EnginePolicyRouter, Harness, Policy, RolloutConfig};
use arcticd_trainer::rl::recipe::SandboxBackend;
use arcticd_trainer::rl::Recipe;
use arcticd_trainer::warm_start::{self, WarmStartConfig};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The demo's recipe (its `[rollout]` is the warm start's setting).
pub const DEMO_RECIPE: &str = include_str!("../recipes/demo.toml");

/// Training pool candidates: count and seed. The warm start's
/// demonstrations use `WarmStartConfig::demo_seed` (1000), so the three sets
/// never share a task.
const CANDIDATES: (usize, u64) = (160, 1);
/// The training pool is the candidates the warm start solved at least once
/// in this many attempts, at most `POOL_SIZE` of them (docs/demo.md: on an
/// unselected pool about half the tasks are never solved and only add
/// groups with no signal).
const SELECT_ATTEMPTS: usize = 2;
const POOL_SIZE: usize = 64;
/// Held-out set: size and seed.
const HELD_OUT: (usize, u64) = (24, 2);
/// Bump to rebuild every cached demo input.
const CACHE_VERSION: &str = "demo-v1";

fn cache_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("ARCTICD_DEMO_DIR") {
        return PathBuf::from(d);
    }
    arcticd_kernels::host::cache_dir("demo")
}

fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|p| p.join(program).is_file()))
}

/// A toy pool in `dir`, generated unless the same settings made it.
fn pool(dir: &Path, count: usize, seed: u64) -> Result<PathBuf> {
    let cfg = warm_start::demo_toy_config(count, seed);
    let key = serde_json::to_string(&cfg)?;
    let stamp = dir.join("settings.json");
    let file = dir.join("tasks.jsonl");
    if file.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(key.as_str()) {
        return Ok(file);
    }
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    toy::generate(&cfg, dir).with_context(|| format!("writing the toy pool {}", dir.display()))?;
    std::fs::write(&stamp, key)?;
    Ok(file)
}

/// The demo's training pool in `dir`: the tasks of `candidates` the
/// warm-started `model` solved at least once in `SELECT_ATTEMPTS` attempts
/// (sampled as in training, through the same harness and sandbox), in file
/// order, at most `POOL_SIZE`. Cached under the warm start's settings
/// `warm_key`; the sampling is resumable (its attempts are kept in
/// `dir/warm-start-eval.jsonl`).
async fn selected_pool(
    dir: &Path,
    candidates: &Path,
    model: &Path,
    warm_key: &str,
    rollout: &RolloutConfig,
    backend: &dyn arcticd_sandbox::Backend,
) -> Result<PathBuf> {
    let key = serde_json::to_string(&(
        warm_key,
        std::fs::read_to_string(candidates.with_file_name("settings.json")).unwrap_or_default(),
        SELECT_ATTEMPTS,
        POOL_SIZE,
    ))?;
    let stamp = dir.join("settings.json");
    let file = dir.join("tasks.jsonl");
    if file.is_file() && std::fs::read_to_string(&stamp).ok().as_deref() == Some(key.as_str()) {
        return Ok(file);
    }
    let partial = dir.join("partial-settings.json");
    if dir.exists() && std::fs::read_to_string(&partial).ok().as_deref() != Some(key.as_str()) {
        std::fs::remove_dir_all(dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    std::fs::write(&partial, &key)?;
    let all = tasks::load_tasks(candidates, Format::Native)?;
    eprintln!(
        "demo: choosing the training pool: the warm start attempts each of {} candidate \
         tasks {} times and keeps those it solves at least once (about 2 minutes, once)",
        all.len(),
        SELECT_ATTEMPTS
    );
    let t0 = std::time::Instant::now();
    let (tokenizer, template) = crate::cli_harness::load_model_files(model)?;
    let harness = Harness::new(tokenizer, template, rollout.clone())?;
    let engine = EnginePolicyRouter::load(model, &harness, 1, 0, "warm-start")?;
    let policy: Arc<dyn Policy> = engine.policy.clone();
    let policy_for = move |_: &tasks::Task| policy.clone();
    let cfg = EvalConfig {
        attempts: SELECT_ATTEMPTS,
        concurrency: 8,
        policy: None,
    };
    let records = dir.join("warm-start-eval.jsonl");
    let summary = run_eval(&harness, &policy_for, backend, &all, &cfg, &records, None).await;
    engine.router.shutdown();
    let summary = summary?;
    if let Some(why) = summary.ungraded() {
        bail!("choosing the training pool: {why} ({})", records.display());
    }
    let kept = select_solved(&all, &summary, 1, POOL_SIZE);
    if kept.is_empty() {
        bail!(
            "the warm start solved none of the {} candidate tasks ({}): \
             delete {} to rebuild the demo's inputs",
            all.len(),
            records.display(),
            dir.parent().unwrap_or(dir).display()
        );
    }
    let kept: Vec<tasks::Task> = kept.into_iter().cloned().collect();
    tasks::write_tasks(&file, &kept)?;
    std::fs::write(&stamp, &key)?;
    eprintln!(
        "demo: training pool of {} tasks ({} of {} candidates solved at least once; \
         warm-start pass@1 {:.2}) in {:.0} s",
        kept.len(),
        summary.per_task.iter().filter(|r| r.solved > 0).count(),
        all.len(),
        summary.pass_at_1,
        t0.elapsed().as_secs_f64()
    );
    Ok(file)
}

/// Prepares the demo's inputs and returns its recipe with `sets` applied.
pub fn prepare(sets: &[String]) -> Result<Recipe> {
    let mut recipe = Recipe::from_toml_with(DEMO_RECIPE, "the built-in demo recipe", sets)?;
    let root = cache_dir().join(CACHE_VERSION);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    eprintln!("demo: inputs cached in {}", root.display());

    let rt = arcticd_sandbox::runtime()?;
    let (backend_kind, backend) = rt.block_on(async {
        if on_path("bwrap") {
            let b = arcticd_sandbox::local::LocalBackend::new()
                .await
                .context("the local (bubblewrap) sandbox")?;
            let b: Box<dyn arcticd_sandbox::Backend> = Box::new(b);
            anyhow::Ok((SandboxBackend::Local, b))
        } else {
            match arcticd_sandbox::docker::DockerBackend::new().await {
                Ok(b) => {
                    let b: Box<dyn arcticd_sandbox::Backend> = Box::new(b);
                    Ok((SandboxBackend::Docker, b))
                }
                Err(e) => bail!(
                    "the demo needs a sandbox: install bubblewrap \
                     (apt-get install bubblewrap debootstrap) or start Docker ({e})"
                ),
            }
        }
    })?;
    recipe.backend = backend_kind;
    eprintln!(
        "demo: sandbox backend {}",
        match backend_kind {
            SandboxBackend::Local => "local (bubblewrap)",
            SandboxBackend::Docker => "docker",
        }
    );
    let docker = backend_kind == SandboxBackend::Docker;
    rt.block_on(crate::cli_sandbox::ensure_base_image(docker, "demo"))?;

    let eval = pool(&root.join("held-out"), HELD_OUT.0, HELD_OUT.1)?;

    let cfg = WarmStartConfig::default();
    let rollout = warm_start::demo_rollout_config();
    let warm = root.join("warm-start");
    let key = serde_json::to_string(&(&cfg, &rollout))?;
    let stamp = warm.join("settings.json");
    let model = warm.join("model");
    let cached = model.join("config.json").is_file()
        && std::fs::read_to_string(&stamp).ok().as_deref() == Some(key.as_str());
    if cached {
        eprintln!("demo: warm-started model {} (cached)", model.display());
    } else {
        if warm.exists() {
            std::fs::remove_dir_all(&warm)?;
        }
        let report = rt.block_on(crate::cli_warm::build_shown(
            &cfg,
            &rollout,
            backend.as_ref(),
            &warm,
            "demo: building the warm-started model once",
            " (about 9 minutes on 2 cores)",
        ))?;
        std::fs::write(&stamp, &key)?;
        eprintln!(
            "demo: warm start ready in {:.0} s ({} demonstrations kept, loss {:.3} -> {:.3})",
            report.total_secs, report.kept, report.first_loss, report.last_loss
        );
    }
    let candidates = pool(&root.join("candidates"), CANDIDATES.0, CANDIDATES.1)?;
    let tasks = rt.block_on(selected_pool(
        &root.join("pool"),
        &candidates,
        &model,
        &key,
        &rollout,
        backend.as_ref(),
    ))?;
    recipe.model = Some(model);
    recipe.tasks = Some(tasks);
    recipe.eval_tasks = Some(eval);
    Ok(recipe)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn demo_recipe_parses_and_runs_the_warm_starts_setting() {
        let r = Recipe::from_toml(DEMO_RECIPE, "recipes/demo.toml").unwrap();
        assert_eq!(r.rollout, warm_start::demo_rollout_config());
        assert!(r.model.is_none() && r.tasks.is_none());
    }
}
