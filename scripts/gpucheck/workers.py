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
MODEL = "gpt2"  # conf/model/gpt2.yaml, composed as train.py does (its defaults pull in conf/model/common)
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
    from benchkit.conf import composed
    from torch._dynamo.utils import counters

    from evaluation.extrapolation import ExtrapolationConfig, evaluate_extrapolation
    from model.config import GPTConfig
    from model.gpt import GPT
    from model.pe import SCHEMES

    torch.set_float32_matmul_precision("high")  # as train.py on CUDA
    device = torch.device(DEVICE)
    counted = _Count()
    logging.getLogger("torch._dynamo").addHandler(counted)
    options = composed("model", MODEL)
    cfg = GPTConfig(vocab_size=50257, **options)
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


def attention_timing(out: Path) -> dict:
    """scripts/benchkit/attention.py's GPU table: pelab's attention alone at B=2, T=8192, the
    file rewritten after each backend group, so that a crash keeps what finished."""
    from benchkit.attention import GPU_CASES, GPU_RATIOS, time_attention

    return time_attention("cuda", [(2, 8192)], GPU_CASES, GPU_RATIOS,
                          write=lambda numbers: (out / "attention_timing.json").write_text(
                              json.dumps(numbers, indent=2) + "\n"))


WORKERS = {"t5_timing": t5_timing, "attention_timing": attention_timing}


def run(name: str, out: Path) -> int:
    if name not in WORKERS:
        raise SystemExit(f"unknown worker {name!r}; workers: {', '.join(WORKERS)}")
    out.mkdir(parents=True, exist_ok=True)
    numbers = WORKERS[name](out)
    (out / f"{name}.json").write_text(json.dumps(numbers, indent=2) + "\n")
    print(json.dumps(numbers))
    return 0
