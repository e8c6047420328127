"""Attention temperature (``model.attn_temperature``) against a float64 forward written from the
definitions: log-length c(p) = ln(p + 1) / ln L in every layer (Chiang & Cholak 2022, causal
form), Llama 4's c(p) = 1 + a ln(floor((p + 1) / F) + 1) in the NoPE layers only, q scaled
before the softmax; every attention backend, query chunks and KV-cache decoding alike."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.pe.schedule import nope_layers
from tests.naive import (naive_bias, naive_gelu, naive_heads, naive_layer_norm, naive_linear, naive_rotate,
                         naive_softmax_attention, naive_spec)


def log_length(p, L):
    return math.log(p + 1) / math.log(L)


def llama4(p, floor, a):
    return 1 + a * math.log(math.floor((p + 1) / floor) + 1)


def naive_logits(model, idx, positions, name, scale_in_layer):
    """Float64 forward of the GPT: pre-LN blocks, the scheme's rotation and bias (docs/design.md),
    q of layer l times scale_in_layer(l, p) (None: unscaled), tied LM head."""
    spec = naive_spec(name, {}, 4, 8) if name != "nope" else {"rotate": False, "slopes": None}
    x = model.wte.weight.detach().double()[idx]
    for layer, block in enumerate(model.blocks):
        h = naive_layer_norm(x, block.ln_1)
        q, k, v = naive_heads(block.attn, h)
        with_pe = layer not in model.nope_layers
        if with_pe and spec["rotate"]:
            q, k = naive_rotate(q, positions, spec, +1.0), naive_rotate(k, positions, spec, -1.0)
        scale = [scale_in_layer(layer, p) for p in positions]
        if scale[0] is not None:
            q = q * torch.tensor(scale, dtype=torch.float64)[:, None]
        bias = naive_bias(spec["slopes"], positions) if with_pe and spec["slopes"] else None
        x = x + naive_linear(block.attn.c_proj, naive_softmax_attention(q, k, v, bias))
        h = naive_layer_norm(x, block.ln_2)
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(naive_linear(block.mlp.c_fc, h)))
    return naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T


CASES = {  # name: (scheme, nope_every, config options, scale_in_layer)
    "log_length-rope": ("rope", None, dict(attn_temperature="log_length", attn_temperature_length=8),
                        lambda layer, p: log_length(p, 8)),
    "log_length-alibi": ("alibi", None, dict(attn_temperature="log_length"), lambda layer, p: log_length(p, 32)),
    "llama4-nope": ("nope", None, dict(attn_temperature="llama4", attn_temperature_floor=4, attn_temperature_scale=0.5),
                    lambda layer, p: llama4(p, 4, 0.5)),
    "llama4-rope-nope_every": ("rope", 2, dict(attn_temperature="llama4", attn_temperature_floor=3),
                               lambda layer, p: llama4(p, 3, 0.1) if layer == 1 else None),
}


def temperature_gpt(case, backend="auto"):
    name, every, options, _ = CASES[case]
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32, attention=backend, **options)
    model = GPT(cfg, SCHEMES[name](cfg), nope_layers(2, every)).eval()
    with torch.no_grad():  # sharper attention than GPT-2 init, so a wrong scale shows
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.c_attn.weight, std=0.3)
    return model


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("start", [0, 29])
def test_every_backend_matches_the_naive_forward(case, backend, start):
    model = temperature_gpt(case, backend)
    idx = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(1))
    positions = list(range(start, start + 12))
    with torch.no_grad():
        logits, _ = model(idx, positions=torch.tensor(positions))
    ref = naive_logits(model, idx, positions, CASES[case][0], CASES[case][3])
    torch.testing.assert_close(logits.double(), ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_query_chunks_and_cache_decoding_equal_the_full_forward(case):
    model = temperature_gpt(case)
    idx = torch.randint(0, 31, (1, 20), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full, _ = model(idx)
        nll = model.token_nll(idx[:, :-1], idx[:, 1:])
        torch.testing.assert_close(model.token_nll(idx[:, :-1], idx[:, 1:], q_chunk=4), nll, atol=1e-5, rtol=0)
        out = model.generate(idx[:, :5], 10, temperature=0, cache=True)
        assert torch.equal(out, model.generate(idx[:, :5], 10, temperature=0, cache=False))


def test_none_changes_nothing_and_log_length_is_one_at_L():
    torch.manual_seed(0)
    a = GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=4, n_embd=32), SCHEMES["rope"](
        GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=4, n_embd=32))).eval()
    assert a.config.attn_temperature == "none"
    from model.temperature import query_scales

    scale, _ = query_scales(GPTConfig(vocab_size=31, block_size=16, attn_temperature="log_length"), a.pe,
                            torch.arange(20), torch.float32)
    assert scale[15].item() == pytest.approx(1.0) and scale[0].item() == 0.0
    assert scale[19].item() == pytest.approx(math.log(20) / math.log(16))


def test_llama4_constants_are_metas():
    cfg = GPTConfig(vocab_size=31, attn_temperature="llama4")
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale) == (8192, 0.1)


@pytest.mark.parametrize("options, message", [
    (dict(attn_temperature="cosine"), "model.attn_temperature must be one of 'none', 'log_length', 'llama4'"),
    (dict(attn_temperature="log_length", attn_temperature_length=1), "model.attn_temperature_length must be null "
                                                                      "or an integer >= 2"),
    (dict(attn_temperature="llama4", attn_temperature_floor=0), "model.attn_temperature_floor must be a positive"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(vocab_size=31, **options)


def test_llama4_needs_a_layer_without_positions():
    cfg = GPTConfig(vocab_size=31, attn_temperature="llama4")
    with pytest.raises(ValueError, match="llama4 scales the queries of layers without position information"):
        GPT(cfg, SCHEMES["rope"](cfg))
