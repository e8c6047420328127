"""scripts/compare_runs.py on fake sweep folders: perplexity per scheme and length by hand, seeds
grouped with intervals and Welch marks, and a clear failure without results; evaluation/compare.py's
line order and seed settings; a probe registered with compare hooks appears with no other edit."""

import math
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from evaluation.extrapolation import ExtrapolationRow, write_csv
from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]


def fake_run(sweep: Path, name: str, scheme: str, ppls: dict[int, float | None], sub: str = "") -> Path:
    rows = [
        ExtrapolationRow(scheme, "none", 64, n, "nonoverlapping", n, 1000, math.log(p), p, 0.5)
        if p is not None else
        ExtrapolationRow(scheme, "none", 64, n, "nonoverlapping", n, 0, math.nan, math.nan, 0.0,
                         f"not applicable: pe={scheme} has 64 positions")
        for n, p in ppls.items()
    ]
    return write_csv(rows, sweep / name / "extrapolation" / sub / "extrapolation.csv")


def compare_runs(*args: str) -> subprocess.CompletedProcess:
    return run_python(["scripts/compare_runs.py", *args], cwd=ROOT, timeout=120)


def test_compare_two_fake_runs(tmp_path):
    sweep = tmp_path / "multirun"
    fake_run(sweep, "0-learned", "learned", {64: 21.0, 128: None, 256: None})
    fake_run(sweep, "1-alibi", "alibi", {64: 20.5, 128: 19.75, 256: 19.5})
    # a later standalone evaluation of the alibi run, with a different token budget: it replaces
    # the whole alibi series instead of mixing points from both files
    time.sleep(0.01)
    later = fake_run(sweep, "1-alibi", "alibi", {64: 20.0, 128: 19.0}, sub="eval-last-20261121")
    os.utime(later, (time.time() + 5, time.time() + 5))

    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "comparison.md").read_text() == (
        "### nonoverlapping\n\nPerplexity by evaluation length (tokens).\n\n"
        "| scheme | 64 (train) | 128 | 256 |\n"
        "|---|---|---|---|\n"
        "| learned | 21.00 | n/a | n/a |\n"
        "| alibi | 20.00 | 19.00 |  |\n"
    )
    lines = (out / "comparison.csv").read_text().splitlines()
    assert lines[0].startswith("scheme,rope_scaling,train_length,eval_length,mode,stride,tokens,loss,ppl")
    assert len(lines) == 1 + 3 + 2
    assert (out / "comparison.png").stat().st_size > 1000


def test_a_run_is_compared_at_its_latest_model(tmp_path):
    """A later look at an earlier checkpoint (a learning curve scored after training) does not
    replace the run's result: the newest file of the highest step wins, and the others are named."""
    from evaluation.probe import STEP_FILE, write_step

    sweep = tmp_path / "multirun"
    at_end = fake_run(sweep, "0-rope", "rope", {64: 10.0, 128: 12.0})
    again = fake_run(sweep, "0-rope", "rope", {64: 11.0, 128: 13.0}, sub="eval-last-2")  # the final model, re-scored
    early = fake_run(sweep, "0-rope", "rope", {64: 30.0}, sub="eval-step000004-3")  # scored last of all
    for path, step, later in ((at_end, 12, 0), (again, 12, 5), (early, 4, 10)):
        write_step(path.parent, step)
        os.utime(path, (time.time() + later, time.time() + later))
    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "| rope | 11.00 | 13.00 |" in (out / "comparison.md").read_text()
    assert "eval-last-2/extrapolation.csv (step 12) compared; left out: scores of earlier steps (4)" in proc.stderr
    # a newer look at the same model at fewer lengths replaces the line whole, and says what it drops
    fewer = fake_run(sweep, "0-rope", "rope", {64: 11.5}, sub="eval-last-4")
    write_step(fewer.parent, 12)
    os.utime(fewer, (time.time() + 15, time.time() + 15))
    proc = compare_runs(str(sweep), "--out", str(out))
    assert "| rope | 11.50 |" in (out / "comparison.md").read_text()
    assert "left out: scores of earlier steps (4); lengths 128 of older files" in proc.stderr

    (early.parent / STEP_FILE).write_text("{}")
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode != 0 and f"{early.parent / STEP_FILE} is not a step record" in proc.stderr


def test_compare_without_results_fails_clearly(tmp_path):
    proc = compare_runs(str(tmp_path))
    assert proc.returncode != 0 and "no extrapolation.csv found" in proc.stderr


# --- several seeds per scheme -----------------------------------------------------------------

def seed_run(sweep: Path, name: str, scheme: str, seed: int, ppls: dict, accuracies: dict | None = None,
             base: int | None = None, learned: str = "") -> Path:
    """A run dir as train.py leaves it: checkpoints/config.yaml (seed, scheme, settings, and
    per-run paths that must not split a group), extrapolation.csv and optionally tasks.csv
    (passkey, two depths: accuracies[length] = (at depth 0, at depth 1))."""
    import yaml

    from evaluation.tasks import TaskRow, write_csv as write_tasks

    run = sweep / name
    pe = {"_target_": f"model.pe.{scheme}", **({"base": base} if base is not None else {})}
    config = {"seed": seed, "run_name": f"{scheme}-seed={seed}", "pe": pe, "model": {"block_size": 64},
              "data": {"seed": seed, "task": "passkey"}, "trainer": {"max_steps": 10, "default_root_dir": str(run)},
              "callbacks": {"model_checkpoint": {"dirpath": str(run / "checkpoints")}}, "paths": {"output_dir": str(run)}}
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "config.yaml").write_text(yaml.safe_dump(config))
    fake_run(sweep, name, scheme, ppls)
    if accuracies:
        write_tasks([TaskRow("passkey", scheme, 64, n, d, 10, acc, acc, 0.1, learned=learned)
                     for n, pair in accuracies.items() for d, acc in zip((0.0, 1.0), pair)],
                    run / "tasks" / "tasks.csv")
    return run


def edit_config(run: Path, change) -> None:
    """``change(config)`` applied to the run's checkpoints/config.yaml (a run saved with other settings)."""
    import yaml

    path = run / "checkpoints" / "config.yaml"
    config = yaml.safe_load(path.read_text())
    change(config)
    path.write_text(yaml.safe_dump(config))


def test_a_tie_for_the_best_mean_is_bold_in_every_tied_group():
    """At 64 rope [0.25, 0.75] and alibi [0.5, 0.5] tie at a mean of 0.5 over nope's [0, 0]; at 128
    every group scores 0 on every seed (a task no scheme learned): every tied group is the best,
    and only the others are tested (nope against rope: t = 0.5 / (0.3536 / sqrt 2) = 2, df = 1,
    p = 0.295)."""
    from evaluation.compare import make_cells

    values = {"rope": {64: [0.25, 0.75], 128: [0.0, 0.0]}, "alibi": {64: [0.5, 0.5], 128: [0.0, 0.0]},
              "nope": {64: [0.0, 0.0], 128: [0.0, 0.0]}}
    points = {(label, "passkey", 64, n): [(seed, v, "ok") for seed, v in enumerate(vs)]
              for label, by_length in values.items() for n, vs in by_length.items()}
    cells = {(c.label, c.eval_length): c for c in make_cells(points, lower_is_better=False)}
    assert {key for key, c in cells.items() if c.best} == {("rope", 64), ("alibi", 64), ("rope", 128),
                                                            ("alibi", 128), ("nope", 128)}
    assert cells["nope", 64].p_vs_best == pytest.approx(0.2952, abs=1e-4) and not cells["nope", 64].significant
    assert all(math.isnan(c.p_vs_best) for c in cells.values() if c.best)


def test_seeds_are_grouped_with_intervals_and_welch_marks(tmp_path):
    sweep = tmp_path / "multirun"
    # perplexity at 64 / 128 per seed (hand-computed statistics in the expected table below):
    #   rope   [4.0, 4.2, 4.4] -> 4.20 ± 4.302653*0.2/sqrt(3) = 0.50;  [8, 9, 10]    -> 9.00 ± 2.48
    #   alibi  [4.1, 4.5, 4.9] -> 4.50 ± 4.302653*0.4/sqrt(3) = 0.99;  [5.0, 5.2, 5.4] -> 5.20 ± 0.50
    # at 64 rope is best; alibi vs rope: t = 0.3/sqrt(0.04/3 + 0.16/3) = 1.16 < t_crit, not significant.
    # at 128 alibi is best; rope vs alibi: t = 3.8/sqrt(1/3 + 0.04/3) = 6.45, df = 2.16, significant.
    # tasks, mean over the two depths: rope 64 [100, 100, 100], 128 [30, 20, 40] -> 30.0 ± 24.8;
    #   alibi 64 [100, 95, 100] -> 98.3 ± 4.302653*2.88675/sqrt(3) = 7.2, 128 [90, 95, 100] -> 95.0 ± 12.4.
    #   At 64 rope (variance 0) is best; Welch's df = 2 (alibi's n - 1), t = 1.6667/sqrt(8.3333/3) = 1,
    #   p = 1 - t/sqrt(2 + t^2) = 1 - 1/sqrt(3) = 0.42265: not significant. At 128 rope: significant.
    rope = ({64: 4.0, 128: 8.0}, {64: 4.2, 128: 9.0}, {64: 4.4, 128: 10.0})
    alibi = ({64: 4.1, 128: 5.0}, {64: 4.5, 128: 5.2}, {64: 4.9, 128: 5.4})
    rope_acc = ({64: (1, 1), 128: (0.2, 0.4)}, {64: (1, 1), 128: (0.1, 0.3)}, {64: (1, 1), 128: (0.3, 0.5)})
    alibi_acc = ({64: (1, 1), 128: (0.9, 0.9)}, {64: (1, 0.9), 128: (1, 0.9)}, {64: (1, 1), 128: (1, 1)})
    for seed in range(3):
        seed_run(sweep, f"{seed}-rope-seed_{seed + 1}", "rope", seed + 1, rope[seed], rope_acc[seed], base=10000)
        seed_run(sweep, f"{seed + 3}-alibi-seed_{seed + 1}", "alibi", seed + 1, alibi[seed], alibi_acc[seed])
    # one run of another setting of rope (its own group, n = 1) and a learned run past its table
    seed_run(sweep, "6-rope-pe.base_100", "rope", 1, {64: 7.0, 128: 20.0}, base=100)
    seed_run(sweep, "7-learned", "learned", 1, {64: 6.0, 128: None})

    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    md = (out / "comparison.md").read_text()
    assert "| scheme (seeds) | 64 (train) | 128 |\n|---|---|---|\n" \
        "| learned (1) | 6.00 | n/a |\n" \
        "| rope (pe.base=100) (1) | 7.00 | 20.00 |\n" \
        "| rope (pe.base=10000) (3) | **4.20 ± 0.50** | 9.00 ± 2.48 * |\n" \
        "| alibi (3) | 4.50 ± 0.99 | **5.20 ± 0.50** |\n" in md
    assert "| scheme (seeds) | 64 (train) | 128 |\n|---|---|---|\n" \
        "| rope (pe.base=10000) (3) | **100.0 ± 0.0** | 30.0 ± 24.8 * |\n" \
        "| alibi (3) | 98.3 ± 7.2 | **95.0 ± 12.4** |\n" in md
    assert md.count("Welch's two-sided t-test, p < 0.05") == 2

    import csv

    with open(out / "comparison_tasks.csv", newline="") as f:
        rows = {(r["scheme"], int(r["eval_length"])): r for r in csv.DictReader(f)}
    alibi64 = rows[("alibi", 64)]
    assert (alibi64["n"], alibi64["seeds"], alibi64["best"], alibi64["significant_vs_best"]) == \
        ("3", "1 2 3", "False", "False")
    assert float(alibi64["p_vs_best"]) == pytest.approx(1 - 1 / math.sqrt(3), abs=1e-9)
    assert float(alibi64["ci95"]) == pytest.approx(4.302653 * math.sqrt(25 / 3) / math.sqrt(3), abs=1e-4)
    with open(out / "comparison.csv", newline="") as f:
        ppl = {(r["scheme"], int(r["eval_length"])): r for r in csv.DictReader(f)}
    assert float(ppl[("rope (pe.base=10000)", 128)]["mean"]) == pytest.approx(9.0)
    assert float(ppl[("rope (pe.base=10000)", 128)]["ci95"]) == pytest.approx(4.302653 / math.sqrt(3), abs=1e-5)
    assert ppl[("learned", 128)]["status"].startswith("not applicable")
    assert (out / "comparison.png").stat().st_size > 1000 and (out / "comparison_tasks.png").stat().st_size > 1000


def test_one_seed_per_scheme_with_tasks_keeps_the_single_run_table(tmp_path):
    sweep = tmp_path / "multirun"
    seed_run(sweep, "0-rope", "rope", 1, {64: 4.0}, {64: (1.0, 0.5), 128: (0.25, 0.0)})
    seed_run(sweep, "1-alibi", "alibi", 1, {64: 4.5}, {64: (1.0, 1.0), 128: (0.5, 1.0)})
    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "comparison.md").read_text() == (
        "### nonoverlapping\n\nPerplexity by evaluation length (tokens).\n\n"
        "| scheme | 64 (train) |\n|---|---|\n| rope | 4.00 |\n| alibi | 4.50 |\n"
        "\n### passkey\n\nExact-match accuracy (%) by evaluation length (tokens), mean over depths.\n\n"
        "| scheme | 64 (train) | 128 |\n|---|---|---|\n| rope | 75.0 | 12.5 |\n| alibi | 100.0 | 75.0 |\n")


def test_single_runs_of_one_scheme_are_named_by_the_setting_that_differs(tmp_path):
    sweep = tmp_path / "multirun"
    seed_run(sweep, "0-rope", "rope", 1, {64: 4.0}, {64: (1.0, 1.0)}, base=10000)
    seed_run(sweep, "1-rope-pe.base_100", "rope", 1, {64: 7.0}, {64: (0.5, 0.0)}, base=100)
    seed_run(sweep, "2-alibi", "alibi", 1, {64: 4.5})
    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    md = (out / "comparison.md").read_text()
    assert "| rope (pe.base=100) | 7.00 |\n| rope (pe.base=10000) | 4.00 |\n| alibi | 4.50 |\n" in md
    assert "| rope (pe.base=100) | 25.0 |\n| rope (pe.base=10000) | 100.0 |\n" in md
    assert "0-rope" not in md and "1-rope" not in md


def test_position_loss_overlay_at_one_length(tmp_path):
    from evaluation.position_loss import PositionLossRow, read_csv, write_csv as write_positions

    sweep = tmp_path / "multirun"
    for name, scheme, rise in (("0-rope", "rope", 2.0), ("1-alibi", "alibi", 0.0)):
        fake_run(sweep, name, scheme, {64: 20.0, 128: 30.0})
        rows = [PositionLossRow(scheme, "none", "sequential", 64, n, "nonoverlapping", n, p, p + 1, 10,
                                3.0 + (rise if p >= 64 else 0.0)) for n in (64, 128) for p in range(n)]
        write_positions(rows, sweep / name / "extrapolation" / "position_loss.csv")
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    overlay = read_csv(tmp_path / "report" / "comparison_position_loss.csv")
    assert {r.eval_length for r in overlay} == {128}  # the longest length both runs have
    assert {r.scheme for r in overlay} == {"rope", "alibi"} and len(overlay) == 2 * 128
    assert next(r.loss for r in overlay if r.scheme == "rope" and r.start == 100) == 5.0
    assert (tmp_path / "report" / "comparison_position_loss.png").stat().st_size > 1000
    assert "loss by token position" in (tmp_path / "report" / "comparison.md").read_text()


def test_runs_that_did_not_learn_are_marked_and_heatmaps_average_seeds(tmp_path):
    sweep = tmp_path / "multirun"
    seed_run(sweep, "0-rope", "rope", 1, {64: 4.0}, {64: (1.0, 1.0), 128: (0.5, 0.0)}, learned="yes")
    seed_run(sweep, "1-rope", "rope", 2, {64: 4.0}, {64: (0.5, 0.7), 128: (0.3, 0.2)}, learned="no")
    seed_run(sweep, "2-alibi", "alibi", 1, {64: 4.5}, {64: (1.0, 1.0), 128: (0.9, 1.0)}, learned="yes")
    seed_run(sweep, "3-alibi", "alibi", 2, {64: 4.5}, {64: (1.0, 0.9), 128: (0.7, 1.0)}, learned="yes")
    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    md = (out / "comparison.md").read_text()
    assert "| rope [1/2 not learned at L] (2) |" in md and "| alibi (2) |" in md
    assert "below 90% on held-out samples at the training length" in md
    lines = (out / "comparison_heatmap.csv").read_text().splitlines()
    assert lines[0] == "task,scheme,learned,depth,64,128"
    assert "passkey,rope [1/2 not learned at L],,0,0.7500,0.4000" in lines  # (1.0 + 0.5) / 2, (0.5 + 0.3) / 2
    assert "passkey,alibi,,1,0.9500,1.0000" in lines
    assert (out / "comparison_heatmap.png").stat().st_size > 1000


# --- the library ------------------------------------------------------------------------------

def test_lines_follow_the_documented_scheme_order_and_unknown_names_come_last():
    from evaluation.compare import scheme_order

    # docs/experiments.md sweeps pe=learned,sinusoidal,rope,alibi,xpos,rope_alibi; the rest follow
    labels = ["t5", "zeta", "alibi documents=both", "rope+yarn", "xpos", "learned", "nope", "rope_alibi", "fire",
              "sinusoidal", "kerple_power", "kerple_log", "alibi", "rope (pe.base=100)"]
    assert sorted(labels, key=scheme_order) == [
        "learned", "sinusoidal", "rope (pe.base=100)", "rope+yarn", "alibi", "alibi documents=both", "xpos",
        "rope_alibi", "fire", "kerple_log", "kerple_power", "nope", "t5", "zeta"]


def test_a_newly_registered_scheme_sorts_after_the_others_without_an_edit(monkeypatch):
    from evaluation.compare import scheme_order
    from model.pe import SCHEMES

    monkeypatch.setitem(SCHEMES, "aaa", SCHEMES["rope"])
    assert sorted(["zeta", "aaa", "t5", "learned"], key=scheme_order) == ["learned", "t5", "aaa", "zeta"]


def test_run_settings_leave_out_the_keys_the_caller_names(tmp_path):
    import yaml

    from evaluation.compare import run_info

    config = {"seed": 3, "pe": {"_target_": "model.pe.rope", "base": 100}, "paths": {"output_dir": "/x", "log": "/y"},
              "trainer": {"max_steps": 10, "devices": 2}}
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "config.yaml").write_text(yaml.safe_dump(config))
    info = run_info(str(tmp_path), ignored=("seed", "paths.", "trainer.devices"))
    assert info.seed == 3
    assert info.setting == {"pe._target_": "'model.pe.rope'", "pe.base": "100", "trainer.max_steps": "10"}
    assert run_info(str(tmp_path / "elsewhere"), ignored=()).setting is None  # no config.yaml: unknown


def test_runs_saved_before_and_after_the_data_module_moved_share_a_seed_group(tmp_path):
    sweep = tmp_path / "multirun"
    for seed, target in ((1, "data.datamodule.TextDataModule"), (2, "pelab.datamodule.TextDataModule")):
        run = seed_run(sweep, f"{seed}-alibi", "alibi", seed, {64: 4.0 + seed, 128: 5.0 + seed})
        edit_config(run, lambda config, target=target: config["data"].update(_target_=target))
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    # one group of two seeds: mean 5.50 at 64, interval 12.706205 * 0.7071068 / sqrt(2) = 6.35
    assert "| alibi (2) | **5.50 ± 6.35** | **6.50 ± 6.35** |" in (tmp_path / "report" / "comparison.md").read_text()


def test_a_run_saved_before_an_option_existed_groups_with_runs_at_its_default(tmp_path):
    """Seed 1 was trained before model.xsa existed (its config lacks the key), seed 2 after, at the
    default 'none' (conf/model/common/gpt.yaml): one group. Seed 3 at xsa='plain' stays apart."""
    sweep = tmp_path / "multirun"
    for seed, xsa in ((1, None), (2, "none"), (3, "plain")):
        run = seed_run(sweep, f"{seed}-alibi", "alibi", seed, {64: 4.0 + seed, 128: 5.0 + seed})
        if xsa is not None:
            edit_config(run, lambda config, xsa=xsa: config["model"].update(xsa=xsa))
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report" / "comparison.md").read_text()
    # seeds 1 and 2: mean 5.50 at 64, interval 12.706205 * 0.7071068 / sqrt(2) = 6.35
    # the group at today's default is the bare scheme; the other names what it changes
    assert "| alibi (2) | **5.50 ± 6.35** | **6.50 ± 6.35** |" in report
    assert "| alibi (model.xsa='plain') (1) | 7.00 | 8.00 |" in report


def test_an_option_a_scheme_gained_later_counts_at_that_schemes_default(tmp_path):
    """pe.step came to pe=rope_dd after seed 1 was trained (its config lacks it); seed 2 holds the
    default of conf/pe/rope_dd.yaml ('softplus'), which today's default pe (RoPE) does not have:
    one group, named bare. Seed 3 at 'linear' stays apart, named by it."""
    sweep = tmp_path / "multirun"
    for seed, step in ((1, None), (2, "softplus"), (3, "linear")):
        run = seed_run(sweep, f"{seed}-rope_dd", "rope_dd", seed, {64: 4.0 + seed, 128: 5.0 + seed})

        def to(config: dict, step=step) -> None:
            config["pe"] = {"_target_": "model.pe.rope_dd.DataDependentRoPE", "base": 10000.0, "rotate_v": True,
                            **({"step": step} if step else {})}
        edit_config(run, to)
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report" / "comparison.md").read_text()
    # seeds 1 and 2: mean 5.50 at 64, interval 12.706205 * 0.7071068 / sqrt(2) = 6.35
    assert "| rope_dd (2) | **5.50 ± 6.35** | **6.50 ± 6.35** |" in report
    assert "| rope_dd (pe.step='linear') (1) | 7.00 | 8.00 |" in report


def test_variants_of_one_scheme_are_named_by_what_they_change_from_the_defaults(tmp_path):
    """RoPE, RoPE + XSA and RoPE as RNoPE-SWA (task_ablation2's three RoPE lines): each named by
    the keys it holds away from conf/ defaults, not by every key that differs among the three;
    a pe key is a default only under the default scheme's own block (same pe._target_)."""
    sweep = tmp_path / "multirun"
    variants = {"rope": {}, "xsa": {"model": {"xsa": "plain"}},
                "rnope": {"model": {"window_pattern": [32, None]}, "pe": {"nope_layers": "global"}}}

    def to(change: dict):
        def apply(config: dict) -> None:
            config["pe"] = {"_target_": "model.pe.rope.RoPE", "nope_layers": None, **change.get("pe", {})}
            config["model"].update({"xsa": "none", "window_pattern": None, **change.get("model", {})})
        return apply

    for i, (name, change) in enumerate(variants.items()):
        edit_config(seed_run(sweep, f"{i}-{name}", "rope", 0, {64: 4.0 + i}), to(change))
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr
    report = (tmp_path / "report" / "comparison.md").read_text()
    assert "| rope | 4.00 |" in report
    assert "| rope (model.xsa='plain') | 5.00 |" in report
    assert "| rope (model.window_pattern=[32, None], pe.nope_layers='global') | 6.00 |" in report
    assert "xsa='none'" not in report and "window_pattern=None" not in report


def test_a_key_named_by_ignore_does_not_split_seeds(tmp_path):
    """Fine-tunes whose seeds each start from their own base (init_from differs) are one group
    with --ignore init_from, and two one-run lines named by init_from without it."""
    sweep = tmp_path / "multirun"
    for seed in (1, 2):
        run = seed_run(sweep, f"{seed}-alibi", "alibi", seed, {64: 4.0 + seed, 128: 5.0 + seed})
        edit_config(run, lambda config, seed=seed: config.update(init_from=f"base_s{seed}/last.ckpt"))
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "apart"))
    assert proc.returncode == 0, proc.stderr
    assert "| alibi (init_from='base_s1/last.ckpt') | 5.00 | 6.00 |" in (tmp_path / "apart" / "comparison.md").read_text()
    proc = compare_runs(str(sweep), "--out", str(tmp_path / "together"), "--ignore", "init_from")
    assert proc.returncode == 0, proc.stderr
    # one group of two seeds: mean 5.50 at 64, interval 12.706205 * 0.7071068 / sqrt(2) = 6.35
    assert "| alibi (2) | **5.50 ± 6.35** | **6.50 ± 6.35** |" in (tmp_path / "together" / "comparison.md").read_text()


def test_streaming_tables_are_grouped_by_seed_per_cache_rule(tmp_path):
    """streaming.csv beside extrapolation.csv: one section per cache rule, buckets as columns, the
    seeds of a setting grouped. Perplexity of bucket [0, 64) / [64, 128) per seed:
      rope  [6.0, 6.2, 6.4] -> 6.20 ± 4.302653*0.2/sqrt(3) = 0.50;  [7.0, 8.0, 9.0] -> 8.00 ± 2.48
      alibi [6.1, 6.1, 6.1] -> 6.10 ± 0.00 (best);                   [5.0, 5.5, 6.0] -> 5.50 ± 1.24 (best)
    rope vs alibi at 128: t = 2.5/sqrt(1/3 + 0.25/3) = 3.87, df = 2.94: p < 0.05, marked."""
    from dataclasses import replace

    from evaluation.streaming import StreamingRow
    from evaluation.sweep import write_rows

    sweep = tmp_path / "multirun"
    values = {"rope": ((6.0, 7.0), (6.2, 8.0), (6.4, 9.0)), "alibi": ((6.1, 5.0), (6.1, 5.5), (6.1, 6.0))}
    for i, (scheme, per_seed) in enumerate(values.items()):
        for seed, (first, second) in enumerate(per_seed, start=1):
            run = seed_run(sweep, f"{3 * i + seed}-{scheme}-seed_{seed}", scheme, seed, {64: 5.0})
            rows = [StreamingRow(scheme, "none", "reindexed", 64, 128, 4, 60, s, e, 64, math.log(p), p, 64, 1.0)
                    for (s, e), p in (((0, 64), first), ((64, 128), second))]
            write_rows(rows, run / "streaming" / "streaming.csv", StreamingRow)
            if scheme == "rope" and seed == 1:  # a later evaluation without sink tokens: its own series
                later = [replace(r, sinks=0, window=64, ppl=r.ppl + 1) for r in rows]
                write_rows(later, run / "streaming" / "eval-last-1" / "streaming.csv", StreamingRow)
    out = tmp_path / "report"
    proc = compare_runs(str(sweep), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    md = (out / "comparison.md").read_text()
    assert "### streaming, reindexed, S=4 W=60" in md
    assert "| scheme (seeds) | 64 (train) | 128 |\n|---|---|---|\n" \
        "| rope (3) | 6.20 ± 0.50 | 8.00 ± 2.48 * |\n" \
        "| alibi (3) | **6.10 ± 0.00** | **5.50 ± 1.24** |\n" in md
    assert "### streaming, reindexed, S=0 W=64" in md and "| rope (1) | **7.00** | **8.00** |" in md
    assert (out / "comparison_streaming.csv").is_file()


def test_task_lines_under_a_scaling_name_it_once():
    """A task row scored under NTK is the line ``rope+ntk`` in compare's tables, plots and W&B
    charts: the label carries the scaling, and the tasks' own labels do not add it again."""
    from evaluation.tasks import TaskRow, _series, label_task_rows, markdown_table

    rows = [TaskRow("passkey", "rope", 64, n, math.nan, 10, 0.5, 0.5, 0.0, learned="yes", rope_scaling=kind)
            for kind in ("none", "ntk") for n in (64, 128)]
    labelled = label_task_rows([("runs/a", r) for r in rows])
    assert sorted(_series(labelled)) == ["rope", "rope+ntk"]
    assert "| passkey | rope+ntk | — | 50.0 | 50.0 |" in markdown_table(labelled)


def test_a_run_that_did_not_learn_is_marked_once_in_every_task_output():
    """compare's single-seed table, the plot series and the W&B chart lines (all built from
    ``label_task_rows``) say "[not learned at L]" once, after the scheme and its scaling."""
    from evaluation.tasks import TaskRow, _series, label_task_rows, markdown_table, single_seed_task_table

    rows = [TaskRow("passkey", "rope", 64, n, math.nan, 10, 0.5, 0.5, 0.0, learned="no", rope_scaling=kind)
            for kind in ("none", "ntk") for n in (64, 128)]
    labelled = label_task_rows([("runs/a", r) for r in rows])
    assert sorted(_series(labelled)) == ["rope [not learned at L]", "rope+ntk [not learned at L]"]
    assert "| passkey | rope+ntk [not learned at L] | — | 50.0 | 50.0 |" in markdown_table(labelled)
    table = single_seed_task_table(labelled, "passkey")
    assert "| rope [not learned at L] | 50.0 | 50.0 |" in table and table.count("not learned") == 2


# --- the plug-in: a probe = its file + one registry line, compare included ----------------------

@dataclass
class ToyRow:
    """A throwaway probe's row: one score per (scheme, length)."""
    scheme: str
    train_length: int
    eval_length: int
    score: float
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def toy_sections(runs, pairs, out):
    """The toy probe's own compare hook, built from the library alone (as a probe file would)."""
    from evaluation.compare import group_points, make_cells
    from evaluation.compare_report import stats_sections, write_stats_csv

    if not pairs:
        return []
    cells = make_cells(group_points(runs, pairs, lambda r: ("toy", r.train_length, r.eval_length), lambda r: r.score),
                       lower_is_better=False)
    write_stats_csv(cells, out / "comparison_toy.csv", "toy")
    return stats_sections(cells, "{:.2f}", lambda section: f"### {section}\n\nToy score by length.")


def toy_probe():
    from evaluation.probe import Comparison, Probe
    from evaluation.results import Logged

    compared = Comparison("toy.csv", ToyRow, series=lambda r: (r.scheme,), section=toy_sections,
                          charts=lambda runs, pairs, out: {"comparison-toy": Logged(summary={"toy/rows": len(pairs)})})
    return Probe(name="toy", config=dict, needs="text", output="toy", evaluate=lambda subject, config: [],
                 save=lambda result, out, title: {}, reports=lambda result, paths: [],
                 announce=lambda result, paths: "", compare=(compared,))


def test_a_registered_probe_with_compare_hooks_appears_in_compare_runs_without_another_edit(tmp_path, monkeypatch):
    """A throwaway probe, registered here and nowhere else: its table is found under the runs, its
    rows grouped by seed with the other probes' (toy scores per seed: rope [2.0, 4.0] -> 3.00 ±
    12.706205 * sqrt(2) / sqrt(2) = 12.71, the best; alibi [1.0], one seed, no test), its section
    follows the built-in ones, its W&B run is logged; unregistered, it is gone again."""
    import importlib.util
    import sys

    from evaluation.registry import PROBES
    from evaluation.sweep import write_rows

    sys.path.insert(0, str(ROOT / "scripts"))
    spec = importlib.util.spec_from_file_location("pelab_script_compare_runs_toy", ROOT / "scripts" / "compare_runs.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    logged = {}
    monkeypatch.setattr(script, "log_to_new_wandb_run", lambda payload, out, **kw: logged.update({kw["name"]: payload}))

    sweep = tmp_path / "multirun"
    for name, scheme, seed, score in (("0-rope", "rope", 1, 2.0), ("1-rope", "rope", 2, 4.0), ("2-alibi", "alibi", 1, 1.0)):
        run = seed_run(sweep, name, scheme, seed, {64: 4.0 + seed})
        write_rows([ToyRow(scheme, 64, 64, score)], run / "toy" / "toy.csv", ToyRow)

    monkeypatch.setitem(PROBES, "toy", toy_probe())
    assert script.main([str(sweep), "--out", str(tmp_path / "with"), "--wandb"]) == 0
    md = (tmp_path / "with" / "comparison.md").read_text()
    assert md.index("### nonoverlapping") < md.index("### toy\n\nToy score by length.\n\n")
    assert "| scheme (seeds) | 64 (train) |\n|---|---|\n| rope (2) | **3.00 ± 12.71** |\n| alibi (1) | 1.00 |\n" in md
    assert (tmp_path / "with" / "comparison_toy.csv").read_text().splitlines()[1].startswith("rope,toy,64,64,2,1 2,3.0,")
    assert logged["comparison-toy"].summary == {"toy/rows": 3} and "comparison" in logged

    monkeypatch.undo()  # unregistered: the same runs compare without it
    assert "toy" not in PROBES
    assert script.main([str(sweep), "--out", str(tmp_path / "without")]) == 0
    assert "### toy" not in (tmp_path / "without" / "comparison.md").read_text()
    assert not (tmp_path / "without" / "comparison_toy.csv").exists()
