"""PoPE: polar coordinate position embedding (Gopalakrishnan et al. 2025, arXiv 2509.10534).

Each of the d = head_dim components of q and k becomes a complex number: magnitude
softplus(q_c) (softplus(k_c)), phase i theta_c for the query at position i, j theta_c for the
key at j, with one frequency per component, theta_c = base^(-c/d), c = 0..d-1 (twice RoPE's
d/2). The logit is the real part of the Hermitian product over sqrt(d):

    a_ij = sum_c softplus(q_c) softplus(k_c) cos((i - j) theta_c - delta_hc) / sqrt(d),

delta a learned offset per head and component, kept in [-2 pi, 0]. Content sets only the
magnitudes and position only the phases, which is the paper's "what" and "where" decoupled.

Transcribed from x-transformers (lucidrains/x-transformers, x_transformers/x_transformers.py:
``PolarEmbedding``, ``apply_polar_pos_emb`` and their use in ``Attention.forward``); where the
paper's text and that code differ, this follows the code:

- q and k become real vectors of 2d dims, [m cos(phase), m sin(phase)] (the code's concatenated
  halves; the paper writes interleaved pairs, the same dot product), so q.k is the logit's sum.
- delta is one table (n_head, d) shared by every layer (the code's one ``PolarEmbedding`` per
  model; the paper speaks of a per-frequency bias), zero at init (``delta_init=uniform``: the
  code's ``bias_uniform_init``, U(-2 pi, 0)), clamped to [-2 pi, 0] in every forward.
- The softmax scale is 1/sqrt(d) of the original head dim, not of the 2d dims (the code passes
  ``dim_head ** -0.5`` to its attend). pelab's backends scale by 1/sqrt(q's last dim) = 1/sqrt(2d),
  so q carries the factor sqrt(2).
- The code adds delta to the key's phase, j theta_c + delta_c; here it is subtracted from the
  query's, i theta_c - delta_hc: the same cos(i theta - j theta - delta), and a query head owns its
  delta also when key heads are shared (GQA), where the code's per-key table would not broadcast.

Keys are stored in a KV cache in their 2d-dim polar form at their own positions, as RoPE's are
rotated; values keep d dims (SDPA, flex and the math backend accept a q/k dim other than v's).
delta also has ``project``: after every optimizer step the stored value is clamped into
[-2 pi, 0], so a parameter pushed past an end does not sit there with the clamp's zero gradient.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding

DELTA_MIN, DELTA_MAX = -2 * math.pi, 0.0
DELTA_INITS = ("zero", "uniform")


class PolarTables(NamedTuple):
    """float32 cos and sin of the phases: queries' i theta_c - delta_hc (..., H, T, d), keys' j theta_c (..., T, d)."""

    q_cos: Tensor
    q_sin: Tensor
    k_cos: Tensor
    k_sin: Tensor


class PoPE(PositionEncoding, name="pope"):
    scaling_kinds: ClassVar[tuple[str, ...]] = ("linear",)  # position interpolation: phases p theta_c / s
    head_rotation: ClassVar[bool] = True  # delta is (n_head, d)

    def __init__(self, config: GPTConfig, base: float = 10000.0, delta_init: str = "zero") -> None:
        super().__init__(config)
        if not base > 1.0:
            raise ValueError(f"pe.base must be > 1, got {base}")
        if delta_init not in DELTA_INITS:
            raise ValueError(f"pe.delta_init must be one of {DELTA_INITS}, got {delta_init!r}")
        self.base, self.delta_init = base, delta_init
        c = torch.arange(config.head_dim, dtype=torch.float64)
        self.register_buffer("inv_freq", (base ** (-c / config.head_dim)).float(), persistent=False)
        delta = torch.zeros(config.n_head, config.head_dim)
        if delta_init == "uniform":
            delta.uniform_(DELTA_MIN, DELTA_MAX)
        self.delta = nn.Parameter(delta)

    def scale(self, scaling) -> None:
        super().scale(scaling)
        self.inv_freq = self.inv_freq / scaling.factor

    def offsets(self) -> Tensor:
        """delta clamped to [-2 pi, 0] (n_head, d), float32."""
        return self.delta.float().clamp(DELTA_MIN, DELTA_MAX)

    def rotate(self, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
        q_tables = self.rotation_tables(q_positions, q_positions)
        k_tables = self.rotation_tables(k_positions, k_positions)
        return self.apply_rotation(q, k, q_tables._replace(k_cos=k_tables.k_cos, k_sin=k_tables.k_sin))

    def rotation_tables(self, positions: Tensor, span: Tensor) -> PolarTables:
        angles = positions.float()[..., None] * self.inv_freq  # (T, d) or (B, T, d)
        if angles.dim() == 3:  # per-sequence positions: a head dim to broadcast over
            angles = angles[:, None]
        q_angles = angles - self.offsets()[:, None, :]  # (H, T, d) or (B, H, T, d)
        return PolarTables(q_angles.cos(), q_angles.sin(), angles.cos(), angles.sin())

    def apply_rotation(self, q: Tensor, k: Tensor, tables: PolarTables) -> tuple[Tensor, Tensor]:
        acc = torch.promote_types(q.dtype, torch.float32)
        with torch.autocast(q.device.type, enabled=False):
            # contiguous: compiled graphs predict softplus_backward's strides from a strided input
            # wrongly on CPU (the c_attn split's views), and elementwise ops on those views are slow
            mq = F.softplus(q.to(acc).contiguous()) * math.sqrt(2.0)  # the backends' 1/sqrt(2d) times sqrt 2: 1/sqrt(d)
            mk = F.softplus(k.to(acc).contiguous())
            q_cos, q_sin, k_cos, k_sin = (t.to(acc) for t in tables)
            return (torch.cat((mq * q_cos, mq * q_sin), dim=-1).to(q.dtype),
                    torch.cat((mk * k_cos, mk * k_sin), dim=-1).to(k.dtype))

    def project(self) -> None:
        with torch.no_grad():
            self.delta.clamp_(DELTA_MIN, DELTA_MAX)

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        components = torch.arange(self.head_dim).float()
        return {"phase offset delta_c": (components, self.offsets().cpu(), "component c (high to low frequency)")}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, delta_init={self.delta_init}"
