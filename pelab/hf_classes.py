"""The transformers classes pelab's models map onto exactly, each one entry of ``EXPORTERS``:
its config for a GPT, its weight layout (``Rule``s: a pelab tensor, the class's tensors, and how
one becomes the other) read both ways (pelab/export.py writes a folder with it,
pelab/hf_import.py reads one back), and a reader of its config in pelab's terms (import).

- ``learned`` -> GPT-2 (``GPT2LMHeadModel``);
- ``rope`` -> GPT-NeoX (``GPTNeoXForCausalLM``);
- ``rope`` with the Llama block (``model.norm=rmsnorm``, ``model.mlp=swiglu``, GQA) -> Llama
  (``LlamaForCausalLM``);
- the same with NoPE layers (``pe.nope_every``, ``pe.nope_layers``) and/or sliding windows of one
  size (``model.window``, ``model.window_pattern``) -> SmolLM3 (``SmolLM3ForCausalLM``: Llama's
  weights, ``no_rope_layers``, ``layer_types``, one ``sliding_window``).

transformers is imported only inside the functions that build a config.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from model.config import GPTConfig
from model.gpt import GPT, RMS_EPS, swiglu_hidden

LATER = "is not exportable to a native transformers class yet"
LAYER_NORM_EPS = 1e-5  # torch.nn.LayerNorm's default, which pelab's blocks use


class ExportError(ValueError):
    """An export (or import) refused, in one line naming the option and why."""


@dataclasses.dataclass(frozen=True)
class Exporter:
    architecture: str  # the transformers class
    scheme: str  # pelab's pe it holds
    config: Callable[[GPT], tuple[Any, dict]]  # its config for a GPT, and extra config.json keys
    layout: Callable[[GPTConfig], list["Rule"]]  # where each weight goes, both ways
    read: Callable[[Any], "Folder"]  # import: a config of the class in pelab's terms
    block: dict = dataclasses.field(default_factory=dict)  # the non-default model options it is made of
    options: tuple[str, ...] = ()  # model options it maps at any value
    schedule: tuple[str, ...] = ()  # pe schedule options (model/pe/schedule.py) it maps at any value
    refusal: Callable[[GPT], str | None] = lambda gpt: None  # an option that is not exact


# ---------------------------------------------------------------------------------------------
# weight layouts: one table per class, read both ways (pelab/export.py writes, pelab/hf_import.py reads)

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
                raise ExportError(f"{where} has a non-zero {nonzero} and this run has model.bias=false; "
                                  "set model.bias=true")
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
        raise ExportError(f"{where} holds {unread[0]} (and {len(unread) - 1} more), which pelab's model has no "
                          "place for")
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
    nope_layers: tuple[int, ...] | None = None  # its NoPE layers (0-based); None: a class without any


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
                  *module(f"{p}.mlp.c_fc", f"{h}.mlp.c_fc", CONV1D),
                  *module(f"{p}.mlp.c_proj", f"{h}.mlp.c_proj", CONV1D)]
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
    if pe.keep is not None:  # unrotated pairs: p-RoPE's keep_fraction or HoPE's max_period
        kept = f"pe.max_period={pe.max_period} (HoPE)" if pe.max_period is not None else ""
        if pe.keep_fraction < 1:
            kept = " and ".join(filter(None, [f"pe.keep_fraction={pe.keep_fraction} (p-RoPE)", kept]))
        return f"{kept} {LATER}"
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
                  *module(f"{p}.attn.c_proj", f"{h}.attention.dense"),
                  *module(f"{p}.ln_2", f"{h}.post_attention_layernorm"),
                  *module(f"{p}.mlp.c_fc", f"{h}.mlp.dense_h_to_4h"),
                  *module(f"{p}.mlp.c_proj", f"{h}.mlp.dense_4h_to_h")]
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

def llama_refusal(gpt: GPT, architecture: str = "LlamaForCausalLM") -> str | None:
    if gpt.config.qk_norm:
        return f"model.qk_norm=true is not exportable: transformers' {architecture} has no QK-norm (set it false)"
    if gpt.pe.rotary_dim != gpt.config.head_dim:
        return (f"pe.rotary_fraction={gpt.pe.rotary_dim / gpt.config.head_dim} with the Llama block: "
                f"{architecture} rotates the whole head (GPT-NeoX's partial rotary needs model.norm=layernorm)")
    return rope_refusal(gpt)


def llama_kwargs(gpt: GPT) -> tuple[dict, dict]:
    """The config arguments of a Llama-block class (Llama, SmolLM3), and the extra config.json keys."""
    c = gpt.config
    rope, keys = rope_keys(gpt)
    del rope["partial_rotary_factor"], keys["partial_rotary_factor"], keys["rotary_pct"]  # always the whole head
    del keys["rotary_emb_base"]  # GPT-NeoX's spelling
    return dict(
        **common_config(c), hidden_size=c.n_embd, intermediate_size=swiglu_hidden(c.n_embd),
        num_hidden_layers=c.n_layer, num_attention_heads=c.n_head, num_key_value_heads=c.kv_heads,
        head_dim=c.head_dim, hidden_act="silu", max_position_embeddings=c.block_size, rms_norm_eps=RMS_EPS,
        rope_parameters=dict(rope), attention_bias=c.bias, mlp_bias=c.bias, attention_dropout=c.dropout), \
        {**keys, "rope_parameters": rope}


def llama_config(gpt: GPT):
    from transformers import LlamaConfig

    kwargs, keys = llama_kwargs(gpt)
    return LlamaConfig(**kwargs), keys


def llama_layout(c: GPTConfig) -> list[Rule]:
    rules = [Rule("wte.weight", ("model.embed_tokens.weight",), TOKENS)]
    for i in range(c.n_layer):
        p, h = f"blocks.{i}", f"model.layers.{i}"
        qkv = tuple(f"{h}.self_attn.{n}_proj" for n in "qkv")
        rules += [*module(f"{p}.ln_1", f"{h}.input_layernorm", bias=None),
                  *module(f"{p}.attn.c_attn", qkv, SPLIT_QKV, SPLIT_QKV),
                  *module(f"{p}.attn.c_proj", f"{h}.self_attn.o_proj"),
                  *module(f"{p}.ln_2", f"{h}.post_attention_layernorm", bias=None),
                  *module(f"{p}.mlp.c_fc", (f"{h}.mlp.gate_proj", f"{h}.mlp.up_proj"), SWIGLU, SWIGLU),
                  *module(f"{p}.mlp.c_proj", f"{h}.mlp.down_proj")]
    return rules + module("ln_f", "model.norm", bias=None)


def read_llama(config, refusals: list[str] | None = None) -> Folder:
    refusals = [] if refusals is None else refusals
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


# ---------------------------------------------------------------------------------------------
# rope with the Llama block, NoPE layers and one window size -> SmolLM3
#
# transformers' SmolLM3 is Llama's block and weights with two per-layer lists: no_rope_layers (1:
# the layer rotates q and k, 0: NoPE) and layer_types (sliding_attention: keys i-W+1..i with W =
# sliding_window, its mask's kv_idx > q_idx - W, as pelab's model.window; full_attention). Its one
# rope_parameters serves every layer: pe.global_base has no place in it.

SMOLLM3 = "SmolLM3ForCausalLM"
SLIDING, FULL = "sliding_attention", "full_attention"


def window_sizes(gpt: GPT) -> list[int]:
    return sorted({w for w in gpt.config.layer_windows if w is not None})


def smollm3_refusal(gpt: GPT) -> str | None:
    sizes = window_sizes(gpt)
    if len(sizes) > 1:  # one sliding_window for every sliding layer (model.window has one size)
        return (f"model.window_pattern={gpt.config.window_pattern!r} {LATER} ({SMOLLM3} has one sliding_window "
                f"for all windowed layers; these have {sizes})")
    return llama_refusal(gpt, SMOLLM3)


def smollm3_config(gpt: GPT):
    from transformers import SmolLM3Config

    kwargs, keys = llama_kwargs(gpt)
    windows, sizes = gpt.config.layer_windows, window_sizes(gpt)
    return SmolLM3Config(
        **kwargs, pad_token_id=None,  # its default (128004) is no id of a small vocabulary
        no_rope_layers=[int(i not in gpt.nope_layers) for i in range(gpt.config.n_layer)],
        layer_types=[FULL if w is None else SLIDING for w in windows],
        use_sliding_window=bool(sizes), sliding_window=sizes[0] if sizes else None), keys


def read_smollm3(config) -> Folder:
    refusals: list[str] = []
    n_layer = config.num_hidden_layers
    types = list(config.layer_types)[:n_layer]
    if SLIDING in types and not (config.use_sliding_window and config.sliding_window):
        # the mask would window those layers and flash attention would not
        refusals.append(f"layer_types with {SLIDING} and use_sliding_window={config.use_sliding_window}, "
                        f"sliding_window={config.sliding_window} (transformers' backends disagree on it)")
    if set(types) - {SLIDING, FULL}:
        refusals.append(f"layer_types={types} (pelab's layers are {SLIDING} or {FULL})")
    folder = read_llama(config, refusals)
    windows = [config.sliding_window if t == SLIDING else None for t in types]
    nope = tuple(i for i, rotates in enumerate(list(config.no_rope_layers)[:n_layer]) if not rotates)
    return folder._replace(model={**folder.model, "window_pattern": windows}, nope_layers=nope,
                           pe={**folder.pe, "global_base": None, "global_keep_fraction": None,
                                                "scaling_layers": None})


# The native classes: a new one is one entry here (its config, layout and reader above).
EXPORTERS: dict[str, Exporter] = {e.architecture: e for e in (
    Exporter("GPT2LMHeadModel", "learned", gpt2_config, gpt2_layout, read_gpt2),
    Exporter("GPTNeoXForCausalLM", "rope", neox_config, neox_layout, read_neox, refusal=rope_refusal),
    Exporter("LlamaForCausalLM", "rope", llama_config, llama_layout, read_llama,
             block={"norm": "rmsnorm", "mlp": "swiglu"}, options=("n_kv_head",), refusal=llama_refusal),
    Exporter(SMOLLM3, "rope", smollm3_config, llama_layout, read_smollm3, block={"norm": "rmsnorm", "mlp": "swiglu"},
             options=("n_kv_head", "window", "window_pattern"), schedule=("nope_every", "nope_layers"),
             refusal=smollm3_refusal),
)}
