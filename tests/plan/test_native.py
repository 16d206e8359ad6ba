"""The fast planner core equals the pure-Python reference (reference.py beside this file) exactly.

On many random cases (1-16 stages, 1-64 micro-batches, op times and delays with zeros and ties,
random warm-ups within caps and outside them, every policy of ``search.policies``, the link models
Latency, Direct and Delegated(k), split and fused backward): the list scheduler gives the same
orders and the same errors; the replay the same slots, stage by stage (times to 1e-9), busy times,
peaks, iteration time and stuck messages, and the compiled core its slots in the order the Python
core visits them. Both the compiled core (when a C compiler is
there) and the pure-Python fallback are checked. The core is built from the C file the package
ships, cached under a hash of that source and the compiler, and checked before use: without a
compiler, with an unusable cache dir, or with a wrong, stale or corrupt library the planner says so
in one line and runs its Python code, or rebuilds.
"""
from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import reference

from ds_pipemorph.plan.ir.links import DIRECT, LATENCY, Delegated
from ds_pipemorph.plan.ir.ops import Op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sim.listsched_py import list_schedule_py
from ds_pipemorph.plan.sched.search import policies
from ds_pipemorph.plan.sim import native
from ds_pipemorph.plan.sim import simulate as sim
from ds_pipemorph.plan.sim.timeline import StuckSchedule

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


def _outcome(fn, costs, N, x, pol):
    try:
        return fn(costs, N, x, policy=pol), None
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
        tl = fn(sched, costs, N, fused_backward=fused, link_model=model)
    except StuckSchedule as e:
        return ("stuck", str(e))
    return ("ok", tl.iteration_ms, tl.busy_ms, tl.peak_inflight, tl.work_ms,
            [(x.stage, x.op, x.start, x.end) for x in tl.slots])


def _same(got, want, in_order: bool = False):
    assert got[0] == want[0], (got[:2], want[:2])
    if got[0] == "stuck":
        assert got == want
        return
    _, t, busy, peak, work, slots = got
    _, t2, busy2, peak2, work2, slots2 = want
    assert abs(t - t2) <= 1e-9 and peak == peak2 and work == work2
    assert all(abs(a - b) <= 1e-9 for a, b in zip(busy, busy2))
    if not in_order:  # each stage's ops in its order, whatever order the stages were visited in
        slots, slots2 = sorted(slots, key=lambda x: x[0]), sorted(slots2, key=lambda x: x[0])
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
        got = _replayed(sim.replay, sched, costs, N, fused, model)
        _same(got, want)
        if impl == "native":  # the compiled core also visits the stages in the Python core's order
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(native, "lib", lambda: None)
                _same(got, _replayed(sim.replay, sched, costs, N, fused, model), in_order=True)
        if want[0] == "ok":
            assert abs(sim.makespan(sched, costs, N, fused_backward=fused, link_model=model) - want[1]) <= 1e-9
        else:
            with pytest.raises(StuckSchedule, match="stage"):
                sim.makespan(sched, costs, N, fused_backward=fused, link_model=model)


def test_replay_rejects_what_the_reference_rejects(impl):
    costs = Costs.uniform(2, 1.0)
    with pytest.raises(ValueError, match="costs are for 2 stages"):
        sim.replay([[Op("F", 0), Op("B", 0), Op("W", 0)]], costs, 1)
    with pytest.raises(IndexError):  # a micro-batch beyond N: the Python code's own error
        sim.replay([[Op("F", 5), Op("B", 5), Op("W", 5)]] * 2, costs, 1)
    with pytest.raises(StuckSchedule, match="stage 0: B0 before F0"):
        sim.replay([[Op("B", 0), Op("F", 0), Op("W", 0)], [Op("F", 0), Op("B", 0), Op("W", 0)]], costs, 1)


def test_large_cases_match_the_reference(impl):
    """One case at the scale the compiled core is for (16 x 64, heterogeneous, slow links, caps)."""
    rng = random.Random(7)
    S, N = 16, 64
    costs = Costs([rng.uniform(5, 20) for _ in range(S)], [rng.uniform(5, 20) for _ in range(S)],
                  [rng.uniform(5, 20) for _ in range(S)], [rng.choice([0.0, rng.uniform(0, 40)]) for _ in range(S - 1)])
    x = random_warmup(rng, S, N, wild=False)
    for pol in policies(costs):
        sched = list_schedule(costs, N, x, policy=pol)
        assert sched == reference.list_schedule(costs, N, x, policy=pol)
        for model in (LATENCY, DIRECT, Delegated(2)):
            _same(_replayed(sim.replay, sched, costs, N, False, model),
                  _replayed(reference.replay, sched, costs, N, False, model))


needs_cc = pytest.mark.skipif(native._compiler()[0] is None, reason="no C compiler")
# The same core with one wrong number: the replay's last end one millisecond late.
WRONG = (b"res[1] = last_end;", b"res[1] = last_end + 1.0;")


def _key(src: bytes) -> str:
    return native.build_key(src, native._compiler()[0])


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == native.__name__]


@needs_cc
def test_native_switch_and_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DS_PIPEMORPH_NATIVE", "0")
    assert native.lib() is None
    monkeypatch.setenv("DS_PIPEMORPH_NATIVE", "1")
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path))
    lib = native.load()  # a fresh build into an empty cache, then a load of what it left
    assert lib is not None
    assert [p.name for p in tmp_path.iterdir()] == [f"plancore-{_key(native.source())}.so"]  # no temporaries left
    again = native.load()
    assert again is not None and again.pm_build_key().decode() == _key(native.source())


def test_the_compiled_core_builds_where_there_is_a_compiler():
    """A C compiler on PATH and no core means the source does not compile: fail loudly (the
    planner would silently run the Python code, correct but far slower at scale)."""
    if native._compiler()[0] is None or not native.enabled():
        pytest.skip("no C compiler, or the core is switched off")
    assert native.lib() is not None


def test_the_source_is_a_c_file_beside_the_module():
    here = Path(native.__file__).parent / "plancore.c"
    assert native.source() == here.read_bytes()
    assert b"int pm_replay(" in native.source() and b"const char *pm_build_key(void)" in native.source()


def test_cc_naming_a_missing_compiler_says_so_in_one_line_and_the_planner_still_plans(tmp_path):
    """A process with ``$CC`` naming a missing binary and no compiler on PATH: one log line naming
    the cause and the cost, and the plans and replays of the Python code."""
    code = (
        "from ds_pipemorph.plan.sim import native, simulate\n"
        "from ds_pipemorph.plan.sched.listsched import list_schedule\n"
        "from ds_pipemorph.plan.ir.profile import Costs\n"
        "c = Costs.uniform(4, 10.0)\n"
        "s = list_schedule(c, 8, [8, 6, 4, 2])\n"
        "print(native.lib() is None, simulate.replay(s, c, 8).iteration_ms, simulate.makespan(s, c, 8))\n"
    )
    empty = tmp_path / "bin"
    empty.mkdir()
    env = {**os.environ, "CC": str(tmp_path / "no-such-cc"), "PATH": str(empty),
           "DS_PIPEMORPH_CACHE": str(tmp_path / "cache"), "DS_PIPEMORPH_NATIVE": "1"}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stderr.splitlines() if "planner core" in x]
    assert lines == [f"planner core not built ($CC names {tmp_path / 'no-such-cc'}, which is not found): replays run "
                     f"in Python, {native.PYTHON_COST}"], p.stderr
    none, t_replay, t_span = p.stdout.split()
    # 4 stages x 8 micro-batches, 10 ms per F, B and W: the zero-bubble optimum 3 N t + (S - 1) t.
    assert none == "True" and float(t_replay) == float(t_span) == 270.0
    assert not (tmp_path / "cache").exists()


def test_no_compiler_on_path_and_no_cc_says_so(monkeypatch, caplog, tmp_path):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # empty: neither Python's compiler nor cc, gcc, clang
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path / "cache"))
    if native._compiler()[0] is not None:
        pytest.skip("Python's own compiler is named by an absolute path")
    assert native.load() is None
    assert _lines(caplog) == [f"planner core not built (no C compiler found): replays run in Python, {native.PYTHON_COST}"]


@needs_cc
def test_an_unusable_cache_dir_says_so_in_one_line(monkeypatch, caplog, tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the cache dir should be")
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(blocker / "cache"))
    assert native.load() is None
    (line,) = _lines(caplog)
    assert line.startswith(f"planner core not built (cache dir {blocker / 'cache'} is not usable: ") and \
        line.endswith(f"): replays run in Python, {native.PYTHON_COST}"), line


@needs_cc
def test_a_core_that_disagrees_with_the_python_code_is_not_used(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path))
    src = native.source()
    assert src.count(WRONG[0]) == 1
    assert native.load(src.replace(*WRONG)) is None
    assert _lines(caplog) == ["planner core not used (it disagrees with the Python code on the replay (Latency "
                              f"links)): replays run in Python, {native.PYTHON_COST}"]


@needs_cc
def test_a_library_built_from_other_source_under_the_cached_name_is_rebuilt(monkeypatch, caplog, tmp_path):
    """A stale library at the name the current source hashes to (as if the source changed and the
    hash did not): it says which source it was built from, so it is not used but rebuilt."""
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path))
    src = native.source()
    stale_src = src.replace(*WRONG)
    native.load(stale_src)  # builds plancore-<stale key>.so (and refuses to use it)
    caplog.clear()
    cached = tmp_path / f"plancore-{_key(src)}.so"
    shutil.copyfile(tmp_path / f"plancore-{_key(stale_src)}.so", cached)
    lib = native.load()
    assert lib is not None and lib.pm_build_key().decode() == _key(src)
    assert native.disagreement(lib) is None and _lines(caplog) == []
    check = subprocess.run([sys.executable, "-c", f"import ctypes; f = ctypes.CDLL({str(cached)!r}).pm_build_key; "
                            "f.restype = ctypes.c_char_p; print(f().decode())"], capture_output=True, text=True, timeout=60)
    assert check.stdout.strip() == _key(src)  # the file under the name now holds the current build


@needs_cc
def test_a_corrupt_cached_library_is_rebuilt(monkeypatch, caplog, tmp_path):
    monkeypatch.setenv("DS_PIPEMORPH_CACHE", str(tmp_path))
    cached = tmp_path / f"plancore-{_key(native.source())}.so"
    cached.write_bytes(b"\x7fELF" + b"\0" * 60)  # a truncated write
    lib = native.load()
    assert lib is not None and native.disagreement(lib) is None and _lines(caplog) == []
    assert cached.read_bytes()[:4] == b"\x7fELF" and cached.stat().st_size > 1000


def test_the_build_key_changes_with_the_source_and_the_compiler(tmp_path):
    cmd = native._compiler()[0]
    if cmd is None:
        pytest.skip("no C compiler")
    src = native.source()
    wrapper = tmp_path / "cc-wrapper"  # another compiler: a script that says another version
    wrapper.write_text(f"#!/bin/sh\n[ \"$1\" = --version ] && {{ echo other 1.0; exit 0; }}\nexec {shutil.which(cmd[0])} \"$@\"\n")
    wrapper.chmod(0o755)
    keys = {native.build_key(src, cmd), native.build_key(src + b"\n", cmd), native.build_key(src, [str(wrapper)])}
    assert len(keys) == 3 and native.build_key(src, cmd) == native.build_key(src, cmd)


@pytest.mark.parametrize("seed", range(3))
def test_native_tolerances_are_the_exact_ones(seed):
    """Newton steps in C against the Python secant search: never above it by more than float
    noise, never more than one resolution step below it (the secant may stop that far below)."""
    from ds_pipemorph.plan.sched import tolerance
    if not HAVE_NATIVE:
        pytest.skip("no C compiler: the compiled core is not available")
    rng = random.Random(300 + seed)
    for _ in range(15):
        S, N = rng.randint(2, 6), rng.randint(2, 12)
        costs = Costs([rng.uniform(2, 20) for _ in range(S)], [rng.uniform(2, 20) for _ in range(S)],
                      [rng.uniform(2, 20) for _ in range(S)], [rng.choice([0.0, 0.0, rng.uniform(1, 30)]) for _ in range(S - 1)])
        sched = list_schedule(costs, N, random_warmup(rng, S, N, wild=False), policy=rng.choice(policies(costs)))
        fused = rng.random() < 0.3
        got = tolerance.link_tolerances(sched, costs, N, resolution_ms=0.01, fused=fused)
        for t in got:
            want = tolerance._replay_tolerance(sched, costs, N, t.link, 0.01, fused, LATENCY)
            if want == float("inf"):
                assert t.replay_ms == float("inf")
            else:
                assert want - 1e-6 <= t.replay_ms <= want + 0.01 + 1e-6
