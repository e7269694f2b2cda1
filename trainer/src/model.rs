//! Training forward and backward of Qwen3.5.
//!
//! The forward is the engine's (`Qwen3_5::forward_keeping`,
//! engine/src/model/qwen3_5.rs): the same layer code that prefills, decodes
//! and scores, with the activations the backward needs kept
//! (`arcticd_engine::model::saved`), so a token's log-probability here is
//! the engine's, bit for bit. The backward walks the layers in reverse
//! (`backward.rs`, written once over a device seam); here are its CPU ops,
//! the `*_backward` kernels.
//!
//! Batches are packed without padding: every sequence starts at position 0
//! with fresh conv/recurrent state, attention runs per sequence, and the conv
//! and gated-delta backwards run per sequence too, so nothing leaks across a
//! sequence boundary in either direction.
//!
//! Gradients: parameter gradients accumulate (`+=`) into [`ModelGrads`] (so
//! micro-batches add up); the residual-stream gradient accumulates within a
//! pass; every other buffer is written. Activations are held for the whole
//! pass, or only each layer's input with `ForwardOptions::recompute_layers`;
//! the gated-delta backward recomputes its states from per-chunk checkpoints.

use crate::backward::{model_backward, BackwardOps, Forward};
use crate::grads::{LinearAttnGrad, LinearGrad, ModelGrads};
use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{Linear, LinearAttention};
use arcticd_engine::model::saved::{FullActs, Keep, Kept, LayerActs, LinearActs};
use arcticd_engine::model::{check_ids, logit_rows_per_chunk, Trace};
use arcticd_engine::{Qwen3_5, SeqCache};
use arcticd_kernels::cpu::{
    activation::{
        gated_delta_gating_backward, sigmoid_gate_backward, silu_backward, silu_mul_backward,
    },
    attention::{attention_backward, AttnDims},
    conv1d::conv1d_backward,
    embedding::embedding_backward,
    gated_delta::{
        gated_delta_backward_from_checkpoints, gated_delta_chunked_backward_from_checkpoints,
        GatedDeltaDims,
    },
    l2norm::l2norm_backward,
    logsoftmax::{
        entropy_backward, entropy_forward, logprob_gather_backward, logprob_gather_forward,
    },
    matmul::{matmul_backward, matmul_forward},
    rmsnorm::{gated_rmsnorm_backward, rmsnorm_backward},
    rope::rope_backward,
};
use arcticd_kernels::Tensor;
use std::ops::Range;

/// A packed batch: token ids of every sequence back to back.
#[derive(Debug, Clone)]
pub struct Packed {
    pub ids: Vec<u32>,
    /// `(start, len)` of each sequence in `ids`.
    pub spans: Vec<(usize, usize)>,
    /// Position of every token within its sequence.
    pub positions: Vec<u32>,
}

impl Packed {
    /// Pack `sequences` (each non-empty, ids below `vocab`).
    pub fn new(sequences: &[Vec<u32>], vocab: usize) -> Result<Self> {
        let refs: Vec<&[u32]> = sequences.iter().map(|s| s.as_slice()).collect();
        Self::continuing(&refs, &vec![0; refs.len()], vocab)
    }

    /// Pack `sequences` that continue from position `past[i]` (the tokens
    /// before it are in a cache): the positions start there.
    pub fn continuing(sequences: &[&[u32]], past: &[usize], vocab: usize) -> Result<Self> {
        check_ids(sequences, vocab).map_err(|e| match e {
            arcticd_engine::Error::Input(m) => Error::Input(m),
            e => Error::Engine(e),
        })?;
        if past.len() != sequences.len() {
            return Err(Error::Shape(format!(
                "{} start positions for {} sequences",
                past.len(),
                sequences.len()
            )));
        }
        let mut ids = Vec::new();
        let mut spans = Vec::with_capacity(sequences.len());
        let mut positions = Vec::new();
        for (seq, &p0) in sequences.iter().zip(past) {
            spans.push((ids.len(), seq.len()));
            ids.extend_from_slice(seq);
            positions.extend((p0..p0 + seq.len()).map(|p| p as u32));
        }
        Ok(Packed {
            ids,
            spans,
            positions,
        })
    }

    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Each sequence's ids.
    pub fn sequences(&self) -> Vec<&[u32]> {
        self.spans
            .iter()
            .map(|&(start, n)| &self.ids[start..start + n])
            .collect()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }
}

/// Everything the backward needs from one forward.
#[derive(Debug)]
pub struct Activations {
    pub packed: Packed,
    layers: Vec<Kept>,
    x_last: Vec<f32>,
    final_rstd: Vec<f32>,
    /// Final hidden states after the final norm, `[tokens, hidden]`.
    pub hidden: Vec<f32>,
}

/// How much of the forward the backward keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ForwardOptions {
    /// Keep only each layer's input and recompute the layer's activations
    /// in the backward (per-layer activation checkpointing): one extra layer
    /// forward per layer, activation memory of one layer instead of all.
    /// The gradients are identical (the forward is deterministic).
    pub recompute_layers: bool,
}

/// The training forward over a packed batch, keeping every activation.
pub fn forward(model: &Qwen3_5, packed: Packed) -> Result<Activations> {
    forward_with(model, packed, ForwardOptions::default())
}

/// The training forward with [`ForwardOptions`]: the engine's forward
/// (`Qwen3_5::forward_keeping`), the same layer code the engine serves with.
pub fn forward_with(model: &Qwen3_5, packed: Packed, opts: ForwardOptions) -> Result<Activations> {
    let keep = if opts.recompute_layers {
        Keep::Inputs
    } else {
        Keep::All
    };
    let trace = model.forward_keeping(&packed.sequences(), keep)?;
    Ok(Activations::of(packed, trace))
}

impl Activations {
    fn of(packed: Packed, trace: Trace) -> Self {
        Activations {
            packed,
            layers: trace.layers,
            x_last: trace.x_last,
            final_rstd: trace.final_rstd,
            hidden: trace.hidden,
        }
    }
}

/// Consecutive sequences of a micro-batch that share their first tokens
/// (the attempts of one task share its prompt, and often their first
/// turns): `members` and the `shared` tokens each of them starts with.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrefixGroup {
    pub members: Range<usize>,
    pub shared: usize,
}

/// Groups of consecutive sequences worth running as one shared prefix and
/// their rests: each group's longest common prefix, short of every
/// member's last token (each rest keeps one). A sequence joins the group
/// before it when that does not lower the tokens the group saves
/// (`shared x (members - 1)`).
pub fn plan_prefixes(sequences: &[&[u32]]) -> Vec<PrefixGroup> {
    let mut groups: Vec<PrefixGroup> = Vec::new();
    let mut open: Option<PrefixGroup> = None;
    for (s, seq) in sequences.iter().enumerate() {
        let own = seq.len().saturating_sub(1);
        if let Some(g) = open.as_mut() {
            let lead = sequences[g.members.start];
            let common = lead
                .iter()
                .zip(seq.iter())
                .take_while(|(a, b)| a == b)
                .count();
            let shared = g.shared.min(common).min(own);
            let members = g.members.len();
            if shared > 0 && shared * members >= g.shared * (members - 1) {
                g.members.end = s + 1;
                g.shared = shared;
                continue;
            }
        }
        if let Some(g) = open.take().filter(|g| g.members.len() > 1) {
            groups.push(g);
        }
        open = Some(PrefixGroup {
            members: s..s + 1,
            shared: own,
        });
    }
    groups.extend(open.filter(|g| g.members.len() > 1));
    groups
}

/// The training forward over sequences that share prompts
/// ([`plan_prefixes`]): each group's shared tokens once, then every
/// sequence's rest continuing from its prefix's caches, the way the engine
/// continues a prefix-cache hit, so every log-prob has the bits of the
/// unshared forward. A scored position inside a prefix is scored once
/// there for every member (the same hidden state), its members' loss
/// gradients summed into it. The backward ([`backward_shared`]) carries
/// the rests' gradients of the prefixes' caches into the prefixes.
#[derive(Debug)]
pub struct SharedActivations {
    /// The shared prefixes, one per group; `None` when nothing is shared.
    prefixes: Option<Activations>,
    /// Each prefix's caches after it: where its group's rests start.
    caches: Vec<SeqCache>,
    /// Every sequence's rest (all of it where it shares nothing).
    rests: Activations,
    /// The group each sequence's rest continues.
    group_of: Vec<Option<usize>>,
    /// Final hidden states, `[tokens, hidden]`: the rests' rows, then the
    /// prefixes'.
    pub hidden: Vec<f32>,
}

impl SharedActivations {
    /// Tokens the forward ran: the prefixes once and every rest.
    pub fn tokens(&self) -> usize {
        self.rests.packed.len() + self.prefixes.as_ref().map_or(0, |p| p.packed.len())
    }
}

/// [`forward_with`] over `sequences` with `groups` sharing their prefixes.
/// `rows` index the sequences packed whole; they come back indexing
/// [`SharedActivations::hidden`].
pub fn forward_shared(
    model: &Qwen3_5,
    sequences: &[&[u32]],
    groups: &[PrefixGroup],
    rows: &[usize],
    opts: ForwardOptions,
) -> Result<(SharedActivations, Vec<usize>)> {
    let keep = if opts.recompute_layers {
        Keep::Inputs
    } else {
        Keep::All
    };
    let vocab = model.config.vocab_size;
    let mut cut = vec![0usize; sequences.len()];
    let mut group_of = vec![None; sequences.len()];
    for (gi, g) in groups.iter().enumerate() {
        let lead = sequences.get(g.members.start).copied().unwrap_or_default();
        for s in g.members.clone() {
            let seq = sequences.get(s).copied().unwrap_or_default();
            if g.shared == 0 || g.shared >= seq.len() || seq[..g.shared] != lead[..g.shared] {
                return Err(Error::Shape(format!(
                    "sequence {s} does not start with its group's {} shared tokens",
                    g.shared
                )));
            }
            if group_of[s].replace(gi).is_some() {
                return Err(Error::Shape(format!("sequence {s} is in two groups")));
            }
            cut[s] = g.shared;
        }
    }
    let prefix_seqs: Vec<&[u32]> = groups
        .iter()
        .map(|g| &sequences[g.members.start][..g.shared])
        .collect();
    let mut caches: Vec<SeqCache> = prefix_seqs.iter().map(|_| model.new_cache()).collect();
    let prefixes = if prefix_seqs.is_empty() {
        None
    } else {
        let packed = Packed::continuing(&prefix_seqs, &vec![0; prefix_seqs.len()], vocab)?;
        let trace = model.forward_keeping_from(&prefix_seqs, &mut caches, keep)?;
        Some(Activations::of(packed, trace))
    };
    let rest_seqs: Vec<&[u32]> = sequences.iter().zip(&cut).map(|(s, &c)| &s[c..]).collect();
    let packed = Packed::continuing(&rest_seqs, &cut, vocab)?;
    let mut rest_caches: Vec<SeqCache> = group_of
        .iter()
        .map(|g| g.map_or_else(|| model.new_cache(), |g| caches[g].clone()))
        .collect();
    let trace = model.forward_keeping_from(&rest_seqs, &mut rest_caches, keep)?;
    drop(rest_caches);
    let mut rests = Activations::of(packed, trace);
    // Rows of the whole packing, moved to the rests' or the prefixes'.
    let rest_tokens = rests.packed.len();
    let mut whole_start = Vec::with_capacity(sequences.len());
    let mut at = 0;
    for seq in sequences {
        whole_start.push(at);
        at += seq.len();
    }
    let moved = rows
        .iter()
        .map(|&r| {
            let s = whole_start.partition_point(|&st| st <= r).saturating_sub(1);
            let off = r.checked_sub(whole_start.get(s).copied().unwrap_or(0));
            match (off, group_of.get(s).copied().flatten(), &prefixes) {
                (Some(off), _, _) if off >= sequences.get(s).map_or(0, |q| q.len()) => {
                    Err(Error::Shape(format!("row {r} is past the batch")))
                }
                (Some(off), Some(g), Some(p)) if off < cut[s] => {
                    Ok(rest_tokens + p.packed.spans[g].0 + off)
                }
                (Some(off), _, _) => off
                    .checked_sub(cut[s])
                    .map(|o| rests.packed.spans[s].0 + o)
                    .ok_or_else(|| Error::Shape(format!("row {r} lies in no prefix"))),
                (None, _, _) => Err(Error::Shape(format!("row {r} is past the batch"))),
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let mut hidden = std::mem::take(&mut rests.hidden);
    let mut prefixes = prefixes;
    if let Some(p) = prefixes.as_mut() {
        hidden.append(&mut p.hidden);
    }
    Ok((
        SharedActivations {
            prefixes,
            caches,
            rests,
            group_of,
            hidden,
        },
        moved,
    ))
}

/// Backward of [`forward_shared`] from `dhidden` (the gradient of
/// [`SharedActivations::hidden`]): the rests first, which leaves the
/// gradient of every prefix's caches (summed over its group), then the
/// prefixes from those and their own rows. Parameter gradients accumulate
/// into `grads`.
pub fn backward_shared(
    model: &Qwen3_5,
    acts: &SharedActivations,
    dhidden: &[f32],
    grads: &mut ModelGrads,
) -> Result<()> {
    let h = model.config.hidden_size;
    if dhidden.len() != acts.tokens() * h {
        return Err(Error::Shape(format!(
            "dhidden has {} values for {} tokens x {h}",
            dhidden.len(),
            acts.tokens()
        )));
    }
    let (drests, dprefixes) = dhidden.split_at(acts.rests.packed.len() * h);
    let mut dcaches: Vec<SeqCache> = acts.caches.iter().map(SeqCache::zeros_like).collect();
    run_backward(
        model,
        &acts.rests,
        drests,
        grads,
        Link::Continues {
            group_of: &acts.group_of,
            caches: &acts.caches,
            dcaches: &mut dcaches,
        },
    )?;
    if let Some(prefixes) = &acts.prefixes {
        run_backward(
            model,
            prefixes,
            dprefixes,
            grads,
            Link::Continued { dcaches: &dcaches },
        )?;
    }
    Ok(())
}

/// `lp[i] = log p(targets[i] | hidden row rows[i])`.
pub fn token_logprobs(
    model: &Qwen3_5,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
) -> Result<Vec<f32>> {
    Ok(token_logprobs_entropy(model, hidden, rows, targets, false, 1.0)?.0)
}

/// [`token_logprobs`] of the distribution at `temperature` (`logits / T`,
/// the engine sampler's exact arithmetic: `x * (1 / T)` in f32, skipped at
/// `T = 1` and for greedy `T = 0`, which the sampler reports at `T = 1`),
/// and with `entropy` also that distribution's entropy at each row (same
/// logits, computed once).
pub fn token_logprobs_entropy(
    model: &Qwen3_5,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    entropy: bool,
    temperature: f32,
) -> Result<(Vec<f32>, Option<Vec<f32>>)> {
    let inv_t = inverse_temperature(temperature)?;
    let (h, vsz) = (model.config.hidden_size, model.config.vocab_size);
    check_rows(hidden.len() / h.max(1), rows, targets)?;
    let w = model.lm_head_weight().as_f32()?;
    let per = logit_rows_per_chunk(vsz);
    let mut lps = Vec::with_capacity(rows.len());
    let mut ents = Vec::with_capacity(if entropy { rows.len() } else { 0 });
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let hsel = gather_rows(hidden, rc, h);
        let mut logits = vec![0.0f32; rc.len() * vsz];
        matmul_forward(&mut logits, &hsel, w, None, rc.len(), h, vsz)?;
        scale_logits(&mut logits, inv_t);
        let mut lp = vec![0.0f32; rc.len()];
        logprob_gather_forward(&mut lp, &logits, tc, rc.len(), vsz)?;
        lps.extend(lp);
        if entropy {
            let mut e = vec![0.0f32; rc.len()];
            entropy_forward(&mut e, &logits, rc.len(), vsz)?;
            ents.extend(e);
        }
    }
    Ok((lps, entropy.then_some(ents)))
}

/// `1 / T` as the sampler computes it; `None` where the sampler does not
/// scale (`T = 1`, or greedy).
pub(crate) fn inverse_temperature(temperature: f32) -> Result<Option<f32>> {
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(Error::Input(format!(
            "temperature must be a finite number >= 0, got {temperature}"
        )));
    }
    Ok((temperature > 1e-6 && temperature != 1.0).then(|| 1.0 / temperature))
}

fn scale_logits(logits: &mut [f32], inv_t: Option<f32>) {
    if let Some(s) = inv_t {
        logits.iter_mut().for_each(|x| *x *= s);
    }
}

pub(crate) fn check_rows(n: usize, rows: &[usize], targets: &[u32]) -> Result<()> {
    if rows.len() != targets.len() {
        return Err(Error::Input(format!(
            "{} rows but {} targets",
            rows.len(),
            targets.len()
        )));
    }
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(Error::Input(format!("row {r} is past the {n} tokens")));
    }
    Ok(())
}

fn gather_rows(x: &[f32], rows: &[usize], h: usize) -> Vec<f32> {
    let mut out = Vec::with_capacity(rows.len() * h);
    for &r in rows {
        out.extend_from_slice(&x[r * h..(r + 1) * h]);
    }
    out
}

/// Backward of [`token_logprobs`] for upstream gradients `dlp`: accumulates
/// the output projection's gradient (into `embed_tokens` when tied) and
/// returns `dhidden [tokens, hidden]`. Logits are recomputed chunk by chunk.
pub fn token_logprobs_backward(
    model: &Qwen3_5,
    grads: &mut ModelGrads,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    dlp: &[f32],
) -> Result<Vec<f32>> {
    token_logprobs_entropy_backward(model, grads, hidden, rows, targets, dlp, None, 1.0)
}

/// Backward of [`token_logprobs_entropy`]: `dlp` per row and, when given,
/// `dent` (gradient of each row's entropy), at the same `temperature`.
#[allow(clippy::too_many_arguments)]
pub fn token_logprobs_entropy_backward(
    model: &Qwen3_5,
    grads: &mut ModelGrads,
    hidden: &[f32],
    rows: &[usize],
    targets: &[u32],
    dlp: &[f32],
    dent: Option<&[f32]>,
    temperature: f32,
) -> Result<Vec<f32>> {
    let inv_t = inverse_temperature(temperature)?;
    let (h, vsz) = (model.config.hidden_size, model.config.vocab_size);
    let n = hidden.len() / h.max(1);
    check_rows(n, rows, targets)?;
    if dlp.len() != rows.len() || dent.is_some_and(|d| d.len() != rows.len()) {
        return Err(Error::Input(format!(
            "{} log-prob gradients for {} rows",
            dlp.len(),
            rows.len()
        )));
    }
    let w = model.lm_head_weight().as_f32()?;
    let dw = match grads.lm_head.as_mut() {
        Some(g) => g,
        None => &mut grads.embed_tokens,
    };
    let per = logit_rows_per_chunk(vsz);
    let mut dhidden = vec![0.0f32; n * h];
    let mut start = 0;
    for (rc, tc) in rows.chunks(per).zip(targets.chunks(per)) {
        let m = rc.len();
        let hsel = gather_rows(hidden, rc, h);
        let mut logits = vec![0.0f32; m * vsz];
        matmul_forward(&mut logits, &hsel, w, None, m, h, vsz)?;
        scale_logits(&mut logits, inv_t);
        let mut dlogits = vec![0.0f32; m * vsz];
        logprob_gather_backward(&mut dlogits, &dlp[start..start + m], &logits, tc, m, vsz)?;
        if let Some(de) = dent {
            entropy_backward(&mut dlogits, &de[start..start + m], &logits, m, vsz)?;
        }
        // d(x / T) / dx = 1 / T.
        scale_logits(&mut dlogits, inv_t);
        let mut dsel = vec![0.0f32; m * h];
        matmul_backward(&mut dsel, dw, None, &dlogits, &hsel, w, m, h, vsz)?;
        for (i, &r) in rc.iter().enumerate() {
            for (d, s) in dhidden[r * h..(r + 1) * h]
                .iter_mut()
                .zip(&dsel[i * h..(i + 1) * h])
            {
                *d += s;
            }
        }
        start += m;
    }
    Ok(dhidden)
}

/// Backward through the whole model from `dhidden` (the gradient of the
/// final hidden states); parameter gradients accumulate into `grads`.
pub fn backward(
    model: &Qwen3_5,
    acts: &Activations,
    dhidden: &[f32],
    grads: &mut ModelGrads,
) -> Result<()> {
    run_backward(model, acts, dhidden, grads, Link::None)
}

/// [`model_backward`] of one packed forward with the CPU ops, linked to
/// the caches its sequences continue or hand on.
fn run_backward(
    model: &Qwen3_5,
    acts: &Activations,
    dhidden: &[f32],
    grads: &mut ModelGrads,
    link: Link<'_>,
) -> Result<()> {
    let (t, h) = (acts.packed.len(), model.config.hidden_size);
    if dhidden.len() != t * h {
        return Err(Error::Shape(format!(
            "dhidden has {} values for {t} tokens x {h}",
            dhidden.len()
        )));
    }
    let fwd = Forward {
        layers: &acts.layers,
        x_last: &acts.x_last,
        final_rstd: &acts.final_rstd,
    };
    let dhidden = dhidden.to_vec();
    let mut ops = CpuBackward {
        model,
        packed: &acts.packed,
        link,
    };
    model_backward(&mut ops, model, &fwd, &dhidden, &mut grads.0)
}

/// How the sequences of one backward relate to caches.
enum Link<'a> {
    /// Each starts from a fresh state and hands nothing on.
    None,
    /// Sequence `s` continues `caches[group_of[s]]` (when it has a group);
    /// the gradient of what it read there accumulates into `dcaches`.
    Continues {
        group_of: &'a [Option<usize>],
        caches: &'a [SeqCache],
        dcaches: &'a mut [SeqCache],
    },
    /// Sequence `s` starts fresh and its caches after it were read by
    /// others, who left their gradient in `dcaches[s]`.
    Continued { dcaches: &'a [SeqCache] },
}

impl Link<'_> {
    /// The cache sequence `s` continues.
    fn past(&self, s: usize) -> Option<(usize, &SeqCache)> {
        match self {
            Link::Continues {
                group_of, caches, ..
            } => group_of
                .get(s)
                .copied()
                .flatten()
                .and_then(|g| caches.get(g).map(|c| (g, c))),
            _ => None,
        }
    }

    /// The gradient of sequence `s`'s caches after it.
    fn handed_on(&self, s: usize) -> Option<&SeqCache> {
        match self {
            Link::Continued { dcaches } => dcaches.get(s),
            _ => None,
        }
    }

    /// Where the gradient of the cache of group `g` accumulates.
    fn dpast(&mut self, g: usize) -> Option<&mut SeqCache> {
        match self {
            Link::Continues { dcaches, .. } => dcaches.get_mut(g),
            _ => None,
        }
    }
}

/// `dst += src`, of equal lengths.
fn add_into(dst: &mut [f32], src: &[f32]) -> Result<()> {
    if dst.len() != src.len() {
        return Err(Error::Shape(format!(
            "a cache gradient of {} values for {}",
            src.len(),
            dst.len()
        )));
    }
    dst.iter_mut().zip(src).for_each(|(d, s)| *d += s);
    Ok(())
}

/// Head width from which the CPU's gated-delta backward runs in the chunked
/// form (`benches/kernels.rs`, `gated_delta_backward`, 512 tokens, 4
/// heads: the chunked form takes 1.37x the recurrent one's time at width
/// 32, 0.72x at 64 and 0.42x at 128). Either is the exact gradient.
const CHUNKED_BACKWARD_MIN_WIDTH: usize = 64;

/// The CPU's side of the backward: the CPU kernels on host vectors, each
/// sequence of the packed batch on its own where the op runs per sequence.
struct CpuBackward<'a> {
    model: &'a Qwen3_5,
    packed: &'a Packed,
    link: Link<'a>,
}

impl BackwardOps for CpuBackward<'_> {
    type W = Tensor;
    type Buf = Vec<f32>;
    type C = Vec<Vec<f32>>;

    fn tokens(&self) -> usize {
        self.packed.len()
    }

    fn zeros(&mut self, n: usize) -> Result<Vec<f32>> {
        Ok(vec![0.0; n])
    }

    fn linear(
        &mut self,
        l: &Linear,
        g: &mut LinearGrad,
        dinp: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        n: usize,
    ) -> Result<()> {
        matmul_backward(
            dinp,
            &mut g.weight,
            g.bias.as_deref_mut(),
            dout,
            inp,
            l.weight.as_f32()?,
            n,
            l.in_features,
            l.out_features,
        )?;
        Ok(())
    }

    fn rmsnorm(
        &mut self,
        dinp: &mut Vec<f32>,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        n: usize,
        c: usize,
    ) -> Result<()> {
        rmsnorm_backward(dinp, dw, dout, inp, w.as_f32()?, rstd, n, c)?;
        Ok(())
    }

    fn silu_mul(
        &mut self,
        dact: &Vec<f32>,
        gate: &Vec<f32>,
        up: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dgate, mut dup) = (vec![0.0f32; dact.len()], vec![0.0f32; dact.len()]);
        silu_mul_backward(&mut dgate, &mut dup, dact, gate, up)?;
        Ok((dgate, dup))
    }

    fn gated_rmsnorm(
        &mut self,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        x: &Vec<f32>,
        z: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        d: usize,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dx, mut dz) = (vec![0.0f32; x.len()], vec![0.0f32; x.len()]);
        let rows = x.len() / d.max(1);
        gated_rmsnorm_backward(&mut dx, &mut dz, dw, dout, x, z, w.as_f32()?, rstd, rows, d)?;
        Ok((dx, dz))
    }

    fn gated_delta(
        &mut self,
        li: usize,
        dcore: &Vec<f32>,
        s: &LinearActs,
    ) -> Result<[Vec<f32>; 5]> {
        let (nk, nv, dk, dv) = self.model.config.delta_heads();
        let (qd, vd, t) = (nk * dk, nv * dv, self.packed.len());
        let mut dq = vec![0.0f32; t * qd];
        let mut dk_ = vec![0.0f32; t * qd];
        let mut dv_ = vec![0.0f32; t * vd];
        let mut dg = vec![0.0f32; t * nv];
        let mut dbeta = vec![0.0f32; t * nv];
        let mut dstate0 = vec![0.0f32; nv * dk * dv];
        for (i, (&(st, n), cps)) in self.packed.spans.iter().zip(&s.checkpoints).enumerate() {
            let past = self.link.past(i).map(|(g, _)| g);
            let last = self
                .link
                .handed_on(i)
                .map(|d| d.recurrent_state[li].as_slice());
            let dims = GatedDeltaDims {
                t: n,
                nk,
                nv,
                dk,
                dv,
            };
            let (kq, kv, kh) = (
                st * qd..(st + n) * qd,
                st * vd..(st + n) * vd,
                st * nv..(st + n) * nv,
            );
            let backward = if dk.min(dv) >= CHUNKED_BACKWARD_MIN_WIDTH {
                gated_delta_chunked_backward_from_checkpoints
            } else {
                gated_delta_backward_from_checkpoints
            };
            backward(
                &mut dq[kq.clone()],
                &mut dk_[kq.clone()],
                &mut dv_[kv.clone()],
                &mut dg[kh.clone()],
                &mut dbeta[kh.clone()],
                past.is_some().then_some(dstate0.as_mut_slice()),
                last,
                &dcore[kv.clone()],
                cps,
                &s.q[kq.clone()],
                &s.k[kq],
                &s.v[kv],
                &s.g[kh.clone()],
                &s.beta[kh],
                dims,
            )?;
            if let Some(d) = past.and_then(|g| self.link.dpast(g)) {
                add_into(&mut d.recurrent_state[li], &dstate0)?;
            }
        }
        Ok([dq, dk_, dv_, dg, dbeta])
    }

    fn scale(&mut self, x: &mut Vec<f32>, s: f32) -> Result<()> {
        for v in x.iter_mut() {
            *v *= s;
        }
        Ok(())
    }

    fn l2norm(
        &mut self,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
        rnorm: &Vec<f32>,
        rows: usize,
        d: usize,
    ) -> Result<Vec<f32>> {
        let mut dinp = vec![0.0f32; inp.len()];
        l2norm_backward(&mut dinp, dout, inp, rnorm, rows, d)?;
        Ok(dinp)
    }

    fn join_columns(&mut self, parts: &[&Vec<f32>], widths: &[usize]) -> Result<Vec<f32>> {
        let lens: Vec<usize> = parts.iter().map(|p| p.len()).collect();
        let rows = crate::backward::joined_rows(&lens, widths)?;
        let mut out = Vec::with_capacity(rows * widths.iter().sum::<usize>());
        for r in 0..rows {
            for (p, &w) in parts.iter().zip(widths) {
                out.extend_from_slice(&p[r * w..(r + 1) * w]);
            }
        }
        Ok(out)
    }

    fn silu(&mut self, dout: &Vec<f32>, x: &Vec<f32>) -> Result<Vec<f32>> {
        let mut dx = vec![0.0f32; x.len()];
        silu_backward(&mut dx, dout, x)?;
        Ok(dx)
    }

    fn conv(
        &mut self,
        li: usize,
        la: &LinearAttention,
        dw: &mut Vec<f32>,
        dout: &Vec<f32>,
        inp: &Vec<f32>,
    ) -> Result<Vec<f32>> {
        let c = &self.model.config;
        let (conv_dim, kc) = (c.linear_conv_dim(), c.conv_kernel);
        let hist = kc.saturating_sub(1);
        let mut dinp = vec![0.0f32; inp.len()];
        let zero_state = vec![0.0f32; hist * conv_dim];
        let mut dstate0 = vec![0.0f32; hist * conv_dim];
        for (i, &(st, n)) in self.packed.spans.iter().enumerate() {
            let r = st * conv_dim..(st + n) * conv_dim;
            let past = self.link.past(i);
            let state0 = past.map_or(&zero_state, |(_, p)| &p.conv_state[li]);
            conv1d_backward(
                &mut dinp[r.clone()],
                dw,
                past.is_some().then_some(dstate0.as_mut_slice()),
                &dout[r.clone()],
                state0,
                &inp[r],
                la.conv1d.as_f32()?,
                n,
                conv_dim,
                kc,
            )?;
            if let Some(d) = past.map(|(g, _)| g).and_then(|g| self.link.dpast(g)) {
                add_into(&mut d.conv_state[li], &dstate0)?;
            }
            // The conv state after the sequence is its last `hist` inputs
            // (those before it are the fresh start's zeros).
            if let Some(d) = self.link.handed_on(i) {
                let d = &d.conv_state[li];
                for j in hist.saturating_sub(n)..hist {
                    let row = st + n + j - hist;
                    add_into(
                        &mut dinp[row * conv_dim..(row + 1) * conv_dim],
                        &d[j * conv_dim..(j + 1) * conv_dim],
                    )?;
                }
            }
        }
        Ok(dinp)
    }

    fn gating(
        &mut self,
        la: &LinearAttention,
        g: &mut LinearAttnGrad,
        dg: &Vec<f32>,
        dbeta: &Vec<f32>,
        s: &LinearActs,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut da, mut db) = (vec![0.0f32; dg.len()], vec![0.0f32; dg.len()]);
        gated_delta_gating_backward(
            &mut da,
            &mut db,
            &mut g.a_log,
            &mut g.dt_bias,
            dg,
            dbeta,
            &s.g,
            &s.beta,
            &s.a,
            la.a_log.as_f32()?,
            la.dt_bias.as_f32()?,
        )?;
        Ok((da, db))
    }

    fn sigmoid_gate(
        &mut self,
        dout: &Vec<f32>,
        attn: &Vec<f32>,
        gate: &Vec<f32>,
    ) -> Result<(Vec<f32>, Vec<f32>)> {
        let (mut dattn, mut dgate) = (vec![0.0f32; dout.len()], vec![0.0f32; dout.len()]);
        sigmoid_gate_backward(&mut dattn, &mut dgate, dout, attn, gate)?;
        Ok((dattn, dgate))
    }

    fn attention(
        &mut self,
        li: usize,
        dattn: &Vec<f32>,
        s: &FullActs,
    ) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let c = &self.model.config;
        let t = self.packed.len();
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let (qrow, kvrow) = (nh * hd, nkv * hd);
        let mut dq = vec![0.0f32; t * qrow];
        let mut dk = vec![0.0f32; t * kvrow];
        let mut dv = vec![0.0f32; t * kvrow];
        let scale = 1.0 / (hd as f32).sqrt();
        for (i, &(st, n)) in self.packed.spans.iter().enumerate() {
            let (rq, rk) = (st * qrow..(st + n) * qrow, st * kvrow..(st + n) * kvrow);
            let dims = |past: usize| AttnDims {
                nq: n,
                nk: past + n,
                n_heads: nh,
                n_kv_heads: nkv,
                head_dim: hd,
            };
            if let Some((g, cache)) = self.link.past(i) {
                // The queries see the cached keys before their own.
                let (pk, pv) = (&cache.k[li], &cache.v[li]);
                let past = pk.len() / kvrow.max(1);
                let kf = [pk.as_slice(), &s.k[rk.clone()]].concat();
                let vf = [pv.as_slice(), &s.v[rk.clone()]].concat();
                let (mut dkf, mut dvf) = (vec![0.0f32; kf.len()], vec![0.0f32; vf.len()]);
                attention_backward(
                    &mut dq[rq.clone()],
                    &mut dkf,
                    &mut dvf,
                    &dattn[rq.clone()],
                    &s.q[rq],
                    &kf,
                    &vf,
                    dims(past),
                    scale,
                )?;
                let split = past * kvrow;
                dk[rk.clone()].copy_from_slice(&dkf[split..]);
                dv[rk].copy_from_slice(&dvf[split..]);
                if let Some(d) = self.link.dpast(g) {
                    add_into(&mut d.k[li], &dkf[..split])?;
                    add_into(&mut d.v[li], &dvf[..split])?;
                }
                continue;
            }
            attention_backward(
                &mut dq[rq.clone()],
                &mut dk[rk.clone()],
                &mut dv[rk.clone()],
                &dattn[rq.clone()],
                &s.q[rq],
                &s.k[rk.clone()],
                &s.v[rk.clone()],
                dims(0),
                scale,
            )?;
            // Keys and values others read from this sequence's cache.
            if let Some(d) = self.link.handed_on(i) {
                add_into(&mut dk[rk.clone()], &d.k[li])?;
                add_into(&mut dv[rk], &d.v[li])?;
            }
        }
        Ok((dq, dk, dv))
    }

    fn qk_norm_rope(
        &mut self,
        mut dout: Vec<f32>,
        raw: &Vec<f32>,
        w: &Tensor,
        rstd: &Vec<f32>,
        heads: usize,
        dw: &mut Vec<f32>,
    ) -> Result<Vec<f32>> {
        let c = &self.model.config;
        let hd = c.head_dim;
        rope_backward(
            &mut dout,
            &self.packed.positions,
            heads,
            hd,
            c.rotary_dim,
            c.rope_theta,
        )?;
        let mut draw = vec![0.0f32; raw.len()];
        let rows = self.packed.len() * heads;
        rmsnorm_backward(&mut draw, dw, &dout, raw, w.as_f32()?, rstd, rows, hd)?;
        Ok(draw)
    }

    fn embedding(&mut self, dtable: &mut Vec<f32>, dx: &Vec<f32>) -> Result<()> {
        let c = &self.model.config;
        embedding_backward(dtable, dx, &self.packed.ids, c.vocab_size, c.hidden_size)?;
        Ok(())
    }

    fn recompute(&mut self, model: &Qwen3_5, li: usize, x_in: &Vec<f32>) -> Result<LayerActs> {
        let starts = (0..self.packed.spans.len())
            .map(|i| {
                self.link
                    .past(i)
                    .map_or_else(|| model.new_cache(), |(_, c)| c.layer(li))
            })
            .collect();
        Ok(model.recompute_layer_from(li, x_in, &self.packed.sequences(), starts)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn group(members: Range<usize>, shared: usize) -> PrefixGroup {
        PrefixGroup { members, shared }
    }

    /// Two tasks' attempts share a system header across tasks and more
    /// within one: the groups are the tasks, each sharing its attempts'
    /// common prefix, and a lone sequence between them joins neither.
    #[test]
    fn groups_are_runs_of_attempts_at_one_prompt() {
        let header = [1u32, 2, 3];
        let a: Vec<u32> = [&header[..], &[10, 11, 12, 13, 14, 15]].concat();
        let b: Vec<u32> = [&header[..], &[20, 21, 22, 23, 24, 25]].concat();
        let with = |p: &[u32], tail: &[u32]| [p, tail].concat();
        let seqs = [
            with(&a, &[7, 8]),
            with(&a, &[7, 9]),
            with(&a, &[7, 8, 5]),
            vec![40, 41, 42],
            with(&b, &[1]),
            with(&b, &[2, 2]),
        ];
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        assert_eq!(plan_prefixes(&refs), vec![group(0..3, 10), group(4..6, 9)]);
        // Each rest keeps a token: a sequence that is another's prefix
        // shares all but its last.
        let same = [vec![1u32, 2, 3], vec![1, 2, 3, 4]];
        let refs: Vec<&[u32]> = same.iter().map(|s| s.as_slice()).collect();
        assert_eq!(plan_prefixes(&refs), vec![group(0..2, 2)]);
        let one = [vec![1u32], vec![1]];
        let refs: Vec<&[u32]> = one.iter().map(|s| s.as_slice()).collect();
        assert_eq!(plan_prefixes(&refs), vec![]);
    }

    /// A sequence that would cut a group's shared tokens by more than it
    /// saves starts its own group.
    #[test]
    fn a_short_match_does_not_shrink_a_group() {
        let long: Vec<u32> = (0..20).collect();
        let seqs = [
            [&long[..], &[100]].concat(),
            [&long[..], &[101]].concat(),
            [&long[..4], &[50, 51, 52]].concat(),
            [&long[..4], &[50, 51, 53]].concat(),
        ];
        let refs: Vec<&[u32]> = seqs.iter().map(|s| s.as_slice()).collect();
        assert_eq!(plan_prefixes(&refs), vec![group(0..2, 20), group(2..4, 6)]);
    }
}
