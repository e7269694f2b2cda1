//! Chat templates: a conversation (OpenAI-style JSON messages, optional tool
//! schemas) rendered to the exact prompt text a checkpoint was trained on.
//!
//! The template is the checkpoint's own Jinja `chat_template`, rendered with
//! minijinja set up the way transformers' `apply_chat_template` sets up
//! Jinja2: `trim_blocks` and `lstrip_blocks`, no auto-escaping, Python string
//! methods (`.startswith`, `.split`, ...) through minijinja-contrib's
//! pycompat, `raise_exception`, `strftime_now`, and a `tojson` filter that
//! writes what Python's `json.dumps` writes (`", "` and `": "` separators,
//! non-ASCII kept), because the tool schemas in Qwen's system prompt are
//! rendered with it and the model saw exactly those bytes in training.
//! Bools and `None` print the Python way (`True`, `None`) for the same reason.
//!
//! Key order: objects are written in the order minijinja iterates them. To
//! keep the caller's key order (as Python dicts do) serde_json and minijinja
//! need their `preserve_order` features; without them keys come out sorted.
//!
//! Not here: tokenizing (`tokenizer.rs`), parsing tool calls out of generated
//! text, or any chat format other than what the template itself says. The
//! engine renders a conversation once and then only appends tokens (docs/ARCHITECTURE.md,
//! "Contracts"), so rendering speed is not a concern.

use std::path::Path;

use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{AutoEscape, Environment, ErrorKind, UndefinedBehavior};

use crate::{Error, Result};

/// Qwen3.5's own chat template (`chat_template.jinja` as published with the
/// Qwen3.5 checkpoints, Apache-2.0), unchanged: tools are listed in the
/// system message, calls use the XML form `<tool_call>\n<function=NAME>\n
/// <parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`, tool
/// results come back in a user turn inside `<tool_response>`, assistant
/// turns after the last user query carry their `<think>` block, and the
/// generation prompt opens a `<think>` block unless `enable_thinking` is
/// false. `arcticd init-model` writes this into tokenizer_config.json.
pub const DEFAULT_TEMPLATE: &str = r##"{%- set image_count = namespace(value=0) %}
{%- set video_count = namespace(value=0) %}
{%- macro render_content(content, do_vision_count, is_system_content=false) %}
    {%- if content is string %}
        {{- content }}
    {%- elif content is iterable and content is not mapping %}
        {%- for item in content %}
            {%- if 'image' in item or 'image_url' in item or item.type == 'image' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain images.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set image_count.value = image_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Picture ' ~ image_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|image_pad|><|vision_end|>' }}
            {%- elif 'video' in item or item.type == 'video' %}
                {%- if is_system_content %}
                    {{- raise_exception('System message cannot contain videos.') }}
                {%- endif %}
                {%- if do_vision_count %}
                    {%- set video_count.value = video_count.value + 1 %}
                {%- endif %}
                {%- if add_vision_id %}
                    {{- 'Video ' ~ video_count.value ~ ': ' }}
                {%- endif %}
                {{- '<|vision_start|><|video_pad|><|vision_end|>' }}
            {%- elif 'text' in item %}
                {{- item.text }}
            {%- else %}
                {{- raise_exception('Unexpected item type in content.') }}
            {%- endif %}
        {%- endfor %}
    {%- elif content is none or content is undefined %}
        {{- '' }}
    {%- else %}
        {{- raise_exception('Unexpected content type.') }}
    {%- endif %}
{%- endmacro %}
{%- if not messages %}
    {{- raise_exception('No messages provided.') }}
{%- endif %}
{%- if tools and tools is iterable and tools is not mapping %}
    {{- '<|im_start|>system\n' }}
    {{- "# Tools\n\nYou have access to the following functions:\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>" }}
    {{- '\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow the specified format: an inner <function=...></function> block must be nested within <tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If there is no function call available, answer the question like normal with your current knowledge and do not tell the user about function calls\n</IMPORTANT>' }}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {%- if content %}
            {{- '\n\n' + content }}
        {%- endif %}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {%- set content = render_content(messages[0].content, false, true)|trim %}
        {{- '<|im_start|>system\n' + content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set content = render_content(message.content, false)|trim %}
        {%- if not(content.startswith('<tool_response>') and content.endswith('</tool_response>')) %}
            {%- set ns.multi_step_tool = false %}
            {%- set ns.last_query_index = index %}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if ns.multi_step_tool %}
    {{- raise_exception('No user query found in messages.') }}
{%- endif %}
{%- for message in messages %}
    {%- set content = render_content(message.content, true)|trim %}
    {%- if message.role == "system" %}
        {%- if not loop.first %}
            {{- raise_exception('System message must be at the beginning.') }}
        {%- endif %}
    {%- elif message.role == "user" %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- set reasoning_content = reasoning_content|trim %}
        {%- if loop.index0 > ns.last_query_index %}
            {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls and message.tool_calls is iterable and message.tool_calls is not mapping %}
            {%- for tool_call in message.tool_calls %}
                {%- if tool_call.function is defined %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {%- if loop.first %}
                    {%- if content|trim %}
                        {{- '\n\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- else %}
                        {{- '<tool_call>\n<function=' + tool_call.name + '>\n' }}
                    {%- endif %}
                {%- else %}
                    {{- '\n<tool_call>\n<function=' + tool_call.name + '>\n' }}
                {%- endif %}
                {%- if tool_call.arguments is defined %}
                    {%- for args_name, args_value in tool_call.arguments|items %}
                        {{- '<parameter=' + args_name + '>\n' }}
                        {%- set args_value = args_value | tojson | safe if args_value is mapping or (args_value is sequence and args_value is not string) else args_value | string %}
                        {{- args_value }}
                        {{- '\n</parameter>\n' }}
                    {%- endfor %}
                {%- endif %}
                {{- '</function>\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.previtem and loop.previtem.role != "tool" %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if not loop.last and loop.nextitem.role != "tool" %}
            {{- '<|im_end|>\n' }}
        {%- elif loop.last %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('Unexpected message role.') }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- else %}
        {{- '<think>\n' }}
    {%- endif %}
{%- endif %}"##;

/// File a checkpoint may ship its template in (preferred over the config).
pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";

const TEMPLATE_NAME: &str = "chat_template";

/// Tokens transformers passes into every template render, read from
/// tokenizer_config.json when the template comes from a checkpoint.
const SPECIAL_TOKEN_KEYS: [&str; 7] = [
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
];

/// A compiled chat template, ready to render conversations.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    special_tokens: Vec<(String, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles `source`. A syntax error is an [`Error::Template`].
    pub fn new(source: impl Into<String>) -> Result<Self> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_auto_escape_callback(|_| AutoEscape::None);
        env.set_undefined_behavior(UndefinedBehavior::Lenient);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(python_formatter);
        env.add_filter("tojson", tojson);
        env.add_filter("string", python_string);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(|e| Error::Template(format!("compiling: {}", describe(&e))))?;
        Ok(Self {
            env,
            source,
            special_tokens: Vec::new(),
        })
    }

    /// Qwen3.5's template, [`DEFAULT_TEMPLATE`].
    pub fn qwen35() -> Self {
        match Self::new(DEFAULT_TEMPLATE) {
            Ok(t) => t,
            // The constant is compiled by the unit tests; it cannot fail here.
            Err(e) => unreachable!("DEFAULT_TEMPLATE does not compile: {e}"),
        }
    }

    /// The template of a checkpoint directory: `chat_template.jinja` if
    /// present, else the `chat_template` field of tokenizer_config.json (a
    /// string, or a list of `{name, template}` of which "default" is used),
    /// else `None`. Special tokens named in tokenizer_config.json
    /// (`bos_token`, `eos_token`, ...) are made available to the template as
    /// transformers does.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config_path = dir.join(crate::tokenizer::TOKENIZER_CONFIG_FILE);
        let config: Option<serde_json::Value> = match std::fs::read(&config_path) {
            Ok(bytes) => Some(serde_json::from_slice(&bytes).map_err(|e| {
                Error::Template(format!("{}: invalid JSON: {e}", config_path.display()))
            })?),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(Error::io(&config_path, e)),
        };

        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        let source = match std::fs::read_to_string(&jinja_path) {
            Ok(s) => Some(s),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => match &config {
                Some(c) => template_from_config(c, &config_path)?,
                None => None,
            },
            Err(e) => return Err(Error::io(&jinja_path, e)),
        };
        let Some(source) = source else {
            return Ok(None);
        };
        let mut template =
            Self::new(source).map_err(|e| Error::Template(format!("{}: {e}", dir.display())))?;
        if let Some(config) = &config {
            template.special_tokens = special_tokens_from_config(config);
        }
        Ok(Some(template))
    }

    /// The template text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders `messages` (each `{"role": .., "content": ..}`, assistant
    /// messages optionally with `tool_calls` whose `arguments` are JSON
    /// objects, not strings) with optional tool schemas. With
    /// `add_generation_prompt` the text ends with the opening of an
    /// assistant turn.
    pub fn render(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        self.render_with(
            messages,
            tools,
            add_generation_prompt,
            &serde_json::Map::new(),
        )
    }

    /// [`render`](Self::render) with extra template variables, e.g.
    /// `{"enable_thinking": false}`. They override the defaults.
    pub fn render_with(
        &self,
        messages: &[serde_json::Value],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
        kwargs: &serde_json::Map<String, serde_json::Value>,
    ) -> Result<String> {
        let mut ctx: std::collections::BTreeMap<String, Value> = self
            .special_tokens
            .iter()
            .map(|(k, v)| (k.clone(), Value::from(v.as_str())))
            .collect();
        let messages: Vec<serde_json::Value> = messages.iter().map(normalize_message).collect();
        ctx.insert("messages".into(), Value::from_serialize(&messages));
        ctx.insert("documents".into(), Value::from(()));
        ctx.insert(
            "tools".into(),
            match tools {
                Some(t) => Value::from_serialize(t),
                None => Value::from(()),
            },
        );
        ctx.insert(
            "add_generation_prompt".into(),
            Value::from(add_generation_prompt),
        );
        for (k, v) in kwargs {
            ctx.insert(k.clone(), Value::from_serialize(v));
        }
        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| Error::Template(describe(&e)))?;
        template
            .render(Value::from(ctx))
            .map_err(|e| Error::Template(describe(&e)))
    }
}

/// What transformers' `apply_chat_template` does to each message before
/// rendering: keys whose value is null are dropped (an OpenAI-style
/// `"content": null` must not print "None"), and reasoning given as
/// `thinking` or `reasoning` is also made available as `reasoning_content`
/// (and `reasoning_content` as `thinking`).
fn normalize_message(message: &serde_json::Value) -> serde_json::Value {
    let serde_json::Value::Object(fields) = message else {
        return message.clone();
    };
    let mut out: serde_json::Map<String, serde_json::Value> = fields
        .iter()
        .filter(|(_, v)| !v.is_null())
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    let reasoning = ["reasoning_content", "thinking", "reasoning"]
        .iter()
        .find_map(|k| out.get(*k).cloned());
    if let Some(reasoning) = reasoning {
        out.entry("thinking").or_insert_with(|| reasoning.clone());
        out.insert("reasoning_content".into(), reasoning);
    }
    serde_json::Value::Object(out)
}

/// The `chat_template` field of a parsed tokenizer_config.json.
fn template_from_config(config: &serde_json::Value, path: &Path) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(named)) => {
            let mut names = Vec::new();
            for entry in named {
                let name = entry.get("name").and_then(|n| n.as_str());
                let template = entry.get("template").and_then(|t| t.as_str());
                match (name, template) {
                    (Some("default"), Some(t)) => return Ok(Some(t.to_string())),
                    (Some(n), Some(_)) => names.push(n.to_string()),
                    _ => {
                        return Err(Error::Template(format!(
                            "{}: chat_template list entries need string \"name\" and \"template\"",
                            path.display()
                        )))
                    }
                }
            }
            Err(Error::Template(format!(
                "{}: chat_template list has no \"default\" entry (has: {})",
                path.display(),
                names.join(", ")
            )))
        }
        Some(_) => Err(Error::Template(format!(
            "{}: chat_template must be a string or a list of {{name, template}}",
            path.display()
        ))),
    }
}

/// `bos_token` etc. from tokenizer_config.json: a string, or an added-token
/// object with a `content` field.
fn special_tokens_from_config(config: &serde_json::Value) -> Vec<(String, String)> {
    SPECIAL_TOKEN_KEYS
        .iter()
        .filter_map(|&key| {
            let value = config.get(key)?;
            let text = value
                .as_str()
                .or_else(|| value.get("content").and_then(|c| c.as_str()))?;
            Some((key.to_string(), text.to_string()))
        })
        .collect()
}

/// A minijinja error with its chain of causes and the template line, on one
/// line.
fn describe(e: &minijinja::Error) -> String {
    let mut out = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        out.push_str(": ");
        out.push_str(&s.to_string());
        source = s.source();
    }
    out
}

fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// Python's `time.strftime(format)` on the current UTC time, for the common
/// directives (templates use it to date the system prompt).
fn strftime_now(format: String) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, secs)
}

fn strftime(format: &str, unix_secs: i64) -> std::result::Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
        "Sunday",
    ];
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    // 1970-01-01 was a Thursday (index 3 counting from Monday).
    let weekday = (days + 3).rem_euclid(7) as usize;
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let month_name = MONTHS[(month - 1) as usize];
    let day_name = DAYS[weekday];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('-') => match chars.next() {
                // glibc's no-padding flag, used by some templates (%-d).
                Some('d') => out.push_str(&day.to_string()),
                Some('m') => out.push_str(&month.to_string()),
                other => return Err(bad_directive(other)),
            },
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{day_of_year:03}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(day_name),
            Some('a') => out.push_str(&day_name[..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('F') => out.push_str(&format!("{year}-{month:02}-{day:02}")),
            Some('T') => out.push_str(&format!("{hour:02}:{minute:02}:{second:02}")),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            other => return Err(bad_directive(other)),
        }
    }
    Ok(out)
}

fn bad_directive(c: Option<char>) -> minijinja::Error {
    minijinja::Error::new(
        ErrorKind::InvalidOperation,
        format!(
            "strftime_now: unsupported directive %{}",
            c.map(String::from).unwrap_or_default()
        ),
    )
}

/// Days since 1970-01-01 to (year, month, day), proleptic Gregorian
/// (Howard Hinnant's civil_from_days).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = if month > 2 { month - 3 } else { month + 9 };
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `{{ value }}` output: Python's `str()` for bools, none, floats and
/// containers; everything else as minijinja prints it.
fn python_formatter(
    out: &mut minijinja::Output,
    state: &minijinja::State,
    value: &Value,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Bool | ValueKind::None | ValueKind::Seq | ValueKind::Map => out
            .write_str(&python_str(value)?)
            .map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "writing template output")),
        ValueKind::Number if !value.is_integer() => out
            .write_str(&python_str(value)?)
            .map_err(|_| minijinja::Error::new(ErrorKind::WriteFailure, "writing template output")),
        _ => minijinja::escape_formatter(out, state, value),
    }
}

/// The `string` filter: Python's `str()`.
fn python_string(value: Value) -> std::result::Result<Value, minijinja::Error> {
    if value.kind() == ValueKind::String {
        return Ok(value);
    }
    Ok(Value::from(python_str(&value)?))
}

fn python_str(value: &Value) -> std::result::Result<String, minijinja::Error> {
    match value.kind() {
        ValueKind::String => Ok(value.as_str().unwrap_or_default().to_string()),
        ValueKind::Undefined => Ok(String::new()),
        _ => {
            let mut out = String::new();
            python_repr(&mut out, value)?;
            Ok(out)
        }
    }
}

/// Python's `repr()` of a JSON-like value.
fn python_repr(out: &mut String, value: &Value) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("None"),
        ValueKind::Bool => out.push_str(if value.is_true() { "True" } else { "False" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
        ValueKind::String => python_str_repr(out, value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &item)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in value.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                python_repr(out, &key)?;
                out.push_str(": ");
                python_repr(out, &value.get_item(&key)?)?;
            }
            out.push('}');
        }
        _ => out.push_str(&value.to_string()),
    }
    Ok(())
}

fn python_str_repr(out: &mut String, s: &str) {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                out.push_str(&format!("\\x{:02x}", c as u32));
            }
            c => out.push(c),
        }
    }
    out.push(quote);
}

/// Python's `repr(float)`: shortest round-trip digits, positional for
/// exponents -4..16, else `1e+20` style.
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let sign = if f.is_sign_negative() { "-" } else { "" };
    // `{:e}` gives Rust's shortest round-trip digits, like "1.25e-7".
    let sci = format!("{:e}", f.abs());
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let n = digits.len() as i32;
    let body = if (-4..16).contains(&exp) {
        if exp >= 0 {
            let int_len = exp + 1;
            if n <= int_len {
                format!("{digits}{}.0", "0".repeat((int_len - n) as usize))
            } else {
                let (a, b) = digits.split_at(int_len as usize);
                format!("{a}.{b}")
            }
        } else {
            format!("0.{}{digits}", "0".repeat((-exp - 1) as usize))
        }
    } else {
        let (first, rest) = digits.split_at(1);
        let frac = if rest.is_empty() {
            String::new()
        } else {
            format!(".{rest}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{first}{frac}e{esign}{:02}", exp.abs())
    };
    format!("{sign}{body}")
}

/// Options of the `tojson` filter, named as in Python's `json.dumps`.
struct JsonStyle {
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
    ensure_ascii: bool,
    sort_keys: bool,
}

/// transformers' `tojson`: `json.dumps(value, ensure_ascii=False,
/// indent=None, separators=None, sort_keys=False)`, keyword arguments
/// (and a positional indent) as in Python.
fn tojson(
    value: Value,
    indent: Option<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, minijinja::Error> {
    let indent = match kwargs.get::<Option<Value>>("indent")? {
        Some(v) => Some(v),
        None => indent,
    };
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() || v.is_undefined() => None,
        Some(v) if v.kind() == ValueKind::String => {
            Some(v.as_str().unwrap_or_default().to_string())
        }
        Some(v) => {
            let n = i64::try_from(v)?;
            Some(" ".repeat(n.max(0) as usize))
        }
    };
    let (item_sep, key_sep) = match kwargs.get::<Option<Vec<String>>>("separators")? {
        Some(seps) if seps.len() == 2 => (seps[0].clone(), seps[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair",
            ))
        }
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let style = JsonStyle {
        indent,
        item_sep,
        key_sep,
        ensure_ascii: kwargs.get::<Option<bool>>("ensure_ascii")?.unwrap_or(false),
        sort_keys: kwargs.get::<Option<bool>>("sort_keys")?.unwrap_or(false),
    };
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, &style, 0)?;
    Ok(Value::from_safe_string(out))
}

fn write_json(
    out: &mut String,
    value: &Value,
    style: &JsonStyle,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    match value.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
        ValueKind::Number if value.is_integer() => out.push_str(&value.to_string()),
        ValueKind::Number => out.push_str(&python_float(f64::try_from(value.clone())?)),
        ValueKind::String => json_string(out, value.as_str().unwrap_or_default(), style),
        ValueKind::Bytes => json_string(
            out,
            &String::from_utf8_lossy(value.as_bytes().unwrap_or_default()),
            style,
        ),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = value.try_iter()?.collect();
            write_container(out, '[', ']', items.len(), style, depth, |out, i| {
                write_json(out, &items[i], style, depth + 1)
            })?;
        }
        ValueKind::Map => {
            let mut entries = Vec::new();
            for key in value.try_iter()? {
                let item = value.get_item(&key)?;
                entries.push((json_key(&key)?, item));
            }
            if style.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            write_container(out, '{', '}', entries.len(), style, depth, |out, i| {
                json_string(out, &entries[i].0, style);
                out.push_str(&style.key_sep);
                write_json(out, &entries[i].1, style, depth + 1)
            })?;
        }
        kind => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                format!("tojson: a {kind} is not JSON serializable"),
            ))
        }
    }
    Ok(())
}

/// Brackets, separators and Python's indentation around `len` items.
fn write_container(
    out: &mut String,
    open: char,
    close: char,
    len: usize,
    style: &JsonStyle,
    depth: usize,
    mut item: impl FnMut(&mut String, usize) -> std::result::Result<(), minijinja::Error>,
) -> std::result::Result<(), minijinja::Error> {
    out.push(open);
    if len == 0 {
        out.push(close);
        return Ok(());
    }
    for i in 0..len {
        if i > 0 {
            out.push_str(&style.item_sep);
        }
        if let Some(indent) = &style.indent {
            out.push('\n');
            out.push_str(&indent.repeat(depth + 1));
        }
        item(out, i)?;
    }
    if let Some(indent) = &style.indent {
        out.push('\n');
        out.push_str(&indent.repeat(depth));
    }
    out.push(close);
    Ok(())
}

/// Python turns non-string keys into strings: `1` -> "1", `True` -> "true".
fn json_key(key: &Value) -> std::result::Result<String, minijinja::Error> {
    match key.kind() {
        ValueKind::String => Ok(key.as_str().unwrap_or_default().to_string()),
        ValueKind::None => Ok("null".into()),
        ValueKind::Bool => Ok(if key.is_true() { "true" } else { "false" }.into()),
        ValueKind::Number if key.is_integer() => Ok(key.to_string()),
        ValueKind::Number => Ok(python_float(f64::try_from(key.clone())?)),
        kind => Err(minijinja::Error::new(
            ErrorKind::InvalidOperation,
            format!("tojson: keys must be str, int, float, bool or None, not {kind}"),
        )),
    }
}

/// A JSON string literal as Python's json module writes it.
fn json_string(out: &mut String, s: &str, style: &JsonStyle) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c if style.ensure_ascii && (c as u32) > 0x7e => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The roles a chat message may have: OpenAI's (`developer` is read as
/// `system`).
pub const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// An OpenAI chat message as the template expects it, for every path that
/// takes messages from outside (`serve`, `sft` data): `developer` becomes
/// `system`, and tool-call arguments given as a JSON string (OpenAI's wire
/// form) become the object they encode. A message that is no object, a
/// role outside [`ROLES`], or arguments that are no JSON object are an
/// input error naming the field within the message (the template would
/// otherwise fail on them with its own internals, "cannot convert value
/// into pairs").
pub fn openai_messages(msgs: &[serde_json::Value]) -> Result<Vec<serde_json::Value>> {
    msgs.iter()
        .enumerate()
        .map(|(i, m)| {
            openai_message(m).map_err(|e| match e {
                Error::Input(why) => Error::Input(format!("messages[{i}]: {why}")),
                other => other,
            })
        })
        .collect()
}

/// One message of [`openai_messages`]; its errors name the field within
/// the message.
pub fn openai_message(m: &serde_json::Value) -> Result<serde_json::Value> {
    use serde_json::Value as Json;
    let mut m = m.clone();
    let obj = m
        .as_object_mut()
        .ok_or_else(|| Error::Input("a message is a JSON object".into()))?;
    match obj.get("role") {
        Some(Json::String(r)) if r == "developer" => {
            obj.insert("role".into(), Json::from("system"));
        }
        Some(Json::String(r)) if ROLES.contains(&r.as_str()) => {}
        Some(Json::String(r)) => {
            return Err(Error::Input(format!(
                "role {r:?} is not one of {}",
                ROLES.join(", ")
            )))
        }
        Some(_) => return Err(Error::Input("role is not a string".into())),
        None => return Err(Error::Input("a message needs a \"role\"".into())),
    }
    if let Some(calls) = obj.get_mut("tool_calls").and_then(Json::as_array_mut) {
        for (j, call) in calls.iter_mut().enumerate() {
            let (target, path) = match call.get("function").is_some() {
                true => (&mut call["function"], format!("tool_calls[{j}].function")),
                false => (call, format!("tool_calls[{j}]")),
            };
            let Some(args) = target.get_mut("arguments") else {
                continue;
            };
            let parsed = match args {
                Json::Object(_) => continue,
                Json::String(s) => serde_json::from_str::<Json>(s)
                    .map_err(|e| Error::Input(format!("{path}.arguments is not JSON ({e})")))?,
                _ => {
                    return Err(Error::Input(format!(
                        "{path}.arguments is not a JSON object or its string"
                    )))
                }
            };
            if !parsed.is_object() {
                return Err(Error::Input(format!(
                    "{path}.arguments is not a JSON object"
                )));
            }
            *args = parsed;
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_normalized_or_refused_naming_the_field() {
        use serde_json::json;
        let call = |args: serde_json::Value| {
            json!({"role": "assistant", "content": null, "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]})
        };
        let m = openai_message(&call(json!("{\"city\": \"P\"}"))).unwrap();
        assert_eq!(
            m["tool_calls"][0]["function"]["arguments"],
            json!({"city": "P"})
        );
        let same = openai_message(&call(json!({"city": "P"}))).unwrap();
        assert_eq!(same, m);
        let dev = openai_message(&json!({"role": "developer", "content": "x"})).unwrap();
        assert_eq!(dev["role"], "system");
        let err = |m: serde_json::Value| openai_message(&m).unwrap_err().to_string();
        assert!(
            err(call(json!("{not json"))).contains("tool_calls[0].function.arguments is not JSON")
        );
        assert!(err(call(json!("[1]"))).contains("arguments is not a JSON object"));
        assert!(err(call(json!(3))).contains("arguments is not a JSON object"));
        assert!(err(json!({"role": "wizard", "content": "x"}))
            .contains("role \"wizard\" is not one of"));
        assert!(err(json!({"content": "x"})).contains("needs a \"role\""));
        assert!(err(json!("hi")).contains("is a JSON object"));
        let list = [json!({"role": "user", "content": "x"}), call(json!("{"))];
        let e = openai_messages(&list).unwrap_err().to_string();
        assert!(
            e.contains("messages[1]: tool_calls[0].function.arguments"),
            "{e}"
        );
    }
    use serde_json::json;

    fn qwen() -> ChatTemplate {
        ChatTemplate::new(DEFAULT_TEMPLATE).unwrap()
    }

    fn temp_dir(tag: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!(
            "arcticd-chat-{tag}-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn plain_conversation_with_generation_prompt() {
        let t = qwen();
        let out = t
            .render(&[json!({"role": "user", "content": "hi"})], None, true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
        );

        let kwargs = json!({"enable_thinking": false});
        let out = t
            .render_with(
                &[json!({"role": "user", "content": "hi"})],
                None,
                true,
                kwargs.as_object().unwrap(),
            )
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
        );
    }

    #[test]
    fn plain_template_renders_exactly_the_chatml_prompt() {
        let t = ChatTemplate::new(
            "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>' + '\\n' }}{% endfor %}\
             {% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
        )
        .unwrap();
        let out = t
            .render(&[json!({"role": "user", "content": "hi"})], None, true)
            .unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn system_and_history() {
        let msgs = [
            json!({"role": "system", "content": "Be brief."}),
            json!({"role": "user", "content": "2+2?"}),
            json!({"role": "assistant", "content": "4"}),
            json!({"role": "user", "content": "3+3?"}),
        ];
        let out = qwen().render(&msgs, None, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>system\nBe brief.<|im_end|>\n\
             <|im_start|>user\n2+2?<|im_end|>\n\
             <|im_start|>assistant\n4<|im_end|>\n\
             <|im_start|>user\n3+3?<|im_end|>\n"
        );
    }

    #[test]
    fn assistant_tool_call_renders_the_xml_format() {
        let msgs = [
            json!({"role": "user", "content": "list files"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"type": "function", "function": {"name": "bash", "arguments": {"command": "ls -la"}}},
                {"type": "function", "function": {"name": "edit", "arguments": {
                    "command": "create", "flag": true, "line": 3, "opts": {"x": [1, "é"]},
                    "path": "a.py"}}}
            ]}),
        ];
        let out = qwen().render(&msgs, None, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nlist files<|im_end|>\n\
             <|im_start|>assistant\n<think>\n\n</think>\n\n\
             <tool_call>\n<function=bash>\n<parameter=command>\nls -la\n</parameter>\n</function>\n</tool_call>\n\
             <tool_call>\n<function=edit>\n\
             <parameter=command>\ncreate\n</parameter>\n\
             <parameter=flag>\nTrue\n</parameter>\n\
             <parameter=line>\n3\n</parameter>\n\
             <parameter=opts>\n{\"x\": [1, \"é\"]}\n</parameter>\n\
             <parameter=path>\na.py\n</parameter>\n\
             </function>\n</tool_call><|im_end|>\n"
        );
    }

    /// The tool-call module's renderer writes what the template writes.
    #[test]
    fn render_call_equals_the_templates_rendering() {
        let msgs = [
            json!({"role": "user", "content": "go"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "edit", "arguments": {"command": "view", "path": "a.py"}}}]}),
            json!({"role": "user", "content": "next"}),
        ];
        let out = qwen().render(&msgs, None, false).unwrap();
        let call = crate::tool_call::render_call("edit", &[("command", "view"), ("path", "a.py")]);
        assert!(
            out.contains(&format!("<|im_start|>assistant\n{call}<|im_end|>\n")),
            "{out}"
        );
    }

    #[test]
    fn tool_call_after_text_and_reasoning() {
        let msgs = [
            json!({"role": "user", "content": "go"}),
            json!({"role": "assistant", "content": "Checking.", "reasoning_content": "think hard",
                   "tool_calls": [{"function": {"name": "submit", "arguments": {}}}]}),
        ];
        let out = qwen().render(&msgs, None, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\ngo<|im_end|>\n\
             <|im_start|>assistant\n<think>\nthink hard\n</think>\n\nChecking.\n\n\
             <tool_call>\n<function=submit>\n</function>\n</tool_call><|im_end|>\n"
        );
    }

    #[test]
    fn tool_results_render_in_a_user_turn() {
        let msgs = [
            json!({"role": "user", "content": "run it"}),
            json!({"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "bash", "arguments": {"command": "echo a"}}},
                {"function": {"name": "bash", "arguments": {"command": "echo b"}}}]}),
            json!({"role": "tool", "content": "a"}),
            json!({"role": "tool", "content": "b\n"}),
        ];
        let out = qwen().render(&msgs, None, true).unwrap();
        let tail = "<|im_start|>user\n<tool_response>\na\n</tool_response>\n\
                    <tool_response>\nb\n</tool_response><|im_end|>\n\
                    <|im_start|>assistant\n<think>\n";
        assert!(out.ends_with(tail), "{out}");
    }

    #[test]
    fn tools_are_listed_in_the_system_prompt() {
        let tools = [json!({"type": "function", "function": {
            "name": "bash", "description": "Run a command ünïcode",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}},
                           "required": ["command"]}}})];
        let msgs = [
            json!({"role": "system", "content": "You fix bugs."}),
            json!({"role": "user", "content": "hi"}),
        ];
        let out = qwen().render(&msgs, Some(&tools), true).unwrap();
        assert!(out.starts_with(
            "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        ));
        // json.dumps separators, non-ASCII kept. (Keys sorted here: see the
        // module docs on preserve_order.)
        assert!(out.contains(
            "<tools>\n{\"function\": {\"description\": \"Run a command ünïcode\", \"name\": \"bash\", \
             \"parameters\": {\"properties\": {\"command\": {\"type\": \"string\"}}, \
             \"required\": [\"command\"], \"type\": \"object\"}}, \"type\": \"function\"}\n</tools>"
        ) || out.contains("{\"type\": \"function\", \"function\": {\"name\": \"bash\""),
            "{out}");
        assert!(out
            .contains("</IMPORTANT>\n\nYou fix bugs.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"));
    }

    #[test]
    fn null_fields_dropped_and_reasoning_aliased_like_transformers() {
        let msgs = [
            json!({"role": "user", "content": "q"}),
            json!({"role": "assistant", "content": null, "reasoning": "r",
                   "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}),
        ];
        let out = qwen().render(&msgs, None, false).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n<think>\nr\n</think>\n\n\
             <tool_call>\n<function=f>\n<parameter=a>\n1\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        );
    }

    #[test]
    fn broken_templates_are_errors_not_panics() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content").unwrap_err();
        assert!(matches!(err, Error::Template(_)), "{err:?}");

        let t = ChatTemplate::new("{{ raise_exception('nope: ' + messages[0].role) }}").unwrap();
        let err = t
            .render(&[json!({"role": "user", "content": "x"})], None, false)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Template(m) if m.contains("nope: user")),
            "{err:?}"
        );

        // Qwen's own template refuses a conversation with no user query.
        let err = qwen()
            .render(&[json!({"role": "system", "content": "x"})], None, true)
            .unwrap_err();
        assert!(
            matches!(&err, Error::Template(m) if m.contains("No user query")),
            "{err:?}"
        );

        let t = ChatTemplate::new("{{ messages[0].content.nosuchmethod() }}").unwrap();
        let err = t
            .render(&[json!({"role": "user", "content": "x"})], None, false)
            .unwrap_err();
        assert!(matches!(err, Error::Template(_)));
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ v | tojson }}|{{ v | tojson(indent=2) }}|{{ s | tojson(ensure_ascii=true) }}|{{ v | tojson(separators=[',', ':']) }}",
        )
        .unwrap();
        let kwargs = json!({"v": {"a": [1, 2.5, 1e20, 0.0001, 1e-5, null, true], "b": {}, "c": []},
                            "s": "é\u{1F600}\"\\\n\u{1}"});
        let out = t
            .render_with(&[], None, false, kwargs.as_object().unwrap())
            .unwrap();
        let parts: Vec<&str> = out.split('|').collect();
        assert_eq!(
            parts[0],
            r#"{"a": [1, 2.5, 1e+20, 0.0001, 1e-05, null, true], "b": {}, "c": []}"#
        );
        assert_eq!(
            parts[1],
            "{\n  \"a\": [\n    1,\n    2.5,\n    1e+20,\n    0.0001,\n    1e-05,\n    null,\n    true\n  ],\n  \"b\": {},\n  \"c\": []\n}"
        );
        assert_eq!(parts[2], r#""\u00e9\ud83d\ude00\"\\\n\u0001""#);
        assert_eq!(
            parts[3],
            r#"{"a":[1,2.5,1e+20,0.0001,1e-05,null,true],"b":{},"c":[]}"#
        );
    }

    #[test]
    fn python_style_values() {
        assert_eq!(python_float(1.0), "1.0");
        assert_eq!(python_float(-0.0), "-0.0");
        assert_eq!(python_float(123456789012345.0), "123456789012345.0");
        assert_eq!(python_float(1e16), "1e+16");
        assert_eq!(python_float(1.5e-7), "1.5e-07");
        assert_eq!(python_float(0.1), "0.1");
        assert_eq!(python_float(f64::INFINITY), "Infinity");
        let t = ChatTemplate::new("{{ a }} {{ b }} {{ c | string }} {{ d }} {{ e }}").unwrap();
        let kwargs = json!({"a": true, "b": null, "c": false, "d": ["x", "it's"], "e": 2.0});
        let out = t
            .render_with(&[], None, false, kwargs.as_object().unwrap())
            .unwrap();
        assert_eq!(out, "True None False ['x', \"it's\"] 2.0");
    }

    #[test]
    fn strftime_formats_dates() {
        // 2024-03-05 07:08:09 UTC, a Tuesday.
        let secs = 1_709_622_489;
        assert_eq!(
            strftime("%Y-%m-%d %H:%M:%S %a %A %b %B %d %j %y %%", secs).unwrap(),
            "2024-03-05 07:08:09 Tue Tuesday Mar March 05 065 24 %"
        );
        assert_eq!(strftime("%d %b %Y", 0).unwrap(), "01 Jan 1970");
        assert!(strftime("%Q", 0).is_err());
        let t = ChatTemplate::new("{{ strftime_now('%Y') }}").unwrap();
        let year: i64 = t.render(&[], None, false).unwrap().parse().unwrap();
        assert!(year >= 2024);
    }

    #[test]
    fn from_dir_prefers_jinja_then_config() {
        let dir = temp_dir("fromdir");
        assert!(ChatTemplate::from_dir(&dir).unwrap().is_none());

        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": [
                {"name": "tool_use", "template": "TOOLS"},
                {"name": "default", "template": "DEFAULT {{ eos_token }}"}],
                "eos_token": {"content": "<|im_end|>"}})
            .to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], None, false).unwrap(), "DEFAULT <|im_end|>");

        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": "CONFIG {{ bos_token }}", "bos_token": "<s>"}).to_string(),
        )
        .unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], None, false).unwrap(), "CONFIG <s>");

        std::fs::write(dir.join(CHAT_TEMPLATE_FILE), "JINJA\n").unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[], None, false).unwrap(), "JINJA");

        std::fs::write(dir.join(CHAT_TEMPLATE_FILE), "{% if %}").unwrap();
        assert!(matches!(
            ChatTemplate::from_dir(&dir),
            Err(Error::Template(_))
        ));

        std::fs::remove_file(dir.join(CHAT_TEMPLATE_FILE)).unwrap();
        std::fs::write(
            dir.join("tokenizer_config.json"),
            json!({"chat_template": [{"name": "tool_use", "template": "T"}]}).to_string(),
        )
        .unwrap();
        assert!(matches!(
            ChatTemplate::from_dir(&dir),
            Err(Error::Template(_))
        ));
        std::fs::write(dir.join("tokenizer_config.json"), "{not json").unwrap();
        assert!(matches!(
            ChatTemplate::from_dir(&dir),
            Err(Error::Template(_))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
