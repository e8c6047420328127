"""Paths as options, and what the filesystem does to a write, each as one line.

Every output path option (``data.data_dir``, ``callbacks.*.dirpath``, a script's ``out=`` and
``work=``) is checked here before any data is read: that it exists or can be created, that it is
the right kind (a file, a folder), that this user can write it, and that it is not one of the
command's own inputs. An input is checked by its reader, which knows its kind
(``data.tokenizer``: data/tokenizers.py; ``data.paths``: data/corpus.py; ``ckpt=``:
pelab/checkpoint/). A write that fills the disk is said the same way (``no_space``). A failure
is a ``PathError``: a ValueError whose message is the one line ``KEY=VALUE: what is wrong; what
to do``. Standard library only (data/ and everything above it use it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class PathError(ValueError):
    """A path that cannot serve its option, or a write the filesystem refused: one line."""


def folder_problem(path: Path) -> tuple[Path, str] | None:
    """Why ``path`` cannot be used (or created) as a folder to write into: (the nearest part of
    it that exists, what is wrong with that part), or None. Creates nothing that stays."""
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        return existing, "a file, not a folder"
    try:  # a real write: permission bits say nothing for root, ACLs or read-only mounts
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as err:
        if err.errno == errno.EROFS:
            return existing, "a folder on a read-only filesystem"
        if err.errno in DISK_FULL:
            return existing, "a folder on a full disk (no space left on device)"
        return existing, f"a folder this user cannot write ({err.strerror or err})"
    return None


def output_folder(key: str, given, purpose: str = "", inputs: dict | None = None, beside: bool = False) -> Path:
    """``given`` (the value of ``key``) usable as a folder to write into: it, or the nearest part
    of it that exists, is a writable folder, and it is none of the command's ``inputs``
    ({key: path}) nor holds or lies inside one. ``purpose``: said after what to give (", for the
    report"). ``beside``: the folder is written beside it and renamed into place (whatever is
    there now is replaced): its parent is what must be writable."""
    path = Path(os.path.expanduser(str(given))).absolute()
    problem = folder_problem(path.parent if beside else path)
    if problem:
        existing, what = problem
        where = " is" if existing == path else f": {existing} above it is"
        raise PathError(f"{key}={given}{where} {what}; give {key}= a new folder, or an existing folder this "
                        f"user can write{purpose}")
    clash(key, given, path, inputs)
    return path


def output_file(key: str, given, purpose: str = "", inputs: dict | None = None) -> Path:
    """``given`` (the value of ``key``) usable as a file to write: not a folder, in a folder that
    exists or can be created and that this user can write, and none of the command's ``inputs``."""
    path = Path(os.path.expanduser(str(given))).absolute()
    if path.is_dir():
        raise PathError(f"{key}={given} is a folder, not a file; give {key}= a file's path{purpose}")
    problem = folder_problem(path.parent)
    if problem:
        existing, what = problem
        raise PathError(f"{key}={given}: {existing} above it is {what}; give {key}= a file in a folder this "
                        f"user can write{purpose}")
    clash(key, given, path, inputs)
    return path


def overlap(output: Path, source: Path) -> str | None:
    """How an output path meets a path the command reads: "is" it, "holds" it, "lies inside" it, or None."""
    src, dst = Path(os.path.expanduser(str(source))).resolve(), Path(output).resolve()
    return "is" if dst == src else "holds" if dst in src.parents else "lies inside" if src in dst.parents else None


def clash(key: str, given, path: Path, inputs: dict | None) -> None:
    """An output that is, holds or lies inside one of the command's inputs would overwrite what
    the command reads: refused."""
    for source_key, source in (inputs or {}).items():
        how = overlap(path, source)
        if how is not None:
            raise PathError(f"{key}={given} {how} {source_key}={source}, which the command reads; give {key}= "
                            f"a path apart from it")


# --- a full disk ---------------------------------------------------------------------------------

# how Rust's std::io::Error prints an errno (safetensors and tokenizers raise their own types)
RUST_OS_ERRORS = tuple(f"(os error {code})" for code in DISK_FULL)


def disk_full(err: BaseException | None) -> bool:
    """Whether ``err`` (or what it was raised from) is a write refused for want of space or quota:
    an OSError, or a library's own error carrying one (safetensors: ``... (os error 28)``)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in DISK_FULL or any(e in str(err) for e in RUST_OS_ERRORS):
            return True
        err = err.__cause__ or err.__context__
    return False


def free_space(path: Path) -> str:
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    try:
        return f"{shutil.disk_usage(existing).free / 2**20:.1f} MiB free there now"
    except (OSError, TypeError):
        return "free space unknown"


def no_space(path: Path, doing: str, elsewhere: str) -> PathError:
    """The one line for a write into ``path`` that filled its disk while ``doing`` something; the
    caller has removed what it half-wrote. ``elsewhere``: the option that moves it."""
    error = PathError(f"{path}: no space left on device while {doing} ({free_space(Path(path))}; nothing "
                      f"half-written is kept): free space or point {elsewhere} elsewhere")
    error.__suppress_context__ = True
    return error


# --- what a killed writer leaves -----------------------------------------------------------------

def process_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, exited but not yet reaped, does not)."""
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by another user
        return True
    with contextlib.suppress(OSError, IndexError):  # Linux: a killed child not yet reaped
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def aside_name(path: Path, suffix: str) -> Path:
    """``.NAME.<pid>-<id>.<suffix>`` beside ``path``: a writer's temporary or set-aside copy,
    named by its process so that the next writer knows when its owner is gone."""
    return path.parent / f".{path.name}.{os.getpid()}-{os.urandom(4).hex()}.{suffix}"


def remove_dead_leftovers(path: Path, suffixes: tuple[str, ...] = ("tmp", "old")) -> list[Path]:
    """Remove the ``aside_name``s of ``path`` whose process is gone (a killed writer's); a live
    writer's are kept. Returns what was removed."""
    pattern = re.compile(rf"\.{re.escape(path.name)}\.(\d+)-[0-9a-f]{{8}}\.({'|'.join(map(re.escape, suffixes))})")
    removed = []
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.iterdir():
        match = pattern.fullmatch(entry.name)
        if match and not process_alive(int(match.group(1))):
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
            removed.append(entry)
    return removed
