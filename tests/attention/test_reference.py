"""The attention layer with each scheme variant (SDPA, float32 mask) against the float64 reference
of tests/naive.py: q, k, v from the raw weights, each scheme's definition, never ``pe.rotate``/``pe.bias``."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention.masks import attention_mask
from tests.position_context import position_context
from tests.naive import SLOPES_4, VARIANT_IDS, VARIANTS, naive_attention, naive_bias, naive_spec
from tests.tiny import build


# Positions as the model sees them: from 0, offset (sliding windows, caches), and reset and
# repeated (packed documents). Causality is token order whatever the positions say.
POSITIONS = {
    "from0": list(range(9)),
    "offset37": list(range(37, 46)),
    "reset": [0, 1, 2, 3, 4, 0, 1, 2, 3],
    "repeat": [5, 5, 5, 2, 2, 7, 0, 0, 9],
}


@pytest.mark.parametrize("name, opts", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("pos", list(POSITIONS), ids=list(POSITIONS))
def test_attention_fp32_matches_naive(name, opts, pos):
    cfg, model, attn = build(name, opts)
    T = 9
    x = torch.randn(2, T, cfg.n_embd)
    positions = torch.tensor(POSITIONS[pos])
    mask = attention_mask(model.pe, positions, positions, torch.float32)
    if model.pe.uses_bias:
        assert mask.shape == (1, cfg.n_head, T, T) and mask.dtype == torch.float32
    else:
        assert mask is None
    with torch.no_grad():
        y = attn(x, position_context(model.pe, positions, mask))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, opts", VARIANTS, ids=VARIANT_IDS)
def test_attention_bf16_autocast_matches_naive(name, opts):
    cfg, model, attn = build(name, opts, seed=1)
    T = 9
    x = torch.randn(2, T, cfg.n_embd)
    positions = torch.arange(T) + 300  # above 256: not representable in bf16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = model._compute_dtype(x.device)
        assert dtype == torch.bfloat16
        mask = attention_mask(model.pe, positions, positions, dtype)
        if mask is not None:
            assert mask.dtype == torch.bfloat16
        y = attn(x, position_context(model.pe, positions, mask))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-2 * scale, f"bf16 error {err:.3g} vs scale {scale:.3g}"


def test_attention_with_linear_biases_matches_naive():
    name, opts = "rope_alibi", {}
    cfg, model, attn = build(name, opts, seed=2, bias=True)
    assert attn.c_attn.bias is not None
    T = 7
    x = torch.randn(3, T, cfg.n_embd)
    positions = torch.arange(T) + 5
    with torch.no_grad():
        y = attn(x, position_context(model.pe, positions, attention_mask(model.pe, positions, positions, torch.float32)))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "rope_alibi"])
def test_attention_mask_matches_naive(name):
    cfg, model, _ = build(name, {})
    positions = torch.arange(6) + 11
    mask = attention_mask(model.pe, positions, positions, torch.float32)
    ref = naive_bias(SLOPES_4, positions.tolist())
    assert mask.shape == (1, 4, 6, 6)
    for i in range(6):
        for j in range(6):
            if j > i:
                assert torch.all(mask[0, :, i, j] == -math.inf)
            else:
                torch.testing.assert_close(mask[0, :, i, j].double(), ref[:, i, j], atol=1e-6, rtol=0)
