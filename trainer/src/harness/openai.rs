//! A [`Policy`] over any OpenAI-compatible HTTP endpoint (vLLM, SGLang,
//! llama.cpp, our own server), for evaluation and auditing with a model
//! served elsewhere.
//!
//! It calls `/v1/completions` with the prompt as text (the prompt ids
//! decoded with special tokens kept), not `/v1/chat/completions`: a chat
//! endpoint would re-render the conversation from messages on the server,
//! which breaks the rule that the model sees exactly the tokens the
//! trajectory records. The returned text is re-encoded with our tokenizer;
//! the server's per-token log-probabilities are used when their count
//! matches, else they are recorded as 0 (external models are only
//! evaluated, never trained on). Weight version is 0. Plain `http://` only
//! (no TLS): endpoints are expected on the local network.

use super::policy::{Completion, FinishReason, GenerateRequest, Policy};
use crate::{Error, Result};
use arcticd_engine::tokenizer::Tokenizer;
use async_trait::async_trait;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{json, Value};
use std::sync::Arc;

/// Settings of [`OpenAiPolicy`].
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(default)]
pub struct OpenAiConfig {
    /// Base URL, e.g. `http://127.0.0.1:8000` or `http://host:8000/v1`.
    /// Default `http://127.0.0.1:8000`.
    pub endpoint: String,
    /// Model name sent in each request. Default `default`.
    pub model: String,
    /// Limit of one request, seconds. Default 600.
    pub request_timeout_secs: f64,
    /// Sent as a bearer token when not empty. Default empty.
    pub api_key: String,
}

impl Default for OpenAiConfig {
    fn default() -> Self {
        OpenAiConfig {
            endpoint: "http://127.0.0.1:8000".into(),
            model: "default".into(),
            request_timeout_secs: 600.0,
            api_key: String::new(),
        }
    }
}

/// The OpenAI-compatible client.
pub struct OpenAiPolicy {
    cfg: OpenAiConfig,
    tokenizer: Arc<Tokenizer>,
    client: Client<hyper_util::client::legacy::connect::HttpConnector, Full<bytes::Bytes>>,
}

impl OpenAiPolicy {
    pub fn new(cfg: OpenAiConfig, tokenizer: Arc<Tokenizer>) -> Result<Self> {
        super::rollout::check_secs("request_timeout_secs", cfg.request_timeout_secs, None)?;
        if !cfg.endpoint.starts_with("http://") {
            return Err(Error::Input(format!(
                "endpoint {:?} must start with http:// (TLS is not supported)",
                cfg.endpoint
            )));
        }
        let client = Client::builder(TokioExecutor::new()).build_http();
        Ok(OpenAiPolicy {
            cfg,
            tokenizer,
            client,
        })
    }

    fn url(&self) -> String {
        let base = self.cfg.endpoint.trim_end_matches('/');
        if base.ends_with("/v1") {
            format!("{base}/completions")
        } else {
            format!("{base}/v1/completions")
        }
    }

    async fn post(&self, body: Value) -> Result<Value> {
        let bytes = serde_json::to_vec(&body).map_err(|e| Error::Input(e.to_string()))?;
        let mut req = hyper::Request::post(self.url()).header("content-type", "application/json");
        if !self.cfg.api_key.is_empty() {
            req = req.header("authorization", format!("Bearer {}", self.cfg.api_key));
        }
        let req = req
            .body(Full::new(bytes::Bytes::from(bytes)))
            .map_err(|e| Error::Input(format!("building the request: {e}")))?;
        let fut = async {
            let resp = self
                .client
                .request(req)
                .await
                .map_err(|e| Error::Endpoint(format!("POST {}: {e}", self.url())))?;
            let status = resp.status();
            let body = resp
                .into_body()
                .collect()
                .await
                .map_err(|e| Error::Endpoint(format!("reading the response: {e}")))?
                .to_bytes();
            if !status.is_success() {
                return Err(Error::Endpoint(format!(
                    "POST {}: HTTP {status}: {}",
                    self.url(),
                    String::from_utf8_lossy(&body)
                        .chars()
                        .take(500)
                        .collect::<String>()
                )));
            }
            serde_json::from_slice::<Value>(&body)
                .map_err(|e| Error::Endpoint(format!("response is not JSON: {e}")))
        };
        match arcticd_sandbox::tokio::time::timeout(
            std::time::Duration::from_secs_f64(self.cfg.request_timeout_secs),
            fut,
        )
        .await
        {
            Ok(r) => r,
            Err(_) => Err(Error::Endpoint(format!(
                "POST {} timed out after {} s",
                self.url(),
                self.cfg.request_timeout_secs
            ))),
        }
    }
}

#[async_trait]
impl Policy for OpenAiPolicy {
    async fn generate(&self, req: GenerateRequest) -> Result<Completion> {
        let prompt = self.tokenizer.decode(&req.prompt_ids, false)?;
        let stop: Vec<String> = req
            .stop_token_ids
            .iter()
            .filter_map(|&id| self.tokenizer.id_to_token(id))
            .collect();
        let body = json!({
            "model": self.cfg.model,
            "prompt": prompt,
            "max_tokens": req.max_new_tokens,
            "temperature": req.temperature,
            "logprobs": 1,
            "stop": stop,
            "skip_special_tokens": false,
        });
        let v = self.post(body).await?;
        let choice = v
            .get("choices")
            .and_then(|c| c.get(0))
            .ok_or_else(|| Error::Endpoint(format!("response has no choices: {v}")))?;
        let text = choice.get("text").and_then(Value::as_str).unwrap_or("");
        let finish_reason = match choice.get("finish_reason").and_then(Value::as_str) {
            Some("length") => FinishReason::Length,
            _ => FinishReason::Stop,
        };
        let mut ids = self.tokenizer.encode(text)?;
        let server_lps: Vec<f32> = choice
            .get("logprobs")
            .and_then(|l| l.get("token_logprobs"))
            .and_then(Value::as_array)
            .map(|a| a.iter().map(|x| x.as_f64().unwrap_or(0.0) as f32).collect())
            .unwrap_or_default();
        let mut logprobs = if server_lps.len() == ids.len() {
            server_lps
        } else {
            vec![0.0; ids.len()]
        };
        if finish_reason == FinishReason::Stop {
            if let Some(&stop) = req.stop_token_ids.first() {
                if ids.last() != Some(&stop) {
                    ids.push(stop);
                    logprobs.push(0.0);
                }
            }
        }
        Ok(Completion {
            weight_versions: vec![0; ids.len()],
            logprobs,
            token_ids: ids,
            finish_reason,
        })
    }

    fn name(&self) -> String {
        format!("openai:{}@{}", self.cfg.model, self.cfg.endpoint)
    }
}
