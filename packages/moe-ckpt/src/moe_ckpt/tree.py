"""Nested state: dicts of tensors, shards and plain values, as ``torch`` state dicts are.

``save`` and ``load`` take a mapping whose values may themselves be mappings, or lists
of them (a model's and an optimizer's ``state_dict()`` side by side; ``torch.optim``'s
with integer keys and a list of ``param_groups``). ``flatten`` walks it: a tensor or
shard becomes a stored tensor named by its path joined with ``/``
(``optim/state/0/exp_avg``, a list's items by their index); a JSON scalar (``int``,
``float``, ``bool``, ``str``, ``None``) or a list or tuple of them becomes a *value*,
kept in the manifest as it was on rank 0 (values are meant to be the same on every
rank: hyperparameters, step counters). Anything else is refused naming its path.

Loading walks the targets the same way: tensors are filled in place, and each value
is replaced in its (mutable) mapping by the saved one, a tuple again if the target's
was a tuple. So ``sd = opt.state_dict(); load(dir, {"optim": sd});
opt.load_state_dict(sd)`` restores a ``torch.optim`` optimizer whose state exists
(after one step, or built with the same parameters and stepped once): ``state_dict()``
lists only the state an optimizer has.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from moe_ckpt.errors import MissingTensorError

SEPARATOR = "/"
# a node of a state: a tensor, a shard (ShardLike), a JSON scalar, or a mapping or list of nodes
StateTree = Any
_SCALARS = (bool, int, float, str, type(None))


def _is_value(leaf: Any) -> bool:
    if isinstance(leaf, (list, tuple)):
        return all(isinstance(x, _SCALARS) for x in leaf)
    return isinstance(leaf, _SCALARS)


def _is_tensor(leaf: Any) -> bool:
    return isinstance(leaf, torch.Tensor) or hasattr(leaf, "local")


def _where(path: tuple) -> str:
    return "state" + "".join(f"[{k!r}]" for k in path)


def _is_container(node: Any) -> bool:
    """A mapping, or a list or tuple that holds more than scalars (``param_groups``)."""
    if _is_tensor(node):
        return False
    return isinstance(node, Mapping) or (isinstance(node, (list, tuple)) and not _is_value(node))


def _leaves(state: Mapping | list | tuple, path: tuple = ()) -> list[tuple[tuple, Any]]:
    out = []
    items = state.items() if isinstance(state, Mapping) else enumerate(state)
    for key, leaf in items:
        if not isinstance(key, (str, int)) or isinstance(key, bool) or key == "":
            raise TypeError(f"{_where(path)}: key {key!r} must be a non-empty string or an int")
        if isinstance(key, str) and SEPARATOR in key and path:
            raise ValueError(f"{_where((*path, key))}: a nested key cannot hold {SEPARATOR!r}, "
                             "which joins the path into a tensor name")
        if _is_container(leaf):
            out += _leaves(leaf, (*path, key))
        else:
            out.append(((*path, key), leaf))
    return out


def flatten(state: Mapping) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(tensors, values)`` of a nested state, keyed by path names; errors name the path."""
    tensors: dict[str, Any] = {}
    values: dict[str, Any] = {}
    for path, leaf in _leaves(state):
        name = SEPARATOR.join(str(k) for k in path)
        if name in tensors or name in values:
            raise ValueError(f"{_where(path)}: its name {name!r} is also another entry's")
        if _is_tensor(leaf):
            tensors[name] = leaf
        elif _is_value(leaf):
            if any(isinstance(x, float) and not math.isfinite(x)
                   for x in (leaf if isinstance(leaf, (list, tuple)) else [leaf])):
                raise ValueError(f"{_where(path)}: a non-finite float cannot be stored as a value "
                                 "(store it as a tensor)")
            values[name] = list(leaf) if isinstance(leaf, tuple) else leaf
        else:
            raise TypeError(f"{_where(path)}: a {type(leaf).__name__} is neither a tensor, a shard, "
                            "a mapping, nor a JSON scalar or a list of them")
    return tensors, values


def fill_values(targets: Mapping, saved: Mapping[str, Any], where: str) -> None:
    """Replace each value leaf of ``targets`` by its saved value (``where``: the checkpoint)."""
    for path, leaf in _leaves(targets):
        if _is_tensor(leaf):
            continue
        name = SEPARATOR.join(str(k) for k in path)
        if name not in saved:
            raise MissingTensorError(f"value {name!r} is not in checkpoint {where}")
        parent: Any = targets
        for key in path[:-1]:
            parent = parent[key]
        if not isinstance(parent, (MutableMapping, list)):
            raise TypeError(f"{_where(path)}: its {type(parent).__name__} cannot take the "
                            "saved value; pass a dict or a list there")
        value = saved[name]
        parent[path[-1]] = tuple(value) if isinstance(leaf, tuple) else value
