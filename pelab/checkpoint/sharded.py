"""FSDP's sharded checkpoint directories (conf/trainer/fsdp.yaml, hsdp.yaml): written under a
hidden name and renamed into place when complete (also in the background: async_save.py),
``state_dict_type=auto``, resumed on any number of ranks, and gathered whole on one process."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path
from typing import Any

from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy

from data.paths import aside_name, remove_dead_leftovers
from pelab.checkpoint.async_save import AsyncSaves
from pelab.checkpoint.atomic import disk_full_error, fsync_dir
from pelab.checkpoint.errors import CheckpointError
from pelab.checkpoint.mesh import build_mesh, mesh_shape

# Lightning writes a sharded checkpoint as a directory: torch.distributed.checkpoint's shards and
# ``.metadata`` (written last, by rank 0, once every rank's shards are on disk) and ``meta.pt``
# (everything but the model and optimizer state: loops, schedule, callbacks, hyper-parameters).
META_FILE = "meta.pt"  # lightning.fabric.strategies.fsdp._METADATA_FILENAME
DCP_METADATA = ".metadata"
BYTES_PER_PARAMETER = 12  # a full state: float32 weights and AdamW's two float32 moments
SHARDED_ABOVE_BYTES = 2 * 2**30  # state_dict_type=auto: sharded above ~179M parameters (gpt2_medium and up)


class FSDPStrategy(LightningFSDPStrategy):
    """Lightning's ``FSDPStrategy`` (conf/trainer/fsdp.yaml) with sharded checkpoints that resume.

    ``state_dict_type``: ``full`` (gathered on rank 0, one file, through the trainer's
    CheckpointIO), ``sharded`` (each rank writes its own shards with torch.distributed.checkpoint:
    no gather, no rank holding the whole state, on save or on resume) or ``auto``: sharded when
    the full state (12 bytes a parameter) exceeds ``SHARDED_ABOVE_BYTES``, decided once the model
    is built. Lightning writes a sharded checkpoint straight into its final directory, so a kill
    mid-save leaves a half-written one under the real name; here it is written under a hidden
    name beside it (``.NAME.<id>.partial``) and renamed into place once every rank's shards and
    ``meta.pt`` are on disk.

    ``async_save``: sharded saves written by a background thread while training goes on
    (``AsyncSaves``), still renamed into place only when complete. ``device_mesh``: hybrid
    sharding's ``[replicas, shards]`` (conf/trainer/hsdp.yaml), built on the training device.
    """

    # Lightning refuses FSDP without a GPU only for its own class (an exact type check in its
    # accelerator connector); this subclass keeps that refusal, at the same point (building the
    # Trainer). tests/harness/fsdp_worker.py lifts it to run FSDP on gloo CPU processes.
    cpu_for_tests = False

    @property
    def accelerator(self):
        return self._accelerator

    @accelerator.setter
    def accelerator(self, accelerator) -> None:
        from lightning.pytorch.accelerators import CUDAAccelerator

        if accelerator is not None and not isinstance(accelerator, CUDAAccelerator) and not self.cpu_for_tests:
            raise ValueError(f"trainer.accelerator: trainer=fsdp (FSDP) needs GPUs, got {type(accelerator).__name__}; "
                             "set trainer.accelerator=gpu, or use trainer=default / trainer=ddp on this machine")
        self._accelerator = accelerator

    def __init__(self, *args: Any, state_dict_type: str = "auto", async_save: bool = False,
                 device_mesh: Any = None, **kwargs: Any) -> None:
        if state_dict_type not in ("auto", "full", "sharded"):
            raise ValueError(f"trainer.strategy.state_dict_type must be auto, full or sharded, got "
                             f"{state_dict_type!r}")
        if async_save not in (True, False):
            raise ValueError(f"trainer.strategy.async_save must be true or false, got {async_save!r}")
        if async_save and state_dict_type == "full":
            raise ValueError("trainer.strategy.async_save=true saves sharded checkpoints in the background "
                             "(torch.distributed.checkpoint.async_save), and state_dict_type=full gathers one file on "
                             "rank 0; allowed: state_dict_type=sharded or auto with async_save=true")
        self.requested_state_dict_type = state_dict_type
        self.async_saves = AsyncSaves() if async_save else None
        mesh = device_mesh if hasattr(device_mesh, "get_group") else mesh_shape(device_mesh)  # a DeviceMesh as it is
        super().__init__(*args, state_dict_type="full" if state_dict_type == "auto" else state_dict_type,
                         device_mesh=mesh, **kwargs)

    def setup_environment(self) -> None:
        """Lightning's, with a ``(replicas, shards)`` mesh built on the training device's type
        (Lightning builds it on CUDA only) and checked against the world the job started, and the
        asynchronous saves' own process group."""
        shape = self.kwargs.pop("device_mesh", None) if isinstance(self.kwargs.get("device_mesh"), tuple) else None
        super().setup_environment()
        if shape is not None:
            self.kwargs["device_mesh"] = build_mesh(shape, self.root_device.type, self.world_size)
        if self.async_saves is not None:
            self.async_saves.setup()

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    def setup(self, trainer) -> None:
        if self.requested_state_dict_type == "auto":  # the model is built (configure_model) before setup
            self._state_dict_type = auto_state_dict_type(sum(p.numel() for p in self.lightning_module.parameters()))
        if self.async_saves is not None and self._state_dict_type == "full" and self.is_global_zero:
            print("[pelab] trainer.strategy.async_save=true: this model's checkpoints are full (state_dict_type=auto, "
                  "state under 2 GiB): they are saved synchronously", flush=True)
        super().setup(trainer)

    def teardown(self) -> None:
        if self.async_saves is not None:
            self.async_saves.wait()  # the last checkpoint is complete before the process may exit
        super().teardown()

    def remove_checkpoint(self, filepath) -> None:
        """A checkpoint superseded while a save is in flight is removed once that save is complete."""
        if self.async_saves is not None and self.is_global_zero and self.async_saves.defer(
                lambda: LightningFSDPStrategy.remove_checkpoint(self, filepath)):
            return
        super().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        """A sharded directory resumed as Lightning resumes it, but for the optimizer state: that is
        read into this rank's own layout of it (``FSDP.optim_state_dict`` of an optimizer whose
        state exists), so FULL_SHARD and HYBRID_SHARD alike get their AdamW moments back exactly.
        Lightning's ``load_sharded_optimizer_state_dict`` lays hybrid sharding's 2-D state out over
        the whole world: the weights came back right, the moments wrong. Anything else (a full
        file, validation only, several optimizers) is Lightning's."""
        import torch
        from lightning.fabric.strategies.fsdp import _get_sharded_state_dict_context
        from lightning.pytorch.trainer.states import TrainerFn
        from torch.distributed.checkpoint import load
        from torch.distributed.checkpoint.state_dict import _init_optim_state
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

        path = Path(self.broadcast(checkpoint_path))
        module = self.lightning_module
        if not (path.is_dir() and (path / META_FILE).is_file()) or module.trainer.state.fn != TrainerFn.FITTING \
                or len(self.optimizers) != 1:
            return super().load_checkpoint(checkpoint_path, weights_only)
        optimizer = self.optimizers[0]
        with _get_sharded_state_dict_context(self.model):
            state = {"model": self.model.state_dict()}
            load(state, checkpoint_id=path)
            self.model.load_state_dict(state["model"], strict=module.strict_loading)
            _init_optim_state(optimizer)  # AdamW creates its state at its first step (here with lr 0: no change)
            state = {"optimizer_0": FSDP.optim_state_dict(self.model, optimizer)}  # this rank's layout, filled in
            load(state, checkpoint_id=path)
            optimizer.load_state_dict(FSDP.optim_state_dict_to_load(self.model, optimizer, state["optimizer_0"]))
        return torch.load(path / META_FILE, weights_only=weights_only)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(filepath))
        if self._state_dict_type != "sharded" or storage_options is not None or not isinstance(
                get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        tmp = path.parent / self.broadcast(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")  # rank 0's name
        if self.async_saves is not None:
            return self._save_async(checkpoint, tmp, path)
        error = None
        try:
            super().save_checkpoint(checkpoint, tmp)  # every rank's shards, .metadata, then rank 0's meta.pt
            if self.is_global_zero:
                with open(tmp / META_FILE, "rb+") as f:
                    os.fsync(f.fileno())  # the shards are fsynced by torch.distributed.checkpoint
                fsync_dir(tmp)
        except Exception as err:  # noqa: BLE001 - raised below, on every rank, once all have stopped writing
            error = err
        if not self.reduce_boolean_decision(error is None, all=True):  # a collective: all ranks are done
            if self.is_global_zero:
                shutil.rmtree(tmp, ignore_errors=True)
            if error is None:
                raise CheckpointError(f"saving {path} failed on another rank (see its error); the checkpoints "
                                      "already there are intact")
            raise disk_full_error(error, path) or error
        if self.is_global_zero:
            _into_place(tmp, path)
        self.barrier("pelab.FSDPStrategy.save_checkpoint")

    def _save_async(self, checkpoint: dict[str, Any], tmp: Path, path: Path) -> None:
        """Lightning's sharded layout (``model``, ``optimizer_N`` through torch.distributed.checkpoint,
        the rest in rank zero's ``meta.pt``), written in the background; returns once the state is
        copied to CPU memory (after the previous save is complete)."""
        state = {"model": checkpoint.pop("state_dict")}
        state.update({f"optimizer_{i}": s for i, s in enumerate(checkpoint.pop("optimizer_states", []))})
        self.async_saves.start(state, checkpoint, tmp, path, self.is_global_zero, _into_place)
        if path.name.startswith("hpc_ckpt_"):  # SLURM's requeue signal: the job is stopped right after this save
            self.async_saves.wait()


def _into_place(tmp: Path, path: Path) -> None:
    """Rank zero: the complete directory under its name, and any killed save's leftovers removed."""
    replace_dir(tmp, path)
    for stale in path.parent.glob(f".{path.name}.*.partial"):  # left behind by a save that was killed
        shutil.rmtree(stale, ignore_errors=True)


def auto_state_dict_type(parameters: int) -> str:
    """``state_dict_type=auto``: sharded when gathering the full state on one rank would be costly."""
    return "sharded" if BYTES_PER_PARAMETER * parameters > SHARDED_ABOVE_BYTES else "full"


def replace_dir(new: Path, path: Path) -> None:
    """Put the directory ``new`` at ``path``, whatever is there (a file, a directory, a link).
    A directory cannot be renamed over a non-empty one, so the old one is renamed aside first:
    a kill between the two renames leaves it as ``.NAME.<pid>-<id>.old``, complete, which the
    next replacement of ``path`` removes once its own is in place (its process is gone)."""
    aside = None
    if os.path.lexists(path):
        aside = aside_name(path, "old")
        os.rename(path, aside)
    os.rename(new, path)
    fsync_dir(path.parent)
    if aside is not None:
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink()
    remove_dead_leftovers(path, ("old",))


def sharded_complete(path: Path) -> str | None:
    """None for a complete sharded checkpoint directory, else what is missing."""
    missing = [name for name in (DCP_METADATA, META_FILE) if not (path / name).is_file()]
    if missing:
        return (f"a half-written sharded checkpoint (no {' or '.join(missing)}: its save did not finish); "
                "written by a save that was not atomic")
    return None


def sharded_state(path, keys=("model",)) -> dict[str, Any]:
    """The tensors of a sharded checkpoint directory, gathered whole on this one process (no process
    group): ``{"model": {name: tensor}}``, and ``optimizer_0`` too when asked. This is
    torch.distributed.checkpoint's own ``format_utils.dcp_to_torch_save`` without the file it
    writes (its public ``load`` fills only the keys a state dict already has)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    state: dict[str, Any] = {}
    _load_state_dict(state, storage_reader=FileSystemReader(path), planner=_EmptyStateDictLoadPlanner(keys=set(keys)),
                     no_dist=True)
    return state
