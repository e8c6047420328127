"""Running the steps (each in its own process group, under its timeout and what is left of the
run's budget) and writing the report: gpu_check.json and gpu_check.md in the output folder."""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import threading
import time
from pathlib import Path

from gpucheck.steps import ROOT, Outcome, Result, Step

MIN_START_S = 45  # a step is not started with less of the budget left than this
TRAIN_PARALLEL = 3  # train.py runs at once (tiny models: the GPU has room; timings are not taken from them)


def child_env(out: Path) -> dict:
    """The environment of every step: the checkout importable, a fresh pelab cache in the output
    folder, W&B off, Hugging Face offline, unbuffered output, and Hydra's full error (so the last
    line of a failed train.py, which the report keeps, is the exception and not Hydra's hint)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PELAB_CACHE"] = str(out / "cache")
    env.update(WANDB_MODE="disabled", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
               HYDRA_FULL_ERROR="1")
    return env


def stop_group(proc: subprocess.Popen) -> None:
    """End the step's process group (its children too: DDP ranks, compile workers), politely first:
    SIGINT lets pytest write the junit xml of the tests that finished and Lightning stop cleanly."""
    for sig, wait in ((signal.SIGINT, 20), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def default_sigint() -> None:
    """In the child before exec: SIGINT back to its default. A runner started in the background
    by a non-interactive shell has SIGINT ignored, which children inherit, and pytest then
    never sees the SIGINT that ``stop_group`` sends first."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(step: Step, out: Path, env: dict, deadline: float, gpus: int) -> Outcome:
    if step.gpus > gpus:
        return Outcome(step, "skip", f"needs {step.gpus} GPUs, {gpus} present")
    left = deadline - time.monotonic()
    if left < MIN_START_S:
        return Outcome(step, "skip", f"the run's budget is spent ({max(left, 0):.0f} s left)")
    timeout = min(step.timeout_s, left)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    log_path = out / "logs" / f"{step.name}.log"
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        log.write(f"$ {step.shown()}\n")
        log.flush()
        proc = subprocess.Popen(step.command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, preexec_fn=default_sigint)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            stop_group(proc)
            returncode = None
    seconds = time.monotonic() - t0
    result = Result(returncode, seconds, log_path.read_text(errors="replace"), out)
    try:
        status, reason, numbers = step.parse(result)
    except Exception as e:  # noqa: BLE001 - a parser bug must not lose the other steps
        status, reason, numbers = "fail", f"could not read the step's output: {type(e).__name__}: {e}", {}
    if returncode is None:  # the parser's reason says what finished before; say why it stopped
        status = "fail"
        if timeout < step.timeout_s:
            budget = (f"stopped when the run's budget ran out, after {seconds:.0f} s (its own timeout: "
                      f"{step.timeout_s} s; rerun it with steps={step.name})")
            reason = f"{budget}; {reason}" if reason else budget
        elif not reason:
            reason = f"timed out after {seconds:.0f} s"
    return Outcome(step, status, reason, seconds, numbers)


def run_all(steps: list[Step], out: Path, env: dict, deadline: float, gpus: int, say=print) -> list[Outcome]:
    """The steps in order; consecutive train steps TRAIN_PARALLEL at a time after the first."""
    outcomes: list[Outcome] = []
    i, trained = 0, False
    while i < len(steps):
        batch = [steps[i]]
        # the first train run alone: it tokenizes the corpus into the shared cache the others read
        while (trained and steps[i].group == "train" and i + len(batch) < len(steps)
               and len(batch) < TRAIN_PARALLEL and steps[i + len(batch)].group == "train"):
            batch.append(steps[i + len(batch)])
        trained = trained or steps[i].group == "train"
        results: dict[str, Outcome] = {}

        def one(step: Step) -> None:
            results[step.name] = run_step(step, out, env, deadline, gpus)

        threads = [threading.Thread(target=one, args=(s,)) for s in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for step in batch:
            outcome = results[step.name]
            outcomes.append(outcome)
            say(f"[gpu_check] {step.name}: {outcome.status}" + (f" ({outcome.reason})" if outcome.reason else "")
                + f", {outcome.seconds:.0f} s")
        i += len(batch)
    return outcomes


def machine() -> dict:
    import torch

    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "gpus": [], "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import lightning

        info["lightning"] = lightning.__version__
    except ImportError:
        info["lightning"] = None
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            info["gpus"].append({"name": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                                 "capability": f"{p.major}.{p.minor}", "multiprocessors": p.multi_processor_count})
    return info


def summary(outcomes: list[Outcome]) -> dict:
    return {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip")}


def write_report(out: Path, info: dict, outcomes: list[Outcome], budget_s: float, wall_s: float) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "budget_s": budget_s, "wall_s": round(wall_s, 1), "summary": summary(outcomes),
              "steps": [o.as_dict() for o in outcomes]}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    path = out / "gpu_check.md"
    path.write_text(markdown(report))
    return path


def _short(numbers: dict) -> str:
    """The key numbers of a step in one cell (nested tables and long lists left to the JSON)."""
    parts = []
    for key, value in numbers.items():
        if key in ("failures", "routes", "rows", "schemes", "problems"):
            continue
        if isinstance(value, float):
            value = f"{value:.4g}"
        elif isinstance(value, (dict, list)):
            value = json.dumps(value, default=str)
            value = value if len(value) <= 120 else value[:117] + "..."
        parts.append(f"{key}={value}")
    return "; ".join(parts).replace("|", "/")


def markdown(report: dict) -> str:
    info, s = report["machine"], report["summary"]
    gpus = ", ".join(f"{g['name']} ({g['memory_gib']} GiB)" for g in info["gpus"]) or "none"
    lines = [
        "# pelab GPU acceptance run", "",
        f"{info['started']} on {info['host']}: {gpus}; torch {info['torch']} (CUDA {info['cuda']}), "
        f"lightning {info['lightning']}, Python {info['python']}.", "",
        f"**{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped** in {report['wall_s']:.0f} s "
        f"(budget {report['budget_s']:.0f} s). Protocol and tolerances: docs/gpu.md.", "",
        "| step | status | seconds | key numbers | reason |", "|---|---|---|---|---|",
    ]
    for step in report["steps"]:
        lines.append(f"| {step['name']} | {step['status']} | {step['seconds']:.0f} | {_short(step['numbers'])} | "
                     f"{step['reason'].replace('|', '/')} |")
    for step in report["steps"]:
        n = step["numbers"]
        if n.get("failures"):
            lines += ["", f"## {step['name']}: failures", ""]
            lines += [f"- `{f['test']}`: {f['message']}" for f in n["failures"]]
        if n.get("schemes"):
            lines += ["", f"## {step['name']}: per scheme", "", "| scheme | " + " | ".join(
                next(iter(n["schemes"].values())).keys()) + " |", "|---" * (1 + len(next(iter(n["schemes"].values()))))
                + "|"]
            lines += [f"| {name} | " + " | ".join(str(v) for v in row.values()) + " |"
                      for name, row in n["schemes"].items()]
        if n.get("rows"):
            lines += ["", f"## {step['name']}: rows", "", "```", *[json.dumps(r) for r in n["rows"]], "```"]
    lines += ["", "Every step's command, timeout and numbers: gpu_check.json; its output: logs/STEP.log.", ""]
    return "\n".join(lines)
