#!/usr/bin/env bash
# Where a long-context step's GPU time goes (issue 21: the 7B's 524,288-token step at 35.9% MFU
# against 40%). One device call, any one-GPU kind (the kernels' speed is the same on H100 and
# H200; the memory options auto_fit picks are not):
#
#   BENCH_COMMIT=<hash> bash dev/long_profile_gpu.sh [tokens]    # default 131072
#
# 1. dev/attention_speed_probe.py: SDPA's causal GQA attention alone (Qwen2.5-7B's 28/4 heads),
#    per backend, at 131,072 and 524,288 tokens ($OUT/attention.jsonl).
# 2. Qwen2.5-7B at one sequence of [tokens] on the defaults, the last warm-up step traced
#    (bench.py --profile), then benchmarks/trace_overlap.py --top 30 on the trace: GPU time by
#    kernel family against the step ($OUT/trace.txt, the row in $OUT/bench/).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
tokens=${1:-131072}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
{
  timeout 120 python3 dev/attention_speed_probe.py --tokens 131072
  timeout 150 python3 dev/attention_speed_probe.py --tokens 524288 --backends default,cudnn
} 2>&1 | tee "$out/attention.jsonl"
timeout 330 python3 benchmarks/bench.py --tag "profile${tokens}" \
  --run "qwen2.5-7b:$tokens:megatrain-hbm:1" --seq-len "$tokens" --steps 1 --warmup 2 \
  --streamed-init --profile --timeout-s 320 --results-dir "$out/bench" >"$out/bench.log" 2>&1
grep -aE "^bench|placement|auto_fit|step_times|gpu_busy" "$out/bench.log" | tail -8
trace=$(ls "$out"/bench/traces/*.gz benchmarks/results/traces/*.gz 2>/dev/null | tail -1)
[ -n "$trace" ] && python3 benchmarks/trace_overlap.py --top 30 "$trace" | tee "$out/trace.txt"
[ -n "$trace" ] && cp "$trace" "$out/"
