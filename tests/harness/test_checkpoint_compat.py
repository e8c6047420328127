"""Checkpoints written before the re-layout (tests/fixtures/README.md: commit b42b955) still
resume, evaluate and sample, and give the numbers the code that wrote them gives.

The expected values were measured by running b42b955 itself on these fixtures with the same
commands; a run laid out like a user's (RUN_DIR/checkpoints/{last.ckpt,config.yaml}) is
rebuilt in a temporary dir for each test.
"""

import csv
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
# the model the fixtures were trained with (tests/fixtures/README.md)
MODEL = ["model.n_layer=2", "model.n_embd=32", "model.n_head=2"]
EXPECTED = {  # b42b955 on its own checkpoints
    "rope": {
        "resumed": {6: 5.522093772888184, 7: 5.532514572143555},  # train/loss resuming steps 6 -> 8
        "eval": {256: 5.553327311761677, 512: 5.551833943463862},  # nonoverlapping loss, fp32, 512 tokens
        "sample": 'It wasnC"\ufffd\x15\x15L(\ufffdU\x0fz\x08r\\\ufffdGJ\ufffd\u01e2\ufffd\x02\ufffd\n',
    },
    "t5": {
        "resumed": {6: 5.532012939453125, 7: 5.5397820472717285},
        "eval": {256: 5.549938092939556, 512: 5.554454326629639},
        "sample": "It was\u0738\ufffd\x19\ufffd\ufffd\u03e1\ufffdi\ufffd\ufffd\ufffdeGjv\ufffd\ufffd\ufffd\ufffd\ufffd+_\n",
    },
}


def run(args, timeout=300) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    proc = run_python(args, cwd=ROOT, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


@pytest.fixture(params=sorted(EXPECTED))
def old_run(request, tmp_path) -> tuple[str, Path]:
    """(scheme, RUN_DIR/checkpoints/last.ckpt) of a run written by b42b955."""
    scheme = request.param
    ckpt_dir = tmp_path / "old-run" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    shutil.copy(FIXTURES / f"main-b42b955-{scheme}.ckpt", ckpt_dir / "last.ckpt")
    shutil.copy(FIXTURES / f"main-b42b955-{scheme}.yaml", ckpt_dir / "config.yaml")
    return scheme, ckpt_dir / "last.ckpt"


def test_old_checkpoint_resumes_where_it_stopped(old_run, tmp_path):
    scheme, ckpt = old_run
    out = tmp_path / "resumed"
    proc = run(["train.py", f"pe={scheme}", *MODEL, "eval.extrapolation.enabled=false", "logger=csv",
                "trainer.log_every_n_steps=1", f"ckpt_path={ckpt}", "trainer.max_steps=8", f"hydra.run.dir={out}"])
    assert "finished at step 8" in proc.stdout
    with open(out / "csv" / "metrics.csv") as f:
        losses = {int(r["step"]): float(r["train/loss"]) for r in csv.DictReader(f) if r.get("train/loss")}
    assert losses == pytest.approx(EXPECTED[scheme]["resumed"], rel=1e-4)  # nothing re-trained from step 0
    assert torch.load(out / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 8


def test_old_checkpoint_evaluates(old_run, tmp_path):
    from evaluation.extrapolation import read_csv

    scheme, ckpt = old_run
    run(["scripts/eval_extrapolation.py", f"ckpt={ckpt}", "multipliers=1,2", "max_tokens=512", "precision=32",
         f"out={tmp_path}"])
    rows = read_csv(tmp_path / "extrapolation.csv")
    assert all(r.ok and r.scheme == scheme and r.tokens == 512 for r in rows)
    assert {r.eval_length: r.loss for r in rows} == pytest.approx(EXPECTED[scheme]["eval"], rel=1e-6)


def test_old_checkpoint_samples(old_run):
    scheme, ckpt = old_run
    args = ["scripts/sample.py", f"ckpt={ckpt}", "tokens=24", "seed=0", "prompt=It was", "device=cpu"]
    assert run(args).stdout == EXPECTED[scheme]["sample"]  # cache = no cache: tests/model/test_generate.py
