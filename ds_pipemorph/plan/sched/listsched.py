"""List scheduler (PipeMorph Alg. 3/4): the greedy schedule of a warm-up and a ``Policy``.

Which core runs is decided here: the compiled one (``plan.sim.native``) when it is available, else the
pure-Python one (``plan.sim.listsched_py``, where the algorithm is written out); the same schedule
either way.
"""
from __future__ import annotations

from ..ir.ops import Schedule
from ..ir.profile import Costs
from ..sim import native
from ..sim.listsched_py import Policy, list_schedule_py


def list_schedule(costs: Costs, microbatches: int, warmup: list[int], *, policy: Policy = Policy()) -> Schedule:
    """The greedy schedule; the compiled core (``plan.sim.native``) when it is available, else
    ``list_schedule_py``: the same schedule either way."""
    return list_schedule_encoded(costs, microbatches, warmup, policy)[0]


_LAST: list = []  # (inputs, schedule, encoding) of the last few compiled runs


def list_schedule_encoded(costs: Costs, microbatches: int, warmup: list[int], policy: Policy = Policy()):
    """(``list_schedule(...)``, its encoding for the compiled replay, or None without the core).

    The last few compiled results are kept: asked again for the same inputs (the planning CLI's
    greedy pass, then the search's first candidate), it returns a fresh copy of the same orders."""
    if len(warmup) != costs.stages:
        raise ValueError(f"warmup has {len(warmup)} values, expected {costs.stages}")
    key = (tuple(costs.f), tuple(costs.b), tuple(costs.w), tuple(costs.links), microbatches, tuple(warmup), policy)
    for k, sched, enc in _LAST:
        if k == key:
            out = [list(r) for r in sched]
            native.remember(out, microbatches, enc)
            return out, enc
    out = native.list_schedule(costs, microbatches, warmup, policy.priority, policy.w_fits_gap, policy.late_w,
                               policy.units, policy.w_share)
    if out is None:
        return list_schedule_py(costs, microbatches, warmup, policy), None
    _LAST.insert(0, (key, [list(r) for r in out[0]], out[1]))
    del _LAST[2:]
    native.remember(out[0], microbatches, out[1])
    return out
