//! The run directory: what a training run leaves behind, and how a resumed
//! run finds where to continue (docs/ARCHITECTURE.md, "The run directory").
//!
//! ```text
//! recipe.toml                  the resolved recipe
//! metrics.jsonl                one object per update
//! eval.jsonl                   one object per held-out evaluation
//! trajectories/step-NNNNNN.jsonl   what update N trained on
//! trajectories/dropped.jsonl   stale, masked or zero-variance trajectories, with why
//! checkpoints/step-NNNNNN/     Hugging Face layout + optimizer + run_state.json
//! plots/*.png                  from `arcticd plot`
//! ```
//!
//! Checkpoints appear atomically (written to a hidden sibling, then
//! renamed), so a directory named `step-N` holding `run_state.json` is
//! complete; anything else is debris of a killed write and is removed on
//! resume. Resume cuts `metrics.jsonl`, `eval.jsonl`, `dropped.jsonl` and
//! the trajectory files back to the checkpoint's update, so no update is
//! missing or doubled.
//!
//! Not for: deciding what goes into a record (the loop).

use super::pool::PoolState;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The loop's state saved with each checkpoint.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunState {
    /// Updates done.
    pub step: u64,
    /// The parameter store's version.
    pub weight_version: u64,
    pub pool: PoolState,
    /// Groups the trainer had consumed.
    pub groups_consumed: u64,
    /// Groups dispatched by then (the difference was in flight or buffered,
    /// and is lost with the process).
    pub groups_started: u64,
    /// Seconds of training before this checkpoint.
    pub elapsed_s: f64,
    /// Running totals.
    pub totals: Totals,
    /// Why the run failed here (its updates solved and trained nothing),
    /// when it stopped for that at this checkpoint.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed: Option<String>,
}

/// Counts over the whole run.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Totals {
    pub rollouts: u64,
    pub stale_dropped: u64,
    pub masked_infra: u64,
    pub zero_variance_groups: u64,
    pub skipped_updates: u64,
    pub lost_on_resume: u64,
    /// Groups consumed beyond B by dynamic sampling.
    #[serde(default)]
    pub extra_groups: u64,
    /// Rollbacks to an earlier checkpoint after dead updates.
    #[serde(default)]
    pub rollbacks: u64,
    /// Groups sampled before a rollback and discarded after it.
    #[serde(default)]
    pub rollback_discarded: u64,
}

/// A run directory held by this process ([`RunDir::lock`]).
#[derive(Debug)]
pub struct RunLock(#[allow(dead_code)] std::fs::File);

/// Paths of a run directory.
#[derive(Debug, Clone)]
pub struct RunDir {
    pub root: PathBuf,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |e| Error::io(path, e)
}

impl RunDir {
    pub fn new(root: impl Into<PathBuf>) -> Self {
        RunDir { root: root.into() }
    }

    pub fn recipe(&self) -> PathBuf {
        self.root.join("recipe.toml")
    }
    pub fn metrics(&self) -> PathBuf {
        self.root.join("metrics.jsonl")
    }
    pub fn eval(&self) -> PathBuf {
        self.root.join("eval.jsonl")
    }
    pub fn trajectories(&self) -> PathBuf {
        self.root.join("trajectories")
    }
    pub fn step_trajectories(&self, step: u64) -> PathBuf {
        self.trajectories().join(format!("step-{step:06}.jsonl"))
    }
    pub fn dropped(&self) -> PathBuf {
        self.trajectories().join("dropped.jsonl")
    }
    pub fn checkpoints(&self) -> PathBuf {
        self.root.join("checkpoints")
    }
    pub fn checkpoint(&self, step: u64) -> PathBuf {
        self.checkpoints().join(format!("step-{step:06}"))
    }

    /// Holds the run directory (which exists) for this process until the
    /// value is dropped or the process ends: a second `train` on the same
    /// directory, fresh or resumed, is refused instead of interleaving its
    /// updates with this one's. An advisory lock on `.lock`, which names
    /// the holder's pid.
    pub fn lock(&self) -> Result<RunLock> {
        use std::io::{Read, Seek};
        let p = self.root.join(".lock");
        let mut f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(&p)
            .map_err(io(&p))?;
        match f.try_lock() {
            Ok(()) => {
                f.set_len(0).map_err(io(&p))?;
                f.rewind().map_err(io(&p))?;
                writeln!(f, "{}", std::process::id()).map_err(io(&p))?;
                Ok(RunLock(f))
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                let mut pid = String::new();
                let _ = f.read_to_string(&mut pid);
                Err(Error::Run(format!(
                    "{} is in use by another arcticd train (pid {}); one process at a time \
                     trains in a run directory",
                    self.root.display(),
                    pid.trim()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => Err(Error::io(&p, e)),
        }
    }

    /// Whether a new run may start here: refuses a path that is not a
    /// directory and one that already holds a run. `arcticd train` asks
    /// before it builds anything, `create` again when it makes the run.
    pub fn check_new(&self) -> Result<()> {
        if self.root.exists() && !self.root.is_dir() {
            return Err(Error::Run(format!(
                "{} is not a directory: a run directory is made there; pick another --out",
                self.root.display()
            )));
        }
        if self.metrics().exists() || self.recipe().exists() {
            return Err(Error::Run(format!(
                "{} already holds a run: continue it with --resume {0}, or pick another --out",
                self.root.display()
            )));
        }
        Ok(())
    }

    /// Makes a new run directory; refuses one that already holds a run.
    pub fn create(&self) -> Result<()> {
        self.check_new()?;
        for d in [self.trajectories(), self.checkpoints()] {
            std::fs::create_dir_all(&d).map_err(io(&d))?;
        }
        Ok(())
    }

    /// Complete checkpoints, oldest first: (update, directory).
    pub fn complete_checkpoints(&self) -> Result<Vec<(u64, PathBuf)>> {
        let dir = self.checkpoints();
        let rd = match std::fs::read_dir(&dir) {
            Ok(rd) => rd,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
            Err(e) => return Err(Error::io(&dir, e)),
        };
        let mut out = Vec::new();
        for entry in rd {
            let entry = entry.map_err(io(&dir))?;
            let name = entry.file_name().to_string_lossy().to_string();
            let Some(n) = name
                .strip_prefix("step-")
                .and_then(|s| s.parse::<u64>().ok())
            else {
                continue;
            };
            if entry.path().join("run_state.json").is_file() {
                out.push((n, entry.path()));
            }
        }
        out.sort();
        Ok(out)
    }

    /// The newest complete checkpoint that can be resumed from (its run
    /// state and its weights read) and its run state. Newer ones that
    /// cannot (damaged after they were written) are moved aside to
    /// `damaged-step-N` (kept: what is in them may still be wanted), each
    /// with a warning: the run redoes their updates, and a checkpoint left
    /// under a redone update's name would be taken for that update's.
    /// When every checkpoint is damaged, nothing is moved and the resume is
    /// refused: starting over would cut every logged update, which is the
    /// person's call, not the resume's.
    pub fn latest_checkpoint(&self) -> Result<Option<(PathBuf, RunState)>> {
        let mut damaged: Vec<(PathBuf, String)> = Vec::new();
        let mut found = None;
        for (_, dir) in self.complete_checkpoints()?.into_iter().rev() {
            let p = dir.join("run_state.json");
            let text = std::fs::read(&p).map_err(io(&p))?;
            let why = match serde_json::from_slice::<RunState>(&text) {
                Ok(s) => match readable_weights(&dir) {
                    Ok(()) => {
                        found = Some((dir, s));
                        break;
                    }
                    // Damage, not a failure to read (a permission, a
                    // missing file: said, nothing removed).
                    Err(
                        e @ (Error::Io { .. } | Error::Engine(arcticd_engine::Error::Io { .. })),
                    ) => return Err(e),
                    Err(e) => format!("its weights or optimizer state cannot be read: {e}"),
                },
                Err(e) => format!("its run state cannot be read: {e}"),
            };
            damaged.push((dir, why));
        }
        if found.is_none() && !damaged.is_empty() {
            let list: Vec<String> = damaged
                .iter()
                .map(|(dir, why)| format!("{}: {why}", dir.display()))
                .collect();
            return Err(Error::Run(format!(
                "{}: every checkpoint is damaged, so there is nothing to resume from ({}); \
                 nothing was changed. To start this run over from its first update, move \
                 its checkpoints folder aside and resume again (its logged updates are then \
                 cut); or start a new run with another --out",
                self.root.display(),
                list.join("; ")
            )));
        }
        for (dir, why) in damaged {
            let aside = self.aside(&dir);
            std::fs::rename(&dir, &aside).map_err(io(&dir))?;
            tracing::warn!(
                "{}: {why}; moved aside to {}, the run resumes from an earlier checkpoint",
                dir.display(),
                aside.display()
            );
        }
        Ok(found)
    }

    /// A free name for the damaged checkpoint `dir` beside it:
    /// `damaged-step-N`, then `damaged-step-N.2`, ... (no name the
    /// checkpoint listing, pruning or debris removal looks at).
    fn aside(&self, dir: &Path) -> PathBuf {
        let name = dir.file_name().map(|n| n.to_string_lossy().to_string());
        let base = self
            .checkpoints()
            .join(format!("damaged-{}", name.unwrap_or_default()));
        let mut p = base.clone();
        let mut k = 1;
        while p.exists() {
            k += 1;
            p = PathBuf::from(format!("{}.{k}", base.display()));
        }
        p
    }

    /// Removes hidden debris of interrupted checkpoint writes.
    pub fn remove_partial_checkpoints(&self) -> Result<()> {
        let dir = self.checkpoints();
        let Ok(rd) = std::fs::read_dir(&dir) else {
            return Ok(());
        };
        for entry in rd.flatten() {
            let name = entry.file_name().to_string_lossy().to_string();
            let complete = entry.path().join("run_state.json").is_file();
            if name.starts_with('.') || (name.starts_with("step-") && !complete) {
                let p = entry.path();
                std::fs::remove_dir_all(&p).map_err(io(&p))?;
            }
        }
        Ok(())
    }

    /// Keeps the newest `keep` complete checkpoints (None: all).
    pub fn prune_checkpoints(&self, keep: Option<usize>) -> Result<()> {
        let Some(keep) = keep else { return Ok(()) };
        let all = self.complete_checkpoints()?;
        let n = all.len().saturating_sub(keep.max(1));
        for (_, dir) in all.into_iter().take(n) {
            std::fs::remove_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(())
    }

    /// Cuts the logs back to update `step`: metrics and eval lines with a
    /// larger `step`, dropped records of later updates and later trajectory
    /// files go. Returns the metrics lines removed.
    pub fn cut_to(&self, step: u64) -> Result<Vec<Value>> {
        let removed = cut_jsonl(&self.metrics(), "step", step)?;
        cut_jsonl(&self.eval(), "step", step)?;
        cut_jsonl(&self.dropped(), "step", step)?;
        if let Ok(rd) = std::fs::read_dir(self.trajectories()) {
            for entry in rd.flatten() {
                let name = entry.file_name().to_string_lossy().to_string();
                let n = name
                    .strip_prefix("step-")
                    .and_then(|s| s.strip_suffix(".jsonl"))
                    .and_then(|s| s.parse::<u64>().ok());
                if n.is_some_and(|n| n > step) {
                    let p = entry.path();
                    std::fs::remove_file(&p).map_err(io(&p))?;
                }
            }
        }
        Ok(removed)
    }
}

/// Keeps the lines of a JSONL file whose `key` is at most `max` (a torn
/// line is dropped); rewrites it atomically. Returns the removed records.
fn cut_jsonl(path: &Path, key: &str, max: u64) -> Result<Vec<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(vec![]),
        Err(e) => return Err(Error::io(path, e)),
    };
    let mut kept = String::new();
    let mut removed = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        if v.get(key).and_then(Value::as_u64).is_some_and(|s| s > max) {
            removed.push(v);
        } else {
            kept.push_str(line);
            kept.push('\n');
        }
    }
    arcticd_engine::weights::write_atomic(path, kept.as_bytes())?;
    Ok(removed)
}

/// Appends one JSON line and flushes it.
pub fn append_jsonl(path: &Path, value: &impl Serialize) -> Result<()> {
    let mut line = serde_json::to_string(value)
        .map_err(|e| Error::Run(format!("serializing a record for {}: {e}", path.display())))?;
    line.push('\n');
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(io(path))?;
    f.write_all(line.as_bytes()).map_err(io(path))?;
    f.flush().map_err(io(path))
}

/// Writes many JSON lines at once (a new file).
pub fn write_jsonl<T: Serialize>(path: &Path, values: impl IntoIterator<Item = T>) -> Result<()> {
    let mut text = String::new();
    for v in values {
        text.push_str(
            &serde_json::to_string(&v)
                .map_err(|e| Error::Run(format!("serializing for {}: {e}", path.display())))?,
        );
        text.push('\n');
    }
    arcticd_engine::weights::write_atomic(path, text.as_bytes()).map_err(Into::into)
}

/// Whether a checkpoint's weights and, where it has them, its optimizer
/// state (`trainer_state.json`, `optimizer.safetensors`) read whole:
/// headers and sizes, not the data.
fn readable_weights(dir: &Path) -> Result<()> {
    arcticd_engine::weights::Checkpoint::open(dir)?;
    let state = dir.join("trainer_state.json");
    if state.is_file() {
        let text = std::fs::read(&state).map_err(io(&state))?;
        serde_json::from_slice::<crate::checkpoint::TrainerState>(&text)
            .map_err(|e| Error::Checkpoint(format!("{}: {e}", state.display())))?;
    }
    let moments = dir.join("optimizer.safetensors");
    if moments.is_file() {
        arcticd_engine::weights::check_safetensors(&moments)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn cut_keeps_earlier_steps_and_drops_torn_lines() {
        let d = tempfile::tempdir().unwrap();
        let r = RunDir::new(d.path());
        r.create().unwrap();
        for s in 1..=4u64 {
            append_jsonl(&r.metrics(), &json!({"step": s})).unwrap();
            write_jsonl(&r.step_trajectories(s), [json!({"x": s})]).unwrap();
        }
        std::fs::OpenOptions::new()
            .append(true)
            .open(r.metrics())
            .unwrap()
            .write_all(b"{\"step\": 5, \"tor")
            .unwrap();
        let removed = r.cut_to(2).unwrap();
        assert_eq!(removed.len(), 2);
        let text = std::fs::read_to_string(r.metrics()).unwrap();
        assert_eq!(text, "{\"step\":1}\n{\"step\":2}\n");
        assert!(r.step_trajectories(2).exists() && !r.step_trajectories(3).exists());
        assert!(r.create().is_err(), "a second create must refuse");
    }

    #[test]
    fn only_complete_checkpoints_count() {
        let d = tempfile::tempdir().unwrap();
        let r = RunDir::new(d.path());
        r.create().unwrap();
        for (name, complete) in [
            ("step-000002", true),
            ("step-000004", false),
            (".step-000006.tmp1", false),
        ] {
            let p = r.checkpoints().join(name);
            std::fs::create_dir_all(&p).unwrap();
            if complete {
                std::fs::write(p.join("run_state.json"), "{}").unwrap();
            }
        }
        let all = r.complete_checkpoints().unwrap();
        assert_eq!(all.iter().map(|c| c.0).collect::<Vec<_>>(), vec![2]);
        r.remove_partial_checkpoints().unwrap();
        assert_eq!(std::fs::read_dir(r.checkpoints()).unwrap().count(), 1);
    }

    #[test]
    fn one_holder_of_a_run_directory_at_a_time() {
        let d = tempfile::tempdir().unwrap();
        let r = RunDir::new(d.path());
        let held = r.lock().unwrap();
        let e = r.lock().unwrap_err().to_string();
        let pid = std::process::id();
        assert!(
            e.contains(&format!("in use by another arcticd train (pid {pid})")),
            "{e}"
        );
        drop(held);
        r.lock().unwrap();
    }

    /// A damaged newest checkpoint (run state, weights or moments) is passed over
    /// and moved aside, whole; the one before it is resumed from.
    #[test]
    fn a_damaged_newest_checkpoint_is_moved_aside_and_the_one_before_used() {
        let d = tempfile::tempdir().unwrap();
        let r = RunDir::new(d.path());
        r.create().unwrap();
        let state = |step: u64| RunState {
            step,
            weight_version: step,
            pool: crate::rl::pool::PoolState {
                tasks: vec![],
                order: vec![],
                cursor: 0,
                epoch: 0,
                rng: 0,
            },
            groups_consumed: 0,
            groups_started: 0,
            elapsed_s: 0.0,
            totals: Totals::default(),
            failed: None,
        };
        for step in [1u64, 2, 3] {
            let p = r.checkpoint(step);
            arcticd_engine::init::init_model(arcticd_engine::init::TINY, &p, 0).unwrap();
            let json = serde_json::to_vec(&state(step)).unwrap();
            std::fs::write(p.join("run_state.json"), json).unwrap();
        }
        // 3: truncated weights; 2: a torn run state.
        let w = r.checkpoint(3).join("model.safetensors");
        let bytes = std::fs::read(&w).unwrap();
        std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
        std::fs::write(r.checkpoint(2).join("run_state.json"), "{").unwrap();
        // 4: truncated optimizer moments, as the loop writes them.
        let p = r.checkpoint(4);
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &p, 0).unwrap();
        std::fs::write(
            p.join("run_state.json"),
            serde_json::to_vec(&state(4)).unwrap(),
        )
        .unwrap();
        let moments = p.join("optimizer.safetensors");
        std::fs::copy(p.join("model.safetensors"), &moments).unwrap();
        let bytes = std::fs::read(&moments).unwrap();
        std::fs::write(&moments, &bytes[..bytes.len() - 1]).unwrap();
        let (dir, s) = r.latest_checkpoint().unwrap().expect("step 1 is whole");
        assert_eq!((dir, s.step), (r.checkpoint(1), 1));
        assert!(!r.checkpoint(2).exists() && !r.checkpoint(3).exists() && !p.exists());
        assert!(r
            .checkpoints()
            .join("damaged-step-000004/optimizer.safetensors")
            .is_file());
        let aside = |name: &str| r.checkpoints().join(name);
        assert_eq!(
            std::fs::read_to_string(aside("damaged-step-000002").join("run_state.json")).unwrap(),
            "{"
        );
        assert!(aside("damaged-step-000003/model.safetensors").is_file());
        // Listing, pruning and debris removal leave them alone.
        assert_eq!(r.complete_checkpoints().unwrap().len(), 1);
        r.remove_partial_checkpoints().unwrap();
        r.prune_checkpoints(Some(1)).unwrap();
        assert!(aside("damaged-step-000002").is_dir() && aside("damaged-step-000003").is_dir());
        // The same update damaged again, after it was redone: a new name.
        let p = r.checkpoint(2);
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &p, 0).unwrap();
        std::fs::write(p.join("run_state.json"), "{").unwrap();
        r.latest_checkpoint().unwrap();
        assert!(aside("damaged-step-000002.2/run_state.json").is_file());
        // Step 1 damaged too, with step 2 again: every checkpoint is
        // damaged; the resume is refused and nothing moves.
        let p = r.checkpoint(2);
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &p, 0).unwrap();
        std::fs::write(p.join("run_state.json"), "{").unwrap();
        let w = r.checkpoint(1).join("model.safetensors");
        let bytes = std::fs::read(&w).unwrap();
        std::fs::write(&w, &bytes[..bytes.len() / 2]).unwrap();
        let e = r.latest_checkpoint().unwrap_err().to_string();
        assert!(e.contains("every checkpoint is damaged"), "{e}");
        assert!(
            e.contains("step-000001") && e.contains("step-000002"),
            "{e}"
        );
        assert!(r.checkpoint(1).is_dir() && r.checkpoint(2).is_dir());
        assert!(!aside("damaged-step-000001").exists());
        assert!(!aside("damaged-step-000002.3").exists());
        assert_eq!(r.complete_checkpoints().unwrap().len(), 2);
    }
}
