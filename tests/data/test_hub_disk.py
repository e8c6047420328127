"""data/corpus.py HubCorpus on local parquet (the hub presets' code path, offline): a build reads
the parquet files in place (no Arrow copy anywhere; the build's scratch under 1 byte per token
beyond the result), writes the same token files as the ``datasets`` path (keep_arrow=true, kept
in the Hugging Face cache), and leaves nothing but the token files in the cache folder, also
after a full verification; a corpus that is not parquet still goes through an Arrow copy, removed
after the build."""

import json
import os
import threading
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import data.cache
import data.corpus
from data.cache import prepare_token_files
from data.corpus import HubCorpus, held_out_evenly
from data.tokenizers import get_tokenizer

CACHE_FILES = {"meta.json", "train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy", "build.lock"}
TOKEN_FILES = ("train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy")


def arrow_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.arrow")) if folder.exists() else []


def folder_bytes(*folders: Path) -> int:
    """The sizes of the files under ``folders`` (files removed while it looks are skipped)."""
    total = 0
    for folder in folders:
        for root, _, names in os.walk(folder):
            for name in names:
                try:
                    total += os.stat(os.path.join(root, name)).st_size
                except FileNotFoundError:
                    pass
    return total


def web_texts(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [f"document {i}: " + "words of web text " * int(rng.integers(1, 40)) + "é…\n" * (i % 3) for i in range(n)]


@pytest.fixture
def offline_hf(tmp_path, monkeypatch):
    """An empty HF_HOME datasets cache and HF_HUB_OFFLINE=1, for this test."""
    hf = tmp_path / "hf" / "datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", hf / "downloads")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf


def test_a_hub_corpus_build_leaves_no_arrow_copy_in_the_hf_cache(tmp_path, offline_hf):
    texts = [f"document {i}: " + "words of web text " * (3 + i % 11) for i in range(300)]
    source = tmp_path / "corpus" / "part-000.parquet"
    source.parent.mkdir()
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), source)
    hf = offline_hf
    tok = get_tokenizer("bytes")

    def corpus(**options):
        return HubCorpus("parquet", None, val_split=None, val_documents=30, data_files=[str(source)], **options)

    out = tmp_path / "cache"
    meta = prepare_token_files(corpus(), tok, out)
    assert arrow_files(tmp_path / "hf") == []
    assert {p.name for p in out.iterdir()} == CACHE_FILES  # no build/ folder, no lease
    train_rows, _ = held_out_evenly(len(texts), 30)  # the right documents were tokenized
    expected = [b for i in train_rows for b in list(texts[i].encode()) + [tok.eot_token]]
    assert np.fromfile(out / "train.bin", dtype=np.uint16).tolist() == expected
    assert meta["splits"]["val"]["num_documents"] == 30

    verified = prepare_token_files(corpus(), tok, out, verify=True)  # the full check loads the corpus too
    assert verified["splits"]["train"]["sha256"] == meta["splits"]["train"]["sha256"]
    assert arrow_files(tmp_path / "hf") == [] and {p.name for p in out.iterdir()} == CACHE_FILES

    kept = prepare_token_files(corpus(keep_arrow=True), tok, tmp_path / "kept")  # on request: as datasets does
    assert kept["corpus_hash"] == meta["corpus_hash"]  # where the Arrow copy lives changes no fingerprint
    assert arrow_files(hf) != []


@pytest.mark.parametrize("own_val_split", [False, True])
def test_in_place_build_equals_the_datasets_path_byte_for_byte(tmp_path, offline_hf, monkeypatch, own_val_split):
    """3 files of several row groups (read in the order datasets reads them), held-out rows spread
    over all of them, another text column name: the in-place build never calls load_dataset and
    its token files equal those of the Arrow path (keep_arrow=true) and of a naive tokenization
    of the rows held out independently."""
    texts = web_texts(257)
    folder = tmp_path / "corpus"
    folder.mkdir()
    bounds = [0, 90, 91, 257]  # a one-row file too
    for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
        pq.write_table(pa.table({"id": list(range(a, b)), "content": texts[a:b]}), folder / f"part-{k:03d}.parquet",
                       row_group_size=17)
    val_texts = web_texts(23, seed=1)
    pq.write_table(pa.table({"content": val_texts}), folder / "val.parquet", row_group_size=5)
    if own_val_split:
        options = {"data_files": {"train": str(folder / "part-*.parquet"), "validation": str(folder / "val.parquet")}}
        train_rows, expected_val = np.arange(len(texts)), val_texts
    else:
        options = {"data_files": [str(folder / "part-*.parquet")], "val_split": None, "val_documents": 40}
        train_rows = np.array([i for i in range(len(texts)) if i not in {i * len(texts) // 40 for i in range(40)}])
        expected_val = [texts[i * len(texts) // 40] for i in range(40)]
    tok = get_tokenizer("bytes")

    def corpus(**extra):
        return HubCorpus("parquet", None, text_column="content", **options, **extra)

    old = prepare_token_files(corpus(keep_arrow=True), tok, tmp_path / "old")  # the datasets path, forced
    calls = []
    original = datasets.load_dataset
    monkeypatch.setattr(datasets, "load_dataset", lambda *a, **k: calls.append(a) or original(*a, **k))
    new = prepare_token_files(corpus(), tok, tmp_path / "new")
    assert calls == []  # no Arrow copy was made
    for name in TOKEN_FILES:
        assert (tmp_path / "new" / name).read_bytes() == (tmp_path / "old" / name).read_bytes(), name
    assert new["corpus_hash"] == old["corpus_hash"]
    for split, rows in (("train", [texts[i] for i in train_rows]), ("val", expected_val)):
        naive = [b for t in rows for b in list(t.encode()) + [tok.eot_token]]
        assert np.fromfile(tmp_path / "new" / f"{split}.bin", dtype=np.uint16).tolist() == naive
        assert new["splits"][split]["num_documents"] == len(rows)


def test_in_place_build_scratch_is_under_one_byte_per_token(tmp_path, offline_hf, monkeypatch):
    """Bytes under the cache folder and HF_HOME, sampled at every batch read and by a thread,
    never exceed the download plus the finished cache by more than 1 byte per token."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = web_texts(2000)
    for k in range(4):  # with a metadata column, as the hub's corpora have (datasets' Arrow copy holds it too)
        part = texts[k::4]
        urls = [f"https://example.com/crawl-2024-10/{k}/{i}/{'index' * (i % 9)}.html" for i in range(len(part))]
        pq.write_table(pa.table({"text": part, "url": urls}), folder / f"part-{k}.parquet", row_group_size=100)
    hf_home, out = tmp_path / "hf", tmp_path / "cache"
    download = folder_bytes(folder, hf_home)  # local data_files: the download is the files themselves
    peak, arrow_seen = [0], []

    def sample():
        peak[0] = max(peak[0], folder_bytes(folder, hf_home, out))
        arrow_seen.extend(arrow_files(out) + arrow_files(hf_home))

    write_split = data.cache.write_split  # a sample as each split begins: any copy of the corpus exists by then
    monkeypatch.setattr(data.cache, "write_split", lambda *a: sample() or write_split(*a))
    original = data.corpus.ParquetRows.iter
    # batches of 50 rows: a sample after each of many batches
    monkeypatch.setattr(data.corpus.ParquetRows, "iter",
                        lambda self, batch_size: (sample() or table for table in original(self, 50)))
    done = threading.Event()
    sampler = threading.Thread(target=lambda: [sample() for _ in iter(lambda: done.wait(0.002), True)])
    sampler.start()
    try:
        meta = prepare_token_files(HubCorpus("parquet", None, val_split=None, val_documents=100,
                                             data_files=[str(folder / "*.parquet")]), get_tokenizer("bytes"), out)
    finally:
        done.set()
        sampler.join()
    tokens = sum(meta["splits"][s]["num_tokens"] for s in ("train", "val"))
    result = folder_bytes(out)
    assert folder_bytes(folder, hf_home) == download and arrow_files(hf_home) == []
    scratch = peak[0] - download - result
    assert arrow_seen == []  # no copy of the corpus at any time
    assert scratch <= tokens, (scratch, tokens)  # <= 1 byte per token beyond the result
    assert peak[0] >= download + result * 0.5  # the sampling saw the build's files


def test_a_corpus_that_is_not_parquet_goes_through_an_arrow_copy_removed_after(tmp_path, offline_hf):
    folder = tmp_path / "corpus"
    folder.mkdir()
    texts = web_texts(60)
    (folder / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    corpus = HubCorpus("json", None, val_split=None, val_documents=6, data_files=[str(folder / "a.jsonl")])
    tok = get_tokenizer("bytes")
    out = tmp_path / "cache"
    prepare_token_files(corpus, tok, out)
    assert corpus._sources is None  # not parquet: datasets' Arrow copy in build/, removed with it
    assert {p.name for p in out.iterdir()} == CACHE_FILES and arrow_files(tmp_path / "hf") == []
    train_rows, _ = held_out_evenly(len(texts), 6)
    expected = [b for i in train_rows for b in list(texts[i].encode()) + [tok.eot_token]]
    assert np.fromfile(out / "train.bin", dtype=np.uint16).tolist() == expected


def test_a_hub_repository_downloaded_earlier_builds_offline_from_the_download(tmp_path, offline_hf, monkeypatch):
    """A hub dataset repository as the Hugging Face cache holds it after a download (refs/main, a
    snapshot with the README's configs and the parquet files of one config) and no Arrow cache:
    with HF_HUB_OFFLINE=1 the build reads that download in place, the right config's rows."""
    import huggingface_hub

    hub = tmp_path / "hf" / "hub"
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    repo = hub / "datasets--someone--web-corpus"
    snapshot = repo / "snapshots" / ("ab" * 20)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("ab" * 20)
    texts, other = web_texts(120), web_texts(30, seed=2)
    (snapshot / "sample" / "small").mkdir(parents=True)
    for k in range(2):
        blob = repo / "blobs" / f"{k:064x}"  # a snapshot's files are links to blobs named by content
        blob.parent.mkdir(exist_ok=True)
        pq.write_table(pa.table({"text": texts[k * 60:(k + 1) * 60]}), blob)
        (snapshot / "sample" / "small" / f"{k}.parquet").symlink_to(blob)
    (snapshot / "other").mkdir()
    pq.write_table(pa.table({"text": other}), snapshot / "other" / "000.parquet")
    (snapshot / "README.md").write_text(
        "---\nconfigs:\n- config_name: sample-small\n  data_files:\n  - split: train\n    path: sample/small/*\n"
        "- config_name: other\n  data_files:\n  - split: train\n    path: other/*\n---\n# a corpus\n")
    corpus = HubCorpus("someone/web-corpus", "sample-small", val_split=None, val_documents=12)
    assert corpus.needs_hub
    tok = get_tokenizer("bytes")
    out = tmp_path / "cache"
    meta = prepare_token_files(corpus, tok, out)
    train_rows, val_rows = held_out_evenly(len(texts), 12)
    for split, rows in (("train", train_rows), ("val", val_rows)):
        naive = [b for i in rows for b in list(texts[i].encode()) + [tok.eot_token]]
        assert np.fromfile(out / f"{split}.bin", dtype=np.uint16).tolist() == naive
    assert meta["splits"]["train"]["num_documents"] == 108
    commit = "ab" * 20  # the files named as datasets names them online: one fingerprint either way
    assert corpus._sources == {"train": [[f"hf://datasets/someone/web-corpus@{commit}/sample/small/{k}.parquet"
                                          for k in range(2)], [["someone/web-corpus", commit]] * 2]}
    assert {p.name for p in out.iterdir()} == CACHE_FILES and arrow_files(tmp_path / "hf") == []
