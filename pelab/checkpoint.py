"""Checkpoints that survive faults.

- ``AtomicCheckpointIO``: the Trainer's CheckpointIO plugin (conf/trainer/default.yaml). A save goes
  to a hidden temporary file in the checkpoint's own directory, is fsynced, then ``os.replace``d
  over the final name, so a kill (or power loss) mid-save leaves the previous file intact.
- ``FSDPStrategy``: Lightning's, for conf/trainer/fsdp.yaml: ``state_dict_type=auto`` (sharded
  above ``SHARDED_ABOVE_BYTES`` of full state) and sharded (torch.distributed.checkpoint)
  directories written under a hidden name and renamed into place when complete.
- ``read_checkpoint``: opens a file (or a sharded directory) as a pelab checkpoint
  (``weights_only=True``, tensors memory-mapped, so it is cheap) or raises ``CheckpointError``
  naming the file and what is wrong; ``verify=True`` also checks every record's CRC-32.
- ``check_resume``: the above plus a comparison of the checkpoint's position scheme and model
  shape with the run's config, for ``train.py ckpt_path=...`` before any data or compute.
- ``check_init_from`` / ``init_state``: ``train.py init_from=...``, a run that starts from another
  run's weights (fresh optimizer, schedule, step and data): the file, its architecture against the
  run's, and its weights made to fit the run's scheme, all before any data or compute.
- ``load_lit_gpt``: checked, ``weights_only=True`` ``LitGPT.load_from_checkpoint`` for the scripts;
  a sharded directory is gathered on the one CPU process (``sharded_state``).
- ``resume_from_run_dir``: ``resume=auto``, the newest intact checkpoint of the run dir.
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import shutil
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from hydra.errors import CompactHydraException
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import FSDPStrategy as LightningFSDPStrategy

from pelab.config import ConfigError, fail

EXPECTED = "a Lightning checkpoint written by train.py (RUN_DIR/checkpoints/*.ckpt)"
ZIP_MAGIC = b"PK\x03\x04"  # every torch.save archive (the default format since torch 1.6) starts so


class CheckpointError(CompactHydraException, ValueError):
    """A checkpoint file that cannot be used (or be written), with the file and the reason in the
    message; Hydra's CLI prints it alone, without a traceback, as a ``ConfigError``."""


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` whose local saves are atomic and durable.

    Lightning 2.6's own ``_atomic_save`` serialises the whole checkpoint into memory, writes it to a
    temporary file in the *system* temp dir and moves it into place: when that dir is on another
    filesystem (a tmpfs ``/tmp``, a network checkpoint dir) the move is a copy into the final name,
    so a kill mid-copy leaves a truncated file; nothing is fsynced either. Here the temporary file
    sits next to the target (same filesystem, so ``os.replace`` is atomic), the checkpoint streams
    into it, and file and directory are fsynced. Remote (fsspec URL) paths keep Lightning's save.

    ``refuse_non_finite``: a state dict holding NaN/inf weights is not written (the previous file
    under that name is kept), whatever made the weights non-finite.
    """

    def __init__(self, refuse_non_finite: bool = True) -> None:
        super().__init__()
        self.refuse_non_finite = refuse_non_finite

    def save_checkpoint(self, checkpoint: dict[str, Any], path, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, path, storage_options)
        if self.refuse_non_finite:
            _refuse_non_finite(checkpoint.get("state_dict", {}), path)
        atomic_torch_save(checkpoint, Path(path))


def atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.*.tmp"):  # left behind by a save that was killed
        stale.unlink(missing_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    try:
        # os.open with 0o666 lets the umask set the permissions, as for any new file
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())  # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        raise disk_full_error(err, path) or err
    _fsync_dir(path.parent)


def _fsync_dir(directory: Path) -> None:
    if hasattr(os, "O_DIRECTORY"):  # make a rename itself durable (POSIX)
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _causes(err: BaseException):
    """``err``, its causes and contexts, and the per-rank failures a torch.distributed.checkpoint
    ``CheckpointException`` carries."""
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__]
        for failure in (getattr(e, "failures", None) or {}).values():  # rank -> exception (or a wrapper)
            todo.append(failure if isinstance(failure, BaseException) else getattr(failure, "exc", None))


def disk_full_error(err: BaseException, path) -> CheckpointError | None:
    """One line for a save that ran out of space (torch's own error is two chained tracebacks,
    ``No space left on device`` then ``enforce fail at inline_container.cc``), or None."""
    if not any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT) for e in _causes(err)):
        return None
    directory = Path(path).parent
    try:
        free = f"{shutil.disk_usage(directory).free / 2**30:.2f} GiB free there now"
    except OSError:
        free = "free space unknown"
    error = CheckpointError(f"no space left on the device of {directory} while saving {Path(path).name} "
                            f"({free}); the checkpoints already there are intact: free space or point "
                            "callbacks.model_checkpoint.dirpath elsewhere, then resume=auto")
    error.__suppress_context__ = True
    return error


def _refuse_non_finite(state_dict: dict[str, Any], path) -> None:
    floats = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    if not floats:
        return
    finite = [bool(v.isfinite().all()) for v in floats.values()]  # once per save, not per step
    if all(finite):
        return
    bad = [k for k, ok in zip(floats, finite) if not ok]
    raise CheckpointError(
        f"refusing to write {path}: {len(bad)} weight tensor(s) are not finite (NaN/inf), first {bad[0]!r}; "
        "the previous file under that name is kept"
    )


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

    def __init__(self, *args: Any, state_dict_type: str = "auto", **kwargs: Any) -> None:
        if state_dict_type not in ("auto", "full", "sharded"):
            raise ValueError(f"trainer.strategy.state_dict_type must be auto, full or sharded, got "
                             f"{state_dict_type!r}")
        self.requested_state_dict_type = state_dict_type
        super().__init__(*args, state_dict_type="full" if state_dict_type == "auto" else state_dict_type, **kwargs)

    @property
    def state_dict_type(self) -> str:
        return self._state_dict_type

    def setup(self, trainer) -> None:
        if self.requested_state_dict_type == "auto":  # the model is built (configure_model) before setup
            self._state_dict_type = auto_state_dict_type(sum(p.numel() for p in self.lightning_module.parameters()))
        super().setup(trainer)

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        path = Path(self.broadcast(filepath))
        if self._state_dict_type != "sharded" or storage_options is not None or not isinstance(
                get_filesystem(path), LocalFileSystem):
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        tmp = path.parent / self.broadcast(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")  # rank 0's name
        error = None
        try:
            super().save_checkpoint(checkpoint, tmp)  # every rank's shards, .metadata, then rank 0's meta.pt
            if self.is_global_zero:
                with open(tmp / META_FILE, "rb+") as f:
                    os.fsync(f.fileno())  # the shards are fsynced by torch.distributed.checkpoint
                _fsync_dir(tmp)
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
            replace_dir(tmp, path)
            for stale in path.parent.glob(f".{path.name}.*.partial"):  # left behind by a save that was killed
                shutil.rmtree(stale, ignore_errors=True)
        self.barrier("pelab.FSDPStrategy.save_checkpoint")


def auto_state_dict_type(parameters: int) -> str:
    """``state_dict_type=auto``: sharded when gathering the full state on one rank would be costly."""
    return "sharded" if BYTES_PER_PARAMETER * parameters > SHARDED_ABOVE_BYTES else "full"


def replace_dir(new: Path, path: Path) -> None:
    """Put the directory ``new`` at ``path``, whatever is there (a file, a directory, a link).
    A directory cannot be renamed over a non-empty one, so the old one is renamed aside first:
    a kill between the two renames leaves it as ``.NAME.<id>.old``, complete."""
    aside = None
    if os.path.lexists(path):
        aside = path.parent / f".{path.name}.{uuid.uuid4().hex[:8]}.old"
        os.rename(path, aside)
    os.rename(new, path)
    _fsync_dir(path.parent)
    if aside is not None:
        shutil.rmtree(aside) if aside.is_dir() and not aside.is_symlink() else aside.unlink()


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


def consolidate(path, out) -> Path:
    """A sharded checkpoint directory as one full checkpoint file (weights and the run's
    hyper-parameters, no optimizer state): what ``scripts/*.py ckpt=`` and ``init_from`` read."""
    ckpt = {**read_checkpoint(path, "ckpt"), "state_dict": sharded_state(path)["model"]}
    atomic_torch_save(ckpt, Path(out))
    return Path(out)


def _reason(error: BaseException) -> str:
    """The line of torch's (long) weights_only refusal that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "Unsupported global" in line:
            return line.split(" was not an allowed global")[0].split("GLOBAL ")[-1]
        if line.endswith("WeightsUnpickler error:") and i + 1 < len(lines):
            return lines[i + 1]
    return (lines or [type(error).__name__])[0][:300]


def read_checkpoint(path, key: str = "ckpt_path", for_resume: bool = False, verify: bool = False) -> dict[str, Any]:
    """Open ``path`` as a pelab checkpoint or raise ``CheckpointError`` saying what is wrong.

    Loaded with ``weights_only=True`` (tensors and plain containers only, no code runs) and
    ``mmap=True`` (tensor bytes are not read), so checking a large checkpoint is quick.
    ``verify``: also read every record and check its CRC-32 (a block damaged in place, size kept,
    loads without any error otherwise: torch checks no CRC); reads the whole file once.
    ``key`` is the option the path came from (``ckpt_path``, ``ckpt``), named in errors.
    A sharded checkpoint (a directory) gives its ``meta.pt`` (everything but the tensors).
    """
    path = Path(path)
    where = f"{key}={path}"
    if path.is_dir():
        return _read_sharded(path, where, for_resume, verify)
    if not path.is_file():
        raise CheckpointError(f"{where} does not exist" if not path.exists() else f"{where} is not a file")
    size = path.stat().st_size
    if size == 0:
        raise CheckpointError(f"{where} is empty (0 bytes): its save was interrupted; use an earlier checkpoint")
    with open(path, "rb") as f:
        head = f.read(16)
    if not zipfile.is_zipfile(path):
        if head.startswith(ZIP_MAGIC):  # the archive's directory is written last: the end is missing
            raise CheckpointError(
                f"{where} is truncated or corrupt ({size} bytes): it starts like a torch.save archive but "
                "its end (the zip directory) is missing, e.g. an interrupted copy; use another checkpoint "
                "such as the step*.ckpt next to it")
        raise CheckpointError(f"{where} is not a PyTorch checkpoint: it starts with {head!r} where a torch.save "
                              f"archive starts with {ZIP_MAGIC!r}; expected {EXPECTED}")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except pickle.UnpicklingError as e:
        reason = _reason(e)
        if "Unsupported global" not in str(e):  # a damaged record, not a foreign object
            raise CheckpointError(f"{where} is corrupt, its pickled record cannot be read: {reason}") from e
        raise CheckpointError(
            f"{where} holds a Python object of type {reason}, which is not loaded: checkpoints are read with "
            f"weights_only=True (tensors and plain containers only, no code runs); expected {EXPECTED}") from e
    except Exception as e:  # a damaged archive: torch's zip reader or unpickler fails
        raise CheckpointError(f"{where} is corrupt, torch.load failed: {type(e).__name__}: {_reason(e)}") from e
    if verify:
        _verify_records(path, where)
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        found = f"keys {sorted(map(str, ckpt))[:8]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise CheckpointError(f"{where} is a torch file but not a Lightning checkpoint (no 'state_dict'; it holds "
                              f"{found}); expected {EXPECTED}")
    return _check_contents(ckpt, where, for_resume)


def _check_contents(ckpt: dict[str, Any], where: str, for_resume: bool, sharded: bool = False) -> dict[str, Any]:
    hparams = ckpt.get("hyper_parameters")
    if not isinstance(hparams, dict) or not all(isinstance(hparams.get(k), dict) for k in ("model", "pe")):
        raise CheckpointError(f"{where} is a Lightning checkpoint but not one of pelab's LitGPT (its "
                              f"hyper_parameters lack the 'model' and 'pe' configs); expected {EXPECTED}")
    if for_resume and not sharded and "optimizer_states" not in ckpt:
        raise CheckpointError(f"{where} holds weights only (saved with save_weights_only=True, no optimizer "
                              "state): it can be evaluated or sampled from, not resumed")
    return ckpt


def _verify_records(path: Path, where: str) -> None:
    """Every record of the archive read and checked against the CRC-32 stored when it was written."""
    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as e:  # a damaged local header
        bad, reason = None, f"{type(e).__name__}: {e}"
    else:
        reason = None
    if bad is not None or reason is not None:
        what = f"its record {bad!r} fails its CRC-32 check" if bad is not None else reason
        raise CheckpointError(f"{where} is corrupt ({path.stat().st_size} bytes, size intact): {what}, e.g. a "
                              "disk or copy error; use another checkpoint such as the step*.ckpt next to it")


def _read_sharded(path: Path, where: str, for_resume: bool, verify: bool) -> dict[str, Any]:
    """A sharded checkpoint directory (Lightning's FSDP ``state_dict_type=sharded``): complete,
    its ``meta.pt`` a pelab checkpoint's, its shards all there and as long as ``.metadata`` says,
    the optimizer state in it for a resume. torch.distributed.checkpoint stores no checksums, so
    ``verify`` adds nothing here."""
    incomplete = sharded_complete(path)
    if incomplete:
        raise CheckpointError(f"{where} is {incomplete}; use another checkpoint such as a step*.ckpt next to it")
    from torch.distributed.checkpoint import FileSystemReader

    try:
        meta = torch.load(path / META_FILE, map_location="cpu", weights_only=True)
        layout = FileSystemReader(path).read_metadata()
    except Exception as e:  # noqa: BLE001 - torch's zip reader, unpickler or DCP's reader
        raise CheckpointError(f"{where} is a sharded checkpoint whose {META_FILE} or {DCP_METADATA} cannot be "
                              f"read: {type(e).__name__}: {_reason(e)}") from e
    if not isinstance(meta, dict):
        raise CheckpointError(f"{where}/{META_FILE} holds a {type(meta).__name__}, not a Lightning checkpoint's "
                              f"metadata; expected {EXPECTED}")
    extent: dict[str, int] = {}  # bytes each shard file must hold
    for info in (layout.storage_data or {}).values():
        name = str(info.relative_path)
        extent[name] = max(extent.get(name, 0), info.offset + info.length)
    for name, size in sorted(extent.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{where} is incomplete: its shard {name} is missing")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{where} is truncated: its shard {name} holds {shard.stat().st_size} bytes, "
                                  f"its {DCP_METADATA} says {size}")
    keys = list(layout.state_dict_metadata)
    if for_resume and not any(k.startswith("optimizer_0.") for k in keys):
        raise CheckpointError(f"{where} holds weights only (no optimizer state): it can be evaluated or sampled "
                              "from, not resumed")
    return _check_contents({**meta, "state_dict": None}, where, for_resume, sharded=True)


def _scheme(pe: dict) -> str:
    """The ``pe=`` choice of a pe config (conf/pe/NAME.yaml), from its class."""
    from model.pe import SCHEMES

    by_target = {f"{cls.__module__}.{cls.__qualname__}": name for name, cls in SCHEMES.items()}
    target = pe.get("_target_")
    return by_target.get(target, str(target))


def _defaults(target: Any) -> dict[str, Any]:
    """Constructor defaults of a config's class: a key missing on one side (a checkpoint from before
    the key existed) counts as its default, not as a difference."""
    import dataclasses
    import inspect

    from hydra.utils import get_class

    try:
        cls = get_class(target) if isinstance(target, str) else target
    except Exception:  # an unknown class: compare the keys as they are
        return {}
    if dataclasses.is_dataclass(cls):
        return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}
    return {k: p.default for k, p in inspect.signature(cls).parameters.items() if p.default is not p.empty}


def config_mismatches(saved: dict, run: dict) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint value, run value) for each ``pe``/``model`` setting that differs.

    A different scheme is one entry (``pe``): the other pe keys belong to another scheme.
    ``model.vocab_size`` is compared only when the run sets it (train.py takes it from the data).
    """
    from model.config import GPTConfig

    def diff(group: str, defaults: dict) -> list[tuple[str, Any, Any]]:
        defaults = _flat(defaults)  # nested blocks (pe.scaling) compared key by key
        ours, theirs = {**defaults, **_flat(saved[group])}, {**defaults, **_flat(run[group])}
        if group == "model" and theirs.get("vocab_size") is None:
            ours.pop("vocab_size", None)
        return [(f"{group}.{k}", ours.get(k), theirs.get(k)) for k in sorted(set(ours) | set(theirs))
                if ours.get(k) != theirs.get(k)]

    from model.pe.scaling import SCALING_DEFAULTS

    target = saved["pe"].get("_target_")
    pe_defaults = {"scaling": SCALING_DEFAULTS, **_defaults(target)}  # a checkpoint from before pe.scaling
    pe = [("pe", saved["pe"], run["pe"])] if target != run["pe"].get("_target_") else diff("pe", pe_defaults)
    return pe + diff("model", _defaults(GPTConfig))


def _flat(values: dict, prefix: str = "") -> dict:
    """{"scaling": {"kind": ...}} as {"scaling.kind": ...}."""
    out = {}
    for k, v in values.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def _describe(key: str, value: Any) -> str:
    if key == "pe":
        return f"pe={_scheme(value)} ({value.get('_target_')})"
    return f"{key}={value}"


def _strategy_name(cfg) -> str:
    strategy = cfg.trainer.get("strategy") if "trainer" in cfg else None
    return str(strategy.get("_target_") if hasattr(strategy, "get") else strategy)


def _loads_sharded(cfg) -> bool:
    """Whether the run's strategy resumes a sharded (torch.distributed.checkpoint) directory."""
    from hydra.utils import get_class

    try:
        return issubclass(get_class(_strategy_name(cfg)), LightningFSDPStrategy)
    except Exception:  # noqa: BLE001 - a strategy name ("ddp", "auto") or no trainer section
        return _strategy_name(cfg).startswith("fsdp")


def check_resume(ckpt_path, cfg) -> dict[str, Any]:
    """``train.py ckpt_path=...``: a usable checkpoint whose scheme and model match the run's config.

    Rope and ALiBi have no parameters, so without this a resume under another scheme would load
    "successfully" and silently train a different model.
    """
    from omegaconf import OmegaConf

    if Path(ckpt_path).is_dir() and not _loads_sharded(cfg):
        raise CheckpointError(
            f"ckpt_path={ckpt_path} is a sharded checkpoint (a directory written by trainer=fsdp with "
            f"state_dict_type=sharded), which only trainer=fsdp resumes; this run's trainer.strategy is "
            f"{_strategy_name(cfg)}. Resume it with trainer=fsdp, or start from its weights with "
            f"init_from={ckpt_path} (a fresh optimizer)")
    ckpt = verified(ckpt_path, "ckpt_path")
    run = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("pe", "model")}
    diffs = config_mismatches(ckpt["hyper_parameters"], run)
    if diffs:
        fixes = " ".join(f"pe={_scheme(s)}" if k == "pe" else f"{k}={s}" for k, s, _ in diffs)
        raise CheckpointError(
            f"ckpt_path={ckpt_path} was trained with {', '.join(_describe(k, s) for k, s, _ in diffs)}, "
            f"this run has {', '.join(_describe(k, r) for k, _, r in diffs)}; "
            f"resume with {fixes} or start a new run")
    return ckpt


# What init_from may change: the training length, regularisation, the attention backend and
# temperature, every pe option but the scheme itself (base, scaling, ...), optim and data.
INIT_FREE = ("model.block_size", "model.dropout", "model.attention", "model.attn_temperature",
             "model.attn_temperature_length", "model.attn_temperature_floor", "model.attn_temperature_scale")


def check_init_from(path, cfg) -> dict[str, Any]:
    """``train.py init_from=...``: a readable pelab checkpoint (weights only is enough) of the
    run's architecture; every differing key is listed. (``hf:DIR``, a transformers folder, is
    pelab/hf_import.py's ``check_hf_init``.)"""
    from omegaconf import OmegaConf

    ckpt = read_checkpoint(path, "init_from", verify=True)
    if Path(path).is_dir():
        ckpt["state_dict"] = sharded_state(path)["model"]
    refuse_non_finite_init(ckpt["state_dict"], path)
    run = {k: OmegaConf.to_container(cfg[k], resolve=True) for k in ("pe", "model")}
    diffs = [(k, s, r) for k, s, r in config_mismatches(ckpt["hyper_parameters"], run)
             if k == "pe" or k.startswith("model.") and k not in INIT_FREE]
    if diffs:
        raise CheckpointError(
            f"init_from={path} has another architecture: it was trained with "
            f"{', '.join(_describe(k, s) for k, s, _ in diffs)}, this run has "
            f"{', '.join(_describe(k, r) for k, _, r in diffs)}; a run started from it may change only "
            f"{', '.join(INIT_FREE)}, the pe options (not the scheme), optim and data")
    return ckpt


def refuse_non_finite_init(state_dict: dict[str, Any], path) -> None:
    floats = {k: v for k, v in state_dict.items() if isinstance(v, torch.Tensor) and v.is_floating_point()}
    bad = [k for k, v in floats.items() if not bool(v.isfinite().all())]
    if bad:
        raise CheckpointError(f"init_from={path} holds non-finite weights (NaN/inf) in {len(bad)} of {len(floats)} "
                              f"tensors, first {bad[0]!r}: a run cannot start from them; use an earlier checkpoint "
                              "of that run")


def init_state(ckpt: dict[str, Any], scheme, path) -> dict[str, Any]:
    """The GPT's state dict of an ``init_from`` checkpoint, its scheme tensors made to fit
    ``scheme`` (``resized_state``: a learned table of another length) and checked against it;
    ``fresh_pe`` (an ``hf:`` folder of another scheme): the scheme's own initial tensors."""
    state = {}
    for key, value in ckpt["state_dict"].items():
        key = key.replace("_orig_mod.", "")  # saved from a torch.compile'd model
        if key.startswith("model."):
            state[key.removeprefix("model.")] = value
    pe = (scheme.state_dict() if ckpt.get("fresh_pe") else
          scheme.resized_state({k.removeprefix("pe."): v for k, v in state.items() if k.startswith("pe.")}))
    want = scheme.state_dict()
    wrong = sorted(set(want) ^ set(pe)) + sorted(k for k in set(want) & set(pe) if want[k].shape != pe[k].shape)
    if wrong:
        shapes = ", ".join(f"pe.{k}: {tuple(pe[k].shape) if k in pe else 'absent'} in the checkpoint, "
                           f"{tuple(want[k].shape) if k in want else 'absent'} in this run" for k in wrong)
        raise CheckpointError(f"init_from={path}: its pe={scheme.name} weights do not fit this run's: {shapes}")
    return {**{k: v for k, v in state.items() if not k.startswith("pe.")}, **{f"pe.{k}": v for k, v in pe.items()}}


def load_init_weights(gpt, state: dict[str, Any], path) -> None:
    """Copy ``init_state``'s weights into ``gpt`` (a GPT), naming any tensor of another shape
    (the vocabulary comes from the data, known only once the tokenizer is loaded)."""
    own = gpt.state_dict()
    state = _fit_vocabulary(state, own, gpt.config, path)
    wrong = [k for k in own if k in state and own[k].shape != state[k].shape]
    if wrong:
        raise CheckpointError(
            f"init_from={path} does not fit this run's model: "
            + ", ".join(f"{k} {tuple(state[k].shape)} in the checkpoint, {tuple(own[k].shape)} here" for k in wrong)
            + " (a different tokenizer or data.vocab?)")
    gpt.load_state_dict(state)
    print(f"[pelab] init_from: weights of {path} (optimizer, schedule, step and data start fresh)", flush=True)


def _fit_vocabulary(state: dict[str, Any], own: dict[str, Any], config, path) -> dict[str, Any]:
    """A token table of the run's vocab_size rows (an ``hf:`` folder keeps no padding) takes the
    run's own padding rows; a table of another vocabulary is refused naming both sizes."""
    table, rows = state.get("wte.weight"), own["wte.weight"].shape[0]
    if table is None or table.shape[0] == rows:
        return state
    if table.shape[0] == config.vocab_size:
        padded = torch.cat((table, own["wte.weight"][config.vocab_size:].to(table.dtype)))
        return {**state, "wte.weight": padded, "lm_head.weight": padded}
    raise CheckpointError(f"init_from={path} has {table.shape[0]} token rows (wte.weight), this run's model "
                          f"{rows} (model.vocab_size={config.vocab_size} from the data's tokenizer, "
                          f"model.pad_vocab_multiple={config.pad_vocab_multiple}): use the data.tokenizer it was "
                          "trained with")


def load_lit_gpt(path, map_location=None, key: str = "ckpt"):
    """``LitGPT.load_from_checkpoint`` after ``read_checkpoint`` (every record's CRC checked),
    with ``weights_only=True``. A sharded checkpoint directory is gathered on this one process
    first (``sharded_state``)."""
    from pelab.lit import LitGPT

    ckpt = read_checkpoint(path, key, verify=True)
    if Path(path).is_dir():
        buffer = io.BytesIO()  # Lightning's loader then does for it what it does for a file
        torch.save({**ckpt, "state_dict": sharded_state(path)["model"]}, buffer)
        buffer.seek(0)
        path = buffer
    return LitGPT.load_from_checkpoint(path, map_location=map_location, weights_only=True)


# (path, size, mtime) of checkpoints already verified in this process: resume=auto verifies its
# pick, validation then checks ckpt_path again; a file of hundreds of GiB is read once.
_VERIFIED: dict[tuple[str, int, int], dict[str, Any]] = {}


def verified(path, key: str = "ckpt_path") -> dict[str, Any]:
    """``read_checkpoint(..., for_resume=True, verify=True)``, once per file and version."""
    path = Path(path)
    stamp_of = path / META_FILE if path.is_dir() else path
    stamp = (str(path.resolve()), *((stamp_of.stat().st_size, stamp_of.stat().st_mtime_ns)
                                    if stamp_of.is_file() else (-1, -1)))
    if stamp not in _VERIFIED:
        ckpt = read_checkpoint(path, key, for_resume=True, verify=True)
        if stamp[1] < 0:
            return ckpt
        _VERIFIED.clear()  # one entry is all a run needs
        _VERIFIED[stamp] = ckpt
    return _VERIFIED[stamp]


def resume_from_run_dir(cfg, output_dir: Path) -> bool:
    """``resume=auto``: set ``ckpt_path`` to the newest intact checkpoint of the run dir and say so
    (True), or start fresh when the dir has none (a first start and a restart are one command).
    A damaged newest checkpoint (truncated, a block corrupted in place, a half-written sharded
    directory) is skipped, saying why, for the next newest; when every one is damaged the run
    refuses to start rather than train from scratch over them."""
    resume = cfg.get("resume")
    if resume is None:
        return False
    if resume != "auto":
        fail("resume", resume, "null or auto")
    if cfg.ckpt_path:
        raise ConfigError(f"resume=auto and ckpt_path={cfg.ckpt_path} both given: resume=auto picks the newest "
                          f"checkpoint of the run dir itself; keep one of them")
    found = checkpoints_newest_first(output_dir)
    if not found:
        print(f"[pelab] resume=auto: no checkpoint in {output_dir}, starting fresh", flush=True)
        return False
    skipped = []
    for path in found:
        try:
            verified(path, "resume=auto")
        except CheckpointError as err:
            print(f"[pelab] resume=auto: skipping {path}: {str(err).removeprefix(f'resume=auto={path} ')}",
                  flush=True)
            skipped.append(path)
            continue
        cfg.ckpt_path = str(path)
        after = f" (the newer {', '.join(p.name for p in skipped)} skipped: see above)" if skipped else ""
        print(f"[pelab] resume=auto: continuing from {path}{after}", flush=True)
        return True
    raise CheckpointError(f"resume=auto: every checkpoint of {output_dir} is damaged "
                          f"({', '.join(str(p) for p in skipped)}; reasons above); refusing to start fresh over "
                          "them: move them away to start a new run there, or pass ckpt_path= to one you repaired")


def _written(path: Path) -> int:
    """When a checkpoint was completed: a sharded directory's meta.pt is written last."""
    return (path / META_FILE if path.is_dir() else path).stat().st_mtime_ns


def checkpoints_newest_first(run_dir) -> list[Path]:
    """The checkpoints of a run dir (``checkpoints/*.ckpt``, files or sharded directories, and the
    ``hpc_ckpt_*.ckpt`` Lightning writes on a SLURM requeue signal), newest first. A sharded
    directory whose save did not finish is left out (and said so): it can only be one that
    was written without ``FSDPStrategy``'s rename."""
    run_dir = Path(run_dir)
    found = []
    for p in [*run_dir.glob("checkpoints/*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")]:
        if p.is_dir() and sharded_complete(p):
            print(f"[pelab] resume=auto: ignoring {p}: {sharded_complete(p)}", flush=True)
        elif p.is_file() or p.is_dir():
            found.append(p)
    return sorted(found, key=_written, reverse=True)


def newest_checkpoint(run_dir) -> Path | None:
    """The most recently completed checkpoint of a run dir, or None."""
    found = checkpoints_newest_first(run_dir)
    return found[0] if found else None
