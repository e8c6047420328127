"""ALiBi: slopes against the paper's values, the bias against a naive float64 loop."""

from __future__ import annotations

import pytest
import torch

from model.pe import SCHEMES, alibi_slopes
from tests.naive import naive_alibi_bias
from tests.tiny import tiny_config


def test_alibi_slopes_powers_of_two():
    expected8 = [2.0 ** -i for i in range(1, 9)]
    torch.testing.assert_close(alibi_slopes(8).double(), torch.tensor(expected8, dtype=torch.float64))
    expected4 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
    torch.testing.assert_close(alibi_slopes(4).double(), torch.tensor(expected4, dtype=torch.float64))
    assert alibi_slopes(1).tolist() == [2.0 ** -8]
    expected16 = [2.0 ** (-0.5 * i) for i in range(1, 17)]
    torch.testing.assert_close(alibi_slopes(16).double(), torch.tensor(expected16, dtype=torch.float64))


def test_alibi_slopes_non_powers_of_two():
    expected12 = [2.0 ** -i for i in range(1, 9)] + [2.0 ** -0.5, 2.0 ** -1.5, 2.0 ** -2.5, 2.0 ** -3.5]
    got12 = alibi_slopes(12)
    assert got12.dtype == torch.float32 and got12.shape == (12,)
    torch.testing.assert_close(got12.double(), torch.tensor(expected12, dtype=torch.float64))
    expected6 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    torch.testing.assert_close(alibi_slopes(6).double(), torch.tensor(expected6, dtype=torch.float64))
    expected3 = [2.0 ** -4, 2.0 ** -8, 2.0 ** -2]
    torch.testing.assert_close(alibi_slopes(3).double(), torch.tensor(expected3, dtype=torch.float64))
    with pytest.raises(ValueError):
        alibi_slopes(0)


def test_alibi_bias_matches_naive():
    cfg = tiny_config(n_embd=48, n_head=6)
    pe = SCHEMES["alibi"](cfg)
    T = 32
    pos = torch.arange(T)
    bias = pe.bias(pos, pos)
    assert bias.shape == (6, T, T)
    assert bias.dtype == torch.float32
    slopes = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8, 2.0 ** -1, 2.0 ** -3]
    ref = naive_alibi_bias(slopes, pos.tolist(), pos.tolist())
    for h in range(6):
        assert torch.all(torch.diagonal(bias[h]) == 0)
    lower = torch.tril(torch.ones(T, T, dtype=torch.bool))
    torch.testing.assert_close(bias.double()[:, lower], ref[:, lower], atol=1e-6, rtol=0)
    # hand value: head 4 (slope 1/2), i=10, j=3 -> -3.5
    assert bias[4, 10, 3].item() == pytest.approx(-3.5)
    # offset positions give the same bias
    off = torch.arange(100, 100 + T)
    torch.testing.assert_close(pe.bias(off, off), bias, atol=0, rtol=0)
    # rectangular (KV-cache style): 3 queries at the end of 32 keys
    bq = pe.bias(off[-3:], off)
    assert bq.shape == (6, 3, T)
    torch.testing.assert_close(bq, bias[:, -3:], atol=0, rtol=0)
    assert pe.uses_bias and sum(p.numel() for p in pe.parameters()) == 0


def test_alibi_no_embedding_or_rotation():
    torch.manual_seed(11)
    cfg = tiny_config()
    pe = SCHEMES["alibi"](cfg)
    x = torch.randn(1, 3, cfg.n_embd)
    assert torch.equal(pe.embed(x, torch.arange(3)), x)
