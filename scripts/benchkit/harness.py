"""The timing harness: every path in its own process, one at a time, in rotating rounds.

Processes are forked from a server that has imported torch and lightning but computed nothing,
so a path trains in its process's main thread with its own allocator and OpenMP team, as a
real run does (threads sharing one process slow allocation-heavy paths). The parent passes a
baton: it sends a path a quota of steps and waits for their times, so exactly one path runs at
a time. The protocol is described in docs/benchmark.md.
"""

from __future__ import annotations

import os
import time

from benchkit.conf import HARNESS
from benchkit.paths import PELAB_LOOP, Stop, path_body
from benchkit.probes import child_eval, child_train_memory


def quiet() -> None:
    """No lightning banners or warnings (after lightning's import, which sets its levels)."""
    import logging
    import warnings

    import lightning  # noqa: F401

    warnings.filterwarnings("ignore")
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("lightning"):
            logging.getLogger(name).setLevel(logging.ERROR)


class StepClock:
    """The path process's side of the baton: ``begin()`` once before the first step, ``tick()``
    at every step end. ``tick`` records the interval since the previous step end (or since
    ``begin``/the resume) in wall and process-CPU seconds, and at the end of a quota reports
    them over ``conn`` and waits for the next quota; it returns True when the body must stop."""

    def __init__(self, conn, sync, release=None) -> None:
        self.conn, self.sync, self.release = conn, sync, release
        self.times: list[tuple[float, float]] = []
        self._quota, self._last, self._last_cpu = 0, 0.0, 0.0

    def wait(self) -> bool:
        """Block until the parent sends the next quota; True means stop."""
        quota = self.conn.recv()
        if quota is None:
            return True
        self._quota = quota
        self._last, self._last_cpu = time.perf_counter(), time.process_time()
        return False

    def begin(self) -> None:
        self.sync()
        self._last, self._last_cpu = time.perf_counter(), time.process_time()

    def tick(self) -> bool:
        self.sync()
        now, cpu = time.perf_counter(), time.process_time()
        self.times.append((now - self._last, cpu - self._last_cpu))
        self._last, self._last_cpu = now, cpu
        self._quota -= 1
        if self._quota > 0:
            return False
        self.conn.send(("steps", self.times))
        self.times = []
        if self.release:  # between quotas, untimed (the first step of the next quota is not timed either)
            self.release()
        return self.wait()


def _path_process(conn, kind: str, job: dict) -> None:
    """A path's process: build the model and its loop, report flops/token, then run quotas."""
    import torch

    quiet()
    torch.set_num_threads(job["nthreads"])
    device = job["device"]

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    # on CUDA a waiting path hands its cached blocks back, so that the paths alive at once hold
    # their weights and optimizer state, and only the running one its activations
    clock = StepClock(conn, sync, torch.cuda.empty_cache if device == "cuda" else None)
    try:
        body, fpt = path_body(None if kind == "reference" else kind, job)
        conn.send(("ready", fpt))
        if not clock.wait():
            body(clock)
    except Stop:
        pass
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("done", None))


class TimedPath:
    """A training path in its own process, ``quota`` steps at a time on request."""

    def __init__(self, name: str, kind: str, job: dict, children: Children) -> None:
        self.name = name
        self.times: list[float] = []   # every interval, warm-up included
        self.cpu: list[float] = []     # this path's process CPU seconds over the same intervals
        self.rounds: list[list[float]] = []
        self.cpu_rounds: list[list[float]] = []
        self.conn, child_conn = children.ctx.Pipe()
        self.process = children.ctx.Process(target=_path_process, args=(child_conn, kind, job), name=name,
                                            daemon=True)
        self.process.start()
        child_conn.close()
        self.flops_per_token = self._receive("ready")

    def _receive(self, expected: str):
        try:
            what, value = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"path {self.name} died (exit code {self.process.exitcode})") from None
        if what == "error":
            raise RuntimeError(f"path {self.name} failed: {value}")
        if what != expected:
            raise RuntimeError(f"path {self.name} stopped early ({what})")
        return value

    def run(self, n: int, skip: int = 0, record: bool = True) -> None:
        """Run skip + n steps now (blocking); the last n are added to ``rounds`` (wall) and
        ``cpu_rounds`` (process CPU time)."""
        self.start(n, skip)
        self.collect(skip, record)

    def start(self, n: int, skip: int = 0) -> None:
        """Send the quota of skip + n steps without waiting (``collect`` waits)."""
        self.conn.send(skip + n)

    def collect(self, skip: int = 0, record: bool = True) -> None:
        steps = self._receive("steps")
        self.times += [w for w, _ in steps]
        self.cpu += [c for _, c in steps]
        if record:
            self.rounds.append([w for w, _ in steps[skip:]])
            self.cpu_rounds.append([c for _, c in steps[skip:]])

    def finish(self) -> None:
        if self.process.is_alive():
            try:
                self.conn.send(None)
            except (BrokenPipeError, OSError):
                pass
            self.process.join(timeout=60)
            if self.process.is_alive():
                self.process.kill()
        self.conn.close()


def _child(kind: str, job: dict):
    quiet()
    return child_eval(job) if kind == "eval" else child_train_memory(job)


class Children:
    """Fresh processes forked from a server that has imported torch and lightning but computed
    nothing, so each child's peak RSS starts at its import footprint and its OpenMP is fresh."""

    def __init__(self) -> None:
        import multiprocessing as mp

        self.ctx = mp.get_context("forkserver")
        self.ctx.set_forkserver_preload(["torch", "lightning", HARNESS])

    def run(self, kind: str, job: dict) -> dict:
        """A one-off measurement (``kind`` memory or eval) in a fresh child."""
        with self.ctx.Pool(1, maxtasksperchild=1) as pool:
            return pool.apply(_child, (kind, job))


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def time_paths(model: dict, schemes: list[str], precision: str, compiles: list[bool], opts: dict,
               children: Children) -> tuple[dict[tuple[str, bool], TimedPath], list[float]]:
    """Time every path of one config and precision, eager and compiled interleaved in the same
    rounds (so compiled/eager ratios are paired like the others): the paths by (name, compile)
    and the load average at the start and end."""
    import torch

    device, B = opts["device"], opts["batch_size"]
    nthreads = torch.get_num_threads()
    paths: dict[tuple[str, bool], TimedPath] = {}
    try:
        for compile_ in compiles:
            job = {"model": model, "precision": precision, "compile": compile_, "device": device, "B": B,
                   "nthreads": nthreads, "doc_length": opts.get("doc_length")}
            for name in ["reference", *([PELAB_LOOP] if opts["loop"] else []), *schemes]:
                paths[name, compile_] = TimedPath(f"{name}{'+compile' if compile_ else ''}", name, job, children)
        load_start = load1()
        order = list(paths)
        # warm-up (compilation, when compiled) of warmup_parallel paths at once: never timed
        at_once = max(1, opts.get("warmup_parallel", 1))
        for i in range(0, len(order), at_once):
            for p in order[i:i + at_once]:
                paths[p].start(opts["warmup"])
            for p in order[i:i + at_once]:
                paths[p].collect(record=False)
        for r in range(opts["rounds"]):
            # every path at every place of the order in turn; the first step after a switch
            # (other processes' data in the caches, this one's OpenMP team asleep) is not timed
            turn = order[r % len(order):] + order[: r % len(order)]
            for p in (turn if r % 2 == 0 else turn[::-1]):
                paths[p].run(opts["steps"], skip=1)
    finally:
        for p in paths.values():
            p.finish()
    return paths, [load_start, load1()]


def peak_flops(device: str, precision: str) -> tuple[float, str]:
    """The device's peak FLOP/s in the compute dtype: on CUDA the dense peak train/mfu uses
    (pelab.callbacks.device_peak), else measured here as the best of repeated 2048^3 matmuls
    (CPU MFU is relative to the achievable rate). A CPU without native bf16 takes over a minute
    per 2048^3 bf16 matmul: the size stops growing where one matmul would pass 2 s, and the
    trials stop after a few seconds."""
    import torch

    dtype = torch.bfloat16 if precision == "bf16-mixed" else torch.float32
    if device == "cuda":
        from pelab.callbacks import device_peak

        peak = device_peak(torch.device("cuda"), precision)
        if peak:
            return peak
    trials, budget_s = 12, 5.0
    n = 256
    while True:  # grow to 2048 while the next size's matmul is predicted under 2 s
        a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
        (a @ b).sum().item()  # first call: kernel selection, page faults
        t0 = time.perf_counter()
        (a @ b).sum().item()
        if n == 2048 or (time.perf_counter() - t0) * 8 > 2.0:
            break
        n *= 2
    best, start = float("inf"), time.perf_counter()
    for done in range(trials):
        if done >= 2 and time.perf_counter() - start > budget_s:
            trials = done
            break
        t0 = time.perf_counter()
        (a @ b).sum().item()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best, f"measured: best of {trials} {n}^3 {str(dtype).removeprefix('torch.')} matmuls on {device}"
