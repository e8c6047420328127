"""A run's name and what it leaves in its run dir: run names and sweep subdirs from the
overrides that change what is trained, the W&B identity (name, group, tags), the lock that keeps
a second run out of a run dir in use, the resolved config beside the checkpoints, the W&B run id
a restart continues, the end-of-run summary.
"""

from __future__ import annotations

import hashlib
import math
import os
import re
import socket
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf, open_dict

from pelab.redact import looks_secret, redact, redact_text

# Overrides that do not change what is trained stay out of run names and sweep subdirs: an
# exact key, or a whole group given with its dot ("logger."). Never a bare prefix: "pe" is
# the scheme choice only (it leads the name), "pe.base=100" does change the model.
NOT_IN_NAME = (
    "pe", "logger", "logger.", "hydra.", "paths.", "callbacks", "callbacks.", "eval", "eval.",
    "trainer.accelerator", "trainer.devices", "trainer.num_nodes", "trainer.strategy",
    "trainer.enable_progress_bar", "trainer.enable_model_summary", "trainer.enable_checkpointing",
    "trainer.log_every_n_steps", "trainer.val_check_interval", "trainer.limit_val_batches",
    "trainer.num_sanity_val_steps", "data.num_workers", "data.data_dir", "data.tokenize_num_proc",
    "data.val_batch_size", "ckpt_path", "resume", "compile", "run_name", "group", "tags", "project",
)
NAME_LIMIT = 128


def name_overrides(overrides) -> list[str]:
    """The command-line overrides that change what is trained, as typed (never a secret)."""
    groups = tuple(k for k in NOT_IN_NAME if k.endswith("."))
    kept = []
    for override in overrides:
        key = override.split("=", 1)[0].lstrip("+~")
        if key not in NOT_IN_NAME and not key.startswith(groups) and not looks_secret(key):
            kept.append(redact_text(override))
    return kept


def _bounded(text: str) -> str:
    """At most NAME_LIMIT characters; a longer text is cut and keeps a hash of the whole, so
    runs differing only past the cut still get different names."""
    if len(text) <= NAME_LIMIT:
        return text
    return f"{text[:NAME_LIMIT - 9]}-{hashlib.sha1(text.encode()).hexdigest()[:8]}"  # "-": valid in a dir override


def run_slug(scheme: str, overrides) -> str:
    """The run name as a sweep subdir: one path component that is also a plain Hydra override
    value (Lightning's DDP launcher passes it back as hydra.run.dir=DIR), so '=' -> '_',
    ',' between overrides -> '+', anything else outside [A-Za-z0-9._+-] -> '_'.
    Used by conf/hydra/default.yaml as ${pelab.run_slug:SCHEME,${hydra.overrides.task}}."""
    items = [re.sub(r"[^A-Za-z0-9._+-]", "_", o) for o in name_overrides(overrides)]
    return _bounded("-".join([scheme, "+".join(items)]).rstrip("-"))


OmegaConf.register_new_resolver("pelab.run_slug", run_slug, replace=True)


@dataclass
class RunIdentity:
    """How a run shows up on W&B: one group per sweep/experiment, one named run per scheme."""

    name: str
    group: str | None
    tags: list[str]
    choices: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"run_name": self.name, "group": self.group, "tags": self.tags, "choices": self.choices}


def describe_run(cfg: DictConfig) -> RunIdentity:
    choices: dict[str, str] = {}
    overrides: list[str] = []
    sweep = None
    if HydraConfig.initialized():
        hc = HydraConfig.get()
        choices = {k: str(v) for k, v in hc.runtime.choices.items() if v is not None and not k.startswith("hydra")}
        overrides = name_overrides(hc.overrides.task)
        if hc.mode == RunMode.MULTIRUN:
            sweep = "_".join(Path(hc.sweep.dir).parts[-2:])  # DATE_TIME of the default sweep dir
    scheme = choices.get("pe") or cfg.pe._target_.rsplit(".", 1)[-1]
    name = cfg.run_name or _bounded("-".join([scheme, ",".join(overrides)]).rstrip("-"))
    group = cfg.group or (f"{choices.get('experiment') or 'sweep'}-{sweep}" if sweep else None)
    tags = [f"pe:{scheme}"] + [f"{k}:{choices[k]}" for k in ("model", "data") if k in choices]
    tags += [t for t in cfg.tags if t not in tags]
    return RunIdentity(name=name, group=group, tags=tags, choices={"pe": scheme, **choices})


def name_run(cfg: DictConfig) -> RunIdentity:
    """``describe_run``, also recorded in ``cfg`` so that the saved config says how the run
    appears on W&B."""
    identity = describe_run(cfg)
    with open_dict(cfg):
        cfg.run_name, cfg.group, cfg.tags = identity.name, identity.group, identity.tags
    return identity


RUN_ID_FILE = "wandb_run_id.txt"


def wandb_run_id(output_dir: Path, resuming: bool) -> str:
    """The W&B run id of this run dir: the stored one when resuming (a restart after preemption
    continues the same W&B run, offline too), else a new one (``save_run_id`` stores it once
    the run is sure to start)."""
    path = Path(output_dir) / RUN_ID_FILE
    if resuming and path.is_file():
        return path.read_text().strip()
    import secrets
    import string

    return "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))  # W&B's id form


def save_run_id(output_dir: Path, run_id: str) -> None:
    path = Path(output_dir) / RUN_ID_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    tmp.write_text(run_id + "\n")
    os.replace(tmp, path)


LOCK_FILE = ".pelab.lock"  # in the run dir; held (flock) for as long as the run's process lives
OWNER_FILE = ".pelab.lock.owner"  # who holds it: filelock truncates the lock file itself on every try
_HELD: dict[str, object] = {}  # run dir -> this process's lock on it


def lock_run_dir(output_dir: Path) -> None:
    """Hold the run dir for this process (rank zero of a run), or refuse naming the process that
    holds it. Two runs in one dir (``resume=auto`` started twice, a job and its requeued copy)
    would write over each other's checkpoints and delete each other's temporary files. The
    lock (``filelock``, an OS lock on ``.pelab.lock``) goes with the process: a run that crashed
    or was killed leaves nothing to clean up. Held until the process exits."""
    from filelock import FileLock, Timeout

    from pelab.config import ConfigError

    output_dir = Path(output_dir).resolve()
    if str(output_dir) in _HELD:
        return
    output_dir.mkdir(parents=True, exist_ok=True)
    lock = FileLock(output_dir / LOCK_FILE, timeout=0)
    try:
        lock.acquire()
    except (NotImplementedError, PermissionError) as err:  # a filesystem without flock (filelock 3), read-only
        print(f"[pelab] run dir {output_dir} cannot be locked ({type(err).__name__}: {err}): a second run started "
              "in it would not be stopped", flush=True)
        return
    except Timeout:
        try:
            owner = (output_dir / OWNER_FILE).read_text().strip() or "another process"
        except OSError:
            owner = "another process"
        raise ConfigError(f"run dir {output_dir} is in use by another run ({owner}): two runs in one directory "
                          "write over each other's checkpoints; wait for it to end, stop it, or start this one "
                          "with another hydra.run.dir") from None
    tmp = output_dir / f"{OWNER_FILE}.partial"
    tmp.write_text(f"pid {os.getpid()} on host {socket.gethostname()}, since "
                   f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    os.replace(tmp, output_dir / OWNER_FILE)
    _HELD[str(output_dir)] = lock


def save_run(cfg: DictConfig, trainer, output_dir: Path, run_id: str, loggers: list, identity: RunIdentity) -> None:
    """The run dir held for this run (``lock_run_dir``); the resolved config, secrets masked, into
    the checkpoint dir (before the first checkpoint: the scripts read it there) and to every
    logger; the W&B run id for a restart."""
    # ModelCheckpoint warns about a non-empty dir: config.yaml is there on purpose.
    warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
    resolved = redact(OmegaConf.to_container(cfg, resolve=True))
    if trainer.is_global_zero:
        lock_run_dir(output_dir)  # before anything of this run is written beside the checkpoints
        ckpt_dir = Path(output_dir) / "checkpoints"
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(resolved), ckpt_dir / "config.yaml")
        save_run_id(output_dir, run_id)
    for logger in loggers:
        logger.log_hyperparams({"config": resolved, **identity.as_dict()})


def emulated_bf16_notice(trainer) -> str | None:
    """One line when a bf16 run trains on a CPU without native bf16 matmuls (AVX2 only: oneDNN
    emulates them, several times slower than float32), naming the faster setting; else None."""
    import torch

    if not str(trainer.precision).startswith("bf16") or trainer.strategy.root_device.type != "cpu":
        return None
    native = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)
    if native is None or native():
        return None
    return (f"[pelab] note: trainer.precision={trainer.precision} on a CPU without native bf16 "
            f"({torch.backends.cpu.get_cpu_capability()}): its matmuls are emulated, several times slower than "
            f"float32; trainer.precision=32-true trains faster on this machine")


def summary(trainer, identity: RunIdentity, output_dir: Path, loggers: list) -> float | None:
    """Close the loggers and print (rank zero) where everything went; the final val/loss."""
    from pelab.loggers import finish_loggers  # imports Lightning: this module is loaded before Hydra starts

    metrics = trainer.callback_metrics
    val_loss = float(metrics["val/loss"]) if "val/loss" in metrics else None
    if not trainer.is_global_zero:
        return val_loss
    lines = [f"[pelab] run {identity.name!r} finished at step {trainer.global_step}"]
    if val_loss is not None:
        line = f"[pelab] val loss {val_loss:.4f} (ppl {math.exp(val_loss):.2f})"
        if "val/unigram_loss" in metrics:  # pelab/probes.py EndOfTrainingEvaluation
            baseline = float(metrics["val/unigram_loss"])
            line += f"; unigram baseline {baseline:.4f} (ppl {math.exp(baseline):.2f})"
        lines.append(line)
    lines.append(f"[pelab] outputs: {Path(output_dir).resolve()}")
    ckpt = trainer.checkpoint_callback
    if ckpt is not None and ckpt.last_model_path:
        lines.append(f"[pelab] checkpoints: {Path(ckpt.dirpath).resolve()} (+ resolved config.yaml)")
    lines += finish_loggers(loggers)
    print("\n".join(lines), flush=True)
    return val_loss
