//! Qwen3.5's tool-call format in one place: [`render_call`] writes it,
//! [`check`] is the strict raw-text check the training gate applies, and
//! [`parse_lenient`] is the forgiving parser the OpenAI server uses (and the
//! `format_check = "lenient"` ablation, through [`check_lenient`]). The chat
//! template (`chat.rs`) renders past calls in the same form; a test holds
//! [`render_call`] equal to it.
//!
//! The strict check reads the raw generated text of one assistant turn,
//! before any lenient parsing, and accepts exactly this grammar (Qwen3.5's
//! XML tool calls, as its chat template renders them):
//!
//! ```text
//! turn   := prefix "<tool_call>\n<function=" NAME ">\n" param* "</function>\n</tool_call>" ws
//! param  := "<parameter=" PNAME ">\n" VALUE "\n</parameter>\n"
//! ```
//!
//! `prefix` is free text (reasoning) holding no tool-call tag; a `<think>`
//! opened in it must be closed before the call, so a call inside thinking is
//! rejected. `ws` is whitespace only: nothing may follow the call, and so a
//! second call is rejected. A VALUE ends at the first `\n</parameter>\n`; a
//! value line that is itself a structural tag (`<parameter=...`,
//! `</function>`, `<tool_call>`, `</tool_call>`) is rejected as ambiguous,
//! which is what catches a missing `</parameter>`. Values may hold `<`,
//! XML-like text and any Unicode. The call is then checked against the tool
//! schemas (OpenAI function format): known tool, known and non-repeated
//! parameters, required ones present, and values of the declared JSON type
//! without coercion (`"30s"` is not an integer, `yes` is not a boolean).
//!
//! What the strict check does not accept, on purpose, and the lenient parser
//! repairs (as vLLM's qwen3_coder parser does): an unclosed `<tool_call>`, a
//! missing `</parameter>` or `</function>` at the end, several calls,
//! trailing text, a repeated parameter (the last wins), and calls inside
//! `<think>`. Not for: running the call (the harness's tools).

use serde::Serialize;
use serde_json::{Map, Value};

/// A well-formed tool call with typed arguments.
#[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Map<String, Value>,
}

/// Why a turn is not a well-formed tool call.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FormatViolation {
    /// Stable short code, e.g. `trailing_text`, `unknown_tool`.
    pub code: &'static str,
    /// What exactly is wrong, for transcripts.
    pub detail: String,
}

impl std::fmt::Display for FormatViolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code, self.detail)
    }
}

fn bad<T>(code: &'static str, detail: impl Into<String>) -> Result<T, FormatViolation> {
    Err(FormatViolation {
        code,
        detail: detail.into(),
    })
}

const OPEN_CALL: &str = "<tool_call>";
const CLOSE_CALL: &str = "</tool_call>";
const STRUCTURAL: [&str; 6] = [
    "<tool_call>",
    "</tool_call>",
    "<function=",
    "</function>",
    "<parameter=",
    "</parameter>",
];

fn is_name(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-' || c == '.')
}

/// Checks one raw assistant turn (the stop token excluded) against the
/// grammar and `tools` (OpenAI-style `{"type":"function","function":{...}}`
/// or bare `{"name", "parameters"}` objects).
pub fn check(raw: &str, tools: &[Value]) -> Result<ToolCall, FormatViolation> {
    let Some(open) = raw.find(OPEN_CALL) else {
        if raw.contains("<function=") {
            return bad("no_wrapper", "a <function=...> without <tool_call>");
        }
        return bad("no_tool_call", "the turn holds no <tool_call>");
    };
    let prefix = &raw[..open];
    if let Some(tag) = STRUCTURAL.iter().find(|t| prefix.contains(**t)) {
        return bad("stray_tag", format!("{tag} before the <tool_call>"));
    }
    if let Some(t) = prefix.rfind("<think>") {
        if !prefix[t..].contains("</think>") {
            return bad(
                "call_inside_think",
                "the call is inside an unclosed <think>",
            );
        }
    }
    let mut rest = &raw[open + OPEN_CALL.len()..];
    rest = match rest.strip_prefix("\n<function=") {
        Some(r) => r,
        None => {
            return bad(
                "malformed_call_open",
                "<tool_call> must be followed by a newline and <function=NAME>",
            )
        }
    };
    let Some(gt) = rest.find(">\n") else {
        return bad(
            "malformed_function_tag",
            "<function=NAME> is not closed by '>' and a newline",
        );
    };
    let name = &rest[..gt];
    if !is_name(name) {
        return bad(
            "malformed_function_tag",
            format!("bad function name {name:?}"),
        );
    }
    rest = &rest[gt + 2..];
    let mut params: Vec<(String, String)> = Vec::new();
    while let Some(r) = rest.strip_prefix("<parameter=") {
        let Some(gt) = r.find(">\n") else {
            return bad(
                "malformed_parameter_tag",
                "<parameter=NAME> is not closed by '>' and a newline",
            );
        };
        let pname = &r[..gt];
        if !is_name(pname) {
            return bad(
                "malformed_parameter_tag",
                format!("bad parameter name {pname:?}"),
            );
        }
        let body = &r[gt + 2..];
        let Some(end) = body.find("\n</parameter>\n") else {
            return bad(
                "unclosed_parameter",
                format!("parameter {pname} has no '\\n</parameter>\\n'"),
            );
        };
        let value = &body[..end];
        for line in value.lines() {
            let t = line.trim();
            if t.starts_with("<parameter=")
                || t == "</function>"
                || t == OPEN_CALL
                || t == CLOSE_CALL
                || t.starts_with("<function=")
            {
                return bad(
                    "unclosed_parameter",
                    format!("value of {pname} holds the structural line {t:?}"),
                );
            }
        }
        if params.iter().any(|(p, _)| p == pname) {
            return bad(
                "duplicate_parameter",
                format!("parameter {pname} given twice"),
            );
        }
        params.push((pname.to_string(), value.to_string()));
        rest = &body[end + "\n</parameter>\n".len()..];
    }
    let Some(after) = rest.strip_prefix("</function>\n</tool_call>") else {
        if rest.starts_with("</function>") {
            return bad(
                "malformed_call_close",
                "</function> must be followed by a newline and </tool_call>",
            );
        }
        return bad(
            "missing_function_close",
            format!(
                "expected <parameter=...> or </function>, found {:?}",
                head(rest)
            ),
        );
    };
    if !after.trim().is_empty() {
        if after.contains(OPEN_CALL) || after.contains("<function=") {
            return bad("multiple_calls", "more than one tool call in the turn");
        }
        return bad(
            "trailing_text",
            format!("text after the call: {:?}", head(after.trim())),
        );
    }
    let arguments = check_schema(name, &params, tools)?;
    Ok(ToolCall {
        name: name.to_string(),
        arguments,
    })
}

fn head(s: &str) -> String {
    s.chars().take(40).collect()
}

/// Checks that `tools` are schemas [`check`] can judge calls against:
/// each an object (OpenAI's `{"type": "function", "function": {...}}` or
/// the bare function) with a non-empty string `name`, unique among them,
/// and `parameters`, when given, an object whose `properties` is an
/// object and whose `required` is a list of strings. The message names
/// the first tool that is not.
pub fn check_tools(tools: &[Value]) -> Result<(), String> {
    let mut seen: Vec<&str> = Vec::new();
    for (i, t) in tools.iter().enumerate() {
        let f = function_of(t);
        if !f.is_object() {
            return Err(format!(
                "tools[{i}] is not an object with a function's name and parameters"
            ));
        }
        let name = match f.get("name").and_then(Value::as_str) {
            Some(n) if !n.trim().is_empty() => n,
            _ => return Err(format!("tools[{i}] has no function name")),
        };
        // OpenAI's rule; the call format writes the name inside a tag.
        let fits = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '-';
        if name.len() > 64 || !name.chars().all(fits) {
            return Err(format!(
                "tools[{i}]: the function name {name:?} must be 1 to 64 letters, digits, _ or -"
            ));
        }
        if seen.contains(&name) {
            return Err(format!("tools[{i}]: the name {name:?} is given twice"));
        }
        seen.push(name);
        if let Some(p) = f.get("parameters") {
            let ok = p.is_object()
                && p.get("properties").is_none_or(Value::is_object)
                && p.get("required")
                    .is_none_or(|r| r.as_array().is_some_and(|a| a.iter().all(Value::is_string)));
            if !ok {
                return Err(format!(
                    "tools[{i}] ({name}): parameters must be a JSON schema object, with \
                     `properties` an object and `required` a list of names"
                ));
            }
        }
    }
    Ok(())
}

/// The function a tool describes: OpenAI's `{"type": "function",
/// "function": {...}}` wrapper, or the bare function object.
pub fn function_of(tool: &Value) -> &Value {
    tool.get("function").unwrap_or(tool)
}

/// The `{"name", "parameters"}` object of `name` among `tools`.
fn find_tool<'a>(name: &str, tools: &'a [Value]) -> Option<&'a Value> {
    tools.iter().find_map(|t| {
        let f = function_of(t);
        (f.get("name").and_then(Value::as_str) == Some(name)).then_some(f)
    })
}

fn check_schema(
    name: &str,
    params: &[(String, String)],
    tools: &[Value],
) -> Result<Map<String, Value>, FormatViolation> {
    let Some(tool) = find_tool(name, tools) else {
        return bad("unknown_tool", format!("no tool named {name:?}"));
    };
    let empty = Map::new();
    let props = tool
        .get("parameters")
        .and_then(|p| p.get("properties"))
        .and_then(Value::as_object)
        .unwrap_or(&empty);
    let required: Vec<&str> = tool
        .get("parameters")
        .and_then(|p| p.get("required"))
        .and_then(Value::as_array)
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    let mut out = Map::new();
    for (p, raw) in params {
        let Some(schema) = props.get(p) else {
            return bad(
                "unknown_parameter",
                format!("{name} has no parameter {p:?}"),
            );
        };
        let v = typed(raw, schema).map_err(|why| FormatViolation {
            code: "bad_type",
            detail: format!("{name}.{p}: {why}"),
        })?;
        if let Some(allowed) = schema.get("enum").and_then(Value::as_array) {
            if !allowed.contains(&v) {
                return bad(
                    "not_in_enum",
                    format!("{name}.{p} = {v} is not one of {allowed:?}"),
                );
            }
        }
        out.insert(p.clone(), v);
    }
    if let Some(missing) = required.iter().find(|r| !out.contains_key(**r)) {
        return bad("missing_parameter", format!("{name} needs {missing:?}"));
    }
    Ok(out)
}

fn is_json_int(s: &str) -> bool {
    let d = s.strip_prefix('-').unwrap_or(s);
    !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()) && (d == "0" || !d.starts_with('0'))
}

/// The value of a raw parameter under its JSON-schema type, with no
/// coercion beyond reading the declared type's literal syntax.
fn typed(raw: &str, schema: &Value) -> Result<Value, String> {
    let ty = schema
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("string");
    match ty {
        "string" => Ok(Value::String(raw.to_string())),
        "integer" => {
            if !is_json_int(raw) {
                return Err(format!("{raw:?} is not an integer"));
            }
            raw.parse::<i64>()
                .map(Value::from)
                .map_err(|_| format!("{raw:?} is out of range"))
        }
        "number" => match serde_json::from_str::<Value>(raw) {
            Ok(v @ Value::Number(_)) if raw == raw.trim() => Ok(v),
            _ => Err(format!("{raw:?} is not a number")),
        },
        "boolean" => match raw {
            "true" => Ok(Value::Bool(true)),
            "false" => Ok(Value::Bool(false)),
            _ => Err(format!("{raw:?} is not true or false")),
        },
        "array" | "object" => {
            let v: Value = serde_json::from_str(raw).map_err(|_| format!("{raw:?} is not JSON"))?;
            let ok = match (&v, ty) {
                (Value::Array(items), "array") => {
                    let item_ty = schema
                        .get("items")
                        .and_then(|i| i.get("type"))
                        .and_then(Value::as_str);
                    items.iter().all(|x| match item_ty {
                        Some("integer") => x.as_i64().is_some(),
                        Some("number") => x.is_number(),
                        Some("string") => x.is_string(),
                        Some("boolean") => x.is_boolean(),
                        _ => true,
                    })
                }
                (Value::Object(_), "object") => true,
                _ => false,
            };
            if ok {
                Ok(v)
            } else {
                Err(format!("{raw:?} is not a valid {ty}"))
            }
        }
        other => Err(format!("unsupported schema type {other:?}")),
    }
}

/// Renders a call in the exact grammar (the inverse of [`check`] for
/// string-valued arguments), for scripted policies and tests.
pub fn render_call(name: &str, args: &[(&str, &str)]) -> String {
    let mut s = format!("<tool_call>\n<function={name}>\n");
    for (k, v) in args {
        s.push_str(&format!("<parameter={k}>\n{v}\n</parameter>\n"));
    }
    s.push_str("</function>\n</tool_call>");
    s
}

/// A call as the lenient parser found it: the name and raw parameter text.
#[derive(Debug, Clone, PartialEq)]
struct RawCall {
    name: String,
    params: Vec<(String, String)>,
}

/// Splits generated text into content and tool calls, forgivingly: a call
/// left open at the end of the text (the budget ran out) still counts if
/// its function name is complete, text around and between calls is
/// content, and a `<tool_call>` block without a function stays content.
/// Values are JSON when they parse as a non-string JSON value, else text.
pub fn parse_lenient(text: &str) -> (String, Vec<ToolCall>) {
    let (content, raw) = parse_lenient_raw(text);
    let calls = raw
        .into_iter()
        .map(|c| ToolCall {
            name: c.name,
            arguments: c
                .params
                .into_iter()
                .map(|(k, raw)| {
                    let v = serde_json::from_str::<Value>(&raw)
                        .ok()
                        .filter(|v| !v.is_string())
                        .unwrap_or(Value::String(raw));
                    (k, v)
                })
                .collect(),
        })
        .collect();
    (content, calls)
}

/// The lenient judgement of one turn (the `format_check = "lenient"`
/// ablation): the first call [`parse_lenient`] finds, whatever else the
/// turn holds, checked against the tool schemas like [`check`] (known tool
/// and parameters, required ones present, declared types).
pub fn check_lenient(raw: &str, tools: &[Value]) -> Result<ToolCall, FormatViolation> {
    let (_, calls) = parse_lenient_raw(raw);
    let Some(call) = calls.into_iter().next() else {
        return bad("no_tool_call", "no tool call found, even leniently");
    };
    let mut params: Vec<(String, String)> = Vec::new();
    for (k, v) in call.params {
        params.retain(|(p, _)| *p != k);
        params.push((k, v));
    }
    let arguments = check_schema(&call.name, &params, tools)?;
    Ok(ToolCall {
        name: call.name,
        arguments,
    })
}

/// How a turn is judged before its call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FormatCheck {
    /// [`check`]: the raw text must be exactly one well-formed call.
    #[default]
    Strict,
    /// [`check_lenient`]: an ablation.
    Lenient,
}

impl FormatCheck {
    pub fn judge(self, raw: &str, tools: &[Value]) -> Result<ToolCall, FormatViolation> {
        match self {
            FormatCheck::Strict => check(raw, tools),
            FormatCheck::Lenient => check_lenient(raw, tools),
        }
    }
}

fn parse_lenient_raw(text: &str) -> (String, Vec<RawCall>) {
    let mut content = String::new();
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN_CALL) {
        content.push_str(&rest[..start]);
        let after = &rest[start + OPEN_CALL.len()..];
        let (body, next) = match after.find(CLOSE_CALL) {
            Some(end) => (&after[..end], &after[end + CLOSE_CALL.len()..]),
            None => (after, ""),
        };
        match parse_function(body) {
            Some(call) => calls.push(call),
            None => content.push_str(&rest[start..rest.len() - next.len()]),
        }
        rest = next;
    }
    content.push_str(rest);
    (content.trim().to_string(), calls)
}

fn parse_function(body: &str) -> Option<RawCall> {
    let f = body.find("<function=")?;
    let after = &body[f + "<function=".len()..];
    let gt = after.find('>')?;
    let name = after[..gt].trim().to_string();
    if name.is_empty() || name.contains('\n') {
        return None;
    }
    let mut rest = &after[gt + 1..];
    let mut params = Vec::new();
    while let Some(p) = rest.find("<parameter=") {
        let a = &rest[p + "<parameter=".len()..];
        let Some(gt) = a.find('>') else { break };
        let key = a[..gt].trim().to_string();
        let v = &a[gt + 1..];
        let Some(end) = v.find("</parameter>") else {
            break;
        };
        let raw = v[..end].strip_prefix('\n').unwrap_or(&v[..end]);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        params.push((key, raw.to_string()));
        rest = &v[end + "</parameter>".len()..];
    }
    Some(RawCall { name, params })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tool_schemas_that_cannot_judge_a_call_are_refused() {
        check_tools(&tools()).unwrap();
        check_tools(&[]).unwrap();
        let wrapped = json!({"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}});
        check_tools(&[wrapped.clone(), json!({"name": "g"})]).unwrap();
        for (bad, says) in [
            (vec![json!(1)], "tools[0] is not an object"),
            (
                vec![json!({"type": "function", "function": "f"})],
                "tools[0] is not an object",
            ),
            (
                vec![json!({"parameters": {}})],
                "tools[0] has no function name",
            ),
            (vec![json!({"function": {"name": " "}})], "no function name"),
            (
                vec![json!({"name": "has space!"})],
                "must be 1 to 64 letters, digits, _ or -",
            ),
            (vec![json!({"name": "f".repeat(65)})], "must be 1 to 64"),
            (
                vec![wrapped.clone(), json!({"name": "f"})],
                "tools[1]: the name \"f\" is given twice",
            ),
            (
                vec![json!({"name": "f", "parameters": []})],
                "tools[0] (f): parameters",
            ),
            (
                vec![json!({"name": "f", "parameters": {"properties": [1]}})],
                "parameters",
            ),
            (
                vec![json!({"name": "f", "parameters": {"required": "x"}})],
                "parameters",
            ),
        ] {
            let e = check_tools(&bad).unwrap_err();
            assert!(e.contains(says), "{bad:?}: {e}");
        }
    }

    fn tools() -> Vec<Value> {
        vec![
            json!({"type": "function", "function": {"name": "bash", "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"]}}}),
            json!({"type": "function", "function": {"name": "submit",
                "parameters": {"type": "object", "properties": {}}}}),
        ]
    }

    #[test]
    fn accepts_rendered_calls_and_types_values() {
        let c = check(
            &render_call("bash", &[("command", "ls -la"), ("timeout", "30")]),
            &tools(),
        )
        .unwrap();
        assert_eq!(c.name, "bash");
        assert_eq!(c.arguments["timeout"], json!(30));
        let c = check(&render_call("submit", &[]), &tools()).unwrap();
        assert!(c.arguments.is_empty());
        let c = check(&render_call("bash", &[("command", "")]), &tools()).unwrap();
        assert_eq!(c.arguments["command"], json!(""));
    }

    #[test]
    fn rejects_the_basic_cases() {
        let t = tools();
        let call = render_call("bash", &[("command", "ls")]);
        assert_eq!(
            check(&format!("{call}\nok"), &t).unwrap_err().code,
            "trailing_text"
        );
        assert_eq!(
            check(&format!("{call}{call}"), &t).unwrap_err().code,
            "multiple_calls"
        );
        assert_eq!(
            check(
                &render_call("bash", &[("command", "ls"), ("timeout", "30s")]),
                &t
            )
            .unwrap_err()
            .code,
            "bad_type"
        );
        assert_eq!(
            check(&render_call("rm", &[]), &t).unwrap_err().code,
            "unknown_tool"
        );
    }

    #[test]
    fn lenient_parse_keeps_text_and_repairs_open_calls() {
        let text = "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>";
        let (content, calls) = parse_lenient(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls.len(), 1);
        assert_eq!(calls[0].name, "get_weather");
        assert_eq!(calls[0].arguments["city"], "Paris");
        assert_eq!(calls[0].arguments["days"], 3);
        // Two calls, text between them kept; an open call at the end counts.
        let (content, calls) = parse_lenient(
            "<tool_call>\n<function=a>\n</function>\n</tool_call> mid <tool_call>\n<function=b>\n<parameter=x>\n{\"k\": 1}\n</parameter>",
        );
        assert_eq!(content, "mid");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[1].arguments["x"], json!({"k": 1}));
        // No function: stays content.
        let (content, calls) = parse_lenient("<tool_call>junk</tool_call>");
        assert!(calls.is_empty());
        assert_eq!(content, "<tool_call>junk</tool_call>");
    }

    /// What the lenient ablation lets through and the strict gate stops,
    /// and what both stop.
    #[test]
    fn lenient_check_accepts_what_strict_rejects_but_still_checks_schemas() {
        let t = tools();
        let call = render_call("bash", &[("command", "ls")]);
        let repeated = "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n<parameter=command>\npwd\n</parameter>\n</function>\n</tool_call>";
        let unclosed = "<tool_call>\n<function=bash>\n<parameter=command>\nls\n</parameter>\n";
        for (turn, strict_code) in [
            (format!("{call}\nok"), "trailing_text"),
            (format!("{call}{call}"), "multiple_calls"),
            (repeated.to_string(), "duplicate_parameter"),
            (unclosed.to_string(), "missing_function_close"),
            (format!("<think>{call}"), "call_inside_think"),
        ] {
            assert_eq!(
                FormatCheck::Strict.judge(&turn, &t).unwrap_err().code,
                strict_code
            );
            let c = FormatCheck::Lenient.judge(&turn, &t).unwrap();
            assert_eq!(c.name, "bash", "{turn}");
        }
        assert_eq!(
            check_lenient(repeated, &t).unwrap().arguments["command"],
            "pwd"
        );
        for (turn, code) in [
            ("no call at all".to_string(), "no_tool_call"),
            (render_call("rm", &[]), "unknown_tool"),
            (
                render_call("bash", &[("timeout", "3")]),
                "missing_parameter",
            ),
            (
                render_call("bash", &[("command", "ls"), ("timeout", "30s")]),
                "bad_type",
            ),
        ] {
            assert_eq!(check_lenient(&turn, &t).unwrap_err().code, code, "{turn}");
        }
        // Both accept a well-formed call alike.
        assert_eq!(check(&call, &t), check_lenient(&call, &t));
    }
}
