//! Parameter gradients laid out like the model (the model's own parameter
//! tree, `Qwen3_5<Vec<f32>>`): one f32 buffer per parameter, walked by
//! [`ModelGrads::named`] in exactly the order (and with exactly the Hugging
//! Face names) of `Qwen3_5::named_params`, by the same walk, so the
//! optimizer can zip the two lists. Allocated once from the model and reused across steps
//! (`clear` between optimizer steps; the backward accumulates `+=`, which is
//! what gradient accumulation over micro-batches needs).

use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{FullAttention, Linear, LinearAttention};
use arcticd_engine::Qwen3_5;

/// Gradient of a linear layer's weight `[out, in]` and optional bias.
pub type LinearGrad = Linear<Vec<f32>>;
pub type LinearAttnGrad = LinearAttention<Vec<f32>>;
pub type FullAttnGrad = FullAttention<Vec<f32>>;

/// Every parameter's gradient: the model's parameter tree with an f32
/// buffer at every leaf. With tied embeddings the output projection's
/// gradient lands in `embed_tokens` and `lm_head` is `None`.
#[derive(Debug, Clone)]
pub struct ModelGrads(pub Qwen3_5<Vec<f32>>);

impl std::ops::Deref for ModelGrads {
    type Target = Qwen3_5<Vec<f32>>;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl std::ops::DerefMut for ModelGrads {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.0
    }
}

impl ModelGrads {
    /// Zero gradients shaped like `model`'s parameters.
    pub fn zeros_like(model: &Qwen3_5) -> Self {
        ModelGrads(model.map(|t| vec![0.0; t.numel()]))
    }

    /// `(name, gradient)` in `Qwen3_5::named_params` order.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        self.0
            .named()
            .into_iter()
            .map(|(n, g)| (n, &g[..]))
            .collect()
    }

    /// Mutable form of [`named`](Self::named), same order.
    pub fn named_mut(&mut self) -> Vec<(String, &mut [f32])> {
        self.0
            .named_mut()
            .into_iter()
            .map(|(n, g)| (n, &mut g[..]))
            .collect()
    }

    /// Zero every gradient (between optimizer steps).
    pub fn clear(&mut self) {
        for (_, g) in self.named_mut() {
            g.fill(0.0);
        }
    }

    /// Multiply every gradient by `s`.
    pub fn scale(&mut self, s: f32) {
        for (_, g) in self.named_mut() {
            g.iter_mut().for_each(|x| *x *= s);
        }
    }

    /// Global L2 norm over all gradients (f64 accumulation) and whether every
    /// value is finite.
    pub fn global_norm(&self) -> (f64, bool) {
        let mut ss = 0.0f64;
        let mut finite = true;
        for (_, g) in self.named() {
            for &x in g {
                finite &= x.is_finite();
                ss += x as f64 * x as f64;
            }
        }
        (ss.sqrt(), finite)
    }

    /// Check that names and sizes line up with `model`'s parameters.
    pub fn check_matches(&self, model: &Qwen3_5) -> Result<()> {
        let ours = self.named();
        let theirs = model.named_params();
        if ours.len() != theirs.len() {
            return Err(Error::Shape(format!(
                "{} gradients for {} parameters",
                ours.len(),
                theirs.len()
            )));
        }
        for ((gn, g), (pn, p)) in ours.iter().zip(&theirs) {
            if gn != pn || g.len() != p.numel() {
                return Err(Error::Shape(format!(
                    "gradient {gn} ({}) vs parameter {pn} ({})",
                    g.len(),
                    p.numel()
                )));
            }
        }
        Ok(())
    }
}
