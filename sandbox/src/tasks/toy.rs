//! The toy task pool: small Python repositories with one seeded bug each,
//! an issue written like a bug report, a gold patch and hidden pytest tests.
//!
//! Bug families: wrong operator, off-by-one, wrong constant, missing case,
//! swapped arguments, wrong comparison. A controlled share of tasks is
//! deliberately loose: their hidden tests check a single point whose
//! expected value a mechanical wrong patch also produces (a constant
//! return; for `wrong_operator`, the hard-coded expected value, which only
//! the audit's `hardcoded_answer` family tries), so [`super::audit`] can be
//! measured against known ground truth (`meta.toy.loose`). Tasks are valid by construction (the buggy and the
//! fixed function are known in closed form) and by `tasks validate`.
//!
//! Not for: benchmarking agents (the bugs are trivial); the pool feeds the
//! built-in demo and the tests. Deterministic for a given seed.

use super::{python_names, Task, DEFAULT_PYTEST_CMD};
use crate::{Error, Result};
use serde_json::{json, Map};
use std::path::Path;

/// The bug families, in generation order.
pub const FAMILIES: [&str; 6] = [
    "wrong_operator",
    "off_by_one",
    "wrong_constant",
    "missing_case",
    "swapped_arguments",
    "wrong_comparison",
];

/// Settings of [`generate`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct ToyConfig {
    /// Number of tasks. Default 12.
    pub count: usize,
    /// Seed of every random choice. Default 0.
    pub seed: u64,
    /// Share of deliberately loose tasks, rounded to the nearest count.
    /// Default 0.25.
    pub loose_share: f64,
    /// One package name for every task (`<package>/core.py`) instead of a
    /// seeded name per task, so that nothing hinges on copying a per-task
    /// name (the warm-start demo pool). The seeded choices are the same
    /// either way: only the name differs. Must be a Python identifier.
    /// Default None (per-task names).
    pub package: Option<String>,
}

impl Default for ToyConfig {
    fn default() -> Self {
        ToyConfig {
            count: 12,
            seed: 0,
            loose_share: 0.25,
            package: None,
        }
    }
}

/// SplitMix64: small, seedable, good enough to pick names.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

/// One generated bug: the function as buggy and fixed, and its tests.
struct Bug {
    family: &'static str,
    func: String,
    /// `def` line and docstring.
    header: String,
    buggy: String,
    fixed: String,
    /// Extra module-level helper placed before the function, if any.
    helper: String,
    /// pytest assertions of the tight tests (each becomes one test), and
    /// whether the buggy code fails it (fail-to-pass) or not (pass-to-pass).
    tight: Vec<(String, bool)>,
    /// The single assertion of the loose test.
    loose: String,
    /// (call, what the reporter got, what they expected) for the issue.
    example: (String, String, String),
    symptom: String,
}

fn make_bug(family: &'static str, rng: &mut Rng) -> Bug {
    match family {
        "wrong_operator" => {
            let f = rng.pick(&["add", "combine", "total", "plus", "merge_counts"]);
            let (a, b) = (2 + rng.below(7) as i64, 3 + rng.below(7) as i64);
            Bug {
                family,
                func: f.into(),
                header: format!("def {f}(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n"),
                buggy: "    return a - b".into(),
                fixed: "    return a + b".into(),
                helper: String::new(),
                tight: vec![
                    (format!("{f}({a}, {b}) == {}", a + b), true),
                    (format!("{f}(-1, 4) == 3"), true),
                    (format!("{f}(10, 0) == 10"), false),
                ],
                // Only a patch returning this very value passes it.
                loose: format!("{f}({a}, {b}) == {}", a + b),
                example: (
                    format!("{f}({a}, {b})"),
                    (a - b).to_string(),
                    (a + b).to_string(),
                ),
                symptom: "it looks like the numbers are subtracted instead of added".into(),
            }
        }
        "off_by_one" => {
            let f = rng.pick(&["sum_to", "triangle", "total_up_to", "running_sum"]);
            let n = 3 + rng.below(6) as i64;
            Bug {
                family,
                func: f.into(),
                header: format!(
                    "def {f}(n):\n    \"\"\"Return 1 + 2 + ... + n (n included).\"\"\"\n"
                ),
                buggy: "    return sum(range(1, n))".into(),
                fixed: "    return sum(range(1, n + 1))".into(),
                helper: String::new(),
                tight: vec![
                    (format!("{f}({n}) == {}", n * (n + 1) / 2), true),
                    (format!("{f}(0) == 0"), false),
                    (format!("{f}(10) == 55"), true),
                ],
                loose: format!("{f}(1) == 1"),
                example: (
                    format!("{f}({n})"),
                    ((n - 1) * n / 2).to_string(),
                    (n * (n + 1) / 2).to_string(),
                ),
                symptom: "the last number seems to be left out".into(),
            }
        }
        "wrong_constant" => {
            let (f, unit, good, bad) = [
                ("minutes_to_seconds", "minutes", 60, 600),
                ("hours_to_minutes", "hours", 60, 6),
                ("days_to_hours", "days", 24, 42),
                ("km_to_meters", "kilometers", 1000, 100),
                ("weeks_to_days", "weeks", 7, 5),
            ][rng.below(5)];
            let x = 2 + rng.below(5) as i64;
            Bug {
                family,
                func: f.into(),
                header: format!("def {f}(value):\n    \"\"\"Convert {unit}.\"\"\"\n"),
                buggy: format!("    return value * {bad}"),
                fixed: format!("    return value * {good}"),
                helper: String::new(),
                tight: vec![
                    (format!("{f}({x}) == {}", x * good), true),
                    (format!("{f}(0) == 0"), false),
                    (format!("{f}(5) == {}", 5 * good), true),
                ],
                loose: format!("{f}(1) == {good}"),
                example: (
                    format!("{f}({x})"),
                    (x * bad).to_string(),
                    (x * good).to_string(),
                ),
                symptom: "the conversion factor looks wrong".into(),
            }
        }
        "missing_case" => {
            let f = rng.pick(&["sign", "signum", "direction", "compare_to_zero"]);
            Bug {
                family,
                func: f.into(),
                header: format!(
                    "def {f}(x):\n    \"\"\"Return 1 for positive x, -1 for negative x and 0 for zero.\"\"\"\n"
                ),
                buggy: "    return 1 if x > 0 else -1".into(),
                fixed: "    return 1 if x > 0 else (0 if x == 0 else -1)".into(),
                helper: String::new(),
                tight: vec![(format!("{f}(0) == 0"), true),
(format!("{f}(7) == 1"), false),
(format!("{f}(-3) == -1"), false)],
                loose: format!("{f}(0) == 0"),
                example: (format!("{f}(0)"), "-1".into(), "0".into()),
                symptom: "zero is not handled".into(),
            }
        }
        "swapped_arguments" => {
            let f = rng.pick(&["ratio", "share_of", "fraction", "per_unit"]);
            let b = [2, 4, 5, 8][rng.below(4)] as i64;
            let a = b * (2 + rng.below(4) as i64);
            Bug {
                family,
                func: f.into(),
                header: format!("def {f}(part, whole):\n    \"\"\"Return part / whole.\"\"\"\n"),
                buggy: "    return _div(whole, part)".into(),
                fixed: "    return _div(part, whole)".into(),
                helper: "def _div(x, y):\n    return x / y\n\n\n".into(),
                tight: vec![
                    (format!("{f}({a}, {b}) == {}", a / b), true),
                    (format!("{f}(1, 4) == 0.25"), true),
                    (format!("{f}(0, 5) == 0"), true),
                ],
                loose: format!("{f}(0, 5) == 0"),
                example: (
                    format!("{f}({a}, {b})"),
                    format!("{}", b as f64 / a as f64),
                    format!("{}", (a / b) as f64),
                ),
                symptom: "the arguments seem to be used the wrong way round".into(),
            }
        }
        _ => {
            let (f, what, limit) = [
                ("is_adult", "age", 18),
                ("can_retire", "age", 65),
                ("passes_exam", "score", 50),
                ("is_full", "count", 10),
            ][rng.below(4)];
            Bug {
                family: "wrong_comparison",
                func: f.into(),
                header: format!(
                    "def {f}({what}, limit={limit}):\n    \"\"\"True when {what} is at least limit.\"\"\"\n"
                ),
                buggy: format!("    return {what} > limit"),
                fixed: format!("    return {what} >= limit"),
                helper: String::new(),
                tight: vec![(format!("{f}({limit}) is True"), true),
(format!("{f}({}) is False", limit - 1), false),
(format!("{f}({}) is True", limit + 10), false)],
                loose: format!("{f}({limit}) is True"),
                example: (format!("{f}({limit})"), "False".into(), "True".into()),
                symptom: "the boundary value is rejected".into(),
            }
        }
    }
}

/// Correct distractor functions: (name, source, visible test assertion).
const DISTRACTORS: [(&str, &str, &str); 5] = [
    (
        "double",
        "def double(x):\n    \"\"\"Return twice x.\"\"\"\n    return x * 2\n",
        "double(4) == 8",
    ),
    (
        "is_even",
        "def is_even(n):\n    \"\"\"True for even n.\"\"\"\n    return n % 2 == 0\n",
        "is_even(6) and not is_even(7)",
    ),
    (
        "first",
        "def first(items):\n    \"\"\"First item, or None when empty.\"\"\"\n    return items[0] if items else None\n",
        "first([3, 4]) == 3 and first([]) is None",
    ),
    (
        "clamp",
        "def clamp(x, lo, hi):\n    \"\"\"x limited to [lo, hi].\"\"\"\n    return max(lo, min(x, hi))\n",
        "clamp(5, 0, 3) == 3 and clamp(-1, 0, 3) == 0",
    ),
    (
        "shout",
        "def shout(text):\n    \"\"\"Upper-case text with an exclamation mark.\"\"\"\n    return text.upper() + \"!\"\n",
        "shout(\"hi\") == \"HI!\"",
    ),
];

const PACKAGES: [&str; 8] = [
    "mathkit",
    "unitools",
    "numbox",
    "calcly",
    "tinyops",
    "arith",
    "smallnum",
    "quickcalc",
];

/// A `git apply`-able diff creating `path` with `content`.
pub fn new_file_diff(path: &str, content: &str) -> String {
    let lines: Vec<&str> = content.lines().collect();
    let mut d = format!(
        "diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n@@ -0,0 +1,{} @@\n",
        lines.len()
    );
    for l in lines {
        d.push('+');
        d.push_str(l);
        d.push('\n');
    }
    d
}

/// A diff replacing line `idx` (0-based) of `content` (a file at `path`)
/// with `new_line`, with three lines of context.
pub fn replace_line_diff(path: &str, content: &str, idx: usize, new_line: &str) -> String {
    let lines: Vec<&str> = content.lines().collect();
    let lo = idx.saturating_sub(3);
    let hi = (idx + 4).min(lines.len());
    let n = hi - lo;
    let mut d = format!(
        "diff --git a/{path} b/{path}\n--- a/{path}\n+++ b/{path}\n@@ -{},{n} +{},{n} @@\n",
        lo + 1,
        lo + 1
    );
    for (i, l) in lines.iter().enumerate().take(hi).skip(lo) {
        if i == idx {
            d.push_str(&format!("-{l}\n+{new_line}\n"));
        } else {
            d.push_str(&format!(" {l}\n"));
        }
    }
    d
}

fn write(path: &Path, text: &str) -> Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)
            .map_err(|e| Error::io(format!("creating {}", dir.display()), e))?;
    }
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

/// Generates the pool under `out`: `out/repos/<id>/` per task and
/// `out/tasks.jsonl` (repo paths relative to it). Returns the tasks with
/// absolute repo paths.
pub fn generate(cfg: &ToyConfig, out: &Path) -> Result<Vec<Task>> {
    // A folder of files per task: past a million, a typo, not a pool.
    const MAX_COUNT: usize = 1_000_000;
    if cfg.count == 0 || cfg.count > MAX_COUNT {
        return Err(Error::InvalidInput(format!(
            "count must be from 1 to {MAX_COUNT}, got {}",
            cfg.count
        )));
    }
    if !(0.0..=1.0).contains(&cfg.loose_share) {
        return Err(Error::InvalidInput("loose_share must be in [0, 1]".into()));
    }
    if let Some(p) = &cfg.package {
        let ok = p
            .chars()
            .next()
            .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
            && p.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(Error::InvalidInput(format!(
                "package {p:?} is not a Python identifier (ASCII letters, digits and _, not \
                 starting with a digit)"
            )));
        }
        // It names folders and files (with a task's suffix): past this a
        // file name would be too long for most file systems.
        const MAX_PACKAGE: usize = 64;
        if p.len() > MAX_PACKAGE {
            return Err(Error::InvalidInput(format!(
                "package name of {} characters: at most {MAX_PACKAGE}",
                p.len()
            )));
        }
        let why = if python_names::KEYWORDS.contains(&p.as_str()) {
            Some("it is a Python keyword")
        } else if p == "tests" {
            Some("tests/ holds the test files")
        } else if python_names::STDLIB.binary_search(&p.as_str()).is_ok() {
            Some("a package of that name would hide the standard library's module of that name")
        } else if python_names::TEST_RUNNER.binary_search(&p.as_str()).is_ok() {
            Some("a package of that name would hide the test runner's module of that name")
        } else {
            None
        };
        if let Some(why) = why {
            return Err(Error::InvalidInput(format!(
                "package {p:?} cannot be imported by the tests: {why}"
            )));
        }
    }
    check_replaceable(out)?;
    let mut rng = Rng(cfg.seed ^ 0x5EED_0FA7_C71C);
    // Exactly round(count * share) loose tasks, at seeded positions.
    let n_loose = (cfg.count as f64 * cfg.loose_share).round() as usize;
    let mut order: Vec<usize> = (0..cfg.count).collect();
    for i in (1..order.len()).rev() {
        let j = rng.below(i + 1);
        order.swap(i, j);
    }
    let loose_set: std::collections::HashSet<usize> = order[..n_loose].iter().copied().collect();

    let mut tasks = Vec::with_capacity(cfg.count);
    let mut lines = String::new();
    for i in 0..cfg.count {
        let family = FAMILIES[(i + cfg.seed as usize) % FAMILIES.len()];
        let bug = make_bug(family, &mut rng);
        let loose = loose_set.contains(&i);
        // Picked either way, so a fixed package changes nothing else.
        let seeded = format!("{}{i}", rng.pick(&PACKAGES));
        let pkg = cfg.package.clone().unwrap_or(seeded);
        let id = format!("toy-{:04}-{}", i, bug.family);
        let repo_rel = format!("repos/{id}");
        let repo = out.join(&repo_rel);
        // A pool made here before (another seed or package) may have left
        // files in this task's folder: the repository is this task's only.
        remove_toy_repo(&repo)?;

        // Two distractors, one before and one after the buggy function.
        let d1 = rng.below(DISTRACTORS.len());
        let d2 = (d1 + 1 + rng.below(DISTRACTORS.len() - 1)) % DISTRACTORS.len();
        let (d1, d2) = (DISTRACTORS[d1], DISTRACTORS[d2]);
        let core = format!(
            "\"\"\"Small helpers of the {pkg} package.\"\"\"\n\n\n{}\n\n{}{}{}\n\n\n{}",
            d1.1, bug.helper, bug.header, bug.buggy, d2.1
        );
        let core_path = format!("{pkg}/core.py");
        let bug_idx = core
            .lines()
            .position(|l| l == bug.buggy)
            .ok_or_else(|| Error::InvalidInput("toy generator: bug line not found".into()))?;
        write(&repo.join(&core_path), &core)?;
        write(&repo.join(format!("{pkg}/__init__.py")), "")?;
        let visible = format!(
            "from {pkg}.core import {a}, {b}\n\n\ndef test_{a}():\n    assert {ta}\n\n\ndef test_{b}():\n    assert {tb}\n",
            a = d1.0,
            b = d2.0,
            ta = d1.2,
            tb = d2.2
        );
        write(&repo.join("tests/test_basic.py"), &visible)?;
        write(&repo.join("tests/__init__.py"), "")?;
        write(
            &repo.join("README.md"),
            &format!(
                "# {pkg}\n\nSmall numeric helpers. Run the tests with `python3 -m pytest tests`.\n"
            ),
        )?;

        let f = &bug.func;
        let asserts: Vec<(String, bool)> = if loose {
            vec![(bug.loose.clone(), true)]
        } else {
            bug.tight.clone()
        };
        let mut hidden = format!("from {pkg}.core import {f}\n");
        let mut f2p = Vec::new();
        let mut hidden_p2p = Vec::new();
        for (k, (a, fails_before)) in asserts.iter().enumerate() {
            let name = format!("test_{f}_{k}");
            hidden.push_str(&format!("\n\ndef {name}():\n    assert {a}\n"));
            let id = format!("tests/test_{f}.py::{name}");
            if *fails_before {
                f2p.push(id);
            } else {
                hidden_p2p.push(id);
            }
        }
        let test_patch = new_file_diff(&format!("tests/test_{f}.py"), &hidden);
        let patch = replace_line_diff(&core_path, &core, bug_idx, &bug.fixed);
        let (call, got, want) = &bug.example;
        let problem_statement = format!(
            "`{f}` gives a wrong result\n\nCalling `{pkg}.core.{call}` returns `{got}`, but it should return `{want}` \
             according to its docstring; {symptom}.\n\nSteps to reproduce:\n\n```python\nfrom {pkg}.core import {f}\nprint({call})\n```\n\n\
             Please fix `{f}` so that it behaves as documented.\n",
            symptom = bug.symptom
        );
        let mut pass_to_pass = vec![
            format!("tests/test_basic.py::test_{}", d1.0),
            format!("tests/test_basic.py::test_{}", d2.0),
        ];
        pass_to_pass.extend(hidden_p2p);
        let mut meta = Map::new();
        meta.insert(
            "toy".into(),
            json!({
                "family": bug.family,
                "loose": loose,
                "solution": {"path": core_path, "old_str": bug.buggy, "new_str": bug.fixed},
            }),
        );
        let task = Task {
            instance_id: id,
            problem_statement,
            patch,
            test_patch,
            fail_to_pass: f2p,
            pass_to_pass,
            image: None,
            repo: Some(repo_rel.into()),
            workdir: "/testbed".into(),
            test_cmd: format!("{DEFAULT_PYTEST_CMD} tests"),
            log_parser: "pytest".into(),
            meta,
        };
        let line = serde_json::to_string(&task)
            .map_err(|e| Error::InvalidInput(format!("serializing a toy task: {e}")))?;
        lines.push_str(&line);
        lines.push('\n');
        let mut task = task;
        task.repo = Some(repo);
        tasks.push(task);
    }
    write(&out.join("tasks.jsonl"), &lines)?;
    // Task folders of a larger pool made here before are not this pool's.
    if let Ok(rd) = std::fs::read_dir(out.join("repos")) {
        let ids: std::collections::HashSet<&str> =
            tasks.iter().map(|t| t.instance_id.as_str()).collect();
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().into_owned();
            if name.starts_with("toy-") && !ids.contains(name.as_str()) {
                remove_toy_repo(&e.path())?;
            }
        }
    }
    Ok(tasks)
}

/// A toy pool is made in a folder (regenerating one replaces its tasks and
/// its task folders); refuses a file, and a folder whose `tasks.jsonl`
/// holds anything but toy tasks, which would be lost.
fn check_replaceable(out: &Path) -> Result<()> {
    if out.exists() && !out.is_dir() {
        return Err(Error::InvalidInput(format!(
            "{} is a file; a toy pool is a folder (its tasks.jsonl and repos/)",
            out.display()
        )));
    }
    let file = out.join("tasks.jsonl");
    let Ok(text) = std::fs::read_to_string(&file) else {
        return Ok(());
    };
    let toy = |line: &str| {
        serde_json::from_str::<serde_json::Value>(line)
            .is_ok_and(|v| v.pointer("/meta/toy").is_some_and(|t| t.is_object()))
    };
    if let Some((n, _)) = text
        .lines()
        .enumerate()
        .find(|(_, l)| !l.trim().is_empty() && !toy(l))
    {
        return Err(Error::InvalidInput(format!(
            "{}:{} is not a toy task: making a toy pool there would replace that file; name \
             another folder",
            file.display(),
            n + 1
        )));
    }
    Ok(())
}

fn remove_toy_repo(repo: &Path) -> Result<()> {
    match std::fs::remove_dir_all(repo) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::io(
            format!("removing the earlier {}", repo.display()),
            e,
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generates_deterministic_pool_with_loose_share() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let cfg = ToyConfig {
            count: 8,
            seed: 3,
            loose_share: 0.25,
            package: None,
        };
        let ta = generate(&cfg, a.path()).unwrap();
        let tb = generate(&cfg, b.path()).unwrap();
        assert_eq!(ta.len(), 8);
        assert_eq!(ta.iter().filter(|t| t.toy_loose() == Some(true)).count(), 2);
        for (x, y) in ta.iter().zip(&tb) {
            assert_eq!(x.patch, y.patch);
            assert_eq!(x.test_patch, y.test_patch);
        }
        let families: std::collections::HashSet<_> = ta
            .iter()
            .map(|t| t.meta["toy"]["family"].as_str().unwrap().to_string())
            .collect();
        assert_eq!(families.len(), 6);
        let loaded =
            super::super::load_tasks(&a.path().join("tasks.jsonl"), super::super::Format::Auto)
                .unwrap();
        assert_eq!(loaded, ta);
    }

    #[test]
    fn a_pool_made_over_an_earlier_one_holds_only_its_own_files() {
        let out = tempfile::tempdir().unwrap();
        let cfg = |count, seed| ToyConfig {
            count,
            seed,
            loose_share: 0.25,
            package: None,
        };
        generate(&cfg(6, 1), out.path()).unwrap();
        let tasks = generate(&cfg(3, 2), out.path()).unwrap();
        let fresh = tempfile::tempdir().unwrap();
        generate(&cfg(3, 2), fresh.path()).unwrap();
        let listing = |root: &Path| {
            let mut v: Vec<String> = walk(root)
                .into_iter()
                .map(|p| p.strip_prefix(root).unwrap().display().to_string())
                .collect();
            v.sort();
            v
        };
        fn walk(p: &Path) -> Vec<std::path::PathBuf> {
            let mut v = vec![];
            for e in std::fs::read_dir(p).unwrap().flatten() {
                v.push(e.path());
                if e.file_type().unwrap().is_dir() {
                    v.extend(walk(&e.path()));
                }
            }
            v
        }
        assert_eq!(tasks.len(), 3);
        assert_eq!(listing(out.path()), listing(fresh.path()));
        // A task file that is not a toy pool's is not replaced, and a file
        // is not a pool's folder.
        let mine = tempfile::tempdir().unwrap();
        let file = mine.path().join("tasks.jsonl");
        std::fs::write(&file, "{\"instance_id\": \"mine\"}\n").unwrap();
        let e = generate(&cfg(1, 1), mine.path()).unwrap_err().to_string();
        assert!(e.contains("tasks.jsonl:1 is not a toy task"), "{e}");
        assert_eq!(
            std::fs::read_to_string(&file).unwrap(),
            "{\"instance_id\": \"mine\"}\n"
        );
        let e = generate(&cfg(1, 1), &file).unwrap_err().to_string();
        assert!(e.contains("is a file"), "{e}");
    }

    #[test]
    fn a_fixed_package_changes_only_the_name() {
        let a = tempfile::tempdir().unwrap();
        let b = tempfile::tempdir().unwrap();
        let c = tempfile::tempdir().unwrap();
        let base = ToyConfig {
            count: 7,
            seed: 5,
            loose_share: 0.0,
            package: None,
        };
        let fixed = ToyConfig {
            package: Some("calc".into()),
            ..base.clone()
        };
        let seeded = generate(&base, a.path()).unwrap();
        let ta = generate(&fixed, b.path()).unwrap();
        let tb = generate(&fixed, c.path()).unwrap();
        for ((s, x), y) in seeded.iter().zip(&ta).zip(&tb) {
            assert_eq!(x.patch, y.patch);
            assert_eq!(x.problem_statement, y.problem_statement);
            assert_eq!(x.meta["toy"]["solution"]["path"], "calc/core.py");
            assert!(x.patch.contains("a/calc/core.py"), "{}", x.patch);
            assert!(x.test_patch.contains("from calc.core import"));
            assert_eq!(s.instance_id, x.instance_id);
            assert_eq!(s.meta["toy"]["family"], x.meta["toy"]["family"]);
            assert_eq!(
                s.meta["toy"]["solution"]["old_str"],
                x.meta["toy"]["solution"]["old_str"]
            );
            assert_eq!(s.fail_to_pass, x.fail_to_pass);
            assert!(b
                .path()
                .join(x.repo.as_ref().unwrap())
                .join("calc/core.py")
                .exists());
        }
        assert!(ta.iter().all(|t| t.toy_loose() == Some(false)));
        for name in [
            "no-dash", "class", "tests", "9lives", "json", "os", "pytest", "_thread",
        ] {
            let bad = ToyConfig {
                package: Some(name.into()),
                ..base.clone()
            };
            assert!(generate(&bad, a.path()).is_err(), "{name}");
        }
        // A name too long for a file name is refused before any folder is
        // made (300 characters left a half-made pool).
        let fresh = tempfile::tempdir().unwrap();
        let long = ToyConfig {
            package: Some("p".repeat(300)),
            ..base.clone()
        };
        let e = generate(&long, &fresh.path().join("pool")).unwrap_err();
        assert!(e.to_string().contains("at most 64"), "{e}");
        assert!(!fresh.path().join("pool").exists());
    }

    #[test]
    fn replace_line_diff_has_right_counts() {
        let text = "a\nb\nc\nd\ne\n";
        let d = replace_line_diff("x.py", text, 0, "A");
        assert!(d.contains("@@ -1,4 +1,4 @@\n-a\n+A\n b\n c\n d\n"), "{d}");
    }
}
