//! Strengthening loose tasks: extra tests, accepted only when they pass on
//! the gold patch and fail on the wrong patch the task's tests let through
//! (the audit's `--strengthen`).
//!
//! A candidate is a diff that touches test files only (written by an agent
//! through the harness; see the trainer's `harness::wrong_patch`). It is
//! judged here, in fresh sandboxes like any grade: combined with the task's
//! test patch, every test (old and new) must pass with the gold patch and at
//! least one new test must fail with the wrong patch. New tests are the ids
//! the log reports with the candidate that it did not report without it.
//! The strengthened task (test patch combined, the new ids added to
//! FAIL_TO_PASS or PASS_TO_PASS by how they run before the gold patch) must
//! then validate and survive a fresh audit (the mechanical variants plus the
//! wrong patch) to be accepted. Not for: writing tests (that is the agent's
//! job) or deciding which tasks to strengthen (the audit's caller).

use super::audit::{audit_task, AuditConfig, Variant};
use super::validate::{task_env, validate_task};
use super::{default_test_cmd, Task};
use crate::grading::{self, patch_paths, GradeOutcome, GradeReport, TestSpec};
use crate::logparse::TestStatus;
use crate::{Backend, Policy, Result, Snapshot};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::{Component, Path};
use std::sync::Arc;

/// Whether `path` (relative, as in a diff) is a test file: below a `test`,
/// `tests` or `testing` folder, or named `test_*`, `*_test.py`,
/// `*_tests.py` or `conftest.py`.
pub fn is_test_path(path: &str) -> bool {
    let p = Path::new(path);
    if p.is_absolute() || p.components().any(|c| !matches!(c, Component::Normal(_))) {
        return false;
    }
    let in_test_folder = p.parent().is_some_and(|d| {
        d.components()
            .any(|c| matches!(c.as_os_str().to_str(), Some("test" | "tests" | "testing")))
    });
    let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
    in_test_folder
        || name.starts_with("test_")
        || name.ends_with("_test.py")
        || name.ends_with("_tests.py")
        || name == "conftest.py"
}

/// The verdict on one candidate test diff.
#[derive(Debug, Clone, Serialize)]
pub struct CandidateCheck {
    /// `accepted` (valid and tight), `still_loose` (valid, but another
    /// wrong patch still passes), or why it was rejected: `empty`,
    /// `touches_source`, `does_not_apply`, `no_new_tests`,
    /// `fails_with_gold`, `passes_with_wrong_patch`, `invalid` (the
    /// strengthened task failed validation), `infra`.
    pub outcome: String,
    /// Human-readable evidence.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
    /// New tests that fail before the gold patch.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub new_fail_to_pass: Vec<String>,
    /// New tests that pass before the gold patch.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub new_pass_to_pass: Vec<String>,
    /// The wrong patch the strengthened tests still accept (`still_loose`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub still_accepted: Option<Variant>,
    /// The strengthened task (`accepted` and `still_loose`).
    #[serde(skip)]
    pub strengthened: Option<Task>,
}

impl CandidateCheck {
    fn rejected(outcome: &str, detail: impl Into<String>) -> Self {
        CandidateCheck {
            outcome: outcome.to_string(),
            detail: detail.into(),
            new_fail_to_pass: vec![],
            new_pass_to_pass: vec![],
            still_accepted: None,
            strengthened: None,
        }
    }
}

/// One agent attempt at strengthening a task.
#[derive(Debug, Clone, Serialize)]
pub struct StrengthenAttempt {
    pub attempt: usize,
    /// Name of the wrong patch the new tests had to reject.
    pub target: String,
    /// How the agent's rollout ended (`submitted`, or the gate that ended it).
    pub termination: String,
    /// The check of the submitted diff; absent when nothing was submitted.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub check: Option<CandidateCheck>,
    /// Why nothing was checked.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

/// What strengthening did for one loose task.
#[derive(Debug, Clone, Serialize)]
pub struct Strengthening {
    /// `strengthened` (valid and no longer loose) or `rejected` (no
    /// attempt got there).
    pub status: &'static str,
    pub attempts: Vec<StrengthenAttempt>,
    /// Tests added to FAIL_TO_PASS (every accepted round), when strengthened.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub new_fail_to_pass: Vec<String>,
    /// Tests added to PASS_TO_PASS, when strengthened.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub new_pass_to_pass: Vec<String>,
    /// The strengthened task's test patch (the evidence), when strengthened.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub test_patch: Option<String>,
    /// The strengthened task, when strengthened.
    #[serde(skip)]
    pub task: Option<Task>,
}

/// `patches` applied in order to a fresh sandbox of the snapshot, as one
/// diff against it; `Ok(Err(why))` when one does not apply.
async fn combine(
    backend: &dyn Backend,
    snapshot: &Arc<Snapshot>,
    image: &str,
    policy: &Policy,
    patches: &[&str],
) -> Result<std::result::Result<String, String>> {
    let sb = backend.start(snapshot, image, policy).await?;
    let result = async {
        for (i, p) in patches.iter().enumerate() {
            let o = sb.apply_patch(p).await?;
            if !o.applied {
                return Ok(Err(format!("patch {i}: {}", o.output.trim())));
            }
        }
        Ok::<_, crate::Error>(Ok(sb.diff().await?))
    }
    .await;
    let closed = sb.close().await;
    let r = result?;
    closed?;
    Ok(r)
}

fn passed(r: &GradeReport, id: &str) -> bool {
    r.tests.get(id) == Some(&TestStatus::Passed)
}

/// Grades `diff` with `spec`; infrastructure failures become the error text.
async fn run(
    backend: &dyn Backend,
    env: &(Arc<Snapshot>, String, Policy),
    diff: &str,
    spec: &TestSpec,
) -> std::result::Result<GradeReport, String> {
    match grading::grade(backend, &env.0, &env.1, &env.2, diff, spec).await {
        Ok(r) if r.outcome == GradeOutcome::InfraError => Err(r.detail),
        Ok(r) => Ok(r),
        Err(e) => Err(e.to_string()),
    }
}

/// Judges a candidate test diff for `task`, whose tests accept `wrong`.
pub async fn check_candidate(
    backend: &dyn Backend,
    task: &Task,
    policy: &Policy,
    cfg: &AuditConfig,
    wrong: &Variant,
    candidate: &str,
) -> CandidateCheck {
    let paths = patch_paths(candidate);
    if candidate.trim().is_empty() || paths.is_empty() {
        return CandidateCheck::rejected("empty", "the submitted diff changes nothing");
    }
    let source: Vec<&str> = paths
        .iter()
        .filter(|p| !is_test_path(p))
        .map(String::as_str)
        .collect();
    if !source.is_empty() {
        return CandidateCheck::rejected(
            "touches_source",
            format!("files that are not tests: {}", source.join(", ")),
        );
    }
    let vcfg = &cfg.validate;
    let env = match task_env(backend, task, &vcfg.image, policy).await {
        Ok(x) => x,
        Err(e) => return CandidateCheck::rejected("infra", e.to_string()),
    };
    let combined = match combine(
        backend,
        &env.0,
        &env.1,
        &env.2,
        &[&task.test_patch, candidate],
    )
    .await
    {
        Ok(Ok(d)) => d,
        Ok(Err(why)) => {
            return CandidateCheck::rejected(
                "does_not_apply",
                format!("with the task's test patch: {why}"),
            )
        }
        Err(e) => return CandidateCheck::rejected("infra", e.to_string()),
    };
    // A default pytest command lists the test patch's files: it must run
    // the candidate's new files too. A command of the task's own stays.
    let test_cmd = if task.test_cmd == default_test_cmd(&task.test_patch) {
        default_test_cmd(&combined)
    } else {
        task.test_cmd.clone()
    };
    let mut with_tests = task.clone();
    with_tests.test_patch = combined;
    with_tests.test_cmd = test_cmd;
    let secs = vcfg.test_timeout_secs;

    let baseline = match run(backend, &env, &task.patch, &task.test_spec(secs)).await {
        Ok(r) => r,
        Err(e) => return CandidateCheck::rejected("infra", format!("gold, old tests: {e}")),
    };
    let gold = match run(backend, &env, &task.patch, &with_tests.test_spec(secs)).await {
        Ok(r) => r,
        Err(e) => return CandidateCheck::rejected("infra", format!("gold, new tests: {e}")),
    };
    let new_ids: Vec<String> = gold
        .tests
        .keys()
        .filter(|t| !baseline.tests.contains_key(*t))
        .cloned()
        .collect();
    if new_ids.is_empty() {
        return CandidateCheck::rejected(
            "no_new_tests",
            format!(
                "no test id appeared that the old tests did not report (does `{}` run the new tests?)",
                with_tests.test_cmd
            ),
        );
    }
    let failing_new: Vec<&str> = new_ids
        .iter()
        .filter(|t| !passed(&gold, t))
        .map(String::as_str)
        .collect();
    if gold.outcome != GradeOutcome::Resolved || !failing_new.is_empty() {
        let old: Vec<&str> = gold.failing.iter().map(|(t, _)| t.as_str()).collect();
        return CandidateCheck::rejected(
            "fails_with_gold",
            format!(
                "{}; new tests failing: [{}]; old tests failing: [{}]",
                gold.detail,
                failing_new.join(", "),
                old.join(", ")
            ),
        );
    }
    let new_only = TestSpec {
        fail_to_pass: new_ids.clone(),
        pass_to_pass: vec![],
        ..with_tests.test_spec(secs)
    };
    let on_wrong = match run(backend, &env, &wrong.patch, &new_only).await {
        Ok(r) if r.outcome == GradeOutcome::PatchFailed => {
            return CandidateCheck::rejected("infra", format!("wrong patch: {}", r.detail))
        }
        Ok(r) => r,
        Err(e) => return CandidateCheck::rejected("infra", format!("wrong patch: {e}")),
    };
    if new_ids.iter().all(|t| passed(&on_wrong, t)) {
        return CandidateCheck::rejected(
            "passes_with_wrong_patch",
            format!(
                "every new test passes with wrong patch {}: [{}]",
                wrong.name,
                new_ids.join(", ")
            ),
        );
    }
    let before = match run(backend, &env, "", &new_only).await {
        Ok(r) => r,
        Err(e) => return CandidateCheck::rejected("infra", format!("before the gold patch: {e}")),
    };
    let (new_p2p, new_f2p): (Vec<String>, Vec<String>) =
        new_ids.into_iter().partition(|t| passed(&before, t));
    let mut strengthened = with_tests;
    strengthened.fail_to_pass.extend(new_f2p.iter().cloned());
    strengthened.pass_to_pass.extend(new_p2p.iter().cloned());
    let mut rounds = match strengthened.meta.remove("strengthened") {
        Some(Value::Array(a)) => a,
        _ => vec![],
    };
    rounds.push(json!({
        "rejects": wrong.name,
        "new_fail_to_pass": new_f2p,
        "new_pass_to_pass": new_p2p,
    }));
    strengthened
        .meta
        .insert("strengthened".into(), Value::Array(rounds));
    // The toy ground truth describes the generated tests; these are
    // stronger now (whether strong enough, the audit below decides).
    if let Some(toy) = strengthened
        .meta
        .get_mut("toy")
        .and_then(Value::as_object_mut)
    {
        if toy.contains_key("loose") {
            toy.insert("loose".into(), Value::Bool(false));
        }
    }
    let mut check = CandidateCheck {
        outcome: String::new(),
        detail: String::new(),
        new_fail_to_pass: new_f2p,
        new_pass_to_pass: new_p2p,
        still_accepted: None,
        strengthened: None,
    };

    let v = validate_task(backend, &strengthened, policy, vcfg).await;
    if !v.is_valid() {
        check.outcome = "invalid".into();
        check.detail = format!(
            "the strengthened task is invalid: {} {}",
            v.reason.unwrap_or_default(),
            v.detail
        );
        return check;
    }
    let recfg = AuditConfig {
        validate_first: false,
        ..cfg.clone()
    };
    let audit = audit_task(backend, &strengthened, policy, &recfg, vec![wrong.clone()]).await;
    if audit.verdict == "loose" {
        check.outcome = "still_loose".into();
        check.detail = format!(
            "the strengthened tests still accept wrong patch {}",
            audit
                .accepted
                .as_ref()
                .map(|a| a.name.as_str())
                .unwrap_or("?")
        );
        check.still_accepted = audit.accepted;
    } else {
        check.outcome = "accepted".into();
        check.detail = format!("{} wrong patches rejected", audit.tried);
    }
    check.strengthened = Some(strengthened);
    check
}

/// New test ids of the accepted rounds, without repeats, in order.
pub fn merge_ids(rounds: &[&[String]]) -> Vec<String> {
    let mut seen = BTreeSet::new();
    rounds
        .iter()
        .flat_map(|r| r.iter())
        .filter(|t| seen.insert(t.to_string()))
        .cloned()
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tells_test_files_from_source() {
        for p in [
            "tests/test_x.py",
            "pkg/tests/helpers.py",
            "test_top.py",
            "pkg/core_test.py",
            "conftest.py",
            "src/testing/util.py",
        ] {
            assert!(is_test_path(p), "{p}");
        }
        for p in [
            "pkg/core.py",
            "setup.py",
            "tests/../pkg/core.py",
            "/tests/x.py",
            "pkg/contest.py",
        ] {
            assert!(!is_test_path(p), "{p}");
        }
    }

    #[test]
    fn merges_ids_in_order() {
        let a = vec!["x".to_string(), "y".to_string()];
        let b = vec!["y".to_string(), "z".to_string()];
        assert_eq!(merge_ids(&[&a, &b]), vec!["x", "y", "z"]);
    }
}
