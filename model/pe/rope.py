"""Rotary position embedding (RoFormer, Su et al. 2021).

Pairs (x[k], x[k + r/2]) of the first r = rotary_fraction * head_dim dims of q and k are
rotated by angle p * theta_k, theta_k = base^(-2k/r). This is the half-split
("rotate_half") layout of GPT-NeoX / LLaMA / Hugging Face, not RoFormer's interleaved
pairs; the two are the same function up to a fixed permutation of the head dims.

Four options (RoPE only; xPos and RoPE+ALiBi keep the defaults):

- ``keep_fraction`` p (p-RoPE, Barbero et al. 2024, "Round and Round We Go! What makes
  Rotary Positional Encodings useful?"): only the n = floor(p * r/2) highest frequencies,
  pairs k = 0..n-1, rotate; the lowest ones are removed, i.e. theta_k = 0 for k >= n, so
  dims k and k + r/2 of those pairs pass unrotated (exactly: cos 0 = 1, sin 0 = 0). The
  kept pairs keep their RoPE frequencies base^(-2k/r) (unlike ``rotary_fraction``, which
  spreads base^(-2k/r') over fewer dims r'). p = 1 is plain RoPE; p -> 0 would be NoPE.
- ``max_period`` P: only the pairs whose period 2 pi / theta_k is at most P tokens rotate,
  removed as ``keep_fraction``'s (HoPE, Chen et al. 2024: P = the training length, so every
  rotating pair completes a period inside a training window). Periods of the unscaled, initial
  frequencies; with ``keep_fraction`` the smaller of the two kept sets.
- ``min_frequency`` w (modded-nanogpt's half-truncated RoPE): the n = r/2 frequencies run
  geometrically from 1 down to w inclusive, theta_k = w^(k/(n-1)) = (1/w)^-linspace(0, 1, n),
  i.e. ``base`` = w^(-n/(n-1)); so one of ``base`` and ``min_frequency`` is set.
- ``learnable_freq``: theta_k * exp(alpha_k) with a learned alpha (init 0, so training
  starts from plain RoPE). Off by default, and then no parameter exists (old checkpoints
  load unchanged).

``frequencies()`` is the one place the pair frequencies come from: learned factor first,
then the scaling (``scaling``: linear interpolation, NTK, dynamic NTK, YaRN, Llama 3,
LongRoPE; model/pe/rope_scaling.py) on top of the learned values, then the p-RoPE removal.
The scaling is set for training by ``scale`` or for one evaluation by ``scaled``
(model/pe/scaling.py), for every subclass (xPos, RoPE+ALiBi); it is a plain attribute, not
part of the state dict.
"""

from __future__ import annotations

import math
from typing import ClassVar, NamedTuple

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding
from model.pe.rope_scaling import SCALING_KINDS, RopeFrequencies, RopeScaling, scaled_frequencies
from model.pe.schedule import LayerRope


def swap_halves(x: Tensor, half: int) -> Tensor:
    """x with dims [0, half) and [half, 2*half) exchanged, later dims kept: a symmetric
    permutation, so it is its own transpose."""
    # a cat, not a roll: inductor turns a roll's backward into a scatter-add
    return torch.cat((x[..., half : 2 * half], x[..., :half], x[..., 2 * half :]), dim=-1)


def rotate_half(x: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
    """Pairs (x[k], x[k + half]) rotated: (x1 c - x2 s, x2 c + x1 s) = x * cos + swap(x) * sin
    with full-width tables cos = (c, c, 1..) and sin = (-s, s, 0..) (``RotaryTables``)."""
    return torch.addcmul(x * cos, swap_halves(x, half), sin)


class _Rotation(torch.autograd.Function):
    """q and k rotated in one autograd node whose backward is the transposed rotation,
    g * cos + swap(g * sin). Composed of elementwise ops, the rotation costs about a dozen
    autograd nodes per layer and full-size zero-filled slice gradients. Contiguous inputs:
    bf16 elementwise ops on the strided q, k views are slow on CPU. The tables get no
    gradient: only ``rotate_half`` under autograd carries one (learned frequencies)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, q_cos: Tensor, q_sin: Tensor, k_cos: Tensor | None,
                k_sin: Tensor | None, half: int) -> tuple[Tensor, Tensor]:
        # k's tables None: the same as q's. Dynamo cannot trace an apply that gets one tensor
        # twice (RoPE's shared tables in float32), and would break the graph in every layer.
        if k_cos is None:
            k_cos, k_sin = q_cos, q_sin
        ctx.save_for_backward(q_cos, q_sin, k_cos, k_sin)
        ctx.half = half
        return rotate_half(q.contiguous(), q_cos, q_sin, half), rotate_half(k.contiguous(), k_cos, k_sin, half)

    @staticmethod
    def backward(ctx, d_q: Tensor, d_k: Tensor):
        q_cos, q_sin, k_cos, k_sin = ctx.saved_tensors

        def transposed(g: Tensor | None, cos: Tensor, sin: Tensor) -> Tensor | None:
            return None if g is None else swap_halves(g * sin, ctx.half).add_(g * cos)

        return transposed(d_q, q_cos, q_sin), transposed(d_k, k_cos, k_sin), None, None, None, None, None


class RotaryTables(NamedTuple):
    """Full-width float32 tables for queries and keys (equal for RoPE, different decays for
    xPos): cos = (c, c, 1..), sin = (-s, s, 0..) over the head dim, so that the rotation is
    x * cos + swap_halves(x) * sin."""

    q_cos: Tensor
    q_sin: Tensor
    k_cos: Tensor
    k_sin: Tensor

    def cast(self, dtype: torch.dtype) -> "RotaryTables":
        q_cos, q_sin = _heads(self.q_cos, dtype), _heads(self.q_sin, dtype)
        if self.shared:  # cast once, and keep them one tensor for ``_Rotation``
            return RotaryTables(q_cos, q_sin, q_cos, q_sin)
        return RotaryTables(q_cos, q_sin, _heads(self.k_cos, dtype), _heads(self.k_sin, dtype))

    @property
    def shared(self) -> bool:
        """Queries and keys use the very same tables (RoPE; not xPos's two decays)."""
        return self.k_cos is self.q_cos and self.k_sin is self.q_sin


def rotary_frequencies(base: float, rotary_dim: int) -> Tensor:
    """theta_k = base^(-2k/r), k = 0..r/2 - 1, in float64 (the buffers keep their float32 rounding)."""
    k2 = torch.arange(0, rotary_dim, 2, dtype=torch.float64)
    return base ** (-k2 / rotary_dim)


def full_width(cos: Tensor, sin: Tensor, head_dim: int) -> tuple[Tensor, Tensor]:
    """Pair tables (..., r/2) as ``rotate_half`` takes them over the head dim: (c, c, 1..) and
    (-s, s, 0..), the dims past the rotary ones passing unrotated."""
    rest = cos.new_ones(()).expand(*cos.shape[:-1], head_dim - 2 * cos.shape[-1])
    return torch.cat((cos, cos, rest), dim=-1), torch.cat((-sin, sin, rest * 0), dim=-1)


def _heads(table: Tensor, dtype: torch.dtype) -> Tensor:
    """(T, D) broadcasts over (B, H, T, .) as it is; per-sequence (B, T, D) needs a head dim."""
    return (table[:, None] if table.dim() == 3 else table).to(dtype)


def frequency_base(min_frequency: float, n_pairs: int, base: float) -> float:
    """The base whose n_pairs frequencies base^(-k/n) run from 1 down to ``min_frequency`` inclusive."""
    if n_pairs < 2 or not 0.0 < min_frequency < 1.0:
        raise ValueError(f"pe.min_frequency must be in (0, 1) with at least 2 rotary pairs (theta runs from 1 down "
                         f"to it), got {min_frequency} with {n_pairs}")
    if base != 10000.0:
        raise ValueError(f"pe.base and pe.min_frequency: set one of the two (min_frequency={min_frequency} sets "
                         f"base = min_frequency^(-n/(n-1))), got base={base}")
    return min_frequency ** (-n_pairs / (n_pairs - 1))


def pairs_within(max_period: float, inv_freq: Tensor) -> int:
    """How many pairs, from the highest frequency down, have a period 2 pi / theta_k of at most ``max_period``."""
    shortest = 2 * math.pi / inv_freq[0].item()
    if not max_period >= shortest:
        raise ValueError(f"pe.max_period must be at least the shortest period 2 pi / theta_0 = {shortest:.4g} tokens "
                         f"(a smaller one keeps no pair to rotate; no rotation at all is pe=nope), got {max_period}")
    # theta_k falls with k, so the pairs within the period are a prefix; 1e-12 absorbs pow's rounding at equality
    return int((2 * math.pi / inv_freq <= max_period * (1 + 1e-12)).sum())


class RoPE(PositionEncoding, name="rope"):
    scaling_kinds: ClassVar[tuple[str, ...]] = SCALING_KINDS

    def __init__(
        self,
        config: GPTConfig,
        base: float = 10000.0,
        rotary_fraction: float = 1.0,
        keep_fraction: float = 1.0,
        learnable_freq: bool = False,
        max_period: float | None = None,
        min_frequency: float | None = None,
    ) -> None:
        super().__init__(config)
        if not 0.0 < rotary_fraction <= 1.0:
            raise ValueError(f"pe.rotary_fraction must be in (0, 1], got {rotary_fraction}")
        if base <= 1.0:
            raise ValueError(f"pe.base must be > 1, got {base}")
        self.rotary_dim = int(config.head_dim * rotary_fraction) // 2 * 2
        if self.rotary_dim < 2:
            raise ValueError(
                f"pe.rotary_fraction={rotary_fraction} of head_dim={config.head_dim} leaves no pair to rotate"
            )
        n_pairs = self.rotary_dim // 2
        if min_frequency is not None:
            base = frequency_base(min_frequency, n_pairs, base)
        self.base = base
        inv_freq = rotary_frequencies(base, self.rotary_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        # floor(p * r/2); the rounding to 6 places stops 0.29 * 100 = 28.999... from losing a pair
        self.kept_pairs = int(round(keep_fraction * n_pairs, 6))
        if not 0.0 < keep_fraction <= 1.0 or self.kept_pairs < 1:
            raise ValueError(f"pe.keep_fraction must be in (0, 1] and keep at least one of the {n_pairs} "
                             f"frequency pairs, got {keep_fraction} (no rotation at all is pe=nope)")
        if max_period is not None:
            self.kept_pairs = min(self.kept_pairs, pairs_within(max_period, inv_freq))
        self.keep_fraction, self.max_period, self.min_frequency = keep_fraction, max_period, min_frequency
        # 1 for the kept (highest) frequencies, 0 for the removed ones; None = keep all
        keep = (torch.arange(n_pairs) < self.kept_pairs).float()
        self.register_buffer("keep", keep if self.kept_pairs < n_pairs else None, persistent=False)
        self.log_freq_scale = nn.Parameter(torch.zeros(n_pairs)) if learnable_freq else None

    def scale(self, scaling: RopeScaling) -> None:
        if scaling.kind == "longrope":  # checked here, not at the first forward
            scaled_frequencies(scaling, self.inv_freq, scaling.original_length)
        super().scale(scaling)

    def frequencies(self, *positions: Tensor, layer: LayerRope | None = None) -> RopeFrequencies:
        """The call's effective frequencies. Pass every position tensor of the call (q's and
        k's): dynamic NTK takes T from the largest of them, and q and k must share it.
        ``layer``: a layer's own RoPE (model/pe/schedule.py): another base for the same pairs,
        another p-RoPE kept fraction, or no scaling."""
        layer = layer or LayerRope()
        inv_freq = self.inv_freq if layer.base is None else self.inv_freq_at(layer.base)
        if self.log_freq_scale is not None:  # learned theta_k * exp(alpha_k), float32
            inv_freq = inv_freq * self.log_freq_scale.float().exp()
        if self.scaling is None or not layer.scaled:
            freqs = RopeFrequencies(inv_freq)
        else:  # the scaling starts from the (learned) frequencies the model was trained with
            length = torch.stack([p.max() for p in positions]).max() + 1
            freqs = scaled_frequencies(self.scaling, inv_freq, length)
        keep = self.keep if layer.keep_fraction is None else self.kept_at(layer.keep_fraction, layer.base)
        if keep is not None:  # p-RoPE: removed pairs get theta = 0 after any scaling
            freqs = freqs._replace(inv_freq=freqs.inv_freq * keep)
        return freqs

    def kept_at(self, keep_fraction: float, base: float | None = None) -> Tensor | None:
        """p-RoPE's 1/0 mask of another kept fraction (HoPE's max_period still applies, at ``base``),
        computed as ``__init__`` does; None where every pair is kept."""
        n_pairs = self.rotary_dim // 2
        kept = int(round(keep_fraction * n_pairs, 6))
        if kept < 1:
            raise ValueError(f"pe.global_keep_fraction={keep_fraction} keeps none of the {n_pairs} frequency pairs "
                             f"(no rotation at all is a NoPE layer: pe.nope_layers=global)")
        if self.max_period is not None:
            kept = min(kept, pairs_within(self.max_period, self.inv_freq if base is None else self.inv_freq_at(base)))
        return (torch.arange(n_pairs, device=self.inv_freq.device) < kept).float() if kept < n_pairs else None

    def inv_freq_at(self, base: float) -> Tensor:
        """theta_k = base^(-2k/r) at another ``base``, computed as ``__init__`` does (float64, then float32)."""
        return rotary_frequencies(base, self.rotary_dim).float().to(self.inv_freq.device)

    def angles(self, positions: Tensor, freqs: RopeFrequencies | None = None) -> Tensor:
        """(..., T, rotary_dim/2) float32 angles p * theta_k (with the scaling applied, if set)."""
        if freqs is None:
            freqs = self.frequencies(positions)
        p = positions.float()
        if freqs.position_scale != 1.0:
            p = p * freqs.position_scale
        return p[..., None] * freqs.inv_freq

    def rotate(self, q: Tensor, k: Tensor, q_positions: Tensor, k_positions: Tensor) -> tuple[Tensor, Tensor]:
        span = torch.cat((q_positions, k_positions), dim=-1)
        q_tables = self.rotation_tables(q_positions, span)
        k_tables = self.rotation_tables(k_positions, span)
        return self.apply_rotation(q, k, q_tables._replace(k_cos=k_tables.k_cos, k_sin=k_tables.k_sin))

    def rotation_tables(self, positions: Tensor, span: Tensor, layer: LayerRope | None = None) -> "RotaryTables":
        freqs = self.frequencies(span, layer=layer)  # dynamic NTK: T from the whole span
        cos, sin = self._cos_sin(positions, freqs)
        return RotaryTables(cos, sin, cos, sin)

    def apply_rotation(self, q: Tensor, k: Tensor, tables: "RotaryTables") -> tuple[Tensor, Tensor]:
        tables, half = tables.cast(q.dtype), self.rotary_dim // 2
        if torch.is_grad_enabled() and any(t.requires_grad for t in tables):  # learned frequencies
            return (rotate_half(q, tables.q_cos, tables.q_sin, half),
                    rotate_half(k, tables.k_cos, tables.k_sin, half))
        if tables.shared:
            return _Rotation.apply(q, k, tables.q_cos, tables.q_sin, None, None, half)
        return _Rotation.apply(q, k, *tables, half)

    def _cos_sin(self, positions: Tensor, freqs: RopeFrequencies, scale: Tensor | None = None
                 ) -> tuple[Tensor, Tensor]:
        """Full-width float32 (..., T, head_dim) cos and sin tables (``RotaryTables``), times
        YaRN's attention factor and xPos's decay."""
        angles = self.angles(positions, freqs)
        cos, sin = angles.cos(), angles.sin()
        if freqs.attention_factor != 1.0:  # YaRN: on q and on k, so the logits scale by its square
            scale = freqs.attention_factor if scale is None else scale * freqs.attention_factor
        if scale is not None:  # xPos multiplies both the cos and sin terms
            cos, sin = cos * scale, sin * scale
        return full_width(cos, sin, self.head_dim)

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        curves = super().learned_functions(length)
        if self.log_freq_scale is not None:  # learned theta_k / initial theta_k = exp(alpha_k), per pair
            pairs = torch.arange(self.log_freq_scale.numel()).float()
            curves["frequency factor exp(alpha_k)"] = (pairs, self.log_freq_scale.detach().float().exp()[None].cpu(),
                                                       "pair k (high to low frequency)")
        return curves

    def extra_repr(self) -> str:
        extra = f", scaling={self.scaling}" if self.scaling is not None else ""
        if self.keep is not None:
            extra += f", kept_pairs={self.kept_pairs}/{self.rotary_dim // 2}"
        if self.max_period is not None:
            extra += f", max_period={self.max_period}"
        if self.log_freq_scale is not None:
            extra += ", learnable_freq=True"
        return f"{super().extra_repr()}, base={self.base}, rotary_dim={self.rotary_dim}{extra}"
