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
//! What runs here today: one sequence at a time, from position 0, with
//! its state on the device ([`CudaSeqCache`]: conv and recurrent state,
//! keys and values in blocks): scoring, and prefill then decode (greedy
//! generation). Not yet: the engine's batched, paged, scheduled decode on
//! the device (its scheduler still runs the CPU model), and the training
//! forward (`keep`), which is refused.
//!
//! Not for: the layer's structure (`qwen3_5`), the kernels themselves.

use super::logit_rows_per_chunk;
use super::ops::LayerOps;
use super::qwen3_5::{Linear, LinearAttention, Qwen3_5};
use crate::config::{LayerType, ModelConfig};
use crate::{Error, Result};
use arcticd_kernels::cuda::cudarc::driver::CudaSlice;
use arcticd_kernels::cuda::device::{CudaDevice, Mat, MatMut};
use arcticd_kernels::Tensor;
use half::bf16;
use std::sync::Arc;

/// How a model's matrices are held on the device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum WeightDType {
    /// bf16 matrices: half the memory and bandwidth; the products round
    /// their input to bf16 as well.
    #[default]
    Bf16,
    /// f32 matrices and fp32 products: the CPU's numbers to rounding.
    F32,
}

/// A parameter on the device.
pub enum DeviceParam {
    F32(CudaSlice<f32>),
    /// bf16 as raw bits.
    Bf16(CudaSlice<u16>),
}

impl DeviceParam {
    fn f32(&self, what: &str) -> Result<&CudaSlice<f32>> {
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
    pub fn upload(model: &Qwen3_5, dev: Arc<CudaDevice>, dtype: WeightDType) -> Result<Self> {
        let on_device = model.try_map(|name, t: &Tensor| -> Result<DeviceParam> {
            let values = t
                .as_f32()
                .map_err(|e| Error::Weights(format!("{name}: {e}")))?;
            if t.shape().len() == 2 && dtype == WeightDType::Bf16 {
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

    pub fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    /// Bytes of parameters on the device.
    pub fn param_bytes(&self) -> usize {
        self.model.named().iter().map(|(_, p)| p.bytes()).sum()
    }

    /// An empty state for one sequence of at most `capacity` positions:
    /// per linear layer its conv state and fp32 recurrent state, per
    /// full-attention layer room for its keys and values.
    pub fn new_cache(&self, capacity: usize) -> Result<CudaSeqCache> {
        let c = &self.model.config;
        let dev = &*self.dev;
        let (_, nv, dk, dv) = c.delta_heads();
        let kv_rows = capacity.div_ceil(KV_BLOCK) * KV_BLOCK * c.num_kv_heads * c.head_dim;
        let n = c.num_layers();
        let mut cache = CudaSeqCache {
            conv_state: (0..n).map(|_| None).collect(),
            recurrent_state: (0..n).map(|_| None).collect(),
            kv: (0..n).map(|_| None).collect(),
            len: 0,
            capacity,
        };
        for (li, lt) in c.layer_types.iter().enumerate() {
            if *lt == LayerType::LinearAttention {
                cache.conv_state[li] = Some(dev.zeros((c.conv_kernel - 1) * c.linear_conv_dim())?);
                cache.recurrent_state[li] = Some(dev.zeros(nv * dk * dv)?);
            } else {
                cache.kv[li] = Some((dev.zeros(kv_rows)?, dev.zeros(kv_rows)?));
            }
        }
        Ok(cache)
    }

    /// Runs `tokens` after what `cache` holds; returns the final hidden
    /// states (after the final norm) `[tokens, hidden]` on the device.
    pub fn forward(&self, cache: &mut CudaSeqCache, tokens: &[u32]) -> Result<CudaSlice<f32>> {
        let c = &self.model.config;
        if tokens.is_empty() {
            return Err(Error::Input("no tokens to run".into()));
        }
        if cache.len + tokens.len() > cache.capacity {
            return Err(Error::Input(format!(
                "{} tokens after {} do not fit a sequence cache of {}",
                tokens.len(),
                cache.len,
                cache.capacity
            )));
        }
        let t = tokens.len();
        let mut ops = CudaOps::new(&self.dev, c, tokens, cache)?;
        let mut x = ops.embed(&self.model.embed_tokens)?;
        for li in 0..self.model.layers.len() {
            self.model.layer_forward(&mut ops, li, &mut x, t, false)?;
        }
        let (hidden, _) = ops.rmsnorm(&x, &self.model.norm, c.hidden_size, c.rms_norm_eps)?;
        cache.len += t;
        Ok(hidden)
    }

    /// The output projection of hidden rows `r0..r0 + n`: logits `[n, vocab]`.
    fn logits(&self, hidden: &CudaSlice<f32>, r0: usize, n: usize) -> Result<CudaSlice<f32>> {
        let (h, vocab) = (self.model.config.hidden_size, self.model.config.vocab_size);
        let head = self
            .model
            .lm_head
            .as_ref()
            .unwrap_or(&self.model.embed_tokens);
        let dev = &*self.dev;
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
            let mut cache = self.new_cache(seq.len())?;
            let hidden = self.forward(&mut cache, seq)?;
            let mut row = vec![None];
            let scored = seq.len() - 1;
            let per_chunk = logit_rows_per_chunk(vocab);
            let mut r0 = 0;
            while r0 < scored {
                let n = per_chunk.min(scored - r0);
                let logits = self.logits(&hidden, r0, n)?;
                let targets = dev.upload(&seq[r0 + 1..r0 + 1 + n])?;
                let mut lp = dev.zeros::<f32>(n)?;
                dev.logprob_gather_forward(&mut lp, &logits, &targets, vocab, 1.0)?;
                row.extend(dev.download(&lp)?.into_iter().map(Some));
                r0 += n;
            }
            out.push(row);
        }
        Ok(out)
    }
}

/// Positions per block of a sequence's key/value pool on the device (one
/// sequence's pool is its own; the block table is `0, 1, 2, ...`).
const KV_BLOCK: usize = 16;

/// One sequence's state on the device ([`CudaModel::new_cache`]).
pub struct CudaSeqCache {
    conv_state: Vec<Option<CudaSlice<f32>>>,
    recurrent_state: Vec<Option<CudaSlice<f32>>>,
    /// Keys and values, `[capacity (rounded up to KV_BLOCK), kv_heads * head_dim]`.
    kv: Vec<Option<(CudaSlice<f32>, CudaSlice<f32>)>>,
    /// Positions already run.
    pub len: usize,
    pub capacity: usize,
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

/// New tokens of one sequence on the device, continuing its cache.
pub(crate) struct CudaOps<'a> {
    dev: &'a CudaDevice,
    config: &'a ModelConfig,
    ids: &'a [u32],
    /// Positions the cache already holds.
    past: usize,
    positions: CudaSlice<u32>,
    cache: &'a mut CudaSeqCache,
}

impl<'a> CudaOps<'a> {
    fn new(
        dev: &'a CudaDevice,
        config: &'a ModelConfig,
        ids: &'a [u32],
        cache: &'a mut CudaSeqCache,
    ) -> Result<Self> {
        let past = cache.len;
        let positions: Vec<u32> = (past..past + ids.len()).map(|p| p as u32).collect();
        Ok(CudaOps {
            dev,
            config,
            ids,
            past,
            positions: dev.upload(&positions)?,
            cache,
        })
    }

    fn t(&self) -> usize {
        self.ids.len()
    }
}

impl LayerOps for CudaOps<'_> {
    type W = DeviceParam;
    type Buf = CudaSlice<f32>;
    /// The CUDA forward keeps nothing for a backward (yet).
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
            DeviceParam::F32(w) => self.dev.embedding_forward(&mut x, self.ids, w, v, h),
            DeviceParam::Bf16(w) => self.dev.embedding_forward_bf16(&mut x, self.ids, w, v, h),
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
        let state = state_of(&mut self.cache.conv_state, li, "conv")?;
        self.dev
            .conv1d_forward(&mut out, state, qkv, w, t, conv_dim, k)?;
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
        if keep {
            return Err(Error::Input(
                "the training forward does not run on CUDA yet".into(),
            ));
        }
        let dims = self.config.delta_heads();
        let t = self.t();
        let mut out = self.dev.zeros::<f32>(t * dims.1 * dims.3)?;
        let slots = self.dev.upload(&[0u32])?;
        let state = state_of(&mut self.cache.recurrent_state, li, "recurrent")?;
        self.dev.gated_delta_prefill(
            &mut out,
            state,
            q,
            k,
            v,
            g,
            beta,
            &slots,
            &[0, t as u32],
            dims,
        )?;
        Ok((out, None))
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
        let (t, past) = (self.t(), self.past);
        let mut out = self.dev.zeros::<f32>(t * nh * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        let Some((k_pool, v_pool)) = self.cache.kv.get_mut(li).and_then(Option::as_mut) else {
            return Err(Error::Invariant(format!(
                "layer {li} has no key/value pool in the sequence's cache"
            )));
        };
        // The new keys and values join the pool at their positions.
        let slots: Vec<u32> = (past..past + t).map(|p| p as u32).collect();
        self.dev
            .paged_kv_write(k_pool, v_pool, k, v, &slots, nkv * hd)?;
        if past == 0 {
            self.dev.varlen_attention_prefill(
                &mut out,
                q,
                k,
                v,
                &[0, t as u32],
                (nh, nkv, hd),
                scale,
            )?;
            return Ok(out);
        }
        // After a past: each new query over the pool up to its own
        // position, as a decode step of its own.
        let blocks: Vec<u32> = (0..self.cache.capacity.div_ceil(KV_BLOCK) as u32).collect();
        let tables = vec![blocks; t];
        let lens: Vec<u32> = (past + 1..=past + t).map(|n| n as u32).collect();
        self.dev.paged_attention_decode(
            &mut out,
            q,
            k_pool,
            v_pool,
            &tables,
            &lens,
            (nh, nkv, hd),
            KV_BLOCK,
            scale,
        )?;
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
}
