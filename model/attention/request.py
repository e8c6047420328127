"""What decides the attention route of one forward: one frozen request, read by ``resolve``, ``auto``
and every backend's ``refusal``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionRequest:
    """One forward's attention, as routing sees it (``GPT.request`` builds it)."""

    pe: Any  # the scheme (model/pe/): its hooks and ``terms`` kind
    device: torch.device
    dtype: torch.dtype = torch.float32  # the compute dtype of q, k, v
    dropout: float = 0.0  # attention dropout of this forward (0 outside training)
    grad: bool = False  # under autograd
    queries: int | None = None  # new tokens of the forward (1: decoding); None: unknown
    documents: bool = False  # packed documents (a document mask)
    batch: int | None = None  # sequences; with ``queries`` and ``layers`` it sizes math's tensors
    layers: int = 1
    normaliser: str = "softmax"  # model.normaliser (model/attention/normalisers.py)
    windows: bool = False  # some layer has a sliding window

    @classmethod
    def of_model(cls, config, pe, device: torch.device, dtype: torch.dtype, training: bool, grad: bool, *,
                 queries: int | None = None, batch: int | None = None, documents: bool = False) -> "AttentionRequest":
        """The request of a forward of a model built from ``config`` (model/config.py's GPTConfig):
        what a forward adds (device, dtype, mode, its shape) beside what the config fixes. Built by
        ``GPT.request`` for each forward and by the launch check before any model exists."""
        return cls(pe, device, dtype, config.dropout if training else 0.0, grad, queries, documents, batch,
                   config.n_layer, config.normaliser, config.windowed)

    @property
    def terms(self) -> str | None:
        """The scheme's kind of data-dependent terms: None, "layer" or "scores" (PositionEncoding.terms)."""
        return getattr(self.pe, "terms", None)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
