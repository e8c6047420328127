"""The GPT forward: shapes, loss and gradients at init for every scheme, the loss against a fully
naive float64 forward, refused positions, and an init that leaves a scheme's parameters alone."""

from __future__ import annotations

import math

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from tests.naive import (VARIANT_IDS, VARIANTS, leaf_params, naive_attention, naive_gelu, naive_layer_norm, naive_linear,
                         naive_reference, naive_spec)
from tests.tiny import attention_config, build, has_parameters, schemes_where, tiny_config


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_gpt_forward_backward(name):
    torch.manual_seed(0)
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES[name](cfg))
    B, T = 2, 12
    idx = torch.randint(0, cfg.vocab_size, (B, T))
    targets = torch.randint(0, cfg.vocab_size, (B, T))
    logits, loss = model(idx, targets)
    assert logits.shape == (B, T, cfg.vocab_size)
    assert loss.ndim == 0 and torch.isfinite(loss)
    # at init the loss is close to log(V)
    assert abs(loss.item() - math.log(cfg.vocab_size)) < 0.5
    loss.backward()
    g = model.wte.weight.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    for i, block in enumerate(model.blocks):
        for pname, p in block.named_parameters():
            assert p.grad is not None, f"block {i} {pname} got no grad"
            assert torch.isfinite(p.grad).all()
            assert p.grad.abs().sum() > 0, f"block {i} {pname} has zero grad"
    if name == "learned":
        wpe = model.pe.wpe.weight.grad
        assert wpe is not None and wpe[:T].abs().sum() > 0
        # rows never used get no gradient
        assert torch.all(wpe[T:] == 0)
    elif has_parameters(model.pe):  # a learned bias, PoPE's phase offsets: they train with the network
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.pe.parameters())
    else:
        assert all(p.grad is None or p.grad.abs().sum() == 0 for p in model.pe.parameters())


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_gpt_logits_without_targets_and_padded_vocab(name):
    torch.manual_seed(1)
    cfg = tiny_config(vocab_size=37, pad_vocab_multiple=8)
    model = GPT(cfg, SCHEMES[name](cfg))
    assert model.lm_head.weight.shape[0] == 40
    logits, loss = model(torch.randint(0, 37, (1, 5)))
    assert loss is None
    assert logits.shape == (1, 5, 37)


def test_gpt_rejects_wrong_positions_shape():
    cfg = tiny_config()
    model = GPT(cfg, SCHEMES["rope"](cfg))
    with pytest.raises(ValueError):
        model(torch.zeros(1, 6, dtype=torch.long), positions=torch.arange(5))


def naive_gpt(model, name, opts, idx, targets, positions: list[int]):
    cfg = model.config
    spec = naive_spec(name, opts, cfg.n_head, cfg.head_dim)
    W_tok = model.wte.weight.detach().double()
    x = W_tok[idx]
    if model.pe.uses_embed:
        x = x + naive_reference("NAIVE_EMBED", name)(model.pe, leaf_params(model.pe), positions, opts).detach()
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


def test_model_init_leaves_scheme_parameters_to_the_scheme():
    """GPT-2's global init must not overwrite what a scheme initialised itself."""
    from torch import nn

    from model.pe.base import PositionEncoding

    class OwnInit(PositionEncoding):  # unregistered: no name
        def __init__(self, config):
            super().__init__(config)
            self.table = nn.Embedding(5, 3)
            self.proj = nn.Linear(3, 2)
            for p in self.parameters():
                nn.init.constant_(p, 0.75)

    config = GPTConfig(vocab_size=11, block_size=8, n_layer=2, n_head=2, n_embd=16)
    model = GPT(config, OwnInit(config))
    assert all(torch.all(p == 0.75) for p in model.pe.parameters())
    assert model.lm_head.weight.std().item() == pytest.approx(0.02, rel=0.3)  # the network still gets GPT-2 init


@pytest.mark.parametrize("name", schemes_where(has_parameters))
def test_gpt_init_leaves_the_scheme_parameters_alone(name):
    cfg = attention_config()
    torch.manual_seed(3)
    pe = SCHEMES[name](cfg)
    before = {n: t.detach().clone() for n, t in pe.named_parameters()}
    GPT(cfg, pe)
    for n, t in pe.named_parameters():
        assert torch.equal(t, before[n]), n
