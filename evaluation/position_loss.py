"""Loss by token position: where in a long window the NLL of an extrapolating model rises.

The extrapolation evaluation (evaluation/extrapolation.py) already computes one NLL per scored
target; ``PositionSums`` adds those same numbers per position in the window (no second
forward). Position ``p`` (0-based) is the input token whose successor is predicted, so the
prediction at ``p`` has seen ``p + 1`` tokens. In ``sliding`` mode only the last ``stride``
positions of each window are scored, so the curve starts at ``length - stride``.

Rows: the first ``2 L`` positions (``L`` the training length) one by one, then log-spaced
bins (``per_octave`` per doubling) up to the eval length. A bin's ``loss`` is the mean over
every target scored in it (sum of NLL / count, pooled over windows and, under DDP, ranks).
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

import numpy as np

from evaluation.compare import Runs, label_rows
from evaluation.compare_report import save_figure
from evaluation.plots import length_axis
from evaluation.probe import Comparison
from evaluation.results import LineSeries, Logged, table
from evaluation.sweep import read_rows, write_rows


class PositionSums:
    """Summed NLL and target counts per window position of one eval length."""

    def __init__(self, length: int) -> None:
        self.length = length
        self.sums = np.zeros(length, dtype=np.float64)
        self.counts = np.zeros(length, dtype=np.int64)

    def add(self, first: int, sums: np.ndarray, count_each: int) -> None:
        """Positions ``first..first+len(sums)-1`` received ``sums`` over ``count_each`` windows."""
        self.sums[first : first + len(sums)] += sums
        self.counts[first : first + len(sums)] += count_each


def position_bins(length: int, train_length: int, per_octave: int = 4) -> list[tuple[int, int]]:
    """[start, end) position ranges: singletons below ``min(2 L, length)``, then log-spaced
    (edges ``2 L · 2^(k / per_octave)`` rounded, duplicates dropped), the last ending at ``length``."""
    exact = min(2 * train_length, length)
    bins = [(p, p + 1) for p in range(exact)]
    k, start = 1, exact
    while start < length:
        end = min(length, max(start + 1, int(round(2 * train_length * 2 ** (k / per_octave)))))
        k += 1
        if end > start:
            bins.append((start, end))
            start = end
    return bins


@dataclass
class PositionLossRow:
    scheme: str
    rope_scaling: str
    positions: str  # the positions the model saw: sequential (0..T-1) or randomized
    train_length: int
    eval_length: int
    mode: str
    stride: int
    start: int  # first window position of the bin (0-based)
    end: int  # one past the last
    tokens: int  # targets scored in the bin
    loss: float  # mean NLL (nats) over them

    @property
    def x(self) -> float:
        """Plot abscissa: the bin's middle, 1-based (tokens seen by the prediction)."""
        return (self.start + 1 + self.end) / 2


def bin_rows(sums: PositionSums, head: dict, per_octave: int = 4) -> list[PositionLossRow]:
    """Rows of one eval length; ``head``: the other PositionLossRow fields (scheme ... stride)."""
    rows = []
    for start, end in position_bins(sums.length, head["train_length"], per_octave):
        n = int(sums.counts[start:end].sum())
        if n:  # sliding: the unscored head of the window has no rows
            rows.append(PositionLossRow(**head, start=start, end=end, tokens=n,
                                        loss=float(sums.sums[start:end].sum() / n)))
    return rows


def write_csv(rows: Sequence[PositionLossRow], path: Path) -> Path:
    return write_rows(rows, path, PositionLossRow)


def read_csv(path: Path) -> list[PositionLossRow]:
    return read_rows(path, PositionLossRow)


COLUMNS = [f.name for f in fields(PositionLossRow)]


def _curves(rows: Sequence[PositionLossRow], by: Sequence[str]) -> dict[str, list[PositionLossRow]]:
    curves: dict[str, list[PositionLossRow]] = {}
    for r in rows:
        curves.setdefault(" ".join(str(getattr(r, k)) for k in by), []).append(r)
    for points in curves.values():
        points.sort(key=lambda r: r.start)
    return curves


def curve_keys(rows: Sequence[PositionLossRow], always: Sequence[str] = ("eval_length",)) -> list[str]:
    """``always`` plus every other series field that takes more than one value in ``rows``."""
    extra = [k for k in ("scheme", "mode", "rope_scaling", "positions") if k not in always
             and len({getattr(r, k) for r in rows}) > 1]
    return [*always, *extra]


def smoothed(points: Sequence[PositionLossRow], per_octave: int = 8) -> tuple[list[float], list[float]]:
    """(x, mean NLL) of one curve pooled into ``per_octave`` log-spaced groups by x: a single
    position's mean over a few windows is too noisy to read (the CSV keeps the exact values)."""
    groups: dict[int, list[PositionLossRow]] = {}
    for r in points:
        groups.setdefault(math.floor(math.log2(r.x) * per_octave), []).append(r)
    xs, ys = [], []
    for _, members in sorted(groups.items()):
        n = sum(r.tokens for r in members)
        xs.append(sum(r.x * r.tokens for r in members) / n)
        ys.append(sum(r.loss * r.tokens for r in members) / n)
    return xs, ys


def plot_rows(rows: Sequence[PositionLossRow], title: str = "Loss by token position",
              by: Sequence[str] | None = None):
    """Mean NLL against window position (log-x, pooled by ``smoothed``), one curve per ``by``
    (default: eval length, plus mode / scaling / scheme where several); the training length is
    a dotted line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, points in _curves(rows, by or curve_keys(rows)).items():
        xs, ys = smoothed(points)
        ax.plot(xs, ys, label=label, linewidth=1.2)
    length_axis(ax, (r.train_length for r in rows), label="token position in the window")
    ax.set_ylabel("mean NLL (nats)")
    ax.set_title(title)
    if rows:
        ax.legend(fontsize=7, title=" ".join(by or curve_keys(rows)), title_fontsize=7)
    fig.tight_layout()
    return fig


def save_results(rows: Sequence[PositionLossRow], out_dir: Path, title: str) -> dict[str, Path]:
    """position_loss.csv + position_loss.png in ``out_dir``."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, out_dir / "position_loss.csv"), "png": out_dir / "position_loss.png"}
    fig = plot_rows(rows, title=title)
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths


def loggable(rows: Sequence[PositionLossRow], png: Path | None = None, prefix: str = "extrapolation") -> Logged:
    """A line chart of NLL against log2(position), one line per curve, the table and the PNG."""
    curves = _curves(rows, curve_keys(rows))
    logged = Logged(tables={f"{prefix}/position_loss_table": table(rows, COLUMNS)})
    if curves:
        logged.charts[f"{prefix}/position_loss"] = LineSeries(
            xs=[[math.log2(r.x) for r in points] for points in curves.values()],
            ys=[[r.loss for r in points] for points in curves.values()], keys=list(curves),
            title="mean NLL by token position", xname="log2(token position)")
    logged.add_image(f"{prefix}/position_loss_plot", png)
    return logged


# --- across runs: scripts/compare_runs.py ----------------------------------------------------

def comparison_sections(runs: Runs, pairs: list[tuple[str, PositionLossRow]], out: Path) -> list[str]:
    """comparison_position_loss.{csv,png}: every run's loss by position at one eval length (the
    ``position_length`` option, default the longest that every run has); its one section."""
    if not pairs:
        return []
    run_dirs = {run for run, _ in pairs}
    common = set.intersection(*({r.eval_length for other, r in pairs if other == run} for run in run_dirs))
    length = runs.options.get("position_length") or (max(common) if common else None)
    rows = label_rows([(run, r) for run, r in pairs if r.eval_length == length])
    if not rows:
        print(f"[pelab] no loss-by-position rows at length {length} (have: "
              f"{sorted({r.eval_length for _, r in pairs})})", file=sys.stderr)
        return []
    write_csv(rows, out / "comparison_position_loss.csv")
    train = sorted({r.train_length for r in rows})
    save_figure(plot_rows(rows, title=f"Loss by token position at eval length {length}",
                          by=curve_keys(rows, always=("scheme",))), out / "comparison_position_loss.png")
    return [f"### loss by token position\n\nEval length {length} (training length {', '.join(map(str, train))}): "
            f"comparison_position_loss.png / .csv, {len({r.scheme for r in rows})} line(s).\n"]


#: written beside extrapolation.csv (its probe's second table); runs are labelled, not grouped by seed
COMPARISON = Comparison("position_loss.csv", PositionLossRow,
                        series=lambda r: (r.scheme, r.mode, r.rope_scaling, r.positions),
                        section=comparison_sections, place=40, grouped=False)
