"""Model-level position options, set in the ``pe`` group beside the scheme's own options.

- Per-layer schedules: which layers apply the scheme and which attend with no position
  information (NoPE), as in models that interleave RoPE with NoPE layers.
- Randomized positions (Ruoss et al. 2023): ``pe.randomize_to=N`` trains every sequence at
  a sorted random subset of [0, N) instead of 0..T-1, so a model trained at length T has
  seen positions up to N; evaluation and generation use 0..T-1 as usual.

``pe.nope_every=N`` makes every N-th layer a NoPE layer (1-based: layers N, 2N, ...; with
N = 4 and 0-based indices, layers 3, 7, 11, ... as Llama 4's ``no_rope_layer_interval``).
These belong to the model, not the scheme: ``split_schedule`` takes them out before the
scheme is built.
"""

from __future__ import annotations

import numbers

import torch
from torch import Tensor

SCHEDULE_KEYS = ("nope_every", "randomize_to")


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


def check_nope_layers(layers: frozenset[int], n_layer: int, pe) -> None:
    """A schedule must leave the scheme some layer when the scheme has parameters: unused
    parameters get no gradient, and DDP stops at its second step on them."""
    if layers and len(layers) == n_layer and any(True for _ in pe.parameters()):
        raise ValueError(f"pe.nope_every={min(layers) + 1} makes all {n_layer} layers NoPE layers, so pe={pe.name}'s "
                         f"parameters would never be used; use pe.nope_every >= 2 (or pe=nope)")


def check_randomize_to(randomize_to: int | None, block_size: int, max_positions: int | None) -> int | None:
    """``pe.randomize_to`` checked against the training length and the scheme's table."""
    if randomize_to is None:
        return None
    if not isinstance(randomize_to, numbers.Integral) or isinstance(randomize_to, bool) or randomize_to < block_size:
        raise ValueError(f"pe.randomize_to must be null or an integer >= model.block_size={block_size} "
                         f"(positions are drawn from [0, N)), got {randomize_to!r}")
    if max_positions is not None and randomize_to > max_positions:
        raise ValueError(f"pe.randomize_to={randomize_to} exceeds the {max_positions} positions of the scheme; "
                         f"randomized positions need a scheme with unbounded positions (or a larger table)")
    return int(randomize_to)


def random_positions(batch: int, length: int, limit: int, generator: torch.Generator,
                     device: torch.device | None = None) -> Tensor:
    """(batch, length) positions: for each sequence a sorted random subset of [0, limit)."""
    keys = torch.rand(batch, limit, generator=generator, device=device)
    return keys.topk(length, dim=-1).indices.sort(dim=-1).values
