"""Synthetic-task accuracy of a trained checkpoint against length (and passkey depth).

    python scripts/eval_tasks.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt
    python scripts/eval_tasks.py ckpt=... multipliers=1,2,4,8,16 depths=0,0.5,1 samples=200
    python scripts/eval_tasks.py ckpt=... lengths=300,1000 wandb=true
    python scripts/eval_tasks.py ckpt=... multipliers=1,2,4 rope_scaling=linear,ntk,yarn

The task, its options and the seed of the test samples come from the run's resolved config
(checkpoints/config.yaml, written by train.py); the run must have trained on data=synthetic.
Results go to RUN_DIR/tasks/eval-<ckpt>-<time>/ as tasks.csv, tasks.png and tasks.md (earlier
results are never overwritten) and, with wandb=true, to a W&B run in the training run's group.
"""

from __future__ import annotations

import sys

from _common import (EVAL_PRECISIONS, ROPE_SCALING_HELP, checkpoint_arg, choice, device_arg, eval_lengths,
                     evaluate_checkpoint, flag, integer, load_run_config, number, numbers, parse_key_values,
                     rope_scaling_options, run_eval_block)

OPTIONS = {
    "ckpt": "path to a Lightning checkpoint written by train.py on data=synthetic (required)",
    "multipliers": "eval lengths as multiples of the training length, e.g. 1,2,4,8",
    "lengths": "absolute eval lengths, e.g. 300,1000",
    "depths": "passkey / niah key depths in [0, 1], e.g. 0,0.25,0.5,0.75,1",
    "samples": "samples per length (and depth), default 100",
    "seed": "seed of the test samples (default: the run's data.seed, the same for every scheme)",
    "tokens_per_batch": "tokens per forward pass (default 16384)",
    "q_chunk": "attention query chunk for long sequences (default 1024)",
    "precision": "bf16-mixed, 16-mixed, 32-true or 32 (default: the run's trainer.precision); the results' title "
                 "says what ran",
    "positions": "sequential (0..T-1, default) or randomized (a pe.randomize_to model, positions drawn as in training)",
    **ROPE_SCALING_HELP,
    "device": "cpu, cuda or cuda:N (default: cuda when available)",
    "out": "output directory (default: RUN_DIR/tasks/eval-<ckpt>-<time>)",
    "wandb": "true to log the table and chart to W&B (offline when there are no credentials)",
}
SYNTHETIC = "pelab.datamodule.SyntheticDataModule"


def parse_options(args: dict[str, str]) -> dict:
    """The TaskEvalConfig options given on the command line, each value checked (one line naming
    the option, before the checkpoint is read)."""
    from evaluation.sweep import POSITION_MODES

    options: dict = eval_lengths(args, "1,2,4,8")  # lengths given here replace the run's
    if "depths" in args:
        options["depths"] = numbers("depths", args["depths"], lambda k, v: number(k, v, minimum=0, maximum=1),
                                    "numbers in [0, 1], e.g. 0,0.5,1")
    for key in ("samples", "tokens_per_batch", "q_chunk"):
        if key in args:
            options[key] = integer(key, args[key], minimum=1)
    if "precision" in args:
        options["precision"] = choice("precision", args["precision"], EVAL_PRECISIONS)
    if "positions" in args:
        options["positions"] = choice("positions", args["positions"], POSITION_MODES)
    return options | rope_scaling_options(args)


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    given = parse_options(args)
    seed = integer("seed", args["seed"], minimum=0) if "seed" in args else None
    device = device_arg(args.get("device"))
    log_wandb = flag("wandb", args.get("wandb", "false"))
    ckpt = checkpoint_arg(args, OPTIONS)

    from evaluation.tasks import TaskEvalConfig
    from pelab.config import ConfigError
    from pelab.datamodule import build_datamodule, data_options

    cfg = load_run_config(ckpt, "which task, options and seed to use")
    if data_options(cfg.data).get("_target_") != SYNTHETIC:  # a run saved with an older spelling too
        raise SystemExit(f"ckpt={ckpt} was trained on data with _target_={cfg.data.get('_target_')}, not a "
                         f"synthetic task ({SYNTHETIC}); use scripts/eval_extrapolation.py for text")
    options = {**run_eval_block(cfg, "tasks"), **given}
    try:
        TaskEvalConfig.from_dict(options)
        build_datamodule(cfg.data)  # builds the task; reads nothing
    except (ConfigError, ValueError) as e:
        raise SystemExit(str(e)) from None
    evaluate_checkpoint(ckpt, cfg, {"tasks": {**options, "enabled": True}}, device, args.get("out"), log_wandb, seed)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
