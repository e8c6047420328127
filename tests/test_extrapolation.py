import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation.extrapolation import (
    ExtrapolationConfig, ExtrapolationRow, evaluate_extrapolation, markdown_table, read_csv, save_results, score_length,
)
from model import GPT, GPTConfig
from model.pe import SCHEMES

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


def toy(scheme="alibi", **options):
    torch.manual_seed(0)
    return GPT(CFG, SCHEMES[scheme](CFG, **options)).eval()


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 50, size=700).astype(np.uint16)


def naive_nll(gpt, tokens, length, stride):
    """Sum of -log p over the last `stride` targets of windows starting at 0, stride, 2*stride, ..."""
    total, count, s = 0.0, 0, 0
    while s + length + 1 <= len(tokens):
        window = torch.tensor(tokens[s : s + length + 1].astype(np.int64))[None]
        with torch.no_grad():
            logits, _ = gpt(window[:, :-1])
        logp = F.log_softmax(logits.double(), dim=-1)[0]
        for t in range(length - stride, length):
            total -= logp[t, window[0, t + 1]].item()
            count += 1
        s += stride
    return total, count


@pytest.mark.parametrize("scheme", ["alibi", "rope", "sinusoidal"])
def test_nonoverlapping_matches_hand_computed_ppl(scheme, tokens):
    gpt = toy(scheme)
    total, count, _ = score_length(gpt, tokens, 32, "nonoverlapping", precision="32", tokens_per_batch=64)
    ref_total, ref_count = naive_nll(gpt, tokens, 32, 32)
    assert count == ref_count == (len(tokens) - 1) // 32 * 32
    assert math.exp(total / count) == pytest.approx(math.exp(ref_total / ref_count), rel=1e-5)


@pytest.mark.parametrize("stride", [8, 20])
def test_sliding_matches_hand_computed_ppl(stride, tokens):
    gpt = toy("rope_alibi")
    total, count, step = score_length(gpt, tokens, 48, "sliding", stride=stride, precision="32")
    ref_total, ref_count = naive_nll(gpt, tokens, 48, stride)
    assert step == stride and count == ref_count
    assert total / count == pytest.approx(ref_total / ref_count, rel=1e-5)


def test_sliding_with_stride_equal_window_is_nonoverlapping(tokens):
    gpt = toy("xpos")
    a = score_length(gpt, tokens, 40, "nonoverlapping", precision="32")
    b = score_length(gpt, tokens, 40, "sliding", stride=40, precision="32")
    assert a[1] == b[1] and a[0] == pytest.approx(b[0], rel=1e-6)


def test_query_chunks_do_not_change_the_result(tokens):
    gpt = toy("alibi")
    a = score_length(gpt, tokens, 128, "nonoverlapping", q_chunk=None, precision="32")
    b = score_length(gpt, tokens, 128, "nonoverlapping", q_chunk=24, precision="32")
    assert a[1] == b[1] and a[0] == pytest.approx(b[0], rel=1e-6)


def test_max_tokens_counts_whole_windows(tokens):
    total, count, _ = score_length(toy(), tokens, 32, "nonoverlapping", max_tokens=100, precision="32")
    assert count == 96  # three whole windows of 32, never a partial one


def test_rows_name_everything_and_learned_is_not_applicable(tokens, capsys):
    config = ExtrapolationConfig(multipliers=[1, 2, 4], lengths=[100], modes=["nonoverlapping", "sliding"],
                                 stride=8, precision="32")
    rows = evaluate_extrapolation(toy("learned"), tokens, 16, config)
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
    rows = evaluate_extrapolation(toy("alibi"), short, 16, ExtrapolationConfig(multipliers=[1, 16], precision="32"))
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
    gpt = toy("rope")
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
