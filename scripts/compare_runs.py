"""Collect the extrapolation results of many runs into one table and one plot.

    python scripts/compare_runs.py multirun/2026-11-21/12-00-00
    python scripts/compare_runs.py 'outputs/*/*' --mode sliding --out comparison/
    python scripts/compare_runs.py multirun/DATE/TIME --wandb      # also log to W&B, in the sweep's group

Every ``extrapolation.csv`` under the given directories (or the CSV files given) is read.
When a run holds several (the one written at the end of training and later
scripts/eval_extrapolation.py results), rows of the newer file win. Lines are named by
scheme (+ RoPE scaling), and by run directory when two runs share a scheme.
Writes comparison.csv, comparison.md and comparison.png (one line per scheme, ppl vs length).
"""

from __future__ import annotations

import argparse
import glob
import sys
from dataclasses import asdict
from pathlib import Path

from _common import log_rows_to_new_wandb_run

from evaluation.extrapolation import ExtrapolationRow, markdown_table, plot_rows, read_csv, write_csv


def find_result_files(patterns: list[str]) -> list[Path]:
    files: set[Path] = set()
    for pattern in patterns:
        matches = [Path(p) for p in glob.glob(pattern)] or [Path(pattern)]
        for path in matches:
            if path.is_file() and path.suffix == ".csv":
                files.add(path.resolve())
            elif path.is_dir():
                files.update(p.resolve() for p in path.rglob("extrapolation.csv"))
    return sorted(files)


def run_dir_of(csv_path: Path) -> Path:
    """The run directory: the parent of the ``extrapolation`` folder the CSV lives in."""
    for parent in csv_path.parents:
        if parent.name == "extrapolation":
            return parent.parent
    return csv_path.parent


def collect(files: list[Path]) -> list[tuple[str, ExtrapolationRow]]:
    """(run dir, row) pairs. A series (scheme, mode, scaling) of a run comes whole from the newest
    file that has it, so points measured with different settings are never mixed in one line."""
    newest: dict[tuple, tuple[float, Path]] = {}
    rows_of: dict[Path, list[ExtrapolationRow]] = {}
    for path in files:
        rows_of[path] = read_csv(path)
        mtime = path.stat().st_mtime
        for row in rows_of[path]:
            key = (str(run_dir_of(path)), row.scheme, row.mode, row.rope_scaling)
            if key not in newest or newest[key][0] < mtime:
                newest[key] = (mtime, path)
    pairs = []
    for (run, scheme, mode, scaling), (_, path) in newest.items():
        pairs += [(run, r) for r in rows_of[path] if (r.scheme, r.mode, r.rope_scaling) == (scheme, mode, scaling)]
    return pairs


def label_rows(pairs: list[tuple[str, ExtrapolationRow]]) -> list[ExtrapolationRow]:
    """Rows whose ``scheme`` field becomes the line label: scheme [+ scaling] [+ run]."""
    runs_per_scheme: dict[str, set[str]] = {}
    for run, row in pairs:
        runs_per_scheme.setdefault(row.scheme, set()).add(run)
    labelled = []
    for run, row in pairs:
        label = row.scheme if row.rope_scaling == "none" else f"{row.scheme}+{row.rope_scaling}"
        if len(runs_per_scheme[row.scheme]) > 1:
            label += f" ({Path(run).name})"
        labelled.append(ExtrapolationRow(**{**asdict(row), "scheme": label}))
    order = {"learned": 0, "sinusoidal": 1, "rope": 2, "alibi": 3, "xpos": 4, "rope_alibi": 5}
    labelled.sort(key=lambda r: (order.get(r.scheme.split("+")[0].split(" ")[0], 99), r.scheme, r.mode, r.eval_length))
    return labelled


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run directories, sweep directories, globs or CSV files")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the first path, if a directory)")
    parser.add_argument("--mode", default=None, help="only this mode (nonoverlapping or sliding)")
    parser.add_argument("--wandb", action="store_true", help="also log table and plot to a W&B run")
    parser.add_argument("--project", default="pelab")
    parser.add_argument("--group", default=None, help="W&B group (default: the runs' group from their config)")
    args = parser.parse_args(argv)

    files = find_result_files(args.paths)
    if not files:
        raise SystemExit(f"no extrapolation.csv found under {args.paths}")
    rows = label_rows(collect(files))
    if args.mode:
        rows = [r for r in rows if r.mode == args.mode]
        if not rows:
            raise SystemExit(f"no rows with mode={args.mode}")
    first = Path(args.paths[0])
    out = args.out or (first if first.is_dir() else Path("."))
    out.mkdir(parents=True, exist_ok=True)

    write_csv(rows, out / "comparison.csv")
    sections = []
    for mode in sorted({r.mode for r in rows}):
        mode_rows = [r for r in rows if r.mode == mode]
        strides = sorted({r.stride for r in mode_rows}) if mode == "sliding" else []
        title = f"### {mode}" + (f" (stride {', '.join(map(str, strides))})" if strides else "")
        sections.append(f"{title}\n\nPerplexity by evaluation length (tokens).\n\n{markdown_table(mode_rows)}")
    (out / "comparison.md").write_text("\n".join(sections))
    fig = plot_rows(rows, series_by=("scheme", "mode") if len({r.mode for r in rows}) > 1 else ("scheme",),
                    title="Extrapolation: perplexity vs evaluation length")
    fig.savefig(out / "comparison.png")
    print((out / "comparison.md").read_text())
    print(f"[pelab] {len(files)} result file(s) -> {out / 'comparison.csv'}, comparison.md, comparison.png")

    if args.wandb:
        log_rows_to_new_wandb_run(rows, out / "comparison.png", out, prefix="comparison", series_by=("scheme", "mode"),
                                  project=args.project, group=args.group or _group_of(files), job_type="compare",
                                  name="comparison")
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
