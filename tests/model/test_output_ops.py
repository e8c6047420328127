"""Operations on the attention output (model/output_ops/): gated attention (Qiu et al. 2025) and
exclusive self-attention (Zhai 2026; modded-nanogpt's gated form) against float64 formulas
written from the papers' equations, hand-computed values, every backend, the KV cache and
gradients. The export of every scheme with them is in tests/scripts/test_export_remote.py."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS
from model.config import GPTConfig
from model.output_ops import OUTPUTS, ExclusiveSelfAttention, OutputGate
from tests.naive import naive_heads, naive_linear, naive_rotate, naive_softmax_attention, rope_rotation
from tests.position_context import position_context
from tests.tiny import decode_stepwise, tiny_gpt

KINDS = [(op.key, kind) for op in OUTPUTS for kind in op.kinds[1:]]


def spread(model, seed: int = 3):
    """Every output-op weight off its init (gated XSA starts at zero strength), q/k sharpened."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.c_attn.weight, std=0.3)
            for p in block.attn.output_ops.parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def naive_outputs(attn, x64, y, v, options: dict) -> torch.Tensor:
    """(B, T, H*hd) per-head outputs y after XSA and the gate, by loops over tokens and heads:
    z = y - s (y.v) v / |v|^2 with s = 1 (plain) or tanh(x . w_h) (gated); then
    z * sigmoid(x W_g + b), one logit per head (headwise) or per dim (elementwise)."""
    B, T, _ = x64.shape
    H, hd = attn.n_head, attn.head_dim
    ops = {type(op).key: op for op in attn.output_ops}
    out = y.clone()
    for b in range(B):
        for t in range(T):
            for h in range(H):
                yh, vh = out[b, t, h * hd:(h + 1) * hd], v[b, h, t]
                if "xsa" in ops:
                    s = 1.0
                    if options["xsa"] == "gated":
                        s = math.tanh(float(x64[b, t] @ ops["xsa"].alpha.weight.detach().double()[h]))
                    yh = yh - s * torch.dot(yh, vh) / torch.dot(vh, vh) * vh
                if "output_gate" in ops:
                    logits = naive_linear(ops["output_gate"].proj, x64[b, t])
                    g = logits[h] if options["output_gate"] == "headwise" else logits[h * hd:(h + 1) * hd]
                    yh = yh / (1.0 + torch.exp(-g))
                out[b, t, h * hd:(h + 1) * hd] = yh
    return out


@pytest.mark.parametrize("options", [{"xsa": "plain"}, {"xsa": "gated"}, {"output_gate": "headwise"},
                                     {"output_gate": "elementwise"}, {"xsa": "gated", "output_gate": "elementwise"}],
                         ids=lambda o: "+".join(f"{k}={v}" for k, v in o.items()))
def test_layer_is_its_float64_formula(options):
    model = spread(tiny_gpt("rope", 1, bias=True, **options))
    attn = model.blocks[0].attn
    x = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(7)
    with torch.no_grad():
        got = attn(x, position_context(model.pe, positions))
    x64 = x.double()
    q, k, v = naive_heads(attn, x64)
    spec = rope_rotation({}, attn.head_dim)
    q, k = naive_rotate(q, positions.tolist(), spec, +1.0), naive_rotate(k, positions.tolist(), spec, -1.0)
    y = naive_softmax_attention(q, k, v)
    ref = naive_linear(attn.c_proj, naive_outputs(attn, x64, y, v, options))
    torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


def test_xsa_removes_the_component_along_the_own_value_by_hand():
    op = ExclusiveSelfAttention(GPTConfig(vocab_size=2, n_layer=1, n_head=1, n_embd=2), "plain")
    y = torch.tensor([[[[3.0, 4.0], [1.0, 1.0], [2.0, 5.0]]]])  # (B, H, T, hd)
    v = torch.tensor([[[[1.0, 0.0], [2.0, 2.0], [0.0, 0.0]]]])  # a zero value passes y unchanged
    z = op(y, torch.zeros(1, 3, 2), v)
    torch.testing.assert_close(z, torch.tensor([[[[0.0, 4.0], [0.0, 0.0], [2.0, 5.0]]]]))


def test_headwise_gate_by_hand():
    """Zero weights, bias b: every head's output times sigmoid(b_h)."""
    op = OutputGate(GPTConfig(vocab_size=2, n_layer=1, n_head=2, n_embd=4, bias=True), "headwise")
    with torch.no_grad():
        op.proj.weight.zero_()
        op.proj.bias.copy_(torch.tensor([0.0, math.log(3.0)]))  # sigmoid: 1/2 and 3/4
    y = torch.ones(1, 2, 1, 2)
    torch.testing.assert_close(op(y, torch.randn(1, 1, 4), y)[0, :, 0, 0], torch.tensor([0.5, 0.75]))


def test_init_gated_xsa_starts_at_plain_attention_and_the_gate_at_gpt2s():
    model = tiny_gpt("rope", 0, xsa="gated", output_gate="elementwise", n_embd=64)
    for block in model.blocks:
        xsa, gate = block.attn.output_ops  # XSA first, then the gate (modded-nanogpt's order)
        assert isinstance(xsa, ExclusiveSelfAttention) and isinstance(gate, OutputGate)
        assert torch.count_nonzero(xsa.alpha.weight) == 0  # tanh(0) = 0: no subtraction at step 0
        assert 0.015 < gate.proj.weight.std() < 0.025


def test_per_layer_kinds_repeat_over_the_layers():
    model = tiny_gpt("rope", 0, n_layer=4, xsa=["none", "gated"], output_gate=["headwise", "none", "none", "elementwise"])
    kinds = [[(type(op).key, op.kind) for op in block.attn.output_ops] for block in model.blocks]
    assert kinds == [[("output_gate", "headwise")], [("xsa", "gated")], [], [("xsa", "gated"), ("output_gate", "elementwise")]]


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_computes_the_same_model(backend):
    options = dict(xsa=["plain", "gated"], output_gate="elementwise", n_kv_head=2)
    scheme = "t5" if backend == "bias_grad" else "alibi" if backend == "sdpa_key" else "rope"
    ref = spread(tiny_gpt(scheme, 2, **options))
    model = spread(tiny_gpt(scheme, 2, attention=backend, **options))
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    grad = backend == "bias_grad"
    with torch.set_grad_enabled(grad):
        assert model.attention(idx.device).name == backend
        got = model(idx)[0]
    with torch.no_grad():
        want = ref.double()(idx)[0]
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("key, kind", KINDS)
def test_cached_decoding_equals_one_full_forward(key, kind):
    """GQA and a window pattern beside it: the op reads the new tokens' own values, not the cache's."""
    model = spread(tiny_gpt("rope", 4, vocab_size=41, block_size=32, n_kv_head=2, window_pattern=[4, None],
                            **{key: kind}))
    steps, full, _ = decode_stepwise(model, 41)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("key, kind", KINDS)
def test_gradients_are_the_finite_differences(key, kind):
    op = next(o for o in OUTPUTS if o.key == key)(GPTConfig(vocab_size=2, n_layer=1, n_head=2, n_embd=8), kind).double()
    with torch.no_grad():
        for p in op.parameters():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(5)))
    gen = torch.Generator().manual_seed(6)
    y, v = (torch.randn(1, 2, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True) for _ in range(2))
    x = torch.randn(1, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, x, v: op(y, x, v), (y, x, v))


@pytest.mark.parametrize("overrides, message", [
    ({"output_gate": "sigmoid"}, "model.output_gate must be one of 'none', 'headwise', 'elementwise' or a per-layer "
                                 "list of them, got 'sigmoid'"),
    ({"xsa": "exclusive"}, "model.xsa must be one of 'none', 'plain', 'gated' or a per-layer list of them, got "
                           "'exclusive'"),
    ({"xsa": ["plain", "none", "gated"]}, "model.xsa must be one of 'none', 'plain', 'gated' or a list of 1 to "
                                          "model.n_layer=2 of them (layer l uses entry l % length), got "
                                          "['plain', 'none', 'gated']"),
    ({"output_gate": ["headwise", "half"]}, "model.output_gate must be one of 'none', 'headwise', 'elementwise' or a "
                                            "list of 1 to model.n_layer=2 of them (layer l uses entry l % length), "
                                            "got ['headwise', 'half']"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=37, n_layer=2, **overrides)
    assert str(err.value) == message


def test_a_model_with_every_output_op_traces_as_one_graph():
    """torch.compile sees one graph, no break (dynamo only: the CUDA acceptance compiles it)."""
    torch._dynamo.reset()
    model = tiny_gpt("rope", 0, **{op.key: list(op.kinds[1:]) for op in OUTPUTS}).train()
    idx = torch.randint(0, 37, (2, 16), generator=torch.Generator().manual_seed(0))
    explained = torch._dynamo.explain(model)(idx, idx)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
