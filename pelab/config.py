"""Config checks: a bad value fails early with its key, the value and what is allowed.

Types come from the annotations of whatever consumes a section (GPTConfig, OptimConfig, a
scheme's ``__init__``, Lightning's ``Trainer.__init__`` ...), so a new option is checked
without being listed here.
"""

from __future__ import annotations

import collections.abc
import functools
import inspect
import types
import typing
from typing import Any, Callable, Literal, Union

from hydra.errors import CompactHydraException, InstantiationException
from hydra.utils import get_class
from omegaconf import OmegaConf

from model.config import require as model_require


class ConfigError(CompactHydraException, ValueError):
    """A bad config value. Hydra's CLI prints a CompactHydraException as its message alone,
    without a traceback (HYDRA_FULL_ERROR=1 still shows one)."""


def plain(node: Any) -> Any:
    """A config node as plain YAML data (dicts, lists, scalars), interpolations resolved."""
    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else node


def config_error(section: str, err: BaseException) -> ConfigError:
    """A constructor's ``err`` as the ConfigError users see: its own message when that names
    its key (model/ and data/ raise plain ValueErrors that do), else prefixed with the section."""
    message = str(err)
    return ConfigError(message if message.startswith(section) else f"{section}: {message}")


def build(section: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with a ValueError/TypeError it raises, directly or inside Hydra's
    InstantiationException, turned into ``config_error(section, ...)``: one line, no traceback."""
    try:
        return fn(*args, **kwargs)
    except ConfigError:
        raise
    except InstantiationException as err:
        if isinstance(err.__cause__, (ValueError, TypeError)):
            raise config_error(section, err.__cause__) from None
        raise
    except (ValueError, TypeError) as err:
        raise config_error(section, err) from None


def target_class(section: str, values: dict) -> type:
    """The class a config node's ``_target_`` names, or a ConfigError saying it names none."""
    try:
        return get_class(values["_target_"])
    except Exception as err:  # noqa: BLE001 - a missing or unimportable _target_
        raise ConfigError(f"{section}._target_={values.get('_target_')!r} is not an importable class: "
                          f"{err}") from None


# model/config.py's check (key, value, what is allowed), raising the harness's one-line ConfigError
require = functools.partial(model_require, error=ConfigError)


def fail(key: str, value: Any, allowed: str) -> typing.NoReturn:
    require(False, key, value, allowed)
    raise AssertionError("not reached: require raised")


_SEQUENCES = (list, tuple, collections.abc.Sequence, collections.abc.Iterable)


def matches(value: Any, hint: Any) -> bool:
    """Whether ``value`` (plain YAML data: None, bool, int, float, str, list, dict) fits ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if hint is Any or hint is inspect.Parameter.empty:
        return True
    if isinstance(value, dict) and "_target_" in value:  # Hydra instantiates it: the consumer checks it
        return True
    if origin in (Union, types.UnionType):
        return any(matches(value, a) for a in args)
    if origin is Literal:  # type-exact: True is not 1, 16.0 is not 16
        return any(type(value) is type(a) and value == a for a in args)
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:  # YAML and Hydra read 1 as an int
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin in _SEQUENCES:
        if not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(matches(v, a) for v, a in zip(value, args))
        return not args or all(matches(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict)
    if isinstance(hint, type):
        return isinstance(value, hint)
    return True  # a hint we do not model: the consumer checks it


def describe(hint: Any) -> str:
    """``hint`` in words, for error messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (Union, types.UnionType):
        literals = [v for a in args if typing.get_origin(a) is Literal for v in typing.get_args(a)]
        parts = [describe(Literal[tuple(literals)])] if literals else []
        parts += [describe(a) for a in args if a is not type(None) and typing.get_origin(a) is not Literal]
        return " or ".join(parts + (["null"] if type(None) in args else []))
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin in _SEQUENCES:
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"[{', '.join(describe(a) for a in args)}]"
        plural = {int: "integers", float: "numbers", str: "strings", bool: "booleans"}
        return f"a list of {plural.get(args[0]) or describe(args[0])}" if args else "a list"
    words = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}
    return words.get(hint, getattr(hint, "__name__", str(hint)))


def _type_hints(fn: Any) -> dict:
    """``fn``'s resolved annotations; none where one names a type imported only for type checkers
    (e.g. WandbLogger's wandb ``Run``): those options go unchecked rather than fail."""
    try:
        return typing.get_type_hints(fn)
    except NameError:
        return {}


def _keyword_options(target: Any) -> tuple[dict, dict, bool]:
    """(parameters, type hints, takes any keyword) of ``target``'s constructor. A class whose
    ``__init__`` forwards ``**options`` to its base also gets the base's parameters (up the
    MRO until a constructor without ``**``), so a subclass need not repeat its parent's
    signature for its options to be checked."""
    init = target if hasattr(target, "__dataclass_fields__") else getattr(target, "__init__", target)
    params, hints = dict(inspect.signature(target).parameters), _type_hints(init)
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    for base in (target.__mro__[1:] if inspect.isclass(target) else ()):
        if not takes_any or base is object:
            break
        if "__init__" not in vars(base):
            continue
        base_params = inspect.signature(base).parameters
        params = {**{n: p for n, p in base_params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)},
                  **{n: p for n, p in params.items() if p.kind is not p.VAR_KEYWORD}}
        hints = {**_type_hints(base.__init__), **hints}
        takes_any = any(p.kind is p.VAR_KEYWORD for p in base_params.values())
    return params, hints, takes_any


def check_options(section: str, values: dict, target: Any, ignore: tuple[str, ...] = ()) -> None:
    """Unknown keys and wrong types in ``values``, the keyword arguments of ``target`` (a class
    or dataclass). Keys starting with '_' (Hydra's ``_target_`` ...) and ``ignore`` are skipped."""
    params, hints, takes_any = _keyword_options(target)
    options = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
               and n not in ignore]
    name = getattr(target, "__qualname__", str(target))
    for key, value in values.items():
        if key.startswith("_") or key in ignore:
            continue
        if key not in params and not takes_any:
            raise ConfigError(f"{section}.{key}={value!r} is not an option of {section} ({name}); "
                              f"valid options: {', '.join(options) or '(none)'}")
        hint = hints.get(key)
        if hint is not None and not matches(value, hint):
            fail(f"{section}.{key}", value, describe(hint))
