//! Grading: the agent's diff and the hidden test patch, applied in a fresh
//! sandbox from the same snapshot, the test command run between markers, the
//! log parsed, and a reward decided by fixed rules.
//!
//! Nothing the agent did besides its diff reaches the grade: its sandbox is
//! never reused, and the files the test patch touches are reset to the
//! snapshot before the test patch applies, so an agent cannot pre-edit the
//! hidden tests. Rules ([`judge`]): a fail-to-pass or pass-to-pass test that
//! is absent, skipped or errored counts as failed; a log that parses to
//! nothing is an infrastructure error (the trainer masks it), except when
//! pytest says the tests did not collect (the agent's change broke an
//! import or the syntax: its failure, reward 0, never masked); a non-zero
//! exit with no failures in the log is rejected as spoofed; a run killed at
//! its timeout or for memory is the agent's failure. Reward 1 only when
//! every listed test passed. Not a task loader.

use crate::logparse::{self, TestResults, TestStatus};
use crate::{Backend, Error, ExecRequest, Policy, Result, Sandbox, Snapshot};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// How a task is graded.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct TestSpec {
    /// Shell command that runs the tests in the workdir, e.g.
    /// `python3 -m pytest -rA -v tests/test_x.py`.
    pub test_command: String,
    /// Unified diff adding the hidden tests; never shown to the agent.
    #[serde(default)]
    pub test_patch: String,
    /// Tests that must go from failing to passing.
    #[serde(default)]
    pub fail_to_pass: Vec<String>,
    /// Tests that must keep passing.
    #[serde(default)]
    pub pass_to_pass: Vec<String>,
    /// Registered log parser name. Default `pytest`.
    #[serde(default = "default_parser")]
    pub log_parser: String,
    /// Limit of the test run, seconds. Default 900.
    #[serde(default = "default_test_timeout")]
    pub timeout_secs: f64,
}

fn default_parser() -> String {
    "pytest".into()
}

fn default_test_timeout() -> f64 {
    900.0
}

/// The verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum GradeOutcome {
    /// Every listed test passed: reward 1.
    Resolved,
    /// Some listed test did not pass: reward 0.
    Unresolved,
    /// The agent's diff did not apply: reward 0.
    PatchFailed,
    /// Non-zero exit but no failure in the log: reward 0, flagged.
    SpoofedLog,
    /// The grade could not be determined (the task or the machinery failed):
    /// masked by the trainer, never a reward.
    InfraError,
}

/// A grade and what it rests on.
#[derive(Debug, Clone, Serialize)]
pub struct GradeReport {
    pub outcome: GradeOutcome,
    pub reward: f64,
    pub exit_code: Option<i64>,
    pub timed_out: bool,
    pub memory_exceeded: bool,
    /// Listed tests that did not pass, with the status seen (None: absent).
    pub failing: Vec<(String, Option<TestStatus>)>,
    pub tests: TestResults,
    pub detail: String,
    /// The test log between the markers, capped (head and tail).
    pub log: String,
}

impl GradeReport {
    fn early(outcome: GradeOutcome, detail: String) -> Self {
        GradeReport {
            outcome,
            reward: 0.0,
            exit_code: None,
            timed_out: false,
            memory_exceeded: false,
            failing: vec![],
            tests: TestResults::new(),
            detail,
            log: String::new(),
        }
    }
}

/// Whether a pytest log says collection failed (a module under test that
/// no longer imports or parses). Valid tasks collect with the gold patch, so
/// this is the change's doing, not the machinery's.
pub fn collection_failed(log: &str) -> bool {
    log.contains("ERROR collecting")
        || log.contains("errors during collection")
        || log.contains("error during collection")
        || log.contains("ImportError while importing test module")
}

/// Applies the rules to one finished test run.
pub fn judge(
    spec: &TestSpec,
    exit_code: Option<i64>,
    timed_out: bool,
    memory_exceeded: bool,
    tests: &TestResults,
) -> (GradeOutcome, Vec<(String, Option<TestStatus>)>, String) {
    let failing: Vec<(String, Option<TestStatus>)> = spec
        .fail_to_pass
        .iter()
        .chain(spec.pass_to_pass.iter())
        .filter_map(|t| {
            let s = tests.get(t).copied();
            (s != Some(TestStatus::Passed)).then(|| (t.clone(), s))
        })
        .collect();
    if timed_out {
        return (
            GradeOutcome::Unresolved,
            failing,
            "test run timed out".into(),
        );
    }
    if memory_exceeded {
        return (
            GradeOutcome::Unresolved,
            failing,
            "test run exceeded memory".into(),
        );
    }
    if tests.is_empty() {
        return (
            GradeOutcome::InfraError,
            failing,
            format!("test log parsed to nothing (exit code {exit_code:?})"),
        );
    }
    let any_failure = tests
        .values()
        .any(|s| matches!(s, TestStatus::Failed | TestStatus::Error));
    if exit_code != Some(0) && !any_failure {
        return (
            GradeOutcome::SpoofedLog,
            failing,
            format!("exit code {exit_code:?} with no failure in the log"),
        );
    }
    if failing.is_empty() {
        (
            GradeOutcome::Resolved,
            failing,
            "all listed tests passed".into(),
        )
    } else {
        let n = failing.len();
        (
            GradeOutcome::Unresolved,
            failing,
            format!("{n} listed tests did not pass"),
        )
    }
}

/// Files a unified diff touches (both sides of renames), from its
/// `diff --git a/X b/Y` headers and `---`/`+++` lines.
pub fn patch_paths(patch: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |p: &str| {
        let p = p.trim();
        if p != "/dev/null" && !p.is_empty() && !out.iter().any(|x| x == p) {
            out.push(p.to_string());
        }
    };
    for line in patch.lines() {
        if let Some(rest) = line
            .strip_prefix("--- a/")
            .or_else(|| line.strip_prefix("+++ b/"))
        {
            push(rest.split('\t').next().unwrap_or(rest));
        } else if let Some(rest) = line.strip_prefix("diff --git a/") {
            if let Some((a, b)) = rest.split_once(" b/") {
                push(a);
                push(b);
            }
        }
    }
    out
}

fn nonce() -> String {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{:x}{:x}", t, std::process::id())
}

/// Grades already given, keyed by everything a grade is decided by: the
/// image, the snapshot's commit, the test spec and the agent's diff. An RL
/// run grades the same fix of the same task many times (the attempts of a
/// group, every epoch); a kept grade skips a sandbox and a test run. Only
/// verdicts the tests reached in time are kept (resolved, unresolved, a
/// diff that did not apply), never an infrastructure error, a timeout or a
/// memory kill, so the machinery's failures are retried, not remembered.
/// For tests that are deterministic (a task's validation runs them twice)
/// a kept grade is the grade a new run would give.
pub struct GradeCache {
    entries: Mutex<HashMap<[u8; 32], GradeReport>>,
    capacity: usize,
    hits: AtomicU64,
    misses: AtomicU64,
}

/// A kept report's log is cut to this many bytes (the grade does not read
/// it again; memory stays bounded by `capacity` small entries).
const CACHED_LOG_BYTES: usize = 2048;

impl GradeCache {
    /// A cache of at most `capacity` grades (when full, it starts over).
    pub fn new(capacity: usize) -> Self {
        GradeCache {
            entries: Mutex::new(HashMap::new()),
            capacity: capacity.max(1),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
        }
    }

    /// Grades served from the cache so far.
    pub fn hits(&self) -> u64 {
        self.hits.load(Ordering::Relaxed)
    }

    /// Grades that ran the tests so far.
    pub fn misses(&self) -> u64 {
        self.misses.load(Ordering::Relaxed)
    }

    fn key(image: &str, commit: &str, spec: &TestSpec, agent_diff: &str) -> [u8; 32] {
        use sha2::{Digest, Sha256};
        let mut h = Sha256::new();
        let spec = serde_json::to_string(spec).unwrap_or_default();
        for part in [image, commit, &spec, agent_diff] {
            h.update((part.len() as u64).to_le_bytes());
            h.update(part.as_bytes());
        }
        h.finalize().into()
    }

    fn get(&self, key: &[u8; 32]) -> Option<GradeReport> {
        let found = self.entries.lock().ok()?.get(key).cloned();
        let counter = if found.is_some() {
            &self.hits
        } else {
            &self.misses
        };
        counter.fetch_add(1, Ordering::Relaxed);
        found
    }

    fn put(&self, key: [u8; 32], report: &GradeReport) {
        let keep = matches!(
            report.outcome,
            GradeOutcome::Resolved | GradeOutcome::Unresolved | GradeOutcome::PatchFailed
        ) && !report.timed_out
            && !report.memory_exceeded;
        if !keep {
            return;
        }
        let mut kept = report.clone();
        if kept.log.len() > CACHED_LOG_BYTES {
            let mut cut = CACHED_LOG_BYTES;
            while !kept.log.is_char_boundary(cut) {
                cut -= 1;
            }
            kept.log.truncate(cut);
            kept.log.push_str("\n[log cut: a cached grade]\n");
        }
        if let Ok(mut entries) = self.entries.lock() {
            if entries.len() >= self.capacity {
                entries.clear();
            }
            entries.insert(key, kept);
        }
    }
}

/// [`grade`] through a [`GradeCache`]: a grade already given for the same
/// image, snapshot, spec and diff is returned without running anything.
/// The flag says whether it was.
pub async fn grade_cached(
    cache: &GradeCache,
    backend: &dyn Backend,
    snapshot: &Arc<Snapshot>,
    image: &str,
    policy: &Policy,
    agent_diff: &str,
    spec: &TestSpec,
) -> Result<(GradeReport, bool)> {
    let key = GradeCache::key(image, snapshot.commit(), spec, agent_diff);
    if let Some(report) = cache.get(&key) {
        return Ok((report, true));
    }
    let report = grade(backend, snapshot, image, policy, agent_diff, spec).await?;
    cache.put(key, &report);
    Ok((report, false))
}

/// Grades `agent_diff` against `spec` in a fresh sandbox that is removed
/// afterwards. `Err` only for failures of the machinery before a verdict
/// (the caller treats it like [`GradeOutcome::InfraError`]).
pub async fn grade(
    backend: &dyn Backend,
    snapshot: &Arc<Snapshot>,
    image: &str,
    policy: &Policy,
    agent_diff: &str,
    spec: &TestSpec,
) -> Result<GradeReport> {
    if spec.fail_to_pass.is_empty() && spec.pass_to_pass.is_empty() {
        return Err(Error::InvalidInput("a test spec lists no tests".into()));
    }
    let parser = logparse::parser(&spec.log_parser)
        .ok_or_else(|| Error::InvalidInput(format!("unknown log parser {}", spec.log_parser)))?;
    let sandbox = backend.start(snapshot, image, policy).await?;
    let result = grade_in(sandbox.as_ref(), parser, agent_diff, spec).await;
    let closed = sandbox.close().await;
    let report = result?;
    closed?;
    Ok(report)
}

async fn grade_in(
    sb: &dyn Sandbox,
    parser: &dyn logparse::LogParser,
    agent_diff: &str,
    spec: &TestSpec,
) -> Result<GradeReport> {
    let applied = sb.apply_patch(agent_diff).await?;
    if !applied.applied {
        return Ok(GradeReport::early(
            GradeOutcome::PatchFailed,
            format!("the diff did not apply: {}", applied.output.trim()),
        ));
    }
    if !spec.test_patch.trim().is_empty() {
        // Reset whatever the agent did to the files the hidden tests own.
        let mut argv = vec![
            "sh".to_string(),
            "-c".to_string(),
            r#"c=$1; shift; for p in "$@"; do
  if git cat-file -e "$c:$p" 2>/dev/null; then git checkout -q "$c" -- "$p" || exit 1
  else rm -rf -- "$p"; fi; done"#
                .to_string(),
            "sh".to_string(),
            sb.snapshot_commit().to_string(),
        ];
        argv.extend(patch_paths(&spec.test_patch));
        let r = sb.exec(ExecRequest::argv(argv)).await?;
        if !r.success() {
            return Ok(GradeReport::early(
                GradeOutcome::InfraError,
                format!("resetting test files failed: {}", r.stderr.text().trim()),
            ));
        }
        let t = sb.apply_patch(&spec.test_patch).await?;
        if !t.applied {
            return Ok(GradeReport::early(
                GradeOutcome::InfraError,
                format!("test patch did not apply: {}", t.output.trim()),
            ));
        }
    }
    let n = nonce();
    let begin = format!("ARCTICD_TESTS_BEGIN_{n}");
    let end = format!("ARCTICD_TESTS_END_{n}");
    let script = format!(
        "echo {begin}; {{ {cmd}\n}} 2>&1; rc=$?; echo {end}; exit $rc",
        cmd = spec.test_command
    );
    let r = sb
        .exec(
            ExecRequest::shell(script)
                .timeout(spec.timeout_secs)
                .output_cap(8 * 1024 * 1024),
        )
        .await?;
    let out = r.stdout.text();
    let start = out.find(&begin).map(|i| i + begin.len()).unwrap_or(0);
    let stop = out.rfind(&end).filter(|&i| i >= start).unwrap_or(out.len());
    let log = out[start..stop].to_string();
    let tests = parser.parse(&log);
    let (mut outcome, failing, mut detail) =
        judge(spec, r.exit_code, r.timed_out, r.memory_exceeded, &tests);
    if outcome == GradeOutcome::InfraError && collection_failed(&log) {
        outcome = GradeOutcome::Unresolved;
        detail = format!("the tests did not collect after the change ({detail})");
    }
    Ok(GradeReport {
        outcome,
        reward: if outcome == GradeOutcome::Resolved {
            1.0
        } else {
            0.0
        },
        exit_code: r.exit_code,
        timed_out: r.timed_out,
        memory_exceeded: r.memory_exceeded,
        failing,
        tests,
        detail,
        log,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Only verdicts reached in time are kept; the key covers every input;
    /// a kept log is cut.
    #[test]
    fn grade_cache_keeps_verdicts_not_machinery_failures() {
        let cache = GradeCache::new(8);
        let report = |outcome, timed_out| GradeReport {
            timed_out,
            log: "x".repeat(10_000),
            ..GradeReport::early(outcome, String::new())
        };
        let k = |diff: &str| GradeCache::key("img", "c0ffee", &spec(), diff);
        cache.put(k("a"), &report(GradeOutcome::Resolved, false));
        cache.put(k("b"), &report(GradeOutcome::InfraError, false));
        cache.put(k("c"), &report(GradeOutcome::Unresolved, true));
        cache.put(k("d"), &report(GradeOutcome::PatchFailed, false));
        let a = cache.get(&k("a")).expect("a verdict is kept");
        assert_eq!(a.outcome, GradeOutcome::Resolved);
        assert!(a.log.len() < 2200 && a.log.ends_with("[log cut: a cached grade]\n"));
        assert!(cache.get(&k("b")).is_none(), "an infra error is retried");
        assert!(cache.get(&k("c")).is_none(), "a timeout is retried");
        assert!(cache.get(&k("d")).is_some());
        assert_eq!((cache.hits(), cache.misses()), (2, 2));
        // Any input changes the key.
        let mut other = spec();
        other.fail_to_pass.push("t.py::more".into());
        let keys = [
            k("a"),
            GradeCache::key("img2", "c0ffee", &spec(), "a"),
            GradeCache::key("img", "c0ffef", &spec(), "a"),
            GradeCache::key("img", "c0ffee", &other, "a"),
            // No ambiguity where one part ends and the next begins.
            GradeCache::key("im", "gc0ffee", &spec(), "a"),
        ];
        for (i, x) in keys.iter().enumerate() {
            for y in &keys[i + 1..] {
                assert_ne!(x, y);
            }
        }
        // Full: it starts over instead of growing.
        let small = GradeCache::new(2);
        for d in ["1", "2", "3"] {
            small.put(k(d), &report(GradeOutcome::Resolved, false));
        }
        assert!(small.get(&k("3")).is_some() && small.get(&k("1")).is_none());
    }

    fn spec() -> TestSpec {
        TestSpec {
            test_command: "pytest".into(),
            test_patch: String::new(),
            fail_to_pass: vec!["t.py::f2p".into()],
            pass_to_pass: vec!["t.py::p2p".into()],
            log_parser: "pytest".into(),
            timeout_secs: 10.0,
        }
    }

    fn results(pairs: &[(&str, TestStatus)]) -> TestResults {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn all_listed_passing_is_resolved() {
        let r = results(&[
            ("t.py::f2p", TestStatus::Passed),
            ("t.py::p2p", TestStatus::Passed),
        ]);
        assert_eq!(
            judge(&spec(), Some(0), false, false, &r).0,
            GradeOutcome::Resolved
        );
    }

    #[test]
    fn missing_skipped_or_errored_f2p_fails() {
        for s in [
            None,
            Some(TestStatus::Skipped),
            Some(TestStatus::Error),
            Some(TestStatus::XFailed),
        ] {
            let mut r = results(&[
                ("t.py::p2p", TestStatus::Passed),
                ("t.py::other", TestStatus::Failed),
            ]);
            if let Some(s) = s {
                r.insert("t.py::f2p".into(), s);
            }
            let (o, failing, _) = judge(&spec(), Some(1), false, false, &r);
            assert_eq!(o, GradeOutcome::Unresolved, "{s:?}");
            assert_eq!(failing, vec![("t.py::f2p".to_string(), s)]);
        }
    }

    #[test]
    fn empty_log_is_infra_error() {
        assert_eq!(
            judge(&spec(), Some(2), false, false, &TestResults::new()).0,
            GradeOutcome::InfraError
        );
    }

    #[test]
    fn collection_errors_are_the_changes_failure() {
        let log = "==== ERRORS ====\n____ ERROR collecting tests/test_x.py ____\nE   SyntaxError: invalid syntax\n!!!! Interrupted: 1 error during collection !!!!";
        assert!(collection_failed(log));
        assert!(!collection_failed("bash: python3: command not found"));
    }

    #[test]
    fn nonzero_exit_without_failures_is_spoofed() {
        let r = results(&[
            ("t.py::f2p", TestStatus::Passed),
            ("t.py::p2p", TestStatus::Passed),
        ]);
        assert_eq!(
            judge(&spec(), Some(1), false, false, &r).0,
            GradeOutcome::SpoofedLog
        );
        assert_eq!(
            judge(&spec(), None, false, false, &r).0,
            GradeOutcome::SpoofedLog
        );
    }

    #[test]
    fn timeouts_and_memory_kills_are_unresolved() {
        let r = results(&[
            ("t.py::f2p", TestStatus::Passed),
            ("t.py::p2p", TestStatus::Passed),
        ]);
        assert_eq!(
            judge(&spec(), None, true, false, &r).0,
            GradeOutcome::Unresolved
        );
        assert_eq!(
            judge(&spec(), Some(137), false, true, &r).0,
            GradeOutcome::Unresolved
        );
    }

    #[test]
    fn finds_patch_paths() {
        let p = "diff --git a/tests/test_x.py b/tests/test_x.py\n--- a/tests/test_x.py\n+++ b/tests/test_x.py\n\
                 diff --git a/new.py b/new.py\nnew file mode 100644\n--- /dev/null\n+++ b/new.py\n";
        assert_eq!(patch_paths(p), vec!["tests/test_x.py", "new.py"]);
    }
}
