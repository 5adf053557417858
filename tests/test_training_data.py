"""hf_megatrain.training_data: local files and streams through datasets, packed or padded rows,
seeded splits, and one-line errors for the user's mistakes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
import torch
from transformers import default_data_collator

from hf_megatrain import HFMegaTrainer, MegaTrainArguments
from hf_megatrain.text import DataError, build_chunks, load_tokenizer, read_texts
from hf_megatrain.training_data import DataArguments, load_training_data

from .helpers import common_args, tiny_config, tiny_model

# Plain-text role headers (the bundled tokenizer has no chat template).
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] | capitalize + ':\n' + m['content'] + '\n' }}{% endfor %}"
)


def doc(i: int) -> str:
    """A short document of its own (its numbers); packed rows of several may still repeat."""
    return "".join(
        f"Document {i}, part {j}: layer {i * 7 + j} streams through the device.\n\n"
        for j in range(3)
    )


@pytest.fixture(autouse=True, scope="module")
def datasets_cache(tmp_path_factory):
    """Keep the datasets cache of these tests out of ~/.cache."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path_factory.mktemp("hf_datasets"))
        yield


@pytest.fixture
def tok():
    return load_tokenizer(None)


def jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def ids(ds) -> list[list[int]]:
    return [row["input_ids"].tolist() for row in ds]


def test_bundled_corpus_matches_build_chunks(tok):
    data = load_training_data(DataArguments(), tok, seed=0)
    # One document, one tokenize-and-pack batch, the same paragraph pieces: the same rows.
    chunks = build_chunks(tok, read_texts(None), 128)
    assert data.num_train_rows + len(data.eval) == len(chunks)
    assert sorted(ids(data.train) + ids(data.eval)) == sorted(chunks)
    assert len(data.eval) == round(len(chunks) * 0.05)
    assert data.description.startswith(f"bundled corpus: 1 document -> {data.num_train_rows:,} ")
    batch = default_data_collator([data.train[i] for i in range(4)])
    assert batch["input_ids"].shape == (4, 128) and batch["input_ids"].dtype == torch.long
    assert torch.equal(batch["input_ids"], batch["labels"])


def test_text_file_and_folder(tmp_path, tok):
    (tmp_path / "a.txt").write_text(doc(1) * 20)
    args = DataArguments(dataset_name=str(tmp_path / "a.txt"), seq_len=16, eval_fraction=0)
    data = load_training_data(args, tok)
    assert data.eval is None
    assert sorted(ids(data.train)) == sorted(build_chunks(tok, read_texts(tmp_path / "a.txt"), 16))

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    (folder / ".hidden").mkdir()
    (folder / "b.md").write_text(doc(2) * 10)
    (folder / "sub" / "c.txt").write_text(doc(3) * 10)
    (folder / ".hidden" / "d.txt").write_text(doc(4) * 10)  # not data
    (folder / "notes.log").write_text("ignored")
    data = load_training_data(DataArguments(dataset_name=str(folder), seq_len=16), tok)
    assert "2 documents" in data.description
    expected = build_chunks(tok, read_texts(folder / "b.md") + read_texts(folder / "sub"), 16)
    assert sorted(ids(data.train) + ids(data.eval)) == sorted(expected)


@pytest.mark.parametrize("kind", ["jsonl", "parquet", "csv"])
def test_tabular_files(tmp_path, tok, kind):
    rows = {"id": list(range(30)), "body": [doc(i) for i in range(30)]}
    path = tmp_path / f"data.{kind}"
    table = datasets.Dataset.from_dict(rows)
    if kind == "jsonl":
        table.to_json(path)
    else:
        getattr(table, f"to_{kind}")(path)
    args = DataArguments(dataset_name=str(path), dataset_text_field="body", seq_len=32)
    data = load_training_data(args, tok)
    text = "".join(t for t in rows["body"])
    n_tokens = len(tok(text)["input_ids"]) + 30  # plus one EOS per document
    assert data.num_train_rows + len(data.eval) == n_tokens // 32
    assert "text column 'body'" in data.description and "30 documents" in data.description
    assert set(data.train.column_names) == {"input_ids", "labels"}


def test_rows_without_text_are_counted_as_skipped(tmp_path, tok):
    """Found by an audit: rows whose text sat under another key (or was null or blank) were
    dropped silently while the banner counted them as documents."""
    path = tmp_path / "mixed.jsonl"
    rows = [{"text": doc(i)} if i % 3 else {"content": doc(i)} for i in range(30)]
    rows[1] = {"text": None}
    rows[2] = {"text": "   "}
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = load_training_data(DataArguments(dataset_name=str(path), seq_len=32), tok)
    assert "12 empty rows skipped (no text: missing, null or blank)" in data.description
    assert "18 documents" in data.description
    kept = "".join(r["text"] for r in rows if (r.get("text") or "").strip())
    n_tokens = len(tok(kept)["input_ids"]) + 18  # plus one EOS per document
    assert data.num_train_rows + len(data.eval) == n_tokens // 32


@pytest.mark.parametrize("streaming", [False, True])
def test_a_broken_json_line_is_named_by_its_line(tmp_path, tok, streaming):
    """Found by an audit: pyarrow names a parse error's row within its read block (row 407 for
    line 2,001); the error now names the file's line."""
    path = tmp_path / "data.jsonl"
    lines = [json.dumps({"text": doc(i)}) for i in range(3000)]
    lines[2000] = '{"text": "broken'
    path.write_text("\n".join(lines) + "\n")
    args = DataArguments(dataset_name=str(path), seq_len=32, streaming=streaming)
    with pytest.raises(DataError, match=f"could not read {path}.*: line 2001 is not JSON"):
        load_training_data(args, tok)


def test_chat_messages_use_the_chat_template(tmp_path, tok):
    convs = [
        {"messages": [{"role": "user", "content": f"Question {i}?"},
                      {"role": "assistant", "content": f"Answer {i}, in full."}]}
        for i in range(40)
    ]  # fmt: skip
    path = jsonl(tmp_path / "chat.jsonl", convs)
    args = DataArguments(dataset_name=str(path), seq_len=24, eval_fraction=0)
    with pytest.raises(DataError, match="no chat template.*--dataset_text_field"):
        load_training_data(args, tok)
    tok.chat_template = CHAT_TEMPLATE
    data = load_training_data(args, tok)
    assert "chat column 'messages'" in data.description
    text = tok.decode(data.train[0]["input_ids"])
    assert "User:\n" in text or "Assistant:\n" in text
    rendered = "".join(tok.apply_chat_template(c["messages"], tokenize=False) for c in convs)
    assert data.num_train_rows == (len(tok(rendered)["input_ids"]) + 40) // 24


def test_streaming_eval_from_head_disjoint_and_repeatable(tmp_path, tok):
    path = jsonl(tmp_path / "s.jsonl", [{"text": doc(i)} for i in range(60)])
    base = dict(dataset_name=str(path), streaming=True, seq_len=16, max_eval_sequences=5)
    plain = load_training_data(DataArguments(**base, shuffle_buffer=0), tok, seed=0)
    assert plain.num_train_rows is None
    assert isinstance(plain.train, datasets.IterableDataset)
    assert "head of the stream" in plain.description and "train streamed" in plain.description
    # Eval is the head of the stream (in order); train the stream after it: the documents wholly
    # in the head are left out, the one it ends inside of trains from where the head stopped.
    whole = DataArguments(**{**base, "max_eval_sequences": 0, "shuffle_buffer": 0})
    whole = load_training_data(whole, tok)
    assert len(plain.eval) == 5 and ids(plain.eval) == ids(whole.train)[:5]
    lengths = [len(tok(doc(i), add_special_tokens=False)["input_ids"]) + 1 for i in range(60)]
    assert sum(lengths[: next(k for k in range(61) if sum(lengths[:k]) >= 80)]) > 80  # one cut
    assert ids(plain.train) == ids(whole.train)[5:]

    shuffled = load_training_data(DataArguments(**base, shuffle_buffer=50), tok, seed=0)
    first = ids(shuffled.train)
    assert first == ids(shuffled.train)  # a second pass (a resume) sees the same rows
    assert sorted(first) == sorted(ids(plain.train)) and first != ids(plain.train)
    assert ids(shuffled.eval) == ids(plain.eval)  # the head is taken before the shuffle
    again = load_training_data(DataArguments(**base, shuffle_buffer=50), tok, seed=0)
    other = load_training_data(DataArguments(**base, shuffle_buffer=50), tok, seed=1)
    assert ids(again.train) == first and ids(other.train) != first
    batch = default_data_collator(list(shuffled.train.take(2)))
    assert batch["input_ids"].shape == (2, 16) and batch["labels"].dtype == torch.long


def test_a_one_document_stream_trains_after_its_eval_head(tmp_path, tok):
    """README's `--dataset_name corpus.txt --streaming`: one document, the eval head from its
    start, train the rest of it (leaving the document out whole left no train row: an error)."""
    path = tmp_path / "one.txt"
    path.write_text("".join(doc(i) for i in range(40)))
    base = dict(dataset_name=str(path), streaming=True, seq_len=16, shuffle_buffer=0)
    data = load_training_data(DataArguments(**base, max_eval_sequences=3), tok)
    whole = load_training_data(DataArguments(**base, max_eval_sequences=0), tok)
    assert ids(data.eval) == ids(whole.train)[:3] and ids(data.train) == ids(whole.train)[3:]


def test_seeded_split_is_deterministic(tmp_path, tok):
    path = jsonl(tmp_path / "d.jsonl", [{"text": doc(i)} for i in range(60)])
    args = DataArguments(dataset_name=str(path), seq_len=16, eval_fraction=0.1)
    a, b = load_training_data(args, tok, seed=3), load_training_data(args, tok, seed=3)
    c = load_training_data(args, tok, seed=4)
    assert ids(a.train) == ids(b.train) and ids(a.eval) == ids(b.eval)
    assert ids(a.eval) != ids(c.eval) and ids(a.train) != ids(c.train)
    n = a.num_train_rows + len(a.eval)
    everything = load_training_data(DataArguments(**{**vars(args), "eval_fraction": 0}), tok)
    assert sorted(ids(a.train) + ids(a.eval)) == sorted(ids(everything.train))  # disjoint
    assert len(a.eval) == round(n * 0.1)
    capped = load_training_data(DataArguments(**{**vars(args), "max_eval_sequences": 2}), tok)
    assert len(capped.eval) == 2 and capped.num_train_rows == n - 2  # the rest stays in train


def test_unpacked_rows_are_padded(tmp_path, tok):
    texts = ["Short one.", doc(1) * 5]  # one shorter than seq_len, one truncated
    path = jsonl(tmp_path / "p.jsonl", [{"text": t} for t in texts])
    args = DataArguments(dataset_name=str(path), packing=False, seq_len=12, eval_fraction=0)
    data = load_training_data(args, tok)
    assert "one padded row per document" in data.description
    rows = sorted(data.train, key=lambda r: int(r["attention_mask"].sum()))
    short, long = rows
    n = len(tok(texts[0])["input_ids"]) + 1  # + EOS
    assert short["attention_mask"].tolist() == [1] * n + [0] * (12 - n)
    assert short["input_ids"][n - 1] == tok.eos_token_id
    assert (short["input_ids"][n:] == tok.pad_token_id).all()
    assert (short["labels"][n:] == -100).all()
    assert torch.equal(short["labels"][:n], short["input_ids"][:n])
    assert long["attention_mask"].all() and torch.equal(long["labels"], long["input_ids"])
    batch = default_data_collator(rows)
    assert set(batch) == {"input_ids", "labels", "attention_mask"}


def test_eval_split_is_used_when_there(monkeypatch, tok):
    from hf_megatrain import training_data

    train = datasets.Dataset.from_dict({"text": [doc(i) for i in range(30)]})
    valid = datasets.Dataset.from_dict({"text": [doc(100 + i) for i in range(30)]})

    def load(streaming: bool, **kwargs):
        splits = {"train": train, "validation": valid}
        if streaming:
            splits = {k: v.to_iterable_dataset() for k, v in splits.items()}
        monkeypatch.setattr(training_data, "load_splits", lambda args: splits)
        args = DataArguments(dataset_name="org/name", seq_len=16, streaming=streaming, **kwargs)
        return load_training_data(args, tok)

    # The validation split in stream order, as training rows.
    split_rows = ids(load(True, dataset_train_split="validation", max_eval_sequences=0,
                          shuffle_buffer=0).train)  # fmt: skip
    assert len(split_rows) > 64
    for streaming in (False, True):
        data = load(streaming)
        assert "(split 'validation')" in data.description
        assert ids(data.eval) == split_rows[:64]  # the head of the split, in order
    # Nothing is held out of train.
    assert load(False).num_train_rows == load(False, max_eval_sequences=0).num_train_rows
    with pytest.raises(DataError, match="no split 'dev'.*--dataset_eval_split"):
        load(False, dataset_eval_split="dev")


def errors(tmp_path: Path, tok) -> list[tuple[dict, str]]:
    (tmp_path / "data.xml").write_text("<a/>")
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "empty.jsonl").write_text("")
    # Rows, every one without text (packed, this blamed --seq_len).
    jsonl(tmp_path / "blank.jsonl", [{"text": ""}, {"text": "  "}, {"text": None}])
    (tmp_path / "tiny.txt").write_text("Too short.")
    jsonl(tmp_path / "cols.jsonl", [{"title": "t", "body": doc(1)}])
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (tmp_path / "mixed").mkdir()
    (tmp_path / "mixed" / "a.txt").write_text(doc(1))
    (tmp_path / "mixed" / "b.csv").write_text("text\nhello\n")
    return [
        (dict(dataset_name=str(tmp_path / "data.xml")), r"unknown file type '\.xml'"),
        (dict(dataset_name=str(tmp_path / "nope.jsonl")), "data not found: .*--dataset_name"),
        (dict(dataset_name=str(tmp_path / "empty.txt")), "is empty"),
        (dict(dataset_name=str(tmp_path / "empty.jsonl")), "is empty"),
        (dict(dataset_name=str(tmp_path / "blank.jsonl")), "no text to train on: all 3 rows"),
        (dict(dataset_name=str(tmp_path / "mixed")), "mixes csv and text files"),
        (
            dict(dataset_name=str(tmp_path / "cols.jsonl")),
            r"no column 'text' .* its columns: title, body\. Choose one with --dataset_text_field",
        ),
        (dict(dataset_name=str(tmp_path / "tiny.txt")), "one sequence of 128 tokens.*--seq_len"),
        (
            dict(dataset_name=str(tmp_path / "tiny.txt"), streaming=True),
            "one sequence of 128 tokens.*--seq_len",
        ),
        (
            # Exactly one row (the text and its EOS).
            dict(
                dataset_name=str(tmp_path / "tiny.txt"),
                seq_len=len(tok("Too short.")["input_ids"]) + 1,
            ),
            "need at least 2.*--eval_fraction 0",
        ),
        (
            dict(dataset_name=str(tmp_path / "bad.jsonl")),
            "could not read .*bad.jsonl.*: line 2 is not JSON",
        ),
        (
            dict(dataset_name=str(tmp_path / "bad.jsonl"), streaming=True),
            "could not read .*bad.jsonl.*: line 2 is not JSON",
        ),
        (dict(dataset_name=str(tmp_path / "latin1.txt")), "could not read .*'utf-8' codec"),
        (dict(dataset_train_split="dev"), "no split 'dev'.*--dataset_train_split"),
        (dict(seq_len=0), "--seq_len must be"),
    ]


def test_errors_are_one_line_data_errors(tmp_path, tok):
    for kwargs, pattern in errors(tmp_path, tok):
        with pytest.raises(DataError, match=pattern) as e:
            load_training_data(DataArguments(**kwargs), tok)
        assert "\n" not in str(e.value), kwargs


def test_a_bad_json_line_is_reported_once(tmp_path, tok):
    """datasets' JSON loader logged its own line first (its row counted from 0 within a read
    block, 'row 5' for the file's line 6), beside ours (found by an audit): only ours now."""
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps({"text": f"row {i}"}) for i in range(10)]
    lines[5] = "{not json"
    path.write_text("\n".join(lines) + "\n")
    seen: list[str] = []

    class Seen(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    loader_log = logging.getLogger("datasets.packaged_modules.json.json")
    handler = Seen()
    loader_log.addHandler(handler)
    try:
        for streaming in (False, True):
            with pytest.raises(DataError, match="line 6 is not JSON"):
                args = DataArguments(dataset_name=str(path), streaming=streaming)
                load_training_data(args, tok)
    finally:
        loader_log.removeHandler(handler)
    assert not [m for m in seen if "Failed to load JSON" in m], seen


def test_wrong_column_kind_and_streamed_small_data(tmp_path, tok):
    path = jsonl(tmp_path / "n.jsonl", [{"text": 5}])
    with pytest.raises(DataError, match="holds int, not text.*--dataset_text_field"):
        load_training_data(DataArguments(dataset_name=str(path)), tok)
    path = jsonl(tmp_path / "few.jsonl", [{"text": doc(i)} for i in range(3)])
    args = DataArguments(dataset_name=str(path), streaming=True, seq_len=16)
    with pytest.raises(DataError, match="all needed for eval.*--max_eval_sequences"):
        load_training_data(args, tok)


def test_a_stream_of_copies_of_its_eval_documents_says_so(tmp_path, tok):
    """Streaming never trains on a copy of an eval document: a stream whose every later
    document repeats one in the eval head is refused for that, not for holding only the eval
    rows (found by an audit: 2,000 short repeated lines were said to stream 4 sequences)."""
    rows = [{"text": ["hi", "a", "ok", "yes no"][i % 4]} for i in range(2000)]
    path = jsonl(tmp_path / "copies.jsonl", rows)
    args = DataArguments(dataset_name=str(path), streaming=True, seq_len=16, max_eval_sequences=4)
    with pytest.raises(DataError, match="every document is empty or a copy of an eval document"):
        load_training_data(args, tok)


def test_split_slices_as_datasets_reads_them(tmp_path, tok):
    """``--dataset_train_split train[:50%]`` and ``--dataset_eval_split train[50%:]`` as in
    ``datasets.load_dataset`` (found by an audit: refused as an unknown split): the halves'
    documents, none in both; a malformed slice and a slice of a stream are refused in one line."""
    path = jsonl(tmp_path / "d.jsonl", [{"text": doc(i)} for i in range(40)])
    args = DataArguments(
        dataset_name=str(path), seq_len=16, dataset_train_split="train[:50%]",
        dataset_eval_split="train[50%:]", packing=False,
    )  # fmt: skip
    data = load_training_data(args, tok)
    whole = load_training_data(
        DataArguments(dataset_name=str(path), seq_len=16, packing=False, eval_fraction=0), tok
    )
    assert data.num_train_rows == 20 and len(data.eval) == 20 == whole.num_train_rows // 2
    train_rows = {tuple(r["input_ids"].tolist()) for r in data.train}
    assert not train_rows & {tuple(r["input_ids"].tolist()) for r in data.eval}
    with pytest.raises(DataError, match="'train\\[:50' is not a split or a split slice"):
        load_training_data(
            DataArguments(dataset_name=str(path), dataset_train_split="train[:50"), tok
        )
    with pytest.raises(DataError, match="a split slice needs the rows counted.*--streaming"):
        stream = DataArguments(
            dataset_name=str(path), streaming=True, dataset_train_split="train[:5]"
        )
        load_training_data(stream, tok)
    # Found by a later audit: a slice past the split's end was a traceback from datasets'
    # select, and a train and an eval split sharing rows were accepted silently.
    with pytest.raises(DataError, match=r"'train\[50:60\]' selects no rows \('train' has 40"):
        load_training_data(
            DataArguments(dataset_name=str(path), dataset_train_split="train[50:60]"), tok
        )
    for train, evaluate, shared in (
        ("train", "train[-10%:]", 4),
        ("train[:50%]", "train[40%:]", 4),
    ):
        with pytest.raises(DataError, match=f"share {shared} rows of 'train'"):
            load_training_data(
                DataArguments(
                    dataset_name=str(path), dataset_train_split=train, dataset_eval_split=evaluate
                ),
                tok,
            )


def test_hub_id_offline_without_cache(monkeypatch, tok):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    args = DataArguments(dataset_name="hf-megatrain-test/no-such-dataset")
    with pytest.raises(DataError, match="from the Hub or the local cache.*network") as e:
        load_training_data(args, tok)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("streaming", [True, False], ids=["streamed-packed", "padded"])
def test_trains_with_hfmegatrainer(tmp_path, tok, streaming):
    """The streamed IterableDataset (max_steps set) and padded rows (attention_mask, labels
    -100) through HFMegaTrainer and default_data_collator, train and eval."""
    path = jsonl(tmp_path / "s.jsonl", [{"text": doc(i)} for i in range(40)])
    args = DataArguments(
        dataset_name=str(path), streaming=streaming, packing=streaming, seq_len=16,
        max_eval_sequences=4,
    )  # fmt: skip
    data = load_training_data(args, tok)
    model = tiny_model(tiny_config("llama", vocab_size=len(tok)))
    targs = MegaTrainArguments(output_dir=str(tmp_path / "out"), **common_args(max_steps=3))
    trainer = HFMegaTrainer(
        model=model,
        args=targs,
        train_dataset=data.train,
        eval_dataset=data.eval,
        data_collator=default_data_collator,
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert trainer.state.global_step == 3 and len(losses) == 3
    assert all(torch.isfinite(torch.tensor(losses)))
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))


def test_one_document_without_packing_names_what_helps(tok):
    """--no_packing on one document (the bundled corpus): one row whatever --seq_len is, so the
    message offers what gives rows (documents, packing), not a lower --seq_len."""
    with pytest.raises(DataError) as e:
        load_training_data(DataArguments(packing=False), tok)
    msg = str(e.value)
    assert "one row per document and the data has 1 non-empty document" in msg
    assert "add documents, drop --no_packing" in msg and "--eval_fraction 0" in msg
    assert "lower --seq_len" not in msg


def test_hub_id_without_network_fails_fast(monkeypatch, tok):
    """No network and no HF_HUB_OFFLINE: one short connection check, then datasets runs
    offline (no ~30 s of retries) and the error says the Hub cannot be reached."""
    import time
    from types import SimpleNamespace

    from hf_megatrain import training_data

    def no_network(address, timeout=None):
        raise OSError(101, "Network is unreachable")

    for name in ("https_proxy", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(training_data, "socket", SimpleNamespace(create_connection=no_network))
    args = DataArguments(dataset_name="hf-megatrain-test/no-such-dataset")
    start = time.perf_counter()
    with pytest.raises(DataError, match="the Hub at .* cannot be reached: Network is unreachable"):
        load_training_data(args, tok)
    assert time.perf_counter() - start < 20  # datasets' retries alone sleep 23 s
    assert datasets.config.HF_HUB_OFFLINE is False  # offline for that load only
    # Behind a proxy a direct connection proves nothing: not checked.
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    assert training_data.hub_unreachable() is None


def test_folder_splits_follow_datasets_file_names(tmp_path, monkeypatch, tok):
    """A folder's splits are the ones datasets infers from its file names: validation.jsonl is
    the eval split (never trained on); a Hub download (README.md + data/train-*.parquet) loads."""
    folder = tmp_path / "splitdir"
    folder.mkdir()
    jsonl(folder / "train.jsonl", [{"text": doc(i)} for i in range(40)])
    jsonl(folder / "validation.jsonl", [{"text": doc(500 + i)} for i in range(40)])
    args = DataArguments(dataset_name=str(folder), seq_len=16)
    data = load_training_data(args, tok)
    assert "40 documents" in data.description and "(split 'validation')" in data.description
    alone = load_training_data(
        DataArguments(dataset_name=str(folder / "train.jsonl"), seq_len=16, eval_fraction=0), tok
    )
    assert sorted(ids(data.train)) == sorted(ids(alone.train))  # validation is not trained on
    held = load_training_data(
        DataArguments(**{**vars(args), "dataset_eval_split": "validation"}), tok
    )
    assert ids(held.eval) == ids(data.eval)

    hub = tmp_path / "hubdl"
    (hub / "data").mkdir(parents=True)
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# A dataset card\n")
    table = datasets.Dataset.from_dict({"text": [doc(i) for i in range(30)]})
    table.to_parquet(hub / "data" / "train-00000-of-00001.parquet")
    datasets.Dataset.from_dict({"text": [doc(900 + i) for i in range(30)]}).to_parquet(
        hub / "data" / "test-00000-of-00001.parquet"
    )
    data = load_training_data(DataArguments(dataset_name=str(hub), seq_len=16), tok)
    assert "30 documents" in data.description and "(split 'test')" in data.description


def test_eval_split_that_is_the_train_split_is_held_out(tmp_path, tok):
    path = jsonl(tmp_path / "d.jsonl", [{"text": doc(i)} for i in range(60)])
    args = DataArguments(dataset_name=str(path), seq_len=16, dataset_eval_split="train")
    data = load_training_data(args, tok)
    everything = load_training_data(DataArguments(**{**vars(args), "eval_fraction": 0,
                                                     "dataset_eval_split": None}), tok)  # fmt: skip
    assert sorted(ids(data.train) + ids(data.eval)) == sorted(ids(everything.train))
    assert "held out of split 'train'" in data.description
    with pytest.raises(DataError, match="is the split trained on.*--dataset_eval_split"):
        load_training_data(DataArguments(**{**vars(args), "eval_fraction": 0}), tok)


@pytest.mark.parametrize("name", ["my_texts/", "./my_texts", "../my_texts", "/no/such/dir"])
def test_missing_local_paths_are_not_hub_ids(monkeypatch, tok, name):
    from hf_megatrain import training_data

    def no_hub(*a, **k):
        raise AssertionError("the Hub was asked")

    monkeypatch.setattr(training_data, "hub_unreachable", no_hub)
    with pytest.raises(DataError, match=f"data not found: {name} \\(--dataset_name\\)"):
        load_training_data(DataArguments(dataset_name=name), tok)


def word_tokenizer_file(path: Path, specials: list[str], bos: str | None = None) -> Path:
    """A tokenizer.json of the words of doc() and ``specials`` (ids 0, 1, ...), no config: as a
    bare --tokenizer FILE. ``bos``: its post-processor puts that token before a text (Llama)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    raw = Tokenizer(models.WordLevel(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.WordLevelTrainer(special_tokens=[*specials, "<unk>"])
    raw.train_from_iterator([doc(i) for i in range(50)], trainer)
    if bos is not None:
        raw.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", special_tokens=[(bos, raw.token_to_id(bos))]
        )
    raw.save(str(path))
    return path


def test_bare_tokenizer_file_keeps_its_own_special_tokens(tmp_path):
    """EOS and pad come from the file's vocabulary; names it lacks are not added as new ids."""
    path = word_tokenizer_file(tmp_path / "tokenizer.json", ["<s>", "</s>", "<pad>"])
    tok = load_tokenizer(path)
    n_vocab = tok.backend_tokenizer.get_vocab_size()
    assert (tok.eos_token, tok.pad_token) == ("</s>", "<pad>")
    assert (tok.eos_token_id, tok.pad_token_id) == (1, 2) and len(tok) == n_vocab
    bare = word_tokenizer_file(tmp_path / "bare.json", ["[SEP]"])
    with pytest.raises(DataError, match="no EOS token .*tokenizer folder"):
        load_tokenizer(bare)
    bundled = load_tokenizer(None)  # as before: its own <|endoftext|> and <|pad|>, no BOS
    assert (bundled.eos_token, bundled.pad_token, bundled.bos_token) == (
        "<|endoftext|>", "<|pad|>", None,
    )  # fmt: skip
    assert len(bundled) == bundled.backend_tokenizer.get_vocab_size() == 4096


def test_documents_start_with_the_tokenizers_bos(tmp_path, tok):
    """A tokenizer that puts BOS before a text (Llama, Gemma) gets it at the start of each
    document, once (a chat template that writes it is not doubled); the bundled one (no BOS)
    gives the same rows as the plain token stream."""
    from hf_megatrain.text import bos_token_id

    bos_tok = load_tokenizer(word_tokenizer_file(tmp_path / "t.json", ["<s>", "</s>"], bos="<s>"))
    assert bos_tok.bos_token == "<s>" and bos_token_id(bos_tok) == 0
    texts = [doc(i) for i in range(6)]
    path = jsonl(tmp_path / "d.jsonl", [{"text": t} for t in texts])
    args = DataArguments(dataset_name=str(path), packing=False, seq_len=64, eval_fraction=0)
    for row in load_training_data(args, bos_tok).train:
        ids_ = row["input_ids"].tolist()
        assert ids_[0] == 0 and ids_.count(0) == 1
    chunks = build_chunks(bos_tok, [("a", t) for t in texts], 8)
    assert sum(c.count(0) for c in chunks) >= 5 and chunks[0][0] == 0

    bos_tok.chat_template = "{{ bos_token }}" + CHAT_TEMPLATE
    convs = [{"messages": [{"role": "user", "content": doc(i)}]} for i in range(4)]
    chat = DataArguments(**{**vars(args), "dataset_name": str(jsonl(tmp_path / "c.jsonl", convs))})
    for row in load_training_data(chat, bos_tok).train:
        assert row["input_ids"][0] == 0 and row["input_ids"][1] != 0

    assert bos_token_id(tok) is None
    packed = load_training_data(DataArguments(**{**vars(args), "packing": True}), tok)
    eos = [tok.eos_token_id]
    stream = [i for t in texts for i in tok(t, add_special_tokens=False)["input_ids"] + eos]
    rows = [stream[i : i + 64] for i in range(0, len(stream) // 64 * 64, 64)]
    assert sorted(ids(packed.train)) == sorted(rows)


def test_streamed_eval_documents_stay_out_of_train_across_workers(tmp_path, tok):
    """The held-out head of a stream read by two DataLoader workers (the shards split between
    them): none of its rows or documents is trained on (but the rest of the one it ends
    inside of), the others are."""
    import re

    folder = tmp_path / "shards"
    folder.mkdir()
    for s in range(4):
        jsonl(folder / f"part{s}.jsonl", [{"text": doc(s * 100 + i)} for i in range(25)])
    args = DataArguments(
        dataset_name=str(folder), streaming=True, seq_len=16, max_eval_sequences=6,
        shuffle_buffer=0,
    )  # fmt: skip
    data = load_training_data(args, tok)
    loader = torch.utils.data.DataLoader(data.train, batch_size=None, num_workers=2)
    train = [row["input_ids"].tolist() for row in loader]

    def documents(rows: list[list[int]]) -> set[int]:
        return {int(n) for r in rows for n in re.findall(r"Document (\d+), part", tok.decode(r))}

    held = documents(ids(data.eval))  # the last one's rest, after the head, is trained
    assert held and held & documents(train) == {max(held)}
    assert not {tuple(r) for r in ids(data.eval)} & {tuple(r) for r in train}
    assert len(documents(train) | held) >= 90  # of 100 (a row may cut a name in each part)


def test_chat_turns_are_checked(tmp_path, tok):
    """ShareGPT turns, non-text content and None content are refused with the row and the
    format; text parts are joined; empty conversations are skipped and counted."""
    tok.chat_template = CHAT_TEMPLATE

    def load(convs: list, **kwargs):
        path = jsonl(tmp_path / "c.jsonl", [{"messages": c} for c in convs])
        args = DataArguments(dataset_name=str(path), seq_len=8, eval_fraction=0, **kwargs)
        return load_training_data(args, tok)

    chats = [[{"role": "user", "content": f"Question {i}?"},
              {"role": "assistant", "content": f"Answer {i}, in full."}] for i in range(20)]  # fmt: skip
    share = [[{"from": "human", "value": t[0]["content"]}] for t in chats]
    for streaming in (False, True):
        with pytest.raises(DataError, match="ShareGPT-style.*'role', 'content'.*--dataset_messag"):
            load(share, streaming=streaming, max_eval_sequences=0)
    parts = [[{**t, "content": [{"type": "text", "text": t["content"]}]} for t in c] for c in chats]
    assert ids(load(parts).train) == ids(load(chats).train)
    bad = chats[:3] + [[chats[3][0], {"role": "assistant", "content": None}]] + chats[4:]
    with pytest.raises(DataError, match=r"row 3 \(from 0\).*turn 1 \(assistant\).*None, not text"):
        load(bad)
    image = [[{"role": "user", "content": [{"type": "image", "text": None}]}]]
    with pytest.raises(DataError, match="content parts other than text"):
        load(chats[:2] + image)
    data = load(chats[:5] + [[], None] + chats[5:])
    assert "2 empty conversations skipped" in data.description
    assert ids(data.train) == ids(load(chats).train)


def test_one_bad_row_is_named_not_the_column(tmp_path, tok):
    rows = [{"text": doc(i)} for i in range(30)]
    rows[20] = {"text": 12345}
    path = jsonl(tmp_path / "m.jsonl", rows)
    for streaming in (False, True):
        args = DataArguments(dataset_name=str(path), streaming=streaming)
        with pytest.raises(DataError, match=r"row 20 \(from 0\) of column 'text' holds int 12345"):
            data = load_training_data(args, tok)
            list(data.train)


def test_a_named_text_field_must_exist(tmp_path, tok):
    tok.chat_template = CHAT_TEMPLATE
    path = jsonl(tmp_path / "c.jsonl", [{"messages": [{"role": "user", "content": "Hi"}]}] * 50)
    args = DataArguments(dataset_name=str(path), dataset_text_field="body", seq_len=4)
    with pytest.raises(DataError, match="no column 'body' \\(--dataset_text_field\\).*messages"):
        load_training_data(args, tok)
