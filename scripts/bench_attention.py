"""pelab's attention alone, forward + backward (scripts/benchkit/attention.py): sliding windows
and attention sinks against full causal attention, on the route a training step takes.

    python scripts/bench_attention.py                      # CPU: T=2048, W=256, batch 4 (issue 34's row)
    python scripts/bench_attention.py device=cuda T=8192 batch=2   # GPU: flex, sdpa, sdpa_key, t5 on flex
    python scripts/bench_attention.py smoke=true           # seconds: what tests/scripts/test_bench.py runs

Prints one ``ATTENTION_JSON {...}`` line (also written to ``out=FILE``) and a table of ratios.
"""

from __future__ import annotations

import json
import sys

from _cli import command_line
from _common import choice, integer, path_option

SMOKE = ["T=256", "W=32", "batch=1", "rounds=1", "calls=1"]


def main(argv: list[str]) -> int:
    cfg = command_line("bench_attention", argv, __doc__)
    if cfg is None:
        return 0
    if cfg.smoke is True:  # its sizes, under the keys given
        cfg = command_line("bench_attention", [*SMOKE, *argv], __doc__)
    device = choice("device", cfg.device, ("cpu", "cuda"))
    T = integer("T", cfg.T, minimum=2)
    W = integer("W", (256 if device == "cpu" else T // 8) if cfg.W is None else cfg.W, minimum=1)
    batch = integer("batch", cfg.batch, minimum=1)
    rounds = integer("rounds", cfg.rounds, minimum=1)
    calls = integer("calls", cfg.calls, minimum=1)
    precision = choice("precision", cfg.precision or ("32" if device == "cpu" else "bf16-mixed"), ("bf16-mixed", "32"))
    if cfg.out is not None:  # a file this user can write (data/paths.py), before anything is timed
        path_option("output_file", "out", cfg.out)
    from benchkit.attention import CPU_CASES, CPU_RATIOS, GPU_CASES, GPU_RATIOS, time_attention

    cases, ratios = (GPU_CASES, GPU_RATIOS) if device == "cuda" else (CPU_CASES, CPU_RATIOS)
    numbers = time_attention(device, [(batch, T)], cases, ratios, window=W, rounds=rounds, calls=calls,
                             bf16=precision == "bf16-mixed")
    line = json.dumps(numbers)
    print("ATTENTION_JSON " + line, flush=True)
    if cfg.out is not None:
        with open(str(cfg.out), "w") as f:
            f.write(line + "\n")
    for shape, found in numbers["shapes"].items():
        print(f"\n{shape} ({device}, {precision}), ms per forward + backward: "
              + ", ".join(f"{name} {ms:.2f}" for name, ms in found["ms"].items()))
        for what, r in found["ratios"].items():
            print(f"  {what}: {r['median']:.3f} ({r['range'][0]:.3f}-{r['range'][1]:.3f})"
                  + (f" {r['status']}" if "status" in r else ""))
    for problem in numbers["problems"]:
        print(f"[bench_attention] problem: {problem}")
    return 1 if numbers["problems"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
