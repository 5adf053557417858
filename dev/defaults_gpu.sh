#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for issues 20 and 21:
#
#   BENCH_COMMIT=<hash> bash dev/defaults_gpu.sh
#
# 1. tests/test_gpu_parity.py: bf16 streamed vs stock over 150 steps, 3 families (issue 21).
# 2. Llama-3.1-8B at 65,536 tokens/step with no engine flag (the defaults), without and then
#    with liger-kernel installed (issue 20's targets: >= 430 / >= 480 model TFLOP/s).
# 3. tests/test_gpu.py's defaults test, with liger installed.
# .whl/ holds datasets, dill, multiprocess, trl and liger_kernel wheels; liger goes in last.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 240 python3 -m pytest tests/test_gpu_parity.py -o addopts="" -p no:cacheprovider -q -s \
  -rA 2>&1 | grep -aE "streamed max rel|passed|failed|XPASS|XFAIL|Error" | tail -8
bench() {  # bench <tag>
  timeout 170 python3 benchmarks/bench.py --tag "$1" --streamed-init --steps 3 --warmup 1 \
    --timeout-s 165 --run llama-3.1-8b:65536:megatrain-hbm --results-dir "$out/$1" 2>&1 \
    | grep -aE "^bench|Liger-Kernel|placement|attention outputs" | tail -6
}
bench defaults-noliger
with_liger
bench defaults-liger
timeout 120 python3 -m pytest tests/test_gpu.py -k "defaults_on_gpu" -o addopts="" \
  -p no:cacheprovider -q 2>&1 | grep -aE "^(FAILED|ERROR)|[0-9]+ (passed|failed)" | tail -12
