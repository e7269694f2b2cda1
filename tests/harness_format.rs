//! The strict tool-call format check against its corpus: malformed calls
//! that lenient (qwen3_coder-style) parsers accept must all be rejected with
//! the expected reason, and valid calls (multi-line values, `<` and XML-like
//! text, Unicode, reasoning before the call) must all be accepted; the same
//! verdicts through `arcticd check-format`. The corpus lives in
//! tests/fixtures/format/ (invalid.json, valid.json).

use anyhow::{ensure, Context, Result};
use arcticd_trainer::harness::{format, tools};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn corpus(name: &str) -> Result<Vec<Value>> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/format")
        .join(name);
    let text = std::fs::read_to_string(&p).with_context(|| p.display().to_string())?;
    Ok(serde_json::from_str(&text)?)
}

fn field<'a>(v: &'a Value, k: &str) -> &'a str {
    v.get(k).and_then(Value::as_str).unwrap_or_default()
}

#[test]
fn rejects_every_malformed_call_with_its_reason() -> Result<()> {
    let cases = corpus("invalid.json")?;
    ensure!(cases.len() >= 30, "only {} malformed cases", cases.len());
    let schemas = tools::tool_schemas();
    for c in &cases {
        match format::check(field(c, "text"), &schemas) {
            Ok(call) => anyhow::bail!("{} accepted as {call:?}", field(c, "name")),
            Err(v) => ensure!(
                v.code == field(c, "reason"),
                "{}: reason {} ({}), expected {}",
                field(c, "name"),
                v.code,
                v.detail,
                field(c, "reason")
            ),
        }
    }
    Ok(())
}

#[test]
fn accepts_every_valid_call() -> Result<()> {
    let cases = corpus("valid.json")?;
    ensure!(cases.len() >= 15);
    let schemas = tools::tool_schemas();
    for c in &cases {
        if let Err(v) = format::check(field(c, "text"), &schemas) {
            anyhow::bail!("{} rejected: {v}", field(c, "name"));
        }
    }
    // Values come back exactly, typed by the schema.
    let unicode = cases
        .iter()
        .find(|c| field(c, "name") == "unicode")
        .context("unicode case")?;
    let call =
        format::check(field(unicode, "text"), &schemas).map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(call.arguments["new_str"] == "GREETING = \"héllo wörld — 你好 🌍\"");
    let ranged = cases
        .iter()
        .find(|c| field(c, "name") == "view_range")
        .context("view_range")?;
    let call =
        format::check(field(ranged, "text"), &schemas).map_err(|e| anyhow::anyhow!("{e}"))?;
    ensure!(call.arguments["view_range"] == serde_json::json!([1, 20]));
    Ok(())
}

#[test]
fn check_format_command_gives_the_same_verdicts() -> Result<()> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/format");
    for (file, want) in [("invalid.json", "invalid"), ("valid.json", "valid")] {
        let cases = corpus(file)?;
        let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
            .args(["check-format", "--input"])
            .arg(dir.join(file))
            .output()?;
        ensure!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let lines: Vec<Value> = String::from_utf8(out.stdout)?
            .lines()
            .map(serde_json::from_str)
            .collect::<std::result::Result<_, _>>()?;
        ensure!(lines.len() == cases.len());
        for (v, c) in lines.iter().zip(&cases) {
            ensure!(field(v, "verdict") == want, "{}: {v}", field(c, "name"));
            if want == "invalid" {
                ensure!(
                    field(v, "reason") == field(c, "reason"),
                    "{}: {v}",
                    field(c, "name")
                );
            } else {
                ensure!(v.get("call").is_some());
            }
        }
    }
    let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["check-format", "--input", "/nonexistent/arcticd.json"])
        .output()?;
    ensure!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("error:"));
    // Tool schemas that name no function are refused, not read as no tools.
    let bad_tools =
        std::env::temp_dir().join(format!("arcticd-bad-tools-{}.json", std::process::id()));
    std::fs::write(
        &bad_tools,
        r#"[{"type": "function", "function": {"parameters": {}}}]"#,
    )?;
    let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["check-format", "--input"])
        .arg(dir.join("valid.json"))
        .arg("--tools")
        .arg(&bad_tools)
        .output()?;
    std::fs::remove_file(&bad_tools).ok();
    let err = String::from_utf8_lossy(&out.stderr);
    ensure!(
        !out.status.success()
            && err.contains("tools[0] has no function name")
            && out.stdout.is_empty(),
        "{err}"
    );
    Ok(())
}
