#!/usr/bin/env python3
"""Check checkpoints written by `arcticd sft` against transformers and PyTorch.

    python tests/ref/check_trainer_checkpoint.py --arcticd target/release/arcticd

1. `arcticd init-model --preset tiny` writes a base model (with tokenizer and
   chat template); a small `tokens`/`loss_mask` SFT data file is written.
2. `arcticd sft` trains N steps from it (AdamW, weight decay, clipping,
   warmup) and writes a checkpoint.
3. transformers loads that checkpoint (no missing or unexpected keys) and
   scores token sequences; `arcticd score` must agree (--tol, log-probs).
4. The same N steps are run with torch.optim.AdamW (+ clip_grad_norm_ and
   transformers' get_constant_schedule_with_warmup) from the base model on
   the same token sequences, and the trained weights must agree per tensor
   (relative L2 error <= --weight-tol).

Prints one JSON object with the numbers; exits non-zero on any failure.

The reference trains through transformers' recurrent gated-delta function
(`torch_recurrent_gated_delta_rule`, the same function as its chunked
prefill path, evaluated token by token as arcticd does). With
`--chunked-reference` it uses the chunked path instead; on init-model's
weights (A = exp(A_log) up to ~16, so per-token decays near exp(-16)) the
chunked fp32 backward loses digits in the decay gradient (differences of
large cumulative log-decays), and Adam, which normalizes each element,
turns that into ~5e-3 relative weight differences on in_proj_a / dt_bias /
A_log after a few steps; every other tensor stays within 1e-4.
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, get_constant_schedule_with_warmup
import transformers.models.qwen3_5.modeling_qwen3_5 as mq

ARGS = dict(steps=4, batch_size=2, lr=3e-3, weight_decay=0.05, beta1=0.9, beta2=0.99, eps=1e-8,
            grad_clip=0.5, warmup=2)


def run(cmd):
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr}")
    return res.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arcticd", default="target/release/arcticd")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--weight-tol", type=float, default=1e-4)
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--chunked-reference", action="store_true",
                    help="train the PyTorch reference with transformers' chunked gated-delta path (its "
                    "default for prefill) instead of its recurrent one; see the note in the docstring")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if not args.chunked_reference:
        # Same function, the recurrent evaluation order (as arcticd's engine and trainer).
        mq.torch_chunk_gated_delta_rule = (
            lambda q, k, v, g, beta, chunk_size=64, **kw: mq.torch_recurrent_gated_delta_rule(q, k, v, g, beta, **kw))

    work = tempfile.mkdtemp(prefix="arcticd-trainer-ckpt-")
    base, trained = os.path.join(work, "base"), os.path.join(work, "trained")
    run([args.arcticd, "init-model", "--preset", "tiny", "--out", base, "--seed", "3"])
    ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32, attn_implementation="eager")
    vocab = ref.config.get_text_config().vocab_size
    g = torch.Generator().manual_seed(0)
    lines = []
    for n in (20, 33, 9):
        toks = torch.randint(0, vocab, (n,), generator=g).tolist()
        lines.append(dict(tokens=toks, loss_mask=[0] * (n // 3) + [1] * (n - n // 3)))
    data = os.path.join(work, "data.jsonl")
    with open(data, "w") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    flags = []
    for k, v in ARGS.items():
        flags += [f"--{k.replace('_', '-')}", str(v)]
    out = run([args.arcticd, "sft", "--model", base, "--data", data, "--out", trained] + flags)
    losses = [json.loads(l)["loss"] for l in out.splitlines()]

    # 3. transformers loads the arcticd checkpoint and scores like arcticd.
    model, info = AutoModelForCausalLM.from_pretrained(
        trained, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    missing = list(info["missing_keys"]) + list(info["unexpected_keys"])
    assert not missing, f"loading info: {info}"
    seqs = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 17, 70)]
    expected = []
    with torch.no_grad():
        for s in seqs:
            lp = torch.log_softmax(model(torch.tensor([s])).logits[0].double(), -1)
            expected.append([lp[t - 1, s[t]].item() for t in range(1, len(s))])
    inp = os.path.join(work, "score.json")
    with open(inp, "w") as f:
        json.dump({"sequences": seqs}, f)
    got = json.loads(run([args.arcticd, "score", "--model", trained, "--input", inp]))["logprobs"]
    lp_diff = max((abs(a - b) for gr, er in zip(got, expected) for a, b in zip(gr[1:], er)), default=0.0)

    # 4. The same steps in PyTorch.
    opt = torch.optim.AdamW(ref.parameters(), lr=ARGS["lr"], betas=(ARGS["beta1"], ARGS["beta2"]),
                            eps=ARGS["eps"], weight_decay=ARGS["weight_decay"])
    sched = get_constant_schedule_with_warmup(opt, ARGS["warmup"])
    torch_losses = []
    B = ARGS["batch_size"]
    for step in range(ARGS["steps"]):
        batch = [lines[(step * B + i) % len(lines)] for i in range(B)]
        n_targets = sum(sum(b["loss_mask"][1:]) for b in batch)
        opt.zero_grad()
        loss = torch.zeros(())
        for b in batch:
            ids = b["tokens"]
            lp = torch.log_softmax(ref(torch.tensor([ids])).logits[0].float(), -1)
            lp = lp[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
            loss = loss - (lp * torch.tensor(b["loss_mask"][1:], dtype=torch.float32)).sum()
        loss = loss / n_targets
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), ARGS["grad_clip"])
        opt.step()
        sched.step()
        torch_losses.append(loss.item())
    ours = load_file(os.path.join(trained, "model.safetensors"))
    worst_w, worst_name = 0.0, None
    for name, p in ref.named_parameters():
        q = ours[name]
        e = ((q - p.detach()).norm() / p.detach().norm().clamp_min(1e-30)).item()
        if e > worst_w:
            worst_w, worst_name = e, name
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(losses, torch_losses))
    report = dict(steps=ARGS["steps"], max_abs_logprob_diff=lp_diff,
                  max_rel_weight_err=worst_w, worst_tensor=worst_name, max_rel_loss_diff=loss_diff,
                  arcticd_losses=losses, torch_losses=torch_losses)
    print(json.dumps(report))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    ok = lp_diff <= args.tol and worst_w <= args.weight_tol and loss_diff <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
