"""evaluation/tasks.py (accuracy vs length on the synthetic tasks) against a naive per-sample loop
and hand counts, and scripts/eval_tasks.py on a checkpoint that train.py wrote."""

import math
import os
from pathlib import Path

import pytest
import torch

from data.synthetic import Task
from evaluation.probe import read_step
from evaluation.tasks import (
    TaskEvalConfig, TaskRow, evaluate_tasks, markdown_table, mean_over_depths, read_csv,
    save_results, summary_metrics,
)
from model import GPT, GPTConfig
from pelab.datamodule import SyntheticDataModule
from pelab.evaluate import run_evaluations, subject_of
from tests.cli import run_python
from tests.tiny import tiny_gpt

ROOT = Path(__file__).resolve().parents[2]

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def naive_scores(gpt, task, length, samples, seed, depth=None, positions=None):
    """(exact, tokens right, answer tokens): one sample at a time, full logits, a Python loop;
    ``positions``: what the model is given instead of 0..T-1."""
    exact, right, total = 0, 0, 0
    for i in range(samples):
        x, y = task.sample(length, i, seed, "test", 0, depth)
        with torch.no_grad():
            logits, _ = gpt(torch.from_numpy(x)[None], positions=positions)
        ok = True
        for t in range(length):
            if y[t] >= 0:
                hit = int(torch.argmax(logits[0, t])) == y[t]
                right, total, ok = right + hit, total + 1, ok and hit
        exact += ok
    return exact, right, total


def bits_only(gpt: GPT) -> GPT:
    """The output layer untied and reduced to rows +v for '0' and -v for '1' (all others 0):
    every prediction is a bit, which one depends on the context."""
    with torch.no_grad():
        v = gpt.lm_head.weight[ord("0")].clone() * 100
        gpt.lm_head.weight = torch.nn.Parameter(torch.zeros_like(gpt.lm_head.weight))
        gpt.lm_head.weight[ord("0")], gpt.lm_head.weight[ord("1")] = v, -v
    return gpt


@pytest.mark.parametrize("task", [Task("flipflop", p_ignore=0.5), Task("copy")], ids=lambda t: t.name)
def test_accuracy_equals_a_naive_loop(task):
    gpt = bits_only(tiny_gpt("alibi", config=CFG)) if task.name == "flipflop" else tiny_gpt("alibi", config=CFG)
    config = TaskEvalConfig(multipliers=[1, 2], samples=7, tokens_per_batch=100, q_chunk=24, precision="32")
    rows = evaluate_tasks(gpt, task, 32, config, seed=4, log=lambda _: None)
    assert [r.eval_length for r in rows] == [32, 64] and all(math.isnan(r.depth) for r in rows)
    for row in rows:
        exact, right, total = naive_scores(gpt, task, row.eval_length, 7, seed=4)
        assert row.ok and row.samples == 7
        assert row.accuracy == exact / 7 and row.token_accuracy == pytest.approx(right / total, abs=1e-12)
    if task.name == "flipflop":  # the comparison is not vacuous: some reads right, some wrong
        assert all(0.1 < r.token_accuracy < 0.9 for r in rows)


def test_position_interpolation_scores_as_the_model_at_positions_divided_by_the_factor():
    """eval.tasks.rope_scaling=[null, linear] (PI, factor = eval length / L): at 2 L each sample
    scores as the plain model given positions 0, 1/2, 1, ... (Chen et al. 2023's definition,
    through the forward's positions, not the scaling code); at L the factor is 1, the plain
    model's rows; a scheme the kind does not apply to says so; each scaling gets its own labels."""
    task = Task("flipflop", p_ignore=0.5)
    gpt = bits_only(tiny_gpt("rope", config=CFG))
    with torch.no_grad():  # sharper attention: the positions decide more of the reads
        for block in gpt.blocks:
            block.attn.c_attn.weight.mul_(4)
    config = TaskEvalConfig(multipliers=[1, 2], samples=7, precision="32", rope_scaling=[None, "linear"])
    rows = evaluate_tasks(gpt, task, 32, config, seed=4, log=lambda _: None)
    assert [(r.rope_scaling, r.eval_length) for r in rows] == [("none", 32), ("none", 64), ("linear", 32),
                                                              ("linear", 64)]
    plain, pi = {r.eval_length: r for r in rows[:2]}, {r.eval_length: r for r in rows[2:]}
    exact, right, total = naive_scores(gpt, task, 64, 7, seed=4, positions=torch.arange(64) / 2)
    assert pi[64].accuracy == exact / 7 and pi[64].token_accuracy == pytest.approx(right / total, abs=1e-12)
    assert pi[64].token_accuracy != plain[64].token_accuracy  # the scaling changed what was read
    assert (pi[32].accuracy, pi[32].token_accuracy) == (plain[32].accuracy, plain[32].token_accuracy)
    assert {r.learned for r in rows} == {"no"}  # an untrained model, judged per scaling at L
    table = markdown_table(rows)
    assert "| flipflop | rope [not learned at L] |" in table and "| flipflop | rope+linear [not learned at L] |" in table
    assert "tasks/flipflop/linear/accuracy@64" in summary_metrics(rows) and "tasks/flipflop/accuracy@64" in \
        summary_metrics(rows)
    (row,) = evaluate_tasks(tiny_gpt("learned", config=CFG), task, 32,
                            TaskEvalConfig(multipliers=[1], samples=2, precision="32", rope_scaling=["ntk"]),
                            seed=4, log=lambda _: None)
    assert row.status == "not applicable: rope_scaling=ntk does not apply to pe=learned (it takes none)"
    with pytest.raises(ValueError, match=r"eval.tasks.rope_scaling must be a list of null, linear.*got \['pi'\]"):
        TaskEvalConfig(rope_scaling=["pi"])
    with pytest.raises(ValueError, match=r"eval.tasks.rope_scaling_factor must be null .* got 0.5"):
        TaskEvalConfig(rope_scaling=["linear"], rope_scaling_factor=0.5)


def constant_model(token: int) -> GPT:
    """A model whose every prediction is ``token``: the final LayerNorm's gain is 0 and its bias
    is the (tied) output row of ``token``, which is set to all ones."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16, bias=True)
    gpt = tiny_gpt("rope", config=cfg)
    with torch.no_grad():
        gpt.lm_head.weight[token] = 1.0
        gpt.ln_f.weight.zero_()
        gpt.ln_f.bias.fill_(1.0)
    return gpt


def test_accuracy_of_a_constant_predictor_by_hand():
    # predicting '7' everywhere: a key of 2 digits is exactly right when it is "77", and a digit
    # is right when it is 7; counted here from the samples' targets
    task, samples = Task("passkey", key_length=2), 300
    keys = [task.sample(64, i, 11, "test", 0, 0.5)[1][-2:] for i in range(samples)]
    exact = sum(list(k) == [55, 55] for k in keys) / samples
    digits = sum((k == 55).sum() for k in keys) / (2 * samples)
    config = TaskEvalConfig(multipliers=[1], depths=[0.5], samples=samples, precision="32")
    (row,) = evaluate_tasks(constant_model(ord("7")), task, 64, config, seed=11, log=lambda _: None)
    assert row.accuracy == pytest.approx(exact) and row.token_accuracy == pytest.approx(digits)
    assert 0.04 < digits < 0.16 and row.depth == 0.5  # about 1 in 10, as drawn


def test_learned_past_its_table_is_not_applicable_and_short_lengths_are_skipped(capsys):
    config = TaskEvalConfig(multipliers=[1, 2], lengths=[5], depths=[0, 1], samples=3, precision="32")
    rows = evaluate_tasks(tiny_gpt("learned", config=CFG), Task("passkey"), 32, config, seed=0)
    assert [(r.eval_length, r.depth) for r in rows] == [(n, d) for n in (5, 32, 64) for d in (0.0, 1.0)]
    assert {r.status for r in rows[:2]} == {"skipped: a passkey sample needs at least 11 tokens"}
    assert all(r.ok and r.samples == 3 for r in rows[2:4])
    assert {r.status for r in rows[4:]} == {"not applicable: pe=learned has 32 positions"}
    assert all(math.isnan(r.accuracy) and r.samples == 0 for r in rows[4:])
    assert "not applicable" in capsys.readouterr().out


def test_results_round_trip_table_and_metrics(tmp_path):
    rows = [TaskRow("passkey", "rope", 16, 16, 0.0, 10, 1.0, 1.0, 0.1),
            TaskRow("passkey", "rope", 16, 16, 1.0, 10, 0.8, 0.9, 0.1),
            TaskRow("passkey", "rope", 16, 32, 0.0, 10, 0.5, 0.7, 0.1),
            TaskRow("passkey", "rope", 16, 32, 1.0, 10, 0.1, 0.3, 0.1),
            TaskRow("passkey", "learned", 16, 32, 0.0, 0, math.nan, math.nan, 0.0,
                    "not applicable: pe=learned has 16 positions")]
    paths = save_results(rows, tmp_path, title="t")
    assert paths["png"].stat().st_size > 1000
    back = read_csv(paths["csv"])
    assert [(r.scheme, r.eval_length, r.depth, r.accuracy, r.status) for r in back[:4]] == \
        [(r.scheme, r.eval_length, r.depth, r.accuracy, r.status) for r in rows[:4]]
    assert math.isnan(back[4].accuracy)
    assert markdown_table(rows) == (
        "| task | scheme | depth | 16 (train) | 32 |\n|---|---|---|---|---|\n"
        "| passkey | rope | 0 | 100.0 | 50.0 |\n| passkey | rope | 1 | 80.0 | 10.0 |\n"
        "| passkey | learned | 0 |  | n/a |\n"
        "| passkey | rope | mean | 90.0 | 30.0 |\n| passkey | learned | mean |  | n/a |\n")
    means = mean_over_depths(rows)
    assert [(r.scheme, r.eval_length, r.samples, r.accuracy) for r in means[:2]] == \
        [("rope", 16, 20, pytest.approx(0.9)), ("rope", 32, 20, pytest.approx(0.3))]
    metrics = summary_metrics(rows)
    assert metrics["tasks/passkey/accuracy@32"] == pytest.approx(0.3)
    assert metrics["tasks/passkey/token_accuracy@16"] == pytest.approx(0.95)
    assert metrics["tasks/passkey/depth1/accuracy@16"] == 0.8
    assert not any("learned" in k for k in metrics) and len(metrics) == 4 + 4


def test_runner_writes_task_tables_and_logs(tmp_path):
    from lightning.pytorch.loggers import CSVLogger
    from omegaconf import OmegaConf

    from pelab.lit import LitGPT

    cfg = OmegaConf.create({
        "model": {"block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16, "vocab_size": 256},
        "trainer": {"precision": "32"},
        "eval": {"tasks": {"multipliers": [1, 2], "depths": [0.5], "samples": 4}},
    })
    module = LitGPT(model=cfg.model, pe={"_target_": "model.pe.alibi.ALiBi"})
    logger = CSVLogger(tmp_path, name="csv", version="")
    dm = SyntheticDataModule("passkey", block_size=16)
    options = {**OmegaConf.to_container(cfg.eval.tasks), "precision": "32"}
    rows = run_evaluations(subject_of(module, dm), {"tasks": options}, tmp_path, 3, [logger])["tasks"].result
    logger.save()
    assert [(r.eval_length, r.depth, r.samples) for r in rows] == [(16, 0.5, 4), (32, 0.5, 4)]
    assert [(r.eval_length, r.accuracy) for r in read_csv(tmp_path / "tasks" / "tasks.csv")] == \
        [(r.eval_length, r.accuracy) for r in rows]
    assert read_step(tmp_path / "tasks") == 3  # which model the files score
    logged = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "tasks/passkey/accuracy@32" in logged and "tasks/passkey/depth0.5/accuracy@16" in logged
    assert run_evaluations(subject_of(module, dm), {"tasks": {**options, "enabled": False}}, tmp_path, 3, [logger]) == {}


def test_train_then_eval_tasks_script(tmp_path):
    """train.py runs unchanged on synthetic data; scripts/eval_tasks.py scores its checkpoint."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    run = tmp_path / "run"
    tiny = ["experiment=task_ablation", "pe=alibi", "logger=csv", f"hydra.run.dir={run}", "model.n_layer=1",
            "model.n_embd=32", "model.block_size=32", "data.batch_size=4", "data.val_samples=8", "data.key_length=2",
            "trainer.max_steps=3", "trainer.val_check_interval=3", "~callbacks.attention_maps",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
            "trainer.precision=32-true"]  # this CPU emulates bf16; the subject here is the scripts
    proc = run_python(["train.py", *tiny], cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram baseline 2.3" in proc.stdout  # two-digit keys: about ln 10 per answer token
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    bad = run_python(["scripts/eval_tasks.py", f"ckpt={ckpt}", "rope_scaling=pi"], cwd=ROOT, env=env, timeout=300)
    assert bad.returncode != 0 and "rope_scaling='pi' is not valid" in bad.stderr + bad.stdout
    proc = run_python(["scripts/eval_tasks.py", f"ckpt={ckpt}", "multipliers=1,2", "rope_scaling=linear",
                       "depths=0,1", "samples=5", "precision=32", f"out={out}"],
                       cwd=ROOT, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(out / "tasks.csv")
    assert [(r.task, r.scheme, r.rope_scaling, r.train_length, r.eval_length, r.depth, r.samples) for r in rows] == \
        [("passkey", "alibi", s, 32, n, d, 5) for s in ("none", "linear") for n in (32, 64) for d in (0.0, 1.0)]

    # scripts/evaluate.py: the probes conf/eval enables, the files the end of training wrote, nothing else
    where = tmp_path / "elsewhere"
    where.mkdir()
    proc = run_python([str(ROOT / "scripts" / "evaluate.py"), f"ckpt={ckpt}", "device=cpu",
                       "eval.tasks.multipliers=[1]", "eval.tasks.depths=[1]", "eval.tasks.samples=3",
                       "eval.sweep.precision=32", "eval.probe.multipliers=[1]", "eval.probe.rows=4"],
                       cwd=where, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (tasks,) = (run / "tasks").glob("eval-last-*/tasks.csv")
    (probe,) = (run / "attention_probe").glob("eval-last-*/probe.csv")
    for written, at_end in ((tasks, run / "tasks" / "tasks.csv"), (probe, run / "attention_probe" / "probe.csv")):
        assert written.read_text().splitlines()[0] == at_end.read_text().splitlines()[0]  # the same columns
    assert [(r.eval_length, r.depth, r.samples) for r in read_csv(tasks)] == [(32, 1.0, 3)]
    # every evaluation says which model it scored: last.ckpt is step 3, as the end of training was
    assert read_step(tasks.parent) == read_step(probe.parent) == read_step(out) == read_step(run / "tasks") == 3
    assert not list(where.iterdir())  # Hydra wrote no outputs/ and changed no directory


def test_depth_by_length_heatmap_and_learned_mark(tmp_path):
    from evaluation.tasks import mark_learned

    def run(scheme, accuracies):  # {(length, depth): accuracy}, 10 samples each
        return [TaskRow("niah", scheme, 16, n, d, 10, a, a, 0.1) for (n, d), a in accuracies.items()]

    good = run("alibi", {(16, 0.0): 1.0, (16, 1.0): 0.8, (32, 0.0): 0.5, (32, 1.0): 0.2})
    bad = run("rope", {(16, 0.0): 0.9, (16, 1.0): 0.8, (32, 0.0): 0.0, (32, 1.0): 0.1})
    assert mark_learned(good) == "yes"  # (1.0 + 0.8) / 2 = 0.9 >= 0.9
    assert mark_learned(bad) == "no"  # 0.85
    paths = save_results(good + bad, tmp_path, title="t")
    assert (tmp_path / "heatmap.csv").read_text().splitlines() == [
        "task,scheme,learned,depth,16,32",
        "niah,alibi,yes,0,1.0000,0.5000", "niah,alibi,yes,1,0.8000,0.2000",
        "niah,rope,no,0,0.9000,0.0000", "niah,rope,no,1,0.8000,0.1000"]
    assert paths["heatmap"].stat().st_size > 1000
    md = paths["md"].read_text()
    assert "| niah | rope [not learned at L] | mean | 85.0 | 5.0 |" in md and "| niah | alibi | mean | 90.0 | 35.0 |" in md
    assert "below 90% on held-out samples at the training length" in md
    assert [r.learned for r in read_csv(paths["csv"])] == ["yes"] * 4 + ["no"] * 4


def test_niah_trains_as_typed_and_writes_heatmap_and_table(tmp_path):
    """``python train.py data=synthetic data.task=niah``: no extrapolation switch needed; perplexity is
    skipped, the accuracy table and the depth x length heatmap are written and the verdict printed."""
    run = tmp_path / "run"
    proc = run_python(
        ["train.py", "data=synthetic", "data.task=niah", "logger=csv", f"hydra.run.dir={run}",
         "model.n_layer=1", "model.n_embd=32", "model.block_size=80", "data.batch_size=4", "data.val_samples=4",
         "data.key_length=2", "trainer.max_steps=2", "trainer.val_check_interval=2", "~callbacks.attention_maps",
         "eval.tasks.samples=2", "eval.tasks.multipliers=[1,2]", "eval.tasks.depths=[0,1]",
         "trainer.precision=32-true",
         "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"],
        cwd=ROOT, env={**os.environ, "HYDRA_FULL_ERROR": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "[extrapolation]" not in proc.stdout and "task NOT learned at the training length" in proc.stdout
    rows = read_csv(run / "tasks" / "tasks.csv")
    assert [(r.task, r.eval_length, r.depth, r.learned) for r in rows] == \
        [("niah", n, d, "no") for n in (80, 160) for d in (0.0, 1.0)]
    assert (run / "tasks" / "heatmap.png").stat().st_size > 1000 and (run / "tasks" / "heatmap.csv").exists()
