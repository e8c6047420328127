"""Small models shared by the tests: configurations, scheme lists taken from the registry by
property, one tiny GPT builder (``tiny_gpt``), positions as the model sees them, per-layer contexts."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from model.attention import BACKENDS, Terms
from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from model.positions import Pass, layer_contexts


def tiny_config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=37, block_size=16, n_layer=2, n_head=4, n_embd=32)
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


def attention_config(**overrides) -> GPTConfig:
    kwargs = dict(vocab_size=31, block_size=32, n_layer=2, n_head=4, n_embd=32)  # head dim 8
    kwargs.update(overrides)
    return GPTConfig(**kwargs)


@functools.cache
def _default_schemes() -> dict:
    with torch.random.fork_rng(devices=[]):  # building at collection leaves the tests' random state alone
        return {name: SCHEMES[name](attention_config()) for name in sorted(SCHEMES)}


def schemes_where(test: Callable) -> list[str]:
    """The registered schemes (sorted by name) whose default instance passes ``test``."""
    return [name for name, pe in _default_schemes().items() if test(pe)]


def has_parameters(pe) -> bool:
    return any(True for _ in pe.parameters())


# schemes whose bias has parameters (T5, KERPLE, FIRE): CPU training runs them on the bias_grad backend
LEARNED_BIAS = schemes_where(lambda pe: pe.uses_bias and has_parameters(pe))


def tiny_gpt(scheme: str = "rope", seed: int = 0, *, config: GPTConfig | None = None, pe_options: dict | None = None,
             sharpen: float | None = None, **overrides) -> GPT:
    """A GPT with pe=``scheme`` in eval mode, built right after torch.manual_seed(seed), on
    ``config`` or tiny_config(**overrides), with the scheme's ``pe_options``. ``sharpen``: the std
    of every block's q/k/v weights, larger than GPT-2's init so that attention is far from uniform
    and a wrong position term, mask or stale key shows."""
    if config is not None and overrides:
        raise TypeError(f"tiny_gpt takes config or config overrides, not both: {sorted(overrides)}")
    torch.manual_seed(seed)
    cfg = tiny_config(**overrides) if config is None else config
    model = GPT(cfg, SCHEMES[scheme](cfg, **(pe_options or {})))
    if sharpen is not None:
        with torch.no_grad():
            for block in model.blocks:
                torch.nn.init.normal_(block.attn.c_attn.weight, std=sharpen)
    return model.eval()


def build(name, opts=None, seed=0, **cfg_overrides):
    """(config, model, first attention layer) of a GPT with scheme ``name`` on attention_config."""
    model = tiny_gpt(name, seed, config=attention_config(**cfg_overrides), pe_options=opts)
    # larger weights than GPT-2 init so attention is far from uniform and errors show
    attn = model.blocks[0].attn
    with torch.no_grad():
        torch.nn.init.normal_(attn.c_attn.weight, std=0.25)
        torch.nn.init.normal_(attn.c_proj.weight, std=0.2)
        if attn.c_attn.bias is not None:
            torch.nn.init.normal_(attn.c_attn.bias, std=0.1)
            torch.nn.init.normal_(attn.c_proj.bias, std=0.1)
    return model.config, model, attn


# Positions as the model may see them: from 0, offset past the training length (FIRE's
# max(i, L) switches branch), and reset / repeated (a visible key can have a larger position).
POSITIONS = {
    "from0": list(range(9)),
    "offset": list(range(37, 46)),
    "reset": [0, 1, 2, 3, 4, 0, 1, 2, 3],
    "repeat": [5, 5, 5, 2, 2, 7, 0, 0, 9],
    "far": [0, 3, 17, 40, 129, 300, 301, 1000, 5000],
}


def rotate_single(pe, x: torch.Tensor, p: int) -> torch.Tensor:
    """Apply pe.rotate to one head vector x (d,) at position p (used as both q and k)."""
    q = x.reshape(1, 1, 1, -1)
    pos = torch.tensor([p])
    rq, _ = pe.rotate(q, q.clone(), pos, pos)
    return rq.reshape(-1)


def contexts(model, positions, k_positions=None, dtype=torch.float32, always_mask=False):
    """The per-layer position contexts of one forward, as ``GPT.hidden`` builds them."""
    backend = model.attention(positions.device, dtype=dtype)
    terms = Terms(model.pe, positions, positions if k_positions is None else k_positions, dtype=dtype,
                  explicit_mask=always_mask, normaliser=model.config.normaliser)
    return layer_contexts(terms, backend, n_layer=len(model.blocks), nope_layers=model.nope_layers)


def layer_output(model, x, backend: str, window=None, documents=None, chunk=None):
    """The first layer's attention output on ``backend`` as GPT.hidden runs it."""
    positions = torch.arange(x.shape[1])
    docs = None if documents is None else torch.tensor(documents)
    terms = Terms(model.pe, positions, positions, dtype=x.dtype, q_documents=docs, k_documents=docs,
                  normaliser=model.config.normaliser)
    ctx = layer_contexts(terms, BACKENDS[backend], Pass(q_chunk=chunk), 1, windows=(window,))[0]
    return model.blocks[0].attn(x, ctx)


def compiled_training_loss(model, seed: int = 11, length: int = 16):
    """Check that ``model`` (training mode) is one graph without a break, and that its compiled
    training step (aot_eager, fullgraph) neither recompiles nor moves away from eager's loss;
    returns the compiled loss (its gradients are in the parameters)."""
    torch._dynamo.reset()
    model.train()
    idx = torch.randint(0, 31, (2, length), generator=torch.Generator().manual_seed(seed))
    targets = torch.roll(idx, -1, dims=1)
    explained = torch._dynamo.explain(model)(idx, targets)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    eager = model(idx, targets)[1]
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):
            model.zero_grad()
            loss = compiled(idx, targets)[1]
            loss.backward()
    torch.testing.assert_close(loss, eager, atol=1e-5, rtol=1e-5)
    return loss


# Options that only set a scheme's size, the smallest that still runs each of its branches: for
# tests of masks, routes and compiles, where the default size (FIRE's 32 hidden units, unrolled
# in flex's score_mod) only costs time. A scheme's own formula is tested at its defaults (tests/pe/).
SMALL_OPTIONS = {"fire": {"mlp_width": 4}}


def decode_stepwise(model: GPT, vocab: int, prompt_len: int = 6, new: int = 8):
    """(logits of a KV-cache decode, one token a step after the prompt, logits of one full forward
    over the same tokens, the cache) of a greedy continuation of a random prompt; asserts that
    greedy decoding with the cache gives the tokens it gives without."""
    from model.generate import KVCache

    prompt = torch.randint(0, vocab, (2, prompt_len), generator=torch.Generator().manual_seed(1))
    tokens = model.generate(prompt, new, temperature=0)
    assert torch.equal(tokens, model.generate(prompt, new, temperature=0, cache=False))
    with torch.no_grad():
        full = model(tokens)[0]
        cache = KVCache(len(model.blocks), torch.arange(tokens.shape[1]))
        steps = [model.logits(model.hidden(tokens[:, :prompt_len], cache=cache))]
        steps += [model.logits(model.hidden(tokens[:, t:t + 1], cache=cache)) for t in range(prompt_len, tokens.shape[1])]
    return torch.cat(steps, dim=1), full, cache
