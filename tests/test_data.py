import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data.corpus import GutenbergCorpus, gutenberg_books, split_tail
from data.datamodule import ContiguousWindows, RandomWindows, TextDataModule, prepare_token_files
from data.tokenizers import get_tokenizer


@pytest.fixture(scope="module")
def corpus():
    return GutenbergCorpus(val_fraction=0.1)


@pytest.fixture(scope="module")
def prepared(corpus, cache_root):
    dm = TextDataModule(corpus, tokenizer="bytes", block_size=64, batch_size=4)
    dm.setup()
    return dm


def test_gutenberg_books_are_clean(corpus):
    books = gutenberg_books(corpus.raw_text())
    assert [t for t, _ in books] == [
        "The Adventures Of Sherlock Holmes", "History Of The United States", "Manual Of Surgery", "War And Peace",
    ]
    for _, body in books:
        for marker in ("PROJECT GUTENBERG", "Project Gutenberg", "SMALL PRINT", "wiktionary", "def g():"):
            assert marker not in body
    assert len(books[-1][1]) > 2_500_000  # War and Peace: long documents for extrapolation


def test_validation_is_the_tail_and_disjoint(corpus):
    docs = corpus.documents()
    for (title, train), (_, val), (_, body) in zip(docs["train"], docs["val"], gutenberg_books(corpus.raw_text())):
        assert train + val == body
        assert 0.08 < len(val) / len(body) < 0.12
        # No long passage of the held-out text appears in the training text.
        for probe in (val[100:300], val[len(val) // 2 : len(val) // 2 + 200], val[-250:-50]):
            assert probe not in train, title
    # held-out War and Peace stays one contiguous text longer than 16 x 1024 bytes
    assert len(docs["val"][-1][1]) > 16 * 1024 * 4


def test_split_tail_cuts_at_paragraph():
    body = "a" * 1000 + "\n\n" + "b" * 400
    train, val = split_tail(body, 0.2)
    assert train.endswith("\n\n") and val == "b" * 400
    # no paragraph break before the cut: cut at the exact fraction
    train, val = split_tail("x" * 1000, 0.1)
    assert (len(train), len(val)) == (900, 100)


def test_memmap_matches_tokenizer(prepared, corpus):
    meta = json.loads((prepared.token_dir / "meta.json").read_text())
    tok = get_tokenizer("bytes")
    val_docs = corpus.documents()["val"]
    val = np.memmap(prepared.split_path("val"), dtype=meta["dtype"], mode="r")
    assert meta["dtype"] == "uint16"
    assert len(val) == sum(len(tok.encode(body)) for _, body in val_docs)
    offsets = meta["splits"]["val"]["doc_offsets"]
    first = val_docs[0][1]
    assert val[offsets[0] : offsets[1]].tolist() == tok.encode(first)


def test_prepare_is_idempotent_and_atomic(prepared, corpus):
    bin_path = prepared.split_path("train")
    before = bin_path.stat().st_mtime_ns
    prepare_token_files(corpus, get_tokenizer("bytes"), prepared.token_dir)
    assert bin_path.stat().st_mtime_ns == before  # nothing rewritten
    assert not list(prepared.token_dir.glob("*.partial"))


def test_train_windows_inside_memmap_and_shifted(prepared):
    ds = prepared.train_set
    tokens = np.memmap(prepared.split_path("train"), dtype=prepared.meta["dtype"], mode="r")
    for i in range(0, 5000, 37):
        s = ds.start(i)
        assert 0 <= s and s + 64 + 1 <= len(tokens)
        x, y = ds[i]
        assert x.shape == y.shape == (64,) and x.dtype == torch.int64
        assert torch.equal(x, torch.from_numpy(tokens[s : s + 64].astype(np.int64)))
        assert torch.equal(y, torch.from_numpy(tokens[s + 1 : s + 65].astype(np.int64)))
    # the last possible start is reachable in principle: starts span the file
    starts = np.array([ds.start(i) for i in range(20000)])
    assert starts.min() < 0.01 * len(tokens) and starts.max() > 0.99 * (len(tokens) - 65)


def test_ranks_draw_different_windows(prepared):
    path, dtype = prepared.split_path("train"), prepared.meta["dtype"]
    r0 = RandomWindows(path, dtype, 64, 1000, seed=1, rank=0)
    r1 = RandomWindows(path, dtype, 64, 1000, seed=1, rank=1)
    again = RandomWindows(path, dtype, 64, 1000, seed=1, rank=0)
    s0 = [r0.start(i) for i in range(1000)]
    assert s0 == [again.start(i) for i in range(1000)]  # deterministic (resumable)
    assert len(set(s0) & {r1.start(i) for i in range(1000)}) < 5


def test_validation_windows_cover_val_split_in_order(prepared):
    ds = prepared.val_set
    tokens = np.memmap(prepared.split_path("val"), dtype=prepared.meta["dtype"], mode="r")
    assert len(ds) == (len(tokens) - 1) // 64
    x0, y0 = ds[0]
    x1, _ = ds[1]
    assert torch.equal(x1[:1], y0[-1:])  # windows tile the stream
    assert x0.tolist() == tokens[:64].tolist()


def test_dataloader_batches(prepared):
    x, y = next(iter(prepared.train_dataloader()))
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < prepared.vocab_size


def test_windows_refuse_too_short_file(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="fewer than one training window"):
        RandomWindows(path, "uint16", 64, 10)
    with pytest.raises(ValueError, match="fewer than one validation window"):
        ContiguousWindows(path, "uint16", 64)


def test_unigram_baseline_is_entropy_like(prepared):
    # Bytes of English prose: unigram cross-entropy about 3.0-3.4 nats (4.4-4.9 bits).
    assert 2.8 < prepared.unigram_loss() < 3.5


def test_hub_corpus_offline_fails_clearly(tmp_path, monkeypatch):
    from data.corpus import HubCorpus

    import datasets
    import huggingface_hub

    # HF_DATASETS_OFFLINE=1 with an empty cache, as set before launch (the libraries read it at import)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf")
    with pytest.raises(RuntimeError, match="need network access.*data=gutenberg"):
        HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1").load(tmp_path)


def test_hub_corpus_unreachable_fails_fast(tmp_path, monkeypatch):
    import time

    import data.corpus as corpus_module

    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(corpus_module, "hub_reachable", lambda timeout=3.0: False)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="(?s)hub is unreachable.*data=gutenberg"):
        corpus_module.HubCorpus("Salesforce/wikitext", "wikitext-103-raw-v1").load(tmp_path)
    assert time.perf_counter() - t0 < 1.0


def test_resumed_run_continues_the_window_sequence(prepared):
    """After k optimisation steps, a resumed run's first batch is the fresh run's batch k."""
    class FakeTrainer:
        global_step, accumulate_grad_batches, global_rank = 3, 2, 0

    fresh = list(zip(range(8), prepared.train_dataloader()))
    prepared.trainer = FakeTrainer()
    try:
        resumed = next(iter(prepared.train_dataloader()))
    finally:
        prepared.trainer = None
        prepared.train_set.offset = 0
    assert torch.equal(resumed[0], fresh[6][1][0])  # 3 steps x 2 accumulated batches
