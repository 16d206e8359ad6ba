"""Restarts converge on both ends, wherever a delegate dies in the exchange, on a busy host; a busy host
restarts nothing; a rank closing while its peer is not done neither loses an acknowledgement nor
leaves its peer waiting until its timeout.

Every test runs beside two CPU-bound processes (``cpu_burners``): on 2 cores each process of the job
then gets a CPU about half the time.
"""
import bodies  # noqa: F401  (workers' sibling modules import each other by name)
import pytest
import restart_bodies
from workers import launch

from ds_pipemorph.runtime.transport.delegated.delegate_proc import RECV_POINTS, SEND_POINTS

N = 4
CASES = [("send", p, 1) for p in SEND_POINTS] + [("recv", p, 1) for p in RECV_POINTS]

pytestmark = pytest.mark.alone  # two burners and the job: no other test's job beside them


@pytest.mark.timeout(900)
def test_a_delegate_killed_at_any_point_of_the_exchange_is_restarted_on_both_ends_and_loses_nothing(cpu_burners):
    res = launch(2, restart_bodies.forced_restarts, CASES, N, timeout=850.0)
    for i, (role, point, _) in enumerate(CASES):
        r0, r1 = res[0][i], res[1][i]
        case = r0["case"]
        for r in (r0, r1):
            assert r["ok"] == [True] * N, (case, r)
        # Every message of each direction was taken once, in order.
        assert r0["seqs"]["Fs"] == r1["seqs"]["Fr"] == N, case
        assert r1["seqs"]["Bs"] == r0["seqs"]["Br"] == N, case
        # The killed delegate's end restarted it as generation 1; its peer's end met it there: one
        # restart per end of the F direction, none of the B direction, none beyond generation 1.
        killed, other = (r0, r1) if role == "send" else (r1, r0)
        assert killed["born"]["F" + role[0]] == 1, (case, killed["events"])
        peer_role = "r" if role == "send" else "s"
        assert other["born"]["F" + peer_role] == 1, (case, other["events"], killed["events"])
        assert len(killed["events"]) == 1 and "F queue 0" in killed["events"][0], (case, killed["events"])
        assert len(other["events"]) == 1 and "F queue 0" in other["events"][0], (case, other["events"])
        assert all(b == 0 for k, b in r0["born"].items() if k.startswith("B")), case
        assert all(b == 0 for k, b in r1["born"].items() if k.startswith("B")), case
        # Far from the transport's timeout (60 s): nothing waited for a deadline.
        assert r0["took"] < 45 and r1["took"] < 45, (case, r0["took"], r1["took"])


@pytest.mark.timeout(300)
def test_closing_right_after_the_last_message_or_before_it_is_taken_is_neither_a_loss_nor_a_hang(cpu_burners):
    res = launch(2, restart_bodies.close_races, N, 1.5, timeout=280.0)
    r0, r1 = res[0], res[1]
    assert r0["ok"] == r1["ok"] == [True] * N
    # Stage 0 closed while its delegate still owed the last acknowledgement: it was sent, and no end
    # took the closed connection for a lost peer.
    assert r0["first"]["events"] == [] and r1["first"]["events"] == [], (r0["first"], r1["first"])
    # Stage 0 closed before the last B was sent: stage 1 is told so at once, nothing restarts.
    assert r1["refused"] is not None and "closed its end of link 0 first" in r1["refused"], r1["refused"]
    assert "SEND_B3" in r1["refused"], r1["refused"]
    assert r1["refused_after_s"] < 15, r1["refused_after_s"]
    assert r0["second"]["events"] == [] and r1["second"]["events"] == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_hundred_iterations_beside_two_burners_restart_no_delegate(cpu_burners):
    iterations = 200
    res = launch(2, restart_bodies.busy_iterations, iterations, 6, timeout=850.0)
    for r in (0, 1):
        assert res[r]["bad"] == 0
        assert res[r]["events"] == [], res[r]["events"]
        assert res[r]["duplicates"] == 0
        assert all(b == 0 for b in res[r]["born"].values()), res[r]["born"]
    assert res[0]["seqs"]["Fs"] == res[1]["seqs"]["Fr"] == iterations * 6
