"""The per-forward position context: computed once in ``GPT.hidden`` and handed to every block.

It holds the scheme's rotation tables and, for the attention backend that will run, the
position terms that backend prepared (a float32 mask, key features, a score function).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from model.attention import BACKENDS, AttentionBackend, AttentionRecorder, Terms


@dataclass
class PositionContext:
    """What every layer of one forward shares."""

    pe: Any  # the scheme
    terms: Terms  # query and key positions, compute dtype
    backend: AttentionBackend
    state: Any = None  # backend.prepare(terms); per chunk when ``chunk`` is set
    tables: Any = None  # the scheme's rotation tables; None: no rotation in this layer
    chunk: int | None = None  # attend in query chunks of this size (long evaluations)
    record: AttentionRecorder | None = None  # collects the probabilities (math backend)
    q_scale: Tensor | None = None  # attention temperature: q times this per query (model/temperature.py)

    @property
    def positions(self) -> Tensor:
        return self.terms.q_positions


@dataclass(frozen=True)
class Pass:
    """How one forward runs outside training (generation, evaluation probes); training leaves
    every field at its default."""

    q_chunk: int | None = None  # attend in query chunks of this size: bounds memory on long sequences
    span: Tensor | None = None  # every position of the context, for span-dependent schemes (default: the keys')
    attention: str | None = None  # a backend name for this forward instead of model.attention
    record: AttentionRecorder | None = None  # collects the attention probabilities (math backend)


# the fewest query rows of a windowed layer's chunk: fewer would spend more on the loop than they save
WINDOW_ROWS = 64


def window_rows(window: int, queries: int) -> int | None:
    """Query rows per chunk of a layer with a sliding window (training included): each chunk
    reads only its window's keys, so attention costs O(T W), not the O(T^2) of a masked kernel
    (measured: docs/design.md, "Sliding windows"); None where the sequence is too short for
    chunks to pay."""
    rows = max(WINDOW_ROWS, window // 2)
    return rows if queries >= 2 * (rows + window) else None


def layer_contexts(terms: Terms, backend: AttentionBackend, how: Pass = Pass(), n_layer: int = 1,
                   nope_layers: frozenset[int] = frozenset(),
                   q_scales: tuple[Tensor | None, Tensor | None] = (None, None),
                   windows: tuple[int | None, ...] = (),
                   rope: tuple[Any, ...] = (),
                   scaled: tuple[bool, ...] = ()) -> list[PositionContext]:
    """One forward's per-layer contexts, built once from its position ``terms``: the scheme's
    (rotation tables over ``how.span`` and the backend's position terms) and, for the NoPE
    layers of a schedule, a causal-only one; one of each per distinct sliding window
    (``windows``: layer i's, None or absent = full; long windowed layers attend in query chunks,
    ``window_rows``) and per distinct own RoPE (``rope``: layer i's ``LayerRope``, None or absent
    = the scheme's; model/pe/schedule.py). ``q_scales``: the attention temperature of
    the scheme's layers and of the NoPE layers (``query_scales``); ``scaled``: whether layer i
    takes it (False: no temperature; absent: True)."""
    pe, positions = terms.pe, terms.q_positions
    chunk = how.q_chunk if how.q_chunk is not None and positions.shape[-1] > how.q_chunk else None
    span = terms.k_positions if how.span is None else how.span  # every key of the forward, whatever a window keeps

    def build(with_pe: bool, window: int | None, own: Any, scale: bool) -> PositionContext:
        kind = backend if with_pe else BACKENDS[backend.plain]
        layer_terms = (terms if with_pe else replace(terms, bias=False)).windowed(window)
        rows = chunk
        if rows is None and layer_terms.window is not None and not kind.full_keys:
            rows = window_rows(layer_terms.window, positions.shape[-1])
        return PositionContext(pe, layer_terms, kind, kind.prepare(layer_terms, chunked=rows is not None),
                               tables[own] if with_pe else None, rows, how.record,
                               None if not scale else q_scales[0] if with_pe else q_scales[1])

    keys = terms.k_positions.shape[-1]  # a window of at least every key is full attention
    windows = [w if w is not None and w < keys else None for w in windows]
    layers = [(i not in nope_layers, windows[i] if i < len(windows) else None,
               rope[i] if i < len(rope) and i not in nope_layers else None,
               scaled[i] if i < len(scaled) else True) for i in range(n_layer)]
    # the rotation tables of each distinct own RoPE, once per forward
    tables = {own: rotation_tables(pe, positions, span, own) for own in dict.fromkeys(r for _, _, r, _ in layers)}
    built = {layer: build(*layer) for layer in dict.fromkeys(layers)}  # masks once per kind of layer
    return [built[layer] for layer in layers]


def rotation_tables(pe: Any, positions: Tensor, span: Tensor, own: Any) -> Any:
    """The scheme's rotation tables, with a layer's own RoPE (``LayerRope``) when one is given; None
    without a rotation."""
    if not pe.uses_rotate:
        return None
    return pe.rotation_tables(positions, span) if own is None else pe.rotation_tables(positions, span, layer=own)


def resolve_positions(pe: Any, T: int, positions: Tensor | None, device: torch.device, start: int = 0) -> Tensor:
    """The default start..start+T-1, checked against the scheme's table; or validated explicit ones."""
    if positions is None:
        limit = pe.max_positions
        if limit is not None and start + T > limit:
            raise ValueError(
                f"sequence length {start + T} exceeds the {limit} positions of pe={pe.name}; "
                f"this scheme cannot run past its table"
            )
        return torch.arange(start, start + T, device=device)
    if positions.shape[-1:] != (T,) or positions.dim() > 2:
        raise ValueError(f"positions must have shape ({T},) or (batch, {T}), got {tuple(positions.shape)}")
    return positions


__all__ = ["Pass", "PositionContext", "layer_contexts", "resolve_positions"]
