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
from model.attention.masks import attention_mask
from model.gpt import GPT
from model.positions import position_context
from model.lit import LitGPT
from model.pe import SCHEMES
from model.pe.base import distance_bias

torch.set_num_threads(2)

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


@pytest.mark.parametrize("name, flags", [  # every new scheme
    ("nope", (False, False, False)),
    ("t5", (False, False, True)),
    ("kerple_log", (False, False, True)),
    ("kerple_power", (False, False, True)),
    ("fire", (False, False, True)),
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


@pytest.mark.parametrize("name", LEARNED)
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
    assert attention_mask(model.pe, positions, positions, torch.float32) is None  # SDPA is_causal
    x = torch.randn(2, 9, cfg.n_embd)
    with torch.no_grad():
        y = attn(x, position_context(model.pe, positions, None))
        # positions carry nothing: any position values give the same output
        y_far = attn(x, position_context(model.pe, torch.tensor(POSITIONS["far"]), None))
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


# --------------------------------------------------------------------------------------
# learned biases: bias, attention output and gradients against float64 references
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("pos", list(POSITIONS))
@pytest.mark.parametrize("name", LEARNED)
def test_bias_matches_naive(name, pos):
    cfg, model, _ = build(name)
    pe = model.pe
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    bias = pe.bias(p, p)
    assert bias.shape == (cfg.n_head, 9, 9) and bias.dtype == torch.float32
    ref = naive_scheme_bias(name, pe, leaf_params(pe), positions, positions).detach()
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)
    # rectangular (query chunk / cache): the last 3 queries against all 9 keys
    torch.testing.assert_close(pe.bias(p[-3:], p), bias[:, -3:], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("pos", ["from0", "reset", "far"])
@pytest.mark.parametrize("name", LEARNED)
def test_attention_output_matches_naive(name, pos):
    cfg, model, attn = build(name, seed=1)
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    x = torch.randn(2, len(positions), cfg.n_embd)
    mask = attention_mask(model.pe, p, p, torch.float32)
    assert mask.shape == (1, cfg.n_head, 9, 9)
    with torch.no_grad():
        y = attn(x, position_context(model.pe, p, mask))
    bias = naive_scheme_bias(name, model.pe, leaf_params(model.pe), positions, positions).detach()
    torch.testing.assert_close(y.double(), naive_attention(attn, x, bias), atol=1e-5, rtol=1e-5)


# FIRE "window": every query below the threshold L = 32 (a training window), where the bias
# is computed per distance; the default positions cross L (per (i, j) pair)
@pytest.mark.parametrize("name, window", [(n, False) for n in LEARNED] + [("fire", True)])
def test_gradients_reach_parameters_and_match_naive(name, window):
    """d loss / d param through the model's attention (SDPA, float32) equals autograd on the
    naive float64 formula, for a loss that weights every output differently."""
    cfg, model, attn = build(name, seed=2)
    if name == "t5":  # distances 0..290 hit exact, log-spaced and clipped buckets
        positions = [0, 1, 2, 5, 17, 20, 40, 90, 290]
    elif window:
        positions = [0, 1, 2, 5, 9, 14, 20, 27, 31]
    else:
        positions = POSITIONS["far"][:7] + [41, 42]
    p = torch.tensor(positions)
    x = torch.randn(2, len(positions), cfg.n_embd)
    weights = torch.randn(2, len(positions), cfg.n_embd, dtype=torch.float64)
    y = attn(x, position_context(model.pe, p, attention_mask(model.pe, p, p, torch.float32)))
    (y.double() * weights).sum().backward()
    leaves = leaf_params(model.pe)
    bias = naive_scheme_bias(name, model.pe, leaves, positions, positions)
    (naive_attention(attn, x, bias) * weights).sum().backward()
    for n, param in model.pe.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), n
        ref = leaves[n].grad
        if n == "mlp.2.bias":  # FIRE's output bias shifts a whole row per head: softmax ignores it
            assert param.grad.abs().max() < 1e-5 and ref.abs().max() < 1e-12  # float32 rounding only
            continue
        assert ref.abs().max() > 1e-6, f"{n}: the check needs a non-zero gradient"
        # in the window every hidden unit sees all of a row's distances and its bias gradient
        # nearly cancels (dS rows sum to zero), leaving float32 rounding of ~1e-6 of the largest
        scale = (1e-5 if window else 1e-6) * ref.abs().max().item()
        torch.testing.assert_close(param.grad.double(), ref, atol=scale, rtol=1e-3,
                                   msg=lambda m: f"{name}.{n}: {m}")


# the bias's own gradient for query/key positions the model passes: a training window and
# a query chunk of it (distance_bias's Toeplitz layout; FIRE's window needs positions < 32),
# reset positions (its gather) and far ones (per pair)
BIAS_GRAD_POSITIONS = {
    "window": (list(range(30)), list(range(30))),
    "chunk": (list(range(21, 30)), list(range(30))),
    "reset": (POSITIONS["reset"], POSITIONS["reset"]),
    "far": (POSITIONS["far"], POSITIONS["far"]),
}


@pytest.mark.parametrize("pos", list(BIAS_GRAD_POSITIONS))
@pytest.mark.parametrize("name", LEARNED)
def test_bias_and_its_gradients_match_naive(name, pos):
    qpos, kpos = BIAS_GRAD_POSITIONS[pos]
    _, model, _ = build(name, seed=3)
    pe = model.pe
    bias = pe.bias(torch.tensor(qpos), torch.tensor(kpos))
    weights = torch.randn(bias.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    (bias.double() * weights).sum().backward()
    leaves = leaf_params(pe)
    ref_bias = naive_scheme_bias(name, pe, leaves, qpos, kpos)
    torch.testing.assert_close(bias.detach().double(), ref_bias.detach(), atol=1e-5, rtol=1e-5)
    (ref_bias * weights).sum().backward()
    for n, param in pe.named_parameters():
        ref = leaves[n].grad
        assert ref.abs().max() > 1e-6, f"{n}: the check needs a non-zero gradient"
        torch.testing.assert_close(param.grad.double(), ref, atol=1e-5 * ref.abs().max().item(), rtol=1e-4,
                                   msg=lambda m: f"{name}.{n}: {m}")


@pytest.mark.parametrize("qpos, kpos, evaluated", [
    (list(range(8)), list(range(8)), 15),  # a window: Tq + Tk - 1 distances
    (list(range(5, 8)), list(range(8)), 10),  # its last 3 queries
    (list(range(40, 44)), list(range(3, 10)), 10),  # queries far after the keys
    ([0, 1, 2, 0, 1, 2], [0, 1, 2, 0, 1, 2], 5),  # reset positions: the range -2..2, gathered
    ([[0, 1, 2, 3], [2, 3, 4, 5]], [[0, 1, 2, 3], [4, 5, 6, 7]], 9),  # per-sequence positions: -3..3 and -5..1
    ([0, 9, 40], [0, 9, 40], 9),  # sparse: fewer pairs (9) than distances (81), per pair
])
def test_distance_bias_equals_its_definition(qpos, kpos, evaluated):
    """bias[..., h, i, j] = values[p_i - p_j, h] by loops, value and gradient, from a table
    indexed by distance; and the values are evaluated once per distance (or per pair)."""
    table = torch.randn(101, 3, dtype=torch.float64, requires_grad=True)  # distances -50..50
    seen = []

    def values_of(d):
        seen.append(d.numel())
        return table[d + 50]

    qp, kp = torch.tensor(qpos), torch.tensor(kpos)
    got = distance_bias(values_of, qp, kp)
    qb, kb = (qp, kp) if qp.dim() == 2 else (qp[None], kp[None])
    ref = torch.stack([torch.stack([torch.stack([torch.stack([table[int(i - j) + 50, h] for j in kb[b]])
                                                 for i in qb[b]]) for h in range(3)]) for b in range(len(qb))])
    ref = ref if qp.dim() == 2 else ref[0]
    assert got.shape == ref.shape and seen == [evaluated]
    assert torch.equal(got, ref)
    weights = torch.randn(ref.shape, dtype=torch.float64)
    grad, = torch.autograd.grad((got * weights).sum(), table)
    ref_grad, = torch.autograd.grad((ref * weights).sum(), table)
    torch.testing.assert_close(grad, ref_grad, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", LEARNED)
def test_bias_is_float32_under_bf16_autocast(name):
    _, model, _ = build(name)
    p = torch.tensor(POSITIONS["far"])
    ref = model.pe.bias(p, p)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = model.pe.bias(p, p)
        mask = attention_mask(model.pe, p, p, torch.bfloat16)
    assert got.dtype == torch.float32 and mask.dtype == torch.bfloat16
    torch.testing.assert_close(got, ref, atol=0, rtol=0)


@pytest.mark.parametrize("name", LEARNED)
def test_trains_in_a_lightning_fit(name):
    """A few bf16-mixed steps of the real LitGPT fit: finite loss, every scheme parameter in
    the no-decay group and moved by the optimizer."""
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    cls = SCHEMES[name]
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32),
                    pe={"_target_": f"{cls.__module__}.{cls.__name__}"},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2})
    before = {n: t.detach().clone() for n, t in module.model.pe.named_parameters()}
    losses = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            losses.append(outputs["loss"].item())

    trainer = L.Trainer(max_steps=6, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        gradient_clip_val=1.0, limit_val_batches=0, callbacks=[Record()])
    trainer.fit(module, train_dataloaders=loader)
    assert len(losses) == 6 and all(math.isfinite(v) for v in losses)
    _, no_decay = trainer.optimizers[0].param_groups
    assert no_decay["weight_decay"] == 0.0
    no_decay_ids = {id(t) for t in no_decay["params"]}
    for n, t in module.model.pe.named_parameters():
        assert id(t) in no_decay_ids, n
        assert not torch.equal(t.detach(), before[n]), f"{n} did not move"


# --------------------------------------------------------------------------------------
# t5
# --------------------------------------------------------------------------------------


def test_t5_bucket_hand_values():
    """num_buckets 32 -> 16 exact buckets; n >= 16: 16 + floor(16 ln(n/16) / ln(128/16)),
    at most 31. ln 8 = 2.0794."""
    from model.pe import t5_bucket

    expected = {
        0: 0, 1: 1, 15: 15,  # exact
        16: 16,  # 16 ln(1) / ln 8 = 0
        17: 16,  # 16 * 0.0606 / 2.0794 = 0.466
        20: 17,  # 16 * 0.2231 / 2.0794 = 1.717
        22: 18,  # 16 * 0.3185 / 2.0794 = 2.450
        31: 21,  # 16 * 0.6614 / 2.0794 = 5.089
        32: 21,  # 16 * ln 2 / ln 8 = 16/3 = 5.333
        45: 23,  # 16 * 1.0341 / 2.0794 = 7.957
        63: 26,  # 16 * 1.3706 / 2.0794 = 10.546
        64: 26,  # 16 * ln 4 / ln 8 = 32/3 = 10.667
        90: 29,  # 16 * 1.7272 / 2.0794 = 13.290
        100: 30,  # 16 * 1.8326 / 2.0794 = 14.101
        127: 31,  # 16 * 2.0716 / 2.0794 = 15.940
        128: 31,  # 16 + 16 = 32, clipped to 31
        1000: 31, 10**6: 31,  # clipped
        -1: 0, -50: 0,  # unidirectional: n = max(i - j, 0)
    }
    got = t5_bucket(torch.tensor(list(expected)))
    assert got.dtype == torch.int64
    assert dict(zip(expected, got.tolist())) == expected
    # num_buckets 8, max_distance 20: 4 exact; n >= 4: 4 + floor(4 ln(n/4) / ln 5), ln 5 = 1.6094
    small = {3: 3, 4: 4, 5: 4, 6: 5, 9: 6, 13: 6, 14: 7, 19: 7, 20: 7, 500: 7}
    # 5: 4*.2231/1.6094 = .555; 6: 4*.4055/1.6094 = 1.008; 9: 4*.8109/1.6094 = 2.015;
    # 13: 4*1.1787/1.6094 = 2.929; 14: 4*1.2528/1.6094 = 3.114; 20: 4 -> 8, clipped to 7
    got = t5_bucket(torch.tensor(list(small)), num_buckets=8, max_distance=20)
    assert dict(zip(small, got.tolist())) == small


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (8, 20), (64, 1000), (33, 100)])
def test_t5_bucket_matches_naive_definition(num_buckets, max_distance):
    from model.pe import t5_bucket

    n = torch.arange(-5, 3000)
    got = t5_bucket(n, num_buckets, max_distance).tolist()
    ref = [naive_t5_bucket(v, num_buckets, max_distance) for v in n.tolist()]
    assert got == ref
    assert set(got) == set(range(num_buckets))  # every bucket is reachable


def test_t5_table_init_is_t5x_fan_avg_uniform():
    """t5x: variance_scaling(1.0, 'fan_avg', 'uniform') on (heads, buckets): U(-a, a),
    a = sqrt(3 / ((heads + buckets) / 2)); 16 heads, 32 buckets -> a = sqrt(1/8) = 0.3536."""
    torch.manual_seed(0)
    pe = SCHEMES["t5"](config(n_head=16, n_embd=64))
    table = pe.relative_attention_bias.weight
    assert table.shape == (32, 16)
    a = math.sqrt(1 / 8)
    assert table.abs().max().item() <= a
    assert table.abs().max().item() > 0.95 * a
    assert table.std().item() == pytest.approx(a / math.sqrt(3), rel=0.1)  # uniform: std a/sqrt(3)


def test_t5_bias_hand_values_and_options():
    pe = SCHEMES["t5"](config(), num_buckets=8, max_distance=20)
    with torch.no_grad():  # table[b, h] = 10 b + h, so the bias names its bucket
        pe.relative_attention_bias.weight.copy_(10 * torch.arange(8.0)[:, None] + torch.arange(4.0))
    qpos, kpos = torch.tensor([30, 2]), torch.tensor([0, 10, 24, 25, 26, 29, 30])
    bias = pe.bias(qpos, kpos)
    # query 30: distances 30, 20, 6, 5, 4, 1, 0 -> buckets 7, 7, 5, 4, 4, 1, 0
    assert bias[2, 0].tolist() == [72, 72, 52, 42, 42, 12, 2]
    # query 2: distances 2, -8, ... -> 2 then bucket 0 for every negative distance
    assert bias[3, 1].tolist() == [23, 3, 3, 3, 3, 3, 3]
    with pytest.raises(ValueError):
        SCHEMES["t5"](config(), num_buckets=32, max_distance=16)


# --------------------------------------------------------------------------------------
# kerple
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name, r1_high, r2_high", [("kerple_log", 2.0, 1.0), ("kerple_power", 1.0, 2.0)])
def test_kerple_init_is_the_references_uniform(name, r1_high, r2_high):
    """Reference: log bias_p (r1) = rand * 2, bias_a (r2) = rand * 1; power bias_a (r1) =
    rand * 1, bias_p (r2) = rand * 2, one value per head."""
    torch.manual_seed(0)
    pe = SCHEMES[name](config(n_head=64, n_embd=128))
    for param, high in ((pe.r1, r1_high), (pe.r2, r2_high)):
        assert param.shape == (64,)
        assert param.min().item() > 0 and param.max().item() < high
        assert param.max().item() > 0.8 * high and param.min().item() < 0.2 * high  # spread over (0, high)
    assert pe.eps == 0.01


def test_kerple_hand_values():
    log = SCHEMES["kerple_log"](config())
    power = SCHEMES["kerple_power"](config())
    with torch.no_grad():
        log.r1.copy_(torch.tensor([0.5, 1.0, 2.0, 1.5]))
        log.r2.copy_(torch.tensor([2.0, 0.5, 1.0, 0.25]))
        power.r1.copy_(torch.tensor([0.5, 1.0, 0.25, 2.0]))
        power.r2.copy_(torch.tensor([1.5, 1.0, 2.0, 0.5]))
    qpos, kpos = torch.tensor([10]), torch.tensor([7, 10, 6, 14])  # |i - j| = 3, 0, 4, 4
    b = log.bias(qpos, kpos)[:, 0]
    assert b[0, 0].item() == pytest.approx(-0.5 * math.log(7))  # -0.5 ln(1 + 2*3) = -0.97296
    assert b[1, 2].item() == pytest.approx(-1.0 * math.log(3))  # -ln(1 + 0.5*4)
    assert b[3, 3].item() == pytest.approx(-1.5 * math.log(2))  # key after the query in position: |-4|
    assert torch.all(b[:, 1] == 0)  # distance 0
    b = power.bias(qpos, kpos)[:, 0]
    assert b[0, 2].item() == pytest.approx(-4.0)  # -0.5 * 4^1.5 = -0.5 * 8
    assert b[2, 0].item() == pytest.approx(-2.25)  # -0.25 * 3^2
    assert b[3, 0].item() == pytest.approx(-2 * math.sqrt(3))  # -2 * 3^0.5
    assert torch.all(b[:, 1] == 0)


@pytest.mark.parametrize("name", ["kerple_log", "kerple_power"])
def test_kerple_parameters_are_projected_back_into_range(name):
    """A step that drives r1, r2 negative (and the power exponent above 2): the next forward
    uses them clamped to [0.01, inf) (r2 of power: [0.01, 2]), as the reference, ``project()``
    after the step writes them clamped, and the
    bias is the kernel at the clamped values. The gradient is the plain one at the clamped
    value, so a later step can move a parameter back up (it is not stuck at the bound)."""
    torch.manual_seed(4)
    pe = SCHEMES[name](config())
    opt = torch.optim.SGD(pe.parameters(), lr=10.0)
    with torch.no_grad():
        pe.r2[3] = 1.9
    push = torch.tensor([1.0, 1.0, 1.0, -1.0])  # heads 0-2 down, head 3 up (past 2 for power's r2)
    (pe.r1 * push).sum().add((pe.r2 * push).sum()).backward()
    opt.step()
    assert (pe.r1[:3] < 0).all() and (pe.r2[:3] < 0).all()  # the optimizer did leave the range
    positions = torch.tensor([0, 1, 2, 3, 5, 8, 13, 40])
    unprojected = pe.bias(positions, positions)  # forward uses the clamped values, writes nothing
    assert (pe.r1[:3] < 0).all() and (pe.r2[:3] < 0).all()
    pe.project()  # after every optimizer step (pelab's LightningModule)
    bias = pe.bias(positions, positions)
    assert torch.equal(bias, unprojected)
    assert (pe.r1 >= 0.01).all() and (pe.r2 >= 0.01).all()
    assert torch.all(pe.r1[:3] == 0.01) and torch.all(pe.r2[:3] == 0.01)
    if name == "kerple_power":
        assert pe.r2[3].item() == 2.0
    r1, r2 = pe.r1.detach().double(), pe.r2.detach().double()
    ref = naive_kerple_bias(name, r1, r2, positions.tolist(), positions.tolist())
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)
    assert torch.isfinite(bias).all()
    # back up: minimising sum(bias) asks for a stronger penalty, i.e. larger r1 and r2
    opt.zero_grad()
    pe.bias(positions, positions).sum().backward()
    assert (pe.r1.grad[:3] < 0).all() and (pe.r2.grad[:3] < 0).all()  # a clamp inside autograd gives 0
    opt.step()
    assert (pe.r1[:3] > 0.01).all() and (pe.r2[:3] > 0.01).all()


# --------------------------------------------------------------------------------------
# fire
# --------------------------------------------------------------------------------------


def test_fire_init_is_the_references():
    """c = 0.1, threshold multiplier 1 times L0 = model.block_size, PyTorch's default Linear
    init (U(-1/sqrt(fan_in), 1/sqrt(fan_in))) for the 1 -> 32 -> heads MLP."""
    torch.manual_seed(0)
    pe = SCHEMES["fire"](config(block_size=48, n_head=16, n_embd=64))
    assert pe.c.item() == pytest.approx(0.1) and pe.threshold_multiplier.item() == 1.0
    assert pe.init_threshold.item() == 48.0 and pe.threshold.item() == 48.0
    assert not pe.init_threshold.requires_grad and "init_threshold" in pe.state_dict()  # fixed, saved
    first, second = pe.mlp[0], pe.mlp[2]
    assert (first.in_features, first.out_features, second.out_features) == (1, 32, 16)
    assert isinstance(pe.mlp[1], torch.nn.ReLU)
    for layer, bound in ((first, 1.0), (second, 1 / math.sqrt(32))):
        for t in (layer.weight, layer.bias):
            assert t.abs().max().item() <= bound and t.abs().max().item() > 0.8 * bound
    assert SCHEMES["fire"](config(), init_threshold=100.0).threshold.item() == 100.0


def test_fire_hand_values():
    """A 1 -> 1 -> heads MLP with unit weights and zero biases returns the normalised
    distance itself: log(|c (i - j)| + 1) / (log(|c max(i, L)| + 1) + eps)."""
    pe = SCHEMES["fire"](config(block_size=32), mlp_width=1)
    with torch.no_grad():
        for layer in (pe.mlp[0], pe.mlp[2]):
            layer.weight.fill_(1.0)
            layer.bias.zero_()
    qpos, kpos = torch.tensor([10, 50]), torch.tensor([0, 10, 40, 50])
    b = pe.bias(qpos, kpos)
    assert b.shape == (4, 2, 4) and torch.equal(b[0], b[3])
    # i = 10 < L = 32: normaliser ln(0.1 * 32 + 1) = ln 4.2 = 1.435085
    assert b[0, 0, 0].item() == pytest.approx(math.log(2) / (math.log(4.2) + 1e-6), rel=1e-6)  # 0.482998
    assert b[0, 0, 1].item() == 0.0
    assert b[0, 0, 2].item() == pytest.approx(math.log(4) / math.log(4.2), rel=1e-5)  # |10 - 40| = 30
    # i = 50 > L: normaliser ln(0.1 * 50 + 1) = ln 6
    assert b[0, 1, 0].item() == pytest.approx(1.0, rel=1e-5)  # psi(50) / psi(50)
    assert b[0, 1, 1].item() == pytest.approx(math.log(5) / math.log(6), rel=1e-5)  # 0.898244
    with torch.no_grad():  # the threshold moves with its multiplier: L = 2 * 32 = 64 > 50
        pe.threshold_multiplier.fill_(2.0)
    b = pe.bias(qpos, kpos)
    assert b[0, 1, 1].item() == pytest.approx(math.log(5) / math.log(7.4), rel=1e-5)  # ln(0.1*64+1)


def test_fire_sign_of_c_and_threshold_does_nothing():
    """The reference takes |c x| and |m L0|: a step that drives c and the multiplier negative
    leaves the bias that of their absolute values (the effective c and L stay positive)."""
    torch.manual_seed(5)
    pe = SCHEMES["fire"](config())
    positions = torch.tensor(POSITIONS["far"])
    opt = torch.optim.SGD([pe.c, pe.threshold_multiplier], lr=1.0)
    (pe.c * 0.3 + pe.threshold_multiplier * 3.0).backward()  # c: 0.1 -> -0.2, m: 1 -> -2
    opt.step()
    assert pe.c.item() == pytest.approx(-0.2) and pe.threshold_multiplier.item() == pytest.approx(-2.0)
    bias = pe.bias(positions, positions)
    assert torch.isfinite(bias).all() and pe.threshold.item() == pytest.approx(64.0)
    p = leaf_params(pe)
    p["c"], p["threshold_multiplier"] = p["c"].detach().abs(), p["threshold_multiplier"].detach().abs()
    ref = naive_fire_bias(p, positions.tolist(), positions.tolist()).detach()
    torch.testing.assert_close(bias.double(), ref, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------------------
# rope options: keep_fraction (p-RoPE) and learnable_freq
# --------------------------------------------------------------------------------------


def rope_config(**overrides) -> GPTConfig:
    return config(**{"n_embd": 64, "n_head": 4, **overrides})  # head dim 16: 8 pairs


def test_rope_defaults_are_plain_rope_exactly():
    torch.manual_seed(6)
    cfg = rope_config()
    plain = SCHEMES["rope"](cfg)
    assert plain.keep is None and plain.log_freq_scale is None
    assert list(plain.parameters()) == [] and plain.state_dict() == {}  # checkpoints unchanged
    learnable = SCHEMES["rope"](cfg, keep_fraction=1.0, learnable_freq=True)
    assert [n for n, _ in learnable.named_parameters()] == ["log_freq_scale"]
    assert torch.equal(learnable.log_freq_scale, torch.zeros(8))
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 4, 6, 16)
    pos = torch.tensor([0, 1, 7, 300, 4000, 4001])
    for a, b in zip(plain.rotate(q, k, pos, pos), learnable.rotate(q, k, pos, pos)):
        assert torch.equal(a, b)  # exp(0) = 1: bit for bit


@pytest.mark.parametrize("keep_fraction, rotary_fraction, kept", [
    (0.5, 1.0, 4), (0.75, 1.0, 6), (0.3, 1.0, 2), (0.125, 1.0, 1), (0.5, 0.5, 2),
])
def test_prope_rotates_only_the_highest_frequencies(keep_fraction, rotary_fraction, kept):
    """Pairs k < floor(p * r/2) rotate by p_t * base^(-2k/r) (the full-RoPE frequencies);
    the lower-frequency pairs (dims k and k + r/2) and dims past r pass through bit for bit."""
    torch.manual_seed(7)
    pe = SCHEMES["rope"](rope_config(), keep_fraction=keep_fraction, rotary_fraction=rotary_fraction)
    r = int(16 * rotary_fraction)
    assert pe.kept_pairs == kept
    positions = [0, 1, 5, 77, 255]
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    rq, rk = pe.rotate(q, k, torch.tensor(positions), torch.tensor(positions))
    thetas = prope_thetas(r, kept)
    for x, rx in ((q, rq), (k, rk)):
        for h in range(2):
            for t, p in enumerate(positions):
                x64 = x[0, h, t].double()
                ref = torch.cat([naive_rope_pair(x64[:r], torch.tensor(float(p), dtype=torch.float64), thetas), x64[r:]])
                torch.testing.assert_close(rx[0, h, t].double(), ref, atol=1e-5, rtol=0)
    passthrough = [d for d in range(16) if not (d < kept or r // 2 <= d < r // 2 + kept)]
    assert torch.equal(rq[..., passthrough], q[..., passthrough])
    assert (rq[0, :, 1:, :kept] - q[0, :, 1:, :kept]).abs().amax(-1).min() > 1e-4  # kept pairs do rotate


def test_prope_keeps_the_rope_frequencies_unlike_rotary_fraction():
    """keep_fraction 0.5 of head dim 16: theta_k = 10000^(-2k/16) for k < 4, then 0; partial
    rotary (rotary_fraction 0.5) instead spreads 10000^(-2k/8) over 4 pairs."""
    prope = SCHEMES["rope"](rope_config(), keep_fraction=0.5).frequencies(torch.tensor([0])).inv_freq
    expected = [10000 ** (-2 * k / 16) if k < 4 else 0.0 for k in range(8)]  # 1, 0.316, 0.1, 0.0316
    torch.testing.assert_close(prope.double(), torch.tensor(expected, dtype=torch.float64), atol=0, rtol=1e-6)
    partial = SCHEMES["rope"](rope_config(), rotary_fraction=0.5).frequencies(torch.tensor([0])).inv_freq
    torch.testing.assert_close(partial.double(), torch.tensor([1.0, 0.1, 0.01, 0.001], dtype=torch.float64),
                               atol=0, rtol=1e-6)


def test_rope_option_validation():
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=0.0)
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=1.5)
    with pytest.raises(ValueError, match="keep_fraction"):
        SCHEMES["rope"](rope_config(), keep_fraction=0.1)  # floor(0.8) = 0 of 8 pairs
    # 0.29 * 100 = 28.999999999999996 in binary: still 29 pairs
    assert SCHEMES["rope"](config(n_embd=200, n_head=1), keep_fraction=0.29).kept_pairs == 29


@pytest.mark.parametrize("pos", ["from0", "reset", "far"])
def test_rope_options_attention_matches_naive(pos):
    cfg, model, attn = build("rope", seed=8, keep_fraction=0.5, learnable_freq=True)  # head dim 8: 2 of 4 pairs
    alpha = torch.tensor([0.3, -0.7, 0.5, 0.2])
    with torch.no_grad():
        model.pe.log_freq_scale.copy_(alpha)
    positions = POSITIONS[pos]
    p = torch.tensor(positions)
    x = torch.randn(2, 9, cfg.n_embd)
    assert attention_mask(model.pe, p, p, torch.float32) is None
    with torch.no_grad():
        y = attn(x, position_context(model.pe, p, None))
    thetas = prope_thetas(8, 2, alpha=alpha.double())
    ref = naive_attention(attn, x, rotate=lambda t, v: naive_rope_pair(
        v, torch.tensor(float(positions[t]), dtype=torch.float64), thetas))
    tol = 1e-5 if max(positions) < 300 else 2e-3  # float32 angles at p = 5000
    torch.testing.assert_close(y.double(), ref, atol=tol, rtol=tol)


def test_learnable_freq_gradient_matches_naive():
    cfg, model, attn = build("rope", seed=9, keep_fraction=0.75, learnable_freq=True)  # 3 of 4 pairs
    with torch.no_grad():
        model.pe.log_freq_scale.copy_(torch.tensor([0.1, -0.2, 0.3, 0.4]))
    positions = [0, 1, 2, 3, 5, 8, 13, 21]
    p = torch.tensor(positions)
    x = torch.randn(2, 8, cfg.n_embd)
    weights = torch.randn(2, 8, cfg.n_embd, dtype=torch.float64)
    (attn(x, position_context(model.pe, p, None)).double() * weights).sum().backward()
    alpha = model.pe.log_freq_scale.detach().double().requires_grad_(True)
    thetas = prope_thetas(8, 3, alpha=alpha)
    ref = naive_attention(attn, x, rotate=lambda t, v: naive_rope_pair(
        v, torch.tensor(float(positions[t]), dtype=torch.float64), thetas))
    (ref * weights).sum().backward()
    got = model.pe.log_freq_scale.grad.double()
    assert alpha.grad[:3].abs().min() > 1e-5 and alpha.grad[3] == 0  # the removed pair learns nothing
    torch.testing.assert_close(got, alpha.grad, atol=1e-6 * alpha.grad.abs().max().item(), rtol=1e-3)


def test_scaling_starts_from_the_learned_frequencies():
    """Evaluation-time scaling applies to theta_k * exp(alpha_k); p-RoPE's removed pairs stay 0.
    ntk with s = 4, r = 16: theta'_k = theta_k e^alpha_k 4^(-2k/14); linear: positions / 4."""
    from model.pe.rope_scaling import RopeScaling

    pe = SCHEMES["rope"](rope_config(), keep_fraction=0.75, learnable_freq=True)  # 6 of 8 pairs
    alpha = [0.2, -0.1, 0.05, 0.3, -0.4, 0.0, 0.7, -0.3]
    with torch.no_grad():
        pe.log_freq_scale.copy_(torch.tensor(alpha))
    learned = [10000 ** (-2 * k / 16) * math.exp(alpha[k]) if k < 6 else 0.0 for k in range(8)]
    pos = torch.tensor([0, 100])
    got = pe.frequencies(pos)
    torch.testing.assert_close(got.inv_freq.double(), torch.tensor(learned, dtype=torch.float64), atol=0, rtol=1e-6)
    pe.set_scaling(RopeScaling("ntk", 4.0, 32))
    ntk = [learned[k] * 4.0 ** (-2 * k / 14) for k in range(8)]
    torch.testing.assert_close(pe.frequencies(pos).inv_freq.double(), torch.tensor(ntk, dtype=torch.float64),
                               atol=0, rtol=1e-6)
    pe.set_scaling(RopeScaling("linear", 4.0, 32))
    lin = pe.frequencies(pos)
    assert lin.position_scale == 0.25
    torch.testing.assert_close(lin.inv_freq.double(), torch.tensor(learned, dtype=torch.float64), atol=0, rtol=1e-6)
    pe.set_scaling(RopeScaling("yarn", 4.0, 32))
    yarn = pe.frequencies(pos).inv_freq
    assert torch.all(yarn[6:] == 0) and torch.all(yarn[:6] > 0)
    pe.set_scaling(None)
    torch.testing.assert_close(pe.frequencies(pos).inv_freq, got.inv_freq, atol=0, rtol=0)


def test_rope_subclasses_keep_plain_frequencies():
    for name in ("xpos", "rope_alibi"):
        pe = SCHEMES[name](rope_config())
        assert pe.keep is None and pe.log_freq_scale is None and list(pe.parameters()) == []


def test_learnable_freq_trains_and_survives_a_checkpoint(tmp_path):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (4, 33))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=2, n_head=4, n_embd=32),
                    pe={"_target_": "model.pe.rope.RoPE", "keep_fraction": 0.5, "learnable_freq": True},
                    optim={"lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2})
    trainer = L.Trainer(max_steps=5, accelerator="cpu", precision="bf16-mixed", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path)
    trainer.fit(module, train_dataloaders=loader)
    alpha = module.model.pe.log_freq_scale.detach()
    assert torch.isfinite(alpha).all() and alpha[:2].abs().min() > 0 and torch.all(alpha[2:] == 0)
    assert id(module.model.pe.log_freq_scale) in {id(t) for t in trainer.optimizers[0].param_groups[1]["params"]}
    path = tmp_path / "m.ckpt"
    trainer.save_checkpoint(path)
    loaded = LitGPT.load_from_checkpoint(path)
    assert torch.equal(loaded.model.pe.log_freq_scale, module.model.pe.log_freq_scale)
    module.eval(), loaded.eval()
    idx = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(module(idx)[0], loaded(idx)[0], atol=0, rtol=0)
