"""HF-format checkpoints straight from and into the host store.

Saving builds a state dict of views into the host store (no copy of the streamed weights) and
hands it to the model's own ``save_pretrained``, which splits it into safetensors shards, reverts
transformers' weight conversions (e.g. fused MoE experts back to per-expert tensors) and writes
shard by shard. Masters are fp32, so a saved run resumes bit-exactly.

Loading reads safetensors tensor by tensor into the store, so peak host RAM stays close to the
store's own size. Keys are matched to the model's parameter names directly, or through the one
conversion transformers applies to the supported MoE models (per-expert ``gate/up/down`` or
``w1/w3/w2`` tensors into fused ``gate_up_proj`` / ``down_proj`` expert tensors).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager

import torch
from huggingface_hub import split_torch_state_dict_into_shards
from safetensors import safe_open
from safetensors.torch import save_file

from ..core.options import EXPORT_DTYPES, EngineOptions, size_bytes
from ..core.publish import MANIFEST_NAME, staged_folder
from .conversions import conversions, reverts_as_views
from .model import StreamedModelState, streamed_state

logger = logging.getLogger(__name__)

OPTIMIZER_STATE_DIR = "megatrain_optimizer"


def _require_state(model) -> StreamedModelState:
    state = streamed_state(model)
    if state is None:
        raise ValueError("hf_megatrain: this model is not streamed (prepare it first).")
    # A background optimizer update (this rank's, or under data parallel another rank's, of
    # the shared weights) may still be writing the store.
    state.engine.wait_all_weights()
    return state


# ---- saving ---------------------------------------------------------------------------------
def host_state_dict(
    model, dtype: torch.dtype | None = None, keep_on_device: bool = False
) -> dict[str, torch.Tensor]:
    """The model's full state dict, streamed weights as views of the fp32 masters.

    ``dtype``: floating-point tensors cast to it, on the CPU (a copy, except where they already
    have it); modules the model keeps in fp32 whatever its dtype
    (``_keep_in_fp32_modules_strict``) stay fp32. Default: as stored.

    ``keep_on_device``: tensors on the GPU (the resident embeddings, norm and head, the HBM
    tier's masters) stay there, as views, instead of being copied to the CPU whole; a writer
    that copies them shard by shard (safetensors, ``save_pretrained``) then holds one shard of
    them in host RAM, not all (at 7B the resident weights alone are 4.4 GB). Ignored where a
    ``dtype`` cast applies to them.
    """
    state = _require_state(model)
    out: dict[str, torch.Tensor] = {}
    layer_keys = {}
    for i, store in enumerate(state.store.layers):
        # Host-store layers are views (no copy); HBM-tier layers' masters are copied to the
        # CPU unless kept on the device. Each view has a storage of its own.
        master = store.master if keep_on_device else store.master.cpu()
        for rel, view in store.param_views(master).items():
            layer_keys[state.full_name(i, rel)] = _own_storage(view)
    for key, value in model.state_dict(keep_vars=False).items():
        if key in layer_keys:
            out[key] = layer_keys[key]
        elif value.device.type == "meta":
            raise RuntimeError(f"hf_megatrain: {key} has no data (meta) and is not streamed")
        else:
            out[key] = value.detach() if keep_on_device else value.detach().to("cpu")
    if dtype is not None:
        keep = _fp32_module_re(model) if dtype in (torch.float16, torch.bfloat16) else None
        # One cast per aliased tensor: tied weights (lm_head.weight and embed_tokens.weight)
        # must stay one storage, as save_pretrained drops tied keys by shared storage.
        cast: dict[tuple, torch.Tensor] = {}
        for key, value in out.items():
            if not value.is_floating_point() or (keep is not None and keep.search(key)):
                continue
            if value.dtype == dtype:
                continue
            if value.numel() == 0:  # (no storage to share: data_ptr 0 for all)
                out[key] = value.to("cpu", dtype)
                continue
            storage = value.untyped_storage().data_ptr()
            alias = (
                storage,
                value.storage_offset(),
                tuple(value.shape),
                value.stride(),
                value.dtype,
            )
            if alias not in cast:
                # Cast into host memory: a cast on the GPU would need the rounded copy of the
                # whole HBM tier and resident weights there at once.
                cast[alias] = value.to("cpu", dtype)
            out[key] = cast[alias]
    return out


def _own_storage(view: torch.Tensor) -> torch.Tensor:
    """``view`` (of a layer's one flat buffer) as a tensor over the same memory with a storage
    of its own. ``save_pretrained`` clones tensors that share a storage without being tied
    (safetensors refuses aliasing): views of one buffer made it copy every streamed weight,
    one more whole model in host RAM during each save."""
    return torch.from_dlpack(view) if view.is_contiguous() else view


def _fp32_module_re(model) -> re.Pattern | None:
    """Keys of the modules ``from_pretrained`` keeps in fp32 even in a bf16 model."""
    names = getattr(model, "_keep_in_fp32_modules_strict", None)
    if not isinstance(names, (set, frozenset, list, tuple)) or not names:
        return None
    return re.compile(r"(^|\.)(" + "|".join(re.escape(n) for n in sorted(names)) + r")(\.|$)")


def write_streamed_pretrained(
    model,
    folder: str,
    max_shard_size: str | int | None = None,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write ``model``'s files into ``folder`` as they are (no staging, no manifest): the writer
    behind :func:`save_streamed_pretrained` and the Trainer's checkpoints.

    ``dtype``: of the floating-point tensors written (default fp32: the masters as they are;
    checkpoints meant for resuming must keep it); ``config.json`` records it.
    """
    if max_shard_size is None:
        state = streamed_state(model)
        options = state.options.options if state is not None and state.options else EngineOptions()
        max_shard_size = options.max_shard_size
    # The GPU's tensors stay there, copied to the host a shard at a time by the writer; fused
    # weights (MoE experts) are reverted to the checkpoint's layout as views of them
    # (``reverts_as_views``), not as copies.
    tensors = host_state_dict(model, dtype, keep_on_device=True)
    # The config as the model came (streaming turned use_cache off for training), and the dtype
    # of the files written (save_pretrained records the in-memory fp32 masters'), as
    # from_pretrained(dtype="auto") reads it.
    state = streamed_state(model)
    config = model.config
    saved = dict(use_cache=config.use_cache, dtype=config.dtype)
    if state is not None and state.use_cache is not None:
        config.use_cache = state.use_cache
    try:
        # In bytes: transformers reads only 'KB' to 'TB' names (not '1GiB' or '500000').
        shard = size_bytes(max_shard_size)
        with reverts_as_views():
            model.save_pretrained(folder, state_dict=tensors, max_shard_size=shard)
        written = str(dtype).removeprefix("torch.")
        if str(config.dtype).removeprefix("torch.") != written:
            config.dtype = written
            config.save_pretrained(folder)
    finally:
        config.use_cache, config.dtype = saved["use_cache"], saved["dtype"]


#: Files of an earlier save in a model folder that a new save replaces even where it does not
#: write the same names (weights of another sharding); every other entry is kept.
_WEIGHT_FILE_RE = re.compile(
    r"^(model|pytorch_model|adapter_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?$"
)


def keep_beside_model(name: str) -> bool:
    """Whether an entry of an existing model folder survives a new save into it: everything but
    weight files and the manifest (a user's files, checkpoints in a Trainer's output_dir)."""
    return name != MANIFEST_NAME and not _WEIGHT_FILE_RE.match(name)


@contextmanager
def staged_model_folder(output_dir: str, saved_from: dict | None = None):
    """A hidden folder beside ``output_dir`` to write a model save into; published whole (with
    its manifest, which records ``saved_from``) over ``output_dir`` when the block ends, entries
    of ``keep_beside_model`` kept. See ``core/publish.py``."""
    with staged_folder(output_dir, keep=keep_beside_model, saved_from=saved_from) as folder:
        yield folder


def save_streamed_pretrained(
    model,
    output_dir: str,
    max_shard_size: str | int | None = None,
    dtype: torch.dtype | str = torch.float32,
) -> None:
    """Write ``model`` as sharded HF safetensors (loadable by ``from_pretrained``).

    The files are written into a hidden folder beside ``output_dir``, fsynced, listed with their
    sha256 in ``megatrain_manifest.json`` and the folder swapped in whole: a reader sees the old
    save or the new one, never a mix. Other entries already in ``output_dir`` are kept (weight
    files of an older save are not). ``max_shard_size``: default the streamed model's
    ``max_shard_size`` option. ``dtype``: of the floating-point tensors written, a
    ``torch.dtype`` or an ``export_dtype`` name (default fp32, the masters as they are).
    """
    if isinstance(dtype, str):
        if dtype not in EXPORT_DTYPES:
            raise ValueError(f"hf_megatrain: dtype={dtype!r}: one of {', '.join(EXPORT_DTYPES)}")
        dtype = EXPORT_DTYPES[dtype]
    with staged_model_folder(output_dir) as folder:
        write_streamed_pretrained(model, folder, max_shard_size, dtype)


# ---- loading --------------------------------------------------------------------------------
def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        return [os.path.join(path, f) for f in sorted(set(weight_map.values()))]
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        return [single]
    names = os.listdir(path) if os.path.isdir(path) else []
    pickled = sorted(f for f in names if re.fullmatch(r"pytorch_model.*\.bin", f))
    if pickled:
        # Never unpickled here: a pickle can run code, and torch.load reads it whole.
        raise FileNotFoundError(
            f"hf_megatrain: {path} holds PyTorch pickle weights ({', '.join(pickled[:3])}), not "
            "safetensors, which are all hf_megatrain reads: convert them once, e.g. "
            "AutoModelForCausalLM.from_pretrained(path).save_pretrained(new_folder)"
        )
    raise FileNotFoundError(
        f"hf_megatrain: no model.safetensors or model.safetensors.index.json in {path} "
        f"(only safetensors checkpoints are supported)"
    )


def check_checkpoint_files(path: str) -> None:
    """Every weight file of the checkpoint folder ``path`` (``_checkpoint_files``) is there and
    its safetensors header reads: a missing or truncated shard is named before anything is
    allocated (reading its tensors would fail only then). Raises ``ValueError``."""
    try:
        files = _checkpoint_files(path)
    except FileNotFoundError as e:  # neither an index nor model.safetensors
        raise ValueError(str(e)) from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(
            f"hf_megatrain: {path}/model.safetensors.index.json is not a valid safetensors "
            f"index ({e})"
        ) from None
    missing = sorted(os.path.basename(f) for f in files if not os.path.isfile(f))
    if missing:
        raise ValueError(
            f"hf_megatrain: {path}: shard(s) listed in model.safetensors.index.json are "
            f"missing: {missing}"
        )
    for f in files:
        try:
            with safe_open(f, framework="pt"):
                pass
        except Exception as e:  # noqa: BLE001 - safetensors' own error class
            raise ValueError(
                f"hf_megatrain: {f} is not a readable safetensors file ({e})"
            ) from None


def iter_checkpoint_tensors(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, tensor)`` one at a time from a safetensors checkpoint folder."""
    for file in _checkpoint_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for key in f.keys():
                yield key, f.get_tensor(key)


_EXPERT_RE = re.compile(
    r"^(?P<base>.*\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$"
)
# (fused target, row-block index within the fused tensor, number of row blocks)
_EXPERT_TARGET = {
    "gate_proj": ("gate_up_proj", 0, 2),
    "w1": ("gate_up_proj", 0, 2),
    "up_proj": ("gate_up_proj", 1, 2),
    "w3": ("gate_up_proj", 1, 2),
    "down_proj": ("down_proj", 0, 1),
    "w2": ("down_proj", 0, 1),
}


def drop_other_towers(unknown: list[str], model, prefix: str, path: str) -> list[str]:
    """``unknown`` (a multimodal checkpoint's keys that match no tensor of the model: Llama 4's)
    less those of towers the causal LM does not have (``vision_model.*``,
    ``multi_modal_projector.*``): their first name is neither a module of the model nor its base
    prefix (``language_model``, whose tensors are the model's). ``from_pretrained`` skips them
    too; the training loads skip them, logging how many."""
    children = {name for name, _ in model.named_children()} | {prefix}
    skipped = [k for k in unknown if k.split(".", 1)[0] not in children]
    if skipped:
        towers = sorted({k.split(".", 1)[0] for k in skipped})
        logger.info(
            "hf_megatrain: %d tensors of %s belong to the checkpoint's other towers (%s), which "
            "the causal LM does not have: skipped, as from_pretrained does",
            len(skipped), path, ", ".join(towers),
        )  # fmt: skip
    return [k for k in unknown if k.split(".", 1)[0] in children]


def drop_ignored_keys(unknown: list[str], model) -> list[str]:
    """``unknown`` (checkpoint keys that match no tensor of ``model``) less those its class
    skips on load (``_keys_to_ignore_on_load_unexpected``, regular expressions, as
    ``from_pretrained`` applies them): the key/value projections a checkpoint holds for
    KV-sharing layers that have none (Gemma 3n, Gemma 4 E2B/E4B)."""
    ignored = getattr(model, "_keys_to_ignore_on_load_unexpected", None)
    if not unknown or not ignored:
        return unknown
    pattern = re.compile("|".join(f"({p})" for p in ignored))
    return [key for key in unknown if pattern.search(key) is None]


def is_multimodal_checkpoint(path: str) -> bool:
    """Whether the checkpoint folder's config.json is a composite one (a ``text_config``)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return isinstance(json.load(f).get("text_config"), dict)
    except (OSError, ValueError, AttributeError):
        return False


def resolve_checkpoint_key(key: str, names, prefix: str = "model"):
    """Map a checkpoint key to ``(target name in names, index expression)`` or None.

    As ``from_pretrained``: the key as is, with or without the model's ``base_model_prefix``
    (``model``, ``transformer``, ``gpt_neox``: a checkpoint saved from the base model has none),
    and per-expert tensors into their fused expert tensor (an index into it)."""
    pre = f"{prefix}."
    for cand in dict.fromkeys((key, pre + key, key.removeprefix(pre))):
        if cand in names:
            return cand, None
        m = _EXPERT_RE.match(cand)
        if m:
            fused, block, blocks = _EXPERT_TARGET[m["proj"]]
            name = f"{m['base']}.{fused}"
            if name in names:
                rows = names[name].shape[1] // blocks
                return name, (int(m["e"]), slice(block * rows, (block + 1) * rows))
    return None


def _resolve_target(key: str, targets: dict[str, torch.Tensor], prefix: str = "model"):
    """Map a checkpoint key to ``(destination tensor, index expression)`` or None."""
    hit = resolve_checkpoint_key(key, targets, prefix)
    return None if hit is None else (targets[hit[0]], hit[1])


def _checkpoint_renamings(model) -> list:
    """transformers' own key renamings for ``model`` (e.g. Mixtral's ``block_sparse_moe`` ->
    ``mlp``), as used by ``from_pretrained``."""
    found, renaming = conversions(model)
    return [t for t in found if isinstance(t, renaming)]


def _rename(key: str, renamings: list) -> str:
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def load_weights_into_store(model, path: str) -> None:
    """Read a safetensors checkpoint tensor by tensor into the host store and resident params."""
    state = _require_state(model)
    renamings = _checkpoint_renamings(model)
    prefix = getattr(model, "base_model_prefix", "model") or "model"
    targets: dict[str, torch.Tensor] = {}
    # Data parallel: a layer's shared weights are written by its owner only (every rank still
    # reads and checks the whole checkpoint, so a mismatch fails on every rank alike).
    not_mine: set[int] = set()
    for i, store in enumerate(state.store.layers):
        for rel, view in store.param_views(store.master).items():
            targets[state.full_name(i, rel)] = view
            if not store.owned:
                not_mine.add(id(view))
    resident_ids = {id(p) for _, p, _ in state.resident}
    # Every name of a resident parameter, tied aliases included (lm_head.weight -> embed_tokens).
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in resident_ids:
            targets[name] = p
    # Persistent buffers that checkpoints carry (DeepSeek-V3's router score-correction bias):
    # read when present, not required (older checkpoints may predate a buffer).
    optional: set[int] = set()
    for mod_name, module in model.named_modules():
        for buf_name, buf in module.named_buffers(recurse=False):
            if buf is None or buf_name in module._non_persistent_buffers_set:
                continue
            if buf.device.type != "meta":
                targets.setdefault(f"{mod_name}.{buf_name}" if mod_name else buf_name, buf)
                optional.add(id(buf))
    filled: set[int] = set()
    unknown: list[str] = []
    with torch.no_grad():
        for key, tensor in iter_checkpoint_tensors(path):
            # Checkpoint names may predate the module names (renamed by transformers on load and
            # reverted on save); the expert merge itself is handled in _resolve_target.
            hit = _resolve_target(_rename(key, renamings), targets, prefix) or _resolve_target(
                key, targets, prefix
            )
            if hit is None:
                unknown.append(key)
                continue
            dest, index = hit
            dst = dest if index is None else dest[index]
            if tuple(dst.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"hf_megatrain: checkpoint tensor {key} has shape {tuple(tensor.shape)}, "
                    f"the model expects {tuple(dst.shape)}"
                )
            if id(dest) not in not_mine:
                dst.copy_(tensor.to(torch.float32))
            filled.add(id(dest))
    missing = [n for n, t in targets.items() if id(t) not in filled and id(t) not in optional]
    if unknown and os.path.isdir(path) and is_multimodal_checkpoint(path):
        unknown = drop_other_towers(unknown, model, prefix, path)
    unknown = drop_ignored_keys(unknown, model)
    if unknown:
        raise ValueError(
            f"hf_megatrain: {len(unknown)} checkpoint tensors do not match the model, e.g. "
            f"{unknown[:5]}"
        )
    if missing:
        raise ValueError(
            f"hf_megatrain: the checkpoint at {path} lacks {len(missing)} tensors, e.g. {missing[:5]}"
        )
    for store in state.store.layers:
        if store.owned:
            store.refresh_stream_copy()
    state.engine.invalidate_weights()
    if state.engine.dp is not None:
        state.engine.dp.barrier()  # every owner has written its layers


# ---- optimizer state ------------------------------------------------------------------------
def save_optimizer_state(
    optimizer, output_dir: str, max_shard_size: str | int | None = None
) -> None:
    """AdamW moments of every streamed layer (one safetensors file per layer) and residents
    (``resident.safetensors``, or shards of it no larger than ``max_shard_size``, default the
    option's: the writer copies a file's GPU tensors to the host together; meta.json lists the
    files).

    Under data parallel every rank calls it: each writes the layers it owns, rank 0 the
    replicated (resident) state and the metadata. The files are those of a single-process run.
    Across nodes they are written once: node 0's owners write every layer, the other nodes'
    (whose copies are the same) nothing.
    """
    optimizer.wait()
    state = optimizer.engine
    if state.dp is not None and state.dp.node != 0:
        return
    folder = os.path.join(output_dir, OPTIMIZER_STATE_DIR)
    os.makedirs(folder, exist_ok=True)
    steps, resident = optimizer.streamed_state()
    slot_steps = optimizer.slot_steps()
    for i, store in enumerate(state.stores):
        if store.exp_avg is None:
            continue  # frozen layer, or (data parallel) a layer another rank owns
        tensors = {"exp_avg": store.exp_avg.cpu(), "exp_avg_sq": store.exp_avg_sq.cpu()}
        if i in steps:
            # The step count travels with the moments: under data parallel only the owner
            # knows it (meta.json comes from rank 0).
            tensors["step"] = torch.tensor([steps[i]], dtype=torch.float32)
        if i in slot_steps:  # (slots that went without a gradient in some step)
            tensors["slot_steps"] = torch.tensor(slot_steps[i], dtype=torch.float32)
        save_file(tensors, os.path.join(folder, f"layer_{i:05d}.safetensors"))
    if state.dp is not None and state.dp.rank != 0:
        return
    # Each shard's tensors stay where they are (the GPU, mostly) until safetensors copies that
    # shard's to the host: at 7B the resident moments are 8.7 GB, which a plan that fills the
    # host has no room for.
    split = split_torch_state_dict_into_shards(
        resident,
        filename_pattern=RESIDENT_STATE_PATTERN,
        max_shard_size=size_bytes(max_shard_size or EngineOptions().max_shard_size),
    )
    for name, keys in split.filename_to_tensors.items():
        save_file({k: resident[k].detach().contiguous() for k in keys}, os.path.join(folder, name))
    meta = {
        "resident_files": sorted(split.filename_to_tensors),
        "steps": {str(k): v for k, v in steps.items()},
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups
        ],
        "num_layers": len(state.stores),
    }
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)


def stock_optimizer_note(checkpoint: str) -> str:
    """Where ``checkpoint`` holds the stock Trainer's ``optimizer.pt`` instead of hf_megatrain's
    optimizer state: a clause saying so, for a message ("" otherwise)."""
    path = os.path.join(checkpoint, "optimizer.pt")
    if not os.path.isfile(path):
        return ""
    return (
        f" ({path} is the stock Trainer's optimizer state, which hf_megatrain cannot read: it "
        f"keeps AdamW moments per streamed layer in {OPTIMIZER_STATE_DIR}/)"
    )


def _resident_layer_moments(
    store, resident: Mapping[str, torch.Tensor], full_name: Callable[[str], str]
) -> list[float] | None:
    """A layer's moments kept as resident parameters' (an older checkpoint of a layer mixing
    frozen and trainable parameters) copied into its store, zeros elsewhere: each slot's step
    count (0 for slots without moments), or None where the resident state holds none of it."""
    found = [f"{full_name(slot.name)}.exp_avg" in resident for slot in store.slots]
    if not any(found):
        return None
    for slot, has in zip(store.slots, found):
        if not has:
            continue
        keys = [f"{full_name(slot.name)}.{k}" for k in ("exp_avg", "exp_avg_sq", "step")]
        if not all(k in resident for k in keys):
            raise ValueError(
                f"hf_megatrain: resident.safetensors holds {keys[0]} without "
                f"{' and '.join(k for k in keys[1:] if k not in resident)}: an incomplete "
                "optimizer state (resume from another checkpoint, or with "
                "megatrain_resume_without_optimizer_state=True)"
            )
        if resident[keys[0]].numel() != slot.numel:
            raise ValueError(
                f"hf_megatrain: resident.safetensors holds {keys[0]} of "
                f"{resident[keys[0]].numel()} elements, the model's parameter has {slot.numel}"
            )
    store.exp_avg.zero_()
    store.exp_avg_sq.zero_()
    per_slot = []
    for slot, has in zip(store.slots, found):
        if not has:
            per_slot.append(0.0)
            continue
        name = full_name(slot.name)
        for key in ("exp_avg", "exp_avg_sq"):
            getattr(store, key)[slot.offset : slot.offset + slot.numel].copy_(
                resident[f"{name}.{key}"].reshape(-1)
            )
        per_slot.append(float(resident[f"{name}.step"].reshape(-1)[0]))
    return per_slot


def has_optimizer_state(checkpoint: str) -> bool:
    return os.path.isfile(os.path.join(checkpoint, OPTIMIZER_STATE_DIR, "meta.json"))


def _open_state_file(checkpoint: str, name: str):
    """``safe_open`` of an optimizer-state file of ``checkpoint``; a missing, truncated or
    unreadable one raises an error that names it (safetensors' own names no file)."""
    path = os.path.join(checkpoint, OPTIMIZER_STATE_DIR, name)
    if not os.path.isfile(path):
        raise FileNotFoundError(f"hf_megatrain: {path} is missing")
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # noqa: BLE001 - safetensors' own error class
        raise ValueError(
            f"hf_megatrain: {path} is truncated or not a readable safetensors file ({e})"
        ) from None


#: Names of the resident optimizer state's files: ``resident.safetensors``, or its shards.
RESIDENT_STATE_PATTERN = "resident{suffix}.safetensors"


def _resident_files(meta: dict) -> list[str]:
    """The resident state's files a checkpoint's meta.json lists (one file before 2026-12-07)."""
    return list(meta.get("resident_files", ["resident.safetensors"]))


class _ResidentState(Mapping):
    """The resident optimizer state of a checkpoint by name, each tensor read from its file when
    asked for: the caller moves each to its parameter's device before the next is read, so the
    host holds one tensor of it at a time, not all (8.7 GB at 7B)."""

    def __init__(self, checkpoint: str, files: list[str]) -> None:
        self._checkpoint = checkpoint
        self._file_of: dict[str, str] = {}
        for name in files:
            with _open_state_file(checkpoint, name) as f:
                self._file_of.update(dict.fromkeys(f.keys(), name))

    def __getitem__(self, key: str) -> torch.Tensor:
        with _open_state_file(self._checkpoint, self._file_of[key]) as f:
            return f.get_tensor(key)

    def __contains__(self, key: object) -> bool:
        return key in self._file_of

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


def _read_optimizer_meta(checkpoint: str) -> dict:
    path = os.path.join(checkpoint, OPTIMIZER_STATE_DIR, "meta.json")
    try:
        with open(path, encoding="utf-8") as f:
            meta = json.load(f)
        int(meta["num_layers"]), dict(meta["steps"]), list(meta["param_groups"])
    except FileNotFoundError:
        raise FileNotFoundError(f"hf_megatrain: {path} is missing") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"hf_megatrain: {path} is truncated or corrupt ({e})") from None
    return meta


def optimizer_state_problem(checkpoint: str) -> str | None:
    """Why ``checkpoint``'s optimizer state cannot be read, naming the file relative to the
    checkpoint (None: every file is there and its safetensors header reads). For checkpoints
    without a manifest, whose sizes nothing else checks; layers without a file (frozen, or
    under data parallel written by their owners) are not required."""
    folder = os.path.join(checkpoint, OPTIMIZER_STATE_DIR)
    try:
        names = _resident_files(_read_optimizer_meta(checkpoint)) + sorted(
            n for n in os.listdir(folder) if n.startswith("layer_") and n.endswith(".safetensors")
        )
        for name in names:
            with _open_state_file(checkpoint, name):
                pass
    except (OSError, ValueError) as e:
        return str(e).removeprefix("hf_megatrain: ").replace(os.path.join(checkpoint, ""), "", 1)
    return None


def load_optimizer_state(
    optimizer, checkpoint: str, layer_name: Callable[[int, str], str] | None = None
) -> None:
    """Restore :func:`save_optimizer_state`'s files into ``optimizer`` (a ``HostAdamW``).

    ``layer_name(layer, slot name)``: a layer parameter's name in the model. With it, a
    checkpoint written when a layer's trainable parameters stayed resident beside a frozen
    store (a layer that mixes both, before 2026-12-06: their moments in resident.safetensors,
    no file of the layer's) is read into the layer's store, where they now live."""
    optimizer.wait()
    meta = _read_optimizer_meta(checkpoint)
    stores = optimizer.engine.stores
    if meta["num_layers"] != len(stores):
        raise ValueError(
            f"hf_megatrain: optimizer state in {checkpoint} has {meta['num_layers']} layers, "
            f"the model has {len(stores)}"
        )
    steps = {int(k): v for k, v in meta["steps"].items()}
    slot_steps: dict[int, list[float]] = {}
    resident = _ResidentState(checkpoint, _resident_files(meta))
    for i, store in enumerate(stores):
        if store.exp_avg is None:
            continue
        name = f"layer_{i:05d}.safetensors"
        if layer_name is not None and not os.path.isfile(
            os.path.join(checkpoint, OPTIMIZER_STATE_DIR, name)
        ):
            per_slot = _resident_layer_moments(store, resident, functools.partial(layer_name, i))
            if per_slot is not None:
                steps[i], slot_steps[i] = max(per_slot), per_slot
                continue
        with _open_state_file(checkpoint, name) as f:
            store.exp_avg.copy_(f.get_tensor("exp_avg"))
            store.exp_avg_sq.copy_(f.get_tensor("exp_avg_sq"))
            if "step" in f.keys():
                steps[i] = float(f.get_tensor("step")[0])
            if "slot_steps" in f.keys():
                slot_steps[i] = f.get_tensor("slot_steps").tolist()
    optimizer.load_streamed_state(steps, resident, slot_steps)
    for group, saved in zip(optimizer.param_groups, meta["param_groups"]):
        for k, v in saved.items():
            group[k] = tuple(v) if isinstance(v, list) else v
