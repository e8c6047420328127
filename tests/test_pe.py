"""Position-encoding schemes checked against naive, independent references.

Every reference below is written from the definitions in docs/design.md ("Schemes,
exactly") with explicit per-pair / per-element loops in float64 and
``math.sin``/``math.cos``; none of them calls the scheme code it checks.
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES, PositionEncoding, alibi_slopes

torch.set_num_threads(2)

ALL_SCHEMES = ["learned", "sinusoidal", "rope", "alibi", "xpos", "rope_alibi"]


def tiny_config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=32)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


# --------------------------------------------------------------------------------------
# naive references (float64, explicit loops)
# --------------------------------------------------------------------------------------


def naive_rope_vec(x, p: int, base: float = 10000.0, rotary_dim: int | None = None, scale=None):
    """Half-split RoPE of one head vector x (list/1-d tensor) at integer position p.

    Pair k = (dims k, k + r/2), angle p * base^(-2k/r); dims >= r pass through. ``scale``
    (optional callable k -> factor) multiplies both rotated components of pair k (xPos).
    """
    x = [float(v) for v in x]
    d = len(x)
    r = d if rotary_dim is None else rotary_dim
    half = r // 2
    out = list(x)
    for k in range(half):
        theta = base ** (-2.0 * k / r)
        a = p * theta
        c, s = math.cos(a), math.sin(a)
        f = 1.0 if scale is None else scale(k)
        x1, x2 = x[k], x[k + half]
        out[k] = f * (x1 * c - x2 * s)
        out[k + half] = f * (x2 * c + x1 * s)
    return torch.tensor(out, dtype=torch.float64)


def naive_rope(x: torch.Tensor, positions, base=10000.0, rotary_dim=None) -> torch.Tensor:
    """x (..., T, d); rotate every vector at its position with naive_rope_vec."""
    x64 = x.detach().double()
    out = torch.empty_like(x64)
    for idx in itertools.product(*[range(n) for n in x64.shape[:-2]]):
        for t, p in enumerate(positions):
            out[idx + (t,)] = naive_rope_vec(x64[idx + (t,)], int(p), base, rotary_dim)
    return out


def zeta(k: int, r: int, gamma: float = 0.4) -> float:
    return (2.0 * k / r + gamma) / (1.0 + gamma)


def naive_sinusoidal(p: int, d_model: int) -> list[float]:
    row = [0.0] * d_model
    for k in range(d_model // 2):
        a = p / (10000.0 ** (2.0 * k / d_model))
        row[2 * k] = math.sin(a)
        row[2 * k + 1] = math.cos(a)
    return row


def naive_alibi_bias(slopes: list[float], q_pos, k_pos) -> torch.Tensor:
    H, Tq, Tk = len(slopes), len(q_pos), len(k_pos)
    out = torch.zeros(H, Tq, Tk, dtype=torch.float64)
    for h in range(H):
        for a in range(Tq):
            for b in range(Tk):
                out[h, a, b] = -slopes[h] * (int(q_pos[a]) - int(k_pos[b]))
    return out


# --------------------------------------------------------------------------------------
# registry, flags, whole-model forward/backward
# --------------------------------------------------------------------------------------


def test_registry_has_all_schemes():
    for name in ALL_SCHEMES:
        assert name in SCHEMES
        assert SCHEMES[name].name == name


@pytest.mark.parametrize(
    "name, flags",
    [
        ("learned", (True, False, False)),
        ("sinusoidal", (True, False, False)),
        ("rope", (False, True, False)),
        ("xpos", (False, True, False)),
        ("alibi", (False, False, True)),
        ("rope_alibi", (False, True, True)),
    ],
)
def test_hook_flags_match_design(name, flags):
    pe = SCHEMES[name](tiny_config())
    assert (pe.uses_embed, pe.uses_rotate, pe.uses_bias) == flags
    base = PositionEncoding(tiny_config())
    assert (base.uses_embed, base.uses_rotate, base.uses_bias) == (False, False, False)


def test_max_positions():
    cfg = tiny_config(block_size=16)
    assert SCHEMES["learned"](cfg).max_positions == 16
    assert SCHEMES["learned"](cfg, max_positions=40).max_positions == 40
    for name in ["sinusoidal", "rope", "alibi", "xpos", "rope_alibi"]:
        assert SCHEMES[name](cfg).max_positions is None


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_gpt_forward_backward(name):
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES[name](cfg))
    B, T = 2, 12
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    logits, loss = model(idx, targets)
    assert logits.shape == (B, T, cfg.vocab_size)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # at init the loss is close to log(V)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    g = model.wte.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    for i, block in enumerate(model.blocks):
        for pname, p in block.named_parameters():
            assert p.grad is not None, f"block {i} {pname} got no grad"
            assert torch.isfinite(p.grad).all()
            assert p.grad.abs().sum() > 0, f"block {i} {pname} has zero grad"
    if name == "learned":
        wpe = model.pe.wpe.weight.grad
        assert wpe is not None and wpe[:T].abs().sum() > 0
        # rows never used get no gradient
        assert torch.all(wpe[T:] == 0)
    else:
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.pe.parameters())


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_gpt_logits_without_targets_and_padded_vocab(name):
    torch.manual_seed(1)
    cfg = tiny_config(vocab_size=37, pad_vocab_multiple=8)
    model = GPT(cfg, SCHEMES[name](cfg))
    assert model.lm_head.weight.shape[0] == 40
    logits, loss = model(torch.randint(0, 37, (1, 5)))
    assert loss is None
    assert logits.shape == (1, 5, 37)


@pytest.mark.parametrize("name", ["rope", "alibi", "xpos", "rope_alibi"])
def test_relative_schemes_are_translation_invariant_in_gpt(name):
    """Relative-only schemes: shifting all positions by a constant leaves the logits unchanged."""
    torch.manual_seed(2)
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES[name](cfg)).eval()
    idx = torch.randint(0, cfg.vocab_size, (2, 10))
    with torch.no_grad():
        ref, _ = model(idx)
        shifted, _ = model(idx, positions=torch.arange(100, 110))
    torch.testing.assert_close(shifted, ref, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["learned", "sinusoidal"])
def test_absolute_schemes_depend_on_absolute_position(name):
    torch.manual_seed(3)
    cfg = tiny_config(block_size=64)
    pe = SCHEMES[name](cfg)
    if name == "learned":
        torch.nn.init.normal_(pe.wpe.weight, std=1.0)
    model = GPT(cfg, pe).eval()
    idx = torch.randint(0, cfg.vocab_size, (1, 8))
    with torch.no_grad():
        a, _ = model(idx)
        b, _ = model(idx, positions=torch.arange(20, 28))
    assert (a - b).abs().max() > 1e-3


def test_gpt_rejects_wrong_positions_shape():
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES["rope"](cfg))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 6, dtype=torch.long), positions=torch.arange(5))


# --------------------------------------------------------------------------------------
# learned
# --------------------------------------------------------------------------------------


def test_learned_refuses_sequences_past_its_table():
    cfg = tiny_config(block_size=16)
    model = GPT(cfg, SCHEMES["learned"](cfg))
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly the table: fine
    with pytest.raises(ValueError, match=r"\b16\b"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_learned_refuses_explicit_positions_past_its_table():
    cfg = tiny_config(block_size=16)
    model = GPT(cfg, SCHEMES["learned"](cfg))
    model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(12, 16))
    with pytest.raises(ValueError, match=r"\b16\b"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(13, 17))
    pe = SCHEMES["learned"](cfg, max_positions=8)
    with pytest.raises(ValueError, match=r"\b8\b"):
        pe.embed(torch.zeros(1, 2, cfg.n_embd), torch.tensor([3, 8]))


def test_learned_embed_adds_table_rows():
    torch.manual_seed(4)
    cfg = tiny_config()
    pe = SCHEMES["learned"](cfg)
    x = torch.randn(2, 3, cfg.n_embd)
    pos = torch.tensor([5, 0, 11])
    out = pe.embed(x, pos)
    W = pe.wpe.weight.detach()
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(out[b, t], x[b, t] + W[int(pos[t])])


# --------------------------------------------------------------------------------------
# sinusoidal
# --------------------------------------------------------------------------------------


def test_sinusoidal_matches_formula():
    cfg = tiny_config(n_embd=32, n_head=4)
    pe = SCHEMES["sinusoidal"](cfg, scale=1.0)  # the formula as printed
    positions = [0, 1, 7, 100, 511, 3000]
    out = pe.embed(torch.zeros(1, len(positions), 32), torch.tensor(positions))
    assert out.dtype == torch.float32
    for t, p in enumerate(positions):
        ref = torch.tensor(naive_sinusoidal(p, 32), dtype=torch.float64)
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
        ref = torch.tensor(naive_sinusoidal(p, cfg.n_embd), dtype=torch.float32)
        torch.testing.assert_close(out[:, t], x[:, t] + ref, atol=1e-5, rtol=0)


# --------------------------------------------------------------------------------------
# RoPE
# --------------------------------------------------------------------------------------


def rotate_single(pe, x: torch.Tensor, p: int) -> torch.Tensor:
    """Apply pe.rotate to one head vector x (d,) at position p (used as both q and k)."""
    q = x.reshape(1, 1, 1, -1)
    pos = torch.tensor([p])
    rq, _ = pe.rotate(q, q.clone(), pos, pos)
    return rq.reshape(-1)


def test_rope_matches_naive_half_split():
    torch.manual_seed(6)
    cfg = tiny_config(n_embd=64, n_head=4)  # head dim 16
    pe = SCHEMES["rope"](cfg)
    positions = torch.tensor([0, 1, 2, 17, 255, 1000, 5000])
    q = torch.randn(2, 4, len(positions), 16)
    k = torch.randn(2, 4, len(positions), 16)
    rq, rk = pe.rotate(q, k, positions, positions)
    assert rq.shape == q.shape and rk.shape == k.shape
    ref_q = naive_rope(q, positions.tolist())
    ref_k = naive_rope(k, positions.tolist())
    # position 0 is the identity
    torch.testing.assert_close(rq[..., 0, :], q[..., 0, :], atol=1e-7, rtol=0)
    # float32 angles: small positions tight, large positions limited by p*theta rounding
    small = positions < 300
    torch.testing.assert_close(rq[..., small, :].double(), ref_q[..., small, :], atol=1e-5, rtol=0)
    torch.testing.assert_close(rk[..., small, :].double(), ref_k[..., small, :], atol=1e-5, rtol=0)
    torch.testing.assert_close(rq.double(), ref_q, atol=5e-3, rtol=0)
    torch.testing.assert_close(rk.double(), ref_k, atol=5e-3, rtol=0)


def test_rope_hand_computed_pair():
    """head dim 4: pairs (0,2) with theta=1 and (1,3) with theta=base^(-1/2)=0.01."""
    cfg = tiny_config(n_embd=8, n_head=2)  # head dim 4
    pe = SCHEMES["rope"](cfg)
    x = torch.tensor([1.0, 0.0, 0.0, 1.0])
    out = rotate_single(pe, x, 3)
    expected = torch.tensor([math.cos(3), -math.sin(0.03), math.sin(3), math.cos(0.03)])
    torch.testing.assert_close(out, expected.float(), atol=1e-6, rtol=0)


def test_rope_relative_property_and_norms():
    torch.manual_seed(7)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["rope"](cfg)
    q = torch.randn(16)
    k = torch.randn(16)
    scale = (q.norm() * k.norm()).item()

    def score(m, n):
        return torch.dot(rotate_single(pe, q, m), rotate_single(pe, k, n)).item()

    for diff in [0, 1, 5, -3, 40]:
        ref = score(diff + 10, 10) if diff + 10 >= 0 else None
        for base_pos in [10, 11, 37, 300]:
            assert score(base_pos + diff, base_pos) == pytest.approx(ref, abs=1e-5 * scale)
        # large absolute positions: float32 angle rounding gives ~1e-4 radian errors
        for base_pos in [4000, 5000, 8000]:
            assert score(base_pos + diff, base_pos) == pytest.approx(ref, abs=2e-3 * scale)
        # and the naive float64 reference: <R_m q, R_n k> with explicit rotations
        naive = torch.dot(naive_rope_vec(q, 5000 + diff), naive_rope_vec(k, 5000)).item()
        naive0 = torch.dot(naive_rope_vec(q, diff + 10), naive_rope_vec(k, 10)).item()
        assert naive == pytest.approx(naive0, abs=1e-9 * scale)
        assert ref == pytest.approx(naive0, abs=1e-5 * scale)
    # the score does change with the distance
    assert abs(score(3, 0) - score(0, 0)) > 1e-3
    for p in [0, 1, 123, 5000]:
        assert rotate_single(pe, q, p).norm().item() == pytest.approx(q.norm().item(), rel=1e-5)


def test_rope_base_option():
    torch.manual_seed(8)
    cfg = tiny_config(n_embd=64, n_head=4)
    x = torch.randn(16)
    a = rotate_single(SCHEMES["rope"](cfg), x, 50)
    b = rotate_single(SCHEMES["rope"](cfg, base=500.0), x, 50)
    assert (a - b).abs().max() > 1e-2
    torch.testing.assert_close(b.double(), naive_rope_vec(x, 50, base=500.0), atol=1e-5, rtol=0)
    torch.testing.assert_close(a.double(), naive_rope_vec(x, 50, base=10000.0), atol=1e-5, rtol=0)


@pytest.mark.parametrize("scheme,kwargs", [("rope", {}), ("rope", {"rotary_fraction": 0.5}), ("xpos", {})])
@pytest.mark.parametrize("per_sequence", [False, True])
def test_rotation_backward_matches_finite_differences(scheme, kwargs, per_sequence):
    """The rotation's hand-written backward (the transposed rotation) against float64 finite
    differences, for full and partial rotation, xPos's different q and k tables, and
    per-sequence positions."""
    torch.manual_seed(3)
    pe = SCHEMES[scheme](tiny_config(n_embd=64, n_head=4), **kwargs)  # head dim 16
    positions = torch.tensor([[0, 5, 9, 300, 301], [7, 2, 40, 41, 1000]])
    positions = positions if per_sequence else positions[1]
    tables = pe.rotation_tables(positions, positions)
    q, k = (torch.randn(2, 3, 5, 16, dtype=torch.float64, requires_grad=True) for _ in range(2))
    assert torch.autograd.gradcheck(lambda q, k: pe.apply_rotation(q, k, tables), (q, k))
    # and the values: the naive per-pair rotation at each position
    rq, _ = pe.apply_rotation(q, k, tables)
    if scheme == "rope":
        rows = positions.expand(2, 5).tolist()
        for b in range(2):
            ref = naive_rope(q[b : b + 1].detach(), rows[b], rotary_dim=pe.rotary_dim)
            torch.testing.assert_close(rq[b : b + 1].detach(), ref, atol=1e-4, rtol=0)  # float32 angles at 1000


def test_rope_rotary_fraction_half():
    torch.manual_seed(9)
    cfg = tiny_config(n_embd=64, n_head=4)  # head dim 16 -> rotary dim 8
    pe = SCHEMES["rope"](cfg, rotary_fraction=0.5)
    positions = torch.tensor([0, 3, 77, 400])
    q = torch.randn(1, 2, 4, 16)
    k = torch.randn(1, 2, 4, 16)
    rq, rk = pe.rotate(q, k, positions, positions)
    # last half untouched, bit for bit
    assert torch.equal(rq[..., 8:], q[..., 8:])
    assert torch.equal(rk[..., 8:], k[..., 8:])
    # first half rotated as an 8-dim RoPE: pairs (k, k+4), theta_k = base^(-2k/8)
    ref = naive_rope(q, positions.tolist(), rotary_dim=8)
    torch.testing.assert_close(rq.double(), ref, atol=1e-5, rtol=0)
    assert (rq[..., 1:, :8] - q[..., 1:, :8]).abs().amax(dim=-1).min() > 1e-3
    # norms of the rotated part preserved
    torch.testing.assert_close(rq[..., :8].norm(dim=-1), q[..., :8].norm(dim=-1), rtol=1e-5, atol=0)


def test_rope_invalid_options():
    cfg = tiny_config()
    with pytest.raises(ValueError):
        SCHEMES["rope"](cfg, rotary_fraction=0.0)
    with pytest.raises(ValueError):
        SCHEMES["rope"](cfg, base=1.0)


def test_rope_bf16_uses_float32_angles():
    """bf16 q at positions 1000..1003 is rotated by the exact angles, not bf16-rounded positions."""
    torch.manual_seed(10)
    cfg = tiny_config(n_embd=64, n_head=4)
    pe = SCHEMES["rope"](cfg)
    positions = [1000, 1001, 1002, 1003]
    x = torch.randn(16).to(torch.bfloat16)
    q = x.reshape(1, 1, 1, 16).expand(1, 1, 4, 16).contiguous()
    rq, _ = pe.rotate(q, q.clone(), torch.tensor(positions), torch.tensor(positions))
    assert rq.dtype == torch.bfloat16
    xr = x.double()
    tol = 3e-2 * xr.norm().item()
    for t, p in enumerate(positions):
        exact = naive_rope_vec(xr, p)
        err = (rq[0, 0, t].double() - exact).abs().max().item()
        assert err < tol
        # what a bf16 position would have given (spacing 4 above 512)
        p_bf16 = int(torch.tensor(float(p), dtype=torch.bfloat16).item())
        if p_bf16 != p:
            wrong = naive_rope_vec(xr, p_bf16)
            assert (wrong - exact).abs().max().item() > 3 * tol


# --------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# xPos
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# RoPE + ALiBi
# --------------------------------------------------------------------------------------


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


def test_scheme_yaml_values_equal_constructor_defaults(project_root):
    """A scheme option has one default: the constructor's. Each conf/pe yaml may list an
    option (so `pe.KEY=` overrides work) only with that same value, so building a scheme in
    code (bench, tests, scripts) and from its yaml give the same model."""
    import inspect

    from omegaconf import OmegaConf

    yamls = sorted((project_root / "conf" / "pe").glob("*.yaml"))
    assert {p.stem for p in yamls} >= {"learned", "sinusoidal", "rope", "alibi", "xpos", "rope_alibi"}
    for path in yamls:
        cfg = OmegaConf.to_container(OmegaConf.load(path))
        for key in ("nope_every", "randomize_to"):  # model-level options (model/pe/schedule.py), off by default
            assert cfg.pop(key, None) is None
        module, _, cls_name = cfg.pop("_target_").rpartition(".")
        cls = getattr(__import__(module, fromlist=[cls_name]), cls_name)
        params = inspect.signature(cls.__init__).parameters
        for key, value in cfg.items():
            assert key in params, f"{path.name}: {key} is not an option of {cls_name}"
            assert params[key].default == value, (
                f"{path.name}: {key}: {value!r} differs from the constructor default {params[key].default!r}")


def test_sinusoidal_default_is_the_scaled_sinusoid():
    """Built without options (as scripts/bench.py does) the sinusoid has amplitude 1/sqrt(d_model)."""
    from model.config import GPTConfig
    from model.pe import SinusoidalPositionEmbedding

    config = GPTConfig(vocab_size=8, block_size=8, n_layer=1, n_head=2, n_embd=64)
    out = SinusoidalPositionEmbedding(config).embed(torch.zeros(1, 1, 64), torch.tensor([0]))
    assert out[0, 0, 1].item() == pytest.approx(1 / 8)  # cos(0) / sqrt(64)


def test_registering_a_taken_scheme_name_is_an_error():
    from model.pe.base import PositionEncoding

    before = dict(SCHEMES)
    with pytest.raises(ValueError, match="'rope' is already registered by model.pe.rope.RoPE"):
        class MyRoPE(PositionEncoding, name="rope"):
            pass
    assert SCHEMES == before


def test_model_init_leaves_scheme_parameters_to_the_scheme():
    """GPT-2's global init must not overwrite what a scheme initialised itself."""
    from torch import nn

    from model.pe.base import PositionEncoding

    class OwnInit(PositionEncoding):  # unregistered: no name
        def __init__(self, config):
            super().__init__(config)
            self.table = nn.Embedding(5, 3)
            self.proj = nn.Linear(3, 2)
            for p in self.parameters():
                nn.init.constant_(p, 0.75)

    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, OwnInit(config))
    assert all(torch.all(p == 0.75) for p in model.pe.parameters())
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.3)  # the network still gets GPT-2 init
