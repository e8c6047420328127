"""Every backend of one scheme computes the same model: the scheme's terms at the positions given
(randomized ones included) under document masks, in every compute dtype, against float64
references (a naive loop over the bias formulas, and the float64 model scoring each document alone)."""

from __future__ import annotations

import pytest
import torch

from data.packing import document_layout
from model.attention import BACKENDS
from model.pe.schedule import random_positions
from model.positions import layer_contexts
from tests.attention.test_document_mask import EOT, naive_document_attention, windows
from tests.naive import SLOPES_4, leaf_params, naive_alibi_bias, naive_scheme_bias
from tests.tiny import build, schemes_where

CPU = torch.device("cpu")
# schemes whose only position term is a bias (the naive loop below has no rotation)
BIAS_ONLY = schemes_where(lambda pe: pe.uses_bias and not (pe.uses_rotate or pe.uses_embed))


def naive_bias64(name, pe, qpos, kpos):
    """(H, Tq, Tk) float64 bias at the given integer positions, from the formulas (ALiBi: MPT's
    -m_h (p_i - p_j) with the slopes typed in)."""
    if name == "alibi":
        return naive_alibi_bias(SLOPES_4, qpos, kpos)
    return naive_scheme_bias(name, pe, leaf_params(pe), qpos, kpos).detach()


def randomized_layout(seed: int, T: int = 16, limit: int = 64):
    """(2, T) randomized positions (sorted subsets of [0, limit)) and the document ids of a window."""
    positions = random_positions(2, T, limit, torch.Generator().manual_seed(seed))
    idx = windows(seed, T=T, ends=((4, 9), (6,)))
    return positions, document_layout(idx, EOT)[1]


@pytest.mark.parametrize("name", BIAS_ONLY)
def test_randomized_positions_under_a_document_mask_on_every_backend(name):
    """pe.randomize_to with data.document_mask: the bias at the randomized positions, not at token
    order's (which the mask-building backends once substituted for a bias of the distance alone),
    on every backend that runs the scheme, against a float64 loop over each document's keys."""
    _, model, attn = build(name, block_size=16)
    positions, documents = randomized_layout(3)
    x = torch.randn(2, 16, 32, generator=torch.Generator().manual_seed(4))
    rows = positions.tolist()
    biases = [naive_bias64(name, model.pe, r, r) for r in rows]
    ref = naive_document_attention(attn, x, biases, documents.tolist())
    ran = []
    for backend in BACKENDS.values():
        grad = backend.name == "bias_grad"  # the learned-bias kernel runs under autograd only
        if not backend.supports(model.pe, CPU, torch.float32, 0.0, grad) or not backend.fits(model.pe, CPU,
                                                                                             torch.float32, grad):
            continue
        ctx = layer_contexts(model.pe, 1, positions, backend, documents=documents)[0]
        with torch.set_grad_enabled(grad):
            out = attn(x, ctx).detach()
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5, msg=lambda m: f"{backend.name}: {m}")
        ran.append(backend.name)
    assert {"sdpa", "math", "flex"} <= set(ran)
