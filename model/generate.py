"""Generation: top-k/top-p sampling and ``generate``, decoding against the KV cache (model/cache.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.cache import KVCache, LayerCache, Sinks, Windows  # re-exported: the cache's old home
from model.positions import Pass


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


__all__ = ["KVCache", "LayerCache", "Sinks", "Windows", "generate", "sample_next"]
