//! The model side of the harness without sandboxes: the observation tokens
//! the harness appends are exactly what the chat template renders for a
//! tool response and the next generation prompt; the OpenAI-compatible
//! client speaks `/v1/completions` correctly to a fake server; the
//! in-process engine policy returns per-token log-probabilities and weight
//! versions from a real (tiny, random) model.

use anyhow::{ensure, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::tokio;
use arcticd_trainer::harness::engine_policy::{EnginePolicy, Routing};
use arcticd_trainer::harness::openai::{OpenAiConfig, OpenAiPolicy};
use arcticd_trainer::harness::policy::{FinishReason, GenerateRequest, Policy};
use arcticd_trainer::harness::{Harness, RolloutConfig};
use serde_json::{json, Value};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;

struct TempDir(PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn tiny_model(tag: &str) -> Result<TempDir> {
    let p = std::env::temp_dir().join(format!("arcticd-policies-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&p);
    let out = Command::new(env!("CARGO_BIN_EXE_arcticd"))
        .args(["init-model", "--preset", "tiny", "--out"])
        .arg(&p)
        .output()?;
    ensure!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(TempDir(p))
}

#[test]
fn appended_observation_matches_the_chat_template() -> Result<()> {
    for thinking in [false, true] {
        let t = ChatTemplate::qwen35();
        let tok = tiny_model(if thinking { "tmpl1" } else { "tmpl0" })?;
        let tokenizer = Arc::new(Tokenizer::from_dir(&tok.0)?);
        let cfg = RolloutConfig {
            enable_thinking: thinking,
            ..Default::default()
        };
        let h = Harness::new(tokenizer, ChatTemplate::qwen35(), cfg)?;
        let mut kw = serde_json::Map::new();
        kw.insert("enable_thinking".into(), Value::Bool(thinking));
        let base = vec![
            json!({"role": "system", "content": "sys"}),
            json!({"role": "user", "content": "fix it"}),
            json!({"role": "assistant", "content": "I will look."}),
        ];
        let before = t.render_with(&base, Some(h.tools()), false, &kw)?;
        let mut with_tool = base.clone();
        with_tool.push(json!({"role": "tool", "content": "a.py\nb.py"}));
        let after = t.render_with(&with_tool, Some(h.tools()), true, &kw)?;
        let appended = h.observation_text("a.py\nb.py", true);
        // The model's turn ends at <|im_end|>; the template's newline after
        // it is the first character the harness appends.
        let expected = format!("{}{}", before.trim_end_matches('\n'), appended);
        ensure!(
            after == expected,
            "thinking={thinking}\ntemplate:\n{after:?}\nharness:\n{expected:?}"
        );
    }
    Ok(())
}

/// A one-shot HTTP server: returns the request body it got.
async fn fake_server(reply: Value) -> Result<(String, tokio::task::JoinHandle<Result<Value>>)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
    let addr = listener.local_addr()?;
    let handle = tokio::spawn(async move {
        let (mut sock, _) = listener.accept().await?;
        let mut buf = Vec::new();
        let mut chunk = [0u8; 4096];
        let (head_end, len) = loop {
            let n = sock.read(&mut chunk).await?;
            ensure!(n > 0, "connection closed early");
            buf.extend_from_slice(&chunk[..n]);
            if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                ensure!(head.starts_with("post /v1/completions "), "{head}");
                let len: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("content-length:"))
                    .context("no content-length")?
                    .trim()
                    .parse()?;
                break (i + 4, len);
            }
        };
        while buf.len() < head_end + len {
            let n = sock.read(&mut chunk).await?;
            ensure!(n > 0, "body cut short");
            buf.extend_from_slice(&chunk[..n]);
        }
        let body: Value = serde_json::from_slice(&buf[head_end..head_end + len])?;
        let text = reply.to_string();
        let resp = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{text}",
            text.len()
        );
        sock.write_all(resp.as_bytes()).await?;
        sock.shutdown().await?;
        Ok(body)
    });
    Ok((format!("http://{addr}"), handle))
}

#[test]
fn openai_client_round_trip() -> Result<()> {
    let dir = tiny_model("openai")?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.0)?);
    let im_end = tokenizer.token_to_id("<|im_end|>").context("im_end")?;
    let call = "<tool_call>\n<function=submit>\n</function>\n</tool_call>";
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let reply = json!({"choices": [{"text": call, "finish_reason": "stop", "logprobs": null}]});
        let (url, server) = fake_server(reply).await?;
        let policy = OpenAiPolicy::new(
            OpenAiConfig {
                endpoint: format!("{url}/v1"),
                model: "m1".into(),
                ..Default::default()
            },
            tokenizer.clone(),
        )?;
        let prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")?;
        let c = policy
            .generate(GenerateRequest {
                prompt_ids: prompt.clone(),
                max_new_tokens: 64,
                temperature: 0.5,
                stop_token_ids: vec![im_end],
                session: 0,
            })
            .await?;
        let body = server.await??;
        ensure!(
            body["model"] == "m1" && body["max_tokens"] == 64 && body["temperature"] == 0.5,
            "{body}"
        );
        ensure!(
            body["prompt"] == tokenizer.decode(&prompt, false)?.as_str(),
            "{body}"
        );
        ensure!(body["stop"] == json!(["<|im_end|>"]), "{body}");
        ensure!(c.finish_reason == FinishReason::Stop);
        ensure!(c.token_ids.last() == Some(&im_end));
        ensure!(tokenizer.decode(&c.token_ids[..c.token_ids.len() - 1], false)? == call);
        c.check()?;

        // A server error is an error, not a turn.
        let (url, server) = fake_server(json!({"oops": true})).await?;
        let policy = OpenAiPolicy::new(
            OpenAiConfig {
                endpoint: url,
                ..Default::default()
            },
            tokenizer.clone(),
        )?;
        let r = policy
            .generate(GenerateRequest {
                prompt_ids: prompt,
                max_new_tokens: 8,
                temperature: 0.0,
                stop_token_ids: vec![im_end],
                session: 0,
            })
            .await;
        let _ = server.await;
        ensure!(r.is_err(), "a reply without choices was accepted");
        ensure!(OpenAiPolicy::new(
            OpenAiConfig {
                endpoint: "https://example.invalid".into(),
                ..Default::default()
            },
            tokenizer,
        )
        .is_err());
        Ok(())
    })
}

#[test]
fn engine_policy_reports_logprobs_and_versions() -> Result<()> {
    let dir = tiny_model("engine")?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.0)?);
    let model = arcticd_engine::Qwen3_5::load(&dir.0)?;
    let store = arcticd_engine::ParamStore::new(model);
    let router = arcticd_engine::router::Router::start(
        1,
        store,
        Some(tokenizer.clone()),
        arcticd_engine::engine::EngineConfig::default(),
    )?;
    let policy = EnginePolicy::new(router, "tiny");
    let im_end = tokenizer.token_to_id("<|im_end|>").context("im_end")?;
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")?;
        let c = policy
            .generate(GenerateRequest {
                prompt_ids: prompt,
                max_new_tokens: 12,
                temperature: 1.0,
                stop_token_ids: vec![im_end],
                session: 0,
            })
            .await?;
        c.check()?;
        ensure!(!c.token_ids.is_empty() && c.token_ids.len() <= 12);
        ensure!(c.logprobs.iter().all(|l| l.is_finite() && *l <= 0.0));
        if c.finish_reason == FinishReason::Length {
            ensure!(c.token_ids.len() == 12);
        }
        Ok(())
    })
}

/// Requests served per replica when six requests of one session run at once
/// under `routing`, on two replicas.
fn served_per_replica(routing: Routing) -> Result<Vec<u64>> {
    let dir = tiny_model(&format!("routing-{routing:?}"))?;
    let tokenizer = Arc::new(Tokenizer::from_dir(&dir.0)?);
    let model = arcticd_engine::Qwen3_5::load(&dir.0)?;
    let router = arcticd_engine::router::Router::start(
        2,
        arcticd_engine::ParamStore::new(model),
        Some(tokenizer.clone()),
        arcticd_engine::engine::EngineConfig::default(),
    )?;
    let policy = Arc::new(EnginePolicy::new(router.clone(), "tiny").with_routing(routing));
    let prompt = tokenizer.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")?;
    let rt = arcticd_sandbox::runtime()?;
    rt.block_on(async {
        let jobs: Vec<_> = (0..6)
            .map(|_| {
                let (policy, prompt) = (policy.clone(), prompt.clone());
                tokio::spawn(async move {
                    policy
                        .generate(GenerateRequest {
                            prompt_ids: prompt,
                            max_new_tokens: 8,
                            temperature: 1.0,
                            stop_token_ids: vec![],
                            session: 5,
                        })
                        .await
                })
            })
            .collect();
        for j in jobs {
            j.await??;
        }
        Ok::<_, anyhow::Error>(())
    })?;
    let served = router
        .replicas()
        .iter()
        .map(|r| {
            r.metrics()
                .prompt_tokens
                .load(std::sync::atomic::Ordering::Relaxed)
                / prompt.len() as u64
        })
        .collect();
    router.shutdown();
    Ok(served)
}

/// Pinned routing (an ablation) keeps every request of a session on the
/// replica the session picks (5 % 2 = 1); least-loaded spreads them.
#[test]
fn pinned_routing_keeps_a_session_on_one_replica_and_least_loaded_spreads() -> Result<()> {
    let pinned = served_per_replica(Routing::Pinned)?;
    ensure!(pinned == vec![0, 6], "pinned: {pinned:?}");
    let spread = served_per_replica(Routing::LeastLoaded)?;
    ensure!(
        spread.iter().sum::<u64>() == 6 && spread.iter().all(|&n| n > 0),
        "least loaded: {spread:?}"
    );
    Ok(())
}
