"""data/corpus.py HubCorpus on local parquet (the hub presets' code path, offline): a build leaves
no Arrow copy in the Hugging Face cache, nor anything but the token files in the cache folder,
also after a full verification; keep_arrow=true keeps it there (and shows the check can see it)."""

from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data.cache import prepare_token_files
from data.corpus import HubCorpus, held_out_evenly
from data.tokenizers import get_tokenizer

CACHE_FILES = {"meta.json", "train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy", "build.lock"}


def arrow_files(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.arrow")) if folder.exists() else []


def test_a_hub_corpus_build_leaves_no_arrow_copy_in_the_hf_cache(tmp_path, monkeypatch):
    texts = [f"document {i}: " + "words of web text " * (3 + i % 11) for i in range(300)]
    source = tmp_path / "corpus" / "part-000.parquet"
    source.parent.mkdir()
    pq.write_table(pa.table({"text": texts, "id": list(range(len(texts)))}), source)
    hf = tmp_path / "hf" / "datasets"  # HF_HOME's datasets cache, for this test
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", hf)
    monkeypatch.setattr(datasets.config, "DOWNLOADED_DATASETS_PATH", hf / "downloads")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
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
