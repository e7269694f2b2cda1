//! The asynchronous RL loop of `arcticd train`, in one process
//! (docs/ARCHITECTURE.md, "Data flow of train").
//!
//! - A dispatcher (tokio task) takes tasks from the pool and starts a group
//!   of G rollouts per task, as long as admission allows: group n may start
//!   only while `n < (updates done + max_staleness + 1) * B`, so a group
//!   that finishes in order is consumed within the bound. The counter is
//!   restored on resume (to the groups consumed), so no burst follows.
//! - Rollout workers (tokio tasks, at most `concurrency` at once) run the
//!   harness against the engine replicas behind the least-loaded router,
//!   every rollout under a timeout; a finished group goes to the buffer.
//! - The trainer (this thread) takes B complete groups, plans the batch at
//!   its weight version (staleness bound, masking, advantages: `batch`),
//!   runs forward and backward while the engines keep generating, and
//!   only for the optimizer's write pauses the engines (a guard resumes
//!   them whatever happens); the version goes up and every engine rebuilds
//!   its in-flight caches before its next token.
//! - Every `eval_every` / `recheck_every` updates, held-out tasks and
//!   retired tasks are scored with a frozen copy of the weights on an
//!   engine of their own; those rollouts are never trained on.
//! - Every update appends one line to `metrics.jsonl` and writes what it
//!   trained on; checkpoints carry the run state for `--resume`.
//!
//! Not for: command-line parsing, progress display (the caller's `on_step`).

use super::batch::{self, Group, PlanConfig};
use super::pool::TaskPool;
use super::probe::{self, Probe};
use super::recipe::{Keep, Recipe, SandboxBackend};
use super::run_dir::{append_jsonl, write_jsonl, RunDir, RunState, Totals};
use crate::checkpoint::save_checkpoint_with;
use crate::comm::{Communicator, LocalComm};
use crate::device::{step_devices, RestorePoint, StepDevice};
use crate::harness::engine_policy::EnginePolicy;
use crate::harness::trajectory::Trajectory;
use crate::harness::{Harness, Policy};
use crate::memory::{host_memory_available, MemoryPlan, PlanShape};
use crate::step::{PgExample, StepMetrics, Trainer, WriteGate};
use crate::{Error, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::config::ModelConfig;
use arcticd_engine::engine;
use arcticd_engine::engine::EngineConfig;
use arcticd_engine::router::Router;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_engine::{ParamStore, Qwen3_5};
use arcticd_sandbox::tasks::{load_tasks, Format, Task};
use arcticd_sandbox::Backend;
use serde::Serialize;
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Notify, Semaphore};

/// A trainer rank's engines (the replicas reading its weights) as its
/// write gate.
struct RouterGate {
    router: Router,
    replicas: Vec<usize>,
}

impl WriteGate for RouterGate {
    fn pause(&self) -> Result<()> {
        for &r in &self.replicas {
            self.router.replicas()[r].pause()?;
        }
        fault_point("weight_update");
        Ok(())
    }
    fn resume(&self) {
        for &r in &self.replicas {
            self.router.replicas()[r].resume();
        }
    }
}

/// A trainer rank on the device the recipe names.
type RankTrainer = Trainer<Box<dyn StepDevice>>;

/// The device of rank `rank` (and its replicas): `cuda:N+rank` for
/// `cuda:N`.
fn rank_device(device: arcticd_kernels::Device, rank: usize) -> arcticd_kernels::Device {
    match device {
        arcticd_kernels::Device::Cpu => arcticd_kernels::Device::Cpu,
        arcticd_kernels::Device::Cuda(n) => arcticd_kernels::Device::Cuda(n + rank),
    }
}

/// The trainer ranks past rank 0 (which steps on the loop's own thread),
/// one thread each with its own copy of the weights, taking its share of
/// every batch.
struct Ranks {
    jobs: Vec<mpsc::Sender<RankJob>>,
    /// Each rank's outcome of its last job (its metrics stay with it:
    /// rank 0's stand for the group).
    results: Vec<mpsc::Receiver<Result<()>>>,
}

/// What a rank past 0 is asked to do.
enum RankJob {
    /// A policy-gradient step on its share of the batch.
    Step(Vec<PgExample>),
    /// A rollback to this point.
    Restore(RestorePoint),
}

impl Ranks {
    /// Starts `trainers` (ranks 1.., in order) on threads of their own.
    fn start(trainers: Vec<RankTrainer>) -> Result<Ranks> {
        let (mut jobs, mut results) = (Vec::new(), Vec::new());
        for (i, mut trainer) in trainers.into_iter().enumerate() {
            let (job_tx, job_rx) = mpsc::channel::<RankJob>();
            let (result_tx, result_rx) = mpsc::channel();
            std::thread::Builder::new()
                .name(format!("trainer-rank-{}", i + 1))
                .spawn(move || {
                    for job in job_rx {
                        let done = match job {
                            RankJob::Step(share) => trainer.pg_step(&share).map(drop),
                            RankJob::Restore(point) => trainer.restore(&point).map(drop),
                        };
                        if result_tx.send(done).is_err() {
                            break;
                        }
                    }
                })
                .map_err(|e| Error::Run(format!("starting trainer rank {}: {e}", i + 1)))?;
            jobs.push(job_tx);
            results.push(result_rx);
        }
        Ok(Ranks { jobs, results })
    }

    /// `jobs[r]` sent to rank r + 1, `mine` run on rank 0 (here), then every
    /// rank's answer: rank 0's, or the first error of any rank.
    fn all<T>(
        &self,
        jobs: impl IntoIterator<Item = RankJob>,
        mine: impl FnOnce() -> Result<T>,
    ) -> Result<T> {
        for (r, (tx, job)) in self.jobs.iter().zip(jobs).enumerate() {
            tx.send(job)
                .map_err(|_| Error::Collective(format!("trainer rank {} has stopped", r + 1)))?;
        }
        let mine = mine();
        let mut first_err = None;
        for (r, rx) in self.results.iter().enumerate() {
            let got = rx.recv().unwrap_or_else(|_| {
                Err(Error::Collective(format!(
                    "trainer rank {} has stopped",
                    r + 1
                )))
            });
            if let Err(e) = got {
                first_err.get_or_insert(e);
            }
        }
        let m = mine?;
        match first_err {
            Some(e) => Err(e),
            None => Ok(m),
        }
    }

    /// One policy-gradient step over every rank: `trainer` (rank 0) here,
    /// the others on their threads, each on a contiguous share of
    /// `examples` of about equal tokens.
    fn pg_step(&self, trainer: &mut RankTrainer, examples: &[PgExample]) -> Result<StepMetrics> {
        if self.jobs.is_empty() {
            return trainer.pg_step(examples);
        }
        let shares = split_by_tokens(examples, self.jobs.len() + 1);
        let jobs = shares[1..].iter().map(|s| RankJob::Step(s.to_vec()));
        self.all(jobs, || trainer.pg_step(shares[0]))
    }

    /// Every rank rolled back to `point`; rank 0's new weight version.
    fn restore(&self, trainer: &mut RankTrainer, point: &RestorePoint) -> Result<u64> {
        let jobs = self.jobs.iter().map(|_| RankJob::Restore(point.clone()));
        self.all(jobs, || trainer.restore(point))
    }
}

/// `examples` in `n` contiguous shares of about equal token counts: each
/// example goes to the share its middle token falls in (a share may be
/// empty).
fn split_by_tokens(examples: &[PgExample], n: usize) -> Vec<&[PgExample]> {
    let n = n.max(1);
    let total: usize = examples.iter().map(|e| e.tokens.len()).sum();
    let mut bounds = vec![0; n + 1];
    let mut prefix = 0;
    for (i, e) in examples.iter().enumerate() {
        let len = e.tokens.len();
        let share = ((2 * prefix + len) * n / (2 * total).max(1)).min(n - 1);
        bounds[share + 1] = i + 1;
        prefix += len;
    }
    // Shares that got no example end where the one before them does.
    for k in 1..=n {
        bounds[k] = bounds[k].max(bounds[k - 1]);
    }
    bounds[n] = examples.len();
    (0..n)
        .map(|k| &examples[bounds[k]..bounds[k + 1]])
        .collect()
}

/// Test hook for crash tests: with `ARCTICD_FAULT_PAUSE=<point>` (and
/// `ARCTICD_FAULT_DIR=<dir>`), the process writes `<dir>/paused-<point>`
/// and sleeps when it reaches that point, so a test can SIGKILL it exactly
/// there. Points: `rollouts` (the trainer waits while rollouts run),
/// `weight_update` (engines paused, weights about to be written),
/// `checkpoint_write` (a checkpoint written but not yet in place).
/// `ARCTICD_FAULT_HIT=N` picks the N-th time the point is reached
/// (default 1).
fn fault_point(point: &str) {
    static HITS: AtomicU64 = AtomicU64::new(0);
    if std::env::var("ARCTICD_FAULT_PAUSE").ok().as_deref() != Some(point) {
        return;
    }
    let want: u64 = std::env::var("ARCTICD_FAULT_HIT")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1);
    if HITS.fetch_add(1, Ordering::AcqRel) + 1 != want {
        return;
    }
    if let Some(dir) = std::env::var_os("ARCTICD_FAULT_DIR") {
        let _ = std::fs::write(PathBuf::from(dir).join(format!("paused-{point}")), b"");
    }
    std::thread::sleep(Duration::from_secs(3600));
}

/// Called with every metrics record as it is written.
pub type StepCallback = Box<dyn FnMut(&Value) + Send>;

/// How a run is started.
pub struct RunOptions {
    /// The run directory.
    pub out: PathBuf,
    /// Continue the run in `out` from its last complete checkpoint.
    pub resume: bool,
    /// Set to stop: the current update finishes, a checkpoint is written,
    /// in-flight rollouts are abandoned and their sandboxes removed.
    pub cancel: Arc<AtomicBool>,
    /// Called with every metrics record as it is written.
    pub on_step: Option<StepCallback>,
}

/// What a finished run reports.
#[derive(Debug, Clone, Serialize)]
pub struct RunSummary {
    pub run_dir: PathBuf,
    pub steps: u64,
    pub weight_version: u64,
    pub elapsed_s: f64,
    pub cancelled: bool,
    /// Why the run ended before its last update, when it did
    /// (`stop_after_dead_updates`).
    pub stopped: Option<String>,
    /// The first and last metrics records.
    pub first: Option<Value>,
    pub last: Option<Value>,
    /// Every held-out evaluation: (update, pass@1).
    pub evals: Vec<(u64, f64)>,
    /// From the run's first held-out evaluation to its last (eval.jsonl,
    /// so across resumes).
    pub held_out: Option<HeldOutChange>,
    pub totals: Totals,
}

/// The held-out pass@1 before the first update and at the last
/// evaluation, over the tasks scored both times, with the standard error
/// of the mean of their paired differences. Taken over tasks, it holds
/// both the attempts' sampling noise and how differently the tasks
/// changed: the error of the change on tasks like these, not only on
/// the ones scored (each evaluation's own `std_error` is the attempts'
/// noise alone).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct HeldOutChange {
    pub from_step: u64,
    pub to_step: u64,
    pub from: f64,
    pub to: f64,
    pub tasks: usize,
    /// Attempts per task in the first and the last evaluation.
    pub attempts: (u64, u64),
    pub std_error: f64,
}

impl HeldOutChange {
    /// From the text of eval.jsonl: its update-0 record and its last one
    /// (None without both, or when they scored different task lists).
    pub fn from_eval_log(text: &str) -> Option<Self> {
        let records: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let step = |r: &Value| r.get("step").and_then(Value::as_u64);
        let first = records.iter().find(|r| step(r) == Some(0))?;
        let last = records
            .iter()
            .rev()
            .find(|r| step(r).is_some_and(|s| s > 0))?;
        let per_task = |r: &Value| -> Option<Vec<Option<f64>>> {
            r.get("per_task")?
                .as_array()?
                .iter()
                .map(|x| match x {
                    Value::Null => Some(None),
                    x => x.as_f64().map(Some),
                })
                .collect()
        };
        let (a, b) = (per_task(first)?, per_task(last)?);
        if a.len() != b.len() {
            return None;
        }
        let pairs: Vec<(f64, f64)> = a
            .iter()
            .zip(&b)
            .filter_map(|(x, y)| Some(((*x)?, (*y)?)))
            .collect();
        let n = pairs.len();
        if n == 0 {
            return None;
        }
        let mean = |f: &dyn Fn(&(f64, f64)) -> f64| pairs.iter().map(f).sum::<f64>() / n as f64;
        let (from, to) = (mean(&|p| p.0), mean(&|p| p.1));
        let d = to - from;
        let var = if n > 1 {
            pairs.iter().map(|p| (p.1 - p.0 - d).powi(2)).sum::<f64>() / (n - 1) as f64
        } else {
            0.0
        };
        let attempts = |r: &Value| r.get("attempts").and_then(Value::as_u64).unwrap_or(0);
        Some(HeldOutChange {
            from_step: 0,
            to_step: step(last)?,
            from,
            to,
            tasks: n,
            attempts: (attempts(first), attempts(last)),
            std_error: (var / n as f64).sqrt(),
        })
    }
}

/// Updates in a row that solved nothing and trained nothing: the run's
/// weights are stuck where they are (`stop_after_dead_updates`).
#[derive(Default)]
struct DeadStreak {
    limit: u64,
    run: u64,
    /// Why the streak's first masked attempt was masked, when one was.
    first_masked: Option<String>,
}

impl DeadStreak {
    fn new(limit: u64) -> Self {
        DeadStreak {
            limit,
            ..DeadStreak::default()
        }
    }

    /// After an update that `trained` (or not) at `pass_rate`, whose
    /// attempts ended as `termination` and whose first masked attempt (if
    /// any) was masked for `masked`: why the run should stop, once `limit`
    /// such updates came in a row.
    fn after(
        &mut self,
        trained: bool,
        pass_rate: f64,
        termination: &std::collections::BTreeMap<String, usize>,
        masked: Option<&str>,
    ) -> Option<String> {
        if !trained && pass_rate == 0.0 {
            self.run += 1;
            if self.first_masked.is_none() {
                self.first_masked = masked.map(str::to_string);
            }
        } else {
            self.run = 0;
            self.first_masked = None;
        }
        (self.limit > 0 && self.run >= self.limit).then(|| {
            format!(
                "the last {} updates solved nothing and trained nothing ({}): the weights can \
                 no longer change (stop_after_dead_updates = {})",
                self.run,
                self.why(termination),
                self.limit
            )
        })
    }

    /// Dead updates in a row so far.
    fn len(&self) -> u64 {
        self.run
    }

    /// Starts counting again (after a rollback).
    fn reset(&mut self) {
        self.run = 0;
        self.first_masked = None;
    }

    /// At the end of a run of `updates` updates that the limit did not
    /// stop: why it failed, when every one of them was dead (a run shorter
    /// than the limit that trained nothing is no success either).
    fn whole_run(
        &self,
        updates: u64,
        termination: &std::collections::BTreeMap<String, usize>,
    ) -> Option<String> {
        (updates > 0 && self.run >= updates).then(|| {
            format!(
                "all {updates} updates of this run solved nothing and trained nothing ({})",
                self.why(termination)
            )
        })
    }

    fn why(&self, termination: &std::collections::BTreeMap<String, usize>) -> String {
        // Masked attempts (Termination::masked) are never graded.
        let what = if termination
            .keys()
            .all(|k| k == "infra" || k == "policy_error")
        {
            "no attempt was graded: every one was masked as a failure of the sandbox, the \
             model or rollout_timeout_secs"
        } else {
            "every graded attempt failed"
        };
        let first = match &self.first_masked {
            Some(m) => format!("; the first masked attempt: {m}"),
            None => String::new(),
        };
        format!("{what}; how the last update's attempts ended: {termination:?}{first}")
    }
}

/// Each update's pass rate and whether it was dead, by update.
type History = std::collections::BTreeMap<u64, (f64, bool)>;

/// The checkpoint a collapsed run rolls back to, from `checkpoints`
/// (update, where; oldest first; the model the run started from is the
/// checkpoint of update 0), given the run's `history`: the newest one
/// - written before the dead streak that began at update `streak_start`
///   could have been sampled from broken weights (the first dead update's
///   rollouts came from weights as old as `max_staleness` + 1 updates
///   before it, so the checkpoint must be older still),
/// - before the run's last live update,
/// - healthy: the updates that sampled from weights near it (the
///   `max_staleness` + 1 after it) passed, on average, at least half the
///   run's mean pass rate before the streak (a checkpoint written while
///   the run was already sick is no place to go back to),
/// - older than `tried`, the target of a rollback after which no update
///   was live yet.
fn rollback_target<P: Clone>(
    checkpoints: &[(u64, P)],
    streak_start: u64,
    history: &History,
    tried: Option<u64>,
    max_staleness: u64,
) -> Option<(u64, P)> {
    let before: Vec<(u64, f64, bool)> = history
        .range(..streak_start)
        .map(|(&s, &(p, d))| (s, p, d))
        .collect();
    let last_live = before.iter().rev().find(|u| !u.2)?.0;
    let mean = |ps: &[f64]| ps.iter().sum::<f64>() / ps.len().max(1) as f64;
    let bar = 0.5 * mean(&before.iter().map(|u| u.1).collect::<Vec<_>>());
    checkpoints
        .iter()
        .rev()
        .find(|(at, _)| {
            let after: Vec<f64> = history
                .range(at + 1..=at + max_staleness + 1)
                .map(|(_, &(p, _))| p)
                .collect();
            at + max_staleness + 2 <= streak_start
                && *at < last_live
                && tried.is_none_or(|t| *at < t)
                && !after.is_empty()
                && mean(&after) >= bar
        })
        .cloned()
}

/// Where a collapsed run in `run_dir` can go back to, oldest first: the
/// model it started from (`model_dir`, as update 0), then its complete
/// checkpoints.
fn restore_points(run_dir: &RunDir, model_dir: &Path) -> Result<Vec<(u64, RestorePoint)>> {
    let mut points = vec![(0, RestorePoint::Start(model_dir.to_path_buf()))];
    points.extend(
        run_dir
            .complete_checkpoints()?
            .into_iter()
            .filter(|(at, _)| *at > 0)
            .map(|(at, dir)| (at, RestorePoint::Checkpoint(dir))),
    );
    Ok(points)
}

/// Where the run in `run_dir` (started from `model_dir`) goes back to
/// after a collapse whose first dead update is `streak_start`: the newest
/// point [`rollback_target`] accepts.
fn collapse_target(
    (run_dir, model_dir): (&RunDir, &Path),
    streak_start: u64,
    history: &History,
    tried: Option<u64>,
    max_staleness: u64,
) -> Result<Option<(u64, RestorePoint)>> {
    let points = restore_points(run_dir, model_dir)?;
    Ok(rollback_target(
        &points,
        streak_start,
        history,
        tried,
        max_staleness,
    ))
}

/// Why a run that ended with its last `n` updates dead (`why`: how they
/// ended) failed, and where a user can go back to: `back`, the newest
/// healthy point before the collapse, if one is kept.
fn ended_collapsed(n: u64, why: &str, back: Option<(u64, RestorePoint)>) -> String {
    let back = match back {
        Some((at, point)) => format!(
            "; the newest healthy point before it is {} ({})",
            point_name(at, &point),
            point.dir().display()
        ),
        None => String::new(),
    };
    format!(
        "the run ended collapsed: its last {n} updates solved nothing and trained nothing \
         ({why}) and no rollback undid it (rollback_after_dead_updates, max_rollbacks), so its \
         final weights are the collapse's{back}"
    )
}

/// How a user is told of the point of update `at`.
fn point_name(at: u64, point: &RestorePoint) -> String {
    match point {
        RestorePoint::Start(_) => "the model the run started from".into(),
        RestorePoint::Checkpoint(_) => format!("the checkpoint of update {at}"),
    }
}

/// What the metrics records of a resumed run's kept updates say for its
/// rollbacks (`pass_rate`, `dead`, `rolled_back_to`): its history, the
/// checkpoint of the last rollback when no live update followed it, and
/// the dead updates in a row it ended on.
fn rollback_memory(records: &[Value]) -> (History, Option<u64>, u64) {
    let (mut history, mut tried, mut dead) = (History::new(), None, 0);
    for r in records {
        let Some(step) = r["step"].as_u64() else {
            continue;
        };
        let is_dead = r["dead"] == Value::Bool(true);
        history.insert(step, (r["pass_rate"].as_f64().unwrap_or(0.0), is_dead));
        if is_dead {
            dead += 1;
        } else {
            (tried, dead) = (None, 0);
        }
        if let Some(to) = r["rolled_back_to"].as_u64() {
            (tried, dead) = (Some(to), 0);
        }
    }
    (history, tried, dead)
}

/// Whether every token a group's attempts generated was sampled at weight
/// version `floor` or later (a group sampled before a rollback is not).
fn sampled_since(g: &Group, floor: u64) -> bool {
    g.trajectories
        .iter()
        .all(|t| batch::oldest_version(t).is_none_or(|v| v >= floor))
}

/// Test hook for the rollback tests: with `ARCTICD_FAULT_DEAD=<from>:<n>`,
/// updates `from` to `from + n - 1` count as dead (solved and trained
/// nothing) whatever they did, so a run collapses on cue.
fn fault_dead(step: u64) -> bool {
    let Ok(spec) = std::env::var("ARCTICD_FAULT_DEAD") else {
        return false;
    };
    let mut parts = spec.split(':').map(|p| p.parse::<u64>().ok());
    match (parts.next().flatten(), parts.next().flatten()) {
        (Some(from), Some(n)) => (from..from + n).contains(&step),
        _ => false,
    }
}

/// Whether a group's graded rewards differ (it carries a policy-gradient
/// signal); what dynamic sampling waits for.
fn informative(g: &Group) -> bool {
    let mut graded = g
        .trajectories
        .iter()
        .filter(|t| !t.masked)
        .map(|t| t.reward);
    match graded.next() {
        Some(first) => graded.any(|r| r != first),
        None => false,
    }
}

/// State shared by the dispatcher, the workers and the trainer.
struct Shared {
    steps_done: AtomicU64,
    groups_started: AtomicU64,
    /// Groups consumed beyond B per update (dynamic sampling's refills):
    /// admission lets that many more start.
    extra_groups: AtomicU64,
    stop: AtomicBool,
    wake: Notify,
    pool: Mutex<TaskPool>,
    rollouts_done: AtomicU64,
}

/// Everything a rollout needs, shared by the workers.
struct Rollouts {
    harness: Arc<Harness>,
    backend: Arc<dyn Backend>,
    permits: Arc<Semaphore>,
    timeout: Duration,
}

impl Rollouts {
    /// One rollout under the timeout; a timeout is `infra`.
    async fn one(&self, policy: Arc<dyn Policy>, task: Arc<Task>, attempt: usize) -> Trajectory {
        let Ok(_permit) = self.permits.clone().acquire_owned().await else {
            return infra(&task, attempt, &policy.name(), "the run is stopping".into());
        };
        let fut = self
            .harness
            .rollout(policy.as_ref(), self.backend.as_ref(), &task, attempt);
        match tokio::time::timeout(self.timeout, fut).await {
            Ok(t) => t,
            Err(_) => infra(
                &task,
                attempt,
                &policy.name(),
                format!("rollout ran past {} s", self.timeout.as_secs_f64()),
            ),
        }
    }

    /// `attempts` rollouts of one task, concurrently.
    async fn group(
        &self,
        policy: Arc<dyn Policy>,
        task: Arc<Task>,
        attempts: usize,
    ) -> Vec<Trajectory> {
        let futs = (0..attempts).map(|a| self.one(policy.clone(), task.clone(), a));
        futures_util::future::join_all(futs).await
    }
}

/// A trajectory for a rollout that never ran or was abandoned.
fn infra(task: &Task, attempt: usize, policy: &str, why: String) -> Trajectory {
    Trajectory::unstarted(&task.instance_id, attempt, policy, &why)
}

/// The dispatcher: starts groups while admission allows.
async fn dispatch(
    shared: Arc<Shared>,
    rollouts: Arc<Rollouts>,
    policy: Arc<dyn Policy>,
    tasks: Arc<Vec<Arc<Task>>>,
    recipe: Arc<Recipe>,
    groups: mpsc::Sender<Group>,
) {
    let b = recipe.groups_per_step as u64;
    let mut workers = tokio::task::JoinSet::new();
    loop {
        if shared.stop.load(Ordering::Acquire) {
            break;
        }
        let started = shared.groups_started.load(Ordering::Acquire);
        let done = shared.steps_done.load(Ordering::Acquire);
        let allowed =
            (done + recipe.max_staleness + 1) * b + shared.extra_groups.load(Ordering::Acquire);
        let next = if started < allowed {
            shared
                .pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .next_task()
        } else {
            None
        };
        let Some(task) = next else {
            // Admission closed or every task retired: wait for an update.
            let _ = tokio::time::timeout(Duration::from_millis(500), shared.wake.notified()).await;
            continue;
        };
        let seq = shared.groups_started.fetch_add(1, Ordering::AcqRel);
        let (shared2, rollouts2, policy2, tx) = (
            shared.clone(),
            rollouts.clone(),
            policy.clone(),
            groups.clone(),
        );
        let t = tasks[task].clone();
        let g = recipe.group_size;
        workers.spawn(async move {
            let trajectories = rollouts2.group(policy2, t, g).await;
            shared2
                .rollouts_done
                .fetch_add(trajectories.len() as u64, Ordering::Relaxed);
            let _ = tx.send(Group {
                task,
                seq,
                trajectories,
            });
        });
        // Reap finished workers so the set does not grow.
        while workers.try_join_next().is_some() {}
    }
    // Stopping: the engines are shut down by the trainer, so every worker
    // ends soon (aborted generations are policy errors, sandboxes close).
    let _ = tokio::time::timeout(Duration::from_secs(120), async {
        while workers.join_next().await.is_some() {}
    })
    .await;
    workers.abort_all();
}

/// pass@1 and per-task mean rewards of `tasks` under a frozen copy of the
/// weights (an engine of its own; never trained on).
async fn frozen_scores(
    model: Qwen3_5,
    version: u64,
    tokenizer: Arc<Tokenizer>,
    engine: EngineConfig,
    rollouts: Arc<Rollouts>,
    tasks: Vec<Arc<Task>>,
    attempts: usize,
) -> Result<Vec<Option<f64>>> {
    let store = ParamStore::with_version(model, version);
    let router = Router::start(1, store, Some(tokenizer), engine)?;
    let policy: Arc<dyn Policy> = Arc::new(EnginePolicy::new(router.clone(), "frozen"));
    let futs = tasks
        .into_iter()
        .map(|t| rollouts.group(policy.clone(), t, attempts));
    let groups = futures_util::future::join_all(futs).await;
    router.shutdown();
    Ok(groups
        .iter()
        .map(|g| {
            let graded: Vec<f64> = g.iter().filter(|t| !t.masked).map(|t| t.reward).collect();
            (!graded.is_empty()).then(|| graded.iter().sum::<f64>() / graded.len() as f64)
        })
        .collect())
}

/// Mean over tasks with a score.
fn mean_of(scores: &[Option<f64>]) -> Option<f64> {
    let v: Vec<f64> = scores.iter().flatten().copied().collect();
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// The standard error of [`mean_of`] from the attempts' sampling: each
/// task's score is the mean of `attempts` draws in [0, 1], whose variance
/// p(1 - p) / attempts is estimated without bias as
/// p̂(1 - p̂) / (attempts - 1) (for pass/fail draws; an upper bound for
/// others). None under 2 attempts or without a scored task.
fn sampling_std_error(scores: &[Option<f64>], attempts: usize) -> Option<f64> {
    let v: Vec<f64> = scores.iter().flatten().copied().collect();
    if attempts < 2 || v.is_empty() {
        return None;
    }
    let var: f64 = v.iter().map(|p| p * (1.0 - p)).sum::<f64>() / (attempts - 1) as f64;
    Some(var.sqrt() / v.len() as f64)
}

/// A frozen evaluation or recheck in flight.
enum SideJob {
    Eval {
        step: u64,
        attempts: usize,
        scores: Result<Vec<Option<f64>>>,
    },
    Recheck {
        step: u64,
        tasks: Vec<usize>,
        scores: Result<Vec<Option<f64>>>,
    },
    Probe {
        step: u64,
        probe: Result<Probe>,
    },
}

/// The tasks of the recipe's `key` (`tasks` or `eval_tasks`) at `path`.
fn load_task_file(key: &str, path: &Path) -> Result<Vec<Arc<Task>>> {
    let tasks = load_tasks(path, Format::Auto)
        .map_err(|e| Error::Recipe(format!("{key} {}: {e}", path.display())))?;
    if tasks.is_empty() {
        return Err(Error::Recipe(format!("{key} {}: no tasks", path.display())));
    }
    Ok(tasks.into_iter().map(Arc::new).collect())
}

/// A trainer's micro-batch in a run of `recipe` holding `sequences`
/// trajectories: the micro-batch budget, at most all of them at the
/// engines' context, at least one.
fn trainer_shape(recipe: &Recipe, sequences: usize) -> PlanShape {
    let context = recipe.engine_config().max_model_len;
    let trajectories = recipe.group_size * recipe.groups_per_step;
    PlanShape {
        tokens: recipe
            .micro_batch_tokens
            .min(trajectories * context)
            .max(context),
        sequences,
        recompute_layers: false,
    }
}

/// What a run of `recipe` holds: the trainer at its micro-batch budget
/// (trajectories of at most the engines' context) on every rank, the
/// replicas' caches,
/// and the frozen evaluation engine when evaluations or rechecks run.
pub fn memory_plan(recipe: &Recipe, config: &ModelConfig) -> MemoryPlan {
    let engine = recipe.engine_config();
    let trajectories = recipe.group_size * recipe.groups_per_step;
    let mut plan = MemoryPlan::training(config, trainer_shape(recipe, trajectories));
    if recipe.ranks > 1 {
        // Every rank holds all of it for its own copy and share.
        for (what, bytes) in &mut plan.items {
            *what = format!("{what}, x {} ranks", recipe.ranks);
            *bytes *= recipe.ranks as u64;
        }
    }
    if recipe.ref_kl_coef != 0.0 {
        let params = Qwen3_5::plan(config.clone()).parameters();
        plan.add(
            format!(
                "KL reference weights, f32{}",
                if recipe.ranks > 1 {
                    ", one copy per rank"
                } else {
                    ""
                }
            ),
            params * 4 * recipe.ranks as u64,
        );
    }
    plan.add_engines(config, recipe.replicas, engine.cache_memory, true);
    plan
}

/// What one rank's GPU holds in a run with `device = "cuda..."`: the device
/// trainer (the engines' bf16 weights, f32 masters, moments, gradients,
/// activations), the KL reference in f32, and the rank's engines' caches
/// (the engines read the trainer's bf16 copy from their start: the step
/// devices are made first).
pub fn gpu_memory_plan(recipe: &Recipe, config: &ModelConfig) -> MemoryPlan {
    let engine = recipe.engine_config();
    let trajectories = recipe.group_size * recipe.groups_per_step;
    let mut plan = MemoryPlan::training_on(
        config,
        trainer_shape(recipe, trajectories.div_ceil(recipe.ranks.max(1))),
        crate::memory::Placement::Gpu,
    );
    let params = Qwen3_5::plan(config.clone()).parameters();
    if recipe.ref_kl_coef != 0.0 {
        plan.add("KL reference weights, f32", params * 4);
    }
    let replicas = recipe.replicas.div_ceil(recipe.ranks.max(1)) as u64;
    plan.add(
        format!("engine caches ({replicas} x {})", engine.cache_memory >> 20),
        replicas * engine.cache_memory as u64,
    );
    plan.add(
        format!(
            "engine steps' working memory ({replicas} x {} tokens)",
            engine.max_batched_tokens
        ),
        replicas * engine.step_scratch_bytes(config) as u64,
    );
    plan
}

/// Bytes free on `device` now (a GPU; the host's for the CPU).
#[cfg(feature = "cuda")]
fn free_device_memory(device: arcticd_kernels::Device) -> Result<u64> {
    match device {
        arcticd_kernels::Device::Cuda(i) => {
            let dev = arcticd_kernels::cuda::device::CudaDevice::new(i)?;
            Ok(dev.memory_info()?.0 as u64)
        }
        arcticd_kernels::Device::Cpu => Ok(host_memory_available().unwrap_or(u64::MAX)),
    }
}

#[cfg(not(feature = "cuda"))]
fn free_device_memory(device: arcticd_kernels::Device) -> Result<u64> {
    device.check_available()?;
    Ok(host_memory_available().unwrap_or(u64::MAX))
}

/// Runs (or resumes) a training run to its last update.
pub fn run(recipe: Recipe, mut opts: RunOptions) -> Result<RunSummary> {
    let run_dir = RunDir::new(&opts.out);
    let recipe = Arc::new(recipe.checked()?);
    let model_dir = recipe
        .model
        .clone()
        .ok_or_else(|| Error::Recipe("no model: set model = \"DIR\"".into()))?;
    let tasks_path = recipe
        .tasks
        .clone()
        .ok_or_else(|| Error::Recipe("no tasks: set tasks = \"FILE\"".into()))?;
    // Everything that can be wrong with the inputs fails here, before a
    // single rollout starts.
    for rank in 0..recipe.ranks {
        let d = rank_device(recipe.device, rank);
        d.check_available().map_err(|e| {
            Error::Recipe(format!("device = \"{}\", rank {rank}: {e}", recipe.device))
        })?;
    }
    let tasks = Arc::new(load_task_file("tasks", &tasks_path)?);
    let eval_tasks = match &recipe.eval_tasks {
        Some(p) => load_task_file("eval_tasks", p)?,
        None => Vec::new(),
    };
    let tokenizer = Arc::new(
        Tokenizer::from_dir(&model_dir)
            .map_err(|e| Error::Recipe(format!("model {}: {e}", model_dir.display())))?,
    );
    let template = ChatTemplate::from_dir(&model_dir)?.unwrap_or_else(ChatTemplate::qwen35);
    let harness = Arc::new(Harness::new(
        tokenizer.clone(),
        template,
        recipe.rollout.clone(),
    )?);

    // Fresh run or resume, the directory held by this process throughout.
    let _held;
    let mut state = if opts.resume {
        if run_dir.recipe().is_file() {
            _held = run_dir.lock()?;
        }
        let ids: Vec<&str> = tasks.iter().map(|t| t.instance_id.as_str()).collect();
        resume_state(&run_dir, &recipe, &ids)?
    } else {
        run_dir.check_new()?;
        std::fs::create_dir_all(&run_dir.root).map_err(|e| Error::io(&run_dir.root, e))?;
        _held = run_dir.lock()?;
        run_dir.create()?;
        std::fs::write(run_dir.recipe(), recipe.to_toml()?)
            .map_err(|e| Error::io(run_dir.recipe(), e))?;
        None
    };
    let (weights_dir, start) = match &state {
        Some((dir, s, _)) => (dir.clone(), Some(s.clone())),
        None => (model_dir.clone(), None),
    };
    let model_config = ModelConfig::from_dir(&weights_dir)
        .map_err(|e| Error::Recipe(format!("model {}: {e}", weights_dir.display())))?;
    let plan = memory_plan(&recipe, &model_config);
    tracing::info!("memory plan:\n{plan}");
    const FIX: &str = "lower micro_batch_tokens, turn on recompute_layers, or give the engines \
                       less cache (recipe keys; --set KEY=VALUE changes one)";
    if recipe.device == arcticd_kernels::Device::Cpu {
        plan.check(host_memory_available(), FIX)?;
    } else {
        let gpu = gpu_memory_plan(&recipe, &model_config);
        tracing::info!("memory plan of each rank's GPU:\n{gpu}");
        for rank in 0..recipe.ranks {
            let device = rank_device(recipe.device, rank);
            gpu.check(Some(free_device_memory(device)?), FIX)?;
        }
    }
    let model = Qwen3_5::load(&weights_dir)
        .map_err(|e| Error::Recipe(format!("model {}: {e}", weights_dir.display())))?;
    let version0 = start.as_ref().map_or(0, |s| s.weight_version);
    // One copy of the weights per trainer rank; rank 0's is `store`.
    let stores: Vec<Arc<ParamStore>> = (1..recipe.ranks)
        .map(|_| ParamStore::with_version(model.clone(), version0))
        .collect();
    let store = ParamStore::with_version(model, version0);
    let stores: Vec<Arc<ParamStore>> = std::iter::once(store.clone()).chain(stores).collect();
    // The step devices first: a GPU rank's trainer publishes the weight
    // copy its engines then read from their start, with no upload of their own.
    let config = recipe.train_config();
    let reference = || -> crate::Result<Option<Qwen3_5>> {
        if recipe.ref_kl_coef == 0.0 {
            return Ok(None);
        }
        // The run's starting model, also on resume.
        Ok(Some(Qwen3_5::load(&model_dir).map_err(|e| {
            Error::Recipe(format!("KL reference {}: {e}", model_dir.display()))
        })?))
    };
    let devices: Vec<_> = (0..stores.len())
        .map(|rank| rank_device(recipe.device, rank))
        .collect();
    let step_devs = step_devices(
        &devices,
        &stores,
        config.optimizer,
        reference,
        recipe.batch_invariant,
    )?;
    let engine_cfg = recipe.engine_config();
    let router = Router::new(
        (0..recipe.replicas)
            .map(|r| {
                engine::start(
                    stores[r % stores.len()].clone(),
                    Some(tokenizer.clone()),
                    EngineConfig {
                        device: rank_device(recipe.device, r % stores.len()),
                        ..engine_cfg.clone()
                    },
                )
            })
            .collect::<std::result::Result<Vec<_>, _>>()?,
    )?;
    // Rollouts end at the engines' context when it is shorter than the
    // recipe's budget (see `Policy::context_limit`): said, not silent.
    if let Some(info) = router.replicas().first().map(|r| r.info()) {
        let (limit, bound) = info.context_limit();
        let budget = recipe.rollout.max_context_tokens;
        if budget == 0 || limit < budget {
            tracing::warn!(
                "rollouts end at {limit} tokens of context ({}), not at rollout.max_context_tokens \
                 = {budget}",
                bound.unwrap_or("the engines' max_model_len")
            );
        }
    }
    let mut comms: Vec<Option<Arc<dyn Communicator>>> = if recipe.ranks > 1 {
        LocalComm::world(recipe.ranks)?
            .into_iter()
            .map(|c| Some(Arc::new(c) as Arc<dyn Communicator>))
            .collect()
    } else {
        vec![None]
    };
    let mut trainers = Vec::with_capacity(stores.len());
    for (rank, (dev, comm)) in step_devs.into_iter().zip(comms.iter_mut()).enumerate() {
        let mut t = Trainer::on(dev, config.clone());
        if start.is_some() {
            t.load_optimizer(&weights_dir)?;
        }
        t.gate = Some(Arc::new(RouterGate {
            router: router.clone(),
            replicas: (rank..recipe.replicas).step_by(stores.len()).collect(),
        }));
        if let Some(c) = comm.take() {
            t = t.with_comm(c);
        }
        trainers.push(t);
    }
    let mut trainer = trainers.remove(0);
    let ranks = Ranks::start(trainers)?;

    let mut pool = TaskPool::new(
        tasks.iter().map(|t| t.instance_id.clone()).collect(),
        recipe.seed,
        recipe.retire_after,
        recipe.drop_after,
    );
    let mut totals = Totals::default();
    let (mut step, mut consumed, mut elapsed0) = (0u64, 0u64, 0.0);
    let mut lost_now = 0u64;
    let mut grades_mark = (0, 0);
    // Tokens per replica at the previous update: `replica_tokens` is the
    // work each replica did in between.
    let mut tokens_before = router.generated_tokens();
    if let Some((_, s, lost)) = state.take() {
        // resume_state checked the pool against the task file.
        pool.state = s.pool;
        totals = s.totals;
        totals.lost_on_resume += lost;
        lost_now = lost;
        step = s.step;
        consumed = s.groups_consumed;
        elapsed0 = s.elapsed_s;
        if step >= recipe.steps {
            tracing::warn!(
                "the run is at update {step} and its recipe asks for {} (steps): nothing to \
                 train; raise steps in {} to go on",
                recipe.steps,
                run_dir.recipe().display()
            );
        }
    }

    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(|e| Error::io("building the tokio runtime", e))?;
    let backend: Arc<dyn Backend> = rt.block_on(async {
        let b: Result<Arc<dyn Backend>> = match recipe.backend {
            SandboxBackend::Local => {
                Ok(Arc::new(arcticd_sandbox::local::LocalBackend::new().await?))
            }
            SandboxBackend::Docker => Ok(Arc::new(
                arcticd_sandbox::docker::DockerBackend::new().await?,
            )),
        };
        b
    })?;
    let rollouts = Arc::new(Rollouts {
        harness,
        backend,
        permits: Arc::new(Semaphore::new(recipe.concurrency)),
        timeout: Duration::from_secs_f64(recipe.rollout_timeout_secs),
    });
    let shared = Arc::new(Shared {
        steps_done: AtomicU64::new(step),
        // Admission restored: what was in flight died with the old process.
        groups_started: AtomicU64::new(consumed),
        extra_groups: AtomicU64::new(consumed.saturating_sub(step * recipe.groups_per_step as u64)),
        stop: AtomicBool::new(false),
        wake: Notify::new(),
        pool: Mutex::new(pool),
        rollouts_done: AtomicU64::new(0),
    });
    let policy: Arc<dyn Policy> =
        Arc::new(EnginePolicy::new(router.clone(), "arcticd").with_routing(recipe.routing));
    let (group_tx, group_rx) = mpsc::channel::<Group>();
    let dispatcher = rt.spawn(dispatch(
        shared.clone(),
        rollouts.clone(),
        policy,
        tasks.clone(),
        recipe.clone(),
        group_tx,
    ));
    let _signals = crate::interrupt::watch(
        opts.cancel.clone(),
        crate::interrupt::Stops {
            command: "train",
            first: "finishing this update, then checkpoint and stop",
            kept: "--resume continues from the last complete checkpoint",
        },
    )?;

    let (side_tx, side_rx) = mpsc::channel::<SideJob>();
    let mut side_pending = 0usize;
    // The evaluations before the first update and after the last take
    // `eval_end_attempts` (the run's held-out change is theirs).
    let spawn_eval = |at: u64, end: bool, pending: &mut usize| {
        let k = match recipe.eval_end_attempts {
            n if end && n > 0 => n,
            _ => recipe.eval_attempts,
        };
        if eval_tasks.is_empty() || k == 0 {
            return;
        }
        let (m, v) = (store.read().clone(), store.weight_version());
        let (tok, ecfg, ro, tx) = (
            tokenizer.clone(),
            engine_cfg.clone(),
            rollouts.clone(),
            side_tx.clone(),
        );
        let ts = eval_tasks.clone();
        *pending += 1;
        rt.spawn(async move {
            let scores = frozen_scores(m, v, tok, ecfg, ro, ts, k).await;
            let _ = tx.send(SideJob::Eval {
                step: at,
                attempts: k,
                scores,
            });
        });
    };

    let t_start = Instant::now();
    let elapsed = |t: &Instant| elapsed0 + t.elapsed().as_secs_f64();
    let mut first: Option<Value> = None;
    let mut last: Option<Value> = None;
    let mut evals: Vec<(u64, f64)> = Vec::new();
    let mut cancelled = false;
    let mut stopped: Option<String> = None;
    let mut dead = DeadStreak::new(recipe.stop_after_dead_updates);
    // Rollbacks: groups sampled below `floor` (before the last rollback)
    // are discarded; `history` holds each update's pass rate and whether
    // it was dead, `tried` the last rollback's checkpoint until an update
    // lives again.
    let rollbacks_on = recipe.rollback_after_dead_updates > 0 && recipe.max_rollbacks > 0;
    let (mut floor, mut history, mut tried) = (0u64, History::new(), None::<u64>);
    let (mut discarded_now, mut no_target_said) = (0u64, false);
    if step > 0 {
        // Resumed: where the kept updates left the streak and the rollbacks.
        let text = std::fs::read_to_string(run_dir.metrics())
            .map_err(|e| Error::io(run_dir.metrics(), e))?;
        let records: Vec<Value> = text
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        let (h, t, run) = rollback_memory(&records);
        (history, tried, dead.run) = (h, t, run);
    }
    let (first_step, mut last_termination) = (step, Default::default());
    let mut carry: Vec<Group> = Vec::new();
    let b = recipe.groups_per_step;
    let mut rollouts_mark = (0u64, Instant::now());
    if step == 0 && recipe.eval_every > 0 {
        spawn_eval(0, true, &mut side_pending);
    }
    let saver = Saver {
        run_dir: &run_dir,
        recipe: &recipe,
        model_dir: &model_dir,
        shared: &shared,
    };
    let result: Result<()> = (|| {
        while step < recipe.steps {
            // Wait for B complete groups.
            let t_wait = Instant::now();
            if step > 0 {
                fault_point("rollouts");
            }
            let deadline = t_wait + Duration::from_secs_f64(recipe.batch_timeout_secs);
            // Enough groups: B of them, or with dynamic sampling B that
            // carry signal (at most dynamic_max_groups in all).
            let enough = |carry: &[Group]| {
                if !recipe.dynamic_sampling {
                    return carry.len() >= b;
                }
                carry.len() >= recipe.dynamic_max_groups.max(b)
                    || carry.iter().filter(|g| informative(g)).count() >= b
            };
            while !enough(&carry) {
                if opts.cancel.load(Ordering::Acquire) {
                    cancelled = true;
                    return Ok(());
                }
                match group_rx.recv_timeout(Duration::from_millis(250)) {
                    Ok(g) if !sampled_since(&g, floor) => {
                        // Sampled before a rollback: admission starts
                        // another in its place.
                        consumed += 1;
                        shared.extra_groups.fetch_add(1, Ordering::AcqRel);
                        totals.rollback_discarded += 1;
                        discarded_now += 1;
                    }
                    Ok(g) => carry.push(g),
                    Err(mpsc::RecvTimeoutError::Timeout) => {
                        if Instant::now() > deadline {
                            return Err(Error::Run(format!(
                                "no batch after {} s (batch_timeout_secs): {} of {b} groups came",
                                recipe.batch_timeout_secs,
                                carry.len()
                            )));
                        }
                        let pool = shared.pool.lock().unwrap_or_else(|e| e.into_inner());
                        if pool.active() == 0
                            && shared.groups_started.load(Ordering::Acquire)
                                == consumed + carry.len() as u64
                        {
                            let why = "every task is retired (mastered or hopeless)";
                            tracing::warn!("stopping at update {step}: {why}");
                            stopped = Some(why.to_string());
                            return Ok(());
                        }
                    }
                    Err(mpsc::RecvTimeoutError::Disconnected) => {
                        return Err(Error::Run("the rollout dispatcher stopped".into()))
                    }
                }
            }
            let take = if recipe.dynamic_sampling {
                // Up to and including the B-th informative group.
                let mut seen = 0;
                carry
                    .iter()
                    .position(|g| {
                        seen += usize::from(informative(g));
                        seen == b
                    })
                    .map_or(carry.len(), |i| i + 1)
            } else {
                b
            };
            let groups: Vec<Group> = carry.drain(..take).collect();
            let extra_groups = groups.len().saturating_sub(b);
            let time_wait_s = t_wait.elapsed().as_secs_f64();
            consumed += groups.len() as u64;
            if extra_groups > 0 {
                shared
                    .extra_groups
                    .fetch_add(extra_groups as u64, Ordering::AcqRel);
                totals.extra_groups += extra_groups as u64;
            }
            // Curriculum: one visit per group.
            let mut newly_retired = 0usize;
            {
                let mut pool = shared.pool.lock().unwrap_or_else(|e| e.into_inner());
                for g in &groups {
                    let graded: Vec<&Trajectory> =
                        g.trajectories.iter().filter(|t| !t.masked).collect();
                    let solved = graded.iter().filter(|t| t.reward >= 1.0).count();
                    if pool
                        .record(g.task, solved, graded.len(), step + 1)
                        .is_some()
                    {
                        newly_retired += 1;
                    }
                }
            }
            // A prompt for the identity probe, from any consumed group (the
            // batch may train nothing when every group is zero-variance).
            let probe_prompt = groups
                .iter()
                .flat_map(|g| &g.trajectories)
                .find_map(|t| probe::prompt_of(&t.token_ids, &t.loss_mask));
            let version = store.weight_version();
            let batch = batch::plan(
                groups,
                PlanConfig {
                    trainer_version: version,
                    max_staleness: recipe.max_staleness,
                    stale: recipe.stale,
                    filter_zero_variance: recipe.filter_zero_variance,
                    advantage_std: recipe.advantage_std,
                    overlong: recipe.overlong,
                    length_penalty: recipe.length_penalty,
                },
            );
            let t_train = Instant::now();
            let sm = if batch.examples.is_empty() {
                totals.skipped_updates += 1;
                None
            } else {
                Some(ranks.pg_step(&mut trainer, &batch.examples)?)
            };
            if sm.as_ref().is_some_and(|m| m.skipped) {
                // A non-finite loss or gradient: weights untouched, counted.
                totals.skipped_updates += 1;
            }
            let train_total = t_train.elapsed().as_secs_f64();
            let trained = sm.as_ref().is_some_and(|m| !m.skipped);
            let time_update_s = sm.as_ref().map_or(0.0, |m| m.update_secs);
            step += 1;
            shared.steps_done.store(step, Ordering::Release);
            shared.wake.notify_waiters();

            // Records of what this update consumed.
            #[derive(Serialize)]
            struct Trained<'a> {
                step: u64,
                advantage: f32,
                #[serde(flatten)]
                t: &'a Trajectory,
            }
            #[derive(Serialize)]
            struct Dropped<'a> {
                step: u64,
                why: &'a str,
                #[serde(flatten)]
                t: &'a Trajectory,
            }
            write_jsonl(
                &run_dir.step_trajectories(step),
                batch.trained.iter().map(|(t, a)| Trained {
                    step,
                    advantage: *a,
                    t,
                }),
            )?;
            for (t, why) in &batch.dropped {
                append_jsonl(&run_dir.dropped(), &Dropped { step, why, t })?;
            }
            let s = &batch.stats;
            let (pass_rate, termination) = (s.pass_rate, s.termination.clone());
            let first_masked = batch
                .dropped
                .iter()
                .find(|(t, _)| t.masked || t.termination.masked())
                .map(|(_, why)| why.clone());
            totals.rollouts += s.trajectories as u64;
            // Dead updates in a row: roll back when the run had lived since
            // a checkpoint, else (or past max_rollbacks) stop at the limit.
            let faulted = fault_dead(step);
            if faulted {
                tracing::warn!(
                    "update {step} counts as dead whatever it did: ARCTICD_FAULT_DEAD (a test \
                     hook) is set"
                );
            }
            let mut stop_why = dead.after(
                trained && !faulted,
                if faulted { 0.0 } else { pass_rate },
                &termination,
                first_masked.as_deref(),
            );
            let was_dead = dead.len() > 0;
            history.insert(step, (pass_rate, was_dead));
            if !was_dead {
                (tried, no_target_said) = (None, false);
            }
            let mut rolled = None;
            if rollbacks_on
                && dead.len() >= recipe.rollback_after_dead_updates
                && totals.rollbacks < recipe.max_rollbacks
            {
                let start = step + 1 - dead.len();
                let target = collapse_target(
                    (&run_dir, &model_dir),
                    start,
                    &history,
                    tried,
                    recipe.max_staleness,
                )?;
                match target {
                    Some((at, point)) => {
                        tracing::warn!(
                            "update {step}: the last {} updates solved nothing and trained \
                             nothing ({}); rolling back to {} ({}), rollback {} of at most {}",
                            dead.len(),
                            dead.why(&termination),
                            point_name(at, &point),
                            match point {
                                RestorePoint::Start(_) => "its weights, a fresh optimizer",
                                RestorePoint::Checkpoint(_) => "weights and optimizer state",
                            },
                            totals.rollbacks + 1,
                            recipe.max_rollbacks
                        );
                        floor = ranks.restore(&mut trainer, &point)?;
                        (tried, stop_why) = (Some(at), None);
                        totals.rollbacks += 1;
                        dead.reset();
                        let n = carry.len() as u64;
                        carry.clear();
                        consumed += n;
                        shared.extra_groups.fetch_add(n, Ordering::AcqRel);
                        totals.rollback_discarded += n;
                        discarded_now += n;
                        rolled = Some((at, floor));
                    }
                    None if !no_target_said => {
                        no_target_said = true;
                        tracing::warn!(
                            "update {step}: the last {} updates solved nothing and trained \
                             nothing, and no checkpoint (nor the model the run started from) is \
                             old enough and healthy to roll back to (one written before update \
                             {} and before the last live update {}, whose next {} updates passed \
                             at least half the run's mean)",
                            dead.len(),
                            start.saturating_sub(recipe.max_staleness + 1),
                            history
                                .range(..start)
                                .rev()
                                .find(|(_, u)| !u.1)
                                .map_or("(none)".into(), |(s, _)| s.to_string()),
                            recipe.max_staleness + 1
                        );
                    }
                    None => {}
                }
            }
            totals.stale_dropped += s.stale_dropped as u64;
            totals.masked_infra += s.masked_infra as u64;
            totals.zero_variance_groups += s.zero_variance_groups as u64;

            // The metrics record.
            let now = elapsed(&t_start);
            let done_rollouts = shared.rollouts_done.load(Ordering::Relaxed);
            let dt = rollouts_mark.1.elapsed().as_secs_f64().max(1e-9);
            let rollouts_per_s = (done_rollouts - rollouts_mark.0) as f64 / dt;
            rollouts_mark = (done_rollouts, Instant::now());
            let (mastered, hopeless) = shared
                .pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .retired_counts();
            let mut rec = Map::new();
            let mut put = |k: &str, v: Value| {
                rec.insert(k.to_string(), v);
            };
            put("step", json!(step));
            put("weight_version", json!(store.weight_version()));
            put("elapsed_s", json!(now));
            put("reward_mean", json!(s.reward_mean));
            put("pass_rate", json!(s.pass_rate));
            put("groups", json!(s.groups));
            put("trajectories", json!(s.trajectories));
            put("trained_trajectories", json!(s.trained));
            put("zero_variance_groups", json!(s.zero_variance_groups));
            put("extra_groups", json!(extra_groups));
            put("overlong_masked", json!(s.overlong_masked));
            put("stale_dropped", json!(s.stale_dropped));
            put("stale_masked_tokens", json!(s.stale_masked_tokens));
            put("masked_infra", json!(s.masked_infra));
            put("termination", json!(s.termination));
            put("staleness_mean", json!(s.staleness_mean));
            put("staleness_max", json!(s.staleness_max));
            put("lag_histogram", json!(s.lag_histogram));
            let mm = sm.as_ref().and_then(|m| m.mismatch.clone());
            put(
                "mismatch_same_version_mean",
                json!(mm.as_ref().map(|m| m.same_version_mean)),
            );
            put(
                "mismatch_same_version_max",
                json!(mm.as_ref().map(|m| m.same_version_max)),
            );
            put(
                "mismatch_same_version_tokens",
                json!(mm.as_ref().map(|m| m.same_version_tokens)),
            );
            put(
                "lag_divergence_mean",
                json!(mm.as_ref().map(|m| m.lag_mean)),
            );
            put("lag_divergence_max", json!(mm.as_ref().map(|m| m.lag_max)));
            put("lag_tokens", json!(mm.as_ref().map(|m| m.lag_tokens)));
            let pg = sm.as_ref().and_then(|m| m.pg.clone());
            put("loss", json!(sm.as_ref().map(|m| m.loss)));
            put("grad_norm", json!(sm.as_ref().map(|m| m.grad_norm)));
            put(
                "clip_fraction",
                json!(pg.as_ref().map(|p| p.clipped_fraction)),
            );
            put("tail_masked", json!(pg.as_ref().map(|p| p.tail_masked)));
            if recipe.kl_coef != 0.0 {
                put("kl_behaviour", json!(pg.as_ref().map(|p| p.kl)));
            }
            if recipe.ref_kl_coef != 0.0 {
                put("kl_reference", json!(pg.as_ref().map(|p| p.ref_kl)));
            }
            put("lr", json!(trainer.lr()));
            put(
                "weights_checksum",
                json!(sm
                    .as_ref()
                    .and_then(|m| m.weights_checksum)
                    .map(|c| format!("{c:016x}"))),
            );
            put("tokens", json!(s.trained_tokens));
            put("tokens_run", json!(sm.as_ref().map(|m| m.tokens_run)));
            put(
                "update_skipped",
                json!(sm.as_ref().is_none_or(|m| m.skipped)),
            );
            put("time_wait_s", json!(time_wait_s));
            put("time_train_s", json!(train_total - time_update_s));
            put("time_update_s", json!(time_update_s));
            put("rollouts_per_s", json!(rollouts_per_s));
            // Pitfall of long runs: a buffer that grows until the process
            // runs out of memory. Logged so the plot shows it rising.
            let mib = |b: u64| (b as f64 / (1u64 << 20) as f64 * 10.0).round() / 10.0;
            let resident = crate::memory::process_resident();
            put("rss_mib", json!(resident.map(|r| mib(r.0))));
            put("rss_peak_mib", json!(resident.map(|r| mib(r.1))));
            // Beside it, what live allocations hold and what the allocator
            // keeps free: which of the two a rise in the resident set is.
            let heap = crate::memory::heap_usage();
            put("heap_live_mib", json!(heap.map(|h| mib(h.0))));
            put("heap_free_mib", json!(heap.map(|h| mib(h.1))));
            // Grades since the previous update: reused from the grade cache,
            // or run in a sandbox (evaluations included).
            let grades_now = rollouts.harness.grade_cache_counts();
            put("grades_cached", json!(grades_now.0 - grades_mark.0));
            put("grades_run", json!(grades_now.1 - grades_mark.1));
            grades_mark = grades_now;
            put("replica_load", json!(router.loads()));
            let tokens_now = router.generated_tokens();
            let per_replica: Vec<u64> = tokens_now
                .iter()
                .zip(&tokens_before)
                .map(|(now, before)| now.saturating_sub(*before))
                .collect();
            tokens_before = tokens_now;
            put("replica_tokens", json!(per_replica));
            put("retired", json!(mastered + hopeless));
            put("retired_mastered", json!(mastered));
            put("retired_hopeless", json!(hopeless));
            put("newly_retired", json!(newly_retired));
            if lost_now > 0 {
                put("lost_on_resume", json!(lost_now));
                lost_now = 0;
            }
            put("dead", json!(was_dead));
            if let Some((at, version)) = rolled {
                put("rolled_back_to", json!(at));
                put("rollback_version", json!(version));
            }
            if discarded_now > 0 {
                put("rollback_discarded", json!(discarded_now));
                discarded_now = 0;
            }

            // Frozen side jobs that finished, and the ones now due. They
            // copy the host's weights: a trainer on a GPU brings them up to
            // date first (its steps leave them on the device).
            let is_last = step >= recipe.steps;
            let due = |every: u64| every > 0 && step.is_multiple_of(every);
            let host_probe = recipe.device == arcticd_kernels::Device::Cpu;
            if due(recipe.eval_every)
                || (recipe.eval_every > 0 && is_last)
                || (host_probe && due(recipe.probe_every))
                || due(recipe.recheck_every)
            {
                trainer.sync_host()?;
            }
            if recipe.eval_every > 0 && (step % recipe.eval_every == 0 || is_last) {
                spawn_eval(step, is_last, &mut side_pending);
            }
            if let (true, Some(prompt)) = (
                recipe.probe_every > 0 && step % recipe.probe_every == 0,
                probe_prompt,
            ) {
                let (r, tx, at) = (router.clone(), side_tx.clone(), step);
                let (n, temp) = (recipe.probe_tokens, recipe.rollout.temperature);
                let seed = recipe.seed ^ step;
                let v = store.weight_version();
                side_pending += 1;
                if recipe.device == arcticd_kernels::Device::Cpu {
                    let m = store.read().clone();
                    rt.spawn(async move {
                        let probe = probe::run(r, m, v, prompt, n, temp, seed).await;
                        let _ = tx.send(SideJob::Probe { step: at, probe });
                    });
                } else {
                    // The device trainer scores the sample itself, now,
                    // while it still holds version v.
                    let probe = rt
                        .block_on(probe::sample(r, prompt.clone(), n, temp, seed))
                        .and_then(|choice| {
                            probe::score_by(v, &prompt, &choice, |seq, rows, targets| {
                                let (lps, _) = trainer.dev.forward(
                                    crate::device::MicroBatch {
                                        sequences: &[seq],
                                        rows,
                                        targets,
                                        groups: &[],
                                    },
                                    false,
                                    temp,
                                    crate::model::ForwardOptions::default(),
                                )?;
                                Ok(lps)
                            })
                        });
                    let _ = tx.send(SideJob::Probe { step: at, probe });
                }
            }
            if recipe.recheck_every > 0 && step % recipe.recheck_every == 0 {
                let retired = shared
                    .pool
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .retired();
                if !retired.is_empty() {
                    let (m, v) = (store.read().clone(), store.weight_version());
                    let (tok, ecfg, ro, tx) = (
                        tokenizer.clone(),
                        engine_cfg.clone(),
                        rollouts.clone(),
                        side_tx.clone(),
                    );
                    let ts: Vec<Arc<Task>> = retired.iter().map(|&i| tasks[i].clone()).collect();
                    let k = recipe.recheck_attempts;
                    side_pending += 1;
                    let at = step;
                    rt.spawn(async move {
                        let scores = frozen_scores(m, v, tok, ecfg, ro, ts, k).await;
                        let _ = tx.send(SideJob::Recheck {
                            step: at,
                            tasks: retired,
                            scores,
                        });
                    });
                }
            }
            // The last update waits for its evaluation, so the run ends
            // with the held-out score of its final weights.
            let wait_all = is_last && side_pending > 0;
            let t_side = Instant::now();
            while side_pending > 0 {
                // The final wait ends early on a stop signal.
                let job = if wait_all {
                    let deadline = t_side + Duration::from_secs_f64(recipe.batch_timeout_secs);
                    loop {
                        if opts.cancel.load(Ordering::Acquire) || Instant::now() > deadline {
                            break None;
                        }
                        match side_rx.recv_timeout(Duration::from_millis(250)) {
                            Ok(j) => break Some(j),
                            Err(mpsc::RecvTimeoutError::Timeout) => {}
                            Err(mpsc::RecvTimeoutError::Disconnected) => break None,
                        }
                    }
                } else {
                    side_rx.try_recv().ok()
                };
                let Some(job) = job else { break };
                side_pending -= 1;
                match job {
                    SideJob::Eval {
                        step: at,
                        attempts,
                        scores,
                    } => match scores {
                        Ok(sc) => {
                            let p = mean_of(&sc).unwrap_or(0.0);
                            let se = sampling_std_error(&sc, attempts);
                            evals.push((at, p));
                            rec.insert("eval_pass_at_1".into(), json!(p));
                            rec.insert("eval_at_step".into(), json!(at));
                            if let Some(se) = se {
                                rec.insert("eval_std_error".into(), json!(se));
                            }
                            append_jsonl(
                                &run_dir.eval(),
                                &json!({"step": at, "pass_at_1": p, "std_error": se,
                                        "tasks": sc.len(), "attempts": attempts,
                                        "per_task": sc}),
                            )?;
                        }
                        Err(e) => tracing::warn!("evaluation at update {at} failed: {e}"),
                    },
                    SideJob::Recheck {
                        step: at,
                        tasks: which,
                        scores,
                    } => match scores {
                        Ok(sc) => {
                            let mut pool = shared.pool.lock().unwrap_or_else(|e| e.into_inner());
                            let mut back = 0;
                            for (&i, r) in which.iter().zip(&sc) {
                                if let Some(r) = r {
                                    back += usize::from(pool.recheck(
                                        i,
                                        *r,
                                        recipe.unretire_below,
                                        step,
                                    ));
                                }
                            }
                            rec.insert("recheck_reward".into(), json!(mean_of(&sc)));
                            rec.insert("recheck_at_step".into(), json!(at));
                            rec.insert("unretired".into(), json!(back));
                        }
                        Err(e) => tracing::warn!("recheck at update {at} failed: {e}"),
                    },
                    SideJob::Probe { step: at, probe } => match probe {
                        Ok(p) => {
                            rec.insert("probe_at_step".into(), json!(at));
                            rec.insert("probe_version".into(), json!(p.version));
                            rec.insert("probe_tokens".into(), json!(p.tokens));
                            rec.insert("probe_mismatch_mean".into(), json!(p.mean));
                            rec.insert("probe_mismatch_max".into(), json!(p.max));
                        }
                        Err(e) => tracing::warn!("identity probe after update {at} failed: {e}"),
                    },
                }
            }
            if wait_all {
                rec.insert(
                    "time_final_eval_s".into(),
                    json!(t_side.elapsed().as_secs_f64()),
                );
            }
            let rec = Value::Object(rec);
            append_jsonl(&run_dir.metrics(), &rec)?;
            if let Some(f) = opts.on_step.as_mut() {
                f(&rec);
            }
            if first.is_none() {
                first = Some(rec.clone());
            }
            last = Some(rec);

            if (recipe.checkpoint_every > 0 && step % recipe.checkpoint_every == 0) || is_last {
                saver.save(&mut trainer, step, consumed, elapsed(&t_start), &totals)?;
            }
            if opts.cancel.load(Ordering::Acquire) {
                cancelled = true;
                return Ok(());
            }
            if let Some(why) = stop_why {
                tracing::warn!("stopping at update {step}: {why}");
                stopped = Some(why);
                return Ok(());
            }
            last_termination = termination;
        }
        // A run that ended before its limit could fire, and trained nothing
        // in any update, failed all the same; so did one that ended in a
        // collapse it did not roll back from (its final weights are the
        // collapse's).
        if !cancelled {
            stopped = dead
                .whole_run(step - first_step, &last_termination)
                .or_else(|| {
                    let n = dead.len();
                    let collapse = recipe.rollback_after_dead_updates;
                    (collapse > 0 && n >= collapse).then(|| {
                        let back = collapse_target(
                            (&run_dir, &model_dir),
                            step + 1 - n,
                            &history,
                            tried,
                            recipe.max_staleness,
                        );
                        ended_collapsed(n, &dead.why(&last_termination), back.ok().flatten())
                    })
                });
        }
        Ok(())
    })();

    // Stop everything, whatever happened above.
    shared.stop.store(true, Ordering::Release);
    shared.wake.notify_waiters();
    let ended = result.and_then(|_| {
        if cancelled || stopped.is_some() {
            saver.save(&mut trainer, step, consumed, elapsed(&t_start), &totals)?;
            if let Some(why) = &stopped {
                record_failure(&run_dir, step, why)?;
            }
        }
        Ok(())
    });
    router.shutdown();
    let _ = rt.block_on(async { tokio::time::timeout(Duration::from_secs(150), dispatcher).await });
    rt.shutdown_timeout(Duration::from_secs(10));
    ended?;
    Ok(RunSummary {
        run_dir: opts.out.clone(),
        steps: step,
        weight_version: store.weight_version(),
        elapsed_s: elapsed(&t_start),
        cancelled,
        stopped,
        first,
        last,
        evals,
        held_out: std::fs::read_to_string(run_dir.eval())
            .ok()
            .and_then(|t| HeldOutChange::from_eval_log(&t)),
        totals,
    })
}

/// What a checkpoint is written from besides the trainer and the loop's
/// counts: the run directory, the recipe saved with it, the model's own
/// files, and the pool and dispatch state shared with the rollouts.
struct Saver<'a> {
    run_dir: &'a RunDir,
    recipe: &'a Recipe,
    model_dir: &'a Path,
    shared: &'a Shared,
}

impl Saver<'_> {
    /// Writes `checkpoints/step-N` with the run state (unless it is there
    /// already), and prunes old ones.
    fn save(
        &self,
        trainer: &mut RankTrainer,
        step: u64,
        consumed: u64,
        elapsed_s: f64,
        totals: &Totals,
    ) -> Result<()> {
        let Saver {
            run_dir,
            recipe,
            model_dir,
            shared,
        } = *self;
        let dir = run_dir.checkpoint(step);
        if dir.join("run_state.json").is_file() {
            return Ok(());
        }
        trainer.sync_host()?;
        let state = RunState {
            step,
            weight_version: trainer.store().weight_version(),
            pool: shared
                .pool
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .state
                .clone(),
            groups_consumed: consumed,
            groups_started: shared.groups_started.load(Ordering::Acquire),
            elapsed_s,
            totals: totals.clone(),
            failed: None,
        };
        let json = serde_json::to_vec_pretty(&state).map_err(|e| Error::Run(e.to_string()))?;
        let t0 = Instant::now();
        // Written under a hidden name, then renamed into place: a directory
        // named step-N with a run state is always complete.
        let partial = run_dir
            .checkpoints()
            .join(format!(".step-{step:06}.partial"));
        {
            let m = trainer.store().read();
            let saved = save_checkpoint_with(
                &partial,
                &m,
                model_dir,
                Some(&*trainer.optimizer()?),
                &[
                    ("run_state.json", json),
                    ("recipe.toml", recipe.to_toml()?.into_bytes()),
                ],
            );
            if let Err(e) = saved {
                // A full disk: free what the partial write took at once.
                let _ = std::fs::remove_dir_all(&partial);
                return Err(e);
            }
        }
        fault_point("checkpoint_write");
        std::fs::rename(&partial, &dir).map_err(|e| Error::io(&dir, e))?;
        tracing::info!(
            step,
            secs = t0.elapsed().as_secs_f64(),
            "checkpoint {}",
            dir.display()
        );
        run_dir.prune_checkpoints(match recipe.keep_checkpoints {
            Keep::Count(n) => Some(n),
            Keep::All(_) => None,
        })
    }
}

/// Marks checkpoint `step` as where the run failed, for `why`: a resume
/// with no updates left says so instead of finishing as a success.
fn record_failure(run_dir: &RunDir, step: u64, why: &str) -> Result<()> {
    let path = run_dir.checkpoint(step).join("run_state.json");
    let text = std::fs::read(&path).map_err(|e| Error::io(&path, e))?;
    let mut state: RunState = serde_json::from_slice(&text)
        .map_err(|e| Error::Run(format!("{}: {e}", path.display())))?;
    state.failed = Some(why.to_string());
    let json = serde_json::to_vec_pretty(&state).map_err(|e| Error::Run(e.to_string()))?;
    // Whole or not at all: written beside it, then renamed over it.
    let tmp = path.with_extension("json.partial");
    std::fs::write(&tmp, json).map_err(|e| Error::io(&tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io(&path, e))
}

/// For `--resume`: the checkpoint to continue from (None: from the start),
/// with the logs cut back to it; returns (weights dir, state, rollouts lost).
fn resume_state(
    run_dir: &RunDir,
    recipe: &Recipe,
    ids: &[&str],
) -> Result<Option<(PathBuf, RunState, u64)>> {
    if !run_dir.recipe().is_file() {
        return Err(Error::Run(format!(
            "{} is not a run directory (no recipe.toml)",
            run_dir.root.display()
        )));
    }
    run_dir.remove_partial_checkpoints()?;
    let latest = run_dir.latest_checkpoint()?;
    let step = latest.as_ref().map_or(0, |(_, s)| s.step);
    let removed = run_dir.cut_to(step)?;
    std::fs::create_dir_all(run_dir.trajectories())
        .map_err(|e| Error::io(run_dir.trajectories(), e))?;
    std::fs::create_dir_all(run_dir.checkpoints())
        .map_err(|e| Error::io(run_dir.checkpoints(), e))?;
    let cut_rollouts: u64 = removed
        .iter()
        .filter_map(|v| v.get("trajectories").and_then(Value::as_u64))
        .sum();
    let Some((dir, s)) = latest else {
        tracing::warn!(
            "no complete checkpoint in {}: the run starts over from its first update \
             ({} logged updates had no checkpoint and were discarded)",
            run_dir.root.display(),
            removed.len()
        );
        return Ok(None);
    };
    if s.pool.tasks.len() != ids.len() {
        return Err(Error::Run(format!(
            "{}: {} tasks in the checkpoint, {} in the task file",
            dir.display(),
            s.pool.tasks.len(),
            ids.len()
        )));
    }
    // The pool's records are by position: the same tasks in the same order.
    let moved: Vec<usize> = (0..ids.len())
        .filter(|&i| s.pool.tasks[i].id != ids[i])
        .collect();
    if let Some(&i) = moved.first() {
        return Err(Error::Run(format!(
            "{}: the task file changed since the run started: {} of {} tasks differ or \
             moved (task {i} is {:?} in the checkpoint, {:?} in the file); resume with the \
             task file the run started with",
            dir.display(),
            moved.len(),
            ids.len(),
            s.pool.tasks[i].id,
            ids[i]
        )));
    }
    // The recipe the checkpoint was made with (checkpoints of older
    // versions have none): a setting edited, or removed (so it takes its
    // default), in the run's recipe.toml since then is said, not silent.
    // A copy that no longer parses only loses that comparison: the
    // checkpoint itself is whole (its recipe is a record, not an input).
    if let Ok(earlier) = std::fs::read_to_string(dir.join("recipe.toml")) {
        match recipe.changes_from(&earlier) {
            Ok(changes) if !changes.is_empty() => tracing::warn!(
                "{} resumes with a recipe that differs from the one step {} was made with: {}",
                run_dir.root.display(),
                s.step,
                changes.join("; ")
            ),
            Ok(_) => {}
            Err(e) => tracing::warn!(
                "{}: cannot say whether the recipe changed since step {}: {e}",
                dir.join("recipe.toml").display(),
                s.step
            ),
        }
    }
    if let Some(why) = &s.failed {
        if s.step >= recipe.steps {
            return Err(Error::Run(format!(
                "{}: the run failed at its last update, {}: {why}; no update is left to \
                 resume (raise `steps` in {} to go on from it, or start a new run)",
                run_dir.root.display(),
                s.step,
                run_dir.recipe().display()
            )));
        }
        tracing::warn!(
            "the run stopped at update {} ({why}); resuming from there, with a fresh count \
             of dead updates",
            s.step
        );
    }
    let in_flight = s.groups_started.saturating_sub(s.groups_consumed) * recipe.group_size as u64;
    let lost = in_flight + cut_rollouts;
    tracing::warn!(
        step = s.step,
        lost_on_resume = lost,
        "resuming from {}",
        dir.display()
    );
    Ok(Some((dir, s, lost)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// pass@1's sampling error: tasks at 0 or 1 add none, a task at 1/2
    /// over 2 attempts adds a variance of 1/4.
    #[test]
    fn sampling_std_error_of_pass_at_1() {
        let sc = [Some(0.0), Some(0.5), Some(1.0), None];
        assert_eq!(sampling_std_error(&sc, 2), Some(0.25f64.sqrt() / 3.0));
        assert_eq!(sampling_std_error(&sc, 1), None);
        assert_eq!(sampling_std_error(&[None], 8), None);
        // 8 attempts: 3/8 solved, 5/8 solved.
        let sc = [Some(0.375), Some(0.625)];
        let want = (2.0 * 0.375 * 0.625 / 7.0f64).sqrt() / 2.0;
        assert!((sampling_std_error(&sc, 8).unwrap() - want).abs() < 1e-15);
    }

    /// The change is over the tasks scored both times, from the update-0
    /// record to the last; its standard error is that of the mean paired
    /// difference.
    #[test]
    fn held_out_change_pairs_the_first_and_last_evaluations() {
        let log = [
            r#"{"step":0,"pass_at_1":0.5,"tasks":4,"attempts":8,"per_task":[0.0,0.5,null,1.0]}"#,
            r#"{"step":10,"pass_at_1":0.1,"tasks":4,"attempts":2,"per_task":[0.0,0.0,0.0,0.5]}"#,
            r#"{"step":20,"pass_at_1":0.7,"tasks":4,"attempts":8,"per_task":[0.5,0.5,1.0,1.0]}"#,
            "torn",
        ]
        .join("\n");
        let h = HeldOutChange::from_eval_log(&log).unwrap();
        // Task 2 is unscored at update 0: the pairs are (0, .5), (.5, .5),
        // (1, 1); differences .5, 0, 0 (mean 1/6, sample variance 1/12).
        assert_eq!(
            (h.from_step, h.to_step, h.tasks, h.attempts),
            (0, 20, 3, (8, 8))
        );
        assert!(
            (h.from - 0.5).abs() < 1e-12 && (h.to - 2.0 / 3.0).abs() < 1e-12,
            "{h:?}"
        );
        assert!(
            (h.std_error - (1.0f64 / 36.0).sqrt()).abs() < 1e-12,
            "{h:?}"
        );
        // Without an update-0 record, a later one, or the same task list,
        // there is no change to report.
        let first = log.lines().next().unwrap();
        assert_eq!(HeldOutChange::from_eval_log(first), None);
        assert_eq!(
            HeldOutChange::from_eval_log(&log.replacen("\"step\":0", "\"step\":5", 1)),
            None
        );
        let other = format!("{first}\n{}", r#"{"step":9,"attempts":8,"per_task":[1.0]}"#);
        assert_eq!(HeldOutChange::from_eval_log(&other), None);
    }

    /// A rank's GPU plan: the device trainer's buffers, the rank's share of
    /// the engines' caches (no weights of their own: they read the
    /// trainer's copy), and the KL reference only when the loss has the
    /// term; two ranks each plan for half the replicas.
    #[test]
    fn a_gpu_plan_holds_a_ranks_share() {
        let config = arcticd_engine::init::preset_config(&arcticd_engine::init::TINY).unwrap();
        let one = Recipe::from_toml("device = \"cuda\"\nreplicas = 2\n", "r").unwrap();
        let plan = gpu_memory_plan(&one, &config);
        let names: Vec<&str> = plan.items.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.iter().any(|n| n.starts_with("engine caches (2 x")),
            "{plan}"
        );
        assert!(!names.iter().any(|n| n.contains("KL reference")), "{plan}");
        assert!(!names.iter().any(|n| n.contains("own")), "{plan}");
        // Each replica's step needs working memory beside its cache.
        let step = one.engine_config().step_scratch_bytes(&config) as u64;
        assert!(
            plan.items
                .iter()
                .any(|(n, b)| n.starts_with("engine steps' working memory (2 x") && *b == 2 * step),
            "{plan}"
        );
        let two = Recipe::from_toml(
            "device = \"cuda\"\nreplicas = 2\nranks = 2\nref_kl_coef = 0.1\n",
            "r",
        )
        .unwrap();
        let plan2 = gpu_memory_plan(&two, &config);
        let names: Vec<&str> = plan2.items.iter().map(|(n, _)| n.as_str()).collect();
        assert!(
            names.iter().any(|n| n.starts_with("engine caches (1 x")),
            "{plan2}"
        );
        assert!(names.iter().any(|n| n.contains("KL reference")), "{plan2}");
    }

    /// The streak grows only on updates that solved and trained nothing,
    /// fires at the limit with the last update's terminations, and never
    /// with a limit of 0.
    #[test]
    fn a_dead_streak_stops_the_run_at_its_limit() {
        let ended: std::collections::BTreeMap<String, usize> =
            [("invalid_format".to_string(), 8)].into();
        let mut d = DeadStreak::new(3);
        assert!(d.after(false, 0.0, &ended, None).is_none());
        assert!(d.after(false, 0.0, &ended, None).is_none());
        // A solve (nothing trained: every group solved alike) resets it.
        assert!(d.after(false, 1.0, &ended, None).is_none());
        assert!(d.after(false, 0.0, &ended, None).is_none());
        // So does an update that trained.
        assert!(d.after(true, 0.0, &ended, None).is_none());
        assert!(d.after(false, 0.0, &ended, None).is_none());
        assert!(d.after(false, 0.0, &ended, None).is_none());
        let why = d.after(false, 0.0, &ended, None).unwrap();
        assert!(
            why.contains("last 3 updates") && why.contains("invalid_format"),
            "{why}"
        );
        // Nothing graded: said as such, not as failed attempts.
        let masked: std::collections::BTreeMap<String, usize> = [("infra".to_string(), 8)].into();
        let mut d = DeadStreak::new(1);
        let why = d
            .after(
                false,
                0.0,
                &masked,
                Some("masked: Infra: no root file system"),
            )
            .unwrap();
        assert!(why.contains("no attempt was graded"), "{why}");
        assert!(
            why.contains("the first masked attempt: masked: Infra: no root"),
            "{why}"
        );
        let mut never = DeadStreak::new(0);
        assert!((0..100).all(|_| never.after(false, 0.0, &ended, None).is_none()));
    }

    /// A run shorter than the limit whose every update was dead failed; one
    /// with a live update among them, or with no update, did not.
    #[test]
    fn a_run_whose_every_update_was_dead_failed() {
        let masked: std::collections::BTreeMap<String, usize> = [("infra".to_string(), 2)].into();
        let mut d = DeadStreak::new(10);
        assert!(d
            .after(false, 0.0, &masked, Some("masked: Infra: x"))
            .is_none());
        assert!(d.after(false, 0.0, &masked, None).is_none());
        let why = d.whole_run(2, &masked).unwrap();
        assert!(
            why.contains("all 2 updates") && why.contains("masked: Infra: x"),
            "{why}"
        );
        assert!(d.whole_run(3, &masked).is_none());
        assert!(DeadStreak::new(10).whole_run(0, &masked).is_none());
        let mut live = DeadStreak::new(10);
        live.after(true, 0.0, &masked, None);
        assert!(live.whole_run(1, &masked).is_none());
    }

    /// A run's history: updates 1..=`live` at pass rate `pass`, then dead
    /// ones up to `to`.
    fn history(live: u64, to: u64, pass: f64) -> History {
        (1..=to)
            .map(|s| {
                (
                    s,
                    if s <= live {
                        (pass, false)
                    } else {
                        (0.0, true)
                    },
                )
            })
            .collect()
    }

    /// The rollback target: the newest checkpoint older than the first
    /// dead update's oldest possible sampling weights and than the last
    /// live update; after a rollback that no live update followed, an
    /// older one; none for a run that never lived.
    #[test]
    fn a_rollback_goes_to_the_newest_checkpoint_before_the_collapse() {
        let cks: Vec<(u64, PathBuf)> = [20, 40, 60, 80]
            .iter()
            .map(|&s| (s, PathBuf::from(format!("step-{s}"))))
            .collect();
        let at = |start: u64, live: u64, tried, ms| {
            let h = history(live, start + 3, 0.5);
            rollback_target(&cks, start, &h, tried, ms).map(|c| c.0)
        };
        // Dead from update 64, live at 63, staleness 2: 60 is old enough.
        assert_eq!(at(64, 63, None, 2), Some(60));
        // Dead from 62: 60's weights may have sampled update 62's rollouts.
        assert_eq!(at(62, 61, None, 2), Some(40));
        assert_eq!(at(62, 61, None, 0), Some(60));
        // The boundary: at + staleness + 2 <= start.
        assert_eq!(at(64, 63, None, 3), Some(40));
        // 60 was tried and no update lived since: go further back.
        assert_eq!(at(70, 63, Some(60), 2), Some(40));
        assert_eq!(at(70, 63, Some(20), 2), None);
        // A run that never lived, or dead before any checkpoint, has none.
        assert_eq!(at(64, 0, None, 2), None);
        assert_eq!(at(21, 20, None, 0), None);
        assert_eq!(
            rollback_target::<PathBuf>(&[], 64, &history(63, 66, 0.5), None, 2),
            None
        );
        // A run that never solved anything but trained (pass rate 0
        // throughout) still has healthy checkpoints: half of 0 is 0.
        assert_eq!(at_pass(&cks, 64, 63, 0.0), Some(60));
    }

    fn at_pass(cks: &[(u64, PathBuf)], start: u64, live: u64, pass: f64) -> Option<u64> {
        rollback_target(cks, start, &history(live, start + 3, pass), None, 2).map(|c| c.0)
    }

    /// A checkpoint written while the run was sick (the updates that
    /// sampled from it passed less than half the run's mean) is passed
    /// over for an older, healthy one, or none.
    #[test]
    fn a_rollback_passes_over_a_checkpoint_from_a_sick_stretch() {
        let cks: Vec<(u64, PathBuf)> = [10, 20]
            .iter()
            .map(|&s| (s, PathBuf::from(s.to_string())))
            .collect();
        // The seed-1 run of docs/demo.md: sick at 8-12, well at 14-17,
        // dead from 21.
        let pass = [
            0.27, 0.14, 0.27, 0.25, 0.27, 0.22, 0.34, 0.02, 0.06, 0.02, 0.06, 0.0, 0.11, 0.38,
            0.39, 0.42, 0.41, 0.30, 0.11, 0.08,
        ];
        let mut h: History = pass
            .iter()
            .enumerate()
            .map(|(i, &p)| (i as u64 + 1, (p, p == 0.0)))
            .collect();
        for s in 21..=23 {
            h.insert(s, (0.0, true));
        }
        assert_eq!(rollback_target(&cks, 21, &h, None, 0), None);
        // The model it started from is: updates 1-3 passed 0.23.
        let with_start: Vec<(u64, PathBuf)> = [(0, PathBuf::from("start"))]
            .into_iter()
            .chain(cks.iter().cloned())
            .collect();
        assert_eq!(
            rollback_target(&with_start, 21, &h, None, 2).map(|c| c.0),
            Some(0)
        );
        // With the run healthy at 11-13, 10 is a place to go back to.
        for s in 11..=13 {
            h.insert(s, (0.3, false));
        }
        assert_eq!(
            rollback_target(&cks, 21, &h, None, 2).map(|c| c.0),
            Some(10)
        );
    }

    /// The model the run started from is the checkpoint of update 0: a
    /// run that collapses before its first checkpoint is old enough goes
    /// back to it, if the updates that sampled from it were healthy.
    #[test]
    fn a_rollback_can_go_back_to_the_start() {
        let cks: Vec<(u64, PathBuf)> = [0, 10, 20]
            .iter()
            .map(|&s| (s, PathBuf::from(s.to_string())))
            .collect();
        // Dead from update 8: 10 is too new, the start is old enough.
        let h = history(7, 10, 0.3);
        assert_eq!(rollback_target(&cks, 8, &h, None, 2).map(|c| c.0), Some(0));
        // Not before max_staleness + 2 updates: 0 + 2 + 2 > 3.
        let h = history(2, 5, 0.3);
        assert_eq!(rollback_target(&cks, 3, &h, None, 2), None);
        // Tried already: nothing older.
        let h = history(7, 12, 0.3);
        assert_eq!(rollback_target(&cks, 8, &h, Some(0), 2), None);
        // The start is no place to go back to when the updates that
        // sampled from it were sick.
        let mut h = history(7, 10, 0.3);
        for s in 1..=3 {
            h.insert(s, (0.01, false));
        }
        assert_eq!(rollback_target(&cks, 8, &h, None, 2), None);
    }

    /// A resumed run picks up its history, streak and rollbacks from its
    /// records.
    #[test]
    fn a_resumed_run_remembers_its_streak_and_rollbacks() {
        let rec = |step: u64, dead: bool| json!({"step": step, "dead": dead, "pass_rate": 0.25});
        let mut records = vec![rec(1, false), rec(2, false), rec(3, true), rec(4, true)];
        let (h, tried, run) = rollback_memory(&records);
        assert_eq!((tried, run), (None, 2));
        assert_eq!(h.get(&2), Some(&(0.25, false)));
        assert_eq!(h.get(&4), Some(&(0.25, true)));
        records.push(json!({"step": 5, "dead": true, "rolled_back_to": 1}));
        let (h, tried, run) = rollback_memory(&records);
        assert_eq!((tried, run, h.get(&5)), (Some(1), 0, Some(&(0.0, true))));
        records.push(rec(6, true));
        assert_eq!(rollback_memory(&records).1, Some(1));
        assert_eq!(rollback_memory(&records).2, 1);
        records.push(rec(7, false));
        let (h, tried, run) = rollback_memory(&records);
        assert_eq!((h.len(), tried, run), (7, None, 0));
        assert!(rollback_memory(&[]).0.is_empty());
    }

    /// A group is kept after a rollback only when every token its attempts
    /// generated was sampled at the rollback's version or later; prompt
    /// tokens (mask 0, version 0) do not count.
    #[test]
    fn groups_sampled_before_a_rollback_are_told_apart() {
        let traj = |versions: &[u64], mask: &[u8]| {
            let mut t = Trajectory::unstarted("t", 0, "p", "");
            t.weight_versions = versions.to_vec();
            t.loss_mask = mask.to_vec();
            t
        };
        let group = |ts: Vec<Trajectory>| Group {
            task: 0,
            seq: 0,
            trajectories: ts,
        };
        let fresh = group(vec![traj(&[0, 0, 7, 7], &[0, 0, 1, 1])]);
        assert!(sampled_since(&fresh, 7));
        assert!(sampled_since(&fresh, 0));
        let mixed = group(vec![
            traj(&[0, 7, 8], &[0, 1, 1]),
            traj(&[0, 6, 7], &[0, 1, 1]),
        ]);
        assert!(!sampled_since(&mixed, 7));
        assert!(sampled_since(&mixed, 6));
        // An attempt that generated nothing does not hold its group back.
        let empty = group(vec![traj(&[], &[]), traj(&[0, 9], &[0, 1])]);
        assert!(sampled_since(&empty, 9));
    }

    #[test]
    fn shares_split_the_tokens_evenly_and_keep_every_example() {
        let ex = |n: usize| PgExample {
            tokens: vec![1; n],
            loss_mask: vec![1; n],
            behaviour_logprobs: vec![0.0; n],
            proximal_logprobs: None,
            advantage: 0.0,
            weight_versions: vec![],
        };
        let batch: Vec<PgExample> = [10, 10, 10, 10, 30, 10, 10, 10].map(ex).to_vec();
        let lens = |shares: &[&[PgExample]]| -> Vec<usize> {
            shares
                .iter()
                .map(|s| s.iter().map(|e| e.tokens.len()).sum())
                .collect()
        };
        assert_eq!(lens(&split_by_tokens(&batch, 1)), vec![100]);
        assert_eq!(lens(&split_by_tokens(&batch, 2)), vec![40, 60]);
        assert_eq!(lens(&split_by_tokens(&batch, 4)), vec![20, 20, 30, 30]);
        // More ranks than examples: some get empty shares.
        let two = &batch[..2];
        assert_eq!(lens(&split_by_tokens(two, 4)), vec![0, 10, 0, 10]);
        assert_eq!(lens(&split_by_tokens(&[], 3)), vec![0, 0, 0]);
    }
}
