"""Host synchronisations per training step on CUDA, as the GPU itself reports them: a callback for
train.py (``+callbacks.host_syncs._target_=scripts.gpucheck.syncs.CudaSyncs``) that turns on
``torch.cuda.set_sync_debug_mode("warn")`` for the training loop, so that every synchronising CUDA
call (a device read on the host, a blocking copy, a stream or device synchronize) raises a
warning, and counts those warnings by the training step that was running. A step runs from one
``on_train_batch_start`` to the next: its forward, backward, update, logging and the next batch's
transfer. It writes ``out`` (JSON): counts per step, the calling sites per step, and a self-test
(one deliberate ``.item()`` that must be counted, or the counts mean nothing).

``imitate=true`` rehearses it on a CPU (tests/gpu/test_gpu_check.py): CPU torch has no sync debug
mode, so a dispatch mode raises the same warning for every host read of a tensor's value
(``aten._local_scalar_dense``: ``item``, ``bool``, ``float``), which is the one kind of sync a CPU
can show.

Imports only torch, Lightning and the standard library: train.py loads it by its dotted path from
the repository root, outside scripts/gpu_check.py's import path.
"""

from __future__ import annotations

import json
import traceback
import warnings
from collections import Counter, defaultdict
from pathlib import Path

import lightning as L
import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_TEXT = "synchronizing CUDA operation"  # c10/cuda's warn_or_error_on_sync: "called a ..."


def site(depth: int = 5) -> str:
    """The innermost frames outside torch, warnings and this file: who asked for the sync."""
    frames = [f for f in reversed(traceback.extract_stack()[:-2])
              if "/torch/" not in f.filename and "warnings" not in Path(f.filename).name
              and not f.filename.endswith("syncs.py")]
    return " < ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in frames[:depth]) or "?"


class HostReadsWarn(TorchDispatchMode):
    """CPU stand-in of CUDA's sync debug mode: SYNC_TEXT warned at every host read of a value."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            warnings.warn(SYNC_TEXT, UserWarning, stacklevel=2)
        return func(*args, **(kwargs or {}))


class CudaSyncs(L.Callback):
    """Counts CUDA's sync warnings per training step (train.py ``+callbacks.host_syncs``) into ``out``."""

    def __init__(self, out: str, imitate: bool = False) -> None:
        self.out = Path(out)
        self.imitate = HostReadsWarn() if imitate else None
        self.step = -1  # before the first training batch
        self.counts: Counter = Counter()
        self.sites: dict[int, Counter] = defaultdict(Counter)
        self.self_test = 0
        self._saved = None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._saved = warnings.catch_warnings()  # filters and showwarning restored at the end
        self._saved.__enter__()
        warnings.filterwarnings("always", message=f".*{SYNC_TEXT}")  # every call, not once per place
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if SYNC_TEXT in str(message):
                self.counts[self.step] += 1
                self.sites[self.step][site()] += 1
                return
            shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        if self.imitate:
            self.imitate.__enter__()
        else:
            torch.cuda.set_sync_debug_mode("warn")
        before = self.counts[self.step]
        torch.ones(1, device=pl_module.device).item()  # must be counted: proves the counter sees syncs
        self.self_test = self.counts[self.step] - before
        self.counts[self.step], self.sites[self.step] = before, Counter()

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        self.step = trainer.global_step

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.imitate:
            self.imitate.__exit__(None, None, None)
        else:
            torch.cuda.set_sync_debug_mode("default")
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
        if not trainer.is_global_zero:
            return
        self.out.parent.mkdir(parents=True, exist_ok=True)
        self.out.write_text(json.dumps({
            "log_every_n_steps": trainer.log_every_n_steps, "steps": trainer.global_step,
            "self_test": self.self_test, "counts": {str(s): n for s, n in sorted(self.counts.items())},
            "sites": {str(s): dict(c.most_common()) for s, c in sorted(self.sites.items())}}, indent=1) + "\n")
