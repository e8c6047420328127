"""Attention backends: a class per file, one name -> backend map, one ``auto`` policy.

Every backend adds the scheme's position terms in float32 (docs/design.md, section 5).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms, data_terms
from model.attention.bias_grad import BiasGrad
from model.attention.flex import Flex
from model.attention.math import AttentionRecorder, Math
from model.attention.sdpa import SDPA
from model.attention.sdpa_key import SDPAKey
from model.attention.sinks import SINKS
from model.attention.stick_breaking import NORMALISERS

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (SDPA(), SDPAKey(), Flex(), Math(), BiasGrad())}
CHOICES = ("auto", *BACKENDS)  # the values of model.attention


def auto(pe: Any, device: torch.device, dropout: float) -> str:
    """The default backend of a scheme on a device (docs/design.md, section 5)."""
    if data_terms(pe) == "scores":  # only math materialises the scores
        return "math"
    if not pe.uses_bias:
        return "sdpa"
    if pe.key_only_slopes() is not None:  # on CPU the float32 mask measured faster (docs/performance.md, 5)
        return "sdpa_key" if device.type == "cuda" else "sdpa"
    if device.type == "cuda" and not dropout:
        return "flex"
    return "sdpa"


def resolve(name: str, pe: Any, device: torch.device, dtype: torch.dtype = torch.float32, dropout: float = 0.0,
            grad: bool = False, queries: int | None = None, documents: bool = False, batch: int | None = None,
            layers: int = 1, sinks: bool = False, normaliser: str = "softmax", windows: bool = False
            ) -> AttentionBackend:
    """The backend that runs ``name`` (a value of model.attention) for this forward: ``auto``
    decided, a backend that does not apply replaced by the first of its fallbacks that does
    (``math`` applies everywhere; a ``strict`` one raises instead, saying why), flex for a
    single query (decoding) served by ``math``, and SDPA with a learned bias under autograd
    on CPU served by ``bias_grad`` (SDPA would take its float32 math path).

    ``documents``: packed documents. On CUDA ``auto`` then takes flex where it applies (no
    dropout): its document BlockMask skips the blocks with no pair of one document, where SDPA
    would get a dense (B, 1, T, T) mask and compute every block. CPU routes are unchanged.
    ``windows``: some layer has a sliding window; on CUDA ``auto`` takes flex likewise (its
    window BlockMask skips the blocks before the window; SDPA would lose its causal kernel to
    an explicit mask: 1.135x the full model's step on an H200, docs/gpu.md).
    ``sinks``: attention sinks (sinks.py), which a backend joins only in its ``sink_dtypes``; on
    CUDA ``auto`` takes flex for them too (its LSE rescale; SDPA's extra key and head dims cost
    2.0x at T = 8192 on an H100, flex's rescale 1.06x);
    ``normaliser``: model.normaliser, which a backend computes only in its ``normalisers``.
    ``batch`` (with ``queries`` and ``layers``): a CUDA training forward that resolves to
    ``math`` is refused before any compute when math's float32 (B, H, T, T) tensors would not
    fit in the device's free memory (``check_math_memory``)."""
    def applies(backend: str) -> bool:
        return BACKENDS[backend].supports(pe, device, dtype, dropout, grad, sinks, normaliser)

    backend = BACKENDS[auto(pe, device, dropout) if name == "auto" else name]
    if (name == "auto" or not backend.strict) and not applies(backend.name):  # auto's pick is never an error
        backend = next(BACKENDS[n] for n in backend.fallback if applies(n))
    if (name == "auto" and (documents or windows or sinks) and device.type == "cuda" and backend.name != "flex"
            and applies("flex")):
        backend = BACKENDS["flex"]
    if queries == 1 and backend.decode is not None:
        backend = BACKENDS[backend.decode]
    if backend.grad_route is not None and applies(backend.grad_route):
        backend = BACKENDS[backend.grad_route]
    if not backend.adds(pe):  # a strict backend named
        kind = data_terms(pe)
        raise ValueError(f"model.attention={name} cannot add pe={pe.name}'s per-layer data-dependent terms; "
                         f"use model.attention=auto, sdpa, flex or math" if kind == "layer" else
                         f"model.attention={name} cannot add pe={pe.name}'s terms of the attention scores; "
                         f"use model.attention=auto or math")
    if normaliser not in backend.normalisers:  # a strict backend named
        raise ValueError(f"model.attention={name} cannot compute model.normaliser={normaliser}; "
                         f"use model.attention=auto or math")
    if (backend.name == "math" and grad and device.type == "cuda" and batch is not None and queries is not None
            and not torch.compiler.is_compiling()):  # reading the free memory would break the graph
        check_math_memory(name, pe, device, dtype, dropout, batch, queries, layers)
    return backend


def math_training_bytes(batch: int, heads: int, queries: int, keys: int, layers: int, dropout: float,
                        mask_bytes: int = 1) -> int:
    """Bytes of (B, H, Tq, Tk) tensors the ``math`` backend holds in a training forward: per
    layer, kept for the backward, the float32 probabilities and, with dropout, the dropped
    probabilities (float32) and the dropout mask (``mask_bytes`` an element: CUDA's dropout
    keeps a bool mask, CPU's a float32 one); plus the float32 scores and scores + mask of the
    layer being computed."""
    scores = batch * heads * queries * keys
    return scores * ((8 + mask_bytes if dropout else 4) * layers + 8)


def free_device_bytes(device: torch.device) -> int:
    """Bytes this process can still allocate on a CUDA device: the driver's free memory and
    what the caching allocator holds unused."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def check_math_memory(name: str, pe: Any, device: torch.device, dtype: torch.dtype, dropout: float, batch: int,
                      queries: int, layers: int) -> None:
    """Refuse a CUDA training forward on ``math`` whose (B, H, T, T) tensors do not fit, with
    the estimate and the ways out (before any attention is computed)."""
    need, free = math_training_bytes(batch, pe.n_head, queries, queries, layers, dropout), free_device_bytes(device)
    if need <= free:
        return
    gib = 2 ** 30
    route = "model.attention=math" if name == "math" else f"model.attention={name} with pe={pe.name} resolves to math"
    scores = data_terms(pe) == "scores"  # only math adds them, in any dtype and with any dropout
    why = ("only math adds its terms of the attention scores" if name != "math" and scores else
           f"model.dropout={dropout} in {str(dtype).removeprefix('torch.')}: flex has no attention dropout and SDPA "
           f"needs a float32 mask in float32 compute" if name != "math" and dropout else "")
    ways = ["model.dropout=0 (pe's bias on flex)" if dropout and BACKENDS["flex"].fits(pe, device, dtype, True)
            and BACKENDS["flex"].adds(pe) else None,
            "trainer.precision=32-true (SDPA with a float32 mask)" if dtype != torch.float32 and not scores else None,
            "another model.attention (sdpa, flex)" if name == "math" else None,
            "a smaller data.batch_size or model.block_size"]
    raise ValueError(
        f"{route}{' (' + why + ')' if why else ''}, which keeps float32 (B, H, T, T) attention tensors per layer: "
        f"about {need / gib:.1f} GiB for batch {batch} x {pe.n_head} heads x T={queries} x {layers} layers, more than "
        f"the {free / gib:.1f} GiB free on {device}. Ways out: {'; '.join(w for w in ways if w)}")


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: Any, dropout: float = 0.0, sink: Tensor | None = None,
           layer_terms: tuple[Tensor, Tensor] | None = None, score_terms: Any = None) -> Tensor:
    """(B, H, Tq, hd) output of queries that are the last Tq of the Tk keys, with the context's
    backend and prepared state, in query chunks when the context has them (long evaluations:
    the (H, T, T) terms never exist at once); ``sink``: the layer's (H,) sink logits (sinks.py);
    ``layer_terms``: a data-dependent scheme's (B, H, Tq) and (B, H, Tk) c, whose c_i - c_j the
    backend adds to this layer's mask (``AttentionBackend.add_layer_terms``); ``score_terms``: a
    score-dependent scheme's f(q, scores, visible keys) of this layer, which the backend adds to its logits."""
    backend, Tq, Tk = ctx.backend, q.shape[2], k.shape[2]
    with_sink = {} if sink is None else {"sink": sink}  # without sinks every backend's call stays 5 arguments
    if ctx.terms.normaliser != "softmax":  # only backends that compute it get it (resolve)
        with_sink["normaliser"] = ctx.terms.normaliser
    if score_terms is not None:  # only backends that declare ``score_terms`` get it (resolve)
        with_sink["score_terms"] = score_terms
    spans = [(0, Tq)] if ctx.chunk is None else [(s, min(Tq, s + ctx.chunk)) for s in range(0, Tq, ctx.chunk)]
    parts = []
    for s, e in spans:
        ks, ke = ctx.terms.key_span(s, e)  # rows [s, e) see keys [ks, ke): their windows' (all earlier without)
        if backend.full_keys:  # all Tk keys (its ``chunk`` hides the unseen): one K/V shape, one compiled kernel
            ks, ke = 0, Tk
        state = ctx.state if ctx.chunk is None else backend.chunk(ctx.state, ctx.terms, s, e)
        if layer_terms is not None:
            state = backend.add_layer_terms(state, layer_terms[0][..., s:e], layer_terms[1][..., ks:ke],
                                            ctx.terms.dtype)
        if ctx.chunk is None:
            out = backend(q, k, v, state, dropout, **with_sink)
        else:
            out = backend(q[:, :, s:e], k[:, :, ks:ke], v[:, :, ks:ke], state, dropout, **with_sink)
        if backend.records:
            out, p = out
            if ctx.record is not None:
                ctx.record.add_chunk(F.pad(p, (ks if ctx.chunk is not None else 0, 0)), s, Tk)
        parts.append(out)
    if ctx.record is not None and backend.records:
        ctx.record.end_layer()
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


__all__ = ["BACKENDS", "CHOICES", "NORMALISERS", "SINKS", "AttentionBackend", "AttentionRecorder", "Terms", "attend",
           "auto", "check_math_memory", "math_training_bytes", "resolve"]
