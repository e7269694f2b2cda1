#!/usr/bin/env bash
# The checks that need a GPU, as one short script: run it on a machine with
# an NVIDIA GPU, the CUDA 13 driver and NVRTC on the loader path (PyPI's
# nvidia-cuda-nvrtc wheel puts libnvrtc in nvidia/cu13/lib). Every GPU test
# compares a CUDA op with its CPU reference; with ARCTICD_REQUIRE_GPU set a
# missing device is a failure, not a skip.
#
#   bash scripts/gpu-check.sh            # build, then the GPU tests
#   BIN_ONLY=1 bash scripts/gpu-check.sh # build the test binary only (no GPU)
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${NVRTC_LIB:-}" ]; then
  NVRTC_LIB=$(python3 -c 'import nvidia, os; print(os.path.join(list(nvidia.__path__)[0], "cu13", "lib"))' 2>/dev/null || true)
fi
[ -n "$NVRTC_LIB" ] && export LD_LIBRARY_PATH="$NVRTC_LIB:${LD_LIBRARY_PATH:-}"
cargo test --release -p arcticd-kernels --features cuda --no-run
[ -n "${BIN_ONLY:-}" ] && exit 0
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
ARCTICD_REQUIRE_GPU=1 ARCTICD_REQUIRE_NVRTC=1 \
  cargo test --release -p arcticd-kernels --features cuda -- cuda:: --test-threads 1
