//! Criterion benchmarks of the CPU kernels at Qwen3.5-like shapes (scaled to
//! what a 2-core CI machine runs in seconds): matmul, RMSNorm, the gated delta
//! rule in both forms, and causal GQA attention. Throughput is in elements
//! (tokens for the sequence kernels) so regressions read as rates.

use arcticd_kernels::cpu::{
    attention::{attention_forward, AttnDims},
    gated_delta::{
        gated_delta_backward_from_checkpoints, gated_delta_chunked_backward_from_checkpoints,
        gated_delta_chunked_forward, gated_delta_recurrent_forward,
        gated_delta_recurrent_forward_checkpointed, GatedDeltaDims, CHECKPOINT_EVERY,
    },
    matmul::matmul_forward,
    rmsnorm::rmsnorm_forward,
};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn rand_vec(n: usize, rng: &mut StdRng) -> Vec<f32> {
    (0..n).map(|_| rng.gen_range(-1.0..1.0)).collect()
}

fn bench_matmul(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(0);
    let mut g = c.benchmark_group("matmul");
    for &(n, k, m) in &[(512, 256, 512), (1024, 1024, 1024)] {
        let a = rand_vec(n * k, &mut rng);
        let w = rand_vec(m * k, &mut rng);
        let mut out = vec![0.0; n * m];
        g.throughput(Throughput::Elements((2 * n * k * m) as u64));
        g.bench_function(BenchmarkId::from_parameter(format!("{n}x{k}x{m}")), |b| {
            b.iter(|| matmul_forward(&mut out, &a, &w, None, n, k, m).unwrap())
        });
    }
    g.finish();
}

fn bench_rmsnorm(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(1);
    let (n, d) = (4096, 1024);
    let x = rand_vec(n * d, &mut rng);
    let w = rand_vec(d, &mut rng);
    let mut out = vec![0.0; n * d];
    let mut rstd = vec![0.0; n];
    let mut g = c.benchmark_group("rmsnorm");
    g.throughput(Throughput::Elements((n * d) as u64));
    g.bench_function("4096x1024", |b| {
        b.iter(|| rmsnorm_forward(&mut out, &mut rstd, &x, &w, n, d, 1e-6).unwrap())
    });
    g.finish();
}

fn bench_gated_delta(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(2);
    let dims = GatedDeltaDims {
        t: 512,
        nk: 2,
        nv: 4,
        dk: 64,
        dv: 64,
    };
    let unit = |v: Vec<f32>, d: usize| -> Vec<f32> {
        v.chunks(d)
            .flat_map(|r| {
                let n = r.iter().map(|x| x * x).sum::<f32>().sqrt();
                r.iter().map(move |x| x / n).collect::<Vec<_>>()
            })
            .collect()
    };
    let q = unit(rand_vec(dims.t * dims.nk * dims.dk, &mut rng), dims.dk);
    let k = unit(rand_vec(dims.t * dims.nk * dims.dk, &mut rng), dims.dk);
    let v = rand_vec(dims.t * dims.nv * dims.dv, &mut rng);
    let gate: Vec<f32> = (0..dims.t * dims.nv)
        .map(|_| rng.gen_range(-2.0..-0.01))
        .collect();
    let beta: Vec<f32> = (0..dims.t * dims.nv)
        .map(|_| rng.gen_range(0.0..1.0))
        .collect();
    let mut out = vec![0.0; dims.t * dims.nv * dims.dv];
    let mut state = vec![0.0; dims.nv * dims.dk * dims.dv];
    let mut g = c.benchmark_group("gated_delta");
    g.throughput(Throughput::Elements(dims.t as u64));
    g.bench_function("recurrent_t512_h4_d64", |b| {
        b.iter(|| {
            state.fill(0.0);
            gated_delta_recurrent_forward(&mut out, &mut state, &q, &k, &v, &gate, &beta, dims)
                .unwrap()
        })
    });
    g.bench_function("chunked64_t512_h4_d64", |b| {
        b.iter(|| {
            state.fill(0.0);
            gated_delta_chunked_forward(&mut out, &mut state, &q, &k, &v, &gate, &beta, dims, 64)
                .unwrap()
        })
    });
    g.finish();

    // The two backwards from the same checkpoints, at the demo's head width
    // (32), this group's (64) and the real models' (128): the ratio of
    // each pair is the chunked form's gain on a CPU.
    let mut g = c.benchmark_group("gated_delta_backward");
    g.throughput(Throughput::Elements(dims.t as u64));
    for width in [32, 64, 128] {
        let dims = GatedDeltaDims {
            dk: width,
            dv: width,
            ..dims
        };
        let q = unit(rand_vec(dims.t * dims.nk * width, &mut rng), width);
        let k = unit(rand_vec(dims.t * dims.nk * width, &mut rng), width);
        let v = rand_vec(dims.t * dims.nv * width, &mut rng);
        let dout = rand_vec(dims.t * dims.nv * width, &mut rng);
        let sn = dims.nv * width * width;
        let mut cps = vec![0.0; dims.t.div_ceil(CHECKPOINT_EVERY) * sn];
        let mut out = vec![0.0; dims.t * dims.nv * width];
        let mut state = vec![0.0; sn];
        gated_delta_recurrent_forward_checkpointed(
            &mut out, &mut state, &q, &k, &v, &gate, &beta, dims, &mut cps,
        )
        .unwrap();
        let (mut dq, mut dk) = (vec![0.0; q.len()], vec![0.0; q.len()]);
        let mut dv = vec![0.0; v.len()];
        let (mut dg, mut db) = (vec![0.0; gate.len()], vec![0.0; gate.len()]);
        for (name, f) in [
            (
                "recurrent",
                gated_delta_backward_from_checkpoints as BackwardFn,
            ),
            ("chunked", gated_delta_chunked_backward_from_checkpoints),
        ] {
            g.bench_function(format!("{name}_t512_h4_d{width}"), |b| {
                b.iter(|| {
                    f(
                        &mut dq, &mut dk, &mut dv, &mut dg, &mut db, None, None, &dout, &cps, &q,
                        &k, &v, &gate, &beta, dims,
                    )
                    .unwrap()
                })
            });
        }
    }
    g.finish();
}

/// The signature both gated-delta backwards share.
type BackwardFn = fn(
    &mut [f32],
    &mut [f32],
    &mut [f32],
    &mut [f32],
    &mut [f32],
    Option<&mut [f32]>,
    Option<&[f32]>,
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    &[f32],
    GatedDeltaDims,
) -> arcticd_kernels::Result<()>;

fn bench_attention(c: &mut Criterion) {
    let mut rng = StdRng::seed_from_u64(3);
    let d = AttnDims {
        nq: 512,
        nk: 512,
        n_heads: 8,
        n_kv_heads: 2,
        head_dim: 64,
    };
    let q = rand_vec(d.nq * d.n_heads * d.head_dim, &mut rng);
    let k = rand_vec(d.nk * d.n_kv_heads * d.head_dim, &mut rng);
    let v = rand_vec(d.nk * d.n_kv_heads * d.head_dim, &mut rng);
    let mut out = vec![0.0; q.len()];
    let mut g = c.benchmark_group("attention");
    g.throughput(Throughput::Elements(d.nq as u64));
    g.bench_function("causal_gqa_t512_h8_kv2_d64", |b| {
        b.iter(|| attention_forward(&mut out, &q, &k, &v, d, 0.125).unwrap())
    });
    g.finish();
}

criterion_group!(
    name = benches;
    config = Criterion::default().sample_size(10).warm_up_time(std::time::Duration::from_millis(500)).measurement_time(std::time::Duration::from_secs(2));
    targets = bench_matmul, bench_rmsnorm, bench_gated_delta, bench_attention
);
criterion_main!(benches);
