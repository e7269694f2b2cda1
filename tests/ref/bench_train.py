"""Training-step throughput of PyTorch autograd through transformers' Qwen3.5
(fp32, eager attention, pure-PyTorch gated-delta and conv fallbacks): forward,
token-mean cross-entropy over every position, backward and torch.optim.AdamW,
on a batch of random sequences. Prints one JSON line with tokens/s. Run by
`cargo run --release -p arcticd-trainer --example bench_train -- --torch PYTHON`
with the same model, batch and thread count.

    python tests/ref/bench_train.py --model DIR [--batch 8] [--seq-len 512] [--threads N]
"""

import argparse
import json
import os
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--iters", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    model.train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        opt.zero_grad()
        logits = model(ids).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(2, ids[:, 1:, None])
        loss = -lp.mean()
        loss.backward()
        opt.step()

    step()  # warm-up
    times = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    print(json.dumps({"impl": "torch", "threads": args.threads, "step_s": median,
                      "tokens_per_s": args.batch * args.seq_len / median}))


if __name__ == "__main__":
    main()
