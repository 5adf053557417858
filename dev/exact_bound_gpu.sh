#!/usr/bin/env bash
# Issue 21's exact long-context runs, longer together than one device command (nvidia-h200,
# carry .whl; liger-kernel from its wheel):
#
#   BENCH_COMMIT=<hash> bash dev/exact_bound_gpu.sh start   # starts the queue, waits ~560 s
#   BENCH_COMMIT=<hash> bash dev/exact_bound_gpu.sh wait    # again, within the 30 s idle window
#
# The queue (one process group under setsid; the device tool leaves it running while the
# machine is held), each run one step, fp32 boundaries, clipping on:
# 1. Qwen2.5-1.5B at one 1,048,576-token sequence, the defaults (auto_fit picks the options).
# 2. Qwen2.5-7B at 458,752 tokens, the defaults: the plan's longest exact length (lower bound).
# 3. Qwen2.5-7B at 475,136 tokens, --auto-fit off with the options auto picks at 458,752 and
#    the HBM tier the plan gives them: the plan's host side is 4.60 GiB short (upper bound).
# Every call packs what has finished into $OUT/exact-bound.tgz (rows, markdown, the log).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
with_liger
work=/tmp/exact-bound
mode=${1:?start | wait}  # (queue: the runs themselves, started by start)

run() {  # run <tag> <model:tokens> <timeout> [bench args]
  local tag=$1 spec=$2 limit=$3
  shift 3
  python3 benchmarks/bench.py --tag "$tag" --run "$spec:megatrain-hbm:1" \
    --seq-len "${spec##*:}" --steps 1 --warmup 0 --timeout-s "$limit" \
    --results-dir "$work/results" "$@"
}

if [ "$mode" = queue ]; then
  run exact1m qwen2.5-1.5b:1048576 1300
  run exact459k qwen2.5-7b:458752 700 --streamed-init
  run over475k qwen2.5-7b:475136 300 --streamed-init --auto-fit off --mlp-tile-tokens 16384 \
    --offload-activations --stream-fp32-master --checkpoint-every 4
  echo "queue done"
  exit 0
fi
if [ "$mode" = start ]; then
  rm -rf "$work" && mkdir -p "$work/results"
  setsid nohup bash "$0" queue >"$work/queue.log" 2>&1 </dev/null &
  sleep 5
fi
waited=0
while ! grep -q "queue done" "$work/queue.log" && [ "$waited" -lt "${WAIT_S:-555}" ]; do
  sleep 5
  waited=$((waited + 5))
done
grep -q "queue done" "$work/queue.log" || echo "queue still running after ${waited}s"
free -g | head -2
grep -aE "^bench|placement|auto_fit|Error|error:|Killed|out of memory" "$work/queue.log" | tail -20
tar czf "$out/exact-bound.tgz" -C "$work" .
