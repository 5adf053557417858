#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl): one phase of the validation matrix:
#
#   BENCH_COMMIT=<hash> bash dev/matrix_gpu.sh 1/2        # then 2/2 (K/N: the K-th of N)
#   BENCH_COMMIT=<hash> bash dev/matrix_gpu.sh 1/1 --families qwen3 --seq-lens 4k,32k
#   BENCH_COMMIT=<hash> bash dev/matrix_gpu.sh 1/1 --cells mistral:32k,phi3:256k
#
# benchmarks/validation_matrix.py: 5 families x 4k/32k/128k/256k tokens with hf_megatrain's
# defaults (no engine flag, random init, bf16, one sequence per step, one step), each cell a
# bench.py worker; `--dry-run` here lists the cells, the planner's verdicts, estimates and
# phases. Arguments after the phase go to the matrix. liger-kernel is not installed: the
# defaults of a plain `pip install hf_megatrain`. Rows, the phase's markdown and the workers'
# log land in $OUT/matrix-<K>of<N>/; the cells' progress lines and the matrix are printed.
# .whl holds datasets, dill and multiprocess (hf_megatrain's dependencies the image lacks).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
phase=${1:-1/1}
shift || true
out=$out/matrix-${phase/\//of}
mkdir -p "$out"
tag=matrix-${BENCH_TAG:-h200}
# The budget leaves room for the install, the plan and the last cell's teardown (600 s a call).
timeout 565 python3 benchmarks/validation_matrix.py --phase "$phase" \
  --max-wall-s "${MAX_WALL_S:-520}" --tag "$tag" --results-dir "$out" "$@" 2>&1 \
  | grep -aE "^(matrix|Traceback|[A-Za-z.]*Error)"
python3 benchmarks/validation_matrix.py --summarize "$out/results.csv" --tag "$tag" \
  --markdown "$out/matrix.md" >/dev/null 2>&1 \
  && sed -n '/^| family/,/^\*\*promise/p' "$out/matrix.md"
