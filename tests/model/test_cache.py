"""The KV cache (model/cache.py) under each eviction policy, on a FoX model with a sliding window:
every decoding step equals a float64 forward written out by hand over the tokens the cache holds,
with FoX's c of the text the policy says (the whole text's, or the kept tokens' as one text);
keys, values and key terms stay aligned; bad arguments fail early."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from model.cache import KVCache, Sinks, Windows
from tests.tiny import tiny_gpt

S, W, N, WINDOW = 2, 4, 14, 5  # sinks, recent keys, text length, the model's window (< S + W: it hides a sink)


def fox(window: int = WINDOW):
    model = tiny_gpt("fox", 0, sharpen=0.4, n_layer=1, block_size=32, window=window).double()
    with torch.no_grad():  # strong gates far from 1, so a wrong or stale c shows
        for gate in model.pe.gates:
            gate.weight.normal_(std=1.0)
            gate.bias.uniform_(-2.0, 0.0)
    return model


def reference(model, tokens, kept: list[int], c_text: list[int]) -> torch.Tensor:
    """(B, V) logits of the last of ``kept`` by hand: it attends the last ``WINDOW`` kept tokens
    with scores q.k / sqrt(d) + c_i - c_j, c the cumulative log forget gates over the tokens
    ``c_text`` (a superset of ``kept`` in text order)."""
    block, attn = model.blocks[0], model.blocks[0].attn
    B, C, H = tokens.shape[0], model.config.n_embd, attn.n_head

    def heads(t):
        return t.view(B, -1, H, C // H).transpose(1, 2)

    x = model.wte(tokens[:, kept])
    q, k, v = (heads(t) for t in attn.c_attn(block.ln_1(x)).split(C, dim=2))
    gates = F.logsigmoid(model.pe.gates[0](block.ln_1(model.wte(tokens[:, c_text])))).transpose(1, 2)
    c = gates.cumsum(-1)[..., [c_text.index(i) for i in kept]]
    scores = (q[:, :, -1:] @ k.transpose(-1, -2)) / math.sqrt(C // H) + c[..., -1:, None] - c[..., None, :]
    scores[..., : max(0, len(kept) - WINDOW)] = float("-inf")  # the window: the last WINDOW keys held
    y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, 1, C)
    h = x[:, -1:] + attn.c_proj(y)
    h = h + block.mlp(block.ln_2(h))
    return model.logits(model.ln_f(h))[:, 0]


POLICIES = {"windows": Windows((WINDOW,)), "reindexed": Sinks(S, W), "absolute": Sinks(S, W, reindexed=False)}


@torch.no_grad()
@pytest.mark.parametrize("policy", POLICIES)
def test_each_step_equals_a_forward_by_hand_over_what_the_cache_holds(policy):
    """windows: every earlier token, the whole text's c (= the full forward); reindexed: sinks +
    recent as one contiguous text (the evicted gates out of c); absolute: sinks + recent with the
    whole text's c (the evicted gates kept between a sink and the recent keys)."""
    model = fox()
    tokens = torch.randint(0, 37, (2, N), generator=torch.Generator().manual_seed(5))
    span = torch.arange(N)
    cache = KVCache(1, span, policy=POLICIES[policy])
    full = model.logits(model.hidden(tokens))
    for t in range(N):
        cache.evict()
        cache.place_sinks(model, tokens[:, :S])
        got = model.logits(model.hidden(tokens[:, t : t + 1], span[t : t + 1], cache=cache))[:, 0]
        everything = list(range(t + 1))
        if policy == "windows":
            kept, c_text = everything, everything
            torch.testing.assert_close(got, full[:, t], rtol=1e-10, atol=1e-12)
        else:
            kept = list(range(min(S, t + 1))) + list(range(max(S, t - W + 1), t + 1))
            c_text = kept if policy == "reindexed" else everything
        torch.testing.assert_close(got, reference(model, tokens, kept, c_text), rtol=1e-10, atol=1e-12)
        layer = cache.layers[0]
        assert layer.k.shape[2] == layer.v.shape[2] == layer.key_terms.shape[-1]  # evicted together
        if policy == "windows":
            assert layer.k.shape[2] == min(t + 1, WINDOW - 1)
        else:
            assert cache.length == layer.k.shape[2] == len(kept)
            held = cache.positions.tolist()
            if policy == "absolute" or t < S + W:
                assert held == kept
            else:  # re-indexed: the sinks right before the recent keys
                assert held == list(range(t - W - S + 1, t + 1))
    assert cache.peak == (WINDOW if policy == "windows" else S + W)
    if policy != "windows":  # the reference tells the rules apart (evicted gates in c or not), far above the tolerance
        assert (reference(model, tokens, kept, kept) - reference(model, tokens, kept, everything)).abs().max() > 1e-5


def test_windows_is_the_default_and_bad_arguments_fail_early():
    cache = KVCache(3, torch.arange(4), (2, None))
    assert cache.policy == Windows((2, None)) and [layer.window for layer in cache.layers] == [2, None, None]
    with pytest.raises(ValueError, match="KVCache takes windows or a policy, not both"):
        KVCache(2, torch.arange(4), (2,), policy=Sinks(1, 2))
    for sinks, window in ((-1, 2), (1, 0)):
        with pytest.raises(ValueError, match=rf"Sinks\(sinks={sinks}, window={window}\): sinks must be >= 0"):
            Sinks(sinks, window)
