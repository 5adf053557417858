#!/usr/bin/env bash
# Issue 21 on the GPU (nvidia-h200), one call: the parity test and a bisect of the bf16 gap.
#
#   bash dev/fidelity_gpu.sh
#
# The bisect trains the "small" Llama (6 layers, 25M) in bf16 for 150 steps at seq 512 from one
# initial state: stock, stock again (kernel nondeterminism alone), stock at batch 4 x 2 (the
# band), streamed, and streamed with one feature changed at a time. Summary lines on stdout; CSV
# and PNG under $OUT/bisect.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out/bisect"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 300 python3 benchmarks/loss_curves.py --family llama --size small --seq-len 512 \
  --steps 150 --bf16 --repeat-stock --out "$out/bisect" \
  --variant hbm:resident_layers=6 \
  --variant hbm-keep:resident_layers=6,keep_activations=6 \
  --variant no-fused-loss:fused_loss=false 2>&1 | grep -v Warning | tail -12
