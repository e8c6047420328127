"""data/cache.py: one builder across processes, a crashed builder's lock recovered, a token file
corrupted in place refused and rebuilt, only token files and small metadata left after a build,
a start-up check that opens no corpus, and scripts/prepare_data.py."""

import json
import multiprocessing
import os
import time
from pathlib import Path

import numpy as np
import pytest
from filelock import FileLock

import data.cache
import data.shards
from data.cache import prepare_token_files
from data.shards import token_source
from data.stream import load_tokens
from data.corpus import HubCorpus, TextFilesCorpus
from data.tokenizers import get_tokenizer

ROOT = Path(__file__).resolve().parents[2]
SEP = 0x1E
CACHE_FILES = {"meta.json", "shards"}  # a corpus of files: the manifest and one folder per group of files
SHARD_FILES = {"shard.json", "train.bin", "val.bin", "train.offsets.npy", "val.offsets.npy"}


def token_files(out_dir: Path) -> dict[str, bytes]:
    """Every token and offsets file of a sharded cache, by relative path."""
    return {p.relative_to(out_dir).as_posix(): p.read_bytes() for p in sorted(out_dir.rglob("*"))
            if p.name.endswith((".bin", ".npy"))}


def first_bin(out_dir: Path, split: str = "train") -> Path:
    """The token file of the split's first part (data/shards.py)."""
    key, file_split = json.loads((out_dir / "meta.json").read_text())["splits"][split]["parts"][0][:2]
    return out_dir / "shards" / key / f"{file_split}.bin"


def corpus_files(folder: Path, n: int = 24) -> TextFilesCorpus:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (folder / f"{i:02d}.txt").write_text(f"document {i}: " + "lorem ipsum " * (5 + i % 7) + "\n")
    return TextFilesCorpus([str(folder)], val_fraction=0.25)


def expected_tokens(corpus: TextFilesCorpus, split: str, workdir: Path) -> list[int]:
    """The split's documents by hand: each one's UTF-8 bytes, then the separator."""
    texts = list(corpus.load(workdir)[split]["text"])
    return [b for t in texts for b in list(t.encode()) + [SEP]]


def preparer(out_dir, folder, start, results, slow):
    """One competing process: waits for the others, then prepares the same cache."""
    import contextlib
    import io

    from data.cache import Throughput

    if slow:  # the builder holds the lock long enough for the others to find it held
        import data.shards

        original = data.shards.build_shard
        data.shards.build_shard = lambda *a, **k: (time.sleep(slow), original(*a, **k))[1]
    log = io.StringIO()
    stats = Throughput()
    start.wait()
    try:
        with contextlib.redirect_stdout(log):
            prepare_token_files(TextFilesCorpus([folder], val_fraction=0.25), get_tokenizer("bytes"), Path(out_dir),
                                stats=stats)
        results.put((os.getpid(), stats.built, log.getvalue(), None))
    except BaseException as err:  # noqa: BLE001 - reported to the test
        results.put((os.getpid(), False, log.getvalue(), repr(err)))


def test_concurrent_preparers_build_once_and_agree(tmp_path):
    """Three processes on one fresh cache: one builds, two wait (saying so) and reuse it; no
    crash; the files are those of a lone build, byte for byte."""
    corpus = corpus_files(tmp_path / "c")
    alone = prepare_token_files(corpus, get_tokenizer("bytes"), tmp_path / "alone")
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Barrier(3), ctx.Queue()
    out = tmp_path / "shared"
    procs = [ctx.Process(target=preparer, args=(str(out), str(tmp_path / "c"), start, results, 2.0))
             for _ in range(3)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert [r[3] for r in reports] == [None, None, None], reports
    assert sum(r[1] for r in reports) == 1, reports  # exactly one build
    waiters = [r for r in reports if not r[1]]
    builder = next(r for r in reports if r[1])
    # a waiter the machine's load held back past the build finds the cache built, silently; one that looked
    # while the holder was descheduled between its flock and its lease names no pid (tests/data/test_cache_lock.py
    # checks the named holder)
    named = (f"is being built by pid {builder[0]}", "is being built by another process")
    for r in waiters:
        assert "tokenizing" not in r[2] and (not r[2] or any(n in r[2] for n in named)), r[2]
    assert any("waiting for it" in r[2] for r in waiters), reports
    assert token_files(out) == token_files(tmp_path / "alone") and token_files(out)
    assert json.loads((out / "meta.json").read_text())["splits"]["val"]["sha256"] == alone["splits"]["val"]["sha256"]


def crashing_builder(out_dir, folder):
    """Dies (no cleanup, no exception handling) halfway through writing the token files: after
    the first shard, in the middle of the second one's train split."""
    import data.shards

    original, writes = data.shards.SplitWriter.add, []

    def die_in_second_shard(self, *args, **kwargs):
        writes.append(self.path.parent)
        if len(set(writes)) == 2:
            os._exit(3)
        return original(self, *args, **kwargs)

    data.shards.SplitWriter.add = die_in_second_shard
    prepare_token_files(TextFilesCorpus([folder], val_fraction=0.25), get_tokenizer("bytes"), Path(out_dir))


def test_a_crashed_builders_lock_is_released(tmp_path, monkeypatch):
    monkeypatch.setattr(data.shards, "GROUP_FILES", 4)  # several groups of files: a second shard to die in
    corpus = corpus_files(tmp_path / "c")
    proc = multiprocessing.get_context("fork").Process(target=crashing_builder,
                                                       args=(str(tmp_path / "t"), str(tmp_path / "c")))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == 3
    shards = tmp_path / "t" / "shards"
    assert not (tmp_path / "t" / "meta.json").exists() and list(shards.glob("*/train.bin.partial"))
    done = [p.parent for p in shards.glob("*/shard.json")]
    assert len(done) == 1  # the first shard is complete, the second is not
    kept = {p: p.stat().st_mtime_ns for p in done[0].glob("*.bin")}
    for lock in (tmp_path / "t" / "build.lock", *shards.glob("*/build.lock")):
        with FileLock(lock, timeout=5):  # free at once: the OS released it
            pass
    meta = prepare_token_files(corpus, get_tokenizer("bytes"), tmp_path / "t")
    tokens = np.asarray(load_tokens(token_source(tmp_path / "t", meta, "val"), meta["dtype"])).tolist()
    assert tokens == expected_tokens(corpus, "val", tmp_path / "w")
    assert meta["splits"]["val"]["num_tokens"] > 0
    assert {p: p.stat().st_mtime_ns for p in done[0].glob("*.bin")} == kept  # the complete shard was reused
    assert not list(shards.glob("*/*.partial"))


def stale_lines(capsys) -> list[str]:
    return [line for line in capsys.readouterr().out.splitlines() if "token cache" in line]


def test_token_file_corrupted_in_place_is_rebuilt(tmp_path, capsys):
    """Ids 65535 written into train.bin, size kept (issue 32): the moved mtime makes the start
    check hash the file; the sha256 differs, so the cache is rebuilt, saying why. With the mtime
    put back (bit rot), only a verifying run (scripts/prepare_data.py) sees it: it does."""
    corpus, tok, out = corpus_files(tmp_path / "c"), get_tokenizer("bytes"), tmp_path / "t"
    meta = prepare_token_files(corpus, tok, out)
    target = first_bin(out)
    good = target.read_bytes()
    assert meta["splits"]["train"]["max_id"] >= max(good[::2])  # uint16 little-endian, ids < 256
    built = os.stat(target)

    def corrupt(restore_mtime: bool):
        with open(target, "r+b") as f:
            f.seek(40)
            f.write(b"\xff\xff" * 8)
        recorded = json.loads((target.parent / "shard.json").read_text())["splits"]["train"]["mtime_ns"]
        # the write moves the mtime (by 1 s here: coarse clocks), or bit rot leaves it as recorded
        os.utime(target, ns=(built.st_atime_ns, recorded if restore_mtime else recorded + 10**9))
        assert target.stat().st_size == len(good)

    capsys.readouterr()
    corrupt(restore_mtime=False)
    prepare_token_files(corpus, tok, out)
    lines = stale_lines(capsys)
    assert len(lines) == 1 and "train.bin was modified after it was built (sha256" in lines[0], lines
    assert "corrupted in place?; rebuilding" in lines[0]
    assert target.read_bytes() == good

    corrupt(restore_mtime=True)
    prepare_token_files(corpus, tok, out)  # the cheap check cannot see it
    assert stale_lines(capsys) == [] and target.read_bytes() != good
    prepare_token_files(corpus, tok, out, verify=True)
    assert "train.bin was modified after it was built" in stale_lines(capsys)[0]
    assert target.read_bytes() == good


def test_after_a_build_only_token_files_and_small_metadata_remain(tmp_path):
    corpus, out = corpus_files(tmp_path / "c", n=40), tmp_path / "t"
    meta = prepare_token_files(corpus, get_tokenizer("bytes"), out)
    assert {p.name for p in out.iterdir()} - {"build.lock"} == CACHE_FILES  # no Arrow copies, no build/ folder
    shards = list((out / "shards").iterdir())
    assert shards and all({p.name for p in s.iterdir()} - {"build.lock"} == SHARD_FILES for s in shards)
    saved = json.loads((out / "meta.json").read_text())
    # offsets stay in the shards' .npy files (int64 memmaps): the manifest grows with shards, not documents
    assert "doc_offsets" not in json.dumps(saved) and (out / "meta.json").stat().st_size < 1000 + 300 * len(shards)
    assert all(np.load(f, mmap_mode="r").dtype == np.int64 for f in out.glob("shards/*/*.offsets.npy"))
    for split in ("train", "val"):
        offsets = np.asarray(meta["splits"][split]["doc_offsets"])
        assert offsets.dtype == np.int64
        tokens = np.asarray(load_tokens(token_source(out, meta, split), "uint16"))
        assert offsets[0] == 0 and offsets[-1] == len(tokens) == saved["splits"][split]["num_tokens"]
        assert np.flatnonzero(tokens == SEP).tolist() == (offsets[1:] - 1).tolist()  # a separator ends each
        assert len(offsets) - 1 == saved["splits"][split]["num_documents"]


def test_start_up_check_opens_no_hub_corpus(tmp_path, monkeypatch):
    """A built cache of a hub corpus is used without load_dataset (opened by the builder only)."""
    import datasets

    rows = {"train": [f"row {i}\n" for i in range(10)], "val": ["held out\n"]}
    loads = []

    def load(self):
        loads.append(1)
        return datasets.DatasetDict({k: datasets.Dataset.from_dict({"text": v}) for k, v in rows.items()})

    monkeypatch.setattr(HubCorpus, "_load", load)
    tok = get_tokenizer("bytes")
    prepare_token_files(HubCorpus("x/corpus"), tok, tmp_path)
    assert loads == [1]
    meta = prepare_token_files(HubCorpus("x/corpus"), tok, tmp_path)  # a new process's corpus object
    assert loads == [1] and meta["splits"]["val"]["num_tokens"] == len("held out\n") + 1


def test_prepare_script_builds_what_train_uses(tmp_path, monkeypatch, capsys):
    """scripts/prepare_data.py with train.py's overrides builds the cache that the data module of
    the same config (as train.py builds it) then uses with no tokenization; a second run
    verifies without rebuilding; bad input is one line."""
    from hydra import compose, initialize_config_dir

    from pelab.datamodule import build_datamodule

    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import prepare_data

    corpus_files(tmp_path / "c")
    monkeypatch.setenv("PELAB_CACHE", str(tmp_path / "cache"))
    overrides = ["data=text", f"data.paths=[{tmp_path / 'c'}]", "model.block_size=16"]
    assert prepare_data.main(overrides) == 0
    first = capsys.readouterr()
    assert ": built;" in first.out and "M tok/s" in first.out and "so the build runs at" in first.out
    assert "groups of files checked or tokenized (bytes)" in first.err  # the progress bar
    cache = next((tmp_path / "cache" / "data").glob("files-c-*/bytes"))
    assert {p.name for p in cache.iterdir()} - {"build.lock"} == CACHE_FILES

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=[*overrides, f"paths.output_dir={tmp_path / 'out'}"])
    datamodule = build_datamodule(cfg.data)
    monkeypatch.setattr(data.cache, "build", lambda *a, **k: pytest.fail("the training run tokenized"))
    monkeypatch.setattr(data.shards, "build_shard", lambda *a, **k: pytest.fail("the training run tokenized"))
    datamodule.setup()
    assert datamodule.token_dir == cache and len(datamodule.val_set) > 0

    monkeypatch.undo()
    monkeypatch.setenv("PELAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    assert prepare_data.main(overrides) == 0
    second = capsys.readouterr()
    assert "verified, already complete" in second.out and "tokenizing" not in second.out + second.err
    assert prepare_data.main([*overrides, "data.tokenizer=missing/tokenizer.json"]) == 2
    bad = capsys.readouterr().err
    assert bad.strip().count("\n") == 0 and "data.tokenizer must be one of" in bad and "missing/tokenizer.json" in bad
