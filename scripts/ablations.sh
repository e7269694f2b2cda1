#!/usr/bin/env bash
# The short ablation runs of docs/ablations.md: the built-in demo (its cached
# warm start, pool and seed) with one recipe key changed per run, two engine
# replicas, no held-out evaluation. Run directories go to runs/abl-NAME
# (runs/abl-NAME-sN with SEED=N, the task order's seed; the demo's is 0);
# `arcticd plot runs/abl-*` overlays them.
#
#   bash scripts/ablations.sh            # all runs, 12 updates each
#   STEPS=40 bash scripts/ablations.sh bf16 pinned
#   STEPS=40 SEED=1 bash scripts/ablations.sh full nogates
set -u
cd "$(dirname "$0")/.."
BIN=${BIN:-target/release/arcticd}
STEPS=${STEPS:-12}
[ -x "$BIN" ] || cargo build --release --bin arcticd
SEED=${SEED:-}
common=(--set "steps=$STEPS" --set eval_every=0 --set replicas=2)
suffix=""
if [ -n "$SEED" ]; then
  common+=(--set "seed=$SEED")
  suffix="-s$SEED"
fi
mkdir -p runs
declare -A sets=(
  [full]=""
  [bf16]="state_dtype=bf16"
  [norebuild]="rebuild_caches=false"
  [pinned]="routing=pinned"
  [lenient]="rollout.format_check=lenient"
  [nogates]="rollout.gate_format=false rollout.gate_duplicate=false rollout.gate_length=false"
  [lengthpen]="length_penalty=1.0"
  [lengthpen5]="length_penalty=5.0"
  [lengthpen20]="length_penalty=20.0"
  [noshare]="share_prefixes=false"
)
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(full bf16 norebuild pinned lenient nogates lengthpen lengthpen5 lengthpen20 noshare)
for name in "${names[@]}"; do
  [ -n "${sets[$name]+x}" ] || { echo "unknown run $name (one of ${!sets[*]})" >&2; exit 2; }
  extra=()
  for kv in ${sets[$name]}; do extra+=(--set "$kv"); done
  out="runs/abl-$name$suffix"
  rm -rf "$out"
  echo "=== $name$suffix: ${sets[$name]:-the full recipe} ($(date +%T))"
  "$BIN" train --out "$out" "${common[@]}" "${extra[@]}" > "$out.log" 2>&1
  echo "=== $name$suffix: exit $? ($(date +%T))"
done
