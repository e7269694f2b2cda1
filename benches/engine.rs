//! Criterion benchmarks of the engine on the `small` preset: decode
//! throughput (generated tokens/s) at 1, 8 and 32 concurrent sequences, and
//! time to first token of a 1,024-token prompt cold and on a prefix-cache
//! hit.
//! `tests/ref/bench_engine.py` compares the same workload with transformers.

use arcticd_engine::engine::{self, Choice, EngineConfig, EngineHandle, Request};
use arcticd_engine::sampler::SamplingParams;
use arcticd_engine::{ParamStore, Qwen3_5};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
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

criterion_group!(benches, bench_decode, bench_ttft);
criterion_main!(benches);
