"""LongRoPE (``pe.scaling.kind=longrope``) against a float64 transcription of Hugging Face's
``_compute_longrope_parameters`` and its per-call update: theta_k / e_k with the short factors
while max position + 1 <= L, the long ones past it; cos and sin times sqrt(1 + ln s / ln L)."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from model.pe.rope_scaling import RopeScaling
from tests import tiny
from tests.pe.test_rope_scaling import naive_rotate


def hf_longrope(d, base, ext):
    """inv_freq = 1 / (ext * base ** (arange(0, d, 2) / d)), transcribed in float64."""
    return [1.0 / (ext[k] * base ** ((2 * k) / d)) for k in range(d // 2)]


def hf_attention_factor(s, L):
    return 1.0 if s <= 1.0 else math.sqrt(1 + math.log(s) / math.log(L))


def factors(n, seed):
    g = torch.Generator().manual_seed(seed)
    return (1 + 3 * torch.rand(n, generator=g, dtype=torch.float64)).tolist()


@pytest.mark.parametrize("d, base, s, L", [(16, 10000.0, 4.0, 32), (32, 500000.0, 8.0, 128), (64, 10000.0, 2.0, 64)])
def test_rotation_equals_the_reference_either_side_of_L(d, base, s, L):
    short, long = factors(d // 2, 1), factors(d // 2, 2)
    pe = SCHEMES["rope"](tiny.tiny_config(n_embd=4 * d), base=base)
    pe.scale(RopeScaling("longrope", s, L, short_factor=short, long_factor=long))
    x = torch.randn(d, generator=torch.Generator().manual_seed(3))
    m = hf_attention_factor(s, L)
    for positions, ext in (([0, 1, 5, L - 1], short), ([0, 3, L, 2 * L + 1], long)):  # T = max + 1
        q = x.reshape(1, 1, 1, -1).expand(1, 1, len(positions), -1).contiguous()
        pos = torch.tensor(positions)
        rq, _ = pe.rotate(q, q.clone(), pos, pos)
        for t, p in enumerate(positions):
            ref = naive_rotate(x, p, hf_longrope(d, base, ext), factor=m)
            torch.testing.assert_close(rq[0, 0, t].double(), ref, atol=2e-5, rtol=0)


def test_attention_factor_literal_and_override():
    s, L = 8.0, 4096
    assert hf_attention_factor(s, L) == pytest.approx(math.sqrt(1 + math.log(8) / math.log(4096)))  # 1.1180
    pe = SCHEMES["rope"](tiny.tiny_config())  # head dim 8: 4 pairs
    pe.scale(RopeScaling("longrope", s, L, short_factor=[1.0] * 4, long_factor=[2.0] * 4))
    assert pe.frequencies(torch.tensor([0])).attention_factor == pytest.approx(1.1180339887, abs=1e-9)
    pe = SCHEMES["rope"](tiny.tiny_config())
    pe.scale(RopeScaling("longrope", s, L, short_factor=[1.0] * 4, long_factor=[2.0] * 4, attention_factor=1.5))
    assert pe.frequencies(torch.tensor([0])).attention_factor == 1.5


@pytest.mark.parametrize("short, long", [([1.0] * 3, [1.0] * 4), ([1.0] * 4, [1.0] * 5), ([1.0] * 8, [1.0] * 8)])
def test_lists_of_the_wrong_length_are_refused(short, long):
    pe = SCHEMES["rope"](tiny.tiny_config())  # head dim 8: 4 rotary pairs
    with pytest.raises(ValueError, match="must be lists of 4 factors"):
        pe.scale(RopeScaling("longrope", 4.0, 16, short_factor=short, long_factor=long))


def test_lists_are_required_and_positive():
    with pytest.raises(ValueError, match="needs short_factor and long_factor"):
        RopeScaling("longrope", 4.0, 16, short_factor=[1.0])
    with pytest.raises(ValueError, match="finite numbers > 0"):
        RopeScaling("longrope", 4.0, 16, short_factor=[1.0, 0.0], long_factor=[1.0, 1.0])
