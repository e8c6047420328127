"""Llama 3 RoPE scaling (``pe.scaling.kind=llama3``) against a float64 transcription of Meta's
``apply_scaling`` (llama-models, Llama 3.1): a per-frequency loop over three wavelength bands."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from model.pe.rope_scaling import RopeScaling
from tests import tiny


def meta_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's loop, transcribed: keep short wavelengths, divide long ones, blend in between."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return out


def thetas(d, base):
    return [base ** (-2.0 * k / d) for k in range(d // 2)]


def llama3_pe(d, base, **scaling):
    pe = SCHEMES["rope"](tiny.tiny_config(n_embd=4 * d), base=base)
    pe.scale(RopeScaling("llama3", **scaling))
    return pe


@pytest.mark.parametrize("d, base, s, L, low, high", [
    (128, 500000.0, 8.0, 8192, 1.0, 4.0),  # Llama 3.1's own setting
    (64, 10000.0, 4.0, 128, 1.0, 4.0),
    (32, 10000.0, 2.0, 256, 2.0, 8.0),
    (16, 500000.0, 16.0, 64, 0.5, 3.0),
])
def test_frequencies_equal_metas_loop(d, base, s, L, low, high):
    ref = meta_apply_scaling(thetas(d, base), s, low, high, L)
    pe = llama3_pe(d, base, factor=s, original_length=L, low_freq_factor=low, high_freq_factor=high)
    got = pe.angles(torch.tensor([1]))[0].double().tolist()
    for k in range(d // 2):
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=0), k
    freqs = pe.frequencies(torch.tensor([0]))
    assert freqs.attention_factor == 1.0 and freqs.position_scale == 1.0


def test_llama31_bands_by_hand():
    """d 128, base 500000, L 8192: wavelengths below 2048 kept, above 8192 divided by 8."""
    plain = thetas(128, 500000.0)
    got = llama3_pe(128, 500000.0, factor=8.0, original_length=8192).angles(torch.tensor([1]))[0].double()
    wavelength = [2 * math.pi / t for t in plain]
    kept = [k for k, w in enumerate(wavelength) if w < 2048]
    divided = [k for k, w in enumerate(wavelength) if w > 8192]
    assert kept and divided and len(kept) + len(divided) < 64  # all three bands present
    for k in kept:
        assert got[k] == pytest.approx(plain[k], rel=1e-6)
    for k in divided:
        assert got[k] == pytest.approx(plain[k] / 8, rel=1e-6)


@pytest.mark.parametrize("low, high", [(4.0, 4.0), (4.0, 1.0), (0.0, 4.0)])
def test_bad_bands_are_refused(low, high):
    with pytest.raises(ValueError, match="0 < low_freq_factor < high_freq_factor"):
        RopeScaling("llama3", 8.0, 128, low_freq_factor=low, high_freq_factor=high)
