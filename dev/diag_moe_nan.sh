#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl): does OLMoE-1B-7B's first step give a non-finite loss
# at 131,072 tokens with HBM-tier layers (the matrix at 4ced842: 8 HBM-tier layers, step 1
# skipped as non-finite; at 262,144 with none: finite), and without them? Then the GPU watchdog
# tests. Prints each run's placement, skips and losses.
source "$(dirname "$0")/device_env.sh"
b() { timeout "$1" python3 benchmarks/bench.py --system megatrain-hbm --model olmoe-1b-7b-0924 \
  --micro-batch 1 --steps 1 --warmup 1 --seed 0 --device auto --lr 1e-05 --streamed-init \
  --results-dir "$out/diag" "${@:2}" 2>&1 \
  | grep -aE "placement|non-finite|train_loss|ran out|Error|: ok|failed" | cut -c1-240; }
echo "== watchdog tests"; bash "$(dirname "$0")/watchdog_gpu.sh" out_of_memory_recovery_on_gpu
echo "== 128k defaults"; b 100 --seq-len 131072 --tokens-per-step 131072
[ "${STREAMED:-0}" = 1 ] && { echo "== 128k, every layer streamed"
  b 100 --seq-len 131072 --tokens-per-step 131072 --resident-layers 0; }
