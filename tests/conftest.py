"""Shared test setup: 2 threads (1 per worker under pytest-xdist's 2 workers), an isolated
cache for tokenizer assets and token memmaps."""

import os
import tempfile
from pathlib import Path

# Under pytest-xdist (pyproject's addopts: 2 workers on CI's 2 cores) each worker, and every
# train.py it spawns (they inherit OMP_NUM_THREADS), runs one intra-op thread: two threads per
# worker would put 4 on 2 cores. A plain run (-p no:xdist, -n 0) keeps 2.
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
THREADS = 1 if WORKERS > 1 else 2
if WORKERS > 1:
    os.environ["OMP_NUM_THREADS"] = str(THREADS)
os.environ.setdefault("OMP_NUM_THREADS", str(THREADS))
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One cache per test session, shared with subprocesses (train.py) through the environment.
os.environ["PELAB_CACHE"] = os.environ.get("PELAB_TEST_CACHE") or tempfile.mkdtemp(prefix="pelab-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(THREADS)

ROOT = Path(__file__).resolve().parents[1]


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
