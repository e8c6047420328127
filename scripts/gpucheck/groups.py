"""The process groups of the steps running now, and what ends them whatever ends the run.

Each step runs in a session of its own (its process group holds pytest's workers, train.py's
DDP ranks and compile workers), so a signal to the runner's own group does not reach the steps.
They end in three ways:

- a step that exits, or is stopped at its timeout or the run's deadline: its group is ended
  (``ended``: what it left behind too);
- SIGTERM or SIGINT to the runner (``stop``, from gpu_check.py's handlers): every running group
  is stopped politely in parallel (stop_group's SIGINT, SIGTERM, SIGKILL) and no further step
  starts;
- the runner killed outright (SIGKILL, an out-of-memory kill): a guardian process in a session
  of its own holds the list of running groups, read from a pipe the runner writes; when the
  pipe closes (the runner is gone, however it died) it sends SIGTERM to each group still
  there, then SIGKILL.

Run as a script, this file is the guardian.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

GUARDIAN_GRACE_S = 5  # between the guardian's SIGTERM and its SIGKILL


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:  # a member this user cannot signal: not one of the runner's
        return False


def kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class StepGroups:
    """The running steps' processes (each the leader of its group), the guardian that outlives the
    runner, and the stop asked for by a signal (``stopped``: its name, or None)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.procs: dict[int, subprocess.Popen] = {}
        self.guardian: subprocess.Popen | None = None
        self.stopped: str | None = None

    def started(self, proc: subprocess.Popen) -> None:
        with self.lock:
            self.procs[proc.pid] = proc
            self._tell(f"+{proc.pid}")

    def ended(self, proc: subprocess.Popen) -> None:
        """The step's leader has exited (and was waited for): end what is left of its group
        (a child it did not wait for still holds the GPU), then forget it."""
        kill_group(proc.pid, signal.SIGKILL)
        with self.lock:
            self.procs.pop(proc.pid, None)
            self._tell(f"-{proc.pid}")

    def stop(self, why: str, stop_group) -> None:
        """Stop every running step (``stop_group(proc)`` each, in parallel threads, so one slow
        to stop does not delay the others); steps not started yet are skipped (``stopped``)."""
        with self.lock:
            self.stopped = self.stopped or why
            running = list(self.procs.values())
        for proc in running:
            threading.Thread(target=stop_group, args=(proc,), daemon=True).start()

    def _tell(self, line: str) -> None:
        """One line to the guardian (started with the first step)."""
        if self.guardian is None or self.guardian.poll() is not None:
            self.guardian = subprocess.Popen([sys.executable, os.path.abspath(__file__)], stdin=subprocess.PIPE,
                                             stdout=subprocess.DEVNULL, start_new_session=True, text=True)
            for pid in self.procs:  # a guardian started again (the first one died) learns every group
                self.guardian.stdin.write(f"+{pid}\n")
        try:
            self.guardian.stdin.write(line + "\n")
            self.guardian.stdin.flush()
        except (BrokenPipeError, OSError):  # the guardian died: the next line starts another
            self.guardian = None


def guard() -> None:
    """The guardian: read ``+PGID`` / ``-PGID`` lines until the runner's end of the pipe closes,
    then end every group still listed: SIGTERM, then SIGKILL after GUARDIAN_GRACE_S."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # it ends when the runner is gone, not before
    groups: set[int] = set()
    for line in sys.stdin:
        line = line.strip()
        if line[:1] == "+":
            groups.add(int(line[1:]))
        elif line[:1] == "-":
            groups.discard(int(line[1:]))
    left = [g for g in groups if group_alive(g)]
    for pgid in left:
        kill_group(pgid, signal.SIGTERM)
    until = time.monotonic() + GUARDIAN_GRACE_S
    while left and time.monotonic() < until:
        time.sleep(0.1)
        left = [g for g in left if group_alive(g)]
    for pgid in left:
        kill_group(pgid, signal.SIGKILL)


if __name__ == "__main__":
    guard()
