"""The training stream: sample ``g`` of a run is a pure function of (seed, sampling, g).

``g`` is the *global* sample index: the run's g-th training window counted over every rank,
micro-batch and accumulation step. Optimisation step ``s`` of a run with a global batch of
``G`` samples trains on samples ``s*G .. (s+1)*G - 1`` whatever the number of ranks: micro-batch
``m`` of rank ``r`` (of ``world``, batches of ``B``) holds samples
``start + (m*world + r)*B .. + B - 1`` (``GlobalSamples``), where ``start`` is the number of
samples the run had consumed when this loader was built. So a run resumed on another number
of ranks or nodes continues the same stream, with no replay and no gap, as long as it knows
how many samples were consumed (the data module keeps that count in its checkpoint state).
With one rank the index is the rank-0 counter of the earlier per-rank stream, so one-rank runs
train on exactly the windows they did before.

``data.sampling`` picks how a sample index becomes a window (``SAMPLING``):

- ``random`` (default): a window start drawn uniformly over the split from splitmix64 of
  (seed, g), with replacement (nanoGPT style). One pass of N samples x T tokens over an
  N*T-token split leaves about 1/e of the tokens unseen.
- ``epoch``: the split cut into ``(n - 1) // T`` non-overlapping windows (window k starts at
  ``k*T``; its target overlaps the next window's first input); epoch ``e`` visits every one of
  them once, in the order of a permutation seeded by (seed, e): samples ``e*W .. (e+1)*W - 1``.
  The tail of fewer than T + 1 tokens is never a window. The permutation is drawn with
  numpy's Generator (``default_rng([seed, e])``) and held by each loading process for the
  epoch it is in: 4 bytes per window (10B tokens at T=1024: 39 MB).

Both are stateless given ``g``: DataLoader workers compute the same windows as the main
process, and resuming needs only the count of consumed samples.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

SAMPLING = ("random", "epoch")
_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A well-mixed 64-bit hash (Steele et al.), cheap enough to call per sample."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def map_tokens(path: Path, dtype: str) -> np.ndarray:
    if path.stat().st_size == 0:  # an empty split: numpy cannot map an empty file
        return np.zeros(0, dtype=np.dtype(dtype))
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


class SplitParts:
    """A split stored as several token ranges (a sharded cache, data/shards.py): ``parts`` =
    (file, first token, end token) in order; ``name`` names it in messages. Small and picklable:
    what a DataLoader worker receives instead of a mapping."""

    def __init__(self, parts: list[tuple[Path, int, int]], name: Path) -> None:
        self.parts, self.name = [(Path(f), int(a), int(b)) for f, a, b in parts], name

    def __str__(self) -> str:
        return f"{self.name} ({len(self.parts)} parts)"


class ConcatTokens:
    """The parts of a ``SplitParts`` read as one token array: ``len``, and slices (what the
    windows and the probes take), equal to the same slice of the concatenated files. Each file is
    mapped on first use; a slice inside one part is a view of its mapping (as one file's would
    be), one that crosses parts a copy. O(parts) memory, a binary search per slice."""

    def __init__(self, source: SplitParts, dtype: str) -> None:
        self.source, self.dtype = source, np.dtype(dtype)
        sizes = np.array([b - a for _, a, b in source.parts], dtype=np.int64)
        self.ends = np.cumsum(sizes)  # token index where each part ends
        self._maps: dict[Path, np.ndarray] = {}

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def _part(self, i: int) -> np.ndarray:
        path, a, b = self.source.parts[i]
        if path not in self._maps:
            self._maps[path] = map_tokens(path, self.dtype.name)
        return self._maps[path][a:b]

    def __getitem__(self, index):
        if isinstance(index, (int, np.integer)):
            n = len(self)
            i = int(index) + n if index < 0 else int(index)
            if not 0 <= i < n:
                raise IndexError(f"token {index} out of range for {n} tokens")
            return self[i : i + 1][0]
        if not isinstance(index, slice) or index.step not in (None, 1):
            raise TypeError(f"{type(self).__name__} takes an integer or a slice with step 1, got {index!r}")
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return np.zeros(0, dtype=self.dtype)
        first = int(np.searchsorted(self.ends, start, side="right"))
        last = int(np.searchsorted(self.ends, stop - 1, side="right"))
        pieces = []
        for i in range(first, last + 1):
            begin = int(self.ends[i - 1]) if i else 0
            pieces.append(self._part(i)[max(start - begin, 0) : stop - begin])
        return pieces[0] if len(pieces) == 1 else np.concatenate(pieces)

    def __array__(self, dtype=None, copy=None):
        whole = self[:]
        return whole if dtype is None else whole.astype(dtype)

    def __getstate__(self) -> dict:  # a worker maps the files itself
        return {**self.__dict__, "_maps": {}}


def load_tokens(source, dtype: str):
    """A split's tokens: a ``.bin`` file as a memmap, or a sharded split's parts (``SplitParts``)
    as one ``ConcatTokens``."""
    if isinstance(source, SplitParts):
        return ConcatTokens(source, dtype)
    return map_tokens(Path(source), dtype)


def check_sampling(sampling) -> None:
    """``data.sampling`` is one of ``SAMPLING``; checked when the data module is built, before any data is read."""
    if sampling not in SAMPLING:
        raise ValueError(f"data.sampling={sampling!r} is not valid; allowed: {', '.join(SAMPLING)}")


class TrainWindows(Dataset):
    """Training sample ``g`` (the global sample index) = a window (x, y = x shifted by one) of
    the split at ``start(g)``; ``sampling`` says how starts are drawn (module docstring)."""

    def __init__(self, path: Path, dtype: str, block_size: int, seed: int = 0, sampling: str = "random"):
        check_sampling(sampling)
        self.path, self.dtype, self.block_size = path, dtype, block_size
        self.seed, self.sampling = seed, sampling
        self._tokens: np.ndarray | None = None
        self._permutation: tuple[int, np.ndarray] | None = None  # (epoch, its window order), per process
        n = len(load_tokens(path, dtype))
        if n < block_size + 2:
            raise ValueError(f"{path} holds {n} tokens, fewer than one training window of {block_size + 1}")
        self.num_starts = n - block_size  # random: start s uses tokens s .. s + block_size
        self.num_windows = (n - 1) // block_size  # epoch: windows at 0, T, 2T, .. per epoch
        # splitmix64(seed) ^ 0: the key of the per-rank stream's rank 0, which one-rank runs used
        self._key = splitmix64(splitmix64(seed))

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The window indices of ``epoch`` in the order its samples visit them (a permutation of
        0 .. num_windows - 1, seeded by (seed, epoch))."""
        if self._permutation is None or self._permutation[0] != epoch:
            dtype = np.uint32 if self.num_windows <= 2**32 else np.int64
            order = np.arange(self.num_windows, dtype=dtype)
            np.random.default_rng([self.seed & _MASK64, epoch]).shuffle(order)  # numpy seeds are >= 0
            self._permutation = (epoch, order)
        return self._permutation[1]

    def start(self, g: int) -> int:
        if self.sampling == "epoch":
            epoch, k = divmod(g, self.num_windows)
            return int(self.epoch_order(epoch)[k]) * self.block_size
        return splitmix64(self._key ^ g) % self.num_starts

    def __getitem__(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:  # opened lazily: each DataLoader worker maps the file itself
            self._tokens = load_tokens(self.path, self.dtype)
        s = self.start(g)
        chunk = torch.from_numpy(self._tokens[s : s + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]

    def __getstate__(self) -> dict:  # workers get the path, not the parent's mapping or permutation
        return {**self.__dict__, "_tokens": None, "_permutation": None}


class GlobalSamples(Sampler):
    """The global sample indices rank ``rank`` of ``world`` trains on, in order, from sample
    ``start`` (the samples the run had consumed) up to ``end``: its micro-batch m (of
    ``batch_size``) is samples ``start + (m*world + rank)*batch_size`` onwards. Every rank
    yields the same number of whole micro-batches."""

    def __init__(self, start: int, rank: int, world: int, batch_size: int, end: int) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} is not in 0 .. {world - 1}")
        self.start, self.rank, self.world, self.batch_size = start, rank, world, batch_size
        self.rows = max(end - start, 0) // (world * batch_size)  # micro-batches per rank

    def __iter__(self):
        B, row = self.batch_size, self.world * self.batch_size
        for m in range(self.rows):
            first = self.start + m * row + self.rank * B
            yield from range(first, first + B)

    def __len__(self) -> int:
        return self.rows * self.batch_size
