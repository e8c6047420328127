"""Only global rank zero checks the corpus files at start (issue 50, item 3): on 2 gloo processes
with pelab's TextFilesDataModule, rank 0 stats the corpus (its cheap fingerprint) once, rank 1
not at all: it opens the cache from the meta.json rank 0 found valid. Both train on the same
tokens. A rank whose cache folder is its own (node-local disks) checks and builds it itself; a
check that fails on rank 0 is one line on rank 1, not a hang. The four starts share one launch
of the two processes (tests/harness/rank_check_worker.py runs them in turn)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]


def corpus(folder: Path, files: int = 12) -> Path:
    folder.mkdir()
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    for i in range(files):
        (folder / f"doc{i:02d}.txt").write_text(" ".join(rng.choice(words, 400)) + "\n")
    return folder


@pytest.fixture(scope="module")
def starts(tmp_path_factory) -> dict:
    """One launch of the worker (2 gloo processes) running four starts in turn: a first start on a
    shared cache folder (rank 0 builds), a second on it (rank 0 checks), node-local cache folders,
    and a check that fails on rank 0 (last: it ends the job). {start: (rank 0's, rank 1's record)},
    and the job's output."""
    tmp = tmp_path_factory.mktemp("rank_zero")
    text, out = corpus(tmp / "corpus"), tmp / "out"
    proc = subprocess.run([sys.executable, "tests/harness/rank_check_worker.py", str(text), str(tmp / "cache"),
                           str(out), "shared,shared,local,fail"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=600)
    records = {}
    for start, folder in (("built", "shared"), ("checked", "shared.2"), ("local", "local"), ("fail", "fail")):
        records[start] = tuple(json.loads((out / folder / f"rank{r}.json").read_text())
                               if (out / folder / f"rank{r}.json").is_file() else {} for r in (0, 1))
    records["job"] = proc
    return records


def ran(starts: dict, start: str) -> tuple[dict, dict]:
    zero, one = starts[start]
    assert zero and one and "error" not in zero and "error" not in one, (start, zero, one, starts["job"].stderr[-4000:])
    return zero, one


def test_rank_zero_checks_the_corpus_and_rank_one_reads_its_verdict(starts):
    """First start: rank 0 builds the cache; second start on it: rank 0 checks it once (its
    prepare_data's check serves its setup too: each used to check), rank 1 never."""
    for start in ("built", "checked"):
        zero, one = ran(starts, start)
        assert one["file_stats"] == 0 and one["corpus_stats"] == 0, start  # rank 1 touched no corpus file
        assert zero["file_stats"] >= 1 and zero["corpus_stats"] >= 12, start  # a stat of each of the 12 files
        assert zero["step"] == one["step"] == 2
        assert zero["train_tokens"] == one["train_tokens"] > 0
        assert zero["sample0"] == one["sample0"] and zero["val0"] == one["val0"]  # the same cache, the same tokens
    assert zero["file_stats"] == 1 and zero["corpus_stats"] == 12 * 2  # file_stats: size and mtime, a stat each


def test_a_rank_with_its_own_cache_folder_checks_and_builds_it(starts):
    """data_dir on node-local disks: rank 1's meta.json is not rank 0's (it has none yet), so it
    checks the corpus and builds its own cache; the tokens are the same."""
    zero, one = ran(starts, "local")
    assert zero["file_stats"] >= 1 and one["file_stats"] >= 1 and one["corpus_stats"] >= 12
    assert zero["data_dir"] != one["data_dir"] and (Path(one["data_dir"])).is_dir()
    assert zero["sample0"] == one["sample0"] and zero["val0"] == one["val0"]


def test_a_check_that_fails_on_rank_zero_is_one_line_on_rank_one(starts):
    zero, one = starts["fail"]
    assert starts["job"].returncode != 0
    assert zero["error"] == "OSError: the corpus folder went away", zero
    assert one["error"].startswith("RuntimeError: global rank 0 could not prepare the token cache ")
    assert one["error"].endswith(": OSError: the corpus folder went away") and "\n" not in one["error"]
