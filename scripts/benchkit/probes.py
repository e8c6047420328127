"""Peak training memory and evaluation time/memory, each measured in a fresh child process.

On CUDA peak memory is ``torch.cuda.max_memory_allocated``; on CPU it is the rise of the
process's peak RSS (``getrusage`` ru_maxrss) above its RSS before the model is built, in a
child forked from a server that has imported torch and lightning but computed nothing.
"""

from __future__ import annotations

import os
import statistics
import time

from benchkit.conf import lit_module
from benchkit.paths import PELAB_LOOP, Stop, path_body
from benchkit.report import eval_fields

EVAL_Q_CHUNK = 1024  # as evaluation/extrapolation.py
EVAL_TOKENS_PER_BATCH = 4096
TRAIN_STEPS = 3


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_start(device: str) -> float:
    import torch

    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    return _rss_bytes()


def _peak_mb(device: str, start: float) -> float:
    import resource

    import torch

    if device == "cuda":
        return (torch.cuda.max_memory_allocated() - start) / 2**20
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - start) / 2**20


def child_train_memory(job: dict) -> dict:
    """Peak memory of a few training steps of one path (run in a fresh child)."""
    import torch

    torch.set_num_threads(job["nthreads"])
    device = job["device"]
    start = _peak_start(device)

    class Steps:  # no baton: run TRAIN_STEPS steps and stop
        n = 0

        def begin(self) -> None:
            pass

        def tick(self) -> bool:
            self.n += 1
            if self.n >= TRAIN_STEPS:
                if job["scheme"] is None:
                    return True
                raise Stop
            return False

    body, _ = path_body(job["scheme"], job)
    try:
        body(Steps())
    except Stop:
        pass
    return {"peak_mem_mb": _peak_mb(device, start)}


def child_eval(job: dict) -> dict:
    """Time (median of 2 after a warm-up) and peak memory of ``GPT.token_nll`` at eval_factor x
    the training length, eval mode, under the row's precision (run in a fresh child). The
    learned scheme gets a position table that long: what is measured is the time."""
    import torch

    torch.set_num_threads(job["nthreads"])
    device, model = job["device"], job["model"]
    L_eval = model["block_size"] * job["eval_factor"]
    start = _peak_start(device)
    overrides = {"max_positions": L_eval} if job["scheme"] == "learned" else {}
    gpt = lit_module(model, job["scheme"], False, **overrides).model.to(device).eval()
    batch = job.get("eval_batch") or max(1, EVAL_TOKENS_PER_BATCH // L_eval)
    g = torch.Generator().manual_seed(1)
    xy = torch.randint(0, model["vocab_size"], (batch, L_eval + 1), generator=g).to(device)
    times = []
    for _ in range(3):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16,
                                             enabled=job["precision"] == "bf16-mixed"):
            nll = gpt.token_nll(xy[:, :-1], xy[:, 1:], q_chunk=EVAL_Q_CHUNK)
        float(nll.sum())
        times.append(time.perf_counter() - t0)
    return {"eval_s_16x": statistics.median(times[1:]), "eval_peak_mem_mb_16x": _peak_mb(device, start),
            "eval_length": L_eval, "eval_batch": batch}


def add_memory_and_eval(rows: list[dict], cfg: str, model: dict, precision: str, compile_: bool, opts: dict,
                        children) -> None:
    """Add ``peak_mem_mb`` (every row but pelab-loop's, which has pelab's model) and, on pelab
    rows, the evaluation fields to ``rows``, row by row, each measurement in a fresh child.
    Evaluation does not depend on ``compile``: it is cached by (config, scheme, precision, factor)."""
    import torch

    device, B = opts["device"], opts["batch_size"]
    nthreads = torch.get_num_threads()
    for row in rows:
        scheme = None if row["path"] == "reference" else row["scheme"]
        if row.get("documents"):  # the packed-documents path of the scheme (benchkit/paths.py)
            scheme = f"{scheme}+{row['documents']}"
        job = {"model": model, "scheme": scheme, "precision": precision, "compile": compile_, "device": device,
               "B": B, "nthreads": nthreads, "doc_length": opts.get("doc_length")}
        measured = opts["memory"] and row["path"] != PELAB_LOOP
        row["peak_mem_mb"] = round(children.run("memory", job)["peak_mem_mb"], 1) if measured else None
        row["peak_mem_method"] = ("cuda max_memory_allocated" if device == "cuda" else
                                  "cpu peak RSS rise (getrusage ru_maxrss) in a forked child") if measured else None
        row["eval_s_16x"] = row["eval_peak_mem_mb_16x"] = row["eval_length"] = None
        if opts["eval"] and row["path"] == "pelab":
            factors = opts["eval_factors"]
            batch = 1 if len(factors) > 1 else None  # a memory curve compares lengths alone
            curve = []
            for factor in factors:
                key = (cfg, scheme, precision, factor, batch)
                if key not in opts["eval_cache"]:
                    opts["eval_cache"][key] = children.run("eval", job | {"eval_factor": factor, "eval_batch": batch})
                curve.append(opts["eval_cache"][key])
            row |= eval_fields(factors, curve)
