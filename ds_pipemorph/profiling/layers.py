"""Per-layer costs and sizes of a model, measured in this process: the layer profile that
``pipemorph partition`` reads (``plan.partition.layer_profile``, docs/partition.md).

Each layer runs on its real input: the sample micro-batch carried through the layers before it.
F, B and W are timed as ``stages.time_stage`` times a stage, each layer as a one-layer stage:
B and W split as the engine splits them (``runtime.bw_split``; or autograd's split on request). The first
layer's input is data: its B is (close to) zero and its W is its whole backward, as in the engine;
every other layer's input needs a gradient. The last layer includes the loss. A layer whose output
needs no gradient (a function without parameters applied to data) has F only; its B and W are 0.

Sizes are in MB (2**20 bytes), per micro-batch where not said otherwise:

- ``activation_mb``: the layer's output tensors, sent forward when a stage ends after the layer;
- ``gradient_mb``: those of them that get a gradient back (floating, requiring grad);
- ``stash_mb``: what autograd saves for backward during the layer's forward (and the loss's, on the
  last layer), seen through ``torch.autograd.graph.saved_tensors_hooks``: each storage once, the
  layer's own parameters left out (they are in ``memory_mb``). Layers are measured apart, so a
  tensor saved by two neighbouring layers (a ReLU's output, saved again as the next Linear's
  input) counts in both;
- ``memory_mb``: held the whole iteration: 4 × the bytes of the trainable parameters (parameters,
  gradients and Adam's two moments, all in the parameters' dtype; mixed precision's fp32 master
  copies are not counted), plus frozen parameters and buffers once;
- ``param_count``: trainable parameters, what DeepSpeed's ``"parameters"`` partition balances.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch
from pydantic import ValidationError

from ..fileio import BadInput, describe, dump, first_line, write_atomic
from ..plan.partition.layer_profile import LayerProfile
from .pipecapture import StageModule, _TiedCall, recording_pipeline_modules
from .stages import _split_available, _stage_input, _sync, _tensors, _to, time_stage

MB = 2 ** 20


@dataclass(frozen=True)
class LayerCosts:
    name: str
    forward_ms: float
    backward_input_ms: float
    backward_weight_ms: float
    activation_mb: float
    gradient_mb: float
    memory_mb: float
    stash_mb: float
    params: int


def model_layers(factory: Callable) -> tuple[list, Optional[Callable], Optional[int]]:
    """``factory()``'s layers, loss function (or None) and stage count (or None).

    A ``PipelineModule`` (built while only its arguments are recorded) gives its layer list, in
    DeepSpeed's layer numbering, its ``loss_fn`` and its ``num_stages`` (or the topology's); a list
    of modules, ``LayerSpec``s or functions is taken as the layers."""
    from deepspeed.pipe import LayerSpec, PipelineModule

    with recording_pipeline_modules():
        obj = factory()
    if isinstance(obj, PipelineModule):
        if not hasattr(obj, "_pm_args"):
            raise BadInput("--model: the PipelineModule was built before profiling started; build it inside the function")
        a = obj._pm_args
        topology = a.get("topology")
        stages = topology.get_dim("pipe") if topology is not None else a.get("num_stages")
        return list(a["layers"]), a.get("loss_fn"), stages
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(m, LayerSpec) or callable(m) for m in obj):
        return list(obj), None, None
    raise BadInput(f"--model: expected a deepspeed.pipe.PipelineModule or a list of layers (modules, LayerSpecs "
                   f"or functions), got {type(obj).__name__}")


def build_layers(layers: Sequence) -> list[tuple[str, StageModule]]:
    """(name, module) per layer: ``LayerSpec``s built, ``TiedLayerSpec``s of one key sharing one
    module (as within a stage), modules and functions as they are."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    tied: dict = {}
    out = []
    for i, spec in enumerate(layers):
        if isinstance(spec, TiedLayerSpec):
            if spec.key not in tied:
                tied[spec.key] = spec.build()
            f, name = tied[spec.key], f"{spec.typename.__name__} (tied '{spec.key}')"
            if spec.forward_fn:
                f = _TiedCall(f, spec.forward_fn)
        elif isinstance(spec, LayerSpec):
            f, name = spec.build(), spec.typename.__name__
        elif callable(spec):
            f = spec
            name = type(spec).__name__ if isinstance(spec, torch.nn.Module) else getattr(spec, "__name__", "function")
        else:
            raise BadInput(f"layer {i} ({spec!r}) is neither a LayerSpec, a module nor a function")
        out.append((name, StageModule([f])))
    return out


def profile_layers(layers: Sequence, inputs, labels=None, loss_fn: Optional[Callable] = None, *,
                   warmup: int = 2, reps: int = 5, split: Optional[str] = None,
                   device: torch.device = torch.device("cpu"),
                   on_layer: Callable[[int], None] = lambda i: None) -> tuple[list[LayerCosts], str]:
    """Costs of every layer (median of ``reps`` timed rounds after ``warmup``), and the B/W split
    used ("runtime" or "autograd"; None picks runtime if present). ``loss_fn(output, labels)``
    ends the last layer when both are given."""
    if split is None:
        split = "runtime" if _split_available() else "autograd"
    built = build_layers(layers)
    x = _to(inputs, device)
    labels = _to(labels, device)
    loss = (lambda out: loss_fn(out, labels)) if loss_fn is not None and labels is not None else None
    costs = []
    for i, (name, m) in enumerate(built):
        m.to(device).train()
        last = i == len(built) - 1
        try:
            c, x = _measure(name, m, x, first=i == 0, loss=loss if last else None, warmup=warmup, reps=reps,
                            split=split, device=device)
        except BadInput as e:
            raise BadInput(f"layer {i} ({name}): {e}") from None
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            msg = first_line(e)
            raise BadInput(f"layer {i} ({name}) failed on its sample input: {type(e).__name__}: {msg}") from None
        costs.append(c)
        on_layer(i)
    return costs, split


def _measure(name, m, x, *, first, loss, warmup, reps, split, device) -> tuple[LayerCosts, object]:
    """One layer's costs, and its output (detached): the next layer's input."""
    act, grad, stash, y, grads = _sizes(m, x, first, loss)
    f, b, w = _time_layer(m, x, grads, first=first, loss=loss, warmup=warmup, reps=reps, split=split, device=device)
    trainable = [p for p in m.parameters() if p.requires_grad]
    held = sum(_nbytes(p) for p in m.parameters() if not p.requires_grad) + sum(_nbytes(buf) for buf in m.buffers())
    memory = 4 * sum(_nbytes(p) for p in trainable) + held
    c = LayerCosts(name, f, b, w, act / MB, grad / MB, memory / MB, stash / MB, sum(p.numel() for p in trainable))
    return c, y


def _sizes(m, x, first: bool, loss) -> tuple[int, int, int, object, list]:
    """One untimed forward: output bytes, bytes of the outputs that get a gradient, bytes saved for
    backward (each storage once, parameters left out), the detached output, and a gradient for
    each output (or the loss) that needs one: ones for a scalar, else random normal."""
    own = {_storage_key(p) for p in m.parameters()}
    saved: dict = {}

    def pack(t):
        key = _storage_key(t)
        if key not in own:
            saved[key] = _storage_bytes(t)
        return t

    xin = _stage_input(x, needs_grad=not first)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = m(xin)
        z = loss(y) if loss is not None else y
    outs = _tensors(y)
    act = sum(_nbytes(t) for t in outs)
    grad = sum(_nbytes(t) for t in outs if t.requires_grad)
    grads = [torch.ones_like(o) if o.dim() == 0 else torch.randn_like(o) for o in _tensors(z) if o.requires_grad]
    detached = y.detach() if isinstance(y, torch.Tensor) else type(y)(
        t.detach() if isinstance(t, torch.Tensor) else t for t in y)
    return act, grad, sum(saved.values()), detached, grads


def _time_layer(m, x, grads: list, *, first, loss, warmup, reps, split, device) -> tuple[float, float, float]:
    """Median F, B and W (ms) of one layer: ``stages.time_stage`` with the output gradients
    ``grads`` drawn beforehand. Without ``grads`` (nothing to differentiate) only F runs; B and W
    are 0."""
    if grads:
        t = time_stage(m, x, first=first, loss=loss, warmup=warmup, reps=reps, split=split, device=device,
                       grads=grads)
        return t.forward_ms, t.backward_input_ms, t.backward_weight_ms
    f_ms = []
    for i in range(warmup + reps):
        xi = _stage_input(x, needs_grad=not first)
        _sync(device)
        t0 = time.perf_counter()
        out = m(xi)
        if loss is not None:
            out = loss(out)
        _sync(device)
        if i >= warmup:
            f_ms.append((time.perf_counter() - t0) * 1e3)
        del out, xi
    return statistics.median(f_ms), 0.0, 0.0


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _storage_key(t: torch.Tensor):
    try:
        return ("storage", t.untyped_storage().data_ptr(), t.device)
    except (RuntimeError, NotImplementedError):  # a tensor without a plain storage
        return ("tensor", id(t))


def _storage_bytes(t: torch.Tensor) -> int:
    """What a saved tensor keeps alive: its whole storage (a saved view holds all of it)."""
    try:
        return t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):
        return _nbytes(t)


def layer_profile_data(costs: Sequence[LayerCosts], stages: int, microbatches: int) -> dict:
    """The layer profile (docs/partition.md) of measured layers, checked by ``LayerProfile``;
    BadInput saying why not (e.g. fewer layers than stages)."""
    data = {
        "stages": stages,
        "microbatches": microbatches,
        "layers": {
            "forward_ms": [round(c.forward_ms, 4) for c in costs],
            "backward_input_ms": [round(c.backward_input_ms, 4) for c in costs],
            "backward_weight_ms": [round(c.backward_weight_ms, 4) for c in costs],
            "activation_mb": [c.activation_mb for c in costs],
            "gradient_mb": [c.gradient_mb for c in costs],
            "memory_mb": [c.memory_mb for c in costs],
            "stash_mb": [c.stash_mb for c in costs],
            "param_count": [c.params for c in costs],
        },
    }
    try:
        LayerProfile.model_validate(data)
    except ValidationError as e:
        raise BadInput(f"the layer profile: {describe(e)}") from None
    return data


def write_layer_profile(path, data: dict) -> None:
    """Write ``data`` atomically: YAML, or JSON when the name ends in ``.json``."""
    write_atomic(path, dump(data, str(path).lower().endswith(".json")))
