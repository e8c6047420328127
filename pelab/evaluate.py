"""The one runner of the probes (evaluation/registry.py): when training ends
(pelab/probes.py ``EndOfTrainingEvaluation``) and from the scripts (scripts/evaluate.py and the
eval_* commands), so a checkpoint evaluated later gets the same files as the run that wrote it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.stream import load_tokens
from evaluation.probe import Probe, Report, Subject, write_step
from evaluation.registry import PROBES, enabled_probes
from pelab.loggers import log_results


@dataclass
class Outcome:
    """What one probe produced: its result, the files it wrote, what the loggers got."""

    result: Any
    paths: dict[str, Path]
    reports: list[Report]


def subject_of(module, datamodule, distributed: bool = False, rank_zero: bool = True, seed: int | None = None
               ) -> Subject:
    """A LitGPT and its data module as the probes see them; the held-out tokens are read only
    when a probe asks. ``seed``: the task samples' seed (default: the data module's)."""
    held_out = ((lambda: load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"]))
                if getattr(datamodule, "held_out_text", True) else None)
    return Subject(module.model, module.config.block_size, module.pe_name, held_out,
                   task=getattr(datamodule, "task", None),
                   seed=getattr(datamodule, "seed", 0) if seed is None else seed,
                   randomize_to=getattr(module, "randomize_to", None), documents=getattr(module, "documents", None),
                   distributed=distributed, log=print if rank_zero else (lambda _: None))


def run_evaluations(subject: Subject, options: dict[str, Any], output_dir: Path | Callable[[Probe], Path],
                    step: int = 0, loggers: Sequence = (), rank_zero: bool = True,
                    note: Callable[[Any], str | None] | None = None) -> dict[str, Outcome]:
    """Every probe ``options`` (the ``eval`` section, or its probe blocks) enables, in registry
    order. A sharded probe (``every_rank``) runs on every rank; the others, and all saving and
    logging, on rank zero only. ``step``: the training step of the model (the loggers' step,
    and ``step.json`` beside each probe's files). Files go to ``output_dir / probe.output`` (or
    ``output_dir(probe)``); ``note(config)`` (e.g. the precision that ran) joins the plots' title
    and heads the markdown table."""
    outcomes: dict[str, Outcome] = {}
    enabled = enabled_probes(options, subject.held_out_text)
    if enabled and rank_zero:  # where the scoring runs: the device of the weights it is given
        device = next(subject.gpt.parameters()).device
        ranks = f", sharded over {torch.distributed.get_world_size()} ranks" if subject.distributed else ""
        print(f"[pelab] evaluation on {device}{ranks}: {', '.join(enabled)}", flush=True)
    for name, block in enabled.items():
        probe = PROBES[name]
        if not (probe.every_rank or rank_zero):
            continue
        config = probe.config.from_dict(block)
        result = probe.evaluate(subject, config)
        if not rank_zero:
            continue
        said = note(config) if note else None
        title = probe.title(subject) + (f", {said}" if said else "")
        folder = output_dir(probe) if callable(output_dir) else Path(output_dir) / probe.output
        paths = probe.save(result, folder, title)
        write_step(folder, step)  # which model these files score, for compare_runs
        if said and "md" in paths:  # which model, and what the numbers ran in
            paths["md"].write_text(f"{title}\n\n{paths['md'].read_text()}")
        reports = probe.reports(result, paths)
        for logged, metrics in reports:
            log_results(list(loggers), logged, metrics, step)
        print(probe.announce(result, paths), flush=True)
        outcomes[name] = Outcome(result, paths, reports)
    return outcomes
