"""Float64 references written from the definitions in docs/design.md, section 3 (loops over
``math.cos``/``math.sin``, slopes typed in, explicit masks and softmax); none calls the code it checks."""

from __future__ import annotations

import itertools
import math

import torch


# --------------------------------------------------------------------------------------
# rotations and ALiBi
# --------------------------------------------------------------------------------------


def naive_rope_vec(x, p: int, base: float = 10000.0, rotary_dim: int | None = None, scale=None):
    """Half-split RoPE of one head vector x (list/1-d tensor) at integer position p.

    Pair k = (dims k, k + r/2), angle p * base^(-2k/r); dims >= r pass through. ``scale``
    (optional callable k -> factor) multiplies both rotated components of pair k (xPos).
    """
    x = [float(v) for v in x]
    d = len(x)
    r = d if rotary_dim is None else rotary_dim
    half = r // 2
    out = list(x)
    for k in range(half):
        theta = base ** (-2.0 * k / r)
        a = p * theta
        c, s = math.cos(a), math.sin(a)
        f = 1.0 if scale is None else scale(k)
        x1, x2 = x[k], x[k + half]
        out[k] = f * (x1 * c - x2 * s)
        out[k + half] = f * (x2 * c + x1 * s)
    return torch.tensor(out, dtype=torch.float64)


def naive_rope(x: torch.Tensor, positions, base=10000.0, rotary_dim=None) -> torch.Tensor:
    """x (..., T, d); rotate every vector at its position with naive_rope_vec."""
    x64 = x.detach().double()
    out = torch.empty_like(x64)
    for idx in itertools.product(*[range(n) for n in x64.shape[:-2]]):
        for t, p in enumerate(positions):
            out[idx + (t,)] = naive_rope_vec(x64[idx + (t,)], int(p), base, rotary_dim)
    return out


def naive_alibi_bias(slopes: list[float], q_pos, k_pos) -> torch.Tensor:
    H, Tq, Tk = len(slopes), len(q_pos), len(k_pos)
    out = torch.zeros(H, Tq, Tk, dtype=torch.float64)
    for h in range(H):
        for a in range(Tq):
            for b in range(Tk):
                out[h, a, b] = -slopes[h] * (int(q_pos[a]) - int(k_pos[b]))
    return out


# --------------------------------------------------------------------------------------
# learned biases: T5, KERPLE, FIRE
# --------------------------------------------------------------------------------------


def naive_t5_bucket(n: int, num_buckets: int = 32, max_distance: int = 128) -> int:
    """T5's unidirectional bucket of distance n = i - j, from its definition."""
    n = max(n, 0)
    exact = num_buckets // 2
    if n < exact:
        return n
    return min(exact + int(math.log(n / exact) / math.log(max_distance / exact) * (num_buckets - exact)),
               num_buckets - 1)


def naive_t5_bias(table, qpos, kpos, num_buckets=32, max_distance=128):
    """table (num_buckets, H) float64 -> (H, Tq, Tk), bias[h, i, j] = table[bucket(p_i - p_j), h]."""
    H = table.shape[1]
    return torch.stack([torch.stack([torch.stack([table[naive_t5_bucket(pi - pj, num_buckets, max_distance), h]
                                                  for pj in kpos]) for pi in qpos]) for h in range(H)])


def naive_kerple_bias(kind, r1, r2, qpos, kpos):
    """-r1 log(1 + r2 |i - j|) or -r1 |i - j|^r2 per head, r1, r2 (H,) float64."""
    def one(h, d):
        if kind == "kerple_log":
            return -r1[h] * torch.log(1 + r2[h] * d)
        return -r1[h] * d ** r2[h] if d > 0 else torch.zeros((), dtype=torch.float64)  # 0^r2 = 0

    return torch.stack([torch.stack([torch.stack([one(h, float(abs(pi - pj))) for pj in kpos]) for pi in qpos])
                        for h in range(len(r1))])


def naive_fire_bias(p, qpos, kpos, eps=1e-6):
    """MLP(log(|c (i - j)| + 1) / (log(|c max(i, |m L0|)| + 1) + eps)) per (i, j); p: float64 params."""
    c, threshold = p["c"].reshape(()), torch.abs(p["threshold_multiplier"].reshape(()) * p["init_threshold"])
    W1, b1, W2, b2 = p["mlp.0.weight"], p["mlp.0.bias"], p["mlp.2.weight"], p["mlp.2.bias"]
    H = W2.shape[0]
    out = [[[None] * len(kpos) for _ in qpos] for _ in range(H)]
    for a, pi in enumerate(qpos):
        norm = torch.log(torch.abs(c * torch.maximum(torch.tensor(float(pi), dtype=torch.float64), threshold)) + 1)
        for b, pj in enumerate(kpos):
            u = torch.log(torch.abs(c * (pi - pj)) + 1) / (norm + eps)
            hidden = torch.relu(W1[:, 0] * u + b1)
            f = W2 @ hidden + b2
            for h in range(H):
                out[h][a][b] = f[h]
    return torch.stack([torch.stack([torch.stack(row) for row in head]) for head in out])


def leaf_params(pe):
    """float64 leaf copies of the scheme's parameters and buffers, by name."""
    p = {n: t.detach().double().clone().requires_grad_(True) for n, t in pe.named_parameters()}
    p.update({n: t.detach().double() for n, t in pe.named_buffers() if t is not None})
    return p


def naive_scheme_bias(name, pe, p, qpos, kpos):
    if name == "t5":
        return naive_t5_bias(p["relative_attention_bias.weight"], qpos, kpos, pe.num_buckets, pe.max_distance)
    if name in ("kerple_log", "kerple_power"):
        return naive_kerple_bias(name, p["r1"], p["r2"], qpos, kpos)
    if name == "fire":
        return naive_fire_bias(p, qpos, kpos, pe.eps)
    raise AssertionError(name)


# --------------------------------------------------------------------------------------
# attention layers
# --------------------------------------------------------------------------------------


def naive_qkv(attn, x):
    """float64 q, k, v, each (B, T, H, head dim), of an attention layer's input projection."""
    x64 = x.detach().double()
    B, T, C = x64.shape
    y = x64 @ attn.c_attn.weight.detach().double().T
    return tuple(y[..., n * C:(n + 1) * C].reshape(B, T, attn.n_head, C // attn.n_head) for n in range(3))


def naive_attention_loops(attn, x, bias=None, rotate=None):
    """c_proj(softmax(q k^T / sqrt(d) + bias, key j > query i masked by index) v), float64.

    ``bias`` (H, T, T) float64 or None; ``rotate(t, vec) -> vec`` rotates q and k at token t."""
    q, k, v = naive_qkv(attn, x)
    B, T, H, hd = q.shape
    C = H * hd
    out = torch.zeros(B, T, H, hd, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            qs = [q[b, t, h] if rotate is None else rotate(t, q[b, t, h]) for t in range(T)]
            ks = [k[b, t, h] if rotate is None else rotate(t, k[b, t, h]) for t in range(T)]
            for i in range(T):
                scores = torch.stack([torch.dot(qs[i], ks[j]) / math.sqrt(hd)
                                      + (0.0 if bias is None else bias[h, i, j]) for j in range(i + 1)])
                w = torch.exp(scores - scores.max())
                w = w / w.sum()
                out[b, i, h] = sum(w[j] * v[b, j, h] for j in range(i + 1))
    return out.reshape(B, T, C) @ attn.c_proj.weight.detach().double().T


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
