"""scripts/bench.py writes each row the moment it is complete (issue 50, item 6): a bench stopped
midway (the GPU acceptance's budget) has the rows it measured in ``out=``, whole lines only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.scripts.test_bench import FIELDS

ROOT = Path(__file__).resolve().parents[2]


def test_a_bench_killed_after_its_first_row_has_written_it(tmp_path: Path) -> None:
    """The smoke run has 4 rows in one group; each row's memory (and, on pelab rows, evaluation)
    is measured in a fresh child after the group's timing, seconds apart. The bench is SIGKILLed
    as soon as its first row is in the file: it must be there, complete, while the rows not yet
    measured are not (the file used to be written only when the whole group had ended)."""
    out = tmp_path / "bench.jsonl"
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "bench.py"), "smoke=true", f"out={out}"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)  # its group: the forkserver and the measuring children
    try:
        until = time.monotonic() + 600
        while time.monotonic() < until and proc.poll() is None:
            if out.is_file() and out.read_text().endswith("\n"):
                break
            time.sleep(0.02)
        assert proc.poll() is None, "the bench ended before it was killed: " + proc.stdout.read().decode()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    text = out.read_text()
    assert text.endswith("\n")  # whole lines only
    rows = [json.loads(line) for line in text.splitlines()]
    assert 1 <= len(rows) < 4, [(r["path"], r["scheme"]) for r in rows]
    first = rows[0]
    assert (first["path"], first["scheme"]) == ("reference", "learned")
    assert FIELDS <= first.keys(), FIELDS - first.keys()
    assert isinstance(first["step_ms"], float) and isinstance(first["peak_mem_mb"], float)
