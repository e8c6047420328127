"""Collect the results of many runs into one table and one plot: perplexity vs length
(``extrapolation.csv``) and synthetic-task accuracy vs length (``tasks.csv``); streaming
perplexity by position (``streaming.csv``) as a table.

    python scripts/compare_runs.py multirun/2026-11-21/12-00-00
    python scripts/compare_runs.py 'outputs/*/*' --mode sliding --out comparison/
    python scripts/compare_runs.py multirun/DATE/TIME --wandb      # also log to W&B, in the sweep's group
    python scripts/compare_runs.py runs/drope_s*/drope --ignore init_from   # seeds, each from its own base

Every ``extrapolation.csv`` and ``tasks.csv`` under the given directories (or the CSV files
given) is read. When a run holds several (the one written at the end of training and later
scripts/eval_extrapolation.py or eval_tasks.py results), a series comes whole from the newest
file that scores the run's latest model (the step its ``step.json`` records): scores of an earlier
checkpoint, written later, are left out, and what a line leaves out (those steps, lengths only an
older file has) is named on stderr (give that CSV to compare it). Lines are named by scheme (+ RoPE
scaling).

**Seeds.** Runs whose resolved configs (``checkpoints/config.yaml``) differ only in ``seed``
and in settings that do not change what is trained (paths, loggers, callbacks, evaluation
options: what run names leave out) are one group (a key a run's config predates counts at today's
default, that of the option it chose: pe=rope_dd's own for a rope_dd run): its lines show the mean over the
seeds ± the 95% Student-t interval (n − 1 degrees of freedom), the best mean at each length
is bold, and ``*`` marks a group whose values differ from the best group's at that length by
Welch's two-sided t-test at α = 0.05 (p-values in the CSV); the plot draws the intervals as
bands. With one run per group (or no config.yaml) the output is one line per run; two runs of
one scheme are named by the settings that differ, each by those it holds away from today's
defaults (``rope`` beside ``rope (model.xsa='plain')``; else by run directory). Task accuracy is the
exact-match accuracy of a run averaged over its passkey depths; tasks with set-valued answers
(graphwalks, common_words, frequent_words) show their F1 beside it (single runs: ``62.5 (F1 80.0)`` in a cell;
seed groups: a section ``TASK F1`` after the task's). A run below the learned criterion at its
training length is marked once: ``[not learned at L]`` after its label (seed groups: ``[k/n not
learned at L]``), with the criterion below the tables.

Writes comparison.{csv,md,png} (perplexity; markdown with every section) and, when there are
task results, comparison_tasks.{csv,png}. Loss by token position (``position_loss.csv``) of
every run at one eval length (``--position-length``, default the longest every run has) is
overlaid in comparison_position_loss.{csv,png}.

Each table comes from its probe (``Probe.compare`` in evaluation/registry.py's ``PROBES``): a
new probe with compare hooks appears here with no edit to this file.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from _common import log_to_new_wandb_run

from evaluation import compare, compare_report
from evaluation.registry import PROBES
from pelab.run import NOT_IN_NAME

# Config keys that do not split a seed group: the run names' list, the seed (what a group varies)
# the resolved output dir, and the data module's class path (runs saved before and after it moved
# into pelab/ train the same; the corpus and its options still split groups).
NOT_TRAINED = ("seed", "data.seed", "trainer.default_root_dir", "data._target_", *NOT_IN_NAME)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run directories, sweep directories, globs or CSV files")
    parser.add_argument("--out", type=Path, default=None, help="output directory (default: the first path, if a directory)")
    parser.add_argument("--mode", default=None, help="only this mode (nonoverlapping or sliding)")
    parser.add_argument("--position-length", type=int, default=None,
                        help="eval length of the loss-by-position overlay (default: the longest every run has)")
    parser.add_argument("--ignore", action="append", default=[], metavar="KEY",
                        help="a config key that does not split a seed group (repeatable), e.g. init_from when each "
                             "seed starts from its own base run's checkpoint")
    parser.add_argument("--wandb", action="store_true", help="also log table and plot to a W&B run")
    parser.add_argument("--project", default="pelab")
    parser.add_argument("--group", default=None, help="W&B group (default: the runs' group from their config)")
    return parser.parse_args(argv)


def default_config() -> dict:
    """Today's default config tree (conf/config.yaml as composed): a run trained before an option
    existed ran it at its default, so that option does not split it from newer runs."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    with initialize_config_dir(str(Path(__file__).resolve().parents[1] / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("config"), resolve=False)


def option_defaults(block: str, target: str) -> dict | None:
    """The config tree with ``block=OPTION``, the option of conf/BLOCK/ whose ``_target_`` is
    ``target`` (pe=rope_dd's own keys and defaults), or None where none is today."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    conf = Path(__file__).resolve().parents[1] / "conf"
    line = f"_target_: {target}"
    options = [p.stem for p in sorted((conf / block).glob("*.yaml")) if line in p.read_text().splitlines()]
    if not options:
        return None
    with initialize_config_dir(str(conf), version_base="1.3"):
        return OmegaConf.to_container(compose("config", overrides=[f"{block}={options[0]}"]), resolve=False)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        runs = compare.read_runs(args.paths, PROBES.values(), (*NOT_TRAINED, *args.ignore), vars(args),
                                 asked=args.ignore, defaults=default_config(), option_defaults=option_defaults)
    except compare.CompareError as err:
        raise SystemExit(str(err)) from None
    first = Path(args.paths[0])
    out = args.out or (first if first.is_dir() else Path("."))
    out.mkdir(parents=True, exist_ok=True)

    (out / "comparison.md").write_text("\n".join(compare_report.report(runs, out)))
    print((out / "comparison.md").read_text())
    written = ", ".join(p.name for p in sorted(out.glob("comparison*.*")))
    print(f"[pelab] {len(runs.files)} result file(s) -> {out}: {written}")
    if args.wandb:
        group = args.group or compare.run_group(runs)
        for name, logged in compare_report.charts(runs, out).items():  # one W&B run per kind of result
            log_to_new_wandb_run(logged, out, project=args.project, group=group, job_type="compare", name=name)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
