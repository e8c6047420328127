"""Streaming evaluation (evaluation/streaming.py, StreamingLLM): a cache holding the whole text is
the ordinary full-context evaluation; with eviction, each step equals a plain forward over the
sinks and the window at the positions the rule gives; the cache stays within sinks + window;
the probe's rows, files and refusals."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.attention_probe import probe_windows
from evaluation.streaming import PROBE, StreamingConfig, evaluate_streaming, position_buckets, stream_nll
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES

VOCAB = 37


def tiny(scheme: str, n_layer: int = 2, block_size: int = 64) -> GPT:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=VOCAB, block_size=block_size, n_layer=n_layer, n_head=2, n_embd=32)
    model = GPT(config, SCHEMES[scheme](config)).eval()
    with torch.no_grad():
        for block in model.blocks:  # sharper attention than GPT-2's init, so which keys are kept shows
            block.attn.c_attn.weight.mul_(8)
    return model


def text(n: int, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, n), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("scheme", ["rope", "alibi", "learned", "fox", "cope"])
def test_a_cache_that_holds_the_whole_text_is_the_full_context_evaluation(scheme):
    model, tokens = tiny(scheme), text(20)
    with torch.no_grad():
        full = model.token_nll(tokens[:, :-1], tokens[:, 1:])
    for rule in ("reindexed", "absolute"):
        nll, peak = stream_nll(model, tokens, sinks=4, window=16, cache_positions=rule)
        torch.testing.assert_close(nll, full, atol=2e-5, rtol=0)
        assert peak == 19  # the last step's keys: every token but the final target


@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_each_step_is_a_plain_forward_over_the_sinks_and_the_window(scheme):
    """One layer, so a cached key is a function of its token and position only (deeper layers'
    keys keep the context they were computed in): after the first eviction the prediction at
    step t equals a plain forward over tokens [0, S) + [t - W + 1, t], at positions 0..S+W-1
    (re-indexed) or at their text positions (absolute)."""
    S, W, n = 2, 4, 16
    model, tokens = tiny(scheme, n_layer=1), text(n)
    reindexed, peak = stream_nll(model, tokens, S, W, "reindexed")
    absolute, _ = stream_nll(model, tokens, S, W, "absolute")
    assert peak == S + W
    for t in range(S + W, n - 1):
        kept = list(range(S)) + list(range(t - W + 1, t + 1))
        for got, positions in ((reindexed, None), (absolute, torch.tensor(kept))):
            with torch.no_grad():
                logits = model(tokens[:, kept], positions=positions)[0][:, -1]
            torch.testing.assert_close(got[:, t], F.cross_entropy(logits, tokens[:, t + 1], reduction="none"),
                                       atol=2e-5, rtol=0)
    assert (reindexed[:, S + W:] - absolute[:, S + W:]).abs().max() > 1e-3  # the two rules differ


def test_fox_streams_the_cache_as_one_contiguous_text_when_reindexed():
    """FoX has no positions: re-indexed, step t equals a plain forward over tokens [0, S) +
    [t - W + 1, t], the gates of the evicted tokens out of every decay; absolute keeps them in."""
    S, W, n = 2, 4, 16
    model, tokens = tiny("fox", n_layer=1), text(n)
    with torch.no_grad():
        for gate in model.pe.gates:  # decays far from 1, so dropping the evicted gates shows
            gate.bias.fill_(-1.0)
    reindexed, _ = stream_nll(model, tokens, S, W, "reindexed")
    absolute, _ = stream_nll(model, tokens, S, W, "absolute")
    for t in range(S + W, n - 1):
        kept = list(range(S)) + list(range(t - W + 1, t + 1))
        with torch.no_grad():
            logits = model(tokens[:, kept])[0][:, -1]
        torch.testing.assert_close(reindexed[:, t], F.cross_entropy(logits, tokens[:, t + 1], reduction="none"),
                                   atol=2e-5, rtol=0)
    assert (reindexed[:, S + W:] - absolute[:, S + W:]).abs().max() > 1e-3


def test_the_cache_stays_within_sinks_plus_window_in_every_layer():
    model = tiny("rope")
    from model.cache import KVCache, Sinks

    cache = KVCache(2, torch.arange(20), policy=Sinks(sinks=3, window=4))
    seen = []
    with torch.no_grad():
        for t, token in enumerate(text(20, batch=1)[0]):
            cache.evict()
            cache.place_sinks(model, text(20, batch=1)[:, :3])
            model.hidden(token.view(1, 1), torch.tensor([t]), cache=cache)
            seen.append([layer.k.shape[2] for layer in cache.layers] + [cache.length])
    assert max(max(s) for s in seen) == 7 and seen[-1] == [7, 7, 7]
    assert cache.positions.tolist() == [13, 14, 15, 16, 17, 18, 19]  # re-indexed: the sinks just before the window


def test_position_buckets():
    assert position_buckets(100, 16) == [(0, 16), (16, 32), (32, 64), (64, 100)]
    assert position_buckets(64, 16, per_octave=2) == [(0, 16), (16, 23), (23, 32), (32, 45), (45, 64)]
    assert position_buckets(10, 16) == [(0, 10)]


def test_the_probe_writes_its_table_and_refuses_what_it_cannot_score(tmp_path):
    """Through the registry: rows per rule and bucket up to 4 L, CSV + markdown + plot, W&B data;
    a learned table shorter than the text is not applicable; bad options fail in one line."""
    from evaluation.registry import PROBES

    assert PROBES["streaming"] is PROBE
    tokens = np.random.default_rng(0).integers(0, VOCAB, 100)
    config = StreamingConfig.from_dict({"multiplier": 4, "sinks": 2, "cache_positions": ["reindexed", "absolute"]})
    rows = evaluate_streaming(tiny("rope"), probe_windows(tokens), 8, config, log=lambda _: None)
    assert [(r.cache_positions, r.start, r.end) for r in rows] == [
        (rule, s, e) for rule in ("reindexed", "absolute") for s, e in ((0, 8), (8, 16), (16, 31))]
    assert all(r.ok and r.window == 6 and r.max_cache == 8 and r.model_sinks == "none" for r in rows)
    paths = PROBE.save(rows, tmp_path, "tiny")
    with open(paths["csv"]) as f:
        assert len(list(csv.DictReader(f))) == 6
    assert "| rope / reindexed, S=2 W=6 |" in paths["md"].read_text() and paths["png"].exists()
    [(logged, metrics)] = PROBE.reports(rows, paths)
    assert "streaming/table" in logged.tables and metrics["streaming/absolute/ppl@31"] == rows[-1].ppl
    chart = logged.charts["streaming/ppl_vs_position"]  # one line per rule over log2(bucket end)
    assert chart.keys == ["reindexed, S=2 W=6", "absolute, S=2 W=6"] and chart.xs == [3.0, 4.0, math.log2(31)]
    assert chart.ys == [[r.ppl for r in rows[:3]], [r.ppl for r in rows[3:]]]
    learned = evaluate_streaming(tiny("learned", block_size=16), probe_windows(tokens), 8, config,
                                 log=lambda _: None)
    assert all(r.status == "not applicable: pe=learned has 16 positions" for r in learned)
    short = evaluate_streaming(tiny("rope"), probe_windows(tokens[:20]), 8, config, log=lambda _: None)
    assert short[0].status.startswith("skipped: held-out text has 20 tokens")
    for bad, message in (({"cache_positions": ["slots"]}, "eval.streaming.cache_positions must be a non-empty list"),
                         ({"sinks": -1}, "eval.streaming.sinks must be an integer >= 0, got -1"),
                         ({"window": 0}, "eval.streaming.window must be null")):
        with pytest.raises(ValueError, match=message):
            StreamingConfig.from_dict(bad)
