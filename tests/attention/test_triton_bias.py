"""``triton_bias``: the fused Triton kernels for a bias of the distance, run through Triton's
interpreter on CPU (TRITON_INTERPRET=1), against float64 autograd on the formulas: the kernel
alone (output, dq, dk, dv and the bias vector's gradient, reduced per tile along diagonals), each
learned-bias scheme through a model layer (output and the gradients of the input, the weights and
the scheme's own parameters), and the routes: ``auto`` on CUDA, the fallback where the bias is not
one vector of the distance, and the one-line refusals of what the kernel cannot serve.

Shapes are small (the interpreter is slow) but span several 16-row tiles with a partial last one
(T = 37), two heads or more, a batch of two (the bias gradient sums over it) and queries that are
the last rows of longer keys (query chunks)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from model.attention import KERNELS, AttentionRequest, resolve  # noqa: E402
from model.attention import triton_bias  # noqa: E402
from model.attention.triton_bias import Delegated, attention_with_distance_bias  # noqa: E402
from model.config import GPTConfig  # noqa: E402
from model.pe import SCHEMES  # noqa: E402
from tests.attention.test_backends import naive_layer64  # noqa: E402
from tests.naive import leaf_params, set_naive_params  # noqa: E402
from tests.tiny import build, contexts  # noqa: E402

torch.set_num_threads(2)
SCHEMES_OF_DISTANCE = ["t5", "kerple_log", "kerple_power", "fire"]
# T5 with few buckets: at T = 20 its exact ones, its log ones and the last (distances >= 12) are all read
OPTIONS = {"t5": {"num_buckets": 8, "max_distance": 12}}
CUDA = torch.device("cuda")


@pytest.fixture
def interpreter(monkeypatch):
    """Triton's interpreter for this test only (the interpreted kernels are built on first use, apart
    from the compiled ones a CUDA test uses)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def naive_distance_attention(q, k, v, b):
    """float64 softmax(q k^T / sqrt(D) + b[h, i' - j]) v over keys j <= i', i' = Tk - Tq + i."""
    Tq, Tk, D = q.shape[2], k.shape[2], q.shape[-1]
    distance = (torch.arange(Tk - Tq, Tk)[:, None] - torch.arange(Tk)[None, :]).to(q.device)
    logits = q @ k.transpose(-1, -2) / D ** 0.5 + b[:, distance.clamp(min=0)]
    return torch.softmax(logits.masked_fill(distance < 0, float("-inf")), -1) @ v


@pytest.mark.parametrize("dtype, Tq", [(torch.float32, 37), (torch.float32, 21), (torch.bfloat16, 37)])
def test_kernel_equals_the_float64_reference_with_the_bias_gradient(interpreter, dtype, Tq):
    """Output, dq, dk, dv and dL/db[h, d] of the kernel; bf16 inputs are compared against the
    float64 reference on the same (rounded) inputs, within the rounding of bf16 P and dS."""
    B, H, Tk, D = 2, 2, 37, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype) for T in (Tq, Tk, Tk))
    b = torch.randn(H, Tk, generator=g)
    weights = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64)
    inputs = [t.clone().requires_grad_(True) for t in (q, k, v, b)]
    out = attention_with_distance_bias(*inputs)
    (out.double() * weights).sum().backward()
    ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v, b)]
    ref = naive_distance_attention(*ref_inputs)
    (ref * weights).sum().backward()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol)
    for name, got, want in zip("qkvb", inputs, ref_inputs):
        scale = want.grad.abs().max().item()
        assert scale > 1e-3, f"d{name}: the check needs a non-zero gradient"
        torch.testing.assert_close(got.grad.double(), want.grad, atol=tol * scale, rtol=tol,
                                   msg=lambda m, n=name: f"d{n}: {m}")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_compiled_kernel_on_cuda_equals_the_float64_reference(dtype):
    """The compiled kernels at their GPU tile (64 rows) and gpt2's head size: T = 200 (a partial
    fourth tile), query chunks (Tq = 70), three heads; bf16/fp16 within their P and dS rounding."""
    B, H, Tk, D = 2, 3, 200, 64
    for Tq in (Tk, 70):
        g = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(B, H, T, D, generator=g).to(dtype).cuda() for T in (Tq, Tk, Tk))
        b = torch.randn(H, Tk, generator=g).cuda()
        weights = torch.randn(B, H, Tq, D, generator=g, dtype=torch.float64).cuda()
        inputs = [t.clone().requires_grad_(True) for t in (q, k, v, b)]
        out = attention_with_distance_bias(*inputs)
        (out.double() * weights).sum().backward()
        ref_inputs = [t.detach().double().requires_grad_(True) for t in (q, k, v, b)]
        ref = naive_distance_attention(*ref_inputs)
        (ref * weights).sum().backward()
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out.double(), ref, atol=tol, rtol=tol, msg=lambda m: f"output at Tq={Tq}: {m}")
        for name, got, want in zip("qkvb", inputs, ref_inputs):
            scale = want.grad.abs().max().item()
            torch.testing.assert_close(got.grad.double(), want.grad, atol=tol * scale, rtol=tol,
                                       msg=lambda m, n=name: f"d{n} at Tq={Tq}: {m}")


def distance_model(scheme):
    """A layer of pe=``scheme`` on triton_bias: 4 heads of 16 dims, the naive references'
    parameters (FIRE's threshold L = 2 x 48 above every position, so its bias is of the distance)."""
    cfg, model, attn = build(scheme, OPTIONS.get(scheme, {}), seed=3, attention="triton_bias", n_embd=64,
                             block_size=48)
    set_naive_params(model.pe)
    if scheme == "fire":
        with torch.no_grad():
            model.pe.threshold_multiplier.fill_(2.0)
    return cfg, model, attn


def check_layer(model, attn, positions, delegated=False):
    """The first layer at ``positions`` against float64 autograd: output, and gradients of the
    input, both weights and every scheme parameter."""
    torch.manual_seed(5)
    x = torch.randn(2, positions.shape[0], model.config.n_embd, requires_grad=True)
    weights = torch.randn(2, positions.shape[0], model.config.n_embd, dtype=torch.float64)
    ctx = contexts(model, positions)[0]
    assert ctx.backend.name == "triton_bias" and isinstance(ctx.state, Delegated) == delegated
    y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    W, Wp = (attn.c_attn.weight.detach().double().requires_grad_(True),
             attn.c_proj.weight.detach().double().requires_grad_(True))
    params = leaf_params(model.pe)
    ref = naive_layer64(W, Wp, x64, [positions.tolist()] * 2, model.pe, OPTIONS.get(model.pe.name, {}), params)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = [("x", x.grad, x64.grad), ("c_attn", attn.c_attn.weight.grad, W.grad),
             ("c_proj", attn.c_proj.weight.grad, Wp.grad)]
    pairs += [(n, p.grad, params[n].grad) for n, p in model.pe.named_parameters() if params[n].grad is not None]
    largest = max(params[n].grad.abs().max().item() for n in params if params[n].grad is not None)
    for n, got, want in pairs:
        scale = want.abs().max().item()
        if n == "mlp.2.bias" or scale == 0:  # FIRE's output bias shifts a whole row (softmax ignores it),
            # its threshold does nothing while every i < L: zero to float32 rounding of the row sums of dS
            assert got is None or got.abs().max() < 1e-5 * largest, (n, got)
            continue
        assert scale > 1e-6, f"{n}: the check needs a non-zero gradient"
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m, n=n: f"{n}: {m}")


@pytest.mark.parametrize("scheme", SCHEMES_OF_DISTANCE)
def test_each_learned_bias_through_the_kernel_equals_the_float64_layer(interpreter, scheme):
    """The scheme's (H, T) vector of the distance from its parameters, the kernel, and autograd
    from dL/db back to the parameters (T5's exact, log and last buckets, KERPLE's
    projection, FIRE's MLP and c): positions 5..24 (two tiles, the second partial), so the bias is read at the distance, not the position."""
    _, model, attn = distance_model(scheme)
    check_layer(model, attn, torch.arange(5, 25))


def test_fire_past_its_threshold_takes_the_route_the_kernel_replaces(interpreter):
    """FIRE with queries at or past L = 12 (its bias then depends on max(i, L), not on i - j alone):
    the forward is prepared for bias_grad (flex on CUDA), with the same model."""
    _, model, attn = distance_model("fire")
    with torch.no_grad():
        model.pe.threshold_multiplier.fill_(0.25)
    check_layer(model, attn, torch.arange(0, 20), delegated=True)


def test_auto_keeps_todays_route_until_the_kernel_is_measured_on_a_gpu(monkeypatch):
    """Not yet compiled or timed on a GPU: auto on CUDA keeps flex for a learned bias, and the kernel
    runs only where it is named."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    for scheme in SCHEMES_OF_DISTANCE:
        pe = SCHEMES[scheme](cfg)
        assert resolve("auto", AttentionRequest(pe, CUDA, torch.bfloat16, grad=True)).name == "flex"
        assert resolve("triton_bias", AttentionRequest(pe, CUDA, torch.bfloat16, grad=True)).name == "triton_bias"


def test_auto_takes_the_kernel_on_cuda_for_a_learned_bias_in_training(monkeypatch):
    """Once switched on (TritonBias.in_auto), auto on CUDA with Triton present: triton_bias for t5,
    kerple and fire under autograd without dropout; flex without autograd or with Triton absent
    (today's route); CPU routes unchanged."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(triton_bias.TritonBias, "in_auto", True)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=32)
    cpu = torch.device("cpu")
    for scheme in SCHEMES_OF_DISTANCE:
        pe = SCHEMES[scheme](cfg)
        for dtype in (torch.bfloat16, torch.float32):
            assert resolve("auto", AttentionRequest(pe, CUDA, dtype, grad=True)).name == "triton_bias"
            assert resolve("auto", AttentionRequest(pe, CUDA, dtype, grad=False)).name == "flex"
            assert resolve("auto", AttentionRequest(pe, CUDA, dtype, 0.1, grad=True)).name != "triton_bias"
            assert resolve("auto", AttentionRequest(pe, CUDA, dtype, grad=True, documents=True)).name == "flex"
            assert resolve("auto", AttentionRequest(pe, cpu, dtype, grad=True)).name == "bias_grad"
    assert resolve("auto", AttentionRequest(SCHEMES["rope"](cfg), CUDA, grad=True)).name == "sdpa"
    assert resolve("auto", AttentionRequest(SCHEMES["alibi"](cfg), CUDA, grad=True)).name == "sdpa_key"
    monkeypatch.setattr(triton_bias, "TRITON", False)
    assert resolve("auto", AttentionRequest(SCHEMES["t5"](cfg), CUDA, grad=True)).name == "flex"


def refusal(monkeypatch, interpret="1", scheme="t5", device=CUDA, dtype=torch.float32, dropout=0.0, **config):
    """The error of model.attention=triton_bias forced for this forward (None: it serves it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TRITON_INTERPRET", interpret)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, **{"n_embd": 32, **config})
    request = AttentionRequest(SCHEMES[scheme](cfg), device, dtype, dropout, grad=True, windows=cfg.windowed)
    try:
        assert resolve("triton_bias", request).name == "triton_bias"
    except ValueError as error:
        return str(error)
    return None


def test_forced_route_it_cannot_serve_is_one_line_naming_the_key_and_the_way_out(monkeypatch):
    cpu = torch.device("cpu")
    assert refusal(monkeypatch) is None and refusal(monkeypatch, device=cpu) is None
    cases = {
        "model.attention=triton_bias on cpu runs only through Triton's interpreter: set TRITON_INTERPRET=1":
            dict(interpret="0", device=cpu),
        "model.attention=triton_bias tiles head_dim = model.n_embd / model.n_head = 12: it needs a power of two":
            dict(n_embd=24),
        "model.attention=triton_bias tiles head_dim = model.n_embd / model.n_head = 512: it needs a power of two "
        "from 16 to 256": dict(n_embd=1024),
        "model.attention=triton_bias computes in float32, bf16 or fp16, not float64; use model.attention=math":
            dict(dtype=torch.float64),
        "model.attention=triton_bias has no attention dropout": dict(dropout=0.1),
        "model.attention=triton_bias serves a bias of the distance (t5, kerple_log, kerple_power, fire, alibi); "
        "pe=rope has none": dict(scheme="rope"),
        "model.attention=triton_bias has no sliding windows (model.window, model.window_pattern); use "
        "model.attention=auto":
            dict(window=8),
    }
    for message, case in cases.items():
        got = refusal(monkeypatch, **case)
        assert got is not None and got.startswith(message) and "\n" not in got, (case, got)
    request = AttentionRequest(SCHEMES["t5"](GPTConfig(vocab_size=32, block_size=16, n_head=2, n_embd=32)), CUDA,
                               grad=True, documents=True)
    assert KERNELS["triton_bias"].refusal(request).startswith("model.attention=triton_bias has no packed documents")
