"""Sharded checkpoints saved beside training (``trainer.strategy.async_save=true``): the state is
copied to CPU memory, then torch.distributed.checkpoint's ``async_save`` writes it from a
background thread while the next steps train. The directory is still written under a hidden
name and renamed into place only once every rank's shards and ``.metadata`` are on disk, so a
kill mid-save leaves the previous checkpoints as they were and nothing under a checkpoint's name.
"""

from __future__ import annotations

import os
import shutil
import threading
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable

import torch

from pelab.checkpoint.atomic import disk_full_error, fsync_dir


class AsyncSaves:
    """At most one save in flight per process (the next save, a removal's turn, the end of fit
    wait for it). Rank zero renames a finished save into place from the writer's thread, then
    removes the checkpoints superseded while it was in flight (not before: a kill meanwhile
    must still find one complete checkpoint)."""

    def __init__(self) -> None:
        self.group = None  # a gloo group of its own: the writer's collectives never meet training's
        self.pending: Future | None = None
        self.target: Path | None = None
        self.finished = threading.Event()  # set once the save in flight is renamed (or cleaned up)
        self.removals: list[Callable[[], None]] = []
        self.error: BaseException | None = None  # rank zero's rename or removal failed
        self.lock = threading.Lock()

    def setup(self) -> None:
        import torch.distributed as dist

        self.group = dist.new_group(backend="gloo")  # every rank, at the same point (setup_environment)

    def start(self, state: dict[str, Any], meta: dict[str, Any], tmp: Path, path: Path, global_zero: bool,
              finish: Callable[[Path, Path], None]) -> None:
        """Write ``state`` (model and optimizer shards) and ``meta`` (rank zero's ``meta.pt``) to
        ``tmp``, then ``finish(tmp, path)`` on rank zero once every rank's part is on disk."""
        from torch.distributed.checkpoint import async_save

        self.wait()
        tmp.mkdir(parents=True, exist_ok=True)
        if global_zero:  # before the shards: the rename must never find it missing
            torch.save(meta, tmp / "meta.pt")
        finished = threading.Event()
        future = async_save(state, checkpoint_id=tmp, process_group=self.group, async_stager=Copies())
        with self.lock:
            self.pending, self.target, self.finished = future, path, finished

        def done(f: Future) -> None:
            try:
                ok = f.exception() is None
                if global_zero and not ok:
                    shutil.rmtree(tmp, ignore_errors=True)
                elif global_zero:
                    with open(tmp / "meta.pt", "rb+") as meta_file:
                        os.fsync(meta_file.fileno())
                    fsync_dir(tmp)
                    finish(tmp, path)
                with self.lock:  # after a failure the superseded checkpoints are kept
                    removals, self.removals = (self.removals if ok else []), []
                    finished.set()  # from here on, a removal runs at once
                for remove in removals:
                    remove()
            except BaseException as err:  # noqa: BLE001 - raised by wait(), in the training thread
                self.error = err
            finally:
                finished.set()

        future.add_done_callback(done)

    def defer(self, remove: Callable[[], None]) -> bool:
        """Run ``remove`` once the save in flight is complete (True), or say there is none (False)."""
        with self.lock:
            if self.pending is None or self.finished.is_set():
                return False
            self.removals.append(remove)
            return True

    def wait(self) -> None:
        """Block until the save in flight (if any) is complete and renamed; its failure is raised
        here, on every rank (torch.distributed.checkpoint reports any rank's to all)."""
        with self.lock:
            future, path, finished, self.pending = self.pending, self.target, self.finished, None
        if future is None:
            return
        finished.wait()  # the writer is done and rank zero's rename (or clean-up) too
        if future.exception() is not None:
            err = future.exception()
            raise disk_full_error(err, path) or err
        error, self.error = self.error, None
        if error is not None:
            raise error


class Copies:
    """The stager ``async_save`` is given: the state copied before it returns, so the steps that
    train meanwhile change nothing it writes. torch's default stager cannot copy FSDP's
    ``ShardedTensor``s (it asks them for a ``data_ptr``): their local shards are copied here."""

    _synchronize_after_execute = False  # stage() has copied everything when it returns

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state: Any) -> Any:
        from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor

        if isinstance(state, ShardedTensor):
            shards = [Shard(s.tensor.detach().clone(), s.metadata) for s in state.local_shards()]
            return ShardedTensor._init_from_local_shards_and_global_metadata(
                shards, state.metadata(), process_group=state._process_group)
        if isinstance(state, torch.Tensor):  # a plain tensor or a DTensor (hybrid sharding's)
            return state.detach().clone()
        if isinstance(state, dict):
            return {k: self.stage(v) for k, v in state.items()}
        if isinstance(state, (list, tuple)):
            return type(state)(self.stage(v) for v in state)
        return state

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass
