"""``train.py init_from=hf:DIR``: a run that starts from a local Hugging Face transformers folder
(GPT2LMHeadModel, GPTNeoXForCausalLM, LlamaForCausalLM, SmolLM3ForCausalLM) through the weight layouts the exporter
writes (pelab/hf_classes.py), read the other way; docs/export.md.

The folder must hold the run's model: layers, heads, width, key/value heads, norm, MLP, QK-norm,
each layer's window where the class has windows (SmolLM3; the run's ``model.window`` or
``model.window_pattern``) (here, before any data is read) and vocabulary (``load_init_weights``,
once the tokenizer gives the run's). Its positions are kept or replaced:

- the run's ``pe`` is the folder's scheme (learned for GPT-2, rope for GPT-NeoX and Llama): its
  settings must be the folder's (rope's base, rotary_fraction and scaling; learned's table size,
  unless ``pe.extend=interpolate``; SmolLM3's NoPE layers, which the run's ``pe.nope_every`` or
  ``pe.nope_layers`` must give, and no ``pe.global_base``); ``pe.scaling`` may be added, and only
  then may ``model.block_size`` exceed the folder's length (context extension);
- another ``pe``: the folder's position weights (GPT-2's table) are dropped and the run's scheme
  starts from its own initialisation, said in one printed line (recalibrating a pretrained model
  to another scheme).

A folder of pelab's own remote code (PelabForCausalLM, pelab/hf_remote/) holds GPT's weights
under their own names and GPTConfig's fields in config.json: it is read as a pelab checkpoint is
(``init_from=CKPT``): every model key but those ``INIT_FREE`` lists must be the run's, its pe
options may change, another scheme starts fresh.
"""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf

from model.pe import SCHEMES
from model.pe.schedule import LAYER_KEYS, layer_positions, split_schedule
from pelab.checkpoint import INIT_FREE, CheckpointError, refuse_non_finite_init
from pelab.checkpoint.compare import scheme_choice
from pelab.hf_classes import EXPORTERS, ExportError, Folder, to_pelab_state
from pelab.hf_remote import ARCHITECTURE as REMOTE, FORMAT
from pelab.lit import model_config

PREFIX = "hf:"
MATCHED = ("n_layer", "n_head", "n_embd", "n_kv_head", "norm", "mlp", "qk_norm")  # the weights' shapes and block
WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def check_hf_init(spec: str, cfg) -> dict[str, Any]:
    """``init_from=hf:DIR``: the folder ``spec`` checked against the run's config ``cfg`` and read,
    in the form ``check_init_from`` returns a checkpoint: pelab state dict, the folder's length, and
    whether the run's scheme starts fresh."""
    where = f"init_from={spec}"
    path = Path(spec.removeprefix(PREFIX))
    architecture = folder_architecture(path, where)
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f'{where} needs transformers: pip install -e ".[dev]"') from None
    if architecture == REMOTE:
        return check_remote_init(path, cfg, where)
    exporter = EXPORTERS[architecture]
    config = transformers.AutoConfig.from_pretrained(path)
    folder = exporter.read(config)
    if not getattr(config, "tie_word_embeddings", True):
        folder.refusals.append("tie_word_embeddings=false (pelab ties the output head to the embedding)")
    if folder.refusals:
        raise CheckpointError(f"{where} ({architecture}) has {'; '.join(folder.refusals)}: pelab's model cannot "
                              "compute it")
    model = model_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": folder.model["vocab_size"]})
    pe = OmegaConf.to_container(cfg.pe, resolve=True)
    check_model(folder, model, architecture, where)
    same = scheme_choice(pe) == folder.scheme
    if same:
        check_positions(folder, pe, model, where)
    for note in folder.notes:
        print(f"[pelab] {where}: {note}", flush=True)
    if not same:
        print(f"[pelab] {where}: its positions are pe={folder.scheme} ({architecture}), this run's "
              f"pe={scheme_choice(pe)}: {'its position table is dropped and ' if folder.scheme == 'learned' else ''}"
              f"the run's scheme starts from its own initialisation", flush=True)

    hf, info = getattr(transformers, architecture).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    missing = info.get("missing_keys") or []
    if missing:  # transformers would start them at random: never a silent guess
        raise CheckpointError(f"{where} has no weight for {sorted(missing)[0]} (and {len(missing) - 1} more)")
    try:
        state = to_pelab_state(dict(hf.named_parameters()), exporter.layout(model), model, where)
    except ExportError as err:
        raise CheckpointError(str(err)) from None
    if not same:
        state = {k: v for k, v in state.items() if not k.startswith("pe.")}
    refuse_non_finite_init(state, spec)
    return {"state_dict": {f"model.{k}": v.detach() for k, v in state.items()},
            "hyper_parameters": {"model": {"block_size": folder.length}}, "fresh_pe": not same}


def folder_architecture(path: Path, where: str) -> str:
    """The class named by ``path``'s config.json, one pelab imports, in a folder with weights."""
    if not path.is_dir():
        raise CheckpointError(f"{where}: {path} is not a folder (a local Hugging Face transformers folder)")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{where}: {path} has no config.json (not a Hugging Face transformers folder)")
    try:
        architectures = json.loads((path / "config.json").read_text()).get("architectures") or []
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{where}: {path / 'config.json'} is not a JSON object ({err})") from None
    known = ", ".join([*EXPORTERS, REMOTE])
    if len(architectures) != 1 or architectures[0] not in (*EXPORTERS, REMOTE):
        raise CheckpointError(f"{where} is a {', '.join(architectures) or 'folder with no architectures'}; "
                              f"pelab imports {known}")
    if not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        raise CheckpointError(f"{where}: {path} has no weights ({' or '.join(WEIGHT_FILES)})")
    return architectures[0]


def check_remote_init(path: Path, cfg, where: str) -> dict[str, Any]:
    """``check_hf_init`` of a folder of pelab's own remote code: GPT's state dict (the tied head
    back, the padding rows left to the run), checked as ``init_from`` checks a pelab checkpoint."""
    from safetensors.torch import load_file

    config = json.loads((path / "config.json").read_text())
    if config.get("pelab_format") != FORMAT:
        raise CheckpointError(f"{where} is remote code of an older pelab export (config.json has no pelab_format="
                              f"{FORMAT}): pelab reads back only the folders that carry its own model; export the "
                              "checkpoint again with scripts/export_hf.py")
    folder = config["gpt"]
    model = model_config({**OmegaConf.to_container(cfg.model, resolve=True), "vocab_size": folder["vocab_size"]})
    free = {k.removeprefix("model.") for k in INIT_FREE} | {"vocab_size", "pad_vocab_multiple"}
    run = {k: model.kv_heads if k == "n_kv_head" else getattr(model, k) for k in folder if k not in free}
    folder = {**folder, "n_kv_head": folder["n_kv_head"] or folder["n_head"]}
    diffs = [k for k in run if run[k] != folder[k] and not (isinstance(run[k], (list, tuple)) and
                                                           list(run[k]) == folder[k])]
    if diffs:
        raise CheckpointError(
            f"{where} holds another model: the folder ({REMOTE}) has "
            f"{', '.join(f'model.{k}={folder[k]}' for k in diffs)}, this run has "
            f"{', '.join(f'model.{k}={run[k]}' for k in diffs)}; set the run's to the folder's")
    scheme, ours = config["pe"]["scheme"], scheme_choice(OmegaConf.to_container(cfg.pe, resolve=True))
    if scheme != ours:
        print(f"[pelab] {where}: its positions are pe={scheme} ({REMOTE}), this run's pe={ours}: the run's scheme "
              "starts from its own initialisation", flush=True)
    state = {}
    for weights in sorted(path.glob("*.safetensors")):
        state.update({k.removeprefix("model."): v for k, v in load_file(weights).items()})
    state["wte.weight"] = state["lm_head.weight"] = state["wte.weight"][: folder["vocab_size"]]
    if scheme != ours:
        state = {k: v for k, v in state.items() if not k.startswith("pe.")}
    refuse_non_finite_init(state, where.removeprefix("init_from="))
    return {"state_dict": {f"model.{k}": v for k, v in state.items()},
            "hyper_parameters": {"model": {"block_size": folder["block_size"]}}, "fresh_pe": scheme != ours}


# a folder's model key read off the run's GPTConfig where it is not the field itself
RUN_VALUE = {"n_kv_head": lambda m: m.kv_heads, "window_pattern": lambda m: list(m.layer_windows)}


def check_model(folder: Folder, model, architecture: str, where: str) -> None:
    """The folder's model (``MATCHED``, and each layer's window where its class has windows) is the run's."""
    keys = [*MATCHED, *(k for k in folder.model if k not in (*MATCHED, "vocab_size"))]
    run = {key: RUN_VALUE.get(key, lambda m: getattr(m, key))(model) for key in keys}
    diffs = [key for key in keys if folder.model[key] != run[key]]
    if diffs:
        raise CheckpointError(
            f"{where} holds another model: the folder ({architecture}) has "
            f"{', '.join(f'model.{k}={folder.model[k]}' for k in diffs)}, this run has "
            f"{', '.join(f'model.{k}={run[k]}' for k in diffs)}; set the run's to the folder's")


def check_positions(folder: Folder, pe: dict, model, where: str) -> None:
    """A run of the folder's own scheme (``model``: its GPTConfig) keeps its settings and NoPE
    layers (``pe.scaling`` may be added)."""
    block_size = model.block_size
    defaults = {k: p.default for k, p in inspect.signature(SCHEMES[folder.scheme].__init__).parameters.items()}
    run = {k: pe.get(k, defaults.get(k)) for k in folder.pe}
    diffs = [(f"pe.{k}", v, run[k]) for k, v in folder.pe.items() if run[k] != v]
    if folder.nope_layers is not None:
        schedule = split_schedule(pe)[1]
        nope = sorted(layer_positions(model.layer_windows, *(schedule.get(k) for k in LAYER_KEYS))[0])
        if nope != list(folder.nope_layers):
            diffs.append(("NoPE layers", list(folder.nope_layers), f"{nope} (pe.nope_every, pe.nope_layers)"))
    scaling = pe.get("scaling") or {}
    diffs += [(f"pe.scaling.{k}", v, scaling.get(k)) for k, v in (folder.scaling or {}).items() if scaling.get(k) != v]
    if folder.scheme == "learned":
        table = pe.get("max_positions") or block_size
        if table != folder.length and pe.get("extend") is None:
            diffs.append(("pe.max_positions", folder.length, f"{table} (null = model.block_size)"))
    elif block_size > folder.length and scaling.get("kind", "none") == "none":
        diffs.append(("model.block_size", f"<= {folder.length} (max_position_embeddings; longer with pe.scaling)",
                      block_size))
    if diffs:
        raise CheckpointError(
            f"{where} was trained with {', '.join(f'{k}={v}' for k, v, _ in diffs)}, this run has "
            f"{', '.join(f'{k}={r}' for k, _, r in diffs)}; set them to the folder's, or choose another pe "
            f"(its own parameters then start fresh)")
