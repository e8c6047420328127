"""The pieces every synthetic task (data/synthetic.py, data/tasks_2025.py) lays its samples out
with: the structural marker ids, the filler sentences, and the Gutenberg haystack."""

from __future__ import annotations

import functools

import numpy as np

PAD, NEEDLE, SEP, QUERY = 0x00, 0x1C, 0x1D, 0x1F
SPECIAL_IDS = {"PAD": PAD, "NEEDLE": NEEDLE, "SEP": SEP, "QUERY": QUERY}
DIGITS, LOWER, UPPER = ord("0"), ord("a"), ord("A")
FILLER = np.frombuffer(b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ",
                       dtype=np.uint8).astype(np.int64)


def _ids(text: bytes) -> np.ndarray:
    return np.frombuffer(text, dtype=np.uint8).astype(np.int64)


def _in_filler(pieces: list[np.ndarray], places: np.ndarray, size: int) -> np.ndarray:
    """``size`` filler tokens (the passkey sentences) with each piece inserted after
    round(place x size) of them; pieces at the same token keep the order of their places (ties:
    the order of ``pieces``)."""
    filler = FILLER[np.arange(size) % len(FILLER)]
    order = np.argsort(places, kind="stable")
    cuts = np.rint(places[order] * size).astype(int)
    parts, start = [], 0
    for cut, i in zip(cuts, order):
        parts += [filler[start:cut], pieces[i]]
        start = cut
    return np.concatenate([*parts, filler[start:]])


@functools.lru_cache(maxsize=2)
def haystack(split: str) -> np.ndarray:
    """The embedded Gutenberg corpus (data/corpus.py, held-out = the last 10% of every book) as
    byte ids, ``train`` or ``val`` split; control bytes become spaces, so no text byte is one of
    the structural ids above."""
    from data.corpus import GutenbergCorpus

    text = "\n\n".join(body for _, body in GutenbergCorpus(0.1).documents()[split])
    ids = np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
    return np.where((ids < 0x20) & (ids != ord("\n")), ord(" "), ids)
