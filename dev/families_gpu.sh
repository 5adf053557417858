#!/usr/bin/env bash
# The CUDA checks of families added to SUPPORTED_MODEL_TYPES (device tool, one GPU):
#
#   bash dev/families_gpu.sh tests TYPE ...   # test_gpu.py's stock-parity case for each type,
#                                             # with the save cases and the second-gradient case
#   bash dev/families_gpu.sh sweep TYPE ...   # dev/family_plan_sweep.py on CUDA at hidden 1,024
#                                             # (8 heads of 128, 2 kv heads, MLP 4,096), 16,384
#                                             # tokens: each family's step against its plan
#
# Types the installed transformers lacks are skipped. Output: $OUT/families-<phase>.{log,md}.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: tests | sweep}
shift
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
types=$(python3 -c "import sys; from transformers import CONFIG_MAPPING as M; \
print(' '.join(t for t in sys.argv[1:] if t in M))" "$@")
echo "types here: $types"
case "$phase" in
  tests)
    k=$(for t in $types; do printf 'every_family_trains_like_stock_on_gpu and %s] or ' "$t"; done)
    timeout 560 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
      -k "${k}shard_at_a_time or save_resume_on_gpu or two_forwards" 2>&1 \
      | grep -v '^DEBUG' >"$out/families-tests.log"
    grep -aE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)" "$out/families-tests.log" | tail -60
    ;;
  sweep)
    # shellcheck disable=SC2086
    timeout 560 python3 dev/family_plan_sweep.py --device cuda --widths 1024,8,2,128,4096 \
      --tokens 16384 --markdown "$out/families-sweep.md" $types 2>&1 \
      | grep -v '^DEBUG' | tee "$out/families-sweep.log" | grep -a "ratio"
    ;;
esac
