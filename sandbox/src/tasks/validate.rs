//! Task validation: the data-hygiene rule (docs/ARCHITECTURE.md, recipe step
//! 10), checked by running the tests.
//!
//! A task is valid when, graded in fresh sandboxes: its fail-to-pass tests
//! fail without the gold patch and pass with it; its pass-to-pass tests pass
//! both times; the set of test ids the log reports is the same before and
//! after; and each of the two conditions, run twice, gives the same results
//! (flaky tests make a reward noise). Not for: judging whether the tests are
//! strong enough (see [`super::audit`]).

use super::Task;
use crate::grading::{self, GradeOutcome, GradeReport};
use crate::logparse::TestStatus;
use crate::snapshot::{folder_stamp, SnapshotCache};
use crate::{Backend, Error, Policy, Result, Snapshot};
use futures_util::StreamExt;
use serde::Serialize;
use std::path::Path;
use std::sync::{Arc, OnceLock};

/// Settings of [`validate_tasks`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ValidateConfig {
    /// Image for tasks with a local `repo` and no `image`. Default the
    /// sandbox base image tag.
    pub image: String,
    /// Limit of one test run, seconds. Default 300.
    pub test_timeout_secs: f64,
    /// Runs of each condition (before / with gold); 2 catches most flaky
    /// tests. Default 2.
    pub repeats: usize,
    /// Tasks validated at once. Default 2.
    pub concurrency: usize,
}

impl Default for ValidateConfig {
    fn default() -> Self {
        ValidateConfig {
            image: crate::image::DEFAULT_TAG.to_string(),
            test_timeout_secs: 300.0,
            repeats: 2,
            concurrency: 2,
        }
    }
}

impl ValidateConfig {
    /// A test time limit of some seconds, at least one run of each
    /// condition and one task at a time: checked before any sandbox starts,
    /// so a bad setting is one error, not every task's `infra` verdict.
    pub fn check(&self) -> Result<()> {
        let t = self.test_timeout_secs;
        if !crate::timeout_ok(t) {
            return Err(Error::InvalidInput(format!(
                "the test time limit must be a number of seconds above 0 and below {:e}, got {t}",
                crate::MAX_TIMEOUT_SECS
            )));
        }
        if self.repeats == 0 || self.concurrency == 0 {
            return Err(Error::InvalidInput(format!(
                "validation needs at least 1 run of each condition and 1 task at once, \
                 got repeats {} and concurrency {}",
                self.repeats, self.concurrency
            )));
        }
        Ok(())
    }
}

/// The verdict on one task.
#[derive(Debug, Clone, Serialize)]
pub struct Verdict {
    pub instance_id: String,
    /// `valid` or `invalid`.
    pub verdict: &'static str,
    /// Why invalid: `test_timeout` and `test_memory` (a test run hit its
    /// limit), `no_tests_parsed`, `gold_patch_does_not_apply`,
    /// `gold_fails`, `f2p_passes_before`, `p2p_fails_before`, `flaky`,
    /// `test_ids_differ`, `infra`, `environment` (the repository could not
    /// be prepared: image or its workdir missing, unreadable `repo`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Human-readable evidence.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub detail: String,
}

impl Verdict {
    fn invalid(id: &str, reason: &str, detail: String) -> Self {
        Verdict {
            instance_id: id.to_string(),
            verdict: "invalid",
            reason: Some(reason.to_string()),
            detail,
        }
    }
    /// Whether the task passed.
    pub fn is_valid(&self) -> bool {
        self.verdict == "valid"
    }
}

/// The snapshot and image a task's sandboxes start from, and the policy
/// with the task's workdir. The snapshot is the task's local `repo` folder
/// when it has one; otherwise the repository its `image` holds at `workdir`
/// (exported once per image by the backend). Errors name the task.
pub async fn task_env(
    backend: &dyn Backend,
    task: &Task,
    default_image: &str,
    policy: &Policy,
) -> Result<(Arc<Snapshot>, String, Policy)> {
    let id = &task.instance_id;
    let named = |e: Error| match e {
        Error::Image(m) => Error::Image(format!("task {id}: {m}")),
        Error::InvalidInput(m) => Error::InvalidInput(format!("task {id}: {m}")),
        other => Error::Snapshot(format!("task {id}: {other}")),
    };
    let snapshot = match (&task.repo, &task.image) {
        (Some(repo), _) => dir_snapshot(repo).await.map_err(named)?,
        (None, Some(image)) => backend
            .snapshot_from_image(image, &task.workdir)
            .await
            .map_err(named)?,
        (None, None) => {
            return Err(Error::InvalidInput(format!(
                "task {id}: neither `repo` nor `image` is given"
            )))
        }
    };
    let image = task
        .image
        .clone()
        .unwrap_or_else(|| default_image.to_string());
    let policy = Policy {
        workdir: task.workdir.clone(),
        ..policy.clone()
    };
    Ok((snapshot, image, policy))
}

/// Most snapshots of task folders kept by [`dir_snapshot`] (a training
/// pool's worth of small repositories).
const DIR_SNAPSHOTS: usize = 512;

/// The snapshot of a task's local repository, made once while the folder
/// is unchanged ([`folder_stamp`]): the rollouts, grades and checks of one
/// task share one snapshot instead of each staging and committing a copy.
async fn dir_snapshot(repo: &Path) -> Result<Arc<Snapshot>> {
    static CACHE: OnceLock<SnapshotCache> = OnceLock::new();
    let cache = CACHE.get_or_init(|| SnapshotCache::with_capacity(DIR_SNAPSHOTS));
    let blocking = |e: tokio::task::JoinError| Error::Snapshot(format!("snapshot worker: {e}"));
    let (dir, stamp_dir) = (repo.to_path_buf(), repo.to_path_buf());
    let stamp = tokio::task::spawn_blocking(move || folder_stamp(&stamp_dir))
        .await
        .map_err(blocking)??;
    cache
        .get_or_make(&repo.to_string_lossy(), &stamp, || async move {
            tokio::task::spawn_blocking(move || Snapshot::from_dir(&dir))
                .await
                .map_err(blocking)?
        })
        .await
}

/// Validates one task.
pub async fn validate_task(
    backend: &dyn Backend,
    task: &Task,
    policy: &Policy,
    cfg: &ValidateConfig,
) -> Verdict {
    let id = task.instance_id.as_str();
    let (snapshot, image, policy) = match task_env(backend, task, &cfg.image, policy).await {
        Ok(x) => x,
        Err(e) => return Verdict::invalid(id, "environment", e.to_string()),
    };
    let spec = task.test_spec(cfg.test_timeout_secs);
    let mut before: Vec<GradeReport> = Vec::new();
    let mut after: Vec<GradeReport> = Vec::new();
    for _ in 0..cfg.repeats.max(1) {
        for (diff, runs) in [("", &mut before), (task.patch.as_str(), &mut after)] {
            match grading::grade(backend, &snapshot, &image, &policy, diff, &spec).await {
                Ok(r) => runs.push(r),
                Err(e) => return Verdict::invalid(id, "infra", e.to_string()),
            }
        }
    }
    judge_runs(id, task, &before, &after)
}

/// The validation rules on finished runs (before and with the gold patch).
pub fn judge_runs(id: &str, task: &Task, before: &[GradeReport], after: &[GradeReport]) -> Verdict {
    if let Some(r) = after
        .iter()
        .find(|r| r.outcome == GradeOutcome::PatchFailed)
    {
        return Verdict::invalid(id, "gold_patch_does_not_apply", r.detail.clone());
    }
    // A test run cut off by its limits parses to little or nothing: said
    // as the limit, not as a log the parser could not read.
    if let Some(r) = before
        .iter()
        .chain(after)
        .find(|r| r.timed_out || r.memory_exceeded)
    {
        let reason = if r.timed_out {
            "test_timeout"
        } else {
            "test_memory"
        };
        return Verdict::invalid(id, reason, r.detail.clone());
    }
    for r in before.iter().chain(after) {
        if r.tests.is_empty() {
            return Verdict::invalid(id, "no_tests_parsed", r.detail.clone());
        }
    }
    if let Some(r) = after
        .iter()
        .chain(before)
        .find(|r| r.outcome == GradeOutcome::InfraError)
    {
        return Verdict::invalid(id, "infra", r.detail.clone());
    }
    for runs in [before, after] {
        if runs.windows(2).any(|w| w[0].tests != w[1].tests) {
            return Verdict::invalid(
                id,
                "flaky",
                "two runs of the same condition gave different results".into(),
            );
        }
    }
    let (Some(b), Some(a)) = (before.first(), after.first()) else {
        return Verdict::invalid(id, "infra", "no runs".into());
    };
    if a.outcome != GradeOutcome::Resolved {
        let failing: Vec<&str> = a.failing.iter().map(|(t, _)| t.as_str()).collect();
        return Verdict::invalid(
            id,
            "gold_fails",
            format!("{}: {}", a.detail, failing.join(", ")),
        );
    }
    let passed_before: Vec<&str> = task
        .fail_to_pass
        .iter()
        .filter(|t| b.tests.get(*t) == Some(&TestStatus::Passed))
        .map(String::as_str)
        .collect();
    if !passed_before.is_empty() {
        return Verdict::invalid(id, "f2p_passes_before", passed_before.join(", "));
    }
    let p2p_failing: Vec<&str> = task
        .pass_to_pass
        .iter()
        .filter(|t| b.tests.get(*t) != Some(&TestStatus::Passed))
        .map(String::as_str)
        .collect();
    if !p2p_failing.is_empty() {
        return Verdict::invalid(id, "p2p_fails_before", p2p_failing.join(", "));
    }
    let ids_b: Vec<&String> = b.tests.keys().collect();
    let ids_a: Vec<&String> = a.tests.keys().collect();
    if ids_b != ids_a {
        let only_b: Vec<&str> = ids_b
            .iter()
            .filter(|t| !a.tests.contains_key(**t))
            .map(|t| t.as_str())
            .collect();
        let only_a: Vec<&str> = ids_a
            .iter()
            .filter(|t| !b.tests.contains_key(**t))
            .map(|t| t.as_str())
            .collect();
        return Verdict::invalid(
            id,
            "test_ids_differ",
            format!(
                "only before: [{}]; only after: [{}]",
                only_b.join(", "),
                only_a.join(", ")
            ),
        );
    }
    Verdict {
        instance_id: id.to_string(),
        verdict: "valid",
        reason: None,
        detail: String::new(),
    }
}

/// Validates every task, `cfg.concurrency` at a time; verdicts come back in
/// task order.
pub async fn validate_tasks(
    backend: &dyn Backend,
    tasks: &[Task],
    policy: &Policy,
    cfg: &ValidateConfig,
) -> Vec<Verdict> {
    futures_util::stream::iter(tasks.iter().map(|t| validate_task(backend, t, policy, cfg)))
        .buffered(cfg.concurrency.max(1))
        .collect()
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A time limit no sandbox takes is one error up front, with the
    /// bounds (1e7 s passed this check, then failed every task as infra).
    #[test]
    fn the_test_time_limit_is_bounded_both_ways() {
        let with = |t: f64| ValidateConfig {
            test_timeout_secs: t,
            ..ValidateConfig::default()
        };
        assert!(with(300.0).check().is_ok());
        for t in [0.0, -1.0, f64::NAN, 1e7, 1e20, f64::INFINITY] {
            let e = with(t).check().unwrap_err().to_string();
            assert!(e.contains("below 1e7"), "{t}: {e}");
        }
    }

    /// A test run that hit its time or memory limit is invalid for that
    /// reason, not as a log that parsed to nothing.
    #[test]
    fn a_test_run_cut_off_by_its_limit_is_named() {
        let task: Task = serde_json::from_value(serde_json::json!({
            "instance_id": "t", "problem_statement": "", "patch": "", "test_patch": "",
            "FAIL_TO_PASS": ["a"], "PASS_TO_PASS": [], "test_cmd": "sleep 9"
        }))
        .unwrap();
        let run = |timed_out: bool, memory_exceeded: bool| GradeReport {
            outcome: GradeOutcome::Unresolved,
            reward: 0.0,
            exit_code: None,
            timed_out,
            memory_exceeded,
            failing: vec![],
            tests: Default::default(),
            detail: "cut off".into(),
            log: String::new(),
        };
        let reason = |before: GradeReport, after: GradeReport| {
            judge_runs("t", &task, &[before], &[after]).reason.unwrap()
        };
        assert_eq!(reason(run(true, false), run(false, false)), "test_timeout");
        assert_eq!(reason(run(false, false), run(false, true)), "test_memory");
        assert_eq!(
            reason(run(false, false), run(false, false)),
            "no_tests_parsed"
        );
    }

    /// An unchanged folder gives the snapshot already made; a changed file
    /// gives a new one, with the new content.
    #[test]
    fn a_task_folder_is_snapshotted_once_while_unchanged() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("m.py");
        std::fs::write(&file, "x = 1\n").unwrap();
        let rt = crate::runtime().unwrap();
        let a = rt.block_on(dir_snapshot(dir.path())).unwrap();
        let b = rt.block_on(dir_snapshot(dir.path())).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        std::fs::write(&file, "x = 22\n").unwrap();
        let c = rt.block_on(dir_snapshot(dir.path())).unwrap();
        assert!(!Arc::ptr_eq(&a, &c));
        assert_ne!(a.commit(), c.commit());
        let staged = std::fs::read_to_string(c.path().join("m.py")).unwrap();
        assert_eq!(staged, "x = 22\n");
    }
}
