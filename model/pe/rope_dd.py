"""Data-dependent RoPE: rotary angles accumulated from the tokens, not read from positions.

RoPE turns pair k of a query or key at position t by t * omega_k. Here each layer l advances
its own clock by a learned step of each token (accumulated rotations, Godavarti 2026,
arXiv 2606.24975; Selective RoPE, Movahedi et al. 2025, arXiv 2511.17388):

    Theta_t = sum_{s<=t} omega * phi(x_s),   phi(x) = softplus(W_l x + b_l) > 0,
    logit_ij = q_i^T R(Theta_i - Theta_j) k_j / sqrt(d),

with x the layer's attention input (the normed block input), omega_k = base^(-2k/r) RoPE's
frequencies, and one phi per key/value head and rotary pair (queries of a GQA group share
their key head's angles, so q_i^T R(Theta_i - Theta_j) k_j holds in every group). q is turned
by Theta_i and k by Theta_j with the half-split (rotate_half) pairs of model/pe/rope.py.

With ``step="linear"``, phi(x) = W_l x + b_l is signed: it can turn a token by exactly 0 or
backwards (Selective RoPE's phi is signed too). A softplus step is never 0, so a token meant to
leave the clock alone still moves it a little, and that adds up over a long text.

``rotate_v``: values too are turned, v_j by Theta_j, and the output of query i is turned back
by -Theta_i, so that it reads sum_j a_ij R(Theta_j - Theta_i) v_j: relative as the logits are.
The accumulated-rotations paper reports that rotating values helps; it is off by default
(RoPE's form, which the init reproduces).

Init: W = 0 and phi(b) = 1 (b = 1 for the linear step), so phi = 1 and Theta_t = omega (t + 1):
plain RoPE exactly (a common shift of every position changes no logit) until training moves W, b.

The scheme never reads position values, so it needs no rule for randomized positions, packed
documents or windows: Theta_i - Theta_j sums the steps of the tokens j+1..i alone, and a
document mask hides every pair across documents, so each packed document sees the angles it
would see alone (the accumulation restarts in effect, as FoX's c_i - c_j does). Theta is summed
and its cos/sin taken in float64, then cast to the compute dtype, so the turns keep float32's
absolute accuracy however long the text (a float32 running sum errs by about eps Theta, and
plain RoPE's float32 t * omega by eps t). The steps' gradient comes from the turns' own
derivative (``_Turn``), not from autograd through the cos/sin tables. A KV cache
stores keys (and values) turned and each layer's float64 Theta beside them (model/cache.py; as
many bytes as float32 keys): new tokens continue the newest kept key's Theta.

Where it differs from the papers: the accumulated-rotations paper has no public code. Selective
RoPE's code (timurcarstensen/selective-rope, ``modules/rotary.py``) takes phi as a signed low-rank
projection (rank 16, no bias by default) of the l2-normalised hidden state, passed through a short
causal convolution (width 4), optionally plus a positive bias exp(b) and times a sigmoid gate,
with frequencies base^(-2k/d) at base 500000 and a random init; it turns q and k, not v. Its
state-tracking sweep (``configs/state_tracking/``) adds the bias and sets base 1 (every pair at
frequency 1; ``pe.base`` here must exceed 1). Here phi's input (the layer's normed attention
input), a full-rank step per head and pair, softplus by default, no convolution or gate, and the
RoPE-equal init are this file's choices.
"""

from __future__ import annotations

import math
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.config import GPTConfig
from model.pe.base import PositionEncoding
from model.pe.rope import full_width, rotary_frequencies, rotate_half, swap_halves


def _signed(z: Tensor) -> Tensor:
    """phi of pe.step=linear: the logit itself, so a turn can be 0 or negative (Selective RoPE's)."""
    return z


#: pe.step: phi of the turns and the bias at which phi = 1 (one position per token, RoPE's)
STEPS = {"softplus": (F.softplus, math.log(math.expm1(1.0))), "linear": (_signed, 1.0)}


class _Turn(torch.autograd.Function):
    """x (B, H, T, hd) turned by its tokens' angles theta (B, G, T, pairs), H a multiple of G (query head
    h reads kv head h // group, HF's repeat_kv), from theta's detached tables ``cos``, ``sin`` (B, G, T, hd).
    One node whose backward is the transposed turn for x and, for theta, the derivative of the turn:
    d/dtheta_p of (x_p c - x_p' s, x_p' c + x_p s) = (-out_p', out_p), p' = p + pairs, summed over each
    kv head's query heads. Autograd through the tables would instead form (B, H, T, hd) gradients of
    cos and sin and sum them back through the cat and the head repeat."""

    @staticmethod
    def forward(ctx, x: Tensor, theta: Tensor, cos: Tensor, sin: Tensor, half: int) -> Tensor:
        group = x.shape[1] // cos.shape[1]
        if group > 1:
            cos, sin = cos.repeat_interleave(group, dim=1), sin.repeat_interleave(group, dim=1)
        out = rotate_half(x.contiguous(), cos, sin, half)
        ctx.save_for_backward(cos, sin, out)
        ctx.half, ctx.group, ctx.theta_dtype = half, group, theta.dtype
        return out

    @staticmethod
    def backward(ctx, d_out: Tensor):
        cos, sin, out = ctx.saved_tensors
        half = ctx.half
        d_x = swap_halves(d_out * sin, half).add_(d_out * cos)
        d_theta = d_out[..., half:2 * half] * out[..., :half] - d_out[..., :half] * out[..., half:2 * half]
        if ctx.group > 1:
            d_theta = d_theta.unflatten(1, (-1, ctx.group)).sum(2)
        return d_x, d_theta.to(ctx.theta_dtype), None, None, None


class DataDependentRoPE(PositionEncoding, name="rope_dd"):
    terms: ClassVar[str | None] = "rotation"

    def __init__(self, config: GPTConfig, base: float = 10000.0, rotate_v: bool = False,
                 step: str = "softplus") -> None:
        super().__init__(config)
        if isinstance(base, bool) or not isinstance(base, (int, float)) or not base > 1.0:
            raise ValueError(f"pe.base must be a number > 1 (omega_k = base^(-2k/d)), got {base!r}")
        if not isinstance(rotate_v, bool):
            raise ValueError(f"pe.rotate_v must be true or false (turn the values and the output too), "
                             f"got {rotate_v!r}")
        if step not in STEPS:
            raise ValueError(f"pe.step must be one of {', '.join(STEPS)} (phi of the turns: positive or signed), "
                             f"got {step!r}")
        self.base, self.rotate_v, self.step = float(base), rotate_v, step
        self.phi, unit_bias = STEPS[step]
        self.kv_heads, self.rotary_dim = config.kv_heads, config.head_dim // 2 * 2
        self.pairs = self.rotary_dim // 2
        self.register_buffer("inv_freq", rotary_frequencies(self.base, self.rotary_dim).float(), persistent=False)
        # phi of each layer: one step per key/value head and rotary pair
        self.steps = nn.ModuleList(nn.Linear(config.n_embd, self.kv_heads * self.pairs) for _ in range(config.n_layer))
        for step in self.steps:
            nn.init.zeros_(step.weight)
            nn.init.constant_(step.bias, unit_bias)

    def layer_terms(self, x: Tensor, layer: int, start: Tensor | None = None) -> Tensor:
        """Theta (B, kv heads, pairs, T) float64 of layer ``layer``'s input x (B, T, C),
        continuing ``start`` (B, kv heads, pairs, 1), the Theta of the token before x (a KV cache), if given.
        Tokens last: the cache keeps and evicts them as FoX's c."""
        if not 0 <= layer < len(self.steps):
            raise ValueError(f"pe=rope_dd has steps for layers 0..{len(self.steps) - 1}, got layer {layer}")
        B, T, _ = x.shape
        with torch.autocast(x.device.type, enabled=False):  # the steps in float32 (or float64), never bf16
            step = self.steps[layer]
            # W x^T + b: (B, kv heads * pairs, T), row g * pairs + p, tokens last: the running sum runs along
            # contiguous memory (slower along a strided dim on CPU, docs/benchmark.md), and the Linear's
            # output is never transposed (a compiled backward's view of a transposed gradient fails)
            logit = torch.baddbmm(step.bias[:, None], step.weight.expand(B, -1, -1), x.to(step.weight.dtype).mT)
            logit = logit.to(torch.promote_types(step.weight.dtype, torch.float32))
        turns = self.phi(logit) * self.inv_freq.to(logit.dtype).repeat(self.kv_heads)[:, None]
        theta = torch.cumsum(turns.double(), dim=-1).view(B, self.kv_heads, self.pairs, T)
        return theta if start is None else theta + start

    def rotate_layer(self, q: Tensor, k: Tensor, v: Tensor, angles: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q (B, H, T, hd), k and v (B, kv heads, T, hd) turned by their tokens' ``angles``; v only with rotate_v."""
        theta, cos, sin = self._tables(angles, q.dtype)
        turned = [_Turn.apply(t, theta, cos, sin, self.pairs) for t in ((q, k, v) if self.rotate_v else (q, k))]
        return turned[0], turned[1], turned[2] if self.rotate_v else v

    def unrotate_output(self, y: Tensor, angles: Tensor) -> Tensor:
        """y (B, H or kv heads, T, hd) turned back by -Theta of its tokens with rotate_v; else y."""
        if not self.rotate_v:
            return y
        theta, cos, sin = self._tables(angles, y.dtype)
        return _Turn.apply(y, -theta, cos, -sin, self.pairs)

    def _tables(self, angles: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
        """theta (B, kv heads, T, pairs) float64, and its full-width cos = (c, c, 1..) and sin = (-s, s, 0..)
        (rope.py's layout) in ``dtype``."""
        theta = angles.transpose(-1, -2)
        with torch.no_grad():  # the tables carry no gradient: _Turn gives the angles theirs
            cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)  # of the float64 sum: exact however large
            return (theta, *full_width(cos, sin, self.head_dim))

    def decayed_parameters(self) -> list[nn.Parameter]:
        return [step.weight for step in self.steps]  # decay pulls phi back towards RoPE's constant step

    @torch.no_grad()
    def learned_functions(self, length: int) -> dict[str, tuple[Tensor, Tensor, str]]:
        unit = torch.stack([self.phi(step.bias.float()).view(self.kv_heads, self.pairs).mean(0).cpu()
                            for step in self.steps])  # (layers, pairs)
        return {f"step {self.step}(b) by pair, per layer": (torch.arange(self.pairs).float(), unit,
                                                       "pair k (high to low frequency)")}

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, base={self.base}, rotate_v={self.rotate_v}, step={self.step}, "
                f"steps=(kv heads x pairs)")
