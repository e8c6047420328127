"""``train.py init_from=...``: a run that starts from another run's weights (fresh optimizer,
schedule, step and data): the file, its architecture against the run's, and its weights made to
fit the run's scheme, all before any data or compute."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pelab.checkpoint.compare import config_mismatches, describe
from pelab.checkpoint.errors import CheckpointError
from pelab.checkpoint.read import read_checkpoint
from pelab.checkpoint.sharded import sharded_state
from pelab.checkpoint.tokenizer import check_tokenizer


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
            f"{', '.join(describe(k, s) for k, s, _ in diffs)}, this run has "
            f"{', '.join(describe(k, r) for k, _, r in diffs)}; a run started from it may change only "
            f"{', '.join(INIT_FREE)}, the pe options (not the scheme), optim and data")
    spec = OmegaConf.select(cfg, "data.tokenizer")
    if spec is not None:  # another tokenizer: its token embeddings would be read as other tokens
        check_tokenizer(ckpt, f"init_from={path}", spec, "use the data.tokenizer it was trained with")
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
