"""Secrets never reach a saved, logged or printed config.

A value is masked when its key looks like a secret (api_key, token, password, secret, ...;
``max_tokens`` and ``tokenizer`` do not), and the values of secret-looking environment
variables (WANDB_API_KEY, HF_TOKEN, ...) are masked wherever they appear in a string.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

MASK = "***"
_SECRET_KEY = re.compile(
    r"(?:^|[_.-])(?:api_?key|access_?key|private_?key|secrets?|token|passwords?|passwd|credentials?|auth)(?:$|[_.-])",
    re.IGNORECASE,
)


def looks_secret(key: Any) -> bool:
    """``key`` (a config key, dotted path, override or environment variable name) names a secret."""
    return bool(_SECRET_KEY.search(str(key).lstrip("+~").rsplit(".", 1)[-1]))


def env_secrets() -> list[str]:
    # Short values ("1", "true") would mask ordinary text.
    return [v for k, v in os.environ.items() if looks_secret(k) and len(v) >= 6]


def redact_text(text: str) -> str:
    """``text`` with secret environment values masked; a ``key=value`` override with a secret key
    keeps only its key."""
    key, sep, _ = text.partition("=")
    if sep and looks_secret(key):
        return f"{key}={MASK}"
    for secret in env_secrets():
        text = text.replace(secret, MASK)
    return text


def redact(data: Any) -> Any:
    """A copy of plain config data (dicts, lists, scalars) with every secret masked."""
    if isinstance(data, dict):
        return {k: MASK if looks_secret(k) and v is not None else redact(v) for k, v in data.items()}
    if isinstance(data, (list, tuple)):
        return [redact(v) for v in data]
    return redact_text(data) if isinstance(data, str) else data


def redact_yaml_file(path: Path) -> None:
    """Mask the secrets of a saved YAML config in place (atomically); untouched when it has none."""
    if not path.is_file():
        return
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    clean = redact(data)
    if clean != data:
        tmp = path.with_name(path.name + ".partial")
        OmegaConf.save(OmegaConf.create(clean), tmp)
        os.replace(tmp, path)
