//! The wrong-patch audit: a task is loose when a plausible wrong patch
//! passes every one of its tests, so its reward would teach the wrong fix.
//!
//! Wrong patches here are mechanical variants of the gold patch
//! ([`variants`]): return a value the tests expect from the function the
//! gold patch changes (the hard-coded answer, the commonest reward hack:
//! the test asserts `slugify("Hello World") == "hello-world"` and the patch
//! makes `slugify` return `"hello-world"`), drop a hunk, keep only what
//! makes a new symbol exist, replace an added return value or assignment
//! with a constant, replace an added statement with a no-op, invert an
//! added condition. Each is graded
//! like an agent's diff; the first that resolves the task is kept as
//! evidence. Agent-written wrong patches (an external model shown the gold
//! patch) plug in at [`audit_task`]'s `extra` argument; a loose task's
//! tests can then be strengthened ([`super::strengthen`]), which the report
//! records. Not for: validity (see [`super::validate`], run first).

use super::strengthen::Strengthening;
use super::validate::{task_env, validate_task, ValidateConfig, Verdict};
use super::Task;
use crate::grading::{self, GradeOutcome};
use crate::{Backend, Policy};
use futures_util::StreamExt;
use serde::Serialize;

/// One hunk of a file diff; counts are recomputed when rendering.
#[derive(Debug, Clone, PartialEq)]
struct Hunk {
    old_start: usize,
    section: String,
    /// Lines with their prefix (` `, `-`, `+`, `\`).
    lines: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
struct FileDiff {
    header: Vec<String>,
    hunks: Vec<Hunk>,
}

fn parse_patch(patch: &str) -> Option<Vec<FileDiff>> {
    let mut files: Vec<FileDiff> = Vec::new();
    // Lines still owed to the current hunk (old side, new side), from its
    // header: a removed line starting `--- ` is content, not a file header.
    let (mut old_left, mut new_left) = (0usize, 0usize);
    for line in patch.lines() {
        if old_left > 0 || new_left > 0 {
            let l = if line.is_empty() { " " } else { line };
            match l.chars().next() {
                Some(' ') => {
                    old_left = old_left.checked_sub(1)?;
                    new_left = new_left.checked_sub(1)?;
                }
                Some('-') => old_left = old_left.checked_sub(1)?,
                Some('+') => new_left = new_left.checked_sub(1)?,
                Some('\\') => {}
                _ => return None,
            }
            files
                .last_mut()?
                .hunks
                .last_mut()?
                .lines
                .push(l.to_string());
        } else if line.starts_with('\\') {
            files
                .last_mut()?
                .hunks
                .last_mut()?
                .lines
                .push(line.to_string());
        } else if let Some(rest) = line.strip_prefix("@@ -") {
            let (range, section) = rest.split_once(" @@")?;
            let mut parts = range.split_whitespace();
            let count = |r: &str| -> Option<(usize, usize)> {
                let mut it = r.split(',');
                let start = it.next()?.parse().ok()?;
                let n = match it.next() {
                    Some(n) => n.parse().ok()?,
                    None => 1,
                };
                Some((start, n))
            };
            let (old_start, o) = count(parts.next()?)?;
            let (_, n) = count(parts.next()?.strip_prefix('+')?)?;
            old_left = o;
            new_left = n;
            files.last_mut()?.hunks.push(Hunk {
                old_start,
                section: section.to_string(),
                lines: vec![],
            });
        } else {
            let new_file = line.starts_with("diff --git ")
                || (line.starts_with("--- ")
                    && files
                        .last()
                        .map(|f| {
                            !f.hunks.is_empty() || f.header.iter().any(|h| h.starts_with("--- "))
                        })
                        .unwrap_or(true));
            if new_file || files.is_empty() {
                files.push(FileDiff {
                    header: vec![],
                    hunks: vec![],
                });
            }
            files.last_mut()?.header.push(line.to_string());
        }
    }
    Some(files)
}

fn render(files: &[FileDiff]) -> String {
    let mut out = String::new();
    for f in files {
        if f.hunks.is_empty()
            && !f
                .header
                .iter()
                .any(|h| h.starts_with("new file") || h.starts_with("deleted file"))
        {
            continue;
        }
        for h in &f.header {
            out.push_str(h);
            out.push('\n');
        }
        let mut delta: i64 = 0;
        for h in &f.hunks {
            let old_n = h
                .lines
                .iter()
                .filter(|l| l.starts_with(' ') || l.starts_with('-'))
                .count();
            let new_n = h
                .lines
                .iter()
                .filter(|l| l.starts_with(' ') || l.starts_with('+'))
                .count();
            let new_start = if new_n == 0 {
                (h.old_start as i64 + delta - 1).max(0)
            } else if old_n == 0 {
                h.old_start as i64 + delta + 1
            } else {
                h.old_start as i64 + delta
            };
            out.push_str(&format!(
                "@@ -{},{} +{},{} @@{}\n",
                h.old_start, old_n, new_start, new_n, h.section
            ));
            for l in &h.lines {
                out.push_str(l);
                out.push('\n');
            }
            delta += new_n as i64 - old_n as i64;
        }
    }
    out
}

/// A mechanical wrong patch.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct Variant {
    /// e.g. `drop_hunk_1`, `constant_return_0`, `invert_condition`.
    pub name: String,
    pub patch: String,
}

fn indent_of(s: &str) -> &str {
    &s[..s.len() - s.trim_start().len()]
}

fn is_comparison(e: &str) -> bool {
    [" == ", " != ", " >= ", " <= ", " > ", " < ", " in ", " is "]
        .iter()
        .any(|op| e.contains(op))
}

/// Rewrites each added line with `f` (None: leave it) one at a time; one
/// variant per (line, rewrite).
fn per_added_line(
    files: &[FileDiff],
    name: &str,
    f: &dyn Fn(&str) -> Vec<String>,
    out: &mut Vec<Variant>,
) {
    for fi in 0..files.len() {
        for hi in 0..files[fi].hunks.len() {
            for li in 0..files[fi].hunks[hi].lines.len() {
                let line = &files[fi].hunks[hi].lines[li];
                let Some(body) = line.strip_prefix('+') else {
                    continue;
                };
                for (k, new) in f(body).into_iter().enumerate() {
                    let mut v = files.to_vec();
                    v[fi].hunks[hi].lines[li] = format!("+{new}");
                    out.push(Variant {
                        name: format!("{name}_{fi}_{hi}_{li}_{k}"),
                        patch: render(&v),
                    });
                }
            }
        }
    }
}

fn int_literals(patch: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for line in patch
        .lines()
        .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
    {
        let mut cur = String::new();
        for c in line.chars().chain(std::iter::once(' ')) {
            if c.is_ascii_digit() {
                cur.push(c);
            } else {
                if !cur.is_empty() && !out.contains(&cur) && out.len() < 6 {
                    out.push(cur.clone());
                }
                cur.clear();
            }
        }
    }
    out
}

/// Whether `s` reads as a Python literal: a quoted string, a number,
/// `True`/`False`/`None`, or a bracketed collection with no names in it.
fn is_literal(s: &str) -> bool {
    let s = s.trim();
    if s.len() >= 2
        && ((s.starts_with('"') && s.ends_with('"')) || (s.starts_with('\'') && s.ends_with('\'')))
    {
        return !s[1..s.len() - 1].contains(s.chars().next().unwrap_or('"'));
    }
    if ["True", "False", "None"].contains(&s) || s.parse::<f64>().is_ok() {
        return true;
    }
    let bracketed = [('[', ']'), ('(', ')'), ('{', '}')]
        .iter()
        .any(|(a, b)| s.starts_with(*a) && s.ends_with(*b));
    // Letters only inside quotes.
    let mut quote: Option<char> = None;
    let named = s.chars().any(|c| match quote {
        Some(q) => {
            if c == q {
                quote = None;
            }
            false
        }
        None if c == '"' || c == '\'' => {
            quote = Some(c);
            false
        }
        None => c.is_alphabetic() || c == '_',
    });
    bracketed && !named
}

/// The values the tests of `test_patch` expect: literal sides of `==` in
/// added `assert` lines, `True` for `is True` or a bare assert, `False`
/// for `is False` (at most 8, in order).
fn expected_literals(test_patch: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut push = |v: &str| {
        let v = v.trim().to_string();
        if !v.is_empty() && !out.contains(&v) && out.len() < 8 {
            out.push(v);
        }
    };
    for line in test_patch
        .lines()
        .filter(|l| l.starts_with('+') && !l.starts_with("+++"))
    {
        let Some(e) = line[1..].trim().strip_prefix("assert ") else {
            continue;
        };
        // A message after the assertion, or a comment, is not the value.
        let e = e.split(" # ").next().unwrap_or(e).trim();
        if let Some((l, r)) = e.rsplit_once(" == ") {
            for side in [r, l] {
                if is_literal(side) {
                    push(side);
                }
            }
        } else if e.ends_with(" is True") {
            push("True");
        } else if e.ends_with(" is False") || e.starts_with("not ") {
            push("False");
        } else if !e.contains(" is ") && !e.contains(" in ") {
            push("True");
        }
    }
    out
}

/// The hard-coded answer: for each hunk of `files` whose function's `def`
/// line it shows, `return LITERAL` as the first line of that function's
/// body, for each literal the tests expect. The gold change itself is
/// kept (now dead code), as an agent's patch would.
fn hardcoded_answers(files: &[FileDiff], literals: &[String], out: &mut Vec<Variant>) {
    for fi in 0..files.len() {
        for hi in 0..files[fi].hunks.len() {
            let lines = &files[fi].hunks[hi].lines;
            let Some(first_change) = lines
                .iter()
                .position(|l| l.starts_with('+') || l.starts_with('-'))
            else {
                continue;
            };
            let body = |l: &String| l.get(1..).unwrap_or("").to_string();
            let Some(d) = (0..first_change).rev().find(|&i| {
                let l = &lines[i];
                let t = body(l);
                let t = t.trim_start();
                !l.starts_with('-')
                    && (t.starts_with("def ") || t.starts_with("async def "))
                    && t.trim_end().ends_with(':')
            }) else {
                continue;
            };
            let def_indent = indent_of(&body(&lines[d])).len();
            // The body's own indentation, from its first non-blank line.
            let indent = lines[d + 1..]
                .iter()
                .filter(|l| !l.starts_with('-'))
                .map(body)
                .find(|b| !b.trim().is_empty())
                .map(|b| indent_of(&b).to_string())
                .filter(|i| i.len() > def_indent)
                .unwrap_or_else(|| " ".repeat(def_indent + 4));
            for (k, lit) in literals.iter().enumerate() {
                let mut v = files.to_vec();
                v[fi].hunks[hi]
                    .lines
                    .insert(d + 1, format!("+{indent}return {lit}"));
                out.push(Variant {
                    name: format!("hardcoded_answer_{fi}_{hi}_{k}"),
                    patch: render(&v),
                });
            }
        }
    }
}

/// The mechanical wrong variants of `gold`, deduplicated, without the gold
/// patch itself or an empty patch. `test_patch` (the task's tests) gives
/// the expected values the hard-coded answers return; those come first.
pub fn variants(gold: &str, test_patch: &str) -> Vec<Variant> {
    let Some(files) = parse_patch(gold) else {
        return vec![];
    };
    let mut out = Vec::new();
    hardcoded_answers(&files, &expected_literals(test_patch), &mut out);
    // Drop one hunk (only when something remains).
    let total: usize = files.iter().map(|f| f.hunks.len()).sum();
    if total > 1 {
        let mut k = 0;
        for fi in 0..files.len() {
            for hi in 0..files[fi].hunks.len() {
                let mut v = files.clone();
                v[fi].hunks.remove(hi);
                out.push(Variant {
                    name: format!("drop_hunk_{k}"),
                    patch: render(&v),
                });
                k += 1;
            }
        }
    }
    // Keep only the new symbols: added def/class lines with a stub body.
    {
        let mut v = files.clone();
        let mut any = false;
        for f in &mut v {
            for h in &mut f.hunks {
                let mut lines = Vec::new();
                let mut stub_indent: Option<usize> = None;
                for l in &h.lines {
                    if let Some(body) = l.strip_prefix('+') {
                        let ind = indent_of(body).len();
                        if let Some(si) = stub_indent {
                            if body.trim().is_empty() || ind > si {
                                continue;
                            }
                            stub_indent = None;
                        }
                        let t = body.trim_start();
                        if t.starts_with("def ")
                            || t.starts_with("class ")
                            || t.starts_with("async def ")
                        {
                            any = true;
                            lines.push(l.clone());
                            lines
                                .push(format!("+{}    raise NotImplementedError", indent_of(body)));
                            stub_indent = Some(ind);
                        } else if t.starts_with("import ") || t.starts_with("from ") {
                            lines.push(l.clone());
                        }
                        // Other added lines are dropped.
                    } else if let Some(old) = l.strip_prefix('-') {
                        // Keep the old code where the gold patch replaced it.
                        lines.push(format!(" {old}"));
                    } else {
                        stub_indent = None;
                        lines.push(l.clone());
                    }
                }
                h.lines = lines;
            }
        }
        if any {
            out.push(Variant {
                name: "symbol_only".into(),
                patch: render(&v),
            });
        }
    }
    let mut constants: Vec<String> = ["0", "1", "-1", "True", "False", "None", "\"\""]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for lit in int_literals(gold) {
        if !constants.contains(&lit) {
            constants.push(lit);
        }
    }
    let consts = constants.clone();
    per_added_line(
        &files,
        "constant_return",
        &|body: &str| {
            let t = body.trim_start();
            match t.strip_prefix("return ") {
                Some(e) if !consts.iter().any(|c| c == e.trim()) => consts
                    .iter()
                    .map(|c| format!("{}return {c}", indent_of(body)))
                    .collect(),
                _ => vec![],
            }
        },
        &mut out,
    );
    per_added_line(
        &files,
        "constant_assign",
        &|body: &str| {
            let t = body.trim_start();
            let Some((lhs, rhs)) = t.split_once(" = ") else {
                return vec![];
            };
            if !lhs
                .chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
                || rhs.trim().is_empty()
            {
                return vec![];
            }
            ["0", "None"]
                .iter()
                .map(|c| format!("{}{lhs} = {c}", indent_of(body)))
                .collect()
        },
        &mut out,
    );
    per_added_line(
        &files,
        "noop",
        &|body: &str| {
            let t = body.trim_start();
            let block = t.ends_with(':')
                || t.is_empty()
                || t.starts_with('#')
                || t.starts_with('@')
                || t.starts_with(')')
                || t.starts_with(']')
                || t.starts_with('}')
                || [
                    "def ", "class ", "return", "else", "elif ", "except", "finally", "import ",
                    "from ",
                ]
                .iter()
                .any(|k| t.starts_with(k));
            if block || t.ends_with(',') || t.ends_with('(') || t.ends_with('[') || t.ends_with('{')
            {
                vec![]
            } else {
                vec![format!("{}pass", indent_of(body))]
            }
        },
        &mut out,
    );
    per_added_line(
        &files,
        "invert_condition",
        &|body: &str| {
            let ind = indent_of(body);
            let t = body.trim_start();
            for kw in ["if ", "elif ", "while "] {
                if let Some(c) = t.strip_prefix(kw).and_then(|r| r.strip_suffix(':')) {
                    return vec![format!("{ind}{kw}not ({c}):")];
                }
            }
            if let Some(e) = t.strip_prefix("return ") {
                if let Some((a, rest)) = e.split_once(" if ") {
                    if let Some((c, b)) = rest.split_once(" else ") {
                        return vec![format!("{ind}return {a} if not ({c}) else {b}")];
                    }
                }
                if is_comparison(e) {
                    return vec![format!("{ind}return not ({e})")];
                }
            }
            vec![]
        },
        &mut out,
    );
    let mut seen = std::collections::HashSet::new();
    let gold_norm = render(&files);
    out.retain(|v| {
        !v.patch.trim().is_empty() && v.patch != gold_norm && seen.insert(v.patch.clone())
    });
    out
}

/// Settings of [`audit_tasks`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct AuditConfig {
    /// Validation settings (image, test timeout, repeats, concurrency).
    pub validate: ValidateConfig,
    /// Validate each task first and audit only the valid ones. Default true.
    pub validate_first: bool,
    /// Most wrong patches graded per task. Default 24.
    pub max_variants: usize,
}

impl Default for AuditConfig {
    fn default() -> Self {
        AuditConfig {
            validate: ValidateConfig::default(),
            validate_first: true,
            max_variants: 24,
        }
    }
}

/// The audit of one task.
#[derive(Debug, Clone, Serialize)]
pub struct AuditResult {
    pub instance_id: String,
    /// `loose`, `tight`, `invalid` (validation failed; see `validation`),
    /// `strengthened` (was loose; new tests made it tight, see
    /// `strengthening`), or `undecided` (no wrong patch passed, but some
    /// could not be graded, `infra_errors`, or none was tried; not curated).
    pub verdict: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub validation: Option<Verdict>,
    /// Wrong patches graded.
    pub tried: usize,
    /// Wrong patches whose grading failed for infrastructure reasons.
    pub infra_errors: usize,
    /// The wrong patch that passed every test (evidence).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub accepted: Option<Variant>,
    /// Ground truth of toy tasks (`meta.toy.loose`), when known.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub expected_loose: Option<bool>,
    /// What strengthening a loose task did, when it was tried.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub strengthening: Option<Strengthening>,
}

impl AuditResult {
    /// The task to keep in the curated set: the task itself when tight,
    /// its strengthened version when strengthened, none otherwise.
    pub fn curated(&self, task: &Task) -> Option<Task> {
        match self.verdict {
            "tight" => Some(task.clone()),
            "strengthened" => self.strengthening.as_ref()?.task.clone(),
            _ => None,
        }
    }
}

/// Audits one task with the mechanical variants plus `extra` wrong patches
/// (e.g. from an agent), stopping at the first accepted one.
pub async fn audit_task(
    backend: &dyn Backend,
    task: &Task,
    policy: &Policy,
    cfg: &AuditConfig,
    extra: Vec<Variant>,
) -> AuditResult {
    let mut result = AuditResult {
        instance_id: task.instance_id.clone(),
        verdict: "tight",
        validation: None,
        tried: 0,
        infra_errors: 0,
        accepted: None,
        expected_loose: task.toy_loose(),
        strengthening: None,
    };
    if cfg.validate_first {
        let v = validate_task(backend, task, policy, &cfg.validate).await;
        let ok = v.is_valid();
        result.validation = Some(v);
        if !ok {
            result.verdict = "invalid";
            return result;
        }
    }
    let (snapshot, image, policy) = match task_env(backend, task, &cfg.validate.image, policy).await
    {
        Ok(x) => x,
        Err(e) => {
            result.verdict = "invalid";
            result.validation = Some(Verdict {
                instance_id: task.instance_id.clone(),
                verdict: "invalid",
                reason: Some("environment".into()),
                detail: e.to_string(),
            });
            return result;
        }
    };
    let spec = task.test_spec(cfg.validate.test_timeout_secs);
    let mut candidates = variants(&task.patch, &task.test_patch);
    candidates.truncate(cfg.max_variants);
    candidates.extend(extra);
    for v in candidates {
        result.tried += 1;
        match grading::grade(backend, &snapshot, &image, &policy, &v.patch, &spec).await {
            Ok(r) if r.outcome == GradeOutcome::Resolved => {
                result.verdict = "loose";
                result.accepted = Some(v);
                break;
            }
            Ok(r) if r.outcome == GradeOutcome::InfraError => result.infra_errors += 1,
            Ok(_) => {}
            Err(_) => result.infra_errors += 1,
        }
    }
    // Tight claims that wrong patches were graded and every one failed: one
    // that could not be graded, or none at all, leaves the question open.
    if result.verdict == "tight" && (result.infra_errors > 0 || result.tried == 0) {
        result.verdict = "undecided";
    }
    result
}

/// Summary of an audit run.
#[derive(Debug, Clone, Serialize)]
pub struct AuditReport {
    pub tasks: usize,
    pub invalid: usize,
    pub loose: usize,
    pub tight: usize,
    /// Loose tasks whose strengthened tests made them tight.
    pub strengthened: usize,
    /// Tasks no wrong patch passed but some could not be graded.
    pub undecided: usize,
    /// Of the tasks flagged loose (strengthened ones included: the audit
    /// flagged them first), the share that truly are (toy tasks only;
    /// null without ground truth or flags).
    pub precision: Option<f64>,
    /// Of the truly loose tasks, the share flagged.
    pub recall: Option<f64>,
    pub results: Vec<AuditResult>,
}

/// Audits every task, `cfg.validate.concurrency` at a time, in task order.
pub async fn audit_tasks(
    backend: &dyn Backend,
    tasks: &[Task],
    policy: &Policy,
    cfg: &AuditConfig,
) -> AuditReport {
    let results: Vec<AuditResult> = futures_util::stream::iter(
        tasks
            .iter()
            .map(|t| audit_task(backend, t, policy, cfg, vec![])),
    )
    .buffered(cfg.validate.concurrency.max(1))
    .collect()
    .await;
    report(results)
}

/// Counts and precision / recall against the toy ground truth.
pub fn report(results: Vec<AuditResult>) -> AuditReport {
    let count = |v: &str| results.iter().filter(|r| r.verdict == v).count();
    let judged: Vec<&AuditResult> = results
        .iter()
        .filter(|r| !matches!(r.verdict, "invalid" | "undecided") && r.expected_loose.is_some())
        .collect();
    let flagged_loose = |r: &&&AuditResult| matches!(r.verdict, "loose" | "strengthened");
    let tp = judged
        .iter()
        .filter(flagged_loose)
        .filter(|r| r.expected_loose == Some(true))
        .count();
    let flagged = judged.iter().filter(flagged_loose).count();
    let truly = judged
        .iter()
        .filter(|r| r.expected_loose == Some(true))
        .count();
    AuditReport {
        tasks: results.len(),
        invalid: count("invalid"),
        loose: count("loose"),
        tight: count("tight"),
        strengthened: count("strengthened"),
        undecided: count("undecided"),
        precision: (flagged > 0).then(|| tp as f64 / flagged as f64),
        recall: (truly > 0).then(|| tp as f64 / truly as f64),
        results,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOLD: &str = "diff --git a/m.py b/m.py\n--- a/m.py\n+++ b/m.py\n@@ -1,4 +1,4 @@\n def f(age, limit=18):\n-    return age > limit\n+    return age >= limit\n \n \n@@ -10,3 +10,4 @@\n def g(x):\n+    x = x * 60\n     return x\n \n";

    #[test]
    fn hardcoded_answers_return_what_the_tests_expect() {
        let gold = "--- a/text.py\n+++ b/text.py\n@@ -1,4 +1,4 @@\n def slugify(s):\n     \"\"\"Lower-case, words joined by '-'.\"\"\"\n-    return s.lower()\n+    return '-'.join(s.lower().split())\n \n";
        let tests = "--- /dev/null\n+++ b/tests/test_text.py\n@@ -0,0 +1,6 @@\n+from text import slugify\n+\n+def test_slug():\n+    assert slugify(\"Hello World\") == \"hello-world\"\n+    assert slugify(x) == expected  # not a literal\n+    assert [1, 'a'] == pick()\n";
        assert_eq!(
            expected_literals(tests),
            vec!["\"hello-world\"".to_string(), "[1, 'a']".to_string()]
        );
        let v = variants(gold, tests);
        let hack = &v[0];
        assert!(hack.name.starts_with("hardcoded_answer"), "{}", hack.name);
        // The return is the body's first line; the gold change stays.
        assert!(
            hack.patch
                .contains(" def slugify(s):\n+    return \"hello-world\"\n     \"\"\""),
            "{}",
            hack.patch
        );
        assert!(hack.patch.contains("+    return '-'.join("));
        assert!(hack.patch.contains("@@ -1,4 +1,5 @@"), "{}", hack.patch);
        assert!(v.iter().any(|x| x.patch.contains("+    return [1, 'a']\n")));
        // Without tests, no hard-coded answer.
        assert!(!variants(gold, "")
            .iter()
            .any(|x| x.name.starts_with("hardcoded")));
        assert!(is_literal("-2.5") && is_literal("(1, 2)") && is_literal("'a b'"));
        assert!(!is_literal("f(1)") && !is_literal("[x]") && !is_literal("'a' + b"));
    }

    #[test]
    fn round_trips_and_recounts() {
        let files = parse_patch(GOLD).unwrap();
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].hunks.len(), 2);
        assert_eq!(render(&files), GOLD);
    }

    #[test]
    fn makes_each_kind_of_variant() {
        let v = variants(GOLD, "");
        let names: Vec<&str> = v.iter().map(|v| v.name.as_str()).collect();
        assert!(
            names.iter().any(|n| n.starts_with("drop_hunk")),
            "{names:?}"
        );
        assert!(
            names.iter().any(|n| n.starts_with("constant_return")),
            "{names:?}"
        );
        assert!(
            names.iter().any(|n| n.starts_with("constant_assign")),
            "{names:?}"
        );
        assert!(names.iter().any(|n| n.starts_with("noop")), "{names:?}");
        let inv = v
            .iter()
            .find(|v| v.name.starts_with("invert_condition"))
            .unwrap();
        assert!(
            inv.patch.contains("+    return not (age >= limit)"),
            "{}",
            inv.patch
        );
        let c60 = v.iter().any(|v| v.patch.contains("+    return 60\n"));
        assert!(c60, "literal from the gold patch used as a constant");
        // Dropping the second hunk recounts nothing in the first.
        let d = v.iter().find(|v| v.name == "drop_hunk_1").unwrap();
        assert!(d.patch.contains("@@ -1,3 +1,3 @@") || d.patch.contains("@@ -1,4 +1,4 @@"));
        assert!(!v.iter().any(|x| x.patch == GOLD));
    }

    #[test]
    fn report_counts_strengthened_tasks_as_flagged() {
        let r = |id: &str, verdict: &'static str, loose: bool| AuditResult {
            instance_id: id.into(),
            verdict,
            validation: None,
            tried: 1,
            infra_errors: 0,
            accepted: None,
            expected_loose: Some(loose),
            strengthening: None,
        };
        let rep = report(vec![
            r("a", "strengthened", true),
            r("b", "loose", true),
            r("c", "tight", false),
            r("d", "tight", true),
            // Undecided is no verdict: not in precision or recall.
            r("e", "undecided", true),
        ]);
        assert_eq!(
            (
                rep.loose,
                rep.tight,
                rep.strengthened,
                rep.invalid,
                rep.undecided
            ),
            (1, 2, 1, 0, 1)
        );
        assert_eq!(rep.precision, Some(1.0));
        assert_eq!(rep.recall, Some(2.0 / 3.0));
        // A strengthened result without its task keeps nothing.
        let task = crate::tasks::parse_record(
            &serde_json::json!({
                "instance_id": "c", "problem_statement": "x", "patch": "p",
                "FAIL_TO_PASS": ["t::a"], "repo": "r", "test_cmd": "pytest"
            }),
            crate::tasks::Format::Native,
            "r",
        )
        .unwrap();
        assert_eq!(rep.results[2].curated(&task), Some(task.clone()));
        assert_eq!(rep.results[0].curated(&task), None);
        assert_eq!(rep.results[1].curated(&task), None);
    }

    #[test]
    fn symbol_only_stubs_new_functions() {
        let gold = "--- a/m.py\n+++ b/m.py\n@@ -1,2 +1,5 @@\n x = 1\n+def helper(a):\n+    b = a + 1\n+    return b\n \n";
        let v = variants(gold, "");
        let s = v.iter().find(|v| v.name == "symbol_only").unwrap();
        assert!(
            s.patch
                .contains("+def helper(a):\n+    raise NotImplementedError\n"),
            "{}",
            s.patch
        );
        assert!(s.patch.contains("@@ -1,2 +1,4 @@"), "{}", s.patch);
    }
}
