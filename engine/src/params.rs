//! The shared, versioned parameter store: one per device, read by every
//! engine replica and by the trainer, written in place only by the
//! optimizer step while the engines are paused between two steps (docs/ARCHITECTURE.md,
//! "Weights"). Readers take a read guard for the duration of one forward;
//! `update` takes the write guard, applies the change in place (no copy of
//! the model) and bumps `weight_version`. The weights packed for the
//! matrix product are kept here too, once per version for every replica,
//! and (with the `cuda` feature) the weight copies a trainer keeps on a
//! GPU for the engines on that GPU to read in place ([`DeviceCopy`]).

use crate::model::{LinearPacks, Qwen3_5};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

#[derive(Debug)]
pub struct ParamStore {
    model: RwLock<Qwen3_5>,
    version: AtomicU64,
    /// The version the host tensors hold: `version`, or an earlier one
    /// while a GPU trainer keeps the current weights only on its device
    /// ([`advance_on_device`](Self::advance_on_device)).
    host_version: AtomicU64,
    /// The current version's packed weights, built by the first reader
    /// that needs them.
    packs: Mutex<Option<(u64, Arc<LinearPacks>)>>,
    /// One per GPU whose trainer keeps the engines' weights there.
    #[cfg(feature = "cuda")]
    device_copies: Mutex<Vec<DeviceCopy>>,
}

/// The weights on one GPU as its engines read them (bf16 matrices), written
/// in place by the trainer on that GPU after each optimizer step, while
/// the engines are paused: an engine on `ordinal` whose store moved to
/// `version` reads `model` instead of uploading the host copy again, once
/// its stream waits for `written` (the write, queued on the trainer's
/// stream: the trainer's thread does not wait for it).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone)]
pub struct DeviceCopy {
    pub ordinal: usize,
    pub version: u64,
    pub model: Arc<RwLock<crate::model::cuda::CudaModel>>,
    pub written: Arc<arcticd_kernels::cuda::device::CudaEvent>,
}

impl ParamStore {
    fn build(model: Qwen3_5, version: u64, packs: Option<(u64, Arc<LinearPacks>)>) -> Arc<Self> {
        Arc::new(ParamStore {
            model: RwLock::new(model),
            version: AtomicU64::new(version),
            host_version: AtomicU64::new(version),
            packs: Mutex::new(packs),
            #[cfg(feature = "cuda")]
            device_copies: Mutex::new(Vec::new()),
        })
    }

    /// Wrap a loaded model at weight version 0.
    pub fn new(model: Qwen3_5) -> Arc<Self> {
        Self::build(model, 0, None)
    }

    /// Records (or replaces) the weight copy on `copy.ordinal`.
    #[cfg(feature = "cuda")]
    pub fn publish_device_copy(&self, copy: DeviceCopy) {
        let mut all = self.device_copies.lock().unwrap_or_else(|e| e.into_inner());
        all.retain(|c| c.ordinal != copy.ordinal);
        all.push(copy);
    }

    /// The weight copy on GPU `ordinal`, if a trainer keeps one there.
    #[cfg(feature = "cuda")]
    pub fn device_copy(&self, ordinal: usize) -> Option<DeviceCopy> {
        let all = self.device_copies.lock().unwrap_or_else(|e| e.into_inner());
        all.iter().find(|c| c.ordinal == ordinal).cloned()
    }

    /// Wrap a model loaded with its packs by [`Qwen3_5::load_packed`], at
    /// weight version 0: the packs are this version's. Such a model holds
    /// its matrices only packed, so it is for reading (serving, sampling):
    /// after an [`update`](Self::update) its matrices cannot be packed
    /// again, and forwards fail with an error naming the released tensor.
    pub fn packed(model: Qwen3_5, packs: LinearPacks) -> Arc<Self> {
        Self::build(model, 0, Some((0, Arc::new(packs))))
    }

    /// Wrap a model at a given weight version (a resumed run continues the
    /// version numbering of its checkpoint).
    pub fn with_version(model: Qwen3_5, version: u64) -> Arc<Self> {
        Self::build(model, version, None)
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
        self.host_version.store(v, Ordering::Release);
        (v, r)
    }

    /// Bumps the version without touching the host tensors: a GPU trainer
    /// wrote the new weights into the device copy its engines read
    /// ([`DeviceCopy`]) and brings the host up to date only when something
    /// reads it ([`refresh_host`](Self::refresh_host)), so a step moves no
    /// weights across the bus. Until then a host read is behind:
    /// [`host_behind`](Self::host_behind) says so, and a CPU forward or an
    /// upload from the host refuses. Callers pause the engines around this,
    /// as around [`update`](Self::update). Returns the new version.
    pub fn advance_on_device(&self) -> u64 {
        let _guard = self.model.write().unwrap_or_else(|e| e.into_inner());
        self.version.fetch_add(1, Ordering::AcqRel) + 1
    }

    /// Writes the current version's weights into the host tensors (`f`, from
    /// the device that holds them) and marks the host current; returns `f`'s
    /// result. The caller holds the weights still meanwhile (no step runs).
    pub fn refresh_host<R>(&self, f: impl FnOnce(&mut Qwen3_5) -> R) -> R {
        let mut guard = self.model.write().unwrap_or_else(|e| e.into_inner());
        let r = f(&mut guard);
        let v = self.version.load(Ordering::Acquire);
        self.host_version.store(v, Ordering::Release);
        r
    }

    /// `(host version, current version)` while the host tensors are behind
    /// the current weights; `None` when a host read is current.
    pub fn host_behind(&self) -> Option<(u64, u64)> {
        let v = self.version.load(Ordering::Acquire);
        let h = self.host_version.load(Ordering::Acquire);
        (h != v).then_some((h, v))
    }

    /// The error a reader of the host tensors gives while they are behind.
    pub fn check_host_current(&self) -> crate::Result<()> {
        match self.host_behind() {
            None => Ok(()),
            Some((h, v)) => Err(crate::Error::Invariant(format!(
                "the host's copy of the weights is at version {h}, behind version {v}: \
                 the trainer keeps them on its GPU, where only that GPU's replicas with \
                 bf16 weights read them"
            ))),
        }
    }

    /// Frees the host's copy of every parameter (shapes and names stay) and
    /// its packs, without a new version: for a server whose replicas all
    /// hold their own copy on a GPU and whose weights never change. Returns
    /// the bytes freed. Afterwards anything that reads a host tensor (a CPU
    /// forward, an upload after an update) fails with the released
    /// tensor's error.
    pub fn release_host_weights(&self) -> usize {
        let mut guard = self.model.write().unwrap_or_else(|e| e.into_inner());
        let freed = guard.held_bytes();
        for (_, t) in guard.named_params_mut() {
            t.release();
        }
        *self.packs.lock().unwrap_or_else(|e| e.into_inner()) = None;
        freed
    }

    /// The weights of `version` packed for the matrix product (see
    /// [`LinearPacks`]), one copy for every replica reading this store: the
    /// first caller at a version packs them, the others wait and share it.
    /// `model` is the caller's read guard at `version` (so the version
    /// cannot move meanwhile). The previous version's packs are released
    /// first, and freed once no step still holds them; a failure to pack is
    /// logged and gives empty packs (the products then pack per call, with
    /// the same bits).
    pub fn packs(&self, model: &Qwen3_5, version: u64) -> Arc<LinearPacks> {
        let mut slot = self.packs.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((v, p)) = slot.as_ref() {
            if *v == version {
                return p.clone();
            }
        }
        *slot = None;
        let packs = Arc::new(model.pack_linears().unwrap_or_else(|e| {
            tracing::warn!("cannot pack the weights ({e}); products pack per call");
            LinearPacks::default()
        }));
        *slot = Some((version, packs.clone()));
        packs
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{init_model, TINY};

    /// Readers at one version share one pack; an update gives a new one.
    #[test]
    fn packs_are_shared_per_version() {
        let dir = std::env::temp_dir().join(format!("arcticd-params-packs-{}", std::process::id()));
        init_model(TINY, &dir, 0).unwrap();
        let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        let first = {
            let m = store.read();
            store.packs(&m, store.weight_version())
        };
        let again = {
            let m = store.read();
            store.packs(&m, store.weight_version())
        };
        assert!(Arc::ptr_eq(&first, &again));
        let (v, ()) = store.update(|_| ());
        let m = store.read();
        let next = store.packs(&m, v);
        assert!(!Arc::ptr_eq(&first, &next));
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Releasing the host weights frees them at the same version; a CPU
    /// forward after it is an error naming a released tensor, not a panic.
    #[test]
    fn released_host_weights_are_an_error_to_read() {
        let dir =
            std::env::temp_dir().join(format!("arcticd-params-release-{}", std::process::id()));
        init_model(TINY, &dir, 1).unwrap();
        let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        std::fs::remove_dir_all(&dir).ok();
        let held = store.read().held_bytes();
        assert_eq!(store.release_host_weights(), held);
        assert_eq!(store.weight_version(), 0);
        let m = store.read();
        assert_eq!(m.held_bytes(), 0);
        let mut cache = m.new_cache();
        let tokens: Vec<u32> = (1..5).collect();
        let err = m
            .forward(&mut [crate::model::SeqInput {
                tokens: &tokens,
                cache: &mut cache,
            }])
            .unwrap_err();
        assert!(err.to_string().contains("released"), "{err}");
    }

    /// A version moved on the device leaves the host behind until a
    /// refresh: a CPU forward refuses in between, with both versions named.
    #[test]
    fn a_host_behind_the_device_refuses_until_refreshed() {
        let dir =
            std::env::temp_dir().join(format!("arcticd-params-behind-{}", std::process::id()));
        init_model(TINY, &dir, 2).unwrap();
        let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        std::fs::remove_dir_all(&dir).ok();
        assert_eq!(store.host_behind(), None);
        assert_eq!(store.advance_on_device(), 1);
        assert_eq!(store.advance_on_device(), 2);
        assert_eq!(store.host_behind(), Some((0, 2)));
        let err = store.check_host_current().unwrap_err().to_string();
        assert!(err.contains("version 0, behind version 2"), "{err}");
        let n = store.refresh_host(|m| m.config.vocab_size);
        assert_eq!(n, TINY.vocab);
        assert_eq!(store.host_behind(), None);
        assert_eq!(store.weight_version(), 2);
        let (v, ()) = store.update(|_| ());
        assert_eq!((v, store.host_behind()), (3, None));
        store.check_host_current().unwrap();
    }

    /// A store made from a packed load serves its packs at version 0,
    /// holds the matrices once, and gives the same logits as a store that
    /// packs a fully loaded model.
    #[test]
    fn a_packed_load_serves_the_same_bits_from_its_packs() {
        let dir =
            std::env::temp_dir().join(format!("arcticd-params-packed-{}", std::process::id()));
        init_model(TINY, &dir, 4).unwrap();
        let full = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        let (model, packs) = Qwen3_5::load_packed(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let packed = ParamStore::packed(model, packs);
        let logits = |store: &ParamStore| {
            let m = store.read();
            let p = store.packs(&m, store.weight_version());
            let mut cache = m.new_cache();
            let tokens: Vec<u32> = (1..12).collect();
            let mut batch = [crate::model::SeqInput {
                tokens: &tokens,
                cache: &mut cache,
            }];
            let hidden = m.forward_with(&mut batch, Some(&p)).unwrap();
            let out = m.logits_with(&hidden, Some(&p)).unwrap();
            (
                out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                m.held_bytes(),
                p.bytes(),
            )
        };
        let (want, full_bytes, _) = logits(&full);
        let (got, held, pack_bytes) = logits(&packed);
        assert_eq!(got, want);
        if arcticd_kernels::cpu::sgemm::available() {
            assert!(pack_bytes > 0);
            // Only the embedding table and the vectors are left unpacked.
            let m = packed.read();
            let kept: usize = m.embed_tokens.held_bytes()
                + m.named_params()
                    .iter()
                    .filter(|(_, t)| t.shape().len() != 2)
                    .map(|(_, t)| t.held_bytes())
                    .sum::<usize>();
            assert_eq!(held, kept);
            assert!(held < full_bytes);
            // Read unpacked, a released matrix is an error, not a panic.
            let mut cache = m.new_cache();
            let mut batch = [crate::model::SeqInput {
                tokens: &[1, 2],
                cache: &mut cache,
            }];
            let e = m.forward_with(&mut batch, None).unwrap_err().to_string();
            assert!(e.contains("released"), "{e}");
        } else {
            assert_eq!(held, full_bytes);
        }
    }
}
