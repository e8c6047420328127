"""Synthetic-task accuracy of a trained checkpoint against length (and passkey depth):
scripts/evaluate.py with the tasks probe alone, each given key (conf/scripts/eval_tasks.yaml) put
on the run's own ``eval.tasks``.

    python scripts/eval_tasks.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt
    python scripts/eval_tasks.py ckpt=... multipliers=1,2,4,8,16 depths=0,0.5,1 samples=200
    python scripts/eval_tasks.py ckpt=... lengths=300,1000 wandb=true
    python scripts/eval_tasks.py ckpt=... multipliers=1,2,4 rope_scaling=linear,ntk,yarn

The task, its options and the seed of the test samples come from the run's resolved config
(checkpoints/config.yaml); the run must have trained on data=synthetic. Results go to
RUN_DIR/tasks/eval-<ckpt>-<time>/ as tasks.csv, tasks.png, tasks.md and step.json (the checkpoint's
training step; earlier results are never overwritten) and, with wandb=true, to a W&B run in the
training run's group.
"""

from __future__ import annotations

import sys

from _cli import command_line, script
from _common import EVAL_PRECISIONS, choice, eval_lengths, given, integer, number, numbers, rope_scaling_options


def parse_options(cfg) -> dict:
    """The ``eval.tasks`` options given, each checked (one line naming the key) before the
    checkpoint is read."""
    from evaluation.sweep import POSITION_MODES

    options: dict = eval_lengths(cfg, "1,2,4,8")  # lengths given here replace the run's
    if given(cfg, "depths"):
        options["depths"] = numbers("depths", cfg.depths, lambda k, v: number(k, v, minimum=0, maximum=1),
                                    "numbers in [0, 1], e.g. 0,0.5,1")
    for key in ("samples", "tokens_per_batch", "q_chunk"):
        if given(cfg, key):
            options[key] = integer(key, cfg[key], minimum=1)
    for key, allowed in (("precision", EVAL_PRECISIONS), ("positions", POSITION_MODES)):
        if given(cfg, key):
            options[key] = choice(key, cfg[key], allowed)
    return options | rope_scaling_options(cfg)


def main(argv: list[str]) -> int:
    cfg = command_line("eval_tasks", argv, __doc__)
    return 0 if cfg is None else script("evaluate").probe_alone("tasks", cfg, parse_options(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
