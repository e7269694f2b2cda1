//! Qwen3.5 text model (dense): a hybrid of Gated DeltaNet ("linear
//! attention") layers and gated full-attention layers, as in transformers'
//! `models/qwen3_5` (see docs/ARCHITECTURE.md, "The model").
//!
//! `Qwen3_5::load` reads a Hugging Face checkpoint directory; `forward` runs
//! a batch of variable-length sequences packed without padding, each with its
//! own `SeqCache` (conv state and fp32 recurrent state per linear layer, K/V
//! per attention layer), so the same code does full-sequence scoring, prefill
//! and decode. Sequences never see each other: attention, conv and recurrent
//! state are all per sequence.
//!
//! The trainer's forward is this forward too, with activations kept
//! (`forward_keeping`, see `saved`): one layer implementation for
//! prefill, decode, scoring and training.
//!
//! Not for: paging, scheduling or sampling (the engine's cache and scheduler
//! sit above this), nor the backward (trainer).

use super::cpu::{self, CpuOps};
use super::ops::{take, LayerOps};
use super::saved::{FullActs, Keep, Kept, LayerActs, LinearActs, MixerActs, Trace};
use super::PrefillForm;
use crate::config::{LayerType, ModelConfig};
use crate::sampler::{score_rows, Sampled};
use crate::weights::Checkpoint;
use crate::{Error, Result};
use arcticd_kernels::cpu::{
    logsoftmax::logprob_gather_forward,
    matmul::{matmul_forward, matmul_forward_packed, pack_linear},
    sgemm::PackedB,
};
use arcticd_kernels::{DType, Tensor, TensorId};
use std::collections::{HashMap, HashSet};
use std::path::Path;

/// A linear layer's weight `[out, in]` and optional bias.
#[derive(Debug, Clone)]
pub struct Linear<T = Tensor> {
    pub weight: T,
    pub bias: Option<T>,
    pub in_features: usize,
    pub out_features: usize,
}

impl Linear<Shape> {
    fn plan(in_f: usize, out_f: usize, bias: bool) -> Self {
        Linear {
            weight: vec![out_f, in_f],
            bias: bias.then(|| vec![out_f]),
            in_features: in_f,
            out_features: out_f,
        }
    }
}

impl Linear {
    /// `out[n, out] = inp[n, in] @ W^T + b`.
    pub fn forward(&self, inp: &[f32], n: usize) -> Result<Vec<f32>> {
        self.forward_with(inp, n, None)
    }

    /// [`forward`](Self::forward), with the weight from `packs` when it is
    /// there (the same bits; see [`LinearPacks`]).
    pub fn forward_with(
        &self,
        inp: &[f32],
        n: usize,
        packs: Option<&LinearPacks>,
    ) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; n * self.out_features];
        let bias = match &self.bias {
            Some(b) => Some(b.as_f32()?),
            None => None,
        };
        if let Some(p) = packs.and_then(|p| p.get(&self.weight)) {
            matmul_forward_packed(&mut out, inp, p, bias, n)?;
            return Ok(out);
        }
        matmul_forward(
            &mut out,
            inp,
            self.weight.as_f32()?,
            bias,
            n,
            self.in_features,
            self.out_features,
        )?;
        Ok(out)
    }
}

/// The model's matrices (linear weights, the output head) packed once for
/// the matrix product, so decoding steps, which multiply every weight by a
/// few rows, do not re-pack each weight every step. Found by the weight
/// tensor's identity; built by [`Qwen3_5::pack_linears`] and valid only
/// until the weights change (the engine rebuilds it on a new weight
/// version). Empty where the packed product does not run (neither AVX-512
/// nor AVX2 + FMA).
/// A model read only through its packs can drop the f32 weights they hold
/// ([`Qwen3_5::load_packed`]).
///
/// Linears that read the same input (a linear layer's four input
/// projections, an attention layer's q, k and v, the MLP's gate and up) are
/// also packed side by side as one matrix, so a step multiplies the input
/// once for all of them ([`project`]). Each output column is still the same
/// sequential sum over the input, so the bits do not change.
#[derive(Debug, Default)]
pub struct LinearPacks {
    single: HashMap<TensorId, PackedB>,
    /// Keyed by the first member's weight; the members' widths.
    fused: HashMap<TensorId, (PackedB, Vec<usize>)>,
    /// Every weight whose values a pack holds (the singles and each member
    /// of a side-by-side pack).
    holds: HashSet<TensorId>,
}

impl LinearPacks {
    /// Bytes of every packed matrix together.
    pub fn bytes(&self) -> usize {
        let single: usize = self.single.values().map(PackedB::bytes).sum();
        single + self.fused.values().map(|(p, _)| p.bytes()).sum::<usize>()
    }

    /// Whether every matrix is packed in bf16 (its values all bf16 values;
    /// see [`PackedB`]).
    pub fn all_bf16(&self) -> bool {
        self.single.values().all(PackedB::is_bf16) && self.fused.values().all(|(p, _)| p.is_bf16())
    }

    /// Whether a pack holds the values of `weight`.
    pub fn holds(&self, weight: &Tensor) -> bool {
        self.holds.contains(&weight.id())
    }

    pub(crate) fn get(&self, weight: &Tensor) -> Option<&PackedB> {
        self.single
            .get(&weight.id())
            .filter(|p| p.dims().0 * p.dims().1 == weight.numel())
    }

    /// The side-by-side pack of `group`, when there is one for exactly
    /// these widths.
    pub(crate) fn get_fused(&self, group: &[&Linear]) -> Option<&PackedB> {
        let (p, widths) = self.fused.get(&group.first()?.weight.id())?;
        let same = widths.len() == group.len()
            && widths.iter().zip(group).all(|(w, l)| *w == l.out_features);
        same.then_some(p)
    }

    /// Packs `group` side by side (biasless linears over one input width);
    /// whether it did.
    fn add_fused(&mut self, group: &[&Linear]) -> Result<bool> {
        let c = group[0].in_features;
        if group.iter().any(|l| l.bias.is_some() || l.in_features != c) {
            return Ok(false);
        }
        let mut joined = Vec::new();
        for l in group {
            joined.extend_from_slice(l.weight.as_f32()?);
        }
        let widths: Vec<usize> = group.iter().map(|l| l.out_features).collect();
        let Some(p) = pack_linear(&joined, c, widths.iter().sum())? else {
            return Ok(false);
        };
        self.fused.insert(group[0].weight.id(), (p, widths));
        self.holds.extend(group.iter().map(|l| l.weight.id()));
        Ok(true)
    }

    /// Packs one matrix on its own; whether it did.
    fn add_single(&mut self, weight: &Tensor) -> Result<bool> {
        let [rows, cols] = *weight.shape() else {
            return Ok(false);
        };
        let Some(p) = pack_linear(weight.as_f32()?, cols, rows)? else {
            return Ok(false);
        };
        self.single.insert(weight.id(), p);
        self.holds.insert(weight.id());
        Ok(true)
    }
}

/// Rows of logits made at once by scoring and by the trainer's log-probs:
/// a 248k vocabulary never needs `tokens x vocab` floats (64 MiB a chunk),
/// and the two chunk alike, so their results match.
pub fn logit_rows_per_chunk(vocab: usize) -> usize {
    (1 << 24) / vocab.max(1) + 1
}

/// How a packed batch lies: every new token's id and position, and per
/// sequence `(start, new tokens, tokens already in its cache)`.
pub(crate) struct Layout {
    pub ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub spans: Vec<(usize, usize, usize)>,
}

impl Layout {
    pub(crate) fn of(batch: &[SeqInput<'_>]) -> Result<Self> {
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut spans = Vec::with_capacity(batch.len());
        for (s, seq) in batch.iter().enumerate() {
            if seq.tokens.is_empty() {
                return Err(Error::Input(format!("sequence {s} is empty")));
            }
            let (n, past) = (seq.tokens.len(), seq.cache.len);
            spans.push((ids.len(), n, past));
            ids.extend_from_slice(seq.tokens);
            positions.extend((past..past + n).map(|p| p as u32));
        }
        Ok(Layout {
            ids,
            positions,
            spans,
        })
    }
}

/// Every sequence is non-empty and its ids below `vocab`: what a forward
/// over fresh sequences (scoring, training) asks of its input.
pub fn check_ids<S: AsRef<[u32]>>(sequences: &[S], vocab: usize) -> Result<()> {
    for (s, seq) in sequences.iter().map(AsRef::as_ref).enumerate() {
        if seq.is_empty() {
            return Err(Error::Input(format!("sequence {s} is empty")));
        }
        if let Some((i, &id)) = seq.iter().enumerate().find(|(_, &id)| id as usize >= vocab) {
            return Err(Error::Input(format!(
                "sequence {s}, position {i}: token id {id} is not below the vocabulary size {vocab}"
            )));
        }
    }
    Ok(())
}

/// `sequences` paired with their caches (fresh ones, or the ones they continue).
fn fresh_batch<'a>(sequences: &[&'a [u32]], caches: &'a mut [SeqCache]) -> Vec<SeqInput<'a>> {
    sequences
        .iter()
        .zip(caches.iter_mut())
        .map(|(&tokens, cache)| SeqInput { tokens, cache })
        .collect()
}

/// Gated DeltaNet mixer weights.
#[derive(Debug, Clone)]
pub struct LinearAttention<T = Tensor> {
    pub in_proj_qkv: Linear<T>,
    pub in_proj_z: Linear<T>,
    pub in_proj_b: Linear<T>,
    pub in_proj_a: Linear<T>,
    /// Depthwise conv weight `[conv_dim, 1, kernel]`, the checkpoint's shape
    /// (so parameter names and shapes are exactly Hugging Face's).
    pub conv1d: T,
    pub a_log: T,
    pub dt_bias: T,
    /// Gated RMSNorm weight `[dv]` (plain w).
    pub norm: T,
    pub out_proj: Linear<T>,
}

impl<T> LinearAttention<T> {
    /// The projections of the layer input, in the order the layer code
    /// takes them.
    pub(crate) fn input_projections(&self) -> [&Linear<T>; 4] {
        [
            &self.in_proj_qkv,
            &self.in_proj_z,
            &self.in_proj_b,
            &self.in_proj_a,
        ]
    }
}

/// Gated full-attention mixer weights.
#[derive(Debug, Clone)]
pub struct FullAttention<T = Tensor> {
    /// `[n_heads * head_dim * 2, hidden]`: per head, query then gate.
    pub q_proj: Linear<T>,
    pub k_proj: Linear<T>,
    pub v_proj: Linear<T>,
    pub o_proj: Linear<T>,
    pub q_norm: T,
    pub k_norm: T,
}

impl<T> FullAttention<T> {
    /// The projections of the layer input, in the order the layer code
    /// takes them.
    pub(crate) fn input_projections(&self) -> [&Linear<T>; 3] {
        [&self.q_proj, &self.k_proj, &self.v_proj]
    }
}

#[derive(Debug, Clone)]
pub enum Mixer<T = Tensor> {
    Linear(Box<LinearAttention<T>>),
    Full(Box<FullAttention<T>>),
}

#[derive(Debug, Clone)]
pub struct Layer<T = Tensor> {
    pub input_layernorm: T,
    pub mixer: Mixer<T>,
    pub post_attention_layernorm: T,
    pub gate_proj: Linear<T>,
    pub up_proj: Linear<T>,
    pub down_proj: Linear<T>,
}

/// The Qwen3.5 text model's parameter tree, one `T` per parameter: the
/// model itself with `T = Tensor` (f32 parameters on the CPU), and any
/// other per-parameter value with another `T` (the trainer's gradients are
/// `Qwen3_5<Vec<f32>>`, [`Qwen3_5::plan`] is `Qwen3_5<Shape>`). The tree is
/// laid out once, from the config, in [`plan`](Qwen3_5::plan); parameter
/// names (Hugging Face's) and their order are given once, in
/// [`try_map`](Qwen3_5::try_map).
#[derive(Debug, Clone)]
pub struct Qwen3_5<T = Tensor> {
    pub config: ModelConfig,
    pub embed_tokens: T,
    pub layers: Vec<Layer<T>>,
    pub norm: T,
    /// `None` when tied to `embed_tokens`.
    pub lm_head: Option<T>,
}

/// A parameter's shape, the leaf of [`Qwen3_5::plan`].
pub type Shape = Vec<usize>;

/// Per-sequence decode state. Linear layers: conv history `[K-1, conv_dim]`
/// and recurrent state `[nv, dk, dv]` (fp32, always). Attention layers: the
/// post-norm, post-RoPE keys and the values of every position so far.
#[derive(Debug, Clone)]
pub struct SeqCache {
    pub conv_state: Vec<Vec<f32>>,
    pub recurrent_state: Vec<Vec<f32>>,
    pub k: Vec<Vec<f32>>,
    pub v: Vec<Vec<f32>>,
    /// Tokens already absorbed into this cache.
    pub len: usize,
}

impl SeqCache {
    /// A cache of the same shape holding zeros: the gradient of one.
    pub fn zeros_like(&self) -> SeqCache {
        let zeros = |x: &[Vec<f32>]| x.iter().map(|v| vec![0.0; v.len()]).collect();
        SeqCache {
            conv_state: zeros(&self.conv_state),
            recurrent_state: zeros(&self.recurrent_state),
            k: zeros(&self.k),
            v: zeros(&self.v),
            len: self.len,
        }
    }

    /// This cache with only layer `li`'s state: what a forward of that one
    /// layer reads, without copying every layer's keys.
    pub fn layer(&self, li: usize) -> SeqCache {
        let only = |x: &[Vec<f32>]| {
            (0..x.len())
                .map(|i| if i == li { x[i].clone() } else { Vec::new() })
                .collect()
        };
        SeqCache {
            conv_state: only(&self.conv_state),
            recurrent_state: only(&self.recurrent_state),
            k: only(&self.k),
            v: only(&self.v),
            len: self.len,
        }
    }
}

/// Where a sequence's past keys and values lie in a paged cache (see
/// [`Qwen3_5::forward_paged`]): positions `0..past` in the blocks of
/// `blocks`, `block_size` positions each, of the pools `pools[layer]` (the K
/// and V pools `[num_blocks, block_size, kv_row]` of each full-attention
/// layer, by model layer index; empty for the others).
#[derive(Clone, Copy, Debug)]
pub struct PagedPast<'a> {
    pub blocks: &'a [u32],
    pub block_size: usize,
    pub pools: &'a [(&'a [f32], &'a [f32])],
}

/// One sequence of a packed batch: new tokens, appended to what `cache` holds.
pub struct SeqInput<'a> {
    pub tokens: &'a [u32],
    pub cache: &'a mut SeqCache,
}

/// What the plan alone does not catch in a checkpoint: a conv bias (not
/// part of Qwen3.5) and a missing untied head.
fn check_checkpoint(config: &ModelConfig, ck: &Checkpoint) -> Result<()> {
    for (i, lt) in config.layer_types.iter().enumerate() {
        let bias = format!("{}layers.{i}.linear_attn.conv1d.bias", config.weight_prefix);
        if *lt == LayerType::LinearAttention && ck.contains(&bias) {
            return Err(Error::Weights(format!(
                "{bias}: a conv bias is not part of Qwen3.5"
            )));
        }
    }
    if !config.tie_word_embeddings && !ck.contains("lm_head.weight") {
        return Err(Error::Weights(
            "missing tensor lm_head.weight (and tie_word_embeddings is false)".into(),
        ));
    }
    Ok(())
}

impl Qwen3_5 {
    /// Load from a Hugging Face checkpoint directory (config.json + safetensors).
    pub fn load(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ck)
    }

    pub fn from_checkpoint(config: ModelConfig, ck: &Checkpoint) -> Result<Self> {
        check_checkpoint(&config, ck)?;
        Qwen3_5::plan(config).try_map(|name, shape| ck.get_f32(&name, shape))
    }

    /// An empty decode state for one sequence.
    pub fn new_cache(&self) -> SeqCache {
        let c = &self.config;
        let n = c.num_layers();
        let mut cache = SeqCache {
            conv_state: vec![Vec::new(); n],
            recurrent_state: vec![Vec::new(); n],
            k: vec![Vec::new(); n],
            v: vec![Vec::new(); n],
            len: 0,
        };
        for (i, lt) in c.layer_types.iter().enumerate() {
            if *lt == LayerType::LinearAttention {
                cache.conv_state[i] = vec![0.0; (c.conv_kernel - 1) * c.linear_conv_dim()];
                cache.recurrent_state[i] =
                    vec![
                        0.0;
                        c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
                    ];
            }
        }
        cache
    }

    /// The output projection `[vocab, hidden]` (tied or not).
    pub fn lm_head_weight(&self) -> &Tensor {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens)
    }

    /// Run the packed batch; returns the final hidden states (after the final
    /// norm) `[sum of new tokens, hidden]`, sequences in order. Caches advance.
    pub fn forward(&self, batch: &mut [SeqInput<'_>]) -> Result<Vec<f32>> {
        self.forward_with(batch, None)
    }

    /// [`forward`](Self::forward) with packed weights (the same bits).
    pub fn forward_with(
        &self,
        batch: &mut [SeqInput<'_>],
        packs: Option<&LinearPacks>,
    ) -> Result<Vec<f32>> {
        self.forward_paged(batch, None, packs, PrefillForm::Recurrent)
    }

    /// [`forward_with`](Self::forward_with) where sequence `s` may read its
    /// past keys and values in place from a paged cache, `pasts[s]`, instead
    /// of from its [`SeqCache`]: its cache then holds no K/V (it receives
    /// only the positions this call adds, for the caller to write back).
    /// The bits are those of the same K/V held in the cache. `form` is how
    /// the recurrence runs over each sequence's new tokens.
    pub fn forward_paged(
        &self,
        batch: &mut [SeqInput<'_>],
        pasts: Option<&[Option<PagedPast<'_>>]>,
        packs: Option<&LinearPacks>,
        form: PrefillForm,
    ) -> Result<Vec<f32>> {
        if pasts.is_some_and(|p| p.len() != batch.len()) {
            return Err(Error::Input(format!(
                "{} paged pasts for {} sequences",
                pasts.map_or(0, |p| p.len()),
                batch.len()
            )));
        }
        let layout = Layout::of(batch)?;
        let t = layout.ids.len();
        let mut ops = self.cpu_ops(&layout, batch, pasts, packs);
        ops.form = form;
        let mut x = ops.embed(&self.embed_tokens)?;
        for li in 0..self.layers.len() {
            self.layer_forward(&mut ops, li, &mut x, t, false)?;
        }
        for seq in batch.iter_mut() {
            seq.cache.len += seq.tokens.len();
        }
        Ok(self.final_norm(&x)?.0)
    }

    /// The training forward: `sequences`, each from position 0 with fresh
    /// state, packed back to back, through the same layer code as
    /// [`forward`](Self::forward) (so every number is the engine's, bit for
    /// bit), keeping what a backward needs ([`Keep`]).
    pub fn forward_keeping(&self, sequences: &[&[u32]], keep: Keep) -> Result<Trace> {
        let mut caches: Vec<SeqCache> = sequences.iter().map(|_| self.new_cache()).collect();
        self.forward_keeping_from(sequences, &mut caches, keep)
    }

    /// [`forward_keeping`](Self::forward_keeping) of sequences that
    /// continue what `caches` hold (one per sequence; fresh ones start at
    /// position 0), each cache advanced past its sequence: the trainer's
    /// forward of the attempts that share a prompt, after the prompt. The
    /// same layer code as a prefix-cache hit, so the same bits as one
    /// forward over the whole sequence.
    pub fn forward_keeping_from(
        &self,
        sequences: &[&[u32]],
        caches: &mut [SeqCache],
        keep: Keep,
    ) -> Result<Trace> {
        if caches.len() != sequences.len() {
            return Err(Error::Input(format!(
                "{} caches for {} sequences",
                caches.len(),
                sequences.len()
            )));
        }
        let mut batch = fresh_batch(sequences, caches);
        let layout = Layout::of(&batch)?;
        let t = layout.ids.len();
        let mut ops = self.cpu_ops(&layout, &mut batch, None, None);
        let mut x = ops.embed(&self.embed_tokens)?;
        let mut layers = Vec::with_capacity(self.layers.len());
        for li in 0..self.layers.len() {
            let all = keep == Keep::All;
            let x_in = (!all).then(|| x.clone());
            let acts = self.layer_forward(&mut ops, li, &mut x, t, all)?;
            layers.push(match (x_in, acts) {
                (Some(x_in), _) => Kept::Input(x_in),
                (None, Some(acts)) => Kept::All(Box::new(acts)),
                (None, None) => {
                    return Err(Error::Invariant(format!("layer {li} kept no activations")))
                }
            });
        }
        for seq in batch.iter_mut() {
            seq.cache.len += seq.tokens.len();
        }
        let (hidden, final_rstd) = self.final_norm(&x)?;
        Ok(Trace {
            layers,
            x_last: x,
            final_rstd,
            hidden,
        })
    }

    /// Layer `li`'s activations again, from its input `x_in`, for the
    /// sequences of [`forward_keeping`](Self::forward_keeping): what a
    /// backward over [`Keep::Inputs`] runs, the same code and bits.
    pub fn recompute_layer(
        &self,
        li: usize,
        x_in: &[f32],
        sequences: &[&[u32]],
    ) -> Result<LayerActs> {
        let caches = sequences.iter().map(|_| self.new_cache()).collect();
        self.recompute_layer_from(li, x_in, sequences, caches)
    }

    /// [`recompute_layer`](Self::recompute_layer) for the sequences of
    /// [`forward_keeping_from`](Self::forward_keeping_from), from the
    /// caches they started with.
    pub fn recompute_layer_from(
        &self,
        li: usize,
        x_in: &[f32],
        sequences: &[&[u32]],
        mut caches: Vec<SeqCache>,
    ) -> Result<LayerActs> {
        if li >= self.layers.len() {
            return Err(Error::Input(format!(
                "layer {li} of a model with {} layers",
                self.layers.len()
            )));
        }
        if caches.len() != sequences.len() {
            return Err(Error::Input(format!(
                "{} caches for {} sequences",
                caches.len(),
                sequences.len()
            )));
        }
        let mut batch = fresh_batch(sequences, &mut caches);
        let layout = Layout::of(&batch)?;
        if x_in.len() != layout.ids.len() * self.config.hidden_size {
            return Err(Error::Input(format!(
                "layer input of {} values for {} tokens",
                x_in.len(),
                layout.ids.len()
            )));
        }
        let mut x = x_in.to_vec();
        let t = layout.ids.len();
        let mut ops = self.cpu_ops(&layout, &mut batch, None, None);
        self.layer_forward(&mut ops, li, &mut x, t, true)?
            .ok_or_else(|| Error::Invariant(format!("layer {li} kept no activations")))
    }

    /// The final norm of the residual stream, and its reciprocal RMS per row.
    fn final_norm(&self, x: &[f32]) -> Result<(Vec<f32>, Vec<f32>)> {
        let c = &self.config;
        cpu::rmsnorm(x, &self.norm, c.hidden_size, c.rms_norm_eps)
    }

    /// The CPU's side of a forward over `batch`.
    fn cpu_ops<'a, 'b, 'c>(
        &'a self,
        layout: &'a Layout,
        batch: &'a mut [SeqInput<'b>],
        pasts: Option<&'a [Option<PagedPast<'c>>]>,
        packs: Option<&'a LinearPacks>,
    ) -> CpuOps<'a, 'b, 'c> {
        CpuOps {
            config: &self.config,
            layout,
            batch,
            pasts,
            packs,
            form: PrefillForm::Recurrent,
        }
    }

    /// Logits `[n, vocab]` for hidden rows `[n, hidden]`.
    pub fn logits(&self, hidden: &[f32]) -> Result<Vec<f32>> {
        self.logits_with(hidden, None)
    }

    /// [`logits`](Self::logits) with packed weights (the same bits).
    pub fn logits_with(&self, hidden: &[f32], packs: Option<&LinearPacks>) -> Result<Vec<f32>> {
        let (h, vsz) = (self.config.hidden_size, self.config.vocab_size);
        let n = hidden.len() / h;
        let mut out = vec![0.0f32; n * vsz];
        let weight = self.lm_head_weight();
        if let Some(p) = packs.and_then(|p| p.get(weight)) {
            matmul_forward_packed(&mut out, hidden, p, None, n)?;
            return Ok(out);
        }
        matmul_forward(&mut out, hidden, weight.as_f32()?, None, n, h, vsz)?;
        Ok(out)
    }

    /// `lp[s][t] = log p(tok_t | tok_<t)` for t >= 1 (index 0 is `None`).
    /// Logits are made a bounded number of rows at a time, so a real
    /// 248k-token vocabulary does not need `tokens x vocab` floats at once.
    pub fn score(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<Option<f32>>>> {
        self.score_with(sequences, None)
    }

    /// [`score`](Self::score) with packed weights (the same bits).
    pub fn score_with(
        &self,
        sequences: &[Vec<u32>],
        packs: Option<&LinearPacks>,
    ) -> Result<Vec<Vec<Option<f32>>>> {
        let vsz = self.config.vocab_size;
        let mut lps = Vec::new();
        self.scored_logits(sequences, packs, |logits, targets| {
            let mut lp = vec![0.0f32; targets.len()];
            logprob_gather_forward(&mut lp, logits, targets, targets.len(), vsz)?;
            lps.extend(lp);
            Ok(())
        })?;
        let mut it = lps.into_iter();
        Ok(sequences
            .iter()
            .map(|seq| {
                std::iter::once(None)
                    .chain((1..seq.len()).map(|_| it.next()))
                    .collect()
            })
            .collect())
    }

    /// Each token of `tokens` after the first with its log-prob under the
    /// model (temperature 1) and the `top` most likely tokens at its place,
    /// as the sampler reports a generated token: a prompt's log-probs.
    pub fn score_top(
        &self,
        tokens: &[u32],
        packs: Option<&LinearPacks>,
        top: usize,
    ) -> Result<Vec<Sampled>> {
        let mut out = Vec::with_capacity(tokens.len().saturating_sub(1));
        let mut logp = Vec::new();
        self.scored_logits(&[tokens.to_vec()], packs, |logits, targets| {
            score_rows(logits, targets, top, &mut logp, &mut out)
        })?;
        Ok(out)
    }

    /// The full forward of `sequences` (each from position 0, fresh
    /// state), then the logits of every scored row (all but the last
    /// position of each sequence) handed to `each` with the rows' target
    /// tokens, a bounded number of rows at a time, so a real 248k-token
    /// vocabulary does not need `tokens x vocab` floats at once.
    fn scored_logits(
        &self,
        sequences: &[Vec<u32>],
        packs: Option<&LinearPacks>,
        mut each: impl FnMut(&[f32], &[u32]) -> Result<()>,
    ) -> Result<()> {
        let vsz = self.config.vocab_size;
        check_ids(sequences, vsz)?;
        let mut caches: Vec<SeqCache> = sequences.iter().map(|_| self.new_cache()).collect();
        let seqs: Vec<&[u32]> = sequences.iter().map(Vec::as_slice).collect();
        let hidden = self.forward_with(&mut fresh_batch(&seqs, &mut caches), packs)?;
        let h = self.config.hidden_size;
        let mut rows = Vec::new();
        let mut targets = Vec::new();
        let mut start = 0;
        for seq in sequences {
            for i in 0..seq.len() - 1 {
                rows.push(start + i);
                targets.push(seq[i + 1]);
            }
            start += seq.len();
        }
        let rows_per_chunk = logit_rows_per_chunk(vsz);
        for (rchunk, tchunk) in rows
            .chunks(rows_per_chunk)
            .zip(targets.chunks(rows_per_chunk))
        {
            let mut hsel = Vec::with_capacity(rchunk.len() * h);
            for &r in rchunk {
                hsel.extend_from_slice(&hidden[r * h..(r + 1) * h]);
            }
            each(&self.logits_with(&hsel, packs)?, tchunk)?;
        }
        Ok(())
    }
}

/// A mixer's output and, with `keep`, its activations.
type MixerOut<B, A> = Result<(B, Option<A>)>;

/// A layer's activations in device `O`'s buffers.
type KeptLayer<O> = LayerActs<<O as LayerOps>::Buf, <O as LayerOps>::Checkpoints>;

/// The layer code, once for every device: a decoder layer over a packed
/// batch of `t` new tokens, written against the device seam ([`LayerOps`]).
/// Prefill, decode, scoring and the trainer's forward all run it.
impl<W> Qwen3_5<W> {
    /// Decoder layer `li`: `x` (the residual stream) is updated in place
    /// and each sequence's state of this layer advances. With `keep`, the
    /// layer's activations come back for a backward; the arithmetic is the
    /// same either way.
    pub(crate) fn layer_forward<O: LayerOps<W = W>>(
        &self,
        ops: &mut O,
        li: usize,
        x: &mut O::Buf,
        t: usize,
        keep: bool,
    ) -> Result<Option<KeptLayer<O>>> {
        let c = &self.config;
        let (h, eps) = (c.hidden_size, c.rms_norm_eps);
        let layer = &self.layers[li];
        let x_in = keep.then(|| ops.duplicate(x)).transpose()?;
        let (xn1, rstd1) = ops.rmsnorm(x, &layer.input_layernorm, h, eps)?;
        let (mixed, mixer) = match &layer.mixer {
            Mixer::Linear(la) => {
                let (out, acts) = self.delta_net(ops, la, li, &xn1, t, keep)?;
                (out, acts.map(|a| MixerActs::Linear(Box::new(a))))
            }
            Mixer::Full(fa) => {
                let (out, acts) = self.attention(ops, fa, li, &xn1, t, keep)?;
                (out, acts.map(|a| MixerActs::Full(Box::new(a))))
            }
        };
        ops.add_assign(x, &mixed)?;
        let x_mid = keep.then(|| ops.duplicate(x)).transpose()?;
        let (xn2, rstd2) = ops.rmsnorm(x, &layer.post_attention_layernorm, h, eps)?;
        let mlp_in = [&layer.gate_proj, &layer.up_proj];
        let [gate, up] = take("the MLP's projections", ops.project(&mlp_in, &xn2, t)?)?;
        let act = ops.silu_mul(&gate, &up, t, c.intermediate_size)?;
        let [mlp] = take("down_proj", ops.project(&[&layer.down_proj], &act, t)?)?;
        ops.add_assign(x, &mlp)?;
        let (Some(x_in), Some(mixer), Some(x_mid)) = (x_in, mixer, x_mid) else {
            return Ok(None);
        };
        Ok(Some(LayerActs {
            x_in,
            rstd1,
            xn1,
            mixer,
            x_mid,
            rstd2,
            xn2,
            gate,
            up,
            act,
        }))
    }

    /// A Gated DeltaNet mixer over the normed input `xn`: its output
    /// (after `out_proj`) and, with `keep`, its activations.
    fn delta_net<O: LayerOps<W = W>>(
        &self,
        ops: &mut O,
        la: &LinearAttention<W>,
        li: usize,
        xn: &O::Buf,
        t: usize,
        keep: bool,
    ) -> MixerOut<O::Buf, LinearActs<O::Buf, O::Checkpoints>> {
        let c = &self.config;
        let (nk, nv, dk, dv) = c.delta_heads();
        let [qkv, z, b, a] = take(
            "the input projections",
            ops.project(&la.input_projections(), xn, t)?,
        )?;
        // Causal conv per sequence, continuing from each sequence's conv state.
        let mut conv = ops.causal_conv(la, li, &qkv)?;
        let conv_pre = keep.then(|| ops.duplicate(&conv)).transpose()?;
        ops.silu(&mut conv)?;
        // Channels [q | k | v]; q and k normalised per head, q also scaled.
        let (qd, vd) = (nk * dk, nv * dv);
        let [q_raw, k_raw, v] = take("the conv's split", ops.split_columns(&conv, &[qd, qd, vd])?)?;
        let scale = 1.0 / (dk as f32).sqrt();
        let (q, rn_q) = ops.l2norm(&q_raw, t * nk, dk, scale)?;
        let (k, rn_k) = ops.l2norm(&k_raw, t * nk, dk, 1.0)?;
        let (g, beta) = ops.gating(la, &a, &b)?;
        let (core, checkpoints) = ops.recurrence(li, &q, &k, &v, &g, &beta, keep)?;
        let (normed, rstd) = ops.gated_rmsnorm(&core, &z, &la.norm, dv, c.rms_norm_eps)?;
        let [out] = take("out_proj", ops.project(&[&la.out_proj], &normed, t)?)?;
        let (Some(conv_pre), Some(checkpoints)) = (conv_pre, checkpoints) else {
            return Ok((out, None));
        };
        let acts = LinearActs {
            qkv,
            conv_pre,
            q_raw,
            k_raw,
            rn_q,
            rn_k,
            q,
            k,
            v,
            z,
            a,
            beta,
            g,
            core,
            rstd,
            normed,
            checkpoints,
        };
        Ok((out, Some(acts)))
    }

    /// A gated full-attention mixer over the normed input `xn`: its output
    /// (after `o_proj`) and, with `keep`, its activations.
    fn attention<O: LayerOps<W = W>>(
        &self,
        ops: &mut O,
        fa: &FullAttention<W>,
        li: usize,
        xn: &O::Buf,
        t: usize,
        keep: bool,
    ) -> MixerOut<O::Buf, FullActs<O::Buf>> {
        let c = &self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let [qg, k_raw, v] = take(
            "the input projections",
            ops.project(&fa.input_projections(), xn, t)?,
        )?;
        // Per head: head_dim query values, then head_dim gate values.
        let [q_raw, gate] = take("the query's split", ops.split_columns(&qg, &[hd, hd])?)?;
        let (q, q_rstd) = ops.qk_norm_rope(&q_raw, &fa.q_norm, nh)?;
        let (k, k_rstd) = ops.qk_norm_rope(&k_raw, &fa.k_norm, nkv)?;
        let mut out = ops.attention(li, &q, &k, &v)?;
        let attn = keep.then(|| ops.duplicate(&out)).transpose()?;
        ops.sigmoid_gate(&mut out, &gate)?;
        let [projected] = take("o_proj", ops.project(&[&fa.o_proj], &out, t)?)?;
        let acts = attn.map(|attn| FullActs {
            q_raw,
            gate,
            k_raw,
            q_rstd,
            k_rstd,
            q,
            k,
            v,
            attn,
            gated: out,
        });
        Ok((projected, acts))
    }
}

impl Qwen3_5<Shape> {
    /// How many numbers the model holds.
    pub fn parameters(&self) -> u64 {
        self.named()
            .iter()
            .map(|(_, s)| s.iter().product::<usize>() as u64)
            .sum()
    }

    /// Every parameter's shape, laid out from the config.
    pub fn plan(config: ModelConfig) -> Self {
        let c = &config;
        let h = c.hidden_size;
        let (nv, dv) = (c.linear_num_value_heads, c.linear_value_head_dim);
        let (nh, nkv, hd, bias) = (c.num_heads, c.num_kv_heads, c.head_dim, c.attention_bias);
        let (conv_dim, im) = (c.linear_conv_dim(), c.intermediate_size);
        let layers = c
            .layer_types
            .iter()
            .map(|lt| Layer {
                input_layernorm: vec![h],
                mixer: match lt {
                    LayerType::LinearAttention => Mixer::Linear(Box::new(LinearAttention {
                        in_proj_qkv: Linear::plan(h, conv_dim, false),
                        in_proj_z: Linear::plan(h, nv * dv, false),
                        in_proj_b: Linear::plan(h, nv, false),
                        in_proj_a: Linear::plan(h, nv, false),
                        conv1d: vec![conv_dim, 1, c.conv_kernel],
                        a_log: vec![nv],
                        dt_bias: vec![nv],
                        norm: vec![dv],
                        out_proj: Linear::plan(nv * dv, h, false),
                    })),
                    LayerType::FullAttention => Mixer::Full(Box::new(FullAttention {
                        q_proj: Linear::plan(h, nh * hd * 2, bias),
                        k_proj: Linear::plan(h, nkv * hd, bias),
                        v_proj: Linear::plan(h, nkv * hd, bias),
                        o_proj: Linear::plan(nh * hd, h, bias),
                        q_norm: vec![hd],
                        k_norm: vec![hd],
                    })),
                },
                post_attention_layernorm: vec![h],
                gate_proj: Linear::plan(h, im, false),
                up_proj: Linear::plan(h, im, false),
                down_proj: Linear::plan(im, h, false),
            })
            .collect();
        Qwen3_5 {
            embed_tokens: vec![c.vocab_size, h],
            layers,
            norm: vec![h],
            lm_head: (!c.tie_word_embeddings).then(|| vec![c.vocab_size, h]),
            config,
        }
    }
}

/// A linear layer's leaves through `$f` under `$name`; `[$($r)*]` is the
/// binding (`&` or `&mut`), as in [`map_tree`].
macro_rules! map_linear {
    ($l:expr, $name:expr, $f:ident, [$($r:tt)*]) => {{
        let l = $l;
        let name = $name;
        Linear {
            weight: $f(format!("{name}.weight"), $($r)* l.weight)?,
            bias: match $($r)* l.bias {
                Some(b) => Some($f(format!("{name}.bias"), b)?),
                None => None,
            },
            in_features: l.in_features,
            out_features: l.out_features,
        }
    }};
}

/// The one walk of the parameter tree: every parameter, with its Hugging
/// Face name, through `$f` (a `&mut FnMut(String, leaf) -> Result<U, E>`)
/// in one fixed order, into a tree of the results. `[$($r)*]` picks `&` or
/// `&mut`: one body for both, so the two walks cannot drift apart.
macro_rules! map_tree {
    ($model:expr, $f:ident, [$($r:tt)*]) => {{
        let m = $model;
        let p = m.config.weight_prefix.clone();
        let config = m.config.clone();
        let embed_tokens = $f(format!("{p}embed_tokens.weight"), $($r)* m.embed_tokens)?;
        let mut layers = Vec::with_capacity(m.layers.len());
        for (i, layer) in ($($r)* m.layers).into_iter().enumerate() {
            let l = format!("{p}layers.{i}.");
            let input_layernorm = $f(format!("{l}input_layernorm.weight"), $($r)* layer.input_layernorm)?;
            let post_attention_layernorm = $f(format!("{l}post_attention_layernorm.weight"), $($r)* layer.post_attention_layernorm)?;
            let mixer = match $($r)* layer.mixer {
                Mixer::Linear(la) => {
                    let a = format!("{l}linear_attn.");
                    Mixer::Linear(Box::new(LinearAttention {
                        in_proj_qkv: map_linear!($($r)* la.in_proj_qkv, format!("{a}in_proj_qkv"), $f, [$($r)*]),
                        in_proj_z: map_linear!($($r)* la.in_proj_z, format!("{a}in_proj_z"), $f, [$($r)*]),
                        in_proj_b: map_linear!($($r)* la.in_proj_b, format!("{a}in_proj_b"), $f, [$($r)*]),
                        in_proj_a: map_linear!($($r)* la.in_proj_a, format!("{a}in_proj_a"), $f, [$($r)*]),
                        conv1d: $f(format!("{a}conv1d.weight"), $($r)* la.conv1d)?,
                        a_log: $f(format!("{a}A_log"), $($r)* la.a_log)?,
                        dt_bias: $f(format!("{a}dt_bias"), $($r)* la.dt_bias)?,
                        norm: $f(format!("{a}norm.weight"), $($r)* la.norm)?,
                        out_proj: map_linear!($($r)* la.out_proj, format!("{a}out_proj"), $f, [$($r)*]),
                    }))
                }
                Mixer::Full(fa) => {
                    let a = format!("{l}self_attn.");
                    Mixer::Full(Box::new(FullAttention {
                        q_proj: map_linear!($($r)* fa.q_proj, format!("{a}q_proj"), $f, [$($r)*]),
                        k_proj: map_linear!($($r)* fa.k_proj, format!("{a}k_proj"), $f, [$($r)*]),
                        v_proj: map_linear!($($r)* fa.v_proj, format!("{a}v_proj"), $f, [$($r)*]),
                        o_proj: map_linear!($($r)* fa.o_proj, format!("{a}o_proj"), $f, [$($r)*]),
                        q_norm: $f(format!("{a}q_norm.weight"), $($r)* fa.q_norm)?,
                        k_norm: $f(format!("{a}k_norm.weight"), $($r)* fa.k_norm)?,
                    }))
                }
            };
            let mm = format!("{l}mlp.");
            layers.push(Layer {
                input_layernorm,
                mixer,
                post_attention_layernorm,
                gate_proj: map_linear!($($r)* layer.gate_proj, format!("{mm}gate_proj"), $f, [$($r)*]),
                up_proj: map_linear!($($r)* layer.up_proj, format!("{mm}up_proj"), $f, [$($r)*]),
                down_proj: map_linear!($($r)* layer.down_proj, format!("{mm}down_proj"), $f, [$($r)*]),
            });
        }
        let norm = $f(format!("{p}norm.weight"), $($r)* m.norm)?;
        let lm_head = match $($r)* m.lm_head {
            Some(h) => Some($f("lm_head.weight".to_string(), h)?),
            None => None,
        };
        Qwen3_5 {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
        }
    }};
}

impl<T> Qwen3_5<T> {
    /// The same tree with `f(name, leaf)` at every leaf, visited in the
    /// order of [`named`](Self::named); the first error stops the walk.
    pub fn try_map<'a, U, E>(
        &'a self,
        mut f: impl FnMut(String, &'a T) -> std::result::Result<U, E>,
    ) -> std::result::Result<Qwen3_5<U>, E> {
        Ok(map_tree!(self, f, [&]))
    }

    /// [`try_map`](Self::try_map) through mutable leaves.
    pub fn try_map_mut<'a, U, E>(
        &'a mut self,
        mut f: impl FnMut(String, &'a mut T) -> std::result::Result<U, E>,
    ) -> std::result::Result<Qwen3_5<U>, E> {
        Ok(map_tree!(self, f, [&mut]))
    }

    /// The same tree with `f(leaf)` at every leaf.
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> Qwen3_5<U> {
        let mapped = self.try_map(|_, t| Ok::<U, std::convert::Infallible>(f(t)));
        match mapped {
            Ok(tree) => tree,
            Err(never) => match never {},
        }
    }

    /// Every parameter with its Hugging Face name (under `weight_prefix`,
    /// and `lm_head.weight` when untied), in one fixed order: the order the
    /// optimizer, the gradients and the checkpoint writer all walk.
    pub fn named(&self) -> Vec<(String, &T)> {
        let mut out = Vec::new();
        let walked = self.try_map(|name, t| {
            out.push((name, t));
            Ok::<(), std::convert::Infallible>(())
        });
        match walked {
            Ok(_) => out,
            Err(never) => match never {},
        }
    }

    /// Mutable form of [`named`](Self::named), same order.
    pub fn named_mut(&mut self) -> Vec<(String, &mut T)> {
        let mut out = Vec::new();
        let walked = self.try_map_mut(|name, t| {
            out.push((name, t));
            Ok::<(), std::convert::Infallible>(())
        });
        match walked {
            Ok(_) => out,
            Err(never) => match never {},
        }
    }
}

impl Qwen3_5 {
    /// Every two-dimensional parameter (linear weights, embeddings / output
    /// head) packed for the matrix product; see [`LinearPacks`]. Empty
    /// packs where the packed product does not run.
    pub fn pack_linears(&self) -> Result<LinearPacks> {
        let mut packs = LinearPacks::default();
        if !arcticd_kernels::cpu::sgemm::available() {
            return Ok(packs);
        }
        for li in 0..self.layers.len() {
            self.pack_layer(li, &mut packs)?;
        }
        self.pack_head(&mut packs)?;
        Ok(packs)
    }

    /// Layer `li`'s matrices into `packs`: the groups that read one input
    /// side by side, every other matrix on its own.
    fn pack_layer(&self, li: usize, packs: &mut LinearPacks) -> Result<()> {
        let layer = &self.layers[li];
        let mut groups = vec![vec![&layer.gate_proj, &layer.up_proj]];
        let mut singles = vec![&layer.down_proj];
        match &layer.mixer {
            Mixer::Linear(la) => {
                groups.push(la.input_projections().to_vec());
                singles.push(&la.out_proj);
            }
            Mixer::Full(fa) => {
                groups.push(fa.input_projections().to_vec());
                singles.push(&fa.o_proj);
            }
        }
        for g in groups {
            if !packs.add_fused(&g)? {
                singles.extend(g);
            }
        }
        for l in singles {
            packs.add_single(&l.weight)?;
        }
        Ok(())
    }

    /// The output head (the embedding table when tied) into `packs`.
    fn pack_head(&self, packs: &mut LinearPacks) -> Result<()> {
        packs.add_single(self.lm_head_weight())?;
        Ok(())
    }

    /// Load a model to be read only through its packed matrices (serving:
    /// no gradient, no weight update), holding each weight once: the
    /// matrices a pack holds are released as soon as their layer is packed,
    /// so at most one layer's matrices are held twice while loading. The
    /// embedding table stays (tokens are looked up in it), packed too when
    /// it is the output head. Where the packed product does not run, this
    /// is [`load`](Self::load) with empty packs.
    pub fn load_packed(dir: &Path) -> Result<(Self, LinearPacks)> {
        if !arcticd_kernels::cpu::sgemm::available() {
            return Ok((Self::load(dir)?, LinearPacks::default()));
        }
        let config = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        check_checkpoint(&config, &ck)?;
        let mut model = Qwen3_5::plan(config)
            .try_map(|_, shape| Ok::<_, Error>(Tensor::released(shape, DType::F32)))?;
        let p = model.config.weight_prefix.clone();
        // The layer a parameter belongs to, from its name (None: outside
        // the layers).
        let layer_of = |name: &str| -> Option<usize> {
            let rest = name.strip_prefix(&p)?.strip_prefix("layers.")?;
            rest.split('.').next()?.parse().ok()
        };
        let mut packs = LinearPacks::default();
        for unit in std::iter::once(None).chain((0..model.layers.len()).map(Some)) {
            for (name, t) in model.named_params_mut() {
                if layer_of(&name) == unit {
                    *t = ck.get_f32(&name, t.shape())?;
                }
            }
            match unit {
                Some(li) => model.pack_layer(li, &mut packs)?,
                None => model.pack_head(&mut packs)?,
            }
            let embed = model.embed_tokens.id();
            for (name, t) in model.named_params_mut() {
                if layer_of(&name) == unit && t.id() != embed && packs.holds(t) {
                    t.release();
                }
            }
        }
        Ok((model, packs))
    }

    /// Bytes of parameter values the model holds (released ones excluded).
    pub fn held_bytes(&self) -> usize {
        self.named_params()
            .iter()
            .map(|(_, t)| t.held_bytes())
            .sum()
    }

    /// [`named`](Self::named), the model's parameters.
    pub fn named_params(&self) -> Vec<(String, &Tensor)> {
        self.named()
    }

    /// [`named_mut`](Self::named_mut): the parameter store is updated in
    /// place through this.
    pub fn named_params_mut(&mut self) -> Vec<(String, &mut Tensor)> {
        self.named_mut()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::init::{init_model, TINY};

    /// The plan, the loaded model and the checkpoint agree: the same names
    /// in the same order, each parameter of its planned shape, and every
    /// tensor of the checkpoint is one of them.
    #[test]
    fn the_plan_names_every_checkpoint_tensor_once() {
        let dir = std::env::temp_dir().join(format!("arcticd-plan-{}", std::process::id()));
        init_model(TINY, &dir, 5).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        let ck = Checkpoint::open(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let plan = Qwen3_5::plan(model.config.clone());
        let planned = plan.named();
        let loaded = model.named_params();
        assert_eq!(planned.len(), loaded.len());
        for ((pn, shape), (ln, t)) in planned.iter().zip(&loaded) {
            assert_eq!(pn, ln);
            assert_eq!(&t.shape().to_vec(), *shape, "{pn}");
        }
        let mut names: Vec<&str> = ck.names().collect();
        names.sort();
        let mut ours: Vec<&str> = planned.iter().map(|(n, _)| n.as_str()).collect();
        ours.sort();
        assert_eq!(names, ours);
        // A tree of another leaf type walks in the same order.
        let sizes = model.map(|t| t.numel());
        let sized: Vec<usize> = sizes.named().into_iter().map(|(_, n)| *n).collect();
        let numels: Vec<usize> = loaded.iter().map(|(_, t)| t.numel()).collect();
        assert_eq!(sized, numels);
    }

    /// A memory plan's activation count is what a training forward keeps,
    /// to the value, with sequences shorter and longer than a checkpoint
    /// interval, in both keep modes, and one layer at a time.
    #[test]
    fn planned_activations_are_what_the_forward_keeps() {
        use crate::model::saved::{planned_floats, planned_layer_floats};
        let dir = std::env::temp_dir().join(format!("arcticd-acts-{}", std::process::id()));
        init_model(TINY, &dir, 6).unwrap();
        let model = Qwen3_5::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let c = &model.config;
        let every = arcticd_kernels::cpu::gated_delta::CHECKPOINT_EVERY;
        let lens = [1, 7, every, every + 3, 2 * every + 1];
        let seqs: Vec<Vec<u32>> = lens
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 7 + 1) % 50).collect())
            .collect();
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        for keep in [Keep::All, Keep::Inputs] {
            let trace = model.forward_keeping(&refs, keep).unwrap();
            assert_eq!(trace.floats(), planned_floats(c, &lens, keep), "{keep:?}");
        }
        let trace = model.forward_keeping(&refs, Keep::Inputs).unwrap();
        for (li, kept) in trace.layers.iter().enumerate() {
            let Kept::Input(x) = kept else { panic!() };
            let acts = model.recompute_layer(li, x, &refs).unwrap();
            assert_eq!(
                acts.floats(),
                planned_layer_floats(c, li, &lens),
                "layer {li}"
            );
        }
    }

    /// Packed weights, single and side by side, give the unpacked bits, in
    /// a prefill of two sequences and in the decode step after it; with
    /// f32 weights and with weights that are all bf16 values (then packed in
    /// bf16, half the bytes).
    #[test]
    fn packed_weights_give_the_same_bits() {
        let dir = std::env::temp_dir().join(format!("arcticd-packs-{}", std::process::id()));
        init_model(TINY, &dir, 3).unwrap();
        let mut model = Qwen3_5::load(&dir).unwrap();
        std::fs::remove_dir_all(&dir).ok();
        let mut f32_bytes = 0;
        for weights in ["f32", "bf16"] {
            if weights == "bf16" {
                for (_, t) in model.named_params_mut() {
                    for x in t.as_f32_mut().unwrap() {
                        *x = half::bf16::from_f32(*x).to_f32();
                    }
                }
            }
            let packs = model.pack_linears().unwrap();
            let mut runs = Vec::new();
            for p in [None, Some(&packs)] {
                let mut caches = [model.new_cache(), model.new_cache()];
                let [c0, c1] = &mut caches;
                let mut out = Vec::new();
                let prompts: [Vec<u32>; 2] = [(1..20).collect(), (30..36).collect()];
                let mut batch = [
                    SeqInput {
                        tokens: &prompts[0],
                        cache: c0,
                    },
                    SeqInput {
                        tokens: &prompts[1],
                        cache: c1,
                    },
                ];
                let hidden = model.forward_with(&mut batch, p).unwrap();
                out.extend(model.logits_with(&hidden, p).unwrap());
                let [c0, c1] = &mut caches;
                let mut batch = [
                    SeqInput {
                        tokens: &[7],
                        cache: c0,
                    },
                    SeqInput {
                        tokens: &[9],
                        cache: c1,
                    },
                ];
                let hidden = model.forward_with(&mut batch, p).unwrap();
                out.extend(model.logits_with(&hidden, p).unwrap());
                runs.push(out.iter().map(|x| x.to_bits()).collect::<Vec<u32>>());
            }
            if arcticd_kernels::cpu::sgemm::available() {
                assert!(!packs.fused.is_empty() && !packs.single.is_empty());
                match weights {
                    "f32" => {
                        assert!(!packs.all_bf16());
                        f32_bytes = packs.bytes();
                    }
                    _ => {
                        assert!(packs.all_bf16());
                        assert_eq!(2 * packs.bytes(), f32_bytes);
                    }
                }
            }
            assert_eq!(runs[0], runs[1], "{weights} weights");
        }
    }
}
