"""PoPE (model/pe/pope.py) against a float64 reference transcribed from x-transformers
(x_transformers/x_transformers.py: ``PolarEmbedding``, ``apply_polar_pos_emb``, and ``Attention``'s
scale ``dim_head ** -0.5``): the logit of head h, query i at position p_i, key j at p_j is

    sum_c softplus(q_c) softplus(k_c) cos((p_i - p_j) theta_c - delta_hc) / sqrt(d),  theta_c = base^(-c/d),

written as loops over i, j (token order: causal) and c. Every backend PoPE runs on, per-sequence
positions (restarted and repeated), packed documents, the KV cache, delta's gradient and range,
linear scaling and the refusals. The shared suites cover it too: compile(fullgraph=True) in
tests/model/test_compile.py, causality in tests/attention/test_causality.py, windows in
tests/attention/test_windows.py (with delta at its init 0)."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import AttentionRequest, resolve
from model.generate import KVCache
from model.pe import SCHEMES
from model.pe.rope_scaling import RopeScaling
from model.pe.scaling import apply_scaling, scaled
from model.positions import Pass
from tests.naive import naive_heads, naive_linear
from tests.tiny import attention_config, build, contexts, tiny_gpt

H, D = 4, 8  # attention_config: 4 heads of 8 dims
ROWS = [[0, 1, 2, 3, 4, 0, 1, 2, 3], [5, 5, 5, 2, 2, 7, 0, 0, 9]]  # a restart, repeats


def delta_values() -> torch.Tensor:
    """Offsets spread over (-2 pi, 0), distinct per head and component, so a mix-up shows."""
    return -2 * math.pi * torch.rand(H, D, generator=torch.Generator().manual_seed(3)).clamp(0.05, 0.95)


def softplus64(x: torch.Tensor) -> torch.Tensor:
    return torch.log1p(torch.exp(x))


def naive_pope_layer(attn, x64: torch.Tensor, rows, delta: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """c_proj(softmax over keys j <= i of the PoPE logits, times v), float64 loops over i and j (the
    sum over c as a vector of the d components); ``delta`` (H, d) float64."""
    q, k, v = naive_heads(attn, x64)
    B, _, T, d = q.shape
    theta = torch.tensor([base ** (-c / d) for c in range(d)], dtype=torch.float64)
    out = torch.zeros(B, T, H * d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for i in range(T):
                logits = []
                for j in range(i + 1):
                    phase = (rows[b][i] - rows[b][j]) * theta - delta[h]
                    logits.append((softplus64(q[b, h, i]) * softplus64(k[b, h, j]) * torch.cos(phase)).sum()
                                  / math.sqrt(d))
                w = torch.softmax(torch.stack(logits), dim=0)
                out[b, i, h * d:(h + 1) * d] = sum(w[j] * v[b, h, j] for j in range(i + 1))
    return naive_linear(attn.c_proj, out)


def pope_model(backend="auto", seed=0, **overrides):
    cfg, model, attn = build("pope", {}, seed=seed, attention=backend, **overrides)
    with torch.no_grad():
        model.pe.delta.copy_(delta_values())
    return cfg, model, attn


@pytest.mark.parametrize("backend", ["sdpa", "math", "flex"])
@pytest.mark.parametrize("pos", ["offset", "rows"])
def test_layer_matches_the_float64_formula_with_delta_gradients(backend, pos):
    """One layer on each backend PoPE declares: output, and (not flex: no CPU backward) the
    gradients of the input and of delta, against float64 autograd through the loops."""
    cfg, model, attn = pope_model(backend, seed=7)
    rows = [list(range(37, 46))] * 2 if pos == "offset" else ROWS
    positions = torch.tensor(rows[0]) if pos == "offset" else torch.tensor(rows)
    x = torch.randn(2, 9, cfg.n_embd, requires_grad=True)
    grad = backend != "flex"
    with torch.set_grad_enabled(grad):
        ctx = contexts(model, positions)[0]
        assert ctx.backend.name == backend
        y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    delta64 = model.pe.delta.detach().double().requires_grad_(True)
    ref = naive_pope_layer(attn, x64, rows, delta64)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    weights = torch.randn(2, 9, cfg.n_embd, dtype=torch.float64)
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    for got, want in ((x.grad, x64.grad), (model.pe.delta.grad, delta64.grad)):
        scale = want.abs().max().item()
        assert scale > 1e-6
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-4)


def test_backends_it_declares_and_auto():
    """Rotation only, no bias: auto takes SDPA on CPU and CUDA; flex and math run it; sdpa_key
    (an ALiBi form) does not apply and falls back to SDPA."""
    _, model, _ = pope_model()
    pe = model.pe
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert model.attention(cpu).name == model.attention(cuda).name == "sdpa"
    for device in (cpu, cuda):
        assert resolve("flex", AttentionRequest(pe, device)).name == "flex"
        assert resolve("math", AttentionRequest(pe, device)).name == "math"
        assert resolve("sdpa_key", AttentionRequest(pe, device)).name == "sdpa"


@pytest.mark.parametrize("backend", ["sdpa", "math"])
def test_causal_by_token_order_with_restarted_positions(backend):
    """A token's logits do not change with the tokens after it, though later tokens sit at
    smaller positions (restarts) or the same ones (repeats)."""
    _, model, _ = pope_model(backend, seed=1)
    idx = torch.randint(0, 31, (2, 9), generator=torch.Generator().manual_seed(4))
    other = idx.clone()
    other[:, 5:] = (other[:, 5:] + 7) % 31
    positions = torch.tensor(ROWS)
    with torch.no_grad():
        a, b = model(idx, positions=positions)[0], model(other, positions=positions)[0]
    assert torch.equal(a[:, :5], b[:, :5])
    assert not torch.allclose(a[:, 5:], b[:, 5:])


@pytest.mark.parametrize("backend", ["sdpa", "math"])  # flex: tests/attention/test_document_mask.py
def test_packed_documents_score_as_if_alone(backend):
    """Two documents packed in one row, positions restarting at each: every token's logits
    equal those of its document run alone."""
    _, model, _ = pope_model(backend, seed=2)
    idx = torch.randint(0, 31, (1, 10), generator=torch.Generator().manual_seed(5))
    documents = torch.tensor([[0] * 4 + [1] * 6])
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]])
    with torch.no_grad():
        packed = model.logits(model.hidden(idx, positions, documents))
        alone = torch.cat([model(idx[:, :4])[0], model(idx[:, 4:])[0]], dim=1)
    torch.testing.assert_close(packed, alone, atol=1e-5, rtol=1e-5)


def test_kv_cache_decoding_equals_no_cache_and_the_full_forward():
    """Greedy decoding with the cache (keys stored in their 2d-dim polar form) = without it,
    with grouped key heads, and step-by-step logits = one full forward."""
    model = tiny_gpt("pope", 3, n_kv_head=2, sharpen=0.3)
    with torch.no_grad():
        model.pe.delta.copy_(delta_values())
    prompt = torch.randint(0, 37, (2, 5), generator=torch.Generator().manual_seed(6))
    tokens = model.generate(prompt, 8, temperature=0)
    assert torch.equal(tokens, model.generate(prompt, 8, temperature=0, cache=False))
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(len(model.blocks), torch.arange(tokens.shape[1]))
        steps = [model.logits(model.hidden(tokens[:, :5], cache=cache))]
        steps += [model.logits(model.hidden(tokens[:, t:t + 1], cache=cache)) for t in range(5, tokens.shape[1])]
    assert cache.layers[0].k.shape == (2, 2, 13, 2 * D) and cache.layers[0].v.shape == (2, 2, 13, D)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_delta_trains_and_stays_in_range():
    """delta gets a gradient at its init 0 (the clamp's end), a large step leaves the range and
    ``project`` (after every optimizer step) brings it back; a stored value out of range acts as
    its clamp."""
    model = tiny_gpt("pope", 4)
    assert torch.equal(model.pe.delta, torch.zeros(H, D))
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(7))
    model.train()
    loss = model(idx, idx)[1]
    loss.backward()
    grad = model.pe.delta.grad
    assert grad is not None and grad.abs().max() > 0
    with torch.no_grad():
        model.pe.delta.sub_(1e4 * grad.sign())  # both ends crossed
        assert model.pe.delta.max() > 0 and model.pe.delta.min() < -2 * math.pi
        model.eval()
        out_of_range = model(idx)[0]
        model.pe.project()
        assert model.pe.delta.min() >= -2 * math.pi and model.pe.delta.max() <= 0
        assert torch.equal(model(idx)[0], out_of_range)
    uniform = SCHEMES["pope"](attention_config(), delta_init="uniform").delta
    assert uniform.min() >= -2 * math.pi and uniform.max() <= 0 and uniform.std() > 1


def test_linear_scaling_divides_positions():
    """pe.scaling kind linear (position interpolation): phases at p equal the unscaled ones at p / s,
    for training (``apply_scaling``) and inside one evaluation (``scaled``), restored after it."""
    pe = SCHEMES["pope"](attention_config())
    with torch.no_grad():
        pe.delta.copy_(delta_values())
    p = torch.tensor([0, 4, 10, 300])
    plain = pe.rotation_tables(p, p)
    with scaled(pe, RopeScaling("linear", 2.0, original_length=16)):
        for a, b in zip(pe.rotation_tables(2 * p, 2 * p), plain):
            torch.testing.assert_close(a, b, atol=2e-6, rtol=0)
    assert all(torch.equal(a, b) for a, b in zip(pe.rotation_tables(p, p), plain))
    trained = SCHEMES["pope"](attention_config())
    apply_scaling(trained, {"kind": "linear", "factor": 4.0}, 16)
    torch.testing.assert_close(trained.inv_freq * 4, pe.inv_freq)


@pytest.mark.parametrize("options, message", [
    ({"base": 1.0}, "pe.base must be > 1, got 1.0"),
    ({"delta_init": "normal"}, "pe.delta_init must be one of ('zero', 'uniform'), got 'normal'"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError) as err:
        SCHEMES["pope"](attention_config(), **options)
    assert str(err.value) == message


def test_options_it_cannot_take_are_refused_naming_them():
    """A scaling kind other than linear, and Llama 4's temperature (for layers without position
    information) in a model whose every layer has PoPE: one line naming the key and what is allowed."""
    pe = SCHEMES["pope"](attention_config())
    with pytest.raises(ValueError, match=r"pe.scaling.kind must be one of none, linear for pe=pope, got 'yarn'"):
        apply_scaling(pe, {"kind": "yarn", "factor": 2.0}, 16)
    with pytest.raises(ValueError, match="model.attn_temperature must be none, log_length, logn or ssmax for pe=pope"):
        tiny_gpt("pope", attn_temperature="llama4")


def test_query_chunks_equal_one_pass():
    """Chunked evaluation (query rows in chunks, keys rotated once) equals one pass."""
    _, model, _ = pope_model("sdpa", seed=5)
    idx = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        one = model.hidden(idx)
        chunked = model.hidden(idx, how=Pass(q_chunk=3))
    torch.testing.assert_close(chunked, one, atol=1e-6, rtol=1e-5)
