"""``hf-megatrain train``: one training job through :class:`HFMegaTrainer`.

With no argument it trains the embedded default (a ~3M-parameter Llama-style model on bundled
English text, with a bundled BPE tokenizer), writes intermediate checkpoints, saves a Hugging Face
model, reloads it with ``AutoModelForCausalLM.from_pretrained`` and prints its eval loss and a
greedy sample. Re-run into the same ``--output_dir`` it resumes from the last complete checkpoint.
The arguments are in :mod:`hf_megatrain.cli_arguments`.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any

from .cli_arguments import RESUME_LAST, TrainSettings, check_loaded_data
from .cli_common import CONFIG_ERRORS, CLIError, error_summary, world_size
from .cli_common import config_from_json as _config_from_json
from .cli_common import is_main_process as _is_main_process
from .cli_common import say as _say
from .cli_common import setup_logging as _setup_logging
from .cli_resume import (
    ROWS_KEY,
    check_same_config,
    check_same_rows,
    check_same_run,
    checkpoints_after,
    earlier_complete,
    is_optimizer_state,
    listed_files_problem,
    record_callback,
    resume_checkpoint,
    run_record,
    seq_len_note,
)
from .text import DEFAULT_CONFIG, has_tokenizer_files
from .text import load_tokenizer as _load_tokenizer_file

# Models above this size are not reloaded for the final check unless asked: a second full fp32
# copy in host RAM next to the host store could exhaust it.
_AUTO_VERIFY_MAX_PARAMS = 2_000_000_000
# A checkpoint holds fp32 weights, two fp32 AdamW moments and little else: 12 bytes/parameter.
_CHECKPOINT_BYTES_PER_PARAM = 12


# ---- model and tokenizer ------------------------------------------------------------------------
def _model_folder(settings: TrainSettings) -> str:
    """The local folder of --model_path: itself, or a Hub repo id's cached (or downloaded)
    snapshot; both the tokenizer and the weights come from it."""
    from .hf.hub import ModelNotFoundError, resolve_model_folder  # noqa: PLC0415
    from .hf.loading import check_model_type  # noqa: PLC0415

    try:
        folder = resolve_model_folder(settings.model.model_path)
        # Before the tokenizer or config is read: transformers would prompt to run custom code.
        check_model_type(folder)
    except (ModelNotFoundError, ValueError) as e:
        raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
    return folder


def load_tokenizer(settings: TrainSettings):
    """The run's tokenizer: --tokenizer, else the model's own, else the bundled one."""
    model = settings.model
    if model.tokenizer is not None:
        return _load_tokenizer_file(model.tokenizer)
    if model.model_path is not None:
        folder = _model_folder(settings)
        if not has_tokenizer_files(folder):
            raise CLIError(
                f"{model.model_path} has no tokenizer files: pass --tokenizer (the bundled one "
                "does not match a pretrained model's vocabulary)"
            )
        return _load_tokenizer_file(folder)
    if model.config is not None and (Path(model.config).parent / "tokenizer.json").is_file():
        return _load_tokenizer_file(Path(model.config).parent)
    return _load_tokenizer_file(None)


def loader_arguments(settings: TrainSettings) -> dict:
    """What both streamed loaders take: the run's engine options and, for the memory plan, its
    step (the micro-batch split) and clipping, as the trainer would pass them."""
    from .core.options import StepShape  # noqa: PLC0415
    from .hf.long_context import liger_layer_kernel_arguments  # noqa: PLC0415

    # Every run, as the trainer plans one (resident_layers="0" included: auto_fit, the
    # attention choice for sliding windows), for --plan-seq-len where given (never below
    # --seq_len: parsing refuses that). Per rank: under sequence parallelism each rank holds
    # seq_len / N of every row.
    args = settings.training
    seq_len = settings.engine.plan_seq_len or settings.data.seq_len
    seq_len = -(-seq_len // settings.engine.sequence_parallel)
    step = StepShape(
        seq_len, args.per_device_train_batch_size * seq_len, args.gradient_accumulation_steps
    )
    return dict(
        options=settings.engine,
        bf16=args.bf16,
        attn_implementation=settings.model.attn,
        step=step,
        clipping=args.max_grad_norm > 0,
        # The plan must know about Liger's kernels as the trainer will.
        **liger_layer_kernel_arguments(args.use_liger_kernel),
    )


def run_config(settings: TrainSettings, folder: str | None = None):
    """The model config this run builds: --model_path's (its local ``folder``, resolved here
    when not given), or --config's (random init)."""
    from transformers import AutoConfig  # noqa: PLC0415

    from .hf.families import model_family, text_model_type, unsupported_model_type  # noqa: PLC0415

    model = settings.model
    if model.model_path is None:
        return _config_from_json(model.config or str(DEFAULT_CONFIG))
    folder = folder or _model_folder(settings)
    try:
        cfg = AutoConfig.from_pretrained(folder, local_files_only=True)
    except CONFIG_ERRORS as e:
        raise CLIError(f"{folder}/config.json: invalid config: {error_summary(e)}") from None
    if model_family(cfg.model_type) is None:
        text = text_model_type(cfg)
        raise CLIError(unsupported_model_type(model.model_path, cfg.model_type, "", text))
    return cfg


def build_model(settings: TrainSettings, tokenizer):
    """The model in streamed form: loaded into the host store, or random init then streamed."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from . import load_streamed_model  # noqa: PLC0415

    model = settings.model
    folder = _model_folder(settings) if model.model_path is not None else None
    cfg = run_config(settings, folder)
    _check_vocab(cfg, tokenizer)
    if folder is not None:
        _check_against_manifest(folder)
        return load_streamed_model(folder, **loader_arguments(settings))
    seed = settings.training.seed
    if not init_in_store():
        from .hf.loading import attention_for  # noqa: PLC0415

        torch.manual_seed(seed)
        # Materialized on CPU in fp32, then HFMegaTrainer moves its decoder layers into the store.
        return AutoModelForCausalLM.from_config(
            cfg, dtype=torch.float32, attn_implementation=attention_for(cfg, model.attn)
        )
    # On a GPU: each decoder layer is initialized straight into its host-store master (on the
    # GPU, then copied), so a config whose fp32 copy would not fit next to the store still
    # starts, and fast; with resident_layers "auto" the plan sizes the HBM tier for this run.
    from .hf.loading import init_streamed_model  # noqa: PLC0415

    return init_streamed_model(cfg, seed=seed, **loader_arguments(settings))


def _check_against_manifest(folder: str) -> None:
    """The weights of a --model_path folder that hf-megatrain saved (it has a manifest) are
    checked against it before loading, as a checkpoint's are before a resume: damaged weights
    that still parse would otherwise train (or fail only at the first save, non-finite). Its
    other files (config, tokenizer) may be edited on purpose: not checked. Rank 0 checks."""
    from .core.publish import MANIFEST_NAME, IntegrityError, read_manifest, verify_folder  # noqa: PLC0415

    if not _is_main_process() or read_manifest(folder) is None:
        return
    _say(f"hf-megatrain: checking the weights in {folder} against its manifest ...")
    try:
        verify_folder(  # (a checkpoint's optimizer state is not loaded: not checked)
            folder,
            only=lambda rel: (
                rel.endswith((".safetensors", ".safetensors.index.json"))
                and not is_optimizer_state(rel)
            ),
        )
    except IntegrityError as e:
        raise CLIError(
            f"--model_path: {str(e).removeprefix('hf_megatrain: ')}: the weights changed after "
            f"hf-megatrain saved them. Restore them, or delete {MANIFEST_NAME} to train from "
            "the folder as it is"
        ) from None


def init_in_store() -> bool:
    """Random init straight into the host store (``init_streamed_model``): on a GPU, where
    the layers are initialized on the device, fast, and the model never exists as a whole."""
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def _check_vocab(cfg, tokenizer) -> None:
    vocab = getattr(cfg, "vocab_size", None)
    if vocab is not None and len(tokenizer) > vocab:
        raise CLIError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab}"
        )


# ---- the run ------------------------------------------------------------------------------------
def end_process_group() -> None:
    """Tear down a data-parallel launch's process group before interpreter exit.

    Left to interpreter shutdown, the collective library's threads may be destroyed while still
    joinable, aborting a finished run ("terminate called without an active exception").
    """
    import torch.distributed as dist  # noqa: PLC0415

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def check_launch() -> None:
    """Refuse launch layouts data parallel cannot run (a node's ranks share its host store)."""
    from .core.distributed import launch_layout_error  # noqa: PLC0415

    world = world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    problem = launch_layout_error(world, local)
    if problem:
        raise CLIError(problem.removeprefix("hf_megatrain: "))
    # accelerate's launcher for a CPU starts more than one process only through mpirun; without
    # it, asked for several, it starts one with a rendezvous address set and no world size
    # (found by an audit: that one trained alone, the global batch a fraction of the one asked).
    asked_several = "MASTER_ADDR" in os.environ and "WORLD_SIZE" not in os.environ
    mpi = any(k in os.environ for k in ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE"))
    if asked_several and "ACCELERATE_USE_CPU" in os.environ and not mpi:
        raise CLIError(
            "accelerate launch started one process where several were asked: on a CPU its "
            "launcher runs several only through mpirun (--mpirun_hostfile). Launch them with "
            "`torchrun --nproc_per_node N -m hf_megatrain train ...`, or `accelerate launch "
            "--config_file recipes/accelerate/multi_gpu.yaml --num_processes N -m hf_megatrain "
            "train ...` (torchrun's workers: gloo on a CPU)"
        )


def _mean_loss(model, rows, batch_size: int, device) -> float:
    """Token-weighted mean next-token loss of ``model`` over ``rows`` (torch-format rows)."""
    import torch  # noqa: PLC0415
    from transformers import default_data_collator  # noqa: PLC0415

    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(rows), batch_size):
            batch = default_data_collator(
                [rows[j] for j in range(i, min(i + batch_size, len(rows)))]
            )
            batch = {k: v.to(device) for k, v in batch.items()}
            out = model(**batch, use_cache=False)
            n = int((batch["labels"][:, 1:] != -100).sum())
            total += float(out.loss) * n
            count += n
    return total / max(count, 1)


def _resumed_state(checkpoint: str) -> str:
    """What a resume from ``checkpoint`` takes from it (with --resume-without-optimizer-state
    the optimizer state or the scheduler may be missing: they start afresh, as said)."""
    from .hf.checkpoint import has_optimizer_state  # noqa: PLC0415

    taken = ["its weights"]
    taken += ["optimizer"] if has_optimizer_state(checkpoint) else []
    taken += ["scheduler"] if os.path.isfile(os.path.join(checkpoint, "scheduler.pt")) else []
    return ", ".join(taken + ["data position, RNG"])


def _dir_size_mb(path: str, suffix: str) -> tuple[int, float]:
    files = [f for f in Path(path).iterdir() if f.name.endswith(suffix)]
    return len(files), sum(f.stat().st_size for f in files) / 1e6


def _checkpoint_state(checkpoint: str):
    """A Trainer checkpoint's ``TrainerState`` (None: no trainer_state.json), checked against
    the checkpoint's manifest first: the resume point is read from it before the trainer checks
    the whole checkpoint, and an altered file must not decide it."""
    from .core.publish import IntegrityError, hash_file, read_manifest  # noqa: PLC0415

    path = Path(checkpoint) / "trainer_state.json"
    if not path.is_file():
        return None
    listed = (read_manifest(checkpoint) or {}).get("files", {}).get(path.name)
    if listed is not None and hash_file(str(path)) != (int(listed["size"]), listed["sha256"]):
        raise IntegrityError(
            f"hf_megatrain: {path} is corrupt: it differs from the one in its checkpoint's manifest"
        )
    from transformers.trainer_callback import TrainerState  # noqa: PLC0415

    try:
        return TrainerState.load_from_json(str(path))
    except (ValueError, TypeError, KeyError) as e:  # (no manifest: an older version's save)
        raise IntegrityError(f"hf_megatrain: {path} is not a trainer state ({e})") from None


def _saved_model_record(folder: str) -> dict | None:
    """What the model saved whole in ``folder`` was saved from (its manifest's ``saved_from``:
    the training step and the checkpoint whose weights it holds, if loaded back at the end);
    None where there is no such model: no manifest, a listed file missing or of another size,
    or saved by a version that did not record it."""
    from .core.publish import IntegrityError, read_manifest  # noqa: PLC0415

    try:
        manifest = read_manifest(folder)
    except IntegrityError:
        return None
    if manifest is None or not (Path(folder) / "config.json").is_file():
        return None
    record = manifest.get("saved_from")
    if not isinstance(record, dict) or not isinstance(record.get("global_step"), int):
        return None
    return record if listed_files_problem(folder, manifest) is None else None


@contextlib.contextmanager
def _damage_names_an_earlier(resume: str | None, settings: TrainSettings):
    """A checkpoint found altered on disk (a file whose sha256 differs from its manifest's) is
    refused in one line that names the newest complete checkpoint before it, to resume from
    instead (the sizes match, so it was taken as complete; nothing is chosen silently)."""
    from .core.publish import IntegrityError  # noqa: PLC0415

    try:
        yield
    except IntegrityError as e:
        if resume is None:
            raise
        allow = settings.engine.resume_without_optimizer_state
        earlier = earlier_complete(resume, allow)
        way = (
            f"to resume from the checkpoint before it, pass --resume_from_checkpoint {earlier}"
            if earlier
            else "no earlier complete checkpoint is there: pass a new --output_dir"
        )
        if getattr(e, "rel", None) is not None and is_optimizer_state(e.rel):
            # A new run can start from its weights (--model_path checks them against the
            # manifest in turn).
            way += (
                f", or start a new run from its weights: --model_path {resume} with a new "
                "--output_dir (AdamW moments at zero, the learning-rate schedule restarted)"
            )
        raise CLIError(f"{str(e).removeprefix('hf_megatrain: ')}; {way}") from None


def _final_model_damage(folder: str) -> str | None:
    """What is wrong with the final model saved in ``folder`` (every file against the sha256
    of its manifest), None if nothing: a run that finds its final model already written ends
    there, so that model is checked whole first."""
    from .core.publish import IntegrityError, verify_folder  # noqa: PLC0415

    _say(f"hf-megatrain: checking the final model in {folder} against its manifest ...")
    try:
        verify_folder(folder)
    except (IntegrityError, FileNotFoundError) as e:
        return str(e).removeprefix("hf_megatrain: ")
    return None


def _best_checkpoint(resume: str, state, args) -> str | None:
    """The checkpoint whose weights this run's final model holds instead of ``resume``'s: the
    best one ``resume``'s trainer state records, under --load_best_model_at_end (as the
    Trainer loads it at the end of training). Looked up beside ``resume`` (the recorded path
    may be relative to another working directory); None where it is gone."""
    if not args.load_best_model_at_end or state is None or not state.best_model_checkpoint:
        return None
    name = os.path.basename(os.path.normpath(state.best_model_checkpoint))
    path = os.path.join(os.path.dirname(os.path.abspath(resume)), name)
    return path if os.path.isdir(path) else None


def _finishes_run(record: dict, resume: str, resume_step: int, args) -> bool:
    """Whether the final model ``record`` describes is this run's: saved at --max_steps or
    later, at the step of the newest complete checkpoint ``resume`` or past every checkpoint
    (the Trainer deletes the last one at the end under --load_best_model_at_end
    --save_total_limit 1), holding the weights this run's end would pick."""
    step, weights_from = record["global_step"], record.get("weights_from")
    if args.max_steps <= 0 or step < args.max_steps or step < resume_step:
        return False  # a shorter run's model, or a newer checkpoint not yet exported
    if step > resume_step:
        checkpoints = os.path.dirname(os.path.abspath(resume))
        if checkpoints_after(checkpoints, resume_step):
            return False  # newer ones are incomplete: the run goes on from resume to mend them
        if not args.load_best_model_at_end:
            return weights_from is None
        return weights_from is not None and os.path.isdir(
            os.path.join(checkpoints, str(weights_from))
        )
    best = _best_checkpoint(resume, _checkpoint_state(resume), args)
    return weights_from == (os.path.basename(best) if best is not None else None)


def _size(nbytes: float) -> str:
    """Bytes for a message: GB with one decimal, MB below 1 GB."""
    return f"{nbytes / 1e9:.1f} GB" if nbytes >= 1e9 else f"{nbytes / 1e6:.0f} MB"


def check_output_dir_on_every_rank(output_dir: str) -> None:
    """Refuse, on every rank, a data-parallel run whose --output_dir some rank cannot see: rank
    0 made it and writes every checkpoint once, into a folder every node reads on resume (found
    by an audit: node-local folders failed in a traceback on one node, a gloo error on the
    other). A collective."""
    import torch.distributed as dist  # noqa: PLC0415

    from .core.distributed import process_group_size  # noqa: PLC0415

    if process_group_size() < 2:
        return
    dist.barrier()  # (rank 0 has made it)
    seen: list = [None] * dist.get_world_size()
    dist.all_gather_object(seen, (output_dir, os.path.isdir(output_dir)))
    missing = [f"rank {rank}'s {path}" for rank, (path, there) in enumerate(seen) if not there]
    if missing:
        raise CLIError(
            f"--output_dir does not exist where rank 0 made it ({seen[0][0]}) for "
            f"{', '.join(missing)}: rank 0 writes the checkpoints once, into a folder every "
            "node reads on resume; pass one on a file system every node shares"
        )


def _warn_checkpoint_disk(settings: TrainSettings, n_params: int) -> None:
    """Say early when the checkpoints the run will write cannot fit on the output disk."""
    args = settings.training
    if args.save_strategy == "no":  # a SaveStrategy, a str enum
        return
    need = n_params * _CHECKPOINT_BYTES_PER_PARAM
    keep = (args.save_total_limit or 0) + 1  # rotation deletes the oldest after the next lands
    free = shutil.disk_usage(args.output_dir).free
    if need * min(keep, 2) > free:
        _say(
            f"  warning: a checkpoint of this model takes ~{_size(need)} and "
            f"{args.output_dir} has {_size(free)} free; pass --save_strategy no, or an "
            "--output_dir on a bigger disk, or the first checkpoint will fail"
        )


def _resume_point(settings: TrainSettings) -> tuple[str | None, int | None]:
    """The checkpoint this run resumes from (None: a fresh run) and its step, checked to be
    complete and of the same run."""
    args = settings.training
    resume, skipped = resume_checkpoint(
        args.resume_from_checkpoint,
        args.output_dir,
        settings.engine.resume_without_optimizer_state,
    )
    if skipped:
        _say(f"hf-megatrain: skipped incomplete {', '.join(skipped)}; resuming from {resume}")
    if resume is None:
        return None, None
    with _damage_names_an_earlier(resume, settings):
        state = _checkpoint_state(resume)  # (checked against its manifest before it is read)
    explicit = args.resume_from_checkpoint is not None
    check_same_run(resume, settings, explicit=explicit)
    # (an edited config file would fail only on loading the weights, after the model is built)
    check_same_config(resume, run_config(settings), explicit=explicit)
    return resume, (state.global_step if state is not None else None)


def _say_header(settings: TrainSettings, data, model, n_params: int) -> None:
    args, data_args = settings.training, settings.data
    cfg = model.config
    what = settings.model.model_path or (
        "random init from " + (settings.model.config or "the bundled config")
    )
    batch, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    rows, split = step_rows(batch, accum, world_size(), settings.engine.sequence_parallel)
    length = (
        f"{args.max_steps} steps" if args.max_steps > 0 else f"{args.num_train_epochs:g} epochs"
    )
    _say(
        f"hf-megatrain: {cfg.model_type} {human_count(n_params)} params, "
        f"{cfg.num_hidden_layers} layers ({what})\n"
        f"  data: {data.description}\n"
        f"  {length} x {data_args.seq_len * rows} tokens ({split}), lr {args.learning_rate:g}, "
        f"{'bf16 compute, fp32 masters' if args.bf16 else 'fp32'} on {args.device.type}"
    )
    n_rows = data.num_train_rows
    if n_rows and args.max_steps > 0 and args.max_steps * rows > 20 * n_rows:
        _say("  note: more than 20 epochs over this data; expect the model to memorize it")
    from .core.options import default_of  # noqa: PLC0415

    if settings.engine.hbm_reserve_gb != default_of("hbm_reserve_gb"):
        _say(
            "  note: --hbm-reserve-gb is not used: it stands in for activations when the row "
            "length is unknown, and this command's rows are --seq_len tokens (the plan sizes "
            "them; --plan-seq-len plans for longer ones)"
        )
    if (
        args.save_only_model
        and str(getattr(args.save_strategy, "value", args.save_strategy)) != "no"
    ):
        _say(
            "  note: --save_only_model: checkpoints hold the weights only (no optimizer, "
            "scheduler or data position); a rerun resumes them only with "
            "--resume-without-optimizer-state, not as the uninterrupted run"
        )


def step_rows(batch: int, accum: int, world: int, sequence_parallel: int) -> tuple[int, str]:
    """The rows one optimizer step trains (hf/step_layout.py), and how they split: ``world``
    processes, each group of ``sequence_parallel`` of them sharing every row of its batch."""
    from .hf.step_layout import StepLayout  # noqa: PLC0415

    layout = StepLayout(world, sequence_parallel, batch, accum)
    split = f"batch {batch} x grad-accum {accum}"
    if sequence_parallel > 1:
        groups = f"{layout.groups} group{'s' if layout.groups != 1 else ''}"
        split += f" x {groups} of {sequence_parallel} processes sharing each row"
    elif world > 1:
        split += f" x {world} processes"
    return layout.rows_per_step, split


def human_count(n: int) -> str:
    """A parameter count for a message: 3.1M, 7.6B."""
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _make_trainer(settings: TrainSettings, model, data, tokenizer, stop):
    from transformers import default_data_collator  # noqa: PLC0415

    from . import HFMegaTrainer  # noqa: PLC0415
    from .hf.heartbeat import StepHeartbeat  # noqa: PLC0415

    try:
        return HFMegaTrainer(
            model=model,
            args=settings.training,
            train_dataset=data.train,
            eval_dataset=data.eval,
            processing_class=tokenizer,
            # Rows are equal-length tensors: stack them. (With a tokenizer the Trainer would pick
            # a padding collator that returns a BatchEncoding instead of a dict.)
            data_collator=default_data_collator,
            callbacks=[
                record_callback(run_record(settings) | {ROWS_KEY: data.rows_digest}),
                stop,
                StepHeartbeat(),  # (a line a minute while a step runs longer)
            ],
        )
    except ImportError as e:  # e.g. --report_to tensorboard without tensorboard installed
        raise CLIError(f"invalid training setting: {e}") from None
    except RuntimeError as e:  # e.g. --report_to wandb: "WandbCallback requires wandb ..."
        if "install" not in str(e):
            raise
        raise CLIError(f"invalid training setting: {error_summary(e)}") from None


@contextlib.contextmanager
def _one_run_in(folder: str):
    """Hold ``folder`` for this run: a second run into it (which would resume from this one's
    unfinished checkpoints and write the same names) is refused. A ``flock`` on a file beside
    the folder (the folder itself is swapped for a new one when the final model is published);
    the kernel drops it when the process ends, however it ends."""
    import fcntl  # noqa: PLC0415

    # Beside the folder's real path: a second run through a symlink to it is refused too.
    parent, name = os.path.split(os.path.realpath(folder))
    lock = os.path.join(parent, f".{name}.hf-megatrain.lock")
    try:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        _say(
            f"hf-megatrain: (not locking {folder} for this run: cannot create {lock}: {e.strerror})"
        )
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise CLIError(
                f"output_dir {folder} is in use by another hf-megatrain run (it would resume "
                "from that run's checkpoints and overwrite them): wait for it to end, or pass "
                "another --output_dir"
            ) from None
        except OSError as e:  # a filesystem without locks
            _say(f"hf-megatrain: (not locking {folder} for this run: {e.strerror})")
        yield
    finally:
        os.close(fd)  # (drops the lock; the empty file stays: removing it could race a start)


def run_train(settings: TrainSettings) -> dict[str, Any]:
    """Run one training job; return a summary (losses, paths, timings) for callers and tests."""
    # Absolute from here on: what the run records (checkpoint paths in trainer_state.json) and
    # reports must not depend on the working folder, e.g. under --output_dir .
    args = settings.training
    args.output_dir = os.path.abspath(args.output_dir)
    # (Data parallel: the ranks of one run share the folder; rank 0 holds it for them.)
    held = _one_run_in(args.output_dir) if _is_main_process() else contextlib.nullcontext()
    with held:
        _setup_logging()
        if _is_main_process():
            from .core.publish import recover  # noqa: PLC0415
            from .hf.superseded import finish_pending_moves  # noqa: PLC0415

            # Before anything reads or makes the folder: a publish of the final model killed
            # half way may have left it renamed aside (restored here) or leftovers (removed).
            recover(args.output_dir)
            finish_pending_moves(args.output_dir)  # (saves a kill left half set aside)
            try:
                os.makedirs(args.output_dir, exist_ok=True)
            except OSError as e:
                raise CLIError(
                    f"output_dir cannot be created: {args.output_dir} ({e.strerror})"
                ) from None
        return _run_train(settings)


def _run_train(settings: TrainSettings) -> dict[str, Any]:
    from .training_data import load_training_data  # noqa: PLC0415

    t_start = time.perf_counter()
    _setup_logging()
    args, data_args = settings.training, settings.data
    device = args.device
    check_output_dir_on_every_rank(args.output_dir)
    resume, resume_step = _resume_point(settings)
    if resume_step is not None and 0 < args.max_steps < resume_step:
        # (its schedule ran to a later end: a shorter run cannot be made from it)
        raise CLIError(
            f"{resume} is at step {resume_step}, past --max_steps {args.max_steps}: it is a "
            "longer run's. Pass another --output_dir for a new run, or --max_steps "
            f"{resume_step} or more to finish or continue that one."
        )
    # The Trainer would train one step past --max_steps from such a checkpoint: the run is
    # finished from it instead, as its last step would have finished it.
    finish_only = resume_step is not None and 0 < args.max_steps <= resume_step
    named = (args.resume_from_checkpoint or "last").lower() not in RESUME_LAST  # a folder
    record = _saved_model_record(args.output_dir) if resume_step is not None else None
    done = not named and record is not None and _finishes_run(record, resume, resume_step, args)
    if done and (damage := _final_model_damage(args.output_dir)) is not None:
        _say(f"hf-megatrain: {damage}; writing it again from {os.path.basename(resume)}")
        done = False
    if done:
        out = args.output_dir
        _say(
            f"hf-megatrain: {out} already holds this run's final model (saved at step "
            f"{record['global_step']} of --max_steps {args.max_steps}; its last checkpoint is "
            f"{os.path.basename(resume)}): nothing to train. Pass a larger --max_steps to "
            "continue it, or another --output_dir."
        )
        return {"output_dir": out, "resumed_from": resume, "already_done": True}

    tokenizer = load_tokenizer(settings)
    if args.disable_tqdm:  # every library's bars: loading, tokenizing and writing shards too
        import datasets  # noqa: PLC0415
        import huggingface_hub.utils  # noqa: PLC0415
        import transformers.utils.logging  # noqa: PLC0415

        datasets.disable_progress_bars()
        huggingface_hub.utils.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()
    # Data parallel: rank 0 tokenizes into the datasets cache, the other ranks read it.
    with args.main_process_first(desc="dataset"):
        data = load_training_data(data_args, tokenizer, seed=args.seed)
    if not finish_only:  # (what only the loaded data tells, before the model is built)
        check_loaded_data(settings, data)
        if resume is not None:
            explicit = args.resume_from_checkpoint is not None
            check_same_rows(resume, data.rows_digest, data_args.seq_len, explicit)
    model = build_model(settings, tokenizer)
    n_params = sum(p.numel() for p in model.parameters())
    _say_header(settings, data, model, n_params)
    if finish_only:
        _say(
            f"  {resume} is at step {resume_step} of --max_steps {args.max_steps}: nothing is "
            "left to train; the final model is written from its weights"
            + (
                f" (the one in {args.output_dir} is step {record['global_step']}'s)"
                if record is not None and record["global_step"] != resume_step
                else ""
            )
        )
    elif resume is not None:
        _say(f"  resuming from {resume} ({_resumed_state(resume)})")
        if note := seq_len_note(resume, data_args.seq_len):
            _say(f"  {note}")
    if not finish_only:
        _warn_checkpoint_disk(settings, n_params)

    from .hf.preemption import SaveOnSigterm  # noqa: PLC0415

    stop = SaveOnSigterm()
    trainer = _make_trainer(settings, model, data, tokenizer, stop)
    t_train = time.perf_counter()
    start_step = resume_step or 0
    train_loss = None
    # A SIGTERM during training: a checkpoint at the step's end, then stop. After training (the
    # final eval and save): the final model is saved first, and the reload check skipped.
    with stop.handling():
        with _damage_names_an_earlier(resume, settings):
            if finish_only:
                _load_final_weights(trainer, resume, resume_step, args)
            else:
                train_loss = trainer.train(resume_from_checkpoint=resume).training_loss
        train_s = time.perf_counter() - t_train
        if stop.stopped_at is not None:
            checkpoint = os.path.join(args.output_dir, f"checkpoint-{stop.stopped_at}")
            _say(
                f"hf-megatrain: stopped by {stop.received.name} after step {stop.stopped_at} of "
                f"this run; saved {checkpoint}. Run the same command again to resume from it."
            )
            return {
                "output_dir": args.output_dir,
                "stopped": checkpoint,
                "signal": int(stop.received),
            }
        # (None where the evaluation computed no loss: the model is still saved.)
        eval_loss = trainer.evaluate().get("eval_loss") if data.eval is not None else None
        if eval_loss is not None and not math.isfinite(eval_loss):
            raise CLIError(
                f"the final eval loss is {eval_loss}: training diverged (try a lower --lr); the "
                "model was not saved"
            )
        trainer.save_model(args.output_dir)
    trainer.accelerator.wait_for_everyone()  # rank 0 wrote the model
    stopped_after_training = stop.requested
    if not _is_main_process():
        # Data parallel: the report and the reload check are rank 0's.
        return {"output_dir": args.output_dir, "n_params": n_params}
    out = args.output_dir
    steps_run = 0 if finish_only else trainer.state.global_step - start_step
    if finish_only:
        done = f"\nhf-megatrain: finished the run from {resume} (step {resume_step}"
    else:
        noun = "step" if steps_run == 1 else "steps"
        done = f"\nhf-megatrain: trained {steps_run} {noun}" + (
            f" (from step {start_step})" if start_step else ""
        )
        done += f" in {train_s:.1f} s (mean train loss {train_loss:.4f} over these steps"
    _say_saved(out, done, eval_loss)
    result: dict[str, Any] = {
        "output_dir": out,
        "n_params": n_params,
        "train_loss": train_loss,
        "log_history": list(trainer.state.log_history),
        "eval_loss": eval_loss,
        "train_seconds": train_s,
        "resumed_from": resume,
        "finished_from_checkpoint": finish_only,
    }
    verify = settings.model.verify
    if stopped_after_training:
        _say(
            f"\n({stop.received.name} after training: the final model is saved; the reload "
            "check is skipped.)"
        )
    elif verify is False:
        _say("\n(Skipped reloading the saved model for the final check: --no-verify was given.)")
    elif verify or n_params <= _AUTO_VERIFY_MAX_PARAMS:
        # Free the host store first: the check loads a second, ordinary copy of the model.
        del trainer, model
        gc.collect()
        _verify_saved(settings, out, data.eval, tokenizer, device, eval_loss, result)
    else:
        _say(
            f"\n(Skipped reloading a {human_count(n_params)}-parameter model for the final check: "
            f"above {human_count(_AUTO_VERIFY_MAX_PARAMS)} a second copy may not fit in host RAM; "
            "pass --verify to force it.)"
        )
    _say(f"hf-megatrain: done in {time.perf_counter() - t_start:.1f} s")
    return result


def _load_final_weights(trainer, resume: str, resume_step: int, args) -> None:
    """Load what the end of training from ``resume`` would leave in the model: the best
    checkpoint's weights under --load_best_model_at_end, else ``resume``'s; the trainer is put
    at ``resume``'s step, which the final model's manifest records."""
    from .hf.preemption import evaluation_owed  # noqa: PLC0415

    if evaluation_owed(resume):  # (a signal stopped its step's evaluation: it decides the best)
        state = trainer.evaluate_stopped_step(resume)
    else:
        state = _checkpoint_state(resume)
    trainer.state.global_step = resume_step
    best = _best_checkpoint(resume, state, args)
    if best is None:
        if args.load_best_model_at_end and state is not None and state.best_model_checkpoint:
            _say(
                f"  warning: the best checkpoint {state.best_model_checkpoint} is gone: the "
                f"final model is {resume}'s weights"
            )
        trainer._load_from_checkpoint(resume)  # verified against its manifest, then read
        return
    _say(f"  --load_best_model_at_end: the final model is the best checkpoint, {best}")
    trainer.state.best_model_checkpoint = best
    trainer._load_best_model()  # verified, then read; recorded as the weights' origin


def _say_saved(out: str, done: str, eval_loss: float | None) -> None:
    """The end-of-run report: ``done`` (what was trained, an open parenthesis) and the save."""
    n_shards, mb = _dir_size_mb(out, ".safetensors")
    _say(
        done
        + (f", eval loss {eval_loss:.4f}" if eval_loss is not None else "")
        + f").\nSaved {n_shards} safetensors shard(s), {mb:.1f} MB, and the tokenizer to {out}\n"
        "Load it with:\n"
        "  from transformers import AutoModelForCausalLM, AutoTokenizer\n"
        f'  model = AutoModelForCausalLM.from_pretrained("{out}")\n'
        f'  tokenizer = AutoTokenizer.from_pretrained("{out}")\n'
        f"Continue training it with: hf-megatrain train --model_path {out} --dataset_name <data>"
    )


def _verify_saved(settings, out, eval_rows, tokenizer, device, eval_loss, result) -> None:
    """Reload the saved model as a user would and report its eval loss and a greedy sample."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, local_files_only=True)
    reloaded.to(device).eval()
    if eval_rows is not None and len(eval_rows):
        batch = settings.training.per_device_eval_batch_size
        reloaded_loss = _mean_loss(reloaded, eval_rows, batch, device)
        result["reloaded_eval_loss"] = reloaded_loss
        _say(
            f"\nCheck: AutoModelForCausalLM.from_pretrained loaded the saved model; its eval "
            f"loss is {reloaded_loss:.4f} (perplexity {math.exp(min(reloaded_loss, 50)):.1f})"
            + (f" vs {eval_loss:.4f} from the streamed model" if eval_loss is not None else "")
            + (
                " (which averaged per-batch losses over the processes, whose last batches are "
                "evened out with repeated rows: not quite the same mean)"
                if eval_loss is not None and world_size() > 1
                else ""
            )
        )
        if not math.isfinite(reloaded_loss):
            raise RuntimeError("the reloaded model gives a non-finite loss")
    prompt, n_new = settings.model.sample_prompt, settings.model.max_new_tokens
    if n_new > 0 and prompt:
        enc = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = reloaded.generate(
                **enc.to(device),
                max_new_tokens=n_new,
                do_sample=False,
                # A minutes-old model loops on its most frequent tokens; blocking repeated
                # trigrams keeps the greedy sample readable without sampling noise.
                no_repeat_ngram_size=3,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        sample = tokenizer.decode(gen[0], skip_special_tokens=True)
        result["sample"] = sample
        _say(f"Greedy sample ({n_new} new tokens, no repeated trigrams):\n---\n{sample}\n---")


__all__ = [
    "build_model",
    "end_process_group",
    "human_count",
    "init_in_store",
    "load_tokenizer",
    "loader_arguments",
    "run_train",
]
