"""pyproject's version floors against the first release of each version-sensitive API the code
uses, as read in the upstream source of the releases (docs/gpu.md, Version floors). A lower
floor would let pip install a torch or Lightning on which pelab fails at its first step."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

# (package, API, first release that has it, a file of pelab that uses it, the text there)
FACTS = [
    ("torch", "torch._dynamo.config.recompile_limit", "2.7", "model/attention/flex.py", "recompile_limit"),
    ("torch", "torch.nn.utils.get_total_norm", "2.6", "pelab/callbacks.py", "torch.nn.utils.get_total_norm"),
    ("torch", "flex_attention backward into captured tensors that require grad", "2.6", "model/pe/t5.py",
     "self.relative_attention_bias.weight"),  # the learned table flex's score_mod captures
    ("lightning", "LightningModule.load_from_checkpoint(weights_only=)", "2.6", "pelab/checkpoint/load.py",
     "load_from_checkpoint(path, map_location=map_location, weights_only=True)"),
    ("lightning", "ModelCheckpoint(save_on_exception=)", "2.5.3", "conf/callbacks/default.yaml",
     "save_on_exception:"),
]


def version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.match(r"\d+(\.\d+)*", text).group(0).split("."))


def floors() -> dict[str, tuple[int, ...]]:
    """{package: floor} of pyproject's [project] dependencies that state one (``>=``)."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        tomllib = pytest.importorskip("tomli")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    found = {}
    for requirement in project["dependencies"]:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*(\[.*\])?\s*(.*)", requirement)
        floor = re.search(r">=\s*([0-9.]+)", m.group(3))
        if floor:
            found[m.group(1).lower()] = version(floor.group(1))
    return found


@pytest.mark.parametrize("package, api, first, path, text", FACTS, ids=[f[1] for f in FACTS])
def test_the_floor_is_at_least_the_first_release_of_each_api(package, api, first, path, text):
    assert text in (ROOT / path).read_text(), f"{path} no longer uses {api}: update FACTS and docs/gpu.md"
    assert floors()[package] >= version(first), f"pyproject lets {package} below {first}, which lacks {api}"


def test_the_floors_are_what_docs_gpu_md_records():
    """The evidence table and pyproject say the same floors."""
    doc = (ROOT / "docs" / "gpu.md").read_text()
    have = floors()
    for package in ("torch", "lightning"):
        stated = re.search(rf"`{package}>=([0-9.]+)`", doc)
        assert stated, f"docs/gpu.md states no {package} floor"
        assert version(stated.group(1)) == have[package]


def test_the_installed_versions_have_these_apis():
    """What the floors promise holds for the versions installed here (which pass the suite)."""
    import lightning
    import torch
    from lightning.pytorch import LightningModule

    assert floors()["torch"] <= version(torch.__version__)
    assert floors()["lightning"] <= version(lightning.__version__)
    assert callable(torch.nn.utils.get_total_norm)
    assert hasattr(torch._dynamo.config, "recompile_limit")
    assert "weights_only" in inspect.signature(LightningModule.load_from_checkpoint).parameters
