"""Position terms keep float32 accuracy at distances past 4096 under bf16 autocast, on every
backend, against a float64 softmax of the same q, k, v."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.attention import BACKENDS as BACKEND_REGISTRY
from model.attention import attend
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from tests.tiny import contexts

BACKENDS = sorted(BACKEND_REGISTRY)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_position_terms_keep_float32_accuracy_at_long_distance(backend, dtype):
    """ALiBi at T = 4608: the last 48 queries against all 4608 keys (the cache/chunk form of
    the model's contexts) equal float64 softmax(q k^T/sqrt(d) - m (i - j)) v computed from
    the same q, k, v. Tolerance: bf16 compute (autocast) 2^-8 (|y| + sum_j p_j |v_j|), the
    rounding of the bf16 probabilities and output of a fused kernel; float32 compute 1e-5 of
    that. The old path, the mask cast to bf16 (a bias of -16 in steps of 0.125), fails both:
    v's first channel follows the sign of that rounding along the last query's row."""
    torch.manual_seed(11)
    H, hd, T, Tq = 2, 8, 4608, 48
    cfg = GPTConfig(vocab_size=11, block_size=T, n_layer=1, n_head=H, n_embd=H * hd, attention=backend)
    model = GPT(cfg, SCHEMES["alibi"](cfg))
    slopes = [2.0 ** -4, 2.0 ** -8]  # 2 heads: 2^(-8h/2); the flat one reaches -18 at distance 4607
    positions = torch.arange(T)
    i, j = positions[-Tq:, None].double(), positions[None, :].double()
    bias = torch.stack([-m * (i - j) for m in slopes])[None]  # (1, H, Tq, T) float64
    q = (torch.randn(1, H, Tq, hd) * 0.5 + 1.0).to(dtype)
    k = torch.randn(1, H, T, hd) * 0.5
    k[:, :, :512] += 6.0  # the first 512 keys (distances 4048..4607) match every query: q.k/sqrt(8) ~ 17
    k = k.to(dtype)  # so the flat head's mass sits where its bias is -16..-18 (bf16 steps of 0.125)
    v = torch.randn(1, H, T, hd)
    v[..., 0] = torch.sign(bias.bfloat16().double() - bias)[:, :, -1].float() + 0.5
    v = v.to(dtype)
    # a forward (flex has no CPU backward: its refusal under autograd)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ctx = contexts(model, positions[-Tq:], positions, dtype=dtype, always_mask=True)[0]
        assert ctx.backend.name == ("sdpa" if backend == "bias_grad" else backend)  # alibi: no learned bias
        y = attend(q, k, v, ctx)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(hd) + bias
    probs = torch.softmax(scores.masked_fill(j > i, -math.inf), -1)
    ref = probs @ v.double()
    tol = (2.0 ** -8 if dtype == torch.bfloat16 else 1e-5) * (ref.abs() + probs @ v.double().abs())
    err = (y.double() - ref).abs()
    assert y.dtype == dtype and (err <= tol).all(), f"max error {err.max():.3g}, {(err / tol).max():.3g}x the tolerance"
    if backend == "sdpa":  # the old behaviour: the same mask cast to bf16 fails this test
        assert ctx.state.dtype == torch.float32
        old = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.state.bfloat16().to(dtype))
        old_err = (old.double() - ref).abs()
        assert (old_err > tol).any(), f"bf16 mask: max error {old_err.max():.3g}, within tolerance"
        assert (old_err / tol).max() > 3 * (err / tol).max(), "not a clear margin"
