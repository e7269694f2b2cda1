#!/usr/bin/env python3
"""Write gradient fixtures for the trainer with PyTorch autograd through
transformers' Qwen3.5.

    python tests/ref/make_grad_fixtures.py --out tests/fixtures/grads

Cases (each a directory under --out):

* grad cases (`gqa_untied`, `mqa_tied`): a tiny random checkpoint
  (`save_pretrained`), a packed batch of sequences and per-token weights
  `w[s][t]` (0 at t = 0, zeros elsewhere act as a loss mask, negative values
  as negative advantages) in `batch.json`, the scalar
  `L = sum_s sum_{t>=1} w[s][t] * log p(ids[s][t] | ids[s][:t])`, every
  log-prob, and the gradient dL/dparam of every parameter under its Hugging
  Face name in `grads.safetensors`. Each sequence runs alone (batch 1,
  positions from 0), which is what a packed batch without cross-sequence
  leakage must reproduce.
* `sft_adamw`: `arcticd sft` semantics on the `gqa_untied` checkpoint: a JSONL
  data file, the arguments, per-step losses and the weights after N steps of
  `torch.optim.AdamW` (+ `clip_grad_norm_`) in `final.safetensors`.

fp32 on CPU, one thread, eager attention, fixed seeds: reproducible on the
versions in requirements.txt.
"""

import argparse
import json
import os
import shutil
import sys

import torch
import transformers
from safetensors.torch import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_parity_fixtures import randomize  # noqa: E402  (same randomization rules)

VOCAB = 128

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_conv_kernel_dim=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    rms_norm_eps=1e-6,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)

CASES = [
    dict(
        name="gqa_untied",
        seed=2001,
        description="untied lm_head, layers linear/full/linear, GQA 4/2 heads, linear nk=2 nv=4 dk=dv=8, rotary 0.25",
        text=dict(
            num_hidden_layers=3,
            layer_types=["linear_attention", "full_attention", "linear_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25),
        ),
        # 70 crosses a 64-token chunk of the gated-delta kernels; 1 is a lone token.
        lengths=[70, 1, 23],
    ),
    dict(
        name="mqa_tied",
        seed=2002,
        description="tied embeddings, layers full/linear, MQA 2/1 heads head_dim 32 rotary 0.5 theta 1e6, "
        "linear nk=nv=2 dk=16 dv=8, rms_norm_eps 1e-5",
        text=dict(
            num_hidden_layers=2,
            layer_types=["full_attention", "linear_attention"],
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=32,
            linear_key_head_dim=16,
            linear_value_head_dim=8,
            linear_num_key_heads=2,
            linear_num_value_heads=2,
            rms_norm_eps=1e-5,
            tie_word_embeddings=True,
            rope_parameters=dict(rope_type="default", rope_theta=1000000.0, partial_rotary_factor=0.5),
        ),
        lengths=[40, 9],
    ),
]

SFT = dict(
    name="sft_adamw",
    base="gqa_untied",
    seed=2003,
    steps=3,
    batch_size=2,
    lr=1e-2,
    weight_decay=0.1,
    beta1=0.9,
    beta2=0.95,
    eps=1e-8,
    grad_clip=1.0,
    lengths=[12, 30, 7, 19, 25],
)


def build(case):
    torch.manual_seed(case["seed"])
    gen = torch.Generator().manual_seed(case["seed"])
    kw = dict(BASE)
    kw.update(case["text"])
    cfg = Qwen3_5TextConfig(**kw)
    cfg._attn_implementation = "eager"
    model = Qwen3_5ForCausalLM(cfg)
    randomize(model, gen)
    return model, gen


def seq_logprobs(model, ids):
    """log p(ids[t] | ids[:t]) for t >= 1, fp32 logits, log-softmax in fp32."""
    out = model(input_ids=torch.tensor([ids], dtype=torch.long))
    lp = torch.log_softmax(out.logits[0].float(), dim=-1)
    return lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


def grads_by_name(model):
    # Tied weights appear once (under model.embed_tokens.weight), as on disk.
    return {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}


def write_json(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f, separators=(",", ":"))
        f.write("\n")


def write_grad_case(case, out):
    d = os.path.join(out, case["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model, gen = build(case)
    model.save_pretrained(d)
    model.train()  # no dropout in Qwen3.5; train() only for autograd clarity
    seqs = [torch.randint(0, VOCAB, (n,), generator=gen).tolist() for n in case["lengths"]]
    weights = []
    for ids in seqs:
        w = (torch.randn(len(ids), generator=gen) * 0.5).tolist()
        mask = (torch.rand(len(ids), generator=gen) < 0.8).tolist()
        w = [0.0] + [round(x, 4) if m else 0.0 for x, m in zip(w[1:], mask[1:])]
        weights.append(w)
    model.zero_grad()
    loss = torch.zeros((), dtype=torch.float32)
    lps = []
    for ids, w in zip(seqs, weights):
        lp = seq_logprobs(model, ids)
        lps.append([None] + lp.detach().tolist())
        loss = loss + (lp * torch.tensor(w[1:], dtype=torch.float32)).sum()
    loss.backward()
    grads = grads_by_name(model)
    save_file(grads, os.path.join(d, "grads.safetensors"), metadata={"format": "pt"})
    write_json(
        os.path.join(d, "batch.json"),
        dict(
            case=case["name"],
            description=case["description"],
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
            loss_definition="sum_s sum_{t>=1} weights[s][t] * logprobs[s][t]",
            sequences=seqs,
            weights=weights,
            loss=loss.item(),
            logprobs=lps,
        ),
    )
    norms = {n: g.norm().item() for n, g in grads.items()}
    print(f"{case['name']}: loss {loss.item():.6f}, {len(grads)} grads, min norm {min(norms.values()):.3g}")


def clip_and_step(model, opt, clip):
    total = None
    if clip is not None:
        total = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
    opt.step()
    return total


def write_sft_case(out):
    s = SFT
    base = next(c for c in CASES if c["name"] == s["base"])
    d = os.path.join(out, s["name"])
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    model, _ = build(base)  # same weights as the base case's checkpoint
    gen = torch.Generator().manual_seed(s["seed"])
    lines = []
    for n in s["lengths"]:
        tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
        # A prompt then a completion: targets are the tokens after the prompt.
        cut = max(1, n // 3)
        lines.append(dict(tokens=tokens, loss_mask=[0] * cut + [1] * (n - cut)))
    with open(os.path.join(d, "data.jsonl"), "w") as f:
        for line in lines:
            f.write(json.dumps(line, separators=(",", ":")) + "\n")
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=s["lr"],
        betas=(s["beta1"], s["beta2"]),
        eps=s["eps"],
        weight_decay=s["weight_decay"],
    )
    losses, norms = [], []
    B = s["batch_size"]
    for step in range(s["steps"]):
        batch = [lines[(step * B + i) % len(lines)] for i in range(B)]
        n_targets = sum(sum(b["loss_mask"][1:]) for b in batch)
        opt.zero_grad()
        loss = torch.zeros((), dtype=torch.float32)
        for b in batch:
            lp = seq_logprobs(model, b["tokens"])
            m = torch.tensor(b["loss_mask"][1:], dtype=torch.float32)
            loss = loss - (lp * m).sum()
        loss = loss / n_targets
        loss.backward()
        norms.append(clip_and_step(model, opt, s["grad_clip"]))
        losses.append(loss.item())
    final = {n: p.detach().clone().contiguous() for n, p in model.named_parameters()}
    save_file(final, os.path.join(d, "final.safetensors"), metadata={"format": "pt"})
    args = {k: s[k] for k in ("steps", "batch_size", "lr", "weight_decay", "beta1", "beta2", "eps", "grad_clip")}
    write_json(
        os.path.join(d, "expected.json"),
        dict(
            case=s["name"],
            base_checkpoint=s["base"],
            transformers_version=transformers.__version__,
            torch_version=torch.__version__,
            args=args,
            losses=losses,
            grad_norms_before_clip=norms,
        ),
    )
    print(f"{s['name']}: losses {losses}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="output directory, e.g. tests/fixtures/grads")
    args = ap.parse_args()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    os.makedirs(args.out, exist_ok=True)
    for case in CASES:
        write_grad_case(case, args.out)
    write_sft_case(args.out)
    total = 0
    for root, _, files in os.walk(args.out):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    print(f"total {total / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
