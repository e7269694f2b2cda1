//! `arcticd sft`: supervised fine-tuning with the trainer crate, with the
//! semantics outside checks compare against PyTorch: step k uses data lines
//! `k*B .. k*B+B-1` (mod the number of lines) in file order, loss = sum of
//! -log p over target tokens / target tokens in the batch, one AdamW step
//! (torch semantics) per batch, constant LR unless `--warmup`, no clipping
//! unless `--grad-clip`. Prints one JSON line per step on stdout (progress
//! goes to stderr: a bar on a terminal, periodic plain lines otherwise) and
//! writes the final checkpoint, with optimizer state for resume, to `--out`.
//! Ctrl-C or SIGTERM ends the step under way, writes the checkpoint of the
//! steps done and exits with the signal's status (130, 143); a second
//! signal stops at once.

use crate::progress::Progress;
use anyhow::{Context, Result};
use arcticd_engine::chat::ChatTemplate;
use arcticd_engine::config::ModelConfig;
use arcticd_engine::tokenizer::Tokenizer;
use arcticd_engine::{ParamStore, Qwen3_5};
use arcticd_trainer::checkpoint::save_checkpoint;
use arcticd_trainer::data::{batch_for_step, read_sft_jsonl, ChatRender};
use arcticd_trainer::device::StepDevice;
use arcticd_trainer::memory::{host_memory_available, MemoryPlan, Placement, PlanShape};
use arcticd_trainer::optim::{AdamWConfig, LrSchedule};
use arcticd_trainer::step::{TrainConfig, Trainer};
use clap::Args;
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct SftArgs {
    /// Checkpoint directory to start from (Hugging Face layout).
    #[arg(long)]
    pub model: PathBuf,
    /// JSONL data: {"tokens": [...], "loss_mask": [...]} or {"messages": [...], "tools": [...]} per line.
    #[arg(long)]
    pub data: PathBuf,
    /// Where the final checkpoint is written (replaced atomically).
    #[arg(long)]
    pub out: PathBuf,
    /// Optimizer steps.
    #[arg(long)]
    pub steps: usize,
    /// Sequences per step.
    #[arg(long)]
    pub batch_size: usize,
    /// Peak learning rate.
    #[arg(long)]
    pub lr: f64,
    /// Decoupled weight decay (torch.optim.AdamW's default).
    #[arg(long, default_value_t = 0.01)]
    pub weight_decay: f64,
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f64,
    #[arg(long, default_value_t = 0.999)]
    pub beta2: f64,
    #[arg(long, default_value_t = 1e-8)]
    pub eps: f64,
    /// Clip the global gradient norm to this (torch clip_grad_norm_); off by default.
    #[arg(long, value_parser = crate::positive_number)]
    pub grad_clip: Option<f64>,
    /// Linear warmup steps: step k (0-based) uses lr * k / warmup while k < warmup
    /// (transformers' get_constant_schedule_with_warmup); 0 = constant.
    #[arg(long, default_value_t = 0)]
    pub warmup: u64,
    /// Tokens per micro-batch (gradient accumulation inside a step).
    #[arg(long, default_value_t = 16384, value_parser = crate::at_least_one)]
    pub micro_batch_tokens: usize,
    /// Run the tokens consecutive sequences of a step start with once (the
    /// recipe key `share_prefixes`; the CPU trainer): the same loss and
    /// gradient as every sequence whole, to fp32 rounding.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set, value_name = "BOOL")]
    pub share_prefixes: bool,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature: the whole
    /// step on the GPU (f32 weights as the masters; the same trainer code).
    #[arg(long, default_value = "cpu")]
    pub device: arcticd_kernels::Device,
}

pub fn sft(args: SftArgs) -> Result<()> {
    anyhow::ensure!(
        args.batch_size > 0 && args.steps > 0,
        "--batch-size and --steps must be positive (0 steps would write the model back unchanged)"
    );
    anyhow::ensure!(
        args.lr > 0.0,
        "--lr {} is not a learning rate: give a number above 0 (at 0 the model would be \
         written back unchanged)",
        args.lr
    );
    let schedule = if args.warmup > 0 {
        LrSchedule::LinearWarmup {
            warmup: args.warmup,
        }
    } else {
        LrSchedule::Constant
    };
    if let Some(w) = schedule.unfinished_warmup(args.steps as u64, args.lr) {
        eprintln!("arcticd sft: warning: {w}");
    }
    arcticd_trainer::checkpoint::check_checkpoint_out(&args.out).context("--out")?;
    let model_config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let vocab = model_config.vocab_size;
    // Tokenizer and template only matter for {"messages": ...} lines.
    let tokenizer = Tokenizer::from_dir(&args.model).ok();
    let template = ChatTemplate::from_dir(&args.model).ok().flatten();
    let chat = match (&tokenizer, &template) {
        (Some(tokenizer), Some(template)) => Some(ChatRender {
            tokenizer,
            template,
        }),
        _ => None,
    };
    let data = read_sft_jsonl(&args.data, vocab, chat.as_ref(), model_config.max_positions)?;
    if args.batch_size > data.len() {
        eprintln!(
            "arcticd sft: warning: --batch-size {} is more than the {} examples of {}, so every \
             step holds some examples more than once (weighted as many times)",
            args.batch_size,
            data.len(),
            args.data.display()
        );
    }
    // What the run will hold, before the weights are loaded: a micro-batch
    // is at most the budget (or one longer sequence), of at most a batch's
    // sequences.
    let longest = data.iter().map(|e| e.tokens.len()).max().unwrap_or(1);
    let shape = PlanShape {
        tokens: (args.batch_size * longest)
            .min(args.micro_batch_tokens)
            .max(longest),
        sequences: args.batch_size,
        recompute_layers: false,
    };
    check_plan(
        &model_config,
        shape,
        args.device,
        "lower --micro-batch-tokens or --batch-size",
    )?;
    let model = Qwen3_5::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let config = TrainConfig {
        optimizer: AdamWConfig {
            lr: args.lr,
            beta1: args.beta1,
            beta2: args.beta2,
            eps: args.eps,
            weight_decay: args.weight_decay,
        },
        schedule,
        grad_clip: args.grad_clip,
        micro_batch_tokens: args.micro_batch_tokens,
        share_prefixes: args.share_prefixes,
        ..TrainConfig::default()
    };
    let store = ParamStore::new(model);
    match args.device {
        arcticd_kernels::Device::Cpu => sft_loop(&args, &data, Trainer::new(store, config)?),
        arcticd_kernels::Device::Cuda(ordinal) => sft_on_cuda(&args, &data, config, store, ordinal),
    }
}

/// The SFT steps on whichever device `trainer` runs: a JSON line per step,
/// then the checkpoint (weights and optimizer state from the host).
fn sft_loop<D: StepDevice>(
    args: &SftArgs,
    data: &[arcticd_trainer::step::SftExample],
    mut trainer: Trainer<D>,
) -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering};
    let stop = std::sync::Arc::new(AtomicBool::new(false));
    let _signals = arcticd_trainer::interrupt::watch(
        stop.clone(),
        arcticd_trainer::interrupt::Stops {
            command: "sft",
            first: "finishing this step, then the checkpoint of the steps done",
            kept: "no checkpoint written",
        },
    )?;
    let mut progress = Progress::new(Some(args.steps as u64), "sft");
    let mut stdout = std::io::stdout().lock();
    let (mut done, mut skipped, mut last_skipped) = (0, 0, false);
    for step in 0..args.steps {
        if stop.load(Ordering::Acquire) {
            break;
        }
        let m = trainer.sft_step(&batch_for_step(data, step, args.batch_size))?;
        let line = serde_json::json!({
            "step": step + 1,
            "loss": m.loss,
            "grad_norm": m.grad_norm,
            "lr": m.lr,
            "tokens": m.tokens,
            "tokens_run": m.tokens_run,
            "skipped": m.skipped,
            "device": args.device.to_string(),
        });
        writeln!(stdout, "{line}")?;
        stdout.flush()?;
        if m.skipped {
            progress.println(format!(
                "warning: step {}: non-finite loss or gradient, step skipped",
                step + 1
            ));
            skipped += 1;
        }
        last_skipped = m.skipped;
        progress.set_message(format!("loss {:.4}", m.loss));
        progress.inc(1);
        done = step + 1;
    }
    if done > 0 && skipped == done {
        progress.finish(String::new());
        anyhow::bail!(
            "every step ({done}) had a non-finite loss or gradient and was skipped: nothing was \
             trained, no checkpoint written"
        );
    }
    progress.finish(format!("writing checkpoint {}", args.out.display()));
    trainer.sync_host()?;
    let optimizer = trainer.optimizer()?;
    let model = trainer.store().read();
    save_checkpoint(&args.out, &model, &args.model, Some(&optimizer))
        .with_context(|| format!("writing checkpoint {}", args.out.display()))?;
    if last_skipped {
        // Kept for a look, but not a run that finished well.
        anyhow::bail!(
            "the last step had a non-finite loss or gradient ({skipped} of {done} steps were \
             skipped): the weights have likely diverged (--lr {} too high?); {} holds them as \
             they are",
            args.lr,
            args.out.display()
        );
    }
    if let Some(status) = arcticd_trainer::interrupt::status().filter(|_| done < args.steps) {
        // Stopped by a signal: the checkpoint holds the steps done, and the
        // status says the run did not finish.
        eprintln!(
            "arcticd sft: stopped after {done} of {} steps; {} holds them",
            args.steps,
            args.out.display()
        );
        std::process::exit(status);
    }
    Ok(())
}

/// The trainer's memory plan where it will run, printed, and refused
/// before anything is loaded when it needs more than is there: host memory
/// on the CPU, the memory free on the GPU (the device trainer's layout:
/// the engines' bf16 weights, f32 masters, moments, gradients and
/// activations).
fn check_plan(
    config: &ModelConfig,
    shape: PlanShape,
    device: arcticd_kernels::Device,
    fix: &str,
) -> Result<()> {
    match device {
        arcticd_kernels::Device::Cpu => {
            let plan = MemoryPlan::training(config, shape);
            eprintln!("memory plan:\n{plan}");
            Ok(plan.check(host_memory_available(), fix)?)
        }
        arcticd_kernels::Device::Cuda(ordinal) => check_gpu_plan(config, shape, ordinal, fix),
    }
}

#[cfg(feature = "cuda")]
fn check_gpu_plan(config: &ModelConfig, shape: PlanShape, ordinal: usize, fix: &str) -> Result<()> {
    let plan = MemoryPlan::training_on(config, shape, Placement::Gpu);
    eprintln!("memory plan on cuda:{ordinal}:\n{plan}");
    let dev = arcticd_kernels::cuda::device::CudaDevice::new(ordinal)?;
    let (free, _) = dev.memory_info()?;
    Ok(plan.check(Some(free as u64), fix)?)
}

/// Without CUDA there is no GPU to plan for: the caller's device then
/// fails with the build's error.
#[cfg(not(feature = "cuda"))]
fn check_gpu_plan(_: &ModelConfig, _: PlanShape, ordinal: usize, _: &str) -> Result<()> {
    crate::cli_model::no_cuda(ordinal)
}

/// `sft --device cuda:N`: the trainer's steps on the GPU
/// (`trainer::cuda::CudaStep`), the rest as on the CPU.
#[cfg(feature = "cuda")]
fn sft_on_cuda(
    args: &SftArgs,
    data: &[arcticd_trainer::step::SftExample],
    config: TrainConfig,
    store: std::sync::Arc<ParamStore>,
    ordinal: usize,
) -> Result<()> {
    use arcticd_kernels::cuda::device::CudaDevice;
    let dev = std::sync::Arc::new(CudaDevice::new(ordinal)?);
    let step = arcticd_trainer::cuda::CudaStep::new(store, dev, config.optimizer)?;
    sft_loop(args, data, Trainer::on(step, config))
}

#[cfg(not(feature = "cuda"))]
fn sft_on_cuda(
    _args: &SftArgs,
    _data: &[arcticd_trainer::step::SftExample],
    _config: TrainConfig,
    _store: std::sync::Arc<ParamStore>,
    ordinal: usize,
) -> Result<()> {
    crate::cli_model::no_cuda(ordinal)
}

/// Where `arcticd plan` places the trainer's buffers.
#[derive(Clone, Copy, clap::ValueEnum)]
pub enum PlacementArg {
    /// Host memory, every buffer f32 (the trainer of `sft` and `train`).
    Cpu,
    /// One GPU: bf16 weights the engine reads, fp32 masters, moments,
    /// gradients and activations (the device trainer's design).
    Gpu,
}

#[derive(Args)]
#[command(group(clap::ArgGroup::new("shape").required(true).args(["model", "preset"])))]
pub struct PlanArgs {
    /// Model folder (its config.json is all that is read).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// A built-in shape instead: tiny, small, demo, qwen3.5-0.8b, qwen3.5-4b.
    #[arg(long)]
    pub preset: Option<String>,
    /// Tokens per micro-batch.
    #[arg(long, default_value_t = 32_768)]
    pub tokens: usize,
    /// Sequences per micro-batch.
    #[arg(long, default_value_t = 1)]
    pub sequences: usize,
    /// Keep only each layer's input and recompute the layer in the backward.
    #[arg(long)]
    pub recompute_layers: bool,
    #[arg(long, value_enum, default_value = "cpu")]
    pub placement: PlacementArg,
    /// Memory the plan must fit in, GB (10^9 bytes). Default: this host's
    /// available memory with `--placement cpu`; required with `gpu` (141
    /// for an H200).
    #[arg(long)]
    pub memory_gb: Option<f64>,
}

/// A micro-batch shape the memory plan can size: positive, no more
/// sequences than tokens, and at most 2^30 tokens (past that the plan's
/// byte counts could wrap around, and planning a sequence at a time would
/// allocate before refusing). `sequences` names the flag that set them.
fn check_plan_tokens(tokens: usize, sequences: usize, what: &str) -> Result<()> {
    if tokens == 0 || sequences == 0 || sequences > tokens || tokens > 1 << 30 {
        anyhow::bail!(
            "--tokens and {what} must be positive, with no more sequences than tokens \
             and at most 1073741824 tokens"
        );
    }
    Ok(())
}

/// `arcticd plan`: the training memory plan of a model at a micro-batch
/// shape, before anything is allocated; fails when it does not fit.
pub fn plan(args: PlanArgs) -> Result<()> {
    let config = match (&args.model, &args.preset) {
        (Some(dir), _) => ModelConfig::from_dir(dir)
            .with_context(|| format!("reading the config of {}", dir.display()))?,
        (None, Some(name)) => {
            arcticd_engine::init::preset_config(&arcticd_engine::init::preset(name)?)?
        }
        (None, None) => anyhow::bail!("give --model DIR or --preset NAME"),
    };
    check_plan_tokens(args.tokens, args.sequences, "--sequences")?;
    let placement = match args.placement {
        PlacementArg::Cpu => Placement::Host,
        PlacementArg::Gpu => Placement::Gpu,
    };
    let available = match (args.memory_gb, args.placement) {
        // Past 2^64 bytes the count would saturate, and "fits" would be said
        // of a size no machine has.
        (Some(gb), _) if gb > 0.0 && gb * 1e9 < u64::MAX as f64 => Some((gb * 1e9) as u64),
        (Some(gb), _) => anyhow::bail!(
            "--memory-gb {gb} is not a memory size: a positive number of GB below 1.8e10"
        ),
        (None, PlacementArg::Cpu) => host_memory_available(),
        (None, PlacementArg::Gpu) => {
            anyhow::bail!("--placement gpu needs --memory-gb (141 for an H200)")
        }
    };
    let plan = MemoryPlan::training_on(
        &config,
        PlanShape {
            tokens: args.tokens,
            sequences: args.sequences,
            recompute_layers: args.recompute_layers,
        },
        placement,
    );
    // A plan that does not fit is shown by its error.
    plan.check(
        available,
        "lower --tokens or --sequences, or add --recompute-layers",
    )?;
    outln!("{plan}")?;
    if let Some(a) = available {
        outln!(
            "fits: {:.1} GB of {:.1} GB",
            plan.total() as f64 / 1e9,
            a as f64 / 1e9
        )?;
    }
    Ok(())
}

#[derive(Args)]
pub struct BenchTrainArgs {
    /// Checkpoint directory (a random model of a real shape from `arcticd
    /// init-model` measures that shape).
    #[arg(long)]
    pub model: PathBuf,
    /// Tokens per optimizer step (random ids, cut into sequences of
    /// `--seq-len`).
    #[arg(long, default_value_t = 8192)]
    pub tokens: usize,
    /// Tokens per sequence.
    #[arg(long, default_value_t = 2048)]
    pub seq_len: usize,
    /// Timed steps (after one untimed warm-up step).
    #[arg(long, default_value_t = 3)]
    pub steps: usize,
    /// Tokens per micro-batch; the whole step in one by default.
    #[arg(long, value_parser = crate::at_least_one)]
    pub micro_batch_tokens: Option<usize>,
    /// Keep only each layer's input in the forward, recompute in the backward.
    #[arg(long)]
    pub recompute_layers: bool,
    /// `cpu`, or `cuda:N` in a build with the `cuda` feature (the RL loop's
    /// step there: the engines' copy of the weights written in place too).
    #[arg(long, default_value = "cpu")]
    pub device: arcticd_kernels::Device,
    /// The device's peak in TFLOP/s for the products' precision, to report
    /// model FLOPs utilization (`mfu`); omitted without it.
    #[arg(long, value_parser = crate::positive_number)]
    pub peak_tflops: Option<f64>,
    /// Sequences per group sharing a prompt of `--prompt-len` tokens, the
    /// loss on the rest only, as in RL (the attempts at one task). Above 1,
    /// every step runs twice, side by side: with the shared prompt run once
    /// per group, and with every sequence whole (the baseline).
    #[arg(long, default_value_t = 1, value_parser = crate::at_least_one)]
    pub group_size: usize,
    /// Prompt tokens shared by a group (with `--group-size`).
    #[arg(long, default_value_t = 0)]
    pub prompt_len: usize,
}

/// `arcticd bench-train`: the time of full SFT steps (forward, loss,
/// backward, clipping, AdamW, the write of the weights the engines read)
/// on random sequences; one JSON line with tokens/s, the median step and
/// update times, and the model FLOPs of a step counted as 6 per matrix
/// parameter per token (the output projection included, the attention
/// scores and the recurrence not).
pub fn bench_train(args: BenchTrainArgs) -> Result<()> {
    use rand::{rngs::StdRng, Rng, SeedableRng};
    anyhow::ensure!(
        args.tokens > 0 && args.seq_len > 0 && args.steps > 0,
        "--tokens, --seq-len and --steps must be positive"
    );
    check_plan_tokens(args.tokens, args.tokens.div_ceil(args.seq_len), "--seq-len")?;
    let model_config = ModelConfig::from_dir(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    // A micro-batch holds at most the step.
    let micro = args
        .micro_batch_tokens
        .unwrap_or(args.tokens)
        .clamp(1, args.tokens);
    let seq_len = args.seq_len.min(args.tokens);
    let shape = PlanShape {
        tokens: micro.max(seq_len),
        sequences: args.tokens.div_ceil(seq_len),
        recompute_layers: args.recompute_layers,
    };
    check_plan(
        &model_config,
        shape,
        args.device,
        "lower --micro-batch-tokens or --tokens, or add --recompute-layers",
    )?;
    let model = Qwen3_5::load(&args.model)
        .with_context(|| format!("loading model from {}", args.model.display()))?;
    let matrix_params: usize = model
        .named_params()
        .iter()
        .filter(|(name, t)| t.shape().len() == 2 && !name.ends_with("embed_tokens.weight"))
        .map(|(_, t)| t.numel())
        .sum::<usize>()
        + model.lm_head_weight().numel() * usize::from(model.lm_head.is_none());
    let vocab = model.config.vocab_size as u32;
    let grouped = args.group_size > 1;
    anyhow::ensure!(
        !grouped || (args.prompt_len > 0 && args.prompt_len < seq_len),
        "--group-size needs a --prompt-len of at least 1 and below the sequence length {seq_len}"
    );
    let mut rng = StdRng::seed_from_u64(0);
    let mut left = args.tokens;
    let mut batch = Vec::new();
    let mut prompt = Vec::new();
    while left > 0 {
        let n = seq_len.min(left);
        let mut ex = arcticd_trainer::step::SftExample {
            tokens: (0..n).map(|_| rng.gen_range(0..vocab)).collect(),
            loss_mask: vec![1; n],
        };
        if grouped {
            if batch.len() % args.group_size == 0 {
                prompt = ex.tokens[..args.prompt_len.min(n - 1)].to_vec();
            }
            let p = prompt.len().min(n - 1);
            ex.tokens[..p].copy_from_slice(&prompt[..p]);
            ex.loss_mask[..p].fill(0);
        }
        batch.push(ex);
        left -= n;
    }
    let config = TrainConfig {
        optimizer: AdamWConfig {
            lr: 1e-5,
            ..AdamWConfig::default()
        },
        grad_clip: Some(1.0),
        micro_batch_tokens: micro,
        recompute_layers: args.recompute_layers,
        ..TrainConfig::default()
    };
    // The baseline, every sequence whole, only beside a grouped run.
    let baseline = grouped.then(|| model.clone());
    let trainer_of = |model: Qwen3_5, share_prefixes: bool| -> Result<_> {
        let config = TrainConfig {
            share_prefixes,
            ..config.clone()
        };
        let dev = arcticd_trainer::device::step_device(
            args.device,
            ParamStore::new(model),
            config.optimizer,
            None,
            false,
        )?;
        let mut trainer = Trainer::on(dev, config);
        trainer.sft_step(&batch)?;
        Ok(trainer)
    };
    let mut trainer = trainer_of(model, true)?;
    let mut whole = baseline.map(|m| trainer_of(m, false)).transpose()?;
    let (mut times, mut updates, mut whole_times) = (Vec::new(), Vec::new(), Vec::new());
    let mut tokens_run = 0;
    for i in 0..args.steps {
        let t0 = std::time::Instant::now();
        let m = trainer.sft_step(&batch)?;
        let t = t0.elapsed().as_secs_f64();
        eprintln!(
            "step {}/{}: {t:.3} s, loss {:.4}, update {:.4} s",
            i + 1,
            args.steps,
            m.loss,
            m.update_secs
        );
        times.push(t);
        updates.push(m.update_secs);
        tokens_run = m.tokens_run;
        if let Some(w) = whole.as_mut() {
            let t0 = std::time::Instant::now();
            let m = w.sft_step(&batch)?;
            let t = t0.elapsed().as_secs_f64();
            eprintln!("  every sequence whole: {t:.3} s, loss {:.4}", m.loss);
            whole_times.push(t);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (step_s, update_s) = (median(&mut times), median(&mut updates));
    let tflops = 6.0 * matrix_params as f64 * args.tokens as f64 / step_s / 1e12;
    let mut out = serde_json::json!({
        "device": args.device.to_string(),
        "tokens_per_step": args.tokens,
        "seq_len": seq_len,
        "micro_batch_tokens": micro,
        "recompute_layers": args.recompute_layers,
        "matrix_params": matrix_params,
        "median_step_s": step_s,
        "tokens_per_s": args.tokens as f64 / step_s,
        "median_update_s": update_s,
        "tokens_run": tokens_run,
        "model_tflops": tflops,
    });
    if let Some(peak) = args.peak_tflops {
        out["mfu"] = serde_json::json!(tflops / peak);
    }
    if grouped {
        let whole_s = median(&mut whole_times);
        out["group_size"] = serde_json::json!(args.group_size);
        out["prompt_len"] = serde_json::json!(args.prompt_len);
        out["whole_median_step_s"] = serde_json::json!(whole_s);
        out["whole_tokens_per_s"] = serde_json::json!(args.tokens as f64 / whole_s);
        out["speedup_vs_whole"] = serde_json::json!(whole_s / step_s);
    }
    outln!("{out}")?;
    Ok(())
}
