"""Float64 references written from the definitions in docs/design.md, section 3 (loops over
``math.cos``/``math.sin``, slopes typed in, explicit masks and softmax); none calls the code it checks.

Each formula is written once. The tables NAIVE_EMBED, NAIVE_ROTATION and NAIVE_BIAS hold, by
registered scheme name, the reference of each hook the scheme uses; ``naive_reference`` looks one
up and names the table to extend when a scheme has none (tests/pe/test_interface.py checks that
every registered scheme has one per hook)."""

from __future__ import annotations

import math

import torch

from model.pe import SCHEMES

# the schemes whose terms are functions of positions alone, which these references compute; a
# data-dependent one (FoX's gates read each layer's input) has its own float64 test (tests/pe/test_fox.py)
POSITION_SCHEMES = [name for name in sorted(SCHEMES) if SCHEMES[name].terms is None]


# --------------------------------------------------------------------------------------
# rotations: RoPE and xPos
# --------------------------------------------------------------------------------------


def naive_rope_vec(x, p: int, base: float = 10000.0, rotary_dim: int | None = None, scale=None):
    """Half-split RoPE of head vectors x (list or tensor, (..., d)) at integer position p.

    Pair k = (dims k, k + r/2), angle p * base^(-2k/r); dims >= r pass through. ``scale``
    (optional callable k -> factor) multiplies both rotated components of pair k (xPos).
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    r = x.shape[-1] if rotary_dim is None else rotary_dim
    half = r // 2
    out = x.clone()
    for k in range(half):
        theta = base ** (-2.0 * k / r)
        a = p * theta
        c, s = math.cos(a), math.sin(a)
        f = 1.0 if scale is None else scale(k)
        x1, x2 = x[..., k], x[..., k + half]
        out[..., k] = f * (x1 * c - x2 * s)
        out[..., k + half] = f * (x2 * c + x1 * s)
    return out


def naive_rope(x: torch.Tensor, positions, base=10000.0, rotary_dim=None) -> torch.Tensor:
    """x (..., T, d); rotate every vector at its position with naive_rope_vec."""
    x64 = x.detach().double()
    out = torch.empty_like(x64)
    for t, p in enumerate(positions):
        out[..., t, :] = naive_rope_vec(x64[..., t, :], int(p), base, rotary_dim)
    return out


def naive_rotate(x: torch.Tensor, positions: list[int], spec: dict, sign: float) -> torch.Tensor:
    """x (B, H, T, hd) float64, rotated as ``spec`` (a NAIVE_ROTATION entry) says.

    For xPos both rotated components of pair k are multiplied by zeta_k^(sign * p / B),
    zeta_k = (2k/r + gamma) / (1 + gamma). PoPE (``polar``) gives (B, H, T, 2 hd).
    """
    if spec.get("polar"):
        return torch.stack([naive_polar_vec(x[:, :, t], p, spec["base"], sign) for t, p in enumerate(positions)], 2)
    r, gamma = spec["r"], spec.get("gamma")
    out = x.clone()
    for t, p in enumerate(positions):
        scale = None
        if spec["xpos"]:
            scale = lambda k, p=p: ((2.0 * k / r + gamma) / (1.0 + gamma)) ** (sign * p / spec["B"])  # noqa: E731
        out[:, :, t] = naive_rope_vec(x[:, :, t], p, spec["base"], r, scale)
    return out


def naive_polar_vec(x, p: int, base: float, sign: float) -> torch.Tensor:
    """PoPE's polar form of head vectors x (..., d) at integer position p, offsets delta at their
    init 0: [m_c cos(p theta_c)]_c ++ [m_c sin(p theta_c)]_c, m_c = log(1 + e^x_c), theta_c = base^(-c/d).
    Queries (sign +1) carry sqrt 2, so that naive_softmax_attention's 1/sqrt(2d) is PoPE's 1/sqrt(d)."""
    x = torch.as_tensor(x, dtype=torch.float64)
    d = x.shape[-1]
    m = torch.log1p(torch.exp(x)) * (math.sqrt(2.0) if sign > 0 else 1.0)
    angles = [p * base ** (-c / d) for c in range(d)]
    cos = torch.tensor([math.cos(a) for a in angles], dtype=torch.float64)
    sin = torch.tensor([math.sin(a) for a in angles], dtype=torch.float64)
    return torch.cat((m * cos, m * sin), dim=-1)


def rope_rotation(opts: dict, head_dim: int) -> dict:
    """RoPE's rotary dims r (the even part of head_dim * rotary_fraction) and base."""
    r = int(head_dim * opts.get("rotary_fraction", 1.0)) // 2 * 2
    return {"r": r, "base": opts.get("base", 10000.0), "xpos": False}


def xpos_rotation(opts: dict, head_dim: int) -> dict:
    """RoPE plus xPos's per-pair decay: scale base B and gamma."""
    return {**rope_rotation(opts, head_dim), "xpos": True, "B": opts.get("scale_base", 512.0),
            "gamma": opts.get("gamma", 0.4)}


# --------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------


# Slopes typed in from docs/design.md: 4 heads -> 2^(-8h/4) = 2^-2, 2^-4, 2^-6, 2^-8.
SLOPES_4 = [2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8]
SLOPES_2 = [2.0 ** -4, 2.0 ** -8]


def naive_alibi_slopes(n_head: int, bias_heads: int | None = None, slope_multiplier: float = 1.0) -> list[float]:
    """The typed-in slopes of the first ``bias_heads`` heads times the multiplier; 0 for the rest."""
    nb = bias_heads or n_head
    assert nb in (2, 4), f"slopes are typed in for 2 or 4 biased heads, got {nb}"
    return [slope_multiplier * s for s in {4: SLOPES_4, 2: SLOPES_2}[nb]] + [0.0] * (n_head - nb)


def naive_alibi_bias(slopes: list[float], q_pos, k_pos) -> torch.Tensor:
    """(H, Tq, Tk) float64, bias[h, i, j] = -m_h (p_i - p_j)."""
    H, Tq, Tk = len(slopes), len(q_pos), len(k_pos)
    out = torch.zeros(H, Tq, Tk, dtype=torch.float64)
    for h in range(H):
        for a in range(Tq):
            for b in range(Tk):
                out[h, a, b] = -slopes[h] * (int(q_pos[a]) - int(k_pos[b]))
    return out


def naive_bias(slopes: list[float], positions: list[int]) -> torch.Tensor:
    """ALiBi's bias with queries and keys at the same positions."""
    return naive_alibi_bias(slopes, positions, positions)


# --------------------------------------------------------------------------------------
# absolute embeddings
# --------------------------------------------------------------------------------------


def naive_sinusoidal(positions, d: int, base: float = 10000.0) -> torch.Tensor:
    """(T, d) float64, PE(p, 2k) = sin(p / base^(2k/d)), PE(p, 2k+1) = cos(same)."""
    table = torch.zeros(len(positions), d, dtype=torch.float64)
    for t, p in enumerate(positions):
        for k in range(d // 2):
            a = p / base ** (2.0 * k / d)
            table[t, 2 * k], table[t, 2 * k + 1] = math.sin(a), math.cos(a)
    return table


def naive_sinusoidal_embedding(pe, p, positions, opts):
    """The table times ``scale``, by default 1/sqrt(d_model)."""
    d, scale = pe.n_embd, opts.get("scale")
    return naive_sinusoidal(positions, d, opts.get("base", 10000.0)) * (1 / math.sqrt(d) if scale is None else scale)


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


def set_kerple_params(pe):
    pe.r1.copy_(torch.tensor([0.3, 1.2, 0.05, 0.8]))  # inside KERPLE's projection range
    pe.r2.copy_(torch.tensor([0.5, 0.02, 1.5, 0.9]))


def set_fire_params(pe):
    pe.c.fill_(0.3)
    pe.threshold_multiplier.fill_(0.25)


# --------------------------------------------------------------------------------------
# the references of each scheme, by registered name
# --------------------------------------------------------------------------------------


# embed hook: (pe, float64 leaves p, positions, options) -> (T, n_embd), added to the token embeddings
NAIVE_EMBED = {
    "learned": lambda pe, p, positions, opts: p["wpe.weight"][list(positions)],
    "sinusoidal": naive_sinusoidal_embedding,
}

# rotate hook: (options, head_dim) -> the spec naive_rotate applies (rotary dims, base, xPos)
NAIVE_ROTATION = {
    "rope": rope_rotation,
    "xpos": xpos_rotation,
    "rope_alibi": rope_rotation,
    "pope": lambda opts, head_dim: {"polar": True, "base": opts.get("base", 10000.0), "r": head_dim, "xpos": False},
}

# ALiBi-style slopes: (options, n_head) -> slopes of bias = -m (i - j)
NAIVE_SLOPES = {
    "alibi": lambda opts, n_head: naive_alibi_slopes(n_head),
    "rope_alibi": lambda opts, n_head: naive_alibi_slopes(n_head, opts.get("bias_heads"),
                                                          opts.get("slope_multiplier", 1.0)),
}


def slope_bias(name):
    return lambda pe, p, qpos, kpos, opts: naive_alibi_bias(NAIVE_SLOPES[name](opts, pe.n_head), qpos, kpos)


# bias hook: (pe, float64 leaves p, q positions, k positions, options) -> (H, Tq, Tk)
NAIVE_BIAS = {
    "alibi": slope_bias("alibi"),
    "rope_alibi": slope_bias("rope_alibi"),
    "t5": lambda pe, p, qpos, kpos, opts: naive_t5_bias(p["relative_attention_bias.weight"], qpos, kpos,
                                                        pe.num_buckets, pe.max_distance),
    "kerple_log": lambda pe, p, qpos, kpos, opts: naive_kerple_bias("kerple_log", p["r1"], p["r2"], qpos, kpos),
    "kerple_power": lambda pe, p, qpos, kpos, opts: naive_kerple_bias("kerple_power", p["r1"], p["r2"], qpos, kpos),
    "fire": lambda pe, p, qpos, kpos, opts: naive_fire_bias(p, qpos, kpos, pe.eps),
}

# learned parameters set to fixed, non-trivial values (in place, under no_grad) before a check,
# so no term of the formula sits at a degenerate initial value; optional per scheme
NAIVE_PARAMS = {
    "t5": lambda pe: torch.nn.init.normal_(pe.relative_attention_bias.weight, std=1.0),
    "kerple_log": set_kerple_params,
    "kerple_power": set_kerple_params,
    "fire": set_fire_params,
}

# FIRE divides the distance by a function of the query's own position, max(i, L): not relative-only
READS_QUERY_POSITION = {"fire"}

# which table holds the reference of each hook
HOOK_TABLES = {"uses_embed": "NAIVE_EMBED", "uses_rotate": "NAIVE_ROTATION", "uses_bias": "NAIVE_BIAS"}


def naive_reference(table: str, name: str):
    """The entry of pe=``name`` in the table named ``table`` (e.g. "NAIVE_BIAS")."""
    entries = globals()[table]
    if name not in entries:
        raise LookupError(f"no float64 reference for pe={name}: add one to tests/naive.py {table}")
    return entries[name]


def set_naive_params(pe) -> None:
    """The scheme's learned parameters at their NAIVE_PARAMS values (none listed: left as built)."""
    with torch.no_grad():
        NAIVE_PARAMS.get(pe.name, lambda pe: None)(pe)


def naive_scheme_bias(name, pe, p, qpos, kpos, opts=None):
    """(H, Tq, Tk) float64 bias of pe=``name`` from its NAIVE_BIAS formula; p: leaf_params(pe)."""
    return naive_reference("NAIVE_BIAS", name)(pe, p, qpos, kpos, opts or {})


def naive_spec(name: str, opts: dict, n_head: int, head_dim: int) -> dict:
    """What naive_attention needs of a scheme: its rotation (if any) and ALiBi slopes (or None)."""
    spec = {"rotate": name in NAIVE_ROTATION, "xpos": False, "slopes": None}
    if name in NAIVE_ROTATION:
        spec.update(NAIVE_ROTATION[name](opts, head_dim))
    if name in NAIVE_SLOPES:
        spec["slopes"] = NAIVE_SLOPES[name](opts, n_head)
    return spec


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
    """(B, H, T, hd) float64 -> (B, T, H*hd), explicit scores, masks and softmax; q and k may
    have another dim than v (PoPE's 2 hd), the scale is q's."""
    B, H, T, hd = v.shape
    scores = torch.einsum("bhid,bhjd->bhij", q, k) / math.sqrt(q.shape[-1])
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
