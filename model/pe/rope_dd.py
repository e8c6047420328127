"""Data-dependent RoPE: rotary angles accumulated from the tokens, not read from positions.

RoPE turns pair k of a query or key at position t by t * omega_k. Here each layer l advances
its own clock by a positive, learned step of each token (accumulated rotations, Godavarti 2026,
arXiv 2606.24975; Selective RoPE, Movahedi et al. 2025, arXiv 2511.17388):

    Theta_t = sum_{s<=t} omega * phi(x_s),   phi(x) = softplus(W_l x + b_l) > 0,
    logit_ij = q_i^T R(Theta_i - Theta_j) k_j / sqrt(d),

with x the layer's attention input (the normed block input), omega_k = base^(-2k/r) RoPE's
frequencies, and one phi per key/value head and rotary pair (queries of a GQA group share
their key head's angles, so q_i^T R(Theta_i - Theta_j) k_j holds in every group). q is turned
by Theta_i and k by Theta_j with the half-split (rotate_half) pairs of model/pe/rope.py.

``rotate_v``: values too are turned, v_j by Theta_j, and the output of query i is turned back
by -Theta_i, so that it reads sum_j a_ij R(Theta_j - Theta_i) v_j: relative as the logits are.
The accumulated-rotations paper reports that rotating values helps; it is off by default, the
form Selective RoPE and RoPE have.

Init: W = 0 and softplus(b) = 1, so phi = 1 and Theta_t = omega (t + 1): plain RoPE exactly
(a common shift of every position changes no logit) until training moves W and b.

The scheme never reads position values, so it needs no rule for randomized positions, packed
documents or windows: Theta_i - Theta_j sums the steps of the tokens j+1..i alone, and a
document mask hides every pair across documents, so each packed document sees the angles it
would see alone (the accumulation restarts in effect, as FoX's c_i - c_j does). Theta is summed
in float64 and reduced modulo 2 pi before the float32 cos/sin, so the angles keep float32's
absolute accuracy however long the text (plain float32 t * omega errs by eps t). A KV cache
stores keys (and values) turned and each layer's Theta beside them (model/cache.py): new
tokens continue the newest kept key's Theta.

Where it differs from the papers: there is no public code; phi's input (the attention input),
its softplus, one step per head and pair and the RoPE-equal init are this file's choices.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding
from model.pe.rope import rotate_half

UNIT_STEP = math.log(math.expm1(1.0))  # softplus(b) = 1: one position per token, RoPE's


class DataDependentRoPE(PositionEncoding, name="rope_dd"):
    terms: ClassVar[str | None] = "rotation"

    def __init__(self, config: GPTConfig, base: float = 10000.0, rotate_v: bool = False) -> None:
        super().__init__(config)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
            raise ValueError(f"pe.base must be a number > 1 (omega_k = base^(-2k/d)), got {base!r}")
        if not isinstance(rotate_v, bool):
            raise ValueError(f"pe.rotate_v must be true or false (turn the values and the output too), "
                             f"got {rotate_v!r}")
        self.base, self.rotate_v = float(base), rotate_v
        self.kv_heads, self.rotary_dim = config.kv_heads, config.head_dim // 2 * 2
        self.pairs = self.rotary_dim // 2
        k2 = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64)
        self.register_buffer("inv_freq", (self.base ** (-k2 / self.rotary_dim)).float(), persistent=False)
        # phi of each layer: one step per key/value head and rotary pair
        self.steps = nn.ModuleList(nn.Linear(config.n_embd, self.kv_heads * self.pairs) for _ in range(config.n_layer))
        for step in self.steps:
            nn.init.zeros_(step.weight)
            nn.init.constant_(step.bias, UNIT_STEP)

    def layer_terms(self, x: Tensor, layer: int, start: Tensor | None = None) -> Tensor:
        """Theta (B, kv heads, pairs, T) float64 in [0, 2 pi) of layer ``layer``'s input x (B, T, C),
        continuing ``start`` (B, kv heads, pairs, 1), the Theta of the token before x (a KV cache), if given.
        Tokens last: the cache keeps and evicts them as FoX's c."""
        if not 0 <= layer < len(self.steps):
            raise ValueError(f"pe=rope_dd has steps for layers 0..{len(self.steps) - 1}, got layer {layer}")
        B, T, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):  # the steps in float32 (or float64), never bf16
            step = self.steps[layer]
            logit = step(x.to(step.weight.dtype)).to(torch.promote_types(step.weight.dtype, torch.float32))
        turns = F.softplus(logit).unflatten(-1, (self.kv_heads, self.pairs)) * self.inv_freq.to(logit.dtype)
        theta = torch.cumsum(turns.double(), dim=1).permute(0, 2, 3, 1)  # (B, T, G, P) summed over T, tokens last
        if start is not None:
            theta = theta + start
        return torch.remainder(theta, 2 * math.pi)  # exact in float64: cos/sin see the same angle

    def rotate_layer(self, q: Tensor, k: Tensor, v: Tensor, angles: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, hd), k and v (B, kv heads, T, hd) turned by their tokens' ``angles``; v only with rotate_v."""
        cos, sin = self._tables(angles, q.dtype)
        half = self.pairs
        k_out = rotate_half(k, cos, sin, half)
        v_out = rotate_half(v, cos, sin, half) if self.rotate_v else v
        cos, sin = self._per_head(cos, q), self._per_head(sin, q)
        return rotate_half(q, cos, sin, half), k_out, v_out

    def unrotate_output(self, y: Tensor, angles: Tensor) -> Tensor:
        """y (B, H or kv heads, T, hd) turned back by -Theta of its tokens with rotate_v; else y."""
        if not self.rotate_v:
            return y
        cos, sin = self._tables(angles, y.dtype)
        return rotate_half(y, self._per_head(cos, y), -self._per_head(sin, y), self.pairs)

    def _tables(self, angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """Full-width (B, kv heads, T, hd) cos = (c, c, 1..) and sin = (-s, s, 0..) (rope.py's layout)."""
        theta = angles.transpose(-1, -2)  # float32 in [0, 2 pi) (float64 for float64 compute): the sum is reduced
        theta = theta if dtype == torch.float64 else theta.float()
        cos, sin = theta.cos(), theta.sin()
        rest = cos.new_ones(()).expand(*cos.shape[:-1], self.head_dim - self.rotary_dim)
        return torch.cat((cos, cos, rest), dim=-1).to(dtype), torch.cat((-sin, sin, rest * 0), dim=-1).to(dtype)

    @staticmethod
    def _per_head(table: Tensor, t: Tensor) -> Tensor:
        """A kv-head table for ``t``'s heads: query head h reads kv head h // group (HF's repeat_kv)."""
        group = t.shape[1] // table.shape[1]
        return table if group == 1 else table.repeat_interleave(group, dim=1)

    def decayed_parameters(self) -> list[nn.Parameter]:
        return [step.weight for step in self.steps]  # decay pulls phi back towards RoPE's constant step

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        unit = torch.stack([F.softplus(step.bias.float()).view(self.kv_heads, self.pairs).mean(0).cpu()
                            for step in self.steps])  # (layers, pairs)
        return {"step softplus(b) by pair, per layer": (torch.arange(self.pairs).float(), unit,
                                                       "pair k (high to low frequency)")}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, base={self.base}, rotate_v={self.rotate_v}, steps=(kv heads x pairs)"
