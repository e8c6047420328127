"""data/corpus.py, data/val_windows.py and the TextDataModule on the Gutenberg corpus: clean
books, a disjoint held-out tail, token files against the tokenizer, windows by hand, and a
cache that notices stale inputs."""

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from data.corpus import GutenbergCorpus, gutenberg_books, split_tail
import datasets
import tiktoken

from data.cache import prepare_token_files
from data.stream import GlobalSamples, TrainWindows
from data.tokenizers import get_tokenizer
from data.val_windows import ValidationWindows, spread_starts
from pelab.datamodule import TextDataModule

SEP = 0x1E  # the bytes tokenizer's document separator (ASCII record separator)


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
    meta = prepared.meta
    tok = get_tokenizer("bytes")
    val_docs = corpus.documents()["val"]
    val = np.memmap(prepared.split_path("val"), dtype=meta["dtype"], mode="r")
    assert meta["dtype"] == "uint16"
    assert len(val) == sum(len(body.encode("utf-8")) + 1 for _, body in val_docs)  # + one separator each
    offsets = meta["splits"]["val"]["doc_offsets"]
    first = val_docs[0][1]
    assert val[offsets[0] : offsets[1]].tolist() == list(first.encode("utf-8")) + [SEP]


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
    windows, again = TrainWindows(path, dtype, 64, seed=1), TrainWindows(path, dtype, 64, seed=1)
    r0, r1 = (list(GlobalSamples(0, rank, 2, 4, 2000)) for rank in (0, 1))
    s0 = [windows.start(g) for g in r0]
    assert s0 == [again.start(g) for g in r0]  # deterministic (resumable)
    assert len(set(s0) & {windows.start(g) for g in r1}) < 5


def docs_without_a_window(starts, offsets) -> list[int]:
    """Indices of documents [offsets[d], offsets[d+1]) in which no window starts."""
    starts = np.asarray(starts)
    return [d for d in range(len(offsets) - 1)
            if not ((starts >= offsets[d]) & (starts < offsets[d + 1])).any()]


def test_validation_windows_cover_every_held_out_document(prepared):
    ds = prepared.val_set
    tokens = np.memmap(prepared.split_path("val"), dtype=prepared.meta["dtype"], mode="r")
    offsets = prepared.meta["splits"]["val"]["doc_offsets"]
    assert len(offsets) == 5 and len(ds) == 256  # four books, the default 256 windows
    assert docs_without_a_window(ds.starts, offsets) == []
    # spread from the first to the last possible window, evenly (gaps differ by at most one token)
    gaps = np.diff(ds.starts)
    assert ds.starts[0] == 0 and ds.starts[-1] == len(tokens) - 65
    assert gaps.min() >= 64 and gaps.max() - gaps.min() <= 1
    # at the default run's context (256) too
    assert docs_without_a_window(spread_starts(len(tokens), 256, 256), offsets) == []
    x, y = ds[100]
    s = int(ds.starts[100])
    assert x.tolist() == tokens[s : s + 64].tolist() and y.tolist() == tokens[s + 1 : s + 65].tolist()


def test_validation_windows_hand_computed_and_deterministic(prepared):
    # 1001 tokens, windows of 100 (+1 target): the last start is 900, three windows at 0, 450, 900
    assert spread_starts(1001, 100, 3).tolist() == [0, 450, 900]
    assert spread_starts(1001, 100, 1).tolist() == [0]
    # more windows than fit without overlap: capped at (n - 1) // block_size; null = all that fit
    assert spread_starts(1001, 100, 50).tolist() == list(range(0, 1000, 100))
    assert spread_starts(1001, 100, None).tolist() == list(range(0, 1000, 100))
    assert spread_starts(50, 100, 3).tolist() == []
    path, dtype = prepared.split_path("val"), prepared.meta["dtype"]
    a, b = ValidationWindows(path, dtype, 64, 256), ValidationWindows(path, dtype, 64, 256)
    assert a.starts.tolist() == b.starts.tolist() and torch.equal(a[255][0], b[255][0])


def test_val_windows_bad_value_fails_early(corpus):
    for bad in (0, -3, 2.5, "many"):
        with pytest.raises(ValueError, match=rf"data\.val_windows.*positive integer.*null.*got {bad!r}"):
            TextDataModule(corpus, val_windows=bad)


def test_bytes_separator_exactly_between_documents(prepared, corpus):
    raw = corpus.raw_text()
    assert chr(SEP) not in raw  # the separator never occurs in the embedded corpus
    for split in ("train", "val"):
        tokens = np.memmap(prepared.split_path(split), dtype=prepared.meta["dtype"], mode="r")
        offsets = prepared.meta["splits"][split]["doc_offsets"]
        assert np.flatnonzero(tokens == SEP).tolist() == [end - 1 for end in offsets[1:]]


class EditableCorpus(GutenbergCorpus):
    """A corpus whose documents the test chooses (and edits)."""

    def __init__(self, docs: dict[str, list[tuple[str, str]]]):
        super().__init__()
        self.docs = docs

    def documents(self):
        return {split: list(docs) for split, docs in self.docs.items()}


def small_docs(val_text="The cat sat on the mat.\n"):
    return {"train": [("A", "First training document.\n"), ("B", "Second one, naïve.\n")],
            "val": [("A", val_text), ("B", "Held-out text of B.\n")]}


def read_bin(out_dir: Path, split: str) -> list[int]:
    return np.fromfile(out_dir / f"{split}.bin", dtype=np.uint16).tolist()


def test_separator_in_document_text_cannot_fake_a_boundary(tmp_path):
    corpus = EditableCorpus({"train": [("A", "one\x1etwo\n"), ("B", "\x1e\x1e")], "val": [("A", "x\x1ey")]})
    prepare_token_files(corpus, get_tokenizer("bytes"), tmp_path)
    assert read_bin(tmp_path, "train") == list(b"onetwo\n") + [SEP] + [SEP]
    assert read_bin(tmp_path, "val") == list(b"xy") + [SEP]


def test_hub_rows_documents_or_lines(tmp_path, monkeypatch, capsys):
    """rows_are_documents (true by default; WikiText sets false): a separator after every row
    or none; switching it rebuilds the cache (the cache directory name does not include it)."""
    from data.corpus import HubCorpus

    rows = {"train": ["line one\n", "line two\n"], "val": ["held out\n", "more\n"]}
    monkeypatch.setattr(HubCorpus, "_load", lambda self: datasets.DatasetDict(
        {k: datasets.Dataset.from_dict({"text": v}) for k, v in rows.items()}))
    tok = get_tokenizer("bytes")
    prepare_token_files(HubCorpus("x/wiki", rows_are_documents=False), tok, tmp_path)
    assert read_bin(tmp_path, "val") == list(b"held out\nmore\n")  # lines of one running text
    capsys.readouterr()
    prepare_token_files(HubCorpus("x/wiki", rows_are_documents=True), tok, tmp_path)
    assert read_bin(tmp_path, "val") == list(b"held out\n") + [SEP] + list(b"more\n") + [SEP]
    assert len(stale_lines(capsys)) == 1
    rows["val"][1] = "MORE\n"  # the hub data changed: its datasets fingerprint changes (seen by verify)
    prepare_token_files(HubCorpus("x/wiki", rows_are_documents=True), tok, tmp_path, verify=True)
    assert read_bin(tmp_path, "val")[-6:-1] == list(b"MORE\n")


def stale_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "token cache" in line]


def test_cache_detects_truncated_bin(tmp_path, capsys):
    corpus, tok = EditableCorpus(small_docs()), get_tokenizer("bytes")
    prepare_token_files(corpus, tok, tmp_path)
    good = read_bin(tmp_path, "val")
    with open(tmp_path / "val.bin", "r+b") as f:
        f.truncate(2 * (len(good) - 3))  # lose the last three tokens
    capsys.readouterr()
    meta = prepare_token_files(corpus, tok, tmp_path)
    assert read_bin(tmp_path, "val") == good and meta["splits"]["val"]["num_tokens"] == len(good)
    lines = stale_lines(capsys)
    assert len(lines) == 1 and "val.bin" in lines[0] and "rebuilding" in lines[0]


def test_cache_with_broken_meta_is_rebuilt(tmp_path, capsys):
    corpus, tok = EditableCorpus(small_docs()), get_tokenizer("bytes")
    prepare_token_files(corpus, tok, tmp_path)
    (tmp_path / "meta.json").write_text('{"version": 2, "tokenizer"')  # cut off mid-write by another tool
    capsys.readouterr()
    meta = prepare_token_files(corpus, tok, tmp_path)
    assert "meta.json unreadable" in stale_lines(capsys)[0]
    assert json.loads((tmp_path / "meta.json").read_text())["splits"]["val"]["sha256"] == meta["splits"]["val"]["sha256"]


def test_cache_detects_edited_corpus_text(tmp_path, capsys):
    tok = get_tokenizer("bytes")
    prepare_token_files(EditableCorpus(small_docs("The cat sat on the mat.\n")), tok, tmp_path)
    capsys.readouterr()
    # same length, same tokenizer: only the text differs
    prepare_token_files(EditableCorpus(small_docs("The dog sat on the mat.\n")), tok, tmp_path)
    assert read_bin(tmp_path, "val")[:24] == list(b"The dog sat on the mat.\n")
    lines = stale_lines(capsys)
    assert len(lines) == 1 and "corpus" in lines[0]
    # unchanged corpus: reused, nothing printed
    prepare_token_files(EditableCorpus(small_docs("The dog sat on the mat.\n")), tok, tmp_path)
    assert stale_lines(capsys) == []


def test_cache_detects_switched_tokenizer(tmp_path, capsys):
    corpus, tok = EditableCorpus(small_docs()), get_tokenizer("bytes")
    prepare_token_files(corpus, tok, tmp_path)
    capsys.readouterr()
    # another tokenizer under the same name: byte b -> id 255 - b
    flipped = tiktoken.Encoding(name="bytes", pat_str=r"[\s\S]{1,64}", special_tokens={}, explicit_n_vocab=256,
                                mergeable_ranks={bytes([i]): 255 - i for i in range(256)})
    switched = dataclasses.replace(tok, encoding=flipped)
    prepare_token_files(corpus, switched, tmp_path)
    assert read_bin(tmp_path, "val")[:3] == [255 - b for b in b"The"]
    lines = stale_lines(capsys)
    assert len(lines) == 1 and "tokenizer 'bytes' changed" in lines[0]


def test_crash_during_rebuild_leaves_no_meta(tmp_path):
    tok = get_tokenizer("bytes")
    prepare_token_files(EditableCorpus(small_docs()), tok, tmp_path)

    class CrashesOnVal(EditableCorpus):  # train.bin is rewritten, then tokenizing val fails
        def load(self, workdir):
            splits = super().load(workdir)
            splits["val"] = datasets.Dataset.from_dict({"text": [None]})
            return splits

    edited = small_docs("Edited.\n")
    with pytest.raises(AttributeError, match="replace"):  # None has no .replace
        prepare_token_files(CrashesOnVal(edited), tok, tmp_path)
    assert not (tmp_path / "meta.json").exists()  # nothing points at the half-rebuilt files
    meta = prepare_token_files(EditableCorpus(edited), tok, tmp_path)
    assert read_bin(tmp_path, "val")[:9] == list(b"Edited.\n") + [SEP]
    assert meta["splits"]["val"]["num_tokens"] == len(read_bin(tmp_path, "val"))


def test_dataloader_batches(prepared):
    x, y = next(iter(prepared.train_dataloader()))
    assert x.shape == (4, 64) and torch.equal(x[:, 1:], y[:, :-1])
    assert int(x.max()) < prepared.vocab_size


def test_windows_refuse_too_short_file(tmp_path):
    path = tmp_path / "tiny.bin"
    np.arange(10, dtype=np.uint16).tofile(path)
    with pytest.raises(ValueError, match="fewer than one training window"):
        TrainWindows(path, "uint16", 64)
    with pytest.raises(ValueError, match="fewer than one validation window"):
        ValidationWindows(path, "uint16", 64)


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
        global_step, accumulate_grad_batches, global_rank, world_size = 3, 2, 0, 1

    fresh = list(zip(range(8), prepared.train_dataloader()))
    prepared.trainer = FakeTrainer()
    try:
        resumed = next(iter(prepared.train_dataloader()))
    finally:
        prepared.trainer = None
    assert torch.equal(resumed[0], fresh[6][1][0])  # 3 steps x 2 accumulated batches
