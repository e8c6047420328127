"""The harness's evaluation callbacks: Lightning talks to evaluation/ here, and only here.

The probes themselves (scoring, rows, files, plots) are plain functions in ``evaluation/``;
these callbacks (conf/callbacks/default.yaml) pick the model, the data and the moment from the
trainer, call them, and hand what they return to the trainer's loggers:

- ``EndOfTrainingEvaluation``: when fit ends, the extrapolation table (every rank scores its
  share of the windows; the sums are reduced), the task accuracy table for synthetic data,
  the attention probe against length (rank zero) and the unigram baseline (rank zero);
- ``AttentionMaps``: attention heatmaps and per-head summaries on a fixed validation sample;
- ``PositionFunctions``: the scheme's learned position functions when training ends.

Outputs go under ``trainer.default_root_dir`` (the run dir) and to the trainer's loggers.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import WandbLogger
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from data.stream import load_tokens
from evaluation import position_loss
from evaluation import tasks as task_eval
from evaluation.attention_maps import (ProbeConfig, eager_attention_pass, eval_mode, evaluate_probe, head_summaries,
                                       plot_attention_grid, probe_loggable, probe_metrics, probe_windows, save_probe,
                                       summary_metrics)
from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation, loggable, save_results
from evaluation.position_functions import plot_functions
from model.gpt import uncompiled
from pelab.loggers import log_results


def sharded_parameters(trainer: L.Trainer) -> bool:
    """True under strategies that shard the weights across ranks (FSDP, model parallel): a
    forward of the bare module outside the strategy's wrapper would see only shards."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

    return isinstance(getattr(trainer, "strategy", None), (FSDPStrategy, ModelParallelStrategy))


class EndOfTrainingEvaluation(L.Callback):
    """``extrapolation`` / ``tasks``: the ``eval.extrapolation`` / ``eval.tasks`` options
    (conf/eval/default.yaml); each runs when its ``enabled`` is true."""

    def __init__(self, extrapolation: dict | None = None, tasks: dict | None = None, probe: dict | None = None) -> None:
        self.extrapolation = dict(extrapolation or {})
        self.tasks = dict(tasks or {})
        self.probe = dict(probe or {})

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        datamodule = trainer.datamodule
        output_dir = Path(trainer.default_root_dir)
        step = trainer.global_step
        options, tasks = dict(self.extrapolation), dict(self.tasks)
        # a synthetic task has no held-out text: its accuracy table replaces perplexity (eval.tasks.enabled=auto)
        text = getattr(datamodule, "held_out_text", True)
        options["enabled"] = bool(options.get("enabled")) and text
        tasks["enabled"] = tasks.get("enabled", "auto") is True or (tasks.get("enabled", "auto") == "auto" and not text)
        if sharded_parameters(trainer) and (options.get("enabled") or tasks.get("enabled") or self.probe.get("enabled")):
            ckpt = getattr(trainer.checkpoint_callback, "last_model_path", "") or "RUN_DIR/checkpoints/last.ckpt"
            rank_zero_warn(f"end-of-training evaluation skipped under {type(trainer.strategy).__name__} (each rank holds "
                           f"a shard of the weights): run scripts/eval_extrapolation.py ckpt={ckpt} (or "
                           f"scripts/eval_tasks.py) on the full checkpoint")
            options["enabled"] = tasks["enabled"] = False
        probe_on = bool(self.probe.get("enabled")) and not sharded_parameters(trainer)
        if options.pop("enabled", False):
            config = ExtrapolationConfig.from_dict(options)
            tokens = load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"])
            train_length = pl_module.config.block_size
            log = print if trainer.is_global_zero else (lambda _: None)
            by_position: list = []
            rows = evaluate_extrapolation(pl_module.model, tokens, train_length, config, log=log,
                                          distributed=trainer.world_size > 1, position_rows=by_position,
                                          randomize_to=getattr(pl_module, "randomize_to", None),
                                          documents=getattr(pl_module, "documents", None))
            if trainer.is_global_zero:
                title = f"pe={pl_module.pe_name}, trained at {train_length}"
                paths = save_results(rows, output_dir / "extrapolation", title=title)
                metrics = {f"extrapolation/{r.mode}/{r.rope_scaling}/ppl@{r.eval_length}"
                           + ("" if r.documents == "none" else f"/documents={r.documents}"): r.ppl for r in rows if r.ok}
                log_results(trainer.loggers, loggable(rows, paths["png"]), metrics, step)
                if by_position:
                    where = position_loss.save_results(by_position, output_dir / "extrapolation", title=title)
                    log_results(trainer.loggers, position_loss.loggable(by_position, where["png"]), {}, step)
                print(f"[pelab] extrapolation table: {paths['csv']} (+ .png, .md, position_loss.csv/.png)", flush=True)
        if not trainer.is_global_zero:
            return
        if tasks.get("enabled"):
            run_task_evaluation(tasks, pl_module, datamodule, trainer.loggers, output_dir, step)
        if probe_on:
            self.run_probe(pl_module, datamodule, trainer.loggers, output_dir, step)
        baseline = datamodule.unigram_loss()
        trainer.callback_metrics["val/unigram_loss"] = torch.tensor(baseline)  # for the end-of-run summary
        for logger in trainer.loggers:
            logger.log_metrics({"val/unigram_loss": baseline}, step=step)

    def run_probe(self, pl_module, datamodule, loggers, output_dir: Path, step: int) -> None:
        """Attention entropy and distance per layer and head at every probe length (its own pass)."""
        config = ProbeConfig.from_dict({k: v for k, v in self.probe.items() if k != "enabled"})
        if getattr(datamodule, "held_out_text", True):
            windows = probe_windows(load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"]))
        else:
            windows = probe_windows(task=datamodule.task, seed=datamodule.seed)
        train_length = pl_module.config.block_size
        rows = evaluate_probe(pl_module.model, windows, train_length, config)
        paths = save_probe(rows, output_dir / "attention_probe", title=f"pe={pl_module.pe_name}, trained at {train_length}")
        log_results(loggers, probe_loggable(rows, paths["png"]), probe_metrics(rows), step)
        print(f"[pelab] attention probe: {paths['csv']} (+ .png)", flush=True)


def run_task_evaluation(options: dict, module, datamodule, loggers: list, output_dir: Path, step: int
                        ) -> list[task_eval.TaskRow]:
    """The end-of-training task evaluation (rank zero): the accuracy table of the trained model
    on the data module's task, CSV/PNG/markdown under ``output_dir/tasks``, W&B table and chart.
    ``options``: ``eval.tasks`` (``enabled: false`` skips); the training length is the model's."""
    options = dict(options)
    if not options.pop("enabled", True):
        return []
    config = task_eval.TaskEvalConfig.from_dict(options)
    train_length = module.config.block_size
    rows = task_eval.evaluate_tasks(module.model, datamodule.task, train_length, config, seed=datamodule.seed,
                                    randomize_to=getattr(module, "randomize_to", None))
    paths = task_eval.save_results(rows, output_dir / "tasks",
                                   title=f"{datamodule.task.name}: pe={module.pe_name}, trained at {train_length}")
    log_results(loggers, task_eval.loggable(rows, paths["png"]), task_eval.summary_metrics(rows), step)
    verdict = {"yes": "learned", "no": "NOT learned", "": "not measured"}[rows[0].learned if rows else ""]
    threshold = 100 * task_eval.LEARNED_THRESHOLD
    print(f"[pelab] task accuracy table: {paths['csv']} (+ .png, .md{', heatmap.png/.csv' if 'heatmap' in paths else ''}); "
          f"task {verdict} at the training length (criterion: exact match >= {threshold:g}% on held-out samples)",
          flush=True)
    return rows


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
