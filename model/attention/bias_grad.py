"""``bias_grad``: attention with a learned bias on CPU, with the bias gradient SDPA lacks.

A scheme whose bias has parameters (T5 buckets, KERPLE, FIRE) needs the gradient of the loss
with respect to every (head, i, j) logit. SDPA's CPU flash kernel gives none, so a mask that
requires grad sends SDPA to its float32 math path, which materialises (B, H, T, T) float32
tensors both ways. Here the forward is the flash kernel with the float32 mask, and the
backward is the softmax-attention gradient in tiles of query rows, small enough to stay in
cache; a tile stops at its last row's last visible key (later keys are exactly zero):

    P  = softmax(scale q k^T + mask)           (recomputed in float32, not stored)
    dP = dO V^T                                (float32)
    dS = P * (dP - rowsum(P * dP))             (torch's fused softmax backward)
    dV = P^T dO,   dQ = scale dS K,   dK = scale dS^T Q
    dmask = dS, summed over the batch rows the mask was broadcast over

The bias gradient is as exact as SDPA's float32 math path: P is normalised by its own row
sums, so every row of dS sums to zero to float32 rounding (FIRE's threshold shifts whole rows
and needs that). dQ, dK, dV run in the compute dtype, as in the flash kernel's backward.
Forward and backward are ``torch.library`` custom ops, opaque to ``torch.compile``: a compiled
graph calls these same eager kernels (traced, the tiles would unroll into every layer).
Measurements: docs/benchmark.md.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch import Tensor

from model.attention.base import Terms
from model.attention.request import AttentionRequest
from model.attention.sdpa import SDPA, KernelCall, default_scale, mask_dtype

# float32 elements of one tile's (b, H, QUERY_TILE, Tk) tensors: 2 MiB, about one core's L2.
BLOCK_ELEMENTS = 1 << 19
# query rows per tile of the float32 part of the backward
QUERY_TILE = 64


@torch.library.custom_op("pelab::attention_with_bias_grad", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor, scale: float) -> Tensor:
    # bias only receives the gradient: mask is what the softmax adds (see attention_with_bias_grad)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)
    return out


@_attention.register_fake
def _(q, k, v, mask, bias, scale):
    # the flash kernel's own meta function, so that the strides a compiled graph assumes are its
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, False, attn_mask=mask, scale=scale)[0]


@torch.library.custom_op("pelab::attention_with_bias_grad_backward", mutates_args=())
def _attention_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    # autocast off: a compiled graph may run the backward under the forward's autocast, which
    # would turn the float32 matmuls below into bf16 ones
    with torch.autocast(d_out.device.type, enabled=False):
        return _backward(d_out, q, k, v, mask, bias, scale)


@_attention_backward.register_fake
def _(d_out, q, k, v, mask, bias, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), bias.new_empty(bias.shape)


def _backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, bias: Tensor,
              scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dtype, tile = q.dtype, QUERY_TILE
    acc = torch.promote_types(dtype, torch.float32)  # float32, or float64 for float64 inputs
    d_out = d_out.to(dtype)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_bias = torch.zeros(bias.shape, dtype=acc, device=bias.device)
    B, H, Tq, Tk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    step = max(1, BLOCK_ELEMENTS // (H * min(tile, Tq) * Tk))
    shared = mask.shape[0] == 1  # one mask for every sequence
    summed = bias.shape[0] == 1  # one bias for every sequence: its gradient sums over the batch
    tiled = tile < Tq
    p_c = ds_c = None  # compute-dtype P and dS of a block; keys after each tile stay zero
    for b in range(0, B, step):
        rows = slice(b, b + step)
        qb, kb, vb, gb = q[rows], k[rows], v[rows], d_out[rows]
        if tiled and (p_c is None or p_c.shape[0] != qb.shape[0]):
            p_c = q.new_zeros(qb.shape[0], H, Tq, Tk)
            ds_c = torch.zeros_like(p_c)
        # contiguous: q, k, v arrive as (B, T, H, hd) views, whose per-tile slices matmul would copy
        qf, kf, vf, gf = (t.to(acc, memory_format=torch.contiguous_format) for t in (qb, kb, vb, gb))
        for s in range(0, Tq, tile):
            e = min(s + tile, Tq)
            seen = e + Tk - Tq  # the queries are the last Tq keys: row e - 1 sees keys [0, seen)
            tile_mask = mask[..., s:e, :seen] if shared else mask[rows, :, s:e, :seen]
            scores = torch.matmul(qf[:, :, s:e], kf[:, :, :seen].transpose(-2, -1))
            p = torch.softmax(torch.add(tile_mask, scores, alpha=scale), dim=-1)
            dp = torch.matmul(gf[:, :, s:e], vf[:, :, :seen].transpose(-2, -1))
            ds = torch._softmax_backward_data(dp, p, -1, acc)
            if summed:
                d_bias[..., s:e, :seen] += ds.sum(0, keepdim=True)
            else:
                d_bias[rows, :, s:e, :seen] = ds
            if tiled:
                p_c[:, :, s:e, :seen] = p
                ds_c[:, :, s:e, :seen] = ds
            else:
                p_c, ds_c = p.to(dtype), ds.to(dtype)
        dv[rows] = torch.matmul(p_c.transpose(-2, -1), gb)
        dq[rows] = torch.matmul(ds_c, kb).mul_(scale)
        dk[rows] = torch.matmul(ds_c.transpose(-2, -1), qb).mul_(scale)
    return dq, dk, dv, d_bias.to(bias.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, mask, bias, scale = inputs
    ctx.save_for_backward(q, k, v, mask, bias)
    ctx.scale = scale


def _grad(ctx, d_out):
    q, k, v, mask, bias = ctx.saved_tensors
    dq, dk, dv, d_bias = _attention_backward(d_out, q, k, v, mask, bias, ctx.scale)
    return dq, dk, dv, None, d_bias, None


_attention.register_autograd(_grad, setup_context=_setup_context)


def attention_with_bias_grad(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scale: float,
                             bias: Tensor | None = None) -> Tensor:
    """softmax(scale q k^T + mask) v for (B, H, Tq, hd) q, k, v and a (1 or B, H, Tq, Tk)
    float mask (bias plus -inf on hidden keys; every query sees at least one key), with
    gradients for q, k, v and the mask. Causal: the queries are the last Tq of the Tk keys
    and the mask hides every key after its query (the backward never looks at those).

    ``bias`` (1, H, Tq, Tk), when given, takes the mask's gradient instead: the mask is then
    ``bias`` with more keys hidden per sequence (packed documents), and the gradient, zero on
    every hidden key, is summed over the batch inside the tiles (no (B, H, Tq, Tk) gradient)."""
    return _attention(q, k, v, mask.detach(), mask if bias is None else bias, scale)


class BiasGrad(SDPA):
    """The state is SDPA's float32 mask; layers whose mask needs no gradient run SDPA."""

    name = "bias_grad"
    fallback = ("sdpa", "flex", "math")
    dropout = False
    grad_route = None

    def refusal(self, request: AttentionRequest) -> str | None:
        pe = request.pe
        if request.device.type != "cpu":  # CUDA's SDPA kernels take the bias gradient themselves
            return f"model.attention={self.name} runs on CPU only"
        if not (request.grad and pe.uses_bias and any(p.requires_grad for p in pe.parameters())):
            return f"model.attention={self.name} serves a learned bias under autograd, not pe={pe.name} here"
        return super().refusal(request)

    def prepare(self, terms: Terms, chunked: bool = False) -> Tensor | tuple[Tensor, Tensor] | None:
        """SDPA's mask; under a document mask a bias at positions shared by every sequence (one
        (1, H, Tq, Tk) tensor: plain positions, or any positions for a bias of the distance alone)
        comes as (that bias with the other documents hidden, the bias): its gradient is then
        summed over the batch in the backward's tiles."""
        q_positions, k_positions = terms.bias_positions()
        if chunked or not (terms.documents and terms.with_bias) or q_positions.dim() > 1:
            return super().prepare(terms, chunked)
        shared = replace(terms, q_positions=q_positions, k_positions=k_positions, q_documents=None, k_documents=None)
        bias = shared.mask()
        return bias.detach().masked_fill(terms.hidden(), float("-inf")), bias

    def kernel_call(self, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float) -> KernelCall:
        """SDPA's call, or with a mask whose bias needs its gradient the tiled kernel's: the mask in
        float32 (float64 for float64 q) and ``bias``, what takes the gradient. Its causal rule (queries
        the last Tq keys) holds for a key added first, whose column of ``bias`` gets its gradient."""
        mask, bias = state if isinstance(state, tuple) else (state, state)  # bias: what takes the gradient
        if mask is None or not bias.requires_grad or dropout or not torch.is_grad_enabled():
            return super().kernel_call(q, k, v, mask, dropout)
        mask = mask_dtype(mask, v.dtype)  # float64 for float64 q; the gradient goes back to float32
        return KernelCall(q.to(v.dtype), k.to(v.dtype), v, mask, False, 0.0, default_scale(q), bias.to(mask.dtype))

    def run(self, call: KernelCall) -> Tensor:
        if call.bias is None:
            return super().run(call)
        with torch.autocast(call.v.device.type, enabled=False):
            return attention_with_bias_grad(call.q, call.k, call.v, call.mask, call.scale, bias=call.bias)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float) -> Tensor:
        return self.run(self.kernel_call(q, k, v, state, dropout))[..., :v.shape[-1]]
