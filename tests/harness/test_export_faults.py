"""Faults during scripts/export_hf.py: a kill -9 in the middle of an ``overwrite=true`` export
leaves the previous export folder whole (byte for byte) and a ``.OUT.<pid>-<id>.tmp`` folder
beside it, which the next export to that ``out`` removes (its owner is gone)."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import lightning
import pytest
import torch
import yaml

pytest.importorskip("transformers")

from pelab.lit import LitGPT  # noqa: E402
from tests.cli import kill_at_marker  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# the export script as a user runs it, stalled once the new folder's weights are written
KILL_CHILD = r"""
import sys, time
from pathlib import Path

sys.path.insert(0, "scripts")
import pelab.export

marker = Path(sys.argv[1])
real = pelab.export.save_tokenizer
def stalled(*args, **kwargs):  # the weights are in the temp folder: tell the parent, wait to be killed
    marker.touch()
    time.sleep(60)
    return real(*args, **kwargs)
pelab.export.save_tokenizer = stalled

import export_hf
export_hf.main(sys.argv[2:])
print("the export finished: the test did not kill it")
"""


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def write_checkpoint(folder: Path, seed: int) -> Path:
    """A train.py-like checkpoint of a tiny learned-PE model, its run config beside it."""
    torch.manual_seed(seed)
    lit = LitGPT(model=dict(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=16),
                 pe={"_target_": "model.pe.learned.LearnedPositionEmbedding"})
    folder.mkdir(parents=True)
    ckpt = folder / "last.ckpt"
    torch.save({"state_dict": lit.state_dict(), "hyper_parameters": dict(lit.hparams),
                "pytorch-lightning_version": lightning.__version__}, ckpt)
    (folder / "config.yaml").write_text(yaml.safe_dump({"data": {"tokenizer": "bytes"}}))
    return ckpt


def export(*args: str) -> int:
    """scripts/export_hf.py in this process (only the killed export needs a process of its own)."""
    from tests.scripts.test_export_hf import script

    return script().main(list(args))


def test_kill_during_an_overwrite_export_keeps_the_previous_folder_and_the_next_export_clears_the_temp(tmp_path):
    first, second = write_checkpoint(tmp_path / "a", seed=0), write_checkpoint(tmp_path / "b", seed=1)
    out, marker = tmp_path / "hf", tmp_path / "writing"
    assert export(f"ckpt={first}", f"out={out}") == 0
    previous = tree_bytes(out)
    assert "model.safetensors" in previous
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(marker), f"ckpt={second}", f"out={out}",
                              "overwrite=true"], cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_at_marker(child, marker, 240)
    assert child.returncode == -signal.SIGKILL
    # the previous export, whole; the killed one's weights in its temp folder, named by its pid
    assert tree_bytes(out) == previous
    leftovers = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.")]
    assert len(leftovers) == 1 and re.fullmatch(rf"\.hf\.{child.pid}-[0-9a-f]{{8}}\.tmp", leftovers[0].name), leftovers
    assert (leftovers[0] / "model.safetensors").is_file()
    # the next export to that out clears it and replaces the folder
    assert export(f"ckpt={second}", f"out={out}", "overwrite=true") == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "hf", "writing"]
    assert tree_bytes(out)["model.safetensors"] != previous["model.safetensors"]
