"""Many runs' results side by side: find their tables, name their lines, group their seeds and
score every group at every length (the outputs: evaluation/compare_report.py, and each probe's
``Comparison`` hooks beside the probe).

- **Files.** Every table a registered probe compares (``Probe.compare``: extrapolation.csv,
  tasks.csv, ...) under the given directories (or the CSV files given). When a run holds
  several, a series comes whole from the newest file of its latest model (``step.json``).
- **Labels.** A line is named by scheme (+ RoPE scaling, + packed documents); two runs of one
  scheme by the settings that differ, each by those it holds away from today's defaults (the
  one at every default keeps the bare name), else by run directory. Schemes are listed in the order
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
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, Sequence

from evaluation.probe import Comparison, Probe, read_step
from evaluation.stats import ALPHA, mean_ci, welch_test
from evaluation.sweep import read_rows, scaled_name
from model.pe import SCHEMES


class CompareError(ValueError):
    """Input a comparison cannot read; the message says what was given and what is needed."""


# --- files ----------------------------------------------------------------------------------

def find_result_files(patterns: Sequence[str], name: str, others: Collection[str] | None = None) -> list[Path]:
    """Every file called ``name`` under ``patterns`` (directories, globs or files); ``others``
    given: any other CSV given by a name not among them is read as this table too."""
    files: set[Path] = set()
    for pattern in patterns:
        matches = [Path(p) for p in glob.glob(pattern)] or [Path(pattern)]
        for path in matches:
            if path.is_file() and path.name == name:
                files.add(path.resolve())
            elif others is not None and path.is_file() and path.suffix == ".csv" and path.name not in others:
                files.add(path.resolve())  # a CSV given by a name no probe writes
            elif path.is_dir():
                files.update(p.resolve() for p in path.rglob(name))
    return sorted(files)


def check_table(path: Path, row_type: type, name: str) -> None:
    """``path`` has the columns of a ``row_type`` table (the CSV ``name`` that train.py and
    scripts/eval_*.py write), else a CompareError saying what it is and what is read, before
    anything is read."""
    with open(path, newline="") as f:
        header = next(csv.reader(f), [])
    needed = [f.name for f in fields(row_type) if f.default is MISSING and f.default_factory is MISSING]
    missing = [c for c in needed if c not in header]
    if not missing:
        return
    what = " (a Lightning CSVLogger metrics file)" if {"step", "epoch"} <= set(header) else ""
    run = path.parent.parent if path.parent.name == "csv" else None  # logger=csv writes RUN/csv/metrics.csv
    raise CompareError(f"{path} is not a results table{what}: its columns are {', '.join(header) or '(none)'}, and "
                       f"{name} needs {', '.join(needed)}; give the run or sweep directory"
                       + (f" ({run})" if run else "")
                       + " or the extrapolation.csv / tasks.csv written by train.py and scripts/eval_*.py")


def run_dir_of(csv_path: Path, folders: Collection[str]) -> Path:
    """The run directory: the parent of the probe's output folder (one of ``folders``) the CSV lives in."""
    for parent in csv_path.parents:
        if parent.name in folders:
            return parent.parent
    return csv_path.parent


def newest_series(files: list[Path], read: Callable, series: Callable, folders: Collection[str]
                  ) -> list[tuple[str, object]]:
    """(run dir, row) pairs. A series of a run comes whole from one file, so points measured with
    different settings are never mixed in one line: the newest file that scores the run's latest
    model (the highest step a file's ``STEP_FILE`` records; files without one count as older than
    any step). What that leaves out of a run's line, scores of earlier checkpoints or lengths only
    an older file has, is named on stderr; give a CSV to compare that one instead."""
    ranked: dict[tuple, list[tuple[tuple[int, float], Path]]] = {}  # (run dir, series) -> its files
    rows_of: dict[Path, list] = {}
    for path in files:
        rows_of[path] = read(path)
        try:
            step = read_step(path.parent)
        except ValueError as e:
            raise CompareError(str(e)) from None
        rank = (-1 if step is None else step, path.stat().st_mtime)
        for key in dict.fromkeys((str(run_dir_of(path, folders)), series(row)) for row in rows_of[path]):
            ranked.setdefault(key, []).append((rank, path))
    pairs = []
    for (run, line), candidates in ranked.items():
        (step, _), path = max(candidates)
        rows = {p: [r for r in rows_of[p] if series(r) == line] for _, p in candidates}
        pairs += [(run, r) for r in rows[path]]
        earlier = sorted({s for (s, _), p in candidates if -1 < s < step})
        lengths = sorted({getattr(r, "eval_length", None) for p in rows if p != path for r in rows[p]}
                         - {getattr(r, "eval_length", None) for r in rows[path]} - {None})
        left = ([f"scores of earlier steps ({', '.join(map(str, earlier))})"] if earlier else []) + \
               ([f"lengths {', '.join(map(str, lengths))} of older files"] if lengths else [])
        if left:
            print(f"[pelab] {run}: {path.parent.name}/{path.name}" + (f" (step {step})" if step >= 0 else "")
                  + f" compared; left out: {'; '.join(left)} (give a CSV to compare that one)", file=sys.stderr)
    return pairs


def run_group(runs: Runs) -> str | None:
    """The ``group`` of the first run with a resolved config (a sweep's runs share it)."""
    import yaml

    for path in runs.files:
        config = run_dir_of(path, runs.folders) / "checkpoints" / "config.yaml"
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
        if group is not None and group.named:
            label = group.label
        elif len(runs_per_scheme[row.scheme]) > 1:
            label += f" ({Path(run).name})"
        labelled.append(type(row)(**{**asdict(row), "scheme": label}))
    labelled.sort(key=lambda r: (*scheme_order(r.scheme), getattr(r, "mode", getattr(r, "task", "")), r.eval_length))
    return labelled


# --- seeds ----------------------------------------------------------------------------------

def _flatten(node, prefix: str = "") -> dict[str, str]:
    if isinstance(node, dict):
        return {k: v for key, value in node.items() for k, v in _flatten(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: repr(node)}


@dataclass
class RunInfo:
    seed: int | None = None
    setting: dict[str, str] | None = None  # the trained-for config without the seed; None: unknown
    keys: frozenset[str] = frozenset()  # every config key (dotted), ignored ones too
    defaults: dict[str, str] = field(default_factory=dict)  # those it ran under (``Defaults.of``)


def default_values(defaults: dict | None) -> dict[str, str]:
    """Today's defaults (a config tree) as dotted keys, as ``_flatten`` writes a run's config;
    interpolations left out (their values are unknown here)."""
    return {k: v for k, v in _flatten(defaults or {}).items() if "${" not in v}


class Defaults:
    """Today's defaults as dotted keys: conf/config.yaml's (``tree``), and, for a run whose block
    (pe, data, trainer) is another option than the default one (another ``_target_``), that
    option's own block, from ``option(block, target)`` (a config tree holding the block, or None
    where no option has that target today), composed once per target."""

    def __init__(self, tree: dict | None, option: Callable[[str, str], dict | None] | None = None) -> None:
        self.values = default_values(tree)
        self.option = option
        self.blocks: dict[tuple[str, str], dict[str, str] | None] = {}

    def of(self, flat: dict[str, str]) -> dict[str, str]:
        """The defaults a run with config ``flat`` (dotted keys) ran under."""
        import ast

        out = self.values
        for key, target in flat.items():
            block, _, rest = key.partition(".")
            if rest != "_target_" or self.option is None or self.values.get(key) in (None, target):
                continue
            if (block, target) not in self.blocks:
                tree = self.option(block, ast.literal_eval(target))
                self.blocks[block, target] = None if tree is None else default_values({block: tree[block]})
            if self.blocks[block, target] is not None:
                out = {k: v for k, v in out.items() if k.partition(".")[0] != block} | self.blocks[block, target]
        return out


def run_info(run_dir: str, ignored: Sequence[str], defaults: Defaults | None = None) -> RunInfo:
    """The run's seed and its config without the ``ignored`` keys (an entry ending in "." is a
    whole group of keys); a key of ``defaults`` (those the run ran under) the run's config lacks
    takes its default there: an option added after the run was trained, which it ran at its default."""
    import yaml

    path = Path(run_dir) / "checkpoints" / "config.yaml"
    if not path.is_file():
        return RunInfo()
    config = yaml.safe_load(path.read_text()) or {}
    groups = tuple(k for k in ignored if k.endswith("."))
    flat = _flatten(config)
    known = defaults.of(flat) if defaults is not None else {}
    setting = {k: v for k, v in {**known, **flat}.items() if k not in ignored and not k.startswith(groups)}
    return RunInfo(config.get("seed"), setting, frozenset(flat), known)


def check_ignored(asked: Sequence[str], info: dict[str, RunInfo], option: str = "--ignore") -> None:
    """Each key of ``asked`` (a ``KEY`` or a group ``PREFIX.``) in some run's config, else one line
    naming it and the nearest keys there are: a misspelt key would silently split no group."""
    import difflib

    keys = set().union(*(i.keys for i in info.values()))
    groups = {k[:i + 1] for k in keys for i, c in enumerate(k) if c == "."}
    for key in asked:
        if key in keys or (key.endswith(".") and key in groups):
            continue
        if not keys:
            raise CompareError(f"{option} {key}: no compared run has a config (RUN/checkpoints/config.yaml), so no "
                               "key can be ignored; drop it")
        group = key.rstrip(".").rpartition(".")[0]  # the keys beside it, e.g. pe.* for pe.bse
        siblings = sorted(k for k in keys if group and k.startswith(group + "."))
        near = list(dict.fromkeys(difflib.get_close_matches(key, sorted(keys | groups), n=6, cutoff=0.5)
                                  + siblings))[:10] or sorted(keys | groups)[:12]
        raise CompareError(f"{option} {key}: no compared run's config has this key; nearest keys: {', '.join(near)} "
                           "(a whole group: PREFIX. with the dot)")


@dataclass
class Group:
    label: str
    runs: list[str] = field(default_factory=list)
    seeds: list = field(default_factory=list)
    named: bool = False  # told apart from other settings of its scheme (its label may still be the bare one)


def at_default(key: str, setting: dict[str, str], defaults: dict[str, str]) -> bool:
    """Whether ``setting`` holds the default at ``key`` (``defaults``: those it ran under,
    ``Defaults.of``): only where they hold the run's own block (same ``_target_``: pe.base of a
    scheme no option composes is not RoPE's default)."""
    block = key.split(".")[0]
    same = defaults.get(f"{block}._target_") == setting.get(f"{block}._target_")
    return same and key in defaults and defaults[key] == setting[key]


def seed_groups(runs_by_label: dict[str, set[str]], info: dict[str, RunInfo]) -> dict[tuple[str, str], Group]:
    """(base label, run dir) -> its group. Runs of a label whose settings are equal form one
    group (one run per seed; a repeated seed keeps the first run dir, with a warning); runs
    without a config.yaml stay alone. Several settings of a label are named by the keys that
    differ, each group by those it holds away from the defaults it ran under
    (``RunInfo.defaults``): RoPE and RoPE with XSA read "rope" and "rope (model.xsa='plain')"."""
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
                    known = info[group.runs[0]].defaults
                    keys = sorted(k for k in setting if any(o.get(k) != setting[k] for o in others)
                                  and not at_default(k, setting, known))
                    group.label = f"{label} (" + ", ".join(f"{k}={setting[k]}" for k in keys) + ")" if keys else label
                group.named = True
    return groups


# --- what is compared -----------------------------------------------------------------------

@dataclass
class Table:
    """One probe table across runs: the files read and their rows as (run dir, row)."""
    comparison: Comparison
    files: list[Path]
    pairs: list[tuple[str, Any]]


@dataclass
class Runs:
    """Every compared table, each run's seed group by (base label, run), the caller's options."""
    tables: list[Table]
    groups: dict[tuple[str, str], Group]
    folders: frozenset[str] = frozenset()  # the probes' output folders: a run dir is their parent
    options: dict[str, Any] = field(default_factory=dict)  # e.g. compare_runs' mode, position_length

    @property
    def files(self) -> list[Path]:
        return [path for table in self.tables for path in table.files]

    @property
    def multi_seed(self) -> bool:
        return any(len(g.runs) > 1 for g in self.groups.values())


def read_runs(paths: Sequence[str], probes: Iterable[Probe], ignored: Sequence[str],
              options: dict[str, Any] | None = None, asked: Sequence[str] = (), defaults: dict | None = None,
              option_defaults: Callable[[str, str], dict | None] | None = None) -> Runs:
    """Every table the ``probes`` compare (``Probe.compare``) under ``paths``, every file checked
    before any is read, each table's ``select`` applied with ``options``, runs grouped by seed
    (``ignored``: config keys that do not split a group; ``asked``: those of them the user named,
    each of which some run's config must have; ``defaults``: the config tree of today's defaults,
    which fill the keys a run's config predates; ``option_defaults(block, target)``: the config tree
    of another option of a block, as ``Defaults`` reads it)."""
    options = dict(options or {})
    parts = [(probe.output, c) for probe in probes for c in probe.compare]
    folders = frozenset(output for output, _ in parts)
    names = {c.file for _, c in parts}
    found = [(c, find_result_files(paths, c.file, names if c.any_csv else None)) for _, c in parts]
    if not any(files for _, files in found):
        first, *rest = [c.file for c, _ in found]
        raise CompareError(f"no {first} found" + (f" (nor {', '.join(rest)})" if rest else "") + f" under {list(paths)}")
    for c, files in found:
        for path in files:
            check_table(path, c.row, c.file)
    tables = []
    for c, files in found:
        pairs = newest_series(files, lambda path, row=c.row: read_rows(path, row), c.series, folders)
        tables.append(Table(c, files, c.select(pairs, options) if c.select else pairs))
    runs_by_label: dict[str, set[str]] = {}
    for table in tables:
        for run, r in table.pairs if table.comparison.grouped else ():
            runs_by_label.setdefault(base_label(r), set()).add(run)
    values = Defaults(defaults, option_defaults)  # flattened once, each other option composed once
    info = {run: run_info(run, ignored, values) for runs in runs_by_label.values() for run in runs}
    check_ignored(asked, info)
    return Runs(tables, seed_groups(runs_by_label, info), folders, options)


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
    the best groups per (section, length) (all of them on a tie) and Welch's test of every other
    group against the first."""
    cells = []
    for (label, section, train, length), values in points.items():
        ok = [(s, v) for s, v, _ in values if v is not None]
        status = "ok" if ok else values[0][2]
        cells.append(Cell(label, section, train, length, [v for _, v in ok], [s for s, _ in ok], status))
    for key in {(c.section, c.eval_length) for c in cells}:
        scored = [c for c in cells if (c.section, c.eval_length) == key and c.values]
        if not scored:
            continue
        target = (min if lower_is_better else max)(c.summary.mean for c in scored)
        for c in scored:
            c.best = c.summary.mean == target  # a tie is bold in every tied group
        first = next(c for c in scored if c.best)
        for c in scored:
            if not c.best:
                result = welch_test(first.values, c.values, ALPHA)
                c.p_vs_best, c.significant = result.p, result.significant
    cells.sort(key=lambda c: (c.section, *scheme_order(c.label), c.eval_length))
    return cells


def group_points(runs: Runs, pairs: Iterable[tuple[str, Any]], where: Callable[[Any], tuple],
                 value: Callable[[Any], float]) -> dict[tuple, list[tuple]]:
    """``make_cells``' points: each (run dir, row) of a seed group at (group label, *``where(row)``)
    = (label, section, train length, length), as (seed, ``value(row)`` or None when the row is
    not ok, status)."""
    points: dict[tuple, list[tuple]] = {}
    for run, r in pairs:
        group = runs.groups.get((base_label(r), run))
        if group is None:  # a repeated seed, left out
            continue
        points.setdefault((group.label, *where(r)), []).append(
            (group.seeds[group.runs.index(run)], value(r) if r.ok else None, r.status))
    return points
