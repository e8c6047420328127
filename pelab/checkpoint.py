"""Checkpoints that survive faults.

- ``AtomicCheckpointIO``: the Trainer's CheckpointIO plugin (conf/trainer/default.yaml). A save goes
  to a hidden temporary file in the checkpoint's own directory, is fsynced, then ``os.replace``d
  over the final name, so a kill (or power loss) mid-save leaves the previous file intact.
- ``read_checkpoint``: opens a file as a pelab checkpoint (``weights_only=True``, tensors
  memory-mapped, so it is cheap) or raises ``CheckpointError`` naming the file and what is wrong.
- ``check_resume``: the above plus a comparison of the checkpoint's position scheme and model
  shape with the run's config, for ``train.py ckpt_path=...`` before any data or compute.
- ``check_init_from`` / ``init_state``: ``train.py init_from=...``, a run that starts from another
  run's weights (fresh optimizer, schedule, step and data): the file, its architecture against the
  run's, and its weights made to fit the run's scheme, all before any data or compute.
- ``load_lit_gpt``: checked, ``weights_only=True`` ``LitGPT.load_from_checkpoint`` for the scripts.
- ``resume_from_run_dir``: ``resume=auto``, the newest checkpoint of the run dir.
"""

from __future__ import annotations

import os
import pickle
import uuid
import zipfile
from pathlib import Path
from typing import Any

import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.pytorch.plugins.io import TorchCheckpointIO

from pelab.config import ConfigError, fail

EXPECTED = "a Lightning checkpoint written by train.py (RUN_DIR/checkpoints/*.ckpt)"
ZIP_MAGIC = b"PK\x03\x04"  # every torch.save archive (the default format since torch 1.6) starts so


class CheckpointError(ValueError):
    """A checkpoint file that cannot be used, with the file and the reason in the message."""


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
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # make the rename itself durable (POSIX)
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


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


def _reason(error: BaseException) -> str:
    """The line of torch's (long) weights_only refusal that says what was refused."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    for i, line in enumerate(lines):
        if "Unsupported global" in line:
            return line.split(" was not an allowed global")[0].split("GLOBAL ")[-1]
        if line.endswith("WeightsUnpickler error:") and i + 1 < len(lines):
            return lines[i + 1]
    return (lines or [type(error).__name__])[0][:300]


def read_checkpoint(path, key: str = "ckpt_path", for_resume: bool = False) -> dict[str, Any]:
    """Open ``path`` as a pelab checkpoint or raise ``CheckpointError`` saying what is wrong.

    Loaded with ``weights_only=True`` (tensors and plain containers only, no code runs) and
    ``mmap=True`` (tensor bytes are not read), so checking a large checkpoint is quick.
    ``key`` is the option the path came from (``ckpt_path``, ``ckpt``), named in errors.
    """
    path = Path(path)
    where = f"{key}={path}"
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
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        found = f"keys {sorted(map(str, ckpt))[:8]}" if isinstance(ckpt, dict) else f"a {type(ckpt).__name__}"
        raise CheckpointError(f"{where} is a torch file but not a Lightning checkpoint (no 'state_dict'; it holds "
                              f"{found}); expected {EXPECTED}")
    hparams = ckpt.get("hyper_parameters")
    if not isinstance(hparams, dict) or not all(isinstance(hparams.get(k), dict) for k in ("model", "pe")):
        raise CheckpointError(f"{where} is a Lightning checkpoint but not one of pelab's LitGPT (its "
                              f"hyper_parameters lack the 'model' and 'pe' configs); expected {EXPECTED}")
    if for_resume and "optimizer_states" not in ckpt:
        raise CheckpointError(f"{where} holds weights only (saved with save_weights_only=True, no optimizer "
                              "state): it can be evaluated or sampled from, not resumed")
    return ckpt


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


def check_resume(ckpt_path, cfg) -> dict[str, Any]:
    """``train.py ckpt_path=...``: a usable checkpoint whose scheme and model match the run's config.

    Rope and ALiBi have no parameters, so without this a resume under another scheme would load
    "successfully" and silently train a different model.
    """
    from omegaconf import OmegaConf

    ckpt = read_checkpoint(ckpt_path, "ckpt_path", for_resume=True)
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
    run's architecture; every differing key is listed."""
    from omegaconf import OmegaConf

    ckpt = read_checkpoint(path, "init_from")
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


def init_state(ckpt: dict[str, Any], scheme, path) -> dict[str, Any]:
    """The GPT's state dict of an ``init_from`` checkpoint, its scheme tensors made to fit
    ``scheme`` (``resized_state``: a learned table of another length) and checked against it."""
    state = {}
    for key, value in ckpt["state_dict"].items():
        key = key.replace("_orig_mod.", "")  # saved from a torch.compile'd model
        if key.startswith("model."):
            state[key.removeprefix("model.")] = value
    pe = scheme.resized_state({k.removeprefix("pe."): v for k, v in state.items() if k.startswith("pe.")})
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
    wrong = [k for k in own if k in state and own[k].shape != state[k].shape]
    if wrong:
        raise CheckpointError(
            f"init_from={path} does not fit this run's model: "
            + ", ".join(f"{k} {tuple(state[k].shape)} in the checkpoint, {tuple(own[k].shape)} here" for k in wrong)
            + " (a different tokenizer or data.vocab?)")
    gpt.load_state_dict(state)
    print(f"[pelab] init_from: weights of {path} (optimizer, schedule, step and data start fresh)", flush=True)


def load_lit_gpt(path, map_location=None, key: str = "ckpt"):
    """``LitGPT.load_from_checkpoint`` after ``read_checkpoint``, with ``weights_only=True``."""
    from pelab.lit import LitGPT

    read_checkpoint(path, key)
    return LitGPT.load_from_checkpoint(path, map_location=map_location, weights_only=True)


def resume_from_run_dir(cfg, output_dir: Path) -> bool:
    """``resume=auto``: set ``ckpt_path`` to the newest checkpoint of the run dir and say so
    (True), or start fresh when the dir has none (a first start and a restart are one command)."""
    resume = cfg.get("resume")
    if resume is None:
        return False
    if resume != "auto":
        fail("resume", resume, "null or auto")
    if cfg.ckpt_path:
        raise ConfigError(f"resume=auto and ckpt_path={cfg.ckpt_path} both given: resume=auto picks the newest "
                          f"checkpoint of the run dir itself; keep one of them")
    newest = newest_checkpoint(output_dir)
    if newest is None:
        print(f"[pelab] resume=auto: no checkpoint in {output_dir}, starting fresh", flush=True)
        return False
    cfg.ckpt_path = str(newest)
    print(f"[pelab] resume=auto: continuing from {newest}", flush=True)
    return True


def newest_checkpoint(run_dir) -> Path | None:
    """The most recently written checkpoint of a run dir (``checkpoints/*.ckpt``, and the
    ``hpc_ckpt_*.ckpt`` Lightning writes on a SLURM requeue signal), or None."""
    run_dir = Path(run_dir)
    found = [p for p in [*run_dir.glob("checkpoints/*.ckpt"), *run_dir.glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    return max(found, key=lambda p: p.stat().st_mtime_ns) if found else None
