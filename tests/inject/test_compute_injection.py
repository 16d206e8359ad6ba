"""Compute-straggler injection (pipemorph.inject.compute, inject.compute_trace): a slowed stage's F, B
and W take factor x their own time in its OpRecords, from the iteration the trace names, the other
stages are untouched, and the numbers equal an uninjected run. Config errors are one sentence."""
import json
import os
import statistics
import sys
import time
from pathlib import Path

import pytest
import torch
import typer

from ds_pipemorph.procs import run_group
from ds_pipemorph.runtime.config import PipeMorphConfigError, parse_config
from ds_pipemorph.inject.compute import ComputeInjector, ComputeSchedule, ComputeTrace, compute_schedule

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
OP_MS = 10.0
SLOW_FROM = 3
ITERATIONS = 6
# Medians of an op kind within an iteration (8 ops) are at least these: a sleep wakes late, never
# early. A busy machine makes them longer by any amount, so no test bounds them from above: a wait
# is told from no wait by the injector's own account (what it waited is at most what the slowed
# ops took beyond their own time).
NORMAL = OP_MS * 0.9
DOUBLED = 2 * OP_MS * 0.92


def launch(tmp_path, spec: dict, timeout: float) -> dict:
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [sys.executable, str(REPO / "tests" / "runtime" / "forkrun.py"), "4",
           str(HERE / "compute_worker.py"), str(tmp_path / "spec.json"), str(tmp_path)]
    p = run_group(cmd, timeout, cwd=REPO, env=env)
    assert (tmp_path / "compute.rank0.json").exists(), (p.stdout + p.stderr)[-4000:]
    return {r: json.loads((tmp_path / f"compute.rank{r}.json").read_text()) for r in range(4)}


def medians(iteration_ops: list) -> dict[str, float]:
    """Kind (F, B, W) -> median duration in ms over one iteration's ops."""
    by_kind: dict[str, list[float]] = {}
    for op, ms in iteration_ops:
        by_kind.setdefault(op[0], []).append(ms)
    assert sorted(by_kind) == ["B", "F", "W"] and all(len(v) == 8 for v in by_kind.values()), iteration_ops
    return {k: statistics.median(v) for k, v in by_kind.items()}


def max_param_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((torch.tensor(a[k]) - torch.tensor(b[k])).abs().max().item() for k in a)


def _each_at_least(stage: int, ops, least: float) -> bool:
    """Every op's median is at least ``least`` ms. The first stage runs each B and the W its order has
    right after it as one pass (it sends no input gradient), recorded as the B: there the two count
    together (the first iteration, which measures memory, runs them apart)."""
    m = medians(ops)
    if stage == 0:
        return m["F"] >= least and m["B"] + m["W"] >= 2 * least
    return all(ms >= least for ms in m.values())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stage_2_slowed_from_iteration_3_doubles_its_ops_only_and_changes_no_number(tmp_path):
    trace = tmp_path / "compute_trace.yaml"
    trace.write_text(f"points:\n  - {{iteration: {SLOW_FROM}, factors: {{2: 2.0}}}}\n")
    spec = {"op_ms": OP_MS, "microbatches": 8, "runs": [
        {"name": "bad_stage", "iterations": 1, "inject": {"compute": {"7": 2.0}}},
        {"name": "plain", "iterations": ITERATIONS, "inject": {}},
        {"name": "trace", "iterations": ITERATIONS, "inject": {"compute_trace": str(trace)}},
        {"name": "static", "iterations": ITERATIONS, "inject": {"compute": {"1": 1.5}}},
    ]}
    res = launch(tmp_path, spec, 280)
    report = {r: {name: [{k: round(v, 1) for k, v in medians(ops).items()} for ops in res[r][name]["ops"]]
                  for name in ("plain", "trace", "static")} for r in range(4)}

    for r in range(4):  # refused on every rank at engine start, in one sentence
        assert res[r]["bad_stage"] == {"error": "ds_config pipemorph.inject.compute names stage 7, but a 4-stage "
                                                "pipeline has stages 0..3"}
        assert res[r]["plain"]["stage"] == r and res[r]["plain"]["injector"] is None

    # Stage 2 in the trace run: at least 10 ms per op before iteration 3, at least 20 ms from it on.
    stage2 = res[2]["trace"]
    assert stage2["injector"]["iterations"] == ITERATIONS
    for it, ops in enumerate(stage2["ops"]):
        for kind, ms in medians(ops).items():
            assert ms >= (DOUBLED if it >= SLOW_FROM else NORMAL), (it, kind, report[2])
    # The waits are the slowed ops' own time: at least 3 iterations x 24 ops x 10 ms, and at most half
    # of what the ops of iterations 3.. took (each took its own time and then at least as long again).
    # Waits before iteration 3 would add as much again: the injector waited from iteration 3 on only.
    slowed_s = sum(ms for ops in stage2["ops"][SLOW_FROM:] for _, ms in ops) / 1e3
    assert 0.9 * 3 * 24 * OP_MS / 1e3 <= stage2["injector"]["injected_s"] <= slowed_s / 2, (stage2["injector"], slowed_s)

    # Only stage 2 has an injector; every stage's ops take at least their 10 ms.
    for r in range(4):
        runs = ("plain",) if r == 2 else ("plain", "trace")
        for name in runs:
            for it, ops in enumerate(res[r][name]["ops"]):
                assert _each_at_least(r, ops, NORMAL), (r, name, it, report[r])
        if r != 2:
            assert res[r]["trace"]["injector"] is None

    # The static form: stage 1 at 1.5 from the first iteration (it waits half its ops' own time:
    # at most a third of what they took), nobody else slowed.
    for r in range(4):
        least = 1.5 * NORMAL if r == 1 else NORMAL
        for it, ops in enumerate(res[r]["static"]["ops"]):
            assert _each_at_least(r, ops, least), (r, it, report[r])
        assert (res[r]["static"]["injector"] is not None) == (r == 1)
    took_s = sum(ms for ops in res[1]["static"]["ops"] for _, ms in ops) / 1e3
    assert 0.5 * 0.9 * ITERATIONS * 24 * OP_MS / 1e3 <= res[1]["static"]["injector"]["injected_s"] <= took_s / 3

    # Injection waits; it never changes a number (the same plan runs, in the same order).
    for r in range(4):
        for name in ("trace", "static"):
            assert res[r][name]["losses"] == pytest.approx(res[r]["plain"]["losses"], abs=1e-6)
            assert max_param_diff(res[r][name]["params"], res[r]["plain"]["params"]) <= 1e-6


# -- the injector in-process -------------------------------------------------------------------------

class F: pass  # noqa: E701 - stand-ins for instruction types
class W: pass  # noqa: E701
class SEND: pass  # noqa: E701


def _handlers(calls):
    def op(engine, ms):
        calls.append(ms)
        time.sleep(ms / 1e3)
        return ms
    return {F: op, W: op, SEND: op}


def _timed(fn, *args) -> float:
    t = time.perf_counter()
    fn(*args)
    return (time.perf_counter() - t) * 1e3


def test_wrapped_ops_take_factor_times_their_own_time_and_other_instructions_are_untouched():
    calls = []
    handlers = _handlers(calls)
    inj = ComputeInjector(ComputeSchedule({2: 2.0}), stage=2)
    wrapped = inj.wrap(handlers, (F, W))
    assert wrapped[SEND] is handlers[SEND] and wrapped[F] is not handlers[F]
    inj.start_iteration()
    assert (inj.iteration, inj.factor) == (0, 2.0)
    t = time.perf_counter()
    assert wrapped[F](None, 20) == 20 and calls == [20]  # the handler runs once, its result is returned
    took_f = (time.perf_counter() - t) * 1e3
    took_w = _timed(wrapped[W], None, 20)
    # A slowed op waits as long again as it took itself (a sleep wakes late, never early): it takes
    # at least twice its 20 ms, and what it waited is at most half of what it took in all.
    assert took_f >= 38 and took_w >= 38
    assert 0.038 <= inj.injected_s <= (took_f + took_w) / 2e3
    waited = inj.injected_s
    assert _timed(wrapped[SEND], None, 20) >= 18 and calls == [20, 20, 20]
    assert inj.injected_s == waited  # SEND ran as it is: no wait


def test_a_trace_steps_by_iteration_and_factor_1_runs_the_op_unchanged():
    tr = ComputeTrace.model_validate({"points": [{"iteration": 2, "factors": {"2": 3.0, "0": 1.5}},
                                                 {"iteration": 4, "factors": {"0": 2.0}}]})
    sched = ComputeSchedule({}, tr)
    assert [sched.factor(2, k) for k in range(6)] == [1.0, 1.0, 3.0, 3.0, 1.0, 1.0]
    assert [sched.factor(0, k) for k in range(6)] == [1.0, 1.0, 1.5, 1.5, 2.0, 2.0]
    assert [sched.touches(s) for s in range(4)] == [True, False, True, False]
    inj = ComputeInjector(sched, stage=2)
    wrapped = inj.wrap(_handlers([]), (F,))
    times, waited = [], []
    for _ in range(4):
        inj.start_iteration()
        before = inj.injected_s
        times.append(_timed(wrapped[F], None, 10))
        waited.append(inj.injected_s - before)
    assert waited[:2] == [0.0, 0.0] and all(t >= 9 for t in times[:2]), (times, waited)  # factor 1: no wait
    # Factor 3: it waits twice its own time (at least 2 x 10 ms), at most two thirds of what it took.
    assert all(t >= 28 and 0.019 <= w <= 2 * t / 3e3 for t, w in zip(times[2:], waited[2:])), (times, waited)


# -- configuration --------------------------------------------------------------------------------------

FACTOR = ("stage 2's factor must be a finite number >= 1 (1 = unchanged, 2.0 = its F, B and W take twice as long), "
          "got {}")


@pytest.mark.parametrize("inject,message", [
    ({"compute": {"x": 2.0}}, 'inject.compute: stage \'x\' is not a stage index (write "0", "1", ...)'),
    ({"compute": {"-1": 2.0}}, 'inject.compute: stage \'-1\' is not a stage index (write "0", "1", ...)'),
    ({"compute": {"2": 0}}, "inject.compute: " + FACTOR.format(0)),
    ({"compute": {"2": -2.0}}, "inject.compute: " + FACTOR.format(-2)),
    ({"compute": {"2": 0.5}}, "inject.compute: " + FACTOR.format(0.5)),
    ({"compute": {"2": float("inf")}}, "inject.compute: " + FACTOR.format("inf")),
    ({"compute": {"2": "fast"}}, "inject.compute.2: expected a number, got the string 'fast'"),
    ({"compute": {"2": "2.0"}}, "inject.compute.2: expected a number, got the string '2.0'"),  # not converted
    ({"compute": {"2": True}}, "inject.compute.2: expected a number, got the boolean true"),
    ({"compute": {"2": {"factor": 2}}}, "inject.compute.2: expected a number, got a mapping"),
    ({"compute_trace": " "}, "inject.compute_trace: compute_trace must be a file path (or null)"),
    ({"compute": {"2": 2.0}, "compute_trace": "t.yaml"},
     "inject: give inject.compute (factors from the first iteration) or inject.compute_trace (factors by "
     "iteration), not both"),
    ({"computes": {"2": 2.0}}, "unknown key 'inject.computes'"),
])
def test_bad_compute_injection_is_refused_in_one_sentence(inject, message):
    with pytest.raises(PipeMorphConfigError) as e:
        parse_config({"inject": inject})
    assert str(e.value) == f"ds_config pipemorph: {message}"


def test_a_bad_factor_on_a_cli_path_exits_2():
    from ds_pipemorph_cli.common import user_errors

    with pytest.raises(typer.Exit) as e:
        with user_errors():
            parse_config({"inject": {"compute": {"2": 0}}})
    assert e.value.exit_code == 2


def test_good_sections_and_what_they_build(tmp_path):
    assert parse_config({"inject": {"compute": {2: 2}}}).inject.compute == {"2": 2.0}  # YAML/Python int keys
    assert compute_schedule(parse_config({}).inject, 4) is None
    assert compute_schedule(parse_config({"inject": {"compute": {"2": 1.0}}}).inject, 4) is None  # 1 = no-op
    sched = compute_schedule(parse_config({"inject": {"compute": {"2": 2.0}}}).inject, 4)
    assert [sched.factor(s, 0) for s in range(4)] == [1.0, 1.0, 2.0, 1.0]
    assert [sched.touches(s) for s in range(4)] == [False, False, True, False]


def _trace_cfg(tmp_path, text: str):
    p = tmp_path / "ct.yaml"
    p.write_text(text)
    return parse_config({"inject": {"compute_trace": str(p)}}).inject, p


@pytest.mark.parametrize("text,message", [
    ("points: [{iteration: 3, factors: {7: 2.0}}]",
     "ds_config pipemorph.inject.compute_trace {p}: the point at iteration 3 names stage 7, but a 4-stage pipeline "
     "has stages 0..3"),
    ("points: [{iteration: 3, factors: {2: 0}}]",
     "ds_config pipemorph.inject.compute_trace {p}: points.0.factors: " + FACTOR.format(0)),
    ("points: [{iteration: 3, factors: {2: 2}}, {iteration: 3, factors: {}}]",
     "ds_config pipemorph.inject.compute_trace {p}: points: iterations must increase (3 comes after 3)"),
    ("points: [{t: 1.0, factors: {2: 2}}]",
     "ds_config pipemorph.inject.compute_trace {p}: missing key 'points.0.iteration'"),
    ("points: []",
     "ds_config pipemorph.inject.compute_trace {p}: points: List should have at least 1 item after validation, not 0"),
])
def test_a_bad_compute_trace_is_refused_at_engine_start_in_one_sentence(tmp_path, text, message):
    cfg, p = _trace_cfg(tmp_path, text)
    with pytest.raises(PipeMorphConfigError) as e:
        compute_schedule(cfg, 4)
    assert str(e.value) == message.format(p=p)


def test_a_missing_compute_trace_or_a_stage_the_job_lacks_is_one_sentence(tmp_path):
    with pytest.raises(PipeMorphConfigError) as e:
        compute_schedule(parse_config({"inject": {"compute_trace": str(tmp_path / "nope.yaml")}}).inject, 4)
    assert str(e.value) == f"ds_config pipemorph.inject.compute_trace: cannot read '{tmp_path / 'nope.yaml'}'"
    with pytest.raises(PipeMorphConfigError) as e:
        compute_schedule(parse_config({"inject": {"compute": {"4": 2.0}}}).inject, 4)
    assert str(e.value) == "ds_config pipemorph.inject.compute names stage 4, but a 4-stage pipeline has stages 0..3"
    cfg, _ = _trace_cfg(tmp_path, "points: [{iteration: 0, factors: {}}, {iteration: 5, factors: {'1': 1.0}}]")
    assert compute_schedule(cfg, 4) is None  # never above 1: nothing injected
