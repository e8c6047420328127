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

from _common import integer, parse_key_values

OPTIONS = {
    "device": "cpu or cuda (default cpu)",
    "T": "sequence length (default 2048)",
    "W": "window (default 256 on CPU, T/8 on CUDA)",
    "batch": "sequences (default 4)",
    "precision": "bf16-mixed or 32 (default: 32 on CPU, where bf16 is often emulated; bf16-mixed on CUDA)",
    "rounds": "interleaved timed rounds (default 5)",
    "calls": "forward + backward calls per case and round (default 5)",
    "out": "also write the JSON to this file",
    "smoke": "true: T=256, W=32, batch 1, 1 round of 1 call",
}


def main(argv: list[str]) -> int:
    args = parse_key_values(argv, OPTIONS)
    if args.get("smoke", "false").lower() in ("1", "true", "yes"):
        args = {"T": "256", "W": "32", "batch": "1", "rounds": "1", "calls": "1"} | args
    device = args.get("device", "cpu")
    if device not in ("cpu", "cuda"):
        raise SystemExit(f"device={device!r} is not valid: expected cpu or cuda")
    T = integer("T", args.get("T", "2048"), minimum=2)
    W = integer("W", args.get("W", str(256 if device == "cpu" else T // 8)), minimum=1)
    batch = integer("batch", args.get("batch", "4"), minimum=1)
    rounds = integer("rounds", args.get("rounds", "5"), minimum=1)
    calls = integer("calls", args.get("calls", "5"), minimum=1)
    precision = args.get("precision", "32" if device == "cpu" else "bf16-mixed")
    if precision not in ("bf16-mixed", "32"):
        raise SystemExit(f"precision={precision!r} is not valid: expected bf16-mixed or 32")
    from benchkit.attention import CPU_CASES, CPU_RATIOS, GPU_CASES, GPU_RATIOS, time_attention

    cases, ratios = (GPU_CASES, GPU_RATIOS) if device == "cuda" else (CPU_CASES, CPU_RATIOS)
    numbers = time_attention(device, [(batch, T)], cases, ratios, window=W, rounds=rounds, calls=calls,
                             bf16=precision == "bf16-mixed")
    line = json.dumps(numbers)
    print("ATTENTION_JSON " + line, flush=True)
    if "out" in args:
        with open(args["out"], "w") as f:
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
