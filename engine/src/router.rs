//! Router over engine replicas: each request goes to the replica with the
//! least outstanding work (queued plus running tokens, see
//! `EngineMetrics::load`; ties go to each replica in turn), never pinned to
//! one for cache reuse. Pinning piles
//! work on one replica and its queued rollouts go stale (docs/ARCHITECTURE.md, recipe step 8).
//!
//! Replicas may share one parameter store; the router does not care. Load is
//! added when a request is submitted, so a burst of requests arriving
//! between two engine steps still spreads out.

use crate::engine::{self, EngineConfig, EngineHandle, PromptScores, Request, Submitted};
use crate::params::ParamStore;
use crate::tokenizer::Tokenizer;
use crate::{Error, Result};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// A set of engine replicas behind one submit call.
#[derive(Debug, Clone)]
pub struct Router {
    replicas: Vec<EngineHandle>,
    /// Serialises pick-and-submit so two callers cannot both read the same
    /// minimum before either adds its load. Held for microseconds.
    pick: Arc<Mutex<()>>,
    /// Where the next pick starts its scan, so ties rotate over the
    /// replicas (between turns loads are mostly all 0; always taking the
    /// lowest index would hand replica 0 most of the work).
    turn: Arc<AtomicUsize>,
}

impl Router {
    pub fn new(replicas: Vec<EngineHandle>) -> Result<Self> {
        if replicas.is_empty() {
            return Err(Error::Config("a router needs at least one replica".into()));
        }
        Ok(Router {
            replicas,
            pick: Arc::new(Mutex::new(())),
            turn: Arc::new(AtomicUsize::new(0)),
        })
    }

    /// Start `n` replicas over one shared store.
    pub fn start(
        n: usize,
        store: Arc<ParamStore>,
        tokenizer: Option<Arc<Tokenizer>>,
        config: EngineConfig,
    ) -> Result<Self> {
        let replicas = (0..n)
            .map(|_| engine::start(store.clone(), tokenizer.clone(), config.clone()))
            .collect::<Result<Vec<_>>>()?;
        Self::new(replicas)
    }

    pub fn replicas(&self) -> &[EngineHandle] {
        &self.replicas
    }

    /// Current load of each replica.
    pub fn loads(&self) -> Vec<u64> {
        self.replicas.iter().map(|r| r.load()).collect()
    }

    /// Tokens each replica has generated since it started.
    pub fn generated_tokens(&self) -> Vec<u64> {
        self.replicas
            .iter()
            .map(|r| r.metrics().generated_tokens.load(Ordering::Relaxed))
            .collect()
    }

    /// Index of the least-loaded replica; ties go to each replica in turn.
    pub fn least_loaded(&self) -> usize {
        let n = self.replicas.len();
        let start = self.turn.fetch_add(1, Ordering::Relaxed) % n;
        let mut best = start;
        let mut best_load = u64::MAX;
        for k in 0..n {
            let i = (start + k) % n;
            let l = self.replicas[i].load();
            if l < best_load {
                best = i;
                best_load = l;
            }
        }
        best
    }

    /// Submit to the least-loaded replica; returns its index too.
    pub fn submit(&self, request: Request) -> Result<(usize, Submitted)> {
        self.submit_to_least_loaded(request, false)
    }

    /// [`submit`](Self::submit) with each choice's token events held until
    /// it finishes (see `EngineHandle::submit_collected`).
    pub fn submit_collected(&self, request: Request) -> Result<(usize, Submitted)> {
        self.submit_to_least_loaded(request, true)
    }

    fn submit_to_least_loaded(
        &self,
        request: Request,
        collected: bool,
    ) -> Result<(usize, Submitted)> {
        let _guard = self.pick.lock().unwrap_or_else(|e| e.into_inner());
        let i = self.least_loaded();
        let sub = if collected {
            self.replicas[i].submit_collected(request)?
        } else {
            self.replicas[i].submit(request)?
        };
        Ok((i, sub))
    }

    /// Score a prompt on the least-loaded replica (see
    /// `EngineHandle::score_prompt`).
    pub async fn score_prompt(&self, tokens: Vec<u32>, top: usize) -> Result<PromptScores> {
        let answer = {
            let _guard = self.pick.lock().unwrap_or_else(|e| e.into_inner());
            let i = self.least_loaded();
            self.replicas[i].submit_score(tokens, top)?
        };
        EngineHandle::scored(answer).await
    }

    /// Submit to replica `replica` whatever its load (pinned routing, an
    /// ablation of the recipe; see the module note).
    pub fn submit_to(&self, replica: usize, request: Request) -> Result<Submitted> {
        let r = self.replicas.get(replica).ok_or_else(|| {
            Error::Config(format!(
                "replica {replica} of {} does not exist",
                self.replicas.len()
            ))
        })?;
        r.submit(request)
    }

    /// Checks a request against the first replica's limits (all replicas
    /// share a configuration).
    pub fn validate(&self, request: &Request) -> Result<()> {
        self.replicas[0].validate(request)
    }

    /// Checks a prompt that is only scored, never continued (see
    /// `EngineHandle::check_prompt`).
    pub fn validate_prompt(&self, prompt: &[u32]) -> Result<()> {
        self.replicas[0].check_prompt(prompt, 0)
    }

    /// Abort request `id` on replica `replica`.
    pub fn abort(&self, replica: usize, id: u64) {
        if let Some(r) = self.replicas.get(replica) {
            r.abort(id);
        }
    }

    /// Pause every replica (for a weight update); see `EngineHandle::pause`.
    pub fn pause(&self) -> Result<()> {
        for r in &self.replicas {
            r.pause()?;
        }
        Ok(())
    }

    pub fn resume(&self) {
        for r in &self.replicas {
            r.resume();
        }
    }

    pub fn shutdown(&self) {
        for r in &self.replicas {
            r.shutdown();
        }
    }
}
