"""The learned absolute position table: rows added to the embeddings, and refusal past its size."""

from __future__ import annotations

import pytest
import torch

from model.gpt import GPT
from model.pe import SCHEMES
from tests.tiny import tiny_config


def test_learned_refuses_sequences_past_its_table():
    cfg = tiny_config(block_size=16)
    model = GPT(cfg, SCHEMES["learned"](cfg))
    model(torch.zeros(1, 16, dtype=torch.long))  # exactly the table: fine
    with pytest.raises(ValueError, match=r"\b16\b"):
        model(torch.zeros(1, 17, dtype=torch.long))


def test_learned_refuses_explicit_positions_past_its_table():
    cfg = tiny_config(block_size=16)
    model = GPT(cfg, SCHEMES["learned"](cfg))
    model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(12, 16))
    with pytest.raises(ValueError, match=r"\b16\b"):
        model(torch.zeros(1, 4, dtype=torch.long), positions=torch.arange(13, 17))
    pe = SCHEMES["learned"](cfg, max_positions=8)
    with pytest.raises(ValueError, match=r"\b8\b"):
        pe.embed(torch.zeros(1, 2, cfg.n_embd), torch.tensor([3, 8]))


def test_learned_embed_adds_table_rows():
    torch.manual_seed(4)
    cfg = tiny_config()
    pe = SCHEMES["learned"](cfg)
    x = torch.randn(2, 3, cfg.n_embd)
    pos = torch.tensor([5, 0, 11])
    out = pe.embed(x, pos)
    W = pe.wpe.weight.detach()
    for b in range(2):
        for t in range(3):
            torch.testing.assert_close(out[b, t], x[b, t] + W[int(pos[t])])
