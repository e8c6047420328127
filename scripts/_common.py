"""Helpers shared by the scripts: import path, key=value arguments, run configs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout is the application: model/, data/ are not installed
    sys.path.insert(0, str(ROOT))


def join_torchrun_group(device) -> bool:
    """Under ``torchrun`` (WORLD_SIZE > 1): join its process group (NCCL on CUDA, else gloo),
    one GPU per local rank, and return True; a plain ``python`` start returns False."""
    import atexit
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    import torch
    import torch.distributed as dist

    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    atexit.register(dist.destroy_process_group)  # the backend's threads stopped before exit (else it may abort)
    return True


def describe_options(allowed: dict[str, str]) -> str:
    return "\n".join(f"  {k:20s} {help}" for k, help in allowed.items())


def parse_key_values(argv: list[str], allowed: dict[str, str]) -> dict[str, str]:
    """``key=value`` arguments (Hydra style); unknown keys fail with the list of valid ones."""
    values = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {arg!r}; keys: {', '.join(allowed)}")
        if key not in allowed:
            raise SystemExit(f"unknown option {key!r}; valid options:\n{describe_options(allowed)}")
        values[key] = value
    return values


def checkpoint_arg(args: dict[str, str], allowed: dict[str, str]) -> Path:
    """The required ``ckpt=PATH``, checked to be a readable pelab checkpoint (not truncated, not a
    foreign file) before any data is read; load it with ``pelab.checkpoint.load_lit_gpt``."""
    if "ckpt" not in args:
        raise SystemExit(f"ckpt=PATH is required; options:\n{describe_options(allowed)}")
    from pelab.checkpoint import CheckpointError, read_checkpoint

    ckpt = Path(args["ckpt"])
    try:
        read_checkpoint(ckpt, key="ckpt")
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    return ckpt


def load_run_config(ckpt: Path, needed_for: str):
    """The resolved config train.py saved beside the checkpoint (``checkpoints/config.yaml``)."""
    from omegaconf import OmegaConf

    path = ckpt.parent / "config.yaml"
    if not path.is_file():
        raise SystemExit(f"{path} not found: the run's resolved config (written by train.py) tells {needed_for}")
    return OmegaConf.load(path)


def log_rows_to_new_wandb_run(rows, png: Path, out: Path, prefix: str, series_by=("mode", "rope_scaling"),
                              **init) -> None:
    """One W&B run holding an extrapolation table and chart; offline (and said so) when the
    server cannot be reached or there are no credentials, as train.py does."""
    import os

    import wandb

    from evaluation.extrapolation import log_to_wandb
    from pelab.loggers import wandb_offline_reason

    why = "WANDB_MODE=offline" if os.environ.get("WANDB_MODE") == "offline" else wandb_offline_reason()
    try:  # the results are already on disk: a W&B failure must not turn into a failed command
        run = wandb.init(dir=str(out), mode="offline" if why else "online", **init)
        log_to_wandb(rows, run, png=png, prefix=prefix, series_by=series_by)
        run.finish()
    except Exception as err:  # noqa: BLE001 - whatever W&B raises
        print(f"[pelab] W&B logging failed: {type(err).__name__}: {err}; the results are in {out}", file=sys.stderr)
        return
    print(f"[pelab] W&B offline run in {out / 'wandb'} ({why}; upload later with wandb sync)" if why
          else f"[pelab] W&B run: {run.url}")


def split_list(value: str) -> list[str]:
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]
