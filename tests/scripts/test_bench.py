"""scripts/bench.py's smoke run end to end and the fields of its JSON lines; numbers are never
asserted (docs/benchmark.md), its intervals are tested in tests/evaluation/test_stats.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]

FIELDS = {"config", "scheme", "path", "precision", "compile", "tokens_per_s", "ratio_vs_reference",
          "ratio_vs_learned", "peak_mem_mb", "mfu", "eval_s_16x", "eval_peak_mem_mb_16x", "compile_s", "step_ms",
          "ratio_vs_reference_ci95", "ratio_vs_learned_ci95", "ratio_vs_eager_ci95"}


def test_bench_smoke(tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    env = dict(os.environ, WANDB_MODE="offline")
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench.py"), "smoke=true", "eval_factor=1,2",
                           "warmup_parallel=2", f"out={out}"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    printed = [json.loads(line.removeprefix("BENCH_JSON ")) for line in proc.stdout.splitlines()
               if line.startswith("BENCH_JSON ")]
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert printed == written
    paths = {(r["path"], r["scheme"]) for r in written}
    assert paths == {("reference", "learned"), ("pelab-loop", "learned"), ("pelab", "learned"), ("pelab", "alibi")}
    for row in written:
        assert FIELDS <= row.keys(), FIELDS - row.keys()
        assert "byte" in row["config"] and "tiny" in row["config"]
        assert row["precision"] == "32" and row["compile"] is False  # the smoke run is float32
        loop = row["path"] == "pelab-loop"  # pelab's model in the reference loop: no memory or eval of its own
        for key in ("tokens_per_s", "mfu", "step_ms") + (() if loop else ("peak_mem_mb",)):
            assert isinstance(row[key], float), (key, row[key])
        assert isinstance(row["ratio_vs_reference"], float) or not loop
        pelab = row["path"] == "pelab"
        assert (row["ratio_vs_learned"] is not None) == pelab
        assert (row["ratio_vs_reference"] is None) == (pelab and row["scheme"] != "learned")
        assert (row["peak_mem_mb"] is None) == loop
        assert (row["eval_s_16x"] is not None) == pelab
        assert row["ratio_vs_eager"] is None  # eager only
        if pelab:  # two evaluation lengths: a memory curve, one sequence each
            assert [(c["length"], c["batch"]) for c in row["eval_curve"]] == [(256, 1), (512, 1)]
            assert row["eval_length"] == 512 and isinstance(row["eval_mem_exponent"], float)
    assert "| config |" in proc.stdout  # the table
    assert "[bench] performance targets: judged on CUDA rows only (none here)" in proc.stdout


def test_bench_rejects_unknown_options() -> None:
    proc = run_python([str(ROOT / "scripts" / "bench.py"), "nonsense=1"], cwd=ROOT, timeout=120)
    assert proc.returncode != 0 and "valid options" in proc.stderr


def _import_like_the_script() -> None:
    """scripts/ on sys.path, as `python scripts/bench.py` has it: bench.py, benchkit/."""
    if str(ROOT / "scripts") not in sys.path:
        sys.path.insert(0, str(ROOT / "scripts"))


def test_growth_exponent_reads_linear_and_quadratic_growth() -> None:
    _import_like_the_script()
    from benchkit.report import growth_exponent

    assert abs(growth_exponent([1024, 2048, 4096], [30.0, 60.0, 120.0]) - 1.0) < 1e-12
    assert abs(growth_exponent([1024, 2048, 4096], [10.0, 40.0, 160.0]) - 2.0) < 1e-12
    assert abs(growth_exponent([2, 8], [3.0, 6.0]) - 0.5) < 1e-12  # log 2 / log 4


def test_ratio_interval_is_the_median_interval_rounded() -> None:
    """The JSON's ``*_ci95``: evaluation.stats.median_ci's order statistics, rounded to 4 places."""
    _import_like_the_script()
    from benchkit.report import ratio_ci95

    values = [1 + v / 3 for v in range(10, 0, -1)]  # x_(2) = 1.66666..., x_(9) = 4
    assert ratio_ci95(values) == [1.6667, 4.0]
    assert ratio_ci95(values[:5]) is None


def test_scheme_lists_come_from_the_registry() -> None:
    _import_like_the_script()
    from bench import configs_of, schemes_of

    from model.pe import SCHEMES

    every = schemes_of("all")
    assert sorted(every) == sorted(SCHEMES) and every[0] == "learned"
    assert schemes_of("rope+learned") == schemes_of("learned,rope") == ["learned", "rope"]
    assert configs_of("byte-tiny:alibi+nope,gpt2-tiny") == [("byte-tiny", ["alibi", "nope"]), ("gpt2-tiny", every)]
    assert configs_of("byte-tiny:alibi", schemes="rope") == [("byte-tiny", ["rope"])]


def test_documents_schemes_must_be_benched_schemes_with_documents() -> None:
    _import_like_the_script()
    import pytest
    from bench import main

    with pytest.raises(SystemExit, match="documents_schemes= needs documents=mask or documents=both"):
        main(["configs=byte-tiny:learned+rope", "documents_schemes=rope"])
    with pytest.raises(SystemExit, match=r"documents_schemes: \['t5'\] not among the schemes of config byte-tiny"):
        main(["configs=byte-tiny:learned+rope", "documents=mask", "documents_schemes=rope,t5"])


def test_variants_are_model_options_checked_before_anything_runs() -> None:
    _import_like_the_script()
    import pytest
    from bench import main, variants_of
    from benchkit.paths import path_parts

    assert variants_of("sinks=learned,window_pattern=[8,null];sinks=zero") == [
        "sinks=learned", "window_pattern=[8,null];sinks=zero"]
    assert path_parts("rope@window_pattern=[8,null];sinks=zero") == (
        "rope", None, {"window_pattern": [8, None], "sinks": "zero"})
    assert path_parts("t5+mask") == ("t5", "mask", {})
    with pytest.raises(SystemExit, match="'foo=1' is not KEY=VALUE;KEY=VALUE with model options"):
        main(["configs=byte-tiny:rope", "variants=foo=1"])
    with pytest.raises(SystemExit, match="model.sinks must be one of"):
        main(["configs=byte-tiny:rope", "variants=sinks=bogus"])
    with pytest.raises(SystemExit, match="variant_schemes= needs variants="):
        main(["configs=byte-tiny:rope", "variant_schemes=rope"])


def test_targets_judge_variants_and_the_schemes_with_their_own_limit() -> None:
    """The report's GPU targets from rows: sinks within 1.05x the same scheme, a window no slower
    than full attention, PoPE within 1.3x rope (issue 35), a bias scheme within 1.10x; CPU rows
    judge nothing."""
    _import_like_the_script()
    from benchkit.report import targets

    def row(scheme, step, path="pelab", device="cuda", **extra):
        return {"config": "gpt2-gpt2", "precision": "bf16-mixed", "compile": True, "block_size": 1024,
                "device": device, "scheme": scheme, "path": path, "step_ms": step, "mfu": 0.3} | extra

    rows = [row("rope", 40.0), row("pope", 50.0), row("t5", 48.0),
            row("rope", 41.6, "pelab-variant", variant="sinks=learned", options={"sinks": "learned"},
                step_ratio_vs_same_scheme=1.04),
            row("rope", 44.0, "pelab-variant", variant="window=128", options={"window": 128},
                step_ratio_vs_same_scheme=1.1)]
    judged = {t["target"].split(" (")[0]: t["status"] for t in targets(rows)}
    assert judged == {"pope step <= 1.30x rope's": "PASS", "t5 step <= 1.10x rope's": "FAIL",
                      "rope with sinks=learned <= 1.05x without": "PASS",
                      "rope with window=128 <= full attention's step": "FAIL"}
    assert targets([{**r, "device": "cpu"} for r in rows]) == []


def test_attention_bench_smoke(tmp_path: Path) -> None:
    """scripts/bench_attention.py's smoke run: pelab's attention alone on the CPU route, each case
    timed (numbers not asserted), the ratios with their per-round range, the JSON written."""
    _import_like_the_script()
    from bench_attention import main

    out = tmp_path / "attention.json"
    assert main(["smoke=true", f"out={out}"]) == 0
    found = json.loads(out.read_text())
    shape = found["shapes"]["B=1 T=256 W=32"]
    assert found["problems"] == [] and set(shape["ms"]) == {"causal", "window", "sinks"}
    assert all(ms > 0 for ms in shape["ms"].values())
    for ratio in shape["ratios"].values():
        assert ratio["range"][0] <= ratio["median"] <= ratio["range"][1]
