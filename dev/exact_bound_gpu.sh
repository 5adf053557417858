#!/usr/bin/env bash
# Issue 21's exact long-context runs and issue 20's GPU checks left over, as one queue that may
# outlast one device command (nvidia-h200, carry .whl; liger-kernel from its wheel):
#
#   BENCH_COMMIT=<hash> bash dev/exact_bound_gpu.sh start [ITEM ...]  # starts the queue, waits ~555 s
#   BENCH_COMMIT=<hash> bash dev/exact_bound_gpu.sh wait    # again, within the 30 s idle window
#
# The queue runs under setsid (the device tool leaves it running while the machine is held).
# Items, in the order given (default: exact1m exact459k over475k):
#   exact1m    Qwen2.5-1.5B, one 1,048,576-token sequence, the defaults (auto_fit picks the
#              options; fp32 boundaries, clipping on). ~14 min.
#   exact459k  Qwen2.5-7B at 458,752 tokens, the defaults: the plan's longest exact length.
#              ~8.5 min.
#   over475k   Qwen2.5-7B at 475,136 tokens, --auto-fit off with the options auto picks at
#              458,752: the plan's host side is 4.60 GiB short (the measured upper bound;
#              ~4 min if the host runs out as planned, ~9 if it trains).
#   14b64k     Qwen2.5-14B at 65,536 tokens/step (16 rows of 4,096), the defaults: clipping on,
#              auto_fit's cast HBM tier, fp32-master streaming, tiles, segments of 4. ~3 min.
#   seamtests  tests/test_gpu.py's cases that call what 2026-12-07 made public, and its working
#              set cases (the plan's hidden-state gradient line).
#   gemmatests tests/test_gpu.py's cases for the families of 2026-12-07 (53rd session): Gemma 4's
#              KV sharing and per-layer inputs, Gemma 4 unified, Gemma 3n (the family test, and
#              under FlexAttention, which "auto" picks for it past its window on CUDA).
#   oomtests   tests/test_gpu.py's out-of-memory watchdog and auto_fit cases (with the memory
#              options it switches on once nothing is left in HBM to give up).
#   familystep tests/test_gpu.py's family-step and family-at-width cases (the plan's lines per
#              family on CUDA, the latter at hidden 1,024: the terms of 2026-12-06) and
#              the cast HBM tier's (with the long-context options auto_fit pairs it with).
#   compacttests  tests/test_gpu.py's cases for the bf16 gradient slots and what they touch (the
#              slim stores, the watchdog's move to the host tier, auto_fit, autocast parity).
#   compact14b Qwen2.5-14B at 65,536 tokens/step, the defaults, with bf16 gradient slots
#              (auto_fit: segments of 2 instead of 4). ~3 min.
#   exact500k  Qwen2.5-7B at 499,712 tokens, the defaults: the plan's longest exact length with
#              bf16 gradient slots. ~10 min.
#   over508k   Qwen2.5-7B at 507,904 tokens, --auto-fit off with exact500k's options (segments
#              of 6, every layer streamed): the plan's GPU bound is 1.38 GiB over the H200's,
#              only by its margin for measured errors (the upper bound: trains, or runs out of
#              GPU memory with nothing for the watchdog to move). ~11 min if it trains.
#   auto524k   Qwen2.5-7B at one 524,288-token sequence on the defaults: the plan picks exact
#              options itself (auto_fit's least recompute: tiles, offload, fp32-master streaming,
#              segments of 6, 1 HBM-tier layer, 9 layers' attention outputs; expected 126.69 GiB;
#              since 2026-12-04 weighed with the chains' kept outputs: segments of 4, 5 HBM-tier
#              layers, 5 forward-kept outputs, chain outputs 1, filled to 2-3 per segment; bound
#              138.50, expected 128.10). At c670e18 (segments of 6, 1 tier layer, 9 outputs, no
#              chain outputs): 561.6 s, 42.65 model TFLOP/s, 34.1% MFU. ~12 min.
#   filltest   tests/test_gpu.py's chain-output cases (the per-segment fill below the peak).
#   auto262k   Qwen2.5-7B at one 262,144-token sequence on the defaults: auto_fit's least-recompute
#              set (tiles, offload, segments of 2, 8 HBM-tier layers, every layer's attention
#              outputs) against base262k's options (segments of 6, no tier: 95.62 model TFLOP/s).
#              The lightest set (no segments, 21 tier layers, 4 layers' outputs) is
#              `--checkpoint-every 1 --mlp-tile-tokens 16384 --offload-activations
#              --stream-fp32-master --hbm-cast-weights --auto-fit off` (item light262k). ~3 min each.
#   exact524k  Qwen2.5-7B at one 524,288-token sequence, exact, --auto-fit off with segments of 6
#              (every layer streamed): the plan expects 128.15 GiB of GPU (its bound, 144.19, is
#              over the H200 by its margin; exact500k reserved 10.5 GiB under its first-step
#              expectation) and
#              121.91 GiB of host without its 2.17 GiB margin. ~13 min if it trains.
#   timeline262k exact524k's options at 262,144 tokens with --layer-timing (diagnostic: the
#              long step's forward, chain recompute and backward per layer). ~3 min.
#   llama8b    Llama-3.1-8B at 65,536 tokens/step (16 rows of 4,096), the defaults. ~2 min.
#   slow14b    compact14b with the host update on 8 threads: a host whose AdamW runs ~2.2 G params/s
#              (some machine starts run 2.4), where the update falls behind the forward; with
#              --device-update-lead 2 (off by default 2026-12-04 to 12-05, on again since: the
#              GPU's AdamW rounds as the CPU's, core/exact_adamw.py).
#   nodevice14b compact14b with --device-update-lead 0 (the default 2026-12-04 to 12-05).
#   exactprobe dev/exact_adamw_probe.py (diagnostic: the CPU, and the elements the kernels round apart).
#   exacttests tests/test_exact_adamw.py's GPU kernel against the CPU kernel, tests/test_gpu.py's
#              device-update training (bitwise the CPU-only run), the alias-type Liger test and
#              tests/test_tiling.py's bf16 tile-gradient case on CUDA.
#   lead14b    compact14b with --device-update-lead 2 (the A/B of device updates).
#   timeline8b The same with --layer-timing (diagnostic: where the GPU waits). ~2 min.
#   qwen7b     Qwen2.5-7B at 65,536 tokens/step (16 rows of 4,096), the defaults. ~2 min.
#   familygpu2 dev/family_plan_sweep.py on CUDA at hidden 768 (familygpu's second width).
#   gradprobe  dev/grad_band_probe.py at the parity test's seed 1 (one step's gradients).
#   familymoe  dev/family_plan_sweep.py on CUDA for MoE families with wide experts (4x, 8x h).
#   aktests    tests/test_gpu.py's autocast_kernels cases (bitwise), with the Liger and compiled ones.
#   ligerbits  dev/liger_bitwise.py: the weights autocast_kernels on vs off change under Liger.
#   noak8b, noak14b  llama8b and compact14b with --no-autocast-kernels (PyTorch's cast kernels).
#   profile8b  llama8b with a CUDA kernel trace of one step (its .json.gz packed with the rows);
#              read it with benchmarks/trace_overlap.py --top N. ~3 min.
#   lktests    tests/test_gpu.py's fused-loss-kernel, chunked-loss and autocast_kernels cases,
#              then tests/test_gpu_parity.py (150 bf16 steps, 3 families, ~2 min).
#   chain262k  Qwen2.5-7B at 262,144 tokens with exact524k's options (segments of 6, every layer
#              streamed), the segment chains keeping 5 layers' attention outputs for their
#              recompute (--chain-attention-outputs 5); base262k: the same without. ~4 min each.
#   chaintest  tests/test_gpu.py's chain-attention, keep-attention and recompute tile-skip cases.
#   paritytest tests/test_gpu_parity.py alone (lktests' second half).
#   parityseeds the parity test's three families at seeds 1 and 2 (initial weights and data order),
#              SDPA pinned to math: whether streamed's drift against stock has one sign over
#              seeds (at 2defc34, seed 0: all three below stock, each inside its band). ~8 min.
#   seed1bisect the Llama of the parity test at seed 1 (math SDPA), where streamed left the band
#              (2.78x band_mean at c670e18; seeds 0 and 2: 0.46x, 0.49x): a third batching twin
#              (8 x 1) and streamed with one feature off at a time (Liger's kernels, the fused
#              loss, autocast_kernels, bf16 gradient slots, the overlapped host update) and with
#              every layer in HBM (nothing streamed): which one moves streamed back. ~4 min.
#   matrix9    the validation matrix's 9 cells whose plans changed since their rows (qwen3 and
#              mistral at 4k-256k, moe 256k; `validation_matrix.py --dry-run` lists them), without
#              liger-kernel as dev/matrix_gpu.sh runs them: rows and matrix.md in results/matrix.
#              ~15 min by the dry run's estimate.
#   unseen     the matrix tool on configs no issue or matrix names (benchmarks/configs:
#              gemma-3-12b, mistral-nemo-12b, phi-4, deepseek-v2-lite, llama-3.2-3b), without
#              liger-kernel, cells UNSEEN_CELLS (default below); rows and unseen.md in
#              results/unseen, tag unseen-h200.
#   matrixcasts the validation matrix's qwen3 and mistral cells at 4k, 32k and 128k again, planned
#              with autocast_kernels' shared casts counted in kept layers (since 2026-12-04: at
#              128k one more kept layer each; at 4k and 32k the same placement, expected 5-11
#              GiB lower), and qwen3 at 256k, whose recomputed layers' working set now counts
#              the compiled norms, the shared casts and the kept outputs (25-26 HBM-tier layers
#              where it kept 12). ~9 min.
#   keptgpu    tests/test_gpu.py's kept-activation memory cases: the kept layers' saves per token
#              against the plan's count with the shared casts (one bf16 cast per normed input).
#   wsgpu      tests/test_gpu.py's untiled working-set cases (Qwen3-1.7B- and Danube-wide layers,
#              PyTorch's and compiled kernels): the measured per-token peak against the line.
#   familygpu  dev/family_plan_sweep.py --device cuda at hidden 1,024 (8 heads of 128, 2 kv heads,
#              MLP 4,096), 16,384 tokens: the families given a fitted working-set term or RoPE
#              copies on the CPU tracker (2026-12-05) and Llama for reference, the CUDA
#              allocator's step peak against the plan. ~2 min.
#   familynew  dev/family_plan_sweep.py --device cuda as familygpu for the families added
#              2026-12-06 (ERNIE 4.5 MoE, DeepSeek-V3.2, MiniCPM3, BioGPT), the MoE families whose
#              shared experts the plan now reads from the module (Hunyuan, EXAONE-MoE), the dense
#              ones given the peak line or a fitted term (Ministral, Cohere 2, GLM, BitNet,
#              DiffLlama, nanochat, GPT-2, CodeGen), Persimmon (its ReLU^2 as nanochat's),
#              DeepSeek-V3 and Llama for reference. ~5 min; "familynew done" when complete.
#   familyall  dev/family_plan_sweep.py --device cuda as familygpu over every supported family,
#              then at hidden 768 the ones with a pow in their activation (fp32 under CUDA
#              autocast) or GPT-J's eager attention (Persimmon, GPT-Neo, CodeGen, GPT-2,
#              nanochat, BitNet). ~6 min; "familyall done" when complete.
#   familyeager dev/family_plan_sweep.py --device cuda for GPT-Neo, XGLM, CodeGen and GPT-J (their
#              own eager attention's score copies) and Llama 4 (every expert on every token) at
#              hidden 1,024 and 768. ~1 min.
#   llama4gpu  tests/test_gpu.py's Llama 4 cases (streamed against stock on the GPU).
#   compiledgpu tests/test_gpu.py's compiled-kernel cases: Llama's features and Qwen3, and the
#              families 'auto' compiles for since 2026-12-05 (Granite, EXAONE 4, Hunyuan). ~2 min.
#   lossexp    the fused loss kernel with CUDA's expf (was tl.exp's ex2.approx): its logit gradient
#              against the stock loss's (tests/test_gpu.py -k fused_loss_kernel prints the share of
#              entries that differ), then the parity Llama at seed 1 (math SDPA, twins 2,4,8) with
#              the kernel and without the fused loss: does the kernel's curve rejoin stock's group
#              (seed1bisect: defaults 1.66x band, without the fused loss 0.53x)? And
#              dev/loss_gemm_probe.py: is the head's weight gradient stock's GEMM bit for bit? ~4 min.
#   seed1optim the parity Llama at seed 1 (math SDPA) with the 8 x 1 twin and stock trained by
#              torch's other AdamW kernel (loss_curves.py --optim-twin) in the band: whether
#              stock's own fp32-ulp change moves it as far as streamed's host AdamW moved the
#              streamed curve (seed1bisect: every-layer-in-HBM 2e-3 from streamed). ~3 min.
#   old8b      long8b on an older tree: OLD_COMMIT=<hash>, the tree unpacked (as tree8b) with
#              `git archive <hash> | tar -x -C .abold/<hash>` and .abold carried (same-start A/B).
#   old14b     compact14b on the tree of $OLD_COMMIT, as old8b.
#   fp32m8b    llama8b with --stream-fp32-master (host-bound starts: less for the CPU AdamW to write).
#   tree8b:<hash>[+--flag+value...] llama8b (3 steps) on the tree of <hash> (flags of this item
#              alone after "+"), unpacked into .abold/<hash> (without
#              benchmarks/results): several trees on one machine start, to bisect a change of speed;
#              TREE8B_ARGS: more bench flags (e.g. --device-update-lead 0: the host path alone).
#   gemma4wide tests/test_gpu.py's Gemma 4 case at its own widths (heads of 256 and 512).
#   savetests  tests/test_gpu.py's save cases: a shard at a time, fused MoE experts reverted as
#              views (2026-12-07), save/resume on the CUDA path, a second gradient in one
#              micro-batch under eager updates (SecondGradientError from the CUDA drain).
#   tilegpu    tests/test_gpu.py's and test_tiling.py's CUDA tile cases (9, ~1 min on an H100).
#   newfam     ERNIE 4.5 MoE's, DeepSeek-V3.2's, MiniCPM3's and BioGPT's CUDA family cases and
#              the gradless-parameter skip on CUDA (test_gradless_params.py's GPU cases).
#   repeatprobe dev/repeat_probe.py on the Llama of the parity test (150 bf16 steps, each run
#              twice): stock, streamed, streamed without the overlapped host update and without
#              Liger-Kernel; then streamed with the SDPA backend pinned to math and with
#              deterministic algorithms: which part does not repeat bitwise (at e90dc3c streamed
#              first differed at step 34, stock repeats). ~5 min. repeatprobe2: streamed without
#              the fused loss, without autocast_kernels, without bf16 gradient slots. ~3 min.
#   warm8b     llama8b for one step, thrown away: the first bench process of a machine start runs
#              slow (its host-update waits fall step by step), so A/Bs go after it.
#   cast8b     llama8b with --hbm-cast-weights: HBM-tier layers cast on use, 2 more in the tier.
#   nolk8b     llama8b with --no-fused-loss-kernel (PyTorch's ops in the loss: the A/B).
#   compiled8b llama8b with --layer-kernels compiled: the defaults as without liger-kernel.
#   gemma2bisect benchmarks/loss_curves.py, Gemma2 small (parity's config): stock, its two
#              batching twins, streamed, and streamed with one recent exact option off at a time
#              (which one moves streamed out of the band). Curves in results/gemma2/. ~3 min.
#   devprobe   Gemma2 small, 20 steps: streamed with device updates (default) and without, step
#              by step against stock (a bug shows at once; rounding noise starts near 1e-7).
#   long8b, longnolk8b  llama8b and nolk8b with 8 timed steps (the host side settles).
#   devallprobe dev/device_update_probe.py: Gemma2 small, 150 bf16 steps, stock, its two twins,
#              streamed (no device updates) and twice streamed with every claimable host layer
#              taken over by the GPU each step, deterministically (whether the device path
#              depends on timing, and what the GPU AdamW's roundings alone do). ~3 min.
#   devparity  Parity curves (150 bf16 steps, stock + two batching twins) of Gemma2 and Llama with
#              streamed runs at device_update_lead 2 (twice: timing decides which layers the GPU
#              takes) and 0: whether device updates move streamed out of the band. ~5 min.
#   threads14b, threads8b  compact14b and llama8b with the host update on 15 of 16 cores (a
#              core left to the training thread): the A/B of host_update_threads. At c7afdc8
#              the default was 15 and these items ran 16: equal on the 14B, 16 +1% on the 8B.
#   updatetests tests/test_gpu.py's cases for the host update and the weight prefetch (the
#              deferred prefetch, bf16 slots, slim stores, eager updates, the timeline, resume).
#   updateprobe dev/host_update_probe.py: the host AdamW update's speed per page size, chunk,
#              stream-copy refresh and thread count, on one layer-sized store. ~1 min.
#   loratest   tests/test_gpu.py's LoRA / PEFT cases (since 2026-12-05 a frozen base is planned
#              streamed, as the builder places it).
#   trace8b    llama8b with the CUDA allocator's history (benchmarks/memory_trace.py's summary in
#              $work/trace8b.txt): which of the plan's lines holds the ~8.6 GiB the plan expects
#              above the measured peak at 64k (+6.7-6.9% in every llama8b64k row since e814603);
#              one more HBM-tier layer fits in it.
#   tier8b     llama8b with --resident-layers 16 and 17, every attention output kept, --auto-fit off
#              (auto picks 15 where ~9 GiB stay free; the plan says 16 and 17 do not fit).
#   evalsave   tests/test_gpu.py's loss-only evaluation (the fused loss in evaluation), its
#              out-of-memory recovery, save/resume and loss-kernel cases (2026-12-07's changes).
#   gpuaudit   tests/test_gpu.py's and test_peft_variants.py's cases for the 2026-12-05 CPU fixes
#              (a second trainer's new AdamW, LoRA variants with dropout), the loss kernel's
#              cases with their output, and GraniteMoE's row of familymoe (aux off where the
#              installed transformers cannot compute it).
#   apitests   tests/test_gpu.py's stock-parity, save/resume, second-trainer and module-call cases
#              (the trainer, CLI and Python-API paths on CUDA). ~3 min.
#   probe28    dev/long_peak_probe.py with the 7B's 28 layers at 131,072 tokens (9 HBM-tier
#              layers, the exact426k options): the phases' peaks and what is live at the peak.
# Every call packs what has finished into $OUT/exact-bound.tgz (rows, markdown, JSON, the log).
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

run64k() {  # run64k <tag> <model> <timeout> [bench args]: 65,536 tokens/step, 16 rows of 4,096
  local tag=$1 model=$2 limit=$3
  shift 3
  python3 benchmarks/bench.py --tag "$tag" --run "$model:65536:megatrain-hbm:16" --seq-len 4096 \
    --streamed-init --timeout-s "$limit" --results-dir "$work/results" "$@"
}

item() {  # item <name>: one queue item
  case "$1" in
    exact1m) run exact1m qwen2.5-1.5b:1048576 1300 ;;
    exact459k) run exact459k qwen2.5-7b:458752 700 --streamed-init ;;
    over475k)
      run over475k qwen2.5-7b:475136 700 --streamed-init --auto-fit off \
        --mlp-tile-tokens 16384 --offload-activations --stream-fp32-master --checkpoint-every 4
      ;;
    14b64k)
      run64k exact14b64k qwen2.5-14b 300 --steps 3 --warmup 1
      ;;
    compacttests)
      timeout 500 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "compact_host_grads or slim_host or out_of_memory_recovery or auto_fit_on_gpu or bf16_streamed_matches" \
        2>&1 | grep -v '^DEBUG'
      ;;
    compact14b)
      run64k compact14b64k qwen2.5-14b 300 --steps 3 --warmup 1
      ;;
    slimtest)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "slim_host" 2>&1 | grep -v '^DEBUG'
      ;;
    timeline14b)
      run64k timeline14b64k qwen2.5-14b 300 --steps 2 --warmup 1 --layer-timing
      ;;
    llama8b)
      run64k llama8b64k llama-3.1-8b 240 --steps 3 --warmup 1
      ;;
    aktests)  # autocast_kernels' GPU tests, beside the Liger and compiled-kernel paths they run in
      timeout 400 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "autocast_kernels or liger_kernels or (compiled_kernels and untiled)" 2>&1 | grep -v '^DEBUG'
      ;;
    ligerbits)  # which weights differ, autocast_kernels on vs off, per Liger kernel (diagnostic)
      timeout 300 python3 dev/liger_bitwise.py 2>&1 | grep -E "^liger|^  off|^  stock|Error"
      ;;
    lktests)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "fused_loss_kernel or chunked_loss or autocast_kernels" 2>&1 | grep -v '^DEBUG'
      timeout 330 python3 -m pytest tests/test_gpu_parity.py -o addopts="" -p no:cacheprovider \
        -q -s 2>&1 | grep -aE "band|took over|passed|failed|Error" | grep -v "^{"
      ;;
    base262k|chain262k)
      run "$1" qwen2.5-7b:262144 400 --streamed-init --auto-fit off --resident-layers 0 \
        --mlp-tile-tokens 16384 --offload-activations --stream-fp32-master --checkpoint-every 6 \
        --chain-attention-outputs "$([ "$1" = chain262k ] && echo 5 || echo 0)"
      ;;
    filltest)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "chain_attention or below_the_peak" 2>&1 | grep -v '^DEBUG'
      ;;
    chaintest)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "chain_attention or keep_attention_outputs_on_gpu or skips_the_tiles" 2>&1 \
        | grep -v '^DEBUG'
      ;;
    repeatprobe|repeatprobe2)
      if [ "$1" = repeatprobe ]; then
        sets=("--stock --variant ovl:overlap_optimizer=false --variant torchk:layer_kernels=torch"
              "--sdpa-backend math" "--deterministic")
      else
        sets=("--no-streamed --variant nofl:fused_loss=false --variant noak:autocast_kernels=false
               --variant nocompact:compact_host_grads=false")
      fi
      for extra in "${sets[@]}"; do
        # shellcheck disable=SC2086
        timeout 300 python3 dev/repeat_probe.py --family llama --steps 150 --out "$work/results" \
          $extra 2>&1 | grep -aE '^\{"family|Error' | tail -3
      done
      ;;
    paritytest)
      timeout 420 python3 -m pytest tests/test_gpu_parity.py -o addopts="" -p no:cacheprovider \
        -q -s -rA 2>&1 | grep -aE "band|took over|differs|passed|failed|PASSED|FAILED|Error" \
        | grep -v "^{"
      ;;
    parityseeds)  # the parity test's runs at data-order/weight seeds 1 and 2 (math SDPA): the drift's sign
      for seed in 1 2; do
        for fam in llama gemma2 qwen3_moe; do
          timeout 300 python3 benchmarks/loss_curves.py --family "$fam" --size small --seq-len 512 \
            --steps 150 --bf16 --band-accums 2,4 --seed "$seed" --sdpa-backend math --no-plot \
            --out "$work/results/seed$seed-$fam" 2>&1 | grep -aE "^  streamed|band_mean" | tail -2
        done
      done
      ;;
    seed1bisect)
      timeout 420 python3 benchmarks/loss_curves.py --family llama --size small --seq-len 512 \
        --steps 150 --bf16 --band-accums 2,4,8 --seed 1 --sdpa-backend math --no-plot \
        --out "$work/results/seed1bisect" --variant torchk:layer_kernels=torch \
        --variant nofl:fused_loss=false --variant noak:autocast_kernels=false \
        --variant nocompact:compact_host_grads=false --variant ovl:overlap_optimizer=false \
        --variant hbm:resident_layers=6 2>&1 | grep -v '^DEBUG' | tail -12
      ;;
    matrix9)  # (a site without liger-kernel: the defaults of a plain install, as matrix_gpu.sh)
      compgen -G ".whl/*.whl" | grep -v liger_kernel | xargs -r python3 -m pip install -q \
        --no-index --no-deps --target /tmp/site_noliger >/dev/null 2>&1
      PYTHONPATH=/tmp/site_noliger:$PWD timeout 1500 python3 benchmarks/validation_matrix.py \
        --cells qwen3:4k,qwen3:32k,qwen3:128k,qwen3:256k,mistral:4k,mistral:32k,mistral:128k,mistral:256k,moe:256k \
        --max-wall-s 1400 --tag matrix-h200 --results-dir "$work/results/matrix" 2>&1 \
        | grep -aE "^(matrix|Traceback|[A-Za-z.]*Error)"
      PYTHONPATH=/tmp/site_noliger:$PWD python3 benchmarks/validation_matrix.py --summarize \
        "$work/results/matrix/results.csv" --tag matrix-h200 \
        --markdown "$work/results/matrix/matrix.md" >/dev/null 2>&1
      ;;
    unseen)  # (a site without liger-kernel, as matrix9)
      compgen -G ".whl/*.whl" | grep -v liger_kernel | xargs -r python3 -m pip install -q \
        --no-index --no-deps --target /tmp/site_noliger >/dev/null 2>&1
      PYTHONPATH=/tmp/site_noliger:$PWD timeout 1500 python3 benchmarks/validation_matrix.py \
        --config g3=gemma-3-12b --config nemo=mistral-nemo-12b --config phi4=phi-4 \
        --config dsv2l=deepseek-v2-lite --config l3b=llama-3.2-3b \
        --cells ${UNSEEN_CELLS:-dsv2l:32k,phi4:32k,l3b:128k,g3:32k,nemo:128k} \
        --max-wall-s 1400 --tag unseen-h200 --results-dir "$work/results/unseen" 2>&1 \
        | grep -aE "^(matrix|Traceback|[A-Za-z.]*Error)"
      PYTHONPATH=/tmp/site_noliger:$PWD python3 benchmarks/validation_matrix.py --summarize \
        "$work/results/unseen/results.csv" --tag unseen-h200 \
        --markdown "$work/results/unseen/unseen.md" >/dev/null 2>&1
      ;;
    matrixcasts)  # (a site without liger-kernel, as matrix9)
      compgen -G ".whl/*.whl" | grep -v liger_kernel | xargs -r python3 -m pip install -q \
        --no-index --no-deps --target /tmp/site_noliger >/dev/null 2>&1
      PYTHONPATH=/tmp/site_noliger:$PWD timeout 1100 python3 benchmarks/validation_matrix.py \
        --cells ${MATRIX_CELLS:-qwen3:4k,qwen3:32k,qwen3:128k,qwen3:256k,mistral:4k,mistral:32k,mistral:128k} \
        --max-wall-s 1000 --tag matrix-h200 --results-dir "$work/results/matrix" 2>&1 \
        | grep -aE "^(matrix|Traceback|[A-Za-z.]*Error)"
      ;;
    keptgpu)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q -s \
        -k "kept_activation_memory" 2>&1 | grep -aE "kept bytes|passed|failed|Error" | tail -8
      ;;
    wsgpu)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q -s \
        -k "untiled_working_set" 2>&1 | grep -aE "working set per token|passed|failed|Error" | tail -8
      ;;
    compiledgpu)
      timeout 400 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "compiled_kernels_on_gpu or defaults_on_gpu" 2>&1 | grep -aE "passed|failed|Error" | tail -12
      ;;
    familygpu)
      timeout 300 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 1024,8,2,128,4096 --markdown "$work/results/family_plan_sweep_cuda_h1024.md" \
        llama olmo2 olmo3 hunyuan_v1_dense exaone4 apertus gptj phi stablelm olmo arcee nemotron \
        ernie4_5 helium 2>&1 | grep -aE "ratio|error"
      ;;
    familynew)  # the families added 2026-12-06 and the MoE ones with shared experts under other names
      timeout 540 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 1024,8,2,128,4096 --markdown "$work/results/family_plan_sweep_cuda_new.md" \
        llama ernie4_5_moe hunyuan_v1_moe exaone_moe deepseek_v32 deepseek_v3 minicpm3 biogpt \
        ministral cohere2 glm bitnet diffllama nanochat gpt2 codegen persimmon \
        2>&1 | grep -aE "ratio|error"
      echo "familynew done"
      ;;
    familyall)  # every supported family at hidden 1,024 on the CUDA allocator, then the ones with
      # fp32 activations under autocast (pow: gelu_new, ReLU^2) or their own eager attention at 768
      timeout 420 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 1024,8,2,128,4096 --markdown "$work/results/family_plan_sweep_cuda_all.md" \
        2>&1 | grep -aE "ratio|error"
      timeout 150 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 768,6,2,128,3072 --markdown "$work/results/family_plan_sweep_cuda_act768.md" \
        persimmon gpt_neo codegen gpt2 nanochat bitnet 2>&1 | grep -aE "ratio|error"
      echo "familyall done"
      ;;
    familyeager)  # the eager families given their scores' copies (2026-12-06), at two widths
      for w in 1024,8,2,128,4096 768,6,2,128,3072; do
        timeout 120 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 --widths "$w" \
          gpt_neo xglm codegen gptj llama4_text 2>&1 | grep -aE "ratio|error"
      done
      echo "familyeager done"
      ;;
    llama4gpu)  # Llama 4 (text) on the GPU: its family cases against stock
      timeout 300 python3 -m pytest tests/test_gpu.py -k "llama4" -o addopts="" -p no:cacheprovider \
        -rA -q 2>&1 | grep -aE "PASSED|FAILED|ERROR|passed|failed|Error" | tail -12
      ;;
    familygpu2)  # familygpu at a second width: the CUDA activation terms off their fitted point
      timeout 300 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 768,6,2,128,3072 --markdown "$work/results/family_plan_sweep_cuda_h768.md" \
        llama apertus arcee nemotron phi gptj olmo2 hunyuan_v1_dense exaone4 2>&1 \
        | grep -aE "ratio|error"
      ;;
    gradprobe)  # one step's gradients at seed 1 (steps 0 and 64): streamed vs stock's twins
      timeout 540 python3 dev/grad_band_probe.py --family llama --size small --seq-len 512 \
        --seed 1 --at-steps ${GRADPROBE_STEPS:-0,64} --batches ${GRADPROBE_BATCHES:-2} --band-accums 2,4,8 --sdpa-backend math \
        --variant nofl:fused_loss=false --variant torchk:layer_kernels=torch \
        --variant plain:layer_kernels=torch,fused_loss_kernel=false \
        --variant hbm:resident_layers=6 --out "$work/results/gradprobe" 2>&1 \
        | grep -aE "^step|^  |wrote|Error" | grep -v "^  device updates"
      ;;
    familymoe)  # MoE families with experts 4x and 8x the hidden size on CUDA (the wide-expert peak)
      for w in 1024,8,2,128,4096 512,4,2,128,4096; do
        timeout 200 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 --widths "$w" \
          --markdown "$work/results/family_plan_sweep_cuda_moe_${w%%,*}.md" mixtral olmoe \
          granitemoe qwen2_moe qwen3_moe deepseek_v2 deepseek_v3 glm4_moe dots1 2>&1 \
          | grep -aE "ratio|error"
      done
      ;;
    lossexp)
      timeout 60 python3 dev/loss_gemm_probe.py 2>&1 | tail -8
      timeout 180 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q -s \
        -k "fused_loss_kernel" 2>&1 | grep -aE "differ|passed|failed|Error" | tail -10
      timeout 420 python3 benchmarks/loss_curves.py --family llama --size small --seq-len 512 \
        --steps 150 --bf16 --band-accums 2,4,8 --seed 1 --sdpa-backend math --no-plot \
        --out "$work/results/seed1exp" --variant nofl:fused_loss=false 2>&1 \
        | grep -v '^DEBUG' | tail -8
      ;;
    seed1optim)
      timeout 420 python3 benchmarks/loss_curves.py --family llama --size small --seq-len 512 \
        --steps 150 --bf16 --band-accums 2,4,8 --optim-twin --seed 1 --sdpa-backend math \
        --no-plot --out "$work/results/seed1optim" 2>&1 | grep -v '^DEBUG' | tail -8
      ;;
    tree8b:*)  # llama8b on the tree of the hash after the colon, unpacked into .abold/<hash>;
      # bench flags of this item alone after it, joined by "+" (tree8b:<hash>+--flag+value)
      local item=${1#tree8b:}
      local tree=${item%%+*} extra=""
      [ "$item" != "$tree" ] && extra=${item#*+} && extra=${extra//+/ }
      (cd ".abold/$tree" && PYTHONPATH=/tmp/site:$PWD BENCH_COMMIT=$tree python3 \
        benchmarks/bench.py --tag "tree8b64k" --run "llama-3.1-8b:65536:megatrain-hbm:16" \
        --seq-len 4096 --streamed-init --timeout-s 240 --results-dir "$work/results" --steps 3 \
        --warmup 1 ${TREE8B_ARGS:-} $extra)
      ;;
    old8b)  # long8b on the tree of $OLD_COMMIT, unpacked (git archive) into .abold/$OLD_COMMIT
      (cd ".abold/${OLD_COMMIT:?}" && PYTHONPATH=/tmp/site:$PWD BENCH_COMMIT=${OLD_COMMIT:?} python3 \
        benchmarks/bench.py --tag old8b64k --run "llama-3.1-8b:65536:megatrain-hbm:16" \
        --seq-len 4096 --streamed-init --timeout-s 300 --results-dir "$work/results" --steps 8 \
        --warmup 1)
      ;;
    old14b)  # compact14b on the tree of $OLD_COMMIT, as old8b
      (cd ".abold/${OLD_COMMIT:?}" && PYTHONPATH=/tmp/site:$PWD BENCH_COMMIT=${OLD_COMMIT:?} python3 \
        benchmarks/bench.py --tag old14b64k --run "qwen2.5-14b:65536:megatrain-hbm:16" \
        --seq-len 4096 --streamed-init --timeout-s 300 --results-dir "$work/results" --steps 3 \
        --warmup 1)
      ;;
    tilegpu)  # the CUDA tile cases only (-k "tile or tiled" also runs test_tiling.py's CPU ones)
      timeout 280 python3 -m pytest tests/test_gpu.py tests/test_tiling.py -o addopts="" \
        -p no:cacheprovider -v -k "offload-tiles or (liger_kernels_on_gpu and mlp-tiles) or \
        (compiled_kernels_on_gpu and mlp-tiles) or recompute_skips_the_tiles_on_gpu or \
        attention-outputs-tiles or (in_bf16 and cuda) or (dropout_masks and cuda) or \
        (mlp_tile_term_on_gpu and liger)" 2>&1 |
        grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|Error"
      ;;
    newfam)  # the families added 2026-12-06 (afternoon) on CUDA, and the skip of gradless parameters
      timeout 280 python3 -m pytest tests/test_gpu.py tests/test_gradless_params.py -o addopts="" \
        -p no:cacheprovider -v -k "ernie4_5_moe or deepseek_v32 or minicpm3 or biogpt or skipped_on_gpu" 2>&1 |
        grep -E "PASS|FAIL|SKIP|ERROR|passed|failed|Error"
      ;;
    gemma2bisect)
      timeout 400 python3 benchmarks/loss_curves.py --family gemma2 --size small --seq-len 512 \
        --steps 150 --bf16 --band-accums 2,4 --no-plot --out "$work/results/gemma2" \
        --variant noak:autocast_kernels=false --variant nodev:device_update_lead=0 \
        --variant nocompact:compact_host_grads=false 2>&1 | grep -v '^DEBUG' | tail -15
      ;;
    devprobe)
      timeout 200 python3 benchmarks/loss_curves.py --family gemma2 --size small --seq-len 512 \
        --steps 20 --bf16 --band-accums 2 --no-plot --out "$work/results/devprobe" \
        --variant nodev:device_update_lead=0 2>&1 | grep -v '^DEBUG' | tail -6
      python3 - "$work/results/devprobe/loss_curves.csv" <<'PY'
import csv, sys
c = {}
for r in csv.DictReader(open(sys.argv[1])):
    c.setdefault(r["run"], {})[int(r["step"])] = float(r["loss"])
s = c["stock"]
for k in sorted(s):
    print(k, " ".join(f"{n}={c[n][k] / s[k] - 1:+.2e}" for n in c if n != "stock"))
PY
      ;;
    long8b)
      run64k long8b64k llama-3.1-8b 300 --steps 8 --warmup 1
      ;;
    longnolk8b)
      run64k longnolk8b64k llama-3.1-8b 300 --steps 8 --warmup 1 --no-fused-loss-kernel
      ;;
    devparity)
      for fam in gemma2 llama; do
        timeout 400 python3 benchmarks/loss_curves.py --family "$fam" --size small --seq-len 512 \
          --steps 150 --bf16 --band-accums 2,4 --no-plot --out "$work/results/devparity-$fam" \
          --variant lead2a:device_update_lead=2 --variant lead2b:device_update_lead=2 \
          --variant lead0:device_update_lead=0 2>&1 | grep -v '^DEBUG' | tail -8
      done
      ;;
    warm8b)
      run64k warm8b64k llama-3.1-8b 240 --steps 1 --warmup 1
      ;;
    cast8b)  # llama8b with --hbm-cast-weights (18 HBM-tier layers instead of 16: less host update)
      run64k cast8b64k llama-3.1-8b 240 --steps 3 --warmup 1 --hbm-cast-weights
      ;;
    nolk8b)
      run64k nolk8b64k llama-3.1-8b 240 --steps 3 --warmup 1 --no-fused-loss-kernel
      ;;
    compiled8b)
      run64k compiled8b64k llama-3.1-8b 300 --steps 3 --warmup 1 --layer-kernels compiled
      ;;
    noak8b)  # llama8b with --no-autocast-kernels (the A/B of autocast_kernels)
      run64k noak8b64k llama-3.1-8b 240 --steps 3 --warmup 1 --no-autocast-kernels
      ;;
    noak14b)
      run64k noak14b64k qwen2.5-14b 300 --steps 3 --warmup 1 --no-autocast-kernels
      ;;
    profile8b)  # llama8b with one step's CUDA kernel trace (the last warm-up step), copied to $work
      run64k profile8b64k llama-3.1-8b 300 --steps 1 --warmup 2 --profile
      cp benchmarks/results/traces/*llama-3.1-8b-65536.json.gz "$work/" 2>/dev/null
      ;;
    threads14b)  # the host update on 15 of the 16 cores (the default: all of torch's threads)
      run64k threads14b64k qwen2.5-14b 300 --steps 3 --warmup 1 --host-update-threads 15
      ;;
    threads8b)
      run64k threads8b64k llama-3.1-8b 240 --steps 3 --warmup 1 --host-update-threads 15
      ;;
    nodevice14b)  # compact14b with every host update on the CPU (the A/B of device updates)
      run64k nodevice14b64k qwen2.5-14b 300 --steps 3 --warmup 1 --device-update-lead 0
      ;;
    slow14b)  # a slow host stood in for: the host update on 8 of the 16 cores (~2.2 G params/s)
      run64k slow14b64k qwen2.5-14b 300 --steps 3 --warmup 1 --host-update-threads 8 \
        --device-update-lead 2
      ;;
    lead14b)
      run64k lead14b64k qwen2.5-14b 300 --steps 3 --warmup 1 --device-update-lead 2
      ;;
    devallprobe)
      timeout 400 python3 dev/device_update_probe.py --family gemma2 --size small --seq-len 512 \
        --steps 150 --bf16 --band-accums 2,4 --no-plot --out "$work/results/devall" \
        --variant alla:device_update_lead=2 --variant allb:device_update_lead=2 2>&1 \
        | grep -v '^DEBUG' | tail -10
      ;;
    timeline8b)
      run64k timeline8b64k llama-3.1-8b 240 --steps 2 --warmup 1 --layer-timing
      ;;
    qwen7b)
      run64k qwen7b64k qwen2.5-7b 240 --steps 3 --warmup 1
      ;;
    exactprobe)  # where the device updates' AdamW and the CPU's round apart, if anywhere
      timeout 200 python3 dev/exact_adamw_probe.py 2>&1 | grep -v '^DEBUG' | tail -40
      ;;
    exacttests)
      timeout 500 python3 -m pytest tests/test_exact_adamw.py tests/test_gpu.py tests/test_tiling.py \
        -o addopts="" -p no:cacheprovider -rA -q \
        -k "gpu_kernel or device_updates or built_as_llama or untiled_ones" 2>&1 | grep -v '^DEBUG'
      ;;
    updatetests)
      timeout 500 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "device_updates or prefetch_waits or compact_host_grads or slim_host or eager_updates or layer_timeline or save_resume" \
        2>&1 | grep -v '^DEBUG'
      ;;
    updateprobe)
      timeout 240 python3 dev/host_update_probe.py --json "$work/results/host_update_probe.json"
      ;;
    exact500k) run exact500k qwen2.5-7b:499712 900 --streamed-init ;;
    auto524k) run auto524k qwen2.5-7b:524288 1500 --streamed-init ;;
    auto262k) run auto262k qwen2.5-7b:262144 600 --streamed-init ;;
    light262k) run light262k qwen2.5-7b:262144 600 --streamed-init --mlp-tile-tokens 16384 \
      --offload-activations --stream-fp32-master --hbm-cast-weights --auto-fit off ;;
    exact524k)
      run exact524k qwen2.5-7b:524288 1000 --streamed-init --auto-fit off --resident-layers 0 \
        --mlp-tile-tokens 16384 --offload-activations --stream-fp32-master --checkpoint-every 6
      ;;
    timeline262k)  # exact524k's options at 262,144 tokens, with the layer timeline (diagnostic)
      run timeline262k qwen2.5-7b:262144 400 --streamed-init --auto-fit off --resident-layers 0 \
        --mlp-tile-tokens 16384 --offload-activations --stream-fp32-master --checkpoint-every 6 \
        --layer-timing
      ;;
    over508k)
      run over508k qwen2.5-7b:507904 900 --streamed-init --auto-fit off --resident-layers 0 \
        --mlp-tile-tokens 16384 --offload-activations --stream-fp32-master --checkpoint-every 6
      ;;
    gemma4wide)  # Gemma 4 at its own head widths (256 sliding, 512 full) against stock on CUDA
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "gemma4_wide" 2>&1 | grep -v '^DEBUG'
      ;;
    savetests)
      timeout 300 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "shard_at_a_time or save_resume_on_gpu or two_forwards" 2>&1 | grep -v '^DEBUG'
      ;;
    seamtests)  # the GPU tests that call what 2026-12-07 made public (streamed_model, run_tile,
      # working_set_line) and the plan's whole-step lines on CUDA (the hidden-state gradient line)
      timeout 540 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "save_resume_on_gpu or recompute_skips_the_tiles_on_gpu or evaluation_out_of_memory \
        or mlp_tile_term_on_gpu or kept_attention_output_memory or working_set" 2>&1 \
        | grep -v '^DEBUG'
      ;;
    gemmatests)  # the carried keys/values and per-layer inputs, Gemma 4 unified, Gemma 3n
      timeout 540 python3 -m pytest tests/test_gpu.py tests/test_gpu_attention.py -o addopts="" \
        -p no:cacheprovider -rA -q -k "kv_sharing_and_per_layer_inputs_on_gpu or \
        (every_family_trains_like_stock_on_gpu and (gemma3n or gemma4)) or \
        (auto_flex_attention_trains_like_eager and gemma3n)" 2>&1 | grep -v '^DEBUG'
      ;;
    oomtests)  # the out-of-memory watchdog's GPU cases (the HBM tier, evaluation, the memory
      # options switched on once nothing is left in HBM: 2026-12-07, 54th session)
      timeout 400 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "out_of_memory or auto_fit_on_gpu" 2>&1 | grep -v '^DEBUG'
      ;;
    familystep)
      timeout 540 python3 -m pytest tests/test_gpu.py -k "family_step or family_at_width or hbm_cast" -o addopts="" \
        -p no:cacheprovider -rA -q -s --durations=12 2>&1 | grep -v '^DEBUG'
      ;;
    probe28)
      timeout 400 python3 dev/long_peak_probe.py benchmarks/configs/qwen2.5-7b --layers 28 \
        --tokens 131072 --hbm-layers 9 --option checkpoint_every=4 \
        --option mlp_tile_tokens=16384 --option offload_activations=true \
        --option stream_fp32_master=true --json "$work/results/probe28.json"
      ;;
    loratest)  # tests/test_gpu.py's LoRA / PEFT cases (a frozen base is planned streamed)
      timeout 200 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q \
        -k "lora or peft or adapter" 2>&1 | grep -aE "passed|failed|Error" | tail -8
      ;;
    fp32m8b)  # llama8b with --stream-fp32-master: the host AdamW writes no bf16 copy (2 of its
      # ~30 B per parameter) and the streamed layers' weights cross PCIe in fp32
      run64k fp32m8b64k llama-3.1-8b 240 --steps 3 --warmup 1 --stream-fp32-master
      ;;
    tier8b)  # llama8b with 16 and 17 HBM-tier layers (auto picks 15), every attention output
      for n in ${TIER8B_LAYERS:-16 17}; do  # kept as auto keeps them (the plan's over-estimate)
        run64k "tier${n}_8b64k" llama-3.1-8b 240 --steps 3 --warmup 1 --resident-layers "$n" \
          --keep-attention-outputs all --auto-fit off
      done
      ;;
    trace8b)  # llama8b's allocator history summarized (what is live at the reserved peak)
      BENCH_MEMORY_TRACE="$work/trace8b.txt" run64k trace8b64k llama-3.1-8b 300 --steps 1 \
        --warmup 1
      ;;
    apitests)  # the trainer, CLI and module-call paths on CUDA (stock parity, save/resume)
      timeout 400 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q -m gpu \
        -k "like_stock or save_resume or second_trainer or module_calls" 2>&1 | grep -v '^DEBUG'
      ;;
    evalsave)  # 2026-12-07 (46th): loss-only evaluation's fused loss and saves over store views
      timeout 400 python3 -m pytest tests/test_gpu.py -o addopts="" -p no:cacheprovider -rA -q -m gpu \
        -k "loss_only_evaluation or evaluation_out_of_memory or save_resume or fused_loss_kernel" \
        2>&1 | grep -v '^DEBUG'
      ;;
    gpuaudit)  # the thirtieth session's CPU fixes on CUDA, and the loss kernel's cases in full
      timeout 300 python3 -m pytest tests/test_gpu.py tests/test_peft_variants.py -o addopts="" \
        -p no:cacheprovider -rA -q -s -m gpu \
        -k "second_trainer or peft_variant or fused_loss_kernel or module_calls_on_gpu" 2>&1 \
        | grep -aE "^loss|^max|differ|^E  |passed|failed|Error" | tail -60
      timeout 200 python3 dev/family_plan_sweep.py --device cuda --tokens 16384 \
        --widths 1024,8,2,128,4096 granitemoe 2>&1 | grep -aE "ratio|error"
      ;;
    *) echo "unknown item: $1" ;;
  esac
}

if [ "$mode" = queue ]; then
  shift
  [ "$#" -gt 0 ] || set -- exact1m exact459k over475k
  for name in "$@"; do item "$name"; done
  echo "queue done"
  exit 0
fi
if [ "$mode" = start ]; then
  rm -rf "$work" && mkdir -p "$work/results"
  shift
  setsid nohup bash "$0" queue "$@" >"$work/queue.log" 2>&1 </dev/null &
  sleep 5
fi
if [ ! -f "$work/queue.log" ]; then
  # A fresh machine (the last one was released after its idle window): nothing to wait for.
  echo "no queue on this machine (it was given back since 'start'): run 'start' again"
  exit 1
fi
waited=0
while ! grep -q "queue done" "$work/queue.log" && [ "$waited" -lt "${WAIT_S:-555}" ]; do
  sleep 5
  waited=$((waited + 5))
done
grep -q "queue done" "$work/queue.log" || echo "queue still running after ${waited}s"
free -g | head -2
grep -aE "^bench|^matrix|placement|auto_fit|Error|error:|Killed|out of memory|passed|failed|peak" \
  "$work/queue.log" | tail -30
tar czf "$out/exact-bound.tgz" -C "$work" .
