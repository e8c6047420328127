"""Differential attention V2 (``model.attention_kind=differential``), as microsoft/unilm's
``Diff-Transformer/Diff-Transformer-V2/multihead_flashdiffv2.py``: each of the H output heads
has two query heads, 2h and 2h + 1, which read the same key/value head; one attention call over
the 2H query heads gives a_{2h} and a_{2h+1}, and head h's output is

    out_h = a_{2h} - sigmoid(lambda_{t,h}) * a_{2h+1},    lambda = x W_lambda  (W_lambda: C -> H, no bias)

x being the attention's input (the block's normalised hidden states). ``c_proj`` is unchanged
(H heads in, C out) and there is no per-head norm (V1's GroupNorm and its 1 - lambda_init factor
are gone in V2). V1 (``multihead_diffattn.py``) splits the H heads themselves into pairs and so
needs an even H; V2's query projection is 2C wide, so every H works and an odd number of heads
is not refused.

The layout, as the reference's: c_attn's q part is 2C wide, query head j = 2h + r (r = 0, 1)
reads rows [j hd, (j + 1) hd). Under GQA query head j reads key/value head j // (2H / G), as
flash-attn's grouping does, and the two heads of a pair always share theirs: 2H / G = 2 (H / G)
is even, so 2h and 2h + 1 fall in one group. That needs G to divide H, which ``model.n_kv_head``
already must (model/config.py); a G dividing 2H but not H, which would split pairs, is refused
there.

What combines: whatever acts per query head alike or per softmax. A rotation or an embedding
that is the same in every head (rope and its scalings, xpos, learned, sinusoidal, nope), rope_dd's
turns (per key/value head: both heads of a pair turn alike; with rotate_v the output is turned
back after the combination, which is linear and so commutes with the turn), qk_norm,
the attention temperature (per query; ssmax's s_h and the sink logits are per softmax, so one per
query head: 2H per layer), windows, packed documents, query chunks, the KV cache (it keeps the G
key/value heads) and the operations on the attention output (model/output_ops/, after the
combination, on the H output heads with their own values). What does not: a scheme with terms of
its own per head (a bias: ALiBi, T5, KERPLE, FIRE; data-dependent terms: FoX, CoPE; a rotation
that differs per head: PoPE's phases), sized for H heads where the backends see 2H;
``check_scheme`` refuses them before any data is read.

Init: pelab's GPT-2 init, N(0, 0.02), for every Linear, W_lambda included (the reference file
sets none: PyTorch's default), so sigmoid(lambda) starts near 1/2.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# model.attention_kind -> query heads per output head
QUERIES_PER_HEAD = {"standard": 1, "differential": 2}
ATTENTION_KINDS = tuple(QUERIES_PER_HEAD)


def check_scheme(config, pe) -> None:
    """``model.attention_kind=differential`` with a scheme whose terms are per head: one line."""
    if config.attention_kind == "standard":
        return
    has = ("a bias per head" if pe.uses_bias else
           "data-dependent terms per head" if pe.terms is not None and not pe.uses_layer_rotation else
           "a rotation that differs per head" if pe.head_rotation else None)
    if has is not None:
        raise ValueError(f"model.attention_kind=differential needs a scheme without per-head terms, got pe={pe.name} "
                         f"({has}, for n_head={config.n_head} heads where differential attention has "
                         f"{2 * config.n_head} query heads): use a rotation or embedding scheme (rope, xpos, rope_dd, "
                         f"learned, sinusoidal, nope) or model.attention_kind=standard")


class DifferentialV2(nn.Module):
    """The pair combination: (B, 2H, T, hd) query-head outputs -> (B, H, T, hd)."""

    def __init__(self, config) -> None:
        super().__init__()
        self.n_head = config.n_head
        self.lambda_proj = nn.Linear(config.n_embd, config.n_head, bias=False)

    def forward(self, y: Tensor, x: Tensor) -> Tensor:
        """a_{2h} - sigmoid(lambda_h(x)) a_{2h+1}; x (B, T, C) the attention input."""
        weight = torch.sigmoid(self.lambda_proj(x)).transpose(1, 2).unsqueeze(-1)  # (B, H, T, 1)
        return y[:, 0::2] - weight.to(y.dtype) * y[:, 1::2]

    @staticmethod
    def head_values(v: Tensor) -> Tensor:
        """Output head h's values of values repeated to the 2H query heads (both heads of a pair read them)."""
        return v[:, 0::2]


def build(config) -> DifferentialV2 | None:
    """Layer's combination of its query heads, None for standard attention (one query head per head)."""
    return DifferentialV2(config) if config.attention_kind == "differential" else None
