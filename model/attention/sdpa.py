"""``sdpa``: PyTorch's fused attention with the position terms as a float32 mask."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.features import KEY_PIECES
from model.attention.sinks import sink_key


def mask_dtype(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A float mask in the wider of its dtype (float32) and the compute dtype: float32 with bf16
    or fp16 q (the position terms keep float32 accuracy), float64 with float64 q (CPU SDPA's
    kernels add a float32 mask to float64 scores wrongly from 16 keys on, docs/design.md); a
    boolean mask as it is."""
    if mask is None or not mask.is_floating_point():
        return mask
    return mask.to(torch.promote_types(mask.dtype, dtype))


def sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout: float, causal: bool,
         scale: float | None = None) -> Tensor:
    """SDPA in the compute dtype of v with a float32 mask added in float32 (float64 for float64
    q, ``mask_dtype``): autocast is off here because it would cast the mask to bf16 (q, k, v
    already are). A q/k head dim wider than v's (PoPE's 2d) pads v with zeros: SDPA's fused kernels
    take one head dim, and else it runs its math path (6x slower on CPU without grad, 1.7x with)."""
    width = v.shape[-1]
    if q.shape[-1] > width:
        v = F.pad(v, (0, q.shape[-1] - width))
    with torch.autocast(v.device.type, enabled=False):
        out = F.scaled_dot_product_attention(q.to(v.dtype), k.to(v.dtype), v, attn_mask=mask_dtype(mask, v.dtype),
                                             dropout_p=dropout, is_causal=causal, scale=scale)
    return out if out.shape[-1] == width else out[..., :width]


def default_scale(q: Tensor) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


class SDPA(AttentionBackend):
    """The state is the float32 mask with a bias, else a boolean order mask or None (SDPA's
    causal kernel)."""

    name = "sdpa"
    fallback = ("flex", "math")
    grad_route = "bias_grad"  # a learned bias on CPU, where SDPA would take its float32 math path
    sink_dtypes = tuple(KEY_PIECES)  # the sink key's logit in exact pieces: fp16 has none (flex or math)
    layer_terms = True  # a data-dependent scheme's c_i - c_j join its float32 mask

    def fits(self, pe, device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
        # CUDA's fused kernels take a float mask only in q's dtype: the memory-efficient one
        # refuses a float32 mask with bf16/fp16 q, and cuDNN reads it as q's dtype (garbage).
        # A bias must keep float32, so on CUDA a bias goes through SDPA in float32 compute only.
        return device.type != "cuda" or not (pe.uses_bias or pe.data_dependent) or dtype == torch.float32

    def prepare(self, terms: Terms, chunked: bool = False) -> Tensor | None:
        return None if chunked else terms.order_mask()

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Any, dropout: float,
                 sink: Tensor | None = None) -> Tensor:
        causal = mask is None and q.shape[2] == k.shape[2]
        if sink is None:
            return sdpa(q, k, v, mask, dropout, causal)
        Tq, width, scale = q.shape[2], v.shape[-1], default_scale(q)
        q, k, v, mask, causal = sink_key(q, k, v, sink, scale, mask, causal)
        return sdpa(q, k, v, mask, dropout, causal, scale)[..., -Tq:, :width]
