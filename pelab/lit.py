"""LightningModule: optimisation, schedule and metrics around the GPT of model/gpt.py."""

from __future__ import annotations

from dataclasses import dataclass

import hydra
import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn
from torchmetrics import MeanMetric

from data.packing import DocumentOptions
from model.config import GPTConfig
from model.differential import check_scheme as check_attention_kind
from model.gpt import GPT
from model.unwrap import uncompiled
from model.pe.scaling import apply_scaling, split_scaling
from model.temperature import check_temperature
from model.pe.schedule import (LAYER_KEYS, check_layer_rope, check_nope_layers, check_randomize_to, layer_positions,
                                random_positions, split_schedule)
from pelab.callbacks import LOGGED_STEP_BARS, logging_step
from pelab.checkpoint.tokenizer import RECORD as TOKENIZER_RECORD, tokenizer_record
from pelab.config import ConfigError, build, check_options, plain, target_class
from pelab.optim import OptimConfig, adamw, cosine_schedule, decay_rule


def model_config(values: dict) -> GPTConfig:
    """``GPTConfig`` of a ``model`` config dict: unknown keys and types checked here, ranges by
    GPTConfig itself; either way a one-line ConfigError."""
    check_options("model", values, GPTConfig)
    return build("model", GPTConfig, **values)


@dataclass
class Position:
    """A ``pe`` config built: the scheme and the schedule options beside it (model/pe/schedule.py)."""

    scheme: nn.Module
    nope_layers: frozenset[int]
    randomize_to: int | None
    layer_rope: tuple = ()  # layer i's own RoPE (LayerRope: pe.global_base, ...); None: the scheme's


def position_options(pe: dict) -> tuple[dict, dict]:
    """(the scheme's options, the schedule options and ``scaling``) of a ``pe`` config dict; the
    scheme's are checked against its class's signature."""
    options, schedule = split_schedule(pe)
    options, schedule["scaling"] = split_scaling(options)  # model/pe/scaling.py, applied once built
    check_options("pe", options, target_class("pe", options), ignore=("config",))
    return options, schedule


def build_position(pe: dict, config: GPTConfig) -> Position:
    """The scheme of a ``pe`` config dict for ``config``'s shape, with every rule that ties it to
    the model checked (a one-line ConfigError). Its parameters are initialised here, from the
    global RNG: the run's seed must be set before."""
    options, schedule = position_options(pe)
    scheme = build("pe", hydra.utils.instantiate(options, _partial_=True), config)
    build("pe.scaling", apply_scaling, scheme, schedule["scaling"], config.block_size)
    randomize_to = build("pe", check_randomize_to, schedule.get("randomize_to"), config.block_size,
                         scheme.max_positions)
    layers, rope = build("pe", layer_positions, config.layer_windows, *(schedule.get(k) for k in LAYER_KEYS))
    setting = next((f"pe.{k}={schedule[k]}" for k in LAYER_KEYS[:2] if schedule.get(k) is not None), None)
    if layers and not (scheme.uses_rotate or scheme.uses_bias):
        acts = ("only adds to the embeddings" if scheme.terms is None else
                "counts every layer's positions from its attention scores" if scheme.terms == "scores" else
                "turns every layer's q and k by angles of its input" if scheme.terms == "rotation" else
                "gates every layer's attention from its input")
        raise ConfigError(f"{setting} needs a scheme that acts inside attention through positions "
                          f"(rotation or bias); pe={scheme.name} {acts}")
    build("pe", check_nope_layers, layers, config.n_layer, scheme, setting)
    build("pe", check_layer_rope, rope, scheme)
    build("model.attn_temperature", check_temperature, config, scheme, layers)
    build("model.attention_kind", check_attention_kind, config, scheme)
    if scheme.max_positions is not None and config.block_size > scheme.max_positions:
        raise ConfigError(f"model.block_size={config.block_size} exceeds the {scheme.max_positions} positions of "
                          f"pe={scheme.name}; raise pe.max_positions or lower model.block_size")
    return Position(scheme, layers, randomize_to, rope)


# the compute dtype of a trainer.precision, by its prefix ("bf16-mixed", "16-mixed", "32-true", ...)
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "16": torch.float16, "32": torch.float32, "64": torch.float64}

class LitGPT(L.LightningModule):
    """Built from plain dicts (the Hydra groups ``model``, ``pe``, ``optim``) so that a
    checkpoint alone rebuilds the model: ``LitGPT.load_from_checkpoint(path)``. ``position``:
    the ``pe`` config already built (train.py's validation builds it once), else built here.
    ``documents``: what training reads of the packed documents (data/packing.py
    ``DocumentOptions`` as a dict); ``eval_documents``: ``eval.documents`` for validation
    (None: as training)."""

    def __init__(self, model: dict, pe: dict, optim: dict | None = None, compile: bool = False,
                 position: Position | None = None, documents: dict | None = None,
                 eval_documents: str | None = None) -> None:
        super().__init__()
        model, pe, optim = plain(model), plain(pe), plain(optim) or {}
        documents = plain(documents) or {}
        self.save_hyperparameters({"model": model, "pe": pe, "optim": optim, "compile": compile,
                                   "documents": documents})
        self.documents = DocumentOptions(**documents)
        self.val_documents = self.documents.resolve(eval_documents)
        self.config = model_config(model)
        self.optim = OptimConfig(**optim)
        position = position or build_position(pe, self.config)
        self.model = GPT(self.config, position.scheme, position.nope_layers, position.layer_rope)
        self.decay_rule: dict[str, bool] | None = None  # recorded by configure_model
        self.randomize_to = position.randomize_to
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
        """Called by Lightning before any strategy wraps the model. Records which parameters get
        weight decay, by name: under FSDP the parameters are 1-D shard views by the time
        configure_optimizers runs. Once: a later fit may find the model already wrapped."""
        if self.decay_rule is None:
            self.decay_rule = decay_rule(uncompiled(self.model))
        if self.compile and not isinstance(self.model, torch._dynamo.eval_frame.OptimizedModule):
            self.model = torch.compile(self.model)

    def on_fit_start(self) -> None:
        # the tokenizer this fit reads, kept in every checkpoint (pelab/checkpoint/tokenizer.py)
        datamodule = getattr(self.trainer, "datamodule", None)
        self.tokenizer_record = (tokenizer_record(datamodule.tokenizer)
                                 if getattr(datamodule, "tokenizer_name", None) is not None else None)
        if self.global_rank == 0:  # the attention backend that runs, once per fit
            dtype = COMPUTE_DTYPES.get(str(self.trainer.precision).split("-")[0], torch.float32)
            print(f"[pelab] attention: {uncompiled(self.model).attention(self.device, dtype=dtype).name} "
                  f"(model.attention={self.config.attention}, pe={self.pe_name}, {self.device.type}, "
                  f"{str(dtype).removeprefix('torch.')})")

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if getattr(self, "tokenizer_record", None):  # none: a synthetic task, or saved outside a fit
            checkpoint[TOKENIZER_RECORD] = self.tokenizer_record

    def configure_callbacks(self) -> list:
        """Lightning's default progress bar in its logging-step version (pelab/callbacks.py
        ``LoggedStepMetrics``): it reads the device at logging steps only. A bar of another
        class, or none, is left as it is."""
        bar = self.trainer.progress_bar_callback
        logged = LOGGED_STEP_BARS.get(type(bar))
        return [logged.like(bar)] if logged else []

    def optimizer_step(self, *args, **kwargs) -> None:
        super().optimizer_step(*args, **kwargs)
        uncompiled(self.model).pe.project()  # constrained scheme parameters (KERPLE) back into range

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None, positions: torch.Tensor | None = None):
        return self.model(idx, targets, positions)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        positions, documents = self.documents.layout(x)
        if self.randomize_to is not None:  # never with document positions (pelab/validate.py)
            positions = self.training_positions(x, batch_idx)
        _, loss = self.model(x, y, positions, documents)
        if self._trainer is None or logging_step(self._trainer):  # read on the host only when logged
            self.log("train/loss", loss)  # shown by LoggedStepMetrics' bars (prog_bar=True: read every batch)
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
        _, loss = self.model(x, y, *self.val_documents.layout(x))
        scored = (y >= 0).sum()  # scored targets only: ignored ones (-1) carry no loss
        # a batch of ignored windows only (the padding that evens out the ranks' batch counts):
        # weight 0, and 0, not the NaN of a mean over no target, so that it adds exactly nothing
        self.val_loss.update(torch.where(scored > 0, loss, 0.0), weight=scored)

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
        # Not fused under a GradScaler (16-mixed): it unscales inside a fused step, so the
        # gradients could not be unscaled before clipping (configure_gradient_clipping).
        fused = self.device.type in ("cuda", "cpu") and self._grad_scaler() is None
        optimizer = adamw(self.model, self.optim, fused, self.decay_rule)  # rule None: decided now
        scheduler = cosine_schedule(optimizer, self.optim, self.optim.decay_steps or self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
