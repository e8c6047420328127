"""Where a run logs: the loggers of ``cfg.logger``, W&B going offline by itself when it cannot
reach a server, and Lightning's WandbLogger made unable to stop a training run."""

from __future__ import annotations

import argparse
import netrc
import os
import re
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Literal
from urllib.parse import urlparse

import hydra
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.loggers.logger import DummyExperiment
from omegaconf import DictConfig

from evaluation.results import Logged
from pelab.config import ConfigError
from pelab.redact import redact, redact_text


@contextmanager
def _redacted_argv() -> Iterator[None]:
    """W&B records ``sys.argv`` in the run's metadata: let it see the command line redacted."""
    saved = sys.argv[:]
    sys.argv[1:] = [redact_text(a) for a in saved[1:]]
    try:
        yield
    finally:
        sys.argv[:] = saved


class SafeWandbLogger(WandbLogger):
    """``WandbLogger`` for which W&B failing (unwritable offline directory, network gone, any
    exception from wandb) costs the W&B run, never the training run: the first error is
    reported once, on one line, and every later W&B call is a no-op. Hyperparameters are
    logged with secrets masked.

    ``log_model``: checkpoints of the ``ModelCheckpoint`` callback as W&B model artifacts, with
    aliases ``latest`` and ``best`` (its monitored metric): ``true`` when training ends, ``all``
    as each is written, ``false`` none. Offline, they wait in the offline run for ``wandb sync``."""

    def __init__(self, *args: Any, log_model: Literal["all"] | bool = False, offline: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(*args, log_model=log_model, offline=offline and not log_model, **kwargs)
        self._offline = offline  # Lightning refuses it with log_model, yet an offline run keeps artifacts for sync
        self.failure: str | None = None  # why W&B was switched off, once it was
        self._last_step: int | None = None
        self._said_sharded = False

    def run_safely(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)``, unless W&B already failed; an exception switches W&B off
        instead of propagating. For code that talks to the wandb run directly."""
        if self.failure is not None:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # noqa: BLE001 - whatever W&B raises, training goes on
            at = f" at step {self._last_step}" if self._last_step is not None else ""
            self.failure = f"W&B logging failed{at}: {type(err).__name__}: {err}"
            print(f"[pelab] {self.failure}; training continues, W&B logging disabled for this run",
                  file=sys.stderr, flush=True)
            return None

    @property
    def experiment(self) -> Any:
        if self.failure is None and self._experiment is None:
            def start() -> None:
                if self.save_dir:
                    Path(self.save_dir).mkdir(parents=True, exist_ok=True)
                super(SafeWandbLogger, self).experiment

            with _redacted_argv():
                self.run_safely(start)
        if self.failure is not None:
            return DummyExperiment()  # every attribute a no-op, as on ranks > 0
        return super().experiment

    def log_metrics(self, metrics: dict, step: int | None = None) -> None:
        if step is not None:
            self._last_step = step
        self.run_safely(super().log_metrics, metrics, step)

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(params, argparse.Namespace):
            params = vars(params)
        self.run_safely(super().log_hyperparams, redact(dict(params)), *args, **kwargs)

    def log_table(self, *args: Any, **kwargs: Any) -> None:
        self.run_safely(super().log_table, *args, **kwargs)

    def log_text(self, *args: Any, **kwargs: Any) -> None:
        self.run_safely(super().log_text, *args, **kwargs)

    def log_image(self, *args: Any, **kwargs: Any) -> None:
        self.run_safely(super().log_image, *args, **kwargs)

    def log_audio(self, *args: Any, **kwargs: Any) -> None:
        self.run_safely(super().log_audio, *args, **kwargs)

    def log_video(self, *args: Any, **kwargs: Any) -> None:
        self.run_safely(super().log_video, *args, **kwargs)

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self._say_if_sharded(checkpoint_callback)
        self.run_safely(super().after_save_checkpoint, checkpoint_callback)

    def finalize(self, status: str) -> None:
        self.run_safely(super().finalize, status)

    def _say_if_sharded(self, checkpoint_callback: Any) -> None:
        """Lightning logs only checkpoint files: a sharded checkpoint (a directory) is said once."""
        path = getattr(checkpoint_callback, "last_model_path", "") or ""
        if self._log_model and path and Path(path).is_dir() and not self._said_sharded:
            self._said_sharded = True
            print(f"[pelab] logger.wandb.log_model={self._log_model}: {path} is a sharded checkpoint (a directory) and "
                  f"is not logged as a W&B artifact; trainer.strategy.state_dict_type=full writes one file",
                  file=sys.stderr, flush=True)

    def finish(self, exit_code: int = 0) -> str | None:
        """Close the W&B run; one line saying where it went (offline: how to upload it)."""
        run = self._experiment
        if run is None:
            return None
        if self.failure is not None:
            try:  # best effort, so that the next job of a sweep starts its own run
                run.finish(exit_code=1, quiet=True)
            except Exception:  # noqa: BLE001
                pass
            return "[pelab] W&B run incomplete: logging stopped at the error reported above"

        def close() -> str:
            run_dir = Path(run.dir).parent
            offline = run.offline
            run.finish(exit_code=exit_code)
            if offline:
                return f"[pelab] W&B offline run: {run_dir}  (upload later: wandb sync {run_dir})"
            return f"[pelab] W&B run: {run.url}"

        return self.run_safely(close) or f"[pelab] {self.failure}"


def log_to_wandb(logged: Logged, run) -> None:
    """One probe's tables, line charts and images in one ``run.log``, then its summary scalars,
    then those measured at several lengths once more, one ``run.log`` per length (``by_length``)."""
    import wandb

    payload = {key: wandb.Table(columns=columns, data=data) for key, (columns, data) in logged.tables.items()}
    payload.update({key: wandb.plot.line_series(xs=c.xs, ys=c.ys, keys=c.keys, title=c.title, xname=c.xname)
                    for key, c in logged.charts.items()})
    payload.update({key: wandb.Image(str(path)) for key, path in logged.images.items()})
    run.log(payload)
    for key, value in logged.summary.items():
        run.summary[key] = value
    for prefix, rows in by_length(logged.summary).items():
        axis = f"{prefix}/length"
        run.define_metric(axis)
        for metric in sorted({name for row in rows.values() for name in row}):  # by name: Lightning's "*" glob
            run.define_metric(metric, step_metric=axis, summary="none")  # puts the rest on trainer/global_step
        for length in sorted(rows):
            run.log({axis: length, **rows[length]})


AT_LENGTH = re.compile(r"(?P<metric>(?P<prefix>[^/@]+)/[^@]+)@(?P<length>\d+)")


def by_length(summary: dict[str, Any]) -> dict[str, dict[int, dict[str, float]]]:
    """The scalars named ``{prefix}/.../{name}@{length}`` (``extrapolation/nonoverlapping/none/
    ppl@512``, ``tasks/passkey/accuracy@256``) as rows by length under each prefix, the metric
    named without ``@{length}``: one W&B log call per row puts length on the x-axis."""
    rows: dict[str, dict[int, dict[str, float]]] = {}
    for key, value in summary.items():
        match = AT_LENGTH.fullmatch(key)
        if match and isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.setdefault(match["prefix"], {}).setdefault(int(match["length"]), {})[match["metric"]] = value
    return rows


def log_results(loggers: list, logged: Logged, metrics: dict[str, float], step: int) -> None:
    """An evaluation's results to every logger: W&B runs get ``logged`` (tables, charts, PNGs;
    a W&B failure loses only W&B: the files on disk stand), the others the summary ``metrics``."""
    for logger in loggers:
        if isinstance(logger, SafeWandbLogger):
            logger.run_safely(log_to_wandb, logged, logger.experiment)
        elif isinstance(logger, WandbLogger):
            log_to_wandb(logged, logger.experiment)
        else:
            logger.log_metrics(metrics, step=step)


def wandb_reachable(timeout: float = 3.0) -> bool:
    url = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai"))
    try:
        with socket.create_connection((url.hostname, url.port or 443), timeout=timeout):
            return True
    except OSError:
        return False


def wandb_has_credentials() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def wandb_offline_reason() -> str | None:
    """Why a W&B run cannot go online from here (no credentials, no route), or None."""
    if not wandb_has_credentials():
        return "no W&B credentials (WANDB_API_KEY or `wandb login`)"
    if not wandb_reachable():
        return "W&B server unreachable"
    return None


def check_log_model(key: str, log_model: Any, trainer: dict) -> None:
    """Lightning logs checkpoint files only: with sharded checkpoints (directories) the artifacts
    would silently never appear, so the pair is refused."""
    strategy = trainer.get("strategy")
    if log_model and isinstance(strategy, dict) and strategy.get("state_dict_type") == "sharded":
        raise ConfigError(f"{key}={log_model!r} logs checkpoint files, but trainer.strategy.state_dict_type=sharded "
                          f"writes directories: set trainer.strategy.state_dict_type=full or {key}=false")


def build_loggers(cfg: DictConfig, identity, run_id: str | None = None) -> list:
    """The loggers of ``cfg.logger``; a W&B one named by ``identity`` (pelab/run.py RunIdentity)."""
    loggers = []
    for key, logger_cfg in (cfg.get("logger") or {}).items():
        if logger_cfg is None or "_target_" not in logger_cfg:
            continue
        extra = {}
        if issubclass(hydra.utils.get_class(logger_cfg._target_), WandbLogger):
            extra = {"name": identity.name, "group": identity.group, "tags": identity.tags}
            if run_id:  # same id after a restart: the W&B run continues (resume="allow": or starts)
                extra |= {"id": run_id, "resume": "allow"}
            mode = os.environ.get("WANDB_MODE", "")
            if mode not in ("offline", "disabled") and not logger_cfg.get("offline"):
                why = wandb_offline_reason()
                if why:
                    print(f"[pelab] {why}: logging to W&B in offline mode", flush=True)
                    extra["offline"] = True
            os.environ.setdefault("WANDB_SILENT", "true")
        loggers.append(hydra.utils.instantiate(logger_cfg, **extra))
    return loggers


def finish_loggers(loggers: list) -> list[str]:
    """Flush file loggers and close the W&B run, saying where each went."""
    lines = []
    for logger in loggers:
        if isinstance(logger, SafeWandbLogger):
            lines.append(logger.finish())
        elif isinstance(logger, WandbLogger):  # Lightning's own, if configured
            logger.experiment.finish()
        else:
            logger.save()  # flush what was logged after fit (extrapolation, unigram baseline)
            lines.append(f"[pelab] {type(logger).__name__}: {getattr(logger, 'log_dir', None) or logger.save_dir}")
    return [line for line in lines if line]


@contextmanager
def closed_on_failure(loggers: list) -> Iterator[None]:
    """A W&B run whose training failed is closed as failed, so that the next job of a sweep does
    not log into it."""
    try:
        yield
    except BaseException:
        for logger in loggers:
            if isinstance(logger, SafeWandbLogger):
                logger.finish(exit_code=1)
        raise
