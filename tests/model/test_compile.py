"""``torch.compile(fullgraph=True)`` of the whole model for every scheme: no graph break, no
recompile on a second step, and the loss and gradients of eager mode (to bf16 rounding)."""

from __future__ import annotations

import pytest
import torch

from model.config import GPTConfig
from model.gpt import GPT
from model.loss import CHUNKED_LOSS_MIN_VOCAB, use_chunked_loss
from model.pe import SCHEMES


CASES = [(name, "auto") for name in sorted(SCHEMES)] + [("alibi", "sdpa_key"), ("rope_alibi", "math")]
# A large vocabulary takes the chunked LM-head loss (model/loss.py), whose chunk loop reads sizes and
# flags on the host: it must stay inside the one graph, not break it. These cases' one compile checks both.
CHUNKED_LOSS = {("learned", "auto"), ("rope", "auto")}


@pytest.mark.parametrize("bf16", [True, False], ids=["bf16", "fp32"])  # fp32: RoPE's q and k share one table
@pytest.mark.parametrize("name, attention", CASES, ids=[f"{n}-{a}" for n, a in CASES])
def test_compiles_fullgraph_without_recompiling(name, attention, bf16):
    vocab_size = 32
    if (name, attention) in CHUNKED_LOSS:
        vocab_size = CHUNKED_LOSS_MIN_VOCAB
        assert use_chunked_loss(vocab_size)
    check_compiled_step(name, attention, bf16, vocab_size=vocab_size)


def check_compiled_step(name: str, attention: str, bf16: bool, vocab_size: int) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=vocab_size, block_size=8, n_layer=2, n_head=2, n_embd=16, attention=attention)
    model = GPT(config, SCHEMES[name](config))
    # aot_eager: Dynamo's capture and AOTAutograd's graphs as inductor gets them, without its C++ code generation
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    idx = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))
    targets = torch.randint(0, vocab_size, (2, 8), generator=torch.Generator().manual_seed(2))
    targets[0, 3] = -1  # an ignored position

    def step(module):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            _, loss = module(idx, targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    eager_loss, eager_grads = step(model)
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(2):  # the second step must reuse the first compilation
            loss, grads = step(compiled)
    # bf16 autocast: the compiled graph may round in another order, so bf16-level tolerances
    torch.testing.assert_close(loss, eager_loss, atol=1e-2, rtol=0)
    assert grads.keys() == eager_grads.keys()
    for n, g in grads.items():
        scale = eager_grads[n].abs().max().item()  # (+1e-8: FIRE's output bias has a zero gradient)
        torch.testing.assert_close(g, eager_grads[n], atol=5e-2 * scale + 1e-8, rtol=0, msg=lambda m: f"{n}: {m}")
