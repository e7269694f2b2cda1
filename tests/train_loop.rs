//! `arcticd train` end to end on the tiny preset, a few toy tasks and the
//! local sandbox: invariants of the loop, not learning.
//!
//! - No trained token lags the trainer by more than `max_staleness`.
//! - The behaviour log-prob of every trained token equals `arcticd score`
//!   under the checkpoint of that token's weight version (1e-5): versions
//!   are honest and in-flight caches were rebuilt after every update.
//! - The same-version engine/trainer mismatch is within 1e-6.
//! - A run killed with SIGKILL while rollouts run, while the weights are
//!   being written (engines paused) and while a checkpoint is being
//!   written resumes with no update missing or doubled.
//! - Bad recipes and missing inputs are clear errors before anything starts.
//! - SIGINT or SIGTERM stops after the update with a checkpoint; a second
//!   signal stops at once.
//!
//! The recipe turns on a small entropy bonus and keeps zero-variance groups
//! so that a random model's all-zero rewards still move the weights every
//! update (what is checked is that versions and caches stay honest when
//! they move).

mod common;

use common::TempDir;
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn arcticd() -> Command {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
}

/// `arcticd train --recipe RECIPE --out RUN`, with `--set` for each of
/// `sets` (`key=value`).
fn train(recipe: &Path, run: &Path, sets: &[&str]) -> Command {
    let mut cmd = arcticd();
    cmd.args(["train", "--recipe"])
        .arg(recipe)
        .arg("--out")
        .arg(run);
    for kv in sets {
        cmd.args(["--set", kv]);
    }
    cmd
}

/// `arcticd train --resume RUN`, run to its end.
fn resume(run: &Path) -> Output {
    arcticd()
        .args(["train", "--resume"])
        .arg(run)
        .output()
        .unwrap()
}

fn ok(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what} failed: {}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// Local sandbox ready (image built); false: skipped (fails under CI).
fn local_ready() -> bool {
    if let Err(e) = common::base_image() {
        common::skip("local", &e);
        return false;
    }
    let rt = arcticd_sandbox::runtime().unwrap();
    match rt.block_on(arcticd_sandbox::local::LocalBackend::new()) {
        Ok(_) => true,
        Err(e) => {
            common::skip("local", &e.to_string());
            false
        }
    }
}

const RECIPE: &str = r#"
model = "tiny"
tasks = "toy/tasks.jsonl"
steps = 4
group_size = 2
groups_per_step = 2
concurrency = 4
max_staleness = 1
lr = 1e-2
entropy_coef = 0.05
filter_zero_variance = false
eval_every = 0
recheck_every = 0
checkpoint_every = 1
keep_checkpoints = "all"
rollout_timeout_secs = 120.0
batch_timeout_secs = 300.0
engine_cache_mib = 32
[rollout]
max_turns = 2
max_new_tokens = 24
max_context_tokens = 4096
"#;

/// A tiny model, four toy tasks and the recipe, with the top-level keys
/// of `extra`, in `dir`.
fn setup(dir: &Path, extra: &str) -> PathBuf {
    ok(
        arcticd()
            .args(["init-model", "--preset", "tiny", "--out"])
            .arg(dir.join("tiny"))
            .output()
            .unwrap(),
        "init-model",
    );
    ok(
        arcticd()
            .args(["tasks", "toy", "--count", "4", "--seed", "3", "--out"])
            .arg(dir.join("toy"))
            .output()
            .unwrap(),
        "tasks toy",
    );
    let recipe = dir.join("r.toml");
    // Top-level keys: before the recipe's [rollout] table.
    std::fs::write(&recipe, format!("{extra}\n{RECIPE}")).unwrap();
    recipe
}

fn read_jsonl(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn steps_of(run: &Path) -> Vec<u64> {
    read_jsonl(&run.join("metrics.jsonl"))
        .iter()
        .map(|m| m["step"].as_u64().unwrap())
        .collect()
}

#[test]
fn trained_tokens_are_honest_about_their_weights() {
    // Held out (the training tasks themselves, for the test): before the
    // first update and after the last with 2 attempts each, at update 2
    // with 1.
    let extra = "probe_every = 1\nprobe_tokens = 12\neval_tasks = \"toy/tasks.jsonl\"\n";
    let sets = ["eval_every=2", "eval_attempts=1", "eval_end_attempts=2"];
    let Some((_dir, run, out)) = honest_run(extra, &sets) else {
        return;
    };
    let evals = read_jsonl(&run.join("eval.jsonl"));
    let at: Vec<(u64, u64)> = evals
        .iter()
        .map(|e| (e["step"].as_u64().unwrap(), e["attempts"].as_u64().unwrap()))
        .collect();
    assert_eq!(at, vec![(0, 2), (2, 1), (4, 2)], "{evals:?}");
    // A standard error from the attempts' sampling needs 2 of them.
    let se: Vec<bool> = evals.iter().map(|e| e["std_error"].is_f64()).collect();
    assert_eq!(se, vec![true, false, true], "{evals:?}");
    // The run reports the change from the first to the last, over the
    // tasks scored both times, with the paired standard error.
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    let h = &summary["held_out"];
    assert_eq!(
        (h["from_step"].as_u64(), h["to_step"].as_u64()),
        (Some(0), Some(4)),
        "{h}"
    );
    assert_eq!(h["tasks"].as_u64(), Some(4), "{h}");
    let scores = |e: &Value| -> Vec<f64> {
        e["per_task"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect()
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    assert_eq!(h["from"].as_f64(), Some(mean(&scores(&evals[0]))), "{h}");
    assert_eq!(h["to"].as_f64(), Some(mean(&scores(&evals[2]))), "{h}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("held-out pass@1") && stderr.contains("4 tasks x 2 attempts"),
        "{stderr}"
    );
    // The identity probe after every update: a live replica's tokens
    // scored by the trainer's forward on a frozen copy of the same weights.
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    // Every update logs the process's resident memory, and its peak never
    // falls (a long run's growing buffer shows as a rising line).
    let mut peak = 0.0;
    for m in &metrics {
        let (rss, p) = (m["rss_mib"].as_f64(), m["rss_peak_mib"].as_f64());
        let (Some(rss), Some(p)) = (rss, p) else {
            panic!("no resident memory logged: {m}");
        };
        assert!(rss > 1.0 && p >= rss && p >= peak, "{m}");
        peak = p;
    }
    let probed: Vec<&Value> = metrics
        .iter()
        .filter(|m| m["probe_tokens"].as_u64().is_some_and(|n| n > 0))
        .collect();
    assert!(!probed.is_empty(), "no probe reported: {metrics:?}");
    for m in probed {
        let mx = m["probe_mismatch_max"].as_f64().unwrap();
        assert!(mx <= 1e-6, "probe mismatch {mx}: {m}");
        assert!(m["probe_version"].as_u64().unwrap() >= 1, "{m}");
    }

    // `arcticd replay` of every update, from the checkpoint before it and
    // its recorded batch, is that update: the same loss and gradient norm
    // to the bit. With a recipe key changed it is another update.
    for m in &metrics {
        let step = m["step"].as_u64().unwrap();
        let replay = |sets: &[&str]| -> Value {
            let mut cmd = arcticd();
            cmd.args(["replay", "--run"])
                .arg(&run)
                .args(["--step", &step.to_string()]);
            for s in sets {
                cmd.args(["--set", s]);
            }
            serde_json::from_slice(&ok(cmd.output().unwrap(), "replay").stdout).unwrap()
        };
        let r = replay(&[]);
        assert_eq!(r["grad_norm"], m["grad_norm"], "update {step}: {r} vs {m}");
        assert_eq!(r["loss"], m["loss"], "update {step}: {r} vs {m}");
        let changed = replay(&["entropy_coef=0"]);
        assert_ne!(changed["loss"], m["loss"], "update {step}: {changed}");
    }
    // Chained from the first update's start, the recorded updates are the
    // run's, one JSON line each.
    let last = metrics.last().unwrap()["step"].as_u64().unwrap();
    let out = arcticd()
        .args(["replay", "--run"])
        .arg(&run)
        .args(["--step", "1", "--through", &last.to_string()])
        .output()
        .unwrap();
    let chain: Vec<Value> = String::from_utf8_lossy(&ok(out, "replay --through").stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let trained: Vec<&Value> = metrics
        .iter()
        .filter(|m| !m["grad_norm"].is_null())
        .collect();
    assert_eq!(chain.len(), trained.len());
    for (r, m) in chain.iter().zip(trained) {
        assert_eq!(r["step"], m["step"]);
        assert_eq!(r["grad_norm"], m["grad_norm"], "chained: {r} vs {m}");
    }
    // Past the run's last update: refused before any replay runs, naming
    // the updates there are.
    let out = arcticd()
        .args(["replay", "--run"])
        .arg(&run)
        .args(["--step", "1", "--through", &(last + 3).to_string()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && out.stdout.is_empty(), "{err}");
    assert!(
        err.contains(&format!("recorded no batch of update {}", last + 1))
            && err.contains(&format!("from 1 to {last}")),
        "{err}"
    );
    // A key the replay does not read (it made the recorded batch) is
    // refused, not taken and ignored.
    for set in ["rollout.max_turns=3", "tasks=other.jsonl"] {
        let out = arcticd()
            .args(["replay", "--run"])
            .arg(&run)
            .args(["--step", "1", "--set", set])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && err.contains("a replay does not read it"),
            "{set}: {err}"
        );
    }
    // --attribute names the parameters that carry the last update's
    // effect on the probes, largest first.
    let first = &read_jsonl(&run.join("trajectories/step-000001.jsonl"))[0];
    let ids: Vec<u64> = first["token_ids"].as_array().unwrap()[..40]
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let probes = run.join("probes.json");
    std::fs::write(&probes, serde_json::json!({"sequences": [ids]}).to_string()).unwrap();
    let out = arcticd()
        .args(["replay", "--run"])
        .arg(&run)
        .args(["--step", "1", "--attribute", "--probes"])
        .arg(&probes)
        .output()
        .unwrap();
    let r: Value = serde_json::from_slice(&ok(out, "replay --attribute").stdout).unwrap();
    let shifts: Vec<f64> = r["attribution"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| {
            assert!(
                a["parameter"].as_str().unwrap().starts_with("model."),
                "{a}"
            );
            a["probe_shift"].as_f64().unwrap().abs()
        })
        .collect();
    assert!(!shifts.is_empty() && shifts.len() <= 12, "{r}");
    assert!(shifts.windows(2).all(|w| w[0] >= w[1]), "{r}");
    // An update with no checkpoint before it is refused, naming those kept.
    std::fs::remove_dir_all(run.join("checkpoints/step-000002")).unwrap();
    let out = arcticd()
        .args(["replay", "--run"])
        .arg(&run)
        .args(["--step", "3"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no complete checkpoint of update 2"), "{err}");
}

/// Two data-parallel trainer ranks, each with its own weights and its own
/// replica: the ranks' checksums agree at every update, and the tokens
/// either replica generated re-score under rank 0's checkpoints to the
/// same bits' worth.
#[test]
fn two_ranks_keep_identical_weights_without_a_broadcast() {
    let Some((_dir, run, _)) = honest_run("ranks = 2\nreplicas = 2\nchecksum_every = 1\n", &[])
    else {
        return;
    };
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    let checked = metrics
        .iter()
        .filter(|m| m["weights_checksum"].is_string())
        .count();
    let trained = metrics
        .iter()
        .filter(|m| m["update_skipped"] == Value::Bool(false))
        .count();
    assert!(trained > 0);
    assert_eq!(checked, trained, "{metrics:?}");
    let tokens: Vec<u64> =
        serde_json::from_value(metrics.last().unwrap()["replica_tokens"].clone()).unwrap();
    println!("replica tokens {tokens:?}");
}

/// A run of the test recipe plus `extra` (top-level keys) and `--set`s,
/// its trained tokens re-scored under the checkpoint of the version that
/// generated them; the run directory and the train command's output.
/// None when the sandbox is not ready (skipped).
fn honest_run(extra: &str, sets: &[&str]) -> Option<(TempDir, PathBuf, Output)> {
    if !local_ready() {
        return None;
    }
    let dir = TempDir::new("train-loop").unwrap();
    let recipe = setup(dir.path(), extra);
    let run = dir.path().join("run");
    let out = ok(train(&recipe, &run, sets).output().unwrap(), "train");
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    assert_eq!(steps_of(&run), vec![1, 2, 3, 4]);
    let mut same_version_tokens = 0;
    for m in &metrics {
        let step = m["step"].as_u64().unwrap();
        assert_eq!(m["weight_version"].as_u64(), Some(step), "{m}");
        assert!(m["staleness_max"].as_u64().unwrap() <= 1, "{m}");
        if let Some(n) = m["mismatch_same_version_tokens"].as_u64() {
            same_version_tokens += n;
            if n > 0 {
                let mx = m["mismatch_same_version_max"].as_f64().unwrap();
                assert!(mx <= 1e-6, "same-version mismatch {mx} at step {step}");
            }
        }
    }
    assert!(
        same_version_tokens > 0,
        "no token was generated by the trainer's weights"
    );

    // Every trained token, grouped by the version that produced it, is
    // re-scored under that version's checkpoint.
    // Per version: (sequence, [(position, behaviour log-prob)]).
    type Scored = Vec<(Vec<u32>, Vec<(usize, f32)>)>;
    let mut by_version: BTreeMap<u64, Scored> = BTreeMap::new();
    let mut trained = 0;
    for step in 1..=4u64 {
        for t in read_jsonl(&run.join(format!("trajectories/step-{step:06}.jsonl"))) {
            trained += 1;
            let ids: Vec<u32> = serde_json::from_value(t["token_ids"].clone()).unwrap();
            let mask: Vec<u8> = serde_json::from_value(t["loss_mask"].clone()).unwrap();
            let lps: Vec<f32> = serde_json::from_value(t["logprobs"].clone()).unwrap();
            let vs: Vec<u64> = serde_json::from_value(t["weight_versions"].clone()).unwrap();
            let mut per: BTreeMap<u64, Vec<(usize, f32)>> = BTreeMap::new();
            for i in 0..ids.len() {
                if mask[i] == 1 {
                    // The trainer's version before this update was step - 1.
                    assert!(
                        step - 1 - vs[i] <= 1,
                        "token of version {} trained at step {step}",
                        vs[i]
                    );
                    per.entry(vs[i]).or_default().push((i, lps[i]));
                }
            }
            for (v, pos) in per {
                by_version.entry(v).or_default().push((ids.clone(), pos));
            }
        }
    }
    assert!(trained > 0);
    let mut checked = 0;
    let mut worst = 0f32;
    for (v, seqs) in &by_version {
        let model = if *v == 0 {
            dir.path().join("tiny")
        } else {
            run.join(format!("checkpoints/step-{v:06}"))
        };
        let input = dir.path().join(format!("score-{v}.json"));
        let sequences: Vec<&Vec<u32>> = seqs.iter().map(|(ids, _)| ids).collect();
        std::fs::write(
            &input,
            serde_json::json!({ "sequences": sequences }).to_string(),
        )
        .unwrap();
        let out = ok(
            arcticd()
                .args(["score", "--model"])
                .arg(&model)
                .arg("--input")
                .arg(&input)
                .output()
                .unwrap(),
            "score",
        );
        let scored: Value = serde_json::from_slice(&out.stdout).unwrap();
        for (k, (_, pos)) in seqs.iter().enumerate() {
            for &(i, behaviour) in pos {
                let lp = scored["logprobs"][k][i].as_f64().unwrap() as f32;
                worst = worst.max((lp - behaviour).abs());
                checked += 1;
            }
        }
    }
    println!(
        "{checked} trained tokens over {} versions, worst |score - behaviour| {worst:e}",
        by_version.len()
    );
    assert!(
        by_version.len() >= 2,
        "tokens of only one version were trained on"
    );
    assert!(
        worst <= 1e-5,
        "behaviour log-probs differ from the checkpoint's by {worst:e}"
    );
    Some((dir, run, out))
}

/// Runs until the fault point's marker appears, then SIGKILLs.
fn kill_at(recipe: &Path, run: &Path, point: &str, hit: u32, marks: &Path) {
    let mut child = train(recipe, run, &[])
        .env("ARCTICD_FAULT_PAUSE", point)
        .env("ARCTICD_FAULT_HIT", hit.to_string())
        .env("ARCTICD_FAULT_DIR", marks)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let marker = marks.join(format!("paused-{point}"));
    let t0 = Instant::now();
    while !marker.exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("{point}: the run ended ({status}) before reaching the fault point");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(180),
            "{point}: never reached"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    child.kill().unwrap(); // SIGKILL
    child.wait().unwrap();
}

#[test]
fn resume_after_sigkill_loses_no_update() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-resume").unwrap();
    let recipe = setup(dir.path(), "");
    for (point, hit) in [
        ("rollouts", 2),
        ("weight_update", 2),
        ("checkpoint_write", 2),
    ] {
        let run = dir.path().join(format!("run-{point}"));
        let marks = dir.path().join(format!("marks-{point}"));
        std::fs::create_dir_all(&marks).unwrap();
        kill_at(&recipe, &run, point, hit, &marks);
        let before = steps_of(&run);
        // Resume as a user would.
        ok(
            arcticd()
                .arg("train")
                .arg("--resume")
                .arg(&run)
                .output()
                .unwrap(),
            "resume",
        );
        let steps = steps_of(&run);
        assert_eq!(
            steps,
            vec![1, 2, 3, 4],
            "{point}: steps before the kill {before:?}"
        );
        let metrics = read_jsonl(&run.join("metrics.jsonl"));
        let versions: Vec<u64> = metrics
            .iter()
            .map(|m| m["weight_version"].as_u64().unwrap())
            .collect();
        assert_eq!(versions, vec![1, 2, 3, 4], "{point}");
        assert!(run.join("checkpoints/step-000004/run_state.json").is_file());
        let debris: Vec<_> = std::fs::read_dir(run.join("checkpoints"))
            .unwrap()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with('.'))
            .collect();
        assert!(debris.is_empty(), "{point}: partial checkpoints left");
        let lost: u64 = metrics
            .iter()
            .filter_map(|m| m["lost_on_resume"].as_u64())
            .sum();
        println!("{point}: steps before kill {before:?}, lost_on_resume {lost}");
        assert!(
            lost > 0,
            "{point}: rollouts in flight at the kill were not counted"
        );
    }
}

#[test]
fn dynamic_sampling_refills_up_to_its_cap_and_counts_the_refills() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-dynamic").unwrap();
    // A fresh tiny model solves nothing: every group has zero variance, so
    // every update consumes the cap (4 = B + 2 refills) and trains on
    // nothing. Admission must let the refills start.
    let recipe = setup(dir.path(), "");
    let run = dir.path().join("run");
    ok(
        train(
            &recipe,
            &run,
            &[
                "steps=3",
                "dynamic_sampling=true",
                "dynamic_max_groups=4",
                "checkpoint_every=0",
            ],
        )
        .output()
        .unwrap(),
        "train",
    );
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    assert_eq!(steps_of(&run), vec![1, 2, 3]);
    for m in &metrics {
        assert_eq!(m["groups"].as_u64(), Some(4), "{m}");
        assert_eq!(m["extra_groups"].as_u64(), Some(2), "{m}");
        assert_eq!(m["zero_variance_groups"].as_u64(), Some(4), "{m}");
    }
}

#[test]
fn bad_recipes_and_inputs_are_clear_errors() {
    let dir = TempDir::new("train-bad").unwrap();
    let cases = [
        ("stepz = 3\n", "stepz"),
        ("steps = \"many\"\n", "steps"),
        ("group_size = 1\n", "group_size"),
        ("model = \"nope\"\ntasks = \"nope.jsonl\"\n", "nope.jsonl"),
        ("tasks = \"t.jsonl\"\n", "no model"),
        ("device = \"tpu\"\n", "expected cpu, cuda or cuda:N"),
        // Without a CUDA build (or driver), before any input is read.
        (
            "model = \"m\"\ntasks = \"nope.jsonl\"\ndevice = \"cuda:0\"\n",
            "device = \"cuda:0\", rank 0",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let r = dir.path().join(format!("bad{i}.toml"));
        std::fs::write(&r, text).unwrap();
        let out = train(&r, &dir.path().join(format!("run{i}")), &[])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{text:?} was accepted");
        assert!(err.contains(needle), "{text:?}: {err}");
        assert!(!err.contains("panicked"), "{err}");
    }
    let out = resume(dir.path());
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a run directory"));
    let out = resume(&dir.path().join("no-such-run"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("no such run directory"));
    let out = arcticd()
        .args(["train", "--recipe", "/nonexistent/r.toml"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    // An --out that cannot take a new run is refused before anything is
    // built: here the demo, which would otherwise spend minutes on its
    // inputs first.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "keep").unwrap();
    let taken = dir.path().join("taken");
    std::fs::create_dir(&taken).unwrap();
    std::fs::write(taken.join("recipe.toml"), "steps = 1\n").unwrap();
    for (out_dir, needle) in [
        (&file, "is not a directory"),
        (&taken, "already holds a run"),
    ] {
        let out = arcticd()
            .args(["train", "--out"])
            .arg(out_dir)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{}", out_dir.display());
        assert!(err.contains(needle), "{err}");
        assert!(!err.contains("demo:"), "the demo was built first: {err}");
    }
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep");
    assert_eq!(
        std::fs::read_to_string(taken.join("recipe.toml")).unwrap(),
        "steps = 1\n"
    );
}

#[test]
fn a_run_that_solves_and_trains_nothing_stops_and_says_why() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-dead").unwrap();
    // A fresh tiny model solves nothing; with zero-variance groups left
    // out, no update trains: the weights are stuck, and after two such
    // updates the run ends, checkpointed, with a non-zero exit.
    let recipe = setup(dir.path(), "");
    let run = dir.path().join("run");
    let out = train(
        &recipe,
        &run,
        &[
            "steps=20",
            "filter_zero_variance=true",
            "stop_after_dead_updates=2",
            "checkpoint_every=0",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the run failed") && stderr.contains("stop_after_dead_updates = 2"),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(steps_of(&run), vec![1, 2]);
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary["stopped"].as_str().is_some(), "{summary}");
    assert!(run.join("checkpoints/step-000002/run_state.json").is_file());

    // A run shorter than the limit, every update of it dead, fails too (it
    // ended with exit 0, having trained nothing).
    let short = dir.path().join("short");
    let out = train(
        &recipe,
        &short,
        &[
            "steps=1",
            "filter_zero_variance=true",
            "stop_after_dead_updates=10",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the run failed: all 1 updates of this run solved nothing"),
        "{stderr}"
    );
    // Resumed with no update left, it fails again, saying why; it does not
    // finish as a success.
    let out = resume(&short);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the run failed at its last update, 1: all 1 updates")
            && stderr.contains("no update is left to resume"),
        "{stderr}"
    );
}

/// A resume reads the pool's records by position, so a task file whose
/// tasks were reordered (same count) is refused, not misapplied. With the
/// file put back, a resume after the run's recipe was edited (steps raised,
/// as the finished run says to, and a key removed) says what changed.
/// Runs of the test recipe that collapse on cue (`ARCTICD_FAULT_DEAD`
/// counts updates as dead whatever they did), rolling back after 2 dead
/// updates, with no stale rollouts, plus `sets`: `(run, output)`.
fn collapsing_run(
    dir: &Path,
    recipe: &Path,
    name: &str,
    dead: &str,
    sets: &[&str],
) -> (PathBuf, Output) {
    let run = dir.join(name);
    let mut all = vec!["max_staleness=0", "rollback_after_dead_updates=2"];
    all.extend(sets);
    let out = train(recipe, &run, &all)
        .env("ARCTICD_FAULT_DEAD", dead)
        .output()
        .unwrap();
    (run, out)
}

/// A [`collapsing_run`] that must fail, cleanly: its directory and stderr.
fn failed_run(
    dir: &Path,
    recipe: &Path,
    name: &str,
    dead: &str,
    sets: &[&str],
) -> (PathBuf, String) {
    let (run, out) = collapsing_run(dir, recipe, name, dead, sets);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    (run, stderr)
}

fn model_tensors(ck: &Path) -> Vec<arcticd_trainer::checkpoint::NamedTensor> {
    arcticd_trainer::checkpoint::read_safetensors_f32(&ck.join("model.safetensors")).unwrap()
}

/// `arcticd replay` of updates `from..=through` of `run`, in a chain: each
/// update's loss and gradient norm are the run's own, to the bit.
fn replays_to_the_bit(run: &Path, from: u64, through: u64) {
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    let chain = ok(
        arcticd()
            .args(["replay", "--run"])
            .arg(run)
            .args([
                "--step",
                &from.to_string(),
                "--through",
                &through.to_string(),
            ])
            .output()
            .unwrap(),
        "replay",
    );
    let chain: Vec<Value> = String::from_utf8_lossy(&chain.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(chain.len() as u64, through + 1 - from);
    for r in &chain {
        let m = &metrics[r["step"].as_u64().unwrap() as usize - 1];
        assert_eq!(r["loss"], m["loss"], "{r} vs {m}");
        assert_eq!(r["grad_norm"], m["grad_norm"], "{r} vs {m}");
    }
}

#[test]
fn a_collapsed_run_rolls_back_to_its_last_good_checkpoint_and_goes_on() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-rollback").unwrap();
    let recipe = setup(dir.path(), "warmup = 4");
    // Updates 5 and 6 dead: after the second, the run goes back to the
    // checkpoint of update 3 (older than the first dead update's sampling
    // weights), weights and optimizer, and trains on to the end.
    let (run, out) = collapsing_run(dir.path(), &recipe, "run", "5:2", &["steps=8"]);
    let out = ok(out, "train with a collapse");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("update 6: the last 2 updates solved nothing")
            && stderr.contains("rolling back to the checkpoint of update 3"),
        "{stderr}"
    );
    assert_eq!(steps_of(&run), (1..=8).collect::<Vec<u64>>());
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    let at = |s: u64| &metrics[s as usize - 1];
    assert_eq!(at(6)["rolled_back_to"].as_u64(), Some(3), "{}", at(6));
    assert!(metrics
        .iter()
        .filter(|m| m["step"] != 6)
        .all(|m| m["rolled_back_to"].is_null()));
    // A new version, above every one before; the learning rate of the
    // optimizer step count put back (warmup: it differs at every step).
    let v6 = at(6)["weight_version"].as_u64().unwrap();
    assert!(v6 > at(5)["weight_version"].as_u64().unwrap(), "{}", at(6));
    assert_eq!(at(6)["rollback_version"].as_u64(), Some(v6));
    assert_eq!(at(6)["lr"], at(3)["lr"]);
    assert_ne!(at(5)["lr"], at(3)["lr"]);
    // What update 6 wrote is update 3's weights; training went on from them.
    let ck = |s: u64| run.join(format!("checkpoints/step-{s:06}"));
    assert!(model_tensors(&ck(6)) == model_tensors(&ck(3)));
    assert!(model_tensors(&ck(7)) != model_tensors(&ck(3)));
    for m in &metrics[6..] {
        assert_eq!(m["update_skipped"], Value::Bool(false), "{m}");
        assert!(m["staleness_max"].as_u64().unwrap() == 0, "{m}");
    }
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        summary["totals"]["rollbacks"].as_u64(),
        Some(1),
        "{summary}"
    );
    assert!(summary["stopped"].is_null(), "{summary}");
    // The replay chain across the rollback restores the same checkpoint:
    // every update replays to the bit.
    replays_to_the_bit(&run, 2, 8);

    // A collapse that does not end: each rollback goes further back (3,
    // then 2), then, past max_rollbacks, the run stops at
    // stop_after_dead_updates and says why.
    let (run, stderr) = failed_run(
        dir.path(),
        &recipe,
        "stuck",
        "5:100",
        &["steps=20", "max_rollbacks=2", "stop_after_dead_updates=3"],
    );
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    let rolled: Vec<(u64, u64)> = metrics
        .iter()
        .filter_map(|m| Some((m["step"].as_u64()?, m["rolled_back_to"].as_u64()?)))
        .collect();
    assert_eq!(rolled, vec![(6, 3), (8, 2)], "{stderr}");
    assert_eq!(steps_of(&run).last(), Some(&11), "{stderr}");
    assert!(stderr.contains("stop_after_dead_updates = 3"), "{stderr}");

    // A run resumed in the middle of a collapse remembers it: two dead
    // updates before the stop, one after the resume, then the rollback.
    let (run, out) = collapsing_run(
        dir.path(),
        &recipe,
        "resumed",
        "5:100",
        &["steps=6", "rollback_after_dead_updates=3"],
    );
    ok(out, "the run up to the resume");
    let recipe_path = run.join("recipe.toml");
    let text = std::fs::read_to_string(&recipe_path).unwrap();
    assert!(text.contains("\nsteps = 6\n"), "{text}");
    std::fs::write(&recipe_path, text.replace("\nsteps = 6\n", "\nsteps = 8\n")).unwrap();
    let out = arcticd()
        .args(["train", "--resume"])
        .arg(&run)
        .env("ARCTICD_FAULT_DEAD", "5:100")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("update 7: the last 3 updates solved nothing")
            && stderr.contains("rolling back to the checkpoint of update 3"),
        "{stderr}"
    );
    assert!(out.status.success(), "{stderr}");

    // A collapse before any checkpoint is old enough: back to the model
    // the run started from, with a fresh optimizer (update 5 steps at
    // update 1's learning rate), and on to the end; the replay chain from
    // update 1 follows it there.
    let (run, out) = collapsing_run(
        dir.path(),
        &recipe,
        "early",
        "3:2",
        &["steps=6", "checkpoint_every=4"],
    );
    let out = ok(out, "train with an early collapse");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("rolling back to the model the run started from"),
        "{stderr}"
    );
    let metrics = read_jsonl(&run.join("metrics.jsonl"));
    let at = |s: u64| &metrics[s as usize - 1];
    assert_eq!(at(4)["rolled_back_to"].as_u64(), Some(0), "{}", at(4));
    assert_eq!(at(5)["lr"], at(1)["lr"]);
    assert_ne!(at(2)["lr"], at(1)["lr"]);
    assert!(
        model_tensors(&run.join("checkpoints/step-000004"))
            == model_tensors(&dir.path().join("tiny"))
    );
    replays_to_the_bit(&run, 1, 6);

    // A run that ends in a collapse no rollback undid (none allowed here)
    // failed, whatever the stop limit, and says where to go back to.
    let (run, stderr) = failed_run(
        dir.path(),
        &recipe,
        "ended",
        "5:100",
        &["steps=8", "max_rollbacks=0"],
    );
    assert!(
        stderr.contains("the run ended collapsed: its last 4 updates solved nothing")
            && stderr.contains("the newest healthy point before it is the checkpoint of update 3"),
        "{stderr}"
    );
    assert_eq!(steps_of(&run).last(), Some(&8), "{stderr}");

    // A run that never lived has nothing to go back to: it stops.
    let (run, stderr) = failed_run(
        dir.path(),
        &recipe,
        "never",
        "1:100",
        &["steps=20", "stop_after_dead_updates=3"],
    );
    assert!(
        stderr.contains("no checkpoint (nor the model the run started from) is old enough"),
        "{stderr}"
    );
    assert_eq!(steps_of(&run), vec![1, 2, 3]);
}

#[test]
fn resume_refuses_a_reordered_task_file_and_names_recipe_edits() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-reorder").unwrap();
    let recipe = setup(dir.path(), "");
    let run = dir.path().join("run");
    ok(
        train(&recipe, &run, &["steps=1"]).output().unwrap(),
        "train",
    );
    let tasks = dir.path().join("toy/tasks.jsonl");
    let text = std::fs::read_to_string(&tasks).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines.reverse();
    std::fs::write(&tasks, lines.join("\n") + "\n").unwrap();
    let out = resume(&run);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("the task file changed since the run started: 4 of 4 tasks"),
        "{stderr}"
    );
    std::fs::write(&tasks, &text).unwrap();
    let saved = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
    let edited: String = saved
        .lines()
        .filter(|l| !l.starts_with("entropy_coef ="))
        .map(|l| match l.starts_with("steps =") {
            true => "steps = 2\n".to_string(),
            false => format!("{l}\n"),
        })
        .collect();
    std::fs::write(run.join("recipe.toml"), edited).unwrap();
    let out = ok(resume(&run), "resume");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("differs from the one step 1 was made with")
            && stderr.contains("steps: 1 -> 2")
            && stderr.contains("entropy_coef: 0.05 -> 0.0"),
        "{stderr}"
    );
    assert_eq!(steps_of(&run), vec![1, 2]);
    // A checkpoint whose copy of the recipe no longer parses still
    // resumes: only the comparison is lost, and that is said.
    std::fs::write(
        run.join("checkpoints/step-000002/recipe.toml"),
        "steps = [unclosed\n",
    )
    .unwrap();
    let recipe_now = std::fs::read_to_string(run.join("recipe.toml")).unwrap();
    std::fs::write(
        run.join("recipe.toml"),
        recipe_now.replace("steps = 2\n", "steps = 3\n"),
    )
    .unwrap();
    let out = ok(resume(&run), "resume past a corrupt recipe copy");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("cannot say whether the recipe changed since step 2"),
        "{stderr}"
    );
    assert_eq!(steps_of(&run), vec![1, 2, 3]);
}

/// A run whose every task retires ends with a checkpoint of its last
/// update and says why (it ended with neither).
#[test]
fn a_run_whose_tasks_all_retire_checkpoints_and_says_why() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-retired").unwrap();
    // A fresh tiny model solves nothing: each task retires as hopeless
    // after its first visit.
    let recipe = setup(dir.path(), "");
    let run = dir.path().join("run");
    let out = train(
        &recipe,
        &run,
        &[
            "steps=50",
            "drop_after=1",
            "stop_after_dead_updates=0",
            "checkpoint_every=0",
        ],
    )
    .output()
    .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(stderr.contains("every task is retired"), "{stderr}");
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(summary["stopped"].as_str().is_some(), "{summary}");
    let last = *steps_of(&run).last().unwrap();
    assert!(last < 50, "{last}");
    assert!(
        run.join(format!("checkpoints/step-{last:06}/run_state.json"))
            .is_file(),
        "no checkpoint of the last update {last}"
    );
}

/// Starts a long run (no periodic checkpoint) with its sandboxes under
/// `local`, and waits for its first update.
fn start_long_run(
    dir: &Path,
    local: &Path,
    env: &[(&str, &Path)],
) -> (std::process::Child, PathBuf) {
    let recipe = setup(dir, "");
    let run = dir.join("run");
    std::fs::create_dir_all(local).unwrap();
    let mut cmd = train(&recipe, &run, &["steps=1000", "checkpoint_every=0"]);
    cmd.env("ARCTICD_LOCAL_DIR", local)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let t0 = Instant::now();
    while steps_of(&run).is_empty() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended ({status}) before its first update");
        }
        assert!(t0.elapsed() < Duration::from_secs(180), "no update came");
        std::thread::sleep(Duration::from_millis(100));
    }
    (child, run)
}

fn signal(child: &std::process::Child, sig: &str) {
    assert!(Command::new("kill")
        .args([sig, &child.id().to_string()])
        .status()
        .unwrap()
        .success());
}

/// Ctrl-C and SIGTERM (what `kill`, `docker stop` and schedulers send)
/// alike: said at once, the update under way ends, a checkpoint of it is
/// written, the sandboxes are gone, and the status is the signal's (130,
/// 143), not a finished run's 0.
#[test]
fn ctrl_c_or_sigterm_checkpoints_and_leaves_no_sandbox() {
    if !local_ready() {
        return;
    }
    for (sig, status) in [("-INT", 130), ("-TERM", 143)] {
        let dir = TempDir::new("train-signal").unwrap();
        let local = dir.path().join("local-sandboxes");
        let (child, run) = start_long_run(dir.path(), &local, &[]);
        signal(&child, sig);
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        // Not a finished run: the shell's status for the signal.
        assert_eq!(out.status.code(), Some(status), "{sig}: {err}");
        assert!(err.contains("then checkpoint and stop"), "{sig}: {err}");
        let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(summary["cancelled"], Value::Bool(true), "{sig}: {summary}");
        let last = *steps_of(&run).last().unwrap();
        assert_eq!(summary["steps"].as_u64(), Some(last));
        assert!(
            run.join(format!("checkpoints/step-{last:06}/run_state.json"))
                .is_file(),
            "{sig}: no checkpoint of the last update {last}"
        );
        let left: Vec<String> = std::fs::read_dir(&local)
            .unwrap()
            .flatten()
            .map(|e| e.file_name().to_string_lossy().to_string())
            .filter(|n| n.starts_with("arcticd-"))
            .collect();
        assert!(left.is_empty(), "{sig}: sandboxes left behind: {left:?}");
    }
}

/// A second signal while the orderly stop is under way (held here at the
/// checkpoint's write) ends the process at once, status 130, instead of
/// being swallowed.
#[test]
fn a_second_signal_stops_at_once() {
    if !local_ready() {
        return;
    }
    let dir = TempDir::new("train-signal-twice").unwrap();
    let local = dir.path().join("local-sandboxes");
    let marks = dir.path().join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    let (mut child, _run) = start_long_run(
        dir.path(),
        &local,
        &[
            ("ARCTICD_FAULT_PAUSE", Path::new("checkpoint_write")),
            ("ARCTICD_FAULT_DIR", &marks),
        ],
    );
    signal(&child, "-INT");
    let t0 = Instant::now();
    while !marks.join("paused-checkpoint_write").exists() {
        if let Ok(Some(status)) = child.try_wait() {
            panic!("the run ended ({status}) before its checkpoint");
        }
        assert!(
            t0.elapsed() < Duration::from_secs(120),
            "no checkpoint began"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    signal(&child, "-INT");
    let t0 = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if t0.elapsed() > Duration::from_secs(30) {
            child.kill().unwrap();
            panic!("the second signal was swallowed: still running after 30 s");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(status.code(), Some(130), "{status}");
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("SIGINT again: stopped at once"), "{err}");
}
