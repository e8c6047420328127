"""CoPE (pe=cope): gates g_ij = sigmoid(q_i . k_j / sqrt(d)) over the visible keys, positions
p_ij = sum_{t=j..i} g_it clamped to npos_max - 1, and logit_ij = (q_i . k_j + interpolation of
q_i . e[floor p], q_i . e[ceil p]) / sqrt(d). A float64 reference written from that formula with
loops (facebookresearch/RAM, projects/cope/src/cope/context_position.py) on the math backend, with
gradients into q/k weights and the table; windows, packed documents, query chunks, the KV cache,
causality, the clamp, and bad input."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, AttentionRequest, resolve
from model.pe import SCHEMES
from tests.tiny import attention_config, build, layer_output

T = 9
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]
DECLARED = [name for name, b in BACKENDS.items() if "scores" in b.terms]


def cope_attention(x, attn, table, npos, window=None, documents=None):
    """(B, T, C) float64 output of one CoPE attention layer, from the formula with loops."""
    B, n, C = x.shape
    H = attn.n_head
    q, k, v = (x @ attn.c_attn.weight.double().T).split(C, dim=-1)
    out = torch.zeros(B, n, H, C // H, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            qh, kh, vh = (t[b].view(n, H, -1)[:, h] for t in (q, k, v))
            d = qh.shape[-1]
            for i in range(n):
                seen = [j for j in range(i + 1) if (window is None or j > i - window)
                        and (documents is None or documents[b][i] == documents[b][j])]
                gate = {t: torch.sigmoid(qh[i] @ kh[t] / math.sqrt(d)) for t in seen}
                logits = []
                for j in seen:
                    p = torch.clamp(sum(gate[t] for t in seen if t >= j), max=npos - 1)
                    lo, hi = math.floor(p.item()), math.ceil(p.item())
                    w = p - lo
                    pos = (1 - w) * (qh[i] @ table[lo]) + w * (qh[i] @ table[hi])
                    logits.append((qh[i] @ kh[j] + pos) / math.sqrt(d))
                weights = torch.softmax(torch.stack(logits), dim=0)
                out[b, i, h] = sum(weights[m] * vh[j] for m, j in enumerate(seen))
    return out.reshape(B, n, C) @ attn.c_proj.weight.double().T


def cope_model(npos_max=None, **overrides):
    _, model, attn = build("cope", {"npos_max": npos_max}, **overrides)
    with torch.no_grad():  # a table far from its zero init: the position term must show
        model.pe.context_table.normal_(std=1.0)
    return model.double(), attn


@pytest.mark.parametrize("backend", DECLARED)
@pytest.mark.parametrize("case", ["plain", "window", "documents", "chunks", "clamped"])
def test_layer_matches_reference_with_gradients(backend, case):
    npos = 3 if case == "clamped" else None  # positions up to 9 clamp at 2
    model, attn = cope_model(npos_max=npos)
    x = torch.randn(2, T, 32, dtype=torch.float64, requires_grad=True)
    window, documents = (3 if case == "window" else None), (DOCUMENTS if case == "documents" else None)
    got = layer_output(model, x, backend, window, documents, chunk=4 if case == "chunks" else None)
    want = cope_attention(x, attn, model.pe.context_table[0], model.pe.npos, window, documents)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    leaves = (attn.c_attn.weight, model.pe.context_table, x)
    got_grads = torch.autograd.grad(got.square().sum(), leaves)
    want_grads = torch.autograd.grad(want.square().sum(), leaves)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-10)
    assert got_grads[1][0].abs().sum() > 0 and got_grads[1][1].abs().sum() == 0  # layer 0 reads its own table


def test_table_changes_the_output_and_is_per_layer():
    model, _ = cope_model()
    idx = torch.randint(0, 31, (1, T))
    before = model(idx)[0]
    with torch.no_grad():
        model.pe.context_table[1].zero_()
    assert not torch.allclose(model(idx)[0], before)
    assert model.pe.context_table.shape == (model.config.n_layer, model.config.block_size + 1, model.config.head_dim)





def test_query_chunks_equal_one_pass():
    model, _ = cope_model()
    idx = torch.randint(0, 31, (2, T))
    torch.testing.assert_close(model.token_nll(idx, idx, q_chunk=4), model.token_nll(idx, idx), rtol=1e-10, atol=1e-12)


def test_auto_routes_to_math():
    pe = SCHEMES["cope"](attention_config())
    for device, dtype in ((torch.device("cpu"), torch.float32), (torch.device("cuda"), torch.bfloat16)):
        assert resolve("auto", AttentionRequest(pe, device, dtype)).name == "math"
        assert resolve("auto", AttentionRequest(pe, device, dtype, grad=True)).name == "math"


def test_bad_input():
    with pytest.raises(ValueError, match="pe.npos_max must be >= 1"):
        SCHEMES["cope"](attention_config(), npos_max=0)
    pe = SCHEMES["cope"](attention_config())
    strict = [name for name, b in BACKENDS.items() if b.strict and "scores" not in b.terms]
    assert strict  # flex: named explicitly, it refuses; the others fall back to math
    for name in strict:
        with pytest.raises(ValueError, match=f"model.attention={name} cannot add pe=cope's terms of the attention"):
            resolve(name, AttentionRequest(pe, torch.device("cpu")))
    request = AttentionRequest(pe, torch.device("cpu"))
    assert {resolve(name, request).name for name in BACKENDS if name not in strict} == {"math"}
    with pytest.raises(ValueError, match="tables for layers 0..1, got layer 2"):
        pe.score_terms(torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 3), torch.ones(3, 3, dtype=torch.bool), 2)


def test_a_training_route_that_does_not_fit_is_refused_naming_why(monkeypatch):
    import model.attention as attention

    monkeypatch.setattr(attention, "free_device_bytes", lambda device: 8 * 2 ** 30)
    pe = SCHEMES["cope"](attention_config(block_size=1024, n_layer=12, n_head=12, n_embd=48))
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match=r"model.attention=auto with pe=cope resolves to math \(only math adds its "
                                             r"terms of the attention scores\), .* Ways out: a smaller data.batch_size"):
            resolve("auto", AttentionRequest(pe, torch.device("cuda"), dtype, 0.1, grad=True, queries=1024, batch=16,
                                             layers=12))
