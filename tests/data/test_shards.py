"""data/shards.py: a corpus of files cached per group of files. A grown corpus encodes only the
new file (its group's other files copied) and leaves every other shard's files untouched; parts built apart (shard=i/n,
in one process or two at once) then merged equal one process's build byte for byte; clean=true
removes only what no current manifest references and refuses while a build holds a lock; bad
input is one line; the parts read as one split equal a naive concatenation of the tokenizer's
own ids, window for window."""

import json
import multiprocessing
from pathlib import Path

import numpy as np
import pytest

import data.cache
import data.shards
from data.cache import Throughput, prepare_token_files
from data.corpus import TextFilesCorpus, document_key, held_out_by_hash
from data.shards import CleanRefused, MissingShards, clean, file_groups, token_source
from data.stream import TrainWindows, load_tokens
from data.tokenizers import get_tokenizer
from data.val_windows import ValidationWindows

ROOT = Path(__file__).resolve().parents[2]
SEP = 0x1E


@pytest.fixture(autouse=True)
def small_groups(monkeypatch):
    """Groups of about 4 files (the paths' hashes decide): small corpora make several shards."""
    monkeypatch.setattr(data.shards, "GROUP_FILES", 4)


def write_corpus(folder: Path, n: int, start: int = 0) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(start, start + n):
        (folder / f"{i:03d}.txt").write_text(f"document {i}: " + " ".join(f"w{(i * 7 + j) % 89}" for j in
                                                                            range(10 + i % 13)) + "\n")


def token_files(out: Path) -> dict[str, bytes]:
    return {p.relative_to(out).as_posix(): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.name.endswith((".bin", ".npy"))}


def without_mtimes(value):
    """A shard.json or manifest with the recorded mtimes (when this copy's files were written) left out."""
    if isinstance(value, dict):
        return {k: without_mtimes(v) for k, v in value.items() if k != "mtime_ns"}
    if isinstance(value, list):
        return [without_mtimes(v) for v in value]
    return value


def same_cache(a: Path, b: Path) -> None:
    """Every token and offsets file byte for byte; every shard.json and the manifest equal but
    for the files' mtimes (and the manifest's shard entries' [tokens, mtime] pairs)."""
    assert token_files(a) and token_files(a) == token_files(b)
    jsons = sorted(p.relative_to(a).as_posix() for p in a.rglob("*.json"))
    assert jsons == sorted(p.relative_to(b).as_posix() for p in b.rglob("*.json"))
    for name in jsons:
        left, right = (json.loads((root / name).read_text()) for root in (a, b))
        if name == "meta.json":
            for side in (left, right):
                side["shards"] = [[e["key"], {s: v[0] for s, v in e["splits"].items()}] for e in side["shards"]]
        assert without_mtimes(left) == without_mtimes(right), name


def naive_split(corpus: TextFilesCorpus, tok, split: str) -> np.ndarray:
    """The split by hand: files in sorted order, documents in order, held out by their hash
    (held_out_by_hash over the whole corpus), each encoded by the tokenizer then the separator."""
    texts = [t for f in sorted(corpus.files) for t in corpus.file_documents(f)]
    keys = np.array([document_key(t) for t in texts], dtype=np.uint64)
    train, val = held_out_by_hash(keys, corpus.val_fraction)
    rows = train if split == "train" else val
    return np.array([i for r in rows for i in tok.encode(texts[r]) + [tok.eot_token]], dtype=np.uint16)


def shard_state(out: Path) -> dict[str, tuple[int, int]]:
    """(inode, mtime) of every token file, by relative path."""
    return {p.relative_to(out).as_posix(): (p.stat().st_ino, p.stat().st_mtime_ns) for p in out.rglob("*.bin")}


def test_a_grown_corpus_encodes_only_the_new_file(tmp_path, monkeypatch):
    write_corpus(tmp_path / "c", 50)
    tok, out = get_tokenizer("bytes"), tmp_path / "out"
    first = prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), tok, out)
    before = shard_state(out)
    assert len(first["shards"]) >= 3

    (tmp_path / "c" / "025a.txt").write_text("a new document in the middle of the sorted files\n")
    grown = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2)
    encoded = []
    original = type(tok).encode_array
    monkeypatch.setattr(type(tok), "encode_array", lambda self, t, *a: encoded.extend(t) or original(self, t, *a))
    stats = Throughput()
    meta = prepare_token_files(grown, tok, out, stats=stats)
    old_keys, new_keys = {e["key"] for e in first["shards"]}, {e["key"] for e in meta["shards"]}
    built = [s for s in data.shards.plan(grown, out, tok.fingerprint()) if s.key not in old_keys]
    # the new file's group only (split in two when the new file ends a group), every other group reused
    assert 1 <= len(built) <= 2 and any(tmp_path / "c" / "025a.txt" in s.files for s in built)
    assert len(old_keys - new_keys) <= 1  # none when the new file is a group alone
    # only the new file is encoded; its group's other files are copied from the shards that held them
    new_file = tmp_path / "c" / "025a.txt"
    assert encoded == [new_file.read_text()] and stats.tokens == len(tok.encode(new_file.read_text())) + 1
    others = [f for s in built for f in s.files if f != new_file]
    assert stats.copied == sum(len(tok.encode(f.read_text())) + 1 for f in others)
    after = shard_state(out)
    kept = {k: v for k, v in before.items() if k.split("/")[1] in new_keys}
    assert len(kept) == 2 * len(old_keys & new_keys) and all(after[k] == v for k, v in kept.items())  # same inode, mtime
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(load_tokens(token_source(out, meta, split), meta["dtype"])),
                              naive_split(grown, tok, split))
    fresh = tmp_path / "fresh"
    prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), tok, fresh)
    listed = {e["key"] for e in meta["shards"]}
    assert {k: v for k, v in token_files(out).items() if k.split("/")[1] in listed} == token_files(fresh)


def build_parts(out: Path, folder: Path, parts: list[int], n: int, delay: float = 0.0) -> None:
    corpus, tok = TextFilesCorpus([str(folder)], val_fraction=0.2), get_tokenizer("bytes")
    if delay:  # the two processes overlap: each waits a little inside every shard it builds
        import time

        original = data.shards.build_shard
        data.shards.build_shard = lambda *a, **k: (time.sleep(delay), original(*a, **k))[1]
    for i in parts:
        assert corpus.prepare_token_files(tok, out, part=(i, n)) is None


def test_parts_then_merge_equal_one_process_build(tmp_path, capsys):
    write_corpus(tmp_path / "c", 40)
    tok = get_tokenizer("bytes")
    alone = prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), tok, tmp_path / "alone")
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2)
    build_parts(tmp_path / "parts", tmp_path / "c", [2, 0], 3)
    with pytest.raises(MissingShards) as missing:  # part 1 of 3 not built: named, nothing written
        corpus.prepare_token_files(tok, tmp_path / "parts", merge=True)
    message = str(missing.value)
    assert "\n" not in message and "merge=true: " in message and "not built" in message
    absent = data.shards.plan(corpus, tmp_path / "parts", tok.fingerprint())[1::3]
    assert all(s.key in message for s in absent[:3]) and not (tmp_path / "parts" / "meta.json").exists()
    build_parts(tmp_path / "parts", tmp_path / "c", [1], 3)
    capsys.readouterr()
    merged = corpus.prepare_token_files(tok, tmp_path / "parts", merge=True)
    assert "tokeniz" not in capsys.readouterr().out  # the merge tokenized nothing
    same_cache(tmp_path / "alone", tmp_path / "parts")
    assert merged["splits"]["val"]["sha256"] == alone["splits"]["val"]["sha256"]


def test_two_processes_build_the_parts_at_once(tmp_path):
    write_corpus(tmp_path / "c", 40)
    tok = get_tokenizer("bytes")
    prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), tok, tmp_path / "alone")
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=build_parts, args=(tmp_path / "two", tmp_path / "c", [i], 2, 0.2)) for i in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2).prepare_token_files(tok, tmp_path / "two", merge=True)
    same_cache(tmp_path / "alone", tmp_path / "two")


def stale_setup(tmp_path: Path) -> tuple[Path, dict, set]:
    """A cache root with a current sharded cache whose corpus lost a file (its replaced shard is stale),
    an older-format cache, a build's leftover, a parallel build not merged, and a folder that is
    no cache. Returns (root, the current manifest, the paths clean must remove)."""
    root = tmp_path / "cache" / "data"  # $PELAB_CACHE/data
    write_corpus(tmp_path / "c", 30)
    tok = get_tokenizer("bytes")
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2)
    out = root / corpus.cache_name / "bytes"
    first = prepare_token_files(corpus, tok, out)
    (tmp_path / "c" / "013.txt").unlink()  # its group's paths change: the old shard is no manifest's any more
    meta = prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), tok, out)
    listed = {e["key"] for e in meta["shards"]}
    stale = {out / "shards" / e["key"] for e in first["shards"] if e["key"] not in listed}
    assert stale
    old = root / "gutenberg-val0.1" / "bytes"
    old.mkdir(parents=True)
    (old / "meta.json").write_text(json.dumps({"version": 3}))
    (old / "train.bin").write_bytes(b"\0" * 64)
    (out / "train.bin.partial").write_bytes(b"\0" * 8)
    unmerged = root / "files-other" / "bytes"
    (unmerged / "shards" / "abc").mkdir(parents=True)
    (unmerged / "shards" / "abc" / "train.bin").write_bytes(b"\0" * 4)
    (root / "notes" / "mine").mkdir(parents=True)
    (root / "notes" / "mine" / "keep.txt").write_text("not a cache")
    return root, meta, stale | {old, out / "train.bin.partial"}


def test_clean_removes_only_what_no_current_manifest_references(tmp_path, monkeypatch):
    root, meta, expected = stale_setup(tmp_path)
    removed, kept = clean(root)
    assert {p for p, _, _ in removed} == expected
    assert not any(p.exists() for p in expected) and not (root / "gutenberg-val0.1").exists()
    assert [p for p, _ in kept] == [root / "files-other" / "bytes"] and (root / "files-other" / "bytes" / "shards").exists()
    assert (root / "notes" / "mine" / "keep.txt").exists()
    # the current cache is whole: used as it is, nothing rebuilt
    monkeypatch.setattr(data.shards, "build_shard", lambda *a, **k: pytest.fail("rebuilt after clean"))
    out = next(root.glob("files-c-*/bytes"))
    again = prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), get_tokenizer("bytes"), out)
    assert again["splits"]["train"]["sha256"] == meta["splits"]["train"]["sha256"]
    corpus = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2)  # the group that lost a file: copied right
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(load_tokens(token_source(out, again, split), again["dtype"])),
                              naive_split(corpus, get_tokenizer("bytes"), split))
    assert clean(root)[0] == []


def hold_lock(folder, ready, release):
    from data.lock import build_lock

    with build_lock(Path(folder)):
        ready.set()
        release.wait(60)


def test_clean_refuses_while_a_build_holds_a_lock(tmp_path, monkeypatch, capsys):
    root, _, expected = stale_setup(tmp_path)
    shard = next(p for p in expected if p.parent.name == "shards")
    ctx = multiprocessing.get_context("fork")
    ready, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=hold_lock, args=(str(shard), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(CleanRefused) as refused:
            clean(root)
        message = str(refused.value)
        assert "\n" not in message and f"{shard} is being built by pid {holder.pid}" in message
        assert "nothing was removed" in message and all(p.exists() for p in expected)
        monkeypatch.syspath_prepend(str(ROOT / "scripts"))  # the command: one line, exit status 1
        monkeypatch.setenv("PELAB_CACHE", str(tmp_path / "cache"))
        import prepare_data

        capsys.readouterr()
        assert prepare_data.main(["data=text", f"data.paths=[{tmp_path / 'c'}]", "clean=true"]) == 1
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and f"{shard} is being built by pid {holder.pid}" in err
        assert all(p.exists() for p in expected)
    finally:
        release.set()
        holder.join(timeout=30)
    assert {p for p, _, _ in clean(root)[0]} == expected


def test_bad_input_is_one_line_before_any_work(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import prepare_data

    write_corpus(tmp_path / "c", 40)
    assert len(file_groups(TextFilesCorpus([str(tmp_path / "c")]).files)) >= 2  # two parts, each with work
    monkeypatch.setenv("PELAB_CACHE", str(tmp_path / "cache"))
    data_args = ["data=text", f"data.paths=[{tmp_path / 'c'}]"]
    for arg, said in (("shard=3/2", "shard=3/2 is not valid: i must be in 0 .. 1"),
                      ("shard=0/0", "shard=0/0 is not valid: n must be >= 1"),
                      ("shard=1", "shard=1 is not valid: expected i/n with integers 0 <= i < n"),
                      ("shard=a/b", "shard=a/b is not valid: expected i/n"),
                      ("merge=yes", "merge=yes is not valid: expected true or false")):
        assert prepare_data.main([*data_args, arg]) == 2
        err = capsys.readouterr().err
        assert err.strip().count("\n") == 0 and said in err, err
    assert not (tmp_path / "cache").exists()  # nothing read, nothing written
    assert prepare_data.main([*data_args, "shard=0/2", "merge=true"]) == 2
    assert "separate steps" in capsys.readouterr().err
    assert prepare_data.main(["shard=0/2"]) == 2  # the embedded corpus is one shard
    assert "is one shard" in capsys.readouterr().err

    assert prepare_data.main([*data_args, "shard=0/2"]) == 0
    assert "shard=0/2:" in capsys.readouterr().out
    assert prepare_data.main([*data_args, "merge=true"]) == 1  # part 1 of 2 missing: named
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "merge=true: " in err and "shards missing or incomplete" in err
    built = token_files(tmp_path / "cache")
    assert built and not list((tmp_path / "cache").rglob("meta.json"))
    assert prepare_data.main([*data_args, "shard=1/2"]) == 0 and prepare_data.main([*data_args, "merge=true"]) == 0
    out = capsys.readouterr().out
    assert ": merged (every shard present and complete);" in out
    assert {k: v for k, v in token_files(tmp_path / "cache").items() if k in built} == built  # nothing built lost


def test_the_parts_read_as_one_split_equal_the_naive_stream(tmp_path, monkeypatch):
    """The reader (ConcatTokens over the manifest's parts) against the tokenizer's own ids
    concatenated by hand: every token, random slices across parts, and the training (random and
    epoch) and validation windows of one file holding the same tokens."""
    write_corpus(tmp_path / "c", 60)  # groups of about 4 files: many part boundaries
    corpus, tok = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), get_tokenizer("bytes")
    meta = prepare_token_files(corpus, tok, tmp_path / "out")
    assert len(meta["splits"]["train"]["parts"]) >= 8
    for split in ("train", "val"):
        expected = naive_split(corpus, tok, split)
        source = token_source(tmp_path / "out", meta, split)
        tokens = load_tokens(source, meta["dtype"])
        assert len(tokens) == len(expected) == meta["splits"][split]["num_tokens"]
        assert np.array_equal(np.asarray(tokens), expected)
        offsets = np.asarray(meta["splits"][split]["doc_offsets"])
        assert np.flatnonzero(expected == SEP).tolist() == (offsets[1:] - 1).tolist()
        rng = np.random.default_rng(0)
        for a, b in rng.integers(0, len(expected), size=(200, 2)):
            assert np.array_equal(tokens[min(a, b) : max(a, b) + 5], expected[min(a, b) : max(a, b) + 5])
        single = tmp_path / f"{split}.bin"
        expected.tofile(single)
        if split == "train":
            for sampling in ("random", "epoch"):
                parts, one = (TrainWindows(s, meta["dtype"], 16, seed=4, sampling=sampling) for s in (source, single))
                for g in range(0, 3 * one.num_windows, 7):
                    assert all(np.array_equal(x, y) for x, y in zip(parts[g], one[g]))
        else:
            parts, one = (ValidationWindows(s, meta["dtype"], 16, 32) for s in (source, single))
            assert len(parts) == len(one) and all(np.array_equal(parts[i][0], one[i][0]) for i in range(len(one)))


def test_no_document_below_the_threshold_holds_out_the_smallest_key(tmp_path):
    """The global "at least one document each side" of held_out_by_hash, across shards: the
    smallest-keyed document of the whole corpus is cut out of its shard's train part."""
    write_corpus(tmp_path / "c", 30)
    corpus, tok = TextFilesCorpus([str(tmp_path / "c")], val_fraction=1e-12), get_tokenizer("bytes")
    meta = prepare_token_files(corpus, tok, tmp_path / "out")
    assert meta["splits"]["val"]["num_documents"] == 1 and len(meta["shards"]) >= 2
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(load_tokens(token_source(tmp_path / "out", meta, split), meta["dtype"])),
                              naive_split(corpus, tok, split))


def test_every_document_below_the_threshold_trains_the_largest_key(tmp_path):
    """The other side of the rule: all held out, the largest-keyed document trains."""
    texts = [t for t in (f"short document {i}\n" for i in range(400)) if document_key(t) < 2**63][:12]
    (tmp_path / "c").mkdir()
    for i, text in enumerate(texts):
        (tmp_path / "c" / f"{i:02d}.txt").write_text(text)
    corpus, tok = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.5), get_tokenizer("bytes")
    meta = prepare_token_files(corpus, tok, tmp_path / "out")
    assert meta["splits"]["train"]["num_documents"] == 1 and len(meta["shards"]) >= 2
    for split in ("train", "val"):
        assert np.array_equal(np.asarray(load_tokens(token_source(tmp_path / "out", meta, split), meta["dtype"])),
                              naive_split(corpus, tok, split))


def test_a_build_needs_no_scratch_beyond_its_result(tmp_path, monkeypatch):
    """Sampled after every batch written: the cache folder never holds more than the finished
    cache plus 1 byte per token (the text is read where it lies; only the shard's .partial files)."""
    monkeypatch.setattr(data.cache, "BATCH_DOCUMENTS", 3)
    write_corpus(tmp_path / "c", 40)
    out, peak = tmp_path / "out", [0]
    original = data.shards.SplitWriter.add

    def sample(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.out.flush()
        peak[0] = max(peak[0], sum(p.stat().st_size for p in out.rglob("*") if p.is_file()))

    monkeypatch.setattr(data.shards.SplitWriter, "add", sample)
    meta = prepare_token_files(TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), get_tokenizer("bytes"), out)
    final = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    tokens = sum(meta["splits"][s]["num_tokens"] for s in ("train", "val"))
    assert 0 < peak[0] <= final + tokens


def test_an_old_format_cache_is_rebuilt_beside_and_said_once(tmp_path, capsys):
    write_corpus(tmp_path / "c", 12)
    corpus, tok = TextFilesCorpus([str(tmp_path / "c")], val_fraction=0.2), get_tokenizer("bytes")
    out = tmp_path / "root" / corpus.cache_name / "bytes"
    out.mkdir(parents=True)
    (out / "meta.json").write_text(json.dumps({"version": 3, "splits": {}}))
    (out / "train.bin").write_bytes(b"\0\0" * 10)
    meta = prepare_token_files(corpus, tok, out)
    lines = [line for line in capsys.readouterr().out.splitlines() if "format version 3" in line]
    assert len(lines) == 1 and "expected 4" in lines[0] and meta["version"] == 4
    assert np.array_equal(np.asarray(load_tokens(token_source(out, meta, "train"), meta["dtype"])),
                          naive_split(corpus, tok, "train"))
    assert (out / "train.bin").exists()  # the old files stay until clean=true
    removed, _ = clean(tmp_path / "root")
    assert [p for p, _, _ in removed] == [out / "train.bin"] and (out / "meta.json").exists()
