"""Every attention backend × every registered scheme against float64 autograd on the formulas (a
layer's output and gradients, chunked evaluation, cache decoding); flex, ``auto`` and the fused hooks."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS as BACKEND_REGISTRY
from model.attention.sdpa_key import key_features
from model.generate import KVCache
from model.pe import SCHEMES
from tests.naive import (
    POSITION_SCHEMES, leaf_params, naive_gelu, naive_layer_norm, naive_linear, naive_reference, naive_rotate,
    naive_softmax_attention, set_naive_params,
)
from tests.tiny import LEARNED_BIAS, attention_config, build, contexts


BACKENDS = sorted(BACKEND_REGISTRY)
BACKEND_SCHEMES = [(n, {}) for n in POSITION_SCHEMES] + [("rope_alibi", {"bias_heads": 2, "slope_multiplier": 0.5})]
BACKEND_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in BACKEND_SCHEMES]


# per-sequence positions: packed documents (reset) and repeats
ROWS = [[0, 1, 2, 3, 4, 0, 1, 2, 3], [5, 5, 5, 2, 2, 7, 0, 0, 9]]


def naive_layer64(W, Wp, x64, rows, pe, opts, params):
    """One attention layer in float64 per sequence b at positions rows[b] (causal by order), with
    the rotation and bias references of tests/naive.py for the hooks the scheme uses;
    ``params``: the scheme's float64 leaves."""
    rotation = naive_reference("NAIVE_ROTATION", pe.name)(opts, pe.head_dim) if pe.uses_rotate else None
    bias = naive_reference("NAIVE_BIAS", pe.name) if pe.uses_bias else None
    outs = []
    B, T, C = x64.shape
    for b, pos in enumerate(rows):
        y = x64[b : b + 1] @ W.T
        q, k, v = (y[..., i * C : (i + 1) * C].view(1, T, pe.n_head, C // pe.n_head).transpose(1, 2) for i in range(3))
        if rotation is not None:
            q, k = naive_rotate(q, pos, rotation, +1.0), naive_rotate(k, pos, rotation, -1.0)
        outs.append(naive_softmax_attention(q, k, v, None if bias is None else bias(pe, params, pos, pos, opts)) @ Wp.T)
    return torch.cat(outs)


def backend_model(name, opts, backend, seed=0, **overrides):
    cfg, model, attn = build(name, opts, seed=seed, attention=backend, **overrides)
    set_naive_params(model.pe)
    return cfg, model, attn


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, opts", BACKEND_SCHEMES, ids=BACKEND_IDS)
@pytest.mark.parametrize("pos", ["offset", "rows"])
def test_backend_layer_matches_naive_forward_and_gradients(backend, name, opts, pos):
    """One layer through ``layer_contexts`` (the model's per-forward position terms)
    with each backend, against float64 autograd on the formulas: output, and gradients of
    the input, the attention weights and the scheme's own parameters (flex: forward only,
    FlexAttention has no CPU backward)."""
    cfg, model, attn = backend_model(name, opts, backend, seed=7)
    rows = [list(range(37, 46))] * 2 if pos == "offset" else ROWS
    positions = torch.tensor(rows[0]) if pos == "offset" else torch.tensor(rows)
    x = torch.randn(2, 9, cfg.n_embd, requires_grad=True)
    weights = torch.randn(2, 9, cfg.n_embd, dtype=torch.float64)
    grad = backend != "flex"
    with torch.set_grad_enabled(grad):  # the route is asked in the forward's grad mode (CPU flex: no backward)
        ctx = contexts(model, positions)[0]
    expected = backend if backend != "sdpa_key" or model.pe.key_only_slopes() is not None else "sdpa"
    if expected in ("sdpa", "bias_grad") and name in LEARNED_BIAS:  # CPU training: the learned-bias kernel
        expected = "bias_grad"
    elif expected == "bias_grad":  # no learned bias: plain SDPA
        expected = "sdpa"
    assert ctx.backend.name == expected
    with torch.set_grad_enabled(grad):
        y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    W, Wp = (attn.c_attn.weight.detach().double().requires_grad_(True),
             attn.c_proj.weight.detach().double().requires_grad_(True))
    params = leaf_params(model.pe)
    ref = naive_layer64(W, Wp, x64, rows, model.pe, opts, params)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = [("x", x.grad, x64.grad), ("c_attn", attn.c_attn.weight.grad, W.grad),
             ("c_proj", attn.c_proj.weight.grad, Wp.grad)]
    pairs += [(n, p.grad, params[n].grad) for n, p in model.pe.named_parameters() if params[n].grad is not None]
    for n, got, want in pairs:
        scale = want.abs().max().item()
        if n == "mlp.2.bias" or scale == 0:  # FIRE's output bias shifts a whole row: softmax ignores
            assert got.abs().max() < 1e-5  # it; FIRE's threshold does nothing while every i > L
            continue
        assert scale > 1e-6, f"{n}: the check needs a non-zero gradient"
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def naive_logits64(model, opts, idx, rows):
    """Whole-model logits in float64 (embeddings, blocks, final norm, tied head)."""
    cfg, pe = model.config, model.pe
    params = {n: t.detach() for n, t in leaf_params(pe).items()}
    x = model.wte.weight.detach().double()[idx]
    if pe.uses_embed:
        embed = naive_reference("NAIVE_EMBED", pe.name)
        x = x + torch.stack([embed(pe, params, pos, opts) for pos in rows])
    for block in model.blocks:
        a = block.attn
        x = x + naive_layer64(a.c_attn.weight.detach().double(), a.c_proj.weight.detach().double(),
                              naive_layer_norm(x, block.ln_1), rows, pe, opts, params)
        h = naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(h))
    return (naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T)[..., : cfg.vocab_size]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, opts", BACKEND_SCHEMES, ids=BACKEND_IDS)
def test_backend_chunked_evaluation_and_cache_decoding_match_naive(backend, name, opts):
    """The whole model with each backend: query-chunked evaluation (chunks of 4 of 10
    tokens, per-sequence positions) and KV-cache decoding (5 tokens, then 1, then 4) against
    the float64 model."""
    cfg, model, _ = backend_model(name, opts, backend, seed=8)
    if model.pe.uses_embed:  # a learned table away from its init, so a wrong lookup shows
        with torch.no_grad():
            for p in model.pe.parameters():
                torch.nn.init.normal_(p, std=0.5)
    T = 10
    idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(9))
    targets = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(10))
    rows = [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [3, 3, 3, 0, 9, 9, 1, 1, 12, 2]]
    ref = naive_logits64(model, opts, idx, rows)
    ref_nll = torch.logsumexp(ref, -1) - ref.gather(-1, targets[..., None])[..., 0]
    with torch.no_grad():
        nll = model.token_nll(idx, targets, positions=torch.tensor(rows), q_chunk=4)
        torch.testing.assert_close(nll.double(), ref_nll, atol=1e-5, rtol=1e-5)
        # cache decoding at the default positions 0..T-1
        ref = naive_logits64(model, opts, idx, [list(range(T))] * 2)
        kv = KVCache(len(model.blocks), torch.arange(T))
        h = torch.cat([model.hidden(idx[:, s:e], cache=kv) for s, e in ((0, 5), (5, 6), (6, T))], dim=1)
        torch.testing.assert_close(model.logits(h).double(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# the flex kernel
# --------------------------------------------------------------------------------------


def test_compiled_flex_keeps_its_kernel_past_dynamos_recompile_limit():
    """The CUDA flex path (compiled here on CPU, forward): every (batch, Tq, Tk) of an
    evaluation sweep gets its own kernel; past dynamo's recompile limit flex would run
    unfused, materialising the scores. Dynamo's limit is lowered to 2 so that 3 shapes
    cross it; each output against a float64 causal softmax with an ALiBi-like score_mod."""
    import warnings

    flex = BACKEND_REGISTRY["flex"]

    torch.manual_seed(0)
    slopes = torch.tensor([0.5, 0.25])
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for B, Tq, Tk in [(2, 128, 128), (1, 128, 256), (1, 256, 256)]:
            q, k, v = torch.randn(B, 2, Tq, 16), torch.randn(B, 2, Tk, 16), torch.randn(B, 2, Tk, 16)
            offset = Tk - Tq

            def score_mod(s, b, h, q_idx, kv_idx):
                return s - slopes[h] * (q_idx + offset - kv_idx)

            with torch.no_grad():
                out = flex.compiled(q, k, v, score_mod, flex.block_mask(Tq, Tk, q.device))
            i = torch.arange(Tq, dtype=torch.float64)[:, None] + offset
            j = torch.arange(Tk, dtype=torch.float64)[None]
            logits = q.double() @ k.double().transpose(-2, -1) / 4.0 - slopes.double()[:, None, None] * (i - j)
            ref = logits.masked_fill(j > i, float("-inf")).softmax(-1) @ v.double()
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    unfused = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not unfused, unfused


@pytest.mark.parametrize("name", ["alibi", "fire"])
def test_chunked_flex_evaluation_compiles_one_kernel_per_length(monkeypatch, name):
    """Query chunks attend the full-length K/V, their offset in the BlockMask: every chunk of
    a length runs one compiled kernel (the CUDA path, compiled here on CPU by a counting
    backend), where K/V cut at each chunk's end would compile one per chunk. The chunked NLL
    equals the float64 model's."""
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    flex, counter = BACKEND_REGISTRY["flex"], CompileCounterWithBackend("eager")
    monkeypatch.setattr(flex, "compile_devices", ("cpu",))
    monkeypatch.setattr(flex, "compile_backend", counter)
    monkeypatch.setattr(flex, "_compiled", None)
    cfg, model, _ = backend_model(name, {}, "flex", seed=3)
    for n, T in enumerate((16, 32), start=1):
        idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(T))
        targets = torch.roll(idx, -1, dims=1)
        rows = [list(range(T))] * 2
        ref = naive_logits64(model, {}, idx, rows)
        ref_nll = torch.logsumexp(ref, -1) - ref.gather(-1, targets[..., None])[..., 0]
        with torch.no_grad():
            nll = model.token_nll(idx, targets, positions=torch.tensor(rows), q_chunk=4)
        torch.testing.assert_close(nll.double(), ref_nll, atol=1e-5, rtol=1e-5)
        assert counter.frame_count == n  # T / 4 chunks of this length, one kernel


def test_flex_backend_refuses_a_bias_without_an_elementwise_form():
    cfg, model, _ = backend_model("alibi", {}, "flex")
    model.pe.bias_score = lambda: None
    with pytest.raises(ValueError, match="model.attention=flex: pe=alibi gives no elementwise bias"):
        contexts(model, torch.arange(4))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_flex_reads_a_learned_bias_as_a_table_on_cuda(name):
    """Under autograd on CUDA flex reads every bias with parameters from a table (its in-kernel
    gradient into a few shared entries took 34-50x rope's step, docs/gpu.md); on CPU only FIRE,
    whose score_mod Inductor cannot differentiate; never a bias without parameters."""
    _, model, _ = backend_model(name, {}, "math")
    flex = BACKEND_REGISTRY["flex"]
    on_cuda = flex.reads_table(model.pe, torch.device("cuda"))
    assert on_cuda == (name in LEARNED_BIAS)
    assert flex.reads_table(model.pe, torch.device("cpu")) == (name == "fire")


# --------------------------------------------------------------------------------------
# backend choice and the scheme hooks it relies on
# --------------------------------------------------------------------------------------


def test_attention_config_is_checked():
    with pytest.raises(ValueError, match=r"model.attention must be .*'auto'.*'flex'.*got 'fast'"):
        attention_config(attention="fast")
    with pytest.raises(ValueError, match="model.attention must be not flex when model.dropout > 0"):
        attention_config(attention="flex", dropout=0.1)


def documented_auto(pe):
    """docs/design.md's ``auto`` for a scheme, (CPU, CUDA), from its hooks: on CUDA sdpa_key for a
    key-only form, flex for another bias, sdpa without one; on CPU SDPA's float32 mask, through
    the learned-bias kernel where the bias has parameters; math everywhere for a term of the scores."""
    if pe.terms == "scores":
        return "math", "math"
    cuda = "sdpa_key" if pe.key_only_slopes() is not None else "flex" if pe.uses_bias else "sdpa"
    return ("bias_grad" if pe.name in LEARNED_BIAS else "sdpa"), cuda


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_auto_backend(name):
    _, model, _ = build(name, {})
    cpu, cuda = documented_auto(model.pe)
    assert model.attention(torch.device("cpu")).name == cpu  # the measured choice (docs/design.md)
    with torch.no_grad():  # no bias gradient wanted: SDPA's fused kernel with the float32 mask
        assert model.attention(torch.device("cpu")).name == ("math" if cpu == "math" else "sdpa")
    assert model.attention(torch.device("cuda")).name == cuda
    assert model.attention(torch.device("cpu"), "math").name == "math"
    if cuda == "flex":  # training with dropout stays on SDPA (flex has no attention dropout)
        _, model, _ = build(name, {}, dropout=0.1)
        assert model.train().attention(torch.device("cuda")).name == "sdpa"


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_bias_hooks_agree_with_bias(name):
    """bias_score (flex's elementwise form) equals bias() everywhere; key_only_slopes, where
    given, are exactly the m of bias = -m (i - j)."""
    cfg, model, _ = backend_model(name, {}, "auto")
    pe = model.pe
    qp, kp = torch.tensor([0, 3, 9, 300, 4100]), torch.tensor([0, 1, 7, 290, 4100, 5])
    score = pe.bias_score()
    assert (score is None) == (not pe.uses_bias)
    if score is not None:
        full = pe.bias(qp, kp)
        heads = torch.arange(cfg.n_head)[:, None, None]
        torch.testing.assert_close(score(qp[None, :, None], kp[None, None, :], heads), full, atol=1e-5, rtol=1e-5)
    slopes = pe.key_only_slopes()
    if slopes is not None:
        d = (qp[:, None] - kp[None, :]).float()
        assert torch.equal(pe.bias(qp, kp), -slopes[:, None, None] * d)


def test_key_features_are_exact_pieces():
    """The bf16 pieces of the key-only term sum back to the float32 value exactly."""
    slopes = torch.tensor([2.0 ** -0.5, 2.0 ** -3.5, 0.3, 2.0 ** -8])
    positions = torch.tensor([0, 5, 17, 300, 4607, 65537])
    feats = key_features(slopes, positions, 8, torch.bfloat16)
    assert feats.dtype == torch.bfloat16 and feats.shape == (1, 4, 6, 3)
    term = slopes[:, None] * (positions - 65537).float()[None, :] * math.sqrt(8)
    assert torch.equal(feats.float().sum(-1)[0], term)
    assert torch.equal(key_features(slopes, positions, 8, torch.float32)[0, ..., 0], term)
