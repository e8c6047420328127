"""Stick-breaking attention (model.normaliser=stick_breaking): the math backend against a float64
reference written from the formula of shawntan/stickbreaking-attention's ``sb_ref.py`` as explicit
products A_ij = sigmoid(z_ij) prod_{j<k<=i} (1 - sigmoid(z_ik)) (``attend_current=True``, no
remainder), with gradients; routes, rows <= 1, causality, documents, windows, query chunks, the KV
cache and bad values."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import AttentionRecorder, AttentionRequest, Terms, resolve
from model.attention.stick_breaking import stick_breaking_probabilities
from model.config import GPTConfig
from model.positions import Pass, layer_contexts
from tests.naive import leaf_params, naive_reference, naive_rotate, set_naive_params
from tests.tiny import build, tiny_gpt

T = 9
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]


def visible(i: int, j: int, window: int | None, documents: list[int] | None) -> bool:
    return j <= i and (window is None or j >= i - window + 1) and (documents is None or documents[i] == documents[j])


def stick_breaking_loops(q, k, v, bias, window=None, documents=None):
    """(1, H, n, d) float64 q, k, v -> (1, n, H*d): each visible key j of query i takes
    sigmoid(z_ij) of what the visible keys k, j < k <= i, left, a product of (1 - sigmoid)."""
    _, H, n, d = v.shape
    z = torch.einsum("bhid,bhjd->bhij", q, k)[0] / math.sqrt(q.shape[-1]) + (0.0 if bias is None else bias)
    rows = []
    for i in range(n):
        out = torch.zeros(H, d, dtype=v.dtype)
        for j in range(n):
            if not visible(i, j, window, documents):
                continue
            a = torch.sigmoid(z[:, i, j])
            for m in range(j + 1, i + 1):
                if visible(i, m, window, documents):
                    a = a * (1 - torch.sigmoid(z[:, i, m]))
            out = out + a[:, None] * v[0, :, j]
        rows.append(out.reshape(H * d))
    return torch.stack(rows)[None]


def loops_layer(attn, x64, pe, params, window=None, documents=None):
    """One attention layer in float64 at positions 0.., the weights read from ``attn``."""
    rotation = naive_reference("NAIVE_ROTATION", pe.name)({}, pe.head_dim) if pe.uses_rotate else None
    bias = naive_reference("NAIVE_BIAS", pe.name) if pe.uses_bias else None
    W, Wp, C = attn.c_attn.weight.detach().double(), attn.c_proj.weight.detach().double(), x64.shape[-1]
    pos, outs = list(range(x64.shape[1])), []
    for b in range(x64.shape[0]):
        y = x64[b : b + 1] @ W.T
        q, k, v = (y[..., n * C:(n + 1) * C].view(1, len(pos), pe.n_head, -1).transpose(1, 2) for n in range(3))
        if rotation is not None:
            q, k = naive_rotate(q, pos, rotation, +1.0), naive_rotate(k, pos, rotation, -1.0)
        b_bias = None if bias is None else bias(pe, params, pos, pos, {})
        outs.append(stick_breaking_loops(q, k, v, b_bias, window, None if documents is None else documents[b]))
    return torch.cat(outs) @ Wp.T


CASES = [("rope", None, False), ("alibi", 3, False), ("nope", None, True), ("rope", 3, True)]


@pytest.mark.parametrize("name, window, documents", CASES, ids=["rope", "alibi-W3", "nope-documents", "rope-W3-doc"])
def test_math_matches_the_formula_with_gradients(name, window, documents):
    """One layer, sharpened weights, against the float64 loops; the input's gradient too."""
    model, attn = build(name, seed=3, normaliser="stick_breaking")[1:]
    set_naive_params(model.pe)
    route = resolve("auto", AttentionRequest(model.pe, torch.device("cpu"), grad=True, normaliser="stick_breaking"))
    positions, docs = torch.arange(T), torch.tensor(DOCUMENTS) if documents else None
    terms = Terms(model.pe, positions, positions, q_documents=docs, k_documents=docs, normaliser="stick_breaking")
    ctx = layer_contexts(terms, route, windows=(window,))[0]
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(4)).requires_grad_(True)
    weights = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    ref = loops_layer(attn, x64, model.pe, leaf_params(model.pe), window, DOCUMENTS if documents else None)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad.double(), x64.grad, atol=1e-5 * x64.grad.abs().max().item(), rtol=1e-4)


def test_weights_by_hand_and_rows_at_most_one():
    """One query, logits 0, ln 3, hidden: the newest key takes 3/4, the older 1/2 of the 1/4 left;
    a long row of large logits stays finite and sums to <= 1 (log space)."""
    z = torch.tensor([[[[0.0, math.log(3.0), -math.inf]]]], dtype=torch.float64)
    torch.testing.assert_close(stick_breaking_probabilities(z), torch.tensor([[[[1 / 8, 3 / 4, 0.0]]]],
                                                                             dtype=torch.float64))
    z = torch.randn(1, 2, 1, 4096, generator=torch.Generator().manual_seed(0)) * 30
    a = stick_breaking_probabilities(z)
    assert torch.isfinite(a).all() and (a.sum(-1) <= 1 + 1e-6).all()


def test_every_route_resolves_to_math_and_flex_refuses():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    for name in ("rope", "alibi", "t5"):
        pe = build(name)[1].pe
        for choice in ("auto", "sdpa", "sdpa_key", "bias_grad", "math"):
            for device, dtype in ((cpu, torch.float32), (cuda, torch.bfloat16)):
                request = AttentionRequest(pe, device, dtype, grad=True, normaliser="stick_breaking")
                assert resolve(choice, request).name == "math"
        assert resolve("auto", AttentionRequest(pe, cpu, queries=1, normaliser="stick_breaking")).name == "math"
        with pytest.raises(ValueError, match="model.attention=flex cannot compute model.normaliser=stick_breaking"):
            resolve("flex", AttentionRequest(pe, cpu, normaliser="stick_breaking"))


def test_causal_packed_and_recorded():
    """A later token never changes an earlier logit; a packed document's logits are its own run's
    at the same positions; the recorded weights are the formula's (rows <= 1)."""
    model = tiny_gpt("rope", 1, normaliser="stick_breaking", sharpen=0.4)
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(2))
    other = idx.clone()
    other[:, 7:] = (other[:, 7:] + 5) % 37
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    record = AttentionRecorder()
    with torch.no_grad():
        full = model(idx)[0]
        torch.testing.assert_close(model(other)[0][:, :7], full[:, :7], atol=1e-6, rtol=1e-6)
        packed = model(idx, None, None, documents)[0]
        alone = model(idx[:1, 5:], torch.arange(5, 12))[0]
        model.hidden(idx, how=Pass(record=record))
    torch.testing.assert_close(packed[:1, 5:], alone, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(packed[:1, 5:], full[:1, 5:], atol=1e-3)
    probs = record.probs[0]
    assert (probs.sum(-1) <= 1 + 1e-6).all() and (probs.sum(-1) < 0.999).any()
    assert (probs.triu(1) == 0).all()


def test_chunked_evaluation_and_greedy_cache_equal_the_whole_forward():
    """Query chunks of 4 of 20 tokens with a window pattern [5, null]: the NLL without chunks;
    greedy decoding with the KV cache: without it, and the cached logits the full forward's."""
    model = tiny_gpt("rope", 9, normaliser="stick_breaking", window_pattern=[5, None], block_size=64, sharpen=0.4)
    idx = torch.randint(0, 37, (2, 20), generator=torch.Generator().manual_seed(8))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        torch.testing.assert_close(model.token_nll(idx, targets, q_chunk=4), model.token_nll(idx, targets),
                                   atol=1e-5, rtol=1e-5)
    prompt = idx[:, :4]
    cached = model.generate(prompt, 10, temperature=0)
    assert torch.equal(cached, model.generate(prompt, 10, temperature=0, cache=False))
    from model.generate import KVCache

    kv = KVCache(len(model.blocks), torch.arange(14), model.config.layer_windows)
    with torch.no_grad():
        h = [model.hidden(cached[:, :5], cache=kv)] + [model.hidden(cached[:, t : t + 1], cache=kv)
                                                       for t in range(5, 14)]
        torch.testing.assert_close(model.logits(torch.cat(h, dim=1)), model(cached)[0], atol=1e-5, rtol=1e-5)


def test_bad_normaliser_fails_with_one_line():
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=8, normaliser="bogus")
    assert str(err.value) == ("model.normaliser must be one of 'softmax', 'sink_learned', 'sink_zero', "
                              "'stick_breaking', got 'bogus'")
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=8, normaliser="stick_breaking", sinks="learned")
    assert str(err.value) == ("model.sinks must be none with model.normaliser=stick_breaking (sinks join a softmax "
                              "denominator), got 'learned'")
    with pytest.raises(ValueError, match="model.attention must be auto or math with model.normaliser=stick_"):
        GPTConfig(vocab_size=8, normaliser="stick_breaking", attention="flex")
    from pelab.lit import model_config

    assert model_config({"vocab_size": 1, "normaliser": "stick_breaking"}).normaliser == "stick_breaking"
