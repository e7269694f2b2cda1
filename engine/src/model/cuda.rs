//! The CUDA side of the layer code ([`LayerOps`]), and a model held on a
//! GPU that scores sequences ([`CudaModel`]). The layer code is the one the
//! CPU runs (`Qwen3_5::layer_forward`); only the ops differ: the NVRTC
//! kernels of `arcticd_kernels::cuda` and cuBLAS products on device
//! buffers, the recurrent state in fp32 as on the CPU.
//!
//! Weights: matrices (the linears, the embedding, the head) in bf16 or
//! f32 ([`WeightDType`]); vectors and the conv kernel always f32. With
//! bf16 matrices a product's input is rounded to bf16 too (cuBLAS takes
//! both operands in one type) and sums in fp32; with f32 ones the products
//! are fp32 throughout (no TF32), which is what the GPU tests compare with
//! the CPU at a tight bound.
//!
//! A forward runs a packed batch of sequences ([`PagedSeq`]), each
//! continuing from its own past: its conv and recurrent state in a state
//! slot, its keys and values in the blocks of its block table, all in a
//! [`DeviceCache`] (the engine's paged cache, placed on the GPU). The
//! engine's scheduler drives it as it drives the CPU model; scoring and
//! greedy generation use a cache of one slot ([`CudaSeqCache`]). The
//! training forward ([`CudaModel::forward_keeping`]) is the same forward
//! over fresh sequences with every layer's activations kept on the device
//! (no recurrent-state checkpoints: the CUDA gated-delta backward replays
//! each sequence from its zero initial state).
//!
//! Not for: the layer's structure (`qwen3_5`), the kernels themselves.

use super::ops::LayerOps;
use super::paged_batch::{PagedBatch, PagedSeq};
use super::qwen3_5::{Linear, LinearAttention, Qwen3_5};
use super::saved::{Keep, Kept, LayerActs};
use super::{logit_rows_per_chunk, PrefillForm};
use crate::config::{LayerType, ModelConfig};
use crate::kv_cache::{CacheLayout, SlotId};
use crate::sampler::{score_rows, Sampled};
use crate::{Error, Result};
use arcticd_kernels::cuda::cudarc::driver::CudaSlice;
use arcticd_kernels::cuda::device::{CudaDevice, Mat, MatMut};
use arcticd_kernels::Tensor;
use half::bf16;
use std::sync::Arc;

pub use super::WeightDType;

/// A parameter on the device.
pub enum DeviceParam {
    F32(CudaSlice<f32>),
    /// bf16 as raw bits.
    Bf16(CudaSlice<u16>),
}

impl DeviceParam {
    /// The f32 buffer, or an error naming `what` when the device holds bf16.
    pub fn f32(&self, what: &str) -> Result<&CudaSlice<f32>> {
        match self {
            DeviceParam::F32(s) => Ok(s),
            DeviceParam::Bf16(_) => Err(Error::Invariant(format!(
                "{what}: an f32 parameter was expected, the device holds bf16"
            ))),
        }
    }

    fn mat(&self) -> Mat<'_> {
        match self {
            DeviceParam::F32(s) => Mat::F32(s),
            DeviceParam::Bf16(s) => Mat::Bf16(s),
        }
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        match self {
            DeviceParam::F32(s) => s.len() * 4,
            DeviceParam::Bf16(s) => s.len() * 2,
        }
    }

    /// [`f32`](Self::f32), writable.
    pub fn f32_mut(&mut self, what: &str) -> Result<&mut CudaSlice<f32>> {
        match self {
            DeviceParam::F32(s) => Ok(s),
            DeviceParam::Bf16(_) => Err(Error::Invariant(format!(
                "{what}: an f32 parameter was expected, the device holds bf16"
            ))),
        }
    }

    /// Values held.
    pub fn len(&self) -> usize {
        match self {
            DeviceParam::F32(s) => s.len(),
            DeviceParam::Bf16(s) => s.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Whether `upload` holds `t` in bf16: the matrices, when asked for.
fn held_in_bf16(t: &Tensor, dtype: WeightDType) -> bool {
    t.shape().len() == 2 && dtype == WeightDType::Bf16
}

/// A Qwen3.5 model on one GPU.
pub struct CudaModel {
    dev: Arc<CudaDevice>,
    model: Qwen3_5<DeviceParam>,
    dtype: WeightDType,
}

impl std::fmt::Debug for CudaModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaModel({:?}, {:?})", self.dev, self.dtype)
    }
}

impl CudaModel {
    /// Copies `model`'s parameters to `dev`: matrices (2-D parameters) in
    /// `dtype`, every other parameter in f32.
    /// A model whose linear-attention key heads are wider than the CUDA
    /// recurrence holds is refused here, before anything is copied.
    pub fn upload(model: &Qwen3_5, dev: Arc<CudaDevice>, dtype: WeightDType) -> Result<Self> {
        let config = &model.config;
        if config.layer_types.contains(&LayerType::LinearAttention) {
            let (_, _, dk, _) = config.delta_heads();
            arcticd_kernels::cuda::device::check_register_columns("the model on CUDA", dk)?;
        }
        let on_device = model.try_map(|name, t: &Tensor| -> Result<DeviceParam> {
            let values = t
                .as_f32()
                .map_err(|e| Error::Weights(format!("{name}: {e}")))?;
            if held_in_bf16(t, dtype) {
                let bits: Vec<u16> = values
                    .iter()
                    .map(|&x| bf16::from_f32(x).to_bits())
                    .collect();
                return Ok(DeviceParam::Bf16(dev.upload(&bits)?));
            }
            Ok(DeviceParam::F32(dev.upload(values)?))
        })?;
        Ok(CudaModel {
            dev,
            model: on_device,
            dtype,
        })
    }

    /// Bytes [`upload`](Self::upload) will take on the device for `model`.
    pub fn upload_bytes(model: &Qwen3_5, dtype: WeightDType) -> usize {
        model
            .named()
            .iter()
            .map(|(_, t)| t.numel() * if held_in_bf16(t, dtype) { 2 } else { 4 })
            .sum()
    }

    /// The parameters on the device.
    pub fn params(&self) -> &Qwen3_5<DeviceParam> {
        &self.model
    }

    /// Copies the parameters back into `model` (same shapes), each widened
    /// to f32 when the device holds bf16.
    pub fn download_into(&self, model: &mut Qwen3_5) -> Result<()> {
        let dev = &*self.dev;
        for ((name, p), (hname, t)) in self.model.named().into_iter().zip(model.named_params_mut())
        {
            let values = match p {
                DeviceParam::F32(s) => dev.download(s)?,
                DeviceParam::Bf16(s) => dev
                    .download(s)?
                    .into_iter()
                    .map(|b| bf16::from_bits(b).to_f32())
                    .collect(),
            };
            let dst = t
                .as_f32_mut()
                .map_err(|e| Error::Weights(format!("{hname}: {e}")))?;
            if name != hname || dst.len() != values.len() {
                return Err(Error::Invariant(format!(
                    "device parameter {name} does not match {hname}"
                )));
            }
            dst.copy_from_slice(&values);
        }
        Ok(())
    }

    /// The parameters on the device, to update in place (the optimizer).
    pub fn params_mut(&mut self) -> &mut Qwen3_5<DeviceParam> {
        &mut self.model
    }

    pub fn device(&self) -> &Arc<CudaDevice> {
        &self.dev
    }

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Bytes of parameters on the device.
    pub fn param_bytes(&self) -> usize {
        self.model.named().iter().map(|(_, p)| p.bytes()).sum()
    }

    /// An empty state for one sequence of at most `capacity` positions:
    /// a cache of one state slot and the blocks for `capacity` positions.
    pub fn new_cache(&self, capacity: usize) -> Result<CudaSeqCache> {
        let layout = CacheLayout::new(&self.model.config);
        let blocks = capacity.div_ceil(KV_BLOCK).max(1);
        Ok(CudaSeqCache {
            cache: DeviceCache::new(self.dev.clone(), &layout, KV_BLOCK, blocks, 1)?,
            blocks: (0..blocks as u32).collect(),
            len: 0,
            capacity,
        })
    }

    /// Runs `tokens` after what `cache` holds; returns the final hidden
    /// states (after the final norm) `[tokens, hidden]` on the device.
    pub fn forward(&self, cache: &mut CudaSeqCache, tokens: &[u32]) -> Result<CudaSlice<f32>> {
        if cache.len + tokens.len() > cache.capacity {
            return Err(Error::Input(format!(
                "{} tokens after {} do not fit a sequence cache of {}",
                tokens.len(),
                cache.len,
                cache.capacity
            )));
        }
        let seq = PagedSeq {
            tokens,
            past: cache.len,
            slot: 0,
            blocks: &cache.blocks,
        };
        let hidden = self.forward_batch(&mut cache.cache, &[seq], PrefillForm::Recurrent)?;
        cache.len += tokens.len();
        Ok(hidden)
    }

    /// Runs a packed batch, each sequence after its past in `cache`;
    /// returns the final hidden states (after the final norm) `[sum of new
    /// tokens, hidden]`, sequences in order. Each sequence's state slot
    /// and blocks advance in place; `form` is how the recurrence runs over
    /// each sequence's new tokens.
    pub fn forward_batch(
        &self,
        cache: &mut DeviceCache,
        seqs: &[PagedSeq<'_>],
        form: PrefillForm,
    ) -> Result<CudaSlice<f32>> {
        self.forward_batch_on(&self.dev, cache, seqs, form)
    }

    /// [`forward_batch`](Self::forward_batch) launched through `dev`, a
    /// handle of the same GPU owned by the caller's thread (weights shared
    /// between threads are read through each thread's own handle: a cuBLAS
    /// handle is not for two threads at once).
    pub fn forward_batch_on(
        &self,
        dev: &CudaDevice,
        cache: &mut DeviceCache,
        seqs: &[PagedSeq<'_>],
        form: PrefillForm,
    ) -> Result<CudaSlice<f32>> {
        let c = &self.model.config;
        cache.take_fault()?;
        let mut ops = CudaOps::new(dev, c, seqs, cache)?;
        ops.form = form;
        let t = ops.t();
        let mut x = ops.embed(&self.model.embed_tokens)?;
        for li in 0..self.model.layers.len() {
            self.model.layer_forward(&mut ops, li, &mut x, t, false)?;
        }
        let (hidden, _) = ops.rmsnorm(&x, &self.model.norm, c.hidden_size, c.rms_norm_eps)?;
        Ok(hidden)
    }

    /// A cache for `sequences` from position 0 with fresh state (one slot
    /// each), and each one's block table.
    fn fresh_cache(&self, sequences: &[&[u32]]) -> Result<(DeviceCache, Vec<Vec<u32>>)> {
        let layout = CacheLayout::new(&self.model.config);
        let mut tables = Vec::with_capacity(sequences.len());
        let mut next = 0u32;
        for s in sequences {
            let n = s.len().div_ceil(KV_BLOCK).max(1) as u32;
            tables.push((next..next + n).collect::<Vec<u32>>());
            next += n;
        }
        let cache = DeviceCache::new(
            self.dev.clone(),
            &layout,
            KV_BLOCK,
            next as usize,
            sequences.len(),
        )?;
        Ok((cache, tables))
    }

    /// The training forward: `sequences`, each from position 0 with fresh
    /// state, packed back to back, through the layer code of
    /// [`forward_batch`](Self::forward_batch), keeping on the device what
    /// the CPU's [`Qwen3_5::forward_keeping`] keeps (less the
    /// recurrent-state checkpoints): every layer's activations
    /// ([`Keep::All`]) or only each layer's input ([`Keep::Inputs`], for a
    /// backward that recomputes a layer at a time with
    /// [`recompute_layer`](Self::recompute_layer)).
    pub fn forward_keeping(&self, sequences: &[&[u32]], keep: Keep) -> Result<CudaTrace> {
        let c = &self.model.config;
        let (mut cache, tables) = self.fresh_cache(sequences)?;
        let seqs = fresh_seqs(sequences, &tables);
        let mut ops = CudaOps::new(&self.dev, c, &seqs, &mut cache)?;
        let t = ops.t();
        let mut x = ops.embed(&self.model.embed_tokens)?;
        let mut layers = Vec::with_capacity(self.model.layers.len());
        for li in 0..self.model.layers.len() {
            if keep == Keep::Inputs {
                let x_in = ops.duplicate(&x)?;
                self.model.layer_forward(&mut ops, li, &mut x, t, false)?;
                layers.push(Kept::Input(x_in));
                continue;
            }
            let acts = self.model.layer_forward(&mut ops, li, &mut x, t, true)?;
            let acts =
                acts.ok_or_else(|| Error::Invariant(format!("layer {li} kept no activations")))?;
            layers.push(Kept::All(Box::new(acts)));
        }
        let (hidden, final_rstd) =
            ops.rmsnorm(&x, &self.model.norm, c.hidden_size, c.rms_norm_eps)?;
        Ok(CudaTrace {
            layers,
            x_last: x,
            final_rstd,
            hidden,
        })
    }

    /// Layer `li`'s activations again, from its input `x_in`, for the
    /// sequences of a [`forward_keeping`](Self::forward_keeping) with
    /// [`Keep::Inputs`]: the same code on fresh state, so the same numbers.
    pub fn recompute_layer(
        &self,
        li: usize,
        x_in: &CudaSlice<f32>,
        sequences: &[&[u32]],
    ) -> Result<LayerActs<CudaSlice<f32>, ()>> {
        let c = &self.model.config;
        if li >= self.model.layers.len() {
            return Err(Error::Input(format!(
                "layer {li} of a model with {} layers",
                self.model.layers.len()
            )));
        }
        let (mut cache, tables) = self.fresh_cache(sequences)?;
        let seqs = fresh_seqs(sequences, &tables);
        let mut ops = CudaOps::new(&self.dev, c, &seqs, &mut cache)?;
        let t = ops.t();
        if x_in.len() != t * c.hidden_size {
            return Err(Error::Input(format!(
                "layer input of {} values for {t} tokens",
                x_in.len()
            )));
        }
        let mut x = ops.duplicate(x_in)?;
        self.model
            .layer_forward(&mut ops, li, &mut x, t, true)?
            .ok_or_else(|| Error::Invariant(format!("layer {li} kept no activations")))
    }

    /// The output projection of `n` gathered hidden rows (`[n, hidden]`):
    /// logits `[n, vocab]` on the device, as the engine computes them (with
    /// bf16 weights the rows are rounded to bf16 for the product).
    pub fn project(&self, rows: &CudaSlice<f32>, n: usize) -> Result<CudaSlice<f32>> {
        self.logits(rows, 0, n)
    }

    /// Logits `[rows.len(), vocab]` of the given rows of `hidden`, on the
    /// host (the engine samples there).
    pub fn logits_of_rows(&self, hidden: &CudaSlice<f32>, rows: &[usize]) -> Result<Vec<f32>> {
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::with_capacity(rows.len() * vocab);
        let (h, dev) = (self.model.config.hidden_size, &*self.dev);
        for chunk in rows.chunks(logit_rows_per_chunk(vocab)) {
            let mut sel = dev.zeros::<f32>(chunk.len() * h)?;
            let which: Vec<u32> = chunk.iter().map(|&r| r as u32).collect();
            dev.gather_rows(&mut sel, hidden, &which, h)?;
            let logits = self.logits(&sel, 0, chunk.len())?;
            out.extend(dev.download(&logits)?);
        }
        Ok(out)
    }

    /// For each hidden row `rows[i]`: with a draw `draws[i]`, the token
    /// the device draws from its logits and that token's log-prob
    /// ([`CudaDevice::sample_rows`]); without one, its logits, downloaded.
    /// Returns the downloaded rows `[rows without a draw, vocab]` in order,
    /// and the picks. Launched through `dev` (see
    /// [`forward_batch_on`](Self::forward_batch_on)).
    #[allow(clippy::type_complexity)]
    pub fn picks_or_logits(
        &self,
        dev: &CudaDevice,
        hidden: &CudaSlice<f32>,
        rows: &[usize],
        draws: &[Option<crate::sampler::DeviceDraw>],
    ) -> Result<(Vec<f32>, Vec<Option<(u32, f32)>>)> {
        if draws.len() != rows.len() {
            return Err(Error::Invariant(format!(
                "{} draws for {} rows",
                draws.len(),
                rows.len()
            )));
        }
        let vocab = self.model.config.vocab_size;
        let mut out = Vec::new();
        let mut picks = Vec::with_capacity(rows.len());
        let h = self.model.config.hidden_size;
        let per = logit_rows_per_chunk(vocab);
        for (chunk, chunk_draws) in rows.chunks(per).zip(draws.chunks(per)) {
            let mut sel = dev.zeros::<f32>(chunk.len() * h)?;
            let which: Vec<u32> = chunk.iter().map(|&r| r as u32).collect();
            dev.gather_rows(&mut sel, hidden, &which, h)?;
            let logits = self.logits_on(dev, &sel, 0, chunk.len())?;
            let drawn: Vec<usize> = (0..chunk.len())
                .filter(|&i| chunk_draws[i].is_some())
                .collect();
            let mut made = if drawn.len() == chunk.len() {
                let d: Vec<_> = chunk_draws.iter().map(|d| d.flatten()).collect();
                dev.sample_rows(&logits, &d, vocab)?
            } else if drawn.is_empty() {
                Vec::new()
            } else {
                let idx: Vec<u32> = drawn.iter().map(|&i| i as u32).collect();
                let mut sub = dev.zeros::<f32>(drawn.len() * vocab)?;
                dev.gather_rows(&mut sub, &logits, &idx, vocab)?;
                let d: Vec<_> = drawn.iter().map(|&i| chunk_draws[i].flatten()).collect();
                dev.sample_rows(&sub, &d, vocab)?
            }
            .into_iter();
            if drawn.is_empty() {
                out.extend(dev.download(&logits)?);
            } else if drawn.len() < chunk.len() {
                let idx: Vec<u32> = (0..chunk.len() as u32)
                    .filter(|&i| chunk_draws[i as usize].is_none())
                    .collect();
                let mut sub = dev.zeros::<f32>(idx.len() * vocab)?;
                dev.gather_rows(&mut sub, &logits, &idx, vocab)?;
                out.extend(dev.download(&sub)?);
            }
            picks.extend(
                chunk_draws
                    .iter()
                    .map(|d| if d.is_some() { made.next() } else { None }),
            );
        }
        Ok((out, picks))
    }

    /// The output projection of hidden rows `r0..r0 + n`: logits `[n, vocab]`.
    fn logits(&self, hidden: &CudaSlice<f32>, r0: usize, n: usize) -> Result<CudaSlice<f32>> {
        self.logits_on(&self.dev, hidden, r0, n)
    }

    /// [`logits`](Self::logits) launched through `dev`.
    fn logits_on(
        &self,
        dev: &CudaDevice,
        hidden: &CudaSlice<f32>,
        r0: usize,
        n: usize,
    ) -> Result<CudaSlice<f32>> {
        let (h, vocab) = (self.model.config.hidden_size, self.model.config.vocab_size);
        let head = self
            .model
            .lm_head
            .as_ref()
            .unwrap_or(&self.model.embed_tokens);
        let mut rows = dev.zeros::<f32>(n * h)?;
        dev.copy_block(&mut rows, hidden, h, (r0, 0), (n, h))?;
        let mut logits = dev.zeros::<f32>(n * vocab)?;
        product(dev, MatMut::F32(&mut logits), &rows, head, n, h, vocab)?;
        Ok(logits)
    }

    /// Runs `tokens` after what `cache` holds and returns the most likely
    /// next token: one step of greedy decoding.
    pub fn greedy_step(&self, cache: &mut CudaSeqCache, tokens: &[u32]) -> Result<u32> {
        let hidden = self.forward(cache, tokens)?;
        let logits = self.logits(&hidden, tokens.len() - 1, 1)?;
        let mut best = self.dev.zeros::<u32>(1)?;
        self.dev
            .argmax_forward(&mut best, &logits, self.model.config.vocab_size)?;
        Ok(self.dev.download(&best)?[0])
    }

    /// `lp[s][t] = log p(tok_t | tok_<t)` for t >= 1 (index 0 is `None`),
    /// as [`Qwen3_5::score`] on the CPU: each sequence from position 0
    /// with fresh state, logits a bounded number of rows at a time.
    pub fn score(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<Option<f32>>>> {
        let vocab = self.model.config.vocab_size;
        super::qwen3_5::check_ids(sequences, vocab)?;
        let dev = &*self.dev;
        let mut out = Vec::with_capacity(sequences.len());
        for seq in sequences {
            let mut row = vec![None];
            self.scored_logits(&self.dev, seq, |logits, targets| {
                let n = targets.len();
                let targets = dev.upload(targets)?;
                let mut lp = dev.zeros::<f32>(n)?;
                dev.logprob_gather_forward(&mut lp, logits, &targets, vocab, 1.0)?;
                row.extend(dev.download(&lp)?.into_iter().map(Some));
                Ok(())
            })?;
            out.push(row);
        }
        Ok(out)
    }

    /// [`Qwen3_5::score_top`] on the device, launched through `dev` (a
    /// handle of this GPU owned by the caller's thread, as in
    /// [`forward_batch_on`](Self::forward_batch_on)): the rows' logits come
    /// to the host, where the same log-softmax and top-k as the CPU's rank
    /// them.
    pub fn score_top_on(
        &self,
        dev: &Arc<CudaDevice>,
        tokens: &[u32],
        top: usize,
    ) -> Result<Vec<Sampled>> {
        let vocab = self.model.config.vocab_size;
        super::qwen3_5::check_ids(&[tokens.to_vec()], vocab)?;
        let mut out = Vec::with_capacity(tokens.len() - 1);
        let mut logp = Vec::new();
        self.scored_logits(dev, tokens, |logits, targets| {
            score_rows(&dev.download(logits)?, targets, top, &mut logp, &mut out)
        })?;
        Ok(out)
    }

    /// The forward of `seq` from position 0 with fresh state, launched
    /// through `dev`, then the logits of every row but the last handed to
    /// `each` with the rows' target tokens, a bounded number of rows at a
    /// time.
    fn scored_logits(
        &self,
        dev: &Arc<CudaDevice>,
        seq: &[u32],
        mut each: impl FnMut(&CudaSlice<f32>, &[u32]) -> Result<()>,
    ) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        let layout = CacheLayout::new(&self.model.config);
        let blocks = seq.len().div_ceil(KV_BLOCK).max(1);
        let mut cache = DeviceCache::new(dev.clone(), &layout, KV_BLOCK, blocks, 1)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        let paged = PagedSeq {
            tokens: seq,
            past: 0,
            slot: 0,
            blocks: &table,
        };
        let hidden = self.forward_batch_on(dev, &mut cache, &[paged], PrefillForm::Recurrent)?;
        let scored = seq.len() - 1;
        let per_chunk = logit_rows_per_chunk(vocab);
        let mut r0 = 0;
        while r0 < scored {
            let n = per_chunk.min(scored - r0);
            each(
                &self.logits_on(dev, &hidden, r0, n)?,
                &seq[r0 + 1..r0 + 1 + n],
            )?;
            r0 += n;
        }
        Ok(())
    }
}

/// A training forward on the device ([`CudaModel::forward_keeping`]).
pub struct CudaTrace {
    /// Every layer's activations ([`Kept::All`]) or input ([`Kept::Input`]).
    pub layers: Vec<Kept<CudaSlice<f32>, ()>>,
    /// The residual stream after the last layer, before the final norm.
    pub x_last: CudaSlice<f32>,
    pub final_rstd: CudaSlice<f32>,
    /// Final hidden states after the final norm, `[tokens, hidden]`.
    pub hidden: CudaSlice<f32>,
}

/// `sequences` from position 0, sequence `i` in slot `i` with `tables[i]`.
fn fresh_seqs<'a>(sequences: &[&'a [u32]], tables: &'a [Vec<u32>]) -> Vec<PagedSeq<'a>> {
    sequences
        .iter()
        .zip(tables)
        .enumerate()
        .map(|(i, (tokens, blocks))| PagedSeq {
            tokens,
            past: 0,
            slot: i as SlotId,
            blocks,
        })
        .collect()
}

/// Positions per block of a lone sequence's key/value pool
/// ([`CudaModel::new_cache`]).
const KV_BLOCK: usize = 16;

/// One sequence's state on the device ([`CudaModel::new_cache`]): a cache
/// of one state slot whose blocks are all this sequence's.
pub struct CudaSeqCache {
    cache: DeviceCache,
    blocks: Vec<u32>,
    /// Positions already run.
    pub len: usize,
    pub capacity: usize,
}

/// The cached tensors of a paged cache on the GPU: per linear layer its
/// conv states `[slots, conv_len]` and fp32 recurrent states `[slots,
/// rec_len]`, per full-attention layer its K and V pools `[blocks,
/// block_size, kv_row]`. The bookkeeping (which blocks and slots are whose)
/// is the host's (`kv_cache::PagedKvCache`).
///
/// The copies the bookkeeping asks for (zero a slot, copy a slot or a
/// block) are launched on the device's stream, in order with the forwards;
/// one that fails is kept and returned by the next forward, which then
/// fails its whole step, as an asynchronous CUDA error would.
pub struct DeviceCache {
    dev: Arc<CudaDevice>,
    layout: CacheLayout,
    block_size: usize,
    num_blocks: usize,
    num_slots: usize,
    conv: Vec<Option<CudaSlice<f32>>>,
    rec: Vec<Option<CudaSlice<f32>>>,
    kv: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    fault: Option<Error>,
}

impl std::fmt::Debug for DeviceCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "DeviceCache({:?}, {} blocks of {}, {} slots)",
            self.dev, self.num_blocks, self.block_size, self.num_slots
        )
    }
}

impl DeviceCache {
    /// `num_blocks` blocks of `block_size` positions and `num_slots` state
    /// slots, zeroed, on `dev`.
    pub fn new(
        dev: Arc<CudaDevice>,
        layout: &CacheLayout,
        block_size: usize,
        num_blocks: usize,
        num_slots: usize,
    ) -> Result<Self> {
        let n = layout.num_layers;
        let mut cache = DeviceCache {
            layout: layout.clone(),
            block_size,
            num_blocks,
            num_slots,
            conv: (0..n).map(|_| None).collect(),
            rec: (0..n).map(|_| None).collect(),
            kv: (0..n).map(|_| None).collect(),
            fault: None,
            dev,
        };
        let pool = num_blocks * block_size * layout.kv_row;
        for &li in &layout.linear_layers {
            cache.conv[li] = Some(cache.dev.zeros(num_slots * layout.conv_len)?);
            cache.rec[li] = Some(cache.dev.zeros(num_slots * layout.rec_len)?);
        }
        for &li in &layout.attn_layers {
            cache.kv[li] = Some((cache.dev.zeros(pool)?, cache.dev.zeros(pool)?));
        }
        Ok(cache)
    }

    /// Zeroes slot `slot` (a fresh sequence's state).
    pub fn zero_slot(&mut self, slot: SlotId) {
        let (dev, l) = (&self.dev, &self.layout);
        let r = slot_states(&mut self.conv, &mut self.rec).try_for_each(|(conv, rec)| {
            dev.zero_range(conv, slot as usize * l.conv_len, l.conv_len)?;
            dev.zero_range(rec, slot as usize * l.rec_len, l.rec_len)
        });
        self.keep_fault(r);
    }

    /// Copies slot `src`'s state into slot `dst`.
    pub fn copy_slot(&mut self, src: SlotId, dst: SlotId) {
        let (dev, l) = (&self.dev, &self.layout);
        let (s, d) = (src as usize, dst as usize);
        let r = slot_states(&mut self.conv, &mut self.rec).try_for_each(|(conv, rec)| {
            dev.copy_within(conv, s * l.conv_len, d * l.conv_len, l.conv_len)?;
            dev.copy_within(rec, s * l.rec_len, d * l.rec_len, l.rec_len)
        });
        self.keep_fault(r);
    }

    /// Copies the first `rows` positions of block `src` into block `dst`,
    /// in every attention layer.
    pub fn copy_block(&mut self, src: u32, dst: u32, rows: usize) {
        let (dev, bs, row) = (&self.dev, self.block_size, self.layout.kv_row);
        let n = rows.min(bs) * row;
        let (s, d) = (src as usize * bs * row, dst as usize * bs * row);
        let r =
            self.kv
                .iter_mut()
                .flatten()
                .try_for_each(|(k, v)| -> arcticd_kernels::Result<()> {
                    dev.copy_within(k, s, d, n)?;
                    dev.copy_within(v, s, d, n)
                });
        self.keep_fault(r);
    }

    fn keep_fault(&mut self, r: arcticd_kernels::Result<()>) {
        if let (Err(e), None) = (r, &self.fault) {
            self.fault = Some(e.into());
        }
    }

    /// The first failure of a copy since the last forward, if any.
    fn take_fault(&mut self) -> Result<()> {
        self.fault.take().map_or(Ok(()), Err)
    }

    /// Bytes held on the device.
    pub fn bytes(&self) -> usize {
        let l = &self.layout;
        (l.linear_layers.len() * (l.conv_len + l.rec_len) * self.num_slots
            + l.attn_layers.len() * 2 * self.num_blocks * self.block_size * l.kv_row)
            * 4
    }
}

/// `out[n, oc] = x[n, c] @ w[oc, c]^T`, the input rounded to the weight's
/// type first.
fn product(
    dev: &CudaDevice,
    out: MatMut<'_>,
    x: &CudaSlice<f32>,
    w: &DeviceParam,
    n: usize,
    c: usize,
    oc: usize,
) -> Result<()> {
    match w {
        DeviceParam::F32(_) => dev.matmul_forward(out, Mat::F32(x), w.mat(), n, c, oc)?,
        DeviceParam::Bf16(_) => {
            let mut xb = dev.zeros::<u16>(x.len())?;
            dev.f32_to_bf16(&mut xb, x)?;
            dev.matmul_forward(out, Mat::Bf16(&xb), w.mat(), n, c, oc)?
        }
    }
    Ok(())
}

/// Each linear layer's conv and recurrent state pools.
fn slot_states<'s>(
    conv: &'s mut [Option<CudaSlice<f32>>],
    rec: &'s mut [Option<CudaSlice<f32>>],
) -> impl Iterator<Item = (&'s mut CudaSlice<f32>, &'s mut CudaSlice<f32>)> {
    conv.iter_mut()
        .zip(rec.iter_mut())
        .filter_map(|(c, r)| c.as_mut().zip(r.as_mut()))
}

/// A packed batch of sequences on the device, each continuing its past
/// in a [`DeviceCache`].
pub(crate) struct CudaOps<'a> {
    dev: &'a CudaDevice,
    config: &'a ModelConfig,
    seqs: &'a [PagedSeq<'a>],
    /// Where the new tokens go (host arithmetic, tested on the CPU).
    batch: PagedBatch,
    positions: CudaSlice<u32>,
    device_slots: CudaSlice<u32>,
    cache: &'a mut DeviceCache,
    /// How the recurrence runs over new tokens (a training forward keeps
    /// its activations and runs it token by token).
    form: PrefillForm,
}

impl<'a> CudaOps<'a> {
    fn new(
        dev: &'a CudaDevice,
        config: &'a ModelConfig,
        seqs: &'a [PagedSeq<'a>],
        cache: &'a mut DeviceCache,
    ) -> Result<Self> {
        let batch = PagedBatch::new(seqs, cache.block_size, cache.num_blocks, cache.num_slots)?;
        Ok(CudaOps {
            dev,
            config,
            seqs,
            positions: dev.upload(&batch.positions)?,
            device_slots: dev.upload(&batch.slots)?,
            batch,
            cache,
            form: PrefillForm::Recurrent,
        })
    }

    fn t(&self) -> usize {
        self.batch.ids.len()
    }
}

impl LayerOps for CudaOps<'_> {
    type W = DeviceParam;
    type Buf = CudaSlice<f32>;
    /// No recurrent-state checkpoints: the CUDA gated-delta backward replays
    /// each sequence from its zero initial state.
    type Checkpoints = ();

    fn duplicate(&mut self, x: &CudaSlice<f32>) -> Result<CudaSlice<f32>> {
        let mut out = self.dev.zeros::<f32>(x.len())?;
        self.dev
            .copy_block(&mut out, x, x.len(), (0, 0), (1, x.len()))?;
        Ok(out)
    }

    fn embed(&mut self, table: &DeviceParam) -> Result<CudaSlice<f32>> {
        let (v, h) = (self.config.vocab_size, self.config.hidden_size);
        let mut x = self.dev.zeros::<f32>(self.t() * h)?;
        match table {
            DeviceParam::F32(w) => self.dev.embedding_forward(&mut x, &self.batch.ids, w, v, h),
            DeviceParam::Bf16(w) => {
                self.dev
                    .embedding_forward_bf16(&mut x, &self.batch.ids, w, v, h)
            }
        }
        .map_err(|e| Error::Input(e.to_string()))?;
        Ok(x)
    }

    fn rmsnorm(
        &mut self,
        x: &CudaSlice<f32>,
        weight: &DeviceParam,
        c: usize,
        eps: f32,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let n = x.len() / c.max(1);
        let (mut out, mut rstd) = (self.dev.zeros(x.len())?, self.dev.zeros(n)?);
        let w = weight.f32("rmsnorm weight")?;
        self.dev
            .rmsnorm_forward(&mut out, &mut rstd, x, w, n, c, eps)?;
        Ok((out, rstd))
    }

    fn add_assign(&mut self, x: &mut CudaSlice<f32>, y: &CudaSlice<f32>) -> Result<()> {
        Ok(self.dev.add_assign(x, y)?)
    }

    fn project(
        &mut self,
        group: &[&Linear<DeviceParam>],
        x: &CudaSlice<f32>,
        t: usize,
    ) -> Result<Vec<CudaSlice<f32>>> {
        let mut outs = Vec::with_capacity(group.len());
        for l in group {
            if l.bias.is_some() {
                return Err(Error::Invariant(
                    "a linear with a bias (Qwen3.5 has none) on CUDA".into(),
                ));
            }
            let mut out = self.dev.zeros::<f32>(t * l.out_features)?;
            let (c, oc) = (l.in_features, l.out_features);
            product(self.dev, MatMut::F32(&mut out), x, &l.weight, t, c, oc)?;
            outs.push(out);
        }
        Ok(outs)
    }

    fn silu_mul(
        &mut self,
        gate: &CudaSlice<f32>,
        up: &CudaSlice<f32>,
        _t: usize,
        _width: usize,
    ) -> Result<CudaSlice<f32>> {
        let mut out = self.dev.zeros::<f32>(gate.len())?;
        self.dev.silu_mul_forward(&mut out, gate, up)?;
        Ok(out)
    }

    fn silu(&mut self, x: &mut CudaSlice<f32>) -> Result<()> {
        Ok(self.dev.silu_forward(x)?)
    }

    fn sigmoid_gate(&mut self, x: &mut CudaSlice<f32>, gate: &CudaSlice<f32>) -> Result<()> {
        Ok(self.dev.sigmoid_gate_forward(x, gate)?)
    }

    fn split_columns(
        &mut self,
        x: &CudaSlice<f32>,
        widths: &[usize],
    ) -> Result<Vec<CudaSlice<f32>>> {
        let width: usize = widths.iter().sum();
        if width == 0 || !x.len().is_multiple_of(width) {
            return Err(Error::Invariant(format!(
                "{} values are not rows of {width}",
                x.len()
            )));
        }
        let rows = x.len() / width;
        let mut col = 0;
        let mut outs = Vec::with_capacity(widths.len());
        for &w in widths {
            let mut out = self.dev.zeros::<f32>(rows * w)?;
            self.dev
                .copy_block(&mut out, x, width, (0, col), (rows, w))?;
            outs.push(out);
            col += w;
        }
        Ok(outs)
    }

    fn l2norm(
        &mut self,
        x: &CudaSlice<f32>,
        rows: usize,
        d: usize,
        scale: f32,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let (mut out, mut rnorm) = (self.dev.zeros(rows * d)?, self.dev.zeros(rows)?);
        self.dev
            .l2norm_forward(&mut out, &mut rnorm, x, rows, d, 1e-6, scale)?;
        Ok((out, rnorm))
    }

    fn gated_rmsnorm(
        &mut self,
        x: &CudaSlice<f32>,
        z: &CudaSlice<f32>,
        weight: &DeviceParam,
        d: usize,
        eps: f32,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let rows = x.len() / d.max(1);
        let (mut out, mut rstd) = (self.dev.zeros(x.len())?, self.dev.zeros(rows)?);
        let w = weight.f32("gated norm weight")?;
        self.dev
            .gated_rmsnorm_forward(&mut out, &mut rstd, x, z, w, rows, d, eps)?;
        Ok((out, rstd))
    }

    fn causal_conv(
        &mut self,
        la: &LinearAttention<DeviceParam>,
        li: usize,
        qkv: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let (conv_dim, k) = (self.config.linear_conv_dim(), self.config.conv_kernel);
        let t = self.t();
        let mut out = self.dev.zeros::<f32>(t * conv_dim)?;
        let w = la.conv1d.f32("conv1d weight")?;
        let state = state_of(&mut self.cache.conv, li, "conv")?;
        self.dev.conv1d_varlen_forward(
            &mut out,
            state,
            qkv,
            w,
            &self.batch.slots,
            &self.batch.cu_seqlens,
            k,
        )?;
        Ok(out)
    }

    fn gating(
        &mut self,
        la: &LinearAttention<DeviceParam>,
        a: &CudaSlice<f32>,
        b: &CudaSlice<f32>,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let nv = self.config.linear_num_value_heads;
        let (mut g, mut beta) = (self.dev.zeros(a.len())?, self.dev.zeros(a.len())?);
        let (a_log, dt_bias) = (la.a_log.f32("A_log")?, la.dt_bias.f32("dt_bias")?);
        self.dev
            .gated_delta_gating_forward(&mut g, &mut beta, a, b, a_log, dt_bias, nv)?;
        Ok((g, beta))
    }

    fn recurrence(
        &mut self,
        li: usize,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
        g: &CudaSlice<f32>,
        beta: &CudaSlice<f32>,
        keep: bool,
    ) -> Result<(CudaSlice<f32>, Option<()>)> {
        let dims = self.config.delta_heads();
        let t = self.t();
        let mut out = self.dev.zeros::<f32>(t * dims.1 * dims.3)?;
        let state = state_of(&mut self.cache.rec, li, "recurrent")?;
        let chunked = self.form == PrefillForm::Chunked && !keep;
        self.dev.gated_delta_prefill(
            &mut out,
            state,
            q,
            k,
            v,
            g,
            beta,
            &self.device_slots,
            &self.batch.cu_seqlens,
            dims,
            chunked,
        )?;
        Ok((out, keep.then_some(())))
    }

    fn qk_norm_rope(
        &mut self,
        x: &CudaSlice<f32>,
        weight: &DeviceParam,
        heads: usize,
    ) -> Result<(CudaSlice<f32>, CudaSlice<f32>)> {
        let c = self.config;
        let mut out = self.duplicate(x)?;
        let mut rstd = self.dev.zeros::<f32>(self.t() * heads)?;
        let w = weight.f32("q/k norm weight")?;
        self.dev.qk_norm_rope_forward(
            &mut out,
            &mut rstd,
            w,
            &self.positions,
            heads,
            c.head_dim,
            c.rotary_dim,
            c.rope_theta,
            c.rms_norm_eps,
        )?;
        Ok((out, rstd))
    }

    fn attention(
        &mut self,
        li: usize,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let c = self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let t = self.t();
        let mut out = self.dev.zeros::<f32>(t * nh * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let bs = self.cache.block_size;
        let Some((k_pool, v_pool)) = self.cache.kv.get_mut(li).and_then(Option::as_mut) else {
            return Err(Error::Invariant(format!(
                "layer {li} has no key/value pool in the cache"
            )));
        };
        // The new keys and values join the pools at their rows.
        self.dev
            .paged_kv_write(k_pool, v_pool, k, v, &self.batch.kv_rows, nkv * hd)?;
        if self.batch.fresh {
            self.dev.varlen_attention_prefill(
                &mut out,
                q,
                k,
                v,
                &self.batch.cu_seqlens,
                (nh, nkv, hd),
                scale,
            )?;
            return Ok(out);
        }
        // After a past, over the pools: a step of single tokens as decode,
        // else the prefill over the blocks (each query's bits are the same).
        if self.seqs.iter().all(|s| s.tokens.len() == 1) {
            let (tables, lens) = self.batch.row_contexts(self.seqs);
            self.dev.paged_attention_decode(
                &mut out,
                q,
                k_pool,
                v_pool,
                &tables,
                &lens,
                (nh, nkv, hd),
                bs,
                scale,
            )?;
        } else {
            let tables: Vec<Vec<u32>> = self.seqs.iter().map(|s| s.blocks.to_vec()).collect();
            let pasts = self
                .seqs
                .iter()
                .map(|s| u32::try_from(s.past))
                .collect::<std::result::Result<Vec<u32>, _>>()
                .map_err(|_| Error::Invariant("a past beyond u32 positions".into()))?;
            self.dev.paged_attention_prefill(
                &mut out,
                q,
                k_pool,
                v_pool,
                &tables,
                &pasts,
                &self.batch.cu_seqlens,
                (nh, nkv, hd),
                bs,
                scale,
            )?;
        }
        Ok(out)
    }
}

/// Layer `li`'s state in a per-layer list, or an error naming what is
/// missing (a layer of the other kind).
fn state_of<'s>(
    states: &'s mut [Option<CudaSlice<f32>>],
    li: usize,
    what: &str,
) -> Result<&'s mut CudaSlice<f32>> {
    states
        .get_mut(li)
        .and_then(Option::as_mut)
        .ok_or_else(|| Error::Invariant(format!("layer {li} has no {what} state in the cache")))
}

#[cfg(test)]
mod tests {
    //! Need a GPU; skipped without one (`ARCTICD_REQUIRE_GPU=1`, as
    //! `scripts/gpu-check.sh` sets it, makes a missing device a failure).
    use super::*;
    use arcticd_kernels::cuda::device::test_device;

    fn gpu() -> Option<Arc<CudaDevice>> {
        test_device().map(Arc::new)
    }

    fn max_diff(a: &[Vec<Option<f32>>], b: &[Vec<Option<f32>>]) -> f32 {
        let mut worst = 0.0f32;
        for (x, y) in a.iter().zip(b) {
            assert_eq!(x.len(), y.len());
            for (p, q) in x.iter().zip(y) {
                match (p, q) {
                    (None, None) => {}
                    (Some(p), Some(q)) => worst = worst.max((p - q).abs()),
                    _ => panic!("scored positions differ"),
                }
            }
        }
        worst
    }

    /// The tiny test model's scores (and greedy tokens) on CUDA against the CPU's: fp32
    /// products within 2e-4 (different summation orders and fused
    /// kernels, no TF32); bf16 matrices (inputs rounded to bf16 too)
    /// within 0.1, printed.
    #[test]
    fn cuda_scores_match_the_cpu() {
        let Some(dev) = gpu() else { return };
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-model-{}", std::process::id()));
        crate::init::init_model(crate::init::TINY, &dir, 3).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let vocab = model.config.vocab_size as u32;
        let seqs: Vec<Vec<u32>> = [1usize, 2, 37, 300]
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 7919 + 13) % vocab).collect())
            .collect();
        let want = model.score(&seqs).unwrap();
        for (dtype, bound) in [(WeightDType::F32, 2e-4), (WeightDType::Bf16, 0.1)] {
            let on_gpu = CudaModel::upload(&model, dev.clone(), dtype).unwrap();
            let got = on_gpu.score(&seqs).unwrap();
            let d = max_diff(&got, &want);
            eprintln!("{dtype:?}: max |log-prob CUDA - CPU| = {d:.3e}");
            assert!(d <= bound, "{dtype:?}: {d} > {bound}");
        }
        let on_gpu = CudaModel::upload(&model, dev, WeightDType::F32).unwrap();

        // Greedy decoding: a prefill, then one token at a time against the
        // cache on the device (paged attention after a past), gives the
        // CPU's tokens.
        let prompt: Vec<u32> = (0..20u32).map(|i| (i * 31 + 5) % vocab).collect();
        let steps = 12;
        let mut cpu_cache = model.new_cache();
        let mut gpu_cache = on_gpu.new_cache(prompt.len() + steps).unwrap();
        let (mut cpu_next, mut gpu_next) = (prompt.clone(), prompt.clone());
        let (mut cpu_out, mut gpu_out) = (Vec::new(), Vec::new());
        let h = model.config.hidden_size;
        for _ in 0..steps {
            let hidden = model
                .forward(&mut [crate::SeqInput {
                    tokens: &cpu_next,
                    cache: &mut cpu_cache,
                }])
                .unwrap();
            let logits = model.logits(&hidden[hidden.len() - h..]).unwrap();
            let tok = crate::sampler::argmax(&logits) as u32;
            cpu_out.push(tok);
            cpu_next = vec![tok];
            let tok = on_gpu.greedy_step(&mut gpu_cache, &gpu_next).unwrap();
            gpu_out.push(tok);
            gpu_next = vec![tok];
        }
        assert_eq!(gpu_out, cpu_out);
        assert_eq!(gpu_cache.len, prompt.len() + steps - 1);
        let mut full = on_gpu.new_cache(2).unwrap();
        let err = on_gpu
            .forward(&mut full, &[1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(err.contains("do not fit"), "{err}");

        let err = on_gpu.score(&[vec![vocab]]).unwrap_err().to_string();
        assert!(err.contains("vocabulary size"), "{err}");
        assert!(on_gpu.score(&[vec![]]).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }

    /// The training forward on CUDA (f32 matrices) against the CPU's
    /// `forward_keeping` over the same packed sequences: every kept
    /// activation of every layer, and the final hidden states, within
    /// 2e-4 (relative above 1; printed).
    #[test]
    fn cuda_training_forward_keeps_the_cpu_activations() {
        use crate::model::saved::MixerActs;
        let Some(dev) = gpu() else { return };
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-keep-{}", std::process::id()));
        crate::init::init_model(crate::init::TINY, &dir, 7).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let vocab = model.config.vocab_size as u32;
        let seqs: Vec<Vec<u32>> = [3usize, 70, 150]
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 613 + 29) % vocab).collect())
            .collect();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let want = model.forward_keeping(&refs, Keep::All).unwrap();
        let on_gpu = CudaModel::upload(&model, dev.clone(), WeightDType::F32).unwrap();
        let got = on_gpu.forward_keeping(&refs, Keep::All).unwrap();
        let mut worst = 0.0f32;
        let mut check = |name: String, d: &CudaSlice<f32>, h: &[f32]| {
            let d = dev.download(d).unwrap();
            assert_eq!(d.len(), h.len(), "{name}");
            for (a, b) in d.iter().zip(h) {
                let e = (a - b).abs() / b.abs().max(1.0);
                worst = worst.max(e);
                assert!(e <= 2e-4, "{name}: cuda {a} cpu {b}");
            }
        };
        for (li, (g, w)) in got.layers.iter().zip(&want.layers).enumerate() {
            let (Kept::All(g), Kept::All(w)) = (g, w) else {
                panic!("layer {li}: only the input was kept")
            };
            for (name, d, h) in [
                ("x_in", &g.x_in, &w.x_in),
                ("xn1", &g.xn1, &w.xn1),
                ("x_mid", &g.x_mid, &w.x_mid),
                ("xn2", &g.xn2, &w.xn2),
                ("gate", &g.gate, &w.gate),
                ("up", &g.up, &w.up),
                ("act", &g.act, &w.act),
            ] {
                check(format!("layer {li} {name}"), d, h);
            }
            match (&g.mixer, &w.mixer) {
                (MixerActs::Linear(g), MixerActs::Linear(w)) => {
                    for (name, d, h) in [
                        ("qkv", &g.qkv, &w.qkv),
                        ("conv_pre", &g.conv_pre, &w.conv_pre),
                        ("q", &g.q, &w.q),
                        ("k", &g.k, &w.k),
                        ("v", &g.v, &w.v),
                        ("g", &g.g, &w.g),
                        ("beta", &g.beta, &w.beta),
                        ("core", &g.core, &w.core),
                        ("normed", &g.normed, &w.normed),
                    ] {
                        check(format!("layer {li} {name}"), d, h);
                    }
                }
                (MixerActs::Full(g), MixerActs::Full(w)) => {
                    for (name, d, h) in [
                        ("q", &g.q, &w.q),
                        ("k", &g.k, &w.k),
                        ("v", &g.v, &w.v),
                        ("attn", &g.attn, &w.attn),
                        ("gated", &g.gated, &w.gated),
                    ] {
                        check(format!("layer {li} {name}"), d, h);
                    }
                }
                _ => panic!("layer {li}: mixer kinds differ"),
            }
        }
        check("hidden".into(), &got.hidden, &want.hidden);
        eprintln!("training forward: max relative |CUDA - CPU| = {worst:.3e}");

        // Keeping only the inputs gives the same bits, and each layer
        // recomputed from its input gives the kept activations' bits.
        let inputs = on_gpu.forward_keeping(&refs, Keep::Inputs).unwrap();
        let bits = |x: &CudaSlice<f32>| {
            dev.download(x)
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect::<Vec<u32>>()
        };
        assert_eq!(bits(&inputs.hidden), bits(&got.hidden));
        for (li, (kept, all)) in inputs.layers.iter().zip(&got.layers).enumerate() {
            let (Kept::Input(x_in), Kept::All(all)) = (kept, all) else {
                panic!("layer {li}: not the kept kinds asked for")
            };
            assert_eq!(bits(x_in), bits(&all.x_in), "layer {li} input");
            let again = on_gpu.recompute_layer(li, x_in, &refs).unwrap();
            for (name, a, b) in [
                ("xn1", &again.xn1, &all.xn1),
                ("x_mid", &again.x_mid, &all.x_mid),
                ("act", &again.act, &all.act),
            ] {
                assert_eq!(bits(a), bits(b), "layer {li} {name} recomputed");
            }
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Tokens drawn on the device against the host sampler with the same
    /// seed, over rows of a 1,000-token vocabulary at temperatures 0
    /// (greedy), 0.7 and 1: the same tokens, log-probs within 1e-5.
    #[test]
    fn device_draws_match_the_host_sampler() {
        use crate::sampler::{Sampler, SamplingParams};
        use rand::{Rng, SeedableRng};
        let Some(dev) = gpu() else { return };
        let (rows, vocab) = (48, 1000);
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        let logits: Vec<f32> = (0..rows * vocab)
            .map(|_| rng.gen_range(-4.0..4.0f32))
            .collect();
        let on_dev = dev.upload(&logits).unwrap();
        for temperature in [0.0f32, 0.7, 1.0] {
            let params = SamplingParams {
                temperature,
                seed: Some(5),
                ..Default::default()
            };
            let mut host: Vec<Sampler> = (0..rows).map(|i| Sampler::new(&params, i)).collect();
            let mut mine: Vec<Sampler> = (0..rows).map(|i| Sampler::new(&params, i)).collect();
            for _ in 0..4 {
                let draws: Vec<_> = mine
                    .iter_mut()
                    .map(|s| s.device_draw(vocab).unwrap())
                    .collect();
                let picks = dev.sample_rows(&on_dev, &draws, vocab).unwrap();
                for (r, (s, (token, lp))) in host.iter_mut().zip(picks).enumerate() {
                    let want = s.sample(&logits[r * vocab..(r + 1) * vocab]).unwrap();
                    assert_eq!(token, want.token, "T {temperature}, row {r}");
                    assert!((lp - want.logprob).abs() <= 1e-5, "{lp} {}", want.logprob);
                }
            }
        }
    }

    /// A greedy request of 16 tokens after a prompt of `len` ids picked by
    /// `salt`.
    fn greedy(len: usize, salt: u32) -> crate::engine::Request {
        crate::engine::Request {
            prompt: (0..len as u32)
                .map(|i| (i * 2_654_435 + salt * 97) % 900 + 10)
                .collect(),
            params: crate::sampler::SamplingParams {
                ignore_eos: true,
                ..crate::sampler::SamplingParams::greedy(16)
            },
        }
    }

    /// A weight update: every f32 parameter moved by up to 0.01.
    fn nudge(store: &crate::ParamStore) {
        store.update(|m| {
            for (i, (_, t)) in m.named_params_mut().into_iter().enumerate() {
                if let Ok(w) = t.as_f32_mut() {
                    for (j, x) in w.iter_mut().enumerate() {
                        *x += 0.01 * (((i * 31 + j * 7) % 13) as f32 - 6.0) / 6.0;
                    }
                }
            }
        });
    }

    /// The engine on a GPU against the engine on the CPU, same store, f32
    /// matrices: prompts shorter than, equal to and longer than one prefill
    /// unit and one step's token budget (so prefills after a past run the
    /// paged path), run together; a prefix-cache hit; a weight update; with
    /// either prefill form. The tokens must be the CPU's; the log-probs
    /// within 2e-3 (printed).
    #[test]
    fn engine_on_cuda_matches_the_cpu_engine() {
        use crate::engine::{self, EngineConfig};
        use crate::ParamStore;
        use arcticd_kernels::Device;
        use std::sync::atomic::Ordering;
        if gpu().is_none() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-engine-{}", std::process::id()));
        crate::init::init_model(crate::init::TINY, &dir, 5).unwrap();
        let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        // Both prefill forms, each on both devices.
        for prefill in [PrefillForm::Recurrent, PrefillForm::Chunked] {
            let config = EngineConfig {
                cache_memory: 16 << 20,
                max_num_seqs: 8,
                max_batched_tokens: 256,
                max_model_len: 2048,
                prefill,
                ..Default::default()
            };
            let cpu = engine::start(store.clone(), None, config.clone()).unwrap();
            let gpu_config = EngineConfig {
                device: Device::Cuda(0),
                weights: WeightDType::F32,
                ..config
            };
            let on_gpu = engine::start(store.clone(), None, gpu_config).unwrap();
            let lens = [(5usize, 1u32), (64, 2), (150, 3), (300, 4)];
            let mut worst = 0.0f32;
            let mut compare = |round: &str| {
                // Submitted together on the GPU, so they share steps.
                let subs: Vec<_> = lens
                    .iter()
                    .map(|&(n, salt)| on_gpu.submit_collected(greedy(n, salt)).unwrap())
                    .collect();
                for (sub, &(n, salt)) in subs.into_iter().zip(&lens) {
                    let got = engine::collect_blocking(sub, 1).unwrap();
                    let want = cpu.generate_blocking(greedy(n, salt)).unwrap();
                    assert_eq!(got[0].tokens, want[0].tokens, "{round}: prompt of {n}");
                    assert_eq!(got[0].weight_versions, want[0].weight_versions);
                    for (a, b) in got[0].logprobs.iter().zip(&want[0].logprobs) {
                        worst = worst.max((a - b).abs());
                    }
                }
            };
            compare("cold");
            // The same prompts again: their prefixes come from the cache.
            compare("prefix hit");
            assert!(on_gpu.metrics().prefix_hit_tokens.load(Ordering::Relaxed) > 0);
            on_gpu.pause().unwrap();
            cpu.pause().unwrap();
            nudge(&store);
            on_gpu.resume();
            cpu.resume();
            compare("after an update");
            eprintln!("engine ({prefill:?} prefill): max |log-prob CUDA - CPU| = {worst:.3e}");
            assert!(worst <= 2e-3, "{worst}");
        }
        std::fs::remove_dir_all(&dir).ok();
    }

    /// Deterministic mode on one GPU (`batch_invariant`, bf16 matrices):
    /// the same greedy requests run together cold, again as prefix hits
    /// (prefills after a past on the paged kernel), and each one alone give
    /// the same tokens and log-prob bits; after a weight update, the bits
    /// of an engine started fresh on the updated store.
    #[test]
    fn batch_invariant_engine_keeps_its_bits() {
        use crate::engine::{self, EngineConfig, EngineHandle};
        use crate::ParamStore;
        use arcticd_kernels::Device;
        use std::sync::atomic::Ordering;
        if gpu().is_none() {
            return;
        }
        let dir = std::env::temp_dir().join(format!("arcticd-cuda-bits-{}", std::process::id()));
        crate::init::init_model(crate::init::TINY, &dir, 6).unwrap();
        let store = ParamStore::new(Qwen3_5::load(&dir).unwrap());
        let config = EngineConfig {
            cache_memory: 16 << 20,
            max_num_seqs: 8,
            max_batched_tokens: 256,
            max_model_len: 2048,
            device: Device::Cuda(0),
            batch_invariant: true,
            ..Default::default()
        };
        let lens = [(5usize, 1u32), (64, 2), (150, 3), (300, 4)];
        type Out = Vec<(Vec<u32>, Vec<u32>)>;
        let together = |eng: &EngineHandle| -> Out {
            let subs: Vec<_> = lens
                .iter()
                .map(|&(n, salt)| eng.submit_collected(greedy(n, salt)).unwrap())
                .collect();
            subs.into_iter()
                .map(|sub| {
                    let got = engine::collect_blocking(sub, 1).unwrap();
                    let bits = got[0].logprobs.iter().map(|x| x.to_bits()).collect();
                    (got[0].tokens.clone(), bits)
                })
                .collect()
        };
        let eng = engine::start(store.clone(), None, config.clone()).unwrap();
        let cold = together(&eng);
        assert_eq!(together(&eng), cold, "prefix hits");
        assert!(eng.metrics().prefix_hit_tokens.load(Ordering::Relaxed) > 0);
        for (&(n, salt), want) in lens.iter().zip(&cold) {
            let got = eng.generate_blocking(greedy(n, salt)).unwrap();
            let bits: Vec<u32> = got[0].logprobs.iter().map(|x| x.to_bits()).collect();
            assert_eq!(
                (&got[0].tokens, &bits),
                (&want.0, &want.1),
                "alone, prompt of {n}"
            );
        }
        eng.pause().unwrap();
        nudge(&store);
        eng.resume();
        let after = together(&eng);
        let fresh = engine::start(store.clone(), None, config).unwrap();
        assert_eq!(after, together(&fresh), "updated == fresh");
        assert_ne!(after, cold, "the update changed the model");
        std::fs::remove_dir_all(&dir).ok();
    }
}
