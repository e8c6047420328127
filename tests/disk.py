"""A full disk for tests: a file wrapper whose writes fail with ENOSPC past a byte budget."""

from __future__ import annotations

import errno
import os


class FullDisk:
    """Test-only: a file whose writes fail with ENOSPC once ``room`` bytes are written."""

    def __init__(self, f, room: int) -> None:
        self.f, self.room = f, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= size
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.f.close()
