"""The B/W split of a stage's autograd graph, without recomputation.

``backward_input`` (B) computes the gradient w.r.t. the stage inputs and, on the way, captures the
gradient arriving at every *frontier node*: a node on the input path (it leads to an input) with a
child edge that leaves the input path towards a parameter (e.g. ``AddmmBackward`` of a Linear,
whose ``mat1`` edge goes to the input and whose weight edge does not). ``WeightGradWork.run`` (W)
re-enters the graph at exactly those nodes with the captured gradients and asks autograd for the
parameters reachable from each group of them only, so autograd evaluates only the parameter-side
outputs of the frontier nodes and the parameter-only region below them: nothing of B is computed
twice.

Linear and LayerNorm layers, and parameters an elementwise op applies (a bias added apart from its
GEMM, a hand-written norm's scale), are not entered again (``wgrad_store``): on the input path, when
their parameters are reached from such layers only, B asks autograd for the gradient arriving at each
Linear and for the other parameters' gradients beside the input gradient, and keeps them with
each Linear's input; W computes the Linears' weight GEMMs directly. When every parameter of a stage
goes this way, B runs without ``retain_graph`` and frees the graph as a fused backward does.

A frontier node of a custom ``torch.autograd.Function`` (Megatron-style layers: one Function whose
backward computes the input gradient, all-reduces it over the tensor-parallel group and computes the
weight gradient, or accumulates it into ``main_grad`` itself) is never entered again: its backward
runs once, in B, as in a fused backward, and a hook keeps the gradients it returned for its
parameter-side edges; W enters the graph below it, at those edges, with them. Its collectives and
side effects happen once, in B, and W runs none of them. This package's own Functions that leave
their parameter side for W to enter again (``recompute``'s chunks) say so with ``W_REENTERS = True``.

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

    ``pinned`` are the frontier nodes with the gradients B captured at them, which a pre-hook on
    each hands the node in W whatever reaches it there: the hooks registered on the tensor a node
    produced (``Tensor.register_hook``) run when the engine reaches the node, once in B, whose
    capture holds their result, and again when W enters it; pinned, W's gradients are B's. What
    such a hook does besides returning a gradient still happens twice, and a ``retain_grad`` on
    that tensor adds to its ``.grad`` a second time (the gradient with its hooks applied again).
    Pinning is also what makes the rare graph exact where a parameter is reached both from a
    frontier node's parameter side and through its input side (one module applied twice in a
    stage): W then runs as one call (``_Plan.clamp``), in which autograd re-runs the input-path
    nodes between frontier nodes and each frontier node still gets its captured gradient.
    """

    groups: list
    pinned: list = field(default_factory=list)  # (frontier node, the grad tuple B captured at it)
    store: Optional[WeightGradStore] = None  # the layers and parameters ``wgrad_store`` computes

    def run(self) -> None:
        """Compute the parameter gradients and accumulate them into ``.grad``; frees the graph."""
        handles = [n.register_prehook(lambda _g, saved=g: saved) for n, g in self.pinned]
        try:
            for grp in self.groups:
                if grp.edges:
                    torch.autograd.backward(grp.edges, grad_tensors=grp.grads, inputs=grp.params)
        finally:
            for h in handles:
                h.remove()
        self.groups = []
        self.pinned = []
        if self.store is not None:
            self.store.run()
            self.store = None

    def kept_grads(self) -> list[torch.Tensor]:
        """The output gradients B kept for W beside the graph (captured ones and the store's)."""
        kept = [g for grp in self.groups for g in grp.grads]
        return kept + (self.store.grads() if self.store is not None else [])


@dataclass
class _Plan:
    """What the analysis of one graph decided, by the position of each node in the walk's order
    (``_walk``), so that the next graph of the same shape (the next micro-batch through the stage)
    reuses it: computed once per shape, not once per B."""

    linears: list  # wgrad_store.Linear with the node's position in ``node``
    in_b: list  # indices of the parameters whose gradients B computes for W (``wgrad_store``)
    frontier: list  # positions of the frontier nodes W re-enters (a pre-hook keeps their input)
    once: list  # (position, [child slots on the parameter side]) of custom Functions run once in B
    groups: list  # ([parameter indices], [("frontier" | "once", position) or ("root", output index)])
    clamp: bool
    retain: bool  # W re-enters the graph: B keeps it


_ADDMM = type(torch.addmm(torch.zeros(1, requires_grad=True), torch.zeros(1, 1), torch.zeros(1, 1)).grad_fn)
_PLANS: dict[tuple, _Plan] = {}  # a graph's shape (``_walk``) -> its plan; the last few stored kept
_PLANS_KEPT = 16


def backward_whole(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
) -> list[Optional[torch.Tensor]]:
    """B and W of one micro-batch as one backward pass, as stock DeepSpeed runs it: every leaf the
    outputs reach accumulates its gradient (the parameters' through their ``AccumulateGrad`` and its
    hooks, once); returns the gradients w.r.t. ``inputs`` (their ``.grad``, None where an input
    needs none). What a split costs on top of this (a second pass into the graph, the store's
    bookkeeping) is saved where nothing waits for the input gradient between B and W."""
    outs, ograds = [], []
    for t, g in zip(outputs, output_grads):
        if t.requires_grad:
            outs.append(t)
            ograds.append(torch.ones_like(t) if g is None else g)
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
            t.retain_grad()  # (the engine's stage inputs are leaves; a non-leaf keeps its .grad only so)
    if outs:
        torch.autograd.backward(outs, ograds)
    return [t.grad if isinstance(t, torch.Tensor) and t.requires_grad else None for t in inputs]


def backward_input(
    outputs: Sequence[torch.Tensor],
    output_grads: Sequence[Optional[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    params: Sequence[torch.Tensor],
    store: bool = True,
) -> tuple[list[Optional[torch.Tensor]], WeightGradWork]:
    """B: gradients w.r.t. ``inputs`` (None where an input needs none) and the work W needs.

    ``outputs`` are the stage outputs (or the scaled loss, with ``output_grads`` of ones);
    outputs with no graph are skipped. ``params`` are the stage's trainable parameters.
    ``store=False`` leaves every layer to the generic split (for comparisons).
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
    params, acc_index, hooked, leaves = _accumulators(params)
    order, shape = _walk(roots, [inputs[i] for i in input_idx], acc_index)
    key = (shape, store and bool(input_idx), len(params), hooked)
    plan = _PLANS.get(key) if leaves else None  # (a non-leaf parameter's node is no accumulator: no shape)
    if plan is None:
        input_nodes = {get_gradient_edge(inputs[i]).node for i in input_idx}
        plan = _analyse(order, roots, input_nodes, acc_index, params, hooked, key[1])
        if leaves:
            if len(_PLANS) >= _PLANS_KEPT:  # the first stored goes first
                _PLANS.pop(next(iter(_PLANS)))
            _PLANS[key] = plan

    captured: dict[int, tuple] = {}
    returned: dict[int, tuple] = {}
    handles = [order[i].register_prehook(lambda g, i=i: captured.__setitem__(i, g)) for i in plan.frontier]
    handles += [order[i].register_hook(lambda gi, _go, i=i: returned.__setitem__(i, gi)) for i, _ in plan.once]
    kept = WeightGradStore(plan.linears, plan.in_b, order, params) if plan.linears or plan.in_b else None
    try:
        if input_idx:  # the graph is kept for W only where W re-enters it
            extra = kept.extra_inputs() if kept is not None else []
            grads = torch.autograd.grad(outs, [inputs[i] for i in input_idx] + extra, grad_outputs=ograds,
                                        retain_graph=plan.retain, allow_unused=True)
            for i, g in zip(input_idx, grads):
                dinputs[i] = g
            if kept is not None:
                kept.keep(grads[len(input_idx):])
    finally:
        for h in handles:
            h.remove()
        if kept is not None:
            kept.release_hooks()

    slots = dict(plan.once)

    def to_group(picked, ents) -> _Group:
        grp = _Group(params=[params[k] for k in picked])
        for kind, i in ents:
            if kind == "once":  # enter below it, at its parameter-side edges
                nf = order[i].next_functions
                got = returned.get(i, ())
                for slot in slots[i]:
                    if slot < len(got) and got[slot] is not None:
                        grp.edges.append(GradientEdge(*nf[slot]))
                        grp.grads.append(got[slot])
            elif kind == "frontier":  # a node that got no gradient at all in B contributes nothing
                for slot, g in enumerate(captured.get(i, ())):
                    if g is not None:
                        grp.edges.append(GradientEdge(order[i], slot))
                        grp.grads.append(g)
            else:
                grp.edges.append(roots[i])
                grp.grads.append(ograds[i])
        return grp

    work = WeightGradWork([to_group(ks, ents) for ks, ents in plan.groups])
    work.pinned = [(order[i], captured[i]) for i in plan.frontier if i in captured]
    work.store = kept
    return dinputs, work


def _walk(roots: list, inputs: list, acc_index: dict) -> tuple[list, tuple]:
    """Every node of the graph below ``roots``, in the order a depth-first walk finds them, and the
    graph's shape: the walk written out, per node found its type, its number of children, and for
    an accumulator which parameter (its index) or stage input (-2 - its index) it accumulates
    into, for a stage input's own node -2 - its index, for a GEMM whether it scales by 1; a child
    found before is written as its position, a missing child as -1. The walk is
    determined by the graph, so two graphs of the same shape differ only in their tensors. (Every B
    runs it: it is written for speed.)"""
    position: dict = {None: -1}
    leaf_input = {id(t): -2 - k for k, t in enumerate(inputs) if t.grad_fn is None}
    at_input = {t.grad_fn: -2 - k for k, t in enumerate(inputs) if t.grad_fn is not None}
    shape: list = [tuple(e.output_nr for e in roots)]
    append = shape.append
    stack = [e.node for e in roots]
    pop, push, seen = stack.pop, stack.extend, position.get
    while stack:
        node = pop()
        at = seen(node)
        if at is not None:
            append(at)
            continue
        position[node] = len(position) - 1
        nf = node.next_functions
        kind = type(node)
        append(kind)
        append(len(nf))
        if kind is wgrad_store.ACCUMULATE:
            k = acc_index.get(node)
            append(k if k is not None else leaf_input.get(id(node.variable), -1))
            continue
        if kind is _ADDMM:  # a Linear's GEMM scales by 1 (``wgrad_store.find`` reads the scales)
            append(getattr(node, "_saved_alpha", None) == 1 and getattr(node, "_saved_beta", None) == 1)
        if at_input:
            append(at_input.get(node, -1))
        push([fn for fn, _ in nf])
    order = list(position)
    del order[0]
    return order, tuple(shape)


def _analyse(order, roots, input_nodes: set, acc_index: dict, params: list, hooked: frozenset,
             store: bool) -> _Plan:
    """The frontier nodes, W's groups and the layers ``wgrad_store`` computes, for one graph."""
    n_nodes = len(order)
    position = {node: i for i, node in enumerate(order)}
    kids = [tuple(position[fn] if fn is not None else -1 for fn, _ in node.next_functions) for node in order]
    children = [[c for c in ks if c >= 0] for ks in kids]
    param_bit = [0] * n_nodes
    for i, node in enumerate(order):
        k = acc_index.get(node)
        if k is not None:
            param_bit[i] = 1 << k
    # Post-order: per node, whether it leads to an input and which parameters lie below it.
    leads_in = [False] * n_nodes
    below = [0] * n_nodes
    done = [False] * n_nodes
    for start in range(n_nodes):
        stack = [start]
        while stack:
            i = stack[-1]
            if done[i]:
                stack.pop()
                continue
            pending = [c for c in children[i] if not done[c]]
            if pending:
                stack.extend(pending)
                continue
            stack.pop()
            done[i] = True
            leads_in[i] = order[i] in input_nodes or any(leads_in[c] for c in children[i])
            mask = param_bit[i]
            for c in children[i]:
                mask |= below[c]
            below[i] = mask

    owned: set = set()
    linears, in_b = [], []
    if store:
        layers = wgrad_store.find({order[i]: [order[c] for c in children[i]] for i in range(n_nodes)},
                                  {order[i]: leads_in[i] for i in range(n_nodes)}, acc_index, hooked)
        owned = {position[n] for n in layers.nodes}
        # in the order autograd runs the nodes (the newest first), in which it adds a shared weight's parts
        for lin in sorted(layers.linears, key=lambda lin: -lin.node._sequence_nr()):
            lin.node = position[lin.node]
            linears.append(lin)
        in_b = layers.in_b

    # Entry points of W: frontier nodes (captured in B) and output edges off the input path.
    entries = []  # (kind, position or output index, param mask of its parameter side)
    for i in range(n_nodes):
        if not leads_in[i] or i in owned:
            continue
        side = 0
        for c in children[i]:
            if not leads_in[c]:
                side |= below[c]
        if side:
            node = order[i]
            once = isinstance(node, BackwardCFunction) and not getattr(type(node)._forward_cls, "W_REENTERS", False)
            entries.append(("once" if once else "frontier", i, side))
    for j, e in enumerate(roots):
        if e.node is not None:
            i = position[e.node]
            if not leads_in[i] and below[i]:
                entries.append(("root", j, below[i]))

    # Group entries that share a parameter (one autograd.grad call per group, no double counting).
    groups: list[list] = []
    for ent in entries:
        merged = [grp for grp in groups if grp[0] & ent[2]]
        new = [ent[2], [ent]]
        for grp in merged:
            new[0] |= grp[0]
            new[1] += grp[1]
            groups.remove(grp)
        groups.append(new)
    clamp = any(below[c] & mask for mask, ents in groups for kind, i, _ in ents if kind != "root"
                for c in children[i] if leads_in[c])
    if clamp:  # one call with every frontier node pinned to its captured gradient
        mask = 0
        for m, _ in groups:
            mask |= m
        groups = [[mask, entries]]
    once = [(i, [s for s, c in enumerate(kids[i]) if c >= 0 and not leads_in[c]]) for kind, i, _ in entries
            if kind == "once"]
    return _Plan(
        linears=linears, in_b=in_b,
        frontier=[i for kind, i, _ in entries if kind == "frontier"], once=once,
        groups=[([k for k in range(len(params)) if m >> k & 1], [(kind, i) for kind, i, _ in ents])
                for m, ents in groups if ents],
        clamp=clamp, retain=bool(entries))


_ACCUMULATORS: dict[int, tuple] = {}  # id(parameter) -> (the parameter, its AccumulateGrad node)
_LAST: tuple = ((), None)  # the last call's parameters (identity, needs a gradient, has hooks) and its result


def _accumulators(params: Sequence[torch.Tensor]) -> tuple[list, dict, frozenset, bool]:
    """The trainable parameters; for each, the node that accumulates into its ``.grad`` (node ->
    index); the indices of those with hooks of their own (``Tensor.register_hook``); and whether
    every one is a leaf. ``get_gradient_edge`` makes a view to find a node (microseconds per
    parameter, per B), so the nodes of the last call's parameters are kept (and with them the
    parameters: a node holds its tensor); the next call with other parameters (after a migration)
    drops them."""
    global _ACCUMULATORS, _LAST
    ident = tuple((id(p), p.requires_grad, bool(p._backward_hooks)) for p in params)
    last = _LAST
    if ident == last[0]:
        return last[1]
    trainable = [p for p in params if p.requires_grad]
    kept: dict[int, tuple] = {}
    index: dict[Node, int] = {}
    leaves = True
    for k, p in enumerate(trainable):
        hit = _ACCUMULATORS.get(id(p))
        node = hit[1] if hit is not None and hit[0] is p else get_gradient_edge(p).node
        if p.is_leaf:  # (a non-leaf's node is new with every graph)
            kept[id(p)] = (p, node)
        else:
            leaves = False
        index.setdefault(node, k)
    hooked = frozenset(k for k, p in enumerate(trainable) if p._backward_hooks)
    _ACCUMULATORS = kept
    result = (trainable, index, hooked, leaves)
    _LAST = (ident, result) if leaves else ((), None)
    return result


def forget_parameters() -> None:
    """Drop the kept accumulator nodes (and with them the parameters): an engine that is destroyed,
    or whose layers moved, calls it."""
    global _ACCUMULATORS, _LAST
    _ACCUMULATORS = {}
    _LAST = ((), None)
    _PLANS.clear()
