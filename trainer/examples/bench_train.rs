//! Training-step throughput: forward + backward + AdamW on a packed batch
//! (default the `small` preset, 8 x 512 tokens, every position a target),
//! printed as JSON `{"tokens_per_s": ..., "phases": {...}}`. With
//! `--torch PYTHON` it also runs tests/ref/bench_train.py (PyTorch autograd
//! through transformers, same model, batch and thread count) and prints the
//! ratio.
//!
//!     cargo run --release -p arcticd-trainer --example bench_train -- [--model DIR]
//!         [--batch 8] [--seq-len 512] [--iters 3] [--torch PYTHON]

use arcticd_engine::init::{init_model, preset};
use arcticd_engine::{ParamStore, Qwen3_5};
use arcticd_trainer::model::{self, Packed};
use arcticd_trainer::optim::AdamWConfig;
use arcticd_trainer::step::{SftExample, TrainConfig, Trainer};
use arcticd_trainer::ModelGrads;
use std::path::PathBuf;
use std::time::Instant;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    arcticd_kernels::host::retain_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let batch: usize = arg(&args, "--batch").map_or(Ok(8), |s| s.parse())?;
    let seq_len: usize = arg(&args, "--seq-len").map_or(Ok(512), |s| s.parse())?;
    let iters: usize = arg(&args, "--iters").map_or(Ok(3), |s| s.parse())?;
    let dir = match arg(&args, "--model") {
        Some(d) => PathBuf::from(d),
        None => {
            let d =
                std::env::temp_dir().join(format!("arcticd-bench-train-{}", std::process::id()));
            init_model(preset("small")?, &d, 0)?;
            d
        }
    };
    let m = Qwen3_5::load(&dir)?;
    let vocab = m.config.vocab_size as u64;
    // Deterministic pseudo-random ids (an LCG; no dependency on rand).
    let mut x = 0x2545F4914F6CDD1Du64;
    let data: Vec<SftExample> = (0..batch)
        .map(|_| {
            let tokens = (0..seq_len)
                .map(|_| {
                    x = x
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    ((x >> 33) % vocab) as u32
                })
                .collect();
            SftExample {
                tokens,
                loss_mask: vec![1; seq_len],
            }
        })
        .collect();

    // Phase timings on one pass (forward, head, backward).
    let seqs: Vec<Vec<u32>> = data.iter().map(|e| e.tokens.clone()).collect();
    let packed = Packed::new(&seqs, m.config.vocab_size)?;
    let t0 = Instant::now();
    let acts = model::forward(&m, packed)?;
    let t_fwd = t0.elapsed().as_secs_f64();
    let (mut rows, mut targets) = (Vec::new(), Vec::new());
    for (seq, &(start, _)) in seqs.iter().zip(&acts.packed.spans) {
        for (t, &tok) in seq.iter().enumerate().skip(1) {
            rows.push(start + t - 1);
            targets.push(tok);
        }
    }
    let t0 = Instant::now();
    let lp = model::token_logprobs(&m, &acts.hidden, &rows, &targets)?;
    let mut grads = ModelGrads::zeros_like(&m);
    let dlp = vec![-1.0 / lp.len() as f32; lp.len()];
    let dh = model::token_logprobs_backward(&m, &mut grads, &acts.hidden, &rows, &targets, &dlp)?;
    let t_head = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    model::backward(&m, &acts, &dh, &mut grads)?;
    let t_bwd = t0.elapsed().as_secs_f64();
    drop(acts);

    let config = TrainConfig {
        optimizer: AdamWConfig {
            lr: 1e-4,
            ..AdamWConfig::default()
        },
        micro_batch_tokens: batch * seq_len,
        ..TrainConfig::default()
    };
    let mut tr = Trainer::new(ParamStore::new(m), config)?;
    tr.sft_step(&data)?; // warm-up
    let mut times = Vec::new();
    for _ in 0..iters {
        let t0 = Instant::now();
        tr.sft_step(&data)?;
        times.push(t0.elapsed().as_secs_f64());
    }
    times.sort_by(f64::total_cmp);
    let median = times[times.len() / 2];
    let tps = (batch * seq_len) as f64 / median;
    let threads = rayon::current_num_threads();
    let mut report = serde_json::json!({
        "impl": "arcticd",
        "batch": batch,
        "seq_len": seq_len,
        "threads": threads,
        "step_s": median,
        "tokens_per_s": tps,
        "phases_s": {"forward": t_fwd, "lm_head_fwd_bwd": t_head, "backward": t_bwd},
    });
    if let Some(py) = arg(&args, "--torch") {
        let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/ref/bench_train.py");
        let out = std::process::Command::new(py)
            .arg(script)
            .args(["--model", dir.to_str().unwrap_or_default()])
            .args([
                "--batch",
                &batch.to_string(),
                "--seq-len",
                &seq_len.to_string(),
            ])
            .args([
                "--iters",
                &iters.to_string(),
                "--threads",
                &threads.to_string(),
            ])
            .output()?;
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned().into());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        let torch: serde_json::Value = serde_json::from_str(text.lines().last().unwrap_or("{}"))?;
        let ttps = torch["tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        report["torch_tokens_per_s"] = ttps.into();
        report["ratio_vs_torch"] = (tps / ttps).into();
    }
    println!("{report}");
    if arg(&args, "--model").is_none() {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(())
}
