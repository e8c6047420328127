"""GPU acceptance: ``compile=true`` captures every scheme's model in one graph on CUDA, where
``auto`` sends the bias schemes to flex and sdpa_key (dynamo's own count, ``torch._dynamo.explain``):
a training forward with the loss (the chunked LM-head loss: a gpt2-sized vocabulary) and an
evaluation forward, bf16 autocast. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from model.pe import SCHEMES
from tests.gpu.cuda_models import CUDA, build, config, tokens

pytestmark = pytest.mark.cuda

VOCAB = 8192  # model.loss.CHUNKED_LOSS_MIN_VOCAB: the chunked loss's custom op is in the graph


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_compiled_model_is_one_graph(record_property, scheme):
    from model.loss import use_chunked_loss

    assert use_chunked_loss(VOCAB)
    torch._dynamo.reset()
    model = build(scheme, config(vocab=VOCAB))
    x, y = tokens(VOCAB)
    record_property("route_train", model.attention(CUDA, dtype=torch.bfloat16).name)
    with torch.autocast(CUDA.type, dtype=torch.bfloat16):
        train = torch._dynamo.explain(model.train())(x, y)
    model.eval()
    with torch.no_grad(), torch.autocast(CUDA.type, dtype=torch.bfloat16):
        record_property("route_eval", model.attention(CUDA, dtype=torch.bfloat16).name)
        evaluation = torch._dynamo.explain(model)(x)
    for what, explained in (("training", train), ("evaluation", evaluation)):
        record_property(f"{what}_graphs", explained.graph_count)
        assert explained.graph_break_count == 0, f"{what}: {explained.break_reasons}"
        assert explained.graph_count == 1, f"{what}: {explained.graph_count} graphs"
