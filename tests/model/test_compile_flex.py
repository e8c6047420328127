"""``torch.compile(fullgraph=True)`` of the model on the flex backend (the CUDA default for bias
schemes), forward only (CPU flex has no backward): no graph break, no recompilation for a
second call of the same shape, and outputs equal to eager."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.pe import SCHEMES
from tests.tiny import SMALL_OPTIONS

torch.set_num_threads(2)


def flex_schemes() -> list[str]:
    """Each scheme that reaches flex with a score_mod (a bias), and RoPE for those without one: a
    rotation or an absolute scheme reaches flex as plain causal attention, and its own operations
    compile in every scheme's case of tests/model/test_compile.py. Flex refuses CoPE; FoX's compiled
    graphs are the cuda tests' (tests/gpu: 8 s of CPU compile here)."""
    config = GPTConfig(vocab_size=32, block_size=128, n_layer=2, n_head=2, n_embd=32)
    return [n for n in sorted(SCHEMES) if SCHEMES[n].terms is None
            and (n == "rope" or SCHEMES[n](config, **SMALL_OPTIONS.get(n, {})).uses_bias)]


@pytest.mark.parametrize("name", flex_schemes())
def test_flex_compiles_fullgraph_without_recompiling(name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=32, block_size=128, n_layer=2, n_head=2, n_embd=32, attention="flex")
    model = GPT(config, SCHEMES[name](config, **SMALL_OPTIONS.get(name, {}))).eval()  # tests/tiny.py
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, 32, (2, 128), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        eager = model(idx)[0]
        first = compiled(idx)[0]
        with torch._dynamo.config.patch(error_on_recompile=True):
            second = compiled(idx)[0]
    torch.testing.assert_close(first.float(), eager.float(), atol=1e-2, rtol=0)
    assert torch.equal(first, second)
