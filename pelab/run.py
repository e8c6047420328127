"""How a run is named and where it logs: run names and sweep subdirs from the overrides that
change what is trained, the W&B identity (name, group, tags), and the loggers built from
``cfg.logger`` with W&B going offline by itself when it cannot reach a server.
"""

from __future__ import annotations

import hashlib
import netrc
import os
import re
import socket
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from pelab.redact import looks_secret, redact_text

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


def build_loggers(cfg: DictConfig, identity: RunIdentity, run_id: str | None = None) -> list:
    from lightning.pytorch.loggers import WandbLogger

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
    from lightning.pytorch.loggers import WandbLogger

    from pelab.loggers import SafeWandbLogger

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
