"""The attention route each (scheme, compute dtype, dropout, model.attention) takes on CUDA,
resolved for a CUDA device and run on CPU with a spy on SDPA: CUDA's fused kernels take a
float mask only in q's dtype (the memory-efficient kernel refuses a float32 mask with bf16 q,
cuDNN reads it as bf16), so SDPA must never get a float mask of another dtype than q's."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from model.attention import BACKENDS, CHOICES, AttentionRequest, Terms, resolve
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.positions import Pass, layer_contexts

torch.set_num_threads(2)

CUDA = torch.device("cuda")
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def sdpa_calls(monkeypatch) -> list[tuple[torch.dtype, torch.dtype | None]]:
    calls, real = [], F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        calls.append((q.dtype, None if attn_mask is None else attn_mask.dtype))
        return real(q, k, v, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    return calls


@pytest.mark.parametrize("dropout", [0.0, 0.2])
@pytest.mark.parametrize("precision", list(DTYPES))
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_sdpa_never_gets_a_float_mask_of_another_dtype_on_cuda(monkeypatch, scheme, precision, dropout):
    dtype = DTYPES[precision]
    calls = sdpa_calls(monkeypatch)
    for choice in CHOICES:
        if choice == "triton_bias":
            continue  # a Triton kernel (SDPA never): tests/attention/test_triton_bias.py
        if choice == "flex" and (dropout or SCHEMES[scheme].terms not in (None, *BACKENDS["flex"].terms)):
            continue  # refused by GPTConfig, or by resolve (flex cannot add CoPE's terms of the scores)
        cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=dropout,
                        attention=choice)
        torch.manual_seed(0)
        model = GPT(cfg, SCHEMES[scheme](cfg)).train()
        backend = resolve(choice, AttentionRequest(model.pe, CUDA, dtype, dropout, grad=True))
        assert backend.name != "bias_grad"  # a CPU kernel
        assert backend.dropout or not dropout, f"{choice} -> {backend.name} drops the attention dropout"
        if backend.name in ("flex", "math"):
            continue  # they never call SDPA
        positions = torch.arange(12)
        x = torch.randn(2, 12, cfg.n_embd)
        # whole sequences, query chunks, and several new tokens after a cache (an explicit order mask)
        for q_chunk, always in ((None, False), (5, False), (None, True)):
            terms = Terms(model.pe, positions, positions, dtype=dtype, explicit_mask=always)
            ctx = layer_contexts(terms, backend, Pass(q_chunk=q_chunk))[0]
            with torch.no_grad(), torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
                y = model.blocks[0](x, ctx)
            assert torch.isfinite(y).all()
    for q_dtype, mask_dtype in calls:
        assert mask_dtype in (None, torch.bool, q_dtype), f"SDPA got a {mask_dtype} mask with {q_dtype} q"


@pytest.mark.parametrize("scheme, precision, dropout, expected", [
    ("t5", "bf16", 0.0, "flex"),  # an elementwise bias, float32 scores
    ("t5", "bf16", 0.2, "math"),  # flex has no dropout; a bf16 mask would round the bias
    ("t5", "fp32", 0.2, "sdpa"),  # a float32 mask with float32 q
    ("fire", "fp16", 0.2, "math"),
    ("alibi", "bf16", 0.2, "sdpa_key"),  # the key-only form: exact in bf16 pieces, SDPA's dropout
    ("alibi", "fp16", 0.0, "flex"),  # fp16 has no exact pieces
    ("rope_alibi", "fp16", 0.2, "math"),
    ("rope", "fp16", 0.2, "sdpa"),  # no bias: the causal kernel
    ("fox", "bf16", 0.0, "flex"),  # c_i - c_j in score_mod: SDPA would need a float32 mask with bf16 q
    ("fox", "bf16", 0.2, "math"),
    ("fox", "fp32", 0.0, "sdpa"),  # a float32 mask with float32 q
])
def test_auto_on_cuda_takes_an_exact_route(scheme, precision, dropout, expected):
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=dropout)
    pe = SCHEMES[scheme](cfg)
    assert resolve("auto", AttentionRequest(pe, CUDA, DTYPES[precision], dropout, grad=True)).name == expected
    if expected != "sdpa_key" and pe.uses_bias:  # an explicit sdpa is rerouted the same way
        assert resolve("sdpa", AttentionRequest(pe, CUDA, DTYPES[precision], dropout, grad=True)).name == expected


def test_every_backend_falls_back_to_one_that_applies():
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    for scheme in SCHEMES:
        pe = SCHEMES[scheme](cfg)
        for name, backend in BACKENDS.items():
            assert "math" in backend.fallback or name == "math"
            for device in (torch.device("cpu"), CUDA):
                for dtype in DTYPES.values():
                    for dropout in (0.0, 0.2):
                        if name == "flex" and (dropout or pe.terms not in (None, *backend.terms)
                                               or device.type == "cpu"):
                            continue  # refused (GPTConfig; resolve: CoPE's terms, no CPU backward on flex)
                        got = resolve(name, AttentionRequest(pe, device, dtype, dropout, grad=True))
                        request = AttentionRequest(pe, device, dtype, dropout, True)
                        assert got.refusal(request) is None or got.name == "flex"


def test_a_schedule_that_leaves_no_layer_to_a_scheme_with_parameters_is_refused():
    from model.pe.schedule import nope_layers

    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16)
    with pytest.raises(ValueError, match=r"pe.nope_every=1 makes all 2 layers NoPE layers, so pe=t5's parameters"):
        GPT(cfg, SCHEMES["t5"](cfg), nope_layers(2, 1))
    GPT(cfg, SCHEMES["t5"](cfg), nope_layers(2, 2))  # one layer keeps the scheme
    GPT(cfg, SCHEMES["alibi"](cfg), nope_layers(2, 1))  # no parameters: nothing unused


def test_decoding_one_token_does_not_take_flex(monkeypatch):
    """generate() with a KV cache: the prompt runs on flex, each decoded token (one query row)
    on math, so compiled flex does not build a kernel and a BlockMask per cache length."""
    flex = BACKENDS["flex"]
    shapes, real = [], type(flex).__call__
    monkeypatch.setattr(type(flex), "__call__", lambda self, q, k, v, s, d: shapes.append(q.shape[2]) or real(
        self, q, k, v, s, d))
    cfg = GPTConfig(vocab_size=32, block_size=32, n_layer=2, n_head=2, n_embd=16, attention="flex")
    torch.manual_seed(0)
    model = GPT(cfg, SCHEMES["t5"](cfg)).eval()
    prompt = torch.randint(0, 32, (1, 6), generator=torch.Generator().manual_seed(1))
    cached = model.generate(prompt, 5, temperature=0.0)
    assert shapes == [6, 6]  # the prompt, in both layers
    assert torch.equal(cached, model.generate(prompt, 5, temperature=0.0, cache=False))


@pytest.mark.parametrize("scheme", ["kerple_log", "kerple_power"])
def test_kerple_forward_writes_no_parameter_and_keeps_the_reference_gradient(scheme):
    """FSDP (use_orig_params) hands a module its parameters as views of one flat tensor; an
    in-place clamp inside forward then fails in backward. The reference clamps in place and
    differentiates at the clamped value: the gradient must be that plain one, not clamp's zero."""
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    pe = SCHEMES[scheme](cfg)
    flat = torch.tensor([0.003, 0.7, 0.004, 0.5], requires_grad=True)  # r1[0], r2[0] below eps = 0.01
    r1, r2 = flat.split(2)  # views of one flat tensor, as FSDP hands them out
    del pe.r1, pe.r2
    pe.r1, pe.r2 = r1, r2
    positions = torch.arange(6)
    weights = torch.randn(2, 6, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    (pe.bias(positions, positions).double() * weights).sum().backward()
    assert torch.equal(flat.detach(), torch.tensor([0.003, 0.7, 0.004, 0.5]))  # forward wrote nothing
    # reference: the parameters clamped first, then used, in float64
    a = torch.tensor([0.01, 0.7], dtype=torch.float64, requires_grad=True)
    b = torch.tensor([0.01, 0.5], dtype=torch.float64, requires_grad=True)
    d = (positions[:, None] - positions[None, :]).double().abs()
    kernel = (lambda a, b: -a[:, None, None] * torch.log1p(b[:, None, None] * d)) if scheme == "kerple_log" \
        else (lambda a, b: -a[:, None, None] * d.pow(b[:, None, None]))
    (kernel(a, b) * weights).sum().backward()
    torch.testing.assert_close(flat.grad.double(), torch.cat([a.grad, b.grad]), atol=1e-5, rtol=1e-5)


def test_a_block_mask_first_built_under_inference_mode_is_a_normal_tensor():
    """Lightning's sanity validation runs under inference_mode; the cached BlockMask is reused by
    training, whose backward cannot save inference tensors."""
    flex = BACKENDS["flex"]
    flex._block_masks.clear()
    with torch.inference_mode():
        mask = flex.block_mask(48, 48, torch.device("cpu"))
    assert not mask.kv_num_blocks.is_inference() and not mask.kv_indices.is_inference()
    assert flex.block_mask(48, 48, torch.device("cpu")) is mask  # cached


# --------------------------------------------------------------------------------------
# packed documents on CUDA: flex's block-sparse document mask, not SDPA's dense one
# --------------------------------------------------------------------------------------


def documents_of(lengths: list[int], batch: int = 2) -> torch.Tensor:
    """(B, T) document ids of documents of these lengths, packed one after another."""
    return torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None].expand(batch, -1)


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
def test_document_masks_on_cuda_take_flex(precision):
    """Every scheme's ``auto`` route on CUDA with packed documents is flex (a BlockMask that
    skips blocks), where flex applies: not with attention dropout (flex has none; the route is
    then the one without documents). CPU routes and an explicit model.attention are unchanged."""
    dtype, cpu = DTYPES[precision], torch.device("cpu")
    for scheme in sorted(SCHEMES):
        for dropout in (0.0, 0.2):
            cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16, dropout=dropout)
            pe = SCHEMES[scheme](cfg)
            plain = resolve("auto", AttentionRequest(pe, CUDA, dtype, dropout, grad=True, queries=16)).name
            routed = resolve("auto", AttentionRequest(pe, CUDA, dtype, dropout, grad=True, queries=16,
                                                      documents=True)).name
            assert routed == ("flex" if not (dropout or pe.terms == "scores") else plain), (scheme, dropout, routed)
            for device, name in ((cpu, "auto"), (CUDA, "sdpa"), (CUDA, "math")):
                assert (resolve(name, AttentionRequest(pe, device, dtype, dropout, grad=True, queries=16,
                                                       documents=True)).name
                        == resolve(name, AttentionRequest(pe, device, dtype, dropout, grad=True, queries=16)).name)
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=1, n_head=2, n_embd=16)
    model = GPT(cfg, SCHEMES["rope"](cfg)).train()  # GPT.hidden hands the forward's batch and documents over
    assert model.attention(CUDA, dtype=dtype, queries=16, batch=2, documents=True).name == "flex"


@pytest.mark.parametrize("option", ["windows", "sinks"])
def test_windows_and_sinks_on_cuda_take_flex(option):
    """A model with a sliding window on some layer, or with attention sinks: ``auto`` on CUDA
    takes flex where it applies (its window BlockMask skips blocks, its LSE rescales for sinks;
    SDPA would need an explicit mask or an extra key), in bf16 and float32, and the route is the
    one without the option with dropout, on CPU and for a named backend."""
    cpu, given = torch.device("cpu"), {"windows": True} if option == "windows" else {"normaliser": "sink_learned"}
    for scheme in sorted(SCHEMES):
        for dropout in (0.0, 0.2):
            cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, dropout=dropout)
            pe = SCHEMES[scheme](cfg)
            for dtype in (torch.bfloat16, torch.float32):
                plain = resolve("auto", AttentionRequest(pe, CUDA, dtype, dropout, grad=True, queries=16)).name
                request = AttentionRequest(pe, CUDA, dtype, dropout, grad=True, queries=16, **given)
                routed = resolve("auto", request).name
                assert routed == ("flex" if not (dropout or pe.terms == "scores") else plain), (scheme, dropout, routed)
            for device, name in ((cpu, "auto"), (CUDA, "sdpa")):
                assert (resolve(name, AttentionRequest(pe, device, torch.bfloat16, dropout, grad=True, **given)).name
                        == resolve(name, AttentionRequest(pe, device, torch.bfloat16, dropout, grad=True)).name)
    model_options = {"window_pattern": [4, None]} if option == "windows" else {"sinks": "learned"}
    cfg = GPTConfig(vocab_size=32, block_size=16, n_layer=2, n_head=2, n_embd=16, **model_options)
    model = GPT(cfg, SCHEMES["rope"](cfg)).train()  # GPT.attention hands the model's windows and sinks over
    assert model.attention(CUDA, dtype=torch.bfloat16, queries=16, batch=2).name == "flex"
    assert model.attention(cpu, dtype=torch.bfloat16, queries=16, batch=2).name == "sdpa"


def test_document_masked_attention_on_the_cuda_route_skips_blocks(monkeypatch, scheme="t5"):
    """The CUDA route run on CPU (a spy on SDPA and on flex's BlockMask): no dense mask reaches
    SDPA, the key blocks flex visits fall as documents shrink (one document: causal's 3 of the
    2 x 2 blocks of 128; two: 2), and the output is the CPU route's (SDPA with the dense mask)."""
    import torch.nn.attention.flex_attention as fa

    calls, masks, real = sdpa_calls(monkeypatch), [], fa.flex_attention
    monkeypatch.setattr(fa, "flex_attention", lambda *a, **kw: masks.append(kw["block_mask"]) or real(*a, **kw))
    cfg = GPTConfig(vocab_size=32, block_size=256, n_layer=1, n_head=2, n_embd=16)
    torch.manual_seed(0)
    model = GPT(cfg, SCHEMES[scheme](cfg)).eval()
    backend = resolve("auto", AttentionRequest(model.pe, CUDA, torch.float32, 0.0, queries=256, documents=True))
    assert backend.name == "flex"
    x, positions = torch.randn(2, 256, cfg.n_embd), torch.arange(256)
    visited = []
    for lengths in ([256], [128, 128], [100, 28, 64, 64]):
        documents = documents_of(lengths)
        with torch.no_grad():
            terms = Terms(model.pe, positions, positions, q_documents=documents, k_documents=documents)
            ctx = layer_contexts(terms, backend)[0]
            y = model.blocks[0](x, ctx)
            assert not calls
            mask = masks.pop()
            visited.append(int(mask.kv_num_blocks.sum() + (0 if mask.full_kv_num_blocks is None
                                                             else mask.full_kv_num_blocks.sum())))
            ref_backend = model.attention(torch.device("cpu"), queries=256, batch=2, documents=True)
            ref = model.blocks[0](x, layer_contexts(terms, ref_backend)[0])
        torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
        calls.clear()
    assert visited == [2 * 3, 2 * 2, 2 * 2]  # per sequence: blocks with a pair of one document


# --------------------------------------------------------------------------------------
# a bias with attention dropout in bf16/fp16 on CUDA: math, refused when it does not fit
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_math_training_bytes_counts_what_math_keeps_for_the_backward(dropout):
    """The estimate's per-layer part against the (B, H, T, T) tensors the math backend actually
    saves for the backward (autograd's saved-tensor hooks, distinct storages)."""
    from model.attention import math_training_bytes

    B, H, T = 2, 3, 20
    saved = {}

    def pack(t):
        if t.shape[-2:] == (T, T) and t.numel() == B * H * T * T:
            saved[t.untyped_storage().data_ptr()] = t.numel() * t.element_size()
        return t

    q, k, v = (torch.randn(B, H, T, 8, requires_grad=True) for _ in range(3))
    mask = torch.zeros(T, T).masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        BACKENDS["math"](q, k, v, mask, dropout)
    mask_bytes = 4  # CPU's dropout keeps a float32 mask (CUDA's native_dropout a bool one: 1 byte)
    transient = math_training_bytes(B, H, T, T, 0, dropout, mask_bytes)  # the layer being computed
    assert sum(saved.values()) == math_training_bytes(B, H, T, T, 1, dropout, mask_bytes) - transient
    assert sum(saved.values()) == B * H * T * T * (4 + 4 + 4 if dropout else 4)  # probs, dropped probs, mask


def test_a_bias_with_dropout_in_bf16_on_cuda_is_refused_when_math_does_not_fit(monkeypatch):
    """Every scheme whose bf16/fp16 training route with model.dropout > 0 on CUDA is math (a
    bias with no exact route with dropout) is refused at resolve time, before any compute, with
    the estimate and the ways out, when math's tensors exceed the free memory; it runs where
    they fit. At gpt2 size (B 16, 12 heads, T 1024, 12 layers) with dropout: 16*12*1024^2*(9*12
    + 8) bytes = 21.75 GiB."""
    import model.attention as attention

    free = {"bytes": 8 * 2 ** 30}
    monkeypatch.setattr(attention, "free_device_bytes", lambda device: free["bytes"])
    cfg = GPTConfig(vocab_size=32, block_size=1024, n_layer=12, n_head=12, n_embd=48, dropout=0.1)
    refused = []
    for scheme in sorted(SCHEMES):
        if SCHEMES[scheme].terms == "scores":
            continue  # math in every dtype, dropout or not: tests/pe/test_cope.py
        pe = SCHEMES[scheme](cfg)
        for precision in ("bf16", "fp16"):
            shape = dict(queries=1024, batch=16, layers=12)
            if resolve("auto", AttentionRequest(pe, CUDA, DTYPES[precision], 0.1, grad=True)).name != "math":
                resolve("auto", AttentionRequest(pe, CUDA, DTYPES[precision], 0.1, grad=True, **shape))  # no math
                continue
            refused.append((scheme, precision))
            with pytest.raises(ValueError) as err:
                resolve("auto", AttentionRequest(pe, CUDA, DTYPES[precision], 0.1, grad=True, **shape))
            message = str(err.value)
            assert f"model.attention=auto with pe={scheme} resolves to math" in message
            assert "about 21.8 GiB for batch 16 x 12 heads x T=1024 x 12 layers, more than the 8.0 GiB free" in message
            assert "model.dropout=0" in message and "trainer.precision=32-true" in message
            # no check without autograd (evaluation), or where it fits, or for fp32 (SDPA)
            request = AttentionRequest(pe, CUDA, DTYPES[precision], 0.1, grad=False, **shape)
            assert resolve("auto", request).name == "math"
            free["bytes"] = 22 * 2 ** 30
            assert resolve("auto", replace(request, grad=True)).name == "math"
            free["bytes"] = 8 * 2 ** 30
            assert resolve("auto", AttentionRequest(pe, CUDA, torch.float32, 0.1, grad=True, **shape)).name != "math"
    assert ("t5", "bf16") in refused and ("fire", "fp16") in refused  # the routes of test_auto_on_cuda_...
    with pytest.raises(ValueError, match=r"model.attention=math, which keeps .* Ways out: .*another model.attention"):
        resolve("math", AttentionRequest(SCHEMES["rope"](cfg), CUDA, torch.bfloat16, 0.0, grad=True, queries=1024,
                                         batch=16, layers=12))
