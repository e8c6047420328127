"""NoPE: the causal mask alone, against a naive float64 attention loop; RoPE as the control."""

from __future__ import annotations

import torch

from model.attention.masks import attention_mask
from model.gpt import GPT
from model.pe import SCHEMES
from tests.position_context import position_context
from tests.naive import naive_attention_loops
from tests.tiny import POSITIONS, attention_config, build


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
    torch.testing.assert_close(y.double(), naive_attention_loops(attn, x), atol=1e-5, rtol=1e-5)
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
        cfg = attention_config(n_layer=1)
        model = GPT(cfg, SCHEMES[name](cfg)).eval()
        with torch.no_grad():
            torch.nn.init.normal_(model.blocks[0].attn.c_attn.weight, std=0.5)
            outs[name] = (model(idx)[0][0, -1], model(perm)[0][0, -1])
    torch.testing.assert_close(outs["nope"][0], outs["nope"][1], atol=1e-5, rtol=0)
    assert (outs["rope"][0] - outs["rope"][1]).abs().max() > 1e-3
