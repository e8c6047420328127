"""Synthetic-task accuracy against length: a model trained on ``data/synthetic.py`` samples of
length L answers fresh samples (the ``test`` stream) of lengths L·{1, 2, 4, 8} and, for
passkey, with the key at several depths.

One teacher-forced forward per batch: the answer tokens' logits come from ``GPT.hidden`` and
``GPT.logits`` at the answer positions only (so (B, T, V) logits never exist), and the
prediction is their argmax. That is exactly greedy decoding for the exact-match score: if
every answer token is the argmax given the true prefix, greedy decoding reproduces the answer,
and if one is not, greedy decoding fails at the first such token. ``token_accuracy`` is the
fraction of answer tokens right given the true prefix (teacher-forced, pooled over samples).

Rows follow ``evaluation/extrapolation.py``: learned PE past its table is "not applicable"
(never clamped), a length shorter than the task's layout is "skipped", nothing is estimated
from fewer samples than the row states. The samples depend only on (task, options, seed,
index, length, depth), so every scheme of an ablation answers the same questions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import torch

from data.synthetic import Task
from evaluation.extrapolation import LengthSweepOptions, _autocast, read_rows, write_rows
from model.gpt import GPT, uncompiled
from pelab.config import require

PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)


@dataclass
class TaskEvalConfig(LengthSweepOptions):
    section: ClassVar[str] = "eval.tasks"
    multipliers: Sequence[float] = (1, 2, 4, 8)  # eval lengths as multiples of the train length
    lengths: Sequence[int] = ()  # absolute eval lengths, added to the multiples
    depths: Sequence[float] = PASSKEY_DEPTHS  # passkey only: key depth, 0 = first token, 1 = before the question
    samples: int = 100  # per (length, depth)
    tokens_per_batch: int = 16384
    q_chunk: int = 1024  # attention query chunk for long sequences (memory bound)
    precision: str = "bf16-mixed"
    # packed documents: a task sample is one document with no separator, so only "none" applies
    documents: str | None = None

    def __post_init__(self) -> None:
        key = "eval.tasks"
        require(self.documents in (None, "none"), f"{key}.documents", self.documents,
                "null or none (a synthetic task sample is a single document, with no separator to pack by)")
        require(len(self.multipliers) + len(self.lengths) > 0, f"{key}.multipliers", list(self.multipliers),
                "a non-empty list when eval.tasks.lengths is empty")
        require(all(m > 0 for m in self.multipliers), f"{key}.multipliers", list(self.multipliers), "positive numbers")
        require(all(int(n) == n and n >= 1 for n in self.lengths), f"{key}.lengths", list(self.lengths),
                "positive integers")
        require(len(self.depths) > 0 and all(0 <= d <= 1 for d in self.depths), f"{key}.depths", list(self.depths),
                "a non-empty list of numbers in [0, 1]")
        for name in ("samples", "tokens_per_batch", "q_chunk"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"{key}.{name}", value,
                    "an integer >= 1")



@dataclass
class TaskRow:
    task: str
    scheme: str
    train_length: int
    eval_length: int
    depth: float  # NaN for tasks without a depth
    samples: int
    accuracy: float  # exact match: every answer token right
    token_accuracy: float  # answer tokens right, pooled over the samples
    seconds: float
    status: str = "ok"  # "ok", "not applicable: ...", "skipped: ..."
    documents: str = "none"  # packed documents read: always none (one sample, one document)

    @property
    def ok(self) -> bool:
        return self.status == "ok"


COLUMNS = [f.name for f in fields(TaskRow)]


def task_batch(task: Task, length: int, indices: Sequence[int], seed: int, depth: float | None = None,
               split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(indices), length) int64, of the given samples."""
    pairs = [task.sample(length, i, seed, split, 0, depth) for i in indices]
    return torch.from_numpy(np.stack([x for x, _ in pairs])), torch.from_numpy(np.stack([y for _, y in pairs]))


@torch.no_grad()
def score_batch(gpt: GPT, inputs: torch.Tensor, targets: torch.Tensor, q_chunk: int | None = 1024,
                precision: str = "bf16-mixed") -> tuple[torch.Tensor, int, int]:
    """(per-sample exact match (B,) bool, answer tokens right, answer tokens) of one batch;
    targets are -1 except at the answers."""
    device = next(gpt.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    answer = targets >= 0
    with _autocast(precision, device):
        h = gpt.hidden(inputs, q_chunk=q_chunk)
        predicted = gpt.logits(h[answer]).argmax(dim=-1)  # only the answer positions reach the LM head
    right = predicted == targets[answer]
    wrong = torch.zeros_like(answer)
    wrong[answer] = ~right
    return ~wrong.any(dim=1), int(right.sum()), int(answer.sum())


def evaluate_tasks(gpt: GPT, task: Task, train_length: int, config: TaskEvalConfig, seed: int,
                   log=print) -> list[TaskRow]:
    """Every (length, depth) row for one model on one task."""
    gpt = uncompiled(gpt)
    was_training = gpt.training
    gpt.eval()
    depths = [float(d) for d in config.depths] if task.name == "passkey" else [math.nan]
    rows: list[TaskRow] = []
    try:
        for length in config.eval_lengths(train_length):
            for depth in depths:
                row = TaskRow(task.name, gpt.pe.name, train_length, length, depth, 0, math.nan, math.nan, 0.0)
                row.status = _why_not_scored(gpt.pe, task, length) or "ok"
                if row.ok:
                    _score_row(gpt, task, row, config, seed)
                rows.append(row)
                log(format_row(row))
    finally:
        gpt.train(was_training)
    return rows


def _why_not_scored(pe, task: Task, length: int) -> str | None:
    if pe.max_positions is not None and length > pe.max_positions:
        return f"not applicable: pe={pe.name} has {pe.max_positions} positions"
    if length < task.min_length:
        return f"skipped: a {task.name} sample needs at least {task.min_length} tokens"
    return None


def _score_row(gpt: GPT, task: Task, row: TaskRow, config: TaskEvalConfig, seed: int) -> None:
    t0 = time.perf_counter()
    depth = None if math.isnan(row.depth) else row.depth
    batch = max(1, config.tokens_per_batch // row.eval_length)
    exact, right, total = 0, 0, 0
    for start in range(0, config.samples, batch):
        indices = range(start, min(config.samples, start + batch))
        inputs, targets = task_batch(task, row.eval_length, indices, seed, depth)
        ok, r, n = score_batch(gpt, inputs, targets, config.q_chunk, config.precision)
        exact, right, total = exact + int(ok.sum()), right + r, total + n
    row.seconds = time.perf_counter() - t0
    row.samples, row.accuracy, row.token_accuracy = config.samples, exact / config.samples, right / total


def format_row(row: TaskRow) -> str:
    depth = "" if math.isnan(row.depth) else f" depth={row.depth:g}"
    head = f"[tasks] task={row.task} pe={row.scheme} train={row.train_length} eval={row.eval_length}{depth}"
    if not row.ok:
        return f"{head}: {row.status}"
    return (f"{head}: accuracy {row.accuracy:.3f} (tokens {row.token_accuracy:.3f}) over {row.samples} samples "
            f"in {row.seconds:.1f}s")


def write_csv(rows: Sequence[TaskRow], path: Path) -> Path:
    return write_rows(rows, path, TaskRow)


def read_csv(path: Path) -> list[TaskRow]:
    return read_rows(path, TaskRow)


def depth_label(depth: float) -> str:
    return "—" if math.isnan(depth) else f"{depth:g}"


def mean_over_depths(rows: Sequence[TaskRow]) -> list[TaskRow]:
    """One row per (task, scheme, eval length): the sample-weighted accuracy over its depths
    (depth NaN). Rows of tasks without depths are returned as they are; a length with any
    row not ok keeps that row's status."""
    groups: dict[tuple, list[TaskRow]] = {}
    for r in rows:
        groups.setdefault((r.task, r.scheme, r.train_length, r.eval_length), []).append(r)
    merged = []
    for (task, scheme, train, length), members in groups.items():
        bad = next((r for r in members if not r.ok), None)
        if len(members) == 1 or bad is not None:
            merged.append(TaskRow(**{**asdict(bad or members[0]), "depth": math.nan}))
            continue
        n = sum(r.samples for r in members)
        merged.append(TaskRow(task, scheme, train, length, math.nan, n,
                              sum(r.accuracy * r.samples for r in members) / n,
                              sum(r.token_accuracy * r.samples for r in members) / n,  # equal answers per sample
                              sum(r.seconds for r in members)))
    return merged


def _series(rows: Sequence[TaskRow]) -> dict[str, list[TaskRow]]:
    """Plot/chart series: one per (scheme, depth), plus the mean over depths where there are several."""
    series: dict[str, list[TaskRow]] = {}
    several = len({r.depth for r in rows if not math.isnan(r.depth)}) > 1
    for r in rows:
        if r.ok:
            label = r.scheme if math.isnan(r.depth) else f"{r.scheme} depth={r.depth:g}"
            series.setdefault(label, []).append(r)
    if several:
        for r in mean_over_depths(rows):
            if r.ok:
                series.setdefault(f"{r.scheme} mean", []).append(r)
    return series


def plot_rows(rows: Sequence[TaskRow], title: str = "Task accuracy"):
    """Exact-match accuracy against eval length (log-x), one line per series; train length dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, points in sorted(_series(rows).items()):
        points.sort(key=lambda r: r.eval_length)
        ax.plot([r.eval_length for r in points], [r.accuracy for r in points], marker="o", label=label,
                linewidth=2.5 if label.endswith(" mean") else 1.2)
    for train_length in sorted({r.train_length for r in rows}):
        ax.axvline(train_length, color="grey", linestyle=":", linewidth=1)
    ax.set_xscale("log", base=2)
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel("evaluation length (tokens); dotted: training length")
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if any(r.ok for r in rows):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _cell(r: TaskRow) -> str:
    if r.ok:
        return f"{100 * r.accuracy:.1f}"
    return "n/a" if r.status.startswith("not applicable") else "—"


def markdown_table(rows: Sequence[TaskRow]) -> str:
    """One line per (task, scheme, depth), plus the mean over depths; exact-match accuracy in %."""
    lengths = sorted({r.eval_length for r in rows})
    lines_of: dict[tuple, dict[int, str]] = {}
    several = len({r.depth for r in rows if not math.isnan(r.depth)}) > 1
    for r in rows:
        lines_of.setdefault((r.task, r.scheme, depth_label(r.depth)), {})[r.eval_length] = _cell(r)
    if several:
        for r in mean_over_depths(rows):
            lines_of.setdefault((r.task, r.scheme, "mean"), {})[r.eval_length] = _cell(r)
    train = sorted({r.train_length for r in rows})
    header = "| task | scheme | depth | " + " | ".join(
        f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 3)]
    for (task, scheme, depth), cells in lines_of.items():
        lines.append(f"| {task} | {scheme} | {depth} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def save_results(rows: Sequence[TaskRow], out_dir: Path, title: str) -> dict[str, Path]:
    """tasks.csv + tasks.png + tasks.md in ``out_dir``, so nothing depends on W&B."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, out_dir / "tasks.csv"), "png": out_dir / "tasks.png", "md": out_dir / "tasks.md"}
    fig = plot_rows(rows, title=title)
    fig.savefig(paths["png"])
    import matplotlib.pyplot as plt

    plt.close(fig)
    paths["md"].write_text("Exact-match accuracy (%) by evaluation length (tokens).\n\n" + markdown_table(rows))
    return paths


def summary_metrics(rows: Sequence[TaskRow], prefix: str = "tasks") -> dict[str, float]:
    """``{prefix}/{task}/accuracy@{length}`` (mean over depths) and, for passkey,
    ``{prefix}/{task}/depth{d}/accuracy@{length}``; ok rows only."""
    metrics = {}
    for r in rows:
        if r.ok and not math.isnan(r.depth):
            metrics[f"{prefix}/{r.task}/depth{r.depth:g}/accuracy@{r.eval_length}"] = r.accuracy
    for r in mean_over_depths(rows):
        if r.ok:
            metrics[f"{prefix}/{r.task}/accuracy@{r.eval_length}"] = r.accuracy
            metrics[f"{prefix}/{r.task}/token_accuracy@{r.eval_length}"] = r.token_accuracy
    return metrics


def log_to_wandb(rows: Sequence[TaskRow], run, png: Path | None = None, prefix: str = "tasks") -> None:
    """A wandb.Table, an accuracy-vs-length line chart (one line per depth), the PNG, summary scalars."""
    import wandb

    payload = {f"{prefix}/table": wandb.Table(columns=COLUMNS, data=[[getattr(r, c) for c in COLUMNS] for r in rows])}
    series = _series(rows)
    if series:
        lengths = sorted({r.eval_length for points in series.values() for r in points})
        ys = [[next((r.accuracy for r in points if r.eval_length == n), float("nan")) for n in lengths]
              for points in series.values()]
        # W&B line charts have no log axis setting: plot against log2(length) instead.
        payload[f"{prefix}/accuracy_vs_length"] = wandb.plot.line_series(
            xs=[math.log2(n) for n in lengths], ys=ys, keys=list(series),
            title="exact-match accuracy vs eval length", xname="log2(eval length)")
    if png is not None and Path(png).exists():
        payload[f"{prefix}/plot"] = wandb.Image(str(png))
    run.log(payload)
    for key, value in summary_metrics(rows, prefix).items():
        run.summary[key] = value


def run_task_evaluation(options: dict, module, datamodule, loggers: list, output_dir: Path, step: int
                        ) -> list[TaskRow]:
    """The end-of-training task evaluation (rank zero): the accuracy table of the trained model
    on the data module's task, CSV/PNG/markdown under ``output_dir/tasks``, W&B table and chart.
    ``options``: ``eval.tasks`` (``enabled: false`` skips); the training length is the model's."""
    from pelab.loggers import log_results

    options = dict(options)
    if not options.pop("enabled", True):
        return []
    config = TaskEvalConfig.from_dict(options)
    train_length = module.config.block_size
    rows = evaluate_tasks(module.model, datamodule.task, train_length, config, seed=datamodule.seed)
    paths = save_results(rows, output_dir / "tasks",
                         title=f"{datamodule.task.name}: pe={module.pe_name}, trained at {train_length}")
    log_results(loggers, log_to_wandb, rows, paths["png"], summary_metrics(rows), step)
    print(f"[pelab] task accuracy table: {paths['csv']} (+ .png, .md)", flush=True)
    return rows
