"""KERPLE (log and power): the reference's init, hand values, and r1, r2 projected back into range,
against the naive float64 kernel."""

from __future__ import annotations

import math

import pytest
import torch

from model.pe import SCHEMES
from tests.naive import naive_kerple_bias
from tests.tiny import attention_config


@pytest.mark.parametrize("name, r1_high, r2_high", [("kerple_log", 2.0, 1.0), ("kerple_power", 1.0, 2.0)])
def test_kerple_init_is_the_references_uniform(name, r1_high, r2_high):
    """Reference: log bias_p (r1) = rand * 2, bias_a (r2) = rand * 1; power bias_a (r1) =
    rand * 1, bias_p (r2) = rand * 2, one value per head."""
    torch.manual_seed(0)
    pe = SCHEMES[name](attention_config(n_head=64, n_embd=128))
    for param, high in ((pe.r1, r1_high), (pe.r2, r2_high)):
        assert param.shape == (64,)
        assert param.min().item() > 0 and param.max().item() < high
        assert param.max().item() > 0.8 * high and param.min().item() < 0.2 * high  # spread over (0, high)
    assert pe.eps == 0.01


def test_kerple_hand_values():
    log = SCHEMES["kerple_log"](attention_config())
    power = SCHEMES["kerple_power"](attention_config())
    with torch.no_grad():
        log.r1.copy_(torch.tensor([0.5, 1.0, 2.0, 1.5]))
        log.r2.copy_(torch.tensor([2.0, 0.5, 1.0, 0.25]))
        power.r1.copy_(torch.tensor([0.5, 1.0, 0.25, 2.0]))
        power.r2.copy_(torch.tensor([1.5, 1.0, 2.0, 0.5]))
    qpos, kpos = torch.tensor([10]), torch.tensor([7, 10, 6, 14])  # |i - j| = 3, 0, 4, 4
    b = log.bias(qpos, kpos)[:, 0]
    assert b[0, 0].item() == pytest.approx(-0.5 * math.log(7))  # -0.5 ln(1 + 2*3) = -0.97296
    assert b[1, 2].item() == pytest.approx(-1.0 * math.log(3))  # -ln(1 + 0.5*4)
    assert b[3, 3].item() == pytest.approx(-1.5 * math.log(2))  # key after the query in position: |-4|
    assert torch.all(b[:, 1] == 0)  # distance 0
    b = power.bias(qpos, kpos)[:, 0]
    assert b[0, 2].item() == pytest.approx(-4.0)  # -0.5 * 4^1.5 = -0.5 * 8
    assert b[2, 0].item() == pytest.approx(-2.25)  # -0.25 * 3^2
    assert b[3, 0].item() == pytest.approx(-2 * math.sqrt(3))  # -2 * 3^0.5
    assert torch.all(b[:, 1] == 0)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_parameters_are_projected_back_into_range(name):
    """A step that drives r1, r2 negative (and the power exponent above 2): the next forward
    uses them clamped to [0.01, inf) (r2 of power: [0.01, 2]), as the reference, ``project()``
    after the step writes them clamped, and the
    bias is the kernel at the clamped values. The gradient is the plain one at the clamped
    value, so a later step can move a parameter back up (it is not stuck at the bound)."""
    torch.manual_seed(4)
    pe = SCHEMES[name](attention_config())
    opt = torch.optim.SGD(pe.parameters(), lr=10.0)
    with torch.no_grad():
        pe.r2[3] = 1.9
    push = torch.tensor([1.0, 1.0, 1.0, -1.0])  # heads 0-2 down, head 3 up (past 2 for power's r2)
    (pe.r1 * push).sum().add((pe.r2 * push).sum()).backward()
    opt.step()
    assert (pe.r1[:3] < 0).all() and (pe.r2[:3] < 0).all()  # the optimizer did leave the range
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 13, 40])
    unprojected = pe.bias(positions, positions)  # forward uses the clamped values, writes nothing
    assert (pe.r1[:3] < 0).all() and (pe.r2[:3] < 0).all()
    pe.project()  # after every optimizer step (pelab's LightningModule)
    bias = pe.bias(positions, positions)
    assert torch.equal(bias, unprojected)
    assert (pe.r1 >= 0.01).all() and (pe.r2 >= 0.01).all()
    assert torch.all(pe.r1[:3] == 0.01) and torch.all(pe.r2[:3] == 0.01)
    if name == "kerple_power":
        assert pe.r2[3].item() == 2.0
    r1, r2 = pe.r1.detach().double(), pe.r2.detach().double()
    ref = naive_kerple_bias(name, r1, r2, positions.tolist(), positions.tolist())
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(bias).all()
    # back up: minimising sum(bias) asks for a stronger penalty, i.e. larger r1 and r2
    opt.zero_grad()
    pe.bias(positions, positions).sum().backward()
    assert (pe.r1.grad[:3] < 0).all() and (pe.r2.grad[:3] < 0).all()  # a clamp inside autograd gives 0
    opt.step()
    assert (pe.r1[:3] > 0.01).all() and (pe.r2[:3] > 0.01).all()
