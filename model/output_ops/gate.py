"""Gated attention (Qiu et al. 2025, "Gated Attention for Large Language Models", NeurIPS;
code: qiuzh20/gated_attention ``modeling_qwen3.py``): the attention output of each head is
multiplied by sigmoid(x W_g), x the attention's input (the block's normalised hidden states,
which the reference's ``q_proj`` reads; its gate logits are extra rows of ``q_proj``, here a
Linear of their own with the same init), before the output projection.

- ``headwise``: one logit per head and token, (B, T, H);
- ``elementwise``: one per head dim, (B, T, H * hd).

A gate near 0 lets a head write nothing for a token, which the paper reports removes the
attention sink (a head no longer needs a first-token key to park its weight on).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from model.output_ops.base import OutputOp


class OutputGate(OutputOp):
    key = "output_gate"
    kinds = ("none", "headwise", "elementwise")

    def __init__(self, config, kind: str) -> None:
        super().__init__()
        self.kind, self.n_head = kind, config.n_head
        self.proj = nn.Linear(config.n_embd, config.n_head if kind == "headwise" else config.n_embd, bias=config.bias)

    def forward(self, y: Tensor, x: Tensor, v: Tensor) -> Tensor:
        B, T, _ = x.shape
        gate = self.proj(x).view(B, T, self.n_head, -1).transpose(1, 2)  # (B, H, T, 1 or hd)
        return y * torch.sigmoid(gate)
