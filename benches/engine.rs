//! Criterion benchmarks of the engine on the `small` preset: decode
//! throughput (generated tokens/s) at 1, 8 and 32 concurrent sequences, and
//! time to first token of a 1,024-token prompt cold and on a prefix-cache
//! hit, and 16 requests through a cache that holds only four of them whole,
//! at once against one by one (preemption's cost: at once should not lose).
//! `tests/ref/bench_engine.py` compares the same workload with transformers.

use arcticd_engine::engine::{self, Choice, EngineConfig, EngineHandle, Request};
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{ParamStore, Qwen3_5};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

const NEW_TOKENS: usize = 32;

fn small_store() -> std::sync::Arc<ParamStore> {
    let dir = std::env::temp_dir().join(format!("arcticd-bench-engine-{}", std::process::id()));
    arcticd_engine::init::init_model(arcticd_engine::init::SMALL, &dir, 0).unwrap();
    ParamStore::new(Qwen3_5::load(&dir).unwrap())
}

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ salt.wrapping_mul(40_503)) % 4000 + 10)
        .collect()
}

fn request(prompt: Vec<u32>, max_tokens: usize) -> Request {
    Request {
        prompt,
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
    }
}

/// Submit `reqs` at once and wait for all; returns the wall time.
fn run(eng: &EngineHandle, reqs: Vec<Request>) -> Duration {
    let t0 = Instant::now();
    let subs: Vec<_> = reqs.into_iter().map(|r| eng.submit(r).unwrap()).collect();
    for mut s in subs {
        let mut ch = vec![Choice::default()];
        while engine::apply_event(&mut ch, s.events.blocking_recv().unwrap()).unwrap() == 0 {}
    }
    t0.elapsed()
}

fn bench_decode(c: &mut Criterion) {
    let store = small_store();
    let mut g = c.benchmark_group("engine_decode_small");
    g.sample_size(10);
    {
        let eng = engine::start(
            store.clone(),
            None,
            EngineConfig {
                max_model_len: 4096,
                ..Default::default()
            },
        )
        .unwrap();
        for conc in [1usize, 8, 32] {
            g.throughput(Throughput::Elements((conc * NEW_TOKENS) as u64));
            g.bench_function(BenchmarkId::new("sequences", conc), |b| {
                let mut salt = 0;
                b.iter_custom(|iters| {
                    let mut total = Duration::ZERO;
                    for _ in 0..iters {
                        salt += 1;
                        let reqs = (0..conc)
                            .map(|i| request(prompt(16, salt * 100 + i as u32), NEW_TOKENS))
                            .collect();
                        total += run(&eng, reqs);
                    }
                    total
                })
            });
        }
        eng.shutdown();
    }
    g.finish();
}

fn bench_ttft(c: &mut Criterion) {
    let store = small_store();
    let eng = engine::start(
        store,
        None,
        EngineConfig {
            max_model_len: 4096,
            ..Default::default()
        },
    )
    .unwrap();
    let mut g = c.benchmark_group("engine_ttft_small_1k_prompt");
    g.sample_size(10);
    let mut salt = 1000;
    g.bench_function("cold", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                salt += 1;
                total += run(&eng, vec![request(prompt(1024, salt), 1)]);
            }
            total
        })
    });
    let warm = prompt(1024, 7);
    run(&eng, vec![request(warm.clone(), 1)]);
    g.bench_function("prefix_hit", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                total += run(&eng, vec![request(warm.clone(), 1)]);
            }
            total
        })
    });
    g.finish();
    eng.shutdown();
}

/// 16 requests of 64 prompt and 64 new tokens, with state slots for all of
/// them but blocks for four whole: submitted at once (the scheduler admits,
/// grows and preempts) against one by one (never preempted), the baseline.
fn bench_tight_cache(c: &mut Criterion) {
    const REQUESTS: usize = 16;
    let store = small_store();
    let layout = arcticd_engine::kv_cache::CacheLayout::new(&store.read().config);
    let config = EngineConfig {
        max_model_len: 4096,
        max_num_seqs: REQUESTS,
        prefix_snapshots: 2,
        enable_prefix_cache: false,
        block_size: 16,
        cache_memory: layout.slot_bytes() * (REQUESTS + 2) + layout.block_bytes(16) * 4 * 8,
        ..Default::default()
    };
    let eng = engine::start(store, None, config).unwrap();
    let mut g = c.benchmark_group("engine_tight_cache_small_16x128");
    g.sample_size(10);
    g.throughput(Throughput::Elements((REQUESTS * 64) as u64));
    let mut salt = 5000;
    let mut batch = || {
        salt += 1;
        (0..REQUESTS)
            .map(|i| request(prompt(64, salt * 100 + i as u32), 64))
            .collect::<Vec<_>>()
    };
    let preemptions = || eng.metrics().preemptions.load(Ordering::Relaxed);
    let recomputed = || eng.metrics().recomputed_tokens.load(Ordering::Relaxed);
    let (mut runs, before) = (0u64, preemptions());
    g.bench_function("one_by_one", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                for r in batch() {
                    total += run(&eng, vec![r]);
                }
            }
            total
        })
    });
    let alone = preemptions() - before;
    let (before, recomputed_before) = (preemptions(), recomputed());
    g.bench_function("at_once", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                runs += 1;
                total += run(&eng, batch());
            }
            total
        })
    });
    g.finish();
    let requests = (runs.max(1) * REQUESTS as u64) as f64;
    eprintln!(
        "engine_tight_cache: preemptions one by one {alone}, at once {:.2} per request \
         ({:.0} tokens prefilled again per request)",
        (preemptions() - before) as f64 / requests,
        (recomputed() - recomputed_before) as f64 / requests,
    );
    eng.shutdown();
}

criterion_group!(benches, bench_decode, bench_ttft, bench_tight_cache);
criterion_main!(benches);
