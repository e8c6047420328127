"""Synthetic-task accuracy against length: a model trained on ``data/synthetic.py`` samples of
length L answers fresh samples (the ``test`` stream) of lengths L·{1, 2, 4, 8} and, for
the retrieval tasks with a depth (passkey, niah, multi_key, find_block), with the key at several depths.

One teacher-forced forward per batch: the answer tokens' logits come from ``GPT.hidden`` and
``GPT.logits`` at the answer positions only (so (B, T, V) logits never exist), and the
prediction is their argmax. That is exactly greedy decoding for the exact-match score: if
every answer token is the argmax given the true prefix, greedy decoding reproduces the answer,
and if one is not, greedy decoding fails at the first such token. ``token_accuracy`` is the
fraction of answer tokens right given the true prefix (teacher-forced, pooled over samples).
Tasks whose answer is a set (``Task.set_valued``: graphwalks, common_words, frequent_words) also
get ``f1``, the mean over samples of the F1 of the predicted elements against the true set,
teacher-forced too (``set_f1``): GraphWalks' score; NaN for every other task.

Rows follow ``evaluation/extrapolation.py``: learned PE past its table is "not applicable"
(never clamped), a length shorter than the task's layout is "skipped", nothing is estimated
from fewer samples than the row states. The samples depend only on (task, options, seed,
index, length, depth), so every scheme of an ablation answers the same questions.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import ClassVar, Sequence

import numpy as np
import torch

from data.synthetic import Task
from data.tasks_2025 import END, SET_ELEMENT_WIDTH
from evaluation.compare import Runs, base_label, group_points, label_rows, make_cells
from evaluation.compare_report import plot_bands, save_figure, stats_sections, write_stats_csv
from evaluation.plots import length_axis
from evaluation.probe import Comparison, Probe
from evaluation.results import Logged, log2_chart, table
from evaluation.sweep import (POSITION_MODES, LengthSweepOptions, autocast, eval_positions, read_rows, rope_scalings,
                              scaled_name, scaling_at, why_not_randomized, why_not_scaled, write_rows)
from model.config import require
from model.gpt import GPT, Pass
from model.unwrap import uncompiled
from model.pe.scaling import scaled

PASSKEY_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
#: A run learned its task when the exact match at the training length, over held-out samples
#: (the ``test`` stream) and every depth, reaches this; rows of runs that did not say so.
LEARNED_THRESHOLD = 0.9


@dataclass
class TaskEvalConfig(LengthSweepOptions):
    section: ClassVar[str] = "eval.tasks"
    multipliers: Sequence[float] = (1, 2, 4, 8)  # eval lengths as multiples of the train length
    lengths: Sequence[int] = ()  # absolute eval lengths, added to the multiples
    depths: Sequence[float] = PASSKEY_DEPTHS  # tasks with a depth: key depth, 0 = first token, 1 = before the question
    samples: int = 100  # per (length, depth)
    tokens_per_batch: int = 16384
    q_chunk: int = 1024  # attention query chunk for long sequences (memory bound)
    precision: str = "bf16-mixed"
    positions: str = "sequential"  # POSITION_MODES (eval.positions)
    positions_seed: int = 0
    rope_scaling: Sequence[str | None] = (None,)  # None (the model as trained) and/or linear, ntk, dynamic_ntk, yarn
    rope_scaling_factor: float | None = None  # None = eval length / train length (1 for dynamic_ntk)
    # packed documents: a task sample is one document with no separator, so only "none" applies
    documents: str | None = None
    f1: bool | None = None  # F1 of set-valued answers: null = for tasks with set answers; true = required

    def __post_init__(self) -> None:
        key = "eval.tasks"
        require(self.f1 in (None, True, False), f"{key}.f1", self.f1, "null (for set-valued tasks), true or false")
        require(self.positions in POSITION_MODES, "eval.positions", self.positions, " or ".join(POSITION_MODES))
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
        self.rope_scaling = rope_scalings(self.rope_scaling, self.rope_scaling_factor, key)

    def check_task(self, task: Task) -> None:
        """F1 asked of a task whose answers are single (not sets) is refused, naming both."""
        require(self.f1 is not True or task.set_valued, "eval.tasks.f1", self.f1,
                f"null or false for data.task={task.name}: its answer is a single one, and F1 scores set-valued "
                f"answers ({', '.join(SET_ELEMENT_WIDTH)})")

    def scores_f1(self, task: Task) -> bool:
        return self.f1 is not False and task.set_valued



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
    positions: str = "sequential"  # POSITION_MODES: what the model saw
    learned: str = ""  # "yes" / "no": the run's exact match at its training length >= LEARNED_THRESHOLD; "" unknown
    documents: str = "none"  # packed documents read: always none (one sample, one document)
    rope_scaling: str = "none"  # evaluation-time RoPE scaling (factor: eval length / train length unless given)
    f1: float = math.nan  # set-valued tasks: mean F1 of the predicted set (teacher-forced); NaN otherwise

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def not_learned(self) -> bool:
        return self.learned == "no"


COLUMNS = [f.name for f in fields(TaskRow)]


def task_batch(task: Task, length: int, indices: Sequence[int], seed: int, depth: float | None = None,
               split: str = "test") -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (len(indices), length) int64, of the given samples."""
    pairs = [task.sample(length, i, seed, split, 0, depth) for i in indices]
    return torch.from_numpy(np.stack([x for x, _ in pairs])), torch.from_numpy(np.stack([y for _, y in pairs]))


@torch.no_grad()
def predict_answers(gpt: GPT, inputs: torch.Tensor, targets: torch.Tensor, q_chunk: int | None = 1024,
                    precision: str = "bf16-mixed", positions: torch.Tensor | None = None) -> torch.Tensor:
    """(B, T) argmax predictions at the answer positions (targets >= 0), -1 elsewhere, on the
    targets' device; ``positions``: (B, T), default 0..T-1."""
    device = next(gpt.parameters()).device
    inputs, targets = inputs.to(device), targets.to(device)
    answer = targets >= 0
    with autocast(precision, device):
        h = gpt.hidden(inputs, positions, how=Pass(q_chunk=q_chunk))
        predicted = gpt.logits(h[answer]).argmax(dim=-1)  # only the answer positions reach the LM head
    out = torch.full_like(targets, -1)
    out[answer] = predicted
    return out


def score_batch(gpt: GPT, inputs: torch.Tensor, targets: torch.Tensor, q_chunk: int | None = 1024,
                precision: str = "bf16-mixed", positions: torch.Tensor | None = None) -> tuple[torch.Tensor, int, int]:
    """(per-sample exact match (B,) bool, answer tokens right, answer tokens) of one batch;
    targets are -1 except at the answers. ``positions``: (B, T), default 0..T-1."""
    predicted = predict_answers(gpt, inputs, targets, q_chunk, precision, positions)
    return _exact(predicted, targets.to(predicted.device))


def _exact(predicted: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    answer = targets >= 0
    wrong = answer & (predicted != targets)
    return ~wrong.any(dim=1), int((answer & ~wrong).sum()), int(answer.sum())


def set_f1(predicted: Sequence[int], target: Sequence[int], width: int, end: int) -> float:
    """F1 of one set-valued answer, teacher-forced: ``target`` is the answer's tokens (elements of
    ``width`` tokens, then ``end``), ``predicted`` the argmax at each of them given the true
    prefix. Predicted elements are the predictions at the element positions that hold no
    ``end``; a prediction other than ``end`` at the end position is one element too many. Both
    sets empty: 1."""
    true = {tuple(target[i : i + width]) for i in range(0, len(target) - 1, width)}
    guessed = [tuple(predicted[i : i + width]) for i in range(0, len(predicted) - 1, width)]
    chosen = {g for g in guessed if end not in g}
    extra = int(predicted[-1] != end)
    if not true and not chosen and not extra:
        return 1.0
    return 2 * len(chosen & true) / (len(chosen) + extra + len(true))


def evaluate_tasks(gpt: GPT, task: Task, train_length: int, config: TaskEvalConfig, seed: int,
                   log=print, randomize_to: int | None = None) -> list[TaskRow]:
    """Every (length, depth) row for one model on one task, each marked with whether the model
    learned the task at ``train_length`` (``mark_learned``). ``randomize_to``: the model's
    ``pe.randomize_to`` (for ``config.positions == "randomized"``)."""
    config.check_task(task)
    gpt = uncompiled(gpt)
    was_training = gpt.training
    gpt.eval()
    depths = [float(d) for d in config.depths] if task.has_depth else [math.nan]
    rows: list[TaskRow] = []
    try:
        for kind in (s or "none" for s in config.rope_scaling):
            series = []
            for length in config.eval_lengths(train_length):
                for depth in depths:
                    row = TaskRow(task.name, gpt.pe.name, train_length, length, depth, 0, math.nan, math.nan, 0.0,
                                  positions=config.positions, rope_scaling=kind)
                    row.status = (why_not_scaled(gpt.pe, kind) or why_not_randomized(config.positions, randomize_to,
                                                                                     length)
                                  or _why_not_scored(gpt.pe, task, length) or "ok")
                    if row.ok:
                        _score_row(gpt, task, row, config, seed, randomize_to)
                    series.append(row)
                    log(format_row(row))
            mark_learned(series)  # each scaling's own exact match at L (factor 1 there: the plain model's)
            rows.extend(series)
    finally:
        gpt.train(was_training)
    return rows


def mark_learned(rows: Sequence[TaskRow], threshold: float = LEARNED_THRESHOLD) -> str:
    """Set ``learned`` on every row of one run: "yes" when the sample-weighted exact match at the
    training length (over its depths) is >= ``threshold``, "no" below, "" when not measured there."""
    at_train = [r for r in mean_over_depths(rows) if r.ok and r.eval_length == r.train_length]
    verdict = "" if not at_train else ("yes" if at_train[0].accuracy >= threshold else "no")
    for r in rows:
        r.learned = verdict
    return verdict


def _why_not_scored(pe, task: Task, length: int) -> str | None:
    if pe.max_positions is not None and length > pe.max_positions:
        return f"not applicable: pe={pe.name} has {pe.max_positions} positions"
    if length < task.min_length:
        return f"skipped: a {task.name} sample needs at least {task.min_length} tokens"
    if task.max_length is not None and length > task.max_length:
        return f"skipped: a {task.name} sample holds at most {task.max_length} tokens"
    return None


def _score_row(gpt: GPT, task: Task, row: TaskRow, config: TaskEvalConfig, seed: int,
               randomize_to: int | None = None) -> None:
    t0 = time.perf_counter()
    depth = None if math.isnan(row.depth) else row.depth
    batch = max(1, config.tokens_per_batch // row.eval_length)
    exact, right, total, f1 = 0, 0, 0, []
    scaling = scaling_at(row.rope_scaling, config.rope_scaling_factor, row.eval_length, row.train_length)
    with scaled(gpt.pe, scaling):  # on for this row only
        for start in range(0, config.samples, batch):
            indices = range(start, min(config.samples, start + batch))
            inputs, targets = task_batch(task, row.eval_length, indices, seed, depth)
            where = eval_positions(config.positions, indices, row.eval_length, randomize_to, config.positions_seed,
                                   next(gpt.parameters()).device)
            predicted = predict_answers(gpt, inputs, targets, config.q_chunk, config.precision, where).cpu()
            ok, r, n = _exact(predicted, targets)
            exact, right, total = exact + int(ok.sum()), right + r, total + n
            if config.scores_f1(task):
                f1 += [set_f1(p[t >= 0].tolist(), t[t >= 0].tolist(), SET_ELEMENT_WIDTH[task.name], END)
                       for p, t in zip(predicted, targets)]
    row.seconds = time.perf_counter() - t0
    row.samples, row.accuracy, row.token_accuracy = config.samples, exact / config.samples, right / total
    row.f1 = sum(f1) / len(f1) if f1 else math.nan


def format_row(row: TaskRow) -> str:
    depth = "" if math.isnan(row.depth) else f" depth={row.depth:g}"
    head = (f"[tasks] task={row.task} pe={row.scheme}"
            + ("" if row.rope_scaling == "none" else f" scaling={row.rope_scaling}")
            + f" train={row.train_length} eval={row.eval_length}{depth}"
            + ("" if row.positions == "sequential" else f" positions={row.positions}"))
    if not row.ok:
        return f"{head}: {row.status}"
    f1 = "" if math.isnan(row.f1) else f", F1 {row.f1:.3f}"
    return (f"{head}: accuracy {row.accuracy:.3f} (tokens {row.token_accuracy:.3f}{f1}) over {row.samples} samples "
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
        groups.setdefault((r.task, r.scheme, r.rope_scaling, r.train_length, r.eval_length), []).append(r)
    merged = []
    for (task, scheme, scaling, train, length), members in groups.items():
        bad = next((r for r in members if not r.ok), None)
        if len(members) == 1 or bad is not None:
            merged.append(TaskRow(**{**asdict(bad or members[0]), "depth": math.nan}))
            continue
        n = sum(r.samples for r in members)
        merged.append(TaskRow(task, scheme, train, length, math.nan, n,
                              sum(r.accuracy * r.samples for r in members) / n,
                              sum(r.token_accuracy * r.samples for r in members) / n,  # equal answers per sample
                              sum(r.seconds for r in members), positions=members[0].positions,
                              learned=members[0].learned, rope_scaling=scaling))
    return merged


NOT_LEARNED = " [not learned at L]"
LEARNED_NOTE = (f"[not learned at L]: exact match below {100 * LEARNED_THRESHOLD:g}% on held-out samples at the "
                "training length (a task placed at depths: their mean), so its longer lengths say nothing about "
                "extrapolation.\n")


def scheme_label(r: TaskRow) -> str:
    """The scheme (+ its evaluation-time scaling), marked when its run did not learn the task at
    the training length."""
    return scaled_name(r.scheme, r.rope_scaling) + (NOT_LEARNED if r.not_learned else "")


def _series(rows: Sequence[TaskRow]) -> dict[str, list[TaskRow]]:
    """Plot/chart series: one per (scheme, depth), plus the mean over depths where there are several."""
    series: dict[str, list[TaskRow]] = {}
    several = len({r.depth for r in rows if not math.isnan(r.depth)}) > 1
    for r in rows:
        if r.ok:
            label = scheme_label(r) if math.isnan(r.depth) else f"{scheme_label(r)} depth={r.depth:g}"
            series.setdefault(label, []).append(r)
    if several:
        for r in mean_over_depths(rows):
            if r.ok:
                series.setdefault(f"{scheme_label(r)} mean", []).append(r)
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
    length_axis(ax, (r.train_length for r in rows))
    ax.set_ylim(-0.03, 1.03)
    ax.set_ylabel("exact-match accuracy")
    ax.set_title(title)
    if any(r.ok for r in rows):
        ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _cell(r: TaskRow) -> str:
    if r.ok:
        return f"{100 * r.accuracy:.1f}" + ("" if math.isnan(r.f1) else f" (F1 {100 * r.f1:.1f})")
    return "n/a" if r.status.startswith("not applicable") else "—"


def markdown_table(rows: Sequence[TaskRow]) -> str:
    """One line per (task, scheme, depth), plus the mean over depths; exact-match accuracy in %."""
    lengths = sorted({r.eval_length for r in rows})
    lines_of: dict[tuple, dict[int, str]] = {}
    several = len({r.depth for r in rows if not math.isnan(r.depth)}) > 1
    for r in rows:
        lines_of.setdefault((r.task, scheme_label(r), depth_label(r.depth)), {})[r.eval_length] = _cell(r)
    if several:
        for r in mean_over_depths(rows):
            lines_of.setdefault((r.task, scheme_label(r), "mean"), {})[r.eval_length] = _cell(r)
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
    text = ("Exact-match accuracy (%) by evaluation length (tokens).\n\n" + F1_NOTE * _has_f1(rows)
            + markdown_table(rows))
    paths["md"].write_text(text + (f"\n{LEARNED_NOTE}" if any(r.not_learned for r in rows) else ""))
    if any(r.ok and not math.isnan(r.depth) for r in rows):
        paths["heatmap_csv"] = write_heatmap_csv(rows, out_dir / "heatmap.csv")
        paths["heatmap"] = out_dir / "heatmap.png"
        fig = plot_heatmaps(rows, title=title)
        fig.savefig(paths["heatmap"])
        plt.close(fig)
    return paths


def depth_length_grid(rows: Sequence[TaskRow]) -> tuple[list[float], list[int], np.ndarray]:
    """(depths, lengths, accuracy[depth, length]) of one run's rows (NaN where not scored)."""
    scored = [r for r in rows if not math.isnan(r.depth)]
    depths = sorted({r.depth for r in scored})
    lengths = sorted({r.eval_length for r in scored})
    grid = np.full((len(depths), len(lengths)), np.nan)
    for r in scored:
        if r.ok:
            grid[depths.index(r.depth), lengths.index(r.eval_length)] = r.accuracy
    return depths, lengths, grid


def write_heatmap_csv(rows: Sequence[TaskRow], path: Path) -> Path:
    """One line per (scheme, depth), one column per eval length: exact-match accuracy (empty: not scored)."""
    import csv

    lengths = sorted({r.eval_length for r in rows if not math.isnan(r.depth)})
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["task", "scheme", "learned", "depth", *lengths])
        for (task, scheme), members in _by_run(rows).items():
            depths, cols, grid = depth_length_grid(members)
            for i, depth in enumerate(depths):
                cells = {n: grid[i, j] for j, n in enumerate(cols)}
                writer.writerow([task, scheme, members[0].learned, f"{depth:g}",
                                 *("" if math.isnan(cells.get(n, math.nan)) else f"{cells[n]:.4f}" for n in lengths)])
    return path


def _by_run(rows: Sequence[TaskRow]) -> dict[tuple[str, str], list[TaskRow]]:
    """Rows with a depth by (task, scheme [+ scaling]): one heatmap panel each."""
    out: dict[tuple[str, str], list[TaskRow]] = {}
    for r in rows:
        if not math.isnan(r.depth):
            out.setdefault((r.task, scaled_name(r.scheme, r.rope_scaling)), []).append(r)
    return out


def plot_heatmaps(rows: Sequence[TaskRow], title: str = "Retrieval accuracy"):
    """The depth x length grid of exact-match accuracy, one panel per (task, scheme): depth down
    (0 = start of the context), eval length across, the training length's column outlined."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _by_run(rows)
    n = max(1, len(panels))
    cols = min(n, 4)
    fig, axes = plt.subplots((n + cols - 1) // cols, cols, figsize=(3.2 * cols + 0.8, 2.8 * ((n + cols - 1) // cols)),
                             dpi=120, squeeze=False)
    image = None
    for ax, ((task, scheme), members) in zip(axes.ravel(), panels.items()):
        depths, lengths, grid = depth_length_grid(members)
        image = ax.imshow(np.ma.masked_invalid(grid), vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        for i in range(len(depths)):
            for j in range(len(lengths)):
                text = "—" if math.isnan(grid[i, j]) else f"{100 * grid[i, j]:.0f}"
                ax.text(j, i, text, ha="center", va="center", fontsize=7)
        ax.set_xticks(range(len(lengths)), [str(x) for x in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths], fontsize=7)
        train = members[0].train_length
        if train in lengths:
            j = lengths.index(train)
            ax.add_patch(plt.Rectangle((j - 0.5, -0.5), 1, len(depths), fill=False, linestyle=":", linewidth=1.5))
        ax.set_title(f"{task} {scheme_label(members[0])}", fontsize=8)
        ax.set_xlabel("eval length (dotted: training)", fontsize=7)
        ax.set_ylabel("depth", fontsize=7)
    for ax in axes.ravel()[len(panels):]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="exact match")
    fig.suptitle(title, fontsize=9)
    return fig


def summary_metrics(rows: Sequence[TaskRow], prefix: str = "tasks") -> dict[str, float]:
    """``{prefix}/{task}/accuracy@{length}`` (mean over depths) and, for passkey,
    ``{prefix}/{task}/depth{d}/accuracy@{length}``; with an evaluation-time scaling,
    ``{prefix}/{task}/{scaling}/...``; ok rows only."""
    def key(r: TaskRow) -> str:
        return f"{prefix}/{r.task}" + ("" if r.rope_scaling == "none" else f"/{r.rope_scaling}")

    metrics = {}
    for r in rows:
        if r.ok and not math.isnan(r.depth):
            metrics[f"{key(r)}/depth{r.depth:g}/accuracy@{r.eval_length}"] = r.accuracy
    for r in mean_over_depths(rows):
        if r.ok:
            metrics[f"{key(r)}/accuracy@{r.eval_length}"] = r.accuracy
            metrics[f"{key(r)}/token_accuracy@{r.eval_length}"] = r.token_accuracy
            if not math.isnan(r.f1):
                metrics[f"{key(r)}/f1@{r.eval_length}"] = r.f1
    return metrics


def loggable(rows: Sequence[TaskRow], png: Path | None = None, prefix: str = "tasks") -> Logged:
    """The table, an accuracy-vs-log2(length) line chart (one line per depth), the PNG and the
    heatmap beside it, summary scalars."""
    logged = Logged(tables={f"{prefix}/table": table(rows, COLUMNS)})
    series = _series(rows)
    if series:
        logged.charts[f"{prefix}/accuracy_vs_length"] = log2_chart(
            series, "eval_length", "accuracy", "exact-match accuracy vs eval length", "log2(eval length)")
    if png is not None and Path(png).exists():
        logged.add_image(f"{prefix}/plot", png)
        logged.add_image(f"{prefix}/heatmap", Path(png).with_name("heatmap.png"))
    logged.summary = summary_metrics(rows, prefix)
    if rows and rows[0].learned:
        logged.summary[f"{prefix}/{rows[0].task}/learned_at_train_length"] = rows[0].learned == "yes"
    return logged


def announce(rows: Sequence[TaskRow], paths: dict[str, Path]) -> str:
    """Where the files are, and whether the run learned its task at the training length."""
    verdict = {"yes": "learned", "no": "NOT learned", "": "not measured"}[rows[0].learned if rows else ""]
    heatmap = ", heatmap.png/.csv" if "heatmap" in paths else ""
    return (f"[pelab] task accuracy table: {paths['csv']} (+ .png, .md{heatmap}); task {verdict} at the training "
            f"length (criterion: exact match >= {100 * LEARNED_THRESHOLD:g}% on held-out samples)")


# --- across runs: scripts/compare_runs.py ----------------------------------------------------

TASK_CAPTION = "Exact-match accuracy (%) by evaluation length (tokens)"
F1_CAPTION = "F1 (%) of the set-valued answer by evaluation length (tokens), teacher-forced, mean over samples."
F1_NOTE = "Set-valued answers: (F1 %) beside the exact match, teacher-forced, mean over samples.\n\n"


def task_caption(rows: Sequence[TaskRow]) -> str:
    """The accuracy section's caption: "mean over depths" only for a task scored at depths."""
    return TASK_CAPTION + (", mean over depths." if any(not math.isnan(r.depth) for r in rows) else ".")


def _has_f1(rows: Sequence[TaskRow]) -> bool:
    return any(not math.isnan(r.f1) for r in rows)


def label_task_rows(pairs: list[tuple[str, TaskRow]], groups: dict | None = None) -> list[TaskRow]:
    """``label_rows`` for task rows: their label already carries the evaluation-time scaling
    (``rope+ntk``), so the field is cleared, else the tasks' own labels add it a second time. The
    not-learned mark is left to those labels (``scheme_label``), which add it once."""
    return [replace(r, rope_scaling="none") for r in label_rows(pairs, groups)]


def not_learned_marks(runs: Runs, pairs: list[tuple[str, TaskRow]]) -> dict[str, str]:
    """Group label -> " [k/n not learned at L]" for groups with runs below the learned criterion."""
    learned: dict[str, dict[str, bool]] = {}
    for run, r in pairs:
        group = runs.groups.get((base_label(r), run))
        if group is not None:
            learned.setdefault(group.label, {})[run] = learned.get(group.label, {}).get(run, False) or r.not_learned
    return {label: f" [{sum(v.values())}/{len(v)} not learned at L]" for label, v in learned.items() if any(v.values())}


def heatmap_rows(runs: Runs, pairs: list[tuple[str, TaskRow]]) -> list[TaskRow]:
    """Depth x length accuracy per group (the mean over its seeds), for the heatmap panels."""
    marks = not_learned_marks(runs, pairs)
    cells: dict[tuple, list] = {}
    for run, r in pairs:
        group = runs.groups.get((base_label(r), run))
        if group is not None and not math.isnan(r.depth):
            cells.setdefault((r.task, group.label, r.train_length, r.eval_length, r.depth), []).append(r)
    rows = []
    for (task, label, train, length, depth), members in cells.items():
        ok = [r for r in members if r.ok]
        accuracy = sum(r.accuracy for r in ok) / len(ok) if ok else math.nan
        rows.append(TaskRow(task, label + marks.get(label, ""), train, length, depth, sum(r.samples for r in ok),
                            accuracy, math.nan, 0.0, "ok" if ok else members[0].status))
    return rows


def single_seed_task_table(rows: list[TaskRow], task: str) -> str:
    """One line per run: exact-match accuracy (%) averaged over depths."""
    merged = mean_over_depths([r for r in rows if r.task == task])
    lengths = sorted({r.eval_length for r in merged})
    train = {r.train_length for r in merged}
    cells_of: dict[str, dict[int, str]] = {}
    for r in merged:
        cells_of.setdefault(scheme_label(r), {})[r.eval_length] = _cell(r)
    header = "| scheme | " + " | ".join(f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 1)]
    lines += [f"| {label} | " + " | ".join(cells.get(n, "") for n in lengths) + " |" for label, cells in cells_of.items()]
    return "\n".join(lines) + "\n"


def comparison_sections(runs: Runs, pairs: list[tuple[str, TaskRow]], out: Path) -> list[str]:
    """comparison_tasks.{csv,png} and one markdown section per task; comparison_heatmap.{csv,png}
    (depth x length, mean over seeds) and the note on runs that did not learn their task."""
    if not pairs:
        return []
    if not runs.multi_seed:
        rows = label_task_rows(pairs, runs.groups)
        write_csv(rows, out / "comparison_tasks.csv")
        save_figure(plot_rows(mean_over_depths(rows), title="Task accuracy vs evaluation length"),
                    out / "comparison_tasks.png")
        sections = [f"### {task}\n\n{task_caption(mine)}\n\n{F1_NOTE * _has_f1(mine)}{single_seed_task_table(rows, task)}"
                    for task in sorted({r.task for r in rows}) for mine in [[r for r in rows if r.task == task]]]
    else:
        by_run: dict[str, list[TaskRow]] = {}
        for run, r in pairs:
            by_run.setdefault(run, []).append(r)
        merged = [(run, m) for run, rows in by_run.items() for m in mean_over_depths(rows)]  # a run's mean over depths
        points = group_points(runs, merged, lambda r: (r.task, r.train_length, r.eval_length),
                              lambda r: 100 * r.accuracy)  # percent in tables and plots
        cells = make_cells(points, lower_is_better=False)
        # set-valued tasks: their F1 as a section of its own, "TASK F1", right after the task's
        f1_cells = make_cells(group_points(runs, [(run, m) for run, m in merged if not math.isnan(m.f1)],
                                           lambda r: (f"{r.task} F1", r.train_length, r.eval_length),
                                           lambda r: 100 * r.f1), lower_is_better=False)
        marks = not_learned_marks(runs, pairs)
        for c in cells + f1_cells:
            c.label += marks.get(c.label, "")  # once, on the group's label
        write_stats_csv(cells + f1_cells, out / "comparison_tasks.csv", "task")
        save_figure(plot_bands(cells, "exact-match accuracy (%)", "Task accuracy vs evaluation length"),
                    out / "comparison_tasks.png")
        sections = stats_sections(cells + f1_cells, "{:.1f}", lambda task: f"### {task}\n\n" + (
            F1_CAPTION if task.endswith(" F1") else task_caption([r for _, r in pairs if r.task == task])))
    grid = heatmap_rows(runs, pairs)
    if grid:
        write_heatmap_csv(grid, out / "comparison_heatmap.csv")
        save_figure(plot_heatmaps(grid, title="Exact match by depth and evaluation length (mean over seeds)"),
                    out / "comparison_heatmap.png")
    return sections + ([LEARNED_NOTE] if any(r.not_learned for _, r in pairs) else [])


def comparison_charts(runs: Runs, pairs: list[tuple[str, TaskRow]], out: Path) -> dict[str, Logged]:
    """W&B: every seed's line (the PNG has the means and intervals)."""
    return {"comparison-tasks": loggable(label_task_rows(pairs), out / "comparison_tasks.png")} if pairs else {}


COMPARISON = Comparison("tasks.csv", TaskRow, series=lambda r: (r.task, r.scheme, r.rope_scaling),
                        section=comparison_sections, place=30, charts=comparison_charts)

PROBE = Probe(
    name="tasks", config=TaskEvalConfig, needs="task", output="tasks",
    evaluate=lambda s, config: evaluate_tasks(s.gpt, s.task, s.train_length, config, seed=s.seed, log=s.log,
                                              randomize_to=s.randomize_to),
    save=save_results, reports=lambda rows, paths: [(loggable(rows, paths["png"]), summary_metrics(rows))],
    announce=announce, title=lambda s: f"{s.task.name}: {s.title}", compare=(COMPARISON,),
    switch=(True, False, "auto"), switch_help="auto (on for data=synthetic), true or false")
