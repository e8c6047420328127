"""Attention with each position scheme against a naive float64 reference.

The reference recomputes q, k, v from the raw ``c_attn`` weights, applies each scheme's
definition in docs/design.md (rotation tables from ``math.cos``/``math.sin``, ALiBi slopes
typed in by hand, xPos decay from the zeta formula), then softmax(QK^T/sqrt(d) + bias +
causal mask) V with explicit masks, and ``c_proj``. It never calls ``pe.rotate``/``pe.bias``.
"""

from __future__ import annotations

import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES, PositionEncoding

torch.set_num_threads(2)

ALL_SCHEMES = ["learned", "sinusoidal", "rope", "alibi", "xpos", "rope_alibi"]

# (scheme, constructor options) pairs exercised by the reference comparison
VARIANTS = [
    ("learned", {}),
    ("sinusoidal", {}),
    ("sinusoidal", {"scale": 1.0}),
    ("rope", {}),
    ("rope", {"base": 300.0, "rotary_fraction": 0.5}),
    ("alibi", {}),
    ("xpos", {}),
    ("xpos", {"scale_base": 8.0}),  # strong decay so the xPos factor is visible in the output
    ("rope_alibi", {}),
    ("rope_alibi", {"bias_heads": 2, "slope_multiplier": 0.5}),
    ("nope", {}),  # no rotation, no bias: the causal mask only
    ("rope", {"learnable_freq": True}),  # alpha = 0 at init: exactly the plain RoPE reference
]
VARIANT_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in VARIANTS]

# Slopes typed in from docs/design.md: 4 heads -> 2^(-8h/4) = 2^-2, 2^-4, 2^-6, 2^-8.
SLOPES_4 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
SLOPES_2 = [2.0 ** -4, 2.0 ** -8]


def tiny_config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32)  # head dim 8
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


# --------------------------------------------------------------------------------------
# naive scheme definitions (float64)
# --------------------------------------------------------------------------------------


def naive_spec(name: str, opts: dict, n_head: int, head_dim: int) -> dict:
    """What the scheme does, from its definition: rotary dim/base/xPos params and slopes."""
    spec = {"rotate": name in ("rope", "xpos", "rope_alibi"), "xpos": name == "xpos", "slopes": None}
    frac = opts.get("rotary_fraction", 1.0)
    spec["r"] = int(head_dim * frac) // 2 * 2
    spec["base"] = opts.get("base", 10000.0)
    spec["B"] = opts.get("scale_base", 512.0)
    spec["gamma"] = opts.get("gamma", 0.4)
    if name == "alibi":
        assert n_head == 4
        spec["slopes"] = list(SLOPES_4)
    if name == "rope_alibi":
        assert n_head == 4
        nb = opts.get("bias_heads", None) or 4
        c = opts.get("slope_multiplier", 1.0)
        base_slopes = {4: SLOPES_4, 2: SLOPES_2}[nb]
        spec["slopes"] = [c * s for s in base_slopes] + [0.0] * (n_head - nb)
    return spec


def naive_rotate(x: torch.Tensor, positions: list[int], spec: dict, sign: float) -> torch.Tensor:
    """x (B, H, T, hd) float64. Half-split RoPE: pair k = (k, k + r/2), angle p * base^(-2k/r).

    For xPos both rotated components of pair k are multiplied by zeta_k^(sign * p / B).
    """
    r, half = spec["r"], spec["r"] // 2
    out = x.clone()
    for t, p in enumerate(positions):
        for k in range(half):
            a = p * spec["base"] ** (-2.0 * k / r)
            c, s = math.cos(a), math.sin(a)
            f = 1.0
            if spec["xpos"]:
                zeta = (2.0 * k / r + spec["gamma"]) / (1.0 + spec["gamma"])
                f = zeta ** (sign * p / spec["B"])
            x1, x2 = x[:, :, t, k], x[:, :, t, k + half]
            out[:, :, t, k] = f * (x1 * c - x2 * s)
            out[:, :, t, k + half] = f * (x2 * c + x1 * s)
    return out


def naive_bias(slopes: list[float], positions: list[int]) -> torch.Tensor:
    T = len(positions)
    bias = torch.zeros(len(slopes), T, T, dtype=torch.float64)
    for h, m in enumerate(slopes):
        for i in range(T):
            for j in range(T):
                bias[h, i, j] = -m * (positions[i] - positions[j])
    return bias


def naive_heads(attn, x64: torch.Tensor):
    """q, k, v (B, H, T, hd) float64 straight from c_attn's weights."""
    W = attn.c_attn.weight.detach().double()
    y = x64 @ W.T
    if attn.c_attn.bias is not None:
        y = y + attn.c_attn.bias.detach().double()
    B, T, _ = x64.shape
    H, hd = attn.n_head, attn.head_dim
    C = H * hd
    out = []
    for part in range(3):
        z = y[..., part * C : (part + 1) * C]
        heads = torch.empty(B, H, T, hd, dtype=torch.float64)
        for h in range(H):
            heads[:, h] = z[..., h * hd : (h + 1) * hd]
        out.append(heads)
    return out


def naive_softmax_attention(q, k, v, bias=None, causal=True) -> torch.Tensor:
    """(B, H, T, hd) float64 -> (B, T, H*hd), explicit scores, masks and softmax."""
    B, H, T, hd = q.shape
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(hd)
    if bias is not None:
        scores = scores + bias
    if causal:
        for i in range(T):
            for j in range(i + 1, T):
                scores[:, :, i, j] = -math.inf
    mx = scores.max(dim=-1, keepdim=True).values
    e = torch.exp(scores - mx)
    p = e / e.sum(dim=-1, keepdim=True)
    y = torch.einsum("bhij,bhjd->bhid", p, v)
    out = torch.empty(B, T, H * hd, dtype=torch.float64)
    for h in range(H):
        out[..., h * hd : (h + 1) * hd] = y[:, h]
    return out


def naive_linear(layer, x64):
    y = x64 @ layer.weight.detach().double().T
    if layer.bias is not None:
        y = y + layer.bias.detach().double()
    return y


def naive_attention(attn, x: torch.Tensor, positions: list[int], spec: dict) -> torch.Tensor:
    x64 = x.detach().double()
    q, k, v = naive_heads(attn, x64)
    if spec["rotate"]:
        q = naive_rotate(q, positions, spec, +1.0)
        k = naive_rotate(k, positions, spec, -1.0)
    bias = None if spec["slopes"] is None else naive_bias(spec["slopes"], positions)
    return naive_linear(attn.c_proj, naive_softmax_attention(q, k, v, bias))


def build(name, opts, seed=0, **cfg_overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(**cfg_overrides)
    pe = SCHEMES[name](cfg, **opts)
    model = GPT(cfg, pe).eval()
    # larger weights than GPT-2 init so attention is far from uniform and errors show
    attn = model.blocks[0].attn
    with torch.no_grad():
        torch.nn.init.normal_(attn.c_attn.weight, std=0.25)
        torch.nn.init.normal_(attn.c_proj.weight, std=0.2)
        if attn.c_attn.bias is not None:
            torch.nn.init.normal_(attn.c_attn.bias, std=0.1)
            torch.nn.init.normal_(attn.c_proj.bias, std=0.1)
    return cfg, model, attn


# --------------------------------------------------------------------------------------
# SDPA path == naive reference
# --------------------------------------------------------------------------------------


# Positions as the model sees them: from 0, offset (sliding windows, caches), and reset and
# repeated (packed documents). Causality is token order whatever the positions say.
POSITIONS = {
    "from0": list(range(9)),
    "offset37": list(range(37, 46)),
    "reset": [0, 1, 2, 3, 4, 0, 1, 2, 3],
    "repeat": [5, 5, 5, 2, 2, 7, 0, 0, 9],
}


@pytest.mark.parametrize("name, opts", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("pos", list(POSITIONS), ids=list(POSITIONS))
def test_attention_fp32_matches_naive(name, opts, pos):
    cfg, model, attn = build(name, opts)
    T = 9
    x = torch.randn(2, T, cfg.n_embd)
    positions = torch.tensor(POSITIONS[pos])
    mask = model.attention_mask(positions, positions, torch.float32)
    if model.pe.uses_bias:
        assert mask.shape == (1, cfg.n_head, T, T) and mask.dtype == torch.float32
    else:
        assert mask is None
    with torch.no_grad():
        y = attn(x, model.position_context(positions, mask))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    assert y.shape == x.shape and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name, opts", VARIANTS, ids=VARIANT_IDS)
def test_attention_bf16_autocast_matches_naive(name, opts):
    cfg, model, attn = build(name, opts, seed=1)
    T = 9
    x = torch.randn(2, T, cfg.n_embd)
    positions = torch.arange(T) + 300  # above 256: not representable in bf16
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        dtype = model._compute_dtype(x.device)
        assert dtype == torch.bfloat16
        mask = model.attention_mask(positions, positions, dtype)
        if mask is not None:
            assert mask.dtype == torch.bfloat16
        y = attn(x, model.position_context(positions, mask))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    scale = ref.abs().max().item()
    err = (y.double() - ref).abs().max().item()
    assert err < 2e-2 * scale, f"bf16 error {err:.3g} vs scale {scale:.3g}"


def test_attention_with_linear_biases_matches_naive():
    name, opts = "rope_alibi", {}
    cfg, model, attn = build(name, opts, seed=2, bias=True)
    assert attn.c_attn.bias is not None
    T = 7
    x = torch.randn(3, T, cfg.n_embd)
    positions = torch.arange(T) + 5
    with torch.no_grad():
        y = attn(x, model.position_context(positions, model.attention_mask(positions, positions, torch.float32)))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "rope_alibi"])
def test_attention_mask_matches_naive(name):
    cfg, model, _ = build(name, {})
    positions = torch.arange(6) + 11
    mask = model.attention_mask(positions, positions, torch.float32)
    ref = naive_bias(SLOPES_4, positions.tolist())
    assert mask.shape == (1, 4, 6, 6)
    for i in range(6):
        for j in range(6):
            if j > i:
                assert torch.all(mask[0, :, i, j] == -math.inf)
            else:
                torch.testing.assert_close(mask[0, :, i, j].double(), ref[:, i, j], atol=1e-6, rtol=0)


def test_causality_future_tokens_do_not_leak():
    for name in ALL_SCHEMES:
        cfg, model, attn = build(name, {}, seed=3)
        positions = torch.arange(8)
        x = torch.randn(1, 8, cfg.n_embd)
        x2 = x.clone()
        x2[:, 5:] = torch.randn(1, 3, cfg.n_embd)
        mask = model.attention_mask(positions, positions, torch.float32)
        with torch.no_grad():
            a = attn(x, model.position_context(positions, mask))
            b = attn(x2, model.position_context(positions, mask))
        torch.testing.assert_close(a[:, :5], b[:, :5], atol=1e-6, rtol=0)
        assert (a[:, 5:] - b[:, 5:]).abs().max() > 1e-3


# --------------------------------------------------------------------------------------
# permutation equivariance without position information, broken by each scheme
# --------------------------------------------------------------------------------------


def noncausal_attention_output(attn, pe, x, positions):
    """Non-causal attention through the scheme's hooks (embed -> qkv/rotate -> bias), float64."""
    if pe.uses_embed:
        x = pe.embed(x, positions)
    q, k, v = attn.c_attn(x).view(*x.shape[:2], 3, attn.n_head, attn.head_dim).permute(2, 0, 3, 1, 4)
    q, k = pe.rotate(q, k, positions, positions)  # the hook itself (identity for the bare base class)
    bias = pe.bias(positions, positions).double() if pe.uses_bias else None
    return naive_softmax_attention(q.double(), k.double(), v.double(), bias, causal=False)


def _perm_setup(seed=4):
    torch.manual_seed(seed)
    cfg = tiny_config()
    T = 7
    x = torch.randn(2, T, cfg.n_embd, dtype=torch.float64)
    perm = torch.tensor([3, 0, 6, 1, 5, 2, 4])
    return cfg, T, x, perm


def test_no_position_information_is_permutation_equivariant():
    cfg, T, x, perm = _perm_setup()
    pe = PositionEncoding(cfg)
    _, model, attn = build("rope", {}, seed=5)  # only its attention weights are used
    attn = attn.double()
    positions = torch.arange(T)
    out = noncausal_attention_output(attn, pe, x, positions)
    out_perm = noncausal_attention_output(attn, pe, x[:, perm], positions)
    torch.testing.assert_close(out_perm, out[:, perm], atol=1e-12, rtol=1e-12)
    # and the bare interface contributes nothing
    assert pe.bias(positions, positions) is None
    assert torch.equal(pe.embed(x, positions), x)
    q = torch.randn(1, 2, T, 8)
    rq, rk = pe.rotate(q, q, positions, positions)
    assert rq is q and rk is q
    assert pe.max_positions is None


@pytest.mark.parametrize("name", ALL_SCHEMES)
def test_each_scheme_breaks_permutation_equivariance(name):
    cfg, T, x, perm = _perm_setup()
    pe = SCHEMES[name](cfg).double()
    if name == "learned":
        with torch.no_grad():
            torch.nn.init.normal_(pe.wpe.weight, std=1.0)
    _, model, attn = build("rope", {}, seed=5)
    attn = attn.double()
    positions = torch.arange(T)
    out = noncausal_attention_output(attn, pe, x, positions)
    out_perm = noncausal_attention_output(attn, pe, x[:, perm], positions)
    assert (out_perm - out[:, perm]).abs().max().item() > 1e-3


# --------------------------------------------------------------------------------------
# whole model: GPT loss vs a fully naive forward
# --------------------------------------------------------------------------------------


def naive_layer_norm(x, ln):
    mu = x.mean(dim=-1, keepdim=True)
    var = ((x - mu) ** 2).mean(dim=-1, keepdim=True)
    y = (x - mu) / torch.sqrt(var + ln.eps)
    y = y * ln.weight.detach().double()
    if ln.bias is not None:
        y = y + ln.bias.detach().double()
    return y


def naive_gelu(x):
    return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


def naive_gpt(model, name, opts, idx, targets, positions: list[int]):
    cfg = model.config
    spec = naive_spec(name, opts, cfg.n_head, cfg.head_dim)
    W_tok = model.wte.weight.detach().double()
    x = W_tok[idx]
    if name == "learned":
        x = x + model.pe.wpe.weight.detach().double()[positions]
    if name == "sinusoidal":
        d = cfg.n_embd
        table = torch.zeros(len(positions), d, dtype=torch.float64)
        for t, p in enumerate(positions):
            for k in range(d // 2):
                a = p / 10000.0 ** (2.0 * k / d)
                table[t, 2 * k], table[t, 2 * k + 1] = math.sin(a), math.cos(a)
        scale = opts.get("scale")
        x = x + table * (1 / math.sqrt(d) if scale is None else scale)  # default: 1/sqrt(d_model)
    for block in model.blocks:
        x = x + naive_attention(block.attn, naive_layer_norm(x, block.ln_1), positions, spec)
        h = naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(h))
    logits = naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T
    logits = logits[..., : cfg.vocab_size]
    flat, tgt = logits.reshape(-1, cfg.vocab_size), targets.reshape(-1)
    losses = []
    for row, t in zip(flat, tgt.tolist()):
        if t == -1:
            continue
        mx = row.max()
        losses.append(mx + torch.log(torch.exp(row - mx).sum()) - row[t])
    return logits, torch.stack(losses).mean()


@pytest.mark.parametrize("name, opts", VARIANTS, ids=VARIANT_IDS)
def test_gpt_loss_matches_naive_forward(name, opts):
    cfg, model, _ = build(name, opts, seed=6, pad_vocab_multiple=8)
    if name == "learned":
        with torch.no_grad():
            torch.nn.init.normal_(model.pe.wpe.weight, std=0.5)
    B, T = 2, 10
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    targets[0, 3] = -1  # ignored
    offset = 0 if name == "learned" else 50
    positions = torch.arange(T) + offset
    with torch.no_grad():
        logits, loss = model(idx, targets, positions=positions if offset else None)
    ref_logits, ref_loss = naive_gpt(model, name, opts, idx, targets, positions.tolist())
    torch.testing.assert_close(logits.double(), ref_logits, atol=1e-5, rtol=1e-5)
    assert loss.item() == pytest.approx(ref_loss.item(), abs=1e-5)
