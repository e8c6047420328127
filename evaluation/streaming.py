"""Streaming evaluation (StreamingLLM, Xiao et al. 2024, "Efficient Streaming Language Models
with Attention Sinks"): a long held-out text (``multiplier`` x the training length L, 16 L by
default) scored token by token with the KV cache under StreamingLLM's policy (model/cache.py,
``Sinks``): it keeps the first ``sinks`` tokens (attention sinks) and the ``window`` most recent
ones (the new token's own included), so it never holds more than sinks + window keys however
long the text.

Positions inside the cache (``cache_positions``):

- ``reindexed`` (StreamingLLM's rule): positions are cache slots, 0 .. sinks + window - 1; the
  query sits at the last slot, the sinks at the first ones, right before the recent keys. Here
  the recent keys keep their text positions and the sinks are recomputed each step just before
  the oldest recent key (sinks see only sinks, so their keys are a forward of those tokens
  alone): for a scheme whose scores depend on the distance q - k only (RoPE, ALiBi, T5,
  KERPLE, NoPE) this is the slot rule exactly, with no re-rotation of cached keys.
- ``absolute``: every key keeps its text position (the sinks stay at 0 .. sinks - 1).

Deeper layers' cached keys keep the context they were computed in (StreamingLLM's cache, not a
recomputation of the window). A scheme with a position table (learned) cannot score past it:
its rows are ``not applicable``. Output: NLL and perplexity per position bucket ([0, L), then
octaves up to the text's end), CSV + markdown + plot. Learned sinks (a ``model.sinks`` option)
are the model's own: the ``model_sinks`` column says which ran, so a comparison is two runs.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from evaluation.compare import Runs, group_points, make_cells
from evaluation.compare_report import stats_sections, write_stats_csv
from evaluation.plots import length_axis
from evaluation.probe import Comparison, Probe, Subject
from evaluation.results import Logged, log2_chart, table
from evaluation.sweep import LengthSweepOptions, autocast, eval_mode, probe_windows, read_rows, write_rows
from model.config import require
from model.cache import KVCache, Sinks
from model.unwrap import uncompiled

CACHE_POSITIONS = ("reindexed", "absolute")


@torch.no_grad()
def stream_nll(gpt: nn.Module, tokens: Tensor, sinks: int, window: int, cache_positions: str = "reindexed",
               precision: str = "32-true") -> tuple[Tensor, int]:
    """(B, N - 1) float32 NLL of tokens[:, t + 1] given the streaming cache at step t, one token a
    step, and the most keys any layer's cache held."""
    module = uncompiled(gpt)
    device = tokens.device
    span = torch.arange(tokens.shape[1], device=device)
    cache = KVCache(len(module.blocks), span, policy=Sinks(sinks, window, reindexed=cache_positions == "reindexed"))
    nll = []
    with eval_mode(module), autocast(precision, device):
        for t in range(tokens.shape[1] - 1):
            cache.evict()
            cache.place_sinks(module, tokens[:, :sinks])  # re-indexed only (model/cache.py, ``Sinks``)
            h = module.hidden(tokens[:, t : t + 1], span[t : t + 1], cache=cache)
            nll.append(F.cross_entropy(module.logits(h[:, 0]).float(), tokens[:, t + 1], reduction="none"))
    return torch.stack(nll, dim=1), cache.peak


def position_buckets(n: int, train_length: int, per_octave: int = 1) -> list[tuple[int, int]]:
    """[start, end) ranges of 0-based positions: [0, L), then edges L 2^(k / per_octave) up to ``n``."""
    edges, k = [0], 0
    while edges[-1] < n:
        edge = min(n, int(round(train_length * 2 ** (k / per_octave))))
        k += 1
        if edge > edges[-1]:
            edges.append(edge)
    return list(zip(edges[:-1], edges[1:]))


@dataclass
class StreamingConfig(LengthSweepOptions):
    section: ClassVar[str] = "eval.streaming"
    multiplier: float = 16  # the text's length in training lengths
    sinks: int = 4  # S: the first tokens kept (StreamingLLM's 4)
    window: int | None = None  # W: recent tokens kept, the new one included; None = L - sinks (the cache holds L)
    cache_positions: Sequence[str] = ("reindexed",)  # reindexed (cache slots) and/or absolute
    samples: int = 1  # texts, spread evenly over the held-out split, streamed side by side
    buckets_per_octave: int = 1
    precision: str = "32-true"
    multipliers: Sequence[float] = ()  # LengthSweepOptions' fields, unused: one text length
    lengths: Sequence[int] = ()

    def __post_init__(self) -> None:
        for name, low in (("sinks", 0), ("samples", 1), ("buckets_per_octave", 1)):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= low, f"eval.streaming.{name}",
                    value, f"an integer >= {low}")
        require(self.window is None or (isinstance(self.window, int) and not isinstance(self.window, bool)
                                        and self.window >= 1), "eval.streaming.window", self.window,
                "null (the training length minus the sinks) or an integer >= 1")
        require(isinstance(self.multiplier, (int, float)) and self.multiplier >= 1, "eval.streaming.multiplier",
                self.multiplier, "a number >= 1 (the text's length in training lengths)")
        modes = list(self.cache_positions)
        require(modes and all(m in CACHE_POSITIONS for m in modes), "eval.streaming.cache_positions", modes,
                f"a non-empty list of {', '.join(CACHE_POSITIONS)}")

    def window_of(self, train_length: int) -> int:
        """W for a model trained at ``train_length``; validation asks it before training (pelab/validate.py)."""
        if self.window is not None:
            return self.window
        require(self.sinks < train_length, "eval.streaming.sinks", self.sinks,
                f"less than the training length {train_length} when eval.streaming.window is null (the window is "
                f"the training length minus the sinks, and none would be left); lower it or set eval.streaming.window")
        return train_length - self.sinks


@dataclass
class StreamingRow:
    scheme: str
    model_sinks: str  # the model's own sinks option (model.sinks), "none" without one
    cache_positions: str
    train_length: int
    text_length: int
    sinks: int  # S
    window: int  # W
    start: int  # first position of the bucket (0-based: the prediction at p has seen p + 1 tokens)
    end: int  # one past the last
    tokens: int  # targets scored in the bucket (over every text)
    loss: float  # mean NLL (nats)
    ppl: float
    max_cache: int  # the most keys a layer's cache held
    seconds: float
    status: str = "ok"

    @property
    def ok(self) -> bool:
        return self.status == "ok"


COLUMNS = [f.name for f in fields(StreamingRow)]


def evaluate_streaming(gpt: nn.Module, texts_of, train_length: int, config: StreamingConfig,
                       log=print) -> list[StreamingRow]:
    """Rows per cache-position rule and bucket. ``texts_of(length, samples)``: (samples, length)
    token ids, or a string saying why there are none (``probe_windows``)."""
    module = uncompiled(gpt)
    n, window = int(round(config.multiplier * train_length)), config.window_of(train_length)
    head = dict(scheme=module.pe.name, model_sinks=str(getattr(module.config, "sinks", None) or "none"),
                train_length=train_length, text_length=n, sinks=config.sinks, window=window)
    texts = texts_of(n, config.samples)
    status = texts if isinstance(texts, str) else None
    if status is None and module.pe.max_positions is not None and n > module.pe.max_positions:
        status = f"not applicable: pe={module.pe.name} has {module.pe.max_positions} positions"
    rows = []
    for mode in config.cache_positions:
        if status:
            rows.append(StreamingRow(**head, cache_positions=mode, start=0, end=n, tokens=0, loss=math.nan,
                                     ppl=math.nan, max_cache=0, seconds=0.0, status=status))
            log(f"[streaming] pe={module.pe.name} {mode}: {status}")
            continue
        t0 = time.perf_counter()
        nll, peak = stream_nll(module, texts.to(next(module.parameters()).device), config.sinks, window, mode,
                               config.precision)
        seconds = time.perf_counter() - t0
        nll = nll.double().cpu()
        for start, end in position_buckets(nll.shape[1], train_length, config.buckets_per_octave):
            loss = float(nll[:, start:end].mean())
            rows.append(StreamingRow(**head, cache_positions=mode, start=start, end=end,
                                     tokens=nll[:, start:end].numel(), loss=loss, ppl=math.exp(loss), max_cache=peak,
                                     seconds=seconds))
        log(f"[streaming] pe={module.pe.name} {mode}, S={config.sinks} W={window}: ppl {rows[-1].ppl:.2f} at "
            f"[{rows[-1].start}, {rows[-1].end}) over {len(texts)} x {n} tokens in {seconds:.1f}s")
    return rows


def series_label(r: StreamingRow) -> str:
    return f"{r.cache_positions}, S={r.sinks} W={r.window}" + ("" if r.model_sinks == "none" else
                                                               f", model.sinks={r.model_sinks}")


def markdown_table(rows: Sequence[StreamingRow]) -> str:
    """One line per cache rule, one column per position bucket, perplexity in the cells."""
    buckets = sorted({(r.start, r.end) for r in rows if r.ok})
    lines = ["| scheme / cache | " + " | ".join(f"[{s}, {e})" for s, e in buckets) + " |",
             "|" + "---|" * (len(buckets) + 1)]
    for label in dict.fromkeys(f"{r.scheme} / {series_label(r)}" for r in rows):
        mine = {(r.start, r.end): r for r in rows if f"{r.scheme} / {series_label(r)}" == label}
        cells = [f"{mine[b].ppl:.2f}" if b in mine else "—" for b in buckets]
        reason = next((r.status for r in mine.values() if not r.ok), "")
        lines.append(f"| {label} | " + (" | ".join(cells) if buckets else "") + (f" {reason} |" if reason else " |"))
    return "\n".join(lines) + "\n"


def plot_rows(rows: Sequence[StreamingRow], title: str):
    """Perplexity against position (bucket middles, log2 x), one line per cache rule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ok = [r for r in rows if r.ok]
    for label in dict.fromkeys(series_label(r) for r in ok):
        mine = [r for r in ok if series_label(r) == label]
        ax.plot([(r.start + 1 + r.end) / 2 for r in mine], [r.ppl for r in mine], marker="o", label=label)
    length_axis(ax, (r.train_length for r in rows), label="position in the stream (tokens seen)")
    ax.set_ylabel("perplexity")
    ax.set_title(title)
    if ok:
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def save(rows: Sequence[StreamingRow], out_dir: Path, title: str) -> dict[str, Path]:
    """streaming.csv, streaming.md and streaming.png in ``out_dir``."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_rows(rows, out_dir / "streaming.csv", StreamingRow), "md": out_dir / "streaming.md",
             "png": out_dir / "streaming.png"}
    paths["md"].write_text(markdown_table(rows))
    fig = plot_rows(rows, title)
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths


def metrics(rows: Sequence[StreamingRow], prefix: str = "streaming") -> dict[str, float]:
    """``streaming/{cache_positions}/ppl@{bucket end}``."""
    return {f"{prefix}/{r.cache_positions}/ppl@{r.end}": r.ppl for r in rows if r.ok}


def loggable(rows: Sequence[StreamingRow], png: Path | None = None, prefix: str = "streaming") -> Logged:
    """The table, a perplexity-vs-log2(position) chart per cache rule, the PNG."""
    logged = Logged(tables={f"{prefix}/table": table(rows, COLUMNS)})
    series: dict[str, list[StreamingRow]] = {}
    for r in rows:
        if r.ok:
            series.setdefault(series_label(r), []).append(r)
    if series:
        logged.charts[f"{prefix}/ppl_vs_position"] = log2_chart(series, "end", "ppl", "streaming perplexity vs position",
                                                                "log2(bucket end)")
    logged.add_image(f"{prefix}/plot", png)
    return logged


def evaluate(subject: Subject, config: StreamingConfig) -> list[StreamingRow]:
    return evaluate_streaming(subject.gpt, probe_windows(subject.tokens), subject.train_length, config, subject.log)


# --- across runs: scripts/compare_runs.py ----------------------------------------------------

def comparison_sections(runs: Runs, pairs: list[tuple[str, StreamingRow]], out: Path) -> list[str]:
    """comparison_streaming.csv; one markdown section per cache rule: perplexity by position bucket
    (a column N holds the positions from the previous column's N up to N), seeds grouped."""
    if not pairs:
        return []
    points = group_points(runs, pairs, lambda r: (f"{r.cache_positions}, S={r.sinks} W={r.window}", r.train_length,
                                                  r.end), lambda r: r.ppl)
    cells = make_cells(points, lower_is_better=True)
    write_stats_csv(cells, out / "comparison_streaming.csv", "cache")
    return stats_sections(cells, "{:.2f}", lambda cache: (
        f"### streaming, {cache}\n\nPerplexity by position bucket: each column holds the positions from the "
        "previous column's bound up to its own (docs/evaluation.md, section 7)."))


COMPARISON = Comparison("streaming.csv", StreamingRow, series=lambda r: (r.scheme, r.cache_positions, r.sinks, r.window),
                        section=comparison_sections, place=20)

PROBE = Probe(
    name="streaming", config=StreamingConfig, needs="text", output="streaming", evaluate=evaluate, save=save,
    reports=lambda rows, paths: [(loggable(rows, paths["png"]), metrics(rows))], compare=(COMPARISON,),
    announce=lambda rows, paths: f"[pelab] streaming evaluation: {paths['csv']} (+ .md, .png)")
