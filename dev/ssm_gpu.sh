#!/usr/bin/env bash
# The state-space families' CUDA checks (device tool, one GPU; 2026-12-07, 51st session):
#
#   bash dev/ssm_gpu.sh [TOKENS]
#
# test_gpu.py's stock-parity case for each (dev/families_gpu.sh tests), then
# dev/family_plan_sweep.py on CUDA at hidden 1,024 (Mamba-2 mixers of 32 heads of 64, state 128,
# chunks of 256: tests/test_plan_accuracy.py::ssm_widths) at TOKENS (default 1,024: transformers
# 5.17's broadcast chunk scan holds chunk x heads x state fp32 elements per token), then the
# Gemma 4 wide-head case. Output under $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
types="mamba2 bamba granitemoehybrid nemotron_h falcon_h1 mamba falcon_mamba jamba"
# shellcheck disable=SC2086
bash dev/families_gpu.sh tests $types
for tokens in ${1:-1024}; do
  # shellcheck disable=SC2086
  timeout 300 python3 dev/family_plan_sweep.py --device cuda --widths 1024,8,2,128,4096 \
    --tokens "$tokens" --markdown "$out/ssm-sweep-$tokens.md" $types 2>&1 | grep -v '^DEBUG' \
    | tee "$out/ssm-sweep-$tokens.log" | grep -aE "ratio|error"
done
timeout 200 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
  -k "gemma4_wide" 2>&1 | grep -v '^DEBUG' | tail -15
