# Sourced by the device scripts (nvidia-h200, `.whl` carried): the repo root as working
# directory, $out (the call's $OUT), and the carried wheels the image lacks (datasets, dill,
# multiprocess, trl) in /tmp/site on PYTHONPATH, offline. liger-kernel goes in only when a
# script asks for it (`with_liger`): its runs compare the defaults without and with it.
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-/tmp/out}
mkdir -p "$out"
compgen -G ".whl/*.whl" | grep -v liger_kernel | xargs -r python3 -m pip install -q \
  --no-index --no-deps --target /tmp/site >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 BENCH_MIRROR=0 HF_HUB_OFFLINE=1

with_liger() {
  # (../shared/tools/device-wheels.sh does not fetch it: `pip download liger-kernel --no-deps
  # -d .whl` does; without it the runs are a plain install's, so say so in every log.)
  compgen -G ".whl/liger_kernel-*.whl" >/dev/null || echo "with_liger: no .whl/liger_kernel-*.whl: runs without liger-kernel"
  compgen -G ".whl/liger_kernel-*.whl" | xargs -r python3 -m pip install -q --no-index \
    --no-deps --target /tmp/site >/dev/null 2>&1
}
