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
    ops = [(Op("F", m), Op("B", m), Op("W", m)) for m in range(N)]  # built once: a draw looks at each many times
    step = {"F": 1, "B": -1, "W": 0}
    while any(len(d) < 3 * N for d in done):
        choices = []
        for s in range(S):
            here, prev, nxt = done[s], done[s - 1] if s else None, done[s + 1] if s < S - 1 else None
            room = inflight[s] < caps[s]
            for f, b, w in ops:
                if f not in here:
                    if room and (prev is None or f in prev):
                        choices.append((s, f))
                    continue  # neither its B nor its W can run before its F
                if b not in here:
                    if nxt is None or b in nxt:
                        choices.append((s, b))
                elif w not in here:
                    choices.append((s, w))
        s, op = rng.choice(choices)
        done[s].add(op)
        plan[s].append(op)
        inflight[s] += step[op.kind]
    return plan, caps
