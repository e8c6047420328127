"""Preemption and restart: a stop signal saves last.ckpt at the end of the step and exits
cleanly; ``resume=auto`` in the same run dir continues from it into the same W&B run and ends
with the parameters of an uninterrupted run."""

import os
import subprocess
from pathlib import Path

import torch

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
STEPS = 12
ARGS = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4",
    f"trainer.max_steps={STEPS}", "trainer.val_check_interval=4", "trainer.limit_val_batches=2",
    "trainer.precision=32", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
    "optim.warmup_steps=2", "eval.extrapolation.enabled=false", "~callbacks.attention_maps",
    "~callbacks.position_functions", "logger=wandb", "resume=auto",
]


def run(run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "WANDB_MODE": "offline", "PYTHONPATH": str(ROOT)}
    return run_python(["train.py", f"hydra.run.dir={run_dir}", *ARGS, *extra], cwd=ROOT, env=env, timeout=600)


def weights(ckpt: Path) -> dict:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def offline_run_ids(run_dir: Path) -> set[str]:
    return {p.name.rsplit("-", 1)[-1] for p in (run_dir / "wandb").glob("offline-run-*")}


def stop_at_step_6(run_dir: Path, signum: str) -> Path:
    stopped = run(run_dir, "+callbacks.signal._target_=tests.harness.signal_at_step.SignalAtStep",
                  "+callbacks.signal.step=6", f"+callbacks.signal.signum={signum}")
    assert stopped.returncode == 0, stopped.stderr[-3000:]  # a clean exit, not a crash
    assert "finished at step" not in stopped.stdout
    last = run_dir / "checkpoints" / "last.ckpt"
    saved = torch.load(last, map_location="cpu", weights_only=True)
    assert saved["global_step"] == 6  # the step the signal arrived in was completed, no later one
    return last


def test_sigusr1_also_saves_and_exits(tmp_path):
    stop_at_step_6(tmp_path / "cut", "SIGUSR1")


def test_sigterm_then_resume_auto_equals_an_uninterrupted_run(tmp_path):
    whole = tmp_path / "whole"
    proc = run(whole)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resume=auto: no checkpoint" in proc.stdout  # a fresh dir: resume=auto just starts

    cut = tmp_path / "cut"
    last = stop_at_step_6(cut, "SIGTERM")
    run_id = (cut / "wandb_run_id.txt").read_text().strip()

    resumed = run(cut)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"continuing from {last}" in resumed.stdout and f"finished at step {STEPS}" in resumed.stdout
    assert (cut / "wandb_run_id.txt").read_text().strip() == run_id
    assert offline_run_ids(cut) == {run_id}  # both starts logged into the one W&B run

    a, b = weights(whole / "checkpoints" / "last.ckpt"), weights(last)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=0, atol=1e-6, msg=name)
    assert offline_run_ids(whole) != offline_run_ids(cut)  # a fresh dir gets its own W&B run


def test_resume_auto_and_ckpt_path_together_is_an_error(tmp_path):
    proc = run(tmp_path / "r", "ckpt_path=/nonexistent.ckpt")
    assert proc.returncode != 0
    assert "resume=auto and ckpt_path=/nonexistent.ckpt both given" in proc.stderr
