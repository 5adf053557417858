"""Ulysses sequence parallelism for a streamed HF model: DeepSpeed's implementation, our trainer.

``megatrain_sequence_parallel=N`` (``--sequence-parallel N``): each group of N consecutive ranks
trains on one batch together, each rank holding a contiguous 1/N of every sequence. Nothing here
implements the parallelism itself; it is DeepSpeed's (``deepspeed.runtime.sequence_parallel
.ulysses_sp``, the ALST code that ``accelerate``'s ``ParallelismConfig(sp_backend="deepspeed")``
also uses), run without the DeepSpeed engine:

* ``UlyssesSPAttentionHF.register_with_transformers`` wraps the model's attention function
  (``ALL_ATTENTION_FUNCTIONS[attn_implementation]``): before the core attention an all-to-all
  turns (local tokens, all heads) into (all tokens, heads / N), after it the reverse. The
  decoder layers' other work (norms, MLP, projections) is per token and runs on the local shard.
  It runs inside our streamed layers as it would in any HF model, in forward and in backward's
  recompute (every rank recomputes the same layers, so the collectives match).
* ``UlyssesSPDataLoaderAdapter`` shards the batches: the N ranks' batches are all-gathered and
  processed one after the other, each split along the sequence; labels are shifted before the
  split (``shift_labels``, -100 after the last token), so the token at a shard's end predicts the
  first token of the next shard. ``position_ids`` (global) are added when the collator gave none.

The loss and the gradients need nothing new. Each rank's batch carries ``labels`` = its shard of
``shift_labels``; the Trainer counts ``num_items_in_batch`` over them and, with
``average_tokens_across_devices`` (on by default, forced on here), sums the count over all ranks:
T, the valid tokens of every shard of every sequence in the step. Each rank's loss is then
(sum of its token losses) / T x world_size (the Trainer's scaling), and the engine's data-parallel
reduction sums the ranks' gradients and divides by world_size (core/distributed.py): the gradient
of the global token mean, sum over all tokens / T, exactly what one process computes on whole
sequences. (Averaging per-rank *mean* losses instead would be wrong here: the last shard has one
valid label fewer.) Groups of N are data parallel to each other through the same reduction.

The memory plan sizes activations for this rank's shard (seq_len / N tokens per row: the
trainer's ``_plan_step``); a resume within an epoch skips shards, not rows
(``SequenceShardedLoader.skip_first_batches``, installed in place of accelerate's for the
Trainer's resume).

Not here: evaluation runs without sequence parallelism (each rank evaluates its own rows on whole
sequences, ``disable_in_eval``); attention masks are dropped (causal attention from positions;
right padding is harmless, packed documents need flash attention's position-id path); sliding-
window attention through SDPA is refused (its mask would be dropped).
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from torch import nn

from .loss import unwrap_peft

logger = logging.getLogger(__name__)

#: Attention implementations DeepSpeed's Ulysses wrapper accepts here (eager needs a full mask).
SUPPORTED_ATTENTION = ("sdpa", "flash_attention_2", "flash_attention_3")

# attn_implementation -> transformers' own function, before a Ulysses wrapper replaced it (so a
# second trainer in the same process wraps the original, not the first wrapper).
_ORIGINAL_ATTENTION: dict = {}


class SequenceParallelError(ValueError):
    """A sequence-parallel setup that cannot run (heads not divisible, world size, ...)."""


def _import_deepspeed():
    try:
        import deepspeed.comm as ds_comm  # noqa: PLC0415
        from deepspeed.runtime.sequence_parallel import parallel_state_sp  # noqa: PLC0415
        from deepspeed.runtime.sequence_parallel.ulysses_sp import (  # noqa: PLC0415
            UlyssesSPAttentionHF,
            UlyssesSPDataLoaderAdapter,
        )
    except ImportError as e:
        raise ImportError(
            "hf_megatrain: megatrain_sequence_parallel > 1 runs DeepSpeed's Ulysses sequence "
            f"parallelism and needs the deepspeed package (pip install deepspeed): {e}"
        ) from None
    return ds_comm, parallel_state_sp, UlyssesSPAttentionHF, UlyssesSPDataLoaderAdapter


def check_sequence_parallel(config, size: int, world_size: int, local_world_size: int) -> None:
    """Refuse what Ulysses cannot run, before any collective (every rank decides alike)."""
    if size <= 1:
        return
    if world_size % size:
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size} needs a multiple of {size} "
            f"processes, but {world_size} were launched (--nproc_per_node / --num_processes)."
        )
    if local_world_size % size:
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size} groups ranks of one node, but a "
            f"node runs {local_world_size} processes; run a multiple of {size} per node."
        )
    cfg = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    if heads % size or (kv % size and size % kv):
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: Ulysses splits the attention "
            f"heads across the {size} ranks of a sequence, but the model has "
            f"num_attention_heads={heads} and num_key_value_heads={kv}; the query heads must "
            f"be divisible by {size}, and the key/value heads divisible by it (or it by them)."
        )
    attn = getattr(config, "_attn_implementation", None) or "sdpa"
    if attn not in SUPPORTED_ATTENTION:
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size} needs attn_implementation in "
            f"{SUPPORTED_ATTENTION}, not {attn!r} (Ulysses drops the attention mask: attention "
            "is causal from the positions)."
        )
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        sliding = any("sliding" in str(t) for t in types)
    else:
        sliding = getattr(cfg, "sliding_window", None) is not None and getattr(
            cfg, "use_sliding_window", True
        )
    if sliding and attn == "sdpa":
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model uses sliding-window "
            "attention, which SDPA applies through the attention mask, and Ulysses drops the mask "
            "(every token would attend to the whole prefix). Use attn_implementation="
            "'flash_attention_2', or no sequence parallelism."
        )


class SequenceParallel:
    """This rank's Ulysses group, with DeepSpeed's attention wrapper registered."""

    def __init__(self, model: nn.Module, size: int, micro_batch_size: int) -> None:
        ds_comm, mpu, ulysses, self._adapter = _import_deepspeed()
        if not dist.is_initialized():
            raise SequenceParallelError(
                "hf_megatrain: megatrain_sequence_parallel > 1 needs a launch of several "
                "processes (torchrun / accelerate launch)"
            )
        if not ds_comm.is_initialized():
            # Wraps the existing torch.distributed group; creates nothing new.
            ds_comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # noqa: PLC0415

        hf_model = unwrap_peft(model)
        attn = getattr(hf_model.config, "_attn_implementation", None) or "sdpa"
        if attn in _ORIGINAL_ATTENTION:
            # An earlier trainer in this process wrapped it: wrap transformers' own again.
            ALL_ATTENTION_FUNCTIONS[attn] = _ORIGINAL_ATTENTION[attn]
        else:
            _ORIGINAL_ATTENTION[attn] = ALL_ATTENTION_FUNCTIONS[attn]
        # DeepSpeed keeps its groups module-global and refuses a second setup; a new trainer
        # builds them again (collective, in the same order on every rank).
        mpu._SEQUENCE_PARALLEL_GROUP = None
        mpu._SEQUENCE_DATA_PARALLEL_GROUP = None
        ulysses.register_with_transformers(
            model_name_or_path=hf_model,
            core_attn_implementation=attn,
            sequence_parallel_size=size,
            micro_batch_size=micro_batch_size,
            seq_length_is_variable=True,
            # Evaluation batches are not sharded: each rank evaluates its own whole rows.
            disable_in_eval=True,
        )
        _install_resume_skip()
        self.size = size
        self.group = mpu.get_sequence_parallel_group()
        self.rank = dist.get_rank(self.group)
        logger.info(
            "hf_megatrain: Ulysses sequence parallelism over %d ranks (rank %d of its group, "
            "DeepSpeed's attention wrapper on %r)",
            size,
            self.rank,
            attn,
        )

    def wrap_dataloader(self, dataloader, device) -> SequenceShardedLoader:
        return SequenceShardedLoader(dataloader, self, device)


class _WithPositions:
    """A dataloader whose batches carry global ``position_ids`` (DeepSpeed's adapter needs them
    before it shards; whole rows, so the positions of rank r's shard continue rank r-1's)."""

    def __init__(self, dataloader) -> None:
        self.dataloader = dataloader

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self):
        for batch in self.dataloader:
            if "position_ids" not in batch:
                ids = batch["input_ids"]
                batch["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand(
                    ids.shape[0], -1
                )
            yield batch


class SequenceShardedLoader:
    """The Trainer's train dataloader, sharded along the sequence by DeepSpeed's
    ``UlyssesSPDataLoaderAdapter``: N times as many (1/N-long) batches, each rank of a group
    getting its shard of the same rows. Each yielded batch also has ``labels`` = its shard of
    ``shift_labels`` (already shifted: the loss uses ``shift_labels``; the Trainer counts the
    tokens of ``num_items_in_batch`` from them)."""

    def __init__(self, dataloader, sp: SequenceParallel, device, skip: int = 0) -> None:
        self.dataloader = dataloader
        self.sp = sp
        self.device = torch.device(device)
        self.skip = skip  # shards dropped at the start (a resume within a group's batches)

    def __len__(self) -> int:
        return len(self.dataloader) * self.sp.size - self.skip

    def skip_first_batches(self, num_batches: int) -> SequenceShardedLoader:
        """This loader without its first ``num_batches`` (sharded) batches, for a resume: whole
        rounds of the group's batches skipped in the wrapped loader (accelerate's
        ``skip_first_batches``, nothing loaded), the rest dropped after sharding."""
        from accelerate import skip_first_batches  # noqa: PLC0415

        rounds, rest = divmod(num_batches, self.sp.size)
        inner = skip_first_batches(self.dataloader, rounds) if rounds else self.dataloader
        return SequenceShardedLoader(inner, self.sp, self.device, skip=rest)

    def __getattr__(self, name):  # batch_size, dataset, sampler, ... of the wrapped loader
        if name == "dataloader":
            raise AttributeError(name)
        return getattr(self.dataloader, name)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.dataloader, "set_epoch"):
            self.dataloader.set_epoch(epoch)

    def __iter__(self):
        adapter = self.sp._adapter(
            _WithPositions(self.dataloader),
            sp_rank=self.sp.rank,
            sp_group=self.sp.group,
            sp_world_size=self.sp.size,
            device=self.device,
        )
        for i, batch in enumerate(adapter):
            if i < self.skip:
                continue
            batch["labels"] = batch["shift_labels"]
            yield batch


def _skip_first_batches(dataloader, num_batches: int = 0):
    """``transformers.trainer.skip_first_batches`` (accelerate's), for a sharded loader too."""
    if isinstance(dataloader, SequenceShardedLoader):
        return dataloader.skip_first_batches(num_batches)
    return _skip_first_batches.original(dataloader, num_batches)


def _install_resume_skip() -> None:
    """Make the Trainer's resume skip shards, not whole rows.

    On a resume within an epoch the Trainer calls accelerate's ``skip_first_batches`` on the
    train dataloader, which rebuilds a plain DataLoader from its dataset and sampler: our
    sharding would be lost (every rank training on whole rows through the Ulysses wrapper) and
    N times too many rows skipped. The Trainer looks the function up in its module; ours
    dispatches on the loader's type and leaves every other loader to accelerate's."""
    import transformers.trainer as hf_trainer  # noqa: PLC0415

    current = getattr(hf_trainer, "skip_first_batches", None)
    if current is None:
        logger.warning(
            "hf_megatrain: transformers.trainer has no skip_first_batches: resuming a "
            "sequence-parallel run within an epoch is not adapted to the sharded batches"
        )
        return
    if current is not _skip_first_batches:
        _skip_first_batches.original = current
        hf_trainer.skip_first_batches = _skip_first_batches


def setup_sequence_parallel(model: nn.Module, args, size: int) -> SequenceParallel | None:
    """The run's sequence parallelism (``None`` for ``size`` 1), after checking the launch and
    the model; adjusts the arguments it depends on (token-weighted loss, whole batches)."""
    if size <= 1:
        return None
    world = args.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_sequence_parallel(unwrap_peft(model).config, size, world, local)
    if not args.average_tokens_across_devices:
        logger.info(
            "hf_megatrain: average_tokens_across_devices turned on: with sequence parallelism "
            "the loss is the token mean over every rank's shard"
        )
        args.average_tokens_across_devices = True
    if not args.dataloader_drop_last:
        # Every rank of a group must see batches of the same size (the attention wrapper is
        # built for per_device_train_batch_size rows).
        args.dataloader_drop_last = True
    return SequenceParallel(model, size, args.per_device_train_batch_size)


__all__ = [
    "SUPPORTED_ATTENTION",
    "SequenceParallel",
    "SequenceParallelError",
    "SequenceShardedLoader",
    "check_sequence_parallel",
    "setup_sequence_parallel",
]
