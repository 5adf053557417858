#!/usr/bin/env bash
# Issue 21 on the GPU (nvidia-h200), one call: a bisect of a family's bf16 gap to stock.
#
#   bash dev/fidelity_gpu.sh [family]       # default llama; gemma2, qwen3, mixtral, qwen3_moe
#
# Trains the family's "small" config (6 layers, ~25M) in bf16 for 150 steps at seq 512 from one
# initial state: stock and its equivalent batchings 4 x 2, 2 x 4 and 1 x 8 (the band: three
# twins of stock), streamed, and streamed with one feature changed at a time: every layer in the
# HBM tier (no streaming; the small dense configs have 6) and the attention option at its default
# (FlexAttention where the model soft-caps or slides: the parity curves otherwise keep the
# model's, eager for Gemma-2). At 246d4a7 kept activations and the model's own loss gave curves
# equal to these. Summary lines (parity's mean-based ratios) on stdout; CSV and PNG under
# $OUT/bisect-<family>.
set -uo pipefail
cd "$(dirname "$0")/.."
family=${1:-llama}
out=${OUT:-/tmp/out}/bisect-$family
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 420 python3 benchmarks/loss_curves.py --family "$family" --size small --seq-len 512 \
  --steps 150 --bf16 --band-accums 2,4,8 --out "$out" \
  --variant hbm:resident_layers=6 \
  --variant attention-auto:attention=auto 2>&1 | grep -v Warning | tail -${TAIL_LINES:-14}
