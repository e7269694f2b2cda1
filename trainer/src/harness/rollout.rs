//! The agent loop with gated reward (docs/ARCHITECTURE.md, recipe steps 2 to 4).
//!
//! The prompt is rendered once from the system prompt, the tool schemas and
//! the issue through the model's chat template; from then on it only grows
//! by appending tokens: the model's turn exactly as sampled, then the
//! observation's tokens (the template's tool-response turn and its
//! generation prompt). History is never re-rendered, so the trajectory holds
//! exactly the tokens the model saw and produced.
//!
//! The rollout ends with reward 0 and a recorded reason at the first
//! malformed turn, the first exact repeat of a call, a budget running out
//! (turns, context tokens, wall time) or a turn cut at the token limit;
//! reward comes only from `submit`, graded in a fresh sandbox. Each gate and
//! budget can be switched off ([`RolloutConfig`]); a switched-off format
//! gate tells the model what was wrong and continues (the ablation that
//! recipe step 3 warns about). Not for: sampling, advantages, batching.

use super::format::{FormatCheck, ToolCall};
use super::policy::{FinishReason, GenerateRequest, Policy};
use super::tools::{self, ToolBox, ToolError, ToolOutcome};
use super::trajectory::{Termination, Trajectory, TurnRecord};
use crate::{Error, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_sandbox::grading::{self, GradeCache, GradeOutcome};
use arcticd_sandbox::tasks::validate::task_env;
use arcticd_sandbox::tasks::Task;
use arcticd_sandbox::{Backend, Policy as SandboxPolicy};
use serde_json::{json, Value};
use std::sync::Arc;
use std::time::Instant;

/// The default system prompt.
pub const DEFAULT_SYSTEM_PROMPT: &str =
    "You are a software engineer fixing an issue in a repository. \
The repository is checked out in the current working directory. Use the tools to explore it, \
reproduce the issue, edit the code and check your change. Every reply must be exactly one tool \
call and nothing after it. When the fix is complete, call submit; only submitted changes count.";

/// The default instruction after the issue.
pub const DEFAULT_INSTRUCTION: &str =
    "Fix the issue by editing the source code (not the tests), then call submit.";

/// Settings of a rollout. A budget of 0 is switched off.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RolloutConfig {
    /// Most assistant turns; 0 = no limit. Default 40.
    pub max_turns: usize,
    /// Most tokens in the context (prompt, turns, observations); 0 = no
    /// limit. Default 32768.
    pub max_context_tokens: usize,
    /// Wall-time budget of the rollout in seconds (grading excluded); 0 =
    /// no limit. Default 1800.
    pub max_wall_secs: f64,
    /// Most tokens generated per turn. Default 4096.
    pub max_new_tokens: usize,
    /// End at the first malformed turn. Default true.
    pub gate_format: bool,
    /// End at the first exact repeat of a call. Default true.
    pub gate_duplicate: bool,
    /// End when a turn stops at the token limit. Default true.
    pub gate_length: bool,
    /// How a turn is judged: "strict" (its raw text must be exactly one
    /// well-formed call) or "lenient" (its first call after a forgiving
    /// parse; an ablation). Default "strict".
    pub format_check: FormatCheck,
    /// Sampling temperature. Default 1.0.
    pub temperature: f32,
    /// Open a `<think>` block in each generation prompt. Default false.
    pub enable_thinking: bool,
    /// Longest observation in characters (head and tail kept). Default 10000.
    pub observation_max_chars: usize,
    /// Default bash timeout, seconds. Default 60.
    pub bash_timeout_secs: f64,
    /// Largest bash timeout the agent may ask for, seconds. Default 300.
    pub max_bash_timeout_secs: f64,
    /// Limit of the grading test run, seconds. Default 600.
    pub test_timeout_secs: f64,
    /// Image for tasks with a local `repo` and no `image`. Default the
    /// sandbox base image.
    pub image: String,
    /// System prompt. Default [`DEFAULT_SYSTEM_PROMPT`].
    pub system_prompt: String,
    /// What the user turn asks for after the issue and the repository's
    /// place (the audit's agents get their own). Default
    /// [`DEFAULT_INSTRUCTION`].
    pub instruction: String,
    /// Render the tool schemas, and with them the chat template's
    /// tool-calling instructions, into the system prompt. Off, the prompt
    /// holds only the system prompt and the issue (about 1,100 fewer tokens
    /// with the default tools), for a model that learned the tools and the
    /// call format in training (the warm-start demo); the format check and
    /// the tools are unchanged. Default true.
    pub prompt_tools: bool,
    /// Reuse the grade of a diff already graded on the same task (same
    /// image, snapshot and tests) instead of running the tests again
    /// ([`grading::GradeCache`]: only verdicts reached in time are kept).
    /// Off for tests that are not deterministic. Default true. It changes
    /// no result, so at its default it is left out of the serialized
    /// settings (caches keyed on them stay valid).
    #[serde(skip_serializing_if = "is_true")]
    pub grade_cache: bool,
}

fn is_true(b: &bool) -> bool {
    *b
}

impl Default for RolloutConfig {
    fn default() -> Self {
        RolloutConfig {
            max_turns: 40,
            max_context_tokens: 32768,
            max_wall_secs: 1800.0,
            max_new_tokens: 4096,
            gate_format: true,
            gate_duplicate: true,
            gate_length: true,
            format_check: FormatCheck::Strict,
            temperature: 1.0,
            enable_thinking: false,
            observation_max_chars: 10000,
            bash_timeout_secs: 60.0,
            max_bash_timeout_secs: 300.0,
            test_timeout_secs: 600.0,
            image: arcticd_sandbox::image::DEFAULT_TAG.to_string(),
            system_prompt: DEFAULT_SYSTEM_PROMPT.to_string(),
            instruction: DEFAULT_INSTRUCTION.to_string(),
            prompt_tools: true,
            grade_cache: true,
        }
    }
}

/// Checks a time limit in seconds: finite, not negative (and not zero
/// unless `zero` says what zero means), at most a year, so that it is a
/// `Duration` (a NaN or 1e300 is none) and a limit anyone means.
pub fn check_secs(name: &str, v: f64, zero: Option<&str>) -> Result<()> {
    const MAX: f64 = 365.0 * 24.0 * 3600.0;
    let ok = v.is_finite() && v <= MAX && (v > 0.0 || (v == 0.0 && zero.is_some()));
    if ok {
        return Ok(());
    }
    Err(Error::Input(format!(
        "{name} must be a number of seconds {}up to a year ({MAX}), got {v:?}",
        match zero {
            Some(means) => format!("from 0 ({means}) "),
            None => "above 0 and ".into(),
        }
    )))
}

impl RolloutConfig {
    /// Rejects settings no rollout can run with, before any starts.
    pub fn check(&self) -> Result<()> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(Error::Input(format!(
                "temperature must be a finite number >= 0, got {}",
                self.temperature
            )));
        }
        if self.max_new_tokens == 0 {
            return Err(Error::Input("max_new_tokens must be at least 1".into()));
        }
        if self.image.trim().is_empty() {
            return Err(Error::Input(
                "image must name a sandbox image, not be empty".into(),
            ));
        }
        check_secs("max_wall_secs", self.max_wall_secs, Some("no limit"))?;
        check_secs("bash_timeout_secs", self.bash_timeout_secs, None)?;
        check_secs("max_bash_timeout_secs", self.max_bash_timeout_secs, None)?;
        check_secs("test_timeout_secs", self.test_timeout_secs, None)
    }
}

/// Most grades a harness keeps ([`RolloutConfig::grade_cache`]).
const GRADE_CACHE_ENTRIES: usize = 65_536;

/// The routing key of one rollout: a hash of its task and attempt, the
/// same in every run (SipHash with fixed keys).
fn session_key(instance_id: &str, attempt: usize) -> u64 {
    use std::hash::{Hash, Hasher};
    #[allow(deprecated)]
    let mut h = std::hash::SipHasher::new();
    (instance_id, attempt).hash(&mut h);
    h.finish()
}

/// Runs rollouts: the tokenizer, chat template, tools and settings.
pub struct Harness {
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    /// The settings.
    pub cfg: RolloutConfig,
    /// Sandbox limits for the agent's sandbox and grading.
    pub sandbox_policy: SandboxPolicy,
    tools: Vec<Value>,
    /// What the template appends to open an assistant turn.
    gen_prompt: String,
    im_end: u32,
    grades: Option<GradeCache>,
}

impl Harness {
    /// A harness for a model's tokenizer and chat template.
    pub fn new(
        tokenizer: Arc<Tokenizer>,
        template: ChatTemplate,
        cfg: RolloutConfig,
    ) -> Result<Self> {
        cfg.check()?;
        let im_end = tokenizer
            .token_to_id("<|im_end|>")
            .ok_or_else(|| Error::Input("the tokenizer has no <|im_end|> token".into()))?;
        let kwargs = thinking_kwargs(cfg.enable_thinking);
        let probe = [json!({"role": "user", "content": "x"})];
        let with = template.render_with(&probe, None, true, &kwargs)?;
        let without = template.render_with(&probe, None, false, &kwargs)?;
        let gen_prompt = with
            .strip_prefix(&without)
            .ok_or_else(|| {
                Error::Input("the chat template's generation prompt is not a suffix".into())
            })?
            .to_string();
        let cfg_grade_cache = cfg.grade_cache;
        Ok(Harness {
            tokenizer,
            template,
            cfg,
            sandbox_policy: SandboxPolicy::default(),
            tools: tools::tool_schemas(),
            gen_prompt,
            im_end,
            grades: cfg_grade_cache.then(|| GradeCache::new(GRADE_CACHE_ENTRIES)),
        })
    }

    /// Grades served from the grade cache and grades that ran the tests,
    /// so far (both 0 with the cache off).
    pub fn grade_cache_counts(&self) -> (u64, u64) {
        self.grades
            .as_ref()
            .map_or((0, 0), |c| (c.hits(), c.misses()))
    }

    /// The tool schemas the model is shown.
    pub fn tools(&self) -> &[Value] {
        &self.tools
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// The initial prompt of a task, as text and tokens.
    pub fn initial_prompt(&self, task: &Task) -> Result<(String, Vec<u32>)> {
        let user = format!(
            "<issue>\n{}\n</issue>\n\nThe repository is at {}. {}",
            task.problem_statement.trim(),
            task.workdir,
            self.cfg.instruction.trim()
        );
        let messages = [
            json!({"role": "system", "content": self.cfg.system_prompt}),
            json!({"role": "user", "content": user}),
        ];
        let tools = self.cfg.prompt_tools.then_some(self.tools.as_slice());
        let text = self.template.render_with(
            &messages,
            tools,
            true,
            &thinking_kwargs(self.cfg.enable_thinking),
        )?;
        // The issue comes from outside: a special token's text in it stays
        // text (it cannot close the user turn and open another).
        let at = text.find(&user).ok_or_else(|| {
            Error::Input("the chat template did not keep the user message as written".into())
        })?;
        let ids = self
            .tokenizer
            .encode_guarded(&text, std::slice::from_ref(&(at..at + user.len())))?;
        Ok((text, ids))
    }

    /// The text appended after a model turn: the tool response turn and the
    /// next generation prompt (the template's own format).
    pub fn observation_text(&self, observation: &str, turn_closed: bool) -> String {
        self.observation_parts(observation, turn_closed).0
    }

    /// [`Harness::observation_text`] and the byte range of the tool's
    /// output in it, between the `<tool_response>` tokens.
    fn observation_parts(
        &self,
        observation: &str,
        turn_closed: bool,
    ) -> (String, std::ops::Range<usize>) {
        let head = format!(
            "{}\n<|im_start|>user\n<tool_response>",
            if turn_closed { "" } else { "<|im_end|>" }
        );
        let text = format!(
            "{head}\n{observation}\n</tool_response><|im_end|>\n{}",
            self.gen_prompt
        );
        let range = head.len()..head.len() + observation.len() + 2;
        (text, range)
    }

    /// The tokens appended after a model turn. The tool's output comes from
    /// the sandbox (files, command output): a special token's text in it
    /// stays text, so a file holding `<|im_end|>` cannot end the turn.
    pub fn observation_ids(&self, observation: &str, turn_closed: bool) -> Result<Vec<u32>> {
        let (text, range) = self.observation_parts(observation, turn_closed);
        Ok(self.tokenizer.encode_guarded(&text, &[range])?)
    }

    /// Runs one rollout of `task`. Never fails: errors become the
    /// termination reason (`infra`, `policy_error`).
    pub async fn rollout(
        &self,
        policy: &dyn Policy,
        backend: &dyn Backend,
        task: &Task,
        attempt: usize,
    ) -> Trajectory {
        let start = Instant::now();
        let mut t = Trajectory::unstarted(&task.instance_id, attempt, &policy.name(), "");
        let (term, detail) = self.run(policy, backend, task, &mut t, start).await;
        t.termination = term;
        t.masked = term.masked();
        if term != Termination::Submitted {
            t.reward = 0.0;
        }
        t.detail = detail;
        t.wall_secs = start.elapsed().as_secs_f64();
        t
    }

    fn push_env(&self, t: &mut Trajectory, ids: &[u32]) {
        t.token_ids.extend_from_slice(ids);
        t.loss_mask.extend(std::iter::repeat_n(0u8, ids.len()));
        t.logprobs.extend(std::iter::repeat_n(0f32, ids.len()));
        t.weight_versions
            .extend(std::iter::repeat_n(0u64, ids.len()));
    }

    async fn run(
        &self,
        policy: &dyn Policy,
        backend: &dyn Backend,
        task: &Task,
        t: &mut Trajectory,
        start: Instant,
    ) -> (Termination, String) {
        let (text, ids) = match self.initial_prompt(task) {
            Ok(x) => x,
            Err(e) => return (Termination::Infra, format!("building the prompt: {e}")),
        };
        t.prompt_text = text;
        t.prompt_len = ids.len();
        self.push_env(t, &ids);
        let (snapshot, image, sb_policy) =
            match task_env(backend, task, &self.cfg.image, &self.sandbox_policy).await {
                Ok(x) => x,
                Err(e) => return (Termination::Infra, e.to_string()),
            };
        let sandbox = match backend.start(&snapshot, &image, &sb_policy).await {
            Ok(s) => s,
            Err(e) => return (Termination::Infra, format!("starting the sandbox: {e}")),
        };
        let result = self.turns(policy, sandbox.as_ref(), t, start).await;
        let diff = match &result {
            Ok(()) => Some(sandbox.diff().await),
            _ => None,
        };
        let closed = sandbox.close().await;
        let outcome = match (result, diff) {
            (Err(e), _) => return e,
            (Ok(()), Some(Ok(diff))) => diff,
            // A working copy the agent made unreadable (its .git removed)
            // or too large to diff is a failed submission, not a masked
            // infrastructure error: masking would let an agent hide its
            // failures from the reward.
            (
                Ok(()),
                Some(Err(
                    e @ (arcticd_sandbox::Error::Workspace(_)
                    | arcticd_sandbox::Error::TooLarge { .. }),
                )),
            ) => {
                return (
                    Termination::Submitted,
                    format!("submitted, but the diff cannot be taken (reward 0): {e}"),
                )
            }
            (Ok(()), Some(Err(e))) => return (Termination::Infra, format!("taking the diff: {e}")),
            (Ok(()), None) => return (Termination::Infra, "no diff".into()),
        };
        if let Err(e) = closed {
            tracing::warn!("closing sandbox of {}: {e}", task.instance_id);
        }
        t.diff = Some(outcome.clone());
        let spec = task.test_spec(self.cfg.test_timeout_secs);
        let graded = match &self.grades {
            Some(cache) => {
                grading::grade_cached(
                    cache, backend, &snapshot, &image, &sb_policy, &outcome, &spec,
                )
                .await
            }
            None => grading::grade(backend, &snapshot, &image, &sb_policy, &outcome, &spec)
                .await
                .map(|g| (g, false)),
        };
        match graded {
            Ok((g, cached)) => {
                t.grade = Some(json!({
                    "outcome": g.outcome,
                    "detail": g.detail,
                    "failing": g.failing,
                    "cached": cached,
                }));
                if g.outcome == GradeOutcome::InfraError {
                    return (Termination::Infra, format!("grading: {}", g.detail));
                }
                t.reward = g.reward;
                (Termination::Submitted, format!("submitted: {}", g.detail))
            }
            Err(e) => (Termination::Infra, format!("grading: {e}")),
        }
    }

    /// The turn loop. `Ok(())`: the agent submitted; `Err`: the
    /// rollout ended otherwise, with its reason.
    async fn turns(
        &self,
        policy: &dyn Policy,
        sandbox: &dyn arcticd_sandbox::Sandbox,
        t: &mut Trajectory,
        start: Instant,
    ) -> std::result::Result<(), (Termination, String)> {
        let mut toolbox = ToolBox::new(
            sandbox,
            self.cfg.bash_timeout_secs,
            self.cfg.max_bash_timeout_secs,
        );
        let mut calls: Vec<ToolCall> = Vec::new();
        let mut turn = 0usize;
        let session = session_key(&t.task_id, t.attempt);
        // The context budget: the configured one, within what the policy
        // can hold (0: none).
        let budget = match (self.cfg.max_context_tokens, policy.context_limit()) {
            (0, Some(l)) => l,
            (b, Some(l)) => b.min(l),
            (b, None) => b,
        };
        loop {
            if self.cfg.max_turns > 0 && turn >= self.cfg.max_turns {
                return Err((
                    Termination::TurnBudget,
                    format!("{turn} turns without submitting"),
                ));
            }
            let elapsed = start.elapsed().as_secs_f64();
            if self.cfg.max_wall_secs > 0.0 && elapsed >= self.cfg.max_wall_secs {
                return Err((Termination::WallBudget, format!("{elapsed:.1} s elapsed")));
            }
            let mut max_new = self.cfg.max_new_tokens;
            if budget > 0 {
                let room = budget.saturating_sub(t.token_ids.len());
                if room == 0 {
                    return Err((
                        Termination::ContextBudget,
                        format!("{} tokens in context", t.token_ids.len()),
                    ));
                }
                max_new = max_new.min(room);
            }
            turn += 1;
            let req = GenerateRequest {
                prompt_ids: t.token_ids.clone(),
                max_new_tokens: max_new,
                temperature: self.cfg.temperature,
                stop_token_ids: vec![self.im_end],
                session,
            };
            let g0 = Instant::now();
            let gen = if self.cfg.max_wall_secs > 0.0 {
                let left = (self.cfg.max_wall_secs - start.elapsed().as_secs_f64()).max(0.001);
                match arcticd_sandbox::tokio::time::timeout(
                    std::time::Duration::from_secs_f64(left),
                    policy.generate(req),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => {
                        return Err((
                            Termination::WallBudget,
                            "generation ran past the wall-time budget".into(),
                        ))
                    }
                }
            } else {
                policy.generate(req).await
            };
            let c = match gen.and_then(|c| c.check().map(|_| c)) {
                Ok(c) => c,
                Err(e) => return Err((Termination::PolicyError, e.to_string())),
            };
            let mut record = TurnRecord {
                n_tokens: c.token_ids.len(),
                finish_reason: match c.finish_reason {
                    FinishReason::Stop => "stop".into(),
                    FinishReason::Length => "length".into(),
                },
                gen_secs: g0.elapsed().as_secs_f64(),
                ..Default::default()
            };
            t.token_ids.extend_from_slice(&c.token_ids);
            t.loss_mask
                .extend(std::iter::repeat_n(1u8, c.token_ids.len()));
            t.logprobs.extend_from_slice(&c.logprobs);
            t.weight_versions.extend_from_slice(&c.weight_versions);
            let closed = c.token_ids.last() == Some(&self.im_end);
            let body = if closed {
                &c.token_ids[..c.token_ids.len() - 1]
            } else {
                &c.token_ids[..]
            };
            record.raw_text = match self.tokenizer.decode(body, false) {
                Ok(s) => s,
                Err(e) => {
                    t.turns.push(record);
                    return Err((Termination::PolicyError, format!("decoding the turn: {e}")));
                }
            };
            if c.finish_reason == FinishReason::Length && self.cfg.gate_length {
                t.turns.push(record);
                return Err((
                    Termination::Truncated,
                    "the turn hit the token limit".into(),
                ));
            }
            let observation = match self.cfg.format_check.judge(&record.raw_text, &self.tools) {
                Err(v) => {
                    record.format_error = Some(v.to_string());
                    if self.cfg.gate_format {
                        t.turns.push(record);
                        return Err((Termination::InvalidFormat, v.to_string()));
                    }
                    format!("Error: your reply was not exactly one well-formed tool call ({v}). Reply with one tool call.")
                }
                Ok(call) => {
                    record.call = serde_json::to_value(&call).ok();
                    if calls.contains(&call) {
                        if self.cfg.gate_duplicate {
                            t.turns.push(record);
                            return Err((
                                Termination::DuplicateCall,
                                format!("repeated call to {}", call.name),
                            ));
                        }
                    } else {
                        calls.push(call.clone());
                    }
                    let t0 = Instant::now();
                    let out = toolbox.run(&call).await;
                    record.tool_secs = t0.elapsed().as_secs_f64();
                    match out {
                        Ok(ToolOutcome::Submit) => {
                            t.turns.push(record);
                            return Ok(());
                        }
                        // As written: `observation_ids` keeps any control
                        // token's text in it as text.
                        Ok(ToolOutcome::Observation(o)) => {
                            tools::truncate_middle(&o, self.cfg.observation_max_chars)
                        }
                        Err(ToolError::Infra(e)) => {
                            t.turns.push(record);
                            return Err((Termination::Infra, e.to_string()));
                        }
                    }
                }
            };
            let obs_ids = match self.observation_ids(&observation, closed) {
                Ok(ids) => ids,
                Err(e) => {
                    return Err((Termination::Infra, format!("encoding the observation: {e}")))
                }
            };
            record.observation = Some(observation);
            t.turns.push(record);
            self.push_env(t, &obs_ids);
            if budget > 0 && t.token_ids.len() >= budget {
                return Err((
                    Termination::ContextBudget,
                    format!("{} tokens in context", t.token_ids.len()),
                ));
            }
        }
    }
}

fn thinking_kwargs(enable: bool) -> serde_json::Map<String, Value> {
    let mut m = serde_json::Map::new();
    m.insert("enable_thinking".into(), Value::Bool(enable));
    m
}
