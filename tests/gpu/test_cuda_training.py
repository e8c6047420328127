"""GPU acceptance: one training step (forward + backward) of every scheme on every attention route
a CUDA run can take, in bf16 and fp16 autocast, with attention dropout 0 and 0.2, against the
``math`` backend (the attention formula in float32), plus flex's gradients of learned biases in
float32, a BlockMask first built under inference_mode, and sdpa_key under the flash kernel alone.
Bounds and why: docs/gpu.md, "What each check asserts". Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from model.attention import BACKENDS
from model.attention.base import Terms
from model.pe import SCHEMES
from tests.gpu.cuda_models import (CUDA, DTYPES, FLOOR, attention_dropout_only, build, config, flat,
                                   highest_matmul_precision, learned_bias_schemes, rel, routes, scheme_instance,
                                   scheme_parameter_indices, tokens, training_step, with_attention)

pytestmark = pytest.mark.cuda

ROUTES = routes()
COMPARED = sorted({(s, p, r) for s, p, d, r, _ in ROUTES if r != "math"})  # math is the reference
DROPOUT_ROUTES = sorted({(s, p, r) for s, p, d, r, _ in ROUTES if d > 0})
LEARNED_BIAS = learned_bias_schemes()
KEY_ONLY = [n for n in sorted(SCHEMES) if scheme_instance(n, config()).key_only_slopes() is not None]


@pytest.fixture(autouse=True)
def float32_matmuls():
    """References in float32 proper: TF32 off whatever another test or import set."""
    with highest_matmul_precision():
        yield


def check_bounded(record_property, what: str, route, math_, ref, floor: float) -> None:
    """‖route − math‖ ≤ floor·‖math‖ + 2‖math − ref‖: the route within the dtype's rounding of
    math, where ``ref`` is math in float32 (so ‖math − ref‖ is math's own rounding error)."""
    d, own = rel(route, math_), rel(math_, ref)
    bound = floor + 2 * own
    record_property(f"{what}_rel_err", f"{d:.3g}")
    record_property(f"{what}_bound", f"{bound:.3g}")
    assert d <= bound, f"{what}: relative error {d:.3g} against math > bound {bound:.3g} (math's own {own:.3g})"


def compare_with_math(record_property, scheme: str, precision: str, route: str, choice: str | None = None,
                      **options) -> None:
    """``choice``: the model.attention value that leads to ``route`` (default the route's own
    name); ``options``: model options (sinks, windows), learned sinks set far from zero."""
    dtype = DTYPES[precision]
    model = build(scheme, config(choice or route, **options))
    with torch.no_grad():  # learned sinks start near zero (gpt-oss's init): make them matter
        for block in model.blocks:
            if isinstance(block.attn.sinks, torch.nn.Parameter):
                block.attn.sinks.copy_(torch.linspace(-1.0, 2.0, block.attn.sinks.numel()))
    assert model.attention(CUDA, dtype=dtype).name == route, "the route resolved differently on this machine"
    math_model = with_attention(model, "math")
    x, y = tokens(model.config.vocab_size)
    logits, loss, grads = training_step(model, x, y, dtype)
    m_logits, m_loss, m_grads = training_step(math_model, x, y, dtype)
    r_logits, r_loss, r_grads = training_step(math_model, x, y, None)  # math in float32: the reference
    for name, (lg, ls, gs) in (("route", (logits, loss, grads)), ("math", (m_logits, m_loss, m_grads))):
        assert torch.isfinite(lg).all() and torch.isfinite(ls), f"{name}: non-finite logits or loss"
        assert all(torch.isfinite(g).all() for g in gs), f"{name}: non-finite gradients"
    floor = FLOOR[dtype]
    check_bounded(record_property, "loss", loss, m_loss, r_loss, floor)
    check_bounded(record_property, "logits", logits, m_logits, r_logits, floor)
    check_bounded(record_property, "grads", flat(grads), flat(m_grads), flat(r_grads), floor)
    names = [n for n, _ in model.named_parameters()]
    sinks = [i for i, n in enumerate(names) if n.endswith("attn.sinks")]
    for ids in (scheme_parameter_indices(model), sinks):  # the scheme's own gradients, then the sinks'
        scale = flat([r_grads[i] for i in ids]).norm().item() if ids else 0.0
        for i in ids:  # each tensor alone
            check_scheme_tensor(record_property, names[i], grads[i], m_grads[i], r_grads[i], floor, scale)


def check_scheme_tensor(record_property, name: str, route, math_, ref, floor: float, scale: float) -> None:
    """One tensor of the scheme (``scale``: the norm of the scheme's whole float32 gradient).
    ‖route − math‖ ≤ (floor + 2·own)·‖math‖ + floor·scale. The second term: a flash-style backward
    (flex, SDPA's kernels) takes each row's D_i = dO_i·O_i from the output rounded to the compute
    dtype, so every score gradient dS_ij carries P_ij·δD_i, which a tensor's gradient sums.
    A tensor whose exact gradient vanishes (‖ref‖ ≤ 1e-3·scale: FIRE's output bias adds one
    constant to every score of a row, which softmax ignores) keeps only that noise, and math's own
    relative error is > 1: it is held to ‖route − math‖ ≤ 0.1·scale (garbage, not rounding)."""
    err = (route.double() - math_.double()).norm().item()
    own = rel(math_, ref)
    vanishing = ref.double().norm().item() <= 1e-3 * scale
    bound = 0.1 * scale if vanishing else (floor + 2 * own) * math_.double().norm().item() + floor * scale
    record_property(f"grad[{name}]_abs_err", f"{err:.3g}")
    record_property(f"grad[{name}]_bound", f"{bound:.3g}")
    assert err <= bound, (f"grad[{name}]: error {err:.3g} against math > bound {bound:.3g} (relative "
                          f"{rel(route, math_):.3g}, math's own {own:.3g}, the scheme's gradient {scale:.3g}, "
                          f"vanishing: {vanishing})")


@pytest.mark.parametrize("scheme, precision, route", COMPARED, ids=["-".join(c) for c in COMPARED])
def test_training_step_matches_math(record_property, scheme, precision, route):
    """Every route but math (those of dropout 0.2 included, run here with the dropout off):
    loss, logits and all gradients finite and within the bound of math."""
    record_property("route", route)
    compare_with_math(record_property, scheme, precision, route)


@pytest.mark.parametrize("scheme, precision, route", DROPOUT_ROUTES, ids=["-".join(c) for c in DROPOUT_ROUTES])
def test_dropout_route_is_finite_and_drops_attention(record_property, scheme, precision, route):
    """model.dropout=0.2: the route a training step takes applies attention dropout (with every
    other dropout off, the same seed gives the same logits within 1e-5 relative, another seed
    logits at least 1e-2 away; 0.86 on CPU) and the loss and gradients are finite. Against math
    only with the dropout off (the test above): the kernels draw their masks from other streams."""
    record_property("route", route)
    dtype = DTYPES[precision]
    choice = next(c for s, p, d, r, choices in ROUTES if (s, p, r) == (scheme, precision, route) and d > 0
                  for c in choices)
    model = attention_dropout_only(build(scheme, config(choice, dropout=0.2)))
    model.train()
    assert model.attention(CUDA, dtype=dtype).name == route
    x, y = tokens(model.config.vocab_size)
    torch.manual_seed(1)
    logits, loss, grads = training_step(model, x, y, dtype)
    assert torch.isfinite(loss) and torch.isfinite(logits).all()
    assert all(torch.isfinite(g).all() for g in grads)
    assert any(g.abs().sum() > 0 for g in grads)
    torch.manual_seed(1)
    again, _, _ = training_step(model, x, y, dtype)
    torch.manual_seed(2)
    other, _, _ = training_step(model, x, y, dtype)
    record_property("logits_change_other_seed", f"{rel(other, logits):.3g}")
    assert rel(again, logits) <= 1e-5, "the same seed must draw the same attention dropout"
    assert rel(other, logits) >= 1e-2, "attention dropout 0.2 changed (almost) nothing: the route drops no attention"


@pytest.mark.parametrize("scheme", LEARNED_BIAS)
def test_flex_gradients_of_learned_biases_match_math_in_float32(record_property, scheme):
    """flex's backward into the scheme's parameters (captured by score_mod), float32 q, k, v,
    against the attention written out in float64 with the scheme in float64; math (float32)
    must meet the same bound. Per tensor: ‖g − g64‖ ≤ 1e-4‖g64‖ + 1e-5‖all of the scheme's g64‖
    (FIRE's last MLP bias shifts whole rows: its true gradient is 0 and only the second term
    applies); outputs and q, k, v gradients within 1e-4 relative."""
    cfg = config("flex")
    torch.manual_seed(0)
    pe = SCHEMES[scheme](cfg).to(CUDA)
    B, H, D = 2, cfg.n_head, cfg.head_dim
    g = torch.Generator(device=CUDA).manual_seed(3)
    q, k, v = (2 * torch.randn(B, H, 128, D, device=CUDA, generator=g) for _ in range(3))
    w = torch.randn(B, H, 128, D, device=CUDA, generator=g)
    positions = torch.arange(128, device=CUDA)

    def run(backend_name: str, module):
        module.zero_grad(set_to_none=True)
        qq, kk, vv = (t.clone().requires_grad_() for t in (q, k, v))
        backend = BACKENDS[backend_name]
        out = backend(qq, kk, vv, backend.prepare(Terms(module, positions, positions)), 0.0)
        out = out[0] if backend.records else out
        (out * w).sum().backward()
        return out.detach(), [t.grad for t in (qq, kk, vv)], [p.grad.detach() for p in module.parameters()]

    flex_out, flex_qkv, flex_g = run("flex", pe)
    math_out, math_qkv, math_g = run("math", pe)
    # float64 reference: the scheme's bias in float64, softmax attention written out
    pe64 = copy.deepcopy(pe).double()
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    future = torch.arange(128, device=CUDA)[None, :] > torch.arange(128, device=CUDA)[:, None]
    scores = q64 @ k64.transpose(-1, -2) / math.sqrt(D) + pe64.bias(positions, positions).double()
    out64 = torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1) @ v64
    (out64 * w.double()).sum().backward()
    ref_g = [p.grad for p in pe64.parameters()]
    scale = flat(ref_g).norm().item()
    for name, got, alt, ref in zip((n for n, _ in pe.named_parameters()), flex_g, math_g, ref_g):
        bound = 1e-4 * ref.norm().item() + 1e-5 * scale
        err, math_err = (got.double() - ref).norm().item(), (alt.double() - ref).norm().item()
        record_property(f"grad[{name}]_abs_err", f"{err:.3g} (math {math_err:.3g}, bound {bound:.3g})")
        assert math_err <= bound, f"the float32 reference itself misses the bound for {name}: {math_err:.3g}"
        assert err <= bound, f"flex gradient of {name}: error {err:.3g} > {bound:.3g} (math: {math_err:.3g})"
    assert rel(flex_out, out64.detach()) <= 1e-4
    for got, ref in zip(flex_qkv, (q64.grad, k64.grad, v64.grad)):
        assert rel(got, ref) <= 1e-4


@pytest.mark.parametrize("scheme", LEARNED_BIAS)
def test_a_block_mask_first_built_under_inference_mode_trains(record_property, scheme):
    """Lightning's sanity validation runs under inference_mode before the first training step; the
    flex BlockMask cached then (per shape) is reused by training, whose backward saves it (audit
    #16). A bf16 training step after such a forward must run and still match math."""
    BACKENDS["flex"]._block_masks.clear()
    model = build(scheme, config("flex"))
    x, y = tokens(model.config.vocab_size)
    model.eval()
    with torch.inference_mode(), torch.autocast(CUDA.type, dtype=torch.bfloat16):
        model(x)
    assert BACKENDS["flex"]._block_masks, "the inference forward built no BlockMask: the test tests nothing"
    compare_with_math(record_property, scheme, "bf16", "flex")


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("n_embd", [64, 256], ids=["head_dim16", "head_dim64"])
@pytest.mark.parametrize("scheme", KEY_ONLY)
def test_sdpa_key_runs_on_the_flash_kernel_alone(scheme, n_embd, dropout):
    """sdpa_key pads q, k, v to one head dim (a multiple of 8) and keeps SDPA's causal kernel, so
    the flash kernel alone must take a bf16 training step and KV-cache decoding (one query, no
    mask); with dropout off the step also matches math."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    model = build(scheme, config("sdpa_key", dropout=dropout, n_embd=n_embd))
    x, y = tokens(model.config.vocab_size)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        logits, loss, grads = training_step(model, x, y, torch.bfloat16)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads)
        model.eval()
        with torch.autocast(CUDA.type, dtype=torch.bfloat16):
            out = model.generate(x[:1, :16], 8, temperature=0.0)
        assert out.shape == (1, 24)
    if not dropout:
        math_model = with_attention(model, "math")
        _, m_loss, m_grads = training_step(math_model, x, y, torch.bfloat16)
        _, r_loss, r_grads = training_step(math_model, x, y, None)
        assert rel(flat(grads), flat(m_grads)) <= FLOOR[torch.bfloat16] + 2 * rel(flat(m_grads), flat(r_grads))


@pytest.mark.parametrize("precision", sorted(DTYPES))
def test_chunked_loss_gradients_on_cuda(precision):
    """The chunked LM-head loss (gpt2's vocabulary) on CUDA under autocast, the loss scaled by
    GradScaler's first scale for fp16: gradients against a float64 reference of the same
    rounded operands within 2e-3 relative (bf16: one rounding, 2^-8), and no vocabulary row loses
    its gradient (audit #5)."""
    import torch.nn.functional as F

    from model.loss import chunked_cross_entropy

    dtype = DTYPES[precision]
    g = torch.Generator(device=CUDA).manual_seed(0)
    N, C, V = 4096, 64, 50257
    h = (torch.randn(N, C, device=CUDA, generator=g) * 0.5).requires_grad_(True)
    w = (torch.randn(V, C, device=CUDA, generator=g) * 0.1).requires_grad_(True)
    targets = torch.randint(0, V, (N,), device=CUDA, generator=g)
    scale = 2.0**16 if dtype == torch.float16 else 1.0
    with torch.autocast(CUDA.type, dtype=dtype):
        loss = chunked_cross_entropy(h, w, targets, vocab_size=V)
    (loss * scale).backward()
    h64 = h.detach().to(dtype).double().requires_grad_(True)
    w64 = w.detach().to(dtype).double().requires_grad_(True)
    ref = F.cross_entropy(h64 @ w64.T, targets)
    ref.backward()
    assert abs(loss.item() - ref.item()) <= 2e-3 * ref.item()
    # d loss / d logits enters the backward's matmuls rounded once to the compute dtype (bf16 2^-8)
    bound = max(2e-3, torch.finfo(dtype).eps / 2)
    for name, got, want in (("hidden", h.grad / scale, h64.grad), ("weight", w.grad / scale, w64.grad)):
        assert rel(got, want) < bound, f"{name}: relative error {rel(got, want):.3g} > {bound:.3g}"
    zero_rows = int(((w.grad == 0).all(1) & (w64.grad != 0).any(1)).sum())
    assert zero_rows == 0, f"{zero_rows} vocabulary rows lost their gradient"
