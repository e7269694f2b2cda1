//! Test log parsers: from a test command's output to per-test results.
//!
//! A registry maps a parser name to a parser so task formats can name theirs
//! (`pytest` first; others are added with [`register`]-style entries in
//! [`parser`]). Parsers only read text; what counts as a pass for a reward is
//! decided in [`crate::grading`]. Follows the SWE-bench log-parser idea: the
//! `-rA` short summary of pytest lists every test with its outcome.

use serde::Serialize;
use std::collections::BTreeMap;

/// Outcome of one test as the log reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TestStatus {
    Passed,
    Failed,
    Error,
    Skipped,
    /// Expected failure that failed (pytest `XFAIL`).
    XFailed,
    /// Expected failure that passed (pytest `XPASS`).
    XPassed,
}

/// Test id to status.
pub type TestResults = BTreeMap<String, TestStatus>;

/// A test log parser.
pub trait LogParser: Send + Sync {
    fn name(&self) -> &'static str;
    fn parse(&self, log: &str) -> TestResults;
}

/// The parser registered under `name`.
pub fn parser(name: &str) -> Option<&'static dyn LogParser> {
    static PYTEST: PytestParser = PytestParser;
    match name {
        "pytest" => Some(&PYTEST),
        _ => None,
    }
}

/// Names of every registered parser.
pub fn parser_names() -> &'static [&'static str] {
    &["pytest"]
}

/// pytest with `-rA` (short summary of every outcome), also reading the
/// verbose `path::test PASSED [ 50%]` lines of `-v`. When a test appears in
/// both, the summary wins; a worse outcome never gets overwritten by a
/// better one from a repeated line.
pub struct PytestParser;

fn status_word(w: &str) -> Option<TestStatus> {
    Some(match w {
        "PASSED" => TestStatus::Passed,
        "FAILED" => TestStatus::Failed,
        "ERROR" => TestStatus::Error,
        "SKIPPED" => TestStatus::Skipped,
        "XFAIL" => TestStatus::XFailed,
        "XPASS" => TestStatus::XPassed,
        _ => return None,
    })
}

fn rank(s: TestStatus) -> u8 {
    match s {
        TestStatus::Passed | TestStatus::XFailed => 0,
        TestStatus::Skipped => 1,
        TestStatus::XPassed => 2,
        TestStatus::Failed => 3,
        TestStatus::Error => 4,
    }
}

fn record(map: &mut TestResults, id: &str, status: TestStatus) {
    let id = id.trim();
    if id.is_empty() || !id.contains("::") {
        return;
    }
    map.entry(id.to_string())
        .and_modify(|old| {
            if rank(status) > rank(*old) {
                *old = status;
            }
        })
        .or_insert(status);
}

impl LogParser for PytestParser {
    fn name(&self) -> &'static str {
        "pytest"
    }

    fn parse(&self, log: &str) -> TestResults {
        let mut summary = TestResults::new();
        let mut verbose = TestResults::new();
        let mut in_summary = false;
        for raw in log.lines() {
            let line = raw.trim_end();
            if line.starts_with('=') && line.contains("short test summary info") {
                in_summary = true;
                continue;
            }
            if in_summary && line.starts_with('=') {
                in_summary = false;
                continue;
            }
            if in_summary {
                // `STATUS id` or `STATUS id - message`; SKIPPED lines carry a
                // location, not an id, and are skipped by `record`.
                let Some((word, rest)) = line.split_once(' ') else {
                    continue;
                };
                if let Some(status) = status_word(word) {
                    let id = rest.split(" - ").next().unwrap_or(rest);
                    record(&mut summary, id, status);
                }
                continue;
            }
            // Verbose form: `path::test STATUS [ NN%]` (optionally followed by
            // the percentage).
            let mut words = line.split_whitespace();
            if let (Some(id), Some(word)) = (words.next(), words.next()) {
                if let Some(status) = status_word(word) {
                    record(&mut verbose, id, status);
                }
            }
        }
        for (id, s) in verbose {
            summary.entry(id).or_insert(s);
        }
        summary
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LOG: &str = "\
============================= test session starts ==============================
collected 5 items

tests/test_a.py::test_ok PASSED                                          [ 20%]
tests/test_a.py::test_bad FAILED                                         [ 40%]
tests/test_a.py::test_param[1-2] PASSED                                  [ 60%]

=================================== FAILURES ===================================
___________________________________ test_bad ___________________________________
E   assert 1 == 2
=========================== short test summary info ============================
PASSED tests/test_a.py::test_ok
PASSED tests/test_a.py::test_param[1-2]
PASSED tests/test_a.py::test_param[a b - c]
FAILED tests/test_a.py::test_bad - assert 1 == 2
ERROR tests/test_b.py::test_fixture - RuntimeError: boom
SKIPPED [1] tests/test_c.py:10: no gpu
XFAIL tests/test_a.py::test_xf - reason
XPASS tests/test_a.py::test_xp
==================== 1 failed, 3 passed, 1 error in 0.12s =====================
";

    #[test]
    fn parses_summary_and_verbose_lines() {
        let r = parser("pytest").unwrap().parse(LOG);
        assert_eq!(r["tests/test_a.py::test_ok"], TestStatus::Passed);
        assert_eq!(r["tests/test_a.py::test_bad"], TestStatus::Failed);
        assert_eq!(r["tests/test_a.py::test_param[1-2]"], TestStatus::Passed);
        assert_eq!(r["tests/test_b.py::test_fixture"], TestStatus::Error);
        assert_eq!(r["tests/test_a.py::test_xf"], TestStatus::XFailed);
        assert_eq!(r["tests/test_a.py::test_xp"], TestStatus::XPassed);
        // Ids containing " - " are cut at the first separator; the verbose
        // line is not there to correct it, which is why -v is recommended.
        assert!(r.contains_key("tests/test_a.py::test_param[a b"));
        assert_eq!(r.len(), 7);
    }

    #[test]
    fn a_repeated_line_cannot_upgrade_a_failure() {
        let log = "=== short test summary info ===\nFAILED t.py::x\nPASSED t.py::x\n";
        let r = PytestParser.parse(log);
        assert_eq!(r["t.py::x"], TestStatus::Failed);
    }

    #[test]
    fn unrelated_text_parses_to_nothing() {
        assert!(PytestParser
            .parse("Traceback: ImportError\nPASSED\n")
            .is_empty());
        assert!(parser("nope").is_none());
        assert_eq!(parser_names(), &["pytest"]);
    }
}
