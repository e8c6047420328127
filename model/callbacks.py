"""Lightning callbacks configured from conf/callbacks/."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch
from lightning.fabric.utilities.throughput import get_available_flops


class TokensPerSecond(L.Callback):
    """Logs ``train/tokens_per_sec`` (summed over ranks) and, where the device's peak is
    known (CUDA), ``train/mfu`` from ``LitGPT.flops_per_token``.

    Timed between logging steps and excluding validation; the device is synchronised only
    at those steps, so the training step itself is untouched.
    """

    def __init__(self) -> None:
        self._t0: float | None = None
        self._tokens = 0
        self._peak_flops: float | None = None

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        dtype = torch.bfloat16 if "bf16" in str(trainer.precision) else torch.float32
        self._peak_flops = get_available_flops(trainer.strategy.root_device, dtype)

    def _sync(self, pl_module: L.LightningModule) -> None:
        if pl_module.device.type == "cuda":
            torch.cuda.synchronize(pl_module.device)

    def _restart(self, pl_module: L.LightningModule) -> None:
        self._sync(pl_module)
        self._t0, self._tokens = time.perf_counter(), 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._restart(pl_module)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.training:  # resume timing after an in-fit validation
            self._restart(pl_module)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._tokens += batch[0].numel()
        if trainer.global_step % trainer.log_every_n_steps or trainer.fit_loop._should_accumulate():
            return
        self._sync(pl_module)
        elapsed = time.perf_counter() - self._t0
        if self._tokens and elapsed > 0:
            world = trainer.world_size
            pl_module.log("train/tokens_per_sec", self._tokens * world / elapsed, on_step=True, on_epoch=False)
            flops_per_token = getattr(pl_module, "flops_per_token", None)
            if self._peak_flops and flops_per_token:  # per device: this rank's tokens
                mfu = self._tokens * flops_per_token / elapsed / self._peak_flops
                pl_module.log("train/mfu", mfu, on_step=True, on_epoch=False)
        self._t0, self._tokens = time.perf_counter(), 0
