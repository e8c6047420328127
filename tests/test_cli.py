"""tests/cli.py's ``run_python`` gives what ``subprocess.run([sys.executable, ...])`` gives."""

import os
import subprocess
import sys

import pytest

from tests.cli import run_python

SNIPPET = """
import atexit, os, sys
atexit.register(lambda: print("at exit", flush=True))
print("argv", sys.argv[1:], "cwd", os.path.basename(os.getcwd()), "env", os.environ.get("PELAB_CLI_PROBE"))
print("on stderr", file=sys.stderr)
if sys.argv[1] == "raise":
    raise ValueError("uncaught")
sys.exit(int(sys.argv[1]) if sys.argv[1].isdigit() else sys.argv[1])
"""


@pytest.mark.parametrize("arg", ["0", "3", "raise", "a message"])
def test_run_python_equals_a_subprocess(tmp_path, arg):
    env = {**os.environ, "PELAB_CLI_PROBE": "seen"}
    real = subprocess.run([sys.executable, "-c", SNIPPET, arg], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)
    forked = run_python(["-c", SNIPPET, arg], cwd=tmp_path, env=env, timeout=60)
    assert forked.returncode == real.returncode == {"0": 0, "3": 3}.get(arg, 1)
    assert forked.stdout == real.stdout
    assert f"argv ['{arg}'] cwd {tmp_path.name} env seen" in forked.stdout and "at exit" in forked.stdout
    assert forked.stderr.splitlines()[0] == real.stderr.splitlines()[0] == "on stderr"
    assert forked.stderr.splitlines()[-1] == real.stderr.splitlines()[-1]  # the exception's line, the message


def test_a_script_sees_its_own_folder_first_and_a_timeout_is_raised(tmp_path):
    (tmp_path / "helper_mod.py").write_text("VALUE = 7\n")
    (tmp_path / "main.py").write_text("import sys, helper_mod\nprint(sys.argv, helper_mod.VALUE)\n")
    proc = run_python([str(tmp_path / "main.py"), "x=1"], timeout=60)
    assert (proc.returncode, proc.stdout) == (0, f"['{tmp_path / 'main.py'}', 'x=1'] 7\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(30)"], timeout=2)
