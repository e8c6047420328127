"""The GPU acceptance run, in four parts that each fit one command of a borrowed GPU machine.

    python scripts/gpu_check.py part=1 out=DIR   # preflight; cuda tests (pytest -n 4) beside the train runs and t5_timing
    python scripts/gpu_check.py part=2 out=DIR   # preflight; the bench alone (MFU, step ratios, the performance targets)
    python scripts/gpu_check.py part=3 out=DIR   # preflight; windows, sinks, PoPE, FoX, CoPE, stick-breaking: tests, runs, timing
    python scripts/gpu_check.py part=4 out=DIR   # preflight; issue 47: cuda tests then the bench with the plain loop, beside a
                                                 # gpt2 run evaluating on the GPU and the host syncs per step
    python scripts/gpu_check.py plan=true        # the plan only: the parts, their budgets, commands, what to install
    python scripts/gpu_check.py steps=bench      # some steps (names or groups: tests, train, timing, bench, issue47, ddp)

Each part is budgeted 540 s (steps that no longer fit are skipped, a step past the budget is
stopped), and rewrites its report after every step: at most 8 files straight in ``out=`` (the
JSON and markdown report, the console lines, the junit xml, the bench rows, one tarball of logs
and metrics); the steps themselves write into ``work=``. Without CUDA it prints its plan and
exits 0 without running anything. The exit code is 1 when a step failed. SIGTERM or SIGINT stops
the running steps (each step's whole process group), skips the rest and writes the report; a
runner killed outright leaves a guardian that ends the steps' groups (gpucheck/groups.py). The
recipe for a GPU machine without network, each step, what it asserts and its tolerances: docs/gpu.md.
"""

from __future__ import annotations

import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from _cli import command_line, compose
from _common import ROOT, flag, integer, number, path_option

OPTIONS = compose("gpu_check")  # its keys and defaults: conf/scripts/gpu_check.yaml
BUDGET_S = 1200
WORKERS = OPTIONS.workers


def select(steps: list, spec: str | None) -> list:
    if not spec:
        return steps
    wanted = {s.strip() for s in spec.split(",") if s.strip()}
    known = {s.name for s in steps} | {s.group for s in steps}
    unknown = sorted(wanted - known)
    if unknown:
        raise SystemExit(f"unknown steps {unknown}; steps: {', '.join(s.name for s in steps)}; "
                         f"groups: {', '.join(sorted({s.group for s in steps}))}")
    return [s for s in steps if s.name in wanted or s.group in wanted]


def _step_lines(step, indent: str) -> list[str]:
    return [f"{indent}{step.name} ({step.timeout_s}{', needs 2+ GPUs' if step.gpus > 1 else ''}): {step.what}",
            f"{indent}  $ {step.shown()}"]


def plan_text(parts: dict, others: list, gpus: int, out: Path, work: Path) -> str:
    """The parts (each with its budget and lanes), then the steps outside them."""
    from gpucheck.needs import NEEDS, install_lines
    from gpucheck.runner import EXPORTED, TRAIN_PARALLEL

    carried = ", ".join(f"{dist}" for _, dist, _, carry, _ in NEEDS if carry)
    present = ", ".join(f"{dist}" for _, dist, _, carry, _ in NEEDS if not carry)
    lines = [
        "[gpu_check] the GPU acceptance run (docs/gpu.md): its plan",
        f"  report: {out}/ gets at most {len(EXPORTED)} files, rewritten after every step: {', '.join(EXPORTED)}; "
        f"the steps write into {work}; GPUs here: {gpus}",
        f"  needs beyond torch and Lightning: {carried} (usually missing on GPU images: carry them as wheels);",
        f"  and {present} (usually present; the preflight step names any that does not import)",
        "  how to install them offline:",
        *[f"    {line}" for line in install_lines()],
    ]
    for part in parts.values():
        lines += [f"  part={part.name} (budget {part.budget_s} s): {part.what}",
                  "    preflight (in process, 60): torch and lightning at least pyproject's floors, the packages "
                  "above imported, CUDA devices, the MFU peak of the device",
                  f"    then {len(part.lanes)} lane(s) side by side, each in order (timeout in seconds; train runs "
                  f"{TRAIN_PARALLEL} at a time after the first):"]
        for i, lane in enumerate(part.lanes):
            lines.append(f"    lane {'abcdefgh'[i]}:")
            for step in lane:
                lines += _step_lines(step, "      ")
    if others:
        lines.append("  outside the parts (run them with steps=NAME,...; one after another):")
        for step in others:
            lines += _step_lines(step, "    ")
    return "\n".join(lines)


def preflight(gpus: int):
    """Versions against pyproject's floors, packages, devices, the MFU peak: an Outcome."""
    import re

    import torch

    from gpucheck.needs import not_importable, too_old
    from gpucheck.steps import Outcome, Step

    step = Step("preflight", "preflight", "versions, packages, devices, MFU peak", [], 60, lambda r: ("pass", "", {}))
    t0 = time.monotonic()
    numbers: dict = {"torch": torch.__version__, "gpus": gpus,
                     "devices": [torch.cuda.get_device_name(i) for i in range(gpus)]}
    problems = []
    floors = dict(re.findall(r'"(torch|lightning)>=([0-9.]+)', (ROOT / "pyproject.toml").read_text()))
    try:
        import lightning

        numbers["lightning"] = lightning.__version__
    except ImportError:
        numbers["lightning"] = None
        problems.append("lightning is not installed")
    for package, floor in floors.items():
        have = numbers.get(package)
        if have and _version(have) < _version(floor):
            problems.append(f"{package} {have} is below pyproject's floor {floor} (docs/gpu.md, Version floors)")
    if broken := not_importable():
        problems.append(f"not importable: {'; '.join(broken)} (install offline: docs/gpu.md)")
    problems += too_old()
    if gpus:
        try:
            from pelab.callbacks import device_peak

            peak = device_peak(torch.device("cuda", 0), "bf16-mixed")
            numbers["mfu_peak_bf16"] = peak[1] if peak else "none known: train/mfu is not logged"
        except ImportError as e:
            problems.append(f"pelab.callbacks does not import: {e}")
    else:
        problems.append("no CUDA device")
    return Outcome(step, "fail" if problems else "pass", "; ".join(problems), time.monotonic() - t0, numbers)


def _version(text: str) -> tuple[int, ...]:
    import re

    return tuple(int(p) for p in re.match(r"\d+(?:\.\d+)*", text).group(0).split("."))


def main(argv: list[str]) -> int:
    args = command_line("gpu_check", argv, __doc__)
    if args is None:
        return 0
    if args.worker is not None:
        from gpucheck.workers import run

        return run(str(args.worker), Path(str(args.out or ".")))
    import torch

    from gpucheck.steps import all_steps, parts
    from model.pe import SCHEMES

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    stamp = time.strftime("%Y-%m-%d_%H-%M-%S")
    # every path checked before anything starts: a borrowed GPU's time is not spent on a bad one
    out = path_option("output_folder", "out", args.out or ROOT / "outputs" / "gpu_check" / stamp, ", for the report")
    out = out.resolve()
    work = Path(str(args.work or Path(tempfile.gettempdir()) / "pelab-gpu-check" / f"{out.name}-{stamp}"))
    work = path_option("output_folder", "work", work, ", for the steps' files").resolve()
    workers = integer("workers", args.workers, minimum=1)
    every = all_steps(work, sorted(SCHEMES), gpus, workers)
    part = None if args.part is None else str(args.part)
    plan_only = flag("plan", args.plan)
    by_part = parts(work, sorted(SCHEMES), gpus, workers) if part or plan_only or not gpus else {}
    if part is not None and part not in by_part:
        raise SystemExit(f"part={part!r}: expected one of {', '.join(by_part)} (plan=true lists them)")
    if part:
        chosen = {s.name for s in select(by_part[part].steps(), args.steps)}
        lanes = [[s for s in lane if s.name in chosen] for lane in by_part[part].lanes]
        lanes = [lane for lane in lanes if lane]
        budget_s = number("budget_s", by_part[part].budget_s if args.budget_s is None else args.budget_s, above=0)
    else:
        lanes = [select(every, args.steps)]
        budget_s = number("budget_s", BUDGET_S if args.budget_s is None else args.budget_s, above=0)
    if plan_only or not gpus:
        if not gpus:
            print("[gpu_check] no CUDA device here: nothing is run. On a GPU machine this command runs the plan "
                  "below and writes the report.")
        shown = {part: by_part[part]} if part else by_part
        in_parts = {s.name for p in shown.values() for s in p.steps()}
        others = [] if part else [s for s in every if s.name not in in_parts]
        print(plan_text(shown, others, gpus, out, work))
        return 0

    from gpucheck.runner import GROUPS, Report, default_sigint, machine

    default_sigint()
    GROUPS.stopped = None  # a run of its own (a test may run several in one process)
    report = Report(out, work, machine(), budget_s, part)
    previous = {sig: signal.signal(sig, stopping(report)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run_part(report, part, gpus, lanes, work, budget_s, out)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if GROUPS.stopped:
            report.say(f"[gpu_check] stopped by {GROUPS.stopped}: the steps it ran were ended, the others skipped")


def stopping(report):
    """The handler of SIGTERM and SIGINT: every running step's process group stopped (in threads:
    a handler must not block the main thread, which then writes the report), no step started after."""
    from gpucheck.runner import GROUPS, stop_group

    def handler(signum, frame) -> None:
        name = signal.Signals(signum).name
        threading.Thread(target=report.say, args=(f"[gpu_check] {name}: stopping the running steps",),
                         daemon=True).start()
        GROUPS.stop(name, stop_group)

    return handler


def run_part(report, part, gpus: int, lanes: list, work: Path, budget_s: float, out: Path) -> int:
    """The preflight, then the lanes; the report written after each step and at the end."""
    from gpucheck.runner import STOP_GRACE_S, child_env, run_lanes

    deadline = report.t0 + budget_s - STOP_GRACE_S  # a step stopped at its deadline ends within the budget
    report.say(f"[gpu_check] {gpus} GPU(s); {f'part {part}; ' if part else ''}report in {out}; work files in "
               f"{work}; budget {budget_s:.0f} s")
    first = preflight(gpus)
    report.say(f"[gpu_check] preflight: {first.status}" + (f" ({first.reason})" if first.reason else ""))
    report.finished(first)
    outcomes = [first, *run_lanes(lanes, work, child_env(work), deadline, gpus, report)]
    path = report.write()
    failed = [o.step.name for o in outcomes if o.status == "fail"]
    report.say(f"[gpu_check] report: {path} (and {path.with_suffix('.json').name})"
               + (f"; failed: {', '.join(failed)}" if failed else "; no step failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
