"""What runs once training ends, as a callback so it works the same under every strategy:
the extrapolation table (every rank scores its share of the windows; the sums are reduced),
the task accuracy table for synthetic data (rank zero), and the unigram baseline (rank zero).
Outputs go under ``trainer.default_root_dir`` (the run dir) and to the trainer's loggers.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.utilities import rank_zero_warn

from data.datamodule import load_tokens
from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation, log_to_wandb, save_results
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
                log_results(trainer.loggers, log_to_wandb, rows, paths["png"], metrics, step)
                if by_position:
                    from evaluation import position_loss

                    where = position_loss.save_results(by_position, output_dir / "extrapolation", title=title)
                    log_results(trainer.loggers, position_loss.log_to_wandb, by_position, where["png"], {}, step)
                print(f"[pelab] extrapolation table: {paths['csv']} (+ .png, .md, position_loss.csv/.png)", flush=True)
        if not trainer.is_global_zero:
            return
        if tasks.get("enabled"):
            from evaluation.tasks import run_task_evaluation

            run_task_evaluation(tasks, pl_module, datamodule, trainer.loggers, output_dir, step)
        if probe_on:
            self.run_probe(pl_module, datamodule, trainer.loggers, output_dir, step)
        baseline = datamodule.unigram_loss()
        trainer.callback_metrics["val/unigram_loss"] = torch.tensor(baseline)  # for the end-of-run summary
        for logger in trainer.loggers:
            logger.log_metrics({"val/unigram_loss": baseline}, step=step)

    def run_probe(self, pl_module, datamodule, loggers, output_dir: Path, step: int) -> None:
        """Attention entropy and distance per layer and head at every probe length (its own pass)."""
        from evaluation.attention_maps import (ProbeConfig, evaluate_probe, log_probe_to_wandb, probe_metrics,
                                               probe_windows, save_probe)

        config = ProbeConfig.from_dict({k: v for k, v in self.probe.items() if k != "enabled"})
        if getattr(datamodule, "held_out_text", True):
            windows = probe_windows(load_tokens(datamodule.split_path("val"), datamodule.meta["dtype"]))
        else:
            windows = probe_windows(task=datamodule.task, seed=datamodule.seed)
        train_length = pl_module.config.block_size
        rows = evaluate_probe(pl_module.model, windows, train_length, config)
        paths = save_probe(rows, output_dir / "attention_probe", title=f"pe={pl_module.pe_name}, trained at {train_length}")
        log_results(loggers, log_probe_to_wandb, rows, paths["png"], probe_metrics(rows), step)
        print(f"[pelab] attention probe: {paths['csv']} (+ .png)", flush=True)
