"""Running the steps (each in its own process group, under its timeout and what is left of the
run's budget; lanes of steps side by side) and the report: a few files straight in the output
folder, rewritten after every step (EXPORTED), while the steps write into a work folder."""

from __future__ import annotations

import io
import json
import os
import platform
import signal
import subprocess
import tarfile
import threading
import time
from pathlib import Path

from gpucheck.groups import StepGroups
from gpucheck.steps import ROOT, Outcome, Result, Step

MIN_START_S = 45  # a step is not started with less of the budget left than this
TRAIN_PARALLEL = 3  # train.py runs at once (tiny models: the GPU has room; timings are not taken from them)
HEARTBEAT_S = 30  # the report is also rewritten this often while steps run
STOP_GRACE_S = 40  # stop_group's SIGINT, SIGTERM, SIGKILL waits: a step ends at most this long after its deadline
# what the output folder holds, all directly in it: a borrowed GPU machine returns at most 8 files
EXPORTED = ("gpu_check.json", "gpu_check.md", "gpu_check.log", "cuda-tests.xml", "bench.jsonl", "logs.tgz")
GROUPS = StepGroups()  # the running steps' process groups: ended with the step, on a signal, or by the guardian


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
    """SIGINT back to its default in this process, for the steps it starts: a runner started in
    the background by a non-interactive shell has SIGINT ignored, which children inherit (a
    handled signal is reset to its default at exec, an ignored one stays ignored), and pytest then
    never sees the SIGINT that ``stop_group`` sends first. Called once from the main thread before
    any step starts (not as Popen's preexec_fn: unsafe while other threads run steps)."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_step(step: Step, out: Path, env: dict, deadline: float, gpus: int, started=None) -> Outcome:
    """The step in its own process group, stopped at its timeout or the deadline; ``started(step)``
    is called once its process runs (its log then holds the command)."""
    if GROUPS.stopped:
        return Outcome(step, "skip", f"the run was stopped ({GROUPS.stopped}) before this step started")
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
                                stdin=subprocess.DEVNULL, start_new_session=True)
        GROUPS.started(proc)
        try:
            if started:
                started(step)
            try:
                returncode = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                stop_group(proc)
                returncode = None
        finally:
            GROUPS.ended(proc)
        # a signal to the runner stopped it (a step that had ended well before keeps its pass)
        stopped = GROUPS.stopped if returncode != 0 else None
    seconds = time.monotonic() - t0
    result = Result(returncode, seconds, log_path.read_text(errors="replace"), out)
    try:
        status, reason, numbers = step.parse(result)
    except Exception as e:  # noqa: BLE001 - a parser bug must not lose the other steps
        status, reason, numbers = "fail", f"could not read the step's output: {type(e).__name__}: {e}", {}
    if stopped:
        status = "fail"
        why = f"stopped after {seconds:.0f} s: the run was stopped ({stopped})"
        reason = f"{why}; {reason}" if reason else why
    elif returncode is None:  # the parser's reason says what finished before; say why it stopped
        status = "fail"
        if timeout < step.timeout_s:
            budget = (f"stopped when the run's budget ran out, after {seconds:.0f} s (its own timeout: "
                      f"{step.timeout_s} s; rerun it with steps={step.name})")
            reason = f"{budget}; {reason}" if reason else budget
        elif not reason:
            reason = f"timed out after {seconds:.0f} s"
    return Outcome(step, status, reason, seconds, numbers)


def run_all(steps: list[Step], out: Path, env: dict, deadline: float, gpus: int, say=print,
            started=None, finished=None, parallel: int = TRAIN_PARALLEL) -> list[Outcome]:
    """The steps in order; consecutive train steps ``parallel`` at a time after the first.
    ``started(step)`` and ``finished(outcome)`` are called as each step starts and ends."""
    outcomes: list[Outcome] = []
    i, trained = 0, False
    while i < len(steps):
        batch = [steps[i]]
        # the first train run alone: it tokenizes the corpus into the shared cache the others read
        while (trained and steps[i].group == "train" and i + len(batch) < len(steps)
               and len(batch) < parallel and steps[i + len(batch)].group == "train"):
            batch.append(steps[i + len(batch)])
        trained = trained or steps[i].group == "train"
        results: dict[str, Outcome] = {}

        def one(step: Step) -> None:
            outcome = results[step.name] = run_step(step, out, env, deadline, gpus, started)
            say(f"[gpu_check] {step.name}: {outcome.status}" + (f" ({outcome.reason})" if outcome.reason else "")
                + f", {outcome.seconds:.0f} s")
            for target in outcome.numbers.get("targets", []):  # the bench's performance targets
                say(f"[gpu_check]   target {target}")
            if finished:
                finished(outcome)

        threads = [threading.Thread(target=one, args=(s,)) for s in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        outcomes += [results[step.name] for step in batch]
        i += len(batch)
    return outcomes


def run_lanes(lanes: list[list[Step]], work: Path, env: dict, deadline: float, gpus: int, report: Report,
              parallel: int = TRAIN_PARALLEL) -> list[Outcome]:
    """Each lane in its own thread (its steps in order, as ``run_all``), the lanes side by side;
    the report is rewritten as each step starts and ends. The outcomes in lane order."""
    results: list[list[Outcome]] = [[] for _ in lanes]

    def lane(i: int) -> None:
        results[i] = run_all(lanes[i], work, env, deadline, gpus, say=report.say, started=report.started,
                             finished=report.finished, parallel=parallel)

    threads = [threading.Thread(target=lane, args=(i,)) for i in range(len(lanes))]
    done = threading.Event()
    beat = threading.Thread(target=report.heartbeat, args=(done,), daemon=True)
    for t in [*threads, beat]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    beat.join()
    return [o for lane_outcomes in results for o in lane_outcomes]


class Report:
    """The report of a run in progress, rewritten into ``out`` (the files of EXPORTED, nothing
    else, no folders) at every step's start and end, so that a run stopped from outside still
    leaves what finished: gpu_check.json and .md (steps still running listed as such), the
    console lines, the cuda tests' junit xml, the bench rows, and logs.tgz (every log, each train
    run's metrics.csv and the workers' JSON from ``work``)."""

    def __init__(self, out: Path, work: Path, info: dict, budget_s: float, part: str | None = None) -> None:
        self.out, self.work, self.info, self.budget_s, self.part = out, work, info, budget_s, part
        self.t0 = time.monotonic()
        self.outcomes: list[Outcome] = []
        self.running: dict[str, tuple[Step, float]] = {}
        self.lines: list[str] = []
        self.lock = threading.RLock()
        out.mkdir(parents=True, exist_ok=True)

    def say(self, line: str) -> None:
        with self.lock:
            print(line, flush=True)
            self.lines.append(line)
            _write(self.out / "gpu_check.log", ("\n".join(self.lines) + "\n").encode())

    def started(self, step: Step) -> None:
        with self.lock:
            self.running[step.name] = (step, time.monotonic())
            self.write()

    def finished(self, outcome: Outcome) -> None:
        with self.lock:
            self.running.pop(outcome.step.name, None)
            self.outcomes.append(outcome)
            self.write()

    def heartbeat(self, done: threading.Event) -> None:
        """Rewrite the report every HEARTBEAT_S until ``done``: a part stopped during a long step
        still returns that step's log up to shortly before."""
        while not done.wait(HEARTBEAT_S):
            self.write()

    def write(self) -> Path:
        with self.lock:
            now = time.monotonic()
            still = [Outcome(step, "running", f"still running after {now - t:.0f} s when this report was written "
                             f"(its timeout: {step.timeout_s} s)", now - t) for step, t in self.running.values()]
            self._export()  # before the JSON, which is written last: whoever reads it finds logs as recent
            return write_report(self.out, self.info, self.outcomes + still, self.budget_s, now - self.t0, self.part)

    def _export(self) -> None:
        xml = self.work / "cuda-tests.xml"
        if xml.is_file():
            _write(self.out / "cuda-tests.xml", xml.read_bytes())
        rows = sorted(self.work.glob("bench*.jsonl"))
        if rows:
            _write(self.out / "bench.jsonl", b"".join(p.read_bytes() for p in rows))
        kept = [*sorted(self.work.glob("logs/*.log")), *sorted(self.work.glob("train/*/csv/metrics.csv")),
                *sorted(self.work.glob("train/*/extrapolation/extrapolation.csv")),  # train_gpt2_eval's seconds
                *sorted(self.work.glob("train/*/.hydra/overrides.yaml")), *sorted(self.work.glob("*.json")),
                *sorted(self.work.glob("*.jsonl")), *sorted(self.work.glob("*.xml"))]
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
            for path in kept:
                try:
                    data = path.read_bytes()  # read whole: a log may grow and a CSV be rewritten meanwhile
                except OSError:
                    continue
                info = tarfile.TarInfo(str(path.relative_to(self.work)))
                info.size, info.mtime = len(data), int(time.time())
                tar.addfile(info, io.BytesIO(data))
        _write(self.out / "logs.tgz", buffer.getvalue())


def _write(path: Path, data: bytes) -> None:
    """Replace ``path`` at once (a reader, or a run killed meanwhile, never sees half a file)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


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
    counts = {s: sum(o.status == s for o in outcomes) for s in ("pass", "fail", "skip")}
    if any(o.status == "running" for o in outcomes):
        counts["running"] = sum(o.status == "running" for o in outcomes)
    return counts


def write_report(out: Path, info: dict, outcomes: list[Outcome], budget_s: float, wall_s: float,
                 part: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    report = {"machine": info, "part": part, "budget_s": budget_s, "wall_s": round(wall_s, 1),
              "summary": summary(outcomes), "steps": [o.as_dict() for o in outcomes]}
    path = out / "gpu_check.md"
    _write(path, markdown(report).encode())
    _write(out / "gpu_check.json", (json.dumps(report, indent=2, default=str) + "\n").encode())  # last
    return path


def _short(numbers: dict) -> str:
    """The key numbers of a step in one cell (nested tables and long lists left to the JSON)."""
    parts = []
    for key, value in numbers.items():
        if key in ("failures", "routes", "rows", "schemes", "problems", "targets", "documents"):
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
        f"**{s['pass']} passed, {s['fail']} failed, {s['skip']} skipped**"
        + (f", **{s['running']} still running**" if s.get("running") else "")
        + f" in {report['wall_s']:.0f} s (budget {report['budget_s']:.0f} s"
        + (f", part {report['part']}" if report.get("part") else "") + "). Protocol and tolerances: docs/gpu.md.", "",
    ]
    judged = [t for step in report["steps"] for t in step["numbers"].get("targets", [])]
    if judged:  # the GPU performance targets (the bench steps): reported, never a step's failure
        lines += ["## Performance targets", "", *[f"- {t}" for t in judged], ""]
    lines += ["| step | status | seconds | key numbers | reason |", "|---|---|---|---|---|"]
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
        if n.get("documents"):
            lines += ["", f"## {step['name']}: packed documents against the same scheme", "",
                      "| scheme+documents | step_ms | step ratio | mean doc length |", "|---|---|---|---|"]
            lines += [f"| {name} | {row['step_ms']} | {row['step_ratio_vs_same_scheme']} | {row['doc_length']} |"
                      for name, row in n["documents"].items()]
        if n.get("rows"):
            lines += ["", f"## {step['name']}: rows", "", "```", *[json.dumps(r) for r in n["rows"]], "```"]
    lines += ["", "Every step's command, timeout and numbers: gpu_check.json; its output: logs/STEP.log in logs.tgz.",
              ""]
    return "\n".join(lines)
