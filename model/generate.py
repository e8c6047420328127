"""Generation: a KV cache for incremental decoding, top-k/top-p sampling, ``generate``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.positions import Pass


class LayerCache:
    """One layer's cached keys (rotated once, at their own positions) and values, n_kv_head heads
    each: GQA's query heads share them when attending (model/gpt.py), the cache never repeats them.
    A layer with a sliding window W keeps only the last W - 1 keys: with the next token's own,
    the W keys it sees (memory flat however long the generation)."""

    def __init__(self, window: int | None = None) -> None:
        self.window = window
        self.k: Tensor | None = None
        self.v: Tensor | None = None
        self.key_terms: Tensor | None = None  # a data-dependent scheme's c of the kept keys (model/gpt.py)

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """The kept keys and values followed by these (what the new tokens attend); keeps the
        last W - 1 of them with a window, all without."""
        k = k if self.k is None else torch.cat((self.k, k), dim=2)
        v = v if self.v is None else torch.cat((self.v, v), dim=2)
        start = 0 if self.window is None else max(0, k.shape[2] - self.window + 1)
        self.k, self.v = k[:, :, start:], v[:, :, start:]
        return k, v


class KVCache:
    """Keys and values of every layer for incremental decoding. ``span`` is every position
    the generation will cover, fixed up front: schemes whose tables depend on the context
    (xPos's reference point, dynamic NTK's length) read it, so cached keys stay valid and
    decoding equals one full forward over the final sequence. ``windows``: each layer's sliding
    window (None: full; absent: every layer full), as ``GPTConfig.layer_windows``."""

    def __init__(self, n_layer: int, span: Tensor, windows: tuple[int | None, ...] = ()) -> None:
        self.span = span
        self.positions = span[:0]
        self.layers = [LayerCache(windows[i] if i < len(windows) else None) for i in range(n_layer)]

    @property
    def length(self) -> int:
        return self.positions.shape[-1]


def sample_next(logits: Tensor, temperature: float = 1.0, top_k: int | None = None, top_p: float | None = None,
                generator: torch.Generator | None = None) -> Tensor:
    """(B, 1) next token ids from (B, V) logits: greedy at temperature 0, else softmax
    sampling restricted to the ``top_k`` most likely and the smallest set with ``top_p`` mass."""
    if temperature == 0:
        return logits.argmax(-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k:
        kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        drop = cum - torch.softmax(sorted_logits, dim=-1) >= top_p  # mass before this token already >= p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)


@torch.no_grad()
def generate(model: Any, idx: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, cache: bool = True, generator: torch.Generator | None = None) -> Tensor:
    """Continue ``idx`` (B, P) with ``model`` (a GPT) by ``max_new_tokens`` tokens; temperature 0 = greedy.

    ``cache=True`` decodes one token per step against cached keys and values;
    ``cache=False`` recomputes the whole sequence each step (for comparison). Both see the
    positions 0..P+max_new_tokens-1 as one span, so they agree with each other and with
    one full forward over the final sequence. Dynamic NTK therefore takes its scale from
    the final length from the first step on (instead of re-scaling as the text grows,
    which would leave cached keys rotated at an older scale).
    """
    total = idx.shape[1] + max_new_tokens
    limit = model.pe.max_positions
    if limit is not None and total > limit:
        raise ValueError(f"generating to {total} tokens exceeds the {limit} positions of pe={model.pe.name}; "
                         f"ask for at most {limit - idx.shape[1]} new tokens")
    span = torch.arange(total, device=idx.device)
    kv = KVCache(len(model.blocks), span, model.config.layer_windows) if cache else None
    new = idx
    for step in range(max_new_tokens):
        if kv is not None:
            h = model.hidden(new, cache=kv)
        else:  # full recomputation, with the same span for span-dependent schemes
            h = model.hidden(idx, how=Pass(span=span))
        new = sample_next(model.logits(h[:, -1]), temperature, top_k, top_p, generator)
        idx = torch.cat((idx, new), dim=1)
    return idx
