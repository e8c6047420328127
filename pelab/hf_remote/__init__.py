"""Export as transformers remote code: every scheme and option no native class holds exactly.

The folder gets this package's ``modeling_pelab.py`` and ``configuration_pelab.py`` copied
verbatim (they import only torch and transformers), ``auto_map`` in config.json, and pelab's
weights under their own names (``model.`` + GPT.state_dict's key, the tied head stored once).
``AutoModelForCausalLM.from_pretrained(DIR, trust_remote_code=True)`` loads it.

config.json describes the model in the remote code's terms (configuration_pelab.py): the block
options, each layer's window, NoPE layers and RoPE base, the attention temperature and the
scheme as its parts (``embed``, ``rotate``, ``bias``), built by the scheme's entry in
``REMOTE_SCHEMES``. A new scheme is one entry there (the options it reads and its parts) and
its formula in modeling_pelab.py; a new model option is one name in ``FIELDS`` once the remote
code computes it. Anything else is refused naming the key.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from torch import Tensor, nn

from model.config import GPTConfig
from model.gpt import GPT
from model.pe.schedule import split_schedule
from pelab.hf_classes import ExportError

ARCHITECTURE = "PelabForCausalLM"
TEMPLATES = ("configuration_pelab.py", "modeling_pelab.py")
AUTO_MAP = {"AutoConfig": "configuration_pelab.PelabConfig", "AutoModelForCausalLM": "modeling_pelab.PelabForCausalLM"}
NOT_REMOTE = "is not exportable (not even as remote code)"

# GPTConfig fields the remote code computes at any value (attention backends and dropout change nothing at inference)
FIELDS = frozenset({
    "vocab_size", "block_size", "n_layer", "n_head", "n_embd", "dropout", "bias", "pad_vocab_multiple", "attention",
    "attn_temperature", "attn_temperature_length", "attn_temperature_floor", "attn_temperature_scale",
    "norm", "mlp", "qk_norm", "n_kv_head", "window", "window_pattern", "sinks", "normaliser",
})
# pe schedule keys: the per-layer plan is read off the model; randomize_to moves training positions only
SCHEDULE = frozenset({"nope_every", "nope_layers", "global_base", "randomize_to"})


class RemoteScheme(NamedTuple):
    options: tuple[str, ...]  # the pe options its parts hold (another one is refused)
    parts: Callable[[Any], dict]  # the scheme instance -> {"embed"|"rotate"|"bias": options}


def rotation(pe) -> dict:
    """RoPE and its subclasses: base, rotated dims, kept pairs (p-RoPE, HoPE), learned frequencies, scaling."""
    return {"kind": "rope", "base": float(pe.base), "rotary_dim": pe.rotary_dim, "kept_pairs": pe.kept_pairs,
            "learnable_freq": pe.log_freq_scale is not None, "xpos": None,
            "scaling": None if pe.scaling is None else dataclasses.asdict(pe.scaling)}


def slopes(pe) -> dict:
    # the slopes as the scheme holds them: alibi_slopes, bias_heads, slope_multiplier and a linear scaling applied
    return {"kind": "slopes", "slopes": pe.slopes.tolist()}


REMOTE_SCHEMES: dict[str, RemoteScheme] = {
    "learned": RemoteScheme(("max_positions", "extend"),
                            lambda pe: {"embed": {"kind": "learned", "positions": pe.table_size}}),
    "sinusoidal": RemoteScheme(("base", "scale"),
                               lambda pe: {"embed": {"kind": "sinusoidal", "base": pe.base, "scale": pe.scale}}),
    "rope": RemoteScheme(("base", "rotary_fraction", "keep_fraction", "learnable_freq", "max_period", "min_frequency",
                          "scaling"), lambda pe: {"rotate": rotation(pe)}),
    "alibi": RemoteScheme(("scaling",), lambda pe: {"bias": slopes(pe)}),
    "xpos": RemoteScheme(("base", "gamma", "scale_base", "rotary_fraction", "scaling"),
                         lambda pe: {"rotate": {**rotation(pe), "xpos": {"gamma": pe.gamma,
                                                                         "scale_base": pe.scale_base}}}),
    "rope_alibi": RemoteScheme(("base", "rotary_fraction", "bias_heads", "slope_multiplier", "scaling"),
                               lambda pe: {"rotate": rotation(pe), "bias": slopes(pe)}),
    "fire": RemoteScheme(("mlp_width", "init_c", "init_threshold", "eps"),
                         lambda pe: {"bias": {"kind": "fire", "mlp_width": pe.mlp[0].out_features, "eps": pe.eps}}),
    "kerple_log": RemoteScheme(("eps",), lambda pe: {"bias": {"kind": "kerple_log", "eps": pe.eps, "r2_max": None}}),
    "kerple_power": RemoteScheme(("eps",), lambda pe: {"bias": {"kind": "kerple_power", "eps": pe.eps,
                                                                "r2_max": pe.r2_max}}),
    "nope": RemoteScheme((), lambda pe: {}),
    "t5": RemoteScheme(("num_buckets", "max_distance"),
                       lambda pe: {"bias": {"kind": "t5", "num_buckets": pe.num_buckets,
                                            "max_distance": pe.max_distance}}),
    "pope": RemoteScheme(("base", "delta_init"), lambda pe: {"rotate": {"kind": "pope", "base": float(pe.base)}}),
    "fox": RemoteScheme((), lambda pe: {"gates": {"kind": "fox"}}),
    "cope": RemoteScheme(("npos_max",), lambda pe: {"scores": {"kind": "cope", "npos": pe.npos}}),
}


def missing_scheme(name: str) -> str:
    return (f"pe={name} {NOT_REMOTE}: add its entry to REMOTE_SCHEMES in pelab/hf_remote/__init__.py (the options it "
            f"reads and its embed/rotate/bias parts) and its formula to pelab/hf_remote/modeling_pelab.py")


def remote_refusal(gpt: GPT, pe_config: dict) -> str | None:
    """Why ``gpt`` (built from the ``pe`` config ``pe_config``) cannot be written as remote code (one line), or None."""
    scheme = REMOTE_SCHEMES.get(gpt.pe.name)
    if scheme is None:
        return missing_scheme(gpt.pe.name)
    for field in dataclasses.fields(GPTConfig):
        value = getattr(gpt.config, field.name)
        if field.name not in FIELDS and field.default is not dataclasses.MISSING and value != field.default:
            return f"model.{field.name}={value!r} {NOT_REMOTE}: only its default {field.default!r} is"
    options, schedule = split_schedule(pe_config)
    for key, value in schedule.items():
        if key not in SCHEDULE and value is not None:
            return f"pe.{key}={value!r} {NOT_REMOTE}"
    unknown = sorted(set(options) - {"_target_", "scaling", *scheme.options})
    if unknown:
        return f"pe.{unknown[0]}={options[unknown[0]]!r} {NOT_REMOTE} for pe={gpt.pe.name}"
    if gpt.pe.scaling is not None and "scaling" not in scheme.options:  # every pe config has a (kind none) block
        return f"pe.scaling.kind={gpt.pe.scaling.kind} {NOT_REMOTE} for pe={gpt.pe.name}"
    return None


def remote_config(gpt: GPT) -> dict:
    """The PelabConfig keyword arguments of ``gpt`` (configuration_pelab.py)."""
    c = gpt.config
    bases = list(getattr(gpt, "layer_bases", ()))  # pe.global_base: layer i's own RoPE base
    return dict(
        vocab_size=c.vocab_size, n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, n_kv_head=c.kv_heads,
        bias=c.bias, norm=c.norm, mlp=c.mlp, mlp_hidden=gpt.blocks[0].mlp.c_proj.in_features, qk_norm=c.qk_norm,
        max_position_embeddings=gpt.pe.max_positions or c.block_size, layer_windows=list(c.layer_windows),
        nope_layers=sorted(gpt.nope_layers), layer_bases=bases + [None] * (c.n_layer - len(bases)),
        attn_temperature=temperature(gpt), pe=REMOTE_SCHEMES[gpt.pe.name].parts(gpt.pe), pelab_scheme=gpt.pe.name,
        sinks=c.sinks, normaliser=c.normaliser)


def temperature(gpt: GPT) -> dict | None:
    """The attention temperature and the layers whose queries it scales (llama4: those without position information)."""
    c = gpt.config
    if c.attn_temperature == "none":
        return None
    positional = gpt.pe.uses_rotate or gpt.pe.uses_bias
    layers = [i for i in range(c.n_layer) if c.attn_temperature != "llama4" or i in gpt.nope_layers or not positional]
    return {"kind": c.attn_temperature, "layers": layers, "length": c.attn_temperature_length or c.block_size,
            "floor": c.attn_temperature_floor, "scale": c.attn_temperature_scale}


def remote_state(gpt: GPT) -> dict[str, Tensor]:
    """pelab's weights under the remote model's names: the padded vocabulary rows dropped, the tied head left out."""
    state = {f"model.{key}": value for key, value in gpt.state_dict().items() if key != "lm_head.weight"}
    state["model.wte.weight"] = state["model.wte.weight"][: gpt.config.vocab_size]
    return state


def remote_model(gpt: GPT) -> nn.Module:
    """The remote code's model holding ``gpt``'s weights; every tensor of either side has its match."""
    from pelab.hf_remote.configuration_pelab import PelabConfig
    from pelab.hf_remote.modeling_pelab import PelabForCausalLM

    model = PelabForCausalLM(PelabConfig(**remote_config(gpt))).eval()
    result = model.load_state_dict(remote_state(gpt), strict=False)
    missing = sorted(set(result.missing_keys) - {"lm_head.weight"})
    if missing or result.unexpected_keys:  # a bug of the remote code, never a random weight
        raise ExportError(f"{ARCHITECTURE}: the remote code has no place for {result.unexpected_keys} "
                          f"or no pelab weight for {missing}")
    return model


def copy_templates(folder: Path) -> None:
    for name in TEMPLATES:
        shutil.copyfile(Path(__file__).with_name(name), folder / name)
