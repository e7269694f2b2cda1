//! The CPU matrix product (`cpu::sgemm`, AVX-512 or AVX2 + FMA) against the
//! `gemm` crate on the same `nn.Linear` products, side by side: decode
//! (a few rows times a weight, prepacked as the engine holds it, in f32
//! and in bf16) and prefill / training (many rows, B packed per call), at
//! the Qwen3.5-0.8B MLP shape (hidden 1,024, intermediate 3,584) and the
//! demo model's (hidden 128, intermediate 384). Criterion times each; the
//! bench also prints one line per shape with the ratio of the medians,
//! `gemm / sgemm` (above 1: sgemm is faster).
//!
//!     cargo bench -p arcticd-kernels --bench cpu_matmul

use arcticd_kernels::cpu::matmul::{matmul_forward_packed, pack_linear};
use arcticd_kernels::cpu::sgemm::{self, Strided};
use criterion::{BenchmarkId, Criterion, Throughput};
use rand::{rngs::StdRng, Rng, SeedableRng};
use std::time::{Duration, Instant};

/// `out[n, oc] = inp[n, c] @ w[oc, c]^T` by the `gemm` crate in one call.
fn gemm_crate(out: &mut [f32], inp: &[f32], w: &[f32], n: usize, c: usize, oc: usize) {
    // SAFETY: out is [n, oc] row-major, inp [n, c] row-major, w^T read
    // with row stride 1 and column stride c; lengths are the caller's.
    unsafe {
        gemm::gemm(
            n,
            oc,
            c,
            out.as_mut_ptr(),
            1,
            oc as isize,
            false,
            inp.as_ptr(),
            1,
            c as isize,
            w.as_ptr(),
            c as isize,
            1,
            0.0f32,
            1.0f32,
            false,
            false,
            false,
            gemm::Parallelism::Rayon(0),
        )
    }
}

/// Median seconds of `f` over `reps` runs after one warm-up.
fn median(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut t: Vec<f64> = (0..reps)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    t[reps / 2]
}

fn main() {
    if !sgemm::available() {
        eprintln!("cpu_matmul: this CPU has neither AVX-512 nor AVX2 + FMA; nothing to compare");
        return;
    }
    let mut c = Criterion::default()
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(300))
        .sample_size(10)
        .configure_from_args();
    let mut rng = StdRng::seed_from_u64(0);
    let bf = |x: f32| half::bf16::from_f32(x).to_f32();
    // (name, rows, in, out, weights)
    let shapes = [
        ("0.8b-mlp-up decode", 1, 1024, 3584, "f32"),
        ("0.8b-mlp-up decode", 1, 1024, 3584, "bf16"),
        ("0.8b-mlp-up decode", 8, 1024, 3584, "bf16"),
        ("0.8b-mlp-down prefill", 512, 3584, 1024, "f32"),
        ("demo-mlp-up train", 2048, 128, 384, "f32"),
        ("demo-mlp-down train", 2048, 384, 128, "f32"),
    ];
    let mut ratios = Vec::new();
    for (name, n, k, oc, weights) in shapes {
        let inp: Vec<f32> = (0..n * k).map(|_| rng.gen_range(-1.0..1.0)).collect();
        let mut w: Vec<f32> = (0..oc * k).map(|_| rng.gen_range(-0.1..0.1)).collect();
        if weights == "bf16" {
            w.iter_mut().for_each(|x| *x = bf(*x));
        }
        let mut out = vec![0.0f32; n * oc];
        let id = format!("{name} {n}x{k}x{oc} {weights}");
        // Decode holds the weight packed (as the engine does); the rest
        // pack B inside the call (as training does).
        let packed = (n <= 8).then(|| pack_linear(&w, k, oc).unwrap().unwrap());
        let ours = |out: &mut [f32]| match &packed {
            Some(p) => matmul_forward_packed(out, &inp, p, None, n).unwrap(),
            None => {
                let a = Strided {
                    data: &inp,
                    rs: k,
                    cs: 1,
                };
                let b = Strided {
                    data: &w,
                    rs: 1,
                    cs: k,
                };
                sgemm::sgemm(n, oc, k, a, b, out, oc, false, true).unwrap()
            }
        };
        let mut g = c.benchmark_group("linear");
        g.throughput(Throughput::Elements((2 * n * k * oc) as u64));
        g.bench_function(BenchmarkId::new("sgemm", &id), |bch| {
            bch.iter(|| ours(&mut out))
        });
        g.bench_function(BenchmarkId::new("gemm-crate", &id), |bch| {
            bch.iter(|| gemm_crate(&mut out, &inp, &w, n, k, oc))
        });
        g.finish();
        let reps = 21;
        let t_ours = median(reps, || ours(&mut out));
        let t_gemm = median(reps, || gemm_crate(&mut out, &inp, &w, n, k, oc));
        ratios.push((id, t_ours, t_gemm));
    }
    println!("\nlinear products, median of 21 runs (gemm-crate / sgemm: above 1, sgemm is faster)");
    for (id, t_ours, t_gemm) in ratios {
        let gflops = |t: f64| {
            let p: Vec<usize> = id
                .split_whitespace()
                .nth(2)
                .unwrap()
                .split('x')
                .map(|x| x.parse().unwrap())
                .collect();
            2.0 * (p[0] * p[1] * p[2]) as f64 / t / 1e9
        };
        println!(
            "{id:<45} sgemm {:>9.1} us ({:>6.1} GFLOP/s)  gemm-crate {:>9.1} us ({:>6.1} GFLOP/s)  ratio {:.2}",
            t_ours * 1e6,
            gflops(t_ours),
            t_gemm * 1e6,
            gflops(t_gemm),
            t_gemm / t_ours
        );
    }
}
