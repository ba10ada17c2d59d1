#!/usr/bin/env bash
# One call on a lent GPU (H100/H200): versions, the Pallas tests compiled, then the step benchmark.
#
#   OUT=/some/dir bash benchmarks/gpu_session.sh
#
# Run from anywhere (it cd's to the repository root); needs no network. Everything it prints is
# also teed into $OUT: versions.txt, pytest.txt, bench.txt, bench_large.txt, and the benchmark
# results gpu.json (BERT-base, 1000x1000, huge-64M) and gpu_bert_large.json. Each stage has its
# own time limit so the whole script stays under 10 minutes; a stage that fails or times out does
# not stop the next one (the exit status is the first failure's).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-$PWD/gpu_out}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# tests/conftest.py defaults JAX_PLATFORMS to cpu: ask for the GPU explicitly.
export JAX_PLATFORMS=cuda
status=0
stage() {  # stage NAME LIMIT_S CMD...: run CMD with a time limit, tee into $OUT/NAME.txt
  local name=$1 limit=$2
  shift 2
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

# TestPallasGPU compiles the kernels (TestPallasInterpret runs them interpreted on the GPU backend).
stage pytest 240 python3 -m pytest -q -rs -p no:cacheprovider --durations=10 tests/test_pallas.py

IMPLS="optax.lamb optax_lamb.lamb update_and_apply pallas.lamb pallas.apply"
# shellcheck disable=SC2086
stage bench 150 python3 -m benchmarks.step --skip-large --impls $IMPLS --json "$OUT/gpu.json"
# shellcheck disable=SC2086
stage bench_large 100 python3 -m benchmarks.step --cases bert-large --impls $IMPLS \
  --json "$OUT/gpu_bert_large.json"

echo "done $(date -u +%H:%M:%S), status $status; files in $OUT:" && ls -l "$OUT"
exit "$status"
