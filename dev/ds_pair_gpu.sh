#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl with DeepSpeed: ../shared/tools/device-wheels.sh)
# for issue 20's ">= 4x DeepSpeed ZeRO-3 offload at 1.5B and 3B, 16k" target, side by side:
#
#   BENCH_COMMIT=<hash> bash dev/ds_pair_gpu.sh [models]   # default: qwen2.5-1.5b qwen2.5-3b
#
# Qwen2.5-1.5B and -3B at 16,384 tokens/step (4 x 4096): DeepSpeed ZeRO-3 with parameter and
# optimizer offload (bench.py's config), hf_megatrain's defaults without liger-kernel (compiled
# kernels), then with it (Liger's). Rows in $OUT/bench/results.csv, the runs' output in
# $OUT/bench.log; the rows' lines are printed.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
export DS_SKIP_CUDA_CHECK=1
# DeepSpeed JIT-builds its CPUAdam op on first use: once, here, outside the runs' timers.
start=$(date +%s)
python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
  >"$out/cpu_adam_build.log" 2>&1 || tail -5 "$out/cpu_adam_build.log"
echo "CPUAdam ready in $(( $(date +%s) - start )) s"
bench() {  # bench <tag> <--run specs...>
  local tag=$1
  shift
  timeout 420 python3 benchmarks/bench.py --tag "$tag" --streamed-init --steps 3 --warmup 1 \
    --timeout-s 150 --results-dir "$out/bench" "$@" >>"$out/bench.log" 2>&1
}
models=${1:-qwen2.5-1.5b qwen2.5-3b}
runs=() liger_runs=()
for m in $models; do
  runs+=(--run "$m:16384:deepspeed,megatrain-hbm")
  liger_runs+=(--run "$m:16384:megatrain-hbm")
done
bench dspair "${runs[@]}"
with_liger
bench dspair-liger "${liger_runs[@]}"
grep -aE "^bench|layer kernels" "$out/bench.log" | tail -20
python3 - "$out/bench/results.csv" <<'PY'
import csv, sys
for r in csv.DictReader(open(sys.argv[1])):
    print(r["tag"], r["system"], r["model"], r["status"][:40], r["tokens_per_s"], r["model_tflops"],
          r["peak_hbm_gib"], r["peak_host_gib"], r["note"][:60])
PY
