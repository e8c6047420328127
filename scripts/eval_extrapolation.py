"""Extrapolation perplexity of a trained checkpoint: scripts/evaluate.py with the extrapolation
probe alone, its keys spelt short (conf/scripts/eval_extrapolation.yaml; ``mode`` is
``eval.extrapolation.modes``), each given key put on the run's own ``eval.extrapolation``.

    python scripts/eval_extrapolation.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt
    python scripts/eval_extrapolation.py ckpt=... multipliers=1,2,4,8,16 mode=nonoverlapping,sliding stride=128
    python scripts/eval_extrapolation.py ckpt=... rope_scaling=linear,ntk,yarn
    torchrun --nproc_per_node=8 scripts/eval_extrapolation.py ckpt=...   # windows sharded over 8 GPUs

Results go to RUN_DIR/extrapolation/eval-<ckpt>-<time>/ as CSV, PNG and markdown, with step.json
(the checkpoint's training step; earlier results are never overwritten) and, with wandb=true, to a
W&B run in the training run's group.
"""

from __future__ import annotations

import sys

from _cli import command_line, script
from _common import EVAL_PRECISIONS, choice, eval_lengths, given, integer, is_null, items, rope_scaling_options


def parse_options(cfg) -> dict:
    """The ``eval.extrapolation`` options given, each checked (one line naming the key) before the
    checkpoint or any data is read."""
    from evaluation.extrapolation import DOCUMENT_MODES, MODES, POSITION_MODES

    options: dict = eval_lengths(cfg, "1,2,4,8,16")  # lengths given here replace the run's
    if given(cfg, "mode"):
        options["modes"] = [choice("mode", m, MODES) for m in items(cfg.mode)]
    for key, everything in (("stride", "half the eval length"), ("max_tokens", "all held-out text")):
        if given(cfg, key):
            options[key] = None if is_null(cfg[key]) else integer(
                key, cfg[key], minimum=1, allowed=f"an integer >= 1, or null ({everything})")
    for key, allowed in (("precision", EVAL_PRECISIONS), ("positions", POSITION_MODES)):
        if given(cfg, key):
            options[key] = choice(key, cfg[key], allowed)
    if given(cfg, "documents"):  # null or "train": as the run trained ("none" is a mode)
        options["documents"] = [None if m in (None, "null", "train") else choice("documents", m, DOCUMENT_MODES)
                                for m in items(cfg.documents)]
    return options | rope_scaling_options(cfg)


def main(argv: list[str]) -> int:
    cfg = command_line("eval_extrapolation", argv, __doc__)
    return 0 if cfg is None else script("evaluate").probe_alone("extrapolation", cfg, parse_options(cfg))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
