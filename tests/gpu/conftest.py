"""tests/gpu: the GPU acceptance tests (marked ``cuda``) beside CPU tests of the acceptance run's
own parts. A ``cuda`` test is skipped where torch sees no CUDA device, so ``python -m pytest -q``
on CPU skips them without building anything; ``pytest -m cuda`` selects them (docs/gpu.md)."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (the GPU acceptance run: docs/gpu.md)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)
