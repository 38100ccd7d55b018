#!/usr/bin/env bash
# One command on a bare GPU machine (torch, triton, transformers; no internet): the suite in
# bench/gpu_bench.py on random-weight checkpoints of Llama-3.1-8B and Qwen3-0.6B shape.
# Records append to bench/results.json; with $OUT set (the device tool) a copy lands there.
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
python3 bench/gpu_bench.py "$@"
if [ -n "${OUT:-}" ]; then cp bench/results.json "$OUT/"; fi
