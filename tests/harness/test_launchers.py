"""Cluster sweeps go through Hydra's launcher plugins: the SLURM preset maps the trainer's
devices and nodes onto the job's tasks, and a sweep through submitit's local executor (the
same launcher code as on SLURM, with local processes) trains one run per job."""

import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
FAST = [
    "model.n_layer=1", "model.n_embd=32", "model.n_head=2", "model.block_size=32", "data.batch_size=4",
    "trainer.max_steps=3", "trainer.val_check_interval=3", "trainer.limit_val_batches=2",
    "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "optim.warmup_steps=1",
    "eval.extrapolation.multipliers=[1,2]", "eval.extrapolation.max_tokens=256",
    "~callbacks.attention_maps", "~callbacks.position_functions", "logger=csv",
]


def compose_with_hydra(*overrides: str):
    import train  # noqa: F401 - registers the run_slug resolver used by the sweep subdir

    with initialize_config_dir(version_base="1.3", config_dir=str(ROOT / "conf")):
        return compose("config", overrides=list(overrides), return_hydra_config=True)


def test_slurm_preset_maps_devices_and_nodes_to_tasks():
    cfg = compose_with_hydra("hydra/launcher=slurm", "trainer=ddp", "trainer.devices=8", "trainer.num_nodes=2",
                             "hydra.launcher.partition=gpu", "hydra.launcher.account=lab")
    launcher = cfg.hydra.launcher
    assert launcher._target_.endswith("submitit_launcher.SlurmLauncher")
    assert (launcher.nodes, launcher.tasks_per_node, launcher.gpus_per_node) == (2, 8, 8)
    assert (launcher.partition, launcher.account) == ("gpu", "lab")
    assert launcher.max_num_timeout > 0 and launcher.signal_delay_s > 0  # requeued on time limits


def test_joblib_launcher_composes():
    cfg = compose_with_hydra("hydra/launcher=joblib", "hydra.launcher.n_jobs=2")
    assert cfg.hydra.launcher._target_.endswith("JoblibLauncher") and cfg.hydra.launcher.n_jobs == 2


def test_two_job_sweep_through_submitit_local_executor(tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    # the launching process forks from the test's forkserver (tests/cli.py); submitit starts each job's own
    proc = run_python(["train.py", "-m", "hydra/launcher=submitit_local", "hydra.launcher.timeout_min=10",
                       "pe=rope,alibi", f"hydra.sweep.dir={tmp_path}", *FAST], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if (p / "checkpoints" / "last.ckpt").is_file())
    assert [r.split("-")[:2] for r in runs] == [["0", "rope"], ["1", "alibi"]], sorted(tmp_path.iterdir())
    for run in runs:  # each job ran to the end, its own process and table
        assert (tmp_path / run / "extrapolation" / "extrapolation.csv").is_file()
    logs = list((tmp_path / ".submitit").rglob("*_log.out"))
    assert len(logs) == 2  # two submitit jobs, not one process running both
