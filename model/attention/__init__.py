"""Attention backends: a class per file, one name -> backend map, one ``auto`` policy.

Every backend adds the scheme's position terms in float32 (docs/design.md, section 5).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.bias_grad import BiasGrad
from model.attention.flex import Flex
from model.attention.math import AttentionRecorder, Math
from model.attention.normalisers import NORMALISERS
from model.attention.request import AttentionRequest
from model.attention.sdpa import SDPA
from model.attention.sdpa_key import SDPAKey
from model.attention.sinks import SINKS
from model.attention.triton_bias import TritonBias

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (SDPA(), SDPAKey(), Flex(), Math(), BiasGrad())}
# backends whose kernels need a compiler beside torch (Triton): named, or taken by auto where they run
KERNELS: dict[str, AttentionBackend] = {b.name: b for b in (TritonBias(),)}
CHOICES = ("auto", *BACKENDS, *KERNELS)  # the values of model.attention


def auto(request: AttentionRequest) -> str:
    """The default backend of a forward (docs/design.md, section 5)."""
    pe = request.pe
    if request.terms == "scores":  # only math materialises the scores
        return "math"
    if not pe.uses_bias:
        return "sdpa"
    if pe.key_only_slopes() is not None:  # on CPU the float32 mask measured faster (docs/performance.md, 5)
        return "sdpa_key" if request.cuda else "sdpa"
    kernel = KERNELS["triton_bias"]
    if kernel.in_auto and request.cuda and request.grad and kernel.refusal(request) is None:
        return "triton_bias"  # a bias of the distance trains in one fused kernel (docs/design.md, section 5)
    if request.cuda and not request.dropout:
        return "flex"
    return "sdpa"


def resolve(name: str, request: AttentionRequest) -> AttentionBackend:
    """The backend that runs ``name`` (a value of model.attention) for ``request``: ``auto``
    decided, a backend that refuses it replaced by the first of its fallbacks that serves it
    (``math`` serves everything; a ``strict`` one named raises its refusal instead), a single
    query (decoding) served by the backend's ``decode``, and SDPA with a learned bias under
    autograd on CPU served by ``bias_grad`` (SDPA would take its float32 math path).

    On CUDA ``auto`` takes flex where it serves (no dropout) for packed documents (its document
    BlockMask skips the blocks with no pair of one document, where SDPA would get a dense
    (B, 1, T, T) mask), for sliding windows (its window BlockMask skips the blocks before the
    window; SDPA would lose its causal kernel to an explicit mask: 1.135x the full model's step
    on an H200, docs/gpu.md) and for a sink normaliser (its LSE rescale; SDPA's extra key and
    head dims cost 2.0x at T = 8192 on an H100, flex's rescale 1.06x). CPU routes are unchanged.
    A CUDA training forward that resolves to ``math`` is refused before any compute when math's
    float32 (B, H, T, T) tensors would not fit in the device's free memory (``check_math_memory``)."""
    def serves(backend: str) -> bool:
        return BACKENDS[backend].refusal(request) is None

    backend = {**BACKENDS, **KERNELS}[auto(request) if name == "auto" else name]
    why = backend.refusal(request)
    if why and backend.strict and name != "auto":  # auto's pick is never an error
        raise ValueError(why)
    if why:
        backend = next(BACKENDS[n] for n in backend.fallback if serves(n))
    sink = NORMALISERS[request.normaliser].sink is not None
    if (name == "auto" and (request.documents or request.windows or sink) and request.cuda
            and backend.name != "flex" and serves("flex")):
        backend = BACKENDS["flex"]
    if request.queries == 1 and backend.decode is not None:
        backend = BACKENDS[backend.decode]
    if backend.grad_route is not None and serves(backend.grad_route):
        backend = BACKENDS[backend.grad_route]
    if (backend.name == "math" and request.grad and request.cuda and request.batch is not None
            and request.queries is not None and not torch.compiler.is_compiling()):  # a memory read breaks a graph
        check_math_memory(name, request)
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


def check_math_memory(name: str, request: AttentionRequest) -> None:
    """Refuse a CUDA training forward on ``math`` whose (B, H, T, T) tensors do not fit, with
    the estimate and the ways out (before any attention is computed)."""
    pe, device, dtype, dropout, batch, queries = (request.pe, request.device, request.dtype, request.dropout,
                                                  request.batch, request.queries)
    need = math_training_bytes(batch, pe.n_head, queries, queries, request.layers, dropout)
    free = free_device_bytes(device)
    if need <= free:
        return
    gib = 2 ** 30
    route = "model.attention=math" if name == "math" else f"model.attention={name} with pe={pe.name} resolves to math"
    scores = request.terms == "scores"  # only math adds them, in any dtype and with any dropout
    why = ("only math adds its terms of the attention scores" if name != "math" and scores else
           f"model.dropout={dropout} in {str(dtype).removeprefix('torch.')}: flex has no attention dropout and SDPA "
           f"needs a float32 mask in float32 compute" if name != "math" and dropout else "")
    ways = ["model.dropout=0 (pe's bias on flex)"
            if dropout and BACKENDS["flex"].refusal(replace(request, dropout=0.0, grad=True)) is None else None,
            "trainer.precision=32-true (SDPA with a float32 mask)" if dtype != torch.float32 and not scores else None,
            "another model.attention (sdpa, flex)" if name == "math" else None,
            "a smaller data.batch_size or model.block_size"]
    raise ValueError(
        f"{route}{' (' + why + ')' if why else ''}, which keeps float32 (B, H, T, T) attention tensors per layer: "
        f"about {need / gib:.1f} GiB for batch {batch} x {pe.n_head} heads x T={queries} x {request.layers} layers, "
        f"more than the {free / gib:.1f} GiB free on {device}. Ways out: {'; '.join(w for w in ways if w)}")


def attend(q: Tensor, k: Tensor, v: Tensor, ctx: Any, dropout: float = 0.0, sink: Tensor | None = None,
           layer_terms: tuple[Tensor, Tensor] | None = None, score_terms: Any = None) -> Tensor:
    """(B, H, Tq, hd) output of queries that are the last Tq of the Tk keys, with the context's
    backend, prepared state and normaliser (normalisers.py), in query chunks when the context has
    them (long evaluations: the (H, T, T) terms never exist at once); ``sink``: the layer's (H,)
    sink logits (a sink normaliser's); ``layer_terms``: a data-dependent scheme's (B, H, Tq) and
    (B, H, Tk) c, whose c_i - c_j the backend adds to this layer's mask
    (``AttentionBackend.add_layer_terms``); ``score_terms``: a score-dependent scheme's f(q,
    scores, visible keys) of this layer, which the backend adds to its logits."""
    backend, Tq, Tk = ctx.backend, q.shape[2], k.shape[2]
    normaliser = NORMALISERS[ctx.terms.normaliser]
    if (sink is None) != (normaliser.sink is None):  # a layer's sink logits and its normaliser come together
        raise ValueError(f"attention with normaliser {normaliser.name} got {'no ' if sink is None else ''}sink logits")
    extras = {} if score_terms is None else {"score_terms": score_terms}  # only math takes them (refusal)
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
            out = normaliser.attend(backend, q, k, v, state, dropout, sink, **extras)
        else:
            out = normaliser.attend(backend, q[:, :, s:e], k[:, :, ks:ke], v[:, :, ks:ke], state, dropout, sink,
                                    **extras)
        if backend.records:
            out, p = out
            if ctx.record is not None:
                ctx.record.add_chunk(F.pad(p, (ks if ctx.chunk is not None else 0, 0)), s, Tk)
        parts.append(out)
    if ctx.record is not None and backend.records:
        ctx.record.end_layer()
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


__all__ = ["BACKENDS", "CHOICES", "KERNELS", "NORMALISERS", "SINKS", "AttentionBackend", "AttentionRecorder",
           "AttentionRequest", "Terms", "attend", "auto", "check_math_memory", "math_training_bytes", "resolve"]
