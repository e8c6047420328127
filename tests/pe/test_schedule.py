"""Model-level position options (model/pe/schedule.py): NoPE layers every N (pe.nope_every)
against layers run by hand, and randomized positions (pe.randomize_to)."""

from __future__ import annotations

import pytest
import torch

from model.attention import Terms
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.positions import layer_contexts


def test_nope_every_layer_drops_the_scheme_on_those_layers_only():
    """A 4-layer RoPE+bias model with nope_every=2: layers 1 and 3 see no position
    information. Reference: each layer run with the scheme (rope_alibi) or with a NoPE
    scheme's context, chosen by hand."""
    from model.pe.schedule import nope_layers

    assert nope_layers(8, 4) == {3, 7} and nope_layers(4, None) == set() and nope_layers(3, 1) == {0, 1, 2}
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=41, block_size=64, n_layer=4, n_head=4, n_embd=32)
    scheduled = GPT(config, SCHEMES["rope_alibi"](config), nope_layers(4, 2)).eval()
    reference = GPT(config, SCHEMES["rope_alibi"](config)).eval()
    plain = GPT(config, SCHEMES["nope"](config)).eval()
    reference.load_state_dict(scheduled.state_dict())
    plain.load_state_dict(scheduled.state_dict())
    idx = torch.randint(0, 41, (2, 20), generator=torch.Generator().manual_seed(5))
    positions = torch.arange(20)
    with torch.no_grad():
        x = scheduled.embed(idx, positions)
        for i, block in enumerate(reference.blocks):
            model = plain if i in (1, 3) else reference
            ctx = layer_contexts(Terms(model.pe, positions, positions), model.attention(positions.device))[0]
            x = block(x, ctx)
        expected = scheduled.logits(scheduled.ln_f(x))
        got = scheduled(idx)[0]
        torch.testing.assert_close(got, expected, atol=1e-6, rtol=0)
        # and it differs from applying the scheme everywhere
        assert (reference(idx)[0] - got).abs().max() > 1e-3
    # the probe and the cache follow the schedule too
    from evaluation.attention_maps import eager_attention_pass

    run = eager_attention_pass(scheduled, idx, return_hidden=True)
    torch.testing.assert_close(scheduled.logits(run.hidden), got, atol=1e-5, rtol=0)
    tokens = scheduled.generate(idx[:, :8], 12, temperature=0)
    assert torch.equal(tokens, scheduled.generate(idx[:, :8], 12, temperature=0, cache=False))


def test_nope_every_from_the_config(tmp_path):
    """pe.nope_every reaches the model through LitGPT; embedding-only schemes refuse it."""
    from pelab.lit import LitGPT

    module = LitGPT(model={"vocab_size": 41, "block_size": 32, "n_layer": 8, "n_head": 2, "n_embd": 16},
                    pe={"_target_": "model.pe.rope.RoPE", "nope_every": 4})
    assert module.model.nope_layers == {3, 7}
    with pytest.raises(ValueError, match="pe.nope_every must be null or an integer >= 1"):
        LitGPT(model={"vocab_size": 41, "block_size": 32}, pe={"_target_": "model.pe.rope.RoPE", "nope_every": 0})


# --------------------------------------------------------------------------------------
# randomized positions (Ruoss et al. 2023)
# --------------------------------------------------------------------------------------


def test_random_positions_are_sorted_distinct_subsets():
    from model.pe.schedule import random_positions

    g = torch.Generator().manual_seed(0)
    p = random_positions(64, 16, 40, g)
    assert p.shape == (64, 16) and p.min() >= 0 and p.max() < 40
    assert torch.all(p[:, 1:] > p[:, :-1])  # strictly increasing: sorted, no repeats
    assert len({tuple(row.tolist()) for row in p}) > 60  # sequences get their own
    # every position of [0, 40) is drawn about equally often (16/40 of the rows each)
    counts = torch.bincount(random_positions(4000, 16, 40, g).flatten(), minlength=40).float() / 4000
    assert torch.allclose(counts, torch.full((40,), 0.4), atol=0.04)
    assert torch.equal(random_positions(2, 16, 16, g), torch.arange(16).expand(2, 16))  # N = T: no choice


def test_training_uses_random_positions_and_evaluation_does_not(monkeypatch):
    from pelab.lit import LitGPT

    module = LitGPT(model={"vocab_size": 41, "block_size": 16, "n_layer": 1, "n_head": 2, "n_embd": 16},
                    pe={"_target_": "model.pe.alibi.ALiBi", "randomize_to": 64})
    seen = []
    forward = module.model.forward
    monkeypatch.setattr(module.model, "forward", lambda x, y=None, positions=None, documents=None:
                        seen.append(positions) or forward(x, y, positions, documents))
    monkeypatch.setattr(module, "log", lambda *a, **k: None)
    monkeypatch.setattr(module, "optimizers", lambda: type("O", (), {"param_groups": [{"lr": 0.0}]})())
    x = torch.randint(0, 41, (3, 16))
    loss = module.training_step((x, x), 0)
    positions = seen[-1]
    assert positions.shape == (3, 16) and positions.max() < 64 and torch.all(positions[:, 1:] > positions[:, :-1])
    torch.testing.assert_close(loss, module.model(x, x, positions)[1])
    module.training_step((x, x), 0)
    assert torch.equal(seen[-1], positions)  # a pure function of (seed, rank, step, micro-batch)
    module.training_step((x, x), 1)
    assert not torch.equal(seen[-1], positions)
    module.validation_step((x, x), 0)
    assert seen[-1] is None  # evaluation: 0..T-1
    with pytest.raises(ValueError, match="pe.randomize_to=64 exceeds the 16 positions"):
        LitGPT(model={"vocab_size": 41, "block_size": 16}, pe={"_target_": "model.pe.learned.LearnedPositionEmbedding",
                                                               "randomize_to": 64})
