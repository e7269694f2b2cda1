//! Criterion benchmarks of the CUDA kernels at the real Qwen3.5-0.8B shapes
//! (hidden 1024, intermediate 3,584, 16 linear heads of 128, conv channels
//! 6,144, vocab 248,320), 8,192 tokens per step for the training ops.
//! Throughput is the bytes each kernel must move at least, so a result
//! reads as a fraction of the GPU's memory bandwidth; every benchmark also
//! prints `bytes GROUP/NAME/ID N` on stderr, which `scripts/gpu-check.sh`
//! joins with criterion's times into one JSON against the H200's 4.8 TB/s.
//! The cuBLAS products are timed at decode shapes (batch 1 and 32), where
//! reading the bf16 weight is the floor. Full attention (8 heads over 2 KV
//! heads of 256) is bound by arithmetic, not memory, at 8,192 tokens: its
//! benchmarks also print `flops GROUP/NAME/ID N` (the causal half of the
//! score and value products, and for the backward the 2.5x of it that
//! FlashAttention counts), which the script turns into TFLOP/s.
//!
//! Needs the `cuda` feature and a GPU; without one it says so and exits.
//!
//!     cargo bench -p arcticd-kernels --features cuda --bench cuda

use arcticd_kernels::cpu::adamw::AdamWStep;
use arcticd_kernels::cuda::device::{CudaDevice, Mat, MatMut};
use criterion::{measurement::WallTime, BenchmarkGroup, BenchmarkId, Criterion, Throughput};
use cudarc::driver::CudaSlice;
use rand::{rngs::StdRng, Rng, SeedableRng};

const T: usize = 8192;
const HIDDEN: usize = 1024;
const INTER: usize = 3584;
const NV: usize = 16;
const DK: usize = 128;
const CONV: usize = 6144;
const VOCAB: usize = 248_320;

fn buf(d: &CudaDevice, rng: &mut StdRng, n: usize, scale: f32) -> CudaSlice<f32> {
    let v: Vec<f32> = (0..n).map(|_| rng.gen_range(-scale..scale)).collect();
    d.upload(&v).expect("upload")
}

/// One benchmark of `op` (then a device synchronize, so each sample is the
/// kernels' time) moving `bytes`.
fn bench(
    g: &mut BenchmarkGroup<'_, WallTime>,
    d: &CudaDevice,
    (group, name, id): (&str, &str, &str),
    bytes: usize,
    mut op: impl FnMut(),
) {
    eprintln!("bytes {group}/{name}/{id} {bytes}");
    g.throughput(Throughput::Bytes(bytes as u64));
    g.bench_function(BenchmarkId::new(name, id), |b| {
        b.iter(|| {
            op();
            d.synchronize().expect("synchronize");
        })
    });
}

fn norms(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_norm";
    let mut g = c.benchmark_group(G);
    let n = T * HIDDEN;
    let (x, w, dy) = (
        buf(d, rng, n, 1.0),
        buf(d, rng, HIDDEN, 0.5),
        buf(d, rng, n, 1.0),
    );
    let (mut y, mut r) = (d.zeros(n).unwrap(), d.zeros(T).unwrap());
    let (mut dx, mut dw) = (d.zeros(n).unwrap(), d.zeros(HIDDEN).unwrap());
    bench(
        &mut g,
        d,
        (G, "rmsnorm_forward", "8192x1024"),
        2 * n * 4,
        || {
            d.rmsnorm_forward(&mut y, &mut r, &x, &w, T, HIDDEN, 1e-6)
                .unwrap()
        },
    );
    // Reads dout and inp twice (the row pass and the weight sums), adds
    // into dinp.
    bench(
        &mut g,
        d,
        (G, "rmsnorm_backward", "8192x1024"),
        6 * n * 4,
        || {
            d.rmsnorm_backward(&mut dx, &mut dw, &dy, &x, &w, &r, T, HIDDEN)
                .unwrap()
        },
    );
    g.finish();
}

fn elementwise(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_elementwise";
    let mut g = c.benchmark_group(G);
    let n = T * INTER;
    let (gate, up, dy) = (
        buf(d, rng, n, 4.0),
        buf(d, rng, n, 1.0),
        buf(d, rng, n, 1.0),
    );
    let (mut out, mut dg, mut du) = (
        d.zeros(n).unwrap(),
        d.zeros(n).unwrap(),
        d.zeros(n).unwrap(),
    );
    bench(
        &mut g,
        d,
        (G, "silu_mul_forward", "8192x3584"),
        3 * n * 4,
        || d.silu_mul_forward(&mut out, &gate, &up).unwrap(),
    );
    bench(
        &mut g,
        d,
        (G, "silu_mul_backward", "8192x3584"),
        5 * n * 4,
        || {
            d.silu_mul_backward(&mut dg, &mut du, &dy, &gate, &up)
                .unwrap()
        },
    );
    g.finish();
}

fn linear_attention(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_linear_attention";
    let mut g = c.benchmark_group(G);
    let (k, n) = (4, T * CONV);
    let (x, w, dy) = (
        buf(d, rng, n, 1.0),
        buf(d, rng, CONV * k, 0.5),
        buf(d, rng, n, 1.0),
    );
    let state0 = d.zeros((k - 1) * CONV).unwrap();
    let mut state = d.zeros((k - 1) * CONV).unwrap();
    let (mut out, mut dx, mut dw) = (
        d.zeros(n).unwrap(),
        d.zeros(n).unwrap(),
        d.zeros(CONV * k).unwrap(),
    );
    bench(
        &mut g,
        d,
        (G, "conv1d_forward", "8192x6144"),
        2 * n * 4,
        || {
            d.conv1d_forward(&mut out, &mut state, &x, &w, T, CONV, k)
                .unwrap()
        },
    );
    bench(
        &mut g,
        d,
        (G, "conv1d_backward", "8192x6144"),
        4 * n * 4,
        || {
            d.conv1d_backward(&mut dx, &mut dw, None, &dy, &state0, &x, &w, T, CONV, k)
                .unwrap()
        },
    );
    let m = T * NV;
    let (a, bb) = (buf(d, rng, m, 3.0), buf(d, rng, m, 3.0));
    let (a_log, dt_bias) = (buf(d, rng, NV, 1.0), buf(d, rng, NV, 1.0));
    let (mut gg, mut beta) = (d.zeros(m).unwrap(), d.zeros(m).unwrap());
    let (dg, dbeta) = (buf(d, rng, m, 1.0), buf(d, rng, m, 1.0));
    let (mut da, mut db) = (d.zeros(m).unwrap(), d.zeros(m).unwrap());
    let (mut dal, mut ddt) = (d.zeros(NV).unwrap(), d.zeros(NV).unwrap());
    d.gated_delta_gating_forward(&mut gg, &mut beta, &a, &bb, &a_log, &dt_bias, NV)
        .unwrap();
    bench(
        &mut g,
        d,
        (G, "gating_backward", "8192x16"),
        8 * m * 4,
        || {
            d.gated_delta_gating_backward(
                &mut da, &mut db, &mut dal, &mut ddt, &dg, &dbeta, &gg, &beta, &a, &a_log, &dt_bias,
            )
            .unwrap()
        },
    );
    // One decode step of the recurrence at batch 32: the fp32 state
    // ([32, 16, 128, 128]) is read and written once.
    let seqs = 32;
    let mut st = d.zeros(seqs * NV * DK * DK).unwrap();
    let slots: Vec<u32> = (0..seqs as u32).collect();
    let slots = d.upload(&slots).unwrap();
    let (q, kk, v) = (
        buf(d, rng, seqs * NV * DK, 0.1),
        buf(d, rng, seqs * NV * DK, 0.1),
        buf(d, rng, seqs * NV * DK, 1.0),
    );
    let (gd, bd) = (buf(d, rng, seqs * NV, 0.1), buf(d, rng, seqs * NV, 0.5));
    let mut o = d.zeros(seqs * NV * DK).unwrap();
    let state_bytes = 2 * seqs * NV * DK * DK * 4;
    bench(
        &mut g,
        d,
        (G, "gated_delta_decode", "32x16x128x128"),
        state_bytes,
        || {
            d.gated_delta_decode(
                &mut o,
                &mut st,
                &q,
                &kk,
                &v,
                &gd,
                &bd,
                &slots,
                (NV, NV, DK, DK),
            )
            .unwrap()
        },
    );
    // Prefill of one 8,192-token sequence, in both forms: token by token
    // (one block per value head walks every token) and chunked (every
    // chunk's state-free work at once, then a scan over 128 chunks); the
    // same bytes, so the two times are the ratio.
    let tv = T * NV * DK;
    let (q, kk, v) = (
        buf(d, rng, tv, 0.1),
        buf(d, rng, tv, 0.1),
        buf(d, rng, tv, 1.0),
    );
    let decay: Vec<f32> = (0..T * NV).map(|_| -rng.gen_range(0.0..0.2f32)).collect();
    let (gp, bp) = (d.upload(&decay).unwrap(), buf(d, rng, T * NV, 0.5));
    let mut st = d.zeros(NV * DK * DK).unwrap();
    let slot0 = d.upload(&[0u32]).unwrap();
    let mut o = d.zeros(tv).unwrap();
    let cu = [0u32, T as u32];
    for (name, chunked) in [
        ("gated_delta_prefill_recurrent", false),
        ("gated_delta_prefill_chunked", true),
    ] {
        bench(&mut g, d, (G, name, "8192x16x128x128"), 4 * tv * 4, || {
            d.gated_delta_prefill(
                &mut o,
                &mut st,
                &q,
                &kk,
                &v,
                &gp,
                &bp,
                &slot0,
                &cu,
                (NV, NV, DK, DK),
                chunked,
            )
            .unwrap()
        });
    }
    // The recurrence's backward over 2,048 tokens (one block per value
    // head, by re-computation): what it must read and write at least.
    let t = 2048;
    let dims = arcticd_kernels::cpu::gated_delta::GatedDeltaDims {
        t,
        nk: NV,
        nv: NV,
        dk: DK,
        dv: DK,
    };
    let tv = t * NV * DK;
    let (q, kk, v, dout) = (
        buf(d, rng, tv, 0.1),
        buf(d, rng, tv, 0.1),
        buf(d, rng, tv, 1.0),
        buf(d, rng, tv, 1.0),
    );
    let (gt, bt) = (buf(d, rng, t * NV, 0.1), buf(d, rng, t * NV, 0.5));
    let s0 = d.zeros(NV * DK * DK).unwrap();
    let (mut dq, mut dkk, mut dvv) = (
        d.zeros(tv).unwrap(),
        d.zeros(tv).unwrap(),
        d.zeros(tv).unwrap(),
    );
    let (mut dgg, mut dbb) = (d.zeros(t * NV).unwrap(), d.zeros(t * NV).unwrap());
    let io = (7 * tv + 4 * t * NV) * 4;
    bench(
        &mut g,
        d,
        (G, "gated_delta_backward", "2048x16x128x128"),
        io,
        || {
            d.gated_delta_backward(
                &mut dq, &mut dkk, &mut dvv, &mut dgg, &mut dbb, None, &dout, &s0, &q, &kk, &v,
                &gt, &bt, dims,
            )
            .unwrap()
        },
    );
    // The same gradient in the chunked form (the trainer's): the pair's
    // times give its ratio over the recurrent baseline.
    let cu = [0, t as u32];
    bench(
        &mut g,
        d,
        (G, "gated_delta_chunked_backward", "2048x16x128x128"),
        io,
        || {
            d.gated_delta_chunked_backward(
                &mut dq,
                &mut dkk,
                &mut dvv,
                &mut dgg,
                &mut dbb,
                &dout,
                None,
                &q,
                &kk,
                &v,
                &gt,
                &bt,
                &cu,
                (NV, NV, DK, DK),
            )
            .unwrap()
        },
    );
    g.finish();
}

/// Causal GQA attention at the 0.8B shape: fresh prefill of one 8,192-token
/// sequence; 512 new tokens after a cached past of 7,680 (the paged
/// prefill); a decode step of 1 and of 32 sequences over 8,192 keys each; the
/// backward of the 8,192-token prefill.
fn full_attention(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_attention";
    let mut g = c.benchmark_group(G);
    let (nh, nkv, hd) = (8, 2, 256);
    let scale = (hd as f32).powf(-0.5);
    let (qrow, kvrow) = (nh * hd, nkv * hd);
    let (q, k, v) = (
        buf(d, rng, T * qrow, 1.0),
        buf(d, rng, T * kvrow, 1.0),
        buf(d, rng, T * kvrow, 1.0),
    );
    let mut out = d.zeros(T * qrow).unwrap();
    // Score and value products over the causal half: 2 * 2 * T^2 / 2 * hd
    // per head.
    let causal = |nq: usize, nk: usize| 2 * nh * hd * (nq * nk - nq * nq.saturating_sub(1) / 2);
    let io = |rows: usize| rows * (2 * qrow + 2 * kvrow) * 4;
    let id = format!("{T}x{nh}/{nkv}x{hd}");
    eprintln!("flops {G}/varlen_prefill/{id} {}", 2 * causal(T, T));
    bench(&mut g, d, (G, "varlen_prefill", &id), io(T), || {
        d.varlen_attention_prefill(&mut out, &q, &k, &v, &[0, T as u32], (nh, nkv, hd), scale)
            .unwrap()
    });
    // The same keys in a pool of blocks of 16, the table in order.
    let bs = 16;
    let table: Vec<u32> = (0..(T / bs) as u32).collect();
    let (new, past) = (512, T - 512);
    let qn = buf(d, rng, new * qrow, 1.0);
    let mut on = d.zeros(new * qrow).unwrap();
    let pid = format!("{new}after{past}x{nh}/{nkv}x{hd}");
    eprintln!("flops {G}/paged_prefill/{pid} {}", 2 * causal(new, T));
    bench(
        &mut g,
        d,
        (G, "paged_prefill", &pid),
        io(new) + T * kvrow * 8,
        || {
            d.paged_attention_prefill(
                &mut on,
                &qn,
                &k,
                &v,
                std::slice::from_ref(&table),
                &[past as u32],
                &[0, new as u32],
                (nh, nkv, hd),
                bs,
                scale,
            )
            .unwrap()
        },
    );
    // Decode: 1 or 32 sequences share the pool's 8,192 keys (the bytes
    // count each sequence's own read). At batch 1 the 16 splits of 512
    // keys are what spread the step over the GPU.
    for seqs in [1, 32] {
        let qd = buf(d, rng, seqs * qrow, 1.0);
        let mut od = d.zeros(seqs * qrow).unwrap();
        let did = format!("{seqs}x{T}x{nh}/{nkv}x{hd}");
        eprintln!("flops {G}/paged_decode/{did} {}", 2 * seqs * causal(1, T));
        bench(
            &mut g,
            d,
            (G, "paged_decode", &did),
            seqs * T * kvrow * 8,
            || {
                d.paged_attention_decode(
                    &mut od,
                    &qd,
                    &k,
                    &v,
                    &vec![table.clone(); seqs],
                    &vec![T as u32; seqs],
                    (nh, nkv, hd),
                    bs,
                    scale,
                )
                .unwrap()
            },
        );
    }
    let dout = buf(d, rng, T * qrow, 1.0);
    let (mut dq, mut dk, mut dv) = (
        d.zeros(T * qrow).unwrap(),
        d.zeros(T * kvrow).unwrap(),
        d.zeros(T * kvrow).unwrap(),
    );
    let dims = arcticd_kernels::cpu::attention::AttnDims {
        nq: T,
        nk: T,
        n_heads: nh,
        n_kv_heads: nkv,
        head_dim: hd,
    };
    eprintln!("flops {G}/backward/{id} {}", 5 * causal(T, T));
    bench(&mut g, d, (G, "backward", &id), 2 * io(T), || {
        d.attention_backward(&mut dq, &mut dk, &mut dv, &dout, &q, &k, &v, dims, scale)
            .unwrap()
    });
    g.finish();
}

fn vocabulary(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_vocabulary";
    let mut g = c.benchmark_group(G);
    let rows = 64;
    let logits = buf(d, rng, rows * VOCAB, 10.0);
    let targets: Vec<u32> = (0..rows).map(|_| rng.gen_range(0..VOCAB as u32)).collect();
    let targets = d.upload(&targets).unwrap();
    let (mut lp, dlp) = (d.zeros(rows).unwrap(), buf(d, rng, rows, 1.0));
    let mut dl = d.zeros(rows * VOCAB).unwrap();
    let lb = rows * VOCAB * 4;
    bench(
        &mut g,
        d,
        (G, "logprob_gather_forward", "64x248320"),
        lb,
        || {
            d.logprob_gather_forward(&mut lp, &logits, &targets, VOCAB, 1.0)
                .unwrap()
        },
    );
    bench(
        &mut g,
        d,
        (G, "logprob_gather_backward", "64x248320"),
        2 * lb,
        || {
            d.logprob_gather_backward(&mut dl, &dlp, &logits, &targets, VOCAB, 1.0)
                .unwrap()
        },
    );
    // The embedding's gradient: 8,192 tokens over 512 distinct ids.
    let ids: Vec<u32> = (0..T).map(|_| rng.gen_range(0..512)).collect();
    let dy = buf(d, rng, T * HIDDEN, 1.0);
    let mut table = d.zeros(VOCAB * HIDDEN).unwrap();
    bench(
        &mut g,
        d,
        (G, "embedding_backward", "8192x1024"),
        T * HIDDEN * 4,
        || {
            d.embedding_backward(&mut table, &dy, &ids, VOCAB, HIDDEN)
                .unwrap()
        },
    );
    g.finish();
}

fn optimizer(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_optimizer";
    let mut g = c.benchmark_group(G);
    // A 100M-parameter slice (the 0.8B model is eight of them).
    let n = 100_000_000;
    let mut p = buf(d, rng, n, 1.0);
    let grad = buf(d, rng, n, 0.01);
    let (mut m, mut v) = (d.zeros(n).unwrap(), d.zeros(n).unwrap());
    let mut bits = d.zeros::<u16>(n).unwrap();
    let s = AdamWStep::new(1e-6, 0.9, 0.999, 1e-8, 0.0, 10);
    // Reads param, grad and two moments; writes param, two moments, bf16.
    bench(
        &mut g,
        d,
        (G, "adamw_update", "100M"),
        n * (7 * 4 + 2),
        || {
            d.adamw_update(&mut p, &mut m, &mut v, Some(&mut bits), &grad, &s)
                .unwrap()
        },
    );
    bench(&mut g, d, (G, "sum_squares", "100M"), n * 4, || {
        d.sum_squares(&grad).unwrap();
    });
    g.finish();
}

/// Decode-shaped products (bandwidth-bound: the bf16 weight is read once
/// per step), at batch 1 and 32: the MLP's up projection and the
/// vocabulary head of the 0.8B shape.
fn products(c: &mut Criterion, d: &CudaDevice, rng: &mut StdRng) {
    const G: &str = "cuda_matmul";
    let mut g = c.benchmark_group(G);
    let bits = |d: &CudaDevice, rng: &mut StdRng, n: usize| -> CudaSlice<u16> {
        let v: Vec<u16> = (0..n)
            .map(|_| half::bf16::from_f32(rng.gen_range(-0.05f32..0.05)).to_bits())
            .collect();
        d.upload(&v).expect("upload")
    };
    // cuBLAS, then the deterministic mode's in-order kernel on the same
    // operands (and for the up projection a prefill of 8,192 rows, where
    // the kernel gives up the tensor cores): the pairs' times are the
    // mode's cost.
    for (name, cin, cout) in [("up", HIDDEN, INTER), ("head", HIDDEN, VOCAB)] {
        let w = bits(d, rng, cin * cout);
        let batches: &[usize] = if name == "up" { &[1, 32, T] } else { &[1, 32] };
        for &rows in batches {
            let x = bits(d, rng, rows * cin);
            let mut out = d.zeros::<f32>(rows * cout).unwrap();
            let id = format!("{rows}x{cin}x{cout}");
            for (mode, invariant) in [("", false), ("invariant_", true)] {
                d.set_batch_invariant(invariant);
                let flops = 2 * rows * cin * cout;
                eprintln!("flops {G}/{mode}bf16_{name}/{id} {flops}");
                bench(
                    &mut g,
                    d,
                    (G, &format!("{mode}bf16_{name}"), &id),
                    cin * cout * 2 + rows * (cin * 2 + cout * 4),
                    || {
                        d.matmul_forward(
                            MatMut::F32(&mut out),
                            Mat::Bf16(&x),
                            Mat::Bf16(&w),
                            rows,
                            cin,
                            cout,
                        )
                        .unwrap()
                    },
                );
            }
            d.set_batch_invariant(false);
        }
    }
    g.finish();
}

fn main() {
    let d = match CudaDevice::new(0) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("cuda benchmarks skipped: {e}");
            return;
        }
    };
    let mut c = Criterion::default()
        .sample_size(20)
        .warm_up_time(std::time::Duration::from_millis(300))
        .measurement_time(std::time::Duration::from_secs(1))
        .configure_from_args();
    let mut rng = StdRng::seed_from_u64(0);
    norms(&mut c, &d, &mut rng);
    elementwise(&mut c, &d, &mut rng);
    linear_attention(&mut c, &d, &mut rng);
    full_attention(&mut c, &d, &mut rng);
    vocabulary(&mut c, &d, &mut rng);
    optimizer(&mut c, &d, &mut rng);
    products(&mut c, &d, &mut rng);
    c.final_summary();
}
