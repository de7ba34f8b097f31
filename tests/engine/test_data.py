"""The data pipeline: corpora on disk, a cached tokenizer, and resumable seeded batches."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from engine.data import corpus as data
from engine.data import tokenizer
from engine.data.corpus import (
    DataError,
    TokenBatches,
    build_data,
    default_corpus,
    get_tokenizer,
    open_corpus,
    tokenize_corpus,
)
from engine.data.held_out import build_run_data, eval_batches, split_documents
from engine.data.tokenizer import cache_dir, save_tokenizer
from engine.models.zoo import build_model

SMALL_VOCAB = 300  # the 260 byte-level tokens plus a few merges: trains in milliseconds


def prose(seed: int, sentences: int = 200) -> str:
    """Deterministic English-like text with enough repetition for BPE to find merges."""
    rng = random.Random(seed)
    words = (
        "the model moves every chunk between device and host while training runs "
        "memory budget policy margin parameter gradient optimizer step"
    ).split()
    lines = (
        " ".join(rng.choice(words) for _ in range(rng.randint(4, 12))) + "."
        for _ in range(sentences)
    )
    return "\n".join(lines) + "\n"


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "cache"
    monkeypatch.setenv("TUITRAIN_CACHE", str(path))
    return path


@pytest.fixture
def text_file(tmp_path) -> Path:
    path = tmp_path / "corpus.txt"
    path.write_text(prose(0, sentences=600))
    return path


def small_data(path, **overrides) -> TokenBatches:
    options = dict(
        model_name_or_path="tiny", vocab_limit=SMALL_VOCAB, batch_size=2, seq_len=16, seed=0
    )
    return build_data(str(path) if path is not None else None, **{**options, **overrides})


def refuse(*_args, **_kwargs):
    raise AssertionError("must come from the cache")


# The cache -------------------------------------------------------------------------------


def test_the_cache_lives_where_the_environment_says(monkeypatch, tmp_path):
    monkeypatch.setenv("TUITRAIN_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv("TUITRAIN_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "tuitrain"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "tuitrain"


def test_the_tokenizer_is_trained_once_then_loaded(fresh_cache, text_file, monkeypatch):
    first = get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    assert list((fresh_cache / "tokenizers").glob("*.json"))
    monkeypatch.setattr(tokenizer, "train_tokenizer", refuse)
    second = get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    assert second.get_vocab() == first.get_vocab()
    assert len(second) == SMALL_VOCAB


def test_an_edited_corpus_gets_a_new_tokenizer(fresh_cache, text_file, monkeypatch):
    get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    calls = []
    train = tokenizer.train_tokenizer
    monkeypatch.setattr(
        tokenizer, "train_tokenizer", lambda texts, **kw: calls.append(1) or train(texts, **kw)
    )
    text_file.write_text(prose(1, sentences=700))
    get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    assert calls == [1]


def test_the_token_stream_is_encoded_once_then_loaded(fresh_cache, text_file, monkeypatch):
    first = small_data(text_file)
    monkeypatch.setattr(tokenizer, "encode_documents", refuse)
    monkeypatch.setattr(tokenizer, "train_tokenizer", refuse)
    second = small_data(text_file)
    assert first.num_tokens == second.num_tokens
    assert torch.equal(next(first)["input_ids"], next(second)["input_ids"])


def test_no_half_written_files_are_left_in_the_cache(fresh_cache, text_file):
    small_data(text_file)
    leftovers = [p.name for p in fresh_cache.rglob("*") if p.name.endswith(".tmp")]
    assert leftovers == []


# The tokenizer ---------------------------------------------------------------------------


def test_the_trained_tokenizer_reserves_opts_special_ids(fresh_cache, text_file):
    tok = get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    assert [tok.convert_tokens_to_ids(t) for t in ("<s>", "<pad>", "</s>", "<unk>")] == [0, 1, 2, 3]
    assert (tok.pad_token_id, tok.eos_token_id) == (1, 2)
    text = "any script at all: é, 漢字, 🙂\n\ttabs too"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text


def test_a_saved_tokenizer_reloads_offline_and_encodes_alike(fresh_cache, text_file, tmp_path):
    tok = get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    save_tokenizer(tok, tmp_path / "saved")
    again = AutoTokenizer.from_pretrained(tmp_path / "saved", local_files_only=True)
    text = prose(5, sentences=3)
    assert again(text)["input_ids"] == tok(text)["input_ids"]
    assert again.eos_token_id == tok.eos_token_id


@pytest.fixture
def model_folder_with_tokenizer(fresh_cache, tmp_path, text_file) -> Path:
    folder = tmp_path / "model"
    build_model("tiny").save_pretrained(folder)
    tok = tokenizer.train_tokenizer([prose(9)], vocab_size=280)
    save_tokenizer(tok, folder)
    return folder


def test_a_model_folder_brings_its_own_tokenizer(
    model_folder_with_tokenizer, text_file, monkeypatch
):
    monkeypatch.setattr(tokenizer, "train_tokenizer", refuse)
    tok = get_tokenizer(
        str(text_file), model_name_or_path=str(model_folder_with_tokenizer), vocab_limit=8192
    )
    assert len(tok) == 280
    batches = build_data(
        str(text_file),
        model_name_or_path=str(model_folder_with_tokenizer),
        vocab_limit=8192,
        batch_size=2,
        seq_len=16,
        seed=0,
    )
    assert int(next(batches)["input_ids"].max()) < 280


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused(
    model_folder_with_tokenizer, text_file
):
    with pytest.raises(DataError, match="280 tokens"):
        get_tokenizer(
            str(text_file), model_name_or_path=str(model_folder_with_tokenizer), vocab_limit=270
        )


def test_a_model_too_small_for_byte_level_tokens_is_refused(text_file):
    with pytest.raises(DataError, match="at least 260"):
        get_tokenizer(str(text_file), model_name_or_path="tiny", vocab_limit=100)


def test_every_token_id_fits_the_model(fresh_cache, text_file):
    batches = small_data(text_file, vocab_limit=SMALL_VOCAB)
    for _ in range(batches.batches_per_epoch):
        assert int(next(batches)["input_ids"].max()) < SMALL_VOCAB


# Corpus formats --------------------------------------------------------------------------


def decoded_stream(path) -> str:
    corpus = open_corpus(str(path))
    tok = get_tokenizer(str(path), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB)
    return tok.decode(tokenize_corpus(corpus, tok).tolist())


def test_a_text_file_is_one_document_ended_by_eos(fresh_cache, text_file):
    assert decoded_stream(text_file) == text_file.read_text() + "</s>"


def test_a_folder_reads_text_files_recursively_in_sorted_order(fresh_cache, tmp_path):
    root = tmp_path / "docs"
    (root / "b").mkdir(parents=True)
    (root / "a.md").write_text("alpha\n" * 50)
    (root / "b" / "c.txt").write_text("gamma\n" * 50)
    (root / "b" / "d.py").write_text("delta = 1\n" * 50)
    (root / "image.png").write_bytes(b"\x89PNG\0\0")
    (root / ".hidden.txt").write_text("secret\n")
    corpus = open_corpus(str(root))
    assert [p.relative_to(root).as_posix() for p in corpus.files] == ["a.md", "b/c.txt", "b/d.py"]
    assert (
        decoded_stream(root)
        == "alpha\n" * 50 + "</s>" + "gamma\n" * 50 + "</s>" + "delta = 1\n" * 50 + "</s>"
    )


def test_a_jsonl_file_gives_one_document_per_text_field(fresh_cache, tmp_path):
    path = tmp_path / "corpus.jsonl"
    records = [{"text": prose(i, sentences=20), "id": i} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    assert decoded_stream(path) == "".join(r["text"] + "</s>" for r in records)


@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        ("{not json", "not valid JSON"),
        ('{"body": "no text field"}', 'string "text" field'),
        ('["a list"]', 'string "text" field'),
    ],
)
def test_a_bad_jsonl_line_is_named(fresh_cache, tmp_path, line, complaint):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"text": "fine"}) + "\n" + line + "\n")
    with pytest.raises(DataError, match=complaint) as caught:
        small_data(path)
    assert f"{path}:2" in str(caught.value)


@pytest.fixture(params=["Dataset", "DatasetDict"])
def datasets_folder(tmp_path, request) -> Path:
    """A `save_to_disk` folder of eight documents; a DatasetDict's are in its train split."""
    datasets = pytest.importorskip("datasets", reason="the datasets package is not installed")
    folder = tmp_path / "saved"
    texts = [prose(i, sentences=30) for i in range(8)]
    dataset = datasets.Dataset.from_dict({"text": texts, "n": list(range(8))})
    if request.param == "DatasetDict":
        other = datasets.Dataset.from_dict({"text": ["held out"], "n": [0]})
        dataset = datasets.DatasetDict({"test": other, "train": dataset})
    dataset.save_to_disk(str(folder))
    return folder


def test_a_datasets_folder_reads_its_text_column(fresh_cache, datasets_folder):
    expected = "".join(prose(i, sentences=30) + "</s>" for i in range(8))
    assert decoded_stream(datasets_folder) == expected


def test_a_datasets_folder_reads_with_pyarrow_alone(fresh_cache, datasets_folder, monkeypatch):
    pytest.importorskip("pyarrow", reason="pyarrow is not installed")
    with_datasets = list(open_corpus(str(datasets_folder)).documents())
    monkeypatch.setattr(data, "_installed", lambda package: package != "datasets")
    assert list(open_corpus(str(datasets_folder)).documents()) == with_datasets


def test_a_datasets_folder_without_the_packages_says_what_to_install(tmp_path, monkeypatch):
    folder = tmp_path / "saved"
    folder.mkdir()
    (folder / "dataset_info.json").write_text("{}")
    (folder / "state.json").write_text("{}")
    monkeypatch.setattr(data, "_installed", lambda package: False)
    with pytest.raises(DataError, match="pip install datasets"):
        open_corpus(str(folder))


def test_a_missing_path_is_one_clear_line(tmp_path):
    missing = tmp_path / "nowhere.txt"
    with pytest.raises(DataError) as caught:
        small_data(missing)
    assert str(caught.value) == f"no such data path: {missing}"
    assert isinstance(caught.value, ValueError)


def test_a_binary_file_is_refused(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(DataError, match="does not look like text"):
        open_corpus(str(path))


def test_a_folder_without_text_files_is_refused(tmp_path):
    (tmp_path / "only.png").write_bytes(b"\x89PNG")
    with pytest.raises(DataError, match="no text files"):
        open_corpus(str(tmp_path))


def test_a_corpus_smaller_than_one_batch_is_refused(fresh_cache, tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("just a few words\n")
    with pytest.raises(DataError, match="fewer than one batch of 2 x 16"):
        small_data(path)


def test_a_sequence_longer_than_the_model_positions_is_refused(text_file):
    with pytest.raises(DataError, match="512 positions"):
        small_data(text_file, seq_len=1024)


# The built-in corpus ---------------------------------------------------------------------


def test_the_default_corpus_is_the_standard_librarys_own_source():
    corpus = default_corpus()
    assert len(corpus.files) > 300
    assert all(p.suffix == ".py" for p in corpus.files)
    assert not any(
        part in {"site-packages", "test", "__pycache__"} for p in corpus.files for part in p.parts
    )
    assert corpus.files == default_corpus().files  # a fixed order, so a seed means one run
    assert sum(p.stat().st_size for p in corpus.files) > 5_000_000
    assert corpus.identity() == default_corpus().identity()


def test_the_default_corpus_trains_tiny_and_starts_fast_the_second_time(monkeypatch):
    # Uses the session's shared cache: cold once per checkout, then from the cache.
    options = dict(model_name_or_path="tiny", vocab_limit=8192, batch_size=4, seq_len=128, seed=0)
    first = build_data(None, **options)
    assert len(first.tokenizer) == 8000
    assert first.num_tokens > 1_000_000
    monkeypatch.setattr(tokenizer, "encode_documents", refuse)
    monkeypatch.setattr(tokenizer, "train_tokenizer", refuse)
    # CPU time of this process: other processes sharing the machine do not count.
    start = time.process_time()
    second = build_data(None, **options)
    assert time.process_time() - start < 5.0
    batch = next(second)
    assert torch.equal(batch["input_ids"], next(first)["input_ids"])
    tokens = tokenize_corpus(default_corpus(), second.tokenizer)
    start = second.tokenizer.decode(tokens[:500].tolist())
    assert default_corpus().files[0].read_text().startswith(start)


# Batches ---------------------------------------------------------------------------------


def stream(length: int = 1000) -> np.ndarray:
    return np.arange(length, dtype=np.uint16)


def take(batches: TokenBatches, n: int) -> list[torch.Tensor]:
    return [next(batches)["input_ids"] for _ in range(n)]


def test_a_batch_is_a_block_of_consecutive_tokens_with_labels_equal_to_inputs():
    batch = next(TokenBatches(stream(), batch_size=3, seq_len=10, seed=0))
    ids = batch["input_ids"]
    assert ids.shape == (3, 10) and ids.dtype == torch.long
    assert torch.equal(batch["labels"], ids) and batch["labels"] is not ids
    for row in ids:
        assert row[0] % 10 == 0 and torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 10))


def test_an_epoch_visits_every_block_once_and_the_next_reshuffles():
    batches = TokenBatches(stream(), batch_size=4, seq_len=10, seed=0)  # 100 blocks, 25 batches
    assert (batches.num_blocks, batches.batches_per_epoch) == (100, 25)
    first = torch.cat(take(batches, 25))[:, 0]
    second = torch.cat(take(batches, 25))[:, 0]
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(0, 1000, 10))
    assert first.tolist() != second.tolist()
    assert batches.epoch == 1


def test_the_tail_shorter_than_a_batch_is_left_for_the_next_epoch():
    batches = TokenBatches(stream(1005), batch_size=3, seq_len=10, seed=0)  # 100 blocks
    assert batches.batches_per_epoch == 33
    take(batches, 33)
    assert batches.state_dict() == {"epoch": 0, "position": 33}
    next(batches)
    assert batches.state_dict() == {"epoch": 1, "position": 1}


def test_the_same_seed_gives_the_same_batches():
    one = take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=5), 60)
    two = take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=5), 60)
    assert all(torch.equal(a, b) for a, b in zip(one, two, strict=True))


def test_another_seed_gives_other_batches():
    one = torch.cat(take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=5), 10))
    two = torch.cat(take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=6), 10))
    negative = torch.cat(take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=-5), 10))
    assert not torch.equal(one, two)
    assert not torch.equal(one, negative)


@pytest.mark.parametrize("consumed", [0, 7, 49, 50, 51, 130])
def test_a_resumed_run_continues_with_the_exact_next_batch(consumed):
    original = TokenBatches(stream(), batch_size=2, seq_len=10, seed=3)  # 50 batches an epoch
    take(original, consumed)
    state = json.loads(json.dumps(original.state_dict()))  # survives a checkpoint file
    resumed = TokenBatches(stream(), batch_size=2, seq_len=10, seed=3)
    resumed.load_state_dict(state)
    expected, got = take(original, 60), take(resumed, 60)
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


@pytest.mark.parametrize(
    "state",
    [
        {},
        {"epoch": -1, "position": 0},
        {"epoch": 0, "position": "3"},
        {"epoch": True, "position": 0},
    ],
)
def test_a_malformed_data_state_is_refused(state):
    batches = TokenBatches(stream(), batch_size=2, seq_len=10, seed=0)
    with pytest.raises(ValueError, match="data state"):
        batches.load_state_dict(state)


def test_tokens_may_be_a_tensor_or_a_memory_map(tmp_path):
    path = tmp_path / "tokens.npy"
    np.save(path, stream())
    expected = take(TokenBatches(stream(), batch_size=2, seq_len=10, seed=1), 5)
    for tokens in (torch.arange(1000), np.load(path, mmap_mode="r")):
        got = take(TokenBatches(tokens, batch_size=2, seq_len=10, seed=1), 5)
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_fewer_tokens_than_one_batch_is_a_data_error():
    with pytest.raises(DataError, match="holds 30 tokens"):
        TokenBatches(stream(30), batch_size=2, seq_len=16, seed=0)


@pytest.mark.parametrize(("batch_size", "seq_len"), [(0, 10), (2, 0)])
def test_a_batch_needs_a_positive_shape(batch_size, seq_len):
    with pytest.raises(ValueError, match="must be at least 1"):
        TokenBatches(stream(), batch_size=batch_size, seq_len=seq_len, seed=0)


def test_a_cache_that_cannot_be_written_costs_only_time(tmp_path, text_file, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("TUITRAIN_CACHE", str(blocker))
    first, second = small_data(text_file), small_data(text_file)
    assert torch.equal(next(first)["input_ids"], next(second)["input_ids"])


# Another text field ----------------------------------------------------------------------


def test_a_jsonl_file_reads_the_field_it_is_told(fresh_cache, tmp_path):
    path = tmp_path / "corpus.jsonl"
    records = [{"body": prose(i, sentences=20), "text": "not this"} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    corpus = open_corpus(str(path), text_field="body")
    assert list(corpus.documents()) == [r["body"] for r in records]
    # Another field is another corpus: the caches keep them apart.
    assert corpus.identity() != open_corpus(str(path)).identity()
    assert open_corpus(str(path)).identity() == open_corpus(str(path), text_field="text").identity()


def test_a_missing_jsonl_field_names_the_file_and_the_fields_found(fresh_cache, tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text(json.dumps({"text": "a", "id": 1}) + "\n")
    with pytest.raises(DataError) as caught:
        small_data(path, text_field="body")
    assert str(caught.value) == (
        f'{path}:1: expected an object with a string "body" field (fields: text, id)'
    )


@pytest.mark.parametrize("reader", ["datasets", "pyarrow"])
def test_a_datasets_folder_reads_the_column_it_is_told(
        fresh_cache, datasets_folder, monkeypatch, reader):
    if reader == "pyarrow":
        monkeypatch.setattr(data, "_installed", lambda package: package != "datasets")
    texts = list(open_corpus(str(datasets_folder)).documents())
    renamed = datasets_folder.parent / "renamed"
    import datasets

    saved = datasets.load_from_disk(str(datasets_folder))
    saved.rename_column("text", "content").save_to_disk(str(renamed))
    assert list(open_corpus(str(renamed), text_field="content").documents()) == texts
    with pytest.raises(DataError) as caught:
        list(open_corpus(str(renamed)).documents())
    assert str(caught.value) == f'{renamed}: no "text" column (columns: content, n)'


# Held-out text ---------------------------------------------------------------------------


def documents_of(tokens: np.ndarray, separator: int = 0) -> list[tuple[int, ...]]:
    ends = np.flatnonzero(tokens == separator) + 1
    return [tuple(d.tolist()) for d in np.split(tokens, ends) if len(d)]


def corpus_of(lengths: list[int], seed: int = 0) -> np.ndarray:
    """Documents of the given lengths (separator 0 included), with distinct random tokens."""
    rng = np.random.default_rng(seed)
    parts = [np.append(rng.integers(1, 1000, n - 1), 0) for n in lengths]
    return np.concatenate(parts).astype(np.uint16)


def test_held_out_documents_are_never_trained_on():
    tokens = corpus_of([int(n) for n in np.random.default_rng(1).integers(20, 400, 300)])
    train, held = split_documents(tokens, separator=0, fraction=0.1)
    assert len(train) + len(held) == len(tokens)
    assert 0.08 * len(tokens) < len(held) <= 0.1 * len(tokens)
    trained, judged = set(documents_of(train)), set(documents_of(held))
    assert not trained & judged
    assert trained | judged == set(documents_of(tokens))
    # Fixed by the tokens alone: the same split every time.
    again = split_documents(tokens, separator=0, fraction=0.1)
    assert np.array_equal(again[0], train) and np.array_equal(again[1], held)


def test_copies_of_a_document_fall_on_the_same_side():
    tokens = corpus_of([50] * 40)
    copies = np.concatenate([tokens] * 3)  # every text three times
    train, held = split_documents(copies, separator=0, fraction=0.2)
    assert not set(documents_of(train)) & set(documents_of(held))
    assert len(held) % 3 == 0 and len(held) > 0


def test_one_document_cannot_be_split():
    with pytest.raises(DataError, match="nothing to hold out: the data is one document"):
        split_documents(corpus_of([500]), separator=0, fraction=0.5)
    with pytest.raises(DataError, match="the data is one document"):
        split_documents(np.arange(1, 100, dtype=np.uint16), separator=None, fraction=0.2)
    with pytest.raises(DataError, match="each of the 3 documents is more than 0.2 of"):
        split_documents(corpus_of([100, 150, 200]), separator=0, fraction=0.2)


def test_evaluation_batches_are_fixed_and_spread_over_the_held_out_text():
    tokens = np.arange(10_000, dtype=np.uint16)  # 100 blocks of 100
    first = eval_batches(tokens, sequences=8, batch_size=3, seq_len=100, source="x")
    starts = [int(row[0]) for b in first.batches for row in b["input_ids"]]
    assert starts == [0, 1200, 2500, 3700, 5000, 6200, 7500, 8700]
    assert [len(b["input_ids"]) for b in first.batches] == [3, 3, 2]
    assert (first.sequences, first.tokens) == (8, 800)
    for batch in first.batches:
        assert torch.equal(batch["labels"], batch["input_ids"])
    # The same sequences whatever the batch size, and every block when there are few.
    other = eval_batches(tokens, sequences=8, batch_size=8, seq_len=100, source="x")
    assert torch.equal(other.batches[0]["input_ids"],
                       torch.cat([b["input_ids"] for b in first.batches]))
    few = eval_batches(tokens[:350], sequences=8, batch_size=2, seq_len=100, source="x")
    assert few.sequences == 3
    with pytest.raises(DataError, match=r"held-out text \(x\) holds 99 tokens"):
        eval_batches(tokens[:99], sequences=8, batch_size=2, seq_len=100, source="x")


def test_held_out_text_from_another_corpus_uses_the_runs_tokenizer(fresh_cache, text_file,
                                                                     tmp_path):
    other = tmp_path / "held.txt"
    other.write_text(prose(7, sentences=100))
    run = build_run_data(str(text_file), model_name_or_path="tiny", vocab_limit=SMALL_VOCAB,
                         batch_size=2, seq_len=16, seed=0, eval_path=str(other),
                         eval_sequences=4, eval_batch_size=2)
    whole = small_data(text_file)
    assert run.train.num_tokens == whole.num_tokens  # all of --data is trained on
    assert run.eval.sequences == 4 and run.eval.source == str(other)
    text = run.train.tokenizer.decode(run.eval.batches[0]["input_ids"][0].tolist())
    assert text in other.read_text()


def test_a_share_of_the_built_in_corpus_is_held_out():
    options = dict(model_name_or_path="tiny", vocab_limit=8192, batch_size=4, seq_len=128,
                   seed=0)
    whole = build_data(None, **options)
    run = build_run_data(None, **options, eval_fraction=0.05, eval_sequences=16,
                         eval_batch_size=4)
    held = whole.num_tokens - run.train.num_tokens
    assert 0.04 * whole.num_tokens < held <= 0.05 * whole.num_tokens
    assert run.eval.tokens == 16 * 128
