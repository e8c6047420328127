"""The probes, by the name of their ``eval.<name>`` options, in the order they run.

Adding a probe: its file (score → rows → plot, its ``Comparison`` hooks, ending with a
``PROBE``), one line below, its block in conf/eval/default.yaml, and its tests. The harness
(pelab/evaluate.py) runs every enabled one, when training ends and from scripts/evaluate.py;
scripts/compare_runs.py compares every table a probe lists in ``Probe.compare``.
"""

from __future__ import annotations

from typing import Any

from evaluation import attention_probe, extrapolation, streaming, tasks
from evaluation.probe import Probe

PROBES: dict[str, Probe] = {probe.name: probe for probe in (
    extrapolation.PROBE,
    tasks.PROBE,
    attention_probe.PROBE,
    streaming.PROBE,
)}


def enabled_probes(options: dict[str, Any], held_out_text: bool) -> dict[str, dict]:
    """{name: its options without ``enabled``} of the probes that run: the one rule, used when
    the config is checked and when the probes run (``Probe.runs``). ``options``: the ``eval``
    section (or just its probe blocks); a probe without a block keeps its own default."""
    chosen = {}
    for name, probe in PROBES.items():
        block = dict(options.get(name) or {})
        default = "auto" if "auto" in probe.switch else False
        if probe.runs(block.pop("enabled", default), held_out_text):
            chosen[name] = block
    return chosen
