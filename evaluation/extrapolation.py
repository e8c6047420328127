"""Extrapolation perplexity: a model trained at context L scored on held-out text at longer lengths.

Two protocols, named in every row:

- ``nonoverlapping``: the text is cut into consecutive windows of the eval length and every
  target of every window is scored (the ALiBi paper's main protocol);
- ``sliding``: windows of the eval length advance by ``stride`` and only the last ``stride``
  targets of each window are scored, so every scored token sees at least
  ``length - stride`` tokens of context. ``stride == length`` is exactly ``nonoverlapping``.

A length that needs positions the scheme does not have (learned PE past its table) is
reported as not applicable; a length longer than the held-out text is skipped with a
message. Nothing is clamped and no number comes from fewer or shorter windows than stated.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar, Iterator, Sequence

import numpy as np
import torch

from data.packing import MODES as DOCUMENT_MODES
from data.packing import DocumentOptions
from evaluation import position_loss
from evaluation.compare import CompareError, Runs, group_points, label_rows, make_cells
from evaluation.compare_report import plot_bands, save_figure, stats_sections, write_stats_csv
from evaluation.position_loss import PositionLossRow, PositionSums, bin_rows
from evaluation.probe import Comparison, Probe, Report
from evaluation.plots import length_axis
from evaluation.results import Logged, log2_chart, table
from evaluation.sweep import (POSITION_MODES, LengthSweepOptions, autocast, distributed_sum, eval_positions,
                              read_rows, rope_scalings, scaling_at, shard_of, why_not_randomized, why_not_scaled,
                              write_rows)
from model.config import require
from model.gpt import GPT
from model.unwrap import uncompiled
from model.pe.scaling import scaled

MODES = ("nonoverlapping", "sliding")


@dataclass
class ExtrapolationConfig(LengthSweepOptions):
    section: ClassVar[str] = "extrapolation"

    multipliers: Sequence[float] = (1, 2, 4, 8, 16)  # eval lengths as multiples of the train length
    lengths: Sequence[int] = ()  # absolute eval lengths, added to the multiples
    modes: Sequence[str] = ("nonoverlapping",)
    stride: int | None = None  # sliding stride; None = half the eval length
    max_tokens: int | None = None  # scored tokens per length (whole windows); None = all held-out text
    tokens_per_batch: int = 16384
    q_chunk: int = 1024  # attention query chunk: bounds the (heads, T, T) mask at long lengths
    rope_scaling: Sequence[str | None] = (None,)  # None (plain) and/or linear, ntk, dynamic_ntk, yarn
    rope_scaling_factor: float | None = None  # None = eval length / train length (1 for dynamic_ntk)
    precision: str = "bf16-mixed"
    positions: str = "sequential"  # POSITION_MODES (eval.positions)
    positions_seed: int = 0  # randomized positions: the draws depend on (seed, length, window start)
    position_bins_per_octave: int = 4  # loss by position: log-spaced bins past 2 L
    # packed documents (data/packing.py): None = as the run trained, or a mode, or a list of
    # them (every row once per mode, e.g. [none, both])
    documents: str | Sequence[str | None] | None = None

    def __post_init__(self) -> None:
        key = "eval.extrapolation"
        require(self.positions in POSITION_MODES, "eval.positions", self.positions, " or ".join(POSITION_MODES))
        require(self.position_bins_per_octave >= 1, f"{key}.position_bins_per_octave", self.position_bins_per_octave,
                ">= 1")
        given = self.documents
        self.documents = list(given) if isinstance(given, (list, tuple)) else [given]
        self.documents = [None if m in (None, "null") else m for m in self.documents] or [None]
        require(all(m is None or m in DOCUMENT_MODES for m in self.documents), f"{key}.documents", given,
                f"null (as the run trained), one of {', '.join(DOCUMENT_MODES)}, or a list of them")
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown extrapolation mode(s) {bad}; valid choices: {', '.join(MODES)}")
        for name in ("stride", "max_tokens", "tokens_per_batch", "q_chunk"):
            value = getattr(self, name)
            require(value is None or value >= 1, f"{key}.{name}", value, ">= 1")
        if any(m <= 0 for m in self.multipliers) or any(n < 1 for n in self.lengths):
            raise ValueError(f"eval lengths must be positive, got multipliers={list(self.multipliers)} "
                             f"lengths={list(self.lengths)}")
        self.rope_scaling = rope_scalings(self.rope_scaling, self.rope_scaling_factor, key)


@dataclass
class ExtrapolationRow:
    scheme: str
    rope_scaling: str
    train_length: int
    eval_length: int
    mode: str
    stride: int
    tokens: int
    loss: float
    ppl: float
    seconds: float
    status: str = "ok"  # "ok", "not applicable: ...", "skipped: ..."
    positions: str = "sequential"  # POSITION_MODES: what the model saw
    documents: str = "none"  # what the windows read of packed documents: none, positions, mask, both

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def window_starts(num_tokens: int, length: int, stride: int) -> range:
    """Starts of windows [s, s + length] (length inputs + the one extra target) that fit."""
    return range(0, num_tokens - length, stride)


def window_step(length: int, mode: str, stride: int | None) -> int:
    """How far consecutive windows start apart, which is also the targets scored per window."""
    return length if mode == "nonoverlapping" else (stride or max(1, length // 2))


def scored_windows(num_tokens: int, length: int, mode: str, stride: int | None, max_tokens: int | None
                   ) -> tuple[Sequence[int], int]:
    """(window starts, targets scored per window) for one eval length.

    Uncapped (``max_tokens`` None): every window of ``window_starts``. Capped: the
    ``max(1, max_tokens // step)`` windows spread evenly over all of them (first and last
    included, index j * (M - 1) // (k - 1) of M), so a token budget still samples the whole
    held-out split rather than its beginning. Deterministic; each chosen window keeps its full
    context and scores its own last ``step`` targets, as uncapped."""
    step = window_step(length, mode, stride)
    if step > length:
        raise ValueError(f"sliding stride {step} is longer than the eval window {length}")
    if max_tokens is not None and max_tokens < 1:
        raise ValueError(f"eval.extrapolation.max_tokens must be a positive integer or null (the whole "
                         f"held-out split), got {max_tokens}")
    starts = window_starts(num_tokens, length, step)
    keep = len(starts) if max_tokens is None else min(len(starts), max(1, max_tokens // step))
    if keep < len(starts):
        starts = [starts[j * (len(starts) - 1) // max(keep - 1, 1)] for j in range(keep)]
    return starts, step


def _batches(starts: range, size: int) -> Iterator[range]:
    for i in range(0, len(starts), size):
        yield starts[i : i + size]


@torch.no_grad()
def score_length(gpt: GPT, tokens: np.ndarray, length: int, mode: str, stride: int | None = None,
                 max_tokens: int | None = None, tokens_per_batch: int = 16384, q_chunk: int | None = 1024,
                 precision: str = "bf16-mixed", distributed: bool = False, by_position: PositionSums | None = None,
                 positions: str = "sequential", randomize_to: int | None = None, seed: int = 0,
                 documents: DocumentOptions = DocumentOptions()) -> tuple[float, int, int]:
    """(summed NLL, tokens scored, stride) over the held-out ``tokens`` at one eval length, on
    the windows of ``scored_windows`` (spread over the whole text when ``max_tokens`` caps them).
    ``distributed``: every rank of the process group calls this, scores every world-th window
    and gets the sums over all of them. ``by_position``: also filled with the same NLL summed
    per position in the window (reduced across ranks with the totals). ``positions``: the
    positions the model sees (``POSITION_MODES``); ``randomized`` draws from [0, ``randomize_to``).
    ``documents``: the packed-document layout each window is scored with (its per-document
    positions replace ``positions``'; attention kept inside documents)."""
    device = next(gpt.parameters()).device
    starts, step = scored_windows(len(tokens), length, mode, stride, max_tokens)
    rank, world = shard_of(distributed)
    starts = starts[rank::world]
    batch = max(1, tokens_per_batch // length)
    total, count = 0.0, 0
    sums = torch.zeros(step, dtype=torch.float64)  # per scored position: windows' NLL, same numbers as total
    for group in _batches(starts, batch):
        chunk = np.stack([tokens[s : s + length + 1] for s in group]).astype(np.int64)
        xy = torch.from_numpy(chunk).to(device)
        where = eval_positions(positions, group, length, randomize_to, seed, device)
        with autocast(precision, device):
            restarted, docs = documents.layout(xy[:, :-1])
            nll = gpt.token_nll(xy[:, :-1], xy[:, 1:], where if restarted is None else restarted, q_chunk=q_chunk,
                                documents=docs)
        scored = nll[:, length - step :].double()  # the last `step` targets of every window
        total += scored.sum().item()
        count += scored.numel()
        sums += scored.sum(0).cpu()
    counts = len(starts)  # every scored window adds one target at each scored position
    if world > 1:
        reduced = distributed_sum([total, float(count), float(counts), *sums.tolist()])
        total, count, counts, sums = reduced[0], reduced[1], int(reduced[2]), torch.tensor(reduced[3:])
    if by_position is not None:
        by_position.add(length - step, sums.numpy(), counts)
    return total, int(count), step


@dataclass
class Extrapolation:
    """The table, and the same NLL binned by token position (evaluation/position_loss.py)."""

    rows: list[ExtrapolationRow]
    position_rows: list[PositionLossRow]


def evaluate_extrapolation(gpt: GPT, tokens: np.ndarray, train_length: int, config: ExtrapolationConfig,
                           log=print, distributed: bool = False, randomize_to: int | None = None,
                           documents: DocumentOptions | None = None) -> list[ExtrapolationRow]:
    """The rows of ``measure``."""
    return measure(gpt, tokens, train_length, config, log, distributed, randomize_to, documents).rows


def measure(gpt: GPT, tokens: np.ndarray, train_length: int, config: ExtrapolationConfig, log=print,
            distributed: bool = False, randomize_to: int | None = None, documents: DocumentOptions | None = None
            ) -> Extrapolation:
    """Every (rope scaling, mode, length) row for one model on one held-out token stream, and the
    loss-by-position rows of every scored row (of the first ``config.documents`` mode only:
    their rows carry no mode).
    ``distributed``: called on every rank, which scores its share of the windows; every rank
    gets the whole table (summed NLL and token counts are reduced across ranks).
    ``randomize_to``: the model's ``pe.randomize_to`` (for ``config.positions == "randomized"``).
    ``documents``: how the run trained (``LitGPT.documents``); ``config.documents`` may
    choose otherwise, and every row says what was used."""
    trained = documents or DocumentOptions()
    first_documents = trained.resolve(config.documents[0]).mode
    gpt = uncompiled(gpt)
    was_training = gpt.training
    gpt.eval()
    rows: list[ExtrapolationRow] = []
    position_rows: list[PositionLossRow] = []
    try:
        for documents, scaling in ((trained.resolve(m), s) for m in config.documents for s in config.rope_scaling):
            for mode in config.modes:
                for length in config.eval_lengths(train_length):
                    row = ExtrapolationRow(gpt.pe.name, scaling or "none", train_length, length, mode,
                                           window_step(length, mode, config.stride), 0, math.nan, math.nan, 0.0,
                                           positions=config.positions, documents=documents.mode)
                    row.status = (why_not_randomized(config.positions, randomize_to, length)
                                  or _why_not_scored(gpt.pe, row, len(tokens)) or "ok")
                    if row.ok:
                        sums = _score_row(gpt, tokens, row, config, distributed, randomize_to, documents)
                        if row.documents == first_documents:
                            head = {k: getattr(row, k) for k in ("scheme", "rope_scaling", "positions", "train_length",
                                                                 "eval_length", "mode", "stride")}
                            position_rows.extend(bin_rows(sums, head, config.position_bins_per_octave))
                    rows.append(row)
                    log(format_row(row))
    finally:
        gpt.train(was_training)
    return Extrapolation(rows, position_rows)


def _why_not_scored(pe, row: ExtrapolationRow, num_tokens: int) -> str | None:
    """The status of a row that cannot be measured honestly, or None when it can."""
    scaled_not = why_not_scaled(pe, row.rope_scaling)
    if scaled_not:
        return scaled_not
    if pe.max_positions is not None and row.eval_length > pe.max_positions:
        return f"not applicable: pe={pe.name} has {pe.max_positions} positions"
    if num_tokens < row.eval_length + 1:
        return f"skipped: held-out text has {num_tokens} tokens, fewer than one window of {row.eval_length + 1}"
    if row.stride > row.eval_length:
        return f"skipped: stride {row.stride} longer than the window {row.eval_length}"
    return None


def _score_row(gpt: GPT, tokens: np.ndarray, row: ExtrapolationRow, config: ExtrapolationConfig,
               distributed: bool = False, randomize_to: int | None = None,
               documents: DocumentOptions = DocumentOptions()) -> PositionSums:
    """Fill tokens, loss, ppl and seconds, with the row's RoPE scaling on for this length only;
    the same NLL summed by window position is returned."""
    scaling = scaling_at(row.rope_scaling, config.rope_scaling_factor, row.eval_length, row.train_length)
    t0 = time.perf_counter()
    sums = PositionSums(row.eval_length)
    with scaled(gpt.pe, scaling):
        total, count, _ = score_length(gpt, tokens, row.eval_length, row.mode, config.stride, config.max_tokens,
                                       config.tokens_per_batch, config.q_chunk, config.precision, distributed,
                                       sums, config.positions, randomize_to, config.positions_seed, documents)
    row.seconds = time.perf_counter() - t0
    row.tokens, row.loss = count, total / count
    row.ppl = math.exp(row.loss)
    return sums


def format_row(row: ExtrapolationRow) -> str:
    head = (f"[extrapolation] pe={row.scheme} scaling={row.rope_scaling} mode={row.mode} "
            f"train={row.train_length} eval={row.eval_length} stride={row.stride}"
            + ("" if row.positions == "sequential" else f" positions={row.positions}")
            + ("" if row.documents == "none" else f" documents={row.documents}"))
    if not row.ok:
        return f"{head}: {row.status}"
    return f"{head}: ppl {row.ppl:.3f} (loss {row.loss:.4f}) over {row.tokens} tokens in {row.seconds:.1f}s"


COLUMNS = [f.name for f in fields(ExtrapolationRow)]


def write_csv(rows: Sequence[ExtrapolationRow], path: Path) -> Path:
    return write_rows(rows, path, ExtrapolationRow)


def read_csv(path: Path) -> list[ExtrapolationRow]:
    return read_rows(path, ExtrapolationRow)


def series_label(row: ExtrapolationRow, by: Sequence[str]) -> str:
    return " ".join(str(getattr(row, key)) for key in by)


def plot_rows(rows: Sequence[ExtrapolationRow], series_by: Sequence[str] = ("mode", "rope_scaling"),
              title: str = "Extrapolation"):
    """ppl against eval length (log-x, log-y), one line per series; the train length is marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    series: dict[str, list[ExtrapolationRow]] = {}
    for row in rows:
        if row.ok:
            series.setdefault(series_label(row, series_by), []).append(row)
    for label, points in sorted(series.items()):
        points.sort(key=lambda r: r.eval_length)
        ax.plot([r.eval_length for r in points], [r.ppl for r in points], marker="o", label=label)
    length_axis(ax, (r.train_length for r in rows))
    ppls = [r.ppl for r in rows if r.ok]
    if ppls and max(ppls) > 3 * min(ppls):  # log-y only when the range needs it
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    if series:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def markdown_table(rows: Sequence[ExtrapolationRow], row_by: Sequence[str] = ("scheme",)) -> str:
    """ALiBi-paper style: one line per model, one column per eval length, ppl in the cells."""
    lengths = sorted({r.eval_length for r in rows})
    table: dict[str, dict[int, str]] = {}
    for r in rows:
        cell = f"{r.ppl:.2f}" if r.ok else ("n/a" if r.status.startswith("not applicable") else "—")
        table.setdefault(series_label(r, row_by), {})[r.eval_length] = cell
    train = sorted({r.train_length for r in rows})
    header = "| " + " / ".join(row_by) + " | " + " | ".join(
        f"{n}" + (" (train)" if n in train else "") for n in lengths) + " |"
    lines = [header, "|" + "---|" * (len(lengths) + 1)]
    for label, cells in table.items():
        lines.append(f"| {label} | " + " | ".join(cells.get(n, "") for n in lengths) + " |")
    return "\n".join(lines) + "\n"


def save_results(rows: Sequence[ExtrapolationRow], out_dir: Path, title: str) -> dict[str, Path]:
    """CSV + PNG (+ markdown) on disk, so nothing depends on W&B being reachable."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_csv(rows, out_dir / "extrapolation.csv")}
    fig = plot_rows(rows, title=title, series_by=("mode", "rope_scaling", *(
        ("documents",) if len({r.documents for r in rows}) > 1 else ())))
    paths["png"] = out_dir / "extrapolation.png"
    fig.savefig(paths["png"])
    import matplotlib.pyplot as plt

    plt.close(fig)
    paths["md"] = out_dir / "extrapolation.md"
    randomized = ("positions",) if any(r.positions != "sequential" for r in rows) else ()  # say which, when not 0..T-1
    several = ("documents",) if len({r.documents for r in rows}) > 1 else ()  # several packed-document modes
    paths["md"].write_text(markdown_table(rows, row_by=("scheme", "mode", "rope_scaling", *randomized, *several)))
    return paths


def loggable(rows: Sequence[ExtrapolationRow], png: Path | None = None, prefix: str = "extrapolation",
             series_by: Sequence[str] = ("mode", "rope_scaling")) -> Logged:
    """The table, a ppl-vs-log2(length) line chart per series, the log-x PNG, and summary scalars."""
    logged = Logged(tables={f"{prefix}/table": table(rows, COLUMNS)})
    series: dict[str, list[ExtrapolationRow]] = {}
    for r in rows:
        if r.ok:
            series.setdefault(series_label(r, series_by), []).append(r)
    if series:
        logged.charts[f"{prefix}/ppl_vs_length"] = log2_chart(series, "eval_length", "ppl", "perplexity vs eval length",
                                                              "log2(eval length)")
    logged.add_image(f"{prefix}/plot", png)
    logged.summary = {f"{prefix}/{r.mode}/{r.rope_scaling}/ppl@{r.eval_length}": r.ppl for r in rows if r.ok}
    return logged


def metrics(rows: Sequence[ExtrapolationRow]) -> dict[str, float]:
    """Scalars for loggers without tables: ``extrapolation/{mode}/{scaling}/ppl@{length}``, plus
    ``/documents={mode}`` for rows that read packed documents."""
    return {f"extrapolation/{r.mode}/{r.rope_scaling}/ppl@{r.eval_length}"
            + ("" if r.documents == "none" else f"/documents={r.documents}"): r.ppl for r in rows if r.ok}


def save(result: Extrapolation, out_dir: Path, title: str) -> dict[str, Path]:
    """The table's files (``save_results``) and, beside them, position_loss.csv/.png."""
    paths = save_results(result.rows, out_dir, title)
    if result.position_rows:
        where = position_loss.save_results(result.position_rows, out_dir, title)
        paths.update(position_loss_csv=where["csv"], position_loss_png=where["png"])
    return paths


def reports(result: Extrapolation, paths: dict[str, Path]) -> list[Report]:
    out = [(loggable(result.rows, paths["png"]), metrics(result.rows))]
    if result.position_rows:
        out.append((position_loss.loggable(result.position_rows, paths["position_loss_png"]), {}))
    return out


# --- across runs: scripts/compare_runs.py ----------------------------------------------------

def comparison_sections(runs: Runs, pairs: list[tuple[str, ExtrapolationRow]], out: Path) -> list[str]:
    """comparison.{csv,png}; one markdown section per mode."""
    if not pairs:
        return []
    caption = "Perplexity by evaluation length (tokens)."
    if not runs.multi_seed:
        rows = label_rows(pairs, runs.groups)
        write_csv(rows, out / "comparison.csv")
        sections = []
        for mode in sorted({r.mode for r in rows}):
            mode_rows = [r for r in rows if r.mode == mode]
            strides = sorted({r.stride for r in mode_rows}) if mode == "sliding" else []
            title = f"### {mode}" + (f" (stride {', '.join(map(str, strides))})" if strides else "")
            sections.append(f"{title}\n\n{caption}\n\n{markdown_table(mode_rows)}")
        save_figure(plot_rows(rows, series_by=("scheme", "mode") if len({r.mode for r in rows}) > 1 else ("scheme",),
                              title="Extrapolation: perplexity vs evaluation length"), out / "comparison.png")
        return sections
    points = group_points(runs, pairs, lambda r: (r.mode, r.train_length, r.eval_length), lambda r: r.ppl)
    cells = make_cells(points, lower_is_better=True)
    write_stats_csv(cells, out / "comparison.csv", "mode")
    means = [c.summary.mean for c in cells if c.values]
    save_figure(plot_bands(cells, "perplexity", "Extrapolation: perplexity vs evaluation length",
                           log_y=bool(means) and max(means) > 3 * min(means)), out / "comparison.png")
    return stats_sections(cells, "{:.2f}", lambda mode: f"### {mode}\n\n{caption}")


def only_mode(pairs: list[tuple[str, ExtrapolationRow]], options: dict) -> list[tuple[str, ExtrapolationRow]]:
    """compare_runs --mode: only that mode's rows."""
    mode = options.get("mode")
    if not mode:
        return pairs
    pairs = [(run, r) for run, r in pairs if r.mode == mode]
    if not pairs:
        raise CompareError(f"no rows with mode={mode}")
    return pairs


def comparison_charts(runs: Runs, pairs: list[tuple[str, ExtrapolationRow]], out: Path) -> dict[str, Logged]:
    """W&B: every seed's line (the PNG has the means and intervals)."""
    if not pairs:
        return {}
    rows = label_rows(pairs, None if runs.multi_seed else runs.groups)
    return {"comparison": loggable(rows, out / "comparison.png", prefix="comparison", series_by=("scheme", "mode"))}


COMPARISON = Comparison("extrapolation.csv", ExtrapolationRow, series=lambda r: (r.scheme, r.mode, r.rope_scaling),
                        section=comparison_sections, place=10, select=only_mode, charts=comparison_charts, any_csv=True)

PROBE = Probe(
    name="extrapolation", config=ExtrapolationConfig, needs="text", output="extrapolation", every_rank=True,
    evaluate=lambda s, config: measure(s.gpt, s.tokens, s.train_length, config, s.log, s.distributed,
                                       s.randomize_to, s.documents),
    save=save, reports=reports, compare=(COMPARISON, position_loss.COMPARISON),
    announce=lambda result, paths: f"[pelab] extrapolation table: {paths['csv']} (+ .png, .md, position_loss.csv/.png)")
