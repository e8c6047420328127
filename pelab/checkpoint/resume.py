"""Resuming a run: ``ckpt_path=`` checked against the run's config before any data or compute
(``check_resume``), and ``resume=auto``'s pick of the newest intact checkpoint of the run dir."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy

from pelab.checkpoint.compare import config_mismatches, describe, scheme_choice
from pelab.checkpoint.errors import CheckpointError
from pelab.checkpoint.read import verified
from pelab.checkpoint.sharded import META_FILE, sharded_complete
from pelab.checkpoint.tokenizer import check_tokenizer
from pelab.config import ConfigError, fail


def _strategy_name(cfg) -> str:
    strategy = cfg.trainer.get("strategy") if "trainer" in cfg else None
    return str(strategy.get("_target_") if hasattr(strategy, "get") else strategy)


def _loads_sharded(cfg) -> bool:
    """Whether the run's strategy resumes a sharded (torch.distributed.checkpoint) directory."""
    from hydra.utils import get_class

    try:
        return issubclass(get_class(_strategy_name(cfg)), LightningFSDPStrategy)
    except Exception:  # noqa: BLE001 - a strategy name ("ddp", "auto") or no trainer section
        return _strategy_name(cfg).startswith("fsdp")


def check_resume(ckpt_path, cfg) -> dict[str, Any]:
    """``train.py ckpt_path=...``: a usable checkpoint whose scheme and model match the run's config.

    Rope and ALiBi have no parameters, so without this a resume under another scheme would load
    "successfully" and silently train a different model.
    """
    from omegaconf import OmegaConf

    if Path(ckpt_path).is_dir() and not _loads_sharded(cfg):
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is a sharded checkpoint (a directory written by trainer=fsdp with "
            f"state_dict_type=sharded), which only trainer=fsdp resumes; this run's trainer.strategy is "
            f"{_strategy_name(cfg)}. Resume it with trainer=fsdp, or start from its weights with "
            f"init_from={ckpt_path} (a fresh optimizer)")
    ckpt = verified(ckpt_path, "ckpt_path")
    run = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("pe", "model")}
    diffs = config_mismatches(ckpt["hyper_parameters"], run)
    if diffs:
        fixes = " ".join(f"pe={scheme_choice(s)}" if k == "pe" else f"{k}={s}" for k, s, _ in diffs)
        raise CheckpointError(
            f"ckpt_path={ckpt_path} was trained with {', '.join(describe(k, s) for k, s, _ in diffs)}, "
            f"this run has {', '.join(describe(k, r) for k, _, r in diffs)}; "
            f"resume with {fixes} or start a new run")
    spec = OmegaConf.select(cfg, "data.tokenizer")
    if spec is not None:  # a changed tokenizer file: the old weights would train on other ids
        check_tokenizer(ckpt, f"ckpt_path={ckpt_path}", spec,
                        "restore the tokenizer file it was trained with, or start a new run")
    return ckpt


def resume_from_run_dir(cfg, output_dir: Path) -> bool:
    """``resume=auto``: set ``ckpt_path`` to the newest intact checkpoint of the run dir and say so
    (True), or start fresh when the dir has none (a first start and a restart are one command).
    A damaged newest checkpoint (truncated, a block corrupted in place, a half-written sharded
    directory) is skipped, saying why, for the next newest; when every one is damaged the run
    refuses to start rather than train from scratch over them."""
    resume = cfg.get("resume")
    if resume is None:
        return False
    if resume != "auto":
        fail("resume", resume, "null or auto")
    if cfg.ckpt_path:
        raise ConfigError(f"resume=auto and ckpt_path={cfg.ckpt_path} both given: resume=auto picks the newest "
                          f"checkpoint of the run dir itself; keep one of them")
    found = checkpoints_newest_first(output_dir)
    if not found:
        print(f"[pelab] resume=auto: no checkpoint in {output_dir}, starting fresh", flush=True)
        return False
    skipped = []
    for path in found:
        try:
            verified(path, "resume=auto")
        except CheckpointError as err:
            print(f"[pelab] resume=auto: skipping {path}: {str(err).removeprefix(f'resume=auto={path} ')}",
                  flush=True)
            skipped.append(path)
            continue
        cfg.ckpt_path = str(path)
        after = f" (the newer {', '.join(p.name for p in skipped)} skipped: see above)" if skipped else ""
        print(f"[pelab] resume=auto: continuing from {path}{after}", flush=True)
        return True
    raise CheckpointError(f"resume=auto: every checkpoint of {output_dir} is damaged "
                          f"({', '.join(str(p) for p in skipped)}; reasons above); refusing to start fresh over "
                          "them: move them away to start a new run there, or pass ckpt_path= to one you repaired")


def _written(path: Path) -> int:
    """When a checkpoint was completed: a sharded directory's meta.pt is written last."""
    return (path / META_FILE if path.is_dir() else path).stat().st_mtime_ns


def checkpoints_newest_first(run_dir) -> list[Path]:
    """The checkpoints of a run dir (``checkpoints/*.ckpt``, files or sharded directories, and the
    ``hpc_ckpt_*.ckpt`` Lightning writes on a SLURM requeue signal), newest first. A sharded
    directory whose save did not finish is left out (and said so): it can only be one that
    was written without ``FSDPStrategy``'s rename."""
    run_dir = Path(run_dir)
    found = []
    for p in [*run_dir.glob("checkpoints/*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")]:
        if p.is_dir() and sharded_complete(p):
            print(f"[pelab] resume=auto: ignoring {p}: {sharded_complete(p)}", flush=True)
        elif p.is_file() or p.is_dir():
            found.append(p)
    return sorted(found, key=_written, reverse=True)
