"""Loss by token position (evaluation/position_loss.py) from the extrapolation evaluation's own
NLL: per-position means against a float64 window-by-window loop, bins, query chunks, sliding
windows, a 2-rank split reduced exactly, and the files a run writes."""


import numpy as np
import pytest
import torch
import torch.nn.functional as F

from evaluation import extrapolation as ex
from evaluation.position_loss import PositionSums, bin_rows, position_bins, read_csv, save_results
from model import GPTConfig
from tests.tiny import tiny_gpt

CFG = GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=4, n_embd=32)


@pytest.fixture(scope="module")
def tokens():
    return np.random.default_rng(0).integers(0, 50, size=400).astype(np.uint16)


def naive_by_position(gpt, tokens, length, step):
    """{window position: list of -log p (float64)} over windows 0, step, 2 step, ... scoring the last `step`."""
    out = {}
    for s in range(0, len(tokens) - length, step):
        window = torch.tensor(tokens[s : s + length + 1].astype(np.int64))[None]
        with torch.no_grad():
            logits, _ = gpt(window[:, :-1])
        logp = F.log_softmax(logits.double(), dim=-1)[0]
        for t in range(length - step, length):
            out.setdefault(t, []).append(-logp[t, window[0, t + 1]].item())
    return out


@pytest.mark.parametrize("mode,stride,q_chunk", [("nonoverlapping", None, None), ("nonoverlapping", None, 8),
                                                  ("sliding", 12, 5)])
def test_per_position_mean_matches_hand_computed(tokens, mode, stride, q_chunk):
    gpt, length = tiny_gpt("alibi", config=CFG), 32
    sums = PositionSums(length)
    total, count, step = ex.score_length(gpt, tokens, length, mode, stride, precision="32", q_chunk=q_chunk,
                                         tokens_per_batch=64, by_position=sums)
    ref = naive_by_position(gpt, tokens, length, step)
    assert sorted(ref) == [p for p in range(length) if sums.counts[p]]  # sliding: only the scored tail
    for p, values in ref.items():
        assert sums.counts[p] == len(values)
        assert sums.sums[p] / sums.counts[p] == pytest.approx(np.mean(values), rel=1e-5)
    assert sums.sums.sum() == pytest.approx(total, rel=1e-12) and sums.counts.sum() == count  # the same NLL


def test_bins_exact_below_two_l_then_log_spaced():
    bins = position_bins(64, 8, per_octave=2)
    assert bins[:16] == [(p, p + 1) for p in range(16)]
    assert bins[16:] == [(16, 23), (23, 32), (32, 45), (45, 64)]  # 16 * 2^(k/2), rounded
    assert position_bins(10, 8) == [(p, p + 1) for p in range(10)]  # shorter than 2 L: all exact


def test_binned_mean_pools_targets():
    sums = PositionSums(6)
    sums.add(0, np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0]), 1)
    sums.add(4, np.array([10.0, 20.0]), 3)  # positions 4, 5 scored by 3 more windows
    head = dict(scheme="x", rope_scaling="none", positions="sequential", train_length=2, eval_length=6,
                mode="nonoverlapping", stride=6)
    rows = bin_rows(sums, head, per_octave=1)
    assert [(r.start, r.end, r.tokens) for r in rows] == [(0, 1, 1), (1, 2, 1), (2, 3, 1), (3, 4, 1), (4, 6, 8)]
    assert rows[-1].loss == pytest.approx((5 + 6 + 10 + 20) / 8)


def test_two_rank_split_reduces_sums_and_counts_exactly(tokens, monkeypatch):
    gpt, length = tiny_gpt("rope", config=CFG), 24
    whole = PositionSums(length)
    total, count, _ = ex.score_length(gpt, tokens, length, "nonoverlapping", precision="32", by_position=whole)
    sent = {}
    parts = []
    for rank in (1, 0):  # rank 1 first: its vector is what rank 0's all_reduce adds
        monkeypatch.setattr(ex, "shard_of", lambda distributed, r=rank: (r, 2))
        monkeypatch.setattr(ex, "distributed_sum", lambda values, r=rank: (
            sent.setdefault(r, list(values)) and [a + b for a, b in zip(values, sent.get(1 - r, [0] * len(values)))]))
        sums = PositionSums(length)
        parts.append((ex.score_length(gpt, tokens, length, "nonoverlapping", precision="32", distributed=True,
                                      by_position=sums), sums))
    (t1, c1, _), s1 = parts[1]  # rank 0 after the reduction
    assert c1 == count and t1 == pytest.approx(total, rel=1e-6)
    np.testing.assert_array_equal(s1.counts, whole.counts)
    np.testing.assert_allclose(s1.sums, whole.sums, rtol=1e-6)  # float32 forwards of other batches
    assert sent[0][2] + sent[1][2] == whole.counts[0]  # windows split between the ranks, none twice


def test_evaluation_writes_position_rows_and_files(tokens, tmp_path):
    gpt = tiny_gpt("alibi", config=CFG)
    config = ex.ExtrapolationConfig(multipliers=(1, 4), modes=("nonoverlapping", "sliding"), precision="32")
    result = ex.measure(gpt, tokens, 16, config, log=lambda _: None)
    rows, by_position = result.rows, result.position_rows
    for row in rows:
        mine = [r for r in by_position if (r.eval_length, r.mode) == (row.eval_length, row.mode)]
        assert sum(r.tokens for r in mine) == row.tokens
        assert sum(r.loss * r.tokens for r in mine) / row.tokens == pytest.approx(row.loss, rel=1e-6)
        assert all(r.positions == "sequential" for r in mine)
    paths = save_results(by_position, tmp_path, "t")
    assert read_csv(paths["csv"]) == by_position and paths["png"].stat().st_size > 1000


def test_wandb_payload_has_a_line_per_length(tokens, tmp_path):
    gpt = tiny_gpt("alibi", config=CFG)
    by_position = ex.measure(gpt, tokens, 16, ex.ExtrapolationConfig(multipliers=(1, 2), precision="32"),
                             log=lambda _: None).position_rows
    paths = save_results(by_position, tmp_path, "t")

    class Run:  # what pelab.loggers.log_to_wandb calls on a W&B run
        payload = {}

        def log(self, payload):
            self.payload.update(payload)

    from evaluation.position_loss import loggable
    from pelab.loggers import log_to_wandb

    run = Run()
    log_to_wandb(loggable(by_position, png=paths["png"]), run)
    chart = run.payload["extrapolation/position_loss"]
    assert sorted(set(chart.table.get_column("lineKey"))) == ["16", "32"]
    assert {"extrapolation/position_loss_table", "extrapolation/position_loss_plot"} <= set(run.payload)


# --- eval.positions=randomized (Ruoss et al. 2023: positions drawn at evaluation as in training) -----


def test_randomized_positions_sorted_subsets_seeded_per_window():
    a = ex.eval_positions("randomized", [0, 40, 80], 16, 64, seed=0, device=torch.device("cpu"))
    b = ex.eval_positions("randomized", [80], 16, 64, seed=0, device=torch.device("cpu"))
    assert a.shape == (3, 16) and a.dtype == torch.int64
    for row in a:
        assert (row[1:] > row[:-1]).all() and 0 <= row.min() and row.max() < 64  # sorted, distinct, in [0, N)
    assert torch.equal(a[2], b[0])  # a window's draw does not depend on its batch
    assert not torch.equal(a[0], a[1])  # fresh positions per window
    assert not torch.equal(a[0], ex.eval_positions("randomized", [0], 16, 64, seed=1, device=torch.device("cpu"))[0])
    assert ex.eval_positions("sequential", [0], 16, None, 0, torch.device("cpu")) is None


def test_randomized_evaluation_scores_with_those_positions(tokens):
    gpt, length, limit = tiny_gpt("alibi", config=CFG), 16, 64  # ALiBi: distances change the attention even untrained
    total, count, _ = ex.score_length(gpt, tokens, length, "nonoverlapping", precision="32", tokens_per_batch=48,
                                      positions="randomized", randomize_to=limit, seed=3)
    ref, n = 0.0, 0
    for s in range(0, len(tokens) - length, length):  # one window at a time, full logits in float64
        window = torch.tensor(tokens[s : s + length + 1].astype(np.int64))[None]
        where = ex.eval_positions("randomized", [s], length, limit, 3, torch.device("cpu"))
        with torch.no_grad():
            logits, _ = gpt(window[:, :-1], positions=where)
        logp = F.log_softmax(logits.double(), -1)[0]
        ref -= sum(logp[t, window[0, t + 1]].item() for t in range(length))
        n += length
    assert count == n and total / count == pytest.approx(ref / n, rel=1e-5)
    plain, _, _ = ex.score_length(gpt, tokens, length, "nonoverlapping", precision="32")
    assert plain != pytest.approx(total, rel=1e-5)  # the positions changed what the model saw (float32 noise: ~1e-7)


def test_randomized_rows_say_so_and_lengths_past_n_are_not_applicable(tokens):
    gpt = tiny_gpt("rope", config=CFG)
    config = ex.ExtrapolationConfig(multipliers=(1, 2, 4), precision="32", positions="randomized")
    rows = ex.evaluate_extrapolation(gpt, tokens, 16, config, log=lambda _: None, randomize_to=32)
    assert [(r.eval_length, r.positions, r.ok) for r in rows] == [(16, "randomized", True), (32, "randomized", True),
                                                                  (64, "randomized", False)]
    assert rows[2].status == "not applicable: 64 randomized positions do not fit in [0, pe.randomize_to=32)"
    rows = ex.evaluate_extrapolation(gpt, tokens, 16, config, log=lambda _: None)
    assert rows[0].status == "not applicable: eval.positions=randomized needs a model trained with pe.randomize_to"
    default = ex.evaluate_extrapolation(gpt, tokens, 16, ex.ExtrapolationConfig(multipliers=(1,), precision="32"),
                                        log=lambda _: None)
    assert default[0].positions == "sequential"
    with pytest.raises(Exception, match="eval.positions must be sequential or randomized, got 'shuffled'"):
        ex.ExtrapolationConfig(positions="shuffled")


def test_randomized_task_evaluation():
    from data.synthetic import Task
    from evaluation.tasks import TaskEvalConfig, evaluate_tasks

    gpt = tiny_gpt("rope", vocab_size=256, n_layer=1, n_head=2, n_embd=16)
    config = TaskEvalConfig(multipliers=(1, 2), depths=(0.5,), samples=3, precision="32", positions="randomized")
    rows = evaluate_tasks(gpt, Task("passkey", key_length=2), 16, config, seed=0, log=lambda _: None, randomize_to=20)
    assert [(r.eval_length, r.positions, r.ok) for r in rows] == [(16, "randomized", True), (32, "randomized", False)]
