"""A lower bound on the iteration time of any valid schedule (used where the MILP is out of reach).

Per stage s, with a_s the earliest arrival of F0 (ramp-up) and the round trips of the first and last
micro-batch through the stages below (ramp-down), every schedule satisfies:

1. T >= a_s + work_s                                         (nothing starts before F0 arrives)
2. T >= r_s + N(b_s + w_s) + max(0, N - k_s) f_s             (no B or W before B0's gradient arrives
   at r_s, and at most k_s forwards fit before it, k_s = the stage's in-flight cap)
3. T >= start(F_{N-1}@s) + f_s + q_s + b_s + tail_s          (the last micro-batch goes down and back,
   then stage s and every stage above it still run its B and W), where start(F_{N-1}@s) is at least
   a_s + (N-1) f_s, and, when the cap forces N - k_s backwards first, r_s + (N-k_s) b_s + (N-k_s-1) f_s.

On uniform profiles with no delay and no cap, (1) at the last stage gives 3·N·t + (S−1)·t, which the
planner reaches.
"""
from __future__ import annotations

from typing import Optional

from .profile import Costs


def lower_bound_ms(costs: Costs, microbatches: int, caps: Optional[list[int]] = None) -> float:
    S, N = costs.stages, microbatches
    f, b, w, c = costs.f, costs.b, costs.w, costs.links
    caps = caps or [N] * S
    a = [0.0] * S  # F0 arrival at stage s
    for s in range(1, S):
        a[s] = a[s - 1] + f[s - 1] + c[s - 1]
    bottom = a[S - 1] + f[S - 1]  # F0 done on the last stage
    r = [0.0] * S  # earliest arrival of B0's gradient at stage s (own F0 done for the last stage)
    r[S - 1] = bottom
    for s in range(S - 2, -1, -1):
        r[s] = r[s + 1] + b[s + 1] + c[s]
    best = 0.0
    for s in range(S):
        k = min(caps[s], N)
        work = N * (f[s] + b[s] + w[s])
        lb1 = a[s] + work
        lb2 = r[s] + N * (b[s] + w[s]) + max(0, N - k) * f[s]
        # q: from F_{N-1} done on s until its gradient is back at s.
        q = sum(c[j] for j in range(s, S - 1)) * 2 + sum(f[j] + b[j] for j in range(s + 1, S))
        tail = w[s]
        acc = 0.0
        for j in range(s - 1, -1, -1):
            acc += c[j] + b[j]
            tail = max(tail, acc + w[j])
        start_last = a[s] + (N - 1) * f[s]
        if N > k:
            start_last = max(start_last, r[s] + (N - k) * b[s] + (N - k - 1) * f[s])
        lb3 = start_last + f[s] + q + b[s] + tail
        best = max(best, lb1, lb2, lb3)
    return best
