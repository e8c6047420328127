"""GPU acceptance: the LM-head loss's CUDA routes (model/loss.py ``loss_route``) make no host
synchronisation -- checked by CUDA itself, ``torch.cuda.set_sync_debug_mode("error")`` --
and give float64's loss and gradients of the same rounded operands; the CPU-tuned ``chunked``
loop does synchronise there (the check is live). Skipped without CUDA (tests/gpu/conftest.py);
the CPU imitation of the same checks is tests/model/test_loss_cuda_path.py."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from tests.gpu.cuda_models import CUDA, DTYPES, rel

pytestmark = pytest.mark.cuda

N, C, V, VP = 4096, 64, 50257, 50304


@contextlib.contextmanager
def syncs_are_errors():
    before = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(before)


def inputs(seed: int = 0):
    g = torch.Generator(device=CUDA).manual_seed(seed)
    h = (torch.randn(N, C, device=CUDA, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(VP, C, device=CUDA, generator=g) * 0.1).requires_grad_(True)
    t = torch.randint(0, V, (N,), device=CUDA, generator=g)
    t[::5] = -1
    return h, w, t


def route_loss(route: str, h, w, t):
    """The loss as GPT.forward computes it on ``route``."""
    from model.loss import chunked_cross_entropy, forced_loss_route, use_chunked_loss

    with forced_loss_route(route):
        if use_chunked_loss(V, h):
            return chunked_cross_entropy(h, w, t, vocab_size=V)
        return F.cross_entropy(F.linear(h, w)[..., :V].float(), t, ignore_index=-1)


@pytest.mark.parametrize("precision", sorted(DTYPES))
@pytest.mark.parametrize("route", ["full", "chunked_nosync"])
def test_cuda_route_has_no_host_sync_and_float64_numbers(record_property, route, precision):
    from model.loss import loss_route

    dtype = DTYPES[precision]
    h, w, t = inputs()
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    torch.cuda.synchronize()
    with syncs_are_errors(), torch.autocast(CUDA.type, dtype=dtype):
        loss = route_loss(route, h, w, t)
        (loss * scale).backward()
    assert loss_route(V, h) == "full"  # what auto picks at this size (N x V << 2**30)
    scored = t >= 0
    h64 = h.detach().to(dtype).double().requires_grad_(True)
    w64 = w.detach().to(dtype).double().requires_grad_(True)
    z = h64 @ w64[:V].T
    ref = (z.logsumexp(1) - z.gather(1, t.clamp_min(0)[:, None])[:, 0])[scored].mean()
    ref.backward()
    record_property("loss_rel_err", abs(loss.item() - ref.item()) / ref.item())
    assert abs(loss.item() - ref.item()) <= 1e-3 * ref.item()
    # d loss / d logits is rounded to the autocast dtype, as autograd does for full logits: on
    # CPU (same shapes) bf16 gave 1.7e-3, fp16 3e-4 (full) and 7e-7 (chunked_nosync: float32)
    bound = {torch.bfloat16: 3e-3, torch.float16: 1e-3}[dtype]
    for name, got, want in (("hidden", h.grad / scale, h64.grad), ("weight", w.grad / scale, w64.grad)):
        record_property(f"{name}_rel_err", rel(got, want))
        assert rel(got, want) < bound, f"{name}: relative error {rel(got, want):.3g}"


def test_cpu_tuned_loop_does_sync_on_cuda():
    """The check is live: the ``chunked`` loop's int(n_valid) stops the host."""
    h, w, t = inputs()
    torch.cuda.synchronize()
    with pytest.raises(RuntimeError, match="synchroniz"), syncs_are_errors(), torch.autocast(CUDA.type,
                                                                                          dtype=torch.bfloat16):
        route_loss("chunked", h, w, t)


def test_compiled_full_route_has_no_host_sync():
    """The route auto takes for gpt2 at B=16 on CUDA, compiled (inductor) as the bench and
    gpu_check run it: after the first (compiling) call, a step runs with syncs as errors."""
    h, w, t = inputs()
    torch._dynamo.reset()
    step = torch.compile(lambda h, w, t: F.cross_entropy(F.linear(h, w)[..., :V].float(), t, ignore_index=-1),
                         fullgraph=True)  # the ``full`` route: GPT.forward's two lines
    for check in (contextlib.nullcontext(), syncs_are_errors()):  # compile first, then check
        h.grad = w.grad = None
        torch.cuda.synchronize()
        with check, torch.autocast(CUDA.type, dtype=torch.bfloat16):
            step(h, w, t).backward()
    assert h.grad is not None and w.grad is not None
