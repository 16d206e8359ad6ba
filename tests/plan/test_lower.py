"""Lowering a plan to per-rank streams, and the dry run that proves them deadlock-free."""
import importlib.util
import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ds_pipemorph.plan.ir.lower import BadStream, Deadlock, dry_run, format_streams, lower
from ds_pipemorph.plan.ir.ops import Op, parse_op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, gpipe, zb_h1
from ds_pipemorph.plan.sched.listsched import list_schedule
from ds_pipemorph.plan.sched.search import POLICIES, search
from ds_pipemorph.plan.sched.warmup import adapted_warmup, initial_warmup

# random valid plans: the generator the runtime tests use (tests/runtime/randplans.py)
_spec = importlib.util.spec_from_file_location("randplans", Path(__file__).parents[1] / "runtime" / "randplans.py")
randplans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(randplans)


def streams_of(lines):
    return [[parse_op(t) for t in line.split()] for line in lines]


def check_lowering(sched, fused=False):
    """Structure the module promises, checked on the streams, then both dry runs."""
    S = len(sched)
    streams = lower(sched, fused_backward=fused)
    for s, (row, stream) in enumerate(zip(sched, streams)):
        assert [op.local() for op in stream if op.is_compute] == row  # the plan's order, untouched
        n_recv = (s > 0) * sum(op.kind == "F" for op in row) + (s < S - 1) * sum(op.kind == "B" for op in row)
        head = stream[:n_recv]
        assert all(op.kind.startswith("RECV") for op in head)  # every receive up front
        assert not any(op.kind.startswith("RECV") for op in stream[n_recv:])
        if s > 0:  # in the order the producer sends them
            assert [op.mb for op in head if op.kind == "RECV_F"] == [op.mb for op in sched[s - 1] if op.kind == "F"]
        if s < S - 1:
            assert [op.mb for op in head if op.kind == "RECV_B"] == [op.mb for op in sched[s + 1] if op.kind == "B"]
        for i, op in enumerate(stream):
            if op.kind == "SEND_F":
                assert stream[i - 1] == Op("F", op.mb, s)
            if op.kind == "SEND_B":
                prev = stream[i - 1]
                assert prev == Op("B", op.mb, s) or fused and prev == Op("W", op.mb, s)
        assert sum(op.kind == "SEND_F" for op in stream) == (s < S - 1) * len(row) // 3
        assert sum(op.kind == "SEND_B" for op in stream) == (s > 0) * len(row) // 3
    dry_run(streams)
    dry_run(streams, blocking_sends=True, ordered_channels=True)
    return streams


def test_two_stage_1f1b_lowers_to_the_streams_written_out():
    sched = deepspeed_1f1b(2, 2)  # fused backward: B m, W m
    assert format_streams(check_lowering(sched, fused=True)) == [
        "0RECV_B0 0RECV_B1 0F0 0SEND_F0 0F1 0SEND_F1 0B0 0W0 0B1 0W1",
        "1RECV_F0 1RECV_F1 1F0 1B0 1W0 1SEND_B0 1F1 1B1 1W1 1SEND_B1",
    ]
    assert format_streams(lower(sched))[1] == "1RECV_F0 1RECV_F1 1F0 1B0 1SEND_B0 1W0 1F1 1B1 1SEND_B1 1W1"


@pytest.mark.parametrize("S,N", [(2, 1), (3, 5), (4, 12), (8, 32)])
def test_baselines_and_planned_warmups_lower_deadlock_free(S, N):
    costs = Costs.uniform(S, 10.0, [0.0] * (S - 1))
    check_lowering(deepspeed_1f1b(S, N), fused=True)
    check_lowering(gpipe(S, N), fused=True)
    check_lowering(zb_h1(costs, N))
    caps = [max(1, N - s) for s in range(S)]
    check_lowering(list_schedule(costs, N, adapted_warmup(costs, N, caps=caps)))
    slow = Costs.uniform(S, 10.0, [30.0] + [0.0] * (S - 2))
    check_lowering(list_schedule(slow, N, adapted_warmup(slow, N, caps=caps)))


@st.composite
def cases(draw):
    S = draw(st.integers(2, 5))
    n = draw(st.integers(1, 8))
    t = st.floats(0.5, 20.0, allow_nan=False)
    costs = Costs([draw(t) for _ in range(S)], [draw(t) for _ in range(S)], [draw(t) for _ in range(S)],
                  [draw(st.sampled_from([0.0, 30.0])) for _ in range(S - 1)])
    return costs, n, [draw(st.integers(1, n)) for _ in range(S)]


@settings(max_examples=60, deadline=None)
@given(cases(), st.sampled_from(POLICIES))
def test_every_list_schedule_lowers_deadlock_free(case, policy):
    costs, n, caps = case
    check_lowering(list_schedule(costs, n, initial_warmup(caps), policy=policy))


@settings(max_examples=15, deadline=None)
@given(cases())
def test_every_searched_plan_lowers_deadlock_free(case):
    costs, n, caps = case
    check_lowering(search(costs, n, caps=caps, budget_s=5.0, max_evals=40, exact=False).schedule)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.integers(1, 8), st.randoms(use_true_random=False))
def test_every_random_valid_plan_lowers_deadlock_free(S, N, rng):
    sched, _ = randplans.random_plan(S, N, random.Random(rng.random()))
    check_lowering(sched)
    check_lowering(sched, fused=True)


# A hand-made bad lowering of a 2-stage plan (stage 0: F0 F1 B0 W0 B1 W1, stage 1: F0 B0 W0 F1 B1
# W1): each stage posts one receive only after a send whose receive the other stage posts late.
BAD = [
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0W0 0RECV_B1 0B1 0W1",
    "1RECV_F0 1F0 1B0 1SEND_B0 1W0 1RECV_F1 1F1 1B1 1SEND_B1 1W1",
]


def test_blocking_sends_deadlock_is_reported_naming_stages_ops_and_needs():
    # Stage 0 blocks in 0SEND_F1 until stage 1 posts 1RECV_F1, which stage 1 does only after its
    # 1SEND_B0 completed, which needs stage 0's 0RECV_B0, posted after 0SEND_F1: a cycle.
    with pytest.raises(Deadlock) as e:
        dry_run(streams_of(BAD), blocking_sends=True)
    assert str(e.value) == (
        "deadlock: stage 0 waits at 0SEND_F1 (needs 1RECV_F1), stage 1 waits at 1SEND_B0 (needs 0RECV_B0)"
    )


def test_the_same_stream_runs_with_nonblocking_sends():
    dry_run(streams_of(BAD))  # isend: nobody waits for a posted receive


def test_a_consumer_that_waits_on_a_send_never_issued_is_a_deadlock():
    # stage 0 wants B0's gradient before it sends F0; stage 1 sends that gradient only after F0.
    streams = streams_of([
        "0RECV_B0 0B0 0F0 0SEND_F0 0W0",
        "1RECV_F0 1F0 1B0 1SEND_B0 1W0",
    ])
    with pytest.raises(Deadlock, match=r"^deadlock: stage 0 waits at 0B0 \(needs 1SEND_B0\), "
                                       r"stage 1 waits at 1F0 \(needs 0SEND_F0\)$"):
        dry_run(streams)


@pytest.mark.parametrize("lines,match", [
    (["0F0 0SEND_F0 0RECV_B0 0B0 0W0", "1F0 1RECV_F0 1B0 1SEND_B0 1W0"],
     "stage 1: 1F0 consumes a tensor whose receive 1RECV_F0 is not posted before it"),
    (["0F0 0SEND_F0 0B0 0W0", "1RECV_F0 1F0 1B0 1W0"], "stage 0: 0B0 consumes a tensor whose receive 0RECV_B0"),
    (["0F0 0SEND_F0 0SEND_F0", "1RECV_F0 1F0"], "stage 0: 0SEND_F0 appears twice"),
    (["0SEND_F0 0F0", "1RECV_F0 1F0"], "stage 0: 0SEND_F0 sends before 0F0 produced it"),
    (["0F0 0SEND_F0", "1F0"], "stage 1: 1F0 consumes"),
    (["0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F0 1F0"], "stage 0: 0SEND_F1 has no receive: stage 1 never posts 1RECV_F1"),
    (["0F0 0SEND_F0", "1RECV_F0 1RECV_F1 1F0"], "stage 1: 1RECV_F1 is never sent"),
    (["0F0", "0F1"], "rank 1: 0F1 belongs to stage 0"),
    (["0F0 0SEND_B0"], "talks to stage -1"),
])
def test_malformed_streams_are_named(lines, match):
    with pytest.raises(BadStream, match=match):
        dry_run(streams_of(lines))


def test_messages_matched_in_order_must_be_received_in_the_order_they_are_sent():
    lines = ["0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F1 1RECV_F0 1F0 1F1"]
    dry_run(streams_of(lines))  # matched by tag: fine
    with pytest.raises(BadStream, match="stage 1: its receive #0 from stage 0 is 1RECV_F1 but stage 0 sends 0SEND_F0"):
        dry_run(streams_of(lines), ordered_channels=True)


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_receive_window_bounds_outstanding_receives_and_still_runs(window):
    rng = random.Random(window)
    for i in range(60):
        S, N = rng.randint(2, 5), rng.randint(1, 9)
        if i % 2:  # zero-bubble plans: every stage consumes in the order its neighbours produce
            plan = list_schedule(Costs.uniform(S), N, initial_warmup([rng.randint(1, N) for _ in range(S)]))
        else:  # random valid plans: consumed out of the producers' order too
            plan, _ = randplans.random_plan(S, N, random.Random(rng.random()))
        windowed, upfront = lower(plan, recv_window=window), lower(plan)
        dry_run(windowed)
        dry_run(windowed, ordered_channels=True)
        for s in range(S):
            # the same ops, only the receives moved: same compute order, same sends, same receives
            assert sorted(map(str, windowed[s])) == sorted(map(str, upfront[s]))
            assert [o for o in windowed[s] if not o.kind.startswith("RECV")] == \
                [o for o in upfront[s] if not o.kind.startswith("RECV")]
            for kind, consumer in (("RECV_F", "F"), ("RECV_B", "B")):
                posted = used = peak = 0
                for op in windowed[s]:
                    if op.kind == kind:
                        posted += 1
                    elif op.kind == consumer and ((kind == "RECV_F" and s > 0) or (kind == "RECV_B" and s < S - 1)):
                        assert posted > used, f"stage {s}: {op} before its receive is posted"
                        used += 1
                    peak = max(peak, posted - used)
                # beyond the window only as far as consuming out of the producers' order needs
                order = [op.mb for op in upfront[s] if op.kind == kind]
                if not order:
                    assert peak == 0
                    continue
                consumed = [op.mb for op in plan[s] if op.kind == consumer]
                need = max(order.index(m) + 1 - j for j, m in enumerate(consumed))
                assert peak <= max(window, need)


def test_a_window_below_one_is_refused():
    with pytest.raises(ValueError, match="recv_window"):
        lower([[Op("F", 0), Op("B", 0), Op("W", 0)]], recv_window=0)


# -- the one lowering policy ---------------------------------------------------------------------

def test_the_policy_posts_one_receive_ahead_by_default_and_a_plan_file_may_say_otherwise(tmp_path):
    from ds_pipemorph.plan.files.planfile import PlanFile
    from ds_pipemorph.plan.ir.lower import RECV_WINDOW, LoweringPolicy

    plan = zb_h1(Costs.uniform(3), 6)
    assert RECV_WINDOW == 1 and LoweringPolicy() == LoweringPolicy(recv_window=1, fused=False)
    assert LoweringPolicy().lower(plan) == lower(plan, recv_window=1)
    # stage 1 of ZB-H1 posts F0's and B0's receives before its first op, one of each kind; F1's
    # once F0 has consumed its own (after F0's send)
    assert LoweringPolicy().lines(plan)[1].split()[:5] == ["1RECV_F0", "1RECV_B0", "1F0", "1SEND_F0", "1RECV_F1"]
    # a window of 2: two of each kind
    assert LoweringPolicy(recv_window=2).lines(plan)[1].split()[:5] == ["1RECV_F0", "1RECV_F1", "1RECV_B0",
                                                                        "1RECV_B1", "1F0"]
    # ready dispatch: every receive of the iteration up front, the rest unchanged
    ready = LoweringPolicy().for_dispatch("ready")
    assert ready == LoweringPolicy(recv_window=None) and ready.lower(plan) == lower(plan)
    assert LoweringPolicy(recv_window=5).for_dispatch("ordered") == LoweringPolicy(recv_window=5)
    with pytest.raises(ValueError, match="recv_window"):
        LoweringPolicy(recv_window=0)
    with pytest.raises(ValueError, match="dispatch"):
        LoweringPolicy().for_dispatch("eager")

    base = {"version": 1, "stages": 3, "microbatches": 6, "warmup": [3, 2, 1],
            "schedule": [[str(op) for op in row] for row in plan]}
    path = tmp_path / "p.json"
    import json

    path.write_text(json.dumps(base))
    assert PlanFile.read(path)[0].lowering == LoweringPolicy()  # a file without the field
    path.write_text(json.dumps({**base, "recv_window": 3, "backward": "fused"}))
    assert PlanFile.read(path)[0].lowering == LoweringPolicy(recv_window=3, fused=True)
    path.write_text(json.dumps({**base, "recv_window": 0}))
    from ds_pipemorph.fileio import BadInput

    with pytest.raises(BadInput, match="recv_window"):
        PlanFile.read(path)


def test_a_policy_lowering_that_cannot_run_raises_bad_stream():
    from ds_pipemorph.plan.ir.lower import LoweringPolicy

    # stage 0 waits at B0 for stage 1's gradient, stage 1 at F0 for stage 0's activation
    stuck = [[Op("B", 0), Op("F", 0), Op("W", 0)], [Op("F", 0), Op("B", 0), Op("W", 0)]]
    with pytest.raises(Deadlock, match="stage 0 waits at 0B0 .needs 1SEND_B0., stage 1 waits at 1F0"):
        LoweringPolicy().lower(stuck)
