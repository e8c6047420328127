"""The acceptance run's steps: each a command with a timeout, and a parser that turns the finished
process (exit code, log, files it wrote) into a status and its key numbers. What each asserts and
why: docs/gpu.md."""

from __future__ import annotations

import csv
import json
import math
import re
import statistics
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# one short trainer=gpu run per scheme: tiny model, bytes corpus, a validation after a sanity check
# (num_sanity_val_steps builds flex's BlockMask under inference_mode before training uses it)
TRAIN_OVERRIDES = ("model=tiny", "trainer.max_steps=20", "trainer.val_check_interval=10",
                   "trainer.limit_val_batches=2", "trainer.num_sanity_val_steps=2", "trainer.log_every_n_steps=5",
                   "trainer.enable_progress_bar=false", "logger=csv", "eval.extrapolation.enabled=false",
                   "data.val_windows=64")
# beside the per-scheme runs: the other routes a real run takes
TRAIN_EXTRAS = {
    "t5_compile": ("pe=t5", "compile=true"),  # flex inside the compiled model, through Lightning
    "alibi_fp16": ("pe=alibi", "trainer.precision=16-mixed"),  # fp16: alibi on flex, GradScaler
    "t5_dropout": ("pe=t5", "model.dropout=0.2"),  # attention dropout: t5 on math
    # what landed after the acceptance was first written, each in one run:
    # packed documents (every paragraph a document): flex's document BlockMask forward and backward
    "t5_documents": ("pe=t5", "data.document_mask=true", "data.corpus.sample_by=paragraph"),
    # ... and the SDPA routes' bool masks, asked for by name (auto takes flex for documents on CUDA):
    # rope on sdpa with restarted positions, alibi on sdpa_key
    "rope_documents": ("pe=rope", "model.attention=sdpa", "data.document_mask=true", "data.document_positions=true",
                       "data.corpus.sample_by=paragraph"),
    "alibi_documents": ("pe=alibi", "model.attention=sdpa_key", "data.document_mask=true",
                        "data.corpus.sample_by=paragraph"),
    # attention temperature (a per-query scale of q) with randomized positions
    "rope_temperature_randomized": ("pe=rope", "model.attn_temperature=log_length", "pe.randomize_to=1024"),
    # init_from (train_rope's checkpoint) with training-time RoPE scaling at twice the length
    "rope_init_from_yarn": ("pe=rope", "init_from={train}/rope/checkpoints/last.ckpt", "model.block_size=512",
                            "pe.scaling.kind=yarn", "pe.scaling.factor=2"),
    # 32-true with a learned bias: SDPA with a float32 mask that requires grad
    "t5_fp32": ("pe=t5", "trainer.precision=32-true"),
    # sliding windows and attention sinks (flex's window BlockMask, the sink through flex's LSE),
    # and stick-breaking attention (math)
    "rope_window_sinks": ("pe=rope", "model.window_pattern=[64,null]", "model.sinks=learned"),
    "t5_window_sinks": ("pe=t5", "model.window=64", "model.sinks=learned"),
    "stick_breaking": ("pe=nope", "model.normaliser=stick_breaking"),
}
# the bench (gpt2 124M, context 1024, batch 16, bf16, compiled) in two runs, each with rope as the
# baseline of its bias schemes: a part stopped during the second keeps the first's rows
BENCH_RUNS = {
    "bench_core": {"schemes": ("learned", "rope", "alibi", "rope_alibi"), "extra": ()},
    "bench_bias_documents": {"schemes": ("rope", "alibi", "t5", "kerple_log", "fire"),
                             "extra": ("documents=mask", "documents_schemes=rope,alibi,t5")},
}
# what landed on CPU only (docs/gpu.md, "Not yet run on a GPU"): PoPE and FoX against rope, and
# rope with learned sinks and with a window pattern against itself
BENCH_2026 = {
    "bench_2026": {"schemes": ("rope", "pope", "fox"),
                   "extra": ("variants=sinks=learned,window_pattern=[128,null]", "variant_schemes=rope")},
    "bench_bias_table": {"schemes": ("rope", "t5", "kerple_log", "fire"), "extra": ()},
}
BENCH_ARGS = ("compile=true", "rounds=5", "steps=3", "warmup=2", "warmup_parallel=3", "eval=false", "memory=false",
              "loop=false")


@dataclass
class Result:
    """What a step left: exit code (None: timed out), seconds, its log and output folder."""

    returncode: int | None
    seconds: float
    log: str
    out: Path


@dataclass
class Step:
    name: str
    group: str
    what: str
    command: list[str]  # run in the repository root; [] for the in-process preflight
    timeout_s: int
    parse: Callable[[Result], tuple[str, str, dict]]  # -> (status, reason, key numbers)
    gpus: int = 1  # GPUs it needs; fewer present: skipped with a note

    def shown(self) -> str:
        return " ".join("python" if c == PY else c for c in self.command) if self.command else "(in process)"


def ok_exit(result: Result) -> tuple[str, str] | None:
    """(fail, reason) for a timeout or a non-zero exit, else None. The reason of an exit is the
    exception that ended the process (``raised``), else the log's last line."""
    if result.returncode is None:
        return "fail", f"timed out after {result.seconds:.0f} s"
    if result.returncode != 0:
        tail = [line for line in result.log.strip().splitlines() if line.strip()][-1:] or ["no output"]
        return "fail", f"exit code {result.returncode}: {(raised(result.log) or tail[0])[:300]}"
    return None


TRACEBACK = "Traceback (most recent call last):"
CAUSED = "The above exception was the direct cause of the following exception:"


def raised(log: str) -> str | None:
    """The exception a Python process died of, read from its log: the last traceback's exception
    (``Type: message``), when the log ends with it. When that exception was raised *from* another
    (the "direct cause" chain: Hydra's instantiate wraps whatever the target raised in an
    InstantiationException whose own text ends in ``full_key: ...``), the innermost cause, the
    wrapper named after it. None when the log does not end in a traceback."""
    lines = log.rstrip().splitlines()
    last = len(lines) - 1
    chain: list[tuple[str, str]] = []  # (type, message) from the outermost back to the cause
    end = last + 1
    while True:
        starts = [i for i in range(end) if lines[i].rstrip() == TRACEBACK]
        if not starts:
            break
        found = _exception_after(lines, starts[-1], end)
        if found is None or (not chain and found[2] < last):  # the log goes on after it: not what ended it
            break
        chain.append(found[:2])
        before = [line.strip() for line in lines[max(starts[-1] - 3, 0):starts[-1]] if line.strip()]
        if not before or before[-1] != CAUSED:
            break
        end = starts[-1]
    if not chain:
        return None
    kind, message = chain[-1]
    text = f"{kind}: {message}" if message else kind
    return text if len(chain) == 1 else f"{text} (raised inside {chain[0][0]})"


def _exception_after(lines: list[str], header: int, end: int) -> tuple[str, str, int] | None:
    """(type, message, index of its last line) of the exception a traceback starting at line
    ``header`` ends with: the first line after its frames (indented) at column 0, and the lines
    that follow it up to a blank one; None when there is none before ``end``."""
    i = header + 1
    while i < end and (not lines[i].strip() or lines[i][0] in " \t"):
        i += 1
    if i >= end:
        return None
    stop = i + 1
    while stop < end and lines[stop].strip() and lines[stop].rstrip() not in (TRACEBACK, CAUSED):
        stop += 1
    kind, _, first = lines[i].partition(": ")
    message = " ".join([first.strip(), *(line.strip() for line in lines[i + 1:stop])]).strip()
    return kind.strip(), message, stop - 1


# --------------------------------------------------------------------------------------
# cuda tests
# --------------------------------------------------------------------------------------


def parse_junit(path: Path) -> dict:
    """Counts, seconds, failures (test id and first line of the message), the largest ratio of a
    recorded error to its bound (``*_rel_err`` / ``*_bound`` properties) and the route of each test."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = [c for c in suite.findall("testcase") if c.get("name")]  # an interrupted test leaves a nameless one
    failures, routes, worst = [], {}, (0.0, None)
    for case in cases:
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}".rsplit(".", 1)[-1]
        problem = case.find("failure")
        if problem is None:
            problem = case.find("error")
        if problem is not None:
            failures.append({"test": test_id, "message": (problem.get("message") or "").splitlines()[0][:300]
                             if problem.get("message") else ""})
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if "route" in props:
            routes[test_id] = props["route"]
        for key, value in props.items():
            if key.endswith("_rel_err") and key.replace("_rel_err", "_bound") in props:
                ratio = float(value) / max(float(props[key.replace("_rel_err", "_bound")]), 1e-30)
                if ratio > worst[0]:
                    worst = (ratio, f"{test_id} {key.removesuffix('_rel_err')}")
    skipped = sum(1 for c in cases if c.find("skipped") is not None)
    return {"tests": len(cases), "failed": len(failures), "skipped": skipped,
            "passed": len(cases) - len(failures) - skipped, "seconds": round(float(suite.get("time", 0.0)), 1),
            "worst_error_to_bound": round(worst[0], 3), "worst_at": worst[1], "failures": failures,
            "routes": routes}


def parse_cuda_tests(result: Result) -> tuple[str, str, dict]:
    xml = result.out / "cuda-tests.xml"
    if not xml.is_file():
        bad = ok_exit(result) or ("fail", "pytest wrote no junit xml")
        return bad[0], bad[1], {}
    numbers = parse_junit(xml)
    if result.returncode is None:  # interrupted: the xml holds the tests that finished
        return "fail", (f"timed out after {result.seconds:.0f} s, with {numbers['passed']} passed and "
                        f"{numbers['failed']} failed before"), numbers
    if numbers["tests"] == 0:
        return "fail", "no cuda test ran", numbers
    if numbers["failed"]:
        return "fail", f"{numbers['failed']} of {numbers['tests']} failed", numbers
    if numbers["skipped"]:
        return "fail", f"{numbers['skipped']} skipped on a GPU machine", numbers
    return "pass", "", numbers


def cuda_tests_step(out: Path, workers: int = 1) -> Step:
    """``workers`` > 1: pytest-xdist's ``-n`` (when installed: GPU images have it), the flex
    compiles of the tests then run side by side."""
    import importlib.util

    parallel = ["-n", str(workers)] if workers > 1 and importlib.util.find_spec("xdist") else []
    return Step("cuda_tests", "tests", "pytest -m cuda: every scheme x route x {bf16, fp16} x dropout {0, 0.2} "
                "against math, flex gradients, compile graphs, flash-only sdpa_key, chunked loss"
                + (f", {workers} pytest workers" if parallel else ""),
                [PY, "-m", "pytest", "-m", "cuda", *parallel, "-v", "-p", "no:cacheprovider", "tests/gpu",
                 f"--junitxml={out / 'cuda-tests.xml'}", "-o", "junit_family=xunit1"],
                600, parse_cuda_tests)


# --------------------------------------------------------------------------------------
# train.py runs
# --------------------------------------------------------------------------------------


def parse_train_log(log: str) -> dict:
    """The backend train.py printed, the MFU peak it used, its final validation loss."""
    numbers: dict = {}
    if m := re.search(r"\[pelab\] attention: (\S+)", log):
        numbers["attention"] = m.group(1)
    if m := re.search(r"train/mfu peak: (.+)", log):
        numbers["mfu_peak"] = m.group(1).strip()
    elif "train/mfu not logged" in log:
        numbers["mfu_peak"] = "none"
    if m := re.search(r"\[pelab\] val loss (\S+)", log):
        numbers["val_loss"] = float(m.group(1))
    return numbers


def last_logged(metrics_csv: Path, *keys: str) -> dict:
    """The last non-empty value of each key in a CSVLogger metrics.csv."""
    found: dict = {}
    if not metrics_csv.is_file():
        return found
    with open(metrics_csv, newline="") as f:
        for row in csv.DictReader(f):
            for key in keys:
                if row.get(key):
                    found[key] = float(row[key])
    return found


def run_dir_of(command: list[str]) -> Path:
    """The ``hydra.run.dir=`` a train.py command writes to."""
    return Path(next(c for c in command if c.startswith("hydra.run.dir=")).partition("=")[2])


def train_parser(run_dir: Path) -> Callable[[Result], tuple[str, str, dict]]:
    """The parser of a train.py run writing to ``run_dir``: its log, and the last tokens/s and MFU
    of its CSVLogger file, ``run_dir/csv/metrics.csv`` (conf/logger/csv.yaml: save_dir is the
    run's output dir, name csv, version empty)."""

    def parse_train(result: Result) -> tuple[str, str, dict]:
        numbers = parse_train_log(result.log)
        numbers |= {k.split("/")[-1]: round(v, 4) for k, v in
                    last_logged(run_dir / "csv" / "metrics.csv", "train/tokens_per_sec", "train/mfu").items()}
        if bad := ok_exit(result):
            return bad[0], bad[1], numbers
        loss = numbers.get("val_loss")
        if loss is None or not math.isfinite(loss):
            return "fail", f"no finite validation loss printed (got {loss})", numbers
        return "pass", "", numbers

    return parse_train


def train_step(name: str, group: str, what: str, command: list[str], timeout_s: int, gpus: int = 1) -> Step:
    return Step(name, group, what, command, timeout_s, train_parser(run_dir_of(command)), gpus)


def train_steps(out: Path, schemes: list[str]) -> list[Step]:
    """One run per scheme, then TRAIN_EXTRAS (``{train}`` in an override: the folder of the runs)."""
    runs = {s: (f"pe={s}",) for s in schemes} | {name: tuple(o.format(train=out / "train") for o in extra)
                                                 for name, extra in TRAIN_EXTRAS.items()}
    return [train_step(f"train_{name}", "train", f"python train.py trainer=gpu {' '.join(extra)}: "
                       f"{TRAIN_OVERRIDES[1]}, sanity validation, finite val loss",
                       [PY, "train.py", "trainer=gpu", *extra, *TRAIN_OVERRIDES,
                        f"hydra.run.dir={out / 'train' / name}"],
                       240 if "compile=true" in extra else 150) for name, extra in runs.items()]


def ddp_step(out: Path, gpus: int) -> Step:
    devices = str(gpus) if gpus >= 2 else "N"  # every GPU present; with one, skipped
    return train_step("ddp", "ddp", "python train.py trainer=ddp on every GPU present, pe=t5 (a learned bias: its "
                      "gradients reduced over ranks)",
                      [PY, "train.py", "trainer=ddp", f"trainer.devices={devices}", "pe=t5", *TRAIN_OVERRIDES,
                       f"hydra.run.dir={out / 'train' / 'ddp'}"], 300, gpus=2)


# --------------------------------------------------------------------------------------
# t5 extrapolation sweep and sampling (workers.py)
# --------------------------------------------------------------------------------------


def worker_parser(name: str) -> Callable[[Result], tuple[str, str, dict]]:
    """Fails on the worker's exit or its ``problems``; targets in its numbers are reported only."""

    def parse_worker(result: Result) -> tuple[str, str, dict]:
        path = result.out / f"{name}.json"
        numbers = json.loads(path.read_text()) if path.is_file() else {}
        if bad := ok_exit(result):
            return bad[0], bad[1], numbers
        if not numbers:
            return "fail", f"the worker wrote no {name}.json", numbers
        problems = numbers.get("problems", [])
        return ("fail", "; ".join(problems), numbers) if problems else ("pass", "", numbers)

    return parse_worker


def t5_step(out: Path) -> Step:
    return Step("t5_timing", "timing", "t5 at gpt2 size (L=1024): the 16x extrapolation sweep (1k..16k, bf16) cold "
                "and warm, and 100 sampled tokens with a KV cache, timed; graphs compiled counted",
                [PY, "scripts/gpu_check.py", "worker=t5_timing", f"out={out}"], 420, worker_parser("t5_timing"))


def attention_step(out: Path) -> Step:
    return Step("attention_timing", "timing", "pelab's attention alone, forward + backward, bf16, 12 heads of 64, "
                "B=2 T=8192: flex and sdpa windows of T/8 against causal, sinks against none "
                "on flex, sdpa and sdpa_key (targets reported, not failed)",
                [PY, "scripts/gpu_check.py", "worker=attention_timing", f"out={out}"], 240,
                worker_parser("attention_timing"))


# --------------------------------------------------------------------------------------
# the bench
# --------------------------------------------------------------------------------------


def bench_numbers(rows: list[dict]) -> dict:
    """Per scheme (pelab rows): step ms, tokens/s, MFU, compile s; per document-masked row its
    step ratio to the same scheme; the peak used; the reference's step; each performance target
    judged (scripts/benchkit/report.py ``targets``) as a PASS or FAIL line."""
    from benchkit.report import targets

    numbers: dict = {"schemes": {}}
    for row in rows:
        if row.get("path") == "pelab":
            numbers["schemes"][row["scheme"]] = {k: row.get(k) for k in ("step_ms", "tokens_per_s", "mfu", "compile_s")}
        if row.get("path") == "pelab-documents":
            numbers.setdefault("documents", {})[f"{row['scheme']}+{row['documents']}"] = {
                k: row.get(k) for k in ("step_ms", "step_ratio_vs_same_scheme", "doc_length")}
        if row.get("path") == "pelab-variant":
            numbers.setdefault("variants", {})[f"{row['scheme']}@{row['variant']}"] = {
                k: row.get(k) for k in ("step_ms", "step_ratio_vs_same_scheme", "step_ratio_vs_same_scheme_ci95")}
        if row.get("peak_source"):
            numbers["peak"] = f"{row.get('peak_tflops')} TFLOP/s ({row['peak_source']})"
        if row.get("path") == "reference":
            numbers["reference_step_ms"] = row.get("step_ms")
            numbers["reference_mfu"] = row.get("mfu")
    numbers["targets"] = [f"{t['status']} {t['target']}: {t['detail']}" for t in targets(rows)]
    ratios = loop_ratios(rows)
    numbers["targets"] += ratios.pop("targets", [])
    return numbers | ratios


PELAB_OVER_REFERENCE_MIN = 0.95  # issue 47: pelab's tokens/s at least 0.95x the plain loop's
ROPE_OVER_LEARNED_STEP_MAX = 1.03  # issue 47: rope's step at most 1.03x learned's


def loop_ratios(rows: list[dict]) -> dict:
    """The tokens/s ratios with their 95% intervals (the bench's paired per-round ratios) where
    the rows have them: pelab learned / the reference, pelab's model in the reference's loop /
    the reference, rope / learned; with issue 47's two targets as lines (PASS or FAIL) on CUDA."""
    found: dict = {}
    lines = []
    for row in rows:
        if row.get("path") in ("pelab", "pelab-loop") and row["scheme"] == "learned" \
                and row.get("ratio_vs_reference") is not None:
            name = "pelab_over_reference" if row["path"] == "pelab" else "pelab_loop_over_reference"
            found[name], found[f"{name}_ci95"] = row["ratio_vs_reference"], row.get("ratio_vs_reference_ci95")
            if row["path"] == "pelab" and row.get("device") == "cuda":
                ci = row.get("ratio_vs_reference_ci95")
                lines.append(f"{'PASS' if row['ratio_vs_reference'] >= PELAB_OVER_REFERENCE_MIN else 'FAIL'} pelab "
                             f"learned tokens/s >= {PELAB_OVER_REFERENCE_MIN}x the reference's (issue 47; "
                             f"{row['config']}): {row['ratio_vs_reference']:.3f}" + (f" ({ci[0]:.3f}-{ci[1]:.3f})"
                                                                                   if ci else ""))
        if row.get("path") == "pelab" and row["scheme"] == "rope" and row.get("ratio_vs_learned"):
            found["rope_over_learned"], found["rope_over_learned_ci95"] = (row["ratio_vs_learned"],
                                                                           row.get("ratio_vs_learned_ci95"))
            if row.get("device") == "cuda":
                step = 1 / row["ratio_vs_learned"]  # tokens/s learned / rope = rope's step / learned's
                ci = row.get("ratio_vs_learned_ci95")
                lines.append(f"{'PASS' if step <= ROPE_OVER_LEARNED_STEP_MAX else 'FAIL'} rope step <= "
                             f"{ROPE_OVER_LEARNED_STEP_MAX}x learned's (issue 47; {row['config']}): {step:.3f}"
                             + (f" ({1 / ci[1]:.3f}-{1 / ci[0]:.3f})" if ci else ""))
    if lines:
        found["targets"] = lines
    return found


def bench_parser(rows_file: Path, schemes: tuple[str, ...]) -> Callable[[Result], tuple[str, str, dict]]:
    """Passes when every scheme has its row with an MFU; the targets are reported, never failed."""

    def parse_bench(result: Result) -> tuple[str, str, dict]:
        lines = rows_file.read_text().splitlines() if rows_file.is_file() else []
        numbers = bench_numbers([json.loads(line) for line in lines if line.strip()])
        if bad := ok_exit(result):
            return bad[0], bad[1], numbers
        missing = [s for s in schemes if s not in numbers["schemes"]]
        if missing:
            return "fail", f"no bench row for {missing}", numbers
        if any(not (v.get("mfu") or 0) > 0 for v in numbers["schemes"].values()):
            return "fail", "no MFU: no peak known for this device", numbers
        return "pass", "", numbers

    return parse_bench


def bench_steps(out: Path, runs: dict = BENCH_RUNS) -> list[Step]:
    steps = []
    for name, run in runs.items():
        rows = out / f"{name}.jsonl"
        extra = " ".join(run["extra"])
        steps.append(Step(name, "bench", f"scripts/bench.py: gpt2 124M at context 1024, compiled, bf16, "
                          f"{', '.join(run['schemes'])}{f' ({extra})' if extra else ''}: step times, MFU, the "
                          "performance targets (reported, not failed)",
                          [PY, "scripts/bench.py", f"configs=gpt2-gpt2:{'+'.join(run['schemes'])}", *BENCH_ARGS,
                           *run["extra"], f"out={rows}"], 480, bench_parser(rows, run["schemes"])))
    return steps


# --------------------------------------------------------------------------------------
# issue 47: evaluation on the training device, host syncs per step, the bench with the plain loop
# --------------------------------------------------------------------------------------

# gpt2 124M at context 1024, compiled, bf16, on the bytes corpus (the gpt2 tokenizer needs the
# network); the end-of-training extrapolation at L x {1, 2, 4} on 65536 tokens per length
GPT2_EVAL_RUN = ("model=gpt2", "data=gutenberg", "compile=true", "trainer.precision=bf16-mixed", "data.batch_size=16",
                 "trainer.max_steps=80", "trainer.log_every_n_steps=10", "trainer.val_check_interval=80",
                 "trainer.limit_val_batches=2", "data.val_windows=32", "trainer.enable_progress_bar=false",
                 "logger=csv", "eval.sweep.multipliers=[1,2,4]", "eval.extrapolation.max_tokens=65536",
                 "eval.probe.enabled=false")
EVAL_DEVICE = re.compile(r"\[pelab\] evaluation on (\S+?)(?:,|: )")  # pelab/evaluate.py, before the probes
EXTRAPOLATION_ROW = re.compile(r"\[extrapolation\] .*? eval=(\d+) .*: ppl \S+ \(loss \S+\) over (\d+) tokens in "
                               r"([0-9.]+)s")  # evaluation/extrapolation.py format_row


def logged(metrics_csv: Path, key: str) -> list[float]:
    """Every non-empty value of ``key`` in a CSVLogger metrics.csv, in order."""
    if not metrics_csv.is_file():
        return []
    with open(metrics_csv, newline="") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def eval_rows(log: str, table: Path) -> list[tuple[int, int, float]]:
    """(eval length, tokens, seconds) of each extrapolation row: from the table train.py wrote
    (full precision), else from the lines it printed (seconds to 0.1 s)."""
    if table.is_file():
        with open(table, newline="") as f:
            return [(int(r["eval_length"]), int(r["tokens"]), float(r["seconds"])) for r in csv.DictReader(f)
                    if r.get("status") == "ok" and r.get("mode") == "nonoverlapping"
                    and r.get("rope_scaling") == "none"]
    return [(int(n), int(t), float(s)) for n, t, s in EXTRAPOLATION_ROW.findall(log)]


def gpt2_eval_parser(run_dir: Path) -> Callable[[Result], tuple[str, str, dict]]:
    """Passes when the run ended with a finite validation loss and its end-of-training evaluation
    scored on CUDA; reports the evaluation's tokens/s (all lengths, and at L) against training's
    (the median of the logged values after the first, which holds the compile)."""

    def parse(result: Result) -> tuple[str, str, dict]:
        numbers = parse_train_log(result.log)
        if m := EVAL_DEVICE.search(result.log):
            numbers["eval_device"] = m.group(1)
        train = logged(run_dir / "csv" / "metrics.csv", "train/tokens_per_sec")
        if train:
            numbers["train_tokens_per_s"] = round(statistics.median(train[1:] or train), 1)
        rows = eval_rows(result.log, run_dir / "extrapolation" / "extrapolation.csv")
        if rows:
            numbers["eval_tokens_per_s_by_length"] = {n: round(t / s, 1) if s > 0 else None for n, t, s in rows}
            seconds = sum(s for _, _, s in rows)
            numbers["eval_tokens"], numbers["eval_s"] = sum(t for _, t, _ in rows), round(seconds, 3)
            if seconds > 0:
                numbers["eval_tokens_per_s"] = round(numbers["eval_tokens"] / seconds, 1)
            if train and seconds > 0:
                numbers["eval_over_train_tokens_per_s"] = round(numbers["eval_tokens_per_s"]
                                                                / numbers["train_tokens_per_s"], 3)
        if bad := ok_exit(result):
            return bad[0], bad[1], numbers
        loss = numbers.get("val_loss")
        if loss is None or not math.isfinite(loss):
            return "fail", f"no finite validation loss printed (got {loss})", numbers
        if not numbers.get("eval_device", "").startswith("cuda"):
            where = numbers.get("eval_device", "no device printed")
            return "fail", f"the end-of-training evaluation scored on {where}, not on the GPU that trained", numbers
        if not rows:
            return "fail", "no extrapolation row printed", numbers
        return "pass", "", numbers

    return parse


def gpt2_eval_step(out: Path) -> Step:
    run_dir = out / "train" / "gpt2_eval"
    return Step("train_gpt2_eval", "issue47", "python train.py trainer=gpu model=gpt2 data=gutenberg compile=true: "
                "80 steps of gpt2 124M at 1024, then the end-of-training extrapolation at L x {1,2,4} on the "
                "training device; evaluation tokens/s against training tokens/s",
                [PY, "train.py", "trainer=gpu", *GPT2_EVAL_RUN, f"hydra.run.dir={run_dir}"], 300,
                gpt2_eval_parser(run_dir))


# a tiny run with the default callbacks and progress bar; the step from one batch start to the next
HOST_SYNCS_RUN = ("model=tiny", "data=gutenberg", "trainer.max_steps=40", "trainer.log_every_n_steps=10",
                  "trainer.val_check_interval=1000", "trainer.limit_val_batches=1", "logger=csv",
                  "eval.extrapolation.enabled=false", "eval.probe.enabled=false")


def logging_step(step: int, every: int) -> bool:
    """Lightning logs in the step after which global_step is a multiple of log_every_n_steps."""
    return (step + 1) % every == 0


def host_syncs_numbers(report: dict) -> dict:
    """Syncs per training step, in steps that do not log and in steps that do (the last step,
    which ends the fit, and the time before the first are left out), the places of the first
    kind, and the target (none there) as a PASS or FAIL line."""
    every, last = int(report["log_every_n_steps"]), int(report["steps"]) - 1
    counts = {int(s): n for s, n in report["counts"].items()}
    quiet = [s for s in range(last) if not logging_step(s, every)]
    logs = [s for s in range(last) if logging_step(s, every)]
    places: dict[str, int] = {}
    for s in quiet:
        for place, n in report["sites"].get(str(s), {}).items():
            places[place] = places.get(place, 0) + n
    in_quiet = sum(counts.get(s, 0) for s in quiet)
    numbers = {"self_test": report["self_test"], "steps": report["steps"], "log_every_n_steps": every,
               "syncs_per_quiet_step": round(in_quiet / len(quiet), 2) if quiet else None,
               "max_in_a_quiet_step": max((counts.get(s, 0) for s in quiet), default=None),
               "syncs_per_logging_step": round(sum(counts.get(s, 0) for s in logs) / len(logs), 2) if logs else None,
               "before_the_first_step": counts.get(-1, 0),
               "quiet_sites": dict(sorted(places.items(), key=lambda kv: -kv[1])[:6])}
    numbers["targets"] = [f"{'PASS' if quiet and not in_quiet else 'FAIL'} no host sync in a training step that does "
                          f"not log (issue 47): {in_quiet} in {len(quiet)} such steps; "
                          f"{numbers['syncs_per_logging_step']} per logging step"]
    return numbers


def host_syncs_parser(path: Path) -> Callable[[Result], tuple[str, str, dict]]:
    """Passes when the run ended and the counter proved it sees syncs (its deliberate ``.item()``
    counted once); the count in quiet steps is a target, reported and never failed."""

    def parse(result: Result) -> tuple[str, str, dict]:
        numbers = host_syncs_numbers(json.loads(path.read_text())) if path.is_file() else {}
        if bad := ok_exit(result):
            return bad[0], bad[1], numbers
        if not numbers:
            return "fail", f"the run wrote no {path.name}", numbers
        if numbers["self_test"] != 1:
            return "fail", f"the counter saw {numbers['self_test']} syncs for one .item(): its counts mean nothing", \
                numbers
        return "pass", "", numbers

    return parse


def host_syncs_step(out: Path) -> Step:
    path = out / "host_syncs.json"
    return Step("host_syncs", "issue47", "python train.py trainer=gpu model=tiny, 40 steps logging every 10, under "
                "torch.cuda.set_sync_debug_mode('warn') (scripts/gpucheck/syncs.py): synchronising CUDA calls per "
                "training step, in steps that log and in those that do not (target: none there, reported)",
                [PY, "train.py", "trainer=gpu", *HOST_SYNCS_RUN,
                 "+callbacks.host_syncs._target_=scripts.gpucheck.syncs.CudaSyncs",
                 f"+callbacks.host_syncs.out={path}", f"hydra.run.dir={out / 'train' / 'host_syncs'}"], 150,
                host_syncs_parser(path))


# the bench with the reference's plain loop: 4 paths (reference, pelab's model in that loop,
# pelab learned and rope under Lightning) compiled 4 at once, then 9 rounds (a 95% interval
# needs 6 or more)
BENCH_LOOP_ARGS = ("configs=gpt2-gpt2:learned+rope", "compile=true", "loop=true", "rounds=9", "steps=3", "warmup=2",
                   "warmup_parallel=4", "eval=false", "memory=false")


def bench_loop_step(out: Path) -> Step:
    rows = out / "bench_loop.jsonl"
    return Step("bench_loop", "issue47", "scripts/bench.py: gpt2 124M at context 1024, compiled, bf16, learned and "
                "rope with the reference's plain loop: pelab / reference tokens/s (and pelab's model in that loop), "
                "rope / learned, MFU, each ratio with its 95% interval (targets reported, not failed)",
                [PY, "scripts/bench.py", *BENCH_LOOP_ARGS, f"out={rows}"], 420,
                bench_parser(rows, ("learned", "rope")))


def fsdp_step(out: Path, gpus: int) -> Step:
    devices = str(gpus) if gpus >= 2 else "N"
    return train_step("fsdp", "ddp", "python train.py trainer=fsdp on every GPU present, pe=kerple_log (parameters "
                      "projected after the optimizer step, position terms float32 under FSDP's bf16)",
                      [PY, "train.py", "trainer=fsdp", f"trainer.devices={devices}", "pe=kerple_log",
                       *TRAIN_OVERRIDES, f"hydra.run.dir={out / 'train' / 'fsdp'}"], 300, gpus=2)


def all_steps(out: Path, schemes: list[str], gpus: int, workers: int = 1) -> list[Step]:
    """Every step after the preflight, in the order they run (the most telling first, so that a
    budget running out drops the least)."""
    return [cuda_tests_step(out, workers), *train_steps(out, schemes), t5_step(out), attention_step(out),
            *bench_steps(out), *bench_steps(out, BENCH_2026), gpt2_eval_step(out), host_syncs_step(out),
            bench_loop_step(out), ddp_step(out, gpus), fsdp_step(out, gpus)]


PART_BUDGET_S = 540  # a part is one command of a borrowed GPU machine (10 min at most, its start included)


@dataclass
class Part:
    """A named part of the acceptance run: lanes of steps that run side by side (each lane in
    order) within one budget."""

    name: str
    what: str
    budget_s: int
    lanes: list[list[Step]]

    def steps(self) -> list[Step]:
        return [step for lane in self.lanes for step in lane]


def parts(out: Path, schemes: list[str], gpus: int, workers: int) -> dict[str, Part]:
    """Four parts, each within one GPU-machine command. Part 1: the cuda tests (pytest -n
    ``workers``), the short train runs and t5_timing, three lanes at once (none of them is timed
    for performance). Part 2: the bench alone, so that its step times are clean. Part 3: what
    has not yet run on a GPU: the cuda tests beside its train runs, then, after them in the
    first lane, the attention timing and its bench runs (the train lane ends first). Part 4: what
    issue 47 changes: the cuda tests then the bench with the reference's loop in one lane, the
    gpt2 train run with its evaluation and the host-sync count in the other (both report ratios or
    counts within their own run, so the other lane's load does not bias them)."""
    every = {step.name: step for step in all_steps(out, schemes, gpus, workers)}
    train = [every[name] for name in PART1_TRAIN]
    return {
        "1": Part("1", "preflight; cuda tests beside the train runs and the t5 timing", PART_BUDGET_S,
                  [[every["cuda_tests"]], train, [every["t5_timing"]]]),
        "2": Part("2", "preflight; the bench alone (step times, MFU, the performance targets)", PART_BUDGET_S,
                  [[every[name] for name in BENCH_RUNS]]),
        "3": Part("3", "preflight; the cuda tests beside the new train runs, then the attention timing and the bench "
                       "of PoPE, FoX, sinks, windows and the learned-bias table route", PART_BUDGET_S,
                  [[every["cuda_tests"], every["attention_timing"], *(every[name] for name in BENCH_2026)],
                   [every[name] for name in PART3_TRAIN]]),
        "4": Part("4", "preflight; issue 47: the cuda tests, then the bench with the reference's loop (pelab / "
                       "reference, rope / learned, MFU), beside a gpt2 train run that evaluates on the GPU and the "
                       "host syncs per training step", PART_BUDGET_S,
                  [[replace(every["cuda_tests"], timeout_s=PART4_TESTS_S), every["bench_loop"]],
                   [every["train_gpt2_eval"], every["host_syncs"]]]),
    }


# part 1's train runs, in order (the first runs alone: it tokenizes the corpus into the cache)
PART1_TRAIN = ("train_rope", "train_t5", "train_fire", "train_alibi", "train_t5_documents", "train_rope_documents",
               "train_alibi_documents", "train_rope_init_from_yarn", "train_rope_temperature_randomized",
               "train_t5_fp32", "train_t5_compile", "train_alibi_fp16", "train_t5_dropout")
# part 4's cuda tests stop here, so that the bench after them keeps the time to compile and time
# (they took 81-121 s alone with 4 workers on an H100 and an H200)
PART4_TESTS_S = 300
# part 3's: the schemes and options that landed on CPU only
PART3_TRAIN = ("train_pope", "train_fox", "train_cope", "train_rope_window_sinks", "train_t5_window_sinks",
               "train_stick_breaking")


@dataclass
class Outcome:
    step: Step
    status: str  # pass, fail, skip
    reason: str = ""
    seconds: float = 0.0
    numbers: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.step.name, "group": self.step.group, "what": self.step.what,
                "command": self.step.shown(), "timeout_s": self.step.timeout_s, "status": self.status,
                "reason": self.reason, "seconds": round(self.seconds, 1), "numbers": self.numbers}
