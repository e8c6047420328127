"""Causality is token order on every attention path, whatever the positions say (reset, repeated):
changing token t leaves every earlier output unchanged and changes the output at t."""

from __future__ import annotations

import pytest
import torch

from evaluation.attention_maps import attention_probs, eager_attention_pass
from model.attention.masks import attention_mask
from model.gpt import GPT
from model.pe import SCHEMES
from tests.position_context import position_context
from tests.tiny import build as build_layer, tiny_gpt

ALL_SCHEMES = sorted(SCHEMES)
T = 16
# Two packed documents (positions reset) and a run of repeats: later tokens carry position
# values smaller than, or equal to, earlier ones.
POSITION_SETS = {
    "reset": list(range(8)) + list(range(8)),
    "repeat": [3, 3, 3, 0, 9, 9, 1, 1, 1, 12, 2, 2, 5, 5, 0, 4],
}
CHANGED = (1, 6, 9, 13)  # tokens to change, inside and across the reset


def outputs(model: GPT, idx: torch.Tensor, positions: torch.Tensor, path: str) -> torch.Tensor:
    """(B, T, ...) per-token outputs of one attention path."""
    with torch.no_grad():
        if path == "forward":  # the training path: fused SDPA, is_causal or the float mask
            return model(idx, positions=positions)[0]
        if path == "chunked":  # long evaluation: query chunks of 5 against all earlier keys
            targets = torch.arange(idx.numel()).view_as(idx) % 37  # fixed: only inputs change
            return model.token_nll(idx, targets, positions=positions, q_chunk=5)[..., None]
        if path == "probe":  # eager pass materialising probabilities
            run = eager_attention_pass(model, idx, positions, return_hidden=True)
            probs = torch.cat([p.transpose(1, 2).flatten(2) for p in run.probs.values()], dim=-1)
            return torch.cat([run.hidden, probs], dim=-1)
    raise AssertionError(path)


@pytest.mark.parametrize("path", ["forward", "chunked", "probe"])
@pytest.mark.parametrize("positions_name", list(POSITION_SETS))
@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_changing_token_t_changes_nothing_before_t(name, positions_name, path):
    model = tiny_gpt(name, sharpen=0.3)  # sharper attention, so a leak would show
    positions = torch.tensor(POSITION_SETS[positions_name])
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 37, (2, T), generator=generator)
    base = outputs(model, idx, positions, path)
    for t in CHANGED:
        changed = idx.clone()
        changed[:, t] = (changed[:, t] + 1 + torch.randint(0, 35, (2,), generator=generator)) % 37
        out = outputs(model, changed, positions, path)
        torch.testing.assert_close(out[:, :t], base[:, :t], atol=1e-6, rtol=0,
                                   msg=lambda m: f"token {t} leaked into earlier outputs ({path}): {m}")
        assert (out[:, t] - base[:, t]).abs().max() > 1e-4, f"changing token {t} changed nothing at {t}"


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_probe_rows_put_zero_weight_on_later_tokens(name):
    """With reset positions an earlier key can have a larger position than the query:
    order, not value, decides what is masked."""
    model = tiny_gpt(name, sharpen=0.3)
    positions = torch.tensor(POSITION_SETS["reset"])
    idx = torch.randint(0, 37, (1, T), generator=torch.Generator().manual_seed(2))
    for p in attention_probs(model, idx, positions).values():
        later = torch.ones(T, T, dtype=torch.bool).triu(1)
        assert torch.all(p[..., later] == 0)
        earlier = ~later
        assert torch.all(p[..., earlier] > 0)  # keys 0..i all visible, e.g. key 7 from query 8
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]))


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_per_sequence_positions_equal_running_each_sequence_alone(name):
    """(B, T) positions (each sequence its own: packed documents, randomized positions) give
    every row exactly what that row gives alone with its (T,) positions, on every path."""
    model = tiny_gpt(name, sharpen=0.3)
    positions = torch.tensor([POSITION_SETS["reset"], POSITION_SETS["repeat"], [t % 11 for t in range(T)]])
    idx = torch.randint(0, 37, (3, T), generator=torch.Generator().manual_seed(3))
    targets = torch.randint(0, 37, (3, T), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        batched = model(idx, positions=positions)[0]
        batched_nll = model.token_nll(idx, targets, positions=positions, q_chunk=5)
        batched_probs = attention_probs(model, idx, positions)
        for b in range(3):
            alone = model(idx[b : b + 1], positions=positions[b])[0]
            torch.testing.assert_close(batched[b : b + 1], alone, atol=1e-5, rtol=1e-5)
            nll = model.token_nll(idx[b : b + 1], targets[b : b + 1], positions=positions[b], q_chunk=5)
            torch.testing.assert_close(batched_nll[b : b + 1], nll, atol=1e-5, rtol=1e-5)
            for layer, p in attention_probs(model, idx[b : b + 1], positions[b]).items():
                torch.testing.assert_close(batched_probs[layer][b : b + 1], p, atol=1e-6, rtol=1e-5)
    assert (batched[0] - batched[1]).abs().max() > 0  # the rows really differ


def test_positions_of_the_wrong_shape_are_refused():
    model = tiny_gpt("rope", sharpen=0.3)
    with pytest.raises(ValueError, match=r"positions must have shape \(16,\) or \(batch, 16\), got \(2, 15\)"):
        model(torch.zeros(2, T, dtype=torch.long), positions=torch.zeros(2, T - 1, dtype=torch.long))


def test_causality_future_tokens_do_not_leak():
    # a context of positions alone (position_context): the data-dependent schemes (fox, cope) need each layer's
    # input or scores, and test their causality in tests/pe/test_fox.py and test_cope.py
    for name in (n for n in ALL_SCHEMES if SCHEMES[n].terms is None):
        cfg, model, attn = build_layer(name, {}, seed=3)
        positions = torch.arange(8)
        x = torch.randn(1, 8, cfg.n_embd)
        x2 = x.clone()
        x2[:, 5:] = torch.randn(1, 3, cfg.n_embd)
        mask = attention_mask(model.pe, positions, positions, torch.float32)
        with torch.no_grad():
            a = attn(x, position_context(model.pe, positions, mask))
            b = attn(x2, position_context(model.pe, positions, mask))
        torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
        assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-3
