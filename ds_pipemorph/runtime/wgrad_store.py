"""Weight gradients of Linear and LayerNorm layers left for W as tensors, not as a graph to re-enter.

The generic split (``bw_split``) leaves W the part of the autograd graph below each frontier node
and re-enters it: one engine call per group of parameters, and the whole graph kept from B to W.
For the layers that carry a transformer stage's parameters that is more than W needs. A Linear's
weight gradient is one GEMM of two tensors, the layer's input and the gradient arriving at its
output; a LayerNorm's are two vectors of its width. So
the stage's ``nn.Linear`` and ``nn.LayerNorm`` modules run through the autograd functions below
(``install``): their backward computes the input gradient and, while a ``WeightGradStore`` collects
(B), hands the weight-gradient computation to it instead of running it. W (``WeightGradStore.run``)
runs those GEMMs and reductions and accumulates their results with one ``torch.autograd.backward``
call on the parameters: autograd's ``AccumulateGrad`` runs once per parameter and fires every hook
registered on it (DeepSpeed's bf16 and ZeRO gradient hooks), as after a fused backward. Megatron's
zero-bubble fork keeps a queue of weight-gradient closures in the same way.

A layer defers only when ``bw_split`` lets it (``allowed``): its node lies on the path to the stage
inputs and each of its parameters is reached from deferring layers only. Anywhere else (a layer
whose output does not lead to an input, a weight also used by another op) the layer's node is an
ordinary node of the graph and W reaches it as before; without a store (a fused backward, stock
code around the module) the functions compute every gradient at once, as torch does.

Kept for W per deferred Linear: its input (what the forward saved anyway) and the gradient of its
output. A LayerNorm's weight gradients are two vectors of its width that come out of the same
kernel as its input gradient: B computes them, and W only accumulates them. When every parameter of a
stage defers, B frees the graph as it goes, as a fused backward does.
"""
from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F


class _Kept(torch.autograd.Function):
    """Holds tensors for W as autograd holds a node's saved tensors, so that every saved-tensor hook
    in force (the engine's activation meter, a user's offloading hooks) sees them as it sees the
    graph's: packed now, unpacked at W, released when the store is."""

    @staticmethod
    def forward(ctx, anchor, *tensors):
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx, _grad):  # never called: nothing differentiates through it
        raise RuntimeError("the weight-gradient store's holder is not differentiable")


_ANCHOR = torch.empty(0, requires_grad=True)  # gives ``_Kept`` a node (an input that needs a gradient)


class WeightGradStore:
    """The weight-gradient work of one B, run by W.

    Process-wide (autograd may run a backward on its device threads) and stacked: a checkpointed
    chunk recomputed inside B collects into its own store while the stage's waits.
    """

    _stack: list["WeightGradStore"] = []

    def __init__(self, allowed: set, nodes: set):
        self.allowed = allowed  # the autograd nodes (the layers' ``ctx``) that may defer
        self.nodes = nodes  # every node of the graph B runs (``allowed`` among them)
        self.entries: list[tuple] = []  # (compute, output gradient, saved tensors, params)
        self._kept: Optional[torch.Tensor] = None  # after ``seal``: holds the entries' saved tensors

    def __enter__(self) -> "WeightGradStore":
        WeightGradStore._stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        WeightGradStore._stack.remove(self)

    @staticmethod
    def collecting(ctx) -> Optional["WeightGradStore"]:
        """The store of the B whose graph holds the node ``ctx``, or None (a fused backward, or W
        entering the graph again). Chosen by the node, not by the order of the stack: a device thread
        may run a node of the stage's graph while a checkpointed chunk's B is on top of it."""
        for store in reversed(WeightGradStore._stack):
            if ctx in store.nodes:
                return store
        return None

    def put(self, compute, grad: torch.Tensor, saved: tuple, params: tuple) -> None:
        """Keep ``compute(grad, *saved) -> gradients of params`` for W: ``saved`` are tensors the
        forward saved, ``grad`` the gradient B computed for the layer's output."""
        self.entries.append((compute, grad, saved, params))

    def seal(self) -> None:
        """After B: hold the entries' saved tensors as saved tensors (``_Kept``), not as plain references,
        and let go of the graph's nodes (only B chooses by them)."""
        self.allowed, self.nodes = set(), set()
        saved = [t.detach() for _, _, ts, _ in self.entries for t in ts]  # no edge into the graph B ran
        with torch.enable_grad():
            self._kept = _Kept.apply(_ANCHOR, *saved)
        self.entries = [(c, g, len(ts), p) for c, g, ts, p in self.entries]

    def grads(self) -> list[torch.Tensor]:
        """The output gradients kept (for the memory report)."""
        return [grad for _, grad, _, _ in self.entries if grad is not None]

    def run(self) -> None:
        """Compute every kept weight gradient and accumulate them in one autograd call."""
        saved = iter(self._kept.grad_fn.saved_tensors)
        summed: dict[int, list] = {}
        for compute, grad, n, params in self.entries:
            for p, g in zip(params, compute(grad, *(next(saved) for _ in range(n)))):
                if g is None or p is None:
                    continue
                slot = summed.get(id(p))
                if slot is None:
                    summed[id(p)] = [p, g]
                else:
                    slot[1] = slot[1] + g
        self.entries, self._kept = [], None
        if summed:
            tensors, grads = zip(*summed.values())
            torch.autograd.backward(list(tensors), grad_tensors=list(grads))


def _linear_wgrad(x, gy, need_w, need_b):
    x2 = x.reshape(-1, x.shape[-1])
    gy2 = gy.reshape(-1, gy.shape[-1])
    return (gy2.t().mm(x2) if need_w else None, gy2.sum(0) if need_b else None)


class _Linear(torch.autograd.Function):
    W_REENTERS = True  # in B only the input gradient (or the store's); W enters again for the rest (bw_split)

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.params = (weight, bias)  # the parameters themselves, whatever saved-tensor hooks return
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        w, b = ctx.params
        need_w, need_b = ctx.needs_input_grad[1], b is not None and ctx.needs_input_grad[2]
        store = WeightGradStore.collecting(ctx)
        if store is not None:  # B: the input gradient only
            if ctx in store.allowed and (need_w or need_b):
                store.put(lambda gy, x: _linear_wgrad(x, gy, need_w, need_b), gy, (x,),
                          (w if need_w else None, b if need_b else None))
            return gx, None, None
        gw, gb = _linear_wgrad(x, gy, need_w, need_b)
        return gx, gw, gb


def _computed(_grad, *grads):
    return grads


def _norm_grads(gy, x, shape, mean, rstd, weight, bias, mask):
    return torch.ops.aten.native_layer_norm_backward(gy, x, shape, mean, rstd, weight, bias, mask)


class _LayerNorm(torch.autograd.Function):
    W_REENTERS = True  # as _Linear

    @staticmethod
    def forward(ctx, x, weight, bias, shape, eps):
        out, mean, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
        ctx.save_for_backward(x, weight, bias, mean, rstd)
        ctx.shape = shape
        ctx.params = (weight, bias)
        return out

    @staticmethod
    def backward(ctx, gy):
        x, weight, bias, mean, rstd = ctx.saved_tensors
        need = list(ctx.needs_input_grad[:3])
        need[2] = need[2] and bias is not None
        need[1] = need[1] and weight is not None
        store = WeightGradStore.collecting(ctx)
        if store is not None and ctx in store.allowed and (need[1] or need[2]):
            # B: the weight gradients of a norm are two vectors of the layer's width, computed in the
            # same kernel as the input gradient: B computes them and W only accumulates them (what
            # W would need to compute them later, the input and the gradient, is far larger).
            gx, gw, gb = _norm_grads(gy, x, ctx.shape, mean, rstd, weight, bias, need)
            got = [(p, g) for p, g, n in zip(ctx.params, (gw, gb), need[1:]) if n]
            store.put(_computed, None, tuple(g for _, g in got), tuple(p for p, _ in got))
            return gx, None, None, None, None
        if store is not None:  # B, a norm whose parameters W reaches through the graph: input gradient only
            gx = _norm_grads(gy, x, ctx.shape, mean, rstd, weight, bias, [need[0], False, False])[0] \
                if need[0] else None
            return gx, None, None, None, None
        gx, gw, gb = _norm_grads(gy, x, ctx.shape, mean, rstd, weight, bias, need)
        return gx, gw, gb, None, None


NODE_TYPES = (_Linear._backward_cls, _LayerNorm._backward_cls)


def _autocast_on() -> bool:
    return torch.is_autocast_enabled("cuda") or torch.is_autocast_enabled("cpu")


def _linear_forward(self, x):
    if not torch.is_grad_enabled() or _autocast_on() or not (self.weight.requires_grad or x.requires_grad):
        return F.linear(x, self.weight, self.bias)
    return _Linear.apply(x, self.weight, self.bias)


def _norm_forward(self, x):
    if not torch.is_grad_enabled() or _autocast_on():
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
    return _LayerNorm.apply(x, self.weight, self.bias, list(self.normalized_shape), self.eps)


def install(module: torch.nn.Module) -> int:
    """Route the ``nn.Linear`` and ``nn.LayerNorm`` layers of ``module`` (those that keep the stock
    ``forward``) through the store's functions; returns how many. The parameters are unchanged."""
    count = 0
    for m in module.modules():
        if isinstance(m, torch.nn.Linear) and type(m).forward is torch.nn.Linear.forward:
            m.forward = types.MethodType(_linear_forward, m)
        elif isinstance(m, torch.nn.LayerNorm) and type(m).forward is torch.nn.LayerNorm.forward \
                and m.elementwise_affine:
            m.forward = types.MethodType(_norm_forward, m)
        else:
            continue
        count += 1
    return count


def uninstall(module: torch.nn.Module) -> None:
    """Give the layers ``install`` routed their stock forward back."""
    for m in module.modules():
        fwd = m.__dict__.get("forward")
        if isinstance(fwd, types.MethodType) and fwd.__func__ in (_linear_forward, _norm_forward):
            del m.forward
