//! The backward on a GPU (feature `cuda`): the CUDA side of the backward
//! seam ([`BackwardOps`]) over the activations the CUDA training forward
//! kept (`CudaModel::forward_keeping`), with the parameter gradients in
//! device buffers laid out like the model (`Qwen3_5<CudaSlice<f32>>`).
//! The layer walk is `backward.rs`'s, the one the CPU runs; the ops are
//! the CUDA backward kernels, each tested against its CPU reference, and
//! cuBLAS products in fp32.
//!
//! The ops that run per sequence (the gated delta rule, the causal conv,
//! attention) copy each sequence's rows out of the packed batch and its
//! gradients back. The model's matrices must be f32 on the device
//! (`WeightDType::F32`): the product's backward takes f32 weights. A layer
//! whose forward kept only its input is run again from it.
//!
//! The loss's log-probabilities and their backward run here too
//! ([`token_logprobs`], [`token_logprobs_backward`]), as on the CPU: the
//! logits made a bounded number of rows at a time
//! (`logit_rows_per_chunk`), never `[tokens, vocab]` at once.
//!
//! AdamW runs on the device too ([`CudaAdamW`]): the model's f32
//! parameters on the GPU are the master weights, updated in place with the
//! CPU's step scalars (`AdamWStep`), and [`sft_step`] puts the pieces
//! together as the CPU's SFT step does (mean negative log-likelihood of
//! the masked tokens, global-norm clipping, AdamW).
//!
//! With [`CudaStep::share_with_engines`] the engines on the trainer's GPU
//! read a bf16 copy of the weights there that the step writes in place from
//! the masters (`DeviceCopy` in the store), instead of uploading the host
//! copy after every update.
//!
//! Not for: the kernels themselves.

use crate::backward::{model_backward, BackwardOps, Forward};
use crate::comm::Communicator;
use crate::device::{MicroBatch, RestorePoint, Scores, StepDevice};
use crate::model::ForwardOptions;
use crate::optim::{AdamW, AdamWConfig};
use crate::step::{PauseGuard, WriteGate};
use crate::{Error, Result};
use arcticd_engine::model::cuda::{CudaModel, CudaTrace, DeviceParam};
use arcticd_engine::model::qwen3_5::{Linear, LinearAttention};
use arcticd_engine::model::saved::{FullActs, LayerActs, LinearActs};
use arcticd_engine::model::{Keep, WeightDType};
use arcticd_engine::params::DeviceCopy;
use arcticd_engine::ParamStore;
use arcticd_engine::{ModelConfig, Qwen3_5};
use arcticd_kernels::cpu::attention::AttnDims;
use arcticd_kernels::cuda::cudarc::driver::CudaSlice;
use arcticd_kernels::cuda::cudarc::nccl::{Comm, ReduceOp};
use arcticd_kernels::cuda::device::CudaDevice;
use std::borrow::Cow;
use std::path::Path;
use std::sync::{Arc, RwLock};

type Buf = CudaSlice<f32>;

/// Every parameter's gradient on the device, zeroed, shaped like `model`.
pub fn zero_grads(model: &CudaModel) -> Result<Qwen3_5<Buf>> {
    let dev = model.device();
    model
        .params()
        .try_map(|_, p| -> Result<Buf> { Ok(dev.zeros(p.len())?) })
}

/// Backward through the whole model on the device, from `dhidden` (the
/// gradient of the final hidden states, `[tokens, hidden]`) and the trace
/// of `forward.forward_keeping(sequences)` (`forward`: the f32 masters
/// `model`, or the engines' bf16 copy of them; a layer recomputed from its
/// input runs there too); the products take `model`'s weights and the
/// gradients accumulate into `grads` ([`zero_grads`]).
pub fn backward(
    model: &CudaModel,
    forward: &CudaModel,
    sequences: &[&[u32]],
    trace: &CudaTrace,
    dhidden: &Buf,
    grads: &mut Qwen3_5<Buf>,
) -> Result<()> {
    let config = model.config();
    let mut spans = Vec::with_capacity(sequences.len());
    let mut ids = Vec::new();
    let mut positions = Vec::new();
    for s in sequences {
        spans.push((ids.len(), s.len()));
        ids.extend_from_slice(s);
        positions.extend(0..s.len() as u32);
    }
    let h = config.hidden_size;
    if dhidden.len() != ids.len() * h || trace.hidden.len() != ids.len() * h {
        return Err(Error::Shape(format!(
            "dhidden has {} values and the trace {} for {} tokens x {h}",
            dhidden.len(),
            trace.hidden.len(),
            ids.len()
        )));
    }
    let dev = model.device();
    let mut ops = CudaBackward {
        dev,
        config,
        positions: dev.upload(&positions)?,
        ids,
        spans,
        model: forward,
        sequences,
    };
    let fwd = Forward {
        layers: &trace.layers,
        x_last: &trace.x_last,
        final_rstd: &trace.final_rstd,
    };
    model_backward(&mut ops, model.params(), &fwd, dhidden, grads)
}

/// `lp[i] = log p(targets[i] | hidden row rows[i])` at `temperature` and,
/// with `entropy`, that distribution's entropy at each row (as the CPU's
/// `model::token_logprobs_entropy`), on the device. `hidden` is `[tokens,
/// hidden]` (a trace's final hidden states).
pub fn token_logprobs(
    model: &CudaModel,
    hidden: &Buf,
    rows: &[usize],
    targets: &[u32],
    entropy: bool,
    temperature: f32,
) -> Result<(Buf, Option<Buf>)> {
    let inv_t = crate::model::inverse_temperature(temperature)?.unwrap_or(1.0);
    let (h, vocab) = (model.config().hidden_size, model.config().vocab_size);
    crate::model::check_rows(hidden.len() / h.max(1), rows, targets)?;
    let dev = model.device();
    let mut lps = dev.zeros(rows.len())?;
    let mut ents = if entropy {
        Some(dev.zeros(rows.len())?)
    } else {
        None
    };
    let per = arcticd_engine::model::logit_rows_per_chunk(vocab);
    let mut start = 0;
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let m = rc.len();
        let logits = chunk_logits(model, hidden, rc)?;
        let mut lp = dev.zeros(m)?;
        dev.logprob_gather_forward(&mut lp, &logits, &dev.upload(tc)?, vocab, inv_t)?;
        dev.copy_into(&mut lps, &lp, 1, (start, 0), (m, 1))?;
        if let Some(all) = ents.as_mut() {
            let mut e = dev.zeros(m)?;
            dev.entropy_forward(&mut e, &logits, vocab, inv_t)?;
            dev.copy_into(all, &e, 1, (start, 0), (m, 1))?;
        }
        start += m;
    }
    Ok((lps, ents))
}

/// Backward of [`token_logprobs`] for upstream gradients `dlp` and, when
/// given, `dent` (of each row's entropy), one per row, on the device: the
/// output projection's gradient accumulates into `grads` (into
/// `embed_tokens` when tied) and `dhidden [tokens, hidden]` comes back.
/// `rows` must be distinct (each position's next token once). The logits
/// are recomputed through `forward` (the model [`token_logprobs`] ran:
/// the masters, or the engines' bf16 copy); `model` is the f32 masters.
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs_backward(
    model: &CudaModel,
    forward: &CudaModel,
    grads: &mut Qwen3_5<Buf>,
    hidden: &Buf,
    rows: &[usize],
    targets: &[u32],
    dlp: &Buf,
    dent: Option<&Buf>,
    temperature: f32,
) -> Result<Buf> {
    let inv_t = crate::model::inverse_temperature(temperature)?.unwrap_or(1.0);
    let (h, vocab) = (model.config().hidden_size, model.config().vocab_size);
    let n = hidden.len() / h.max(1);
    crate::model::check_rows(n, rows, targets)?;
    if dlp.len() != rows.len() || dent.is_some_and(|d| d.len() != rows.len()) {
        return Err(Error::Input(format!(
            "{} log-prob gradients for {} rows",
            dlp.len(),
            rows.len()
        )));
    }
    let (dev, head) = (model.device(), head_of(model)?);
    let dw = match grads.lm_head.as_mut() {
        Some(g) => g,
        None => &mut grads.embed_tokens,
    };
    let per = arcticd_engine::model::logit_rows_per_chunk(vocab);
    let mut dhidden = dev.zeros(n * h)?;
    let mut start = 0;
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let m = rc.len();
        let logits = chunk_logits(forward, hidden, rc)?;
        let mut d = dev.zeros(m)?;
        dev.copy_block(&mut d, dlp, 1, (start, 0), (m, 1))?;
        let mut dlogits = dev.zeros(m * vocab)?;
        dev.logprob_gather_backward(&mut dlogits, &d, &logits, &dev.upload(tc)?, vocab, inv_t)?;
        if let Some(de) = dent {
            let mut e = dev.zeros(m)?;
            dev.copy_block(&mut e, de, 1, (start, 0), (m, 1))?;
            dev.entropy_backward(&mut dlogits, &e, &logits, vocab, inv_t)?;
        }
        let sel = gather(dev, hidden, rc, h)?;
        let mut dsel = dev.zeros(m * h)?;
        dev.matmul_backward(&mut dsel, dw, &dlogits, &sel, head, m, h, vocab)?;
        let which: Vec<u32> = rc.iter().map(|&r| r as u32).collect();
        dev.scatter_rows(&mut dhidden, &dsel, &which, h)?;
        start += m;
    }
    Ok(dhidden)
}

/// The output projection `[vocab, hidden]` (tied or not), in f32.
fn head_of(model: &CudaModel) -> Result<&Buf> {
    let p = model.params();
    weight(p.lm_head.as_ref().unwrap_or(&p.embed_tokens))
}

/// Rows `rows` of `x` (rows of `width`), gathered.
fn gather(dev: &CudaDevice, x: &Buf, rows: &[usize], width: usize) -> Result<Buf> {
    let which: Vec<u32> = rows.iter().map(|&r| r as u32).collect();
    let mut out = dev.zeros(rows.len() * width)?;
    dev.gather_rows(&mut out, x, &which, width)?;
    Ok(out)
}

/// Logits `[rows.len(), vocab]` of the hidden rows `rows`, through
/// `model`'s output projection (the engine's: f32 or bf16 weights).
fn chunk_logits(model: &CudaModel, hidden: &Buf, rows: &[usize]) -> Result<Buf> {
    let h = model.config().hidden_size;
    let sel = gather(model.device(), hidden, rows, h)?;
    Ok(model.project(&sel, rows.len())?)
}

/// AdamW on the device: the moments beside the model's f32 parameters
/// (the masters), one step as the CPU's [`crate::optim::AdamW::step`].
pub struct CudaAdamW {
    pub config: crate::optim::AdamWConfig,
    /// Optimizer steps taken.
    pub step: u64,
    exp_avg: Qwen3_5<Buf>,
    exp_avg_sq: Qwen3_5<Buf>,
}

impl CudaAdamW {
    pub fn new(model: &CudaModel, config: crate::optim::AdamWConfig) -> Result<Self> {
        Ok(CudaAdamW {
            config,
            step: 0,
            exp_avg: zero_grads(model)?,
            exp_avg_sq: zero_grads(model)?,
        })
    }

    /// One step at `lr` with `grads` on `model`'s parameters, in place.
    pub fn step(&mut self, model: &mut CudaModel, grads: &Qwen3_5<Buf>, lr: f64) -> Result<()> {
        let dev = model.device().clone();
        let c = self.config;
        let s = arcticd_kernels::cpu::adamw::AdamWStep::new(
            lr,
            c.beta1,
            c.beta2,
            c.eps,
            c.weight_decay,
            self.step + 1,
        );
        let params = model.params_mut().named_mut();
        let (ms, vs, gs) = (
            self.exp_avg.named_mut(),
            self.exp_avg_sq.named_mut(),
            grads.named(),
        );
        if params.len() != gs.len() || ms.len() != gs.len() {
            return Err(Error::Shape(format!(
                "{} gradients for {} parameters",
                gs.len(),
                params.len()
            )));
        }
        for ((((name, p), (_, m)), (_, v)), (gname, g)) in
            params.into_iter().zip(ms).zip(vs).zip(gs)
        {
            if name != gname {
                return Err(Error::Shape(format!(
                    "gradient {gname} does not match parameter {name}"
                )));
            }
            dev.adamw_update(p.f32_mut(&name)?, m, v, None, g, &s)?;
        }
        self.step += 1;
        Ok(())
    }
}

impl CudaAdamW {
    /// The state as the CPU's optimizer holds it (masters from `model`'s
    /// parameters, the moments downloaded), to write with a checkpoint.
    pub fn to_host(&self, model: &CudaModel, host: &Qwen3_5) -> Result<crate::optim::AdamW> {
        let dev = model.device();
        let mut opt = crate::optim::AdamW::new(host, self.config)?;
        opt.step = self.step;
        for (dst, src) in [
            (&mut opt.exp_avg, &self.exp_avg),
            (&mut opt.exp_avg_sq, &self.exp_avg_sq),
        ] {
            for (d, (_, s)) in dst.iter_mut().zip(src.named()) {
                *d = dev.download(s)?;
            }
        }
        Ok(opt)
    }

    /// Takes the moments, step count and settings of `host` (a checkpoint's
    /// optimizer state), uploaded to `dev`.
    pub fn load_host(&mut self, dev: &CudaDevice, host: &AdamW) -> Result<()> {
        for (dst, src) in [
            (&mut self.exp_avg, &host.exp_avg),
            (&mut self.exp_avg_sq, &host.exp_avg_sq),
        ] {
            let named = dst.named_mut();
            if named.len() != src.len() {
                return Err(Error::Shape(format!(
                    "{} optimizer tensors for {} parameters",
                    src.len(),
                    named.len()
                )));
            }
            for ((name, d), s) in named.into_iter().zip(src) {
                if d.len() != s.len() {
                    return Err(Error::Shape(format!(
                        "optimizer state {name}: {} values for {}",
                        s.len(),
                        d.len()
                    )));
                }
                *d = dev.upload(s)?;
            }
        }
        self.step = host.step;
        self.config = host.config;
        Ok(())
    }
}

/// Scales the gradients to a global norm of at most `max_norm` (as the
/// CPU's `optim::clip_grad_norm`: per-tensor sums of squares in f64, in
/// parameter order); returns the norm before.
pub fn clip_grad_norm(dev: &CudaDevice, grads: &mut Qwen3_5<Buf>, max_norm: f64) -> Result<f64> {
    let total = global_norm(dev, grads)?;
    let coef = (max_norm / (total + 1e-6)).min(1.0);
    if coef < 1.0 {
        for (_, g) in grads.named_mut() {
            dev.scale(g, coef as f32)?;
        }
    }
    Ok(total)
}

/// The gradients' global L2 norm: per-tensor sums of squares in f64, in
/// parameter order.
pub fn global_norm(dev: &CudaDevice, grads: &Qwen3_5<Buf>) -> Result<f64> {
    let mut ss = 0.0f64;
    for (_, g) in grads.named() {
        ss += dev.sum_squares(g)?;
    }
    Ok(ss.sqrt())
}

/// A trainer's device on a GPU: the model's f32 parameters on the device
/// are the AdamW masters (the backward's products take f32 weights), the
/// gradients and moments beside them. [`crate::step::Trainer`] runs its
/// steps over this as over the CPU, so SFT and the policy-gradient loss,
/// micro-batches, clipping, the data-parallel sync and the metrics are the
/// CPU trainer's code.
///
/// After each step the engines on the GPU read the new weights from the
/// bf16 copy written there in place ([`share_with_engines`](Self::share_with_engines));
/// the host's tensors are left behind, under the new version, until
/// something on the host reads them ([`StepDevice::sync_host`]: a
/// checkpoint, an evaluation's copy, the ranks' checksum), so a step moves
/// no weights across the bus. In a data-parallel group the
/// gradients are summed on the host through the communicator. The entropy
/// term, the KL reference (a frozen f32 copy on the same device) and
/// layer recomputation (`recompute_layers`: only each layer's input kept,
/// the layer run again in the backward) run there too.
pub struct CudaStep {
    store: Arc<ParamStore>,
    model: CudaModel,
    opt: CudaAdamW,
    grads: Qwen3_5<Buf>,
    /// The fixed policy of the KL-to-reference term, on the device.
    reference: Option<CudaModel>,
    /// The engines' weights on this GPU, written in place after each step
    /// ([`share_with_engines`](Self::share_with_engines)).
    shared: Option<Arc<RwLock<CudaModel>>>,
    /// This rank's NCCL communicator: the gradients are summed across the
    /// ranks' GPUs in place (else through the host communicator).
    nccl: Option<NcclRank>,
    /// The last forward's trace, until its backward.
    last: Option<Kept>,
}

struct Kept {
    sequences: Vec<Vec<u32>>,
    trace: CudaTrace,
    rows: Vec<usize>,
    targets: Vec<u32>,
}

impl CudaStep {
    /// Uploads the store's model to `dev` in f32, with fresh AdamW state.
    pub fn new(store: Arc<ParamStore>, dev: Arc<CudaDevice>, config: AdamWConfig) -> Result<Self> {
        config.check()?;
        let model = CudaModel::upload(&store.read(), dev, WeightDType::F32)?;
        let opt = CudaAdamW::new(&model, config)?;
        let grads = zero_grads(&model)?;
        Ok(CudaStep {
            store,
            model,
            opt,
            grads,
            reference: None,
            shared: None,
            nccl: None,
            last: None,
        })
    }

    /// Sums the gradients across ranks over NCCL, on the device, instead of
    /// through the host communicator ([`nccl_world`]).
    pub fn with_nccl(mut self, rank: NcclRank) -> Self {
        self.nccl = Some(rank);
        self
    }

    /// Keeps the engines' weights on this GPU (bf16 matrices, as a GPU
    /// engine holds them) and writes them in place from the masters after
    /// every step, while the engines are paused; the copy is published in
    /// the store, so an engine on this GPU reads it after an update instead
    /// of uploading the host copy again.
    pub fn share_with_engines(&mut self) -> Result<()> {
        let dev = self.model.device().clone();
        let copy = CudaModel::upload(&self.store.read(), dev.clone(), WeightDType::Bf16)?;
        let model = Arc::new(RwLock::new(copy));
        self.store.publish_device_copy(DeviceCopy {
            ordinal: dev.ordinal(),
            version: self.store.weight_version(),
            model: model.clone(),
            written: Arc::new(dev.record_event()?),
        });
        self.shared = Some(model);
        Ok(())
    }

    /// Holds `reference` (uploaded in f32 beside the masters) as the KL
    /// term's fixed policy; it must have the trained model's shapes.
    pub fn set_reference(&mut self, reference: &Qwen3_5) -> Result<()> {
        if !crate::device::same_shapes(&self.store.read().config, &reference.config) {
            return Err(Error::Input(
                "the KL reference model's config differs from the trained model's".into(),
            ));
        }
        let dev = self.model.device().clone();
        self.reference = Some(CudaModel::upload(reference, dev, WeightDType::F32)?);
        Ok(())
    }

    /// After the masters changed (a step, a rollback): with the engines
    /// paused, writes the engines' copy on this GPU from them and moves the
    /// store to a new version there (the host's tensors stay behind until
    /// something reads them, [`StepDevice::sync_host`]); the new version
    /// and the seconds the engines were paused.
    fn publish(&mut self, gate: Option<&dyn WriteGate>) -> Result<(u64, f64)> {
        let dev = self.model.device();
        let t0 = std::time::Instant::now();
        let version = {
            let _paused = PauseGuard::pause(gate)?;
            // The engines on this GPU read the device copy; the host's
            // tensors stay behind until something reads them (sync_host).
            match &self.shared {
                Some(shared) => {
                    let mut copy = shared.write().unwrap_or_else(|e| e.into_inner());
                    write_engine_copy(&self.model, &mut copy)?;
                    // An engine's stream waits for this event before it
                    // reads the copy; none is reading it now (an engine's
                    // step ends in a download, and the engines are paused).
                    let written = Arc::new(dev.record_event()?);
                    let version = self.store.advance_on_device();
                    self.store.publish_device_copy(DeviceCopy {
                        ordinal: dev.ordinal(),
                        version,
                        model: shared.clone(),
                        written,
                    });
                    version
                }
                // No engine here (SFT, bench-train): nothing reads the
                // weights before the next sync_host.
                None => self.store.advance_on_device(),
            }
        };
        Ok((version, t0.elapsed().as_secs_f64()))
    }

    /// The model on the device (its parameters are the masters).
    pub fn model(&self) -> &CudaModel {
        &self.model
    }

    /// The gradients of the last accumulation, on the device.
    pub fn grads(&self) -> &Qwen3_5<Buf> {
        &self.grads
    }
}

impl StepDevice for CudaStep {
    fn store(&self) -> &Arc<ParamStore> {
        &self.store
    }

    fn zero_grads(&mut self) -> Result<()> {
        let dev = self.model.device().clone();
        for (_, g) in self.grads.named_mut() {
            let n = g.len();
            dev.zero_range(g, 0, n)?;
        }
        self.last = None;
        Ok(())
    }

    fn forward(
        &mut self,
        batch: MicroBatch<'_>,
        entropy: bool,
        temperature: f32,
        opts: ForwardOptions,
    ) -> Result<Scores> {
        // Token ids were checked against the vocabulary by the trainer.
        // Every sequence runs whole here (`shares_prefixes` is false, so
        // the step gives no groups): prefix sharing is the CPU trainer's.
        let keep = if opts.recompute_layers {
            Keep::Inputs
        } else {
            Keep::All
        };
        // Where the engines sample from the bf16 copy, the log-probs are
        // the copy's too (the same weights and products as the engines');
        // the gradients are the masters'.
        let copy = self
            .shared
            .as_ref()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()));
        let fwd: &CudaModel = copy.as_deref().unwrap_or(&self.model);
        let trace = fwd.forward_keeping(batch.sequences, keep)?;
        let (lp, ent) = token_logprobs(
            fwd,
            &trace.hidden,
            batch.rows,
            batch.targets,
            entropy,
            temperature,
        )?;
        let dev = self.model.device();
        let lp = dev.download(&lp)?;
        let ent = ent.map(|e| dev.download(&e)).transpose()?;
        drop(copy);
        self.last = Some(Kept {
            sequences: batch.sequences.iter().map(|s| s.to_vec()).collect(),
            trace,
            rows: batch.rows.to_vec(),
            targets: batch.targets.to_vec(),
        });
        Ok((lp, ent))
    }

    fn has_reference(&self) -> bool {
        self.reference.is_some()
    }

    /// The reference's forward is the training forward keeping only each
    /// layer's input, dropped at once.
    fn reference_logprobs(&mut self, batch: MicroBatch<'_>, temperature: f32) -> Result<Vec<f32>> {
        let r = self.reference.as_ref().ok_or_else(|| {
            Error::Input("ref_kl_coef is set but the trainer has no reference model".into())
        })?;
        let trace = r.forward_keeping(batch.sequences, Keep::Inputs)?;
        let (lp, _) = token_logprobs(
            r,
            &trace.hidden,
            batch.rows,
            batch.targets,
            false,
            temperature,
        )?;
        Ok(r.device().download(&lp)?)
    }

    fn backward(&mut self, dlp: &[f32], dentropy: Option<&[f32]>, temperature: f32) -> Result<()> {
        let k = self
            .last
            .take()
            .ok_or_else(|| Error::Shape("a backward without its forward".into()))?;
        let dev = self.model.device();
        let dlp = dev.upload(dlp)?;
        let dent = dentropy.map(|d| dev.upload(d)).transpose()?;
        let copy = self
            .shared
            .as_ref()
            .map(|s| s.read().unwrap_or_else(|e| e.into_inner()));
        let fwd: &CudaModel = copy.as_deref().unwrap_or(&self.model);
        let dhidden = token_logprobs_backward(
            &self.model,
            fwd,
            &mut self.grads,
            &k.trace.hidden,
            &k.rows,
            &k.targets,
            &dlp,
            dent.as_ref(),
            temperature,
        )?;
        let seqs: Vec<&[u32]> = k.sequences.iter().map(|s| s.as_slice()).collect();
        backward(&self.model, fwd, &seqs, &k.trace, &dhidden, &mut self.grads)
    }

    fn all_reduce_grads(&mut self, comm: &dyn Communicator) -> Result<()> {
        let dev = self.model.device().clone();
        if let Some(n) = &self.nccl {
            // On the device's stream, in order with the backward that made
            // the gradients and the norm that reads them.
            for (name, g) in self.grads.named_mut() {
                n.0.all_reduce_in_place(g, &ReduceOp::Sum)
                    .map_err(|e| Error::Input(format!("NCCL all-reduce of {name}: {e:?}")))?;
            }
            return Ok(());
        }
        for (_, g) in self.grads.named_mut() {
            let mut host = dev.download(g)?;
            comm.all_reduce_sum(&mut host)?;
            *g = dev.upload(&host)?;
        }
        Ok(())
    }

    fn grad_norm(&self) -> Result<(f64, bool)> {
        let n = global_norm(self.model.device(), &self.grads)?;
        Ok((n, n.is_finite()))
    }

    fn scale_grads(&mut self, s: f32) -> Result<()> {
        let dev = self.model.device().clone();
        for (_, g) in self.grads.named_mut() {
            dev.scale(g, s)?;
        }
        Ok(())
    }

    fn apply(&mut self, lr: f64, gate: Option<&dyn WriteGate>) -> Result<(u64, f64)> {
        self.opt.step(&mut self.model, &self.grads, lr)?;
        self.publish(gate)
    }

    fn restore(&mut self, point: &RestorePoint, gate: Option<&dyn WriteGate>) -> Result<u64> {
        // Everything is read and checked before the device changes: a
        // missing or mismatched checkpoint leaves the trainer as it was.
        let (saved, host) = point.load(&self.store.read().config, self.opt.config)?;
        let values = saved.named_params();
        let dev = self.model.device().clone();
        let params = self.model.params_mut().named_mut();
        if params.len() != values.len() || params.iter().zip(&values).any(|(p, v)| p.0 != v.0) {
            return Err(Error::Checkpoint(format!(
                "{}: its parameters are not the trained model's",
                point.dir().display()
            )));
        }
        for ((name, p), (_, t)) in params.into_iter().zip(values) {
            *p.f32_mut(&name)? = dev.upload(t.as_f32()?)?;
        }
        self.opt.load_host(&dev, &host)?;
        self.last = None;
        Ok(self.publish(gate)?.0)
    }

    fn sync_host(&mut self) -> Result<()> {
        if self.store.host_behind().is_none() {
            return Ok(());
        }
        // The masters are still: steps run on this thread, after this.
        let dev = self.model.device();
        let values = self
            .model
            .params()
            .named()
            .into_iter()
            .map(|(name, p)| Ok(dev.download(p.f32(&name)?)?))
            .collect::<Result<Vec<Vec<f32>>>>()?;
        self.store.refresh_host(|m| write_values(m, &values))
    }

    fn steps(&self) -> u64 {
        self.opt.step
    }

    fn host_optimizer(&self) -> Result<Cow<'_, AdamW>> {
        Ok(Cow::Owned(
            self.opt.to_host(&self.model, &self.store.read())?,
        ))
    }

    fn load_optimizer(&mut self, dir: &Path) -> Result<()> {
        let mut host = AdamW::new(&self.store.read(), self.opt.config)?;
        crate::checkpoint::load_optimizer(dir, &mut host)?;
        self.opt.load_host(self.model.device(), &host)
    }
}

/// Writes `values` (one per parameter, in the walk's order) into `model`.
fn write_values(model: &mut Qwen3_5, values: &[Vec<f32>]) -> Result<()> {
    let params = model.named_params_mut();
    if params.len() != values.len() {
        return Err(Error::Shape(format!(
            "{} values for {} parameters",
            values.len(),
            params.len()
        )));
    }
    for ((name, t), v) in params.into_iter().zip(values) {
        let dst = t.as_f32_mut()?;
        if dst.len() != v.len() {
            return Err(Error::Shape(format!(
                "{name}: {} values for {}",
                v.len(),
                dst.len()
            )));
        }
        dst.copy_from_slice(v);
    }
    Ok(())
}

/// The CUDA side of the backward over one packed batch.
struct CudaBackward<'a> {
    dev: &'a CudaDevice,
    config: &'a ModelConfig,
    ids: Vec<u32>,
    /// `(start, len)` of each sequence.
    spans: Vec<(usize, usize)>,
    positions: CudaSlice<u32>,
    /// The model that ran the forward and the sequences, for a layer
    /// recomputed from its input.
    model: &'a CudaModel,
    sequences: &'a [&'a [u32]],
}

impl CudaBackward<'_> {
    /// Rows `start..start + n` of `x`, rows of `width`.
    fn rows(&self, x: &Buf, width: usize, (start, n): (usize, usize)) -> Result<Buf> {
        let mut out = self.dev.zeros(n * width)?;
        self.dev
            .copy_block(&mut out, x, width, (start, 0), (n, width))?;
        Ok(out)
    }

    /// `part` (rows of `width`) written at row `start` of `out`.
    fn put_rows(&self, out: &mut Buf, part: &Buf, width: usize, start: usize) -> Result<()> {
        let n = part.len() / width.max(1);
        Ok(self
            .dev
            .copy_into(out, part, width, (start, 0), (n, width))?)
    }
}

impl BackwardOps for CudaBackward<'_> {
    type W = DeviceParam;
    type Buf = Buf;
    type C = ();

    fn tokens(&self) -> usize {
        self.ids.len()
    }

    fn zeros(&mut self, n: usize) -> Result<Buf> {
        Ok(self.dev.zeros(n)?)
    }

    fn linear(
        &mut self,
        l: &Linear<DeviceParam>,
        g: &mut Linear<Buf>,
        dinp: &mut Buf,
        dout: &Buf,
        inp: &Buf,
        n: usize,
    ) -> Result<()> {
        if l.bias.is_some() {
            return Err(Error::Shape(
                "a linear with a bias (Qwen3.5 has none) on CUDA".into(),
            ));
        }
        let w = weight(&l.weight)?;
        self.dev.matmul_backward(
            dinp,
            &mut g.weight,
            dout,
            inp,
            w,
            n,
            l.in_features,
            l.out_features,
        )?;
        Ok(())
    }

    fn rmsnorm(
        &mut self,
        dinp: &mut Buf,
        dw: &mut Buf,
        dout: &Buf,
        inp: &Buf,
        w: &DeviceParam,
        rstd: &Buf,
        n: usize,
        c: usize,
    ) -> Result<()> {
        let w = weight(w)?;
        Ok(self
            .dev
            .rmsnorm_backward(dinp, dw, dout, inp, w, rstd, n, c)?)
    }

    fn silu_mul(&mut self, dact: &Buf, gate: &Buf, up: &Buf) -> Result<(Buf, Buf)> {
        let (mut dgate, mut dup) = (self.dev.zeros(dact.len())?, self.dev.zeros(dact.len())?);
        self.dev
            .silu_mul_backward(&mut dgate, &mut dup, dact, gate, up)?;
        Ok((dgate, dup))
    }

    fn gated_rmsnorm(
        &mut self,
        dw: &mut Buf,
        dout: &Buf,
        x: &Buf,
        z: &Buf,
        w: &DeviceParam,
        rstd: &Buf,
        d: usize,
    ) -> Result<(Buf, Buf)> {
        let (mut dx, mut dz) = (self.dev.zeros(x.len())?, self.dev.zeros(x.len())?);
        let rows = x.len() / d.max(1);
        self.dev.gated_rmsnorm_backward(
            &mut dx,
            &mut dz,
            dw,
            dout,
            x,
            z,
            weight(w)?,
            rstd,
            rows,
            d,
        )?;
        Ok((dx, dz))
    }

    fn gated_delta(
        &mut self,
        _li: usize,
        dcore: &Buf,
        s: &LinearActs<Buf, ()>,
    ) -> Result<[Buf; 5]> {
        let (nk, nv, dk, dv) = self.config.delta_heads();
        let (qd, vd, t) = (nk * dk, nv * dv, self.tokens());
        let mut dq = self.dev.zeros(t * qd)?;
        let mut dk_ = self.dev.zeros(t * qd)?;
        let mut dv_ = self.dev.zeros(t * vd)?;
        let mut dg = self.dev.zeros(t * nv)?;
        let mut dbeta = self.dev.zeros(t * nv)?;
        // Every sequence from the zero state, in one chunked backward (the
        // spans are the packed sequences, in order from token 0).
        let cu_seqlens: Vec<u32> = std::iter::once(0)
            .chain(self.spans.iter().map(|&(st, n)| (st + n) as u32))
            .collect();
        self.dev.gated_delta_chunked_backward(
            &mut dq,
            &mut dk_,
            &mut dv_,
            &mut dg,
            &mut dbeta,
            dcore,
            None,
            &s.q,
            &s.k,
            &s.v,
            &s.g,
            &s.beta,
            &cu_seqlens,
            (nk, nv, dk, dv),
        )?;
        Ok([dq, dk_, dv_, dg, dbeta])
    }

    fn scale(&mut self, x: &mut Buf, s: f32) -> Result<()> {
        Ok(self.dev.scale(x, s)?)
    }

    fn l2norm(&mut self, dout: &Buf, inp: &Buf, rnorm: &Buf, rows: usize, d: usize) -> Result<Buf> {
        let mut dinp = self.dev.zeros(inp.len())?;
        self.dev
            .l2norm_backward(&mut dinp, dout, inp, rnorm, rows, d)?;
        Ok(dinp)
    }

    fn join_columns(&mut self, parts: &[&Buf], widths: &[usize]) -> Result<Buf> {
        let total: usize = widths.iter().sum();
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let rows = crate::backward::joined_rows(&lens, widths)?;
        let mut out = self.dev.zeros(rows * total)?;
        let mut col = 0;
        for (p, &w) in parts.iter().zip(widths) {
            self.dev
                .copy_into(&mut out, p, total, (0, col), (rows, w))?;
            col += w;
        }
        Ok(out)
    }

    fn silu(&mut self, dout: &Buf, x: &Buf) -> Result<Buf> {
        let mut dx = self.dev.zeros(x.len())?;
        self.dev.silu_backward(&mut dx, dout, x)?;
        Ok(dx)
    }

    fn conv(
        &mut self,
        _li: usize,
        la: &LinearAttention<DeviceParam>,
        dw: &mut Buf,
        dout: &Buf,
        inp: &Buf,
    ) -> Result<Buf> {
        let (c, k) = (self.config.linear_conv_dim(), self.config.conv_kernel);
        let w = weight(&la.conv1d)?;
        let mut dinp = self.dev.zeros(inp.len())?;
        let state0 = self.dev.zeros(k.saturating_sub(1) * c)?;
        for &span in &self.spans {
            let (x, d) = (self.rows(inp, c, span)?, self.rows(dout, c, span)?);
            let mut dx = self.dev.zeros(span.1 * c)?;
            self.dev
                .conv1d_backward(&mut dx, dw, None, &d, &state0, &x, w, span.1, c, k)?;
            self.put_rows(&mut dinp, &dx, c, span.0)?;
        }
        Ok(dinp)
    }

    fn gating(
        &mut self,
        la: &LinearAttention<DeviceParam>,
        g: &mut LinearAttention<Buf>,
        dg: &Buf,
        dbeta: &Buf,
        s: &LinearActs<Buf, ()>,
    ) -> Result<(Buf, Buf)> {
        let (mut da, mut db) = (self.dev.zeros(dg.len())?, self.dev.zeros(dg.len())?);
        self.dev.gated_delta_gating_backward(
            &mut da,
            &mut db,
            &mut g.a_log,
            &mut g.dt_bias,
            dg,
            dbeta,
            &s.g,
            &s.beta,
            &s.a,
            weight(&la.a_log)?,
            weight(&la.dt_bias)?,
        )?;
        Ok((da, db))
    }

    fn sigmoid_gate(&mut self, dout: &Buf, attn: &Buf, gate: &Buf) -> Result<(Buf, Buf)> {
        let (mut dattn, mut dgate) = (self.dev.zeros(dout.len())?, self.dev.zeros(dout.len())?);
        self.dev
            .sigmoid_gate_backward(&mut dattn, &mut dgate, dout, attn, gate)?;
        Ok((dattn, dgate))
    }

    fn attention(&mut self, _li: usize, dattn: &Buf, s: &FullActs<Buf>) -> Result<(Buf, Buf, Buf)> {
        let c = self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let (qrow, kvrow, t) = (nh * hd, nkv * hd, self.tokens());
        let mut dq = self.dev.zeros(t * qrow)?;
        let mut dk = self.dev.zeros(t * kvrow)?;
        let mut dv = self.dev.zeros(t * kvrow)?;
        let scale = 1.0 / (hd as f32).sqrt();
        for &span in &self.spans {
            let n = span.1;
            let (q, d) = (self.rows(&s.q, qrow, span)?, self.rows(dattn, qrow, span)?);
            let (k, v) = (self.rows(&s.k, kvrow, span)?, self.rows(&s.v, kvrow, span)?);
            let mut sq = self.dev.zeros(n * qrow)?;
            let (mut sk, mut sv) = (self.dev.zeros(n * kvrow)?, self.dev.zeros(n * kvrow)?);
            let dims = AttnDims {
                nq: n,
                nk: n,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            self.dev
                .attention_backward(&mut sq, &mut sk, &mut sv, &d, &q, &k, &v, dims, scale)?;
            self.put_rows(&mut dq, &sq, qrow, span.0)?;
            self.put_rows(&mut dk, &sk, kvrow, span.0)?;
            self.put_rows(&mut dv, &sv, kvrow, span.0)?;
        }
        Ok((dq, dk, dv))
    }

    fn qk_norm_rope(
        &mut self,
        dout: Buf,
        raw: &Buf,
        w: &DeviceParam,
        rstd: &Buf,
        heads: usize,
        dw: &mut Buf,
    ) -> Result<Buf> {
        let c = self.config;
        let mut draw = self.dev.zeros(raw.len())?;
        self.dev.qk_norm_rope_backward(
            &mut draw,
            dw,
            &dout,
            raw,
            weight(w)?,
            rstd,
            &self.positions,
            heads,
            c.head_dim,
            c.rotary_dim,
            c.rope_theta,
        )?;
        Ok(draw)
    }

    fn embedding(&mut self, dtable: &mut Buf, dx: &Buf) -> Result<()> {
        let c = self.config;
        Ok(self
            .dev
            .embedding_backward(dtable, dx, &self.ids, c.vocab_size, c.hidden_size)?)
    }

    fn recompute(
        &mut self,
        _model: &Qwen3_5<DeviceParam>,
        li: usize,
        x_in: &Buf,
    ) -> Result<LayerActs<Buf, ()>> {
        Ok(self.model.recompute_layer(li, x_in, self.sequences)?)
    }
}

/// One rank's NCCL communicator ([`nccl_world`]).
pub struct NcclRank(Comm);

// SAFETY: an NCCL communicator may be used from any thread as long as two
// threads do not use it at once; a rank's communicator is owned by that
// rank's step device and used only through `&mut self` (the all-reduce).
unsafe impl Send for NcclRank {}

/// One NCCL communicator per device of `devices` (one rank each, this
/// process), on each device's stream. An error, never a panic, when the
/// library cannot be loaded: cudarc looks for `libnccl.so`, and NCCL's
/// wheels ship only `libnccl.so.2` (link one to the other in a folder on
/// `LD_LIBRARY_PATH`).
pub fn nccl_world(devices: &[Arc<CudaDevice>]) -> Result<Vec<NcclRank>> {
    // SAFETY: only tries to open the library by its candidate names.
    if !unsafe { arcticd_kernels::cuda::cudarc::nccl::sys::is_culib_present() } {
        return Err(Error::Input(
            "the NCCL library (libnccl.so) is not on the loader path; NCCL's wheels \
             ship libnccl.so.2 only: link libnccl.so to it in a folder on LD_LIBRARY_PATH"
                .into(),
        ));
    }
    let streams = devices.iter().map(|d| d.stream().clone()).collect();
    let comms = Comm::from_devices(streams).map_err(|e| Error::Input(format!("NCCL: {e:?}")))?;
    Ok(comms.into_iter().map(NcclRank).collect())
}

/// The engines' copy of the weights from the masters, in place: bf16
/// matrices rounded (as the upload rounds them), f32 parameters copied.
fn write_engine_copy(masters: &CudaModel, copy: &mut CudaModel) -> Result<()> {
    let dev = masters.device().clone();
    for ((name, m), (_, c)) in masters
        .params()
        .named()
        .into_iter()
        .zip(copy.params_mut().named_mut())
    {
        let m = m.f32(&name)?;
        match c {
            DeviceParam::Bf16(bits) => dev.f32_to_bf16(bits, m)?,
            DeviceParam::F32(x) => dev.copy_block(x, m, m.len(), (0, 0), (1, m.len()))?,
        }
    }
    Ok(())
}

/// A parameter's f32 buffer: the backward's products take f32 weights.
fn weight(p: &DeviceParam) -> Result<&Buf> {
    Ok(p.f32("the CUDA backward needs f32 weights (WeightDType::F32)")?)
}

#[cfg(test)]
mod tests {
    //! Need a GPU; skipped without one (`ARCTICD_REQUIRE_GPU=1` makes a
    //! missing device a failure, as `scripts/gpu-check.sh` sets it).
    use super::*;
    use crate::model::{backward as cpu_backward, forward, Packed};
    use crate::ModelGrads;
    use arcticd_kernels::cuda::device::test_device;

    /// Every parameter's gradient on CUDA (f32 weights, the same upstream
    /// gradient) against the CPU backward, on packed sequences of 3, 70
    /// and 150 tokens: within 1e-3 of the largest value of each tensor
    /// (fp32, different summation orders; the worst printed).
    /// A world of one GPU over NCCL: the all-reduce leaves a rank's
    /// gradients as they are, so a step with NCCL is the step without it,
    /// bit for bit. Skipped (said) where the NCCL library does not load,
    /// unless `ARCTICD_REQUIRE_NCCL` is set.
    #[test]
    fn a_single_gpu_nccl_world_changes_nothing() {
        use crate::comm::LocalComm;
        use crate::step::{SftExample, TrainConfig, Trainer};
        let Some(dev) = test_device().map(Arc::new) else {
            return;
        };
        let ranks = match nccl_world(std::slice::from_ref(&dev)) {
            Ok(r) => r,
            Err(e) => {
                assert!(std::env::var_os("ARCTICD_REQUIRE_NCCL").is_none(), "{e}");
                eprintln!("skipped: {e}");
                return;
            }
        };
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-nccl-{}", std::process::id()));
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 12).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let vocab = model.config.vocab_size as u32;
        let config = TrainConfig::default();
        let batch = vec![SftExample {
            tokens: (0..50u32).map(|i| (i * 13 + 3) % vocab).collect(),
            loss_mask: vec![1; 50],
        }];
        let mut weights = Vec::new();
        for nccl in [None, ranks.into_iter().next()] {
            let store = crate::step::store_of(model.clone());
            let mut step = CudaStep::new(store.clone(), dev.clone(), config.optimizer).unwrap();
            if let Some(n) = nccl {
                step = step.with_nccl(n);
            }
            let comm = LocalComm::world(1).unwrap().pop().unwrap();
            let mut t = Trainer::on(step, config.clone()).with_comm(Arc::new(comm));
            t.sft_step(&batch).unwrap();
            t.sync_host().unwrap();
            weights.push(weight_bits(&store.read()));
        }
        assert_eq!(weights[0], weights[1]);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Every parameter's bits, in order.
    fn weight_bits(m: &Qwen3_5) -> Vec<u32> {
        m.named_params()
            .into_iter()
            .flat_map(|(_, t)| {
                t.as_f32()
                    .unwrap()
                    .iter()
                    .map(|x| x.to_bits())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// A rollback on the GPU is a resume: back to a checkpoint, the next
    /// step gives the weights and moments of a fresh trainer resumed from
    /// it; back to the starting model, those of a fresh trainer's first
    /// step; bit for bit (one device, the same kernels); each rollback
    /// under a new, higher version, and a missing checkpoint changes
    /// nothing.
    #[test]
    fn a_rollback_on_the_gpu_equals_a_resume() {
        use crate::device::RestorePoint;
        use crate::step::{SftExample, TrainConfig, Trainer};
        let Some(dev) = test_device().map(Arc::new) else {
            return;
        };
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-restore-{}", std::process::id()));
        let start = dir.join("start");
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &start, 5).unwrap();
        let vocab = Qwen3_5::load(&start).unwrap().config.vocab_size as u32;
        let config = TrainConfig::default();
        let batch = |k: u32| {
            vec![SftExample {
                tokens: (0..40u32).map(|i| (i * 7 + k * 31 + 1) % vocab).collect(),
                loss_mask: vec![1; 40],
            }]
        };
        let trainer = |from: &Path, resume: bool| {
            let store = crate::step::store_of(Qwen3_5::load(from).unwrap());
            let step = CudaStep::new(store, dev.clone(), config.optimizer).unwrap();
            let mut t = Trainer::on(step, config.clone());
            if resume {
                t.load_optimizer(from).unwrap();
            }
            t
        };
        // The state after a step, as the host sees it: weights, moments,
        // step count.
        let state = |t: &mut Trainer<CudaStep>| {
            t.sync_host().unwrap();
            let opt = t.optimizer().unwrap().into_owned();
            (
                weight_bits(&t.store().read()),
                opt.exp_avg,
                opt.exp_avg_sq,
                opt.step,
            )
        };

        let mut a = trainer(&start, false);
        a.sft_step(&batch(0)).unwrap();
        a.sync_host().unwrap();
        let ck = dir.join("step1");
        crate::checkpoint::save_checkpoint(
            &ck,
            &a.store().read(),
            &start,
            Some(&*a.optimizer().unwrap()),
        )
        .unwrap();
        a.sft_step(&batch(1)).unwrap();
        a.sft_step(&batch(2)).unwrap();

        // Each point, then the step the fresh trainer takes from it.
        for (point, from, resume, k) in [
            (RestorePoint::Checkpoint(ck.clone()), &ck, true, 1),
            (RestorePoint::Start(start.clone()), &start, false, 0),
        ] {
            let before = a.store().weight_version();
            let v = a.restore(&point).unwrap();
            assert!(v > before, "{point:?}: version {v} after {before}");
            a.sft_step(&batch(k)).unwrap();
            let mut fresh = trainer(from, resume);
            fresh.sft_step(&batch(k)).unwrap();
            assert!(
                state(&mut a) == state(&mut fresh),
                "{point:?}: a step after the rollback"
            );
        }

        let kept = a.store().weight_version();
        assert!(a
            .restore(&RestorePoint::Checkpoint(dir.join("missing")))
            .is_err());
        assert_eq!(a.store().weight_version(), kept);
        std::fs::remove_dir_all(&dir).ok();
    }

    /// One GPU's engine reads the trainer's weights in place: after an SFT
    /// step on a trainer sharing its weights, the store's device copy is at
    /// the new version, and an engine that followed the update (reading
    /// the copy) generates exactly what a fresh engine uploading the
    /// synced host weights generates (the same bf16 rounding of the same
    /// masters).
    #[test]
    fn the_engine_reads_the_trainers_weights_in_place() {
        engine_follows_the_trainer(false);
    }

    /// The same in the deterministic mode (trainer and engine products
    /// batch-invariant): the trainer's log-probs of the engine's tokens are
    /// the engine's, bit for bit, as on the CPU.
    #[test]
    fn batch_invariant_trainer_scores_the_engines_bits() {
        engine_follows_the_trainer(true);
    }

    fn engine_follows_the_trainer(batch_invariant: bool) {
        use crate::step::{SftExample, TrainConfig, Trainer};
        use arcticd_engine::engine::{self, EngineConfig, Request};
        use arcticd_engine::sampler::SamplingParams;
        let Some(dev) = test_device() else {
            return;
        };
        dev.set_batch_invariant(batch_invariant);
        let dev = Arc::new(dev);
        let dir = std::env::temp_dir().join(format!(
            "arcticd-cuda-shared-{}-{batch_invariant}",
            std::process::id()
        ));
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 11).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let vocab = model.config.vocab_size as u32;
        let store = crate::step::store_of(model);
        let config = TrainConfig {
            optimizer: AdamWConfig {
                lr: 1e-2,
                ..AdamWConfig::default()
            },
            ..TrainConfig::default()
        };
        let mut step = CudaStep::new(store.clone(), dev.clone(), config.optimizer).unwrap();
        step.share_with_engines().unwrap();
        let mut trainer = Trainer::on(step, config);
        let engine_config = EngineConfig {
            cache_memory: 16 << 20,
            max_num_seqs: 4,
            max_batched_tokens: 256,
            max_model_len: 1024,
            device: arcticd_kernels::Device::Cuda(dev.ordinal()),
            batch_invariant,
            ..Default::default()
        };
        let follower = engine::start(store.clone(), None, engine_config.clone()).unwrap();
        let greedy = || Request {
            prompt: (0..40u32).map(|i| (i * 97 + 5) % vocab).collect(),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(12)
            },
        };
        follower.generate_blocking(greedy()).unwrap();
        let batch = vec![SftExample {
            tokens: (0..60u32).map(|i| (i * 31 + 7) % vocab).collect(),
            loss_mask: vec![1; 60],
        }];
        trainer.sft_step(&batch).unwrap();
        let copy = store.device_copy(dev.ordinal()).unwrap();
        assert_eq!(copy.version, store.weight_version());
        let after = follower.generate_blocking(greedy()).unwrap();
        // The trainer scores those tokens with the copy the engine sampled
        // from (its forward reads the bf16 copy, not the f32 masters): the
        // same weights and products, so the same log-probs but for the
        // batch-dependence of cuBLAS's kernels (the engine ran 40 + 1 rows,
        // then 1 row a step; the trainer runs 52 at once).
        let prompt = greedy().prompt;
        let seq: Vec<u32> = prompt.iter().chain(&after[0].tokens).copied().collect();
        let n = after[0].tokens.len();
        let rows: Vec<usize> = (prompt.len() - 1..seq.len() - 1).collect();
        let (lp, _) = trainer
            .dev
            .forward(
                crate::device::MicroBatch {
                    sequences: &[&seq],
                    rows: &rows,
                    targets: &seq[prompt.len()..],
                    groups: &[],
                },
                false,
                1.0,
                crate::model::ForwardOptions::default(),
            )
            .unwrap();
        assert_eq!(lp.len(), n);
        let worst = lp
            .iter()
            .zip(&after[0].logprobs)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        eprintln!(
            "trainer (bf16 copy) vs engine log-probs (batch-invariant {batch_invariant}): \
             max |diff| {worst:e}"
        );
        let bound = if batch_invariant { 0.0 } else { 1e-4 };
        assert!(
            worst <= bound,
            "trainer vs engine log-probs differ by {worst}"
        );
        // The host's tensors are behind until synced; a fresh store of
        // them, with no device copy, makes the fresh engine upload.
        assert_eq!(store.host_behind(), Some((0, 1)));
        trainer.sync_host().unwrap();
        let host =
            arcticd_engine::ParamStore::with_version(store.read().clone(), store.weight_version());
        let fresh = engine::start(host, None, engine_config).unwrap();
        let want = fresh.generate_blocking(greedy()).unwrap();
        assert_eq!(after[0].tokens, want[0].tokens);
        let bits = |c: &engine::Choice| c.logprobs.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&after[0]), bits(&want[0]));
        assert_eq!(after[0].weight_versions, want[0].weight_versions);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn cuda_gradients_match_the_cpu() {
        let Some(dev) = test_device().map(Arc::new) else {
            return;
        };
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-grads-{}", std::process::id()));
        arcticd_engine::init::init_model(arcticd_engine::init::TINY, &dir, 9).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let vocab = model.config.vocab_size as u32;
        let seqs: Vec<Vec<u32>> = [3usize, 70, 150]
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 389 + 17) % vocab).collect())
            .collect();
        let h = model.config.hidden_size;
        let t: usize = seqs.iter().map(Vec::len).sum();
        let dhidden: Vec<f32> = (0..t * h)
            .map(|i| ((i * 7919 % 1000) as f32 / 1000.0 - 0.5) * 0.1)
            .collect();

        let acts = forward(&model, Packed::new(&seqs, model.config.vocab_size).unwrap()).unwrap();
        let mut want = ModelGrads::zeros_like(&model);
        cpu_backward(&model, &acts, &dhidden, &mut want).unwrap();

        let on_gpu = CudaModel::upload(&model, dev.clone(), WeightDType::F32).unwrap();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let trace = on_gpu.forward_keeping(&refs, Keep::All).unwrap();
        let mut got = zero_grads(&on_gpu).unwrap();
        let dh = dev.upload(&dhidden).unwrap();
        backward(&on_gpu, &on_gpu, &refs, &trace, &dh, &mut got).unwrap();

        let mut worst = (0.0f32, String::new());
        for ((name, g), (wname, w)) in got.named().into_iter().zip(want.named()) {
            assert_eq!(name, wname);
            let g = dev.download(g).unwrap();
            let scale = w.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
            let err = g
                .iter()
                .zip(w)
                .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
                / scale;
            if err > worst.0 {
                worst = (err, name.clone());
            }
            assert!(err <= 1e-3, "{name}: {err:.3e} of its largest value");
        }
        eprintln!("gradients: worst {:.3e} ({})", worst.0, worst.1);

        // The loss's log-probs and their backward, at T = 0.7, on rows of
        // every sequence: against the CPU's, and the head's gradient too.
        let rows: Vec<usize> = (0..t - 1).filter(|r| r % 3 != 1).collect();
        let all: Vec<u32> = seqs.concat();
        let targets: Vec<u32> = rows.iter().map(|&r| all[r + 1]).collect();
        let dlp: Vec<f32> = (0..rows.len()).map(|i| -1.0 / (1.0 + i as f32)).collect();
        let want_lp =
            crate::model::token_logprobs_entropy(&model, &acts.hidden, &rows, &targets, false, 0.7)
                .unwrap()
                .0;
        let (lp, _) = token_logprobs(&on_gpu, &trace.hidden, &rows, &targets, false, 0.7).unwrap();
        let lp = dev.download(&lp).unwrap();
        let d = lp
            .iter()
            .zip(&want_lp)
            .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        eprintln!("log-probs: max |CUDA - CPU| = {d:.3e}");
        assert!(d <= 2e-4, "{d}");
        let mut want_g = ModelGrads::zeros_like(&model);
        let want_dh = crate::model::token_logprobs_entropy_backward(
            &model,
            &mut want_g,
            &acts.hidden,
            &rows,
            &targets,
            &dlp,
            None,
            0.7,
        )
        .unwrap();
        let mut got_g = zero_grads(&on_gpu).unwrap();
        let dlp_dev = dev.upload(&dlp).unwrap();
        let dh = token_logprobs_backward(
            &on_gpu,
            &on_gpu,
            &mut got_g,
            &trace.hidden,
            &rows,
            &targets,
            &dlp_dev,
            None,
            0.7,
        )
        .unwrap();
        let rel = |a: &[f32], b: &[f32]| {
            let scale = b.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
            a.iter()
                .zip(b)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale
        };
        assert!(rel(&dev.download(&dh).unwrap(), &want_dh) <= 1e-3);
        let head = |g: &Qwen3_5<Buf>| g.lm_head.as_ref().unwrap_or(&g.embed_tokens).clone();
        let got_head = dev.download(&head(&got_g)).unwrap();
        let want_head = want_g.lm_head.as_ref().unwrap_or(&want_g.embed_tokens);
        assert!(rel(&got_head, want_head) <= 1e-3);

        // The trainer on both devices, the same code over each device:
        // three SFT steps, then three policy-gradient steps with an entropy
        // bonus and a KL term to the starting model, each in two micro-batches (forward, log-probs, the loss, backward, clipping,
        // AdamW, the write of the host store). The losses within 1e-4; the
        // weights after within a mean of 1e-2 of an AdamW step each (a
        // near-zero gradient's sign can flip a step); the host store the
        // engines read holds the device's masters.
        use crate::step::{PgExample, SftExample, TrainConfig, Trainer};
        let batch: Vec<SftExample> = seqs
            .iter()
            .map(|s| SftExample {
                tokens: s.clone(),
                loss_mask: (0..s.len()).map(|i| u8::from(i % 4 != 0)).collect(),
            })
            .collect();
        let lr = 1e-3;
        let config = TrainConfig {
            optimizer: AdamWConfig {
                lr,
                ..AdamWConfig::default()
            },
            grad_clip: Some(1.0),
            micro_batch_tokens: 100,
            ..TrainConfig::default()
        };
        let mut cpu = Trainer::new(crate::step::store_of(model.clone()), config.clone()).unwrap();
        let gpu_store = crate::step::store_of(model.clone());
        let mut gpu = Trainer::on(
            CudaStep::new(gpu_store.clone(), dev.clone(), config.optimizer).unwrap(),
            config,
        );
        for step in 0..3 {
            let (g, c) = (gpu.sft_step(&batch).unwrap(), cpu.sft_step(&batch).unwrap());
            eprintln!("sft step {step}: loss CUDA {:.6} CPU {:.6}", g.loss, c.loss);
            assert_eq!(g.micro_batches, 2);
            assert!(
                (g.loss - c.loss).abs() <= 1e-4,
                "step {step}: {g:?} vs {c:?}"
            );
        }
        let pg: Vec<PgExample> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| PgExample {
                tokens: s.clone(),
                loss_mask: (0..s.len()).map(|t| u8::from(t >= s.len() / 2)).collect(),
                behaviour_logprobs: vec![-3.0; s.len()],
                proximal_logprobs: None,
                advantage: if i % 2 == 0 { 1.0 } else { -0.5 },
                weight_versions: Vec::new(),
            })
            .collect();
        gpu.config.pg.entropy_coef = 0.01;
        cpu.config.pg.entropy_coef = 0.01;
        // A KL term to the starting model, held by each device.
        gpu.config.pg.ref_kl_coef = 0.05;
        cpu.config.pg.ref_kl_coef = 0.05;
        gpu.dev.set_reference(&model).unwrap();
        cpu.dev.set_reference(model.clone()).unwrap();
        for step in 0..3 {
            let (g, c) = (gpu.pg_step(&pg).unwrap(), cpu.pg_step(&pg).unwrap());
            eprintln!("pg step {step}: loss CUDA {:.6} CPU {:.6}", g.loss, c.loss);
            assert!(
                (g.loss - c.loss).abs() <= 1e-4,
                "step {step}: {g:?} vs {c:?}"
            );
        }
        // The steps left the host's tensors at version 0, under version 6
        // (the checksum of a group would have synced them); a sync brings
        // them to the masters' values.
        assert_eq!(gpu_store.host_behind(), Some((0, 6)));
        gpu.sync_host().unwrap();
        assert_eq!(gpu_store.host_behind(), None);
        let (mut sum, mut count) = (0.0f64, 0usize);
        let host = gpu_store.read();
        let cpu_model = cpu.store().read();
        for (((name, p), (_, h)), (_, w)) in gpu
            .dev
            .model()
            .params()
            .named()
            .into_iter()
            .zip(host.named_params())
            .zip(cpu_model.named_params())
        {
            let got = dev.download(p.f32(&name).unwrap()).unwrap();
            assert_eq!(got.as_slice(), h.as_f32().unwrap(), "{name}: host store");
            for (a, b) in got.iter().zip(w.as_f32().unwrap()) {
                sum += (a - b).abs() as f64;
                count += 1;
            }
        }
        let mean = sum / count as f64;
        eprintln!("mean |weight CUDA - CPU| after 6 steps = {mean:.3e}");
        assert!(mean <= 6.0 * 1e-2 * lr, "{mean}");
        drop((host, cpu_model));
        assert_eq!(gpu_store.weight_version(), 6);
        // Layers recomputed in the backward: the same step as keeping them.
        gpu.config.recompute_layers = true;
        cpu.config.recompute_layers = true;
        let (g, c) = (gpu.sft_step(&batch).unwrap(), cpu.sft_step(&batch).unwrap());
        assert!(
            (g.loss - c.loss).abs() <= 1e-4,
            "recomputed: {g:?} vs {c:?}"
        );

        // A bf16 model cannot run the backward (f32 products): an error.
        let bf16 = CudaModel::upload(&model, dev.clone(), WeightDType::Bf16).unwrap();
        let trace = bf16.forward_keeping(&refs, Keep::All).unwrap();
        let mut g = zero_grads(&bf16).unwrap();
        let err = backward(&bf16, &bf16, &refs, &trace, &dh, &mut g).unwrap_err();
        assert!(err.to_string().contains("f32 weights"), "{err}");
        std::fs::remove_dir_all(&dir).ok();
    }
}
