#!/usr/bin/env bash
# GPU evidence for the front door (issue 22), one device call (nvidia-h200, carry .whl):
#
#   BENCH_COMMIT=<hash> bash dev/front_door_gpu.sh cli-dpo    # CLI train + resume, 7B DPO row
#   bash dev/front_door_gpu.sh gpu-tests                      # the GPU test suite
#   bash dev/front_door_gpu.sh readme                         # README's Python example, as written
#
# .whl/ holds the wheels the machine lacks (datasets, dill, multiprocess, trl):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux2014_x86_64 -d .whl \
#     'datasets==5.2.0' 'dill<0.4.2' 'multiprocess<0.70.20' 'trl==1.16.0'
set -uo pipefail
phase=${1:?phase: cli-dpo | gpu-tests | readme}
source "$(dirname "$0")/device_env.sh"
with_liger
python3 -c "import torch, transformers, datasets, trl; print('versions', torch.__version__, \
transformers.__version__, datasets.__version__, trl.__version__, torch.cuda.get_device_name())"

case "$phase" in
  cli-dpo)
    # The CLI on the GPU (bf16 by default there): 40 steps with a checkpoint every 20, then the
    # same command asked for 60 steps resumes from checkpoint-40 (time to first step shown).
    cli() {
      python3 -m hf_megatrain train --output_dir /tmp/cli-run --save_steps 20 \
        --logging_steps 20 --disable_tqdm true --max_new_tokens 8 "$@" 2>&1 \
        | grep -aE "^hf-megatrain|^  |^Check|resuming|'loss'|error|Traceback"
    }
    cli --max_steps 40 >"$out/cli.log"
    cli --max_steps 60 >>"$out/cli.log"
    ls /tmp/cli-run >>"$out/cli.log"
    cat "$out/cli.log"
    # 7B DPO with the frozen streamed reference: one row in bench.py's schema.
    timeout 480 python3 dev/dpo7b.py --out "$out/dpo7b.csv" >"$out/dpo7b.log" 2>&1
    echo "dpo7b rc=$?"
    tail -25 "$out/dpo7b.log"
    ;;
  readme)
    # The first python block of README.md, run as a user would paste it.
    python3 -c "import re,sys; t=open('README.md').read(); \
sys.stdout.write(re.search(r'\x60\x60\x60python\n(.*?)\x60\x60\x60', t, re.S).group(1))" >/tmp/readme_example.py
    (cd /tmp && timeout 300 python3 readme_example.py 2>&1 | tail -5)
    ;;
  gpu-tests)
    timeout 560 python3 -m pytest tests/test_gpu.py tests/test_packing.py -k "not liger" \
      -o addopts="" -p no:cacheprovider -rA -q --durations=10 >"$out/gpu-tests.log" 2>&1
    grep -aE "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$out/gpu-tests.log" | tail -30
    ;;
esac
