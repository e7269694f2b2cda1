#!/usr/bin/env python3
"""Write the long-sequence gradient fixture: the trainer's gradients against
float64 autograd, and PyTorch float32's error against the same reference.

    python tests/ref/make_long_grad_fixture.py --out tests/fixtures/grads/long_f64

On the `gqa_untied` checkpoint of make_grad_fixtures.py (read from
tests/fixtures/grads/gqa_untied), one sequence of 3,840 seeded token ids and
per-token weights uniform in [-1, 1] (multiples of 1/64) (advantages of both signs, so the
gradients of the decay parameters A_log and dt_bias are sums that mostly
cancel), the scalar `L = sum_{t>=1} w[t] * log p(ids[t] | ids[:t])` is
differentiated by autograd twice: in float64 (the reference) and in
float32 (what PyTorch training computes). Written:

* `batch.json`: ids and weights;
* `ref_grads.safetensors`: the float64 gradient of every parameter, rounded
  to float32 (a relative rounding of 6e-8, far below the errors measured);
* `torch_f32_errors.json`: per parameter, PyTorch float32's error against
  the reference: `norm` = |g - ref| / |ref| over the tensor, and `element`
  = the largest |g_i - ref_i| / |ref_i| (the decay parameters' gradients
  are small, so their own size is the scale that matters to Adam).

CPU, one thread, eager attention, fixed seed.
"""

import argparse
import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM

TOKENS = 3840
SEED = 11


def grads(model, ids, w, dtype):
    model = model.to(dtype)
    model.zero_grad(set_to_none=True)
    x = torch.tensor([ids], dtype=torch.long)
    logits = model(input_ids=x).logits[0, :-1].to(dtype)
    lp = torch.log_softmax(logits, dim=-1).gather(1, x[0, 1:, None])[:, 0]
    loss = (lp * torch.tensor(w[1:], dtype=dtype)).sum()
    loss.backward()
    return {n: p.grad.detach().to(torch.float64).clone() for n, p in model.named_parameters()}


def main():
    ap = argparse.ArgumentParser()
    here = os.path.dirname(os.path.abspath(__file__))
    ap.add_argument("--model", default=os.path.join(here, "../fixtures/grads/gqa_untied"))
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(SEED)
    model = Qwen3_5ForCausalLM.from_pretrained(args.model, attn_implementation="eager")
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (TOKENS,), generator=g).tolist()
    # Multiples of 1/64: exact in float32 and short in JSON.
    w = [0.0] + (torch.randint(-64, 65, (TOKENS - 1,), generator=g) / 64).tolist()
    ref = grads(model, ids, w, torch.float64)
    f32 = grads(model, ids, w, torch.float32)
    errors = {}
    for name, r in ref.items():
        d = f32[name] - r
        norm = (d.norm() / r.norm()).item() if r.norm() > 0 else 0.0
        nz = r.abs() > 0
        element = (d[nz].abs() / r[nz].abs()).max().item() if nz.any() else 0.0
        errors[name] = {"norm": norm, "element": element}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "batch.json"), "w") as f:
        json.dump({"ids": ids, "weights": w}, f)
    save_file(
        {n: r.to(torch.float32).contiguous() for n, r in ref.items()},
        os.path.join(args.out, "ref_grads.safetensors"),
    )
    with open(os.path.join(args.out, "torch_f32_errors.json"), "w") as f:
        json.dump(errors, f, indent=1, sort_keys=True)
    for n in sorted(errors):
        print(f"{n:<55} torch f32 vs f64: norm {errors[n]['norm']:.2e} element {errors[n]['element']:.2e}")


if __name__ == "__main__":
    main()
