"""Attention maps: materialised attention probabilities from the model's own forward.

The training/eval forward uses fused kernels that never materialise the weights, so the
probabilities come from one more run of the same forward (``GPT.hidden``) with the ``math``
attention backend, which takes the softmax explicitly in float32 and records it:

    probs = attention_probs(gpt, idx)            # {layer: (B, H, T, T)}
    stats = head_summaries(probs)                # {layer: {"distance": (H,), "entropy": (H,)}}
    fig = plot_attention_grid(probs)             # layers x heads, log colour scale

``AttentionMaps`` is the Lightning callback (conf/callbacks/default.yaml) that does this on
a fixed validation sample every N validations and at the end of training, outside any
training step.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import lightning as L
import numpy as np
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor, nn

from model.attention import AttentionRecorder
from model.gpt import uncompiled
from model.positions import resolve_positions

__all__ = [
    "AttentionPass",
    "eager_attention_pass",
    "attention_probs",
    "head_summaries",
    "summary_metrics",
    "plot_attention_grid",
    "AttentionMaps",
]


# --------------------------------------------------------------------------------------
# the eager pass
# --------------------------------------------------------------------------------------


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode; restore each one's own ``training`` flag after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, flag in flags:
            m.training = flag


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
        hidden = gpt.hidden(idx, positions, attention="math", record=recorder, documents=documents)
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


# --------------------------------------------------------------------------------------
# the Lightning callback
# --------------------------------------------------------------------------------------


def _first_loader(loaders: Any) -> Any:
    if isinstance(loaders, Mapping):
        return next(iter(loaders.values()), None)
    if isinstance(loaders, (list, tuple)):
        return loaders[0] if loaders else None
    return loaders


class AttentionMaps(L.Callback):
    """Attention heatmaps and per-head summaries on a fixed validation sample.

    Every ``every_n_validations`` validation runs (sanity checks excluded) and once when
    training ends, on global rank zero: take the first window of
    ``trainer.datamodule.val_set`` (else of the first validation dataloader's dataset),
    truncated to ``sample_length``; run ``attention_probs`` in eval mode under no_grad; save
    ``{default_root_dir or log_dir}/{output_subdir}/step{global_step:06d}.png``; log it to
    every ``WandbLogger`` as ``attention/maps``; log ``attention/L{l}H{h}/distance`` and
    ``.../entropy`` to every logger. The work happens at validation epoch end (inside the
    validation window, so throughput timing excludes it) and never in a training step.

    ``layers``: layers to analyse (default all); ``heads``: heads to plot (default the first
    ``max_heads_plotted``); summaries cover every head of the analysed layers.
    """

    def __init__(
        self,
        every_n_validations: int = 1,
        layers: list[int] | None = None,
        heads: list[int] | None = None,
        sample_length: int | None = None,
        output_subdir: str = "attention",
        max_heads_plotted: int = 16,
    ) -> None:
        if every_n_validations < 1:
            raise ValueError(f"every_n_validations must be >= 1, got {every_n_validations}")
        if sample_length is not None and sample_length < 1:
            raise ValueError(f"sample_length must be >= 1 or None, got {sample_length}")
        if max_heads_plotted < 1:
            raise ValueError(f"max_heads_plotted must be >= 1, got {max_heads_plotted}")
        self.every_n_validations = every_n_validations
        self.layers = None if layers is None else list(layers)
        self.heads = None if heads is None else list(heads)
        self.sample_length = sample_length
        self.output_subdir = output_subdir
        self.max_heads_plotted = max_heads_plotted
        self.validations = 0  # completed (non-sanity) validation runs
        self._warned_sharded = False
        self._sample: Tensor | None = None
        self._last_step: int | None = None
        self.last_path: Path | None = None
        self.last_metrics: dict[str, float] = {}

    # -- hooks -----------------------------------------------------------------------

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validations += 1
        if self.validations % self.every_n_validations == 0:
            self.run(trainer, pl_module)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._last_step != trainer.global_step:
            self.run(trainer, pl_module)

    def state_dict(self) -> dict[str, Any]:
        return {"validations": self.validations}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validations = int(state_dict.get("validations", 0))

    # -- work ------------------------------------------------------------------------

    def sample(self, trainer: L.Trainer) -> Tensor | None:
        """The fixed (1, T) validation sample, taken once and cached."""
        if self._sample is None:
            dataset = getattr(trainer.datamodule, "val_set", None) if trainer.datamodule is not None else None
            if dataset is None:
                dataset = getattr(_first_loader(trainer.val_dataloaders), "dataset", None)
            if dataset is None or len(dataset) == 0:
                return None
            item = dataset[0]
            x = item[0] if isinstance(item, (tuple, list)) else item
            x = torch.as_tensor(x).reshape(-1)
            self._sample = x[: self.sample_length].unsqueeze(0).clone()
        return self._sample

    def output_dir(self, trainer: L.Trainer) -> Path:
        return Path(trainer.default_root_dir or trainer.log_dir) / self.output_subdir

    def run(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._last_step = trainer.global_step
        if not trainer.is_global_zero:
            return
        from evaluation.end_of_training import sharded_parameters

        if sharded_parameters(trainer):  # rank zero alone cannot run a forward over weight shards
            if not self._warned_sharded:
                rank_zero_warn(f"AttentionMaps: skipped under {type(trainer.strategy).__name__} (the weights are "
                               f"sharded across ranks); remove it with ~callbacks.attention_maps")
                self._warned_sharded = True
            return
        idx = self.sample(trainer)
        if idx is None:
            rank_zero_warn("AttentionMaps: no validation sample available; skipping attention maps")
            return
        gpt = uncompiled(getattr(pl_module, "model", pl_module))
        idx = idx.to(pl_module.device)
        step = trainer.global_step
        documents = getattr(pl_module, "val_documents", None)  # packed documents as validation reads them
        positions, document_ids = documents.layout(idx) if documents is not None else (None, None)
        with eval_mode(pl_module):
            result = eager_attention_pass(gpt, idx, positions, layers=self.layers, documents=document_ids)
        # per-document positions: distances and axes in tokens (inside a document they are the same)
        shown = result.positions if result.positions.dim() == 1 else None
        summaries = head_summaries(result.probs, shown)
        self.last_metrics = summary_metrics(summaries)

        n_head = next(iter(result.probs.values())).shape[1]
        heads = self.heads if self.heads is not None else list(range(n_head))
        heads = heads[: self.max_heads_plotted]
        scheme = getattr(getattr(gpt, "pe", None), "name", "")
        title = " ".join(filter(None, ["attention", scheme, f"step {step}", f"(T={idx.shape[1]})"]))
        fig = plot_attention_grid(result.probs, heads=heads, title=title, positions=shown)
        path = self.output_dir(trainer) / f"step{step:06d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=100)
        self.last_path = path
        del fig, result

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="attention/maps", images=[str(path)], step=step)
            logger.log_metrics(self.last_metrics, step=step)
