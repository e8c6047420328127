"""A checkpoint made whole for the scripts: ``LitGPT`` loaded checked (``load_lit_gpt``) and a
sharded directory written as one full file (``consolidate``)."""

from __future__ import annotations

import io
from pathlib import Path

import torch

from pelab.checkpoint.atomic import atomic_torch_save
from pelab.checkpoint.read import read_checkpoint
from pelab.checkpoint.sharded import sharded_state
from pelab.checkpoint.tokenizer import check_tokenizer


def consolidate(path, out) -> Path:
    """A sharded checkpoint directory as one full checkpoint file (weights and the run's
    hyper-parameters, no optimizer state): what ``scripts/*.py ckpt=`` and ``init_from`` read."""
    ckpt = {**read_checkpoint(path, "ckpt"), "state_dict": sharded_state(path)["model"]}
    atomic_torch_save(ckpt, Path(out))
    return Path(out)


def load_lit_gpt(path, map_location=None, key: str = "ckpt"):
    """``LitGPT.load_from_checkpoint`` after ``read_checkpoint`` (every record's CRC checked) and
    ``check_tokenizer`` (its tokenizer unchanged), with ``weights_only=True``. A sharded checkpoint
    directory is gathered on this one process first (``sharded_state``)."""
    from pelab.lit import LitGPT

    ckpt = read_checkpoint(path, key, verify=True)
    check_tokenizer(ckpt, f"{key}={path}")  # the tokenizer file it names, changed since: refused
    if Path(path).is_dir():
        buffer = io.BytesIO()  # Lightning's loader then does for it what it does for a file
        torch.save({**ckpt, "state_dict": sharded_state(path)["model"]}, buffer)
        buffer.seek(0)
        path = buffer
    return LitGPT.load_from_checkpoint(path, map_location=map_location, weights_only=True)
