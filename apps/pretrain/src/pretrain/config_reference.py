"""Every config key with its type, default and description, read from the config dataclasses.

The descriptions are the comments the dataclasses carry beside each field (the
trailing ``# ...`` on its line, after the block of comment lines right above it,
section rulers ``# --- name`` left out), read from the source with ``ast`` and
``tokenize``; the types and defaults are the fields' own. Nothing is listed by hand,
so the reference follows any field a package adds or changes.

``annotated_toml`` writes a config as TOML holding every key, one per line, each
with a trailing comment ``type, default D: description``; a key whose value is
``None`` where ``None`` is the default is written commented out (TOML has no null),
so the file is both the full reference and a config ``load_config`` reads back to
the same values. ``pretrain config`` prints it; each run writes it as
``run_dir/config.toml``.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import io
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pretrain.config_tree import field_types, to_tree, toml_value


@dataclass(frozen=True)
class KeyDoc:
    key: str  # dotted key (an element table's fields: ``data.sources[].path``)
    type: str  # as the reference shows it: int, float | none, adamw | muon, list of str
    default: Any  # the dataclass default (a TOML-ready value; None when unset)
    description: str  # one line


def _comments(source: str) -> dict[int, str]:
    """Line number -> the text of the comment on that line."""
    found = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            found[token.start[0]] = token.string.lstrip("#").strip()
    return found


@functools.cache
def field_descriptions(cls: type) -> dict[str, str]:
    """Field name -> its description, from the comments beside the field in ``cls``'s source
    (empty strings where the source cannot be read or a field has no comment)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {f.name: "" for f in dataclasses.fields(cls)}
    lines, comments = source.splitlines(), _comments(source)
    body = next(node for node in ast.parse(source).body if isinstance(node, ast.ClassDef)).body
    described = {}
    for node in body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            text = comments.get(line, "")
            if text.startswith("---"):  # a section ruler, not this field's
                break
            above.insert(0, text)
            line -= 1
        trailing = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1)
                    if n in comments]
        described[node.target.id] = " ".join(above + trailing)
    return {f.name: described.get(f.name, "") for f in dataclasses.fields(cls)}


def type_name(tp: Any) -> str:
    """A field type as the reference shows it."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("none" if a is type(None) else type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(str(a) for a in args)
    if origin in (list, tuple):
        item = args[0] if args else Any
        if dataclasses.is_dataclass(item):
            names = ", ".join(f.name for f in dataclasses.fields(item))
            return f"list of {{{names}}} tables"
        return f"list of {type_name(item)}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return " | ".join(m.name for m in tp)
    return getattr(tp, "__name__", str(tp))


def _element_type(tp: Any) -> type | None:
    """The dataclass of a list-of-tables field (``data.sources``), else ``None``."""
    if typing.get_origin(tp) in (list, tuple):
        args = typing.get_args(tp)
        if args and dataclasses.is_dataclass(args[0]):
            return args[0]
    return None


def _tree_value(value: Any) -> Any:
    """A field value as ``to_tree`` writes it (None stays None)."""
    if isinstance(value, enum.Enum):
        return value.name
    if isinstance(value, (list, tuple)):
        return [to_tree(v) if dataclasses.is_dataclass(v) else v for v in value]
    return value


def key_docs(obj: Any, defaults: Any = None, prefix: str = "") -> Iterator[tuple[KeyDoc, Any]]:
    """Every key under the dataclass instance ``obj`` (the whole config), depth first in
    field order, with its value in ``obj``; an element table's fields follow its list
    (their value: ``None``). ``defaults``: the default instance at this place (a section's
    defaults are its parent's default for it, not its class's own)."""
    cls = type(obj)
    defaults = cls() if defaults is None else defaults
    hints, descriptions = field_types(cls), field_descriptions(cls)
    for f in dataclasses.fields(cls):
        value, default = getattr(obj, f.name), getattr(defaults, f.name)
        if dataclasses.is_dataclass(value):
            yield from key_docs(value, default, f"{prefix}{f.name}.")
            continue
        key = prefix + f.name
        yield KeyDoc(key, type_name(hints[f.name]), _tree_value(default),
                     descriptions[f.name]), _tree_value(value)
        element = _element_type(hints[f.name])
        if element is not None:
            for doc, _ in key_docs(element(), None, f"{key}[]."):
                yield doc, None


def all_key_docs(obj: Any) -> list[KeyDoc]:
    return [doc for doc, _ in key_docs(obj)]


def _default_text(value: Any) -> str:
    return "none" if value is None else toml_value(value)


def _annotation(doc: KeyDoc, source: str | None) -> str:
    text = f"{doc.type}, default {_default_text(doc.default)}"
    if doc.description:
        text += f": {doc.description}"
    return text + (f" (set by {source})" if source else "")


def annotated_toml(cfg: Any, header: str = "", key_sources: Mapping[str, str] | None = None) -> str:
    """``cfg`` (a config dataclass tree) as TOML with every key and its reference comment;
    ``key_sources``: dotted key -> where its value came from, added to the comment."""
    key_sources = key_sources or {}
    sections: dict[str, list[str]] = {}
    for doc, value in key_docs(cfg):
        section, _, name = doc.key.rpartition(".")
        if section.endswith("[]"):  # a field of a list's element tables
            section, _, owner = section[:-2].rpartition(".")
            sections.setdefault(section, []).append(f"#   {owner}[].{name}: {_annotation(doc, None)}")
            continue
        note = _annotation(doc, key_sources.get(doc.key))
        if value is None and doc.default is None:
            line = f"# {name} =   # {note}"
        else:
            shown = "none" if value is None else value  # None over a non-None default
            line = f"{name} = {toml_value(shown)}  # {note}"
        sections.setdefault(section, []).append(line)
    out = [f"# {line}" for line in header.splitlines()]
    out += sections.pop("", [])  # TOML: the top-level keys before any table
    for section, lines in sections.items():
        if section:
            out += ["", f"[{section}]"]
        out += lines
    return "\n".join(out).lstrip("\n") + "\n"
