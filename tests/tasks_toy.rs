//! The toy pool through validation and the wrong-patch audit on the real
//! sandbox: generated tasks are valid on both backends, broken tasks get the
//! right invalid reason, and the audit flags exactly the deliberately loose
//! tasks (precision and recall 1 on the pool), keeping evidence. Also the
//! `arcticd tasks` command line: `toy` output and schema errors that name
//! the record and field.
//!
//! A backend that is unavailable fails the test when `CI` is set and is
//! skipped loudly otherwise.

use anyhow::{ensure, Result};
use arcticd_sandbox::docker::DockerBackend;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::{audit, toy, validate, Task};
use arcticd_sandbox::{Backend, Policy};
use std::process::Command;

mod common;
use common::{base_image, skip, TempDir};

/// Whether the backend can run here (builds the base image first; call
/// outside any runtime), reporting when not.
fn usable(docker: bool) -> bool {
    let name = if docker { "docker" } else { "local" };
    match base_image() {
        Err(e) => {
            skip(name, &e);
            false
        }
        Ok(false) if docker => {
            skip(name, "cannot connect to the Docker daemon");
            false
        }
        Ok(_) => true,
    }
}

/// The backend, or None (after reporting) when it is unavailable.
async fn backend(docker: bool) -> Option<Box<dyn Backend>> {
    let name = if docker { "docker" } else { "local" };
    let b: Result<Box<dyn Backend>, _> = if docker {
        DockerBackend::new()
            .await
            .map(|b| Box::new(b) as Box<dyn Backend>)
    } else {
        LocalBackend::new()
            .await
            .map(|b| Box::new(b) as Box<dyn Backend>)
    };
    match b {
        Ok(b) => Some(b),
        Err(e) => {
            skip(name, &e.to_string());
            None
        }
    }
}

fn pool(tag: &str, count: usize, loose_share: f64) -> Result<(TempDir, Vec<Task>)> {
    let dir = TempDir::new(tag)?;
    let cfg = toy::ToyConfig {
        count,
        seed: 5,
        loose_share,
        ..Default::default()
    };
    let tasks = toy::generate(&cfg, &dir.0)?;
    Ok((dir, tasks))
}

fn cfg() -> validate::ValidateConfig {
    validate::ValidateConfig {
        test_timeout_secs: 120.0,
        ..Default::default()
    }
}

fn validates_on(docker: bool) -> Result<()> {
    if !usable(docker) {
        return Ok(());
    }
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let Some(b) = backend(docker).await else {
            return Ok(());
        };
        // Three tasks on Docker (slower starts), six locally.
        let (_dir, tasks) = pool(
            if docker { "vd" } else { "vl" },
            if docker { 3 } else { 6 },
            0.34,
        )?;
        let verdicts =
            validate::validate_tasks(b.as_ref(), &tasks, &Policy::default(), &cfg()).await;
        for v in &verdicts {
            ensure!(v.is_valid(), "{v:?}");
        }
        Ok(())
    })
}

#[test]
fn toy_pool_is_valid_on_docker() -> Result<()> {
    validates_on(true)
}

#[test]
fn toy_pool_is_valid_locally() -> Result<()> {
    validates_on(false)
}

#[test]
fn broken_tasks_are_invalid_with_the_right_reason() -> Result<()> {
    if !usable(false) {
        return Ok(());
    }
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let Some(b) = backend(false).await else {
            return Ok(());
        };
        let (_dir, tasks) = pool("bad", 1, 0.0)?;
        let good = &tasks[0];
        let mut no_gold = good.clone();
        no_gold.patch = String::new();
        let mut p2p_as_f2p = good.clone();
        p2p_as_f2p.fail_to_pass.push(good.pass_to_pass[0].clone());
        let mut no_tests = good.clone();
        no_tests.test_cmd = "echo nothing to see".into();
        let mut bad_gold = good.clone();
        // A patch whose removed line is not in the file.
        let old_line = good.meta["toy"]["solution"]["old_str"].as_str().unwrap_or_default();
        bad_gold.patch = good
            .patch
            .replace(&format!("\n-{old_line}\n"), "\n-    nothing_like_this()\n");
        ensure!(bad_gold.patch != good.patch);
        let mut flaky = good.clone();
        // A coin-flip test written next to the others before they run.
        flaky.test_cmd = format!(
            "printf 'import random\\n\\ndef test_coin():\\n    assert random.random() < 0.5\\n' > tests/test_flaky.py && {}",
            good.test_cmd
        );
        flaky.repo = good.repo.clone();
        let cases = [
            (no_gold, "gold_fails"),
            (p2p_as_f2p, "f2p_passes_before"),
            (no_tests, "no_tests_parsed"),
            (bad_gold, "gold_patch_does_not_apply"),
        ];
        for (task, reason) in &cases {
            let v = validate::validate_task(b.as_ref(), task, &Policy::default(), &cfg()).await;
            ensure!(v.reason.as_deref() == Some(*reason), "{reason}: {v:?}");
        }
        // Six runs of a coin flip all agree with probability 1/16; four
        // tries make a false failure a 1-in-65536 event.
        let mut seen = false;
        for _ in 0..4 {
            let mut c = cfg();
            c.repeats = 3;
            let v = validate::validate_task(b.as_ref(), &flaky, &Policy::default(), &c).await;
            if v.reason.as_deref() == Some("flaky") {
                seen = true;
                break;
            }
        }
        ensure!(seen, "a coin-flip test was never reported flaky");
        Ok(())
    })
}

#[test]
fn audit_flags_exactly_the_loose_toy_tasks() -> Result<()> {
    if !usable(false) {
        return Ok(());
    }
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let Some(b) = backend(false).await else {
            return Ok(());
        };
        let (_dir, tasks) = pool("audit", 6, 0.34)?;
        ensure!(tasks.iter().filter(|t| t.toy_loose() == Some(true)).count() == 2);
        let cfg = audit::AuditConfig {
            validate: cfg(),
            validate_first: false,
            max_variants: 24,
        };
        let report = audit::audit_tasks(b.as_ref(), &tasks, &Policy::default(), &cfg).await;
        ensure!(
            report.precision == Some(1.0) && report.recall == Some(1.0),
            "{report:#?}"
        );
        ensure!(report.loose == 2 && report.tight == 4 && report.invalid == 0);
        for r in &report.results {
            ensure!(r.infra_errors == 0, "{r:?}");
            if r.verdict == "loose" {
                let evidence = r
                    .accepted
                    .as_ref()
                    .map(|v| v.patch.clone())
                    .unwrap_or_default();
                ensure!(evidence.contains("+    return "), "{r:?}");
            } else {
                ensure!(r.tried >= 5, "too few wrong patches tried: {r:?}");
            }
        }
        Ok(())
    })
}

fn arcticd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(args)
        .output()
        .expect("running arcticd")
}

#[test]
fn tasks_command_line() -> Result<()> {
    let dir = TempDir::new("cli")?;
    let out = dir.0.join("pool");
    let o = out.display().to_string();
    let r = arcticd(&[
        "tasks",
        "toy",
        "--count",
        "4",
        "--seed",
        "2",
        "--loose-share",
        "0.5",
        "--out",
        &o,
    ]);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout)?;
    ensure!(v["tasks"] == 4 && v["loose"] == 2, "{v}");
    let file = out.join("tasks.jsonl");
    let tasks = arcticd_sandbox::tasks::load_tasks(&file, arcticd_sandbox::tasks::Format::Auto)?;
    ensure!(
        tasks.len() == 4
            && tasks
                .iter()
                .all(|t| t.repo.as_ref().is_some_and(|r| r.is_dir()))
    );

    // A schema error names the file, line, record and field.
    let bad = dir.0.join("bad.jsonl");
    let text = std::fs::read_to_string(&file)?;
    let first = text
        .lines()
        .next()
        .unwrap_or_default()
        .replace("\"FAIL_TO_PASS\":[", "\"FAIL_TO_PASS\":[3,");
    std::fs::write(&bad, format!("{first}\n"))?;
    let r = arcticd(&[
        "tasks",
        "validate",
        "--tasks",
        &bad.display().to_string(),
        "--backend",
        "local",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    ensure!(!r.status.success(), "accepted a bad record");
    ensure!(
        err.contains("bad.jsonl:1") && err.contains("toy-0000") && err.contains("`FAIL_TO_PASS`"),
        "{err}"
    );

    // `tasks select` keeps the tasks an eval solved: here the second task
    // solved on its retry (the last record of an attempt counts, as in
    // eval's resume), the first never (its retry's success is masked), and
    // the fourth task was never attempted.
    let ids: Vec<&str> = tasks.iter().map(|t| t.instance_id.as_str()).collect();
    let eval = dir.0.join("eval.jsonl");
    let rec = |id: &str, reward: f64, masked: bool| {
        let termination = if masked { "infra" } else { "submitted" };
        serde_json::json!({"task_id": id, "attempt": 0, "reward": reward,
                           "termination": termination, "masked": masked})
        .to_string()
    };
    std::fs::write(
        &eval,
        [
            rec(ids[0], 0.0, false),
            rec(ids[0], 1.0, true),
            rec(ids[1], 0.0, false),
            rec(ids[1], 1.0, false),
            rec(ids[2], 1.0, false),
        ]
        .join("\n"),
    )?;
    let picked = dir.0.join("sel/picked.jsonl");
    let select = |min: &str| {
        arcticd(&[
            "tasks",
            "select",
            "--tasks",
            &file.display().to_string(),
            "--eval",
            &eval.display().to_string(),
            "--min-solved",
            min,
            "--out",
            &picked.display().to_string(),
        ])
    };
    let r = select("1");
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let v: serde_json::Value = serde_json::from_slice(&r.stdout)?;
    ensure!(v["kept"] == 2 && v["attempted"] == 3, "{v}");
    let kept = arcticd_sandbox::tasks::load_tasks(&picked, arcticd_sandbox::tasks::Format::Auto)?;
    ensure!(kept
        .iter()
        .map(|t| t.instance_id.as_str())
        .eq([ids[1], ids[2]]));
    ensure!(kept
        .iter()
        .all(|t| t.repo.as_ref().is_some_and(|r| r.is_dir())));
    let r = select("2");
    ensure!(!r.status.success() && String::from_utf8_lossy(&r.stderr).contains("nothing written"));
    // An earlier selection is replaced.
    let r = select("1");
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    // --out naming an input (the task file, the records) or an existing
    // file that is not tasks is refused, and the file is left as it was;
    // a missing records file is named.
    let before = std::fs::read(&file)?;
    let notes = dir.0.join("notes.txt");
    std::fs::write(&notes, "not tasks\n")?;
    for (out, eval_file, says) in [
        (&file, &eval, "is the file given to --tasks"),
        (&eval, &eval, "is the file given to --eval"),
        (
            &picked,
            &dir.0.join("no-such.jsonl"),
            "no-such.jsonl: no such file",
        ),
        (&notes, &eval, "exists and is not a task file"),
    ] {
        let r = arcticd(&[
            "tasks",
            "select",
            "--tasks",
            &file.display().to_string(),
            "--eval",
            &eval_file.display().to_string(),
            "--out",
            &out.display().to_string(),
        ]);
        let err = String::from_utf8_lossy(&r.stderr);
        ensure!(!r.status.success() && err.contains(says), "{says}: {err}");
    }
    ensure!(std::fs::read(&file)? == before, "the task file changed");
    ensure!(std::fs::read_to_string(&notes)? == "not tasks\n");
    Ok(())
}

#[test]
fn audit_takes_agent_written_wrong_patches() -> Result<()> {
    if !usable(false) {
        return Ok(());
    }
    let (dir, tasks) = pool("agent", 1, 0.0)?;
    let model = dir.0.join("model");
    let r = arcticd(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        &model.display().to_string(),
    ]);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let t = &tasks[0];
    let s = &t.meta["toy"]["solution"];
    let (path, old, new) = (
        s["path"].as_str().unwrap_or_default(),
        s["old_str"].as_str().unwrap_or_default(),
        s["new_str"].as_str().unwrap_or_default(),
    );
    // The "agent" (scripted) submits a patch other than the gold one that
    // passes the tests: the audit must take it as evidence.
    let call = arcticd_trainer::harness::format::render_call(
        "str_replace_based_edit_tool",
        &[
            ("command", "str_replace"),
            ("path", path),
            ("old_str", old),
            ("new_str", &format!("{new}  # special-cased")),
        ],
    );
    let submit = arcticd_trainer::harness::format::render_call("submit", &[]);
    let script = dir.0.join("agent.json");
    std::fs::write(
        &script,
        serde_json::json!({ t.instance_id.clone(): [call, submit] }).to_string(),
    )?;
    let file = dir.0.join("tasks.jsonl").display().to_string();
    let report = dir.0.join("report.json");
    let base = [
        "tasks",
        "audit",
        "--tasks",
        &file,
        "--backend",
        "local",
        "--no-validate",
        "--max-variants",
        "0",
    ];
    // No wrong patch tried (no variant, no agent): nothing shows the task
    // tight, so it is undecided, and left out of a curated set.
    let r = arcticd(&base);
    let err = String::from_utf8_lossy(&r.stderr);
    ensure!(r.status.success(), "{err}");
    let v: serde_json::Value = serde_json::from_slice(&r.stdout)?;
    ensure!(
        v["undecided"] == 1 && v["tight"] == 0 && v["results"][0]["tried"] == 0,
        "{v}"
    );
    ensure!(err.contains("none was tried"), "{err}");
    // The curated set may not be written over the task file it reads.
    let mut over: Vec<&str> = base.to_vec();
    over.extend(["--out", &file]);
    let r = arcticd(&over);
    let err = String::from_utf8_lossy(&r.stderr);
    ensure!(
        !r.status.success() && err.contains("is the file given to --tasks"),
        "{err}"
    );
    // Nor into a folder that is not there: said before the audit runs (it
    // ran to the end, then lost every verdict).
    for flag in ["--out", "--report"] {
        let mut lost: Vec<&str> = base.to_vec();
        let nowhere = format!("{file}.d/none/x.json");
        lost.extend([flag, &nowhere]);
        let r = arcticd(&lost);
        let err = String::from_utf8_lossy(&r.stderr);
        ensure!(
            !r.status.success() && err.contains("does not exist") && r.stdout.is_empty(),
            "{err}"
        );
        ensure!(
            !err.contains("none was tried"),
            "the audit ran first: {err}"
        );
    }
    let mut args: Vec<String> = base.iter().map(|s| s.to_string()).collect();
    for x in [
        "--agent-script",
        &script.display().to_string(),
        "--tokenizer",
        &model.display().to_string(),
        "--report",
        &report.display().to_string(),
    ] {
        args.push(x.to_string());
    }
    let argv: Vec<&str> = args.iter().map(String::as_str).collect();
    let r = arcticd(&argv);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let full: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
    let res = &full["results"][0];
    ensure!(
        res["verdict"] == "loose" && res["accepted"]["name"] == "agent_0",
        "{full}"
    );
    ensure!(res["accepted"]["patch"]
        .as_str()
        .unwrap_or_default()
        .contains("special-cased"));
    Ok(())
}
