"""Decoding with a KV cache against one full forward over the final sequence, step by step, for
every scheme and RoPE scaling; sampling (greedy, top-k, top-p) and scripts/sample.py."""

from __future__ import annotations

import pytest
import torch

from model.generate import KVCache, sample_next
from model.gpt import GPT
from model.pe import SCHEMES
from model.pe.rope_scaling import ROPE_SCALINGS, RopeScaling
from tests.cli import run_python
from tests.tiny import tiny_gpt

PROMPT, NEW = 16, 64
CASES = [(name, None) for name in sorted(SCHEMES)] + [("rope", s) for s in ROPE_SCALINGS] + [("xpos", "yarn")]


def build(name: str, scaling: str | None = None, seed: int = 0) -> GPT:
    model = tiny_gpt(name, seed, sharpen=0.3, vocab_size=41, block_size=128)  # sharp, so a stale key would show
    with torch.no_grad():  # learned position terms away from their init
        for p in model.pe.parameters():
            p.add_(0.1 * torch.randn_like(p))
    if scaling:  # factor 2 with a short "training" length, so every method changes the angles
        model.pe.scale(RopeScaling(scaling, 2.0, original_length=24))
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
    for name in sorted(SCHEMES):
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
    root = Path(__file__).resolve().parents[2]
    outputs = []
    for cache in ("true", "false"):
        proc = run_python(["scripts/sample.py", f"ckpt={ckpt}", "prompt=It was", "tokens=40",
                           "temperature=0", f"cache={cache}", "device=cpu"],
                          cwd=root, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr
        outputs.append(proc.stdout)
    assert outputs[0] == outputs[1] and outputs[0].startswith("It was") and len(outputs[0]) > len("It was") + 20
