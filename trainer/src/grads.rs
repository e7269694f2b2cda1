//! Parameter gradients laid out like the model: one f32 buffer per parameter,
//! walked by [`ModelGrads::named`] in exactly the order (and with exactly the
//! Hugging Face names) of `Qwen3_5::named_params`, so the optimizer can zip
//! the two lists. Allocated once from the model and reused across steps
//! (`clear` between optimizer steps; the backward accumulates `+=`, which is
//! what gradient accumulation over micro-batches needs).

use crate::{Error, Result};
use arcticd_engine::model::qwen3_5::{Linear, Mixer};
use arcticd_engine::Qwen3_5;

/// Gradient of a linear layer's weight `[out, in]` and optional bias.
#[derive(Debug, Clone)]
pub struct LinearGrad {
    pub weight: Vec<f32>,
    pub bias: Option<Vec<f32>>,
}

impl LinearGrad {
    fn zeros(l: &Linear) -> Self {
        LinearGrad {
            weight: vec![0.0; l.in_features * l.out_features],
            bias: l.bias.as_ref().map(|_| vec![0.0; l.out_features]),
        }
    }
}

#[derive(Debug, Clone)]
pub struct LinearAttnGrad {
    pub in_proj_qkv: LinearGrad,
    pub in_proj_z: LinearGrad,
    pub in_proj_b: LinearGrad,
    pub in_proj_a: LinearGrad,
    pub conv1d: Vec<f32>,
    pub a_log: Vec<f32>,
    pub dt_bias: Vec<f32>,
    pub norm: Vec<f32>,
    pub out_proj: LinearGrad,
}

#[derive(Debug, Clone)]
pub struct FullAttnGrad {
    pub q_proj: LinearGrad,
    pub k_proj: LinearGrad,
    pub v_proj: LinearGrad,
    pub o_proj: LinearGrad,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
}

#[derive(Debug, Clone)]
pub enum MixerGrad {
    Linear(Box<LinearAttnGrad>),
    Full(Box<FullAttnGrad>),
}

#[derive(Debug, Clone)]
pub struct LayerGrad {
    pub input_layernorm: Vec<f32>,
    pub mixer: MixerGrad,
    pub post_attention_layernorm: Vec<f32>,
    pub gate_proj: LinearGrad,
    pub up_proj: LinearGrad,
    pub down_proj: LinearGrad,
}

/// Every parameter's gradient. With tied embeddings the output projection's
/// gradient lands in `embed_tokens` and `lm_head` is `None`.
#[derive(Debug, Clone)]
pub struct ModelGrads {
    pub embed_tokens: Vec<f32>,
    pub layers: Vec<LayerGrad>,
    pub norm: Vec<f32>,
    pub lm_head: Option<Vec<f32>>,
    prefix: String,
}

fn zeros(t: &arcticd_kernels::Tensor) -> Vec<f32> {
    vec![0.0; t.numel()]
}

macro_rules! walk_grads {
    ($g:expr, $out:ident, $($mut:tt)?) => {{
        let g = $g;
        let p = g.prefix.clone();
        $out.push((format!("{p}embed_tokens.weight"), & $($mut)? g.embed_tokens[..]));
        for (i, layer) in (& $($mut)? g.layers).into_iter().enumerate() {
            let l = format!("{p}layers.{i}.");
            $out.push((format!("{l}input_layernorm.weight"), & $($mut)? layer.input_layernorm[..]));
            $out.push((format!("{l}post_attention_layernorm.weight"), & $($mut)? layer.post_attention_layernorm[..]));
            match & $($mut)? layer.mixer {
                MixerGrad::Linear(la) => {
                    let a = format!("{l}linear_attn.");
                    $out.push((format!("{a}in_proj_qkv.weight"), & $($mut)? la.in_proj_qkv.weight[..]));
                    $out.push((format!("{a}in_proj_z.weight"), & $($mut)? la.in_proj_z.weight[..]));
                    $out.push((format!("{a}in_proj_b.weight"), & $($mut)? la.in_proj_b.weight[..]));
                    $out.push((format!("{a}in_proj_a.weight"), & $($mut)? la.in_proj_a.weight[..]));
                    $out.push((format!("{a}conv1d.weight"), & $($mut)? la.conv1d[..]));
                    $out.push((format!("{a}A_log"), & $($mut)? la.a_log[..]));
                    $out.push((format!("{a}dt_bias"), & $($mut)? la.dt_bias[..]));
                    $out.push((format!("{a}norm.weight"), & $($mut)? la.norm[..]));
                    $out.push((format!("{a}out_proj.weight"), & $($mut)? la.out_proj.weight[..]));
                }
                MixerGrad::Full(fa) => {
                    let a = format!("{l}self_attn.");
                    for (n, lin) in [
                        ("q_proj", & $($mut)? fa.q_proj),
                        ("k_proj", & $($mut)? fa.k_proj),
                        ("v_proj", & $($mut)? fa.v_proj),
                        ("o_proj", & $($mut)? fa.o_proj),
                    ] {
                        $out.push((format!("{a}{n}.weight"), & $($mut)? lin.weight[..]));
                        if let Some(b) = & $($mut)? lin.bias {
                            $out.push((format!("{a}{n}.bias"), & $($mut)? b[..]));
                        }
                    }
                    $out.push((format!("{a}q_norm.weight"), & $($mut)? fa.q_norm[..]));
                    $out.push((format!("{a}k_norm.weight"), & $($mut)? fa.k_norm[..]));
                }
            }
            let mm = format!("{l}mlp.");
            $out.push((format!("{mm}gate_proj.weight"), & $($mut)? layer.gate_proj.weight[..]));
            $out.push((format!("{mm}up_proj.weight"), & $($mut)? layer.up_proj.weight[..]));
            $out.push((format!("{mm}down_proj.weight"), & $($mut)? layer.down_proj.weight[..]));
        }
        $out.push((format!("{p}norm.weight"), & $($mut)? g.norm[..]));
        if let Some(h) = & $($mut)? g.lm_head {
            $out.push(("lm_head.weight".to_string(), & $($mut)? h[..]));
        }
    }};
}

impl ModelGrads {
    /// Zero gradients shaped like `model`'s parameters.
    pub fn zeros_like(model: &Qwen3_5) -> Self {
        let layers = model
            .layers
            .iter()
            .map(|layer| LayerGrad {
                input_layernorm: zeros(&layer.input_layernorm),
                mixer: match &layer.mixer {
                    Mixer::Linear(la) => MixerGrad::Linear(Box::new(LinearAttnGrad {
                        in_proj_qkv: LinearGrad::zeros(&la.in_proj_qkv),
                        in_proj_z: LinearGrad::zeros(&la.in_proj_z),
                        in_proj_b: LinearGrad::zeros(&la.in_proj_b),
                        in_proj_a: LinearGrad::zeros(&la.in_proj_a),
                        conv1d: zeros(&la.conv1d),
                        a_log: zeros(&la.a_log),
                        dt_bias: zeros(&la.dt_bias),
                        norm: zeros(&la.norm),
                        out_proj: LinearGrad::zeros(&la.out_proj),
                    })),
                    Mixer::Full(fa) => MixerGrad::Full(Box::new(FullAttnGrad {
                        q_proj: LinearGrad::zeros(&fa.q_proj),
                        k_proj: LinearGrad::zeros(&fa.k_proj),
                        v_proj: LinearGrad::zeros(&fa.v_proj),
                        o_proj: LinearGrad::zeros(&fa.o_proj),
                        q_norm: zeros(&fa.q_norm),
                        k_norm: zeros(&fa.k_norm),
                    })),
                },
                post_attention_layernorm: zeros(&layer.post_attention_layernorm),
                gate_proj: LinearGrad::zeros(&layer.gate_proj),
                up_proj: LinearGrad::zeros(&layer.up_proj),
                down_proj: LinearGrad::zeros(&layer.down_proj),
            })
            .collect();
        ModelGrads {
            embed_tokens: zeros(&model.embed_tokens),
            layers,
            norm: zeros(&model.norm),
            lm_head: model.lm_head.as_ref().map(zeros),
            prefix: model.config.weight_prefix.clone(),
        }
    }

    /// `(name, gradient)` in `Qwen3_5::named_params` order.
    pub fn named(&self) -> Vec<(String, &[f32])> {
        let mut out: Vec<(String, &[f32])> = Vec::new();
        walk_grads!(self, out,);
        out
    }

    /// Mutable form of [`named`](Self::named), same order.
    pub fn named_mut(&mut self) -> Vec<(String, &mut [f32])> {
        let mut out: Vec<(String, &mut [f32])> = Vec::new();
        walk_grads!(self, out, mut);
        out
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
