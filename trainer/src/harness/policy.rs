//! The model behind a rollout, as a trait: prompt token ids in, generated
//! token ids out with their behaviour log-probabilities and the weight
//! version that produced each, and why generation stopped.
//!
//! Implementations: [`ScriptedPolicy`] (replays known turns; tests and
//! demos), [`super::openai::OpenAiPolicy`] (any OpenAI-compatible
//! `/v1/completions` endpoint), and the in-process engine (plugged in by the
//! engine crate's owner: it only has to implement [`Policy`]). Not for:
//! sampling itself or prompt construction (the rollout builds prompts).

use crate::{Error, Result};
use arcticd_engine::tokenizer::Tokenizer;
pub use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// One generation request.
#[derive(Debug, Clone)]
pub struct GenerateRequest {
    /// The whole context so far, exactly as the model should see it.
    pub prompt_ids: Vec<u32>,
    /// Most tokens to generate.
    pub max_new_tokens: usize,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Generation stops after any of these (the end-of-turn token).
    pub stop_token_ids: Vec<u32>,
    /// The same for every turn of one rollout and different between
    /// rollouts (a hash of task and attempt); pinned routing keys on it.
    pub session: u64,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// A stop token (end of turn) was produced.
    Stop,
    /// `max_new_tokens` ran out.
    Length,
}

/// What the model produced.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Generated ids, the stop token included when one ended the turn.
    pub token_ids: Vec<u32>,
    /// Log-probability of each generated token under the distribution it
    /// was sampled from (after temperature).
    pub logprobs: Vec<f32>,
    /// Weight version that produced each token.
    pub weight_versions: Vec<u64>,
    pub finish_reason: FinishReason,
}

impl Completion {
    /// Checks the per-token vectors line up.
    pub fn check(&self) -> Result<()> {
        if self.logprobs.len() != self.token_ids.len()
            || self.weight_versions.len() != self.token_ids.len()
        {
            return Err(Error::Input(format!(
                "completion has {} tokens, {} logprobs and {} weight versions",
                self.token_ids.len(),
                self.logprobs.len(),
                self.weight_versions.len()
            )));
        }
        Ok(())
    }
}

/// A model that continues token sequences.
#[async_trait]
pub trait Policy: Send + Sync {
    /// Continues `req.prompt_ids`.
    async fn generate(&self, req: GenerateRequest) -> Result<Completion>;
    /// A name for logs and trajectory records.
    fn name(&self) -> String;
    /// The most tokens one sequence (prompt and completion) may hold, when
    /// the policy knows it: a rollout that would pass it ends on its
    /// context budget (the agent's doing) instead of in a refused request
    /// (masked as the policy's failure).
    fn context_limit(&self) -> Option<usize> {
        None
    }
}

/// Replays fixed assistant turns (raw text, encoded with the tokenizer and
/// ended with the end-of-turn token). Runs out into empty turns, which the
/// format gate rejects. Log-probabilities are 0 and the weight version 0.
///
/// Plays its turns in order, one per call: use one instance per rollout.
pub struct ScriptedPolicy {
    tokenizer: Arc<Tokenizer>,
    turns: Vec<String>,
    next: AtomicUsize,
    /// Finish every turn with `Length` instead (to exercise that gate).
    pub truncate: bool,
    seen: Mutex<Vec<usize>>,
}

impl ScriptedPolicy {
    pub fn new(tokenizer: Arc<Tokenizer>, turns: Vec<String>) -> Self {
        ScriptedPolicy {
            tokenizer,
            turns,
            next: AtomicUsize::new(0),
            truncate: false,
            seen: Mutex::new(Vec::new()),
        }
    }

    /// Prompt lengths seen per call (tests check prompts only grow).
    pub fn prompt_lengths(&self) -> Vec<usize> {
        self.seen.lock().map(|v| v.clone()).unwrap_or_default()
    }
}

#[async_trait]
impl Policy for ScriptedPolicy {
    async fn generate(&self, req: GenerateRequest) -> Result<Completion> {
        if let Ok(mut v) = self.seen.lock() {
            v.push(req.prompt_ids.len());
        }
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let text = self.turns.get(i).cloned().unwrap_or_default();
        let mut ids = self.tokenizer.encode(&text)?;
        let finish = if self.truncate || ids.len() > req.max_new_tokens {
            ids.truncate(req.max_new_tokens);
            FinishReason::Length
        } else {
            if let Some(&stop) = req.stop_token_ids.first() {
                ids.push(stop);
            }
            FinishReason::Stop
        };
        Ok(Completion {
            logprobs: vec![0.0; ids.len()],
            weight_versions: vec![0; ids.len()],
            token_ids: ids,
            finish_reason: finish,
        })
    }

    fn name(&self) -> String {
        "scripted".into()
    }
}
