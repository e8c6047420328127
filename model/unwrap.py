"""The eager module behind a ``torch.compile`` wrapper."""

from torch import nn


def uncompiled(model: nn.Module) -> nn.Module:
    """The eager module behind a ``torch.compile`` wrapper (evaluation probes must not be traced)."""
    return getattr(model, "_orig_mod", model)
