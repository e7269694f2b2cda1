#!/usr/bin/env bash
# The overfit stress test of docs/ablations.md, end to end:
#  1. a toy pool (one package, no loose tasks, a seed of its own);
#  2. the demo's warm-started model attempts each task 4 times, sampling as
#     the recipe does;
#  3. the tasks it solved at least once, the first 160, are the pool;
#  4. `arcticd train --recipe recipes/overfit.toml` on that pool.
# The warm start is $WARM when set, else the demo's (built by `arcticd
# train` once), else one built here (`arcticd warm-start`, about 10 minutes
# on 2 cores). Pass extra `--set key=value` arguments through to train.
#
#   bash scripts/overfit.sh [--set steps=100 ...]
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/arcticd}
OUT=${OUT:-runs/overfit}
# The demo's warm start solves about 40% of the candidates at least once.
CANDIDATES=${CANDIDATES:-440}
[ -x "$BIN" ] || cargo build --release --bin arcticd
data="$(pwd)/$OUT-data"
mkdir -p "$data"
cache="${ARCTICD_DEMO_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/arcticd/demo}/demo-v1"
if [ -n "${WARM:-}" ]; then
  model="$WARM/model"
elif [ -f "$cache/warm-start/model/config.json" ]; then
  model="$cache/warm-start/model"
else
  model="$data/warm-start/model"
  [ -f "$model/config.json" ] || "$BIN" warm-start --out "$data/warm-start"
fi
[ -f "$model/config.json" ] || { echo "no warm start at $model" >&2; exit 1; }
[ -f "$data/candidates/tasks.jsonl" ] ||
  "$BIN" tasks toy --count "$CANDIDATES" --seed 3 --loose-share 0 --package calc --out "$data/candidates"
rollout=$(python3 -c 'import tomllib,json,sys; print(json.dumps(tomllib.load(open("recipes/overfit.toml","rb"))["rollout"]))')
"$BIN" eval --model "$model" --tasks "$data/candidates/tasks.jsonl" --attempts 4 --concurrency 8 \
  --backend local --out "$data/warm-start-eval.jsonl" --config "$rollout" > "$data/warm-start-eval.summary.json"
"$BIN" tasks select --tasks "$data/candidates/tasks.jsonl" --eval "$data/warm-start-eval.jsonl" \
  --min-solved 1 --limit 160 --out "$data/pool.jsonl"
"$BIN" train --recipe recipes/overfit.toml --out "$OUT" \
  --set "model=$model" --set "tasks=$data/pool.jsonl" --set "eval_tasks=$data/pool.jsonl" "$@"
