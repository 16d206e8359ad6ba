"""Per-micro-batch op times in the real engine (testing and benchmarks only).

``VaryInjector`` is an engine hook (``runtime.hooks``) on F, B and W: each op of (stage, kind,
micro-batch) lasts the time a ``plan.sim.variation.OpTable`` gives it: the handler runs (an emulated
stage built with the table's smallest times, or a real model), then the op sleeps until its start
plus the table's time. ``tables(k)`` gives the table of iteration k, so variation can change every
iteration (seeded: the simulator replays the same tables). Timing only: the numbers computed are untouched.
"""
from __future__ import annotations

from collections.abc import Callable

from ..plan.sim.variation import OpTable
from ..runtime import instructions as I
from ..runtime.hooks import EngineHooks
from .emulated import _sleep_until

_KINDS = {I.ForwardPass: "F", I.BackwardInputPass: "B", I.BackwardWeightPass: "W"}


class VaryInjector(EngineHooks):
    ops = frozenset(_KINDS)

    def __init__(self, tables: Callable[[int], OpTable], stage: int):
        self.tables, self.stage = tables, stage
        self.iteration = -1
        self._table: OpTable | None = None

    def start_iteration(self, engine=None) -> None:
        self.iteration += 1
        self._table = self.tables(self.iteration)

    def after_op(self, engine, instruction, kwargs, started) -> None:
        _sleep_until(started, self._table(self.stage, _KINDS[instruction], kwargs["micro_batch"]))


def install(engine, tables: Callable[[int], OpTable]) -> VaryInjector:
    """Add the injector to ``engine``'s hooks; its iteration advances at each ``train_batch``."""
    inj = VaryInjector(tables, engine.stage_id)
    engine.add_hooks(inj)
    return inj
