"""Training rows for ``hf-megatrain train`` from a Hub dataset or local files, through 🤗 datasets.

:func:`load_training_data` reads the data (``datasets.load_dataset``: its cache, its streaming),
renders chat rows with the tokenizer's chat template, tokenizes with ``map(batched=True)`` and
packs documents into ``seq_len``-token rows (or pads one row per document), then holds out the
eval rows. Problems with the user's data raise :class:`~hf_megatrain.text.DataError` with one
line that names the flag to change.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .hf.data_identity import rows_digest
from .text import DEFAULT_CORPUS, TEXT_SUFFIXES, DataError, bos_token_id

if TYPE_CHECKING:
    import datasets

#: The ``datasets`` builder of each local file suffix.
BUILDERS = {
    **dict.fromkeys(TEXT_SUFFIXES, "text"),
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
    ".csv": "csv",
}
# Documents per tokenize-and-pack batch. Packing carries nothing from one batch to the next (no
# state, so a streamed map is deterministic and restartable): each batch drops its last partial
# row, under seq_len tokens per 1,000 documents.
PACK_BATCH = 1000
# Paragraphs per tokenizer input: a long document (one .txt file is one document) is tokenized in
# pieces that the fast tokenizer encodes in parallel, as text.build_chunks does.
PIECE_PARAGRAPHS = 64
EVAL_SPLITS = ("validation", "test")
# Rows checked for the column's kind (text, or chat turns) before tokenizing.
FIRST_ROWS = 16
# Documentation that Hub dataset folders carry next to their data files (README.md dataset card).
DOC_SUFFIXES = (".md", ".rst")


@dataclass
class DataArguments:
    """Data flags of ``hf-megatrain train`` (HfArgumentParser makes each field a --<name>)."""

    dataset_name: str | None = field(
        default=None,
        metadata={
            "help": "a Hub dataset id (org/name) or a local file or folder: .txt/.md/.rst/.text "
            "(one document per file), .json/.jsonl, .parquet or .csv; a folder: its files of "
            "one such kind, searched recursively, split by name as datasets does (train.jsonl, "
            "validation.jsonl, data/test-*.parquet; else all train). Default: the bundled "
            "English corpus"
        },
    )
    dataset_config: str | None = field(
        default=None, metadata={"help": "the Hub dataset's config (subset) name"}
    )
    dataset_train_split: str = field(
        default="train",
        metadata={
            "help": "the split to train on, or a slice of splits as datasets reads one "
            "(train[:90%%], train[-1000:]; not with --streaming)"
        },
    )
    dataset_eval_split: str | None = field(
        default=None,
        metadata={
            "help": "the split to evaluate on. Default: a 'validation' or 'test' split if the "
            "dataset has one, else rows held out of the train split (--eval_fraction; also "
            "when this names the train split)"
        },
    )
    dataset_text_field: str = field(default="text", metadata={"help": "the text column"})
    dataset_messages_field: str = field(
        default="messages",
        metadata={
            "help": "the chat column, used when there is no text column: a list of "
            "{'role', 'content'} turns, rendered with the tokenizer's chat template"
        },
    )
    streaming: bool = field(
        default=False,
        metadata={
            "help": "stream the dataset instead of downloading and preparing it whole (for "
            "corpora bigger than disk or RAM); needs --max_steps"
        },
    )
    packing: bool = field(
        default=True,
        metadata={
            "help": "join documents with EOS and cut the stream into --seq_len-token rows; "
            "--no_packing: one row per document, truncated to --seq_len and padded"
        },
    )
    seq_len: int = field(default=128, metadata={"help": "tokens per training row"})
    eval_fraction: float = field(
        default=0.05,
        metadata={
            "help": "without an eval split, the fraction of the rows held out for eval (at most "
            "--max_eval_sequences; streaming: --max_eval_sequences rows from the head of the "
            "stream); 0: no held-out eval"
        },
    )
    max_eval_sequences: int = field(
        default=64, metadata={"help": "at most this many eval rows; 0: no eval"}
    )
    shuffle_buffer: int = field(
        default=10000,
        metadata={"help": "streaming: rows in the seeded shuffle buffer; 0: no shuffle"},
    )


@dataclass
class TrainingData:
    """What :func:`load_training_data` returns.

    Rows are ``{"input_ids", "labels"}`` LongTensors of ``seq_len`` (plus ``attention_mask`` when
    not packing; labels are -100 on padding), in torch format for ``default_data_collator``.
    """

    train: datasets.Dataset | datasets.IterableDataset
    eval: datasets.Dataset | None  # at most max_eval_sequences rows, never also in train
    description: str  # one line for the run banner
    num_train_rows: int | None  # None when streaming
    #: The train rows' identity (``rows_digest``; None when streaming): a resume compares it.
    rows_digest: str | None = None


def load_training_data(args: DataArguments, tokenizer, *, seed: int = 0) -> TrainingData:
    """Load, tokenize and pack the data that ``args`` names; see :class:`DataArguments`."""
    _check_args(args)
    splits = load_splits(args)
    source = args.dataset_name or "bundled corpus"
    if args.dataset_config:
        source += f" [{args.dataset_config}]"
    names = list(splits)
    for flag, split in (("train", args.dataset_train_split), ("eval", args.dataset_eval_split)):
        if split is not None and split not in splits and "[" in split:
            sliced = _split_slice(splits, split, f"--dataset_{flag}_split")
            if sliced is not None:
                splits[split] = sliced
        if split is not None and split not in splits:
            raise DataError(
                f"{source} has no split {split!r} (its splits: {', '.join(names)}); choose one "
                f"with --dataset_{flag}_split"
            )
    _refuse_overlapping_slices(splits, args.dataset_train_split, args.dataset_eval_split)
    # An eval split that is the train split would evaluate on training rows: rows of it are held
    # out instead (TrainingData.eval is never also in train).
    held_from_train = args.dataset_eval_split == args.dataset_train_split
    if held_from_train and not (args.eval_fraction > 0 and args.max_eval_sequences):
        raise DataError(
            f"--dataset_eval_split {args.dataset_eval_split} is the split trained on: its rows are "
            "held out for eval, but --eval_fraction or --max_eval_sequences is 0. Name another "
            "split, or drop --dataset_eval_split"
        )
    eval_split = None
    if not held_from_train:
        eval_split = args.dataset_eval_split or next(
            (s for s in EVAL_SPLITS if s in splits and s != args.dataset_train_split), None
        )
    raw = splits[args.dataset_train_split]
    where = f"{source} (split {args.dataset_train_split!r})"
    if not args.streaming and len(raw) == 0:
        raise DataError(f"{where} has no rows: the data is empty")
    with _reading(where):  # a stream is first read here
        encode, columns = _encoder(raw, args, tokenizer, where)
    kind = "chat" if encode["chat"] else "text"
    label = f"{kind} column {encode['column']!r}"
    n_empty = 0
    if not args.streaming:
        count = _empty_conversations if encode["chat"] else _empty_texts
        n_empty = count(raw, encode["column"])
        if n_empty == len(raw):
            # (Found by an audit: packed, this said "not enough text for one sequence of N
            # tokens: lower --seq_len", where there was no text at all.)
            raise DataError(f"{where}: no text to train on: all {n_empty:,} rows are empty")
        if n_empty:
            what = "conversation" if encode["chat"] else "row"
            label += f", {n_empty:,} empty {what}{'s' if n_empty != 1 else ''} skipped"
            if not encode["chat"]:  # (e.g. rows that keep their text under another key)
                label += " (no text: missing, null or blank)"
    if not args.packing:
        label += ", one padded row per document"

    eval_rows, eval_from = None, ""
    if eval_split is not None and args.max_eval_sequences:
        where = f"{source} (split {eval_split!r})"
        with _reading(where):
            eval_rows = _eval_split_rows(splits[eval_split], args, tokenizer, where)
        eval_from = f" (split {eval_split!r})"
    # Without an eval split: rows held out of train (eval_fraction 0: none).
    n_held = args.max_eval_sequences if eval_rows is None and args.eval_fraction > 0 else 0
    with _reading(source):
        if args.streaming:
            train, held = _stream_rows(raw, columns, encode, n_held, args, seed, source)
        else:
            train, held = _prepared_rows(raw, columns, encode, n_held, args, seed)
    if held is not None:
        eval_rows, eval_from = held, " (head of the stream)" if args.streaming else ""
        if held_from_train:
            eval_from += f" (held out of split {args.dataset_train_split!r})"
    n_eval = len(eval_rows) if eval_rows is not None else 0
    if args.streaming:
        description = (
            f"{source} (streaming, {label}): eval {n_eval} sequences of {args.seq_len} "
            f"tokens{eval_from}; train streamed"
        )
    else:
        n_docs = len(raw) - n_empty  # (the skipped rows are named in the label)
        description = (
            f"{source}{f' ({label})' if args.dataset_name else ''}: {n_docs:,} "
            f"document{'s' if n_docs != 1 else ''} -> {len(train):,} train / {n_eval:,} "
            f"eval{eval_from} sequences of {args.seq_len} tokens"
        )
    return TrainingData(
        train=train,
        eval=eval_rows,
        description=description,
        num_train_rows=None if args.streaming else len(train),
        rows_digest=None if args.streaming else rows_digest(train),
    )


def _prepared_rows(
    raw: datasets.Dataset,
    columns: list[str],
    encode: dict[str, Any],
    n_held: int,
    args: DataArguments,
    seed: int,
) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """(train, held-out eval or None) of a prepared Dataset: tokenized through the datasets cache,
    shuffled with the seed, eval split off as text.split_chunks does."""
    packed = _packed(raw, encode, columns, desc=f"Tokenizing into {args.seq_len}-token rows")
    n = len(packed)
    if n == 0:
        raise _too_little(args)
    if n_held and n < 2:
        raise _one_row(args)
    # split_chunks' rules (at least one eval row, at least one train row), and at most
    # max_eval_sequences: the rest of the fraction stays in train.
    packed = packed.shuffle(seed=seed)
    if n_held:
        n_held = min(max(1, round(n * args.eval_fraction)), n_held, n - 1)
    train = packed.select(range(n_held, n)).with_format("torch")
    held = packed.select(range(n_held)).with_format("torch") if n_held else None
    return train, held


def _stream_rows(
    raw: datasets.IterableDataset,
    columns: list[str],
    encode: dict[str, Any],
    n_held: int,
    args: DataArguments,
    seed: int,
    source: str,
) -> tuple[datasets.IterableDataset, datasets.Dataset | None]:
    """(train, held-out eval or None) of a stream: eval rows materialized from its head.

    The documents of the eval rows are left out of train by their content (_digest), not by
    their position: a stream read by several DataLoader workers is split over them by shards,
    and IterableDataset.skip would skip some rows of each worker's part instead of the head.
    A copy of an eval document later in the stream is left out too (eval is never trained on).
    The document that the head ends in the middle of trains from where the head stopped (its
    tokens after the head's last row): left out whole, a one-document corpus had nothing left.
    """
    held = None
    exclude: frozenset[str] = frozenset()
    cut: tuple = ()
    read = 0
    if n_held:
        rows, exclude, cut, read = _stream_head(raw, encode, n_held, args)
        if not rows:
            raise _too_little(args)
        held = _rows_dataset(rows)
    packed = _packed(raw, {**encode, "exclude": exclude, "cut": cut}, columns)
    n_left = len(list(packed.take(1)))
    if n_left == 0 and not n_held:
        raise _too_little(args)
    if n_left == 0 and len(held) == n_held and next(iter(raw.skip(read)), None) is not None:
        # (Found by an audit: a stream of repeated lines was said to hold only the eval rows.)
        raise DataError(
            f"{source}: after the {n_held} eval sequence(s) at the head of the stream, every "
            "document is empty or a copy of an eval document, and streaming never trains on "
            "a copy of an eval document: deduplicate the data, set --eval_fraction 0, or drop "
            "--streaming"
        )
    if n_left == 0 or (held is not None and len(held) < n_held):
        n = len(held) if held is not None else 0
        raise DataError(
            f"{source} streams only {n} sequence(s) of {args.seq_len} tokens, all needed "
            f"for eval: lower --max_eval_sequences, {_more_rows(args)}, set --eval_fraction 0, "
            "or drop --streaming"
        )
    if args.shuffle_buffer:
        # Seeded (the buffer and the shard order): a resume that re-reads the stream sees the
        # same rows.
        packed = packed.shuffle(seed=seed, buffer_size=args.shuffle_buffer)
    return packed.with_format("torch"), held


def _stream_head(
    raw: datasets.IterableDataset, encode: dict[str, Any], n_held: int, args: DataArguments
) -> tuple[list[dict], frozenset[str], tuple, int]:
    """The first ``n_held`` rows of the stream (fewer if it is that short), the digests of the
    documents wholly in them, (digest, tokens in the head) of the packed document the head
    ends inside of, else (), and how many documents were read: document by document, only as
    many as needed."""
    column = encode["column"]
    kwargs = {k: encode[k] for k in ("tokenizer", "column", "chat", "bos", "where")}
    docs: list[list[int]] = []
    digests: set[str] = set()
    cut: tuple = ()
    need, have = (n_held * args.seq_len if args.packing else n_held), 0
    i = -1
    for i, row in enumerate(raw):
        digest = _digest(row[column])
        new = _documents([row[column]], [i], **kwargs)
        docs += new
        used = need - have
        have += sum(map(len, new)) if args.packing else len(new)
        if args.packing and have > need and digest not in digests:
            cut = (digest, used)  # its first `used` tokens end the head; the rest trains
        else:
            digests.add(digest)
        if have >= need:
            break
    rows = _rows(docs, tokenizer=encode["tokenizer"], seq_len=args.seq_len, packing=args.packing)
    head = [dict(zip(rows, values)) for values in zip(*rows.values())][:n_held]
    return head, frozenset(digests), cut, i + 1


def _split_parts(splits: Mapping[str, Any], spec: str, flag: str) -> list | None:
    """A split or split slice's parts as datasets reads them (``to_absolute``: a split name and
    a row range each); None where it names no split of ``splits``. Refused in one line: a
    malformed slice, and a slice of a stream (its rows are not counted)."""
    import datasets  # noqa: PLC0415 - as the loaders: imported when data is read

    try:
        instruction = datasets.ReadInstruction.from_spec(spec)
    except ValueError as e:
        raise DataError(f"{flag} {spec!r} is not a split or a split slice: {e}") from None
    names = {part.split("[", 1)[0].strip() for part in spec.split("+")}
    if not names <= set(splits):
        return None
    if any(isinstance(splits[n], datasets.IterableDataset) for n in names):
        if "[" not in spec:
            return None  # (a whole streamed split: nothing to count)
        raise DataError(
            f"{flag} {spec!r}: a split slice needs the rows counted, which --streaming does not "
            "do; name a whole split, or drop --streaming"
        )
    return instruction.to_absolute({n: len(splits[n]) for n in names})


def _split_slice(splits: Mapping[str, Any], spec: str, flag: str) -> datasets.Dataset | None:
    """The rows of a split slice as ``datasets.load_dataset`` reads one (``train[:90%]``,
    ``train[-1000:]``, ``train[:10%]+validation``); None where it names no split of ``splits``
    (the caller says which there are)."""
    import datasets  # noqa: PLC0415

    parts = _split_parts(splits, spec, flag)
    if parts is None:
        return None
    # (An empty range: datasets' select of one past the end raises.)
    rows = [splits[p.splitname].select(range(p.from_, p.to)) for p in parts if p.to > p.from_]
    if not rows:  # (found by an audit: a traceback from datasets' select)
        held = sorted({(p.splitname, len(splits[p.splitname])) for p in parts})
        said = ", ".join(f"{n!r} has {k} rows" for n, k in held)
        raise DataError(f"{flag} {spec!r} selects no rows ({said})")
    return rows[0] if len(rows) == 1 else datasets.concatenate_datasets(rows)


def _refuse_overlapping_slices(splits: Mapping[str, Any], train: str, evaluate: str | None) -> None:
    """Refuse a train and an eval split of which one is a slice and both take rows of one split
    (``train`` and ``train[-10%:]``, ``train[:50%]`` and ``train[40%:]``): the evaluation would
    score rows trained on (found by an audit: accepted silently). Equal names are held out
    instead (``load_training_data``)."""
    if evaluate is None or evaluate == train or "[" not in train + evaluate:
        return
    a = _split_parts(splits, train, "--dataset_train_split") or []
    b = _split_parts(splits, evaluate, "--dataset_eval_split") or []
    shared = sorted(
        (x.splitname, max(x.from_, y.from_), min(x.to, y.to))
        for x in a
        for y in b
        if x.splitname == y.splitname and min(x.to, y.to) > max(x.from_, y.from_)
    )
    if shared:
        name, first, last = shared[0]
        n = sum(hi - lo for _, lo, hi in shared)
        more = " ..." if len(shared) > 1 else ""
        raise DataError(
            f"--dataset_train_split {train!r} and --dataset_eval_split {evaluate!r} share {n} "
            f"rows of {name!r} (rows {first}-{last - 1}{more}): the evaluation would score rows "
            f"trained on. Give slices that do not overlap, e.g. {name}[:90%] and {name}[90%:]"
        )


def _check_args(args: DataArguments) -> None:
    if args.seq_len < 1:
        raise DataError(f"--seq_len must be at least 1, not {args.seq_len}")
    if not 0 <= args.eval_fraction < 1:
        raise DataError(f"--eval_fraction must be in [0, 1), not {args.eval_fraction}")
    if args.max_eval_sequences < 0:
        raise DataError(f"--max_eval_sequences must be 0 or more, not {args.max_eval_sequences}")
    if args.shuffle_buffer < 0:
        raise DataError(f"--shuffle_buffer must be 0 or more, not {args.shuffle_buffer}")


def _too_little(args: DataArguments) -> DataError:
    if not args.packing:  # every non-empty document makes a row: there were none
        return DataError("no text to train on: every document is empty")
    return DataError(
        f"not enough text for one sequence of {args.seq_len} tokens (the documents hold fewer "
        "in all): lower --seq_len or add data"
    )


def _one_row(args: DataArguments) -> DataError:
    """One row, and a train and an eval row are needed."""
    if args.packing:
        return DataError(
            f"not enough data: 1 sequence of {args.seq_len} tokens, need at least 2 for a train "
            "and an eval row: lower --seq_len, add data, or set --eval_fraction 0"
        )
    # Without packing a row is one document, whatever --seq_len is: lowering it cannot help.
    return DataError(
        "not enough data: --no_packing makes one row per document and the data has 1 non-empty "
        f"document, need 2 for a train and an eval row: {_more_rows(args)}, or set "
        "--eval_fraction 0"
    )


def _more_rows(args: DataArguments) -> str:
    """What gives more rows. Without packing a row is one document, whatever --seq_len is."""
    if args.packing:
        return "lower --seq_len or add data"
    return f"add documents, drop --no_packing to pack the text into {args.seq_len}-token rows"


def load_splits(args: DataArguments) -> dict[str, Any]:
    """Every split of the named data (a DatasetDict, or an IterableDatasetDict when streaming)."""
    from datasets import load_dataset  # noqa: PLC0415

    name = args.dataset_name
    path = Path(name).expanduser() if name else DEFAULT_CORPUS
    if name is None or path.exists():
        if args.dataset_config:
            raise DataError(
                f"--dataset_config {args.dataset_config} names a configuration of a Hub "
                f"dataset, but --dataset_name {name or '(the bundled corpus)'} is local files: drop it"
            )
        builder, files = _local_files(path)
        # One row per text file, as text.read_texts: documents are packed (or padded) whole.
        extra = {"sample_by": "document"} if builder == "text" else {}
        what = str(path) if name else "the bundled corpus"
        with _reading(what):
            splits = load_dataset(
                builder,
                data_files={split: [str(f) for f in fs] for split, fs in files.items()},
                streaming=args.streaming,
                **extra,
            )
    else:
        if _looks_local(name):
            raise DataError(f"data not found: {name} (--dataset_name)")
        unreachable = hub_unreachable()
        try:
            with _offline_datasets(unreachable is not None):
                splits = load_dataset(name, args.dataset_config, streaming=args.streaming)
        except ConnectionError as e:  # offline (HF_HUB_OFFLINE / no network) and not cached
            why = unreachable or _one_line(e)
            raise DataError(
                f"could not load the dataset {name!r} from the Hub or the local cache "
                f"({why}): run once with network access so that datasets caches it, or "
                "pass a local file or folder as --dataset_name"
            ) from None
        except Exception as e:  # not found, gated, missing config, ...
            raise DataError(
                f"could not load the dataset {name!r}: {_one_line(e)} (--dataset_name, "
                "--dataset_config)"
            ) from None
    return dict(splits)


def _looks_local(name: str) -> bool:
    """Whether a --dataset_name that does not exist meant a local path, not a Hub id: a path
    prefix (./ ../ / ~), a folder's trailing slash, a backslash or a data file suffix (as
    hf.hub.looks_like_repo_id tells a model folder from a repo id)."""
    return (
        name.startswith((".", "/", "~"))
        or name.endswith(("/", os.sep))
        or "\\" in name
        or ".." in name
        or Path(name).suffix.lower() in BUILDERS
    )


#: Seconds to wait for a connection to the Hub before loading a Hub dataset as offline.
HUB_CONNECT_TIMEOUT = 3.0
_PROXY_VARIABLES = ("https_proxy", "http_proxy", "all_proxy")  # either case


def hub_unreachable() -> str | None:
    """Why the Hub cannot be reached (one TCP connection, a few seconds at most), else None.

    Without a network, datasets retries each request with backoff (~30 s) before it reads its
    cache or fails. Not checked in offline mode (nothing to wait for) or behind a proxy (a
    direct connection says nothing about the proxied one).
    """
    from urllib.parse import urlsplit  # noqa: PLC0415

    from datasets import config  # noqa: PLC0415

    proxied = any(os.environ.get(v) or os.environ.get(v.upper()) for v in _PROXY_VARIABLES)
    if config.HF_HUB_OFFLINE or proxied:
        return None
    url = urlsplit(config.HF_ENDPOINT)
    if not url.hostname:
        return None
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname, port), timeout=HUB_CONNECT_TIMEOUT).close()
    except OSError as e:
        return f"the Hub at {config.HF_ENDPOINT} cannot be reached: {e.strerror or e}"
    return None


@contextmanager
def _offline_datasets(offline: bool) -> Iterator[None]:
    """datasets in offline mode (what HF_HUB_OFFLINE=1 sets) for one load: it reads its cache
    at once instead of retrying an unreachable Hub."""
    from datasets import config  # noqa: PLC0415

    before = config.HF_HUB_OFFLINE
    config.HF_HUB_OFFLINE = before or offline
    try:
        yield
    finally:
        config.HF_HUB_OFFLINE = before


def _local_files(path: Path) -> tuple[str, dict[str, list[Path]]]:
    """The builder and the files of each split of a local file (all train) or folder.

    A folder's splits are what ``datasets.load_dataset(folder)`` infers from file and folder
    names (train.jsonl / validation.jsonl, data/train-*.parquet, ...; else all train), so held-out
    files are never trained on. Its files must be of one kind; documentation (README.md) next to
    non-text data files is not data.
    """
    if path.is_file():
        splits = {"train": [path]}
    else:
        from datasets.data_files import DataFilesDict, get_data_patterns  # noqa: PLC0415

        base = str(path.resolve())
        try:
            patterns = get_data_patterns(base)
        except FileNotFoundError:  # no file at all, hidden ones aside
            patterns = {}
        found = DataFilesDict.from_patterns(patterns, base_path=base) if patterns else {}
        # datasets leaves out hidden files and folders (.git, .cache); unknown kinds are no data.
        splits = {
            str(split): [Path(f) for f in fs if Path(f).suffix.lower() in BUILDERS]
            for split, fs in found.items()
        }
        if any(BUILDERS[f.suffix.lower()] != "text" for fs in splits.values() for f in fs):
            splits = {
                k: [f for f in fs if f.suffix.lower() not in DOC_SUFFIXES]
                for k, fs in splits.items()
            }
        splits = {k: fs for k, fs in splits.items() if fs}
        if not splits:
            raise DataError(f"no data files ({', '.join(BUILDERS)}) under {path} (--dataset_name)")
    files = [f for fs in splits.values() for f in fs]
    kinds = {BUILDERS.get(f.suffix.lower()) for f in files}
    if None in kinds:
        raise DataError(
            f"{path}: unknown file type {path.suffix!r}; --dataset_name takes "
            f"{', '.join(BUILDERS)} files, a folder of them, or a Hub dataset id"
        )
    if len(kinds) > 1:
        raise DataError(
            f"{path} mixes {' and '.join(sorted(kinds))} files: point --dataset_name at one kind"
        )
    if all(f.stat().st_size == 0 for f in files):
        raise DataError(f"{path} is empty: no data (--dataset_name)")
    return kinds.pop(), splits


def _encoder(
    ds: datasets.Dataset | datasets.IterableDataset, args: DataArguments, tokenizer, where: str
) -> tuple[dict[str, Any], list[str]]:
    """``_encode``'s keyword arguments for ``ds`` (which column, chat or not) and its columns."""
    columns = ds.column_names
    if columns is None:  # a stream without declared features: look at its first row
        first = next(iter(ds.take(1)), None)
        if first is None:
            raise DataError(f"{where} has no rows: the data is empty")
        columns = list(first)
    named = args.dataset_text_field != DataArguments.dataset_text_field  # given, not the default
    if named and args.dataset_text_field not in columns:
        raise DataError(
            f"{where} has no column {args.dataset_text_field!r} (--dataset_text_field); its "
            f"columns: {', '.join(columns)}"
        )
    if args.dataset_text_field in columns:
        column, chat = args.dataset_text_field, False
    elif args.dataset_messages_field in columns:
        column, chat = args.dataset_messages_field, True
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where} has chat rows (column {column!r}) but the tokenizer has no chat "
                "template: use a tokenizer with one, or a text column (--dataset_text_field)"
            )
    else:
        raise DataError(
            f"{where} has no column {args.dataset_text_field!r} (text) or "
            f"{args.dataset_messages_field!r} (chat); its columns: {', '.join(columns)}. "
            "Choose one with --dataset_text_field or --dataset_messages_field"
        )
    kwargs = dict(
        tokenizer=tokenizer,
        column=column,
        chat=chat,
        seq_len=args.seq_len,
        packing=args.packing,
        bos=bos_token_id(tokenizer),
        where=where,
    )
    _check_first_rows(ds, column, chat, where)
    return kwargs, columns


def _check_first_rows(
    ds: datasets.Dataset | datasets.IterableDataset, column: str, chat: bool, where: str
) -> None:
    """A column of the wrong kind (or chat turns of another format) fails here, before any
    training, with the flag to change; one bad row later on fails as itself, in _documents."""
    from datasets import Dataset  # noqa: PLC0415

    n = min(len(ds), FIRST_ROWS) if isinstance(ds, Dataset) else FIRST_ROWS
    values = [row[column] for row in ds.take(n)]
    if chat:
        for i, conv in enumerate(values):
            _chat_turns(conv, i, column, where)
        return
    values = [v for v in values if v is not None]
    if values and not any(isinstance(v, str) for v in values):
        raise DataError(
            f"{where}: column {column!r} holds {type(values[0]).__name__}, not text: choose the "
            "text column with --dataset_text_field"
        )


def _packed(ds, encode: dict[str, Any], columns: list[str], **kwargs: Any):
    """``ds`` tokenized and packed into rows by ``_encode`` (batched, with row indices), its
    source ``columns`` dropped; ``kwargs`` to ``map`` (a Dataset's ``desc``)."""
    return ds.map(
        _encode,
        batched=True,
        batch_size=PACK_BATCH,
        remove_columns=columns,
        fn_kwargs=encode,
        with_indices=True,
        **kwargs,
    )


def _eval_split_rows(
    ds: datasets.Dataset | datasets.IterableDataset, args: DataArguments, tokenizer, where: str
) -> datasets.Dataset:
    """The first ``max_eval_sequences`` rows of an eval split, materialized."""
    encode, columns = _encoder(ds, args, tokenizer, where)
    if not args.streaming:
        ds = ds.to_iterable_dataset()  # lazily: only the documents that the head needs
    rows = _packed(ds, encode, columns)
    head = list(rows.take(args.max_eval_sequences))
    if not head:
        raise DataError(
            f"{where} has too little text for one sequence of {args.seq_len} tokens: choose "
            "another split with --dataset_eval_split, or set --max_eval_sequences 0"
        )
    return _rows_dataset(head)


def _rows_dataset(rows: list[dict]) -> datasets.Dataset:
    from datasets import Dataset  # noqa: PLC0415

    return Dataset.from_list(rows).with_format("torch")


def _encode(
    batch: dict[str, list],
    indices: list[int],
    *,
    tokenizer,
    column: str,
    chat: bool,
    seq_len: int,
    packing: bool,
    bos: int | None,
    where: str,
    exclude: frozenset[str] = frozenset(),
    cut: tuple = (),
) -> dict[str, list[np.ndarray]]:
    """A batch of documents (rows ``indices`` of the data) -> training rows, documents whose
    :func:`_digest` is in ``exclude`` left out, the first ``cut[1]`` tokens of the one whose
    digest is ``cut[0]`` too. A module-level function of its arguments only, so
    the datasets cache recognizes it (fingerprint) across runs."""
    docs = _documents(
        batch[column], indices, tokenizer=tokenizer, column=column, chat=chat, bos=bos,
        where=where, exclude=exclude, cut=cut,
    )  # fmt: skip
    return _rows(docs, tokenizer=tokenizer, seq_len=seq_len, packing=packing)


def _documents(
    values: list,
    indices: list[int],
    *,
    tokenizer,
    column: str,
    chat: bool,
    bos: int | None,
    where: str,
    exclude: frozenset[str] = frozenset(),
    cut: tuple = (),
) -> list[list[int]]:
    """Token ids of each non-empty document of ``values`` (chats rendered with the template);
    those whose digest is in ``exclude`` left out, the first ``cut[1]`` tokens of ``cut[0]``'s."""
    texts, skips = [], []
    for i, doc in zip(indices, values):
        digest = _digest(doc) if exclude or cut else None
        if digest is not None and digest in exclude:
            continue
        if chat:
            turns = _chat_turns(doc, i, column, where)
            if not turns:  # an empty conversation: nothing to learn (counted in the banner)
                continue
            doc = tokenizer.apply_chat_template(turns, tokenize=False)
        elif doc is not None and not isinstance(doc, str):
            raise DataError(
                f"{where}: row {i} (from 0) of column {column!r} holds {type(doc).__name__} "
                f"{_short(doc)}, not text: fix or drop that row"
            )
        if doc and doc.strip():
            texts.append(doc)
            skips.append(cut[1] if cut and digest == cut[0] else 0)
    tokens = _tokenize(tokenizer, texts, bos)
    return [ids[skip:] if skip else ids for ids, skip in zip(tokens, skips)]


def _rows(
    docs: list[list[int]], *, tokenizer, seq_len: int, packing: bool
) -> dict[str, list[np.ndarray]]:
    """Documents' token ids -> training rows: packed, or one padded row per document.

    Rows are int32 arrays of their own (not views of the batch: a streamed shuffle buffer would
    keep whole batches alive), labels the same array as input_ids when packing: a buffer of
    10,000 rows of 4,096 tokens holds 160 MB (Python int lists: ~3 GB). The torch format makes
    them int64 tensors.
    """
    if packing:
        # As text.build_chunks: documents joined (each ends in EOS), cut into seq_len blocks.
        stream = np.fromiter(chain.from_iterable(docs), dtype=np.int32)
        blocks = [b.copy() for b in stream[: len(stream) // seq_len * seq_len].reshape(-1, seq_len)]
        return {"input_ids": blocks, "labels": blocks}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    out: dict[str, list[np.ndarray]] = {"input_ids": [], "labels": [], "attention_mask": []}
    for ids in docs:
        row = np.asarray(ids[:seq_len], dtype=np.int32)
        fill = (0, seq_len - len(row))
        out["input_ids"].append(np.pad(row, fill, constant_values=pad))
        out["labels"].append(np.pad(row, fill, constant_values=-100))  # no loss on padding
        out["attention_mask"].append(np.pad(np.ones_like(row), fill))
    return out


def _chat_turns(conv: Any, i: int, column: str, where: str) -> list[dict] | None:
    """A conversation as the turns a chat template takes ({'role', 'content'} dicts with text
    content), or None when it is empty. Content given as text parts ([{'type': 'text', 'text':
    ...}], the multimodal layout) is joined, as the templates that take parts render it."""
    if not conv:
        return None
    row = f"{where}: row {i} (from 0) of column {column!r}"
    fix = "choose the chat column with --dataset_messages_field"
    if not isinstance(conv, list):
        raise DataError(
            f"{row} holds {type(conv).__name__} {_short(conv)}, not a list of chat turns "
            f"({{'role', 'content'}} dicts): {fix}, or a text column with --dataset_text_field"
        )
    turns = []
    for j, turn in enumerate(conv):
        if not isinstance(turn, dict):
            raise DataError(
                f"{row}: turn {j} is {type(turn).__name__} {_short(turn)}, not a "
                f"{{'role', 'content'}} dict: {fix}"
            )
        # (datasets gives every turn of a column every key seen: absent ones are None)
        if turn.get("role") is None and isinstance(turn.get("from"), str) and "value" in turn:
            raise DataError(
                f"{where}: column {column!r} holds ShareGPT-style turns {{'from', 'value'}} (row "
                f"{i}), not the {{'role', 'content'}} turns that chat templates take: convert "
                "them (from -> role, with human -> user and gpt -> assistant; value -> content), "
                f"or {fix}"
            )
        role, content = turn.get("role"), turn.get("content")
        if not isinstance(role, str):
            keys = ", ".join(sorted(map(str, turn)))
            raise DataError(
                f"{row}: turn {j} has no text 'role' (its keys: {keys}); chat templates take "
                f"{{'role', 'content'}} turns: {fix}"
            )
        if isinstance(content, list):
            texts = [p.get("text") for p in content if isinstance(p, dict)]
            if len(texts) != len(content) or not all(
                p.get("type") == "text" and isinstance(t, str) for p, t in zip(content, texts)
            ):
                raise DataError(
                    f"{row}: turn {j} ({role}) holds content parts other than text "
                    f"({_short(content)}): only text turns can be trained on"
                )
            turn = {**turn, "content": "".join(texts)}
        elif content is None and turn.get("tool_calls"):
            pass  # an assistant's tool call: the template renders it
        elif not isinstance(content, str):
            raise DataError(
                f"{row}: turn {j} ({role}) holds content {_short(content)}, not text: fix or "
                "drop that row"
            )
        turns.append(turn)
    return turns


def _empty_conversations(ds: datasets.Dataset, column: str) -> int:
    """How many rows of a chat column are empty (null or no turns): skipped, not an error.
    Counted on the Arrow column, without reading the rows into Python."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    values = ds.with_format("arrow")[column]
    if not (pa.types.is_list(values.type) or pa.types.is_large_list(values.type)):
        return 0
    lengths = pc.fill_null(pc.list_value_length(values), 0)
    return len(values) - pc.count(pc.filter(lengths, pc.greater(lengths, 0))).as_py()


def _empty_texts(ds: datasets.Dataset, column: str) -> int:
    """How many rows of a text column hold no text (null, or only whitespace): skipped, not an
    error. Counted on the Arrow column."""
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.compute as pc  # noqa: PLC0415

    values = ds.with_format("arrow")[column]
    if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
        return values.null_count
    chunks = values.chunks if isinstance(values, pa.ChunkedArray) else [values]
    blank = 0
    for chunk in chunks:  # (a trimmed copy of one chunk at a time, not of the whole column)
        blank += (
            pc.sum(pc.fill_null(pc.equal(pc.utf8_trim_whitespace(chunk), ""), True)).as_py() or 0
        )
    return blank


def _digest(value: Any) -> str:
    """A document's identity across processes (Python's hash() is salted per process)."""
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _tokenize(tokenizer, texts: list[str], bos: int | None = None) -> list[list[int]]:
    """Token ids of each text, ``bos`` (text.bos_token_id) first unless the text starts with it,
    EOS appended; long texts go in paragraph pieces (the same tokens as text.build_chunks: pieces
    split after a blank line, where BPE pre-tokenization splits)."""
    pieces, owner = [], []
    for d, text in enumerate(texts):
        paras = text.split("\n\n")
        for i in range(0, len(paras), PIECE_PARAGRAPHS):
            last = i + PIECE_PARAGRAPHS >= len(paras)
            pieces.append("\n\n".join(paras[i : i + PIECE_PARAGRAPHS]) + ("" if last else "\n\n"))
            owner.append(d)
    enc = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"] if pieces else []
    docs: list[list[int]] = [[] for _ in texts]
    for d, ids in zip(owner, enc):
        docs[d].extend(ids)
    for ids in docs:
        if bos is not None and ids[:1] != [bos]:  # a rendered chat may start with its BOS
            ids.insert(0, bos)
        if tokenizer.eos_token_id is not None:
            ids.append(tokenizer.eos_token_id)
    return docs


def _one_line(e: BaseException) -> str:
    """The exception and its causes (datasets wraps a parse error in a generic one), one line."""
    parts = []
    while e is not None and len(parts) < 3:
        parts.append(f"{type(e).__name__}: {e}")
        e = e.__cause__
    msg = " ".join(" <- ".join(parts).split())
    return msg if len(msg) <= 400 else msg[:397] + "..."


@contextmanager
def _reading(what: str) -> Iterator[None]:
    """Files that fail to parse or decode, a stream that fails to open: one DataError line.
    (datasets' JSON loader logs its own line for a bad row first, numbered within a read
    block: silenced here, the error names the file's line.)"""
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)
    try:
        yield
    except DataError:
        raise
    except Exception as e:
        message = _one_line(e)
        if "JSON parse error" in message:  # (pyarrow's row is counted within a read block)
            message = _first_bad_json_line(what) or message
        raise DataError(f"could not read {what}: {message}") from None
    finally:
        json_log.setLevel(level)


def _first_bad_json_line(what: str) -> str | None:
    """Where the first line that is not JSON is, in the JSON-lines files of ``what`` (a local
    file or folder, as the messages name it: "path (split ...)"); None where none is found."""
    import gzip  # noqa: PLC0415

    path = Path(what.split(" (split ")[0]).expanduser()
    files = [path] if path.is_file() else sorted(path.rglob("*")) if path.is_dir() else []
    for file in files:
        if not file.name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
            continue
        opener = gzip.open if file.name.endswith(".gz") else open
        with opener(file, "rt", encoding="utf-8", errors="replace") as lines:
            for number, line in enumerate(lines, 1):
                if not line.strip():
                    continue
                if number == 1 and not line.lstrip().startswith("{"):
                    break  # (one JSON document, not JSON lines: pyarrow's message stands)
                try:
                    if not isinstance(json.loads(line), dict):
                        raise ValueError("not an object")
                except ValueError as e:
                    where = "" if file == path else f"{file}, "  # (the folder's file)
                    return f"{where}line {number} is not JSON ({e}): fix or drop that line"
    return None


__all__ = [
    "DataArguments",
    "TrainingData",
    "hub_unreachable",
    "load_splits",
    "load_training_data",
]
