"""The sinusoidal embedding against the formula in float64 (``math.sin``/``math.cos``) and hand values."""

from __future__ import annotations

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import naive_sinusoidal
from tests.tiny import tiny_config


def test_sinusoidal_matches_formula():
    cfg = tiny_config(n_embd=32, n_head=4)
    pe = SCHEMES["sinusoidal"](cfg, scale=1.0)  # the formula as printed
    positions = [0, 1, 7, 100, 511, 3000]
    out = pe.embed(torch.zeros(1, len(positions), 32), torch.tensor(positions))
    assert out.dtype == torch.float32
    for t, p in enumerate(positions):
        ref = naive_sinusoidal([p], 32)[0]
        # float32 angles at p=3000 carry ~3e-4 rounding
        tol = 1e-6 if p < 10 else 1e-3
        torch.testing.assert_close(out[0, t].double(), ref, atol=tol, rtol=0)
    # a few hand-computed values: PE(1,0)=sin(1), PE(1,1)=cos(1), PE(0, odd)=1
    assert out[0, 1, 0].item() == pytest.approx(0.8414709848, abs=1e-6)
    assert out[0, 1, 1].item() == pytest.approx(0.5403023059, abs=1e-6)
    assert torch.all(out[0, 0, 1::2] == 1) and torch.all(out[0, 0, 0::2] == 0)


def test_sinusoidal_is_added_and_has_no_parameters():
    torch.manual_seed(5)
    cfg = tiny_config()
    pe = SCHEMES["sinusoidal"](cfg, scale=1.0)
    assert sum(p.numel() for p in pe.parameters()) == 0
    x = torch.randn(3, 4, cfg.n_embd)
    pos = torch.tensor([2, 9, 4, 0])
    out = pe.embed(x, pos)
    for t, p in enumerate(pos.tolist()):
        ref = naive_sinusoidal([p], cfg.n_embd)[0].float()
        torch.testing.assert_close(out[:, t], x[:, t] + ref, atol=1e-5, rtol=0)


def test_sinusoidal_scale_null_is_inverse_sqrt_d_model():
    """scale=None multiplies the exact formula by 1/sqrt(d_model); scale=1.0 is the formula."""
    import math

    from model.config import GPTConfig
    from model.pe import SinusoidalPositionEmbedding

    config = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=16)
    x = torch.zeros(1, 3, 16)
    positions = torch.tensor([0, 5, 700])
    exact = SinusoidalPositionEmbedding(config, scale=1.0).embed(x, positions)
    scaled = SinusoidalPositionEmbedding(config, scale=None).embed(x, positions)
    torch.testing.assert_close(scaled, exact / 4.0)  # 1/sqrt(16)
    assert exact[0, 2, 0].item() == pytest.approx(math.sin(700.0), abs=1e-5)
    with pytest.raises(ValueError, match="pe.scale"):
        SinusoidalPositionEmbedding(config, scale=0.0)


def test_sinusoidal_default_is_the_scaled_sinusoid():
    """Built without options (as scripts/bench.py does) the sinusoid has amplitude 1/sqrt(d_model)."""
    from model.config import GPTConfig
    from model.pe import SinusoidalPositionEmbedding

    config = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=64)
    out = SinusoidalPositionEmbedding(config).embed(torch.zeros(1, 1, 64), torch.tensor([0]))
    assert out[0, 0, 1].item() == pytest.approx(1 / 8)  # cos(0) / sqrt(64)
