"""The harness's Python cost per training step: a near-free model, so the step time is the loop's.

    python scripts/benchkit/overhead.py [steps=200] [rounds=5] [device=cpu] [precision=32-true]

Three paths train the same tiny pelab GPT (1 layer, width 8, 8 tokens, batch 1), one at a time,
in alternating rounds, each rebuilt every round and its first ``warmup`` steps untimed:

- ``plain``: the bench's plain loop (benchkit/paths.py ``plain_loop_body``, pelab's model);
- ``lightning``: ``LitGPT`` fitted by a Lightning Trainer with no callback of pelab's;
- ``pelab``: the same with conf/callbacks/default.yaml's timed callbacks (the bench's paths).

Prints one ``BENCH_JSON`` row: each path's median CPU µs per step (and the spread of the round
medians), and the differences that split the harness's cost into Lightning's and pelab's.
Results: docs/performance.md, "Harness cost per step".
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

if __name__ == "__main__":  # scripts/ (benchkit) and the checkout (pelab, model) importable
    sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parents[2])]

NEAR_FREE = {"vocab_size": 16, "block_size": 8, "n_layer": 1, "n_head": 1, "n_embd": 8}
PATHS = ("plain", "lightning", "pelab")


class Clock:
    """``begin()`` before the first step, ``tick()`` after each: True once ``n`` steps are timed.
    Records the process's CPU seconds per step (one thread: the host's work, what a GPU run
    would wait on; unlike wall time, not inflated by other processes on a shared machine)."""

    def __init__(self, n: int, warmup: int) -> None:
        self.n, self.warmup, self.times = n, warmup, []
        self._last = 0.0

    def begin(self) -> None:
        self._last = time.process_time()

    def tick(self) -> bool:
        now = time.process_time()
        if self.warmup > 0:
            self.warmup -= 1
        else:
            self.times.append(now - self._last)
        self._last = now
        return len(self.times) >= self.n


def body_of(path: str, device: str, precision: str):
    """The training body of ``path`` (benchkit/paths.py's, with or without pelab's callbacks)."""
    import torch

    from benchkit import paths

    if path == "plain":
        return paths.plain_loop_body(NEAR_FREE, precision, False, device, 1, torch.get_num_threads(),
                                     pelab_model=True)[0]
    if path == "pelab":
        return paths.pelab_body(NEAR_FREE, "learned", precision, False, device, 1, torch.get_num_threads())[0]
    from benchkit.conf import lit_module

    lit = lit_module(NEAR_FREE, "learned", False)

    def bare(clock) -> None:  # pelab_body's fit without conf/callbacks (Lightning's loop and LitGPT only)
        import lightning as L

        class Timer(L.Callback):
            def on_train_start(self, trainer, pl_module) -> None:
                clock.begin()

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                if clock.tick():
                    raise paths.Stop

        trainer = paths.lightning_trainer(precision, device, [Timer()])
        trainer.fit(lit, train_dataloaders=paths.batches(NEAR_FREE["vocab_size"], 1, NEAR_FREE["block_size"]))

    return bare


def measure(steps: int = 200, rounds: int = 5, warmup: int = 20, device: str = "cpu",
            precision: str = "32-true") -> dict:
    """The row: µs per step of each path, medians over every timed step."""
    import logging
    import warnings

    from benchkit.paths import Stop

    warnings.filterwarnings("ignore")
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    times: dict[str, list[float]] = {p: [] for p in PATHS}
    round_medians: dict[str, list[float]] = {p: [] for p in PATHS}
    for r in range(rounds):
        for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
            clock = Clock(steps, warmup)
            try:
                body_of(path, device, precision)(clock)
            except Stop:
                pass
            times[path] += clock.times
            round_medians[path].append(statistics.median(clock.times) * 1e6)
    us = {p: statistics.median(t) * 1e6 for p, t in times.items()}
    return {"row": "harness_overhead", "device": device, "precision": precision, "model": NEAR_FREE,
            "steps": steps, "rounds": rounds,
            **{f"{p}_us": round(us[p], 1) for p in PATHS},
            **{f"{p}_round_us": [round(min(m), 1), round(max(m), 1)] for p, m in round_medians.items()},
            "lightning_minus_plain_us": round(us["lightning"] - us["plain"], 1),
            "pelab_callbacks_us": round(us["pelab"] - us["lightning"], 1),
            "pelab_minus_plain_us": round(us["pelab"] - us["plain"], 1)}


def main(argv: list[str]) -> int:
    import torch

    args = dict(a.split("=", 1) for a in argv)
    torch.set_num_threads(1)
    row = measure(int(args.get("steps", 200)), int(args.get("rounds", 5)), device=args.get("device", "cpu"),
                  precision=args.get("precision", "32-true"))
    print("BENCH_JSON " + json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
