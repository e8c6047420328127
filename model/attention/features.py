"""Terms carried inside q.k as extra head dims, exactly: pieces of a float32 value in the
compute dtype (sdpa_key's ALiBi term, the SDPA sink logit) and the padding of the head dim."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

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


def pad_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q and k padded with zeros to the device's head-dim multiple, v to the same dim (the fused
    kernels take one head dim); the output's first v.shape[-1] dims are attention's."""
    pad = -q.shape[-1] % KEY_PAD_MULTIPLE.get(q.device.type, 1)
    if pad:
        q, k = F.pad(q, (0, pad)), F.pad(k, (0, pad))
    return q, k, F.pad(v, (0, q.shape[-1] - v.shape[-1]))


def default_scale(q: Tensor) -> float:
    """SDPA's default logit scale, 1 / sqrt(q's head dim)."""
    return 1.0 / math.sqrt(q.shape[-1])
