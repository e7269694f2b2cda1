//! Rejection fine-tuning through the real local sandbox: a round keeps
//! exactly the solved, well-formed trajectories, fine-tunes on them and
//! writes a loadable checkpoint, a report and the final model's attempts;
//! a rerun resumes without sampling or training again, and one with other
//! settings (or into a folder that is no rft output) is refused; a model that
//! solves nothing is a clear error with its attempts kept; `arcticd rft`
//! rejects bad input before anything starts.
//!
//! An unavailable local backend fails the test when `CI` is set and is
//! skipped loudly otherwise. Not for: whether RFT improves a model (a
//! measurement, see docs/).

mod common;
use anyhow::{ensure, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::{toy, Task};
use arcticd_trainer::harness::format::render_call;
use arcticd_trainer::harness::{Harness, Policy, ScriptedPolicy};
use arcticd_trainer::rft::{self, RftConfig, Sampler};
use arcticd_trainer::sft::SftSettings;
use arcticd_trainer::warm_start;
use common::{base_image, skip, TempDir};
use std::path::Path;
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

fn tiny_model(dir: &Path) {
    let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["init-model", "--preset", "tiny", "--out"])
        .arg(dir)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn harness(model: &Path) -> Harness {
    let tok = Arc::new(Tokenizer::from_dir(model).unwrap());
    let template = ChatTemplate::from_dir(model)
        .unwrap()
        .unwrap_or_else(ChatTemplate::qwen35);
    Harness::new(tok, template, warm_start::demo_rollout_config()).unwrap()
}

#[test]
fn a_round_keeps_the_solved_well_formed_attempts_and_resumes() {
    let dir = TempDir::new("rft").unwrap();
    let model = dir.0.join("model");
    tiny_model(&model);
    let tasks = toy::generate(&warm_start::demo_toy_config(4, 11), &dir.0.join("pool")).unwrap();
    let h = harness(&model);
    let tok = h.tokenizer().clone();
    // The expert on tasks 0 and 2; on 1 and 3 a submit without a fix
    // (reward 0).
    let solvable: Vec<String> = [0, 2]
        .iter()
        .map(|&i| tasks[i].instance_id.clone())
        .collect();
    let policy_for = move |t: &Task| -> Arc<dyn Policy> {
        let turns = if solvable.contains(&t.instance_id) {
            warm_start::expert_turns(t).unwrap()
        } else {
            vec![render_call("submit", &[])]
        };
        Arc::new(ScriptedPolicy::new(tok.clone(), turns))
    };
    let cfg = RftConfig {
        attempts: 2,
        concurrency: 2,
        sft: SftSettings {
            steps: 2,
            batch_size: 2,
            warmup: 1,
            ..SftSettings::default()
        },
        ..RftConfig::default()
    };
    let out = dir.0.join("out");
    with_local(async |backend| {
        let sampler = Sampler::Fixed(&policy_for);
        let r = rft::run_rft(&model, &tasks, &h, &sampler, backend, &out, &cfg, None).await?;
        ensure!(r.rounds.len() == 1, "{r:?}");
        let r1 = &r.rounds[0];
        ensure!(r1.before.tasks == 4 && r1.before.attempts == 8, "{r1:?}");
        ensure!(r1.before.solved_tasks == 2 && (r1.before.pass_at_1 - 0.5).abs() < 1e-9);
        ensure!(
            r1.kept == 4 && r1.kept_tasks == 2 && r1.rejected_format == 0,
            "{r1:?}"
        );
        ensure!(r1.first_loss.is_finite() && r1.first_loss > 0.0);
        ensure!(r.final_model == out.join("round-1/model"));
        arcticd_engine::Qwen3_5::load(&r.final_model)?;
        ensure!(
            r.after.attempts == 8 && r.after.solved_tasks == 2,
            "{:?}",
            r.after
        );
        ensure!(out.join("report.json").is_file() && out.join("after/attempts.jsonl").is_file());
        let lines = |p: &Path| std::fs::read_to_string(p).unwrap().lines().count();
        ensure!(lines(&out.join("round-1/attempts.jsonl")) == 8);

        // A rerun samples nothing new and does not retrain.
        let again = rft::run_rft(&model, &tasks, &h, &sampler, backend, &out, &cfg, None).await?;
        ensure!(lines(&out.join("round-1/attempts.jsonl")) == 8);
        ensure!(again.rounds[0].first_loss == 0.0 && again.rounds[0].kept == 4);

        // Other settings over the same folder are refused, the first that
        // differs named, before anything is sampled.
        let more = RftConfig {
            attempts: 3,
            ..cfg.clone()
        };
        let err = rft::run_rft(&model, &tasks, &h, &sampler, backend, &out, &more, None)
            .await
            .unwrap_err()
            .to_string();
        ensure!(err.contains("another attempts (2 there, 3 now)"), "{err}");
        ensure!(lines(&out.join("round-1/attempts.jsonl")) == 8);
        let err = rft::run_rft(&model, &tasks[..3], &h, &sampler, backend, &out, &cfg, None)
            .await
            .unwrap_err()
            .to_string();
        ensure!(err.contains("another tasks"), "{err}");
        // A folder that is not empty and has no rft.json is left untouched.
        let other = dir.0.join("other");
        std::fs::create_dir_all(&other)?;
        std::fs::write(other.join("notes.txt"), "mine")?;
        let err = rft::run_rft(&model, &tasks, &h, &sampler, backend, &other, &cfg, None)
            .await
            .unwrap_err()
            .to_string();
        ensure!(err.contains("is not empty and has no rft.json"), "{err}");
        ensure!(std::fs::read_dir(&other)?.count() == 1);
        Ok(())
    });
}

#[test]
fn a_model_that_solves_nothing_is_a_clear_error() {
    let dir = TempDir::new("rft-none").unwrap();
    let model = dir.0.join("model");
    tiny_model(&model);
    let tasks = toy::generate(&warm_start::demo_toy_config(2, 12), &dir.0.join("pool")).unwrap();
    let mut h = harness(&model);
    h.cfg.max_new_tokens = 16;
    let cfg = RftConfig {
        attempts: 1,
        concurrency: 2,
        ..RftConfig::default()
    };
    let out = dir.0.join("out");
    with_local(async |backend| {
        let e = rft::run_rft(
            &model,
            &tasks,
            &h,
            &Sampler::Engine,
            backend,
            &out,
            &cfg,
            None,
        )
        .await
        .unwrap_err()
        .to_string();
        ensure!(e.contains("nothing to fine-tune on"), "{e}");
        let n = std::fs::read_to_string(out.join("round-1/attempts.jsonl"))?
            .lines()
            .count();
        ensure!(n == 2, "{n} attempts recorded");
        ensure!(!out.join("round-1/model").exists());
        Ok(())
    });
}

#[test]
fn the_cli_rejects_bad_input_before_starting() {
    let dir = TempDir::new("rft-cli").unwrap();
    let run = |args: &[&str]| {
        let o = Command::new(env!("CARGO_BIN_EXE_arcticd"))
            .arg("rft")
            .args(args)
            .output()
            .unwrap();
        assert!(!o.status.success());
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let out = dir.0.join("out");
    let out = out.to_str().unwrap();
    let e = run(&[
        "--model",
        "/nonexistent",
        "--tasks",
        "/nonexistent.jsonl",
        "--out",
        out,
    ]);
    assert!(e.contains("error:"), "{e}");
    let model = dir.0.join("model");
    tiny_model(&model);
    let tasks = dir.0.join("pool");
    toy::generate(&warm_start::demo_toy_config(1, 13), &tasks).unwrap();
    let m = model.to_str().unwrap();
    let t = tasks.join("tasks.jsonl");
    let t = t.to_str().unwrap();
    let e = run(&["--model", m, "--tasks", t, "--out", out, "--attempts", "0"]);
    assert!(e.contains("attempts >= 1"), "{e}");
    let e = run(&[
        "--model",
        m,
        "--tasks",
        t,
        "--out",
        out,
        "--sft",
        "{\"stepz\": 1}",
    ]);
    assert!(e.contains("--sft"), "{e}");
    assert!(!Path::new(out).join("round-1").exists());
}
