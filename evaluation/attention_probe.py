"""The attention probe against length: per layer and head, the attention entropy, mean
distance, the weight on the first token and the weight on no token at L ... 16 L
(``eval.probe``, its own math-backend pass when training ends, on held-out windows or task
samples). Entropy rising with length towards ln(keys) is the attention-dilution
signature; weight piling up on the first token is StreamingLLM's "attention sink" (Xiao et al.
2024), and weight on no token is what a learned sink (``model.sinks``) takes.

Cost per length: ``samples`` math-backend forwards of T tokens (O(layers · H · T²) float32 work,
the probabilities held ``q_chunk`` rows at a time: H · q_chunk · T floats), statistics over
``rows`` sampled query rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import ClassVar

import numpy as np
import torch
from torch import Tensor, nn

from evaluation.plots import length_axis
from evaluation.probe import Probe, Subject
from evaluation.results import LineSeries, Logged, table
from evaluation.sweep import LengthSweepOptions, eval_mode, probe_windows, write_rows
from model.attention import AttentionRecorder
from model.config import require
from model.unwrap import uncompiled
from model.positions import Pass, resolve_positions


class ProbeRecorder(AttentionRecorder):
    """Reduces the ``math`` backend's probabilities chunk by chunk to per-head sums over sampled
    query rows, so no (T, T) matrix is kept: {layer: [entropy sum (H,), distance sum (H,),
    uniform-entropy sum, rows, first-token sum (H,), no-token sum (H,)]}. Distance of a row i:
    Σ_j p_ij (pos_i − pos_j); entropy: −Σ_j p_ij ln p_ij; the uniform reference: ln(keys row i
    sees); first token: p_i0; no token: 1 − Σ_j p_ij (a sink's share; 0 for a plain softmax)."""

    def __init__(self, rows: Tensor, positions: Tensor) -> None:
        super().__init__(None)
        self.rows, self.positions = rows, positions  # sorted query indices; (T,) or (B, T) positions
        self.sums: dict[int, list] = {}

    def add_chunk(self, probs: Tensor, first_row: int, keys: int) -> None:
        rows = self.rows[(self.rows >= first_row) & (self.rows < first_row + probs.shape[2])]
        if not len(rows):
            return
        p = probs[:, :, rows - first_row].double()  # (B, H, R, keys seen)
        seen = p.shape[-1]
        pos = self.positions.to(p.device).double()
        rel = pos[..., rows, None] - pos[..., None, :seen]  # (R, seen) or (B, R, seen)
        distance = (p * (rel[:, None] if rel.dim() == 3 else rel)).sum(-1)  # (B, H, R)
        entropy = -torch.special.xlogy(p, p).sum(-1)
        acc = self.sums.setdefault(self.calls, [0.0, 0.0, 0.0, 0, 0.0, 0.0])
        acc[0] = acc[0] + entropy.sum(dim=(0, 2)).cpu()
        acc[1] = acc[1] + distance.sum(dim=(0, 2)).cpu()
        acc[2] += p.shape[0] * float((rows + 1 + keys - self.positions.shape[-1]).double().log().sum())  # ln(keys seen)
        acc[3] += p.shape[0] * len(rows)
        acc[4] = acc[4] + p[..., 0].sum(dim=(0, 2)).cpu()
        acc[5] = acc[5] + (1 - p.sum(-1)).clamp_min(0).sum(dim=(0, 2)).cpu()  # rounding: a softmax row sums to 1 ± eps

    def end_layer(self) -> None:
        self.calls += 1


def probe_rows_of(length: int, rows: int) -> Tensor:
    """``rows`` query indices spread evenly over [0, length), the last one included (all when fewer)."""
    if rows >= length:
        return torch.arange(length)
    return torch.unique(torch.linspace(0, length - 1, rows).round().long())


@torch.no_grad()
def probe_attention(gpt: nn.Module, windows: Tensor, rows: int = 256, q_chunk: int | None = 256,
                    positions: Tensor | None = None) -> dict[int, dict[str, Tensor | float]]:
    """{layer: {"entropy": (H,), "distance": (H,), "uniform_entropy": float, "rows": int,
    "first_weight": (H,), "null_weight": (H,)}}: means
    over the sampled query rows of every window (S, T), one window per forward (math backend,
    query chunks of ``q_chunk``: the probabilities held at once are (H, q_chunk, T))."""
    module = uncompiled(gpt)
    T = windows.shape[1]
    sampled = probe_rows_of(T, rows).to(windows.device)
    with eval_mode(module):
        where = resolve_positions(module.pe, T, positions, windows.device)
        recorder = ProbeRecorder(sampled, where)
        for window in windows:
            module.hidden(window[None], where, how=Pass(q_chunk=q_chunk, attention="math", record=recorder))
            recorder.calls = 0  # the next window's layers start again at 0
    return {layer: {"entropy": (e / n).float(), "distance": (d / n).float(), "uniform_entropy": u / n, "rows": n,
                    "first_weight": (f / n).float(), "null_weight": (z / n).float()}
            for layer, (e, d, u, n, f, z) in sorted(recorder.sums.items())}


@dataclass
class ProbeConfig(LengthSweepOptions):
    section: ClassVar[str] = "eval.probe"
    multipliers: Sequence[float] = (1, 2, 4, 8, 16)  # probe lengths as multiples of the training length
    lengths: Sequence[int] = ()  # absolute lengths, added to the multiples
    samples: int = 1  # windows per length
    rows: int = 256  # query rows per window, spread evenly (the statistics' cost; the forward is O(T^2) anyway)
    q_chunk: int = 256  # query chunk of the math forward: bounds the probabilities held at once

    def __post_init__(self) -> None:
        for name in ("samples", "rows", "q_chunk"):
            value = getattr(self, name)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"eval.probe.{name}",
                    value, "an integer >= 1")
        require(len(self.multipliers) + len(self.lengths) > 0, "eval.probe.multipliers", list(self.multipliers),
                "a non-empty list when eval.probe.lengths is empty")
        require(all(m > 0 for m in self.multipliers), "eval.probe.multipliers", list(self.multipliers),
                "positive numbers")
        require(all(int(n) == n and n >= 1 for n in self.lengths), "eval.probe.lengths", list(self.lengths),
                "positive integers")


@dataclass
class ProbeRow:
    scheme: str
    train_length: int
    eval_length: int
    layer: int
    head: int
    samples: int
    rows: int  # query rows averaged (over all samples)
    entropy: float  # mean attention entropy (nats)
    uniform_entropy: float  # mean ln(keys seen) of the same rows: the entropy of uniform attention
    distance: float  # mean attention distance (positions)
    seconds: float
    status: str = "ok"
    first_weight: float = math.nan  # mean attention weight on the window's first token (position 0)
    null_weight: float = math.nan  # mean weight on no token: a learned sink's share, 0 for a softmax

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def evaluate_probe(gpt: nn.Module, windows_of: Callable[[int, int], Tensor | str], train_length: int,
                   config: ProbeConfig, log=print) -> list[ProbeRow]:
    """Rows for every (length, layer, head). ``windows_of(length, samples)``: (samples, length)
    token ids, or a string saying why there are none (the row's status)."""
    import time

    module = uncompiled(gpt)
    rows: list[ProbeRow] = []
    n_head = module.config.query_heads  # the weights recorded: differential attention's 2 n_head query heads
    for length in config.eval_lengths(train_length):
        status = None
        if module.pe.max_positions is not None and length > module.pe.max_positions:
            status = f"not applicable: pe={module.pe.name} has {module.pe.max_positions} positions"
        windows = None if status else windows_of(length, config.samples)
        if isinstance(windows, str):
            status = windows
        if status:
            rows.append(ProbeRow(module.pe.name, train_length, length, -1, -1, 0, 0, math.nan, math.nan, math.nan,
                                 0.0, status))
            log(f"[probe] pe={module.pe.name} eval={length}: {status}")
            continue
        t0 = time.perf_counter()
        stats = probe_attention(module, windows.to(next(module.parameters()).device), config.rows, config.q_chunk)
        seconds = time.perf_counter() - t0
        for layer, s in stats.items():
            for head in range(n_head):
                rows.append(ProbeRow(module.pe.name, train_length, length, layer, head, len(windows), s["rows"],
                                     float(s["entropy"][head]), s["uniform_entropy"], float(s["distance"][head]),
                                     seconds, first_weight=float(s["first_weight"][head]),
                                     null_weight=float(s["null_weight"][head])))
        mean_of = {key: sum(float(s[key].mean()) for s in stats.values()) / len(stats)
                   for key in ("entropy", "first_weight", "null_weight")}
        log(f"[probe] pe={module.pe.name} eval={length}: entropy {mean_of['entropy']:.3f} nats (uniform "
            f"{next(iter(stats.values()))['uniform_entropy']:.3f}), weight on the first token "
            f"{mean_of['first_weight']:.3f}, on no token {mean_of['null_weight']:.3f}, over {len(windows)} x "
            f"{min(config.rows, length)} rows in {seconds:.1f}s")
    return rows


def plot_probe(rows: Sequence[ProbeRow], title: str = "Attention against length"):
    """Entropy (with the uniform-attention reference, dashed), mean distance and the weight on the
    first token (on no token, dashed, where a sink takes some) against length, one line per layer
    (mean over heads), heads as thin lines; the training length dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.ok]
    fig, (left, middle, right) = plt.subplots(1, 3, figsize=(14, 4), dpi=120)
    panels = ((left, "entropy"), (middle, "distance"), (right, "first_weight"))
    for layer in sorted({r.layer for r in ok}):
        mine = [r for r in ok if r.layer == layer]
        lengths = sorted({r.eval_length for r in mine})
        for ax, field in panels:
            mean = [np.mean([getattr(r, field) for r in mine if r.eval_length == n]) for n in lengths]
            line, = ax.plot(lengths, mean, marker="o", label=f"layer {layer}")
            for head in sorted({r.head for r in mine}):
                ax.plot(lengths, [next(getattr(r, field) for r in mine if r.eval_length == n and r.head == head)
                                  for n in lengths], color=line.get_color(), alpha=0.25, linewidth=0.7)
        null = [np.mean([r.null_weight for r in mine if r.eval_length == n]) for n in lengths]
        if max(null, default=0.0) > 1e-6:
            right.plot(lengths, null, "--", color=line.get_color(), label=f"layer {layer}: on no token (sink)")
    lengths = sorted({r.eval_length for r in ok})
    if lengths:
        left.plot(lengths, [next(r.uniform_entropy for r in ok if r.eval_length == n) for n in lengths], "k--",
                  linewidth=1, label="uniform attention")
    for ax, label in ((left, "attention entropy (nats)"), (middle, "mean attention distance (positions)"),
                      (right, "attention weight on the first token")):
        length_axis(ax, (r.train_length for r in rows))
        ax.set_ylabel(label)
    if ok:
        middle.set_yscale("log")
        left.legend(fontsize=7)
        right.legend(fontsize=6)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def save_probe(rows: Sequence[ProbeRow], out_dir: Path, title: str) -> dict[str, Path]:
    """probe.csv + probe.png in ``out_dir``."""
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"csv": write_rows(rows, out_dir / "probe.csv", ProbeRow), "png": out_dir / "probe.png"}
    fig = plot_probe(rows, title)
    fig.savefig(paths["png"])
    plt.close(fig)
    return paths


CHARTED = ("entropy", "distance", "first_weight", "null_weight")


def probe_metrics(rows: Sequence[ProbeRow], prefix: str = "probe") -> dict[str, float]:
    """``probe/L{l}H{h}/{field}@{length}`` for entropy, distance, first_weight and null_weight."""
    return {f"{prefix}/L{r.layer}H{r.head}/{field}@{r.eval_length}": getattr(r, field)
            for r in rows if r.ok for field in CHARTED}


def probe_loggable(rows: Sequence[ProbeRow], png: Path | None = None, prefix: str = "probe") -> Logged:
    """A table, a chart per ``CHARTED`` field against log2(length) (one line per layer, mean over
    heads), the PNG."""
    logged = Logged(tables={f"{prefix}/table": table(rows, [f.name for f in fields(ProbeRow)])})
    ok = [r for r in rows if r.ok]
    layers = sorted({r.layer for r in ok})
    lengths = sorted({r.eval_length for r in ok})
    if ok:
        for field in CHARTED:
            ys = [[float(np.mean([getattr(r, field) for r in ok if r.layer == layer and r.eval_length == n]))
                   for n in lengths] for layer in layers]
            logged.charts[f"{prefix}/{field}_vs_length"] = LineSeries(
                xs=[math.log2(n) for n in lengths], ys=ys, keys=[f"layer {layer}" for layer in layers],
                title=f"attention {field.replace('_', ' ')} vs eval length", xname="log2(eval length)")
    logged.add_image(f"{prefix}/plot", png)
    return logged


def evaluate(subject: Subject, config: ProbeConfig) -> list[ProbeRow]:
    """The probe on held-out windows, or on the task's samples when the run has no held-out text."""
    windows = (probe_windows(subject.tokens) if subject.held_out_text
               else probe_windows(task=subject.task, seed=subject.seed))
    return evaluate_probe(subject.gpt, windows, subject.train_length, config, log=subject.log)


PROBE = Probe(
    name="probe", config=ProbeConfig, needs="either", output="attention_probe", evaluate=evaluate, save=save_probe,
    reports=lambda rows, paths: [(probe_loggable(rows, paths["png"]), probe_metrics(rows))],
    announce=lambda rows, paths: f"[pelab] attention probe: {paths['csv']} (+ .png)")
