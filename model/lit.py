"""LightningModule: optimisation, schedule and metrics around the GPT of model/gpt.py."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

import hydra
import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from omegaconf import DictConfig, OmegaConf
from torchmetrics import MeanMetric

from model.config import GPTConfig
from model.gpt import GPT
from model.pe.schedule import check_randomize_to, nope_layers, random_positions, split_schedule
from pelab.config import check_options, require


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr: float = 1e-4
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    warmup_steps: int = 100
    decay_steps: int | None = None  # cosine reaches min_lr here; default: trainer.max_steps

    def __post_init__(self) -> None:
        check_options("optim", {f.name: getattr(self, f.name) for f in fields(self)}, OptimConfig)
        self.betas = tuple(self.betas)
        require(self.lr > 0, "optim.lr", self.lr, "> 0")
        require(0 < self.min_lr <= self.lr, "optim.min_lr", self.min_lr, f"in (0, optim.lr={self.lr}]")
        require(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        require(all(0 <= b < 1 for b in self.betas), "optim.betas", list(self.betas), "two numbers in [0, 1)")
        require(self.eps > 0, "optim.eps", self.eps, "> 0")
        require(self.warmup_steps >= 0, "optim.warmup_steps", self.warmup_steps, "an integer >= 0")
        require(self.decay_steps is None or self.decay_steps >= 1, "optim.decay_steps", self.decay_steps,
                "null (= trainer.max_steps) or an integer >= 1")

    def lr_at(self, step: int, decay_steps: int) -> float:
        """Linear warmup from 0, then cosine decay to min_lr at decay_steps, then flat."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / (self.warmup_steps + 1)
        if step >= decay_steps:
            return self.min_lr
        progress = (step - self.warmup_steps) / max(1, decay_steps - self.warmup_steps)
        return self.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (self.lr - self.min_lr)


def _plain(cfg: Any) -> Any:
    return OmegaConf.to_container(cfg, resolve=True) if isinstance(cfg, DictConfig) else cfg


class LitGPT(L.LightningModule):
    """Built from plain dicts (the Hydra groups ``model``, ``pe``, ``optim``) so that a
    checkpoint alone rebuilds the model: ``LitGPT.load_from_checkpoint(path)``."""

    def __init__(self, model: dict, pe: dict, optim: dict | None = None, compile: bool = False) -> None:
        super().__init__()
        model, pe, optim = _plain(model), _plain(pe), _plain(optim) or {}
        self.save_hyperparameters({"model": model, "pe": pe, "optim": optim, "compile": compile})
        self.config = GPTConfig(**model)
        self.optim = OptimConfig(**optim)
        scheme, schedule = split_schedule(pe)
        pe_factory = hydra.utils.instantiate(scheme, _partial_=True)
        self.model = GPT(self.config, pe_factory(self.config),
                         nope_layers(self.config.n_layer, schedule.get("nope_every")))
        self.randomize_to = check_randomize_to(schedule.get("randomize_to"), self.config.block_size,
                                               self.model.pe.max_positions)
        self.compile = compile
        self.val_loss = MeanMetric()
        # PaLM appendix B: 6N + 12·L·d·T model FLOPs per trained token (tied weights counted once)
        n_params = sum(p.numel() for p in self.model.parameters())
        c = self.config
        self.flops_per_token = 6 * n_params + 12 * c.n_layer * c.n_embd * c.block_size

    @property
    def pe_name(self) -> str:
        return self.model.pe.name

    def configure_model(self) -> None:
        if self.compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def on_fit_start(self) -> None:
        if self.global_rank == 0:  # the attention backend, once per fit
            gpt = getattr(self.model, "_orig_mod", self.model)
            print(f"[pelab] attention: {gpt.attention_backend(self.device)} "
                  f"(model.attention={self.config.attention}, pe={self.pe_name}, {self.device.type})")

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        return self.model(idx, targets, positions)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        _, loss = self.model(x, y, self.training_positions(x, batch_idx))
        self.log("train/loss", loss, prog_bar=True)
        self.log("lr", self.optimizers().param_groups[0]["lr"], prog_bar=False)
        return loss

    def training_positions(self, x: torch.Tensor, batch_idx: int) -> torch.Tensor | None:
        """None (0..T-1), or with ``pe.randomize_to`` per-sequence random positions drawn from
        (seed, rank, step, micro-batch): reproducible, resumable, different on every rank."""
        if self.randomize_to is None:
            return None
        key = hash((torch.initial_seed(), self.global_rank, self.global_step, batch_idx)) & (2**63 - 1)
        generator = torch.Generator(device=x.device).manual_seed(key)
        return random_positions(x.shape[0], x.shape[1], self.randomize_to, generator, x.device)

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        _, loss = self.model(x, y)
        self.val_loss.update(loss, weight=(y >= 0).sum())  # scored targets only: ignored ones (-1) carry no loss

    def on_validation_epoch_end(self) -> None:
        loss = self.val_loss.compute()  # token-weighted mean, synced across ranks by torchmetrics
        self.val_loss.reset()
        self.log("val/loss", loss, prog_bar=True)
        self.log("val/ppl", torch.exp(loss))

    def _grad_scaler(self):
        """The trainer's GradScaler (16-mixed), or None (bf16-mixed, 32-true, no trainer)."""
        return getattr(getattr(self._trainer, "precision_plugin", None), "scaler", None)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip as ``trainer.gradient_clip_val``/``_algorithm`` say, where Lightning's own clipping
        would refuse pelab's setups: its mixed-precision plugin refuses every fused optimizer
        (a rule for GradScaler's unscaling inside the step; bf16 has no scaler) and its FSDP
        plugin refuses norm clipping (the norm must span every shard: FSDP's own
        ``clip_grad_norm_``). Under 16-mixed the AdamW is not fused and Lightning clips."""
        if not gradient_clip_val:
            return
        trainer = self.trainer
        if self._grad_scaler() is not None:
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            return
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if str(getattr(gradient_clip_algorithm, "value", gradient_clip_algorithm)) == "value":
            torch.nn.utils.clip_grad_value_(params, gradient_clip_val)
        elif isinstance(trainer.strategy, FSDPStrategy):
            trainer.strategy.model.clip_grad_norm_(gradient_clip_val)
        else:
            torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)

    def configure_optimizers(self) -> dict:
        decay, no_decay = [], []
        pe = self.model.pe
        scheme_rule = {id(p): False for p in pe.parameters()} | {id(p): True for p in pe.decayed_parameters()}
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            # Matrices (incl. the tied token embedding, as in nanoGPT) are decayed; norm gains and
            # biases are not; a scheme's parameters only where the scheme says so.
            (decay if scheme_rule.get(id(p), p.dim() >= 2) else no_decay).append(p)
        groups = [{"params": decay, "weight_decay": self.optim.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        # torch's fused AdamW kernel (CUDA, and CPU since torch 2.4): on CPU about 3x faster than
        # the per-parameter loop that nanoGPT (fused on CUDA only) and the bench reference use.
        # Not with a GradScaler (16-mixed): it unscales inside a fused step, so the gradients
        # could not be unscaled before clipping (configure_gradient_clipping).
        fused = self.device.type in ("cuda", "cpu") and self._grad_scaler() is None
        optimizer = torch.optim.AdamW(groups, lr=self.optim.lr, betas=self.optim.betas,
                                      eps=self.optim.eps, fused=fused)
        decay_steps = self.optim.decay_steps or self.trainer.max_steps
        if decay_steps is None or decay_steps <= 0:
            raise ValueError("set trainer.max_steps (or optim.decay_steps): the cosine schedule needs a length")
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: self.optim.lr_at(step, decay_steps) / self.optim.lr
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
