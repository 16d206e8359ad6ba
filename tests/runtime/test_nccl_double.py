"""NCCL's point-to-point rules on CPU: the test double (``inject.nccl_double``) fails what NCCL cannot
run, and the engine under it (``inject: {nccl_rules: true}``) lowers with ``NcclLowering`` and
trains exactly like stock DeepSpeed.

The double's own tests play lowered streams through the direct path with no engine
(``stream_player.py``): the default lowering's streams end in ``TransportTimeout`` (a deadlock under
NCCL's queues), a receive posted out of the sender's order ends in ``TransportError`` naming both
messages, and the NCCL lowering's streams deliver every message to its receive. Results are judged
from the files each rank writes, not from exit codes.
"""
from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import yaml

from ds_pipemorph.plan.ir.lower import LoweringPolicy
from ds_pipemorph.plan.ir.nccl_lowering import NcclLowering
from ds_pipemorph.plan.ir.ops import Op, parse_stage
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b
from ds_pipemorph.plan.sim.validate import validate_schedule
from ds_pipemorph.procs import run_group

from .launch import HERE, REPO, launch
from .plans_io import write_plan
from .randplans import random_plan
from .launch import max_param_diff
from .test_equivalence import _assert_equal_to_stock, _expected_peak

NCCL = {"nccl_rules": True}


def _play(cases: list[dict], ranks: int, tmp_path, timeout: float) -> dict:
    """Run ``cases`` (stream_player's SPEC) on ``ranks`` ranks; (name, rank) -> what the rank wrote."""
    spec = tmp_path / "streams.json"
    spec.write_text(json.dumps(cases))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = run_group([sys.executable, str(HERE / "forkrun.py"), str(ranks),
                   str(HERE / "stream_player.py"), str(spec), str(tmp_path)], timeout, cwd=REPO, env=env)
    out = {}
    for case in cases:
        for r in range(ranks):
            path = tmp_path / f"{case['name']}.rank{r}.json"
            assert path.exists(), f"{path.name} missing; launch output:\n{(p.stdout + p.stderr)[-4000:]}"
            out[case["name"], r] = json.loads(path.read_text())
    return out


def _case(name: str, streams, timeout_s: float = 5.0) -> dict:
    return {"name": name, "timeout_s": timeout_s, "streams": [[[str(op.kind), op.mb] for op in s] for s in streams]}


@pytest.mark.timeout(60)
def test_default_lowering_deadlocks_under_the_double_and_ends_in_a_timeout(tmp_path):
    streams = LoweringPolicy().lower(deepspeed_1f1b(2, 2))  # 0RECV_B0 0F0 ... / 1RECV_F0 1F0 ...
    got = _play([_case("default", streams)], 2, tmp_path, timeout=50)
    for r in range(2):
        assert got["default", r]["error"] == "TransportTimeout", got["default", r]
        assert "timed out after 5 s" in got["default", r]["text"]


@pytest.mark.timeout(60)
def test_two_ranks_sending_to_each_other_before_receiving_deadlock_under_the_double(tmp_path):
    # Stage 0 sends F0 then waits for B0; stage 1 sends B0 (of an earlier exchange, here made up as an
    # ungrouped swap) then receives F0: both queue heads are sends, neither meets its receive.
    streams = [[Op("F", 0, 0), Op("SEND_F", 0, 0), Op("RECV_B", 0, 0), Op("B", 0, 0)],
               [Op("SEND_B", 0, 1), Op("RECV_F", 0, 1), Op("F", 0, 1)]]
    got = _play([_case("swap", streams)], 2, tmp_path, timeout=50)
    texts = [got["swap", r]["text"] for r in range(2)]
    errors = [got["swap", r]["error"] for r in range(2)]
    # Each rank's wait times out, unless its peer timed out first (its 5 s began earlier on a busy
    # host) and left: then this rank's send to it fails, naming the send.
    assert "TransportTimeout" in errors, texts
    for r in range(2):
        assert errors[r] == "TransportTimeout" or (errors[r] == "TransportError" and "failed" in texts[r]
                                                  and f"to rank {1 - r}" in texts[r]), texts


@pytest.mark.timeout(60)
def test_a_receive_posted_out_of_the_senders_order_is_an_error_naming_both_messages(tmp_path):
    streams = [[Op("F", 0, 0), Op("SEND_F", 0, 0), Op("F", 1, 0), Op("SEND_F", 1, 0)],
               [Op("RECV_F", 1, 1), Op("RECV_F", 0, 1), Op("F", 1, 1), Op("F", 0, 1)]]
    got = _play([_case("swapped", streams)], 2, tmp_path, timeout=50)
    assert got["swapped", 1]["error"] == "TransportError", got["swapped", 1]
    assert "receive no. 1 from rank 0 was posted for F1 header" in got["swapped", 1]["text"]
    assert "meets F0 header" in got["swapped", 1]["text"]


@pytest.mark.timeout(120)
def test_nccl_lowering_streams_deliver_every_message_under_the_double_and_through_batch_isend_irecv(tmp_path):
    """Ungrouped, and grouped as the engine issues them (``nccl_groups``) for two iterations (the
    second with known layouts, so whole groups): under the double, and through torch's own
    ``isend``/``irecv``/``batch_isend_irecv`` on gloo issued in the same order."""
    rng = random.Random(5)
    plans = [("1f1b_s3", deepspeed_1f1b(3, 3)), ("random_s3", random_plan(3, 3, rng)[0]),
             ("random_s3_b", random_plan(3, 3, rng)[0])]
    cases = [_case(name, NcclLowering().lower(plan)) for name, plan in plans]
    cases.append(_case("fused_s3", NcclLowering(fused=True).lower(deepspeed_1f1b(3, 3))))
    for name, plan in plans[:2]:
        for p2p in ("double", "torch"):
            cases.append({**_case(f"{name}_grouped_{p2p}", NcclLowering().lower(plan)), "groups": True,
                          "iterations": 2, "p2p": p2p})
    got = _play(cases, 3, tmp_path, timeout=110)
    for case in cases:
        for r in range(3):
            out = got[case["name"], r]
            assert out.get("ok"), (case["name"], r, out)
            want = {f"F{m}" for m in range(3) if r > 0} | {f"B{m}" for m in range(3) if r < 2}
            assert set(out["received"]) == want
            for msg, runs in out["received"].items():
                code = (1 if msg[0] == "F" else 2) * 100 + int(msg[1:])
                assert runs == [[[code] * 3, [[-code] * 2] * 2]] * case.get("iterations", 1), (case["name"], r, msg)


def _nccl_section(schedule: str, **more) -> dict:
    # No memory limit: these jobs switch to plan files deeper than stock's memory, as a re-plan with
    # a budget granted would (memory is tests/runtime/test_memory.py's subject).
    return {"schedule": schedule, "delegation": {"mode": "off"}, "adapt": {"enabled": False}, "inject": NCCL,
            "memory": {"budget": None}, **more}


def _assert_ran_nccl_lowering(run, name: str, plan, ranks: int) -> None:
    """Every step ran the NCCL lowering's stream of ``plan`` (receives where it puts them), and once
    the layouts were known (steps 2 and 3) issued each run of adjacent sends and receives with one
    peer as one group, holding those messages' tensors in the stream's order."""
    streams = NcclLowering().lower(plan)
    for r in range(ranks):
        ours = run.result(name, r)
        stream = streams[ours["stage"]]
        assert ours["p2p"] == "NcclRules", f"{name} rank {r}: the direct path ran on {ours['p2p']}"
        assert ours["executed"] == [[str(op) for op in stream]] * 3, f"{name} rank {r}: {ours['executed']}"
        want = [[("send" if op.kind.startswith("SEND") else "recv", f"{op.kind[-1]}{op.mb} part 1")
                 for op in stream[i:j]] for i, j in _runs_with_one_peer(stream)]
        got = ours["p2p_groups"]
        assert got[len(got) - 2 * len(want):] == want * 2, f"{name} rank {r}: groups {got}"


def _runs_with_one_peer(stream) -> list[tuple[int, int]]:
    """(start, stop) of each run of two or more adjacent sends and receives with one peer."""
    runs, start = [], 0
    for i in range(1, len(stream) + 1):
        if i == len(stream) or stream[i].is_compute or stream[start].is_compute or stream[i].peer != stream[start].peer:
            if i - start > 1 and not stream[start].is_compute:
                runs.append((start, i))
            start = i
    return runs


@pytest.mark.timeout(150)
def test_two_stages_under_nccl_rules_train_like_stock_with_1f1b_zb_adaptive_plan_files_and_refuse_ready(tmp_path):
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    S, N = 2, 4
    jobs = [{"name": "stock", "stages": S, "micro_batches": N, "pipemorph": None}]
    checks = []
    for sched in ("1f1b", "zb", "adaptive"):
        section = _nccl_section(sched)
        jobs.append({"name": sched, "stages": S, "micro_batches": N, "pipemorph": section})
        checks.append((sched, build_plan(parse_config(section), S, N)))
    rng = random.Random(3)
    plan, caps = random_plan(S, N, rng)
    validate_schedule(plan, S, N, caps=caps)
    path = write_plan(tmp_path / "random.yaml", plan, N)
    jobs.append({"name": "random_plan_file", "stages": S, "micro_batches": N,
                 "pipemorph": _nccl_section("plan", plan_file=path)})
    checks.append(("random_plan_file", plan))
    # The control loop on (its re-plans go through the same _set_plan as a plan change), and a plan
    # change after the first step, whose plan file asks for a receive window NCCL's rules ignore.
    jobs.append({"name": "adaptive_control_loop", "stages": S, "micro_batches": N,
                 "pipemorph": {**_nccl_section("adaptive"), "adapt": {"enabled": True, "every_iterations": 1}}})
    other, _ = random_plan(S, N, rng)
    other_path = write_plan(tmp_path / "other.yaml", other, N)
    other_file = yaml.safe_load(open(other_path))
    other_file["recv_window"] = 1
    Path(other_path).write_text(yaml.safe_dump(other_file, sort_keys=False))
    jobs.append({"name": "plan_changed", "stages": S, "micro_batches": N, "pipemorph": _nccl_section("zb"),
                 "switch_plan": {"1": other_path}})
    jobs.append({"name": "switch_to_ready", "stages": S, "micro_batches": N, "pipemorph": _nccl_section("zb"),
                 "switch_dispatch": "ready"})
    jobs.append({"name": "ready", "stages": S, "micro_batches": N, "expect_error": True,
                 "pipemorph": _nccl_section("zb", dispatch="ready")})
    delayed = _nccl_section("zb")  # the double holds the slow link's messages in the pair's queue
    delayed["inject"] = {**delayed["inject"], "links": {"0": {"delay_ms": 5}}}
    jobs.append({"name": "delayed", "stages": S, "micro_batches": N, "pipemorph": delayed})
    checks.append(("delayed", checks[1][1]))
    run = launch(S, jobs, tmp_path, timeout=140)
    for name, plan in checks:
        _assert_equal_to_stock(run, name, "stock", S, _expected_peak(jobs[[j["name"] for j in jobs].index(name)]
                                                                     ["pipemorph"], S, N), plan)
        _assert_ran_nccl_lowering(run, name, plan, S)
    _assert_equal_to_stock(run, "adaptive_control_loop", "stock", S)
    _assert_equal_to_stock(run, "plan_changed", "stock", S)
    first, then = NcclLowering().lines(checks[1][1]), NcclLowering().lines(other)
    for r in range(S):
        assert run.result("plan_changed", r)["executed"] == [first[r].split()] + [then[r].split()] * 2
    refusal = ("dispatch 'ready' posts every receive of an iteration up front, which NCCL's in-order "
               "point-to-point cannot run: set pipemorph.dispatch to \"ordered\"")
    for r in range(S):
        assert run.result("switch_to_ready", r)["switch_error"] == refusal
        assert run.error("ready", r) == refusal
    _assert_equal_to_stock(run, "switch_to_ready", "stock", S)


@pytest.mark.timeout(120)
def test_two_pipelines_by_two_stages_under_nccl_rules_train_like_stock(tmp_path):
    jobs = [{"name": "stock", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": None},
            {"name": "zb", "stages": 2, "dp": 2, "micro_batches": 4, "pipemorph": _nccl_section("zb")}]
    run = launch(4, jobs, tmp_path, timeout=110)
    _assert_equal_to_stock(run, "zb", "stock", 4, _expected_peak(jobs[1]["pipemorph"], 2, 4))
    assert [run.result("zb", r)["p2p"] for r in range(4)] == ["NcclRules"] * 4


@pytest.mark.timeout(150)
def test_links_that_fail_under_nccl_rules_fail_over_to_the_delegates_and_train_like_stock(tmp_path):
    """Failover (PipeMorph §5.3) under the double: link 0's direct path fails from its 6th message per
    direction and link 1's, 10 ms slow, from its 7th (step 2, micro-batches 1 and 2); both ends move
    each direction to the delegates, whose gloo groups match by tag, and training is unchanged."""
    from ds_pipemorph.runtime.config import parse_config
    from ds_pipemorph.runtime.plans import build_plan

    from .test_faults import EXPECTED_EVENTS

    S, N = 3, 4
    section = {**_nccl_section("zb", timeout_s=60), "delegation": {"mode": "auto", "queues": 1},
               "inject": {**NCCL, "links": {"1": {"delay_ms": 10.0}}, "faults": {"link_fails_after": {"0": 5, "1": 6}}}}
    jobs = [{"name": "stock", "stages": S, "micro_batches": N, "pipemorph": None},
            {"name": "link_fails", "stages": S, "micro_batches": N, "pipemorph": section}]
    zb = build_plan(parse_config(section), S, N)
    run = launch(S, jobs, tmp_path, timeout=140)
    _assert_equal_to_stock(run, "link_fails", "stock", S, plan=zb)
    for r in range(S):
        got = run.result("link_fails", r)
        assert got["p2p"] == "NcclRules"
        events = "\n".join(got["events"])
        for line in EXPECTED_EVENTS["link_fails"][got["stage"]]:
            assert line in events, f"rank {r}: no '{line}' in\n{events}"
        assert got["executed"][0] == NcclLowering().lines(zb)[got["stage"]].split()


@pytest.mark.timeout(200)
def test_the_control_loop_replans_for_a_slow_link_under_nccl_rules_and_trains_like_stock(tmp_path):
    """A 40 ms link 0, slow in the double's pair queue: the control loop measures it and re-plans; every
    step runs a stream that passes NCCL's dry run (the new plan lowered by ``NcclLowering``), and the
    losses and parameters equal stock DeepSpeed's."""
    from ds_pipemorph.plan.ir.nccl import nccl_dry_run

    S, N, STEPS = 2, 4, 5
    section = {**_nccl_section("adaptive", timeout_s=60), "adapt": {"enabled": True, "every_iterations": 1,
                                                                     "replan": "inline"},
               "inject": {**NCCL, "links": {"0": {"delay_ms": 40.0}}}}
    jobs = [{"name": "stock", "stages": S, "micro_batches": N, "steps": STEPS, "pipemorph": None},
            {"name": "replanned", "stages": S, "micro_batches": N, "steps": STEPS, "pipemorph": section}]
    run = launch(S, jobs, tmp_path, timeout=190)
    for r in range(S):
        ours, ref = run.result("replanned", r), run.result("stock", r)
        assert ours["p2p"] == "NcclRules"
        assert ours["losses"] == pytest.approx(ref["losses"], abs=1e-5), f"rank {r}: losses differ"
        assert max_param_diff(ours, ref) <= 1e-5, f"rank {r}: parameters differ"
    replans = run.result("replanned", 0)["replans"]
    assert replans and replans[0] < STEPS - 1, f"the 40 ms link was never re-planned for: {replans}"
    streams = [[run.result("replanned", r)["executed"][k] for r in range(S)] for k in range(STEPS)]
    for k, step in enumerate(streams):
        nccl_dry_run([parse_stage(ops) for ops in step])  # raises naming the stuck ops
    assert streams[-1] != streams[0], "the re-plan did not change what the stages ran"
