"""Lower bounds on the iteration time of any valid schedule: every bound the planner proves with.

- ``lower_bound_ms``: terms 1-5 below (the search's gap and stop, the re-plan policy's "keep").
- ``cap_bound_ms``: the round trips a tight in-flight cap forces (``cap_chain`` per stage).
- ``stage_bound``: ``lower_bound_ms``'s terms and ``cap_chain`` for one stage of a partial
  partition, from what is fixed above it and the least below it (the partition search).
- ``one_machine_bound``: a stage alone, from its ops' earliest starts and least tails (the exact
  planner's static bound on its makespan).

``lower_bound_ms``, per stage s, with a_s the earliest arrival of F0 (ramp-up) and the round trips of the first and last
micro-batch through the stages below (ramp-down), every schedule satisfies:

1. T >= a_s + work_s                                         (nothing starts before F0 arrives)
2. T >= r_s + N(b_s + w_s) + max(0, N - k_s) f_s             (no B or W before B0's gradient arrives
   at r_s, and at most k_s forwards fit before it, k_s = the stage's in-flight cap)
3. T >= start(F_{N-1}@s) + f_s + q_s + b_s + tail_s          (the last micro-batch goes down and back,
   then stage s and every stage above it still run its B and W), where start(F_{N-1}@s) is at least
   a_s + (N-1) f_s, and, when the cap forces N - k_s backwards first, r_s + (N-k_s) b_s + (N-k_s-1) f_s.

On uniform profiles with no delay and no cap, (1) at the last stage gives 3·N·t + (S−1)·t, which the
planner reaches.

Two more per stage s count the idle time of the ramp-up, which (1)–(3) miss when a stage above s is
slower at forwards than s (e.g. stage 2 of benchmarks/planner/planner_scale.py's "32x256 heterogeneous #1",
where they left a 2.5 % gap that was the bound's, not the plan's). Let g_s = max_{j<=s} f_j.

4. Before r_s, stage s can only run forwards (no gradient has arrived: every B needs its micro-batch
   to go to the bottom and back, and every F arrives at s at or after a_s), and the k-th forward it
   runs (k = 0, 1, ...) ends at e_k >= a_s + f_s + k·g_s: of the first k+1 forwards run on s, one
   is of a micro-batch m >= k (they are distinct); on every stage j < s the forwards run one after
   another from a_j on, so whichever m is run last there of m+1 distinct ones ends at or after
   a_j + (m+1) f_j, and F m reaches s at or after a_j + (m+1) f_j + (a_s − a_j − f_j) = a_s + m f_j
   (a_s − a_j is the F0 path from j to s). It also ends at or after a_s + (k+1) f_s. So the busy
   time of s in [0, r_s] is at most P_s = Σ_{k<K_s} clamp(r_s − a_s − k·g_s, 0, f_s), with K_s the
   most forwards that can start on s before r_s: N, and k_j for every j <= s (no B ends on j before
   r_j >= r_s, so j starts at most k_j forwards by then). Everything else of the stage runs after
   r_s, one op at a time:  T >= r_s + work_s − P_s.
5. All Fs and Bs of s end by r_s + N(f_s + b_s) − P_s at the earliest, the last of them a B whose
   gradient still goes up (tail as in 3):  T >= r_s + N(f_s + b_s) − P_s + tail_s.

(4) is at least (1) and (2), since P_s <= r_s − a_s and P_s <= K_s f_s. In (3) the last forward run on
s starts at or after a_s + (N−1) g_s by the same argument. tests/plan/test_bounds.py checks that the
bound never exceeds the MILP's proven optimum on small random cases.
"""
from __future__ import annotations

from typing import Optional

from ..ir.profile import Costs

INF = float("inf")


def first_arrivals(costs: Costs) -> tuple[list[float], list[float]]:
    """Per stage s, the earliest time F0's activation arrives (a_s, 0 on the first stage) and the
    earliest time B0's gradient arrives (r_s; on the last stage: its own F0 done)."""
    S, f, b, c = costs.stages, costs.f, costs.b, costs.links
    a = [0.0] * S
    for s in range(1, S):
        a[s] = a[s - 1] + f[s - 1] + c[s - 1]
    r = [0.0] * S
    r[S - 1] = a[S - 1] + f[S - 1]
    for s in range(S - 2, -1, -1):
        r[s] = r[s + 1] + b[s + 1] + c[s]
    return a, r


def lower_bound_ms(costs: Costs, microbatches: int, *, caps: Optional[list[int]] = None) -> float:
    S, N = costs.stages, microbatches
    f, b, w, c = costs.f, costs.b, costs.w, costs.links
    caps = caps or [N] * S
    a, r = first_arrivals(costs)
    best = 0.0
    g = 0.0  # slowest forward at or above s
    kcap = N  # fewest forwards any stage at or above s starts before its first gradient arrives
    for s in range(S):
        g = max(g, f[s])
        k = min(caps[s], N)
        kcap = min(kcap, k)
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
        start_last = a[s] + (N - 1) * g
        if N > k:
            start_last = max(start_last, r[s] + (N - k) * b[s] + (N - k - 1) * f[s])
        lb3 = start_last + f[s] + q + b[s] + tail
        busy = ramp_busy(r[s] - a[s], f[s], g, kcap)
        lb4 = r[s] + work - busy
        lb5 = r[s] + N * (f[s] + b[s]) - busy + tail
        best = max(best, lb1, lb2, lb3, lb4, lb5)
    return best


def ramp_busy(span: float, f: float, g: float, count: int) -> float:
    """Σ_{k<count} clamp(span − k·g, 0, f) for g >= f >= 0: the most a stage can be busy with
    forwards ``span`` after its first one may start (bound 4). Terms fall by g >= f, so all but at
    most one are f or 0; a count off by one at the boundary only ever adds, never misses, a term."""
    if span <= 0 or f <= 0 or count <= 0:
        return 0.0
    if g <= 0:  # pragma: no cover - g >= f > 0
        return count * f
    full = 0 if span < f else min(count, int((span - f) // g) + 1)  # terms equal to f
    busy = full * f
    if full < count:
        busy += min(f, max(0.0, span - full * g))
    return busy


def stage_bound(a: float, f: float, b: float, w: float, trip: float, g: float, up: float, k: int, kmin: int,
                 N: int) -> float:
    """``lower_bound_ms``'s terms 1-5 and ``cap_chain`` for one stage, from what the stages above
    fix and the least the stages below can add (the partition search's bound of a cut stage): F0 arrives at ``a``; the stage runs ``f``, ``b``, ``w``
    per micro-batch and holds at most ``k`` activations; ``trip`` is the least round trip below it
    over the cuts of the stages below (``partition._trip_table``; the true one is no shorter: every term
    grows with it, terms 4 and 5 too, as the ramp's busy time grows at most as fast as its span);
    ``g`` the slowest forward at or above it; ``up`` the longest gradient path above it ending in a W
    (tail = max(w, up)); ``kmin`` the least cap at or above it."""
    r = a + f + trip
    tail = max(w, up)
    lb3_start = a + (N - 1) * g
    if N > k:
        lb3_start = max(lb3_start, r + (N - k) * b + (N - k - 1) * f)
    busy = ramp_busy(r - a, f, g, kmin)
    return max(a + N * (f + b + w), r + N * (b + w) + max(0, N - k) * f, lb3_start + f + trip + b + tail,
               r + N * (f + b + w) - busy, r + N * (f + b) - busy + tail, cap_chain(a, f, b, tail, trip, k, N))


def cap_bound_ms(costs: Costs, microbatches: int, caps: list[int]) -> float:
    """A lower bound on the iteration time of any valid schedule that keeps stage s at most
    caps[s] activations in flight, for where the caps bind (``lower_bound_ms`` counts one
    round trip per stage; a tight cap costs one per cap's worth of micro-batches).

    On stage s, let E_j be the end of the j-th forward it runs (in whatever order), trip_s the
    round trip below it (the forward and backward-input of every stage below, and both ways of
    every link below). The backward-input of the micro-batch of forward i starts at or after
    E_i + trip_s, since its gradient comes back from the last stage. Before starting forward
    j >= k (k = caps[s]), at least j - k + 1 backward-inputs have ended (at most k in flight), of
    distinct micro-batches among forwards 0..j-1, one of them of forward index >= j - k; so
    E_j >= E_{j-k} + trip_s + b_s + f_s, and E_j >= E_{j-1} + f_s, E_0 >= a_s + f_s. Hence,
    with N - 1 = q k + r, the last forward ends at or after a_s + f_s + r f_s + q (f_s + trip_s +
    b_s); its micro-batch then goes down and back (trip_s), runs its backward-input here and still
    its W here or its backward-input and W above (tail_s, as in ``lower_bound_ms``)."""
    S, N = costs.stages, microbatches
    f, b, w, c = costs.f, costs.b, costs.w, costs.links
    trip = [0.0] * S
    for s in range(S - 2, -1, -1):
        trip[s] = trip[s + 1] + f[s + 1] + b[s + 1] + 2 * c[s]
    best, a, up = 0.0, 0.0, -INF
    for s in range(S):
        best = max(best, cap_chain(a, f[s], b[s], max(w[s], up), trip[s], min(caps[s], N), N))
        if s < S - 1:
            up = max(up, w[s]) + c[s] + b[s]
            a += f[s] + c[s]
    return best


def cap_chain(a: float, f: float, b: float, tail: float, trip: float, k: int, N: int) -> float:
    """``cap_bound_ms``'s term for one stage (it grows with ``trip``)."""
    q, r = divmod(N - 1, max(1, k))
    return a + f + r * f + q * (f + trip + b) + trip + b + tail


def one_machine_bound(machines: list[list[int]], head: list[float], tail: list[float], dur: list[float]) -> float:
    """A bound on the makespan C from each machine alone (a stage: ``machines[s]`` lists the
    indices of its ops into ``head``, ``tail``, ``dur``; ``head[v]``: the earliest start of op v,
    ``tail[v]``: the least time from its start to the end). For any set A of one machine's ops,
    ``C >= min_A head + sum_A d + min_A (tail - d)``; A ranges over {head >= h, tail - d >= q}.

    The exact planner's LP relaxation misses it (its big-M rows let ops overlap), e.g. idle forced
    on a bottleneck stage while it waits for forwards that arrive slower than it runs them.
    """
    best = 0.0
    for ops in machines:
        after = {v: tail[v] - dur[v] for v in ops}
        for h in sorted({head[v] for v in ops}):
            group = [v for v in ops if head[v] >= h]
            for q in sorted({after[v] for v in group}):
                work = sum(dur[v] for v in group if after[v] >= q)
                best = max(best, h + work + q)
    return best
