"""Attention maps: materialised attention probabilities from the model's own forward.

The training/eval forward uses fused kernels that never materialise the weights, so the
probabilities come from one more run of the same forward (``GPT.hidden``) with the ``math``
attention backend, which takes the softmax explicitly in float32 and records it:

    probs = attention_probs(gpt, idx)            # {layer: (B, H, T, T)}
    stats = head_summaries(probs)                # {layer: {"distance": (H,), "entropy": (H,)}}
    fig = plot_attention_grid(probs)             # layers x heads, log colour scale

``pelab.probes.AttentionMaps`` is the Lightning callback (conf/callbacks/default.yaml) that
does this on a fixed validation sample every N validations and at the end of training,
outside any training step.

The probe against length (entropy and distance per head at L ... 16 L) is
evaluation/attention_probe.py.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from evaluation.sweep import eval_mode
from model.attention import AttentionRecorder
from model.unwrap import uncompiled
from model.positions import Pass, resolve_positions

__all__ = [
    "AttentionPass",
    "eager_attention_pass",
    "attention_probs",
    "head_summaries",
    "summary_metrics",
    "plot_attention_grid",
]


# --------------------------------------------------------------------------------------
# the eager pass
# --------------------------------------------------------------------------------------


def _layer_set(layers: Iterable[int] | None, n_layer: int) -> set[int]:
    if layers is None:
        return set(range(n_layer))
    out = set()
    for layer in layers:
        layer = int(layer)
        if not -n_layer <= layer < n_layer:
            raise ValueError(f"layer {layer} out of range for a model with {n_layer} layers")
        out.add(layer % n_layer)
    return out


class AttentionPass(NamedTuple):
    probs: dict[int, Tensor]  # layer -> (B, H, T, T) float32
    positions: Tensor  # (T,) or (B, T) the positions used
    hidden: Tensor | None  # final normalised hidden states (B, T, C), when the pass ran to the end


def eager_attention_pass(
    gpt: nn.Module,
    idx: Tensor,
    positions: Tensor | None = None,
    layers: Iterable[int] | None = None,
    return_hidden: bool = False,
    documents: Tensor | None = None,
) -> AttentionPass:
    """Run ``gpt``'s own forward (``GPT.hidden``) with the ``math`` attention backend,
    recording the attention probabilities of the requested layers.

    The math backend computes softmax(q kᵀ/√d + mask) in float32 with the layer's float32
    mask (the scheme's bias and the causal -inf, or causal only on a NoPE layer of a
    schedule); everything else is the ordinary forward. Modules are used in whatever mode
    they are in (call under eval for dropout-free probabilities; ``attention_probs`` does).
    ``documents``: (B, T) document ids of packed documents (keys of other documents get 0).
    """
    gpt = uncompiled(gpt)
    wanted = _layer_set(layers, len(gpt.blocks))
    positions = resolve_positions(gpt.pe, idx.shape[1], positions, idx.device)
    recorder = AttentionRecorder(wanted)
    with torch.no_grad():
        hidden = gpt.hidden(idx, positions, documents, how=Pass(attention="math", record=recorder))
    return AttentionPass(recorder.probs, positions, hidden if return_hidden else None)


def attention_probs(
    gpt: nn.Module, idx: Tensor, positions: Tensor | None = None, layers: Iterable[int] | None = None
) -> dict[int, Tensor]:
    """Attention probabilities {layer: (B, H, T, T) float32} of ``gpt`` on ``idx`` (B, T).

    Rows sum to one; entries with key position > query position are exactly zero. Runs
    under ``torch.no_grad`` with every module temporarily in eval mode (modes restored).
    """
    module = uncompiled(gpt)
    with eval_mode(module):
        return eager_attention_pass(module, idx, positions, layers).probs


# --------------------------------------------------------------------------------------
# per-head summaries
# --------------------------------------------------------------------------------------


def _as_layers(probs: Mapping[int, Tensor] | Tensor) -> Mapping[int, Tensor]:
    return probs if isinstance(probs, Mapping) else {0: probs}


def head_summaries(
    probs: Mapping[int, Tensor] | Tensor, positions: Tensor | None = None
) -> dict[int, dict[str, Tensor]]:
    """Per layer and head: ``distance`` = mean over query rows i of Σ_j p_ij (pos_i − pos_j),
    and ``entropy`` = mean over rows of −Σ_j p_ij log p_ij (nats; 0 log 0 = 0).

    ``probs``: {layer: (B, H, T, T)} (or one such tensor, reported as layer 0); rows and the
    batch are averaged. ``positions`` (T,): the positions the attention was computed at
    (default 0..T-1). Returns {layer: {"distance": (H,), "entropy": (H,)}} float32 on CPU.
    """
    out: dict[int, dict[str, Tensor]] = {}
    for layer, p in _as_layers(probs).items():
        p = p.float()
        T = p.shape[-1]
        pos = torch.arange(T, device=p.device) if positions is None else positions.to(p.device)
        rel = (pos[:, None] - pos[None, :]).float()  # (T, T): i - j
        distance = (p * rel).sum(-1)  # (B, H, T)
        entropy = -torch.special.xlogy(p, p).sum(-1)  # (B, H, T)
        out[layer] = {
            "distance": distance.mean(dim=(0, 2)).cpu(),
            "entropy": entropy.mean(dim=(0, 2)).cpu(),
        }
    return out


def summary_metrics(summaries: Mapping[int, Mapping[str, Tensor]], prefix: str = "attention") -> dict[str, float]:
    """Flatten ``head_summaries`` to ``{f"{prefix}/L{l}H{h}/{name}": value}``."""
    metrics = {}
    for layer, stats in sorted(summaries.items()):
        for name, values in stats.items():
            for head, value in enumerate(values.tolist()):
                metrics[f"{prefix}/L{layer}H{head}/{name}"] = value
    return metrics


# --------------------------------------------------------------------------------------
# plotting
# --------------------------------------------------------------------------------------


def plot_attention_grid(
    probs_by_layer: Mapping[int, Tensor] | Tensor,
    heads: Sequence[int] | None = None,
    title: str = "attention probabilities",
    positions: Tensor | None = None,
    sample: int = 0,
    vmin: float = 1e-4,
    panel_size: float = 1.8,
):
    """A layers × heads grid of heatmaps (query rows, key columns) for batch item ``sample``.

    Log colour scale from ``vmin`` to 1 (smaller probabilities get the lowest colour); the
    causal upper triangle (key position > query position) is left blank. Returns a
    matplotlib ``Figure`` built without pyplot (Agg canvas), so nothing is displayed or
    kept in global state.
    """
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import LogNorm
    from matplotlib.figure import Figure

    probs_by_layer = _as_layers(probs_by_layer)
    layers = sorted(probs_by_layer)
    if not layers:
        raise ValueError("no layers to plot")
    first = probs_by_layer[layers[0]]
    n_head, T = first.shape[-3], first.shape[-1]
    heads = list(range(n_head)) if heads is None else [int(h) for h in heads]
    if not heads or any(not 0 <= h < n_head for h in heads):
        raise ValueError(f"heads must be a non-empty subset of 0..{n_head - 1}, got {heads}")
    pos = torch.arange(T) if positions is None else positions.detach().cpu()
    future = (pos[None, :] > pos[:, None]).numpy()  # (T, T) key after query

    cmap = colormaps["viridis"].with_extremes(bad="white")
    norm = LogNorm(vmin=vmin, vmax=1.0)
    fig = Figure(figsize=(panel_size * len(heads) + 1.2, panel_size * len(layers) + 0.7), layout="constrained")
    FigureCanvasAgg(fig)
    axes = np.atleast_2d(fig.subplots(len(layers), len(heads), squeeze=False))
    image = None
    for r, layer in enumerate(layers):
        p = probs_by_layer[layer].detach()
        p = p[sample] if p.dim() == 4 else p
        p = p[heads].float().cpu().numpy()  # (len(heads), T, T)
        p = np.where(future[None], np.nan, np.clip(p, vmin, 1.0))
        for c, head in enumerate(heads):
            ax = axes[r, c]
            image = ax.imshow(p[c], cmap=cmap, norm=norm, interpolation="auto", aspect="equal")
            ax.set_title(f"L{layer} H{head}", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
            if c == 0:
                ax.set_ylabel("query", fontsize=7)
            if r == len(layers) - 1:
                ax.set_xlabel("key", fontsize=7)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="probability")
    fig.suptitle(title)
    return fig
