"""``hf-megatrain``: the command line (``train``, ``plan``, ``verify``).

``hf-megatrain train`` with no argument trains the embedded default (see :mod:`cli_train`); its
arguments are the Trainer's own (:mod:`cli_arguments`). User mistakes end in one
``hf-megatrain: error: ...`` line, not a traceback.
"""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys

from .cli_arguments import add_train_arguments, parse_train_arguments
from .cli_common import CLIError, Parser, ShortErrors
from .cli_plan import add_plan_parser as _add_plan_parser
from .cli_plan import run_plan as run_plan
from .cli_train import check_launch, end_process_group, run_train
from .cli_verify import add_verify_parser as _add_verify_parser
from .cli_verify import run_verify as run_verify
from .text import DATA_DIR as DATA_DIR
from .text import DEFAULT_CONFIG as DEFAULT_CONFIG
from .text import DEFAULT_CORPUS as DEFAULT_CORPUS
from .text import DEFAULT_TOKENIZER as DEFAULT_TOKENIZER
from .text import DataError

TRAIN_DESCRIPTION = (
    "Train with HFMegaTrainer. Every TrainingArguments flag works (--report_to, --save_steps, "
    "--resume_from_checkpoint, --eval_strategy, --push_to_hub, ...), with the data, model and "
    "engine flags below. Precedence: flags > --recipe YAML > defaults. With no argument: a "
    "~3M-parameter Llama-style model on bundled text, a few minutes on a laptop CPU. Checkpoints "
    "are written every --save_steps; re-run into the same --output_dir to resume from the last."
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; ``train``'s own arguments are :func:`build_train_parser`'s."""
    parser = Parser(
        prog="hf-megatrain",
        description="Train decoder LLMs larger than the GPU with hf_megatrain.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    # Parsed by build_train_parser (an HfArgumentParser): here only for the command list.
    sub.add_parser("train", help="train a model (no argument: the embedded CPU-sized default)",
                   add_help=False)  # fmt: skip
    _add_plan_parser(sub)
    _add_verify_parser(sub)
    return parser


def build_train_parser() -> argparse.ArgumentParser:
    """``hf-megatrain train``'s parser: HfArgumentParser over the model, data and training
    arguments, plus the recipe, short spellings and engine flags."""
    from transformers import HfArgumentParser  # noqa: PLC0415

    from .cli_arguments import _dataclasses  # noqa: PLC0415

    class TrainParser(ShortErrors, HfArgumentParser):
        pass

    parser = TrainParser(_dataclasses(), prog="hf-megatrain train", description=TRAIN_DESCRIPTION)
    add_train_arguments(parser)
    return parser


def parse_train(argv: list[str]):
    """``hf-megatrain train`` arguments (``argv`` without the command) as TrainSettings."""
    return parse_train_arguments(build_train_parser(), argv)


def _command_parser(parser: argparse.ArgumentParser, command: str | None):
    """The sub-parser of ``command`` (the top-level parser where there is none)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    return parser


def _as_flags(message: str) -> str:
    """A library message that names a trainer argument, with the CLI's flag instead."""
    return message.replace(
        "set megatrain_resume_without_optimizer_state=True", "pass --resume-without-optimizer-state"
    )


_WRITE_ELSEWHERE = "check that you may write there, or pass another --output_dir"
#: OS errors a run ends in where the disk, not the program, failed (mostly while saving): what
#: happened, and what to do.
_OS_ERRORS = {
    errno.ENOSPC: (
        "no space left on the device of --output_dir while saving",
        "free space or pass an --output_dir on a bigger disk",
    ),
    errno.EDQUOT: (
        "disk quota exceeded on the file system of --output_dir while saving",
        "free space within the quota, or pass an --output_dir elsewhere",
    ),
    errno.EFBIG: (
        "a file under --output_dir grew past the largest file allowed (a file-size limit, "
        "ulimit -f, or the file system's own)",
        "raise the limit, pass a smaller --max-shard-size, or an --output_dir on another file "
        "system",
    ),
    errno.EROFS: (
        "the file system of --output_dir is read-only",
        "pass an --output_dir on a writable file system",
    ),
    errno.EIO: (
        "input/output error (a failing disk or network file system)",
        "check the disk, or pass an --output_dir on another one",
    ),
    errno.ENAMETOOLONG: (
        "a file name under --output_dir is too long for its file system",
        "pass a shorter --output_dir",
    ),
    errno.EACCES: ("permission denied", _WRITE_ELSEWHERE),
    errno.EPERM: ("operation not permitted", _WRITE_ELSEWHERE),
}


def _os_error_message(e: BaseException) -> str | None:
    """The one-line message for ``e`` where it is one of the OS errors of ``_OS_ERRORS``
    (None: another error, shown with its traceback)."""
    from .core.publish import os_error_code  # noqa: PLC0415

    code, filename = os_error_code(e), getattr(e, "filename", None)
    if code not in _OS_ERRORS:
        return None
    what, todo = _OS_ERRORS[code]
    where = f" ({os.fsdecode(filename)})" if filename else ""
    return (
        f"{what}{where}: {todo}. Checkpoints published before the error are intact (saves are "
        "swapped in only when complete); a re-run resumes from the last complete one"
    )


#: How a collective reports a peer process gone (gloo's transport, NCCL's watchdog, torch's
#: store): the words of those errors, which are plain RuntimeErrors under gloo.
_PEER_LOST = (
    "Connection reset by peer", "Connection closed by peer", "Broken pipe",
    "remote process exited", "communicator was aborted", "DistNetworkError",
)  # fmt: skip


def _peer_lost_message(e: BaseException) -> str | None:
    """The one-line message for a data-parallel run whose peer process stopped (killed, out
    of memory, a node gone): None for any other error."""
    from .core.distributed import process_group_size  # noqa: PLC0415

    if process_group_size() < 2:
        return None
    text = str(e)
    if not isinstance(e, RuntimeError) or not any(w in text for w in _PEER_LOST):
        return None
    # (gloo's words: "[.../pair.cc:537] Read error [addr]:port: Connection reset by peer. This
    # is typically caused by ...": the source path and the boilerplate after it dropped)
    first = re.sub(r"^\[[^\]]*\.\w+:\d+\]\s*", "", " ".join(text.split())).split(". ")[0][:200]
    return (
        f"a data-parallel peer process stopped ({first}): this rank stops too; the launcher's "
        "log names the rank that failed first. Checkpoints published before are intact (saves "
        "are swapped in only when complete); rerunning the command resumes from the newest one"
    )


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``hf-megatrain`` and ``python3 -m hf_megatrain``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "train":
        ns = argparse.Namespace(command="train")
    else:
        ns, extra = parser.parse_known_args(argv)
        if extra:  # the command's own parser names them, with its flags as suggestions
            _command_parser(parser, ns.command).error(f"unrecognized arguments: {' '.join(extra)}")
    if ns.command not in ("train", "plan", "verify"):
        parser.print_help()
        return 2
    try:
        if ns.command == "verify":
            return run_verify(ns)
        if ns.command == "plan":
            run_plan(ns)
            return 0
        check_launch()
        settings = parse_train(argv[1:])
        from . import InsufficientHostMemoryError, UnsupportedModelError  # noqa: PLC0415
        from .core.distributed import DataParallelError  # noqa: PLC0415
        from .core.optimizer import NonFiniteError  # noqa: PLC0415

        try:
            result = run_train(settings)
            if result.get("stopped"):
                # Stopped by SIGTERM / SIGUSR1 with a checkpoint saved: not done, so not status
                # 0 (a job script's next command must not take the run for finished).
                return 128 + result["signal"]
        except NonFiniteError as e:
            # Training stopped on NaN/inf (megatrain_nonfinite), or a save refused such weights.
            raise CLIError(str(e).removeprefix("hf_megatrain: ")) from None
        except (
            InsufficientHostMemoryError, ValueError, FileNotFoundError, DataParallelError
        ) as e:  # fmt: skip
            # The library's refusals (unsupported model, host RAM, a setting checked against
            # the model such as resident layers beyond its count or more ranks than layers, a
            # checkpoint missing files) say "hf_megatrain: ..."; any other ValueError is a bug
            # to show.
            ours = isinstance(
                e, (InsufficientHostMemoryError, UnsupportedModelError, DataParallelError)
            )
            if not ours and not str(e).startswith("hf_megatrain: "):
                raise
            raise CLIError(_as_flags(str(e).removeprefix("hf_megatrain: "))) from None
        except Exception as e:
            message = None
            if not isinstance(e, CLIError):
                message = _os_error_message(e) or _peer_lost_message(e)
            if message is None:
                raise
            raise CLIError(message) from None
        finally:
            end_process_group()
    except (CLIError, DataError) as e:
        # A string SystemExit prints one line on stderr and exits with status 1.
        raise SystemExit(f"hf-megatrain: error: {e}") from None
    except KeyboardInterrupt:
        # 128 + SIGINT, as shells report an interrupted command (1 would read as an error).
        print("hf-megatrain: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    return 0


if __name__ == "__main__":
    sys.exit(main())
