"""Evaluation-time RoPE scaling (linear, NTK, dynamic NTK, YaRN) against naive float64 per-pair
loops from the formulas (Chen et al. 2023, NTK-aware base, HF dynamic NTK, YaRN's reference code)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES, RoPE
from model.pe.rope_scaling import ROPE_SCALINGS, RopeScaling
from model.pe.scaling import scaled
from tests import tiny

ROPE_FAMILY = tiny.schemes_where(lambda pe: isinstance(pe, RoPE))  # RoPE and its subclasses (not PoPE)


def tiny_config(**overrides) -> GPTConfig:
    return tiny.tiny_config(**{"n_embd": 64, **overrides})  # head dim 16


# --------------------------------------------------------------------------------------
# naive references (float64, explicit loops)
# --------------------------------------------------------------------------------------


def naive_thetas(r: int, base: float = 10000.0) -> list[float]:
    return [base ** (-2.0 * k / r) for k in range(r // 2)]


def naive_rotate(x, p: float, thetas: list[float], factor: float = 1.0, decay=None) -> torch.Tensor:
    """Half-split rotation of one head vector at (possibly fractional) position p: pair k =
    (dims k, k + r/2) turns by p * thetas[k], r = 2 * len(thetas); both rotated components
    are multiplied by ``factor`` (and by ``decay(k)``, xPos); dims >= r pass through."""
    x = [float(v) for v in x]
    half = len(thetas)
    out = list(x)
    for k in range(half):
        a = p * thetas[k]
        f = factor * (1.0 if decay is None else decay(k))
        x1, x2 = x[k], x[k + half]
        out[k] = f * (x1 * math.cos(a) - x2 * math.sin(a))
        out[k + half] = f * (x2 * math.cos(a) + x1 * math.sin(a))
    return torch.tensor(out, dtype=torch.float64)


def naive_yarn(d: int, base: float, s: float, L: int, beta_fast=32.0, beta_slow=1.0, truncate=True):
    """(theta'_k per pair, low, high) from the YaRN reference code's formula, d = rotary dim."""
    def corr(rotations):  # the fractional pair index whose pair turns `rotations` times over L
        return d * math.log(L / (2 * math.pi * rotations)) / (2 * math.log(base))

    low, high = corr(beta_fast), corr(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    out = []
    for k, theta in enumerate(naive_thetas(d, base)):
        ramp = min(max((k - low) / (high - low), 0.0), 1.0)
        out.append((theta / s) * ramp + theta * (1 - ramp))
    return out, low, high


def rotate_at(pe, x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """pe.rotate of the single head vector x (d,) placed at every position: (T, d)."""
    q = x.reshape(1, 1, 1, -1).expand(1, 1, len(positions), -1).contiguous()
    pos = torch.tensor(positions)
    rq, _ = pe.rotate(q, q.clone(), pos, pos)
    return rq[0, 0]


def scaled_pe(name: str, scaling: RopeScaling, cfg: GPTConfig | None = None, **kwargs):
    pe = SCHEMES[name](cfg or tiny_config(), **kwargs)
    pe.scale(scaling)
    return pe


# --------------------------------------------------------------------------------------
# linear (position interpolation)
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("s", [4.0, 2.5])
def test_linear_is_rope_at_fractional_positions(s):
    torch.manual_seed(0)
    pe = scaled_pe("rope", RopeScaling("linear", s, original_length=16))
    x = torch.randn(16)
    positions = [0, 1, 3, 10, 37, 200]
    out = rotate_at(pe, x, positions)
    thetas = naive_thetas(16)
    for t, p in enumerate(positions):
        torch.testing.assert_close(out[t].double(), naive_rotate(x, p / s, thetas), atol=1e-5, rtol=0)
        if p:
            assert (out[t].double() - naive_rotate(x, p, thetas)).abs().max() > 1e-2


def test_linear_score_is_unscaled_score_at_divided_positions():
    torch.manual_seed(1)
    s = 4.0
    pe = scaled_pe("rope", RopeScaling("linear", s, original_length=16))
    q, k = torch.randn(16), torch.randn(16)
    thetas = naive_thetas(16)
    positions = [0, 1, 5, 13, 63]
    rq, rk = rotate_at(pe, q, positions), rotate_at(pe, k, positions)
    for a, m in enumerate(positions):
        for b, n in enumerate(positions[: a + 1]):
            ref = torch.dot(naive_rotate(q, m / s, thetas), naive_rotate(k, n / s, thetas)).item()
            assert torch.dot(rq[a], rk[b]).item() == pytest.approx(ref, abs=1e-5)


# --------------------------------------------------------------------------------------
# NTK-aware base change
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rotary_fraction", [1.0, 0.5])
def test_ntk_equals_rope_with_changed_base(rotary_fraction):
    torch.manual_seed(2)
    s, base = 4.0, 10000.0
    pe = scaled_pe("rope", RopeScaling("ntk", s, original_length=16), rotary_fraction=rotary_fraction)
    d = int(16 * rotary_fraction)  # the rotary dim, not the head dim
    new_base = base * s ** (d / (d - 2))
    x = torch.randn(16)
    positions = [0, 1, 7, 50, 300]
    out = rotate_at(pe, x, positions)
    for t, p in enumerate(positions):
        torch.testing.assert_close(out[t].double(), naive_rotate(x, p, naive_thetas(d, new_base)), atol=2e-5, rtol=0)
    # highest-frequency pair unchanged, lowest-frequency pair divided by s
    plain = naive_thetas(d, base)
    angles = pe.angles(torch.tensor([1000]))[0].double()
    assert angles[0].item() == pytest.approx(1000 * plain[0], rel=1e-6)
    assert angles[-1].item() == pytest.approx(1000 * plain[-1] / s, rel=1e-5)
    assert plain[-1] / angles[-1].item() * 1000 == pytest.approx(s, rel=1e-5)


# --------------------------------------------------------------------------------------
# dynamic NTK
# --------------------------------------------------------------------------------------


def test_dynamic_ntk_is_identity_within_the_original_length():
    torch.manual_seed(3)
    L = 16
    x = torch.randn(16)
    plain = SCHEMES["rope"](tiny_config())
    for factor in [1.0, 2.0, 8.0]:
        pe = scaled_pe("rope", RopeScaling("dynamic_ntk", factor, original_length=L))
        for positions in [list(range(L)), [3, 15], [0]]:  # T = max position + 1 <= L
            assert torch.equal(rotate_at(pe, x, positions), rotate_at(plain, x, positions))


@pytest.mark.parametrize("factor, T", [(1.0, 64), (1.0, 40), (2.0, 32), (3.0, 20)])
def test_dynamic_ntk_takes_the_scale_from_the_length(factor, T):
    torch.manual_seed(4)
    L, d = 16, 16
    pe = scaled_pe("rope", RopeScaling("dynamic_ntk", factor, original_length=L))
    s_dyn = max(1.0, factor * T / L - (factor - 1))
    if (factor, T) == (1.0, 64):
        assert s_dyn == 4.0  # T = 4L with factor 1 is ntk with s = 4
    thetas = naive_thetas(d, 10000.0 * s_dyn ** (d / (d - 2)))
    x = torch.randn(16)
    positions = [0, 1, 9, T - 1]
    out = rotate_at(pe, x, positions)
    for t, p in enumerate(positions):
        torch.testing.assert_close(out[t].double(), naive_rotate(x, p, thetas), atol=2e-5, rtol=0)
    if (factor, T) == (1.0, 64):
        ntk = scaled_pe("rope", RopeScaling("ntk", 4.0, original_length=L))
        torch.testing.assert_close(out, rotate_at(ntk, x, positions), atol=1e-6, rtol=0)


def test_dynamic_ntk_q_and_k_share_the_length():
    """T comes from the largest position of q and k together, so q's rotation at p = 10 uses
    the same base as the keys up to 63 (KV-cache style calls keep the relative property)."""
    torch.manual_seed(5)
    pe = scaled_pe("rope", RopeScaling("dynamic_ntk", 1.0, original_length=16))
    x = torch.randn(1, 1, 1, 16)
    rq, _ = pe.rotate(x, torch.randn(1, 1, 64, 16), torch.tensor([10]), torch.arange(64))
    thetas = naive_thetas(16, 10000.0 * 4.0 ** (16 / 14))
    torch.testing.assert_close(rq.reshape(-1).double(), naive_rotate(x.reshape(-1), 10, thetas), atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------
# YaRN
# --------------------------------------------------------------------------------------


def yarn_pe(d: int, s: float, L: int, rotary_fraction: float = 1.0, **kwargs):
    """A RoPE of head dim d with YaRN set."""
    return scaled_pe("rope", RopeScaling("yarn", s, original_length=L, **kwargs),
                  tiny_config(n_embd=4 * d), rotary_fraction=rotary_fraction)


def effective_thetas(pe) -> list[float]:
    return pe.angles(torch.tensor([1]))[0].double().tolist()  # angle at p = 1


@pytest.mark.parametrize("s", [4.0, 8.0])
@pytest.mark.parametrize("L", [256, 4096])
@pytest.mark.parametrize("d", [64, 128])
def test_yarn_frequencies_match_the_reference_per_pair(d, L, s):
    ref, low, high = naive_yarn(d, 10000.0, s, L)
    assert 0 <= low < high < d // 2  # every case has kept, ramp and interpolated pairs
    got = effective_thetas(yarn_pe(d, s, L))
    assert len(got) == d // 2
    for k in range(d // 2):
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=0), k


def test_yarn_correction_dims_by_hand():
    # corr(r) = d ln(L / (2 pi r)) / (2 ln 10000), 2 ln 10000 = 18.42068
    # d = 64, L = 256: corr(32) = 64 ln(1.27324) / 18.42068 = 0.839 -> low 0
    #                  corr(1) = 64 ln(40.7437) / 18.42068 = 12.880 -> high 13
    # d = 128, L = 4096: corr(32) = 128 ln(20.3718) / 18.42068 = 20.944 -> low 20
    #                    corr(1) = 128 ln(651.899) / 18.42068 = 45.027 -> high 46
    # d = 32, L = 128 (the ablation: head dim 32, train length 128; corr does not depend on s):
    #                  corr(32) = 32 ln(0.63662) / 18.42068 = -0.784 -> low 0
    #                  corr(1) = 32 ln(20.3718) / 18.42068 = 5.236 -> high 6
    assert naive_yarn(64, 10000.0, 4.0, 256)[1:] == (0, 13)
    assert naive_yarn(128, 10000.0, 4.0, 4096)[1:] == (20, 46)
    for s in [2.0, 4.0, 8.0, 16.0]:
        assert naive_yarn(32, 10000.0, s, 128)[1:] == (0, 6)
    s = 4.0
    plain = naive_thetas(64)
    got = effective_thetas(yarn_pe(64, s, 256))
    assert got[0] == pytest.approx(plain[0], rel=1e-7)  # k <= low: kept
    for k in range(13, 32):  # k >= high: divided by s
        assert got[k] == pytest.approx(plain[k] / s, rel=1e-6)
    # pair 8: theta = 10000^(-16/64) = 0.1, r = 256 * 0.1 / (2 pi) = 4.074 rotations; ramp 8/13,
    # so it keeps 5/13 = 0.385 of theta: theta' = 0.1 * (8/13 / 4 + 5/13) = 0.1 * 7/13.
    # The paper's text would keep (4.074 - 1) / 31 = 0.099.
    assert got[8] == pytest.approx(0.1 * 7 / 13, rel=1e-6)
    kept = (got[8] / 0.1 - 1 / s) / (1 - 1 / s)
    assert kept == pytest.approx(0.3846, abs=1e-4)
    assert abs(kept - 0.099) > 0.25


def test_yarn_attention_factor_literal():
    for s, m in [(4.0, 1.1386294361), (8.0, 1.2079441542), (1.0, 1.0)]:  # 0.1 ln s + 1
        freqs = yarn_pe(16, s, 16).frequencies(torch.tensor([0]))
        assert freqs.attention_factor == pytest.approx(m, abs=1e-10)


def test_yarn_rotation_matches_the_reference():
    """Full rotation: reference frequencies, cos and sin times m = 0.1 ln s + 1."""
    torch.manual_seed(6)
    s, L, d = 4.0, 1024, 16
    pe = scaled_pe("rope", RopeScaling("yarn", s, original_length=L))
    ref, low, high = naive_yarn(d, 10000.0, s, L)
    assert (low, high) == (1, 5)  # 16 ln(1024 / (64 pi)) / 18.42 = 1.41, 16 ln(1024 / (2 pi)) / 18.42 = 4.42
    m = 0.1 * math.log(s) + 1
    x = torch.randn(16)
    positions = [0, 1, 100, 3000]
    out = rotate_at(pe, x, positions)
    for t, p in enumerate(positions):
        torch.testing.assert_close(out[t].double(), naive_rotate(x, p, ref, factor=m),
                                   atol=5e-4 if p > 1000 else 1e-5, rtol=0)


@pytest.mark.parametrize("name", ROPE_FAMILY)
def test_yarn_attention_factor_scales_logits_by_its_square(name):
    torch.manual_seed(7)
    pe = scaled_pe(name, RopeScaling("yarn", 4.0, original_length=16))
    q = torch.randn(1, 1, 1, 16)
    zero = torch.tensor([0])
    rq, rk = pe.rotate(q, q.clone(), zero, zero)  # position 0: no rotation (and no xPos decay)
    logit = torch.dot(rq.reshape(-1), rk.reshape(-1)).double().item()
    unscaled = torch.dot(q.reshape(-1), q.reshape(-1)).double().item()
    assert logit == pytest.approx((0.1 * math.log(4) + 1) ** 2 * unscaled, rel=1e-5)
    # bf16 in, bf16 out
    rq16, _ = pe.rotate(q.bfloat16(), q.bfloat16(), zero, zero)
    assert rq16.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "d, L, rotary_fraction, kwargs",
    [
        (64, 256, 1.0, dict(truncate=False)),  # low 0.839, high 12.880 unrounded
        (128, 4096, 1.0, dict(truncate=False)),
        (64, 1024, 1.0, dict(beta_fast=100.0, beta_slow=10.0)),
        (64, 1024, 0.5, {}),  # corr uses the rotary dim (32), not the head dim
        (16, 4, 1.0, {}),  # corr(1) = -0.39: low = high = 0, so high = 0.001
        (16, 1024, 0.125, {}),  # rotary dim 2: the single pair is kept
    ],
)
def test_yarn_options_match_the_reference(d, L, rotary_fraction, kwargs):
    s = 4.0
    rotary_dim = int(d * rotary_fraction)
    ref, low, high = naive_yarn(rotary_dim, 10000.0, s, L, **kwargs)
    if (d, L) == (16, 4):
        assert (low, high) == (0, 0.001)
    got = effective_thetas(yarn_pe(d, s, L, rotary_fraction, **kwargs))
    assert len(got) == rotary_dim // 2
    for k in range(rotary_dim // 2):
        assert got[k] == pytest.approx(ref[k], rel=1e-6, abs=0), k


# --------------------------------------------------------------------------------------
# every method, every RoPE-family scheme
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ROPE_FAMILY)
@pytest.mark.parametrize("kind", ROPE_SCALINGS)
def test_factor_one_is_the_identity(kind, name):
    """s = 1 changes nothing, bit for bit (dynamic NTK: within L, since its factor 1 still
    stretches past L by T/L)."""
    torch.manual_seed(8)
    L = 1000 if kind == "dynamic_ntk" else 16
    plain = SCHEMES[name](tiny_config())
    pe = scaled_pe(name, RopeScaling(kind, 1.0, original_length=L))
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    pos = torch.tensor([0, 1, 7, 30, 200, 999])
    for a, b in zip(pe.rotate(q, k, pos, pos), plain.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)


def test_xpos_scaling_moves_the_angles_not_the_decay():
    torch.manual_seed(9)
    s, B, gamma = 4.0, 512.0, 0.4
    pe = scaled_pe("xpos", RopeScaling("linear", s, original_length=16))
    positions = [0, 3, 20, 90]
    q, k = torch.randn(1, 1, 4, 16), torch.randn(1, 1, 4, 16)
    rq, rk = pe.rotate(q, k, torch.tensor(positions), torch.tensor(positions))
    c = (min(positions) + max(positions)) // 2
    thetas = naive_thetas(16)
    for t, p in enumerate(positions):
        def zeta(kk):
            return (2.0 * kk / 16 + gamma) / (1.0 + gamma)
        ref_q = naive_rotate(q[0, 0, t], p / s, thetas, decay=lambda kk: zeta(kk) ** ((p - c) / B))
        ref_k = naive_rotate(k[0, 0, t], p / s, thetas, decay=lambda kk: zeta(kk) ** (-(p - c) / B))
        torch.testing.assert_close(rq[0, 0, t].double(), ref_q, atol=1e-5, rtol=0)
        torch.testing.assert_close(rk[0, 0, t].double(), ref_k, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ROPE_FAMILY)
def test_gpt_forward_with_every_scaling_and_exact_restore(name):
    torch.manual_seed(10)
    cfg = tiny_config(n_embd=32)  # head dim 8
    model = GPT(cfg, SCHEMES[name](cfg)).eval()
    T = 3 * cfg.block_size  # past the training context, so dynamic NTK is active too
    idx = torch.randint(0, cfg.vocab_size, (2, T))
    bias = model.pe.bias(torch.arange(T), torch.arange(T)) if model.pe.uses_bias else None
    with torch.no_grad():
        ref, _ = model(idx)
        for kind in ROPE_SCALINGS:
            with scaled(model.pe, RopeScaling(kind, 4.0, original_length=cfg.block_size)):
                out, _ = model(idx)
                assert torch.isfinite(out).all(), kind
                assert (out - ref).abs().max() > 1e-4, kind
                if bias is not None:  # RoPE+ALiBi: linear interpolates the bias (/4: exact), the rest leave it
                    expected = bias / 4 if kind == "linear" else bias
                    assert torch.equal(model.pe.bias(torch.arange(T), torch.arange(T)), expected), kind
                assert kind in repr(model.pe)
            restored, _ = model(idx)
            assert torch.equal(restored, ref), kind
            if bias is not None:
                assert torch.equal(model.pe.bias(torch.arange(T), torch.arange(T)), bias)
            assert model.pe.scaling is None


def test_scaling_is_not_in_the_state_dict():
    cfg = tiny_config()
    pe = SCHEMES["rope"](cfg)
    keys = set(pe.state_dict())
    with scaled(pe, RopeScaling("yarn", 4.0, original_length=16)):
        assert set(pe.state_dict()) == keys


def test_scaling_kinds():
    """Rotary schemes take every kind; of the others, ALiBi-type biases take linear, the rest none."""
    cfg = tiny_config()
    for name in ROPE_FAMILY:
        assert SCHEMES[name](cfg).scaling_kinds == (*ROPE_SCALINGS, "longrope")
    for name in tiny.schemes_where(lambda pe: not pe.uses_rotate):
        pe = SCHEMES[name](cfg)
        assert pe.scaling_kinds == (("linear",) if pe.key_only_slopes() is not None else ()), name


# --------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------


def test_bad_kind_names_the_valid_choices():
    with pytest.raises(ValueError) as err:
        RopeScaling("ntk_by_parts", 4.0, original_length=16)
    msg = str(err.value)
    assert "ntk_by_parts" in msg
    assert all(kind in msg for kind in ["linear", "ntk", "dynamic_ntk", "yarn"])


@pytest.mark.parametrize("factor", [0.5, 0.0, -2.0, float("nan"), float("inf")])
def test_bad_factor(factor):
    with pytest.raises(ValueError, match=">= 1") as err:
        RopeScaling("linear", factor, original_length=16)
    assert repr(factor) in str(err.value)


@pytest.mark.parametrize(
    "kwargs",
    [dict(original_length=0), dict(original_length=16.0), dict(beta_fast=1.0, beta_slow=1.0),
     dict(beta_fast=32.0, beta_slow=-1.0), dict(beta_slow=0.0), dict(truncate=1)],
)
def test_bad_length_or_ramp(kwargs):
    kwargs = {"original_length": 16, **kwargs}
    with pytest.raises(ValueError):
        RopeScaling("yarn", 2.0, **kwargs)


def test_scaled_rejects_other_objects():
    pe = SCHEMES["rope"](tiny_config())
    with pytest.raises(TypeError, match="scaled expects a RopeScaling or None, got dict"):
        with scaled(pe, {"kind": "linear", "factor": 2.0, "original_length": 16}):
            pass
    with pytest.raises(dataclasses.FrozenInstanceError):
        RopeScaling("linear", 2.0, 16).factor = 3.0
