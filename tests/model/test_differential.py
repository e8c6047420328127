"""Differential attention V2 (model/differential.py, ``model.attention_kind=differential``) against a
float64 formula written from microsoft/unilm's ``multihead_flashdiffv2.py`` (2H query heads, query
head j reading key/value head j // (2H / G), one softmax each, out_h = a_{2h} - sigmoid(x W_l)_h
a_{2h+1}, then the output projection), every backend, packed documents, query chunks, the KV cache,
gradients and the refusals. The export is in tests/scripts/test_export_remote.py (OPTION_CASES)."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, AttentionRequest
from model.config import GPTConfig
from model.differential import DifferentialV2
from model.pe import SCHEMES
from model.temperature import ssmax_init
from pelab.config import ConfigError
from pelab.lit import build_position
from tests.naive import naive_linear, naive_rope_vec
from tests.tiny import decode_stepwise, tiny_config, tiny_gpt

DIFF = dict(attention_kind="differential")


def spread(model, seed: int = 3):
    """q/k sharpened and every lambda and sink off its init, so that a misplaced head shows."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for block in model.blocks:
            attn = block.attn
            attn.c_attn.weight.copy_(torch.randn(attn.c_attn.weight.shape, generator=gen) * 0.3)
            attn.pairs.lambda_proj.weight.copy_(torch.randn(attn.pairs.lambda_proj.weight.shape, generator=gen))
            for p in (attn.sinks, attn.ssmax):
                if isinstance(p, torch.nn.Parameter):
                    p.add_(torch.randn(p.shape, generator=gen))
    return model


def naive_differential(attn, x: torch.Tensor, positions: list[int], rotate=None, rotate_v: bool = False
                       ) -> torch.Tensor:
    """(B, T, C) float64 output of one differential layer, loops over query heads, rows and keys:
    q_j = x W_q[j hd:(j+1) hd] (j < 2H), k_g, v_g likewise after the 2C query rows; q and k turned
    (``rotate(vec, b, t, g, sign)``, default RoPE at ``positions``); query head j reads k/v head
    j // (2H / G); z_tk = c_j q_t.k_k / sqrt(hd) (c_j = s_j ln(t + 1) with ssmax, else 1);
    p = exp(z) / (exp(sink_j) [with a sink] + sum_k<=t exp(z)); a_j = p v (``rotate_v``: v_k turned
    by its token's angles and a_j turned back by -its query's, head by head before the pairs meet);
    out_h = a_{2h} - sigmoid(x . W_l[h]) a_{2h+1}; then c_proj."""
    x64 = x.double()
    B, T, C = x64.shape
    H, G, hd = attn.n_head, attn.n_kv_head, attn.head_dim
    if rotate is None:
        def rotate(vec, b, t, g, sign):
            return naive_rope_vec(vec, positions[t])
    rows = naive_linear(attn.c_attn, x64)
    lam = x64 @ attn.pairs.lambda_proj.weight.detach().double().T  # (B, T, H)
    sinks = None if attn.sinks is None else attn.sinks.detach().double()
    ssmax = None if attn.ssmax is None else attn.ssmax.detach().double()
    out = torch.zeros(B, T, C, dtype=torch.float64)
    for b in range(B):
        heads = []
        for j in range(2 * H):
            g = j // (2 * H // G)
            q = [rotate(rows[b, t, j * hd:(j + 1) * hd], b, t, g, 1.0) for t in range(T)]
            k = [rotate(rows[b, t, 2 * C + g * hd:2 * C + (g + 1) * hd], b, t, g, 1.0) for t in range(T)]
            v = [rows[b, t, 2 * C + G * hd + g * hd:2 * C + G * hd + (g + 1) * hd] for t in range(T)]
            v = [rotate(v[t], b, t, g, 1.0) for t in range(T)] if rotate_v else v
            a = []
            for t in range(T):
                c = 1.0 if ssmax is None else float(ssmax[j]) * math.log(t + 1)
                z = torch.stack([c * torch.dot(q[t], k[s]) / math.sqrt(hd) for s in range(t + 1)])
                e = torch.exp(z)
                denominator = e.sum() + (0.0 if sinks is None else torch.exp(sinks[j]))
                y = sum(e[s] / denominator * v[s] for s in range(t + 1))
                a.append(rotate(y, b, t, g, -1.0) if rotate_v else y)
            heads.append(a)
        for h in range(H):
            for t in range(T):
                weight = 1.0 / (1.0 + math.exp(-float(lam[b, t, h])))
                out[b, t, h * hd:(h + 1) * hd] = heads[2 * h][t] - weight * heads[2 * h + 1][t]
    return naive_linear(attn.c_proj, out)


@pytest.mark.parametrize("options", [{}, {"n_kv_head": 2}, {"n_kv_head": 1}, {"n_head": 3, "n_embd": 24},
                                     {"normaliser": "sink_learned", "attn_temperature": "ssmax", "n_kv_head": 2}],
                         ids=["mha", "gqa", "mqa", "odd_heads", "sinks_ssmax_gqa"])
def test_layer_is_the_v2_formula(options):
    model = spread(tiny_gpt("rope", 1, n_layer=1, **DIFF, **options))
    x = torch.randn(2, 6, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.blocks[0].attn(x, model_context(model, 6))
    torch.testing.assert_close(got.double(), naive_differential(model.blocks[0].attn, x, list(range(6))),
                               atol=1e-5, rtol=1e-5)


def model_context(model, T: int):
    """The first layer's context of a forward of T tokens from 0, as GPT.hidden builds it."""
    from model.attention import Terms
    from model.positions import layer_contexts
    from model.temperature import query_scales

    positions = torch.arange(T)
    terms = Terms(model.pe, positions, positions, normaliser=model.config.normaliser)
    return layer_contexts(terms, model.attention(positions.device), n_layer=1,
                          q_scales=query_scales(model.config, model.pe, positions))[0]


def test_shapes_and_init():
    """2C query rows, G key/value heads, one lambda per head; GPT-2's N(0, 0.02) on W_lambda (the
    reference file sets no init of its own); 2H sinks and ssmax factors, one per softmax."""
    model = tiny_gpt("rope", 0, n_embd=64, n_kv_head=2, normaliser="sink_learned", attn_temperature="ssmax", **DIFF)
    attn = model.blocks[0].attn
    assert attn.c_attn.weight.shape == (2 * 64 + 2 * 2 * 16, 64)
    assert attn.pairs.lambda_proj.weight.shape == (4, 64) and attn.pairs.lambda_proj.bias is None
    assert 0.01 < attn.pairs.lambda_proj.weight.std() < 0.03
    assert attn.sinks.shape == (8,) and attn.ssmax.shape == (8,)
    assert torch.allclose(attn.ssmax, torch.full((8,), ssmax_init(16)))


def serving_backends() -> list[str]:
    """The backends that serve a rotation scheme in a forward without autograd on CPU."""
    pe = tiny_gpt("rope", 0, **DIFF).pe
    request = AttentionRequest(pe, torch.device("cpu"))
    return [name for name, backend in sorted(BACKENDS.items()) if backend.refusal(request) is None]


def test_the_backends_that_refuse_are_those_of_a_bias():
    """sdpa_key carries ALiBi-type slopes and bias_grad a learned bias's gradient: differential
    attention refuses every bias, so neither has anything to serve; the rest serve it."""
    assert set(BACKENDS) - set(serving_backends()) == {"sdpa_key", "bias_grad"}


@pytest.mark.parametrize("backend", serving_backends())
def test_every_backend_with_documents_chunks_and_windows_computes_the_float64_model(backend):
    options = dict(n_kv_head=2, window_pattern=[5, None], xsa="gated", **DIFF)
    ref = spread(tiny_gpt("rope", 2, **options)).double()
    model = spread(tiny_gpt("rope", 2, attention=backend, **options))
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    positions = torch.tensor([list(range(5)) + list(range(7)), list(range(12))])
    with torch.no_grad():
        assert model.attention(idx.device).name == backend
        want = ref.token_nll(idx, idx, positions, documents=documents)
        got = model.token_nll(idx, idx, positions, q_chunk=4, documents=documents)
        # a packed document attends as if alone
        alone = ref.token_nll(idx[:1, 5:], idx[:1, 5:])
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)  # token_nll is float32 (the float64 model's rounded)
    torch.testing.assert_close(want[:1, 5:], alone, atol=1e-6, rtol=1e-6)


def test_training_gradients_equal_on_sdpa_and_math():
    """A CPU training step (sdpa's kernel, autograd) against the math backend's gradients."""
    grads = {}
    for backend in ("sdpa", "math"):
        model = spread(tiny_gpt("xpos", 4, attention=backend, n_kv_head=2, **DIFF)).train()
        idx = torch.randint(0, 37, (2, 10), generator=torch.Generator().manual_seed(2))
        model(idx, torch.roll(idx, -1, 1))[1].backward()
        grads[backend] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert any("lambda_proj" in n for n in grads["math"])
    for name, grad in grads["math"].items():
        torch.testing.assert_close(grads["sdpa"][name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("options", [{"n_kv_head": 2, "window_pattern": [4, None]}, {"normaliser": "sink_learned"}],
                         ids=["gqa_window", "sinks"])
def test_cached_decoding_equals_one_full_forward(options):
    model = spread(tiny_gpt("rope", 4, vocab_size=41, block_size=32, **DIFF, **options))
    steps, full, cache = decode_stepwise(model, 41)
    assert cache.layers[0].k.shape[1] == model.config.kv_heads  # the cache keeps the G key/value heads
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


def test_combination_gradients_are_the_finite_differences():
    op = DifferentialV2(GPTConfig(vocab_size=2, n_layer=1, n_head=2, n_embd=8)).double()
    gen = torch.Generator().manual_seed(6)
    y = torch.randn(1, 4, 3, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    x = torch.randn(1, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda y, x, w: torch.func.functional_call(op, {"lambda_proj.weight": w}, (y, x)),
                                    (y, x, w))


def test_lambda_zero_logit_halves_the_second_map_by_hand():
    """W_l = 0: sigmoid(0) = 1/2, out_h = a_{2h} - a_{2h+1} / 2, pairs (0, 1) and (2, 3)."""
    op = DifferentialV2(GPTConfig(vocab_size=2, n_layer=1, n_head=2, n_embd=4))
    torch.nn.init.zeros_(op.lambda_proj.weight)
    y = torch.tensor([1.0, 4.0, 10.0, 2.0]).view(1, 4, 1, 1)
    assert op(y, torch.randn(1, 1, 4)).flatten().tolist() == [1.0 - 2.0, 10.0 - 1.0]


@pytest.mark.parametrize("scheme, has", [("alibi", "a bias per head"), ("fox", "data-dependent terms per head"),
                                         ("pope", "a rotation that differs per head")])
def test_schemes_with_per_head_terms_are_refused_before_any_data(scheme, has):
    """At build_position (pelab/validate.py builds the scheme before reading data), one line."""
    cls = SCHEMES[scheme]
    with pytest.raises(ConfigError) as err:
        build_position({"_target_": f"{cls.__module__}.{cls.__qualname__}"}, tiny_config(**DIFF))
    message = str(err.value)
    assert "\n" not in message and "model.attention_kind=differential" in message and f"pe={scheme} ({has}" in message
    with pytest.raises(ValueError, match="needs a scheme without per-head terms"):
        tiny_gpt(scheme, 0, **DIFF)


def test_rotation_and_embedding_schemes_build():
    for scheme in ("rope", "xpos", "learned", "sinusoidal", "nope"):
        tiny_gpt(scheme, 0, **DIFF)


def test_unknown_kind_names_the_key():
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=37, attention_kind="diff")
    assert str(err.value) == "model.attention_kind must be one of 'standard', 'differential', got 'diff'"


def test_attention_probe_reports_every_query_head():
    """The probe (evaluation/attention_probe.py) reads the math backend's weights: 2H softmaxes per
    layer, each a row; a pair's second map is its own row, with its own sink share."""
    import numpy as np

    from evaluation.attention_probe import ProbeConfig, evaluate_probe
    from evaluation.sweep import probe_windows

    model = spread(tiny_gpt("rope", 0, vocab_size=32, block_size=8, n_layer=1, n_head=2, n_embd=16,
                            normaliser="sink_learned", **DIFF))
    tokens = np.random.default_rng(0).integers(0, 32, 40).astype(np.uint16)
    rows = evaluate_probe(model, probe_windows(tokens), 8, ProbeConfig(multipliers=(1,), samples=2, rows=4),
                          log=lambda _: None)
    assert [(r.layer, r.head) for r in rows] == [(0, head) for head in range(4)]
    assert len({round(r.null_weight, 6) for r in rows}) == 4  # four sink logits, four sink shares


def test_training_forward_is_one_graph():
    """torch.compile traces the training forward (GQA, sinks, the pair combination) without a break."""
    model = tiny_gpt("rope", 0, vocab_size=31, n_kv_head=2, normaliser="sink_learned", **DIFF).train()
    idx = torch.randint(0, 31, (2, 16), generator=torch.Generator().manual_seed(11))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(idx, torch.roll(idx, -1, dims=1))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)


def rope_dd_turns(model, x: torch.Tensor):
    """rotate(vec, b, t, g, sign) of pe=rope_dd's first layer from its formula: Theta_t = sum_{s<=t}
    omega * softplus(W x_s + b) per kv head g and pair p (omega_p = base^(-p/P)); pair (p, p + P)
    turned by sign * Theta."""
    step, P, G = model.pe.steps[0], model.config.head_dim // 2, model.config.kv_heads
    phi = torch.log1p(torch.exp(x.double() @ step.weight.detach().double().T + step.bias.detach().double()))
    omega = torch.tensor([model.pe.base ** (-p / P) for p in range(P)], dtype=torch.float32).double()
    theta = torch.cumsum(phi.view(*x.shape[:2], G, P) * omega, dim=1)  # (B, T, G, P)

    def rotate(vec, b, t, g, sign):
        angle = sign * theta[b, t, g]
        c, s = torch.cos(angle), torch.sin(angle)
        return torch.cat((vec[:P] * c - vec[P:] * s, vec[P:] * c + vec[:P] * s))
    return rotate


@pytest.mark.parametrize("rotate_v", [False, True])
def test_rope_dd_turns_both_heads_of_a_pair_alike(rotate_v):
    """pe=rope_dd's angles are per key/value head, so both query heads of a pair turn alike; with
    rotate_v the output is turned back after the combination (linear: the same as head by head)."""
    model = spread(tiny_gpt("rope_dd", 1, n_layer=1, n_kv_head=2, pe_options={"rotate_v": rotate_v}, **DIFF))
    with torch.no_grad():
        model.pe.steps[0].weight.copy_(torch.randn(model.pe.steps[0].weight.shape,
                                                   generator=torch.Generator().manual_seed(4)) * 0.5)
    x = torch.randn(2, 6, model.config.n_embd, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model.blocks[0].attn(x, model_context(model, 6))
    want = naive_differential(model.blocks[0].attn, x, [], rope_dd_turns(model, x), rotate_v)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_rope_dd_cached_decoding_equals_one_full_forward():
    model = spread(tiny_gpt("rope_dd", 4, vocab_size=41, block_size=32, n_kv_head=2, pe_options={"rotate_v": True},
                            **DIFF))
    prompt = torch.randint(0, 41, (2, 6), generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.generate(prompt, 6, temperature=0), model.generate(prompt, 6, temperature=0, cache=False))
