"""Operations on the attention output: per head, after the backend and before ``c_proj``, so
every backend, the KV cache and query chunking serve them alike. A new one is a file here
with a class like these and one entry in ``OUTPUTS``; its ``key`` is a ``model`` option that
takes a kind or a per-layer list of kinds (repeating over the layers, as ``window_pattern``).

- ``xsa``: exclusive self-attention (xsa.py), the part of y along the token's own value removed;
- ``output_gate``: gated attention (gate.py), y times a sigmoid gate of the attention input.
"""

from __future__ import annotations

from model.output_ops.base import OutputOp, layer_kind
from model.output_ops.gate import OutputGate
from model.output_ops.xsa import ExclusiveSelfAttention

# in the order they apply (modded-nanogpt: XSA, then the gate)
OUTPUTS: tuple[type[OutputOp], ...] = (ExclusiveSelfAttention, OutputGate)

__all__ = ["OUTPUTS", "ExclusiveSelfAttention", "OutputGate", "OutputOp", "layer_kind"]
