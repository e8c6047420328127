"""Plots of what a scheme learned about positions, at the end of training.

T5 bucket biases, KERPLE and FIRE bias against distance per head, RoPE's learned frequency
factors: whatever the scheme returns from ``learned_functions`` (model/pe/base.py), so a
new scheme plugs in without a change here. Schemes with nothing learned produce nothing.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from lightning.pytorch.loggers import WandbLogger  # noqa: E402
from lightning.pytorch.utilities import rank_zero_warn  # noqa: E402
from torch import Tensor  # noqa: E402

from model.gpt import uncompiled  # noqa: E402


def plot_functions(curves: dict[str, tuple[Tensor, Tensor, str]], title: str, path: Path) -> Path:
    """One panel per function, one line per head (or curve); written to ``path`` (PNG)."""
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.6), squeeze=False)
    for ax, (name, (x, y, xlabel)) in zip(axes[0], curves.items()):
        for i, row in enumerate(y):
            ax.plot(x.numpy(), row.numpy(), label=f"head {i}" if len(y) > 1 else None, linewidth=1)
        ax.set_title(name)
        ax.set_xlabel(xlabel)
        if len(y) > 1:
            ax.legend(fontsize=6, ncol=2)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class PositionFunctions(L.Callback):
    """When training ends (rank zero): plot the scheme's learned position functions to
    ``{default_root_dir}/{output_subdir}/stepNNNNNN.png`` and W&B (``position/functions``)."""

    def __init__(self, output_subdir: str = "position_functions") -> None:
        self.output_subdir = output_subdir
        self.last_path: Path | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        from evaluation.end_of_training import sharded_parameters

        if sharded_parameters(trainer):  # the scheme's parameters are flattened shards here
            rank_zero_warn(f"position-function plots skipped under {type(trainer.strategy).__name__}: the weights "
                           f"are sharded; plot from the full checkpoint")
            return
        gpt = uncompiled(getattr(pl_module, "model", pl_module))
        curves = gpt.pe.learned_functions(gpt.config.block_size)
        if not curves:
            return
        step = trainer.global_step
        path = Path(trainer.default_root_dir or trainer.log_dir) / self.output_subdir / f"step{step:06d}.png"
        self.last_path = plot_functions(curves, f"pe={gpt.pe.name}, step {step}", path)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="position/functions", images=[str(path)], step=step)
