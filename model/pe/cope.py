"""CoPE, contextual position encoding (Golovneva et al. 2024): positions counted by gates of the scores.

Query i gates every key it sees, g_ij = sigmoid(q_i . k_j / sqrt(d)), and key j sits at the
position p_ij = sum_{t=j..i} g_it (summed over the visible keys from j to the query), clamped to
npos_max - 1. A learned table e (npos_max, head_dim) per layer, shared by the heads, gives the
logit term by interpolating between the integers around p:

    logit_ij = (q_i . k_j + (1 - w) q_i . e[floor p_ij] + w q_i . e[ceil p_ij]) / sqrt(d),  w = p - floor p.

The term needs each row's scores, so it enters attention through the score hook (``score_terms``),
which only the math backend (it materialises the scores) runs; hidden keys (later, before a
window, of another document) have gate 0, so every document counts its own positions.

Transcribed from the authors' code (facebookresearch/RAM, projects/cope/src/cope/context_position.py,
``ContextPosSelfAttn`` with its defaults: gates of the attention's own keys, the table zero at init,
npos = block_size + 1, the term added before the 1/sqrt(d) scale). Where it differs from the
paper: the paper's gates sigmoid(q.k) are unscaled, the code's divide by sqrt(d) (followed here);
floor and ceil carry no gradient, w does. The code has no window or documents; here their keys are
hidden keys like later ones.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding


class CoPE(PositionEncoding, name="cope"):
    terms: ClassVar[str | None] = "scores"

    def __init__(self, config: GPTConfig, npos_max: int | None = None) -> None:
        super().__init__(config)
        self.npos = config.block_size + 1 if npos_max is None else npos_max  # position 0 is possible
        if self.npos < 1:
            raise ValueError(f"pe.npos_max must be >= 1 (the size of CoPE's position table), got {npos_max}")
        self.context_table = nn.Parameter(torch.zeros(config.n_layer, self.npos, config.head_dim))

    def positions(self, scores: Tensor, visible: Tensor) -> Tensor:
        """(..., Tq, Tk) p_ij = sum over visible t = j..i of sigmoid(score_it), clamped to npos_max - 1."""
        gates = torch.sigmoid(scores) * visible
        return gates.flip(-1).cumsum(-1).flip(-1).clamp(max=self.npos - 1)

    def score_terms(self, q: Tensor, scores: Tensor, visible: Tensor, layer: int) -> Tensor:
        """(B, H, Tq, Tk) logit terms of layer ``layer`` from its queries q (B, H, Tq, d), scaled
        scores q.k / sqrt(d) (B, H, Tq, Tk) and the visible keys (bool, broadcastable)."""
        if not 0 <= layer < self.context_table.shape[0]:
            raise ValueError(f"pe=cope has tables for layers 0..{self.context_table.shape[0] - 1}, got layer {layer}")
        p = self.positions(scores, visible)
        fixed = torch.matmul(q, self.context_table[layer].to(q.dtype).t())  # (B, H, Tq, npos): q . e[n] for every n
        floor = p.detach().floor()
        w = p - floor
        low, high = fixed.gather(-1, floor.long()), fixed.gather(-1, p.detach().ceil().long())
        return (high * w + low * (1 - w)) * (1.0 / math.sqrt(q.shape[-1]))

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        norms = self.context_table.float().norm(dim=-1).cpu()  # (layers, npos)
        return {"|e[p]| by layer": (torch.arange(self.npos).float(), norms, "context position p")}
