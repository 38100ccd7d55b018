#!/usr/bin/env bash
# One command on a bare GPU machine (torch, triton, transformers; no internet): first the GPU
# correctness tests (tests/gpu: Triton kernels and whole models in bf16, CUDA graphs), then the
# suite in bench/gpu_bench.py on random-weight checkpoints of Llama-3.1-8B and Qwen3-0.6B shape.
# Records append to bench/results.json; with $OUT set (the device tool) a copy and the test log
# land there. The exit status is the tests' (the benchmark runs whatever they say).
#   bash bench/run_gpu.sh                      # both models
#   bash bench/run_gpu.sh --models qwen3-0.6b  # arguments go to gpu_bench.py
set -euo pipefail
cd "$(dirname "$0")/.."

# shardserve without pip install: a namespace folder whose subpackages are this checkout's
shim=$(mktemp -d)
mkdir -p "$shim/shardserve"
for part in planner runtime launch; do ln -s "$PWD/$part" "$shim/shardserve/$part"; done
if compgen -G ".whl/*.whl" > /dev/null; then  # wheels carried for packages the image lacks
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$shim" .whl/*.whl
fi
export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
tests_status=0
if python3 -c "import pytest" 2> /dev/null; then
  log="${OUT:-$(mktemp -d)}/gpu_tests.log"
  python3 -m pytest -q -rs -p no:cacheprovider tests/gpu 2>&1 | tee "$log" || tests_status=$?
else
  echo "pytest is not installed here: tests/gpu not run (carry its wheel in .whl)"
fi
python3 bench/gpu_bench.py "$@"
if [ -n "${OUT:-}" ]; then cp bench/results.json "$OUT/"; fi
exit "$tests_status"
