"""Export a pelab checkpoint to a Hugging Face transformers folder (docs/export.md).

A native class first, where one computes exactly what pelab computes:

- ``learned`` -> GPT-2 (``GPT2LMHeadModel``; exact GELU, ``activation_function="gelu"``);
- ``rope`` -> GPT-NeoX (``GPTNeoXForCausalLM``, sequential residual, half-split rotation,
  ``rotary_pct`` = rotary_fraction, base = ``pe.base``; ``pe.scaling`` linear and llama3 as
  the same ``rope_type``);
- ``rope`` with the Llama block (``model.norm=rmsnorm``, ``model.mlp=swiglu``, GQA) -> Llama
  (``LlamaForCausalLM``); with NoPE layers and/or sliding windows of one size -> SmolLM3
  (``SmolLM3ForCausalLM``).

The classes, their configs and their weight layouts are pelab/hf_classes.py's, read both ways:
here to export, by pelab/hf_import.py to start a run from a folder (``init_from=hf:DIR``).

Every other scheme and option (another scheme, NoPE layers or windows without the Llama block,
windows of several sizes, per-layer RoPE bases, other RoPE scalings, p-RoPE, learned frequencies,
temperatures, other blocks) is written as remote code: the model's
own files and a thin wrapper (pelab/hf_remote/: ``trust_remote_code=True``); a scheme whose
module cannot travel with it is refused before anything is written. The folder is written beside
``out`` under a temporary name and renamed into place, so a failed export leaves nothing
half-written. transformers is imported only when exporting or importing.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from torch import nn

from data.paths import aside_name, overlap, remove_dead_leftovers
from model.config import GPTConfig
from model.gpt import GPT
from model.pe.schedule import LAYER_KEYS, split_schedule
from pelab.checkpoint import load_lit_gpt, replace_dir
from pelab.hf_classes import EXPORTERS, LATER, Exporter, ExportError, to_hf_state
from pelab.hf_remote import ARCHITECTURE, remote_refusal, save_remote

# GPTConfig fields every exporter maps (attention backends all compute the same function);
# any other field must be at its default.
HANDLED_FIELDS = frozenset({"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias",
                            "pad_vocab_multiple", "attention"})
TRAINING_ONLY = frozenset({"randomize_to"})  # pe schedule keys that move training positions only
NOPE_KEYS = LAYER_KEYS[:2]  # the pe schedule keys that make NoPE layers (nope_every, nope_layers)
MODEL_DEFAULTS = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}


class Exported(NamedTuple):
    path: Path
    architecture: str  # the transformers class written
    notes: list[str]  # what the folder lacks, e.g. tokenizer files


def require_transformers():
    try:
        import transformers
    except ImportError:
        raise ExportError('export needs transformers: pip install -e ".[dev]" (or pip install transformers)') from None
    return transformers


# ---------------------------------------------------------------------------------------------
# entry points

def export_hf(ckpt_path, out_dir, overwrite: bool = False) -> Exported:
    """The checkpoint ``ckpt_path`` (train.py's, with its run config beside it) as a transformers
    folder at ``out_dir``."""
    out = check_out(out_dir, overwrite, source=ckpt_path)
    require_transformers()
    lit = load_lit_gpt(ckpt_path, map_location="cpu")
    return export_model(lit.model.eval(), out, pe_config=dict(lit.hparams["pe"]),
                        tokenizer=run_tokenizer(Path(ckpt_path)), overwrite=overwrite)


def export_model(gpt: GPT, out_dir, pe_config: dict | None = None, tokenizer: Any = None,
                 overwrite: bool = False) -> Exported:
    """``gpt`` (built from the ``pe`` config ``pe_config``: the scheme's options, which remote code
    rebuilds it from) with ``tokenizer``'s files (a pelab tokenizer of data/tokenizers.py, or None)
    written to ``out_dir``: as a native class where one is exact, else as remote code."""
    out = check_out(out_dir, overwrite)
    pe_config = pe_config or {}
    native_refusal = unexportable(gpt, pe_config)
    if native_refusal:
        refusal = remote_refusal(gpt, pe_config)
        if refusal:
            raise ExportError(refusal)
    transformers = require_transformers()
    notes: list[str] = []
    if native_refusal is None:
        (hf_model, extra_config), architecture = native_model(transformers, gpt, pe_config)
    else:
        architecture = ARCHITECTURE
        notes.append(f"{native_refusal}: written as remote code ({ARCHITECTURE}); load it with "
                     f"trust_remote_code=True")
    eot = getattr(tokenizer, "eot_token", None)
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = aside_name(out, "tmp")  # named by its pid: whose it is
    try:
        if native_refusal is None:
            save_model(hf_model, tmp, extra_config, eot)
        else:
            save_remote(gpt, pe_config, tmp, eot)
        notes += save_tokenizer(tokenizer, gpt.config.vocab_size, tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return Exported(out, architecture, notes)


def native_model(transformers, gpt: GPT, pe_config: dict) -> tuple[tuple[nn.Module, dict], str]:
    """(``gpt``'s weights in its native class (``exporter_for``), the extra config.json keys), the class."""
    exporter = exporter_for(gpt, pe_config)
    config, extra_config = exporter.config(gpt)
    hf_model = getattr(transformers, exporter.architecture)(config).eval()
    hf_model.load_state_dict(to_hf_state(gpt, exporter.layout(gpt.config), hf_model), strict=False)
    return (hf_model, extra_config), exporter.architecture


def check_out(out_dir, overwrite: bool, source=None) -> Path:
    """``out_dir`` checked before anything is read or written: never the checkpoint ``source``
    (nor a folder holding it or inside it), never a folder holding any run's checkpoints (overwrite
    would replace it whole); an existing non-empty one only with ``overwrite``."""
    out = Path(out_dir)
    how = None if source is None else overlap(out, source)
    if how is not None:
        src = Path(source).resolve()
        run = src.parent.parent if src.parent.name == "checkpoints" else src.parent
        said = {"is": "is", "holds": "contains", "lies inside": "is inside"}[how]
        raise ExportError(f"out={out} {said} the checkpoint ckpt={source} reads, which overwrite would delete; give "
                          f"out= a new folder that holds no checkpoint, e.g. out={run / 'hf'}")
    held = run_files_in(out)
    if held is not None:
        raise ExportError(f"out={out} holds a training run's files ({held}), which overwrite would delete; "
                          f"give out= a new folder, or a previous export's folder, e.g. out={out / 'hf'}")
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        kind = "a non-empty directory" if out.is_dir() else "a file"
        raise ExportError(f"out={out} is {kind}; set overwrite=true to replace it")
    return out


def run_files_in(path: Path) -> Path | None:
    """The first training-run file at or under ``path``: a checkpoint (a ``.ckpt`` file or a
    sharded checkpoint directory, meta.pt + .metadata) or a Hydra run dir's ``.hydra``; else None.
    An export folder holds none of these."""
    if path.is_symlink() or not path.exists():
        return None
    if path.name.endswith(".ckpt") or not path.is_dir():
        return path if path.name.endswith(".ckpt") else None
    for folder, dirs, files in os.walk(path):  # links are not followed: replacing out removes the link only
        names = set(dirs) | set(files)
        hit = next((n for n in sorted(names) if n.endswith(".ckpt") or n == ".hydra"), None)
        if hit is None and {"meta.pt", ".metadata"} <= names:
            return Path(folder)
        if hit is not None:
            return Path(folder) / hit
    return None


def remove_stale_temps(out: Path) -> None:
    """Remove what killed exports to ``out`` left beside it: ``.OUT.<pid>-<id>.tmp`` folders whose
    process is gone (a live one may still be writing its own)."""
    remove_dead_leftovers(out, ("tmp",))


def run_tokenizer(ckpt: Path):
    """The tokenizer of the run (``data.tokenizer`` of its config.yaml), or None without one."""
    from omegaconf import OmegaConf

    from data.tokenizers import get_tokenizer

    run_config = ckpt.parent / "config.yaml"
    if not run_config.is_file():
        return None
    return get_tokenizer(str(OmegaConf.load(run_config).data.tokenizer))


# ---------------------------------------------------------------------------------------------
# what can be exported

def unexportable(gpt: GPT, pe_config: dict) -> str | None:
    """Why ``gpt`` has no exact native export (one line), or None."""
    exporter = exporter_for(gpt, pe_config)
    if exporter is None:
        return scheme_refusal(gpt.pe.name)
    refusal = exporter.refusal(gpt)
    if refusal:
        return refusal
    unmapped = unmapped_options(gpt, pe_config, exporter)
    return unmapped[0] if unmapped else None


def unmapped_options(gpt: GPT, pe_config: dict, exporter: Exporter) -> list[str]:
    """What ``gpt`` sets that ``exporter``'s class does not map, one line each (model options,
    then pe schedule options, then the per-layer plan they built)."""
    handled = HANDLED_FIELDS | set(exporter.block) | set(exporter.options)
    lines = [f"model.{field}={getattr(gpt.config, field)!r} {LATER} (only the default {default!r} is)"
             for field, default in MODEL_DEFAULTS.items()
             if field not in handled and getattr(gpt.config, field) != default]
    _, schedule = split_schedule(pe_config)
    lines += [f"pe.{key}={value!r} {LATER}" for key, value in schedule.items()
              if value is not None and key not in TRAINING_ONLY | set(exporter.schedule)]
    if gpt.nope_layers and not set(NOPE_KEYS) & set(exporter.schedule):
        lines.append(f"NoPE layers {sorted(gpt.nope_layers)} (pe.nope_every) {LATER}")
    if any(r is not None for r in getattr(gpt, "layer_rope", ())) and "global_base" not in exporter.schedule:
        lines.append(f"a layer's own RoPE (pe.global_base, global_keep_fraction, scaling_layers) {LATER}")
    return lines


def exporter_for(gpt: GPT, pe_config: dict | None = None) -> Exporter | None:
    """The class for ``gpt``'s scheme and block: among those whose block options it has, the most
    specific block (Llama's over GPT-NeoX's plain one), then the class that maps the most of what it
    sets (SmolLM3 for NoPE layers and windows), then the first registered (the plainest: Llama). A
    class that cannot hold it exactly then names what it lacks."""
    fitting = [e for e in EXPORTERS.values()
               if e.scheme == gpt.pe.name and all(getattr(gpt.config, k) == v for k, v in e.block.items())]
    return min(fitting, key=lambda e: (-len(e.block), len(unmapped_options(gpt, pe_config or {}, e))), default=None)


def scheme_refusal(name: str) -> str | None:
    if any(e.scheme == name for e in EXPORTERS.values()):
        return None
    native = [" ".join([e.scheme, *(f"model.{k}={v}" for k, v in e.block.items())]) + f" -> {e.architecture}"
              for e in EXPORTERS.values()]
    return f"pe={name} {LATER} (native exports: {', '.join(native)})"




# ---------------------------------------------------------------------------------------------
# files

def save_model(hf_model: nn.Module, folder: Path, extra_config: dict, eot: int | None) -> None:
    """safetensors weights (tied head written once), config.json with ``extra_config`` added,
    generation_config.json."""
    from transformers import GenerationConfig

    hf_model.config.bos_token_id = hf_model.config.eos_token_id = eot
    hf_model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=eot, eos_token_id=eot).save_pretrained(folder)
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(extra_config)
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def save_tokenizer(tokenizer: Any, vocab_size: int, folder: Path) -> list[str]:
    """tokenizer.json + its config for a tiktoken-based pelab tokenizer (gpt2, bytes, a ranks
    file); a note for anything else."""
    encoding = getattr(tokenizer, "encoding", None)
    if encoding is None:
        if tokenizer is None:
            return ["no tokenizer files written: no run config (config.yaml) beside the checkpoint names data.tokenizer"]
        return [f"no tokenizer files written: data.tokenizer={tokenizer.name} (a tokenizer.json) has no export yet"]
    if encoding.n_vocab > vocab_size:
        raise ExportError(f"data.tokenizer={tokenizer.name} has {encoding.n_vocab} ids but model.vocab_size={vocab_size}")
    from transformers import PreTrainedTokenizerFast

    backend, eos = byte_level_bpe(encoding, tokenizer.eot_token)
    hf_tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                           **({"eos_token": eos, "bos_token": eos} if eos else {}))
    hf_tokenizer.save_pretrained(folder)
    return []


def byte_level_bpe(encoding, eot: int | None):
    """A ``tokenizers`` byte-level BPE giving ``encoding``'s ids: its ranks as the vocabulary, the
    merges read off the ranks (each token's splits into two tokens, in rank order), its split
    pattern and its special tokens. Returns it and the end-of-text token's text when that is a
    special token (bytes' end-of-text is an ordinary byte: no special token)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    to_text = byte_text()
    ranks: dict[bytes, int] = encoding._mergeable_ranks  # tiktoken keeps the ranks here
    vocab = {to_text(token): rank for token, rank in ranks.items()}
    merges = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        merges += [(rank, ranks[a], ranks[b], to_text(a), to_text(b)) for a, b in pairs]
    merges.sort()
    backend = Tokenizer(models.BPE(vocab, [(a, b) for *_, a, b in merges]))
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(encoding._pat_str), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    specials = sorted(encoding._special_tokens.items(), key=lambda kv: kv[1])
    backend.add_special_tokens([AddedToken(text, special=True, normalized=False) for text, _ in specials])
    for text, i in specials:
        if backend.token_to_id(text) != i:  # added tokens take the next ids: they must follow the ranks
            raise ExportError(f"special token {text!r} has id {i}, not the {backend.token_to_id(text)} after the ranks")
    eos = next((text for text, i in specials if i == eot), None)
    return backend, eos


def byte_text() -> Callable[[bytes], str]:
    """GPT-2's reversible bytes -> printable text map, the alphabet of byte-level BPE."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return lambda token: "".join(table[b] for b in token)
