"""``MegaTrainArguments``: ``TrainingArguments`` plus the streaming engine's knobs."""

from __future__ import annotations

from dataclasses import dataclass, field

from transformers import TrainingArguments


@dataclass
class MegaTrainArguments(TrainingArguments):
    """Training arguments for :class:`HFMegaTrainer`.

    Precision: ``bf16=True`` streams bf16 weights and computes under bf16 autocast with fp32 master
    weights and fp32 AdamW states; without it everything is fp32. ``fp16`` is refused.
    """

    megatrain_pin_memory: bool = field(
        default=True,
        metadata={
            "help": "Register the host store's PCIe-facing buffers (stream copy, gradients) as "
            "pinned memory when CUDA is present, so copies run at full PCIe bandwidth and "
            "overlap compute. Turn off only to debug."
        },
    )
    megatrain_host_memory_limit_gb: float | None = field(
        default=None,
        metadata={
            "help": "Host RAM (GiB) the host store may use. Default: what the OS reports as "
            "available (MemAvailable, capped by a cgroup limit). The run is refused before any "
            "allocation when the store does not fit."
        },
    )
    megatrain_max_shard_size: str = field(
        default="2GB",
        metadata={
            "help": "Largest safetensors shard written by save_model and checkpoints. Shards are "
            "serialized one at a time, so this also bounds the extra host RAM a save needs."
        },
    )
    megatrain_overlap_optimizer: bool | None = field(
        default=None,
        metadata={
            "help": "Run the host AdamW update of step t on a CPU thread while step t+1's forward "
            "runs; layer i streams in as soon as its update is done. Exact (same arithmetic, "
            "same order per layer). Default: on with CUDA, off on CPU."
        },
    )
    megatrain_resident_layers: str = field(
        default="0",
        metadata={
            "help": "Decoder layers whose whole state (fp32 master, AdamW moments, grad, compute "
            "copy: 18 bytes/param in bf16 runs) lives in HBM instead of host RAM; they never "
            "cross PCIe and update with the fused GPU AdamW. An integer, or 'auto' for as many "
            "as fit: the memory planner sizes activations, loss and resident embeddings for "
            "per_device_train_batch_size x megatrain_plan_seq_len tokens per micro-batch, or, "
            "when that length is unknown, reserves megatrain_hbm_reserve_gb for them."
        },
    )
    megatrain_plan_seq_len: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per training row that resident_layers='auto' plans HBM for. Default: "
            "the length of the first training example (its input_ids) when the dataset is "
            "indexable; otherwise the fixed megatrain_hbm_reserve_gb is used."
        },
    )
    megatrain_hbm_reserve_gb: float = field(
        default=48.0,
        metadata={
            "help": "HBM (GiB) kept free for activations, logits and resident embeddings when "
            "megatrain_resident_layers='auto' and the row length is unknown (see "
            "megatrain_plan_seq_len)."
        },
    )
    megatrain_keep_activations: str = field(
        default="auto",
        metadata={
            "help": "HBM-tier layers that keep their forward activations for backward instead "
            "of saving only their input and recomputing the layer (6 instead of about 7.5 "
            "FLOPs per parameter and token; identical results). 'auto': as many as the HBM left "
            "after the layer tier holds (the planned tier of megatrain_resident_layers='auto', "
            "or a count there, which leaves more room; needs a known row length and a GPU; the "
            "last layers of the tier are chosen), else none. An integer: "
            "that many (at most the HBM-tier layer count). 'off' or 0: recompute every layer. "
            "Streamed layers always recompute: their GPU buffer is reused by the next layer."
        },
    )
    megatrain_fused_loss: bool = field(
        default=True,
        metadata={
            "help": "In training, fuse the LM head with the cross-entropy and process tokens in "
            "chunks so full logits never exist (exact loss and gradients, HF's "
            "num_items_in_batch semantics). Applies to dense architectures; MoE models and "
            "evaluation use the model's own forward."
        },
    )
    megatrain_loss_chunk_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Tokens per chunk of the fused loss. Default: about 2 GiB of fp32 logits "
            "per chunk (3.5k tokens at a 152k vocabulary)."
        },
    )
    megatrain_mlp_tile_tokens: int = field(
        default=0,
        metadata={
            "help": "Run each decoder layer's dense MLP in tiles of this many tokens along the "
            "sequence (forward and backward recompute), so its (tokens x intermediate) "
            "intermediates exist for one tile at a time: for very long sequences. 0 = off."
        },
    )
    megatrain_offload_activations: bool = field(
        default=False,
        metadata={
            "help": "Keep each decoder layer's saved input (the boundary hidden states, >= 1M "
            "elements) in pinned host memory instead of HBM between forward and backward; "
            "backward prefetches layer i-1's input while layer i recomputes. For sequences whose "
            "boundary activations do not fit in HBM."
        },
    )
    megatrain_boundary_dtype: str = field(
        default="input",
        metadata={
            "help": "Precision of each decoder layer's saved input (the fp32 residual stream "
            "kept from forward to the backward recompute: tokens x hidden x 4 bytes per layer, "
            "the largest activation cost of long sequences). 'input' (default) or 'float32': "
            "kept as is, exact. 'bfloat16': saved rounded to bf16 (half the bytes in HBM, or in "
            "pinned host RAM and over PCIe with megatrain_offload_activations). The forward and "
            "the loss are unchanged (the layers still compute from the fp32 stream), but "
            "backward recomputes each layer from its rounded input (relative error <= 2^-9 "
            "per element), so gradients are approximate (1e-3 to 3e-3 relative error of the "
            "layer gradients on the small test models). Use it when the boundary activations "
            "are what does not fit (`hf-megatrain plan --bf16-boundaries` shows the effect). "
            "No effect on inputs already in bf16."
        },
    )
    megatrain_recompute_early_stop: bool = field(
        default=True,
        metadata={
            "help": "A recomputed layer (every streamed layer, HBM-tier layers that keep no "
            "activations) re-runs in backward only until the last tensor its backward needs is "
            "re-made, as torch's checkpointing does: the MLP's down projection and the residual "
            "add are not run twice (about 7% of a recomputed layer's linear FLOPs). Identical "
            "gradients either way; False re-runs the whole layer (for comparisons). Layers "
            "whose inputs are saved rounded (megatrain_boundary_dtype='bfloat16') always re-run "
            "whole."
        },
    )
    megatrain_keep_attention_outputs: str = field(
        default="off",
        metadata={
            "help": "Layers recomputed in backward that keep the fused attention kernel's "
            "outputs (SDPA's attention output and log-sum-exp) from forward, so that their "
            "recompute does not run attention's forward again (torch's selective "
            "checkpointing applied to the SDPA kernels): identical gradients, one attention "
            "forward less per such layer (the costliest part of a long sequence's recompute), "
            "for heads x head_dim compute-dtype values plus 4 B per head per token and layer "
            "in HBM. 'off'; 'all' (or True: every recomputed layer, counted when the plan "
            "sizes the HBM tier); 'auto' (as many of the last recomputed layers as the memory "
            "plan leaves HBM for after the HBM tier and kept activations; needs the plan: "
            "megatrain_resident_layers 'auto' or a count, on a GPU); or a count (the last N "
            "recomputed layers). Needs megatrain_recompute_early_stop; attention that does not "
            "run through PyTorch SDPA's fused kernels (flex attention, flash-attn) is "
            "recomputed as before."
        },
    )
    megatrain_checkpoint_every: int = field(
        default=1,
        metadata={
            "help": "Checkpoint segments of k decoder layers (k >= 1; 1 = off): only the first "
            "layer of each run of k saves its residual-stream input (the boundary activation, "
            "subject to megatrain_offload_activations and megatrain_boundary_dtype); the others "
            "save none and, in backward, get theirs by re-running the segment's forward from "
            "the first layer's saved input (once per segment, the inputs cached on the device "
            "for the segment's backward). Memory: ceil(layers / k) saved inputs instead of one "
            "per layer, plus up to k - 1 fp32 layer inputs in HBM while a segment's backward "
            "runs. Compute: k - 1 extra layer forwards per segment, i.e. (k - 1) / k of a layer "
            "forward per layer (a streamed layer's 8 FLOPs per parameter and token become "
            "8 + 2 (k - 1) / k: +12.5% at k=2, +19% at k=4, < +25% always). Exact: the "
            "recomputed inputs are the forward's, bit for bit. Only layers whose input is a "
            "large activation (>= 1M elements: the hidden states at training sizes) and the "
            "previous layer's output skip saving it; layers that keep their activations "
            "(megatrain_keep_activations) are never followers and end a segment."
        },
    )
    megatrain_eager_update: bool = field(
        default=True,
        metadata={
            "help": "With gradient clipping off (max_grad_norm <= 0), update each layer as soon "
            "as its gradient of the step is final, during the backward of the layers below it "
            "(nothing waits for a global norm). Same arithmetic as the update after backward."
        },
    )
    megatrain_host_grads: bool | None = field(
        default=None,
        metadata={
            "help": "Keep an fp32 gradient slot (4 bytes/param) in every host-tier layer store. "
            "Default (None): only when the update needs the step's gradients held, i.e. with "
            "clipping on (max_grad_norm > 0) or megatrain_eager_update off; with eager updates "
            "each layer's final gradient passes through a ring of "
            "2 pinned staging buffers (the size of one layer) into its CPU update instead, so "
            "the store takes 14 instead of 18 bytes/param in bf16 runs. True: always keep it. "
            "False: never (refused with clipping on or eager updates off)."
        },
    )
    megatrain_stream_fp32_master: bool = field(
        default=False,
        metadata={
            "help": "bf16 runs: keep no bf16 copy of host-tier layers in host RAM; stream the "
            "fp32 master (twice the H2D bytes) into an fp32 GPU staging buffer and cast it to "
            "bf16 on the GPU's copy stream. 2 bytes/param less host RAM (12 bytes/param with "
            "eager updates), for when host RAM, not PCIe, is the limit. Same weights: the cast "
            "rounds exactly as the host copy does. No effect in fp32 runs."
        },
    )
    megatrain_hbm_cast_weights: bool = field(
        default=False,
        metadata={
            "help": "bf16 runs: HBM-tier layers keep no bf16 copy of their weights, only the fp32 "
            "master, gradient and moments (16 instead of 18 bytes/param, what stock training "
            "keeps), so more layers fit in HBM; each is cast from its master into a stream "
            "buffer on the GPU's copy stream when it runs, as autocast casts fp32 weights in "
            "stock training. Same weights (the same rounding of the same master). The tier's "
            "layers that keep their activations (megatrain_keep_activations) keep their bf16 "
            "copy: their kept graph holds it. No effect in fp32 runs."
        },
    )
    megatrain_log_throughput: bool = field(
        default=True,
        metadata={
            "help": "Add tokens_per_s, model_tflops (6 * params * tokens/s), mfu (with causal "
            "attention FLOPs, on CUDA), host_rss_gib / host_peak_gib and hbm_peak_gib to the "
            "Trainer logs, so TensorBoard / W&B callbacks show them."
        },
    )
    megatrain_peak_tflops: float = field(
        default=989.0,
        metadata={
            "help": "Dense bf16 peak of the GPU in TFLOP/s, the denominator of the logged MFU "
            "(989 = H100/H200 SXM datasheet)."
        },
    )
