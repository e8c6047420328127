"""The optimiser: AdamW with decoupled weight decay on matrices only, linear warmup, then cosine
decay to ``min_lr`` (the ``optim`` config group)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import nn

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


# Name components that wrappers insert: FSDP units, activation checkpointing, torch.compile.
WRAPPER_NAMES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod")


def plain_name(name: str) -> str:
    """A parameter's name without the wrappers' components, i.e. its name in the bare model:
    ``blocks.0._fsdp_wrapped_module.attn.c_attn.weight`` -> ``blocks.0.attn.c_attn.weight``."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def decay_rule(model: nn.Module) -> dict[str, bool]:
    """Whether each parameter (by plain name, tied ones under each name) gets weight decay:
    matrices do (the tied token embedding too, as in nanoGPT); norm gains and biases do not; a
    position scheme's parameters only where the scheme says so. Decided on the bare model:
    under FSDP (``use_orig_params``) every parameter is a 1-D shard view by the time the
    optimizer is built, so its shape no longer tells a matrix from a bias."""
    pe = model.pe
    scheme_rule = {id(p): False for p in pe.parameters()} | {id(p): True for p in pe.decayed_parameters()}
    return {plain_name(name): scheme_rule.get(id(p), p.dim() >= 2)
            for name, p in model.named_parameters(remove_duplicate=False)}


def param_groups(model: nn.Module, weight_decay: float, rule: dict[str, bool] | None = None) -> list[dict]:
    """The decayed and the other trainable parameters of ``model`` (bare or wrapped), as
    ``rule`` (``decay_rule`` of the bare model; default: of ``model`` itself) says by name."""
    rule = decay_rule(model) if rule is None else rule
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            if plain_name(name) not in rule:
                raise KeyError(f"parameter {name} was not in the model when its weight-decay groups were decided")
            (decay if rule[plain_name(name)] else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def adamw(model: nn.Module, optim: OptimConfig, fused: bool, rule: dict[str, bool] | None = None
          ) -> torch.optim.AdamW:
    return torch.optim.AdamW(param_groups(model, optim.weight_decay, rule), lr=optim.lr, betas=optim.betas,
                             eps=optim.eps, fused=fused)


def cosine_schedule(optimizer: torch.optim.Optimizer, optim: OptimConfig,
                    decay_steps: int | None) -> torch.optim.lr_scheduler.LambdaLR:
    """``OptimConfig.lr_at`` as a per-step multiplier of ``optim.lr``."""
    if decay_steps is None or decay_steps <= 0:
        raise ValueError("set trainer.max_steps (or optim.decay_steps): the cosine schedule needs a length")
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: optim.lr_at(step, decay_steps) / optim.lr)
