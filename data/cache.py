"""The token cache: a corpus tokenized once into ``{split}.bin`` memmaps plus ``meta.json``.

A corpus is tokenized once with ``datasets.map`` (``tokenize_num_proc`` processes, ids stored
in the token dtype) and streamed, one Arrow batch at a time, into ``{split}.bin`` memmaps
(uint16 when the vocabulary fits, else uint32) plus ``meta.json``, written last and
atomically so an interrupted preparation is redone, never half-read. Nothing holds a whole
split in RAM, so hub-scale corpora (FineWeb-Edu, OpenWebText) fit as long as the disk does;
the intermediate Arrow files of the tokenization are deleted once the .bin is written.

``meta.json`` records the format version, tokenizer name and fingerprint, corpus
fingerprint, dtype and per-split token counts and document offsets. A cache is reused only
when all of them match and every ``.bin`` has exactly ``num_tokens x itemsize`` bytes;
otherwise one line says what differed and the files are rebuilt (meta.json is removed
first and written last, so a crash never leaves it pointing at half-written bins).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import datasets
import numpy as np
import pyarrow.compute as pc

from data.tokenizers import Tokenizer

FORMAT_VERSION = 2  # 2: hashes in meta.json, bytes separator 0x1E

def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def cache_mismatch(meta: dict, out_dir: Path, tokenizer: Tokenizer, tokenizer_hash: str, corpus_hash: str
                   ) -> str | None:
    """What makes the cache described by ``meta`` unusable, or None when it matches. Cheap:
    compares hashes and file sizes, never re-tokenizes."""
    if meta.get("version") != FORMAT_VERSION:
        return f"format version {meta.get('version')}, expected {FORMAT_VERSION}"
    if meta.get("tokenizer") != tokenizer.name:
        return f"tokenizer {meta.get('tokenizer')!r}, expected {tokenizer.name!r}"
    if meta.get("tokenizer_hash") != tokenizer_hash:
        return (f"tokenizer {tokenizer.name!r} changed (fingerprint {str(meta.get('tokenizer_hash'))[:12]} "
                f"-> {tokenizer_hash[:12]})")
    if meta.get("corpus_hash") != corpus_hash:
        return f"corpus changed (fingerprint {str(meta.get('corpus_hash'))[:12]} -> {corpus_hash[:12]})"
    dtype = token_dtype(tokenizer.vocab_size)
    if meta.get("dtype") != dtype.name:
        return f"dtype {meta.get('dtype')}, expected {dtype.name}"
    for split in ("train", "val"):
        path = out_dir / f"{split}.bin"
        expected = meta["splits"][split]["num_tokens"] * dtype.itemsize
        if not path.is_file():
            return f"{path.name} is missing"
        if path.stat().st_size != expected:
            return (f"{path.name} has {path.stat().st_size} bytes, expected {expected} "
                    f"({meta['splits'][split]['num_tokens']} tokens x {dtype.itemsize})")
    return None


def write_tokens(tokenized: datasets.Dataset, path: Path, dtype: np.dtype, batch_size: int = 8192) -> np.ndarray:
    """Append the ``ids`` of every row of ``tokenized`` (in row order) to ``path``, one Arrow
    batch at a time: memory stays at one batch whatever the corpus size. Written to
    ``path.partial`` and renamed at the end. Returns the number of tokens of every row."""
    tmp = path.with_name(path.name + ".partial")
    lengths = [np.zeros(0, dtype=np.int64)]
    with open(tmp, "wb") as out:
        for table in tokenized.with_format("arrow").iter(batch_size=batch_size):
            ids = table.column("ids").combine_chunks()
            lengths.append(pc.list_value_length(ids).to_numpy(zero_copy_only=False).astype(np.int64))
            np.asarray(ids.flatten()).astype(dtype, copy=False).tofile(out)
    os.replace(tmp, path)
    return np.concatenate(lengths)


def _remove_new_cache_files(result: datasets.Dataset, source: datasets.Dataset) -> None:
    """Delete the Arrow files ``map`` wrote for ``result``: the .bin is the cache, and for a
    hub-scale corpus these files are as large as the .bin itself."""
    keep = {f["filename"] for f in source.cache_files}
    for f in result.cache_files:
        if f["filename"] not in keep:
            Path(f["filename"]).unlink(missing_ok=True)


def prepare_token_files(corpus, tokenizer: Tokenizer, out_dir: Path, num_proc: int | None = None) -> dict:
    """Tokenize ``corpus`` into ``out_dir/{train,val}.bin``; reuse them when ``meta.json``
    matches the corpus, the tokenizer and the files, else say what differed and rebuild."""
    meta_path = out_dir / "meta.json"
    tokenizer_hash, corpus_hash = tokenizer.fingerprint(), corpus.fingerprint()
    if meta_path.exists():
        try:
            why = cache_mismatch(json.loads(meta_path.read_text()), out_dir, tokenizer, tokenizer_hash, corpus_hash)
        except (ValueError, KeyError, TypeError, AttributeError) as err:  # unreadable or incomplete meta.json
            why = f"meta.json unreadable ({type(err).__name__}: {err})"
        if why is None:
            return json.loads(meta_path.read_text())
        print(f"[pelab] token cache {out_dir} is stale: {why}; rebuilding", flush=True)
        meta_path.unlink()  # first: a crash mid-rebuild must leave no meta.json over half-written bins
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"[pelab] tokenizing {corpus.cache_name} ({tokenizer.name}) into {out_dir}", flush=True)
    splits = corpus.load(out_dir)
    separate = getattr(corpus, "rows_are_documents", True)
    dtype = token_dtype(tokenizer.vocab_size)

    def encode(batch: dict) -> dict:
        return {"ids": tokenizer.encode_documents(batch["text"], separate=separate)}

    meta = {"version": FORMAT_VERSION, "tokenizer": tokenizer.name, "tokenizer_hash": tokenizer_hash,
            "vocab_size": tokenizer.vocab_size, "eot_token": tokenizer.eot_token if separate else None,
            "dtype": dtype.name, "corpus": corpus.cache_name, "corpus_hash": corpus_hash, "splits": {}}
    for split, dataset in splits.items():
        # Token ids stored as the .bin's own dtype (2 bytes each for uint16, not Python's int64).
        # Not from datasets' cache: this runs only on a rebuild, and a local file edited within
        # one mtime tick would otherwise come back as the old tokens.
        tokenized = dataset.map(encode, batched=True, remove_columns=dataset.column_names, num_proc=num_proc,
                                features=datasets.Features({"ids": datasets.List(datasets.Value(dtype.name))}),
                                load_from_cache_file=False, desc=f"tokenizing {split} ({tokenizer.name})")
        lengths = write_tokens(tokenized, out_dir / f"{split}.bin", dtype)
        _remove_new_cache_files(tokenized, dataset)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
        meta["splits"][split] = {"num_tokens": int(offsets[-1]), "doc_offsets": offsets}
    tmp_meta = meta_path.with_suffix(".json.partial")
    tmp_meta.write_text(json.dumps(meta, indent=1))
    os.replace(tmp_meta, meta_path)
    return meta
