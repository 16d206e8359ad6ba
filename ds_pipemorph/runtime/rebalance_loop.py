"""The rebalance loop in the engine: measure every stage, decide (``control.rebalance``), migrate.

At each iteration boundary every rank contributes one row: its stage's mean F, B and W per
micro-batch (from the op records, so an injected or real slowdown counts) and, for each layer it
holds, its weight (``layer_weight``: the parameters it computes with) and its signature
(``layer_signature``). Layers with equal signatures are assumed to cost the same on every stage,
which is how the loop tells a stage slow from the start from a healthy one; the assumption fails
where the activations' shapes change with depth (``control.rebalance``; a ``layer_profile`` then
says what each layer costs). The rows travel in the boundary's one all-gather
(``runtime.boundary``; a few hundred bytes), and every rank runs the same ``Rebalancer`` on the
same table (the slowest replica of each stage; no wall clock in the decision), so every rank
reaches the same ``Migration`` without another message. The engine runs it
(``LayerMigrator.migrate`` on every rank); if it succeeds everywhere, the partition's plan replaces
a ``zb`` schedule's (``1f1b`` and ``plan`` keep the order the user chose; ``adaptive`` re-plans
from its own measurements, which now come from the new partition).
"""
from __future__ import annotations

import functools
import hashlib
import logging
from typing import Optional

import torch
from deepspeed.pipe import TiedLayerSpec

from ..control.rebalance import Rebalancer
from ..fileio import BadInput
from ..plan.ir.memory import MemoryBudget
from ..plan.partition.layer_profile import read_layer_profile
from .boundary import Migration
from .config import PipeMorphConfigError
from .oprecords import fbw_ms_per_microbatch

logger = logging.getLogger(__name__)


class RebalanceLoop:
    """The rebalance loop's ``runtime.boundary.BoundaryLoop``: its row, and every rank's same ``Migration``."""

    def __init__(self, engine, budget: MemoryBudget):
        cfg = engine.pipemorph.rebalance
        S, N = engine.num_stages, engine.micro_batches
        layers = engine.module._num_layers
        profile = None
        if cfg.layer_profile:
            try:
                profile = read_layer_profile(cfg.layer_profile, stages=S, microbatches=N)
            except BadInput as e:
                raise PipeMorphConfigError(f"rebalance.layer_profile: {e}") from None
            if profile.num_layers != layers:
                raise PipeMorphConfigError(f"rebalance.layer_profile {cfg.layer_profile}: {profile.num_layers} layers, "
                                           f"but the model has {layers}")
        tied = tuple(i for i, spec in enumerate(engine.module._layer_specs) if isinstance(spec, TiedLayerSpec))
        self.budget = budget  # the engine's: its caps are read at every decision (a grant may come later)
        self.rebalancer = Rebalancer(S, N, list(engine.module.parts), list(budget.caps), noise=cfg.noise,
                                     patience=cfg.patience, min_gain=cfg.min_gain, warmup=cfg.warmup_iterations,
                                     profile=profile, pinned=tied)
        self.S, self.layers = S, layers
        self.events: list[dict] = []  # one per decision: what was decided and what the migration did
        # Per layer index, its (weight, signature) while the partition stays ``_described_parts``: a
        # layer index always names the same spec, but the stage's layers change with a migration
        # (a hand ``engine.repartition`` included), so a change of parts starts afresh. Keyed by
        # index, never by the layer objects: holding those would keep a moved-away layer's tensors
        # alive until the next exchange.
        self._described: dict[int, tuple[int, int]] = {}
        self._described_parts: Optional[tuple[int, ...]] = None

    @property
    def width(self) -> int:
        return 3 * self.S + 2 * self.layers

    def row(self, engine, records) -> torch.Tensor:
        """This rank's stage's F, B, W per micro-batch, then its layers' weights, then their
        signatures (zeros for the layers it does not hold)."""
        S, L = engine.num_stages, self.layers
        row = torch.zeros(self.width, dtype=torch.float64)
        row[3 * engine.stage_id: 3 * engine.stage_id + 3] = torch.tensor(fbw_ms_per_microbatch(records, engine.micro_batches))
        for layer, (weight, signature) in self.described(engine.module).items():
            row[3 * S + layer] = weight
            row[3 * S + L + layer] = signature
        return row

    def described(self, module) -> dict[int, tuple[int, int]]:
        """Each layer this stage holds: (``layer_weight``, ``layer_signature``), computed once per partition."""
        parts = tuple(module.parts)
        if parts != self._described_parts:
            self._described, self._described_parts = {}, parts
            for i, func in enumerate(module.forward_funcs):
                self._described[module._local_start + i] = (layer_weight(func), layer_signature(func))
        return self._described

    def decide(self, engine, table: torch.Tensor, sync_ms: float, exchange_ms: float) -> Optional[Migration]:
        """The same ``Migration`` on every rank, or None; per stage, its slowest replica counts."""
        S = self.S
        L = self.layers
        table = table.amax(dim=0)
        self.rebalancer.iteration = engine.boundary.iteration  # exchanges may skip iterations: count these
        self.rebalancer.set_caps(self.budget.caps)
        decision = self.rebalancer.observe(table[:3 * S].view(S, 3).tolist(), table[3 * S:3 * S + L].tolist(),
                                           [int(x) for x in table[3 * S + L:].tolist()])
        if decision is None:
            return None
        event = {"iteration": decision.iteration, "parts": decision.parts,
                 "slowdown": [round(x, 3) for x in decision.slowdown], "current_ms": round(decision.current_ms, 3),
                 "predicted_ms": round(decision.predicted_ms, 3)}
        # ``zb`` follows the partition; ``1f1b`` and ``plan`` keep the order the user chose, and
        # ``adaptive`` re-plans from its own measurements, which now come from the new partition.
        plan = decision.plan if engine.pipemorph.schedule == "zb" else None
        return Migration(list(decision.parts), plan, event)

    def quiet(self) -> bool:
        """Layer costs known and, at the last observation, every stage within ``noise`` of its
        reference: a drift must last ``patience`` observations, and one that starts brings the next
        exchange to the next iteration, so they are iterations in a row."""
        r = self.rebalancer
        if r.profile is None or not r.history:  # learning, or nothing observed since the last decision
            return False
        return all(ref / (1.0 + r.noise) <= x <= ref * (1.0 + r.noise) for x, ref in zip(r.history[-1], r.reference))

    def applied(self, engine, migration: Migration, report, seconds: float) -> None:
        """Every rank, after the engine ran ``migration``: the loop's bookkeeping and one log line."""
        event = {**migration.event, "ok": report.ok, "seconds": round(seconds, 4), "bytes_sent": report.bytes_sent,
                 "bytes_received": report.bytes_received, "reason": report.reason}
        if report.ok:
            self.rebalancer.moved(migration.parts)
        else:
            self.rebalancer.failed()
        self.events.append(event)
        if engine.global_rank == 0:
            logger.warning(f"pipemorph: rebalance: predicted slowdowns {event['slowdown']} -> parts {migration.parts} "
                           f"({event['current_ms']:.0f} -> {event['predicted_ms']:.0f} ms predicted): "
                           f"{report.describe()}")


# Signatures travel in the float64 boundary row: below 2**53 every integer is exact.
SIGNATURE_BITS = 52


def layer_signature(layer) -> int:
    """A number equal for layers that compute the same thing with the same parameters' shapes, on
    every rank; 0 for an ``nn.Module`` without parameters, which joins no class.

    A module: a hash of its type and its parameters' names, shapes, dtypes and whether they train
    (a frozen layer has no W). Anything else in the forward list is a function: a plain function
    or lambda, or the ``functools.partial(forward_fn, tied_module)`` DeepSpeed stores for a
    ``TiedLayerSpec`` with a ``forward_fn`` (a tied output head). A function that computes with a
    module (a partial's first argument, a bound method's object) may cost as much as a block (the
    head's matmul), so it is never free: its signature is a hash of the function's name and that
    module's parameters, a class of its own, and a stage holding it does not hold its blocks alone.
    A function without a module (a flatten or ``contiguous`` lambda between blocks, as DeepSpeed's
    examples write them) is 0, free, as a module without parameters is: otherwise a pipeline with
    one between every pair of blocks would have no stage holding its blocks alone.

    Python's own ``hash`` of a string differs between processes, so a fixed digest is used; no
    part of the text depends on memory addresses or file paths."""
    if isinstance(layer, torch.nn.Module):
        params = _parameters(layer)
        if not params:
            return 0
        text = f"{_type_name(layer)}:{params}"
    else:
        func, module = _callee(layer)
        if module is None:
            return 0
        text = f"function {_function_name(func)} of {_type_name(module)}:{_parameters(module)}"
    digest = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")
    return 1 + digest % (2**SIGNATURE_BITS - 1)


def layer_weight(layer) -> int:
    """What a layer's share of its stage's time is split by: the parameters it computes with (a
    module's own; a function's module's, e.g. the tied embedding a head multiplies by; 0 for a
    function without one)."""
    module = layer if isinstance(layer, torch.nn.Module) else _callee(layer)[1]
    return 0 if module is None else sum(p.numel() for p in module.parameters())


def _parameters(module: torch.nn.Module) -> list[tuple]:
    return [(name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in module.named_parameters()]


def _type_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _callee(layer) -> tuple[object, Optional[torch.nn.Module]]:
    """The function a non-module layer runs, and the module it computes with (or None)."""
    func, module = layer, None
    while True:
        if isinstance(func, functools.partial):
            if module is None and func.args and isinstance(func.args[0], torch.nn.Module):
                module = func.args[0]
            func = func.func
        elif isinstance(getattr(func, "__self__", None), torch.nn.Module) and hasattr(func, "__func__"):
            module = module if module is not None else func.__self__
            func = func.__func__
        else:
            return func, module


def _function_name(func) -> str:
    """Module, qualified name and, for Python code, its first line (two lambdas of one function share
    a qualified name); a callable object is named by its type."""
    name = getattr(func, "__qualname__", None)
    if not isinstance(name, str):
        return _type_name(func)
    code = getattr(func, "__code__", None)
    line = f":{code.co_firstlineno}" if code is not None else ""
    return f"{getattr(func, '__module__', None)}.{name}{line}"
