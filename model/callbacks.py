"""Lightning callbacks configured from conf/callbacks/."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ThroughputMonitor


def _batch_size(batch: Any) -> int:
    return batch[0].size(0)


def _tokens(batch: Any) -> int:
    return batch[0].numel()


class TokenThroughput(ThroughputMonitor):
    """Lightning's ThroughputMonitor for (x, y) token batches: ``train/items_per_sec`` is
    tokens/s over all devices, ``train/device/items_per_sec`` per device, and on GPUs
    ``train/device/mfu`` from ``LitGPT.flops_per_batch``."""

    def __init__(self, window_size: int = 20, **kwargs: Any) -> None:
        super().__init__(batch_size_fn=_batch_size, length_fn=_tokens, window_size=window_size, **kwargs)
