"""A sharded checkpoint directory (trainer=fsdp) as one checkpoint file: the weights and the run's
hyper-parameters, no optimizer state; what ``init_from`` and the scripts' ``ckpt=`` read.

    python scripts/consolidate.py ckpt=RUN/checkpoints/last.ckpt out=last-full.ckpt

The scripts and ``init_from=DIR`` also read the directory itself (its shards gathered on one
process); one file is easier to copy and share.
"""

from __future__ import annotations

import sys

from _cli import command_line
from _common import bad_value, checked_checkpoint, path_option, required


def main(argv: list[str]) -> int:
    cfg = command_line("consolidate", argv, __doc__)
    if cfg is None:
        return 0
    out = str(required(cfg, "out", "FILE"))
    path_option("output_file", "out", out, inputs={"ckpt": required(cfg, "ckpt", "DIR")})  # never into what it reads
    ckpt = checked_checkpoint(required(cfg, "ckpt", "DIR"))
    if not ckpt.is_dir():
        bad_value("ckpt", str(ckpt), "a sharded checkpoint directory (trainer=fsdp); a file is one checkpoint already")
    from pelab.checkpoint import CheckpointError, consolidate

    try:
        print(f"wrote {consolidate(ckpt, out)}")
    except CheckpointError as e:
        raise SystemExit(str(e)) from None
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
