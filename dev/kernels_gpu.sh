#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for issue 20's "fast by default" layer kernels:
#
#   BENCH_COMMIT=<hash> bash dev/kernels_gpu.sh [models]
#
# 1. tests/test_gpu.py: the compiled kernels (Inductor) and the defaults test, no liger-kernel;
# 2. each model (default llama-3.1-8b) at 65,536 tokens/step, one call, side by side:
#    --layer-kernels torch, the defaults without liger-kernel (compiled kernels), then the
#    defaults with liger-kernel installed (Liger's). Rows in $OUT/bench/results.csv, the
#    runs' output in $OUT/bench.log.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 200 python3 -m pytest tests/test_gpu.py -k "compiled_kernels or defaults_on_gpu" \
  -o addopts="" -p no:cacheprovider -q -rA >"$out/gpu-tests.log" 2>&1
grep -aE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)|Error:" "$out/gpu-tests.log" | tail -10
bench() {  # bench <tag> <model> [engine flags]
  local tag=$1 model=$2
  shift 2
  timeout 200 python3 benchmarks/bench.py --tag "$tag" --streamed-init --steps 3 --warmup 1 \
    --timeout-s 195 --run "$model:65536:megatrain-hbm" --results-dir "$out/bench" "$@" \
    >"$out/run.log" 2>&1
  cat "$out/run.log" >>"$out/bench.log"
  grep -aE "^bench|layer kernels|placement|step_times|compiled" "$out/run.log" | tail -6
  rm -f "$out/run.log"
}
for model in ${1:-llama-3.1-8b}; do
  bench kern-torch "$model" --layer-kernels torch
  bench kern-compiled "$model"
done
with_liger
for model in ${1:-llama-3.1-8b}; do
  bench kern-liger "$model"
done
