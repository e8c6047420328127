"""The outputs of a comparison (evaluation/compare.py): comparison.md, each compared table's
sections in ``Comparison.place`` order (each probe's own hook writes its CSV and PNG into
``out``), the W&B charts, and what those hooks share: the statistics table, its CSV and the
plot with interval bands.

One run per group: one line per run, the tables of the single-run scripts. Several seeds in a
group: mean ± the 95% Student-t interval, the best mean bold (each of a tie), ``*`` where Welch's
test differs from the best, p-values in the CSV, the intervals as bands in the plot.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Callable

from evaluation.compare import Cell, Runs
from evaluation.plots import length_axis
from evaluation.results import Logged

LEGEND = ("Mean over seeds ± half-width of the 95% confidence interval (Student t, n − 1 degrees of freedom); "
          "**bold**: best mean at that length (every tied group); *: differs from the best by Welch's two-sided "
          "t-test, p < 0.05 (p in the CSV). One seed: no interval, no test.\n")
STAT_COLUMNS = ["scheme", "section", "train_length", "eval_length", "n", "seeds", "mean", "ci95", "sd", "best",
                "p_vs_best", "significant_vs_best", "status"]


def report(runs: Runs, out: Path) -> list[str]:
    """comparison.md's sections: every compared table's, lowest ``place`` first (stable: registry order)."""
    tables = sorted(runs.tables, key=lambda t: t.comparison.place)
    return [section for t in tables for section in t.comparison.section(runs, t.pairs, out)]


def charts(runs: Runs, out: Path) -> dict[str, Logged]:
    """{W&B run name: what it logs} of every compared table that has charts."""
    return {name: logged for t in runs.tables if t.comparison.charts
            for name, logged in t.comparison.charts(runs, t.pairs, out).items()}


# --- tables ---------------------------------------------------------------------------------

def _format_cell(c: Cell, fmt: str) -> str:
    if not c.values:
        return "n/a" if c.status.startswith("not applicable") else "—"
    s = c.summary
    text = fmt.format(s.mean) + ("" if s.n == 1 else " ± " + fmt.format(s.half_width))
    if c.best:
        return f"**{text}**"
    return text + (" *" if c.significant else "")


def stats_markdown(cells: list[Cell], section: str, fmt: str) -> str:
    rows = [c for c in cells if c.section == section]
    lengths = sorted({c.eval_length for c in rows})
    train = {c.train_length for c in rows}
    table: dict[str, dict[int, Cell]] = {}
    for c in rows:
        table.setdefault(c.label, {})[c.eval_length] = c
    header = "| scheme (seeds) | " + " | ".join(f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 1)]
    for label, by_length in table.items():
        n = max(len(c.values) for c in by_length.values())
        lines.append(f"| {label} ({n}) | " + " | ".join(_format_cell(by_length[k], fmt) if k in by_length else ""
                                                       for k in lengths) + " |")
    return "\n".join(lines) + "\n"


def stats_sections(cells: list[Cell], fmt: str, heading: Callable[[str], str]) -> list[str]:
    """One markdown section per cell section (mode, task, ...): ``heading(section)``, the table, the legend."""
    return [f"{heading(section)}\n\n{stats_markdown(cells, section, fmt)}\n{LEGEND}"
            for section in sorted({c.section for c in cells})]


def write_stats_csv(cells: list[Cell], path: Path, section_name: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([section_name if c == "section" else c for c in STAT_COLUMNS])
        for c in cells:
            s = c.summary
            writer.writerow([c.label, c.section, c.train_length, c.eval_length, len(c.values),
                             " ".join(map(str, c.seeds)), s.mean if s else math.nan, s.half_width if s else math.nan,
                             s.sd if s else math.nan, c.best, c.p_vs_best, c.significant, c.status])


# --- plots ----------------------------------------------------------------------------------

def plot_bands(cells: list[Cell], ylabel: str, title: str, log_y: bool = False):
    """Mean against eval length (log-x), one line per (group, section), the 95% interval as a band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    sections = sorted({c.section for c in cells})
    series: dict[str, list[Cell]] = {}
    for c in cells:
        if c.values:
            series.setdefault(c.label + (f" {c.section}" if len(sections) > 1 else ""), []).append(c)
    for label, points in series.items():
        points.sort(key=lambda c: c.eval_length)
        xs = [c.eval_length for c in points]
        means = [c.summary.mean for c in points]
        half = [0.0 if math.isnan(c.summary.half_width) else c.summary.half_width for c in points]
        line, = ax.plot(xs, means, marker="o", label=label)
        ax.fill_between(xs, [m - h for m, h in zip(means, half)], [m + h for m, h in zip(means, half)],
                        color=line.get_color(), alpha=0.2, linewidth=0)
    length_axis(ax, [c.train_length for c in cells], note="; bands: 95% CI over seeds")
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save_figure(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
