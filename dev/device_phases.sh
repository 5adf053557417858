#!/usr/bin/env bash
# The GPU-machine work of a session as named phases, each sized to fit one device command
# (10 minutes), every output packed into ONE file, $OUT/results-<phase>.tgz (the device tool
# returns only a few files per call: a sweep's CSV, markdown, logs and traces otherwise get
# dropped). Run from the repo root there, `.whl` carried, BENCH_COMMIT set:
#
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh tests      # nvidia-h200 or -x2
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh speed      # nvidia-h200
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh speed2     # nvidia-h200
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh speed8k    # nvidia-h200 (~5 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh speed-pair # nvidia-h200-x2 (~8 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg speed8b # nvidia-h200(-x2) (~11 min),
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg-wait    # then this within 30 s
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh longest-ds # nvidia-h200(-x2) (~4 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg matrix  # nvidia-h200 (~13 min),
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg-wait    # then this within 30 s
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg matrix-ds  # nvidia-h200 (~10 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh liger-plan # nvidia-h200 (~2.5 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg matrix-all  # the three above (~26 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh stock-fit  # nvidia-h200 (~4 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh stock7b64  # nvidia-h200 (~4 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh stock7b8k  # nvidia-h200 (~3 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh liger8k    # nvidia-h200 (~3 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh attn-auto  # nvidia-h200 (~2 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh families   # nvidia-h200 (~2 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh bg next-all  # families, stock-fit, liger8k, attn-auto (~15 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh profile8k  # nvidia-h200 (~4 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh liger      # nvidia-h200 or -x2 (~9 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh liger64k   # nvidia-h200 (~4 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh longest    # nvidia-h200
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh long       # nvidia-h200
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh long1m     # nvidia-h200, then long-wait
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh long7b     # nvidia-h200, then long-wait
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh long3b     # nvidia-h200(-x2), long-wait
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh long-pair  # nvidia-h200-x2, long-wait
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh dp         # nvidia-h200-x2
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh dpsteady   # nvidia-h200-x2 (~5 min)
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh recipes    # nvidia-h200
#   BENCH_COMMIT=<hash> bash dev/device_phases.sh recipes-cli  # nvidia-h200 (~125 s)
#
# The recipes phase needs TRL and datasets, which the GPU image lacks: carry their wheels in .whl
# (bash ../shared/tools/device-wheels.sh trl==1.16.0 datasets==5.2.0 'dill<0.4.2'
# 'multiprocess<0.70.20').
#
# Then, here: tar xzf <files_at>/results-<phase>.tgz -C /tmp/x and merge its
# benchmarks/results/results.csv rows into ours (bench.append_csv), logs and summaries as files.
set -uo pipefail
cd "$(dirname "$0")/.."
phase=${1:?phase: tests | speed | speed2 | speed8k | speed-pair | speed8b | bg | bg-wait | longest-ds | matrix | matrix-ds | matrix-all | families | stock-fit | stock7b64 | stock7b8k | liger8k | attn-auto | next-all | liger-plan | profile8k | liger | liger64k | longest | long | long1m | long7b | long3b | long-pair | long-wait | dp | dpsteady | recipes | recipes-cli}
out=${OUT:-/tmp/out}
mkdir -p "$out" benchmarks/results/logs
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 BENCH_MIRROR=0
log="benchmarks/results/logs/$(date -u +%F)-phase-$phase.log"
pack() { tar czf "$out/results-$phase.tgz" benchmarks/results; }
trap pack EXIT
bench() { bash dev/run_device.sh "$@" >>"$log" 2>&1; grep "^bench:" "$log" | tail -3; pack; }
# A run longer than one device command: started in its own session (setsid), which the device
# tool leaves running while the machine is held; this call waits LONG_SLEEP seconds (shorter
# when the call ran another phase first) and `long-wait`, called again within the machine's
# idle window, waits for the rest and packs.
start_long() {
  local out=${LONG_LOG:-$log}
  setsid nohup bash dev/run_device.sh --steps 1 --warmup 0 "$@" >>"$out" 2>&1 </dev/null &
  sleep "${LONG_SLEEP:-560}"
  tail -5 "$out"
}

case "$phase" in
  tests)
    # Every GPU-marked test; the 2-GPU data-parallel ones skip on one GPU. Liger-Kernel (the
    # use_liger_kernel test) from its wheel in .whl when carried.
    lk=$(compgen -G ".whl/liger_kernel-*.whl")
    if [ -n "$lk" ] && python3 -m pip install -q --no-index --no-deps --no-compile \
      --no-cache-dir --upgrade --target /tmp/site-liger "$lk" >>"$log" 2>&1; then
      export PYTHONPATH=/tmp/site-liger:$PYTHONPATH
    fi
    timeout 420 python3 -m pytest tests/test_gpu.py tests/test_packing.py tests/test_gpu_dp.py \
      -k "not liger" -o addopts="" -p no:cacheprovider -rA -q --durations=12 2>&1 | grep -v '^DEBUG' >>"$log"
    # Liger patches module-level names of transformers' model files (the tests put them back):
    # its tests run in a process of their own all the same.
    timeout 240 python3 -m pytest tests/test_gpu.py -k liger -o addopts="" -p no:cacheprovider \
      -rA -q 2>&1 | grep -v '^DEBUG' >>"$log"
    grep -aE "^(FAILED|ERROR)|kept (attention )?bytes per token|fp32-output GEMMs|[0-9]+ (passed|failed|skipped)" "$log" | tail -30
    ;;
  families)
    # Every supported family through the GPU path against the stock Trainer's autocast, then the
    # GPU tests of the code they touched: norm parameters bound in fp32 (LayerNorm too), the
    # loaders' SDPA fallback, the layer buffers' device. At a1763ff: 49 passed, GraniteMoE failed
    # inside transformers 5.17's own model (tests/helpers.stock_aux_loss_trains). ~2 min.
    timeout 480 python3 -m pytest tests/test_gpu.py -k "every_family or bf16_streamed or \
      init_streamed or save_resume" -o addopts="" -p no:cacheprovider -rA -q --durations=8 2>&1 \
      | grep -v '^DEBUG' >>"$log"
    grep -aE "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$log" | tail -30
    ;;
  speed)
    # Issue 3's stock comparisons where stock fits (1.5B at 16k and 32k, 3B at 16k, 7B at 8k),
    # with HBM-tier layers keeping their activations where the plan leaves room (no recompute);
    # first the GPU tests of that path (equality with recompute, kept bytes vs the planner).
    timeout 150 python3 -m pytest tests/test_gpu.py -k "kept" -o addopts="" -p no:cacheprovider \
      -rA -q 2>&1 | grep -v '^DEBUG' >>"$log"
    grep -E "passed|failed|Error" "$log" | tail -4
    bench --tag "speed-$(date -u +%H%M)" --steps 3 --warmup 1 --timeout-s 110 \
      --run qwen2.5-1.5b:16384:megatrain-hbm,stock --run qwen2.5-1.5b:32768:megatrain-hbm,stock \
      --run qwen2.5-3b:16384:megatrain-hbm,stock
    bench --tag "speed7b-$(date -u +%H%M)" --streamed-init --steps 3 --warmup 2 --timeout-s 150 \
      --run qwen2.5-7b:8192:megatrain-hbm,stock
    ;;
  speed2)
    # Issue 3, what is left: DeepSpeed ZeRO-3 offload at 64k tokens/step against the HBM tier in
    # the same sweep (target 1.3x) and at 16k for 1.5B and 3B (target 2.5x); the inter-layer gaps
    # of a 7B step at 64k tokens from CUDA events (no CUPTI slowdown; target < 5% of the step);
    # the 7B at 8k tokens again with layer timing (0.94x of stock at 710d066).
    bench --tag "ds-$(date -u +%H%M)" --steps 3 --warmup 1 --timeout-s 170 \
      --run qwen2.5-1.5b:65536:megatrain-hbm,deepspeed:16 \
      --run qwen2.5-1.5b:16384:megatrain-hbm,deepspeed --run qwen2.5-3b:16384:megatrain-hbm,deepspeed
    bench --tag "gaps-$(date -u +%H%M)" --streamed-init --layer-timing --steps 3 --warmup 2 \
      --timeout-s 150 --run qwen2.5-7b:65536:megatrain-hbm:16 --run qwen2.5-7b:8192:megatrain-hbm:2
    ;;
  speed8k)
    # Issue 3's 7B at 8k tokens/step (0.94x of stock): the profile8k traces put the difference in
    # the layers' own kernels, 39 ms of it the bf16->fp32 gradient adds, since replaced by a
    # converting copy for the step's first micro-batch. Stock, the bf16-copy HBM tier (27
    # layers) and the cast-on-use tier (all 28, the last 4 keeping activations with their bf16
    # copies), and the 64k row with either tier. About 6 minutes.
    at=$(date -u +%H%M)
    bench --tag "speed8k-$at" --streamed-init --layer-timing --steps 3 --warmup 2 \
      --timeout-s 150 --run qwen2.5-7b:8192:megatrain-hbm,stock:2 \
      --run qwen2.5-7b:65536:megatrain-hbm:16
    bench --tag "speed8k-cast-$at" --streamed-init --hbm-cast-weights --layer-timing --steps 3 \
      --warmup 2 --timeout-s 120 --run qwen2.5-7b:8192:megatrain-hbm:2 \
      --run qwen2.5-7b:65536:megatrain-hbm:16
    ;;
  speed-pair)
    # nvidia-h200-x2, after `tests`: issue 3's two open targets side by side, one per GPU (each
    # sweep compares within itself, on its own GPU), with the early-stop recompute against the
    # whole-layer one (--no-recompute-early-stop: the engine before 20233b4). GPU 0: Qwen2.5-7B
    # at 8k tokens/step, stock and both HBM tiers (0.96x / 0.988x of stock at be61ad9), then 7B
    # at 64k in 4 micro-batches of 16k with 18 HBM-tier layers (the plan then keeps 6 layers'
    # activations; "auto" would put 25 in HBM and keep none). GPU 1: 7B and Llama-3.1-8B at 64k
    # tokens/step with Liger-Kernel's RMSNorm / RoPE / SwiGLU (436 / 425 model TFLOP/s at
    # be61ad9; 450 targeted). About 8 minutes.
    at=$(date -u +%H%M)
    (
      export CUDA_VISIBLE_DEVICES=0
      bench --tag "pair8k-$at" --streamed-init --layer-timing --steps 3 --warmup 2 \
        --timeout-s 150 --run qwen2.5-7b:8192:megatrain-hbm,stock:2
      for stop in on off; do
        flag=$([ "$stop" = off ] && echo --no-recompute-early-stop)
        # shellcheck disable=SC2086
        bench --tag "pair8k-cast-$stop-$at" --streamed-init --hbm-cast-weights --layer-timing \
          --steps 3 --warmup 2 --timeout-s 120 $flag --run qwen2.5-7b:8192:megatrain-hbm:2
      done
      bench --tag "pair64k-liger-mb4-$at" --streamed-init --liger --resident-layers 18 \
        --layer-timing --steps 3 --warmup 2 --timeout-s 150 \
        --run qwen2.5-7b:65536:megatrain-hbm:4
    ) &
    (
      export CUDA_VISIBLE_DEVICES=1
      log="${log%.log}-gpu1.log"
      for stop in on off; do
        flag=$([ "$stop" = off ] && echo --no-recompute-early-stop)
        # shellcheck disable=SC2086
        bench --tag "pair64k-liger-$stop-$at" --streamed-init --liger --layer-timing --steps 3 \
          --warmup 2 --timeout-s 150 $flag --run qwen2.5-7b:65536:megatrain-hbm:16
      done
      bench --tag "pair64k-liger8b-$at" --streamed-init --liger --layer-timing --steps 3 \
        --warmup 2 --timeout-s 170 --run llama-3.1-8b:65536:megatrain-hbm:16
    ) &
    wait
    grep -ah "^bench:.*tok/step" "$log" "${log%.log}-gpu1.log"
    ;;
  speed8b)
    # Issue 3's one target left: Llama-3.1-8B at 64k tokens/step or more, 450 model TFLOP/s
    # (445 at 8f64357, pair64k-liger8b-1336, beside another sweep on the 2-GPU machine). Alone
    # on a GPU: 64k in one micro-batch; 128k in two (weights cross PCIe once per step, the
    # step's fixed costs, ~60 ms outside the layer passes, amortized over twice the tokens);
    # the 8B and the 7B at 64k with the attention kernel's outputs kept for the recompute
    # (--keep-attention-outputs: no attention forward in the recompute, ~2% of the step by
    # profile64k-1015's attention time; 16 GiB of HBM for the 8B, so the plan streams 19 layers
    # instead of 14, whose host AdamW the next forward may wait for: the layer timeline's gaps
    # say); the same with 16 HBM-tier layers (beyond the plan, which runs ~8% above the
    # measured peak with Liger-Kernel: it warns, 136 GiB expected); 64k with 12 HBM-tier
    # layers (the plan then keeps 2 layers' activations: two recomputes less, ~1.3% of the
    # step). About 11 minutes: start it in the background (setsid) and wait in two calls.
    at=$(date -u +%H%M)
    bench --tag "speed8b-$at" --streamed-init --liger --layer-timing --steps 3 --warmup 2 \
      --timeout-s 200 --run llama-3.1-8b:65536:megatrain-hbm:16 \
      --run llama-3.1-8b:131072:megatrain-hbm:16
    bench --tag "speed8b-attn-$at" --streamed-init --liger --keep-attention-outputs \
      --layer-timing --steps 3 --warmup 2 --timeout-s 170 \
      --run llama-3.1-8b:65536:megatrain-hbm:16 --run qwen2.5-7b:65536:megatrain-hbm:16
    bench --tag "speed8b-attn16-$at" --streamed-init --liger --keep-attention-outputs \
      --resident-layers 16 --layer-timing --steps 3 --warmup 2 --timeout-s 170 \
      --run llama-3.1-8b:65536:megatrain-hbm:16
    bench --tag "speed8b-keep-$at" --streamed-init --liger --resident-layers 12 --layer-timing \
      --steps 3 --warmup 2 --timeout-s 170 --run llama-3.1-8b:65536:megatrain-hbm:16
    ;;
  matrix)
    # Issue 3's configuration matrix where results.csv has no row yet (benchmarks/speed_matrix.py
    # shows the gaps): Qwen2.5-7B and Llama-3.1-8B at 16k tokens/step (hf_megatrain in one
    # micro-batch; stock in micro-batches of 2 sequences, as its 7B at 8k, or 1 for the 8B,
    # whose 16 B/param fill 120 GiB), Qwen2.5-3B at 64k, stock 7B and 8B at 64k (gradient
    # accumulation over the same micro-batches, beside hf_megatrain's one 64k micro-batch in the
    # same sweep: each system as it runs best). nvidia-h200. About 13 minutes: `bg matrix`,
    # then `bg-wait`; then `bg matrix-ds`.
    at=$(date -u +%H%M)
    bench --tag "matrix16k-$at" --streamed-init --steps 3 --warmup 2 --timeout-s 240 \
      --run qwen2.5-7b:16384:megatrain-hbm:4 --run qwen2.5-7b:16384:stock:2 \
      --run llama-3.1-8b:16384:megatrain-hbm:4 --run llama-3.1-8b:16384:stock:1
    bench --tag "matrix64k-$at" --streamed-init --steps 3 --warmup 2 --timeout-s 240 \
      --run qwen2.5-3b:65536:megatrain-hbm:16 --run qwen2.5-3b:65536:stock:4 \
      --run qwen2.5-7b:65536:megatrain-hbm:16 --run qwen2.5-7b:65536:stock:2 \
      --run llama-3.1-8b:65536:megatrain-hbm:16 --run llama-3.1-8b:65536:stock:1
    ;;
  matrix-ds)
    # The matrix's DeepSpeed ZeRO-3 offload cells: Qwen2.5-3B at 64k (beside an hf_megatrain row
    # of the same sweep), 7B and 8B at 16k. DeepSpeed holds 16 B/param and more on the host: on
    # the 1-GPU machine's 128 GiB its 7B at 8k was killed 189 s in, before its first step
    # (longest-1355); a kill during set-up does not depend on the tokens per step, so the 64k
    # cells are not run again for it (4 such runs would take 13 minutes). nvidia-h200 (its host
    # size is part of the result). About 10 minutes: `bg matrix-ds`, then `bg-wait`.
    at=$(date -u +%H%M)
    bench --tag "matrixds-$at" --steps 2 --warmup 1 --timeout-s 300 \
      --run qwen2.5-3b:65536:megatrain-hbm,deepspeed:8 \
      --run qwen2.5-7b:16384:deepspeed:2 --run llama-3.1-8b:16384:deepspeed:2
    ;;
  stock-fit)
    # Issue 3's last stock cell "wherever stock fits": Qwen2.5-1.5B at 64k, where stock ran out of
    # GPU memory at micro-batches of 16 (h200-c; its 32k micro-batches of 8 trained), beside
    # hf_megatrain in one sweep, both at the micro-batches they may run best at. (The 7B cells,
    # stock at micro-batch 1, ran at a1763ff: stockfit7b-2318, stockfit7b64-2318.) nvidia-h200,
    # about 4 minutes, in the foreground: a background run dies with its machine when the next
    # call comes after the idle window (two were lost so on 2026-11-30).
    # Ran at 069027f: stockfit15-0000 (stock fits at 8 and 4; hf_megatrain 1.26x).
    bench --tag "stockfit15-$(date -u +%H%M)" --streamed-init --steps 3 --warmup 2 --timeout-s 120 \
      --run qwen2.5-1.5b:65536:megatrain-hbm:16 --run qwen2.5-1.5b:65536:megatrain-hbm:8 \
      --run qwen2.5-1.5b:65536:stock:8 --run qwen2.5-1.5b:65536:stock:4
    ;;
  liger8k)
    # Qwen2.5-7B at 8k with Liger-Kernel for both systems at the current engine (ligercast8k-1154,
    # 0.988x, predates the early-stop recompute; the cast tier was hf_megatrain's fastest at 8k,
    # pair8k-cast-on-1336; stock ignores the flag). nvidia-h200, about 3 minutes. Ran at 069027f:
    # stockfit-liger8k-0003, 1.04x.
    bench --tag "stockfit-liger8k-$(date -u +%H%M)" --streamed-init --liger --hbm-cast-weights \
      --steps 3 --warmup 2 --timeout-s 150 --run qwen2.5-7b:8192:megatrain-hbm,stock:2
    ;;
  stock7b64)
    # The thinnest stock ratio, Qwen2.5-7B at 64k (1.01x at stockfit7b64-2318), timed again the
    # way every other cell is: 3 timed steps after 2 warm-ups for both systems (that run had
    # the device time for 2 after 1). Stock at one sequence per micro-batch (2 runs out of GPU
    # memory), hf_megatrain as one micro-batch of 16. nvidia-h200, about 4 minutes.
    # Ran at 7ad5709: stock7b64-0021, 1.17x.
    bench --tag "stock7b64-$(date -u +%H%M)" --streamed-init --steps 3 --warmup 2 --timeout-s 240 \
      --run qwen2.5-7b:65536:stock:1 --run qwen2.5-7b:65536:megatrain-hbm:16
    ;;
  stock7b8k)
    # The other thin one, Qwen2.5-7B at 8k without Liger-Kernel (1.011x at pair8k-1336, commit
    # 8f64357), at the current engine: stock beside hf_megatrain's copy tier and cast tier.
    # nvidia-h200, about 3 minutes. Ran at 7ad5709: stock7b8k-0033 (1.02x), stock7b8k-cast-0035.
    bench --tag "stock7b8k-$(date -u +%H%M)" --streamed-init --steps 3 --warmup 2 --timeout-s 200 \
      --run qwen2.5-7b:8192:stock:2 --run qwen2.5-7b:8192:megatrain-hbm:2
    bench --tag "stock7b8k-cast-$(date -u +%H%M)" --streamed-init --hbm-cast-weights --steps 3 \
      --warmup 2 --timeout-s 120 --run qwen2.5-7b:8192:megatrain-hbm:2
    ;;
  attn-auto)
    # Whether megatrain_keep_attention_outputs could default to "auto" (it keeps the attention
    # kernel's outputs of as many recomputed layers as the plan leaves HBM for, never taking an
    # HBM-tier layer; timed so far only as "all" at 64k with Liger-Kernel, +2.2%): Qwen2.5-7B
    # without Liger-Kernel at 8k and 16k tokens/step, off against auto, the two sweeps back to
    # back on one GPU (`plan --keep-attention-outputs auto` keeps them for 27 layers at 8k, 25 at
    # 16k, only 3 at 64k). nvidia-h200, about 2 minutes. Ran at 069027f: attn-off/attn-auto-0006,
    # +0.2% at 8k, +1.2% at 16k (within run-to-run spread; the default stays off).
    at=$(date -u +%H%M)
    for attn in off auto; do
      bench --tag "attn-$attn-$at" --streamed-init --keep-attention-outputs "$attn" \
        --layer-timing --steps 3 --warmup 2 --timeout-s 170 \
        --run qwen2.5-7b:8192:megatrain-hbm:2 --run qwen2.5-7b:16384:megatrain-hbm:4
    done
    ;;
  next-all)
    # The next session's device work in one background run (~15 minutes): families (GPU tests
    # of every architecture), stock-fit (issue 3's last cell), liger8k, attn-auto. `bg next-all`,
    # then `bg-wait` at once; safer: the four phases as four foreground calls.
    for sub in families stock-fit liger8k attn-auto; do bash "$0" "$sub"; done
    ;;
  matrix-all)
    # matrix, matrix-ds and liger-plan one after another in one background run (~26 minutes
    # of a session's 30): `bg matrix-all`, then `bg-wait` twice, each within the machine's idle
    # window. Each phase packs its own results-PHASE.tgz.
    for sub in matrix matrix-ds liger-plan; do bash "$0" "$sub"; done
    ;;
  liger-plan)
    # The streamed loaders' plan with Liger-Kernel (from eab3fc3; before it, bench
    # --streamed-init planned as if unfused: plancheck-1554, 13 HBM-tier layers, 124.1 GiB peak
    # against 136.6 planned): Llama-3.1-8B at 64k with kept attention outputs, now planned with
    # the fused kernels' smaller working set (14 HBM-tier layers by `plan --liger
    # --keep-attention-outputs all`). About 2.5 minutes, nvidia-h200.
    bench --tag "liger-plan-$(date -u +%H%M)" --streamed-init --liger --keep-attention-outputs all \
      --layer-timing --steps 3 --warmup 2 --timeout-s 200 --run llama-3.1-8b:65536:megatrain-hbm:16
    ;;
  longest-ds)
    # Issue 4's table: DeepSpeed ZeRO-3 offload trained one sequence of 65,536 tokens (1.5B,
    # 124.5 GiB HBM) and 32,768 (3B, 83.6 GiB) in `longest`, nothing longer was run: the next
    # lengths, where an out-of-memory result bounds the table's entry. About 4 minutes.
    bench --tag "longest-ds-$(date -u +%H%M)" --seq-len 131072 --steps 1 --warmup 1 \
      --timeout-s 200 --run qwen2.5-1.5b:131072:deepspeed
    bench --tag "longest-ds-$(date -u +%H%M)" --seq-len 65536 --steps 1 --warmup 1 \
      --timeout-s 200 --run qwen2.5-3b:65536:deepspeed
    ;;
  profile8k)
    # Issue 3's one stock comparison below 1.0x (Qwen2.5-7B at 8k tokens/step: 7,298 vs 7,732
    # tok/s at 710d066; layer passes 85% of the step, no inter-layer gaps, at 21c5b8e): a kernel
    # trace of one step of each, GPU time by kernel family (trace_overlap), side by side.
    # Then the 7B at 64k tokens (385 model TFLOP/s at d822e80, 450 targeted): where its kernel
    # time goes beyond the GEMMs (fp32 RMSNorm/RoPE and SwiGLU elementwise passes, recompute).
    bench --tag "profile8k-$(date -u +%H%M)" --streamed-init --profile --steps 2 --warmup 2 \
      --timeout-s 170 --run qwen2.5-7b:8192:megatrain-hbm,stock
    bench --tag "profile64k-$(date -u +%H%M)" --streamed-init --profile --steps 1 --warmup 2 \
      --timeout-s 170 --run qwen2.5-7b:65536:megatrain-hbm:16
    grep -a "bench worker: trace" "$log" | tail -3 | cut -c1-900
    ;;
  liger)
    # Issue 3's lever beyond the GEMMs: Liger-Kernel's fused RMSNorm / RoPE / SwiGLU (the
    # Trainer's use_liger_kernel) against the default kernels, same sweep: the 7B at 64k tokens
    # (385 model TFLOP/s, 450 targeted) and at 8k beside stock (0.94x; stock gets the same
    # kernels in the "on" sweep: like for like), and the 1.5B at 64k, whose HBM
    # tier keeps more layers' activations with the fused kernels' smaller saved set (built by
    # the trainer, not --streamed-init, so that its memory plan sees the kernels).
    at=$(date -u +%H%M)
    for kernels in off on; do
      flag=$([ "$kernels" = on ] && echo --liger)
      # shellcheck disable=SC2086
      bench --tag "liger-$kernels-$at" --streamed-init --layer-timing --steps 3 --warmup 2 \
        --timeout-s 150 $flag --run qwen2.5-7b:65536:megatrain-hbm:16 \
        --run qwen2.5-7b:8192:megatrain-hbm,stock:2
      # shellcheck disable=SC2086
      bench --tag "liger15-$kernels-$at" --layer-timing --steps 3 --warmup 1 --timeout-s 120 \
        $flag --run qwen2.5-1.5b:65536:megatrain-hbm:16
    done
    ;;
  liger64k)
    # The liger phase's 7B at 64k tokens only (off, then on): issue 3's 450 model TFLOP/s
    # target, in about 4 minutes where the whole phase does not fit.
    at=$(date -u +%H%M)
    for kernels in off on; do
      flag=$([ "$kernels" = on ] && echo --liger)
      # shellcheck disable=SC2086
      bench --tag "liger-$kernels-$at" --streamed-init --layer-timing --steps 3 --warmup 2 \
        --timeout-s 150 $flag --run qwen2.5-7b:65536:megatrain-hbm:16
    done
    ;;
  longest)
    # Issue 4's table, the stock and DeepSpeed side: one sequence per step at growing lengths
    # until each runs out of memory (an OOM row is the result). hf_megatrain's side: long,
    # long1m, long7b (3B: `plan --seq-len ... --bf16-boundaries --checkpoint-every 2
    # --offload-activations --mlp-tile-tokens 16384` puts it at 1.39M tokens).
    # Stock at 32k (1.5B, 3B) ran in longest-0822; stock 1.5B at 64k ran out of HBM (h200-j).
    for spec in "32768 qwen2.5-1.5b:32768:deepspeed qwen2.5-3b:32768:deepspeed" \
      "65536 qwen2.5-1.5b:65536:deepspeed qwen2.5-3b:65536:stock" \
      "16384 qwen2.5-7b:16384:stock" "8192 qwen2.5-7b:8192:stock,deepspeed"; do
      read -r len runs <<<"$spec"
      # DeepSpeed's 7B builds and partitions 30 GB of fp32 weights on the host before the host
      # OOM killer can end it: more time, so the row says killed rather than timeout.
      limit=150
      [ "$len" = 8192 ] && limit=320
      # shellcheck disable=SC2046
      bench --tag "longest-$(date -u +%H%M)" --seq-len "$len" --steps 1 --warmup 1 \
        --timeout-s "$limit" $(printf -- '--run %s ' $runs)
    done
    ;;
  long)
    # One 524,288-token sequence of Qwen2.5-1.5B: MLP tiles, boundary activations on the host.
    bench --tag "long-$(date -u +%H%M)" --seq-len 524288 --mlp-tile-tokens 16384 \
      --offload-activations --steps 1 --warmup 0 --timeout-s 540 \
      --run qwen2.5-1.5b:524288:megatrain-hbm:1
    ;;
  long1m)
    # One 1,048,576-token sequence of Qwen2.5-1.5B (bf16 boundaries offloaded: 84 GiB host): about
    # 17 minutes, longer than one device command: start_long, then `long-wait`.
    start_long --tag "long1m-$(date -u +%H%M)" --seq-len 1048576 --mlp-tile-tokens 16384 \
      --offload-activations --boundary-dtype bfloat16 --timeout-s 1500 \
      --run qwen2.5-1.5b:1048576:megatrain-hbm:1
    ;;
  long7b)
    # One 524,288-token sequence of Qwen2.5-7B (issue 4's target): bf16 boundaries saved every
    # 2nd layer and offloaded (`plan ... --bf16-boundaries --checkpoint-every 2`: 136 GiB HBM,
    # 107 GiB host), no clipping, fp32 masters streamed. About 11 minutes (attention at 512k
    # dominates): started under setsid like long1m, then `long-wait`.
    start_long --tag "long7b-$(date -u +%H%M)" --seq-len 524288 --mlp-tile-tokens 16384 \
      --offload-activations --boundary-dtype bfloat16 --checkpoint-every 2 --no-clip \
      --stream-fp32-master --streamed-init --timeout-s 1500 \
      --run qwen2.5-7b:524288:megatrain-hbm:1
    ;;
  long3b)
    # Issue 4's table, hf_megatrain's 3B row: one 524,288-token sequence of Qwen2.5-3B (the
    # planner's ceiling for 3B is 1.38M tokens with segments; 1M would take ~30 minutes). All
    # layers fit in HBM: bf16 boundaries offloaded (76 GiB host), no segments (no extra
    # recompute). About 8 minutes: setsid like long7b, then `long-wait`. On nvidia-h200-x2 too
    # (one GPU; every memory option is explicit, so the run is the one-GPU kind's).
    start_long --tag "long3b-$(date -u +%H%M)" --seq-len 524288 --mlp-tile-tokens 16384 \
      --offload-activations --boundary-dtype bfloat16 --no-clip --streamed-init \
      --timeout-s 1200 --run qwen2.5-3b:524288:megatrain-hbm:1
    ;;
  long-pair)
    # nvidia-h200-x2: long1m on GPU 0 and long3b on GPU 1 at the same time (each run one GPU;
    # planned host peaks 88 + 76 GiB of the host's 256; each row's host peak is its own
    # process's). Saves one long run's device time; the two share host memory bandwidth and
    # CPU cores, so their step times may be a little longer than alone. Then `long-wait`.
    CUDA_VISIBLE_DEVICES=0 LONG_SLEEP=5 LONG_LOG="${log%.log}-1m.log" bash "$0" long1m
    CUDA_VISIBLE_DEVICES=1 LONG_LOG="${log%.log}-3b.log" bash "$0" long3b
    ;;
  bg)
    # A phase longer than one device command (speed8b): `bg PHASE` starts it in its own session
    # (setsid; the device tool leaves it running while the machine is held) and waits up to
    # 550 s; `bg-wait`, called again within the machine's idle window, waits up to 550 s more.
    # Each call returns what the phase has packed so far (results-PHASE.tgz) and its output.
    sub=${2:?bg PHASE}
    rm -rf /tmp/bg-out && mkdir -p /tmp/bg-out
    OUT=/tmp/bg-out setsid nohup bash "$0" "$sub" >/tmp/bg-out/phase.out 2>&1 </dev/null &
    echo $! >/tmp/bg-out/pid
    ;&
  bg-wait)
    waited=0
    while kill -0 "$(cat /tmp/bg-out/pid)" 2>/dev/null && [ "$waited" -lt 550 ]; do
      sleep 5
      waited=$((waited + 5))
    done
    kill -0 "$(cat /tmp/bg-out/pid)" 2>/dev/null && echo "still running after ${waited}s: bg-wait"
    cp /tmp/bg-out/results-*.tgz /tmp/bg-out/phase.out "$out/" 2>/dev/null
    grep -a "^bench:.*tok/step" /tmp/bg-out/phase.out | tail -12
    trap - EXIT  # the phase packs its own results
    ;;
  long-wait)
    waited=0
    while pgrep -f "benchmarks/bench.py" >/dev/null && [ "$waited" -lt 560 ]; do
      sleep 10
      waited=$((waited + 10))
    done
    for f in benchmarks/results/logs/*-phase-long*.log; do tail -n 5 "$f"; done
    python3 benchmarks/longest_table.py --markdown benchmarks/results/longest.md | tail -n 8
    ;;
  dp)
    # Issue 6 on nvidia-h200-x2: the 2-GPU tests (data parallel == one process at the same global
    # batch, NCCL), then the largest model of the 2-GPU kind: Qwen2.5-14B's shape with 90 layers
    # (26.3B) at 12 B/param across both GPUs and the 256 GiB host (`plan --nproc 2 --host-gib 249
    # --no-clip --stream-fp32-master`: 91 layers at most; 80 layers trained at 710d066 with
    # 207.7 GiB host measured vs 207.6 planned). 7B on 1 vs 2 GPUs ran at 710d066 (2.20x).
    # DP_TESTS=0 when the `tests` phase already ran them on this 2-GPU machine.
    if [ "${DP_TESTS:-1}" = 1 ]; then
      timeout 180 python3 -m pytest tests/test_gpu_dp.py -o addopts="" -p no:cacheprovider -rA \
        -q 2>&1 | grep -v '^DEBUG' >>"$log"
      grep -E "passed|failed" "$log" | tail -2
    fi
    pack
    python3 benchmarks/bench_dp.py --tag "dp-$(date -u +%H%M)" --nproc 2 --system megatrain-hbm \
      --model qwen2.5-14b-l90 --seq-len 4096 --tokens-per-gpu 16384 --micro-batch 4 \
      --streamed-init --no-clip --stream-fp32-master --steps 2 --warmup 1 --timeout-s 240 \
      >>"$log" 2>&1
    grep -E '^bench|"status"' "$log" | tail -3
    ;;
  dpsteady)
    # Issue 6 on nvidia-h200-x2: the 7B at 64k tokens per GPU on 1 and 2 GPUs again, 2 warm-up
    # steps and 3 timed. The 2.20x of dp-0633/dp-0635 took the median of 2 timed steps after 1
    # warm-up, and the single-GPU run's first timed step waited ~3.2 s for the host AdamW's
    # first write of its moments (11.07 s vs 7.88 s steady), which a data-parallel rank (half
    # the moments) waits less: steady state against steady state here.
    bench --tag "dpsteady-$(date -u +%H%M)" --streamed-init --steps 3 --warmup 2 --timeout-s 170 \
      --run qwen2.5-7b:65536:megatrain-hbm:16
    python3 benchmarks/bench_dp.py --tag "dpsteady-$(date -u +%H%M)" --nproc 2 \
      --system megatrain-hbm --model qwen2.5-7b --seq-len 4096 --tokens-per-gpu 65536 \
      --micro-batch 16 --streamed-init --steps 3 --warmup 2 --timeout-s 240 >>"$log" 2>&1
    grep -aE '^bench|"status"' "$log" | tail -4
    ;;
  recipes)
    # Issue 6: the Python recipes at real size on one H200, without weights to download:
    # Qwen2.5-7B from its config at random init (streamed init, bundled tokenizer), bf16 compute
    # (automatic on the GPU). SFT: full fine-tuning through TRL, every layer streamed (host store
    # 18 B/param, ~110 GiB), 3 packed rows of <= 4096 tokens, ~4.2k tokens per step, no 30 GB
    # save. LoRA: frozen base stores (6 B/param), 2 x 4096 tokens per step, the stock reload check
    # skipped (a 7B random base exists only in the host store). Estimate: sft ~80 s (imports 15,
    # init 35-40, 4 steps ~20), lora ~45 s.
    whls=$(compgen -G ".whl/trl-*.whl"; compgen -G ".whl/datasets-*.whl"; compgen -G ".whl/dill-*.whl"
      compgen -G ".whl/multiprocess-*.whl")
    if [ -n "$whls" ]; then
      # shellcheck disable=SC2086
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site-recipes $whls >>"$log" 2>&1
      export PYTHONPATH=/tmp/site-recipes:$PYTHONPATH
    fi
    if ! python3 -c "import trl, datasets, peft" >>"$log" 2>&1; then
      echo "recipes: trl / datasets / peft missing; carry their wheels in .whl (header)" | tee -a "$log"
      exit 1
    fi
    # The recipe's own lines, the Trainer's log dicts (loss, tokens_per_s, memory peaks), errors.
    show() { tr '\r' '\n' <"$log" | grep -aE "^($1):|\{'loss'|Error|error:|Killed" | tail -n "$2"; }
    { timeout 100 python3 recipes/sft.py --config benchmarks/configs/qwen2.5-7b --max-length 4096 \
        --batch-size 2 --max-steps 4 --lr 1e-5 --no-save --output-dir /tmp/recipes-sft
      echo "sft: exit status $?"; } >>"$log" 2>&1
    show sft 9
    pack
    { timeout 60 python3 recipes/lora.py --config benchmarks/configs/qwen2.5-7b --seq-len 4096 \
        --batch-size 2 --max-steps 4 --lr 2e-4 --eval-chunks 2 --output-dir /tmp/recipes-lora
      echo "lora: exit status $?"; } >>"$log" 2>&1
    show lora 11
    ;;
  recipes-cli)
    # Issue 6: the YAML recipes of `hf-megatrain train` at real size on one H200 (Qwen2.5-3B, so
    # that two fp32 checkpoints fit the 64 GiB disk), on the bundled corpus repeated 8x (~590k
    # tokens): (1) random init from the config, 2 steps, saved Hub-format; (2) the
    # continued-pretraining recipe from that checkpoint (64k tokens per step in 16 micro-batches);
    # (3) the long-context recipe at a 65,536-token sequence (MLP tiles, offload, HBM tier).
    data=/tmp/cli-data
    mkdir -p "$data"
    for _ in 1 2 3 4 5 6 7 8; do cat hf_megatrain/data/corpus.txt; done >"$data/corpus.txt"
    cli() { timeout "$1" python3 -m hf_megatrain train "${@:2}" >>"$log" 2>&1; echo "exit $? ($2 ...)" | tee -a "$log"; }
    cli 200 --config benchmarks/configs/qwen2.5-3b/config.json --data "$data" --seq-len 4096 \
      --batch-size 4 --max-steps 2 --resident-layers auto --no-verify --eval-fraction 0 \
      --output-dir /tmp/ckpt3b
    pack
    cli 200 --recipe recipes/continued_pretraining.yaml --model-path /tmp/ckpt3b --data "$data" \
      --max-steps 3 --resident-layers auto --no-verify --output-dir /tmp/cpt3b
    pack
    cli 150 --recipe recipes/long_context.yaml --config benchmarks/configs/qwen2.5-3b/config.json \
      --data "$data" --seq-len 65536 --max-steps 2 --output-dir /tmp/long3b
    tr '\r' '\n' <"$log" | grep -aE "^exit|\{'loss'|error" | tail -12
    ;;
  *)
    echo "unknown phase $phase" >&2
    exit 2
    ;;
esac
