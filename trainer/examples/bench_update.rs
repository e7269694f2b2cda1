//! Weight update plus cache rebuild with sequences in flight: the latency a
//! running rollout sees when the optimizer writes the weights (docs/
//! ARCHITECTURE.md, recipe step 7). `--seqs` requests (default 32) decode
//! on one engine; once every one of them has produced tokens, the trainer
//! pauses the engine, writes the weights in place (an AdamW write of the
//! model's own masters) and resumes; the engine then recomputes every
//! in-flight sequence's KV and recurrent state from its token ids before
//! its next token. Printed as JSON: the pause + write + resume time, the
//! gap until every sequence has its next token, and, as the named
//! baseline, the gap between two tokens of the same sequences without an
//! update (ratio = update gap / baseline gap).
//!
//!     cargo run --release -p arcticd-trainer --example bench_update -- [--model DIR]
//!         [--seqs 32] [--prompt 512] [--repeats 5]

use arcticd_engine::engine::{EngineConfig, Event, Request};
use arcticd_engine::init::{init_model, preset};
use arcticd_engine::router::Router;
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{ParamStore, Qwen3_5};
use arcticd_trainer::optim::{AdamW, AdamWConfig};
use std::path::PathBuf;
use std::time::Instant;
use tokio::sync::mpsc::UnboundedReceiver;

fn arg(args: &[String], name: &str) -> Option<String> {
    args.iter()
        .position(|a| a == name)
        .and_then(|i| args.get(i + 1).cloned())
}

/// Waits until every receiver has delivered one more token; seconds taken.
fn next_token_of_all(subs: &mut [UnboundedReceiver<Event>]) -> f64 {
    let t0 = Instant::now();
    for rx in subs.iter_mut() {
        match rx.blocking_recv() {
            Some(Event::Token(_)) => {}
            Some(_) | None => panic!("a sequence ended during the benchmark"),
        }
    }
    t0.elapsed().as_secs_f64()
}

fn drain(subs: &mut [UnboundedReceiver<Event>]) {
    for rx in subs.iter_mut() {
        while rx.try_recv().is_ok() {}
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    arcticd_kernels::host::retain_freed_memory();
    let args: Vec<String> = std::env::args().collect();
    let seqs: usize = arg(&args, "--seqs").map_or(Ok(32), |s| s.parse())?;
    let prompt: usize = arg(&args, "--prompt").map_or(Ok(512), |s| s.parse())?;
    let repeats: usize = arg(&args, "--repeats").map_or(Ok(5), |s| s.parse())?;
    let dir = match arg(&args, "--model") {
        Some(d) => PathBuf::from(d),
        None => {
            let d =
                std::env::temp_dir().join(format!("arcticd-bench-update-{}", std::process::id()));
            init_model(preset("small")?, &d, 0)?;
            d
        }
    };
    let m = Qwen3_5::load(&dir)?;
    let vocab = m.config.vocab_size as u32;
    let opt = AdamW::new(&m, AdamWConfig::default())?;
    let store = ParamStore::new(m);
    let router = Router::start(
        1,
        store.clone(),
        None,
        EngineConfig {
            cache_memory: 512 << 20,
            max_num_seqs: seqs.max(1),
            max_batched_tokens: 4096.max(seqs + 64),
            enable_prefix_cache: false,
            ..EngineConfig::default()
        },
    )?;
    let mut subs = Vec::new();
    for s in 0..seqs {
        let ids: Vec<u32> = (0..prompt)
            .map(|i| ((s * 7919 + i * 104_729) as u32) % vocab)
            .collect();
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(s as u64),
            max_tokens: 20_000,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        let (_, sub) = router.submit(Request {
            prompt: ids,
            params,
        })?;
        subs.push(sub.events);
    }
    // Every sequence prefilled and decoding.
    next_token_of_all(&mut subs);
    let (mut base, mut write, mut gap) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..repeats {
        drain(&mut subs);
        next_token_of_all(&mut subs);
        base.push(next_token_of_all(&mut subs));
        let t0 = Instant::now();
        router.pause()?;
        // Paused: no token comes until the resume; the ones before go.
        drain(&mut subs);
        let (_, r) = store.update(|m| opt.write_to(m));
        r?;
        router.resume();
        write.push(t0.elapsed().as_secs_f64());
        gap.push(t0.elapsed().as_secs_f64() + next_token_of_all(&mut subs));
    }
    router.shutdown();
    let (b, w, g) = (median(base), median(write), median(gap));
    println!(
        "{}",
        serde_json::json!({
            "sequences": seqs,
            "prompt_tokens": prompt,
            "repeats": repeats,
            "pause_write_resume_s": w,
            "update_to_next_token_of_all_s": g,
            "baseline_next_token_of_all_s": b,
            "ratio_update_vs_baseline": g / b,
        })
    );
    Ok(())
}
