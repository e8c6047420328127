"""data/synthetic.py (task layouts, determinism, data module) and evaluation/tasks.py (accuracy
vs length), each checked against an independent naive reading of the bytes or a naive loop."""

import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from data.synthetic import NEEDLE, PAD, QUERY, SEP, SyntheticDataModule, Task
from evaluation.tasks import (
    TaskEvalConfig, TaskRow, evaluate_tasks, markdown_table, mean_over_depths, read_csv, run_task_evaluation,
    save_results, summary_metrics,
)
from model import GPT, GPTConfig
from model.pe import SCHEMES
from pelab.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]
FILLER = b"The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


# --- naive readers: what each task's bytes mean, written from the layout in the docstring ------

def read_passkey(x: bytes, k: int) -> list[int]:
    i = x.index(bytes([NEEDLE]))
    key = x[i + 1 : i + 1 + k]
    assert key.isdigit() and x.count(bytes([NEEDLE])) == 1 and x.count(bytes([QUERY])) == 1
    assert x.endswith(bytes([QUERY]) + key[:-1])  # the question, then the key (its last digit is a target only)
    filler = x[:i] + x[i + 1 + k : len(x) - k]
    assert filler == (FILLER * 100)[: len(filler)]  # the sentences, continuing across the needle
    return list(key)


def read_copy(x: bytes) -> list[int]:
    n = len(x) // 2  # length + 1 ids = [PAD] + n + SEP + n
    body = x[1:] if len(x) % 2 else x  # an odd input length starts with PAD
    assert len(x) % 2 == 0 or x[0] == PAD
    payload = body[:n]
    assert body[n] == SEP and body[n + 1 :] == payload[:-1] and payload.isalpha() and payload.islower()
    return list(payload)


def read_assoc(x: bytes, pairs: int, queries: int) -> list[int]:
    cut = x.index(bytes([SEP]))
    section, asked = x[:cut], x[cut + 1 :] + b"?"
    table = {section[i]: section[i + 1] for i in range(len(section) - 1) if chr(section[i]).isupper()}
    assert len(table) == pairs and sum(chr(c).isupper() for c in section) == pairs
    assert all(chr(v).isdigit() for v in table.values())
    keys = asked[0::2]
    assert len(keys) == queries and len(set(keys)) == queries
    for i, key in enumerate(keys[:-1]):  # earlier answers are inputs too: they must be right
        assert asked[2 * i + 1] == table[key]
    return [table[k] for k in keys]


def read_flipflop(x: bytes) -> list[int]:
    body = x[1:] + b"?" if len(x) % 2 == 0 else x + b"?"  # even input length: PAD first
    assert len(x) % 2 == 1 or x[0] == PAD
    ops, bits = body[0::2], body[1::2]
    assert ops[0:1] == b"w" and ops[-1:] == b"r" and set(ops) <= set(b"wir")
    register, reads = None, []
    for op, bit in zip(ops, bits):
        if op == ord("w"):
            register = bit
        elif op == ord("r"):
            reads.append(register)
    return reads


def answers_of(task: Task, x: np.ndarray) -> list[int]:
    raw = bytes(x.astype(np.uint8).tolist())
    return {"passkey": lambda: read_passkey(raw, task.key_length), "copy": lambda: read_copy(raw),
            "assoc_recall": lambda: read_assoc(raw, task.num_pairs, task.num_queries),
            "flipflop": lambda: read_flipflop(raw)}[task.name]()


TASK_CASES = [Task("passkey"), Task("passkey", key_length=2), Task("copy"), Task("assoc_recall"),
              Task("assoc_recall", num_pairs=3, num_queries=3), Task("flipflop"), Task("flipflop", p_ignore=0.0)]


@pytest.mark.parametrize("task", TASK_CASES, ids=lambda t: f"{t.name}")
def test_samples_have_the_length_and_answers_the_layout_says(task):
    for length in sorted({task.min_length, task.min_length + 1, 64, 65, 257}):
        for index in range(6):
            x, y = task.sample(length, index, seed=3)
            assert x.shape == y.shape == (length,) and x.dtype == y.dtype == np.int64
            assert 0 <= x.min() and x.max() < 256
            answer = np.flatnonzero(y >= 0)
            assert answer[-1] == length - 1  # every layout ends with an answer
            assert list(y[answer]) == answers_of(task, x)  # what a naive reader of the bytes expects
            assert np.all(y[answer[:-1]] == x[answer[:-1] + 1])  # targets are the next tokens
            assert np.all(y[y < 0] == -1)


def test_answer_counts_by_hand():
    assert (Task("passkey").sample(40, 0)[1] >= 0).sum() == 5  # the key's digits
    assert (Task("copy").sample(40, 0)[1] >= 0).sum() == 20  # 41 ids: 20 + SEP + 20
    assert (Task("copy").sample(41, 0)[1] >= 0).sum() == 20  # 42 ids: PAD + 20 + SEP + 20
    assert (Task("assoc_recall", num_pairs=5, num_queries=2).sample(40, 0)[1] >= 0).sum() == 2
    assert Task("passkey").min_length == 11 and Task("assoc_recall").min_length == 24


def test_passkey_depth_places_the_needle_and_keeps_the_key():
    # length 41, key of 5: 42 ids = 30 filler + NEEDLE + 5 + QUERY + 5; the needle goes after
    # round(depth * 30) filler tokens: 0 at depth 0, 15 at 0.5, 30 (right before QUERY) at 1
    task = Task("passkey")
    keys = set()
    for depth, at in ((0.0, 0), (0.25, 8), (0.5, 15), (1.0, 30)):  # round(7.5) = 8: half to even
        x, y = task.sample(41, 7, seed=1, depth=depth)
        assert x[at] == NEEDLE
        keys.add(tuple(y[y >= 0]))
    assert x[36] == QUERY and len(keys) == 1  # the same key at every depth
    drawn = [list(task.sample(41, i, seed=1)[0]).index(NEEDLE) for i in range(300)]
    assert min(drawn) <= 2 and max(drawn) >= 28  # no depth given: spread over [0, 1]


def test_samples_are_pure_functions_of_their_arguments():
    task = Task("assoc_recall")
    a = task.sample(64, 5, seed=9)
    assert all(np.array_equal(u, v) for u, v in zip(a, task.sample(64, 5, seed=9)))
    others = [task.sample(64, 6, seed=9), task.sample(64, 5, seed=10), task.sample(64, 5, seed=9, split="val"),
              task.sample(64, 5, seed=9, rank=1), Task("assoc_recall", num_queries=3).sample(64, 5, seed=9)]
    assert all(not np.array_equal(a[0], o[0]) for o in others)
    # a longer sample is a fresh draw, not the short one padded
    assert not np.array_equal(task.sample(65, 5, seed=9)[0][:64], a[0])


def test_random_parts_have_the_stated_distributions():
    # flipflop FFL(0.8): middle instructions are 'i' with p 0.8, 'w' and 'r' 0.1 each
    ops = Counter()
    for i in range(200):
        x = Task("flipflop").sample(511, i)[0]  # 512 ids: 256 pairs, 254 free instructions each
        ops.update(bytes(x[2:-2:2].astype(np.uint8).tolist()).decode())
    n = sum(ops.values())
    assert n == 200 * 254
    assert abs(ops["i"] / n - 0.8) < 0.01 and abs(ops["w"] / n - 0.1) < 0.01 and abs(ops["r"] / n - 0.1) < 0.01
    digits = Counter()
    for i in range(400):
        y = Task("passkey").sample(20, i)[1]
        digits.update(y[y >= 0].tolist())
    assert set(digits) == set(range(48, 58)) and max(digits.values()) < 2 * min(digits.values())


@pytest.mark.parametrize("make,message", [
    (lambda: Task("pasky"), "data.task must be one of passkey, copy, assoc_recall, flipflop, got 'pasky'"),
    (lambda: Task("assoc_recall", num_pairs=4, num_queries=5), "data.num_queries must be <= data.num_pairs=4"),
    (lambda: Task("assoc_recall", num_pairs=27), "data.num_pairs must be <= 26"),
    (lambda: Task("flipflop", p_ignore=1.0), "data.p_ignore must be a number in [0, 1), got 1.0"),
    (lambda: Task("passkey", key_length=0), "data.key_length must be an integer >= 1, got 0"),
    (lambda: Task("passkey").sample(10, 0), "length must be an integer >= 11 (the shortest passkey sample), got 10"),
    (lambda: Task("copy").sample(10, 0, depth=0.5), "depth must be null for task=copy"),
    (lambda: Task("passkey").sample(20, 0, depth=1.5), "depth must be a number in [0, 1]"),
    (lambda: Task("passkey").sample(20, 0, split="dev"), "split must be one of train, val, test, got 'dev'"),
    (lambda: SyntheticDataModule("passkey", block_size=8), "data.block_size must be an integer >= 11"),
    (lambda: SyntheticDataModule("copy", depth=0.5), "data.depth must be null for data.task=copy"),
    (lambda: SyntheticDataModule(val_samples=0), "data.val_samples must be an integer >= 1, got 0"),
])
def test_bad_options_name_key_value_and_what_is_allowed(make, message):
    with pytest.raises(ConfigError) as err:
        make()
    assert message in str(err.value)


# --- the data module ------------------------------------------------------------------------

def test_data_module_batches_validation_and_resume():
    dm = SyntheticDataModule("flipflop", block_size=33, batch_size=4, val_samples=10, seed=5)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == y.shape == (4, 33) and dm.vocab_size == 256
    first = Task("flipflop").sample(33, 0, seed=5)
    assert torch.equal(x[0], torch.from_numpy(first[0])) and torch.equal(y[0], torch.from_numpy(first[1]))
    val = [b for b in dm.val_dataloader()]
    assert sum(len(b[0]) for b in val) == 10
    again = SyntheticDataModule("flipflop", block_size=33, batch_size=4, val_samples=10, seed=5)
    again.setup()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(val, again.val_dataloader()))  # fixed
    assert not torch.equal(val[0][0][0], x[0])  # validation is its own stream
    dm.train_set.offset = 8  # a resume after two batches continues the stream
    assert torch.equal(dm.train_set[0][0], torch.from_numpy(Task("flipflop").sample(33, 8, seed=5)[0]))


def test_unigram_baseline_is_the_answer_entropy():
    # uniform digits: ln 10 = 2.302585; uniform bits: ln 2 = 0.693147 (add-one smoothing over 256
    # ids moves them up a little: at most ln(1 + 256/answers))
    passkey = SyntheticDataModule("passkey", block_size=32, val_samples=200).unigram_loss(samples=1000)
    flipflop = SyntheticDataModule("flipflop", block_size=64, val_samples=200).unigram_loss(samples=1000)
    assert 2.302585 - 0.02 < passkey < 2.302585 + math.log(1 + 256 / 5000) + 0.02
    assert 0.693147 - 0.01 < flipflop < 0.693147 + 0.08


def test_no_held_out_text_is_said_plainly():
    dm = SyntheticDataModule()
    assert dm.held_out_text is False and dm.meta is None
    with pytest.raises(ValueError, match=r"data.task=passkey is synthetic: there is no val text.*"
                                         r"eval.extrapolation.enabled=false"):
        dm.split_path("val")


def test_model_loss_counts_answer_tokens_only():
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    gpt = GPT(cfg, SCHEMES["rope"](cfg))
    x, y = (torch.from_numpy(a)[None] for a in Task("passkey").sample(64, 0))
    logits, loss = gpt(x, y)
    logp = F.log_softmax(logits[0].double(), -1)
    naive = -sum(logp[t, y[0, t]] for t in range(64) if y[0, t] >= 0) / 5
    assert loss.item() == pytest.approx(naive.item(), rel=1e-5)


def compose(overrides):
    from hydra import compose as hydra_compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return hydra_compose("config", overrides=[*overrides, "paths.output_dir=/nonexistent/pelab-out"])


def test_configs_compose_validate_and_build():
    from data.datamodule import build_datamodule

    from pelab.validate import validate_config

    cfg = compose(["data=synthetic", "data.task=copy", "eval.extrapolation.enabled=false"])
    validate_config(cfg)
    dm = build_datamodule(cfg.data)
    assert dm.task.name == "copy" and dm.block_size == cfg.model.block_size == 256
    cfg = compose(["experiment=task_ablation", "pe=alibi"])
    validate_config(cfg)
    assert cfg.data.task == "passkey" and cfg.model.block_size == 128 and not cfg.eval.extrapolation.enabled
    assert TaskEvalConfig.from_dict({k: v for k, v in cfg.eval.tasks.items() if k != "enabled"}).eval_lengths(128) \
        == [128, 256, 512, 1024]
    with pytest.raises(ConfigError, match=r"data.task must be one of 'passkey', 'copy', 'assoc_recall', "
                                          r"'flipflop', got 'pasky'"):
        validate_config(compose(["data=synthetic", "data.task=pasky", "eval.extrapolation.enabled=false"]))


# --- evaluation/tasks.py --------------------------------------------------------------------

CFG = GPTConfig(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32)


def toy(scheme="rope", cfg=CFG):
    torch.manual_seed(0)
    return GPT(cfg, SCHEMES[scheme](cfg)).eval()


def naive_scores(gpt, task, length, samples, seed, depth=None):
    """(exact, tokens right, answer tokens): one sample at a time, full logits, a Python loop."""
    exact, right, total = 0, 0, 0
    for i in range(samples):
        x, y = task.sample(length, i, seed, "test", 0, depth)
        with torch.no_grad():
            logits, _ = gpt(torch.from_numpy(x)[None])
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
    gpt = bits_only(toy("alibi")) if task.name == "flipflop" else toy("alibi")
    config = TaskEvalConfig(multipliers=[1, 2], samples=7, tokens_per_batch=100, q_chunk=24, precision="32")
    rows = evaluate_tasks(gpt, task, 32, config, seed=4, log=lambda _: None)
    assert [r.eval_length for r in rows] == [32, 64] and all(math.isnan(r.depth) for r in rows)
    for row in rows:
        exact, right, total = naive_scores(gpt, task, row.eval_length, 7, seed=4)
        assert row.ok and row.samples == 7
        assert row.accuracy == exact / 7 and row.token_accuracy == pytest.approx(right / total, abs=1e-12)
    if task.name == "flipflop":  # the comparison is not vacuous: some reads right, some wrong
        assert all(0.1 < r.token_accuracy < 0.9 for r in rows)


def constant_model(token: int) -> GPT:
    """A model whose every prediction is ``token``: the final LayerNorm's gain is 0 and its bias
    is the (tied) output row of ``token``, which is set to all ones."""
    cfg = GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=16, bias=True)
    gpt = toy("rope", cfg)
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
    rows = evaluate_tasks(toy("learned"), Task("passkey"), 32, config, seed=0)
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


def test_run_task_evaluation_writes_tables_and_logs(tmp_path):
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
    rows = run_task_evaluation(options, module, dm, [logger], tmp_path, step=3)
    logger.save()
    assert [(r.eval_length, r.depth, r.samples) for r in rows] == [(16, 0.5, 4), (32, 0.5, 4)]
    assert [(r.eval_length, r.accuracy) for r in read_csv(tmp_path / "tasks" / "tasks.csv")] == \
        [(r.eval_length, r.accuracy) for r in rows]
    logged = (tmp_path / "csv" / "metrics.csv").read_text()
    assert "tasks/passkey/accuracy@32" in logged and "tasks/passkey/depth0.5/accuracy@16" in logged
    assert run_task_evaluation({**options, "enabled": False}, module, dm, [logger], tmp_path, step=3) == []


def test_train_then_eval_tasks_script(tmp_path):
    """train.py runs unchanged on synthetic data; scripts/eval_tasks.py scores its checkpoint."""
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    run = tmp_path / "run"
    tiny = ["experiment=task_ablation", "pe=alibi", "logger=csv", f"hydra.run.dir={run}", "model.n_layer=1",
            "model.n_embd=32", "model.block_size=32", "data.batch_size=4", "data.val_samples=8", "data.key_length=2",
            "trainer.max_steps=3", "trainer.val_check_interval=3", "~callbacks.attention_maps",
            "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    proc = subprocess.run([sys.executable, "train.py", *tiny], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "unigram baseline 2.3" in proc.stdout  # two-digit keys: about ln 10 per answer token
    ckpt = run / "checkpoints" / "last.ckpt"
    out = tmp_path / "eval"
    proc = subprocess.run([sys.executable, "scripts/eval_tasks.py", f"ckpt={ckpt}", "multipliers=1,2",
                           "depths=0,1", "samples=5", "precision=32", f"out={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = read_csv(out / "tasks.csv")
    assert [(r.task, r.scheme, r.train_length, r.eval_length, r.depth, r.samples) for r in rows] == \
        [("passkey", "alibi", 32, n, d, 5) for n in (32, 64) for d in (0.0, 1.0)]
    bad = subprocess.run([sys.executable, "scripts/eval_tasks.py", f"ckpt={ckpt}", "samples=many"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "samples='many' is not valid" in bad.stderr
