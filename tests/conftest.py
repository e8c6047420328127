"""Shared test setup: 2 threads, an isolated cache for tokenizer assets and token memmaps."""

import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
# One cache per test session, shared with subprocesses (train.py) through the environment.
os.environ["PELAB_CACHE"] = os.environ.get("PELAB_TEST_CACHE") or tempfile.mkdtemp(prefix="pelab-test-cache-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(2)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def project_root() -> Path:
    return ROOT


@pytest.fixture(scope="session")
def cache_root() -> Path:
    return Path(os.environ["PELAB_CACHE"])
