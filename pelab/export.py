"""Export a pelab checkpoint to a Hugging Face transformers folder, with a native class where
one computes exactly what pelab computes (docs/export.md):

- ``learned`` -> GPT-2 (``GPT2LMHeadModel``; exact GELU, ``activation_function="gelu"``);
- ``rope`` -> GPT-NeoX (``GPTNeoXForCausalLM``, sequential residual, half-split rotation,
  ``rotary_pct`` = rotary_fraction, base = ``pe.base``; ``pe.scaling`` linear and llama3 as
  the same ``rope_type``).

Everything else (another scheme, NoPE layers, randomized positions, other RoPE scalings, p-RoPE,
learned frequencies, a non-default model option) is refused before anything is written. The
folder is written beside ``out`` under a temporary name and renamed into place, so a failed
export leaves nothing half-written. transformers is imported only here, when exporting.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.gpt import GPT
from model.pe.schedule import split_schedule
from model.pe import SCHEMES
from pelab.checkpoint import load_lit_gpt, read_checkpoint, replace_dir

# GPTConfig fields every exporter maps (attention backends all compute the same function);
# any other field must be at its default.
HANDLED_FIELDS = frozenset({"vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias",
                            "pad_vocab_multiple", "attention"})
LATER = "is not exportable to a native transformers class yet"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which pelab's blocks use


class ExportError(ValueError):
    """An export refused, in one line naming the checkpoint's option and why."""


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
    out = check_out(out_dir, overwrite)
    require_transformers()
    pe_config = read_checkpoint(ckpt_path, key="ckpt")["hyper_parameters"]["pe"]  # tensors not read (mmap)
    refusal = scheme_refusal(scheme_name(pe_config))
    if refusal:  # before the weights load
        raise ExportError(refusal)
    lit = load_lit_gpt(ckpt_path, map_location="cpu")
    return export_model(lit.model.eval(), out, pe_config=dict(lit.hparams["pe"]),
                        tokenizer=run_tokenizer(Path(ckpt_path)), overwrite=overwrite)


def export_model(gpt: GPT, out_dir, pe_config: dict | None = None, tokenizer: Any = None,
                 overwrite: bool = False) -> Exported:
    """``gpt`` (built from the ``pe`` config ``pe_config``) with ``tokenizer``'s files (a pelab
    tokenizer of data/tokenizers.py, or None) written to ``out_dir``."""
    out = check_out(out_dir, overwrite)
    refusal = unexportable(gpt, pe_config or {})
    if refusal:
        raise ExportError(refusal)
    require_transformers()
    exporter = EXPORTERS[gpt.pe.name]
    hf_model, extra_config = exporter.build(gpt)
    eot = getattr(tokenizer, "eot_token", None)
    notes: list[str] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{uuid.uuid4().hex[:8]}.tmp"
    try:
        save_model(hf_model, tmp, extra_config, eot)
        notes += save_tokenizer(tokenizer, gpt.config.vocab_size, tmp)
        replace_dir(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return Exported(out, type(hf_model).__name__, notes)


def check_out(out_dir, overwrite: bool) -> Path:
    out = Path(out_dir)
    if out.exists() and not overwrite and (not out.is_dir() or any(out.iterdir())):
        kind = "a non-empty directory" if out.is_dir() else "a file"
        raise ExportError(f"out={out} is {kind}; set overwrite=true to replace it")
    return out


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
    name = gpt.pe.name
    if name not in EXPORTERS:
        return scheme_refusal(name)
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}
    for field, default in defaults.items():
        value = getattr(gpt.config, field)
        if field not in HANDLED_FIELDS and value != default:
            return f"model.{field}={value!r} {LATER} (only the default {default!r} is)"
    _, schedule = split_schedule(pe_config)
    for key, value in schedule.items():
        if value is not None:
            return f"pe.{key}={value!r} {LATER}"
    if gpt.nope_layers:
        return f"NoPE layers {sorted(gpt.nope_layers)} (pe.nope_every) {LATER}"
    return EXPORTERS[name].refusal(gpt)


def scheme_refusal(name: str) -> str | None:
    if name in EXPORTERS:
        return None
    native = ", ".join(f"{scheme} -> {e.architecture}" for scheme, e in EXPORTERS.items())
    return f"pe={name} {LATER} (native exports: {native})"


def scheme_name(pe_config: dict) -> str:
    """The registered name of a ``pe`` config's class (its ``_target_``)."""
    by_target = {f"{cls.__module__}.{cls.__qualname__}": name for name, cls in SCHEMES.items()}
    return by_target.get(pe_config.get("_target_"), str(pe_config.get("_target_")))


@dataclasses.dataclass(frozen=True)
class Exporter:
    architecture: str
    build: Callable[[GPT], tuple[nn.Module, dict]]  # the HF model with pelab's weights, extra config keys
    refusal: Callable[[GPT], str | None] = lambda gpt: None  # a scheme option that is not exact


# ---------------------------------------------------------------------------------------------
# weights

@torch.no_grad()
def put(param: Tensor, value: Tensor | None) -> None:
    # None: pelab has no bias there; a zero bias computes the same function
    param.copy_(torch.zeros_like(param) if value is None else value.detach().to(param.dtype))


def put_linear(dst: nn.Module, src: nn.Linear, conv1d: bool = False) -> None:
    """nn.Linear ``src`` into ``dst`` (GPT-2's Conv1D keeps its weight as (in, out))."""
    put(dst.weight, src.weight.t() if conv1d else src.weight)
    if dst.bias is not None:  # GPT-NeoX's attention has biases only with attention_bias
        put(dst.bias, src.bias)


def put_norm(dst: nn.LayerNorm, src: nn.LayerNorm) -> None:
    put(dst.weight, src.weight)
    put(dst.bias, src.bias)


def token_table(gpt: GPT) -> Tensor:
    """The embedding rows of real tokens: padded rows are sliced off the logits in pelab too."""
    return gpt.wte.weight[: gpt.config.vocab_size]


def common_config(c: GPTConfig) -> dict:
    # end-of-text ids are the tokenizer's: set when saving (save_model)
    return dict(vocab_size=c.vocab_size, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


# ---------------------------------------------------------------------------------------------
# learned -> GPT-2

def gpt2(gpt: GPT) -> tuple[nn.Module, dict]:
    from transformers import GPT2Config, GPT2LMHeadModel

    c = gpt.config
    config = GPT2Config(
        **common_config(c), n_positions=gpt.pe.max_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        activation_function="gelu",  # exact erf GELU, nn.GELU(); "gelu_new" is the tanh form
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=LAYER_NORM_EPS)
    hf = GPT2LMHeadModel(config).eval()
    body = hf.transformer
    put(body.wte.weight, token_table(gpt))
    put(body.wpe.weight, gpt.pe.wpe.weight)
    for block, layer in zip(gpt.blocks, body.h):
        put_norm(layer.ln_1, block.ln_1)
        put_linear(layer.attn.c_attn, block.attn.c_attn, conv1d=True)
        put_linear(layer.attn.c_proj, block.attn.c_proj, conv1d=True)
        put_norm(layer.ln_2, block.ln_2)
        put_linear(layer.mlp.c_fc, block.mlp.c_fc, conv1d=True)
        put_linear(layer.mlp.c_proj, block.mlp.c_proj, conv1d=True)
    put_norm(body.ln_f, gpt.ln_f)
    return hf, {}


# ---------------------------------------------------------------------------------------------
# rope -> GPT-NeoX

def rotary_pct(gpt: GPT) -> float:
    return gpt.pe.rotary_dim / gpt.config.head_dim


def rope_refusal(gpt: GPT) -> str | None:
    pe = gpt.pe
    if pe.keep is not None:
        return f"pe.keep_fraction={pe.keep_fraction} (p-RoPE) {LATER}"
    if pe.log_freq_scale is not None:
        return f"pe.learnable_freq=true {LATER}"
    if pe.scaling is not None and pe.scaling.kind not in HF_ROPE_TYPES:
        return (f"pe.scaling kind {pe.scaling.kind} {LATER} (exported: "
                f"{', '.join(HF_ROPE_TYPES)}, each proven by a logits-equality test)")
    if int(gpt.config.head_dim * rotary_pct(gpt)) != pe.rotary_dim:  # GPT-NeoX's own rounding of rotary_pct
        return f"a rotary dim of {pe.rotary_dim} of head_dim={gpt.config.head_dim} {LATER}"
    return None


def hf_rope_type(scaling) -> dict:
    """pelab's RoPE scaling as the rope_type keys of transformers' rope_parameters."""
    if scaling is None:
        return {"rope_type": "default"}
    keys = {"rope_type": scaling.kind, "factor": scaling.factor}
    if scaling.kind == "llama3":
        keys.update(low_freq_factor=scaling.low_freq_factor, high_freq_factor=scaling.high_freq_factor,
                    original_max_position_embeddings=scaling.original_length)
    return keys


# pe.scaling kinds that transformers' rope_type computes exactly as pelab (static frequencies)
HF_ROPE_TYPES = ("linear", "llama3")


def per_head_qkv(x: Tensor, n_head: int) -> Tensor:
    """pelab's c_attn rows [q | k | v] (heads inside each) as GPT-NeoX's [q_h, k_h, v_h] per head."""
    return x.reshape(3, n_head, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def gpt_neox(gpt: GPT) -> tuple[nn.Module, dict]:
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    c, pe = gpt.config, gpt.pe
    pct, base = rotary_pct(gpt), float(pe.base)
    scaling = hf_rope_type(pe.scaling)
    rope = {**scaling, "rope_theta": base, "partial_rotary_factor": pct}
    config = GPTNeoXConfig(
        **common_config(c), hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        intermediate_size=4 * c.n_embd, hidden_act="gelu", rope_parameters=dict(rope),
        max_position_embeddings=c.block_size, layer_norm_eps=LAYER_NORM_EPS, use_parallel_residual=False,
        attention_bias=c.bias, attention_dropout=c.dropout, hidden_dropout=c.dropout)
    hf = GPTNeoXForCausalLM(config).eval()
    body = hf.gpt_neox
    put(body.embed_in.weight, token_table(gpt))
    for block, layer in zip(gpt.blocks, body.layers):
        put_norm(layer.input_layernorm, block.ln_1)
        qkv = layer.attention.query_key_value
        put(qkv.weight, per_head_qkv(block.attn.c_attn.weight, c.n_head))
        if qkv.bias is not None:
            put(qkv.bias, None if block.attn.c_attn.bias is None else per_head_qkv(block.attn.c_attn.bias, c.n_head))
        put_linear(layer.attention.dense, block.attn.c_proj)
        put_norm(layer.post_attention_layernorm, block.ln_2)
        put_linear(layer.mlp.dense_h_to_4h, block.mlp.c_fc)
        put_linear(layer.mlp.dense_4h_to_h, block.mlp.c_proj)
    put_norm(body.final_layer_norm, gpt.ln_f)
    # both spellings: the current rope_parameters and the older keys, so any reader finds the base
    legacy_scaling = None if pe.scaling is None else {"type": scaling["rope_type"], **scaling}
    return hf, {"rope_parameters": rope, "rope_theta": base, "rotary_emb_base": base, "rotary_pct": pct,
                "partial_rotary_factor": pct, "rope_scaling": legacy_scaling}


# The schemes with a native export: a new one is one line here.
EXPORTERS: dict[str, Exporter] = {
    "learned": Exporter("GPT2LMHeadModel", gpt2),
    "rope": Exporter("GPTNeoXForCausalLM", gpt_neox, rope_refusal),
}


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
