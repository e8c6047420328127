"""A layer's position context built by hand (tests only): SDPA with a given mask."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from model.attention import BACKENDS, Terms
from model.positions import PositionContext


def position_context(pe: Any, positions: Tensor, mask: Tensor | None = None, span: Tensor | None = None
                     ) -> PositionContext:
    """An SDPA context of tokens at ``positions`` with a given ``mask`` (None: causal), the
    scheme's rotation tables over ``span`` (default: the positions themselves)."""
    tables = pe.rotation_tables(positions, positions if span is None else span) if pe.uses_rotate else None
    return PositionContext(pe, Terms(pe, positions, positions), BACKENDS["sdpa"], mask, tables)
