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
//! What runs here today: a forward over fresh sequences (scoring), one
//! sequence per pass. Not yet: decode with a paged KV cache and state
//! slots on the device (the engine's scheduler still runs the CPU model),
//! and the training forward (`keep`), which is refused.
//!
//! Not for: the layer's structure (`qwen3_5`), the kernels themselves.

use super::logit_rows_per_chunk;
use super::ops::LayerOps;
use super::qwen3_5::{Linear, LinearAttention, Qwen3_5};
use crate::config::ModelConfig;
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

    /// `lp[s][t] = log p(tok_t | tok_<t)` for t >= 1 (index 0 is `None`),
    /// as [`Qwen3_5::score`] on the CPU: each sequence from position 0
    /// with fresh state, logits a bounded number of rows at a time.
    pub fn score(&self, sequences: &[Vec<u32>]) -> Result<Vec<Vec<Option<f32>>>> {
        let c = &self.model.config;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        super::qwen3_5::check_ids(sequences, vocab)?;
        let head = self
            .model
            .lm_head
            .as_ref()
            .unwrap_or(&self.model.embed_tokens);
        let dev = &*self.dev;
        let mut out = Vec::with_capacity(sequences.len());
        for seq in sequences {
            let t = seq.len();
            let mut ops = CudaOps::fresh(dev, c, seq)?;
            let mut x = ops.embed(&self.model.embed_tokens)?;
            for li in 0..self.model.layers.len() {
                self.model.layer_forward(&mut ops, li, &mut x, t, false)?;
            }
            let (hidden, _) = ops.rmsnorm(&x, &self.model.norm, h, c.rms_norm_eps)?;
            let mut row = vec![None];
            let scored = t - 1;
            let per_chunk = logit_rows_per_chunk(vocab);
            let mut r0 = 0;
            while r0 < scored {
                let n = per_chunk.min(scored - r0);
                let mut rows = dev.zeros::<f32>(n * h)?;
                dev.copy_block(&mut rows, &hidden, h, (r0, 0), (n, h))?;
                let mut logits = dev.zeros::<f32>(n * vocab)?;
                ops.product(MatMut::F32(&mut logits), &rows, head, n, h, vocab)?;
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

/// One fresh sequence on the device: its ids and positions, and the conv
/// and recurrent state of each linear layer as the layers make them.
pub(crate) struct CudaOps<'a> {
    dev: &'a CudaDevice,
    config: &'a ModelConfig,
    ids: &'a [u32],
    positions: CudaSlice<u32>,
    conv_state: Vec<Option<CudaSlice<f32>>>,
    recurrent_state: Vec<Option<CudaSlice<f32>>>,
}

impl<'a> CudaOps<'a> {
    fn fresh(dev: &'a CudaDevice, config: &'a ModelConfig, ids: &'a [u32]) -> Result<Self> {
        if ids.is_empty() {
            return Err(Error::Input("an empty sequence".into()));
        }
        let positions: Vec<u32> = (0..ids.len() as u32).collect();
        let n = config.num_layers();
        Ok(CudaOps {
            dev,
            config,
            ids,
            positions: dev.upload(&positions)?,
            conv_state: (0..n).map(|_| None).collect(),
            recurrent_state: (0..n).map(|_| None).collect(),
        })
    }

    fn t(&self) -> usize {
        self.ids.len()
    }

    /// `out[n, oc] = x[n, c] @ w[oc, c]^T`, the input rounded to the
    /// weight's type first.
    fn product(
        &self,
        out: MatMut<'_>,
        x: &CudaSlice<f32>,
        w: &DeviceParam,
        n: usize,
        c: usize,
        oc: usize,
    ) -> Result<()> {
        match w {
            DeviceParam::F32(_) => self
                .dev
                .matmul_forward(out, Mat::F32(x), w.mat(), n, c, oc)?,
            DeviceParam::Bf16(_) => {
                let mut xb = self.dev.zeros::<u16>(x.len())?;
                self.dev.f32_to_bf16(&mut xb, x)?;
                self.dev
                    .matmul_forward(out, Mat::Bf16(&xb), w.mat(), n, c, oc)?
            }
        }
        Ok(())
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
            self.product(MatMut::F32(&mut out), x, &l.weight, t, c, oc)?;
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
        let mut state = self.dev.zeros::<f32>((k - 1) * conv_dim)?;
        let mut out = self.dev.zeros::<f32>(self.t() * conv_dim)?;
        let w = la.conv1d.f32("conv1d weight")?;
        self.dev
            .conv1d_forward(&mut out, &mut state, qkv, w, self.t(), conv_dim, k)?;
        self.conv_state[li] = Some(state);
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
        let mut state = self.dev.zeros::<f32>(dims.1 * dims.2 * dims.3)?;
        let mut out = self.dev.zeros::<f32>(t * dims.1 * dims.3)?;
        let slots = self.dev.upload(&[0u32])?;
        self.dev.gated_delta_prefill(
            &mut out,
            &mut state,
            q,
            k,
            v,
            g,
            beta,
            &slots,
            &[0, t as u32],
            dims,
        )?;
        self.recurrent_state[li] = Some(state);
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
        _li: usize,
        q: &CudaSlice<f32>,
        k: &CudaSlice<f32>,
        v: &CudaSlice<f32>,
    ) -> Result<CudaSlice<f32>> {
        let c = self.config;
        let (nh, nkv, hd) = (c.num_heads, c.num_kv_heads, c.head_dim);
        let t = self.t();
        let mut out = self.dev.zeros::<f32>(t * nh * hd)?;
        let scale = 1.0 / (hd as f32).sqrt();
        self.dev.varlen_attention_prefill(
            &mut out,
            q,
            k,
            v,
            &[0, t as u32],
            (nh, nkv, hd),
            scale,
        )?;
        Ok(out)
    }
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

    /// The tiny test model's scores on CUDA against the CPU's: fp32
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
        let err = on_gpu.score(&[vec![vocab]]).unwrap_err().to_string();
        assert!(err.contains("vocabulary size"), "{err}");
        assert!(on_gpu.score(&[vec![]]).is_err());
        std::fs::remove_dir_all(&dir).ok();
    }
}
