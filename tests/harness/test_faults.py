"""Faults: NaN/inf during training, a kill during a checkpoint save, a full disk during one, bad
checkpoint files (a block corrupted in place among them), a resume under another position scheme,
two runs in one run dir."""

import errno
import os
import shutil
import socket
import struct
import signal
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from hydra import compose, initialize_config_dir
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from pelab.callbacks import NonFiniteError, NonFiniteGuard
from omegaconf import OmegaConf

from pelab.checkpoint import (AtomicCheckpointIO, CheckpointError, check_resume, load_lit_gpt, read_checkpoint,
                              resume_from_run_dir)
from pelab.lit import LitGPT
from tests.cli import kill_at_marker, run_python
from tests.disk import FullDisk

ROOT = Path(__file__).resolve().parents[2]
TINY = dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16)
ROPE = {"_target_": "model.pe.rope.RoPE"}
# train.py as cheap as it goes: the model of the checkpoints below, no evaluation, no attention maps
FAST = ["model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16", "data.batch_size=2",
        "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
        "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "optim.warmup_steps=1",
        "logger=csv", "eval.extrapolation.enabled=false", "~callbacks.attention_maps"]


def compose_config(overrides):
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return compose("config", overrides=overrides)


def run_script(args, timeout=120):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    return run_python(args, cwd=ROOT, env=env, timeout=timeout)


class Poison(L.Callback):
    """Test-only: makes the loss, the gradients or a weight NaN at global ``steps`` (on ``rank``).

    ``loss``: NaN added to the loss, gradients stay finite; ``gradients``: one gradient entry;
    ``weights``: one weight, so loss and gradients both go NaN. ``snapshot`` keeps the bytes of
    ``watch`` (a checkpoint) as they were when the poison struck.
    """

    def __init__(self, what: str = "loss", steps=(3,), rank=None, watch=None) -> None:
        self.what, self.steps, self.rank, self.watch = what, set(steps), rank, watch
        self.snapshot: bytes | None = None

    def _now(self, trainer) -> bool:
        return trainer.global_step in self.steps and self.rank in (None, trainer.global_rank)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if not self._now(trainer):
            return
        if self.watch is not None and Path(self.watch).exists():
            self.snapshot = Path(self.watch).read_bytes()
        gpt = pl_module.model
        if self.what == "weights":
            with torch.no_grad():
                gpt.lm_head.weight.view(-1)[0] = float("nan")
        elif self.what == "loss":
            forward = gpt.forward

            def nan_loss(*args, **kwargs):
                logits, loss = forward(*args, **kwargs)
                return logits, loss + float("nan")  # d(loss + c)/d(loss) = 1: the gradients stay finite

            gpt.forward = nan_loss

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        vars(pl_module.model).pop("forward", None)  # the loss poison lasts one step
        if self.what == "gradients" and self._now(trainer):
            pl_module.model.lm_head.weight.grad.view(-1)[0] = float("nan")


class Snapshot(L.Callback):
    """Test-only: the parameters and AdamW moments before and after each optimizer step."""

    def __init__(self) -> None:
        self.before: dict[int, list[torch.Tensor]] = {}
        self.after: dict[int, list[torch.Tensor]] = {}

    def _state(self, trainer, pl_module) -> list[torch.Tensor]:
        opt = trainer.optimizers[0]
        moments = [s["exp_avg"] for s in opt.state.values() if "exp_avg" in s]
        return [t.detach().clone() for t in [*pl_module.parameters(), *moments]]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.before[trainer.global_step] = self._state(trainer, pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.after[trainer.global_step - 1] = self._state(trainer, pl_module)


def tiny_fit(tmp_path, callbacks, max_steps=6, max_skipped_steps=0, **trainer_kw):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (64, 17))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=TINY, pe=ROPE, optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1})
    guard = NonFiniteGuard(max_skipped_steps=max_skipped_steps)
    # last.ckpt after every step, through Lightning's own CheckpointIO: the guard alone must keep it good
    ckpt = ModelCheckpoint(dirpath=tmp_path, save_last=True, save_top_k=0, every_n_train_steps=1)
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", precision="bf16-mixed", logger=False,
                        callbacks=[*callbacks, guard, ckpt], enable_progress_bar=False,
                        enable_model_summary=False, gradient_clip_val=1.0, limit_val_batches=0,
                        default_root_dir=tmp_path, **trainer_kw)
    trainer.fit(module, train_dataloaders=loader)
    return trainer, module, guard


def assert_finite_checkpoint(path: Path, step: int) -> None:
    ckpt = read_checkpoint(path)  # weights_only=True
    assert ckpt["global_step"] == step
    assert all(t.isfinite().all() for t in ckpt["state_dict"].values() if t.is_floating_point())
    module = load_lit_gpt(path)
    assert all(p.isfinite().all() for p in module.parameters())


# ---------------------------------------------------------------------------- NaN / inf


@pytest.mark.parametrize("what,named", [("loss", "loss"), ("gradients", "gradients"),
                                        ("weights", "loss and gradients")])
def test_non_finite_step_stops_naming_the_step_and_keeps_last_ckpt(tmp_path, what, named):
    poison = Poison(what, steps=[3], watch=tmp_path / "last.ckpt")
    with pytest.raises(NonFiniteError, match=f"non-finite {named} at global step 3 ") as err:
        tiny_fit(tmp_path, [poison])
    assert "max_skipped_steps=0" in str(err.value) and str(tmp_path / "last.ckpt") in str(err.value)
    # nothing was written after the failure: last.ckpt is byte for byte the one from step 3
    assert poison.snapshot is not None and (tmp_path / "last.ckpt").read_bytes() == poison.snapshot
    assert sorted(p.name for p in tmp_path.glob("*.ckpt")) == ["last.ckpt"]
    assert_finite_checkpoint(tmp_path / "last.ckpt", step=3)


def test_skipped_step_makes_no_update_and_training_finishes(tmp_path):
    snap = Snapshot()
    trainer, module, guard = tiny_fit(tmp_path, [Poison("loss", steps=[2]), snap], max_skipped_steps=1)
    assert trainer.global_step == 6 and guard.skipped_steps == 1
    assert trainer.callback_metrics["train/skipped_steps"] == 1  # logged
    for before, after in zip(snap.before[2], snap.after[2]):  # step 2: weights and AdamW moments untouched
        torch.testing.assert_close(before, after, rtol=0, atol=0)
    assert any(not torch.equal(b, a) for b, a in zip(snap.before[3], snap.after[3]))  # step 3 trains again
    assert all(p.isfinite().all() for p in module.parameters())
    assert_finite_checkpoint(tmp_path / "last.ckpt", step=6)
    assert read_checkpoint(tmp_path / "last.ckpt")["callbacks"]["NonFiniteGuard"] == {"skipped_steps": 1}


def test_skip_budget_is_spent_then_training_stops(tmp_path):
    with pytest.raises(NonFiniteError, match=r"non-finite gradients at global step 4 .*Skipped so far: 1 "):
        tiny_fit(tmp_path, [Poison("gradients", steps=[1, 4])], max_skipped_steps=1)
    assert_finite_checkpoint(tmp_path / "last.ckpt", step=4)


def test_guard_rejects_a_bad_budget():
    with pytest.raises(ValueError, match=r"max_skipped_steps must be an integer >= 0 .*got -1"):
        NonFiniteGuard(max_skipped_steps=-1)


def test_ddp_ranks_stop_together_when_one_rank_has_a_nan_loss(tmp_path):
    """Rank 1 alone sees a NaN loss (its gradients, and so the all-reduced ones, stay finite): both
    ranks must stop at the same step with the same message, not hang or train on apart."""
    proc = run_script(["train.py", f"hydra.run.dir={tmp_path}", "trainer.accelerator=cpu", "trainer.devices=2",
                       "trainer.strategy=ddp", "+callbacks.poison._target_=tests.harness.test_faults.Poison",
                       "+callbacks.poison.what=loss", "+callbacks.poison.steps=[3]", "+callbacks.poison.rank=1",
                       *FAST], timeout=300)
    assert proc.returncode != 0
    assert proc.stderr.count("NonFiniteError: non-finite loss at global step 3 ") == 2, proc.stderr[-3000:]
    assert_finite_checkpoint(tmp_path / "checkpoints" / "last.ckpt", step=2)  # the last validation's


# ---------------------------------------------------------------------------- kill during a save

KILL_CHILD = r"""
import io, os, shutil, sys, time
from pathlib import Path

import hydra, torch
from hydra import compose, initialize_config_dir

from pelab.lit import LitGPT

out, marker = Path(sys.argv[1]), Path(sys.argv[2])
with initialize_config_dir(os.path.abspath("conf"), version_base="1.3"):
    cfg = compose("config", overrides=[f"trainer.default_root_dir={out}"])
# the Trainer exactly as conf/trainer/default.yaml builds it, CheckpointIO included
trainer = hydra.utils.instantiate(cfg.trainer, logger=False, callbacks=[], enable_checkpointing=False)
module = LitGPT(model=dict(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=16), pe=cfg.pe)
trainer.strategy.connect(module)
trainer.save_checkpoint(out / "last.ckpt")
shutil.copy(out / "last.ckpt", out / "good.ckpt")
with torch.no_grad():
    for p in module.parameters():
        p.fill_(7.0)

def stall():  # some bytes are on disk: tell the parent, then wait to be killed
    marker.touch()
    time.sleep(60)

class SlowFile:
    def __init__(self, f):
        self.f = f
    def write(self, data):
        n = self.f.write(data)
        self.f.flush()
        stall()
        return n
    def flush(self):
        self.f.flush()

real_save, real_sendfile = torch.save, os.sendfile
def save(obj, f, *args, **kwargs):  # a save streaming into a file on disk (not into memory)
    return real_save(obj, f if isinstance(f, (io.BytesIO, str, os.PathLike)) else SlowFile(f), *args, **kwargs)
def sendfile(out_fd, in_fd, offset, count):  # shutil's copy of a file into place
    n = real_sendfile(out_fd, in_fd, offset, min(count, 4096))
    stall()
    return n
torch.save, os.sendfile = save, sendfile
trainer.save_checkpoint(out / "last.ckpt")
print("the second save finished: the test did not kill it")
"""


def test_kill_during_save_keeps_the_previous_last_ckpt(tmp_path):
    out, marker = tmp_path / "checkpoints", tmp_path / "writing"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Lightning's own save stages the file in TMPDIR; on another filesystem (tmpfs) it is then copied
    # into the final name. Put TMPDIR there when this machine has one, as many clusters do.
    shm = Path("/dev/shm")
    other_fs = shm.is_dir() and os.access(shm, os.W_OK) and shm.stat().st_dev != tmp_path.stat().st_dev
    tmpdir = tempfile.mkdtemp(dir=shm) if other_fs else None
    if tmpdir:
        env["TMPDIR"] = tmpdir
    child = subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(out), str(marker)], cwd=ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        kill_at_marker(child, marker, 90)
    finally:
        if tmpdir:
            subprocess.run(["rm", "-rf", tmpdir], check=False)
    assert child.returncode == -signal.SIGKILL
    # the final name holds the previous checkpoint, whole; the interrupted bytes are in a hidden temp file
    assert (out / "last.ckpt").read_bytes() == (out / "good.ckpt").read_bytes()
    module = load_lit_gpt(out / "last.ckpt")
    assert not any((p == 7.0).all() for p in module.parameters())
    leftovers = list(out.glob(".last.ckpt.*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0
    # the next save of that name clears what the killed one left
    AtomicCheckpointIO().save_checkpoint(read_checkpoint(out / "good.ckpt"), out / "last.ckpt")
    assert not list(out.glob(".last.ckpt.*.tmp")) and read_checkpoint(out / "last.ckpt")


def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_file(tmp_path, rope_ckpt, monkeypatch):
    """torch's own error is two chained tracebacks (No space left on device, then enforce fail at
    inline_container.cc); the run shows one line naming the directory and its free space."""
    path, io = tmp_path / "last.ckpt", AtomicCheckpointIO()
    ckpt = read_checkpoint(rope_ckpt)
    io.save_checkpoint(ckpt, path)
    good = path.read_bytes()
    real = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *args, **kwargs: FullDisk(real(*args, **kwargs), room=4096))
    with pytest.raises(CheckpointError) as err:
        io.save_checkpoint(ckpt, path)
    free = shutil.disk_usage(tmp_path).free / 2**30
    message = str(err.value)
    assert message.startswith(f"no space left on the device of {tmp_path} while saving last.ckpt (") and "\n" not in message
    assert float(message.split("(")[1].split(" GiB free")[0]) == pytest.approx(free, abs=0.05)
    assert err.value.__suppress_context__  # no chained tracebacks
    assert path.read_bytes() == good and list(tmp_path.iterdir()) == [path]  # the temp file is gone


def test_checkpoint_io_keeps_the_old_file_rather_than_write_nan_weights(tmp_path):
    path = tmp_path / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"state_dict": {"w": torch.ones(3)}}, path)
    good = path.read_bytes()
    with pytest.raises(CheckpointError, match=rf"refusing to write {path}: 1 weight tensor\(s\) are not finite"):
        io.save_checkpoint({"state_dict": {"w": torch.tensor([1.0, float("nan"), 1.0])}}, path)
    assert path.read_bytes() == good and list(tmp_path.iterdir()) == [path]


def test_every_trainer_preset_writes_through_the_atomic_io():
    for preset in ("default", "gpu", "ddp"):
        plugins = compose_config([f"trainer={preset}"]).trainer.plugins
        assert [p._target_ for p in plugins] == ["pelab.checkpoint.AtomicCheckpointIO"], preset


# ---------------------------------------------------------------------------- bad checkpoint files


@pytest.fixture(scope="module")
def rope_ckpt(tmp_path_factory) -> Path:
    """A checkpoint of the model FAST builds (vocab 256: the bytes tokenizer), written as train.py does."""
    cfg = compose_config([o for o in FAST if o.startswith("model.")])
    path = tmp_path_factory.mktemp("rope") / "last.ckpt"
    module = LitGPT(model={**cfg.model, "vocab_size": 256}, pe=cfg.pe, optim=cfg.optim)
    trainer = L.Trainer(max_steps=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                        plugins=[AtomicCheckpointIO()], default_root_dir=path.parent)
    trainer.strategy.connect(module)
    trainer.save_checkpoint(path)
    return path


def _text(path, good):
    path.write_text("model: tiny\npe: rope\n")


def _random(path, good):
    path.write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0),
                                   dtype=torch.uint8).numpy().tobytes())


def _empty(path, good):
    path.write_bytes(b"")


def _half(path, good):
    data = good.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def _tensors(path, good):
    torch.save({"weight": torch.ones(2)}, path)


def _other_module(path, good):
    torch.save({"state_dict": {"layer.weight": torch.ones(2)}, "hyper_parameters": {"lr": 0.1}}, path)


def _pickled_object(path, good):
    import argparse

    torch.save({"state_dict": {}, "hyper_parameters": argparse.Namespace(lr=0.1)}, path)


BAD_FILES = [
    (_text, "is not a PyTorch checkpoint: it starts with b'model: tiny"),
    (_random, "is not a PyTorch checkpoint"),
    (_empty, "is empty (0 bytes)"),
    (_half, "is truncated or corrupt"),
    (_tensors, "is a torch file but not a Lightning checkpoint (no 'state_dict'; it holds keys ['weight'])"),
    (_other_module, "is a Lightning checkpoint but not one of pelab's LitGPT"),
    (_pickled_object, "holds a Python object of type argparse.Namespace, which is not loaded"),
]


@pytest.mark.parametrize("make,message", BAD_FILES, ids=[m.__name__.strip("_") for m, _ in BAD_FILES])
def test_bad_checkpoint_file_is_named_with_what_is_wrong(tmp_path, rope_ckpt, make, message):
    path = tmp_path / "bad.ckpt"
    make(path, rope_ckpt)
    with pytest.raises(CheckpointError) as err:
        read_checkpoint(path, key="ckpt")
    assert str(err.value).startswith(f"ckpt={path} ") and message in str(err.value), str(err.value)
    with pytest.raises(CheckpointError, match="ckpt="):
        load_lit_gpt(path)


def test_train_refuses_a_truncated_checkpoint_before_any_work(tmp_path, rope_ckpt):
    bad = tmp_path / "half.ckpt"
    _half(bad, rope_ckpt)
    proc = run_script(["train.py", f"ckpt_path={bad}", f"hydra.run.dir={tmp_path / 'run'}", *FAST])
    assert proc.returncode != 0 and f"ckpt_path={bad} is truncated or corrupt" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "run" / "checkpoints").exists()  # before data, model or Trainer


def test_scripts_refuse_a_foreign_file(tmp_path):
    """scripts/sample.py and scripts/eval_extrapolation.py share _common.checkpoint_arg."""
    bad = tmp_path / "notes.ckpt"
    _text(bad, None)
    proc = run_script(["scripts/sample.py", f"ckpt={bad}"])
    assert proc.returncode != 0 and f"ckpt={bad} is not a PyTorch checkpoint" in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr


# ---------------------------------------------------------------------------- resume under another config


def test_resume_under_another_scheme_fails_early_naming_both(tmp_path, rope_ckpt):
    proc = run_script(["train.py", "pe=alibi", f"ckpt_path={rope_ckpt}", f"hydra.run.dir={tmp_path}", *FAST])
    assert proc.returncode != 0
    assert (f"ckpt_path={rope_ckpt} was trained with pe=rope (model.pe.rope.RoPE), this run has pe=alibi "
            "(model.pe.alibi.ALiBi); resume with pe=rope or start a new run") in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("overrides,message", [
    (["pe.base=500"], "trained with pe.base=10000.0, this run has pe.base=500; resume with pe.base=10000.0 or"),
    (["model.n_layer=2", "model.block_size=32"],
     "trained with model.block_size=16, model.n_layer=1, this run has model.block_size=32, model.n_layer=2; "
     "resume with model.block_size=16 model.n_layer=1 or start a new run"),
    (["pe=xpos", "model.n_embd=32"],
     "trained with pe=rope (model.pe.rope.RoPE), model.n_embd=16, this run has pe=xpos (model.pe.xpos.XPos), "
     "model.n_embd=32; resume with pe=rope model.n_embd=16 or"),
])
def test_resume_names_each_differing_key(rope_ckpt, overrides, message):
    cfg = compose_config([*(o for o in FAST if o.startswith("model.")), *overrides, f"ckpt_path={rope_ckpt}"])
    with pytest.raises(CheckpointError, match="ckpt_path=") as err:
        check_resume(rope_ckpt, cfg)
    assert message in str(err.value), str(err.value)


def test_resume_with_the_checkpoint_config_passes(rope_ckpt):
    ckpt = check_resume(rope_ckpt, compose_config([*FAST, f"ckpt_path={rope_ckpt}"]))
    assert ckpt["hyper_parameters"]["pe"]["_target_"] == ROPE["_target_"]


def test_weights_only_checkpoint_cannot_be_resumed(tmp_path, rope_ckpt):
    ckpt = read_checkpoint(rope_ckpt)
    path = tmp_path / "weights.ckpt"
    torch.save({k: v for k, v in ckpt.items() if k not in ("optimizer_states", "lr_schedulers")}, path)
    with pytest.raises(CheckpointError, match="holds weights only .* not resumed"):
        check_resume(path, compose_config([*FAST, f"ckpt_path={path}"]))
    assert read_checkpoint(path)  # still fine to evaluate or sample


# ---------------------------------------------------------------------------- a block corrupted in place


def corrupt_a_block(path: Path) -> str:
    """Flip 64 bytes in the middle of the largest tensor record (the file keeps its size); the record's name."""
    with zipfile.ZipFile(path) as archive:
        record = max(archive.infolist(), key=lambda info: info.compress_size)
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(record.header_offset)
        header = f.read(30)
        name_length, extra_length = struct.unpack("<HH", header[26:30])
        f.seek(record.header_offset + 30 + name_length + extra_length + record.compress_size // 2)
        block = f.read(64)
        f.seek(-len(block), os.SEEK_CUR)
        f.write(bytes(b ^ 0xFF for b in block))
    assert path.stat().st_size == size
    return record.filename


def test_resume_auto_skips_a_corrupted_last_ckpt_for_the_newest_intact_step_ckpt(tmp_path, rope_ckpt, capsys):
    """torch checks no CRC: a damaged tensor record loads as garbage weights, and the cheap
    (memory-mapped) check passes it. resume=auto reads every record against its CRC-32."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    step, last = ckpts / "step000002.ckpt", ckpts / "last.ckpt"
    shutil.copy(rope_ckpt, step)
    shutil.copy(rope_ckpt, last)
    os.utime(step, ns=(last.stat().st_mtime_ns - 10**9,) * 2)  # the older one
    record = corrupt_a_block(last)
    assert read_checkpoint(last)  # the memory-mapped check alone cannot see it
    cfg = OmegaConf.create({"resume": "auto", "ckpt_path": None})
    assert resume_from_run_dir(cfg, tmp_path) and cfg.ckpt_path == str(step)
    out = capsys.readouterr().out
    assert f"[pelab] resume=auto: skipping {last}: is corrupt (" in out, out
    assert f"its record '{record}' fails its CRC-32 check" in out, out
    assert f"[pelab] resume=auto: continuing from {step} (the newer last.ckpt skipped: see above)" in out, out
    with pytest.raises(CheckpointError, match=f"ckpt_path={last} is corrupt .*'{record}' fails its CRC-32 check"):
        check_resume(last, compose_config([*FAST, f"ckpt_path={last}"]))  # given by name: refused
    corrupt_a_block(step)
    with pytest.raises(CheckpointError, match=f"every checkpoint of {tmp_path} is damaged .* refusing to start fresh"):
        resume_from_run_dir(OmegaConf.create({"resume": "auto", "ckpt_path": None}), tmp_path)


def test_scripts_refuse_a_checkpoint_with_a_corrupted_block(tmp_path, rope_ckpt):
    path = tmp_path / "last.ckpt"
    shutil.copy(rope_ckpt, path)
    record = corrupt_a_block(path)
    with pytest.raises(CheckpointError, match=f"ckpt={path} is corrupt .*'{record}' fails its CRC-32 check"):
        load_lit_gpt(path)


# ---------------------------------------------------------------------------- two runs in one run dir

HOLD = "import sys, time; from pelab.run import lock_run_dir; lock_run_dir(sys.argv[1]); print('held', flush=True); time.sleep(120)"


def test_a_second_run_in_a_run_dir_in_use_is_refused_naming_the_first(tmp_path):
    """Before: both ran, and one deleted the other's temp checkpoint as stale (FileNotFoundError
    on its rename). The first run's lock goes with its process: once it is gone the dir is free."""
    from pelab.config import ConfigError
    from pelab.run import RunIdentity, save_run

    run = tmp_path / "run"
    first = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    args = (OmegaConf.create({"seed": 0}), SimpleNamespace(is_global_zero=True), run, "abcd1234", [],
            RunIdentity(name="rope", group=None, tags=[]))
    try:
        assert first.stdout.readline().strip() == "held"
        with pytest.raises(ConfigError) as err:
            save_run(*args)
        assert (f"run dir {run.resolve()} is in use by another run (pid {first.pid} on host {socket.gethostname()}, "
                "since ") in str(err.value) and "another hydra.run.dir" in str(err.value), str(err.value)
        assert not (run / "checkpoints").exists() and not (run / "wandb_run_id.txt").exists()
    finally:
        first.kill()
        first.wait(timeout=30)
    save_run(*args)  # killed: its lock is released with it
    assert (run / "checkpoints" / "config.yaml").is_file()
