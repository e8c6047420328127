"""Export a pelab checkpoint to a Hugging Face transformers folder, with a native class where
one computes exactly what pelab computes (docs/export.md):

- ``learned`` -> GPT-2 (``GPT2LMHeadModel``; exact GELU, ``activation_function="gelu"``);
- ``rope`` -> GPT-NeoX (``GPTNeoXForCausalLM``, sequential residual, half-split rotation,
  ``rotary_pct`` = rotary_fraction, base = ``pe.base``; ``pe.scaling`` linear and llama3 as
  the same ``rope_type``);
- ``rope`` with the Llama block (``model.norm=rmsnorm``, ``model.mlp=swiglu``, GQA) -> Llama
  (``LlamaForCausalLM``).

Each class has one weight layout (``Rule``s), read both ways: here to export, and by
pelab/hf_import.py to start a run from a folder (``init_from=hf:DIR``).

Everything else (another scheme, NoPE layers, randomized positions, other RoPE scalings, p-RoPE,
learned frequencies, a non-default model option) is refused before anything is written. The
folder is written beside ``out`` under a temporary name and renamed into place, so a failed
export leaves nothing half-written. transformers is imported only when exporting or importing.
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
from model.gpt import GPT, RMS_EPS, swiglu_hidden
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
    transformers = require_transformers()
    exporter = exporter_for(gpt)
    config, extra_config = exporter.config(gpt)
    hf_model = getattr(transformers, exporter.architecture)(config).eval()
    hf_model.load_state_dict(to_hf_state(gpt, exporter.layout(gpt.config), hf_model), strict=False)
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
    exporter = exporter_for(gpt)
    if exporter is None:
        return scheme_refusal(gpt.pe.name)
    refusal = exporter.refusal(gpt)
    if refusal:
        return refusal
    defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig) if f.default is not dataclasses.MISSING}
    handled = HANDLED_FIELDS | set(exporter.block) | set(exporter.options)
    for field, default in defaults.items():
        value = getattr(gpt.config, field)
        if field not in handled and value != default:
            return f"model.{field}={value!r} {LATER} (only the default {default!r} is)"
    _, schedule = split_schedule(pe_config)
    for key, value in schedule.items():
        if value is not None:
            return f"pe.{key}={value!r} {LATER}"
    if gpt.nope_layers:
        return f"NoPE layers {sorted(gpt.nope_layers)} (pe.nope_every) {LATER}"
    return None


def exporter_for(gpt: GPT) -> Exporter | None:
    """The class for ``gpt``'s scheme and block: the one whose block options it has (Llama's),
    else the scheme's plain-block class (which then names the option it lacks)."""
    candidates = [e for e in EXPORTERS.values() if e.scheme == gpt.pe.name]
    fitting = [e for e in candidates if all(getattr(gpt.config, k) == v for k, v in e.block.items())]
    return max(fitting, key=lambda e: len(e.block), default=None)


def scheme_refusal(name: str) -> str | None:
    if any(e.scheme == name for e in EXPORTERS.values()):
        return None
    native = [" ".join([e.scheme, *(f"model.{k}={v}" for k, v in e.block.items())]) + f" -> {e.architecture}"
              for e in EXPORTERS.values()]
    return f"pe={name} {LATER} (native exports: {', '.join(native)})"


def scheme_name(pe_config: dict) -> str:
    """The registered name of a ``pe`` config's class (its ``_target_``)."""
    by_target = {f"{cls.__module__}.{cls.__qualname__}": name for name, cls in SCHEMES.items()}
    return by_target.get(pe_config.get("_target_"), str(pe_config.get("_target_")))


@dataclasses.dataclass(frozen=True)
class Exporter:
    architecture: str  # the transformers class
    scheme: str  # pelab's pe it holds
    config: Callable[[GPT], tuple[Any, dict]]  # its config for a GPT, and extra config.json keys
    layout: Callable[[GPTConfig], list["Rule"]]  # where each weight goes, both ways
    read: Callable[[Any], "Folder"]  # import: a config of the class in pelab's terms
    block: dict = dataclasses.field(default_factory=dict)  # the non-default model options it is made of
    options: tuple[str, ...] = ()  # model options it maps at any value
    refusal: Callable[[GPT], str | None] = lambda gpt: None  # an option that is not exact


# ---------------------------------------------------------------------------------------------
# weight layouts: one table per class, read in both directions (export here, import in
# pelab/hf_import.py)

class Codec(NamedTuple):
    """How one pelab tensor becomes the class's tensors (``to_hf``) and back (``to_pelab``)."""

    to_hf: Callable[[Tensor, GPTConfig], list[Tensor]]
    to_pelab: Callable[[list[Tensor], GPTConfig], Tensor]


class Rule(NamedTuple):
    pelab: str  # a key of GPT.state_dict()
    hf: tuple[str, ...]  # the class's state-dict keys it is stored as
    codec: Codec


def per_head_qkv(x: Tensor, n_head: int) -> Tensor:
    """pelab's c_attn rows [q | k | v] (heads inside each) as GPT-NeoX's [q_h, k_h, v_h] per head."""
    return x.reshape(3, n_head, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def from_per_head_qkv(x: Tensor, n_head: int) -> Tensor:
    return x.reshape(n_head, 3, -1, *x.shape[1:]).transpose(0, 1).reshape(x.shape)


def qkv_sizes(c: GPTConfig) -> tuple[int, int, int]:
    return c.n_embd, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim


SAME = Codec(lambda x, c: [x], lambda xs, c: xs[0])
CONV1D = Codec(lambda x, c: [x.t()], lambda xs, c: xs[0].t())  # GPT-2's Conv1D keeps (in, out)
# the padded embedding rows are sliced off pelab's logits too; on import the run keeps its own
TOKENS = Codec(lambda x, c: [x[: c.vocab_size]], lambda xs, c: xs[0])
NEOX_QKV = Codec(lambda x, c: [per_head_qkv(x, c.n_head)], lambda xs, c: from_per_head_qkv(xs[0], c.n_head))
SPLIT_QKV = Codec(lambda x, c: list(x.split(qkv_sizes(c))), lambda xs, c: torch.cat(xs))
SWIGLU = Codec(lambda x, c: list(x.chunk(2)), lambda xs, c: torch.cat(xs))  # c_fc's rows are [gate; up]


def module(pelab: str, hf: str | tuple[str, ...], weight: Codec = SAME, bias: Codec | None = SAME) -> list[Rule]:
    """The weight (and bias) rules of a Linear or norm: ``hf`` names the class's module(s)."""
    names = (hf,) if isinstance(hf, str) else hf
    rules = [Rule(f"{pelab}.weight", tuple(f"{n}.weight" for n in names), weight)]
    if bias is not None:
        rules.append(Rule(f"{pelab}.bias", tuple(f"{n}.bias" for n in names), bias))
    return rules


def is_bias(rule: Rule) -> bool:
    # pelab has every bias only with model.bias: without, a zero bias in the class computes the same
    return rule.pelab.endswith(".bias")


@torch.no_grad()
def to_hf_state(gpt: GPT, rules: list[Rule], hf_model: nn.Module) -> dict[str, Tensor]:
    """``gpt``'s weights as ``hf_model``'s state dict: every parameter of the class (the tied head
    once) comes from one rule."""
    own, params = gpt.state_dict(), dict(hf_model.named_parameters())
    state = {}
    for rule in rules:
        values = (rule.codec.to_hf(own[rule.pelab], gpt.config) if rule.pelab in own
                  else [torch.zeros_like(params[key]) if key in params else None for key in rule.hf])
        state.update((key, value.detach().clone()) for key, value in zip(rule.hf, values) if key in params)
    if set(params) - set(state):  # a layout that misses a parameter of the class: a bug, never a random weight
        raise ExportError(f"{type(hf_model).__name__}: no pelab weight for {sorted(set(params) - set(state))}")
    return state


def to_pelab_state(hf_state: dict[str, Tensor], rules: list[Rule], config: GPTConfig, where: str) -> dict[str, Tensor]:
    """The class's state dict ``hf_state`` as pelab's (``config``: the run's model), the rules'
    inverse. A non-zero bias where the run has none, or a tensor of the class no rule reads, is
    refused naming it (``where``: the folder, for the message)."""
    state: dict[str, Tensor] = {}
    for rule in rules:
        values = [hf_state.get(key) for key in rule.hf]
        if is_bias(rule) and not config.bias:
            nonzero = next((k for k, v in zip(rule.hf, values) if v is not None and bool(v.any())), None)
            if nonzero:
                raise ExportError(f"{where} has a non-zero {nonzero} and this run has model.bias=false; set model.bias=true")
            continue
        if is_bias(rule) and all(v is None for v in values):  # e.g. GPT-NeoX without attention_bias
            state[rule.pelab] = torch.zeros(state[rule.pelab.removesuffix("bias") + "weight"].shape[0])
            continue
        if any(v is None for v in values):
            raise ExportError(f"{where} has no {[k for k, v in zip(rule.hf, values) if v is None][0]}")
        state[rule.pelab] = rule.codec.to_pelab(values, config).contiguous()
    read = {key for rule in rules for key in rule.hf}
    unread = sorted(set(hf_state) - read)
    if unread:
        raise ExportError(f"{where} holds {unread[0]} (and {len(unread) - 1} more), which pelab's model has no place for")
    state["lm_head.weight"] = state["wte.weight"]  # tied
    return state


def common_config(c: GPTConfig) -> dict:
    # end-of-text ids are the tokenizer's: set when saving (save_model)
    return dict(vocab_size=c.vocab_size, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None)


class Folder(NamedTuple):
    """A transformers config in pelab's terms (import)."""

    model: dict  # GPTConfig fields a run must match
    scheme: str  # the position scheme its weights were trained with
    pe: dict  # that scheme's options a run of the same scheme must match
    length: int  # its position table or max_position_embeddings
    scaling: dict | None  # a rope_type other than default, as pelab's pe.scaling
    refusals: list[str]  # what pelab's block cannot compute (one line each)
    notes: list[str]  # what pelab computes nearly but not exactly (printed)


def check_value(config, key: str, want, refusals: list[str], why: str) -> None:
    value = getattr(config, key, want)
    if value != want:
        refusals.append(f"{key}={value!r} ({why})")


def eps_note(config, key: str, want: float, notes: list[str]) -> None:
    value = getattr(config, key, want)
    if value != want:
        notes.append(f"{key}={value} computed with pelab's {want}")


# ---------------------------------------------------------------------------------------------
# learned -> GPT-2

def gpt2_config(gpt: GPT):
    from transformers import GPT2Config

    c = gpt.config
    return GPT2Config(
        **common_config(c), n_positions=gpt.pe.max_positions, n_embd=c.n_embd, n_layer=c.n_layer, n_head=c.n_head,
        activation_function="gelu",  # exact erf GELU, nn.GELU(); "gelu_new" is the tanh form
        resid_pdrop=c.dropout, embd_pdrop=c.dropout, attn_pdrop=c.dropout, layer_norm_epsilon=LAYER_NORM_EPS), {}


def gpt2_layout(c: GPTConfig) -> list[Rule]:
    rules = [Rule("wte.weight", ("transformer.wte.weight",), TOKENS),
             Rule("pe.wpe.weight", ("transformer.wpe.weight",), SAME)]
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"transformer.h.{i}"
        rules += [*module(f"{p}.ln_1", f"{h}.ln_1"), *module(f"{p}.attn.c_attn", f"{h}.attn.c_attn", CONV1D),
                  *module(f"{p}.attn.c_proj", f"{h}.attn.c_proj", CONV1D), *module(f"{p}.ln_2", f"{h}.ln_2"),
                  *module(f"{p}.mlp.c_fc", f"{h}.mlp.c_fc", CONV1D), *module(f"{p}.mlp.c_proj", f"{h}.mlp.c_proj", CONV1D)]
    return rules + module("ln_f", "transformer.ln_f")


def read_gpt2(config) -> Folder:
    refusals: list[str] = []
    notes: list[str] = []
    check_value(config, "n_inner", None, refusals, "pelab's MLP is 4 x n_embd wide")
    check_value(config, "scale_attn_weights", True, refusals, "pelab scales by 1/sqrt(head_dim)")
    check_value(config, "scale_attn_by_inverse_layer_idx", False, refusals, "pelab does not scale by layer")
    act = config.activation_function
    if act in ("gelu_new", "gelu_pytorch_tanh"):
        notes.append(f"activation_function={act} (tanh GELU) computed with pelab's exact GELU")
    elif act != "gelu":
        refusals.append(f"activation_function={act!r} (pelab's MLP is GELU)")
    eps_note(config, "layer_norm_epsilon", LAYER_NORM_EPS, notes)
    model = dict(n_layer=config.n_layer, n_head=config.n_head, n_embd=config.n_embd, vocab_size=config.vocab_size,
                 norm="layernorm", mlp="gelu", qk_norm=False, n_kv_head=config.n_head)
    return Folder(model, "learned", {}, config.n_positions, None, refusals, notes)


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


def rope_keys(gpt: GPT) -> tuple[dict, dict]:
    """rope_parameters, and config.json's keys in both spellings: the current rope_parameters and
    the older ones, so any reader finds the base."""
    pe, pct, base = gpt.pe, rotary_pct(gpt), float(gpt.pe.base)
    scaling = hf_rope_type(pe.scaling)
    rope = {**scaling, "rope_theta": base, "partial_rotary_factor": pct}
    legacy_scaling = None if pe.scaling is None else {"type": scaling["rope_type"], **scaling}
    return rope, {"rope_parameters": rope, "rope_theta": base, "rotary_emb_base": base, "rotary_pct": pct,
                  "partial_rotary_factor": pct, "rope_scaling": legacy_scaling}


def read_rope(config, refusals: list[str]) -> tuple[dict, dict | None]:
    """pe.base, pe.rotary_fraction and pe.scaling of a config's rope_parameters."""
    rope = dict(getattr(config, "rope_parameters", None) or {})
    base = rope.get("rope_theta", getattr(config, "rope_theta", getattr(config, "rotary_emb_base", 10000.0)))
    fraction = rope.get("partial_rotary_factor", getattr(config, "rotary_pct", 1.0))
    kind = rope.get("rope_type", "default")
    scaling = None
    if kind in HF_ROPE_TYPES:
        scaling = {"kind": kind, "factor": rope["factor"]}
        if kind == "llama3":
            scaling.update(low_freq_factor=rope["low_freq_factor"], high_freq_factor=rope["high_freq_factor"],
                           original_length=rope["original_max_position_embeddings"])
    elif kind != "default":
        refusals.append(f"rope_type={kind!r} (imported: default, {', '.join(HF_ROPE_TYPES)})")
    return {"base": float(base), "rotary_fraction": float(fraction)}, scaling


def neox_config(gpt: GPT):
    from transformers import GPTNeoXConfig

    c = gpt.config
    rope, keys = rope_keys(gpt)
    return GPTNeoXConfig(
        **common_config(c), hidden_size=c.n_embd, num_hidden_layers=c.n_layer, num_attention_heads=c.n_head,
        intermediate_size=4 * c.n_embd, hidden_act="gelu", rope_parameters=dict(rope),
        max_position_embeddings=c.block_size, layer_norm_eps=LAYER_NORM_EPS, use_parallel_residual=False,
        attention_bias=c.bias, attention_dropout=c.dropout, hidden_dropout=c.dropout), keys


def neox_layout(c: GPTConfig) -> list[Rule]:
    rules = [Rule("wte.weight", ("gpt_neox.embed_in.weight",), TOKENS)]
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"gpt_neox.layers.{i}"
        rules += [*module(f"{p}.ln_1", f"{h}.input_layernorm"),
                  *module(f"{p}.attn.c_attn", f"{h}.attention.query_key_value", NEOX_QKV, NEOX_QKV),
                  *module(f"{p}.attn.c_proj", f"{h}.attention.dense"), *module(f"{p}.ln_2", f"{h}.post_attention_layernorm"),
                  *module(f"{p}.mlp.c_fc", f"{h}.mlp.dense_h_to_4h"), *module(f"{p}.mlp.c_proj", f"{h}.mlp.dense_4h_to_h")]
    return rules + module("ln_f", "gpt_neox.final_layer_norm")


def read_neox(config) -> Folder:
    refusals: list[str] = []
    notes: list[str] = []
    check_value(config, "use_parallel_residual", False, refusals, "pelab's block is sequential")
    check_value(config, "intermediate_size", 4 * config.hidden_size, refusals, "pelab's MLP is 4 x n_embd wide")
    check_value(config, "hidden_act", "gelu", refusals, "pelab's MLP is exact GELU")
    eps_note(config, "layer_norm_eps", LAYER_NORM_EPS, notes)
    pe, scaling = read_rope(config, refusals)
    model = dict(n_layer=config.num_hidden_layers, n_head=config.num_attention_heads, n_embd=config.hidden_size,
                 vocab_size=config.vocab_size, norm="layernorm", mlp="gelu", qk_norm=False,
                 n_kv_head=config.num_attention_heads)
    return Folder(model, "rope", pe, config.max_position_embeddings, scaling, refusals, notes)


# ---------------------------------------------------------------------------------------------
# rope with the Llama block (model.norm=rmsnorm, model.mlp=swiglu) -> Llama

def llama_refusal(gpt: GPT) -> str | None:
    if gpt.config.qk_norm:
        return "model.qk_norm=true is not exportable: transformers' LlamaForCausalLM has no QK-norm (set it false)"
    if gpt.pe.rotary_dim != gpt.config.head_dim:
        return (f"pe.rotary_fraction={gpt.pe.rotary_dim / gpt.config.head_dim} with the Llama block: "
                f"LlamaForCausalLM rotates the whole head (GPT-NeoX's partial rotary needs model.norm=layernorm)")
    return rope_refusal(gpt)


def llama_config(gpt: GPT):
    from transformers import LlamaConfig

    c = gpt.config
    rope, keys = rope_keys(gpt)
    del rope["partial_rotary_factor"], keys["partial_rotary_factor"], keys["rotary_pct"]  # always the whole head
    del keys["rotary_emb_base"]  # GPT-NeoX's spelling
    return LlamaConfig(
        **common_config(c), hidden_size=c.n_embd, intermediate_size=swiglu_hidden(c.n_embd),
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.block_size, rms_norm_eps=RMS_EPS,
        rope_parameters=dict(rope), attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout), \
        {**keys, "rope_parameters": rope}


def llama_layout(c: GPTConfig) -> list[Rule]:
    rules = [Rule("wte.weight", ("model.embed_tokens.weight",), TOKENS)]
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"model.layers.{i}"
        qkv = tuple(f"{h}.self_attn.{n}_proj" for n in "qkv")
        rules += [*module(f"{p}.ln_1", f"{h}.input_layernorm", bias=None),
                  *module(f"{p}.attn.c_attn", qkv, SPLIT_QKV, SPLIT_QKV), *module(f"{p}.attn.c_proj", f"{h}.self_attn.o_proj"),
                  *module(f"{p}.ln_2", f"{h}.post_attention_layernorm", bias=None),
                  *module(f"{p}.mlp.c_fc", (f"{h}.mlp.gate_proj", f"{h}.mlp.up_proj"), SWIGLU, SWIGLU),
                  *module(f"{p}.mlp.c_proj", f"{h}.mlp.down_proj")]
    return rules + module("ln_f", "model.norm", bias=None)


def read_llama(config) -> Folder:
    refusals: list[str] = []
    notes: list[str] = []
    heads, width = config.num_attention_heads, config.hidden_size
    check_value(config, "head_dim", width // heads, refusals, "pelab's head dim is n_embd / n_head")
    check_value(config, "intermediate_size", swiglu_hidden(width), refusals,
                f"pelab's SwiGLU is {swiglu_hidden(width)} wide at n_embd={width}")
    check_value(config, "hidden_act", "silu", refusals, "pelab's SwiGLU gates with SiLU")
    check_value(config, "pretraining_tp", 1, refusals, "tensor-parallel slices")
    if getattr(config, "attention_bias", False) != getattr(config, "mlp_bias", False):
        refusals.append("attention_bias != mlp_bias (pelab's model.bias sets both)")
    eps_note(config, "rms_norm_eps", RMS_EPS, notes)
    pe, scaling = read_rope(config, refusals)
    pe["rotary_fraction"] = 1.0  # Llama rotates the whole head
    model = dict(n_layer=config.num_hidden_layers, n_head=heads, n_embd=width, vocab_size=config.vocab_size,
                 norm="rmsnorm", mlp="swiglu", qk_norm=False,
                 n_kv_head=getattr(config, "num_key_value_heads", None) or heads)
    return Folder(model, "rope", pe, config.max_position_embeddings, scaling, refusals, notes)


# The native classes: a new one is one entry here (its config, layout and reader above).
EXPORTERS: dict[str, Exporter] = {e.architecture: e for e in (
    Exporter("GPT2LMHeadModel", "learned", gpt2_config, gpt2_layout, read_gpt2),
    Exporter("GPTNeoXForCausalLM", "rope", neox_config, neox_layout, read_neox, refusal=rope_refusal),
    Exporter("LlamaForCausalLM", "rope", llama_config, llama_layout, read_llama,
             block={"norm": "rmsnorm", "mlp": "swiglu"}, options=("n_kv_head",), refusal=llama_refusal),
)}


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
