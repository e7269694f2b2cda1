//! `arcticd tasks audit --strengthen` on a toy pool of deliberately loose
//! tasks, with a scripted agent writing the tests, on the local backend:
//! a test that the gold patch passes and the accepted wrong patch fails
//! makes its task tight (in the curated output, the new test in
//! FAIL_TO_PASS, and a plain audit of the curated set finds it tight); a
//! "test" the wrong patch passes too, or a diff that touches source files,
//! is rejected with its reason and the task stays loose and out of the
//! curated set. Without an agent, `--strengthen` is a clear error. When
//! new tests reject the wrong patch but a fresh audit finds another one
//! they still accept, the next attempt targets that one, from the
//! strengthened task, until the task is tight.
//!
//! A backend that is unavailable fails the test when `CI` is set and is
//! skipped loudly otherwise.

mod common;
use anyhow::{ensure, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::local::LocalBackend;
use arcticd_sandbox::tasks::audit::{audit_task, AuditConfig};
use arcticd_sandbox::tasks::validate::ValidateConfig;
use arcticd_sandbox::tasks::{load_tasks, toy, Format, Task};
use arcticd_trainer::harness::format::render_call;
use arcticd_trainer::harness::policy::Policy as ModelPolicy;
use arcticd_trainer::harness::strengthen::{strengthen_task, STRENGTHEN_INSTRUCTION};
use arcticd_trainer::harness::wrong_patch::AuditAgent;
use arcticd_trainer::harness::{Harness, RolloutConfig, ScriptedPolicy};
use common::{base_image, skip, TempDir};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Whether the local backend's image exists (built here when it can be),
/// reporting when not.
fn usable() -> bool {
    match base_image() {
        Ok(_) => true,
        Err(e) => {
            skip("local", &e);
            false
        }
    }
}

fn arcticd(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(args)
        .output()
        .expect("running arcticd")
}

/// (package, function) of a toy task, from its solution path and its
/// first fail-to-pass id (`tests/test_F.py::test_F_0`).
fn names(t: &Task) -> Result<(String, String)> {
    let path = t.meta["toy"]["solution"]["path"]
        .as_str()
        .context("no solution path")?;
    let pkg = path.trim_end_matches("/core.py").to_string();
    let f = t.fail_to_pass[0]
        .split("::test_")
        .nth(1)
        .and_then(|s| s.rsplit_once('_'))
        .map(|(f, _)| f.to_string())
        .context("unexpected test id")?;
    Ok((pkg, f))
}

/// The loose hidden test's one assertion, as written in the test patch.
fn loose_assertion(t: &Task) -> Result<String> {
    t.test_patch
        .lines()
        .find_map(|l| l.strip_prefix("+    assert "))
        .map(str::to_string)
        .context("no assertion in the test patch")
}

/// Turns that write `tests/test_extra.py` with `body` and submit.
fn writes_test(pkg: &str, f: &str, body: &str) -> Vec<String> {
    writes_test_to("tests/test_extra.py", pkg, f, body)
}

/// Turns that write test `test_F_strong` with `body` to `path` and submit.
fn writes_test_to(path: &str, pkg: &str, f: &str, body: &str) -> Vec<String> {
    let text = format!("from {pkg}.core import {f}\n\n\ndef test_{f}_strong():\n{body}");
    vec![
        render_call(
            "str_replace_based_edit_tool",
            &[("command", "create"), ("path", path), ("file_text", &text)],
        ),
        render_call("submit", &[]),
    ]
}

fn init_model(dir: &Path) -> Result<PathBuf> {
    let model = dir.join("model");
    let m = arcticd(&[
        "init-model",
        "--preset",
        "tiny",
        "--out",
        &model.display().to_string(),
    ]);
    ensure!(m.status.success(), "{}", String::from_utf8_lossy(&m.stderr));
    Ok(model)
}

#[test]
fn strengthen_makes_loose_tasks_tight_only_with_real_tests() -> Result<()> {
    if !usable() {
        return Ok(());
    }
    let dir = TempDir::new("pool")?;
    // Seed 0: the families are wrong_operator, off_by_one, wrong_constant
    // in order, every task loose.
    let cfg = toy::ToyConfig {
        count: 3,
        seed: 0,
        loose_share: 1.0,
        ..Default::default()
    };
    let tasks = toy::generate(&cfg, &dir.0.join("pool"))?;
    ensure!(tasks.iter().all(|t| t.toy_loose() == Some(true)));
    ensure!(tasks[0].instance_id.ends_with("wrong_operator"));

    // Task 0: a strong test (buggy a - b and every constant fail it).
    let (pkg0, f0) = names(&tasks[0])?;
    let strong = writes_test(&pkg0, &f0, &format!("    assert {f0}(3, 4) == 7\n"));
    // Task 1: the loose assertion again under a new name; the wrong patch
    // passes it too.
    let (pkg1, f1) = names(&tasks[1])?;
    let weak = writes_test(
        &pkg1,
        &f1,
        &format!("    assert {}\n", loose_assertion(&tasks[1])?),
    );
    // Task 2: a test plus the fix itself in the source file.
    let (pkg2, f2) = names(&tasks[2])?;
    let s = &tasks[2].meta["toy"]["solution"];
    let mut with_source = vec![render_call(
        "str_replace_based_edit_tool",
        &[
            ("command", "str_replace"),
            ("path", s["path"].as_str().unwrap_or_default()),
            ("old_str", s["old_str"].as_str().unwrap_or_default()),
            ("new_str", s["new_str"].as_str().unwrap_or_default()),
        ],
    )];
    with_source.extend(writes_test(
        &pkg2,
        &f2,
        &format!("    assert {}\n", loose_assertion(&tasks[2])?),
    ));
    let key = |t: &Task| format!("strengthen/{}", t.instance_id);
    let script = dir.0.join("agent.json");
    std::fs::write(
        &script,
        serde_json::json!({
            key(&tasks[0]): strong,
            key(&tasks[1]): weak,
            key(&tasks[2]): with_source,
        })
        .to_string(),
    )?;
    let model = init_model(&dir.0)?;

    let file = dir.0.join("pool/tasks.jsonl").display().to_string();
    let curated = dir.0.join("curated.jsonl");
    let report = dir.0.join("report.json");

    // Without an agent, --strengthen says what it needs.
    let r = arcticd(&[
        "tasks",
        "audit",
        "--tasks",
        &file,
        "--backend",
        "local",
        "--strengthen",
    ]);
    let err = String::from_utf8_lossy(&r.stderr);
    ensure!(
        !r.status.success() && err.contains("--strengthen needs an agent"),
        "{err}"
    );

    let r = arcticd(&[
        "tasks",
        "audit",
        "--tasks",
        &file,
        "--backend",
        "local",
        "--repeats",
        "1",
        "--strengthen",
        "--agent-script",
        &script.display().to_string(),
        "--tokenizer",
        &model.display().to_string(),
        "--out",
        &curated.display().to_string(),
        "--report",
        &report.display().to_string(),
    ]);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let summary: Value = serde_json::from_slice(&r.stdout)?;
    let full: Value = serde_json::from_str(&std::fs::read_to_string(&report)?)?;
    ensure!(
        summary["strengthened"] == 1 && summary["loose"] == 2 && summary["recall"] == 1.0,
        "{summary}\n{full:#}"
    );
    let res = &full["results"];
    let new_test = format!("tests/test_extra.py::test_{f0}_strong");

    // Task 0: strengthened, the new test fails before the gold patch.
    let s0 = &res[0]["strengthening"];
    ensure!(
        res[0]["verdict"] == "strengthened" && s0["status"] == "strengthened",
        "{:#}",
        res[0]
    );
    ensure!(
        s0["new_fail_to_pass"] == serde_json::json!([new_test]),
        "{s0:#}"
    );
    ensure!(
        s0["attempts"][0]["check"]["outcome"] == "accepted",
        "{s0:#}"
    );
    ensure!(s0["test_patch"]
        .as_str()
        .unwrap_or_default()
        .contains("tests/test_extra.py"));

    // Tasks 1 and 2: rejected for their reasons, still loose.
    for (r, why) in [
        (&res[1], "passes_with_wrong_patch"),
        (&res[2], "touches_source"),
    ] {
        let s = &r["strengthening"];
        ensure!(
            r["verdict"] == "loose"
                && s["status"] == "rejected"
                && s["attempts"][0]["check"]["outcome"] == why,
            "{why}: {r:#}"
        );
    }

    // The curated set is the strengthened task alone, with the new test.
    let kept = load_tasks(&curated, Format::Auto)?;
    ensure!(kept.len() == 1, "{kept:?}");
    let k = &kept[0];
    ensure!(k.instance_id == tasks[0].instance_id);
    ensure!(k.fail_to_pass.contains(&new_test), "{:?}", k.fail_to_pass);
    ensure!(k.fail_to_pass.len() == tasks[0].fail_to_pass.len() + 1);
    ensure!(
        k.test_patch.contains("tests/test_extra.py")
            && k.test_patch.contains(&format!("tests/test_{f0}.py")),
        "{}",
        k.test_patch
    );

    // A plain audit of the curated set finds it valid and tight.
    let r = arcticd(&[
        "tasks",
        "audit",
        "--tasks",
        &curated.display().to_string(),
        "--backend",
        "local",
    ]);
    ensure!(r.status.success(), "{}", String::from_utf8_lossy(&r.stderr));
    let again: Value = serde_json::from_slice(&r.stdout)?;
    ensure!(again["tight"] == 1 && again["invalid"] == 0, "{again:#}");
    Ok(())
}

#[test]
fn strengthen_follows_the_next_wrong_patch_until_tight() -> Result<()> {
    if !usable() {
        return Ok(());
    }
    let dir = TempDir::new("rounds")?;
    let cfg = toy::ToyConfig {
        count: 1,
        seed: 1,
        loose_share: 1.0,
        ..Default::default()
    };
    let tasks = toy::generate(&cfg, &dir.0.join("pool"))?;
    let task = &tasks[0];
    ensure!(
        task.instance_id.ends_with("off_by_one"),
        "{}",
        task.instance_id
    );
    let (pkg, f) = names(task)?;
    let model = init_model(&dir.0)?;
    let tok = Arc::new(Tokenizer::from_dir(&model)?);
    let template = ChatTemplate::from_dir(&model)?.unwrap_or_else(ChatTemplate::qwen35);
    let harness = Harness::new(
        tok.clone(),
        template,
        RolloutConfig {
            instruction: STRENGTHEN_INSTRUCTION.into(),
            ..Default::default()
        },
    )?;
    // The loose test is `f(1) == 1`; the audit's wrong patch returns 1
    // (the hard-coded answer). Round 1 rejects exactly the int 1, so
    // `return True` (equal to 1) still passes; round 2 checks the value.
    let scripts = [
        writes_test_to(
            "tests/test_extra.py",
            &pkg,
            &f,
            &format!("    one = 1\n    assert {f}(3) is not one\n"),
        ),
        writes_test_to(
            "tests/test_extra2.py",
            &pkg,
            &f,
            &format!("    assert {f}(3) == 6\n"),
        ),
    ];
    let calls = AtomicUsize::new(0);
    let policy_for = move |_: &Task| -> Arc<dyn ModelPolicy> {
        let k = calls.fetch_add(1, Ordering::SeqCst).min(1);
        Arc::new(ScriptedPolicy::new(tok.clone(), scripts[k].clone()))
    };
    let agent = AuditAgent {
        harness: &harness,
        policy_for: &policy_for,
        attempts: 3,
    };
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let backend = match LocalBackend::new().await {
            Ok(b) => b,
            Err(e) => {
                eprintln!("SKIPPED: local sandbox backend unavailable: {e}");
                ensure!(std::env::var_os("CI").is_none(), "{e}");
                return Ok(());
            }
        };
        let policy = arcticd_sandbox::Policy::default();
        let cfg = AuditConfig {
            validate: ValidateConfig {
                repeats: 1,
                test_timeout_secs: 120.0,
                ..Default::default()
            },
            ..Default::default()
        };
        let audit = audit_task(&backend, task, &policy, &cfg, vec![]).await;
        let wrong = audit
            .accepted
            .clone()
            .context("the loose task was not flagged")?;
        ensure!(wrong.patch.contains("+    return 1\n"), "{}", wrong.patch);

        let s = strengthen_task(&agent, &backend, task, &wrong, &policy, &cfg).await;
        let json = serde_json::to_string_pretty(&s)?;
        ensure!(
            s.status == "strengthened" && s.attempts.len() == 2,
            "{json}"
        );
        let first = s.attempts[0].check.as_ref().context("no check")?;
        let next = first
            .still_accepted
            .as_ref()
            .context("no next wrong patch")?;
        ensure!(
            first.outcome == "still_loose" && next.patch.contains("+    return True\n"),
            "{json}"
        );
        let second = s.attempts[1].check.as_ref().context("no check")?;
        ensure!(
            s.attempts[1].target == next.name && second.outcome == "accepted",
            "{json}"
        );
        // Round 1's test passes before the fix (3 is not 1); round 2's
        // fails before it (3, not 6).
        ensure!(
            s.new_pass_to_pass == [format!("tests/test_extra.py::test_{f}_strong")]
                && s.new_fail_to_pass == [format!("tests/test_extra2.py::test_{f}_strong")],
            "{json}"
        );
        let done = s.task.as_ref().context("no strengthened task")?;
        ensure!(
            done.test_patch.contains("tests/test_extra.py")
                && done.test_patch.contains("tests/test_extra2.py")
        );
        ensure!(done.meta["strengthened"].as_array().map(Vec::len) == Some(2));
        Ok(())
    })
}
