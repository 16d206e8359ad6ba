"""A slow link between two ranks (testing and benchmarks only), whatever traffic the placement puts on it.

``pipemorph.inject.rank_links: {"0-4": 30}`` makes the link between global ranks 0 and 4 slow by
30 ms one way. What pays depends on where the placement puts the two ranks:

- neighbouring stages of one pipeline: that pipeline link, as ``inject.links`` slows it (every
  message on it, ``testing.inject``);
- the same stage (one data-parallel group), with the link on that group's all-reduce ring (torch
  runs a group's ring in ascending rank order, closed at the end: ``plan.placement.ring_links``).
  A ring all-reduce takes 2(D - 1) steps, each sending one part over every ring link at once and
  ending with its slowest transfer; a part travels as k messages (``inject.allreduce_messages``:
  its size over the bucket size), one in flight per link. So a ring link slowed by c ms adds
  2(D - 1) k c ms to the all-reduce, the model ``plan.placement.allreduce_ms`` prices placements
  with (k = ⌈part / chunk⌉). Every rank of the group waits that long after its ``ReduceGrads``,
  inside the instruction (its op record shows it); the values reduced are untouched;
- anything else (no traffic between them): nothing.
"""
from __future__ import annotations

import time
from typing import Optional

import torch.distributed as dist

from ..plan.placement import ring_links
from ..runtime import instructions as I
from ..runtime.config import PipeMorphConfigError
from .inject import DelaySchedule


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


def wrap_reduce(handlers: dict, extra_ms: float) -> dict:
    """``handlers`` with ``ReduceGrads`` lasting ``extra_ms`` longer."""
    reduce = handlers[I.ReduceGrads]

    def slowed(engine, **kw):
        reduce(engine, **kw)
        time.sleep(extra_ms / 1e3)

    return {**handlers, I.ReduceGrads: slowed}


def install_rank_links(engine, inject, stage_ranks: list[int], delays: Optional[DelaySchedule]) -> Optional[DelaySchedule]:
    """Put ``inject.rank_links`` on ``engine`` (before its transport is built): its all-reduce pays
    what its data-parallel ring crosses, and the returned delay schedule (``delays`` with them added)
    slows the pipeline links between slowed ranks."""
    pairs = parse_pairs(inject.rank_links)
    world = dist.get_world_size()
    bad = [f"{a}-{b}" for a, b in pairs if b >= world]
    if bad:
        raise PipeMorphConfigError(f"pipemorph.inject.rank_links names rank pair {bad[0]}, but the job has "
                                   f"ranks 0..{world - 1}")
    engine.dp_delay_ms = allreduce_delay_ms(pairs, list(engine.grid.dp_group), inject.allreduce_messages)
    if engine.dp_delay_ms > 0:
        engine._INSTRUCTION_MAP = wrap_reduce(engine._INSTRUCTION_MAP, engine.dp_delay_ms)
    on_links = pipeline_delays(pairs, stage_ranks)
    if not any(on_links):
        return delays
    if delays is None:
        return DelaySchedule(on_links)
    delays.static = [max(a, b) for a, b in zip(delays.static, on_links)]
    return delays
