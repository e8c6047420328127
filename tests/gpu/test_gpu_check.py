"""scripts/gpu_check.py on a CPU machine (its plan, nothing run, exit 0) and the parts of the run
that need no GPU: step selection, the runner (exit codes, timeouts that end the whole process
group, the budget, GPU counts), the parsers of pytest's junit xml, train.py's output and the
bench's rows, and the report."""

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

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_check  # noqa: E402
from benchkit import report  # noqa: E402
from gpucheck import runner, steps  # noqa: E402
from model.pe import SCHEMES  # noqa: E402


def test_without_cuda_it_prints_the_plan_runs_nothing_and_exits_0(tmp_path):
    out, work = tmp_path / "report", tmp_path / "work"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", f"out={out}", f"work={work}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = proc.stdout
    assert "no CUDA device here: nothing is run" in text
    for step in steps.all_steps(work, sorted(SCHEMES), 0, gpu_check.WORKERS):  # every step, with its command
        assert f" {step.name} (" in text and step.shown() in text
    assert "-m pytest -m cuda" in text and "scripts/bench.py configs=gpt2-gpt2:" in text
    for scheme in SCHEMES:
        assert f"train.py trainer=gpu pe={scheme} " in text
    # what to install, and how, offline
    assert "pip download --no-deps --only-binary=:all: --python-version 3.12" in text
    assert "hydra-core==" in text and "omegaconf==" in text and "datasets==" in text
    assert "pip wheel --no-deps -w .whl antlr4-python3-runtime==" in text
    assert "pip install -q --no-index --no-deps" in text
    assert not out.exists() and not work.exists(), "the plan must not create the report folder"


def test_help_prints_the_usage_and_every_option(capsys):
    for flag in ("--help", "-h"):
        assert gpu_check.main([flag]) == 0
        printed = capsys.readouterr().out
        assert "python scripts/gpu_check.py" in printed
        assert all(f"  {key} " in printed for key in gpu_check.OPTIONS)
    with pytest.raises(SystemExit, match="expected key=value"):  # other bare words stay errors
        gpu_check.main(["nonsense"])


def test_no_process_is_started_without_cuda_nor_with_plan_true(tmp_path, monkeypatch, capsys):
    import torch

    def refuse(*args, **kwargs):
        raise AssertionError(f"started a process: {args[:1]}")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(gpu_check, "preflight", refuse)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([f"out={tmp_path / 'a'}"]) == 0
    # a GPU machine asked for the plan only
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_check.main(["plan=true", f"out={tmp_path / 'b'}"]) == 0
    assert "GPUs here: 1" in capsys.readouterr().out
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_the_preflight_imports_each_package_not_just_finds_it(tmp_path, monkeypatch):
    """A package that is installed but breaks on import (datasets over a too old pyarrow) must
    fail the preflight: find_spec alone finds it."""
    import importlib.util

    from gpucheck import needs

    (tmp_path / "brokenpkg").mkdir()
    (tmp_path / "brokenpkg" / "__init__.py").write_text("raise ImportError('pyarrow >= 24 is required')\n")
    (tmp_path / "oddpkg.py").write_text("raise AttributeError('module pyarrow has no attribute Table')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(needs, "NEEDS", [("json", "json", "0", False, "ok"),
                                         ("brokenpkg", "broken-dist", "1", True, "breaks"),
                                         ("oddpkg", "odd-dist", "1", True, "breaks otherwise"),
                                         ("surely_absent_pkg", "absent-dist", "1", True, "absent")])
    assert importlib.util.find_spec("brokenpkg") is not None  # what the old check looked at
    assert needs.not_importable() == ["broken-dist (ImportError: pyarrow >= 24 is required)",
                                      "odd-dist (AttributeError: module pyarrow has no attribute Table)",
                                      "absent-dist (ModuleNotFoundError: No module named 'surely_absent_pkg')"]


def test_steps_are_selected_by_name_or_group(tmp_path):
    every = steps.all_steps(tmp_path, sorted(SCHEMES), 1)
    train = gpu_check.select(every, "train")
    assert {s.name for s in train} == {f"train_{s}" for s in SCHEMES} | {f"train_{e}" for e in steps.TRAIN_EXTRAS}
    assert [s.name for s in gpu_check.select(every, "bench_core,cuda_tests")] == ["cuda_tests", "bench_core"]
    assert [s.name for s in gpu_check.select(every, "bench")] == [  # a group
        "bench_core", "bench_bias_documents", "bench_2026", "bench_bias_table"]
    with pytest.raises(SystemExit, match="unknown steps"):
        gpu_check.select(every, "nonsense")


def py_step(name: str, code: str, timeout_s: int = 60, gpus: int = 1) -> steps.Step:
    def parse(result: steps.Result):
        bad = steps.ok_exit(result)
        return (*bad, {}) if bad else ("pass", "", {"log": result.log.strip().splitlines()[-1]})

    return steps.Step(name, "test", "a test step", [sys.executable, "-c", textwrap.dedent(code)], timeout_s, parse,
                      gpus)


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan that no init process reaps stays one in a container)."""
    for _ in range(50):
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_runner_statuses_timeouts_budget_and_gpu_counts(tmp_path):
    env = runner.child_env(tmp_path)
    deadline = time.monotonic() + 600
    ok = runner.run_step(py_step("ok", "print('done')"), tmp_path, env, deadline, gpus=1)
    assert (ok.status, ok.numbers["log"]) == ("pass", "done")
    assert (tmp_path / "logs" / "ok.log").read_text().startswith("$ python -c")
    bad = runner.run_step(py_step("bad", "print('broken here'); raise SystemExit(3)"), tmp_path, env, deadline, 1)
    assert bad.status == "fail" and bad.reason.startswith("exit code 3: broken here")
    # a timeout ends the step's whole process group, children included
    pid_file = tmp_path / "child.pid"
    hang = py_step("hang", f"""
        import subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
    """, timeout_s=3)
    t0 = time.monotonic()
    hung = runner.run_step(hang, tmp_path, env, deadline, 1)
    assert hung.status == "fail" and hung.reason.startswith("timed out") and time.monotonic() - t0 < 60
    assert not running(int(pid_file.read_text())), "the step's child outlived its timeout"
    late = runner.run_step(py_step("late", "print(1)"), tmp_path, env, time.monotonic() + runner.MIN_START_S - 1, 1)
    assert late.status == "skip" and "budget" in late.reason
    two = runner.run_step(py_step("two", "print(1)", gpus=2), tmp_path, env, deadline, 1)
    assert two.status == "skip" and "needs 2 GPUs, 1 present" in two.reason


def test_a_failed_hydra_step_reports_the_exception_not_hydras_hint(tmp_path):
    """train.py runs under @hydra.main, which ends a failure with "Set the environment variable
    HYDRA_FULL_ERROR=1 for a complete stack trace." unless that variable is set: the step's
    reason must be the exception."""
    app = tmp_path / "app.py"
    app.write_text(textwrap.dedent("""
        import hydra

        @hydra.main(version_base="1.3", config_path=None)
        def main(cfg):
            raise ValueError("data.document_mask: expected a bool")

        main()
    """))
    step = steps.Step("train_broken", "train", "a failing Hydra app", [sys.executable, str(app),
                      f"hydra.run.dir={tmp_path / 'run'}"], 60, lambda r: (*steps.ok_exit(r), {}))
    env = runner.child_env(tmp_path)
    outcome = runner.run_step(step, tmp_path, env, time.monotonic() + 600, 1)
    assert outcome.status == "fail"
    assert outcome.reason == "exit code 1: ValueError: data.document_mask: expected a bool", outcome.reason


def test_a_step_cut_by_the_budget_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "MIN_START_S", 1)
    cut = runner.run_step(py_step("cut", "import time; time.sleep(600)", timeout_s=600), tmp_path,
                          runner.child_env(tmp_path), time.monotonic() + 3, 1)
    assert cut.status == "fail" and "budget ran out" in cut.reason and "steps=cut" in cut.reason


def test_train_runs_after_the_first_go_three_at_a_time(tmp_path):
    code = "import time; time.sleep(1.5); print('x')"
    train = [steps.Step(f"t{i}", "train", "", [sys.executable, "-c", code], 60,
                        lambda r: ("pass", "", {})) for i in range(4)]
    t0 = time.monotonic()
    outcomes = runner.run_all(train, tmp_path, runner.child_env(tmp_path), time.monotonic() + 600, 1,
                              say=lambda line: None)
    wall = time.monotonic() - t0
    assert [o.step.name for o in outcomes] == ["t0", "t1", "t2", "t3"] and all(o.status == "pass" for o in outcomes)
    assert wall < 4 * 1.5, f"{wall:.1f} s: the runs after the first did not overlap"  # 1 + 3 parallel: about 3 s


def test_junit_xml_of_real_pytest_runs_is_read(tmp_path):
    (tmp_path / "test_sample.py").write_text(textwrap.dedent("""
        def test_good(record_property):
            record_property("route", "flex")
            record_property("grads_rel_err", "0.02")
            record_property("grads_bound", "0.05")
        def test_bad(record_property):
            record_property("logits_rel_err", "0.3")
            record_property("logits_bound", "0.1")
            assert 1 == 2, "logits: relative error 0.3"
    """))
    xml = tmp_path / "out.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_sample.py"),
                    f"--junitxml={xml}", "-o", "junit_family=xunit1"], cwd=tmp_path, capture_output=True, timeout=120)
    numbers = steps.parse_junit(xml)
    assert (numbers["tests"], numbers["passed"], numbers["failed"], numbers["skipped"]) == (2, 1, 1, 0)
    assert numbers["failures"][0]["test"].endswith("test_bad") and "relative error 0.3" in numbers["failures"][0][
        "message"]
    assert numbers["routes"] == {next(k for k in numbers["routes"]): "flex"}
    assert numbers["worst_error_to_bound"] == 3.0 and numbers["worst_at"].endswith("test_bad logits")
    status, reason, _ = steps.parse_cuda_tests(steps.Result(1, 1.0, "", tmp_path.joinpath("x")))
    assert status == "fail"


def test_a_timed_out_pytest_still_reports_the_tests_that_finished(tmp_path):
    """The runner interrupts a step with SIGINT first: pytest then writes the junit xml of the
    tests that finished, which the report keeps."""
    (tmp_path / "test_slow.py").write_text("import time\ndef test_quick(): pass\ndef test_bad(): assert 0\n"
                                           "def test_slow(): time.sleep(600)\n")
    step = steps.cuda_tests_step(tmp_path)
    step.command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", str(tmp_path / "test_slow.py"),
                    f"--junitxml={tmp_path / 'cuda-tests.xml'}", "-o", "junit_family=xunit1"]
    step.timeout_s = 10
    before = signal.getsignal(signal.SIGINT)
    runner.default_sigint()  # as gpu_check's main does: a suite started in the background has SIGINT ignored
    try:
        outcome = runner.run_step(step, tmp_path, runner.child_env(tmp_path), time.monotonic() + 600, 1)
    finally:
        signal.signal(signal.SIGINT, before)
    assert outcome.status == "fail" and outcome.reason.startswith("timed out after")
    assert "1 passed and 1 failed before" in outcome.reason
    assert outcome.numbers["tests"] == 2 and outcome.numbers["failures"][0]["test"].endswith("test_bad")


def test_train_output_and_bench_rows_are_read(tmp_path):
    # the lines train.py prints (their format strings are in pelab/lit.py and pelab/run.py)
    assert '"[pelab] attention: ' in (ROOT / "pelab" / "lit.py").read_text().replace("f\"", "\"")
    assert '"[pelab] val loss ' in (ROOT / "pelab" / "run.py").read_text().replace("f\"", "\"")
    log = ("[pelab] attention: flex (model.attention=auto, pe=t5, cuda, bfloat16)\n"
           "[pelab] train/mfu peak: 989.4 TFLOP/s: NVIDIA H100 80GB HBM3 as H100 SXM, dense bf16 (docs/gpu.md)\n"
           "[pelab] val loss 3.1416 (ppl 23.14); unigram baseline 3.2213 (ppl 25.06)\n")
    # the CSV where a real run writes it: the step's hydra.run.dir (paths.output_dir) / conf/logger/csv.yaml's
    # name / version (checked against a real tiny CPU run: RUN_DIR/csv/metrics.csv)
    from omegaconf import OmegaConf

    step = steps.train_steps(tmp_path, ["t5"])[0]
    csv_conf = OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "logger" / "csv.yaml"))["csv"]
    assert csv_conf["save_dir"] == "${paths.output_dir}"
    assert OmegaConf.to_container(OmegaConf.load(ROOT / "conf" / "paths" / "default.yaml"))["output_dir"] == \
        "${hydra:runtime.output_dir}"
    run_dir = Path(next(c for c in step.command if c.startswith("hydra.run.dir=")).partition("=")[2])
    metrics = run_dir / csv_conf["name"] / csv_conf["version"] / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    metrics.write_text("step,train/tokens_per_sec,train/mfu,val/loss\n5,1000.0,0.01,\n10,2000.0,0.02,\n10,,,3.14\n")
    status, _, numbers = step.parse(steps.Result(0, 10.0, log, tmp_path))
    assert status == "pass"
    assert numbers == {"attention": "flex", "val_loss": 3.1416, "tokens_per_sec": 2000.0, "mfu": 0.02,
                       "mfu_peak": "989.4 TFLOP/s: NVIDIA H100 80GB HBM3 as H100 SXM, dense bf16 (docs/gpu.md)"}
    status, reason, _ = step.parse(steps.Result(0, 10.0, "[pelab] val loss nan (ppl nan)", tmp_path))
    assert status == "fail" and "finite" in reason
    # the bench's rows: two runs, each with rope; the targets judged by hand
    cuda = {"config": "gpt2-gpt2", "precision": "bf16-mixed", "compile": True, "block_size": 1024, "device": "cuda"}
    first = [{"path": "reference", "scheme": "learned", "step_ms": 20.0, "mfu": 0.5},
             {"path": "pelab", "scheme": "learned", "step_ms": 21.0, "mfu": 0.44, "peak_tflops": 989.4,
              "peak_source": "dense bf16"},
             {"path": "pelab", "scheme": "rope", "step_ms": 22.0, "mfu": 0.38},
             {"path": "pelab", "scheme": "alibi", "step_ms": 23.1, "mfu": 0.35},
             {"path": "pelab", "scheme": "rope_alibi", "step_ms": 26.4, "mfu": 0.33}]
    second = [{"path": "reference", "scheme": "learned", "step_ms": 20.0, "mfu": 0.5},
              {"path": "pelab", "scheme": "rope", "step_ms": 20.0, "mfu": 0.4},
              {"path": "pelab", "scheme": "t5", "step_ms": 21.0, "mfu": 0.38},
              {"path": "pelab-documents", "scheme": "rope", "documents": "mask", "doc_length": 256, "step_ms": 24.0,
               "step_ratio_vs_same_scheme": 1.2, "mfu": 0.3},
              {"path": "pelab-documents", "scheme": "t5", "documents": "mask", "doc_length": 256, "step_ms": 16.0,
               "step_ratio_vs_same_scheme": 0.76, "mfu": 0.4}]
    bench, more = steps.bench_steps(tmp_path)
    assert "documents=mask" in more.command and "warmup_parallel=3" in bench.command
    for step, rows in ((bench, first), (more, second)):
        rows_file = Path(next(c for c in step.command if c.startswith("out=")).partition("=")[2])
        rows_file.write_text("".join(json.dumps(cuda | r) + "\n" for r in rows))
    status, _, numbers = bench.parse(steps.Result(0, 100.0, "", tmp_path))
    assert status == "pass" and numbers["reference_step_ms"] == 20.0 and numbers["peak"].startswith("989.4 TFLOP/s")
    where = "gpt2-gpt2 T=1024 bf16-mixed compiled"
    assert numbers["targets"] == [
        f"FAIL MFU >= 45% (gpt2-124M, context 1024, pelab learned; {where}): MFU 0.440; the independent reference 0.500",
        f"PASS alibi step <= 1.10x rope's ({where}): 23.10 ms / 22.00 ms = 1.050",
        f"FAIL rope_alibi step <= 1.10x rope's ({where}): 26.40 ms / 22.00 ms = 1.200"]
    status, _, numbers = more.parse(steps.Result(0, 100.0, "", tmp_path))
    assert status == "fail" and numbers["documents"]["t5+mask"]["step_ratio_vs_same_scheme"] == 0.76  # no alibi row
    assert numbers["targets"] == [
        f"PASS t5 step <= 1.10x rope's ({where}): 21.00 ms / 20.00 ms = 1.050",
        f"FAIL rope with documents=mask (mean length 256) cheaper than causal ({where}): step ratio 1.200 vs the "
        "same scheme without documents",
        f"PASS t5 with documents=mask (mean length 256) cheaper than causal ({where}): step ratio 0.760 vs the same "
        "scheme without documents"]
    assert not [t for t in report.targets([r | {"device": "cpu"} for r in first])]  # GPU targets only


def test_the_report_has_every_step(tmp_path):
    outcomes = [steps.Outcome(py_step("one", ""), "pass", "", 1.0, {"passed": 3, "worst_error_to_bound": 0.5,
                                                                    "targets": ["FAIL MFU >= 45%: MFU 0.4"]}),
                steps.Outcome(py_step("two", ""), "fail", "exit code 1: boom", 2.0,
                              {"failures": [{"test": "t::x", "message": "bad | worse"}]}),
                steps.Outcome(py_step("three", ""), "skip", "needs 2 GPUs, 1 present")]
    info = {"host": "h", "python": "3.12", "torch": "2.11", "cuda": "13.0", "lightning": "2.6.6", "started": "now",
            "gpus": [{"name": "NVIDIA H100 80GB HBM3", "memory_gib": 79.2, "capability": "9.0",
                      "multiprocessors": 132}]}
    md = runner.write_report(tmp_path, info, outcomes, 1200, 3.0)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["summary"] == {"pass": 1, "fail": 1, "skip": 1}
    assert [s["name"] for s in report["steps"]] == ["one", "two", "three"]
    text = md.read_text()
    assert "**1 passed, 1 failed, 1 skipped**" in text and "NVIDIA H100 80GB HBM3" in text
    assert "| two | fail |" in text and "- `t::x`: bad | worse" in text
    assert "## Performance targets\n\n- FAIL MFU >= 45%: MFU 0.4\n" in text


def test_on_a_gpu_machine_it_runs_the_preflight_and_the_steps_and_writes_the_report(tmp_path, monkeypatch, capsys):
    """The driver end to end with CUDA faked and two stand-in steps (one passes, one fails)."""
    import torch

    from pelab import callbacks

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(runner, "machine", lambda: {"host": "h", "python": "3.12", "torch": torch.__version__,
                                                     "cuda": "13.0", "lightning": "2.6", "started": "now", "gpus": []})
    from gpucheck import needs

    monkeypatch.setattr(needs, "NEEDS", needs.NEEDS[:1])  # importing each is tested above
    stand_ins = [py_step("passes", "print('fine')"), py_step("fails", "raise SystemExit(2)")]
    monkeypatch.setattr(steps, "all_steps", lambda out, schemes, gpus, workers: stand_ins)
    assert gpu_check.main([f"out={tmp_path}", f"work={tmp_path / 'work'}", "budget_s=600"]) == 1
    printed = capsys.readouterr().out
    assert "[gpu_check] preflight: pass" in printed and f"report: {tmp_path / 'gpu_check.md'}" in printed
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [("preflight", "pass"), ("passes", "pass"),
                                                                   ("fails", "fail")]
    assert report["steps"][0]["numbers"]["mfu_peak_bf16"] == callbacks.device_peak(torch.device("cuda"),
                                                                                   "bf16-mixed")[1]


def test_parts_fit_the_gpu_window_and_the_plan_lists_them(tmp_path, capsys, monkeypatch):
    import importlib.util

    import torch

    find_spec = importlib.util.find_spec
    for xdist in (False, True):  # GPU images have pytest-xdist; without it the cuda tests run in one process
        monkeypatch.setattr(importlib.util, "find_spec",
                            lambda name, *a: (find_spec("pytest") if xdist else None) if name == "xdist"
                            else find_spec(name, *a))
        parts = steps.parts(tmp_path, sorted(SCHEMES), 1, 4)
        assert len(parts) == 4 and all(p.budget_s <= 540 for p in parts.values())
        lanes = parts["1"].lanes
        assert [s.name for s in lanes[0]] == ["cuda_tests"] and ("-n" in lanes[0][0].command) == xdist
        # part 3: the cuda tests first in its timed lane, the other lane train runs only
        assert parts["3"].lanes[0][0].name == "cuda_tests"
        assert {s.group for s in parts["3"].lanes[1]} == {"train"}
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    assert any(s.group == "train" for s in lanes[1]) and "t5_timing" in {s.name for lane in lanes for s in lane}
    assert [s.group for s in parts["2"].steps()] == ["bench"] * len(parts["2"].steps())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main(["plan=true", f"out={tmp_path / 'r'}"]) == 0
    printed = capsys.readouterr().out
    assert all(f"part={p} (budget 540 s)" in printed for p in "1234") and "part=5" not in printed
    assert len(runner.EXPORTED) <= 8
    with pytest.raises(SystemExit, match="part='5': expected one of 1, 2, 3, 4"):
        gpu_check.main(["part=5"])
    with pytest.raises(SystemExit, match="workers='x' is not valid: expected an integer >= 1"):
        gpu_check.main(["workers=x"])


KILLED_PART = """
import signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a runner started in the background by a non-interactive shell
sys.path.insert(0, {scripts!r})
import torch
import gpu_check
from gpucheck import runner, steps

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
runner.machine = lambda: {{"host": "h", "python": "3", "torch": "t", "cuda": "c", "lightning": "l", "started": "now",
                          "gpus": []}}
gpu_check.preflight = lambda gpus: steps.Outcome(steps.Step("preflight", "preflight", "", [], 60, None), "pass")

def step(name, code, group="test", timeout_s=600):
    def parse(result):
        bad = steps.ok_exit(result)
        return (*bad, {{}}) if bad else ("pass", "", {{"said": result.log.strip().splitlines()[-1]}})
    return steps.Step(name, group, "stand-in", [sys.executable, "-c", code], timeout_s, parse)

def fake_parts(work, schemes, gpus, workers):
    metrics = "import pathlib; p = pathlib.Path({work!r}) / 'train' / 'r' / 'csv'; p.mkdir(parents=True); "
    metrics += "(p / 'metrics.csv').write_text(chr(10).join(['step,train/tokens_per_sec', '1,5.0'])); print('trained')"
    slow = "import os, time; open({pid!r}, 'w').write(str(os.getpid())); print('sleeping', flush=True); time.sleep(600)"
    # stopped at its timeout by SIGINT, which must reach it (else SIGTERM only after 20 s)
    hung = step("hung", "import time; time.sleep(600)", timeout_s=2)
    lanes = [[step("quick", "print('quick done')"), hung, step("slow", slow)],
             [step("trained", metrics, "train"), step("broken", "raise SystemExit('broken: reason')")]]
    return {{"1": steps.Part("1", "stand-ins", 540, lanes)}}

steps.parts = fake_parts
sys.exit(gpu_check.main(["part=1", "out={out}", "work={work}"]))
"""


def test_a_part_killed_midway_leaves_the_report_of_what_finished(tmp_path):
    """A part stopped from outside (the GPU machine's command limit) still returns the steps
    that finished: the report is rewritten after every step, into at most 8 files and no folder."""
    import signal
    import tarfile

    out, work, pid_file = tmp_path / "out", tmp_path / "work", tmp_path / "slow.pid"
    code = KILLED_PART.format(scripts=str(ROOT / "scripts"), out=str(out), work=str(work), pid=str(pid_file))
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        report = {}
        for _ in range(600):  # until the three quick steps have finished and the slow one runs
            time.sleep(0.1)
            if (out / "gpu_check.json").is_file():
                report = json.loads((out / "gpu_check.json").read_text())
                if report["summary"].get("running") == 1 and sum(report["summary"].values()) == 6:
                    break
        assert proc.poll() is None, proc.stdout.read().decode()[-2000:]
        proc.kill()  # SIGKILL: nothing of gpu_check's own runs after this
        proc.wait(timeout=30)
    finally:
        if pid_file.is_file():
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        proc.kill()
    statuses = {s["name"]: (s["status"], s["reason"]) for s in report["steps"]}
    assert statuses["preflight"][0] == "pass" and statuses["quick"][0] == "pass"
    assert statuses["broken"] == ("fail", "exit code 1: broken: reason")
    assert statuses["trained"][0] == "pass" and statuses["slow"][0] == "running"
    hung = next(s for s in report["steps"] if s["name"] == "hung")
    assert hung["status"] == "fail" and hung["reason"].startswith("timed out") and hung["seconds"] < 15
    entries = sorted(p.name for p in out.iterdir())
    assert len(entries) <= 8 and all((out / e).is_file() for e in entries), entries
    assert set(entries) <= set(runner.EXPORTED)
    md = (out / "gpu_check.md").read_text()
    assert "| quick | pass |" in md and "| broken | fail |" in md and "| slow | running |" in md
    assert "[gpu_check] broken: fail" in (out / "gpu_check.log").read_text()
    with tarfile.open(out / "logs.tgz") as tar:
        names = set(tar.getnames())
        assert {"logs/quick.log", "logs/broken.log", "logs/slow.log", "train/r/csv/metrics.csv"} <= names
        assert b"quick done" in tar.extractfile("logs/quick.log").read()


def test_part_1_trains_what_landed_after_the_acceptance_was_written(tmp_path):
    """Packed documents (flex's document BlockMask; the SDPA routes' bool masks), attention
    temperature, randomized positions, init_from with training-time RoPE scaling and 32-true with
    a learned bias each get a train run; every override is a key of train.py's config."""
    from hydra import compose, initialize_config_dir

    lane = steps.parts(tmp_path, sorted(SCHEMES), 1, 4)["1"].lanes[1]
    runs = {s.name: s.command for s in lane}
    every = " ".join(" ".join(c) for c in runs.values())
    covering = []
    for option in ("pe=t5 data.document_mask=true",
                   "pe=rope model.attention=sdpa data.document_mask=true data.document_positions=true",
                   "pe=alibi model.attention=sdpa_key data.document_mask=true", "model.attn_temperature=log_length",
                   "pe.randomize_to=",
                   "pe.scaling.kind=yarn", "init_from=", "pe=t5 trainer.precision=32-true"):
        assert option in every, option
        covering += [s for s in lane if option in " ".join(s.command) and s not in covering]
    # init_from reads the last checkpoint of train_rope, which runs first and alone
    init_from = next(c for cmd in runs.values() for c in cmd if c.startswith("init_from="))
    assert Path(init_from.partition("=")[2]) == steps.run_dir_of(runs["train_rope"]) / "checkpoints" / "last.ckpt"
    assert lane[0].name == "train_rope"
    # the documents runs take the routes they are for on CUDA, bf16, training (resolve reads only the device type)
    import torch

    from model.attention import AttentionRequest, resolve
    from model.config import GPTConfig

    cfg = GPTConfig(vocab_size=64, block_size=64, n_layer=1, n_head=2, n_embd=32)
    for scheme, choice, route in (("t5", "auto", "flex"), ("rope", "sdpa", "sdpa"), ("alibi", "sdpa_key", "sdpa_key")):
        pe = SCHEMES[scheme](cfg)
        request = AttentionRequest(pe, torch.device("cuda"), torch.bfloat16, grad=True, documents=True)
        assert resolve(choice, request).name == route
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for step in covering:
            compose("config", overrides=[c for c in step.command[2:] if not c.startswith("hydra.")])


# ---------------------------------------------------------------------------- part 4 (issue 47)


def test_part_4_runs_the_tests_then_the_loop_bench_beside_the_gpt2_evaluation_and_the_sync_count(tmp_path):
    """Lane a: the cuda tests, capped so that the bench after them keeps its time, then the bench
    with the reference's loop and enough rounds for a 95% interval; lane b: the gpt2 run, then the
    host-sync count. Every override is a key of train.py's config or of bench.py's."""
    from hydra import compose, initialize_config_dir

    from _cli import compose as script_config
    from evaluation.stats import median_ci

    part = steps.parts(tmp_path, sorted(SCHEMES), 1, 4)["4"]
    assert [[s.name for s in lane] for lane in part.lanes] == [["cuda_tests", "bench_loop"],
                                                              ["train_gpt2_eval", "host_syncs"]]
    tests, bench = part.lanes[0]
    assert tests.timeout_s == steps.PART4_TESTS_S and steps.all_steps(tmp_path, [], 1, 4)[0].timeout_s == 600
    # the lane's steps fit the part (runner.STOP_GRACE_S: steps end that long before the budget)
    assert tests.timeout_s + runner.MIN_START_S <= part.budget_s - runner.STOP_GRACE_S
    args = dict(c.split("=", 1) for c in bench.command[2:])
    assert set(args) <= set(script_config("bench")) and args["loop"] == "true" and args["compile"] == "true"
    assert args["configs"] == "gpt2-gpt2:learned+rope"
    assert median_ci([float(i) for i in range(int(args["rounds"]))]) is not None  # an interval per ratio
    gpt2, syncs = part.lanes[1]
    assert "model=gpt2" in gpt2.command and "data=gutenberg" in gpt2.command and "compile=true" in gpt2.command
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        for step in part.lanes[1]:
            cfg = compose("config", overrides=[c for c in step.command[2:] if not c.startswith("hydra.")])
            assert cfg.trainer.accelerator == "gpu"
        assert list(cfg.callbacks.host_syncs.keys()) == ["_target_", "out"]
    evaluated = compose_run(gpt2)
    assert evaluated.eval.extrapolation.multipliers == [1, 2, 4] and evaluated.data.tokenizer == "bytes"
    assert evaluated.trainer.max_steps > 2 * evaluated.trainer.log_every_n_steps  # tokens/s after the compile
    assert [s.name for s in gpu_check.select(steps.all_steps(tmp_path, [], 1, 4), "issue47")] == [
        "train_gpt2_eval", "host_syncs", "bench_loop"]


def compose_run(step):
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=[c for c in step.command[2:] if not c.startswith("hydra.")])


GPT2_LOG = """[pelab] attention: sdpa (model.attention=auto, pe=rope, cuda, bfloat16)
[pelab] train/mfu peak: 989.4 TFLOP/s: NVIDIA H200 as H200, dense bf16 (docs/gpu.md)
[pelab] evaluation on {device}: extrapolation
[extrapolation] pe=rope scaling=none mode=nonoverlapping train=1024 eval=1024 stride=1024: ppl 9.1 (loss 2.2083) over 65536 tokens in 0.2s
[extrapolation] pe=rope scaling=none mode=nonoverlapping train=1024 eval=2048 stride=2048: ppl 19.4 (loss 2.9653) over 65536 tokens in 0.4s
[extrapolation] pe=rope scaling=none mode=nonoverlapping train=1024 eval=4096 stride=4096: ppl 88.2 (loss 4.4796) over 65536 tokens in 0.8s
[pelab] val loss 2.1000 (ppl 8.17); unigram baseline 3.2213 (ppl 25.06)
"""


def test_the_gpt2_runs_evaluation_device_and_tokens_per_second_are_read(tmp_path):
    # the lines are train.py's own (format strings in pelab/evaluate.py and evaluation/extrapolation.py)
    assert '"[pelab] evaluation on {device}' in (ROOT / "pelab" / "evaluate.py").read_text().replace('f"', '"')
    assert "over {row.tokens} tokens in {row.seconds:.1f}s" in (ROOT / "evaluation" / "extrapolation.py").read_text()
    step = steps.gpt2_eval_step(tmp_path)
    run_dir = steps.run_dir_of(step.command)
    metrics = run_dir / "csv" / "metrics.csv"
    metrics.parent.mkdir(parents=True)
    # the first logged value holds the compile: the median of the others
    metrics.write_text("step,train/tokens_per_sec,val/loss\n9,1000.0,\n19,300000.0,\n29,400000.0,\n39,350000.0,\n"
                       "79,,2.1\n")
    status, reason, numbers = step.parse(steps.Result(0, 100.0, GPT2_LOG.format(device="cuda:0"), tmp_path))
    assert status == "pass", reason
    assert numbers["eval_device"] == "cuda:0" and numbers["train_tokens_per_s"] == 350000.0
    sharded = GPT2_LOG.format(device="cuda:0, sharded over 2 ranks")
    assert step.parse(steps.Result(0, 100.0, sharded, tmp_path))[2]["eval_device"] == "cuda:0"
    assert numbers["eval_tokens"] == 3 * 65536 and numbers["eval_s"] == 1.4  # from the printed lines
    assert numbers["eval_tokens_per_s_by_length"] == {1024: 327680.0, 2048: 163840.0, 4096: 81920.0}
    assert numbers["eval_tokens_per_s"] == round(3 * 65536 / 1.4, 1)
    assert numbers["eval_over_train_tokens_per_s"] == round(3 * 65536 / 1.4 / 350000, 3)
    # the table, where train.py wrote it, wins over the rounded lines
    table = run_dir / "extrapolation" / "extrapolation.csv"
    table.parent.mkdir()
    table.write_text("scheme,rope_scaling,train_length,eval_length,mode,stride,tokens,loss,ppl,seconds,status\n"
                     "rope,none,1024,1024,nonoverlapping,1024,65536,2.2,9.1,0.25,ok\n"
                     "rope,none,1024,2048,nonoverlapping,2048,65536,2.9,19.4,0.5,ok\n"
                     "rope,linear,1024,2048,nonoverlapping,2048,65536,2.9,19.4,9.0,ok\n")
    _, _, numbers = step.parse(steps.Result(0, 100.0, GPT2_LOG.format(device="cuda:0"), tmp_path))
    assert numbers["eval_tokens_per_s_by_length"] == {1024: 262144.0, 2048: 131072.0} and numbers["eval_s"] == 0.75
    # evaluated on the host after GPU training: the failure this step is for
    status, reason, _ = step.parse(steps.Result(0, 100.0, GPT2_LOG.format(device="cpu"), tmp_path))
    assert status == "fail" and "scored on cpu" in reason
    status, reason, _ = step.parse(steps.Result(0, 100.0, GPT2_LOG.replace("[pelab] evaluation on {device}: "
                                                                           "extrapolation\n", ""), tmp_path))
    assert status == "fail" and "no device printed" in reason


def test_host_syncs_per_step_are_counted_by_whether_the_step_logs(tmp_path):
    report = {"log_every_n_steps": 4, "steps": 12, "self_test": 1,
              "counts": {"-1": 2, "0": 0, "1": 1, "3": 5, "5": 2, "7": 4, "11": 9},
              "sites": {"1": {"callbacks.py:10 guard": 1}, "5": {"callbacks.py:10 guard": 1, "lit.py:3 log": 1}}}
    numbers = steps.host_syncs_numbers(report)
    # steps 0..10 (11 ends the fit); 3 and 7 log; the other 9 do not: 3 syncs among them
    assert numbers["syncs_per_quiet_step"] == round(3 / 9, 2) and numbers["max_in_a_quiet_step"] == 2
    assert numbers["syncs_per_logging_step"] == 4.5 and numbers["before_the_first_step"] == 2
    assert numbers["quiet_sites"] == {"callbacks.py:10 guard": 2, "lit.py:3 log": 1}
    assert numbers["targets"] == ["FAIL no host sync in a training step that does not log (issue 47): 3 in 9 such "
                                  "steps; 4.5 per logging step"]
    report["counts"] = {"3": 5, "7": 4, "11": 1}
    assert steps.host_syncs_numbers(report)["targets"][0].startswith("PASS")
    path = tmp_path / "host_syncs.json"
    path.write_text(json.dumps(report | {"self_test": 0}))
    status, reason, _ = steps.host_syncs_parser(path)(steps.Result(0, 1.0, "", tmp_path))
    assert status == "fail" and "its counts mean nothing" in reason


def test_the_sync_counter_runs_through_train_py(tmp_path):
    """The host_syncs step's own command, on a CPU: trainer=default, fewer steps, and the
    counter's CPU stand-in of CUDA's sync debug mode (a warning at each host read of a value)."""
    step = steps.host_syncs_step(tmp_path)
    command = [c.replace("trainer=gpu", "trainer=default") for c in step.command]
    command = [c for c in command if not c.startswith(("trainer.max_steps=", "trainer.log_every_n_steps="))]
    command += ["trainer.max_steps=8", "trainer.log_every_n_steps=4", "data.batch_size=4",
                "+callbacks.host_syncs.imitate=true"]
    env = dict(os.environ, HYDRA_FULL_ERROR="1", WANDB_MODE="disabled")
    assert command[0] == steps.PY
    proc = run_python(command[1:], cwd=ROOT, env=env)  # train.py, forked from the preloaded server (tests/cli.py)
    status, reason, numbers = step.parse(steps.Result(proc.returncode, 1.0, proc.stdout + proc.stderr, tmp_path))
    assert status == "pass", reason + (proc.stdout + proc.stderr)[-3000:]
    assert numbers["self_test"] == 1 and numbers["steps"] == 8 and numbers["log_every_n_steps"] == 4
    assert numbers["syncs_per_logging_step"] > 0  # the logged loss and learning rate are read there


def test_the_loop_bench_reports_pelab_over_the_reference_and_rope_over_learned(tmp_path):
    cuda = {"config": "gpt2-gpt2", "precision": "bf16-mixed", "compile": True, "block_size": 1024, "device": "cuda"}
    rows = [{"path": "reference", "scheme": "learned", "step_ms": 34.0, "mfu": 0.42, "ratio_vs_reference": 1.0},
            {"path": "pelab-loop", "scheme": "learned", "step_ms": 36.0, "mfu": 0.40, "ratio_vs_reference": 0.945,
             "ratio_vs_reference_ci95": [0.93, 0.95]},
            {"path": "pelab", "scheme": "learned", "step_ms": 40.4, "mfu": 0.352, "ratio_vs_reference": 0.837,
             "ratio_vs_reference_ci95": [0.8, 0.86], "ratio_vs_learned": 1.0},
            {"path": "pelab", "scheme": "rope", "step_ms": 45.9, "mfu": 0.308, "ratio_vs_learned": 0.8889,
             "ratio_vs_learned_ci95": [0.8, 0.9]}]
    bench = steps.bench_loop_step(tmp_path)
    Path(next(c for c in bench.command if c.startswith("out=")).partition("=")[2]).write_text(
        "".join(json.dumps(cuda | r) + "\n" for r in rows))
    status, _, numbers = bench.parse(steps.Result(0, 100.0, "", tmp_path))
    assert status == "pass" and numbers["schemes"]["rope"]["mfu"] == 0.308 and numbers["reference_mfu"] == 0.42
    assert (numbers["pelab_over_reference"], numbers["pelab_over_reference_ci95"]) == (0.837, [0.8, 0.86])
    assert (numbers["pelab_loop_over_reference"], numbers["rope_over_learned"]) == (0.945, 0.8889)
    assert numbers["targets"][-2:] == [
        "FAIL pelab learned tokens/s >= 0.95x the reference's (issue 47; gpt2-gpt2): 0.837 (0.800-0.860)",
        "FAIL rope step <= 1.03x learned's (issue 47; gpt2-gpt2): 1.125 (1.111-1.250)"]
