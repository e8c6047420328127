"""Chunked LM head + cross-entropy for large vocabularies.

``chunked_cross_entropy(hidden, weight, targets, vocab_size)`` returns the same mean
cross-entropy as ``F.cross_entropy(F.linear(hidden, weight)[:, :vocab_size].float(),
targets, ignore_index=-1)``, with the same gradients w.r.t. ``hidden`` and ``weight``, but
never holds the full (N, V) logits: rows are processed ``chunk_size`` at a time, and only one
chunk's (chunk_size, V) logits exist at once.

How it works (the "gradients in forward" trick, as in Liger-Kernel's fused linear
cross-entropy and Apple's Cut Cross-Entropy): the forward of the autograd Function, for every
chunk of rows,

1. computes the chunk's logits ``h_c @ W[:vocab_size].T`` in the compute dtype (the autocast
   dtype under ``torch.autocast``, else the inputs' dtype),
2. converts them to float32 into a reused buffer, takes the softmax there in place (one fused
   kernel), and adds the chunk's share of the loss, -log softmax[target] (from logsumexp of
   the row's logits instead when softmax[target] < 2**-100, so a hopeless target stays exact),
3. forms d loss / d logits = (softmax - one_hot(target)) / n_valid in float32 (zero for
   ignored rows) and casts it to the compute dtype (exactly what autograd does for the
   full-logits reference) -- except under fp16, where it stays float32: these values are
   formed before the loss scale of mixed precision applies, and fp16 would flush them to 0,
4. stores d loss / d h_c = g_c @ W and accumulates d loss / d W += g_c.T @ h_c (float32
   accumulator).

The backward then only multiplies the stored gradients by ``grad_output``. Padded vocabulary
rows (``weight.shape[0] > vocab_size``, see ``GPTConfig.padded_vocab_size``) are never part
of the softmax and get zero gradient from the loss; with a tied embedding the embedding's own
gradient still accumulates into the same Parameter through autograd as usual.

The mean is over targets != ``ignore_index``. When every target is ignored the loss is 0 (not
NaN, as ``F.cross_entropy`` would give) and every gradient is zero.

Use from ``GPT`` (model/gpt.py) for the training loss::

    from model.loss import chunked_cross_entropy, use_chunked_loss

    h = self.hidden(idx, positions)                         # (B, T, C)
    if targets is not None and use_chunked_loss(self.config.vocab_size, h):   # loss_route's choice
        loss = chunked_cross_entropy(h, self.lm_head.weight, targets,
                                     vocab_size=self.config.vocab_size)   # ignore_index=-1
        # no (B, T, V) logits exist; return None (or compute self.logits(h) lazily if needed)

``hidden`` may be (N, C) or (..., C) with ``targets`` of the matching leading shape; it is
flattened. Pass the Parameter itself (``self.lm_head.weight``, shape (padded_vocab, C)), not
a slice, so the gradient lands on the tied weight directly. Works with and without
``torch.autocast`` (bf16 matmuls, float32 softmax statistics). Double backward is not
supported (the gradients are computed in forward).

Routes (``loss_route``, the one place that chooses; ``PELAB_LM_LOSS`` or
``forced_loss_route`` override it): on CPU the chunk loop above from the vocabulary
``CHUNKED_LOSS_MIN_VOCAB`` on (``chunked``), full logits below it. On an accelerator the
chunked loop as written would stop the host 2 + N / chunk_size times per step (``int``/``bool``
of device tensors) and run as an opaque op that torch.compile cannot fuse, so there full
logits + ``F.cross_entropy`` in float32 (``full``, what compile fuses and the reference loop
runs) is taken while the logits fit ``FULL_LOGITS_MAX_ELEMENTS``, and above it
``chunked_nosync``: the same loop with no host synchronisation (each row's loss from
logsumexp, n_valid kept on the device, the target range checked by ``torch._assert_async``).
CPU numbers do not change: the CPU route is the loop as it was.

Peak memory and time against full logits, per chunk size: docs/performance.md, section 1.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

#: Vocabulary size from which the chunked loss is worth it. Below it the (N, V) logits are
#: small (the byte vocabulary: 256 -> 1 MB of fp32 logits for 4096 tokens) and the plain
#: ``F.cross_entropy`` path is as fast; from 8192 on the fp32 logits of a 16x256 batch reach
#: 128 MB and grow to 824 MB at the gpt2 vocabulary.
CHUNKED_LOSS_MIN_VOCAB = 8192

#: Rows per chunk: the fastest measured size, or within noise of it (docs/performance.md), with
#: chunk buffers of rows * V * 6 bytes (bf16 logits + fp32 softmax: 309 MB at V=50257).
DEFAULT_CHUNK_SIZE = 1024


#: Above this many (rows x vocabulary) logits an accelerator's loss is chunked: full float32
#: logits of 2**30 elements are 4 GiB (gpt2's vocabulary at B=16, T=1024 is 16384 x 50257 =
#: 0.82 * 2**30: full logits).
FULL_LOGITS_MAX_ELEMENTS = 1 << 30

#: The ways to compute the LM-head loss (``loss_route``):
#: ``full``: full (N, V) logits + ``F.cross_entropy`` in float32 (GPT.forward's own lines; the
#: reference loop's formula, which torch.compile fuses);
#: ``chunked``: the chunk loop below tuned for CPU (it reads ``n_valid`` and one flag per chunk
#: on the host: 2 + N / chunk_size host synchronisations on an accelerator);
#: ``chunked_nosync``: the same chunk loop with no host synchronisation (the loss from
#: logsumexp for every row, counts kept on the device, an asynchronous target-range check).
LOSS_ROUTES = ("full", "chunked", "chunked_nosync")

#: Environment variable that forces a route for every call (``auto`` or unset: ``loss_route``
#: decides), e.g. ``PELAB_LM_LOSS=chunked`` to time the CPU-tuned loop on a GPU.
LOSS_ROUTE_ENV = "PELAB_LM_LOSS"


def parse_loss_route(value: str | None, source: str) -> str | None:
    """A route name from ``source`` (the variable or argument named in the error), None for
    ``auto`` / unset; anything else is rejected, naming the allowed values."""
    if value is None or value == "auto":
        return None
    if value not in LOSS_ROUTES:
        raise ValueError(f"{source}={value!r}: expected auto or one of {', '.join(LOSS_ROUTES)}")
    return value


_forced_route: str | None = parse_loss_route(os.environ.get(LOSS_ROUTE_ENV), LOSS_ROUTE_ENV)


@contextlib.contextmanager
def forced_loss_route(route: str | None):
    """Within the block every LM-head loss takes ``route`` (one of ``LOSS_ROUTES``; None or
    ``auto``: ``loss_route`` decides), e.g. to run the accelerator's route on CPU tensors."""
    global _forced_route
    before, _forced_route = _forced_route, parse_loss_route(route, "forced_loss_route(route)")
    try:
        yield
    finally:
        _forced_route = before


def loss_route(vocab_size: int, hidden: Tensor | None = None, chunked: bool = False) -> str:
    """The one place that chooses how the LM-head loss is computed (one of ``LOSS_ROUTES``).

    On CPU (or with no ``hidden``): ``full`` below ``CHUNKED_LOSS_MIN_VOCAB`` (8192), else
    ``chunked``. On an accelerator: ``full`` below that vocabulary or while the
    (rows, vocab_size) logits fit ``FULL_LOGITS_MAX_ELEMENTS``, else ``chunked_nosync``.
    ``chunked=True`` asks which chunk loop (a direct call of ``chunked_cross_entropy``): the
    device's one. ``PELAB_LM_LOSS`` / ``forced_loss_route`` override all of it (a forced
    ``full`` leaves direct chunked calls to the device's loop).
    """
    if _forced_route is not None and not (chunked and _forced_route == "full"):
        return _forced_route
    on_cpu = hidden is None or hidden.device.type == "cpu"
    if not chunked:
        if vocab_size < CHUNKED_LOSS_MIN_VOCAB:
            return "full"
        if not on_cpu and (hidden.numel() // hidden.shape[-1]) * vocab_size <= FULL_LOGITS_MAX_ELEMENTS:
            return "full"
    return "chunked" if on_cpu else "chunked_nosync"


def use_chunked_loss(vocab_size: int, hidden: Tensor | None = None) -> bool:
    """True when ``loss_route`` picks a chunked route for these final hidden states (no
    ``hidden``: CPU's choice, ``vocab_size >= CHUNKED_LOSS_MIN_VOCAB``), so that
    ``chunked_cross_entropy`` should replace full logits + ``F.cross_entropy``."""
    return loss_route(vocab_size, hidden) != "full"


def _compute_dtype(hidden: Tensor, weight: Tensor) -> torch.dtype:
    device_type = hidden.device.type
    if torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return torch.promote_types(hidden.dtype, weight.dtype)


#: Below this softmax probability of the target, its -log is taken from logsumexp instead
#: (float32 subnormals start at 1.2e-38; 2**-100 keeps a wide margin).
_TINY = 2.0 ** -100


def _softmax_(x: Tensor) -> Tensor:
    """Row softmax of a 2-D float32 tensor in place: the fused kernel writes each element
    after reading it, so input and output may alias (faster on CPU than max, sub, exp, sum
    as separate passes, and no second (rows, V) buffer)."""
    return torch.ops.aten._softmax.out(x, 1, False, out=x)


#: Elements per block when adding a compute-dtype weight gradient into the float32 one.
_ADD_BLOCK = 1 << 22


def _add_converted_(acc: Tensor, part: Tensor, buf: Tensor) -> None:
    """acc += part for a float32 ``acc`` and a lower-precision ``part`` of the same 2-D shape,
    through a small float32 ``buf`` of whole rows: a mixed-dtype ``add_`` takes a slow
    slow per-element path on CPU (converting with ``copy_`` and adding in fp32 is faster),
    and a cache-sized buffer avoids a second (V, C) float32 tensor."""
    rows = buf.shape[0]
    for s in range(0, acc.shape[0], rows):
        e = min(s + rows, acc.shape[0])
        acc[s:e].add_(buf[: e - s].copy_(part[s:e]))


def _accumulate_chunks(hidden: Tensor, w: Tensor, targets: Tensor, row_scale: Tensor, chunk_size: int,
                       dtype: torch.dtype, loss: Tensor, grad_h: Tensor | None, grad_w: Tensor | None,
                       sync_free: bool = False) -> None:
    """The chunk loop: adds the loss into ``loss`` (0-dim float32) and writes d loss / d hidden
    into ``grad_h`` (N, C) and adds d loss / d w into ``grad_w`` (V, C, float32), each when not
    None. ``w`` is the (V, C) weight in the compute ``dtype``; ``row_scale`` (N,) float32 is
    1/n_valid for scored rows and 0 for ignored ones (whose targets are any valid id).

    Every (chunk, V) buffer is allocated once and reused: on CPU a fresh allocation of this
    size is a fresh mmap, and its page faults cost more than the arithmetic on it.

    ``sync_free`` (the ``chunked_nosync`` route): every row's loss is logsumexp - target logit
    (no per-chunk host check for an underflowing softmax[target]) and the weight gradient is
    added into the float32 one by one mixed-dtype ``add_`` (one kernel on an accelerator).
    """
    N = hidden.shape[0]
    V, C = w.shape
    rows = min(chunk_size, N)
    device = hidden.device
    logits_buf = torch.empty((rows, V), dtype=dtype, device=device)  # logits, then d loss / d logits
    # float32 work buffer for the softmax statistics (the logits buffer itself when dtype is fp32)
    work_buf = logits_buf if dtype == torch.float32 else torch.empty((rows, V), dtype=torch.float32, device=device)
    need_grad = grad_h is not None or grad_w is not None
    # fp16 cannot hold d loss / d logits = p / n_valid (it flushes to zero below 6e-8, before any
    # loss scale applies): under fp16 the gradient matmuls run in float32
    gdt = torch.float32 if dtype == torch.float16 else dtype
    w_g = w if gdt == dtype else w.float()
    gh_buf = torch.empty((rows, C), dtype=gdt, device=device) if grad_h is not None and grad_h.dtype != gdt else None
    gw_buf = torch.empty((V, C), dtype=gdt, device=device) if grad_w is not None and grad_w.dtype != gdt else None
    add_rows = min(V, max(1, _ADD_BLOCK // C))
    add_buf = (torch.empty((add_rows, C), dtype=grad_w.dtype, device=device)
               if gw_buf is not None and not sync_free else None)
    for s in range(0, N, chunk_size):
        e = min(s + chunk_size, N)
        n = e - s
        h_c = hidden[s:e].to(dtype)
        t_c = targets[s:e].unsqueeze(1)
        scale_c = row_scale[s:e].unsqueeze(1)
        logits = torch.mm(h_c, w.t(), out=logits_buf[:n])
        x = work_buf[:n]
        if x is not logits:
            x.copy_(logits)  # compute dtype -> float32, exact
        target_logit = x.gather(1, t_c)
        if sync_free:
            nll = torch.logsumexp(x, 1, keepdim=True).sub_(target_logit)
            _softmax_(x)
        else:
            _softmax_(x)  # x = softmax(logits) in float32, in place (one fused pass)
            p_target = x.gather(1, t_c)
            nll = p_target.log().neg_()
            tiny = ((p_target < _TINY) & (scale_c > 0)).squeeze(1)
            if bool(tiny.any()):  # -log p would lose precision or be inf: logsumexp of these rows' logits
                again = torch.mm(h_c[tiny], w.t()).float()  # (the buffer now holds the softmax)
                nll[tiny] = torch.logsumexp(again, dim=1, keepdim=True) - target_logit[tiny]
        loss += (nll.masked_fill_(scale_c == 0, 0.0) * scale_c).sum()  # ignored rows may have p = 0
        if not need_grad:
            continue
        # d loss / d logits = (softmax - one_hot) * scale, formed in float32 and rounded once to
        # the compute dtype (as autograd does for the full-logits reference)
        x.scatter_add_(1, t_c, torch.full_like(target_logit, -1.0))
        x.mul_(scale_c)
        g = logits if gdt == dtype else x
        if g is not x:
            g.copy_(x)
        h_g = h_c if gdt == dtype else h_c.float()
        if grad_h is not None:
            if gh_buf is None:
                torch.mm(g, w_g, out=grad_h[s:e])
            else:
                grad_h[s:e].copy_(torch.mm(g, w_g, out=gh_buf[:n]))
        if grad_w is not None:
            if gw_buf is None:
                grad_w.addmm_(g.t(), h_g)
            elif sync_free:
                grad_w.add_(torch.mm(g.t(), h_g, out=gw_buf))
            else:
                _add_converted_(grad_w, torch.mm(g.t(), h_g, out=gw_buf), add_buf)


_no_autocast = contextlib.nullcontext()


def _loss_and_grads_impl(hidden: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, ignore_index: int,
                         chunk_size: int, compute_dtype: torch.dtype, need_h: bool, need_w: bool,
                         sync_free: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, d loss / d hidden, d loss / d weight); a gradient not asked for is an empty tensor.
    An opaque op: torch.compile calls it as it is (the CPU chunk loop reads sizes and flags on the
    host, which a traced graph cannot), so a compiled model keeps one graph. ``sync_free``: no
    host synchronisation (n_valid stays on the device, the target range is checked by
    ``torch._assert_async``, the loop always runs)."""
    device_type = hidden.device.type  # (the meta device has no autocast: shape checks run there)
    with torch.autocast(device_type, enabled=False) if torch.amp.is_autocast_available(device_type) else _no_autocast:
        w = weight[:vocab_size].to(compute_dtype)  # (V, C): padded rows never enter
        valid = targets != ignore_index
        safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
        range_msg = f"target out of range [0, {vocab_size}) (ignore_index {ignore_index})"
        if sync_free:
            torch._assert_async(((safe_targets >= 0) & (safe_targets < vocab_size)).all(), range_msg)
            n_valid = valid.sum()
            row_scale = valid.to(torch.float32) / n_valid.clamp_min(1)
        else:
            n_valid = int(valid.sum())
            if n_valid and bool(((safe_targets < 0) | (safe_targets >= vocab_size)).any()):
                raise IndexError(range_msg)
            # per-row gradient scale: 1/n_valid for scored rows, 0 for ignored ones
            row_scale = valid.to(torch.float32) / max(n_valid, 1)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_h = (torch.empty if sync_free or n_valid else torch.zeros)(
            hidden.shape if need_h else (0,), dtype=hidden.dtype, device=hidden.device)
        # float32 accumulator of the weight's full (padded) shape, so that autograd can hand it
        # to the Parameter without a copy; padded rows stay zero
        grad_w = torch.zeros(weight.shape if need_w else (0,), dtype=_grad_w_dtype(weight), device=weight.device)
        if sync_free or n_valid:  # (sync_free: an ignored row's gradient is 0 * its softmax)
            _accumulate_chunks(hidden, w, safe_targets, row_scale, chunk_size, compute_dtype,
                               loss, grad_h if need_h else None, grad_w[:vocab_size] if need_w else None, sync_free)
    return loss, grad_h, grad_w


_loss_and_grads = torch.library.custom_op("pelab::chunked_linear_cross_entropy", _loss_and_grads_impl,
                                          mutates_args=())


@_loss_and_grads.register_fake
def _(hidden, weight, targets, vocab_size, ignore_index, chunk_size, compute_dtype, need_h, need_w, sync_free=False):
    return (hidden.new_empty((), dtype=torch.float32), hidden.new_empty(hidden.shape if need_h else (0,)),
            weight.new_empty(weight.shape if need_w else (0,), dtype=_grad_w_dtype(weight)))


def _grad_w_dtype(weight: Tensor) -> torch.dtype:
    return torch.promote_types(weight.dtype, torch.float32)


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, vocab_size: int, ignore_index: int,
                chunk_size: int, compute_dtype: torch.dtype, grad_enabled: bool, sync_free: bool) -> Tensor:
        ctx.weight_dtype = weight.dtype
        # forward runs under no_grad; the caller's grad mode decides whether gradients are made
        need_h = ctx.needs_input_grad[0] and grad_enabled
        need_w = ctx.needs_input_grad[1] and grad_enabled
        loss, grad_h, grad_w = _loss_and_grads(hidden, weight, targets, vocab_size, ignore_index, chunk_size,
                                               compute_dtype, need_h, need_w, sync_free)
        ctx.needs = (need_h, need_w)
        ctx.sync_free = sync_free
        if torch.compiler.is_compiling():  # a traced graph keeps tensors for backward only this way
            ctx.save_for_backward(grad_h, grad_w)
        else:
            # kept as attributes (not save_for_backward) so that backward can drop the last
            # reference and autograd can steal the tensors instead of copying them
            ctx.grads = (grad_h, grad_w)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        if torch.compiler.is_compiling():
            grad_h, grad_w = ctx.saved_tensors
            one = False
        else:
            if not hasattr(ctx, "grads"):
                raise RuntimeError("chunked_cross_entropy: backward through the same loss twice is not supported "
                                   "(its gradients are computed in forward and handed over once)")
            grad_h, grad_w = ctx.grads
            del ctx.grads
            one = not ctx.sync_free and grad_output.device.type == "cpu" and bool(grad_output == 1)
        grad_h, grad_w = (g if need else None for g, need in zip((grad_h, grad_w), ctx.needs))
        if grad_h is not None and not one:
            grad_h = grad_h * grad_output.to(grad_h.dtype)
        if grad_w is not None and not one:
            grad_w = grad_w * grad_output.to(grad_w.dtype)
        if grad_w is not None and grad_w.dtype != ctx.weight_dtype:
            grad_w = grad_w.to(ctx.weight_dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None


def chunked_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, vocab_size: int | None = None,
                          ignore_index: int = -1, chunk_size: int = DEFAULT_CHUNK_SIZE,
                          sync_free: bool | None = None) -> Tensor:
    """Mean cross-entropy of ``hidden @ weight[:vocab_size].T`` against ``targets``, computed
    ``chunk_size`` rows at a time (forward and backward) without the full (N, V) logits.

    hidden: (..., C) final hidden states; weight: (V_padded, C) LM-head weight (may be tied to
    the embedding); targets: (...) int64 ids in [0, vocab_size) or ``ignore_index``;
    vocab_size: real vocabulary (default ``weight.shape[0]``), rows past it are padding and
    never win. Returns a float32 scalar: the mean over non-ignored targets, 0 if all are
    ignored. Matmuls run in the autocast dtype when autocast is on, log-softmax in float32.
    sync_free: run the chunk loop with no host synchronisation (None: as ``loss_route`` picks
    for ``hidden``'s device: False on CPU, True on an accelerator).
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    C = hidden.shape[-1]
    if weight.dim() != 2 or weight.shape[1] != C:
        raise ValueError(f"weight must be (V, {C}), got {tuple(weight.shape)}")
    vocab_size = weight.shape[0] if vocab_size is None else vocab_size
    if not 0 < vocab_size <= weight.shape[0]:
        raise ValueError(f"vocab_size {vocab_size} must be in (0, {weight.shape[0]}]")
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets shape {tuple(targets.shape)} must match hidden {tuple(hidden.shape[:-1])}")
    h = hidden.reshape(-1, C)
    t = targets.reshape(-1)
    if sync_free is None:
        sync_free = loss_route(vocab_size, hidden, chunked=True) == "chunked_nosync"
    return _ChunkedLinearCrossEntropy.apply(h, weight, t, vocab_size, ignore_index, chunk_size,
                                            _compute_dtype(hidden, weight), torch.is_grad_enabled(), sync_free)
