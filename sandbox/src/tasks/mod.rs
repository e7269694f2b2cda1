//! Tasks: what one unit of RL or evaluation work is, and how task files are
//! read.
//!
//! A task is an issue text, a repository snapshot, hidden tests and a gold
//! patch (docs/ARCHITECTURE.md, recipe step 1). The native format is JSONL with the
//! SWE-bench field names (`instance_id`, `problem_statement`, `patch`,
//! `test_patch`, `FAIL_TO_PASS`, `PASS_TO_PASS`; the test lists may be lists
//! or the JSON-encoded strings SWE-bench ships) plus the environment: a
//! Docker `image` with the repository at `workdir` (exported into the
//! snapshot, its history dropped), or a local `repo` folder (relative to
//! the task file) that becomes the snapshot; `test_cmd`;
//! `log_parser`. [`load_tasks`] also maps SWE-bench and R2E-Gym /
//! SWE-rebench style records onto it ([`Format`]). Every schema error names
//! the record (line and id) and the field.
//!
//! Not for: running tasks (see [`crate::grading`], [`validate`], [`audit`],
//! [`strengthen`])
//! or token-level anything.

pub mod audit;
mod python_names;
pub mod strengthen;
pub mod toy;
pub mod validate;

use crate::grading::TestSpec;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// One task, normalized.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Task {
    /// Unique id of the task.
    pub instance_id: String,
    /// The issue text shown to the agent.
    pub problem_statement: String,
    /// The gold patch (unified diff); never shown to the agent.
    pub patch: String,
    /// Unified diff adding the hidden tests; never shown to the agent.
    pub test_patch: String,
    /// Tests that fail before the gold patch and pass after it.
    #[serde(rename = "FAIL_TO_PASS")]
    pub fail_to_pass: Vec<String>,
    /// Tests that pass before and after.
    #[serde(rename = "PASS_TO_PASS")]
    pub pass_to_pass: Vec<String>,
    /// Docker image holding the repository at `workdir` (SWE-bench style;
    /// for the local backend a root file system folder or a tag built by
    /// [`crate::image`]). Without `repo`, the snapshot is the image's
    /// `workdir` folder, exported once per image with its history dropped;
    /// with `repo`, the image only runs the commands.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub image: Option<String>,
    /// Local folder holding the repository snapshot; relative paths are
    /// resolved against the task file's folder when loading.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub repo: Option<PathBuf>,
    /// Where the repository lives in the sandbox. Default `/testbed`.
    #[serde(default = "default_workdir")]
    pub workdir: String,
    /// Shell command that runs the tests in the workdir.
    pub test_cmd: String,
    /// Registered log parser. Default `pytest`.
    #[serde(default = "default_parser")]
    pub log_parser: String,
    /// Anything else the source record carried (kept, not interpreted, except
    /// `toy` for the toy pool's ground truth).
    #[serde(default, skip_serializing_if = "Map::is_empty")]
    pub meta: Map<String, Value>,
}

fn default_workdir() -> String {
    "/testbed".into()
}

fn default_parser() -> String {
    "pytest".into()
}

/// Default test command for Python repositories when a record names none:
/// pytest with the `-rA` summary the parser reads, on the test patch's files.
pub const DEFAULT_PYTEST_CMD: &str = "python3 -m pytest -rA -p no:cacheprovider";

impl Task {
    /// The grading spec of this task, with a test-run limit of `timeout_secs`.
    pub fn test_spec(&self, timeout_secs: f64) -> TestSpec {
        TestSpec {
            test_command: self.test_cmd.clone(),
            test_patch: self.test_patch.clone(),
            fail_to_pass: self.fail_to_pass.clone(),
            pass_to_pass: self.pass_to_pass.clone(),
            log_parser: self.log_parser.clone(),
            timeout_secs,
        }
    }

    /// Whether the toy generator made this task loose on purpose (`None` for
    /// tasks that are not toys).
    pub fn toy_loose(&self) -> Option<bool> {
        self.meta.get("toy")?.get("loose")?.as_bool()
    }

    /// Checks what the schema cannot: non-empty id, tests listed, a known log
    /// parser, an environment.
    pub fn check(&self, record: &str) -> Result<()> {
        let bad = |field: &str, msg: &str| {
            Err(Error::InvalidInput(format!(
                "{record}: field `{field}`: {msg}"
            )))
        };
        if self.instance_id.trim().is_empty() {
            return bad("instance_id", "is empty");
        }
        if self.fail_to_pass.is_empty() {
            return bad("FAIL_TO_PASS", "lists no test");
        }
        if self.test_cmd.trim().is_empty() {
            return bad("test_cmd", "is empty");
        }
        if crate::logparse::parser(&self.log_parser).is_none() {
            return bad(
                "log_parser",
                &format!(
                    "unknown parser {:?} (known: {})",
                    self.log_parser,
                    crate::logparse::parser_names().join(", ")
                ),
            );
        }
        if self.image.is_none() && self.repo.is_none() {
            return bad("repo", "neither `repo` nor `image` is given");
        }
        if !self.workdir.starts_with('/') {
            return bad("workdir", "must be an absolute path");
        }
        Ok(())
    }
}

/// Source format of a task file's records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Format {
    /// Decide per record: native when it has `test_cmd` and no `docker_image`
    /// / `image_name`, R2E-Gym / SWE-rebench when it has one of those,
    /// SWE-bench otherwise.
    Auto,
    /// This crate's format (see [`Task`]).
    Native,
    /// SWE-bench / SWE-bench Verified records (`repo` is the GitHub name; the
    /// image is the SWE-bench evaluation image of the instance).
    Swebench,
    /// R2E-Gym and SWE-rebench records (`docker_image` or `image_name`,
    /// test command in `test_cmd` or `install_config.test_cmd`).
    R2e,
}

impl std::str::FromStr for Format {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Format::Auto),
            "native" => Ok(Format::Native),
            "swebench" => Ok(Format::Swebench),
            "r2e" | "rebench" | "swe-rebench" => Ok(Format::R2e),
            _ => Err(Error::InvalidInput(format!(
                "unknown task format {s:?} (auto, native, swebench, r2e)"
            ))),
        }
    }
}

/// Reads a JSONL task file (blank lines skipped) in `format`; relative
/// `repo` folders resolve against the file's folder. Fails on the first bad
/// record, naming its line, id and field; duplicate ids are an error.
pub fn load_tasks(path: &Path, format: Format) -> Result<Vec<Task>> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading {}", path.display()), e))?;
    let base = path.parent().unwrap_or(Path::new("."));
    let tasks = parse_tasks(&text, format, &path.display().to_string())?;
    Ok(tasks
        .into_iter()
        .map(|mut t| {
            if let Some(r) = &t.repo {
                if r.is_relative() {
                    t.repo = Some(base.join(r));
                }
            }
            t
        })
        .collect())
}

/// Parses JSONL text; `source` names the file in errors. A leading UTF-8
/// byte-order mark (some editors write one) is not part of the first line.
pub fn parse_tasks(text: &str, format: Format, source: &str) -> Result<Vec<Task>> {
    let mut out: Vec<Task> = Vec::new();
    let mut seen = std::collections::HashSet::new();
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let value: Value = serde_json::from_str(line).map_err(|e| {
            Error::InvalidInput(format!("{source}:{}: not a JSON object: {e}", i + 1))
        })?;
        let id = value
            .get("instance_id")
            .and_then(Value::as_str)
            .unwrap_or("?")
            .to_string();
        let record = format!("{source}:{} (instance_id {id:?})", i + 1);
        let task = parse_record(&value, format, &record)?;
        if !seen.insert(task.instance_id.clone()) {
            return Err(Error::InvalidInput(format!(
                "{record}: field `instance_id`: duplicate id"
            )));
        }
        out.push(task);
    }
    Ok(out)
}

/// Maps one record onto a [`Task`]; errors start with `record`.
pub fn parse_record(value: &Value, format: Format, record: &str) -> Result<Task> {
    let obj = value
        .as_object()
        .ok_or_else(|| Error::InvalidInput(format!("{record}: the record is not a JSON object")))?;
    let format = match format {
        Format::Auto => {
            if obj.contains_key("docker_image") || obj.contains_key("image_name") {
                Format::R2e
            } else if obj.contains_key("test_cmd") {
                Format::Native
            } else {
                Format::Swebench
            }
        }
        f => f,
    };
    let r = Record { obj, record };
    let fail_to_pass = r.test_list("FAIL_TO_PASS", true)?;
    let pass_to_pass = r.test_list("PASS_TO_PASS", false)?;
    let instance_id = r.string("instance_id", true)?;
    let problem_statement = r.string("problem_statement", true)?;
    let patch = r.string("patch", true)?;
    let test_patch = r.string("test_patch", false)?;
    // What the formats differ in: where the image and the test command
    // come from, and the fields that name them.
    let (image, repo, test_cmd, own): (_, _, _, &[&str]) = match format {
        Format::Native | Format::Auto => (
            r.opt_string("image")?,
            r.opt_string("repo")?.map(PathBuf::from),
            r.string("test_cmd", true)?,
            &["image", "repo", "test_cmd", "meta"],
        ),
        Format::Swebench => {
            // SWE-bench's evaluation images: `__` in the id becomes `_1776_`.
            let image = match r.opt_string("image")? {
                Some(i) => i,
                None => format!(
                    "swebench/sweb.eval.x86_64.{}:latest",
                    instance_id.replace("__", "_1776_").to_lowercase()
                ),
            };
            let test_cmd = match r.opt_string("test_cmd")? {
                Some(c) => c,
                None => default_test_cmd(&test_patch),
            };
            (Some(image), None, test_cmd, &["image", "test_cmd"])
        }
        Format::R2e => {
            let image = match r.opt_string("docker_image")? {
                Some(i) => i,
                None => match r.opt_string("image_name")? {
                    Some(i) => i,
                    None => r.string("image", true)?,
                },
            };
            let from_install = match obj.get("install_config") {
                Some(Value::Object(c)) => match c.get("test_cmd") {
                    Some(Value::String(s)) => Some(s.clone()),
                    Some(Value::Array(a)) => Some(
                        a.iter()
                            .filter_map(Value::as_str)
                            .collect::<Vec<_>>()
                            .join(" && "),
                    ),
                    Some(_) => {
                        return Err(Error::InvalidInput(format!(
                            "{record}: field `install_config.test_cmd`: expected a string or a list of strings"
                        )))
                    }
                    None => None,
                },
                _ => None,
            };
            let test_cmd = match r.opt_string("test_cmd")? {
                Some(c) => c,
                None => from_install.unwrap_or_else(|| default_test_cmd(&test_patch)),
            };
            (
                Some(image),
                None,
                test_cmd,
                &["docker_image", "image_name", "image", "test_cmd"],
            )
        }
    };
    let mut known = vec![
        "instance_id",
        "problem_statement",
        "patch",
        "test_patch",
        "FAIL_TO_PASS",
        "PASS_TO_PASS",
        "workdir",
        "log_parser",
    ];
    known.extend_from_slice(own);
    let task = Task {
        instance_id,
        problem_statement,
        patch,
        test_patch,
        fail_to_pass,
        pass_to_pass,
        image,
        repo,
        workdir: r.opt_string("workdir")?.unwrap_or_else(default_workdir),
        test_cmd,
        log_parser: r.opt_string("log_parser")?.unwrap_or_else(default_parser),
        meta: r.rest(&known),
    };
    task.check(record)?;
    Ok(task)
}

/// pytest on the files the test patch touches (all tests when it touches
/// none).
pub fn default_test_cmd(test_patch: &str) -> String {
    let files: Vec<String> = crate::grading::patch_paths(test_patch)
        .into_iter()
        .filter(|p| p.ends_with(".py"))
        .collect();
    if files.is_empty() {
        DEFAULT_PYTEST_CMD.to_string()
    } else {
        format!("{DEFAULT_PYTEST_CMD} {}", files.join(" "))
    }
}

struct Record<'a> {
    obj: &'a Map<String, Value>,
    record: &'a str,
}

impl Record<'_> {
    fn err(&self, field: &str, msg: &str) -> Error {
        Error::InvalidInput(format!("{}: field `{field}`: {msg}", self.record))
    }

    fn string(&self, field: &str, required: bool) -> Result<String> {
        match self.obj.get(field) {
            Some(Value::String(s)) => Ok(s.clone()),
            None | Some(Value::Null) if !required => Ok(String::new()),
            None | Some(Value::Null) => Err(self.err(field, "is missing")),
            Some(v) => Err(self.err(field, &format!("expected a string, got {}", kind(v)))),
        }
    }

    fn opt_string(&self, field: &str) -> Result<Option<String>> {
        match self.obj.get(field) {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            None | Some(Value::Null) => Ok(None),
            Some(v) => Err(self.err(field, &format!("expected a string, got {}", kind(v)))),
        }
    }

    /// A list of test ids, or the JSON string of one (SWE-bench).
    fn test_list(&self, field: &str, required: bool) -> Result<Vec<String>> {
        let v = match self.obj.get(field) {
            None | Some(Value::Null) if !required => return Ok(vec![]),
            None | Some(Value::Null) => return Err(self.err(field, "is missing")),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .map_err(|e| self.err(field, &format!("a string that is not a JSON list: {e}")))?,
            Some(v) => v.clone(),
        };
        let Value::Array(items) = v else {
            return Err(self.err(field, &format!("expected a list, got {}", kind(&v))));
        };
        items
            .iter()
            .enumerate()
            .map(|(i, x)| match x {
                Value::String(s) if !s.trim().is_empty() => Ok(s.clone()),
                _ => Err(self.err(field, &format!("item {i} is not a non-empty string: {x}"))),
            })
            .collect()
    }

    fn rest(&self, known: &[&str]) -> Map<String, Value> {
        let mut out = Map::new();
        if let Some(Value::Object(m)) = self.obj.get("meta") {
            out.extend(m.clone());
        }
        for (k, v) in self.obj {
            if !known.contains(&k.as_str()) {
                out.insert(k.clone(), v.clone());
            }
        }
        out
    }
}

fn kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Writes tasks as JSONL (one record a line), `repo` paths as given.
pub fn write_tasks(path: &Path, tasks: &[Task]) -> Result<()> {
    let mut text = String::new();
    for t in tasks {
        let line = serde_json::to_string(t)
            .map_err(|e| Error::InvalidInput(format!("serializing {}: {e}", t.instance_id)))?;
        text.push_str(&line);
        text.push('\n');
    }
    std::fs::write(path, text).map_err(|e| Error::io(format!("writing {}", path.display()), e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn native() -> Value {
        json!({
            "instance_id": "t1", "problem_statement": "bug", "patch": "p",
            "test_patch": "", "FAIL_TO_PASS": ["a::b"], "PASS_TO_PASS": [],
            "repo": "repos/t1", "test_cmd": "pytest -rA"
        })
    }

    #[test]
    fn parses_native_and_defaults() {
        let t = parse_record(&native(), Format::Auto, "r").unwrap();
        assert_eq!(t.workdir, "/testbed");
        assert_eq!(t.log_parser, "pytest");
        assert_eq!(t.repo, Some(PathBuf::from("repos/t1")));
    }

    /// A file an editor saved with a byte-order mark reads as without one.
    #[test]
    fn a_byte_order_mark_is_not_part_of_the_first_record() {
        let line = native().to_string();
        let tasks = parse_tasks(&format!("\u{feff}{line}\n"), Format::Auto, "f").unwrap();
        assert_eq!(tasks[0].instance_id, "t1");
        // Anywhere else it is the bad input it is.
        let err = parse_tasks(&format!("{line}\n\u{feff}{line}\n"), Format::Auto, "f");
        assert!(err.unwrap_err().to_string().contains("f:2"));
    }

    #[test]
    fn parses_swebench_json_string_lists() {
        let v = json!({
            "instance_id": "astropy__astropy-12907", "repo": "astropy/astropy",
            "problem_statement": "x", "patch": "p",
            "test_patch": "diff --git a/astropy/tests/test_a.py b/astropy/tests/test_a.py\n",
            "FAIL_TO_PASS": "[\"astropy/tests/test_a.py::test_x\"]",
            "PASS_TO_PASS": "[]", "base_commit": "abc"
        });
        let t = parse_record(&v, Format::Auto, "r").unwrap();
        assert_eq!(t.fail_to_pass, vec!["astropy/tests/test_a.py::test_x"]);
        assert_eq!(
            t.image.as_deref(),
            Some("swebench/sweb.eval.x86_64.astropy_1776_astropy-12907:latest")
        );
        assert!(t.test_cmd.ends_with("astropy/tests/test_a.py"));
        assert_eq!(t.meta["repo"], "astropy/astropy");
    }

    #[test]
    fn parses_rebench_install_config() {
        let v = json!({
            "instance_id": "x__y-1", "problem_statement": "x", "patch": "p",
            "FAIL_TO_PASS": ["t::a"], "docker_image": "img:1",
            "install_config": {"test_cmd": "pytest -rA tests"}
        });
        let t = parse_record(&v, Format::Auto, "r").unwrap();
        assert_eq!(t.image.as_deref(), Some("img:1"));
        assert_eq!(t.test_cmd, "pytest -rA tests");
    }

    #[test]
    fn errors_name_record_and_field() {
        let mut v = native();
        v["FAIL_TO_PASS"] = json!("not json");
        let e = parse_record(&v, Format::Native, "f.jsonl:3 (instance_id \"t1\")")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("f.jsonl:3") && e.contains("`FAIL_TO_PASS`"),
            "{e}"
        );
        let mut v = native();
        v["patch"] = json!(3);
        let e = parse_record(&v, Format::Native, "rec")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`patch`") && e.contains("a number"), "{e}");
        let mut v = native();
        v.as_object_mut().unwrap().remove("test_cmd");
        let e = parse_record(&v, Format::Native, "rec")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`test_cmd`") && e.contains("missing"), "{e}");
        let mut v = native();
        v["log_parser"] = json!("junit");
        let e = parse_record(&v, Format::Native, "rec")
            .unwrap_err()
            .to_string();
        assert!(e.contains("`log_parser`"), "{e}");
        let text = format!("{}\n\n{}\n", native(), native());
        let e = parse_tasks(&text, Format::Auto, "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("f:3") && e.contains("duplicate"), "{e}");
        let e = parse_tasks("{oops\n", Format::Auto, "f")
            .unwrap_err()
            .to_string();
        assert!(e.contains("f:1"), "{e}");
    }
}
