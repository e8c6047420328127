"""What a probe hands a logger: plain data (tables as columns and rows, line charts as series,
image paths, summary scalars). The harness turns it into W&B objects (``pelab.loggers.
log_to_wandb``); nothing here imports a logger.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence


@dataclass
class LineSeries:
    """A line chart, one line per key. W&B line charts have no log-axis setting, so the probes
    give x as log2(length) or log2(position)."""

    xs: list  # x values shared by every line, or one list per line
    ys: list[list[float]]
    keys: list[str]
    title: str
    xname: str


@dataclass
class Logged:
    """One W&B log call: tables, charts and images under their keys, then summary scalars."""

    tables: dict[str, tuple[list[str], list[list]]] = field(default_factory=dict)
    charts: dict[str, LineSeries] = field(default_factory=dict)
    images: dict[str, Path] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def add_image(self, key: str, png: Path | str | None) -> None:
        """``png`` under ``key`` when it was written."""
        if png is not None and Path(png).exists():
            self.images[key] = Path(png)


def table(rows: Sequence, columns: Sequence[str]) -> tuple[list[str], list[list]]:
    """(columns, one list of values per row)."""
    return list(columns), [[getattr(r, c) for c in columns] for r in rows]


def log2_chart(series: dict[str, Sequence], x: str, y: str, title: str, xname: str) -> LineSeries:
    """One line per series (rows with fields ``x`` and ``y``) over every x any series has, on a
    log2 axis; a series without a point at some x is NaN there."""
    xs = sorted({getattr(r, x) for points in series.values() for r in points})
    ys = [[next((getattr(r, y) for r in points if getattr(r, x) == n), math.nan) for n in xs]
          for points in series.values()]
    return LineSeries(xs=[math.log2(n) for n in xs], ys=ys, keys=list(series), title=title, xname=xname)
