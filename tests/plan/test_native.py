"""The fast planner core equals the pure-Python reference (plan/reference.py) exactly.

On many random cases (1-16 stages, 1-64 micro-batches, op times and delays with zeros and ties,
random warm-ups within caps and outside them, every policy of ``search.policies``, the link models
Latency, Direct and Delegated(k), split and fused backward): the list scheduler gives the same
orders and the same errors; the replay the same slots in the same order (times to 1e-9), busy
times, peaks, iteration time and stuck messages. Both the compiled core (when a C compiler is
there) and the pure-Python fallback are checked.
"""
from __future__ import annotations

import random

import pytest

from ds_pipemorph.plan import native, reference
from ds_pipemorph.plan import simulate as sim
from ds_pipemorph.plan.links import DIRECT, LATENCY, Delegated
from ds_pipemorph.plan.listsched import list_schedule, list_schedule_py
from ds_pipemorph.plan.ops import Op
from ds_pipemorph.plan.profile import Costs
from ds_pipemorph.plan.search import policies

HAVE_NATIVE = native.lib() is not None


@pytest.fixture(params=["native", "python"])
def impl(request, monkeypatch):
    """Run the public functions through the compiled core, or with it switched off."""
    if request.param == "native":
        if not HAVE_NATIVE:
            pytest.skip("no C compiler: the compiled core is not available")
    else:
        monkeypatch.setattr(native, "lib", lambda: None)
    return request.param


def _value(rng: random.Random, hi: float = 20.0) -> float:
    return rng.choice([0.0, 0.0, 1.0, 2.0, 5.0, float(rng.randint(0, 4)), round(rng.uniform(0, hi), 3), rng.uniform(0, hi)])


def random_costs(rng: random.Random, S: int) -> Costs:
    draw = lambda: [_value(rng) for _ in range(S)]  # noqa: E731
    return Costs(draw(), draw(), draw(), [_value(rng, 40.0) for _ in range(S - 1)])


def random_warmup(rng: random.Random, S: int, N: int, wild: bool = True) -> list[int]:
    caps = [rng.randint(1, N) for _ in range(S)]
    x, bound = [], N
    for c in caps:
        bound = min(bound, c)
        x.append(rng.randint(1, bound))
    for s in range(S - 2, -1, -1):  # Lemma 1: non-increasing
        x[s] = max(x[s], x[s + 1])
    if wild and rng.random() < 0.1:  # anything, including counts the scheduler stalls on
        x = [rng.randint(0, N + 1) for _ in range(S)]
    return x


def random_case(rng: random.Random):
    S = rng.choice([1, 2, 3, 4, 5, 8, rng.randint(1, 16)])
    N = rng.choice([1, 2, 3, 4, 8, rng.randint(1, 64)])
    return S, N, random_costs(rng, S)


def _outcome(fn, *args):
    try:
        return fn(*args), None
    except (RuntimeError, ValueError) as e:
        return None, f"{type(e).__name__}: {e}"


@pytest.mark.parametrize("seed", range(6))
def test_list_scheduler_gives_the_reference_schedules(impl, seed):
    rng = random.Random(seed)
    for _ in range(60):
        S, N, costs = random_case(rng)
        x = random_warmup(rng, S, N)
        for pol in policies(costs):
            want = _outcome(reference.list_schedule, costs, N, x, pol)
            assert _outcome(list_schedule, costs, N, x, pol) == want, (costs, N, x, pol)
            if S * N <= 64:
                assert _outcome(list_schedule_py, costs, N, x, pol) == want, (costs, N, x, pol)


def random_order(rng: random.Random, S: int, N: int, fifo: bool) -> list[list[Op]]:
    """Per stage a random order with F m < B m < W m (per-kind micro-batch order if ``fifo``);
    stages may wait on each other in a cycle (stuck)."""
    out = []
    for _ in range(S):
        nxt = {k: list(range(N)) for k in "FBW"}
        if not fifo:
            for k in "FBW":
                rng.shuffle(nxt[k])
        done: dict[str, set] = {"F": set(), "B": set(), "W": set()}
        row: list[Op] = []
        while len(row) < 3 * N:
            ok = [k for k in "FBW" if nxt[k] and (k == "F" or nxt[k][0] in done["F" if k == "B" else "B"])]
            if not ok:  # not FIFO: free the head by a swap with an op that is ready
                k = rng.choice([k for k in "BW" if nxt[k]])
                need = done["F" if k == "B" else "B"]
                i = next(i for i, m in enumerate(nxt[k]) if m in need)
                nxt[k][0], nxt[k][i] = nxt[k][i], nxt[k][0]
                continue
            k = rng.choice(ok)
            m = nxt[k].pop(0)
            done[k].add(m)
            row.append(Op(k, m))
        out.append(row)
    return out


def random_model(rng: random.Random, S: int):
    pick = lambda: rng.choice([LATENCY, DIRECT, Delegated(1), Delegated(2), Delegated(rng.randint(1, 5))])  # noqa: E731
    return pick() if rng.random() < 0.6 or S < 2 else [pick() for _ in range(S - 1)]


def _replayed(fn, sched, costs, N, fused, model):
    try:
        tl = fn(sched, costs, N, fused, model)
    except sim.StuckSchedule as e:
        return ("stuck", str(e))
    return ("ok", tl.iteration_ms, tl.busy_ms, tl.peak_inflight, tl.work_ms,
            [(x.stage, x.op, x.start, x.end) for x in tl.slots])


def _same(got, want):
    assert got[0] == want[0], (got[:2], want[:2])
    if got[0] == "stuck":
        assert got == want
        return
    _, t, busy, peak, work, slots = got
    _, t2, busy2, peak2, work2, slots2 = want
    assert abs(t - t2) <= 1e-9 and peak == peak2 and work == work2
    assert all(abs(a - b) <= 1e-9 for a, b in zip(busy, busy2))
    assert [s[:2] for s in slots] == [s[:2] for s in slots2]  # same ops, in the same order
    assert all(abs(a[2] - b[2]) <= 1e-9 and abs(a[3] - b[3]) <= 1e-9 for a, b in zip(slots, slots2))


@pytest.mark.parametrize("seed", range(6))
def test_replay_gives_the_reference_timelines(impl, seed):
    rng = random.Random(100 + seed)
    for _ in range(80):
        S, N, costs = random_case(rng)
        kind = rng.random()
        if kind < 0.4:
            x = random_warmup(rng, S, N)
            sched = _outcome(list_schedule, costs, N, x, rng.choice(policies(costs)))[0]
            if sched is None:
                continue
        else:
            sched = random_order(rng, S, N, fifo=kind < 0.7)
        fused = rng.random() < 0.3
        model = random_model(rng, S)
        want = _replayed(reference.replay, sched, costs, N, fused, model)
        _same(_replayed(sim.replay, sched, costs, N, fused, model), want)
        if want[0] == "ok":
            assert abs(sim.makespan(sched, costs, N, fused, model) - want[1]) <= 1e-9
        else:
            with pytest.raises(sim.StuckSchedule, match="stage"):
                sim.makespan(sched, costs, N, fused, model)


def test_replay_rejects_what_the_reference_rejects(impl):
    costs = Costs.uniform(2, 1.0)
    with pytest.raises(ValueError, match="costs are for 2 stages"):
        sim.replay([[Op("F", 0), Op("B", 0), Op("W", 0)]], costs, 1)
    with pytest.raises(IndexError):  # a micro-batch beyond N: the Python code's own error
        sim.replay([[Op("F", 5), Op("B", 5), Op("W", 5)]] * 2, costs, 1)
    with pytest.raises(sim.StuckSchedule, match="stage 0: B0 before F0"):
        sim.replay([[Op("B", 0), Op("F", 0), Op("W", 0)], [Op("F", 0), Op("B", 0), Op("W", 0)]], costs, 1)


def test_large_cases_match_the_reference(impl):
    """One case at the scale the compiled core is for (16 x 64, heterogeneous, slow links, caps)."""
    rng = random.Random(7)
    S, N = 16, 64
    costs = Costs([rng.uniform(5, 20) for _ in range(S)], [rng.uniform(5, 20) for _ in range(S)],
                  [rng.uniform(5, 20) for _ in range(S)], [rng.choice([0.0, rng.uniform(0, 40)]) for _ in range(S - 1)])
    x = random_warmup(rng, S, N, wild=False)
    for pol in policies(costs):
        sched = list_schedule(costs, N, x, pol)
        assert sched == reference.list_schedule(costs, N, x, pol)
        for model in (LATENCY, DIRECT, Delegated(2)):
            _same(_replayed(sim.replay, sched, costs, N, False, model),
                  _replayed(reference.replay, sched, costs, N, False, model))


@pytest.mark.skipif(not HAVE_NATIVE, reason="no C compiler: the compiled core is not available")
def test_native_switch_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_PIPEMORPH_NATIVE", "0")
    assert native.lib() is None
    monkeypatch.setenv("DS_PIPEMORPH_NATIVE", "1")
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path))
    lib = native._build()  # a fresh build into an empty cache, then a load of what it left
    assert lib is not None and len(list(tmp_path.glob("plancore-*.so"))) == 1
    assert native._build() is not None


def test_the_compiled_core_builds_where_there_is_a_compiler():
    """A C compiler on PATH and no core means the source does not compile: fail loudly (the
    planner would silently run the Python code, correct but far slower at scale)."""
    if native._compiler() is None or not native.enabled():
        pytest.skip("no C compiler, or the core is switched off")
    assert native.lib() is not None


@pytest.mark.parametrize("seed", range(3))
def test_native_tolerances_are_the_exact_ones(seed):
    """Newton steps in C against the Python secant search: never above it by more than float
    noise, never more than one resolution step below it (the secant may stop that far below)."""
    from ds_pipemorph.plan import tolerance

    if not HAVE_NATIVE:
        pytest.skip("no C compiler: the compiled core is not available")
    rng = random.Random(300 + seed)
    for _ in range(15):
        S, N = rng.randint(2, 6), rng.randint(2, 12)
        costs = Costs([rng.uniform(2, 20) for _ in range(S)], [rng.uniform(2, 20) for _ in range(S)],
                      [rng.uniform(2, 20) for _ in range(S)], [rng.choice([0.0, 0.0, rng.uniform(1, 30)]) for _ in range(S - 1)])
        sched = list_schedule(costs, N, random_warmup(rng, S, N, wild=False), rng.choice(policies(costs)))
        fused = rng.random() < 0.3
        got = tolerance.link_tolerances(sched, costs, N, resolution_ms=0.01, fused=fused)
        for t in got:
            want = tolerance._replay_tolerance(sched, costs, N, t.link, 0.01, fused, LATENCY)
            if want == float("inf"):
                assert t.replay_ms == float("inf")
            else:
                assert want - 1e-6 <= t.replay_ms <= want + 0.01 + 1e-6
