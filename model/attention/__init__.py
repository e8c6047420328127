"""Attention backends: a class per file, one name -> backend map, one ``auto`` policy.

Every backend adds the scheme's position terms in float32 (docs/design.md, section 5).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.bias_grad import BiasGrad
from model.attention.flex import Flex
from model.attention.math import AttentionRecorder, Math
from model.attention.sdpa import SDPA
from model.attention.sdpa_key import SDPAKey

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (SDPA(), SDPAKey(), Flex(), Math(), BiasGrad())}
CHOICES = ("auto", *BACKENDS)  # the values of model.attention

# ``auto`` on CPU for schemes with a key-only form: sdpa_key (True) or the float32 mask (False),
# whichever measured faster on CPU (docs/benchmark.md).
AUTO_CPU_KEY_ONLY = False


def auto(pe: Any, device: torch.device, dropout: float) -> str:
    """The default backend of a scheme on a device (docs/design.md, section 5)."""
    if not pe.uses_bias:
        return "sdpa"
    if pe.key_only_slopes() is not None:
        return "sdpa_key" if device.type == "cuda" or AUTO_CPU_KEY_ONLY else "sdpa"
    if device.type == "cuda" and not dropout:
        return "flex"
    return "sdpa"


def resolve(name: str, pe: Any, device: torch.device, dtype: torch.dtype = torch.float32, dropout: float = 0.0,
            grad: bool = False, queries: int | None = None) -> AttentionBackend:
    """The backend that runs ``name`` (a value of model.attention) for this forward: ``auto``
    decided, a backend that does not apply replaced by the first of its fallbacks that does
    (``math`` applies everywhere), flex for a single query (decoding) served by ``math``, and
    SDPA with a learned bias under autograd on CPU served by ``bias_grad`` (SDPA would take
    its float32 math path)."""
    backend = BACKENDS[auto(pe, device, dropout) if name == "auto" else name]
    if backend.name != "flex" and not backend.supports(pe, device, dtype, dropout, grad):  # flex says why
        backend = next(BACKENDS[n] for n in backend.fallback if BACKENDS[n].supports(pe, device, dtype, dropout, grad))
    if backend.name == "flex" and queries == 1:  # one decoded token: a compiled kernel per cache length buys nothing
        backend = BACKENDS["math"]
    bias_grad = BACKENDS["bias_grad"]
    if backend.name == "sdpa" and bias_grad.supports(pe, device, dtype, dropout, grad):
        backend = bias_grad
    return backend


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: Any, dropout: float = 0.0) -> Tensor:
    """(B, H, Tq, hd) output of queries that are the last Tq of the Tk keys, with the context's
    backend and prepared state, in query chunks when the context has them (long evaluations:
    the (H, T, T) terms never exist at once)."""
    backend, Tq, Tk = ctx.backend, q.shape[2], k.shape[2]
    spans = [(0, Tq)] if ctx.chunk is None else [(s, min(Tq, s + ctx.chunk)) for s in range(0, Tq, ctx.chunk)]
    parts = []
    for s, e in spans:
        ke = Tk - Tq + e  # rows [s, e) see keys [0, ke)
        if ctx.chunk is None:
            out = backend(q, k, v, ctx.state, dropout)
        elif backend.full_keys:  # same K/V shape for every chunk: one compiled kernel per length
            out = backend(q[:, :, s:e], k, v, backend.chunk(ctx.state, ctx.terms, s, e), dropout)
        else:
            out = backend(q[:, :, s:e], k[:, :, :ke], v[:, :, :ke], backend.chunk(ctx.state, ctx.terms, s, e), dropout)
        if backend.records:
            out, p = out
            if ctx.record is not None:
                ctx.record.add_chunk(p, s, Tk)
        parts.append(out)
    if ctx.record is not None and backend.records:
        ctx.record.end_layer()
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


__all__ = ["AUTO_CPU_KEY_ONLY", "BACKENDS", "CHOICES", "AttentionBackend", "AttentionRecorder", "Terms", "attend",
           "auto", "resolve"]
