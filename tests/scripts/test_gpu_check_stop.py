"""scripts/gpu_check.py stopped from outside ends its steps' whole process groups (issue 50, item 6):
SIGTERM or SIGINT to the runner stops each running step (children included), skips the steps not
started and still writes the report; a runner killed outright (SIGKILL) leaves its guardian,
which ends them. And a failed step's reason is the exception it died of, also when Hydra's
instantiate wrapped it (the log then ends in ``full_key: ...``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

from gpucheck import runner, steps  # noqa: E402

# gpu_check.main on a faked CUDA machine, one lane: a step whose child (the grandchild of the
# runner, in the step's process group) sleeps, then a step that must never start
RUNNER = """
import sys
sys.path.insert(0, {scripts!r})
import torch
import gpu_check
from gpucheck import runner, steps

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
runner.machine = lambda: {{"host": "h", "python": "3", "torch": "t", "cuda": "c", "lightning": "l", "started": "now",
                          "gpus": []}}
gpu_check.preflight = lambda gpus: steps.Outcome(steps.Step("preflight", "preflight", "", [], 60, None), "pass")

def step(name, code):
    return steps.Step(name, "test", "stand-in", [sys.executable, "-c", code], 600,
                      lambda result: (*(steps.ok_exit(result) or ("pass", "")), {{}}))

parent = '''
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
open({pids!r}, "w").write(str(child.pid))
time.sleep(600)
'''
steps.parts = lambda work, schemes, gpus, workers: {{"1": steps.Part("1", "stand-ins", 540, [
    [step("parent", parent), step("after", "print('should not run')")]])}}
sys.exit(gpu_check.main(["part=1", "out={out}", "work={work}"]))
"""


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan no init process reaps stays one in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def gone_within(pid: int, seconds: float) -> bool:
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if not alive(pid):
            return True
        time.sleep(0.1)
    return not alive(pid)


def start_runner(tmp_path: Path) -> tuple[subprocess.Popen, int, Path]:
    """The runner running the sleeping step: (its process, the step's child's pid, out folder)."""
    out, work, pids = tmp_path / "out", tmp_path / "work", tmp_path / "child.pid"
    code = RUNNER.format(scripts=str(ROOT / "scripts"), out=str(out), work=str(work), pids=str(pids))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    for _ in range(1200):
        if pids.is_file() and pids.read_text().strip():
            break
        assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
        time.sleep(0.1)
    else:
        proc.kill()
        raise AssertionError("the step never started its child")
    return proc, int(pids.read_text()), out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_the_runner_ends_each_steps_group_and_skips_the_rest(tmp_path, sig):
    proc, child, out = start_runner(tmp_path)
    try:
        assert alive(child)
        proc.send_signal(sig)
        printed = proc.communicate(timeout=120)[0].decode()
        assert gone_within(child, 10), "the step's child outlived the stopped runner"
    finally:
        proc.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)
    assert proc.returncode == 1, printed[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    statuses = {s["name"]: (s["status"], s["reason"]) for s in report["steps"]}
    name = signal.Signals(sig).name
    assert statuses["parent"][0] == "fail" and f"the run was stopped ({name})" in statuses["parent"][1]
    assert statuses["after"] == ("skip", f"the run was stopped ({name}) before this step started")
    assert "should not run" not in printed and f"stopped by {name}" in printed


def test_a_runner_killed_outright_leaves_no_step_running(tmp_path):
    """SIGKILL: nothing of the runner runs after it; the guardian (its own session) ends the groups."""
    proc, child, _ = start_runner(tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=30)
        assert gone_within(child, 30), "the step's child outlived the killed runner"
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_step_that_ends_leaves_nothing_of_its_group(tmp_path):
    """A step whose process exits while a child it started still runs: the child is ended too."""
    pids = tmp_path / "child.pid"
    code = textwrap.dedent(f"""
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pids)!r}, "w").write(str(child.pid))
    """)
    step = steps.Step("leaves", "test", "", [sys.executable, "-c", code], 60, lambda r: ("pass", "", {}))
    outcome = runner.run_step(step, tmp_path, runner.child_env(tmp_path), time.monotonic() + 600, 1)
    child = int(pids.read_text())
    try:
        assert outcome.status == "pass" and gone_within(child, 10)
    finally:
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_an_error_inside_hydras_instantiate_is_reported_as_itself(tmp_path):
    """Hydra's instantiate raises InstantiationException from the target's error; with
    HYDRA_FULL_ERROR=1 the log ends in ``full_key: trainer``, which was the step's reason."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent("""
        import hydra
        from omegaconf import OmegaConf

        class Trainer:
            def __init__(self, devices):
                raise ValueError(f"trainer.devices must be >= 1, got {devices}")

        print("composing", flush=True)
        hydra.utils.instantiate(OmegaConf.create({"trainer": {"_target_": "__main__.Trainer", "devices": 0}}).trainer)
    """))
    step = steps.Step("train_broken", "train", "", [sys.executable, str(app)], 60,
                      lambda r: (*steps.ok_exit(r), {}))
    outcome = runner.run_step(step, tmp_path, runner.child_env(tmp_path), time.monotonic() + 600, 1)
    log = (tmp_path / "logs" / "train_broken.log").read_text()
    assert log.rstrip().endswith("full_key: trainer")  # what the reason used to be
    assert outcome.status == "fail"
    assert outcome.reason == ("exit code 1: ValueError: trainer.devices must be >= 1, got 0 "
                              "(raised inside hydra.errors.InstantiationException)"), outcome.reason


def traceback(kind: str, message: str) -> str:
    return f'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n    f()\n{kind}: {message}\n'


@pytest.mark.parametrize("log, expected", [
    (traceback("KeyError", "'a'"), "KeyError: 'a'"),
    # "during handling" is not a cause: the last exception is what the process died of
    (traceback("KeyError", "'a'") + "\nDuring handling of the above exception, another exception occurred:\n\n"
     + traceback("RuntimeError", "boom"), "RuntimeError: boom"),
    # a chain of two causes: the innermost, the outermost named
    (traceback("OSError", "disk") + f"\n{steps.CAUSED}\n\n" + traceback("ValueError", "v") + f"\n{steps.CAUSED}\n\n"
     + traceback("pkg.Wrapper", "call failed:\nValueError('v')\nfull_key: data"),
     "OSError: disk (raised inside pkg.Wrapper)"),
    # a multi-line message, joined
    (traceback("ValueError", "first\nsecond"), "ValueError: first second"),
    # a traceback the process survived (the log goes on after it): not its exit's reason
    (traceback("KeyError", "'a'") + "\nhandled; carrying on\nbroken: reason\n", None),
    ("broken: reason\n", None),
])
def test_the_exception_a_log_ends_with(log, expected):
    assert steps.raised("some output\n" + log) == expected
