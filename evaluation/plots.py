"""What every plot against length shares: a log2 length axis with the training length dotted."""

from __future__ import annotations

from typing import Iterable


def length_axis(ax, train_lengths: Iterable[int], label: str = "evaluation length (tokens)", note: str = "") -> None:
    """Log2 x axis labelled ``label``, a dotted grey line at each training length, a light grid;
    ``note`` is appended to the axis label (e.g. what bands mean)."""
    for train_length in sorted(set(train_lengths)):
        ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_xlabel(f"{label}; dotted: training length{note}")
    ax.grid(True, which="both", alpha=0.3)
