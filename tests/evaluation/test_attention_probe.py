"""The attention probe against length (evaluation/attention_probe.py): its recorder against hand
values, uniform attention against ln(keys), and its rows, files and statuses."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from pelab.config import ConfigError, build


def test_probe_recorder_hand_computed_in_two_chunks():
    import math

    from evaluation.attention_probe import ProbeRecorder

    # rows of one head: [1], [1/2, 1/2], [1/4, 1/4, 1/2]
    p = torch.tensor([[1.0, 0, 0], [0.5, 0.5, 0], [0.25, 0.25, 0.5]])[None, None]
    recorder = ProbeRecorder(torch.arange(3), torch.arange(3))
    recorder.add_chunk(p[:, :, :2, :2], 0, 3)  # rows [0, 2) see keys [0, 2)
    recorder.add_chunk(p[:, :, 2:], 2, 3)
    recorder.end_layer()
    entropy, distance, uniform, n, first, null = recorder.sums[0]
    assert n == 3 and recorder.calls == 1
    assert float(first[0]) / 3 == pytest.approx((1 + 0.5 + 0.25) / 3, rel=1e-12) and float(null[0]) == 0
    assert float(entropy[0]) / 3 == pytest.approx((0 + math.log(2) + 1.5 * math.log(2)) / 3, rel=1e-12)
    assert float(distance[0]) / 3 == pytest.approx((0 + 0.5 * 1 + 0.25 * 2 + 0.25 * 1) / 3, rel=1e-12)
    assert uniform / 3 == pytest.approx((math.log(1) + math.log(2) + math.log(3)) / 3, rel=1e-12)


def test_probe_of_uniform_attention_is_ln_keys_and_half_the_distance():
    """NoPE with zeroed query and key weights attends uniformly: entropy ln(i + 1), distance i / 2."""
    import math

    from evaluation.attention_probe import probe_attention, probe_rows_of

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    gpt = GPT(cfg, SCHEMES["nope"](cfg))
    with torch.no_grad():
        for block in gpt.blocks:
            block.attn.c_attn.weight[: 2 * cfg.n_embd].zero_()
    windows = torch.randint(0, 32, (2, 64))
    stats = probe_attention(gpt, windows, rows=10, q_chunk=7)
    rows = probe_rows_of(64, 10).tolist()
    assert rows[0] == 0 and rows[-1] == 63 and len(rows) == 10
    for layer in (0, 1):
        assert stats[layer]["rows"] == 2 * 10
        expect = sum(math.log(i + 1) for i in rows) / 10
        assert stats[layer]["entropy"].tolist() == pytest.approx([expect] * 2, rel=1e-5)
        assert stats[layer]["uniform_entropy"] == pytest.approx(expect, rel=1e-12)
        assert stats[layer]["distance"].tolist() == pytest.approx([sum(i / 2 for i in rows) / 10] * 2, rel=1e-5)


def test_a_learned_sink_takes_the_weight_no_token_gets():
    """Uniform logits (q and k weights zero) with a sink logit s_h: gpt-oss's softmax over the
    row's n keys and the sink gives each key 1 / (n + e^s) and the sink e^s / (n + e^s)."""
    import math

    from evaluation.attention_probe import probe_attention, probe_rows_of

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, sinks="learned")
    torch.manual_seed(0)
    gpt = GPT(cfg, SCHEMES["nope"](cfg))
    sinks = (1.5, -0.5)
    with torch.no_grad():
        gpt.blocks[0].attn.c_attn.weight[: 2 * cfg.n_embd].zero_()
        gpt.blocks[0].attn.sinks.copy_(torch.tensor(sinks))
    stats = probe_attention(gpt, torch.randint(0, 32, (1, 40)), rows=8, q_chunk=16)[0]
    rows = probe_rows_of(40, 8).tolist()
    for head, s in enumerate(sinks):
        first = sum(1 / (i + 1 + math.exp(s)) for i in rows) / len(rows)
        null = sum(math.exp(s) / (i + 1 + math.exp(s)) for i in rows) / len(rows)
        assert float(stats["first_weight"][head]) == pytest.approx(first, rel=1e-5)
        assert float(stats["null_weight"][head]) == pytest.approx(null, rel=1e-5)


def test_evaluate_probe_rows_files_and_statuses(tmp_path):
    import numpy as np

    from evaluation.attention_probe import ProbeConfig, ProbeRow, evaluate_probe, save_probe
    from evaluation.sweep import probe_windows, read_rows

    cfg = GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_head=2, n_embd=16)
    torch.manual_seed(0)
    tokens = np.random.default_rng(0).integers(0, 32, 100).astype(np.uint16)
    config = ProbeConfig(multipliers=(1, 4, 16), samples=2, rows=5, q_chunk=4)
    rows = evaluate_probe(GPT(cfg, SCHEMES["alibi"](cfg)), probe_windows(tokens), 8, config, log=lambda _: None)
    assert [(r.eval_length, r.layer, r.head) for r in rows if r.ok] == \
        [(n, layer, head) for n in (8, 32) for layer in (0, 1) for head in (0, 1)]
    assert rows[-1].status == "skipped: held-out text has 100 tokens, fewer than one window of 128"
    paths = save_probe(rows, tmp_path, "t")
    assert paths["png"].stat().st_size > 1000
    back = read_rows(paths["csv"], ProbeRow)
    assert [(r.eval_length, r.layer, r.rows) for r in back[:4]] == [(8, 0, 10), (8, 0, 10), (8, 1, 10), (8, 1, 10)]
    assert all(0 < r.first_weight <= 1 and abs(r.null_weight) < 1e-6 for r in back if r.ok)  # a softmax: no sink
    learned = evaluate_probe(GPT(cfg, SCHEMES["learned"](cfg)), probe_windows(tokens), 8, config, log=lambda _: None)
    assert learned[-1].status == "not applicable: pe=learned has 8 positions"
    with pytest.raises(ConfigError, match="eval.probe.rows must be an integer >= 1, got 0"):
        build("eval.probe", ProbeConfig.from_dict, {"rows": 0})  # a ValueError in evaluation/, shown as a ConfigError
