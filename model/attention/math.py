"""``math``: the attention formula written out in float32 (float64 for float64 q), probabilities
materialised (probes)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms


class AttentionRecorder:
    """Collects the attention probabilities of the ``math`` backend, layer by layer in
    forward order: {layer: (B, H, Tq, Tk) float32} for the layers in ``layers`` (None: all)."""

    def __init__(self, layers: set[int] | None = None) -> None:
        self.layers, self.probs, self.calls = layers, {}, 0

    def add(self, probs: Tensor) -> None:
        if self.layers is None or self.calls in self.layers:
            self.probs[self.calls] = probs.detach()
        self.calls += 1

    def add_chunk(self, probs: Tensor, first_row: int, keys: int) -> None:
        """Rows ``first_row..`` of the current layer, (B, H, rows, keys seen); ``keys``: the layer's Tk.
        A subclass may reduce each chunk as it comes (evaluation/attention_maps.py's probe) instead."""
        self._chunks = [*getattr(self, "_chunks", []), F.pad(probs, (0, keys - probs.shape[-1]))]

    def end_layer(self) -> None:
        """The current layer's chunks are all in: record them as one (B, H, Tq, Tk) tensor."""
        chunks, self._chunks = getattr(self, "_chunks", []), []
        self.add(torch.cat(chunks, dim=2))


class Math(AttentionBackend):
    """The state is the float32 mask, always explicit (causal part included)."""

    name = "math"
    records = True
    lse = True
    fallback = ()
    terms = ("layer", "scores")
    plain = "math"

    def prepare(self, terms: Terms, chunked: bool = False) -> Tensor | None:
        return None if chunked else terms.mask(always=True)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, dropout: float, lse: bool = False,
                 weights: Callable[[Tensor], Tensor] | None = None,
                 score_terms: Callable[[Tensor, Tensor, Tensor], Tensor] | None = None) -> tuple[Tensor, ...]:
        """softmax(q k^T / sqrt(d) + mask) v and the weights, in float32 (float64 for float64 v);
        ``weights``: f(logits) in place of the softmax (a normaliser's); ``score_terms``: its
        f(q, scores, visible keys) joins the logits (a score-dependent scheme); with ``lse`` the
        rows' log-sum-exp comes third, and the output stays in float32 for the caller to rescale."""
        acc = torch.promote_types(v.dtype, torch.float32)
        with torch.autocast(v.device.type, enabled=False):
            scores = torch.matmul(q.to(acc), k.to(acc).transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
            logits = scores + mask
            if score_terms is not None:
                logits = logits + score_terms(q.to(acc), scores, mask > float("-inf"))
            probs = torch.softmax(logits, dim=-1) if weights is None else weights(logits)
            dropped = F.dropout(probs, dropout) if dropout else probs
            out = torch.matmul(dropped, v.to(acc))
            if lse:
                return out, probs, torch.logsumexp(logits, dim=-1)
            return out.to(v.dtype), probs
