"""Forward throughput: arcticd against transformers on the same machine.

Makes the `small` preset with `arcticd init-model` (unless --model is given),
times the full forward (every position's logits) of a batch of 8 random
sequences of 512 tokens in arcticd (`arcticd bench-forward`) and in
transformers (fp32, eager attention, its pure-PyTorch gated-delta and conv
fallbacks), both with the same number of threads, and prints tokens/s of each
and the ratio.

    python tests/ref/bench_forward.py --arcticd target/release/arcticd [--threads N]
"""

import argparse
import json
import os
import subprocess
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arcticd", default="target/release/arcticd")
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()

    model_dir = args.model
    if model_dir is None:
        model_dir = tempfile.mkdtemp(prefix="arcticd-bench-")
        subprocess.run([args.arcticd, "init-model", "--preset", "small", "--out", model_dir], check=True)

    env = dict(os.environ, RAYON_NUM_THREADS=str(args.threads))
    out = subprocess.run(
        [args.arcticd, "bench-forward", "--model", model_dir, "--batch", str(args.batch),
         "--seq-len", str(args.seq_len), "--iters", str(args.iters)],
        check=True, capture_output=True, text=True, env=env)
    ours = json.loads(out.stdout.strip().splitlines()[-1])

    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    times = []
    with torch.inference_mode():
        model(ids)  # warm-up
        for _ in range(args.iters):
            t0 = time.perf_counter()
            logits = model(ids).logits
            times.append(time.perf_counter() - t0)
            assert logits.shape == (args.batch, args.seq_len, vocab)
    times.sort()
    ref_tps = args.batch * args.seq_len / times[len(times) // 2]
    result = {
        "model": "small preset" if args.model is None else model_dir,
        "batch": args.batch,
        "seq_len": args.seq_len,
        "threads": args.threads,
        "arcticd_tokens_per_s": round(ours["tokens_per_s"], 1),
        "transformers_tokens_per_s": round(ref_tps, 1),
        "ratio_arcticd_over_transformers": round(ours["tokens_per_s"] / ref_tps, 2),
        "transformers_version": __import__("transformers").__version__,
        "torch_version": torch.__version__,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
