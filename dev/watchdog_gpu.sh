#!/usr/bin/env bash
# One device call (nvidia-h200, carry .whl) for issue 20's fit guarantee and issue 21's parity:
#
#   bash dev/watchdog_gpu.sh [pytest -k expression of tests/test_gpu.py] [parity]
#
# 1. tests/test_gpu.py tests selected by $1 (default: the OOM watchdog, the defaults and the
#    auto_fit tests);
# 2. with "parity" as $2: tests/test_gpu_parity.py (150 bf16 steps, 3 families, ~2 minutes).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
select=${1:-"out_of_memory or defaults_on_gpu or auto_fit"}
timeout 300 python3 -m pytest tests/test_gpu.py -k "$select" -o addopts="" -p no:cacheprovider \
  -q -rA >"$out/gpu-tests.log" 2>&1
grep -aE "^(PASSED|FAILED|ERROR)|[0-9]+ (passed|failed)|Error:" "$out/gpu-tests.log" | tail -15
if [ "${2:-}" = parity ]; then
  timeout 330 python3 -m pytest tests/test_gpu_parity.py -o addopts="" -p no:cacheprovider -q -s \
    -rA 2>&1 | grep -aE "streamed max rel|passed|failed|XPASS|XFAIL" | tail -8
fi
