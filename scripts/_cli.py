"""The scripts' one command line: ``key=value`` arguments on the script's own config,
conf/scripts/<name>.yaml (its keys, their defaults, and after each key a ``#`` comment: its
one-line help, what ``--help`` prints), composed by Hydra, each value read by Hydra's override
grammar and set as Hydra sets an override.

Three rules keep the commands typed before Hydra read the same way:
- a top-level key whose default is text (``prompt``, bench's ``configs``) takes the value as typed;
- a value Hydra's grammar cannot read (``variants=sinks=learned,window=128``, ``prompt=It's``)
  is taken as typed too;
- ``key=a,b``, a sweep to Hydra, is the list ``[a,b]``: a script runs once.
An unknown key is one line naming it and the valid keys, before anything is read.
"""

from __future__ import annotations

import importlib.util
import re
import sys

from _common import ROOT

HELP = ("-h", "--help", "help")
MISSING = "???"  # a required key, or (the evaluation scripts) "not given: the run's value"
KEY_LINE = re.compile(r"^(\w+):\s*(.*?)\s*#\s?(.*)$")  # a top-level key, its default and its comment


def command_line(name: str, argv: list[str], doc: str):
    """conf/scripts/<name>.yaml with ``argv`` on top (a DictConfig), or None after ``--help``."""
    from omegaconf import OmegaConf

    if any(arg in HELP for arg in argv):
        print(usage(doc, name))
        return None
    cfg = compose(name)
    for arg in argv:
        OmegaConf.update(cfg, *setting(cfg, arg), merge=False)  # as Hydra applies an override
    return cfg


def compose(name: str):
    """The script's config with its defaults list (evaluate.yaml's: conf/eval), composed by Hydra;
    the command line is set on it key by key (``setting``), so a key named like a group of the
    training tree (bench's ``eval``, eval_rolling's ``data``) stays the script's own."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3", job_name=name):
        return hydra_compose(f"scripts/{name}")


def setting(cfg, arg: str) -> tuple[str, object]:
    """``arg`` as (key, value), read by Hydra's override grammar under the module's three rules."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ValueType
    from hydra.errors import HydraException

    key, sep, text = arg.partition("=")
    if not sep:
        raise SystemExit(f"expected key=value, got {arg!r}; keys: {', '.join(cfg)}")
    default = known_key(cfg, key, arg)
    if "." not in key and isinstance(default, str) and default != MISSING:  # the script's own text keys
        return key, text.replace("${", "\\${")
    try:
        parsed = OverridesParser.create().parse_override(arg)
    except HydraException:
        return key, text.replace("${", "\\${")
    if parsed.value_type == ValueType.SIMPLE_CHOICE_SWEEP:
        return key, parsed.value().list
    if parsed.is_sweep_override():
        raise SystemExit(f"{arg}: a sweep; a script runs once (give a list: {key}=[a,b])")
    return key, parsed.value()


def known_key(tree, key: str, arg: str):
    """The default of ``key`` (dotted) in ``tree``; an unknown key ends here, in one line."""
    from omegaconf import OmegaConf

    node, parent = OmegaConf.to_container(tree, resolve=False), []
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            where = f" of {'.'.join(parent)}" if parent else ""
            valid = ", ".join(node) if isinstance(node, dict) else f"none: {'.'.join(parent)} is a value"
            raise SystemExit(f"unknown option {key!r} ({arg}); valid options{where}: {valid}")
        node = node[part]
        parent.append(part)
    return node


def quoted(text: str) -> str:
    """``text`` as a Hydra quoted string that reads back as ``text`` (backslashes before a quote
    or the end doubled, quotes escaped, ``${`` not an interpolation)."""
    text = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text)
    return "'" + text.replace("'", "\\'").replace("${", "\\${") + "'"


def as_override(key: str, value) -> str:
    """``key=VALUE`` for a plain value (None, bool, number, text or a list of them)."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return f"{key}={hydra_value(value)}"


def hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    return repr(value) if isinstance(value, (int, float)) else quoted(str(value))


def usage(doc: str, name: str | None = None) -> str:
    """What ``--help`` prints for every script: its docstring, then its keys with their help
    (conf/scripts/<name>.yaml's comments) and, for a key holding a block (evaluate.py's
    ``eval``), the keys of each block."""
    from omegaconf import OmegaConf

    if name is None:
        return f"{doc.strip()}\n\noptions: train.py's overrides (conf/config.yaml), e.g. data=NAME data.KEY=VALUE"
    lines = [doc.strip(), "", "options (key=value; key=a,b is the list [a,b]):"]
    for line in (ROOT / "conf" / "scripts" / f"{name}.yaml").read_text().splitlines():
        if match := KEY_LINE.match(line):
            key, default, help = match.groups()
            if default == MISSING and "required" not in help:
                help += " (default: the run's)"
            elif not (default in ("null", MISSING, '""', "false") or "default" in help or len(default) > 12):
                help += f" (default {default})"
            lines.append(f"  {key:20s} {help}")
    tree = OmegaConf.to_container(compose(name), resolve=False)
    for key, node in tree.items():  # a block of keys (evaluate.py's eval): its keys, by sub-block
        if isinstance(node, dict):
            values = [k for k, v in node.items() if not isinstance(v, dict)]
            blocks = [(f"{key}.{k}", v) for k, v in node.items() if isinstance(v, dict)]
            for where, names in ([(key, values)] if values else []) + [(b, list(v)) for b, v in blocks]:
                lines.append(f"  {where}.KEY: {', '.join(names)}")
    return "\n".join(lines)


def script(name: str):
    """scripts/<name>.py as a module, loaded by its path (``evaluate`` is also a PyPI package's name)."""
    module_name = f"pelab_scripts_{name}"
    if module_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(module_name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    return sys.modules[module_name]
