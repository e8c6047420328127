"""The LM-head loss's accelerator routes (model/loss.py ``loss_route``), imitated on CPU.

On CUDA the chunk loop tuned for CPU stops the host 2 + N / chunk_size times per step; the
accelerator routes (``full``: full logits + ``F.cross_entropy``; ``chunked_nosync``) must not
stop it at all. A dispatch mode counts the operators that read a device value on the host
(torch's own tags ``data_dependent_output`` / ``dynamic_output_shape``, ``bool()`` of a
tensor, boolean-mask writes) -- descending into the opaque custom op -- and the meta device,
where no kernel can read a value, runs the route at gpt2-124M shapes. The numbers are checked
against a float64 cross-entropy written out by hand.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import model.loss as loss_mod
from model.loss import (FULL_LOGITS_MAX_ELEMENTS, LOSS_ROUTE_ENV, chunked_cross_entropy, forced_loss_route,
                        loss_route, parse_loss_route, use_chunked_loss)
from tests.model.test_loss import gpt2_vocabulary_model, make

ATEN = torch.ops.aten
#: operators that hand a device value to the host (beyond the tagged ones): bool(t), equal
HOST_READS = {ATEN.is_nonzero.default, ATEN.equal.default}


def _syncs(func, args, kwargs) -> bool:
    tags = getattr(func, "tags", ())
    if torch.Tag.data_dependent_output in tags or torch.Tag.dynamic_output_shape in tags or func in HOST_READS:
        return True
    if func in (ATEN.index_put_.default, ATEN.index_put.default):  # x[bool_mask] = v runs nonzero inside
        return any(i is not None and i.dtype == torch.bool for i in args[1])
    return False


class HostSyncs(TorchDispatchMode):
    """Counts host-reading operators and all operators; runs pelab's custom op's Python body
    under the same mode (an opaque op's inner operators are otherwise not dispatched to it).
    ``Tensor.tolist`` / ``numpy`` read a CPU tensor's memory without an operator: counted by
    wrapping them while the mode is active."""

    UNDISPATCHED = ("tolist", "numpy")

    def __init__(self):
        super().__init__()
        self.syncs: list[str] = []
        self.ops: list[str] = []
        self._depth = 0  # (re-entered inside the custom op)
        self._saved: dict = {}

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._thread = threading.get_ident()
            self._saved = {name: torch.Tensor.__dict__.get(name) for name in self.UNDISPATCHED}
            for name in self.UNDISPATCHED:
                def counted(t, *a, _name=name, _method=getattr(torch.Tensor, name), **k):
                    if threading.get_ident() == self._thread:  # another thread's read is not this code's
                        self.syncs.append(f"Tensor.{_name}")
                    return _method(t, *a, **k)
                setattr(torch.Tensor, name, counted)
        return super().__enter__()

    def __exit__(self, *exc):
        out = super().__exit__(*exc)
        self._depth -= 1
        if self._depth == 0:
            for name, own in self._saved.items():  # (tolist, numpy are TensorBase's: no own attribute)
                setattr(torch.Tensor, name, own) if own is not None else delattr(torch.Tensor, name)
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.ops.append(str(func))
        if _syncs(func, args, kwargs):
            self.syncs.append(str(func))
        if func is torch.ops.pelab.chunked_linear_cross_entropy.default:
            with self:
                return loss_mod._loss_and_grads_impl(*args, **kwargs)
        return func(*args, **kwargs)


def naive64(h, w, t, V, round_to=None, grad_output=1.0):
    """Cross-entropy by hand in float64: loss = mean over scored rows of
    log(sum_j exp(z_j - m)) + m - z_target, z = h @ w[:V].T; 0 when no row is scored.
    ``round_to``: round h and w to that dtype first (what autocast's matmul sees)."""
    if round_to is not None:
        h, w = h.to(round_to), w.to(round_to)
    h = h.detach().double().requires_grad_()
    w = w.detach().double().requires_grad_()
    z = h @ w[:V].T
    m = z.max(dim=1, keepdim=True).values.detach()
    lse = ((z - m).exp().sum(dim=1, keepdim=True).log() + m).squeeze(1)
    scored = t >= 0
    z_t = z.gather(1, torch.where(scored, t, 0).unsqueeze(1)).squeeze(1)
    loss = torch.where(scored, lse - z_t, 0.0).sum() / max(int(scored.sum()), 1)
    (loss * grad_output).backward()
    return loss.detach(), h.grad, w.grad


def route_loss(route, h, w, t, V, autocast=None, grad_output=1.0, chunk_size=64):
    """Loss and gradients of ``route`` as GPT.forward runs it (``full``: its two lines)."""
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    amp = torch.autocast("cpu", dtype=autocast or torch.bfloat16, enabled=autocast is not None)
    with forced_loss_route(route), amp:
        assert loss_route(V, h) == route
        if use_chunked_loss(V, h):
            loss = chunked_cross_entropy(h, w, t, vocab_size=V, chunk_size=chunk_size)
        else:
            logits = torch.nn.functional.linear(h, w)[..., :V]
            loss = torch.nn.functional.cross_entropy(logits.float(), t, ignore_index=-1)
    (loss * grad_output).backward()
    return loss.detach(), h.grad, w.grad


# -- host synchronisations ---------------------------------------------------------------------


def test_counter_sees_what_syncs_on_cuda():
    """Each of these reads a device value on the host on CUDA (what set_sync_debug_mode reports);
    gather / where / masked_fill / sum do not."""
    x, mask = torch.arange(6.0), torch.tensor([True, False] * 3)
    syncing = [lambda: x.sum().item(), lambda: bool(x.any()), lambda: int(x[0]), lambda: x.tolist(),
               lambda: x.nonzero(), lambda: x[mask], lambda: x.clone().__setitem__(mask, 0.0),
               lambda: torch.equal(x, x), lambda: x.unique(), lambda: x.numpy()]
    for fn in syncing:
        with HostSyncs() as mode:
            fn()
        assert mode.syncs, fn
    with HostSyncs() as mode:
        x.gather(0, torch.tensor([1, 2])), torch.where(mask, x, 0.0), x.masked_fill(mask, 0.0), x.sum()
        torch._assert_async(x.sum() > 0)  # a device-side assert on CUDA
    assert mode.syncs == []


@pytest.mark.parametrize("autocast", [None, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("route", ["full", "chunked_nosync"])
def test_accelerator_routes_have_no_host_syncs(route, autocast):
    N, chunk = 300, 64  # 5 chunks, the last one short
    h, w, t = make(N, 16, 1000, 1024, ignore_every=3)
    with HostSyncs() as mode:
        route_loss(route, h, w, t, 1000, autocast=autocast, chunk_size=chunk)
    assert mode.syncs == []
    if route == "chunked_nosync":  # the mode saw the chunk loop: 3 matmuls per chunk
        assert sum(op.startswith("aten.mm") or op.startswith("aten.addmm") for op in mode.ops) == 3 * 5


def test_cpu_route_syncs_as_counted():
    """The counter on the CPU route (the loop as it was): int(n_valid), the target-range check,
    one bool per chunk, and backward's grad_output == 1 test -- 2 + 5 + 1 here; at gpt2-124M
    (16384 rows, chunk 1024) 2 + 16 = 18 per step on CUDA (no grad_output test there)."""
    h, w, t = make(300, 16, 1000, 1024, ignore_every=3)
    with HostSyncs() as mode:
        route_loss("chunked", h, w, t, 1000, chunk_size=64)
    assert len(mode.syncs) == 2 + 5 + 1, mode.syncs


def test_gpt2_124m_shapes_on_meta():
    """gpt2-124M, B=16, T=1024, bf16, on the meta device (no values exist, so any
    host read raises): an accelerator takes ``full`` there and ``chunked_nosync`` past
    FULL_LOGITS_MAX_ELEMENTS; the chunk loop runs its 16 chunks with no host read."""
    B, T, C, V, Vp = 16, 1024, 768, 50257, 50304
    hidden = torch.empty(B, T, C, device="meta")
    assert B * T * V <= FULL_LOGITS_MAX_ELEMENTS < 2 * B * T * V
    assert loss_route(V, hidden) == "full"
    assert loss_route(V, torch.empty(2 * B, T, C, device="meta")) == "chunked_nosync"
    assert loss_route(V, torch.empty(1, 1, C)) == "chunked"  # CPU: the loop as it was
    assert loss_route(V, hidden, chunked=True) == "chunked_nosync"  # a direct chunked call
    h = torch.empty(B, T, C, device="meta", dtype=torch.bfloat16, requires_grad=True)  # (no autocast on meta)
    w = torch.empty(Vp, C, device="meta", dtype=torch.bfloat16, requires_grad=True)
    t = torch.empty(B, T, dtype=torch.long, device="meta")
    with HostSyncs() as mode:
        loss = chunked_cross_entropy(h, w, t, vocab_size=V)  # the device's loop: no syncs
        loss.backward()
    assert mode.syncs == []
    assert h.grad.shape == h.shape and w.grad.shape == w.shape
    assert sum(op == "aten.logsumexp.default" for op in mode.ops) == B * T // loss_mod.DEFAULT_CHUNK_SIZE


# -- numbers against float64 -------------------------------------------------------------------


@pytest.mark.parametrize("route", ["full", "chunked_nosync"])
@pytest.mark.parametrize("chunk_size, ignore_every", [(1, 0), (10, 3), (37, 0), (64, 4)])
def test_fp32_equals_float64_cross_entropy(route, chunk_size, ignore_every):
    h, w, t = make(37, 16, 100, 128, ignore_every=ignore_every)
    got = route_loss(route, h, w, t, 100, chunk_size=chunk_size)
    for a, b in zip(got, naive64(h, w, t, 100)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert got[2][100:].abs().max() == 0  # padded vocabulary rows: no gradient


def test_nosync_hopeless_targets_padding_and_grad_output():
    """Logit gaps of hundreds of nats (softmax[target] underflows float32: the CPU loop needs
    its host-checked fallback, this one takes logsumexp for every row), padded rows with huge
    logits, and a grad_output other than 1."""
    h, w, t = make(45, 16, 100, 128, ignore_every=5, scale=30.0, seed=1)
    w[100:] = 1e4
    ref = naive64(h, w, t, 100, grad_output=-2.5)
    assert ref[0] > 150
    got = route_loss("chunked_nosync", h, w, t, 100, chunk_size=8, grad_output=-2.5)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


def test_nosync_all_ignored_and_out_of_range():
    h, w, t = make(20, 8, 100, 128)
    loss, gh, gw = route_loss("chunked_nosync", h, w, torch.full_like(t, -1), 100, chunk_size=8)
    assert loss.item() == 0.0 and gh.abs().max() == 0 and gw.abs().max() == 0
    t[3] = 100  # a padded id: rejected (on CUDA by a device-side assert, no host sync)
    with pytest.raises(RuntimeError, match=r"target out of range \[0, 100\)"):
        route_loss("chunked_nosync", h, w, t, 100)


@pytest.mark.parametrize("route", ["full", "chunked_nosync"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_against_float64_of_rounded_operands(route, dtype):
    """bf16/fp16 autocast, the loss scaled by GradScaler's first scale for fp16: loss and
    gradients against float64 of the rounded operands (the only rounding left is the logits')."""
    h, w, t = make(160, 32, 2000, 2048, ignore_every=4, seed=2)
    h, w = h * 0.5, w * 0.1
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    loss, gh, gw = route_loss(route, h, w, t, 2000, autocast=dtype, grad_output=scale, chunk_size=48)
    ref_loss, ref_h, ref_w = naive64(h, w, t, 2000, round_to=dtype)
    tol = 4e-3 if dtype == torch.bfloat16 else 1e-3
    assert abs(loss.item() - ref_loss.item()) <= tol * ref_loss.item()
    for name, got, want in (("hidden", gh / scale, ref_h), ("weight", gw / scale, ref_w)):
        rel = ((got.double() - want).norm() / want.norm()).item()
        assert rel < 2 * tol, f"{name}: relative error {rel:.3g}"


def test_gpt_forward_takes_the_forced_route():
    """GPT.forward at gpt2's vocabulary: each route gives float64's loss and gradients (every
    parameter), and only ``full`` returns logits."""
    gpt, idx, targets = gpt2_vocabulary_model()
    h = gpt.hidden(idx)
    want_loss, want_h, want_w = naive64(h.flatten(0, 1), gpt.lm_head.weight, targets.flatten(), 50257)
    h.backward(want_h.float().view_as(h))  # the rest of the network, through float64's d loss / d h
    gpt.lm_head.weight.grad += want_w.float()  # the head's own share (tied to the embedding)
    want = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    for route in ("full", "chunked_nosync", "chunked"):
        gpt.zero_grad()
        with forced_loss_route(route), HostSyncs() as mode:
            logits, loss = gpt(idx, targets)
            loss.backward()
        assert (logits is None) == (route != "full"), route
        assert not mode.syncs or route == "chunked", (route, mode.syncs)
        assert loss.item() == pytest.approx(want_loss.item(), rel=1e-5), route
        for name, p in gpt.named_parameters():
            torch.testing.assert_close(p.grad, want[name], rtol=1e-4, atol=1e-7, msg=f"{route}: {name}")


def test_bad_route_is_rejected_early():
    for bad in ("fused", "CHUNKED", ""):
        with pytest.raises(ValueError, match=f"forced_loss_route\\(route\\)={bad!r}: expected auto or one of "
                                             "full, chunked, chunked_nosync"):
            with forced_loss_route(bad):
                pass
    with pytest.raises(ValueError, match=f"{LOSS_ROUTE_ENV}='fast': expected auto or one of"):
        parse_loss_route("fast", LOSS_ROUTE_ENV)  # what importing model.loss does with the variable
    assert parse_loss_route("auto", LOSS_ROUTE_ENV) is None and parse_loss_route(None, LOSS_ROUTE_ENV) is None
