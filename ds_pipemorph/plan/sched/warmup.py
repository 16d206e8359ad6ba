"""Warm-up planning (PipeMorph §4.1–4.2): Alg. 1, Alg. 2, the Eq. 1 tolerance and Lemma 1.

x_s is the number of forwards stage s runs before its first B and its cap on in-flight
activations; the slackness of link i is Δ_i = x_i − x_{i+1}.
"""
from __future__ import annotations

import math

from ..ir.profile import Costs


def slackness(warmup: list[int]) -> list[int]:
    return [warmup[i] - warmup[i + 1] for i in range(len(warmup) - 1)]


def check_lemma1(warmup: list[int]) -> None:
    """Lemma 1: warm-up counts never increase along the pipeline; every stage warms up at least once."""
    for s, x in enumerate(warmup):
        if x < 1:
            raise ValueError(f"stage {s}: warm-up count {x} is below 1")
    for i, d in enumerate(slackness(warmup)):
        if d < 0:
            raise ValueError(
                f"stage {i + 1}: warm-up count {warmup[i + 1]} exceeds stage {i}'s {warmup[i]} (Lemma 1: x_s >= x_(s+1))"
            )


def initial_warmup(caps: list[int]) -> list[int]:
    """Alg. 1 generalised to per-stage caps: maximise the minimum slackness, then spread the rest.

    With equal caps M this is exactly Alg. 1: x_0 = M, Δ_avg = ⌊(M−1)/(S−1)⌋, the first
    (M−1) mod (S−1) links get one more. Unequal caps first tighten each cap to the smallest cap
    upstream of it (Lemma 1 forbids a stage warming up more than the one before it).
    """
    S = len(caps)
    if S == 1:
        return [max(1, caps[0])]
    ub = []
    for c in caps:
        ub.append(min(c, ub[-1]) if ub else c)
    # Largest D with 1 + D*(S-1-s) <= ub[s] for all s.
    D = min((ub[s] - 1) // (S - 1 - s) for s in range(S - 1))
    D = max(D, 0)
    # Paper's spread from the top: x_0 = ub_0, even steps with the remainder going to the first links,
    # then clipped by each stage's own bound and kept at least 1 + D*(S-1-s).
    x0 = ub[0]
    avg, r = divmod(x0 - 1, S - 1)
    x = [x0]
    for i in range(1, S):
        x.append(x[-1] - (avg + 1 if i <= r else avg))
    for s in range(S):
        x[s] = max(min(x[s], ub[s]), 1 + D * (S - 1 - s))
    for s in range(S - 2, -1, -1):  # restore monotonicity after clipping
        x[s] = max(x[s], x[s + 1])
    check_lemma1(x)
    return x


def adapted_warmup(costs: Costs, microbatches: int, *, caps: list[int] | None = None,
                   paper_floor: bool = False) -> list[int]:
    """Alg. 2: the smallest slackness per link that absorbs its measured delay (Eq. 1).

    The paper's line 7 rounds ⌊·⌋ and puts t_{i+1}^B in the numerator; Eq. 1 needs
    Δ_i ≥ (t_i^F + t_i^B + 2c_i) / (t_{i+1}^F + t_{i+1}^B), so we round up (``paper_floor=True``
    gives the printed formula). Δ_i is at least 2 and clipped so that no stage warms up more than
    N forwards or more than its memory cap (the paper clips by N − 2S; the cap is what matters).
    """
    S, N = costs.stages, microbatches
    caps = caps or [N] * S
    x = [0] * S
    x[S - 1] = 1
    for i in range(S - 2, -1, -1):
        den = costs.f[i + 1] + costs.b[i + 1]
        if paper_floor:
            num = costs.f[i] + costs.b[i + 1] + 2 * costs.links[i]
            need = math.floor(num / den) if den > 0 else 2
            d = min(N - 2 * S, max(need, 2))
        else:
            num = costs.f[i] + costs.b[i] + 2 * costs.links[i]
            need = math.ceil(num / den - 1e-9) if den > 0 else 2
            d = max(need, 2)
        x[i] = x[i + 1] + max(d, 0)
    # Clip by N and per-stage caps, keeping Lemma 1.
    bound = min(N, caps[0])
    for s in range(S):
        bound = min(bound, caps[s], N)
        x[s] = min(x[s], bound)
    for s in range(S - 2, -1, -1):
        x[s] = max(x[s], x[s + 1])
    return x


def eq1_tolerance_ms(costs: Costs, warmup: list[int]) -> list[float]:
    """Largest delay per link that Eq. 1 says is absorbed: (Δ_i (t^F_{i+1}+t^B_{i+1}) − t^F_i − t^B_i) / 2."""
    out = []
    for i, d in enumerate(slackness(warmup)):
        tol = (d * (costs.f[i + 1] + costs.b[i + 1]) - costs.f[i] - costs.b[i]) / 2
        out.append(max(0.0, tol))
    return out
