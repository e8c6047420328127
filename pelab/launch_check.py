"""A sweep's launcher checked before Hydra starts it (conf/hydra/default.yaml ``callbacks``).

``-m hydra/launcher=slurm`` on a machine without SLURM used to end, after the sweep directory
was written, in submitit's ``RuntimeError: Could not detect "srun"`` traceback. submitit says
itself whether one of its executors can run here (``Executor.affinity()``: -1 = unavailable),
so every submitit launcher is checked the same way, before anything is written.
"""

from __future__ import annotations

import sys
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from pelab.config import ConfigError

# what is missing when submitit's executor of that name is unavailable
MISSING = {"slurm": "SLURM's srun is not on PATH: this is not a SLURM login node"}
LOCAL_LAUNCHERS = "hydra/launcher=submitit_local, hydra/launcher=joblib, or no hydra/launcher (one job at a time)"


def check_launcher(config: DictConfig) -> None:
    """A ConfigError when the sweep's launcher is a submitit one whose executor cannot run here."""
    target = str(config.hydra.launcher.get("_target_", ""))
    if ".hydra_submitit_launcher." not in target:
        return
    from hydra.utils import get_class
    from submitit.core.plugins import get_executors

    executor = getattr(get_class(target), "_EXECUTOR", None)
    executors = get_executors()
    if executor not in executors or executors[executor].affinity() >= 0:
        return
    choice = config.hydra.runtime.choices.get("hydra/launcher", executor)
    why = MISSING.get(executor, f"submitit's {executors[executor].__name__} reports it unavailable")
    raise ConfigError(f"hydra/launcher={choice} submits each job through submitit's {executor} executor, which "
                      f"cannot run on this machine ({why}); run the sweep where it can, or here with "
                      f"{LOCAL_LAUNCHERS}")


class LauncherCheck(Callback):
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            check_launcher(config)
        except ConfigError as err:
            # Hydra turns a callback's exception into a warning and goes on to launch.
            print(f"Error: {err}", file=sys.stderr, flush=True)
            raise SystemExit(1) from None
