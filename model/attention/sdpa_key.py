"""``sdpa_key``: an ALiBi-type bias carried inside q.k, so SDPA keeps its causal kernel.

Under a causal softmax any term constant along a query's row drops out: of -m_h (i - j) only
m_h (j - j_ref) is left, a term of the key alone (j_ref, the last key's position, keeps it
small). k gets it as extra features, q gets ones, and SDPA's scale 1/sqrt(head_dim) multiplies
both parts, so the features carry m_h (j - j_ref) sqrt(head_dim), computed in float32 and split
into pieces exactly representable in the compute dtype (three for bf16: the float32 value).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.features import KEY_PIECES, pad_heads, split_exact
from model.attention.masks import causal_pair
from model.attention.request import AttentionRequest
from model.attention.sdpa import KernelCall, sdpa


def key_features(slopes: Tensor, k_positions: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """(1 or B, H, Tk, n) key features carrying m_h (j - j_ref) sqrt(head_dim) exactly."""
    kp = k_positions if k_positions.dim() == 2 else k_positions[None]
    relative = (kp - kp[:, -1:]).float()  # exact integers
    term = slopes.float()[None, :, None] * relative[:, None, :] * math.sqrt(head_dim)
    return split_exact(term, dtype)


def dropped_rows(slopes: Tensor, q_positions: Tensor, k_positions: Tensor) -> Tensor:
    """(1 or B, H, Tq) float32 m_h (p_i - p_ref): minus the term of each query's row that the key
    features leave out, which a logit added to the row (a normaliser's key) must still be compared against."""
    qp, kp = (p if p.dim() == 2 else p[None] for p in (q_positions, k_positions))
    return slopes.float()[None, :, None] * (qp - kp[:, -1:]).float()[:, None, :]


class SDPAKey(AttentionBackend):
    """The state is the key features of every key of the forward (chunks take their keys),
    for packed documents or a window SDPA's boolean mask (else None: SDPA's causal kernel), and
    the queries' ``dropped_rows`` (the kernel call's ``row_shift``; chunks take their rows).
    The form stays exact under a document mask: -m_h p_i is constant along each query's row
    whichever keys of it are hidden, and p_j - p_ref is per sequence (per-document positions)."""

    name = "sdpa_key"

    def refusal(self, request: AttentionRequest) -> str | None:
        if request.dtype not in KEY_PIECES:  # fp16 has no exact pieces (its range ends at 65504)
            return f"model.attention={self.name} has no exact key features in {request.dtype}"
        if request.pe.key_only_slopes() is None:
            return f"model.attention={self.name}: pe={request.pe.name} has no bias -m_h (i - j) (key_only_slopes)"
        return super().refusal(request)

    def prepare(self, terms: Terms, chunked: bool = False) -> tuple[Tensor, Tensor | None, Tensor]:
        slopes = terms.pe.key_only_slopes()
        features = key_features(slopes, terms.k_positions, terms.pe.head_dim, terms.dtype)
        visible = ~terms.hidden() if (terms.documents or terms.window is not None) and not chunked else None
        return features, visible, dropped_rows(slopes, terms.q_positions, terms.k_positions)

    def chunk(self, state: tuple[Tensor, Tensor | None, Tensor], terms: Terms, s: int,
              e: int) -> tuple[Tensor, Tensor | None, Tensor]:
        rows, (ks, ke) = terms.rows(s, e), terms.key_span(s, e)
        visible = ~rows.hidden() if rows.documents or rows.window is not None else None
        return state[0][..., ks:ke, :], visible, state[2][..., s:e]

    def kernel_call(self, q: Tensor, k: Tensor, v: Tensor, state: tuple[Tensor, Tensor | None, Tensor],
                    dropout: float) -> KernelCall:
        """[q, 1] . [k, features] with the original scale; v padded with zeros to the same dim.
        A key added to the call compares with the full logits: its row shift is the term the features drop."""
        features, visible, dropped = state
        B, H, Tq, D = q.shape
        Tk, n = k.shape[2], features.shape[-1]
        dtype = v.dtype
        q = torch.cat((q.to(dtype), q.new_ones(B, H, Tq, n, dtype=dtype)), dim=-1)
        k = torch.cat((k.to(dtype), features.to(dtype).expand(B, H, Tk, n)), dim=-1)
        mask, causal = causal_pair(Tq, Tk, q.device) if visible is None else (visible, False)
        return KernelCall(q, k, v, mask, causal, dropout, 1.0 / math.sqrt(D), row_shift=dropped)

    def run(self, call: KernelCall) -> Tensor:
        q, k, v = pad_heads(call.q, call.k, call.v)
        return sdpa(q, k, v, call.mask, call.dropout, call.causal, scale=call.scale)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: tuple[Tensor, Tensor | None, Tensor],
                 dropout: float) -> Tensor:
        return self.run(self.kernel_call(q, k, v, state, dropout))[..., -q.shape[2]:, :q.shape[-1]]
