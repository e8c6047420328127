"""GPU acceptance of the model options that change the attention itself: sliding windows
(``model.window``, ``model.window_pattern``) and attention sinks (``model.sinks``), on every CUDA
route a bf16 training step of a representative scheme takes (one per way a scheme reaches the
attention: rotated q/k, key-only slopes, a learned bias, 2d-dim q/k, per-layer data-dependent
terms), against ``math`` with the bound of test_cuda_training.py; the learned sinks' gradient
(through flex's LSE, or SDPA's extra key) is held to it tensor by tensor. Plus one compiled graph
per option. Skipped without CUDA (tests/gpu/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from model.attention import AttentionRequest, resolve
from model.output_ops import OUTPUTS
from tests.gpu.cuda_models import CUDA, CUDA_CHOICES, T, build, config, scheme_instance, tokens
from tests.gpu.test_cuda_training import compare_with_math, float32_matmuls  # noqa: F401 (autouse fixture)

pytestmark = pytest.mark.cuda

SCHEMES = ("rope", "alibi", "t5", "pope", "fox")
W = T // 4  # a window that cuts most rows of the 128-token tests
OPTIONS = {
    "sinks_learned": {"sinks": "learned"},
    "sinks_zero": {"sinks": "zero"},
    "window": {"window": W},
    "window_pattern": {"window_pattern": [W, None]},
    "window_sinks": {"window": W, "sinks": "learned"},
    # each operation on the attention output (model/output_ops/) as a per-layer list of its kinds
    "output_ops": {op.key: list(op.kinds[1:]) for op in OUTPUTS},
}


def option_routes() -> list[tuple[str, str, str, str]]:
    """(scheme, option, backend that runs, the model.attention value asked for) of every distinct
    bf16 training route, resolved for a CUDA device without one."""
    found: dict[tuple, str] = {}
    for scheme in SCHEMES:
        for option, values in OPTIONS.items():
            pe = scheme_instance(scheme, config(**values))
            for choice in CUDA_CHOICES:
                try:
                    route = resolve(choice, AttentionRequest(pe, CUDA, torch.bfloat16, 0.0, grad=True,
                                    normaliser=config(**values).normaliser,
                                    windows=any(k.startswith("window") for k in values))).name
                except ValueError:  # a named backend that refuses the scheme (flex with CoPE)
                    continue
                found.setdefault((scheme, option, route), choice)
    return [(*key, choice) for key, choice in sorted(found.items()) if key[2] != "math"]


ROUTES = option_routes()


@pytest.mark.parametrize("scheme, option, route, choice", ROUTES, ids=["-".join(r[:3]) for r in ROUTES])
def test_training_step_with_option_matches_math(record_property, scheme, option, route, choice):
    record_property("route", route)
    compare_with_math(record_property, scheme, "bf16", route, choice, **OPTIONS[option])


@pytest.mark.parametrize("scheme, option", [("rope", "window_sinks"), ("t5", "window_sinks"),
                                            ("pope", "window_pattern"), ("alibi", "sinks_zero"),
                                            ("fox", "window_sinks"), ("rope", "output_ops")])
def test_compiled_model_with_option_is_one_graph(record_property, scheme, option):
    torch._dynamo.reset()
    model = build(scheme, config(**OPTIONS[option]))
    x, y = tokens(model.config.vocab_size)
    record_property("route_train", model.attention(CUDA, dtype=torch.bfloat16).name)
    with torch.autocast(CUDA.type, dtype=torch.bfloat16):
        explained = torch._dynamo.explain(model.train())(x, y)
    record_property("training_graphs", explained.graph_count)
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1, f"{explained.graph_count} graphs"
