//! The engine: one thread that owns a scheduler and its cache, reads weights
//! from a shared [`ParamStore`], and generates for requests that reach it
//! over a channel. Each request carries its own reply channel, on which the
//! engine sends one [`Event`] per generated token and one per finished
//! choice (a collected request, [`EngineHandle::submit_collected`], gets a
//! choice's token events together when it finishes). A reply channel whose
//! receiver is gone (a client that hung up) aborts the request and frees its
//! sequences.
//!
//! The loop, between any two steps: take new commands; if the parameter
//! store's `weight_version` moved, drop the prefix cache and make every
//! running sequence recompute its cache from its token ids; plan a step;
//! run the forward for it, one run of sequences per pool thread, each run
//! also making its sampled rows' logits (and greedy picks); sample for the
//! sequences whose tokens are all in the cache; send events. Two ablations
//! of the recipe change this loop (`EngineConfig::state_dtype`,
//! `EngineConfig::rebuild_caches`); both are off by default.
//!
//! On a GPU (`EngineConfig::device`) the same loop runs the CUDA model
//! over a cache that lives on the device: the scheduler, prefix cache and
//! version contract are the same, only the forward differs (one packed
//! batch on the device; the sampled rows' logits come back to the host).
//!
//! Weight updates (docs/ARCHITECTURE.md, recipe step 7): [`EngineHandle::pause`] returns once
//! the engine is between two steps and holds no read guard; the owner of the
//! store updates it in place; [`EngineHandle::resume`] lets the engine go on,
//! and the version check above rebuilds every in-flight cache under the new
//! weights before any new token. Every token is tagged with the version
//! that produced it.
//!
//! A prompt's log-probs ([`EngineHandle::score_prompt`], for `echo` with
//! `logprobs`) are a full forward of the prompt on fresh state, run by the
//! same thread between two steps, under the weights of that moment.
//!
//! Not for: HTTP or text (the server), routing across replicas (`router.rs`).

use crate::error::Failure;
use crate::kv_cache::{fit_slots, CacheLayout, PagedKvCache, Placement};
use crate::model::{LinearPacks, PagedPast, PrefillForm, Qwen3_5, SeqCache, SeqInput, WeightDType};
use crate::params::ParamStore;
use crate::sampler::{Sampled, Sampler, SamplingParams, MAX_TOP_LOGPROBS};
use crate::scheduler::{Limits, Scheduled, Scheduler, Sequence};
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use arcticd_kernels::cpu::logsoftmax::greedy_pick;
use arcticd_kernels::Device;
use rayon::prelude::*;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// Engine configuration. Flat; every field has a default.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineConfig {
    /// Positions per KV block. Default 16.
    pub block_size: usize,
    /// Bytes for the KV blocks and state slots together, allocated once.
    /// Default 256 MiB.
    pub cache_memory: usize,
    /// Most sequences running at once. Default 64.
    pub max_num_seqs: usize,
    /// Most tokens in one step's packed forward. Must be at least
    /// `max_num_seqs + prefix_unit`. Default 1024.
    pub max_batched_tokens: usize,
    /// Prefill segment alignment and prefix-cache granularity in tokens; a
    /// multiple of `block_size`. Default 64 (the gated delta chunk).
    pub prefix_unit: usize,
    /// State snapshots the prefix cache may keep. Default 64.
    pub prefix_snapshots: usize,
    /// Reuse cached prompt prefixes. Default true.
    pub enable_prefix_cache: bool,
    /// Longest prompt plus completion, in tokens. Default 32768.
    pub max_model_len: usize,
    /// How the recurrent and conv state is kept between steps. Default
    /// `f32`, the design; `bf16` is an ablation (see [`StateDtype`]).
    pub state_dtype: StateDtype,
    /// Rebuild every in-flight sequence's caches under new weights after an
    /// update. Default true, the design. `false` is an ablation: in-flight
    /// sequences keep the K/V and state the old weights computed (only the
    /// prefix cache is dropped), so the tokens they generate after an
    /// update no longer match a forward under the weights they are tagged
    /// with.
    pub rebuild_caches: bool,
    /// Where the model runs: `cpu` (the default) or `cuda:N` (builds with
    /// the `cuda` feature). On a GPU `cache_memory` is device memory.
    #[serde(with = "device_name")]
    pub device: Device,
    /// How the matrices are held on a GPU (`bf16`, the default, or `f32`).
    /// Ignored on the CPU.
    pub weights: WeightDType,
    /// How a prefill runs the gated-delta recurrence: `recurrent` (the
    /// default: the trainer's bits) or `chunked` (see [`PrefillForm`]).
    pub prefill: PrefillForm,
    /// On a GPU, the deterministic mode: the forward products run on an
    /// in-order kernel instead of cuBLAS, so a row's bits do not depend on
    /// the rows beside it (a prefix hit equals a cold run, a decode step the
    /// full forward), as on the CPU; slower prefill. Default false. The CPU
    /// is always so.
    pub batch_invariant: bool,
}

/// A [`Device`] in a config file: its name (`cpu`, `cuda:0`).
mod device_name {
    use arcticd_kernels::Device;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &Device, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(d)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Device, D::Error> {
        let name = String::deserialize(d)?;
        name.parse().map_err(serde::de::Error::custom)
    }
}

/// The precision of the recurrent and conv state between engine steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StateDtype {
    /// fp32 always, as the trainer keeps it: engine and trainer agree.
    #[default]
    F32,
    /// Rounded to bf16 after every step (each decode token, each prefill
    /// segment), computed in fp32 in between: the common inference default
    /// for these models, and an ablation here. The trainer stays fp32.
    Bf16,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            block_size: 16,
            cache_memory: 256 << 20,
            max_num_seqs: 64,
            max_batched_tokens: 1024,
            prefix_unit: 64,
            prefix_snapshots: 64,
            enable_prefix_cache: true,
            max_model_len: 32768,
            state_dtype: StateDtype::F32,
            rebuild_caches: true,
            device: Device::Cpu,
            weights: WeightDType::Bf16,
            prefill: PrefillForm::Recurrent,
            batch_invariant: false,
        }
    }
}

impl EngineConfig {
    /// Bytes one engine step of `model` may hold beside its cache, at its
    /// peak: one layer's activations for `max_batched_tokens` tokens (what
    /// the training forward keeps of a layer, an upper bound of what the
    /// inference forward has live at once; the residual stream is among
    /// them) and one chunk of logits (the sampled rows, at least
    /// `max_num_seqs`, or a scoring chunk). An estimate, in f32: on a GPU
    /// it is memory the cache must leave free.
    pub fn step_scratch_bytes(&self, model: &crate::config::ModelConfig) -> usize {
        let t = [self.max_batched_tokens];
        let layer = (0..model.layer_types.len())
            .map(|li| crate::model::planned_layer_floats(model, li, &t))
            .max()
            .unwrap_or(0);
        let rows = self
            .max_num_seqs
            .max(crate::model::qwen3_5::logit_rows_per_chunk(
                model.vocab_size,
            ))
            .min(self.max_batched_tokens);
        (layer + rows * model.vocab_size) * 4
    }

    fn validate(&self) -> Result<()> {
        let bad = |m: &str| Err(Error::Config(m.into()));
        if self.block_size == 0
            || self.prefix_unit == 0
            || !self.prefix_unit.is_multiple_of(self.block_size)
        {
            return bad("prefix_unit must be a positive multiple of block_size");
        }
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be positive");
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be positive");
        }
        let least = self.max_num_seqs.saturating_add(self.prefix_unit);
        if self.max_batched_tokens < least {
            return Err(Error::Config(format!(
                "max_batched_tokens ({}) must be at least max_num_seqs + prefix_unit \
                 ({} + {} = {least}): raise it, or lower max_num_seqs",
                self.max_batched_tokens, self.max_num_seqs, self.prefix_unit
            )));
        }
        if self.device != Device::Cpu && self.state_dtype == StateDtype::Bf16 {
            return bad(
                "state_dtype = \"bf16\" is an ablation of the CPU engine; a GPU keeps fp32 state",
            );
        }
        Ok(())
    }
}

/// The `state_dtype = "bf16"` ablation: every conv and recurrent state
/// value rounded to the nearest bf16 (K/V stay fp32).
fn round_states_to_bf16(cache: &mut SeqCache) {
    for x in cache
        .conv_state
        .iter_mut()
        .chain(cache.recurrent_state.iter_mut())
        .flatten()
    {
        *x = half::bf16::from_f32(*x).to_f32();
    }
}

/// Why a choice ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// `max_tokens` or the context length.
    Length,
    /// An end-of-sequence id, a stop id, or a stop string (given).
    Stop { stop_string: Option<String> },
    /// Cancelled (shutdown).
    Abort,
}

/// One generated token.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenEvent {
    /// Which of the request's `n` choices.
    pub index: usize,
    pub token: u32,
    /// Log-probability under the distribution it was sampled from (after
    /// temperature; see `sampler.rs`).
    pub logprob: f32,
    /// Requested alternatives (id, log-prob), most likely first.
    pub top_logprobs: Vec<(u32, f32)>,
    /// Version of the weights that produced it.
    pub weight_version: u64,
}

/// What the engine sends back for a request.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(TokenEvent),
    Finished {
        index: usize,
        reason: FinishReason,
    },
    /// The request failed inside the engine (an internal failure, not the
    /// request's fault: requests are validated on submit); no more events
    /// follow. [`apply_event`] turns it into [`Error::Internal`].
    Error(Failure),
}

/// A generation request: prompt token ids and sampling parameters.
#[derive(Debug, Clone)]
pub struct Request {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// A prompt's tokens as the model scores them ([`EngineHandle::score_prompt`]).
#[derive(Debug, Clone, PartialEq)]
pub struct PromptScores {
    /// Every token after the first: its log-prob under the model
    /// (temperature 1) given the tokens before it, and the requested
    /// alternatives at its place. The first token has none.
    pub tokens: Vec<Sampled>,
    /// Version of the weights that scored them.
    pub weight_version: u64,
}

/// Where a prompt's scores arrive ([`EngineHandle::submit_score`]).
pub type ScoreReceiver = tokio::sync::oneshot::Receiver<Result<PromptScores>>;

/// One finished choice, collected from the events.
#[derive(Debug, Clone, Default)]
pub struct Choice {
    pub tokens: Vec<u32>,
    pub logprobs: Vec<f32>,
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
    pub weight_versions: Vec<u64>,
    pub finish_reason: Option<FinishReason>,
}

/// Gauges and counters the engine publishes after every step (for
/// `/metrics` and the router). Plain atomics, written by the engine thread
/// only.
#[derive(Debug, Default)]
pub struct EngineMetrics {
    pub running: AtomicU64,
    pub waiting: AtomicU64,
    pub blocks_used: AtomicU64,
    pub blocks_total: AtomicU64,
    pub prompt_tokens: AtomicU64,
    pub prefix_hit_tokens: AtomicU64,
    pub generated_tokens: AtomicU64,
    pub steps: AtomicU64,
    pub preemptions: AtomicU64,
    /// Tokens prefilled again after preemption.
    pub recomputed_tokens: AtomicU64,
    /// Outstanding work: for every unfinished request, n * (prompt tokens +
    /// max_tokens). Added on submit, removed when the request ends.
    pub load: AtomicU64,
}

/// Fixed facts about an engine, for request validation.
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub vocab_size: usize,
    /// The configured limit, or the model's `max_position_embeddings` when
    /// that is lower.
    pub max_model_len: usize,
    /// `max_model_len` is the model's `max_position_embeddings`, lower
    /// than the configured limit.
    pub limit_is_model: bool,
    /// Positions the KV pool holds; one sequence can never exceed it.
    pub capacity_tokens: usize,
    /// Sequences that run at once: `max_num_seqs`, or fewer when the cache
    /// memory holds fewer state slots (see `kv_cache::fit_slots`).
    pub max_num_seqs: usize,
    /// Prefix-cache state snapshots kept, fitted the same way.
    pub prefix_snapshots: usize,
    /// The engine has the model's tokenizer, so it can guide a request's
    /// text ([`SamplingParams::prefix_choices`]).
    pub guides_text: bool,
}

impl EngineInfo {
    /// The most tokens one sequence (prompt and completion) may hold, and
    /// what sets that bound when it is not the configured limit: the cache
    /// or the model's trained positions.
    pub fn context_limit(&self) -> (usize, Option<&'static str>) {
        if self.capacity_tokens < self.max_model_len {
            (
                self.capacity_tokens,
                Some("all the engine's cache holds: a larger cache memory raises it"),
            )
        } else if self.limit_is_model {
            (
                self.max_model_len,
                Some("the model's max_position_embeddings"),
            )
        } else {
            (self.max_model_len, None)
        }
    }
}

enum Command {
    Generate {
        id: u64,
        request: Request,
        load: u64,
        reply: UnboundedSender<Event>,
        /// Hold each choice's token events until it finishes.
        collected: bool,
    },
    Score(ScoreJob),
    Abort(u64),
    Pause(mpsc::SyncSender<()>),
    Resume,
    Shutdown,
}

/// A prompt to score, waiting for the engine thread to be between steps.
struct ScoreJob {
    tokens: Vec<u32>,
    top: usize,
    load: u64,
    reply: tokio::sync::oneshot::Sender<Result<PromptScores>>,
}

/// Shared between the handle clones and the engine thread.
#[derive(Debug)]
struct Shared {
    metrics: EngineMetrics,
    info: EngineInfo,
    next_id: AtomicU64,
    stopped: AtomicBool,
}

/// A cheap, cloneable handle to a running engine.
#[derive(Clone)]
pub struct EngineHandle {
    tx: mpsc::Sender<Command>,
    shared: Arc<Shared>,
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("info", &self.shared.info)
            .finish()
    }
}

/// A submitted request: its id (for [`EngineHandle::abort`]) and events.
#[derive(Debug)]
pub struct Submitted {
    pub id: u64,
    pub events: UnboundedReceiver<Event>,
}

impl EngineHandle {
    pub fn info(&self) -> &EngineInfo {
        &self.shared.info
    }

    pub fn metrics(&self) -> &EngineMetrics {
        &self.shared.metrics
    }

    /// Outstanding work (see [`EngineMetrics::load`]).
    pub fn load(&self) -> u64 {
        self.shared.metrics.load.load(Ordering::Relaxed)
    }

    /// The load `request` adds while it is outstanding.
    pub fn request_load(request: &Request) -> u64 {
        // Saturating: a max_tokens near usize::MAX is refused by
        // `validate`, but the load is counted before or without it.
        (request.params.n as u64).saturating_mul(
            (request.prompt.len() as u64).saturating_add(request.params.max_tokens as u64),
        )
    }

    /// Check a request against this engine's limits; the message is for
    /// the client.
    pub fn validate(&self, request: &Request) -> Result<()> {
        request.params.validate()?;
        let vocab = self.shared.info.vocab_size;
        if let Some(&bad) = request
            .params
            .stop_token_ids
            .iter()
            .find(|&&t| t as usize >= vocab)
        {
            return Err(Error::Input(format!(
                "stop token id {bad} is not below the vocabulary size {vocab}, so it could never stop"
            )));
        }
        if !request.params.prefix_choices.is_empty() && !self.shared.info.guides_text {
            return Err(Error::Input(
                "prefix choices need the model's tokenizer, and this engine has none".into(),
            ));
        }
        self.check_prompt(&request.prompt, request.params.max_tokens)
    }

    /// A prompt that is not empty, holds only ids of the vocabulary and
    /// leaves room for `max_tokens` more in the context.
    pub fn check_prompt(&self, prompt: &[u32], max_tokens: usize) -> Result<()> {
        let info = &self.shared.info;
        if prompt.is_empty() {
            return Err(Error::Input("the prompt is empty".into()));
        }
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= info.vocab_size) {
            return Err(Error::Input(format!(
                "token id {bad} is not below the vocabulary size {}",
                info.vocab_size
            )));
        }
        // Saturating: max_tokens comes from the client, up to usize::MAX.
        let total = prompt.len().saturating_add(max_tokens);
        let (limit, bound) = info.context_limit();
        if total > limit {
            // OpenAI's wording (clients look for it), and where the limit
            // comes from when it is not the configured one.
            let from = bound.map(|b| format!(" ({b})")).unwrap_or_default();
            return Err(Error::ContextLength(format!(
                "this model's maximum context length is {limit} tokens{from}; the prompt \
                 has {} and max_tokens is {max_tokens} ({total} in all)",
                prompt.len(),
            )));
        }
        Ok(())
    }

    /// Score a prompt: each token after the first with its log-prob under
    /// the model and the `top` most likely tokens at its place (see
    /// [`PromptScores`]). The engine runs it between two steps, after any
    /// weight update in progress.
    pub async fn score_prompt(&self, tokens: Vec<u32>, top: usize) -> Result<PromptScores> {
        Self::scored(self.submit_score(tokens, top)?).await
    }

    /// Queue a prompt to score ([`score_prompt`](Self::score_prompt)); the
    /// answer comes on the receiver, to be awaited with
    /// [`scored`](Self::scored).
    pub fn submit_score(&self, tokens: Vec<u32>, top: usize) -> Result<ScoreReceiver> {
        if top > MAX_TOP_LOGPROBS {
            return Err(Error::Input(format!(
                "logprobs must be at most {MAX_TOP_LOGPROBS}, got {top}"
            )));
        }
        self.check_prompt(&tokens, 0)?;
        let load = tokens.len() as u64;
        let (reply, answer) = tokio::sync::oneshot::channel();
        self.shared.metrics.load.fetch_add(load, Ordering::Relaxed);
        let job = ScoreJob {
            tokens,
            top,
            load,
            reply,
        };
        if self.tx.send(Command::Score(job)).is_err() {
            self.shared.metrics.load.fetch_sub(load, Ordering::Relaxed);
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        Ok(answer)
    }

    /// [`score_prompt`](Self::score_prompt), blocking (not for async code).
    pub fn score_prompt_blocking(&self, tokens: Vec<u32>, top: usize) -> Result<PromptScores> {
        self.submit_score(tokens, top)?
            .blocking_recv()
            .map_err(|_| Error::Unavailable("the engine stopped".into()))?
    }

    /// The answer to a [`submit_score`](Self::submit_score).
    pub async fn scored(answer: ScoreReceiver) -> Result<PromptScores> {
        answer
            .await
            .map_err(|_| Error::Unavailable("the engine stopped".into()))?
    }

    /// Queue a request; events arrive on the returned receiver.
    pub fn submit(&self, request: Request) -> Result<Submitted> {
        self.submit_with(request, false)
    }

    /// [`submit`](Self::submit) for a caller that only wants the finished
    /// choices: each choice's token events come together when it finishes,
    /// just before its `Finished`. The engine then sends nothing (and wakes
    /// no task) per token; a receiver dropped meanwhile still frees the
    /// request at the next step.
    pub fn submit_collected(&self, request: Request) -> Result<Submitted> {
        self.submit_with(request, true)
    }

    fn submit_with(&self, request: Request, collected: bool) -> Result<Submitted> {
        self.validate(&request)?;
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        let (reply, events) = unbounded_channel();
        let load = Self::request_load(&request);
        self.shared.metrics.load.fetch_add(load, Ordering::Relaxed);
        let cmd = Command::Generate {
            id,
            request,
            load,
            reply,
            collected,
        };
        if self.tx.send(cmd).is_err() {
            self.shared.metrics.load.fetch_sub(load, Ordering::Relaxed);
            return Err(Error::Unavailable("the engine has stopped".into()));
        }
        Ok(Submitted { id, events })
    }

    /// Cancel a request; its sequences are freed before the next step.
    pub fn abort(&self, id: u64) {
        let _ = self.tx.send(Command::Abort(id));
    }

    /// Generate and wait for every choice (blocking; not for async code).
    pub fn generate_blocking(&self, request: Request) -> Result<Vec<Choice>> {
        let n = request.params.n;
        collect_blocking(self.submit_collected(request)?, n)
    }

    /// Async form of [`generate_blocking`](Self::generate_blocking).
    pub async fn generate(&self, request: Request) -> Result<Vec<Choice>> {
        let n = request.params.n;
        let mut sub = self.submit_collected(request)?;
        let mut choices = vec![Choice::default(); n];
        let mut done = 0;
        while done < n {
            match sub.events.recv().await {
                Some(ev) => done += apply_event(&mut choices, ev)?,
                None => return Err(Error::Unavailable("the engine stopped".into())),
            }
        }
        Ok(choices)
    }

    /// Return once the engine is between two steps, holding no read guard
    /// on the parameter store; it takes no further step until
    /// [`resume`](Self::resume). Blocking.
    pub fn pause(&self) -> Result<()> {
        let (ack, wait) = mpsc::sync_channel(1);
        self.tx
            .send(Command::Pause(ack))
            .map_err(|_| Error::Unavailable("the engine has stopped".into()))?;
        wait.recv()
            .map_err(|_| Error::Unavailable("the engine stopped while pausing".into()))
    }

    /// Let a paused engine go on. If the store's version moved, in-flight
    /// caches are rebuilt under the new weights before the next token.
    pub fn resume(&self) {
        let _ = self.tx.send(Command::Resume);
    }

    /// Stop the engine: every unfinished choice gets `FinishReason::Abort`.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Whether the engine thread has exited.
    pub fn is_stopped(&self) -> bool {
        self.shared.stopped.load(Ordering::Acquire)
    }
}

/// Waits for the `n` choices of a submitted request (blocking the thread).
pub fn collect_blocking(mut sub: Submitted, n: usize) -> Result<Vec<Choice>> {
    let mut choices = vec![Choice::default(); n];
    let mut done = 0;
    while done < n {
        match sub.events.blocking_recv() {
            Some(ev) => done += apply_event(&mut choices, ev)?,
            None => return Err(Error::Unavailable("the engine stopped".into())),
        }
    }
    Ok(choices)
}

/// Fold one event into `choices`; returns 1 when a choice finished.
pub fn apply_event(choices: &mut [Choice], ev: Event) -> Result<usize> {
    match ev {
        Event::Token(t) => {
            let c = choices
                .get_mut(t.index)
                .ok_or_else(|| Error::Input(format!("event for unknown choice {}", t.index)))?;
            c.tokens.push(t.token);
            c.logprobs.push(t.logprob);
            c.top_logprobs.push(t.top_logprobs);
            c.weight_versions.push(t.weight_version);
            Ok(0)
        }
        Event::Finished { index, reason } => {
            if let Some(c) = choices.get_mut(index) {
                c.finish_reason = Some(reason);
            }
            Ok(1)
        }
        Event::Error(e) => Err(Error::Internal(e)),
    }
}

/// Per request: where replies go and how many choices are unfinished.
struct Pending {
    reply: UnboundedSender<Event>,
    open: usize,
    load: u64,
    /// For a collected request: each choice's token events so far.
    held: Option<Vec<Vec<TokenEvent>>>,
}

impl Pending {
    /// Sends (or, collected, holds) a token event; false when the receiver
    /// is gone.
    fn deliver(&mut self, ev: TokenEvent) -> bool {
        match &mut self.held {
            Some(held) => match held.get_mut(ev.index) {
                Some(h) if !self.reply.is_closed() => {
                    h.push(ev);
                    true
                }
                _ => false,
            },
            None => self.reply.send(Event::Token(ev)).is_ok(),
        }
    }

    /// Ends choice `index`: its held token events, then `Finished`.
    fn finish(&mut self, index: usize, reason: FinishReason) {
        if let Some(held) = self.held.as_mut().and_then(|h| h.get_mut(index)) {
            for ev in std::mem::take(held) {
                let _ = self.reply.send(Event::Token(ev));
            }
        }
        let _ = self.reply.send(Event::Finished { index, reason });
    }
}

/// Start an engine thread over `store`. `tokenizer` is needed for stop
/// strings and supplies the end-of-sequence ids (with the model config's).
pub fn start(
    store: Arc<ParamStore>,
    tokenizer: Option<Arc<Tokenizer>>,
    config: EngineConfig,
) -> Result<EngineHandle> {
    config.validate()?;
    let placement = match config.device {
        Device::Cpu => Placement::Host,
        #[cfg(feature = "cuda")]
        Device::Cuda(i) => {
            let dev = arcticd_kernels::cuda::device::CudaDevice::new(i)?;
            dev.set_batch_invariant(config.batch_invariant);
            Placement::Device(Arc::new(dev))
        }
        #[cfg(not(feature = "cuda"))]
        Device::Cuda(_) => {
            config.device.check_available()?;
            Placement::Host
        }
    };
    let (cache, fit, vocab_size, mut eos, gpu, max_model_len) = {
        let model = store.read();
        // No sequence runs past the positions the model was trained for.
        let max_model_len = model
            .config
            .max_positions
            .map_or(config.max_model_len, |p| config.max_model_len.min(p));
        // On a GPU the weights go first, so the cache is checked against
        // the memory they leave.
        #[cfg(feature = "cuda")]
        let gpu = match &placement {
            Placement::Device(dev) => Some(GpuReplica::new(
                (&store, &model),
                dev.clone(),
                config.weights,
                store.weight_version(),
                (
                    config.cache_memory,
                    config.step_scratch_bytes(&model.config),
                ),
            )?),
            Placement::Host => None,
        };
        #[cfg(not(feature = "cuda"))]
        let gpu: Option<GpuReplica> = None;
        let unit_blocks = config.prefix_unit / config.block_size;
        let fit = fit_slots(
            &CacheLayout::new(&model.config),
            config.block_size,
            config.cache_memory,
            config.max_num_seqs,
            config.prefix_snapshots,
            unit_blocks.max(1),
        )?;
        let max_blocks =
            fit.running * max_model_len.div_ceil(config.block_size) + fit.snapshots * unit_blocks;
        let cache = PagedKvCache::with_budget(
            &model.config,
            config.block_size,
            config.cache_memory,
            (fit.running + fit.snapshots, unit_blocks.max(1), max_blocks),
            placement,
        )?;
        (
            cache,
            fit,
            model.config.vocab_size,
            model.config.eos_token_ids.clone(),
            gpu,
            max_model_len,
        )
    };
    if fit.reduced {
        tracing::warn!(
            "cache memory {} MiB holds the state of {} running sequences (of max_num_seqs {}) \
             and {} prefix snapshots (of {})",
            config.cache_memory >> 20,
            fit.running,
            config.max_num_seqs,
            fit.snapshots,
            config.prefix_snapshots
        );
    }
    if let Some(t) = &tokenizer {
        for id in t.eos_token_ids() {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let shared = Arc::new(Shared {
        metrics: EngineMetrics::default(),
        info: EngineInfo {
            vocab_size,
            max_model_len,
            limit_is_model: max_model_len < config.max_model_len,
            capacity_tokens: cache.capacity_tokens(),
            max_num_seqs: fit.running,
            prefix_snapshots: fit.snapshots,
            guides_text: tokenizer.is_some(),
        },
        next_id: AtomicU64::new(0),
        stopped: AtomicBool::new(false),
    });
    shared
        .metrics
        .blocks_total
        .store(cache.pool().num_blocks() as u64, Ordering::Relaxed);
    let limits = Limits {
        max_num_seqs: fit.running,
        max_batched_tokens: config.max_batched_tokens,
        unit: config.prefix_unit,
    };
    let scheduler = Scheduler::new(cache, limits, config.enable_prefix_cache);
    let (tx, rx) = mpsc::channel();
    let version = store.weight_version();
    let mut engine = EngineLoop {
        store,
        tokenizer,
        eos,
        scheduler,
        pending: HashMap::new(),
        scratch: Vec::new(),
        shared: shared.clone(),
        version,
        max_model_len,
        state_dtype: config.state_dtype,
        prefill: config.prefill,
        rebuild_caches: config.rebuild_caches,
        gpu,
        scores: Vec::new(),
    };
    std::thread::Builder::new()
        .name("arcticd-engine".into())
        .spawn(move || engine.run(rx))
        .map_err(|e| Error::Input(format!("cannot start the engine thread: {e}")))?;
    Ok(EngineHandle { tx, shared })
}

struct EngineLoop {
    store: Arc<ParamStore>,
    tokenizer: Option<Arc<Tokenizer>>,
    eos: Vec<u32>,
    scheduler: Scheduler,
    pending: HashMap<u64, Pending>,
    /// Contiguous per-sequence caches the forward works on, reused.
    scratch: Vec<SeqCache>,
    shared: Arc<Shared>,
    /// Weight version the cached states were computed with.
    version: u64,
    max_model_len: usize,
    state_dtype: StateDtype,
    prefill: PrefillForm,
    rebuild_caches: bool,
    /// The model on a GPU, when the engine runs there.
    gpu: Option<GpuReplica>,
    /// Prompts to score before the next step (held while paused).
    scores: Vec<ScoreJob>,
}

/// One run's rows of logits (in plan order) and the greedy picks made
/// beside them.
type RunOut = (Vec<f32>, Vec<Option<(usize, f32)>>);

/// What a step's forward hands the samplers, per sampled row in plan
/// order: the pick when the forward made it with the row's own sampler (a
/// greedy pick for a cheap sampler, or a draw on the device), and the
/// row's logits unless that pick is all there is.
struct StepOut {
    logits: Vec<f32>,
    /// Where each row's logits are in `logits`, in rows.
    at: Vec<Option<usize>>,
    picks: Vec<Option<(usize, f32)>>,
}

impl StepOut {
    /// Every row's logits, in order, beside the picks made.
    fn dense((logits, picks): RunOut, rows: usize) -> Self {
        StepOut {
            logits,
            at: (0..rows).map(Some).collect(),
            picks,
        }
    }
}

impl EngineLoop {
    fn run(&mut self, rx: mpsc::Receiver<Command>) {
        let mut paused = false;
        'outer: loop {
            // Block for a command when there is nothing else to do.
            if paused || self.scheduler.is_idle() {
                match rx.recv() {
                    Ok(cmd) => {
                        if !self.command(cmd, &mut paused) {
                            break 'outer;
                        }
                    }
                    Err(_) => break 'outer,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(cmd) => {
                        if !self.command(cmd, &mut paused) {
                            break 'outer;
                        }
                    }
                    Err(mpsc::TryRecvError::Empty) => break,
                    Err(mpsc::TryRecvError::Disconnected) => break 'outer,
                }
            }
            if !paused {
                self.run_scores();
            }
            if !paused && !self.scheduler.is_idle() {
                self.step();
            }
            self.publish();
        }
        self.abort_all();
        self.publish();
        self.shared.stopped.store(true, Ordering::Release);
    }

    /// Handle one command; false means stop.
    fn command(&mut self, cmd: Command, paused: &mut bool) -> bool {
        match cmd {
            Command::Generate {
                id,
                request,
                load,
                reply,
                collected,
            } => {
                let n = request.params.n;
                // One sequence prefills the prompt; the other choices fork
                // from it when it samples its first token.
                let mut first =
                    Sequence::new(id, 0, request.prompt, Sampler::new(&request.params, 0));
                first.forks = (1..n)
                    .map(|i| (i, Sampler::new(&request.params, i)))
                    .collect();
                self.scheduler.add(first);
                self.pending.insert(
                    id,
                    Pending {
                        reply,
                        open: n,
                        load,
                        held: collected.then(|| vec![Vec::new(); n]),
                    },
                );
            }
            Command::Score(job) => self.scores.push(job),
            Command::Abort(id) => self.drop_request(id),
            Command::Pause(ack) => {
                *paused = true;
                let _ = ack.send(());
            }
            Command::Resume => *paused = false,
            Command::Shutdown => return false,
        }
        true
    }

    fn drop_request(&mut self, id: u64) {
        self.scheduler.abort_request(id);
        if let Some(p) = self.pending.remove(&id) {
            self.shared
                .metrics
                .load
                .fetch_sub(p.load, Ordering::Relaxed);
        }
    }

    fn abort_all(&mut self) {
        let ids: Vec<u64> = self.pending.keys().copied().collect();
        for id in ids {
            let open: Vec<usize> = self
                .scheduler
                .running
                .iter()
                .chain(self.scheduler.waiting.iter())
                .filter(|s| s.request == id)
                .flat_map(|s| std::iter::once(s.index).chain(s.forks.iter().map(|f| f.0)))
                .collect();
            if let Some(p) = self.pending.get_mut(&id) {
                for index in open {
                    p.finish(index, FinishReason::Abort);
                }
            }
            self.drop_request(id);
        }
    }

    fn publish(&self) {
        let m = &self.shared.metrics;
        let s = &self.scheduler;
        m.running.store(s.running.len() as u64, Ordering::Relaxed);
        m.waiting.store(s.waiting.len() as u64, Ordering::Relaxed);
        m.blocks_used
            .store(s.cache.pool().num_used() as u64, Ordering::Relaxed);
        m.prompt_tokens.store(s.prompt_tokens, Ordering::Relaxed);
        m.recomputed_tokens
            .store(s.recomputed_tokens, Ordering::Relaxed);
        m.prefix_hit_tokens
            .store(s.prefix_hit_tokens, Ordering::Relaxed);
        m.preemptions.store(s.preemptions, Ordering::Relaxed);
    }

    /// Score the prompts waiting, each under the weights of now. A failure
    /// is the job's own (its reply carries it); the engine goes on.
    fn run_scores(&mut self) {
        for job in std::mem::take(&mut self.scores) {
            let store = self.store.clone();
            let model = store.read();
            let version = store.weight_version();
            let scored = if job.reply.is_closed() {
                None
            } else if let Some(gpu) = &mut self.gpu {
                Some(gpu.score_top((&store, &model), version, &job.tokens, job.top))
            } else {
                Some(store.check_host_current().and_then(|()| {
                    let packs = store.packs(&model, version);
                    model.score_top(&job.tokens, Some(packs.as_ref()), job.top)
                }))
            };
            self.shared
                .metrics
                .load
                .fetch_sub(job.load, Ordering::Relaxed);
            let Some(scored) = scored else {
                continue;
            };
            let answer = scored
                .map(|tokens| PromptScores {
                    tokens,
                    weight_version: version,
                })
                .map_err(|e| match e {
                    e @ (Error::Input(_) | Error::ContextLength(_)) => e,
                    e => {
                        tracing::error!("scoring a prompt failed: {e}");
                        Error::Internal(Failure::from(e))
                    }
                });
            let _ = job.reply.send(answer);
        }
    }

    /// One scheduler step: plan, forward, sample, reply.
    fn step(&mut self) {
        let store = self.store.clone();
        let model = store.read();
        // The version cannot move while the read guard is held.
        let version = store.weight_version();
        if version != self.version {
            if self.rebuild_caches {
                self.scheduler.reset_for_new_weights();
            } else {
                self.scheduler.drop_prefix_cache();
            }
            self.version = version;
        }
        let plan = self.scheduler.schedule();
        if plan.is_empty() {
            return;
        }
        let result = self.forward(&store, &model, version, &plan);
        let sched = &mut self.scheduler;
        let StepOut { logits, at, picks } = match result {
            Ok(out) => out,
            Err(e) => {
                tracing::error!("engine forward failed: {e}");
                self.fail_plan(&plan, Failure::from(e));
                return;
            }
        };
        sched.after_step(&plan);

        // Sequences with every token in the cache, whose logits the runs
        // made (in plan order): sample there.
        let which: Vec<usize> = plan
            .iter()
            .filter(|item| {
                let seq = &sched.running[item.seq];
                seq.computed == seq.tokens.len()
            })
            .map(|item| item.seq)
            .collect();
        let vocab_size = model.config.vocab_size;
        drop(model);
        let with_logits = at.iter().flatten().count();
        if at.len() != which.len()
            || picks.len() > which.len()
            || logits.len() != with_logits * vocab_size
            || at.iter().flatten().any(|&j| j >= with_logits)
        {
            let msg = format!(
                "{} logits for {} of {} sampled rows of {vocab_size}",
                logits.len(),
                with_logits,
                which.len()
            );
            self.fail_plan(&plan, Failure::msg(msg));
            return;
        }
        let vocab = vocab_size;
        let mut finished: Vec<(usize, FinishReason)> = Vec::new();
        let mut hung_up: Vec<u64> = Vec::new();
        // Pending choices fork now and sample from their parent's row.
        let mut targets: Vec<(usize, usize)> = Vec::with_capacity(which.len());
        for (r, &i) in which.iter().enumerate() {
            targets.push((r, i));
            if !self.scheduler.running[i].forks.is_empty() {
                for c in self.scheduler.fork(i) {
                    targets.push((r, c));
                }
            }
        }
        let guided = targets
            .iter()
            .any(|&(_, i)| self.scheduler.running[i].sampler.is_guided());
        let table = match &self.tokenizer {
            Some(t) if guided => Some(t.token_table()),
            _ => None,
        };
        let table = table.as_deref();
        // Each target is a different sequence with its own sampler, so the
        // rows may be sampled in parallel; what each draws does not depend
        // on the others.
        let samples: Vec<Result<Sampled>> = {
            let mut samplers: Vec<Option<&mut Sampler>> = self
                .scheduler
                .running
                .iter_mut()
                .map(|s| Some(&mut s.sampler))
                .collect();
            let jobs: Vec<(usize, Option<&mut Sampler>)> = targets
                .iter()
                .map(|&(r, i)| (r, samplers[i].take()))
                .collect();
            let logits = &logits;
            let (picks, at) = (&picks, &at);
            let one = |(r, s): (usize, Option<&mut Sampler>)| {
                match (s, picks.get(r).copied().flatten()) {
                    (Some(s), pick) => {
                        let on_device = s.take_device_draw();
                        match (pick, at[r]) {
                            // The forward made this row's pick already: a
                            // greedy one, or with the sampler's own draw on
                            // the device.
                            (Some((token, logprob)), _) if on_device || s.is_cheap() => {
                                Ok(Sampled {
                                    token: token as u32,
                                    logprob,
                                    top: Vec::new(),
                                })
                            }
                            (_, Some(j)) if !on_device => {
                                s.sample_with(&logits[j * vocab..(j + 1) * vocab], table)
                            }
                            _ => Err(Error::Invariant(format!(
                                "sampled row {r}: no pick for its draw, or no logits"
                            ))),
                        }
                    }
                    (None, _) => Err(Error::Input(
                        "a sequence was sampled twice in one step".into(),
                    )),
                }
            };
            // Picks the runs made are lookups: handing them to the pool
            // costs more than doing them here.
            let cheap = jobs
                .iter()
                .all(|(_, s)| s.as_ref().is_none_or(|s| s.is_cheap()));
            if cheap {
                jobs.into_iter().map(one).collect()
            } else {
                rayon::scope(|_| jobs.into_par_iter().map(one).collect())
            }
        };
        for ((_, i), sampled) in targets.into_iter().zip(samples) {
            let seq = &mut self.scheduler.running[i];
            let sampled = match sampled {
                Ok(s) => s,
                Err(e) => {
                    hung_up.push(seq.request);
                    if let Some(p) = self.pending.get(&seq.request) {
                        let _ = p.reply.send(Event::Error(Failure::from(e)));
                    }
                    continue;
                }
            };
            seq.tokens.push(sampled.token);
            seq.generated += 1;
            self.shared
                .metrics
                .generated_tokens
                .fetch_add(1, Ordering::Relaxed);
            let ev = TokenEvent {
                index: seq.index,
                token: sampled.token,
                logprob: sampled.logprob,
                top_logprobs: sampled.top,
                weight_version: self.version,
            };
            let delivered = self
                .pending
                .get_mut(&seq.request)
                .is_some_and(|p| p.deliver(ev));
            if !delivered {
                hung_up.push(seq.request);
                continue;
            }
            if let Some(reason) = self.finish_reason(i) {
                finished.push((i, reason));
            }
        }
        // Remove from the back so earlier indices stay valid.
        finished.sort_by_key(|(i, _)| std::cmp::Reverse(*i));
        for (i, reason) in finished {
            let seq = self.scheduler.finish(i);
            if let Some(p) = self.pending.get_mut(&seq.request) {
                p.finish(seq.index, reason);
                p.open -= 1;
                if p.open == 0 {
                    self.drop_request(seq.request);
                }
            }
        }
        hung_up.sort_unstable();
        hung_up.dedup();
        for id in hung_up {
            self.drop_request(id);
        }
        self.shared.metrics.steps.fetch_add(1, Ordering::Relaxed);
    }

    /// One step's forward on the engine's device: logits of the rows to
    /// sample (one per sequence whose tokens are then all in the cache, in
    /// plan order) and any greedy picks made beside them.
    fn forward(
        &mut self,
        store: &ParamStore,
        model: &Qwen3_5,
        version: u64,
        plan: &[Scheduled],
    ) -> Result<StepOut> {
        if let Some(gpu) = &mut self.gpu {
            return gpu.forward(
                (store, model),
                version,
                &mut self.scheduler,
                plan,
                self.prefill,
            );
        }
        store.check_host_current()?;
        cpu_forward(
            model,
            store,
            version,
            &mut self.scheduler,
            &mut self.scratch,
            plan,
            (self.state_dtype, self.prefill),
        )
    }

    /// Whether `running[i]`, which just sampled, is done.
    fn finish_reason(&self, i: usize) -> Option<FinishReason> {
        let seq = &self.scheduler.running[i];
        let params = seq.sampler.params();
        let last = *seq.tokens.last()?;
        if params.stop_token_ids.contains(&last)
            || (!params.ignore_eos && self.eos.contains(&last))
            || seq.sampler.choice_written()
        {
            return Some(FinishReason::Stop { stop_string: None });
        }
        if !params.stop.is_empty() {
            if let Some(tok) = &self.tokenizer {
                let longest = params.stop.iter().map(|s| s.len()).max().unwrap_or(0);
                let from = seq.tokens.len() - seq.generated;
                let tail_start = seq.tokens.len().saturating_sub(longest + 2).max(from);
                if let Ok(text) = tok.decode(&seq.tokens[tail_start..], false) {
                    if let Some(s) = params.stop.iter().find(|s| text.contains(s.as_str())) {
                        return Some(FinishReason::Stop {
                            stop_string: Some(s.clone()),
                        });
                    }
                }
            }
        }
        if seq.generated >= params.max_tokens || seq.tokens.len() >= self.max_model_len {
            return Some(FinishReason::Length);
        }
        None
    }

    /// Fail every request with a sequence in `plan`.
    fn fail_plan(&mut self, plan: &[Scheduled], failure: Failure) {
        let mut ids: Vec<u64> = plan
            .iter()
            .map(|p| self.scheduler.running[p.seq].request)
            .collect();
        ids.sort_unstable();
        ids.dedup();
        for id in ids {
            if let Some(p) = self.pending.get(&id) {
                let _ = p.reply.send(Event::Error(failure.clone()));
            }
            self.drop_request(id);
        }
    }
}

/// One step's forward on the CPU: each planned sequence's state moved from
/// its slot into a scratch cache, one run of sequences per pool thread
/// (each also making its sampled rows' logits and greedy picks), the new
/// positions and states stored back.
fn cpu_forward(
    model: &Qwen3_5,
    store: &ParamStore,
    version: u64,
    sched: &mut Scheduler,
    scratch: &mut Vec<SeqCache>,
    plan: &[Scheduled],
    (state_dtype, prefill): (StateDtype, PrefillForm),
) -> Result<StepOut> {
    // Weights packed once per version for every replica (see
    // `LinearPacks`); without them the products are the same, only
    // slower.
    let packs = store.packs(model, version);
    while scratch.len() < plan.len() {
        scratch.push(model.new_cache());
    }
    for (j, item) in plan.iter().enumerate() {
        let seq = &sched.running[item.seq];
        let Some(slot) = seq.slot else {
            continue;
        };
        // Past K/V stay in their blocks: the forward reads them there.
        sched
            .cache
            .load_states(&mut scratch[j], seq.computed, slot)?;
    }
    let result = {
        let mut batch: Vec<SeqInput<'_>> = plan
            .iter()
            .zip(scratch.iter_mut())
            .map(|(item, cache)| {
                let seq = &sched.running[item.seq];
                SeqInput {
                    tokens: &seq.tokens[seq.computed..seq.computed + item.n],
                    cache,
                }
            })
            .collect();
        // The batch is cut into one run of sequences per pool thread,
        // about equal in tokens, and each thread runs the whole model on
        // its run, then makes the logits of its rows that are sampled: a
        // decode step synchronises once instead of in every kernel, and
        // the kernels' parallel loops start from inside the pool. Their
        // loops still share out work a busy thread has not started. A
        // row's arithmetic does not depend on the rows beside it (every
        // kernel is batch-invariant), so the bits are those of one call
        // over the whole batch.
        let (m, packs): (&Qwen3_5, &LinearPacks) = (model, &packs);
        let pools = sched.cache.pages()?;
        let block_size = sched.cache.block_size();
        let pasts: Vec<Option<PagedPast<'_>>> = plan
            .iter()
            .map(|item| {
                let seq = &sched.running[item.seq];
                seq.slot.map(|_| PagedPast {
                    blocks: &seq.block_table,
                    block_size,
                    pools: &pools,
                })
            })
            .collect();
        // Sequences with every token in the cache after this step are
        // sampled: their last row's logits are made by the run's own
        // thread (a row's logits do not depend on the rows beside it),
        // and a greedy pick too (`Some(true)`), while the row is in its
        // cache.
        let wants: Vec<Option<bool>> = plan
            .iter()
            .map(|item| {
                let seq = &sched.running[item.seq];
                (seq.computed + item.n == seq.tokens.len()).then(|| seq.sampler.is_cheap())
            })
            .collect();
        let runs = split_by_tokens(&mut batch, rayon::current_num_threads());
        let (mut rest, mut rest_wants): (&[Option<PagedPast<'_>>], &[Option<bool>]) =
            (&pasts, &wants);
        let runs: Vec<_> = runs
            .into_iter()
            .map(|run| {
                let (mine, tail) = rest.split_at(run.len());
                let (my_wants, wants_tail) = rest_wants.split_at(run.len());
                (rest, rest_wants) = (tail, wants_tail);
                (run, mine, my_wants)
            })
            .collect();
        // Every pool thread is handed its run by name (a broadcast):
        // left to work stealing, a thread that was asleep sometimes did
        // not wake before the other had finished its own run and taken
        // the second too, and the step took twice as long.
        let runs: Vec<Mutex<Option<_>>> =
            runs.into_iter().map(|run| Mutex::new(Some(run))).collect();
        let h = model.config.hidden_size;
        let vocab = model.config.vocab_size;
        let outs: Vec<Option<Result<RunOut>>> = rayon::broadcast(|ctx| {
            let run = runs
                .get(ctx.index())?
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .take();
            let (run, pasts, wants) = run?;
            let lens: Vec<usize> = run.iter().map(|seq| seq.tokens.len()).collect();
            let out = m
                .forward_paged(run, Some(pasts), Some(packs), prefill)
                .and_then(|hidden| {
                    let mut rows = Vec::new();
                    let mut end = 0;
                    for (n, want) in lens.iter().zip(wants) {
                        end += n;
                        if want.is_some() {
                            rows.extend_from_slice(&hidden[(end - 1) * h..end * h]);
                        }
                    }
                    if rows.is_empty() {
                        return Ok((Vec::new(), Vec::new()));
                    }
                    let logits = m.logits_with(&rows, Some(packs))?;
                    let picks = wants
                        .iter()
                        .flatten()
                        .zip(logits.chunks_exact(vocab))
                        .map(|(&pick, row)| {
                            pick.then(|| greedy_pick(row))
                                .transpose()
                                .map_err(Error::from)
                        })
                        .collect::<Result<Vec<_>>>()?;
                    Ok((logits, picks))
                });
            Some(out)
        });
        outs.into_iter().flatten().try_fold(
            (Vec::new(), Vec::new()),
            |(mut logits, mut picks), out| -> Result<RunOut> {
                let (l, p) = out?;
                logits.extend_from_slice(&l);
                picks.extend(p);
                Ok((logits, picks))
            },
        )
    };
    // The states go back to their slots whether or not the step
    // failed (a failed step fails its sequences after).
    for (j, item) in plan.iter().enumerate() {
        let seq = &sched.running[item.seq];
        if let Some(slot) = seq.slot {
            if state_dtype == StateDtype::Bf16 {
                round_states_to_bf16(&mut scratch[j]);
            }
            sched.cache.store(
                &mut scratch[j],
                &seq.block_table,
                seq.computed,
                item.n,
                slot,
            )?;
        }
    }
    let rows = plan
        .iter()
        .filter(|item| {
            let seq = &sched.running[item.seq];
            seq.computed + item.n == seq.tokens.len()
        })
        .count();
    result.map(|out| StepOut::dense(out, rows))
}

/// The engine's model on a GPU, run over the scheduler's cache on the
/// device: after an update, the copy a trainer on the same GPU wrote in
/// place for this version when the store has one (`DeviceCopy`), else the
/// store's weights uploaded again, before any token of the new version.
#[cfg(feature = "cuda")]
struct GpuReplica {
    /// None only while the weights of a new version are being loaded.
    model: Option<ReplicaWeights>,
    dev: Arc<arcticd_kernels::cuda::device::CudaDevice>,
    weights: WeightDType,
    version: u64,
}

/// A GPU replica's weights: its own upload, or the trainer's copy on the
/// same GPU, read under its lock and through the replica's own device
/// handle.
#[cfg(feature = "cuda")]
enum ReplicaWeights {
    Own(Box<crate::model::cuda::CudaModel>),
    Shared(Arc<std::sync::RwLock<crate::model::cuda::CudaModel>>),
}

#[cfg(feature = "cuda")]
impl ReplicaWeights {
    /// The weights at `version`: the trainer's copy on `dev` when it is at
    /// that version and the replica reads bf16 (as the copy is), else an
    /// upload of the host's, which must then be current.
    fn at(
        store: &ParamStore,
        host: &Qwen3_5,
        dev: &Arc<arcticd_kernels::cuda::device::CudaDevice>,
        weights: WeightDType,
        version: u64,
    ) -> Result<Self> {
        match store.device_copy(dev.ordinal()) {
            Some(c) if c.version == version && weights == WeightDType::Bf16 => {
                dev.wait_event(&c.written)?;
                Ok(ReplicaWeights::Shared(c.model))
            }
            _ => {
                store.check_host_current()?;
                Ok(ReplicaWeights::Own(Box::new(
                    crate::model::cuda::CudaModel::upload(host, dev.clone(), weights)?,
                )))
            }
        }
    }

    fn param_bytes(&self) -> usize {
        match self {
            ReplicaWeights::Own(m) => m.param_bytes(),
            ReplicaWeights::Shared(s) => s.read().unwrap_or_else(|e| e.into_inner()).param_bytes(),
        }
    }
}

#[cfg(feature = "cuda")]
impl GpuReplica {
    /// Takes the weights at `version` ([`ReplicaWeights::at`]) and checks
    /// that `cache_memory` bytes and a step's `scratch` are free beside
    /// them.
    fn new(
        (store, model): (&ParamStore, &Qwen3_5),
        dev: Arc<arcticd_kernels::cuda::device::CudaDevice>,
        weights: WeightDType,
        version: u64,
        (cache_memory, scratch): (usize, usize),
    ) -> Result<Self> {
        let on_gpu = ReplicaWeights::at(store, model, &dev, weights, version)?;
        let (free, _) = dev.memory_info()?;
        if cache_memory.saturating_add(scratch) > free {
            return Err(Error::Config(format!(
                "cache memory {} MiB and a step's working memory (about {} MiB at \
                 max_batched_tokens) are more than the {} MiB free on {dev:?} after the \
                 weights ({} MiB): lower the cache memory",
                cache_memory >> 20,
                scratch.div_ceil(1 << 20),
                free >> 20,
                on_gpu.param_bytes() >> 20
            )));
        }
        Ok(GpuReplica {
            model: Some(on_gpu),
            dev,
            weights,
            version,
        })
    }

    /// Runs `f` on the replica's weights at `version` (loaded first when
    /// they moved) and its own device handle.
    fn with_model<R>(
        &mut self,
        (store, host): (&ParamStore, &Qwen3_5),
        version: u64,
        f: impl FnOnce(
            &crate::model::cuda::CudaModel,
            &Arc<arcticd_kernels::cuda::device::CudaDevice>,
        ) -> Result<R>,
    ) -> Result<R> {
        if version != self.version {
            // The old weights go first: the two never coexist.
            self.model = None;
            self.model = Some(ReplicaWeights::at(
                store,
                host,
                &self.dev,
                self.weights,
                version,
            )?);
            self.version = version;
        }
        match &self.model {
            Some(ReplicaWeights::Own(m)) => f(m, &self.dev),
            Some(ReplicaWeights::Shared(s)) => {
                f(&s.read().unwrap_or_else(|e| e.into_inner()), &self.dev)
            }
            None => Err(Error::Invariant(
                "the GPU replica lost its weights in a failed reload".into(),
            )),
        }
    }

    /// [`Qwen3_5::score_top`] on the replica's weights at `version`.
    fn score_top(
        &mut self,
        weights: (&ParamStore, &Qwen3_5),
        version: u64,
        tokens: &[u32],
        top: usize,
    ) -> Result<Vec<Sampled>> {
        self.with_model(weights, version, |model, dev| {
            model.score_top_on(dev, tokens, top)
        })
    }

    fn forward(
        &mut self,
        weights: (&ParamStore, &Qwen3_5),
        version: u64,
        sched: &mut Scheduler,
        plan: &[Scheduled],
        prefill: PrefillForm,
    ) -> Result<StepOut> {
        let vocab = weights.1.config.vocab_size;
        self.with_model(weights, version, |model, dev| {
            Self::forward_on(model, dev, vocab, sched, plan, prefill)
        })
    }

    /// One step's forward with `model` through `dev`.
    fn forward_on(
        model: &crate::model::cuda::CudaModel,
        dev: &arcticd_kernels::cuda::device::CudaDevice,
        vocab: usize,
        sched: &mut Scheduler,
        plan: &[Scheduled],
        prefill: PrefillForm,
    ) -> Result<StepOut> {
        use crate::model::paged_batch::PagedSeq;
        // Sampled rows whose sampler can draw where the logits are (no
        // truncation, no alternatives, no forks waiting to sample the same
        // row) are drawn on the device; only the others' logits travel.
        let mut draws = Vec::new();
        for item in plan {
            let seq = &mut sched.running[item.seq];
            if seq.computed + item.n == seq.tokens.len() {
                draws.push(if seq.forks.is_empty() {
                    seq.sampler.device_draw(vocab)
                } else {
                    None
                });
            }
        }
        let mut seqs = Vec::with_capacity(plan.len());
        let mut rows = Vec::new();
        let mut end = 0;
        for item in plan {
            let seq = &sched.running[item.seq];
            let slot = seq.slot.ok_or_else(|| {
                Error::Invariant("a scheduled sequence holds no state slot".into())
            })?;
            seqs.push(PagedSeq {
                tokens: &seq.tokens[seq.computed..seq.computed + item.n],
                past: seq.computed,
                slot,
                blocks: &seq.block_table,
            });
            end += item.n;
            if seq.computed + item.n == seq.tokens.len() {
                rows.push(end - 1);
            }
        }
        let cache = sched.cache.device_mut().ok_or_else(|| {
            Error::Invariant("the GPU model was given a cache in host memory".into())
        })?;
        let hidden = model.forward_batch_on(dev, cache, &seqs, prefill)?;
        let (logits, picks) = model.picks_or_logits(dev, &hidden, &rows, &draws)?;
        let mut next = 0;
        let at = picks
            .iter()
            .map(|p| {
                p.is_none().then(|| {
                    next += 1;
                    next - 1
                })
            })
            .collect();
        let picks = picks
            .into_iter()
            .map(|p| p.map(|(t, lp)| (t as usize, lp)))
            .collect();
        Ok(StepOut { logits, at, picks })
    }
}

/// Stands in for the GPU model in builds without CUDA (never made).
#[cfg(not(feature = "cuda"))]
enum GpuReplica {}

#[cfg(not(feature = "cuda"))]
impl GpuReplica {
    fn forward(
        &mut self,
        _: (&ParamStore, &Qwen3_5),
        _: u64,
        _: &mut Scheduler,
        _: &[Scheduled],
        _: PrefillForm,
    ) -> Result<StepOut> {
        match *self {}
    }

    fn score_top(
        &mut self,
        _: (&ParamStore, &Qwen3_5),
        _: u64,
        _: &[u32],
        _: usize,
    ) -> Result<Vec<Sampled>> {
        match *self {}
    }
}

/// `batch` cut into at most `parts` consecutive runs of sequences with about
/// the same number of tokens each (fewer runs when there are fewer
/// sequences; never an empty run).
fn split_by_tokens<'a, 'b>(
    batch: &'a mut [SeqInput<'b>],
    parts: usize,
) -> Vec<&'a mut [SeqInput<'b>]> {
    let total: usize = batch.iter().map(|s| s.tokens.len()).sum();
    let parts = parts.clamp(1, batch.len().max(1));
    let mut runs = Vec::with_capacity(parts);
    let mut rest = batch;
    let mut done = 0;
    for p in 1..parts {
        // End this run where the running total first reaches p/parts of
        // all tokens, leaving at least one sequence for each later run.
        let goal = total * p / parts;
        let mut acc = done;
        let mut cut = 0;
        while cut < rest.len() && (cut == 0 || acc < goal) {
            acc += rest[cut].tokens.len();
            cut += 1;
        }
        let cut = cut.min(rest.len() - (parts - p)).max(1);
        done += rest[..cut].iter().map(|s| s.tokens.len()).sum::<usize>();
        let (head, tail) = std::mem::take(&mut rest).split_at_mut(cut);
        runs.push(head);
        rest = tail;
    }
    if !rest.is_empty() {
        runs.push(rest);
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A step's working memory for the real Qwen3.5-0.8B shape at the
    /// defaults (1,024 tokens, 64 sequences): one layer's activations and
    /// 68 rows of 248,320 logits (the scoring chunk, more than 64 sampled
    /// rows); the layer part grows with the token budget.
    #[test]
    fn a_steps_working_memory_for_the_real_0_8b_shape() {
        let c = crate::init::preset_config(&crate::init::QWEN3_5_0_8B).unwrap();
        let at = |max_batched_tokens| {
            EngineConfig {
                max_batched_tokens,
                ..EngineConfig::default()
            }
            .step_scratch_bytes(&c)
        };
        let logits = 68 * 248_320 * 4;
        let (one, two) = (at(1024), at(2048));
        eprintln!("0.8B step working memory: {} MiB at 1024 tokens", one >> 20);
        assert!(one > logits && one < 512 << 20, "{one}");
        assert_eq!(two - logits, 2 * (one - logits), "{one} {two}");
    }

    fn empty_cache() -> SeqCache {
        SeqCache {
            conv_state: Vec::new(),
            recurrent_state: Vec::new(),
            k: Vec::new(),
            v: Vec::new(),
            len: 0,
        }
    }

    #[test]
    fn runs_cover_the_batch_in_order_with_balanced_tokens() {
        let cases: [(&[usize], usize); 6] = [
            (&[1; 32], 2),
            (&[1; 3], 8),
            (&[512, 1, 1, 1], 2),
            (&[1, 1, 1, 512], 2),
            (&[5, 9, 2, 7, 7, 1, 30], 3),
            (&[4], 1),
        ];
        for (lens, parts) in cases {
            let tokens: Vec<Vec<u32>> = lens.iter().map(|&n| vec![0; n]).collect();
            let mut caches: Vec<SeqCache> = lens.iter().map(|_| empty_cache()).collect();
            let mut batch: Vec<SeqInput<'_>> = tokens
                .iter()
                .zip(caches.iter_mut())
                .map(|(t, cache)| SeqInput { tokens: t, cache })
                .collect();
            let runs = split_by_tokens(&mut batch, parts);
            assert!(!runs.is_empty() && runs.len() <= parts, "{lens:?}");
            assert!(runs.iter().all(|r| !r.is_empty()), "{lens:?}");
            let seen: Vec<usize> = runs
                .iter()
                .flat_map(|r| r.iter().map(|s| s.tokens.len()))
                .collect();
            assert_eq!(seen, lens, "runs keep every sequence, in order");
            let total: usize = lens.iter().sum();
            let longest = *lens.iter().max().unwrap();
            for r in &runs {
                let n: usize = r.iter().map(|s| s.tokens.len()).sum();
                assert!(
                    n <= total.div_ceil(parts) + longest,
                    "{lens:?}: a run of {n}"
                );
            }
        }
        // Equal decode rows split evenly.
        let tokens = vec![vec![0u32]; 32];
        let mut caches: Vec<SeqCache> = (0..32).map(|_| empty_cache()).collect();
        let mut batch: Vec<SeqInput<'_>> = tokens
            .iter()
            .zip(caches.iter_mut())
            .map(|(t, cache)| SeqInput { tokens: t, cache })
            .collect();
        let sizes: Vec<usize> = split_by_tokens(&mut batch, 2)
            .iter()
            .map(|r| r.len())
            .collect();
        assert_eq!(sizes, [16, 16]);
    }
}
