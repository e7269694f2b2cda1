//! Model configuration: the Hugging Face `config.json` deserialized as-is
//! (`HfTextConfig`), then checked and converted to the internal `ModelConfig`.
//!
//! Accepts `model_type` `qwen3_5_text`, and the `qwen3_5` wrapper whose text
//! model sits under `text_config` (its weights then live under
//! `model.language_model.`). Anything the engine does not implement — another
//! activation, a scaled RoPE, biases where the model has none, MoE fields — is
//! refused with an error that names the field, rather than silently computing
//! a different model.

use crate::{Error, Result};
use serde::Deserialize;
use serde_json::Value;
use std::path::Path;

/// The text config exactly as transformers writes it. Every field has the
/// transformers default where one exists.
#[derive(Debug, Clone, Deserialize)]
pub struct HfTextConfig {
    pub model_type: Option<String>,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Default: num_attention_heads.
    pub num_key_value_heads: Option<usize>,
    /// Default: hidden_size / num_attention_heads.
    pub head_dim: Option<usize>,
    /// Default "silu"; nothing else is supported.
    pub hidden_act: Option<String>,
    /// Default 1e-6.
    pub rms_norm_eps: Option<f64>,
    /// Default false.
    pub tie_word_embeddings: Option<bool>,
    /// Default false.
    pub attention_bias: Option<bool>,
    /// `rope_type`, `rope_theta`, `partial_rotary_factor`, `mrope_*`.
    pub rope_parameters: Option<Value>,
    /// Older layout: theta at the top level.
    pub rope_theta: Option<f64>,
    /// Older layout: factor at the top level.
    pub partial_rotary_factor: Option<f64>,
    /// Older layout: scaling block at the top level.
    pub rope_scaling: Option<Value>,
    /// Default 4.
    pub linear_conv_kernel_dim: Option<usize>,
    /// Default 128.
    pub linear_key_head_dim: Option<usize>,
    /// Default 128.
    pub linear_value_head_dim: Option<usize>,
    /// Default 16.
    pub linear_num_key_heads: Option<usize>,
    /// Default 32.
    pub linear_num_value_heads: Option<usize>,
    /// `linear_attention` / `full_attention` per layer.
    pub layer_types: Option<Vec<String>>,
    /// Used when `layer_types` is absent. Default 4.
    pub full_attention_interval: Option<usize>,
    pub eos_token_id: Option<Value>,
    /// The longest sequence the model was trained for; it bounds prompt
    /// plus completion. Absent: no bound from the model.
    pub max_position_embeddings: Option<usize>,
    /// MoE checkpoints carry this; refused.
    pub num_experts: Option<usize>,
    /// Storage dtype transformers records (`torch_dtype` in older files).
    pub dtype: Option<String>,
    pub torch_dtype: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LayerType {
    LinearAttention,
    FullAttention,
}

/// The checked configuration the model is built from.
#[derive(Debug, Clone)]
pub struct ModelConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub tie_word_embeddings: bool,
    pub attention_bias: bool,
    pub rope_theta: f32,
    /// Number of rotated channels per head: head_dim * partial_rotary_factor.
    pub rotary_dim: usize,
    pub conv_kernel: usize,
    pub linear_key_head_dim: usize,
    pub linear_value_head_dim: usize,
    pub linear_num_key_heads: usize,
    pub linear_num_value_heads: usize,
    pub layer_types: Vec<LayerType>,
    pub eos_token_ids: Vec<u32>,
    /// `max_position_embeddings`: the longest prompt plus completion the
    /// model was trained for, when the config gives one.
    pub max_positions: Option<usize>,
    /// Where the text model's tensors live: `model.` or `model.language_model.`.
    pub weight_prefix: String,
    /// The raw text config, kept so checkpoints can be written back as read.
    pub raw_text_config: Value,
}

fn cfg_err(msg: impl Into<String>) -> Error {
    Error::Config(msg.into())
}

impl ModelConfig {
    /// Read and check `DIR/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        let value: Value = serde_json::from_str(&text)
            .map_err(|e| cfg_err(format!("{} is not valid JSON: {e}", path.display())))?;
        Self::from_json(&value)
    }

    /// Check and convert a parsed `config.json`.
    pub fn from_json(value: &Value) -> Result<Self> {
        let model_type = value
            .get("model_type")
            .and_then(Value::as_str)
            .unwrap_or("");
        let (text, prefix) = match model_type {
            "qwen3_5_text" => (value.clone(), "model."),
            "qwen3_5" => {
                let text = value
                    .get("text_config")
                    .cloned()
                    .ok_or_else(|| cfg_err("model_type qwen3_5 needs a text_config"))?;
                (text, "model.language_model.")
            }
            "" => return Err(cfg_err("config.json has no model_type")),
            other => {
                return Err(cfg_err(format!(
                    "unsupported model_type {other:?} (supported: qwen3_5_text, qwen3_5)"
                )))
            }
        };
        let mut hf: HfTextConfig = serde_json::from_value(text.clone()).map_err(|e| {
            cfg_err(format!(
                "text config: {}",
                crate::error::plain_types(&e.to_string())
            ))
        })?;
        if model_type == "qwen3_5" {
            // The wrapper class reads tie_word_embeddings at the top level,
            // the text class inside text_config: tied if either says so.
            let top = value.get("tie_word_embeddings").and_then(Value::as_bool);
            hf.tie_word_embeddings =
                Some(hf.tie_word_embeddings.unwrap_or(false) || top.unwrap_or(false));
            if hf.eos_token_id.is_none() {
                hf.eos_token_id = value.get("eos_token_id").cloned();
            }
        }
        Self::from_hf(hf, prefix, text)
    }

    fn from_hf(hf: HfTextConfig, prefix: &str, raw: Value) -> Result<Self> {
        if let Some(mt) = &hf.model_type {
            if mt != "qwen3_5_text" {
                return Err(cfg_err(format!(
                    "unsupported text model_type {mt:?} (expected qwen3_5_text)"
                )));
            }
        }
        if let Some(act) = &hf.hidden_act {
            if act != "silu" {
                return Err(cfg_err(format!(
                    "unsupported hidden_act {act:?} (only silu)"
                )));
            }
        }
        if hf.num_experts.unwrap_or(0) > 0 {
            return Err(cfg_err(
                "num_experts: mixture-of-experts models are not supported",
            ));
        }
        if let Some(rs) = &hf.rope_scaling {
            if !rs.is_null() {
                return Err(cfg_err("rope_scaling is not supported"));
            }
        }
        // At most 2^20 each (real models stay far below), so that the
        // products of three sizes that shape the weights cannot overflow.
        const MAX_SIZE: usize = 1 << 20;
        let nonzero = |name: &str, v: usize| -> Result<usize> {
            if v == 0 || v > MAX_SIZE {
                Err(cfg_err(format!(
                    "{name} must be positive and at most {MAX_SIZE}, got {v}"
                )))
            } else {
                Ok(v)
            }
        };
        let hidden = nonzero("hidden_size", hf.hidden_size)?;
        let n_layers = nonzero("num_hidden_layers", hf.num_hidden_layers)?;
        let n_heads = nonzero("num_attention_heads", hf.num_attention_heads)?;
        let n_kv = nonzero(
            "num_key_value_heads",
            hf.num_key_value_heads.unwrap_or(n_heads),
        )?;
        if n_heads % n_kv != 0 {
            return Err(cfg_err(format!(
                "num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}"
            )));
        }
        let head_dim = nonzero("head_dim", hf.head_dim.unwrap_or(hidden / n_heads))?;
        nonzero("vocab_size", hf.vocab_size)?;
        nonzero("intermediate_size", hf.intermediate_size)?;

        // RoPE: rope_parameters, or the older top-level fields.
        let rp = hf.rope_parameters.clone().unwrap_or(Value::Null);
        let rope_type = rp
            .get("rope_type")
            .or_else(|| rp.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        if rope_type != "default" {
            return Err(cfg_err(format!(
                "rope_parameters.rope_type {rope_type:?} is not supported (only default)"
            )));
        }
        let theta = rp
            .get("rope_theta")
            .and_then(Value::as_f64)
            .or(hf.rope_theta)
            .unwrap_or(10_000.0);
        let factor = rp
            .get("partial_rotary_factor")
            .and_then(Value::as_f64)
            .or(hf.partial_rotary_factor)
            .unwrap_or(0.25);
        if !(theta.is_finite() && theta > 0.0) {
            return Err(cfg_err(format!(
                "rope_theta {theta} must be a finite number > 0"
            )));
        }
        let eps = hf.rms_norm_eps.unwrap_or(1e-6);
        if !(eps.is_finite() && eps > 0.0) {
            return Err(cfg_err(format!(
                "rms_norm_eps {eps} must be a finite number > 0"
            )));
        }
        if !(factor > 0.0 && factor <= 1.0) {
            return Err(cfg_err(format!(
                "partial_rotary_factor {factor} must be in (0, 1]"
            )));
        }
        let rotary_dim = (head_dim as f64 * factor) as usize;
        if !rotary_dim.is_multiple_of(2) {
            return Err(cfg_err(format!(
                "rotary dim {rotary_dim} (head_dim {head_dim} x {factor}) must be even"
            )));
        }

        let layer_types = match &hf.layer_types {
            Some(list) => {
                if list.len() != n_layers {
                    return Err(cfg_err(format!(
                        "layer_types has {} entries for {n_layers} layers",
                        list.len()
                    )));
                }
                list.iter()
                    .enumerate()
                    .map(|(i, s)| match s.as_str() {
                        "linear_attention" => Ok(LayerType::LinearAttention),
                        "full_attention" => Ok(LayerType::FullAttention),
                        other => Err(cfg_err(format!(
                            "layer_types[{i}] = {other:?} is not supported"
                        ))),
                    })
                    .collect::<Result<Vec<_>>>()?
            }
            None => {
                let interval = nonzero(
                    "full_attention_interval",
                    hf.full_attention_interval.unwrap_or(4),
                )?;
                (0..n_layers)
                    .map(|i| {
                        if (i + 1) % interval == 0 {
                            LayerType::FullAttention
                        } else {
                            LayerType::LinearAttention
                        }
                    })
                    .collect()
            }
        };
        let nk = nonzero(
            "linear_num_key_heads",
            hf.linear_num_key_heads.unwrap_or(16),
        )?;
        let nv = nonzero(
            "linear_num_value_heads",
            hf.linear_num_value_heads.unwrap_or(32),
        )?;
        if nv % nk != 0 {
            return Err(cfg_err(format!(
                "linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}"
            )));
        }
        let eos_token_ids = match &hf.eos_token_id {
            Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
            Some(Value::Array(a)) => a
                .iter()
                .filter_map(|x| x.as_u64())
                .map(|x| x as u32)
                .collect(),
            _ => vec![],
        };
        Ok(ModelConfig {
            vocab_size: hf.vocab_size,
            hidden_size: hidden,
            intermediate_size: hf.intermediate_size,
            num_heads: n_heads,
            num_kv_heads: n_kv,
            head_dim,
            rms_norm_eps: eps as f32,
            tie_word_embeddings: hf.tie_word_embeddings.unwrap_or(false),
            attention_bias: hf.attention_bias.unwrap_or(false),
            rope_theta: theta as f32,
            rotary_dim,
            conv_kernel: nonzero(
                "linear_conv_kernel_dim",
                hf.linear_conv_kernel_dim.unwrap_or(4),
            )?,
            linear_key_head_dim: nonzero(
                "linear_key_head_dim",
                hf.linear_key_head_dim.unwrap_or(128),
            )?,
            linear_value_head_dim: nonzero(
                "linear_value_head_dim",
                hf.linear_value_head_dim.unwrap_or(128),
            )?,
            linear_num_key_heads: nk,
            linear_num_value_heads: nv,
            layer_types,
            eos_token_ids,
            max_positions: match hf.max_position_embeddings {
                Some(0) => return Err(cfg_err("max_position_embeddings must be positive")),
                n => n,
            },
            weight_prefix: prefix.to_string(),
            raw_text_config: raw,
        })
    }

    pub fn num_layers(&self) -> usize {
        self.layer_types.len()
    }

    /// The Gated DeltaNet head shape `(nk, nv, dk, dv)`: key heads, value
    /// heads, key and value head dims.
    pub fn delta_heads(&self) -> (usize, usize, usize, usize) {
        (
            self.linear_num_key_heads,
            self.linear_num_value_heads,
            self.linear_key_head_dim,
            self.linear_value_head_dim,
        )
    }

    /// Channels of the linear layers' q|k|v projection (and its conv).
    pub fn linear_conv_dim(&self) -> usize {
        2 * self.linear_num_key_heads * self.linear_key_head_dim
            + self.linear_num_value_heads * self.linear_value_head_dim
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn base() -> Value {
        json!({
            "model_type": "qwen3_5_text", "vocab_size": 100, "hidden_size": 32,
            "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8
        })
    }

    #[test]
    fn interval_gives_layer_types() {
        let c = ModelConfig::from_json(&base()).unwrap();
        assert_eq!(c.layer_types[3], LayerType::FullAttention);
        assert_eq!(c.layer_types[0], LayerType::LinearAttention);
        assert_eq!(c.rotary_dim, 4);
        assert_eq!(c.weight_prefix, "model.");
    }

    #[test]
    fn wrapper_and_errors() {
        let w =
            json!({"model_type": "qwen3_5", "text_config": base(), "tie_word_embeddings": true});
        let c = ModelConfig::from_json(&w).unwrap();
        assert_eq!(c.weight_prefix, "model.language_model.");
        assert!(c.tie_word_embeddings);
        let mut bad = base();
        bad["model_type"] = json!("llama");
        let e = ModelConfig::from_json(&bad).unwrap_err().to_string();
        assert!(e.contains("llama"), "{e}");
        let mut bad = base();
        bad["hidden_act"] = json!("gelu");
        assert!(ModelConfig::from_json(&bad)
            .unwrap_err()
            .to_string()
            .contains("gelu"));
        let mut bad = base();
        bad["layer_types"] = json!(["linear_attention"]);
        assert!(ModelConfig::from_json(&bad).is_err());
        let mut bad = base();
        bad["num_key_value_heads"] = json!(3);
        assert!(ModelConfig::from_json(&bad).is_err());
        // A wrong type is said plainly, not as a Rust type.
        let mut bad = base();
        bad["hidden_size"] = json!(-64);
        let e = ModelConfig::from_json(&bad).unwrap_err().to_string();
        assert!(
            e.contains("expected a whole number from 0 to") && !e.contains("usize"),
            "{e}"
        );
    }

    /// Sizes whose products would overflow (and then match a checkpoint's
    /// real shapes by wrapping, to panic in a kernel), and the values that
    /// make every score NaN, are refused when the config is read.
    #[test]
    fn sizes_past_two_to_the_twenty_and_nan_making_values_are_refused() {
        for (key, value, says) in [
            (
                "num_attention_heads",
                json!(4u64 + (1u64 << 62)),
                "num_attention_heads",
            ),
            ("head_dim", json!(1u64 << 62), "head_dim"),
            ("intermediate_size", json!(1u64 << 21), "intermediate_size"),
            ("rms_norm_eps", json!(-1.0), "rms_norm_eps"),
            ("rms_norm_eps", json!(0.0), "rms_norm_eps"),
        ] {
            let mut bad = base();
            bad[key] = value;
            let e = ModelConfig::from_json(&bad).unwrap_err().to_string();
            assert!(e.contains(says), "{key}: {e}");
        }
        for theta in [0.0, -1.0] {
            let mut bad = base();
            bad["rope_parameters"]["rope_theta"] = json!(theta);
            let e = ModelConfig::from_json(&bad).unwrap_err().to_string();
            assert!(e.contains("rope_theta"), "{theta}: {e}");
        }
    }
}
