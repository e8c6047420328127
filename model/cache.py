"""The KV cache of incremental decoding, and the policy that says which keys it evicts.

Each layer keeps, side by side, its cached keys (rotated once, at their own positions), their
values (n_kv_head heads: GQA's query heads share them when attending, model/gpt.py) and a
data-dependent scheme's key terms (FoX's c, model/pe/fox.py: running sums, read as differences
c_i - c_j, the new tokens' continuing the newest kept key's). Two policies:

- ``Windows``: a layer with a sliding window W keeps the last W - 1 keys after each append
  (with the next token's own, the W it sees); a full layer keeps all. Generation's.
- ``Sinks``: StreamingLLM's (Xiao et al. 2024): before each new token every layer drops its
  oldest keys after the first ``sinks`` so that, with the new one, sinks + ``window`` remain.
  Re-indexed, the sinks' keys are then recomputed at the positions right before the oldest
  recent key; absolute, every key keeps its text position.

Keys, values and key terms leave a layer in one place (``LayerCache.drop``) and are replaced in
one (``LayerCache.put_front``), so a scheme's key terms always describe the keys kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor


def cut(t: Tensor, dim: int, start: int, stop: int) -> Tensor:
    """``t`` without indices start..stop-1 along ``dim`` (a view when they lead)."""
    rest = t.narrow(dim, stop, t.shape[dim] - stop)
    return rest if start == 0 else torch.cat((t.narrow(dim, 0, start), rest), dim=dim)


class LayerCache:
    """One layer's kept keys, values and key terms; ``window``: keep the last W - 1 keys after
    each append (None: all); ``peak``: the most keys it ever held (what the new tokens attended)."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.key_terms: Tensor | None = None  # (B, H, kept) a data-dependent scheme's terms of the kept keys
        self.gap_terms: Tensor | None = None  # the terms of the last key dropped: where the next kept keys' sum starts
        self.peak = 0

    def last_terms(self) -> Tensor | None:
        """(B, H, 1) the newest kept key's terms, which the new tokens' continue; None if there are none."""
        terms = self.key_terms
        return None if terms is None or not terms.shape[-1] else terms[..., -1:]

    def append(self, k: Tensor, v: Tensor, terms: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor | None]:
        """The kept keys, values and key terms followed by these (what the new tokens attend);
        then keeps the last W - 1 of them with a window."""
        k = k if self.k is None else torch.cat((self.k, k), dim=2)
        v = v if self.v is None else torch.cat((self.v, v), dim=2)
        if terms is not None and self.key_terms is not None:
            terms = torch.cat((self.key_terms, terms), dim=-1)
        self.k, self.v, self.key_terms = k, v, terms
        self.peak = max(self.peak, k.shape[2])
        if self.window is not None:
            self.drop(0, k.shape[2] - self.window + 1)
        return k, v, terms

    def drop(self, start: int, stop: int) -> None:
        """Evict keys start..stop-1 with their values and key terms (every eviction comes here)."""
        if stop <= start:
            return
        self.k, self.v = cut(self.k, 2, start, stop), cut(self.v, 2, start, stop)
        if self.key_terms is not None:
            self.gap_terms = self.key_terms[..., stop - 1 : stop]
            self.key_terms = cut(self.key_terms, -1, start, stop)

    def put_front(self, k: Tensor, v: Tensor, terms: Tensor | None = None) -> None:
        """Replace the first k.shape[2] keys by these. Their terms, a sum over these tokens alone,
        are shifted to end where the next kept keys' sum starts (``gap_terms``): the cache then
        reads as one contiguous text, the dropped tokens out of every c_i - c_j."""
        n = k.shape[2]
        self.k, self.v = torch.cat((k, self.k[:, :, n:]), dim=2), torch.cat((v, self.v[:, :, n:]), dim=2)
        if terms is not None:
            placed = terms if self.gap_terms is None else terms - terms[..., -1:] + self.gap_terms
            self.key_terms = torch.cat((placed, self.key_terms[..., n:]), dim=-1)


@dataclass(frozen=True)
class Windows:
    """Each layer's sliding window (None or absent: full), as ``GPTConfig.layer_windows``: a
    windowed layer evicts as it appends, nothing is evicted between steps."""

    windows: tuple[int | None, ...] = ()

    def layer_window(self, layer: int) -> int | None:
        return self.windows[layer] if layer < len(self.windows) else None

    def evict(self, cache: KVCache, incoming: int) -> None:
        pass

    def place(self, cache: KVCache, model: Any, tokens: Tensor) -> None:
        pass


@dataclass(frozen=True)
class Sinks:
    """StreamingLLM: the first ``sinks`` keys and the ``window`` most recent (the new token's own
    included); ``reindexed``: the sinks recomputed right before the recent keys, else absolute."""

    sinks: int
    window: int
    reindexed: bool = True

    def __post_init__(self) -> None:
        if self.sinks < 0 or self.window < 1:
            raise ValueError(f"Sinks(sinks={self.sinks}, window={self.window}): sinks must be >= 0 and window >= 1")

    def layer_window(self, layer: int) -> int | None:
        return None  # every layer keeps the same keys, dropped between steps

    def evict(self, cache: KVCache, incoming: int) -> None:
        excess = cache.length + incoming - (self.sinks + self.window)
        if excess > 0:
            cache.drop(self.sinks, self.sinks + excess)

    def place(self, cache: KVCache, model: Any, tokens: Tensor) -> None:
        """Re-indexed: the sinks' keys recomputed by ``model`` (a GPT) from ``tokens`` (the text's
        first ``sinks``) at the positions right before the oldest recent key, a no-op until the
        first eviction. Sinks see only sinks, so their keys are a forward of those tokens alone;
        for a scheme that reads q - k only this is the slot rule exactly, with no re-rotation."""
        s = self.sinks
        if not self.reindexed or s == 0 or cache.length <= s:
            return
        first = int(cache.positions[s]) - s
        if int(cache.positions[0]) == first:
            return
        where = torch.arange(first, first + s, device=cache.positions.device)
        fresh = KVCache(len(cache.layers), cache.span)
        model.hidden(tokens, where, cache=fresh)
        cache.put_front(where, fresh)


class KVCache:
    """Keys and values of every layer for incremental decoding. ``span`` is every position
    the generation will cover, fixed up front: schemes whose tables depend on the context
    (xPos's reference point, dynamic NTK's length) read it, so cached keys stay valid and
    decoding equals one full forward over the final sequence. ``windows``: each layer's sliding
    window (None: full; absent: every layer full), as ``GPTConfig.layer_windows``; or ``policy``
    (``Windows`` or ``Sinks``). ``positions``: the kept keys' (with windows: every key's, each
    windowed layer reads its last ones)."""

    def __init__(self, n_layer: int, span: Tensor, windows: tuple[int | None, ...] = (),
                 policy: Windows | Sinks | None = None) -> None:
        if policy is not None and windows:
            raise ValueError(f"KVCache takes windows or a policy, not both: windows={tuple(windows)}, policy={policy}")
        self.policy = Windows(tuple(windows)) if policy is None else policy
        self.span = span
        self.positions = span[:0]
        self.layers = [LayerCache(self.policy.layer_window(i)) for i in range(n_layer)]

    @property
    def length(self) -> int:
        return self.positions.shape[-1]

    @property
    def peak(self) -> int:
        """The most keys any layer held."""
        return max(layer.peak for layer in self.layers)

    def evict(self, incoming: int = 1) -> None:
        """Before ``incoming`` new tokens: drop what the policy drops between steps."""
        self.policy.evict(self, incoming)

    def place_sinks(self, model: Any, tokens: Tensor) -> None:
        """After ``evict``: re-place the kept first tokens where the policy puts them (``Sinks.place``)."""
        self.policy.place(self, model, tokens)

    def drop(self, start: int, stop: int) -> None:
        """Keys start..stop-1 out of every layer, and their positions."""
        self.positions = cut(self.positions, -1, start, stop)
        for layer in self.layers:
            layer.drop(start, stop)

    def put_front(self, positions: Tensor, fresh: KVCache) -> None:
        """The first keys of every layer replaced by ``fresh``'s, now at ``positions``."""
        self.positions = torch.cat((positions, self.positions[positions.shape[-1]:]), dim=-1)
        for layer, new in zip(self.layers, fresh.layers):
            layer.put_front(new.k, new.v, new.key_terms)
