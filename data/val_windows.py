"""Validation windows: ``val_windows`` windows spread evenly over the whole held-out split
(every document is represented, not just the first one), the same in every run, resume and
rank; and the sampler that shards them across ranks so that together they score every window
exactly once.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler

from data.stream import load_tokens


def spread_starts(num_tokens: int, block_size: int, num_windows: int | None) -> np.ndarray:
    """Starts of ``num_windows`` validation windows (block_size inputs + 1 target) spread evenly
    over the whole split, first at 0 and last at the last possible start; never overlapping:
    at most (num_tokens - 1) // block_size windows (None = that many: nearly the whole split).
    A pure function of the split's length, so every run, resume and rank sees the same windows."""
    fit = (num_tokens - 1) // block_size
    count = fit if num_windows is None else min(num_windows, fit)
    if count < 1:
        return np.zeros(0, dtype=np.int64)
    last = num_tokens - 1 - block_size
    # integer arithmetic: exact and platform-independent. Gaps are >= block_size because
    # count <= fit implies last >= (count - 1) * block_size.
    return np.arange(count, dtype=np.int64) * last // max(count - 1, 1)


class ValidationWindows(Dataset):
    """Validation window i (0..N-1) = tokens from ``starts[i]``: ``num_windows`` windows spread
    evenly over the held-out split (``spread_starts``). Indexed 0..N-1 so a sampler can shard
    them across ranks."""

    def __init__(self, path: Path, dtype: str, block_size: int, num_windows: int | None = None):
        self.path, self.dtype, self.block_size = path, dtype, block_size
        self._tokens: np.ndarray | None = None
        n = len(load_tokens(path, dtype))
        self.starts = spread_starts(n, block_size, num_windows)
        if len(self.starts) < 1:
            raise ValueError(f"{path} holds {n} tokens, fewer than one validation window of {block_size + 1}")

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tokens is None:
            self._tokens = load_tokens(self.path, self.dtype)
        s = int(self.starts[i])
        chunk = torch.from_numpy(self._tokens[s : s + self.block_size + 1].astype(np.int64))
        return chunk[:-1], chunk[1:]


class RankShard(Sampler):
    """Indices rank, rank + world, ... of a dataset of ``length``: the ranks validate disjoint
    windows that together are every window exactly once (torch's DistributedSampler pads with
    repeats, which would count some windows twice in the token-weighted mean).

    With ``batch_size``, every rank gets the same number of batches: a rank whose share makes
    one batch fewer than the largest share ends with index ``length``, an ignored window
    (``IgnoredPadding``), in a batch of its own. FSDP gathers parameters in every forward, so a
    rank with an extra batch would wait for the others forever (256 windows, 6 ranks, batches
    of 14: 4 batches on ranks 0-3, 3 on ranks 4-5). The other batches are unchanged."""

    def __init__(self, length: int, rank: int, world: int, batch_size: int | None = None) -> None:
        self.indices = list(range(rank, length, world))
        largest = -(-length // world)  # shares differ by at most one window
        if batch_size is not None and -(-len(self.indices) // batch_size) < -(-largest // batch_size):
            self.indices.append(length)  # this share fills whole batches: the padding is alone in its own

    def __iter__(self):
        return iter(self.indices)

    def __len__(self) -> int:
        return len(self.indices)


class IgnoredPadding(Dataset):
    """``dataset`` and one more sample at index ``len(dataset)``: the inputs of sample 0 with
    every target ignored (-1), so it is scored on no token (validation losses are
    token-weighted over scored targets)."""

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset) + 1

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        if i == len(self.dataset):
            x, y = self.dataset[0]
            return x, torch.full_like(y, -1)
        return self.dataset[i]
