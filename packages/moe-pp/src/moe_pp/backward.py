"""Backward split in two passes: input gradient now, weight gradient later.

Zero-bubble schedules send a stage's input gradient upstream as early as
possible and run the weight-gradient work later, in what would be a bubble.
This module does that split on any autograd graph, without model cooperation.

The graph, seen from the stage outputs, has three kinds of nodes:

- *input-path* nodes: those from which the stage input's gradient is reachable;
  the input pass runs exactly these (``torch.autograd.grad`` w.r.t. the input);
- *weight-only* nodes: those that reach parameters but not the input;
- *boundaries*: input-path nodes with a weight-only child. The input pass runs a
  boundary but skips its weight outputs; a pre-hook keeps the gradients that
  arrived at it.

The weight pass restarts autograd at the boundaries with the kept gradients
(``GradientEdge`` roots) and stops at the parameters. It goes through autograd's
``AccumulateGrad`` with ``inputs=params``, so ``param.grad`` accumulates exactly
as in an ordinary backward and post-accumulate-grad hooks fire: a data-parallel
wrapper that moves gradients into its buckets from such hooks works unchanged.
(torch.distributed.pipelining writes ``param.grad`` directly in its weight pass,
which bypasses those hooks; see the package README.)

Boundaries are grouped by the parameters they reach, one autograd call per
group, so the weight pass never re-runs input-path nodes except when a parameter
is used twice with input-path work in between (then the kept gradients are
pinned on every boundary of the group, which keeps the result exact).

A stage without a gradient-requiring input (the first stage: token ids) has no
input path: the input pass does nothing and the weight pass is the full backward.
Auxiliary losses attached inside the graph need nothing special: their gradient
enters at the node that attached them, like any other.

When the stage outputs must outlive the input pass (a custom autograd Function root
that only they keep alive, see ``_roots_need_outputs``), the input pass runs in two
autograd calls: first the nodes above the roots, retaining nothing, then the rest.
The outputs then hold those nodes without what they saved (a last stage's [N, V]
logits, saved by the cross-entropy), which the weight pass never reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge


@dataclass
class _Group:
    roots: list[GradientEdge] = field(default_factory=list)
    grads: list[torch.Tensor] = field(default_factory=list)
    params: dict[Node, torch.Tensor] = field(default_factory=dict)  # by AccumulateGrad node
    pinned: dict[Node, tuple[torch.Tensor | None, ...]] = field(default_factory=dict)


@dataclass
class WeightGradWork:
    """What the input pass leaves for the weight pass of one (stage, microbatch)."""

    groups: list[_Group]
    # Stage outputs held until the weight pass when a root would otherwise die with them
    # (see ``_roots_need_outputs``); empty in the common case. The nodes above the roots
    # have run by then and freed what they saved (``_run_above``).
    keepalive: tuple[torch.Tensor, ...] = ()


def _roots_need_outputs(roots: list[Node], children: dict[Node, list[Node]]) -> bool:
    """Whether some root node is kept alive only by the stage outputs.

    A built-in node's Python object owns the node, and the node owns its children, so
    roots below a built-in root survive the outputs. A custom autograd Function's
    Python object (``BackwardCFunction``) does not own its node in torch 2.11 (2.13 and
    2.15 do): a custom root with no built-in root above it dies with the outputs, and
    the weight pass then fails ("Attribute '_input_metadata' is invalid for this
    instance of _C._FunctionBase"). Only then are the outputs kept.
    """
    custom = [n for n in roots if isinstance(n, BackwardCFunction)]
    if not custom:
        return False
    covered: set[Node] = set()
    stack = [n for n in roots if not isinstance(n, BackwardCFunction)]
    while stack:
        for kid in children.get(stack.pop(), ()):
            if kid not in covered:
                covered.add(kid)
                stack.append(kid)
    return any(n not in covered for n in custom)


def _run_above(
    edges: list[GradientEdge],
    grads: list[torch.Tensor],
    below: list[Node],
    order: list[Node],
    children: dict[Node, list[Node]],
    to_input: set[Node],
) -> tuple[list[GradientEdge], list[torch.Tensor]]:
    """Backward through the input-path nodes above ``below`` now, retaining nothing.

    ``below``: the weight pass's roots and the stage input's node; everything under
    them is kept for later passes, nothing above them is run again. Returns where the
    rest of the input pass starts: the edges into the part below, with their gradients.
    Returns ``edges`` and ``grads`` unchanged when that part is entered at a node under
    another entry point: an autograd call stopping at both would run, and free, the
    upper one.
    """
    kept: set[Node] = set()
    stack = list(below)
    while stack:
        node = stack.pop()
        if node not in kept:
            kept.add(node)
            stack.extend(children.get(node, ()))
    above = {n for n in order if n in to_input and n not in kept}
    if not above:
        return edges, grads
    targets = list(dict.fromkeys(
        GradientEdge(kid, nr)
        for node in above for kid, nr in node.next_functions
        if kid in to_input and kid not in above
    ))
    entries = {edge.node for edge in targets}
    reaches_entry: set[Node] = set()
    for node in order:  # children first
        if any(k in entries or k in reaches_entry for k in children[node]):
            reaches_entry.add(node)
    if entries & reaches_entry:
        return edges, grads
    first = [(e, g) for e, g in zip(edges, grads, strict=True) if e.node in above]
    rest = [(e, g) for e, g in zip(edges, grads, strict=True) if e.node not in above]
    got = torch.autograd.grad(
        [e for e, _ in first], targets, [g for _, g in first], allow_unused=True
    )
    rest += [(e, g) for e, g in zip(targets, got, strict=True) if g is not None]
    return [e for e, _ in rest], [g for _, g in rest]


def _graph(roots: list[Node]) -> tuple[list[Node], dict[Node, list[Node]]]:
    """Nodes reachable from ``roots`` in post-order (children first), and children."""
    children: dict[Node, list[Node]] = {}
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(r, False) for r in roots]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = [c for c, _ in node.next_functions if c is not None]
        stack.append((node, True))
        stack.extend((c, False) for c in children[node] if c not in children)
    return order, children


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[torch.Tensor | None],
    stage_input: torch.Tensor | None,
    params: Sequence[torch.Tensor],
) -> tuple[torch.Tensor | None, WeightGradWork]:
    """Gradient of the stage input (``None`` without one) and the deferred weight work.

    ``output_grads[i]`` is the gradient of ``outputs[i]`` (``None``: ones, for a
    scalar loss). The graph stays alive until :func:`backward_weight` runs.
    """
    grads = [torch.ones_like(o) if g is None else g for o, g in zip(outputs, output_grads, strict=True)]
    edges = [get_gradient_edge(o) for o in outputs]
    order, children = _graph([e.node for e in edges])
    input_node = (
        get_gradient_edge(stage_input).node
        if stage_input is not None and stage_input.requires_grad
        else None
    )
    param_of = {get_gradient_edge(p).node: p for p in params if p.requires_grad}

    to_input: set[Node] = set()
    to_param: set[Node] = set()
    for node in order:  # children before parents
        kids = children[node]
        if node is input_node or any(k in to_input for k in kids):
            to_input.add(node)
        if node in param_of or any(k in to_param for k in kids):
            to_param.add(node)

    def params_below(starts: list[Node]) -> set[Node]:
        """Parameter nodes reachable from weight-only ``starts``."""
        found, seen, stack = set(), set(starts), list(starts)
        while stack:
            node = stack.pop()
            if node in param_of:
                found.add(node)
            for k in children[node]:
                if k in to_param and k not in seen:
                    seen.add(k)
                    stack.append(k)
        return found

    # W roots: boundaries (gradients captured below) and outputs off the input path.
    boundary_params: dict[Node, set[Node]] = {}
    for node in to_input & to_param:
        weight_kids = [k for k in children[node] if k in to_param and k not in to_input]
        if weight_kids:
            boundary_params[node] = params_below(weight_kids)
    direct: list[tuple[GradientEdge, torch.Tensor, set[Node]]] = [
        (e, g, params_below([e.node]))
        for e, g in zip(edges, grads, strict=True)
        if e.node in to_param and e.node not in to_input
    ]

    roots = [*boundary_params, *(edge.node for edge, _, _ in direct)]
    keep_outputs = _roots_need_outputs(roots, children)
    captured: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    handles = []
    for node in boundary_params:
        def keep(grad_outputs: tuple[torch.Tensor | None, ...], node: Node = node) -> None:
            captured[node] = tuple(grad_outputs)

        handles.append(node.register_prehook(keep))
    try:
        input_grad = None
        if input_node is not None and input_node in to_input:
            if keep_outputs:
                below = [*roots, input_node]
                edges, grads = _run_above(edges, grads, below, order, children, to_input)
            if edges:
                (input_grad,) = torch.autograd.grad(
                    edges, [stage_input], grads, retain_graph=True, allow_unused=True
                )
    finally:
        for h in handles:
            h.remove()

    groups = _group(boundary_params, captured, direct, param_of)
    # A built-in boundary that got no gradient is in no group: nothing holds it, so it
    # covers no custom root below it (the outputs are then kept whole, nodes above included)
    held_roots = [edge.node for g in groups for edge in g.roots]
    keep_outputs = keep_outputs or _roots_need_outputs(held_roots, children)
    return input_grad, WeightGradWork(groups, tuple(outputs) if keep_outputs else ())


def _group(
    boundary_params: dict[Node, set[Node]],
    captured: dict[Node, tuple[torch.Tensor | None, ...]],
    direct: list[tuple[GradientEdge, torch.Tensor, set[Node]]],
    param_of: dict[Node, torch.Tensor],
) -> list[_Group]:
    """Union W roots that reach a common parameter: one autograd call per group."""
    parent: dict[object, object] = {}

    def find(x: object) -> object:
        while parent.setdefault(x, x) is not x:
            parent[x] = parent[parent[x]]  # type: ignore[index]
            x = parent[x]
        return x

    def union(a: object, b: object) -> None:
        parent[find(a)] = find(b)

    roots: list[tuple[object, set[Node]]] = [(n, ps) for n, ps in boundary_params.items()]
    roots += [(("direct", i), ps) for i, (_, _, ps) in enumerate(direct)]
    for key, ps in roots:
        find(key)
        for p in ps:
            union(key, p)

    groups: dict[object, _Group] = {}
    for key, ps in roots:
        if not ps:
            continue
        group = groups.setdefault(find(key), _Group())
        if isinstance(key, tuple):
            edge, grad, _ = direct[key[1]]
            group.roots.append(edge)
            group.grads.append(grad)
        else:
            kept = captured.get(key)
            if kept is None:  # no gradient reached this boundary
                continue
            group.pinned[key] = kept
            for i, g in enumerate(kept):
                if g is not None:
                    group.roots.append(GradientEdge(key, i))
                    group.grads.append(g)
        group.params.update((p, param_of[p]) for p in ps)
    return [g for g in groups.values() if g.roots]


def backward_weight(work: WeightGradWork) -> None:
    """Accumulate the deferred parameter gradients into ``param.grad`` (hooks fire)."""
    for group in work.groups:
        handles = []
        if len(group.pinned) > 1:
            for node, kept in group.pinned.items():
                handles.append(node.register_prehook(lambda _g, kept=kept: kept))
        try:
            torch.autograd.backward(
                group.roots, group.grads, inputs=list(group.params.values()), retain_graph=True
            )
        finally:
            for h in handles:
                h.remove()
    work.groups.clear()
    work.keepalive = ()
