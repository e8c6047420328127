"""Data-dependent RoPE (pe=rope_dd): Theta_t = sum_{s<=t} omega * phi(W x_s + b) per layer, kv head
and pair (phi softplus, or the identity with step="linear"), logit q_i^T R(Theta_i - Theta_j) k_j,
and with rotate_v the values turned by Theta_j and the output by -Theta_i. A float64 reference
written from that formula with loops (explicit sums, explicit cos/sin per pair) on every backend,
with gradients into the steps; GQA, windows, packed documents, query chunks and the output
operations; the RoPE-equal init, position independence, the KV cache, float64 gradcheck of the angle
path and bad input. Compile, export (native refused, remote code's logits and greedy text) and the
shared scheme tests take it from the registry."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, AttentionRequest, resolve
from model.generate import KVCache
from model.pe import SCHEMES
from tests.tiny import attention_config, build, layer_output, tiny_gpt

T = 9
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]


def softplus(z):
    return torch.log1p(torch.exp(z))


def omega(base: float, pairs: int) -> list[float]:
    """RoPE's frequencies base^(-2k/d), rounded to float32 as the scheme keeps them."""
    return [float(torch.tensor(base ** (-k / pairs), dtype=torch.float32)) for k in range(pairs)]


def turn(vec, angles, sign=1.0):
    """vec (hd,) with pair (p, p + P) turned by sign * angles[p], one explicit cos/sin per pair."""
    P = len(angles)
    out = vec.clone()
    for p in range(P):
        a = sign * angles[p]
        c, s = torch.cos(a), torch.sin(a)
        out[p] = vec[p] * c - vec[p + P] * s
        out[p + P] = vec[p + P] * c + vec[p] * s
    return out


def rope_dd_attention(x, attn, step, base=10000.0, rotate_v=False, window=None, documents=None, ops=(),
                      phi="softplus"):
    """(B, T, C) float64 output of one rope_dd attention layer, from the formula with loops; ``ops``:
    the layer's output operations, applied to the unrotated output and own values; ``phi``: softplus
    or linear (the steps W x + b themselves, signed)."""
    B, n, C = x.shape
    H, G, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    P, group = hd // 2, H // G
    q, k, v = (x @ attn.c_attn.weight.double().T).split((C, G * hd, G * hd), dim=-1)
    q, k, v = q.view(B, n, H, hd), k.view(B, n, G, hd), v.view(B, n, G, hd)
    z = x @ step.weight.double().T + step.bias.double()
    phi = (softplus(z) if phi == "softplus" else z).view(B, n, G, P)
    w = omega(base, P)
    theta = [[[torch.stack([sum(w[p] * phi[b, s, g, p] for s in range(t + 1)) for p in range(P)])
               for g in range(G)] for t in range(n)] for b in range(B)]  # theta[b][t][g]: (P,)
    out = torch.zeros(B, H, n, hd, dtype=torch.float64)
    own = torch.zeros(B, H, n, hd, dtype=torch.float64)
    for b in range(B):
        for g in range(G):  # each token's key and value turned once by its own Theta
            keys = [turn(k[b, j, g], theta[b][j][g]) for j in range(n)]
            values = [turn(v[b, j, g], theta[b][j][g]) if rotate_v else v[b, j, g] for j in range(n)]
            for h in range(g * group, (g + 1) * group):  # the query heads of kv head g
                for i in range(n):
                    seen = [j for j in range(i + 1) if (window is None or j > i - window)
                            and (documents is None or documents[b][i] == documents[b][j])]
                    qi = turn(q[b, i, h], theta[b][i][g])
                    a = torch.softmax(torch.stack([qi @ keys[j] / math.sqrt(hd) for j in seen]), dim=0)
                    y = sum(a[m] * values[j] for m, j in enumerate(seen))
                    out[b, h, i] = turn(y, theta[b][i][g], -1.0) if rotate_v else y
                    own[b, h, i] = v[b, i, g]
    for op in ops:
        out = op(out, x, own)
    return out.transpose(1, 2).reshape(B, n, C) @ attn.c_proj.weight.double().T


def rope_dd_model(dtype=torch.float64, rotate_v=False, base=10000.0, step="softplus", **overrides):
    _, model, attn = build("rope_dd", {"rotate_v": rotate_v, "base": base, "step": step}, **overrides)
    with torch.no_grad():  # strong, varied steps: the data dependence must show
        for step in model.pe.steps:
            step.weight.normal_(std=0.5)
            step.bias.uniform_(-1.0, 2.0)
        for op in attn.output_ops:
            for p in op.parameters():
                p.normal_(std=0.5)
    return model.to(dtype), attn


CASES = {  # name: (model options, window, documents, query chunk)
    "plain": ({}, None, None, None),
    "rotate_v": ({"rotate_v": True}, None, None, None),
    "gqa_rotate_v": ({"rotate_v": True, "n_kv_head": 2}, None, None, None),
    "window": ({}, 3, None, None),
    "documents_rotate_v": ({"rotate_v": True}, None, DOCUMENTS, None),
    "linear_gqa_rotate_v": ({"rotate_v": True, "step": "linear", "n_kv_head": 2}, None, None, None),
    "chunks": ({"rotate_v": True}, 6, None, 4),
    "base_output_ops": ({"rotate_v": True, "base": 50.0, "n_kv_head": 2, "xsa": "plain",
                         "output_gate": "elementwise"}, None, None, None),
}
# the backends that serve the scheme themselves (sdpa_key needs ALiBi slopes; CPU flex has no backward: forward only)
GRAD_BACKENDS = [name for name, b in BACKENDS.items()
                 if b.refusal(AttentionRequest(SCHEMES["rope_dd"](attention_config()), torch.device("cpu"),
                                               grad=True)) is None]


@pytest.mark.parametrize("case", CASES)
def test_layer_matches_reference_with_step_gradients(case):
    options, window, documents, chunk = CASES[case]
    model, attn = rope_dd_model(**options)
    step = model.pe.steps[0]
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    want = rope_dd_attention(x, attn, step, model.pe.base, model.pe.rotate_v, window, documents, attn.output_ops,
                             options.get("step", "softplus"))
    wrt = (step.weight, step.bias, x)
    want_grads = torch.autograd.grad(want.square().sum(), wrt)
    for backend in GRAD_BACKENDS:
        got = layer_output(model, x, backend, window, documents, chunk=chunk)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10, msg=f"{backend}")
        for g, w in zip(torch.autograd.grad(got.square().sum(), wrt), want_grads):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10, msg=f"{backend} gradient")


@torch.no_grad()
def test_flex_matches_reference():
    """Forward only: CPU flex has no backward for q, k, v (gradients on flex: the CUDA tests)."""
    options, window, documents, chunk = CASES["documents_rotate_v"]
    model, attn = rope_dd_model(**options)
    x = torch.randn(2, T, 32, dtype=torch.float64)
    want = rope_dd_attention(x, attn, model.pe.steps[0], model.pe.base, model.pe.rotate_v, window, documents)
    torch.testing.assert_close(layer_output(model, x, "flex", window, documents), want, rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_every_backend_name_serves_it():
    """The scheme acts before the backend: every model.attention gives one model (sdpa_key resolves to sdpa;
    flex: against the reference and in the cache tests)."""
    model, _ = rope_dd_model(rotate_v=True, window_pattern=[3, None])
    idx = torch.randint(0, 31, (2, T))
    want = model(idx)[0]
    for name in (n for n in BACKENDS if n != "flex"):
        request = model.request(idx.device, torch.float64, T, 2)
        assert resolve(name, request).name in (name, "sdpa")
        model.config.attention = name
        torch.testing.assert_close(model(idx)[0], want, rtol=1e-10, atol=1e-12, msg=name)


def test_float32_model_is_close_to_reference():
    model, attn = rope_dd_model(dtype=torch.float32, rotate_v=True)
    x = torch.randn(2, T, 32)
    with torch.no_grad():
        got = layer_output(model, x, "sdpa").double()
    torch.testing.assert_close(got, rope_dd_attention(x.double(), attn, model.pe.steps[0], rotate_v=True),
                               rtol=1e-5, atol=1e-5)


def test_gradcheck_of_the_angle_path():
    """float64 gradcheck through the steps' weights, bias and the input: phi, the float64 sum and the
    turns of q, k, v and the output, whose angle gradient is _Turn's own derivative."""
    model, attn = rope_dd_model(rotate_v=True, n_kv_head=2)
    step = model.pe.steps[0]
    x = torch.randn(1, 4, 32, dtype=torch.float64, requires_grad=True)
    leaves = (step.weight.detach().clone().requires_grad_(True), step.bias.detach().clone().requires_grad_(True), x)
    assert torch.autograd.gradcheck(lambda w, b, x: _layer_with(model, w, b, x), leaves, fast_mode=True)


def _layer_with(model, weight, bias, x):
    """The first layer's output with the steps' parameters replaced by ``weight``, ``bias`` (gradcheck's leaves)."""
    step = model.pe.steps[0]
    saved = step.weight, step.bias
    del step.weight, step.bias
    step.weight, step.bias = weight, bias
    try:
        return layer_output(model, x, "math")
    finally:
        del step.weight, step.bias
        step.weight, step.bias = saved


@torch.no_grad()
@pytest.mark.parametrize("step", ["softplus", "linear"])
def test_init_is_plain_rope(step):
    """W = 0 and phi(b) = 1: Theta_t = omega (t + 1), so every logit is RoPE's (a shift of all positions)."""
    rope = tiny_gpt("rope", n_kv_head=2).double()
    dd = tiny_gpt("rope_dd", n_kv_head=2, pe_options={"step": step}).double()
    missing, unexpected = dd.load_state_dict(rope.state_dict(), strict=False)
    assert not unexpected and all(name.startswith("pe.steps.") for name in missing)
    idx = torch.randint(0, 37, (2, 16))
    torch.testing.assert_close(dd(idx)[0], rope(idx)[0], rtol=1e-10, atol=1e-10)
    with torch.no_grad():
        dd.pe.steps[1].weight.normal_(std=0.5)
    assert not torch.allclose(dd(idx)[0], rope(idx)[0], atol=1e-4)  # the steps do act


@torch.no_grad()
@pytest.mark.parametrize("rotate_v", [False, True])
def test_a_linear_step_of_zero_stops_the_clock(rotate_v):
    """step=linear, W = 0 and b = 0: no token turns anything, so the model is NoPE's exactly; a negative
    b turns backwards (RoPE's angles negated: RoPE's logits at reversed positions). A softplus step
    cannot do either (it is > 0 for every b)."""
    nope = tiny_gpt("nope", n_kv_head=2).double()
    dd = tiny_gpt("rope_dd", n_kv_head=2, pe_options={"step": "linear", "rotate_v": rotate_v}).double()
    dd.load_state_dict(nope.state_dict(), strict=False)
    for s in dd.pe.steps:
        s.bias.zero_()
    idx = torch.randint(0, 37, (2, 16))
    torch.testing.assert_close(dd(idx)[0], nope(idx)[0], rtol=1e-10, atol=1e-10)
    rope = tiny_gpt("rope", n_kv_head=2).double()
    dd.load_state_dict(rope.state_dict(), strict=False)
    for s in dd.pe.steps:
        s.bias.fill_(-1.0)
    if not rotate_v:  # Theta_i - Theta_j = -omega (i - j): RoPE's logits at the reversed positions 15 - t
        torch.testing.assert_close(dd(idx)[0], rope(idx, positions=15 - torch.arange(16))[0], rtol=1e-10, atol=1e-10)


@torch.no_grad()
def test_never_reads_positions():
    model, _ = rope_dd_model(rotate_v=True)
    idx = torch.randint(0, 31, (2, T))
    want = model(idx)[0]
    for positions in (torch.arange(T) + 1000, torch.tensor([0, 3, 4, 9, 10, 20, 21, 22, 30])):
        torch.testing.assert_close(model(idx, positions=positions)[0], want, rtol=0, atol=0)
    later = idx.clone()
    later[:, 6:] = (later[:, 6:] + 1) % 31  # causal by token order
    torch.testing.assert_close(model(later)[0][:, :6], want[:, :6], rtol=0, atol=0)


@torch.no_grad()
@pytest.mark.parametrize("rotate_v", [False, True])
def test_packed_documents_restart_the_angles(rotate_v):
    """A packed document's outputs are those of the document alone: its angles in effect start at its first token."""
    model, _ = rope_dd_model(rotate_v=rotate_v)
    idx = torch.randint(0, 31, (1, T))
    packed = model(idx, documents=torch.tensor([[0] * 4 + [1] * 5]))[0]
    torch.testing.assert_close(packed[:, :4], model(idx[:, :4])[0], rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(packed[:, 4:], model(idx[:, 4:])[0], rtol=1e-10, atol=1e-12)


CACHE_CASES = {  # name: (model options, model.attention)
    "plain": ({}, "auto"),
    "rotate_v_gqa_windowed": ({"rotate_v": True, "n_kv_head": 2, "window_pattern": [3, None]}, "auto"),
    "rotate_v_output_ops": ({"rotate_v": True, "xsa": "gated", "output_gate": "headwise"}, "auto"),
    "flex_windowed_gqa": ({"rotate_v": True, "n_kv_head": 2, "window_pattern": [3, None]}, "flex"),
}


@torch.no_grad()
@pytest.mark.parametrize("case", CACHE_CASES)
def test_kv_cache_equals_no_cache(case):
    options, attention = CACHE_CASES[case]
    model, _ = rope_dd_model(attention=attention, **options)
    idx = torch.randint(0, 31, (2, T))
    full = model.hidden(idx)
    cache = KVCache(len(model.blocks), torch.arange(T), model.config.layer_windows)
    parts = [model.hidden(idx[:, s:e], cache=cache) for s, e in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-12)


@torch.no_grad()
def test_greedy_generation_with_cache_equals_without():
    model = tiny_gpt("rope_dd", pe_options={"rotate_v": True}, sharpen=0.5)
    with torch.no_grad():
        for step in model.pe.steps:
            step.weight.normal_(std=0.5)
    prompt = torch.randint(0, 37, (1, 4))
    out = model.generate(prompt, 10, temperature=0.0)
    ids = prompt
    for _ in range(10):  # no cache: one full forward per new token
        ids = torch.cat((ids, model(ids)[0][:, -1:].argmax(-1)), dim=1)
    assert torch.equal(out, ids)


def test_turns_exact_at_long_lengths():
    """Theta is summed and its cos/sin taken in float64: at 16 x 1024 tokens (pair 0, omega_0 = 1, Theta
    grows to ~10^4) the float32 tables are within one float32 rounding of cos and sin of the exact sum of
    the scheme's float32 steps, where a float32 running sum errs by ~eps Theta."""
    pe = SCHEMES["rope_dd"](attention_config(n_layer=1))
    x = torch.randn(1, 16 * 1024, 32)
    with torch.no_grad():
        pe.steps[0].weight.normal_(std=0.3)
        _, cos, sin = pe._tables(pe.layer_terms(x, 0), torch.float32)
        steps = torch.nn.functional.softplus(pe.steps[0](x))[0, :, 0]  # float32, as the scheme computes them
    exact = torch.cumsum(steps.double(), dim=0)
    assert exact[-1] > 5000
    assert (cos[0, 0, :, 0].double() - exact.cos()).abs().max() <= 2 ** -24
    assert (sin[0, 0, :, 4].double() - exact.sin()).abs().max() <= 2 ** -24
    assert (torch.cumsum(steps, dim=0).double().cos() - exact.cos()).abs().max() > 100 * 2 ** -24  # why float64


def test_model_trains_a_step():
    """(One graph under torch.compile, bf16 and float32: tests/model/test_compile.py, which takes every scheme.)"""
    model = tiny_gpt("rope_dd", pe_options={"rotate_v": True}).train()
    idx = torch.randint(0, 37, (2, 16))
    _, loss = model(idx, idx)
    loss.backward()
    assert all(s.weight.grad is not None and s.weight.grad.abs().sum() > 0 for s in model.pe.steps)
    assert model.pe.decayed_parameters() == [s.weight for s in model.pe.steps]


def test_bad_input():
    from pelab.config import ConfigError, check_options
    from model.pe.rope import RoPE

    config = attention_config()
    for options, match in (({"rotate_v": "yes"}, r"pe.rotate_v must be true or false.*'yes'"),
                           ({"base": 1.0}, r"pe.base must be a number > 1.*1.0"),
                           ({"base": "big"}, r"pe.base must be a number > 1.*'big'"),
                           ({"step": "relu"}, r"pe.step must be one of softplus, linear.*'relu'")):
        with pytest.raises(ValueError, match=match):
            SCHEMES["rope_dd"](config, **options)
    with pytest.raises(ValueError, match="steps for layers 0..1, got layer 2"):
        SCHEMES["rope_dd"](config).layer_terms(torch.zeros(1, 3, 32), 2)
    with pytest.raises(ValueError, match="pe.scaling.kind"):
        SCHEMES["rope_dd"](config).scale(type("S", (), {"kind": "linear"})())
    with pytest.raises(ConfigError, match="rotate_v") as refused:  # rotate_v belongs to rope_dd alone
        check_options("pe", {"base": 10000.0, "rotate_v": True}, RoPE, ignore=("config",))  # as pelab/lit.py
    assert "\n" not in str(refused.value)
    # (pe=rope_dd pe.nope_every=2, refused as FoX's: tests/harness/test_config_errors.py)
