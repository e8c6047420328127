"""xPos: the score is the RoPE score times zeta^((n - m)/B), against naive float64 per-pair sums."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import naive_rope_vec
from tests.tiny import rotate_single, tiny_config


def zeta(k: int, r: int, gamma: float = 0.4) -> float:
    return (2.0 * k / r + gamma) / (1.0 + gamma)


def naive_xpos_pair_scores(q, k, n: int, m: int, r: int, base=10000.0, B=512.0, gamma=0.4):
    """Per-pair contributions (float64) of the xPos score q_n . k_m and of the plain RoPE score."""
    half = r // 2
    rope_q, rope_k = naive_rope_vec(q, n, base), naive_rope_vec(k, m, base)
    rope_pairs = [
        float(rope_q[j] * rope_k[j] + rope_q[j + half] * rope_k[j + half]) for j in range(half)
    ]
    xq = naive_rope_vec(q, n, base, scale=lambda j: zeta(j, r, gamma) ** (n / B))
    xk = naive_rope_vec(k, m, base, scale=lambda j: zeta(j, r, gamma) ** (-m / B))
    xpos_pairs = [float(xq[j] * xk[j] + xq[j + half] * xk[j + half]) for j in range(half)]
    return rope_pairs, xpos_pairs


def xpos_score(pe, q, k, n: int, m: int, q_ctx=None, k_ctx=None) -> float:
    """Score q(at n) . k(at m) from pe.rotate, optionally inside wider position sets."""
    qp = [n] if q_ctx is None else q_ctx
    kp = [m] if k_ctx is None else k_ctx
    Q = q.reshape(1, 1, 1, -1).expand(1, 1, len(qp), -1).contiguous()
    K = k.reshape(1, 1, 1, -1).expand(1, 1, len(kp), -1).contiguous()
    rq, rk = pe.rotate(Q, K, torch.tensor(qp), torch.tensor(kp))
    return torch.dot(rq[0, 0, qp.index(n)].double(), rk[0, 0, kp.index(m)].double()).item()


def test_xpos_zeta_values():
    cfg = tiny_config(n_embd=64, n_head=4)  # r = 16
    pe = SCHEMES["xpos"](cfg)
    expected = [(2 * j / 16 + 0.4) / 1.4 for j in range(8)]
    torch.testing.assert_close(pe.zeta.double(), torch.tensor(expected, dtype=torch.float64), atol=1e-7, rtol=0)


def test_xpos_score_is_rope_score_times_decay():
    torch.manual_seed(12)
    cfg = tiny_config(n_embd=64, n_head=4)
    r = 16
    pe = SCHEMES["xpos"](cfg)
    rope = SCHEMES["rope"](cfg)
    q, k = torch.randn(16), torch.randn(16)
    for n, m in [(0, 0), (5, 0), (100, 3), (700, 10), (2000, 1999), (1500, 200)]:
        rope_pairs, xpos_pairs = naive_xpos_pair_scores(q, k, n, m, r)
        # naive self-consistency: each pair carries exactly zeta_j^((n-m)/B)
        for j in range(r // 2):
            factor = zeta(j, r) ** ((n - m) / 512.0)
            assert xpos_pairs[j] == pytest.approx(rope_pairs[j] * factor, rel=1e-9, abs=1e-12)
        got = xpos_score(pe, q, k, n, m)
        ref = sum(xpos_pairs)
        mag = sum(abs(v) for v in xpos_pairs)
        assert got == pytest.approx(ref, abs=1e-4 * mag + 1e-7)
        # plain RoPE through the model code equals the naive RoPE score
        rq = rotate_single(rope, q, n).double()
        rk = rotate_single(rope, k, m).double()
        assert torch.dot(rq, rk).item() == pytest.approx(sum(rope_pairs), abs=1e-4 * q.norm().item() * k.norm().item())


def test_xpos_single_pair_decay():
    """Only pair j nonzero, q = k: score(n, m) / score_rope(n, m) = zeta_j^((n-m)/B)."""
    cfg = tiny_config(n_embd=64, n_head=4)
    r = 16
    pe = SCHEMES["xpos"](cfg)
    for j in [0, 3, 7]:
        v = torch.zeros(16)
        v[j] = 1.0
        # at equal positions no rotation, no decay: score = |v|^2 = 1
        assert xpos_score(pe, v, v, 50, 50) == pytest.approx(1.0, rel=1e-5)
        for d in [0, 64, 256, 512, 1024]:
            n, m = 2000 + d, 2000
            theta = 10000.0 ** (-2.0 * j / r)
            rope_score = math.cos(d * theta)  # <R_n v, R_m v> = cos((n-m) theta)
            if abs(rope_score) < 0.05:
                continue
            expected = rope_score * zeta(j, r) ** (d / 512.0)
            got = xpos_score(pe, v, v, n, m)
            assert got == pytest.approx(expected, rel=2e-3, abs=1e-6)
    # pair 7 has theta = 10000^(-14/16) ~ 3e-4: the rotation barely moves it over 512 steps,
    # so the decay alone shows: zeta_7 = (14/16+0.4)/1.4, one scale_base away -> factor zeta_7
    v = torch.zeros(16)
    v[7] = 1.0
    z7 = (14 / 16 + 0.4) / 1.4
    s0 = xpos_score(pe, v, v, 512, 512)
    s1 = xpos_score(pe, v, v, 1024, 512)
    s2 = xpos_score(pe, v, v, 1536, 512)
    assert s0 > s1 > s2 > 0
    assert s1 / s0 == pytest.approx(z7 * math.cos(512 * 10000 ** (-14 / 16)), rel=1e-3)
    assert s2 / s0 == pytest.approx(z7**2 * math.cos(1024 * 10000 ** (-14 / 16)), rel=1e-3)


def test_xpos_independent_of_centring_and_offset():
    torch.manual_seed(13)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["xpos"](cfg)
    q, k = torch.randn(16), torch.randn(16)
    ref = xpos_score(pe, q, k, 40, 10)
    mag = q.norm().item() * k.norm().item()
    # same n - m at different absolute offsets and inside different key sets (different centre)
    for n, m, k_ctx in [
        (40, 10, list(range(0, 41))),
        (1030, 1000, None),
        (1030, 1000, list(range(990, 1031))),
        (5030, 5000, [0, 5000, 5030]),
    ]:
        got = xpos_score(pe, q, k, n, m, q_ctx=[n], k_ctx=k_ctx)
        # relative 1e-5 of the score scale at small offsets; angle rounding at large p
        tol = 1e-5 * mag if n < 100 else 2e-3 * mag
        assert got == pytest.approx(ref, abs=tol), (n, m, k_ctx)


def test_xpos_finite_at_long_positions():
    torch.manual_seed(14)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["xpos"](cfg)
    qpos = torch.tensor([0, 4096, 8190, 8191, 8192])
    kpos = torch.tensor([0, 1, 4096, 8191, 8192])
    q = torch.randn(1, 4, 5, 16)
    k = torch.randn(1, 4, 5, 16)
    rq, rk = pe.rotate(q, k, qpos, kpos)
    assert torch.isfinite(rq).all() and torch.isfinite(rk).all()
    scores = rq @ rk.transpose(-1, -2)
    assert torch.isfinite(scores).all()
    # q at 8192 against k at 0: naive reference (pair sum)
    qq, kk = q[0, 0, 4], k[0, 0, 0]
    _, xpos_pairs = naive_xpos_pair_scores(qq, kk, 8192, 0, 16)
    mag = sum(abs(v) for v in xpos_pairs)
    assert scores[0, 0, 4, 0].item() == pytest.approx(sum(xpos_pairs), abs=1e-3 * mag + 1e-6)
    # far keys only (centre near 0): q at 8192 still finite
    rq2, rk2 = pe.rotate(q[:, :, :1], k[:, :, :2], torch.tensor([8192]), torch.tensor([0, 1]))
    assert torch.isfinite(rq2).all() and torch.isfinite(rk2).all()


def test_xpos_far_window_is_finite_thanks_to_centring():
    """A window at position ~1e5 (sliding-window eval of a long text): zeta_0^(1e5/512) is
    ~1e-106 and would underflow in float32 without centring; the scores must stay finite and
    equal to the same window at offset 0 (up to float32 angle rounding at 1e5)."""
    torch.manual_seed(17)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["xpos"](cfg)
    T = 8
    q = torch.randn(1, 2, T, 16)
    k = torch.randn(1, 2, T, 16)
    near = torch.arange(T)
    far = torch.arange(T) + 100_000
    rq0, rk0 = pe.rotate(q, k, near, near)
    rq1, rk1 = pe.rotate(q, k, far, far)
    assert torch.isfinite(rq1).all() and torch.isfinite(rk1).all()
    s0 = (rq0 @ rk0.transpose(-1, -2)).tril()
    s1 = (rq1 @ rk1.transpose(-1, -2)).tril()
    mag = (q.norm(dim=-1)[..., :, None] * k.norm(dim=-1)[..., None, :]).tril()
    assert torch.all((s1 - s0).abs() <= 3e-2 * mag + 1e-6)
