"""Host synchronisations per training step: none outside the steps that log.

On a GPU a host read of a device value (``.item()``, ``bool()``, ``.tolist()``, a copy to the
CPU) waits for every kernel queued before it, and a Python number sent to the device waits for
its copy: the host stops queueing the next kernels. On CPU nothing waits, but the same calls
happen, so they are counted where they cannot be missed: a ``TorchDispatchMode`` sees every
operator (``aten._local_scalar_dense`` is what ``item``, ``bool``, ``float``, ``int`` and
formatting come down to; ``aten.lift_fresh`` is a tensor made from a Python value), and the
two reads that bypass the dispatcher on CPU (``Tensor.tolist``, ``Tensor.numpy``) are wrapped.

``SyncMeter`` counts them per training step (from one ``on_train_batch_start`` to the next:
the step, its logging, the next batch's transfer) through train.py with the default callbacks
and the progress bar, and writes them to ``out/rank{R}.json``.
"""

from __future__ import annotations

import json
import os
import traceback
from collections import Counter, defaultdict
from pathlib import Path

import lightning as L
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.cli import run_python

ROOT = Path(__file__).resolve().parents[2]
ATEN = torch.ops.aten
HOST_READS = {ATEN._local_scalar_dense.default, ATEN.is_nonzero.default, ATEN.equal.default, ATEN.item.default}
HOST_VALUES = {ATEN.lift_fresh.default, ATEN.lift_fresh_copy.default}  # torch.tensor(python value)


def where(depth: int = 8) -> str:
    """The innermost frames outside torch and this file: who asked, and who called it."""
    frames = [f for f in reversed(traceback.extract_stack()[:-2])
              if "/torch/" not in f.filename and not f.filename.endswith("test_host_syncs.py")]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[:depth]) or "?"


class HostReads(TorchDispatchMode):
    """Counts host reads and host-made tensors by the step the meter says is running."""

    def __init__(self) -> None:
        super().__init__()
        self.step = -1  # before the first training batch
        self.counts: dict[int, Counter] = defaultdict(Counter)
        self.sites: dict[int, Counter] = defaultdict(Counter)

    def record(self, kind: str) -> None:
        stack = traceback.extract_stack()
        if kind == "value" and any("torch/utils/data/" in f.filename for f in stack):
            return  # the batch assembled on the host (a DataLoader's fetch): it reaches the device as a copy
        if any(f.filename.endswith("grad_scaler.py") for f in stack):
            kind = f"scaler {kind}"  # inside GradScaler.step (16-mixed)
        self.counts[self.step][kind] += 1
        self.sites[self.step][f"{kind} {where()}"] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            self.record("read")
        elif func in HOST_VALUES:
            self.record("value")
        elif func.namespace == "c10d":
            self.record(f"collective {func.__name__}")
        return func(*args, **(kwargs or {}))


class SyncMeter(L.Callback):
    """Test-only (train.py ``+callbacks.sync_meter``): host reads per training step, to ``out``."""

    def __init__(self, out: str) -> None:
        self.out = Path(out)
        self.mode: HostReads | None = None
        self._patched: dict[str, object] = {}

    def on_train_start(self, trainer, pl_module) -> None:
        self.mode = mode = HostReads()
        for name in ("tolist", "numpy"):  # CPU reads that never reach the dispatcher
            original = self._patched[name] = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                mode.record("read")
                return _original(tensor, *args, **kwargs)

            setattr(torch.Tensor, name, counted)
        mode.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.mode.step = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self.mode.__exit__(None, None, None)
        for name, original in self._patched.items():
            setattr(torch.Tensor, name, original)
        self.out.mkdir(parents=True, exist_ok=True)
        report = {"log_every_n_steps": trainer.log_every_n_steps, "max_steps": trainer.max_steps,
                  "counts": {s: dict(c) for s, c in self.mode.counts.items()},
                  "sites": {s: dict(c) for s, c in self.mode.sites.items()}}
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(report, indent=1))


# ---------------------------------------------------------------------------- the runs

STEPS, EVERY = 12, 4
RUN = [f"trainer.max_steps={STEPS}", f"trainer.log_every_n_steps={EVERY}", "trainer.val_check_interval=1000",
       "trainer.limit_val_batches=1", "model.n_layer=1", "model.n_embd=16", "model.n_head=2", "model.block_size=16",
       "data.batch_size=2", "optim.warmup_steps=2", "logger=csv", "eval.extrapolation.enabled=false",
       "eval.probe.enabled=false", "trainer.enable_progress_bar=true"]
FP16_ON_CPU = ("trainer.precision=null", "trainer.plugins=[{_target_:pelab.checkpoint.AtomicCheckpointIO},"
               "{_target_:lightning.pytorch.plugins.precision.MixedPrecision,precision:16-mixed,device:cpu,"
               "scaler:{_target_:torch.amp.GradScaler,device:cpu}}]")
VARIANTS = {
    "32-true": ["trainer.precision=32-true"],
    "bf16-mixed": ["trainer.precision=bf16-mixed"],
    # Lightning turns precision=16-mixed on the CPU into bf16-mixed; its MixedPrecision plugin with a
    # CPU GradScaler runs float16 autocast and the scaler as on a GPU
    "16-mixed": list(FP16_ON_CPU),
    "ddp-2-gloo": ["trainer.precision=32-true", "trainer.accelerator=cpu", "trainer.devices=2",
                   "trainer.strategy=ddp"],
}


def measure(tmp_path: Path, overrides: list[str]) -> list[dict]:
    out = tmp_path / "syncs"
    env = {**os.environ, "HYDRA_FULL_ERROR": "1", "OMP_NUM_THREADS": "1"}
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path / 'run'}", *RUN, *overrides,
                       "+callbacks.sync_meter._target_=tests.harness.test_host_syncs.SyncMeter",
                       f"+callbacks.sync_meter.out={out}"], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def logging_step(step: int, every: int) -> bool:
    """Lightning logs the step after which global_step is a multiple of log_every_n_steps."""
    return (step + 1) % every == 0


def not_pelabs(site: str) -> str | None:
    """Why a host sync or collective in a step that does not log is outside pelab's reach, or None.

    - the gradients' all-reduce, made by DDP in the backward: the one collective a step needs;
    - DDP's broadcast of the module's buffers before each forward (``broadcast_buffers``, on by
      default in ``trainer.strategy=ddp``; pelab's buffers are constants);
    - Lightning's stop-signal flag, broadcast from rank zero and read on the host at every step
      under several processes (``_TrainingEpochLoop._broadcast_sigterm_tensor``, Lightning 2.6);
    - GradScaler.step (16-mixed): one read of ``found_inf`` to decide whether to call the AdamW,
      which is not fused under the scaler (tests/harness/test_lit.py), whose per-parameter step
      counters are host tensors (read on the host, no device sync on a GPU).
    """
    if site.startswith("collective allreduce_") and " backward " in site:
        return "the gradients' all-reduce"
    if site.startswith("collective broadcast_") and "training_step" in site.split(" < ")[1]:
        return "DDP's buffer broadcast"
    if "_broadcast_sigterm_tensor" in site.split(" < ")[0]:
        return "Lightning's stop flag"
    if site.startswith("scaler "):
        return "GradScaler.step"
    return None


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_no_host_sync_in_a_step_that_does_not_log(tmp_path, variant):
    reports = measure(tmp_path, VARIANTS[variant])
    assert len(reports) == (2 if variant.startswith("ddp") else 1)
    for report in reports:
        counts = {int(s): c for s, c in report["counts"].items()}
        sites = {int(s): c for s, c in report["sites"].items()}
        quiet = [s for s in range(STEPS - 1) if not logging_step(s, EVERY)]  # the last step ends the fit
        print(variant, {s: counts.get(s, {}) for s in range(-1, STEPS)})
        found = {s: {site: n for site, n in sites.get(s, {}).items() if not not_pelabs(site)} for s in quiet}
        assert not any(found.values()), f"{variant}: host syncs in steps that do not log: {found}"
        logged = [s for s in range(STEPS - 1) if logging_step(s, EVERY)]
        assert all(counts.get(s, {}).get("read") for s in logged)  # the meter sees the reads that are there
        if variant.startswith("ddp"):  # per step: one gradient all-reduce, nothing of pelab's
            assert all(counts[s]["collective allreduce_.default"] == 1 for s in quiet)


# ---------------------------------------------------------------------------- the guard, read late

class SkipCount(L.Callback):
    """Test-only: the guard's count of skipped steps as each step ends (after the guard's hook)."""

    def __init__(self, guard) -> None:
        self.guard, self.by_step = guard, {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.by_step[trainer.global_step - 1] = self.guard.skipped_steps


def guarded_fit(tmp_path, poison, max_skipped_steps, precision="bf16-mixed"):
    from lightning.pytorch.plugins.precision import MixedPrecision
    from torch.utils.data import DataLoader, TensorDataset

    from pelab.callbacks import NonFiniteGuard
    from pelab.lit import LitGPT
    from tests.harness.test_faults import ROPE, TINY, Snapshot

    torch.manual_seed(0)
    x = torch.randint(0, 64, (64, 17))
    loader = DataLoader(TensorDataset(x[:, :-1], x[:, 1:]), batch_size=4)
    module = LitGPT(model=TINY, pe=ROPE, optim={"lr": 1e-2, "min_lr": 1e-3, "warmup_steps": 1})
    guard, snap = NonFiniteGuard(max_skipped_steps=max_skipped_steps), Snapshot()
    count = SkipCount(guard)
    scaled = precision == "16-mixed"  # Lightning's plugin with a CPU GradScaler: float16 autocast as on a GPU
    plugins = [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu"))] if scaled else None
    trainer = L.Trainer(max_steps=10, accelerator="cpu", precision=None if scaled else precision, plugins=plugins,
                        logger=False, callbacks=[poison, snap, guard, count], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0,
                        limit_val_batches=0, log_every_n_steps=EVERY, default_root_dir=tmp_path)
    return trainer, module, loader, guard, snap, count


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_a_nan_at_step_k_changes_no_weight_and_is_named_at_the_next_logging_step(tmp_path, precision):
    from tests.harness.test_faults import Poison

    trainer, module, loader, guard, snap, count = guarded_fit(tmp_path, Poison("loss", steps=[5]), 1, precision)
    with pytest.warns(UserWarning, match=r"non-finite loss at global step 5: update skipped .* read at step 8\)"):
        trainer.fit(module, train_dataloaders=loader)
    assert trainer.global_step == 10
    for before, after in zip(snap.before[5], snap.after[5]):  # weights and AdamW moments: the bits of step 4's
        assert torch.equal(before, after)
    assert any(not torch.equal(b, a) for b, a in zip(snap.before[6], snap.after[6]))  # step 6 trains again
    assert [count.by_step[s] for s in range(10)] == [0] * 7 + [1] * 3  # read at step 7, the next that logs
    assert trainer.callback_metrics["train/skipped_steps"] == 1
    if precision == "bf16-mixed":  # the skip was the fused kernel's (found_inf), the step counters too
        steps = {float(s["step"]) for s in trainer.optimizers[0].state.values()}
        assert steps == {9.0}


def test_past_the_budget_training_stops_at_the_next_logging_step_naming_the_bad_one(tmp_path):
    from pelab.callbacks import NonFiniteError
    from tests.harness.test_faults import Poison

    trainer, module, loader, guard, snap, count = guarded_fit(tmp_path, Poison("gradients", steps=[5]), 0)
    with pytest.raises(NonFiniteError, match=r"non-finite gradients at global step 5 .*training stopped at step 8 "):
        trainer.fit(module, train_dataloaders=loader)
    for before, after in zip(snap.before[5], snap.after[5]):
        assert torch.equal(before, after)


def test_log_every_n_steps_0_is_one_line_before_any_work(tmp_path):
    """The steps that log are the steps that read the device: 0 would be none (and a modulo by 0)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path}", "trainer.log_every_n_steps=0"], cwd=ROOT, env=env,
                      timeout=300)
    assert proc.returncode != 0
    assert "trainer.log_every_n_steps must be >= 1, got 0" in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "checkpoints").exists()


def test_the_harness_cost_row_times_the_three_paths():
    import sys

    sys.path.insert(0, str(ROOT / "scripts"))
    from benchkit.overhead import PATHS, measure

    row = measure(steps=3, rounds=1, warmup=1)
    assert all(row[f"{p}_us"] > 0 for p in PATHS)
    assert row["pelab_minus_plain_us"] == pytest.approx(row["pelab_us"] - row["plain_us"], abs=0.2)


# ---------------------------------------------------------------------------- on a GPU

class CudaSyncs(L.Callback):
    """Test-only (train.py ``+callbacks.cuda_syncs``): torch's own CUDA sync detector
    (``set_sync_debug_mode("warn")``) on during the steps that do not log, every warning it
    gives recorded by step and site, to ``out/rank{R}.json``."""

    def __init__(self, out: str) -> None:
        self.out, self.step = Path(out), -1
        self.sites: dict[int, Counter] = defaultdict(Counter)
        self._show = None

    def on_train_start(self, trainer, pl_module) -> None:
        import warnings

        self._show = warnings.showwarning

        def record(message, category, filename, lineno, file=None, line=None):
            if "synchronizing CUDA operation" in str(message):
                inside = any(f.filename.endswith("grad_scaler.py") for f in traceback.extract_stack())
                self.sites[self.step][("scaler " if inside else "") + where()] += 1
            else:
                self._show(message, category, filename, lineno, file, line)

        warnings.showwarning = record
        warnings.filterwarnings("always", message=".*synchronizing CUDA operation")

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        from pelab.callbacks import logging_step

        self.step = trainer.global_step
        torch.cuda.set_sync_debug_mode(0 if logging_step(trainer) else "warn")

    def on_train_end(self, trainer, pl_module) -> None:
        import warnings

        torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = self._show
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(
            json.dumps({s: dict(c) for s, c in self.sites.items()}, indent=1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed"])
def test_no_cuda_sync_in_a_step_that_does_not_log(tmp_path, precision):
    out = tmp_path / "syncs"
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path / 'run'}", *RUN, "trainer.accelerator=gpu",
                       "trainer.devices=1", f"trainer.precision={precision}",
                       "+callbacks.cuda_syncs._target_=tests.harness.test_host_syncs.CudaSyncs",
                       f"+callbacks.cuda_syncs.out={out}"], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    sites = {int(s): c for s, c in json.loads((out / "rank0.json").read_text()).items()}
    print(precision, sites)
    quiet = [s for s in range(1, STEPS - 1) if not logging_step(s, EVERY)]  # step 0: CUDA's first-use work
    found = {s: {site: n for site, n in sites.get(s, {}).items() if not site.startswith("scaler ")} for s in quiet}
    assert not any(found.values()), found


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_end_of_training_evaluation_runs_on_the_gpu(tmp_path):
    env = {**os.environ, "HYDRA_FULL_ERROR": "1"}
    proc = run_python(["train.py", f"hydra.run.dir={tmp_path}", *RUN[:-3], "trainer.accelerator=gpu",
                       "trainer.devices=1", "eval.extrapolation.multipliers=[1,2]", "eval.extrapolation.max_tokens=512",
                       "eval.probe.enabled=false"], cwd=ROOT, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "[pelab] evaluation on cuda:0: extrapolation" in proc.stdout, proc.stdout[-3000:]
