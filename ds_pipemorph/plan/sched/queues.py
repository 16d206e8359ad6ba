"""How many delegate queues a delegated link needs to keep pace with its plan (PipeMorph §5.2).

A delegated link with delay c and k queues is k independent FIFOs, each carrying one message at a
time (docs/design.md); message n of a direction travels in FIFO n % k. If the stages produce a message
every t ms and c > k * t, the FIFOs fall behind and the backlog grows through the iteration, whatever
the plan ("at least 4 sending queues are needed" when the GPU produces 8 activations per second and a
delegate sends 2). ``queues_needed`` finds the smallest k for which replaying the plan with k FIFOs on
that link is as fast as with unlimited ones (pure latency), by replay, so bursts count, not only the
mean rate.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Union

from ..ir.links import LATENCY, Delegated, LinkModel, per_link
from ..ir.ops import Schedule
from ..ir.profile import Costs
from ..sim.simulate import makespan

MIN_QUEUES = 2  # the configured default: never fewer, so one late message does not stall the next
MAX_QUEUES = 8  # delegate processes per link direction and end, at most
SLACK = 0.005  # k queues are enough when the plan takes at most this much longer than with unlimited


def queues_needed(schedule: Schedule, costs: Costs, microbatches: int, link: int, *,
                  link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY,
                  lo: int = MIN_QUEUES, hi: int = MAX_QUEUES) -> int:
    """The smallest k in [lo, hi] with which ``link`` (delegated, k FIFOs) does not slow the plan.

    ``link_model`` is the model of the other links (``plan.ir.links``); returns ``hi`` if even
    ``hi`` FIFOs are not enough (the link's delay is then beyond what delegation can hide).
    """
    S = len(schedule)
    if not 0 <= link < S - 1:
        raise ValueError(f"link {link} does not exist: the pipeline has links 0..{S - 2}")
    model = list(per_link(link_model, S - 1))
    if costs.links[link] <= 0:
        return lo
    model[link] = LATENCY
    unlimited = makespan(schedule, costs, microbatches, link_model=model)
    for k in range(lo, hi + 1):
        model[link] = Delegated(k)
        if makespan(schedule, costs, microbatches, link_model=model) <= unlimited * (1 + SLACK):
            return k
    return hi
