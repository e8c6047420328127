"""The GPU acceptance run: one command on a GPU machine, a JSON + markdown report.

    python scripts/gpu_check.py                          # a GPU machine: every step (about 20 min on one H100)
    python scripts/gpu_check.py plan=true                # the plan only: steps, commands, what to install
    python scripts/gpu_check.py steps=cuda_tests,bench   # some steps (names or groups: tests, train, timing, bench, ddp)

Without CUDA it prints its plan (every step with the command it would run, and what to install)
and exits 0 without running anything. On a GPU the report's path is printed at the end; the
exit code is 1 when a step failed. Each step, what it asserts, its tolerances and time budget,
and how to run it offline on a fresh machine: docs/gpu.md.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from _common import ROOT, describe_options, parse_key_values

OPTIONS = {
    "plan": "true: print the plan and exit, also on a GPU machine (default false)",
    "steps": "comma-separated step names or groups to run (default: all); preflight always runs",
    "out": "report folder (default outputs/gpu_check/DATE_TIME)",
    "budget_s": "wall-clock budget of the run in seconds (default 1200); a step that no longer fits is skipped",
    "worker": "(internal) run one in-process step in this child: t5_timing",
}
BUDGET_S = 1200


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


def plan_text(steps: list, gpus: int, budget_s: float, out: Path) -> str:
    from gpucheck.needs import NEEDS, install_lines

    carried = ", ".join(f"{dist}" for _, dist, _, carry, _ in NEEDS if carry)
    present = ", ".join(f"{dist}" for _, dist, _, carry, _ in NEEDS if not carry)
    lines = [
        "[gpu_check] the GPU acceptance run (docs/gpu.md): its plan",
        f"  report: {out}/gpu_check.json and gpu_check.md; budget {budget_s:.0f} s; GPUs here: {gpus}",
        f"  needs beyond torch and Lightning: {carried} (usually missing on GPU images: carry them as wheels);",
        f"  and {present} (usually present; the preflight step names any that is missing)",
        "  how to install them offline:",
        *[f"    {line}" for line in install_lines()],
        "  steps, in order (timeout in seconds; train runs 3 at a time):",
        "    1. preflight (in process, 60): torch and lightning at least pyproject's floors, the packages above "
        "importable, CUDA devices, the MFU peak of the device",
    ]
    for i, step in enumerate(steps, start=2):
        lines.append(f"    {i}. {step.name} ({step.timeout_s}{', needs 2+ GPUs' if step.gpus > 1 else ''}): {step.what}")
        lines.append(f"       $ {step.shown()}")
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


def usage() -> str:
    return f"{__doc__.strip()}\n\noptions (key=value):\n{describe_options(OPTIONS)}"


def main(argv: list[str]) -> int:
    if any(arg in ("-h", "--help", "help") for arg in argv):
        print(usage())
        return 0
    args = parse_key_values(argv, OPTIONS)
    if "worker" in args:
        from gpucheck.workers import run

        return run(args["worker"], Path(args.get("out", ".")))
    import torch

    from gpucheck.steps import all_steps
    from model.pe import SCHEMES

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out = Path(args.get("out") or ROOT / "outputs" / "gpu_check" / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
    budget_s = float(args.get("budget_s", BUDGET_S))
    steps = select(all_steps(out, sorted(SCHEMES), gpus), args.get("steps"))
    plan_only = args.get("plan", "false").lower() in ("1", "true", "yes")
    if plan_only or not gpus:
        if not gpus:
            print("[gpu_check] no CUDA device here: nothing is run. On a GPU machine this command runs the plan "
                  "below and writes the report.")
        print(plan_text(steps, gpus, budget_s, out))
        return 0

    from gpucheck.runner import child_env, machine, run_all, write_report

    t0 = time.monotonic()
    deadline = t0 + budget_s
    print(f"[gpu_check] {gpus} GPU(s); report in {out}; budget {budget_s:.0f} s", flush=True)
    first = preflight(gpus)
    print(f"[gpu_check] preflight: {first.status}" + (f" ({first.reason})" if first.reason else ""), flush=True)
    outcomes = [first, *run_all(steps, out, child_env(out), deadline, gpus,
                                say=lambda line: print(line, flush=True))]
    path = write_report(out, machine(), outcomes, budget_s, time.monotonic() - t0)
    failed = [o.step.name for o in outcomes if o.status == "fail"]
    print(f"[gpu_check] report: {path} (and {path.with_suffix('.json').name})"
          + (f"; failed: {', '.join(failed)}" if failed else "; no step failed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
