//! A [`Policy`] over the in-process engine: requests go to the
//! least-loaded replica of a [`Router`] (design step 8; `Routing::Pinned`
//! is the ablation that keeps a rollout on one replica) and come back with
//! per-token log-probabilities and weight versions exactly as the engine
//! sampled them.
//!
//! Not for: starting engines or loading weights (the caller owns the
//! router); sampling details (see the engine's sampler).

use super::policy::{Completion, FinishReason, GenerateRequest, Policy};
use super::Harness;
use crate::Result;
use arcticd_engine::engine::{
    apply_event, Choice, EngineConfig, FinishReason as EngineFinish, Request,
};
use arcticd_engine::router::Router;
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{Error as EngineError, ParamStore, Qwen3_5};
use async_trait::async_trait;
use serde::{Deserialize, Serialize};
use std::path::Path;
use std::sync::Arc;

/// Which replica a request goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// The replica with the least outstanding work, per request.
    #[default]
    LeastLoaded,
    /// Every request of a rollout to the replica its session picks
    /// (`session % replicas`), whatever the load: cache-affinity routing,
    /// an ablation (load piles up unevenly and queued rollouts go stale).
    Pinned,
}

/// The in-process engine as a policy.
pub struct EnginePolicy {
    router: Router,
    name: String,
    routing: Routing,
}

impl EnginePolicy {
    /// A least-loaded policy over `router`; `name` labels trajectories.
    pub fn new(router: Router, name: impl Into<String>) -> Self {
        EnginePolicy {
            router,
            name: name.into(),
            routing: Routing::LeastLoaded,
        }
    }

    pub fn with_routing(mut self, routing: Routing) -> Self {
        self.routing = routing;
        self
    }
}

/// A checkpoint served by in-process engines for a harness: the policy and
/// the router it runs on (shut it down when done).
pub struct EnginePolicyRouter {
    pub policy: Arc<EnginePolicy>,
    pub router: Router,
}

impl EnginePolicyRouter {
    /// Loads the checkpoint in `model` and starts `replicas` engines with
    /// `cache_mib` MiB of paged cache each (0: the engine's default), long
    /// enough for the harness's context budget.
    pub fn load(
        model: &Path,
        harness: &Harness,
        replicas: usize,
        cache_mib: usize,
        name: &str,
    ) -> Result<Self> {
        // Read only: each matrix held once, packed (the same bits).
        let (weights, packs) = Qwen3_5::load_packed(model)?;
        let mut config = EngineConfig {
            max_model_len: harness
                .cfg
                .max_context_tokens
                .max(harness.cfg.max_new_tokens.saturating_add(1)),
            ..EngineConfig::default()
        };
        if cache_mib > 0 {
            config.cache_memory = cache_mib << 20;
        }
        let router = Router::start(
            replicas.max(1),
            ParamStore::packed(weights, packs),
            Some(harness.tokenizer().clone()),
            config,
        )?;
        let policy = Arc::new(EnginePolicy::new(router.clone(), name));
        Ok(EnginePolicyRouter { policy, router })
    }
}

#[async_trait]
impl Policy for EnginePolicy {
    async fn generate(&self, req: GenerateRequest) -> Result<Completion> {
        let params = SamplingParams {
            temperature: req.temperature,
            max_tokens: req.max_new_tokens,
            stop_token_ids: req.stop_token_ids.clone(),
            n: 1,
            ..SamplingParams::default()
        };
        let request = Request {
            prompt: req.prompt_ids,
            params,
        };
        let mut sub = match self.routing {
            Routing::LeastLoaded => self.router.submit(request)?.1,
            Routing::Pinned => {
                let n = self.router.replicas().len() as u64;
                self.router.submit_to((req.session % n) as usize, request)?
            }
        };
        let mut choices = vec![Choice::default()];
        loop {
            match sub.events.recv().await {
                Some(ev) => {
                    if apply_event(&mut choices, ev)? > 0 {
                        break;
                    }
                }
                None => return Err(EngineError::Unavailable("the engine stopped".into()).into()),
            }
        }
        let Some(c) = choices.pop() else {
            return Err(EngineError::Invariant("the engine returned no choice".into()).into());
        };
        let finish_reason = match c.finish_reason {
            Some(EngineFinish::Stop { .. }) => FinishReason::Stop,
            Some(EngineFinish::Length) => FinishReason::Length,
            Some(EngineFinish::Abort) | None => {
                return Err(
                    EngineError::Unavailable("the engine aborted the request".into()).into(),
                )
            }
        };
        Ok(Completion {
            token_ids: c.tokens,
            logprobs: c.logprobs,
            weight_versions: c.weight_versions,
            finish_reason,
        })
    }

    fn name(&self) -> String {
        self.name.clone()
    }

    fn context_limit(&self) -> Option<usize> {
        // Every replica is sized alike; the least of them bounds a request
        // wherever it is placed.
        self.router
            .replicas()
            .iter()
            .map(|r| r.info().context_limit().0)
            .min()
    }
}
