"""Tokenizers: tiktoken encodings by name, or a tokenizer file by path.

- ``gpt2``: GPT-2's r50k BPE (50257 ids, ``<|endoftext|>`` = 50256), read from
  ``$PELAB_CACHE/gpt2.tiktoken`` when it is there. Else tiktoken downloads its ranks from a
  blob store (or finds them in ``TIKTOKEN_CACHE_DIR``), and they are kept in PELAB_CACHE as that
  file, so nodes sharing PELAB_CACHE need no network; when that fails, the identical ranks file
  is taken from the ``openai-whisper`` source distribution on the package index, verified
  against a pinned sha256 and cached, with no manual step. When both fail (an offline node with
  empty caches): one line (``TokenizerUnavailable``) naming scripts/prepare_data.py,
  PELAB_CACHE and TIKTOKEN_CACHE_DIR.
- ``bytes``: byte-level encoding, 256 ids (token id == byte value): fast for CPU experiments.
  Its end-of-text token is byte 0x1E, ASCII "record separator" (``BYTES_EOT``): a control
  character that never occurs in the embedded corpus (nor in ordinary prose), that is a
  single byte (so it cannot be half of a UTF-8 sequence: bytes >= 0x80 are), and whose ASCII
  meaning is exactly "boundary between records". So that it marks document boundaries and
  nothing else, ``encode_documents`` deletes every U+001E character from document text
  before encoding (``encode``, used for prompts, keeps text as given).

A path works too (``data.tokenizer=PATH``; ``tokenizer_file`` checks it by reading it, a
directory standing for its tokenizer.json):

- a Hugging Face ``tokenizer.json`` (suffix ``.json``), run by the ``tokenizers`` library
  (``HFTokenizer``); its end-of-text token is the first of ``EOT_NAMES`` among its special
  tokens (none: documents are not separated);
- any other file: a tiktoken ranks file (lines ``BASE64 RANK``, e.g. tiktoken's
  ``cl100k_base.tiktoken`` or Llama 3's ``tokenizer.model``), split with GPT-2's pattern, with
  ``<|endoftext|>`` added after the last rank as its end-of-text token (a ranks file carries
  no pattern and no special tokens: for a tokenizer's own, give its tokenizer.json).

Above 65,536 ids the token files are uint32 (data/cache.py). A path that does not exist, a
folder without a tokenizer.json, a file that is empty, unreadable, garbled or neither, or ids
that do not fit the vocabulary are refused with one line naming ``data.tokenizer``, the path,
what is wrong and what to give, during validation (before any data is read).

Documents are separated by appending ``eot_token`` after each one (gpt2: ``<|endoftext|>``,
bytes: 0x1E). ``fingerprint()`` identifies what a tokenizer produces (vocabulary, ranks,
special tokens, separator, the encoding of a fixed probe) so token caches built by another
tokenizer under the same name are detected.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken

from data.paths import PathError

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"
GPT2_EOT = 50256
BYTES_EOT = 0x1E  # ASCII record separator: the bytes tokenizer's end-of-text (see the module docstring)
# Fixed probe for fingerprints: ASCII, digits, whitespace runs, accents, CJK, emoji, both separators.
_PROBE = "Hello world!  It's 3.14159 -- naïve café, Ωμέγα, 東京, 🙂\n\n\tend\x1e<|endoftext|>"


class DocumentEncoder:
    """What every tokenizer adds to its ``encode_batch``: documents with their separator, as
    lists or as one flat array (the token cache's path). Subclasses provide ``name``,
    ``eot_token``, ``eot_char``, ``vocab_size`` and ``encode_batch``."""

    name: str
    eot_token: int | None  # appended after each document when the tokenizer has one
    # A text character that ordinary encoding maps to eot_token (bytes: "\x1e"): deleted from
    # documents so the separator only ever appears between them.
    eot_char: str | None = None

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def raw_encode_batch(self, texts: list[str]) -> list:
        """The backend's own batch call, nothing around it: the reference the token cache's
        throughput is compared with (scripts/prepare_data.py)."""
        raise NotImplementedError

    def _document_texts(self, texts: list[str]) -> list[str]:
        return texts if self.eot_char is None else [t.replace(self.eot_char, "") for t in texts]

    def encode_documents(self, texts: list[str], separate: bool = True) -> list[list[int]]:
        """Each text encoded, ``eot_char`` removed, and (``separate``) ``eot_token`` appended."""
        eot = [self.eot_token] if separate and self.eot_token is not None else []
        return [ids + eot for ids in self.encode_batch(self._document_texts(texts))]

    def encode_array(self, texts: list[str], dtype: np.dtype, separate: bool = True
                     ) -> tuple[np.ndarray, np.ndarray]:
        """``encode_documents`` flattened into one ``dtype`` array, and each document's length
        (its separator included): no per-document list copies, one pass of ``np.fromiter``."""
        texts = self._document_texts(texts)
        array_encoder = getattr(self, "array_encoder", None)
        encoded = [array_encoder(t) for t in texts] if array_encoder is not None else self.encode_batch(texts)
        eot = [self.eot_token] if separate and self.eot_token is not None else []
        lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded)) + len(eot)
        if array_encoder is not None:  # arrays already: concatenate them, separators between
            eot_array = np.array(eot, dtype=dtype)
            pieces = list(itertools.chain.from_iterable(zip(encoded, itertools.repeat(eot_array)))) if eot else encoded
            return (np.concatenate(pieces, dtype=dtype) if pieces else np.zeros(0, dtype)), lengths
        pieces = itertools.chain.from_iterable(zip(encoded, itertools.repeat(eot))) if eot else encoded
        ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=dtype, count=int(lengths.sum()))
        return ids, lengths


@dataclass(frozen=True)
class Tokenizer(DocumentEncoder):
    """A tiktoken encoding (the registry's ``gpt2`` and ``bytes``, or a ranks file)."""

    name: str
    encoding: tiktoken.Encoding
    eot_token: int | None  # appended after each document when the encoding has one
    eot_char: str | None = None
    # Optional: text -> the same ids as encode(), as a numpy array, faster (the bytes tokenizer's
    # are its UTF-8 bytes); the token cache uses it when given.
    array_encoder: Callable[[str], np.ndarray] | None = None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def __post_init__(self) -> None:
        if self.array_encoder is not None and self.array_encoder(_PROBE).tolist() != self.encode(_PROBE):
            object.__setattr__(self, "array_encoder", None)  # not this encoding's shortcut (a replaced encoding)

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        # encode_ordinary_batch(num_threads=1)'s output without its per-call thread pool
        return [self.encoding.encode_ordinary(text) for text in texts]

    def raw_encode_batch(self, texts: list[str]) -> list:
        return self.encoding.encode_ordinary_batch(texts, num_threads=1)

    def decode(self, ids: list[int]) -> str:
        return self.encoding.decode(ids)

    def fingerprint(self) -> str:
        """sha256 of everything that decides the token ids: a tokenizer switched under the same
        name gets a different fingerprint. Cheap enough to check on every load."""
        enc = self.encoding
        ranks = getattr(enc, "_mergeable_ranks", {})  # tiktoken keeps the ranks here
        ranks_digest = hashlib.sha256(b"".join(
            k + v.to_bytes(4, "little") for k, v in sorted(ranks.items(), key=lambda kv: kv[1]))).hexdigest()
        key = {"name": self.name, "n_vocab": enc.n_vocab, "eot_token": self.eot_token, "eot_char": self.eot_char,
               "pat_str": getattr(enc, "_pat_str", None), "special_tokens": sorted(enc._special_tokens.items()),
               "ranks": ranks_digest, "probe": self.encode_documents([_PROBE])}
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()


def cache_dir() -> Path:
    root = os.environ.get("PELAB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "pelab")
    return Path(root)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


class TokenizerUnavailable(PathError):
    """A tokenizer's files are not on this machine and cannot be fetched: one line saying how
    to put them where it looks (a ``PathError``: train.py and the scripts print it as it is)."""


def fetch_gpt2_ranks_from_whisper(dest: Path) -> Path:
    """Download the openai-whisper sdist with pip, extract gpt2.tiktoken, verify, cache."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "--retries", "2", "--dest", tmp, WHISPER_SDIST]  # an offline node learns it in seconds
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            raise RuntimeError(f"`pip download {WHISPER_SDIST}` did not finish in 600 s") from None
        sdists = list(Path(tmp).glob("openai_whisper-*.tar.gz")) + list(Path(tmp).glob("openai-whisper-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            raise RuntimeError(
                "could not get the GPT-2 BPE ranks: tiktoken's download failed and "
                f"`pip download {WHISPER_SDIST}` failed too:\n{proc.stderr.strip()[-2000:]}"
            )
        with tarfile.open(sdists[0]) as tar:
            member = next((m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken")), None)
            if member is None:
                raise RuntimeError(f"{sdists[0].name} has no whisper/assets/gpt2.tiktoken")
            extracted = Path(tmp) / "gpt2.tiktoken"
            with tar.extractfile(member) as src, open(extracted, "wb") as out:
                shutil.copyfileobj(src, out)
        digest = _sha256(extracted)
        if digest != GPT2_RANKS_SHA256:
            raise RuntimeError(f"gpt2.tiktoken from {sdists[0].name} has sha256 {digest}, expected {GPT2_RANKS_SHA256}")
        partial = dest.with_suffix(".partial")
        shutil.copyfile(extracted, partial)
        os.replace(partial, dest)  # atomic: a cut-off run never leaves a truncated cache
    return dest


def gpt2_offline(cache: Path | None = None) -> tiktoken.Encoding:
    """r50k_base built from a hash-verified local ranks file (fetched once if missing)."""
    from tiktoken.load import load_tiktoken_bpe
    from tiktoken_ext.openai_public import r50k_pat_str

    path = (cache or cache_dir()) / "gpt2.tiktoken"
    if not path.exists() or _sha256(path) != GPT2_RANKS_SHA256:
        fetch_gpt2_ranks_from_whisper(path)
    ranks = load_tiktoken_bpe(str(path), expected_hash=GPT2_RANKS_SHA256)
    return tiktoken.Encoding(
        name="gpt2",
        pat_str=r50k_pat_str,
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": GPT2_EOT},
        explicit_n_vocab=50257,
    )


def keep_gpt2_ranks(encoding: tiktoken.Encoding, dest: Path) -> None:
    """Write the ranks tiktoken fetched into ``$PELAB_CACHE/gpt2.tiktoken`` (the pinned file, byte
    for byte), so that every node sharing PELAB_CACHE finds them without network. Best effort."""
    ranks = sorted(encoding._mergeable_ranks.items(), key=lambda kv: kv[1])
    data = b"".join(base64.b64encode(token) + b" %d\n" % rank for token, rank in ranks)
    if hashlib.sha256(data).hexdigest() != GPT2_RANKS_SHA256:
        return
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        partial = dest.with_name(f"{dest.name}.{os.getpid()}.partial")
        partial.write_bytes(data)
        os.replace(partial, dest)
    except OSError:  # a read-only cache: tiktoken's own cache still serves this machine
        pass


def gpt2_encoding() -> tiktoken.Encoding:
    """GPT-2's encoding: from ``$PELAB_CACHE/gpt2.tiktoken``, else tiktoken (its cache,
    ``TIKTOKEN_CACHE_DIR``, or its download; the ranks are then kept in PELAB_CACHE), else the
    openai-whisper sdist from the package index. Where all fail (an offline node with empty
    caches): one line saying how to bring the ranks, not the libraries' tracebacks."""
    cached = cache_dir() / "gpt2.tiktoken"
    if cached.exists():  # already fetched: never touch the network again
        return gpt2_offline()
    try:
        encoding = tiktoken.get_encoding("gpt2")
    except Exception as err:  # no network, blocked host, proxy...: fall back to the package index
        blob_error = f"{type(err).__name__}"
    else:
        keep_gpt2_ranks(encoding, cached)
        return encoding
    try:
        encoding = gpt2_offline()
    except (RuntimeError, OSError) as err:
        pip_error = str(err).strip().splitlines()[-1][:160] if str(err).strip() else type(err).__name__
        raise TokenizerUnavailable(
            f"data.tokenizer=gpt2: the GPT-2 BPE ranks are not on this machine and cannot be downloaded (tiktoken: "
            f"{blob_error}; pip download {WHISPER_SDIST}: {pip_error}); run `python scripts/prepare_data.py` with "
            f"this command's data overrides once on a machine with network, with PELAB_CACHE on a filesystem this "
            f"node shares (the ranks are kept there: {cached}), or set TIKTOKEN_CACHE_DIR to a tiktoken cache "
            f"holding gpt2") from None
    print(f"[pelab] tiktoken could not download gpt2 ({blob_error}); took the ranks from the {WHISPER_SDIST} sdist, "
          f"kept in {cached}", file=sys.stderr)
    return encoding


def bytes_encoding() -> tiktoken.Encoding:
    # Single-byte ranks, no merges: token id == byte value. The pattern only bounds piece
    # length so tiktoken's merge loop stays linear.
    return tiktoken.Encoding(
        name="bytes",
        pat_str=r"[\s\S]{1,64}",
        mergeable_ranks={bytes([i]): i for i in range(256)},
        special_tokens={},
        explicit_n_vocab=256,
    )


# Special tokens taken as a tokenizer.json's end-of-text, first found first (GPT-2 and most BPEs,
# Llama 3, SentencePiece conversions, Gemma).
EOT_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")


class HFTokenizer(DocumentEncoder):
    """A Hugging Face ``tokenizer.json``, run by the ``tokenizers`` library. Special tokens in
    the text are encoded as ordinary text (like tiktoken's ``encode_ordinary``): only the
    separator the cache appends marks a document boundary."""

    def __init__(self, path: Path, key: str = "data.tokenizer", data: bytes | None = None) -> None:
        try:
            from tokenizers import Tokenizer as Backend
        except ImportError as err:
            raise ValueError(f"{key}={str(path)!r} is a tokenizer.json: that needs the `tokenizers` package "
                             f"(pip install tokenizers)") from err
        data = path.read_bytes() if data is None else data
        unreadable = f"{key}={str(path)!r} is not a readable Hugging Face tokenizer.json"
        try:  # the library's own parse errors say where, not what: plain JSON first
            content = json.loads(data)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{unreadable}: not valid JSON ({err}); {what_to_give(key)}") from None
        if not isinstance(content, dict) or not isinstance(content.get("model"), dict):
            found = f"keys {', '.join(list(content)[:6]) or 'none'}" if isinstance(content, dict) else \
                f"a JSON {type(content).__name__}"
            raise ValueError(f"{unreadable}: JSON, but no \"model\" object ({found}); {what_to_give(key)}")
        try:
            self.backend = Backend.from_str(data.decode())
        except Exception as err:
            raise ValueError(f"{unreadable}: {type(err).__name__}: {err}; {what_to_give(key)}") from None
        self.backend.encode_special_tokens = True  # "<|endoftext|>" inside a document is text, not a separator
        self.name, self.path, self.eot_char = str(path), path, None
        vocab = self.backend.get_vocab(with_added_tokens=True)
        ids = np.fromiter(vocab.values(), dtype=np.int64, count=len(vocab))
        if len(ids) == 0 or ids.min() < 0 or ids.max() >= 2**32:
            raise ValueError(f"{key}={str(path)!r}: token ids must lie in [0, 2^32) and there must be some, got "
                             f"{len(ids)} ids" + (f" in [{ids.min()}, {ids.max()}]" if len(ids) else ""))
        self._vocab_size = int(ids.max()) + 1  # the embedding covers every id, gaps included
        specials = {t.content: i for i, t in self.backend.get_added_tokens_decoder().items() if t.special}
        self.eot_token = next((specials[n] for n in EOT_NAMES if n in specials), None)
        self._encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self._encode_batch(texts, add_special_tokens=False)]

    def raw_encode_batch(self, texts: list[str]) -> list:
        return self._encode_batch(texts, add_special_tokens=False)

    def decode(self, ids: list[int]) -> str:
        return self.backend.decode(ids, skip_special_tokens=False)

    def fingerprint(self) -> str:
        key = {"kind": "tokenizer.json", "name": self.name, "vocab_size": self.vocab_size, "eot_token": self.eot_token,
               "json": hashlib.sha256(self.backend.to_str().encode()).hexdigest(),
               "probe": self.encode_documents([_PROBE])}
        return hashlib.sha256(json.dumps(key).encode()).hexdigest()

    def __getstate__(self) -> dict:  # picklable (DataLoader workers, spawn): the backend is rebuilt from its JSON
        state = dict(self.__dict__, backend=self.backend.to_str())
        del state["_encode_batch"]
        return state

    def __setstate__(self, state: dict) -> None:
        from tokenizers import Tokenizer as Backend

        self.__dict__.update(state, backend=Backend.from_str(state["backend"]))
        self.backend.encode_special_tokens = True
        self._encode_batch = getattr(self.backend, "encode_batch_fast", self.backend.encode_batch)


def ranks_file_tokenizer(path: Path, key: str = "data.tokenizer", data: bytes | None = None) -> Tokenizer:
    """A tiktoken ranks file (lines ``BASE64 RANK``, ranks 0..N-1) split with GPT-2's pattern;
    ``<|endoftext|>`` = N is its end-of-text token. Read here, not by tiktoken's loader, which
    caches local files by path and would miss an edit."""
    from tiktoken_ext.openai_public import r50k_pat_str

    ranks: dict[bytes, int] = {}
    data = path.read_bytes() if data is None else data
    try:
        for number, line in enumerate(data.splitlines(), 1):
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, binascii.Error):
        raise ValueError(f"{key}={str(path)!r} is neither a Hugging Face tokenizer.json (suffix .json) nor a tiktoken "
                         f"ranks file (lines 'BASE64 RANK'): line {number}: {line[:60]!r}; "
                         f"{what_to_give(key)}") from None
    values = sorted(ranks.values())
    if not values or values != list(range(len(values))):
        raise ValueError(f"{key}={str(path)!r}: the ranks must be 0..N-1, each once; found {len(values)} distinct "
                         f"tokens with ranks {values[:1]}..{values[-1:]}; {what_to_give(key)}")
    eot = len(ranks)
    encoding = tiktoken.Encoding(name=path.name, pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={"<|endoftext|>": eot}, explicit_n_vocab=eot + 1)
    return Tokenizer(str(path), encoding, eot)


def utf8_ids(text: str) -> np.ndarray:
    """The bytes tokenizer's ids of ``text`` (its UTF-8 bytes), as tiktoken gives them: lone
    surrogates become U+FFFD as in ``Encoding.encode_ordinary``."""
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = text.encode("utf-16", "surrogatepass").decode("utf-16", "replace").encode("utf-8")
    return np.frombuffer(data, dtype=np.uint8)


_BUILDERS = {
    "gpt2": lambda: Tokenizer("gpt2", gpt2_encoding(), GPT2_EOT),
    "bytes": lambda: Tokenizer("bytes", bytes_encoding(), BYTES_EOT, chr(BYTES_EOT), utf8_ids),
}
TOKENIZERS = tuple(_BUILDERS)


def what_to_give(key: str = "data.tokenizer") -> str:
    return (f"give {key}= one of {', '.join(TOKENIZERS)} or the path of a Hugging Face tokenizer.json or a "
            f"tiktoken ranks file")


def tokenizer_path(spec: str, key: str = "data.tokenizer") -> Path | None:
    """None for a registered name; else the tokenizer file ``spec`` names (a directory stands
    for its tokenizer.json), unread. A clear error, naming ``key``, for a path that is none."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key} must be one of {', '.join(TOKENIZERS)} or the path of a tokenizer file, got {spec!r}")
    if spec in _BUILDERS:
        return None
    path = Path(os.path.expanduser(spec)).resolve()
    if path.is_dir() and (path / "tokenizer.json").is_file():
        path = path / "tokenizer.json"
    if path.is_dir():
        raise ValueError(f"{key}={spec!r} is a folder without a tokenizer.json ({path}); {what_to_give(key)}")
    if not path.is_file():
        raise ValueError(f"{key} must be one of {', '.join(TOKENIZERS)} or the path of a tokenizer file (a Hugging "
                         f"Face tokenizer.json or a tiktoken ranks file), got {spec!r}: no such file ({path})")
    return path


def tokenizer_file(spec: str, key: str = "data.tokenizer") -> Path | None:
    """``tokenizer_path``, the file read as a tokenizer: configs are checked before any data is
    read, and a file that is not a tokenizer (empty, garbled, another JSON, unreadable) fails
    here in one line naming ``key``, not when the data module first tokenizes."""
    path = tokenizer_path(spec, key)
    if path is not None:
        read_tokenizer_file(path, key)
    return path


def read_tokenizer_file(path: Path, key: str = "data.tokenizer") -> DocumentEncoder:
    """The tokenizer in the file ``path``: a tokenizer.json by its suffix, else a ranks file."""
    try:
        data = path.read_bytes()
    except OSError as err:
        raise ValueError(f"{key}={str(path)!r} cannot be read ({err.strerror or err}); {what_to_give(key)}") from None
    if not data.strip():
        raise ValueError(f"{key}={str(path)!r} is empty ({len(data)} bytes{', all blank' if data else ''}); "
                         f"{what_to_give(key)}")
    if path.suffix.lower() == ".json":
        return HFTokenizer(path, key, data)
    return ranks_file_tokenizer(path, key, data)


def tokenizer_slug(spec: str) -> str:
    """The token cache's folder for tokenizer ``spec``: the name, or a file's stem and a hash of its path."""
    path = tokenizer_path(spec)
    if path is None:
        return spec
    stem = re.sub(r"[^A-Za-z0-9]+", "_", path.stem).strip("_")[:40]
    return f"{stem}-{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"


def get_tokenizer(spec: str, key: str = "data.tokenizer") -> DocumentEncoder:
    """A registered tokenizer by name, or a tokenizer file by path (see the module docstring)."""
    path = tokenizer_path(spec, key)
    return _BUILDERS[spec]() if path is None else read_tokenizer_file(path, key)
