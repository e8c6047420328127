"""The block options (model.norm, model.mlp, model.qk_norm, model.n_kv_head) against float64
references written here from their definitions: RMSNorm, SwiGLU, a whole model with QK-norm and
grouped key/value heads (every backend), GQA against MHA, cached decoding, and bad values."""

from __future__ import annotations

import pytest
import torch

from model.attention import BACKENDS
from model.config import GPTConfig
from model.gpt import swiglu_hidden
from model.pe import SCHEMES
from tests.naive import leaf_params, naive_reference, naive_rotate, naive_softmax_attention, set_naive_params
from tests.tiny import decode_stepwise, tiny_config, tiny_gpt

LLAMA = dict(norm="rmsnorm", mlp="swiglu", qk_norm=True)
# a scheme each backend runs itself on CPU (not a fallback), and whether it runs under autograd
NATIVE = {"sdpa": ("rope", False), "math": ("rope", False), "flex": ("alibi", False),
          "sdpa_key": ("alibi", False), "bias_grad": ("t5", True)}


def w64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().double()


def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """RMSNorm: x / sqrt(mean(x^2) + 1e-6) * g, over the last dim."""
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w64(weight)


def linear(layer, x: torch.Tensor, rows: slice = slice(None)) -> torch.Tensor:
    """x W[rows]^T + b[rows] in float64."""
    y = x @ w64(layer.weight)[rows].T
    return y if layer.bias is None else y + w64(layer.bias)[rows]


def silu(z: torch.Tensor) -> torch.Tensor:
    return z / (1.0 + torch.exp(-z))


def swiglu(mlp, x: torch.Tensor) -> torch.Tensor:
    """W2(silu(W1 x) * W3 x), c_fc's rows being [W1; W3]."""
    hidden = mlp.c_proj.weight.shape[1]
    return linear(mlp.c_proj, silu(linear(mlp.c_fc, x, slice(0, hidden))) * linear(mlp.c_fc, x, slice(hidden, None)))


def split_heads(y: torch.Tensor, n: int, hd: int) -> torch.Tensor:
    """(B, T, n * hd) -> (B, n, T, hd), head h being dims [h hd, (h + 1) hd)."""
    return torch.stack([y[..., h * hd : (h + 1) * hd] for h in range(n)], dim=1)


def naive_logits(model, idx: torch.Tensor) -> torch.Tensor:
    """Float64 logits of a rmsnorm + swiglu + qk_norm model with n_kv_head key/value heads at
    positions 0..T-1; query head h attends with key/value head h // (n_head / n_kv_head)."""
    cfg, pe = model.config, model.pe
    H, hd, C = cfg.n_head, cfg.n_embd // cfg.n_head, cfg.n_embd
    G = H if cfg.n_kv_head is None else cfg.n_kv_head
    positions = list(range(idx.shape[1]))
    rotation = naive_reference("NAIVE_ROTATION", pe.name)({}, hd) if pe.uses_rotate else None
    bias = (naive_reference("NAIVE_BIAS", pe.name)(pe, leaf_params(pe), positions, positions, {})
            if pe.uses_bias else None)
    x = w64(model.wte.weight)[idx]
    for block in model.blocks:
        attn = block.attn
        y = linear(attn.c_attn, rms(x, block.ln_1.weight))
        q = split_heads(y[..., :C], H, hd)
        k, v = split_heads(y[..., C : C + G * hd], G, hd), split_heads(y[..., C + G * hd :], G, hd)
        q, k = rms(q, attn.q_norm.weight), rms(k, attn.k_norm.weight)
        if rotation is not None:
            q, k = naive_rotate(q, positions, rotation, +1.0), naive_rotate(k, positions, rotation, -1.0)
        k, v = (torch.stack([t[:, h * G // H] for h in range(H)], dim=1) for t in (k, v))
        x = x + linear(attn.c_proj, naive_softmax_attention(q, k, v, bias))
        x = x + swiglu(block.mlp, rms(x, block.ln_2.weight))
    return (rms(x, model.ln_f.weight) @ w64(model.lm_head.weight).T)[..., : cfg.vocab_size]


def llama_gpt(scheme="rope", seed=0, **overrides):
    """A tiny rmsnorm + swiglu + qk_norm GPT, with norm weights away from 1 and sharp attention."""
    model = tiny_gpt(scheme, seed, sharpen=0.3, **{**LLAMA, **overrides})
    set_naive_params(model.pe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or ".ln_" in name or name.startswith("ln_f"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def test_rmsnorm_is_its_formula_and_never_has_a_bias():
    model = tiny_gpt(norm="rmsnorm", bias=True)
    ln = model.blocks[0].ln_1
    assert [n for n, _ in ln.named_parameters()] == ["weight"]
    with torch.no_grad():
        ln.weight.copy_(torch.linspace(0.5, 1.5, 32))
    x = torch.randn(2, 5, 32) * 3
    torch.testing.assert_close(ln(x).double(), rms(x.double(), ln.weight), atol=1e-6, rtol=1e-6)
    assert tiny_gpt(bias=True).blocks[0].ln_1.bias is not None  # GPT-2's LayerNorm keeps its bias


@pytest.mark.parametrize("n_embd, hidden", [(32, 128), (128, 384), (384, 1024), (768, 2048)])
def test_swiglu_hidden_size_is_llamas_rule(n_embd, hidden):
    """floor(8d/3) rounded up to a multiple of 64 (d = 768: 2048, the GELU MLP's 8d^2 weights exactly)."""
    assert swiglu_hidden(n_embd) == hidden


@pytest.mark.parametrize("bias", [False, True])
def test_swiglu_is_its_formula(bias):
    mlp = tiny_gpt(mlp="swiglu", bias=bias).blocks[0].mlp
    assert mlp.c_fc.weight.shape == (2 * 128, 32) and mlp.c_proj.weight.shape == (32, 128)
    if bias:
        with torch.no_grad():
            mlp.c_fc.bias.normal_(std=0.5)
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(mlp(x).double(), swiglu(mlp, x.double()), atol=1e-6, rtol=1e-5)


def test_the_default_block_keeps_its_parameters_and_numbers():
    """GPT-2's block by default; n_kv_head = n_head is the same model (names, shapes, outputs)."""
    base, same = tiny_gpt(seed=3), tiny_gpt(seed=3, n_kv_head=4)
    shapes = {n: tuple(p.shape) for n, p in base.state_dict().items() if n.startswith("blocks.0.")}
    assert shapes == {"blocks.0.ln_1.weight": (32,), "blocks.0.attn.c_attn.weight": (96, 32),
                      "blocks.0.attn.c_proj.weight": (32, 32), "blocks.0.ln_2.weight": (32,),
                      "blocks.0.mlp.c_fc.weight": (128, 32), "blocks.0.mlp.c_proj.weight": (32, 128)}
    assert isinstance(base.ln_f, torch.nn.LayerNorm)
    idx = torch.randint(0, 37, (2, 9))
    assert torch.equal(base(idx)[0], same(idx)[0])


@pytest.mark.parametrize("n_kv_head", [1, 2, 4])
@pytest.mark.parametrize("scheme", ["rope", "alibi"])
def test_model_matches_its_float64_reference(scheme, n_kv_head):
    model = llama_gpt(scheme, n_kv_head=n_kv_head)
    assert model.blocks[0].attn.c_attn.weight.shape == (32 + 2 * n_kv_head * 8, 32)
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(idx)[0]
    torch.testing.assert_close(logits.double(), naive_logits(model, idx), atol=2e-5, rtol=1e-4)


def test_model_with_biases_matches_its_float64_reference():
    model = llama_gpt(n_kv_head=2, bias=True)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(std=0.1)
    idx = torch.randint(0, 37, (1, 9))
    with torch.no_grad():
        logits = model(idx)[0]
    torch.testing.assert_close(logits.double(), naive_logits(model, idx), atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_every_backend_matches_the_float64_reference(backend):
    """GQA + QK-norm on each backend, on the scheme that backend serves itself on CPU."""
    scheme, grad = NATIVE[backend]
    model = llama_gpt(scheme, n_kv_head=2, attention=backend)
    idx = torch.randint(0, 37, (2, 9), generator=torch.Generator().manual_seed(2))
    with torch.set_grad_enabled(grad):
        assert model.attention(idx.device).name == backend
        logits = model(idx)[0]
    torch.testing.assert_close(logits.double(), naive_logits(model, idx), atol=2e-5, rtol=1e-4)


def test_gqa_is_mha_with_each_kv_head_repeated_for_its_query_heads():
    gqa, mha = llama_gpt(n_kv_head=2, seed=4), llama_gpt(seed=5)
    state = {n: p.clone() for n, p in gqa.state_dict().items()}
    for i in range(len(gqa.blocks)):
        w = state[f"blocks.{i}.attn.c_attn.weight"]  # rows: q (4 heads), k (2 heads), v (2 heads), 8 dims each
        k, v = w[32:48].view(2, 8, 32), w[48:64].view(2, 8, 32)
        heads = [0, 0, 1, 1]  # query head h reads kv head h // 2
        k, v = k[heads].reshape(32, 32), v[heads].reshape(32, 32)
        state[f"blocks.{i}.attn.c_attn.weight"] = torch.cat((w[:32], k, v))
    mha.load_state_dict(state)
    idx = torch.randint(0, 37, (2, 9))
    with torch.no_grad():
        torch.testing.assert_close(mha(idx)[0], gqa(idx)[0], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_cached_decoding_keeps_only_kv_heads_and_equals_one_full_forward(name):
    model = llama_gpt(name, n_kv_head=2, vocab_size=41, block_size=32)
    steps, full, cache = decode_stepwise(model, 41)
    # 2 kv heads, not 4 (keys keep the rotation's dim: PoPE's are 2 hd wide)
    assert cache.layers[0].v.shape == (2, 2, 14, 8) and cache.layers[0].k.shape[:3] == (2, 2, 14)
    torch.testing.assert_close(steps, full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("overrides, message", [
    ({"norm": "batchnorm"}, "model.norm must be one of 'layernorm', 'rmsnorm', got 'batchnorm'"),
    ({"mlp": "relu"}, "model.mlp must be one of 'gelu', 'swiglu', got 'relu'"),
    ({"n_kv_head": 3}, "model.n_kv_head must be null or a divisor of model.n_head=4, got 3"),
    ({"n_kv_head": 0}, "model.n_kv_head must be null or a divisor of model.n_head=4, got 0"),
    ({"n_kv_head": 8}, "model.n_kv_head must be null or a divisor of model.n_head=4, got 8"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(").replace(")", r"\)") + "$"):
        tiny_config(**overrides)
    assert GPTConfig(vocab_size=5, n_head=4, n_kv_head=None).kv_heads == 4
