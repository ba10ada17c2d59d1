#!/usr/bin/env bash
# A GPU session (H100/H200) for the Pallas path: versions, the compiled tests, the step benchmark.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh [stages...]
#
# Stages, in this order: versions pytest bench offload bench_many tuning pretrain. Default: versions
# pytest bench offload, which fits one 10-minute call; bench_many (1,000 leaves: XLA alone compiles
# such a step for about 2 minutes on an H100), tuning and pretrain each take a call of their own:
#   call 1: bash benchmarks/gpu_session.sh            call 2: bash benchmarks/gpu_session.sh bench_many
# Run from anywhere (it cd's to the repository root); needs no network. Everything a stage prints is
# also teed into $OUT/<stage>.txt; the benchmark writes $OUT/gpu_<case>.json, the tuning
# $OUT/tuning.json. Each stage has its own time limit; a stage that fails or times out does not stop
# the next one (the exit status is the first failure's). Commit the JSON as
# benchmarks/results/<device>.json (python -m benchmarks.step --json-auto names it). The pretrain
# stage writes $OUT/pretrain_bench.json (tokens/s, MFU, optimizer share) and skips without a GPU.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# tests/conftest.py defaults JAX_PLATFORMS to cpu: ask for the GPU explicitly.
export JAX_PLATFORMS=cuda
STAGES="${*:-versions pytest bench offload}"
status=0
stage() {  # stage NAME LIMIT_S CMD...: run CMD with a time limit, tee into $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
  case " $STAGES " in *" $name "*) ;; *) return 0 ;; esac
  echo "=== $name ($(date -u +%H:%M:%S), limit ${limit}s): $*" | tee -a "$OUT/$name.txt"
  timeout "$limit" "$@" 2>&1 | tee -a "$OUT/$name.txt"
  local rc=${PIPESTATUS[0]}
  echo "=== $name exit $rc" | tee -a "$OUT/$name.txt"
  if [ "$rc" -ne 0 ] && [ "$status" -eq 0 ]; then status=$rc; fi
}

stage versions 60 bash -c '
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.memory --format=csv || true
  python3 - <<EOF
import importlib, platform, sys
print("python", sys.version.split()[0], platform.machine())
for name in ("jax", "jaxlib", "jax_cuda13_plugin", "jax_cuda12_plugin", "triton", "optax", "flax", "numpy"):
  try:
    print(name, importlib.import_module(name).__version__)
  except Exception as e:
    print(name, "-", type(e).__name__)
import jax
print("backend", jax.default_backend(), "devices", jax.devices())
EOF'

# The compiled kernels (TestPallasGPU) and the dispatcher; the interpreted twin runs in CPU CI.
stage pytest 400 python3 -m pytest -q -rs -p no:cacheprovider --durations=8 -k "not Interpret" \
  tests/backends/test_pallas_kernels.py tests/backends/test_conformance.py::TestPallasCompiled \
  tests/backends/test_dispatch.py tests/integration/test_sharded_jit.py

# What users see: device-only and end-to-end step time, buffers, kernels (benchmarks/step.py).
IMPLS="optax.lamb optax_lamb.lamb update_and_apply xla.lamb optax_lamb.lamb-bf16"
# shellcheck disable=SC2086
stage bench 300 python3 -m benchmarks.step --cases bert-large bert-base --impls ${BENCH_IMPLS:-$IMPLS} \
  --json "$OUT/gpu_bert.json"
# The state in host memory (optax_lamb.offload), both modes beside the on-device step, and the
# host-device link's bandwidth (a round trip to pinned_host memory) in the same run.
stage offload 240 python3 -m benchmarks.step --cases bert-large \
  --impls optax_lamb.lamb offload.device offload.host --json "$OUT/gpu_offload.json"
stage bench_many 500 python3 -m benchmarks.step --cases 1000x1000 \
  --impls optax.lamb optax_lamb.lamb update_and_apply --json "$OUT/gpu_many.json"

# Launch configurations of the Pallas path, device-only.
stage tuning 500 python3 -m benchmarks.pallas_tuning --cases bert-large \
  --variants ${TUNING_VARIANTS:-default pass2-all-xla pass2-all-kernel leaves-64} \
  --json "$OUT/tuning.json"

# BERT-base phase 1 through the pretrain command's own jitted step, LAMB and AdamW: tokens/s per
# device, MFU, and the optimizer's share of a step without accumulation (pretrain/bench.py).
stage pretrain 500 python3 -m optax_lamb_recipes.pretrain.bench --preset base --opts lamb adamw \
  --steps 30 --require-gpu --json "$OUT/pretrain_bench.json"

echo "done $(date -u +%H:%M:%S), status $status; files in $OUT:" && ls -l "$OUT"
exit "$status"
