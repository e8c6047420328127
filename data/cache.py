"""The token cache: a corpus tokenized once into ``{split}.bin`` memmaps, built by one process.

``prepare_token_files(corpus, tokenizer, out_dir)`` returns the cache's metadata, building the
cache first when it is missing or stale. Layout of ``out_dir`` after a build, and nothing else:

- ``{split}.bin``: the token ids of every document of the split, each followed by the
  end-of-text separator (uint16 when the vocabulary fits, else uint32);
- ``{split}.offsets.npy``: int64, where each document starts (and the end): read as a memmap;
- ``meta.json``: small, written last and atomically: format version, tokenizer name and
  fingerprint, vocabulary size, dtype, the corpus's full fingerprint (``corpus_hash``) and its
  cheap one (``corpus_stat``: paths, sizes and mtimes), and per split the number of tokens
  and documents, the largest id, the sha256 and the mtime of the ``.bin``;
- ``build.lock`` (empty; ``build.owner`` beside it while a build holds it: see below).

**Start-up check, O(number of files).** A cache is used as it is when ``meta.json`` matches the
format, the tokenizer (fingerprint), the dtype and the corpus's *cheap* fingerprint, and every
file has its recorded size and mtime: nothing is hashed or re-tokenized, and a hub corpus is not
even opened. When only mtimes differ (a corpus file touched, the cache copied), the full check
runs once: the corpus's full fingerprint, the sha256 of each ``.bin`` whose mtime moved. If they
match, ``meta.json`` records the new mtimes and the cache is used; otherwise it is rebuilt, one
line saying why (a ``.bin`` written in place, its size kept, is caught here: its mtime moves and
its sha256 differs). Corpora without a cheap fingerprint (the embedded 6 MB one) are
fingerprinted in full. ``verify=True`` (scripts/prepare_data.py) runs the full check whatever
the mtimes: it also sees a hub corpus changed upstream and bit rot that kept the mtime.

**One builder.** The check-and-build runs under ``out_dir``'s build lock (data/lock.py: a lease
file created ``O_EXCL`` with owner, host and heartbeat, and ``flock`` beside it where the
filesystem has one): whichever process (rank, node, sweep job) takes it first builds; the
others print one line, wait (at most ``lock_timeout`` seconds, then one line), then find the
cache valid and use it. A builder that died (its process gone, or its heartbeat stopped) is
taken over; its partial files are replaced by the next build.

**Building.** The corpus is loaded into ``out_dir/build/`` (its Arrow files), read one Arrow
batch of ``BATCH_DOCUMENTS`` documents at a time, each batch encoded by
``tokenizer.encode_array`` (one ``encode_batch`` call and one ``np.fromiter``) and appended to
``{split}.bin.partial``, hashed on the way; ``tokenize_num_proc`` > 1 encodes batches in that many
threads (the tokenizers release the GIL), written in order. Memory stays at a few batches
whatever the corpus size. ``build/`` is deleted at the end, so only the files above remain.
``Throughput`` measures a build and compares it with the tokenizer's raw call on the same text.

**Corpora of files** (``data=text``) bring their own ``prepare_token_files``: the cache is a
set of shards, one per group of files, read in place (no ``build/`` copy), with a manifest as
``meta.json`` listing each split's parts, so a grown corpus encodes only its new files and the
work splits across processes (data/shards.py; same checks, lock and messages, per shard).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import resource
import shutil
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from data.lock import LOCK_TIMEOUT, build_lock
from data.paths import PathError, disk_full, folder_problem, no_space

FORMAT_VERSION = 4  # 2: hashes in meta.json, bytes separator 0x1E; 3: offsets .npy, corpus_stat, .bin sha256;
# 4: corpora of files sharded by group of files (data/shards.py), read in place
SPLITS = ("train", "val")
BATCH_DOCUMENTS = 1000  # documents per encode call
MOVE_IT = "data.data_dir (or $PELAB_CACHE)"  # the options that say where the cache lives


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def corpus_stat(corpus) -> str:
    """The corpus's cheap fingerprint (``quick_fingerprint``: paths, sizes, mtimes, options);
    corpora without one are fingerprinted in full."""
    quick = getattr(corpus, "quick_fingerprint", None)
    return quick() if quick is not None else corpus.fingerprint()


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def offsets_path(out_dir: Path, split: str) -> Path:
    return out_dir / f"{split}.offsets.npy"


def check_cache_folder(out_dir: Path, key: str | None = None, given=None, built: bool = True) -> None:
    """``out_dir`` can hold this cache: a folder this user can write (or create), or (``built``)
    one holding a built cache (meta.json), read as it is. Else one line (``key=given`` first where
    given), before any data is read: a build would fail on its first write."""
    out_dir = Path(out_dir).absolute()
    if built and (out_dir / "meta.json").is_file() and os.access(out_dir, os.R_OK | os.X_OK):
        return  # a read-only copy of a built cache serves as it is; a rebuild is checked again
    problem = folder_problem(out_dir)
    if problem is not None:
        existing, what = problem
        said = f"{key}={'null' if given is None else given}: " if key else ""
        raise PathError(f"{said}the token cache's folder {out_dir} cannot be written: {existing} is {what}; point "
                        f"{MOVE_IT} at a folder this user can write")


def read_meta(out_dir: Path) -> tuple[dict | None, str | None]:
    """(meta.json's content, None), or (None, why it cannot be used)."""
    path = out_dir / "meta.json"
    if not path.is_file():
        return None, "no meta.json"
    try:
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
        return meta, None
    except (OSError, ValueError) as err:
        return None, f"meta.json unreadable ({type(err).__name__}: {err})"


def header_mismatch(meta: dict, tokenizer, tokenizer_hash: str) -> str | None:
    """Why ``meta`` (a cache's or a manifest's) was not built by this format and tokenizer, or None."""
    if meta.get("version") != FORMAT_VERSION:
        return f"format version {meta.get('version')}, expected {FORMAT_VERSION}"
    if meta.get("tokenizer") != tokenizer.name:
        return f"tokenizer {meta.get('tokenizer')!r}, expected {tokenizer.name!r}"
    if meta.get("tokenizer_hash") != tokenizer_hash:
        return (f"tokenizer {tokenizer.name!r} changed (fingerprint {str(meta.get('tokenizer_hash'))[:12]} "
                f"-> {tokenizer_hash[:12]})")
    dtype = token_dtype(tokenizer.vocab_size)
    if meta.get("vocab_size") != tokenizer.vocab_size or meta.get("dtype") != dtype.name:
        return (f"vocabulary {meta.get('vocab_size')} ({meta.get('dtype')}), expected {tokenizer.vocab_size} "
                f"({dtype.name})")
    return None


def cache_mismatch(meta: dict, out_dir: Path, tokenizer, tokenizer_hash: str, stat: str) -> tuple[str | None, bool]:
    """(what makes the cache unusable, whether a full check may clear it), or (None, False) when
    it matches. O(number of files): compares meta.json with the tokenizer, the corpus's cheap
    fingerprint and every file's size and mtime; reads no data."""
    why = header_mismatch(meta, tokenizer, tokenizer_hash)
    if why is not None:
        return why, False
    try:
        dtype = token_dtype(tokenizer.vocab_size)
        if any("parts" in meta["splits"][split] for split in SPLITS):
            return "a sharded cache's manifest, for a corpus that is not sharded", False
        for split in SPLITS:
            info = meta["splits"][split]
            path, offsets = out_dir / f"{split}.bin", offsets_path(out_dir, split)
            for file in (path, offsets):
                if not file.is_file():
                    return f"{file.name} is missing", False
            expected = info["num_tokens"] * dtype.itemsize
            if path.stat().st_size != expected:
                return (f"{path.name} has {path.stat().st_size} bytes, expected {expected} "
                        f"({info['num_tokens']} tokens x {dtype.itemsize})"), False
            if not -1 <= info["max_id"] < tokenizer.vocab_size:  # -1: no tokens
                return f"{path.name} holds id {info['max_id']}, outside the vocabulary of {tokenizer.vocab_size}", False
        if meta.get("corpus_stat") != stat:
            return "corpus files changed (paths, sizes or mtimes)", True
        for split in SPLITS:
            if (out_dir / f"{split}.bin").stat().st_mtime_ns != meta["splits"][split]["mtime_ns"]:
                return f"{split}.bin was modified after it was built (mtime)", True
    except (KeyError, TypeError, AttributeError) as err:  # an incomplete or foreign meta.json
        return f"meta.json incomplete ({type(err).__name__}: {err})", False
    return None, False


def full_check(meta: dict, out_dir: Path, corpus, everything: bool = False) -> str | None:
    """The expensive half of the check, run by the lock holder only: the corpus's full
    fingerprint and the sha256 of every ``.bin`` whose mtime moved (``everything``: of every
    ``.bin``, and the full fingerprint even when the cheap one matches). None when the cache
    is intact (then ``meta`` is updated with the new mtimes)."""
    if everything or meta.get("corpus_stat") != corpus_stat(corpus):
        corpus_hash = fingerprint_in(corpus, out_dir / "build")
        if corpus_hash != meta.get("corpus_hash"):
            return f"corpus changed (fingerprint {str(meta.get('corpus_hash'))[:12]} -> {corpus_hash[:12]})"
    for split in SPLITS:
        why = token_file_changed(out_dir / f"{split}.bin", meta["splits"][split], everything)
        if why:
            return why
    meta["corpus_stat"] = corpus_stat(corpus)
    return None


def token_file_changed(path: Path, entry: dict, everything: bool) -> str | None:
    """Why the token file ``path`` is not what ``entry`` (its ``sha256`` and ``mtime_ns`` at the build)
    recorded, or None; its sha256 is read only when its mtime moved (or ``everything``), and a file
    touched but unchanged gets its new mtime recorded in ``entry``."""
    mtime = path.stat().st_mtime_ns
    if everything or mtime != entry["mtime_ns"]:
        digest = file_sha256(path)
        if digest != entry["sha256"]:
            return (f"{path.name} was modified after it was built (sha256 {digest[:12]}, built as "
                    f"{entry['sha256'][:12]}): corrupted in place?")
        entry["mtime_ns"] = mtime
    return None


def fingerprint_in(corpus, scratch: Path) -> str:
    """The corpus's full fingerprint; a corpus that must be loaded for it (``loads_to_fingerprint``:
    a hub corpus) is loaded into ``scratch`` (kept loaded for a rebuild; ``let_go`` removes it)."""
    if getattr(corpus, "loads_to_fingerprint", False):
        corpus.load(scratch)
    return corpus.fingerprint()


def let_go(corpus, scratch: Path) -> None:
    """Remove the build folder and the corpus's Arrow copies in it; a corpus holding its loaded
    splits (``release``) lets go of them first: their memory maps would keep the space allocated."""
    if hasattr(corpus, "release"):
        corpus.release()
    shutil.rmtree(scratch, ignore_errors=True)


def with_offsets(meta: dict, out_dir: Path) -> dict:
    """``meta`` with each split's ``doc_offsets``: the offsets file as a read-only memmap."""
    for split in SPLITS:
        meta["splits"][split]["doc_offsets"] = np.load(offsets_path(out_dir, split), mmap_mode="r")
    return meta


def write_meta(meta: dict, out_dir: Path) -> None:
    plain = {**meta, "splits": {s: {k: v for k, v in info.items() if k != "doc_offsets"}
                                for s, info in meta["splits"].items()}}
    tmp = out_dir / "meta.json.partial"
    tmp.write_text(json.dumps(plain, separators=(",", ":")))  # compact: a sharded cache's manifest lists every part
    os.replace(tmp, out_dir / "meta.json")


def cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Throughput:
    """Tokens, wall and CPU seconds of a whole build (fingerprint, reading, tokenizing, writing:
    the process's CPU time, every thread).

    With ``reference_tokens`` > 0 (scripts/prepare_data.py), the build keeps the text of batches
    spread evenly over it (every batch, then every 2nd, 4th, ... whenever the kept text passes
    about ``reference_tokens`` tokens, 4 characters each). When the build is done (its time
    taken), that text is encoded again in batches of ``BATCH_DOCUMENTS``, by pelab
    (``encode_array``) and by the tokenizer's raw batch call (``raw_encode_batch``: tiktoken's
    ``encode_ordinary_batch``), both at one thread with nothing else running, each timed in the
    process's CPU seconds (other processes loading the machine do not count). So the build's
    rate is compared with the raw call on the same text at the same thread count."""

    def __init__(self, reference_tokens: int = 0) -> None:
        self.tokens, self.reference_tokens, self.built = 0, reference_tokens, False
        self.copied = 0  # tokens a sharded build copied from other shards instead of encoding (data/shards.py)
        self.kept: list[list[str]] = []
        self.kept_chars, self.stride, self.batches, self.encoding = 0, 1, 0, None
        self.wall, self.cpu = time.perf_counter(), cpu_seconds()
        self._summary: dict | None = None

    def keep(self, tokenizer, texts: list[str], dtype: np.dtype, separate: bool) -> None:
        """Keep every ``stride``-th batch's text, halving what is kept when it grows past the budget."""
        if self.reference_tokens <= 0:
            return
        self.encoding = (tokenizer, dtype, separate)
        if self.batches % self.stride == 0:
            self.kept.append(texts)
            self.kept_chars += sum(map(len, texts))
            if self.kept_chars > 4 * self.reference_tokens:
                self.kept, self.stride = self.kept[::2], 2 * self.stride
                self.kept_chars = sum(len(t) for batch in self.kept for t in batch)
        self.batches += 1

    def reference(self) -> dict:
        """(tokens, pelab's CPU seconds, the raw call's CPU seconds) on the kept text."""
        tokenizer, dtype, separate = self.encoding
        texts = [t for batch in self.kept for t in batch]
        tokens, mine, raw = 0, 0.0, 0.0
        for i in range(0, len(texts), BATCH_DOCUMENTS):
            chunk = texts[i : i + BATCH_DOCUMENTS]
            start = cpu_seconds()
            ids, _ = tokenizer.encode_array(chunk, dtype, separate)
            middle = cpu_seconds()
            tokenizer.raw_encode_batch(tokenizer._document_texts(chunk))
            raw, mine = raw + cpu_seconds() - middle, mine + middle - start
            tokens += len(ids)
        return {"reference_tokens": tokens, "encode_cpu_s": mine, "raw_cpu_s": raw}

    def summary(self) -> dict:
        """The build's figures (taken at the first call, the end of the build) and the comparison."""
        if self._summary is None:
            wall, cpu = time.perf_counter() - self.wall, cpu_seconds() - self.cpu
            result = {"tokens": self.tokens, "wall_s": wall, "cpu_s": cpu,
                      "tokens_per_cpu_s": self.tokens / max(cpu, 1e-9)}
            if self.kept and self.encoding is not None:
                result.update(self.reference())
                result["raw_tokens_per_cpu_s"] = result["reference_tokens"] / max(result["raw_cpu_s"], 1e-9)
                result["encode_tokens_per_cpu_s"] = result["reference_tokens"] / max(result["encode_cpu_s"], 1e-9)
                result["fraction_of_raw"] = result["tokens_per_cpu_s"] / result["raw_tokens_per_cpu_s"]
            self._summary = result
        return self._summary

    def line(self) -> str:
        r = self.summary()
        text = (f"{r['tokens']:,} tokens in {r['wall_s']:.1f} s ({r['tokens'] / max(r['wall_s'], 1e-9) / 1e6:.2f} M "
                f"tok/s; {r['tokens_per_cpu_s'] / 1e6:.2f} M tok per CPU-s of the whole build over {r['cpu_s']:.1f} "
                f"CPU-s)")
        if "fraction_of_raw" in r:
            text += (f"; on the same text ({r['reference_tokens']:,} tokens of batches spread over the build, one "
                     f"thread each, CPU time) the raw tokenizer call runs at {r['raw_tokens_per_cpu_s'] / 1e6:.2f} M "
                     f"tok per CPU-s and pelab's encoding at {r['encode_tokens_per_cpu_s'] / 1e6:.2f}, so the build "
                     f"runs at {r['fraction_of_raw']:.0%} of it")
        return text


def encoded_batches(batches, tokenizer, dtype: np.dtype, separate: bool, num_proc: int | None, stats: Throughput):
    """(ids, lengths, tag) of every (texts, tag) of ``batches``, in order. With ``num_proc`` > 1,
    batches are encoded in that many threads, at most 2 x num_proc of them in flight."""
    workers = num_proc or 1
    if workers == 1:
        for texts, tag in batches:
            stats.keep(tokenizer, texts, dtype, separate)
            yield (*tokenizer.encode_array(texts, dtype, separate), tag)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="pelab-tokenize") as pool:
        pending: deque = deque()
        for texts, tag in batches:
            stats.keep(tokenizer, texts, dtype, separate)
            pending.append((pool.submit(tokenizer.encode_array, texts, dtype, separate), tag))
            if len(pending) >= 2 * workers:
                future, tag_ = pending.popleft()
                yield (*future.result(), tag_)
        while pending:
            future, tag_ = pending.popleft()
            yield (*future.result(), tag_)


def write_split(dataset, tokenizer, dtype: np.dtype, separate: bool, out_dir: Path, split: str,
                num_proc: int | None, stats: Throughput) -> dict:
    """Tokenize ``dataset`` into ``{split}.bin`` and ``{split}.offsets.npy`` (each written as a
    .partial and renamed); the split's metadata."""
    from tqdm.auto import tqdm

    path, offsets = out_dir / f"{split}.bin", offsets_path(out_dir, split)
    tmp, offsets_tmp = path.with_name(path.name + ".partial"), offsets.with_name(split + ".offsets.partial.npy")
    starts = np.lib.format.open_memmap(offsets_tmp, mode="w+", dtype=np.int64, shape=(len(dataset) + 1,))
    reserve(offsets_tmp)  # its blocks now: a full disk is an error here, not a SIGBUS in the mapped writes
    starts[0] = 0
    digest, total, docs, max_id = hashlib.sha256(), 0, 0, -1
    with open(tmp, "wb") as out, tqdm(total=len(dataset), unit="doc", desc=f"tokenizing {split} ({tokenizer.name})",
                                      dynamic_ncols=True) as bar:
        batches = ((table.column("text").to_pylist(), None)
                   for table in dataset.with_format("arrow").iter(batch_size=BATCH_DOCUMENTS))
        for ids, lengths, _ in encoded_batches(batches, tokenizer, dtype, separate, num_proc, stats):
            out.write(ids)
            digest.update(ids)
            starts[docs + 1 : docs + 1 + len(lengths)] = total + np.cumsum(lengths)
            total, docs = total + len(ids), docs + len(lengths)
            if len(ids):
                max_id = max(max_id, int(ids.max()))
            stats.tokens += len(ids)
            bar.update(len(lengths))
            bar.set_postfix_str(f"{stats.tokens / max(time.perf_counter() - stats.wall, 1e-9) / 1e6:.2f} M tok/s",
                                refresh=False)
    if docs != len(dataset):
        raise RuntimeError(f"{split}: {docs} documents encoded, {len(dataset)} expected")
    starts.flush()
    del starts
    os.replace(offsets_tmp, offsets)
    os.replace(tmp, path)
    return {"num_tokens": total, "num_documents": docs, "max_id": max_id, "sha256": digest.hexdigest(),
            "mtime_ns": path.stat().st_mtime_ns}


def reserve(path: Path) -> None:
    """Allocate ``path``'s blocks (a memmap's file is sparse until its pages are written)."""
    if not hasattr(os, "posix_fallocate"):
        return
    with open(path, "r+b") as f:
        try:
            os.posix_fallocate(f.fileno(), 0, os.fstat(f.fileno()).st_size)
        except OSError as err:
            if err.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # a filesystem without it
                raise


def remove_token_files(out_dir: Path) -> None:
    """What a failed build wrote: its ``.partial`` files and the token files it had renamed
    (meta.json is gone since the build began: they are no cache)."""
    for split in SPLITS:
        path, offsets = out_dir / f"{split}.bin", offsets_path(out_dir, split)
        for file in (path, path.with_name(path.name + ".partial"), offsets,
                     offsets.with_name(split + ".offsets.partial.npy")):
            file.unlink(missing_ok=True)
    (out_dir / "meta.json.partial").unlink(missing_ok=True)


def build(corpus, tokenizer, out_dir: Path, num_proc: int | None, tokenizer_hash: str, stats: Throughput) -> dict:
    """Tokenize ``corpus`` into ``out_dir`` (the caller holds the build lock)."""
    (out_dir / "meta.json").unlink(missing_ok=True)  # first: a crash mid-build leaves no meta.json over half-written bins
    scratch = out_dir / "build"  # emptied when the lock was taken (a hub corpus may be loaded there since)
    print(f"[pelab] tokenizing {corpus.cache_name} ({tokenizer.name}) into {out_dir}", flush=True)
    separate = getattr(corpus, "rows_are_documents", True)
    dtype = token_dtype(tokenizer.vocab_size)
    meta = {"version": FORMAT_VERSION, "tokenizer": tokenizer.name, "tokenizer_hash": tokenizer_hash,
            "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token if separate else None,
            "dtype": dtype.name, "corpus": corpus.cache_name, "corpus_hash": None, "corpus_stat": None,
            "splits": {}}
    try:
        splits = corpus.load(scratch)  # first: a hub corpus fingerprints what it loaded there
        meta["corpus_stat"], meta["corpus_hash"] = corpus_stat(corpus), corpus.fingerprint()  # full hash: building only
        for split in SPLITS:
            meta["splits"][split] = write_split(splits[split], tokenizer, dtype, separate, out_dir, split, num_proc,
                                                stats)
        del splits
        write_meta(meta, out_dir)
    except BaseException as err:
        remove_token_files(out_dir)  # nothing half-written stays (and a full disk gets its space back)
        if disk_full(err):
            raise no_space(out_dir, f"building the token cache of {corpus.cache_name}", MOVE_IT) from None
        raise
    finally:
        let_go(corpus, scratch)  # the corpus's Arrow copies: only the token files stay
    stats.built = True
    print(f"[pelab] tokenized {corpus.cache_name} ({tokenizer.name}): {stats.line()}", flush=True)
    return meta


def prepare_token_files(corpus, tokenizer, out_dir: Path, num_proc: int | None = None, verify: bool = False,
                        stats: Throughput | None = None, lock_timeout: float = LOCK_TIMEOUT) -> dict:
    """The metadata of ``out_dir``'s token cache of ``corpus`` by ``tokenizer``; the cache is
    built first (by one process: ``build_lock``) when it is missing or stale, saying why.
    ``verify`` (scripts/prepare_data.py): also compare the corpus's full fingerprint (a hub
    corpus is opened: its data may have changed upstream) and every ``.bin``'s sha256.
    ``stats``: filled by a build (``stats.built``). ``lock_timeout``: seconds to wait for
    another process's build (``data.lock_timeout``), then one line (``data.lock.LockTimeout``)."""
    own = getattr(corpus, "prepare_token_files", None)
    if own is not None:  # a corpus with its own cache layout (files: one shard per group, data/shards.py)
        return own(tokenizer, out_dir, num_proc, verify=verify, stats=stats, lock_timeout=lock_timeout)
    out_dir = Path(out_dir)
    stats = stats if stats is not None else Throughput()
    tokenizer_hash, stat = tokenizer.fingerprint(), corpus_stat(corpus)
    meta, why = read_meta(out_dir)
    if meta is not None and not verify:
        why, _ = cache_mismatch(meta, out_dir, tokenizer, tokenizer_hash, stat)
        if why is None:
            return with_offsets(meta, out_dir)
    check_cache_folder(out_dir, built=False)  # the lock and a build write: one line, before the corpus is read
    out_dir.mkdir(parents=True, exist_ok=True)
    with build_lock(out_dir, lock_timeout):
        shutil.rmtree(out_dir / "build", ignore_errors=True)  # what a crashed build left
        meta, why = read_meta(out_dir)  # another process may have built it while this one waited
        checkable = False
        if meta is not None:
            why, checkable = cache_mismatch(meta, out_dir, tokenizer, tokenizer_hash, stat)
            if why is None and not verify:
                return with_offsets(meta, out_dir)
            if why is None or checkable:
                reason = why
                try:
                    why = full_check(meta, out_dir, corpus, everything=verify)
                except BaseException:
                    let_go(corpus, out_dir / "build")
                    raise
                if why is None:
                    let_go(corpus, out_dir / "build")
                    write_meta(meta, out_dir)
                    if reason is not None:
                        print(f"[pelab] token cache {out_dir}: {reason}, but the content is unchanged: used as it is",
                              flush=True)
                    return with_offsets(meta, out_dir)
        if meta is not None or why != "no meta.json":
            print(f"[pelab] token cache {out_dir} is stale: {why}; rebuilding", flush=True)
        return with_offsets(build(corpus, tokenizer, out_dir, num_proc, tokenizer_hash, stats), out_dir)
