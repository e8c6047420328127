"""evaluation/extrapolation.py: perplexity per length against a naive window-by-window loop
(non-overlapping, sliding, capped windows), "not applicable" past a learned table, result files."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.extrapolation import (
    ExtrapolationConfig, ExtrapolationRow, evaluate_extrapolation, markdown_table, read_csv, save_results, score_length,
    scored_windows, window_starts,
)
from model import GPTConfig
from tests.tiny import schemes_where, tiny_gpt

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 50, size=700).astype(np.uint16)


def naive_nll(gpt, tokens, length, stride, starts=None):
    """Sum of -log p over the last `stride` targets of windows starting at 0, stride, 2*stride, ...
    (or at the given `starts`)."""
    total, count, s = 0.0, 0, 0
    todo = None if starts is None else list(starts)
    while (s + length + 1 <= len(tokens)) if todo is None else todo:
        if todo is not None:
            s = todo.pop(0)
        window = torch.tensor(tokens[s : s + length + 1].astype(np.int64))[None]
        with torch.no_grad():
            logits, _ = gpt(window[:, :-1])
        logp = F.log_softmax(logits.double(), dim=-1)[0]
        for t in range(length - stride, length):
            total -= logp[t, window[0, t + 1]].item()
            count += 1
        s += stride
    return total, count


@pytest.mark.parametrize("scheme", schemes_where(lambda pe: pe.max_positions is None))  # scored past block_size
def test_nonoverlapping_matches_hand_computed_ppl(scheme, tokens):
    gpt = tiny_gpt(scheme, config=CFG)
    total, count, _ = score_length(gpt, tokens, 32, "nonoverlapping", precision="32", tokens_per_batch=64)
    ref_total, ref_count = naive_nll(gpt, tokens, 32, 32)
    assert count == ref_count == (len(tokens) - 1) // 32 * 32
    assert math.exp(total / count) == pytest.approx(math.exp(ref_total / ref_count), rel=1e-5)


@pytest.mark.parametrize("stride", [8, 20])
def test_sliding_matches_hand_computed_ppl(stride, tokens):
    gpt = tiny_gpt("rope_alibi", config=CFG)
    total, count, step = score_length(gpt, tokens, 48, "sliding", stride=stride, precision="32")
    ref_total, ref_count = naive_nll(gpt, tokens, 48, stride)
    assert step == stride and count == ref_count
    assert total / count == pytest.approx(ref_total / ref_count, rel=1e-5)


def test_sliding_with_stride_equal_window_is_nonoverlapping(tokens):
    gpt = tiny_gpt("xpos", config=CFG)
    a = score_length(gpt, tokens, 40, "nonoverlapping", precision="32")
    b = score_length(gpt, tokens, 40, "sliding", stride=40, precision="32")
    assert a[1] == b[1] and a[0] == pytest.approx(b[0], rel=1e-6)


def test_query_chunks_do_not_change_the_result(tokens):
    gpt = tiny_gpt("alibi", config=CFG)
    a = score_length(gpt, tokens, 128, "nonoverlapping", q_chunk=None, precision="32")
    b = score_length(gpt, tokens, 128, "nonoverlapping", q_chunk=24, precision="32")
    assert a[1] == b[1] and a[0] == pytest.approx(b[0], rel=1e-6)


def test_max_tokens_counts_whole_windows(tokens):
    gpt = tiny_gpt("alibi", config=CFG)
    total, count, _ = score_length(gpt, tokens, 32, "nonoverlapping", max_tokens=100, precision="32")
    assert count == 96  # three whole windows of 32, never a partial one


def test_max_tokens_scores_windows_spread_over_the_text(tokens):
    # 700 tokens, windows of 32: 21 windows start at 0, 32, ..., 640; a budget of 100 keeps
    # three of them, the first, middle and last: 0, 320, 640
    gpt = tiny_gpt("alibi", config=CFG)
    total, count, _ = score_length(gpt, tokens, 32, "nonoverlapping", max_tokens=100, precision="32")
    ref_total, ref_count = naive_nll(gpt, tokens, 32, 32, starts=[0, 320, 640])
    assert count == ref_count == 96 and total == pytest.approx(ref_total, rel=1e-5)
    # sliding, window 48, stride 16: 41 windows at 0, 16, ..., 640; 40 tokens -> 2 windows: 0, 640
    total, count, _ = score_length(gpt, tokens, 48, "sliding", stride=16, max_tokens=40, precision="32")
    ref_total, ref_count = naive_nll(gpt, tokens, 48, 16, starts=[0, 640])
    assert count == ref_count == 32 and total == pytest.approx(ref_total, rel=1e-5)


def test_capped_windows_hand_computed():
    # 1000 tokens, window 100: nine windows at 0, 100, ..., 800
    assert scored_windows(1000, 100, "nonoverlapping", None, None) == (range(0, 900, 100), 100)  # uncapped
    assert scored_windows(1000, 100, "nonoverlapping", None, 300) == ([0, 400, 800], 100)
    assert scored_windows(1000, 100, "nonoverlapping", None, 99) == ([0], 100)  # at least one window
    assert list(scored_windows(1000, 100, "nonoverlapping", None, 10**6)[0]) == list(range(0, 900, 100))
    # sliding, stride 50: 18 windows at 0, 50, ..., 850; 200 tokens -> 4 windows, indices 0, 5, 11, 17
    assert scored_windows(1000, 100, "sliding", 50, 200) == ([0, 250, 550, 850], 50)
    with pytest.raises(ValueError, match=r"max_tokens.*positive integer or null.*got 0"):
        scored_windows(1000, 100, "nonoverlapping", None, 0)


@pytest.fixture(scope="module")
def held_out():
    """The embedded corpus's held-out split (bytes) and its document offsets."""
    from data.corpus import GutenbergCorpus
    from data.stream import load_tokens
    from pelab.datamodule import TextDataModule

    dm = TextDataModule(GutenbergCorpus(0.1), tokenizer="bytes")
    dm.setup()
    return len(load_tokens(dm.split_path("val"), dm.meta["dtype"])), dm.meta["splits"]["val"]["doc_offsets"]


@pytest.mark.parametrize("mode", ["nonoverlapping", "sliding"])
@pytest.mark.parametrize("length", [256, 4096])
def test_capped_windows_cover_every_held_out_document(held_out, mode, length, project_root):
    from omegaconf import OmegaConf

    num_tokens, offsets = held_out
    max_tokens = OmegaConf.load(project_root / "conf/eval/default.yaml").extrapolation.max_tokens
    starts, step = scored_windows(num_tokens, length, mode, None, max_tokens)
    assert len(starts) == max_tokens // step and starts == scored_windows(num_tokens, length, mode, None, max_tokens)[0]
    starts = np.asarray(starts)
    for doc in range(len(offsets) - 1):
        assert ((starts >= offsets[doc]) & (starts < offsets[doc + 1])).any(), f"document {doc} has no window"
    # spread evenly from the first window to the last one, on the uncapped grid
    assert starts[0] == 0 and starts[-1] == window_starts(num_tokens, length, step)[-1]
    assert np.all(starts % step == 0) and np.ptp(np.diff(starts)) <= step


def test_rows_name_everything_and_learned_is_not_applicable(tokens, capsys):
    config = ExtrapolationConfig(multipliers=[1, 2, 4], lengths=[100], modes=["nonoverlapping", "sliding"],
                                 stride=8, precision="32")
    rows = evaluate_extrapolation(tiny_gpt("learned", config=CFG), tokens, 16, config)
    assert [(r.mode, r.eval_length) for r in rows] == [
        (m, n) for m in ("nonoverlapping", "sliding") for n in (16, 32, 64, 100)]
    for r in rows:
        assert r.scheme == "learned" and r.train_length == 16 and r.rope_scaling == "none"
        if r.eval_length <= 16:
            assert r.ok and r.tokens > 0 and r.ppl == pytest.approx(math.exp(r.loss)) and r.seconds >= 0
        else:
            assert r.status == "not applicable: pe=learned has 16 positions" and math.isnan(r.ppl)
    assert {r.stride for r in rows if r.mode == "sliding"} == {8}
    assert "not applicable" in capsys.readouterr().out


def test_too_short_held_out_text_is_skipped_not_estimated():
    short = np.arange(200, dtype=np.uint16) % 50
    rows = evaluate_extrapolation(tiny_gpt("alibi", config=CFG), short, 16,
                                  ExtrapolationConfig(multipliers=[1, 16], precision="32"))
    assert rows[0].ok
    assert rows[1].status.startswith("skipped: held-out text has 200 tokens, fewer than one window of 257")
    assert rows[1].tokens == 0


def test_bad_options_are_named():
    with pytest.raises(ValueError, match=r"\['strided'\].*nonoverlapping, sliding"):
        ExtrapolationConfig(modes=["strided"])
    with pytest.raises(ValueError, match=r"unknown extrapolation option\(s\) \['lenghts'\]"):
        ExtrapolationConfig.from_dict({"lenghts": [1]})


def test_results_round_trip_and_table(tmp_path):
    rows = [
        ExtrapolationRow("alibi", "none", 16, 16, "nonoverlapping", 16, 640, math.log(20.0), 20.0, 0.1),
        ExtrapolationRow("alibi", "none", 16, 32, "nonoverlapping", 32, 640, math.log(19.5), 19.5, 0.1),
        ExtrapolationRow("learned", "none", 16, 32, "nonoverlapping", 32, 0, math.nan, math.nan, 0.0,
                         "not applicable: pe=learned has 16 positions"),
    ]
    paths = save_results(rows, tmp_path, title="t")
    assert paths["png"].stat().st_size > 1000
    back = read_csv(paths["csv"])
    assert [(r.scheme, r.eval_length, r.status) for r in back] == [(r.scheme, r.eval_length, r.status) for r in rows]
    assert back[1].ppl == 19.5
    assert markdown_table(rows) == (
        "| scheme | 16 (train) | 32 |\n|---|---|---|\n| alibi | 20.00 | 19.50 |\n| learned |  | n/a |\n")


def test_dynamic_ntk_in_the_harness_equals_ntk_at_the_length_ratio(tokens):
    """dynamic_ntk takes s = T/L from the sequence; at T = 4L that is ntk with s = 4."""
    gpt = tiny_gpt("rope", config=CFG)
    config = ExtrapolationConfig(multipliers=[4], rope_scaling=["ntk", "dynamic_ntk"], precision="32")
    ntk, dynamic = evaluate_extrapolation(gpt, tokens, 16, config)
    assert (ntk.rope_scaling, dynamic.rope_scaling) == ("ntk", "dynamic_ntk")
    assert dynamic.loss == ntk.loss  # the same frequencies, bit for bit
    plain = evaluate_extrapolation(gpt, tokens, 16, ExtrapolationConfig(multipliers=[4], precision="32"))[0]
    assert plain.loss != ntk.loss
    # a length-ratio factor on top of the dynamic scale would scale twice: a different model
    doubled = evaluate_extrapolation(gpt, tokens, 16, ExtrapolationConfig(
        multipliers=[4], rope_scaling=["dynamic_ntk"], rope_scaling_factor=4.0, precision="32"))[0]
    assert doubled.loss != ntk.loss


def test_alibi_linear_at_evaluation_scores_as_the_model_trained_with_it(tokens):
    """rope_scaling=linear on ALiBi divides its slopes by s for the row (as pe.scaling.kind=linear
    does in training), then restores them; kinds ALiBi does not take are "not applicable"."""
    from model.pe.rope_scaling import RopeScaling

    gpt, trained = tiny_gpt("alibi", config=CFG), tiny_gpt("alibi", config=CFG)
    trained.pe.scale(RopeScaling("linear", 4.0, 16))
    slopes = gpt.pe.slopes
    rows = evaluate_extrapolation(gpt, tokens, 16, ExtrapolationConfig(multipliers=[4], rope_scaling=["linear", "ntk"],
                                                                       precision="32"))
    linear, ntk = [r for r in rows if r.eval_length == 64]
    reference = evaluate_extrapolation(trained, tokens, 16, ExtrapolationConfig(multipliers=[4], precision="32"))[-1]
    assert linear.ok and linear.loss == reference.loss
    assert ntk.status == "not applicable: rope_scaling=ntk does not apply to pe=alibi (it takes linear)"
    assert gpt.pe.slopes is slopes and gpt.pe.scaling is None


def test_a_length_chart_has_one_line_per_series_and_nan_where_a_series_has_no_point():
    """W&B line charts have no log axis: x is log2(length) over every length any line has."""
    from types import SimpleNamespace as Point

    from evaluation.results import log2_chart

    chart = log2_chart({"a": [Point(n=64, ppl=1.0), Point(n=256, ppl=3.0)], "b": [Point(n=128, ppl=2.0)]},
                       "n", "ppl", "title", "log2(n)")
    assert chart.keys == ["a", "b"] and chart.xs == [6.0, 7.0, 8.0]
    assert chart.ys[0][0] == 1.0 and math.isnan(chart.ys[0][1]) and chart.ys[0][2] == 3.0
    assert math.isnan(chart.ys[1][0]) and chart.ys[1][1] == 2.0 and math.isnan(chart.ys[1][2])
