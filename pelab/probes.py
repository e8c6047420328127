"""The harness's evaluation callbacks: Lightning talks to evaluation/ here, and only here.

The probes themselves (scoring, rows, files, plots) are plain functions in ``evaluation/``;
these callbacks (conf/callbacks/default.yaml) pick the model, the data and the moment from the
trainer, call them, and hand what they return to the trainer's loggers:

- ``EndOfTrainingEvaluation``: when fit ends, the probes conf/eval enables, through the runner
  the scripts share (pelab/evaluate.py), then the unigram baseline (rank zero);
- ``AttentionMaps``: attention heatmaps and per-head summaries on a fixed validation sample;
- ``PositionFunctions``: the scheme's learned position functions when training ends.

Outputs go under ``trainer.default_root_dir`` (the run dir) and to the trainer's loggers.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from evaluation.attention_maps import eager_attention_pass, head_summaries, plot_attention_grid, summary_metrics
from evaluation.position_functions import plot_functions
from evaluation.registry import enabled_probes
from evaluation.sweep import eval_mode
from model.unwrap import uncompiled
from pelab.callbacks import sharded_gradients
from pelab.evaluate import run_evaluations, subject_of


def sharded_parameters(trainer: L.Trainer) -> bool:
    """True under strategies that shard the weights across ranks (FSDP, model parallel): a
    forward of the bare module outside the strategy's wrapper would see only shards."""
    return getattr(trainer, "strategy", None) is not None and sharded_gradients(trainer)


@contextmanager
def on_training_device(trainer: L.Trainer, pl_module: L.LightningModule) -> Iterator[None]:
    """The module on the device it trained on, for the length of the block, then back where it
    was. Lightning's teardown, which runs before ``on_fit_end``, parks the module on the CPU to
    free the accelerator; the probes score on the device of the parameters they are given."""
    parked = next(pl_module.parameters()).device
    trainer.strategy.model_to_device()  # the strategy's own move to its root device
    try:
        yield
    finally:
        pl_module.to(parked)  # as teardown left it: the accelerator's memory free again


class EndOfTrainingEvaluation(L.Callback):
    """When fit ends: the probes ``eval.extrapolation`` / ``eval.tasks`` / ``eval.probe``
    (conf/eval/default.yaml) enable, through the one runner (pelab/evaluate.py), on the device
    that trained (``on_training_device``), then the unigram baseline."""

    def __init__(self, options: dict | None = None, **probes: dict) -> None:
        """``options``: the ``eval`` section; ``probes``: probe blocks by name, on top of it."""
        self.options = {**dict(options or {}), **probes}

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        if not sharded_parameters(trainer):
            with on_training_device(trainer, pl_module):
                subject = subject_of(pl_module, datamodule, distributed=trainer.world_size > 1,
                                     rank_zero=trainer.is_global_zero)
                run_evaluations(subject, self.options, Path(trainer.default_root_dir), trainer.global_step,
                                trainer.loggers, rank_zero=trainer.is_global_zero)
        elif enabled_probes(self.options, getattr(datamodule, "held_out_text", True)):
            ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "RUN_DIR/checkpoints/last.ckpt"
            rank_zero_warn(f"end-of-training evaluation skipped under {type(trainer.strategy).__name__} (each rank holds "
                           f"a shard of the weights): run scripts/evaluate.py ckpt={ckpt} (or "
                           f"scripts/eval_extrapolation.py, scripts/eval_tasks.py) on the full checkpoint")
        if not trainer.is_global_zero:
            return
        baseline = datamodule.unigram_loss()
        trainer.callback_metrics["val/unigram_loss"] = torch.tensor(baseline)  # for the end-of-run summary
        for logger in trainer.loggers:
            logger.log_metrics({"val/unigram_loss": baseline}, step=trainer.global_step)


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


class PositionFunctions(L.Callback):
    """When training ends (rank zero): plot the scheme's learned position functions to
    ``{default_root_dir}/{output_subdir}/stepNNNNNN.png`` and W&B (``position/functions``)."""

    def __init__(self, output_subdir: str = "position_functions") -> None:
        self.output_subdir = output_subdir
        self.last_path: Path | None = None

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        if sharded_parameters(trainer):  # the scheme's parameters are flattened shards here
            rank_zero_warn(f"position-function plots skipped under {type(trainer.strategy).__name__}: the weights "
                           f"are sharded; plot from the full checkpoint")
            return
        gpt = uncompiled(getattr(pl_module, "model", pl_module))
        curves = gpt.pe.learned_functions(gpt.config.block_size)
        if not curves:
            return
        step = trainer.global_step
        path = Path(trainer.default_root_dir or trainer.log_dir) / self.output_subdir / f"step{step:06d}.png"
        self.last_path = plot_functions(curves, f"pe={gpt.pe.name}, step {step}", path)
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                logger.log_image(key="position/functions", images=[str(path)], step=step)
