"""Generation with a KV cache equals one full forward, for every scheme and RoPE scaling.

Other frameworks shipped caches that silently differ from the full forward (ALiBi and xPos
with cached keys, dynamic NTK re-rotating cached keys). Here: decode token by token against
the cache and compare every step's logits with one full forward over the final sequence.
"""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT, KVCache, sample_next
from model.pe import SCHEMES
from model.pe.rope_scaling import ROPE_SCALINGS, RopeScaling

torch.set_num_threads(2)

PROMPT, NEW = 16, 64
CASES = [(name, None) for name in sorted(SCHEMES)] + [("rope", s) for s in ROPE_SCALINGS] + [("xpos", "yarn")]


def build(name: str, scaling: str | None = None, seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    config = GPTConfig(vocab_size=41, block_size=128, n_layer=2, n_head=4, n_embd=32)
    model = GPT(config, SCHEMES[name](config)).eval()
    with torch.no_grad():  # sharper attention than GPT-2 init, so a stale key would show
        for block in model.blocks:
            torch.nn.init.normal_(block.attn.c_attn.weight, std=0.3)
        for p in model.pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if scaling:  # factor 2 with a short "training" length, so every method changes the angles
        model.pe.set_scaling(RopeScaling(scaling, 2.0, original_length=24))
    return model


@pytest.mark.parametrize("name, scaling", CASES, ids=[f"{n}-{s or 'plain'}" for n, s in CASES])
def test_cached_decoding_equals_one_full_forward(name, scaling):
    model = build(name, scaling)
    prompt = torch.randint(0, 41, (2, PROMPT), generator=torch.Generator().manual_seed(1))
    tokens = model.generate(prompt, NEW, temperature=0)  # greedy, with the cache
    assert tokens.shape == (2, PROMPT + NEW) and torch.equal(tokens[:, :PROMPT], prompt)

    with torch.no_grad():
        full = model(tokens)[0]  # one forward over the final sequence, positions 0..N-1
        cache = KVCache(len(model.blocks), torch.arange(tokens.shape[1]))
        steps = [model.logits(model.hidden(tokens[:, :PROMPT], cache=cache))]
        for t in range(PROMPT, tokens.shape[1]):
            steps.append(model.logits(model.hidden(tokens[:, t : t + 1], cache=cache)))
    cached = torch.cat(steps, dim=1)
    assert cache.length == tokens.shape[1]
    torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
    # the greedy tokens are the argmax of the full forward's logits
    assert torch.equal(tokens[:, PROMPT:], full[:, PROMPT - 1 : -1].argmax(-1))


@pytest.mark.parametrize("name, scaling", CASES, ids=[f"{n}-{s or 'plain'}" for n, s in CASES])
def test_greedy_text_is_the_same_with_and_without_the_cache(name, scaling):
    model = build(name, scaling, seed=2)
    prompt = torch.randint(0, 41, (1, PROMPT), generator=torch.Generator().manual_seed(3))
    assert torch.equal(model.generate(prompt, 24, temperature=0, cache=True),
                       model.generate(prompt, 24, temperature=0, cache=False))


def test_several_new_tokens_after_a_cache_stay_causal():
    """A chunk of new tokens after cached ones: token t of the chunk never sees t+1."""
    for name in ("rope", "alibi", "nope", "xpos"):
        model = build(name)
        tokens = torch.randint(0, 41, (1, 30), generator=torch.Generator().manual_seed(4))
        with torch.no_grad():
            full = model(tokens)[0]
            cache = KVCache(len(model.blocks), torch.arange(30))
            first = model.logits(model.hidden(tokens[:, :10], cache=cache))
            rest = model.logits(model.hidden(tokens[:, 10:], cache=cache))
        torch.testing.assert_close(torch.cat((first, rest), 1), full, atol=1e-5, rtol=1e-5)


def test_unbounded_schemes_generate_past_the_training_length_and_learned_refuses():
    model = build("alibi")
    prompt = torch.zeros(1, 100, dtype=torch.long)
    assert model.generate(prompt, 60, temperature=0).shape == (1, 160)  # block_size is 128
    learned = build("learned")
    with pytest.raises(ValueError, match="exceeds the 128 positions of pe=learned; ask for at most 28"):
        learned.generate(prompt, 60)


def test_sample_next_top_k_top_p_and_greedy():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert sample_next(logits, temperature=0).item() == 0
    g = torch.Generator().manual_seed(0)
    draws = {sample_next(logits, top_k=2, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}
    # top_p=0.7: 0.5 < 0.7 so token 1 is needed too (0.8 >= 0.7); token 2 is not
    draws = {sample_next(logits, top_p=0.7, generator=g).item() for _ in range(200)}
    assert draws == {0, 1}
    draws = {sample_next(logits, top_p=0.5, generator=g).item() for _ in range(100)}
    assert draws == {0}


def test_sample_script_with_and_without_cache_gives_the_same_greedy_text(tmp_path):
    """scripts/sample.py on a real checkpoint: cache=true and cache=false, temperature 0."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import lightning as L

    from pelab.checkpoint import AtomicCheckpointIO
    from pelab.lit import LitGPT

    torch.manual_seed(0)
    module = LitGPT(model={"vocab_size": 256, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32},
                    pe={"_target_": "model.pe.xpos.XPos"})
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AtomicCheckpointIO()], default_root_dir=tmp_path)
    trainer.strategy.connect(module)
    ckpt = tmp_path / "last.ckpt"
    trainer.save_checkpoint(ckpt)
    root = Path(__file__).resolve().parents[1]
    outputs = []
    for cache in ("true", "false"):
        proc = subprocess.run([sys.executable, "scripts/sample.py", f"ckpt={ckpt}", "prompt=It was", "tokens=40",
                               "temperature=0", f"cache={cache}", "device=cpu"], cwd=root, capture_output=True,
                              text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith("It was") and len(outputs[0]) > len("It was") + 20


# --------------------------------------------------------------------------------------
# per-layer schedules: pe.nope_every
# --------------------------------------------------------------------------------------


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
            x = block(x, model.layer_contexts(positions)[i])
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
    monkeypatch.setattr(module.model, "forward", lambda x, y=None, positions=None: seen.append(positions)
                        or forward(x, y, positions))
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
