"""Export as transformers remote code: the model's own files and a thin wrapper.

The folder holds
- a flat copy of the ``model/`` package, one file per module (model/pe/rope.py ->
  pelab_model_pe_rope.py), its ``from model.x import`` lines made ``from .pelab_model_x import``:
  the only imports transformers' remote-code loader follows to sibling files
  (``dynamic_module_utils.get_relative_imports``), and its torch operators named
  ``pelab_<digest of the code>::`` instead of ``pelab::`` (``OPERATOR``);
- the module defining the scheme when it lives outside model/ (a user's scheme), rewritten alike;
- ``pelab_schemes.py`` (generated): imports the scheme's module, so that it registers;
- this package's ``modeling_pelab.py``, verbatim: the wrapper (configuration and model) that builds
  pelab's GPT from config.json and maps transformers' inputs and cache onto ``GPT.hidden``.

config.json carries GPTConfig's fields (``gpt``), the scheme (``pe``: its registered name, its
constructor's options, its RoPE scaling) and the per-layer plan (``nope_layers``, ``layer_rope``);
the weights are GPT's own under ``model.`` (the tied head stored once). A shipped module that
imports anything but torch, the standard library and model/ is refused naming it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import json
import re
import shutil
import sys
from pathlib import Path

import torch

import model as model_package
from model.gpt import GPT
from model.pe.scaling import split_scaling
from model.pe.schedule import split_schedule
from pelab.hf_classes import ExportError

ARCHITECTURE = "PelabForCausalLM"
TEMPLATES = ("modeling_pelab.py",)
AUTO_MAP = {"AutoConfig": "modeling_pelab.PelabConfig", "AutoModelForCausalLM": "modeling_pelab.PelabForCausalLM"}
REGISTRY = "pelab_schemes.py"
FORMAT = 2  # config.json's pelab_format: the model's own code (folders of the restated model have none)
NOT_REMOTE = "is not exportable as remote code"
# a torch.library operator's name in model/ ("pelab::NAME"): the folder's copy registers under a namespace of its
# own code's digest, since a second registration of a name replaces the first one's kernel in the whole process
# (a loaded export would then run pelab's own models on its copy, possibly of another version)
OPERATOR = re.compile(r"""(custom_op\(\s*["'])pelab::""")
MODEL_DIR = Path(model_package.__file__).parent
SHIPPABLE = frozenset({"torch", *sys.stdlib_module_names})  # what a shipped module may import besides model/


def flat_name(module: str) -> str:
    """The folder's file (without .py) of a dotted module: model.pe.rope -> pelab_model_pe_rope; a module
    outside model/ -> pelab_user_<module>."""
    inside = module == "model" or module.startswith("model.")
    return ("pelab_" if inside else "pelab_user_") + module.replace(".", "_")


def model_modules() -> dict[str, Path]:
    """{dotted name: file} of every module of the model/ package."""
    modules = {}
    for path in sorted(MODEL_DIR.rglob("*.py")):
        parts = list(path.relative_to(MODEL_DIR.parent).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def flat_source(source: str, where: str) -> str:
    """``source`` with its model/ imports made flat relative ones; refuses any other import but
    torch's and the standard library's."""
    lines = source.splitlines(keepends=True)
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "model":  # the loader follows `from .x import` only
                    raise ExportError(f"{where} line {node.lineno}: `import {alias.name}` {NOT_REMOTE}; write "
                                      f"`from {alias.name} import ...`")
                check_shippable(alias.name, where, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level or module.split(".")[0] != "model":
                check_shippable("." * node.level + module, where, node.lineno)
                continue
            line = lines[node.lineno - 1]
            flat = re.sub(rf"\bfrom\s+{re.escape(module)}\s+import\b", f"from .{flat_name(module)} import", line, 1)
            if flat == line:
                raise ExportError(f"{where} line {node.lineno}: write `from {module} import` on one line")
            lines[node.lineno - 1] = flat
    return "".join(lines)


@functools.lru_cache(maxsize=256)
def flat_file(path: str, stamp: int, shippable: frozenset) -> str:
    """``flat_source`` of a file, once per version of it (``stamp``: its mtime) and of SHIPPABLE."""
    return flat_source(Path(path).read_text(encoding="utf-8"), path)


def check_shippable(module: str, where: str, line: int) -> None:
    if module.split(".")[0] not in SHIPPABLE:
        raise ExportError(f"{where} line {line} imports {module}: {NOT_REMOTE} (a shipped module may import only "
                          f"torch, the standard library and model/)")


def scheme_module(gpt: GPT) -> tuple[str, Path]:
    """(dotted name, file) of the module defining ``gpt``'s scheme class."""
    cls = type(gpt.pe)
    if "<locals>" in cls.__qualname__:
        raise ExportError(f"pe={gpt.pe.name} {NOT_REMOTE}: its class {cls.__qualname__} is defined inside a "
                          f"function; define it at the top level of its module")
    path = Path(inspect.getsourcefile(cls))
    module = cls.__module__ if cls.__module__ != "__main__" else path.stem
    return module, path


def remote_files(gpt: GPT) -> dict[str, str]:
    """{file name: text} of the code the folder carries besides the wrapper (ExportError if a
    module cannot travel)."""
    modules = model_modules()
    module, path = scheme_module(gpt)
    modules.setdefault(module, path)  # a scheme outside model/ travels with it
    files = {f"{flat_name(m)}.py": flat_file(str(p), p.stat().st_mtime_ns, SHIPPABLE) for m, p in modules.items()}
    if len(files) != len(modules):
        raise ExportError(f"two modules share a flat file name in {sorted(modules)}: rename one")
    lines = ['"""Written by pelab\'s exporter: importing this registers every position scheme the model may use."""',
             "", "from .pelab_model_pe import SCHEMES  # noqa: F401  (model/pe/: the built-in schemes)"]
    package = ast.parse((MODEL_DIR / "pe" / "__init__.py").read_text(encoding="utf-8"))
    if module not in {node.module for node in ast.walk(package) if isinstance(node, ast.ImportFrom)}:
        # a scheme the model/pe package does not import (a user's) registers when its module is imported
        lines.append(f"from .{flat_name(module)} import {type(gpt.pe).__name__}  # noqa: F401  (pe={gpt.pe.name})")
    files[REGISTRY] = "\n".join(lines) + "\n"
    digest = hashlib.sha256("".join(files[name] for name in sorted(files)).encode()).hexdigest()[:12]
    return {name: OPERATOR.sub(rf"\g<1>pelab_{digest}::", text) for name, text in files.items()}


def remote_refusal(gpt: GPT, pe_config: dict) -> str | None:
    """Why ``gpt`` (built from the ``pe`` config ``pe_config``) cannot be written as remote code (one line), or None."""
    options = remote_config(gpt, pe_config)["pe"]["options"]
    takes = inspect.signature(type(gpt.pe)).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in takes.values()):
        unknown = sorted(set(options) - set(takes))
        if unknown:
            return (f"pe.{unknown[0]}={options[unknown[0]]!r} {NOT_REMOTE}: pe={gpt.pe.name} takes "
                    f"{', '.join(k for k in takes if k != 'config')}")
    try:
        remote_files(gpt)
        json.dumps(options)
    except ExportError as err:
        return str(err)
    except TypeError as err:
        return f"pe={gpt.pe.name} {NOT_REMOTE}: its options are not plain values for config.json ({err})"
    return None


def remote_config(gpt: GPT, pe_config: dict) -> dict:
    """config.json's model description: GPTConfig's fields, the scheme's name, constructor options
    and scaling, the per-layer plan."""
    options, _ = split_schedule(pe_config)  # the per-layer plan is read off the model below
    options, _ = split_scaling(options)  # the scaling is read off the scheme: it may be applied after building
    options = {k: v for k, v in options.items() if k != "_target_"}
    scaling = gpt.pe.scaling
    c = gpt.config
    return {
        # GPTConfig's constructor arguments; any backend computes the same function
        "gpt": {**{f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.init}, "attention": "auto"},
        "pe": {"scheme": gpt.pe.name, "options": options,
               "scaling": None if scaling is None else dataclasses.asdict(scaling)},
        "nope_layers": sorted(gpt.nope_layers),
        "layer_rope": [None if r is None else list(r) for r in gpt.layer_rope],
        "vocab_size": c.vocab_size, "max_position_embeddings": gpt.pe.max_positions or c.block_size,
        "hidden_size": c.n_embd, "num_hidden_layers": c.n_layer, "num_attention_heads": c.n_head,
        "pelab_format": FORMAT,
    }


def rebuilt(config: dict) -> GPT:
    """pelab's GPT built from config.json's description (``remote_config``), as the wrapper builds it
    from the folder's copy of model/."""
    from model.config import GPTConfig
    from model.pe import SCHEMES
    from model.pe.rope_scaling import RopeScaling

    gpt_config = GPTConfig(**config["gpt"])
    scheme = SCHEMES[config["pe"]["scheme"]](gpt_config, **config["pe"]["options"])
    if config["pe"]["scaling"] is not None:
        scheme.scale(RopeScaling(**{k: tuple(v) if isinstance(v, list) else v
                                    for k, v in config["pe"]["scaling"].items()}))
    from model.pe.schedule import LayerRope

    layer_rope = config.get("layer_rope") or [None if b is None else [b, None, True] for b in config["layer_bases"]]
    return GPT(gpt_config, scheme, frozenset(config["nope_layers"]),
               tuple(None if r is None else LayerRope(*r) for r in layer_rope))


def check_rebuilds(gpt: GPT, config: dict) -> None:
    """The model config.json describes computes ``gpt``'s logits: its options are all there."""
    options = config["pe"]["options"]
    try:
        copy = rebuilt(json.loads(json.dumps(config))).to(gpt.lm_head.weight.device).eval()
        copy.load_state_dict(gpt.state_dict())
    except (ValueError, TypeError, RuntimeError) as err:  # another shape of the scheme's weights, a bad option
        raise ExportError(f"pe={gpt.pe.name} built from the pe options {options} does not take this model's "
                          f"weights: {str(err).splitlines()[0]}") from None
    T = min(16, gpt.pe.max_positions or 16)
    ids = torch.arange(T, device=copy.lm_head.weight.device)[None] % gpt.config.vocab_size
    training = gpt.training
    with torch.no_grad():
        diff = (copy(ids)[0] - gpt.eval()(ids)[0]).abs().max().item()
    gpt.train(training)
    if not diff <= 1e-5:
        raise ExportError(f"pe={gpt.pe.name} built from the pe options {options} computes other logits (max diff "
                          f"{diff:.3g}): export it with the pe config it was built from")


def save_remote(gpt: GPT, pe_config: dict, folder: Path, eot: int | None) -> None:
    """The folder's code, config.json, generation_config.json and weights (safetensors)."""
    import transformers
    from safetensors.torch import save_file

    files = remote_files(gpt)
    config = remote_config(gpt, pe_config)
    check_rebuilds(gpt, config)
    folder.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATES:
        shutil.copyfile(Path(__file__).with_name(name), folder / name)
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")
    config.update(model_type="pelab", architectures=[ARCHITECTURE], auto_map=AUTO_MAP, tie_word_embeddings=True,
                  bos_token_id=eot, eos_token_id=eot, transformers_version=transformers.__version__)
    (folder / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    transformers.GenerationConfig(bos_token_id=eot, eos_token_id=eot).save_pretrained(folder)
    state = {f"model.{k}": v.detach().contiguous().cpu() for k, v in gpt.state_dict().items() if k != "lm_head.weight"}
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
