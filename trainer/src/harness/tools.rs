//! The agent's tools, run in its sandbox: `bash`, `str_replace_based_edit_tool`
//! (view with line numbers, create, str_replace matching exactly once,
//! insert, undo_edit) and `submit`, with their JSON schemas.
//!
//! Mini-SWE-Agent-Plus style: every observation is plain text, truncated
//! head-and-tail with a notice. A tool misuse (missing file, no unique
//! match) is an observation for the agent; a failure of the sandbox
//! machinery is a [`ToolError::Infra`] that ends the rollout as `infra`.
//! Not for: grading (`submit` is handled by the rollout, which grades the
//! diff in a fresh sandbox) or format checking (see `format`).

use super::format::ToolCall;
use arcticd_sandbox::{ExecRequest, Sandbox};
use serde_json::{json, Value};
use std::collections::HashMap;

/// The tool schemas in OpenAI function format, rendered into the prompt by
/// the chat template and used by the format check.
pub fn tool_schemas() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {
            "name": "bash",
            "description": "Run a shell command in the repository (the working directory). No network. Output is truncated when long.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string", "description": "The command to run with sh -c."},
                "timeout": {"type": "integer", "description": "Seconds before the command is killed (default 60)."}
            }, "required": ["command"]}
        }}),
        json!({"type": "function", "function": {
            "name": "str_replace_based_edit_tool",
            "description": "View, create and edit files. view shows a file with line numbers or lists a folder; create writes a new file; str_replace replaces old_str, which must occur exactly once, with new_str; insert adds new_str after line insert_line (0 for the top); undo_edit reverts the last edit of the file.",
            "parameters": {"type": "object", "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert", "undo_edit"]},
                "path": {"type": "string", "description": "File or folder, relative to the repository or absolute."},
                "file_text": {"type": "string", "description": "Content for create."},
                "old_str": {"type": "string", "description": "Exact text to replace (str_replace)."},
                "new_str": {"type": "string", "description": "Replacement (str_replace) or text to insert (insert)."},
                "insert_line": {"type": "integer", "description": "Line after which to insert (insert)."},
                "view_range": {"type": "array", "items": {"type": "integer"}, "description": "[first, last] lines to view; last -1 means the end."}
            }, "required": ["command", "path"]}
        }}),
        json!({"type": "function", "function": {
            "name": "submit",
            "description": "Submit the current state of the repository as the fix. Ends the episode; the change is graded by hidden tests.",
            "parameters": {"type": "object", "properties": {}, "required": []}
        }}),
    ]
}

/// A failure of the sandbox machinery (not of the agent's command).
#[derive(Debug)]
pub enum ToolError {
    Infra(arcticd_sandbox::Error),
}

impl std::fmt::Display for ToolError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ToolError::Infra(e) => write!(f, "sandbox infrastructure error: {e}"),
        }
    }
}

/// What a tool call produced.
#[derive(Debug, Clone, PartialEq)]
pub enum ToolOutcome {
    /// Text for the agent.
    Observation(String),
    /// The agent submitted.
    Submit,
}

/// Whether a sandbox error is the agent's doing (an observation) or the
/// machinery's (infra).
fn classify(e: arcticd_sandbox::Error) -> Result<String, ToolError> {
    use arcticd_sandbox::Error as E;
    match e {
        E::Sandbox(m) => Ok(format!("Error: {m}")),
        E::InvalidInput(m) => Ok(format!("Error: {m}")),
        e @ E::TooLarge { .. } => Ok(format!("Error: {e}")),
        e => Err(ToolError::Infra(e)),
    }
}

/// Cuts `text` to at most `max_chars`, keeping the head and the tail.
pub fn truncate_middle(text: &str, max_chars: usize) -> String {
    let n = text.chars().count();
    if n <= max_chars || max_chars == 0 {
        return text.to_string();
    }
    let half = max_chars / 2;
    let head: String = text.chars().take(half).collect();
    let tail: String = text.chars().skip(n - (max_chars - half)).collect();
    format!(
        "{head}\n[... {} characters truncated; narrow the command to see them ...]\n{tail}",
        n - max_chars
    )
}

/// Runs tool calls in one sandbox and remembers file versions for undo.
pub struct ToolBox<'a> {
    sandbox: &'a dyn Sandbox,
    history: HashMap<String, Vec<Option<Vec<u8>>>>,
    /// Default bash timeout, seconds.
    pub bash_timeout_secs: f64,
    /// Largest bash timeout the agent may ask for, seconds.
    pub max_bash_timeout_secs: f64,
}

fn arg<'v>(call: &'v ToolCall, name: &str) -> Option<&'v Value> {
    call.arguments.get(name)
}

fn str_arg<'v>(call: &'v ToolCall, name: &str) -> Option<&'v str> {
    arg(call, name).and_then(Value::as_str)
}

impl<'a> ToolBox<'a> {
    pub fn new(
        sandbox: &'a dyn Sandbox,
        bash_timeout_secs: f64,
        max_bash_timeout_secs: f64,
    ) -> Self {
        ToolBox {
            sandbox,
            history: HashMap::new(),
            bash_timeout_secs,
            max_bash_timeout_secs,
        }
    }

    /// Runs one (format-checked) call.
    pub async fn run(&mut self, call: &ToolCall) -> Result<ToolOutcome, ToolError> {
        let text = match call.name.as_str() {
            "submit" => return Ok(ToolOutcome::Submit),
            "bash" => self.bash(call).await?,
            "str_replace_based_edit_tool" => self.edit(call).await?,
            other => format!("Error: unknown tool {other}"),
        };
        Ok(ToolOutcome::Observation(text))
    }

    async fn bash(&mut self, call: &ToolCall) -> Result<String, ToolError> {
        let Some(command) = str_arg(call, "command") else {
            return Ok("Error: bash needs a command".into());
        };
        let timeout = arg(call, "timeout")
            .and_then(Value::as_f64)
            .filter(|t| *t > 0.0)
            .unwrap_or(self.bash_timeout_secs)
            .min(self.max_bash_timeout_secs);
        let r = match self
            .sandbox
            .exec(ExecRequest::shell(command).timeout(timeout))
            .await
        {
            Ok(r) => r,
            // The command itself cannot be run (a NUL byte in it): the
            // agent's doing, shown to it like any failed command.
            Err(arcticd_sandbox::Error::InvalidInput(m)) => return Ok(format!("Error: {m}")),
            Err(e) => return Err(ToolError::Infra(e)),
        };
        let mut out = r.stdout.text();
        let err = r.stderr.text();
        if !err.is_empty() {
            if !out.is_empty() && !out.ends_with('\n') {
                out.push('\n');
            }
            out.push_str(&err);
        }
        if r.timed_out {
            out.push_str(&format!(
                "\n[command timed out after {timeout} s and was killed]"
            ));
        } else if r.memory_exceeded {
            out.push_str("\n[command killed: memory limit exceeded]");
        } else if let Some(code) = r.exit_code.filter(|c| *c != 0) {
            out.push_str(&format!("\n[exit code {code}]"));
        }
        if out.trim().is_empty() {
            out = "[no output]".into();
        }
        Ok(out)
    }

    async fn read_text(&self, path: &str) -> Result<Result<String, String>, ToolError> {
        match self.sandbox.read_file(path).await {
            Ok(b) => {
                Ok(String::from_utf8(b).map_err(|_| format!("Error: {path} is not UTF-8 text")))
            }
            Err(e) => classify(e).map(Err),
        }
    }

    async fn is_dir(&self, path: &str) -> Result<bool, ToolError> {
        let r = self
            .sandbox
            .exec(ExecRequest::argv(["test", "-d", path]))
            .await
            .map_err(ToolError::Infra)?;
        Ok(r.success())
    }

    async fn exists(&self, path: &str) -> Result<bool, ToolError> {
        let r = self
            .sandbox
            .exec(ExecRequest::argv(["test", "-e", path]))
            .await
            .map_err(ToolError::Infra)?;
        Ok(r.success())
    }

    async fn write(
        &mut self,
        path: &str,
        old: Option<Vec<u8>>,
        new: &str,
    ) -> Result<Option<String>, ToolError> {
        if let Err(e) = self.sandbox.write_file(path, new.as_bytes()).await {
            return classify(e).map(Some);
        }
        self.history.entry(path.to_string()).or_default().push(old);
        Ok(None)
    }

    async fn edit(&mut self, call: &ToolCall) -> Result<String, ToolError> {
        let (Some(cmd), Some(path)) = (str_arg(call, "command"), str_arg(call, "path")) else {
            return Ok("Error: command and path are required".into());
        };
        match cmd {
            "view" => {
                if self.is_dir(path).await? {
                    let r = self
                        .sandbox
                        .exec(ExecRequest::argv([
                            "find",
                            path,
                            "-maxdepth",
                            "2",
                            "-not",
                            "-path",
                            "*/.*",
                        ]))
                        .await
                        .map_err(ToolError::Infra)?;
                    let mut lines: Vec<String> =
                        r.stdout.text().lines().map(str::to_string).collect();
                    lines.sort();
                    return Ok(format!(
                        "Files and folders up to 2 levels deep in {path}:\n{}",
                        lines.join("\n")
                    ));
                }
                let text = match self.read_text(path).await? {
                    Ok(t) => t,
                    Err(e) => return Ok(e),
                };
                let lines: Vec<&str> = text.lines().collect();
                let (mut lo, mut hi) = (1usize, lines.len());
                if let Some(Value::Array(r)) = arg(call, "view_range") {
                    let a = r.first().and_then(Value::as_i64).unwrap_or(1);
                    let b = r.get(1).and_then(Value::as_i64).unwrap_or(-1);
                    if r.len() != 2
                        || a < 1
                        || (b != -1 && b < a)
                        || a as usize > lines.len().max(1)
                    {
                        return Ok(format!(
                            "Error: invalid view_range {r:?} for a file of {} lines",
                            lines.len()
                        ));
                    }
                    lo = a as usize;
                    if b != -1 {
                        hi = (b as usize).min(lines.len());
                    }
                }
                let body: Vec<String> = lines
                    .iter()
                    .enumerate()
                    .skip(lo - 1)
                    .take(hi + 1 - lo)
                    .map(|(i, l)| format!("{:6}\t{l}", i + 1))
                    .collect();
                Ok(format!(
                    "Here is {path} (lines {lo}-{hi}):\n{}",
                    body.join("\n")
                ))
            }
            "create" => {
                let Some(text) = str_arg(call, "file_text") else {
                    return Ok("Error: create needs file_text".into());
                };
                let old = if self.exists(path).await? {
                    match self.sandbox.read_file(path).await {
                        Ok(b) => Some(b),
                        Err(e) => return classify(e),
                    }
                } else {
                    None
                };
                if let Some(parent) = std::path::Path::new(path).parent().and_then(|p| p.to_str()) {
                    if !parent.is_empty() {
                        self.sandbox
                            .exec(ExecRequest::argv(["mkdir", "-p", parent]))
                            .await
                            .map_err(ToolError::Infra)?;
                    }
                }
                Ok(self
                    .write(path, old, text)
                    .await?
                    .unwrap_or_else(|| format!("File created: {path}")))
            }
            "str_replace" => {
                let Some(old_str) = str_arg(call, "old_str") else {
                    return Ok("Error: str_replace needs old_str".into());
                };
                let new_str = str_arg(call, "new_str").unwrap_or("");
                let text = match self.read_text(path).await? {
                    Ok(t) => t,
                    Err(e) => return Ok(e),
                };
                if old_str.is_empty() {
                    return Ok("Error: old_str is empty".into());
                }
                let n = text.matches(old_str).count();
                if n != 1 {
                    return Ok(format!(
                        "Error: old_str occurs {n} times in {path}; it must occur exactly once. Nothing was changed."
                    ));
                }
                let new_text = text.replacen(old_str, new_str, 1);
                Ok(self
                    .write(path, Some(text.into_bytes()), &new_text)
                    .await?
                    .unwrap_or_else(|| format!("Replaced one occurrence in {path}.")))
            }
            "insert" => {
                let (Some(line), Some(new_str)) = (
                    arg(call, "insert_line").and_then(Value::as_i64),
                    str_arg(call, "new_str"),
                ) else {
                    return Ok("Error: insert needs insert_line and new_str".into());
                };
                let text = match self.read_text(path).await? {
                    Ok(t) => t,
                    Err(e) => return Ok(e),
                };
                let mut lines: Vec<&str> = text.lines().collect();
                if line < 0 || line as usize > lines.len() {
                    return Ok(format!(
                        "Error: insert_line {line} is outside 0..={}",
                        lines.len()
                    ));
                }
                let ins: Vec<&str> = new_str.lines().collect();
                let at = line as usize;
                lines.splice(at..at, ins);
                let mut new_text = lines.join("\n");
                if text.ends_with('\n') || text.is_empty() {
                    new_text.push('\n');
                }
                Ok(self
                    .write(path, Some(text.into_bytes()), &new_text)
                    .await?
                    .unwrap_or_else(|| format!("Inserted after line {line} of {path}.")))
            }
            "undo_edit" => {
                let Some(prev) = self.history.get_mut(path).and_then(Vec::pop) else {
                    return Ok(format!("Error: no edit of {path} to undo"));
                };
                match prev {
                    Some(bytes) => {
                        if let Err(e) = self.sandbox.write_file(path, &bytes).await {
                            return classify(e);
                        }
                    }
                    None => {
                        self.sandbox
                            .exec(ExecRequest::argv(["rm", "-f", path]))
                            .await
                            .map_err(ToolError::Infra)?;
                    }
                }
                Ok(format!("Last edit of {path} undone."))
            }
            other => Ok(format!("Error: unknown command {other}")),
        }
    }
}
