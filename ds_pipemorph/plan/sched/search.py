"""Planning beyond one greedy pass: a portfolio of list-scheduler variants, then local search.

1. Portfolio: warm-up vectors (Alg. 1 from the caps, Alg. 2 from the delays, ZB-H1's S−s, the caps
   themselves, and ±1 neighbours of the best) × steady-phase policies; every candidate is scored by
   the replay simulator, so a plan's score is exactly what its order takes under the profile.
2. Double justification (``justify``) of the best few portfolio orders: every op as late, then as
   early as possible, into any gap of its stage; never slower, often several percent faster.
3. Iterated local search (``improve``) from the best few distinct orders: moves that take an op out
   of a back-to-back run on the critical path, Ws moved into gaps, random shifts, with small uphill
   steps allowed.
4. Optional exact solver for small cases (``milp`` extra), warm-started with the best order.
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence, Union

from ..ir.links import LATENCY, Latency, LinkModel, per_link
from ..ir.memory import caps_within, fit_budget, fits
from ..ir.ops import Schedule, peak_inflight, warmup_counts
from ..ir.profile import Costs
from ..sim import native
from ..sim.incremental import Evaluator
from .baselines import zb_h1_warmup
from .bounds import first_arrivals, lower_bound_ms
from .improve import improve
from .justify import justify
from .listsched import list_schedule_encoded
from ..sim.listsched_py import Policy
from .warmup import adapted_warmup, initial_warmup

STARTS = 5  # local-search starting points (best distinct orders; 1 did worse, 3-8 about the same)
JUSTIFY = 10  # best distinct portfolio orders that get justified (10 did better than 0 and than 30)
# The MILP proves most small cases optimal in well under a second, but those the local search misses
# need seconds; within a 1 s budget it made results worse (benchmarks/planner/planner_vs_milp.py), so it
# joins by default only from this budget on.
EXACT_MIN_BUDGET_S = 3.0
JUSTIFY_S_PER_OP = 2e-5  # seconds one op of the schedule adds to a justification, before one was timed
EXACT_MAX_OPS = 48  # stages x micro-batches up to which the MILP runs by default (5 x 8: median 0.05 s)
POLICIES = (Policy("BFW"), Policy("BFW", w_fits_gap=True), Policy("BWF"), Policy("FBW"))


def policies(costs: Costs) -> list[Policy]:
    """The fixed policies plus ones where the bottleneck stage (or it and all below) keeps its W
    for the cool-down, so that it never delays a forward or backward by filling a short gap."""
    S = costs.stages
    work = [costs.f[s] + costs.b[s] + costs.w[s] for s in range(S)]
    neck = max(range(S), key=lambda s: work[s])
    extra = [
        Policy("BFW", late_w=frozenset({neck})),
        Policy("BFW", late_w=frozenset(range(neck, S))),
        Policy("BFW", late_w=frozenset(range(S))),
    ]
    return list(POLICIES) + extra


@dataclass
class SearchResult:
    schedule: Schedule
    iteration_ms: float
    lower_bound_ms: float
    evaluated: int
    seconds: float
    source: str  # which candidate won: "greedy", "portfolio", "justified", "local", "milp"
    trace: list[tuple[float, float]] = field(default_factory=list)  # (seconds, best ms)

    @property
    def greedy_ms(self) -> float:
        """The paper's single greedy pass (Alg. 1 + Alg. 3/4), where every search starts."""
        return self.trace[0][1]

    @property
    def gap_to_bound(self) -> float:
        lb = self.lower_bound_ms
        return 0.0 if lb <= 0 else (self.iteration_ms - lb) / lb


def milp_available() -> bool:
    return importlib.util.find_spec("highspy") is not None


def _key(sched: Schedule, t: float, enc=None, n: int = 0) -> tuple[float, int, int]:
    """Fastest first; among equally fast plans the most resilient (largest minimum slackness, as
    Alg. 1 wants), then the one holding the fewest activations. ``enc``: the schedule's encoding
    for the compiled core (``plan.sim.native``), if known."""
    got = native.peaks_and_warmups(enc, n) if enc is not None else None
    peak, x = got if got is not None else (peak_inflight(sched), warmup_counts(sched))
    min_slack = min((x[i] - x[i + 1] for i in range(len(x) - 1)), default=0)
    return (round(t, 6), -min_slack, sum(peak))


def _pool_key(sched: Schedule, enc) -> object:
    """A key equal for equal schedules: the encoding's bytes when there is one."""
    return enc[1].tobytes() if enc is not None else tuple(map(tuple, sched))


def ramp_warmup(costs: Costs, n: int, caps: list[int]) -> list[int]:
    """Warm-up counts matched to the ramp-up: stage s runs about as many forwards as reach it
    before its first input gradient can (``bounds``: forwards arrive every g_s = max_{j<=s} f_j ms
    from a_s on, the first gradient at r_s), so no gradient waits behind a warm-up forward that
    has not even arrived yet; then within the caps and non-increasing (Lemma 1). On the
    heterogeneous cases of benchmarks/planner/planner_scale.py this start alone reaches the lower bound or
    comes within 0.05 % of it."""
    S, f = costs.stages, costs.f
    a, r = first_arrivals(costs)
    x, g, bound = [], 0.0, n
    for s in range(S):
        g = max(g, f[s])
        want = int((r[s] - a[s]) / g) + 1 if g > 0 else n
        bound = min(bound, caps[s])
        x.append(max(1, min(want, bound)))
    for s in range(1, S):
        x[s] = min(x[s], x[s - 1])
    return x


def _monotone_within(x: list[int], caps: list[int], n: int) -> Optional[list[int]]:
    x = [max(1, min(v, c, n)) for v, c in zip(x, caps)]
    for s in range(len(x) - 2, -1, -1):
        if x[s] < x[s + 1]:
            return None
    return x


def warmup_candidates(costs: Costs, n: int, caps: list[int]) -> list[list[int]]:
    S = costs.stages
    tight = []
    for c in caps:
        tight.append(min(c, n, tight[-1]) if tight else min(c, n))
    base = [
        ramp_warmup(costs, n, caps),
        initial_warmup(caps),
        adapted_warmup(costs, n, caps=caps),
        zb_h1_warmup(S, n),
        tight,
        [min(2 * (S - s) - 1, n) for s in range(S)],
    ]
    out: list[list[int]] = []
    for x in base:
        x = _monotone_within(x, caps, n)
        if x is not None and x not in out:
            out.append(x)
    return out


def _neighbours(x: list[int], caps: list[int], n: int) -> list[list[int]]:
    out = []
    for s in range(len(x)):
        for d in (-1, 1):
            y = list(x)
            y[s] += d
            y = _monotone_within(y, caps, n) if y[s] >= 1 else None
            if y is not None and y != x:
                out.append(y)
    return out


def search(
    costs: Costs,
    microbatches: int,
    *,
    caps: Optional[list[int]] = None,
    budget_s: float = 1.0,
    seed: int = 0,
    exact: Optional[bool] = None,
    max_evals: Optional[int] = None,
    link_model: Union[LinkModel, Sequence[LinkModel]] = LATENCY,
    units: Optional[Sequence[float]] = None,
    w_share: float = 1.0,
) -> SearchResult:
    """The best schedule found within ``budget_s`` seconds and ``max_evals`` replays.

    ``exact``: run the MILP (``milp`` extra) on the rest of the budget, warm-started with the best
    order; ``None`` (default) does so when highspy is installed, stages x micro-batches is at most
    ``EXACT_MAX_OPS`` and the budget is at least ``EXACT_MIN_BUDGET_S``; the heuristics then get
    the first 70 % of the budget.

    The result is deterministic for a given seed when ``max_evals`` is reached before the time
    budget (tests do that); with only a time budget a faster machine may search further.
    ``link_model`` (``plan.ir.links``): score plans with slow links queueing as that model says
    (e.g. ``Direct()``: one message in flight, the sender blocks); the MILP models pure latency
    only, so it is skipped when a link with a delay queues.

    ``units`` (``plan.ir.memory``): each stage's activation memory in micro-batches, what B leaves
    for W counting ``w_share``; the list scheduler keeps within it, and an order found otherwise (the
    local search, justification, the MILP) is scored after ``fit_budget`` made it keep within it.
    """
    t0 = time.perf_counter()
    S, N = costs.stages, microbatches
    caps = [min(c, N) for c in (caps or [N] * S)]
    models = per_link(link_model, S - 1)
    queueing = any(not isinstance(h, Latency) and c > 0 for h, c in zip(models, costs.links))
    auto = S * N <= EXACT_MAX_OPS and budget_s >= EXACT_MIN_BUDGET_S and milp_available() and not queueing
    use_exact = auto if exact is None else exact
    if use_exact and not milp_available():
        raise ImportError("the exact planner needs highspy: pip install 'ds_pipemorph[milp]'")
    end = t0 + 0.95 * budget_s  # headroom for the final bookkeeping
    deadline = t0 + 0.7 * budget_s if use_exact else end
    ev = Evaluator(costs, N, models)  # every replay of the search, counted for ``max_evals``
    score = ev.time
    trace: list[tuple[float, float]] = []

    memory = None if units is None else (tuple(units), w_share)
    if memory is not None:
        caps = [min(c, k) for c, k in zip(caps, caps_within(units))]

    def fitted(sched, enc):
        """``sched`` kept within the memory (re-encoded if it moved); (sched, enc)."""
        if memory is None or fits(sched, units, w_share):
            return sched, enc
        sched = fit_budget(sched, units, ratio=w_share)
        return sched, (ev.encode(sched) if ev.native else None)

    def refit(sched, t: float):
        """(sched, its time) kept within the memory: fitted and scored anew if it moved."""
        moved, menc = fitted(sched, None)
        return (sched, t) if moved is sched else (moved, score(moved, menc))

    # The paper's single greedy pass first: it is the floor every later step must beat.
    base = Policy() if memory is None else Policy(units=memory[0], w_share=w_share)
    best, enc = list_schedule_encoded(costs, N, initial_warmup(caps), base)
    best_t = score(best, enc)
    best_key = _key(best, best_t, enc, N)
    step_s = time.perf_counter() - t0  # one candidate's cost: stop early enough to keep the budget

    def out_of_time() -> bool:
        if max_evals is not None and ev.evals >= max_evals:
            return True
        return time.perf_counter() + 1.5 * step_s > deadline

    source = "greedy"
    trace.append((time.perf_counter() - t0, best_t))
    lb = lower_bound_ms(costs, N, caps=caps)

    # Portfolio, then ±1 neighbourhoods of the best warm-up while they help. Ties in time go to the
    # more resilient, then the leaner plan, so the search goes on at the bound.
    seen: set[tuple] = set()
    pool: dict[tuple, tuple] = {}  # distinct portfolio orders -> (key, schedule): local-search starts

    def consider(sched, enc, found_by: str) -> bool:
        """Score ``sched``, keep it in the pool and make it the best if its key is; whether it was."""
        nonlocal best, best_t, best_key, source
        sched, enc = fitted(sched, enc)
        t = score(sched, enc)
        k = _key(sched, t, enc, N)
        pool.setdefault(_pool_key(sched, enc), (k, sched))
        if k >= best_key:
            return False
        if t < best_t - 1e-9:
            trace.append((time.perf_counter() - t0, t))
        best, best_t, best_key, source = sched, t, k, found_by
        return True

    pols = policies(costs) if memory is None else [replace(p, units=memory[0], w_share=w_share)
                                                   for p in policies(costs)]
    frontier = warmup_candidates(costs, N, caps)
    while frontier and not out_of_time():
        improved = False
        for x in frontier:
            for pol in pols:
                if (tuple(x), pol) in seen or out_of_time():
                    continue
                seen.add((tuple(x), pol))
                sched, enc = list_schedule_encoded(costs, N, x, pol)
                improved = consider(sched, enc, "portfolio") or improved
        frontier = _neighbours(warmup_counts(best), caps, N) if improved else []

    # Double justification of the best distinct portfolio orders: never slower, often faster. It is
    # pure Python and far slower than a candidate of the portfolio: started only if it can end
    # within the budget by its own measured (at first: estimated) time.
    justify_s = JUSTIFY_S_PER_OP * 3 * S * N
    for _, sc in sorted(pool.values(), key=lambda v: v[0])[:JUSTIFY]:
        if out_of_time() or best_t <= lb + 1e-9 or time.perf_counter() + justify_s > deadline:
            break
        tj = time.perf_counter()
        sched = justify(sc, costs, N, caps)
        justify_s = time.perf_counter() - tj
        if sched is None:
            break
        consider(sched, ev.encode(sched) if ev.native else None, "justified")

    # Iterated local search from the best few distinct orders, sharing the time left.
    starts = [best] + [sc for _, sc in sorted(pool.values(), key=lambda v: v[0]) if sc != best][: STARTS - 1]
    for i, start in enumerate(starts):
        if out_of_time() or best_t <= lb + 1e-9:
            break
        share = (deadline - step_s / 2 - time.perf_counter()) / (len(starts) - i)
        sched, t, _ = improve(start, caps, time.perf_counter() + share, seed + i, out_of_time, ev, lb)
        sched, t = refit(sched, t)
        if t < best_t - 1e-9:
            best, best_t, source = sched, t, "local"
            trace.append((time.perf_counter() - t0, best_t))

    if use_exact and best_t > lb + 1e-9:
        from .milp import solve_exact

        # The solver overruns its limit by its model build and read-out (~10 % of a 1 s budget).
        limit = max(0.05, end - time.perf_counter() - 0.1 * budget_s)
        res = solve_exact(costs, N, caps=caps, time_limit_s=limit, warm_start=best)
        exact_plan, exact_t = refit(res.schedule, res.iteration_ms)
        if exact_t < best_t - 1e-9:
            best, best_t, source = exact_plan, exact_t, "milp"
            trace.append((time.perf_counter() - t0, best_t))
        lb = max(lb, res.lower_bound_ms)
    return SearchResult(best, best_t, lb, ev.evals, time.perf_counter() - t0, source, trace)
