#!/usr/bin/env bash
# The checks that need a GPU, as one short script, ending in one JSON of
# numbers on stdout: every CUDA kernel test (each op against its CPU
# reference, forwards and backwards; with ARCTICD_REQUIRE_GPU set a
# missing device is a failure, not a skip), the model's CUDA scores
# against the CPU's, the training forward's activations, and the engine on
# CUDA against the CPU engine (engine crate, `model::cuda`), the backward's
# gradients on CUDA against the CPU's (trainer crate, `cuda`), the CUDA kernel benchmarks (kernels/benches/cuda.rs,
# each as a fraction of the HBM bandwidth; flash-linear-attention's
# chunked gated-delta rule on the same shapes beside them,
# tests/ref/bench_gated_delta.py), and decode through the engine
# on a random model of the Qwen3.5-0.8B shape at batch 1, 32 and 128, and
# after prompts of 8,192 tokens at batch 1 and 8
# (`arcticd bench-decode --device cuda:0`, with cuBLAS and in the deterministic
# mode, `--batch-invariant`: tokens/s and the fraction of the
# HBM roofline; DECODE_PRESETS adds qwen3.5-4b, whose init takes minutes),
# training steps of 8,192 tokens on the same models (`arcticd bench-train`:
# tokens/s, the update's time and model FLOPs utilization),
# PyTorch's training step on the same models and GPU beside them
# (tests/ref/bench_train.py: transformers with flash-linear-attention's
# kernels, fp32 as arcticd computes and bf16 autocast as peers train; the
# fla wheels are staged, PyTorch and transformers are the GPU machine's),
# `arcticd sft --device cuda:0` against PyTorch's AdamW on the fixture, and
# a short `arcticd train --device cuda:0` with the demo recipe (DEMO_STEPS
# updates, default 10; its inputs staged with DEMO=1): the same-version
# engine/trainer mismatch of the asynchronous loop on the GPU.
# The trainer's NCCL test runs against the NCCL the machine's Python has
# (nvidia-nccl wheel; cudarc loads libnccl.so, the wheel ships
# libnccl.so.2: a link in a scratch folder bridges them).
#
# Needs an NVIDIA driver, and NVRTC and cuBLAS on the loader path (PyPI's
# nvidia-cuda-nvrtc and nvidia-cublas wheels put them in nvidia/cu13/lib,
# where PyTorch's CUDA 13 install has them; NVRTC_LIB names the folder). A GPU machine without Rust or a network runs the
# binaries staged beforehand on a build machine:
#
#   BIN_ONLY=1 bash scripts/gpu-check.sh   # build machine: stage target/gpu-check/
#                                          # (stripped binaries and NVRTC, xz'd to
#                                          # travel under 64 MiB; unpacked on use;
#                                          # DEMO=1 stages the demo's inputs in
#                                          # NVRTC's place)
#   bash scripts/gpu-check.sh              # GPU machine: staged binaries, else cargo
#
# Exit status 0 only when every test passed and the benchmarks ran.
#
# HBM_TBS (default 4.8, the H200's) is the bandwidth the fractions use;
# TRAIN_TOKENS (default 8192) the tokens per training step, a list to run
# several (the issue's 8192 32768); TORCH_BASELINE=0 skips PyTorch;
# PHASES (default "tests bench decode train torch sft demo") a subset to
# run: where one command may run at most 10 minutes, run PHASES="tests
# bench sft demo" and then PHASES="decode train torch" (about 5 and 6
# minutes estimated; none of it has run on a GPU yet).
set -euo pipefail
cd "$(dirname "$0")/.."
stage=target/gpu-check
if [ -z "${NVRTC_LIB:-}" ]; then
  for py in .venv/bin/python3 python3; do
    NVRTC_LIB=$("$py" -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)
    [ -e "$NVRTC_LIB/libnvrtc.so.13" ] && break
    NVRTC_LIB=
  done
  # Else a CUDA 13 toolkit's (where nvcc is installed).
  for dir in /usr/local/cuda/lib64 /usr/local/cuda-13*/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    [ -z "$NVRTC_LIB" ] && [ -e "$dir/libnvrtc.so.13" ] && NVRTC_LIB=$dir
  done
  if [ -z "$NVRTC_LIB" ] && [ -d "$stage/nvrtc" ] && [ -z "${BIN_ONLY:-}" ]; then
    # The staged NVRTC, compressed to travel: unpacked once.
    NVRTC_LIB=$(pwd)/$stage/nvrtc
    for z in "$NVRTC_LIB"/*.xz; do [ -f "${z%.xz}" ] || xz -dk "$z"; done
  fi
fi
if [ -n "$NVRTC_LIB" ]; then export LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}"; fi

# The executables cargo builds for a crate's tests or benches (CUDA on):
# executables PACKAGE test|bench ARGS...
executables() {
  local pkg=$1; shift
  cargo "$@" -p "$pkg" --features cuda --no-run --message-format=json 2>/dev/null |
    grep -o '"executable":"[^"]*"' | sed 's/"executable":"//; s/"$//'
}

if [ -n "${BIN_ONLY:-}" ]; then
  mkdir -p "$stage"
  tests=$(executables arcticd-kernels test --release --lib | head -1)
  bench=$(executables arcticd-kernels bench --bench cuda | head -1)
  model_tests=$(executables arcticd-engine test --release --lib | head -1)
  trainer_tests=$(executables arcticd-trainer test --release --lib | head -1)
  # Stripped and xz-compressed, NVRTC (its library and builtins) too:
  # small enough to carry to a GPU machine (64 MiB).
  cargo build --release --features cuda --bin arcticd 2>/dev/null
  rm -f "$stage"/*-tests "$stage"/cuda-bench "$stage"/arcticd "$stage"/*.xz
  for pair in "kernels-tests:$tests" "cuda-bench:$bench" "engine-tests:$model_tests" \
    "trainer-tests:$trainer_tests" "arcticd:target/release/arcticd"; do
    strip -o "$stage/${pair%%:*}" "${pair#*:}"
    xz -T0 -6 "$stage/${pair%%:*}"
  done
  if [ -z "${DEMO:-}" ] && [ -n "$NVRTC_LIB" ] && [ -d "$NVRTC_LIB" ]; then
    rm -rf "$stage/nvrtc" && mkdir -p "$stage/nvrtc"
    for lib in libnvrtc.so.13 libnvrtc-builtins.so.13.0; do
      xz -T0 -6 -c "$NVRTC_LIB/$lib" > "$stage/nvrtc/$lib.xz"
    done
  fi
  # flash-linear-attention for the PyTorch baseline (pure Python, Triton
  # kernels; PyTorch, Triton and einops are on the GPU machine already).
  rm -rf "$stage/wheels"
  py=python3 && [ -x .venv/bin/python3 ] && py=.venv/bin/python3
  if ! "$py" -m pip download -q --no-deps --only-binary=:all: -d "$stage/wheels" \
    flash-linear-attention==0.6.0 fla-core==0.6.0 >&2; then
    echo "warning: fla wheels not staged; the PyTorch baseline will say fla is missing" >&2
  fi
  # The demo's inputs for the demo phase (DEMO=1; run `arcticd train` once
  # before, which builds them): the sandbox's root file system without
  # documentation, locales, perl and package tools, the warm-started model
  # and the task pools, as one archive unpacked into XDG_CACHE_HOME there
  # (28 MB); bubblewrap and the libraries it links beside it, for a
  # machine that has none. NVRTC is then left to the GPU machine's own
  # (its Python's nvidia-cuda-nvrtc or its CUDA toolkit): with both, the
  # carry would pass 64 MiB.
  rm -rf "$stage/demo.tar.xz" "$stage/demo"
  if [ -n "${DEMO:-}" ]; then
    cache=${XDG_CACHE_HOME:-$HOME/.cache}
    # Images are where arcticd puts them: under XDG_CACHE_HOME, else, for
    # root, /var/cache (sandbox/src/image.rs).
    img_base=$cache
    if [ -z "${XDG_CACHE_HOME:-}" ] && [ "$(id -u)" = 0 ]; then img_base=/var/cache; fi
    images=$(cd "$img_base" && ls -d arcticd/images/*/rootfs 2> /dev/null || true)
    if [ -z "$images" ] || [ ! -d "$cache/arcticd/demo" ] || ! command -v bwrap > /dev/null; then
      echo "DEMO=1: run \`arcticd train\` once first (it builds the sandbox image and the" \
        "demo's inputs) on a machine with bubblewrap" >&2
      exit 1
    fi
    rm -rf "$stage/nvrtc"
    # Left out: what no sandboxed command of the demo runs (python3, pytest,
    # git apply, add and diff do), and the warm start's inputs, base model
    # and optimizer moments (the cached model is all the demo reads).
    # shellcheck disable=SC2086
    tar -c --exclude='*/usr/share/locale' --exclude='*/usr/share/doc' \
      --exclude='*/usr/share/man' --exclude='*/usr/share/info' --exclude='*/usr/share/perl' \
      --exclude='*/usr/share/zoneinfo' --exclude='*/usr/lib/x86_64-linux-gnu/perl*' \
      --exclude='*/usr/lib/x86_64-linux-gnu/libperl*' --exclude='*/usr/lib/x86_64-linux-gnu/gconv' \
      --exclude='*/usr/lib/x86_64-linux-gnu/libapt*' --exclude='*/usr/lib/apt' \
      --exclude='*/usr/bin/perl*' --exclude='*/usr/bin/scalar' --exclude='*/usr/bin/git-shell' \
      --exclude='*/usr/lib/git-core/git-http-*' --exclude='*/usr/lib/git-core/git-remote-*' \
      --exclude='*/usr/lib/git-core/git-imap-send' --exclude='*/usr/lib/git-core/scalar' \
      --exclude='*/usr/lib/git-core/git-daemon' --exclude='*/usr/lib/git-core/git-shell' \
      --exclude='*/var/cache' --exclude='*/var/lib/apt' --exclude='*/var/lib/dpkg' \
      --exclude='*.pyc' --exclude=__pycache__ --exclude='*/lock' \
      --exclude='*/warm-start/base' --exclude='*/warm-start/demos*' \
      --exclude='optimizer.safetensors' -C "$img_base" $images -C "$cache" arcticd/demo |
      xz -T0 -9 > "$stage/demo.tar.xz"
    mkdir -p "$stage/demo/bin" "$stage/demo/lib"
    cp "$(command -v bwrap)" "$stage/demo/bin/"
    ldd "$(command -v bwrap)" | awk '$3 ~ /^\// && $1 !~ /^libc\.so/ { print $3 }' |
      xargs -r cp -L -t "$stage/demo/lib"
  fi
  du -sh "$stage" >&2
  exit 0
fi

# Staged binaries travel compressed: unpacked once.
for z in "$stage"/*.xz; do
  if [ -f "$z" ] && [ ! -f "${z%.xz}" ]; then xz -dk "$z" && chmod +x "${z%.xz}"; fi
done
if [ -x "$stage/kernels-tests" ] && [ -x "$stage/cuda-bench" ] && [ -x "$stage/engine-tests" ] &&
  [ -x "$stage/trainer-tests" ]; then
  tests="$stage/kernels-tests"
  bench="$stage/cuda-bench"
  model_tests="$stage/engine-tests"
  trainer_tests="$stage/trainer-tests"
else
  tests=$(executables arcticd-kernels test --release --lib | head -1)
  bench=$(executables arcticd-kernels bench --bench cuda | head -1)
  model_tests=$(executables arcticd-engine test --release --lib | head -1)
  trainer_tests=$(executables arcticd-trainer test --release --lib | head -1)
fi

log=$(mktemp -d)
# NCCL from the machine's own wheel, when it has one.
nccl=$(python3 -c 'import glob, nvidia; print(next(iter(sorted(glob.glob(list(nvidia.__path__)[0] + "/**/libnccl.so.2", recursive=True))), ""))' 2>/dev/null || true)
if [ -n "$nccl" ]; then
  mkdir -p "$log/nccl" && ln -sf "$nccl" "$log/nccl/libnccl.so"
  export LD_LIBRARY_PATH="$log/nccl:$(dirname "$nccl"):${LD_LIBRARY_PATH:-}" ARCTICD_REQUIRE_NCCL=1
fi
echo "NCCL: ${nccl:-none found (the NCCL test skips)}" >&2
gpu=$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo "unknown")
echo "GPU: $gpu" >&2
# PHASES picks what runs (all by default), so the checks can be split over
# calls of a limited length; every program runs under a time limit
# (TEST_TIMEOUT for each test binary, PHASE_TIMEOUT for the rest), so a
# hung kernel costs minutes, not the whole loan.
phases=" ${PHASES:-tests bench decode train torch sft demo} "
want() { case "$phases" in *" $1 "*) return 0 ;; esac; return 1; }
limit() { timeout "${PHASE_TIMEOUT:-300}" "$@"; }
set +e
tests_rc=0
bench_rc=0
: > "$log/tests.txt"
: > "$log/bench.txt"
: > "$log/bench.err"
if want tests; then
  ARCTICD_REQUIRE_GPU=1 ARCTICD_REQUIRE_NVRTC=1 timeout "${TEST_TIMEOUT:-300}" "$tests" cuda:: \
    --test-threads 1 >> "$log/tests.txt" 2>&1
  tests_rc=$?
  # The model on CUDA (the layer code the CPU runs, over the CUDA ops):
  # scores against the CPU's, with the bounds reached printed.
  ARCTICD_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-300}" "$model_tests" model::cuda:: \
    --test-threads 1 --nocapture >> "$log/tests.txt" 2>&1
  model_rc=$?
  [ "$tests_rc" -eq 0 ] && tests_rc=$model_rc
  # The backward on CUDA (the trainer's layer walk over the CUDA ops):
  # every parameter's gradient against the CPU backward.
  ARCTICD_REQUIRE_GPU=1 timeout "${TEST_TIMEOUT:-300}" "$trainer_tests" cuda:: \
    --test-threads 1 --nocapture >> "$log/tests.txt" 2>&1
  trainer_rc=$?
  [ "$tests_rc" -eq 0 ] && tests_rc=$trainer_rc
fi
# flash-linear-attention for the PyTorch baselines (the staged wheels).
if { want torch || want bench; } && [ "${TORCH_BASELINE:-1}" != 0 ] &&
  ls "$stage"/wheels/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$log/site" "$stage"/wheels/*.whl >&2 ||
    echo "warning: the fla wheels did not install; PyTorch runs its own recurrence" >&2
fi
: > "$log/fla.txt"
if want bench; then
  limit "$bench" --bench --output-format bencher > "$log/bench.txt" 2> "$log/bench.err" || bench_rc=1
  # fla's Triton chunked gated-delta rule on the benchmarks' shapes, beside
  # cuda_gated_delta/gated_delta_prefill_chunked and _chunked_backward.
  if [ "${TORCH_BASELINE:-1}" != 0 ]; then
    PYTHONPATH="$log/site${PYTHONPATH:+:$PYTHONPATH}" limit python3 tests/ref/bench_gated_delta.py \
      >> "$log/fla.txt" 2>> "$log/torch.err" || bench_rc=1
  fi
fi
# Decode through the engine on real shapes (random bf16 weights).
if [ -x "$stage/arcticd" ]; then arcticd="$stage/arcticd"; else
  cargo build --release --features cuda --bin arcticd >&2 && arcticd=target/release/arcticd; fi
: > "$log/decode.txt"
: > "$log/train.txt"
: > "$log/torch.txt"
for preset in ${DECODE_PRESETS:-qwen3.5-0.8b}; do
  want decode || want train || want torch || break
  limit "$arcticd" init-model --preset "$preset" --out "$log/$preset" >&2 || bench_rc=1
  if want decode; then
    # cuBLAS, then the deterministic mode's products.
    for invariant in "" --batch-invariant; do
      limit "$arcticd" bench-decode --model "$log/$preset" --device cuda:0 --batch 1,32,128 \
        --prompt-len 16 --new-tokens 64 --cache-memory 32768 --hbm-tb-s "${HBM_TBS:-4.8}" $invariant \
        | sed "s/^{/{\"preset\":\"$preset\",/" >> "$log/decode.txt" || bench_rc=1
    done
    # Long contexts: prompts of 8,192 tokens at batch 1 and 8, where decode
    # attention reads 16 splits of keys per head (decode_tokens_per_s leaves
    # the prefill out).
    limit "$arcticd" bench-decode --model "$log/$preset" --device cuda:0 --batch 1,8 \
      --prompt-len 8192 --new-tokens 64 --cache-memory 32768 --hbm-tb-s "${HBM_TBS:-4.8}" \
      | sed "s/^{/{\"preset\":\"$preset\",/" >> "$log/decode.txt" || bench_rc=1
  fi
  # Training steps (f32 products: PEAK_TFLOPS is the fp32 peak, the
  # H200's 67 by default), with and without recomputed layers; then
  # PyTorch's on the same model (BF16_PEAK_TFLOPS: the dense bf16 peak).
  for tokens in ${TRAIN_TOKENS:-8192}; do
    if want train; then
      for recompute in "" --recompute-layers; do
        limit "$arcticd" bench-train --model "$log/$preset" --device cuda:0 --tokens "$tokens" \
          --seq-len 2048 --steps 3 --peak-tflops "${PEAK_TFLOPS:-67}" $recompute 2>> "$log/train.err" \
          | sed "s/^{/{\"preset\":\"$preset\",/" >> "$log/train.txt" || bench_rc=1
      done
    fi
    if want torch && [ "${TORCH_BASELINE:-1}" != 0 ]; then
      for precision in fp32:"${PEAK_TFLOPS:-67}" bf16:"${BF16_PEAK_TFLOPS:-989}"; do
        PYTHONPATH="$log/site${PYTHONPATH:+:$PYTHONPATH}" limit python3 tests/ref/bench_train.py \
          --model "$log/$preset" --device cuda --tokens "$tokens" --seq-len 2048 --iters 3 \
          --precision "${precision%%:*}" --peak-tflops "${precision#*:}" 2>> "$log/torch.err" \
          | tail -1 | sed "s/^{/{\"preset\":\"$preset\",/" >> "$log/torch.txt" || bench_rc=1
      done
    fi
  done
  rm -rf "${log:?}/$preset"
done
set -e
cat "$log/tests.txt" >&2
grep -v '^bytes \|^flops ' "$log/bench.err" >&2 || true

passed=$(grep -c '^test .* ok$' "$log/tests.txt" || true)
failed=$(grep -c '^test .* FAILED$' "$log/tests.txt" || true)
failures=$({ grep '^test .* FAILED$' "$log/tests.txt" || true; } | awk '{printf "%s\"%s\"", (n++ ? "," : ""), $2}')
benches=$(awk -v hbm="${HBM_TBS:-4.8}" '
  FNR == NR { if ($1 == "bytes") bytes[$2] = $3; if ($1 == "flops") flops[$2] = $3; next }
  $1 == "test" && $4 == "bench:" {
    ns = $5; b = bytes[$2]; tbs = (ns > 0 && b > 0) ? b / ns / 1000 : 0
    f = ($2 in flops && ns > 0) ? sprintf(",\"tflop_s\":%.2f", flops[$2] / ns / 1000) : ""
    printf "%s{\"name\":\"%s\",\"ns\":%s,\"bytes\":%s,\"tb_s\":%.4f,\"hbm_fraction\":%.4f%s}", (n++ ? "," : ""), $2, ns, (b ? b : 0), tbs, tbs / hbm, f
  }' "$log/bench.err" "$log/bench.txt")
# arcticd sft on CUDA against PyTorch's AdamW on the committed fixture
# (tests/fixtures/grads/sft_adamw, the CPU's CLI test): the largest
# relative difference of the three losses (the CPU test's bound is 1e-4).
fx=tests/fixtures/grads
sft_diff=null
if ! want sft; then
  :
elif limit "$arcticd" sft --model "$fx/gqa_untied" --data "$fx/sft_adamw/data.jsonl" --out "$log/sft" \
  --steps 3 --batch-size 2 --lr 0.01 --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --eps 1e-8 \
  --grad-clip 1.0 --device cuda:0 > "$log/sft.txt" 2> "$log/sft.err"; then
  sft_diff=$(awk '
    FNR == NR { sub(/.*"losses":\[/, ""); sub(/\].*/, ""); n = split($0, want, ","); next }
    { sub(/.*"loss":/, ""); sub(/,.*/, ""); got[++m] = $0 }
    END { worst = 0; for (i = 1; i <= n; i++) { d = got[i] - want[i]; if (d < 0) d = -d;
          w = want[i] < 0 ? -want[i] : want[i]; if (d / w > worst) worst = d / w }
          printf "%.3e", (m == n ? worst : 1e9) }' "$fx/sft_adamw/expected.json" "$log/sft.txt")
else
  cat "$log/sft.err" >&2
  bench_rc=1
fi
# A short `arcticd train` with the demo recipe on the GPU (issue 14): the
# staged inputs (DEMO=1 at staging) skip the warm start and the pools, so
# the run is the asynchronous loop itself, its rollouts graded in the local
# sandbox (bubblewrap and cgroups; host git makes the snapshots). Reported:
# the same-version engine/trainer mismatch over trained tokens and probes,
# the pass rate of the first and last update, stale drops, and the time.
demo_json=null
demo_rc=0
set +e
if want demo; then
  if [ ! -f "$stage/demo.tar.xz" ]; then
    demo_json='{"error":"not staged (DEMO=1 BIN_ONLY=1 bash scripts/gpu-check.sh on the build machine)"}'
  else
    mkdir -p "$log/cache" && tar -xJf "$stage/demo.tar.xz" -C "$log/cache" || demo_rc=1
    chmod +x "$stage/demo/bin/bwrap" 2> /dev/null
    command -v bwrap > /dev/null || export PATH="$(pwd)/$stage/demo/bin:$PATH"
    if ldd "$(command -v bwrap)" | grep -q 'not found'; then
      export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$(pwd)/$stage/demo/lib"
    fi
    start=$(date +%s)
    XDG_CACHE_HOME="$log/cache" limit "$arcticd" train --device "${DEMO_DEVICE:-cuda:0}" \
      --set steps="${DEMO_STEPS:-10}" --set eval_every=0 --out "$log/demo" \
      > "$log/demo.txt" 2> "$log/demo.err"
    demo_rc=$?
    demo_json=$(python3 - "$log/demo/metrics.jsonl" "$demo_rc" "$(($(date +%s) - start))" "$log/demo.err" << 'PY'
import json, sys
path, rc, secs, err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
rows = []
try:
    rows = [json.loads(l) for l in open(path) if l.strip()]
except OSError:
    pass
steps = [r for r in rows if "pass_rate" in r]
def top(key):
    vals = [r[key] for r in rows if r.get(key) is not None]
    return max(vals) if vals else None
out = {"rc": rc, "seconds": secs, "updates": len(steps),
       "mismatch_same_version_max": top("mismatch_same_version_max"),
       "mismatch_same_version_tokens": sum(r.get("mismatch_same_version_tokens") or 0 for r in steps),
       "probe_mismatch_max": top("probe_mismatch_max"),
       "pass_rate_first": steps[0]["pass_rate"] if steps else None,
       "pass_rate_last": steps[-1]["pass_rate"] if steps else None,
       "stale_dropped": sum(r.get("stale_dropped") or 0 for r in steps),
       "staleness_max": top("staleness_max")}
if rc != 0:
    tail = [l for l in open(err, errors="replace").read().splitlines() if l.strip()][-3:]
    out["error"] = " | ".join(tail)[-400:]
print(json.dumps(out))
PY
    ) || demo_json='{"error":"the metrics could not be read"}'
    [ "$demo_rc" -eq 0 ] || tail -20 "$log/demo.err" >&2
  fi
fi
set -e
grep -v '^Loading' "$log/torch.err" 2> /dev/null | tail -20 >&2 || true
decode=$(paste -sd, "$log/decode.txt")
train=$(paste -sd, "$log/train.txt")
torch=$(paste -sd, "$log/torch.txt")
fla=$(paste -sd, "$log/fla.txt")
printf '{"gpu":"%s","tests":{"rc":%d,"passed":%d,"failed":%d,"failures":[%s]},"bench_rc":%d,"hbm_tb_s":%s,"benches":[%s],"gated_delta_fla":[%s],"decode":[%s],"train":[%s],"train_torch":[%s],"sft_vs_pytorch_max_rel_loss_diff":%s,"demo":%s}\n' \
  "$gpu" "$tests_rc" "$passed" "$failed" "$failures" "$bench_rc" "${HBM_TBS:-4.8}" "$benches" "$fla" "$decode" "$train" "$torch" "$sft_diff" "$demo_json"
[ "$tests_rc" -eq 0 ] && [ "$bench_rc" -eq 0 ] && [ "$demo_rc" -eq 0 ]
