"""A slow link between two ranks (testing and benchmarks only), whatever traffic the placement puts on it.

``pipemorph.inject.rank_links: {"0-4": 30}`` makes the link between global ranks 0 and 4 slow by
30 ms one way. What pays depends on where the placement puts the two ranks:

- neighbouring stages of one pipeline: that pipeline link, as ``inject.links`` slows it (every
  message on it, ``inject.delays``);
- the same stage (one data-parallel group), with the link on that group's all-reduce ring (torch
  runs a group's ring in ascending rank order, closed at the end: ``plan.place.placement.ring_links``).
  A ring all-reduce takes 2(D - 1) steps, each sending one part over every ring link at once and
  ending with its slowest transfer; a part travels as k messages (``inject.allreduce_messages``:
  its size over the bucket size), one in flight per link. So a ring link slowed by c ms adds
  2(D - 1) k c ms to the all-reduce, the model ``plan.place.placement.allreduce_ms`` prices placements
  with (k = ⌈part / chunk⌉). Every rank of the group waits that long after its ``ReduceGrads``,
  inside the instruction (its op record shows it); the values reduced are untouched;
- anything else (no traffic between them): nothing.
"""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from ..plan.place.placement import ring_links
from ..runtime import instructions as I
from ..runtime.config import PipeMorphConfigError
from ..runtime.hooks import EngineHooks
from .delays import DelaySchedule


def allreduce_delay_ms(pairs: dict[tuple[int, int], float], group: list[int], messages: int = 1) -> float:
    """Extra ms of one all-reduce over ``group`` with ``pairs`` (rank pair -> one-way delay) slowed,
    each part travelling as ``messages`` messages (one in flight per link)."""
    ring = ring_links(group)
    slowest = max((pairs.get((min(a, b), max(a, b)), 0.0) for a, b in ring), default=0.0)
    return 2 * (len(group) - 1) * messages * slowest


def pipeline_delays(pairs: dict[tuple[int, int], float], stage_ranks: list[int]) -> list[float]:
    """Per link of the pipeline whose stage s runs on ``stage_ranks[s]``, the delay ``pairs`` give it."""
    return [pairs.get((min(a, b), max(a, b)), 0.0) for a, b in zip(stage_ranks, stage_ranks[1:])]


def parse_pairs(rank_links: dict[str, float]) -> dict[tuple[int, int], float]:
    """``{"0-4": 30}`` -> ``{(0, 4): 30.0}`` (the config has validated the keys)."""
    out = {}
    for key, ms in rank_links.items():
        a, b = (int(x) for x in key.split("-"))
        out[(min(a, b), max(a, b))] = float(ms)
    return out


def checked_pairs(inject) -> dict[tuple[int, int], float]:
    """``inject.rank_links`` as rank pairs, refused in one sentence if a rank is not in the job."""
    pairs = parse_pairs(inject.rank_links)
    world = dist.get_world_size()
    bad = [f"{a}-{b}" for a, b in pairs if b >= world]
    if bad:
        raise PipeMorphConfigError(f"pipemorph.inject.rank_links names rank pair {bad[0]}, but the job has "
                                   f"ranks 0..{world - 1}")
    return pairs


class SlowAllReduce(EngineHooks):
    """``ReduceGrads`` lasts ``extra_ms`` longer (an engine hook: the wait is inside its op record)."""

    ops = frozenset({I.ReduceGrads})

    def __init__(self, extra_ms: float):
        self.extra_ms = extra_ms

    def after_op(self, engine, instruction, kwargs, started) -> None:
        time.sleep(self.extra_ms / 1e3)


def slow_allreduce(inject, engine) -> Optional[SlowAllReduce]:
    """The hook that makes ``engine``'s all-reduce pay what its data-parallel ring crosses (None: nothing)."""
    pairs = checked_pairs(inject)
    ms = allreduce_delay_ms(pairs, list(engine.grid.dp_group), inject.allreduce_messages)
    return SlowAllReduce(ms) if ms > 0 else None


def add_pipeline_delays(inject, engine, delays: Optional[DelaySchedule]) -> Optional[DelaySchedule]:
    """``delays`` with the links of ``engine``'s pipeline between slowed ranks slowed as well."""
    stage_ranks = [engine.grid.stage_to_global(s) for s in range(engine.num_stages)]
    on_links = pipeline_delays(checked_pairs(inject), stage_ranks)
    if not any(on_links):
        return delays
    if delays is None:
        return DelaySchedule(on_links)
    delays.static = [max(a, b) for a, b in zip(delays.static, on_links)]
    return delays
