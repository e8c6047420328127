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
import torch.nn.functional as F

from model.config import GPTConfig
from model.attention import BACKENDS as BACKEND_REGISTRY
from model.attention import attend
from model.attention.masks import attention_mask
from model.attention.sdpa_key import key_features
from model.generate import KVCache
from model.gpt import GPT
from model.positions import layer_contexts, position_context
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
    mask = attention_mask(model.pe, positions, positions, torch.float32)
    if model.pe.uses_bias:
        assert mask.shape == (1, cfg.n_head, T, T) and mask.dtype == torch.float32
    else:
        assert mask is None
    with torch.no_grad():
        y = attn(x, position_context(model.pe, positions, mask))
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
        mask = attention_mask(model.pe, positions, positions, dtype)
        if mask is not None:
            assert mask.dtype == torch.bfloat16
        y = attn(x, position_context(model.pe, positions, mask))
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
        y = attn(x, position_context(model.pe, positions, attention_mask(model.pe, positions, positions, torch.float32)))
    ref = naive_attention(attn, x, positions.tolist(), naive_spec(name, opts, cfg.n_head, cfg.head_dim))
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["alibi", "rope_alibi"])
def test_attention_mask_matches_naive(name):
    cfg, model, _ = build(name, {})
    positions = torch.arange(6) + 11
    mask = attention_mask(model.pe, positions, positions, torch.float32)
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
        mask = attention_mask(model.pe, positions, positions, torch.float32)
        with torch.no_grad():
            a = attn(x, position_context(model.pe, positions, mask))
            b = attn(x2, position_context(model.pe, positions, mask))
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


# --------------------------------------------------------------------------------------
# every attention backend == the naive float64 reference, for every registered scheme
# --------------------------------------------------------------------------------------

BACKENDS = sorted(BACKEND_REGISTRY)
BACKEND_SCHEMES = [(n, {}) for n in sorted(SCHEMES)] + [("rope_alibi", {"bias_heads": 2, "slope_multiplier": 0.5})]
BACKEND_IDS = [f"{n}-{'-'.join(f'{k}={v}' for k, v in o.items()) or 'default'}" for n, o in BACKEND_SCHEMES]
# schemes whose bias has parameters: CPU training runs them on the bias_grad backend
LEARNED_BIAS = {n for n, cls in SCHEMES.items()
                if (pe := cls(tiny_config())).uses_bias and any(True for _ in pe.parameters())}


def contexts(model, positions, k_positions=None, dtype=torch.float32, always_mask=False):
    """The per-layer position contexts of one forward, as ``GPT.hidden`` builds them."""
    backend = model.attention(positions.device, dtype=dtype)
    return layer_contexts(model.pe, len(model.blocks), positions, backend, k_positions, dtype=dtype,
                          always_mask=always_mask, nope_layers=model.nope_layers)
# per-sequence positions: packed documents (reset) and repeats
ROWS = [[0, 1, 2, 3, 4, 0, 1, 2, 3], [5, 5, 5, 2, 2, 7, 0, 0, 9]]


def set_learned_params(name, pe):
    """Fixed, non-trivial values for the learned biases (inside KERPLE's projection range)."""
    with torch.no_grad():
        if name in ("kerple_log", "kerple_power"):
            pe.r1.copy_(torch.tensor([0.3, 1.2, 0.05, 0.8]))
            pe.r2.copy_(torch.tensor([0.5, 0.02, 1.5, 0.9]))
        if name == "t5":
            torch.nn.init.normal_(pe.relative_attention_bias.weight, std=1.0)
        if name == "fire":
            pe.c.fill_(0.3)
            pe.threshold_multiplier.fill_(0.25)


def naive_t5_bucket(n: int, num_buckets: int, max_distance: int) -> int:
    n, exact = max(n, 0), num_buckets // 2
    if n < exact:
        return n
    return min(exact + math.floor(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)),
               num_buckets - 1)


def naive_bias64(name, opts, pe, params, qpos, kpos):
    """(H, Tq, Tk) float64 bias from the formulas in docs/design.md, with the scheme's
    parameters as float64 leaves ``params``; None for schemes without a bias."""
    H = 4
    out = torch.zeros(H, len(qpos), len(kpos), dtype=torch.float64)
    if name in ("alibi", "rope_alibi"):
        slopes = naive_spec(name, opts, H, 8)["slopes"]
        return torch.tensor([[[-slopes[h] * (i - j) for j in kpos] for i in qpos] for h in range(H)],
                            dtype=torch.float64)
    if name == "t5":
        table = params["relative_attention_bias.weight"]
        rows = [torch.stack([table[naive_t5_bucket(i - j, pe.num_buckets, pe.max_distance)] for j in kpos])
                for i in qpos]  # (Tq) x (Tk, H)
        return torch.stack(rows).permute(2, 0, 1)
    if name in ("kerple_log", "kerple_power"):
        d = torch.tensor([[abs(i - j) for j in kpos] for i in qpos], dtype=torch.float64)
        r1, r2 = params["r1"][:, None, None], params["r2"][:, None, None]
        return -r1 * torch.log(1 + r2 * d) if name == "kerple_log" else -r1 * d ** r2
    if name == "fire":
        c, L = params["c"], (params["threshold_multiplier"] * pe.init_threshold.double()).abs()
        psi = lambda x: torch.log(torch.abs(c * x) + 1)  # noqa: E731
        rows = []
        for i in qpos:
            norm = psi(torch.maximum(torch.tensor(float(i), dtype=torch.float64), L)) + pe.eps
            x = torch.stack([psi(torch.tensor(float(i - j), dtype=torch.float64)) / norm for j in kpos])[:, None]
            h = torch.relu(x @ params["mlp.0.weight"].T + params["mlp.0.bias"])
            rows.append(h @ params["mlp.2.weight"].T + params["mlp.2.bias"])  # (Tk, H)
        return torch.stack(rows).permute(2, 0, 1)
    return None if not out.any() else out


def naive_layer64(W, Wp, x64, rows, name, opts, pe, params, n_head=4):
    """One attention layer in float64 per sequence b at positions rows[b] (causal by order)."""
    spec = naive_spec(name, opts, n_head, 8) if name in ("alibi", "rope_alibi", "rope", "xpos") else \
        {"rotate": False, "slopes": None}
    outs = []
    B, T, C = x64.shape
    for b, pos in enumerate(rows):
        y = x64[b : b + 1] @ W.T
        q, k, v = (y[..., i * C : (i + 1) * C].view(1, T, n_head, C // n_head).transpose(1, 2) for i in range(3))
        if spec["rotate"]:
            q, k = naive_rotate(q, pos, spec, +1.0), naive_rotate(k, pos, spec, -1.0)
        bias = naive_bias64(name, opts, pe, params, pos, pos)
        outs.append(naive_softmax_attention(q, k, v, bias) @ Wp.T)
    return torch.cat(outs)


def backend_model(name, opts, backend, seed=0, **overrides):
    cfg, model, attn = build(name, opts, seed=seed, attention=backend, **overrides)
    set_learned_params(name, model.pe)
    return cfg, model, attn


def float64_leaves(module):
    return {n: p.detach().double().requires_grad_(True) for n, p in module.named_parameters()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, opts", BACKEND_SCHEMES, ids=BACKEND_IDS)
@pytest.mark.parametrize("pos", ["offset", "rows"])
def test_backend_layer_matches_naive_forward_and_gradients(backend, name, opts, pos):
    """One layer through ``layer_contexts`` (the model's per-forward position terms)
    with each backend, against float64 autograd on the formulas: output, and gradients of
    the input, the attention weights and the scheme's own parameters (flex: forward only,
    FlexAttention has no CPU backward)."""
    cfg, model, attn = backend_model(name, opts, backend, seed=7)
    rows = [list(range(37, 46))] * 2 if pos == "offset" else ROWS
    positions = torch.tensor(rows[0]) if pos == "offset" else torch.tensor(rows)
    x = torch.randn(2, 9, cfg.n_embd, requires_grad=True)
    weights = torch.randn(2, 9, cfg.n_embd, dtype=torch.float64)
    ctx = contexts(model, positions)[0]
    expected = backend if backend != "sdpa_key" or model.pe.key_only_slopes() is not None else "sdpa"
    if expected in ("sdpa", "bias_grad") and name in LEARNED_BIAS:  # CPU training: the learned-bias kernel
        expected = "bias_grad"
    elif expected == "bias_grad":  # no learned bias: plain SDPA
        expected = "sdpa"
    assert ctx.backend.name == expected
    grad = backend != "flex"
    with torch.set_grad_enabled(grad):
        y = attn(x, ctx)
    x64 = x.detach().double().requires_grad_(True)
    W, Wp = (attn.c_attn.weight.detach().double().requires_grad_(True),
             attn.c_proj.weight.detach().double().requires_grad_(True))
    params = float64_leaves(model.pe)
    ref = naive_layer64(W, Wp, x64, rows, name, opts, model.pe, params)
    torch.testing.assert_close(y.double(), ref, atol=1e-5, rtol=1e-5)
    if not grad:
        return
    (y.double() * weights).sum().backward()
    (ref * weights).sum().backward()
    pairs = [("x", x.grad, x64.grad), ("c_attn", attn.c_attn.weight.grad, W.grad),
             ("c_proj", attn.c_proj.weight.grad, Wp.grad)]
    pairs += [(n, p.grad, params[n].grad) for n, p in model.pe.named_parameters() if params[n].grad is not None]
    for n, got, want in pairs:
        scale = want.abs().max().item()
        if n == "mlp.2.bias" or scale == 0:  # FIRE's output bias shifts a whole row: softmax ignores
            assert got.abs().max() < 1e-5  # it; FIRE's threshold does nothing while every i > L
            continue
        assert scale > 1e-6, f"{n}: the check needs a non-zero gradient"
        torch.testing.assert_close(got.double(), want, atol=1e-5 * scale, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def naive_logits64(model, name, opts, idx, rows):
    """Whole-model logits in float64 (embeddings, blocks, final norm, tied head)."""
    cfg = model.config
    x = model.wte.weight.detach().double()[idx]
    for b, pos in enumerate(rows):
        if name == "learned":
            x[b] += model.pe.wpe.weight.detach().double()[pos]
        if name == "sinusoidal":
            d = cfg.n_embd
            for t, p in enumerate(pos):
                for k in range(d // 2):
                    a = p / 10000.0 ** (2.0 * k / d)
                    x[b, t, 2 * k] += math.sin(a) / math.sqrt(d)
                    x[b, t, 2 * k + 1] += math.cos(a) / math.sqrt(d)
    params = {n: p.detach().double() for n, p in model.pe.named_parameters()}
    for block in model.blocks:
        a = block.attn
        x = x + naive_layer64(a.c_attn.weight.detach().double(), a.c_proj.weight.detach().double(),
                              naive_layer_norm(x, block.ln_1), rows, name, opts, model.pe, params)
        h = naive_linear(block.mlp.c_fc, naive_layer_norm(x, block.ln_2))
        x = x + naive_linear(block.mlp.c_proj, naive_gelu(h))
    return (naive_layer_norm(x, model.ln_f) @ model.lm_head.weight.detach().double().T)[..., : cfg.vocab_size]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name, opts", BACKEND_SCHEMES, ids=BACKEND_IDS)
def test_backend_chunked_evaluation_and_cache_decoding_match_naive(backend, name, opts):
    """The whole model with each backend: query-chunked evaluation (chunks of 4 of 10
    tokens, per-sequence positions) and KV-cache decoding (5 tokens, then 1, then 4) against
    the float64 model."""
    cfg, model, _ = backend_model(name, opts, backend, seed=8)
    if name == "learned":
        with torch.no_grad():
            torch.nn.init.normal_(model.pe.wpe.weight, std=0.5)
    T = 10
    idx = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(9))
    targets = torch.randint(0, cfg.vocab_size, (2, T), generator=torch.Generator().manual_seed(10))
    rows = [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3], [3, 3, 3, 0, 9, 9, 1, 1, 12, 2]]
    ref = naive_logits64(model, name, opts, idx, rows)
    ref_nll = torch.logsumexp(ref, -1) - ref.gather(-1, targets[..., None])[..., 0]
    with torch.no_grad():
        nll = model.token_nll(idx, targets, positions=torch.tensor(rows), q_chunk=4)
        torch.testing.assert_close(nll.double(), ref_nll, atol=1e-5, rtol=1e-5)
        # cache decoding at the default positions 0..T-1
        ref = naive_logits64(model, name, opts, idx, [list(range(T))] * 2)
        kv = KVCache(len(model.blocks), torch.arange(T))
        h = torch.cat([model.hidden(idx[:, s:e], cache=kv) for s, e in ((0, 5), (5, 6), (6, T))], dim=1)
        torch.testing.assert_close(model.logits(h).double(), ref, atol=1e-5, rtol=1e-5)


def test_compiled_flex_keeps_its_kernel_past_dynamos_recompile_limit():
    """The CUDA flex path (compiled here on CPU, forward): every (batch, Tq, Tk) of an
    evaluation sweep gets its own kernel; past dynamo's recompile limit flex would run
    unfused, materialising the scores. Dynamo's limit is lowered to 2 so that 3 shapes
    cross it; each output against a float64 causal softmax with an ALiBi-like score_mod."""
    import warnings

    flex = BACKEND_REGISTRY["flex"]

    torch.manual_seed(0)
    slopes = torch.tensor([0.5, 0.25])
    with torch._dynamo.config.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for B, Tq, Tk in [(2, 128, 128), (1, 128, 256), (1, 256, 256)]:
            q, k, v = torch.randn(B, 2, Tq, 16), torch.randn(B, 2, Tk, 16), torch.randn(B, 2, Tk, 16)
            offset = Tk - Tq

            def score_mod(s, b, h, q_idx, kv_idx):
                return s - slopes[h] * (q_idx + offset - kv_idx)

            with torch.no_grad():
                out = flex.compiled(q, k, v, score_mod, flex.block_mask(Tq, Tk, q.device))
            i = torch.arange(Tq, dtype=torch.float64)[:, None] + offset
            j = torch.arange(Tk, dtype=torch.float64)[None]
            logits = q.double() @ k.double().transpose(-2, -1) / 4.0 - slopes.double()[:, None, None] * (i - j)
            ref = logits.masked_fill(j > i, float("-inf")).softmax(-1) @ v.double()
            torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    unfused = [str(w.message) for w in caught if "without torch.compile" in str(w.message)]
    assert not unfused, unfused


def test_flex_backend_refuses_a_bias_without_an_elementwise_form():
    cfg, model, _ = backend_model("alibi", {}, "flex")
    model.pe.bias_score = lambda: None
    with pytest.raises(ValueError, match="model.attention=flex: pe=alibi gives no elementwise bias"):
        contexts(model, torch.arange(4))


# --------------------------------------------------------------------------------------
# position terms in float32 at distances >= 4096 under bf16 autocast
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_position_terms_keep_float32_accuracy_at_long_distance(backend, dtype):
    """ALiBi at T = 4608: the last 48 queries against all 4608 keys (the cache/chunk form of
    the model's contexts) equal float64 softmax(q k^T/sqrt(d) - m (i - j)) v computed from
    the same q, k, v. Tolerance: bf16 compute (autocast) 2^-8 (|y| + sum_j p_j |v_j|), the
    rounding of the bf16 probabilities and output of a fused kernel; float32 compute 1e-5 of
    that. The old path, the mask cast to bf16 (a bias of -16 in steps of 0.125), fails both:
    v's first channel follows the sign of that rounding along the last query's row."""
    torch.manual_seed(11)
    H, hd, T, Tq = 2, 8, 4608, 48
    cfg = GPTConfig(vocab_size=11, block_size=T, n_layer=1, n_head=H, n_embd=H * hd, attention=backend)
    model = GPT(cfg, SCHEMES["alibi"](cfg))
    slopes = [2.0 ** -4, 2.0 ** -8]  # 2 heads: 2^(-8h/2); the flat one reaches -18 at distance 4607
    positions = torch.arange(T)
    i, j = positions[-Tq:, None].double(), positions[None, :].double()
    bias = torch.stack([-m * (i - j) for m in slopes])[None]  # (1, H, Tq, T) float64
    q = (torch.randn(1, H, Tq, hd) * 0.5 + 1.0).to(dtype)
    k = torch.randn(1, H, T, hd) * 0.5
    k[:, :, :512] += 6.0  # the first 512 keys (distances 4048..4607) match every query: q.k/sqrt(8) ~ 17
    k = k.to(dtype)  # so the flat head's mass sits where its bias is -16..-18 (bf16 steps of 0.125)
    v = torch.randn(1, H, T, hd)
    v[..., 0] = torch.sign(bias.bfloat16().double() - bias)[:, :, -1].float() + 0.5
    v = v.to(dtype)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        ctx = contexts(model, positions[-Tq:], positions, dtype=dtype, always_mask=True)[0]
        assert ctx.backend.name == ("sdpa" if backend == "bias_grad" else backend)  # alibi: no learned bias
        y = attend(q, k, v, ctx)
    scores = q.double() @ k.double().transpose(-2, -1) / math.sqrt(hd) + bias
    probs = torch.softmax(scores.masked_fill(j > i, -math.inf), -1)
    ref = probs @ v.double()
    tol = (2.0 ** -8 if dtype == torch.bfloat16 else 1e-5) * (ref.abs() + probs @ v.double().abs())
    err = (y.double() - ref).abs()
    assert y.dtype == dtype and (err <= tol).all(), f"max error {err.max():.3g}, {(err / tol).max():.3g}x the tolerance"
    if backend == "sdpa":  # the old behaviour: the same mask cast to bf16 fails this test
        assert ctx.state.dtype == torch.float32
        old = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.state.bfloat16().to(dtype))
        old_err = (old.double() - ref).abs()
        assert (old_err > tol).any(), f"bf16 mask: max error {old_err.max():.3g}, within tolerance"
        assert (old_err / tol).max() > 3 * (err / tol).max(), "not a clear margin"


# --------------------------------------------------------------------------------------
# backend choice and the scheme hooks it relies on
# --------------------------------------------------------------------------------------


def test_attention_config_is_checked():
    with pytest.raises(ValueError, match=r"model.attention must be .*'auto'.*'flex'.*got 'fast'"):
        tiny_config(attention="fast")
    with pytest.raises(ValueError, match="model.attention must be not flex when model.dropout > 0"):
        tiny_config(attention="flex", dropout=0.1)


@pytest.mark.parametrize("name, cpu, cuda", [
    ("rope", "sdpa", "sdpa"), ("nope", "sdpa", "sdpa"), ("alibi", "sdpa", "sdpa_key"),
    ("rope_alibi", "sdpa", "sdpa_key"), ("t5", "bias_grad", "flex"), ("fire", "bias_grad", "flex"),
])
def test_auto_backend(name, cpu, cuda):
    _, model, _ = build(name, {})
    assert model.attention_backend(torch.device("cpu")) == cpu  # the measured choice (docs/design.md)
    with torch.no_grad():  # no bias gradient wanted: SDPA's fused kernel with the float32 mask
        assert model.attention_backend(torch.device("cpu")) == "sdpa"
    assert model.attention_backend(torch.device("cuda")) == cuda
    assert model.attention_backend(torch.device("cpu"), "math") == "math"
    if cuda == "flex":  # training with dropout stays on SDPA (flex has no attention dropout)
        _, model, _ = build(name, {}, dropout=0.1)
        assert model.train().attention_backend(torch.device("cuda")) == "sdpa"


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_bias_hooks_agree_with_bias(name):
    """bias_score (flex's elementwise form) equals bias() everywhere; key_only_slopes, where
    given, are exactly the m of bias = -m (i - j)."""
    cfg, model, _ = backend_model(name, {}, "auto")
    pe = model.pe
    qp, kp = torch.tensor([0, 3, 9, 300, 4100]), torch.tensor([0, 1, 7, 290, 4100, 5])
    score = pe.bias_score()
    assert (score is None) == (not pe.uses_bias)
    if score is not None:
        full = pe.bias(qp, kp)
        heads = torch.arange(cfg.n_head)[:, None, None]
        torch.testing.assert_close(score(qp[None, :, None], kp[None, None, :], heads), full, atol=1e-5, rtol=1e-5)
    slopes = pe.key_only_slopes()
    if slopes is not None:
        d = (qp[:, None] - kp[None, :]).float()
        assert torch.equal(pe.bias(qp, kp), -slopes[:, None, None] * d)


def test_key_features_are_exact_pieces():
    """The bf16 pieces of the key-only term sum back to the float32 value exactly."""
    slopes = torch.tensor([2.0 ** -0.5, 2.0 ** -3.5, 0.3, 2.0 ** -8])
    positions = torch.tensor([0, 5, 17, 300, 4607, 65537])
    feats = key_features(slopes, positions, 8, torch.bfloat16)
    assert feats.dtype == torch.bfloat16 and feats.shape == (1, 4, 6, 3)
    term = slopes[:, None] * (positions - 65537).float()[None, :] * math.sqrt(8)
    assert torch.equal(feats.float().sum(-1)[0], term)
    assert torch.equal(key_features(slopes, positions, 8, torch.float32)[0, ..., 0], term)
