"""Model-level position options, set in the ``pe`` group beside the scheme's own options.

- Per-layer schedules: which layers apply the scheme and which attend with no position
  information (NoPE), as in models that interleave RoPE with NoPE layers.
- Randomized positions (Ruoss et al. 2023): ``pe.randomize_to=N`` trains every sequence at
  a sorted random subset of [0, N) instead of 0..T-1, so a model trained at length T has
  seen positions up to N; evaluation and generation use 0..T-1 as usual.

``pe.nope_every=N`` makes every N-th layer a NoPE layer (1-based: layers N, 2N, ...; with
N = 4 and 0-based indices, layers 3, 7, 11, ... as Llama 4's ``no_rope_layer_interval``).
``pe.nope_layers`` names them by the window pattern instead: ``global`` (the full-attention
layers: RNoPE-SWA, OLMo-core's ``no_global_rope``), ``local`` (the windowed ones) or a list of
0-based layer indices. The full-attention layers may rotate by their own RoPE (``LayerRope``):
``pe.global_base`` another base (Gemma 3: 10k on the windowed layers, 1M on the global ones),
``pe.global_keep_fraction`` p-RoPE there only (Gemma 4: p = 0.25 on the global layers, Hugging
Face's ``rope_type="proportional"``), ``pe.scaling_layers=global`` the scheme's ``pe.scaling``
there only (OLMo 3: YaRN on the full-attention layers). ``layer_positions`` turns them into one
per-layer plan. These belong to the model, not the scheme: ``split_schedule``
takes them out before the scheme is built.
"""

from __future__ import annotations

import inspect
import numbers
from typing import NamedTuple

import torch
from torch import Tensor

# the per-layer plan (``layer_positions``), in its argument order
LAYER_KEYS = ("nope_every", "nope_layers", "global_base", "global_keep_fraction", "scaling_layers")
SCHEDULE_KEYS = (*LAYER_KEYS, "randomize_to")
LAYER_GROUPS = ("global", "local")  # full-attention and windowed layers of model.window(_pattern)
SCALING_LAYERS = ("all", "global")  # pe.scaling_layers


class LayerRope(NamedTuple):
    """A layer's own RoPE, beside the scheme's: another base, another p-RoPE kept fraction, or the
    scheme's ``pe.scaling`` left out (``scaled=False``). None fields are the scheme's."""

    base: float | None = None
    keep_fraction: float | None = None
    scaled: bool = True


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


def layer_group(windows: tuple[int | None, ...], group: str) -> frozenset[int]:
    """The ``global`` (full-attention) or ``local`` (windowed) layers of per-layer ``windows``."""
    return frozenset(i for i, w in enumerate(windows) if (w is None) == (group == "global"))


def listed_nope_layers(n_layer: int, windows: tuple[int | None, ...], value) -> frozenset[int]:
    """``pe.nope_layers``: a group of the window pattern or explicit 0-based layer indices."""
    if value in LAYER_GROUPS:
        layers = layer_group(windows, value)
        if not layers or len(layers) == n_layer:
            raise ValueError(f"pe.nope_layers={value} needs both windowed and full-attention layers, but the model's "
                             f"layer windows are {list(windows)} (set model.window_pattern with null entries, "
                             f"e.g. [64, 64, 64, null])")
        return layers
    indices = list(value) if isinstance(value, (list, tuple)) else None
    if not indices or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) and 0 <= i < n_layer
                              for i in indices):
        raise ValueError(f"pe.nope_layers must be null, {' or '.join(LAYER_GROUPS)} or a non-empty list of 0-based "
                         f"layer indices < model.n_layer={n_layer}, got {value!r}")
    return frozenset(int(i) for i in indices)


def layer_positions(windows: tuple[int | None, ...], nope_every: int | None = None, listed=None,
                    global_base: float | None = None, global_keep_fraction: float | None = None,
                    scaling_layers: str | None = None) -> tuple[frozenset[int], tuple[LayerRope | None, ...]]:
    """(the NoPE layers, each layer's own RoPE or None for the scheme's) of a model whose layer i
    attends ``windows[i]`` (None: full attention), from the ``LAYER_KEYS`` options in their order
    (``listed``: pe.nope_layers)."""
    n_layer = len(windows)
    if nope_every is not None and listed is not None:
        raise ValueError(f"pe.nope_every={nope_every} and pe.nope_layers={listed!r}: set one of the two "
                         f"(nope_every counts layers, nope_layers names them)")
    nope = nope_layers(n_layer, nope_every) if listed is None else listed_nope_layers(n_layer, windows, listed)
    if global_base is not None and (not isinstance(global_base, numbers.Real) or isinstance(global_base, bool)
                                    or not global_base > 1):
        raise ValueError(f"pe.global_base must be null or a number > 1 (the RoPE base of the full-attention "
                         f"layers), got {global_base!r}")
    if global_keep_fraction is not None and (not isinstance(global_keep_fraction, numbers.Real)
                                             or isinstance(global_keep_fraction, bool)
                                             or not 0 < global_keep_fraction <= 1):
        raise ValueError(f"pe.global_keep_fraction must be null or a number in (0, 1] (p-RoPE's kept fraction of "
                         f"the full-attention layers), got {global_keep_fraction!r}")
    if scaling_layers is not None and scaling_layers not in SCALING_LAYERS:
        raise ValueError(f"pe.scaling_layers must be null or one of {', '.join(map(repr, SCALING_LAYERS))} (the "
                         f"layers pe.scaling rescales), got {scaling_layers!r}")
    asked = [(f"pe.{key}={value}", what) for key, value, what in (
        ("global_base", global_base, "sets the RoPE base of"),
        ("global_keep_fraction", global_keep_fraction, "sets p-RoPE's kept fraction of"),
        ("scaling_layers", scaling_layers if scaling_layers == "global" else None, "rescales only"))
        if value is not None]
    if not asked:
        return nope, (None,) * n_layer
    full = layer_group(windows, "global")
    for setting, what in asked:
        if not full or len(full) == n_layer:
            raise ValueError(f"{setting} needs both windowed and full-attention layers, but the model's layer "
                             f"windows are {list(windows)} (with no window use the scheme's own option; set "
                             f"model.window_pattern with null entries, e.g. [64, 64, 64, null])")
        if full <= nope:
            raise ValueError(f"{setting} {what} the full-attention layers {sorted(full)}, but they are all NoPE "
                             f"layers (pe.nope_layers / pe.nope_every)")
    own = LayerRope(None if global_base is None else float(global_base),
                    None if global_keep_fraction is None else float(global_keep_fraction))
    local = LayerRope(scaled=scaling_layers != "global")
    plan = [None if i in nope else own if i in full else local for i in range(n_layer)]
    return nope, tuple(None if layer == LayerRope() else layer for layer in plan)


def check_layer_rope(plan: tuple[LayerRope | None, ...], pe) -> None:
    """A layer's own RoPE needs a scheme whose rotation tables take one (the RoPE family). With
    ``pe.scaling_layers=global`` and no ``pe.scaling``, an evaluation's scaling (eval.*.rope_scaling)
    is the one left out of the windowed layers."""
    if all(layer is None for layer in plan):
        return
    own = [r for r in plan if r is not None]
    setting = next((f"pe.global_base={r.base}" for r in own if r.base is not None),
                   next((f"pe.global_keep_fraction={r.keep_fraction}" for r in own if r.keep_fraction is not None),
                        "pe.scaling_layers=global"))
    if not (pe.uses_rotate and "layer" in inspect.signature(pe.rotation_tables).parameters):
        raise ValueError(f"{setting} needs a RoPE scheme (rope, xpos, rope_alibi and the rope presets), "
                         f"got pe={pe.name}")


def check_nope_layers(layers: frozenset[int], n_layer: int, pe, setting: str | None = None) -> None:
    """A schedule must leave the scheme some layer when the scheme has parameters: unused
    parameters get no gradient, and DDP stops at its second step on them. ``setting``: the
    option that chose the layers, as the user wrote it (default: the ``nope_every`` spelling)."""
    if layers and len(layers) == n_layer and any(True for _ in pe.parameters()):
        setting = setting or f"pe.nope_every={min(layers) + 1}"
        raise ValueError(f"{setting} makes all {n_layer} layers NoPE layers, so pe={pe.name}'s "
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
