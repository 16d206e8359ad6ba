"""The B/W split of a stage's autograd graph, without recomputation.

``backward_input`` (B) computes the gradient w.r.t. the stage inputs and, on the way, captures the
gradient arriving at every *frontier node*: a node on the input path (it leads to an input) with a
child edge that leaves the input path towards a parameter (e.g. ``AddmmBackward`` of a Linear,
whose ``mat1`` edge goes to the input and whose weight edge does not). ``WeightGradWork.run`` (W)
re-enters the graph at exactly those nodes with the captured gradients and asks autograd for the
parameters reachable from each group of them only, so autograd evaluates only the parameter-side
outputs of the frontier nodes and the parameter-only region below them: nothing of B is computed
twice.

Linear and LayerNorm layers routed through ``wgrad_store`` (the engine routes every such layer of a
stage) are not entered again: on the input path, when their parameters are reached from such layers
only, B's pass through them computes the input gradient and keeps what the weight gradient needs
(the layer's input and output gradient) in a ``WeightGradStore``; W computes those gradients
directly. When every parameter of a stage is left to the store, B runs without ``retain_graph``
and frees the graph as a fused backward does.

A frontier node of a custom ``torch.autograd.Function`` (Megatron-style layers: one Function whose
backward computes the input gradient, all-reduces it over the tensor-parallel group and computes the
weight gradient, or accumulates it into ``main_grad`` itself) is never entered again: its backward
runs once, in B, as in a fused backward, and a hook keeps the gradients it returned for its
parameter-side edges; W enters the graph below it, at those edges, with them. Its collectives and
side effects happen once, in B, and W runs none of them. This package's own Functions that leave
their parameter side for W to enter again (``wgrad_store``'s layers when their parameters are
reached elsewhere too, ``recompute``'s chunks) say so with ``W_REENTERS = True``.

Parts of the graph that do not lead to any input (the whole graph of a first stage whose input
needs no gradient, or an output that does not depend on the input) are entered at their output
edges with the output gradients themselves: B does nothing for them and W is their backward.

W accumulates into ``param.grad`` through autograd's own ``AccumulateGrad`` (``torch.autograd.backward``
with the parameters as ``inputs``), so gradient accumulation across micro-batches, tied weights,
data-parallel reduction and every hook registered on a parameter's accumulation (DeepSpeed's bf16
and ZeRO gradient hooks: ``runtime.precision``) behave as with a fused backward, once per W.
The stage outputs are never detached in place, so outputs that are views (``x.view(...)`` at the
end of a stage) are fine.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import GradientEdge, Node, get_gradient_edge

from . import wgrad_store
from .wgrad_store import WeightGradStore


@dataclass
class _Group:
    """One autograd.backward call of W: entry edges with their gradients, and the parameters they reach."""

    edges: list = field(default_factory=list)  # GradientEdge into a frontier node or an output edge
    grads: list = field(default_factory=list)  # the gradient arriving at each edge
    params: list = field(default_factory=list)  # torch.nn.Parameter (or leaf tensor) reached


@dataclass
class WeightGradWork:
    """What B leaves for W of one micro-batch.

    Kept alive until W, and why: the frontier nodes, because W re-enters the graph there; through
    them the graph below them with its saved tensors (each Linear's input, which its weight
    gradient needs, but also what input-path nodes further down saved, since autograd cannot free
    part of a retained graph); the gradient captured at each frontier node (one
    activation-gradient-sized tensor per entry edge); and, for graph parts off the input path, the
    output edges and output gradients. The output tensors, the loss and the stage input are
    released by the caller after B. W runs without ``retain_graph``, so it frees the saved
    tensors of the nodes it runs, and dropping this object frees the rest.

    ``clamp_nodes`` is only set for the rare graph where a parameter is reached both from a
    frontier node's parameter side and through its input side (one module applied twice in a
    stage): W then runs as one call with every frontier node pinned to its captured gradient.
    That is still exact, but autograd re-runs the input-path nodes between frontier nodes.
    """

    groups: list
    clamp_nodes: list = field(default_factory=list)  # (node, captured grad tuple) when clamped
    store: Optional[WeightGradStore] = None  # the deferred Linear and LayerNorm layers (``wgrad_store``)

    def run(self) -> None:
        """Compute the parameter gradients and accumulate them into ``.grad``; frees the graph."""
        handles = [n.register_prehook(lambda _g, saved=g: saved) for n, g in self.clamp_nodes]
        try:
            for grp in self.groups:
                if grp.edges:
                    torch.autograd.backward(grp.edges, grad_tensors=grp.grads, inputs=grp.params)
        finally:
            for h in handles:
                h.remove()
        self.groups = []
        self.clamp_nodes = []
        if self.store is not None:
            self.store.run()
            self.store = None

    def kept_grads(self) -> list[torch.Tensor]:
        """The output gradients B kept for W beside the graph (captured ones and the store's)."""
        kept = [g for grp in self.groups for g in grp.grads]
        return kept + (self.store.grads() if self.store is not None else [])


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
) -> tuple[list[Optional[torch.Tensor]], WeightGradWork]:
    """B: gradients w.r.t. ``inputs`` (None where an input needs none) and the work W needs.

    ``outputs`` are the stage outputs (or the scaled loss, with ``output_grads`` of ones);
    outputs with no graph are skipped. ``params`` are the stage's trainable parameters.
    """
    outs, ograds = [], []
    for t, g in zip(outputs, output_grads):
        if t.requires_grad:
            outs.append(t)
            ograds.append(torch.ones_like(t) if g is None else g)
    input_idx = [i for i, t in enumerate(inputs) if isinstance(t, torch.Tensor) and t.requires_grad]
    dinputs: list[Optional[torch.Tensor]] = [None] * len(inputs)
    if not outs:
        return dinputs, WeightGradWork([])

    roots = [get_gradient_edge(t) for t in outs]
    input_nodes = {get_gradient_edge(inputs[i]).node for i in input_idx}
    params = [p for p in params if p.requires_grad]
    param_bit: dict[Node, int] = {}
    for k, node in enumerate(_accumulators(params)):
        param_bit[node] = param_bit.get(node, 0) | 1 << k

    # Post-order walk: per node, whether it leads to an input and which parameters lie below it.
    leads_in: dict[Node, bool] = {}
    below: dict[Node, int] = {}
    children: dict[Node, list[Node]] = {}
    stack = [(e.node, False) for e in roots if e.node is not None]
    while stack:
        node, done = stack.pop()
        if done:
            kids = children[node]
            leads_in[node] = node in input_nodes or any(leads_in[c] for c in kids)
            mask = param_bit.get(node, 0)
            for c in kids:
                mask |= below[c]
            below[node] = mask
            continue
        if node in children:
            continue
        kids = [fn for fn, _ in node.next_functions if fn is not None]
        children[node] = kids
        stack.append((node, True))
        stack.extend((c, False) for c in kids if c not in children)

    allowed = _deferring(children, leads_in, param_bit)

    # Entry points of W: frontier nodes (captured in B) and output edges off the input path.
    entries = []  # (node_or_edge, param mask of its parameter side, is_frontier)
    for node, kids in children.items():
        if not leads_in[node] or node in allowed:
            continue
        side = 0
        for c in kids:
            if not leads_in[c]:
                side |= below[c]
        if side:
            entries.append((node, side, True))
    for e, g in zip(roots, ograds):
        if e.node is not None and not leads_in[e.node] and below[e.node]:
            entries.append(((e, g), below[e.node], False))

    # Group entries that share a parameter (one autograd.grad call per group, no double counting).
    groups: list[list] = []
    for ent in entries:
        merged = [grp for grp in groups if grp[0] & ent[1]]
        new = [ent[1], [ent]]
        for grp in merged:
            new[0] |= grp[0]
            new[1] += grp[1]
            groups.remove(grp)
        groups.append(new)
    clamp = any(
        below[c] & mask
        for mask, ents in groups
        for node, _, frontier in ents
        if frontier
        for c in children[node]
        if leads_in[c]
    )

    captured: dict[Node, tuple] = {}
    # A custom Function's backward computes every gradient it returns whatever autograd needs, and may
    # communicate or accumulate on its own: keep what it returned for its parameter side (post-hook)
    # so that W starts below it; any other frontier node W re-enters with its captured input (pre-hook).
    run_once = {n for n, _, f in entries if f and isinstance(n, BackwardCFunction)
                and not getattr(type(n)._forward_cls, "W_REENTERS", False)}
    returned: dict[Node, tuple] = {}
    frontier_nodes = [n for n, _, f in entries if f and n not in run_once]
    handles = [
        n.register_prehook(lambda g, n=n: captured.__setitem__(n, g)) for n in frontier_nodes
    ] + [n.register_hook(lambda gi, _go, n=n: returned.__setitem__(n, gi)) for n in run_once]
    store = WeightGradStore(allowed, set(children))
    try:
        if input_idx:
            with store:  # the graph is kept for W only where W re-enters it
                grads = torch.autograd.grad(outs, [inputs[i] for i in input_idx], grad_outputs=ograds,
                                            retain_graph=bool(entries), allow_unused=True)
            for i, g in zip(input_idx, grads):
                dinputs[i] = g
    finally:
        for h in handles:
            h.remove()

    def to_group(mask, ents) -> _Group:
        picked = [k for k in range(len(params)) if mask >> k & 1]
        grp = _Group(params=[params[k] for k in picked])
        for ent, _, frontier in ents:
            if frontier and ent in run_once:  # enter below it, at its parameter-side edges
                for (child, nr), g in zip(ent.next_functions, returned.get(ent, ())):
                    if child is not None and not leads_in[child] and g is not None:
                        grp.edges.append(GradientEdge(child, nr))
                        grp.grads.append(g)
            elif frontier:  # a node that got no gradient at all in B contributes nothing
                for slot, g in enumerate(captured.get(ent, ())):
                    if g is not None:
                        grp.edges.append(GradientEdge(ent, slot))
                        grp.grads.append(g)
            else:
                edge, g = ent
                grp.edges.append(edge)
                grp.grads.append(g)
        return grp

    if clamp:
        mask = 0
        ents = []
        for m, e in groups:
            mask |= m
            ents += e
        work = WeightGradWork([to_group(mask, ents)], [(n, captured[n]) for n in frontier_nodes if n in captured])
    else:
        work = WeightGradWork([to_group(m, e) for m, e in groups if e])
    if store.entries:
        store.seal()
        work.store = store
    return dinputs, work


_ACCUMULATORS: dict[int, tuple] = {}  # id(parameter) -> (the parameter, its AccumulateGrad node)


def _accumulators(params: Sequence[torch.Tensor]) -> list[Node]:
    """The nodes that accumulate into each parameter's ``.grad``. ``get_gradient_edge`` makes a view
    to find one (microseconds per parameter, per B), so the nodes of the last call's parameters are
    kept (and with them the parameters: a node holds its tensor); the next call with other
    parameters (after a migration) drops them."""
    global _ACCUMULATORS
    kept: dict[int, tuple] = {}
    nodes = []
    for p in params:
        hit = _ACCUMULATORS.get(id(p))
        node = hit[1] if hit is not None and hit[0] is p else get_gradient_edge(p).node
        if p.is_leaf:  # (a non-leaf's node is new with every graph)
            kept[id(p)] = (p, node)
        nodes.append(node)
    _ACCUMULATORS = kept
    return nodes


def forget_parameters() -> None:
    """Drop the kept accumulator nodes (and with them the parameters): an engine that is destroyed,
    or whose layers moved, calls it."""
    global _ACCUMULATORS
    _ACCUMULATORS = {}


def _deferring(children: dict, leads_in: dict, param_bit: dict) -> set:
    """The nodes of ``wgrad_store`` layers that may leave their weight gradients to the store: on
    the input path (B runs them), every other child a parameter's accumulator, and every parameter
    reached from such deferring nodes only (one reached elsewhere too is W's graph's to accumulate,
    once)."""
    layers = {n for n in children if type(n) in wgrad_store.NODE_TYPES and leads_in[n]
              and all(leads_in[c] or c in param_bit for c in children[n])}
    if not layers:
        return layers
    parents: dict[Node, list] = {}
    for node, kids in children.items():
        for c in kids:
            if c in param_bit:
                parents.setdefault(c, []).append(node)
    changed = True
    while changed:
        changed = False
        for n in list(layers):
            if any(p not in layers for c in children[n] if c in param_bit for p in parents[c]):
                layers.discard(n)
                changed = True
    return layers
