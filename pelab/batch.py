"""The global batch as tokens per optimiser step: ``data.tokens_per_step`` fixes it, and the
gradient accumulation follows from the micro-batch, the context and the number of ranks, so
a sweep over devices or nodes keeps the optimisation the same."""

from __future__ import annotations

from omegaconf import DictConfig, open_dict

from pelab.config import ConfigError


def accumulation_for(tokens_per_step: int, batch_size: int, block_size: int, devices: int, nodes: int) -> int:
    """Micro-batches per optimiser step so that every step sees exactly ``tokens_per_step`` tokens."""
    per_micro_step = batch_size * block_size * devices * nodes
    if isinstance(tokens_per_step, bool) or not isinstance(tokens_per_step, int) or tokens_per_step < 1:
        raise ConfigError(f"data.tokens_per_step={tokens_per_step!r} is not valid; allowed: null (one micro-batch "
                          f"per rank per step) or a positive integer")
    if tokens_per_step % per_micro_step:
        below = tokens_per_step // per_micro_step * per_micro_step
        near = " or ".join(str(n) for n in (below, below + per_micro_step) if n > 0)
        raise ConfigError(
            f"data.tokens_per_step={tokens_per_step} is not a whole number of micro-batches of data.batch_size="
            f"{batch_size} x model.block_size={block_size} x {devices} device(s) x {nodes} node(s) = "
            f"{per_micro_step} tokens; allowed: a multiple of {per_micro_step}, e.g. {near}")
    return tokens_per_step // per_micro_step


def describe_batch(batch_size: int, block_size: int, devices: int, nodes: int, accumulation: int) -> str:
    total = batch_size * block_size * devices * nodes * accumulation
    return (f"[pelab] global batch: {total:,} tokens per optimiser step = micro-batch {batch_size} x context "
            f"{block_size} x {devices} device(s) x {nodes} node(s) x {accumulation} accumulation step(s)")


def set_accumulation(trainer, cfg: DictConfig) -> None:
    """The trainer's gradient accumulation from ``data.tokens_per_step`` (recorded in ``cfg``, so the
    saved config says how the run ran), then the global batch printed once."""
    data = cfg.data
    if data.get("tokens_per_step") is not None:
        trainer.accumulate_grad_batches = accumulation_for(data.tokens_per_step, data.batch_size, cfg.model.block_size,
                                                           trainer.num_devices, trainer.num_nodes)
        with open_dict(cfg):
            cfg.trainer.accumulate_grad_batches = trainer.accumulate_grad_batches
    if trainer.is_global_zero:
        print(describe_batch(data.batch_size, cfg.model.block_size, trainer.num_devices, trainer.num_nodes,
                             trainer.accumulate_grad_batches), flush=True)
