"""Per-stage modules of a user's model, built in one process without a process group.

``--model module:function`` returns a ``deepspeed.pipe.PipelineModule`` or a list of per-stage
``nn.Module``s. A PipelineModule normally needs a process group whose size its stage count
divides, and builds only its own stage's layers. So the function is called with
``PipelineModule.__init__`` replaced by a recorder (``recording_pipeline_modules``) that keeps the
constructor's arguments (layer specs, ``num_stages`` or ``topology``, ``loss_fn``,
``partition_method``) and does nothing else. DeepSpeed's own ``_partition_layers`` then computes the
stage boundaries (same method, same result as in training), and each stage's layers are built from
their ``LayerSpec``s and run the way ``PipelineModule.forward`` runs them: each layer receives the
previous layer's whole output; a ``TiedLayerSpec`` with ``forward_fn`` calls ``forward_fn(module, x)``
and layers tied by the same key within a stage share one module (tied layers in different stages are
separate copies, as in separate processes).
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, Iterator, Optional

import torch

from ..fileio import BadInput


def load_callable(spec: str, option: str) -> Callable:
    """``package.module:function`` (importable, or from the working directory) or ``path/file.py:function``."""
    mod_name, sep, fn_name = spec.rpartition(":")
    if not sep or not mod_name or not fn_name:
        raise BadInput(f"{option}: '{spec}' is not module:function (e.g. mymodel:build or models/gpt.py:build)")
    try:
        if mod_name.endswith(".py"):
            path = Path(mod_name)
            if not path.is_file():
                raise BadInput(f"{option}: no such file '{mod_name}'")
            sys.path.insert(0, str(path.resolve().parent))
            module_spec = importlib.util.spec_from_file_location(path.stem, path)
            module = importlib.util.module_from_spec(module_spec)
            module_spec.loader.exec_module(module)
        else:
            if os.getcwd() not in sys.path:
                sys.path.insert(0, os.getcwd())
            module = importlib.import_module(mod_name)
    except BadInput:
        raise
    except ImportError as e:
        raise BadInput(f"{option}: cannot import '{mod_name}' ({e})") from None
    except Exception as e:  # a module that raises while it is imported
        raise BadInput(f"{option}: importing '{mod_name}' failed: {type(e).__name__}: {e}") from None
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise BadInput(f"{option}: '{mod_name}' has no function '{fn_name}'")
    return fn


@contextlib.contextmanager
def recording_pipeline_modules() -> Iterator[None]:
    """While active, constructing a PipelineModule only records its arguments (``_pm_args``)."""
    from deepspeed.pipe import PipelineModule

    original = PipelineModule.__init__
    sig = inspect.signature(original)

    def record(self, *args, **kwargs):
        bound = sig.bind(self, *args, **kwargs)
        bound.apply_defaults()
        torch.nn.Module.__init__(self)
        self._pm_args = dict(bound.arguments)

    PipelineModule.__init__ = record
    try:
        yield
    finally:
        PipelineModule.__init__ = original


class StageModule(torch.nn.Module):
    """The layers of one stage, run in order like ``PipelineModule.forward`` runs them."""

    def __init__(self, funcs: list):
        super().__init__()
        self.funcs = funcs
        owners: dict[int, torch.nn.Module] = {}
        for f in funcs:
            m = _module_of(f)
            if m is not None:
                owners.setdefault(id(m), m)
        self.layers = torch.nn.ModuleList(owners.values())  # registered, so .parameters() sees them

    def forward(self, x):
        for f in self.funcs:
            x = f(x)
        return x


def _module_of(f) -> Optional[torch.nn.Module]:
    if isinstance(f, torch.nn.Module):
        return f
    owner = getattr(f, "module", None)  # a tied layer's forward_fn bound to its module
    return owner if isinstance(owner, torch.nn.Module) else None


class _TiedCall:
    def __init__(self, module: torch.nn.Module, forward_fn: Callable):
        self.module, self.forward_fn = module, forward_fn

    def __call__(self, x):
        return self.forward_fn(self.module, x)


def pipeline_stages(pm) -> tuple[list[StageModule], Optional[Callable], list[int]]:
    """Per-stage modules, the loss function and the layer boundaries of a recorded PipelineModule."""
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    a = pm._pm_args
    topology = a.get("topology")
    stages = topology.get_dim("pipe") if topology is not None else a.get("num_stages")
    if not stages or stages < 1:
        raise BadInput("--model: the PipelineModule has neither num_stages nor a topology")
    specs = list(a["layers"])
    pm._layer_specs, pm.num_stages, pm.global_rank = specs, stages, -1  # -1: DeepSpeed prints nothing
    pm._topo = SimpleNamespace(get_coord=lambda rank: SimpleNamespace(pipe=0))
    pm._partition_layers(method=a.get("partition_method") or "parameters")
    parts = list(pm.parts)
    modules = []
    for s in range(stages):
        tied: dict = {}
        funcs = []
        for spec in specs[parts[s]:parts[s + 1]]:
            if isinstance(spec, TiedLayerSpec):
                mod = tied.get(spec.key) or tied.setdefault(spec.key, spec.build())
                funcs.append(_TiedCall(mod, spec.forward_fn) if spec.forward_fn else mod)
            elif isinstance(spec, LayerSpec):
                funcs.append(spec.build())
            elif callable(spec):
                funcs.append(spec)
            else:
                raise BadInput(f"--model: layer {spec!r} is neither a LayerSpec, a module nor a function")
        modules.append(StageModule(funcs))
    return modules, a.get("loss_fn"), parts


def build_stages(factory: Callable) -> tuple[list[torch.nn.Module], Optional[Callable], Optional[list[int]]]:
    """Call ``factory()`` and return (per-stage modules, loss function or None, layer boundaries or None)."""
    from deepspeed.pipe import PipelineModule

    with recording_pipeline_modules():
        obj = factory()
    if isinstance(obj, PipelineModule):
        if not hasattr(obj, "_pm_args"):
            raise BadInput("--model: the PipelineModule was built before profiling started; build it inside the function")
        return pipeline_stages(obj)
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(m, torch.nn.Module) for m in obj):
        return list(obj), None, None
    raise BadInput(f"--model: expected a deepspeed.pipe.PipelineModule or a list of per-stage torch modules, "
                   f"got {type(obj).__name__}")
