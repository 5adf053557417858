#!/usr/bin/env bash
# GPU evidence that a refactor changed no behaviour, in two device calls (nvidia-h200):
#
#   bash dev/arch_check.sh gpu-tests        # the GPU test suite on this tree (~8 min)
#   BENCH_COMMIT=<new> BASE_COMMIT=<old> bash dev/arch_check.sh ab7b   # carry runs/baseline
#
# ab7b times Qwen2.5-7B at 64k tokens/step (one micro-batch of 16 sequences of 4096, HBM tier,
# default engine options) with this tree, then with the tree in runs/baseline (made here with
# `git archive <old> | tar -x -C runs/baseline --exclude='benchmarks/results/*'`), then this
# tree again: before/after on the same machine in one call. Results: $OUT/<side>/results.csv.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: gpu-tests | ab7b}
out=${OUT:-/tmp/out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 BENCH_MIRROR=0

case "$phase" in
  gpu-tests)
    timeout 560 python3 -m pytest tests/test_gpu.py tests/test_packing.py -k "not liger" \
      -o addopts="" -p no:cacheprovider -rA -q --durations=10 >"$out/gpu-tests.log" 2>&1
    grep -aE "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$out/gpu-tests.log" | tail -30
    ;;
  ab7b)
    run() {  # run <side> <tree> <commit>
      (cd "$2" && BENCH_COMMIT=$3 PYTHONPATH=$PWD timeout 200 python3 benchmarks/bench.py \
        --tag "ab7b-$1" --streamed-init --steps 3 --warmup 2 --timeout-s 190 \
        --run qwen2.5-7b:65536:megatrain-hbm:16 --results-dir "$out/$1") 2>&1 | grep "^bench:"
    }
    run after . "${BENCH_COMMIT:-unknown}"
    run before runs/baseline "${BASE_COMMIT:-unknown}"
    run after2 . "${BENCH_COMMIT:-unknown}"
    ;;
esac
