"""Collect the results of many runs into one table and one plot: perplexity vs length
(``extrapolation.csv``) and synthetic-task accuracy vs length (``tasks.csv``).

    python scripts/compare_runs.py multirun/2026-11-21/12-00-00
    python scripts/compare_runs.py 'outputs/*/*' --mode sliding --out comparison/
    python scripts/compare_runs.py multirun/DATE/TIME --wandb      # also log to W&B, in the sweep's group

Every ``extrapolation.csv`` and ``tasks.csv`` under the given directories (or the CSV files
given) is read. When a run holds several (the one written at the end of training and later
scripts/eval_extrapolation.py or eval_tasks.py results), rows of the newer file win, a series
at a time. Lines are named by scheme (+ RoPE scaling).

**Seeds.** Runs whose resolved configs (``checkpoints/config.yaml``) differ only in ``seed``
and in settings that do not change what is trained (paths, loggers, callbacks, evaluation
options: what run names leave out) are one group: its lines show the mean over the
seeds ± the 95% Student-t interval (n − 1 degrees of freedom), the best mean at each length
is bold, and ``*`` marks a group whose values differ from the best group's at that length by
Welch's two-sided t-test at α = 0.05 (p-values in the CSV); the plot draws the intervals as
bands. With one run per group (or no config.yaml) the output is one line per run; two runs of
one scheme are named by the settings that differ (else by run directory). Task accuracy is the
exact-match accuracy of a run averaged over its passkey depths.

Writes comparison.{csv,md,png} (perplexity; markdown with every section) and, when there are
task results, comparison_tasks.{csv,png}. Loss by token position (``position_loss.csv``) of
every run at one eval length (``--position-length``, default the longest every run has) is
overlaid in comparison_position_loss.{csv,png}.
"""

from __future__ import annotations

import argparse
import csv
import glob
import math
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from _common import log_to_new_wandb_run

from evaluation.extrapolation import ExtrapolationRow, loggable, markdown_table, plot_rows, read_csv, write_csv
from evaluation import tasks as task_eval
from evaluation.stats import ALPHA, mean_ci, welch_test

RESULT_FILES = {"extrapolation": "extrapolation.csv", "tasks": "tasks.csv"}
POSITION_FILE = "position_loss.csv"  # written beside extrapolation.csv
ORDER = {"learned": 0, "sinusoidal": 1, "rope": 2, "alibi": 3, "xpos": 4, "rope_alibi": 5}


def find_result_files(patterns: list[str], name: str = "extrapolation.csv") -> list[Path]:
    files: set[Path] = set()
    for pattern in patterns:
        matches = [Path(p) for p in glob.glob(pattern)] or [Path(pattern)]
        for path in matches:
            if path.is_file() and path.name == name:
                files.add(path.resolve())
            elif (path.is_file() and path.suffix == ".csv" and name == "extrapolation.csv"
                  and path.name not in ("tasks.csv", POSITION_FILE)):
                files.add(path.resolve())  # any other CSV given by name is read as an extrapolation table
            elif path.is_dir():
                files.update(p.resolve() for p in path.rglob(name))
    return sorted(files)


def check_table(path: Path, row_type: type) -> None:
    """``path`` has the columns of a ``row_type`` table (the CSV that train.py and scripts/eval_*.py
    write), else one line saying what it is and what this script reads, before anything is read."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    needed = [f.name for f in fields(row_type) if f.default is MISSING and f.default_factory is MISSING]
    missing = [c for c in needed if c not in header]
    if not missing:
        return
    what = " (a Lightning CSVLogger metrics file)" if {"step", "epoch"} <= set(header) else ""
    run = path.parent.parent if path.parent.name == "csv" else None  # logger=csv writes RUN/csv/metrics.csv
    raise SystemExit(f"{path} is not a results table{what}: its columns are {', '.join(header) or '(none)'}, and "
                     f"{RESULT_FILES['tasks' if row_type is task_eval.TaskRow else 'extrapolation']} needs "
                     f"{', '.join(needed)}; give the run or sweep directory" + (f" ({run})" if run else "")
                     + " or the extrapolation.csv / tasks.csv written by train.py and scripts/eval_*.py")


def run_dir_of(csv_path: Path) -> Path:
    """The run directory: the parent of the ``extrapolation`` (or ``tasks``) folder the CSV lives in."""
    for parent in csv_path.parents:
        if parent.name in RESULT_FILES:
            return parent.parent
    return csv_path.parent


def newest_series(files: list[Path], read: Callable, series: Callable) -> list[tuple[str, object]]:
    """(run dir, row) pairs. A series of a run comes whole from the newest file that has it, so
    points measured with different settings are never mixed in one line."""
    newest: dict[tuple, tuple[float, Path]] = {}
    rows_of: dict[Path, list] = {}
    for path in files:
        rows_of[path] = read(path)
        mtime = path.stat().st_mtime
        for row in rows_of[path]:
            key = (str(run_dir_of(path)), series(row))
            if key not in newest or newest[key][0] < mtime:
                newest[key] = (mtime, path)
    return [(run, r) for (run, key), (_, path) in newest.items() for r in rows_of[path] if series(r) == key]


def collect(files: list[Path]) -> list[tuple[str, ExtrapolationRow]]:
    return newest_series(files, read_csv, lambda r: (r.scheme, r.mode, r.rope_scaling))


def collect_tasks(files: list[Path]) -> list[tuple[str, task_eval.TaskRow]]:
    return newest_series(files, task_eval.read_csv, lambda r: (r.task, r.scheme))


def base_label(row) -> str:
    scaling = getattr(row, "rope_scaling", "none")
    label = row.scheme if scaling == "none" else f"{row.scheme}+{scaling}"
    documents = getattr(row, "documents", "none")  # packed documents read by the evaluation
    return label if documents == "none" else f"{label} documents={documents}"


def _order(label: str) -> tuple:
    return ORDER.get(label.split("+")[0].split(" ")[0], 99), label


def label_rows(pairs: list[tuple[str, ExtrapolationRow]], groups: dict | None = None) -> list[ExtrapolationRow]:
    """Rows whose ``scheme`` field becomes the line label: scheme [+ scaling] [+ what differs]. Runs
    of one scheme are told apart by their group's label (the settings that differ, ``seed_groups``)
    when ``groups`` has one, else by run directory."""
    runs_per_scheme: dict[str, set[str]] = {}
    for run, row in pairs:
        runs_per_scheme.setdefault(row.scheme, set()).add(run)
    labelled = []
    for run, row in pairs:
        label = base_label(row)
        group = (groups or {}).get((label, run))
        if group is not None and group.label != label:
            label = group.label
        elif len(runs_per_scheme[row.scheme]) > 1:
            label += f" ({Path(run).name})"
        if getattr(row, "not_learned", False):  # a task run below the learned-at-L criterion
            label += task_eval.NOT_LEARNED
        labelled.append(type(row)(**{**asdict(row), "scheme": label}))
    labelled.sort(key=lambda r: (*_order(r.scheme), getattr(r, "mode", getattr(r, "task", "")), r.eval_length))
    return labelled


# --- seeds ----------------------------------------------------------------------------------

def _not_trained(key: str) -> bool:
    """Config keys that do not change what is trained: the run names' list (pelab/run.py), plus the
    seed (what a group varies) and the resolved output dir."""
    from pelab.run import NOT_IN_NAME

    if key in ("seed", "data.seed", "trainer.default_root_dir") or key in NOT_IN_NAME:
        return True
    return key.startswith(tuple(k for k in NOT_IN_NAME if k.endswith(".")))


def _flatten(node, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: repr(node)}


@dataclass
class RunInfo:
    seed: int | None = None
    setting: dict[str, str] | None = None  # the trained-for config without the seed; None: unknown


def run_info(run_dir: str) -> RunInfo:
    import yaml

    path = Path(run_dir) / "checkpoints" / "config.yaml"
    if not path.is_file():
        return RunInfo()
    config = yaml.safe_load(path.read_text()) or {}
    flat = _flatten(config)
    return RunInfo(config.get("seed"), {k: v for k, v in flat.items() if not _not_trained(k)})


@dataclass
class Group:
    label: str
    runs: list[str] = field(default_factory=list)
    seeds: list = field(default_factory=list)


def seed_groups(runs_by_label: dict[str, set[str]], info: dict[str, RunInfo]) -> dict[tuple[str, str], Group]:
    """(base label, run dir) -> its group. Runs of a label whose settings are equal form one
    group (one run per seed; a repeated seed keeps the first run dir, with a warning); runs
    without a config.yaml stay alone."""
    groups: dict[tuple[str, str], Group] = {}
    for label, runs in runs_by_label.items():
        by_setting: dict[object, Group] = {}
        for run in sorted(runs):
            setting = info[run].setting
            key = run if setting is None else tuple(sorted(setting.items()))
            group = by_setting.setdefault(key, Group(label))
            if info[run].seed is not None and info[run].seed in group.seeds:
                print(f"[pelab] warning: {run} repeats seed {info[run].seed} of {group.runs[0]} with the same "
                      "settings; using the first", file=sys.stderr)
                continue
            group.runs.append(run)
            group.seeds.append(info[run].seed)
            groups[(label, run)] = group
        named = list(by_setting.values())
        if len(named) > 1:  # several settings of one scheme: name what differs, else the run dir
            for group in named:
                setting = info[group.runs[0]].setting
                others = [info[g.runs[0]].setting for g in named if g is not group]
                if setting is None or any(o is None for o in others):
                    group.label = f"{label} ({Path(group.runs[0]).name})"
                else:
                    keys = sorted(k for k in setting if any(o.get(k) != setting[k] for o in others))
                    group.label = f"{label} (" + ", ".join(f"{k}={setting[k]}" for k in keys) + ")"
    return groups


@dataclass
class Cell:
    """One group at one (section, length): the per-seed values and their statistics."""
    label: str
    section: str  # mode (perplexity) or task
    train_length: int
    eval_length: int
    values: list[float]
    seeds: list
    status: str = "ok"  # a row's status when no run has a value here
    best: bool = False
    p_vs_best: float = math.nan
    significant: bool = False

    @property
    def summary(self):
        return mean_ci(self.values) if self.values else None


def make_cells(points: dict[tuple, list[tuple]], lower_is_better: bool) -> list[Cell]:
    """``points[(label, section, train, length)] = [(seed, value or None, status)]`` -> cells, with
    the best group per (section, length) and Welch's test of every other group against it."""
    cells = []
    for (label, section, train, length), values in points.items():
        ok = [(s, v) for s, v, _ in values if v is not None]
        status = "ok" if ok else values[0][2]
        cells.append(Cell(label, section, train, length, [v for _, v in ok], [s for s, _ in ok], status))
    for key in {(c.section, c.eval_length) for c in cells}:
        scored = [c for c in cells if (c.section, c.eval_length) == key and c.values]
        if not scored:
            continue
        best = (min if lower_is_better else max)(scored, key=lambda c: c.summary.mean)
        best.best = True
        for c in scored:
            if c is not best:
                result = welch_test(best.values, c.values, ALPHA)
                c.p_vs_best, c.significant = result.p, result.significant
    cells.sort(key=lambda c: (c.section, *_order(c.label), c.eval_length))
    return cells


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


LEGEND = ("Mean over seeds ± half-width of the 95% confidence interval (Student t, n − 1 degrees of freedom); "
          "**bold**: best mean at that length; *: differs from the best by Welch's two-sided t-test, p < 0.05 "
          "(p in the CSV). One seed: no interval, no test.\n")
STAT_COLUMNS = ["scheme", "section", "train_length", "eval_length", "n", "seeds", "mean", "ci95", "sd", "best",
                "p_vs_best", "significant_vs_best", "status"]


def write_stats_csv(cells: list[Cell], path: Path, section_name: str) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([section_name if c == "section" else c for c in STAT_COLUMNS])
        for c in cells:
            s = c.summary
            writer.writerow([c.label, c.section, c.train_length, c.eval_length, len(c.values),
                             " ".join(map(str, c.seeds)), s.mean if s else math.nan, s.half_width if s else math.nan,
                             s.sd if s else math.nan, c.best, c.p_vs_best, c.significant, c.status])


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
    for train_length in sorted({c.train_length for c in cells}):
        ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    if log_y:
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("evaluation length (tokens); dotted: training length; bands: 95% CI over seeds")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _save(fig, path: Path) -> None:
    import matplotlib.pyplot as plt

    fig.savefig(path)
    plt.close(fig)


# --- the two outputs ------------------------------------------------------------------------

def ppl_points(pairs, groups) -> dict[tuple, list[tuple]]:
    points: dict[tuple, list[tuple]] = {}
    for run, r in pairs:
        group = groups.get((base_label(r), run))
        if group is None:  # a repeated seed, left out
            continue
        key = (group.label, r.mode, r.train_length, r.eval_length)
        points.setdefault(key, []).append((group.seeds[group.runs.index(run)], r.ppl if r.ok else None, r.status))
    return points


def task_points(pairs, groups) -> dict[tuple, list[tuple]]:
    by_run: dict[str, list] = {}
    for run, r in pairs:
        by_run.setdefault(run, []).append(r)
    points: dict[tuple, list[tuple]] = {}
    for run, rows in by_run.items():
        for r in task_eval.mean_over_depths(rows):
            group = groups.get((base_label(r), run))
            if group is None:  # a repeated seed, left out
                continue
            key = (group.label, r.task, r.train_length, r.eval_length)
            accuracy = 100 * r.accuracy if r.ok else None  # percent in tables and plots
            points.setdefault(key, []).append((group.seeds[group.runs.index(run)], accuracy, r.status))
    return points


def not_learned_marks(task_pairs, groups) -> dict[str, str]:
    """Group label -> " [k/n not learned at L]" for groups with runs below the learned criterion."""
    runs: dict[str, dict[str, bool]] = {}
    for run, r in task_pairs:
        group = groups.get((base_label(r), run))
        if group is not None:
            runs.setdefault(group.label, {})[run] = runs.get(group.label, {}).get(run, False) or r.not_learned
    return {label: f" [{sum(v.values())}/{len(v)} not learned at L]" for label, v in runs.items() if any(v.values())}


def heatmap_rows(task_pairs, groups) -> list[task_eval.TaskRow]:
    """Depth x length accuracy per group (the mean over its seeds), for the heatmap panels."""
    marks = not_learned_marks(task_pairs, groups)
    cells: dict[tuple, list] = {}
    for run, r in task_pairs:
        group = groups.get((base_label(r), run))
        if group is not None and not math.isnan(r.depth):
            cells.setdefault((r.task, group.label, r.train_length, r.eval_length, r.depth), []).append(r)
    rows = []
    for (task, label, train, length, depth), members in cells.items():
        ok = [r for r in members if r.ok]
        accuracy = sum(r.accuracy for r in ok) / len(ok) if ok else math.nan
        rows.append(task_eval.TaskRow(task, label + marks.get(label, ""), train, length, depth,
                                      sum(r.samples for r in ok), accuracy, math.nan, 0.0,
                                      "ok" if ok else members[0].status))
    return rows


def single_seed_task_table(rows: list[task_eval.TaskRow], task: str) -> str:
    """One line per run: exact-match accuracy (%) averaged over depths."""
    merged = task_eval.mean_over_depths([r for r in rows if r.task == task])
    lengths = sorted({r.eval_length for r in merged})
    train = {r.train_length for r in merged}
    table: dict[str, dict[int, str]] = {}
    for r in merged:
        table.setdefault(r.scheme, {})[r.eval_length] = task_eval._cell(r)
    header = "| scheme | " + " | ".join(f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 1)]
    lines += [f"| {label} | " + " | ".join(cells.get(n, "") for n in lengths) + " |" for label, cells in table.items()]
    return "\n".join(lines) + "\n"


def position_overlay(paths: list[str], out: Path, length: int | None) -> str | None:
    """comparison_position_loss.{csv,png}: every run's loss by position at one eval length (default
    the longest that every run has); returns the markdown section, None without position files."""
    from evaluation import position_loss

    files = find_result_files(paths, POSITION_FILE)
    if not files:
        return None
    pairs = newest_series(files, position_loss.read_csv, lambda r: (r.scheme, r.mode, r.rope_scaling, r.positions))
    runs = {run for run, _ in pairs}
    common = set.intersection(*({r.eval_length for run2, r in pairs if run2 == run} for run in runs))
    length = length or (max(common) if common else None)
    rows = [r for r in label_rows([(run, r) for run, r in pairs if r.eval_length == length])]
    if not rows:
        print(f"[pelab] no loss-by-position rows at length {length} (have: "
              f"{sorted({r.eval_length for _, r in pairs})})", file=sys.stderr)
        return None
    position_loss.write_csv(rows, out / "comparison_position_loss.csv")
    train = sorted({r.train_length for r in rows})
    _save(position_loss.plot_rows(rows, title=f"Loss by token position at eval length {length}",
                                  by=position_loss.curve_keys(rows, always=("scheme",))),
          out / "comparison_position_loss.png")
    return (f"### loss by token position\n\nEval length {length} (training length {', '.join(map(str, train))}): "
            f"comparison_position_loss.png / .csv, {len({r.scheme for r in rows})} line(s).\n")


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run directories, sweep directories, globs or CSV files")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the first path, if a directory)")
    parser.add_argument("--mode", default=None, help="only this mode (nonoverlapping or sliding)")
    parser.add_argument("--position-length", type=int, default=None,
                        help="eval length of the loss-by-position overlay (default: the longest every run has)")
    parser.add_argument("--wandb", action="store_true", help="also log table and plot to a W&B run")
    parser.add_argument("--project", default="pelab")
    parser.add_argument("--group", default=None, help="W&B group (default: the runs' group from their config)")
    args = parser.parse_args(argv)

    files = find_result_files(args.paths)
    task_files = find_result_files(args.paths, "tasks.csv")
    if not files and not task_files:
        raise SystemExit(f"no extrapolation.csv found (nor tasks.csv) under {args.paths}")
    for path in files:
        check_table(path, ExtrapolationRow)
    for path in task_files:
        check_table(path, task_eval.TaskRow)
    pairs = collect(files)
    if args.mode:
        pairs = [(run, r) for run, r in pairs if r.mode == args.mode]
        if not pairs:
            raise SystemExit(f"no rows with mode={args.mode}")
    task_pairs = collect_tasks(task_files)
    first = Path(args.paths[0])
    out = args.out or (first if first.is_dir() else Path("."))
    out.mkdir(parents=True, exist_ok=True)

    runs_by_label: dict[str, set[str]] = {}
    for run, r in [*pairs, *task_pairs]:
        runs_by_label.setdefault(base_label(r), set()).add(run)
    info = {run: run_info(run) for runs in runs_by_label.values() for run in runs}
    groups = seed_groups(runs_by_label, info)
    multi_seed = any(len(g.runs) > 1 for g in groups.values())

    sections, wandb_rows = [], []
    if pairs and not multi_seed:
        rows = label_rows(pairs, groups)
        write_csv(rows, out / "comparison.csv")
        for mode in sorted({r.mode for r in rows}):
            mode_rows = [r for r in rows if r.mode == mode]
            strides = sorted({r.stride for r in mode_rows}) if mode == "sliding" else []
            title = f"### {mode}" + (f" (stride {', '.join(map(str, strides))})" if strides else "")
            sections.append(f"{title}\n\nPerplexity by evaluation length (tokens).\n\n{markdown_table(mode_rows)}")
        _save(plot_rows(rows, series_by=("scheme", "mode") if len({r.mode for r in rows}) > 1 else ("scheme",),
                        title="Extrapolation: perplexity vs evaluation length"), out / "comparison.png")
        wandb_rows = rows
    elif pairs:
        cells = make_cells(ppl_points(pairs, groups), lower_is_better=True)
        write_stats_csv(cells, out / "comparison.csv", "mode")
        for mode in sorted({c.section for c in cells}):
            sections.append(f"### {mode}\n\nPerplexity by evaluation length (tokens).\n\n"
                            f"{stats_markdown(cells, mode, '{:.2f}')}\n{LEGEND}")
        means = [c.summary.mean for c in cells if c.values]
        _save(plot_bands(cells, "perplexity", "Extrapolation: perplexity vs evaluation length",
                         log_y=bool(means) and max(means) > 3 * min(means)), out / "comparison.png")
        wandb_rows = label_rows(pairs)  # W&B: every seed's line; the PNG has the means and intervals

    if task_pairs and not multi_seed:
        rows = label_rows(task_pairs, groups)
        task_eval.write_csv(rows, out / "comparison_tasks.csv")
        for task in sorted({r.task for r in rows}):
            sections.append(f"### {task}\n\nExact-match accuracy (%) by evaluation length (tokens), mean over "
                            f"depths.\n\n{single_seed_task_table(rows, task)}")
        _save(task_eval.plot_rows(task_eval.mean_over_depths(rows), title="Task accuracy vs evaluation length"),
              out / "comparison_tasks.png")
    elif task_pairs:
        cells = make_cells(task_points(task_pairs, groups), lower_is_better=False)
        marks = not_learned_marks(task_pairs, groups)
        for c in cells:
            c.label += marks.get(c.label, "")
        write_stats_csv(cells, out / "comparison_tasks.csv", "task")
        for task in sorted({c.section for c in cells}):
            sections.append(f"### {task}\n\nExact-match accuracy (%) by evaluation length (tokens), mean over "
                            f"depths.\n\n{stats_markdown(cells, task, '{:.1f}')}\n{LEGEND}")
        _save(plot_bands(cells, "exact-match accuracy (%)", "Task accuracy vs evaluation length"),
              out / "comparison_tasks.png")

    if task_pairs:
        grid = heatmap_rows(task_pairs, groups)
        if grid:
            task_eval.write_heatmap_csv(grid, out / "comparison_heatmap.csv")
            _save(task_eval.plot_heatmaps(grid, title="Exact match by depth and evaluation length (mean over seeds)"),
                  out / "comparison_heatmap.png")
        if any(r.not_learned for _, r in task_pairs):
            sections.append(task_eval.LEARNED_NOTE)
    overlay = position_overlay(args.paths, out, args.position_length)
    if overlay:
        sections.append(overlay)
    (out / "comparison.md").write_text("\n".join(sections))
    print((out / "comparison.md").read_text())
    written = ", ".join(p.name for p in sorted(out.glob("comparison*.*")))
    print(f"[pelab] {len(files) + len(task_files)} result file(s) -> {out}: {written}")

    if args.wandb:
        group = args.group or _group_of([*files, *task_files])
        if wandb_rows:
            log_to_new_wandb_run(loggable(wandb_rows, out / "comparison.png", prefix="comparison",
                                          series_by=("scheme", "mode")),
                                 out, project=args.project, group=group, job_type="compare", name="comparison")
        if task_pairs:
            log_to_new_wandb_run(task_eval.loggable(label_rows(task_pairs), out / "comparison_tasks.png"), out,
                                 project=args.project, group=group, job_type="compare", name="comparison-tasks")
    return 0


def _group_of(files: list[Path]) -> str | None:
    import yaml

    for path in files:
        config = run_dir_of(path) / "checkpoints" / "config.yaml"
        if config.is_file():
            return (yaml.safe_load(config.read_text()) or {}).get("group")
    return None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
