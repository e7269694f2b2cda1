//! `arcticd init-model`: a randomly initialised Qwen3.5-architecture model in
//! Hugging Face layout (config.json, model.safetensors, tokenizer.json,
//! tokenizer_config.json with a chat template) that transformers can load.
//!
//! Presets: `tiny` (well under 1M parameters, for tests), `small` (a few
//! million) and `demo` (`small`'s vocabulary on a narrow, shallow body: the
//! RL demo's warm start). Initialisation follows transformers'
//! Qwen3.5 `_init_weights`: normal(0, 0.02) for linears and embeddings, zeros
//! for the (1 + w) RMSNorms, ones for the gated norm, `A_log = log(U(0, 16))`,
//! `dt_bias = 1`.

use crate::tokenizer::write_tokenizer_files;
use crate::weights::{save_safetensors_encoded, write_atomic, SaveDType};
use crate::{Error, Result};
use rand::{rngs::StdRng, Rng, SeedableRng};
use serde_json::{json, Value};
use std::path::Path;

/// Sizes of a preset.
#[derive(Debug, Clone, Copy)]
pub struct Preset {
    pub name: &'static str,
    pub vocab: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub layers: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub lin_k_heads: usize,
    pub lin_v_heads: usize,
    pub lin_head_dim: usize,
    pub tie: bool,
    /// The tokenizer is trained to `vocab` tokens and the model's
    /// vocabulary is what it reached (`None`), or the tokenizer is trained
    /// to this many and the model keeps `vocab` rows anyway, as real
    /// checkpoints pad theirs (`Some`: a real vocabulary size without
    /// training a tokenizer that large).
    pub tokenizer_vocab: Option<usize>,
    /// The checkpoint's precision on disk.
    pub dtype: SaveDType,
}

pub const TINY: Preset = Preset {
    name: "tiny",
    vocab: 1024,
    hidden: 64,
    intermediate: 128,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    head_dim: 16,
    lin_k_heads: 2,
    lin_v_heads: 4,
    lin_head_dim: 16,
    tie: true,
    tokenizer_vocab: None,
    dtype: SaveDType::F32,
};

pub const SMALL: Preset = Preset {
    name: "small",
    vocab: 4096,
    hidden: 256,
    intermediate: 512,
    layers: 8,
    heads: 4,
    kv_heads: 2,
    head_dim: 64,
    lin_k_heads: 2,
    lin_v_heads: 4,
    lin_head_dim: 64,
    tie: true,
    tokenizer_vocab: None,
    dtype: SaveDType::F32,
};

/// The RL demo's model: `small`'s vocabulary (short token sequences) with
/// a narrow, shallow body, so that its warm start and RL steps are several
/// times faster than `small`'s on a CPU (about 1.6M parameters).
pub const DEMO: Preset = Preset {
    name: "demo",
    vocab: 4096,
    hidden: 128,
    intermediate: 384,
    layers: 4,
    heads: 4,
    kv_heads: 2,
    head_dim: 32,
    lin_k_heads: 2,
    lin_v_heads: 4,
    lin_head_dim: 32,
    tie: true,
    tokenizer_vocab: None,
    dtype: SaveDType::F32,
};

/// The real Qwen3.5-0.8B text shape (DESIGN.md, "Facts checked") with
/// random weights in bf16, as the released checkpoint is stored: for
/// trying real sizes (memory, cache sizing, decode speed) without the
/// released weights. Its tokenizer is a small generated one; the model
/// keeps the real 248,320-row vocabulary.
pub const QWEN3_5_0_8B: Preset = Preset {
    name: "qwen3.5-0.8b",
    vocab: 248_320,
    hidden: 1024,
    intermediate: 3584,
    layers: 24,
    heads: 8,
    kv_heads: 2,
    head_dim: 256,
    lin_k_heads: 16,
    lin_v_heads: 16,
    lin_head_dim: 128,
    tie: true,
    tokenizer_vocab: Some(4096),
    dtype: SaveDType::BF16,
};

/// The Qwen3.5-4B text shape as public code transcribes it (DESIGN.md,
/// "Facts checked"): untied, 32 linear value heads over 16 key heads. For
/// planning memory (`arcticd plan`) and trying real sizes.
pub const QWEN3_5_4B: Preset = Preset {
    name: "qwen3.5-4b",
    vocab: 248_320,
    hidden: 2560,
    intermediate: 9216,
    layers: 32,
    heads: 16,
    kv_heads: 4,
    head_dim: 256,
    lin_k_heads: 16,
    lin_v_heads: 32,
    lin_head_dim: 128,
    tie: false,
    tokenizer_vocab: Some(4096),
    dtype: SaveDType::BF16,
};

pub fn preset(name: &str) -> Result<Preset> {
    match name {
        "tiny" => Ok(TINY),
        "small" => Ok(SMALL),
        "demo" => Ok(DEMO),
        "qwen3.5-0.8b" => Ok(QWEN3_5_0_8B),
        "qwen3.5-4b" => Ok(QWEN3_5_4B),
        other => Err(Error::Input(format!(
            "unknown preset {other:?} (choose tiny, small, demo, qwen3.5-0.8b or qwen3.5-4b)"
        ))),
    }
}

/// The `config.json` of `p` with a vocabulary of `vocab` and the given
/// end-of-sequence and padding ids.
fn preset_config_json(p: &Preset, vocab: usize, eos: u32, pad: u32) -> serde_json::Value {
    let layer_types: Vec<&str> = (0..p.layers)
        .map(|i| {
            if (i + 1) % 4 == 0 {
                "full_attention"
            } else {
                "linear_attention"
            }
        })
        .collect();
    json!({
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": vocab,
        "hidden_size": p.hidden,
        "intermediate_size": p.intermediate,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": p.tie,
        "attention_bias": false,
        "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                            "mrope_section": [11, 11, 10], "mrope_interleaved": true},
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": p.lin_head_dim,
        "linear_value_head_dim": p.lin_head_dim,
        "linear_num_key_heads": p.lin_k_heads,
        "linear_num_value_heads": p.lin_v_heads,
        "layer_types": layer_types,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": match p.dtype {
            SaveDType::F32 => "float32",
            SaveDType::BF16 => "bfloat16",
        },
        "use_cache": true,
    })
}

/// The model config of `p` at its own vocabulary size, written nowhere
/// (for planning: the ids of special tokens are placeholders).
pub fn preset_config(p: &Preset) -> Result<crate::config::ModelConfig> {
    crate::config::ModelConfig::from_json(&preset_config_json(p, p.vocab, 0, 0))
}

/// What `init_model` wrote.
#[derive(Debug, Clone)]
pub struct InitReport {
    pub parameters: usize,
    pub vocab_size: usize,
}

/// Write a random model of `preset` into `out` (created if missing).
pub fn init_model(p: Preset, out: &Path, seed: u64) -> Result<InitReport> {
    std::fs::create_dir_all(out).map_err(|e| Error::io(out, e))?;
    let tok = write_tokenizer_files(out, p.tokenizer_vocab.unwrap_or(p.vocab))?;
    let vocab = match p.tokenizer_vocab {
        Some(_) => p.vocab.max(tok.vocab_size),
        None => tok.vocab_size,
    };
    let config = preset_config_json(&p, vocab, tok.im_end_id, tok.endoftext_id);
    let cfg = crate::config::ModelConfig::from_json(&config)?;

    let mut rng = StdRng::seed_from_u64(seed);
    // Each tensor is encoded in the checkpoint's dtype as soon as it is
    // drawn, so a model of billions of parameters is held once, at its
    // on-disk size (the 4B shape: 9 GB in bf16, not 18 GB of f32 first).
    let mut tensors: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut parameters = 0usize;
    let normal = |shape: Vec<usize>, std: f32, rng: &mut StdRng| -> (Vec<usize>, Vec<f32>) {
        let n: usize = shape.iter().product();
        // Box-Muller: rand 0.8 without rand_distr.
        let data = (0..n)
            .map(|_| {
                let u1: f32 = rng.gen_range(f32::EPSILON..1.0);
                let u2: f32 = rng.gen();
                std * (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
            })
            .collect();
        (shape, data)
    };
    let mut push = |name: String, (shape, data): (Vec<usize>, Vec<f32>)| {
        parameters += data.len();
        tensors.push((name, shape, p.dtype.encode(&data)));
    };
    let h = p.hidden;
    let s = 0.02;
    push(
        "model.embed_tokens.weight".into(),
        normal(vec![vocab, h], s, &mut rng),
    );
    push("model.norm.weight".into(), (vec![h], vec![0.0; h]));
    if !p.tie {
        push("lm_head.weight".into(), normal(vec![vocab, h], s, &mut rng));
    }
    let conv_dim = cfg.linear_conv_dim();
    for (i, lt) in cfg.layer_types.iter().enumerate() {
        let l = format!("model.layers.{i}.");
        push(
            format!("{l}input_layernorm.weight"),
            (vec![h], vec![0.0; h]),
        );
        push(
            format!("{l}post_attention_layernorm.weight"),
            (vec![h], vec![0.0; h]),
        );
        push(
            format!("{l}mlp.gate_proj.weight"),
            normal(vec![p.intermediate, h], s, &mut rng),
        );
        push(
            format!("{l}mlp.up_proj.weight"),
            normal(vec![p.intermediate, h], s, &mut rng),
        );
        push(
            format!("{l}mlp.down_proj.weight"),
            normal(vec![h, p.intermediate], s, &mut rng),
        );
        if *lt == crate::config::LayerType::LinearAttention {
            let a = format!("{l}linear_attn.");
            let (nv, dv) = (p.lin_v_heads, p.lin_head_dim);
            push(
                format!("{a}in_proj_qkv.weight"),
                normal(vec![conv_dim, h], s, &mut rng),
            );
            push(
                format!("{a}in_proj_z.weight"),
                normal(vec![nv * dv, h], s, &mut rng),
            );
            push(
                format!("{a}in_proj_b.weight"),
                normal(vec![nv, h], s, &mut rng),
            );
            push(
                format!("{a}in_proj_a.weight"),
                normal(vec![nv, h], s, &mut rng),
            );
            // nn.Conv1d's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)), fan_in = kernel.
            let bound = 0.5;
            let conv: Vec<f32> = (0..conv_dim * 4)
                .map(|_| rng.gen_range(-bound..bound))
                .collect();
            push(format!("{a}conv1d.weight"), (vec![conv_dim, 1, 4], conv));
            let a_log: Vec<f32> = (0..nv).map(|_| rng.gen_range(1e-4f32..16.0).ln()).collect();
            push(format!("{a}A_log"), (vec![nv], a_log));
            push(format!("{a}dt_bias"), (vec![nv], vec![1.0; nv]));
            push(format!("{a}norm.weight"), (vec![dv], vec![1.0; dv]));
            push(
                format!("{a}out_proj.weight"),
                normal(vec![h, nv * dv], s, &mut rng),
            );
        } else {
            let a = format!("{l}self_attn.");
            let (nh, nkv, hd) = (p.heads, p.kv_heads, p.head_dim);
            push(
                format!("{a}q_proj.weight"),
                normal(vec![nh * hd * 2, h], s, &mut rng),
            );
            push(
                format!("{a}k_proj.weight"),
                normal(vec![nkv * hd, h], s, &mut rng),
            );
            push(
                format!("{a}v_proj.weight"),
                normal(vec![nkv * hd, h], s, &mut rng),
            );
            push(
                format!("{a}o_proj.weight"),
                normal(vec![h, nh * hd], s, &mut rng),
            );
            push(format!("{a}q_norm.weight"), (vec![hd], vec![0.0; hd]));
            push(format!("{a}k_norm.weight"), (vec![hd], vec![0.0; hd]));
        }
    }
    save_safetensors_encoded(&out.join("model.safetensors"), &tensors, p.dtype)?;
    let text = serde_json::to_string_pretty(&config).map_err(|e| Error::Config(e.to_string()))?;
    write_atomic(&out.join("config.json"), text.as_bytes())?;
    let gen: Value = json!({"eos_token_id": [tok.im_end_id, tok.endoftext_id], "pad_token_id": tok.endoftext_id});
    write_atomic(
        &out.join("generation_config.json"),
        serde_json::to_string_pretty(&gen)
            .map_err(|e| Error::Config(e.to_string()))?
            .as_bytes(),
    )?;
    Ok(InitReport {
        parameters,
        vocab_size: vocab,
    })
}
