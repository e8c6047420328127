"""FIRE: the reference's init and constants, hand values of the normalised distance, and the
sign of c and of the threshold against the naive float64 bias."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import leaf_params, naive_fire_bias
from tests.tiny import POSITIONS, attention_config


def test_fire_init_is_the_references():
    """c = 0.1, threshold multiplier 1 times L0 = model.block_size, PyTorch's default Linear
    init (U(-1/sqrt(fan_in), 1/sqrt(fan_in))) for the 1 -> 32 -> heads MLP."""
    torch.manual_seed(0)
    pe = SCHEMES["fire"](attention_config(block_size=48, n_head=16, n_embd=64))
    assert pe.c.item() == pytest.approx(0.1) and pe.threshold_multiplier.item() == 1.0
    assert pe.init_threshold.item() == 48.0 and pe.threshold.item() == 48.0
    assert not pe.init_threshold.requires_grad and "init_threshold" in pe.state_dict()  # fixed, saved
    first, second = pe.mlp[0], pe.mlp[2]
    assert (first.in_features, first.out_features, second.out_features) == (1, 32, 16)
    assert isinstance(pe.mlp[1], torch.nn.ReLU)
    for layer, bound in ((first, 1.0), (second, 1 / math.sqrt(32))):
        for t in (layer.weight, layer.bias):
            assert t.abs().max().item() <= bound and t.abs().max().item() > 0.8 * bound
    assert SCHEMES["fire"](attention_config(), init_threshold=100.0).threshold.item() == 100.0


def test_fire_hand_values():
    """A 1 -> 1 -> heads MLP with unit weights and zero biases returns the normalised
    distance itself: log(|c (i - j)| + 1) / (log(|c max(i, L)| + 1) + eps)."""
    pe = SCHEMES["fire"](attention_config(block_size=32), mlp_width=1)
    with torch.no_grad():
        for layer in (pe.mlp[0], pe.mlp[2]):
            layer.weight.fill_(1.0)
            layer.bias.zero_()
    qpos, kpos = torch.tensor([10, 50]), torch.tensor([0, 10, 40, 50])
    b = pe.bias(qpos, kpos)
    assert b.shape == (4, 2, 4) and torch.equal(b[0], b[3])
    # i = 10 < L = 32: normaliser ln(0.1 * 32 + 1) = ln 4.2 = 1.435085
    assert b[0, 0, 0].item() == pytest.approx(math.log(2) / (math.log(4.2) + 1e-6), rel=1e-6)  # 0.482998
    assert b[0, 0, 1].item() == 0.0
    assert b[0, 0, 2].item() == pytest.approx(math.log(4) / math.log(4.2), rel=1e-5)  # |10 - 40| = 30
    # i = 50 > L: normaliser ln(0.1 * 50 + 1) = ln 6
    assert b[0, 1, 0].item() == pytest.approx(1.0, rel=1e-5)  # psi(50) / psi(50)
    assert b[0, 1, 1].item() == pytest.approx(math.log(5) / math.log(6), rel=1e-5)  # 0.898244
    with torch.no_grad():  # the threshold moves with its multiplier: L = 2 * 32 = 64 > 50
        pe.threshold_multiplier.fill_(2.0)
    b = pe.bias(qpos, kpos)
    assert b[0, 1, 1].item() == pytest.approx(math.log(5) / math.log(7.4), rel=1e-5)  # ln(0.1*64+1)


def test_fire_sign_of_c_and_threshold_does_nothing():
    """The reference takes |c x| and |m L0|: a step that drives c and the multiplier negative
    leaves the bias that of their absolute values (the effective c and L stay positive)."""
    torch.manual_seed(5)
    pe = SCHEMES["fire"](attention_config())
    positions = torch.tensor(POSITIONS["far"])
    opt = torch.optim.SGD([pe.c, pe.threshold_multiplier], lr=1.0)
    (pe.c * 0.3 + pe.threshold_multiplier * 3.0).sum().backward()  # c: 0.1 -> -0.2, m: 1 -> -2
    opt.step()
    assert pe.c.item() == pytest.approx(-0.2) and pe.threshold_multiplier.item() == pytest.approx(-2.0)
    bias = pe.bias(positions, positions)
    assert torch.isfinite(bias).all() and pe.threshold.item() == pytest.approx(64.0)
    p = leaf_params(pe)
    p["c"], p["threshold_multiplier"] = p["c"].detach().abs(), p["threshold_multiplier"].detach().abs()
    ref = naive_fire_bias(p, positions.tolist(), positions.tolist()).detach()
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)


def test_fire_loads_checkpoints_with_scalar_parameters():
    """c and the multiplier are stored with shape (1,) (FSDP refuses 0-dim parameters); a state
    dict written when they were 0-dim loads, and its values give the reference bias."""
    pe = SCHEMES["fire"](attention_config())
    old = {k: v.clone() for k, v in pe.state_dict().items()}
    old["c"], old["threshold_multiplier"] = torch.tensor(0.7), torch.tensor(0.5)  # the old 0-dim form
    pe.load_state_dict(old)
    assert pe.c.shape == (1,) and pe.c.item() == pytest.approx(0.7) and pe.threshold.item() == pytest.approx(0.5 * pe.init_threshold.item())
    positions = torch.tensor(POSITIONS["far"])
    p = leaf_params(pe)
    ref = naive_fire_bias(p, positions.tolist(), positions.tolist()).detach()
    torch.testing.assert_close(pe.bias(positions, positions).double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rows", [[list(range(4, 16))] * 2,
                                  [list(range(12)), [0, 1, 2, 0, 1, 9, 10, 11, 12, 13, 30, 31]]],
                         ids=["shared", "per-sequence"])
def test_fire_trains_through_flex_with_the_reference_gradients(monkeypatch, rows):
    """FIRE's CUDA training route: flex under autograd, compiled (here on CPU by dynamo with the
    eager backend; CPU flex computes its backward densely). Output and the gradients of all of
    FIRE's parameters against float64 autograd on the formula, with queries on both sides of
    the threshold L = 0.75 * 8 = 6 (the normaliser changes with the query past it)."""
    from model.attention import BACKENDS, Terms
    from model.positions import layer_contexts
    from tests.naive import naive_softmax_attention

    torch._dynamo.reset()
    flex = BACKENDS["flex"]
    monkeypatch.setattr(flex, "compile_devices", ("cpu",))
    monkeypatch.setattr(flex, "compile_backend", "eager")
    monkeypatch.setattr(flex, "_compiled", None)
    torch.manual_seed(3)
    pe = SCHEMES["fire"](attention_config(block_size=8))
    with torch.no_grad():
        pe.c.fill_(0.4)
        pe.threshold_multiplier.fill_(0.75)
    positions = torch.tensor(rows[0]) if rows[0] == rows[1] else torch.tensor(rows)
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 12, 8, generator=g) for _ in range(3))  # CPU flex: no q/k/v gradient
    weights = torch.randn(2, 4, 12, 8, generator=g, dtype=torch.float64)
    out = flex(q, k, v, layer_contexts(Terms(pe, positions, positions), flex)[0].state, 0.0)
    (out.double() * weights).sum().backward()
    p = leaf_params(pe)
    refs = [naive_softmax_attention(q[b:b + 1].double(), k[b:b + 1].double(), v[b:b + 1].double(),
                                    naive_fire_bias(p, rows[b], rows[b], pe.eps)[None]) for b in range(2)]
    ref = torch.cat(refs).view(2, 12, 4, 8).transpose(1, 2)
    torch.testing.assert_close(out.double(), ref.detach(), atol=1e-5, rtol=1e-5)
    (ref * weights).sum().backward()
    for name, param in pe.named_parameters():
        want = p[name].grad
        if name == "mlp.2.bias":  # shifts a whole row: softmax ignores it
            assert param.grad.abs().max() < 1e-5
            continue
        assert want.abs().max() > 1e-4, name
        torch.testing.assert_close(param.grad.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")
