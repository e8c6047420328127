"""What every data-dependent scheme (fox, cope) keeps, on whole models: causality by token order
and not by position values, packed documents as independent sequences, the KV cache equal to one
forward (their float64 formula tests are in tests/pe/test_fox.py and test_cope.py)."""

from __future__ import annotations

import pytest
import torch

from model.attention import BACKENDS
from model.generate import KVCache
from model.pe import SCHEMES
from tests.pe.test_cope import cope_model
from tests.pe.test_fox import fox_model

T = 9
MODELS = {"fox": fox_model, "cope": cope_model}
# (scheme, model.attention, window pattern): auto, and flex where it adds the scheme's terms (a full
# layer and a windowed one: eager CPU flex costs about 1 s a model)
CACHE_CASES = ([(s, "auto", pattern) for s in MODELS for pattern in (None, [3, None])]
               + [(s, "flex", [3, None]) for s in MODELS if SCHEMES[s].terms in (None, *BACKENDS["flex"].terms)])


@pytest.mark.parametrize("scheme", MODELS)
def test_causality_by_token_order(scheme):
    model, _ = MODELS[scheme]()
    idx = torch.randint(0, 31, (2, T))
    later = idx.clone()
    later[:, 6:] = (later[:, 6:] + 1) % 31
    torch.testing.assert_close(model(idx)[0][:, :6], model(later)[0][:, :6], rtol=0, atol=1e-12)
    # neither reads position values: randomized positions leave the logits as they are
    torch.testing.assert_close(model(idx, positions=torch.tensor([0, 3, 4, 9, 10, 20, 21, 22, 30]))[0], model(idx)[0])


@pytest.mark.parametrize("scheme", MODELS)
def test_documents_are_independent(scheme):
    model, _ = MODELS[scheme]()
    idx = torch.randint(0, 31, (1, T))
    packed = model(idx, documents=torch.tensor([[0] * 4 + [1] * 5]))[0]
    torch.testing.assert_close(packed[:, 4:], model(idx[:, 4:])[0], rtol=1e-10, atol=1e-12)


@torch.no_grad()
@pytest.mark.parametrize("scheme, attention, pattern", CACHE_CASES,
                         ids=[f"{s}-{a}{'-windowed' if p else ''}" for s, a, p in CACHE_CASES])
def test_kv_cache_equals_no_cache(scheme, attention, pattern):
    """On flex, blocks of new tokens after the cache take flex and single tokens math (``decode``);
    without autograd, as generation runs (CPU flex differentiates no q, k, v)."""
    model, _ = MODELS[scheme](window_pattern=pattern, attention=attention)
    idx = torch.randint(0, 31, (2, T))
    full = model.hidden(idx)
    cache = KVCache(len(model.blocks), torch.arange(T), model.config.layer_windows)
    parts = [model.hidden(idx[:, s:e], cache=cache) for s, e in ((0, 4), (4, 5), (5, 7), (7, 8), (8, 9))]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, rtol=1e-10, atol=1e-12)
