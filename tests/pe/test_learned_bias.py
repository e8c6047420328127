"""Every scheme with a learned bias (T5, KERPLE, FIRE): bias, attention output and parameter gradients
against float64 autograd on the naive formulas of tests/naive.py, and a few steps of a LitGPT fit."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from model.attention.masks import attention_mask
from pelab.lit import LitGPT
from model.pe import SCHEMES
from model.pe.base import distance_bias
from tests.position_context import position_context
from tests.naive import leaf_params, naive_attention_loops, naive_scheme_bias
from tests.tiny import LEARNED_BIAS, POSITIONS, build


@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_bias_matches_naive(name, pos):
    cfg, model, _ = build(name)
    pe = model.pe
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    bias = pe.bias(p, p)
    assert bias.shape == (cfg.n_head, 9, 9) and bias.dtype == torch.float32
    ref = naive_scheme_bias(name, pe, leaf_params(pe), positions, positions).detach()
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)
    # rectangular (query chunk / cache): the last 3 queries against all 9 keys
    torch.testing.assert_close(pe.bias(p[-3:], p), bias[:, -3:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pos", ["from0", "reset", "far"])
@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_attention_output_matches_naive(name, pos):
    cfg, model, attn = build(name, seed=1)
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    x = torch.randn(2, len(positions), cfg.n_embd)
    mask = attention_mask(model.pe, p, p, torch.float32)
    assert mask.shape == (1, cfg.n_head, 9, 9)
    with torch.no_grad():
        y = attn(x, position_context(model.pe, p, mask))
    bias = naive_scheme_bias(name, model.pe, leaf_params(model.pe), positions, positions).detach()
    torch.testing.assert_close(y.double(), naive_attention_loops(attn, x, bias), atol=1e-5, rtol=1e-5)


# FIRE "window": every query below the threshold L = 32 (a training window), where the bias
# is computed per distance; the default positions cross L (per (i, j) pair)
@pytest.mark.parametrize("name, window", [(n, False) for n in LEARNED_BIAS] + [("fire", True)])
def test_gradients_reach_parameters_and_match_naive(name, window):
    """d loss / d param through the model's attention (SDPA, float32) equals autograd on the
    naive float64 formula, for a loss that weights every output differently."""
    cfg, model, attn = build(name, seed=2)
    if name == "t5":  # distances 0..290 hit exact, log-spaced and clipped buckets
        positions = [0, 1, 2, 5, 17, 20, 40, 90, 290]
    elif window:
        positions = [0, 1, 2, 5, 9, 14, 20, 27, 31]
    else:
        positions = POSITIONS["far"][:7] + [41, 42]
    p = torch.tensor(positions)
    x = torch.randn(2, len(positions), cfg.n_embd)
    weights = torch.randn(2, len(positions), cfg.n_embd, dtype=torch.float64)
    y = attn(x, position_context(model.pe, p, attention_mask(model.pe, p, p, torch.float32)))
    (y.double() * weights).sum().backward()
    leaves = leaf_params(model.pe)
    bias = naive_scheme_bias(name, model.pe, leaves, positions, positions)
    (naive_attention_loops(attn, x, bias) * weights).sum().backward()
    for n, param in model.pe.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), n
        ref = leaves[n].grad
        if n == "mlp.2.bias":  # FIRE's output bias shifts a whole row per head: softmax ignores it
            assert param.grad.abs().max() < 1e-5 and ref.abs().max() < 1e-12  # float32 rounding only
            continue
        assert ref.abs().max() > 1e-6, f"{n}: the check needs a non-zero gradient"
        # in the window every hidden unit sees all of a row's distances and its bias gradient
        # nearly cancels (dS rows sum to zero), leaving float32 rounding of ~1e-6 of the largest
        scale = (1e-5 if window else 1e-6) * ref.abs().max().item()
        torch.testing.assert_close(param.grad.double(), ref, atol=scale, rtol=1e-3,
                                   msg=lambda m: f"{name}.{n}: {m}")


# the bias's own gradient for query/key positions the model passes: a training window and
# a query chunk of it (distance_bias's Toeplitz layout; FIRE's window needs positions < 32),
# reset positions (its gather) and far ones (per pair)
BIAS_GRAD_POSITIONS = {
    "window": (list(range(30)), list(range(30))),
    "chunk": (list(range(21, 30)), list(range(30))),
    "reset": (POSITIONS["reset"], POSITIONS["reset"]),
    "far": (POSITIONS["far"], POSITIONS["far"]),
}


@pytest.mark.parametrize("pos", list(BIAS_GRAD_POSITIONS))
@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_bias_and_its_gradients_match_naive(name, pos):
    qpos, kpos = BIAS_GRAD_POSITIONS[pos]
    _, model, _ = build(name, seed=3)
    pe = model.pe
    bias = pe.bias(torch.tensor(qpos), torch.tensor(kpos))
    weights = torch.randn(bias.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (bias.double() * weights).sum().backward()
    leaves = leaf_params(pe)
    ref_bias = naive_scheme_bias(name, pe, leaves, qpos, kpos)
    torch.testing.assert_close(bias.detach().double(), ref_bias.detach(), atol=1e-5, rtol=1e-5)
    (ref_bias * weights).sum().backward()
    for n, param in pe.named_parameters():
        ref = leaves[n].grad
        assert ref.abs().max() > 1e-6, f"{n}: the check needs a non-zero gradient"
        torch.testing.assert_close(param.grad.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4,
                                   msg=lambda m: f"{name}.{n}: {m}")


@pytest.mark.parametrize("qpos, kpos, evaluated", [
    (list(range(8)), list(range(8)), 15),  # a window: Tq + Tk - 1 distances
    (list(range(5, 8)), list(range(8)), 10),  # its last 3 queries
    (list(range(40, 44)), list(range(3, 10)), 10),  # queries far after the keys
    ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2], 5),  # reset positions: the range -2..2, gathered
    ([[0, 1, 2, 3], [2, 3, 4, 5]], [[0, 1, 2, 3], [4, 5, 6, 7]], 9),  # per-sequence positions: -3..3 and -5..1
    ([0, 9, 40], [0, 9, 40], 9),  # sparse: fewer pairs (9) than distances (81), per pair
])
@pytest.mark.parametrize("by_index", [False, True], ids=["flip", "index_select"])
def test_distance_bias_equals_its_definition(monkeypatch, qpos, kpos, evaluated, by_index):
    """bias[..., h, i, j] = values[p_i - p_j, h] by loops, value and gradient, from a table
    indexed by distance; and the values are evaluated once per distance (or per pair). The
    Toeplitz rows reversed by flip (CPU) and by index_select (CUDA's tables of 2 GiB or more)."""
    import model.pe.base as base

    real = base.reverse_rows
    monkeypatch.setattr(base, "reverse_rows", lambda windows: real(windows, by_index=by_index))
    table = torch.randn(101, 3, dtype=torch.float64, requires_grad=True)  # distances -50..50
    seen = []

    def values_of(d):
        seen.append(d.numel())
        return table[d + 50]

    qp, kp = torch.tensor(qpos), torch.tensor(kpos)
    got = distance_bias(values_of, qp, kp)
    qb, kb = (qp, kp) if qp.dim() == 2 else (qp[None], kp[None])
    ref = torch.stack([torch.stack([torch.stack([torch.stack([table[int(i - j) + 50, h] for j in kb[b]])
                                                 for i in qb[b]]) for h in range(3)]) for b in range(len(qb))])
    ref = ref if qp.dim() == 2 else ref[0]
    assert got.shape == ref.shape and seen == [evaluated]
    assert torch.equal(got, ref)
    weights = torch.randn(ref.shape, dtype=torch.float64)
    grad, = torch.autograd.grad((got * weights).sum(), table)
    ref_grad, = torch.autograd.grad((ref * weights).sum(), table)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_bias_is_float32_under_bf16_autocast(name):
    _, model, _ = build(name)
    p = torch.tensor(POSITIONS["far"])
    ref = model.pe.bias(p, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.pe.bias(p, p)
        mask = attention_mask(model.pe, p, p, torch.bfloat16)
    assert got.dtype == torch.float32 and mask.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


@pytest.mark.parametrize("name", LEARNED_BIAS)
def test_trains_in_a_lightning_fit(name):
    """A few bf16-mixed steps of the real LitGPT fit: finite loss, every scheme parameter in
    the no-decay group and moved by the optimizer."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    cls = SCHEMES[name]
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32),
                    pe={"_target_": f"{cls.__module__}.{cls.__name__}"},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2})
    before = {n: t.detach().clone() for n, t in module.model.pe.named_parameters()}
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = L.Trainer(max_steps=6, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, limit_val_batches=0, callbacks=[Record()])
    trainer.fit(module, train_dataloaders=loader)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    _, no_decay = trainer.optimizers[0].param_groups
    assert no_decay["weight_decay"] == 0.0
    no_decay_ids = {id(t) for t in no_decay["params"]}
    for n, t in module.model.pe.named_parameters():
        assert id(t) in no_decay_ids, n
        assert not torch.equal(t.detach(), before[n]), f"{n} did not move"
