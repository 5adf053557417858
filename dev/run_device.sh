#!/usr/bin/env bash
# The benchmark sweep in one call on the GPU machine (run from the repo root there, with `.whl`
# carried). Arguments go to benchmarks/bench.py unchanged; results land in benchmarks/results/
# there and, after every run, in $OUT (results.csv, the sweep's markdown and its log).
#
#   BENCH_COMMIT=<git hash here> bash dev/run_device.sh --tag h200-a \
#       --steps 5 --warmup 2 --timeout-s 240 --run qwen2.5-1.5b:16384:megatrain,deepspeed,stock
#
# BENCH_COMMIT: the copy on the GPU machine has no .git, so the commit comes from the caller.
set -uo pipefail
cd "$(dirname "$0")/.."
whl_dir=${WHL_DIR:-.whl}

# DeepSpeed and its pure-Python deps the image lacks (fill with shared/tools/device-wheels.sh).
# Not the recipes' trl / datasets wheels: a datasets that fails to import against the image's
# pyarrow would break every transformers Trainer import (device_phases.sh recipes installs them
# apart, in /tmp/site-recipes).
mapfile -t wheels < <(compgen -G "$whl_dir/*.whl" | grep -vE '/(trl|datasets|dill|multiprocess)-')
if [ "${#wheels[@]}" -gt 0 ]; then
  # Once per machine, under a lock: runs started side by side (device_phases.sh long-pair) must
  # not upgrade the same --target directory at once, nor one while the other imports from it.
  stamp=/tmp/site/.wheels-$(printf '%s\n' "${wheels[@]##*/}" | md5sum | cut -c1-12)
  (
    flock 9
    [ -e "$stamp" ] || { python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site "${wheels[@]}" && touch "$stamp"; }
  ) 9>/tmp/site.lock || exit 1
else
  echo "run_device: no wheels in $whl_dir; DeepSpeed runs will be recorded as skipped" >&2
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
export DS_SKIP_CUDA_CHECK=1 PYTHONUNBUFFERED=1

# The machine, for the log.
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
grep -E '^(MemTotal|MemAvailable)' /proc/meminfo
echo "cpus: $(nproc)"

# DeepSpeed JIT-compiles its CPUAdam op (ninja + nvcc) on first use; build it once here, outside
# every run's timer and wall-clock limit. Later runs load it from the torch extensions cache.
if [[ " $* " == *deepspeed* ]] && python3 -c "import deepspeed" 2>/dev/null; then
  start=$(date +%s)
  python3 -c "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load()" \
    >/tmp/cpu_adam_build.log 2>&1 || { echo "run_device: CPUAdam build failed:"; tail -20 /tmp/cpu_adam_build.log; }
  echo "run_device: CPUAdam ready in $(( $(date +%s) - start )) s"
fi

# Each run's CSV, summary and log also go to $OUT as files, unless the caller packs them itself
# (device_phases.sh sets BENCH_MIRROR=0: the device tool returns only so many files per call).
mirror=()
if [ -n "${OUT:-}" ] && [ "${BENCH_MIRROR:-1}" = 1 ]; then mirror=(--mirror-dir "$OUT"); fi
python3 benchmarks/bench.py "$@" "${mirror[@]}"
