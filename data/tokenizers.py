"""Tokenizers, all through tiktoken.

- ``gpt2``: GPT-2's r50k BPE (50257 ids, ``<|endoftext|>`` = 50256). tiktoken downloads its
  ranks from a blob store; when that fails (no network), the identical ranks file is taken
  from the ``openai-whisper`` source distribution on the package index, verified against a
  pinned sha256 and cached, with no manual step.
- ``bytes``: byte-level encoding, 256 ids (token id == byte value): fast for CPU experiments.
  Its end-of-text token is byte 0x1E, ASCII "record separator" (``BYTES_EOT``): a control
  character that never occurs in the embedded corpus (nor in ordinary prose), that is a
  single byte (so it cannot be half of a UTF-8 sequence: bytes >= 0x80 are), and whose ASCII
  meaning is exactly "boundary between records". So that it marks document boundaries and
  nothing else, ``encode_documents`` deletes every U+001E character from document text
  before encoding (``encode``, used for prompts, keeps text as given).

Documents are separated by appending ``eot_token`` after each one (gpt2: ``<|endoftext|>``,
bytes: 0x1E). ``fingerprint()`` identifies what a tokenizer produces (vocabulary, ranks,
special tokens, separator, the encoding of a fixed probe) so token caches built by another
tokenizer under the same name are detected.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import tiktoken

GPT2_RANKS_SHA256 = "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930"
WHISPER_SDIST = "openai-whisper==20250625"
GPT2_EOT = 50256
BYTES_EOT = 0x1E  # ASCII record separator: the bytes tokenizer's end-of-text (see the module docstring)
# Fixed probe for fingerprints: ASCII, digits, whitespace runs, accents, CJK, emoji, both separators.
_PROBE = "Hello world!  It's 3.14159 -- naïve café, Ωμέγα, 東京, 🙂\n\n\tend\x1e<|endoftext|>"


@dataclass(frozen=True)
class Tokenizer:
    name: str
    encoding: tiktoken.Encoding
    eot_token: int | None  # appended after each document when the encoding has one
    # A text character that ordinary encoding maps to eot_token (bytes: "\x1e"): deleted from
    # documents so the separator only ever appears between them.
    eot_char: str | None = None

    @property
    def vocab_size(self) -> int:
        return self.encoding.n_vocab

    def encode(self, text: str) -> list[int]:
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.encoding.encode_ordinary_batch(texts, num_threads=1)

    def encode_documents(self, texts: list[str], separate: bool = True) -> list[list[int]]:
        """Each text encoded, ``eot_char`` removed, and (``separate``) ``eot_token`` appended."""
        if self.eot_char is not None:
            texts = [t.replace(self.eot_char, "") for t in texts]
        eot = [self.eot_token] if separate and self.eot_token is not None else []
        return [ids + eot for ids in self.encode_batch(texts)]

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


def fetch_gpt2_ranks_from_whisper(dest: Path) -> Path:
    """Download the openai-whisper sdist with pip, extract gpt2.tiktoken, verify, cache."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
               "--quiet", "--dest", tmp, WHISPER_SDIST]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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


def gpt2_encoding() -> tiktoken.Encoding:
    cached = cache_dir() / "gpt2.tiktoken"
    if cached.exists():  # already fetched: never touch the network again
        return gpt2_offline()
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as err:  # no network, blocked host, proxy...: fall back to the package index
        print(f"[pelab] tiktoken could not download gpt2 ({type(err).__name__}); "
              f"using the ranks from the {WHISPER_SDIST} sdist", file=sys.stderr)
        return gpt2_offline()


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


_BUILDERS = {
    "gpt2": lambda: Tokenizer("gpt2", gpt2_encoding(), GPT2_EOT),
    "bytes": lambda: Tokenizer("bytes", bytes_encoding(), BYTES_EOT, chr(BYTES_EOT)),
}
TOKENIZERS = tuple(_BUILDERS)


def get_tokenizer(name: str) -> Tokenizer:
    if name not in _BUILDERS:
        raise ValueError(f"unknown tokenizer {name!r}; valid choices: {', '.join(TOKENIZERS)}")
    return _BUILDERS[name]()
