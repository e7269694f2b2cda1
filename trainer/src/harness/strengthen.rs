//! Agent-written tests for loose tasks (the audit's `--strengthen`): a
//! model, run through the ordinary harness, is shown the issue, the gold
//! patch, the existing tests and the wrong patch they accept, and asked for
//! tests that pass with the gold patch and fail with the wrong one. Its
//! submitted diff is the candidate, judged by
//! `arcticd_sandbox::tasks::strengthen::check_candidate`.
//!
//! Attempts go on until one is accepted or the attempts run out; when a
//! candidate is valid and rejects the wrong patch but the fresh audit finds
//! another wrong patch the tests still accept, the next attempt starts from
//! the strengthened task and targets that patch. Not for: judging tests
//! (the sandbox crate) or wrong patches (see [`super::wrong_patch`]).

use super::trajectory::Termination;
use super::wrong_patch::AuditAgent;
use arcticd_sandbox::tasks::audit::{AuditConfig, Variant};
use arcticd_sandbox::tasks::strengthen::{
    check_candidate, merge_ids, StrengthenAttempt, Strengthening,
};
use arcticd_sandbox::tasks::Task;
use arcticd_sandbox::{Backend, Policy};

/// The instruction after the issue for the strengthening agent (set it as
/// `RolloutConfig::instruction` of its harness).
pub const STRENGTHEN_INSTRUCTION: &str =
    "Add the tests the task above asks for, changing test files only, then call submit.";

/// Id prefix of strengthening tasks: a scripted agent's turns for task X
/// are keyed `strengthen/X`.
pub const TASK_PREFIX: &str = "strengthen/";

/// The task as the strengthening agent sees it: same repository, an issue
/// text that shows the gold patch, the tests and the wrong patch they
/// accept, and asks for tests that tell the two apart.
pub fn strengthening_task(task: &Task, wrong: &Variant) -> Task {
    let mut t = task.clone();
    t.instance_id = format!("{TASK_PREFIX}{}", task.instance_id);
    t.problem_statement = format!(
        "You are improving the tests of a benchmark task. Its tests are too weak: they accept the WRONG \
         fix shown below. Write new tests that PASS with the correct fix and FAIL with the wrong fix.\n\
         Put them in test files only: a new file (for example under tests/) or an existing test file of \
         the repository; change no other file. Your working copy has neither fix: you may apply one to \
         check your tests, but undo every change outside test files before you submit. The existing \
         hidden tests are not in your working copy; do not re-create them, and give new tests new names.\n\n\
         Issue:\n{}\n\nCorrect fix:\n```diff\n{}```\n\nWrong fix that the tests accept:\n```diff\n{}```\n\n\
         Existing hidden tests:\n```diff\n{}```\nTest command: {}",
        task.problem_statement.trim(),
        task.patch,
        wrong.patch,
        task.test_patch,
        task.test_cmd,
    );
    t
}

fn termination_name(t: Termination) -> String {
    serde_json::to_value(t)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| format!("{t:?}"))
}

/// Strengthens `task`, whose tests accept `wrong`, with up to
/// `agent.attempts` agent attempts. The agent's harness should carry
/// [`STRENGTHEN_INSTRUCTION`].
pub async fn strengthen_task(
    agent: &AuditAgent<'_>,
    backend: &dyn Backend,
    task: &Task,
    wrong: &Variant,
    policy: &Policy,
    cfg: &AuditConfig,
) -> Strengthening {
    let mut current = task.clone();
    let mut target = wrong.clone();
    let mut attempts = Vec::new();
    let mut f2p_rounds: Vec<Vec<String>> = Vec::new();
    let mut p2p_rounds: Vec<Vec<String>> = Vec::new();
    for k in 0..agent.attempts.max(1) {
        let shown = strengthening_task(&current, &target);
        // One policy per rollout (scripted policies replay from the start).
        let p = (agent.policy_for)(&shown);
        let t = agent.harness.rollout(p.as_ref(), backend, &shown, k).await;
        let mut record = StrengthenAttempt {
            attempt: k,
            target: target.name.clone(),
            termination: termination_name(t.termination),
            check: None,
            detail: String::new(),
        };
        // The diff exists only when the agent submitted (grading it against
        // the old tests may still have failed; that grade does not matter).
        let Some(diff) = t.diff else {
            record.detail = t.detail;
            attempts.push(record);
            continue;
        };
        let check = check_candidate(backend, &current, policy, cfg, &target, &diff).await;
        let outcome = check.outcome.clone();
        let next = check.strengthened.clone();
        let still = check.still_accepted.clone();
        if matches!(outcome.as_str(), "accepted" | "still_loose") {
            f2p_rounds.push(check.new_fail_to_pass.clone());
            p2p_rounds.push(check.new_pass_to_pass.clone());
        }
        record.check = Some(check);
        attempts.push(record);
        match (outcome.as_str(), next, still) {
            ("accepted", Some(done), _) => {
                let f2p: Vec<&[String]> = f2p_rounds.iter().map(Vec::as_slice).collect();
                let p2p: Vec<&[String]> = p2p_rounds.iter().map(Vec::as_slice).collect();
                return Strengthening {
                    status: "strengthened",
                    attempts,
                    new_fail_to_pass: merge_ids(&f2p),
                    new_pass_to_pass: merge_ids(&p2p),
                    test_patch: Some(done.test_patch.clone()),
                    task: Some(done),
                };
            }
            ("still_loose", Some(better), Some(w)) => {
                current = better;
                target = w;
            }
            _ => {}
        }
    }
    Strengthening {
        status: "rejected",
        attempts,
        new_fail_to_pass: vec![],
        new_pass_to_pass: vec![],
        test_patch: None,
        task: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strengthening_task_shows_both_fixes_and_the_tests() {
        let task = Task {
            instance_id: "t1".into(),
            problem_statement: "add is wrong".into(),
            patch: "GOLD-DIFF\n".into(),
            test_patch: "TEST-DIFF\n".into(),
            fail_to_pass: vec!["tests/test_a.py::test_a".into()],
            pass_to_pass: vec![],
            image: None,
            repo: Some("r".into()),
            workdir: "/testbed".into(),
            test_cmd: "pytest -rA".into(),
            log_parser: "pytest".into(),
            meta: Default::default(),
        };
        let w = Variant {
            name: "constant_return_0".into(),
            patch: "WRONG-DIFF\n".into(),
        };
        let s = strengthening_task(&task, &w);
        assert_eq!(s.instance_id, "strengthen/t1");
        for part in [
            "add is wrong",
            "GOLD-DIFF",
            "WRONG-DIFF",
            "TEST-DIFF",
            "pytest -rA",
        ] {
            assert!(s.problem_statement.contains(part), "{part}");
        }
        assert_eq!(s.patch, task.patch);
        assert_eq!(s.test_patch, task.test_patch);
    }
}
