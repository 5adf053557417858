#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for issue 20's ">= 1.1x the stock Trainer":
#
#   BENCH_COMMIT=<hash> bash dev/stock_pair_gpu.sh [then: gpu-tests]
#
# 1. stock vs hf_megatrain's defaults side by side, both as a user gets them without
#    liger-kernel (stock: PyTorch's kernels; hf_megatrain: layer_kernels auto = compiled):
#    Qwen2.5-7B at 8k and Qwen2.5-3B at 64k tokens/step (the two closest pairs so far).
#    Rows in $OUT/bench/results.csv, output in $OUT/bench.log.
# 2. with "gpu-tests": the whole GPU suite after (dev/front_door_gpu.sh gpu-tests).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
timeout 330 python3 benchmarks/bench.py --tag stockpair --streamed-init --steps 3 --warmup 2 \
  --timeout-s 150 --run qwen2.5-7b:8192:stock,megatrain-hbm:2 \
  --run qwen2.5-3b:65536:stock,megatrain-hbm:16 --results-dir "$out/bench" >"$out/bench.log" 2>&1
grep -aE "^bench: (megatrain|stock)" "$out/bench.log" | tail -4
if [ "${1:-}" = gpu-tests ]; then
  bash dev/front_door_gpu.sh gpu-tests
fi
