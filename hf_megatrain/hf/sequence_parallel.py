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

Rows whose length is not a multiple of N are padded at the end (``pad_to_shards``: exact, the
pads are causal-attended by nothing real and carry no label).

Not here: evaluation runs without sequence parallelism (each rank evaluates its own rows on whole
sequences, ``disable_in_eval``). Attention masks are dropped (causal attention from positions):
right padding is harmless, left padding is refused, and so are documents packed by
``position_ids`` alone unless flash attention reads them (``batch_problem``, every rank of a
group at once). Refused before training: sliding-window attention through SDPA (its mask would
be dropped), ALiBi, layers that mix tokens outside attention (linear attention, convolutions),
the MoE router aux loss (per shard it is another loss) and label smoothing (the Trainer's smoother
shifts the already shifted labels); at the first layer, attention called without position_ids or
with heads of another shape than the config's (DeepSeek's latent attention).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist
from torch import nn

from .layer_configs import per_layer_attributes
from .loss import router_aux_loss_on, unwrap_peft
from .model import attends_in_chunks

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


def check_sequence_parallel(
    config, size: int, world_size: int, local_world_size: int, model: nn.Module | None = None
) -> None:
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
    if varying := sorted(per_layer_attributes(cfg) & {"head_dim", "num_key_value_heads"}):
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model sets {varying} per "
            "layer (Gemma 4's full-attention layers), and DeepSpeed's Ulysses attention reads "
            "one value for every layer; train it without sequence parallelism."
        )
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
    if getattr(cfg, "alibi", False):
        # Falcon's ALiBi variant: the position bias rides in the attention mask.
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model adds its ALiBi position "
            "bias through the attention mask, which Ulysses drops. Train it without sequence "
            "parallelism."
        )
    if model is not None and router_aux_loss_on(model):
        # Its balance statistics are products of means over the batch's tokens: per shard they
        # are another loss (each rank's added, observed 8% over one process's on a tiny Mixtral).
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model's router load-"
            "balancing (aux) loss is on (output_router_logits=True), and each rank would compute "
            "it over its shard of the sequence only: another loss than one process's. Train "
            "with output_router_logits=False (no aux loss), or without sequence parallelism."
        )
    if attends_in_chunks(cfg):
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model attends in chunks "
            "(Llama 4's chunked attention layers), which attention applies through the mask, and "
            "Ulysses drops the mask (every token would attend to the whole prefix). Train it "
            "without sequence parallelism."
        )
    mixing = sorted({str(t) for t in types or ()} - {"full_attention", "sliding_attention"})
    if mixing:
        # Linear attention, convolutions, state-space layers: they mix tokens along the
        # sequence outside the attention function, on this rank's shard alone.
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size}: the model has layers of type "
            f"{', '.join(mixing)}, which mix tokens along the sequence outside the attention "
            "function that Ulysses wraps (each rank would see only its shard). Train it without "
            "sequence parallelism."
        )
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
        shapes = _shapes_for_deepspeed(hf_model.config)
        ulysses.register_with_transformers(
            model_name_or_path=shapes,
            core_attn_implementation=attn,
            sequence_parallel_size=size,
            micro_batch_size=micro_batch_size,
            seq_length_is_variable=True,
            # Evaluation batches are not sharded: each rank evaluates its own whole rows.
            disable_in_eval=True,
        )
        ALL_ATTENTION_FUNCTIONS[attn] = _checked(ALL_ATTENTION_FUNCTIONS[attn], size, shapes.config)
        _install_resume_skip()
        self.size = size
        self.attn = attn
        pad = getattr(hf_model.config, "pad_token_id", None)
        self.pad_token_id = pad if isinstance(pad, int) and pad >= 0 else 0
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


def _shapes_for_deepspeed(config) -> SimpleNamespace:
    """What DeepSpeed's ``register_with_transformers`` reads of the model (its config), with
    the attention shape spelled out where the config leaves it to the modeling code: DeepSpeed
    reads ``head_dim`` and ``num_key_value_heads`` as they are, but Mixtral's config has
    ``head_dim=None`` (hidden_size / heads, its attention says) and multi-head families may have
    no ``num_key_value_heads``. A copy: the model's own config is left as it is."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    if getattr(text, "head_dim", None) is None:
        text.head_dim = text.hidden_size // heads
    if getattr(text, "num_key_value_heads", None) is None:
        text.num_key_value_heads = heads
    return SimpleNamespace(config=config)


def _checked(wrapper, size: int, config):
    """DeepSpeed's attention wrapper, refusing in words what it would assert on: a family whose
    layers pass their attention no ``position_ids`` (the wrapper gathers them over the group),
    or heads of another shape than the config's (its all-to-all is laid out for those; e.g.
    DeepSeek's multi-head latent attention, whose query and value heads differ in size)."""
    text = config.get_text_config()
    heads, kv, width = text.num_attention_heads, text.num_key_value_heads, text.head_dim

    @functools.wraps(wrapper)
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        if module.training:
            name = type(module).__name__
            if kwargs.get("position_ids") is None:
                raise SequenceParallelError(
                    f"hf_megatrain: megatrain_sequence_parallel={size}: {name} calls its "
                    "attention function without position_ids, which Ulysses needs there (it "
                    "gathers them over the ranks of a sequence). Train this family without "
                    "sequence parallelism."
                )
            got = [tuple(t.shape[1:2]) + tuple(t.shape[3:]) for t in (query, key, value)]
            if got != [(heads, width), (kv, width), (kv, width)]:
                raise SequenceParallelError(
                    f"hf_megatrain: megatrain_sequence_parallel={size}: {name} attends with "
                    f"(heads, head size) of query, key and value {got}, but Ulysses lays its "
                    f"all-to-all out for the config's {heads} query and {kv} key/value heads "
                    f"of {width} (one head size for all three). Train this family without "
                    "sequence parallelism."
                )
        return wrapper(module, query, key, value, attention_mask, *args, **kwargs)

    return attention


class _WithPositions:
    """A dataloader whose batches are ready for DeepSpeed's adapter (which needs them whole,
    before it shards): global ``position_ids`` added when the collator gave none (so the
    positions of rank r's shard continue rank r-1's), and rows padded at the end to a multiple
    of the group's size (``pad_to_shards``). Batches Ulysses would train on wrongly are refused,
    by every rank of the group at once (``check_shardable``)."""

    def __init__(self, dataloader, sp: SequenceParallel, device) -> None:
        self.dataloader = dataloader
        self.sp = sp
        # Where the batch checks' flags are gathered (gloo: host tensors; NCCL: the GPU's).
        self.device = torch.device("cpu") if dist.get_backend(sp.group) == "gloo" else device

    def __len__(self) -> int:
        return len(self.dataloader)

    def __iter__(self):
        for batch in self.dataloader:
            problem = batch_problem(batch, self.sp.attn)
            _refuse_together(problem, self.sp, self.device)
            ids = batch["input_ids"]
            if "position_ids" not in batch:
                batch["position_ids"] = torch.arange(ids.shape[-1], device=ids.device).expand(
                    ids.shape[0], -1
                )
            yield pad_to_shards(batch, self.sp.size, self.sp.pad_token_id)


def batch_problem(batch, attn: str) -> str | None:
    """Why Ulysses cannot train on ``batch`` as one process would (None: it can).

    The attention wrapper drops the attention mask (each rank's is for its shard only) and
    attends causally over the gathered sequence: right padding is harmless (no token attends to
    a later one; pads carry no label), but a mask that hides earlier tokens (left padding, holes)
    would be ignored. Documents packed into a row without a mask are told apart from their
    ``position_ids`` by transformers' mask, which SDPA needs and Ulysses drops (flash attention
    reads them from the positions, after the all-to-all)."""
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if not torch.is_tensor(ids) or ids.dim() != 2:
        return (
            "sequence parallelism shards batches of token ids along the sequence: each batch "
            "needs 'input_ids' of shape (rows, tokens)"
            + ("" if not torch.is_tensor(ids) else f", not {tuple(ids.shape)}")
        )
    for key, value in batch.items():
        if torch.is_tensor(value) and (value.dim() < 2 or value.shape[:2] != ids.shape):
            return (
                f"sequence parallelism shards every tensor of a batch along the sequence, but "
                f"{key!r} has shape {tuple(value.shape)} and 'input_ids' {tuple(ids.shape)}"
            )
    mask = batch.get("attention_mask")
    if mask is not None:
        # Right padding: the mask never goes from 0 back to 1 along a row.
        held = mask.bool()
        if (held[:, 1:] & ~held[:, :-1]).any():
            return (
                "a batch's attention_mask hides tokens before attended ones (left padding or "
                "holes); Ulysses drops the mask and attends causally over the whole row. Pad on "
                "the right (tokenizer.padding_side='right'), or train without sequence "
                "parallelism"
            )
        return None
    positions = batch.get("position_ids")
    if positions is not None and not attn.startswith("flash"):
        if (positions[:, 1:] - positions[:, :-1] != 1).any():
            return (
                "a batch packs several documents into a row (its position_ids restart) without "
                f"an attention mask: attn_implementation={attn!r} keeps the documents apart "
                "through the mask built from the positions, which Ulysses drops (each token "
                "would attend to the documents before its own). Use attn_implementation="
                "'flash_attention_2' (it reads the positions), or rows of one document"
            )
    return None


def _refuse_together(problem: str | None, sp: SequenceParallel, device) -> None:
    """Raise ``problem`` on every rank of the group when any has one: a rank that went on alone
    would wait for the others in the adapter's all-gather."""
    flag = torch.tensor([problem is not None], dtype=torch.int32, device=device)
    flags = [torch.zeros_like(flag) for _ in range(sp.size)]
    dist.all_gather(flags, flag, group=sp.group)
    bad = [r for r, f in enumerate(flags) if int(f)]
    if not bad:
        return
    if problem is None:
        raise SequenceParallelError(
            f"hf_megatrain: the batch of rank {bad[0]} of this sequence-parallel group cannot be "
            "trained with sequence parallelism (its error says why)"
        )
    raise SequenceParallelError(f"hf_megatrain: megatrain_sequence_parallel={sp.size}: {problem}")


def pad_to_shards(batch, size: int, pad_token_id: int = 0):
    """``batch`` with its rows padded at the end to a multiple of ``size`` tokens: ids
    ``pad_token_id``, labels -100, attention mask 0, positions going on. Exact: causal attention
    keeps the pads out of every real token's output, and they carry no label (the last real
    token's target is the -100 the shift would have given it)."""
    length = batch["input_ids"].shape[1]
    extra = -length % size
    if not extra:
        return batch
    fill = {"input_ids": pad_token_id, "labels": -100, "shift_labels": -100}
    out = dict(batch)
    for key, value in batch.items():
        if not torch.is_tensor(value):
            continue
        if key == "position_ids":
            step = torch.arange(1, extra + 1, device=value.device, dtype=value.dtype)
            tail = value[:, -1:] + step
        else:
            shape = (value.shape[0], extra, *value.shape[2:])
            tail = torch.full(shape, fill.get(key, 0), dtype=value.dtype, device=value.device)
        out[key] = torch.cat([value, tail], dim=1)
    return out


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
            _WithPositions(self.dataloader, self.sp, self.device),
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


def check_sequence_parallel_arguments(args, size: int) -> None:
    """Refuse training arguments whose loss Ulysses' batches would change."""
    if size > 1 and getattr(args, "label_smoothing_factor", 0):
        # The Trainer's label smoother shifts the labels it is given, which are already
        # shifted here (and averages per rank, not over the group's tokens).
        raise SequenceParallelError(
            f"hf_megatrain: megatrain_sequence_parallel={size} does not train with "
            f"label_smoothing_factor={args.label_smoothing_factor}: each rank's labels are "
            "already shifted (the token at a shard's end predicts the next shard's first), and "
            "the Trainer's label smoother would shift them again. Train without label smoothing "
            "or without sequence parallelism."
        )


def setup_sequence_parallel(model: nn.Module, args, size: int) -> SequenceParallel | None:
    """The run's sequence parallelism (``None`` for ``size`` 1), after checking the launch and
    the model; adjusts the arguments it depends on (token-weighted loss, whole batches)."""
    if size <= 1:
        return None
    world = args.world_size
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    check_sequence_parallel(unwrap_peft(model).config, size, world, local, model=model)
    check_sequence_parallel_arguments(args, size)
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
    "check_sequence_parallel_arguments",
    "setup_sequence_parallel",
]
