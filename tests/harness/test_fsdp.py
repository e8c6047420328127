"""FSDP on 2 gloo CPU processes, configured by Lightning's FSDPStrategy from conf/trainer/fsdp.yaml
(tests/harness/fsdp_worker.py): weight decay after wrapping, float32 position terms, one
optimizer step of every scheme; and validation shards that give every rank the same number of
batches, with the token-weighted loss of one process."""

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import Dataset

from model.pe import SCHEMES

ROOT = Path(__file__).resolve().parents[2]
WORLD = 2
SCHEME_CASES = sorted(SCHEMES)


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory) -> dict:
    """The worker's results (rank zero's) and its wall time; one run for the whole module."""
    tmp = tmp_path_factory.mktemp("fsdp")
    out, store = tmp / "results.json", tmp / "store"  # a file store: no port to collide on
    start = time.perf_counter()
    ranks = [subprocess.Popen([sys.executable, "tests/harness/fsdp_worker.py", str(rank), str(WORLD), str(store),
                               str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(WORLD)]
    logs = [rank.communicate(timeout=300)[0] for rank in ranks]
    for rank, log in zip(ranks, logs):
        assert rank.returncode == 0, log[-4000:]
    return json.loads(out.read_text()) | {"wall_s": time.perf_counter() - start}


def scheme_result(fsdp: dict, name: str) -> dict:
    result = fsdp[name]
    assert "error" not in result, result.get("traceback", "")
    return result


def test_the_preset_gathers_float32_and_reduces_in_float32(fsdp):
    assert fsdp["precision"] == "bf16-mixed"  # autocast's dtype
    mixed = fsdp["mixed_precision"]
    assert ("param_dtype=None, reduce_dtype=torch.float32, buffer_dtype=torch.float32" in mixed), mixed
    assert fsdp["wall_s"] < 60


@pytest.mark.parametrize("scheme", SCHEME_CASES)
def test_weight_decay_set_is_the_same_after_wrapping(fsdp, scheme):
    """Lightning wraps before configure_optimizers: parameters are then 1-D shard views, and
    only the names recorded on the bare model tell the matrices."""
    result = scheme_result(fsdp, scheme)
    assert result["root_unit"] == "CPUDeviceFSDP"
    assert result["decayed_after"] == result["decayed_before"]
    assert {"wte.weight", "blocks.0.attn.c_attn.weight", "blocks.1.mlp.c_proj.weight"} <= set(result["decayed_after"])


@pytest.mark.parametrize("scheme", SCHEME_CASES)
def test_position_terms_are_float32_and_the_unwrapped_schemes(fsdp, scheme):
    """Inside an FSDP forward under bf16 autocast: buffers float32, and every position term
    (embedding, rotation tables near and at 16k, bias) float32 and equal to the one an unwrapped
    copy of the scheme computes."""
    result = scheme_result(fsdp, scheme)
    assert set(result["buffers"].values()) <= {"float32"}, result["buffers"]
    assert result["terms"] or scheme in ("nope",)
    for term, (dtype, equal) in result["terms"].items():
        assert dtype == "float32" and equal, (term, dtype, equal)


@pytest.mark.parametrize("scheme", SCHEME_CASES)
def test_one_optimizer_step_of_every_scheme(fsdp, scheme):
    """Two steps with a large learning rate through LitGPT.optimizer_step: finite losses and
    parameters, constrained ones back in range (projecting the gathered values again changes
    nothing). KERPLE used to write its parameters inside forward, which FSDP's views forbid."""
    result = scheme_result(fsdp, scheme)
    assert all(torch.isfinite(torch.tensor(result["losses"]))) and len(result["losses"]) == 2
    assert result["finite"]
    if scheme.startswith("kerple"):
        assert result["in_range"]
        values = torch.tensor([v for values in result["pe_parameters"].values() for v in values])
        assert (values == torch.tensor(1e-2)).any()  # the step left the range, the projection brought it back


def test_validation_of_uneven_shards_under_fsdp_matches_one_process(fsdp):
    """5 windows in batches of 2 on 2 ranks: shares of 3 and 2 windows; the second rank's
    padding window evens the batch counts (otherwise FSDP's gathers stop matching)."""
    rope = scheme_result(fsdp, "rope")
    assert rope["val_loss"] == pytest.approx(rope["val_loss_one_process"], rel=1e-6)


class Numbered(Dataset):
    """Window i: inputs all i, targets i + 1 (a few of them ignored)."""

    def __init__(self, count: int, length: int = 8) -> None:
        self.count, self.length = count, length

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, i: int):
        y = torch.full((self.length,), (i + 1) % 64)
        y[: i % 3] = -1
        return torch.full((self.length,), i % 64), y


def rank_loaders(count: int, world: int, batch: int, dataset: Dataset | None = None) -> list:
    from data.datamodule import StreamDataModule

    data = StreamDataModule()
    data.val_set, data.val_batch_size, data.num_workers = dataset or Numbered(count), batch, 0
    loaders = []
    for rank in range(world):
        data.trainer = SimpleNamespace(global_rank=rank, world_size=world)
        loaders.append(list(data.val_dataloader()))
    return loaders


@pytest.mark.parametrize("count, world, batch", [(256, 6, 14), (22, 2, 4), (5, 2, 2), (9, 4, 2), (1, 3, 4),
                                                 (256, 8, 32), (100, 3, 7)])
def test_validation_shards_have_equal_batch_counts(count, world, batch):
    loaders = rank_loaders(count, world, batch)
    assert len({len(batches) for batches in loaders}) == 1, [len(batches) for batches in loaders]
    seen = []
    for rank, batches in enumerate(loaders):
        for x, y in batches:
            padding = (y < 0).all(dim=1)
            assert not padding.any() or len(y) == 1  # a padding window sits alone in its batch
            seen += x[~padding, 0].tolist()
        assert sum(len(x) for x, _ in batches) <= -(-count // world)  # at most one padding window
    assert sorted(seen) == sorted(i % 64 for i in range(count))  # every window once, on one rank


def test_padding_leaves_the_token_weighted_validation_loss_unchanged():
    """256 windows, 6 ranks, batches of 14 (ranks 4 and 5 get a padding batch): the loss summed
    over the ranks as torchmetrics reduces it equals one process's, and the ignored-only batch
    adds exactly nothing (no NaN for the metric to drop)."""
    from pelab.lit import LitGPT

    torch.manual_seed(0)
    module = LitGPT(model=dict(vocab_size=64, block_size=32, n_layer=1, n_head=2, n_embd=16),
                    pe={"_target_": "model.pe.rope.RoPE"})
    module.eval()

    def states(batches) -> tuple[float, float]:
        module.val_loss.reset()
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*nan.*")
            for i, batch in enumerate(batches):
                module.validation_step(batch, i)
        return float(module.val_loss.mean_value), float(module.val_loss.weight)

    dataset = Numbered(256, length=32)
    (one,) = [states(batches) for batches in rank_loaders(256, 1, 14, dataset)]
    shards = [states(batches) for batches in rank_loaders(256, 6, 14, dataset)]
    assert sum(w for _, w in shards) == one[1]  # the same scored targets
    assert sum(v for v, _ in shards) / sum(w for _, w in shards) == pytest.approx(one[0] / one[1], rel=1e-6)
