"""Export a trained checkpoint to a Hugging Face transformers folder (docs/export.md).

    python scripts/export_hf.py ckpt=outputs/DATE/TIME/checkpoints/last.ckpt out=hf/my-model [overwrite=true]

The folder loads with ``AutoModelForCausalLM.from_pretrained(out)`` and ``AutoTokenizer``:
pe=learned as GPT-2, pe=rope as GPT-NeoX, or as Llama with the Llama block (model.norm=rmsnorm,
model.mlp=swiglu), computing the same logits as pelab; ``train.py init_from=hf:OUT`` starts a run
from it. Every other scheme or option is written as remote code (modeling_pelab.py beside the
weights: ``from_pretrained(out, trust_remote_code=True)``), with a note saying why no native class
holds it; what that cannot compute either is refused in one line before anything is written.
"""

from __future__ import annotations

import sys
from pathlib import Path

from _cli import command_line
from _common import checked_checkpoint, flag, required


def main(argv: list[str]) -> int:
    cfg = command_line("export_hf", argv, __doc__)
    if cfg is None:
        return 0
    overwrite = flag("overwrite", cfg.overwrite)
    out = str(required(cfg, "out", "DIR"))
    from data.paths import PathError, disk_full, no_space, output_folder
    from pelab.export import ExportError, check_out, export_hf

    ckpt = str(required(cfg, "ckpt", "PATH"))
    try:
        check_out(out, overwrite, source=ckpt)  # before the checkpoint is read: never its own folder
        output_folder("out", out, beside=True)  # written beside out, then renamed: its folder must be writable
        ckpt = checked_checkpoint(ckpt)
        exported = export_hf(ckpt, out, overwrite=overwrite)
    except (ExportError, PathError) as e:
        raise SystemExit(str(e)) from None
    except Exception as e:  # the export's temp folder is gone already; a previous out is untouched
        if not disk_full(e):
            raise
        raise SystemExit(str(no_space(Path(out).absolute().parent, f"exporting to {out}", "out="))) from None
    for note in exported.notes:
        print(f"[pelab] {note}", file=sys.stderr)
    print(f"wrote {exported.path} ({exported.architecture})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
