"""The one error every checkpoint check raises."""

from __future__ import annotations

from hydra.errors import CompactHydraException


class CheckpointError(CompactHydraException, ValueError):
    """A checkpoint file that cannot be used (or be written), with the file and the reason in the
    message; Hydra's CLI prints it alone, without a traceback, as a ``ConfigError``."""
