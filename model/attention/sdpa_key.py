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
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.masks import causal_pair
from model.attention.sdpa import sdpa

# q, k, v are padded to one head dim, a multiple of this: 8 for CUDA's flash kernels; none on
# CPU, where padding is slower than an odd head dim (docs/benchmark.md).
KEY_PAD_MULTIPLE = {"cuda": 8}
# pieces of the compute dtype whose float32 sum is exactly a float32 value (8 + 8 + 8 significand bits)
KEY_PIECES = {torch.float32: 1, torch.float64: 1, torch.bfloat16: 3}


def split_exact(x: Tensor, dtype: torch.dtype) -> Tensor:
    """(..., n) pieces of float32 ``x`` in ``dtype`` that sum back to ``x`` exactly in float32:
    each piece is the rounding of what the earlier ones left (an exact float32 difference)."""
    pieces, rest = [], x
    for _ in range(KEY_PIECES[dtype]):
        piece = rest.to(dtype)
        pieces.append(piece)
        rest = rest - piece.float()
    return torch.stack(pieces, dim=-1)


def key_features(slopes: Tensor, k_positions: Tensor, head_dim: int, dtype: torch.dtype) -> Tensor:
    """(1 or B, H, Tk, n) key features carrying m_h (j - j_ref) sqrt(head_dim) exactly."""
    kp = k_positions if k_positions.dim() == 2 else k_positions[None]
    relative = (kp - kp[:, -1:]).float()  # exact integers
    term = slopes.float()[None, :, None] * relative[:, None, :] * math.sqrt(head_dim)
    return split_exact(term, dtype)


class SDPAKey(AttentionBackend):
    """The state is the key features of every key of the forward (chunks take their keys) and,
    for packed documents or a window, SDPA's boolean mask (else None: SDPA's causal kernel).
    The form stays exact under a document mask: -m_h p_i is constant along each query's row
    whichever keys of it are hidden, and p_j - p_ref is per sequence (per-document positions)."""

    name = "sdpa_key"
    dtypes = tuple(KEY_PIECES)  # fp16 has no exact pieces (its range ends at 65504)

    def fits(self, pe, device: torch.device, dtype: torch.dtype, grad: bool) -> bool:
        return pe.key_only_slopes() is not None

    def prepare(self, terms: Terms, chunked: bool = False) -> tuple[Tensor, Tensor | None]:
        features = key_features(terms.pe.key_only_slopes(), terms.k_positions, terms.pe.head_dim, terms.dtype)
        visible = ~terms.hidden() if (terms.documents or terms.window is not None) and not chunked else None
        return features, visible

    def chunk(self, state: tuple[Tensor, Tensor | None], terms: Terms, s: int, e: int) -> tuple[Tensor, Tensor | None]:
        rows, (ks, ke) = terms.rows(s, e), terms.key_span(s, e)
        visible = ~rows.hidden() if rows.documents or rows.window is not None else None
        return state[0][..., ks:ke, :], visible

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: tuple[Tensor, Tensor | None],
                 dropout: float) -> Tensor:
        """[q, 1] . [k, features] with the original scale; v padded with zeros to the same dim."""
        features, visible = state
        B, H, Tq, D = q.shape
        Tk, n = k.shape[2], features.shape[-1]
        pad = -(D + n) % KEY_PAD_MULTIPLE.get(q.device.type, 1)
        dtype = v.dtype
        q = torch.cat((q.to(dtype), q.new_ones(B, H, Tq, n, dtype=dtype)), dim=-1)
        k = torch.cat((k.to(dtype), features.to(dtype).expand(B, H, Tk, n)), dim=-1)
        if pad:
            q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
        v = F.pad(v, (0, n + pad))
        mask, causal = causal_pair(Tq, Tk, q.device) if visible is None else (visible, False)
        return sdpa(q, k, v, mask, dropout, causal, scale=1.0 / math.sqrt(D))[..., :D]
