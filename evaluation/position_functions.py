"""Plots of what a scheme learned about positions (at the end of training: pelab.probes.PositionFunctions).

T5 bucket biases, KERPLE and FIRE bias against distance per head, RoPE's learned frequency
factors: whatever the scheme returns from ``learned_functions`` (model/pe/base.py), so a
new scheme plugs in without a change here. Schemes with nothing learned produce nothing.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from torch import Tensor  # noqa: E402


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
