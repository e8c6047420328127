"""RoPE + ALiBi: logits are the naive RoPE logits plus the naive ALiBi bias (float64)."""

from __future__ import annotations

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import naive_alibi_bias, naive_rope
from tests.tiny import tiny_config


def test_rope_alibi_logits_are_rope_plus_alibi():
    torch.manual_seed(15)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["rope_alibi"](cfg)
    T = 6
    pos = torch.arange(T) + 7
    q = torch.randn(1, 4, T, 16)
    k = torch.randn(1, 4, T, 16)
    rq, rk = pe.rotate(q, k, pos, pos)
    logits = (rq @ rk.transpose(-1, -2)).double() / 4.0 + pe.bias(pos, pos).double()
    ref_q = naive_rope(q, pos.tolist())
    ref_k = naive_rope(k, pos.tolist())
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    ref = ref_q @ ref_k.transpose(-1, -2) / 4.0 + naive_alibi_bias(slopes, pos.tolist(), pos.tolist())
    lower = torch.tril(torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(logits[..., lower], ref[..., lower], atol=1e-5, rtol=0)


def test_rope_alibi_bias_heads_and_multiplier():
    cfg = tiny_config(n_embd=64, n_head=4)
    pos = torch.arange(9)
    full = SCHEMES["rope_alibi"](cfg).bias(pos, pos)
    torch.testing.assert_close(
        full.double(), naive_alibi_bias([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8], pos, pos)
    )
    two = SCHEMES["rope_alibi"](cfg, bias_heads=2).bias(pos, pos)
    assert two.shape == (4, 9, 9)
    assert torch.all(two[2:] == 0)
    # alibi_slopes(2) = [2^-4, 2^-8]
    torch.testing.assert_close(two[:2].double(), naive_alibi_bias([2.0 ** -4, 2.0 ** -8], pos, pos))
    half = SCHEMES["rope_alibi"](cfg, slope_multiplier=0.5).bias(pos, pos)
    torch.testing.assert_close(half, 0.5 * full, atol=0, rtol=0)
    both = SCHEMES["rope_alibi"](cfg, bias_heads=2, slope_multiplier=0.5).bias(pos, pos)
    torch.testing.assert_close(both, 0.5 * two, atol=0, rtol=0)
    with pytest.raises(ValueError):
        SCHEMES["rope_alibi"](cfg, bias_heads=5)
    with pytest.raises(ValueError):
        SCHEMES["rope_alibi"](cfg, bias_heads=0)


def test_rope_alibi_rotation_is_rope():
    torch.manual_seed(16)
    cfg = tiny_config(n_embd=64, n_head=4)
    pos = torch.tensor([0, 3, 300])
    q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 4, 3, 16)
    a = SCHEMES["rope_alibi"](cfg, base=777.0).rotate(q, k, pos, pos)
    torch.testing.assert_close(a[0].double(), naive_rope(q, pos.tolist(), base=777.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(a[1].double(), naive_rope(k, pos.tolist(), base=777.0), atol=1e-5, rtol=0)
