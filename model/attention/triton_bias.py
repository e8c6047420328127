"""``triton_bias``: a fused Triton flash-attention kernel for a learned bias of the distance.

A bias of the distance alone (T5's buckets, KERPLE, FIRE while every query is below its
threshold L, ALiBi) is, for queries that are the last Tq of Tk consecutive keys, one value per
head and distance: b[h, d], d = (Tk - Tq + i) - j in 0..Tk-1. The scheme computes that
(H, Tk) vector in PyTorch from its parameters (its own ``bias`` on the last query row), so
autograd carries dL/db to its parameters through the scheme's own formula; the kernels only
read b and return dL/db:

    forward    flash attention (online softmax over key tiles), logits scale q.k + b[h, d],
               float32 scores and accumulators; the output and each row's log-sum-exp stored
    backward   P recomputed from the log-sum-exp; dV and dK per key tile (looping over query
               tiles), dQ per query tile (looping over key tiles), all in float32;
               dS = P (dP - rowsum(dO * O)) is the gradient of every logit, and
               dL/db[h, d] = sum of dS over the pairs (i, j) of head h at distance d.

The bias gradient is reduced per tile: a BLOCK x BLOCK tile of dS covers 2 BLOCK - 1
diagonals (distances); the dQ kernel gathers each diagonal into a column (``tl.gather``), sums
the columns, and adds the 2 BLOCK - 1 partial sums into b's gradient with one atomic add per
distance per tile, so neither an atomic per score nor an (H, Tq, Tk) table exists. The order of
those float32 additions varies between runs (as in other fused backwards).

A forward whose bias is not one vector of the distance (FIRE with a query at or past L,
per-sequence positions, positions that do not step by one) runs the route this backend
replaces: flex on CUDA (its table), bias_grad on CPU. A compiled graph cannot read positions on
the host: there 1-D positions must be a training window (the model's default 0..T-1; checked on
the device, ``torch._assert_async``) and FIRE takes that route.

Triton is imported on first use, by name (``importlib``), never at import: model/ runs with torch
and the standard library alone (the Hugging Face export ships it), and this backend refuses where
Triton is missing. On CPU it runs through Triton's interpreter (TRITON_INTERPRET=1), slowly: the
tests use it. Forward and backward are ``torch.library`` custom ops, opaque to torch.compile.
"""

from __future__ import annotations

import builtins
import functools
import importlib
import importlib.util
import os
import types
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from model.attention.base import AttentionBackend, Terms
from model.attention.bias_grad import BiasGrad
from model.attention.features import default_scale
from model.attention.flex import Flex
from model.attention.request import AttentionRequest

# query and key rows per tile on a GPU; the interpreter takes smaller tiles (fewer numpy elements,
# and a test's short sequence still spans several tiles)
BLOCK = 64
INTERPRETER_BLOCK = 16
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TRITON = importlib.util.find_spec("triton") is not None  # installed (imported only when a kernel first runs)

tl: Any = None  # triton.language: bound in the namespace ``kernels()`` gives the kernels' copies


# ---------------------------------------------------------------------------------------------
# kernels (plain functions here; ``kernels()`` hands them to triton.jit). They call only Triton's
# builtins, not its jitted library functions (tl.zeros, tl.sum, tl.max): those are decided at
# Triton's import, compiled or interpreted, and would fail in the interpreter when Triton was
# imported before TRITON_INTERPRET was set; reductions take the helpers _add and _max.
# ---------------------------------------------------------------------------------------------


def _add(a, b):
    return a + b


def _max(a, b):
    return tl.maximum(a, b)


def _dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with a float32 accumulator. UPCAST (the interpreter with bf16 or fp16 operands): the
    operands widened to float32 first, exactly (Triton's interpreter multiplies bf16 as its raw bits)."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


def _logits(q, k, bias_ptr, rows, cols, off, Tq, Tk, scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """float32 logits scale q k^T + b[h, d] of a tile, -inf where hidden (later keys, padding)."""
    dist = off + rows[:, None] - cols[None, :]
    visible = (dist >= 0) & (rows[:, None] < Tq) & (cols[None, :] < Tk)
    bias = tl.load(bias_ptr + dist, mask=visible, other=0.0)
    s = _dot(q, tl.trans(k), PRECISION, UPCAST) * scale + bias
    return tl.where(visible, s, float("-inf")), visible


def _forward(Q, K, V, Bias, Out, Lse, sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, so_b, so_h, so_t,
             H, Tq, Tk, NB, off, scale, BLOCK: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, dims, cols0 = m * BLOCK + tl.arange(0, BLOCK), tl.arange(0, D), tl.arange(0, BLOCK)
    q = tl.load(Q + b * sq_b + h * sq_h + rows[:, None] * sq_t + dims[None, :], mask=rows[:, None] < Tq, other=0.0)
    top = tl.full([BLOCK], float("-inf"), tl.float32)
    total = tl.full([BLOCK], 0.0, tl.float32)
    acc = tl.full([BLOCK, D], 0.0, tl.float32)
    end = tl.minimum(Tk, off + (m + 1) * BLOCK)  # the block's last row sees keys [0, end)
    for start in range(0, end, BLOCK):
        cols = start + cols0
        k = tl.load(K + b * sk_b + h * sk_h + cols[:, None] * sk_t + dims[None, :], mask=cols[:, None] < Tk,
                    other=0.0)
        v = tl.load(V + b * sv_b + h * sv_h + cols[:, None] * sv_t + dims[None, :], mask=cols[:, None] < Tk,
                    other=0.0)
        s, _ = _logits(q, k, Bias + h * NB, rows, cols, off, Tq, Tk, scale, PRECISION, UPCAST)
        new_top = tl.where(rows < Tq, tl.maximum(top, tl.reduce(s, 1, _max)), 0.0)  # finite: every row sees key 0
        p = tl.exp(s - new_top[:, None])
        shrink = tl.exp(top - new_top)
        total = total * shrink + tl.reduce(p, 1, _add)
        acc = acc * shrink[:, None] + _dot(p.to(v.dtype), v, PRECISION, UPCAST)
        top = new_top
    total = tl.where(rows < Tq, total, 1.0)  # padding rows saw no key: kept finite, never stored
    tl.store(Out + b * so_b + h * so_h + rows[:, None] * so_t + dims[None, :],
             (acc / total[:, None]).to(Out.dtype.element_ty), mask=rows[:, None] < Tq)
    tl.store(Lse + bh * Tq + rows, top + tl.log(total), mask=rows < Tq)


def _backward_kv(Q, K, V, Bias, dO, Lse, Delta, dK, dV, s_b, s_h, s_t, sk_b, sk_h, sk_t, H, Tq, Tk, NB, off, scale,
                 BLOCK: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dK, dV of one key tile; q and dO share strides (s_*), k, v, dK and dV theirs (sk_*)."""
    n, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    cols, dims, rows0 = n * BLOCK + tl.arange(0, BLOCK), tl.arange(0, D), tl.arange(0, BLOCK)
    kv = b * sk_b + h * sk_h + cols[:, None] * sk_t + dims[None, :]
    k = tl.load(K + kv, mask=cols[:, None] < Tk, other=0.0)
    v = tl.load(V + kv, mask=cols[:, None] < Tk, other=0.0)
    dk = tl.full([BLOCK, D], 0.0, tl.float32)
    dv = tl.full([BLOCK, D], 0.0, tl.float32)
    first = tl.maximum(n * BLOCK - off, 0) // BLOCK * BLOCK  # the first query tile that sees this key tile
    for start in range(first, Tq, BLOCK):
        rows = start + rows0
        at = b * s_b + h * s_h + rows[:, None] * s_t + dims[None, :]
        q = tl.load(Q + at, mask=rows[:, None] < Tq, other=0.0)
        do = tl.load(dO + at, mask=rows[:, None] < Tq, other=0.0)
        lse = tl.load(Lse + bh * Tq + rows, mask=rows < Tq, other=0.0)
        delta = tl.load(Delta + bh * Tq + rows, mask=rows < Tq, other=0.0)
        s, visible = _logits(q, k, Bias + h * NB, rows, cols, off, Tq, Tk, scale, PRECISION, UPCAST)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dv += _dot(tl.trans(p.to(do.dtype)), do, PRECISION, UPCAST)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = p * (dp - delta[:, None])
        dk += _dot(tl.trans(ds.to(q.dtype)), q, PRECISION, UPCAST)
    tl.store(dK + kv, (dk * scale).to(dK.dtype.element_ty), mask=cols[:, None] < Tk)  # dK, dV: k's strides
    tl.store(dV + kv, dv.to(dV.dtype.element_ty), mask=cols[:, None] < Tk)


def _backward_q(Q, K, V, Bias, dO, Lse, Delta, dQ, dBias, s_b, s_h, s_t, sk_b, sk_h, sk_t, H, Tq, Tk, NB, off,
                scale, BLOCK: tl.constexpr, D: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """dQ of one query tile, and the tile's partial sums of dL/db per distance."""
    m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    rows, dims, cols0 = m * BLOCK + tl.arange(0, BLOCK), tl.arange(0, D), tl.arange(0, BLOCK)
    at = b * s_b + h * s_h + rows[:, None] * s_t + dims[None, :]
    q = tl.load(Q + at, mask=rows[:, None] < Tq, other=0.0)
    do = tl.load(dO + at, mask=rows[:, None] < Tq, other=0.0)
    lse = tl.load(Lse + bh * Tq + rows, mask=rows < Tq, other=0.0)
    delta = tl.load(Delta + bh * Tq + rows, mask=rows < Tq, other=0.0)
    dq = tl.full([BLOCK, D], 0.0, tl.float32)
    # diagonal t of a tile holds the pairs with i - j = t - (BLOCK - 1): column j = i + BLOCK - 1 - t of row i
    diagonals = tl.arange(0, 2 * BLOCK)
    column = cols0[:, None] + (BLOCK - 1) - diagonals[None, :]
    on_tile = (column >= 0) & (column < BLOCK)
    column = tl.where(on_tile, column, 0)
    end = tl.minimum(Tk, off + (m + 1) * BLOCK)
    for start in range(0, end, BLOCK):
        cols = start + cols0
        kv = b * sk_b + h * sk_h + cols[:, None] * sk_t + dims[None, :]
        k = tl.load(K + kv, mask=cols[:, None] < Tk, other=0.0)
        v = tl.load(V + kv, mask=cols[:, None] < Tk, other=0.0)
        s, visible = _logits(q, k, Bias + h * NB, rows, cols, off, Tq, Tk, scale, PRECISION, UPCAST)
        p = tl.where(visible, tl.exp(s - lse[:, None]), 0.0)
        dp = _dot(do, tl.trans(v), PRECISION, UPCAST)
        ds = tl.where(visible, p * (dp - delta[:, None]), 0.0)
        dq += _dot(ds.to(k.dtype), k, PRECISION, UPCAST)
        partial = tl.reduce(tl.where(on_tile, tl.gather(ds, column, axis=1), 0.0), 0, _add)  # (2 BLOCK,) per diagonal
        distance = off + m * BLOCK - start + diagonals - (BLOCK - 1)
        tl.atomic_add(dBias + h * NB + distance, partial,
                      mask=(diagonals < 2 * BLOCK - 1) & (distance >= 0) & (distance < NB))
    tl.store(dQ + at, (dq * scale).to(dQ.dtype.element_ty), mask=rows[:, None] < Tq)


@functools.lru_cache(maxsize=None)
def kernels(interpret: bool) -> tuple[Any, Any, Any]:
    """The jitted (forward, dK/dV, dQ/db) kernels, compiled or, with ``interpret`` (TRITON_INTERPRET=1,
    which triton.jit reads as it wraps), interpreted: Triton imported by name on first use, the
    functions above copied into a namespace of their own per mode, where they find each other."""
    triton = importlib.import_module("triton")
    namespace = {"__builtins__": builtins, "__name__": __name__, "tl": importlib.import_module("triton.language")}
    for name in ("_add", "_max", "_dot", "_logits", "_forward", "_backward_kv", "_backward_q"):
        namespace[name] = triton.jit(types.FunctionType(globals()[name].__code__, namespace, name))
    return namespace["_forward"], namespace["_backward_kv"], namespace["_backward_q"]


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def launch_shape(q: Tensor, k: Tensor) -> tuple[int, int, int, int, int, int]:
    B, H, Tq, D = q.shape
    block = BLOCK if q.is_cuda else INTERPRETER_BLOCK
    return B, H, Tq, k.shape[2], D, block


def upcast(q: Tensor) -> bool:
    return interpreted() and q.dtype != torch.float32


def precision(q: Tensor) -> str | None:
    """float32 inputs multiply in full float32 (no TF32), as the other backends' float32 compute;
    bf16 and fp16 ones at Triton's default (their products are exact in the float32 accumulator)."""
    return "ieee" if q.dtype == torch.float32 else None


# ---------------------------------------------------------------------------------------------
# the custom ops and their autograd
# ---------------------------------------------------------------------------------------------


@torch.library.custom_op("pelab::triton_bias_attention", mutates_args=())
def _attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    forward, _, _ = kernels(interpreted())
    B, H, Tq, Tk, D, block = launch_shape(q, k)
    out = torch.empty(B, H, Tq, D, dtype=v.dtype, device=q.device)
    lse = torch.empty(B, H, Tq, dtype=torch.float32, device=q.device)
    forward[(triton_cdiv(Tq, block), B * H)](
        q, k, v, bias, out, lse, *q.stride()[:3], *k.stride()[:3], *v.stride()[:3], *out.stride()[:3],
        H, Tq, Tk, bias.shape[-1], Tk - Tq, scale, BLOCK=block, D=D, PRECISION=precision(q),
        UPCAST=upcast(q))
    return out, lse


@_attention.register_fake
def _(q, k, v, bias, scale):
    B, H, Tq, D = q.shape
    return q.new_empty(B, H, Tq, D, dtype=v.dtype), q.new_empty(B, H, Tq, dtype=torch.float32)


@torch.library.custom_op("pelab::triton_bias_attention_backward", mutates_args=())
def _attention_backward(d_out: Tensor, q: Tensor, k: Tensor, v: Tensor, bias: Tensor, out: Tensor, lse: Tensor,
                        scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _, backward_kv, backward_q = kernels(interpreted())
    B, H, Tq, Tk, D, block = launch_shape(q, k)
    q, d_out = q.contiguous(), d_out.to(v.dtype).contiguous()  # one set of strides for q, dO and dQ
    k, v = k.contiguous(), v.contiguous()
    delta = (d_out.float() * out.float()).sum(-1)  # rowsum(dO * O): each row's sum of P * dP
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    d_bias = torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
    common = (*q.stride()[:3], *k.stride()[:3], H, Tq, Tk, bias.shape[-1], Tk - Tq, scale)
    options = dict(BLOCK=block, D=D, PRECISION=precision(q),
        UPCAST=upcast(q))
    backward_kv[(triton_cdiv(Tk, block), B * H)](q, k, v, bias, d_out, lse, delta, dk, dv, *common, **options)
    backward_q[(triton_cdiv(Tq, block), B * H)](q, k, v, bias, d_out, lse, delta, dq, d_bias, *common, **options)
    return dq, dk, dv, d_bias


@_attention_backward.register_fake
def _(d_out, q, k, v, bias, out, lse, scale):
    # contiguous, as the kernels write them (whatever the strides of the views q, k, v came as)
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape),
            bias.new_empty(bias.shape, dtype=torch.float32))


def triton_cdiv(n: int, block: int) -> int:
    return -(-n // block)


def _setup_context(ctx, inputs, output):
    q, k, v, bias, scale = inputs
    ctx.save_for_backward(q, k, v, bias, *output)
    ctx.scale = scale


def _grad(ctx, d_out, d_lse):
    q, k, v, bias, out, lse = ctx.saved_tensors
    dq, dk, dv, d_bias = _attention_backward(d_out, q, k, v, bias, out, lse, ctx.scale)
    return dq, dk, dv, d_bias, None


_attention.register_autograd(_grad, setup_context=_setup_context)


def attention_with_distance_bias(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float | None = None) -> Tensor:
    """softmax(scale q k^T + b[h, d]) v over visible keys for (B, H, Tq, D) q and (B, H, Tk, D) k,
    v whose queries are the last Tq of the Tk keys (query i sees keys j <= Tk - Tq + i at distance
    d = Tk - Tq + i - j), with an (H, Tk) float32 bias vector b; gradients for q, k, v and b."""
    scale = default_scale(q) if scale is None else scale
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))  # the kernels step rows, not dims
    return _attention(q, k, v, bias.float().contiguous(), scale)[0]


# ---------------------------------------------------------------------------------------------
# the backend
# ---------------------------------------------------------------------------------------------


def of_distance(pe: Any) -> bool:
    """Whether the scheme's bias can be one value per head and distance: always
    (``bias_of_distance``), or at some query positions (``bias_of_distance_at``: FIRE below L)."""
    return pe.uses_bias and (pe.bias_of_distance or hasattr(pe, "bias_of_distance_at"))


def distance_vector(terms: Terms) -> Tensor | None:
    """The (H, Tk) float32 bias b[h, d] at distances d = 0..Tk-1 of these terms, under autograd to
    the scheme's parameters (its own ``bias`` on the last query row, reversed), or None where the
    bias is not one vector of the distance (per-sequence positions or documents, positions that do
    not step by one, FIRE at or past L)."""
    pe, q, k = terms.pe, terms.q_positions, terms.k_positions
    if q.dim() != 1 or k.dim() != 1 or terms.documents or terms.window is not None:
        return None
    compiling = torch.compiler.is_compiling()
    window = (k.diff() == 1).all() & (q == k[k.shape[0] - q.shape[0]:]).all()  # the queries the last of the keys
    if compiling:  # no host read: checked on the device, an error rather than a wrong bias
        torch._assert_async(window, "model.attention=triton_bias in a compiled graph takes 1-D positions as a "
                                    "training window (consecutive keys, the queries the last of them); use "
                                    "model.attention=auto for others")
    elif not bool(window):
        return None
    if not pe.bias_of_distance and (compiling or not pe.bias_of_distance_at(q)):
        return None
    return pe.bias(q[-1:], k)[:, 0].flip(-1).float()


@dataclass
class Delegated:
    """A forward this kernel cannot serve, prepared for the route it replaces."""

    backend: AttentionBackend
    state: Any


class TritonBias(AttentionBackend):
    name = "triton_bias"
    # auto takes it on CUDA only once a GPU run has compiled and timed it (docs/gpu.md); until then
    # it runs where it is named (model.attention=triton_bias) and auto keeps today's routes
    in_auto = False
    dropout = False
    strict = True  # named, what it cannot serve is an error naming the way out
    decode = "math"  # one decoded token: nothing to tile
    fallback = ("flex", "math")
    # the routes a forward whose bias is not one vector of the distance takes (own instances: the
    # registry imports this module)
    _delegates = {"cuda": Flex(), "cpu": BiasGrad()}

    def refusal(self, request: AttentionRequest) -> str | None:
        pe, device = request.pe, request.device
        if not of_distance(pe):
            return (f"model.attention={self.name} serves a bias of the distance (t5, kerple_log, kerple_power, fire, "
                    f"alibi); pe={pe.name} has none: use model.attention=auto")
        if request.documents or request.windows:
            what = "packed documents" if request.documents else "sliding windows (model.window, model.window_pattern)"
            return f"model.attention={self.name} has no {what}; use model.attention=auto (flex's block masks)"
        if request.dtype not in DTYPES:
            return (f"model.attention={self.name} computes in float32, bf16 or fp16, not "
                    f"{str(request.dtype).removeprefix('torch.')}; use model.attention=math or sdpa")
        hd = pe.head_dim
        if not 16 <= hd <= 256 or hd & (hd - 1):
            return (f"model.attention={self.name} tiles head_dim = model.n_embd / model.n_head = {hd}: it needs a "
                    f"power of two from 16 to 256; use model.attention=auto")
        if not TRITON:
            return f"model.attention={self.name} needs Triton (pip install triton); use model.attention=auto"
        if device.type == "cuda" and not torch.cuda.is_available():
            return f"model.attention={self.name}: no CUDA device for Triton to compile for; use model.attention=auto"
        if device.type == "cpu" and not interpreted():
            return (f"model.attention={self.name} on cpu runs only through Triton's interpreter: set "
                    f"TRITON_INTERPRET=1 (slow: tests), or use model.attention=auto")
        if device.type not in ("cuda", "cpu"):
            return f"model.attention={self.name} runs on cuda (or cpu through Triton's interpreter), not {device.type}"
        return super().refusal(request)

    def prepare(self, terms: Terms, chunked: bool = False) -> Tensor | Delegated:
        values = distance_vector(terms) if terms.with_bias else None
        if values is not None:
            return values
        delegate = self._delegates["cuda" if terms.q_positions.is_cuda else "cpu"]
        return Delegated(delegate, delegate.prepare(terms, chunked))

    def chunk(self, state: Any, terms: Terms, s: int, e: int) -> Any:
        if isinstance(state, Delegated):
            return Delegated(state.backend, state.backend.chunk(state.state, terms, s, e))
        return self.prepare(terms.rows(s, e))

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, state: Any, dropout: float) -> Tensor:
        if isinstance(state, Delegated):
            return state.backend(q, k, v, state.state, dropout)
        if q.shape[-1] != v.shape[-1] or q.shape[1] != state.shape[0] or state.shape[-1] != k.shape[2]:
            raise ValueError(f"model.attention={self.name} takes q, k, v of one head_dim and {state.shape[0]} heads "
                             f"against a bias of {state.shape[-1]} distances; got q {tuple(q.shape)}, k "
                             f"{tuple(k.shape)}, v {tuple(v.shape)}: use model.attention=auto")
        with torch.autocast(v.device.type, enabled=False):
            return attention_with_distance_bias(q.to(v.dtype), k.to(v.dtype), v, state, default_scale(q))
