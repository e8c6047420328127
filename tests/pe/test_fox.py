"""FoX (pe=fox): per-layer, per-head forget gates f_t = sigmoid(w . x_t + b) of the layer's input, and
logit_ij += sum_{t=j+1..i} log f_t. A float64 reference written from that formula with loops
(zhixuan-lin/forgetting-transformer, modeling_forgetting_transformer.py, fgate_type="full") on every
backend that declares the terms, with gradients into the gates; windows, packed documents, sinks,
query chunks, the KV cache, the 16x-length exactness of c_i - c_j, and bad input."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from model.attention import BACKENDS, AttentionRequest, resolve
from model.attention.base import pair_terms
from model.pe import SCHEMES
from tests.tiny import attention_config, build, layer_output, tiny_gpt

T = 9
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]
DECLARED = [name for name, b in BACKENDS.items() if "layer" in b.terms]


def fox_attention(x, attn, gate, window=None, documents=None, sink=None):
    """(B, T, C) float64 output of one FoX attention layer, from the formula with loops."""
    B, n, C = x.shape
    H = attn.n_head
    q, k, v = (x @ attn.c_attn.weight.double().T).split(C, dim=-1)
    log_f = torch.nn.functional.logsigmoid(x @ gate.weight.double().T + gate.bias.double())  # (B, T, H)
    out = torch.zeros(B, n, H, C // H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            qh, kh, vh = (t[b].view(n, H, -1)[:, h] for t in (q, k, v))
            for i in range(n):
                seen = [j for j in range(i + 1) if (window is None or j > i - window)
                        and (documents is None or documents[b][i] == documents[b][j])]
                zero = torch.zeros((), dtype=torch.float64)
                logits = torch.stack([qh[i] @ kh[j] / math.sqrt(qh.shape[-1])
                                      + sum((log_f[b, t, h] for t in range(j + 1, i + 1)), zero) for j in seen])
                if sink is not None:
                    logits = torch.cat((logits, sink[h].double().view(1)))
                w = torch.softmax(logits, dim=0)[:len(seen)]
                out[b, i, h] = sum(w[m] * vh[j] for m, j in enumerate(seen))
    return out.reshape(B, n, C) @ attn.c_proj.weight.double().T


def fox_model(sinks="none", dtype=torch.float64, **overrides):
    _, model, attn = build("fox", sinks=sinks, **overrides)
    with torch.no_grad():  # strong, varied gates: the decay must show
        for gate in model.pe.gates:
            gate.weight.normal_(std=1.0)
            gate.bias.uniform_(-1.0, 2.0)
        if sinks == "learned":
            attn.sinks.copy_(torch.tensor([1.5, -0.7, 0.0, 3.0]))
    return model.to(dtype), attn


@pytest.mark.parametrize("backend", DECLARED)
@pytest.mark.parametrize("case", ["plain", "window", "documents", "sinks", "chunks"])
def test_layer_matches_reference_with_gate_gradients(backend, case):
    """Gradients into the gates (and the sinks) and the input; on flex, whose eager CPU kernel
    differentiates only what score_mod captures, q, k and v are frozen (their gradient: the cuda tests)."""
    model, attn = fox_model(sinks="learned" if case == "sinks" else "none")
    frozen = backend == "flex"
    attn.c_attn.requires_grad_(not frozen)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=not frozen)
    window = {"window": 3, "chunks": 6}.get(case)  # chunks of 4 rows: the last sees keys 3..8
    documents = DOCUMENTS if case == "documents" else None
    got = layer_output(model, x, backend, window, documents, chunk=4 if case == "chunks" else None)
    want = fox_attention(x, attn, model.pe.gates[0], window, documents, attn.sinks if case == "sinks" else None)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    gate = model.pe.gates[0]
    wrt = (gate.weight, gate.bias, *((attn.sinks,) if case == "sinks" else ()), *(() if frozen else (x,)))
    got_grads = torch.autograd.grad(got.square().sum(), wrt)
    want_grads = torch.autograd.grad(want.square().sum(), wrt)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)


def test_float32_model_is_close_to_reference():
    model, attn = fox_model(dtype=torch.float32)
    x = torch.randn(2, T, 32)
    for backend in DECLARED:
        with torch.no_grad():  # forward only (CPU flex differentiates no q, k, v)
            got = layer_output(model, x, backend).double()
        torch.testing.assert_close(got, fox_attention(x.double(), attn, model.pe.gates[0]), rtol=1e-5, atol=1e-5)


def test_gates_change_the_output_and_are_per_layer():
    model, _ = fox_model()
    idx = torch.randint(0, 31, (1, T))
    before = model(idx)[0]
    with torch.no_grad():
        model.pe.gates[1].bias.fill_(-5.0)  # layer 1 forgets almost everything
    assert not torch.allclose(model(idx)[0], before)
    assert len(model.pe.gates) == model.config.n_layer





def test_query_chunks_equal_one_pass():
    model, _ = fox_model()
    idx = torch.randint(0, 31, (2, T))
    torch.testing.assert_close(model.token_nll(idx, idx, q_chunk=4), model.token_nll(idx, idx), rtol=1e-10, atol=1e-12)


def test_pair_terms_exact_at_16x_the_training_length():
    """c_i - c_j at 16 x 64 tokens with strongly forgetting gates (|c| grows to ~10^4) stays
    within float32's rounding of the difference itself; float32 c would err by eps |c_i|."""
    torch.manual_seed(0)
    n = 16 * 64
    log_f = torch.nn.functional.logsigmoid(torch.randn(1, 2, n, dtype=torch.float64) * 3 - 4)
    c = torch.cumsum(log_f, dim=-1)
    exact = c[..., :, None] - c[..., None, :]
    got = pair_terms(c, c).double()
    bound = exact.abs() * 2 ** -23 + 1e-12
    assert ((got - exact).abs() <= bound).all()
    naive = (c.float()[..., :, None] - c.float()[..., None, :]).double()
    assert ((naive - exact).abs() > bound).any()  # why the split is needed


def test_flex_score_mod_exact_at_16x_the_training_length():
    """Flex adds c_i - c_j in its float32 score_mod from each c's float32 head and remainder: at
    16 x 64 tokens (|c| grows to ~4000) its attention weights are within a few float32 roundings
    of each logit of the float64 formula's, and the gradient into c is the float64 one (the
    remainder carries none: it must not count twice). Float32 c errs by eps |c_i| (~190x the bound)."""
    from model.attention.flex import FlexState

    torch.manual_seed(0)
    n = 16 * 64
    log_f = torch.nn.functional.logsigmoid(torch.randn(1, 1, n, dtype=torch.float64) * 3 - 4)
    c = torch.cumsum(log_f, dim=-1).requires_grad_(True)
    later = torch.ones(n, n, dtype=torch.bool).triu(1)
    exact = torch.softmax((c[..., :, None] - c[..., None, :]).masked_fill(later, -math.inf), dim=-1)
    q = k = torch.zeros(1, 1, n, 8)  # zero scores: the weights are the terms' softmax,
    v = torch.eye(n).expand(1, 1, n, n)  # read out one key per value dim
    flex, state = BACKENDS["flex"], FlexState(None, torch.arange(n), torch.arange(n))
    got = flex(q, k, v, flex.add_layer_terms(state, c, c, torch.float32), 0.0).double()
    seen = exact > 1e-30  # float32 weights underflow below
    bound = 2 ** -21 * exact * (exact.log().abs() + 1)  # the logit's rounding, relative to the weight
    assert ((got - exact).abs() <= bound)[seen].all()
    weights = torch.randn(1, 1, n, n, dtype=torch.float64)
    (grad,), (want,) = (torch.autograd.grad((p * weights).sum(), c) for p in (got, exact))
    assert (grad - want).norm() <= 1e-6 * want.norm()
    with torch.no_grad():
        naive = flex(q, k, v, replace(state, layer=(c.float(), c.float())), 0.0).double()
    assert ((naive - exact).abs() > bound)[seen].any()  # why the split is needed


def test_backends_declared_and_auto_routes():
    pe = SCHEMES["fox"](attention_config())
    assert resolve("auto", AttentionRequest(pe, torch.device("cpu"))).name == "sdpa"
    assert resolve("auto", AttentionRequest(pe, torch.device("cpu"), grad=True)).name == "sdpa"
    assert resolve("sdpa_key", AttentionRequest(pe, torch.device("cpu"))).name == "sdpa"
    # on CUDA a float32 mask needs float32 SDPA: bf16 takes flex's score_mod, math with dropout (flex has none)
    assert resolve("auto", AttentionRequest(pe, torch.device("cuda"), torch.bfloat16, grad=True)).name == "flex"
    assert resolve("auto", AttentionRequest(pe, torch.device("cuda"), torch.bfloat16, 0.1, grad=True)).name == "math"
    assert resolve("auto", AttentionRequest(pe, torch.device("cuda"), torch.float32, grad=True)).name == "sdpa"
    assert resolve("math", AttentionRequest(pe, torch.device("cpu"))).name == "math"
    assert resolve("flex", AttentionRequest(pe, torch.device("cpu"))).name == "flex"


def test_bad_input():
    pe = SCHEMES["fox"](attention_config())
    with pytest.raises(ValueError, match="gates for layers 0..1, got layer 2"):
        pe.layer_terms(torch.zeros(1, 3, 32), 2)
    with pytest.raises(ValueError, match="pe.scaling.kind"):
        pe.scale(type("S", (), {"kind": "linear"})())


def test_model_trains_a_step():
    model = tiny_gpt("fox").train()
    idx = torch.randint(0, 37, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(g.weight.grad is not None and g.weight.grad.abs().sum() > 0 for g in model.pe.gates)


def test_fox_exports_as_remote_code_not_a_native_class():
    # no transformers class has forget gates; the remote code's logits are checked in tests/scripts/test_export_remote.py
    from pelab.export import unexportable
    from pelab.hf_remote import remote_refusal

    gpt = tiny_gpt("fox")
    assert unexportable(gpt, {}).startswith("pe=fox is not exportable to a native transformers class yet")
    assert remote_refusal(gpt, {}) is None
