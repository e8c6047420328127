"""Extrapolation perplexity of a trained checkpoint.

    python scripts/eval_extrapolation.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt
    python scripts/eval_extrapolation.py ckpt=... multipliers=1,2,4,8,16 mode=nonoverlapping,sliding stride=128
    python scripts/eval_extrapolation.py ckpt=... rope_scaling=linear,ntk,yarn
    torchrun --nproc_per_node=8 scripts/eval_extrapolation.py ckpt=...   # windows sharded over 8 GPUs

The data and training length come from the run's resolved config (checkpoints/config.yaml,
written by train.py). Results go to RUN_DIR/extrapolation/eval-<ckpt>-<time>/ as CSV, PNG and
markdown (earlier results are never overwritten) and, with wandb=true, to a W&B run in the
training run's group.
"""

from __future__ import annotations

import sys

from _common import (EVAL_PRECISIONS, ROPE_SCALING_HELP, checkpoint_arg, choice, device_arg, eval_lengths,
                     evaluate_checkpoint, flag, integer, is_null, load_run_config, parse_key_values,
                     rope_scaling_options, run_eval_block, split_list)

OPTIONS = {
    "ckpt": "path to a Lightning checkpoint written by train.py (required)",
    "multipliers": "eval lengths as multiples of the training length, e.g. 1,2,4,8,16",
    "lengths": "absolute eval lengths, e.g. 300,1000",
    "mode": "nonoverlapping and/or sliding, e.g. nonoverlapping,sliding",
    "stride": "sliding stride (default: half the eval length)",
    "max_tokens": "scored tokens per length (default: the run's setting; 'null' = all held-out text)",
    **ROPE_SCALING_HELP,
    "precision": "bf16-mixed, 16-mixed, 32-true or 32 (default: the run's trainer.precision); the results' title "
                 "says what ran",
    "positions": "sequential (0..T-1, default) or randomized (a pe.randomize_to model, positions drawn as in training)",
    "documents": "packed documents: none, positions, mask, both or train, or several, e.g. none,both "
                 "(default: as the run trained)",
    "device": "cpu, cuda or cuda:N (default: cuda when available)",
    "out": "output directory (default: RUN_DIR/extrapolation/eval-<ckpt>-<time>)",
    "wandb": "true to log the table and chart to W&B (offline when there are no credentials)",
}


def parse_options(args: dict[str, str]) -> dict:
    """The ExtrapolationConfig options given on the command line, each value checked (one line
    naming the option, before the checkpoint or any data is read)."""
    from evaluation.extrapolation import DOCUMENT_MODES, MODES, POSITION_MODES

    options: dict = eval_lengths(args, "1,2,4,8,16")  # lengths given here replace the run's
    if "mode" in args:
        options["modes"] = [choice("mode", m, MODES) for m in split_list(args["mode"])]
    for key, parse, allowed in (("stride", integer, "an integer >= 1, or null (half the eval length)"),
                                ("max_tokens", integer, "an integer >= 1, or null (all held-out text)")):
        if key in args:
            options[key] = None if is_null(args[key]) else parse(key, args[key], minimum=1, allowed=allowed)
    if "precision" in args:
        options["precision"] = choice("precision", args["precision"], EVAL_PRECISIONS)
    if "positions" in args:
        options["positions"] = choice("positions", args["positions"], POSITION_MODES)
    if "documents" in args:
        options["documents"] = [None if m.lower() in ("null", "train") else choice("documents", m, DOCUMENT_MODES)
                                for m in split_list(args["documents"])]
    return options | rope_scaling_options(args)


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    given = parse_options(args)
    device = device_arg(args.get("device"))
    log_wandb = flag("wandb", args.get("wandb", "false"))
    ckpt = checkpoint_arg(args, OPTIONS)

    from evaluation.extrapolation import ExtrapolationConfig
    from pelab.validate import check_stride

    cfg = load_run_config(ckpt, "which data and training length to use")
    options = {**run_eval_block(cfg, "extrapolation"), **given}
    try:
        config = ExtrapolationConfig.from_dict(options)
        check_stride(config, cfg.model.block_size, key="stride")
    except ValueError as e:  # one line naming the option, before any data is read
        raise SystemExit(str(e)) from None
    evaluate_checkpoint(ckpt, cfg, {"extrapolation": {**options, "enabled": True}}, device, args.get("out"), log_wandb)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
