"""Sliding windows (model.window, model.window_pattern): query i sees keys i-W+1..i by token
order. Every scheme on every CPU backend against a float64 reference whose window is written
out by index; packed documents; a per-layer pattern; query-chunked evaluation reading only the
window's keys; a KV cache bounded by the window; one compiled graph; bad values."""

from __future__ import annotations

import math

import pytest
import torch

from model.attention import BACKENDS, AttentionRequest, Terms, resolve
from model.attention.masks import causal_future
from model.config import GPTConfig
from model.generate import KVCache
from model.pe import SCHEMES
from model import positions
from model.positions import Pass, layer_contexts
from tests.naive import (
    POSITION_SCHEMES, leaf_params, naive_gelu, naive_layer_norm, naive_linear, naive_reference, naive_rotate,
    set_naive_params,
)
from tests.tiny import LEARNED_BIAS, attention_config, build, compiled_training_loss, schemes_where

T = 9
WINDOWS = [1, 3, T]
SCHEMES_ALL = sorted(SCHEMES)
ROWS = [[0, 1, 2, 3, 4, 0, 1, 2, 3], [5, 5, 5, 2, 2, 7, 0, 0, 9]]  # per-sequence positions (reset, repeated)
DOCUMENTS = [[0, 0, 0, 0, 0, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1, 2, 2]]


def visible(i: int, j: int, window: int | None, documents: list[int] | None = None) -> bool:
    """Key j is seen by query i (token indices): not later, inside the window, same document."""
    return j <= i and (window is None or j >= i - window + 1) and (documents is None or documents[i] == documents[j])


def naive_windowed(q, k, v, bias, window, documents=None):
    """(1, H, T, hd) float64 -> (1, T, H*hd): softmax over the keys ``visible`` says, the others -inf."""
    _, H, n, hd = v.shape  # q and k may have another dim (PoPE's 2 hd): the scale is theirs
    seen = torch.tensor([[visible(i, j, window, documents) for j in range(n)] for i in range(n)])
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1]) + (0.0 if bias is None else bias)
    p = torch.softmax(scores.masked_fill(~seen, -math.inf), dim=-1)
    return torch.einsum("bhij,bhjd->bihd", p, v).reshape(1, n, H * hd)


def naive_layer(W, Wp, x64, rows, pe, params, window, documents=None, nope=False):
    """One attention layer in float64, sequence b at positions rows[b], with the window;
    ``nope``: a NoPE layer of a schedule (no rotation, no bias)."""
    rotation = naive_reference("NAIVE_ROTATION", pe.name)({}, pe.head_dim) if pe.uses_rotate and not nope else None
    bias = naive_reference("NAIVE_BIAS", pe.name) if pe.uses_bias and not nope else None
    C = x64.shape[-1]
    outs = []
    for b, pos in enumerate(rows):
        y = x64[b : b + 1] @ W.T
        q, k, v = (y[..., n * C:(n + 1) * C].view(1, len(pos), pe.n_head, -1).transpose(1, 2) for n in range(3))
        if rotation is not None:
            q, k = naive_rotate(q, pos, rotation, +1.0), naive_rotate(k, pos, rotation, -1.0)
        b_bias = None if bias is None else bias(pe, params, pos, pos, {})
        outs.append(naive_windowed(q, k, v, b_bias, window, None if documents is None else documents[b]) @ Wp.T)
    return torch.cat(outs)


def naive_logits(model, idx, windows):
    """Whole-model float64 logits at positions 0.., layer l with windows[l] (and without position
    terms in the model's NoPE layers)."""
    pe, n = model.pe, idx.shape[1]
    params = {name: t.detach() for name, t in leaf_params(pe).items()}
    x = model.wte.weight.detach().double()[idx]
    rows = [list(range(n))] * idx.shape[0]
    if pe.uses_embed:
        x = x + torch.stack([naive_reference("NAIVE_EMBED", pe.name)(pe, params, r, {}) for r in rows])
    for layer, (block, window) in enumerate(zip(model.blocks, windows)):
        a = block.attn
        x = x + naive_layer(a.c_attn.weight.detach().double(), a.c_proj.weight.detach().double(),
                            naive_layer_norm(x, block.ln_1), rows, pe, params, window,
                            nope=layer in model.nope_layers)
        h = naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(h))
    return (naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T)[..., : model.config.vocab_size]


def test_window_is_w_keys_including_the_query():
    """The off-by-one pin: W=3 lets query i see i-2, i-1, i and not i-3; W=1 is the query alone."""
    hidden = causal_future(5, 5, window=3)
    assert (~hidden).int().tolist() == [[1, 0, 0, 0, 0],
                                        [1, 1, 0, 0, 0],
                                        [1, 1, 1, 0, 0],
                                        [0, 1, 1, 1, 0],
                                        [0, 0, 1, 1, 1]]
    assert torch.equal(~causal_future(4, 4, window=1), torch.eye(4, dtype=torch.bool))
    # queries that are the last 2 of 6 keys (after a cache): token 4 sees 2..4, token 5 sees 3..5
    assert (~causal_future(2, 6, window=3)).int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1]]


@pytest.mark.parametrize("window", [2, 3])
def test_recorded_probabilities_cover_exactly_the_window(window):
    from model.attention import AttentionRecorder

    _, model, _ = build("alibi", attention="math", window=window)
    record = AttentionRecorder()
    idx = torch.randint(0, 31, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model.hidden(idx, how=Pass(record=record))
    for probs in record.probs.values():
        seen = (probs[0] > 0).all(0)  # (T, T): every head puts mass on exactly the visible keys
        assert seen.tolist() == [[visible(i, j, window) for j in range(8)] for i in range(8)]


def route(model, backend: str, grad: bool):
    """The backend resolve gives a layer of this scheme on CPU."""
    return resolve(backend, AttentionRequest(model.pe, torch.device("cpu"), grad=grad))


# every backend a scheme reaches on CPU: sdpa_key where the bias is key-only, bias_grad where it is learned
KEY_ONLY = schemes_where(lambda pe: pe.key_only_slopes() is not None)
ROUTES = [(name, backend) for name in POSITION_SCHEMES for backend in ("sdpa", "math", "flex", "sdpa_key", "bias_grad")
          if (backend != "sdpa_key" or name in KEY_ONLY) and (backend != "bias_grad" or name in LEARNED_BIAS)]
CASES = [(w, False) for w in WINDOWS] + [(3, True)]  # W=1 (self only), 3, T (full), and 3 with packed documents


@pytest.mark.parametrize("window, documents", CASES, ids=["W1", "W3", f"W{T}", "W3-documents"])
@pytest.mark.parametrize("name, backend", ROUTES, ids=[f"{n}-{b}" for n, b in ROUTES])
def test_every_scheme_and_backend_matches_float64(name, backend, window, documents):
    """One layer with the window (and packed documents) against the float64 reference; gradients
    of the input and of the learned biases' parameters where the backend has a backward (CPU flex
    has none; sdpa with a learned bias runs forward only, its backward is bias_grad's)."""
    _, model, attn = build(name, seed=3, attention=backend)
    set_naive_params(model.pe)
    grad = backend != "flex" and not (backend == "sdpa" and name in LEARNED_BIAS)
    positions = torch.tensor(ROWS)
    docs = torch.tensor(DOCUMENTS) if documents else None
    terms = Terms(model.pe, positions, positions, q_documents=docs, k_documents=docs)
    ctx = layer_contexts(terms, route(model, backend, grad), windows=(window,))[0]
    x = torch.randn(2, T, 32, generator=torch.Generator().manual_seed(4)).requires_grad_(grad)
    weights = torch.randn(2, T, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.set_grad_enabled(grad):
        y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    params = leaf_params(model.pe)
    ref = naive_layer(attn.c_attn.weight.detach().double(), attn.c_proj.weight.detach().double(), x64, ROWS,
                      model.pe, params, window, DOCUMENTS if documents else None)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = [("x", x.grad, x64.grad)] + [(n, p.grad, params[n].grad) for n, p in model.pe.named_parameters()
                                         if params[n].grad is not None]
    if name in LEARNED_BIAS:
        assert len(pairs) > 1, "the learned bias must receive a gradient"
    for n, got, want in pairs:
        scale = want.abs().max().item()
        if scale < 1e-9:  # FIRE's output bias shifts whole rows: the softmax ignores it
            assert got.abs().max() < 1e-5
            continue
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "learned"])
def test_pattern_sets_each_layers_window(name):
    """window_pattern=[2, null] over 3 layers: layers 0 and 2 windowed, layer 1 full."""
    _, model, _ = build(name, seed=5, n_layer=3, window_pattern=[2, None])
    set_naive_params(model.pe)
    assert model.config.layer_windows == (2, None, 2)
    idx = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        logits = model(idx)[0]
    torch.testing.assert_close(logits.double(), naive_logits(model, idx, (2, None, 2)), atol=1e-5, rtol=1e-5)
    # and the pattern matters: all-full attention differs
    assert not torch.allclose(logits.double(), naive_logits(model, idx, (None, None, None)), atol=1e-3)


# every backend once (bias_grad runs sdpa without autograd), a rotation, a key-only bias and learned biases
@pytest.mark.parametrize("name", ["rope", "alibi"])
def test_pattern_with_nope_layers_builds_each_kind_of_layer(name):
    """window_pattern=[2, null] with NoPE layers 1 and 2: (scheme, 2), (NoPE, full), (NoPE, 2),
    (scheme, full), each as the float64 model says."""
    from model.gpt import GPT

    torch.manual_seed(14)
    config = attention_config(n_layer=4, window_pattern=[2, None])
    model = GPT(config, SCHEMES[name](config), nope_layers=frozenset({1, 2})).eval()
    for block in model.blocks:
        torch.nn.init.normal_(block.attn.c_attn.weight, std=0.3)
    idx = torch.randint(0, 31, (2, 10), generator=torch.Generator().manual_seed(15))
    with torch.no_grad():
        logits = model(idx)[0]
    torch.testing.assert_close(logits.double(), naive_logits(model, idx, (2, None, 2, None)), atol=1e-5, rtol=1e-5)


CHUNK_ROUTES = [("rope", "sdpa"), ("nope", "math"), ("alibi", "sdpa_key"), ("alibi", "flex"), ("t5", "flex"),
                ("fire", "bias_grad")]


@pytest.mark.parametrize("name, backend", CHUNK_ROUTES, ids=[f"{n}-{b}" for n, b in CHUNK_ROUTES])
def test_chunked_evaluation_reads_only_the_window_and_equals_unchunked(name, backend, monkeypatch):
    """Query chunks of 4 of 24 tokens with W=5: a chunk's K/V slice is at most 4 + 5 - 1 keys
    (flex attends the full K/V, its window BlockMask skipping the blocks before); the NLL equals
    the unchunked forward's and the float64 model's."""
    _, model, _ = build(name, seed=7, attention=backend, window=5)
    set_naive_params(model.pe)
    idx = torch.randint(0, 31, (2, 24), generator=torch.Generator().manual_seed(8))
    targets = torch.roll(idx, -1, dims=1)
    seen = []
    cls = type(BACKENDS[route(model, backend, False).name])
    call = cls.__call__

    def spy(self, q, k, v, state, dropout):
        seen.append((q.shape[2], k.shape[2]))
        return call(self, q, k, v, state, dropout)

    with torch.no_grad():
        whole = model.token_nll(idx, targets)
        monkeypatch.setattr(cls, "__call__", spy)
        chunked = model.token_nll(idx, targets, q_chunk=4)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=1e-5)
    ref = naive_logits(model, idx, (5, 5))
    ref_nll = torch.logsumexp(ref, -1) - ref.gather(-1, targets[..., None])[..., 0]
    torch.testing.assert_close(chunked.double(), ref_nll, atol=1e-5, rtol=1e-5)
    assert seen and all(q == 4 for q, _ in seen)
    if backend != "flex":
        assert max(k for _, k in seen) == 4 + 5 - 1


@pytest.mark.parametrize("name", ["rope", "t5"])
def test_long_windowed_training_forward_attends_in_window_chunks(name, monkeypatch):
    """T=160 with W=5: training chunks of 64 rows read at most 64 + 4 keys; the loss and every
    gradient equal the unchunked masked kernel's, the logits the float64 model's."""
    _, model, _ = build(name, seed=12, window=5, block_size=160)
    set_naive_params(model.pe)
    model.train()
    idx = torch.randint(0, 31, (2, 160), generator=torch.Generator().manual_seed(13))
    targets = torch.roll(idx, -1, dims=1)
    cls = type(route(model, "sdpa", True))
    call, seen = cls.__call__, []

    def spy(self, q, k, v, state, dropout):
        seen.append((q.shape[2], k.shape[2]))
        return call(self, q, k, v, state, dropout)

    def step():
        model.zero_grad()
        logits, loss = model(idx, targets)
        loss.backward()
        return logits, loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    monkeypatch.setattr(cls, "__call__", spy)
    logits, loss, grads = step()
    assert {q for q, _ in seen} == {64, 32} and max(k for _, k in seen) == 64 + 4
    monkeypatch.setattr(positions, "WINDOW_ROWS", 10**6)  # one masked kernel over all 160 rows
    seen.clear()
    _, whole, whole_grads = step()
    assert {q for q, _ in seen} == {160}
    torch.testing.assert_close(loss, whole, atol=1e-6, rtol=1e-6)
    for n, g in whole_grads.items():
        torch.testing.assert_close(grads[n], g, atol=1e-6, rtol=1e-4, msg=lambda m: f"{n}: {m}")
    torch.testing.assert_close(logits.double(), naive_logits(model.eval(), idx, (5, 5)), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("windows", [{"window": 3}, {"window_pattern": [3, None]}], ids=["window", "pattern"])
@pytest.mark.parametrize("name", ["rope", "alibi", "t5", "nope"])
def test_cache_keeps_the_window_and_decodes_as_without(name, windows):
    """Greedy generation with the cache equals it without; cached logits equal the full forward's;
    a windowed layer's cache holds at most W - 1 keys between steps, a full layer's all of them."""
    _, model, _ = build(name, seed=9, block_size=64, **windows)
    for block in model.blocks:  # far from uniform attention, so a stale or missing key shows
        torch.nn.init.normal_(block.attn.c_attn.weight, std=0.4)
    idx = torch.randint(0, 31, (2, 4), generator=torch.Generator().manual_seed(10))
    cached = model.generate(idx, 12, temperature=0)
    assert torch.equal(cached, model.generate(idx, 12, temperature=0, cache=False))
    full = cached[:, :14]
    kv = KVCache(len(model.blocks), torch.arange(14), model.config.layer_windows)
    sizes = []
    with torch.no_grad():
        h = [model.hidden(full[:, :5], cache=kv)]
        for t in range(5, 14):
            h.append(model.hidden(full[:, t : t + 1], cache=kv))
            sizes.append([layer.k.shape[2] for layer in kv.layers])
        reference = model.logits(model.hidden(full))
    torch.testing.assert_close(model.logits(torch.cat(h, dim=1)), reference, atol=1e-5, rtol=1e-5)
    for w, layer_sizes in zip(model.config.layer_windows, zip(*sizes)):
        if w is None:
            assert list(layer_sizes) == list(range(6, 15))
        else:
            assert set(layer_sizes) == {w - 1}


def test_windowed_model_compiles_to_one_graph():
    """A window pattern with a learned bias: one graph, no break, eager's loss and no recompile."""
    _, model, _ = build("t5", n_layer=2, window_pattern=[3, None])
    compiled_training_loss(model)


def test_flex_window_block_mask_compiles_fullgraph(name="alibi"):
    """flex's window BlockMask built inside the compiled graph (forward: CPU flex has no backward),
    with and without packed documents; eager's logits."""
    torch._dynamo.reset()
    _, model, _ = build(name, attention="flex", window=3)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, 31, (2, 12), generator=torch.Generator().manual_seed(16))
    documents = torch.tensor([[0] * 5 + [1] * 7, [0] * 8 + [1] * 4])
    with torch.no_grad():
        for docs in (None, documents):
            torch.testing.assert_close(compiled(idx, None, None, docs)[0], model(idx, None, None, docs)[0],
                                       atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 0}, "model.window must be null (full attention) or an integer >= 1 (keys i-W+1..i), got 0"),
    ({"window": -4}, "model.window must be null (full attention) or an integer >= 1"),
    ({"window": True}, "got True"),
    ({"window": 2.5}, "got 2.5"),
    ({"window_pattern": [64, 0]}, "model.window_pattern must be null or a list of integers >= 1 and nulls"),
    ({"window_pattern": [64, "full"]}, "got [64, 'full']"),
    ({"window": 8, "window_pattern": [8, None]}, "model.window and model.window_pattern must be one of the two"),
    ({"window_pattern": [8, None, 8, None, 8]}, "model.window_pattern must be 1 to model.n_layer=4 entries"),
    ({"window": 8, "attn_temperature": "log_length"}, "model.attn_temperature must be none or llama4 with windows"),
])
def test_bad_windows_fail_with_one_line(kwargs, message):
    with pytest.raises(ValueError) as err:
        GPTConfig(vocab_size=8, n_layer=4, **kwargs)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_bad_window_types_fail_in_the_harness_check():
    from pelab.config import ConfigError
    from pelab.lit import model_config

    assert model_config({"vocab_size": 1, "window_pattern": [64, None]}).layer_windows == (64, None, 64, None)
    with pytest.raises(ConfigError, match="model.window must be an integer or null, got True"):
        model_config({"vocab_size": 1, "window": True})


@pytest.mark.parametrize("n_layer", [4, 6, 8, 12])
def test_rnope_swa_preset_puts_nope_on_the_full_attention_layers(project_root, n_layer):
    """experiment=rnope_swa as train.py composes it: RNoPE-SWA's layout (Yang et al. 2025) is
    three windowed layers with positions, then one full-attention NoPE layer: 0-based layer i is
    global iff i % 4 == 3, and those are exactly the NoPE layers."""
    from hydra import compose, initialize_config_dir

    from model.pe.schedule import LAYER_KEYS, layer_positions
    from pelab.config import plain
    from pelab.lit import model_config

    with initialize_config_dir(str(project_root / "conf"), version_base="1.3"):
        cfg = compose("config", overrides=["experiment=rnope_swa", f"model.n_layer={n_layer}"])
    config = model_config({"vocab_size": 1, **plain(cfg.model)})
    full = {i for i, w in enumerate(config.layer_windows) if w is None}
    assert full == {i for i in range(n_layer) if i % 4 == 3}
    assert layer_positions(config.layer_windows, *(cfg.pe.get(k) for k in LAYER_KEYS))[0] == full
    assert all(w == 64 for i, w in enumerate(config.layer_windows) if i not in full)
