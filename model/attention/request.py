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

    @property
    def terms(self) -> str | None:
        """The scheme's kind of data-dependent terms: None, "layer" or "scores" (PositionEncoding.terms)."""
        return getattr(self.pe, "terms", None)

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"
