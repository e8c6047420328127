"""``python ARGS`` for tests, without paying Lightning's import each time.

A command-line run (``train.py``, ``scripts/*.py``, ``-c CODE``) spends ~8 s of CPU importing
torch, Lightning (whose torchmetrics pulls in transformers and scipy) and Hydra before it does
anything; the suite runs dozens. ``run_python`` runs them in a child forked from a
multiprocessing forkserver that imported those once (one server per test process), with the
given argv, working directory and environment, its stdout and stderr captured: what
``subprocess.run([sys.executable, *args], capture_output=True, text=True)`` returns, for a fresh
``__main__``. What a fork cannot give stays on ``subprocess``: signals sent from outside, several
processes (torchrun, DDP, FSDP), and the tests of commands exactly as a user types them.
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PRELOAD = ["torch", "lightning.pytorch", "hydra", "omegaconf", "wandb"]
# variables the preloaded modules read once on import (threads, Hugging Face's offline mode and
# caches, torch's and CUDA's settings): a run that sets them otherwise gets a real subprocess
IMPORT_TIME = ("OMP_", "MKL_", "HF_", "HUGGINGFACE_", "TRANSFORMERS_", "TORCH", "PYTORCH_", "CUDA_")
_context, _server_env = None, {}


def _forkserver():
    global _context, _server_env
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
        _server_env = dict(os.environ)  # what the server, started on the first run, imports with
    return _context


def _imports_differently(env: dict) -> bool:
    keys = {k for k in (*env, *_server_env) if k.startswith(IMPORT_TIME)}
    return any(env.get(k) != _server_env.get(k) for k in keys)


def _main(args: list[str], cwd: str, env: dict, out: str, err: str) -> None:
    """In the forked child: become ``python ARGS`` in ``cwd`` with ``env``, then exit with its code."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    for fd, path in ((1, out), (2, err)):
        target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(target, fd)
        os.close(target)
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False, buffering=1)
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv, sys.path[:0] = ["-c", *args[2:]], ["", *extra]
            exec(compile(args[1], "<string>", "exec"), {"__name__": "__main__"})
        elif args[0] == "-m":
            sys.argv, sys.path[:0] = [args[1], *args[2:]], [cwd, *extra]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            script = os.path.abspath(args[0])
            sys.argv, sys.path[:0] = [args[0], *args[1:]], [os.path.dirname(script), *extra]
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 - what the interpreter does with an uncaught exception
        traceback.print_exc()
        code = 1
    atexit._run_exitfuncs()  # a forked child skips them; W&B finishes its runs there
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_python(args: list, cwd: Path | str = ROOT, env: dict | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess:
    """``python *args`` (a script and its arguments, ``-c CODE ...`` or ``-m MODULE ...``) in a
    child of the forkserver: a CompletedProcess with text stdout and stderr (always captured, as
    ``subprocess.run(..., capture_output=True, text=True)``), or TimeoutExpired."""
    args, env = [str(a) for a in args], dict(os.environ if env is None else env)
    cmd = [sys.executable, *args]
    context = _forkserver()
    if _imports_differently(env):
        return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="pelab-cli-") as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        child = context.Process(target=_main, args=(args, str(cwd), env, out, err))
        child.start()
        child.join(timeout)
        timed_out = child.exitcode is None
        if timed_out:
            child.kill()
            child.join()

        def read(path):
            return Path(path).read_text(encoding="utf-8", errors="replace") if os.path.exists(path) else ""

        stdout, stderr = read(out), read(err)
    if timed_out:
        raise subprocess.TimeoutExpired(cmd, timeout, output=stdout, stderr=stderr)
    return subprocess.CompletedProcess(cmd, child.exitcode, stdout, stderr)


def kill_at_marker(child: subprocess.Popen, marker: Path, timeout_s: float) -> None:
    """SIGKILL ``child`` as soon as it has written ``marker`` (its point of no return), failing with
    its output if it never does; the child is reaped either way."""
    import signal
    import time

    try:
        deadline = time.monotonic() + timeout_s
        while not marker.exists() and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), child.communicate(timeout=30)
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    finally:
        if child.poll() is None:
            child.kill()
