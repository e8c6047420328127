"""Many runs' results side by side: find their tables, name their lines, group their seeds and
score every group at every length (the outputs: evaluation/compare_report.py).

- **Files.** Every ``extrapolation.csv`` and ``tasks.csv`` under the given directories (or the
  CSV files given). When a run holds several, rows of the newer file win, a series at a time.
- **Labels.** A line is named by scheme (+ RoPE scaling, + packed documents); two runs of one
  scheme by the settings that differ, else by run directory. Schemes are listed in the order
  the registry (``model.pe.SCHEMES``) has them; unknown names last.
- **Seeds.** Runs whose resolved configs (``checkpoints/config.yaml``) differ only in keys the
  caller names as not changing what is trained form one group; a cell holds the group's
  per-seed values, their mean and 95% Student-t interval, the best group at each length, and
  Welch's two-sided t-test of every other group against it (evaluation/stats.py).
"""

from __future__ import annotations

import csv
import glob
import math
import sys
from dataclasses import MISSING, asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Callable, Sequence

from evaluation import streaming
from evaluation import tasks as task_eval
from evaluation.extrapolation import ExtrapolationRow, read_csv
from evaluation.streaming import StreamingRow
from evaluation.stats import ALPHA, mean_ci, welch_test
from evaluation.sweep import scaled_name
from model.pe import SCHEMES

RESULT_FILES = {"extrapolation": "extrapolation.csv", "tasks": "tasks.csv", "streaming": "streaming.csv"}
POSITION_FILE = "position_loss.csv"  # written beside extrapolation.csv
TABLE_OF = {task_eval.TaskRow: "tasks", StreamingRow: "streaming"}  # which RESULT_FILES a row type is read from


class CompareError(ValueError):
    """Input a comparison cannot read; the message says what was given and what is needed."""


# --- files ----------------------------------------------------------------------------------

def find_result_files(patterns: Sequence[str], name: str = "extrapolation.csv") -> list[Path]:
    files: set[Path] = set()
    for pattern in patterns:
        matches = [Path(p) for p in glob.glob(pattern)] or [Path(pattern)]
        for path in matches:
            if path.is_file() and path.name == name:
                files.add(path.resolve())
            elif (path.is_file() and path.suffix == ".csv" and name == "extrapolation.csv"
                  and path.name not in ("tasks.csv", "streaming.csv", POSITION_FILE)):
                files.add(path.resolve())  # any other CSV given by name is read as an extrapolation table
            elif path.is_dir():
                files.update(p.resolve() for p in path.rglob(name))
    return sorted(files)


def check_table(path: Path, row_type: type) -> None:
    """``path`` has the columns of a ``row_type`` table (the CSV that train.py and scripts/eval_*.py
    write), else a CompareError saying what it is and what is read, before anything is read."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    needed = [f.name for f in fields(row_type) if f.default is MISSING and f.default_factory is MISSING]
    missing = [c for c in needed if c not in header]
    if not missing:
        return
    what = " (a Lightning CSVLogger metrics file)" if {"step", "epoch"} <= set(header) else ""
    run = path.parent.parent if path.parent.name == "csv" else None  # logger=csv writes RUN/csv/metrics.csv
    raise CompareError(f"{path} is not a results table{what}: its columns are {', '.join(header) or '(none)'}, and "
                       f"{RESULT_FILES[TABLE_OF.get(row_type, 'extrapolation')]} needs "
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


def run_group(files: list[Path]) -> str | None:
    """The ``group`` of the first run with a resolved config (a sweep's runs share it)."""
    import yaml

    for path in files:
        config = run_dir_of(path) / "checkpoints" / "config.yaml"
        if config.is_file():
            return (yaml.safe_load(config.read_text()) or {}).get("group")
    return None


# --- labels ---------------------------------------------------------------------------------

def base_label(row) -> str:
    label = scaled_name(row.scheme, getattr(row, "rope_scaling", "none"))
    documents = getattr(row, "documents", "none")  # packed documents read by the evaluation
    return label if documents == "none" else f"{label} documents={documents}"


def scheme_order(label: str) -> tuple:
    """Sort key of a line: its scheme's place in the registry, then the label."""
    names = list(SCHEMES)
    scheme = label.split("+")[0].split(" ")[0]
    return names.index(scheme) if scheme in SCHEMES else len(names), label


def label_rows(pairs: list[tuple[str, object]], groups: dict | None = None) -> list:
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
        labelled.append(type(row)(**{**asdict(row), "scheme": label}))
    labelled.sort(key=lambda r: (*scheme_order(r.scheme), getattr(r, "mode", getattr(r, "task", "")), r.eval_length))
    return labelled


def label_task_rows(pairs: list[tuple[str, task_eval.TaskRow]], groups: dict | None = None) -> list[task_eval.TaskRow]:
    """``label_rows`` for task rows: their label already carries the evaluation-time scaling
    (``rope+ntk``), so the field is cleared, else the tasks' own labels add it a second time. The
    not-learned mark is left to those labels (``tasks.scheme_label``), which add it once."""
    return [replace(r, rope_scaling="none") for r in label_rows(pairs, groups)]


# --- seeds ----------------------------------------------------------------------------------

def _flatten(node, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: repr(node)}


@dataclass
class RunInfo:
    seed: int | None = None
    setting: dict[str, str] | None = None  # the trained-for config without the seed; None: unknown


def run_info(run_dir: str, ignored: Sequence[str]) -> RunInfo:
    """The run's seed and its config without the ``ignored`` keys (an entry ending in "." is a
    whole group of keys)."""
    import yaml

    path = Path(run_dir) / "checkpoints" / "config.yaml"
    if not path.is_file():
        return RunInfo()
    config = yaml.safe_load(path.read_text()) or {}
    groups = tuple(k for k in ignored if k.endswith("."))
    setting = {k: v for k, v in _flatten(config).items() if k not in ignored and not k.startswith(groups)}
    return RunInfo(config.get("seed"), setting)


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


# --- what is compared -----------------------------------------------------------------------

@dataclass
class Runs:
    """The rows of every run, as (run dir, row), and each run's seed group by (base label, run)."""
    files: list[Path]
    task_files: list[Path]
    pairs: list[tuple[str, ExtrapolationRow]]
    task_pairs: list[tuple[str, task_eval.TaskRow]]
    groups: dict[tuple[str, str], Group]
    stream_pairs: list[tuple[str, StreamingRow]] = field(default_factory=list)

    @property
    def multi_seed(self) -> bool:
        return any(len(g.runs) > 1 for g in self.groups.values())


def read_runs(paths: Sequence[str], mode: str | None, ignored: Sequence[str]) -> Runs:
    """Every result table under ``paths`` (only rows of ``mode`` when given), every table checked
    before any is read, runs grouped by seed (``ignored``: config keys that do not split a group)."""
    files = find_result_files(paths)
    task_files = find_result_files(paths, "tasks.csv")
    stream_files = find_result_files(paths, "streaming.csv")
    if not files and not task_files:
        raise CompareError(f"no extrapolation.csv found (nor tasks.csv) under {list(paths)}")
    for path in files:
        check_table(path, ExtrapolationRow)
    for path in task_files:
        check_table(path, task_eval.TaskRow)
    for path in stream_files:
        check_table(path, StreamingRow)
    pairs = newest_series(files, read_csv, lambda r: (r.scheme, r.mode, r.rope_scaling))
    if mode:
        pairs = [(run, r) for run, r in pairs if r.mode == mode]
        if not pairs:
            raise CompareError(f"no rows with mode={mode}")
    task_pairs = newest_series(task_files, task_eval.read_csv, lambda r: (r.task, r.scheme, r.rope_scaling))
    stream_pairs = newest_series(stream_files, streaming.read_csv,
                                 lambda r: (r.scheme, r.cache_positions, r.sinks, r.window))
    runs_by_label: dict[str, set[str]] = {}
    for run, r in [*pairs, *task_pairs, *stream_pairs]:
        runs_by_label.setdefault(base_label(r), set()).add(run)
    info = {run: run_info(run, ignored) for runs in runs_by_label.values() for run in runs}
    return Runs(files, task_files, pairs, task_pairs, seed_groups(runs_by_label, info), stream_pairs)


# --- cells: one group at one length ---------------------------------------------------------

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
    cells.sort(key=lambda c: (c.section, *scheme_order(c.label), c.eval_length))
    return cells


def ppl_points(runs: Runs) -> dict[tuple, list[tuple]]:
    points: dict[tuple, list[tuple]] = {}
    for run, r in runs.pairs:
        group = runs.groups.get((base_label(r), run))
        if group is None:  # a repeated seed, left out
            continue
        key = (group.label, r.mode, r.train_length, r.eval_length)
        points.setdefault(key, []).append((group.seeds[group.runs.index(run)], r.ppl if r.ok else None, r.status))
    return points


def task_points(runs: Runs) -> dict[tuple, list[tuple]]:
    by_run: dict[str, list] = {}
    for run, r in runs.task_pairs:
        by_run.setdefault(run, []).append(r)
    points: dict[tuple, list[tuple]] = {}
    for run, rows in by_run.items():
        for r in task_eval.mean_over_depths(rows):
            group = runs.groups.get((base_label(r), run))
            if group is None:  # a repeated seed, left out
                continue
            key = (group.label, r.task, r.train_length, r.eval_length)
            accuracy = 100 * r.accuracy if r.ok else None  # percent in tables and plots
            points.setdefault(key, []).append((group.seeds[group.runs.index(run)], accuracy, r.status))
    return points


def streaming_points(runs: Runs) -> dict[tuple, list[tuple]]:
    """Streaming perplexity per position bucket: the section is the cache-position rule, the
    "length" the bucket's end (positions [previous end, end))."""
    points: dict[tuple, list[tuple]] = {}
    for run, r in runs.stream_pairs:
        group = runs.groups.get((base_label(r), run))
        if group is None:  # a repeated seed, left out
            continue
        key = (group.label, f"{r.cache_positions}, S={r.sinks} W={r.window}", r.train_length, r.end)
        points.setdefault(key, []).append((group.seeds[group.runs.index(run)], r.ppl if r.ok else None, r.status))
    return points


def not_learned_marks(runs: Runs) -> dict[str, str]:
    """Group label -> " [k/n not learned at L]" for groups with runs below the learned criterion."""
    learned: dict[str, dict[str, bool]] = {}
    for run, r in runs.task_pairs:
        group = runs.groups.get((base_label(r), run))
        if group is not None:
            learned.setdefault(group.label, {})[run] = learned.get(group.label, {}).get(run, False) or r.not_learned
    return {label: f" [{sum(v.values())}/{len(v)} not learned at L]" for label, v in learned.items() if any(v.values())}


def heatmap_rows(runs: Runs) -> list[task_eval.TaskRow]:
    """Depth x length accuracy per group (the mean over its seeds), for the heatmap panels."""
    marks = not_learned_marks(runs)
    cells: dict[tuple, list] = {}
    for run, r in runs.task_pairs:
        group = runs.groups.get((base_label(r), run))
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
