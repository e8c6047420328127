"""What the probes share (extrapolation, tasks, the attention probe, streaming): lengths as
multiples of the training length, the positions a model sees at evaluation, the autocast
context of an evaluation precision, eval mode, windows of held-out text or task samples,
sharding over ranks, why a row is not measured, and the rows' CSV I/O. Plain Python and
PyTorch: nothing here knows the harness.
"""

from __future__ import annotations

import contextlib
import csv
import math
from dataclasses import asdict, fields
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from model.config import require
from model.pe.rope_scaling import ROPE_SCALINGS, RopeScaling, default_factor
from model.pe.schedule import random_positions

#: Positions the model sees at evaluation: 0..T-1, or (a ``pe.randomize_to=N`` model) a sorted
#: random subset of [0, N) per sequence as in training (Ruoss et al. 2023), seeded per window.
POSITION_MODES = ("sequential", "randomized")


class LengthSweepOptions:
    """What the evaluation configs share: lengths as multiples of the training length plus
    absolute ones, and construction from a config dict that refuses unknown keys."""

    section: ClassVar[str]
    multipliers: Sequence[float]
    lengths: Sequence[int]

    def eval_lengths(self, train_length: int) -> list[int]:
        return sorted({int(round(m * train_length)) for m in self.multipliers} | {int(n) for n in self.lengths})

    @classmethod
    def from_dict(cls, values: dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known - {"enabled"})
        if unknown:
            raise ValueError(f"unknown {cls.section} option(s) {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**{k: v for k, v in values.items() if k in known})


def eval_positions(mode: str, starts: Sequence[int], length: int, randomize_to: int | None, seed: int,
                   device: torch.device) -> torch.Tensor | None:
    """None (0..T-1) for ``sequential``; for ``randomized`` (len(starts), length) positions, each
    row a sorted random subset of [0, randomize_to) drawn from (seed, length, window start), so
    the draws do not depend on batching or on the rank that scores the window."""
    if mode == "sequential":
        return None
    rows = []
    for s in starts:
        generator = torch.Generator().manual_seed(hash((int(seed), int(length), int(s))) & (2**63 - 1))
        rows.append(random_positions(1, length, randomize_to, generator))
    return torch.cat(rows).to(device)


def why_not_randomized(positions: str, randomize_to: int | None, length: int) -> str | None:
    """The status of a row whose randomized positions cannot be drawn, or None when they can."""
    if positions != "randomized":
        return None
    if randomize_to is None:
        return "not applicable: eval.positions=randomized needs a model trained with pe.randomize_to"
    if length > randomize_to:
        return f"not applicable: {length} randomized positions do not fit in [0, pe.randomize_to={randomize_to})"
    return None


def rope_scalings(given: Sequence[str | None], factor: float | None, key: str) -> list[str | None]:
    """The evaluation-time RoPE scalings a probe scores each length with (None: the model as it
    trained), checked with ``factor`` (None: eval length / train length); ``key`` is the config
    section the values came from."""
    kinds = [None if s in (None, "none", "None", "") else s for s in given] or [None]
    require(all(s is None or s in ROPE_SCALINGS for s in kinds), f"{key}.rope_scaling", list(given),
            f"a list of null, {', '.join(ROPE_SCALINGS)}")
    require(factor is None or math.isfinite(factor) and factor >= 1, f"{key}.rope_scaling_factor", factor,
            "null (eval length / train length) or a finite number >= 1")
    return kinds


def why_not_scaled(pe, kind: str) -> str | None:
    """The status of a row whose evaluation-time scaling ``kind`` ("none" or a kind) cannot apply
    to the scheme, or None when it can."""
    if kind == "none":
        return None
    if kind not in pe.scaling_kinds:
        return (f"not applicable: rope_scaling={kind} does not apply to pe={pe.name} "
                f"(it takes {', '.join(pe.scaling_kinds) or 'none'})")
    if pe.scaling is not None:  # model.pe.scaling.scaled refuses it too
        return f"not applicable: pe was trained with pe.scaling.kind={pe.scaling.kind}, no scaling on top"
    return None


def scaled_name(scheme: str, kind: str) -> str:
    """A line's name: the scheme, + its evaluation-time scaling when it has one (``rope+ntk``)."""
    return scheme if kind == "none" else f"{scheme}+{kind}"


def scaling_at(kind: str, factor: float | None, eval_length: int, train_length: int) -> RopeScaling | None:
    """The RopeScaling of one row ("none": None); ``factor`` None: the kind's default for the
    length (eval length / train length; 1 for dynamic_ntk, which follows the length itself)."""
    if kind == "none":
        return None
    return RopeScaling(kind, factor or default_factor(kind, eval_length, train_length), train_length)


def autocast(precision: str, device: torch.device):
    """The autocast context an evaluation at ``precision`` (a trainer.precision value) runs under."""
    if "bf16" in str(precision):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    if str(precision).startswith("16"):
        return torch.autocast(device.type, dtype=torch.float16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def eval_mode(module: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode; restore each one's own ``training`` flag after."""
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, flag in flags:
            m.training = flag


def probe_windows(tokens: np.ndarray | None = None, task=None, seed: int = 0) -> Callable[[int, int], Tensor | str]:
    """``windows_of(length, samples)`` of a probe: evenly spread windows of held-out ``tokens``, or
    the ``task``'s test samples (depth 0.5 for retrieval tasks); a string says why there are none."""

    def of(length: int, samples: int) -> Tensor | str:
        if task is not None:
            if length < task.min_length:
                return f"skipped: a {task.name} sample needs at least {task.min_length} tokens"
            depth = 0.5 if task.has_depth else None
            return torch.stack([torch.from_numpy(task.sample(length, i, seed, "test", 0, depth)[0])
                                for i in range(samples)])
        if len(tokens) < length:
            return f"skipped: held-out text has {len(tokens)} tokens, fewer than one window of {length}"
        last = len(tokens) - length
        starts = [last * i // max(samples - 1, 1) for i in range(samples)] if samples > 1 else [0]
        return torch.from_numpy(np.stack([tokens[s : s + length] for s in starts]).astype(np.int64))

    return of


def shard_of(distributed: bool) -> tuple[int, int]:
    """(rank, world size) of this process when ``distributed`` and a process group is up, else (0, 1)."""
    import torch.distributed as dist

    if distributed and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def distributed_sum(values: list[float]) -> list[float]:
    """Element-wise sum over the ranks of the process group, in float64."""
    import torch.distributed as dist

    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    summed = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(summed)
    return summed.tolist()


def write_rows(rows: Sequence, path: Path, row_type: type) -> Path:
    """Result rows (dataclass instances of ``row_type``) as a CSV with one column per field."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[f.name for f in fields(row_type)])
        writer.writeheader()
        for row in rows:
            writer.writerow(asdict(row))
    return path


def read_rows(path: Path, row_type: type) -> list:
    """The rows ``write_rows`` wrote, fields cast back to their declared int/float/str types
    (annotations as strings, under ``from __future__ import annotations``, or as the classes)."""
    types = {f.name: getattr(f.type, "__name__", f.type) for f in fields(row_type)}
    casts = {"int": int, "float": float, "str": str}
    with open(path, newline="") as f:
        return [row_type(**{k: casts[types[k]](v) for k, v in r.items() if k in types}) for r in csv.DictReader(f)]
