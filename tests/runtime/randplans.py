"""Random valid plans: random interleavings of ops that respect the dependencies and per-stage caps.

Each draw simulates one execution of the whole pipeline, picking at every step a random stage and
a random op it could run now (F of any arrived micro-batch while under its cap, B of any
micro-batch whose gradient has arrived, W of any micro-batch whose B ran), so forwards, backwards
and weight passes come out of micro-batch order too. The per-stage orders of a valid execution
form a valid plan.
"""
from __future__ import annotations

import random

from ds_pipemorph.plan.ir.ops import Op


def random_plan(stages: int, microbatches: int, rng: random.Random) -> tuple[list[list[Op]], list[int]]:
    S, N = stages, microbatches
    caps = [rng.randint(1, N) for _ in range(S)]
    done = [set() for _ in range(S)]
    inflight = [0] * S
    plan: list[list[Op]] = [[] for _ in range(S)]
    while any(len(d) < 3 * N for d in done):
        choices = []
        for s in range(S):
            for m in range(N):
                f, b, w = Op("F", m), Op("B", m), Op("W", m)
                if f not in done[s] and inflight[s] < caps[s] and (s == 0 or f in done[s - 1]):
                    choices.append((s, f))
                if f in done[s] and b not in done[s] and (s == S - 1 or b in done[s + 1]):
                    choices.append((s, b))
                if b in done[s] and w not in done[s]:
                    choices.append((s, w))
        s, op = rng.choice(choices)
        done[s].add(op)
        plan[s].append(op)
        inflight[s] += {"F": 1, "B": -1, "W": 0}[op.kind]
    return plan, caps
