"""Per-layer position schedules: which layers apply the scheme and which attend with no
position information (NoPE), as in models that interleave RoPE with NoPE layers.

``pe.nope_every=N`` makes every N-th layer a NoPE layer (1-based: layers N, 2N, ...; with
N = 4 and 0-based indices, layers 3, 7, 11, ... as Llama 4's ``no_rope_layer_interval``).
It lives in the ``pe`` config group beside the scheme's own options, but belongs to the
model, not the scheme: ``split_schedule`` takes it out before the scheme is built.
"""

from __future__ import annotations

import numbers

SCHEDULE_KEYS = ("nope_every",)


def split_schedule(pe: dict) -> tuple[dict, dict]:
    """(the scheme's own options, the schedule options) of a ``pe`` config dict."""
    scheme = {k: v for k, v in pe.items() if k not in SCHEDULE_KEYS}
    return scheme, {k: pe[k] for k in SCHEDULE_KEYS if k in pe}


def nope_layers(n_layer: int, nope_every: int | None = None) -> frozenset[int]:
    """0-based indices of the layers that use no position information."""
    if nope_every is None:
        return frozenset()
    if not isinstance(nope_every, numbers.Integral) or isinstance(nope_every, bool) or nope_every < 1:
        raise ValueError(f"pe.nope_every must be null or an integer >= 1 (every N-th layer is NoPE), "
                         f"got {nope_every!r}")
    return frozenset(range(nope_every - 1, n_layer, nope_every))
