"""Stage boundaries for a layer profile: the partition whose greedy zero-bubble plans run fastest.

A partition is DeepSpeed's ``parts`` list (``parts[0] = 0 < parts[1] < ... < parts[S] = L``; stage s
owns layers ``parts[s]..parts[s+1]-1``). ``LayerProfile.costs(parts)`` sums layer times per stage
and prices each boundary as latency + transfer (DynPipe's Eq. 7); ``LayerProfile.caps(parts)``
derives each stage's in-flight cap from its memory; a stage that does not fit its memory makes the
partition infeasible. Unlike DynPipe's Eq. 4-5 (a 1F1B cycle formula), the objective is an
iteration time from the replay simulator: ``quick_ms``, the best of four greedy plans of the
partition, replayed. So everything the planner models counts (ramp-up, ramp-down, link delays the
plan cannot hide, memory caps). The caller plans the winner with the full planner, which starts
from those same plans and can only improve on them.

Per-stage slowdown factors (``slowdown``: stage s runs each layer it holds ``slowdown[s]`` times as
long, e.g. beside another job on its device) scale the stage's F, B and W sums, not the links. The
search then answers: which parts are best on these devices as they are now. Every bound below is
computed from the scaled stage times, so the search stays exact with factors.

The search is a depth-first branch and bound over the boundaries, stage by stage from the input.
Every pruning uses lower bounds on the iteration time of *any* valid schedule within the caps
(``bounds.lower_bound_ms`` and ``bounds.cap_bound_ms``), and ``quick_ms`` replays a valid schedule within
the caps, so nothing that could beat the best score found is cut: on completion the result is the
exhaustive optimum of ``quick_ms`` (``exhaustive`` is the test oracle; ties within ``EPS`` may pick
another partition).

- A node is a prefix of stages ending before layer l. Its bound is the largest, over the cut
  stages, of their bound terms with what the uncut stages could add at its least
  (``bounds.stage_bound``, with the round trip below a stage at its least over every way of cutting the
  stages below that fits memory: ``_trip_table``), and over the uncut ones, the least over every
  way of cutting them that fits memory of the largest of their simpler terms (``_suffix_table``).
  Both tables are dynamic programs over (stage, first layer), computed once. Children are tried
  best bound first. The cheap parts of a child's bound come first: the stage's own work (it only
  grows as the stage takes more layers, so the first child it rules out ends the list) and the
  suffix table's term; the full ``bounds.stage_bound`` only for children that pass both.
- A leaf is scored by its lower bound first (the last stage's exact terms, then the whole
  partition's ``lower_bound_ms`` and ``cap_bound_ms``) and replayed only if that bound is below
  the best score so far. Partitions with equal stage costs and caps share one replay.
- Before it, a local search from the suffix table's best cut and DeepSpeed's two partitions sets
  the first score to prune with: while one helps, the best ``block_shifts`` move (a layer moved
  from one stage to another, the stages between shifted by one), replaying only the moves whose
  bound leaves room to improve. Moving one boundary at a time instead stops far from the
  optimum under tight memory (up to 44 % above it on the memory-capped cases of
  benchmarks/planner/partition_scale.py, where block shifts reach it in most cases), and every partition
  within that margin of its bound is then replayed.

The least lower bound over the partitions not ruled out (every leaf visited and, when a time limit
stops the search, every node left open) is a bound no partition with any plan beats, so the
winner's score minus it is a proven gap (``PartitionResult.gap_to_bound``).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from itertools import combinations
from typing import Callable, Iterator, Optional, Sequence

from ...fileio import BadInput
from ..ir.profile import Costs
from ..sched.bounds import cap_bound_ms, cap_chain, lower_bound_ms, stage_bound
from ..sched.listsched import list_schedule
from ..sim.listsched_py import Policy
from ..sched.search import ramp_warmup
from ..sched.warmup import initial_warmup
from ..sim.simulate import makespan
from .layer_profile import LayerProfile, check_slowdown
from .parts import balanced_parts, uniform_parts

INF = float("inf")
EPS = 1e-9  # ms: a partition must beat the best by more than this to replace it


@dataclass
class PartitionResult:
    parts: list[int]
    iteration_ms: float  # ``quick_ms`` of ``parts``: the search's objective
    lower_bound_ms: float  # no feasible partition with any plan is faster
    replayed: int  # partitions whose greedy plans were replayed
    leaves: int  # complete partitions reached (the rest were cut as prefixes)
    complete: bool  # False if ``time_limit_s`` stopped the search: ``parts`` is then the best found
    seconds: float

    @property
    def gap_to_bound(self) -> float:
        lb = self.lower_bound_ms
        return 0.0 if lb <= 0 else (self.iteration_ms - lb) / lb


def quick_ms(costs: Costs, microbatches: int, caps: list[int], floor: float = 0.0) -> float:
    """Iteration time of the best of four greedy plans, replayed: the list scheduler from the
    ramp-matched and from Alg. 1's warm-up (``search.ramp_warmup``, ``warmup.initial_warmup``),
    each with Alg. 3's priorities and with the bottleneck stage and all below it keeping their W
    for the cool-down (all four are in the full planner's portfolio). Stops at the first plan
    within ``EPS`` of ``floor`` (a lower bound): the value then differs from the best of the four
    by at most ``EPS``."""
    S, n = costs.stages, microbatches
    work = [costs.f[s] + costs.b[s] + costs.w[s] for s in range(S)]
    neck = max(range(S), key=lambda s: work[s])
    pols = (Policy(), Policy("BFW", late_w=frozenset(range(neck, S))))
    best, seen = INF, []
    for x in (ramp_warmup(costs, n, caps), initial_warmup(caps)):
        if x in seen:
            continue
        seen.append(x)
        for pol in pols:
            best = min(best, makespan(list_schedule(costs, n, x, policy=pol), costs, n))
            if best <= floor + EPS:
                return best
    return best


def evaluate(lp: LayerProfile, parts: list[int], *, slowdown: Optional[Sequence[float]] = None) -> float:
    """``quick_ms`` of a partition (stage times scaled by ``slowdown``, as in ``LayerProfile.costs``),
    or inf if a stage does not fit its memory."""
    caps = lp.caps(parts)
    if any(c is None for c in caps):
        return INF
    return quick_ms(lp.costs(parts, slowdown), lp.microbatches, caps)


def compositions(layers: int, stages: int) -> Iterator[list[int]]:
    """Every partition of ``layers`` layers into ``stages`` non-empty stages: C(layers-1, stages-1)."""
    for cuts in combinations(range(1, layers), stages - 1):
        yield [0, *cuts, layers]


def exhaustive(lp: LayerProfile, *, objective: Optional[Callable[[LayerProfile, list[int]], float]] = None,
               slowdown: Optional[Sequence[float]] = None) -> tuple[Optional[list[int]], float]:
    """The best partition by trying all of them (small cases only): (parts, objective), first found
    on ties; (None, inf) if none fits memory. ``slowdown`` scales the stage times of the default
    objective (``evaluate``); a given objective scores ``(lp, parts)`` as it likes."""
    if objective is None:
        factors = check_slowdown(slowdown, lp.stages)
        objective = lambda prof, parts: evaluate(prof, parts, slowdown=factors)  # noqa: E731
    elif slowdown is not None:
        raise ValueError("exhaustive: slowdown applies to the default objective; scale the costs in your objective")
    best, best_t = None, INF
    for parts in compositions(lp.num_layers, lp.stages):
        t = objective(lp, parts)
        if t < best_t - EPS:
            best, best_t = parts, t
    return best, best_t


def _trip_table(lp: LayerProfile, slow: list[float], cap, delay) -> list[list[float]]:
    """D[k][l]: the least, over cuts of layers l..L-1 into stages k..S-1 that fit memory, of the
    way down from stage k's input and back: the F and B of every stage k..S-1 (scaled by its
    factor) and both ways of every link between them (inf if none fits). The round trip below a
    stage k holding layers ..e-1 is at least 2 delay(e-1, k) + D[k+1][e], whatever the rest holds."""
    L, S = lp.num_layers, lp.stages
    pf, pb, _ = lp._prefix
    D = [[INF] * (L + 1) for _ in range(S + 1)]
    for l in range(S - 1, L):
        if cap(S - 1, l, L) is not None:
            D[S - 1][l] = (pf[L] - pf[l] + pb[L] - pb[l]) * slow[S - 1]
    for k in range(S - 2, -1, -1):
        nxt, row, x = D[k + 1], D[k], slow[k]
        for l in range(k, L - (S - 1 - k)):
            best = INF
            for e in range(l + 1, L - (S - 2 - k)):
                if nxt[e] < INF and cap(k, l, e) is not None:
                    v = (pf[e] - pf[l] + pb[e] - pb[l]) * x + 2 * delay[e - 1][k] + nxt[e]
                    if v < best:
                        best = v
            row[l] = best
    return D


def _suffix_table(lp: LayerProfile, stage_lb, fwd, delay) -> list[list[float]]:
    """G[k][l]: the least, over cuts of layers l..L-1 into stages k..S-1 that fit memory, of
    max over those stages of (F0's arrival relative to stage k) + ``stage_lb`` (inf if none fits)."""
    L, S = lp.num_layers, lp.stages
    G = [[INF] * (L + 1) for _ in range(S + 1)]
    for l in range(S - 1, L):
        G[S - 1][l] = stage_lb(S - 1, l, L)
    for k in range(S - 2, -1, -1):
        nxt, row = G[k + 1], G[k]
        for l in range(k, L - (S - 1 - k)):
            best = INF
            for e in range(l + 1, L - (S - 2 - k)):
                if nxt[e] < best:
                    v = max(stage_lb(k, l, e), fwd(k, l, e) + delay[e - 1][k] + nxt[e])
                    if v < best:
                        best = v
            row[l] = best
    return G


def block_shifts(parts: list[int]) -> Iterator[list[int]]:
    """The local search's moves: boundaries i..j (1 <= i <= j < S) all moved by one layer the same
    way, so one layer goes from stage i-1 to stage j or back and the stages between keep their
    sizes (i = j: one boundary moved). A single boundary move cannot shift a layer across
    several stages without first making some stage worse; a block shift can."""
    S = len(parts) - 1
    for i in range(1, S):
        for j in range(i, S):
            for d in (-1, 1):
                if parts[i - 1] < parts[i] + d and parts[j] + d < parts[j + 1]:
                    yield parts[:i] + [x + d for x in parts[i:j + 1]] + parts[j + 1:]


def partition(lp: LayerProfile, *, time_limit_s: Optional[float] = None,
              slowdown: Optional[Sequence[float]] = None) -> PartitionResult:
    """The feasible partition with the least ``quick_ms`` (branch and bound, module docstring);
    with ``time_limit_s``, the best found by then (``complete`` says which; the starting points
    of the local search are scored whatever the limit). ``slowdown`` (one factor > 0 per stage)
    multiplies stage s's F, B and W by ``slowdown[s]``, as in ``LayerProfile.costs``.

    Raises BadInput (a ValueError) naming what to fix if ``slowdown`` is not one finite factor
    above 0 per stage, or naming the profile keys if no partition fits memory."""
    t0 = time.perf_counter()
    L, S, N = lp.num_layers, lp.stages, lp.microbatches
    slow = check_slowdown(slowdown, S)
    pf, pb, pw = lp._prefix  # the prefix sums ``lp.costs`` uses
    delay = [[lp.link_ms(i, j) for j in range(S - 1)] for i in range(L)]
    cap_memo: dict[tuple[int, int, int], Optional[int]] = {}

    def cap(s: int, a: int, e: int) -> Optional[int]:
        key = (s, a, e)
        if key not in cap_memo:
            cap_memo[key] = lp.stage_cap(s, a, e)
        return cap_memo[key]

    def fwd(k: int, a: int, e: int) -> float:
        return (pf[e] - pf[a]) * slow[k]

    D = _trip_table(lp, slow, cap, delay)

    def trip_below(k: int, e: int) -> float:
        """The least round trip below stage k ending before layer e (``_trip_table``)."""
        return 2 * delay[e - 1][k] + D[k + 1][e] if k < S - 1 else 0.0

    lb_memo: dict[tuple[int, int, int], float] = {}

    def stage_lb(k: int, l: int, e: int) -> float:
        """A bound on the iteration time minus F0's arrival at stage k holding layers l..e-1, whatever
        the other stages hold (inf if they do not fit): ``bounds`` terms 1-3 for that stage with
        what depends on the other stages at its least (g_s = f_s, tail_s = w_s, the round trip
        ``trip_below``), and ``cap_bound_ms``'s term likewise."""
        key = (k, l, e)
        got = lb_memo.get(key)
        if got is None:
            c = cap(k, l, e)
            trip = trip_below(k, e)
            if c is None or trip == INF:
                got = INF
            else:
                x = slow[k]
                f, b, w = (pf[e] - pf[l]) * x, (pb[e] - pb[l]) * x, (pw[e] - pw[l]) * x
                got = max(N * (f + b + w), f + trip + N * (b + w) + (N - c) * f, cap_chain(0.0, f, b, w, trip, c, N))
            lb_memo[key] = got
        return got

    G = _suffix_table(lp, stage_lb, fwd, delay)
    if G[0][0] == INF:
        raise BadInput(
            f"no way to cut {L} layers into {S} stages fits memory.capacity_mb: "
            "raise the capacity, lower layers.memory_mb or layers.stash_mb, or use more stages"
        )
    deadline = None if time_limit_s is None else t0 + time_limit_s
    st = {"best": INF, "parts": None, "lb": INF, "open": INF, "replayed": 0, "leaves": 0, "stopped": False}
    memo: dict[tuple, float] = {}  # (stage costs, caps) -> quick_ms
    bound_memo: dict[tuple, float] = {}  # parts -> leaf bound
    parts = [0] * (S + 1)
    parts[S] = L
    caps = [0] * S

    def expired() -> bool:
        return deadline is not None and time.perf_counter() > deadline

    def stage_costs(p: list[int]) -> Costs:
        """``lp.costs(p, slow)`` from the tables: the same floats, without the model's attribute lookups."""
        r = range(S)
        return Costs([(pf[p[s + 1]] - pf[p[s]]) * slow[s] for s in r], [(pb[p[s + 1]] - pb[p[s]]) * slow[s] for s in r],
                     [(pw[p[s + 1]] - pw[p[s]]) * slow[s] for s in r], [delay[p[i + 1] - 1][i] for i in range(S - 1)])

    def caps_of(p: list[int]) -> Optional[list[int]]:
        got = [cap(s, p[s], p[s + 1]) for s in range(S)]
        return None if None in got else got

    def leaf_bound(p: list[int], kcaps: list[int]) -> float:
        """``lower_bound_ms`` and ``cap_bound_ms`` of a complete partition: no plan of it is faster."""
        key = tuple(p)
        got = bound_memo.get(key)
        if got is None:
            costs = stage_costs(p)
            got = bound_memo[key] = max(lower_bound_ms(costs, N, caps=kcaps), cap_bound_ms(costs, N, kcaps))
        return got

    def score(p: list[int], kcaps: list[int], floor: float = 0.0) -> float:
        costs = stage_costs(p)
        key = (tuple(costs.f), tuple(costs.b), tuple(costs.w), tuple(costs.links), tuple(kcaps))
        got = memo.get(key)
        if got is None:
            st["replayed"] += 1
            got = memo[key] = quick_ms(costs, N, list(kcaps), floor)
        return got

    def offer(p: list[int], t: float) -> None:
        if t < st["best"] - EPS:
            st["best"], st["parts"] = t, list(p)

    def leaf(a: float, bound: float, g: float, up: float, kmin: int) -> None:
        """Stages 0..S-2 are cut, the last stage holds the rest; the arguments as in ``node``.
        The last stage's own bound terms (exact: nothing is below it) come first, as they are
        cheap; only then the whole partition's bound, and a replay if it may beat the best."""
        st["leaves"] += 1
        k, l = S - 1, parts[S - 1]
        c = caps[k] = cap(k, l, L)
        x = slow[k]
        f, b, w = (pf[L] - pf[l]) * x, (pb[L] - pb[l]) * x, (pw[L] - pw[l]) * x
        if max(bound, stage_bound(a, f, b, w, 0.0, max(g, f), up, c, min(kmin, c), N)) >= st["best"] - EPS:
            return
        lb = leaf_bound(parts, caps)
        st["lb"] = min(st["lb"], lb)
        if lb >= st["best"] - EPS:
            return
        offer(parts, score(parts, caps, lb))

    def node(k: int, l: int, a: float, pre: float, bound: float, g: float, up: float, kmin: int) -> None:
        """Stages 0..k-1 are cut (``parts[:k+1]``), stage k starts at layer l, F0 arrives at a;
        ``pre``: the prefix stages' largest bound; ``bound``: this node's bound; ``g``, ``up``,
        ``kmin``: the slowest forward, the gradient path's tail (``bounds.stage_bound``) and the least
        cap of the stages above."""
        if st["stopped"] or expired():
            st["stopped"] = True
            st["open"] = min(st["open"], bound)
            return
        if k == S - 1:
            leaf(a, bound, g, up, kmin)
            return
        kids = []
        nxt, x, cut = G[k + 1], slow[k], st["best"] - EPS
        for e in range(l + 1, L - (S - 2 - k)):
            f, b, w = (pf[e] - pf[l]) * x, (pb[e] - pb[l]) * x, (pw[e] - pw[l]) * x
            if a + N * (f + b + w) >= cut:
                break  # bound term 1 of stage k; it only grows with e
            c = cap(k, l, e)
            arrive = a + f + delay[e - 1][k]
            if c is None or arrive + nxt[e] >= cut:  # (inf where the rest does not fit)
                continue
            here = max(pre, stage_bound(a, f, b, w, trip_below(k, e), max(g, f), up, c, min(kmin, c), N))
            kids.append((max(here, arrive + nxt[e]), e, arrive, here, f, b, w, c))
        kids.sort()
        for bd, e, arrive, here, f, b, w, c in kids:
            if bd >= st["best"] - EPS:
                break
            parts[k + 1] = e
            caps[k] = c
            node(k + 1, e, arrive, here, bd, max(g, f), max(up, w) + delay[e - 1][k] + b, min(kmin, c))

    def descend(p: list[int], t: float) -> tuple[list[int], float]:
        """Best-improvement local search over ``block_shifts`` from ``p`` (score ``t``); a move is
        replayed only if its bound leaves room to beat the best move found so far."""
        while not expired():
            best_q, best_t = None, t
            for q in block_shifts(p):
                qc = caps_of(q)
                if qc is None or leaf_bound(q, qc) >= best_t - EPS:
                    continue
                tq = score(q, qc)
                if tq < best_t - EPS:
                    best_q, best_t = q, tq
            if best_q is None:
                break
            p, t = best_q, best_t
        return p, t

    # An incumbent first: local search from the bound's optimum, the uniform and the work-balanced
    # partition. It only makes the pruning start earlier.
    lay = lp.layers
    for start in (_table_optimum(lp, G, stage_lb, fwd, delay), uniform_parts(L, S),
                  balanced_parts([(x + y + z) for x, y, z in zip(lay.forward_ms, lay.backward_input_ms,
                                                                 lay.backward_weight_ms)], S)):
        kc = caps_of(start)
        if kc is None:
            continue
        offer(*descend(start, score(start, kc)))

    node(0, 0, 0.0, 0.0, G[0][0], 0.0, -INF, N)
    lb = min(st["lb"], st["open"], st["best"])
    return PartitionResult(st["parts"], st["best"], lb, st["replayed"], st["leaves"], not st["stopped"],
                           time.perf_counter() - t0)


def _table_optimum(lp: LayerProfile, G, stage_lb, fwd, delay) -> list[int]:
    """A partition attaining the suffix table's optimum (it fits memory)."""
    L, S = lp.num_layers, lp.stages
    parts, l = [0], 0
    for k in range(S - 1):
        e = min((e for e in range(l + 1, L - (S - 2 - k)) if G[k + 1][e] < INF),
                key=lambda e: max(stage_lb(k, l, e), fwd(k, l, e) + delay[e - 1][k] + G[k + 1][e]))
        parts.append(e)
        l = e
    return parts + [L]
