//! Evaluation: pass@1 averaged over K attempts per task, with its standard
//! error, per-task results and a termination-reason histogram, under the
//! same harness and isolation as training (docs/ARCHITECTURE.md, recipe step 11).
//!
//! Resumable: every finished attempt is appended to the output JSONL at
//! once, and attempts already in it are skipped on the next run. Attempts
//! that ended as `infra` or `policy_error` are masked: they count in the
//! histogram but not in pass@1, and are retried on resume. Not for: model
//! selection or training-time metrics.

use super::policy::Policy;
use super::rollout::Harness;
use super::trajectory::{Termination, Trajectory};
use crate::{Error, Result};
use arcticd_sandbox::tasks::Task;
use arcticd_sandbox::Backend;
use futures_util::StreamExt;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashSet};
use std::io::Write;
use std::path::Path;
use std::sync::Arc;

/// Settings of [`run_eval`].
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default)]
pub struct EvalConfig {
    /// Attempts per task (K). Default 4.
    pub attempts: usize,
    /// Rollouts at once. Default 2.
    pub concurrency: usize,
    /// What makes the attempts (`arcticd eval`: the model folder, the
    /// endpoint and model name, or the script file), written into every
    /// record; a resume refuses a file with another's. Default None: not
    /// recorded, not checked.
    pub policy: Option<String>,
}

impl Default for EvalConfig {
    fn default() -> Self {
        EvalConfig {
            attempts: 4,
            concurrency: 2,
            policy: None,
        }
    }
}

impl EvalConfig {
    /// At least one attempt per task and one at a time (0 attempts "ran"
    /// nothing and reported a pass@1 of 0, exit 0).
    pub fn check(&self) -> Result<()> {
        if self.attempts == 0 || self.concurrency == 0 {
            return Err(Error::Input(format!(
                "an evaluation needs at least 1 attempt per task and 1 at once, got {} and {}",
                self.attempts, self.concurrency
            )));
        }
        Ok(())
    }
}

/// One finished attempt, one line of the output file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttemptRecord {
    pub task_id: String,
    pub attempt: usize,
    pub reward: f64,
    pub termination: Termination,
    pub masked: bool,
    /// The rest is for reading the results; a record without it still counts.
    #[serde(default)]
    pub turns: usize,
    #[serde(default)]
    pub tokens: usize,
    #[serde(default)]
    pub wall_secs: f64,
    #[serde(default)]
    pub detail: String,
    /// [`EvalConfig::policy`] of the run that made it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub policy: Option<String>,
}

impl From<&Trajectory> for AttemptRecord {
    fn from(t: &Trajectory) -> Self {
        AttemptRecord {
            task_id: t.task_id.clone(),
            attempt: t.attempt,
            reward: t.reward,
            termination: t.termination,
            masked: t.masked,
            turns: t.turns.len(),
            tokens: t.token_ids.len(),
            wall_secs: t.wall_secs,
            detail: t.detail.clone(),
            policy: None,
        }
    }
}

/// Per-task result.
#[derive(Debug, Clone, Serialize)]
pub struct TaskResult {
    pub task_id: String,
    /// Unmasked attempts.
    pub attempts: usize,
    pub solved: usize,
    /// Mean reward over unmasked attempts.
    pub pass_at_1: Option<f64>,
}

/// The evaluation summary.
#[derive(Debug, Clone, Serialize)]
pub struct EvalSummary {
    /// Tasks with at least one unmasked attempt.
    pub tasks: usize,
    pub attempts: usize,
    /// Mean over tasks of the per-task mean reward.
    pub pass_at_1: f64,
    /// Standard error of that mean over tasks.
    pub stderr: f64,
    pub terminations: BTreeMap<String, usize>,
    pub per_task: Vec<TaskResult>,
    /// Why the first masked attempt was not graded (its termination and
    /// detail), when one was: what to tell a user whose evaluation graded
    /// nothing.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub first_masked: Option<String>,
}

impl EvalSummary {
    /// Why no attempt was graded (every one masked, or none made), when
    /// none was: a pass@1 of nothing is not a result.
    pub fn ungraded(&self) -> Option<String> {
        if self.tasks > 0 {
            return None;
        }
        Some(match &self.first_masked {
            Some(w) => format!(
                "the evaluation graded no attempt: all {} were masked ({}); the first: {w}",
                self.attempts,
                self.terminations
                    .iter()
                    .map(|(k, n)| format!("{n} {k}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            None => "the evaluation made no attempt".to_string(),
        })
    }
}

/// Reads the attempts already in `path` (missing file: none). A torn last
/// line (a crash mid-write: an unterminated fragment of a record) is
/// ignored; any other line that is not an attempt record is an error.
pub fn read_records(path: &Path) -> Result<Vec<AttemptRecord>> {
    Ok(scan_records(path)?.0)
}

/// How an attempts file ends.
#[derive(Debug, PartialEq)]
enum Tail {
    /// Empty, or its last line ends with a newline.
    Clean,
    /// A complete record with no newline after it.
    Unterminated,
    /// An unterminated fragment of a record from byte offset `.0` on.
    Torn(u64),
}

/// The records of `path` and how the file ends.
fn scan_records(path: &Path) -> Result<(Vec<AttemptRecord>, Tail)> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((vec![], Tail::Clean)),
        Err(e) => return Err(Error::io(path, e)),
    };
    let not_ours = |line: usize, why: String| {
        Error::Input(format!(
            "{}:{line}: not an attempt record ({why}), so not an evaluation's records; \
             it is left as it was",
            path.display()
        ))
    };
    let (mut out, mut tail, mut start) = (Vec::new(), Tail::Clean, 0usize);
    for (i, raw) in text.split_inclusive(|&b| b == b'\n').enumerate() {
        let offset = start;
        start += raw.len();
        let terminated = raw.ends_with(b"\n");
        let Ok(line) = std::str::from_utf8(raw) else {
            return Err(not_ours(i + 1, "not UTF-8".into()));
        };
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<AttemptRecord>(line) {
            Ok(r) => {
                out.push(r);
                if !terminated {
                    tail = Tail::Unterminated;
                }
            }
            // Records are written whole, field `task_id` first: a crash
            // mid-write leaves an unterminated start of one.
            Err(_) if !terminated && line.starts_with("{\"task_id\"") => {
                tail = Tail::Torn(offset as u64);
            }
            Err(e) => return Err(not_ours(i + 1, e.to_string())),
        }
    }
    Ok((out, tail))
}

/// Reads the attempts already in `path` and readies it for appending: a
/// torn last line is cut off (with a warning) and a last record with no
/// newline gets one, so the next record starts a line of its own. With a
/// `policy`, a file holding another policy's attempts is refused before
/// anything is written to it.
fn open_records(path: &Path, policy: Option<&str>) -> Result<(Vec<AttemptRecord>, std::fs::File)> {
    let (records, tail) = scan_records(path)?;
    if let Some(ours) = policy {
        if let Some(theirs) = records
            .iter()
            .filter_map(|r| r.policy.as_deref())
            .find(|p| *p != ours)
        {
            return Err(Error::Input(format!(
                "{} holds attempts of another policy ({theirs}; this run's is {ours}); its \
                 attempts would be kept and counted as this one's: name another output file, \
                 or remove it to evaluate anew (nothing was written to it)",
                path.display()
            )));
        }
    }
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| Error::io(path, e))?;
    match tail {
        Tail::Clean => {}
        Tail::Unterminated => f.write_all(b"\n").map_err(|e| Error::io(path, e))?,
        Tail::Torn(at) => {
            tracing::warn!(
                "{}: its last line is a torn record (a run stopped while writing it); cut off",
                path.display()
            );
            f.set_len(at).map_err(|e| Error::io(path, e))?;
        }
    }
    Ok((records, f))
}

/// A termination's name, as in the records (`invalid_format`).
fn name(t: Termination) -> String {
    serde_json::to_value(t)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_default()
}

/// Summarizes attempt records for `tasks` (records of other tasks ignored;
/// the last record of a (task, attempt) wins).
pub fn summarize(tasks: &[Task], records: &[AttemptRecord]) -> EvalSummary {
    let mut latest: BTreeMap<(String, usize), &AttemptRecord> = BTreeMap::new();
    for r in records {
        latest.insert((r.task_id.clone(), r.attempt), r);
    }
    let mut terminations = BTreeMap::new();
    let mut per_task = Vec::new();
    let mut means = Vec::new();
    let mut attempts = 0;
    let mut first_masked = None;
    for task in tasks {
        let rs: Vec<&&AttemptRecord> = latest
            .iter()
            .filter(|((id, _), _)| *id == task.instance_id)
            .map(|(_, r)| r)
            .collect();
        for r in &rs {
            *terminations.entry(name(r.termination)).or_insert(0) += 1;
        }
        attempts += rs.len();
        if first_masked.is_none() {
            first_masked = rs.iter().find(|r| r.masked).map(|r| {
                let term = name(r.termination);
                format!("{} attempt {}: {term}: {}", r.task_id, r.attempt, r.detail)
            });
        }
        let unmasked: Vec<&&&AttemptRecord> = rs.iter().filter(|r| !r.masked).collect();
        let solved = unmasked.iter().filter(|r| r.reward >= 1.0).count();
        let p = (!unmasked.is_empty())
            .then(|| unmasked.iter().map(|r| r.reward).sum::<f64>() / unmasked.len() as f64);
        if let Some(p) = p {
            means.push(p);
        }
        per_task.push(TaskResult {
            task_id: task.instance_id.clone(),
            attempts: unmasked.len(),
            solved,
            pass_at_1: p,
        });
    }
    let n = means.len();
    let mean = if n > 0 {
        means.iter().sum::<f64>() / n as f64
    } else {
        0.0
    };
    let stderr = if n > 1 {
        let var = means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
        (var / n as f64).sqrt()
    } else {
        0.0
    };
    EvalSummary {
        tasks: n,
        attempts,
        pass_at_1: mean,
        stderr,
        terminations,
        per_task,
        first_masked,
    }
}

/// The tasks of `tasks` (in their order) that `summary` shows solved in at
/// least `min_solved` (at least 1) unmasked attempts, at most `limit` of
/// them (0: all). This is how a pool of tasks a model can solve is chosen
/// by sampling: the overfit stress test and the demo's training pool.
pub fn select_solved<'a>(
    tasks: &'a [Task],
    summary: &EvalSummary,
    min_solved: usize,
    limit: usize,
) -> Vec<&'a Task> {
    let solved: std::collections::HashMap<&str, usize> = summary
        .per_task
        .iter()
        .map(|r| (r.task_id.as_str(), r.solved))
        .collect();
    let mut kept: Vec<&Task> = tasks
        .iter()
        .filter(|t| solved.get(t.instance_id.as_str()).copied().unwrap_or(0) >= min_solved.max(1))
        .collect();
    if limit > 0 {
        kept.truncate(limit);
    }
    kept
}

/// The policy for one attempt at a task, called once per rollout (usually
/// the same shared policy for every task).
pub type PolicyFor<'a> = &'a (dyn Fn(&Task) -> Arc<dyn Policy> + Sync);

/// Runs the attempts of `tasks` not yet in `out` (unmasked), appending each
/// as it finishes; full trajectories go to `traj_out` when given.
pub async fn run_eval(
    harness: &Harness,
    policy_for: PolicyFor<'_>,
    backend: &dyn Backend,
    tasks: &[Task],
    cfg: &EvalConfig,
    out: &Path,
    traj_out: Option<&Path>,
) -> Result<EvalSummary> {
    cfg.check()?;
    let (records, mut out_file) = open_records(out, cfg.policy.as_deref())?;
    let done: HashSet<(String, usize)> = records
        .into_iter()
        .filter(|r| !r.masked)
        .map(|r| (r.task_id, r.attempt))
        .collect();
    let todo: Vec<(&Task, usize)> = tasks
        .iter()
        .flat_map(|t| (0..cfg.attempts).map(move |a| (t, a)))
        .filter(|(t, a)| !done.contains(&(t.instance_id.clone(), *a)))
        .collect();
    // A resume is said, not silent: the kept attempts are an earlier run's,
    // whatever policy made them.
    let kept = tasks.len() * cfg.attempts - todo.len();
    if kept > 0 {
        tracing::warn!(
            "{}: {kept} attempts already recorded there are kept and not run again (to \
             evaluate anew, remove the file or name another one)",
            out.display()
        );
    }
    let open = |p: &Path| {
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(p)
            .map_err(|e| Error::io(p, e))
    };
    let mut traj_file = match traj_out {
        Some(p) => Some(open(p)?),
        None => None,
    };
    let mut stream = futures_util::stream::iter(todo.into_iter().map(|(t, a)| async move {
        let policy = policy_for(t);
        harness.rollout(policy.as_ref(), backend, t, a).await
    }))
    .buffer_unordered(cfg.concurrency.max(1));
    while let Some(traj) = stream.next().await {
        // One write per record, newline included, so that a crash leaves
        // at most one torn line, the last.
        let record = AttemptRecord {
            policy: cfg.policy.clone(),
            ..AttemptRecord::from(&traj)
        };
        let mut line = serde_json::to_string(&record).map_err(|e| Error::Input(e.to_string()))?;
        line.push('\n');
        out_file
            .write_all(line.as_bytes())
            .map_err(|e| Error::io(out, e))?;
        if let (Some(f), Some(p)) = (traj_file.as_mut(), traj_out) {
            let mut line = serde_json::to_string(&traj).map_err(|e| Error::Input(e.to_string()))?;
            line.push('\n');
            f.write_all(line.as_bytes()).map_err(|e| Error::io(p, e))?;
        }
    }
    // The summary is of the attempts asked for: an earlier run's with more
    // attempts per task stay in the file but not in this count.
    let records = read_records(out)?;
    let ids: HashSet<&str> = tasks.iter().map(|t| t.instance_id.as_str()).collect();
    let (mut beyond, mut others) = (0, 0);
    for r in &records {
        if !ids.contains(r.task_id.as_str()) {
            others += 1;
        } else if r.attempt >= cfg.attempts {
            beyond += 1;
        }
    }
    if beyond > 0 {
        tracing::warn!(
            "{}: {beyond} records of attempts past the {} per task asked for are left out of the summary",
            out.display(),
            cfg.attempts
        );
    }
    if others > 0 {
        tracing::warn!(
            "{}: {others} records of tasks not in this task file are left out of the summary",
            out.display()
        );
    }
    let asked: Vec<AttemptRecord> = records
        .into_iter()
        .filter(|r| r.attempt < cfg.attempts)
        .collect();
    Ok(summarize(tasks, &asked))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_evaluation_of_no_attempts_is_refused() {
        EvalConfig::default().check().unwrap();
        for (attempts, concurrency) in [(0, 2), (4, 0)] {
            let cfg = EvalConfig {
                attempts,
                concurrency,
                policy: None,
            };
            assert!(cfg.check().is_err(), "{attempts} {concurrency}");
        }
    }

    fn rec(id: &str, attempt: usize, reward: f64, term: Termination) -> AttemptRecord {
        AttemptRecord {
            task_id: id.into(),
            attempt,
            reward,
            termination: term,
            masked: term.masked(),
            turns: 1,
            tokens: 1,
            wall_secs: 0.0,
            detail: String::new(),
            policy: None,
        }
    }

    fn task(id: &str) -> Task {
        Task {
            instance_id: id.into(),
            problem_statement: String::new(),
            patch: String::new(),
            test_patch: String::new(),
            fail_to_pass: vec!["t".into()],
            pass_to_pass: vec![],
            image: None,
            repo: None,
            workdir: "/testbed".into(),
            test_cmd: "pytest".into(),
            log_parser: "pytest".into(),
            meta: Default::default(),
        }
    }

    #[test]
    fn pass_at_1_and_stderr() {
        let tasks = [task("a"), task("b")];
        let recs = [
            rec("a", 0, 1.0, Termination::Submitted),
            rec("a", 1, 0.0, Termination::InvalidFormat),
            rec("b", 0, 1.0, Termination::Submitted),
            rec("b", 1, 0.0, Termination::Infra),
        ];
        let s = summarize(&tasks, &recs);
        // a: 0.5, b: 1.0 (the infra attempt is masked).
        assert!((s.pass_at_1 - 0.75).abs() < 1e-12);
        assert!((s.stderr - 0.25).abs() < 1e-12);
        assert_eq!(s.terminations["infra"], 1);
        assert_eq!(s.attempts, 4);
    }

    #[test]
    fn select_keeps_solved_tasks_in_order_up_to_the_limit() {
        let tasks = [task("a"), task("b"), task("c"), task("d")];
        let recs = [
            rec("a", 0, 0.0, Termination::Submitted),
            rec("b", 0, 1.0, Termination::Submitted),
            rec("b", 1, 1.0, Termination::Submitted),
            rec("c", 0, 1.0, Termination::Submitted),
            // Masked attempts never count as solved.
            rec("d", 0, 1.0, Termination::Infra),
        ];
        let s = summarize(&tasks, &recs);
        let ids = |v: Vec<&Task>| v.iter().map(|t| t.instance_id.clone()).collect::<Vec<_>>();
        assert_eq!(ids(select_solved(&tasks, &s, 1, 0)), ["b", "c"]);
        assert_eq!(ids(select_solved(&tasks, &s, 0, 1)), ["b"]);
        assert_eq!(ids(select_solved(&tasks, &s, 2, 0)), ["b"]);
    }

    #[test]
    fn torn_last_line_is_ignored() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("e.jsonl");
        let line = serde_json::to_string(&rec("a", 0, 1.0, Termination::Submitted)).unwrap();
        std::fs::write(&p, format!("{line}\n{{\"task_id\": \"a\", \"att")).unwrap();
        assert_eq!(read_records(&p).unwrap().len(), 1);
        std::fs::write(&p, format!("oops\n{line}\n")).unwrap();
        assert!(read_records(&p).is_err());
    }

    /// Appends one record the way `run_eval` does, after `open_records`.
    fn append(p: &Path, r: &AttemptRecord) -> Vec<AttemptRecord> {
        let (before, mut f) = open_records(p, None).unwrap();
        let mut line = serde_json::to_string(r).unwrap();
        line.push('\n');
        f.write_all(line.as_bytes()).unwrap();
        drop(f);
        assert_eq!(read_records(p).unwrap().len(), before.len() + 1);
        before
    }

    /// A resumed evaluation after a crash mid-record: the torn line is cut
    /// off before the next record, which starts a line of its own, and the
    /// file reads back whole (it used to glue the new record onto the torn
    /// one and make every later read fail).
    #[test]
    fn a_resume_cuts_the_torn_line_before_appending() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("e.jsonl");
        let a = serde_json::to_string(&rec("a", 0, 1.0, Termination::Submitted)).unwrap();
        let b = rec("b", 0, 0.0, Termination::Submitted);
        std::fs::write(&p, format!("{a}\n{}", &a[..a.len() / 2])).unwrap();
        assert_eq!(append(&p, &b).len(), 1);
        let text = std::fs::read_to_string(&p).unwrap();
        assert_eq!(text.lines().count(), 2, "{text}");
        assert!(
            text.starts_with(&format!("{a}\n{{\"task_id\":\"b\"")),
            "{text}"
        );
        // A last record written whole but for its newline keeps its place.
        std::fs::write(&p, &a).unwrap();
        assert_eq!(append(&p, &b).len(), 1);
        assert_eq!(read_records(&p).unwrap().len(), 2);
        // Blank lines are not records, and not errors.
        std::fs::write(&p, format!("\n{a}\n\n")).unwrap();
        assert_eq!(append(&p, &b).len(), 1);
    }

    /// A file that is not an evaluation's records (a note, a task file) is
    /// refused before anything runs, and left as it was: even when its
    /// only line is its last.
    #[test]
    fn a_file_that_is_not_records_is_refused_untouched() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notes.txt");
        for text in [
            "my important notes, not JSON\n",
            "my important notes, no newline",
            "{\"instance_id\": \"t\"}",
            "{\"task_id\": \"a\"}\n",
        ] {
            std::fs::write(&p, text).unwrap();
            let err = open_records(&p, None).unwrap_err().to_string();
            assert!(err.contains("not an attempt record"), "{text}: {err}");
            assert_eq!(std::fs::read_to_string(&p).unwrap(), text);
        }
    }

    #[test]
    fn an_evaluation_that_graded_nothing_says_why() {
        let tasks = [task("a"), task("b")];
        let mut masked = rec("a", 0, 0.0, Termination::Infra);
        masked.detail = "no root file system".into();
        let s = summarize(
            &tasks,
            &[masked, rec("b", 0, 0.0, Termination::PolicyError)],
        );
        let why = s.ungraded().unwrap();
        assert!(why.contains("all 2 were masked"), "{why}");
        assert!(
            why.contains("a attempt 0: infra: no root file system"),
            "{why}"
        );
        assert!(why.contains("1 infra, 1 policy_error"), "{why}");
        assert!(summarize(&tasks, &[]).ungraded().is_some());
        let s = summarize(&tasks, &[rec("a", 0, 0.0, Termination::Submitted)]);
        assert_eq!(s.ungraded(), None);
    }
}
