"""model/loss.py: chunked LM head + cross-entropy against F.cross_entropy on full logits."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from model.loss import CHUNKED_LOSS_MIN_VOCAB, chunked_cross_entropy, use_chunked_loss

ROOT = Path(__file__).resolve().parents[2]


def make(N=37, C=16, V=100, Vp=128, ignore_every=0, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, C, generator=g)
    w = torch.randn(Vp, C, generator=g) * scale
    t = torch.randint(0, V, (N,), generator=g)
    if ignore_every:
        t[::ignore_every] = -1
    return h, w, t


def reference(h, w, t, V, autocast=False, dtype=torch.float32, grad_output=1.0):
    """Full (N, V) logits + F.cross_entropy, as GPT.forward computes them."""
    h = h.detach().to(dtype).requires_grad_()
    w = w.detach().to(dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        logits = F.linear(h, w)[:, :V]
        loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), t, ignore_index=-1)
    (loss * grad_output).backward()
    return loss.detach(), h.grad, w.grad


def chunked(h, w, t, V, autocast=False, grad_output=1.0, **kw):
    h = h.detach().clone().requires_grad_()
    w = w.detach().clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = chunked_cross_entropy(h, w, t, vocab_size=V, **kw)
    (loss * grad_output).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 8, 10, 36, 37, 64, 4096])  # 37 rows: divides / not / N < chunk
@pytest.mark.parametrize("ignore_every", [0, 3])
def test_fp32_equals_full_logits_in_float64(chunk_size, ignore_every):
    h, w, t = make(ignore_every=ignore_every)
    ref = reference(h, w, t, 100, dtype=torch.float64)
    got = chunked(h, w, t, 100, chunk_size=chunk_size)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32 and got[2].dtype == torch.float32
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert got[2][100:].abs().max() == 0  # padded vocabulary rows: no gradient from the loss


def test_fp32_equals_fp32_full_logits():
    h, w, t = make(N=50, C=24, V=300, Vp=320, ignore_every=4, seed=1)
    for a, b in zip(chunked(h, w, t, 300, chunk_size=16), reference(h, w, t, 300)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_padded_rows_never_win():
    # padded rows with huge logits would dominate the softmax if they were part of it
    h, w, t = make()
    w[100:] = 50.0 * h.abs().max()
    h = h.abs()  # every logit of a padded row is then large and positive
    ref = reference(h, w, t, 100, dtype=torch.float64)
    got = chunked(h, w, t, 100, chunk_size=8)
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert ref[0] < 20  # the reference does not see the padded rows either


def test_very_wrong_targets_keep_precision():
    # logit gaps of hundreds of nats: softmax(target) underflows float32, the loss must not
    h, w, t = make(scale=30.0, ignore_every=5)
    ref = reference(h, w, t, 100, dtype=torch.float64)
    assert ref[0] > 150
    got = chunked(h, w, t, 100, chunk_size=8)
    assert torch.isfinite(got[0])
    for a, b in zip(got, ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [7, 64])
def test_bf16_autocast_matches_bf16_reference(chunk_size):
    h, w, t = make(N=45, C=32, V=200, Vp=256, ignore_every=4, seed=2)
    ref_loss, ref_h, ref_w = reference(h, w, t, 200, autocast=True)
    loss, gh, gw = chunked(h, w, t, 200, autocast=True, chunk_size=chunk_size)
    assert loss.dtype == torch.float32 and gh.dtype == torch.float32 and gw.dtype == torch.float32
    # same bf16 logits, float32 softmax: the loss agrees to float32 rounding
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    # the reference rounds the whole weight gradient to bf16, ours accumulates chunks in fp32
    torch.testing.assert_close(gh, ref_h, rtol=0, atol=1e-2 * ref_h.abs().max().item())
    torch.testing.assert_close(gw, ref_w, rtol=0, atol=1e-2 * ref_w.abs().max().item())
    # and bf16 really is in use: the fp32 loss differs from the bf16 one
    assert not torch.allclose(reference(h, w, t, 200)[0], ref_loss, rtol=0, atol=1e-6)


def test_grad_output_scales():
    h, w, t = make(ignore_every=3)
    for go in (-2.5, 0.0, 3.0):
        ref = reference(h, w, t, 100, dtype=torch.float64, grad_output=go)
        got = chunked(h, w, t, 100, chunk_size=8, grad_output=go)
        for a, b in zip(got, ref):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_all_ignored_is_zero_with_zero_grads():
    h, w, t = make()
    t[:] = -1
    loss, gh, gw = chunked(h, w, t, 100, chunk_size=8)
    assert loss.item() == 0.0
    assert gh.abs().max() == 0 and gw.abs().max() == 0
    assert torch.isnan(F.cross_entropy(F.linear(h, w)[:, :100], t, ignore_index=-1))  # what we avoid


def test_tied_weight_accumulates_with_embedding():
    V, Vp, C, B, T = 100, 128, 16, 3, 11
    g = torch.Generator().manual_seed(3)
    idx = torch.randint(0, V, (B, T), generator=g)
    targets = torch.randint(0, V, (B, T), generator=g)
    targets[0, :4] = -1
    w0 = torch.randn(Vp, C, generator=g)
    mix = torch.randn(C, C, generator=g) / C**0.5

    def run(use_chunked):
        emb = torch.nn.Embedding(Vp, C)
        head = torch.nn.Linear(C, Vp, bias=False)
        with torch.no_grad():
            head.weight.copy_(w0)
        emb.weight = head.weight  # tied, as in GPT
        h = torch.tanh(emb(idx) @ mix)  # (B, T, C)
        if use_chunked:
            loss = chunked_cross_entropy(h, head.weight, targets, vocab_size=V, chunk_size=5)
        else:
            loss = F.cross_entropy(head(h)[..., :V].flatten(0, 1), targets.flatten(), ignore_index=-1)
        loss.backward()
        return loss.detach(), head.weight.grad

    (l1, g1), (l0, g0) = run(True), run(False)
    torch.testing.assert_close(l1, l0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g1, g0, rtol=1e-5, atol=1e-6)
    assert g1[100:].abs().max() == 0  # no token and no target is a padded row
    assert g1[idx.unique()].abs().sum() > 0


def test_no_grad_and_vocab_default():
    h, w, t = make(Vp=100)
    with torch.no_grad():
        loss = chunked_cross_entropy(h, w.requires_grad_(), t, chunk_size=8)
    assert not loss.requires_grad
    torch.testing.assert_close(loss, F.cross_entropy(F.linear(h, w), t), rtol=1e-5, atol=1e-6)


def test_bad_arguments():
    h, w, t = make()
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t, vocab_size=129)
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t[:-1], vocab_size=100)
    with pytest.raises(ValueError):
        chunked_cross_entropy(h, w, t, vocab_size=100, chunk_size=0)
    t[0] = 100  # a padded id as a target
    with pytest.raises(IndexError):
        chunked_cross_entropy(h, w, t, vocab_size=100)


def test_use_chunked_loss_threshold():
    assert CHUNKED_LOSS_MIN_VOCAB == 8192
    assert not use_chunked_loss(256)
    assert not use_chunked_loss(8191)
    assert use_chunked_loss(8192)
    assert use_chunked_loss(50257)


class LargestAllocation(TorchDispatchMode):
    """Records the largest number of elements of any tensor an operator returns."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for x in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(x, torch.Tensor):
                self.largest = max(self.largest, x.numel())
        return out


@pytest.mark.parametrize("autocast", [False, True])
def test_no_full_logits_tensor_exists(autocast):
    N, C, V = 300, 8, 1000
    h, w, t = make(N=N, C=C, V=V, Vp=1024)

    def largest(fn):
        h_ = h.clone().requires_grad_()
        w_ = w.clone().requires_grad_()
        with LargestAllocation() as mode, torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            fn(h_, w_).backward()
        return mode.largest

    full = largest(lambda h_, w_: F.cross_entropy(F.linear(h_, w_)[:, :V].float(), t))
    ours = largest(lambda h_, w_: chunked_cross_entropy(h_, w_, t, vocab_size=V, chunk_size=64))
    assert full >= N * V  # the mode sees the reference's logits
    assert ours <= 64 * V  # one chunk of rows at most, never (N, V)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch, torch.nn.functional as F
    sys.path.insert(0, sys.argv[1])
    from model.loss import chunked_cross_entropy
    torch.set_num_threads(1)
    torch.manual_seed(0)
    N, C, V = 2048, 32, 16384
    h = torch.randn(N, C, requires_grad=True)
    w = (torch.randn(V, C) * 0.1).requires_grad_()
    t = torch.randint(0, V, (N,))
    h.grad, w.grad = torch.zeros_like(h), torch.zeros_like(w)
    out = {}
    # one small call first: a custom op's first call imports torch._dynamo (~80 MB, once per
    # process; Lightning imports it anyway), which is not memory of the loss
    chunked_cross_entropy(torch.randn(4, C), torch.randn(8, C), torch.randint(0, 8, (4,)))

    def status_kb(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])

    for mode in ("chunked", "full"):
        open("/proc/self/clear_refs", "w").write("5")  # resets the high-water mark VmHWM to the current RSS
        before = status_kb("VmRSS")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if mode == "full":
                loss = F.cross_entropy(F.linear(h, w).float(), t)
            else:
                loss = chunked_cross_entropy(h, w, t, chunk_size=128)
        loss.backward()
        peak = status_kb("VmHWM")
        out[mode] = {"peak_mb": (peak - before) / 1024, "loss": loss.item()}
        del loss
    print(json.dumps(out))
""")


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's resettable VmHWM")
def test_peak_memory_is_lower():
    """Peak resident memory of forward + backward in a fresh process: the full path holds
    (N, V) bf16 and several (N, V) fp32 tensors (128 MB each here), ours one chunk."""
    proc = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(ROOT)], capture_output=True, text=True,
                          check=True, env={"OMP_NUM_THREADS": "1", "PATH": ""})
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert abs(res["full"]["loss"] - res["chunked"]["loss"]) < 1e-4
    logits_fp32_mb = 2048 * 16384 * 4 / 2**20
    assert res["full"]["peak_mb"] > 2 * logits_fp32_mb, res  # the reference really materialises them
    assert res["chunked"]["peak_mb"] < 0.5 * logits_fp32_mb, res


def gpt2_vocabulary_model():
    """A one-layer RoPE GPT at gpt2's vocabulary (50257, padded to 50304) and a batch whose first
    five targets of row 0 are ignored: (model, idx, targets), seed 0."""
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.pe.rope import RoPE

    torch.manual_seed(0)
    config = GPTConfig(vocab_size=50257, block_size=16, n_layer=1, n_head=2, n_embd=16, pad_vocab_multiple=64)
    gpt = GPT(config, RoPE(config))
    idx = torch.randint(0, 50257, (2, 16))
    targets = torch.randint(0, 50257, (2, 16))
    targets[0, :5] = -1
    return gpt, idx, targets


def test_gpt_training_loss_with_gpt2_vocabulary_equals_full_logits():
    """GPT.forward uses the chunked loss for a large vocabulary: the same loss and gradients as
    F.cross_entropy on the full logits of the same model (fp32), and no logits returned."""
    gpt, idx, targets = gpt2_vocabulary_model()
    logits, loss = gpt(idx, targets)
    assert logits is None
    loss.backward()
    chunked = {n: p.grad.clone() for n, p in gpt.named_parameters()}
    gpt.zero_grad()
    full = F.cross_entropy(gpt.logits(gpt.hidden(idx)).flatten(0, 1).double(), targets.flatten(), ignore_index=-1)
    full.backward()
    assert loss.item() == pytest.approx(full.item(), rel=1e-5)
    for name, p in gpt.named_parameters():
        torch.testing.assert_close(chunked[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)


@pytest.mark.parametrize("need_h, need_w, sync_free", [(True, True, False), (True, False, False),
                                                     (False, False, False), (True, True, True)])
def test_custom_op_passes_opcheck(need_h, need_w, sync_free):
    """torch.compile plans memory from the op's fake outputs: opcheck runs real and fake side by side."""
    h, w, t = make(ignore_every=4)
    torch.library.opcheck(torch.ops.pelab.chunked_linear_cross_entropy,
                          (h, w, t, 100, -1, 16, torch.bfloat16, need_h, need_w, sync_free))


@pytest.mark.parametrize("autocast, sync_free", [(False, False), (True, False), (True, True)])
def test_compiled_graph_equals_full_logits(autocast, sync_free):
    """Inside a compiled graph (fullgraph: no break) the loss, and gradients scaled by a
    grad_output other than 1, still equal the full-logits reference (both chunk loops)."""
    h, w, t = make(ignore_every=3)
    ref = reference(h, w, t, 100, autocast=autocast, grad_output=2.5)
    torch._dynamo.reset()
    loss_fn = torch.compile(lambda h, w: chunked_cross_entropy(h, w, t, vocab_size=100, chunk_size=10,
                                                               sync_free=sync_free) * 2.5,
                            fullgraph=True, backend="aot_eager")
    h_, w_ = h.clone().requires_grad_(), w.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = loss_fn(h_, w_)
    loss.backward()
    atol = 2e-2 if autocast else 1e-5
    torch.testing.assert_close(loss / 2.5, ref[0], atol=atol, rtol=0)
    for got, want in ((h_.grad, ref[1]), (w_.grad, ref[2])):
        torch.testing.assert_close(got, want, atol=atol * want.abs().max().item(), rtol=0)
