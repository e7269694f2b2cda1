//! `arcticd score`, `arcticd generate` and `arcticd init-model`: the model
//! commands, thin wiring over the engine crate.

use anyhow::{bail, Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::model::WeightDType;
use arcticd_engine::sampler::argmax;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_engine::{ModelConfig, Qwen3_5, SeqInput};
use arcticd_kernels::Device;
use clap::Args;
use serde::Deserialize;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct ScoreArgs {
    /// Checkpoint directory (Hugging Face layout).
    #[arg(long)]
    pub model: PathBuf,
    /// JSON file `{"sequences": [[token ids], ...]}`.
    #[arg(long)]
    pub input: PathBuf,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// On CUDA, the matrices' type: `bf16` (half the memory) or `f32`
    /// (fp32 products, the CPU's numbers to rounding).
    #[arg(long, default_value = "bf16")]
    pub weights: WeightDType,
    /// On CUDA, the deterministic mode: the forward products on an
    /// in-order kernel instead of cuBLAS, so a token's numbers do not
    /// depend on the batch (slower prefill). The CPU is always so.
    #[arg(long)]
    pub batch_invariant: bool,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "an object like {\"sequences\": [[token ids], ...]}"
)]
struct ScoreInput {
    sequences: Vec<Vec<u32>>,
}

/// Print `{"logprobs": [[null, lp1, ...], ...]}`: lp_t = log p(token_t | tokens before t).
pub fn score(args: ScoreArgs) -> Result<()> {
    let text = std::fs::read_to_string(&args.input)
        .with_context(|| format!("reading {}", args.input.display()))?;
    let input: ScoreInput = serde_json::from_str(&text).map_err(|e| {
        anyhow::anyhow!(
            "{} must be {{\"sequences\": [[token ids], ...]}}: {}",
            args.input.display(),
            arcticd_engine::error::plain_types(&e.to_string())
        )
    })?;
    let config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let longest = input.sequences.iter().map(Vec::len).max().unwrap_or(0);
    if let Some(p) = config.max_positions.filter(|&p| longest > p) {
        // Scored all the same, as transformers does: the numbers are the
        // model's, past what it was trained for.
        eprintln!(
            "arcticd score: warning: a sequence of {longest} tokens is past the {p} positions \
             the model was trained for (max_position_embeddings)"
        );
    }
    let lps = match args.device {
        Device::Cpu => {
            // Read only: loaded packed, each weight held once (the same bits).
            let (model, packs) = Qwen3_5::load_packed(&args.model)
                .with_context(|| format!("loading model from {}", args.model.display()))?;
            model.score_with(&input.sequences, Some(&packs))?
        }
        Device::Cuda(ordinal) => score_on_cuda(&args, ordinal, &input.sequences)?,
    };
    // JSON has no NaN or infinity (they would print as null, like the
    // first token's, which has no log-prob): a model that gives them is
    // refused with where, not written as if scored.
    let bad = lps.iter().enumerate().find_map(|(i, seq)| {
        seq.iter()
            .position(|lp| lp.is_some_and(|v| !v.is_finite()))
            .map(|j| (i, j, seq[j]))
    });
    if let Some((i, j, Some(v))) = bad {
        bail!(
            "sequence {i}, token {j}: the model gives the log-prob {v}, which JSON cannot hold; \
             its weights or its configuration are likely broken (NaN or infinite values)"
        );
    }
    let out = serde_json::json!({ "logprobs": lps });
    let mut stdout = std::io::stdout().lock();
    serde_json::to_writer(&mut stdout, &out)?;
    writeln!(stdout)?;
    Ok(())
}

#[cfg(feature = "cuda")]
fn score_on_cuda(
    args: &ScoreArgs,
    ordinal: usize,
    sequences: &[Vec<u32>],
) -> Result<Vec<Vec<Option<f32>>>> {
    Ok(on_cuda(&args.model, args.weights, ordinal, args.batch_invariant)?.score(sequences)?)
}

#[cfg(not(feature = "cuda"))]
fn score_on_cuda(
    _args: &ScoreArgs,
    ordinal: usize,
    _sequences: &[Vec<u32>],
) -> Result<Vec<Vec<Option<f32>>>> {
    no_cuda(ordinal)
}

/// What `--device cuda:N` does in a build without the `cuda` feature.
#[cfg(not(feature = "cuda"))]
pub(crate) fn no_cuda<T>(ordinal: usize) -> Result<T> {
    Device::Cuda(ordinal).check_available()?;
    bail!("cuda:{ordinal}: this build has no CUDA backend")
}

#[derive(Args)]
pub struct GenerateArgs {
    /// Checkpoint directory (Hugging Face layout, with tokenizer files).
    #[arg(long)]
    pub model: PathBuf,
    /// The user message (rendered through the chat template when the model has one).
    #[arg(long)]
    pub prompt: String,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 64, value_parser = crate::at_least_one)]
    pub max_tokens: usize,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// On CUDA, the matrices' type: `bf16` or `f32`.
    #[arg(long, default_value = "bf16")]
    pub weights: WeightDType,
    /// On CUDA, the deterministic mode: the forward products on an
    /// in-order kernel instead of cuBLAS, so a token's numbers do not
    /// depend on the batch (slower prefill). The CPU is always so.
    #[arg(long)]
    pub batch_invariant: bool,
}

/// One greedy step: the next token after `tokens`, which follow what the
/// step has already run.
type GreedyStep = Box<dyn FnMut(&[u32]) -> Result<u32>>;

/// Greedy decoding, printing the completion as it is produced.
pub fn generate(args: GenerateArgs) -> Result<()> {
    let config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let tokenizer = Tokenizer::from_dir(&args.model)?;
    let text = match ChatTemplate::from_dir(&args.model)? {
        Some(t) => t.render(
            &[serde_json::json!({"role": "user", "content": args.prompt})],
            None,
            true,
        )?,
        None => args.prompt.clone(),
    };
    let prompt = tokenizer.encode(&text)?;
    if prompt.is_empty() {
        bail!("the prompt encodes to no tokens");
    }
    if let Some(p) = config.max_positions {
        if prompt.len().saturating_add(args.max_tokens) > p {
            bail!(
                "the prompt is {} tokens and --max-tokens {}: past the {p} positions the model \
                 was trained for (max_position_embeddings in its config.json)",
                prompt.len(),
                args.max_tokens
            );
        }
    }
    let mut stop = tokenizer.eos_token_ids();
    stop.extend(&config.eos_token_ids);
    let mut step: GreedyStep = match args.device {
        Device::Cpu => {
            let (model, packs) = Qwen3_5::load_packed(&args.model)
                .with_context(|| format!("loading model from {}", args.model.display()))?;
            let mut cache = model.new_cache();
            Box::new(move |tokens: &[u32]| {
                let hidden = model.forward_with(
                    &mut [SeqInput {
                        tokens,
                        cache: &mut cache,
                    }],
                    Some(&packs),
                )?;
                let h = model.config.hidden_size;
                let logits = model.logits_with(&hidden[hidden.len() - h..], Some(&packs))?;
                Ok(argmax(&logits) as u32)
            })
        }
        Device::Cuda(ordinal) => {
            cuda_greedy(&args, ordinal, prompt.len().saturating_add(args.max_tokens))?
        }
    };
    let mut next = prompt.clone();
    let mut out = Vec::new();
    let mut printed = 0;
    let mut stdout = std::io::stdout().lock();
    for _ in 0..args.max_tokens {
        let tok = step(&next)?;
        if stop.contains(&tok) {
            break;
        }
        out.push(tok);
        // Print whole characters only: a byte-level token can end mid-UTF-8.
        let s = tokenizer.decode(&out, true)?;
        if !s.ends_with('\u{fffd}') && s.len() > printed {
            write!(stdout, "{}", &s[printed..])?;
            stdout.flush()?;
            printed = s.len();
        }
        next = vec![tok];
    }
    writeln!(stdout)?;
    Ok(())
}

/// The model on `cuda:ORDINAL`, with `--weights` deciding its matrices' type.
#[cfg(feature = "cuda")]
fn on_cuda(
    model_dir: &std::path::Path,
    weights: WeightDType,
    ordinal: usize,
    batch_invariant: bool,
) -> Result<arcticd_engine::model::cuda::CudaModel> {
    use arcticd_engine::model::cuda::CudaModel;
    use arcticd_kernels::cuda::device::CudaDevice;
    let dev = CudaDevice::new(ordinal)?;
    dev.set_batch_invariant(batch_invariant);
    let dev = std::sync::Arc::new(dev);
    let model = Qwen3_5::load(model_dir)
        .with_context(|| format!("loading model from {}", model_dir.display()))?;
    Ok(CudaModel::upload(&model, dev, weights)?)
}

/// Greedy steps on `cuda:ORDINAL` for a sequence of at most `capacity`
/// positions.
#[cfg(feature = "cuda")]
fn cuda_greedy(args: &GenerateArgs, ordinal: usize, capacity: usize) -> Result<GreedyStep> {
    let model = on_cuda(&args.model, args.weights, ordinal, args.batch_invariant)?;
    let mut cache = model.new_cache(capacity)?;
    Ok(Box::new(move |tokens: &[u32]| {
        Ok(model.greedy_step(&mut cache, tokens)?)
    }))
}

#[cfg(not(feature = "cuda"))]
fn cuda_greedy(_args: &GenerateArgs, ordinal: usize, _capacity: usize) -> Result<GreedyStep> {
    no_cuda(ordinal)
}

#[derive(Args)]
pub struct InitModelArgs {
    /// `tiny` (tests, well under 1M parameters), `small` (a few million), `demo` (the RL
    /// demo's warm start: small's vocabulary, a narrow shallow body), `qwen3.5-0.8b`
    /// (the real 0.8B shape, random bf16 weights: 1.5 GB) or `qwen3.5-4b` (the 4B
    /// shape, about 8 GB).
    #[arg(long, default_value = "tiny")]
    pub preset: String,
    /// Output directory (created if missing).
    #[arg(long)]
    pub out: PathBuf,
    /// Seed of the random initialisation.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

pub fn init_model(args: InitModelArgs) -> Result<()> {
    let preset = arcticd_engine::init::preset(&args.preset)?;
    // A new folder or an empty one: random weights written over a trained
    // checkpoint (or beside its optimizer state) would lose it, or mix it.
    let out = &args.out;
    if out.exists() && !out.is_dir() {
        bail!(
            "{} is a file; --out names the folder of the new model",
            out.display()
        );
    }
    if std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some()) {
        bail!(
            "{} is not empty; init-model writes a new model into a new or empty folder \
             (remove it first to replace what is there)",
            out.display()
        );
    }
    let report = arcticd_engine::init::init_model(preset, out, args.seed)?;
    eprintln!(
        "wrote {} ({} preset): {} parameters, vocabulary {}",
        args.out.display(),
        preset.name,
        report.parameters,
        report.vocab_size
    );
    Ok(())
}

#[derive(Args)]
pub struct BenchForwardArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Sequences per batch.
    #[arg(long, default_value_t = 8)]
    pub batch: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 512)]
    pub seq_len: usize,
    /// Timed repetitions (after one warm-up).
    #[arg(long, default_value_t = 3)]
    pub iters: usize,
}

/// Time the full forward (hidden states and logits of every position) of a
/// packed batch of random sequences; prints one JSON line with tokens/s.
pub fn bench_forward(args: BenchForwardArgs) -> Result<()> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    if args.batch == 0 || args.seq_len == 0 || args.iters == 0 {
        bail!("--batch, --seq-len and --iters must be positive");
    }
    let model = Qwen3_5::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    // Every position's logits and one layer's activations at the least: a
    // size far past memory is refused, not an abort on allocation.
    let c = &model.config;
    let need = args
        .batch
        .checked_mul(args.seq_len)
        .and_then(|t| t.checked_mul(c.vocab_size + 4 * c.hidden_size + 3 * c.intermediate_size))
        .and_then(|n| n.checked_mul(4));
    let available = arcticd_trainer::memory::host_memory_available();
    match (need, available) {
        (None, _) => bail!(
            "--batch {} x --seq-len {} is too large",
            args.batch,
            args.seq_len
        ),
        (Some(n), Some(a)) if n as u64 > a => bail!(
            "--batch {} x --seq-len {} needs at least {} MiB (every position's logits and one \
             layer's activations), more than the {} MiB of memory available",
            args.batch,
            args.seq_len,
            n >> 20,
            a >> 20
        ),
        _ => {}
    }
    let mut rng = StdRng::seed_from_u64(0);
    let vocab = model.config.vocab_size as u32;
    let seqs: Vec<Vec<u32>> = (0..args.batch)
        .map(|_| (0..args.seq_len).map(|_| rng.gen_range(0..vocab)).collect())
        .collect();
    let run = || -> Result<f64> {
        let start = std::time::Instant::now();
        let mut caches: Vec<_> = seqs.iter().map(|_| model.new_cache()).collect();
        let mut batch: Vec<SeqInput<'_>> = seqs
            .iter()
            .zip(caches.iter_mut())
            .map(|(s, c)| SeqInput {
                tokens: s,
                cache: c,
            })
            .collect();
        let hidden = model.forward(&mut batch)?;
        let logits = model.logits(&hidden)?;
        std::hint::black_box(&logits);
        Ok(start.elapsed().as_secs_f64())
    };
    run()?;
    let mut times = Vec::with_capacity(args.iters);
    for i in 0..args.iters {
        let t = run()?;
        eprintln!("iteration {}/{}: {:.3} s", i + 1, args.iters, t);
        times.push(t);
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tokens = args.batch * args.seq_len;
    let out = serde_json::json!({
        "engine": "arcticd",
        "batch": args.batch,
        "seq_len": args.seq_len,
        "threads": rayon::current_num_threads(),
        "median_s": median,
        "tokens_per_s": tokens as f64 / median,
    });
    outln!("{out}")?;
    Ok(())
}

#[derive(Args)]
pub struct BenchDecodeArgs {
    /// Checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// Sequences decoding at once, one measurement per value.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub batch: Vec<usize>,
    /// Prompt tokens per sequence (random ids).
    #[arg(long, default_value_t = 16)]
    pub prompt_len: usize,
    /// Tokens generated per sequence.
    #[arg(long, default_value_t = 32)]
    pub new_tokens: usize,
    /// Engine cache memory in MiB (KV blocks and recurrent-state slots).
    #[arg(long, default_value_t = 1024, value_parser = crate::cli_serve::mib)]
    pub cache_memory: usize,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature.
    #[arg(long, default_value = "cpu")]
    pub device: Device,
    /// On CUDA, the matrices' type: `bf16` or `f32`.
    #[arg(long, default_value = "bf16")]
    pub weights: WeightDType,
    /// On CUDA, the memory bandwidth in TB/s that `hbm_fraction` is a
    /// fraction of (the H200's by default).
    #[arg(long, default_value_t = 4.8, value_parser = crate::positive_number)]
    pub hbm_tb_s: f64,
    /// On CUDA, the deterministic mode's products (see `serve`).
    #[arg(long)]
    pub batch_invariant: bool,
}

/// What one decode step moves through a GPU's memory, the roofline's
/// numerator: the weights once, and per sequence its state slot (read and
/// written) and its keys and values (read; the new position's written).
struct StepTraffic {
    weights: usize,
    slot: usize,
    kv_per_position: usize,
}

impl StepTraffic {
    fn of(config: &ModelConfig, weights: usize) -> Self {
        let layout = arcticd_engine::kv_cache::CacheLayout::new(config);
        StepTraffic {
            weights,
            slot: layout.slot_bytes(),
            kv_per_position: layout.block_bytes(1),
        }
    }

    /// Bytes of one step over `batch` sequences of `context` positions.
    fn step_bytes(&self, batch: usize, context: usize) -> usize {
        self.weights + batch * (2 * self.slot + (context + 1) * self.kv_per_position)
    }
}

/// Bytes the model's weights take on `device` as `weights`.
#[cfg(feature = "cuda")]
fn gpu_weight_bytes(model: &Qwen3_5, weights: WeightDType, _device: Device) -> Result<usize> {
    Ok(arcticd_engine::model::cuda::CudaModel::upload_bytes(
        model, weights,
    ))
}

#[cfg(not(feature = "cuda"))]
fn gpu_weight_bytes(_model: &Qwen3_5, _weights: WeightDType, device: Device) -> Result<usize> {
    match device {
        Device::Cuda(ordinal) => no_cuda(ordinal),
        Device::Cpu => bail!("the CPU holds no GPU weights"),
    }
}

/// Greedy decoding through the engine (the serving path: packed weights,
/// paged caches, the scheduler) with `batch` sequences at once; prints one
/// JSON line per batch size with generated tokens/s (prefill of the
/// prompts included, after a warm-up run; the weights are loaded packed,
/// as `arcticd serve` loads them), the time until every sequence of the
/// batch had its first token (`prefill_seconds`, of the same run, so never
/// past `seconds`) and the rate of the tokens after the first from then on
/// (`decode_tokens_per_s`, what a long prompt would otherwise hide; when
/// the prompts take more than one step, the tokens the first sequences
/// made meanwhile are counted in it too), and the process's memory. On a GPU (`--device cuda:N`) each line also has
/// the bytes a decode step moves (the weights as held on the device, and
/// per sequence its state slot read and written and its keys and values
/// read) and that traffic's fraction of `--hbm-tb-s`, the roofline.
pub fn bench_decode(args: BenchDecodeArgs) -> Result<()> {
    use arcticd_engine::engine::{self, Choice, EngineConfig, Request};
    use arcticd_engine::sampler::SamplingParams;
    use arcticd_engine::ParamStore;
    use rand::{rngs::StdRng, Rng, SeedableRng};
    if args.batch.is_empty() || args.batch.contains(&0) || args.prompt_len == 0 {
        bail!("--batch values and --prompt-len must be positive");
    }
    if args.new_tokens == 0 {
        bail!("--new-tokens must be positive");
    }
    let on_gpu = args.device != Device::Cpu;
    let (store, parameters, weight_bytes, traffic) = if on_gpu {
        // The GPU reads the weights it uploads; the host keeps the f32 copy.
        let model = Qwen3_5::load(&args.model)
            .with_context(|| format!("loading model from {}", args.model.display()))?;
        let parameters: usize = model.named_params().iter().map(|(_, t)| t.numel()).sum();
        let weights = gpu_weight_bytes(&model, args.weights, args.device)?;
        let traffic = StepTraffic::of(&model.config, weights);
        (ParamStore::new(model), parameters, weights, Some(traffic))
    } else {
        let (model, packs) = Qwen3_5::load_packed(&args.model)
            .with_context(|| format!("loading model from {}", args.model.display()))?;
        let parameters: usize = model.named_params().iter().map(|(_, t)| t.numel()).sum();
        let bytes = packs.bytes() + model.held_bytes();
        (ParamStore::packed(model, packs), parameters, bytes, None)
    };
    let vocab = store.read().config.vocab_size as u32;
    let weight_mib = weight_bytes >> 20;
    let loaded = arcticd_trainer::memory::process_resident();
    let max_batch = *args.batch.iter().max().unwrap_or(&1);
    let eng = engine::start(
        store,
        None,
        EngineConfig {
            cache_memory: args.cache_memory << 20,
            max_num_seqs: max_batch,
            // A step holds every sequence's decode token, and a prefill
            // chunk beside them.
            max_batched_tokens: EngineConfig::default()
                .max_batched_tokens
                .max(max_batch.saturating_add(EngineConfig::default().prefix_unit)),
            max_model_len: args.prompt_len + args.new_tokens + 16,
            enable_prefix_cache: false,
            device: args.device,
            weights: args.weights,
            batch_invariant: args.batch_invariant,
            ..Default::default()
        },
    )?;
    let mut rng = StdRng::seed_from_u64(0);
    // Seconds until every sequence has its first token (the prompts'
    // prefill), and until every one is done, of the same run.
    let mut run = |batch: usize, new_tokens: usize| -> Result<(f64, f64)> {
        let start = std::time::Instant::now();
        let mut subs = Vec::with_capacity(batch);
        for _ in 0..batch {
            let prompt: Vec<u32> = (0..args.prompt_len)
                .map(|_| rng.gen_range(0..vocab))
                .collect();
            subs.push(eng.submit(Request {
                prompt,
                params: SamplingParams {
                    ignore_eos: true,
                    ..SamplingParams::greedy(new_tokens)
                },
            })?);
        }
        // Each sequence's events wait in its channel, so reading every
        // first event before the rest times the last first token.
        let mut done = vec![false; batch];
        for (s, done) in subs.iter_mut().zip(&mut done) {
            let event = s
                .events
                .blocking_recv()
                .context("the engine stopped mid-request")?;
            *done = engine::apply_event(&mut [Choice::default()], event)? > 0;
        }
        let first = start.elapsed().as_secs_f64();
        for (mut s, _) in subs.into_iter().zip(done).filter(|(_, done)| !done) {
            let mut choices = vec![Choice::default()];
            loop {
                let event = s
                    .events
                    .blocking_recv()
                    .context("the engine stopped mid-request")?;
                if engine::apply_event(&mut choices, event)? > 0 {
                    break;
                }
            }
        }
        Ok((first, start.elapsed().as_secs_f64()))
    };
    run(1, args.new_tokens)?;
    for &batch in &args.batch {
        let (prefill_seconds, seconds) = run(batch, args.new_tokens)?;
        let (rss, peak) = arcticd_trainer::memory::process_resident().unwrap_or((0, 0));
        let tokens_per_s = (batch * args.new_tokens) as f64 / seconds;
        let mut out = serde_json::json!({
            "engine": "arcticd",
            "device": args.device.to_string(),
            "batch_invariant": args.batch_invariant,
            "parameters": parameters,
            "weights_mib": weight_mib,
            "batch": batch,
            "prompt_len": args.prompt_len,
            "new_tokens": args.new_tokens,
            "threads": rayon::current_num_threads(),
            "seconds": seconds,
            "tokens_per_s": tokens_per_s,
            "prefill_seconds": prefill_seconds,
            "rss_after_load_mib": loaded.map(|(r, _)| r >> 20),
            "rss_mib": rss >> 20,
            "peak_rss_mib": peak >> 20,
        });
        if args.new_tokens > 1 && seconds > prefill_seconds {
            out["decode_tokens_per_s"] = serde_json::json!(
                (batch * (args.new_tokens - 1)) as f64 / (seconds - prefill_seconds)
            );
        }
        if let Some(t) = &traffic {
            // Mid-generation: the mean context of a decode step.
            let context = args.prompt_len + args.new_tokens / 2;
            let step_bytes = t.step_bytes(batch, context);
            let steps_per_s = tokens_per_s / batch as f64;
            out["weights"] = serde_json::json!(format!("{:?}", args.weights));
            out["step_bytes"] = serde_json::json!(step_bytes);
            out["hbm_fraction"] =
                serde_json::json!(steps_per_s * step_bytes as f64 / (args.hbm_tb_s * 1e12));
        }
        outln!("{out}")?;
    }
    eng.shutdown();
    Ok(())
}
