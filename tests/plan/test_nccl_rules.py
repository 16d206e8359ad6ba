"""NCCL's in-order point-to-point rules: the dry run (``plan.ir.nccl``) on hand-written streams, the
lowering that passes it (``plan.ir.nccl_lowering``) and the lowering that does not (``lower``).

Expected streams and messages below are derived by hand in the comments. Shorthand: "rank r's
stream with p" is the serial queue of r's sends to and receives from p, in issue order."""
import importlib.util
import random
from pathlib import Path

import pytest

from ds_pipemorph.plan.ir.lower import BadStream, Deadlock, LoweringPolicy, dry_run, format_streams
from ds_pipemorph.plan.ir.nccl import nccl_dry_run, nccl_groups
from ds_pipemorph.plan.ir.nccl_lowering import NcclLowering, lower_nccl
from ds_pipemorph.plan.ir.ops import Op, parse_op
from ds_pipemorph.plan.ir.profile import Costs
from ds_pipemorph.plan.sched.baselines import deepspeed_1f1b, zb_h1

_spec = importlib.util.spec_from_file_location("randplans", Path(__file__).parents[1] / "runtime" / "randplans.py")
randplans = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(randplans)


def streams_of(lines):
    return [[parse_op(t) for t in line.split()] for line in lines]


def texts(matches):
    return [f"{send} {recv}" for send, recv in matches]


# --- the dry run on hand-written streams ---------------------------------------------------------

# Two stages, two micro-batches; each rank sends to the other before it receives from it.
EXCHANGE = [
    "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0RECV_B1 0B1",
    "1RECV_F0 1F0 1B0 1SEND_B0 1RECV_F1 1F1 1B1 1SEND_B1",
]


def test_two_ranks_that_each_send_first_without_a_group_deadlock():
    # F0 matches first (head of both streams). Then rank 0's stream with 1 is 0SEND_F1, 0RECV_B0 and
    # rank 1's is 1SEND_B0, 1RECV_F1: both heads are sends, each needs the receive queued behind
    # the other's send. Host 0 issued everything up to 0B0 and waits there; host 1 passed 1B0 (the
    # last stage consumes no gradient) and waits at 1F1.
    with pytest.raises(Deadlock) as e:
        nccl_dry_run(streams_of(EXCHANGE))
    assert str(e.value) == (
        "deadlock under NCCL's ordering: "
        "stage 0 waits at 0B0 for 0RECV_B0, queued behind 0SEND_F1 (needs 1RECV_F1, queued behind 1SEND_B0); "
        "stage 1 waits at 1F1 for 1RECV_F1, queued behind 1SEND_B0 (needs 0RECV_B0, queued behind 0SEND_F1)"
    )
    dry_run(streams_of(EXCHANGE))  # a tagged transport with non-blocking sends runs it


def test_a_group_on_either_rank_resolves_the_exchange():
    # Rank 0 grouping 0SEND_F1 with 0RECV_B0 (indices 3, 4): 0RECV_B0 is at the head with it and
    # meets 1SEND_B0, then 1RECV_F1 reaches rank 1's head and meets 0SEND_F1: F0, B0, F1, B1.
    assert texts(nccl_dry_run(streams_of(EXCHANGE), groups=[[range(3, 5)], []])) == [
        "0SEND_F0 1RECV_F0", "1SEND_B0 0RECV_B0", "0SEND_F1 1RECV_F1", "1SEND_B1 0RECV_B1"]
    # Rank 1 grouping 1SEND_B0 with 1RECV_F1 (indices 3, 4): 0SEND_F1 meets 1RECV_F1 first.
    assert texts(nccl_dry_run(streams_of(EXCHANGE), groups=[[], [range(3, 5)]])) == [
        "0SEND_F0 1RECV_F0", "0SEND_F1 1RECV_F1", "1SEND_B0 0RECV_B0", "1SEND_B1 0RECV_B1"]
    # nccl_groups finds both runs: the only adjacent send/receive pairs with one peer
    assert nccl_groups(streams_of(EXCHANGE)) == [[range(3, 5)], [range(3, 5)]]


def test_receives_posted_ahead_deadlock_at_the_head_of_both_streams():
    # LoweringPolicy(recv_window=1) on 2 stages x 1 micro-batch (its own docstring's example). Rank
    # 0's stream with 1: 0RECV_B0, 0SEND_F0; rank 1's: 1RECV_F0, 1SEND_B0. Both heads are receives,
    # each waiting for a send queued behind the other's head. Host 0 passes 0F0 (issuing 0SEND_F0)
    # and waits at 0B0; host 1 waits at 1F0, so 1SEND_B0 is never issued.
    lines = ["0RECV_B0 0F0 0SEND_F0 0B0 0W0", "1RECV_F0 1F0 1B0 1SEND_B0 1W0"]
    plan = [[Op("F", 0), Op("B", 0), Op("W", 0)]] * 2
    assert LoweringPolicy(recv_window=1).lines(plan) == lines
    with pytest.raises(Deadlock) as e:
        nccl_dry_run(streams_of(lines))
    assert str(e.value) == (
        "deadlock under NCCL's ordering: stage 0 waits at 0B0 for 0RECV_B0 (needs 1SEND_B0, not issued yet); "
        "stage 1 waits at 1F0 for 1RECV_F0 (needs 0SEND_F0, queued behind 0RECV_B0)"
    )


@pytest.mark.parametrize("policy", [LoweringPolicy(), LoweringPolicy().for_dispatch("ready")],
                         ids=["window 1", "ready"])
def test_the_default_lowering_and_ready_dispatch_deadlock_on_two_stage_1f1b(policy):
    # deepspeed_1f1b(2, 2): stage 0 F0 F1 B0 W0 B1 W1, stage 1 F0 B0 W0 F1 B1 W1. The default window
    # posts one receive of each kind up front, ready dispatch all of them: rank 0 issues 0RECV_B0
    # first and its sends queue behind it; rank 1 issues 1RECV_F0 and waits at 1F0. The pair's heads
    # are two receives.
    with pytest.raises(Deadlock) as e:
        nccl_dry_run(policy.lower(deepspeed_1f1b(2, 2)))
    assert str(e.value) == (
        "deadlock under NCCL's ordering: stage 0 waits at 0B0 for 0RECV_B0 (needs 1SEND_B0, not issued yet); "
        "stage 1 waits at 1F0 for 1RECV_F0 (needs 0SEND_F0, queued behind 0RECV_B0)"
    )


def test_the_kth_send_meets_the_kth_receive_whatever_the_tags():
    lines = ["0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F1 1RECV_F0 1F1 1F0"]
    dry_run(streams_of(lines))  # matched by tag: fine
    with pytest.raises(BadStream, match=r"^stage 1's receive no. 1 from stage 0 is 1RECV_F1 but stage 0's send no. 1"
                                        r" to it is 0SEND_F0 \(NCCL matches"):
        nccl_dry_run(streams_of(lines))


def test_a_wait_for_a_send_never_issued_names_both_stages():
    # Stage 0 waits for B0's gradient before it sends F0; stage 1 sends it only after F0. Both
    # receives head their streams; neither send is ever issued.
    lines = ["0F0 0RECV_B0 0B0 0SEND_F0", "1RECV_F0 1F0 1B0 1SEND_B0"]
    with pytest.raises(Deadlock) as e:
        nccl_dry_run(streams_of(lines))
    assert str(e.value) == (
        "deadlock under NCCL's ordering: stage 0 waits at 0B0 for 0RECV_B0 (needs 1SEND_B0, not issued yet); "
        "stage 1 waits at 1F0 for 1RECV_F0 (needs 0SEND_F0, not issued yet)"
    )


def test_a_stage_whose_host_finished_still_waits_for_its_queued_sends():
    # 3 stages. Rank 1 issues 1SEND_F0 then 1RECV_B9 (never consumed) and reaches its end; rank 2
    # issues 2SEND_B9 then 2RECV_F0 and waits at 2F0. Both streams of the pair (1, 2) start with a
    # send whose receive is queued behind the other's head; rank 0 finished.
    lines = ["0F0 0SEND_F0", "1RECV_F0 1F0 1SEND_F0 1RECV_B9", "2B9 2SEND_B9 2RECV_F0 2F0"]
    with pytest.raises(Deadlock) as e:
        nccl_dry_run(streams_of(lines))
    assert str(e.value) == (
        "deadlock under NCCL's ordering: "
        "stage 1 waits at the end of the iteration for 1SEND_F0 (needs 2RECV_F0, queued behind 2SEND_B9); "
        "stage 2 waits at 2F0 for 2RECV_F0, queued behind 2SEND_B9 (needs 1RECV_B9, queued behind 1SEND_F0)"
    )


@pytest.mark.parametrize("lines,match", [
    (["0F0 0RECV_B0 0B0", "1RECV_F0 1F0 1B0 1SEND_B0"],
     "stage 1: 1RECV_F0 is never matched: stage 0 sends 0 messages to stage 1, which posts 1 receives from it"),
    (["0SEND_F0 0F0", "1RECV_F0 1F0"], "stage 0: 0SEND_F0 sends before 0F0 produced it"),
    (["0F0 0SEND_F0", "1F0 1RECV_F0"], "stage 1: 1F0 consumes a tensor whose receive 1RECV_F0 is not posted before it"),
    (["0F0 0SEND_F0 0SEND_F0", "1RECV_F0 1F0"], "stage 0: 0SEND_F0 appears twice"),
    (["0F0", "0F1"], "rank 1: 0F1 belongs to stage 0"),
])
def test_malformed_streams_are_named(lines, match):
    with pytest.raises(BadStream, match=match):
        nccl_dry_run(streams_of(lines))


@pytest.mark.parametrize("groups,match", [
    ([[range(1, 3)], []], "stage 0: a group holds sends and receives with one peer, not 0SEND_F0 0F1"),
    ([[range(1, 2), range(1, 2)], []], "rank 0: group range"),
    ([[range(3, 9)], []], "leaves the stream"),
    ([[]], "groups are given for 1 ranks, the streams are 2"),
])
def test_malformed_groups_are_named(groups, match):
    with pytest.raises(BadStream, match=match):
        nccl_dry_run(streams_of(["0F0 0SEND_F0 0F1 0SEND_F1", "1RECV_F0 1RECV_F1 1F0 1F1"]), groups=groups)


# --- the lowering for NCCL ----------------------------------------------------------------------

def test_two_stage_1f1b_lowers_to_the_streams_written_out():
    # deepspeed_1f1b(2, 2): stage 0 F0 F1 B0 W0 B1 W1, stage 1 F0 B0 W0 F1 B1 W1. The unit-time run:
    # step 0: 0F0; step 1: 0F1, 1F0; step 2: 1B0; step 3: 0B0, 1W0; step 4: 0W0, 1F1; step 5: 1B1;
    # ... so the pair's messages go F0, F1, B0, B1. Stage 1 must post 1RECV_F1 before its 1SEND_B0
    # (the run makes F1 first): right before that send, after its producer. Stage 0 posts each
    # gradient receive right before its B; its 0SEND_F1 and 0RECV_B0 are adjacent: one group.
    sched = deepspeed_1f1b(2, 2)
    split = lower_nccl(sched)
    assert format_streams(split) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0W0 0RECV_B1 0B1 0W1",
        "1RECV_F0 1F0 1B0 1RECV_F1 1SEND_B0 1W0 1F1 1B1 1SEND_B1 1W1",
    ]
    assert nccl_groups(split) == [[range(3, 5)], [range(3, 5)]]
    # fused: the gradient of B0 leaves after W0, so the receive of F1 moves past W0 with it
    assert NcclLowering(fused=True).lines(sched) == [
        "0F0 0SEND_F0 0F1 0SEND_F1 0RECV_B0 0B0 0W0 0RECV_B1 0B1 0W1",
        "1RECV_F0 1F0 1B0 1W0 1RECV_F1 1SEND_B0 1F1 1B1 1W1 1SEND_B1",
    ]
    for streams in (split, lower_nccl(sched, True)):  # in the pair's order, with or without groups
        order = ["0SEND_F0 1RECV_F0", "0SEND_F1 1RECV_F1", "1SEND_B0 0RECV_B0", "1SEND_B1 0RECV_B1"]
        assert texts(nccl_dry_run(streams)) == order
        assert texts(nccl_dry_run(streams, groups=nccl_groups(streams))) == order


def test_a_plan_that_cannot_run_is_refused():
    # stage 0 wants B0's gradient before it sends F0; stage 1 sends that gradient only after F0
    plan = [[Op("B", 0), Op("F", 0), Op("W", 0)], [Op("F", 0), Op("B", 0), Op("W", 0)]]
    with pytest.raises(Deadlock, match=r"^the plan cannot run: stage 0 waits at 0B0 for 1SEND_B0, "
                                       r"stage 1 waits at 1F0 for 0SEND_F0$"):
        lower_nccl(plan)


def test_ready_dispatch_is_refused_with_nccl():
    assert NcclLowering().for_dispatch("ordered") == NcclLowering()
    with pytest.raises(ValueError, match="with NCCL, dispatch is 'ordered', not 'ready'"):
        NcclLowering().for_dispatch("ready")


def plan_families(random_per_shape: int, seed: int = 0):
    """(name, plan) for 2-8 stages x 1-16 micro-batches: DeepSpeed's 1F1B, ZB-H1, random valid plans."""
    rng = random.Random(seed)
    for S in range(2, 9):
        for N in range(1, 17):
            yield f"1f1b {S}x{N}", deepspeed_1f1b(S, N)
            yield f"zb_h1 {S}x{N}", zb_h1(Costs.uniform(S), N)
            for k in range(random_per_shape):
                yield f"random {S}x{N} #{k}", randplans.random_plan(S, N, random.Random(rng.random()))[0]


def check_nccl_lowering(sched, fused):
    """What the lowering promises, read off the streams, then the dry runs (NCCL's, with and
    without groups, and the tagged one with blocking sends)."""
    S, streams = len(sched), lower_nccl(sched, fused)
    for s, (row, stream) in enumerate(zip(sched, streams)):
        assert [op.local() for op in stream if op.is_compute] == row  # the plan's order, untouched
        for i, op in enumerate(stream):
            if op.kind.is_send:  # after its producer, with at most receives from the same peer between
                j = i - 1
                while stream[j].kind.is_recv and stream[j].peer == op.peer:
                    j -= 1
                assert stream[j] in (Op(op.kind[-1], op.mb, s), fused and Op("W", op.mb, s))
        if s > 0:  # receives from each neighbour in the order it sends
            assert [op.mb for op in stream if op.kind == "RECV_F"] == [op.mb for op in sched[s - 1] if op.kind == "F"]
        if s < S - 1:
            sent = [op.mb for op in streams[s + 1] if op.kind == "SEND_B"]
            assert [op.mb for op in stream if op.kind == "RECV_B"] == sent
    nccl_dry_run(streams)
    nccl_dry_run(streams, groups=nccl_groups(streams))
    dry_run(streams, blocking_sends=True, ordered_channels=True)


@pytest.mark.parametrize("fused", [False, True])
def test_every_plan_family_lowers_to_streams_nccl_runs(fused):
    for name, sched in plan_families(random_per_shape=2, seed=int(fused)):
        try:
            check_nccl_lowering(sched, fused)
        except (AssertionError, BadStream) as e:
            raise AssertionError(f"{name}, fused={fused}: {e}") from e


def test_receives_posted_ahead_deadlock_under_nccl_on_every_plan_family():
    # Whatever the plan, stages 0 and 1 both start with receives from each other (0RECV_B..., then
    # 1RECV_F...) with the default window or every receive up front (ready dispatch): the heads of the
    # pair's two streams are receives, so neither ever meets its send.
    for i, (name, sched) in enumerate(plan_families(random_per_shape=1, seed=2)):
        if i % 3:
            continue
        for policy in (LoweringPolicy(), LoweringPolicy().for_dispatch("ready"), LoweringPolicy(fused=True)):
            with pytest.raises(Deadlock, match="stage 0 waits at .* for 0RECV_B.* stage 1 waits at"):
                nccl_dry_run(policy.lower(sched))
