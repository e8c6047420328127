"""Causal and float attention masks, decided by token order, never by position values."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def causal_future(Tq: int, Tk: int, device: torch.device | None = None, window: int | None = None) -> Tensor:
    """(Tq, Tk) bool, True where key j comes after query i in token order, the queries being
    the last Tq of the Tk tokens. Packed documents, randomized positions and cache offsets
    repeat or reset position values, so order decides. ``window`` W: also True where j <= i - W
    (query i sees the W keys i-W+1..i, itself included)."""
    q_index = torch.arange(Tk - Tq, Tk, device=device)[:, None]
    k_index = torch.arange(Tk, device=device)[None, :]
    if window is None:
        return k_index > q_index
    return (k_index > q_index) | (k_index <= q_index - window)


def hidden_keys(Tq: int, Tk: int, device: torch.device | None = None, q_documents: Tensor | None = None,
                k_documents: Tensor | None = None, window: int | None = None) -> Tensor:
    """True where a query may not see a key: ``causal_future`` (Tq, Tk), or with (B, Tq) and
    (B, Tk) document ids (packed documents, data/packing.py) also every key of another
    document, (B, 1, Tq, Tk): one boolean for every head."""
    future = causal_future(Tq, Tk, device, window)
    if q_documents is None:
        return future
    return (future | (q_documents[:, :, None] != k_documents[:, None, :])).unsqueeze(1)


def causal_pair(Tq: int, Tk: int, device: torch.device) -> tuple[Tensor | None, bool]:
    """(attn_mask, is_causal) for SDPA without position terms."""
    if Tq == Tk:
        return None, True
    if Tq == 1:  # one new token after a cache: every key is visible
        return None, False
    return ~causal_future(Tq, Tk, device), False


def attention_mask(pe: Any, q_positions: Tensor, k_positions: Tensor, dtype: torch.dtype, always: bool = False,
                   with_bias: bool = True, q_documents: Tensor | None = None,
                   k_documents: Tensor | None = None, window: int | None = None) -> Tensor | None:
    """Float mask (1 or B, H, Tq, Tk): the scheme's bias plus -inf on keys after the query.

    None when the scheme has no bias (SDPA's is_causal is faster), unless ``always``.
    ``with_bias=False``: the causal part only (NoPE layers). The model asks float32, so the
    position terms keep float32 accuracy whatever the compute dtype (a bf16 mask would round a
    bias of -16 to steps of 0.125). With document ids the keys of other documents are -inf
    too; without a bias the mask is (1 or B, 1, Tq, Tk), one row set for every head. ``window``: keys
    before the query's sliding window are -inf too."""
    future = hidden_keys(q_positions.shape[-1], k_positions.shape[-1], q_positions.device, q_documents, k_documents,
                         window)
    if pe.uses_bias and with_bias:
        bias = pe.bias(q_positions, k_positions)
    elif always and q_documents is not None:
        bias = torch.zeros((), device=future.device)
    elif always:  # one row set for every head (differential attention has more query heads than pe.n_head)
        bias = torch.zeros(future.shape, device=future.device).unsqueeze(0)
    else:
        return None
    mask = bias.masked_fill(future, float("-inf")).to(dtype)
    return mask if mask.dim() == 4 else mask.unsqueeze(0)  # (B or 1, H, Tq, Tk)
