"""Hydra callbacks (conf/hydra/default.yaml ``callbacks``): checks and clean-up around Hydra's
own steps that train.py cannot reach, because Hydra runs them before the task function."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra.errors import CompactHydraException
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from data.paths import PathError, folder_problem, output_folder
from pelab.config import ConfigError
from pelab.redact import redact_yaml_file

HOW_TO_MOVE = "choose a writable directory with hydra.run.dir=PATH (hydra.sweep.dir=PATH for -m sweeps)"


def check_writable_dir(path: Path) -> None:
    """``path`` is, or can be created as, a writable directory (data/paths.py's check of every
    output folder). Creates nothing."""
    problem = folder_problem(Path(path).absolute())
    if problem is None:
        return
    existing, what = problem
    if not existing.is_dir():
        raise ConfigError(f"output directory {path} cannot be created: {existing} is a file; {HOW_TO_MOVE}")
    raise ConfigError(f"output directory {path} is not writable ({existing} is {what}); {HOW_TO_MOVE}")


def check_output_folders(cfg: DictConfig) -> None:
    """The folders a run writes into, checked before any data is read: ``paths.output_dir`` (Hydra
    checked its run dir; this one may point elsewhere) and every callback's ``dirpath`` (the
    checkpoints: a save that cannot be written would fail after the compute)."""
    check_writable_dir(Path(cfg.paths.output_dir))
    for name, node in (cfg.get("callbacks") or {}).items():
        if node and node.get("dirpath"):
            try:
                output_folder(f"callbacks.{name}.dirpath", node.dirpath)
            except PathError as err:
                raise ConfigError(str(err)) from None


class PathFailure(CompactHydraException, ValueError):
    """A ``data.paths.PathError`` (a path option, or a write the filesystem refused) that reached
    the top of a job: Hydra prints it as its one line, as a ``ConfigError``."""


def _stop_unless_writable(path: Path) -> None:
    try:
        check_writable_dir(path)
    except ConfigError as err:
        # Hydra turns a callback's exception into a warning and goes on to create the dir.
        print(f"Error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None


def log_lightning_through_root() -> None:
    """Lightning's log lines through the root logger only, i.e. Hydra's console and train.log:
    Lightning's package logger has a console handler of its own and also propagates to the root,
    so under Hydra's logging each line would print twice."""
    import lightning  # noqa: F401 - importing it adds that handler

    if not logging.getLogger().handlers:  # hydra/job_logging=none: Lightning's own handler is the only one
        return
    package = logging.getLogger("lightning")
    for handler in list(package.handlers):
        if type(handler) is logging.StreamHandler:
            package.removeHandler(handler)


class PelabCallback(Callback):
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        _stop_unless_writable(Path(config.hydra.run.dir))  # before Hydra creates it

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        _stop_unless_writable(Path(config.hydra.sweep.dir))

    def on_job_start(self, config: DictConfig, **kwargs: Any) -> None:
        log_lightning_through_root()  # Hydra has configured the job's logging just before
        # Hydra has just saved the composed config and the command-line overrides: mask secrets.
        hc = config.hydra
        if hc.output_subdir is not None:
            for name in ("config.yaml", "hydra.yaml", "overrides.yaml"):
                redact_yaml_file(Path(hc.runtime.output_dir) / hc.output_subdir / name)
        if hc.mode == RunMode.MULTIRUN:
            redact_yaml_file(Path(hc.sweep.dir) / "multirun.yaml")

    def on_job_end(self, config: DictConfig, job_return: JobReturn, **kwargs: Any) -> None:
        # data/ and evaluation/ sit below Hydra and cannot raise its compact errors: their path
        # errors (a full disk under the token cache) reach the user as the one line they are
        error = job_return._return_value
        if job_return.status == JobStatus.FAILED and isinstance(error, PathError):
            job_return.return_value = PathFailure(str(error))
