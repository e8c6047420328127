"""Shared test setup: 2 threads (1 per worker under pytest-xdist's 2 workers), an isolated
cache for tokenizer assets and token memmaps."""

import os
import tempfile
from pathlib import Path

# Under pytest-xdist (README's command: -n auto, 2 workers on CI's 2 cores) each worker, and every
# train.py it spawns (they inherit OMP_NUM_THREADS), runs one intra-op thread: two threads per
# worker would put 4 on 2 cores. A plain run (-p no:xdist, -n 0) keeps 2.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = 1 if WORKERS > 1 else 2
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One cache per test session (per xdist worker: no two processes prepare into one), shared with
# subprocesses (train.py) through the environment.
os.environ["PELAB_CACHE"] = os.environ.get("PELAB_TEST_CACHE") or tempfile.mkdtemp(prefix="pelab-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)

ROOT = Path(__file__).resolve().parents[1]

# Seconds each module of 8 s or more took in the README's command (2 xdist workers on this idle 2-core
# machine, 2026-11-29, --durations=0; four modules scaled after that day's cuts); only the order below
# depends on them: a stale figure costs balance, never a test.
HEAVY = {"tests/harness/test_fsdp_train.py": 80, "tests/harness/test_train.py": 78,
         "tests/model/test_compile.py": 68, "tests/model/test_compile_flex.py": 55,
         "tests/attention/test_document_mask.py": 50, "tests/gpu/test_gpu_check.py": 47,
         "tests/harness/test_config_errors.py": 31, "tests/attention/test_backends.py": 30,
         "tests/attention/test_windows.py": 23, "tests/harness/test_distributed.py": 22,
         "tests/scripts/test_bench.py": 22, "tests/harness/test_faults.py": 22,
         "tests/harness/test_rank_zero_check.py": 20, "tests/harness/test_host_syncs.py": 20,
         "tests/evaluation/test_compare_runs.py": 18, "tests/harness/test_init_from.py": 17,
         "tests/scripts/test_bench_rows.py": 16, "tests/data/test_tokenizers.py": 16,
         "tests/harness/test_launchers.py": 15, "tests/harness/test_fsdp.py": 15,
         "tests/scripts/test_export_remote.py": 15, "tests/harness/test_preemption.py": 14,
         "tests/harness/test_init_from_hf.py": 14, "tests/harness/test_checkpoint_compat.py": 13,
         "tests/attention/test_triton_bias.py": 13, "tests/harness/test_export_faults.py": 12,
         "tests/harness/test_host_memory.py": 12, "tests/scripts/test_export_hf.py": 12,
         "tests/evaluation/test_tasks.py": 11, "tests/harness/test_script_errors.py": 11,
         "tests/harness/test_lit.py": 11, "tests/harness/test_multinode.py": 10, "tests/data/test_cache.py": 9,
         "tests/attention/test_sinks.py": 9, "tests/scripts/test_gpu_check_stop.py": 9,
         "tests/attention/test_same_model.py": 9, "tests/harness/test_tokenizer_identity.py": 8,
         "tests/model/test_generate.py": 8}


def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist's worksteal (README's command), an order that lets the workers finish
    together. worksteal hands worker i the i-th contiguous share of the collection (by count)
    and an idle worker steals the tail half of the busiest one's queue. So each share here is
    a set of whole heavy modules (end-to-end runs in subprocesses, compiles: 10-40 s a test;
    whole, so a module-scoped fixture is built once), spread over the shares by their seconds
    (longest first), heaviest first, then light tests (~0.1 s) to the share's count: the tails
    anyone steals from, and the last tests of the run, are short ones. Collection order
    (module by module) stays for a plain run and within every module."""
    workers = WORKERS
    if workers < 2:
        return
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    heavy = sorted((m for m in modules if m in HEAVY), key=lambda m: -HEAVY[m])
    light = [item for m, its in modules.items() if m not in HEAVY for item in its]
    shares = [[] for _ in range(workers)]
    load = [0.0] * workers
    for m in heavy:
        i = min(range(workers), key=lambda w: load[w])
        shares[i].extend(modules[m])
        load[i] += HEAVY[m]
    # the counts worksteal hands out: share i gets len(pending) // (workers - i) of what is left
    counts, left = [], len(items)
    for i in range(workers):
        counts.append(left // (workers - i))
        left -= counts[-1]
    # light tests to each share's count, the least loaded share (at ~0.1 s a test) first
    fill = [max(0, c - len(sh)) for c, sh in zip(counts, shares)]
    if sum(fill) != len(light):  # a share holds more heavy tests than its count: keep pytest's order
        return
    pos = 0
    for i in range(workers):
        shares[i].extend(light[pos:pos + fill[i]])
        pos += fill[i]
    items[:] = [item for share in shares for item in share]


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def cache_root() -> Path:
    return Path(os.environ["PELAB_CACHE"])


@pytest.fixture(scope="session", autouse=True)
def _threads():
    """The session's thread count once more after collection: a few modules set 2 on import."""
    torch.set_num_threads(THREADS)
