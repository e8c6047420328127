"""Helpers shared by the scripts: import path, key=value arguments, run configs."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def parse_key_values(argv: list[str], allowed: dict[str, str]) -> dict[str, str]:
    """``key=value`` arguments (Hydra style); unknown keys fail with the list of valid ones."""
    values = {}
    for arg in argv:
        key, sep, value = arg.partition("=")
        if not sep:
            raise SystemExit(f"expected key=value, got {arg!r}; keys: {', '.join(allowed)}")
        if key not in allowed:
            raise SystemExit(f"unknown option {key!r}; valid options:\n" +
                             "\n".join(f"  {k:20s} {help}" for k, help in allowed.items()))
        values[key] = value
    return values


def split_list(value: str) -> list[str]:
    return [v.strip() for v in value.strip("[]").split(",") if v.strip()]
