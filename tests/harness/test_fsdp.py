"""FSDP on 2 gloo CPU processes, configured by Lightning's FSDPStrategy from conf/trainer/fsdp.yaml
(tests/harness/fsdp_worker.py): weight decay after wrapping, float32 position terms, one
optimizer step of every scheme; validation shards that give every rank the same number of
batches, with the token-weighted loss of one process; sharded checkpoints (a Lightning fit under
the preset's strategy) that resume exactly, that resume=auto finds and one CPU process loads."""

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
    return json.loads(out.read_text()) | {"wall_s": time.perf_counter() - start, "dir": tmp}


def scheme_result(fsdp: dict, name: str) -> dict:
    result = fsdp[name]
    assert "error" not in result, result.get("traceback", "")
    return result


def test_the_preset_gathers_float32_and_reduces_in_float32(fsdp):
    assert fsdp["precision"] == "bf16-mixed"  # autocast's dtype
    mixed = fsdp["mixed_precision"]
    assert ("param_dtype=None, reduce_dtype=torch.float32, buffer_dtype=torch.float32" in mixed), mixed
    assert fsdp["wall_s"] < 90


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
    assert result["terms"] or scheme in ("nope",) or SCHEMES[scheme].terms is not None  # FoX: no position terms
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
    from pelab.datamodule import StreamDataModule

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


# ---------------------------------------------------------------------------- sharded checkpoints


def sharded(fsdp: dict) -> dict:
    result = fsdp["sharded"]
    assert "error" not in result, result.get("traceback", "")
    return result


def test_sharded_checkpoint_resumes_exactly(fsdp):
    """4 steps saving at 2 and 4, against a fresh model (another seed) resumed from step 2: the
    same batches (data position), learning rates (schedule), losses, and then every rank's
    parameter shards and AdamW moments and step counts bit for bit."""
    result = sharded(fsdp)
    assert result["state_dict_type"] == "sharded"
    assert result["saved"] == ["step2.ckpt/", "step4.ckpt/"]  # directories, no temp left
    whole, resumed = result["steps_whole"], result["steps_resumed"]
    assert sorted(resumed) == ["3", "4"] and {k: whole[k] for k in resumed} == resumed
    assert whole["3"][2] != whole["1"][2]  # the batches do move on with the step
    assert result["shards_equal"] and result["moments_equal"] and result["moments"] > 0


def test_resume_auto_finds_the_newest_complete_sharded_checkpoint(fsdp, tmp_path, capsys):
    import shutil

    from omegaconf import OmegaConf

    from pelab.checkpoint import checkpoints_newest_first, read_checkpoint, resume_from_run_dir

    sharded(fsdp)
    run = tmp_path / "run"
    shutil.copytree(fsdp["dir"] / "sharded", run / "checkpoints", ignore=shutil.ignore_patterns("resumed"))
    half = run / "checkpoints" / "step6.ckpt"  # the newest, but its save never finished (no .metadata)
    shutil.copytree(run / "checkpoints" / "step4.ckpt", half)
    (half / ".metadata").unlink()
    assert checkpoints_newest_first(run)[0] == run / "checkpoints" / "step4.ckpt"
    assert f"ignoring {half}: a half-written sharded checkpoint (no .metadata" in capsys.readouterr().out
    cfg = OmegaConf.create({"resume": "auto", "ckpt_path": None})
    assert resume_from_run_dir(cfg, run) and cfg.ckpt_path == str(run / "checkpoints" / "step4.ckpt")
    assert read_checkpoint(cfg.ckpt_path, for_resume=True, verify=True)["global_step"] == 4


def test_a_sharded_checkpoint_loads_on_one_cpu_process(fsdp, tmp_path):
    """scripts/*.py ckpt=DIR (load_lit_gpt) gathers the shards with no process group: the weights
    equal the ones FSDP gathered at the end of training; consolidate() writes them as one file."""
    from pelab.checkpoint import consolidate, load_lit_gpt

    sharded(fsdp)
    gathered = torch.load(fsdp["dir"] / "sharded" / "gathered.pt")
    for module in (load_lit_gpt(fsdp["dir"] / "sharded" / "step4.ckpt"),
                   load_lit_gpt(consolidate(fsdp["dir"] / "sharded" / "step4.ckpt", tmp_path / "step4.ckpt"))):
        params = dict(module.named_parameters())
        assert sorted(params) == sorted(gathered)
        for name, value in gathered.items():
            assert torch.equal(params[name], value), name


def test_a_full_disk_during_a_sharded_save_is_one_line_and_keeps_the_checkpoints(fsdp):
    """The shards' writer raises OSError(ENOSPC) on every rank after writing some bytes."""
    from pelab.checkpoint import read_checkpoint

    result = sharded(fsdp)
    message = result["full_disk"]
    assert message.startswith(f"CheckpointError: no space left on the device of {fsdp['dir'] / 'sharded'} while "
                              "saving step4.ckpt (") and " GiB free there now)" in message and "\n" not in message
    assert result["after_full_disk"] == ["resumed/", "step2.ckpt/", "step4.ckpt/"]  # the temp dir removed
    assert read_checkpoint(fsdp["dir"] / "sharded" / "step4.ckpt", for_resume=True)["global_step"] == 4


def test_state_dict_type_auto_shards_models_whose_full_state_is_costly():
    from pelab.checkpoint import FSDPStrategy, auto_state_dict_type

    assert auto_state_dict_type(124_000_000) == "full"  # gpt2: 1.4 GiB of weights and AdamW moments
    assert auto_state_dict_type(355_000_000) == "sharded"  # gpt2_medium: 4.0 GiB
    with pytest.raises(ValueError, match="trainer.strategy.state_dict_type must be auto, full or sharded, got 'shard'"):
        FSDPStrategy(state_dict_type="shard")


def test_a_sharded_checkpoint_resumes_under_fsdp_only(fsdp):
    """A directory passed where a run's strategy expects a file (DDP, one device) is refused in one
    line before any work, saying what would resume it; under trainer=fsdp it passes the checks."""
    from pelab.checkpoint import CheckpointError, check_resume
    from tests.harness.test_train import compose_config

    sharded(fsdp)
    path = fsdp["dir"] / "sharded" / "step4.ckpt"
    model = ["model.n_layer=2", "model.n_head=4", "model.n_embd=32", "model.block_size=32", f"ckpt_path={path}"]
    for trainer in ("default", "ddp"):
        with pytest.raises(CheckpointError, match=rf"ckpt_path={path} is a sharded checkpoint .* only trainer=fsdp "
                                                  r"resumes; this run's trainer.strategy is \w+\. Resume it with"):
            check_resume(path, compose_config([f"trainer={trainer}", *model]))
    assert check_resume(path, compose_config(["trainer=fsdp", *model]))["global_step"] == 4


def test_the_preset_strategy_still_refuses_a_cpu_trainer():
    """Lightning refuses FSDP on a CPU only for its own class (an exact type check): the subclass
    keeps the refusal, as one line when the Trainer is built (before any data is read)."""
    import lightning as L

    from pelab.checkpoint import FSDPStrategy

    with pytest.raises(ValueError, match="trainer.accelerator: trainer=fsdp .FSDP. needs GPUs, got CPUAccelerator"):
        L.Trainer(accelerator="cpu", devices=1, strategy=FSDPStrategy(), logger=False)
