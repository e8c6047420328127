"""Atomic, durable local saves: a checkpoint file is complete under its name or not there at all.

The Trainer's CheckpointIO plugin (conf/trainer/default.yaml) writes a hidden temporary file in
the checkpoint's own directory, fsyncs it, then ``os.replace``s it over the final name, so a
kill (or power loss) mid-save leaves the previous file intact. A save that runs out of space
fails with one line; a state holding NaN/inf weights is not written.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pelab.checkpoint.errors import CheckpointError


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable.

    Lightning 2.6's own ``_atomic_save`` serialises the whole checkpoint into memory, writes it to a
    temporary file in the *system* temp dir and moves it into place: when that dir is on another
    filesystem (a tmpfs ``/tmp``, a network checkpoint dir) the move is a copy into the final name,
    so a kill mid-copy leaves a truncated file; nothing is fsynced either. Here the temporary file
    sits next to the target (same filesystem, so ``os.replace`` is atomic), the checkpoint streams
    into it, and file and directory are fsynced. Remote (fsspec URL) paths keep Lightning's save.

    ``refuse_non_finite``: a state dict holding NaN/inf weights is not written (the previous file
    under that name is kept), whatever made the weights non-finite.
    """

    def __init__(self, refuse_non_finite: bool = True) -> None:
        super().__init__()
        self.refuse_non_finite = refuse_non_finite

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if self.refuse_non_finite:
            _refuse_non_finite(checkpoint.get("state_dict", {}), path)
        atomic_torch_save(checkpoint, Path(path))


def atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left behind by a save that was killed
        stale.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        # os.open with 0o666 lets the umask set the permissions, as for any new file
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        raise disk_full_error(err, path) or err
    fsync_dir(path.parent)


def fsync_dir(directory: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):  # make a rename itself durable (POSIX)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _causes(err: BaseException):
    """``err``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` carries."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # rank -> exception (or a wrapper)
            todo.append(failure if isinstance(failure, BaseException) else getattr(failure, "exc", None))


def disk_full_error(err: BaseException, path) -> CheckpointError | None:
    """One line for a save that ran out of space (torch's own error is two chained tracebacks,
    ``No space left on device`` then ``enforce fail at inline_container.cc``), or None."""
    if not any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(err)):
        return None
    directory = Path(path).parent
    try:
        free = f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free there now"
    except OSError:
        free = "free space unknown"
    error = CheckpointError(f"no space left on the device of {directory} while saving {Path(path).name} "
                            f"({free}); the checkpoints already there are intact: free space or point "
                            "callbacks.model_checkpoint.dirpath elsewhere, then resume=auto")
    error.__suppress_context__ = True
    return error


def _refuse_non_finite(state_dict: dict[str, Any], path) -> None:
    floats = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if not floats:
        return
    finite = [bool(v.isfinite().all()) for v in floats.values()]  # once per save, not per step
    if all(finite):
        return
    bad = [k for k, ok in zip(floats, finite) if not ok]
    raise CheckpointError(
        f"refusing to write {path}: {len(bad)} weight tensor(s) are not finite (NaN/inf), first {bad[0]!r}; "
        "the previous file under that name is kept"
    )
