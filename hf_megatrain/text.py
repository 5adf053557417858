"""Text data and tokenizers: the bundled defaults and plain-text corpora cut into training rows.

The public surface that ``hf-megatrain train``, the recipes and the benchmarks share. Problems
with the user's data raise :class:`DataError` (a ``ValueError``) with a one-line message.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent / "data"
#: The embedded default model: a ~3M-parameter Llama-style config.
DEFAULT_CONFIG = DATA_DIR / "config.json"
#: Bundled English text (public-domain documentation prose).
DEFAULT_CORPUS = DATA_DIR / "corpus.txt"
#: A 4,096-token byte-level BPE tokenizer trained on the bundled corpus.
DEFAULT_TOKENIZER = DATA_DIR / "tokenizer.json"
TEXT_SUFFIXES = (".txt", ".md", ".rst", ".text")


class DataError(ValueError):
    """The data or tokenizer the user pointed at cannot be used; the message says why."""


# A bare tokenizer.json names no EOS or pad token: the usual names, when its vocabulary has them.
EOS_NAMES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>")
PAD_NAMES = ("<|pad|>", "<pad>")


def load_tokenizer(path: str | Path | None = None):
    """A tokenizer from a ``tokenizer.json`` file or a tokenizer folder; None: the bundled one.

    It always has an EOS token (documents are joined with it) and a pad token (the EOS when the
    tokenizer has none: training never pads, generation needs one).
    """
    from transformers import AutoTokenizer, PreTrainedTokenizerFast  # noqa: PLC0415

    p = Path(path) if path is not None else DEFAULT_TOKENIZER
    if not p.exists():
        raise DataError(f"tokenizer not found: {p}")
    if p.is_file():
        try:
            specials = _file_special_tokens(p)
            tok = PreTrainedTokenizerFast(tokenizer_file=str(p), **specials)
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises a bare Exception
            raise DataError(
                f"could not load a tokenizer from {p} (a tokenizer.json file or a tokenizer "
                f"folder is expected): {e}"
            ) from None
        tok.model_max_length = 1 << 30  # packed chunks set the length, not the tokenizer
    else:
        try:
            tok = AutoTokenizer.from_pretrained(str(p), local_files_only=True)
        except (OSError, ValueError) as e:
            raise DataError(f"could not load a tokenizer from {p}: {e}") from None
    if tok.eos_token_id is None:
        raise DataError("the tokenizer has no EOS token (needed between documents)")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def _file_special_tokens(path: Path) -> dict[str, str]:
    """The EOS, pad and BOS tokens of a bare tokenizer.json (its tokenizer_config.json, which
    names them, is not there): EOS and pad by their usual names when the vocabulary has them
    (a name it lacks would become a new id past the model's vocabulary), BOS the token its
    post-processor puts before a text."""
    from tokenizers import Tokenizer  # noqa: PLC0415

    raw = Tokenizer.from_file(str(path))
    eos = next((n for n in EOS_NAMES if raw.token_to_id(n) is not None), None)
    if eos is None:
        raise DataError(
            f"the tokenizer file {path} has no EOS token of a usual name ({', '.join(EOS_NAMES)}) "
            "and names none itself: pass its tokenizer folder (with the tokenizer_config.json "
            "that names eos_token) instead"
        )
    out = {"eos_token": eos}
    pad = next((n for n in PAD_NAMES if raw.token_to_id(n) is not None), None)
    if pad is not None:
        out["pad_token"] = pad
    with_specials = raw.encode("x").ids
    plain = raw.encode("x", add_special_tokens=False).ids
    if len(with_specials) > len(plain) and with_specials[1 : len(plain) + 1] == plain:
        out["bos_token"] = raw.id_to_token(with_specials[0])
    return out


def bos_token_id(tokenizer) -> int | None:
    """The BOS id that ``tokenizer(text)`` puts before a text (Llama, Gemma, Mistral), None when
    it puts none (GPT-2, Qwen): documents start with it as they do in run_clm and TRL, while
    tokenizing with add_special_tokens=False (long texts go in pieces)."""
    bos = tokenizer.bos_token_id
    if bos is None:
        return None
    with_specials = tokenizer("x")["input_ids"]
    plain = tokenizer("x", add_special_tokens=False)["input_ids"]
    if with_specials[:1] == [bos] and plain[:1] != [bos]:
        return bos
    return None


def has_tokenizer_files(folder: str | Path) -> bool:
    """Whether a model folder carries its own tokenizer."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return any((Path(folder) / n).exists() for n in names)


def read_texts(path: str | Path | None = None) -> list[tuple[str, str]]:
    """(name, text) of every document: one file, or every text file under a folder; None: the
    bundled corpus."""
    if path is None:
        return [(DEFAULT_CORPUS.name, DEFAULT_CORPUS.read_text(encoding="utf-8"))]
    p = Path(path)
    if not p.exists():
        raise DataError(f"data not found: {path}")
    files = (
        [p]
        if p.is_file()
        else sorted(f for f in p.rglob("*") if f.is_file() and f.suffix.lower() in TEXT_SUFFIXES)
    )
    if not files:
        raise DataError(f"no text files ({', '.join(TEXT_SUFFIXES)}) under {path}")
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{f} is not UTF-8 text") from None
        if text.strip():
            docs.append((str(f), text))
    if not docs:
        raise DataError(f"the data under {path} is empty")
    return docs


def build_chunks(tokenizer, docs: list[tuple[str, str]], seq_len: int) -> list[list[int]]:
    """Tokenize, join documents with EOS, cut into ``seq_len`` blocks (the remainder dropped).
    Each document starts with the tokenizer's BOS when ``tokenizer(text)`` adds one.

    Packing without document masking lets attention cross document boundaries; for pretraining on
    a text corpus that is the usual trade against padding waste.
    """
    eos, bos = tokenizer.eos_token_id, bos_token_id(tokenizer)
    stream: list[int] = []
    for _, text in docs:
        # Paragraph batches keep every call small (fast tokenizers parallelize over the batch).
        paras = text.split("\n\n")
        pieces = ["\n\n".join(paras[i : i + 64]) for i in range(0, len(paras), 64)]
        pieces = [pc + "\n\n" for pc in pieces[:-1]] + pieces[-1:]
        enc = tokenizer(pieces, add_special_tokens=False, verbose=False)["input_ids"]
        if bos is not None and enc[0][:1] != [bos]:  # a text may start with the BOS text
            stream.append(bos)
        for ids in enc:
            stream.extend(ids)
        if eos is not None:
            stream.append(eos)
    n = len(stream) // seq_len
    return [stream[i * seq_len : (i + 1) * seq_len] for i in range(n)]


def split_chunks(
    chunks: list[list[int]], eval_fraction: float, seed: int
) -> tuple[list[dict], list[dict]]:
    """Shuffle (seeded) and split into (train rows, eval rows) of ``input_ids`` and ``labels``."""
    import torch  # noqa: PLC0415

    if len(chunks) < 2 and eval_fraction > 0:
        raise DataError(
            f"not enough data: {len(chunks)} sequence(s) of this length; need at least 2 "
            "(lower --seq-len, add data, or set --eval-fraction 0)"
        )
    if not chunks:
        raise DataError("not enough data for one sequence: lower --seq-len or add data")
    order = torch.randperm(len(chunks), generator=torch.Generator().manual_seed(seed)).tolist()
    n_eval = 0 if eval_fraction == 0 else max(1, round(len(chunks) * eval_fraction))
    n_eval = min(n_eval, len(chunks) - 1)

    def rows(idx: list[int]) -> list[dict]:
        out = []
        for i in sorted(idx):
            ids = torch.tensor(chunks[i], dtype=torch.long)
            out.append({"input_ids": ids, "labels": ids.clone()})
        return out

    return rows(order[n_eval:]), rows(order[:n_eval])


def use_bf16(precision: str | None = "auto") -> bool:
    """Whether to compute in bf16: "auto" on a bf16-capable GPU (CPU autocast to bf16 is slower
    than fp32 on most CPUs), else as asked ("bf16" / "fp32")."""
    import torch  # noqa: PLC0415

    precision = precision or "auto"
    if precision == "auto":
        return torch.cuda.is_available() and torch.cuda.is_bf16_supported()
    return precision == "bf16"


__all__ = [
    "DATA_DIR",
    "DEFAULT_CONFIG",
    "DEFAULT_CORPUS",
    "DEFAULT_TOKENIZER",
    "DataError",
    "bos_token_id",
    "build_chunks",
    "has_tokenizer_files",
    "load_tokenizer",
    "read_texts",
    "split_chunks",
    "use_bf16",
]
