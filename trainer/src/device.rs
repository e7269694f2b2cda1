//! Where a trainer's weights, gradients and optimizer state live: the seam
//! an optimizer step is written over. [`crate::step::Trainer`] writes the
//! step once (micro-batches, the losses, the data-parallel sync, the
//! metrics, clipping, the skip of a non-finite step, the pause of the
//! engines around the write); a [`StepDevice`] runs the model's part of it
//! (the training forward with log-probs, the backward, the gradient
//! reductions, AdamW, the write of the weights the engines read).
//! [`CpuStep`] is the CPU, `cuda::CudaStep` (feature `cuda`) a GPU.
//!
//! Not for: the layer code (the engine's `Qwen3_5::layer_forward` and
//! `backward::model_backward`, both already device-generic), the losses.

use crate::comm::Communicator;
use crate::grads::ModelGrads;
use crate::model::{self, ForwardOptions, PrefixGroup, SharedActivations};
use crate::optim::{AdamW, AdamWConfig};
use crate::step::WriteGate;
use crate::{Error, Result};
use arcticd_engine::{ParamStore, Qwen3_5};
use std::borrow::Cow;
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// Where a rollback goes back to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestorePoint {
    /// A checkpoint of the run: its weights, the optimizer's moments and
    /// step count.
    Checkpoint(PathBuf),
    /// The model the run started from: its weights, and the optimizer as
    /// it was before the first step (no moments, step 0).
    Start(PathBuf),
}

impl RestorePoint {
    /// The directory the weights come from.
    pub fn dir(&self) -> &Path {
        match self {
            RestorePoint::Checkpoint(d) | RestorePoint::Start(d) => d,
        }
    }

    /// Its model and its optimizer state on the host (the masters are the
    /// model's weights), checked against the trained model's `config`;
    /// `optimizer` configures AdamW. What every device's
    /// [`StepDevice::restore`] reads before it changes anything.
    pub fn load(
        &self,
        config: &arcticd_engine::ModelConfig,
        optimizer: crate::optim::AdamWConfig,
    ) -> Result<(Qwen3_5, AdamW)> {
        let saved = Qwen3_5::load(self.dir())?;
        if !same_shapes(config, &saved.config) {
            return Err(Error::Checkpoint(format!(
                "{}: its model's config differs from the trained model's",
                self.dir().display()
            )));
        }
        let mut adamw = AdamW::new(&saved, optimizer)?;
        if let RestorePoint::Checkpoint(dir) = self {
            crate::checkpoint::load_optimizer(dir, &mut adamw)?;
        }
        Ok((saved, adamw))
    }
}

/// One micro-batch as a device scores it: whole sequences, and the packed
/// rows whose next token is a target (`rows[i]` predicts `targets[i]`).
#[derive(Debug, Clone, Copy)]
pub struct MicroBatch<'a> {
    pub sequences: &'a [&'a [u32]],
    pub rows: &'a [usize],
    pub targets: &'a [u32],
    /// Runs of sequences whose shared first tokens run once
    /// (`model::plan_prefixes`); empty where nothing is shared.
    pub groups: &'a [PrefixGroup],
}

/// What a training forward scored: each target's log-prob, and the
/// entropy of each row's distribution when asked for.
pub type Scores = (Vec<f32>, Option<Vec<f32>>);

/// The device side of an optimizer step. Calls come in this order per
/// step: [`zero_grads`](Self::zero_grads); per micro-batch
/// [`reference_logprobs`](Self::reference_logprobs) (when the loss needs
/// them), [`forward`](Self::forward), [`backward`](Self::backward); then
/// [`all_reduce_grads`](Self::all_reduce_grads) in a group,
/// [`grad_norm`](Self::grad_norm), [`scale_grads`](Self::scale_grads) when
/// clipping, [`apply`](Self::apply).
pub trait StepDevice: Send {
    /// The host store the engines read: after [`apply`](Self::apply) it
    /// holds the new weights under a new version (on a GPU, in the device
    /// copy the engines there read; the host tensors follow at
    /// [`sync_host`](Self::sync_host)).
    fn store(&self) -> &Arc<ParamStore>;
    /// Brings the store's host tensors up to the current version where
    /// the step keeps the weights elsewhere (a GPU); the CPU writes them in
    /// place, so there it does nothing.
    fn sync_host(&mut self) -> Result<()> {
        Ok(())
    }
    fn zero_grads(&mut self) -> Result<()>;
    /// The training forward of one micro-batch at `temperature`, keeping
    /// what [`backward`](Self::backward) needs (only each layer's input
    /// with `recompute_layers`; the batch's `groups` sharing their
    /// prefixes, where the device [shares them](Self::shares_prefixes)).
    fn forward(
        &mut self,
        batch: MicroBatch<'_>,
        entropy: bool,
        temperature: f32,
        opts: ForwardOptions,
    ) -> Result<Scores>;
    /// Whether a fixed reference policy is held (`pg.ref_kl_coef`).
    fn has_reference(&self) -> bool;
    /// Whether [`forward`](Self::forward) runs a micro-batch's shared
    /// prefixes once (`MicroBatch::groups`); where it does not, the step
    /// gives it no groups and packs micro-batches by whole sequences.
    fn shares_prefixes(&self) -> bool {
        false
    }
    /// The reference policy's log-prob of each target (no backward).
    fn reference_logprobs(&mut self, batch: MicroBatch<'_>, temperature: f32) -> Result<Vec<f32>>;
    /// Backward of the last [`forward`](Self::forward) from the gradient of
    /// each target's log-prob (and of each row's entropy): the parameter
    /// gradients accumulate.
    fn backward(&mut self, dlp: &[f32], dentropy: Option<&[f32]>, temperature: f32) -> Result<()>;
    /// Sums the gradients over the ranks of `comm`.
    fn all_reduce_grads(&mut self, comm: &dyn Communicator) -> Result<()>;
    /// The gradients' global L2 norm (per-tensor sums of squares in f64, in
    /// parameter order), and whether every gradient is finite.
    fn grad_norm(&self) -> Result<(f64, bool)>;
    fn scale_grads(&mut self, s: f32) -> Result<()>;
    /// One AdamW step at `lr` on the master weights, then the write of the
    /// store with `gate` paused around it; returns the new weight version
    /// and the seconds the gate was held.
    fn apply(&mut self, lr: f64, gate: Option<&dyn WriteGate>) -> Result<(u64, f64)>;
    /// Optimizer steps taken.
    fn steps(&self) -> u64;
    /// The optimizer state as the host holds it (checkpoints).
    fn host_optimizer(&self) -> Result<Cow<'_, AdamW>>;
    /// Loads the optimizer's moments and step count from the checkpoint
    /// `dir` whose weights the store holds (resuming): the masters are those
    /// weights already.
    fn load_optimizer(&mut self, dir: &Path) -> Result<()>;
    /// Puts the weights and the optimizer state of `point` back (rolling a
    /// run back): the masters, the moments and the step count become the
    /// checkpoint's, as on resume (or the start's: fresh), and the store is
    /// written with `gate` paused around it; returns the new weight
    /// version (versions only ever grow, so what was sampled before stays
    /// told apart).
    fn restore(&mut self, point: &RestorePoint, gate: Option<&dyn WriteGate>) -> Result<u64>;
}

/// The CPU: the model in the shared store, gradients and AdamW on the host.
pub struct CpuStep {
    pub store: Arc<ParamStore>,
    pub optimizer: AdamW,
    grads: ModelGrads,
    /// The fixed policy of the KL-to-reference term.
    reference: Option<Qwen3_5>,
    /// The last forward's activations, until its backward.
    acts: Option<(SharedActivations, Vec<usize>, Vec<u32>)>,
}

impl CpuStep {
    pub fn new(store: Arc<ParamStore>, config: AdamWConfig) -> Result<Self> {
        let (optimizer, grads) = {
            let m = store.read();
            (AdamW::new(&m, config)?, ModelGrads::zeros_like(&m))
        };
        Ok(CpuStep {
            store,
            optimizer,
            grads,
            reference: None,
            acts: None,
        })
    }

    /// The gradients of the last accumulation.
    pub fn grads(&self) -> &ModelGrads {
        &self.grads
    }

    /// Holds `reference` as the KL term's fixed policy; it must have the
    /// trained model's shapes.
    pub fn set_reference(&mut self, reference: Qwen3_5) -> Result<()> {
        if !same_shapes(&self.store.read().config, &reference.config) {
            return Err(Error::Input(
                "the KL reference model's config differs from the trained model's".into(),
            ));
        }
        self.reference = Some(reference);
        Ok(())
    }
}

/// Whether two configs describe parameters of the same shapes.
pub(crate) fn same_shapes(
    a: &arcticd_engine::config::ModelConfig,
    b: &arcticd_engine::config::ModelConfig,
) -> bool {
    let shape = |c: &arcticd_engine::config::ModelConfig| {
        (
            [
                c.vocab_size,
                c.hidden_size,
                c.intermediate_size,
                c.num_heads,
                c.num_kv_heads,
                c.head_dim,
                c.conv_kernel,
                c.linear_key_head_dim,
                c.linear_value_head_dim,
                c.linear_num_key_heads,
                c.linear_num_value_heads,
            ],
            c.tie_word_embeddings,
            c.layer_types.clone(),
        )
    };
    shape(a) == shape(b)
}

impl StepDevice for CpuStep {
    fn store(&self) -> &Arc<ParamStore> {
        &self.store
    }

    fn zero_grads(&mut self) -> Result<()> {
        self.grads.clear();
        self.acts = None;
        Ok(())
    }

    fn forward(
        &mut self,
        batch: MicroBatch<'_>,
        entropy: bool,
        temperature: f32,
        opts: ForwardOptions,
    ) -> Result<Scores> {
        // A read guard per call: the engines keep generating meanwhile, and
        // the only writer is this trainer's `apply`.
        let m = self.store.read();
        let (acts, rows) =
            model::forward_shared(&m, batch.sequences, batch.groups, batch.rows, opts)?;
        let scores = model::token_logprobs_entropy(
            &m,
            &acts.hidden,
            &rows,
            batch.targets,
            entropy,
            temperature,
        )?;
        self.acts = Some((acts, rows, batch.targets.to_vec()));
        Ok(scores)
    }

    fn has_reference(&self) -> bool {
        self.reference.is_some()
    }

    fn shares_prefixes(&self) -> bool {
        true
    }

    fn reference_logprobs(&mut self, batch: MicroBatch<'_>, temperature: f32) -> Result<Vec<f32>> {
        let r = self.reference.as_ref().ok_or_else(|| {
            Error::Input("ref_kl_coef is set but the trainer has no reference model".into())
        })?;
        // Shared prefixes once here too; no backward, so only each
        // layer's input is kept.
        let opts = ForwardOptions {
            recompute_layers: true,
        };
        let (acts, rows) =
            model::forward_shared(r, batch.sequences, batch.groups, batch.rows, opts)?;
        let (lp, _) = model::token_logprobs_entropy(
            r,
            &acts.hidden,
            &rows,
            batch.targets,
            false,
            temperature,
        )?;
        Ok(lp)
    }

    fn backward(&mut self, dlp: &[f32], dentropy: Option<&[f32]>, temperature: f32) -> Result<()> {
        let (acts, rows, targets) = self
            .acts
            .take()
            .ok_or_else(|| Error::Shape("a backward without its forward".into()))?;
        let m = self.store.read();
        let dhidden = model::token_logprobs_entropy_backward(
            &m,
            &mut self.grads,
            &acts.hidden,
            &rows,
            &targets,
            dlp,
            dentropy,
            temperature,
        )?;
        model::backward_shared(&m, &acts, &dhidden, &mut self.grads)
    }

    fn all_reduce_grads(&mut self, comm: &dyn Communicator) -> Result<()> {
        for (_, g) in self.grads.named_mut() {
            comm.all_reduce_sum(g)?;
        }
        Ok(())
    }

    fn grad_norm(&self) -> Result<(f64, bool)> {
        Ok(self.grads.global_norm())
    }

    fn scale_grads(&mut self, s: f32) -> Result<()> {
        self.grads.scale(s);
        Ok(())
    }

    fn apply(&mut self, lr: f64, gate: Option<&dyn WriteGate>) -> Result<(u64, f64)> {
        self.optimizer.step(&self.grads, lr)?;
        let opt = &self.optimizer;
        let t0 = std::time::Instant::now();
        let (version, res) = {
            let _paused = crate::step::PauseGuard::pause(gate)?;
            self.store.update(|m| opt.write_to(m))
        };
        let secs = t0.elapsed().as_secs_f64();
        res?;
        Ok((version, secs))
    }

    fn steps(&self) -> u64 {
        self.optimizer.step
    }

    fn host_optimizer(&self) -> Result<Cow<'_, AdamW>> {
        Ok(Cow::Borrowed(&self.optimizer))
    }

    fn load_optimizer(&mut self, dir: &Path) -> Result<()> {
        crate::checkpoint::load_optimizer(dir, &mut self.optimizer)
    }

    fn restore(&mut self, point: &RestorePoint, gate: Option<&dyn WriteGate>) -> Result<u64> {
        let (_, optimizer) = point.load(&self.store.read().config, self.optimizer.config)?;
        let (version, res) = {
            let _paused = crate::step::PauseGuard::pause(gate)?;
            self.store.update(|m| optimizer.write_to(m))
        };
        res?;
        self.optimizer = optimizer;
        self.acts = None;
        Ok(version)
    }
}

/// A device chosen at run time (`Trainer<Box<dyn StepDevice>>`).
impl<T: StepDevice + ?Sized> StepDevice for Box<T> {
    fn store(&self) -> &Arc<ParamStore> {
        (**self).store()
    }
    fn sync_host(&mut self) -> Result<()> {
        (**self).sync_host()
    }
    fn zero_grads(&mut self) -> Result<()> {
        (**self).zero_grads()
    }
    fn forward(
        &mut self,
        batch: MicroBatch<'_>,
        entropy: bool,
        temperature: f32,
        opts: ForwardOptions,
    ) -> Result<Scores> {
        (**self).forward(batch, entropy, temperature, opts)
    }
    fn has_reference(&self) -> bool {
        (**self).has_reference()
    }
    fn shares_prefixes(&self) -> bool {
        (**self).shares_prefixes()
    }
    fn reference_logprobs(&mut self, batch: MicroBatch<'_>, temperature: f32) -> Result<Vec<f32>> {
        (**self).reference_logprobs(batch, temperature)
    }
    fn backward(&mut self, dlp: &[f32], dentropy: Option<&[f32]>, temperature: f32) -> Result<()> {
        (**self).backward(dlp, dentropy, temperature)
    }
    fn all_reduce_grads(&mut self, comm: &dyn Communicator) -> Result<()> {
        (**self).all_reduce_grads(comm)
    }
    fn grad_norm(&self) -> Result<(f64, bool)> {
        (**self).grad_norm()
    }
    fn scale_grads(&mut self, s: f32) -> Result<()> {
        (**self).scale_grads(s)
    }
    fn apply(&mut self, lr: f64, gate: Option<&dyn WriteGate>) -> Result<(u64, f64)> {
        (**self).apply(lr, gate)
    }
    fn steps(&self) -> u64 {
        (**self).steps()
    }
    fn host_optimizer(&self) -> Result<Cow<'_, AdamW>> {
        (**self).host_optimizer()
    }
    fn load_optimizer(&mut self, dir: &Path) -> Result<()> {
        (**self).load_optimizer(dir)
    }
    fn restore(&mut self, point: &RestorePoint, gate: Option<&dyn WriteGate>) -> Result<u64> {
        (**self).restore(point, gate)
    }
}

/// A rank's CUDA step device: its engines run on its GPU and read its
/// weights there; its gradients go over NCCL when `nccl` is given.
#[cfg(feature = "cuda")]
fn cuda_step(
    dev: Arc<arcticd_kernels::cuda::device::CudaDevice>,
    store: Arc<ParamStore>,
    config: AdamWConfig,
    reference: Option<Qwen3_5>,
    nccl: Option<crate::cuda::NcclRank>,
) -> Result<Box<dyn StepDevice>> {
    let mut gpu = crate::cuda::CudaStep::new(store, dev, config)?;
    if let Some(r) = reference {
        gpu.set_reference(&r)?;
    }
    gpu.share_with_engines()?;
    if let Some(n) = nccl {
        gpu = gpu.with_nccl(n);
    }
    Ok(Box::new(gpu))
}

/// The step devices of a data-parallel group: rank `r` on `devices[r]`
/// with the model in `stores[r]` and `reference()` as its KL policy. When
/// every rank is a GPU and there are several, their gradients are summed
/// over NCCL, on the devices; where the NCCL library does not load, through
/// the host communicator (said in the log). `batch_invariant`: a GPU's
/// forward products on the in-order kernel (the engines' deterministic
/// mode; the CPU is always so).
pub fn step_devices(
    devices: &[arcticd_kernels::Device],
    stores: &[Arc<ParamStore>],
    config: AdamWConfig,
    reference: impl Fn() -> Result<Option<Qwen3_5>>,
    batch_invariant: bool,
) -> Result<Vec<Box<dyn StepDevice>>> {
    if devices.len() != stores.len() {
        return Err(Error::Input(format!(
            "{} devices for {} ranks",
            devices.len(),
            stores.len()
        )));
    }
    #[cfg(feature = "cuda")]
    {
        let ordinals: Option<Vec<usize>> = devices
            .iter()
            .map(|d| match d {
                arcticd_kernels::Device::Cuda(i) => Some(*i),
                arcticd_kernels::Device::Cpu => None,
            })
            .collect();
        if let Some(ordinals) = ordinals.filter(|o| o.len() > 1) {
            let devs = ordinals
                .iter()
                .map(|&i| gpu(i, batch_invariant))
                .collect::<Result<Vec<_>>>()?;
            let mut ranks: Vec<Option<crate::cuda::NcclRank>> = match crate::cuda::nccl_world(&devs)
            {
                Ok(r) => r.into_iter().map(Some).collect(),
                Err(e) => {
                    tracing::warn!("gradients through the host communicator: {e}");
                    devs.iter().map(|_| None).collect()
                }
            };
            return devs
                .into_iter()
                .zip(stores)
                .zip(ranks.iter_mut())
                .map(|((dev, store), nccl)| {
                    cuda_step(dev, store.clone(), config, reference()?, nccl.take())
                })
                .collect();
        }
    }
    devices
        .iter()
        .zip(stores)
        .map(|(&d, store)| step_device(d, store.clone(), config, reference()?, batch_invariant))
        .collect()
}

/// `cuda:ORDINAL`, its forward products batch-invariant or not.
#[cfg(feature = "cuda")]
fn gpu(
    ordinal: usize,
    batch_invariant: bool,
) -> Result<Arc<arcticd_kernels::cuda::device::CudaDevice>> {
    let dev = arcticd_kernels::cuda::device::CudaDevice::new(ordinal)?;
    dev.set_batch_invariant(batch_invariant);
    Ok(Arc::new(dev))
}

/// The step device for `device`: the CPU, or a GPU by ordinal (builds
/// with the `cuda` feature), for the model in `store`, with `reference`
/// as the KL term's fixed policy when given, batch-invariant as
/// [`step_devices`] says.
pub fn step_device(
    device: arcticd_kernels::Device,
    store: Arc<ParamStore>,
    config: AdamWConfig,
    reference: Option<Qwen3_5>,
    batch_invariant: bool,
) -> Result<Box<dyn StepDevice>> {
    match device {
        arcticd_kernels::Device::Cpu => {
            let mut cpu = CpuStep::new(store, config)?;
            if let Some(r) = reference {
                cpu.set_reference(r)?;
            }
            Ok(Box::new(cpu))
        }
        #[cfg(feature = "cuda")]
        arcticd_kernels::Device::Cuda(i) => {
            cuda_step(gpu(i, batch_invariant)?, store, config, reference, None)
        }
        #[cfg(not(feature = "cuda"))]
        arcticd_kernels::Device::Cuda(_) => {
            let _ = batch_invariant;
            // The stand-in's error: this build has no CUDA backend.
            device.check_available()?;
            Err(Error::Input(format!("{device}: no CUDA backend")))
        }
    }
}
