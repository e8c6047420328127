"""Scaled positions (context extension), one mechanism for training and evaluation.

A scheme declares the kinds it takes (``scaling_kinds``) and applies one in its ``scale``
hook. Training: the ``pe.scaling`` block of a ``pe`` config (conf/pe/schedule/scaling.yaml)
is taken out before the scheme is built and handed to ``scale`` (``apply_scaling``), which
keeps it for every later forward (training, validation, evaluation, KV-cache generation). It
is part of the ``pe`` hyper-parameters, so a checkpoint rebuilds the scaled scheme with no
extra flag. Evaluation: ``with scaled(scheme, scaling):`` applies the same ``scale`` inside
the block and restores the scheme exactly on leaving it; on top of a trained scaling it is
refused (two scalings would compose ambiguously: whose original length?).

- Rotary schemes (rope, xpos, rope_alibi) take every kind of model/pe/rope_scaling.py.
- ALiBi-type biases take ``linear``: distances divided by the factor (Al-Khateeb et al.
  2023, position interpolation for ALiBi); rope_alibi interpolates its bias too under
  ``linear`` and leaves it alone under the other kinds.

``kind: none`` is no scaling; every other option must then stay at its default, and each
kind refuses the options it does not read (KIND_OPTIONS), so a typo is not silently ignored.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from model.config import require
from model.pe.rope_scaling import KIND_OPTIONS, SCALING_KINDS, RopeScaling

# the pe.scaling block with every option at its default (conf/pe/schedule/scaling.yaml lists it)
SCALING_DEFAULTS: dict[str, Any] = {
    "kind": "none", "factor": 1.0, "original_length": None,
    **{f.name: f.default for f in dataclasses.fields(RopeScaling) if f.name not in ("kind", "factor", "original_length")},
}


def split_scaling(pe: dict) -> tuple[dict, dict | None]:
    """(the pe options without ``scaling``, the ``scaling`` block or None)."""
    return {k: v for k, v in pe.items() if k != "scaling"}, pe.get("scaling")


def scaling_of(values: dict | None, block_size: int) -> RopeScaling | None:
    """The ``pe.scaling`` block as a RopeScaling (None for kind none), refusing unknown keys,
    options its kind does not read, and an original length past the training length."""
    if values is None:
        return None
    require(isinstance(values, dict), "pe.scaling", values, "a mapping of " + ", ".join(SCALING_DEFAULTS))
    unknown = sorted(set(values) - set(SCALING_DEFAULTS))
    require(not unknown, f"pe.scaling.{unknown[0] if unknown else ''}", values.get(unknown[0]) if unknown else None,
            "absent: pe.scaling takes " + ", ".join(SCALING_DEFAULTS))
    kind = values.get("kind", "none")
    require(kind == "none" or kind in SCALING_KINDS, "pe.scaling.kind", kind, "one of none, " + ", ".join(SCALING_KINDS))
    reads = ("kind",) if kind == "none" else ("kind", "factor", "original_length", *KIND_OPTIONS[kind])
    for key, value in values.items():
        require(key in reads or value == SCALING_DEFAULTS[key], f"pe.scaling.{key}", value,
                f"{SCALING_DEFAULTS[key]!r}: pe.scaling.kind={kind} reads "
                + (", ".join(r for r in reads if r != "kind") if len(reads) > 1 else "no other option"))
    if kind == "none":
        return None
    length = values.get("original_length")
    require(length is None or isinstance(length, int) and not isinstance(length, bool) and 1 <= length <= block_size,
            "pe.scaling.original_length", length,
            f"null or an integer in [1, model.block_size={block_size}] (the length the model was trained at)")
    options = {k: v for k, v in values.items() if k not in ("kind", "factor", "original_length")}
    with _named_as_config():
        return RopeScaling(kind, values.get("factor", 1.0), block_size if length is None else length, **options)


def check_kind(scheme: Any, kind: str, key: str) -> None:
    """A ValueError naming ``key``, the kind and what ``scheme`` takes, unless it takes ``kind``."""
    kinds = scheme.scaling_kinds
    require(kind in kinds, key, kind, f"one of none, {', '.join(kinds)} for pe={scheme.name}" if kinds
            else f"none: pe={scheme.name} has no positions to scale")


def apply_scaling(scheme: Any, values: dict | None, block_size: int) -> None:
    """Scale ``scheme``'s positions for training as ``pe.scaling`` says (nothing for kind none)."""
    scaling = scaling_of(values, block_size)
    if scaling is None:
        return
    with _named_as_config():
        scheme.scale(scaling)


@contextlib.contextmanager
def scaled(scheme: Any, scaling: RopeScaling | None):
    """``scheme`` scaled by ``scaling`` inside the block (None: as it is), restored exactly on
    leaving it, also on an error: its attributes and buffers are put back as they were."""
    if scaling is None:
        yield scheme
        return
    if not isinstance(scaling, RopeScaling):
        raise TypeError(f"scaled expects a RopeScaling or None, got {type(scaling).__name__}")
    if scheme.scaling is not None:
        raise ValueError(f"rope_scaling={scaling.kind} at evaluation is refused: pe={scheme.name} was trained with "
                         f"pe.scaling.kind={scheme.scaling.kind}, which every forward already applies")
    check_kind(scheme, scaling.kind, "rope_scaling")
    attributes, buffers = dict(vars(scheme)), dict(scheme._buffers)
    try:
        scheme.scale(scaling)
        yield scheme
    finally:
        vars(scheme).clear()
        vars(scheme).update(attributes)
        scheme._buffers.clear()  # the very dict ``attributes`` holds: refilled with the tensors it had
        scheme._buffers.update(buffers)


@contextlib.contextmanager
def _named_as_config():
    """RopeScaling's errors ("rope scaling X must ...") as the config keys ("pe.scaling.X")."""
    try:
        yield
    except ValueError as err:
        raise ValueError(str(err).replace("rope scaling ", "pe.scaling.", 1)) from None
