"""T5's relative bias: buckets against hand values and the naive definition, t5x's table init."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import naive_t5_bucket
from tests.tiny import attention_config


def test_t5_bucket_hand_values():
    """num_buckets 32 -> 16 exact buckets; n >= 16: 16 + floor(16 ln(n/16) / ln(128/16)),
    at most 31. ln 8 = 2.0794."""
    from model.pe import t5_bucket

    expected = {
        0: 0, 1: 1, 15: 15,  # exact
        16: 16,  # 16 ln(1) / ln 8 = 0
        17: 16,  # 16 * 0.0606 / 2.0794 = 0.466
        20: 17,  # 16 * 0.2231 / 2.0794 = 1.717
        22: 18,  # 16 * 0.3185 / 2.0794 = 2.450
        31: 21,  # 16 * 0.6614 / 2.0794 = 5.089
        32: 21,  # 16 * ln 2 / ln 8 = 16/3 = 5.333
        45: 23,  # 16 * 1.0341 / 2.0794 = 7.957
        63: 26,  # 16 * 1.3706 / 2.0794 = 10.546
        64: 26,  # 16 * ln 4 / ln 8 = 32/3 = 10.667
        90: 29,  # 16 * 1.7272 / 2.0794 = 13.290
        100: 30,  # 16 * 1.8326 / 2.0794 = 14.101
        127: 31,  # 16 * 2.0716 / 2.0794 = 15.940
        128: 31,  # 16 + 16 = 32, clipped to 31
        1000: 31, 10**6: 31,  # clipped
        -1: 0, -50: 0,  # unidirectional: n = max(i - j, 0)
    }
    got = t5_bucket(torch.tensor(list(expected)))
    assert got.dtype == torch.int64
    assert dict(zip(expected, got.tolist())) == expected
    # num_buckets 8, max_distance 20: 4 exact; n >= 4: 4 + floor(4 ln(n/4) / ln 5), ln 5 = 1.6094
    small = {3: 3, 4: 4, 5: 4, 6: 5, 9: 6, 13: 6, 14: 7, 19: 7, 20: 7, 500: 7}
    # 5: 4*.2231/1.6094 = .555; 6: 4*.4055/1.6094 = 1.008; 9: 4*.8109/1.6094 = 2.015;
    # 13: 4*1.1787/1.6094 = 2.929; 14: 4*1.2528/1.6094 = 3.114; 20: 4 -> 8, clipped to 7
    got = t5_bucket(torch.tensor(list(small)), num_buckets=8, max_distance=20)
    assert dict(zip(small, got.tolist())) == small


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (64, 1000), (33, 100)])
def test_t5_bucket_matches_naive_definition(num_buckets, max_distance):
    from model.pe import t5_bucket

    n = torch.arange(-5, 3000)
    got = t5_bucket(n, num_buckets, max_distance).tolist()
    ref = [naive_t5_bucket(v, num_buckets, max_distance) for v in n.tolist()]
    assert got == ref
    assert set(got) == set(range(num_buckets))  # every bucket is reachable


def test_t5_table_init_is_t5x_fan_avg_uniform():
    """t5x: variance_scaling(1.0, 'fan_avg', 'uniform') on (heads, buckets): U(-a, a),
    a = sqrt(3 / ((heads + buckets) / 2)); 16 heads, 32 buckets -> a = sqrt(1/8) = 0.3536."""
    torch.manual_seed(0)
    pe = SCHEMES["t5"](attention_config(n_head=16, n_embd=64))
    table = pe.relative_attention_bias.weight
    assert table.shape == (32, 16)
    a = math.sqrt(1 / 8)
    assert table.abs().max().item() <= a
    assert table.abs().max().item() > 0.95 * a
    assert table.std().item() == pytest.approx(a / math.sqrt(3), rel=0.1)  # uniform: std a/sqrt(3)


def test_t5_bias_hand_values_and_options():
    pe = SCHEMES["t5"](attention_config(), num_buckets=8, max_distance=20)
    with torch.no_grad():  # table[b, h] = 10 b + h, so the bias names its bucket
        pe.relative_attention_bias.weight.copy_(10 * torch.arange(8.0)[:, None] + torch.arange(4.0))
    qpos, kpos = torch.tensor([30, 2]), torch.tensor([0, 10, 24, 25, 26, 29, 30])
    bias = pe.bias(qpos, kpos)
    # query 30: distances 30, 20, 6, 5, 4, 1, 0 -> buckets 7, 7, 5, 4, 4, 1, 0
    assert bias[2, 0].tolist() == [72, 72, 52, 42, 42, 12, 2]
    # query 2: distances 2, -8, ... -> 2 then bucket 0 for every negative distance
    assert bias[3, 1].tolist() == [23, 3, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError):
        SCHEMES["t5"](attention_config(), num_buckets=32, max_distance=16)
