"""A file (or a sharded directory) opened as a pelab checkpoint, or a ``CheckpointError`` naming
the file and what is wrong: ``weights_only=True``, tensors memory-mapped (cheap), and with
``verify=True`` every record's CRC-32 checked."""

from __future__ import annotations

import os
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from pelab.checkpoint.errors import CheckpointError
from pelab.checkpoint.sharded import DCP_METADATA, META_FILE, sharded_complete

EXPECTED = "a Lightning checkpoint written by train.py (RUN_DIR/checkpoints/*.ckpt)"
ZIP_MAGIC = b"PK\x03\x04"  # every torch.save archive (the default format since torch 1.6) starts so


def _reason(error: BaseException) -> str:
    """The line of torch's (long) weights_only refusal that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "Unsupported global" in line:
            return line.split(" was not an allowed global")[0].split("GLOBAL ")[-1]
        if line.endswith("WeightsUnpickler error:") and i + 1 < len(lines):
            return lines[i + 1]
    return (lines or [type(error).__name__])[0][:300]


def read_checkpoint(path, key: str = "ckpt_path", for_resume: bool = False, verify: bool = False) -> dict[str, Any]:
    """Open ``path`` as a pelab checkpoint or raise ``CheckpointError`` saying what is wrong.

    Loaded with ``weights_only=True`` (tensors and plain containers only, no code runs) and
    ``mmap=True`` (tensor bytes are not read), so checking a large checkpoint is quick.
    ``verify``: also read every record and check its CRC-32 (a block damaged in place, size kept,
    loads without any error otherwise: torch checks no CRC); reads the whole file once.
    ``key`` is the option the path came from (``ckpt_path``, ``ckpt``), named in errors.
    A sharded checkpoint (a directory) gives its ``meta.pt`` (everything but the tensors).
    """
    path = Path(path)
    where = f"{key}={path}"
    if path.is_dir():
        return _read_sharded(path, where, for_resume, verify)
    if not path.is_file():
        raise CheckpointError(f"{where} does not exist" if not path.exists() else f"{where} is not a file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{where} is empty (0 bytes): its save was interrupted; use an earlier checkpoint")
    with open(path, "rb") as f:
        head = f.read(16)
    if not zipfile.is_zipfile(path):
        if head.startswith(ZIP_MAGIC):  # the archive's directory is written last: the end is missing
            raise CheckpointError(
                f"{where} is truncated or corrupt ({size} bytes): it starts like a torch.save archive but "
                "its end (the zip directory) is missing, e.g. an interrupted copy; use another checkpoint "
                "such as the step*.ckpt next to it")
        raise CheckpointError(f"{where} is not a PyTorch checkpoint: it starts with {head!r} where a torch.save "
                              f"archive starts with {ZIP_MAGIC!r}; expected {EXPECTED}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        reason = _reason(e)
        if "Unsupported global" not in str(e):  # a damaged record, not a foreign object
            raise CheckpointError(f"{where} is corrupt, its pickled record cannot be read: {reason}") from e
        raise CheckpointError(
            f"{where} holds a Python object of type {reason}, which is not loaded: checkpoints are read with "
            f"weights_only=True (tensors and plain containers only, no code runs); expected {EXPECTED}") from e
    except Exception as e:  # a damaged archive: torch's zip reader or unpickler fails
        raise CheckpointError(f"{where} is corrupt, torch.load failed: {type(e).__name__}: {_reason(e)}") from e
    if verify:
        _verify_records(path, where)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        found = f"keys {sorted(map(str, ckpt))[:8]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise CheckpointError(f"{where} is a torch file but not a Lightning checkpoint (no 'state_dict'; it holds "
                              f"{found}); expected {EXPECTED}")
    return _check_contents(ckpt, where, for_resume)


def _check_contents(ckpt: dict[str, Any], where: str, for_resume: bool, sharded: bool = False) -> dict[str, Any]:
    hparams = ckpt.get("hyper_parameters")
    if not isinstance(hparams, dict) or not all(isinstance(hparams.get(k), dict) for k in ("model", "pe")):
        raise CheckpointError(f"{where} is a Lightning checkpoint but not one of pelab's LitGPT (its "
                              f"hyper_parameters lack the 'model' and 'pe' configs); expected {EXPECTED}")
    if for_resume and not sharded and "optimizer_states" not in ckpt:
        raise CheckpointError(f"{where} holds weights only (saved with save_weights_only=True, no optimizer "
                              "state): it can be evaluated or sampled from, not resumed")
    return ckpt


def _verify_records(path: Path, where: str) -> None:
    """Every record of the archive read and checked against the CRC-32 stored when it was written."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:  # a damaged local header
        bad, reason = None, f"{type(e).__name__}: {e}"
    else:
        reason = None
    if bad is not None or reason is not None:
        what = f"its record {bad!r} fails its CRC-32 check" if bad is not None else reason
        raise CheckpointError(f"{where} is corrupt ({path.stat().st_size} bytes, size intact): {what}, e.g. a "
                              "disk or copy error; use another checkpoint such as the step*.ckpt next to it")


def _read_sharded(path: Path, where: str, for_resume: bool, verify: bool) -> dict[str, Any]:
    """A sharded checkpoint directory (Lightning's FSDP ``state_dict_type=sharded``): complete,
    its ``meta.pt`` a pelab checkpoint's, its shards all there and as long as ``.metadata`` says,
    the optimizer state in it for a resume. torch.distributed.checkpoint stores no checksums, so
    ``verify`` adds nothing here."""
    try:
        names = os.listdir(path)
    except OSError as e:
        raise CheckpointError(f"{where} is a folder that cannot be read: {e.strerror}") from None
    if not any(n in (META_FILE, DCP_METADATA) or n.endswith(".distcp") for n in names):
        raise CheckpointError(f"{where} is a folder but not a checkpoint (no {META_FILE}, {DCP_METADATA} or shard "
                              "file in it): expected a .ckpt file or a sharded checkpoint directory written by train.py "
                              "(RUN_DIR/checkpoints/*.ckpt)")
    incomplete = sharded_complete(path)
    if incomplete:
        raise CheckpointError(f"{where} is {incomplete}; use another checkpoint such as a step*.ckpt next to it")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        layout = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - torch's zip reader, unpickler or DCP's reader
        raise CheckpointError(f"{where} is a sharded checkpoint whose {META_FILE} or {DCP_METADATA} cannot be "
                              f"read: {type(e).__name__}: {_reason(e)}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}/{META_FILE} holds a {type(meta).__name__}, not a Lightning checkpoint's "
                              f"metadata; expected {EXPECTED}")
    extent: dict[str, int] = {}  # bytes each shard file must hold
    for info in (layout.storage_data or {}).values():
        name = str(info.relative_path)
        extent[name] = max(extent.get(name, 0), info.offset + info.length)
    for name, size in sorted(extent.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{where} is incomplete: its shard {name} is missing")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{where} is truncated: its shard {name} holds {shard.stat().st_size} bytes, "
                                  f"its {DCP_METADATA} says {size}")
    keys = list(layout.state_dict_metadata)
    if for_resume and not any(k.startswith("optimizer_0.") for k in keys):
        raise CheckpointError(f"{where} holds weights only (no optimizer state): it can be evaluated or sampled "
                              "from, not resumed")
    return _check_contents({**meta, "state_dict": None}, where, for_resume, sharded=True)


# (path, size, mtime) of checkpoints already verified in this process: resume=auto verifies its
# pick, validation then checks ckpt_path again; a file of hundreds of GiB is read once.
_VERIFIED: dict[tuple[str, int, int], dict[str, Any]] = {}


def verified(path, key: str = "ckpt_path") -> dict[str, Any]:
    """``read_checkpoint(..., for_resume=True, verify=True)``, once per file and version."""
    path = Path(path)
    stamp_of = path / META_FILE if path.is_dir() else path
    stamp = (str(path.resolve()), *((stamp_of.stat().st_size, stamp_of.stat().st_mtime_ns)
                                    if stamp_of.is_file() else (-1, -1)))
    if stamp not in _VERIFIED:
        ckpt = read_checkpoint(path, key, for_resume=True, verify=True)
        if stamp[1] < 0:
            return ckpt
        _VERIFIED.clear()  # one entry is all a run needs
        _VERIFIED[stamp] = ckpt
    return _VERIFIED[stamp]
