"""The CPU attention path for learned biases (model/attention/bias_grad.py) against a naive float64
softmax(q k^T / sqrt(d) + mask) v, forward and every gradient, and its use by the model."""

from __future__ import annotations

import math

import pytest
import torch

import model.attention.bias_grad as bias_grad
from model.gpt import GPT
from model.pe import SCHEMES
from tests.tiny import LEARNED_BIAS, tiny_gpt


def naive(q, k, v, mask):
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1]) + mask
    return torch.softmax(scores, dim=-1) @ v


def inputs(dtype, B, H, Tq, Tk, D, mask_batch):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, H, Tk, D, generator=g, dtype=torch.float64) for _ in range(2))
    bias = 2 * torch.randn(mask_batch, H, Tq, Tk, generator=g, dtype=torch.float64)
    hidden = torch.arange(Tk)[None, :] > torch.arange(Tk - Tq, Tk)[:, None]  # queries = the last Tq keys
    mask = bias.masked_fill(hidden, float("-inf"))
    d_out = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    # the compute-dtype values are the exact inputs of both sides
    q, k, v, d_out = (t.to(dtype).double() for t in (q, k, v, d_out))
    return q, k, v, mask.float().double(), d_out


def grads(fn, tensors, d_out):
    leaves = [t.detach().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(d_out.to(out.dtype))
    return out.detach().double(), [t.grad.double() for t in leaves]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.mark.parametrize("tile", [None, 5])  # None: the default tile (one tile here); 5: 24 = 4 * 5 + 4, 7 = 5 + 2
@pytest.mark.parametrize("mask_batch", [1, 5])
@pytest.mark.parametrize("Tq, Tk", [(24, 24), (7, 24)])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_forward_and_gradients_match_naive_float64(monkeypatch, dtype, Tq, Tk, mask_batch, tile):
    if tile is not None:
        monkeypatch.setattr(bias_grad, "QUERY_TILE", tile)
    rows = min(bias_grad.QUERY_TILE, Tq)
    monkeypatch.setattr(bias_grad, "BLOCK_ELEMENTS", 2 * 3 * rows * Tk)  # 2 sequences per block: 5 = 2 + 2 + 1
    q, k, v, mask, d_out = inputs(dtype, 5, 3, Tq, Tk, 16, mask_batch)
    ref_out, ref_grads = grads(naive, (q, k, v, mask), d_out)
    out, got = grads(lambda q, k, v, m: bias_grad.attention_with_bias_grad(q, k, v, m, 1 / math.sqrt(16)),
                     (q.to(dtype), k.to(dtype), v.to(dtype), mask.to(torch.promote_types(dtype, torch.float32))),
                     d_out)
    assert got[3].shape == mask.shape
    if dtype == torch.float64:  # float64 end to end: no float32 step anywhere
        limits = [1e-12] * 5
    elif dtype == torch.float32:
        limits = [1e-5] * 5
    else:  # q, k, v gradients at bf16 rounding, as the flash kernel's; the mask's at float32 level
        limits = [1e-2, 1.5e-2, 1.5e-2, 1.5e-2, 1e-5]
    for name, a, b, limit in zip(("out", "q", "k", "v", "mask"), [out] + got, [ref_out] + ref_grads, limits):
        assert rel_err(a, b) < limit, (name, rel_err(a, b))


@pytest.mark.parametrize("tile", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_a_shared_bias_under_per_sequence_masks_gets_the_batch_summed_gradient(monkeypatch, dtype, tile):
    """Packed documents: one (1, H, T, T) bias, other documents hidden per sequence. The bias
    gradient (summed over the batch in the tiles) equals float64 autograd through
    bias.masked_fill(hidden per sequence, -inf), and so do the output and q, k, v gradients."""
    if tile is not None:
        monkeypatch.setattr(bias_grad, "QUERY_TILE", tile)
    monkeypatch.setattr(bias_grad, "BLOCK_ELEMENTS", 2 * 3 * min(bias_grad.QUERY_TILE, 24) * 24)  # 5 = 2 + 2 + 1
    q, k, v, bias, d_out = inputs(dtype, 5, 3, 24, 24, 16, 1)
    starts = torch.tensor([[0, 7, 15], [0, 1, 2], [0, 20, 23], [0, 12, 12], [0, 24, 24]])  # document starts
    docs = (torch.arange(24)[None, :, None] >= starts[:, None, :]).sum(-1)  # (B, T) document ids
    other = (docs[:, :, None] != docs[:, None, :]).unsqueeze(1)  # (B, 1, T, T)
    ref_out, ref_grads = grads(lambda q, k, v, b: naive(q, k, v, b.masked_fill(other, float("-inf"))),
                               (q, k, v, bias), d_out)
    acc = torch.promote_types(dtype, torch.float32)
    out, got = grads(lambda q, k, v, b: bias_grad.attention_with_bias_grad(
        q, k, v, b.detach().masked_fill(other, float("-inf")), 0.25, bias=b),
        (q.to(dtype), k.to(dtype), v.to(dtype), bias.to(acc)), d_out)
    assert got[3].shape == (1, 3, 24, 24)
    limits = {torch.float64: [1e-12] * 5, torch.float32: [1e-5] * 5,
              torch.bfloat16: [1e-2, 1.5e-2, 1.5e-2, 1.5e-2, 1e-5]}[dtype]
    for name, a, b, limit in zip(("out", "q", "k", "v", "bias"), [out] + got, [ref_out] + ref_grads, limits):
        assert rel_err(a, b) < limit, (name, rel_err(a, b))


def test_bias_gradient_rows_sum_to_zero(monkeypatch):
    """Adding a constant to a query's row of logits changes nothing, so each row of the mask
    gradient sums to zero: in bf16 too, where an unnormalised P would leave rounding there."""
    monkeypatch.setattr(bias_grad, "QUERY_TILE", 12)  # 32 = 12 + 12 + 8
    q, k, v, mask, d_out = inputs(torch.bfloat16, 4, 2, 32, 32, 16, 1)
    _, got = grads(lambda q, k, v, m: bias_grad.attention_with_bias_grad(q, k, v, m, 0.25),
                   (q.bfloat16(), k.bfloat16(), v.bfloat16(), mask.float()), d_out)
    row_sums = got[3].sum(-1)
    assert row_sums.abs().max() < 1e-6 * got[3].abs().max()


def _model(name: str, dropout: float = 0.0) -> GPT:
    return tiny_gpt(name, vocab_size=32, n_head=2, n_embd=16, dropout=dropout).train()


@pytest.mark.parametrize("name, used", [(name, name in LEARNED_BIAS) for name in sorted(SCHEMES)])
def test_model_uses_it_exactly_for_learned_biases_in_training(monkeypatch, name, used):
    calls = []
    original = bias_grad.attention_with_bias_grad
    monkeypatch.setattr(bias_grad, "attention_with_bias_grad", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    model = _model(name)
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = model(idx, idx)
    loss.backward()
    assert len(calls) == (2 if used else 0)  # one per layer; alibi's bias has no parameters
    calls.clear()
    with torch.no_grad():
        model(idx, idx)
    assert not calls  # evaluation: plain SDPA with the float32 mask


def test_attention_dropout_keeps_torch_sdpa(monkeypatch):
    calls = []
    monkeypatch.setattr(bias_grad, "attention_with_bias_grad", lambda *a, **kw: calls.append(1))
    model = _model("t5", dropout=0.1)
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
    model(idx, idx)[1].backward()
    assert not calls and model.pe.relative_attention_bias.weight.grad is not None


@pytest.mark.parametrize("mask_batch, bias_batch", [(1, 1), (3, 3), (3, 1)])
def test_custom_ops_pass_opcheck(mask_batch, bias_batch):
    """Both ops are opaque to torch.compile, which plans memory from their fake (meta) outputs:
    opcheck runs the real and fake kernels side by side (shapes, strides, schema, autograd)."""
    g = torch.Generator().manual_seed(0)
    B, T, H, D = 3, 12, 2, 8
    qkv = torch.randn(B, T, 3, H, D, generator=g).bfloat16()  # q, k, v as the model's (B, T, H, hd) views
    q, k, v = (qkv[:, :, i].transpose(1, 2).requires_grad_() for i in range(3))
    hidden = torch.ones(T, T, dtype=torch.bool).triu(1)
    bias = torch.randn(bias_batch, H, T, T, generator=g).masked_fill(hidden, float("-inf")).requires_grad_()
    documents = torch.rand(mask_batch, 1, T, T, generator=g) < 0.3  # more keys hidden per sequence
    mask = bias.detach().expand(mask_batch, -1, -1, -1).masked_fill(documents & ~hidden, float("-inf"))
    mask[..., 0, 0] = 0.0  # every query sees a key
    torch.library.opcheck(torch.ops.pelab.attention_with_bias_grad, (q, k, v, mask, bias, 0.35))
    d_out = torch.randn(B, H, T, D, generator=g).bfloat16()
    torch.library.opcheck(torch.ops.pelab.attention_with_bias_grad_backward,
                          (d_out, q.detach(), k.detach(), v.detach(), mask, bias.detach(), 0.35))


def test_compiled_graph_runs_the_tiled_backward(monkeypatch):
    """Under torch.compile the backward is the same eager kernel, tiles included, not a traced copy."""
    monkeypatch.setattr(bias_grad, "QUERY_TILE", 5)  # 16 = 5 + 5 + 5 + 1
    tiles = []
    original = bias_grad._backward
    monkeypatch.setattr(bias_grad, "_backward", lambda *a: tiles.append(bias_grad.QUERY_TILE) or original(*a))
    model = _model("kerple_log")
    idx = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(module):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            module(idx, idx)[1].backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager = step(model)
    torch._dynamo.reset()
    compiled = step(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert tiles == [5] * 4  # two layers, eager then compiled
    for n, grad in compiled.items():
        torch.testing.assert_close(grad, eager[n], atol=1e-6 * eager[n].abs().max().item() + 1e-12, rtol=0)
