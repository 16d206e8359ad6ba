"""Per-micro-batch op times in the real engine (testing and benchmarks only).

``VaryInjector`` is an engine hook (``runtime.hooks``) on F, B and W: each op of (stage, kind,
micro-batch) lasts the time a ``plan.sim.variation.OpTable`` gives it: the handler runs (an emulated
stage built with the table's smallest times, or a real model), then the op sleeps until its start
plus the table's time. ``tables(k)`` gives the table of iteration k, so variation can change every
iteration (seeded: the simulator replays the same tables). Timing only: the numbers computed are untouched.
``install_stock`` times stock DeepSpeed's engine from the same tables, so benchmarks can compare them.
"""
from __future__ import annotations

from collections.abc import Callable
from time import perf_counter

from ..plan.ir.ops import Kind
from ..plan.sim.variation import OpTable
from ..runtime import instructions as I
from ..runtime.hooks import EngineHooks
from .emulated import sleep_until

_KINDS = {I.ForwardPass: Kind.F, I.BackwardInputPass: Kind.B, I.BackwardWeightPass: Kind.W}


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
        sleep_until(started, self._table(self.stage, _KINDS[instruction], kwargs["micro_batch"]))


def install(engine, tables: Callable[[int], OpTable]) -> VaryInjector:
    """Add the injector to ``engine``'s hooks; its iteration advances at each ``train_batch``."""
    inj = VaryInjector(tables, engine.stage_id)
    engine.add_hooks(inj)
    return inj


def install_stock(engine, tables: Callable[[int], OpTable], microbatches: int) -> None:
    """The same op times for stock DeepSpeed's ``PipelineEngine`` (benchmarks compare the two): its
    forward lasts the table's F and its fused backward the table's B + W, counted from the start of
    the instruction. Stock instructions name a buffer, not a micro-batch; its 1F1B runs a stage's
    forwards, and its backwards, in micro-batch order, so the k-th of either since start-up is
    micro-batch k mod N of iteration k div N. Training only (an ``eval_batch``'s forwards would count)."""
    from deepspeed.runtime.pipe.schedule import BackwardPass, ForwardPass

    stage, n = engine.stage_id, microbatches
    count = {Kind.F: 0, Kind.B: 0}
    drawn: dict[int, OpTable] = {}  # iteration -> its table (forwards and backwards of one iteration share it)

    def table_of(iteration: int) -> OpTable:
        if iteration not in drawn:
            drawn.clear()
            drawn[iteration] = tables(iteration)
        return drawn[iteration]

    def timed(handler, kind: Kind):
        def run(eng, **kwargs):
            started = perf_counter()
            k, count[kind] = count[kind], count[kind] + 1
            handler(eng, **kwargs)
            table, mb = table_of(k // n), k % n
            ms = table(stage, Kind.F, mb) if kind is Kind.F else table(stage, Kind.B, mb) + table(stage, Kind.W, mb)
            sleep_until(started, ms)
        return run

    handlers = dict(engine._INSTRUCTION_MAP)
    handlers[ForwardPass] = timed(handlers[ForwardPass], Kind.F)
    handlers[BackwardPass] = timed(handlers[BackwardPass], Kind.B)
    engine._INSTRUCTION_MAP = handlers  # stock's own map, on this instance only (as emulated.anchor_stock_engine)
