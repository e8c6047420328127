"""Attention sinks (``model.normaliser=sink_learned|sink_zero``): one logit s_h per head joined to
every softmax denominator.

    p_ij = exp(z_ij) / (exp(s_h) + sum_k exp(z_ik)),    out_i = sum_j p_ij v_j

is gpt-oss's softmax over [z_i, s_h] with the sink's column dropped: a query may give part of its
attention to nothing, and its token weights sum to sigmoid(lse_i - s_h) < 1, lse_i the log-sum-exp
of its logits. ``sink_learned``: s_h a parameter of each layer and head; ``sink_zero``: s_h = 0, the
off-by-one softmax (Megatron's ``softmax_type=off-by-one``). Two forms, both applied by the
normaliser around a backend (normalisers.py): a backend that returns its rows' LSE has its output
rescaled by sigmoid(lse - s_h) (``sink_weight``, torchtitan's ``apply_attention_sink_rescale``); SDPA's
backends, which return no differentiable LSE, attend one more key (``extra_key`` on their kernel call).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.features import default_scale, pad_heads, split_exact

SINKS = ("none", "learned", "zero")  # the values of model.sinks, the old spelling (model/config.py)


def sink_weight(lse: Tensor, sink: Tensor) -> Tensor:
    """(B, H, Tq, 1) sigmoid(lse - s_h): the share of each row's attention its tokens keep."""
    acc = torch.promote_types(lse.dtype, torch.float32)  # float64 for float64 compute (CPU flex)
    return torch.sigmoid(lse.to(acc) - sink.to(acc)[:, None]).unsqueeze(-1)


def sink_key(q: Tensor, k: Tensor, v: Tensor, sink: Tensor, scale: float, mask: Tensor | None, causal: bool,
             shift: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor | None, bool]:
    """SDPA's q, k, v, mask and is_causal with the sink as one more key, the first: each query
    gains n dims holding its sink logit / scale (in ``split_exact`` pieces of the compute dtype,
    so the logit is float32's), the sink key ones there and every other key zeros, and the
    sink's value is zero. A mask (boolean or float) gets a visible column for it; a causal
    forward without one (``causal``: Tq = Tk) keeps SDPA's causal kernel: one zero query first,
    so that the kernel's top-left rule shows query i the sink and keys 0..i. ``shift`` (1 or B,
    H, Tq): a term added to query i's sink logit, for logits from which a constant of the row was
    dropped (sdpa_key). q, k, v come back in v's dtype with one head dim (``pad_heads``); the
    last Tq rows and first v.shape[-1] dims of SDPA's output are the attention's."""
    B, H, Tq, D = q.shape
    dtype = v.dtype
    logit = sink.to(torch.promote_types(dtype, torch.float32))[:, None]  # (H, 1)
    logit = logit if shift is None else logit + shift
    pieces = split_exact(logit / scale, dtype)  # (H, 1 or Tq, n) or (1 or B, H, Tq, n)
    n = pieces.shape[-1]
    q = torch.cat((q.to(dtype), pieces.expand(B, H, Tq, n)), dim=-1)
    first = torch.cat((k.new_zeros(B, H, 1, D, dtype=dtype), k.new_ones(B, H, 1, n, dtype=dtype)), dim=-1)
    k = torch.cat((first, F.pad(k.to(dtype), (0, n))), dim=2)
    v = F.pad(v, (0, 0, 1, 0))
    if mask is not None:
        mask = F.pad(mask, (1, 0), value=True if mask.dtype == torch.bool else 0.0)
    elif causal:
        q = F.pad(q, (0, 0, 1, 0))
    return *pad_heads(q, k, v), mask, causal and mask is None


def extra_key(call: Any, sink: Tensor) -> Any:
    """An SDPA kernel call (sdpa.py's ``KernelCall``) with the sink as one more key (``sink_key``),
    at the scale of the call's own q; a mask's gradient target (``bias``) gets the key's column too."""
    scale = call.scale if call.scale is not None else default_scale(call.q)
    q, k, v, mask, causal = sink_key(call.q, call.k, call.v, sink, scale, call.mask, call.causal, call.row_shift)
    bias = None if call.bias is None else F.pad(call.bias, (1, 0))
    return replace(call, q=q, k=k, v=v, mask=mask, causal=causal, scale=scale, bias=bias, row_shift=None)
