"""YaRN set for training (``pe.scaling.kind=yarn``) against a float64 transcription of Hugging
Face's ``_compute_yarn_parameters`` (the YaRN repository's ``find_correction_range`` and
``linear_ramp_mask``), at several head dims, bases, factors and lengths, with and without an
``attention_factor`` override."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from model.pe.rope_scaling import RopeScaling
from tests import tiny
from tests.pe.test_rope_scaling import naive_rotate, naive_yarn


def hf_yarn(dim, base, factor, original, beta_fast=32.0, beta_slow=1.0, truncate=True, attention_factor=None):
    """(inv_freq per pair, attention factor), as the reference computes them, in float64: the
    frequencies are the YaRN repository's ramp (``naive_yarn``), the factor ``get_mscale``."""
    out, _, _ = naive_yarn(dim, base, factor, original, beta_fast, beta_slow, truncate)
    mscale = 0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0  # get_mscale
    return out, (mscale if attention_factor is None else attention_factor)


@pytest.mark.parametrize("d, base, s, L", [
    (16, 10000.0, 4.0, 128), (32, 500000.0, 4.0, 128), (64, 10000.0, 16.0, 512), (128, 1e6, 8.0, 4096),
])
@pytest.mark.parametrize("attention_factor", [None, 1.25])
def test_trained_yarn_equals_the_reference(d, base, s, L, attention_factor):
    ref, m = hf_yarn(d, base, s, L, attention_factor=attention_factor)
    pe = SCHEMES["rope"](tiny.tiny_config(n_embd=4 * d, block_size=4 * L), base=base)
    pe.scale(RopeScaling("yarn", s, L, attention_factor=attention_factor))
    freqs = pe.frequencies(torch.tensor([0]))
    assert freqs.attention_factor == pytest.approx(m, rel=1e-12)
    got = freqs.inv_freq.double().tolist()
    for k in range(d // 2):
        assert got[k] == pytest.approx(ref[k], rel=2e-6, abs=0), k
    x = torch.randn(d, generator=torch.Generator().manual_seed(d))
    positions = [0, 1, L - 1, 3 * L]
    q = x.reshape(1, 1, 1, -1).expand(1, 1, len(positions), -1).contiguous()
    rq, _ = pe.rotate(q, q.clone(), torch.tensor(positions), torch.tensor(positions))
    for t, p in enumerate(positions):
        torch.testing.assert_close(rq[0, 0, t].double(), naive_rotate(x, p, ref, factor=m), atol=5e-4, rtol=0)


def test_attention_factor_must_be_positive():
    with pytest.raises(ValueError, match="attention_factor must be null or a finite number > 0"):
        RopeScaling("yarn", 4.0, 128, attention_factor=0.0)
