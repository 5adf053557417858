"""Rebuild the bundled corpus and tokenizer (run once by a maintainer; the outputs are committed).

    python3 hf_megatrain/data/build_bundle.py

Writes, next to this file:
  corpus.txt      English prose from the Python documentation shipped inside CPython
                  (``Lib/pydoc_data/topics.py``: the Language Reference topics behind ``help()``),
                  at most ~300 KB, cut at topic boundaries.
  tokenizer.json  a byte-level BPE tokenizer trained on corpus.txt with the ``tokenizers`` library.

The exact bytes depend on the CPython version that runs this (3.11.7 for the committed files).
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAX_BYTES = 295_000
VOCAB_SIZE = 4096
SPECIAL_TOKENS = ["<|endoftext|>", "<|pad|>"]


def build_corpus() -> str:
    import pydoc_data.topics as topics  # noqa: PLC0415 - CPython's own documentation text

    parts: list[str] = []
    size = 0
    # Sorted topic names make the selection independent of dict order across versions.
    for name in sorted(topics.topics):
        text = topics.topics[name].strip().replace("\r\n", "\n")
        n = len(text.encode("utf-8")) + 2
        if size + n > MAX_BYTES:
            continue  # a smaller later topic may still fit
        parts.append(text)
        size += n
    return "\n\n".join(parts) + "\n"


def train_tokenizer(corpus_path: Path, out_path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # noqa: PLC0415

    tok = Tokenizer(models.BPE(unk_token=None))
    # Byte-level: every string encodes (no <unk>), so user data outside the corpus still works.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(corpus_path)], trainer)
    tok.save(str(out_path))


def main() -> None:
    corpus = build_corpus()
    corpus_path = HERE / "corpus.txt"
    corpus_path.write_text(corpus, encoding="utf-8")
    train_tokenizer(corpus_path, HERE / "tokenizer.json")
    print(
        f"corpus.txt: {len(corpus.encode())} bytes from CPython {sys.version.split()[0]}; "
        f"tokenizer.json: vocab {VOCAB_SIZE}"
    )


if __name__ == "__main__":
    main()
