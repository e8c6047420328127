"""Evaluate a checkpoint: the probes conf/eval enables, run as train.py runs them when it ends.

    python scripts/evaluate.py ckpt=RUN_DIR/checkpoints/last.ckpt
    python scripts/evaluate.py ckpt=... eval.extrapolation.multipliers=[1,2] eval.probe.enabled=false
    python scripts/evaluate.py ckpt=... eval.extrapolation.enabled=false eval.probe.enabled=true wandb=true
    torchrun --nproc_per_node=8 scripts/evaluate.py ckpt=...   # extrapolation windows sharded over 8 GPUs

Composes conf/scripts/evaluate.yaml (the training tree's conf/eval beside its own keys): the run's
own ``eval`` section (RUN_DIR/checkpoints/config.yaml) with the command line's ``eval.*``
overrides on top, checked by the rules train.py checks it with, before the checkpoint is read. Results go to
RUN_DIR/<probe>/eval-<ckpt>-<time>/ (or ``out=``): the files the end of training writes, with
``step.json`` (the checkpoint's training step, which scripts/compare_runs.py reads).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from _cli import as_override, command_line
from _common import (ROOT, bad_value, checked_checkpoint, device_arg, evaluate_checkpoint, load_run_config,
                     path_option, run_eval_block)


def main(argv: list[str]) -> int:
    cfg = command_line("evaluate", argv, __doc__)
    if cfg is not None:
        evaluate(cfg, argv)
    return 0


def evaluate(cfg: DictConfig, overrides: list[str]) -> dict:
    """Check every option, then read the checkpoint and run the enabled probes."""
    if OmegaConf.is_missing(cfg, "ckpt"):
        raise SystemExit("ckpt=PATH is required: a checkpoint written by train.py, e.g. "
                         "ckpt=RUN_DIR/checkpoints/last.ckpt")
    device = device_arg(cfg.device)
    if not isinstance(cfg.wandb, bool):
        bad_value("wandb", cfg.wandb, "true or false")
    if cfg.seed is not None and not (isinstance(cfg.seed, int) and not isinstance(cfg.seed, bool) and cfg.seed >= 0):
        bad_value("seed", cfg.seed, "an integer >= 0, or null (the run's data.seed)")
    if cfg.out is not None:  # a folder this user can write (data/paths.py), before the checkpoint is read
        path_option("output_folder", "out", cfg.out)
    ckpt = Path(str(cfg.ckpt))
    if not ckpt.is_file():
        raise SystemExit(f"ckpt={ckpt} is not a file: give a checkpoint written by train.py "
                         f"(RUN_DIR/checkpoints/last.ckpt)")
    run = load_run_config(ckpt, "which data, training length and evaluation options to use")
    options = eval_section(run, cfg, overrides)
    checked(run, options)
    checked_checkpoint(ckpt)  # readable, a pelab checkpoint
    return evaluate_checkpoint(ckpt, run, options, device, cfg.out, cfg.wandb, cfg.seed)


PASSED = ("ckpt", "device", "out", "wandb", "seed")  # the keys a translator shares with this script


def probe_alone(probe: str, cfg: DictConfig, options: dict) -> int:
    """What eval_extrapolation.py and eval_tasks.py run: this script with ``probe`` alone, ``options``
    (their keys, checked) on the run's ``eval.<probe>``, their other keys (ckpt, device, out, wandb,
    seed) as given. A message names the key the way the caller's command line spells it."""
    from evaluation.registry import PROBES

    overrides = [as_override(key, cfg[key]) for key in PASSED if key in cfg and not OmegaConf.is_missing(cfg, key)]
    overrides += [as_override(f"eval.{name}.enabled", name == probe) for name in PROBES]
    overrides += [as_override(f"eval.{probe}.{key}", value) for key, value in options.items()]
    try:
        return main(overrides)
    except SystemExit as e:
        if not isinstance(e.code, str):
            raise
        theirs = "|".join(key for key in cfg if key not in PASSED)
        raise SystemExit(re.sub(rf"\beval\.{probe}\.({theirs})\b", r"\1", str(e.code))) from None


def eval_section(run: DictConfig, cfg: DictConfig, overrides: list[str]) -> dict:
    """The run's ``eval`` section (conf/eval/default.yaml's blocks where it has none) with the
    ``eval.*`` overrides on top, values as Hydra parsed them; each probe's ``enabled`` is conf/eval's
    (with the overrides), whatever the training ran. A shared key (``eval.sweep.q_chunk``,
    ``eval.positions`` ...) reaches every key that reads it in conf/eval/default.yaml, as when
    training; a key set on the command line itself wins."""
    section = OmegaConf.to_container(run.get("eval") or {}, resolve=True)
    defaults = OmegaConf.load(ROOT / "conf" / "eval" / "default.yaml")
    for name in defaults:
        if OmegaConf.is_dict(defaults[name]):
            section[name] = run_eval_block(run, name)
            if "enabled" in defaults[name]:  # what runs is conf/eval's choice, not whether training ran it
                section[name]["enabled"] = given(cfg, f"eval.{name}.enabled")
    keys = []
    for override in overrides:
        key = override.partition("=")[0]
        if key.startswith("~eval"):
            raise SystemExit(f"{override}: deleting an eval key is not supported; set eval.<probe>.enabled=false")
        key = key.lstrip("+")
        if key.startswith("eval."):
            keys.append(key)
    readers = interpolated_by(defaults)
    for key in keys:  # shared keys first, so that a key given itself wins
        for reader in readers_of(key, readers):
            if reader not in keys:
                put(section, reader, given(cfg, key))
    for key in keys:
        put(section, key, given(cfg, key))
    return section


def given(cfg: DictConfig, key: str):
    """The value Hydra parsed for ``key``, as plain data."""
    value = OmegaConf.select(cfg, key)
    return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value


def interpolated_by(defaults: DictConfig) -> dict[str, list[str]]:
    """{"eval.sweep.q_chunk": ["eval.extrapolation.q_chunk", ...]}: the keys of conf/eval/default.yaml
    whose value is exactly ``${...}`` of another key."""
    out: dict[str, list[str]] = {}

    def walk(node, prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}.{key}")
            elif isinstance(value, str) and value.startswith("${") and value.endswith("}") and ":" not in value:
                out.setdefault(value[2:-1], []).append(f"{prefix}.{key}")

    walk(OmegaConf.to_container(defaults, resolve=False), "eval")
    return out


def readers_of(key: str, readers: dict[str, list[str]]) -> list[str]:
    """Every key that reads ``key``, directly or through another."""
    found = []
    for reader in readers.get(key, []):
        found += [reader, *readers_of(reader, readers)]
    return found


def put(section: dict, key: str, value) -> None:
    *parents, last = key.split(".")[1:]
    node = section
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = value


def checked(run: DictConfig, options: dict) -> None:
    """The run's config with this ``eval`` section, through train.py's evaluation checks
    (pelab/validate.py check_evaluation: which probes run, their options); one line on failure."""
    from pelab.config import ConfigError
    from pelab.datamodule import build_datamodule
    from pelab.validate import check_evaluation

    cfg = OmegaConf.merge(run, {"eval": options})
    try:
        check_evaluation(cfg, build_datamodule(run.data))  # builds the data module; reads nothing
    except (ConfigError, ValueError) as err:
        raise SystemExit(str(err)) from None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
