"""data=text (the user's own .txt/.jsonl/.parquet files) and the hub corpora's code path on local
files written by the test: documents, splits, the cache, the streamed writer, fast offline failures."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import datasets
import numpy as np
import pytest
from hydra import compose, initialize_config_dir

from data.corpus import HubCorpus, TextFilesCorpus, document_key, find_corpus_files, held_out_by_hash, held_out_evenly
from data.cache import prepare_token_files
from data.shards import token_source
from data.stream import load_tokens
from data.tokenizers import get_tokenizer
from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
SEP = 0x1E  # the bytes tokenizer's document separator


def docs(n: int, prefix: str = "doc") -> list[str]:
    """Distinct documents of varied length (a few hundred bytes each)."""
    return [f"{prefix} {i}: " + " ".join(f"w{(i * 7 + j) % 97}" for j in range(20 + 13 * (i % 5))) + "\n"
            for i in range(n)]


def write_txt(folder: Path, texts: list[str]) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, text in enumerate(texts):
        paths.append(folder / f"{i:03d}.txt")
        paths[-1].write_text(text, encoding="utf-8")
    return paths


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list[str], field: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    datasets.Dataset.from_dict({"id": list(range(len(texts))), field: texts}).to_parquet(str(path))
    return path


def split_texts(corpus, workdir: Path) -> dict[str, list[str]]:
    loaded = corpus.load(workdir)
    return {split: list(loaded[split]["text"]) for split in ("train", "val")}


def split_tokens(out_dir: Path, meta: dict, split: str) -> np.ndarray:
    """A split's tokens as the training run reads them (one file, or a sharded cache's parts)."""
    return np.asarray(load_tokens(token_source(out_dir, meta, split), meta["dtype"]))


def token_files(out_dir: Path) -> dict[str, bytes]:
    """Every token and offsets file of a cache (a sharded one's under shards/), by relative path."""
    return {p.relative_to(out_dir).as_posix(): p.read_bytes() for p in sorted(out_dir.rglob("*"))
            if p.name.endswith((".bin", ".npy"))}


def read_documents(out_dir: Path, meta: dict, split: str) -> list[bytes]:
    tokens = split_tokens(out_dir, meta, split)
    offsets = np.asarray(meta["splits"][split]["doc_offsets"])
    return [bytes(tokens[a:b].tolist()) for a, b in zip(offsets[:-1], offsets[1:])]


@pytest.mark.parametrize("fmt", ["txt", "jsonl", "parquet"])
def test_each_format_tokenizes_every_document_once(fmt, tmp_path):
    texts = docs(12)
    if fmt == "txt":
        write_txt(tmp_path / "corpus", texts)
        corpus = TextFilesCorpus([str(tmp_path / "corpus")], val_fraction=0.25)
    elif fmt == "jsonl":
        write_jsonl(tmp_path / "corpus.jsonl", texts, field="body")
        corpus = TextFilesCorpus(str(tmp_path / "corpus.jsonl"), text_field="body", val_fraction=0.25)
    else:
        write_parquet(tmp_path / "corpus.parquet", texts, field="content")
        corpus = TextFilesCorpus([str(tmp_path / "corpus.parquet")], text_field="content", val_fraction=0.25)
    out = tmp_path / "tokens"
    meta = prepare_token_files(corpus, get_tokenizer("bytes"), out)
    written = read_documents(out, meta, "train") + read_documents(out, meta, "val")
    # every document exactly once, byte for byte, each followed by one separator
    assert sorted(written) == sorted(t.encode() + bytes([SEP]) for t in texts)
    assert meta["splits"]["val"]["num_tokens"] > 0 and len(read_documents(out, meta, "val")) >= 1


def test_plain_text_split_by_paragraph_and_line(tmp_path):
    (tmp_path / "book.txt").write_text("First paragraph\nstill first.\n\nSecond one.\n\n\nThird.\n")
    by_paragraph = TextFilesCorpus([str(tmp_path / "book.txt")], text_sample_by="paragraph", val_fraction=0.5)
    texts = split_texts(by_paragraph, tmp_path / "p")
    assert sorted(t.strip() for t in texts["train"] + texts["val"]) == [
        "First paragraph\nstill first.", "Second one.", "Third."]
    by_line = TextFilesCorpus([str(tmp_path / "book.txt")], text_sample_by="line", val_fraction=0.5)
    texts = split_texts(by_line, tmp_path / "l")  # blank lines are empty documents: dropped
    assert sorted(texts["train"] + texts["val"]) == ["First paragraph", "Second one.", "Third.", "still first."]


def test_globs_and_directories_pick_supported_files(tmp_path):
    root = tmp_path / "data"
    write_txt(root / "books", docs(3, "book"))
    write_jsonl(root / "web" / "deep" / "part-0.jsonl", docs(4, "web"))
    write_parquet(root / "web" / "part-1.parquet", docs(2, "pq"))
    (root / "web" / "README.md").write_text("not a corpus file")
    write_txt(root / ".cache", ["hidden: never read\n"])
    (root / "books" / ".notes.txt").write_text("hidden too\n")

    every = find_corpus_files([str(root)])
    assert [p.relative_to(root.resolve()).as_posix() for p in every] == [
        "books/000.txt", "books/001.txt", "books/002.txt", "web/deep/part-0.jsonl", "web/part-1.parquet"]
    assert find_corpus_files([str(root / "**" / "*.jsonl")]) == [(root / "web/deep/part-0.jsonl").resolve()]
    # entries may overlap and come in any order: each file once, sorted
    assert find_corpus_files([str(root / "web"), str(root / "books" / "*.txt"), str(root)]) == every

    texts = split_texts(TextFilesCorpus([str(root)], val_fraction=0.3), tmp_path / "work")
    assert sorted(texts["train"] + texts["val"]) == sorted(docs(3, "book") + docs(4, "web") + docs(2, "pq"))
    only_web = split_texts(TextFilesCorpus([str(root / "web" / "**" / "*.jsonl")], val_fraction=0.3), tmp_path / "w")
    assert sorted(only_web["train"] + only_web["val"]) == sorted(docs(4, "web"))


def test_split_is_by_whole_document_and_seed_independent(tmp_path):
    texts = docs(60)
    write_jsonl(tmp_path / "a.jsonl", texts[:30])
    write_parquet(tmp_path / "b.parquet", texts[30:])
    corpus = TextFilesCorpus([str(tmp_path / "*.jsonl"), str(tmp_path / "*.parquet")], val_fraction=0.2)
    split = split_texts(corpus, tmp_path / "w1")
    assert not set(split["train"]) & set(split["val"])  # no document on both sides
    assert sorted(split["train"] + split["val"]) == sorted(texts)  # every document somewhere, once
    # the rule: held out exactly when the document's hash is below val_fraction x 2^64
    assert set(split["val"]) == {t for t in texts if document_key(t) < int(0.2 * 2**64)}
    assert 4 <= len(split["val"]) <= 20
    # deterministic; adding a file moves no existing document across the split
    write_jsonl(tmp_path / "c.jsonl", docs(10, "extra"))
    grown = split_texts(TextFilesCorpus([str(tmp_path)], val_fraction=0.2), tmp_path / "w2")
    assert set(split["val"]) <= set(grown["val"]) and set(split["train"]) <= set(grown["train"])


def test_held_out_by_hash_keeps_one_document_each_side():
    keys = np.array([5, 2**63, 2**64 - 1, 9], dtype=np.uint64)
    train, val = held_out_by_hash(keys, 0.01)  # nothing below 0.01 x 2^64 but keys 5 and 9
    assert val.tolist() == [0, 3] and train.tolist() == [1, 2]
    train, val = held_out_by_hash(np.array([2**62, 2**63], dtype=np.uint64), 0.1)  # none below: smallest held out
    assert val.tolist() == [0] and train.tolist() == [1]
    train, val = held_out_by_hash(np.array([1, 2], dtype=np.uint64), 0.5)  # all below: the largest trains
    assert val.tolist() == [0] and train.tolist() == [1]
    with pytest.raises(ValueError, match="at least two"):
        held_out_by_hash(np.array([1], dtype=np.uint64), 0.5)


def test_fingerprint_and_cache_follow_file_edits(tmp_path, capsys, monkeypatch):
    paths = write_txt(tmp_path / "c", docs(6))
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.3)
    tok, out = get_tokenizer("bytes"), tmp_path / "tokens"
    before, quick = corpus.fingerprint(), corpus.quick_fingerprint()
    assert TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.3).fingerprint() == before
    assert TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.4).fingerprint() != before
    assert TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.4).quick_fingerprint() != quick
    prepare_token_files(corpus, tok, out)
    capsys.readouterr()

    # same length, only the bytes differ; the edit moves the mtime (1 s on: coarse clocks)
    stat = paths[2].stat()
    old = paths[2].read_text()
    new = old.replace("doc 2", "DOC 2")
    assert len(new) == len(old) and new != old
    paths[2].write_text(new)
    os.utime(paths[2], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert corpus.fingerprint() != before and corpus.quick_fingerprint() != quick
    meta = prepare_token_files(corpus, tok, out)
    assert "corpus changed" in capsys.readouterr().out
    written = read_documents(out, meta, "train") + read_documents(out, meta, "val")
    assert new.encode() + bytes([SEP]) in written and old.encode() + bytes([SEP]) not in written

    # unchanged: reused without a word, and without reading the files (sizes and mtimes only)
    import data.corpus

    monkeypatch.setattr(data.corpus.TextFilesCorpus, "fingerprint", lambda self: pytest.fail("files were hashed"))
    prepare_token_files(corpus, tok, out)
    assert "token cache" not in capsys.readouterr().out
    monkeypatch.undo()
    # touched, content unchanged: hashed once, said so, not rebuilt
    built = {p: p.stat().st_mtime_ns for p in out.rglob("*.bin")}
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    prepare_token_files(corpus, tok, out)
    assert "content is unchanged: used as it is" in capsys.readouterr().out
    assert built and {p: p.stat().st_mtime_ns for p in out.rglob("*.bin")} == built
    prepare_token_files(corpus, tok, out)
    assert "token cache" not in capsys.readouterr().out


def test_errors_name_data_paths_and_what_was_found(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    (tmp_path / "paper.pdf").write_bytes(b"%PDF")
    with pytest.raises(ValueError, match=r"data\.paths.*'.*nothing/\*\.txt' matches no file"):
        TextFilesCorpus([str(tmp_path / "nothing" / "*.txt")])
    with pytest.raises(ValueError, match=r"(?s)data\.paths=.*names no corpus file \(found only 2 file\(s\) of other "
                                         r"kinds: .*notes\.csv.*paper\.pdf.*supported: \.txt"):
        TextFilesCorpus([str(tmp_path)])
    with pytest.raises(ValueError, match=r"data\.paths: .*notes\.csv' has an unsupported format '\.csv'"):
        TextFilesCorpus([str(tmp_path / "notes.csv")])
    with pytest.raises(ValueError, match=r"data\.paths: .*missing\.txt' is neither a file, a directory nor a glob"):
        TextFilesCorpus([str(tmp_path / "missing.txt")])
    with pytest.raises(ValueError, match=r"data\.paths is empty"):
        TextFilesCorpus([])
    with pytest.raises(ValueError, match=r"data\.val_fraction must be in \(0, 0\.5\]"):
        TextFilesCorpus([str(tmp_path)], val_fraction=0.0)


def test_missing_text_field_and_single_document_fail_clearly(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", docs(5), field="content")
    with pytest.raises(ValueError, match=r"data\.text_field='text' is not a field of the \.jsonl files .*"
                                         r"fields found: id, content"):
        TextFilesCorpus([str(tmp_path / "a.jsonl")]).load(tmp_path / "w")
    write_parquet(tmp_path / "p" / "b.parquet", docs(5), field="body")
    with pytest.raises(ValueError, match=r"data\.text_field='text' is not a field of the \.parquet files"):
        TextFilesCorpus([str(tmp_path / "p")]).load(tmp_path / "w")
    # one document: a lone .txt is refused at once; a one-line JSONL when its rows are read
    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "only.txt").write_text("just one\n")
    with pytest.raises(ValueError, match=r"data\.paths names one document .*only\.txt.*at least two.*"
                                         r"text_sample_by=paragraph"):
        TextFilesCorpus([str(tmp_path / "t")])
    write_jsonl(tmp_path / "one" / "one.jsonl", ["single\n", "", "  \n"])  # empty documents do not count
    with pytest.raises(ValueError, match=r"data\.paths holds 1 non-empty document\(s\).*at least two"):
        TextFilesCorpus([str(tmp_path / "one")]).load(tmp_path / "w")


def compose_config(overrides, tmp_path):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[*overrides, f"paths.output_dir={tmp_path / 'out'}"])


def test_configs_compose_and_validate(tmp_path):
    from pelab.config import ConfigError
    from pelab.validate import validate_config

    write_txt(tmp_path / "c", docs(3))
    cfg = compose_config(["data=text", f"data.paths=[{tmp_path / 'c'}]"], tmp_path)
    validate_config(cfg)
    assert cfg.data.corpus.paths == [str(tmp_path / "c")] and cfg.data.corpus.text_field == "text"
    for data in ("wikitext103", "fineweb_edu", "openwebtext"):  # no network needed to validate
        validate_config(compose_config([f"data={data}", "model=gpt2"], tmp_path))
    fineweb = compose_config(["data=fineweb_edu"], tmp_path).data
    assert (fineweb.corpus.path, fineweb.corpus.name, fineweb.tokenizer) == ("HuggingFaceFW/fineweb-edu",
                                                                             "sample-10BT", "gpt2")
    assert compose_config(["data=openwebtext"], tmp_path).data.corpus.path == "Skylion007/openwebtext"
    with pytest.raises(ConfigError, match=r"data\.paths is empty"):
        validate_config(compose_config(["data=text"], tmp_path))
    with pytest.raises(ConfigError, match=r"data\.paths: .*matches no file"):
        validate_config(compose_config(["data=text", f"data.paths=[{tmp_path}/*.jsonl]"], tmp_path))


def test_hub_code_path_on_local_parquet_holds_out_evenly_and_shards(tmp_path):
    """HubCorpus on a local parquet file (the code path of data=fineweb_edu/openwebtext without
    the download): val_documents rows spread evenly are held out, and tokenizing with 2
    processes writes the same bins as one process, in row order."""
    texts = docs(50)
    write_parquet(tmp_path / "train.parquet", texts)
    corpus = HubCorpus("parquet", data_files={"train": str(tmp_path / "train.parquet")}, val_split=None,
                       val_documents=5)
    assert not corpus.needs_hub
    train_idx, val_idx = held_out_evenly(50, 5)
    assert val_idx.tolist() == [0, 10, 20, 30, 40] and len(train_idx) == 45
    tok = get_tokenizer("bytes")
    one, two = tmp_path / "one", tmp_path / "two"
    meta1 = prepare_token_files(corpus, tok, one)
    meta2 = prepare_token_files(corpus, tok, two, num_proc=2)
    for split, rows in (("train", train_idx), ("val", val_idx)):
        expected = [ids for i in rows for ids in tok.encode(texts[i]) + [tok.eot_token]]
        assert np.fromfile(one / f"{split}.bin", dtype=np.uint16).tolist() == expected
        assert (one / f"{split}.bin").read_bytes() == (two / f"{split}.bin").read_bytes()
        same = ("num_tokens", "num_documents", "max_id", "sha256")
        assert [meta1["splits"][split][k] for k in same] == [meta2["splits"][split][k] for k in same]
        assert np.array_equal(meta1["splits"][split]["doc_offsets"], meta2["splits"][split]["doc_offsets"])
    assert not list(one.glob("*.partial")) and not list(two.glob("*.partial"))
    with pytest.raises(ValueError, match=r"has 50 rows: data\.corpus\.val_documents=50"):
        HubCorpus("parquet", data_files=str(tmp_path / "train.parquet"), val_split=None, val_documents=50).load()


def test_streamed_writer_uses_small_batches(tmp_path, monkeypatch, tokenizer="bytes"):
    """The .bin is written batch by batch: with 7-document batches (some batches straddling
    nothing but the split) the files equal one-shot writing and the tokenizer's own encoding."""
    import data.cache

    texts = docs(40)
    write_jsonl(tmp_path / "c" / "a.jsonl", texts)
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2)
    tok = get_tokenizer(tokenizer)
    whole = prepare_token_files(corpus, tok, tmp_path / "whole")
    encoded = []
    monkeypatch.setattr(data.cache, "BATCH_DOCUMENTS", 7)
    original = type(tok).encode_array
    monkeypatch.setattr(type(tok), "encode_array", lambda self, t, *a: encoded.append(len(t)) or original(self, t, *a))
    small = prepare_token_files(corpus, tok, tmp_path / "small")
    assert max(encoded) == 7 and sum(encoded) == 40 and len(encoded) >= 6
    assert token_files(tmp_path / "whole") == token_files(tmp_path / "small")
    for split in ("train", "val"):
        assert np.array_equal(whole["splits"][split]["doc_offsets"], small["splits"][split]["doc_offsets"])
        tokens = split_tokens(tmp_path / "small", small, split)
        offsets = small["splits"][split]["doc_offsets"]
        documents = [tokens[a:b].tolist() for a, b in zip(offsets[:-1], offsets[1:])]
        assert documents == [tok.encode(t) + [tok.eot_token] for t in split_texts(corpus, tmp_path / split)[split]]


OFFLINE_SNIPPET = """
import time
from data.corpus import HubCorpus
t0 = time.perf_counter()
try:
    HubCorpus("HuggingFaceFW/fineweb-edu", "sample-10BT", val_split=None).load()
except RuntimeError as err:
    print(f"FAILED after {time.perf_counter() - t0:.3f}s: {err}")
"""
NEEDED = ("network access to", "HF_HOME", "HF_HUB_OFFLINE=1", "data=text")


def test_hub_corpus_offline_mode_fails_fast_with_what_is_needed(tmp_path):
    """HF_HUB_OFFLINE=1 set at launch (as a user does; the libraries read it at import), empty cache."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HF_")}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", OFFLINE_SNIPPET], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env={**clean, "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    assert "FAILED after" in proc.stdout, proc.stdout + proc.stderr[-3000:]
    # the failure itself (after the imports, which a loaded 2-core box takes ~10 s for) is immediate
    assert float(proc.stdout.split("FAILED after ")[1].split("s:")[0]) < 5.0
    assert wall < 60, wall
    for needed in NEEDED:
        assert needed in proc.stdout, proc.stdout


def test_hub_corpus_unreachable_endpoint_fails_fast(tmp_path, monkeypatch):
    """No offline variable, the hub unreachable (nothing listens on 127.0.0.1:9): one TCP
    connect, no download retries."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError) as err:
        HubCorpus("Skylion007/openwebtext", val_split=None).load()
    assert time.perf_counter() - t0 < 5.0
    assert "http://127.0.0.1:9 is unreachable" in str(err.value)
    for needed in NEEDED:
        assert needed in str(err.value)


def test_train_py_on_own_files_writes_extrapolation_table(tmp_path):
    from evaluation.extrapolation import read_csv

    write_txt(tmp_path / "corpus" / "txt", docs(20, "plain"))
    write_jsonl(tmp_path / "corpus" / "web.jsonl", docs(20, "web"), field="content")
    run = tmp_path / "run"
    args = [
        "data=text", f"data.paths=[{tmp_path / 'corpus'}]", "data.text_field=content", "data.val_fraction=0.3",
        "logger=csv", f"hydra.run.dir={run}", "model.n_layer=1", "model.n_embd=32", "model.n_head=2",
        "model.block_size=32", "data.batch_size=4", "trainer.max_steps=2", "trainer.val_check_interval=2",
        "trainer.limit_val_batches=2", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
        "optim.warmup_steps=1", "eval.extrapolation.multipliers=[1,2]", "eval.extrapolation.max_tokens=256",
    ]
    proc = run_python(["train.py", *args], cwd=ROOT, timeout=300,
                      env={**os.environ, "HYDRA_FULL_ERROR": "1", "PELAB_CACHE": str(tmp_path / "cache")})
    # the JSONL's field is 'content' but the .txt files are read whole: both formats in one corpus
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = read_csv(run / "extrapolation" / "extrapolation.csv")
    assert [(r.eval_length, r.ok) for r in rows] == [(32, True), (64, True)]
    assert all(1 < r.ppl < 300 for r in rows)
    cache = next((tmp_path / "cache" / "data").glob("files-corpus-*/bytes"))
    manifest = json.loads((cache / "meta.json").read_text())
    assert sum(len(np.load(f)) - 1 for f in cache.glob("shards/*/*.offsets.npy")) == 40
    assert sum(manifest["splits"][split]["num_documents"] for split in ("train", "val")) == 40
