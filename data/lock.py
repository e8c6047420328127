"""The token cache's build lock: one builder across processes, nodes and shared filesystems.

``build_lock(out_dir, timeout)`` holds the lock for a ``with`` block. Two files in ``out_dir``:

- ``build.owner``, the **lease**, which decides: created with ``O_CREAT | O_EXCL`` (atomic on
  local disks, NFS v3+ and Lustre, with or without ``flock``), holding the owner's pid, host,
  start time and a random token. Its mtime is the **heartbeat**: a daemon thread of the holder
  touches it every ``HEARTBEAT`` seconds. It is removed on release (only while it is still ours).
- ``build.lock``, an OS lock (``flock``) taken beside the lease where the filesystem has one, so
  that processes on one machine (and older pelab versions, which used only it) queue on it. It
  does not decide alone: on Lustre mounted ``localflock`` it is per node, and a node that died
  holding an NFS lock may never release it. The file stays (empty) after a build.

**Waiting.** A waiter prints one line naming the holder, looks again every ``POLL`` seconds,
and after ``timeout`` seconds (``data.lock_timeout``) gives up with a ``LockTimeout``: one line
naming the cache, the holder and the option.

**Taking over.** An owner on this host (and pid namespace) is judged by its process: gone
(``kill -9``, a crash) is stale at once, alive is never stale. An owner elsewhere is stale when
its heartbeat (mtime and content) has not moved for ``stale_after`` seconds of the waiter's own
watching (a crashed node, a job SLURM killed): measured by the waiter's clock only, so nodes
with skewed clocks never take a live lock (NFS attribute caching, up to 60 s, stays under it). The stale lease is
renamed away (one waiter wins the rename), checked to be the one judged stale, and removed;
the waiter then creates its own. The build it interrupted left only ``.partial`` files and no
``meta.json``: the new holder rebuilds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from data.paths import PathError, process_alive

LOCK_TIMEOUT = 3600.0  # seconds a waiter waits for another builder (data.lock_timeout)
STALE_AFTER = 120.0  # seconds without a heartbeat before a lease is taken over
HEARTBEAT = 10.0  # the holder touches its lease this often
POLL = 1.0  # a waiter looks again this often
NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP, errno.EINVAL)  # a filesystem without flock


class LockTimeout(PathError):
    """The lock was held by another process for longer than ``data.lock_timeout``: one line."""


def check_timeout(timeout, key: str = "data.lock_timeout") -> float:
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{key} must be a positive number of seconds (how long to wait for another process "
                         f"building the same token cache), got {timeout!r}")
    return float(timeout)


def pid_namespace() -> str:
    """This process's pid namespace (containers sharing a host name may not share pids)."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def try_flock(path: Path):
    """An open descriptor holding ``flock`` on ``path``; None if another process holds it; -1
    where the filesystem has no flock (the lease alone decides there)."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError as err:
        os.close(fd)
        if err.errno in (errno.EAGAIN, errno.EACCES):
            return None
        if err.errno in NO_FLOCK:
            return -1
        raise


class Lease:
    """``build.owner``: who builds, and since when (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mine = {"pid": os.getpid(), "host": socket.gethostname(), "pidns": pid_namespace(), "since": time.time(),
                     "token": secrets.token_hex(8)}
        self.text = json.dumps(self.mine)
        self.seen: tuple | None = None  # (what was read, when it was first seen) while waiting
        self._stop = threading.Event()

    def create(self) -> bool:
        """The lease made ours, whole: its text written beside it and hard-linked into place (a
        link fails if the lease exists, atomically, as O_EXCL; no reader ever sees it empty);
        O_EXCL then a write where the filesystem has no hard links."""
        beside = self.path.with_name(f"{self.path.name}.{self.mine['pid']}-{self.mine['token']}.new")
        try:
            beside.write_text(self.text)
            os.link(beside, self.path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                return False
            with os.fdopen(fd, "w") as f:
                f.write(self.text)
        finally:
            beside.unlink(missing_ok=True)
        threading.Thread(target=self._beat, name="pelab-lock-heartbeat", daemon=True).start()
        return True

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT):
            with contextlib.suppress(OSError):
                if self.path.read_text() != self.text:
                    return  # taken over: this process's heartbeat has stopped counting
                os.utime(self.path)

    def release(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            if self.path.read_text() == self.text:
                self.path.unlink()

    def read(self) -> tuple[str, int] | None:
        """(the lease's text, its mtime in ns), or None when there is none."""
        try:
            return self.path.read_text(), self.path.stat().st_mtime_ns
        except OSError:
            return None

    def stale(self, found: tuple[str, int], stale_after: float) -> str | None:
        """Why the lease ``found`` (``read()``) is stale, or None while it looks alive."""
        owner = describe(found[0])
        if (owner.get("host"), owner.get("pidns")) == (self.mine["host"], self.mine["pidns"]) and \
                isinstance(owner.get("pid"), int):  # its pid means something here: alive or not decides
            return None if process_alive(owner["pid"]) else "its process is gone"
        now = time.monotonic()
        if self.seen is None or self.seen[0] != found:
            self.seen = (found, now)  # the heartbeat moved (or a new owner): watch again
            return None
        if now - self.seen[1] >= stale_after:
            return f"its heartbeat stopped for {round(now - self.seen[1], 1):g} s"
        return None

    def take_over(self, found: tuple[str, int]) -> bool:
        """Move the stale lease ``found`` away; True when this process did."""
        grave = self.path.with_name(f"{self.path.name}.{self.mine['host']}.{self.mine['pid']}.stale")
        try:
            os.rename(self.path, grave)
        except OSError:
            return False  # another waiter moved it first
        try:
            if grave.read_text() != found[0]:  # a fresh owner's lease, moved by mistake: put it back
                with contextlib.suppress(OSError):
                    os.link(grave, self.path)
                return False
            return True
        finally:
            grave.unlink(missing_ok=True)


def describe(text: str) -> dict:
    try:
        owner = json.loads(text)
        return owner if isinstance(owner, dict) else {}
    except ValueError:
        return {}


def holder_line(found: tuple[str, int] | None) -> str:
    """``pid N on HOST since HH:MM:SS`` of a lease's text, or what can be said without one."""
    if found is None:
        return "another process"
    owner = describe(found[0])
    if "pid" not in owner:
        return found[0].strip()[:120] or "another process"  # an older pelab's owner line
    since = time.strftime("%H:%M:%S", time.localtime(owner.get("since", 0)))
    beat = max(0.0, time.time() - found[1] / 1e9)
    return f"pid {owner['pid']} on {owner.get('host', '?')} since {since} (heartbeat {beat:.0f} s ago)"


@contextlib.contextmanager
def build_lock(out_dir: Path, timeout: float = LOCK_TIMEOUT, stale_after: float = STALE_AFTER, poll: float = POLL):
    """Hold ``out_dir``'s build lock for the block; if another process holds it, say so once,
    wait up to ``timeout`` seconds, taking it over if it goes stale, else raise ``LockTimeout``."""
    timeout = check_timeout(timeout)
    out_dir = Path(out_dir)
    lease, deadline, said = Lease(out_dir / "build.owner"), time.monotonic() + timeout, False
    flock, held, took_over = None, False, False  # flock: a descriptor while held, -1 where there is none
    waited = False  # one poll has passed (a lease not yet written is then named "another process")
    try:
        while True:
            if flock is None:
                flock = try_flock(out_dir / "build.lock")
            # the lease is created by the flock's holder, or by whoever just moved a stale lease away
            # (a flock held by a dead node's process may never be released)
            if (flock is not None or took_over) and lease.create():
                held = True
                break
            took_over = False
            found = lease.read()
            if found is not None and not found[0].strip():  # created, its text not yet written: as if absent
                found = None
            if found is not None and (why := lease.stale(found, stale_after)) is not None:
                if lease.take_over(found):
                    print(f"[pelab] token cache {out_dir}: took over the build lock of {holder_line(found)}: {why}",
                          flush=True)
                    took_over = True
                lease.seen = None
                continue
            if not said and (found is not None or waited):  # a holder between its flock and its lease's text: look again
                print(f"[pelab] token cache {out_dir} is being built by {holder_line(found)}; waiting for it "
                      f"(up to data.lock_timeout={timeout:g} s)", flush=True)
                said = True
            left = deadline - time.monotonic()
            if left <= 0:
                raise LockTimeout(
                    f"{out_dir}: gave up waiting for the token cache after data.lock_timeout={timeout:g} s: it is "
                    f"being built by {holder_line(found)}; let that build finish (or stop it), or raise "
                    f"data.lock_timeout (a lock whose heartbeat stops for {stale_after:g} s is taken over)")
            time.sleep(min(poll, left))
            waited = True
        yield
    finally:
        if held:
            lease.release()
        if flock is not None and flock >= 0:
            os.close(flock)  # releases the flock
