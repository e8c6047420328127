"""NoPE, T5, KERPLE (log, power), FIRE and the RoPE options (p-RoPE, learned frequencies)
against naive float64 references written from the definitions (loops, ``math``), hand
values and the reference implementations' constants; never through the scheme code.

Every learned scheme is checked for: its bias, a full attention output through the
model's attention (SDPA with the float mask) and the gradients of its parameters, each
against a float64 reference evaluated with autograd; its parameters' range after an
optimizer step that pushes them out of it; and a few steps of a real LitGPT fit.
"""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from model.config import GPTConfig
from model.gpt import GPT
from model.lit import LitGPT
from model.pe import SCHEMES

torch.set_num_threads(2)

NEW = ["nope", "t5", "kerple_log", "kerple_power", "fire"]
LEARNED = ["t5", "kerple_log", "kerple_power", "fire"]

# Positions as the model may see them: from 0, offset past the training length (FIRE's
# max(i, L) switches branch), and reset / repeated (a visible key can have a larger position).
POSITIONS = {
    "from0": list(range(9)),
    "offset": list(range(37, 46)),
    "reset": [0, 1, 2, 3, 4, 0, 1, 2, 3],
    "repeat": [5, 5, 5, 2, 2, 7, 0, 0, 9],
    "far": [0, 3, 17, 40, 129, 300, 301, 1000, 5000],
}


def config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32)  # head dim 8
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def build(name: str, seed: int = 0, cfg: GPTConfig | None = None, **opts):
    torch.manual_seed(seed)
    cfg = cfg or config()
    model = GPT(cfg, SCHEMES[name](cfg, **opts)).eval()
    attn = model.blocks[0].attn
    with torch.no_grad():  # sharper attention than GPT-2 init, so errors show
        torch.nn.init.normal_(attn.c_attn.weight, std=0.25)
        torch.nn.init.normal_(attn.c_proj.weight, std=0.2)
    return cfg, model, attn


# --------------------------------------------------------------------------------------
# naive float64 references
# --------------------------------------------------------------------------------------


def naive_attention(attn, x, bias=None, rotate=None):
    """c_proj(softmax(q k^T / sqrt(d) + bias, key j > query i masked by index) v), float64.

    ``bias`` (H, T, T) float64 or None; ``rotate(t, vec) -> vec`` rotates q and k at token t."""
    x64 = x.detach().double()
    B, T, C = x64.shape
    H = attn.n_head
    hd = C // H
    y = x64 @ attn.c_attn.weight.detach().double().T
    q, k, v = (y[..., n * C:(n + 1) * C].reshape(B, T, H, hd) for n in range(3))
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
    c, threshold = p["c"], torch.abs(p["threshold_multiplier"] * p["init_threshold"])
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


def naive_rope_pair(x, pos, thetas):
    """Half-split rotation of one head vector by pos * thetas[k] (float64 tensors)."""
    half = len(thetas)
    out = list(x)
    for k in range(half):
        a = pos * thetas[k]
        c, s = torch.cos(a), torch.sin(a)
        out[k] = x[k] * c - x[k + half] * s
        out[k + half] = x[k + half] * c + x[k] * s
    return torch.stack(out)


def prope_thetas(r: int, keep: int, base: float = 10000.0, alpha=None):
    """theta_k = base^(-2k/r) (times exp(alpha_k)) for k < keep, 0 for the removed lowest."""
    out = []
    for k in range(r // 2):
        t = torch.tensor(base ** (-2.0 * k / r), dtype=torch.float64)
        if alpha is not None:
            t = t * torch.exp(alpha[k])
        out.append(t if k < keep else torch.zeros((), dtype=torch.float64))
    return out


# --------------------------------------------------------------------------------------
# every new scheme: registry, defaults, yaml, causality-relevant contract
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, flags", [
    ("nope", (False, False, False)),
])
def test_registered_with_hooks_and_bench_style_construction(name, flags, project_root):
    cfg = config()
    pe = SCHEMES[name](cfg)  # scripts/bench.py: defaults only
    assert pe.name == name and (pe.uses_embed, pe.uses_rotate, pe.uses_bias) == flags
    assert pe.max_positions is None
    assert (project_root / "conf" / "pe" / f"{name}.yaml").exists()
    cls = SCHEMES[name]
    lit = LitGPT(model=dict(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32),
                 pe={"_target_": f"{cls.__module__}.{cls.__name__}"}, optim={})
    logits, loss = lit(torch.randint(0, 31, (2, 12)), torch.randint(0, 31, (2, 12)))
    assert logits.shape == (2, 12, 31) and torch.isfinite(loss)


@pytest.mark.parametrize("name", [n for n in LEARNED if n in SCHEMES])
def test_gpt_init_leaves_the_scheme_parameters_alone(name):
    cfg = config()
    torch.manual_seed(3)
    pe = SCHEMES[name](cfg)
    before = {n: t.detach().clone() for n, t in pe.named_parameters()}
    GPT(cfg, pe)
    for n, t in pe.named_parameters():
        assert torch.equal(t, before[n]), n


# --------------------------------------------------------------------------------------
# nope
# --------------------------------------------------------------------------------------


def test_nope_is_the_causal_mask_only():
    cfg, model, attn = build("nope")
    assert sum(p.numel() for p in model.pe.parameters()) == 0
    positions = torch.arange(9)
    assert model.attention_mask(positions, positions, torch.float32) is None  # SDPA is_causal
    x = torch.randn(2, 9, cfg.n_embd)
    with torch.no_grad():
        y = attn(x, model.pe, positions, None)
        # positions carry nothing: any position values give the same output
        y_far = attn(x, model.pe, torch.tensor(POSITIONS["far"]), None)
    torch.testing.assert_close(y.double(), naive_attention(attn, x), atol=1e-5, rtol=1e-5)
    assert torch.equal(y, y_far)


def test_nope_last_token_ignores_the_order_of_earlier_tokens():
    """No position information: in one layer the last token attends to every token's
    embedding, so its logits see the earlier tokens as a set (in deeper layers the earlier
    tokens' own prefixes change with the order). RoPE is the control."""
    idx = torch.tensor([[3, 17, 5, 29, 11, 8, 21]])
    perm = torch.tensor([[29, 5, 3, 11, 17, 8, 21]])  # the first six permuted, the last kept
    outs = {}
    for name in ("nope", "rope"):
        torch.manual_seed(0)
        cfg = config(n_layer=1)
        model = GPT(cfg, SCHEMES[name](cfg)).eval()
        with torch.no_grad():
            torch.nn.init.normal_(model.blocks[0].attn.c_attn.weight, std=0.5)
            outs[name] = (model(idx)[0][0, -1], model(perm)[0][0, -1])
    torch.testing.assert_close(outs["nope"][0], outs["nope"][1], atol=1e-5, rtol=0)
    assert (outs["rope"][0] - outs["rope"][1]).abs().max() > 1e-3
