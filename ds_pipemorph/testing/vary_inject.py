"""Per-micro-batch op times in the real engine (testing and benchmarks only).

``VaryInjector`` wraps an engine's F, B and W handlers so that each op of (stage, kind, micro-batch)
lasts the time a ``plan.variation.OpTable`` gives it: the handler runs (an emulated stage built with
the table's smallest times, or a real model), then the op sleeps until its start plus the table's
time. ``tables(k)`` gives the table of iteration k, so variation can change every iteration
(seeded: the simulator replays the same tables). Timing only: the numbers computed are untouched.
"""
from __future__ import annotations

import time
from collections.abc import Callable

from ..plan.variation import OpTable
from ..runtime import instructions as I
from .emulated import _sleep_until

_KINDS = {I.ForwardPass: "F", I.BackwardInputPass: "B", I.BackwardWeightPass: "W"}


class VaryInjector:
    def __init__(self, tables: Callable[[int], OpTable], stage: int):
        self.tables, self.stage = tables, stage
        self.iteration = -1
        self._table: OpTable | None = None

    def start_iteration(self) -> None:
        self.iteration += 1
        self._table = self.tables(self.iteration)

    def wrap(self, handlers: dict) -> dict:
        """``handlers`` (an engine's ``_INSTRUCTION_MAP``) with F, B and W lasting the table's times."""
        out = dict(handlers)
        for cls, kind in _KINDS.items():
            out[cls] = self._timed(handlers[cls], kind)
        return out

    def _timed(self, fn, kind: str):
        def run(engine, **kw):
            start = time.perf_counter()
            fn(engine, **kw)
            _sleep_until(start, self._table(self.stage, kind, kw["micro_batch"]))
        return run


def install(engine, tables: Callable[[int], OpTable]) -> VaryInjector:
    """Wrap ``engine``'s handlers; the injector's iteration advances at each ``train_batch``."""
    inj = VaryInjector(tables, engine.stage_id)
    engine._INSTRUCTION_MAP = inj.wrap(engine._INSTRUCTION_MAP)
    batch = engine.train_batch

    def train_batch(*args, **kwargs):
        inj.start_iteration()
        return batch(*args, **kwargs)

    engine.train_batch = train_batch
    return inj
