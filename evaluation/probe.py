"""What a probe is to the runner that calls it: a ``Probe`` describes one (its ``eval.<name>``
options, what it reads, how it scores, saves and reports), a ``Subject`` is what it evaluates,
a ``Comparison`` is how one of its tables reads across runs (scripts/compare_runs.py).
Each probe file ends with its ``PROBE``; evaluation/registry.py lists them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

import numpy as np
from torch import nn

from data.packing import DocumentOptions
from evaluation.results import Logged
from model.config import require

#: what a probe reads: held-out text, a synthetic task's samples, or whichever the run has
NEEDS = ("text", "task", "either")

#: one logger call: what W&B gets (tables, charts, images) and the scalars other loggers get
Report = tuple[Logged, dict[str, float]]


@dataclass
class Subject:
    """A trained model and the data it is evaluated on."""

    gpt: nn.Module
    train_length: int
    scheme: str
    held_out: Callable[[], np.ndarray] | None = None  # loads the held-out tokens; None: the run has none
    task: Any = None  # data.synthetic.Task of a synthetic run
    seed: int = 0  # the task's sample seed
    randomize_to: int | None = None  # the model's pe.randomize_to
    documents: DocumentOptions | None = None  # how the run read packed documents
    distributed: bool = False  # every rank of the process group evaluates (sharded probes)
    log: Callable[[str], None] = print

    @property
    def held_out_text(self) -> bool:
        return self.held_out is not None

    @cached_property
    def tokens(self) -> np.ndarray:
        """The held-out tokens, read once when a probe first asks."""
        return self.held_out()

    @property
    def title(self) -> str:
        return f"pe={self.scheme}, trained at {self.train_length}"


#: beside every probe's files: the training step of the model they score, so a comparison takes a
#: run's line from its latest model, not from a later look at an earlier checkpoint
STEP_FILE = "step.json"


def write_step(folder: Path, step: int) -> None:
    Path(folder).mkdir(parents=True, exist_ok=True)
    (Path(folder) / STEP_FILE).write_text(json.dumps({"step": int(step)}) + "\n")


def read_step(folder: Path) -> int | None:
    """The step ``folder``'s files score (``write_step``); None where none is recorded (files
    written before steps were). A record that is not one is a ValueError naming the file."""
    path = Path(folder) / STEP_FILE
    if not path.is_file():
        return None
    try:
        step = json.loads(path.read_text())["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"step is {step!r}")
        return step
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path} is not a step record ({type(e).__name__}: {e}); it should read "
                         '{"step": N}, the training step of the model scored (delete it to treat the '
                         "folder's files as of an unknown step)") from None


@dataclass(frozen=True)
class Comparison:
    """One result table of a probe across runs (evaluation/compare.py reads it, scripts/compare_runs.py
    reports it): the ``file`` found under the compared paths, its columns checked before any is
    read, a run's ``series`` taken whole from its latest model's newest file (``STEP_FILE``). The
    hooks get the ``Runs`` read (seed groups, the caller's options) and this table's (run dir,
    row) pairs."""

    file: str  # the CSV the probe writes into its output folder
    row: type  # its row dataclass: the columns checked, the rows read back (evaluation.sweep.read_rows)
    series: Callable[[Any], tuple]  # the line of a run a row belongs to
    section: Callable[[Any, list, Path], list[str]]  # (runs, pairs, out dir) -> markdown sections; writes its files
    place: int = 100  # where its sections stand in comparison.md, lowest first (ties: registry order)
    select: Callable[[list, dict], list] | None = None  # (pairs, options) -> the pairs compared (e.g. --mode)
    charts: Callable[[Any, list, Path], dict[str, Logged]] | None = None  # {W&B run name: what it logs}
    grouped: bool = True  # its runs join the seed groups (False: its section labels runs itself)
    any_csv: bool = False  # a CSV given by a name no probe writes is read as this table


@dataclass(frozen=True)
class Probe:
    """One probe: ``evaluate(subject, config)`` → its result, ``save(result, out_dir, title)`` →
    {kind: path} of the files it wrote, ``reports(result, paths)`` → what the loggers get,
    ``announce(result, paths)`` → the line printed after saving."""

    name: str  # its options: eval.<name> (conf/eval/default.yaml)
    config: type  # an evaluation.sweep.LengthSweepOptions dataclass built from those options
    needs: str  # NEEDS
    evaluate: Callable[[Subject, Any], Any]
    save: Callable[[Any, Path, str], dict[str, Path]]
    reports: Callable[[Any, dict[str, Path]], list[Report]]
    announce: Callable[[Any, dict[str, Path]], str]
    output: str  # its folder in the run dir
    title: Callable[[Subject], str] = field(default=lambda subject: subject.title)
    every_rank: bool = False  # True: every rank scores its share of the work; rank zero saves and reports
    switch: tuple = (True, False)  # eval.<name>.enabled's values; "auto" among them: on when the data has its input
    switch_help: str = "true or false"
    compare: tuple[Comparison, ...] = ()  # its tables in scripts/compare_runs.py; none: not compared

    def __post_init__(self) -> None:
        require(self.needs in NEEDS, f"Probe({self.name}).needs", self.needs, " or ".join(NEEDS))

    def has_input(self, held_out_text: bool) -> bool:
        return self.needs == "either" or (self.needs == "text") == held_out_text

    def runs(self, enabled: Any, held_out_text: bool) -> bool:
        """Whether it runs for ``eval.<name>.enabled`` on a run with or without held-out text.
        auto: when the data has its input. true: a text probe on a synthetic task is off (task
        accuracy replaces perplexity there); a task probe on text data is refused."""
        words = [v for v in self.switch if isinstance(v, str)]
        require(isinstance(enabled, bool) or enabled in words, f"eval.{self.name}.enabled", enabled, self.switch_help)
        if enabled == "auto":
            return self.has_input(held_out_text)
        if enabled is True and self.needs == "task" and held_out_text:
            raise ValueError(f"eval.{self.name}.enabled=true needs a synthetic task: data=synthetic data.task=...")
        return bool(enabled) and self.has_input(held_out_text)
