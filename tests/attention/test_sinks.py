"""Attention sinks (model.sinks=learned|zero): one logit s_h per head joined to every softmax
denominator. Every backend against a float64 reference written from gpt-oss's formula (softmax
over [logits, s_h], the sink's column dropped), with gradients (d/ds_h included); windows, packed
documents, query chunks, the KV cache, one compiled graph, the recorded probabilities, bad values."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, AttentionRecorder, AttentionRequest, Terms, resolve
from model.config import GPTConfig
from model.positions import Pass, layer_contexts
from tests.naive import (
    leaf_params, naive_gelu, naive_layer_norm, naive_linear, naive_reference, naive_rotate, set_naive_params,
)
from tests.tiny import attention_config, build, compiled_training_loss, tiny_gpt

T = 9
ROWS = [[0, 1, 2, 3, 4, 0, 1, 2, 3], [5, 5, 5, 2, 2, 7, 0, 0, 9]]  # per-sequence positions (reset, repeated)
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]
SINKS = [1.5, -0.7, 0.0, 3.0]  # one per head: a strong sink, a weak one, the off-by-one, a dominant one


def visible(i: int, j: int, window: int | None, documents: list[int] | None = None) -> bool:
    return j <= i and (window is None or j >= i - window + 1) and (documents is None or documents[i] == documents[j])


def gpt_oss_attention(q, k, v, bias, sink, window=None, documents=None):
    """(1, H, n, d) q, k and (1, H, n, hd) v, float64 -> (1, n, H*hd), gpt-oss's reference:
    W = softmax([QK^T/sqrt(d) + bias, S]), the last column (the sink's) dropped, W V."""
    _, H, n, hd = v.shape
    seen = torch.tensor([[visible(i, j, window, documents) for j in range(n)] for i in range(n)])
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1]) + (0.0 if bias is None else bias)
    scores = scores.masked_fill(~seen, -math.inf)
    w = torch.softmax(torch.cat((scores, sink.view(1, H, 1, 1).expand(1, H, n, 1)), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("bhij,bhjd->bihd", w, v).reshape(1, n, H * hd)


def naive_layer(attn, x64, rows, pe, params, sink, window=None, documents=None):
    """One attention layer in float64, sequence b at positions rows[b]."""
    rotation = naive_reference("NAIVE_ROTATION", pe.name)({}, pe.head_dim) if pe.uses_rotate else None
    bias = naive_reference("NAIVE_BIAS", pe.name) if pe.uses_bias else None
    W, Wp, C = attn.c_attn.weight.detach().double(), attn.c_proj.weight.detach().double(), x64.shape[-1]
    outs = []
    for b, pos in enumerate(rows):
        y = x64[b : b + 1] @ W.T
        q, k, v = (y[..., n * C:(n + 1) * C].view(1, len(pos), pe.n_head, -1).transpose(1, 2) for n in range(3))
        if rotation is not None:
            q, k = naive_rotate(q, pos, rotation, +1.0), naive_rotate(k, pos, rotation, -1.0)
        b_bias = None if bias is None else bias(pe, params, pos, pos, {})
        outs.append(gpt_oss_attention(q, k, v, b_bias, sink, window, None if documents is None else documents[b]))
    return torch.cat(outs) @ Wp.T


def naive_logits(model, idx, windows):
    """Whole-model float64 logits at positions 0.. (schemes without an embedding), layer l with windows[l]."""
    pe, n = model.pe, idx.shape[1]
    params = {name: t.detach() for name, t in leaf_params(pe).items()}
    x = model.wte.weight.detach().double()[idx]
    rows = [list(range(n))] * idx.shape[0]
    for block, window in zip(model.blocks, windows):
        sink = block.attn.sinks.detach().double()
        x = x + naive_layer(block.attn, naive_layer_norm(x, block.ln_1), rows, pe, params, sink, window)
        h = naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(h))
    return (naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T)[..., : model.config.vocab_size]


def sink_model(name, sinks="learned", seed=0, **overrides):
    """build()'s model with its learned sinks set to SINKS, far from their near-zero init."""
    _, model, attn = build(name, seed=seed, sinks=sinks, **overrides)
    set_naive_params(model.pe)
    if sinks == "learned":
        with torch.no_grad():
            for block in model.blocks:
                block.attn.sinks.copy_(torch.tensor(SINKS))
    return model, attn


# every backend on CPU: rope on the plain ones, alibi's key-only form on sdpa_key (and sdpa's float
# mask), t5's learned bias on bias_grad (its gradient) and flex (forward: CPU flex has no backward),
# PoPE's q.k of 2 hd dims against v's hd
ROUTES = [("rope", "sdpa"), ("rope", "math"), ("rope", "flex"), ("alibi", "sdpa_key"), ("alibi", "sdpa"),
          ("t5", "bias_grad"), ("t5", "flex"), ("pope", "sdpa")]
# (sinks, window, packed documents): the zero sink takes the learned one's path, so one case of it
CASES = [("learned", None, False), ("learned", 3, False), ("learned", 3, True), ("zero", 3, True)]


@pytest.mark.parametrize("sinks, window, documents", CASES, ids=["full", "W3", "W3-documents", "zero-W3-documents"])
@pytest.mark.parametrize("name, backend", ROUTES, ids=[f"{n}-{b}" for n, b in ROUTES])
def test_every_backend_matches_the_gpt_oss_formula(name, backend, sinks, window, documents):
    """One layer against gpt-oss's float64 formula, per-sequence positions, with the window and
    packed documents; the gradients of the input, of the sinks and of a learned bias."""
    model, attn = sink_model(name, sinks, seed=3, attention=backend)
    grad = backend != "flex"
    positions = torch.tensor(ROWS)
    docs = torch.tensor(DOCUMENTS) if documents else None
    route = resolve(backend, AttentionRequest(model.pe, torch.device("cpu"), grad=grad,
                                              normaliser=model.config.normaliser))
    assert route.name == backend
    ctx = layer_contexts(Terms(model.pe, positions, positions, q_documents=docs, k_documents=docs,
                               normaliser=model.config.normaliser), route,
                         windows=(window,))[0]
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(4)).requires_grad_(grad)
    weights = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.set_grad_enabled(grad):
        y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    params = leaf_params(model.pe)
    sink64 = attn.sinks.detach().double().requires_grad_(sinks == "learned")
    ref = naive_layer(attn, x64, ROWS, model.pe, params, sink64, window, DOCUMENTS if documents else None)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = [("x", x.grad, x64.grad)] + [(n, p.grad, params[n].grad) for n, p in model.pe.named_parameters()
                                         if params[n].grad is not None]  # what the reference reads
    assert name != "t5" or len(pairs) == 2, "the learned bias must receive a gradient"
    if sinks == "learned":
        pairs.append(("sinks", attn.sinks.grad, sink64.grad))
        assert sink64.grad.abs().min() > 1e-3, "every head's sink must matter"
    for n, got, want in pairs:
        torch.testing.assert_close(got.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-4,
                                   msg=lambda m: f"{n}: {m}")


def test_zero_sink_is_the_off_by_one_softmax():
    """sinks=zero: one query, logits typed in (head dim 1, q = 1, so z_j = k_j): the math backend's
    recorded weights are p_j = e^z_j / (1 + sum_k e^z_k); a sink logit s_h = ln 3 joins e^s_h = 3."""
    from model.attention.normalisers import NORMALISERS

    q, v = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 3, 1, dtype=torch.float64)
    k = torch.tensor([0.0, math.log(2.0), 5.0], dtype=torch.float64).view(1, 1, 3, 1)  # e^z = 1, 2, hidden
    mask = torch.tensor([0.0, 0.0, -math.inf], dtype=torch.float64)

    def weights(sink):
        return NORMALISERS["sink_zero"].attend(BACKENDS["math"], q, k, v, mask, 0.0, sink)[1]

    torch.testing.assert_close(weights(torch.zeros(1)), torch.tensor([[[[0.25, 0.5, 0.0]]]], dtype=torch.float64))
    torch.testing.assert_close(weights(torch.tensor([math.log(3.0)])),
                               torch.tensor([[[[1 / 6, 2 / 6, 0.0]]]], dtype=torch.float64))


@pytest.mark.parametrize("backend", ["sdpa", "sdpa_key", "math", "flex", "bias_grad"])
def test_chunked_evaluation_equals_the_float64_model(backend):
    """Query chunks of 4 of 20 tokens, a window pattern [5, null] and learned sinks: the NLL of the
    float64 model (each chunk's rows keep their sink)."""
    name = {"sdpa_key": "alibi", "bias_grad": "t5", "flex": "t5"}.get(backend, "rope")
    model, _ = sink_model(name, seed=7, attention=backend, window_pattern=[5, None])
    idx = torch.randint(0, 31, (2, 20), generator=torch.Generator().manual_seed(8))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        chunked = model.token_nll(idx, targets, q_chunk=4)
    ref = naive_logits(model, idx, (5, None))
    torch.testing.assert_close(chunked.double(), torch.logsumexp(ref, -1) - ref.gather(-1, targets[..., None])[..., 0],
                               atol=1e-5, rtol=1e-5)


GREEDY = [("rope", {}), ("rope", {"window_pattern": [3, None]}), ("alibi", {"window": 3}), ("t5", {"window": 3})]


@pytest.mark.parametrize("name, windows", GREEDY, ids=["rope-full", "rope-pattern", "alibi-window", "t5-window"])
def test_greedy_cache_decodes_as_without(name, windows):
    """Greedy generation with the KV cache equals it without; the cached logits the float64 model's."""
    model = tiny_gpt(name, 9, config=attention_config(block_size=64, sinks="learned", **windows), sharpen=0.4)
    set_naive_params(model.pe)
    with torch.no_grad():
        for block in model.blocks:
            block.attn.sinks.copy_(torch.tensor(SINKS))
    idx = torch.randint(0, 31, (2, 4), generator=torch.Generator().manual_seed(10))
    cached = model.generate(idx, 10, temperature=0)
    assert torch.equal(cached, model.generate(idx, 10, temperature=0, cache=False))
    from model.generate import KVCache

    kv = KVCache(len(model.blocks), torch.arange(14), model.config.layer_windows)
    with torch.no_grad():
        h = [model.hidden(cached[:, :5], cache=kv)]
        h += [model.hidden(cached[:, t : t + 1], cache=kv) for t in range(5, 14)]
    torch.testing.assert_close(model.logits(torch.cat(h, dim=1)).double(),
                               naive_logits(model, cached, model.config.layer_windows), atol=1e-5, rtol=1e-5)


def test_sink_model_compiles_to_one_graph():
    """Learned sinks with a window pattern and a learned bias (bias_grad's custom op with the sink
    key): one graph, no break, eager's loss, a gradient for every sink, no recompile."""
    model, _ = sink_model("t5", n_layer=2, window_pattern=[3, None])
    compiled_training_loss(model)
    assert all(block.attn.sinks.grad.abs().min() > 0 for block in model.blocks)


def test_flex_sinks_compile_fullgraph():
    """flex's LSE inside a compiled graph (forward: CPU flex has no backward), with a window and
    packed documents."""
    torch._dynamo.reset()
    model, _ = sink_model("alibi", attention="flex", window=3)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(16))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    with torch.no_grad():
        torch.testing.assert_close(compiled(idx, None, None, documents)[0], model(idx, None, None, documents)[0],
                                   atol=1e-5, rtol=1e-5)


def test_recorded_probabilities_leave_the_sink_its_share():
    """The attention maps record the token columns: row i sums to 1 - sigmoid(s_h - lse_i) < 1, the
    float64 reference's weights; the probes' summaries still run."""
    from evaluation.attention_maps import attention_probs, head_summaries

    model, _ = sink_model("alibi", n_layer=1, attention="math")
    idx = torch.randint(0, 31, (1, 8), generator=torch.Generator().manual_seed(0))
    record = AttentionRecorder()
    with torch.no_grad():
        model.hidden(idx, how=Pass(record=record))
    probs = record.probs[0][0].double()  # (H, T, T)
    attn, x = model.blocks[0].attn, naive_layer_norm(model.wte.weight.detach().double()[idx], model.blocks[0].ln_1)
    q, k, _ = (x[0] @ attn.c_attn.weight.detach().double().T).view(8, 3, 4, 8).permute(1, 2, 0, 3)
    slopes = torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8], dtype=torch.float64)  # ALiBi, 4 heads
    i = torch.arange(8)
    z = (q @ k.transpose(-1, -2)) / math.sqrt(8) - slopes[:, None, None] * (i[:, None] - i[None, :])
    z = z.masked_fill(i[None, :] > i[:, None], -math.inf)
    w = torch.softmax(torch.cat((z, torch.tensor(SINKS, dtype=torch.float64)[:, None, None].expand(4, 8, 1)), -1), -1)
    torch.testing.assert_close(probs, w[..., :-1], atol=1e-6, rtol=1e-5)
    assert (probs.sum(-1) < 1).all() and torch.allclose(probs.sum(-1), 1 - w[..., -1], atol=1e-6)
    stats = head_summaries(attention_probs(model, idx))
    assert all(torch.isfinite(s["entropy"]).all() and torch.isfinite(s["distance"]).all() for s in stats.values())


def test_learned_sinks_leave_the_other_weights_and_start_as_torchtitan():
    """The sinks are drawn last, so every other weight is the sink-free model's at the same seed;
    torchtitan's gpt-oss init: truncated normal with std 0.02 / sqrt(2 (layer + 1)), zero sinks none."""
    plain = tiny_gpt("rope", 1, n_head=64, n_embd=128, n_layer=2)
    sinks = tiny_gpt("rope", 1, n_head=64, n_embd=128, n_layer=2, sinks="learned")
    zero = tiny_gpt("rope", 1, n_head=64, n_embd=128, n_layer=2, sinks="zero")
    own = sinks.state_dict()
    assert {k for k in own if k not in plain.state_dict()} == {"blocks.0.attn.sinks", "blocks.1.attn.sinks"}
    assert all(torch.equal(v, own[k]) for k, v in plain.state_dict().items())
    assert dict(zero.named_parameters()).keys() == dict(plain.named_parameters()).keys()
    assert all(torch.equal(v, zero.state_dict()[k]) for k, v in plain.state_dict().items())
    for layer, block in enumerate(sinks.blocks):
        std = block.attn.sinks.detach().std().item()
        assert 0.75 < std / (0.02 / math.sqrt(2 * (layer + 1))) < 1.3
        assert torch.equal(zero.blocks[layer].attn.sinks, torch.zeros(64))


def test_backends_declare_where_they_join_sinks():
    """sdpa's sink key needs exact pieces of the logit, which fp16 lacks: it falls back there and
    keeps its route everywhere else; ``auto`` on CUDA takes flex for sinks, on CPU sdpa."""
    from model.pe import SCHEMES

    pe = SCHEMES["rope"](attention_config())
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve("sdpa", AttentionRequest(pe, cpu, torch.float16, normaliser="sink_learned")).name != "sdpa"
    assert resolve("sdpa", AttentionRequest(pe, cpu, torch.float16)).name == "sdpa"
    for dtype in (torch.float32, torch.bfloat16):
        assert resolve("sdpa", AttentionRequest(pe, cpu, dtype, normaliser="sink_learned")).name == "sdpa"
        assert resolve("sdpa", AttentionRequest(pe, cuda, dtype, grad=True, normaliser="sink_learned")).name == "sdpa"
        assert resolve("auto", AttentionRequest(pe, cuda, dtype, grad=True, normaliser="sink_learned")).name == "flex"
        assert resolve("auto", AttentionRequest(pe, cpu, dtype, grad=True, normaliser="sink_learned")).name == "sdpa"
    # CUDA's fp16: flex rescales by its LSE
    assert resolve("sdpa", AttentionRequest(pe, cuda, torch.float16, normaliser="sink_learned")).name == "flex"
    request = AttentionRequest(pe, cpu, normaliser="sink_learned")
    assert all(BACKENDS[n].refusal(request) is None for n in ("sdpa", "math", "flex"))


def test_bad_sinks_fail_with_one_line():
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=8, sinks="bogus")
    assert str(err.value) == "model.sinks must be one of 'none', 'learned', 'zero', got 'bogus'"
    from pelab.config import ConfigError
    from pelab.lit import model_config

    assert model_config({"vocab_size": 1, "sinks": "learned"}).sinks == "learned"
    with pytest.raises((ConfigError, ValueError), match="model.sinks"):
        model_config({"vocab_size": 1, "sinks": True})


def test_the_old_spelling_is_the_sink_normaliser():
    """model.sinks=learned|zero is model.normaliser=sink_learned|sink_zero (one slot, read back in
    the old spelling); a model built either way has the same weights under the old parameter name."""
    for old, new in (("learned", "sink_learned"), ("zero", "sink_zero"), ("none", "softmax")):
        assert GPTConfig(vocab_size=8, sinks=old) == GPTConfig(vocab_size=8, normaliser=new)
        assert GPTConfig(vocab_size=8, normaliser=new).sinks == old
    assert GPTConfig(vocab_size=8, sinks="learned", normaliser="sink_learned").normaliser == "sink_learned"
    with pytest.raises(ValueError, match="model.sinks must be none with model.normaliser=sink_zero"):
        GPTConfig(vocab_size=8, sinks="learned", normaliser="sink_zero")
    old, new = (tiny_gpt("rope", 1, n_layer=2, **option).state_dict()
                for option in ({"sinks": "learned"}, {"normaliser": "sink_learned"}))
    assert "blocks.1.attn.sinks" in old and old.keys() == new.keys()
    assert all(torch.equal(old[k], new[k]) for k in old)
    from pelab.checkpoint.compare import config_mismatches  # a checkpoint saved in either spelling resumes

    pe = {"_target_": "model.pe.rope.RoPE"}
    saved = {"pe": pe, "model": {"sinks": "learned", "normaliser": "softmax"}}
    assert config_mismatches(saved, {"pe": pe, "model": {"sinks": "none", "normaliser": "sink_learned"}}) == []
    assert config_mismatches(saved, {"pe": pe, "model": {"sinks": "zero"}}) == [
        ("model.normaliser", "sink_learned", "sink_zero")]


def test_no_backend_file_knows_the_normalisers(project_root):
    """The sink and stick-breaking live in the normaliser slot (model/attention/normalisers.py),
    applied around the backends: no backend file names them."""
    for name in ("sdpa", "sdpa_key", "flex", "math", "bias_grad"):
        text = (project_root / "model" / "attention" / f"{name}.py").read_text().lower()
        assert "sink" not in text and "stick" not in text, name


def test_gptoss_like_preset_alternates_windows_with_learned_sinks(project_root):
    """experiment=gptoss_like as train.py composes it: gpt-oss's layout (its model card) is a banded
    layer first, then a full one, repeated, every layer with learned sinks; GQA, RMSNorm, SwiGLU,
    biases, no QK-norm, RoPE theta 150k; the model builds and its sinks take a gradient."""
    from hydra import compose, initialize_config_dir

    from model.gpt import GPT
    from model.pe import SCHEMES
    from pelab.config import plain
    from pelab.lit import model_config

    with initialize_config_dir(str(project_root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=gptoss_like"])
    config = model_config({"vocab_size": 31, **plain(cfg.model)})
    assert config.layer_windows == (64, None, 64, None) and config.sinks == "learned"
    assert (config.norm, config.mlp, config.qk_norm, config.bias, config.kv_heads) == ("rmsnorm", "swiglu", False,
                                                                                     True, 2)
    assert cfg.pe.base == 150000
    model = GPT(config, SCHEMES["rope"](config, base=cfg.pe.base))
    idx = torch.randint(0, 31, (1, 80), generator=torch.Generator().manual_seed(1))
    model(idx, torch.roll(idx, -1, dims=1))[1].backward()
    assert all(block.attn.sinks.grad is not None for block in model.blocks)
