"""Replay: a fixed per-stage op order under given costs and link delays -> ``Timeline``.

Which core runs is decided here: the compiled one (``plan.sim.native``) when it is available and takes
the input, else the pure-Python one (``plan.sim.replay_py``, where the model is written out). Both give
the same floats; a stuck order raises ``StuckSchedule`` naming the op and what it waits for.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from ..ir.links import LATENCY, LinkModel, LinkModels, per_link
from ..ir.ops import Schedule, peak_inflight
from ..ir.profile import Costs
from . import native
from .replay_py import run_py
from .timeline import Slot, StuckSchedule, Timeline, stuck_message


def replay(schedule: Schedule, costs: Costs, microbatches: int, *, fused_backward: bool = False,
           link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> Timeline:
    """Run the orders as fast as dependencies allow; raise StuckSchedule naming the stuck op.

    ``fused_backward`` models DeepSpeed's ``BackwardPass``: where ``W m`` directly follows ``B m``,
    the input gradient leaves the stage only when that W ends (stock DeepSpeed sends after the
    whole backward). ``link_model`` (one for all links, or one per link, made one per link here
    by ``links.per_link``) says how messages queue on a link (``plan.ir.links``). The semantics are
    ``replay_py.run_py``'s.
    """
    S, N = len(schedule), microbatches
    models = per_link(link_model, S - 1)
    work = [N * (costs.f[s] + costs.b[s] + costs.w[s]) for s in range(S)]
    enc = native.encode(schedule, N) if native.lib() is not None else None
    got = _run_native(schedule, costs, N, fused_backward, models, slots=True, enc=enc) if enc else None
    if got is not None:
        t0, t1, busy, raw = got
        return _LazyTimeline(S, N, raw, schedule, t1 - t0, busy, native.peaks_and_warmups(enc, N)[0], work)
    slots: list[Slot] = []
    t0, t1, busy = run_py(schedule, costs, N, fused_backward, slots, models)
    return Timeline(S, N, slots, t1 - t0, busy, peak_inflight(schedule), work)


class _LazyTimeline(Timeline):
    """A ``Timeline`` from the compiled core: its ``Slot`` objects are made on first use."""

    def __init__(self, stages, microbatches, raw, schedule, iteration_ms, busy_ms, peak, work_ms):
        self.stages, self.microbatches, self._raw, self._schedule = stages, microbatches, raw, schedule
        self._slots = None
        self.iteration_ms, self.busy_ms, self.peak_inflight, self.work_ms = iteration_ms, busy_ms, peak, work_ms

    @property
    def slots(self) -> list[Slot]:
        if self._slots is None:
            ss, sp, st, se = (a.tolist() for a in self._raw)
            rows = self._schedule
            out = []
            add, new = out.append, object.__new__
            for s, p, a, b in zip(ss, sp, st, se):  # Slot(s, op, a, b) without the frozen __init__
                x = new(Slot)
                d = x.__dict__
                d["stage"] = s
                d["op"] = rows[s][p]
                d["start"] = a
                d["end"] = b
                add(x)
            self._slots = out
            self._raw = self._schedule = None
        return self._slots

    @slots.setter
    def slots(self, value: list[Slot]) -> None:
        self._slots, self._raw, self._schedule = value, None, None


def makespan(schedule: Schedule, costs: Costs, microbatches: int, *, fused_backward: bool = False,
             link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY) -> float:
    """``replay(...).iteration_ms`` without building the timeline (the search's inner loop)."""
    models = per_link(link_model, len(schedule) - 1)
    t0, t1, _ = _run(schedule, costs, microbatches, fused_backward, None, models)
    return t1 - t0


def _run(schedule: Schedule, costs: Costs, N: int, fused_backward: bool, slots: Optional[list],
         models: LinkModels):
    """(first start, last end, busy ms per stage): the compiled core when it is available (and no
    slots are asked for), else ``replay_py.run_py``; the same floats either way."""
    if slots is None:
        got = _run_native(schedule, costs, N, fused_backward, models)
        if got is not None:
            return got[:3]
    return run_py(schedule, costs, N, fused_backward, slots, models)


def _run_native(schedule: Schedule, costs: Costs, N: int, fused_backward: bool,
                models: LinkModels, slots: bool = False, enc=None):
    """``_run`` in C: (first, last, busy, raw slots or None); None where the compiled core is
    missing or cannot take the input (the Python code then runs, and raises what it raises)."""
    S = len(schedule)
    if native.lib() is None or costs.stages != S or S < 1:
        return None
    enc = enc or native.encode(schedule, N)
    if enc is None:
        return None
    got = native.replay(enc, costs, N, fused_backward, models, slots=slots)
    if got is None:
        return None
    rc, first, last, busy, ptr, raw, _ = got
    if rc == 1:
        raise StuckSchedule(stuck_message(schedule, ptr, S))
    return first, last, busy, raw
