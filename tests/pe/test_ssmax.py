"""SSMax (``model.attn_temperature=ssmax``; Nakanishi 2025, "Scalable-Softmax Is Superior for
Attention", arXiv 2501.19399, eq. 2 and its query-scaling form) against float64 forwards written
from the paper's definition: the logits of head h at query i are s_h * ln(n) * q_i.k_j / sqrt(d),
n the number of keys the query attends (i + 1 causally, its index in its document + 1 under a
document mask, past + i + 1 after a KV cache), s_h one learned scalar per layer and head; every
backend, query chunks, the cache, its gradient to s_h and one fullgraph compile."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS
from model.attention.math import AttentionRecorder
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.pe.schedule import nope_layers
from model.positions import Pass
from model.temperature import ssmax_init
from tests.naive import (naive_bias, naive_gelu, naive_heads, naive_layer_norm, naive_linear, naive_rotate,
                         naive_softmax_attention, naive_spec)

S = [[0.3, 0.7, 1.1, 1.6], [1.3, 0.2, 0.9, 0.5]]  # s_h of layer 0 and 1: distinct, so a head or layer mix-up shows


def ssmax_gpt(name="rope", backend="auto", every=None, **options):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32, attention=backend,
                    attn_temperature="ssmax", **options)
    model = GPT(cfg, SCHEMES[name](cfg), nope_layers(2, every)).eval()
    with torch.no_grad():  # sharper attention than GPT-2 init, so a wrong scale shows
        for block, s in zip(model.blocks, S):
            torch.nn.init.normal_(block.attn.c_attn.weight, std=0.3)
            block.attn.ssmax.copy_(torch.tensor(s))
    return model


def naive_logits(model, idx, positions, name, s=S, documents=None):
    """Float64 pre-LN GPT (docs/design.md) with q of head h at query t times s[layer][h] * ln(n_t),
    n_t the keys token t attends; ``documents`` (a list of ids): a token sees only its own document's."""
    spec = naive_spec(name, {}, 4, 8) if name != "nope" else {"rotate": False, "slopes": None}
    T = len(positions)
    documents = [0] * T if documents is None else documents
    n = [sum(documents[j] == documents[t] for j in range(t + 1)) for t in range(T)]
    other = torch.tensor([[0.0 if documents[i] == documents[j] else -math.inf for j in range(T)] for i in range(T)],
                         dtype=torch.float64)
    ln_n = torch.tensor([math.log(m) for m in n], dtype=torch.float64)
    x = model.wte.weight.detach().double()[idx]
    for layer, block in enumerate(model.blocks):
        q, k, v = naive_heads(block.attn, naive_layer_norm(x, block.ln_1))
        with_pe = layer not in model.nope_layers
        if with_pe and spec["rotate"]:
            q, k = naive_rotate(q, positions, spec, +1.0), naive_rotate(k, positions, spec, -1.0)
        q = q * (torch.as_tensor(s[layer], dtype=torch.float64)[:, None] * ln_n)[:, :, None]  # (H, T, 1)
        bias = naive_bias(spec["slopes"], positions) if with_pe and spec["slopes"] else torch.zeros(())
        x = x + naive_linear(block.attn.c_proj, naive_softmax_attention(q, k, v, bias + other))
        h = naive_layer_norm(x, block.ln_2)
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(naive_linear(block.mlp.c_fc, h)))
    return naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T


def test_initial_s_is_the_papers():
    """1 / mean(ln n) over a training window: 0.168 at the paper's L = 1024."""
    for L in (2, 32, 1024):
        assert ssmax_init(L) == pytest.approx(L / sum(math.log(n) for n in range(1, L + 1)), rel=1e-12)
    assert round(ssmax_init(1024), 3) == 0.168
    cfg = GPTConfig(vocab_size=31, block_size=64, n_layer=3, n_head=4, attn_temperature="ssmax")
    model = GPT(cfg, SCHEMES["rope"](cfg))
    scales = {n: p for n, p in model.named_parameters() if n.endswith("ssmax")}  # one per layer, (n_head,) each
    assert sorted(scales) == [f"blocks.{i}.attn.ssmax" for i in range(3)]
    for p in scales.values():
        assert p.shape == (4,) and p.dtype == torch.float32
        torch.testing.assert_close(p.detach(), torch.full((4,), ssmax_init(64)))
    cfg = GPTConfig(vocab_size=31, block_size=64, attn_temperature="ssmax", attn_temperature_length=1024)
    assert GPT(cfg, SCHEMES["rope"](cfg)).blocks[0].attn.ssmax[0].item() == pytest.approx(ssmax_init(1024))


def test_one_heads_probabilities_are_the_papers_formula():
    """Layer 0's probabilities (math backend, recorded): softmax_j(s_h ln(i + 1) q_i.k_j / sqrt(d)), j <= i."""
    model = ssmax_gpt("nope")
    idx = torch.randint(0, 31, (1, 12), generator=torch.Generator().manual_seed(1))
    record = AttentionRecorder({0})
    with torch.no_grad():
        model.hidden(idx, how=Pass(attention="math", record=record))
    x = naive_layer_norm(model.wte.weight.detach().double()[idx], model.blocks[0].ln_1)
    q, k, _ = naive_heads(model.blocks[0].attn, x)
    for h, s in enumerate(S[0]):
        for i in range(12):
            z = [s * math.log(i + 1) * float(q[0, h, i] @ k[0, h, j]) / math.sqrt(8) for j in range(i + 1)]
            e = [math.exp(v - max(z)) for v in z]
            want = torch.tensor([v / sum(e) for v in e] + [0.0] * (11 - i), dtype=torch.float64)
            torch.testing.assert_close(record.probs[0][0, h, i].double(), want, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("name, every, start", [("rope", None, 0), ("rope", None, 29), ("alibi", None, 29),
                                                ("nope", None, 0), ("rope", 2, 29)])
def test_every_backend_matches_the_naive_forward(name, every, start, backend):
    model = ssmax_gpt(name, backend, every)
    idx = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = list(range(start, start + 12))
    with torch.no_grad():
        logits, _ = model(idx, positions=torch.tensor(positions))
    torch.testing.assert_close(logits.double(), naive_logits(model, idx, positions, name), atol=2e-5, rtol=1e-5)


def test_packed_documents_count_the_keys_of_the_querys_document():
    model = ssmax_gpt("rope")
    documents = [0] * 6 + [1] * 9 + [2] * 5
    idx = torch.randint(0, 31, (2, 20), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, _ = model(idx, documents=torch.tensor([documents] * 2))
    ref = naive_logits(model, idx, list(range(20)), "rope", documents=documents)
    torch.testing.assert_close(logits.double(), ref, atol=2e-5, rtol=1e-5)


def test_gradient_to_s_matches_the_float64_forward():
    """d(sum of logits * w)/d s_h of every layer, against autograd through the float64 forward."""
    model = ssmax_gpt("rope")
    idx = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(5))
    w = torch.randn(2, 12, 31, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    logits, _ = model(idx)
    (logits.double() * w).sum().backward()
    s = [torch.tensor(row, dtype=torch.float64, requires_grad=True) for row in S]
    (naive_logits(model, idx, list(range(12)), "rope", s) * w).sum().backward()
    for block, ref in zip(model.blocks, s):
        assert ref.grad.abs().min() > 1e-3  # every head's s_h moves the loss
        torch.testing.assert_close(block.attn.ssmax.grad.double(), ref.grad, atol=1e-4, rtol=1e-4)


def test_query_chunks_and_cache_decoding_equal_the_full_forward():
    model = ssmax_gpt("rope")
    idx = torch.randint(0, 31, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        nll = model.token_nll(idx[:, :-1], idx[:, 1:])
        torch.testing.assert_close(model.token_nll(idx[:, :-1], idx[:, 1:], q_chunk=4), nll, atol=1e-5, rtol=0)
        full = model.logits(model.hidden(idx))
        cache = model_cache(model, 20)
        steps = [model.logits(model.hidden(idx[:, :5], cache=cache))]  # a prompt, then one token at a time
        steps += [model.logits(model.hidden(idx[:, t : t + 1], cache=cache)) for t in range(5, 20)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
        out = model.generate(idx[:, :5], 6, temperature=0, cache=True)
        assert torch.equal(out, model.generate(idx[:, :5], 6, temperature=0, cache=False))


def model_cache(model, length):
    from model.generate import KVCache

    return KVCache(len(model.blocks), torch.arange(length))


def test_compiles_fullgraph_as_one_graph_with_eager_gradients():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    model = ssmax_gpt("rope").train()
    idx = torch.randint(0, 31, (2, 16), generator=torch.Generator().manual_seed(7))

    def step(module):
        model.zero_grad(set_to_none=True)
        _, loss = module(idx, idx)
        loss.backward()
        return loss.detach(), [block.attn.ssmax.grad.clone() for block in model.blocks]

    eager = step(model)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(model, fullgraph=True, backend=counter)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second step reuses the first graph
            got = step(compiled)
    assert counter.frame_count == 1
    torch.testing.assert_close(got[0], eager[0], atol=1e-5, rtol=0)
    for g, e in zip(got[1], eager[1]):
        torch.testing.assert_close(g, e, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("options, message", [
    (dict(attn_temperature="ssmax", block_size=1), "model.block_size must be >= 2 with ssmax, got 1"),
    (dict(attn_temperature="ssmax", attn_temperature_length=1),
     "model.attn_temperature_length must be null or an integer >= 2"),
    (dict(attn_temperature="ssmax", window=4), "model.attn_temperature must be none or llama4 with windows "
                                               "(log_length, logn and ssmax count every earlier key), or model.attn_temperature_layers=global "
                                               "(the full-attention layers only), got 'ssmax'"),
    (dict(attn_temperature="ssmx"), "model.attn_temperature must be one of 'none', 'log_length', 'logn', 'llama4', 'ssmax', "
                                    "got 'ssmx'"),
])
def test_bad_options_are_refused_in_one_line(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        GPTConfig(vocab_size=31, **options)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("base, run, allowed", [("none", "ssmax", "not 'ssmax'"), ("ssmax", "log_length", "'ssmax'")])
def test_init_from_across_ssmax_is_refused_in_one_line_before_any_data(tmp_path, base, run, allowed):
    """ssmax's s_h are weights: a checkpoint without them cannot start an ssmax run, nor one with them a run without."""
    from pelab.validate import validate_config
    from tests.harness.test_init_from import run_config, save_base

    save_base(tmp_path / "base.ckpt", [f"model.attn_temperature={base}"])
    with pytest.raises(ValueError) as err:
        validate_config(run_config(tmp_path / "base.ckpt", f"model.attn_temperature={run}"))
    assert f"model.attn_temperature must be {allowed} with init_from={tmp_path / 'base.ckpt'} (trained with " \
           f"attn_temperature='{base}'" in str(err.value) and "\n" not in str(err.value)
    save_base(tmp_path / "same.ckpt", [f"model.attn_temperature={base}"])  # the same side: the weights load
    validate_config(run_config(tmp_path / "same.ckpt", f"model.attn_temperature={base}"))
