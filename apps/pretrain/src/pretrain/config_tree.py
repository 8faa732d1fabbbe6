"""Nested dataclass configs: dotted keys, typed coercion, TOML in and out.

The run config is a tree of dataclasses owned by different packages
(``moe_model.MoEConfig`` beside the app's own sections). Nothing here knows their
fields: every rule is driven by the declared type annotations, so a field another
package adds (``int | None``, ``float``, ``bool``, ``Literal[...]``, an ``Enum``, a
``list[int]``, a nested dataclass) is settable from a TOML file or the command
line the day it lands. Errors are one line and name the dotted key.

TOML values are written here (``toml_value``; the file around them by
``pretrain.config_reference``) rather than with a library because the resolved
config is written at the start of every run, also on machines where only torch
and numpy are installed; the tree holds only scalars, lists and tables, so a
dozen lines cover it.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import math
import tomllib
import types
import typing
from typing import Any

from pretrain.errors import UsageError


class ConfigError(UsageError, ValueError):
    """A configuration the run cannot use; the message names the offending key (exit 2)."""


_NONE_WORDS = ("none", "null")
_TRUE_WORDS = ("true", "1", "yes", "on")
_FALSE_WORDS = ("false", "0", "no", "off")


def field_types(cls: type) -> dict[str, Any]:
    """Resolved annotations of a dataclass (works with ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def all_keys(obj: Any, prefix: str = "") -> list[str]:
    """Every settable dotted key under a dataclass instance."""
    keys = []
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            keys += all_keys(value, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def _describe(tp: Any) -> str:
    """How an error message names what a type accepts."""
    origin = typing.get_origin(tp)
    if origin is typing.Literal:
        return "one of " + ", ".join(str(a) for a in typing.get_args(tp))
    if origin in (list, tuple):
        return "a list"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + ", ".join(m.name for m in tp)
    simple = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    return simple.get(tp, getattr(tp, "__name__", str(tp)))


_MISMATCH = object()


def coerce(key: str, value: Any, tp: Any, text: bool = True) -> Any:
    """Convert a command-line string (``text``) or a typed TOML value to the declared type
    ``tp``. Only command-line text is parsed into numbers and booleans: in a TOML file
    ``steps = "40"`` is a string, refused where an integer is expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or str(value).lower() in _NONE_WORDS):
            return None
        for arm in (a for a in args if a is not type(None)):
            try:
                return coerce(key, value, arm, text)
            except ConfigError:
                pass
        options = [_describe(a) for a in args if a is not type(None)]
        options += ["none"] if type(None) in args else []
        raise ConfigError(f"{key} expects {' or '.join(options)}, got {value!r}")
    if origin in (list, tuple):
        return _coerce_sequence(key, value, origin, args, text)
    if dataclasses.is_dataclass(tp):
        return _coerce_table(key, value, tp)
    result = _coerce_scalar(key, value, tp, text)
    if result is _MISMATCH:
        quoted = " (a quoted string in TOML: write it without quotes)" \
            if not text and isinstance(value, str) and _coerce_scalar(key, value, tp, True) \
            is not _MISMATCH else ""
        raise ConfigError(f"{key} expects {_describe(tp)}, got {value!r}{quoted}")
    return result


def _coerce_scalar(key: str, value: Any, tp: Any, text: bool) -> Any:
    """``value`` as a ``tp`` scalar, or ``_MISMATCH`` (strings read as numbers and booleans
    only when ``text``)."""
    if typing.get_origin(tp) is typing.Literal:
        matches = [c for c in typing.get_args(tp) if value == c or str(value) == str(c)]
        return matches[0] if matches else _MISMATCH
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        matches = [m for m in tp if value in (m, m.name, m.value) or str(value) == str(m.value)]
        return matches[0] if matches else _MISMATCH
    if tp is Any:
        return value
    if isinstance(value, bool) or tp is bool:  # bool is an int subclass: never mix them
        if tp is bool and isinstance(value, bool):
            return value
        if tp is bool and text and isinstance(value, str) and \
                value.lower() in _TRUE_WORDS + _FALSE_WORDS:
            return value.lower() in _TRUE_WORDS
        return _MISMATCH
    if tp is int and isinstance(value, int):
        return value
    if tp is float and isinstance(value, (int, float)):
        return float(value)
    if tp is str:
        return value if isinstance(value, str) else _MISMATCH
    if tp in (int, float) and text and isinstance(value, str):
        try:
            return tp(value.replace("_", ""))
        except ValueError:
            return _MISMATCH
    if tp in (int, float):
        return _MISMATCH
    raise ConfigError(f"{key} has a type ({_describe(tp)}) that cannot be set from a config")


def _coerce_table(key: str, value: Any, tp: type) -> Any:
    """A dataclass from a TOML table (an element of a list of tables, e.g. ``data.sources``)."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key} expects a table like {{{dataclasses.fields(tp)[0].name} = ...}}, "
                          f"got {value!r}")
    obj, types_ = tp(), field_types(tp)
    for name, item in value.items():
        if name not in types_:
            raise ConfigError(f"unknown key {name!r} in {key}; it takes {', '.join(types_)}")
        setattr(obj, name, coerce(f"{key}.{name}", item, types_[name], text=False))
    return obj


def _coerce_sequence(key: str, value: Any, origin: type, args: tuple, text: bool) -> Any:
    """``list[T]`` / ``tuple[T, ...]`` / ``tuple[A, B]`` from a TOML array or ``a,b`` / ``[a,b]``;
    a list of tables (dataclasses) from a TOML array or its inline text ``[{k = v}, ...]``."""
    if isinstance(value, str) and args and dataclasses.is_dataclass(args[0]):
        try:
            value = tomllib.loads(f"value = {value.strip() or '[]'}")["value"]
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{key} expects a TOML array of tables such as "
                              f'[{{path = "a", weight = 1}}], got {value!r} ({e})') from None
    if isinstance(value, str):
        inner = value.strip()
        if inner.startswith("[") and inner.endswith("]"):
            inner = inner[1:-1]
        value = [part.strip().strip("'\"") for part in inner.split(",") if part.strip()]
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"{key} expects a list, got {value!r}")
    if origin is tuple and args and args[-1] is not Ellipsis:
        if len(value) != len(args):
            raise ConfigError(f"{key} expects {len(args)} values, got {len(value)}")
        item_types = list(args)
    else:
        item_types = [args[0] if args else Any] * len(value)
    items = [coerce(f"{key}[{i}]", v, t, text)
             for i, (v, t) in enumerate(zip(value, item_types, strict=True))]
    return tuple(items) if origin is tuple else items


def unknown_key(key: str, root: Any) -> ConfigError:
    candidates = all_keys(root)
    close = difflib.get_close_matches(key, candidates, n=1)
    if not close:  # a misspelt section: compare the leaf name within every section
        leaf = key.rsplit(".", 1)[-1]
        by_leaf = {k.rsplit(".", 1)[-1]: k for k in candidates}
        close = [by_leaf[m] for m in difflib.get_close_matches(leaf, list(by_leaf), n=1)]
    hint = f"; did you mean {close[0]!r}?" if close else ""
    return ConfigError(f"unknown config key {key!r}{hint}")


def set_key(root: Any, key: str, value: Any, text: bool = True) -> None:
    """Set a dotted key on a dataclass tree, converting ``value`` to the field's type
    (``text``: a command-line string, see ``coerce``)."""
    parts = key.split(".")
    obj = root
    for i, part in enumerate(parts):
        names = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else ()
        if part not in names:
            raise unknown_key(key, root)
        if i < len(parts) - 1:
            obj = getattr(obj, part)
            continue
        current = getattr(obj, part)
        if dataclasses.is_dataclass(current):
            example = dataclasses.fields(current)[0].name
            raise ConfigError(f"{key} is a section; set one of its keys, e.g. {key}.{example}")
        object.__setattr__(obj, part, coerce(key, value, field_types(type(obj))[part], text))


def apply_tree(root: Any, tree: dict[str, Any], prefix: str = "") -> list[str]:
    """Apply a nested mapping (a parsed TOML document or a preset) key by key; the dotted
    keys it set, in order."""
    keys = []
    for name, value in tree.items():
        if isinstance(value, dict):
            keys += apply_tree(root, value, f"{prefix}{name}.")
        else:
            set_key(root, prefix + name, value, text=False)
            keys.append(prefix + name)
    return keys


def _default_of(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def to_tree(obj: Any) -> dict[str, Any]:
    """A dataclass tree as nested dicts of TOML-ready values.

    TOML has no null: a ``None`` field whose default is ``None`` is left out (it
    reads back as its default); any other ``None`` is written as ``"none"``, which
    ``coerce`` reads back as ``None`` for optional fields.
    """
    tree: dict[str, Any] = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            tree[f.name] = to_tree(value)
        elif value is None:
            if _default_of(f) is not None:
                tree[f.name] = "none"
        elif isinstance(value, enum.Enum):
            tree[f.name] = value.name
        elif isinstance(value, (list, tuple)):
            tree[f.name] = [to_tree(v) if dataclasses.is_dataclass(v) else v for v in value]
        else:
            tree[f.name] = value
    return tree


_TOML_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f",
                 "\r": "\\r"}


def _toml_string(text: str) -> str:
    """A TOML basic string: any character as itself but the quote, the backslash and the
    control characters (JSON's ``\\uXXXX`` surrogate pairs for characters past U+FFFF are
    not valid TOML)."""
    return '"' + "".join(
        _TOML_ESCAPES.get(c) or (f"\\u{ord(c):04X}" if ord(c) < 0x20 or ord(c) == 0x7F else c)
        for c in text) + '"'


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table (an element of a list of tables)
        return "{" + ", ".join(f"{k} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {value!r} ({type(value).__name__}) as TOML")
