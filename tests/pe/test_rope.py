"""RoPE and its options (partial rotation, p-RoPE, learned frequencies) against naive float64
per-pair rotations, hand values, finite differences and float64 autograd."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from model.attention.masks import attention_mask
from model.config import GPTConfig
from pelab.lit import LitGPT
from model.pe import SCHEMES
from tests.position_context import position_context
from tests.naive import naive_attention_loops, naive_rope, naive_rope_vec
from tests.tiny import POSITIONS, attention_config, build, rotate_single, tiny_config


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
# options: keep_fraction (p-RoPE) and learnable_freq
# --------------------------------------------------------------------------------------


def naive_rope_pair(x, pos, thetas):
    """Half-split rotation of one head vector by pos * thetas[k] (float64 tensors)."""
    half = len(thetas)
    out = list(x)
    for k in range(half):
        a = pos * thetas[k]
        c, s = torch.cos(a), torch.sin(a)
        out[k] = x[k] * c - x[k + half] * s
        out[k + half] = x[k + half] * c + x[k] * s
    return torch.stack(out)


def prope_thetas(r: int, keep: int, base: float = 10000.0, alpha=None):
    """theta_k = base^(-2k/r) (times exp(alpha_k)) for k < keep, 0 for the removed lowest."""
    out = []
    for k in range(r // 2):
        t = torch.tensor(base ** (-2.0 * k / r), dtype=torch.float64)
        if alpha is not None:
            t = t * torch.exp(alpha[k])
        out.append(t if k < keep else torch.zeros((), dtype=torch.float64))
    return out


def rope_config(**overrides) -> GPTConfig:
    return attention_config(**{"n_embd": 64, "n_head": 4, **overrides})  # head dim 16: 8 pairs


def test_rope_defaults_are_plain_rope_exactly():
    torch.manual_seed(6)
    cfg = rope_config()
    plain = SCHEMES["rope"](cfg)
    assert plain.keep is None and plain.log_freq_scale is None
    assert list(plain.parameters()) == [] and plain.state_dict() == {}  # checkpoints unchanged
    learnable = SCHEMES["rope"](cfg, keep_fraction=1.0, learnable_freq=True)
    assert [n for n, _ in learnable.named_parameters()] == ["log_freq_scale"]
    assert torch.equal(learnable.log_freq_scale, torch.zeros(8))
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    pos = torch.tensor([0, 1, 7, 300, 4000, 4001])
    for a, b in zip(plain.rotate(q, k, pos, pos), learnable.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)  # exp(0) = 1: bit for bit


@pytest.mark.parametrize("keep_fraction, rotary_fraction, kept", [
    (0.5, 1.0, 4), (0.75, 1.0, 6), (0.3, 1.0, 2), (0.125, 1.0, 1), (0.5, 0.5, 2),
])
def test_prope_rotates_only_the_highest_frequencies(keep_fraction, rotary_fraction, kept):
    """Pairs k < floor(p * r/2) rotate by p_t * base^(-2k/r) (the full-RoPE frequencies);
    the lower-frequency pairs (dims k and k + r/2) and dims past r pass through bit for bit."""
    torch.manual_seed(7)
    pe = SCHEMES["rope"](rope_config(), keep_fraction=keep_fraction, rotary_fraction=rotary_fraction)
    r = int(16 * rotary_fraction)
    assert pe.kept_pairs == kept
    positions = [0, 1, 5, 77, 255]
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    rq, rk = pe.rotate(q, k, torch.tensor(positions), torch.tensor(positions))
    thetas = prope_thetas(r, kept)
    for x, rx in ((q, rq), (k, rk)):
        for h in range(2):
            for t, p in enumerate(positions):
                x64 = x[0, h, t].double()
                ref = torch.cat([naive_rope_pair(x64[:r], torch.tensor(float(p), dtype=torch.float64), thetas), x64[r:]])
                torch.testing.assert_close(rx[0, h, t].double(), ref, atol=1e-5, rtol=0)
    passthrough = [d for d in range(16) if not (d < kept or r // 2 <= d < r // 2 + kept)]
    assert torch.equal(rq[..., passthrough], q[..., passthrough])
    assert (rq[0, :, 1:, :kept] - q[0, :, 1:, :kept]).abs().amax(-1).min() > 1e-4  # kept pairs do rotate


def test_prope_keeps_the_rope_frequencies_unlike_rotary_fraction():
    """keep_fraction 0.5 of head dim 16: theta_k = 10000^(-2k/16) for k < 4, then 0; partial
    rotary (rotary_fraction 0.5) instead spreads 10000^(-2k/8) over 4 pairs."""
    prope = SCHEMES["rope"](rope_config(), keep_fraction=0.5).frequencies(torch.tensor([0])).inv_freq
    expected = [10000 ** (-2 * k / 16) if k < 4 else 0.0 for k in range(8)]  # 1, 0.316, 0.1, 0.0316
    torch.testing.assert_close(prope.double(), torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-6)
    partial = SCHEMES["rope"](rope_config(), rotary_fraction=0.5).frequencies(torch.tensor([0])).inv_freq
    torch.testing.assert_close(partial.double(), torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64),
                               atol=0, rtol=1e-6)


def test_rope_option_validation():
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=0.0)
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=1.5)
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=0.1)  # floor(0.8) = 0 of 8 pairs
    # 0.29 * 100 = 28.999999999999996 in binary: still 29 pairs
    assert SCHEMES["rope"](attention_config(n_embd=200, n_head=1), keep_fraction=0.29).kept_pairs == 29


@pytest.mark.parametrize("pos", ["from0", "reset", "far"])
def test_rope_options_attention_matches_naive(pos):
    cfg, model, attn = build("rope", {"keep_fraction": 0.5, "learnable_freq": True}, seed=8)  # head dim 8: 2 of 4 pairs
    alpha = torch.tensor([0.3, -0.7, 0.5, 0.2])
    with torch.no_grad():
        model.pe.log_freq_scale.copy_(alpha)
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    x = torch.randn(2, 9, cfg.n_embd)
    assert attention_mask(model.pe, p, p, torch.float32) is None
    with torch.no_grad():
        y = attn(x, position_context(model.pe, p, None))
    thetas = prope_thetas(8, 2, alpha=alpha.double())
    ref = naive_attention_loops(attn, x, rotate=lambda t, v: naive_rope_pair(
        v, torch.tensor(float(positions[t]), dtype=torch.float64), thetas))
    tol = 1e-5 if max(positions) < 300 else 2e-3  # float32 angles at p = 5000
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_learnable_freq_gradient_matches_naive():
    cfg, model, attn = build("rope", {"keep_fraction": 0.75, "learnable_freq": True}, seed=9)  # 3 of 4 pairs
    with torch.no_grad():
        model.pe.log_freq_scale.copy_(torch.tensor([0.1, -0.2, 0.3, 0.4]))
    positions = [0, 1, 2, 3, 5, 8, 13, 21]
    p = torch.tensor(positions)
    x = torch.randn(2, 8, cfg.n_embd)
    weights = torch.randn(2, 8, cfg.n_embd, dtype=torch.float64)
    (attn(x, position_context(model.pe, p, None)).double() * weights).sum().backward()
    alpha = model.pe.log_freq_scale.detach().double().requires_grad_(True)
    thetas = prope_thetas(8, 3, alpha=alpha)
    ref = naive_attention_loops(attn, x, rotate=lambda t, v: naive_rope_pair(
        v, torch.tensor(float(positions[t]), dtype=torch.float64), thetas))
    (ref * weights).sum().backward()
    got = model.pe.log_freq_scale.grad.double()
    assert alpha.grad[:3].abs().min() > 1e-5 and alpha.grad[3] == 0  # the removed pair learns nothing
    torch.testing.assert_close(got, alpha.grad, atol=1e-6 * alpha.grad.abs().max().item(), rtol=1e-3)


def test_scaling_starts_from_the_learned_frequencies():
    """Evaluation-time scaling applies to theta_k * exp(alpha_k); p-RoPE's removed pairs stay 0.
    ntk with s = 4, r = 16: theta'_k = theta_k e^alpha_k 4^(-2k/14); linear: positions / 4."""
    from model.pe.rope_scaling import RopeScaling
    from model.pe.scaling import scaled

    pe = SCHEMES["rope"](rope_config(), keep_fraction=0.75, learnable_freq=True)  # 6 of 8 pairs
    alpha = [0.2, -0.1, 0.05, 0.3, -0.4, 0.0, 0.7, -0.3]
    with torch.no_grad():
        pe.log_freq_scale.copy_(torch.tensor(alpha))
    learned = [10000 ** (-2 * k / 16) * math.exp(alpha[k]) if k < 6 else 0.0 for k in range(8)]
    pos = torch.tensor([0, 100])
    got = pe.frequencies(pos)
    torch.testing.assert_close(got.inv_freq.double(), torch.tensor(learned, dtype=torch.float64), atol=0, rtol=1e-6)
    with scaled(pe, RopeScaling("ntk", 4.0, 32)):
        ntk = [learned[k] * 4.0 ** (-2 * k / 14) for k in range(8)]
        torch.testing.assert_close(pe.frequencies(pos).inv_freq.double(), torch.tensor(ntk, dtype=torch.float64),
                                   atol=0, rtol=1e-6)
    with scaled(pe, RopeScaling("linear", 4.0, 32)):
        lin = pe.frequencies(pos)
    assert lin.position_scale == 0.25
    torch.testing.assert_close(lin.inv_freq.double(), torch.tensor(learned, dtype=torch.float64), atol=0, rtol=1e-6)
    with scaled(pe, RopeScaling("yarn", 4.0, 32)):
        yarn = pe.frequencies(pos).inv_freq
    assert torch.all(yarn[6:] == 0) and torch.all(yarn[:6] > 0)
    torch.testing.assert_close(pe.frequencies(pos).inv_freq, got.inv_freq, atol=0, rtol=0)


def test_rope_subclasses_keep_plain_frequencies():
    for name in ("xpos", "rope_alibi"):
        pe = SCHEMES[name](rope_config())
        assert pe.keep is None and pe.log_freq_scale is None and list(pe.parameters()) == []


def test_learnable_freq_trains_and_survives_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32),
                    pe={"_target_": "model.pe.rope.RoPE", "keep_fraction": 0.5, "learnable_freq": True},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2})
    trainer = L.Trainer(max_steps=5, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)
    alpha = module.model.pe.log_freq_scale.detach()
    assert torch.isfinite(alpha).all() and alpha[:2].abs().min() > 0 and torch.all(alpha[2:] == 0)
    assert id(module.model.pe.log_freq_scale) in {id(t) for t in trainer.optimizers[0].param_groups[1]["params"]}
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = LitGPT.load_from_checkpoint(path)
    assert torch.equal(loaded.model.pe.log_freq_scale, module.model.pe.log_freq_scale)
    module.eval(), loaded.eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(module(idx)[0], loaded(idx)[0], atol=0, rtol=0)
