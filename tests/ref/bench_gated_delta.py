"""flash-linear-attention's chunked gated-delta rule (`fla-core`'s Triton
`chunk_gated_delta_rule`) timed on the shapes of arcticd's CUDA benchmarks
(kernels/benches/cuda.rs, group cuda_gated_delta): the forward over one
sequence of 8,192 tokens with 16 heads of 128 x 128 (with the final state
written, as arcticd's prefill leaves it in its slot), and forward plus
backward over 2,048 tokens (`gated_delta_chunked_backward` times the
backward alone, from the saved forward, so `backward_ms` is the difference
of the two timings here). Inputs as arcticd's benchmark draws them: q and
k in (-0.1, 0.1), v in (-1, 1), log decays in (-0.2, 0); beta in (0, 0.5)
(arcticd's draws (-0.5, 0.5); the sign does not change the work). One JSON
line per dtype.

scripts/gpu-check.sh runs it beside the criterion benchmarks on the same
GPU; it needs CUDA, PyTorch and the `fla` package (the staged wheels).

    python tests/ref/bench_gated_delta.py [--dtype fp32,bf16] [--iters 20]
"""

import argparse
import json
import sys

import torch


def timed(fn, iters):
    """Median milliseconds of `fn` over `iters` runs after 3 warm-ups
    (the first compiles Triton's kernels), by CUDA events."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def inputs(t, heads, dk, dv, dtype, grad, gen):
    def uniform(shape, lo, hi):
        x = torch.rand(shape, generator=gen, device="cuda") * (hi - lo) + lo
        return x.to(dtype).requires_grad_(grad)
    q = uniform((1, t, heads, dk), -0.1, 0.1)
    k = uniform((1, t, heads, dk), -0.1, 0.1)
    v = uniform((1, t, heads, dv), -1.0, 1.0)
    g = uniform((1, t, heads), -0.2, 0.0)
    beta = uniform((1, t, heads), 0.0, 0.5)
    return q, k, v, g, beta


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32,bf16")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--backward-tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gated_delta.py needs a CUDA device")
    try:
        import fla
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception as e:  # noqa: BLE001 - say why, whatever it is
        sys.exit(f"flash-linear-attention (fla) does not import: {e}")
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name in args.dtype.split(","):
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
        q, k, v, g, beta = inputs(args.tokens, args.heads, args.dk, args.dv, dtype, False, gen)
        state = torch.zeros(1, args.heads, args.dk, args.dv, device="cuda", dtype=torch.float32)

        def forward():
            with torch.no_grad():
                chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                       output_final_state=True)

        fwd = timed(forward, args.iters)
        tb = args.backward_tokens
        q, k, v, g, beta = inputs(tb, args.heads, args.dk, args.dv, dtype, True, gen)
        do = torch.rand((1, tb, args.heads, args.dv), generator=gen, device="cuda").to(dtype)

        def forward_only():
            with torch.no_grad():
                chunk_gated_delta_rule(q, k, v, g, beta)

        def forward_backward():
            o, _ = chunk_gated_delta_rule(q, k, v, g, beta)
            o.backward(do)

        short = timed(forward_only, args.iters)
        both = timed(forward_backward, args.iters)
        shape = f"{args.heads}x{args.dk}x{args.dv}"
        print(json.dumps({
            "impl": "fla", "fla": getattr(fla, "__version__", "unknown"),
            "torch": torch.__version__, "dtype": name,
            "forward": f"{args.tokens}x{shape}", "forward_ms": fwd,
            "backward": f"{tb}x{shape}", "forward_ms_at_backward_tokens": short,
            "forward_backward_ms": both, "backward_ms": both - short,
        }), flush=True)


if __name__ == "__main__":
    main()
