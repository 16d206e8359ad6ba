"""Weight gradients of a stage's Linear and LayerNorm layers (and of parameters an elementwise op
applies), read off torch's own graph.

The generic split (``bw_split``) leaves W the part of the autograd graph below each frontier node
and re-enters it: the whole graph kept from B to W, and one more pass of the engine through it. For
the layers that carry a transformer stage's parameters that is more than W needs, and the layers
are recognised in the graph the stock modules build, so nothing is routed or wrapped:

- a **Linear** is an ``AddmmBackward0`` (with a bias) or ``MmBackward0`` (without) whose second
  matrix is the weight transposed (``TBackward0`` over the weight's ``AccumulateGrad``). Its weight
  gradient is one GEMM of two tensors: the layer's input, which the node saved (``_saved_mat1`` /
  ``_saved_self``), and the gradient arriving at the node, which a pre-hook on the node keeps in B
  (after any hook on the tensor the node produced has run). B keeps both and W runs the GEMM, in
  the arrangement torch's ``mm_mat2_backward`` uses; a weight several Linears share gets their
  parts summed in the order autograd adds them. The gradients are the fused backward's bit for bit
  (tested in fp32 and bf16). The bias
  gradient, a sum over rows of that gradient, B asks autograd for directly (the bias among
  ``inputs``): the node computes it as in a fused backward, and W only accumulates it.
- a **LayerNorm** is a ``NativeLayerNormBackward0``. Its weight gradients are two vectors of its
  width that come out of the same kernel as its input gradient, so B asks for them too (its
  parameters among ``inputs``) and W only accumulates them; keeping what W would need to compute
  them later (the input and the gradient) would cost far more.
- an **elementwise parameter** is a parameter added to, subtracted from or multiplied with an
  activation by one ``AddBackward0``, ``SubBackward0`` or ``MulBackward0`` (a bias added apart
  from its GEMM, as ``nn.MultiheadAttention``'s packed input projection adds it, and then ``F.linear``
  gives an ``MmBackward0``; the scale of a hand-written RMSNorm). Its gradient is the node's
  output for it, reduced to its shape: an elementwise product at most, in the same class of cost as
  the node's input gradient, so B asks for it as for a norm's.

W accumulates every such gradient with one call of autograd's engine on the parameters (``accumulate``:
what ``torch.autograd.backward`` runs), so autograd's ``AccumulateGrad`` runs once per parameter
and fires every hook registered on it (DeepSpeed's bf16 and ZeRO gradient hooks), as after a fused
backward. Megatron's zero-bubble fork keeps a queue of weight-gradient closures in the same spirit.

A layer's gradients go this way only when each of its parameters is a leaf reached from such
layers only (``find``); anywhere else (a weight also used by another op, a Linear under autocast,
whose weight reaches the GEMM through a cast, a bias, norm or elementwise parameter with a
``register_hook`` of its own, which B and W would both run) the layer is an ordinary node of the
graph and W re-enters it.
When every parameter of a stage goes this way, B frees the graph as it goes, as a fused backward
does. The Linears' inputs are read from their nodes when B starts, so a saved-tensor hook's unpack
runs for them then, not when autograd reaches each node: under torch's non-reentrant checkpoint
inside a stage (``torch.utils.checkpoint(..., use_reentrant=False)``) that recomputes the region
again before B (the gradients stay exact; the engine's own ``activation_checkpoint_interval``
recomputes once). They are held detached, with their versions (a change in place before W is an
error), and while a saved-tensor hook is in force (the engine's activation meter, a user's
offloading hooks) as saved tensors of a small autograd node (``_Kept``), so the hook sees them
until W as it saw them in the graph.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.graph import Node
from torch.overrides import has_torch_function

_engine_run_backward = getattr(torch.autograd.graph, "_engine_run_backward", None)  # torch's own, after its checks

ACCUMULATE = type(torch.empty(1, requires_grad=True).view(1).grad_fn.next_functions[0][0])  # AccumulateGrad's type
# node name -> (child index of the input, child index of the transposed weight, saved input's attribute)
_LINEAR = {"AddmmBackward0": (1, 2, "_saved_mat1"), "MmBackward0": (0, 1, "_saved_self")}
_NORM = "NativeLayerNormBackward0"
# An elementwise op between an activation and a parameter (a bias added apart from its GEMM, as
# ``nn.MultiheadAttention``'s input projection adds it; a scale, as a hand-written RMSNorm applies it)
_ELEMENTWISE = frozenset({"AddBackward0", "SubBackward0", "MulBackward0"})


class _Kept(torch.autograd.Function):
    """Holds tensors for W as autograd holds a node's saved tensors: packed now, unpacked at W,
    released when the store is."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):  # never called: nothing differentiates through it
        raise RuntimeError("the weight-gradient store's holder is not differentiable")


_ANCHOR = torch.empty(0, requires_grad=True)  # gives ``_Kept`` a node (an input that needs a gradient)
# Whether a saved-tensor hook is in force (torch has no public query; without it, always hold).
_hooks_in_force = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", lambda _tracing: True)


@dataclass
class Linear:
    node: object  # its node (``find``), or the node's position in a walk (``bw_split``)
    weight: int  # index into the stage's parameters
    saved: str  # the node's attribute holding the layer's input


@dataclass
class Layers:
    """The layers of one graph whose weight gradients the store computes (``find``)."""

    linears: list  # Linear
    in_b: list  # indices of the parameters whose gradients B computes (biases, norms', elementwise)
    nodes: set  # every node these layers own (theirs, the transposes, the accumulators)


def find(children: dict, leads_in: dict, acc_index: dict, hooked: frozenset = frozenset()) -> Layers:
    """The Linear, LayerNorm and elementwise-parameter nodes on the input path whose parameters are
    reached from such nodes only. ``children``: every node's child nodes; ``leads_in``: whether a
    node leads to a stage input; ``acc_index``: a parameter's ``AccumulateGrad`` node -> its index
    in the stage's parameters; ``hooked``: indices of parameters with hooks of their own
    (``Tensor.register_hook``): a layer whose bias, norm or elementwise parameter has one stays the
    graph's (B would run the hook on the gradient it computes, and W again on accumulating it)."""
    def accumulator(c) -> bool:
        return type(c) is ACCUMULATE and c in acc_index

    owned: dict[Node, tuple] = {}  # node -> (kind, the param-side nodes it owns, details)
    for n in children:
        if not leads_in[n]:
            continue
        name = type(n).__name__
        spec = _LINEAR.get(name)
        nf = n.next_functions
        if spec is not None:
            at_in, at_w, saved = spec
            t = nf[at_w][0]
            if t is None or type(t).__name__ != "TBackward0" or not leads_in.get(nf[at_in][0], False):
                continue
            acc = t.next_functions[0][0]
            bias = nf[0][0] if name == "AddmmBackward0" else None
            if not accumulator(acc) or (bias is not None and (not accumulator(bias) or acc_index[bias] in hooked)):
                continue
            if not hasattr(n, saved) or (name == "AddmmBackward0" and (getattr(n, "_saved_alpha", None) != 1
                                                                        or getattr(n, "_saved_beta", None) != 1)):
                continue
            owned[n] = ("linear", (t, acc) + ((bias,) if bias is not None else ()),
                        (Linear(n, acc_index[acc], saved), [acc_index[bias]] if bias is not None else []))
        elif name == _NORM:
            accs = [c for c, _ in nf[1:3] if c is not None]
            if not accs or not leads_in.get(nf[0][0], False) or not all(accumulator(c) for c in accs) \
                    or any(acc_index[c] in hooked for c in accs):
                continue
            owned[n] = ("norm", tuple(accs), (None, [acc_index[c] for c in accs]))
        elif name in _ELEMENTWISE:  # x (+, -, *) parameter: the parameter's gradient is B's, as a norm's
            kids = [c for c, _ in nf]
            accs = [c for c in kids if accumulator(c)]
            if len(kids) != 2 or len(accs) != 1 or acc_index[accs[0]] in hooked \
                    or not leads_in.get(kids[1] if accs[0] is kids[0] else kids[0], False):
                continue
            owned[n] = ("elementwise", tuple(accs), (None, [acc_index[accs[0]]]))
    if not owned:
        return Layers([], [], set())
    # Each parameter (and each transpose) must be reached from the layers that own it only.
    watched = {c for _, side, _ in owned.values() for c in side}
    parents: dict[Node, list] = {}
    for node, kids in children.items():
        for c in kids:
            if c in watched:
                parents.setdefault(c, []).append(node)
    changed = True
    while changed:
        changed = False
        mine = {c: n for n, (_, side, _) in owned.items() for c in side}
        for n, (kind, side, _) in list(owned.items()):
            for c in side:
                ok = all(p is n or (mine.get(p) is not None and type(p).__name__ == "TBackward0")
                         for p in parents.get(c, ()))
                if type(c).__name__ == "TBackward0":
                    ok = parents.get(c, []) == [n]
                if not ok:
                    del owned[n]
                    changed = True
                    break
    linears = [lin for _, _, (lin, _) in owned.values() if lin is not None]
    in_b = [k for _, _, (_, ks) in owned.values() for k in ks]
    nodes = set(owned) | {c for _, side, _ in owned.values() for c in side}
    return Layers(linears, in_b, nodes)


class WeightGradStore:
    """What one B keeps for the layers ``find`` chose, and W's computation of their gradients.
    ``linears`` name their nodes by their position in ``order`` (``bw_split``); ``in_b`` are the
    parameters whose gradients B computes.

    The gradient arriving at each Linear is kept by a pre-hook on its node, which autograd runs
    after the hooks registered on the tensor the node produced (``Tensor.register_hook``), so W's
    GEMM sees the gradient B's input gradient saw."""

    def __init__(self, linears: list, in_b: list, order: list, params: list):
        self.params = params
        self.linears = linears
        nodes = [order[lin.node] for lin in linears]
        self.inputs = [getattr(n, lin.saved) for n, lin in zip(nodes, linears)]  # before B frees them
        self.in_b = in_b
        self.gys: list = [None] * len(linears)
        self.b_grads: list = []
        self._versions: list = []
        self._kept: Optional[torch.Tensor] = None
        self._hooks = [n.register_prehook(self._keeper(i)) for i, n in enumerate(nodes)]

    def _keeper(self, i: int):
        def keep(grads):
            self.gys[i] = grads[0]
        return keep

    def extra_inputs(self) -> list:
        """What B asks autograd for beside the stage inputs: the gradients of the ``in_b`` parameters."""
        return [self.params[k] for k in self.in_b]

    def release_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []

    def keep(self, grads) -> None:
        """After B: ``grads`` are what autograd returned for ``extra_inputs``. The Linears' inputs are
        held detached (nothing of the graph stays alive through them) with their versions, so an
        in-place change before W is an error, as autograd's own saved tensors make it; where a
        saved-tensor hook is in force they are held as saved tensors (``_Kept``), so the hook sees
        them until W as it saw them in the graph."""
        self.b_grads = list(grads)
        inputs = [t.detach() for t in self.inputs]
        if _hooks_in_force(False) is not None:
            with torch.enable_grad():
                self._kept = _Kept.apply(_ANCHOR, *inputs)
            self.inputs = []
        else:
            self.inputs = inputs
            self._versions = [t._version for t in inputs]

    def grads(self) -> list[torch.Tensor]:
        """The gradients kept for W (for the memory report): at each Linear's output, and those B
        computed for the ``in_b`` parameters."""
        return [g for g in self.gys + self.b_grads if g is not None]

    def run(self) -> None:
        """Compute every kept weight gradient and accumulate them in one autograd call. A weight's
        gradient is computed as torch's ``mm_mat2_backward`` computes it for ``x @ weight.t()``:
        ``gy^T x`` for a contiguous weight, ``(x^T gy)^T`` otherwise."""
        params = self.params
        ks: list[int] = []
        grads: list[torch.Tensor] = []
        at: dict[int, int] = {}

        def add(k, g):
            j = at.get(k)
            if j is None:
                at[k] = len(ks)
                ks.append(k)
                grads.append(g)
            else:  # a weight Linears share: summed in the order autograd adds them (``linears``' order)
                grads[j] = grads[j] + g

        if self._kept is not None:
            inputs = self._kept.grad_fn.saved_tensors
        else:
            inputs = self.inputs
            if any(t._version != v for t, v in zip(inputs, self._versions)):
                raise RuntimeError("a Linear layer's input was modified in place between its B and its W; "
                                   "W needs it as the forward saw it")
        for lin, gy, x in zip(self.linears, self.gys, inputs):
            if gy is not None:
                w = params[lin.weight]
                add(lin.weight, gy.t().mm(x) if w.stride(1) == 1 and w.stride(0) == w.size(1) else x.t().mm(gy).t())
        for k, g in zip(self.in_b, self.b_grads):
            if g is not None:
                add(k, g)
        self.linears, self.gys, self.b_grads, self.inputs, self._versions, self._kept = [], [], [], [], [], None
        if ks:
            accumulate(tuple(params[k] for k in ks), tuple(grads))


def accumulate(tensors: tuple, grads: tuple) -> None:
    """``torch.autograd.backward(tensors, grads)``: every tensor's ``AccumulateGrad`` runs once, with
    its hooks. The gradients here are computed for exactly these tensors (their shapes and dtypes),
    so torch's check of them (``_make_grads``, tens of microseconds a call) is skipped where torch
    has the engine's entry point and no tensor overrides torch functions."""
    if _engine_run_backward is None or has_torch_function(tensors):
        torch.autograd.backward(list(tensors), grad_tensors=list(grads))
    else:
        _engine_run_backward(tensors, grads, False, False, (), allow_unreachable=True, accumulate_grad=True)
