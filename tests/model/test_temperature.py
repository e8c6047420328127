"""Attention temperature (``model.attn_temperature``) against a float64 forward written from the
definitions: log-length c = ln(n) / ln L in every layer, n the number of keys the query sees
(Chiang & Cholak 2022, causal form), Qwen's logn (1 up to L, log_L n past it; SWAN-GPT's
inference-time scaling), Llama 4's c = 1 + a ln(floor((t + 1) / F) + 1) of the token
index t in the NoPE layers only (Hugging Face's ``cache_position``), q scaled before the softmax;
every attention backend, query chunks, KV-cache decoding, packed documents and randomized
positions alike, and Hugging Face's multiply order in bf16."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, Terms
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.pe.schedule import nope_layers, random_positions
from model.positions import layer_contexts
from model.temperature import query_scales
from tests.naive import (naive_bias, naive_gelu, naive_heads, naive_layer_norm, naive_linear, naive_rotate,
                         naive_softmax_attention, naive_spec)


def log_length(n, L):
    """n: the number of keys the query sees."""
    return math.log(n) / math.log(L)


def logn(n, L):
    """Qwen's logn_list entry for key count n (QwenLM/Qwen modeling_qwen.py): log base L past L, else 1."""
    return math.log(n, L) if n > L else 1


def llama4(t, floor, a):
    """t: the token index."""
    return 1 + a * math.log(math.floor((t + 1) / floor) + 1)


def naive_logits(model, idx, positions, name, scale_in_layer, documents=None):
    """Float64 forward of the GPT: pre-LN blocks, the scheme's rotation and bias (docs/design.md)
    at ``positions`` (a list shared by the batch), q of layer l at token t times
    scale_in_layer(l, t, n) (None: unscaled; n: the keys token t sees), tied LM head;
    ``documents`` (a list of ids): a token sees only the earlier ones of its document."""
    spec = naive_spec(name, {}, 4, 8) if name != "nope" else {"rotate": False, "slopes": None}
    T = len(positions)
    documents = [0] * T if documents is None else documents
    seen = [sum(documents[j] == documents[t] for j in range(t + 1)) for t in range(T)]
    other = torch.tensor([[0.0 if documents[i] == documents[j] else -math.inf for j in range(T)] for i in range(T)],
                         dtype=torch.float64)
    x = model.wte.weight.detach().double()[idx]
    for layer, (block, window) in enumerate(zip(model.blocks, model.config.layer_windows)):
        seen_in = other if window is None else other + torch.tensor(  # a window: keys i - W + 1 .. i
            [[0.0 if i - j < window else -math.inf for j in range(T)] for i in range(T)], dtype=torch.float64)
        h = naive_layer_norm(x, block.ln_1)
        q, k, v = naive_heads(block.attn, h)
        with_pe = layer not in model.nope_layers
        if with_pe and spec["rotate"]:
            q, k = naive_rotate(q, positions, spec, +1.0), naive_rotate(k, positions, spec, -1.0)
        scale = [scale_in_layer(layer, t, seen[t]) for t in range(T)]
        if scale[0] is not None:
            q = q * torch.tensor(scale, dtype=torch.float64)[:, None]
        bias = naive_bias(spec["slopes"], positions) if with_pe and spec["slopes"] else torch.zeros(())
        x = x + naive_linear(block.attn.c_proj, naive_softmax_attention(q, k, v, bias + seen_in))
        h = naive_layer_norm(x, block.ln_2)
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(naive_linear(block.mlp.c_fc, h)))
    return naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T


CASES = {  # name: (scheme, nope_every, config options, scale_in_layer)
    "log_length-rope": ("rope", None, dict(attn_temperature="log_length", attn_temperature_length=8),
                        lambda layer, t, n: log_length(n, 8)),
    "log_length-alibi": ("alibi", None, dict(attn_temperature="log_length"), lambda layer, t, n: log_length(n, 32)),
    "llama4-nope": ("nope", None, dict(attn_temperature="llama4", attn_temperature_floor=4, attn_temperature_scale=0.5),
                    lambda layer, t, n: llama4(t, 4, 0.5)),
    "llama4-rope-nope_every": ("rope", 2, dict(attn_temperature="llama4", attn_temperature_floor=3),
                               lambda layer, t, n: llama4(t, 3, 0.1) if layer == 1 else None),
    # SWAN-GPT's layout: windowed RoPE layers, full NoPE layers scaled by log-length (they see every key)
    "log_length-global-swan": ("rope", 2, dict(attn_temperature="log_length", attn_temperature_length=8,
                                               attn_temperature_layers="global", window_pattern=[4, None]),
                               lambda layer, t, n: log_length(n, 8) if layer == 1 else None),
    # SWAN-GPT's inference-time form: 1 within L = 4, log base L of n past it, on the full layers
    "logn-global-swan": ("rope", 2, dict(attn_temperature="logn", attn_temperature_length=4,
                                         attn_temperature_layers="global", window_pattern=[4, None]),
                         lambda layer, t, n: logn(n, 4) if layer == 1 else None),
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


@pytest.mark.parametrize("case", list(CASES))
def test_packed_documents_at_randomized_positions_match_the_naive_forward(case):
    """A document mask and randomized positions (data.document_mask with pe.randomize_to): log_length's
    n is the number of keys the query sees (its index in its document + 1), llama4's t the index of
    the token in the window (Hugging Face's cache_position), whatever the positions."""
    model = temperature_gpt(case)
    T = 20
    documents = [0] * 6 + [1] * 9 + [2] * 5
    positions = random_positions(1, T, 64, torch.Generator().manual_seed(3))[0].tolist()
    idx = torch.randint(0, 31, (2, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        logits, _ = model(idx, positions=torch.tensor([positions] * 2), documents=torch.tensor([documents] * 2))
    ref = naive_logits(model, idx, positions, CASES[case][0], CASES[case][3], documents)
    torch.testing.assert_close(logits.double(), ref, atol=2e-5, rtol=1e-5)


def test_scales_by_hand_under_documents_randomized_positions_and_a_cache():
    def scales(kind, positions, past=0, documents=None, **options):
        cfg = GPTConfig(vocab_size=31, block_size=4, attn_temperature=kind, **options)  # log_length: L = 4
        return query_scales(cfg, SCHEMES["nope"](cfg), positions, past, documents)[1].flatten().double()

    def close(got, want):
        torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-6, rtol=1e-6)

    randomized = torch.tensor([[3, 9, 10, 20, 21, 40, 41, 63]])
    documents = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    close(scales("log_length", randomized, documents=documents), [log_length(n, 4) for n in (1, 2, 3, 1, 2, 1, 2, 3)])
    close(scales("log_length", randomized), [log_length(n, 4) for n in range(1, 9)])
    close(scales("log_length", torch.tensor([[0, 1, 2, 3, 4, 5]]), documents=torch.tensor([[0, 0, 1, 1, 0, 2]])),
          [log_length(n, 4) for n in (1, 2, 1, 2, 3, 1)])  # an id seen again: its earlier tokens count
    close(scales("log_length", torch.tensor([5, 6, 7]), past=5), [log_length(n, 4) for n in (6, 7, 8)])
    # logn at L = 4, by hand: 1 up to 4 keys, then log_4 5, log_4 6, log_4 7, log_4 8 = 1.5
    close(scales("logn", torch.arange(8)), [1, 1, 1, 1, 1.1609640474, 1.2924812504, 1.4036774610, 1.5])
    close(scales("logn", randomized, documents=documents), [1, 1, 1, 1, 1, 1, 1, 1])  # no document past 4 keys
    llama = dict(attn_temperature_floor=2, attn_temperature_scale=0.5)
    close(scales("llama4", randomized, documents=documents, **llama), [llama4(t, 2, 0.5) for t in range(8)])
    close(scales("llama4", torch.tensor([0, 1, 2]), past=5, **llama), [llama4(t, 2, 0.5) for t in (5, 6, 7)])


def test_llama4_multiplies_in_float32_then_casts_as_hugging_face():
    """bf16: q (bf16) times the float32 scale, rounded once to bf16 (Llama4TextAttention:
    (query_states * attn_scales).to(query_states.dtype), attn_scales float32), not q times a
    bf16-rounded scale."""
    model = temperature_gpt("llama4-nope")
    T, floor, a = 64, 4, 0.5
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(T)
    attn = model.blocks[0].attn
    scales = query_scales(model.config, model.pe, positions)
    terms = Terms(model.pe, positions, positions, dtype=torch.bfloat16)
    plain, scaled = (layer_contexts(terms, BACKENDS["sdpa"], q_scales=q)[0] for q in ((None, None), scales))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        q_raw = attn.qkv(x, plain)[0]
        q = attn.qkv(x, scaled)[0]
    hf_scale = torch.log1p(torch.floor((torch.arange(T).float() + 1.0) / floor)) * a + 1.0  # HF's attn_scales
    assert q.dtype == torch.bfloat16
    assert torch.equal(q, (q_raw * hf_scale[:, None]).to(torch.bfloat16))
    assert not torch.equal(q, q_raw * hf_scale[:, None].to(torch.bfloat16))  # the other order differs


def test_none_changes_nothing_and_log_length_is_one_at_L():
    torch.manual_seed(0)
    a = GPT(GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=4, n_embd=32), SCHEMES["rope"](
        GPTConfig(vocab_size=31, block_size=16, n_layer=1, n_head=4, n_embd=32))).eval()
    assert a.config.attn_temperature == "none"
    scale, _ = query_scales(GPTConfig(vocab_size=31, block_size=16, attn_temperature="log_length"), a.pe,
                            torch.arange(20))
    assert scale[15].item() == pytest.approx(1.0) and scale[0].item() == 0.0
    assert scale[19].item() == pytest.approx(math.log(20) / math.log(16))


def test_logn_within_the_training_length_is_the_model_without_it():
    """SWAN-GPT's scaling acts at inference only: within L a logn model's logits are bit for bit those
    of the same weights without a temperature, so its training is the plain model's."""
    def gpt(**options):
        cfg = GPTConfig(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32, window_pattern=[4, None],
                        **options)
        return GPT(cfg, SCHEMES["rope"](cfg), nope_layers(2, 2)).eval()

    plain = temperature_gpt("logn-global-swan")  # sharp attention: a wrong scale shows
    at_32, at_16 = (gpt(attn_temperature="logn", attn_temperature_length=L, attn_temperature_layers="global")
                    for L in (32, 16))
    without = gpt()
    for model in (at_32, at_16, without):
        model.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 31, (2, 32), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        assert torch.equal(at_32(idx)[0], without(idx)[0])
        assert not torch.equal(at_16(idx)[0], without(idx)[0])  # past L = 16 the full layer's queries scale


def test_llama4_constants_are_metas():
    cfg = GPTConfig(vocab_size=31, attn_temperature="llama4")
    assert (cfg.attn_temperature_floor, cfg.attn_temperature_scale) == (8192, 0.1)


@pytest.mark.parametrize("options, message", [
    (dict(attn_temperature="cosine"), "model.attn_temperature must be one of 'none', 'log_length', 'logn', 'llama4'"),
    (dict(attn_temperature="log_length", attn_temperature_length=1), "model.attn_temperature_length must be null "
                                                                      "or an integer >= 2"),
    (dict(attn_temperature="llama4", attn_temperature_floor=0), "model.attn_temperature_floor must be a positive"),
    (dict(attn_temperature="log_length", window=4), "model.attn_temperature must be none or llama4 with windows "
                                                    "(log_length, logn and ssmax count every earlier key), or "
                                                    "model.attn_temperature_layers=global"),
    (dict(attn_temperature="log_length", attn_temperature_layers="local"), "model.attn_temperature_layers must be "
                                                                            "one of 'all', 'global', got 'local'"),
    (dict(attn_temperature="llama4", attn_temperature_layers="global", window_pattern=[4, None]),
     "model.attn_temperature_layers must be all with model.attn_temperature=llama4"),
    (dict(attn_temperature="ssmax", attn_temperature_layers="global", window=4),
     "model.attn_temperature_layers must be all when the layers are not both windowed and full (layer windows"),
])
def test_bad_options_are_refused(options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        GPTConfig(vocab_size=31, **options)


def test_llama4_needs_a_layer_without_positions():
    cfg = GPTConfig(vocab_size=31, attn_temperature="llama4")
    with pytest.raises(ValueError, match="llama4 scales the queries of layers without position information"):
        GPT(cfg, SCHEMES["rope"](cfg))


def test_ssmax_on_global_layers_has_its_weights_there_only():
    """No s_h in a layer the temperature leaves (an unused parameter would stop DDP)."""
    cfg = GPTConfig(vocab_size=31, n_layer=4, attn_temperature="ssmax", attn_temperature_layers="global",
                    window_pattern=[4, 4, None])
    model = GPT(cfg, SCHEMES["rope"](cfg))
    assert [block.attn.ssmax is not None for block in model.blocks] == [False, False, True, False]
