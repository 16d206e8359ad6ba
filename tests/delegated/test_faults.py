"""Failover (PipeMorph §5.3): a broken direct link and a killed delegate lose and duplicate nothing."""
import bodies
import pytest
from workers import launch

N, ITERS = 6, 2


@pytest.mark.timeout(150)
def test_direct_link_failure_moves_the_link_to_delegates_and_every_message_arrives_once():
    res = launch(2, bodies.faulty, "auto", {"link_fails_after": {0: 4}}, 0.0, ITERS, N, 1)
    for r in (0, 1):
        assert res[r]["ok"] == [True] * (ITERS * N)
        assert res[r]["modes"] == {"F": "delegated", "B": "delegated"}
        assert res[r]["leftovers"] == 0
        assert any("link 0 direct path failed" in e for e in res[r]["events"]), res[r]["events"]
    # Messages 5..12 of each direction went through the delegates, each exactly once.
    assert res[0]["seqs"]["Fs"] == res[1]["seqs"]["Fr"] == ITERS * N - 4
    assert res[1]["seqs"]["Bs"] == res[0]["seqs"]["Br"] == ITERS * N - 4


@pytest.mark.timeout(150)
def test_killed_sender_delegate_is_restarted_and_unacknowledged_messages_are_resent_once():
    # 20 ms per message keeps messages in flight when the delegate is killed after the 3rd send.
    res = launch(2, bodies.faulty, "always", {"kill_delegate": (0, 3)}, 20.0, ITERS, N)
    for r in (0, 1):
        assert res[r]["ok"] == [True] * (ITERS * N)
        assert res[r]["leftovers"] == 0
    ev = res[0]["events"]
    assert any("killed the sender delegate" in e for e in ev), ev
    assert any("link 0: sender delegate of F queue 0" in e and "restarted" in e for e in ev), ev
    assert res[0]["seqs"]["Fs"] == res[1]["seqs"]["Fr"] == ITERS * N


@pytest.mark.timeout(150)
def test_delegate_killed_before_its_pair_met_is_replaced_on_both_ends():
    # The receiver delegate then waits in the Gloo rendezvous for a peer that is gone; its watchdog
    # must see the replacement's generation so that both ends restart. The transport's timeout
    # (600 s) is beyond this test's own (150 s): only the watchdog (or a refused connection) can
    # end the wait in time, and the test's timeout is the one bound on time.
    res = launch(2, bodies.killed_before_meeting, 4, 600.0)
    for r in (0, 1):
        assert res[r]["ok"] == [True] * 4
    assert any("sender delegate of F queue 0" in e and "restarted it as generation 1" in e for e in res[0]["events"])
    # It left the rendezvous either through its watchdog ("lost its peer": the replacement announced
    # generation 1) or, if the dead sender had published its address, through a refused connection.
    assert any("receiver delegate of F queue 0" in e and "restarted it as generation 1" in e
               for e in res[1]["events"]), res[1]["events"]


@pytest.mark.timeout(150)
def test_killed_receiver_delegate_is_restarted_and_nothing_is_lost_or_duplicated():
    res = launch(2, bodies.faulty, "always", {"kill_delegate": (0, 2), "kill_side": "recv"}, 20.0, ITERS, N)
    for r in (0, 1):
        assert res[r]["ok"] == [True] * (ITERS * N)
        assert res[r]["leftovers"] == 0
    ev = res[1]["events"]
    assert any("killed the receiver delegate" in e for e in ev), ev
    assert any("link 0: receiver delegate of F queue 0" in e and "restarted" in e for e in ev), ev
    assert res[0]["seqs"]["Fs"] == res[1]["seqs"]["Fr"] == ITERS * N


@pytest.mark.timeout(150)
def test_delayed_link_failing_in_the_delivery_thread_fails_over_at_once_on_both_ends():
    # 15 ms on link 0, so the real send happens in the delay's delivery thread, and it fails for the last
    # F (and B) message of the first iteration. Right after sending F5, stage 0 waits for B0..B5, and
    # stage 1 sends B5 only once F5 arrived: F5 must be re-sent through the delegates from the delivery
    # thread itself (at stage 0's next call it would be too late: both ends would wait until timeout).
    res = launch(2, bodies.faulty, "auto", {"link_fails_after": {0: 5}}, 15.0, ITERS, N, 1)
    for r, kind in ((0, "F"), (1, "B")):
        assert res[r]["ok"] == [True] * (ITERS * N)
        assert res[r]["modes"] == {"F": "delegated", "B": "delegated"}
        assert res[r]["leftovers"] == 0
        sent = [e for e in res[r]["events"] if f"direct path failed at SEND_{kind}5" in e]
        assert len(sent) == 1 and "in the delivery thread" in sent[0], res[r]["events"]
    assert res[0]["seqs"]["Fs"] == res[1]["seqs"]["Fr"] == ITERS * N - 5
    assert res[1]["seqs"]["Bs"] == res[0]["seqs"]["Br"] == ITERS * N - 5
