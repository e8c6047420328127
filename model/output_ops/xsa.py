"""Exclusive self-attention, XSA (Zhai 2026, arXiv 2603.09078): each head's output y_i loses
its component along the token's own value v_i, z_i = y_i - (y_i . v_i) v_i / |v_i|^2, so
attention carries only what the other tokens add (the token's own value reaches the residual
stream anyway).

- ``plain``: the paper's z;
- ``gated``: modded-nanogpt's learnable strength (``train_gpt.py``, records #82 and #86):
  z_i = y_i - tanh(a_{i,h}) (y_i . v_i) v_i / |v_i|^2 with a per-token, per-head a from the
  attention input; a starts at 0 (zero weights), so training starts from plain attention.
  modded-nanogpt computes a in a small MLP of the residual stream shared by its XSA layers;
  here it is one Linear per layer.

|v|^2 is clamped at 1e-8 (modded-nanogpt's) so a zero value passes y unchanged; the
projection is computed in float32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.output_ops.base import OutputOp

EPS = 1e-8


class ExclusiveSelfAttention(OutputOp):
    key = "xsa"
    kinds = ("none", "plain", "gated")

    def __init__(self, config, kind: str) -> None:
        super().__init__()
        self.kind, self.n_head = kind, config.n_head
        self.alpha = nn.Linear(config.n_embd, config.n_head, bias=False) if kind == "gated" else None

    def init_weights(self, layer: int) -> None:
        if self.alpha is not None:
            nn.init.zeros_(self.alpha.weight)

    def forward(self, y: Tensor, x: Tensor, v: Tensor) -> Tensor:
        wide = torch.promote_types(y.dtype, torch.float32)  # bf16 -> float32, float64 kept
        yf, vf = y.to(wide), v.to(wide)
        along = (yf * vf).sum(-1, keepdim=True) / vf.square().sum(-1, keepdim=True).clamp_min(EPS)
        if self.alpha is not None:
            B, T, _ = x.shape
            along = along * torch.tanh(self.alpha(x).to(wide)).view(B, T, self.n_head, 1).transpose(1, 2)
        return (yf - along * vf).to(y.dtype)
