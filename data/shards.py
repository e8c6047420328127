"""Sharded token caches: a corpus of files (``data=text``) tokenized per group of files, so a
corpus that gains a file tokenizes only that file's group, and several processes or nodes can
build one cache together (``scripts/prepare_data.py shard=i/n``, then ``merge=true``).

**Layout** of the cache folder (``data_dir/<corpus spec>/<tokenizer>``; the folder's name
hashes ``data.paths`` and the options, never the files found, so a grown corpus keeps it):

- ``shards/<key>/``, one per group of files: ``{split}.bin`` and ``{split}.offsets.npy`` as
  data/cache.py writes them for a whole corpus, holding only the group's documents in file order,
  and ``shard.json`` (written last, atomically: a shard without it is incomplete): the group's
  files with their sizes and mtimes, its content hash, per split the tokens, documents, largest
  id, sha256 and mtime of the ``.bin``, and the extreme document keys (below);
- ``meta.json``, the **manifest**, written last and atomically: what data/cache.py's
  ``meta.json`` says of a whole cache (format, tokenizer, dtype, the corpus's cheap and full
  fingerprints, per split tokens and documents), plus the shards in order and each split's
  **parts**: ``[key, file split, first document, end document, first token, end token]``;
- ``build.lock`` / ``build.owner`` in the cache folder (the manifest's writer) and in every
  shard folder (its builder): data/lock.py.

**Groups.** The sorted file list is cut into contiguous groups by the files themselves (content
defined, as chunking by rolling hash is): a group ends after file ``f`` when
``hash(path of f)`` < max(1/``GROUP_FILES``, size/``GROUP_BYTES``), and around any file of
``GROUP_BYTES`` or more, which is a group alone. Why not fixed runs of N files: one file
inserted in the middle would shift every later group and re-tokenize half the corpus; here a
new file changes only the group it falls in (which may split in two). Why not one shard per
file: 50,000 small files would mean 100,000 memory maps per loading process, 250,000 files in
the cache, and a lock, a folder and 5 files written per corpus file (4,508 small files: the
build ran at 41% of the raw tokenizer's rate with groups of 8 files, 67% with 64:
docs/performance.md); groups keep these near ``corpus bytes / GROUP_BYTES`` for big corpora
and ``files / GROUP_FILES`` for many small ones. A rebuilt group encodes only its new or
changed files: ``shard.json`` records each file's documents, and the group's unchanged files
are copied from the shards holding them (``Donors``), so a corpus that gains a file encodes
that file's text and copies at most one group's tokens. A shard's key hashes the format, the
tokenizer's fingerprint, the corpus options and the group's paths: its files' sizes and mtimes
are checked against ``shard.json`` (the cheap check), then its content (files touched but
unchanged: kept, as a whole cache was).

**The held-out split** is decided per document by its hash (``held_out_by_hash``'s threshold),
so each shard splits its own documents. The rule "at least one document each side" is global:
when no document of the corpus falls below the threshold, the manifest's val part is the
smallest-keyed train document (``train_min`` of the shards), cut out of its shard's train part;
symmetrically for train. Parts make this a pure function of the shards' files.

**Reading.** A split is the concatenation of its parts (data/stream.py ``SplitParts``), the
same tokens in the same order as one ``{split}.bin`` of the corpus, so the training windows
(random or epoch) and the validation windows are those of one file of that length.

**Parallel.** ``prepare_sharded(..., part=(i, n))`` builds groups ``i, i+n, i+2n, ...`` only,
each under its own shard lock, and writes no manifest; ``merge=True`` builds nothing: it checks
every group's shard is present and complete, names the missing ones, and writes the manifest.
The shards are the same bytes whichever process built them, so the result is one process's.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np

import data.cache
from data.cache import (FORMAT_VERSION, MOVE_IT, SPLITS, Throughput, check_cache_folder, corpus_stat, encoded_batches,
                        file_sha256, header_mismatch, read_meta, remove_token_files, reserve, token_dtype,
                        token_file_changed, write_meta)
from data.lock import LOCK_TIMEOUT, build_lock, holder_line, try_flock
from data.paths import disk_full, no_space, process_alive
from data.stream import SplitParts

GROUP_FILES = 64  # a group ends after about this many small files ...
GROUP_BYTES = 64 << 20  # ... or about this many bytes of source files
SHARDS = "shards"
SHARD_META = "shard.json"


class MissingShards(ValueError):
    """``merge=true`` found shards absent or incomplete: one line naming them."""


def unit_hash(text: str) -> float:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") / 2**64


def file_groups(files: list[Path]) -> list[list[Path]]:
    """``files`` (sorted) cut into contiguous groups (module docstring)."""
    sizes = [os.stat(f).st_size for f in files]
    groups: list[list[Path]] = []
    current: list[Path] = []
    for i, path in enumerate(files):
        current.append(path)
        last = i + 1 == len(files)
        big = sizes[i] >= GROUP_BYTES or (not last and sizes[i + 1] >= GROUP_BYTES)
        if last or big or unit_hash(str(path)) < max(1 / GROUP_FILES, sizes[i] / GROUP_BYTES):
            groups.append(current)
            current = []
    return groups


class Shard:
    """One group of files and its folder in the cache."""

    def __init__(self, out_dir: Path, files: list[Path], options: list, tokenizer_hash: str) -> None:
        self.files = files
        self.key = hashlib.sha256(json.dumps([FORMAT_VERSION, tokenizer_hash, options, [str(f) for f in files]])
                                  .encode()).hexdigest()[:20]
        self.dir = out_dir / SHARDS / self.key

    def stats(self) -> list:
        return [[str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in self.files]

    def content(self) -> str:
        """sha256 over each file's path, size and bytes (reads every byte once)."""
        digest = hashlib.sha256()
        for path in self.files:
            digest.update(json.dumps([str(path), path.stat().st_size, file_sha256(path)]).encode())
        return digest.hexdigest()

    def __str__(self) -> str:
        more = f" and {len(self.files) - 1} more" if len(self.files) > 1 else ""
        return f"shard {self.key} ({self.files[0]}{more})"


def plan(corpus, out_dir: Path, tokenizer_hash: str) -> list[Shard]:
    return [Shard(out_dir, group, corpus._options(), tokenizer_hash) for group in file_groups(corpus.files)]


def read_shard(shard: Shard) -> dict | None:
    try:
        info = json.loads((shard.dir / SHARD_META).read_text())
        return info if isinstance(info, dict) else None
    except (OSError, ValueError):
        return None


def shard_mismatch(info: dict, shard: Shard, tokenizer_hash: str, dtype: np.dtype) -> tuple[str | None, bool]:
    """(why ``shard``'s files cannot be used, whether a full check may clear it), or (None,
    False): O(files of the group), reading no data."""
    try:
        if (info.get("version"), info.get("tokenizer_hash"), info.get("dtype")) != (FORMAT_VERSION, tokenizer_hash,
                                                                                   dtype.name):
            return "built by another format, tokenizer or dtype", False
        for split in SPLITS:
            path, expected = shard.dir / f"{split}.bin", info["splits"][split]["num_tokens"] * dtype.itemsize
            if not path.is_file() or not (shard.dir / f"{split}.offsets.npy").is_file():
                return f"{split} files missing", False
            if path.stat().st_size != expected:
                return f"{path.name} has {path.stat().st_size} bytes, expected {expected}", False
        if info.get("files") != shard.stats():
            return "corpus files changed (paths, sizes or mtimes)", True
        for split in SPLITS:
            if (shard.dir / f"{split}.bin").stat().st_mtime_ns != info["splits"][split]["mtime_ns"]:
                return f"{split}.bin was modified after it was built (mtime)", True
    except (KeyError, TypeError, AttributeError, OSError) as err:
        return f"{SHARD_META} incomplete ({type(err).__name__}: {err})", False
    return None, False


def shard_full_check(info: dict, shard: Shard, everything: bool) -> str | None:
    """The content behind the cheap check (data/cache.py ``full_check``, for one shard): None when
    intact (``info`` then records the new sizes and mtimes)."""
    if everything or info.get("files") != shard.stats():
        content = shard.content()
        if content != info.get("content"):
            return f"corpus changed (fingerprint {str(info.get('content'))[:12]} -> {content[:12]})"
    for split in SPLITS:
        why = token_file_changed(shard.dir / f"{split}.bin", info["splits"][split], everything)
        if why:
            return why
    info["files"] = shard.stats()
    return None


def write_json(data: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".partial")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


class SplitWriter:
    """One split of one shard: ``{split}.bin`` and ``{split}.offsets.npy`` as ``.partial`` files,
    renamed into place by ``close``; the split's metadata, with each file's documents
    (``per_file``: [first, end, extreme key, its document], the extreme being train's smallest
    key, val's largest), so a later group holding the same file can copy them."""

    def __init__(self, folder: Path, split: str) -> None:
        self.path = folder / f"{split}.bin"
        self.tmp = self.path.with_name(self.path.name + ".partial")
        self.out = open(self.tmp, "wb")
        self.smallest = split == "train"
        self.digest, self.total, self.max_id, self.documents = hashlib.sha256(), 0, -1, 0
        self.starts: list[np.ndarray] = [np.zeros(1, dtype=np.int64)]
        self.per_file: dict[int, list] = {}

    def better(self, key: int, entry: list) -> bool:
        return entry[2] is None or (key < entry[2] if self.smallest else key > entry[2])

    def write(self, ids: np.ndarray, lengths: np.ndarray) -> int:
        """Append documents; the index of the first."""
        first = self.documents
        self.out.write(ids)
        self.digest.update(ids)
        self.starts.append(self.total + np.cumsum(lengths))
        self.total, self.documents = self.total + len(ids), self.documents + len(lengths)
        if len(ids):
            self.max_id = max(self.max_id, int(ids.max()))
        return first

    def add(self, ids: np.ndarray, lengths: np.ndarray, keys: np.ndarray, files: np.ndarray) -> None:
        """Encoded documents with their keys and the index of the file each came from."""
        if not len(lengths):
            return
        first = self.write(ids, lengths)
        bounds = [0, *(np.flatnonzero(np.diff(files)) + 1).tolist(), len(files)]
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            part = keys[lo:hi]
            pick = lo + int(np.argmin(part) if self.smallest else np.argmax(part))  # the first of equal keys
            entry = self.per_file.setdefault(int(files[lo]), [first + lo, first + hi, None, None])
            entry[1] = first + hi
            if self.better(int(keys[pick]), entry):
                entry[2:] = [int(keys[pick]), first + pick]

    def copy(self, ids: np.ndarray, lengths: np.ndarray, file: int, key: int | None, at: int | None) -> None:
        """A file's documents copied from another shard, its extreme ``key`` at its document ``at``."""
        if not len(lengths):
            return
        first = self.write(ids, lengths)
        self.per_file[file] = [first, first + len(lengths), key, None if at is None else first + at]

    def close(self) -> dict:
        self.out.close()
        offsets = self.path.with_name(self.path.name[: -len(".bin")] + ".offsets.npy")
        offsets_tmp = offsets.with_name(offsets.name.replace(".offsets.npy", ".offsets.partial.npy"))
        np.save(offsets_tmp, np.concatenate(self.starts))
        reserve(offsets_tmp)
        os.replace(offsets_tmp, offsets)
        os.replace(self.tmp, self.path)
        extremes = [e for e in self.per_file.values() if e[2] is not None]
        best = min(extremes, key=lambda e: (e[2] if self.smallest else -e[2], e[3]), default=None)
        return {"num_tokens": self.total, "num_documents": self.documents, "max_id": self.max_id,
                "sha256": self.digest.hexdigest(), "mtime_ns": self.path.stat().st_mtime_ns,
                "extreme_key": None if best is None else best[2:],
                "per_file": {str(f): e for f, e in sorted(self.per_file.items())}}


def text_batches(corpus, files: list[Path]):
    """(texts, index in ``files`` of each text's file) of the files' documents, in batches of
    data/cache.py's ``BATCH_DOCUMENTS``, read where they lie."""
    batch: list[str] = []
    origin: list[int] = []
    for n, path in enumerate(files):
        for text in corpus.file_documents(path):
            batch.append(text)
            origin.append(n)
            if len(batch) == data.cache.BATCH_DOCUMENTS:
                yield batch, np.array(origin)
                batch, origin = [], []
    if batch:
        yield batch, np.array(origin)


class Donors:
    """The files complete shards of this cache already hold (``shard.json``, same format,
    tokenizer and dtype, token files as written), by [path, size, mtime]: a new group copies an unchanged file's tokens
    from there instead of encoding it again (a grown corpus encodes only its new files)."""

    def __init__(self, out_dir: Path, tokenizer_hash: str, dtype: np.dtype) -> None:
        self.out_dir, self.tokenizer_hash, self.dtype = out_dir, tokenizer_hash, dtype
        self.found: dict[str, tuple[Path, dict, int]] | None = None  # read when a shard is first built

    def scan(self) -> dict[str, tuple[Path, dict, int]]:
        found: dict[str, tuple[Path, dict, int]] = {}
        out_dir, tokenizer_hash, dtype = self.out_dir, self.tokenizer_hash, self.dtype
        for folder in sorted((out_dir / SHARDS).glob("*/")) if (out_dir / SHARDS).is_dir() else []:
            try:
                info = json.loads((folder / SHARD_META).read_text())
                if (info["version"], info["tokenizer_hash"], info["dtype"]) != (FORMAT_VERSION, tokenizer_hash,
                                                                                dtype.name):
                    continue
                if any((now := (folder / f"{split}.bin").stat()).st_size != entry["num_tokens"] * dtype.itemsize
                       or now.st_mtime_ns != entry["mtime_ns"] for split, entry in info["splits"].items()):
                    continue  # its token files changed since they were written: copy nothing from them
                for n, stat in enumerate(info["files"]):
                    found[json.dumps(stat)] = (folder, info, n)
            except (OSError, ValueError, KeyError, TypeError):
                continue  # incomplete or foreign: not a donor
        return found

    def of(self, stat: list) -> tuple[Path, dict, int] | None:
        if self.found is None:
            self.found = self.scan()
        return self.found.get(json.dumps(stat))


def copy_file(writers: dict, donor: tuple[Path, dict, int], file: int, dtype: np.dtype) -> int:
    """Copy one file's documents (both splits) from its donor shard; the tokens copied."""
    folder, info, n = donor
    copied = 0
    for split, writer in writers.items():
        entry = info["splits"][split]["per_file"].get(str(n))
        if entry is None:
            continue
        offsets = np.load(folder / f"{split}.offsets.npy", mmap_mode="r")
        lo, hi = int(offsets[entry[0]]), int(offsets[entry[1]])
        ids = np.fromfile(folder / f"{split}.bin", dtype=dtype, count=hi - lo, offset=lo * dtype.itemsize)
        lengths = np.diff(np.asarray(offsets[entry[0] : entry[1] + 1]))
        writer.copy(ids, lengths, file, entry[2], None if entry[3] is None else entry[3] - entry[0])
        copied += len(ids)
    return copied


def build_shard(corpus, shard: Shard, tokenizer, tokenizer_hash: str, dtype: np.dtype, num_proc: int | None,
                stats: Throughput, donors: Donors | None = None) -> dict:
    """Tokenize ``shard``'s files into its folder (the caller holds its lock); its ``shard.json``.
    A file some complete shard already holds unchanged (``donors``) is copied from there."""
    shard.dir.mkdir(parents=True, exist_ok=True)
    (shard.dir / SHARD_META).unlink(missing_ok=True)  # first: a crash leaves no complete-looking shard
    stat, content = shard.stats(), shard.content()
    threshold = np.uint64(min(int(corpus.val_fraction * 2**64), 2**64 - 1))
    writers = {split: SplitWriter(shard.dir, split) for split in SPLITS}
    try:
        run: list[int] = []  # files to encode, in order, until the next copied one
        for n in range(len(shard.files) + 1):
            donor = donors.of(stat[n]) if donors is not None and n < len(shard.files) else None
            if n < len(shard.files) and donor is None:
                run.append(n)
                continue
            if run:
                encode_files(corpus, [shard.files[i] for i in run], run, writers, tokenizer, dtype, threshold,
                             num_proc, stats)
                run = []
            if donor is not None:
                stats.copied += copy_file(writers, donor, n, dtype)
        info = {"version": FORMAT_VERSION, "tokenizer_hash": tokenizer_hash, "dtype": dtype.name, "files": stat,
                "content": content, "splits": {split: writer.close() for split, writer in writers.items()}}
        if stat != shard.stats():
            raise RuntimeError(f"{shard}: a file changed while it was being tokenized; run again")
        write_json(info, shard.dir / SHARD_META)
    except BaseException as err:
        for writer in writers.values():
            writer.out.close()
        remove_token_files(shard.dir)
        if disk_full(err):
            raise no_space(shard.dir, f"building the token cache of {corpus.cache_name}", MOVE_IT) from None
        raise
    return info


def encode_files(corpus, files: list[Path], numbers: list[int], writers: dict, tokenizer, dtype: np.dtype,
                 threshold: np.uint64, num_proc: int | None, stats: Throughput) -> None:
    """Encode ``files`` (the group's files ``numbers``) and append their documents to each split."""
    index = np.array(numbers)
    keyed = ((texts, (corpus.document_keys(texts), index[origin])) for texts, origin in text_batches(corpus, files))
    for ids, lengths, (keys, origin) in encoded_batches(keyed, tokenizer, dtype, True, num_proc, stats):
        held = keys < threshold
        if not held.any():
            writers["train"].add(ids, lengths, keys, origin)
        else:
            tokens_held = np.repeat(held, lengths)
            writers["train"].add(ids[~tokens_held], lengths[~held], keys[~held], origin[~held])
            writers["val"].add(ids[tokens_held], lengths[held], keys[held], origin[held])
        stats.tokens += len(ids)


def ensure_shard(corpus, shard: Shard, tokenizer, tokenizer_hash: str, num_proc: int | None, verify: bool,
                 stats: Throughput, lock_timeout: float, donors: Donors | None = None) -> tuple[dict, bool]:
    """(``shard.json`` of a complete, current ``shard``, whether this call built it): reused
    when its cheap check passes (``verify``: its full check), kept after a full check when only
    mtimes moved, else built, under the shard's own lock."""
    dtype = token_dtype(tokenizer.vocab_size)
    info = read_shard(shard)
    if info is not None and not verify and shard_mismatch(info, shard, tokenizer_hash, dtype)[0] is None:
        return info, False
    shard.dir.mkdir(parents=True, exist_ok=True)
    with build_lock(shard.dir, lock_timeout):
        info = read_shard(shard)  # another process may have built it while this one waited
        why = "not built yet"
        if info is not None:
            why, checkable = shard_mismatch(info, shard, tokenizer_hash, dtype)
            if why is None and not verify:
                return info, False
            if why is None or checkable:
                reason, why = why, shard_full_check(info, shard, everything=verify)
                if why is None:
                    write_json(info, shard.dir / SHARD_META)
                    if reason is not None:
                        print(f"[pelab] token cache {shard.dir}: {reason}, but the content is unchanged: used as it "
                              f"is", flush=True)
                    return info, False
            print(f"[pelab] token cache {shard.dir} is stale: {why}; rebuilding", flush=True)
        return build_shard(corpus, shard, tokenizer, tokenizer_hash, dtype, num_proc, stats, donors), True


def split_parts(infos: list[tuple[Shard, dict]]) -> dict[str, list[list]]:
    """Each split's parts (module docstring): every shard's own split, in order; when a split
    is empty corpus-wide, the other split's extreme document (smallest key held out, largest
    key trained) moves, cut out of its shard's part."""
    parts: dict[str, list[list]] = {split: [] for split in SPLITS}
    for shard, info in infos:
        for split in SPLITS:
            entry = info["splits"][split]
            if entry["num_documents"]:
                parts[split].append([shard.key, split, 0, entry["num_documents"], 0, entry["num_tokens"]])
    for empty, other, smallest in (("val", "train", True), ("train", "val", False)):
        if parts[empty] or not parts[other]:
            continue
        candidates = [(info["splits"][other]["extreme_key"], n) for n, (_, info) in enumerate(infos)
                      if info["splits"][other]["extreme_key"] is not None]
        # the smallest (largest) key, the first shard's of equal ones: np.argmin (argmax) over the corpus
        (key, doc), n = min(candidates, key=lambda c: (c[0][0] if smallest else -c[0][0], c[1]))
        shard = infos[n][0]
        offsets = np.load(shard.dir / f"{other}.offsets.npy", mmap_mode="r")
        start, end = int(offsets[doc]), int(offsets[doc + 1])
        parts[empty] = [[shard.key, other, doc, doc + 1, start, end]]
        i = next(i for i, p in enumerate(parts[other]) if p[0] == shard.key)
        whole = parts[other][i]
        pieces = [[shard.key, other, whole[2], doc, whole[4], start], [shard.key, other, doc + 1, whole[3], end, whole[5]]]
        parts[other][i : i + 1] = [p for p in pieces if p[3] > p[2]]
    return parts


def manifest(corpus, tokenizer, tokenizer_hash: str, infos: list[tuple[Shard, dict]]) -> dict:
    dtype = token_dtype(tokenizer.vocab_size)
    documents = sum(info["splits"][s]["num_documents"] for _, info in infos for s in SPLITS)
    if documents < 2:
        raise ValueError(f"data.paths holds {documents} non-empty document(s) in {len(corpus.files)} file(s) "
                         f"({', '.join(map(str, corpus.files[:3]))}): a held-out split needs at least two; add "
                         f"documents, or split plain text with data.text_sample_by=paragraph (or line)")
    parts = split_parts(infos)
    by_key = dict((shard.key, info) for shard, info in infos)
    splits = {}
    for split in SPLITS:
        digest = hashlib.sha256()
        for part in parts[split]:
            digest.update(json.dumps([by_key[part[0]]["splits"][part[1]]["sha256"], *part[2:]]).encode())
        splits[split] = {"num_tokens": sum(p[5] - p[4] for p in parts[split]),
                         "num_documents": sum(p[3] - p[2] for p in parts[split]),
                         "max_id": max((by_key[p[0]]["splits"][p[1]]["max_id"] for p in parts[split]), default=-1),
                         "sha256": digest.hexdigest(), "parts": parts[split]}
    content = hashlib.sha256(json.dumps([corpus._options(), [info["content"] for _, info in infos]]).encode())
    return {"version": FORMAT_VERSION, "tokenizer": tokenizer.name, "tokenizer_hash": tokenizer_hash,
            "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token, "dtype": dtype.name,
            "corpus": corpus.cache_name, "corpus_hash": content.hexdigest(), "corpus_stat": corpus_stat(corpus),
            "shards": [{"key": shard.key, "splits": {s: [info["splits"][s]["num_tokens"],
                                                         info["splits"][s]["mtime_ns"]] for s in SPLITS}}
                       for shard, info in infos],
            "splits": splits}


def manifest_mismatch(meta: dict, out_dir: Path, tokenizer, tokenizer_hash: str, stat: str) -> str | None:
    """Why the manifest cannot be used as it is, or None: O(files + shards), reading no data."""
    why = header_mismatch(meta, tokenizer, tokenizer_hash)
    if why is not None:
        return why
    try:
        itemsize = token_dtype(tokenizer.vocab_size).itemsize
        if meta.get("corpus_stat") != stat:
            return "corpus files changed (paths, sizes or mtimes)"
        for entry in meta["shards"]:
            for split, (tokens, mtime) in entry["splits"].items():
                path = out_dir / SHARDS / entry["key"] / f"{split}.bin"
                if not path.is_file():
                    return f"{path} is missing"
                found = path.stat()
                if found.st_size != tokens * itemsize or found.st_mtime_ns != mtime:
                    return f"{path} changed after it was built (size or mtime)"
        for split in SPLITS:
            meta["splits"][split]["parts"]
    except (KeyError, TypeError, AttributeError, ValueError) as err:
        return f"meta.json incomplete ({type(err).__name__}: {err})"
    return None


def prepare_sharded(corpus, tokenizer, out_dir: Path, num_proc: int | None = None, verify: bool = False,
                    stats: Throughput | None = None, lock_timeout: float = LOCK_TIMEOUT,
                    part: tuple[int, int] | None = None, merge: bool = False) -> dict | None:
    """data/cache.py ``prepare_token_files`` for a corpus of files, shard by shard. ``part=(i,
    n)``: build (or verify) groups i, i+n, ... only and return None; ``merge``: build nothing,
    check every shard, write the manifest (``MissingShards`` naming what is absent)."""
    out_dir = Path(out_dir)
    stats = stats if stats is not None else Throughput()
    tokenizer_hash, stat = tokenizer.fingerprint(), corpus_stat(corpus)
    if part is None and not merge and not verify:
        meta, _ = read_meta(out_dir)
        if meta is not None and manifest_mismatch(meta, out_dir, tokenizer, tokenizer_hash, stat) is None:
            return with_part_offsets(meta, out_dir)
    check_cache_folder(out_dir, built=False)
    (out_dir / SHARDS).mkdir(parents=True, exist_ok=True)
    shards = plan(corpus, out_dir, tokenizer_hash)
    # unchanged files already in some shard are copied, not encoded (a verifying run trusts no copy)
    donors = None if verify else Donors(out_dir, tokenizer_hash, token_dtype(tokenizer.vocab_size))
    if part is not None:
        mine = shards[part[0] :: part[1]]
        built = sum(ensure_shard(corpus, s, tokenizer, tokenizer_hash, num_proc, verify, stats, lock_timeout,
                                 donors)[1] for s in mine)
        stats.built = built > 0
        print(f"[pelab] token cache {out_dir}: shard={part[0]}/{part[1]}: {len(mine)} of {len(shards)} groups of "
              f"files, {built} built, {len(mine) - built} already complete; merge=true writes the manifest when "
              f"every part is done", flush=True)
        return None
    with build_lock(out_dir, lock_timeout):
        meta, why = read_meta(out_dir)  # another process may have written it while this one waited
        if meta is not None and not verify and not merge:
            why = manifest_mismatch(meta, out_dir, tokenizer, tokenizer_hash, stat)
            if why is None:
                return with_part_offsets(meta, out_dir)
        if meta is not None and meta.get("version") != FORMAT_VERSION:
            print(f"[pelab] token cache {out_dir}: format version {meta.get('version')}, expected {FORMAT_VERSION}; "
                  f"building it again beside the old files (scripts/prepare_data.py clean=true removes them)",
                  flush=True)
        if merge:
            infos = merged(shards, tokenizer, tokenizer_hash)
        else:
            from tqdm.auto import tqdm

            infos, built = [], 0
            if not verify:  # a verifying run says what it found below
                print(f"[pelab] tokenizing {corpus.cache_name} ({tokenizer.name}) into {out_dir}: {len(shards)} groups of "
                      f"files, each built unless a complete shard of it is there", flush=True)
            with tqdm(total=len(shards), unit="group", desc=f"groups of files checked or tokenized ({tokenizer.name})",
                      dynamic_ncols=True) as bar:
                for shard in shards:
                    info, fresh = ensure_shard(corpus, shard, tokenizer, tokenizer_hash, num_proc, verify, stats,
                                               lock_timeout, donors)
                    infos.append((shard, info))
                    built += fresh
                    bar.update(1)
                    bar.set_postfix_str(f"{built} built, {stats.tokens / max(time.perf_counter() - stats.wall, 1e-9) / 1e6:.2f} "
                                        f"M tok/s", refresh=False)
            stats.built = built > 0
            if built:
                copied = f" ({stats.copied:,} tokens of unchanged files copied, not encoded)" if stats.copied else ""
                print(f"[pelab] tokenized {corpus.cache_name} ({tokenizer.name}): {built} of {len(shards)} groups of "
                      f"files built{copied}, {len(shards) - built} reused; {stats.line()}", flush=True)
        meta = manifest(corpus, tokenizer, tokenizer_hash, infos)
        write_meta(meta, out_dir)
    return with_part_offsets(meta, out_dir)


def merged(shards: list[Shard], tokenizer, tokenizer_hash: str) -> list[tuple[Shard, dict]]:
    """Every shard's ``shard.json``, each checked (cheaply) complete and current; else one line
    naming the missing ones."""
    dtype = token_dtype(tokenizer.vocab_size)
    infos, missing = [], []
    for n, shard in enumerate(shards):
        info = read_shard(shard)
        why = "not built" if info is None else shard_mismatch(info, shard, tokenizer_hash, dtype)[0]
        if why is not None:
            missing.append(f"group {n} {shard}: {why}")
        infos.append((shard, info))
    if missing:
        raise MissingShards(f"merge=true: {len(missing)} of {len(shards)} shards missing or incomplete: "
                            f"{'; '.join(missing[:3])}{'; ...' if len(missing) > 3 else ''}; build them with "
                            f"shard=i/n (every i of the same n), then merge again")
    return infos


def token_source(out_dir: Path, meta: dict | None, split: str):
    """What data/stream.py's ``load_tokens`` reads for ``split``: the ``.bin`` of a one-file
    cache, or a sharded cache's parts (``SplitParts``)."""
    out_dir = Path(out_dir)
    if meta is None or "parts" not in meta["splits"][split]:
        return out_dir / f"{split}.bin"
    return SplitParts([(out_dir / SHARDS / key / f"{file_split}.bin", start, end)
                       for key, file_split, _, _, start, end in meta["splits"][split]["parts"]], out_dir / split)


class PartOffsets:
    """A sharded split's document offsets (int64, first 0, last the token count), concatenated
    from its parts' offset files on first use (8 bytes a document; nothing reads them at start)."""

    def __init__(self, out_dir: Path, parts: list[list]) -> None:
        self.out_dir, self.parts, self._array = out_dir, parts, None

    def array(self) -> np.ndarray:
        if self._array is None:
            pieces, base = [np.zeros(1, dtype=np.int64)], 0
            for key, file_split, first, end, _, _ in self.parts:
                offsets = np.load(self.out_dir / SHARDS / key / f"{file_split}.offsets.npy", mmap_mode="r")
                piece = np.asarray(offsets[first : end + 1], dtype=np.int64)
                pieces.append(piece[1:] - piece[0] + base)
                base += int(piece[-1] - piece[0])
            self._array = np.concatenate(pieces)
        return self._array

    def __array__(self, dtype=None, copy=None):
        return self.array() if dtype is None else self.array().astype(dtype)

    def __len__(self) -> int:
        return len(self.array())

    def __getitem__(self, index):
        return self.array()[index]

    def __iter__(self):
        return iter(self.array())


def with_part_offsets(meta: dict, out_dir: Path) -> dict:
    for split in SPLITS:
        meta["splits"][split]["doc_offsets"] = PartOffsets(Path(out_dir), meta["splits"][split]["parts"])
    return meta


# ---- clean=true: what no current manifest references ----

def cache_folders(root: Path) -> list[Path]:
    """The token cache folders under ``root`` (``data_dir/<corpus>/<tokenizer>``): those holding
    a pelab file (meta.json, build.lock or shards/), nothing else."""
    if not root.is_dir():
        return []
    return sorted(folder for corpus in root.iterdir() if corpus.is_dir() for folder in corpus.iterdir()
                  if folder.is_dir() and any((folder / n).exists() for n in ("meta.json", "build.lock", SHARDS)))


def stale_entries(root: Path) -> tuple[list[tuple[Path, str]], list[tuple[Path, str]]]:
    """(what ``clean`` removes, what it keeps and why), each a (path, reason). Removed: a cache
    of an older format (its whole folder), shards no manifest of the current format lists, and
    a build's leftovers (``*.partial``, ``build/``). Kept: shards of a folder without a manifest
    (a parallel build not merged yet)."""
    stale, kept = [], []
    for folder in cache_folders(root):
        meta, _ = read_meta(folder)
        if meta is not None and meta.get("version") != FORMAT_VERSION:
            stale.append((folder, f"format version {meta.get('version')} (current: {FORMAT_VERSION})"))
            continue
        debris = [p for p in folder.rglob("*") if p.name.endswith((".partial", ".partial.npy")) or
                  (p.name == "build" and p.is_dir())]
        stale += [(p, "a build's leftover") for p in debris]
        shard_dirs = sorted(p for p in (folder / SHARDS).iterdir() if p.is_dir()) if (folder / SHARDS).is_dir() else []
        if meta is None:
            if shard_dirs:
                kept.append((folder, f"{len(shard_dirs)} shards and no manifest: a parallel build not merged yet "
                                     f"(merge=true), kept"))
            continue
        if "shards" not in meta:
            continue
        listed = {entry.get("key") for entry in meta["shards"]}
        stale += [(p, "no manifest references it") for p in shard_dirs if p.name not in listed]
        old_files = [folder / f"{split}{suffix}" for split in SPLITS for suffix in (".bin", ".offsets.npy")]
        stale += [(p, "a token file of the older, unsharded format") for p in old_files if p.is_file()]
    return stale, kept


def held_by_another(folder: Path) -> str | None:
    """Who holds ``folder``'s build lock (data/lock.py), or None: its flock, else a lease whose
    process is alive (or on another host)."""
    fd = try_flock(folder / "build.lock") if (folder / "build.lock").exists() else -1
    if fd is None:
        from data.lock import Lease

        return holder_line(Lease(folder / "build.owner").read())
    if fd >= 0:
        os.close(fd)
    owner = folder / "build.owner"
    try:
        found = (owner.read_text(), owner.stat().st_mtime_ns)
    except OSError:
        return None
    try:
        info = json.loads(found[0])
    except ValueError:
        info = {}
    import socket

    if info.get("host") == socket.gethostname() and isinstance(info.get("pid"), int) and not process_alive(info["pid"]):
        return None  # its builder is gone
    return holder_line(found)


def clean(root: Path) -> tuple[list[tuple[Path, str, int]], list[tuple[Path, str]]]:
    """Remove what ``stale_entries`` lists; refuse (``CleanRefused``, one line, nothing removed)
    while any cache folder or shard under ``root`` is being built. ((path, reason, bytes)
    removed, kept)."""
    folders = cache_folders(root)
    shard_dirs = [p for f in folders if (f / SHARDS).is_dir() for p in (f / SHARDS).iterdir() if p.is_dir()]
    for folder in folders + shard_dirs:
        holder = held_by_another(folder)
        if holder is not None:
            raise CleanRefused(f"clean=true: {folder} is being built by {holder}; nothing was removed: run clean=true "
                               f"when no preparation or training start is building a token cache under {root}")
    stale, kept = stale_entries(root)
    removed = []
    for path, why in stale:
        size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
        shutil.rmtree(path) if path.is_dir() else path.unlink()
        removed.append((path, why, size))
        parent = path.parent
        if why.startswith("format") and parent != root and not any(parent.iterdir()):
            parent.rmdir()  # the corpus folder of a removed cache, left empty
    return removed, kept


class CleanRefused(ValueError):
    """``clean=true`` while a build runs under the cache root: one line, nothing removed."""


def parse_part(text) -> tuple[int, int]:
    """``shard=i/n`` as (i, n); one line naming the key, the value and what is allowed."""
    allowed = "i/n with integers 0 <= i < n, e.g. shard=0/4 .. shard=3/4 (one per process or node)"
    try:
        i, n = (int(x) for x in str(text).split("/"))
    except ValueError:
        raise ValueError(f"shard={text} is not valid: expected {allowed}") from None
    if n < 1 or not 0 <= i < n:
        raise ValueError(f"shard={text} is not valid: {'n must be >= 1' if n < 1 else f'i must be in 0 .. {n - 1}'}; "
                         f"expected {allowed}")
    return i, n

