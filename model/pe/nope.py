"""NoPE: no position information at all (Kazemnejad et al. 2023; Haviv et al. 2022).

The scheme overrides no hook, so the model runs SDPA with ``is_causal=True`` and nothing
else: the only source of order is the causal mask itself (a token sees the tokens before
it, not where they are). Kept as the baseline every other scheme is measured against.
"""

from __future__ import annotations

from model.pe.base import PositionEncoding


class NoPE(PositionEncoding, name="nope"):
    pass
