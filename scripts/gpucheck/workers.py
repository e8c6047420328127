"""Steps that run as ``python scripts/gpu_check.py worker=NAME out=DIR`` (a child, so the step's
timeout and a crash stay the step's) and write DIR/NAME.json."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path

from gpucheck.steps import ROOT

DEVICE = "cuda"
MODEL = ROOT / "conf" / "model" / "gpt2.yaml"
SWEEP_MULTIPLIERS = (1, 2, 4, 8, 16)
SAMPLED_TOKENS = 100
PROMPT = 512


class _Count(logging.Handler):
    """Counts dynamo's warnings that a frame hit its recompile limit (then it runs unfused)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.hits = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "recompile_limit" in message or "cache_size_limit" in message:
            self.hits += 1


def t5_timing(out: Path) -> dict:
    """pe=t5 at gpt2 size, untrained (what is measured is time, not quality): the extrapolation
    sweep of evaluation/extrapolation.py at L x {1, 2, 4, 8, 16} (16384 tokens per length, bf16,
    query chunks of 1024), first cold (flex compiles) then warm; then 100 tokens sampled with a KV
    cache after a 512-token prompt, cold then warm. Graphs dynamo compiled are counted per phase."""
    import numpy as np
    import torch
    import yaml
    from torch._dynamo.utils import counters

    from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.pe import SCHEMES

    torch.set_float32_matmul_precision("high")  # as train.py on CUDA
    device = torch.device(DEVICE)
    counted = _Count()
    logging.getLogger("torch._dynamo").addHandler(counted)
    cfg = GPTConfig(vocab_size=50257, **yaml.safe_load(MODEL.read_text()))
    torch.manual_seed(0)
    model = GPT(cfg, SCHEMES["t5"](cfg)).to(device).eval()
    L = cfg.block_size
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, size=2 * 16 * L + 1, dtype=np.int64)
    config = ExtrapolationConfig(multipliers=SWEEP_MULTIPLIERS, max_tokens=16 * L, precision="bf16-mixed")
    with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
        route = model.attention(device, dtype=torch.bfloat16, queries=L).name
    numbers: dict = {"route": route, "train_length": L, "problems": []}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def graphs() -> int:
        return int(counters["stats"]["unique_graphs"])

    for phase in ("cold", "warm"):
        g0, t0 = graphs(), time.perf_counter()
        rows = evaluate_extrapolation(model, tokens, L, config, log=lambda line: None)
        sync()
        numbers[f"sweep_{phase}_s"] = round(time.perf_counter() - t0, 2)
        numbers[f"graphs_compiled_sweep_{phase}"] = graphs() - g0
        numbers[f"seconds_by_length_{phase}"] = {r.eval_length: round(r.seconds, 3) for r in rows}
        bad = [r.eval_length for r in rows if not (r.ok and math.isfinite(r.loss))]
        if bad:
            numbers["problems"].append(f"sweep ({phase}): no finite loss at lengths {bad}")
        numbers["loss_by_length"] = {r.eval_length: round(r.loss, 4) for r in rows}

    prompt = torch.from_numpy(tokens[:PROMPT])[None].to(device)
    for phase in ("cold", "warm"):
        g0 = graphs()
        generator = torch.Generator(device=device).manual_seed(0)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            sampled = model.generate(prompt, SAMPLED_TOKENS, temperature=1.0, top_k=50, generator=generator)
        sync()
        seconds = time.perf_counter() - t0
        numbers[f"sample_{phase}_s"] = round(seconds, 3)
        numbers[f"graphs_compiled_sample_{phase}"] = graphs() - g0
        if tuple(sampled.shape) != (1, PROMPT + SAMPLED_TOKENS) or not bool(
                ((sampled >= 0) & (sampled < cfg.vocab_size)).all()):
            numbers["problems"].append(f"sampling ({phase}): got shape {tuple(sampled.shape)} or ids out of range")
    numbers["sample_tokens_per_s_warm"] = round(SAMPLED_TOKENS / numbers["sample_warm_s"], 1)
    numbers["recompile_limit_hits"] = counted.hits
    if counted.hits:
        numbers["problems"].append(f"dynamo hit its recompile limit {counted.hits} times: flex ran unfused")
    return numbers


# attention_timing: pelab's attention alone (model/attention ``attend``, the backend's prepared
# state reused as every layer of a forward reuses it), forward + backward, bf16, 12 heads of 64
ATTENTION_SHAPES = ((2, 8192),)  # (batch, T)
ATTENTION_CASES = (  # (name, scheme, model.attention, model options with W standing for T/8)
    ("flex causal", "rope", "flex", {}),
    ("flex window T/8", "rope", "flex", {"window": "W"}),
    ("flex sinks", "rope", "flex", {"sinks": "learned"}),
    ("sdpa causal", "rope", "sdpa", {}),
    ("sdpa window T/8", "rope", "sdpa", {"window": "W"}),
    ("sdpa sinks", "rope", "sdpa", {"sinks": "learned"}),
    ("sdpa_key alibi", "alibi", "sdpa_key", {}),
    ("sdpa_key alibi sinks", "alibi", "sdpa_key", {"sinks": "learned"}),
    ("flex t5", "t5", "flex", {}),
    ("flex t5 sinks", "t5", "flex", {"sinks": "learned"}),
)
ATTENTION_RATIOS = (  # (what, numerator case, denominator case, target or None)
    ("window T/8 / causal, flex (target <= 0.25)", "flex window T/8", "flex causal", 0.25),
    ("window T/8 / causal, sdpa", "sdpa window T/8", "sdpa causal", None),
    ("sinks / none, flex rope (target <= 1.05)", "flex sinks", "flex causal", 1.05),
    ("sinks / none, sdpa rope (target <= 1.05)", "sdpa sinks", "sdpa causal", 1.05),
    ("sinks / none, sdpa_key alibi (target <= 1.05)", "sdpa_key alibi sinks", "sdpa_key alibi", 1.05),
    ("sinks / none, flex t5 (target <= 1.05)", "flex t5 sinks", "flex t5", 1.05),
)


class _Captured(Exception):
    pass


def captured_attention(model, idx):
    """The arguments the first layer hands to ``attend`` in a bf16 training forward of ``model``."""
    import torch

    import model.gpt as gpt_module

    found = {}

    def spy(*args):
        found["args"] = args
        raise _Captured

    real, gpt_module.attend = gpt_module.attend, spy
    try:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            model.train()(idx)
    except _Captured:
        pass
    finally:
        gpt_module.attend = real
    return found["args"]


def attention_timing(out: Path) -> dict:
    """ATTENTION_CASES at each shape, in groups of one backend (timed together, so that their
    ratios are paired; the file is rewritten after each group, so a crash keeps what finished):
    per case the median over 5 interleaved rounds of the median of 10 forward + backward calls
    (CUDA events), per ratio the median and range of the per-round ratios. The masks and tables
    a forward prepares once are not in the time."""
    import statistics

    import torch

    from model.attention import attend
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.pe import SCHEMES

    torch.set_float32_matmul_precision("high")
    numbers: dict = {"problems": [], "shapes": {}}
    groups: dict[str, list] = {}
    for case in ATTENTION_CASES:
        groups.setdefault(f"{case[1]} on {case[2]}", []).append(case)
    for B, T in ATTENTION_SHAPES:
        shape = numbers["shapes"].setdefault(f"B={B} T={T}", {"ms": {}, "ratios": {}})
        times: dict[str, list[float]] = {}
        for group in groups.values():
            calls = {}
            for name, scheme, backend, options in group:
                options = {k: T // 8 if v == "W" else v for k, v in options.items()}
                cfg = GPTConfig(vocab_size=256, block_size=T, n_layer=1, n_head=12, n_embd=768, attention=backend,
                                **options)
                torch.manual_seed(0)
                model = GPT(cfg, SCHEMES[scheme](cfg)).cuda()
                idx = torch.randint(0, 256, (B, T), device="cuda")
                q, k, v, ctx, dropout, sink, *rest = captured_attention(model, idx)
                torch.cuda.synchronize()
                if ctx.backend.name != backend:
                    numbers["problems"].append(f"{name} at T={T}: ran on {ctx.backend.name}, not {backend}")
                q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
                sink = (None if sink is None else
                        sink.detach().float().requires_grad_(isinstance(sink, torch.nn.Parameter)))
                grad = torch.randn_like(q[..., : v.shape[-1]])

                def call(q=q, k=k, v=v, ctx=ctx, sink=sink, rest=rest, grad=grad):
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        y = attend(q, k, v, ctx, 0.0, sink, *rest)
                    y.backward(grad, retain_graph=True)  # a table's graph to the scheme's parameters is reused

                calls[name] = call
            for name, call in calls.items():  # warm-up: flex compiles
                for _ in range(3):
                    call()
                torch.cuda.synchronize()
            for name in calls:
                times[name] = []
            for _ in range(5):
                for name, call in calls.items():
                    ms = []
                    for _ in range(10):
                        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        start.record()
                        call()
                        end.record()
                        end.synchronize()
                        ms.append(start.elapsed_time(end))
                    times[name].append(statistics.median(ms))
            shape["ms"] |= {name: round(statistics.median(times[name]), 3) for name in calls}
            for what, num, den, target in ATTENTION_RATIOS:
                if num in calls and den in calls:
                    per_round = [a / b for a, b in zip(times[num], times[den])]
                    ratio = statistics.median(per_round)
                    shape["ratios"][what] = {"median": round(ratio, 3),
                                             "range": [round(min(per_round), 3), round(max(per_round), 3)]}
                    if target is not None:
                        shape["ratios"][what]["status"] = "PASS" if ratio <= target else "FAIL"
            (out / "attention_timing.json").write_text(json.dumps(numbers, indent=2) + "\n")
            del calls
            torch.cuda.empty_cache()
    return numbers


WORKERS = {"t5_timing": t5_timing, "attention_timing": attention_timing}


def run(name: str, out: Path) -> int:
    if name not in WORKERS:
        raise SystemExit(f"unknown worker {name!r}; workers: {', '.join(WORKERS)}")
    out.mkdir(parents=True, exist_ok=True)
    numbers = WORKERS[name](out)
    (out / f"{name}.json").write_text(json.dumps(numbers, indent=2) + "\n")
    print(json.dumps(numbers))
    return 0
