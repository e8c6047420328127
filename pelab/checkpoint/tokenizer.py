"""The tokenizer a checkpoint was trained on: recorded in every checkpoint (``tokenizer_record``,
saved by ``LitGPT.on_save_checkpoint``) and checked wherever its weights are read again
(``check_tokenizer``: a resume, ``init_from``, the scripts), before any data is read.

The identity is the token cache's own (data/tokenizers.py ``fingerprint()``: vocabulary, ranks,
special tokens, separator, the ids of a fixed probe), so a ``data.tokenizer=PATH`` file changed in
place is caught even when the token cache was already rebuilt for it. A checkpoint written
before the record existed (or by a synthetic-task run, which has no tokenizer) is accepted.
"""

from __future__ import annotations

from typing import Any

from pelab.checkpoint.errors import CheckpointError

RECORD = "pelab_tokenizer"  # the checkpoint's top-level key (plain strings: loads with weights_only=True)
KEY = "data.tokenizer"


def tokenizer_record(tokenizer) -> dict[str, str]:
    """What a checkpoint keeps of the run's tokenizer: its name (a file's resolved path) and fingerprint."""
    return {"key": KEY, "name": str(tokenizer.name), "fingerprint": tokenizer.fingerprint()}


def check_tokenizer(ckpt: dict[str, Any], where: str, spec: str | None = None, fix: str = "") -> None:
    """Refuse ``ckpt`` (read from ``where``, e.g. ``ckpt_path=PATH``) when the tokenizer ``spec``
    (the run's ``data.tokenizer``; None: the one the checkpoint names) no longer has the
    fingerprint the checkpoint recorded: its ids would be read as other tokens."""
    from data.tokenizers import get_tokenizer

    recorded = ckpt.get(RECORD)
    if not isinstance(recorded, dict) or not recorded.get("fingerprint"):
        return  # written before the record existed, or a synthetic task's: nothing to compare
    trained, spec = recorded.get("name"), str(recorded.get("name") if spec is None else spec)
    try:
        now = get_tokenizer(spec).fingerprint()
    except (ValueError, OSError) as err:  # the file is gone or no longer a tokenizer
        raise CheckpointError(f"{where} was trained on {KEY}={trained}, which cannot be loaded now ({err}); "
                              f"{fix or 'restore the tokenizer file it was trained with'}") from None
    if now != recorded["fingerprint"]:
        raise CheckpointError(
            f"{where} was trained on {KEY}={trained} (fingerprint {recorded['fingerprint'][:12]}), but {KEY}={spec} "
            f"now has fingerprint {now[:12]}: the same ids would mean other tokens; "
            f"{fix or 'restore the tokenizer file it was trained with'}")
