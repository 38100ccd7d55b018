#!/usr/bin/env bash
# The GPU run in parts, each one device call of well under 10 minutes, issued back to back (an idle
# machine is given back after 30 s; a bare one rebuilds the checkpoints under $TMPDIR):
#   1  tests/gpu (Triton kernels and whole models in bf16, CUDA graphs), 300 s per test at most
#   2  Llama-3.1-8B shape: batch-1 decode, eager and CUDA graphs, against the measured HBM roofline
#   3  Llama-3.1-8B shape: offline 1000 x 128/128 beside transformers' generate_batch
#   4  Qwen3-0.6B shape: batch-1 decode; offline 128/128 and 1024/128 beside transformers
#   5  Llama-3.1-8B shape: serving at concurrency 1, 16, 64 through `shardserve launch`
#   6  Llama-3.1-8B attention shapes: the decode, prefill, rotary+KV and SiLU kernels alone (bench/kernel_bench.py)
#   7  `shardserve calibrate`: this runtime's operators on this GPU, to $OUT/calibration-<gpu>.json (else --workdir)
#      and, with $OUT set, to the file `plan` reads on this machine too (part 8 uses it while the machine is warm)
#   8  Llama-3.1-8B shape: the plan's decode step beside the engine's at batches 1, 8, 32, 128 (bench/plan_vs_engine.py)
#   quick  the first run on a lent GPU, at most 7 minutes, each step bounded: tests/gpu's kernels and the
#          Llama family in bf16 against transformers (eager and graphs); the Llama-3.1-8B shape with
#          --load-format dummy: batch-1 decode (eager, graphs) against the measured HBM roofline, offline
#          1000 x 128/128 (plain and async scheduling), then transformers' generate_batch on the same
#          prompts; each record beside the plan's prediction, in $OUT/results.json as it is measured
# Records append to bench/results.json as each is measured; with $OUT set (the device tool) a copy,
# the test log and the server log land there. Arguments after the part go to gpu_bench.py.
#   bash bench/run_gpu.sh --part 2
#   PYTHON=.venv/bin/python bash bench/run_gpu.sh --part 4 --small --device cpu   # smoke run on a CPU
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--quick" ]; then
  part=quick
  shift
elif [ "${1:-}" != "--part" ] || [ -z "${2:-}" ]; then
  sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
else
  part=$2
  shift 2
fi
case "$part" in 1|2|3|4|5|6|7|8|quick) ;; *) echo "unknown part $part: use 1 to 8, or --quick" >&2; exit 2 ;; esac
py=${PYTHON:-python3}

if ! "$py" -c "import shardserve.runtime" 2> /dev/null; then
  # shardserve without pip install: a namespace folder whose subpackages are this checkout's
  shim=$(mktemp -d)
  mkdir -p "$shim/shardserve"
  for pkg in planner runtime launch; do ln -s "$PWD/$pkg" "$shim/shardserve/$pkg"; done
  if compgen -G ".whl/*.whl" > /dev/null; then  # wheels carried for packages the image lacks
    "$py" -m pip install -q --no-index --no-deps --no-compile --target "$shim" .whl/*.whl
  fi
  export PYTHONPATH="$shim${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONUNBUFFERED=1 TRITON_INTERPRET=0

bench() { "$py" bench/gpu_bench.py "$@"; }
bounded() {  # bounded SECONDS CMD...: a step that runs past its share is stopped, and the run goes on
  local rc=0
  timeout -k 10 "$@" || rc=$?
  if [ "$rc" = 124 ]; then echo "STOPPED after $1 s: ${*:2}"; fi
  if [ "$rc" != 0 ]; then status=$rc; fi
}
quick() {
  # gpu_bench's arguments pass on (--small --device cpu: the rehearsal on a CPU)
  local results="${OUT:-bench}/results.json" log="${OUT:-$(mktemp -d)}/gpu_tests.log" flags=()
  if "$py" -c "import pytest_timeout" 2> /dev/null; then flags=(--timeout=100); fi
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.mem --format=csv,noheader || true
  bounded "${QUICK_TESTS_S:-130}" "$py" -m pytest -q -rs -p no:cacheprovider "${flags[@]}" \
    tests/gpu/test_gpu_model.py tests/gpu/test_gpu_kernels.py tests/gpu/test_gpu_fused_kernels.py \
    tests/gpu/test_gpu_gated_delta.py -k "not (qwen3 or gemma2 or gemma3 or phi3 or deepseek_v3 or gpt_oss)" \
    2>&1 | tee "$log"
  local eight=(--model llama-3.1-8b --load-format dummy --results "$results" "$@")
  bounded "${QUICK_DECODE_S:-100}" "$py" bench/gpu_bench.py decode "${eight[@]}"
  bounded "${QUICK_OFFLINE_S:-140}" "$py" bench/gpu_bench.py offline --skip-hf "${eight[@]}"
  bounded "${QUICK_HF_S:-80}" "$py" bench/gpu_bench.py offline-hf "${eight[@]}"
}
calibrate() {
  # gpu_bench's arguments, as calibrate takes them: --small (--sizes small), --device D; the file goes
  # to $OUT, else --workdir, else calibrate's own folder (the one `plan` reads)
  local device=auto sizes=() output=() folder="${OUT:-}" gpu
  while [ $# -gt 0 ]; do
    case "$1" in
      --small) sizes=(--sizes small) ;;
      --device) device=$2; shift ;;
      --workdir) folder=${folder:-$2}; shift ;;
    esac
    shift
  done
  if [ -n "$folder" ]; then
    gpu=$("$py" -c "import sys, torch; from shardserve.launch.calibrate import gpu_name
d = sys.argv[1] if sys.argv[1] != 'auto' else ('cuda' if torch.cuda.is_available() else 'cpu')
catalog, name = gpu_name(d); print((catalog or name).lower().replace(' ', '-'))" "$device")
    output=(--output "$folder/calibration-$gpu.json")
  fi
  "$py" -m shardserve.launch calibrate --device "$device" "${sizes[@]}" "${output[@]}"
  if [ -n "${OUT:-}" ]; then  # and where `plan` reads it on this machine, for part 8
    "$py" -c "import shutil, sys; from shardserve.planner.calibration import calibration_path, read_calibration
data = read_calibration(sys.argv[1]); path = calibration_path(data['gpu']); path.parent.mkdir(parents=True, exist_ok=True)
shutil.copy(sys.argv[1], path)" "$OUT/calibration-$gpu.json"
  fi
}
status=0
case "$part" in
  1)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    timeout_flag=()
    if "$py" -c "import pytest_timeout" 2> /dev/null; then timeout_flag=(--timeout=300); fi
    log="${OUT:-$(mktemp -d)}/gpu_tests.log"
    "$py" -m pytest -q -rs -p no:cacheprovider "${timeout_flag[@]}" tests/gpu 2>&1 | tee "$log" \
      || status=$?
    ;;
  2) bench decode --model llama-3.1-8b "$@" ;;
  3) bench offline --model llama-3.1-8b --shapes 128/128 "$@" ;;
  4)
    bench decode --model qwen3-0.6b "$@"
    bench offline --model qwen3-0.6b --shapes 128/128 1024/128 "$@"
    ;;
  5) bench serve --model llama-3.1-8b "$@" ;;
  6) "$py" bench/kernel_bench.py "$@" ;;
  7) calibrate "$@" ;;
  8) bench steps --model llama-3.1-8b "$@" ;;
  quick) quick "$@" ;;
esac
# (--quick writes its records to $OUT/results.json itself: the checkout's file must not overwrite them)
if [ "$part" != quick ] && [ -n "${OUT:-}" ] && [ -f bench/results.json ]; then cp bench/results.json "$OUT/"; fi
exit "$status"
