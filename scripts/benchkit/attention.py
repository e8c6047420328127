"""pelab's attention alone, forward + backward: ``model/attention.attend`` called with the
arguments the first layer of a bf16 training forward hands it (the backend's prepared state,
which every layer of a forward shares, is built once and not timed), so windows, sinks and the
query chunks of a windowed layer run exactly as in training. Used by scripts/bench_attention.py
(CPU or CUDA) and the GPU acceptance's attention_timing step (docs/gpu.md)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

# (name, scheme, model.attention, model options; "W" stands for the window given)
GPU_CASES = (
    ("flex causal", "rope", "flex", {}),
    ("flex window", "rope", "flex", {"window": "W"}),
    ("flex sinks", "rope", "flex", {"sinks": "learned"}),
    ("sdpa causal", "rope", "sdpa", {}),
    ("sdpa window", "rope", "sdpa", {"window": "W"}),
    ("sdpa sinks", "rope", "sdpa", {"sinks": "learned"}),
    ("sdpa_key alibi", "alibi", "sdpa_key", {}),
    ("sdpa_key alibi sinks", "alibi", "sdpa_key", {"sinks": "learned"}),
    ("flex t5", "t5", "flex", {}),
    ("flex t5 sinks", "t5", "flex", {"sinks": "learned"}),
    # issue 47: each learned bias on the fused Triton kernel (its ms beside "sdpa causal", rope's route)
    ("triton_bias t5", "t5", "triton_bias", {}),
    ("triton_bias kerple_log", "kerple_log", "triton_bias", {}),
    ("triton_bias kerple_power", "kerple_power", "triton_bias", {}),
    ("triton_bias fire", "fire", "triton_bias", {}),
)
# (what, numerator case, denominator case, target or None): issue 34's GPU targets
GPU_RATIOS = (
    ("window / causal, flex (target <= 0.25 at W = T/8)", "flex window", "flex causal", 0.25),
    ("window / causal, sdpa", "sdpa window", "sdpa causal", None),
    ("sinks / none, flex rope (target <= 1.05)", "flex sinks", "flex causal", 1.05),
    ("sinks / none, sdpa rope (target <= 1.05)", "sdpa sinks", "sdpa causal", 1.05),
    ("sinks / none, sdpa_key alibi (target <= 1.05)", "sdpa_key alibi sinks", "sdpa_key alibi", 1.05),
    ("sinks / none, flex t5 (target <= 1.05)", "flex t5 sinks", "flex t5", 1.05),
)
# the CPU route (auto: sdpa; a windowed layer chunks its queries) and issue 34's CPU target
CPU_CASES = (
    ("causal", "rope", "auto", {}),
    ("window", "rope", "auto", {"window": "W"}),
    ("sinks", "rope", "auto", {"sinks": "learned"}),
)
CPU_RATIOS = (
    ("window / causal (target <= 0.35 at T = 2048, W = 256)", "window", "causal", 0.35),
    ("sinks / none", "sinks", "causal", None),
)


class _Captured(Exception):
    pass


def captured_attention(model, idx, device_type: str, bf16: bool = True):
    """The arguments the first layer hands to ``attend`` in a training forward of ``model``
    (under bf16 autocast, or in float32)."""
    import torch

    import model.gpt as gpt_module

    found = {}

    def spy(*args):
        found["args"] = args
        raise _Captured

    real, gpt_module.attend = gpt_module.attend, spy
    try:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
            model.train()(idx)
    except _Captured:
        pass
    finally:
        gpt_module.attend = real
    return found["args"]


def timer(device_type: str) -> Callable[[Callable[[], None]], float]:
    """Milliseconds of one call: CUDA events on CUDA, the wall clock elsewhere."""
    import torch

    def cuda_ms(call) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    def wall_ms(call) -> float:
        t0 = time.perf_counter()
        call()
        return (time.perf_counter() - t0) * 1000

    return cuda_ms if device_type == "cuda" else wall_ms


def time_attention(device: str, shapes, cases=GPU_CASES, ratios=GPU_RATIOS, window: int | None = None,
                   rounds: int = 5, calls: int = 10, heads: int = 12, head_dim: int = 64, bf16: bool = True,
                   write: Callable[[dict], None] | None = None) -> dict:
    """Per shape (batch, T) and case: the median over ``rounds`` interleaved rounds of the median
    of ``calls`` forward + backward calls; per ratio the median and range of the per-round
    ratios. Cases of one scheme and backend are timed together (so their ratios are paired),
    one group after another; ``write`` gets the numbers after each group. ``window``: W (default
    T/8); ``bf16``: under bf16 autocast, else float32 (CPUs without native bf16 emulate it,
    tens of times slower than float32)."""
    import torch

    from model.attention import attend
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.pe import SCHEMES

    device_type = torch.device(device).type
    if device_type == "cuda":
        torch.set_float32_matmul_precision("high")
    ms_of = timer(device_type)
    numbers: dict = {"device": device, "precision": "bf16-mixed" if bf16 else "32", "problems": [], "shapes": {}}
    groups: dict[str, list] = {}
    for case in cases:
        groups.setdefault(f"{case[1]} on {case[2]}", []).append(case)
    for B, T in shapes:
        W = window or T // 8
        shape = numbers["shapes"].setdefault(f"B={B} T={T} W={W}", {"ms": {}, "ratios": {}})
        for group in groups.values():
            calls_of = {}
            for name, scheme, backend, options in group:
                options = {k: W if v == "W" else v for k, v in options.items()}
                cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=1, n_head=heads, n_embd=heads * head_dim,
                                attention=backend, **options)
                torch.manual_seed(0)
                model = GPT(cfg, SCHEMES[scheme](cfg)).to(device)
                idx = torch.randint(0, 256, (B, T), device=device)
                q, k, v, ctx, dropout, sink, *rest = captured_attention(model, idx, device_type, bf16)
                if backend != "auto" and ctx.backend.name != backend:
                    numbers["problems"].append(f"{name} at T={T}: ran on {ctx.backend.name}, not {backend}")
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                sink = (None if sink is None else
                        sink.detach().float().requires_grad_(isinstance(sink, torch.nn.Parameter)))
                grad = torch.randn_like(q[..., : v.shape[-1]])

                def call(q=q, k=k, v=v, ctx=ctx, sink=sink, rest=rest, grad=grad):
                    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=bf16):
                        y = attend(q, k, v, ctx, 0.0, sink, *rest)
                    y.backward(grad, retain_graph=True)  # a table's graph to the scheme's parameters is reused

                calls_of[name] = call
            for call in calls_of.values():  # warm-up: flex compiles
                for _ in range(3):
                    call()
            times: dict[str, list[float]] = {name: [] for name in calls_of}
            for _ in range(rounds):
                for name, call in calls_of.items():
                    times[name].append(statistics.median(ms_of(call) for _ in range(calls)))
            shape["ms"] |= {name: round(statistics.median(t), 3) for name, t in times.items()}
            for what, num, den, target in ratios:
                if num in times and den in times:
                    per_round = [a / b for a, b in zip(times[num], times[den])]
                    ratio = statistics.median(per_round)
                    shape["ratios"][what] = {"median": round(ratio, 3),
                                             "range": [round(min(per_round), 3), round(max(per_round), 3)]}
                    if target is not None:
                        shape["ratios"][what]["status"] = "PASS" if ratio <= target else "FAIL"
            if write is not None:
                write(numbers)
            del calls_of
            if device_type == "cuda":
                torch.cuda.empty_cache()
    return numbers
