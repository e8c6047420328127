import math
import os
import subprocess
import sys
import time
from pathlib import Path

from evaluation.extrapolation import ExtrapolationRow, write_csv

ROOT = Path(__file__).resolve().parents[1]


def fake_run(sweep: Path, name: str, scheme: str, ppls: dict[int, float | None], sub: str = "") -> Path:
    rows = [
        ExtrapolationRow(scheme, "none", 64, n, "nonoverlapping", n, 1000, math.log(p), p, 0.5)
        if p is not None else
        ExtrapolationRow(scheme, "none", 64, n, "nonoverlapping", n, 0, math.nan, math.nan, 0.0,
                         f"not applicable: pe={scheme} has 64 positions")
        for n, p in ppls.items()
    ]
    return write_csv(rows, sweep / name / "extrapolation" / sub / "extrapolation.csv")


def test_compare_two_fake_runs(tmp_path):
    sweep = tmp_path / "multirun"
    fake_run(sweep, "0-learned", "learned", {64: 21.0, 128: None, 256: None})
    fake_run(sweep, "1-alibi", "alibi", {64: 20.5, 128: 19.75, 256: 19.5})
    # a later standalone evaluation of the alibi run, with a different token budget: it replaces
    # the whole alibi series instead of mixing points from both files
    time.sleep(0.01)
    later = fake_run(sweep, "1-alibi", "alibi", {64: 20.0, 128: 19.0}, sub="eval-last-20261121")
    os.utime(later, (time.time() + 5, time.time() + 5))

    out = tmp_path / "report"
    proc = subprocess.run([sys.executable, "scripts/compare_runs.py", str(sweep), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert (out / "comparison.md").read_text() == (
        "### nonoverlapping\n\nPerplexity by evaluation length (tokens).\n\n"
        "| scheme | 64 (train) | 128 | 256 |\n"
        "|---|---|---|---|\n"
        "| learned | 21.00 | n/a | n/a |\n"
        "| alibi | 20.00 | 19.00 |  |\n"
    )
    lines = (out / "comparison.csv").read_text().splitlines()
    assert lines[0].startswith("scheme,rope_scaling,train_length,eval_length,mode,stride,tokens,loss,ppl")
    assert len(lines) == 1 + 3 + 2
    assert (out / "comparison.png").stat().st_size > 1000


def test_compare_without_results_fails_clearly(tmp_path):
    proc = subprocess.run([sys.executable, "scripts/compare_runs.py", str(tmp_path)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "no extrapolation.csv found" in proc.stderr
