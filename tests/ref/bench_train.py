"""Training-step throughput of PyTorch autograd through transformers' Qwen3.5:
forward, token-mean cross-entropy over every position, backward and
torch.optim.AdamW, on a batch of random sequences. Prints one JSON line with
tokens/s.

On the CPU (the default) it is the baseline of
`cargo run --release -p arcticd-trainer --example bench_train -- --torch PYTHON`
(fp32, eager attention, transformers' pure-PyTorch gated-delta and conv
fallbacks, the same model, batch and thread count).

With `--device cuda` it is the baseline of `arcticd bench-train --device
cuda:0` (scripts/gpu-check.sh runs both on the same GPU): SDPA attention and,
where the `fla` package (flash-linear-attention) imports, its Triton
gated-delta kernels, which transformers picks up by itself; `fla_calls`
counts the calls that reached them, so a run that fell back to the PyTorch
recurrence says so. `--precision fp32` is arcticd's arithmetic (fp32
weights and products, TF32 off); `bf16` is the usual PyTorch recipe (bf16
autocast over fp32 master weights). Model FLOPs are counted as
`arcticd bench-train` counts them: 6 per matrix parameter per token, the
output projection included, the embedding, attention scores and
recurrence not.

    python tests/ref/bench_train.py --model DIR [--batch 8] [--seq-len 512] [--threads N]
    python tests/ref/bench_train.py --model DIR --device cuda --tokens 8192 --seq-len 2048 \\
        [--precision fp32|bf16] [--peak-tflops 67]
"""

import argparse
import functools
import importlib
import json
import os
import time

import torch

# Calls that reached flash-linear-attention's kernels. The wrappers go in
# before transformers imports its Qwen3.5 module, which looks the functions
# up once, at import.
FLA_CALLS = {"n": 0}


def count_fla_calls():
    """Wraps fla's gated-delta entry points where transformers finds them;
    returns fla's version, or None where it does not import."""
    try:
        fla = importlib.import_module("fla")
        ops = importlib.import_module("fla.ops.gated_delta_rule")
    except Exception:  # noqa: BLE001 - any failure means no fla kernels
        return None
    for name in ("chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"):
        fn = getattr(ops, name, None)
        if fn is None:
            continue

        @functools.wraps(fn)
        def counted(*args, _fn=fn, **kwargs):
            FLA_CALLS["n"] += 1
            return _fn(*args, **kwargs)

        for module in (ops, fla, importlib.import_module("fla.ops")):
            if getattr(module, name, None) is fn:
                setattr(module, name, counted)
    return getattr(fla, "__version__", "unknown")


def matrix_params(model):
    """Matrix parameters, as arcticd bench-train counts them."""
    n = sum(p.numel() for name, p in model.named_parameters()
            if p.dim() == 2 and not name.endswith("embed_tokens.weight"))
    if model.config.get_text_config().tie_word_embeddings:
        n += model.get_output_embeddings().weight.numel()
    return n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--tokens", type=int, help="tokens per step (sets --batch from --seq-len)")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--peak-tflops", type=float, help="the device's peak, to report mfu")
    args = ap.parse_args()
    if args.tokens is not None:
        if args.tokens % args.seq_len:
            ap.error("--tokens must be a multiple of --seq-len")
        args.batch = args.tokens // args.seq_len
    torch.set_num_threads(args.threads)
    fla = count_fla_calls() if args.device == "cuda" else None
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    attn = "sdpa" if args.device == "cuda" else "eager"
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation=attn)
    model.to(args.device).train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(args.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16")

    def sync():
        if args.device == "cuda":
            torch.cuda.synchronize()

    def step():
        opt.zero_grad()
        with autocast:
            logits = model(ids).logits
        lp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])
        loss = -lp.mean()
        loss.backward()
        opt.step()
        sync()

    step()  # warm-up (and Triton's compilation)
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    tokens = args.batch * args.seq_len
    tflops = 6.0 * matrix_params(model) * tokens / median / 1e12
    out = {"impl": "torch", "device": args.device, "precision": args.precision,
           "threads": args.threads, "batch": args.batch, "seq_len": args.seq_len,
           "step_s": median, "tokens_per_s": tokens / median, "model_tflops": tflops,
           "torch": torch.__version__}
    if args.device == "cuda":
        out["fla"] = fla
        out["fla_calls"] = FLA_CALLS["n"]
        out["peak_memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    if args.peak_tflops:
        out["mfu"] = tflops / args.peak_tflops
    print(json.dumps(out))


if __name__ == "__main__":
    main()
