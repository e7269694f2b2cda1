//! The shared, versioned parameter store: one per device, read by every
//! engine replica and by the trainer, written in place only by the
//! optimizer step while the engines are paused between two steps (docs/ARCHITECTURE.md,
//! "Weights"). Readers take a read guard for the duration of one forward;
//! `update` takes the write guard, applies the change in place (no copy of
//! the model) and bumps `weight_version`.

use crate::model::Qwen3_5;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock, RwLockReadGuard};

#[derive(Debug)]
pub struct ParamStore {
    model: RwLock<Qwen3_5>,
    version: AtomicU64,
}

impl ParamStore {
    /// Wrap a loaded model at weight version 0.
    pub fn new(model: Qwen3_5) -> Arc<Self> {
        Arc::new(ParamStore {
            model: RwLock::new(model),
            version: AtomicU64::new(0),
        })
    }

    /// Wrap a model at a given weight version (a resumed run continues the
    /// version numbering of its checkpoint).
    pub fn with_version(model: Qwen3_5, version: u64) -> Arc<Self> {
        Arc::new(ParamStore {
            model: RwLock::new(model),
            version: AtomicU64::new(version),
        })
    }

    /// Read access for one forward pass. A poisoned lock (a writer panicked)
    /// still yields the data: the update is all-or-nothing from the version's
    /// point of view, and readers check `weight_version`.
    pub fn read(&self) -> RwLockReadGuard<'_, Qwen3_5> {
        self.model.read().unwrap_or_else(|e| e.into_inner())
    }

    /// The version readers see now.
    pub fn weight_version(&self) -> u64 {
        self.version.load(Ordering::Acquire)
    }

    /// Apply `f` to the parameters in place and bump the version; returns the
    /// new version. Callers (the trainer) pause the engines around this.
    pub fn update<R>(&self, f: impl FnOnce(&mut Qwen3_5) -> R) -> (u64, R) {
        let mut guard = self.model.write().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut guard);
        let v = self.version.fetch_add(1, Ordering::AcqRel) + 1;
        (v, r)
    }
}
