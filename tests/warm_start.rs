//! The warm start of the RL demo through the real local sandbox: the
//! expert's turns pass the strict format check and earn reward 1 on every
//! toy family, under both the demo's short prompt and the default one; its
//! trajectories become SFT examples whose targets are exactly the generated
//! tokens; `build_warm_start` writes a loadable checkpoint.
//!
//! An unavailable local backend fails the test when `CI` is set and is
//! skipped loudly otherwise. Not for: model quality (see the report of the
//! warm-start measurements).

mod common;
use anyhow::{ensure, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::toy;
use arcticd_trainer::harness::tools::tool_schemas;
use arcticd_trainer::harness::{check_format, Harness, RolloutConfig, Termination};
use arcticd_trainer::warm_start::{self, SftSettings, WarmStartConfig};
use common::{base_image, skip, TempDir};
use std::process::Command;
use std::sync::Arc;

fn with_local(body: impl AsyncFnOnce(&LocalBackend) -> Result<()>) {
    if let Err(e) = base_image() {
        return skip("local", &format!("base image: {e}"));
    }
    let rt = arcticd_sandbox::runtime().expect("runtime");
    rt.block_on(async {
        let backend = match LocalBackend::new().await {
            Ok(b) => b,
            Err(e) => return skip("local", &e.to_string()),
        };
        if let Err(e) = body(&backend).await {
            panic!("{e:#}");
        }
    });
}

#[test]
fn expert_solves_every_family_with_reward_1() {
    let dir = TempDir::new("warm").unwrap();
    let model = dir.0.join("model");
    let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["init-model", "--preset", "tiny", "--out"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // Six tasks: one of each family.
    let tasks = toy::generate(&warm_start::demo_toy_config(6, 7), &dir.0.join("pool")).unwrap();
    let tok = Arc::new(Tokenizer::from_dir(&model).unwrap());
    let template = || {
        ChatTemplate::from_dir(&model)
            .unwrap()
            .unwrap_or_else(ChatTemplate::qwen35)
    };
    with_local(async |backend| {
        for cfg in [warm_start::demo_rollout_config(), RolloutConfig::default()] {
            let short = !cfg.prompt_tools;
            let h = Harness::new(tok.clone(), template(), cfg)?;
            let trajs = warm_start::expert_trajectories(&h, backend, &tasks, 2, 0.0, 0).await?;
            ensure!(trajs.len() == tasks.len());
            for (task, t) in tasks.iter().zip(&trajs) {
                t.check()?;
                ensure!(t.task_id == task.instance_id, "trajectories out of order");
                ensure!(
                    t.termination == Termination::Submitted && t.reward == 1.0,
                    "{}: {:?} reward {}: {}",
                    t.task_id,
                    t.termination,
                    t.reward,
                    t.detail
                );
                ensure!(t.turns.len() == 3);
                for turn in &t.turns {
                    ensure!(
                        check_format(&turn.raw_text, &tool_schemas()).is_ok(),
                        "{:?}",
                        turn.raw_text
                    );
                }
                ensure!(
                    short != t.prompt_text.contains("<tools>"),
                    "the tool schemas are in the prompt exactly when prompt_tools is on"
                );
            }
            let examples = warm_start::sft_examples(&trajs);
            ensure!(examples.len() == trajs.len());
            for (ex, t) in examples.iter().zip(&trajs) {
                let generated: usize = t.turns.iter().map(|x| x.n_tokens).sum();
                let targets = ex.loss_mask.iter().filter(|&&m| m == 1).count();
                ensure!(
                    targets == generated,
                    "{targets} targets, {generated} generated"
                );
                ensure!(ex.loss_mask[..t.prompt_len].iter().all(|&m| m == 0));
            }
        }
        Ok(())
    });
}

#[test]
fn build_warm_start_writes_a_loadable_checkpoint() {
    let dir = TempDir::new("warm-build").unwrap();
    let cfg = WarmStartConfig {
        preset: "tiny".into(),
        demos: 4,
        sft: SftSettings {
            steps: 3,
            batch_size: 2,
            warmup: 1,
            ..SftSettings::default()
        },
        ..WarmStartConfig::default()
    };
    with_local(async |backend| {
        let r = warm_start::build_warm_start(
            &cfg,
            &warm_start::demo_rollout_config(),
            backend,
            dir.path(),
            None,
        )
        .await?;
        ensure!(r.demos == 4 && r.kept == 4, "{r:?}");
        ensure!(
            r.first_loss.is_finite() && r.last_loss < r.first_loss,
            "{r:?}"
        );
        ensure!(r.prompt_tokens > 0.0 && r.trajectory_tokens > r.prompt_tokens);
        arcticd_engine::Qwen3_5::load(&r.model_dir)?;
        let rollout: RolloutConfig =
            serde_json::from_str(&std::fs::read_to_string(dir.path().join("rollout.json"))?)?;
        ensure!(!rollout.prompt_tools);
        Ok(())
    });
}
