"""The outputs of a comparison (evaluation/compare.py), one function per section: perplexity,
task accuracy, depth x length heatmaps, and loss by position at one length. Each writes its
CSV and PNG into ``out`` and returns its markdown.

One run per group: one line per run, the tables of the single-run scripts. Several seeds in a
group: mean ± the 95% Student-t interval, the best mean bold, ``*`` where Welch's test differs
from the best, p-values in the CSV, the intervals as bands in the plot.
"""

from __future__ import annotations

import csv
import math
import sys
from pathlib import Path
from typing import Sequence

from evaluation import tasks as task_eval
from evaluation.compare import (POSITION_FILE, Cell, Runs, find_result_files, heatmap_rows, label_rows, label_task_rows,
                                make_cells, newest_series, not_learned_marks, ppl_points, streaming_points, task_points)
from evaluation.extrapolation import markdown_table, plot_rows, write_csv
from evaluation.plots import length_axis

LEGEND = ("Mean over seeds ± half-width of the 95% confidence interval (Student t, n − 1 degrees of freedom); "
          "**bold**: best mean at that length; *: differs from the best by Welch's two-sided t-test, p < 0.05 "
          "(p in the CSV). One seed: no interval, no test.\n")
STAT_COLUMNS = ["scheme", "section", "train_length", "eval_length", "n", "seeds", "mean", "ci95", "sd", "best",
                "p_vs_best", "significant_vs_best", "status"]
TASK_CAPTION = "Exact-match accuracy (%) by evaluation length (tokens), mean over depths."


def perplexity(runs: Runs, out: Path) -> list[str]:
    """comparison.{csv,png}; one markdown section per mode."""
    if not runs.pairs:
        return []
    sections = []
    if not runs.multi_seed:
        rows = label_rows(runs.pairs, runs.groups)
        write_csv(rows, out / "comparison.csv")
        for mode in sorted({r.mode for r in rows}):
            mode_rows = [r for r in rows if r.mode == mode]
            strides = sorted({r.stride for r in mode_rows}) if mode == "sliding" else []
            title = f"### {mode}" + (f" (stride {', '.join(map(str, strides))})" if strides else "")
            sections.append(f"{title}\n\nPerplexity by evaluation length (tokens).\n\n{markdown_table(mode_rows)}")
        save(plot_rows(rows, series_by=("scheme", "mode") if len({r.mode for r in rows}) > 1 else ("scheme",),
                       title="Extrapolation: perplexity vs evaluation length"), out / "comparison.png")
        return sections
    cells = make_cells(ppl_points(runs), lower_is_better=True)
    write_stats_csv(cells, out / "comparison.csv", "mode")
    for mode in sorted({c.section for c in cells}):
        sections.append(f"### {mode}\n\nPerplexity by evaluation length (tokens).\n\n"
                        f"{stats_markdown(cells, mode, '{:.2f}')}\n{LEGEND}")
    means = [c.summary.mean for c in cells if c.values]
    save(plot_bands(cells, "perplexity", "Extrapolation: perplexity vs evaluation length",
                    log_y=bool(means) and max(means) > 3 * min(means)), out / "comparison.png")
    return sections


def streaming(runs: Runs, out: Path) -> list[str]:
    """comparison_streaming.csv; one markdown section per cache rule: StreamingLLM perplexity by
    position bucket (a column N holds the positions from the previous column's N up to N)."""
    if not runs.stream_pairs:
        return []
    cells = make_cells(streaming_points(runs), lower_is_better=True)
    write_stats_csv(cells, out / "comparison_streaming.csv", "cache")
    return [f"### streaming, {cache}\n\nPerplexity by position bucket: each column holds the positions from the "
            f"previous column's bound up to its own (docs/evaluation.md, section 7).\n\n"
            f"{stats_markdown(cells, cache, '{:.2f}')}\n{LEGEND}" for cache in sorted({c.section for c in cells})]


def task_accuracy(runs: Runs, out: Path) -> list[str]:
    """comparison_tasks.{csv,png}; one markdown section per task."""
    if not runs.task_pairs:
        return []
    if not runs.multi_seed:
        rows = label_task_rows(runs.task_pairs, runs.groups)
        task_eval.write_csv(rows, out / "comparison_tasks.csv")
        save(task_eval.plot_rows(task_eval.mean_over_depths(rows), title="Task accuracy vs evaluation length"),
             out / "comparison_tasks.png")
        return [f"### {task}\n\n{TASK_CAPTION}\n\n{single_seed_task_table(rows, task)}"
                for task in sorted({r.task for r in rows})]
    cells = make_cells(task_points(runs), lower_is_better=False)
    marks = not_learned_marks(runs)
    for c in cells:
        c.label += marks.get(c.label, "")
    write_stats_csv(cells, out / "comparison_tasks.csv", "task")
    save(plot_bands(cells, "exact-match accuracy (%)", "Task accuracy vs evaluation length"),
         out / "comparison_tasks.png")
    return [f"### {task}\n\n{TASK_CAPTION}\n\n{stats_markdown(cells, task, '{:.1f}')}\n{LEGEND}"
            for task in sorted({c.section for c in cells})]


def heatmaps(runs: Runs, out: Path) -> list[str]:
    """comparison_heatmap.{csv,png} (depth x length, mean over seeds); the note on runs that did
    not learn their task, when some did not."""
    if not runs.task_pairs:
        return []
    grid = heatmap_rows(runs)
    if grid:
        task_eval.write_heatmap_csv(grid, out / "comparison_heatmap.csv")
        save(task_eval.plot_heatmaps(grid, title="Exact match by depth and evaluation length (mean over seeds)"),
             out / "comparison_heatmap.png")
    return [task_eval.LEARNED_NOTE] if any(r.not_learned for _, r in runs.task_pairs) else []


def position_overlay(paths: Sequence[str], out: Path, length: int | None) -> list[str]:
    """comparison_position_loss.{csv,png}: every run's loss by position at one eval length (default
    the longest that every run has); no section without position files."""
    from evaluation import position_loss

    files = find_result_files(paths, POSITION_FILE)
    if not files:
        return []
    pairs = newest_series(files, position_loss.read_csv, lambda r: (r.scheme, r.mode, r.rope_scaling, r.positions))
    runs = {run for run, _ in pairs}
    common = set.intersection(*({r.eval_length for run2, r in pairs if run2 == run} for run in runs))
    length = length or (max(common) if common else None)
    rows = label_rows([(run, r) for run, r in pairs if r.eval_length == length])
    if not rows:
        print(f"[pelab] no loss-by-position rows at length {length} (have: "
              f"{sorted({r.eval_length for _, r in pairs})})", file=sys.stderr)
        return []
    position_loss.write_csv(rows, out / "comparison_position_loss.csv")
    train = sorted({r.train_length for r in rows})
    save(position_loss.plot_rows(rows, title=f"Loss by token position at eval length {length}",
                                 by=position_loss.curve_keys(rows, always=("scheme",))),
         out / "comparison_position_loss.png")
    return [f"### loss by token position\n\nEval length {length} (training length {', '.join(map(str, train))}): "
            f"comparison_position_loss.png / .csv, {len({r.scheme for r in rows})} line(s).\n"]


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


def write_stats_csv(cells: list[Cell], path: Path, section_name: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([section_name if c == "section" else c for c in STAT_COLUMNS])
        for c in cells:
            s = c.summary
            writer.writerow([c.label, c.section, c.train_length, c.eval_length, len(c.values),
                             " ".join(map(str, c.seeds)), s.mean if s else math.nan, s.half_width if s else math.nan,
                             s.sd if s else math.nan, c.best, c.p_vs_best, c.significant, c.status])


def single_seed_task_table(rows: list[task_eval.TaskRow], task: str) -> str:
    """One line per run: exact-match accuracy (%) averaged over depths."""
    merged = task_eval.mean_over_depths([r for r in rows if r.task == task])
    lengths = sorted({r.eval_length for r in merged})
    train = {r.train_length for r in merged}
    table: dict[str, dict[int, str]] = {}
    for r in merged:
        table.setdefault(task_eval.scheme_label(r), {})[r.eval_length] = task_eval._cell(r)
    header = "| scheme | " + " | ".join(f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 1)]
    lines += [f"| {label} | " + " | ".join(cells.get(n, "") for n in lengths) + " |" for label, cells in table.items()]
    return "\n".join(lines) + "\n"


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


def save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)
