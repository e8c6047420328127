"""The ``pe``/``model`` settings a checkpoint was trained with against a run's: what differs."""

from __future__ import annotations

from typing import Any


def scheme_choice(pe: dict) -> str:
    """The ``pe=`` choice of a pe config (conf/pe/NAME.yaml), from its class."""
    from model.pe import SCHEMES

    by_target = {f"{cls.__module__}.{cls.__qualname__}": name for name, cls in SCHEMES.items()}
    target = pe.get("_target_")
    return by_target.get(target, str(target))


def _defaults(target: Any) -> dict[str, Any]:
    """Constructor defaults of a config's class: a key missing on one side (a checkpoint from before
    the key existed) counts as its default, not as a difference."""
    import dataclasses
    import inspect

    from hydra.utils import get_class

    try:
        cls = get_class(target) if isinstance(target, str) else target
    except Exception:  # an unknown class: compare the keys as they are
        return {}
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def config_mismatches(saved: dict, run: dict) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, run value) for each ``pe``/``model`` setting that differs.

    A different scheme is one entry (``pe``): the other pe keys belong to another scheme.
    ``model.vocab_size`` is compared only when the run sets it (train.py takes it from the data).
    """
    from model.config import GPTConfig, fold_sinks

    # model.sinks is the old spelling of a sink normaliser: both sides compared in the new one
    saved, run = ({**c, "model": fold_sinks(c["model"])} for c in (saved, run))

    def diff(group: str, defaults: dict) -> list[tuple[str, Any, Any]]:
        defaults = _flat(defaults)  # nested blocks (pe.scaling) compared key by key
        ours, theirs = {**defaults, **_flat(saved[group])}, {**defaults, **_flat(run[group])}
        if group == "model" and theirs.get("vocab_size") is None:
            ours.pop("vocab_size", None)
        return [(f"{group}.{k}", ours.get(k), theirs.get(k)) for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]

    from model.pe.scaling import SCALING_DEFAULTS

    target = saved["pe"].get("_target_")
    pe_defaults = {"scaling": SCALING_DEFAULTS, **_defaults(target)}  # a checkpoint from before pe.scaling
    pe = [("pe", saved["pe"], run["pe"])] if target != run["pe"].get("_target_") else diff("pe", pe_defaults)
    return pe + diff("model", _defaults(GPTConfig))


def _flat(values: dict, prefix: str = "") -> dict:
    """{"scaling": {"kind": ...}} as {"scaling.kind": ...}."""
    out = {}
    for k, v in values.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def describe(key: str, value: Any) -> str:
    if key == "pe":
        return f"pe={scheme_choice(value)} ({value.get('_target_')})"
    return f"{key}={value}"
