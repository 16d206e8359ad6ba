"""Exact planner for small cases: a MILP over op start times, solved with HiGHS (``highspy``).

Formulation (all times in ms; stage s, micro-batch m, kind k in F/B/W, d(s,k) the op time):

* ``t[s,k,m] >= 0`` continuous start times, ``C`` the makespan; minimise ``C``.
  ``t[0,F,0] = 0`` (F0 on stage 0 is the only op that can come first, so shifting any plan to start
  at 0 fixes it) and ``C >= t[s,W,N-1] + d(s,W)`` (under FIFO W_{N-1} ends last on each stage).
* Precedences ``t[b] >= t[a] + lag`` exactly as ``simulate.replay`` has them: F m on s after F m on
  s-1 plus link s-1; B m on s < S-1 after B m on s+1 plus link s and after own F m (last stage: own
  F m only); W m after own B m.
* Per-kind FIFO (symmetry breaking): on every stage F m before F m+1, B m before B m+1, W m before W m+1.
  This loses no optimality because micro-batches are identical (op times depend only on stage and
  kind). Take any feasible plan and relabel, per stage and kind, the k-th slot in time as micro-batch
  k. Each dependency "slot on s waits for a slot of a given kind on s' plus lag" keeps holding: the k
  earliest slots on s each wait for a distinct slot on s', so at least k of those ends are
  <= t_k - lag, and the k-th earliest one (now micro-batch k) is too. Own-stage F->B->W works the same
  way, and in-flight counts (#F done - #B done) do not depend on labels. Same slots, so same makespan.
  ``fifo_relabel`` does exactly this to a warm start.
* Disjunctions: two ops of different kinds on a stage whose order FIFO + dependencies do not fix,
  i.e. (F i, B j), (F i, W j), (B i, W j) with i > j, get a binary ``z`` (1: the op of micro-batch j
  runs first) and the pair of big-M rows ``t_P >= t_Q + d_Q - M1 (1 - z)``,
  ``t_Q >= t_P + d_P - M2 z``. M1, M2 are the largest value the left-hand gap can take inside the
  time windows ``[head, UB - tail]`` (longest dependency paths from the start and to the end; UB =
  the makespan of a known feasible plan), so they are as tight as the windows allow.
  Valid cuts: ``z[i,j] <= z[i,j-1]`` and ``z[i,j] <= z[i+1,j]`` (FIFO makes "Q_j before P_i"
  monotone); per op a, stage energy ``t_a >= t[F 0] + sum_b d_b [b before a]`` and
  ``C >= t_a + d_a + sum_b d_b [b after a]`` over the ops b of its stage, where [.] is a constant
  (FIFO, dependency, cap) or a binary; and a static one-stage bound on C from heads and tails
  (``bounds.one_machine_bound``) that the big-M relaxation cannot see.
* Memory cap c on stage s: the in-flight count at the start of F i is
  ``#F started before + 1 - #B finished before = i + 1 - sum_j z(B j before F i) <= c``. Under FIFO
  the binaries of B are monotone in j, so this linear row is equivalent to ``z(B_{i-c} before F_i) =
  1``: we add it as the precedence ``t[F i] >= t[B_{i-c}] + b`` (the strongest form) and drop the
  binaries it fixes.

The plan is read off the start times (ties broken by dependency depth), replayed with
``simulate.replay`` and the replayed makespan is returned (it equals the objective at optimality).
"""
from __future__ import annotations

import ctypes
import os
import sys
import time
from dataclasses import dataclass, field

from ..ir.ops import KINDS, Kind, Op, Schedule, peak_inflight
from ..ir.profile import Costs
from ..sim.simulate import replay
from ..sim.timeline import Timeline
from .bounds import one_machine_bound
from .listsched import list_schedule
from .warmup import initial_warmup

# Pairs of kinds that need binaries: (P, Q) with P_i, Q_j unordered for i > j.
_PAIRS = ((Kind.F, Kind.B), (Kind.F, Kind.W), (Kind.B, Kind.W))


@dataclass
class ExactResult:
    """What ``solve_exact`` found; ``optimal`` iff HiGHS proved ``iteration_ms`` minimal."""

    schedule: Schedule
    iteration_ms: float  # replayed makespan of ``schedule``
    objective_ms: float  # the solver's incumbent objective
    lower_bound_ms: float  # the solver's dual bound (at least the model's static bound on C)
    optimal: bool
    seconds: float
    status: str = ""  # HiGHS model status text
    binaries: int = 0
    rows: int = 0

    @property
    def gap(self) -> float:
        """Relative gap of the returned plan to the proven lower bound."""
        return 0.0 if self.iteration_ms <= 0 else (self.iteration_ms - self.lower_bound_ms) / self.iteration_ms


def _import_highspy():
    try:
        import highspy
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the exact planner needs HiGHS: pip install ds_pipemorph[milp] (or pip install highspy)"
        ) from e
    return highspy


# ----------------------------------------------------------------------------- indexing


class _Index:
    """Column numbers: start times (s, kind, m), then C, then binaries."""

    def __init__(self, stages: int, microbatches: int):
        self.S, self.N = stages, microbatches
        self.n_times = 3 * stages * microbatches
        self.C = self.n_times

    def t(self, s: int, k: Kind, m: int) -> int:
        return (s * 3 + k.code) * self.N + m

    def node(self, col: int) -> tuple[int, Kind, int]:
        sk, m = divmod(col, self.N)
        s, k = divmod(sk, 3)
        return s, KINDS[k], m


def precedences(costs: Costs, N: int, caps: list[int], ix: _Index) -> list[tuple[int, int, float]]:
    """Fixed edges (a, b, lag) meaning ``t[b] >= t[a] + lag``: dependencies, FIFO, memory caps."""
    S, L = costs.stages, costs.links
    e: list[tuple[int, int, float]] = []
    for s in range(S):
        f, b, w = costs.f[s], costs.b[s], costs.w[s]
        for m in range(N):
            if s > 0:
                e.append((ix.t(s - 1, Kind.F, m), ix.t(s, Kind.F, m), costs.f[s - 1] + L[s - 1]))
            if s < S - 1:
                e.append((ix.t(s + 1, Kind.B, m), ix.t(s, Kind.B, m), costs.b[s + 1] + L[s]))
            e.append((ix.t(s, Kind.F, m), ix.t(s, Kind.B, m), f))
            e.append((ix.t(s, Kind.B, m), ix.t(s, Kind.W, m), b))
            if m + 1 < N:
                for k, d in ((Kind.F, f), (Kind.B, b), (Kind.W, w)):
                    e.append((ix.t(s, k, m), ix.t(s, k, m + 1), d))
            c = caps[s]
            if m >= c:
                e.append((ix.t(s, Kind.B, m - c), ix.t(s, Kind.F, m), b))
    return e


def _topological(n: int, edges) -> tuple[list[int], list[list[tuple[int, float]]]]:
    out: list[list[tuple[int, float]]] = [[] for _ in range(n)]
    indeg = [0] * n
    for a, b, lag in edges:
        out[a].append((b, lag))
        indeg[b] += 1
    order = [v for v in range(n) if indeg[v] == 0]
    for v in order:  # Kahn: ``order`` grows while we walk it
        for b, _ in out[v]:
            indeg[b] -= 1
            if indeg[b] == 0:
                order.append(b)
    if len(order) != n:  # pragma: no cover - caps >= 1 keep the graph acyclic
        raise ValueError("precedence graph has a cycle")
    return order, out


def windows(ix: _Index, edges, dur: list[float], caps: list[int]) -> tuple[list[float], list[float], list[int]]:
    """Heads (earliest starts), tails (longest time from a start to the end, incl. own time), depths.

    Longest paths over the fixed edges, alternated with one-stage energy until nothing moves: an op
    starts no earlier than ``h + sum d_b`` over its fixed same-stage predecessors b with head >= h,
    and its tail covers its fixed same-stage successors likewise.
    """
    n = ix.n_times
    order, out = _topological(n, edges)
    head, tail, depth = [0.0] * n, list(dur), [0] * n
    for v in order:
        for b, _ in out[v]:
            depth[b] = max(depth[b], depth[v] + 1)
    for _ in range(20):
        for v in order:
            for b, lag in out[v]:
                head[b] = max(head[b], head[v] + lag)
        for v in reversed(order):
            for b, lag in out[v]:
                tail[v] = max(tail[v], lag + tail[b])
        if not _lift_by_stage_energy(ix, head, tail, dur, caps):
            break
    return head, tail, depth


def _lift_by_stage_energy(ix: _Index, head, tail, dur, caps) -> bool:
    moved = False
    after = [t - d for t, d in zip(tail, dur)]  # time from an op's end to the end
    ops = [(k, m) for k in KINDS for m in range(ix.N)]
    for s in range(ix.S):
        col = {a: ix.t(s, *a) for a in ops}
        for a in ops:
            va = col[a]
            order = {b: _fixed_before(a, b, caps[s]) for b in ops if b != a}
            h = _release_energy([col[b] for b, o in order.items() if o is True], head, dur)
            t = dur[va] + _release_energy([col[b] for b, o in order.items() if o is False], after, dur)
            if h > head[va] + 1e-9:
                head[va], moved = h, True
            if t > tail[va] + 1e-9:
                tail[va], moved = t, True
    return moved


def _release_energy(group: list[int], release: list[float], dur: list[float]) -> float:
    """max over h of h + sum of d over the ops of ``group`` released at h or later (0 if empty)."""
    best, acc = 0.0, 0.0
    for v in sorted(group, key=lambda v: -release[v]):
        acc += dur[v]
        best = max(best, release[v] + acc)
    return best


# ----------------------------------------------------------------------------- model


@dataclass
class _Model:
    ix: _Index
    n_cols: int
    lb: list[float]
    ub: list[float]
    binaries: list[tuple[int, str, int, str, int, int]]  # (s, P, i, Q, j, col)
    depth: list[int]  # dependency depth of each start-time column (tie-break when extracting)
    dur: list[float]  # op time of each start-time column
    row_lo: list[float] = field(default_factory=list)
    row_hi: list[float] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    idx: list[int] = field(default_factory=list)
    val: list[float] = field(default_factory=list)

    def row(self, coefs: dict[int, float] | list[tuple[int, float]], lo: float, hi: float = float("inf")) -> None:
        self.starts.append(len(self.idx))
        for c, v in (coefs.items() if isinstance(coefs, dict) else coefs):
            self.idx.append(c)
            self.val.append(v)
        self.row_lo.append(lo)
        self.row_hi.append(hi)


def build_model(costs: Costs, N: int, caps: list[int], upper_bound: float) -> _Model:
    """The MILP of the module docstring, as plain arrays (columns and sparse rows)."""
    S = costs.stages
    ix = _Index(S, N)
    dur = [costs.op_time(s, k) for s, k, _ in map(ix.node, range(ix.n_times))]
    edges = precedences(costs, N, caps, ix)
    head, tail, depth = windows(ix, edges, dur, caps)
    lst = [upper_bound - tail[v] for v in range(ix.n_times)]
    per_stage = [[ix.t(s, k, m) for k in KINDS for m in range(N)] for s in range(S)]
    lb = head + [max(max(head[v] + tail[v] for v in range(ix.n_times)), one_machine_bound(per_stage, head, tail, dur))]
    ub = lst + [upper_bound]
    ub[ix.t(0, Kind.F, 0)] = 0.0
    model = _Model(ix, ix.n_times + 1, lb, ub, [], depth, dur)
    for a, b, lag in edges:
        model.row({b: 1.0, a: -1.0}, lag)
    for s in range(S):
        model.row({ix.C: 1.0, ix.t(s, Kind.W, N - 1): -1.0}, costs.w[s])
        zs = _add_disjunctions(model, s, N, caps[s], head, lst, dur)
        _add_energy_cuts(model, s, N, caps[s], zs)
    return model


def _add_disjunctions(model: _Model, s: int, N: int, cap: int, head, lst, dur) -> dict:
    """Binaries z (Q_j runs before P_i) for each unordered pair, big-M rows, monotone cuts.

    Returns {(P, i, Q, j): column} for the stage.
    """
    ix = model.ix
    zs: dict[tuple[str, int, str, int], int] = {}
    for P, Q in _PAIRS:
        z: dict[tuple[int, int], int] = {}
        for i in range(N):
            for j in range(i):
                if _fixed_before((P, i), (Q, j), cap) is not None:
                    continue  # fixed by the memory cap: B_j before F_i
                col = model.n_cols
                model.n_cols += 1
                model.lb.append(0.0)
                model.ub.append(1.0)
                model.binaries.append((s, P, i, Q, j, col))
                z[i, j] = zs[P, i, Q, j] = col
                p, q = ix.t(s, P, i), ix.t(s, Q, j)
                m1 = max(0.0, lst[q] + dur[q] - head[p])  # largest t_Q + d_Q - t_P
                m2 = max(0.0, lst[p] + dur[p] - head[q])  # largest t_P + d_P - t_Q
                model.row({p: 1.0, q: -1.0, col: -m1}, dur[q] - m1)
                model.row({q: 1.0, p: -1.0, col: m2}, dur[p])
        for (i, j), col in z.items():
            if (i, j - 1) in z:
                model.row({z[i, j - 1]: 1.0, col: -1.0}, 0.0)
            if (i + 1, j) in z:
                model.row({z[i + 1, j]: 1.0, col: -1.0}, 0.0)
    return zs


def _fixed_before(a: tuple[Kind, int], b: tuple[Kind, int], cap: int) -> bool | None:
    """Whether op b runs before op a on a stage by FIFO, dependencies or the cap; None: a binary decides."""
    (ka, ma), (kb, mb) = a, b
    if ka == kb:
        return mb < ma
    if ka.code > kb.code:
        r = _fixed_before(b, a, cap)
        return None if r is None else not r
    # a = P_i, b = Q_j with P earlier in F, B, W: P_i runs first if i <= j; the cap puts B_j first.
    if ma <= mb:
        return False
    if ka is Kind.F and kb is Kind.B and mb <= ma - cap:
        return True
    return None


def _before(a: tuple[Kind, int], b: tuple[Kind, int], cap: int, zs: dict) -> tuple[float, int | None, float]:
    """[b runs before a] on one stage as ``const + sign * z`` -> (const, z column or None, sign)."""
    fixed = _fixed_before(a, b, cap)
    if fixed is not None:
        return float(fixed), None, 0.0
    if a[0].code < b[0].code:  # a = P_i, b = Q_j: z = 1 means Q_j first
        return 0.0, zs[a[0], a[1], b[0], b[1]], 1.0
    return 1.0, zs[b[0], b[1], a[0], a[1]], -1.0


def _add_energy_cuts(model: _Model, s: int, N: int, cap: int, zs: dict) -> None:
    """Per op a on stage s, everything on the stage before a fits in [t(F 0), t_a], everything after
    it in [t_a + d_a, C]:  ``t_a >= t(F 0) + sum_b d_b [b before a]`` and
    ``C >= t_a + d_a + sum_b d_b [b after a]``, with [.] a constant or a binary (FIFO, caps fix most).
    """
    ix = model.ix
    ops = [(k, m) for k in KINDS for m in range(N)]
    f0 = ix.t(s, Kind.F, 0)
    for a in ops:
        ta, da = ix.t(s, *a), model.dur[ix.t(s, *a)]
        pred: dict[int, float] = {ta: 1.0, f0: -1.0}
        succ: dict[int, float] = {ix.C: 1.0, ta: -1.0}
        pred_rhs, succ_rhs = 0.0, da
        for b in ops:
            if b == a:
                continue
            db = model.dur[ix.t(s, *b)]
            const, col, sign = _before(a, b, cap, zs)
            pred_rhs += db * const  # before: const + sign z
            succ_rhs += db * (1.0 - const)  # after: (1 - const) - sign z
            if col is not None and db:
                pred[col] = pred.get(col, 0.0) - db * sign
                succ[col] = succ.get(col, 0.0) + db * sign
        if a != (Kind.F, 0):
            model.row(pred, pred_rhs)
        model.row(succ, succ_rhs)


# ----------------------------------------------------------------------------- warm start


def fifo_relabel(schedule: Schedule) -> Schedule:
    """The same orders with micro-batches renumbered per stage and kind by occurrence (per-kind FIFO).

    A stage runs its row in order, so the k-th op of a kind in the row is the k-th slot of that kind
    in time; by the argument in the module docstring the relabelled plan is valid, within the same
    caps, and its replay is no slower.
    """
    out: Schedule = []
    for row in schedule:
        seen = {k: 0 for k in KINDS}
        new_row = []
        for op in row:
            new_row.append(Op(op.kind, seen[op.kind]))
            seen[op.kind] += 1
        out.append(new_row)
    return out


def _sequential(S: int, N: int) -> Schedule:
    """F m, B m, W m per micro-batch on every stage: feasible under any cap >= 1."""
    row = [Op(k, m) for m in range(N) for k in KINDS]
    return [list(row) for _ in range(S)]


def incumbent(costs: Costs, N: int, caps: list[int], warm_start: Schedule | None) -> tuple[Schedule, Timeline]:
    """Best FIFO plan among the warm start, the list scheduler (Alg. 1 warm-up) and the sequential plan."""
    S = costs.stages
    cands = [_sequential(S, N)]
    try:
        cands.append(list_schedule(costs, N, initial_warmup(caps)))
    except (RuntimeError, ValueError):  # pragma: no cover - the greedy pass is only a hint here
        pass
    if warm_start is not None:
        cands.append(warm_start)
    best: tuple[Schedule, Timeline] | None = None
    for cand in cands:
        try:
            fifo = fifo_relabel(cand)
            tl = replay(fifo, costs, N)
        except ValueError:
            continue
        if any(p > c for p, c in zip(peak_inflight(fifo), caps)):
            continue
        if best is None or tl.iteration_ms < best[1].iteration_ms - 1e-9:
            best = (fifo, tl)
    assert best is not None  # the sequential plan always qualifies
    return best


def solution_vector(model: _Model, schedule: Schedule, tl: Timeline) -> list[float]:
    """Column values of a FIFO plan: its replayed start times, its order as binaries, C."""
    ix = model.ix
    x = [0.0] * model.n_cols
    pos: dict[tuple[int, str, int], int] = {}
    for s, row in enumerate(schedule):
        for p, op in enumerate(row):
            pos[s, op.kind, op.mb] = p
    for sl in tl.slots:
        x[ix.t(sl.stage, sl.op.kind, sl.op.mb)] = sl.start
    x[ix.C] = tl.iteration_ms
    for s, P, i, Q, j, col in model.binaries:
        x[col] = 1.0 if pos[s, Q, j] < pos[s, P, i] else 0.0
    return x


# ----------------------------------------------------------------------------- solve


def _check_caps(caps: list[int] | None, S: int, N: int) -> list[int]:
    if caps is None:
        return [N] * S
    if len(caps) != S:
        raise ValueError(f"caps has {len(caps)} values, expected {S} (one per stage)")
    for s, c in enumerate(caps):
        if c < 1:
            raise ValueError(f"stage {s}: cap {c} is below 1; a stage must hold one activation")
    return [min(int(c), N) for c in caps]


def _solve(highspy, model: _Model, start: list[float], time_limit_s: float):
    import numpy as np

    h = _new_highs(highspy)
    h.setOptionValue("output_flag", False)
    h.setOptionValue("time_limit", float(time_limit_s))
    h.setOptionValue("mip_rel_gap", 1e-7)
    h.setOptionValue("mip_abs_gap", 1e-6)
    h.setOptionValue("random_seed", 0)
    n = model.n_cols
    h.addVars(n, np.array(model.lb, dtype=np.float64), np.array(model.ub, dtype=np.float64))
    h.changeColsCost(1, np.array([model.ix.C], dtype=np.int32), np.array([1.0]))
    cols = np.array([b[-1] for b in model.binaries], dtype=np.int32)
    if len(cols):
        kint = np.full(len(cols), int(highspy.HighsVarType.kInteger), dtype=np.uint8)
        h.changeColsIntegrality(len(cols), cols, kint)
    h.addRows(
        len(model.row_lo),
        np.array(model.row_lo, dtype=np.float64),
        np.array(model.row_hi, dtype=np.float64),
        len(model.idx),
        np.array(model.starts, dtype=np.int32),
        np.array(model.idx, dtype=np.int32),
        np.array(model.val, dtype=np.float64),
    )
    h.setSolution(n, np.arange(n, dtype=np.int32), np.array(start, dtype=np.float64))
    h.run()
    return h


def extract_schedule(model: _Model, x: list[float], N: int) -> Schedule:
    """Per-stage order by start time; ties (zero-time ops) broken by end time, then dependency depth."""
    ix = model.ix
    out: Schedule = []
    for s in range(ix.S):
        cols = [ix.t(s, k, m) for k in KINDS for m in range(N)]

        def key(c):
            _, k, m = ix.node(c)
            return (round(x[c], 6), round(x[c] + model.dur[c], 6), model.depth[c], k.code, m)

        out.append([Op(*ix.node(c)[1:]) for c in sorted(cols, key=key)])
    return out


def solve_exact(
    costs: Costs,
    microbatches: int,
    *,
    caps: list[int] | None = None,
    time_limit_s: float = 60.0,
    warm_start: Schedule | None = None,
) -> ExactResult:
    """Minimum-makespan plan by MILP (module docstring), within ``time_limit_s``.

    Assumes per-kind FIFO order on every stage (F m before F m+1, likewise B and W); this loses no
    optimality because micro-batches are identical (argument in the module docstring). The best of
    ``warm_start`` (relabelled FIFO), the list scheduler and the sequential plan is both the big-M
    upper bound and HiGHS's starting solution. ``optimal`` means HiGHS proved it (relative gap 1e-7);
    otherwise ``lower_bound_ms`` is the proven bound and the plan is the best one found.
    """
    highspy = _import_highspy()
    t0 = time.perf_counter()
    S, N = costs.stages, microbatches
    caps = _check_caps(caps, S, N)
    inc, inc_tl = incumbent(costs, N, caps, warm_start)
    model = build_model(costs, N, caps, inc_tl.iteration_ms)
    h = _solve(highspy, model, solution_vector(model, inc, inc_tl), max(0.0, time_limit_s - (time.perf_counter() - t0)))
    status = h.getModelStatus()
    info = h.getInfo()
    optimal = status == highspy.HighsModelStatus.kOptimal
    has_primal = info.primal_solution_status == 2  # kSolutionStatusFeasible
    if has_primal:
        x = list(h.getSolution().col_value)
        schedule = extract_schedule(model, x, N)
        objective = float(info.objective_function_value)
    else:  # no incumbent accepted (should not happen: we always pass one)
        schedule, objective = inc, inc_tl.iteration_ms
    lower = max(float(info.mip_dual_bound), model.lb[model.ix.C])  # -inf if stopped before the root LP
    tl = replay(schedule, costs, N)
    _check_result(schedule, tl, caps, objective, optimal)
    return ExactResult(
        schedule=schedule,
        iteration_ms=tl.iteration_ms,
        objective_ms=objective,
        lower_bound_ms=min(lower, tl.iteration_ms),
        optimal=optimal,
        seconds=time.perf_counter() - t0,
        status=h.modelStatusToString(status),
        binaries=len(model.binaries),
        rows=len(model.row_lo),
    )


def _check_result(schedule: Schedule, tl: Timeline, caps: list[int], objective: float, optimal: bool) -> None:
    """Replay starts ops as early as possible: replay <= objective, and equal at optimality."""
    tol = 1e-6 * max(1.0, abs(objective))
    if tl.iteration_ms > objective + tol:
        raise RuntimeError(f"replayed plan takes {tl.iteration_ms} ms, more than the MILP objective {objective} ms")
    if optimal and tl.iteration_ms < objective - tol:
        raise RuntimeError(f"replayed plan takes {tl.iteration_ms} ms, less than the 'optimal' objective {objective} ms")
    for s, (p, c) in enumerate(zip(tl.peak_inflight, caps)):
        if p > c:
            raise RuntimeError(f"stage {s}: extracted plan holds {p} activations, above its cap {c}")


def _new_highs(highspy):
    """A ``Highs`` instance. HiGHS prints its banner from C to the process's standard output when
    the first instance is built, before any option can silence it; it goes to standard error
    instead, so that what a command prints (``pipemorph plan --json``) stays what it promises."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        h = highspy.Highs()
        ctypes.CDLL(None).fflush(None)  # C's buffered output, while it still goes to stderr
    finally:
        os.dup2(saved, 1)
        os.close(saved)
    return h
