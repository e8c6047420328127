"""``sdpa``: PyTorch's fused attention with the position terms as a float32 mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.features import default_scale
from model.attention.request import AttentionRequest


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


@dataclass
class KernelCall:
    """One call of SDPA's kernel as a backend of its family hands it over: a normaliser may add a
    key to it before ``run`` (normalisers.py); the output's last Tq rows and first v dims are attention's."""

    q: Tensor
    k: Tensor
    v: Tensor
    mask: Tensor | None  # float or boolean (1 or B, H or 1, Tq, Tk), or None
    causal: bool  # SDPA's causal kernel (no mask, Tq = Tk)
    dropout: float
    scale: float | None = None  # None: 1 / sqrt(q's head dim)
    bias: Tensor | None = None  # the tensor that takes the mask's gradient (bias_grad), or None
    row_shift: Tensor | None = None  # (1 or B, H, Tq): a constant of each row the logits leave out (sdpa_key)


class SDPA(AttentionBackend):
    """The state is the float32 mask with a bias, else a boolean order mask or None (SDPA's
    causal kernel)."""

    name = "sdpa"
    fallback = ("flex", "math")
    grad_route = "bias_grad"  # a learned bias on CPU, where SDPA would take its float32 math path
    terms = ("layer",)  # a data-dependent scheme's c_i - c_j join its float32 mask

    def refusal(self, request: AttentionRequest) -> str | None:
        # CUDA's fused kernels take a float mask only in q's dtype: the memory-efficient one
        # refuses a float32 mask with bf16/fp16 q, and cuDNN reads it as q's dtype (garbage).
        # A bias must keep float32, so on CUDA a bias goes through SDPA in float32 compute only.
        if request.cuda and (request.pe.uses_bias or request.terms == "layer") and request.dtype != torch.float32:
            return (f"model.attention={self.name} on CUDA adds pe={request.pe.name}'s terms only in float32 "
                    f"compute (its kernels read a float mask in q's dtype)")
        return super().refusal(request)

    def prepare(self, terms: Terms, chunked: bool = False) -> Tensor | None:
        return None if chunked else terms.order_mask()

    def kernel_call(self, q: Tensor, k: Tensor, v: Tensor, mask: Any, dropout: float) -> KernelCall:
        return KernelCall(q, k, v, mask, mask is None and q.shape[2] == k.shape[2], dropout)

    def run(self, call: KernelCall) -> Tensor:
        return sdpa(call.q, call.k, call.v, call.mask, call.dropout, call.causal, call.scale)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Any, dropout: float) -> Tensor:
        return self.run(self.kernel_call(q, k, v, mask, dropout))
