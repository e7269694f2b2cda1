//! Agent-written wrong patches for the audit: a model, run through the
//! ordinary harness, is shown the issue, the gold patch and the hidden
//! tests, and asked for a plausible fix that is wrong yet passes the tests.
//! When its submitted diff resolves the task and differs from the gold
//! patch, the task's tests are too loose, and the diff is the evidence.
//!
//! Not for: mechanical variants (see `arcticd_sandbox::tasks::audit`) or
//! judging whether a patch is semantically wrong (that is the prompt's
//! contract with the model; a human reads the evidence).

use super::policy::Policy;
use super::rollout::Harness;
use super::trajectory::Termination;
use arcticd_sandbox::tasks::audit::Variant;
use arcticd_sandbox::tasks::Task;
use arcticd_sandbox::Backend;

/// The task as the adversarial agent sees it: same repository and tests,
/// an issue text that shows the gold patch and the tests and asks for a
/// wrong fix that passes them.
pub fn adversarial_task(task: &Task) -> Task {
    let mut t = task.clone();
    t.problem_statement = format!(
        "You are auditing a benchmark task. Below are its issue, its correct fix and its hidden tests.\n\
         Write a fix that looks plausible but is WRONG (it must not implement the issue correctly, e.g. \
         special-cases the tested inputs or handles only part of the issue) and still passes the tests \
         shown. Do not edit the tests. Submit when done.\n\n\
         Issue:\n{}\n\nCorrect fix (do not apply it):\n```diff\n{}```\n\nHidden tests:\n```diff\n{}```\n\
         Tests that must pass: {}",
        task.problem_statement.trim(),
        task.patch,
        task.test_patch,
        task.fail_to_pass
            .iter()
            .chain(&task.pass_to_pass)
            .cloned()
            .collect::<Vec<_>>()
            .join(", ")
    );
    t
}

fn normalized(patch: &str) -> String {
    patch
        .lines()
        .filter(|l| {
            (l.starts_with('+') || l.starts_with('-'))
                && !l.starts_with("+++")
                && !l.starts_with("---")
        })
        .map(str::trim_end)
        .collect::<Vec<_>>()
        .join("\n")
}

/// One adversarial attempt; the agent's diff when it passed every test and
/// is not the gold patch.
pub async fn agent_wrong_patch(
    harness: &Harness,
    policy: &dyn Policy,
    backend: &dyn Backend,
    task: &Task,
    attempt: usize,
) -> Option<Variant> {
    let t = harness
        .rollout(policy, backend, &adversarial_task(task), attempt)
        .await;
    let diff = t.diff?;
    (t.termination == Termination::Submitted
        && t.reward >= 1.0
        && !diff.trim().is_empty()
        && normalized(&diff) != normalized(&task.patch))
    .then(|| Variant {
        name: format!("agent_{attempt}"),
        patch: diff,
    })
}

/// The audit's agent: a harness, the policy that attempts each task, and
/// attempts per task.
pub struct AuditAgent<'a> {
    pub harness: &'a Harness,
    pub policy_for: &'a (dyn Fn(&Task) -> std::sync::Arc<dyn Policy> + Sync),
    pub attempts: usize,
}

/// [`arcticd_sandbox::tasks::audit::audit_tasks`] with agent-written wrong
/// patches added to each task's mechanical ones (when `agent` is given),
/// and each task found loose then strengthened with agent-written tests
/// (when `strengthen` is given; its harness should carry
/// [`super::strengthen::STRENGTHEN_INSTRUCTION`]).
pub async fn audit_tasks_with_agent(
    backend: &dyn Backend,
    tasks: &[Task],
    policy: &arcticd_sandbox::Policy,
    cfg: &arcticd_sandbox::tasks::audit::AuditConfig,
    agent: Option<&AuditAgent<'_>>,
    strengthen: Option<&AuditAgent<'_>>,
) -> arcticd_sandbox::tasks::audit::AuditReport {
    use arcticd_sandbox::tasks::audit;
    use futures_util::StreamExt;
    let results: Vec<audit::AuditResult> =
        futures_util::stream::iter(tasks.iter().map(|t| async move {
            let mut extra = Vec::new();
            if let Some(ag) = agent {
                for k in 0..ag.attempts.max(1) {
                    // One policy per rollout (scripted policies replay from the start).
                    let p = (ag.policy_for)(t);
                    if let Some(v) = agent_wrong_patch(ag.harness, p.as_ref(), backend, t, k).await
                    {
                        extra.push(v);
                        break;
                    }
                }
            }
            let mut r = audit::audit_task(backend, t, policy, cfg, extra).await;
            if let (Some(sa), "loose", Some(wrong)) = (strengthen, r.verdict, r.accepted.clone()) {
                let s =
                    super::strengthen::strengthen_task(sa, backend, t, &wrong, policy, cfg).await;
                if s.status == "strengthened" {
                    r.verdict = "strengthened";
                }
                r.strengthening = Some(s);
            }
            r
        }))
        .buffered(cfg.validate.concurrency.max(1))
        .collect()
        .await;
    audit::report(results)
}
